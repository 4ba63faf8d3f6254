//! DLCP minimal rate control (paper §3.2.1, Figure 7), a token-bucket pacer and a rate meter.
//!
//! Loss tolerance means the sender only needs enough rate control to avoid congestion
//! collapse: start at line rate, halve when the receiver sees much less than was sent,
//! otherwise creep back up additively. Everything here is a pure function of its inputs: no
//! I/O, no clocks. Time is always a caller-supplied `u64` of nanoseconds from any monotonic
//! origin, which keeps the logic deterministic and testable in simulated time.
//!
//! Typical use: on the receiver, a [`RateMeter`] over bytes received produces a
//! `RateReport` (see [`crate::message`]) every period. The sender divides the bytes it sent
//! since the previous report by the time since then ([`rate_bps`]) and hands both rates to
//! [`RateController::on_report`]; the controller's rate is fed to a [`Pacer`] with
//! [`Pacer::set_rate`].

use thiserror::Error;

/// Nanoseconds per second.
const NS_PER_SEC: u64 = 1_000_000_000;

/// Rate-control parameters. [`RateConfig::new`] gives the paper's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateConfig {
    /// Link bandwidth in bit/s: the starting rate and the ceiling.
    pub line_rate_bps: u64,
    /// Δ: congestion is declared when send rate > Δ · receive rate. Paper: 2.
    pub delta: f64,
    /// Feedback period in ns. Paper: 200 µs.
    pub period_ns: u64,
    /// Additive increase per period, as a fraction of line rate. Paper: 5 %.
    pub additive_increase: f64,
    /// Floor for halving, so the rate never reaches 0 (and can recover in a few periods).
    pub min_rate_bps: u64,
}

/// Why a [`RateConfig`] is unusable.
#[derive(Debug, Clone, Copy, PartialEq, Error)]
pub enum RateConfigError {
    /// `line_rate_bps` is 0.
    #[error("line rate must be > 0")]
    ZeroLineRate,
    /// `delta` is below 1, NaN or infinite.
    #[error("delta must be finite and >= 1, got {0}")]
    BadDelta(f64),
    /// `period_ns` is 0.
    #[error("rate-control period must be > 0")]
    ZeroPeriod,
    /// `additive_increase` is not in `(0, 1]`.
    #[error("additive increase must be in (0, 1], got {0}")]
    BadAdditiveIncrease(f64),
    /// `min_rate_bps` is 0 or above the line rate.
    #[error("minimum rate {min_rate_bps} must be in 1..=line rate {line_rate_bps}")]
    BadMinRate {
        /// The configured floor.
        min_rate_bps: u64,
        /// The configured line rate.
        line_rate_bps: u64,
    },
}

impl RateConfig {
    /// Paper defaults for a link of `line_rate_bps`: Δ = 2, 200 µs period, +5 % of line rate
    /// per period, floor = line rate / 1000 but at least 1 Mbit/s (never above line rate).
    pub fn new(line_rate_bps: u64) -> Self {
        RateConfig {
            line_rate_bps,
            delta: 2.0,
            period_ns: 200_000,
            additive_increase: 0.05,
            min_rate_bps: (line_rate_bps / 1000).max(1_000_000).min(line_rate_bps),
        }
    }

    /// Checks every parameter's range.
    pub fn validate(&self) -> Result<(), RateConfigError> {
        if self.line_rate_bps == 0 {
            return Err(RateConfigError::ZeroLineRate);
        }
        if !(self.delta.is_finite() && self.delta >= 1.0) {
            return Err(RateConfigError::BadDelta(self.delta));
        }
        if self.period_ns == 0 {
            return Err(RateConfigError::ZeroPeriod);
        }
        // Negated `contains`-style test so NaN is rejected as well.
        if !(self.additive_increase > 0.0 && self.additive_increase <= 1.0) {
            return Err(RateConfigError::BadAdditiveIncrease(self.additive_increase));
        }
        if self.min_rate_bps == 0 || self.min_rate_bps > self.line_rate_bps {
            return Err(RateConfigError::BadMinRate {
                min_rate_bps: self.min_rate_bps,
                line_rate_bps: self.line_rate_bps,
            });
        }
        Ok(())
    }
}

/// The two states of Figure 7.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RateState {
    /// Sending at line rate until the first sign of congestion.
    LineRateStart,
    /// Halving on congestion, additive increase otherwise.
    CongestionAvoidance,
}

/// What [`RateController::on_report`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RateEvent {
    /// Rate unchanged (no congestion at line rate, or the report was ignored).
    Hold,
    /// Congestion: rate halved (not below the floor).
    Halved,
    /// No congestion in congestion avoidance: rate raised (not above line rate).
    Increased,
}

