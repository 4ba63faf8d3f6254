//! The parameter server's Stale Synchronous Parallel (SSP) clocks, as MLNET uses them (§3.1).
//!
//! A worker's clock `c_worker` counts its completed iterations (`clock()` increments it). The
//! model clock `c_model` is the minimum worker clock: the weights at `c_model` hold every
//! worker's updates through that iteration. A pull by a worker at `c_worker` is served only when
//! `c_model >= c_worker - s`, where `s` is the staleness threshold (`s = 0` is synchronous).
//!
//! MLNET processes sit on a tree between the workers and the parameter server (the root). Each
//! one caches the newest weights it has seen ([`WeightCache`]), answers a pull from that cache
//! when the cache is fresh enough and forwards it upstream otherwise, and decides when the
//! aggregated push of its subtree must go upstream ([`PushGate`]). Everything here is pure
//! bookkeeping: the caller moves the messages.
//!
//! All clocks only grow, and every view of a clock (a parent's idea of a subtree's clock, a
//! cache's weights) is a clock that was true at some time, so a view never exceeds the truth.
//! Deciding with a view that lags therefore costs waiting, never a broken staleness bound.

/// Whether a worker at `c_worker` may receive the weights of model clock `c_model` under
/// staleness `staleness`: `c_model >= c_worker - staleness`, without underflow.
pub fn pull_allowed(c_model: u64, c_worker: u64, staleness: u64) -> bool {
    c_model.saturating_add(staleness) >= c_worker
}

/// Why a clock operation was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ClockError {
    #[error("no worker {worker}: the clock vector has workers 0..{workers}; use a worker index, not a rank")]
    NoSuchWorker { worker: usize, workers: usize },
    #[error("clock vectors of {ours} and {theirs} workers cannot be merged; both must cover the same workers")]
    SizeMismatch { ours: usize, theirs: usize },
    #[error("worker {worker}'s clock is at u64::MAX and cannot advance")]
    Overflow { worker: usize },
}

/// One clock per worker, indexed by worker index `0..n` (not by rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClockVector {
    clocks: Vec<u64>,
}

impl ClockVector {
    /// `workers` clocks at 0.
    pub fn new(workers: usize) -> ClockVector {
        ClockVector {
            clocks: vec![0; workers],
        }
    }

    pub fn get(&self, w: usize) -> Option<u64> {
        self.clocks.get(w).copied()
    }

    fn slot(&mut self, w: usize) -> Result<&mut u64, ClockError> {
        let workers = self.clocks.len();
        self.clocks
            .get_mut(w)
            .ok_or(ClockError::NoSuchWorker { worker: w, workers })
    }

    /// `clock()` of worker `w`: one more completed iteration. Returns the new clock.
    pub fn tick(&mut self, w: usize) -> Result<u64, ClockError> {
        let slot = self.slot(w)?;
        *slot = slot
            .checked_add(1)
            .ok_or(ClockError::Overflow { worker: w })?;
        Ok(*slot)
    }

    /// Monotone merge of one clock (the clock exchange after re-parenting): raises worker `w`
    /// to `c`, never lowers it. Returns whether it changed.
    pub fn advance_to(&mut self, w: usize, c: u64) -> Result<bool, ClockError> {
        let slot = self.slot(w)?;
        let changed = c > *slot;
        *slot = (*slot).max(c);
        Ok(changed)
    }

    /// Element-wise maximum with `other`, which must cover the same workers.
    pub fn merge(&mut self, other: &ClockVector) -> Result<(), ClockError> {
        if self.clocks.len() != other.clocks.len() {
            return Err(ClockError::SizeMismatch {
                ours: self.clocks.len(),
                theirs: other.clocks.len(),
            });
        }
        for (mine, &theirs) in self.clocks.iter_mut().zip(&other.clocks) {
            *mine = (*mine).max(theirs);
        }
        Ok(())
    }

