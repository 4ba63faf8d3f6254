//! Link rates that change over time: a link's schedule from its topology file, and which rate
//! is in force at a time counted from the fabric's start. Pure: the fabric's loop asks
//! [`RateSchedule::next_change_after`] when to wake and [`RateSchedule::rate_at`] what to
//! apply ([`crate::sched::EgressPort::set_rate`], both directions of the link).
//!
//! A schedule is the link's `rate` from time 0, then each entry's rate from its `at` until the
//! next entry. With a `period`, the whole timeline repeats: every period begins again at the
//! link's `rate` (or at an entry with `at = "0s"`), so a period must be longer than the last
//! `at`.

use serde::Serialize;

/// Shortest time between two steps, and shortest period: a schedule is for network conditions
/// that change over seconds, and the fabric wakes for every change.
pub const MIN_STEP_NS: u64 = 1_000_000;

/// One step of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RateStep {
    /// From this time (ns since the fabric's start, or since the start of the period).
    pub at_ns: u64,
    /// This rate, bit/s.
    pub rate_bps: u64,
}

/// A link's rate over time. Build it with [`RateSchedule::new`], which checks it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RateSchedule {
    base_bps: u64,
    steps: Vec<RateStep>,
    period_ns: Option<u64>,
}

/// Why a schedule is not usable; the topology reader adds the field's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Steps must go forward in time.
    #[error(
        "step {index}: `at` must be at least 1ms later than step {}'s ({} is not after {}); \
         list the steps in time order",
        index - 1,
        fmt_ns(*at_ns),
        fmt_ns(*prev_ns)
    )]
    NotIncreasing {
        /// The step.
        index: usize,
        /// Its time.
        at_ns: u64,
        /// The previous step's.
        prev_ns: u64,
    },
    /// A zero rate.
    #[error("step {index}: the rate must be above 0")]
    ZeroRate {
        /// The step.
        index: usize,
    },
    /// A step at or after the end of the period would never happen.
    #[error(
        "`period` ({}) must be longer than the last step's `at` ({})",
        fmt_ns(*period_ns),
        fmt_ns(*at_ns)
    )]
    PeriodTooShort {
        /// The period.
        period_ns: u64,
        /// The last step's time.
        at_ns: u64,
    },
    /// A period under [`MIN_STEP_NS`].
    #[error("`period` ({}) must be at least 1ms", fmt_ns(*period_ns))]
    ShortPeriod {
        /// The period.
        period_ns: u64,
    },
    /// No steps.
    #[error("a schedule needs at least one step")]
    Empty,
}

/// A time as the topology file would spell it (`20s`, `1500ms`).
fn fmt_ns(ns: u64) -> String {
    gradwire_units::format_duration(std::time::Duration::from_nanos(ns))
}

impl RateSchedule {
    /// `base_bps` from 0 (and from the start of every period), then each step from its time.
    pub fn new(
        base_bps: u64,
        steps: Vec<RateStep>,
        period_ns: Option<u64>,
    ) -> Result<RateSchedule, ScheduleError> {
        let last = steps.last().ok_or(ScheduleError::Empty)?.at_ns;
        if base_bps == 0 {
            // The link's own rate is checked by the topology; a caller passing 0 is refused
            // like a step would be.
            return Err(ScheduleError::ZeroRate { index: 0 });
        }
        for (index, s) in steps.iter().enumerate() {
            if s.rate_bps == 0 {
                return Err(ScheduleError::ZeroRate { index });
            }
            if let Some(prev) = index.checked_sub(1).map(|i| steps[i]) {
                if s.at_ns < prev.at_ns.saturating_add(MIN_STEP_NS) {
                    return Err(ScheduleError::NotIncreasing {
                        index,
                        at_ns: s.at_ns,
                        prev_ns: prev.at_ns,
                    });
                }
            }
        }
        match period_ns {
            Some(p) if p < MIN_STEP_NS => return Err(ScheduleError::ShortPeriod { period_ns: p }),
            Some(p) if p <= last => {
                return Err(ScheduleError::PeriodTooShort {
                    period_ns: p,
                    at_ns: last,
                })
            }
            _ => {}
        }
        Ok(RateSchedule {
            base_bps,
            steps,
            period_ns,
        })
    }

    /// The rate before the first step of each period.
    pub fn base_bps(&self) -> u64 {
        self.base_bps
    }

    /// The steps, in time order.
    pub fn steps(&self) -> &[RateStep] {
        &self.steps
    }

    /// The period, if the schedule repeats.
    pub fn period_ns(&self) -> Option<u64> {
        self.period_ns
    }

    /// The highest rate the link ever runs at (buffers are sized for it).
    pub fn max_bps(&self) -> u64 {
        self.steps
            .iter()
            .map(|s| s.rate_bps)
            .fold(self.base_bps, u64::max)
    }

    /// The rate in force at `t_ns` (a step applies from its time on, inclusive).
    pub fn rate_at(&self, t_ns: u64) -> u64 {
        let t = self.period_ns.map_or(t_ns, |p| t_ns % p);
        self.steps
            .iter()
            .rev()
            .find(|s| s.at_ns <= t)
            .map_or(self.base_bps, |s| s.rate_bps)
    }

