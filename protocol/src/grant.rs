//! Receiver-driven rate grants: the receiver's side of gradwire's incast congestion control.
//!
//! Every collective gradwire carries is many-to-one, and the receiver is the one place that
//! knows its fan-in. A [`GrantAllocator`] is shared by all flows into one receiver host (one
//! per downlink). It keeps an aggregate *target* rate for everything arriving and grants
//! each active flow an equal share of it; the receiver sends the share to its sender as a
//! `RateGrant` when the flow is accepted and whenever the share changes, and the sender paces
//! at it. So a new flow starts at `target / N`, never at line rate, and N senders together
//! never offer much more than the link carries.
//!
//! The target starts at `target_utilization` of the capacity and adapts DCTCP-style
//! (RFC 8257) to the CE marks the receiver sees on all its incoming data, once per period:
//! `alpha = (1 - g) alpha + g F` with `F` the marked fraction of the period's packets; a
//! period with marks multiplies the target by `1 - alpha / 2`, a period without adds
//! `additive_increase` of capacity up to the utilization cap. Marks mean a queue on the path
//! (the receiver's downlink or elsewhere) crossed its ECN threshold, so the aggregate backs
//! off before that queue's not-ECT packets start to be dropped.
//!
//! Pure state: the caller passes time in and moves the numbers (see `gradwire::transport`'s
//! grant pool, which wraps one allocator in a mutex for the receiver threads of a host).

use std::collections::BTreeMap;

use crate::rate::DCTCP_GAIN;

/// Grant parameters for one receiver downlink.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrantConfig {
    /// The downlink's rate, bit/s.
    pub capacity_bps: u64,
    /// Fraction of the capacity the target never exceeds (headroom for control traffic,
    /// header overhead and grants still in flight when the fan-in grows). Default 0.9.
    pub target_utilization: f64,
    /// Added to the target per period without marks, as a fraction of capacity. Default 0.05
    /// (the paper's additive increase).
    pub additive_increase: f64,
    /// DCTCP's gain g. Default 1/16.
    pub gain: f64,
    /// The aggregate target never goes below this (bit/s); a flow's share never below
    /// `min_flow_bps`.
    pub min_target_bps: u64,
    /// Smallest grant of one flow, bit/s.
    pub min_flow_bps: u64,
    /// Adaptation period, ns (the receivers' report period).
    pub period_ns: u64,
    /// React to CE marks (off: the target stays at `target_utilization` of capacity; the
    /// ablation "grants without ECN").
    pub ce_reaction: bool,
    /// How the target is split between the active flows.
    pub policy: GrantPolicy,
}

/// How a [`GrantAllocator`] splits its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantPolicy {
    /// Every active flow gets `target / N`.
    Fair,
    /// Shortest remaining first (as Homa's receivers grant): the `overcommit` flows with the
    /// fewest bytes still missing share the target; every other flow keeps a trickle of
    /// `target / (16 N)` so it stays alive and measured. Minimises mean completion time; the
    /// flow served last finishes no later than under `Fair` (the link works as hard).
    ShortestFirst {
        /// Flows granted at once (at least 1); more than one hides the moment between a flow
        /// finishing and the next one's sender hearing its new grant.
        overcommit: usize,
    },
}

impl GrantConfig {
    /// Defaults for a downlink of `capacity_bps` adapted every `period_ns`.
    pub fn new(capacity_bps: u64, period_ns: u64) -> GrantConfig {
        let capacity_bps = capacity_bps.max(1);
        GrantConfig {
            capacity_bps,
            target_utilization: 0.9,
            additive_increase: 0.05,
            gain: DCTCP_GAIN,
            min_target_bps: (capacity_bps / 100).max(1),
            min_flow_bps: (capacity_bps / 10_000).max(1),
            period_ns: period_ns.max(1),
            ce_reaction: true,
            policy: GrantPolicy::Fair,
        }
    }

    fn cap_bps(&self) -> u64 {
        let u = if self.target_utilization.is_finite() {
            self.target_utilization.clamp(0.0, 1.0)
        } else {
            1.0
        };
        ((self.capacity_bps as f64 * u) as u64)
            .max(self.min_target_bps)
            .max(1)
    }
}

/// A flow's handle in a [`GrantAllocator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GrantKey(u64);

