//! Time bounds per reduce-scatter step (OptiReduce): fixed, or adaptive from the steps this
//! group saw.
//!
//! The adaptive bound is `factor` times the 95th percentile of the last [`WINDOW`] steps'
//! waiting times (from when a step could start to its end), at least `floor`, and none until
//! [`MIN_SAMPLES`] steps were seen: a step that waits far longer than its peers usually do is
//! cut off with what arrived. Steps cut off by the bound count too: when more than 5 % hit
//! it, the percentile is the bound itself and the next bound is `factor` times longer, so a
//! network that slowed down for good is followed, not starved. Each rank learns its own bound;
//! the ranks still agree on the result, because contributor sets travel with the data and
//! the all-gather is reliable.

use std::collections::VecDeque;
use std::time::Duration;

/// Steps remembered.
pub const WINDOW: usize = 64;
/// Steps seen before an adaptive bound applies.
pub const MIN_SAMPLES: usize = 8;

/// A time bound per lossy step of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum StepDeadline {
    /// Only the loss bound ends a step early.
    #[default]
    None,
    /// Every step ends at most this long after it could start.
    Fixed(Duration),
    /// `factor` x the 95th percentile of the recent steps' waits, at least `floor`.
    Adaptive {
        /// Multiplier of the percentile (OptiReduce uses 1.5-2).
        factor: f64,
        /// Shortest bound.
        floor: Duration,
    },
}

impl StepDeadline {
    /// The adaptive bound with its defaults: 1.5 x the 95th percentile, at least 1 ms.
    pub const ADAPTIVE: StepDeadline = StepDeadline::Adaptive {
        factor: 1.5,
        floor: Duration::from_millis(1),
    };

    /// Checks the bound's parameters.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            StepDeadline::None => Ok(()),
            StepDeadline::Fixed(d) if d.is_zero() => {
                Err("a fixed step deadline must be longer than 0".into())
            }
            StepDeadline::Fixed(_) => Ok(()),
            StepDeadline::Adaptive { factor, .. } if !(factor.is_finite() && factor >= 1.0) => Err(
                format!("an adaptive step deadline's factor {factor} must be a number >= 1"),
            ),
            StepDeadline::Adaptive { .. } => Ok(()),
        }
    }
}

/// The recent steps' waiting times of one group.
#[derive(Debug, Default)]
pub struct StepTimes {
    waits: VecDeque<Duration>,
}

impl StepTimes {
    /// Notes a finished step.
    pub fn record(&mut self, waited: Duration) {
        if self.waits.len() == WINDOW {
            self.waits.pop_front();
        }
        self.waits.push_back(waited);
    }

    /// The bound the next operation's steps get.
    pub fn bound(&self, d: &StepDeadline) -> Option<Duration> {
        match *d {
            StepDeadline::None => None,
            StepDeadline::Fixed(t) => Some(t),
            StepDeadline::Adaptive { factor, floor } => {
                if self.waits.len() < MIN_SAMPLES {
                    return None;
                }
                let mut w: Vec<Duration> = self.waits.iter().copied().collect();
                w.sort_unstable();
                let p95 = w[(w.len() * 95 / 100).min(w.len() - 1)];
                Some(p95.mul_f64(factor).max(floor))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn adaptive_bounds_wait_for_samples_then_follow_the_tail() {
        let mut t = StepTimes::default();
        let d = StepDeadline::ADAPTIVE;
        for _ in 0..MIN_SAMPLES - 1 {
            t.record(10 * MS);
        }
        assert_eq!(t.bound(&d), None, "too few steps seen");
        t.record(10 * MS);
        assert_eq!(t.bound(&d), Some(15 * MS));
        // One slow step in 32 is beyond the 95th percentile; one in ten moves it.
        for i in 0..WINDOW {
            t.record(if i % 32 == 0 { 40 * MS } else { 10 * MS });
        }
        assert_eq!(t.bound(&d), Some(15 * MS));
        for _ in 0..WINDOW / 10 {
            t.record(40 * MS);
        }
        assert_eq!(t.bound(&d), Some(60 * MS));
    }

    #[test]
    fn steps_cut_off_by_the_bound_raise_it() {
        let mut t = StepTimes::default();
        let d = StepDeadline::ADAPTIVE;
        for _ in 0..WINDOW {
            t.record(10 * MS);
        }
        // The network slowed: every step now hits the bound and reports it as its wait.
        let mut bound = t.bound(&d).expect("bound");
        for _ in 0..3 {
            for _ in 0..WINDOW / 10 {
                t.record(bound);
            }
            let next = t.bound(&d).expect("bound");
            assert!(next > bound, "{next:?} after {bound:?}");
            bound = next;
        }
    }

    #[test]
    fn fixed_none_floor_and_validation() {
        let t = StepTimes::default();
        assert_eq!(t.bound(&StepDeadline::None), None);
        assert_eq!(t.bound(&StepDeadline::Fixed(3 * MS)), Some(3 * MS));
        let mut t = StepTimes::default();
        for _ in 0..MIN_SAMPLES {
            t.record(Duration::from_micros(10));
        }
        let floored = StepDeadline::Adaptive {
            factor: 2.0,
            floor: 2 * MS,
        };
        assert_eq!(t.bound(&floored), Some(2 * MS));
        assert!(StepDeadline::Fixed(Duration::ZERO).validate().is_err());
        for f in [0.5, f64::NAN, f64::INFINITY] {
            let d = StepDeadline::Adaptive {
                factor: f,
                floor: MS,
            };
            assert!(d.validate().is_err(), "{f}");
        }
        assert!(StepDeadline::ADAPTIVE.validate().is_ok());
    }
}
