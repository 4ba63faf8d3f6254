//! The bounded-loss protocol core (DLCP §3.2.1): deterministic state machines with no sockets
//! and no clocks inside, in the spirit of quinn-proto.
//!
//! A [`sender::SenderFlow`] and a [`receiver::ReceiverFlow`] exchange [`CtrlMsg`]s over a
//! reliable channel and data segments over an unreliable one. The driver in
//! `gradwire::transport` moves those messages and segments; tests can drive the two cores
//! directly and decide exactly which segments are lost.
//!
//! ```text
//!  sender                                   receiver
//!  FlowStart ------------------------------> validate against the registered tensor
//!            <------------------------------ FlowAccept (data port)   | FlowReject
//!  data seg 0..n (paced) ~~~~~~~~~~~~~~~~~~> place by offset, set bitmap bit
//!            <------------------------------ RateReport (every period)
//!  FlowStop(pass) -------------------------> bound met?  yes: FlowFinish
//!            <------------------------------ no: RetransmitRequest(pass, missing ranges)
//!  data (missing only, line rate again) ~~~> ...
//!            <------------------------------ FlowFinish (as soon as >= 1-p received)
//!  FinishConfirm --------------------------> done (late data now dropped as stale)
//! ```

pub mod receiver;
pub mod sender;
#[cfg(test)]
mod tests;

use crate::message::{CtrlMsg, DataSource, LossBound, RejectCode, FLOW_NONCE_LEN};
use crate::wire::header::Flags;

pub use receiver::{DataReject, ReceiverFlow, RecvSpec, RejectCounts};
pub use sender::{SenderConfig, SenderFlow, SenderStats};

/// Identifies one transfer of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct FlowId {
    /// Training job.
    pub job: u32,
    /// Tensor within the job.
    pub tensor: u32,
    /// Round (iteration).
    pub round: u32,
}

impl std::fmt::Display for FlowId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {} tensor {} round {}",
            self.job, self.tensor, self.round
        )
    }
}

/// Where a sender's data comes from, announced in its `FlowStart`: the receiver binds the flow
/// to these sources (peer binding) and, in an authenticated job, keys the flow's data with the
/// nonce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataOrigin {
    /// Every address and source-port range the flow's data may come from.
    pub sources: Vec<DataSource>,
    /// Random per flow (see `FlowStart::flow_nonce`).
    pub flow_nonce: [u8; FLOW_NONCE_LEN],
}

impl DataOrigin {
    /// One source address and port, with a zero nonce (tests and benches).
    pub fn single(src: std::net::SocketAddr) -> DataOrigin {
        DataOrigin {
            sources: vec![DataSource::single(src)],
            flow_nonce: [0; FLOW_NONCE_LEN],
        }
    }
}

/// Default loss bounds (DLCP §3.2.1 "Loss bound setting"): pull is stricter than push because
/// each pulled value is already an aggregate of many workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossDefaults {
    /// Bound for the push stage (worker -> server / reduce).
    pub push: LossBound,
    /// Bound for the pull stage (server -> worker / broadcast).
    pub pull: LossBound,
}

impl Default for LossDefaults {
    fn default() -> Self {
        // 10% push is the largest bound DLCP reports as harmless to convergence; pull 1%.
        let ppm = |v| LossBound::from_ppm(v).unwrap_or(LossBound::RELIABLE);
        LossDefaults {
            push: ppm(100_000),
            pull: ppm(10_000),
        }
    }
}

/// A protocol error: the peer did something the state machine cannot accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// An authenticated flow sent 2^32 datagrams: another would reuse a nonce.
    #[error(
        "authenticated flow used all 2^32 sequence numbers (its nonces); split the tensor or \
         raise the loss bound"
    )]
    NoncesExhausted,
    /// The receiver refused the flow.
    #[error("receiver rejected {flow}: {code:?}: {reason}")]
    Rejected {
        /// Flow.
        flow: FlowId,
        /// Cause.
        code: RejectCode,
        /// Receiver's words.
        reason: String,
    },
    /// The peer gave up.
    #[error("peer aborted (code {code}): {reason}")]
    Aborted {
        /// Peer's code.
        code: u8,
        /// Peer's words.
        reason: String,
    },
    /// A message that is not legal in the current state.
    #[error("unexpected {what} while {state}")]
    Unexpected {
        /// The message kind.
        what: &'static str,
        /// The state it arrived in.
        state: &'static str,
    },
    /// A message naming a different flow.
    #[error("{what} names {got}, but the flow is {expected}")]
    WrongFlow {
        /// The message kind.
        what: &'static str,
        /// What it named.
        got: FlowId,
        /// The active flow.
        expected: FlowId,
    },
    /// No new segment for the configured time while passes kept ending: the data path is
    /// broken while the control channel works (e.g. an MTU the data path cannot carry, a
    /// firewall).
    #[error("no new segment for {idle_ms} ms over {passes} passes in a row ({received} of {total} received): the data path is not delivering")]
    NoDataProgress {
        /// Consecutive passes that delivered nothing new.
        passes: u32,
        /// Time since the last new segment, ms.
        idle_ms: u64,
        /// Segments received.
        received: u32,
        /// Segments in the tensor.
        total: u32,
    },
    /// A retransmission request for segments that do not exist.
    #[error("retransmission request for segments {start}..{end} of a {count}-segment tensor")]
    BadRanges {
        /// First bad segment.
        start: u32,
        /// End of the bad range.
        end: u32,
        /// Segments in the tensor.
        count: u32,
    },
}

