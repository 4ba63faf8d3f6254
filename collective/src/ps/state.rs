//! What the node's background work shares with the API calls: the weights cache, the first
//! error, counters, and the read-only context of the node.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::TransferConfig;

use super::core::{hop_bound, merge_blocks};
use super::types::{PsConfig, PsError, UpdateRecord};
use super::wire::DIGEST_LEN;
use crate::aggregate::{BlockLayout, Contributors};
use crate::clock::WeightCache;
use crate::tree::Tree;

#[derive(Debug, Clone)]
pub(super) struct FailNote {
    pub(super) origin: usize,
    pub(super) reason: String,
    pub(super) came_from: Option<usize>,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) cache: WeightCache,
    pub(super) weights: Tensor,
    /// Per block: 1 + the clock of its values; 0: never received (the local initial values).
    pub(super) have: Vec<u64>,
    /// The first background error, until an API call returns it.
    pub(super) error: Option<PsError>,
    /// The first background error's message (sticky).
    pub(super) failed: Option<String>,
    pub(super) note: Option<FailNote>,
    /// The clock the aggregator waits to complete and the ranks it waits for.
    pub(super) waiting: Option<(u64, Vec<usize>)>,
    pub(super) updates: VecDeque<UpdateRecord>,
    pub(super) updates_applied: u64,
    pub(super) stopped: bool,
    pub(super) dead: Vec<usize>,
    pub(super) tree_version: u64,
    pub(super) fell_back: bool,
    /// [`PsConfig::verify_versions`] below the server's children: versions received and
    /// not yet checked (clock -> values, the rank that passed it down), and the server's
    /// digests not yet used (clock -> digest). Both bounded by [`MAX_UNCHECKED`].
    pub(super) staged: BTreeMap<u64, (Tensor, usize)>,
    pub(super) digests: BTreeMap<u64, [u8; DIGEST_LEN]>,
}

impl State {
    /// Takes version `clock` into the cache: each block that arrived, the sender held
    /// (`clocks`) and is newer than the cache's ([`merge_blocks`]).
    pub(super) fn take_version(
        &mut self,
        clock: u64,
        values: &[u8],
        clocks: &[u64],
        arrived: &[bool],
        bb: usize,
    ) {
        merge_blocks(
            self.weights.as_bytes_mut(),
            &mut self.have,
            values,
            clocks,
            arrived,
            bb,
        );
        self.cache.on_weights(clock);
    }
}

/// Versions, and digests, a worker keeps unchecked at most (the oldest go first): versions
/// come one at a time per link and a digest soon after its version.
pub(super) const MAX_UNCHECKED: usize = 8;

/// [`PsConfig::verify_versions`]: the workers that check every version against the
/// server's digest, sent to them directly: those below the server's children, whose
/// versions come through aggregators (none when it is off).
pub(super) fn digest_takers(tree: &Tree, verify: bool) -> Vec<usize> {
    if !verify {
        return Vec::new();
    }
    tree.members()
        .into_iter()
        .filter(|&r| tree.depth(r).is_some_and(|d| d >= 2))
        .collect()
}

/// The server's digest of version `clock` of the weights (the collectives' result digest).
pub(super) fn version_digest(clock: u64, weights: &[u8]) -> [u8; DIGEST_LEN] {
    crate::algo::digest(b"gradwire ps version v1", clock, weights, &[])
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) sums_sent: AtomicU64,
    pub(super) versions_received: AtomicU64,
    pub(super) versions_sent: AtomicU64,
    pub(super) heartbeats_sent: AtomicU64,
    pub(super) bytes_sent: AtomicU64,
    pub(super) dropped_clocks: AtomicU64,
    pub(super) claims_refused: AtomicU64,
    pub(super) versions_verified: AtomicU64,
    /// 1 + the newest clock this worker handed the aggregator (its own push or an empty
    /// clock): no honest version is newer.
    pub(super) own_clocks: AtomicU64,
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    pub(super) force: AtomicBool,
    /// The node closed its endpoint: its messages' failures mean nothing.
    pub(super) closing: AtomicBool,
    /// Per rank: its Bye arrived (nothing more is owed on the link).
    pub(super) byes: Vec<AtomicBool>,
    pub(super) counters: Counters,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keep the first background error (and tell the neighbours); log the others.
    pub(super) fn fail(&self, rank: usize, err: PsError, came_from: Option<usize>) {
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

    pub(super) fn said_bye(&self, peer: usize) -> bool {
        self.byes
            .get(peer)
            .is_some_and(|b| b.load(Ordering::SeqCst))
    }

    pub(super) fn set_bye(&self, peer: usize) {
        if let Some(b) = self.byes.get(peer) {
            b.store(true, Ordering::SeqCst);
        }
    }

    /// Whether this node failed (it then leaves without a Bye: its peers must see the link
    /// end, not a clean finish that owes them nothing).
    pub(super) fn has_failed(&self) -> bool {
        self.lock().failed.is_some()
    }

    pub(super) fn forced(&self) -> bool {
        self.force.load(Ordering::SeqCst)
    }

    pub(super) fn note_for(&self, peer: usize) -> Option<FailNote> {
        self.lock()
            .note
            .clone()
            .filter(|n| n.came_from != Some(peer))
    }
}