/// The DLCP rate-control state machine (Figure 7).
///
/// | state | send > Δ·recv | otherwise |
/// |---|---|---|
/// | `LineRateStart` | halve, go to `CongestionAvoidance` | hold at line rate |
/// | `CongestionAvoidance` | halve | add `additive_increase`·line rate |
///
/// A retransmission pass resets to `LineRateStart` at line rate.
///
/// The paper's prose for the congestion-avoidance state literally says to halve when the send
/// rate is *smaller* than Δ times the receive rate; that contradicts the first bullet, the
/// intent (back off when much less arrives than is sent) and Figure 7, so we halve when
/// send > Δ·recv in both states.
#[derive(Debug, Clone)]
pub struct RateController {
    cfg: RateConfig,
    state: RateState,
    rate_bps: u64,
    /// Effective floor: `min(min_rate_bps, line_rate_bps)`, so an unvalidated config with the
    /// floor above the ceiling still keeps the rate within `[floor, line]`.
    floor_bps: u64,
    /// Additive step in bit/s, precomputed once.
    step_bps: u64,
}

impl RateController {
    /// Starts in `LineRateStart` at line rate. Does not validate `cfg` (see [`Self::try_new`]);
    /// a bad config gives odd but bounded behaviour, never a panic.
    pub fn new(cfg: RateConfig) -> Self {
        // `as` saturates (NaN -> 0), which is the safe reading of a nonsense fraction.
        let step_bps = (cfg.additive_increase * cfg.line_rate_bps as f64).round() as u64;
        RateController {
            cfg,
            state: RateState::LineRateStart,
            rate_bps: cfg.line_rate_bps,
            floor_bps: cfg.min_rate_bps.min(cfg.line_rate_bps),
            step_bps,
        }
    }

    /// [`Self::new`] after [`RateConfig::validate`].
    pub fn try_new(cfg: RateConfig) -> Result<Self, RateConfigError> {
        cfg.validate()?;
        Ok(Self::new(cfg))
    }

    /// Current sending rate in bit/s.
    pub fn rate_bps(&self) -> u64 {
        self.rate_bps
    }

    /// Current state.
    pub fn state(&self) -> RateState {
        self.state
    }

    /// The configuration in use.
    pub fn config(&self) -> &RateConfig {
        &self.cfg
    }

    /// One period's feedback: the sender's measured send rate over the period and the
    /// receiver's reported receive rate, both in bit/s.
    ///
    /// A report with `send_rate_bps == 0` is ignored (an idle sender, e.g. one waiting on the
    /// control channel, says nothing about congestion), as is any NaN, infinite or negative
    /// input: all give [`RateEvent::Hold`].
    pub fn on_report(&mut self, send_rate_bps: f64, recv_rate_bps: f64) -> RateEvent {
        let usable = send_rate_bps.is_finite()
            && recv_rate_bps.is_finite()
            && send_rate_bps > 0.0
            && recv_rate_bps >= 0.0;
        if !usable {
            return RateEvent::Hold;
        }
        let congested = send_rate_bps > self.cfg.delta * recv_rate_bps;
        match (self.state, congested) {
            (_, true) => {
                self.rate_bps = (self.rate_bps / 2).max(self.floor_bps);
                self.state = RateState::CongestionAvoidance;
                RateEvent::Halved
            }
            (RateState::LineRateStart, false) => RateEvent::Hold,
            (RateState::CongestionAvoidance, false) => {
                self.rate_bps = self
                    .rate_bps
                    .saturating_add(self.step_bps)
                    .min(self.cfg.line_rate_bps);
                RateEvent::Increased
            }
        }
    }

    /// A retransmission pass starts: back to `LineRateStart` at line rate.
    pub fn on_retransmit(&mut self) {
        self.state = RateState::LineRateStart;
        self.rate_bps = self.cfg.line_rate_bps;
    }
}

/// How a sender chooses its rate. The receiver always grants (see [`crate::grant`]); what the
/// sender does with grants and reports is the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RateMode {
    /// Receiver-driven (the default): pace at the receiver's latest `RateGrant`, its share of
    /// the receiver's capacity adapted to the CE marks arriving there. A flow starts at its
    /// share (or, before the first grant, at the rate remembered from the previous flow to
    /// the same receiver, else the floor), never at line rate; retransmission passes keep
    /// the granted rate.
    #[default]
    Grant,
    /// Sender-side reaction to the CE fraction the receiver reports, DCTCP-style
    /// ([`EcnRateController`]): start at the remembered rate (else line rate), cut by
    /// `alpha / 2` in a period with marks, add `additive_increase` of line rate otherwise.
    /// Grants are ignored. The ablation "no grants".
    Ecn,
    /// DLCP's Figure 7 ([`RateController`]), as the paper specifies it: line-rate start, halve
    /// when send > Δ · receive, additive increase; every retransmission pass restarts at line
    /// rate. Grants are ignored. For comparison.
    Fig7,
}

