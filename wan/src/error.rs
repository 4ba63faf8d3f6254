//! The runtime's errors: each names the node, the peer or the scheduler, and what to check.

use std::net::SocketAddr;
use std::time::Duration;

/// Why a node or the scheduler failed.
#[derive(Debug, thiserror::Error)]
pub enum WanError {
    /// A chunk channel with a peer failed, or a peer sent what the round's policy forbids.
    /// A peer that failed closes its links, so the nodes whose links had closed before are
    /// named too: one of them may be the cause (a dead node whose death failed the peer).
    #[error("node {rank}: link with node {peer}: {error}{}", closed_before(.closed))]
    Peer {
        /// This node.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What happened.
        error: String,
        /// Nodes whose links to this one had closed before (finished early, or dead).
        closed: Vec<usize>,
    },
    /// A round did not finish in time: a node stopped answering, or the network is slower
    /// than the timeout allows.
    #[error(
        "node {rank}: round {round} did not finish within {timeout:?} ({pending} chunks still missing; links closed by nodes {closed:?}): a node stopped answering, or raise the timeout"
    )]
    RoundTimeout {
        /// This node.
        rank: usize,
        /// The round.
        round: u32,
        /// Chunks without their result.
        pending: usize,
        /// The timeout.
        timeout: Duration,
        /// Nodes whose links to this one closed (finished early, or dead).
        closed: Vec<usize>,
    },
    /// A peer or the scheduler broke NetStorm's protocol (a chunk from a node that is not
    /// a child in its tree, a second copy, the wrong version).
    #[error("protocol: {0}")]
    Protocol(String),
    /// The scheduler connection failed.
    #[error("scheduler at {addr}: {error}")]
    Scheduler {
        /// Its address.
        addr: SocketAddr,
        /// What happened.
        error: String,
    },
    /// Links could not be set up.
    #[error(transparent)]
    Collective(#[from] gradwire_collective::error::CollectiveError),
    /// A policy could not be formulated (a disconnected overlay, a bad root).
    #[error("policy formulation: {0}")]
    Plan(String),
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A thread could not be started, a socket not bound.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
}

/// " (links closed before by nodes [..])", or nothing when none had.
fn closed_before(closed: &[usize]) -> String {
    if closed.is_empty() {
        String::new()
    } else {
        format!(" (links closed before by nodes {closed:?})")
    }
}
