//! The aggregator: per-clock sums, the server's updates, versions down the tree, and the
//! re-parenting state machine.

use std::collections::{BTreeMap, BTreeSet};

use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};

use super::repair::repaired_tree;
use super::state::{tensor_of, version_digest, Ctx};
use super::types::{PsError, UpdateRecord};
use super::wire::{block_clocks, encode_clocks, DIGEST_LEN, NOT_HELD};
use crate::aggregate::{accumulate, add_into, finish, scale, Contributors, Partial, ReduceOp};
use crate::error::CollectiveError;
use crate::tree::Tree;

/// A sum of one clock's gradients on its way up.
#[derive(Debug)]
pub(super) struct PushMsg {
    pub(super) clock: u64,
    /// `None`: nobody in the subtree contributed.
    pub(super) values: Option<Tensor>,
    /// Encoded contributor sets, when they are not "the whole subtree in every block".
    pub(super) sets: Option<Vec<u8>>,
}

/// A weights version on its way down.
#[derive(Debug)]
pub(super) struct VersionMsg {
    pub(super) clock: u64,
    pub(super) weights: Tensor,
    /// Encoded per-block clocks, when some block is not at `clock`.
    pub(super) block_clocks: Option<Vec<u8>>,
}

/// What a link's sending thread is asked to do.
#[derive(Debug)]
pub(super) enum Out {
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
    /// The server's digest of version `clock` ([`PsConfig::verify_versions`](super::PsConfig::verify_versions)).
    Digest {
        clock: u64,
        digest: [u8; DIGEST_LEN],
    },
    /// Say Bye and end.
    Finish,
}

/// A child's sum as received.
#[derive(Debug)]
pub(super) struct ChildSum {
    pub(super) values: Tensor,
    pub(super) sets: Contributors,
    pub(super) arrived: Vec<bool>,
}

/// The aggregator's input.
#[derive(Debug)]
pub(super) enum AggIn {
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
    /// For the I/O, not the aggregator: a version's send to the peer finished.
    Sent(usize),
    /// For the I/O, not the aggregator: a message from `peer` began (`busy`: its data is
    /// on the way) or ended.
    Heard {
        peer: usize,
        busy: bool,
    },
    /// Tests: send `out` to `peer` whatever this node's role (an attacker's message).
    #[cfg(test)]
    Forge {
        peer: usize,
        out: Out,
    },
}

/// The loss bound of each hop of a tree of `height` hops, so that the whole path stays within
/// `total` (union bound).
pub(super) fn hop_bound(total: LossBound, height: usize) -> LossBound {
    let h = u32::try_from(height.max(1)).unwrap_or(u32::MAX);
    LossBound::from_ppm(total.ppm() / h).unwrap_or(LossBound::RELIABLE)
}

/// The server's step: `w += -lr * avg`, element by element, in `dtype`.
pub(super) fn apply_update(dtype: DType, w: &mut [u8], avg: &[u8], lr: f32) -> Result<(), PsError> {
    let mut step = avg.to_vec();
    scale(dtype, &mut step, -lr);
    add_into(dtype, w, &step).map_err(|e| PsError::Config(format!("update: {e}")))
}

/// Merge a received version into a cache: block `b` takes the incoming values when they
/// arrived, the sender held them, and they are newer than the cache's. `have[b]` is 1 + the
/// block's clock (0: never received). Returns how many blocks changed.
pub(super) fn merge_blocks(
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

/// Whether every block of `sets` names only workers of `allowed` (a one-block set).
pub(super) fn sets_within(sets: &Contributors, allowed: &Contributors) -> bool {
    let limit = allowed.count(0);
    let mut probe = Contributors::none(1, sets.world());
    (0..sets.blocks()).all(|b| {
        probe.assign(0, sets, b);
        probe.unite(0, allowed, 0);
        probe.count(0) == limit
    })
}

/// One clock's sum in the making.
pub(super) struct Pending {
    pub(super) values: Vec<u8>,
    pub(super) sets: Contributors,
    pub(super) own: bool,
    /// The children whose sums are in.
    pub(super) got: BTreeSet<usize>,
}

impl Pending {
    pub(super) fn new(ctx: &Ctx) -> Pending {
        Pending {
            values: vec![0u8; ctx.layout.elems() * ctx.dtype.elem_size()],
            sets: Contributors::none(ctx.blocks(), ctx.world),
            own: false,
            got: BTreeSet::new(),
        }
    }
}

/// The aggregator's state, on the node's owning thread: it alone changes the tree and decides
/// what goes up and down.
pub(super) struct Agg<'a> {
    pub(super) ctx: &'a Ctx,
    /// The ranks this node has links with.
    pub(super) links: Vec<usize>,
    /// Messages for the I/O to send, in order: `(peer, message)`.
    pub(super) outbox: Vec<(usize, Out)>,
    pub(super) tree: Tree,
    pub(super) dead: BTreeSet<usize>,
    pub(super) fell_back: bool,
    pub(super) pending: BTreeMap<u64, Pending>,
    /// The next clock to complete.
    pub(super) next: u64,
    /// Own pushes of clocks not applied yet as far as this node knows (for a STAR re-send).
    pub(super) own: BTreeMap<u64, Option<Tensor>>,
    pub(super) own_next: u64,
    /// Completed sums of clocks not applied yet (a worker re-sends them to a new parent).
    pub(super) completed: BTreeMap<u64, Arc<PushMsg>>,
    /// The parent sums go to (None: the root, or detached until a new parent adopts it).
    pub(super) up: Option<usize>,
    /// The tree version this node attached to `up` at (stamped on its sums).
    pub(super) epoch: u64,
    pub(super) sent_next: u64,
    pub(super) detached_at: Option<u64>,
    pub(super) adopt_wait: Option<(usize, u64, u64)>,
    /// Per child: the first clock it sends here directly, the next one due, the oldest tree
    /// version of its sums accepted.
    pub(super) from: BTreeMap<usize, u64>,
    pub(super) expect: BTreeMap<usize, u64>,
    pub(super) accept: BTreeMap<usize, u64>,
    pub(super) done: BTreeSet<usize>,
    pub(super) bye_sent: BTreeSet<usize>,
    pub(super) stop: bool,
    pub(super) left: bool,
    pub(super) broken: bool,
}