impl RateMode {
    /// The mode's name on command lines and in reports.
    pub fn name(self) -> &'static str {
        match self {
            RateMode::Grant => "grant",
            RateMode::Ecn => "ecn",
            RateMode::Fig7 => "fig7",
        }
    }

    /// The mode named `name` (as [`Self::name`] spells it).
    pub fn from_name(name: &str) -> Option<RateMode> {
        [RateMode::Grant, RateMode::Ecn, RateMode::Fig7]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// DCTCP's estimation gain g (RFC 8257 §4.2 recommends 1/16).
pub const DCTCP_GAIN: f64 = 1.0 / 16.0;

/// The sender-side CE reaction of [`RateMode::Ecn`], DCTCP's rule (RFC 8257) applied to a
/// rate once per report period instead of a window once per RTT:
/// `alpha = (1 - g) alpha + g F`, with `F` the fraction of the period's packets that arrived
/// CE-marked; a period with marks multiplies the rate by `1 - alpha / 2`, a period without
/// adds `additive_increase` of line rate. The rate stays within `[min_rate, line_rate]`.
#[derive(Debug, Clone)]
pub struct EcnRateController {
    cfg: RateConfig,
    rate_bps: u64,
    alpha: f64,
    gain: f64,
    step_bps: u64,
    floor_bps: u64,
}

impl EcnRateController {
    /// Starts at `start_bps` (clamped to `[min_rate, line_rate]`) with `alpha = 1`, DCTCP's
    /// initial value (the first marks halve the rate).
    pub fn new(cfg: RateConfig, start_bps: u64) -> Self {
        let floor_bps = cfg.min_rate_bps.min(cfg.line_rate_bps);
        EcnRateController {
            rate_bps: start_bps.clamp(floor_bps, cfg.line_rate_bps.max(floor_bps)),
            alpha: 1.0,
            gain: DCTCP_GAIN,
            step_bps: (cfg.additive_increase * cfg.line_rate_bps as f64).round() as u64,
            floor_bps,
            cfg,
        }
    }

    /// Current rate, bit/s.
    pub fn rate_bps(&self) -> u64 {
        self.rate_bps
    }

    /// The congestion estimate alpha, in `[0, 1]`.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// One period's report: `packets` data packets arrived, `ce_packets` of them marked. A
    /// period with no packets says nothing and changes nothing.
    pub fn on_report(&mut self, packets: u64, ce_packets: u64) -> RateEvent {
        if packets == 0 {
            return RateEvent::Hold;
        }
        let f = (ce_packets.min(packets) as f64) / packets as f64;
        self.alpha = (1.0 - self.gain) * self.alpha + self.gain * f;
        if ce_packets > 0 {
            let cut = (self.rate_bps as f64 * (1.0 - self.alpha / 2.0)) as u64;
            self.rate_bps = cut.max(self.floor_bps);
            RateEvent::Halved
        } else {
            self.rate_bps = self
                .rate_bps
                .saturating_add(self.step_bps)
                .min(self.cfg.line_rate_bps.max(self.floor_bps));
            RateEvent::Increased
        }
    }
}

/// Token credit per byte: credit is kept in bit·ns/s units so that a refill is the exact
/// integer `rate_bps * elapsed_ns`, with no rounding drift however long the pacer runs.
const CREDIT_PER_BYTE: i128 = 8 * NS_PER_SEC as i128;

/// Token-bucket pacer driven by the caller's clock.
///
/// The bucket starts full (`burst_bytes`) and refills at the configured rate, capped at the
/// burst. [`Self::consume`] may drive it negative (debt), so a packet larger than the burst
/// can still go: the rule is that a packet of `len` bytes may be sent once
/// `available(now) >= min(len, burst)`, which is exactly what [`Self::next_send_at`] waits
/// for and [`Self::try_consume`] checks. Debt is repaid before the next send, so the long-run
/// rate is exact.
///
/// Arithmetic is integer (`i128`/`u128`): `u64::MAX` bit/s for `u64::MAX` ns still fits, so
/// 400 Gbit/s over hours is far from any limit.
#[derive(Debug, Clone)]
pub struct Pacer {
    rate_bps: u64,
    burst_bytes: u64,
    /// Credit in `CREDIT_PER_BYTE` units; negative is debt. Never above the burst.
    tokens: i128,
    /// Time of the last refill; `None` until the first call that passes a time.
    last_ns: Option<u64>,
}

impl Pacer {
    /// A pacer at `rate_bps` with a bucket of `burst_bytes`, initially full.
    pub fn new(rate_bps: u64, burst_bytes: u64) -> Self {
        let mut p = Pacer {
            rate_bps,
            burst_bytes,
            tokens: 0,
            last_ns: None,
        };
        p.tokens = p.burst_credit();
        p
    }

    /// Changes the rate from now on. Credit accrued since the last [`Self::available`] /
    /// [`Self::try_consume`] call is counted at the new rate, so call one of them first if
    /// the exact switch instant matters.
    pub fn set_rate(&mut self, rate_bps: u64) {
        self.rate_bps = rate_bps;
    }

    /// Current rate in bit/s.
    pub fn rate_bps(&self) -> u64 {
        self.rate_bps
    }

    /// Changes the bucket size from now on; credit above the new size is forfeited.
    pub fn set_burst(&mut self, burst_bytes: u64) {
        self.burst_bytes = burst_bytes;
        self.tokens = self.tokens.min(self.burst_credit());
    }

    /// Bucket size in bytes.
    pub fn burst_bytes(&self) -> u64 {
        self.burst_bytes
    }

    fn burst_credit(&self) -> i128 {
        i128::from(self.burst_bytes) * CREDIT_PER_BYTE
    }

    /// Credit the bucket would hold at `now_ns`, without mutating anything.
    fn credit_at(&self, now_ns: u64) -> i128 {
        let Some(last) = self.last_ns else {
            return self.tokens;
        };
        // A clock that steps back accrues nothing rather than underflowing.
        let elapsed = now_ns.saturating_sub(last);
        let add = u128::from(self.rate_bps) * u128::from(elapsed);
        let add = i128::try_from(add).unwrap_or(i128::MAX);
        self.tokens.saturating_add(add).min(self.burst_credit())
    }

    fn refill(&mut self, now_ns: u64) {
        self.tokens = self.credit_at(now_ns);
        self.last_ns = Some(self.last_ns.map_or(now_ns, |l| l.max(now_ns)));
    }

    /// Bytes that may be sent at `now_ns` (0 while in debt).
    pub fn available(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        u64::try_from(self.tokens / CREDIT_PER_BYTE).unwrap_or(0)
    }

    /// Takes `bytes` from the bucket; may leave it in debt.
    pub fn consume(&mut self, bytes: u64) {
        self.tokens = self
            .tokens
            .saturating_sub(i128::from(bytes) * CREDIT_PER_BYTE);
    }

    /// Consumes `bytes` and returns true if a packet of that size may go at `now_ns` (see
    /// the type's sending rule); otherwise changes nothing but the refill and returns false.
    pub fn try_consume(&mut self, now_ns: u64, bytes: u64) -> bool {
        self.refill(now_ns);
        if self.tokens >= self.need(bytes) {
            self.consume(bytes);
            true
        } else {
            false
        }
    }

    /// Credit required before a packet of `bytes` may go: capped at the burst so oversized
    /// packets are not starved.
    fn need(&self, bytes: u64) -> i128 {
        i128::from(bytes.min(self.burst_bytes)) * CREDIT_PER_BYTE
    }

    /// Earliest time `>= now_ns` at which a packet of `bytes` may be sent, for sleeping.
    /// `u64::MAX` if it never will (rate 0 while short of credit).
    pub fn next_send_at(&self, now_ns: u64, bytes: u64) -> u64 {
        let deficit = self.need(bytes).saturating_sub(self.credit_at(now_ns));
        if deficit <= 0 {
            return now_ns;
        }
        if self.rate_bps == 0 {
            return u64::MAX;
        }
        // Round up so that at the returned instant the credit really suffices.
        let wait = deficit.unsigned_abs().div_ceil(u128::from(self.rate_bps));
        now_ns.saturating_add(u64::try_from(wait).unwrap_or(u64::MAX))
    }
}

/// Rate in bit/s of `bytes` over `period_ns` (0 for an empty period).
pub fn rate_bps(bytes: u64, period_ns: u64) -> f64 {
    if period_ns == 0 {
        return 0.0;
    }
    bytes as f64 * 8.0 * NS_PER_SEC as f64 / period_ns as f64
}

/// One closed measurement period.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateSample {
    /// Actual elapsed time in ns (at least the nominal period; more if polled late).
    pub period_ns: u64,
    /// Bytes recorded in the period.
    pub bytes: u64,
    /// Packets recorded.
    pub packets: u64,
    /// Packets recorded with ECN CE.
    pub ce_packets: u64,
    /// `bytes` over `period_ns`, in bit/s.
    pub rate_bps: f64,
}