/// Counters of an allocator, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct GrantStats {
    /// Flows active now.
    pub active: usize,
    /// Most flows active at once.
    pub max_active: usize,
    /// Current aggregate target, bit/s.
    pub target_bps: u64,
    /// Lowest target reached, bit/s.
    pub min_target_bps: u64,
    /// Current congestion estimate alpha.
    pub alpha: f64,
    /// Periods closed.
    pub periods: u64,
    /// Periods with CE marks (the target was cut).
    pub marked_periods: u64,
}

/// The aggregate target of one receiver downlink and the active flows sharing it.
#[derive(Debug, Clone)]
pub struct GrantAllocator {
    cfg: GrantConfig,
    target_bps: u64,
    alpha: f64,
    next_key: u64,
    /// Active flows: the bytes each still misses and its priority class (ordered keys:
    /// deterministic ties).
    flows: BTreeMap<GrantKey, (u64, u8)>,
    window_start_ns: Option<u64>,
    window_packets: u64,
    window_ce: u64,
    stats: GrantStats,
}

impl GrantAllocator {
    /// An allocator with no flows, its target at the utilization cap.
    pub fn new(cfg: GrantConfig) -> GrantAllocator {
        let target_bps = cfg.cap_bps();
        GrantAllocator {
            cfg,
            target_bps,
            alpha: 1.0,
            next_key: 0,
            flows: BTreeMap::new(),
            window_start_ns: None,
            window_packets: 0,
            window_ce: 0,
            stats: GrantStats {
                target_bps,
                min_target_bps: target_bps,
                alpha: 1.0,
                ..GrantStats::default()
            },
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GrantConfig {
        &self.cfg
    }

    /// A flow was accepted: it now shares the target. `remaining_bytes`: what it still has
    /// to receive (its size), for [`GrantPolicy::ShortestFirst`].
    pub fn join(&mut self, remaining_bytes: u64) -> GrantKey {
        self.join_class(remaining_bytes, 0)
    }

    /// A flow of priority class `class` (0 = most urgent) was accepted. Only the flows of
    /// the most urgent class present share the target (under the policy); the others keep
    /// a trickle of `target / (16 N)` so they stay alive and measured, and take over when
    /// the urgent ones leave: a receiver that serves several jobs preempts the less urgent
    /// (MLNET §3.2) without refusing them.
    pub fn join_class(&mut self, remaining_bytes: u64, class: u8) -> GrantKey {
        let key = GrantKey(self.next_key);
        self.next_key += 1;
        self.flows.insert(key, (remaining_bytes, class));
        self.stats.active = self.flows.len();
        self.stats.max_active = self.stats.max_active.max(self.flows.len());
        key
    }

    /// A flow ended (bound met, finished or failed): its share goes to the others. Unknown
    /// keys are ignored.
    pub fn leave(&mut self, key: GrantKey) {
        self.flows.remove(&key);
        self.stats.active = self.flows.len();
    }

    /// What `key`'s flow still misses, as its receiver last said. Unknown keys are ignored.
    pub fn set_remaining(&mut self, key: GrantKey, remaining_bytes: u64) {
        if let Some(r) = self.flows.get_mut(&key) {
            r.0 = remaining_bytes;
        }
    }

    /// The most urgent priority class among the active flows.
    pub fn most_urgent_class(&self) -> Option<u8> {
        self.flows.values().map(|&(_, c)| c).min()
    }

    /// Flows sharing the target now.
    pub fn active(&self) -> usize {
        self.flows.len()
    }

    /// The current aggregate target, bit/s.
    pub fn target_bps(&self) -> u64 {
        self.target_bps
    }

    /// Counters.
    pub fn stats(&self) -> GrantStats {
        self.stats
    }

    /// The share of `key`'s flow: the target split equally over the active flows of the
    /// most urgent class present (the share of one more flow for a key that is not active,
    /// e.g. one that just left); flows of a less urgent class get a trickle.
    pub fn grant_bps(&self, key: GrantKey) -> u64 {
        let n_all = self.flows.len() + usize::from(!self.flows.contains_key(&key));
        let best = self.flows.values().map(|&(_, c)| c).min().unwrap_or(0);
        let trickle = self.target_bps / (16 * n_all.max(1) as u64);
        let mine = self.flows.get(&key).copied();
        if mine.is_some_and(|(_, c)| c > best) {
            return trickle.max(self.cfg.min_flow_bps);
        }
        let peers = || self.flows.iter().filter(move |(_, &(_, c))| c == best);
        let n = peers().count() + usize::from(mine.is_none());
        let fair = self.target_bps / n.max(1) as u64;
        let share = match (self.cfg.policy, mine) {
            (GrantPolicy::ShortestFirst { overcommit }, Some((mine, _))) => {
                let k = overcommit.max(1);
                // This flow's rank: flows missing fewer bytes, or as many and older.
                let ahead = peers()
                    .filter(|(&other, &(r, _))| r < mine || (r == mine && other < key))
                    .count();
                if ahead < k {
                    self.target_bps / k.min(n).max(1) as u64
                } else {
                    fair / 16
                }
            }
            _ => fair,
        };
        share.max(self.cfg.min_flow_bps)
    }

    /// Data that arrived for any flow of this downlink: `packets`, `ce_packets` of them
    /// marked CE. Closes the adaptation period if it has elapsed at `now_ns`.
    pub fn record(&mut self, packets: u64, ce_packets: u64, now_ns: u64) {
        self.window_packets = self.window_packets.saturating_add(packets);
        self.window_ce = self.window_ce.saturating_add(ce_packets.min(packets));
        self.tick(now_ns);
    }

    /// Closes the adaptation period if it has elapsed: updates alpha and the target.
    pub fn tick(&mut self, now_ns: u64) {
        let start = *self.window_start_ns.get_or_insert(now_ns);
        if now_ns.saturating_sub(start) < self.cfg.period_ns {
            return;
        }
        self.window_start_ns = Some(now_ns);
        let (packets, ce) = (self.window_packets, self.window_ce);
        self.window_packets = 0;
        self.window_ce = 0;
        if packets == 0 {
            // Nothing arrived: nothing learnt (an idle link is not evidence of headroom).
            return;
        }
        self.stats.periods += 1;
        let cap = self.cfg.cap_bps();
        if !self.cfg.ce_reaction {
            self.target_bps = cap;
            return;
        }
        let f = ce as f64 / packets as f64;
        let g = if self.cfg.gain.is_finite() {
            self.cfg.gain.clamp(0.0, 1.0)
        } else {
            DCTCP_GAIN
        };
        self.alpha = (1.0 - g) * self.alpha + g * f;
        if ce > 0 {
            self.stats.marked_periods += 1;
            let cut = (self.target_bps as f64 * (1.0 - self.alpha / 2.0)) as u64;
            self.target_bps = cut.max(self.cfg.min_target_bps);
        } else {
            let step =
                (self.cfg.additive_increase.clamp(0.0, 1.0) * self.cfg.capacity_bps as f64) as u64;
            self.target_bps = self.target_bps.saturating_add(step.max(1)).min(cap);
        }
        self.stats.alpha = self.alpha;
        self.stats.target_bps = self.target_bps;
        self.stats.min_target_bps = self.stats.min_target_bps.min(self.target_bps);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const M: u64 = 1_000_000;

    fn alloc() -> GrantAllocator {
        GrantAllocator::new(GrantConfig::new(100 * M, 1_000))
    }

    #[test]
    fn the_most_urgent_class_takes_the_target_and_the_rest_trickle() {
        let mut a = alloc();
        let low = a.join_class(0, 5);
        assert_eq!(a.grant_bps(low), 90 * M, "alone, any class gets the target");
        let hi1 = a.join_class(0, 1);
        let hi2 = a.join_class(0, 1);
        assert_eq!(a.grant_bps(hi1), 45 * M);
        assert_eq!(a.grant_bps(hi2), 45 * M);
        assert_eq!(a.grant_bps(low), 90 * M / 48, "a trickle of target / 16N");
        a.leave(hi1);
        a.leave(hi2);
        assert_eq!(
            a.grant_bps(low),
            90 * M,
            "the urgent ones left: it takes over"
        );
    }

    #[test]
    fn shares_split_the_target_and_follow_the_fan_in() {
        let mut a = alloc();
        assert_eq!(a.target_bps(), 90 * M);
        let k0 = a.join(0);
        assert_eq!(a.grant_bps(k0), 90 * M);
        let ks: Vec<GrantKey> = (0..7).map(|_| a.join(0)).collect();
        assert_eq!(a.active(), 8);
        for k in ks.iter().chain([&k0]) {
            assert_eq!(a.grant_bps(*k), 90 * M / 8);
        }
        a.leave(k0);
        assert_eq!(a.grant_bps(ks[0]), 90 * M / 7);
        // A key that left is told what a newcomer would get; leaving twice is harmless.
        assert_eq!(a.grant_bps(k0), 90 * M / 8);
        a.leave(k0);
        assert_eq!(a.active(), 7);
        assert_eq!(a.stats().max_active, 8);
    }

    #[test]
    fn shortest_first_grants_the_target_to_the_flows_nearest_completion() {
        let mut cfg = GrantConfig::new(100 * M, 1_000);
        cfg.policy = GrantPolicy::ShortestFirst { overcommit: 2 };
        let mut a = GrantAllocator::new(cfg);
        let big = a.join(1_000_000);
        let small = a.join(10_000);
        // Two flows, overcommit 2: both at half the target.
        assert_eq!(a.grant_bps(big), 45 * M);
        assert_eq!(a.grant_bps(small), 45 * M);
        let mid = a.join(100_000);
        let tie = a.join(100_000);
        // Four flows: the two shortest (small, then the older of the tied ones) share the
        // target; the others trickle at a sixteenth of a fair share.
        assert_eq!(a.grant_bps(small), 45 * M);
        assert_eq!(a.grant_bps(mid), 45 * M);
        assert_eq!(a.grant_bps(tie), 90 * M / 4 / 16);
        assert_eq!(a.grant_bps(big), 90 * M / 4 / 16);
        // Progress reorders: the big flow is now nearly done.
        a.set_remaining(big, 1_000);
        assert_eq!(a.grant_bps(big), 45 * M);
        assert_eq!(a.grant_bps(mid), 90 * M / 4 / 16);
        a.leave(small);
        assert_eq!(a.grant_bps(mid), 45 * M);
        // Alone: the whole target.
        a.leave(big);
        a.leave(tie);
        assert_eq!(a.grant_bps(mid), 90 * M);
    }

    #[test]
    fn marks_cut_the_target_and_quiet_periods_restore_it() {
        let mut a = alloc();
        let _k = a.join(0);
        a.record(10, 10, 0);
        // The first period closes at 1 us: all marked, alpha stays 1, the target halves.
        a.record(0, 0, 1_000);
        assert_eq!(a.target_bps(), 45 * M);
        assert_eq!(a.stats().marked_periods, 1);
        // Quiet periods: +5 Mbit/s each, up to the 90 % cap.
        for i in 2..30 {
            a.record(10, 0, i * 1_000);
        }
        assert_eq!(a.target_bps(), 90 * M);
        // An empty period changes nothing.
        let before = a.stats();
        a.tick(40_000);
        assert_eq!(a.target_bps(), 90 * M);
        assert_eq!(a.stats().periods, before.periods);
        // Without CE reaction the target stays at the cap whatever is marked.
        let mut cfg = GrantConfig::new(100 * M, 1_000);
        cfg.ce_reaction = false;
        let mut b = GrantAllocator::new(cfg);
        b.record(10, 10, 0);
        b.record(10, 10, 1_000);
        assert_eq!(b.target_bps(), 90 * M);
    }

    #[test]
    fn floors_hold() {
        let mut a = alloc();
        let keys: Vec<GrantKey> = (0..100_000).map(|_| a.join(0)).collect();
        for t in 0..200 {
            a.record(1, 1, t * 1_000);
        }
        assert_eq!(a.target_bps(), M);
        assert_eq!(a.grant_bps(keys[0]), 10_000);
    }

    proptest! {
        /// Whatever arrives, the target stays within [floor, cap], alpha within [0, 1], and
        /// the shares of the active flows never add up to more than the target (beyond the
        /// per-flow floor).
        #[test]
        fn prop_bounded(events in prop::collection::vec((0u64..100, 0u64..120, 0u64..5_000, 0u8..3), 1..300)) {
            let mut a = alloc();
            let mut keys = Vec::new();
            let mut now = 0u64;
            for (packets, ce, dt, op) in events {
                now += dt;
                match op {
                    0 => keys.push(a.join(packets * 1000)),
                    1 => if let Some(k) = keys.pop() { a.leave(k) },
                    _ => {}
                }
                a.record(packets, ce, now);
                let c = a.config();
                prop_assert!(a.target_bps() >= c.min_target_bps);
                prop_assert!(a.target_bps() <= c.cap_bps());
                prop_assert!((0.0..=1.0).contains(&a.stats().alpha));
                if !keys.is_empty() && a.target_bps() / keys.len() as u64 >= c.min_flow_bps {
                    let sum: u64 = keys.iter().map(|k| a.grant_bps(*k)).sum();
                    prop_assert!(sum <= a.target_bps());
                }
            }
        }
    }
}