/// The error a call must return first, if any: the background error once, then `Failed`.
pub(super) fn take_error(st: &mut State) -> Result<(), PsError> {
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
pub(super) struct Ctx {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) job: u32,
    pub(super) root: usize,
    /// The tree the job started with.
    pub(super) tree0: Tree,
    /// The ranks this node has links with (both ways).
    pub(super) peers: Vec<usize>,
    /// Per rank: a one-block set of the workers in its subtree of `tree0` (a repair only
    /// moves nodes up, so a subtree never gains workers outside it).
    pub(super) subtree0: Vec<Contributors>,
    /// This rank's ancestors in `tree0`, the root included: its parent and every node a
    /// repair can make its parent. Only they send it versions and tree updates.
    pub(super) ancestors0: Vec<usize>,
    /// [`PsConfig::verify_versions`]: at the server, the workers it sends each version's
    /// digest to (those below its children); at such a worker, `true` in `verify_here`.
    pub(super) digest_to: Vec<usize>,
    pub(super) verify_here: bool,
    pub(super) workers: usize,
    pub(super) dtype: DType,
    pub(super) layout: BlockLayout,
    /// Bytes per whole block.
    pub(super) bb: usize,
    pub(super) reliable: bool,
    pub(super) hop_bound: LossBound,
    pub(super) transfer: TransferConfig,
    pub(super) heartbeat: Duration,
    pub(super) failure_timeout: Duration,
    pub(super) poll: Duration,
    pub(super) learning_rate: f32,
    pub(super) keep_updates: usize,
    pub(super) reroute: bool,
    pub(super) max_reparents: usize,
    pub(super) shared: Arc<Shared>,
}

impl Ctx {
    /// The context of `rank`'s node (of `world` ranks) of `job` on `tree`, with links to `peers`, a model like
    /// `initial` (whose values are the node's until a version arrives; the server's are
    /// version 0) in blocks of `block_elems`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        rank: usize,
        world: usize,
        job: u32,
        tree: Tree,
        peers: Vec<usize>,
        initial: &Tensor,
        block_elems: usize,
        cfg: &PsConfig,
        transfer: TransferConfig,
    ) -> Ctx {
        let dtype = initial.dtype();
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
        let ancestors0: Vec<usize> =
            std::iter::successors(tree.parent(rank), |&a| tree.parent(a)).collect();
        let takers = digest_takers(&tree, cfg.verify_versions);
        let verify_here = takers.contains(&rank);
        let digest_to = if tree.parent(rank).is_none() {
            takers
        } else {
            Vec::new()
        };
        let hop = hop_bound(cfg.loss_bound, tree.height());
        let heartbeat = cfg.heartbeat;
        let server = tree.parent(rank).is_none();
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
                staged: BTreeMap::new(),
                digests: BTreeMap::new(),
            }),
            cv: Condvar::new(),
            force: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            byes: (0..world).map(|_| AtomicBool::new(false)).collect(),
            counters: Counters::default(),
        });
        Ctx {
            rank,
            world,
            job,
            root,
            workers: tree.len() - 1,
            tree0: tree,
            peers,
            subtree0,
            ancestors0,
            digest_to,
            verify_here,
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
            shared,
        }
    }
}

impl Ctx {
    pub(super) fn fail(&self, err: PsError) {
        self.shared.fail(self.rank, err, None);
    }

    pub(super) fn blocks(&self) -> usize {
        self.layout.blocks()
    }

    /// Whether `peer` may send this rank weights versions and tree updates: the server and
    /// this rank's aggregators (its ancestors), who hold its weights anyway.
    pub(super) fn above(&self, peer: usize) -> bool {
        self.ancestors0.contains(&peer)
    }

    /// Whether `peer` is below `rank` in the original tree (in its subtree, or itself).
    pub(super) fn below(&self, rank: usize, peer: usize) -> bool {
        peer == rank
            || self
                .subtree0
                .get(rank)
                .is_some_and(|s| peer < s.world() && s.contains(0, peer))
    }

    /// Whether `peer` may report that rank `origin` failed: one above this rank, or one
    /// that speaks for its own subtree (the news travels up from the failed rank, then down
    /// from the ancestors; a leaf cannot blame a rank elsewhere in the tree).
    pub(super) fn may_report(&self, peer: usize, origin: usize) -> bool {
        self.above(peer) || self.below(peer, origin)
    }
}

pub(super) fn describe(dtype: DType, elems: usize) -> String {
    format!("{elems} x {dtype}")
}

pub(super) fn tensor_of(dtype: DType, bytes: &[u8]) -> Tensor {
    let mut t = Tensor::zeros(dtype, bytes.len() / dtype.elem_size());
    t.as_bytes_mut().copy_from_slice(bytes);
    t
}

pub(super) fn raw_tensor(bytes: &[u8]) -> Tensor {
    tensor_of(DType::Raw, bytes)
}
