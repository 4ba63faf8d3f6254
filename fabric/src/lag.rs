//! How late the fabric puts frames on the wire, and when a run fell behind.
//!
//! Queueing is decided on the emulated clock, so a slow loop iteration delays *when* a frame
//! is sent but not the order, marks or drops. The lag of a departure is its send time minus
//! its scheduled delivery time; [`LagHist`] collects them and [`LagHist::stats`] summarises
//! them as [`LagStats`], whose `behind` ([`is_behind`]) says the run must not be used as a
//! result. No I/O, no clock.

use serde::{Deserialize, Serialize};

/// How late departures were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LagStats {
    /// Frames sent (or lost on a link) so far.
    pub departures: u64,
    /// Of those, later than `max_lag_ns`.
    pub late: u64,
    /// The bound.
    pub max_lag_ns: u64,
    /// Largest lag seen.
    pub worst_ns: u64,
    /// Mean lag.
    pub mean_ns: u64,
    /// 99th percentile (upper bound of its power-of-two bucket).
    pub p99_ns: u64,
    /// `late / departures` exceeded the allowed fraction: results of this run are not valid.
    pub behind: bool,
}

/// Whether a run with `late` of `departures` frames later than the bound fell behind: more
/// than `max_late_fraction` of its departures were late. A run with no departures is not
/// behind.
pub fn is_behind(departures: u64, late: u64, max_late_fraction: f64) -> bool {
    departures > 0 && late as f64 > max_late_fraction * departures as f64
}

/// Power-of-two lag histogram, bucket k = [2^k, 2^(k+1)) ns (a lag of 0 counts as 1 ns).
#[derive(Debug, Clone)]
pub struct LagHist {
    buckets: [u64; 64],
    count: u64,
    sum: u128,
    worst: u64,
    late: u64,
}

impl Default for LagHist {
    fn default() -> Self {
        LagHist {
            buckets: [0; 64],
            count: 0,
            sum: 0,
            worst: 0,
            late: 0,
        }
    }
}

impl LagHist {
    /// Counts one departure `lag` ns late; later than `bound` is late.
    pub fn add(&mut self, lag: u64, bound: u64) {
        let k = 63 - lag.max(1).leading_zeros() as usize;
        self.buckets[k] += 1;
        self.count += 1;
        self.sum += u128::from(lag);
        self.worst = self.worst.max(lag);
        if lag > bound {
            self.late += 1;
        }
    }

    /// The summary, with `bound` the lag bound the departures were counted against and
    /// `max_late_fraction` the share of late departures a valid run stays within.
    pub fn stats(&self, bound: u64, max_late_fraction: f64) -> LagStats {
        let mut p99 = 0;
        let target = self.count - self.count / 100;
        let mut seen = 0;
        for (k, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= target && self.count > 0 {
                p99 = if k >= 63 {
                    u64::MAX
                } else {
                    (1u64 << (k + 1)) - 1
                };
                break;
            }
        }
        LagStats {
            departures: self.count,
            late: self.late,
            max_lag_ns: bound,
            worst_ns: self.worst,
            mean_ns: self
                .sum
                .checked_div(u128::from(self.count))
                .map_or(0, |m| m as u64),
            p99_ns: p99,
            behind: is_behind(self.count, self.late, max_late_fraction),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behind_means_more_than_the_allowed_fraction_late() {
        // No departures: nothing to judge.
        assert!(!is_behind(0, 0, 0.01));
        assert!(!is_behind(0, 0, 0.0));
        // 1% of 1000 is 10: exactly at the bound is still valid, one more is not.
        assert!(!is_behind(1000, 0, 0.01));
        assert!(!is_behind(1000, 10, 0.01));
        assert!(is_behind(1000, 11, 0.01));
        // A zero fraction tolerates no late departure at all.
        assert!(!is_behind(5, 0, 0.0));
        assert!(is_behind(5, 1, 0.0));
        // Every departure late.
        assert!(is_behind(3, 3, 0.5));
        // Large counts do not overflow.
        assert!(!is_behind(u64::MAX, u64::MAX / 200, 0.01));
        assert!(is_behind(u64::MAX, u64::MAX / 50, 0.01));
    }

    #[test]
    fn histogram_summary_counts_late_departures_against_the_bound() {
        let bound = 1_000_000;
        let mut h = LagHist::default();
        assert_eq!(
            h.stats(bound, 0.01),
            LagStats {
                max_lag_ns: bound,
                ..LagStats::default()
            }
        );
        // 990 punctual departures (lag 0 counts in the 1 ns bucket) and 10 at 2 ms.
        for _ in 0..990 {
            h.add(0, bound);
        }
        for _ in 0..10 {
            h.add(2_000_000, bound);
        }
        let s = h.stats(bound, 0.01);
        assert_eq!(s.departures, 1000);
        assert_eq!(s.late, 10);
        assert_eq!(s.worst_ns, 2_000_000);
        assert_eq!(s.mean_ns, 20_000);
        // 99% of 1000 = 990 departures are within the first bucket [1, 2) ns.
        assert_eq!(s.p99_ns, 1);
        assert!(!s.behind, "10 of 1000 is exactly 1%: {s:?}");

        // One more late departure tips the run over 1%.
        h.add(bound + 1, bound);
        let s = h.stats(bound, 0.01);
        assert_eq!(s.late, 11);
        assert!(s.behind, "{s:?}");
        // The 99th percentile must cover 1001 - 10 = 991 departures: the 990 punctual ones
        // and the one just over the bound, in bucket [2^19, 2^20) ns.
        assert_eq!(s.p99_ns, (1 << 20) - 1);
        // A lag exactly at the bound is not late.
        let mut h = LagHist::default();
        h.add(bound, bound);
        assert_eq!(h.stats(bound, 0.0).late, 0);
    }
}
