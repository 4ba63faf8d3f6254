//! The receiver's half of the bounded-loss protocol.
//!
//! States: `Receiving` -> `FinishSent` (bound met, FlowFinish sent, still placing late
//! packets) -> `Done` (FinishConfirm received). Data placement is the per-packet hot path:
//! three integer compares to find the flow, [`SegmentLayout::locate`] to bound-check, one
//! copy, one bitmap bit.

use crate::auth::FlowKey;
use crate::bitmap::SegmentBitmap;
use std::net::{IpAddr, SocketAddr};

use crate::message::{
    CtrlMsg, DataSource, FlowStart, LossBound, QueueEcn, RejectCode, ECN_QUEUES, MAX_RANGES,
};
use crate::rate::RateMeter;
use crate::tensor::{DType, PlaceError, SegmentLayout};
use crate::wire::header;

use super::{msg_name, FlowId, ProtoError};

/// What the receiver expects: the registered tensor this flow may write into.
#[derive(Debug, Clone, PartialEq)]
pub struct RecvSpec {
    /// Job.
    pub job: u32,
    /// Tensor id.
    pub tensor: u32,
    /// Required round, or any.
    pub round: Option<u32>,
    /// Element type of the registered buffer.
    pub dtype: DType,
    /// Size of the registered buffer.
    pub size_bytes: u64,
    /// Largest payload this receiver accepts (from its MTU).
    pub max_payload: usize,
    /// Loss bound to enforce; `None` takes the sender's.
    pub loss_bound: Option<LossBound>,
}

/// Where the receiver is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiverPhase {
    /// Placing data; bound not yet met.
    Receiving,
    /// FlowFinish sent; still placing in-flight packets until FinishConfirm.
    FinishSent,
    /// FinishConfirm received.
    Done,
}

impl ReceiverPhase {
    fn name(self) -> &'static str {
        match self {
            ReceiverPhase::Receiving => "receiving",
            ReceiverPhase::FinishSent => "waiting for FinishConfirm",
            ReceiverPhase::Done => "done",
        }
    }
}

/// Why a received datagram was not placed ([`ReceiverFlow::on_datagram`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataReject {
    /// From an address or port the sender did not announce in its `FlowStart`.
    ForeignSource,
    /// Not a parsable gradwire datagram.
    Malformed,
    /// A plain datagram for an authenticated flow, or an authenticated one for a plain flow.
    Unauthenticated,
    /// An authenticated datagram whose tag did not verify (forged, corrupted, or keyed for
    /// another flow, such as a replay from an earlier round).
    BadTag,
    /// An authenticated datagram of an earlier retransmission pass (a replay, or very late).
    StalePass,
    /// The placement checks refused it.
    Place(PlaceError),
}

impl From<PlaceError> for DataReject {
    fn from(e: PlaceError) -> Self {
        DataReject::Place(e)
    }
}

/// Packets refused by the receiver, by reason (none of them touched the tensor).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RejectCounts {
    /// From a source the flow's sender did not announce (peer binding): a third host, or a
    /// port the sender does not use.
    pub foreign_source: u64,
    /// Not a parsable gradwire datagram (truncated, bad version, unknown kind, ...).
    pub malformed: u64,
    /// Plain data for an authenticated flow (or the reverse).
    pub unauthenticated: u64,
    /// Authentication tag did not verify.
    pub bad_tag: u64,
    /// Authenticated data of an earlier pass.
    pub stale_pass: u64,
    /// Unknown job.
    pub unknown_job: u64,
    /// Unknown tensor.
    pub unknown_tensor: u64,
    /// Other round of the tensor.
    pub stale_round: u64,
    /// offset+length outside the tensor.
    pub out_of_bounds: u64,
    /// Length not a whole number of elements.
    pub not_element_multiple: u64,
    /// Payload longer than the flow's segment payload (set by the sender's MTU).
    pub too_long: u64,
    /// Not exactly one segment.
    pub misaligned: u64,
}