    /// The first time after `t_ns` at which the schedule says something new (a step, or the
    /// start of the next period); `None` when nothing follows. The rate there may equal the
    /// one before (a step that repeats a rate); applying it changes nothing.
    pub fn next_change_after(&self, t_ns: u64) -> Option<u64> {
        match self.period_ns {
            None => self.steps.iter().map(|s| s.at_ns).find(|&a| a > t_ns),
            Some(p) => {
                let start = t_ns - t_ns % p;
                let within = t_ns % p;
                let next = self
                    .steps
                    .iter()
                    .map(|s| s.at_ns)
                    .find(|&a| a > within)
                    // The next period starts at the link's rate (or its step at 0).
                    .unwrap_or(p);
                start.checked_add(next)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn step(at_ms: u64, mbit: u64) -> RateStep {
        RateStep {
            at_ns: at_ms * MS,
            rate_bps: mbit * 1_000_000,
        }
    }

    #[test]
    fn rate_at_and_next_change_without_period() {
        let s = RateSchedule::new(100_000_000, vec![step(20, 30), step(50, 60)], None).unwrap();
        assert_eq!(s.rate_at(0), 100_000_000);
        assert_eq!(s.rate_at(20 * MS - 1), 100_000_000);
        assert_eq!(s.rate_at(20 * MS), 30_000_000);
        assert_eq!(s.rate_at(49 * MS), 30_000_000);
        assert_eq!(s.rate_at(50 * MS), 60_000_000);
        assert_eq!(s.rate_at(u64::MAX), 60_000_000);
        assert_eq!(s.next_change_after(0), Some(20 * MS));
        assert_eq!(s.next_change_after(20 * MS - 1), Some(20 * MS));
        assert_eq!(s.next_change_after(20 * MS), Some(50 * MS));
        assert_eq!(s.next_change_after(50 * MS), None);
        assert_eq!(s.max_bps(), 100_000_000);
    }

    #[test]
    fn a_period_repeats_from_the_links_rate() {
        // 10 Mbit/s from 0, 2 from 20 ms, 5 from 40 ms, again from 60 ms.
        let s =
            RateSchedule::new(10_000_000, vec![step(20, 2), step(40, 5)], Some(60 * MS)).unwrap();
        let at = |ms: u64| s.rate_at(ms * MS) / 1_000_000;
        assert_eq!([at(0), at(19), at(20), at(40), at(59)], [10, 10, 2, 5, 5]);
        assert_eq!(
            [at(60), at(80), at(100), at(120), at(6_000_020)],
            [10, 2, 5, 10, 2]
        );
        let next = |ms: u64| s.next_change_after(ms * MS).map(|t| t / MS);
        assert_eq!(next(0), Some(20));
        assert_eq!(
            next(40),
            Some(60),
            "the period's end brings the base rate back"
        );
        assert_eq!(next(59), Some(60));
        assert_eq!(next(60), Some(80));
        assert_eq!(next(6_000_045), Some(6_000_060));
        // Walking the changes visits each step of every period, in order.
        let mut t = 0;
        let mut seen = Vec::new();
        while let Some(n) = s.next_change_after(t).filter(|&n| n <= 130 * MS) {
            seen.push((n / MS, s.rate_at(n) / 1_000_000));
            t = n;
        }
        assert_eq!(
            seen,
            [(20, 2), (40, 5), (60, 10), (80, 2), (100, 5), (120, 10)]
        );
        // A step at 0 replaces the base rate in every period.
        let s =
            RateSchedule::new(10_000_000, vec![step(0, 7), step(30, 3)], Some(60 * MS)).unwrap();
        assert_eq!(s.rate_at(0), 7_000_000);
        assert_eq!(s.rate_at(60 * MS), 7_000_000);
        assert_eq!(s.next_change_after(30 * MS), Some(60 * MS));
        assert_eq!(s.max_bps(), 10_000_000);
        // Near the end of time: no overflow.
        assert_eq!(s.next_change_after(u64::MAX - 1), None);
    }

    #[test]
    fn bad_schedules_are_refused() {
        let bad = |steps: Vec<RateStep>, p: Option<u64>| {
            RateSchedule::new(1_000_000, steps, p).unwrap_err()
        };
        let e = bad(vec![step(20, 3), step(20, 4)], None);
        assert!(
            matches!(e, ScheduleError::NotIncreasing { index: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("later than step 0"), "{e}");
        let e = bad(vec![step(20, 3), step(10, 4)], None);
        assert!(matches!(e, ScheduleError::NotIncreasing { index: 1, .. }));
        let e = bad(vec![step(20, 3), step(30, 0)], None);
        assert_eq!(e, ScheduleError::ZeroRate { index: 1 });
        let e = bad(vec![step(20, 3)], Some(20 * MS));
        assert!(e.to_string().contains("longer than the last step"), "{e}");
        let e = bad(vec![step(0, 3)], Some(999_999));
        assert_eq!(e, ScheduleError::ShortPeriod { period_ns: 999_999 });
        assert!(e.to_string().contains("at least 1ms"), "{e}");
        // Steps closer than 1 ms: the fabric would wake for each.
        let close = vec![
            step(20, 3),
            RateStep {
                at_ns: 20 * MS + 999_999,
                rate_bps: 1,
            },
        ];
        let e = bad(close, None);
        assert!(
            matches!(e, ScheduleError::NotIncreasing { index: 1, .. }),
            "{e}"
        );
        RateSchedule::new(1, vec![step(20, 3), step(21, 4)], Some(22 * MS)).unwrap();
        assert_eq!(bad(vec![], None), ScheduleError::Empty);
    }
}
