//! Per-peer path state: the RTT estimator (RFC 6298, with a millisecond floor rather than
//! TCP's 200 ms) and the congestion window (slow start, then additive increase; DCTCP-style
//! decrease on CE marks; halved only on heavy loss, because a bounded-loss job expects random
//! loss that is not congestion).

use std::time::Duration;

/// RTT estimate of one peer.
#[derive(Debug, Clone)]
pub struct Rtt {
    srtt: Option<Duration>,
    rttvar: Duration,
    min: Duration,
    max: Duration,
    initial: Duration,
}

impl Rtt {
    /// An estimator with no sample yet.
    pub fn new(initial: Duration, min: Duration, max: Duration) -> Rtt {
        Rtt {
            srtt: None,
            rttvar: Duration::ZERO,
            min,
            max,
            initial,
        }
    }

    /// Takes a sample.
    pub fn sample(&mut self, r: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = self.rttvar * 3 / 4 + diff / 4;
                self.srtt = Some(s * 7 / 8 + r / 8);
            }
        }
    }

    /// Smoothed RTT (`None` before the first sample).
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// Retransmission timeout: SRTT + 4 RTTVAR, within [min, max]; the initial value before
    /// any sample.
    pub fn rto(&self) -> Duration {
        match self.srtt {
            None => self.initial,
            Some(s) => (s + 4 * self.rttvar).clamp(self.min, self.max),
        }
    }
}

/// Congestion window of one peer, in segments.
#[derive(Debug, Clone)]
pub struct Window {
    cwnd: f64,
    ssthresh: f64,
    min: f64,
    max: f64,
    /// Acked segments, CE marks and segments seen lost since the last decrease decision.
    acked: u64,
    marked: u64,
    lost: u64,
}

impl Window {
    /// A window of `initial` segments that stays within [2, `max`].
    pub fn new(initial: u32, max: u32) -> Window {
        Window::with_floor(initial, max, 2)
    }

    /// A window of `initial` segments that stays within [`floor`, `max`] (a floor of at least
    /// 2). A sender's window must not fall below the receiver's ACK interval: a window smaller
    /// than that is never acknowledged by itself, only after a retransmission timeout, so the
    /// sender would crawl a few segments per timeout.
    pub fn with_floor(initial: u32, max: u32, floor: u32) -> Window {
        let max = max.max(2);
        let min = floor.clamp(2, max);
        Window {
            cwnd: f64::from(initial.clamp(min, max)),
            ssthresh: f64::from(max),
            min: f64::from(min),
            max: f64::from(max),
            acked: 0,
            marked: 0,
            lost: 0,
        }
    }

    /// Segments allowed in flight.
    pub fn segments(&self) -> u32 {
        self.cwnd as u32
    }

    /// `acked` more segments arrived, `marked` of them CE.
    pub fn on_ack(&mut self, acked: u32, marked: u32) {
        self.acked += u64::from(acked);
        self.marked += u64::from(marked.min(acked));
        if marked == 0 {
            if self.cwnd < self.ssthresh {
                self.cwnd += f64::from(acked);
            } else {
                self.cwnd += f64::from(acked) / self.cwnd;
            }
        }
        // One decrease per window's worth of acks: halved when more than 10 % of it was seen
        // lost (as on_pass_loss), else by half the marked fraction (DCTCP).
        if self.acked as f64 >= self.cwnd {
            if self.lost as f64 > 0.1 * self.acked as f64 {
                self.cwnd /= 2.0;
                self.ssthresh = self.cwnd;
            } else if self.marked > 0 {
                let f = self.marked as f64 / self.acked as f64;
                self.cwnd *= 1.0 - f / 2.0;
                self.ssthresh = self.cwnd;
            }
            self.acked = 0;
            self.marked = 0;
            self.lost = 0;
        }
        self.cwnd = self.cwnd.clamp(self.min, self.max);
    }

    /// `n` segments were seen lost (a receiver's gaps): counted against the current window
    /// of acks by [`Window::on_ack`].
    pub fn on_lost(&mut self, n: u32) {
        self.lost += u64::from(n);
    }

    /// A pass ended with `lost` of `sent` segments missing: halve on heavy loss (above 10 %,
    /// far above the random loss a bounded job is built for), otherwise keep the window.
    pub fn on_pass_loss(&mut self, lost: u32, sent: u32) {
        if sent > 0 && f64::from(lost) > 0.1 * f64::from(sent) {
            self.cwnd = (self.cwnd / 2.0).max(self.min);
            self.ssthresh = self.cwnd;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rto_follows_samples_within_its_floor_and_ceiling() {
        let ms = Duration::from_millis;
        let mut r = Rtt::new(ms(5), ms(1), ms(200));
        assert_eq!(r.rto(), ms(5));
        r.sample(Duration::from_micros(100));
        // 100 us + 4 * 50 us = 300 us, below the 1 ms floor.
        assert_eq!(r.rto(), ms(1));
        for _ in 0..20 {
            r.sample(ms(40));
        }
        assert!(r.rto() > ms(40) && r.rto() < ms(80), "{:?}", r.rto());
        r.sample(Duration::from_secs(10));
        assert_eq!(r.rto(), ms(200));
    }

    #[test]
    fn window_grows_then_backs_off_on_marks_and_heavy_loss() {
        let mut w = Window::new(16, 1000);
        w.on_ack(16, 0);
        assert_eq!(w.segments(), 32);
        let before = w.segments();
        w.on_ack(32, 32);
        assert!(w.segments() < before, "all marked must shrink the window");
        let before = w.segments();
        w.on_pass_loss(2, 100);
        assert_eq!(w.segments(), before, "2 % random loss is not congestion");
        w.on_pass_loss(50, 100);
        assert_eq!(w.segments(), (before / 2).max(2));
        for _ in 0..100 {
            w.on_pass_loss(100, 100);
        }
        assert_eq!(w.segments(), 2);
    }

    #[test]
    fn a_window_of_arrivals_with_heavy_gaps_halves_and_random_loss_does_not() {
        let mut w = Window::new(100, 100);
        w.on_lost(2);
        w.on_ack(100, 0);
        assert_eq!(w.segments(), 100, "2 % of a window lost is not congestion");
        w.on_lost(20);
        w.on_ack(100, 0);
        assert_eq!(w.segments(), 50);
    }

    #[test]
    fn a_floored_window_never_falls_below_the_ack_interval() {
        let mut w = Window::with_floor(128, 16384, 32);
        for _ in 0..20 {
            w.on_pass_loss(100, 100);
        }
        assert_eq!(w.segments(), 32);
        // A floor above the ceiling is the ceiling; below 2 it is 2.
        assert_eq!(Window::with_floor(8, 16, 64).segments(), 16);
        let mut w = Window::with_floor(1, 16, 0);
        w.on_pass_loss(100, 100);
        assert_eq!(w.segments(), 2);
    }
}