impl RejectCounts {
    /// Count one refused datagram.
    pub fn count_datagram(&mut self, e: DataReject) {
        match e {
            DataReject::ForeignSource => self.foreign_source += 1,
            DataReject::Malformed => self.malformed += 1,
            DataReject::Unauthenticated => self.unauthenticated += 1,
            DataReject::BadTag => self.bad_tag += 1,
            DataReject::StalePass => self.stale_pass += 1,
            DataReject::Place(p) => self.count(p),
        }
    }

    /// Count one refusal by the placement checks.
    pub fn count(&mut self, e: PlaceError) {
        let c = match e {
            PlaceError::UnknownJob => &mut self.unknown_job,
            PlaceError::UnknownTensor => &mut self.unknown_tensor,
            PlaceError::StaleRound => &mut self.stale_round,
            PlaceError::OutOfBounds => &mut self.out_of_bounds,
            PlaceError::NotElementMultiple => &mut self.not_element_multiple,
            PlaceError::TooLong => &mut self.too_long,
            PlaceError::Misaligned => &mut self.misaligned,
        };
        *c += 1;
    }

    /// Adds `other`'s counts (a process's totals over its transfers).
    pub fn add(&mut self, other: &RejectCounts) {
        let RejectCounts {
            foreign_source,
            malformed,
            unauthenticated,
            bad_tag,
            stale_pass,
            unknown_job,
            unknown_tensor,
            stale_round,
            out_of_bounds,
            not_element_multiple,
            too_long,
            misaligned,
        } = *other;
        self.foreign_source += foreign_source;
        self.malformed += malformed;
        self.unauthenticated += unauthenticated;
        self.bad_tag += bad_tag;
        self.stale_pass += stale_pass;
        self.unknown_job += unknown_job;
        self.unknown_tensor += unknown_tensor;
        self.stale_round += stale_round;
        self.out_of_bounds += out_of_bounds;
        self.not_element_multiple += not_element_multiple;
        self.too_long += too_long;
        self.misaligned += misaligned;
    }

    /// Every count by name (the names of the JSON fields).
    pub fn by_name(&self) -> [(&'static str, u64); 12] {
        [
            ("foreign_source", self.foreign_source),
            ("malformed", self.malformed),
            ("unauthenticated", self.unauthenticated),
            ("bad_tag", self.bad_tag),
            ("stale_pass", self.stale_pass),
            ("unknown_job", self.unknown_job),
            ("unknown_tensor", self.unknown_tensor),
            ("stale_round", self.stale_round),
            ("out_of_bounds", self.out_of_bounds),
            ("not_element_multiple", self.not_element_multiple),
            ("too_long", self.too_long),
            ("misaligned", self.misaligned),
        ]
    }

    /// The non-zero counts by name, for one-line reports.
    pub fn nonzero(&self) -> Vec<(&'static str, u64)> {
        self.by_name().into_iter().filter(|&(_, n)| n > 0).collect()
    }

    /// Total refusals.
    pub fn total(&self) -> u64 {
        self.by_name().iter().map(|&(_, n)| n).sum()
    }
}

/// The non-zero counts, `name count` separated by two spaces ("none" when all are zero).
impl std::fmt::Display for RejectCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nonzero = self.nonzero();
        if nonzero.is_empty() {
            return f.write_str("none");
        }
        for (i, (name, n)) in nonzero.iter().enumerate() {
            if i > 0 {
                f.write_str("  ")?;
            }
            write!(f, "{name} {n}")?;
        }
        Ok(())
    }
}