    /// `c_model`: the minimum worker clock; 0 when there are no workers.
    pub fn model_clock(&self) -> u64 {
        self.clocks.iter().copied().min().unwrap_or(0)
    }

    pub fn len(&self) -> usize {
        self.clocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clocks.is_empty()
    }
}

/// What a process does with a pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullDecision {
    /// Answer from the cache: its weights (of this model clock) are fresh enough.
    ServeCached { weights_clock: u64 },
    /// Send the pull to the parent (flush the [`PushGate`] first), or wait at the root.
    ForwardUp,
}

/// One MLNET process's cache of the weights (an aggregator, or a worker's local cache): the
/// model clock of the newest weights it holds, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightCache {
    weights_clock: Option<u64>,
}

impl WeightCache {
    /// An empty cache: every pull goes upstream.
    pub fn new() -> WeightCache {
        WeightCache::default()
    }

    /// Serve from the cache iff its weights satisfy [`pull_allowed`] for a worker at `c_worker`.
    pub fn on_pull(&self, c_worker: u64, staleness: u64) -> PullDecision {
        match self.weights_clock {
            Some(wc) if pull_allowed(wc, c_worker, staleness) => {
                PullDecision::ServeCached { weights_clock: wc }
            }
            _ => PullDecision::ForwardUp,
        }
    }

    /// Weights of model clock `weights_clock` arrived from upstream. An older copy (a late
    /// reply) is ignored: the cache never goes backwards. Returns whether it was newer.
    pub fn on_weights(&mut self, weights_clock: u64) -> bool {
        let newer = self.weights_clock.is_none_or(|c| weights_clock > c);
        if newer {
            self.weights_clock = Some(weights_clock);
        }
        newer
    }

    pub fn weights_clock(&self) -> Option<u64> {
        self.weights_clock
    }
}

/// Whether a subtree at clock `c_subtree`, whose parent last heard `c_parent_seen`, must push
/// upstream now under staleness `staleness`: the rule of [`PushGate`].
pub fn push_needed(c_subtree: u64, c_parent_seen: u64, staleness: u64) -> bool {
    c_subtree > c_parent_seen && c_subtree - c_parent_seen >= staleness.max(1)
}

/// MLNET's push rule in one process: the process aggregates its children's pushes and sends
/// the aggregate (with its subtree clock, the minimum over the subtree's workers) upstream
/// only when the parent needs it.
///
/// The rule ([`push_needed`]): push when the subtree clock is ahead of what the parent last
/// heard by at least `max(s, 1)`. With `s = 0` every new clock goes up (synchronous: the parent
/// waits for all its children every iteration); with `s > 0` the parent's view of this subtree
/// lags its clock by at most `s - 1` between pushes.
///
/// Why the bound holds and nothing deadlocks:
/// - Safety does not depend on the gate. A view is a clock that was true earlier, so the root's
///   model clock never exceeds the true minimum, and a pull is answered only when the answering
///   cache or the root satisfies [`pull_allowed`]. A lagging view only makes pulls wait.
/// - One level of gating alone never blocks the slowest worker (clock `c_min`): every other
///   subtree's view is at least `c_min - (s - 1)`, so the root's model clock allows its pull.
/// - Lags add up along deeper paths, so a process must [`flush`](PushGate::flush) before it
///   forwards a pull upstream. Once every worker waits in a pull, no clock moves and each path
///   has been flushed bottom-up after its subtree's last change, so the root's view is exact and
///   the slowest worker's pull is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushGate {
    staleness: u64,
    /// The newest subtree clock this process knows.
    subtree: u64,
    /// The newest subtree clock the parent has been sent.
    parent_seen: u64,
}

impl PushGate {
    /// A gate whose subtree and parent both start at clock 0.
    pub fn new(staleness: u64) -> PushGate {
        PushGate {
            staleness,
            subtree: 0,
            parent_seen: 0,
        }
    }

