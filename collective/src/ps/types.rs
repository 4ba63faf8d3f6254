//! The parameter server's configuration, errors and reports.

use std::time::Duration;

use gradwire::message::LossBound;
use gradwire::transport::TransferConfig;

use crate::aggregate::Contributors;
use crate::error::CollectiveError;

/// How a parameter-server node runs.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// Staleness threshold `s` of a pull that names none (0: synchronous).
    pub staleness: u64,
    /// The server's update: `w -= learning_rate * average gradient`.
    pub learning_rate: f32,
    /// End-to-end loss bound of gradients and weights (split over the tree's hops).
    pub loss_bound: LossBound,
    /// Transport configuration of the set-up's address exchange over the links; its `mtu`
    /// also sets the message layer's segment size (and so the default block).
    pub transfer: TransferConfig,
    /// Longest wait of a blocking call (pull, wait_clock, each phase of shutdown).
    pub op_timeout: Duration,
    /// Period of the heartbeats on every idle link (default 200 ms).
    pub heartbeat: Duration,
    /// Silence after which a link's peer counts as dead (default 1 s; it is also the connect
    /// timeout of the set-up's address exchange; the message layer's peer timeout is twice
    /// it, at least `transfer.idle_timeout`).
    /// Must exceed `heartbeat`.
    pub failure_timeout: Duration,
    /// Route around failed workers (MLNET §3.1, default true): the root declares a rank
    /// dead when its link fails or stays silent for `failure_timeout`, and the tree is
    /// repaired ([`repaired_tree`](super::repaired_tree)). Needs the links of [`fault_tolerant_edges`](super::fault_tolerant_edges). Off: a
    /// failed rank is an error at every rank.
    pub reroute: bool,
    /// Failures repaired by re-attaching children to their grandparent (default 1); one
    /// more and the job falls back to STAR (every worker a child of the server).
    pub max_reparents: usize,
    /// Elements per aggregation block; `None`: exactly one transport segment.
    pub block_elems: Option<usize>,
    /// Testing: the node's endpoint drops this fraction of the data segments arriving at it
    /// (default 0).
    pub inject_loss: f64,
    /// The server keeps the contributor sets of its last `keep_updates` updates (returned in
    /// [`PsStats::updates`]); 0: none.
    pub keep_updates: usize,
    /// Every worker below the server's children checks each weights version against the
    /// server's digest of it (SHA-256), sent to it directly, before it takes the version:
    /// an aggregator that changed a version it passed down is an error naming it, and no
    /// pull ever returns such a version (default false). Needs the links between the
    /// server and every member ([`fault_tolerant_edges`](super::fault_tolerant_edges)) and
    /// a reliable server (`loss_bound` 0: a bounded version is merged block by block).
    pub verify_versions: bool,
}

impl Default for PsConfig {
    fn default() -> Self {
        PsConfig {
            staleness: 0,
            learning_rate: 0.1,
            loss_bound: LossBound::RELIABLE,
            transfer: TransferConfig::default(),
            op_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_millis(200),
            failure_timeout: Duration::from_secs(1),
            reroute: true,
            max_reparents: 1,
            block_elems: None,
            keep_updates: 0,
            inject_loss: 0.0,
            verify_versions: false,
        }
    }
}

/// What a pull returned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PullReport {
    /// Clock (version) of the weights returned.
    pub weights_clock: u64,
    /// Answered from the cache at once, without waiting for a newer version.
    pub served_from_cache: bool,
    /// Time spent waiting for a new enough version.
    pub waited: Duration,
    /// Fraction of the blocks that hold exactly version `weights_clock` (the others kept
    /// older values because that version's block was lost on the way); 1.0 when `p = 0`.
    pub delivered_fraction: f64,
}

/// One update the server applied.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateRecord {
    /// The clock whose gradients were applied (the weights became version `clock + 1`).
    pub clock: u64,
    /// Which workers' gradients are averaged in each block.
    pub contributors: Contributors,
    /// Blocks with every worker's gradient.
    pub complete_blocks: usize,
    /// Mean over blocks of the fraction of workers summed in the block.
    pub delivered_fraction: f64,
}

