//! The sender's half of the bounded-loss protocol.
//!
//! States: `AwaitAccept` -> `Sending` -> `AwaitVerdict` -> (`Sending` again for a
//! retransmission pass | `Done`). A `FlowFinish` in any state after acceptance ends the flow:
//! the receiver has enough, so the sender stops mid-pass (this is where the tail is cut).

use crate::message::{CtrlMsg, FlowStart, LossBound, QueueEcn, SegRange, Stage, ECN_QUEUES};
use crate::rate::{
    EcnRateController, Pacer, RateConfig, RateController, RateEvent, RateMode, RateState,
};
use crate::tensor::{DType, SegmentLayout};
use crate::wire::header;

use super::{msg_name, segment_flags, DataOrigin, FlowId, ProtoError};
use crate::auth::FlowKey;

/// Sender tuning.
#[derive(Debug, Clone, PartialEq)]
pub struct SenderConfig {
    /// How the rate is chosen (receiver grants by default).
    pub mode: RateMode,
    /// Rate control parameters (line rate, Δ, period, additive increase, floor).
    pub rate: RateConfig,
    /// Token-bucket depth in bytes: how far ahead of the paced rate a burst may go. In grant
    /// and ECN modes this is the ceiling: the burst follows the rate (half a report period's
    /// worth, at least two frames), so N senders sharing a receiver add up to about one
    /// period of data, not N full bursts.
    pub burst_bytes: u64,
    /// The rate to start at before the receiver's first grant (grant mode) or as the first
    /// rate (ECN mode): what the previous flow to the same receiver ended at. `None`: the
    /// floor (grant mode) or line rate (ECN mode). Figure 7 always starts at line rate.
    pub initial_rate_bps: Option<u64>,
    /// Send the segments of retransmission passes ECN-capable (marked, not dropped, above a
    /// switch threshold): the segments the loss bound still needs are important. Only safe
    /// with a mode that reacts to marks (grant or ECN).
    pub retransmit_ect: bool,
    /// The job's priority, 0 (most urgent) ..= 7, announced in every `FlowStart`: the
    /// receiving host's grant pool serves the most urgent flows first (MLNET §3.2).
    pub priority: u8,
}

/// Full-size frame on the wire (1500-byte MTU, Ethernet header, FCS, preamble, gap).
const WIRE_FRAME: u64 = 1538;

impl SenderConfig {
    /// gradwire's defaults at `line_rate_bps`: receiver grants, a burst that follows the rate
    /// (half a report period's worth: 2 frames for an 11 Mbit/s share with a 2 ms period, so
    /// 8 senders together stay below a 15 KB switch threshold) up to 32 frames (one send
    /// batch, so a lone fast flow is not held to small batches), retransmissions
    /// ECN-capable.
    pub fn new(line_rate_bps: u64) -> SenderConfig {
        SenderConfig::with_mode(RateMode::Grant, line_rate_bps)
    }

    /// The defaults of `mode` at `line_rate_bps`. Figure 7 keeps the paper's behaviour: a
    /// burst of 64 full-size packets and retransmissions tagged like first transmissions.
    pub fn with_mode(mode: RateMode, line_rate_bps: u64) -> SenderConfig {
        let fig7 = mode == RateMode::Fig7;
        SenderConfig {
            mode,
            rate: RateConfig::new(line_rate_bps),
            burst_bytes: if fig7 { 64 } else { 32 } * WIRE_FRAME,
            initial_rate_bps: None,
            retransmit_ect: !fig7,
            priority: 0,
        }
    }
}

/// Where the sender is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SenderPhase {
    /// FlowStart sent, waiting for FlowAccept.
    AwaitAccept,
    /// Sending the segments of the current pass.
    Sending,
    /// FlowStop sent, waiting for FlowFinish or a retransmission request.
    AwaitVerdict,
    /// FlowFinish received and confirmed.
    Done,
}

impl SenderPhase {
    fn name(self) -> &'static str {
        match self {
            SenderPhase::AwaitAccept => "awaiting FlowAccept",
            SenderPhase::Sending => "sending",
            SenderPhase::AwaitVerdict => "awaiting the receiver's verdict",
            SenderPhase::Done => "done",
        }
    }
}