    /// The rule for explicit clocks: [`push_needed`] with this gate's staleness.
    pub fn must_push(&self, c_subtree: u64, c_parent_seen: u64) -> bool {
        push_needed(c_subtree, c_parent_seen, self.staleness)
    }

    /// The subtree's aggregated clock became `c_subtree` (a lower value is ignored). Returns
    /// `Some(clock)` when the push must go upstream now; the parent then counts as told.
    pub fn observe(&mut self, c_subtree: u64) -> Option<u64> {
        self.subtree = self.subtree.max(c_subtree);
        if self.must_push(self.subtree, self.parent_seen) {
            self.parent_seen = self.subtree;
            Some(self.subtree)
        } else {
            None
        }
    }

    /// Forces the pending clock upstream (before forwarding a pull, at the end of the job):
    /// `Some(clock)` when the parent is behind.
    pub fn flush(&mut self) -> Option<u64> {
        (self.subtree > self.parent_seen).then(|| {
            self.parent_seen = self.subtree;
            self.subtree
        })
    }

    /// After re-parenting: the new parent knows nothing of this subtree, so the clock exchange
    /// sends it the current subtree clock, returned here and counted as told.
    pub fn reparented(&mut self) -> u64 {
        self.parent_seen = self.subtree;
        self.subtree
    }

    pub fn staleness(&self) -> u64 {
        self.staleness
    }

    pub fn subtree_clock(&self) -> u64 {
        self.subtree
    }

    pub fn parent_seen(&self) -> u64 {
        self.parent_seen
    }