/// Counters and timestamps of one receive (nanoseconds on the driver's clock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReceiverStats {
    /// Data packets placed (first copies).
    pub placed: u64,
    /// Duplicate data packets (already had the segment; harmless).
    pub duplicates: u64,
    /// Payload bytes placed.
    pub bytes: u64,
    /// CE-marked data packets.
    pub ce_packets: u64,
    /// Retransmission requests sent.
    pub retransmit_requests: u32,
    /// Segments asked for again, over all requests.
    pub segments_requested: u64,
    /// When FlowStart was accepted.
    pub start_ns: u64,
    /// When the first data packet arrived.
    pub first_data_ns: Option<u64>,
    /// When the loss bound was met.
    pub bound_met_ns: Option<u64>,
    /// When FinishConfirm arrived.
    pub done_ns: Option<u64>,
    /// Data packets received per switch queue (by DSCP) and how many of them were CE: what
    /// the switches did to this flow, fed back to the sender in `EcnReport`.
    pub ecn: [QueueEcn; ECN_QUEUES],
    /// Retransmission requests held back after a pass that delivered nothing new.
    pub backoffs: u32,
    /// Retransmission requests held back because the pass's data was still arriving when
    /// its FlowStop came (a queue draining on a long path): sent once arrivals paused.
    pub drain_holds: u32,
}

/// One tensor being received.
#[derive(Debug)]
pub struct ReceiverFlow {
    id: FlowId,
    /// The sources announced in `FlowStart`, unspecified addresses resolved to the control
    /// peer's: the only ones whose datagrams may touch the tensor.
    peers: Vec<DataSource>,
    /// An authenticated flow's key and the scratch buffer payloads are decrypted into (boxed:
    /// taken out and put back per packet, which moves one pointer).
    auth: Option<Box<(FlowKey, Vec<u8>)>>,
    /// The retransmission pass whose data is current (authenticated flows drop older passes).
    current_pass: u32,
    layout: SegmentLayout,
    loss_bound: LossBound,
    bitmap: SegmentBitmap,
    phase: ReceiverPhase,
    finish_pending: bool,
    /// Packets counted in `stats.ecn` since the last EcnReport.
    ecn_dirty: bool,
    /// An EcnReport is to follow the RateReport just sent.
    ecn_due: bool,
    /// RateReports sent, to send an EcnReport every [`ECN_REPORT_EVERY`] of them.
    rate_reports: u64,
    meter: RateMeter,
    stats: ReceiverStats,
    /// Segments placed when the previous FlowStop arrived, and how many passes in a row
    /// delivered nothing new.
    placed_at_stop: u64,
    futile_passes: u32,
    /// Give up when no new segment arrived for this long (0: never).
    no_progress_ns: u64,
    /// Longest wait before asking again after futile passes.
    max_backoff_ns: u64,
    /// A retransmission request held back: after a futile pass, or while the pass's data
    /// still arrives. Its ranges are computed when it is sent.
    held_request: Option<HeldRequest>,
    /// When a new segment was last placed (or the flow accepted).
    last_new_ns: u64,
    /// Smoothed gap between new segments of the same pass (1/8 gain), 0 before two have
    /// arrived; the wait for a retransmission between passes is not an arrival gap.
    gap_ns: u64,
    /// When the current pass's last new segment arrived (`None` right after a request).
    pass_arrival_ns: Option<u64>,
    /// The grant the driver last set, and the one last sent to the sender.
    grant_bps: Option<u64>,
    sent_grant_bps: Option<u64>,
}

/// An EcnReport follows every this many RateReports (when anything changed), and always
/// precedes FlowFinish: at the paper's 200 us period, every 1.6 ms.
pub const ECN_REPORT_EVERY: u64 = 8;

/// Default for [`ReceiverFlow::set_no_progress_timeout`]: 10 s without a new segment.
pub const DEFAULT_NO_PROGRESS_NS: u64 = 10_000_000_000;

/// Default for [`ReceiverFlow::set_max_backoff`]: at most 100 ms between futile passes.
pub const DEFAULT_MAX_BACKOFF_NS: u64 = 100_000_000;

/// A retransmission request waiting to be sent.
#[derive(Debug, Clone, Copy)]
struct HeldRequest {
    /// The pass it answers.
    pass: u32,
    /// Sent at this time (a backoff), or `None`: once no new segment arrived for
    /// [`ReceiverFlow::quiet_ns`] (a draining queue).
    due_ns: Option<u64>,
}