/// Counters of one send.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SenderStats {
    /// Data packets sent (all passes).
    pub packets: u64,
    /// Payload bytes sent (all passes).
    pub payload_bytes: u64,
    /// Passes started (1 + retransmission passes).
    pub passes: u32,
    /// Segments sent in retransmission passes.
    pub retransmitted: u64,
    /// Rate reports received.
    pub rate_reports: u64,
    /// Times rate control cut the rate (Figure 7: halved; ECN mode: by alpha / 2).
    pub halvings: u64,
    /// Times rate control increased the rate.
    pub increases: u64,
    /// Lowest paced rate reached, bit/s.
    pub min_rate_bps: u64,
    /// CE-marked packets the receiver reported.
    pub ce_reported: u64,
    /// Segments the receiver said it had when it finished the flow.
    pub receiver_segments: Option<u32>,
    /// What the receiver saw per switch queue (data packets and CE marks), from its latest
    /// EcnReport: the switches' treatment of this flow.
    pub ecn: [QueueEcn; ECN_QUEUES],
    /// EcnReports received.
    pub ecn_reports: u64,
    /// RateGrants received.
    pub grants: u64,
    /// The latest grant, bit/s.
    pub last_grant_bps: Option<u64>,
}

/// The pacer's burst at `rate_bps`: Figure 7 keeps its configured burst; the other modes
/// allow half a report period's worth at the rate, at least two full-size frames and at most
/// `max_bytes`.
fn burst_for(mode: RateMode, rate_bps: u64, period_ns: u64, max_bytes: u64) -> u64 {
    if mode == RateMode::Fig7 {
        return max_bytes;
    }
    let half_period = u128::from(rate_bps) * u128::from(period_ns / 2) / 8_000_000_000;
    u64::try_from(half_period)
        .unwrap_or(u64::MAX)
        .clamp(2 * WIRE_FRAME, max_bytes.max(2 * WIRE_FRAME))
}

/// One tensor being sent.
#[derive(Debug)]
pub struct SenderFlow {
    id: FlowId,
    layout: SegmentLayout,
    layer: u16,
    phase: SenderPhase,
    pass: u32,
    /// Segments of the current pass, and the position in them.
    queue: Vec<SegRange>,
    queue_pos: usize,
    next_in_range: u32,
    sent_this_pass: u32,
    seq: u32,
    /// Authenticated flow: its data is sealed with this key, and `seq` (the GCM nonce) must
    /// never repeat, so it does not wrap.
    auth: Option<FlowKey>,
    /// `seq` went past `u32::MAX`.
    seq_wrapped: bool,
    data_port: Option<u16>,
    mode: RateMode,
    retransmit_ect: bool,
    /// Ceiling of the pacer's burst; the report period (for rate-following bursts).
    max_burst_bytes: u64,
    period_ns: u64,
    /// Figure 7's machine (used in that mode).
    rate: RateController,
    /// The CE reaction (used in ECN mode).
    ecn_rate: EcnRateController,
    /// The receiver's latest grant (used in grant mode).
    grant_bps: Option<u64>,
    /// Grant mode's rate before the first grant.
    pre_grant_bps: u64,
    pacer: Pacer,
    last_report_ns: u64,
    sent_since_report: u64,
    stats: SenderStats,
}

