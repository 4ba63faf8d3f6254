//! The parameter server's API: [`PsNode`].

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};

use super::core::AggIn;
use super::io::{bind, node_main};
use super::repair::fault_tolerant_edges;
use super::state::{describe, digest_takers, take_error, Ctx, Shared, State};
use super::types::{PsConfig, PsError, PsStats, PullReport};
use crate::clock::pull_allowed;
use crate::error::CollectiveError;
use crate::link::Links;
use crate::tree::Tree;

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
    /// Whether the node's message-layer datagrams are sealed (authenticated links).
    sealed: bool,
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
        if cfg.verify_versions && cfg.loss_bound != LossBound::RELIABLE {
            return Err(PsError::Config(
                "verify_versions needs a reliable parameter server (loss_bound 0): a bounded \
                 version is merged block by block"
                    .into(),
            ));
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
        {
            // The server's digests go straight to every worker that checks versions.
            let root = tree.root();
            let takers = digest_takers(&tree, cfg.verify_versions);
            let missing: Vec<usize> = if rank == root {
                takers.into_iter().filter(|r| !peers.contains(r)).collect()
            } else if takers.contains(&rank) && !peers.contains(&root) {
                vec![root]
            } else {
                Vec::new()
            };
            if !missing.is_empty() {
                return Err(PsError::Config(format!(
                    "verify_versions needs links between the server and every worker below \
                     its children (fault_tolerant_edges): rank {rank} has none with {missing:?}"
                )));
            }
        }
        let any_peer = peers.first().copied().unwrap_or(0);
        let toward = links.out(any_peer)?.dst();
        let bound = bind(
            toward,
            job,
            rank,
            world,
            transfer.mtu,
            // Twice the failure timeout: a neighbour starts its endpoint only once its own
            // address exchange is over, which a dead neighbour of its own holds up for up to
            // a failure timeout. At least the transfers' idle timeout: a message's data may
            // stall that long under incast before it counts as dead, as a flow's could. An
            // idle link heard from fails after `failure_timeout` (`core::Liveness`).
            cfg.failure_timeout
                .saturating_mul(2)
                .max(transfer.idle_timeout),
            cfg.inject_loss,
            links.job_key().cloned(),
        )?;
        let block_elems = match cfg.block_elems {
            Some(b) => b,
            // One block per segment of the layer, so a lost segment costs one block.
            None => (bound.seg_payload() / dtype.elem_size()).max(1),
        };
        let server = parent.is_none();
        let sealed = bound.member().is_some();
        let ctx = Arc::new(Ctx::new(
            rank,
            world,
            job,
            tree,
            peers,
            initial,
            block_elems,
            &cfg,
            transfer,
        ));
        let shared = ctx.shared.clone();
        let (agg_tx, agg_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let thread_tx = agg_tx.clone();
        let owner = std::thread::Builder::new()
            .name(format!("gw-ps{rank}"))
            .spawn(move || {
                node_main(links, bound, &ctx, thread_tx, agg_rx);
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
            sealed,
        })
    }

    /// Tests: this node sends `out` to `peer` whatever its role allows.
    #[cfg(test)]
    pub(super) fn forge(&self, peer: usize, out: crate::ps::core::Out) {
        if let Some(tx) = &self.agg_tx {
            let _ = tx.send(AggIn::Forge { peer, out });
        }
    }

    /// Tests: this node fails, blaming `rank`, and tells its neighbours so.
    #[cfg(test)]
    pub(super) fn forge_failure(&self, rank: usize, reason: &str) {
        self.shared.fail(
            self.rank,
            PsError::Peer {
                rank,
                reason: reason.into(),
            },
            None,
        );
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
        self.shared
            .counters
            .own_clocks
            .fetch_max(self.c_worker + 1, Ordering::SeqCst);
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
            claims_refused: c.claims_refused.load(Ordering::Relaxed),
            versions_verified: c.versions_verified.load(Ordering::Relaxed),
            updates: st.updates.iter().cloned().collect(),
            dead: st.dead.clone(),
            tree_version: st.tree_version,
            fell_back_to_star: st.fell_back,
            sealed: self.sealed,
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
    use crate::link::{tree_edges, Links, MemLinkConfig};
    use crate::tree::{Strategy, Tree};

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