/// Counts bytes, packets and CE marks and closes a period when asked after it has elapsed.
#[derive(Debug, Clone)]
pub struct RateMeter {
    period_ns: u64,
    start_ns: u64,
    bytes: u64,
    packets: u64,
    ce_packets: u64,
}

impl RateMeter {
    /// A meter whose first period starts at `now_ns`.
    pub fn new(period_ns: u64, now_ns: u64) -> Self {
        RateMeter {
            period_ns,
            start_ns: now_ns,
            bytes: 0,
            packets: 0,
            ce_packets: 0,
        }
    }

    /// Nominal period in ns.
    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// Counts one packet of `bytes`; `ce` if it carried an ECN CE mark.
    pub fn record(&mut self, bytes: u64, ce: bool) {
        self.bytes = self.bytes.saturating_add(bytes);
        self.packets = self.packets.saturating_add(1);
        if ce {
            self.ce_packets = self.ce_packets.saturating_add(1);
        }
    }

    /// Closes the period and starts the next one at `now_ns` if at least the nominal period
    /// (and more than 0 ns) has elapsed since the last sample; otherwise `None`. The sample
    /// reports the actual elapsed time so a late poll does not inflate the rate.
    pub fn poll(&mut self, now_ns: u64) -> Option<RateSample> {
        let elapsed = now_ns.saturating_sub(self.start_ns);
        if elapsed == 0 || elapsed < self.period_ns {
            return None;
        }
        let sample = RateSample {
            period_ns: elapsed,
            bytes: self.bytes,
            packets: self.packets,
            ce_packets: self.ce_packets,
            rate_bps: rate_bps(self.bytes, elapsed),
        };
        *self = RateMeter::new(self.period_ns, now_ns);
        Some(sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const G: u64 = 1_000_000_000;

    #[test]
    fn mode_names_round_trip() {
        for m in [RateMode::Grant, RateMode::Ecn, RateMode::Fig7] {
            assert_eq!(RateMode::from_name(m.name()), Some(m));
        }
        assert_eq!(RateMode::from_name("dctcp"), None);
        assert_eq!(RateMode::default(), RateMode::Grant);
    }

    #[test]
    fn ecn_controller_follows_rfc8257_per_period() {
        let cfg = RateConfig::new(100_000_000);
        let mut c = EcnRateController::new(cfg, 50_000_000);
        assert_eq!(c.rate_bps(), 50_000_000);
        // No packets: nothing learnt.
        assert_eq!(c.on_report(0, 0), RateEvent::Hold);
        assert_eq!(c.rate_bps(), 50_000_000);
        // All marked: alpha stays 1 (from its initial 1), the rate halves.
        assert_eq!(c.on_report(10, 10), RateEvent::Halved);
        assert_eq!(c.alpha(), 1.0);
        assert_eq!(c.rate_bps(), 25_000_000);
        // Unmarked: alpha decays by 15/16, the rate grows by 5 % of line rate.
        assert_eq!(c.on_report(10, 0), RateEvent::Increased);
        assert!((c.alpha() - 15.0 / 16.0).abs() < 1e-12);
        assert_eq!(c.rate_bps(), 30_000_000);
        // A light mark after a long quiet spell cuts little: alpha has decayed.
        for _ in 0..100 {
            c.on_report(10, 0);
        }
        assert_eq!(c.rate_bps(), 100_000_000, "capped at line rate");
        c.on_report(100, 1);
        let a = c.alpha();
        assert!(a < 0.01, "{a}");
        assert_eq!(c.rate_bps(), (100_000_000.0 * (1.0 - a / 2.0)) as u64);
        // Never below the floor, and more CE than packets is read as all marked.
        for _ in 0..200 {
            c.on_report(5, 9);
        }
        assert_eq!(c.rate_bps(), cfg.min_rate_bps);
        assert!(c.alpha() <= 1.0);
        // A start above line rate is clamped.
        assert_eq!(
            EcnRateController::new(cfg, u64::MAX).rate_bps(),
            100_000_000
        );
    }

    fn ctl(line: u64) -> RateController {
        RateController::try_new(RateConfig::new(line)).unwrap()
    }

    #[test]
    fn config_defaults_and_validation() {
        let c = RateConfig::new(100 * G);
        assert_eq!(c.delta, 2.0);
        assert_eq!(c.period_ns, 200_000);
        assert_eq!(c.additive_increase, 0.05);
        assert_eq!(c.min_rate_bps, 100_000_000);
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(RateConfig::new(G / 10).min_rate_bps, 1_000_000);
        assert_eq!(RateConfig::new(500_000).min_rate_bps, 500_000);
        assert_eq!(RateConfig::new(500_000).validate(), Ok(()));

        assert_eq!(
            RateConfig::new(0).validate(),
            Err(RateConfigError::ZeroLineRate)
        );
        for d in [0.99, f64::NAN, f64::INFINITY, -2.0] {
            let c = RateConfig {
                delta: d,
                ..RateConfig::new(G)
            };
            assert!(matches!(c.validate(), Err(RateConfigError::BadDelta(_))));
        }
        let c = RateConfig {
            delta: 1.0,
            ..RateConfig::new(G)
        };
        assert_eq!(c.validate(), Ok(()));
        let c = RateConfig {
            period_ns: 0,
            ..RateConfig::new(G)
        };
        assert_eq!(c.validate(), Err(RateConfigError::ZeroPeriod));
        for ai in [0.0, -0.1, 1.01, f64::NAN] {
            let c = RateConfig {
                additive_increase: ai,
                ..RateConfig::new(G)
            };
            assert!(matches!(
                c.validate(),
                Err(RateConfigError::BadAdditiveIncrease(_))
            ));
        }
        let c = RateConfig {
            additive_increase: 1.0,
            ..RateConfig::new(G)
        };
        assert_eq!(c.validate(), Ok(()));
        for min in [0, G + 1] {
            let c = RateConfig {
                min_rate_bps: min,
                ..RateConfig::new(G)
            };
            assert!(matches!(
                c.validate(),
                Err(RateConfigError::BadMinRate { .. })
            ));
            assert!(RateController::try_new(c).is_err());
        }
    }

    #[test]
    fn line_rate_start_no_congestion_holds() {
        let mut c = ctl(100 * G);
        assert_eq!(c.state(), RateState::LineRateStart);
        assert_eq!(c.rate_bps(), 100 * G);
        // Exactly Δ·recv is not "greater": hold.
        assert_eq!(c.on_report(100e9, 50e9), RateEvent::Hold);
        assert_eq!(c.state(), RateState::LineRateStart);
        assert_eq!(c.rate_bps(), 100 * G);
    }

    #[test]
    fn line_rate_start_congestion_halves_and_enters_ca() {
        let mut c = ctl(100 * G);
        assert_eq!(c.on_report(100e9, 49.9e9), RateEvent::Halved);
        assert_eq!(c.state(), RateState::CongestionAvoidance);
        assert_eq!(c.rate_bps(), 50 * G);
    }

    #[test]
    fn ca_congestion_halves_and_no_congestion_increases() {
        let mut c = ctl(100 * G);
        c.on_report(1.0, 0.0); // nothing received at all: congested
        assert_eq!(c.rate_bps(), 50 * G);
        assert_eq!(c.on_report(50e9, 10e9), RateEvent::Halved);
        assert_eq!(c.state(), RateState::CongestionAvoidance);
        assert_eq!(c.rate_bps(), 25 * G);
        assert_eq!(c.on_report(25e9, 12.5e9), RateEvent::Increased);
        assert_eq!(c.state(), RateState::CongestionAvoidance);
        assert_eq!(c.rate_bps(), 30 * G);
    }

    #[test]
    fn floor_and_cap() {
        let mut c = ctl(100 * G);
        for _ in 0..20 {
            assert_eq!(c.on_report(1e9, 0.0), RateEvent::Halved);
        }
        assert_eq!(c.rate_bps(), 100_000_000);
        for _ in 0..30 {
            assert_eq!(c.on_report(1e9, 1e9), RateEvent::Increased);
        }
        assert_eq!(c.rate_bps(), 100 * G);
        assert_eq!(c.state(), RateState::CongestionAvoidance);
        // A floor at line rate pins the rate.
        let cfg = RateConfig {
            min_rate_bps: G,
            ..RateConfig::new(G)
        };
        let mut c = RateController::try_new(cfg).unwrap();
        assert_eq!(c.on_report(1e9, 0.0), RateEvent::Halved);
        assert_eq!(c.rate_bps(), G);
    }

    #[test]
    fn retransmit_resets() {
        let mut c = ctl(10 * G);
        c.on_report(10e9, 1e9);
        c.on_report(10e9, 1e9);
        assert_eq!(c.rate_bps(), 2_500_000_000);
        c.on_retransmit();
        assert_eq!(c.state(), RateState::LineRateStart);
        assert_eq!(c.rate_bps(), 10 * G);
        c.on_retransmit();
        assert_eq!(c.rate_bps(), 10 * G);
    }

    #[test]
    fn idle_and_garbage_reports_ignored() {
        let mut c = ctl(10 * G);
        c.on_report(10e9, 1e9); // into CA at 5 G
        for (s, r) in [
            (0.0, 0.0),
            (0.0, 5e9),
            (-0.0, 0.0),
            (-1.0, 1.0),
            (1.0, -1.0),
            (f64::NAN, 1.0),
            (1.0, f64::NAN),
            (f64::INFINITY, 1.0),
            (1.0, f64::INFINITY),
        ] {
            assert_eq!(c.on_report(s, r), RateEvent::Hold, "{s} {r}");
        }
        assert_eq!(c.rate_bps(), 5 * G);
        assert_eq!(c.state(), RateState::CongestionAvoidance);
    }

    #[test]
    fn hand_computed_trace() {
        // 100 G line, Δ = 2, +5 G per increase, floor 100 M.
        let mut c = ctl(100 * G);
        let trace: &[(f64, f64, RateEvent, u64, RateState)] = {
            use RateEvent::*;
            use RateState::*;
            &[
                (100e9, 90e9, Hold, 100 * G, LineRateStart),
                (100e9, 40e9, Halved, 50 * G, CongestionAvoidance),
                (50e9, 20e9, Halved, 25 * G, CongestionAvoidance),
                (25e9, 20e9, Increased, 30 * G, CongestionAvoidance),
                (0.0, 0.0, Hold, 30 * G, CongestionAvoidance),
                (30e9, 30e9, Increased, 35 * G, CongestionAvoidance),
                (f64::NAN, 1.0, Hold, 35 * G, CongestionAvoidance),
                (35e9, 17.5e9, Increased, 40 * G, CongestionAvoidance),
                (40e9, 19e9, Halved, 20 * G, CongestionAvoidance),
                (20e9, 0.0, Halved, 10 * G, CongestionAvoidance),
                (10e9, 9e9, Increased, 15 * G, CongestionAvoidance),
            ]
        };
        for (i, &(s, r, ev, rate, st)) in trace.iter().enumerate() {
            assert_eq!(c.on_report(s, r), ev, "step {i}");
            assert_eq!((c.rate_bps(), c.state()), (rate, st), "step {i}");
        }
        for _ in 0..16 {
            c.on_report(1e9, 1e9);
        }
        assert_eq!(c.rate_bps(), 95 * G);
        c.on_report(1e9, 1e9);
        assert_eq!(c.rate_bps(), 100 * G);
        c.on_retransmit();
        assert_eq!(
            (c.rate_bps(), c.state()),
            (100 * G, RateState::LineRateStart)
        );
        assert_eq!(c.on_report(100e9, 60e9), RateEvent::Hold);
    }

    #[test]
    fn unvalidated_config_stays_bounded() {
        let cfg = RateConfig {
            line_rate_bps: 1000,
            delta: f64::NAN,
            period_ns: 0,
            additive_increase: f64::NAN,
            min_rate_bps: 5000,
        };
        let mut c = RateController::new(cfg);
        for _ in 0..5 {
            c.on_report(1e9, 0.0);
            assert_eq!(c.rate_bps(), 1000);
        }
        let mut c = RateController::new(RateConfig {
            min_rate_bps: 0,
            ..RateConfig::new(4)
        });
        for _ in 0..5 {
            c.on_report(1e9, 0.0);
        }
        assert_eq!(c.rate_bps(), 0);
        c.on_report(1.0, 1.0);
        assert_eq!(
            c.rate_bps(),
            0,
            "step rounds to 0 at 4 bit/s; still no panic"
        );
    }

    /// Sends `pkt`-byte packets as fast as the pacer allows until `end_ns`, waking at
    /// `next_send_at` plus `jitter(i)` ns; returns bytes sent.
    fn run_pacer(p: &mut Pacer, pkt: u64, end_ns: u64, jitter: impl Fn(u64) -> u64) -> u64 {
        let mut now = 0;
        let mut sent = 0;
        let mut i = 0;
        loop {
            now = p.next_send_at(now, pkt) + jitter(i);
            if now > end_ns {
                return sent;
            }
            assert!(p.try_consume(now, pkt), "next_send_at must be sufficient");
            sent += pkt;
            i += 1;
        }
    }

    fn assert_rate(sent: u64, end_ns: u64, rate: u64) {
        let got = rate_bps(sent, end_ns);
        let err = (got - rate as f64).abs() / rate as f64;
        assert!(err < 0.001, "rate {got} vs {rate}: error {err}");
    }

    #[test]
    fn pacer_long_run_accuracy() {
        // (rate, burst, packet, simulated time): odd rates exercise the rounding.
        for (rate, burst, pkt, end) in [
            (10 * G, 9000, 1500, NS_PER_SEC),
            (1_000_003, 1500, 1500, 100 * NS_PER_SEC),
            (400 * G, 64 * 1024, 9000, NS_PER_SEC / 10),
            (777_777_777, 3000, 1472, NS_PER_SEC),
        ] {
            let mut p = Pacer::new(rate, burst);
            assert_rate(run_pacer(&mut p, pkt, end, |_| 0), end, rate);
            // Late wake-ups are caught up by the bucket, up to the burst.
            let mut p = Pacer::new(rate, burst);
            assert_rate(run_pacer(&mut p, pkt, end, |i| i % 3), end, rate);
        }
    }

    #[test]
    fn pacer_burst_cap() {
        let mut p = Pacer::new(8 * G, 10_000); // 1 byte/ns
        assert_eq!(p.available(0), 10_000);
        p.consume(10_000);
        assert_eq!(p.available(0), 0);
        assert_eq!(p.available(4_000), 4_000);
        assert_eq!(p.available(1_000_000), 10_000);
        // Hours at 400 G: capped, no overflow.
        p.set_rate(400 * G);
        let hours = 5 * 3600 * NS_PER_SEC;
        assert_eq!(p.available(hours), 10_000);
        assert_eq!(p.next_send_at(hours, 1500), hours);
        assert_eq!(p.next_send_at(u64::MAX, 1500), u64::MAX);
    }

    #[test]
    fn pacer_debt_lets_big_packets_go() {
        let mut p = Pacer::new(8 * G, 1000); // 1 byte/ns, burst smaller than a jumbo frame
        assert_eq!(p.available(0), 1000);
        assert!(p.try_consume(0, 9000));
        assert_eq!(p.available(0), 0);
        // 8000 bytes of debt, then 1000 more for the next packet's (capped) requirement.
        assert_eq!(p.next_send_at(0, 9000), 9000);
        assert_eq!(p.next_send_at(0, 100), 8100);
        assert!(!p.try_consume(8999, 9000));
        assert!(p.try_consume(9000, 9000));
        // Debt saturates instead of overflowing.
        p.consume(u64::MAX);
        p.consume(u64::MAX);
        assert_eq!(p.available(10_000), 0);
        // Rate 0: never.
        let mut p = Pacer::new(0, 100);
        assert!(p.try_consume(0, 100));
        assert_eq!(p.next_send_at(1, 1), u64::MAX);
        assert_eq!(p.available(u64::MAX), 0);
    }

    #[test]
    fn pacer_zero_burst_still_paces() {
        let mut p = Pacer::new(8 * G, 0);
        assert_eq!(p.next_send_at(0, 1500), 0);
        assert!(p.try_consume(0, 1500));
        assert_eq!(p.next_send_at(0, 1500), 1500);
        assert_rate(
            run_pacer(&mut p, 1500, NS_PER_SEC, |_| 0),
            NS_PER_SEC,
            8 * G,
        );
    }

    #[test]
    fn pacer_clock_step_back_is_harmless() {
        let mut p = Pacer::new(8 * G, 10_000);
        p.available(1_000);
        p.consume(10_000);
        assert_eq!(p.available(500), 0);
        assert_eq!(p.available(1_500), 500);
    }

    #[test]
    fn meter_closes_periods() {
        let mut m = RateMeter::new(200_000, 1_000);
        assert_eq!(m.period_ns(), 200_000);
        m.record(1500, false);
        m.record(1500, true);
        assert_eq!(m.poll(1_000), None);
        assert_eq!(m.poll(200_999), None);
        let s = m.poll(201_000).unwrap();
        assert_eq!(
            (s.period_ns, s.bytes, s.packets, s.ce_packets),
            (200_000, 3000, 2, 1)
        );
        assert_eq!(s.rate_bps, 1.2e8);
        // Next period starts at the poll; a late poll reports the real elapsed time.
        m.record(1000, false);
        assert_eq!(m.poll(300_000), None);
        let s = m.poll(601_000).unwrap();
        assert_eq!(
            (s.period_ns, s.bytes, s.packets, s.ce_packets),
            (400_000, 1000, 1, 0)
        );
        assert_eq!(s.rate_bps, 2e7);
        // Empty period.
        let s = m.poll(801_000).unwrap();
        assert_eq!((s.bytes, s.packets, s.rate_bps), (0, 0, 0.0));
        // Clock stepping back or zero period never divides by zero.
        assert_eq!(m.poll(0), None);
        let mut z = RateMeter::new(0, 5);
        assert_eq!(z.poll(5), None);
        assert_eq!(z.poll(6).unwrap().period_ns, 1);
        assert_eq!(rate_bps(10, 0), 0.0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Report(f64, f64),
        Retransmit,
    }

    fn arb_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            0.0..1e12f64,
            Just(0.0),
            Just(f64::NAN),
            Just(f64::INFINITY),
            -1e12..0.0f64,
        ]
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            10 => (arb_f64(), arb_f64()).prop_map(|(s, r)| Op::Report(s, r)),
            1 => Just(Op::Retransmit),
        ]
    }