impl SenderFlow {
    /// Start a flow; returns the flow and the FlowStart (rendezvous) to send.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: FlowId,
        layout: SegmentLayout,
        dtype: DType,
        layer: u16,
        loss_bound: LossBound,
        stage: Stage,
        origin: DataOrigin,
        cfg: &SenderConfig,
        now_ns: u64,
    ) -> (SenderFlow, CtrlMsg) {
        let rate = RateController::new(cfg.rate);
        let line = rate.rate_bps();
        let floor = cfg.rate.min_rate_bps.min(line);
        let ecn_rate = EcnRateController::new(cfg.rate, cfg.initial_rate_bps.unwrap_or(line));
        let pre_grant_bps = cfg
            .initial_rate_bps
            .unwrap_or(floor)
            .clamp(floor, line.max(floor));
        let start_bps = match cfg.mode {
            RateMode::Fig7 => line,
            RateMode::Ecn => ecn_rate.rate_bps(),
            RateMode::Grant => pre_grant_bps,
        };
        let start = CtrlMsg::FlowStart(FlowStart {
            job_id: id.job,
            tensor_id: id.tensor,
            round: id.round,
            layer,
            dtype_code: dtype.code(),
            size_bytes: layout.size_bytes(),
            segment_payload: layout.segment_payload() as u32,
            segment_count: layout.count(),
            loss_bound,
            stage,
            priority: cfg.priority.min(crate::message::MAX_PRIORITY),
            flow_nonce: origin.flow_nonce,
            sources: origin.sources,
        });
        let flow = SenderFlow {
            id,
            layout,
            layer,
            phase: SenderPhase::AwaitAccept,
            pass: 0,
            queue: Vec::new(),
            queue_pos: 0,
            next_in_range: 0,
            sent_this_pass: 0,
            seq: 0,
            auth: None,
            seq_wrapped: false,
            data_port: None,
            mode: cfg.mode,
            retransmit_ect: cfg.retransmit_ect,
            max_burst_bytes: cfg.burst_bytes,
            period_ns: cfg.rate.period_ns,
            rate,
            ecn_rate,
            grant_bps: None,
            pre_grant_bps,
            pacer: Pacer::new(
                start_bps,
                burst_for(cfg.mode, start_bps, cfg.rate.period_ns, cfg.burst_bytes),
            ),
            last_report_ns: now_ns,
            sent_since_report: 0,
            stats: SenderStats {
                min_rate_bps: start_bps,
                ..SenderStats::default()
            },
        };
        (flow, start)
    }

    /// Makes this an authenticated flow: its datagrams are `AuthData`, to be sealed with
    /// [`Self::data_key`] by the driver, and at most 2^32 of them are sent (the sequence
    /// number is the nonce; [`Self::next_segment`] refuses to reuse one).
    pub fn authenticate(&mut self, key: FlowKey) {
        self.auth = Some(key);
    }

    /// The key that seals this flow's datagrams, if authenticated.
    pub fn data_key(&self) -> Option<&FlowKey> {
        self.auth.as_ref()
    }

    /// Bytes after each datagram's payload: the authentication tag, or none.
    pub fn tag_len(&self) -> usize {
        self.data_kind().tag_len()
    }

    /// An authenticated flow has used every sequence number: it cannot send more without
    /// reusing a nonce, and must end (`ProtoError::NoncesExhausted`).
    pub fn nonces_exhausted(&self) -> bool {
        self.auth.is_some() && self.seq_wrapped
    }

    fn data_kind(&self) -> header::Kind {
        if self.auth.is_some() {
            header::Kind::AuthData
        } else {
            header::Kind::Data
        }
    }

    /// Jump the sequence number (tests of its exhaustion; 2^32 packets are too many to send).
    #[cfg(test)]
    pub(crate) fn set_seq_for_test(&mut self, seq: u32) {
        self.seq = seq;
    }

    /// The flow.
    pub fn id(&self) -> FlowId {
        self.id
    }

    /// Current phase.
    pub fn phase(&self) -> SenderPhase {
        self.phase
    }

    /// The receiver's data port, once accepted.
    pub fn data_port(&self) -> Option<u16> {
        self.data_port
    }

    /// Counters.
    pub fn stats(&self) -> SenderStats {
        self.stats
    }

    /// Current paced rate, bit/s: the mode's choice.
    pub fn rate_bps(&self) -> u64 {
        match self.mode {
            RateMode::Fig7 => self.rate.rate_bps(),
            RateMode::Ecn => self.ecn_rate.rate_bps(),
            RateMode::Grant => self
                .grant_bps
                .unwrap_or(self.pre_grant_bps)
                .min(self.rate.config().line_rate_bps),
        }
    }

    /// The rate mode.
    pub fn mode(&self) -> RateMode {
        self.mode
    }

    /// Figure 7's state (meaningful in that mode).
    pub fn rate_state(&self) -> RateState {
        self.rate.state()
    }

    /// Whether segments of the current pass go ECN-capable whatever the priority function
    /// says: retransmissions, when configured.
    pub fn retransmit_important(&self) -> bool {
        self.retransmit_ect && self.pass > 0
    }

    /// Hands the mode's current rate to the pacer and tracks the lowest rate.
    fn apply_rate(&mut self) {
        let r = self.rate_bps();
        self.pacer.set_rate(r);
        self.pacer.set_burst(burst_for(
            self.mode,
            r,
            self.period_ns,
            self.max_burst_bytes,
        ));
        self.stats.min_rate_bps = self.stats.min_rate_bps.min(r);
    }

    /// The segment layout.
    pub fn layout(&self) -> &SegmentLayout {
        &self.layout
    }

    fn start_pass(&mut self, ranges: Vec<SegRange>) {
        self.queue = ranges;
        self.queue_pos = 0;
        self.next_in_range = self.queue.first().map_or(0, |r| r.start);
        self.sent_this_pass = 0;
        self.stats.passes += 1;
        self.phase = SenderPhase::Sending;
    }

    fn check_flow(
        &self,
        what: &'static str,
        job: u32,
        tensor: u32,
        round: u32,
    ) -> Result<(), ProtoError> {
        let got = FlowId { job, tensor, round };
        if got == self.id {
            Ok(())
        } else {
            Err(ProtoError::WrongFlow {
                what,
                got,
                expected: self.id,
            })
        }
    }

    /// Handle a control message; returns a reply to send, if any.
    pub fn on_ctrl(&mut self, msg: CtrlMsg, now_ns: u64) -> Result<Option<CtrlMsg>, ProtoError> {
        let unexpected = |what, phase: SenderPhase| ProtoError::Unexpected {
            what,
            state: phase.name(),
        };
        match msg {
            CtrlMsg::FlowAccept {
                job_id,
                tensor_id,
                round,
                data_port,
            } => {
                self.check_flow("FlowAccept", job_id, tensor_id, round)?;
                if self.phase != SenderPhase::AwaitAccept {
                    return Err(unexpected("FlowAccept", self.phase));
                }
                self.data_port = Some(data_port);
                let all = if self.layout.count() == 0 {
                    Vec::new()
                } else {
                    vec![SegRange {
                        start: 0,
                        len: self.layout.count(),
                    }]
                };
                self.start_pass(all);
                Ok(None)
            }
            CtrlMsg::FlowReject {
                job_id,
                tensor_id,
                round,
                code,
                reason,
            } => Err(ProtoError::Rejected {
                flow: FlowId {
                    job: job_id,
                    tensor: tensor_id,
                    round,
                },
                code,
                reason,
            }),
            CtrlMsg::RateReport {
                period_ns,
                bytes,
                packets,
                ce_packets,
            } => {
                self.stats.rate_reports += 1;
                self.stats.ce_reported += ce_packets;
                // Our own send rate since the previous report (0 if we were idle), measured
                // over the actual elapsed time so report jitter does not skip decisions.
                let elapsed = now_ns.saturating_sub(self.last_report_ns);
                let send_bps = crate::rate::rate_bps(self.sent_since_report, elapsed);
                self.last_report_ns = now_ns;
                self.sent_since_report = 0;
                let recv_bps = if period_ns == 0 {
                    0.0
                } else {
                    bytes as f64 * 8e9 / period_ns as f64
                };
                if self.phase == SenderPhase::Sending {
                    let event = match self.mode {
                        RateMode::Fig7 => self.rate.on_report(send_bps, recv_bps),
                        RateMode::Ecn => self.ecn_rate.on_report(packets, ce_packets),
                        RateMode::Grant => RateEvent::Hold,
                    };
                    match event {
                        RateEvent::Halved => self.stats.halvings += 1,
                        RateEvent::Increased => self.stats.increases += 1,
                        RateEvent::Hold => {}
                    }
                    self.apply_rate();
                }
                Ok(None)
            }
            CtrlMsg::RateGrant { rate_bps } => match self.phase {
                SenderPhase::AwaitAccept => Err(unexpected("RateGrant", self.phase)),
                // Grants keep coming until the receiver learns we are done: harmless.
                SenderPhase::Done => Ok(None),
                SenderPhase::Sending | SenderPhase::AwaitVerdict => {
                    self.stats.grants += 1;
                    self.stats.last_grant_bps = Some(rate_bps);
                    self.grant_bps = Some(rate_bps);
                    if self.mode == RateMode::Grant {
                        self.apply_rate();
                    }
                    Ok(None)
                }
            },
            CtrlMsg::RetransmitRequest { pass, ranges } => {
                match self.phase {
                    SenderPhase::AwaitVerdict if pass == self.pass => {}
                    // A request that crossed our FlowFinish handling or an older pass: stale.
                    SenderPhase::Done => return Ok(None),
                    SenderPhase::AwaitVerdict => return Ok(None),
                    p => return Err(unexpected("RetransmitRequest", p)),
                }
                if let Some(bad) = ranges.iter().find(|r| r.end() > self.layout.count()) {
                    return Err(ProtoError::BadRanges {
                        start: bad.start,
                        end: bad.end(),
                        count: self.layout.count(),
                    });
                }
                self.pass += 1;
                if self.mode == RateMode::Fig7 {
                    // DLCP: a retransmission restarts at line rate. The other modes keep
                    // their rate: the receiver's share does not grow because segments were lost.
                    self.rate.on_retransmit();
                    self.apply_rate();
                }
                self.start_pass(ranges);
                Ok(None)
            }
            CtrlMsg::FlowFinish { received_segments } => match self.phase {
                SenderPhase::Sending | SenderPhase::AwaitVerdict => {
                    self.phase = SenderPhase::Done;
                    self.stats.receiver_segments = Some(received_segments);
                    Ok(Some(CtrlMsg::FinishConfirm))
                }
                p => Err(unexpected("FlowFinish", p)),
            },
            CtrlMsg::EcnReport { queues } => match self.phase {
                // Cumulative: the latest report is the flow's figure so far.
                SenderPhase::Sending | SenderPhase::AwaitVerdict | SenderPhase::Done => {
                    self.stats.ecn = queues;
                    self.stats.ecn_reports += 1;
                    Ok(None)
                }
                p => Err(unexpected("EcnReport", p)),
            },
            CtrlMsg::Abort { code, reason } => Err(ProtoError::Aborted { code, reason }),
            other => Err(unexpected(msg_name(&other), self.phase)),
        }
    }

    /// How many full-size segments the pacer allows now (0 when not sending).
    pub fn budget(&mut self, now_ns: u64) -> usize {
        if self.phase != SenderPhase::Sending {
            return 0;
        }
        let seg = (self.layout.segment_payload() + header::HEADER_LEN) as u64;
        (self.pacer.available(now_ns) / seg.max(1)) as usize
    }

    /// When the pacer will allow the next full-size segment.
    pub fn next_send_at(&self, now_ns: u64) -> u64 {
        let seg = (self.layout.segment_payload() + header::HEADER_LEN) as u64;
        self.pacer.next_send_at(now_ns, seg)
    }

    /// The next segment of the current pass and its header, or `None` when the pass is done.
    pub fn next_segment(&mut self) -> Option<(u32, header::Repr)> {
        if self.phase != SenderPhase::Sending || self.nonces_exhausted() {
            return None;
        }
        let range = *self.queue.get(self.queue_pos)?;
        let index = self.next_in_range;
        let (offset, len) = self.layout.segment(index)?;
        if index + 1 >= range.end() {
            self.queue_pos += 1;
            self.next_in_range = self.queue.get(self.queue_pos).map_or(0, |r| r.start);
        } else {
            self.next_in_range = index + 1;
        }
        let repr = header::Repr {
            kind: self.data_kind(),
            flags: segment_flags(self.pass > 0, index + 1 == self.layout.count(), false),
            pass: self.pass as u8,
            job_id: self.id.job,
            tensor_id: self.id.tensor,
            round: self.id.round,
            offset,
            seq: self.seq,
            length: len as u16,
            layer: self.layer,
        };
        self.seq = self.seq.wrapping_add(1);
        self.seq_wrapped |= self.seq == 0;
        self.sent_this_pass += 1;
        Some((index, repr))
    }

    /// Account for `packets` segments of `bytes` payload handed to the datapath.
    pub fn on_sent(&mut self, packets: u64, bytes: u64, now_ns: u64) {
        let wire = bytes + packets * (header::HEADER_LEN + self.tag_len()) as u64;
        self.pacer.available(now_ns);
        self.pacer.consume(wire);
        self.sent_since_report += wire;
        self.stats.packets += packets;
        self.stats.payload_bytes += bytes;
        if self.pass > 0 {
            self.stats.retransmitted += packets;
        }
    }

    /// If the current pass has been sent completely, move to `AwaitVerdict` and return the
    /// FlowStop to send.
    pub fn poll_pass_end(&mut self) -> Option<CtrlMsg> {
        if self.phase == SenderPhase::Sending && self.queue_pos >= self.queue.len() {
            self.phase = SenderPhase::AwaitVerdict;
            return Some(CtrlMsg::FlowStop {
                pass: self.pass,
                segments_sent: self.sent_this_pass,
            });
        }
        None
    }
}