/// A drain hold ends after this many smoothed arrival gaps without a new segment. Relative
/// to the flow's own arrival spacing: on a datacenter path (gaps of a microsecond, FlowStop
/// right behind the last packet) a request goes out at once as before; behind a WAN queue
/// draining at a few Mbit/s it waits until the queue is empty.
pub const QUIET_GAPS: u64 = 4;

/// A grant that moved by less than this fraction (1/16) is not sent again.
const GRANT_RESEND_SHIFT: u32 = 4;

impl ReceiverFlow {
    /// Validate a FlowStart against what is registered. On success returns the flow and the
    /// FlowAccept to send; on failure the FlowReject to send.
    ///
    /// `control_peer` is the address of the control connection's peer: it stands for the
    /// unspecified addresses among the announced data sources.
    pub fn accept(
        start: &FlowStart,
        spec: &RecvSpec,
        control_peer: IpAddr,
        data_port: u16,
        period_ns: u64,
        now_ns: u64,
    ) -> Result<(ReceiverFlow, CtrlMsg), CtrlMsg> {
        let id = FlowId {
            job: start.job_id,
            tensor: start.tensor_id,
            round: start.round,
        };
        let reject = |code, reason: String| CtrlMsg::FlowReject {
            job_id: id.job,
            tensor_id: id.tensor,
            round: id.round,
            code,
            reason,
        };
        if start.job_id != spec.job || start.tensor_id != spec.tensor {
            return Err(reject(
                RejectCode::UnknownTensor,
                format!(
                    "no tensor registered for job {} tensor {} (expecting job {} tensor {})",
                    start.job_id, start.tensor_id, spec.job, spec.tensor
                ),
            ));
        }
        if spec.round.is_some_and(|r| r != start.round) {
            return Err(reject(
                RejectCode::Other,
                format!(
                    "round {} offered, round {:?} expected",
                    start.round, spec.round
                ),
            ));
        }
        if DType::from_code(start.dtype_code) != Some(spec.dtype) {
            return Err(reject(
                RejectCode::DtypeMismatch,
                format!(
                    "dtype code {} offered, {} registered",
                    start.dtype_code, spec.dtype
                ),
            ));
        }
        if start.size_bytes != spec.size_bytes {
            return Err(reject(
                RejectCode::SizeMismatch,
                format!(
                    "{} bytes offered, {} bytes registered",
                    start.size_bytes, spec.size_bytes
                ),
            ));
        }
        let layout = match SegmentLayout::new(
            start.size_bytes,
            spec.dtype.elem_size(),
            start.segment_payload as usize,
        ) {
            Ok(l) if l.count() == start.segment_count && l.segment_payload() <= spec.max_payload => l,
            Ok(l) => {
                return Err(reject(
                    RejectCode::BadSegmentLayout,
                    format!(
                        "{} segments of {} B offered; this receiver computes {} and accepts at most {} B per segment",
                        start.segment_count,
                        start.segment_payload,
                        l.count(),
                        spec.max_payload
                    ),
                ))
            }
            Err(e) => return Err(reject(RejectCode::BadSegmentLayout, e.to_string())),
        };
        if start.sources.is_empty() {
            return Err(reject(
                RejectCode::Other,
                "FlowStart announces no data source".into(),
            ));
        }
        let wildcard = |a: IpAddr| a.to_canonical().is_unspecified();
        if control_peer.is_unspecified() && start.sources.iter().any(|s| wildcard(s.addr)) {
            return Err(reject(
                RejectCode::Other,
                "FlowStart announces a wildcard data source, but the control channel has no \
                 peer address to stand for it: bind the sender's data socket to an address"
                    .into(),
            ));
        }
        let peers = start
            .sources
            .iter()
            .map(|s| DataSource {
                // `::ffff:0.0.0.0` is a wildcard too.
                addr: if wildcard(s.addr) {
                    control_peer.to_canonical()
                } else {
                    s.addr.to_canonical()
                },
                ..*s
            })
            .collect();
        let loss_bound = spec.loss_bound.unwrap_or(start.loss_bound);
        let flow = ReceiverFlow {
            id,
            peers,
            auth: None,
            current_pass: 0,
            bitmap: SegmentBitmap::new(layout.count()),
            layout,
            loss_bound,
            phase: ReceiverPhase::Receiving,
            finish_pending: false,
            ecn_dirty: false,
            ecn_due: false,
            rate_reports: 0,
            meter: RateMeter::new(period_ns, now_ns),
            stats: ReceiverStats {
                start_ns: now_ns,
                ..ReceiverStats::default()
            },
            placed_at_stop: 0,
            futile_passes: 0,
            no_progress_ns: DEFAULT_NO_PROGRESS_NS,
            max_backoff_ns: DEFAULT_MAX_BACKOFF_NS,
            held_request: None,
            gap_ns: 0,
            pass_arrival_ns: None,
            last_new_ns: now_ns,
            grant_bps: None,
            sent_grant_bps: None,
        };
        let accept = CtrlMsg::FlowAccept {
            job_id: id.job,
            tensor_id: id.tensor,
            round: id.round,
            data_port,
        };
        let mut flow = flow;
        flow.check_bound(now_ns);
        Ok((flow, accept))
    }

