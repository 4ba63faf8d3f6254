//! NetStorm's runtime over gradwire (../shared/papers/netstorm.txt §VIII): the scheduler
//! process and the general nodes, on the pure algorithms and state machines of
//! [`gradwire_netstorm`].
//!
//! - [`channel`]: chunk channels, one directed gradwire link each, driven by a thread per
//!   direction, timing every chunk for the passive link measurement.
//! - [`sync`]: one round at one node as a state machine: aggregate-forward up each root's
//!   tree, results down, auxiliary chunks forwarded by their path.
//! - [`policy`]: the round's trees, shares and auxiliary paths.
//! - [`meta`]: chunk metadata and control messages, in NetStorm's wire format.
//! - [`control`]: the node-scheduler connection (TRP before each PUSH, link reports).
//! - [`scheduler`]: the scheduler (network collector, policy formulation, consistency).
//! - [`node`]: the node loop.
#![deny(unsafe_code)]

pub mod channel;
pub mod control;
pub mod error;
pub mod meta;
pub mod node;
pub mod plan;
pub mod policy;
pub mod scheduler;
pub mod sync;

pub use error::WanError;