/// What a node did, returned by [`PsNode::shutdown`](super::PsNode::shutdown).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PsStats {
    /// This rank.
    pub rank: usize,
    /// Whether this is the server (the tree's root).
    pub server: bool,
    /// The newest weights version this node holds.
    pub model_clock: u64,
    /// The worker's clock (0 at the server).
    pub worker_clock: u64,
    /// Gradients pushed through the API.
    pub pushes: u64,
    /// Clocks ended without a push (an empty contribution).
    pub empty_clocks: u64,
    /// Pulls answered.
    pub pulls: u64,
    /// Pulls answered without waiting.
    pub pulls_from_cache: u64,
    /// Sums sent to the parent.
    pub sums_sent: u64,
    /// Updates applied (server).
    pub updates_applied: u64,
    /// Versions received from the parent.
    pub versions_received: u64,
    /// Versions sent to children (over all child links).
    pub versions_sent: u64,
    /// Heartbeats sent.
    pub heartbeats_sent: u64,
    /// Bytes of the data messages submitted (gradients, weights, contributor sets, block
    /// clocks; the layer's retransmissions not included).
    pub bytes_sent: u64,
    /// Clocks still incomplete when the node stopped (some push never came).
    pub dropped_clocks: u64,
    /// Tree updates and failure reports refused because their sender has no standing to
    /// make them (only the server and this rank's aggregators declare deaths; a rank speaks
    /// for failures in its own subtree); each is logged with the sender.
    pub claims_refused: u64,
    /// Versions checked against the server's digest before they were taken
    /// ([`PsConfig::verify_versions`]).
    pub versions_verified: u64,
    /// The server's last updates (see [`PsConfig::keep_updates`]).
    #[serde(skip)]
    pub updates: Vec<UpdateRecord>,
    /// Ranks this node knows have failed (routed around), ascending.
    pub dead: Vec<usize>,
    /// Tree version: the number of failures repaired (0: the original tree).
    pub tree_version: u64,
    /// Whether the job fell back to STAR after more than `max_reparents` failures.
    pub fell_back_to_star: bool,
    /// Whether this node's message-layer datagrams are sealed with its pair of ranks' keys
    /// (its links were set up with a job secret).
    pub sealed: bool,
}

/// Why a parameter-server call failed.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// A link failed (the peer died, stalled or broke the transport protocol), or set-up failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A blocking call waited `op_timeout` in vain.
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// What the call waited for.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// Another rank failed and the tree passed the news on.
    #[error("rank {rank} failed: {reason}")]
    Peer {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        reason: String,
    },
    /// A peer sent a message that does not fit the protocol.
    #[error("rank {peer} broke the parameter-server protocol: {what}")]
    Protocol {
        /// The peer.
        peer: usize,
        /// What was wrong.
        what: String,
    },
    /// A worker operation was called on the server.
    #[error(
        "rank {rank} is the parameter server: {op} is a worker operation; call it on a worker rank"
    )]
    NotAWorker {
        /// The server's rank.
        rank: usize,
        /// The operation.
        op: &'static str,
    },
    /// A second push in one clock.
    #[error("clock {clock} already has this worker's push: call clock() before pushing again (one push per clock)")]
    AlreadyPushed {
        /// The worker's clock.
        clock: u64,
    },
    /// A tensor that is not shaped like the model.
    #[error("the tensor is {got} but the model is {expected}: pass tensors of the model's dtype and length")]
    Mismatch {
        /// The model's dtype and length.
        expected: String,
        /// The tensor's.
        got: String,
    },
    /// Bad arguments to [`PsNode::start`](super::PsNode::start).
    #[error("invalid parameter-server set-up: {0}")]
    Config(String),
    /// The node failed earlier (that error was returned then); it cannot go on.
    #[error("this node failed earlier ({0}); shut it down and restart the job")]
    Failed(String),
    /// The node's message-layer endpoint failed (its socket or progress thread).
    #[error("the parameter-server node's message-layer endpoint failed: {0}; restart the node")]
    Endpoint(String),
    /// The node's background threads have stopped.
    #[error("the parameter-server node has stopped; start a new one")]
    Stopped,
}