    proptest! {
        #[test]
        fn prop_rate_within_bounds(
            line in 1u64..=400 * G,
            min_frac in 0.0..=1.0f64,
            delta in 1.0..10.0f64,
            ai in 0.0001..=1.0f64,
            ops in prop::collection::vec(arb_op(), 0..200),
        ) {
            let min = ((line as f64 * min_frac) as u64).clamp(1, line);
            let cfg = RateConfig {
                delta,
                additive_increase: ai,
                min_rate_bps: min,
                ..RateConfig::new(line)
            };
            let mut c = RateController::try_new(cfg).unwrap();
            for op in ops {
                let before = c.rate_bps();
                match op {
                    Op::Report(s, r) => {
                        let ev = c.on_report(s, r);
                        match ev {
                            RateEvent::Hold => prop_assert_eq!(c.rate_bps(), before),
                            RateEvent::Halved => prop_assert!(c.rate_bps() <= before),
                            RateEvent::Increased => prop_assert!(c.rate_bps() >= before),
                        }
                    }
                    Op::Retransmit => c.on_retransmit(),
                }
                prop_assert!(c.rate_bps() >= min && c.rate_bps() <= line);
                if c.state() == RateState::LineRateStart {
                    prop_assert_eq!(c.rate_bps(), line);
                }
            }
        }

        #[test]
        fn prop_pacer_never_exceeds_rate_plus_burst(
            rate in 1_000_000u64..=400 * G,
            burst in 0u64..100_000,
            pkt in 64u64..9000,
            wakes in prop::collection::vec(0u64..50_000, 1..200),
        ) {
            let mut p = Pacer::new(rate, burst);
            let mut now = 0u64;
            let mut sent = 0u128;
            for w in wakes {
                now += w;
                while p.try_consume(now, pkt) {
                    sent += u128::from(pkt);
                }
                // Sent <= burst + rate*t + one packet of debt.
                let allowed = u128::from(burst) + u128::from(rate) * u128::from(now) / 8_000_000_000
                    + u128::from(pkt);
                prop_assert!(sent <= allowed, "sent {} allowed {}", sent, allowed);
            }
        }
    }
}
