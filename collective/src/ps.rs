//! MLNET's parameter server (§3) over an aggregation/multicast [`Tree`]: `push`, `pull(s)`,
//! `clock()`.
//!
//! The tree is rooted at the server; every other member is a worker whose process also
//! aggregates for its children (MLNET's interior nodes are workers too). Every rank runs a
//! [`PsNode`]: one background thread owns the rank's [`Links`] for the node's lifetime and runs
//! one sub-thread per link plus the aggregator, so the API calls never touch the network.
//!
//! **What travels where.** Each link carries a sequence of messages, each a small reliable
//! header flow (kind, flags, clock) followed by its data flows:
//!
//! - *Up* (child -> parent), per clock `c = 0, 1, ...`: the sum of the gradients of clock `c`
//!   of the child's whole subtree (flow round = `c`). A worker node sums its own push of
//!   clock `c` (from the API) and each child's sum of clock `c`, in any arrival order, and
//!   sends one sum upstream: a node with `d` children receives `d` values and sends one. The
//!   root averages each block over the workers summed in it, applies `w -= lr * avg`, and its
//!   weights become version `c + 1`. The model clock (the minimum worker clock) thus emerges
//!   from the tree: the root completes clock `c` only once every worker pushed clock `c`.
//! - *Down* (parent -> child): the root multicasts every new version (flow round = its clock);
//!   each node merges it into its cache (which never goes backwards, as [`WeightCache`]) and
//!   forwards its cache to its children. The root multicasts version 0 (its `initial`) at
//!   start, so every replica starts from the server's model. A child link that is busy
//!   forwards only the newest version (older ones are superseded).
//! - *Heartbeats* on every idle link (every [`PsConfig::heartbeat`], 200 ms by default) keep
//!   a slow but live peer apart from a dead one: a link silent for
//!   [`PsConfig::failure_timeout`] (1 s) has failed. A node that fails on its own (a protocol
//!   error, a bad update) tells its neighbours (a *fail* message, passed on), so every rank
//!   learns which rank failed instead of only timing out.
//! - *Bye* ends a link: a node leaves once it was told to stop, its children have left and
//!   its sums are sent; it says Bye on every link and each peer answers with Bye. A node's
//!   shutdown thus waits for its subtree and its neighbours' answers, the root's for the
//!   whole tree.
//!
//! **Routing around failures (MLNET §3.1, [`PsConfig::reroute`]).** Every node also holds
//! the spare links of [`fault_tolerant_edges`] (to its grandparent, and between the root and
//! every member), idle but for heartbeats. The root alone declares a rank dead: when its link
//! with it fails (closed, or silent for `failure_timeout`). It then floods a *tree update*
//! (the dead set; its size is the tree version) over every live link, each node passing it
//! on once, and every node computes the same tree from the original one and the dead set
//! ([`repaired_tree`]): the dead node's children re-attach to their grandparent, or, after
//! more than [`PsConfig::max_reparents`] failures, everyone becomes a child of the root
//! (STAR). A dead server cannot be routed around: MLNET waits for a replacement; here every
//! worker fails with an error naming it (its link closes or falls silent).
//!
//! *Exchanging clocks.* A node that takes in a child (its grandparent, or the root in STAR)
//! sends it an *adopt* message: "send me your sums from clock `k` on". After a re-parenting,
//! `k` is the number of sums the new parent received from the dead node: the dead node's
//! sums of clocks below `k` already hold the child's subtree, the later ones never arrived,
//! so the child re-sends its buffered sums of clocks `k..` (a worker keeps its sums until a
//! version says they were applied) and nothing is counted twice or lost. After the STAR
//! fallback the partial sums in the tree mix workers that now send on their own, so the root
//! discards its pending (unapplied) clocks and every worker re-sends its own pushes from the
//! root's next clock. Sums carry the tree version their sender attached at; a parent ignores
//! a dead node's late sums and sums sent before a child's re-attachment. Until the adopt
//! message arrives a re-attached child keeps its sums. The dead node's contributions of the
//! clocks its parent had not received are lost: the server averages over the workers whose
//! sums arrived, as always, and [`UpdateRecord`] names them. Pulls are still served only
//! under [`pull_allowed`], so the staleness bound holds throughout; [`PsStats`] names the
//! dead ranks, the tree version and whether the job fell back to STAR.
//!
//! **Why the staleness bound holds.** A pull by a worker at `c_worker` is answered from the
//! local cache only when [`pull_allowed`]`(v, c_worker, s)` holds for the version `v` the
//! cache holds, and that version is what it returns (its clock is in the [`PullReport`]);
//! otherwise it waits (at most `op_timeout`) for the multicast of a newer version. Only the
//! root makes versions, version `v` once every worker's push of clock `v - 1` is in it, so a
//! version's clock never claims more than it holds. Because the root multicasts every
//! version eagerly, a pull never has to travel up: the cache is as fresh as the tree allows
//! and a blocked pull just waits for the next multicast. A worker's pull at clock `c` thus
//! needs every worker's push of clock `c - s - 1`: it runs at most `s` clocks ahead of the
//! slowest worker's pushes. Its pushes of later clocks wait in the aggregators until the
//! slower workers' pushes of the earlier clocks arrive; each clock's sum is applied once, in
//! clock order, so the sequence of updates does not depend on who was fast. MLNET's push
//! gate (batching several clocks of a subtree into one push) is not used: every clock's sum
//! is applied on its own.
//!
//! **Bounded loss (DLCP).** With a loss bound `p > 0` each hop of a tree of height `h` gets
//! `p / h`, so by the union bound every worker's gradients reach the root in at least
//! `1 - p` of their blocks and every node holds at least `1 - p` of each version's blocks
//! (blocks are transport segments unless `block_elems` says otherwise). Sums travel with
//! their contributor sets and each block is averaged over the workers actually summed in it
//! ([`crate::aggregate`]); a block that no worker's gradient reached is not updated. Versions
//! travel down with per-block clocks: a block lost on the way keeps its previous (older)
//! values at the receiver, and [`PullReport::delivered_fraction`] says how much of the
//! returned version is exactly that version. With `p = 0` nothing is lost and no set or
//! block clock is sent.
//!
//! **Limits.** One server (one tree), and no replacement for it. Only the root declares
//! deaths, so a failure must break a link with the root: without the spare links (links of
//! [`crate::link::tree_edges`] only) a failure deeper in the tree is not repaired and the
//! ranks waiting on it time out. A rank the root declared dead by mistake (silent for
//! `failure_timeout` under load) is cut off: its sums are ignored and its calls time out. A
//! child that left before its parent died is not re-attached (its new parent's later clocks
//! are dropped at shutdown). Each message is one flow of the whole model (no pipelining in
//! chunks, unlike the communicator's tree all-reduce).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{MissingFill, RecvOptions, RecvReport, SendOptions, TransferConfig};

use crate::aggregate::{
    accumulate, add_into, arrived_blocks, finish, scale, BlockLayout, Contributors, Partial,
    ReduceOp,
};
use crate::clock::{pull_allowed, WeightCache};
use crate::error::CollectiveError;
use crate::link::{InLink, Links, OutLink};
use crate::tree::{Tree, TreeError};

/// How a parameter-server node runs.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// Staleness threshold `s` of a pull that names none (0: synchronous).
    pub staleness: u64,
    /// The server's update: `w -= learning_rate * average gradient`.
    pub learning_rate: f32,
    /// End-to-end loss bound of gradients and weights (split over the tree's hops).
    pub loss_bound: LossBound,
    /// Transport configuration of every transfer.
    pub transfer: TransferConfig,
    /// Longest wait of a blocking call (pull, wait_clock, each phase of shutdown).
    pub op_timeout: Duration,
    /// Period of the heartbeats on every idle link (default 200 ms).
    pub heartbeat: Duration,
    /// Silence after which a link's peer counts as dead (default 1 s; it is also the
    /// transport's connect timeout). Must exceed `heartbeat`.
    pub failure_timeout: Duration,
    /// Route around failed workers (MLNET §3.1, default true): the root declares a rank
    /// dead when its link fails or stays silent for `failure_timeout`, and the tree is
    /// repaired ([`repaired_tree`]). Needs the links of [`fault_tolerant_edges`]. Off: a
    /// failed rank is an error at every rank.
    pub reroute: bool,
    /// Failures repaired by re-attaching children to their grandparent (default 1); one
    /// more and the job falls back to STAR (every worker a child of the server).
    pub max_reparents: usize,
    /// Elements per aggregation block; `None`: exactly one transport segment.
    pub block_elems: Option<usize>,
    /// The server keeps the contributor sets of its last `keep_updates` updates (returned in
    /// [`PsStats::updates`]); 0: none.
    pub keep_updates: usize,
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

/// What a node did, returned by [`PsNode::shutdown`].
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
    /// Payload bytes of data flows sent (gradients and weights, retransmissions included).
    pub bytes_sent: u64,
    /// Clocks still incomplete when the node stopped (some push never came).
    pub dropped_clocks: u64,
    /// The server's last updates (see [`PsConfig::keep_updates`]).
    #[serde(skip)]
    pub updates: Vec<UpdateRecord>,
    /// Ranks this node knows have failed (routed around), ascending.
    pub dead: Vec<usize>,
    /// Tree version: the number of failures repaired (0: the original tree).
    pub tree_version: u64,
    /// Whether the job fell back to STAR after more than `max_reparents` failures.
    pub fell_back_to_star: bool,
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
    /// Bad arguments to [`PsNode::start`].
    #[error("invalid parameter-server set-up: {0}")]
    Config(String),
    /// The node failed earlier (that error was returned then); it cannot go on.
    #[error("this node failed earlier ({0}); shut it down and restart the job")]
    Failed(String),
    /// The node's background threads have stopped.
    #[error("the parameter-server node has stopped; start a new one")]
    Stopped,
}

// Flow ids: a kind in bits 27..31 (the communicator uses 1..=6), the sets/clock flow of a data
// flow with bit 31.
const T_HEADER: u32 = 7 << 27;
const T_PUSH: u32 = 8 << 27;
const T_WEIGHTS: u32 = 9 << 27;
const T_FAIL: u32 = 10 << 27;
const T_TREE: u32 = 11 << 27;
const SIDE_BIT: u32 = 1 << 31;

const HEADER_LEN: usize = 16;
const MAGIC: u8 = 0x50;
/// Header flag: a contributor-set flow (push) or block-clock flow (weights) follows.
const F_SIDE: u8 = 1;
/// Header flag: an empty push (nobody in the subtree contributed to this clock).
const F_EMPTY: u8 = 2;
/// Longest failure reason carried.
const MAX_REASON: usize = 2048;
/// A block the sender does not hold (weights block clocks).
const NOT_HELD: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Heartbeat = 1,
    Bye = 2,
    Push = 3,
    Weights = 4,
    Fail = 5,
    Tree = 6,
    Adopt = 7,
}

/// The header flow of every message: `[magic, kind, flags, 0, len u32, clock u64]`, LE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    kind: Kind,
    flags: u8,
    /// Fail: reason bytes; tree: dead ranks; push: the sender's tree version at attachment;
    /// adopt: the tree version.
    len: u32,
    /// Push and weights: the clock; fail: the rank that failed; tree: the version; adopt:
    /// the first clock the new parent wants.
    clock: u64,
}

