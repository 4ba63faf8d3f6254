//! gradwire fabric: a software twin of a commodity switch, testbeds built from topology files,
//! and the supervision of fabrics running in the background.
//!
//! Pure cores (always built; no I/O, no clock of their own):
//!
//! - [`sched`]: the egress-port queueing core (shared buffer, 8 strict-priority queues,
//!   per-queue ECN-mark/drop thresholds, line rate, propagation delay, random loss), a
//!   function of timed arrivals;
//! - [`forward`]: L3 forwarding of one switch (parse, route, rewrite, ECMP, DSCP to queue);
//! - [`lag`]: how late departures are against the emulated clock, and when a run fell behind;
//! - [`schedule`]: link rates that change over time (which rate is in force when);
//! - [`topology`]: topology files and the plan derived from them (reading the file is the only
//!   I/O).
//!
//! The emulator (feature `emulator`, default on; needs clang and libbpf):
//!
//! - [`netns`]: a topology built as network namespaces and veths, with `gradwire-netns`;
//! - [`run`]: the fabric, every switch of a topology in one event loop over AF_XDP ports;
//! - [`stats`]: what the fabric counts ([`stats::FabricStats`]) and its stats file, written by
//!   the fabric and read back as the same type;
//! - [`supervise`]: fabrics in the background (`gradwire testbed up|down|status`, `gradwire
//!   fabric run|stats`): the process, its state files, readiness, stopping, stale state.

pub mod forward;
pub mod lag;
#[cfg(feature = "emulator")]
pub mod netns;
#[cfg(feature = "emulator")]
pub mod run;
pub mod sched;
pub mod schedule;
#[cfg(feature = "emulator")]
pub mod stats;
#[cfg(feature = "emulator")]
pub mod supervise;
pub mod topology;
