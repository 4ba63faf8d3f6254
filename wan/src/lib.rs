//! NetStorm's runtime over gradwire's message layer (../shared/papers/netstorm.txt §VIII):
//! the scheduler process and the general nodes, on the pure algorithms and state machines of
//! [`gradwire_netstorm`].
//!
//! - [`channel`]: chunk channels as messages of one `gradwire-msg` endpoint per node (one
//!   socket for every peer, no thread per link, no handshake per chunk), timing every chunk
//!   for the passive link measurement.
//! - [`policy`]: the round's chunks under its policy.
//! - [`plan`]: policy formulation for NetStorm's strategies and the baselines.
//! - [`control`]: the node-scheduler connection (TRP before each PUSH, link reports).
//! - [`scheduler`]: the scheduler (network collector, policy formulation, and the
//!   consistency module's versions and per-round pins).
//! - [`seal`]: authenticated scheduler connections (jobs with a secret): a hello, keys
//!   only that node and the scheduler can derive, a tag after every frame.
//! - [`node`]: the node loop around the consistency module's node state machine.
//! - [`workload`]: the synthetic model a WAN job synchronizes, with inputs whose exact
//!   average every node checks, element by element, each round.
//! - [`overlay`]: a WAN topology's sites and the scheduler's overlay of its inter-site links.
//! - [`site`]: one site's node from start to finish (`gradwire wan node`): every node's
//!   endpoint address by the rendezvous (`gradwire-rendezvous`), the scheduler served or
//!   reached, verified rounds, the final barrier, and
//!   its report or its failure as data.
//!
//! The protocol itself (rounds, caching, relays, pinning) is the netstorm crate's
//! model-checked [`gradwire_netstorm::consistency`]; this crate does the I/O.
#![deny(unsafe_code)]

pub mod channel;
pub mod control;
pub mod error;
pub mod node;
pub mod overlay;
pub mod plan;
pub mod policy;
pub mod scheduler;
pub mod seal;
pub mod site;
pub mod workload;

pub use error::WanError;