    /// Whether the parent is behind this subtree (a [`flush`](PushGate::flush) would send).
    pub fn pending(&self) -> bool {
        self.subtree > self.parent_seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pull_rule_edges() {
        assert!(pull_allowed(0, 0, 0));
        assert!(!pull_allowed(0, 1, 0));
        assert!(pull_allowed(3, 5, 2));
        assert!(!pull_allowed(2, 5, 2));
        assert!(pull_allowed(0, 3, 5)); // c_worker - s would underflow
        assert!(pull_allowed(u64::MAX, u64::MAX, u64::MAX));
        assert!(pull_allowed(u64::MAX - 1, u64::MAX, 1));
        assert!(!pull_allowed(u64::MAX - 2, u64::MAX, 1));
    }

    #[test]
    fn clock_vector_basics() {
        let mut v = ClockVector::new(3);
        assert_eq!((v.len(), v.is_empty(), v.model_clock()), (3, false, 0));
        assert_eq!(v.tick(1), Ok(1));
        assert_eq!(v.tick(1), Ok(2));
        assert_eq!(v.model_clock(), 0);
        assert_eq!(v.advance_to(0, 4), Ok(true));
        assert_eq!(v.advance_to(0, 3), Ok(false));
        assert_eq!(v.advance_to(2, 2), Ok(true));
        assert_eq!(v.model_clock(), 2);
        assert_eq!(v.get(0), Some(4));
        assert_eq!(v.get(3), None);
        assert_eq!(
            v.tick(3),
            Err(ClockError::NoSuchWorker {
                worker: 3,
                workers: 3
            })
        );
        assert!(v.advance_to(7, 1).is_err());
        assert_eq!(
            v.merge(&ClockVector::new(2)),
            Err(ClockError::SizeMismatch { ours: 3, theirs: 2 })
        );
        v.advance_to(2, u64::MAX).unwrap();
        assert_eq!(v.tick(2), Err(ClockError::Overflow { worker: 2 }));
        assert_eq!(v.get(2), Some(u64::MAX));
        let empty = ClockVector::new(0);
        assert_eq!((empty.model_clock(), empty.is_empty()), (0, true));
    }

    #[test]
    fn weight_cache_decisions() {
        let mut c = WeightCache::new();
        assert_eq!(c.on_pull(0, 5), PullDecision::ForwardUp);
        assert!(c.on_weights(3));
        assert_eq!(
            c.on_pull(4, 1),
            PullDecision::ServeCached { weights_clock: 3 }
        );
        assert_eq!(c.on_pull(5, 1), PullDecision::ForwardUp);
        assert!(!c.on_weights(2));
        assert!(!c.on_weights(3));
        assert_eq!(c.weights_clock(), Some(3));
        assert!(!c.on_weights(0));
        assert_eq!(c.weights_clock(), Some(3));
    }

    #[test]
    fn push_gate_rule() {
        // s = 0 and s = 1: every new clock goes up.
        for s in [0, 1] {
            let mut g = PushGate::new(s);
            assert_eq!(g.observe(0), None);
            assert_eq!(g.observe(1), Some(1));
            assert_eq!(g.observe(1), None);
            assert_eq!(g.observe(3), Some(3));
            assert!(!g.pending());
        }
        let mut g = PushGate::new(3);
        assert_eq!(g.observe(1), None);
        assert_eq!(g.observe(2), None);
        assert!(g.pending());
        assert_eq!(g.observe(3), Some(3));
        assert_eq!(g.observe(5), None);
        assert_eq!(g.observe(4), None); // lower: ignored
        assert_eq!(g.subtree_clock(), 5);
        assert_eq!(g.flush(), Some(5));
        assert_eq!(g.flush(), None);
        assert_eq!(g.parent_seen(), 5);
        assert_eq!(g.observe(6), None);
        assert_eq!(g.reparented(), 6);
        assert!(!g.pending());
        assert!(g.must_push(9, 6) && !g.must_push(8, 6));
        assert!(push_needed(u64::MAX, u64::MAX - 3, 3));
        assert!(!push_needed(u64::MAX, u64::MAX - 2, 3));
        assert!(!push_needed(2, 5, 0));
    }

    /// Why a forwarded pull flushes every hop: lags below `s` per gate add up along a path.
    #[test]
    fn flush_is_needed_on_deeper_paths() {
        let s = 3;
        let (mut inner, mut outer) = (PushGate::new(s), PushGate::new(s));
        let mut root_view = 0;
        // A lone worker reaches 2; its pull passes the inner process (flush) and is answered
        // from the outer process's cache.
        assert_eq!(inner.observe(1), None);
        assert_eq!(inner.observe(2), None);
        assert_eq!(inner.flush(), Some(2));
        assert_eq!(outer.observe(2), None);
        // Two more iterations: each gate lags by less than s, the root by more.
        assert_eq!(inner.observe(3), None);
        assert_eq!(inner.observe(4), None);
        assert!(!pull_allowed(root_view, 4, s)); // without flushes it would wait forever
        if let Some(c) = inner.flush().and_then(|c| outer.observe(c)) {
            root_view = c;
        }
        if let Some(c) = outer.flush() {
            root_view = c;
        }
        assert_eq!(root_view, 4);
    }

    /// Workers -> one local process each -> group aggregators -> root: every hop has a gate
    /// and (below the root) a cache, as MLNET runs it.
    struct Sim {
        s: u64,
        groups: usize,
        truth: ClockVector,
        wgate: Vec<PushGate>,
        wcache: Vec<WeightCache>,
        /// Per group: the aggregator's view of its workers (member index = w / groups).
        agg_view: Vec<ClockVector>,
        agate: Vec<PushGate>,
        acache: Vec<WeightCache>,
        /// The root's view of each group.
        root: ClockVector,
    }

    impl Sim {
        fn new(n: usize, groups: usize, s: u64) -> Sim {
            Sim {
                s,
                groups,
                truth: ClockVector::new(n),
                wgate: vec![PushGate::new(s); n],
                wcache: vec![WeightCache::new(); n],
                agg_view: (0..groups)
                    .map(|g| ClockVector::new((g..n).step_by(groups).count()))
                    .collect(),
                agate: vec![PushGate::new(s); groups],
                acache: vec![WeightCache::new(); groups],
                root: ClockVector::new(groups),
            }
        }

        fn push_to_aggregator(&mut self, w: usize, c: u64) {
            let g = w % self.groups;
            self.agg_view[g].advance_to(w / self.groups, c).unwrap();
            if let Some(c) = self.agate[g].observe(self.agg_view[g].model_clock()) {
                self.root.advance_to(g, c).unwrap();
            }
        }

        fn tick(&mut self, w: usize) {
            let c = self.truth.tick(w).unwrap();
            if let Some(c) = self.wgate[w].observe(c) {
                self.push_to_aggregator(w, c);
            }
        }

        /// The served weights' clock, or `None` when the pull waits at the root.
        fn pull(&mut self, w: usize) -> Option<u64> {
            let (c, s, g) = (self.truth.get(w).unwrap(), self.s, w % self.groups);
            let served = 'serve: {
                if let PullDecision::ServeCached { weights_clock } = self.wcache[w].on_pull(c, s) {
                    break 'serve Some(weights_clock);
                }
                if let Some(c) = self.wgate[w].flush() {
                    self.push_to_aggregator(w, c);
                }
                if let PullDecision::ServeCached { weights_clock } = self.acache[g].on_pull(c, s) {
                    self.wcache[w].on_weights(weights_clock);
                    break 'serve Some(weights_clock);
                }
                if let Some(c) = self.agate[g].flush() {
                    self.root.advance_to(g, c).unwrap();
                }
                let m = self.root.model_clock();
                if !pull_allowed(m, c, s) {
                    break 'serve None;
                }
                self.acache[g].on_weights(m);
                self.wcache[w].on_weights(m);
                Some(m)
            };
            if let Some(wc) = served {
                // The bound, and weights that exist: never past the true model clock.
                assert!(
                    wc.saturating_add(s) >= c,
                    "served {wc} to a worker at {c}, s={s}"
                );
                assert!(wc <= self.truth.model_clock());
                assert!(self.truth.model_clock().saturating_add(s) >= c);
                if s == 0 {
                    assert!((0..self.truth.len()).all(|v| self.truth.get(v).unwrap() >= c));
                }
            }
            for g in 0..self.groups {
                let group_min = (g..self.truth.len())
                    .step_by(self.groups)
                    .map(|v| self.truth.get(v).unwrap())
                    .min()
                    .unwrap();
                assert!(self.root.get(g).unwrap() <= group_min);
            }
            served
        }
    }