impl Header {
    fn new(kind: Kind, flags: u8, clock: u64) -> Header {
        Header {
            kind,
            flags,
            len: 0,
            clock,
        }
    }

    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        b[1] = self.kind as u8;
        b[2] = self.flags;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.clock.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() != HEADER_LEN || b[0] != MAGIC || b[3] != 0 {
            return Err("malformed message header".into());
        }
        let kind = match b[1] {
            1 => Kind::Heartbeat,
            2 => Kind::Bye,
            3 => Kind::Push,
            4 => Kind::Weights,
            5 => Kind::Fail,
            6 => Kind::Tree,
            7 => Kind::Adopt,
            k => return Err(format!("unknown message kind {k}")),
        };
        let flags = b[2];
        if flags & !(F_SIDE | F_EMPTY) != 0 {
            return Err(format!("unknown header flags {flags:#x}"));
        }
        let mut len = [0u8; 4];
        len.copy_from_slice(&b[4..8]);
        let mut clock = [0u8; 8];
        clock.copy_from_slice(&b[8..16]);
        Ok(Header {
            kind,
            flags,
            len: u32::from_le_bytes(len),
            clock: u64::from_le_bytes(clock),
        })
    }
}

/// The message header's codec, for the fuzz target `ps_header` (not an API: the header is
/// internal to the parameter server's links).
#[doc(hidden)]
pub mod header_codec {
    /// Bytes of a message header.
    pub const LEN: usize = super::HEADER_LEN;

    /// Decode `b` as a message header and encode what was decoded again: `Ok` exactly when
    /// `b` is a valid header.
    pub fn decode_encode(b: &[u8]) -> Result<[u8; LEN], String> {
        super::Header::decode(b).map(|h| h.encode())
    }
}

/// A sum of one clock's gradients on its way up.
#[derive(Debug)]
struct PushMsg {
    clock: u64,
    /// `None`: nobody in the subtree contributed.
    values: Option<Tensor>,
    /// Encoded contributor sets, when they are not "the whole subtree in every block".
    sets: Option<Vec<u8>>,
}

/// A weights version on its way down.
#[derive(Debug)]
struct VersionMsg {
    clock: u64,
    weights: Tensor,
    /// Encoded per-block clocks, when some block is not at `clock`.
    block_clocks: Option<Vec<u8>>,
}

/// What a link's sending thread is asked to do.
#[derive(Debug)]
enum Out {
    /// A sum, stamped with the tree version the sender attached at.
    Push(Arc<PushMsg>, u64),
    Weights(Arc<VersionMsg>),
    /// The dead ranks (the tree version is their number).
    Tree(Arc<Vec<usize>>),
    /// "Send me your sums from clock `from` on" (tree version `version`).
    Adopt {
        version: u64,
        from: u64,
    },
    /// Say Bye and end.
    Finish,
}

/// A child's sum as received.
#[derive(Debug)]
struct ChildSum {
    values: Tensor,
    sets: Contributors,
    arrived: Vec<bool>,
}

/// The aggregator's input.
#[derive(Debug)]
enum AggIn {
    Own {
        clock: u64,
        grads: Option<Tensor>,
    },
    Child {
        peer: usize,
        epoch: u64,
        clock: u64,
        sum: Option<ChildSum>,
    },
    /// A new version reached the cache.
    Version,
    Tree(Vec<usize>),
    Adopt {
        peer: usize,
        version: u64,
        from: u64,
    },
    Bye(usize),
    /// The link with `peer` failed.
    Down {
        peer: usize,
        reason: String,
    },
    Stop,
}

#[derive(Debug, Clone)]
struct FailNote {
    origin: usize,
    reason: String,
    came_from: Option<usize>,
}

#[derive(Debug)]
struct State {
    cache: WeightCache,
    weights: Tensor,
    /// Per block: 1 + the clock of its values; 0: never received (the local initial values).
    have: Vec<u64>,
    /// The first background error, until an API call returns it.
    error: Option<PsError>,
    /// The first background error's message (sticky).
    failed: Option<String>,
    note: Option<FailNote>,
    /// The clock the aggregator waits to complete and the ranks it waits for.
    waiting: Option<(u64, Vec<usize>)>,
    updates: VecDeque<UpdateRecord>,
    updates_applied: u64,
    stopped: bool,
    dead: Vec<usize>,
    tree_version: u64,
    fell_back: bool,
}

#[derive(Debug, Default)]
struct Counters {
    sums_sent: AtomicU64,
    versions_received: AtomicU64,
    versions_sent: AtomicU64,
    heartbeats_sent: AtomicU64,
    bytes_sent: AtomicU64,
    dropped_clocks: AtomicU64,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    force: AtomicBool,
    counters: Counters,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keep the first background error (and tell the neighbours); log the others.
    fn fail(&self, rank: usize, err: PsError, came_from: Option<usize>) {
        let mut st = self.lock();
        if st.failed.is_none() {
            let (origin, reason) = match &err {
                PsError::Peer { rank, reason } => (*rank, reason.clone()),
                e => (rank, e.to_string()),
            };
            st.failed = Some(err.to_string());
            st.note = Some(FailNote {
                origin,
                reason,
                came_from,
            });
            st.error = Some(err);
        } else {
            log::warn!("parameter server rank {rank}: a further error: {err}");
        }
        drop(st);
        self.cv.notify_all();
    }

    fn forced(&self) -> bool {
        self.force.load(Ordering::SeqCst)
    }

    fn note_for(&self, peer: usize) -> Option<FailNote> {
        self.lock()
            .note
            .clone()
            .filter(|n| n.came_from != Some(peer))
    }
}

/// The error a call must return first, if any: the background error once, then `Failed`.
fn take_error(st: &mut State) -> Result<(), PsError> {
    if let Some(e) = st.error.take() {
        return Err(e);
    }
    match &st.failed {
        Some(m) => Err(PsError::Failed(m.clone())),
        None => Ok(()),
    }
}

/// Everything the background threads share, read-only.
#[derive(Debug)]
struct Ctx {
    rank: usize,
    world: usize,
    job: u32,
    root: usize,
    /// The tree the job started with.
    tree0: Tree,
    /// The ranks this node has links with (both ways).
    peers: Vec<usize>,
    /// Per rank: a one-block set of the workers in its subtree of `tree0` (a repair only
    /// moves nodes up, so a subtree never gains workers outside it).
    subtree0: Vec<Contributors>,
    workers: usize,
    dtype: DType,
    layout: BlockLayout,
    /// Bytes per whole block.
    bb: usize,
    reliable: bool,
    hop_bound: LossBound,
    transfer: TransferConfig,
    heartbeat: Duration,
    failure_timeout: Duration,
    poll: Duration,
    learning_rate: f32,
    keep_updates: usize,
    reroute: bool,
    max_reparents: usize,
    shared: Arc<Shared>,
}

impl Ctx {
    fn fail(&self, err: PsError) {
        self.shared.fail(self.rank, err, None);
    }

    fn blocks(&self) -> usize {
        self.layout.blocks()
    }
}

fn describe(dtype: DType, elems: usize) -> String {
    format!("{elems} x {dtype}")
}

fn tensor_of(dtype: DType, bytes: &[u8]) -> Tensor {
    let mut t = Tensor::zeros(dtype, bytes.len() / dtype.elem_size());
    t.as_bytes_mut().copy_from_slice(bytes);
    t
}

fn raw_tensor(bytes: &[u8]) -> Tensor {
    tensor_of(DType::Raw, bytes)
}

/// The loss bound of each hop of a tree of `height` hops, so that the whole path stays within
/// `total` (union bound).
fn hop_bound(total: LossBound, height: usize) -> LossBound {
    let h = u32::try_from(height.max(1)).unwrap_or(u32::MAX);
    LossBound::from_ppm(total.ppm() / h).unwrap_or(LossBound::RELIABLE)
}

/// The server's step: `w += -lr * avg`, element by element, in `dtype`.
fn apply_update(dtype: DType, w: &mut [u8], avg: &[u8], lr: f32) -> Result<(), PsError> {
    let mut step = avg.to_vec();
    scale(dtype, &mut step, -lr);
    add_into(dtype, w, &step).map_err(|e| PsError::Config(format!("update: {e}")))
}

/// Merge a received version into a cache: block `b` takes the incoming values when they
/// arrived, the sender held them, and they are newer than the cache's. `have[b]` is 1 + the
/// block's clock (0: never received). Returns how many blocks changed.
fn merge_blocks(
    w: &mut [u8],
    have: &mut [u64],
    incoming: &[u8],
    in_clocks: &[u64],
    arrived: &[bool],
    bb: usize,
) -> usize {
    let mut changed = 0;
    for (b, (dst, src)) in w
        .chunks_mut(bb.max(1))
        .zip(incoming.chunks(bb.max(1)))
        .enumerate()
    {
        let (Some(&c), Some(&ok), Some(h)) = (in_clocks.get(b), arrived.get(b), have.get_mut(b))
        else {
            continue;
        };
        if ok && c != NOT_HELD && c.saturating_add(1) > *h && dst.len() == src.len() {
            dst.copy_from_slice(src);
            *h = c + 1;
            changed += 1;
        }
    }
    changed
}

/// Per-block clocks of a cache (`NOT_HELD` for blocks never received), and whether any block
/// differs from `version`.
fn block_clocks(have: &[u64], version: u64) -> (Vec<u64>, bool) {
    let clocks: Vec<u64> = have
        .iter()
        .map(|&h| if h == 0 { NOT_HELD } else { h - 1 })
        .collect();
    let explicit = clocks.iter().any(|&c| c != version);
    (clocks, explicit)
}

fn encode_clocks(clocks: &[u64]) -> Vec<u8> {
    clocks.iter().flat_map(|c| c.to_le_bytes()).collect()
}

fn decode_clocks(bytes: &[u8], blocks: usize, version: u64) -> Result<Vec<u64>, String> {
    if bytes.len() != blocks * 8 {
        return Err(format!(
            "block clocks of {} bytes for {blocks} blocks",
            bytes.len()
        ));
    }
    let mut out = Vec::with_capacity(blocks);
    for (b, w) in bytes.chunks_exact(8).enumerate() {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        let c = u64::from_le_bytes(a);
        if c != NOT_HELD && c > version {
            return Err(format!(
                "block {b} claims clock {c}, newer than its version {version}"
            ));
        }
        out.push(c);
    }
    Ok(out)
}

/// Whether every block of `sets` names only workers of `allowed` (a one-block set).
fn sets_within(sets: &Contributors, allowed: &Contributors) -> bool {
    let limit = allowed.count(0);
    let mut probe = Contributors::none(1, sets.world());
    (0..sets.blocks()).all(|b| {
        probe.assign(0, sets, b);
        probe.unite(0, allowed, 0);
        probe.count(0) == limit
    })
}

// ---------------------------------------------------------------------------------------------
// Link I/O.