    /// Give up (with [`ProtoError::NoDataProgress`]) when a pass ends and no new segment
    /// arrived for `ns` (default [`DEFAULT_NO_PROGRESS_NS`]); 0 never gives up. Passes that
    /// deliver nothing are not a reason by themselves: under an incast a congested queue can
    /// drop several passes in a row while the path works, so they back off instead
    /// ([`Self::set_max_backoff`]).
    pub fn set_no_progress_timeout(&mut self, ns: u64) {
        self.no_progress_ns = ns;
    }

    /// After `k` futile passes in a row the retransmission request waits
    /// `min(2^(k-1) ms, max)`; default max [`DEFAULT_MAX_BACKOFF_NS`].
    pub fn set_max_backoff(&mut self, ns: u64) {
        self.max_backoff_ns = ns;
    }

    /// The rate this flow may send at (its share of the receiver's capacity), as the
    /// driver's grant allocator computes it. [`Self::poll`] sends it to the sender when it
    /// is new or moved by 1/16 or more.
    pub fn set_grant(&mut self, rate_bps: u64) {
        self.grant_bps = Some(rate_bps.max(1));
    }

    /// True while the flow still wants data (it counts in the receiver's fan-in).
    pub fn wants_data(&self) -> bool {
        self.phase == ReceiverPhase::Receiving
    }

    /// The flow.
    pub fn id(&self) -> FlowId {
        self.id
    }

    /// Current phase.
    pub fn phase(&self) -> ReceiverPhase {
        self.phase
    }

    /// True once FinishConfirm arrived.
    pub fn is_done(&self) -> bool {
        self.phase == ReceiverPhase::Done
    }

    /// The loss bound in force.
    pub fn loss_bound(&self) -> LossBound {
        self.loss_bound
    }

    /// Segment layout.
    pub fn layout(&self) -> &SegmentLayout {
        &self.layout
    }

    /// Which segments arrived.
    pub fn bitmap(&self) -> &SegmentBitmap {
        &self.bitmap
    }

    /// Counters.
    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    fn check_bound(&mut self, now_ns: u64) {
        if self.phase == ReceiverPhase::Receiving
            && self
                .loss_bound
                .is_met(self.bitmap.count_ones(), self.layout.count())
        {
            self.phase = ReceiverPhase::FinishSent;
            self.finish_pending = true;
            self.stats.bound_met_ns = Some(now_ns);
        }
    }

    /// The data sources this flow accepts datagrams from (announced, resolved).
    pub fn peers(&self) -> &[DataSource] {
        &self.peers
    }

    /// Whether `src` is one of the flow's announced data sources.
    #[inline]
    pub fn is_peer(&self, src: SocketAddr) -> bool {
        let ip = src.ip().to_canonical();
        let port = u32::from(src.port());
        self.peers.iter().any(|p| {
            p.addr == ip
                && port >= u32::from(p.port)
                && port < u32::from(p.port) + u32::from(p.ports)
        })
    }