/// Name of a control message, for errors and logs.
pub fn msg_name(m: &CtrlMsg) -> &'static str {
    match m {
        CtrlMsg::FlowStart(_) => "FlowStart",
        CtrlMsg::FlowAccept { .. } => "FlowAccept",
        CtrlMsg::FlowReject { .. } => "FlowReject",
        CtrlMsg::FlowStop { .. } => "FlowStop",
        CtrlMsg::RetransmitRequest { .. } => "RetransmitRequest",
        CtrlMsg::FlowFinish { .. } => "FlowFinish",
        CtrlMsg::FinishConfirm => "FinishConfirm",
        CtrlMsg::RateReport { .. } => "RateReport",
        CtrlMsg::Abort { .. } => "Abort",
        CtrlMsg::EcnReport { .. } => "EcnReport",
        CtrlMsg::RateGrant { .. } => "RateGrant",
        CtrlMsg::Hello { .. } => "Hello",
        CtrlMsg::Challenge { .. } => "Challenge",
        CtrlMsg::Proof { .. } => "Proof",
        CtrlMsg::Welcome { .. } => "Welcome",
    }
}

/// How a segment is tagged on the wire: DSCP (switch queue) and whether it is ECN-capable
/// (important gradients are ECT and get marked instead of dropped above the queue threshold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// DSCP code point, 0..=63.
    pub dscp: u8,
    /// Send as ECT(0) (true) or not-ECT (false).
    pub ect: bool,
}

impl Tag {
    /// The IP TOS byte for this tag.
    pub const fn tos(self) -> u8 {
        crate::datagram::tos(self.dscp & 0x3f, if self.ect { 0b10 } else { 0 })
    }
}

/// What a priority function sees of a segment.
#[derive(Debug, Clone, Copy)]
pub struct SegmentInfo<'a> {
    /// Segment index.
    pub index: u32,
    /// Byte offset in the tensor.
    pub offset: u64,
    /// Layer of the tensor.
    pub layer: u16,
    /// Element type.
    pub dtype: crate::tensor::DType,
    /// The segment's bytes.
    pub payload: &'a [u8],
}

/// The paper's `prio_func`: decides each segment's tag.
pub type PriorityFn<'a> = dyn Fn(&SegmentInfo<'_>) -> Tag + Sync + 'a;

/// The TOS byte `prio` gives each `seg_payload`-byte segment of `bytes` (a tensor of `dtype`
/// in layer `layer`; the last segment may be shorter): the per-segment tags of a message
/// that is tagged before it is sent.
pub fn tos_per_segment(
    bytes: &[u8],
    seg_payload: usize,
    layer: u16,
    dtype: crate::tensor::DType,
    prio: &PriorityFn<'_>,
) -> Vec<u8> {
    let seg_payload = seg_payload.max(1);
    bytes
        .chunks(seg_payload)
        .enumerate()
        .map(|(i, payload)| {
            prio(&SegmentInfo {
                index: i as u32,
                offset: (i * seg_payload) as u64,
                layer,
                dtype,
                payload,
            })
            .tos()
        })
        .collect()
}

/// A priority function giving every segment the same tag.
pub fn fixed_priority(tag: Tag) -> impl Fn(&SegmentInfo<'_>) -> Tag + Sync {
    move |_| tag
}

/// Header flags for a segment.
pub(crate) fn segment_flags(retransmit: bool, last: bool, important: bool) -> Flags {
    let mut f = Flags::default();
    if retransmit {
        f.insert(Flags::RETRANSMIT);
    }
    if last {
        f.insert(Flags::LAST);
    }
    if important {
        f.insert(Flags::IMPORTANT);
    }
    f
}
