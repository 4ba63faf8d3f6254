//! gradwire's collective layer: what a training job needs on top of the bounded-loss
//! transport, and the host-side communication layer of MLNET.
//!
//! - [`job`]: a job's ranks, roles, addresses and racks, from a job file or from the
//!   launcher's environment (torchrun, Slurm, Open MPI).
//! - [`rendezvous`]: ranks find each other through rank 0 (no daemon of our own).
//! - [`tree`]: MLNET aggregation/multicast trees with in-degree d (STAR, RACK, BINARY, any d),
//!   re-parenting to the grandparent, fallback to STAR.
//! - [`clock`]: the parameter server's SSP clocks (model clock = minimum worker clock; a pull
//!   is served only when `c_model >= c_worker - s`).
//! - [`aggregate`]: DLCP Appendix A's bounded-loss aggregation: each block is averaged over
//!   the ranks whose contribution to it arrived, never over the full count when some were
//!   missing; who contributed to which block is reported.
//! - [`ps`]: MLNET's parameter-server API over a tree: `push`, `pull(staleness)`, `clock`.
//! - [`algo`] and [`group`]: the collectives on the message layer (`gradwire-msg`): ring,
//!   two-phase and tree all-reduce, reduce-scatter, all-gather, broadcast, barrier and
//!   point-to-point as operations on one endpoint per rank, blocking or with handles.
//! - [`link`] and [`comm`]: one directed transport connection per pair of ranks that talk,
//!   and the operations over them on the flow transport (authenticated jobs, the parameter
//!   server, point-to-point by tensor id).
//!
//! Everything here reaches the transports only through their public APIs (`send_tensor`,
//! `recv_tensor`, the `Datapath` and `CtrlChannel` traits and the reports; the message
//! layer's `Endpoint`, `Op` and `Handle`).
#![deny(unsafe_code)]

pub mod aggregate;
pub mod algo;
pub mod clock;
pub mod comm;
pub mod deadline;
pub mod error;
pub mod group;
pub mod job;
pub mod link;
pub mod ps;
/// The rendezvous lives in its own crate (the NetStorm runtime uses it without the
/// collectives); re-exported so that `gradwire_collective::rendezvous` keeps working.
pub use gradwire_rendezvous as rendezvous;
pub mod tree;
