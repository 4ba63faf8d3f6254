//! gradwire's collective job, the workload behind `gradwire job worker` and `gradwire job
//! run`, on the collectives of [`gradwire_collective`]:
//!
//! - [`workload`]: each iteration all-reduces one tensor per layer of a model file, with
//!   values that are a known function of (rank, layer, element), so every element of every
//!   result is checked: exactly with `p = 0`, against the contributors the report names
//!   otherwise. A wrong result is an error, not a statistic.
//! - [`worker`]: one rank, started by whatever launcher the cluster uses (torchrun, Slurm
//!   `srun`, Open MPI `mpirun`, a PMI launcher): rank and world size from the launcher's
//!   variables, rank 0's rendezvous address from `MASTER_ADDR`/`MASTER_PORT` or the job
//!   file; every wait bounded (`--timeout`), so a dead or missing rank ends the job with an
//!   error naming it instead of a hang.
//! - [`run`]: a job file's ranks on one machine: one network namespace per host address on
//!   a private bridge (or a testbed topology's hosts with its emulated fabric), every rank
//!   its own worker process started and supervised by the one launcher of rank processes,
//!   [`gradwire_launch`], with an overall deadline and teardown on every path.
//! - [`error`]: why a worker or a run failed, each message saying what to check or do.
#![deny(unsafe_code)]

pub mod error;
pub mod run;
pub mod worker;
pub mod workload;

pub use error::Error;
pub use worker::{JobAlgorithm, JobOptions};