    /// Makes this an authenticated flow: from now on only `AuthData` datagrams of the
    /// current pass whose tag verifies under `key` are placed (decrypted first).
    pub fn authenticate(&mut self, key: FlowKey) {
        self.auth = Some(Box::new((key, Vec::new())));
    }

    /// Whether the flow takes authenticated datagrams only.
    pub fn is_authenticated(&self) -> bool {
        self.auth.is_some()
    }

    /// Handle one received datagram from `src`: peer binding (the announced sources only),
    /// header parse, for an authenticated flow the kind, pass and tag (payload decrypted),
    /// then [`Self::on_data`]. Returns whether the segment was new; nothing is written
    /// unless every check passed. This is the whole per-packet receive path.
    #[inline]
    pub fn on_datagram(
        &mut self,
        src: SocketAddr,
        datagram: &[u8],
        tensor: &mut [u8],
        tos: u8,
        now_ns: u64,
    ) -> Result<bool, DataReject> {
        if !self.is_peer(src) {
            return Err(DataReject::ForeignSource);
        }
        let pkt = header::Packet::new_checked(datagram).map_err(|_| DataReject::Malformed)?;
        let repr = header::Repr::parse(&pkt).map_err(|_| DataReject::Malformed)?;
        let Some(mut auth) = self.auth.take() else {
            if repr.kind != header::Kind::Data {
                return Err(DataReject::Unauthenticated);
            }
            return Ok(self.on_data(&repr, pkt.payload(), tensor, tos, now_ns)?);
        };
        let res = self.on_sealed(&repr, datagram, &mut auth, tensor, tos, now_ns);
        self.auth = Some(auth);
        res
    }

    /// The header names this flow (job, tensor, round) and the flow still takes data.
    #[inline]
    fn check_ids(&self, hdr: &header::Repr) -> Result<(), PlaceError> {
        if hdr.job_id != self.id.job {
            return Err(PlaceError::UnknownJob);
        }
        if hdr.tensor_id != self.id.tensor {
            return Err(PlaceError::UnknownTensor);
        }
        if hdr.round != self.id.round || self.phase == ReceiverPhase::Done {
            return Err(PlaceError::StaleRound);
        }
        Ok(())
    }

    /// The authenticated half of [`Self::on_datagram`], with the key taken out of `self`.
    #[inline]
    fn on_sealed(
        &mut self,
        repr: &header::Repr,
        datagram: &[u8],
        auth: &mut (FlowKey, Vec<u8>),
        tensor: &mut [u8],
        tos: u8,
        now_ns: u64,
    ) -> Result<bool, DataReject> {
        if repr.kind != header::Kind::AuthData {
            return Err(DataReject::Unauthenticated);
        }
        // Cheap refusals first: junk with another flow's ids costs no decryption.
        self.check_ids(repr)?;
        // The header's pass is 8 bits of the control channel's pass number.
        if repr.pass != self.current_pass as u8 {
            return Err(DataReject::StalePass);
        }
        let (key, scratch) = auth;
        let payload = key
            .open_parsed(repr, datagram, scratch)
            .map_err(|_| DataReject::BadTag)?;
        Ok(self.on_data(repr, payload, tensor, tos, now_ns)?)
    }