fn send_flow(
    ol: &mut OutLink,
    t: &Tensor,
    tensor: u32,
    round: u32,
    stage: Stage,
    bound: LossBound,
    ctx: &Ctx,
) -> Result<u64, PsError> {
    let opts = SendOptions {
        job: ctx.job,
        tensor,
        round,
        layer: 0,
        stage,
        loss_bound: Some(bound),
    };
    let prio = fixed_priority(Tag { dscp: 0, ect: true });
    let peer = ol.peer();
    let r = ol
        .send(t, &opts, &prio, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?;
    Ok(r.stats.payload_bytes)
}

fn recv_flow(
    il: &mut InLink,
    t: &mut Tensor,
    tensor: u32,
    round: u32,
    bound: LossBound,
    ctx: &Ctx,
) -> Result<RecvReport, PsError> {
    let opts = RecvOptions {
        job: ctx.job,
        tensor,
        round: Some(round),
        loss_bound: Some(bound),
        fill: MissingFill::Zero,
        max_bytes: None,
    };
    let peer = il.peer();
    Ok(il
        .recv(t, &opts, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?)
}

/// One link's sending end: its message counter and when it last sent.
struct Tx<'a> {
    ol: &'a mut OutLink,
    seq: u32,
    stage: Stage,
    last: Instant,
}

impl Tx<'_> {
    fn header(&mut self, h: &Header, ctx: &Ctx) -> Result<(), PsError> {
        let t = raw_tensor(&h.encode());
        send_flow(
            self.ol,
            &t,
            T_HEADER,
            self.seq,
            self.stage,
            LossBound::RELIABLE,
            ctx,
        )?;
        self.seq = self.seq.wrapping_add(1);
        self.last = Instant::now();
        Ok(())
    }

    /// A message's data: `values` with the hop's loss bound, then, when there is one, its
    /// side information (contributor sets or block clocks) as a reliable flow. Returns the
    /// payload bytes sent.
    fn data(
        &mut self,
        values: &Tensor,
        side: Option<&[u8]>,
        kind: u32,
        clock: u64,
        stage: Stage,
        ctx: &Ctx,
    ) -> Result<u64, PsError> {
        let round = clock as u32;
        let mut bytes = send_flow(self.ol, values, kind, round, stage, ctx.hop_bound, ctx)?;
        if let Some(side) = side {
            let t = raw_tensor(side);
            let bound = LossBound::RELIABLE;
            bytes += send_flow(self.ol, &t, kind | SIDE_BIT, round, stage, bound, ctx)?;
        }
        Ok(bytes)
    }

    fn push(&mut self, m: &PushMsg, epoch: u64, ctx: &Ctx) -> Result<(), PsError> {
        let mut flags = 0;
        if m.values.is_none() {
            flags |= F_EMPTY;
        } else if m.sets.is_some() {
            flags |= F_SIDE;
        }
        let mut h = Header::new(Kind::Push, flags, m.clock);
        h.len = u32::try_from(epoch).unwrap_or(u32::MAX);
        self.header(&h, ctx)?;
        let bytes = match &m.values {
            Some(v) => self.data(v, m.sets.as_deref(), T_PUSH, m.clock, Stage::Push, ctx)?,
            None => 0,
        };
        ctx.shared
            .counters
            .bytes_sent
            .fetch_add(bytes, Ordering::Relaxed);
        self.last = Instant::now();
        Ok(())
    }

    fn weights(&mut self, m: &VersionMsg, ctx: &Ctx) -> Result<(), PsError> {
        let flags = if m.block_clocks.is_some() { F_SIDE } else { 0 };
        self.header(&Header::new(Kind::Weights, flags, m.clock), ctx)?;
        let side = m.block_clocks.as_deref();
        let bytes = self.data(&m.weights, side, T_WEIGHTS, m.clock, self.stage, ctx)?;
        ctx.shared
            .counters
            .bytes_sent
            .fetch_add(bytes, Ordering::Relaxed);
        ctx.shared
            .counters
            .versions_sent
            .fetch_add(1, Ordering::Relaxed);
        self.last = Instant::now();
        Ok(())
    }

    fn tree(&mut self, dead: &[usize], ctx: &Ctx) -> Result<(), PsError> {
        let mut h = Header::new(Kind::Tree, 0, dead.len() as u64);
        h.len = u32::try_from(dead.len()).unwrap_or(u32::MAX);
        let round = self.seq;
        self.header(&h, ctx)?;
        let bytes: Vec<u8> = dead
            .iter()
            .flat_map(|&r| (r as u64).to_le_bytes())
            .collect();
        send_flow(
            self.ol,
            &raw_tensor(&bytes),
            T_TREE,
            round,
            self.stage,
            LossBound::RELIABLE,
            ctx,
        )?;
        Ok(())
    }

    fn fail(&mut self, note: &FailNote, ctx: &Ctx) -> Result<(), PsError> {
        let mut reason = note.reason.clone();
        if reason.is_empty() {
            reason.push('?');
        }
        if reason.len() > MAX_REASON {
            let mut cut = MAX_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        let mut h = Header::new(Kind::Fail, 0, note.origin as u64);
        h.len = reason.len() as u32;
        let round = self.seq;
        self.header(&h, ctx)?;
        let t = raw_tensor(reason.as_bytes());
        send_flow(
            self.ol,
            &t,
            T_FAIL,
            round,
            self.stage,
            LossBound::RELIABLE,
            ctx,
        )?;
        Ok(())
    }
}

/// What a link thread's error means: with route-around, a link failure marks the peer as
/// suspect (the aggregator decides); otherwise, and for protocol errors, the node fails.
fn link_error(ctx: &Ctx, peer: usize, e: PsError, agg: &Sender<AggIn>) {
    if ctx.shared.forced() {
        return;
    }
    match e {
        PsError::Collective(c) if ctx.reroute => {
            let _ = agg.send(AggIn::Down {
                peer,
                reason: c.to_string(),
            });
        }
        e => ctx.fail(e),
    }
}

/// A link's sending thread: messages from `rx` in order (newest weights only), heartbeats
/// when idle, failure news once, Bye at the end.
fn sender_loop(ol: &mut OutLink, rx: Receiver<Out>, ctx: &Ctx, agg: Sender<AggIn>) {
    let peer = ol.peer();
    let mut tx = Tx {
        ol,
        seq: 0,
        stage: Stage::Pull,
        last: Instant::now(),
    };
    let mut told_fail = false;
    let mut stash: Option<Out> = None;
    let r = (|| -> Result<(), PsError> {
        loop {
            if !told_fail {
                if let Some(note) = ctx.shared.note_for(peer) {
                    told_fail = true;
                    tx.fail(&note, ctx)?;
                }
            }
            if ctx.shared.forced() {
                return Ok(());
            }
            let msg = match stash.take() {
                Some(m) => m,
                None => match rx.recv_timeout(ctx.poll) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => {
                        if tx.last.elapsed() >= ctx.heartbeat {
                            tx.header(&Header::new(Kind::Heartbeat, 0, 0), ctx)?;
                            ctx.shared
                                .counters
                                .heartbeats_sent
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        // A forced stop leaves without a word (the peer must see a failure).
                        if !ctx.shared.forced() {
                            tx.header(&Header::new(Kind::Bye, 0, 0), ctx)?;
                        }
                        return Ok(());
                    }
                },
            };
            // Only the newest of consecutive versions matters.
            let msg = match msg {
                Out::Weights(mut v) => {
                    while let Ok(m) = rx.try_recv() {
                        match m {
                            Out::Weights(newer) => v = newer,
                            other => {
                                stash = Some(other);
                                break;
                            }
                        }
                    }
                    Out::Weights(v)
                }
                other => other,
            };
            match msg {
                Out::Push(p, epoch) => {
                    tx.push(&p, epoch, ctx)?;
                    ctx.shared
                        .counters
                        .sums_sent
                        .fetch_add(1, Ordering::Relaxed);
                }
                Out::Weights(v) => tx.weights(&v, ctx)?,
                Out::Tree(dead) => tx.tree(&dead, ctx)?,
                Out::Adopt { version, from } => {
                    let mut h = Header::new(Kind::Adopt, 0, from);
                    h.len = u32::try_from(version).unwrap_or(u32::MAX);
                    tx.header(&h, ctx)?;
                }
                Out::Finish => {
                    tx.header(&Header::new(Kind::Bye, 0, 0), ctx)?;
                    return Ok(());
                }
            }
        }
    })();
    if let Err(e) = r {
        link_error(ctx, peer, e, &agg);
    }
}

/// One link's receiving end: its message counter.
struct Rx<'a> {
    il: &'a mut InLink,
    seq: u32,
}

impl Rx<'_> {
    fn header(&mut self, ctx: &Ctx) -> Result<Header, PsError> {
        let mut t = Tensor::zeros(DType::Raw, HEADER_LEN);
        recv_flow(
            self.il,
            &mut t,
            T_HEADER,
            self.seq,
            LossBound::RELIABLE,
            ctx,
        )?;
        let round = self.seq;
        self.seq = self.seq.wrapping_add(1);
        Header::decode(t.as_bytes()).map_err(|what| PsError::Protocol {
            peer: self.il.peer(),
            what: format!("message {round}: {what}"),
        })
    }

    fn reason(&mut self, h: &Header, ctx: &Ctx) -> Result<String, PsError> {
        let len = h.len as usize;
        if len == 0 || len > MAX_REASON {
            return Err(self.protocol(format!("a failure reason of {len} bytes")));
        }
        let mut t = Tensor::zeros(DType::Raw, len);
        recv_flow(
            self.il,
            &mut t,
            T_FAIL,
            self.seq.wrapping_sub(1),
            LossBound::RELIABLE,
            ctx,
        )?;
        Ok(String::from_utf8_lossy(t.as_bytes()).into_owned())
    }

    /// A tree update: the dead ranks.
    fn tree(&mut self, h: &Header, ctx: &Ctx) -> Result<Vec<usize>, PsError> {
        let n = h.len as usize;
        if n == 0 || n > ctx.world || h.clock != n as u64 {
            return Err(self.protocol(format!(
                "a tree update of version {} naming {n} dead rank(s)",
                h.clock
            )));
        }
        let mut t = Tensor::zeros(DType::Raw, n * 8);
        recv_flow(
            self.il,
            &mut t,
            T_TREE,
            self.seq.wrapping_sub(1),
            LossBound::RELIABLE,
            ctx,
        )?;
        let mut dead = Vec::with_capacity(n);
        for w in t.as_bytes().chunks_exact(8) {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            match usize::try_from(u64::from_le_bytes(a)) {
                Ok(r) if r < ctx.world => dead.push(r),
                _ => return Err(self.protocol("a tree update names a rank out of range".into())),
            }
        }
        Ok(dead)
    }

    fn protocol(&self, what: String) -> PsError {
        PsError::Protocol {
            peer: self.il.peer(),
            what,
        }
    }

    /// A sum of clock `h.clock`; `subtree`: the workers it may name.
    fn push(
        &mut self,
        h: &Header,
        subtree: &Contributors,
        ctx: &Ctx,
    ) -> Result<Option<ChildSum>, PsError> {
        if h.flags & F_EMPTY != 0 {
            return Ok(None);
        }
        let blocks = ctx.blocks();
        let round = h.clock as u32;
        let mut values = Tensor::zeros(ctx.dtype, ctx.layout.elems());
        let report = recv_flow(self.il, &mut values, T_PUSH, round, ctx.hop_bound, ctx)?;
        let arrived = arrived_blocks(&report.missing_byte_ranges(), ctx.bb, blocks);
        let sets = if h.flags & F_SIDE != 0 {
            let len = blocks * Contributors::none(1, ctx.world).encoded_block_len();
            let mut t = Tensor::zeros(DType::Raw, len);
            recv_flow(
                self.il,
                &mut t,
                T_PUSH | SIDE_BIT,
                round,
                LossBound::RELIABLE,
                ctx,
            )?;
            let sets =
                Contributors::decode(t.as_bytes(), blocks, ctx.world, true).map_err(|e| {
                    self.protocol(format!("contributor sets of clock {}: {e}", h.clock))
                })?;
            if !sets_within(&sets, subtree) {
                return Err(self.protocol(format!(
                    "the sum of clock {} names workers outside its subtree",
                    h.clock
                )));
            }
            sets
        } else if ctx.reliable {
            let mut s = Contributors::none(blocks, ctx.world);
            for b in 0..blocks {
                s.unite(b, subtree, 0);
            }
            s
        } else {
            return Err(self.protocol(format!(
                "the sum of clock {} came without contributor sets under a loss bound",
                h.clock
            )));
        };
        Ok(Some(ChildSum {
            values,
            sets,
            arrived,
        }))
    }

    /// A version: its values, per-block clocks and which blocks arrived.
    fn weights(&mut self, h: &Header, ctx: &Ctx) -> Result<(Tensor, Vec<u64>, Vec<bool>), PsError> {
        let blocks = ctx.blocks();
        let round = h.clock as u32;
        let mut values = Tensor::zeros(ctx.dtype, ctx.layout.elems());
        let report = recv_flow(self.il, &mut values, T_WEIGHTS, round, ctx.hop_bound, ctx)?;
        let arrived = arrived_blocks(&report.missing_byte_ranges(), ctx.bb, blocks);
        let clocks = if h.flags & F_SIDE != 0 {
            let mut t = Tensor::zeros(DType::Raw, blocks * 8);
            recv_flow(
                self.il,
                &mut t,
                T_WEIGHTS | SIDE_BIT,
                round,
                LossBound::RELIABLE,
                ctx,
            )?;
            decode_clocks(t.as_bytes(), blocks, h.clock)
                .map_err(|e| self.protocol(format!("version {}: {e}", h.clock)))?
        } else {
            vec![h.clock; blocks]
        };
        Ok((values, clocks, arrived))
    }
}

