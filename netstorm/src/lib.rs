//! NetStorm (../shared/papers/netstorm.txt) for gradwire: the scheduler's algorithms and the
//! nodes' protocol state machines, with no I/O, no clocks and no threads, so that they are
//! tested exhaustively and fuzzed without a network.
//!
//! - [`config`]: Table I and Table II's options with the paper's defaults.
//! - [`graph`]: the overlay network (sites, links, measured throughput -> transfer delay).
//! - [`fapt`]: Algorithm 1 (quality scores, the root set, fastest aggregation paths) and
//!   Algorithm 2 (the multi-root FAPT), Theorem 1's synchronization delay.
//! - [`baselines`]: STAR, MLNET's balanced k-ary tree (BKT) and TSEngine's maximum-throughput
//!   spanning tree (MST), in the same tree type.
//! - [`aux`]: Algorithm 3, edge-disjoint auxiliary paths.
//! - [`shares`]: chunks of at most CHUNK_SIZE and their shares per root.
//! - [`awareness`]: link throughput from the training traffic itself, without synchronized
//!   clocks.
//! - [`consistency`]: versioned policies, the topology request (TRP) before each PUSH,
//!   early data cached, source-routed auxiliary chunks.
//! - [`wire`]: the scheduler's and the chunks' messages.
#![deny(unsafe_code)]

pub mod aux;
pub mod awareness;
pub mod baselines;
pub mod config;
pub mod consistency;
pub mod fapt;
pub mod graph;
pub mod shares;
pub mod wire;