    /// Place one data packet into `tensor` (the registered buffer), given its parsed header.
    /// This is the placement half of [`Self::on_datagram`] only: it does no peer binding and
    /// no authentication, so drivers call `on_datagram`; tests, benches and fuzzers of the
    /// placement checks call this. `tos` is the packet's IP
    /// TOS / traffic-class byte (DSCP and ECN as received). Returns whether the segment was
    /// new. Nothing is written unless every check passed.
    #[inline]
    pub fn on_data(
        &mut self,
        hdr: &header::Repr,
        payload: &[u8],
        tensor: &mut [u8],
        tos: u8,
        now_ns: u64,
    ) -> Result<bool, PlaceError> {
        let ce = tos & 0b11 == 0b11;
        self.check_ids(hdr)?;
        let index = self.layout.locate(hdr.offset, payload.len())?;
        let start = hdr.offset as usize;
        let dst = tensor
            .get_mut(start..start + payload.len())
            .ok_or(PlaceError::OutOfBounds)?;
        if self.stats.first_data_ns.is_none() {
            // Measure from the first packet: the rendezvous gap before it is not congestion.
            self.meter = RateMeter::new(self.meter.period_ns(), now_ns);
            self.stats.first_data_ns = Some(now_ns);
        }
        let overhead = header::HEADER_LEN + hdr.kind.tag_len();
        self.meter.record((payload.len() + overhead) as u64, ce);
        self.stats.ce_packets += u64::from(ce);
        // A DSCP the policy does not name lands in queue 0 on a gradwire switch.
        let q = gradwire_qos::dscp_queue(tos >> 2).unwrap_or(0);
        if let Some(e) = self.stats.ecn.get_mut(usize::from(q)) {
            e.packets = e.packets.saturating_add(1);
            e.ce = e.ce.saturating_add(u32::from(ce));
            self.ecn_dirty = true;
        }
        if !self.bitmap.set(index) {
            self.stats.duplicates += 1;
            return Ok(false);
        }
        dst.copy_from_slice(payload);
        if let Some(prev) = self.pass_arrival_ns {
            let gap = now_ns.saturating_sub(prev);
            self.gap_ns = if self.gap_ns == 0 {
                gap
            } else {
                self.gap_ns.saturating_mul(7).saturating_add(gap) / 8
            };
        }
        self.pass_arrival_ns = Some(now_ns);
        self.last_new_ns = now_ns;
        self.stats.placed += 1;
        self.stats.bytes += payload.len() as u64;
        self.check_bound(now_ns);
        Ok(true)
    }

    /// Messages due now: FlowFinish once the bound is met, and a RateReport every period
    /// while data flows.
    pub fn poll(&mut self, now_ns: u64) -> Option<CtrlMsg> {
        if self.phase == ReceiverPhase::Receiving {
            if let Some(g) = self.grant_bps {
                let moved = self
                    .sent_grant_bps
                    .is_none_or(|s| s.abs_diff(g) >= (s >> GRANT_RESEND_SHIFT).max(1));
                if moved {
                    self.sent_grant_bps = Some(g);
                    return Some(CtrlMsg::RateGrant { rate_bps: g });
                }
            }
            if let Some(h) = self.held_request {
                let due = h
                    .due_ns
                    .unwrap_or_else(|| self.last_new_ns.saturating_add(self.quiet_ns()));
                if now_ns >= due {
                    self.held_request = None;
                    return Some(self.retransmit_request(h.pass));
                }
            }
        }
        if self.finish_pending {
            // The final per-queue ECN counts go first, so the sender has them when it is done.
            if self.ecn_dirty {
                return Some(self.ecn_report());
            }
            self.finish_pending = false;
            return Some(CtrlMsg::FlowFinish {
                received_segments: self.bitmap.count_ones(),
            });
        }
        if self.phase != ReceiverPhase::Receiving || self.stats.first_data_ns.is_none() {
            // Before the first packet there is no rate to report (a report of 0 would read
            // as congestion when the path is merely longer than one period); after FlowFinish
            // the sender has stopped, so reports would inform nobody.
            return None;
        }
        if self.ecn_due {
            self.ecn_due = false;
            if self.ecn_dirty {
                return Some(self.ecn_report());
            }
        }
        let report = self.meter.poll(now_ns).map(|s| CtrlMsg::RateReport {
            period_ns: s.period_ns,
            bytes: s.bytes,
            packets: s.packets,
            ce_packets: s.ce_packets,
        });
        if report.is_some() {
            self.rate_reports += 1;
            self.ecn_due = self.rate_reports % ECN_REPORT_EVERY == 0;
        }
        report
    }