    proptest! {
        #[test]
        fn served_pulls_keep_the_staleness_bound(
            n in 1usize..7,
            groups in 1usize..4,
            s in 0u64..4,
            ops in proptest::collection::vec((any::<bool>(), 0usize..7), 0..200),
        ) {
            let groups = groups.min(n);
            let mut sim = Sim::new(n, groups, s);
            for (tick, w) in ops {
                let w = w % n;
                if tick {
                    // A worker ticks only after its pull was served (it trains on weights).
                    if sim.pull(w).is_some() {
                        sim.tick(w);
                    }
                } else {
                    sim.pull(w);
                }
            }
            // Liveness: the others run until each waits in a pull (which flushed its path);
            // they cannot get more than s + 1 ahead of the slowest, which is then served.
            let slowest = (0..n).min_by_key(|&w| sim.truth.get(w).unwrap()).unwrap();
            let mut rounds = 0;
            loop {
                let mut progressed = false;
                for w in (0..n).filter(|&w| w != slowest) {
                    if sim.pull(w).is_some() {
                        sim.tick(w);
                        progressed = true;
                    }
                }
                if !progressed {
                    break;
                }
                rounds += 1;
                prop_assert!(rounds <= s + 2, "workers ran {rounds} rounds ahead");
            }
            prop_assert!(sim.pull(slowest).is_some());
        }

        #[test]
        fn synchronous_pull_needs_every_worker(
            clocks in proptest::collection::vec(0u64..6, 1..8),
            c_worker in 0u64..8,
        ) {
            let mut v = ClockVector::new(clocks.len());
            for (w, &c) in clocks.iter().enumerate() {
                v.advance_to(w, c).unwrap();
            }
            prop_assert_eq!(
                pull_allowed(v.model_clock(), c_worker, 0),
                clocks.iter().all(|&c| c >= c_worker)
            );
        }

        #[test]
        fn clock_vector_is_a_monotone_min(
            n in 0usize..6,
            ops in proptest::collection::vec((0u8..2, 0usize..6, 0u64..20), 0..60),
            other in proptest::collection::vec(0u64..20, 0..6),
        ) {
            let mut v = ClockVector::new(n);
            for (op, w, c) in ops {
                let before = v.clone();
                let res = if op == 0 {
                    v.tick(w).map(|_| true)
                } else {
                    v.advance_to(w, c)
                };
                prop_assert_eq!(res.is_err(), w >= n);
                for i in 0..n {
                    prop_assert!(v.get(i) >= before.get(i));
                }
                if let Ok(changed) = res {
                    prop_assert_eq!(changed, v != before);
                }
                prop_assert_eq!(v.model_clock(), (0..n).filter_map(|i| v.get(i)).min().unwrap_or(0));
                prop_assert!(v.model_clock() >= before.model_clock());
            }
            let mut o = ClockVector::new(other.len());
            for (w, &c) in other.iter().enumerate() {
                o.advance_to(w, c).unwrap();
            }
            if o.len() != n {
                prop_assert!(v.clone().merge(&o).is_err());
                return Ok(());
            }
            let mut vo = v.clone();
            vo.merge(&o).unwrap();
            let mut ov = o.clone();
            ov.merge(&v).unwrap();
            prop_assert_eq!(&vo, &ov);
            for i in 0..n {
                prop_assert_eq!(vo.get(i), v.get(i).max(o.get(i)));
            }
            let mut again = vo.clone();
            again.merge(&o).unwrap();
            prop_assert_eq!(&again, &vo);
            again.merge(&again.clone()).unwrap();
            prop_assert_eq!(&again, &vo);
            prop_assert!(vo.model_clock() >= v.model_clock().max(o.model_clock()));
        }

        #[test]
        fn weight_cache_never_goes_backwards(
            arrivals in proptest::collection::vec(0u64..50, 0..40),
            c_worker in 0u64..60,
            s in 0u64..5,
        ) {
            let mut cache = WeightCache::new();
            let mut best: Option<u64> = None;
            for a in arrivals {
                let newer = cache.on_weights(a);
                prop_assert_eq!(newer, best.is_none_or(|b| a > b));
                best = best.max(Some(a));
                prop_assert_eq!(cache.weights_clock(), best);
                match cache.on_pull(c_worker, s) {
                    PullDecision::ServeCached { weights_clock } => {
                        prop_assert_eq!(Some(weights_clock), best);
                        prop_assert!(pull_allowed(weights_clock, c_worker, s));
                    }
                    PullDecision::ForwardUp => {
                        prop_assert!(!pull_allowed(best.unwrap_or(0), c_worker, s));
                    }
                }
            }
        }

        #[test]
        fn push_gate_lag_stays_below_the_threshold(
            s in 0u64..5,
            steps in proptest::collection::vec((0u64..4, any::<bool>()), 0..80),
        ) {
            let mut g = PushGate::new(s);
            let mut c = 0u64;
            for (inc, flush) in steps {
                c += inc;
                let seen = g.parent_seen();
                let pushed = g.observe(c);
                prop_assert_eq!(pushed.is_some(), push_needed(c, seen, s));
                if flush {
                    let f = g.flush();
                    prop_assert_eq!(f.is_some(), pushed.is_none() && c > seen);
                    prop_assert_eq!(g.parent_seen(), c);
                }
                prop_assert!(g.parent_seen() <= c);
                prop_assert!(c - g.parent_seen() < s.max(1));
            }
        }
    }
}