impl<'a> Agg<'a> {
    pub(super) fn new(ctx: &'a Ctx, links: Vec<usize>) -> Agg<'a> {
        let tree = ctx.tree0.clone();
        let children = tree.children(ctx.rank).to_vec();
        Agg {
            ctx,
            links,
            outbox: Vec::new(),
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

    pub(super) fn worker(&self) -> bool {
        self.ctx.rank != self.ctx.root
    }

    pub(super) fn send(&mut self, peer: usize, m: Out) {
        if self.links.contains(&peer) {
            self.outbox.push((peer, m));
        }
    }

    pub(super) fn fatal(&mut self, e: PsError) {
        self.ctx.fail(e);
        self.broken = true;
    }

    pub(super) fn children(&self) -> Vec<usize> {
        self.tree.children(self.ctx.rank).to_vec()
    }

    pub(super) fn handle(&mut self, msg: AggIn) {
        match msg {
            AggIn::Stop => self.stop = true,
            AggIn::Sent(_) | AggIn::Heard { .. } => {}
            #[cfg(test)]
            AggIn::Forge { peer, out } => self.send(peer, out),
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
                    // Pass the news down (the root may not reach everyone directly); only
                    // ranks below this one take it from here.
                    let list: Arc<Vec<usize>> = Arc::new(all.iter().copied().collect());
                    let me = self.ctx.rank;
                    for q in self.links.clone() {
                        if q != me
                            && self.ctx.below(me, q)
                            && !all.contains(&q)
                            && !self.bye_sent.contains(&q)
                        {
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

    pub(super) fn on_own(&mut self, clock: u64, grads: Option<Tensor>) {
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

    pub(super) fn on_child(&mut self, peer: usize, epoch: u64, clock: u64, sum: Option<ChildSum>) {
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
    pub(super) fn on_version(&mut self) {
        let v = self.ctx.shared.lock().cache.weights_clock().unwrap_or(0);
        self.own.retain(|&c, _| c >= v);
        self.completed.retain(|&c, _| c >= v);
        for c in self.children() {
            self.send_version(c);
        }
    }

    /// The server: the digest of its current version to every worker that checks it.
    pub(super) fn send_digests(&mut self) {
        if self.ctx.digest_to.is_empty() {
            return;
        }
        let (clock, digest) = {
            let st = self.ctx.shared.lock();
            let Some(v) = st.cache.weights_clock() else {
                return;
            };
            (v, version_digest(v, st.weights.as_bytes()))
        };
        for q in self.ctx.digest_to.clone() {
            if !self.dead.contains(&q) {
                self.send(q, Out::Digest { clock, digest });
            }
        }
    }

    /// This node's cache to `peer`.
    pub(super) fn send_version(&mut self, peer: usize) {
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

    pub(super) fn on_down(&mut self, peer: usize, reason: String) {
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
                for q in self.links.clone() {
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
    pub(super) fn apply_tree(&mut self, dead: BTreeSet<usize>) {
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
    pub(super) fn adopt(&mut self, child: usize, version: u64, from: u64) {
        self.from.insert(child, from);
        self.expect.insert(child, from);
        self.accept.insert(child, version);
        self.send(child, Out::Adopt { version, from });
        self.send_version(child);
    }

    pub(super) fn detach(&mut self, version: u64) {
        self.up = None;
        self.detached_at = Some(version);
    }

    pub(super) fn try_attach(&mut self) {
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

    pub(super) fn complete(&self, clock: u64) -> bool {
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
    pub(super) fn drain(&mut self) {
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
                self.send_digests();
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

    pub(super) fn sum_msg(&self, clock: u64, p: &Pending) -> PushMsg {
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
    pub(super) fn may_leave(&self) -> bool {
        self.stop
            && self
                .children()
                .iter()
                .all(|c| self.done.contains(c) || self.dead.contains(c))
            && (!self.worker() || (self.up.is_some() && self.sent_next >= self.next))
    }

    pub(super) fn leave(&mut self) {
        self.left = true;
        let peers = self.links.clone();
        for q in peers {
            if self.bye_sent.insert(q) {
                self.send(q, Out::Finish);
            }
        }
    }
}

/// The server's update for `clock`; its weights become version `clock + 1`.
pub(super) fn apply(ctx: &Ctx, clock: u64, mut p: Pending) -> Result<(), PsError> {
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
pub(super) fn publish(ctx: &Ctx, clock: Option<u64>) {
    let version = clock.unwrap_or(0);
    {
        let mut st = ctx.shared.lock();
        st.cache.on_weights(version);
        st.have.fill(version + 1);
    }
    ctx.shared.cv.notify_all();
}

/// When each link is due a heartbeat: one that sent nothing for `period`. The peer's layer
/// fails its receive of a link silent for `failure_timeout` (it pings the peer meanwhile), so
/// an idle live link must say something; a dead one says nothing and fails. Driven by the
/// clock passed in.
#[derive(Debug)]
pub(super) struct Beats {
    period: Duration,
    last: BTreeMap<usize, Instant>,
}

impl Beats {
    /// Links to `peers`, each last heard of (by its peer) at `now`.
    pub(super) fn new(period: Duration, peers: &[usize], now: Instant) -> Beats {
        Beats {
            period,
            last: peers.iter().map(|&p| (p, now)).collect(),
        }
    }

    /// Something was sent to `peer` at `now`.
    pub(super) fn sent(&mut self, peer: usize, now: Instant) {
        if let Some(t) = self.last.get_mut(&peer) {
            *t = (*t).max(now);
        }
    }

    /// The link to `peer` ended (Bye sent, or it failed): no more heartbeats.
    pub(super) fn stop(&mut self, peer: usize) {
        self.last.remove(&peer);
    }

    /// The links due a heartbeat at `now`, each counted as sent then.
    pub(super) fn due(&mut self, now: Instant) -> Vec<usize> {
        let period = self.period;
        let mut out = Vec::new();
        for (&p, t) in self.last.iter_mut() {
            if now.saturating_duration_since(*t) >= period {
                *t = now;
                out.push(p);
            }
        }
        out
    }

    /// When the next heartbeat is due, if any link is live.
    pub(super) fn next(&self) -> Option<Instant> {
        self.last.values().min().map(|&t| t + self.period)
    }
}

/// Which links fell silent: one heard from at least once that then says nothing for
/// `timeout` has failed (its peer sends a heartbeat every `heartbeat` while idle). A link
/// never heard from is judged by the set-up (the address exchange) and by the layer's peer
/// timeout; one in the middle of a message's data by the layer, which fails a message that
/// makes no progress. Driven by the clock passed in.
#[derive(Debug)]
pub(super) struct Liveness {
    timeout: Duration,
    /// Per link heard from: when last, and whether a message's data is on the way.
    heard: BTreeMap<usize, (Instant, bool)>,
    ended: BTreeSet<usize>,
}

impl Liveness {
    pub(super) fn new(timeout: Duration) -> Liveness {
        Liveness {
            timeout,
            heard: BTreeMap::new(),
            ended: BTreeSet::new(),
        }
    }

    /// A message from `peer` began (`busy`) or ended at `now`.
    pub(super) fn heard(&mut self, peer: usize, now: Instant, busy: bool) {
        if !self.ended.contains(&peer) {
            let e = self.heard.entry(peer).or_insert((now, busy));
            *e = (e.0.max(now), busy);
        }
    }

    /// The link with `peer` ended (its Bye, or it failed): it is no longer watched.
    pub(super) fn stop(&mut self, peer: usize) {
        self.ended.insert(peer);
        self.heard.remove(&peer);
    }

    /// The links silent for the timeout at `now`, each reported once.
    pub(super) fn silent(&mut self, now: Instant) -> Vec<usize> {
        let timeout = self.timeout;
        let out: Vec<usize> = self
            .heard
            .iter()
            .filter(|(_, &(t, busy))| !busy && now.saturating_duration_since(t) >= timeout)
            .map(|(&p, _)| p)
            .collect();
        for &p in &out {
            self.stop(p);
        }
        out
    }
}

#[cfg(test)]
mod tests;
