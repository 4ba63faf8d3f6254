//! gradwire fabric: a software twin of a commodity switch, and testbeds built from topology
//! files.
//!
//! - [`sched`]: the egress-port queueing core (shared buffer, 8 strict-priority queues,
//!   per-queue ECN-mark/drop thresholds, line rate, propagation delay, random loss). A pure
//!   function of timed arrivals: no I/O, no clock of its own.

pub mod forward;
#[cfg(feature = "emulator")]
pub mod netns;
#[cfg(feature = "emulator")]
pub mod run;
pub mod sched;
pub mod topology;