/// A link's receiving thread: every message to the aggregator (versions merged into the
/// cache here), until the peer's Bye or the link fails.
fn peer_recv(il: &mut InLink, ctx: &Ctx, agg: Sender<AggIn>) {
    let peer = il.peer();
    let mut rx = Rx { il, seq: 0 };
    let r = (|| -> Result<(), PsError> {
        loop {
            let h = rx.header(ctx)?;
            let msg = match h.kind {
                Kind::Heartbeat => None,
                Kind::Bye => {
                    let _ = agg.send(AggIn::Bye(peer));
                    return Ok(());
                }
                Kind::Fail => {
                    let reason = rx.reason(&h, ctx)?;
                    let rank = usize::try_from(h.clock).unwrap_or(usize::MAX);
                    ctx.shared
                        .fail(ctx.rank, PsError::Peer { rank, reason }, Some(peer));
                    None
                }
                Kind::Push => {
                    let sum = rx.push(&h, &ctx.subtree0[peer], ctx)?;
                    Some(AggIn::Child {
                        peer,
                        epoch: u64::from(h.len),
                        clock: h.clock,
                        sum,
                    })
                }
                Kind::Weights => {
                    let (values, clocks, arrived) = rx.weights(&h, ctx)?;
                    ctx.shared
                        .counters
                        .versions_received
                        .fetch_add(1, Ordering::Relaxed);
                    {
                        let mut st = ctx.shared.lock();
                        let st = &mut *st;
                        merge_blocks(
                            st.weights.as_bytes_mut(),
                            &mut st.have,
                            values.as_bytes(),
                            &clocks,
                            &arrived,
                            ctx.bb,
                        );
                        st.cache.on_weights(h.clock);
                    }
                    ctx.shared.cv.notify_all();
                    Some(AggIn::Version)
                }
                Kind::Tree => Some(AggIn::Tree(rx.tree(&h, ctx)?)),
                Kind::Adopt => Some(AggIn::Adopt {
                    peer,
                    version: u64::from(h.len),
                    from: h.clock,
                }),
            };
            if let Some(m) = msg {
                // The aggregator may have left already: then only the Bye matters.
                let _ = agg.send(m);
            }
            if ctx.shared.forced() {
                return Ok(());
            }
        }
    })();
    if let Err(e) = r {
        link_error(ctx, peer, e, &agg);
    }
}

/// One clock's sum in the making.
struct Pending {
    values: Vec<u8>,
    sets: Contributors,
    own: bool,
    /// The children whose sums are in.
    got: BTreeSet<usize>,
}

impl Pending {
    fn new(ctx: &Ctx) -> Pending {
        Pending {
            values: vec![0u8; ctx.layout.elems() * ctx.dtype.elem_size()],
            sets: Contributors::none(ctx.blocks(), ctx.world),
            own: false,
            got: BTreeSet::new(),
        }
    }
}

/// The tree after the failures in `dead`: each dead node's children re-attached to the
/// nearest live ancestor ([`Tree::reparent`]), or MLNET's STAR fallback ([`Tree::star`], the
/// `bool` is then true) once more than `max_reparents` nodes failed or when a re-attachment
/// needs a link [`fault_tolerant_edges`] does not provide (a dead parent and grandparent).
/// Every rank computes it from the same inputs, so all survivors agree on the tree.
pub fn repaired_tree(
    original: &Tree,
    dead: &[usize],
    max_reparents: usize,
) -> Result<(Tree, bool), TreeError> {
    let mut dead = dead.to_vec();
    dead.sort_unstable();
    dead.dedup();
    let mut t = original.clone();
    for &d in &dead {
        t = t.reparent(d)?;
    }
    if dead.is_empty() {
        return Ok((t, false));
    }
    let ft: BTreeSet<(usize, usize)> = fault_tolerant_edges(original).into_iter().collect();
    if dead.len() > max_reparents || t.edges().iter().any(|e| !ft.contains(e)) {
        return Ok((t.star(), true));
    }
    Ok((t, false))
}

/// The links a route-around job needs ([`PsConfig::reroute`]), directed `(from, to)`, each
/// once: the tree's edges both ways, every node <-> its grandparent (where children re-attach
/// when their parent dies), and the root <-> every member (failure news, and the STAR
/// fallback). The extra links stay idle, kept alive by heartbeats, until a failure needs them.
pub fn fault_tolerant_edges(tree: &Tree) -> Vec<(usize, usize)> {
    let root = tree.root();
    let mut set = BTreeSet::new();
    for m in tree.members() {
        let ups = [
            tree.parent(m),
            tree.grandparent(m),
            (m != root).then_some(root),
        ];
        for q in ups.into_iter().flatten() {
            set.insert((m, q));
            set.insert((q, m));
        }
    }
    set.into_iter().collect()
}

/// The aggregator's state, on the node's owning thread: it alone changes the tree and decides
/// what goes up and down.
struct Agg<'a> {
    ctx: &'a Ctx,
    outs: BTreeMap<usize, Sender<Out>>,
    tree: Tree,
    dead: BTreeSet<usize>,
    fell_back: bool,
    pending: BTreeMap<u64, Pending>,
    /// The next clock to complete.
    next: u64,
    /// Own pushes of clocks not applied yet as far as this node knows (for a STAR re-send).
    own: BTreeMap<u64, Option<Tensor>>,
    own_next: u64,
    /// Completed sums of clocks not applied yet (a worker re-sends them to a new parent).
    completed: BTreeMap<u64, Arc<PushMsg>>,
    /// The parent sums go to (None: the root, or detached until a new parent adopts it).
    up: Option<usize>,
    /// The tree version this node attached to `up` at (stamped on its sums).
    epoch: u64,
    sent_next: u64,
    detached_at: Option<u64>,
    adopt_wait: Option<(usize, u64, u64)>,
    /// Per child: the first clock it sends here directly, the next one due, the oldest tree
    /// version of its sums accepted.
    from: BTreeMap<usize, u64>,
    expect: BTreeMap<usize, u64>,
    accept: BTreeMap<usize, u64>,
    done: BTreeSet<usize>,
    bye_sent: BTreeSet<usize>,
    stop: bool,
    left: bool,
    broken: bool,
}

