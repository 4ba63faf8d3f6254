//! The collective layer's errors: each says which rank or link failed and what to check.

use gradwire::transport::TransferError;

use crate::aggregate::AggregateError;
use crate::job::JobError;
use crate::rendezvous::RendezvousError;
use crate::tree::TreeError;

/// Why a collective operation or its set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// A transfer with a peer failed (the peer died, stalled, or broke the protocol).
    #[error("link with rank {peer}: {source}")]
    Link {
        /// The peer rank.
        peer: usize,
        /// What the transport reported.
        source: TransferError,
    },
    /// An algorithm needs a link the communicator was not built with.
    #[error(
        "no link from rank {from} to rank {to}: build the communicator with this algorithm's links"
    )]
    NoLink {
        /// Sending rank.
        from: usize,
        /// Receiving rank.
        to: usize,
    },
    /// A peer sent aggregation data that does not fit (forged or corrupt contributor sets).
    #[error("rank {peer} sent invalid aggregation data: {source}")]
    Aggregate {
        /// The peer rank.
        peer: usize,
        /// What was wrong.
        source: AggregateError,
    },
    /// Bad arguments or configuration.
    /// A peer of a message-layer operation sent data the operation refuses (forged or
    /// corrupt contributor sets).
    #[error("rank {peer} sent invalid aggregation data: {reason}")]
    Data {
        /// The rank.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// Set-up failed because of what a peer published (another transport or authentication).
    #[error("set-up with rank {peer}: {reason}")]
    PeerSetup {
        /// The rank.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// A peer of a message-layer operation died, hung or aborted.
    #[error("rank {peer}: {reason}")]
    Peer {
        /// The rank.
        peer: usize,
        /// What happened.
        reason: String,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Setting up links failed (addresses, sockets).
    #[error("link set-up: {0}")]
    Setup(String),
    /// The job description is invalid.
    #[error(transparent)]
    Job(#[from] JobError),
    /// The rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// A tree could not be built or repaired.
    #[error(transparent)]
    Tree(#[from] TreeError),
    /// An earlier operation of this communicator failed: its links may be mid-flow and the
    /// ranks' operation counters may differ.
    #[error("this communicator failed earlier ({0}); build a new one (new links) to go on")]
    Unusable(String),
    /// A helper thread of an operation panicked (a bug: please report it).
    #[error("an internal thread of the collective operation panicked")]
    ThreadPanicked,
}

impl CollectiveError {
    /// The error of a transfer with `peer`.
    pub fn link(peer: usize) -> impl Fn(TransferError) -> CollectiveError {
        move |source| CollectiveError::Link { peer, source }
    }
}