    /// How long arrivals must pause before a request goes out: [`QUIET_GAPS`] smoothed gaps
    /// between new segments, at most the longest backoff.
    fn quiet_ns(&self) -> u64 {
        self.gap_ns
            .saturating_mul(QUIET_GAPS)
            .min(self.max_backoff_ns)
    }

    /// The request for what is missing now; the sender's next pass is current from here on
    /// (late packets of `pass` counted until this moment).
    fn retransmit_request(&mut self, pass: u32) -> CtrlMsg {
        let ranges = self.bitmap.missing_ranges(MAX_RANGES);
        self.stats.retransmit_requests += 1;
        self.stats.segments_requested += ranges.iter().map(|r| u64::from(r.len)).sum::<u64>();
        self.current_pass = pass.wrapping_add(1);
        self.pass_arrival_ns = None;
        // Segments that arrived while the request was held belong to the pass it answers:
        // the next pass is judged futile or not by what it brings itself.
        self.placed_at_stop = self.stats.placed;
        CtrlMsg::RetransmitRequest { pass, ranges }
    }

    fn ecn_report(&mut self) -> CtrlMsg {
        self.ecn_dirty = false;
        CtrlMsg::EcnReport {
            queues: self.stats.ecn,
        }
    }

    /// Handle a control message; returns a reply to send, if any.
    pub fn on_ctrl(&mut self, msg: CtrlMsg, now_ns: u64) -> Result<Option<CtrlMsg>, ProtoError> {
        match msg {
            CtrlMsg::FlowStop { pass, .. } => match self.phase {
                // FlowFinish is already on its way; the sender will confirm.
                ReceiverPhase::FinishSent | ReceiverPhase::Done => Ok(None),
                ReceiverPhase::Receiving => {
                    if self.stats.placed == self.placed_at_stop {
                        self.futile_passes += 1;
                    } else {
                        self.futile_passes = 0;
                    }
                    self.placed_at_stop = self.stats.placed;
                    if self.no_progress_ns > 0
                        && now_ns.saturating_sub(self.last_new_ns) >= self.no_progress_ns
                    {
                        return Err(ProtoError::NoDataProgress {
                            passes: self.futile_passes,
                            received: self.bitmap.count_ones(),
                            total: self.layout.count(),
                            idle_ms: now_ns.saturating_sub(self.last_new_ns) / 1_000_000,
                        });
                    }
                    if self.futile_passes == 0 {
                        if now_ns.saturating_sub(self.last_new_ns) >= self.quiet_ns() {
                            return Ok(Some(self.retransmit_request(pass)));
                        }
                        // The pass's data still arrives: FlowStop overtook a queue that is
                        // draining (a long, deep-buffered path). Asking now would resend
                        // everything still queued; ask once arrivals pause.
                        self.stats.drain_holds += 1;
                        self.held_request = Some(HeldRequest { pass, due_ns: None });
                        return Ok(None);
                    }
                    // Nothing new got through: let the queue drain before asking again.
                    self.stats.backoffs += 1;
                    let wait =
                        (1_000_000u64 << (self.futile_passes - 1).min(20)).min(self.max_backoff_ns);
                    self.held_request = Some(HeldRequest {
                        pass,
                        due_ns: Some(now_ns.saturating_add(wait)),
                    });
                    Ok(None)
                }
            },
            CtrlMsg::FinishConfirm => match self.phase {
                ReceiverPhase::FinishSent => {
                    self.phase = ReceiverPhase::Done;
                    self.stats.done_ns = Some(now_ns);
                    Ok(None)
                }
                p => Err(ProtoError::Unexpected {
                    what: "FinishConfirm",
                    state: p.name(),
                }),
            },
            CtrlMsg::Abort { code, reason } => Err(ProtoError::Aborted { code, reason }),
            other => Err(ProtoError::Unexpected {
                what: msg_name(&other),
                state: self.phase.name(),
            }),
        }
    }
}