impl<'a> Agg<'a> {
    fn new(ctx: &'a Ctx, outs: BTreeMap<usize, Sender<Out>>) -> Agg<'a> {
        let tree = ctx.tree0.clone();
        let children = tree.children(ctx.rank).to_vec();
        Agg {
            ctx,
            outs,
            up: tree.parent(ctx.rank),
            tree,
            dead: BTreeSet::new(),
            fell_back: false,
            pending: BTreeMap::new(),
            next: 0,
            own: BTreeMap::new(),
            own_next: 0,
            completed: BTreeMap::new(),
            epoch: 0,
            sent_next: 0,
            detached_at: None,
            adopt_wait: None,
            from: children.iter().map(|&c| (c, 0)).collect(),
            expect: children.iter().map(|&c| (c, 0)).collect(),
            accept: children.iter().map(|&c| (c, 0)).collect(),
            done: BTreeSet::new(),
            bye_sent: BTreeSet::new(),
            stop: false,
            left: false,
            broken: false,
        }
    }

    fn worker(&self) -> bool {
        self.ctx.rank != self.ctx.root
    }

    fn send(&self, peer: usize, m: Out) {
        if let Some(tx) = self.outs.get(&peer) {
            let _ = tx.send(m);
        }
    }

    fn fatal(&mut self, e: PsError) {
        self.ctx.fail(e);
        self.broken = true;
    }

    fn children(&self) -> Vec<usize> {
        self.tree.children(self.ctx.rank).to_vec()
    }

    fn handle(&mut self, msg: AggIn) {
        match msg {
            AggIn::Stop => self.stop = true,
            AggIn::Own { clock, grads } => self.on_own(clock, grads),
            AggIn::Child {
                peer,
                epoch,
                clock,
                sum,
            } => self.on_child(peer, epoch, clock, sum),
            AggIn::Version => self.on_version(),
            AggIn::Tree(dead) => {
                let mut all = self.dead.clone();
                all.extend(dead);
                if all.len() > self.dead.len() {
                    // Pass the news on (flooding: the root may not reach everyone directly).
                    let list: Arc<Vec<usize>> = Arc::new(all.iter().copied().collect());
                    for &q in self.outs.keys() {
                        if !all.contains(&q) && !self.bye_sent.contains(&q) {
                            self.send(q, Out::Tree(list.clone()));
                        }
                    }
                    self.apply_tree(all);
                }
            }
            AggIn::Adopt {
                peer,
                version,
                from,
            } => {
                if self.up.is_none() || version > self.epoch {
                    self.adopt_wait = Some((peer, version, from));
                    self.try_attach();
                }
            }
            AggIn::Bye(peer) => {
                self.done.insert(peer);
                if self.up == Some(peer) {
                    self.up = None;
                }
                if !self.left && self.bye_sent.insert(peer) {
                    self.send(peer, Out::Finish);
                }
            }
            AggIn::Down { peer, reason } => self.on_down(peer, reason),
        }
        self.drain();
    }

    fn on_own(&mut self, clock: u64, grads: Option<Tensor>) {
        self.own_next = clock + 1;
        if self.ctx.reroute {
            self.own.insert(clock, grads.clone());
        }
        let ctx = self.ctx;
        let p = self
            .pending
            .entry(clock)
            .or_insert_with(|| Pending::new(ctx));
        p.own = true;
        if let Some(g) = grads {
            if let Err(e) = add_into(ctx.dtype, &mut p.values, g.as_bytes()) {
                self.fatal(PsError::Config(format!("own push: {e}")));
                return;
            }
            for b in 0..ctx.blocks() {
                p.sets.insert(b, ctx.rank);
            }
        }
    }

    fn on_child(&mut self, peer: usize, epoch: u64, clock: u64, sum: Option<ChildSum>) {
        let ctx = self.ctx;
        // A dead node's late sum, a former child's, or one sent before its re-attachment:
        // what it holds reaches the root another way (or is lost with the dead node).
        if self.dead.contains(&peer)
            || !self.tree.children(ctx.rank).contains(&peer)
            || epoch < self.accept.get(&peer).copied().unwrap_or(0)
        {
            log::debug!(
                "parameter server rank {}: ignored rank {peer}'s sum of clock {clock} (tree version {epoch})",
                ctx.rank
            );
            return;
        }
        let due = self.expect.get(&peer).copied().unwrap_or(0);
        if clock != due {
            self.fatal(PsError::Protocol {
                peer,
                what: format!("sent the sum of clock {clock} where clock {due} was due"),
            });
            return;
        }
        self.expect.insert(peer, due + 1);
        let p = self
            .pending
            .entry(clock)
            .or_insert_with(|| Pending::new(ctx));
        p.got.insert(peer);
        if let Some(s) = sum {
            let mut local = Partial {
                dtype: ctx.dtype,
                values: &mut p.values,
                contributors: &mut p.sets,
                first_block: 0,
            };
            if let Err(source) =
                accumulate(&mut local, s.values.as_bytes(), &s.sets, &s.arrived, ctx.bb)
            {
                self.fatal(CollectiveError::Aggregate { peer, source }.into());
            }
        }
    }

    /// A new version reached the cache: prune what it makes useless, pass it on.
    fn on_version(&mut self) {
        let v = self.ctx.shared.lock().cache.weights_clock().unwrap_or(0);
        self.own.retain(|&c, _| c >= v);
        self.completed.retain(|&c, _| c >= v);
        for c in self.children() {
            self.send_version(c);
        }
    }

    /// This node's cache to `peer`.
    fn send_version(&self, peer: usize) {
        let msg = {
            let st = self.ctx.shared.lock();
            let Some(version) = st.cache.weights_clock() else {
                return;
            };
            let (c, explicit) = block_clocks(&st.have, version);
            VersionMsg {
                clock: version,
                weights: st.weights.clone(),
                block_clocks: explicit.then(|| encode_clocks(&c)),
            }
        };
        self.send(peer, Out::Weights(Arc::new(msg)));
    }

    fn on_down(&mut self, peer: usize, reason: String) {
        let ctx = self.ctx;
        if self.done.contains(&peer) || self.dead.contains(&peer) {
            return;
        }
        if !self.worker() {
            if ctx.tree0.contains(peer) {
                log::warn!("parameter server: rank {peer} failed ({reason}); routing around it");
                let mut all = self.dead.clone();
                all.insert(peer);
                let list: Arc<Vec<usize>> = Arc::new(all.iter().copied().collect());
                for &q in self.outs.keys() {
                    if !all.contains(&q) && !self.bye_sent.contains(&q) {
                        self.send(q, Out::Tree(list.clone()));
                    }
                }
                self.apply_tree(all);
            }
            return;
        }
        if peer == ctx.root {
            self.fatal(PsError::Peer {
                rank: peer,
                reason: format!(
                    "the parameter server (rank {peer}) is gone: {reason} (MLNET waits for a replacement server; this job reports it: restart the job)"
                ),
            });
            return;
        }
        // Wait for the root's tree update; sums stay buffered meanwhile.
        if self.up == Some(peer) {
            self.up = None;
            self.detached_at = Some(self.dead.len() as u64);
        }
    }

    /// Switch to the tree without the `dead` ranks.
    fn apply_tree(&mut self, dead: BTreeSet<usize>) {
        let ctx = self.ctx;
        let me = ctx.rank;
        if dead.contains(&ctx.root) {
            self.fatal(PsError::Peer {
                rank: ctx.root,
                reason: "the parameter server is gone (MLNET waits for a replacement server; this job reports it: restart the job)".into(),
            });
            return;
        }
        if dead.contains(&me) {
            self.fatal(PsError::Peer {
                rank: me,
                reason: format!(
                    "the server declared this rank dead (its links were silent for {:?}); restart it",
                    ctx.failure_timeout
                ),
            });
            return;
        }
        let list: Vec<usize> = dead.iter().copied().collect();
        let (tree, star) = match repaired_tree(&ctx.tree0, &list, ctx.max_reparents) {
            Ok(x) => x,
            Err(e) => {
                self.fatal(PsError::Config(format!("tree repair: {e}")));
                return;
            }
        };
        let old = std::mem::replace(&mut self.tree, tree);
        let newly: Vec<usize> = dead.difference(&self.dead).copied().collect();
        self.dead = dead;
        let version = self.dead.len() as u64;
        let star_switch = star && !self.fell_back;
        self.fell_back |= star;
        // How far each dead child's sums got here: its children resume from there.
        let mut reached = BTreeMap::new();
        for d in &newly {
            if let Some(k) = self.expect.remove(d) {
                reached.insert(*d, k);
            }
            self.from.remove(d);
            self.accept.remove(d);
        }
        log::warn!(
            "parameter server rank {me}: tree version {version} without rank(s) {:?}{}",
            self.dead,
            if star { " (STAR fallback)" } else { "" }
        );
        let worker = self.worker();
        if star_switch {
            if worker {
                // Everything is re-sent from the own pushes: the partial sums mix workers
                // that now send to the root themselves.
                self.pending.clear();
                self.completed.clear();
                let own: Vec<(u64, Option<Tensor>)> =
                    self.own.iter().map(|(&c, g)| (c, g.clone())).collect();
                for (c, g) in own {
                    let mut p = Pending::new(ctx);
                    p.own = true;
                    if let Some(g) = g {
                        p.values.copy_from_slice(g.as_bytes());
                        for b in 0..ctx.blocks() {
                            p.sets.insert(b, me);
                        }
                    }
                    self.completed.insert(c, Arc::new(self.sum_msg(c, &p)));
                }
                self.next = self.own_next;
                for c in old.children(me) {
                    self.from.remove(c);
                    self.expect.remove(c);
                    self.accept.remove(c);
                }
                self.detach(version);
            } else {
                self.pending.clear();
                for c in self.children() {
                    self.adopt(c, version, self.next);
                }
            }
        } else {
            let before: BTreeSet<usize> = old.children(me).iter().copied().collect();
            for c in self.children() {
                if !before.contains(&c) {
                    let from = old
                        .parent(c)
                        .and_then(|d| reached.get(&d).copied())
                        .unwrap_or(self.next);
                    self.adopt(c, version, from);
                }
            }
            if worker && self.tree.parent(me) != old.parent(me) {
                self.detach(version);
            }
        }
        {
            let mut st = ctx.shared.lock();
            st.dead = self.dead.iter().copied().collect();
            st.tree_version = version;
            st.fell_back = self.fell_back;
        }
        self.try_attach();
    }

    /// Take `child` in: it sends its sums of clocks `from..` here (the earlier ones reached
    /// this node through its dead parent, or were applied).
    fn adopt(&mut self, child: usize, version: u64, from: u64) {
        self.from.insert(child, from);
        self.expect.insert(child, from);
        self.accept.insert(child, version);
        self.send(child, Out::Adopt { version, from });
        self.send_version(child);
    }

    fn detach(&mut self, version: u64) {
        self.up = None;
        self.detached_at = Some(version);
    }

    fn try_attach(&mut self) {
        let Some((peer, version, from)) = self.adopt_wait else {
            return;
        };
        let ok = self.tree.parent(self.ctx.rank) == Some(peer)
            && self.detached_at.is_some_and(|d| version >= d);
        if ok {
            self.adopt_wait = None;
            self.up = Some(peer);
            self.epoch = version;
            self.detached_at = None;
            self.sent_next = from;
        }
    }

    fn complete(&self, clock: u64) -> bool {
        let Some(p) = self.pending.get(&clock) else {
            return false;
        };
        (p.own || !self.worker())
            && self
                .tree
                .children(self.ctx.rank)
                .iter()
                .all(|c| self.from.get(c).copied().unwrap_or(0) > clock || p.got.contains(c))
    }

    /// Complete every clock that can be, in order; send what is due upstream.
    fn drain(&mut self) {
        if self.broken {
            return;
        }
        while self.complete(self.next) {
            let Some(p) = self.pending.remove(&self.next) else {
                break;
            };
            if self.worker() {
                let m = self.sum_msg(self.next, &p);
                self.completed.insert(self.next, Arc::new(m));
            } else if let Err(e) = apply(self.ctx, self.next, p) {
                self.fatal(e);
                return;
            } else {
                for c in self.children() {
                    self.send_version(c);
                }
            }
            self.next += 1;
        }
        if let Some(up) = self.up {
            while self.sent_next < self.next {
                if let Some(m) = self.completed.get(&self.sent_next) {
                    self.send(up, Out::Push(m.clone(), self.epoch));
                }
                self.sent_next += 1;
            }
        }
        let waiting_on: Vec<usize> = match self.pending.get(&self.next) {
            Some(p) => self
                .children()
                .into_iter()
                .filter(|c| !p.got.contains(c))
                .collect(),
            None => self.children(),
        };
        self.ctx.shared.lock().waiting = Some((self.next, waiting_on));
    }

    fn sum_msg(&self, clock: u64, p: &Pending) -> PushMsg {
        let ctx = self.ctx;
        let blocks = ctx.blocks();
        let mine = ctx.subtree0[ctx.rank].count(0);
        let empty = (0..blocks).all(|b| p.sets.count(b) == 0);
        let explicit = !ctx.reliable || (0..blocks).any(|b| p.sets.count(b) != mine);
        PushMsg {
            clock,
            values: (!empty).then(|| tensor_of(ctx.dtype, &p.values)),
            sets: (explicit && !empty).then(|| p.sets.encode(0..blocks)),
        }
    }

    /// Whether the node may leave: stopped, its children gone, its sums sent.
    fn may_leave(&self) -> bool {
        self.stop
            && self
                .children()
                .iter()
                .all(|c| self.done.contains(c) || self.dead.contains(c))
            && (!self.worker() || (self.up.is_some() && self.sent_next >= self.next))
    }

    fn leave(&mut self) {
        self.left = true;
        let peers: Vec<usize> = self.outs.keys().copied().collect();
        for q in peers {
            if self.bye_sent.insert(q) {
                self.send(q, Out::Finish);
            }
        }
    }
}

/// The aggregator, on the node's owning thread: sums each clock's pushes in clock order and
/// sends the sum up (a worker) or applies it (the server); repairs the tree on failures.
fn aggregate(ctx: &Ctx, rx: Receiver<AggIn>, outs: BTreeMap<usize, Sender<Out>>) {
    let mut agg = Agg::new(ctx, outs);
    if !agg.worker() {
        publish(ctx, None);
        for c in agg.children() {
            agg.send_version(c);
        }
    }
    loop {
        if ctx.shared.forced() || agg.broken {
            break;
        }
        if agg.may_leave() {
            agg.leave();
            break;
        }
        match rx.recv_timeout(ctx.poll) {
            Ok(m) => agg.handle(m),
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    if !agg.pending.is_empty() {
        log::warn!(
            "parameter server rank {}: stopped with {} clock(s) incomplete (from clock {}): some push never came",
            ctx.rank,
            agg.pending.len(),
            agg.next
        );
        ctx.shared
            .counters
            .dropped_clocks
            .fetch_add(agg.pending.len() as u64, Ordering::Relaxed);
    }
}

/// The server's update for `clock`; its weights become version `clock + 1`.
fn apply(ctx: &Ctx, clock: u64, mut p: Pending) -> Result<(), PsError> {
    let blocks = ctx.blocks();
    {
        let mut local = Partial {
            dtype: ctx.dtype,
            values: &mut p.values,
            contributors: &mut p.sets,
            first_block: 0,
        };
        finish(&mut local, ctx.bb, ReduceOp::Average, ctx.workers);
    }
    let complete_blocks = (0..blocks)
        .filter(|&b| p.sets.count(b) == ctx.workers)
        .count();
    let delivered_fraction = if blocks == 0 {
        1.0
    } else {
        (0..blocks)
            .map(|b| p.sets.count(b) as f64 / ctx.workers.max(1) as f64)
            .sum::<f64>()
            / blocks as f64
    };
    let mut st = ctx.shared.lock();
    apply_update(
        ctx.dtype,
        st.weights.as_bytes_mut(),
        &p.values,
        ctx.learning_rate,
    )?;
    if ctx.keep_updates > 0 {
        if st.updates.len() >= ctx.keep_updates {
            st.updates.pop_front();
        }
        st.updates.push_back(UpdateRecord {
            clock,
            contributors: p.sets,
            complete_blocks,
            delivered_fraction,
        });
    }
    st.updates_applied += 1;
    drop(st);
    publish(ctx, Some(clock + 1));
    Ok(())
}

/// The server's weights become version `clock` (None: version 0, the initial weights).
fn publish(ctx: &Ctx, clock: Option<u64>) {
    let version = clock.unwrap_or(0);
    {
        let mut st = ctx.shared.lock();
        st.cache.on_weights(version);
        st.have.fill(version + 1);
    }
    ctx.shared.cv.notify_all();
}

/// The node's owning thread: every link gets a sending and a receiving sub-thread; the
/// aggregator runs here.
fn node_main(mut links: Links, ctx: &Ctx, agg_tx: Sender<AggIn>, agg_rx: Receiver<AggIn>) {
    let (outs, ins) = match links.many(&ctx.peers, &ctx.peers) {
        Ok(x) => x,
        Err(e) => {
            ctx.fail(e.into());
            return;
        }
    };
    std::thread::scope(|sc| {
        let mut handles = Vec::new();
        let spawn_err = |e: std::io::Error| {
            ctx.fail(PsError::Config(format!(
                "cannot start a link thread: {e} (too many threads?)"
            )));
        };
        let name = |what: &str| format!("gw-ps{}-{what}", ctx.rank);
        let mut txs = BTreeMap::new();
        for ol in outs {
            let (tx, rx) = mpsc::channel::<Out>();
            txs.insert(ol.peer(), tx);
            let agg = agg_tx.clone();
            let b = std::thread::Builder::new().name(name(&format!("to{}", ol.peer())));
            match b.spawn_scoped(sc, move || sender_loop(ol, rx, ctx, agg)) {
                Ok(h) => handles.push(h),
                Err(e) => spawn_err(e),
            }
        }
        for il in ins {
            let agg = agg_tx.clone();
            let b = std::thread::Builder::new().name(name(&format!("from{}", il.peer())));
            match b.spawn_scoped(sc, move || peer_recv(il, ctx, agg)) {
                Ok(h) => handles.push(h),
                Err(e) => spawn_err(e),
            }
        }
        drop(agg_tx);
        aggregate(ctx, agg_rx, txs);
        for h in handles {
            if h.join().is_err() {
                ctx.fail(CollectiveError::ThreadPanicked.into());
            }
        }
    });
}

/// One rank's parameter-server node: the server at the tree's root, a worker elsewhere.
///
/// A worker iterates: [`pull`](PsNode::pull) weights within the staleness bound, compute,
/// [`push`](PsNode::push) the gradients, [`clock`](PsNode::clock). The server watches with
/// [`weights`](PsNode::weights) and [`wait_clock`](PsNode::wait_clock). Every rank ends with
/// [`shutdown`](PsNode::shutdown). A background error is returned by the next call that can
/// return one.
#[derive(Debug)]
pub struct PsNode {
    rank: usize,
    server: bool,
    dtype: DType,
    elems: usize,
    block_elems: usize,
    cfg: PsConfig,
    shared: Arc<Shared>,
    agg_tx: Option<Sender<AggIn>>,
    done_rx: Receiver<()>,
    owner: Option<JoinHandle<()>>,
    c_worker: u64,
    pushed: bool,
    pushes: u64,
    empty_clocks: u64,
    pulls: u64,
    pulls_from_cache: u64,
}

impl PsNode {
    /// Start this rank's node of job `job` over `links` (which must hold `tree_edges(&tree)`).
    /// Every member of `tree` calls it; the root is the server. `initial`: the model (f32,
    /// f16 or bf16); the server's is authoritative (it is multicast as version 0), the
    /// workers' only gives the dtype and length.
    pub fn start(
        links: Links,
        tree: Tree,
        job: u32,
        initial: &Tensor,
        cfg: PsConfig,
    ) -> Result<PsNode, PsError> {
        let mut links = links;
        let (rank, world) = (links.rank(), links.world());
        let dtype = initial.dtype();
        if dtype == DType::Raw {
            return Err(PsError::Config(
                "the model must be f32, f16 or bf16, not raw bytes".into(),
            ));
        }
        if initial.elems() == 0 {
            return Err(PsError::Config("the model has no elements".into()));
        }
        if !tree.contains(rank) {
            return Err(PsError::Config(format!(
                "rank {rank} is not a member of the tree (members {:?})",
                tree.members()
            )));
        }
        if tree.len() < 2 {
            return Err(PsError::Config(
                "the tree has no worker: a parameter server needs at least one".into(),
            ));
        }
        if let Some(m) = tree.members().into_iter().find(|&m| m >= world) {
            return Err(PsError::Config(format!(
                "tree member {m} is not a rank of this {world}-rank job"
            )));
        }
        if !cfg.learning_rate.is_finite() {
            return Err(PsError::Config(format!(
                "learning rate {} is not finite",
                cfg.learning_rate
            )));
        }
        if cfg.op_timeout.is_zero() {
            return Err(PsError::Config("op_timeout must be positive".into()));
        }
        if cfg.heartbeat.is_zero() || cfg.failure_timeout <= cfg.heartbeat {
            return Err(PsError::Config(format!(
                "heartbeat {:?} must be positive and below failure_timeout {:?} (a live peer must be heard before it counts as dead)",
                cfg.heartbeat, cfg.failure_timeout
            )));
        }
        if cfg.block_elems == Some(0) {
            return Err(PsError::Config("block_elems must be at least 1".into()));
        }
        let mut transfer = cfg.transfer.clone();
        transfer.connect_timeout = cfg.failure_timeout;
        transfer
            .validate()
            .map_err(|e| PsError::Config(e.to_string()))?;
        let parent = tree.parent(rank);
        // The tree's links must exist; with route-around, so may the spare ones.
        let mut peers: Vec<usize> = parent.into_iter().collect();
        peers.extend(tree.children(rank));
        {
            links.many(&peers, &peers)?;
        }
        if cfg.reroute {
            for (from, to) in fault_tolerant_edges(&tree) {
                if from == rank
                    && !peers.contains(&to)
                    && links.out(to).is_ok()
                    && links.inn(to).is_ok()
                {
                    peers.push(to);
                }
            }
        }
        let any_peer = peers.first().copied().unwrap_or(0);
        let block_elems = match cfg.block_elems {
            Some(b) => b,
            None => {
                let mtu = transfer.mtu;
                let payload = links
                    .out(any_peer)?
                    .segment_payload(dtype, mtu)
                    .ok_or_else(|| PsError::Config(format!("mtu {mtu} leaves no payload")))?;
                (payload / dtype.elem_size()).max(1)
            }
        };
        let layout = BlockLayout::new(initial.elems(), block_elems);
        let blocks = layout.blocks();
        let root = tree.root();
        let subtree_of = |c: usize| {
            let mut s = Contributors::none(1, world);
            if !tree.contains(c) {
                return s;
            }
            let mut stack = vec![c];
            while let Some(q) = stack.pop() {
                if q != root {
                    s.insert(0, q);
                }
                stack.extend_from_slice(tree.children(q));
            }
            s
        };
        let subtree0: Vec<Contributors> = (0..world).map(subtree_of).collect();
        let hop = hop_bound(cfg.loss_bound, tree.height());
        let heartbeat = cfg.heartbeat;
        let server = parent.is_none();
        let mut cache = WeightCache::new();
        let mut have = vec![0u64; blocks];
        if server {
            cache.on_weights(0);
            have.fill(1);
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                cache,
                weights: initial.clone(),
                have,
                error: None,
                failed: None,
                note: None,
                waiting: None,
                updates: VecDeque::new(),
                updates_applied: 0,
                stopped: false,
                dead: Vec::new(),
                tree_version: 0,
                fell_back: false,
            }),
            cv: Condvar::new(),
            force: AtomicBool::new(false),
            counters: Counters::default(),
        });
        let ctx = Arc::new(Ctx {
            rank,
            world,
            job,
            root,
            workers: tree.len() - 1,
            tree0: tree,
            peers,
            subtree0,
            dtype,
            layout,
            bb: block_elems * dtype.elem_size(),
            reliable: hop == LossBound::RELIABLE,
            hop_bound: hop,
            transfer,
            heartbeat,
            failure_timeout: cfg.failure_timeout,
            poll: heartbeat.min(Duration::from_millis(50)),
            learning_rate: cfg.learning_rate,
            keep_updates: cfg.keep_updates,
            reroute: cfg.reroute,
            max_reparents: cfg.max_reparents,
            shared: shared.clone(),
        });
        let (agg_tx, agg_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let thread_tx = agg_tx.clone();
        let owner = std::thread::Builder::new()
            .name(format!("gw-ps{rank}"))
            .spawn(move || {
                node_main(links, &ctx, thread_tx, agg_rx);
                {
                    let mut st = ctx.shared.lock();
                    st.stopped = true;
                }
                ctx.shared.cv.notify_all();
                let _ = done_tx.send(());
            })
            .map_err(|e| PsError::Config(format!("cannot start the node's thread: {e}")))?;
        Ok(PsNode {
            rank,
            server,
            dtype,
            elems: initial.elems(),
            block_elems,
            cfg,
            shared,
            agg_tx: Some(agg_tx),
            done_rx,
            owner: Some(owner),
            c_worker: 0,
            pushed: false,
            pushes: 0,
            empty_clocks: 0,
            pulls: 0,
            pulls_from_cache: 0,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether this node is the server (the tree's root).
    pub fn is_server(&self) -> bool {
        self.server
    }

    /// Elements per aggregation block.
    pub fn block_elems(&self) -> usize {
        self.block_elems
    }

    /// The worker's clock `c_worker` (0 at the server).
    pub fn worker_clock(&self) -> u64 {
        self.c_worker
    }

    fn check_tensor(&self, t: &Tensor) -> Result<(), PsError> {
        if t.dtype() != self.dtype || t.elems() != self.elems {
            return Err(PsError::Mismatch {
                expected: describe(self.dtype, self.elems),
                got: describe(t.dtype(), t.elems()),
            });
        }
        Ok(())
    }

    fn worker_only(&self, op: &'static str) -> Result<(), PsError> {
        if self.server {
            return Err(PsError::NotAWorker {
                rank: self.rank,
                op,
            });
        }
        Ok(())
    }

    fn send_own(&self, grads: Option<Tensor>) -> Result<(), PsError> {
        let sent = self.agg_tx.as_ref().is_some_and(|tx| {
            tx.send(AggIn::Own {
                clock: self.c_worker,
                grads,
            })
            .is_ok()
        });
        if sent {
            Ok(())
        } else {
            take_error(&mut self.shared.lock())?;
            Err(PsError::Stopped)
        }
    }

    /// Push the gradients of this worker's current clock (at most once per clock).
    pub fn push(&mut self, grads: &Tensor) -> Result<(), PsError> {
        self.worker_only("push")?;
        self.check_tensor(grads)?;
        take_error(&mut self.shared.lock())?;
        if self.pushed {
            return Err(PsError::AlreadyPushed {
                clock: self.c_worker,
            });
        }
        self.send_own(Some(grads.clone()))?;
        self.pushed = true;
        self.pushes += 1;
        Ok(())
    }

    /// End this worker's iteration: `c_worker += 1`; returns the new clock. A clock without a
    /// push contributes nothing (the server averages over the workers that pushed). On the
    /// server it does nothing and returns the model clock.
    pub fn clock(&mut self) -> u64 {
        if self.server {
            return self.shared.lock().cache.weights_clock().unwrap_or(0);
        }
        if !self.pushed {
            // A stopped node has nothing to tell; the next call reports why.
            if self.send_own(None).is_ok() {
                self.empty_clocks += 1;
            }
        }
        self.pushed = false;
        self.c_worker += 1;
        self.c_worker
    }

    /// Pull the weights into `weights`, within staleness `staleness` (`None`: the configured
    /// one): from the cache at once when its version `v` satisfies
    /// `pull_allowed(v, c_worker, s)`, else after waiting (at most `op_timeout`) for the
    /// multicast of a new enough version.
    pub fn pull(
        &mut self,
        weights: &mut Tensor,
        staleness: Option<u64>,
    ) -> Result<PullReport, PsError> {
        self.worker_only("pull")?;
        self.check_tensor(weights)?;
        let s = staleness.unwrap_or(self.cfg.staleness);
        let cw = self.c_worker;
        let started = Instant::now();
        let deadline = started + self.cfg.op_timeout;
        let mut waited = false;
        let mut st = self.shared.lock();
        loop {
            take_error(&mut st)?;
            if let Some(v) = st.cache.weights_clock() {
                if pull_allowed(v, cw, s) {
                    weights
                        .as_bytes_mut()
                        .copy_from_slice(st.weights.as_bytes());
                    let fresh = st.have.iter().filter(|&&h| h == v + 1).count();
                    let blocks = st.have.len().max(1);
                    drop(st);
                    self.pulls += 1;
                    if !waited {
                        self.pulls_from_cache += 1;
                    }
                    return Ok(PullReport {
                        weights_clock: v,
                        served_from_cache: !waited,
                        waited: if waited {
                            started.elapsed()
                        } else {
                            Duration::ZERO
                        },
                        delivered_fraction: fresh as f64 / blocks as f64,
                    });
                }
            }
            if st.stopped {
                return Err(PsError::Stopped);
            }
            let now = Instant::now();
            if now >= deadline {
                let need = cw.saturating_sub(s);
                return Err(PsError::Timeout {
                    what: format!(
                        "the weights of clock {need} or newer (worker clock {cw}, staleness {s}; this node holds {}){}",
                        st.cache
                            .weights_clock()
                            .map_or("none".to_string(), |c| format!("clock {c}")),
                        waiting_note(&st)
                    ),
                    waited: started.elapsed(),
                });
            }
            waited = true;
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The newest weights this node holds and their clock: the server's current weights, a
    /// worker's cache (before the first version arrives: its `initial` at clock 0).
    pub fn weights(&self) -> (u64, Tensor) {
        let st = self.shared.lock();
        (st.cache.weights_clock().unwrap_or(0), st.weights.clone())
    }

    /// Wait until this node holds weights of clock `c` or newer (at the server: until every
    /// worker's gradients of clocks below `c` are applied); returns the clock held.
    pub fn wait_clock(&self, c: u64, timeout: Duration) -> Result<u64, PsError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut st = self.shared.lock();
        loop {
            take_error(&mut st)?;
            if let Some(v) = st.cache.weights_clock().filter(|&v| v >= c) {
                return Ok(v);
            }
            if st.stopped {
                return Err(PsError::Stopped);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PsError::Timeout {
                    what: format!(
                        "clock {c} at rank {} (it holds {}){}",
                        self.rank,
                        st.cache
                            .weights_clock()
                            .map_or("none".to_string(), |v| format!("clock {v}")),
                        waiting_note(&st)
                    ),
                    waited: started.elapsed(),
                });
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stop the node: a worker's pushes so far still reach the server. Every rank calls it
    /// after its last iteration; a worker returns once its subtree has stopped and its parent
    /// acknowledged, the server once every worker has. Each phase waits at most
    /// `op_timeout`; then the node leaves anyway (its peers see the link close). Returns the
    /// first background error not returned yet, or a timeout when the node had to leave.
    pub fn shutdown(mut self) -> Result<PsStats, PsError> {
        let op = self.cfg.op_timeout;
        if let Some(tx) = self.agg_tx.take() {
            let _ = tx.send(AggIn::Stop);
        }
        // Drain (a failed node leaves at once: what it would wait for may never come).
        let deadline = Instant::now() + op;
        let mut forced = false;
        let mut timed_out = false;
        let mut ended = false;
        while !ended {
            if !forced && self.shared.lock().failed.is_some() {
                forced = true;
                self.shared.force.store(true, Ordering::SeqCst);
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            ended = self.wait_done((deadline - now).min(Duration::from_millis(50)));
        }
        if !ended {
            timed_out = !forced;
            self.shared.force.store(true, Ordering::SeqCst);
            // Every blocking step of a thread is bounded by op_timeout (a silent peer) or a
            // heartbeat (a live one).
            ended = self.wait_done(op + Duration::from_secs(1));
        }
        if ended {
            if let Some(h) = self.owner.take() {
                if h.join().is_err() {
                    return Err(CollectiveError::ThreadPanicked.into());
                }
            }
        }
        let stats = self.stats();
        let mut st = self.shared.lock();
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        if let Some(m) = &st.failed {
            return Err(PsError::Failed(m.clone()));
        }
        if !ended {
            return Err(PsError::Timeout {
                what: format!(
                    "rank {}'s link threads to stop (left running; they end on their own)",
                    self.rank
                ),
                waited: op * 2,
            });
        }
        if timed_out {
            return Err(PsError::Timeout {
                what: format!(
                    "rank {}'s subtree and parent to finish (the node left without them){}",
                    self.rank,
                    waiting_note(&st)
                ),
                waited: op,
            });
        }
        Ok(stats)
    }

    fn wait_done(&self, timeout: Duration) -> bool {
        match self.done_rx.recv_timeout(timeout) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => true,
            Err(RecvTimeoutError::Timeout) => false,
        }
    }

    fn stats(&self) -> PsStats {
        let c = &self.shared.counters;
        let st = self.shared.lock();
        PsStats {
            rank: self.rank,
            server: self.server,
            model_clock: st.cache.weights_clock().unwrap_or(0),
            worker_clock: self.c_worker,
            pushes: self.pushes,
            empty_clocks: self.empty_clocks,
            pulls: self.pulls,
            pulls_from_cache: self.pulls_from_cache,
            sums_sent: c.sums_sent.load(Ordering::Relaxed),
            updates_applied: st.updates_applied,
            versions_received: c.versions_received.load(Ordering::Relaxed),
            versions_sent: c.versions_sent.load(Ordering::Relaxed),
            heartbeats_sent: c.heartbeats_sent.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            dropped_clocks: c.dropped_clocks.load(Ordering::Relaxed),
            updates: st.updates.iter().cloned().collect(),
            dead: st.dead.clone(),
            tree_version: st.tree_version,
            fell_back_to_star: st.fell_back,
        }
    }
}

fn waiting_note(st: &State) -> String {
    match &st.waiting {
        Some((c, ranks)) if !ranks.is_empty() => {
            format!("; this node still waits for the push of clock {c} from rank(s) {ranks:?}")
        }
        _ => String::new(),
    }
}

impl Drop for PsNode {
    /// Without [`PsNode::shutdown`]: the node leaves at once, pushes not yet sent included
    /// (its threads end on their own within `op_timeout`; peers see the links close and
    /// fail). Never blocks.
    fn drop(&mut self) {
        if self.owner.is_some() {
            self.shared.force.store(true, Ordering::SeqCst);
            if let Some(tx) = self.agg_tx.take() {
                let _ = tx.send(AggIn::Stop);
            }
            self.shared.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate::test_bytes::{f32_bytes, f32_of};
    use crate::link::{tree_edges, MemLinkConfig};
    use crate::tree::Strategy;
    use proptest::prelude::*;

    #[test]
    fn header_round_trip_and_refusals() {
        for h in [
            Header::new(Kind::Heartbeat, 0, 0),
            Header::new(Kind::Push, F_SIDE, 7),
            Header::new(Kind::Push, F_EMPTY, u64::MAX),
            Header {
                kind: Kind::Fail,
                flags: 0,
                len: 42,
                clock: 3,
            },
        ] {
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
        let good = Header::new(Kind::Bye, 0, 1).encode();
        assert!(Header::decode(&good[..15]).is_err());
        let mut bad = good;
        bad[0] = 0;
        assert!(Header::decode(&bad).is_err());
        let mut bad = good;
        bad[1] = 9;
        assert!(Header::decode(&bad).unwrap_err().contains("kind 9"));
        let mut bad = good;
        bad[2] = 0x80;
        assert!(Header::decode(&bad).is_err());
    }

    #[test]
    fn the_loss_bound_is_split_over_the_hops() {
        let p = LossBound::from_fraction(0.05).unwrap();
        assert_eq!(hop_bound(p, 1), p);
        assert_eq!(hop_bound(p, 2).ppm(), 25_000);
        assert_eq!(hop_bound(p, 0), p);
        assert_eq!(hop_bound(LossBound::RELIABLE, 3), LossBound::RELIABLE);
        // Too small to split: reliable, never more loss than asked for.
        assert_eq!(
            hop_bound(LossBound::from_ppm(2).unwrap(), 3),
            LossBound::RELIABLE
        );
    }

    #[test]
    fn the_update_is_exact_for_small_values() {
        let mut w = f32_bytes(&[1.0, -2.0, 3.5]);
        apply_update(DType::F32, &mut w, &f32_bytes(&[0.5, 1.0, -2.0]), 0.5).unwrap();
        assert_eq!(f32_of(&w), vec![0.75, -2.5, 4.5]);
        let mut h: Vec<u8> = [half::f16::from_f32(1.0), half::f16::from_f32(4.0)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let g: Vec<u8> = [half::f16::from_f32(2.0), half::f16::from_f32(-1.0)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        apply_update(DType::F16, &mut h, &g, 0.25).unwrap();
        assert_eq!(half::f16::from_le_bytes([h[0], h[1]]).to_f32(), 0.5);
        assert_eq!(half::f16::from_le_bytes([h[2], h[3]]).to_f32(), 4.25);
        assert!(apply_update(DType::F32, &mut w, &[0u8; 4], 1.0).is_err());
    }

    #[test]
    fn block_clocks_encode_and_refuse_the_future() {
        let have = [0u64, 3, 4];
        let (c, explicit) = block_clocks(&have, 3);
        assert_eq!(c, vec![NOT_HELD, 2, 3]);
        assert!(explicit);
        assert_eq!(block_clocks(&[4, 4], 3), (vec![3, 3], false));
        let bytes = encode_clocks(&c);
        assert_eq!(decode_clocks(&bytes, 3, 3), Ok(c.clone()));
        assert!(decode_clocks(&bytes, 3, 2).unwrap_err().contains("newer"));
        assert!(decode_clocks(&bytes[..16], 3, 3).is_err());
    }

    #[test]
    fn sets_must_stay_inside_the_subtree() {
        let world = 6;
        let mut allowed = Contributors::none(1, world);
        allowed.insert(0, 2);
        allowed.insert(0, 4);
        let mut sets = Contributors::none(3, world);
        sets.insert(0, 2);
        sets.insert(1, 4);
        sets.insert(1, 2);
        assert!(sets_within(&sets, &allowed));
        sets.insert(2, 5);
        assert!(!sets_within(&sets, &allowed));
    }

    #[test]
    fn one_failure_reparents_more_fall_back_to_star() {
        let members: Vec<usize> = (0..7).collect();
        let t = Tree::build(Strategy::BINARY, 0, &members, &[0; 7]).unwrap();
        let interior: Vec<usize> = (1..7).filter(|&r| !t.children(r).is_empty()).collect();
        let d = interior[0];
        let (r, star) = repaired_tree(&t, &[d], 1).unwrap();
        assert!(!star);
        assert_eq!(r, t.reparent(d).unwrap());
        assert_eq!(repaired_tree(&t, &[], 1).unwrap(), (t.clone(), false));
        // Two failures: STAR over the survivors.
        let (s, star) = repaired_tree(&t, &[interior[1], d, d], 1).unwrap();
        assert!(star);
        assert_eq!(s.height(), 1);
        assert!(!s.contains(d) && !s.contains(interior[1]));
        assert_eq!(s.len(), 5);
        // Allowed two re-parentings, siblings both go to the root (links exist) ...
        let (two, star) = repaired_tree(&t, &interior, 2).unwrap();
        assert!(!star);
        assert_eq!(two.height(), 1);
        // ... but a dead parent and grandparent would need a link nobody has.
        let chain = Tree::build(Strategy::Degree(1), 0, &[0, 1, 2, 3, 4], &[0; 5]).unwrap();
        let (c, star) = repaired_tree(&chain, &[1], 3).unwrap();
        assert!(!star && c.parent(2) == Some(0));
        let (c, star) = repaired_tree(&chain, &[2, 3], 3).unwrap();
        assert!(star, "{c:?}");
        assert_eq!(
            repaired_tree(&chain, &[0], 3).unwrap_err(),
            TreeError::RootFailed(0)
        );
    }

    #[test]
    fn spare_links_cover_every_repair() {
        let members: Vec<usize> = (0..9).collect();
        for strat in [Strategy::BINARY, Strategy::Degree(1), Strategy::Degree(3)] {
            let t = Tree::build(strat, 0, &members, &[0; 9]).unwrap();
            let e: BTreeSet<(usize, usize)> = fault_tolerant_edges(&t).into_iter().collect();
            assert_eq!(e.len(), fault_tolerant_edges(&t).len());
            for d in 1..9 {
                let (r, _) = repaired_tree(&t, &[d], 1).unwrap();
                for (c, p) in r.edges() {
                    assert!(
                        e.contains(&(c, p)) && e.contains(&(p, c)),
                        "{strat}: {c}-{p}"
                    );
                }
            }
            for (c, p) in t.star().edges() {
                assert!(e.contains(&(c, p)) && e.contains(&(p, c)));
            }
        }
    }

    proptest! {
        /// Whatever order and loss versions arrive with, each block holds the newest
        /// version whose block reached it, and never goes back.
        #[test]
        fn merge_keeps_the_newest_block_that_arrived(
            arrivals in proptest::collection::vec(
                (0u64..20, proptest::collection::vec(any::<bool>(), 4)), 0..30),
        ) {
            let (bb, blocks) = (8usize, 4usize);
            let value = |clock: u64, b: usize| (clock * 10 + b as u64) as f32;
            let mut w = vec![0u8; bb * blocks];
            let mut have = vec![0u64; blocks];
            let mut best: Vec<Option<u64>> = vec![None; blocks];
            for (clock, arrived) in arrivals {
                let incoming = f32_bytes(
                    &(0..blocks).flat_map(|b| [value(clock, b); 2]).collect::<Vec<_>>(),
                );
                let before = have.clone();
                merge_blocks(&mut w, &mut have, &incoming, &vec![clock; blocks], &arrived, bb);
                for b in 0..blocks {
                    if arrived[b] {
                        best[b] = best[b].max(Some(clock));
                    }
                    prop_assert!(have[b] >= before[b]);
                    prop_assert_eq!(have[b], best[b].map_or(0, |c| c + 1));
                    if let Some(c) = best[b] {
                        prop_assert_eq!(f32_of(&w[b * bb..(b + 1) * bb]), vec![value(c, b); 2]);
                    }
                }
            }
        }

        #[test]
        fn header_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(h) = Header::decode(&bytes) {
                // Canonical: whatever is accepted re-encodes to the same bytes.
                prop_assert_eq!(&h.encode()[..], &bytes[..]);
            }
        }

        #[test]
        fn headers_round_trip(
            kind in 1u8..=7,
            flags in 0u8..4,
            len in any::<u32>(),
            clock in any::<u64>(),
        ) {
            let kind = [Kind::Heartbeat, Kind::Bye, Kind::Push, Kind::Weights, Kind::Fail,
                Kind::Tree, Kind::Adopt][usize::from(kind - 1)];
            let h = Header { kind, flags, len, clock };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }

    fn star(world: usize) -> Tree {
        let members: Vec<usize> = (0..world).collect();
        Tree::build(Strategy::Star, 0, &members, &vec![0; world]).unwrap()
    }

    fn mem_links(tree: &Tree, world: usize) -> Vec<Links> {
        Links::in_memory(world, &tree_edges(tree), &MemLinkConfig::default()).unwrap()
    }

    #[test]
    fn start_refuses_bad_set_ups() {
        let t = star(3);
        let model = Tensor::from_f32(&[1.0; 10]);
        let start_as = |rank: usize, t: &Tree, model: &Tensor, cfg: PsConfig| {
            let l = mem_links(&star(3), 3).remove(rank);
            PsNode::start(l, t.clone(), 1, model, cfg).map(|_| ())
        };
        let start = |t: &Tree, model: &Tensor, cfg: PsConfig| start_as(1, t, model, cfg);
        let cfg = PsConfig::default();
        let is_config = |r: Result<(), PsError>| matches!(r, Err(PsError::Config(_)));
        assert!(is_config(start(
            &t,
            &Tensor::zeros(DType::Raw, 4),
            cfg.clone()
        )));
        assert!(is_config(start(
            &t,
            &Tensor::zeros(DType::F32, 0),
            cfg.clone()
        )));
        // Rank 1 outside the tree; a tree of the server alone.
        let lone = Tree::build(Strategy::Star, 0, &[0], &[0; 3]).unwrap();
        assert!(is_config(start(&lone, &model, cfg.clone())));
        let r = start_as(0, &lone, &model, cfg.clone());
        assert!(
            matches!(&r, Err(PsError::Config(m)) if m.contains("no worker")),
            "{r:?}"
        );
        let nan = PsConfig {
            learning_rate: f32::NAN,
            ..cfg.clone()
        };
        assert!(is_config(start(&t, &model, nan)));
        let zero_block = PsConfig {
            block_elems: Some(0),
            ..cfg.clone()
        };
        assert!(is_config(start(&t, &model, zero_block)));
        let zero_timeout = PsConfig {
            op_timeout: Duration::ZERO,
            ..cfg.clone()
        };
        assert!(is_config(start(&t, &model, zero_timeout)));
        let no_heartbeat = PsConfig {
            heartbeat: Duration::ZERO,
            ..cfg.clone()
        };
        assert!(is_config(start(&t, &model, no_heartbeat)));
        let deaf = PsConfig {
            failure_timeout: Duration::from_millis(100),
            ..cfg.clone()
        };
        assert!(is_config(start(&t, &model, deaf)));
        // A tree whose edges the links do not have: rank 1 under rank 2.
        let chain = Tree::build(Strategy::Degree(1), 0, &[0, 2, 1], &[0; 3]).unwrap();
        let r = start(&chain, &model, cfg);
        assert!(
            matches!(r, Err(PsError::Collective(CollectiveError::NoLink { .. }))),
            "{r:?}"
        );
    }

    /// Links idle for several op_timeouts stay up: heartbeats keep a slow peer apart from a
    /// dead one.
    #[test]
    fn idle_links_live_on_heartbeats() {
        let world = 3;
        let t = star(world);
        let cfg = PsConfig {
            op_timeout: Duration::from_millis(400),
            learning_rate: 1.0,
            ..PsConfig::default()
        };
        let model = Tensor::from_f32(&[0.0; 64]);
        let stats: Vec<PsStats> = std::thread::scope(|s| {
            let hs: Vec<_> = mem_links(&t, world)
                .into_iter()
                .map(|l| {
                    let (t, cfg, model) = (t.clone(), cfg.clone(), &model);
                    s.spawn(move || {
                        let mut node = PsNode::start(l, t, 1, model, cfg).unwrap();
                        std::thread::sleep(Duration::from_millis(1_500));
                        if node.is_server() {
                            node.wait_clock(1, Duration::from_secs(10)).unwrap();
                        } else {
                            let mut w = Tensor::from_f32(&[0.0; 64]);
                            node.pull(&mut w, None).unwrap();
                            node.push(&Tensor::from_f32(&[2.0; 64])).unwrap();
                            node.clock();
                            node.pull(&mut w, None).unwrap();
                            assert_eq!(w.as_f32().unwrap(), &[-2.0; 64]);
                        }
                        node.shutdown().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for s in &stats {
            assert!(s.heartbeats_sent > 0, "{s:?}");
        }
    }
}
