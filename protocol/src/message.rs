//! Control-channel messages and their framing.
//!
//! The control channel is a reliable, ordered byte stream (kernel TCP, driven by the caller);
//! this module only turns [`CtrlMsg`] values into bytes and back, so it does no I/O and never
//! reads a clock. Every frame is a big-endian `u32` body length followed by the body; the body
//! starts with a version byte ([`VERSION`]) and a kind byte, then the kind's fixed-layout
//! fields (big-endian), with variable parts length-prefixed. See `docs/protocol.md`.
//!
//! The encoding is canonical: [`CtrlMsg::decode_body`] accepts exactly the bodies that
//! [`CtrlMsg::encode`] can produce (reserved bits must be zero, ranges sorted, strings UTF-8
//! and bounded), so `decode(encode(m)) == m` and `encode(decode(b)) == b`. Decoding never
//! panics and never allocates more than the input can justify.

use thiserror::Error;

/// Protocol version carried in every body. Version 2 added the connection handshake
/// (`Hello` .. `Welcome`), the sealed frames of authenticated jobs and the data sources and
/// flow nonce of `FlowStart`; version 3 the job priority in `FlowStart`'s flags. An older
/// peer is refused with [`CtrlError::BadVersion`].
pub const VERSION: u8 = 3;
/// Bytes in the length prefix that precedes each body.
pub const LEN_PREFIX: usize = 4;
/// Largest body accepted or produced (1 MiB); bounds the receiver's buffering.
pub const MAX_BODY: u32 = 1 << 20;
/// Largest `reason` string, in UTF-8 bytes.
pub const MAX_REASON: usize = 1024;
/// Most data sources one `FlowStart` may announce.
pub const MAX_SOURCES: usize = 64;
/// Bytes of a handshake nonce (`Hello`, `Challenge`).
pub const HANDSHAKE_NONCE_LEN: usize = 32;
/// Bytes of a handshake proof (`Proof`, `Welcome`): an HMAC-SHA256.
pub const HANDSHAKE_PROOF_LEN: usize = 32;
/// Bytes of an ephemeral X25519 public key (`Hello`, `Challenge`).
pub const HANDSHAKE_PUBLIC_LEN: usize = 32;
/// Bytes of the per-flow nonce in `FlowStart` (keys an authenticated flow's data).
pub const FLOW_NONCE_LEN: usize = 16;
/// Most ranges one `RetransmitRequest` can carry without its body exceeding [`MAX_BODY`].
pub const MAX_RANGES: usize = (MAX_BODY as usize - HEADER - 4 - 4) / 8;

/// Version + kind bytes at the start of every body.
const HEADER: usize = 2;

/// Message kind codes (the body's second byte).
pub mod kind {
    /// [`super::CtrlMsg::FlowStart`].
    pub const FLOW_START: u8 = 1;
    /// [`super::CtrlMsg::FlowAccept`].
    pub const FLOW_ACCEPT: u8 = 2;
    /// [`super::CtrlMsg::FlowReject`].
    pub const FLOW_REJECT: u8 = 3;
    /// [`super::CtrlMsg::FlowStop`].
    pub const FLOW_STOP: u8 = 4;
    /// [`super::CtrlMsg::RetransmitRequest`].
    pub const RETRANSMIT_REQUEST: u8 = 5;
    /// [`super::CtrlMsg::FlowFinish`].
    pub const FLOW_FINISH: u8 = 6;
    /// [`super::CtrlMsg::FinishConfirm`].
    pub const FINISH_CONFIRM: u8 = 7;
    /// [`super::CtrlMsg::RateReport`].
    pub const RATE_REPORT: u8 = 8;
    /// [`super::CtrlMsg::Abort`].
    pub const ABORT: u8 = 9;
    /// [`super::CtrlMsg::EcnReport`].
    pub const ECN_REPORT: u8 = 10;
    /// [`super::CtrlMsg::RateGrant`].
    pub const RATE_GRANT: u8 = 11;
    /// [`super::CtrlMsg::Hello`].
    pub const HELLO: u8 = 12;
    /// [`super::CtrlMsg::Challenge`].
    pub const CHALLENGE: u8 = 13;
    /// [`super::CtrlMsg::Proof`].
    pub const PROOF: u8 = 14;
    /// [`super::CtrlMsg::Welcome`].
    pub const WELCOME: u8 = 15;
}

/// Switch queues an [`CtrlMsg::EcnReport`] covers (the 7 data queues and the control queue).
pub const ECN_QUEUES: usize = 8;

/// Data packets of a flow that arrived through one switch queue, and how many were CE.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize)]
pub struct QueueEcn {
    /// Packets received (duplicates included: they crossed the switch too).
    pub packets: u32,
    /// Of those, marked CE by a switch.
    pub ce: u32,
}

/// Why a control message could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CtrlError {
    /// The body ended before a field it announces.
    #[error("control message truncated")]
    Truncated,
    /// The body's version byte is not [`VERSION`].
    #[error("unsupported control protocol version {0}")]
    BadVersion(u8),
    /// The body's kind byte names no message.
    #[error("unknown control message kind {0}")]
    UnknownKind(u8),
    /// A body length (announced or produced) exceeds [`MAX_BODY`].
    #[error("control message body of {0} bytes exceeds the 1 MiB limit")]
    TooLarge(u32),
    /// A loss bound above 1 000 000 parts per million.
    #[error("loss bound {0} ppm exceeds 1000000")]
    BadLossBound(u32),
    /// A loss-bound fraction that is NaN or outside `[0, 1]`.
    #[error("loss bound fraction must be within [0, 1]")]
    BadFraction,
    /// Retransmit ranges empty (len 0), overflowing, unsorted or overlapping.
    #[error("retransmit ranges must be non-empty, in bounds, sorted and non-overlapping")]
    BadRanges,
    /// A reason string that is not valid UTF-8.
    #[error("reason is not valid UTF-8")]
    BadUtf8,
    /// A reason string longer than [`MAX_REASON`] bytes.
    #[error("reason of {0} bytes exceeds the 1024-byte limit")]
    ReasonTooLong(usize),
    /// A `FlowStart` priority above [`MAX_PRIORITY`].
    #[error("FlowStart priority {0} is above the least urgent, 7")]
    BadPriority(u8),
    /// `FlowStart` flags with reserved bits set.
    #[error("reserved flag bits set: {0:#04x}")]
    BadFlags(u8),
    /// A `FlowReject` code that names no [`RejectCode`].
    #[error("unknown reject code {0}")]
    BadRejectCode(u8),
    /// Bytes left in the body after the message's last field.
    #[error("{0} trailing bytes after control message")]
    TrailingBytes(usize),
    /// A `RateGrant` of 0 bit/s (a receiver that wants a sender to pause grants the floor).
    #[error("rate grant of 0 bit/s")]
    ZeroGrant,
    /// A `FlowStart` announcing no data source, more than [`MAX_SOURCES`], a port range of
    /// zero ports or past 65535, or an address family code other than 4 or 6.
    #[error("FlowStart data sources must be 1..=64 address/port ranges within 1..=65535")]
    BadSources,
    /// A sealed frame whose tag did not verify: tampered with, replayed, reordered, or sent by
    /// a peer without the job secret. The stream cannot be trusted after it (sticky).
    #[error("control frame failed authentication (tampered, replayed, or a peer without the job secret)")]
    BadSeal,
}

/// Tolerated loss for one tensor, in parts per million of its segments (`0..=1_000_000`).
///
/// `0` ([`LossBound::RELIABLE`]) means every segment must arrive. The invariant
/// `ppm <= 1_000_000` is enforced by every constructor, so a `LossBound` always encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LossBound(u32);

impl LossBound {
    /// No loss tolerated.
    pub const RELIABLE: LossBound = LossBound(0);
    /// Parts per million in a whole (the largest valid bound: everything may be lost).
    pub const PPM_ONE: u32 = 1_000_000;

    /// A bound of `ppm` parts per million; above [`Self::PPM_ONE`] is an error.
    pub const fn from_ppm(ppm: u32) -> Result<Self, CtrlError> {
        if ppm > Self::PPM_ONE {
            Err(CtrlError::BadLossBound(ppm))
        } else {
            Ok(LossBound(ppm))
        }
    }

    /// A bound from a fraction in `[0, 1]`, rounded to the nearest ppm; NaN is an error.
    pub fn from_fraction(fraction: f64) -> Result<Self, CtrlError> {
        // `contains` is false for NaN, so NaN is rejected here too.
        if !(0.0..=1.0).contains(&fraction) {
            return Err(CtrlError::BadFraction);
        }
        // In [0, 1e6] after rounding, so the cast is exact.
        let ppm = (fraction * f64::from(Self::PPM_ONE)).round() as u32;
        Self::from_ppm(ppm)
    }

    /// Parts per million that may be lost.
    pub const fn ppm(self) -> u32 {
        self.0
    }

    /// The bound as a fraction in `[0, 1]`.
    pub fn as_fraction(self) -> f64 {
        f64::from(self.0) / f64::from(Self::PPM_ONE)
    }

    /// Whether `received` of `total` segments satisfies the bound:
    /// `received * 1e6 >= total * (1e6 - ppm)`, exactly, in integers.
    pub fn is_met(self, received_segments: u32, total_segments: u32) -> bool {
        let need = u64::from(Self::PPM_ONE.saturating_sub(self.0));
        // Both products are below 2^32 * 1e6 < 2^52: no overflow in u64.
        u64::from(received_segments) * u64::from(Self::PPM_ONE) >= u64::from(total_segments) * need
    }

    /// The fewest received segments out of `total_segments` that meet the bound.
    pub fn min_received(self, total_segments: u32) -> u32 {
        let need = u64::from(Self::PPM_ONE.saturating_sub(self.0));
        let min = (u64::from(total_segments) * need).div_ceil(u64::from(Self::PPM_ONE));
        // min <= total_segments, so it fits; the fallback is unreachable.
        u32::try_from(min).unwrap_or(total_segments)
    }
}

/// Which parameter-synchronisation stage a flow belongs to (`FlowStart` flags bit 0).
///
/// The paper enforces a tighter bound on the pull stage because pulled values are
/// aggregates of many workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Stage {
    /// Workers -> aggregator (reduce). Flags bit 0 clear.
    #[default]
    Push,
    /// Aggregator -> workers (broadcast). Flags bit 0 set.
    Pull,
}

/// A range of UDP source ports on one address that a sender's data may come from (announced
/// in `FlowStart`; the receiver accepts data of the flow from these sources only).
///
/// An unspecified address (`0.0.0.0` or `::`) stands for the address the control connection
/// comes from: a sender whose data socket is bound to the wildcard does not know its source
/// address until the kernel routes a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataSource {
    /// Source address (unspecified: the control connection's peer address).
    pub addr: std::net::IpAddr,
    /// First source port.
    pub port: u16,
    /// Number of consecutive ports from `port` (at least 1; several for per-packet spraying).
    pub ports: u16,
}

impl DataSource {
    /// One address and port.
    pub const fn single(addr: std::net::SocketAddr) -> DataSource {
        DataSource {
            addr: addr.ip(),
            port: addr.port(),
            ports: 1,
        }
    }

    /// Whether the range is one the wire can carry: at least one port, none past 65535.
    pub const fn is_valid(&self) -> bool {
        self.ports >= 1 && self.port as u32 + self.ports as u32 <= 65_536
    }

    /// Bytes on the wire: family, address, port, ports.
    const fn wire_len(&self) -> usize {
        1 + match self.addr {
            std::net::IpAddr::V4(_) => 4,
            std::net::IpAddr::V6(_) => 16,
        } + 2
            + 2
    }
}

/// `FlowStart` flag bit marking the pull stage.
const FLAG_PULL: u8 = 0x01;
/// Where `FlowStart`'s flags carry the priority (bits 1-3).
const PRIORITY_SHIFT: u8 = 1;
/// Least urgent priority a `FlowStart` can carry (0 is the most urgent).
pub const MAX_PRIORITY: u8 = 7;

/// The rendezvous a sender opens a tensor transfer with (kind 1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FlowStart {
    /// Training job.
    pub job_id: u32,
    /// Tensor within the job.
    pub tensor_id: u32,
    /// Training round (iteration).
    pub round: u32,
    /// DNN layer the tensor belongs to (drives switch priority).
    pub layer: u16,
    /// Element type: 0 raw bytes, 1 f32, 2 f16, 3 bf16; kept raw, mapped by the caller.
    pub dtype_code: u8,
    /// Tensor size in bytes.
    pub size_bytes: u64,
    /// Payload bytes in every full segment (the last one may be shorter).
    pub segment_payload: u32,
    /// Number of segments.
    pub segment_count: u32,
    /// Tolerated loss.
    pub loss_bound: LossBound,
    /// Push or pull stage.
    pub stage: Stage,
    /// The job's priority, 0 (most urgent) ..= [`MAX_PRIORITY`] (flags bits 1-3): the
    /// receiver's grant pool serves the most urgent flows first (MLNET §3.2).
    pub priority: u8,
    /// Random per flow: with an authenticated job it keys the flow's data (with the session's
    /// nonces); otherwise it tells two flows of the same ids apart in traces.
    pub flow_nonce: [u8; FLOW_NONCE_LEN],
    /// Where the flow's data comes from: 1..=[`MAX_SOURCES`] address/port ranges (every
    /// interface and spray port the sender uses).
    pub sources: Vec<DataSource>,
}

impl FlowStart {
    /// Fixed body bytes after version and kind (the sources follow).
    const FIELDS_LEN: usize = 4 + 4 + 4 + 2 + 1 + 8 + 4 + 4 + 4 + 1 + FLOW_NONCE_LEN + 1;

    /// Whether `segment_count == ceil(size_bytes / segment_payload)` with a non-zero payload.
    /// Decoding does not check this: a mismatch is the receiver's `BadSegmentLayout` reject.
    pub fn segment_layout_ok(&self) -> bool {
        self.segment_payload != 0
            && self.size_bytes.div_ceil(u64::from(self.segment_payload))
                == u64::from(self.segment_count)
    }
}

/// Why a receiver refused a `FlowStart`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectCode {
    /// The receiver expects no such tensor.
    UnknownTensor,
    /// `size_bytes` differs from the receiver's tensor.
    SizeMismatch,
    /// `dtype_code` differs from the receiver's tensor.
    DtypeMismatch,
    /// Segment payload/count are inconsistent or unsupported.
    BadSegmentLayout,
    /// The receiver cannot take the flow now.
    Busy,
    /// Anything else; see the reason string.
    Other,
}

impl RejectCode {
    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            RejectCode::UnknownTensor => 1,
            RejectCode::SizeMismatch => 2,
            RejectCode::DtypeMismatch => 3,
            RejectCode::BadSegmentLayout => 4,
            RejectCode::Busy => 5,
            RejectCode::Other => 255,
        }
    }

    /// The code for a wire byte, if it names one.
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => RejectCode::UnknownTensor,
            2 => RejectCode::SizeMismatch,
            3 => RejectCode::DtypeMismatch,
            4 => RejectCode::BadSegmentLayout,
            5 => RejectCode::Busy,
            255 => RejectCode::Other,
            _ => return None,
        })
    }
}

/// Half-open range of segment indices `[start, start + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegRange {
    /// First segment index.
    pub start: u32,
    /// Number of segments (must be > 0 on the wire).
    pub len: u32,
}

impl SegRange {
    /// One past the last index. Saturates for an (invalid) overflowing range rather than
    /// wrapping, so a hand-built bad range cannot alias low indices.
    pub const fn end(&self) -> u32 {
        self.start.saturating_add(self.len)
    }

    /// Whether `index` lies in the range.
    pub const fn contains(&self, index: u32) -> bool {
        index >= self.start && index < self.end()
    }

    /// The fewest sorted, non-overlapping, non-adjacent ranges covering `indices` (any order,
    /// duplicates allowed): the canonical way to build a `RetransmitRequest`.
    pub fn coalesce<I: IntoIterator<Item = u32>>(indices: I) -> Vec<SegRange> {
        let mut idx: Vec<u32> = indices.into_iter().collect();
        idx.sort_unstable();
        idx.dedup();
        let mut out: Vec<SegRange> = Vec::new();
        for i in idx {
            match out.last_mut() {
                // Sorted and deduplicated, so `i >= end`; equal means adjacent. `end()` of a
                // range built here never overflows because `i` itself is a u32.
                Some(r) if r.end() == i => r.len += 1,
                _ => out.push(SegRange { start: i, len: 1 }),
            }
        }
        out
    }
}

/// Checks the wire rules for retransmit ranges: each non-empty and in bounds, sorted,
/// non-overlapping (adjacent is allowed), and few enough to fit in one body.
fn check_ranges(ranges: &[SegRange]) -> Result<(), CtrlError> {
    if ranges.len() > MAX_RANGES {
        let body = HEADER + 8 + ranges.len().saturating_mul(8);
        return Err(CtrlError::TooLarge(u32::try_from(body).unwrap_or(u32::MAX)));
    }
    let mut prev_end: u32 = 0;
    for r in ranges {
        let end = match r.start.checked_add(r.len) {
            Some(end) if r.len > 0 && r.start >= prev_end => end,
            _ => return Err(CtrlError::BadRanges),
        };
        prev_end = end;
    }
    Ok(())
}

/// A control-channel message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CtrlMsg {
    /// Sender -> receiver: open a tensor transfer (kind 1).
    FlowStart(FlowStart),
    /// Receiver -> sender: transfer accepted (kind 2).
    FlowAccept {
        /// Echoed from `FlowStart`.
        job_id: u32,
        /// Echoed from `FlowStart`.
        tensor_id: u32,
        /// Echoed from `FlowStart`.
        round: u32,
        /// The receiver's UDP port to send data to.
        data_port: u16,
    },
    /// Receiver -> sender: transfer refused (kind 3).
    FlowReject {
        /// Echoed from `FlowStart`.
        job_id: u32,
        /// Echoed from `FlowStart`.
        tensor_id: u32,
        /// Echoed from `FlowStart`.
        round: u32,
        /// Machine-readable cause.
        code: RejectCode,
        /// Human-readable cause, at most [`MAX_REASON`] bytes.
        reason: String,
    },
    /// Sender -> receiver: the sender finished pass `pass` (kind 4).
    FlowStop {
        /// Pass number (0 = first transmission).
        pass: u32,
        /// Segments sent in this pass.
        segments_sent: u32,
    },
    /// Receiver -> sender: resend these segments (kind 5), answering the `FlowStop` of pass
    /// `pass`; the sender sends them as pass `pass + 1`.
    RetransmitRequest {
        /// The pass whose `FlowStop` this answers (requests for other passes are stale).
        pass: u32,
        /// Missing segments; sorted, non-overlapping, non-empty ranges.
        ranges: Vec<SegRange>,
    },
    /// Receiver -> sender: the loss bound is met (kind 6).
    FlowFinish {
        /// Distinct segments received so far.
        received_segments: u32,
    },
    /// Sender -> receiver: acknowledges `FlowFinish`; no more data follows (kind 7).
    FinishConfirm,
    /// Receiver -> sender: what arrived in the last measurement period (kind 8).
    RateReport {
        /// Actual length of the period in nanoseconds.
        period_ns: u64,
        /// Data bytes received.
        bytes: u64,
        /// Data packets received.
        packets: u64,
        /// Of those, packets marked ECN CE.
        ce_packets: u64,
    },
    /// Receiver -> sender: per switch queue (from each packet's DSCP), the data packets of
    /// this flow received so far and how many a switch marked CE (kind 10). Cumulative; sent
    /// every few rate reports and right before `FlowFinish`.
    EcnReport {
        /// Indexed by queue 0..=7.
        queues: [QueueEcn; ECN_QUEUES],
    },
    /// Receiver -> sender: the rate this flow may send at, its share of the receiver's
    /// capacity (kind 11). Sent right after `FlowAccept` and whenever the share changes; a
    /// sender in grant mode paces at it, retransmission passes included.
    RateGrant {
        /// Granted rate in bit/s (at least 1).
        rate_bps: u64,
    },
    /// Client -> server: the first message on every control connection (kind 12). `auth`:
    /// the client holds the job secret and will prove it.
    Hello {
        /// The client wants (and will accept only) an authenticated connection.
        auth: bool,
        /// Fresh random nonce of the client.
        nonce: [u8; HANDSHAKE_NONCE_LEN],
        /// The client's ephemeral X25519 public key (all zeros in a plain `Hello`).
        public: [u8; HANDSHAKE_PUBLIC_LEN],
    },
    /// Server -> client, authenticated jobs only (kind 13): the server's nonce and ephemeral
    /// public key. No proof yet: the server proves the secret only to a client that did, so
    /// a stranger at the control port learns nothing to test guesses of the secret against.
    Challenge {
        /// Fresh random nonce of the server.
        nonce: [u8; HANDSHAKE_NONCE_LEN],
        /// The server's ephemeral X25519 public key.
        public: [u8; HANDSHAKE_PUBLIC_LEN],
    },
    /// Client -> server, authenticated jobs only (kind 14): the client's proof of the secret.
    Proof {
        /// `JobKey::client_proof(transcript)`.
        proof: [u8; HANDSHAKE_PROOF_LEN],
    },
    /// Server -> client: the handshake is complete (kind 15); from here on flows may start.
    /// With `auth`, this is the first sealed frame and carries the server's proof.
    Welcome {
        /// The connection is authenticated (every later frame is sealed).
        auth: bool,
        /// `JobKey::server_proof(transcript)` (all zeros in a plain `Welcome`).
        proof: [u8; HANDSHAKE_PROOF_LEN],
    },
    /// Either side gives up on the flow (kind 9).
    Abort {
        /// Application-defined code.
        code: u8,
        /// Human-readable cause, at most [`MAX_REASON`] bytes.
        reason: String,
    },
}

impl CtrlMsg {
    /// The message's kind byte.
    pub const fn kind(&self) -> u8 {
        match self {
            CtrlMsg::FlowStart(_) => kind::FLOW_START,
            CtrlMsg::FlowAccept { .. } => kind::FLOW_ACCEPT,
            CtrlMsg::FlowReject { .. } => kind::FLOW_REJECT,
            CtrlMsg::FlowStop { .. } => kind::FLOW_STOP,
            CtrlMsg::RetransmitRequest { .. } => kind::RETRANSMIT_REQUEST,
            CtrlMsg::FlowFinish { .. } => kind::FLOW_FINISH,
            CtrlMsg::FinishConfirm => kind::FINISH_CONFIRM,
            CtrlMsg::RateReport { .. } => kind::RATE_REPORT,
            CtrlMsg::Abort { .. } => kind::ABORT,
            CtrlMsg::EcnReport { .. } => kind::ECN_REPORT,
            CtrlMsg::RateGrant { .. } => kind::RATE_GRANT,
            CtrlMsg::Hello { .. } => kind::HELLO,
            CtrlMsg::Challenge { .. } => kind::CHALLENGE,
            CtrlMsg::Proof { .. } => kind::PROOF,
            CtrlMsg::Welcome { .. } => kind::WELCOME,
        }
    }

    /// Checks that the message can be encoded (string lengths, range rules, body size).
    pub fn validate(&self) -> Result<(), CtrlError> {
        match self {
            CtrlMsg::FlowReject { reason, .. } | CtrlMsg::Abort { reason, .. }
                if reason.len() > MAX_REASON =>
            {
                Err(CtrlError::ReasonTooLong(reason.len()))
            }
            CtrlMsg::RetransmitRequest { ranges, .. } => check_ranges(ranges),
            CtrlMsg::RateGrant { rate_bps: 0 } => Err(CtrlError::ZeroGrant),
            CtrlMsg::FlowStart(f) if f.priority > MAX_PRIORITY => {
                Err(CtrlError::BadPriority(f.priority))
            }
            CtrlMsg::FlowStart(f)
                if f.sources.is_empty()
                    || f.sources.len() > MAX_SOURCES
                    || !f.sources.iter().all(DataSource::is_valid) =>
            {
                Err(CtrlError::BadSources)
            }
            _ => Ok(()),
        }
    }

    /// Body length in bytes (version and kind included, length prefix excluded).
    /// Meaningful only for messages that pass [`Self::validate`].
    pub fn body_len(&self) -> usize {
        HEADER
            + match self {
                CtrlMsg::FlowStart(f) => {
                    FlowStart::FIELDS_LEN
                        + f.sources.iter().map(DataSource::wire_len).sum::<usize>()
                }
                CtrlMsg::FlowAccept { .. } => 4 + 4 + 4 + 2,
                CtrlMsg::FlowReject { reason, .. } => 4 + 4 + 4 + 1 + 2 + reason.len(),
                CtrlMsg::FlowStop { .. } => 4 + 4,
                CtrlMsg::RetransmitRequest { ranges, .. } => 4 + 4 + ranges.len().saturating_mul(8),
                CtrlMsg::FlowFinish { .. } => 4,
                CtrlMsg::FinishConfirm => 0,
                CtrlMsg::RateReport { .. } => 8 * 4,
                CtrlMsg::Abort { reason, .. } => 1 + 2 + reason.len(),
                CtrlMsg::EcnReport { .. } => ECN_QUEUES * 8,
                CtrlMsg::RateGrant { .. } => 8,
                CtrlMsg::Hello { .. } => 1 + HANDSHAKE_NONCE_LEN + HANDSHAKE_PUBLIC_LEN,
                CtrlMsg::Challenge { .. } => HANDSHAKE_NONCE_LEN + HANDSHAKE_PUBLIC_LEN,
                CtrlMsg::Proof { .. } => HANDSHAKE_PROOF_LEN,
                CtrlMsg::Welcome { .. } => 1 + HANDSHAKE_PROOF_LEN,
            }
    }

    /// Appends the length prefix and body to `out`.
    ///
    /// Fails (leaving `out` untouched) only for messages the wire cannot carry: a reason over
    /// [`MAX_REASON`] bytes or retransmit ranges breaking the rules of [`SegRange`]. This is
    /// what makes `decode_body(encode(m)) == m` hold for every message that encodes.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), CtrlError> {
        self.validate()?;
        let body_len = self.body_len();
        // validate() bounds every variable part, so this cannot fail; kept as a check.
        let prefix = u32::try_from(body_len)
            .ok()
            .filter(|&n| n <= MAX_BODY)
            .ok_or(CtrlError::TooLarge(u32::MAX))?;
        out.reserve(LEN_PREFIX + body_len);
        out.extend_from_slice(&prefix.to_be_bytes());
        out.push(VERSION);
        out.push(self.kind());
        match self {
            CtrlMsg::FlowStart(f) => {
                out.extend_from_slice(&f.job_id.to_be_bytes());
                out.extend_from_slice(&f.tensor_id.to_be_bytes());
                out.extend_from_slice(&f.round.to_be_bytes());
                out.extend_from_slice(&f.layer.to_be_bytes());
                out.push(f.dtype_code);
                out.extend_from_slice(&f.size_bytes.to_be_bytes());
                out.extend_from_slice(&f.segment_payload.to_be_bytes());
                out.extend_from_slice(&f.segment_count.to_be_bytes());
                out.extend_from_slice(&f.loss_bound.ppm().to_be_bytes());
                // validate() capped the priority at MAX_PRIORITY.
                out.push(
                    match f.stage {
                        Stage::Push => 0,
                        Stage::Pull => FLAG_PULL,
                    } | (f.priority << PRIORITY_SHIFT),
                );
                out.extend_from_slice(&f.flow_nonce);
                // validate() capped the count at MAX_SOURCES.
                out.push(f.sources.len() as u8);
                for src in &f.sources {
                    match src.addr {
                        std::net::IpAddr::V4(a) => {
                            out.push(4);
                            out.extend_from_slice(&a.octets());
                        }
                        std::net::IpAddr::V6(a) => {
                            out.push(6);
                            out.extend_from_slice(&a.octets());
                        }
                    }
                    out.extend_from_slice(&src.port.to_be_bytes());
                    out.extend_from_slice(&src.ports.to_be_bytes());
                }
            }
            CtrlMsg::FlowAccept {
                job_id,
                tensor_id,
                round,
                data_port,
            } => {
                out.extend_from_slice(&job_id.to_be_bytes());
                out.extend_from_slice(&tensor_id.to_be_bytes());
                out.extend_from_slice(&round.to_be_bytes());
                out.extend_from_slice(&data_port.to_be_bytes());
            }
            CtrlMsg::FlowReject {
                job_id,
                tensor_id,
                round,
                code,
                reason,
            } => {
                out.extend_from_slice(&job_id.to_be_bytes());
                out.extend_from_slice(&tensor_id.to_be_bytes());
                out.extend_from_slice(&round.to_be_bytes());
                out.push(code.code());
                put_str(out, reason);
            }
            CtrlMsg::FlowStop {
                pass,
                segments_sent,
            } => {
                out.extend_from_slice(&pass.to_be_bytes());
                out.extend_from_slice(&segments_sent.to_be_bytes());
            }
            CtrlMsg::RetransmitRequest { pass, ranges } => {
                out.extend_from_slice(&pass.to_be_bytes());
                // validate() capped the count at MAX_RANGES, so it fits in u32.
                let count = u32::try_from(ranges.len()).unwrap_or(u32::MAX);
                out.extend_from_slice(&count.to_be_bytes());
                for r in ranges {
                    out.extend_from_slice(&r.start.to_be_bytes());
                    out.extend_from_slice(&r.len.to_be_bytes());
                }
            }
            CtrlMsg::FlowFinish { received_segments } => {
                out.extend_from_slice(&received_segments.to_be_bytes());
            }
            CtrlMsg::FinishConfirm => {}
            CtrlMsg::RateReport {
                period_ns,
                bytes,
                packets,
                ce_packets,
            } => {
                out.extend_from_slice(&period_ns.to_be_bytes());
                out.extend_from_slice(&bytes.to_be_bytes());
                out.extend_from_slice(&packets.to_be_bytes());
                out.extend_from_slice(&ce_packets.to_be_bytes());
            }
            CtrlMsg::EcnReport { queues } => {
                for q in queues {
                    out.extend_from_slice(&q.packets.to_be_bytes());
                    out.extend_from_slice(&q.ce.to_be_bytes());
                }
            }
            CtrlMsg::Abort { code, reason } => {
                out.push(*code);
                put_str(out, reason);
            }
            CtrlMsg::RateGrant { rate_bps } => out.extend_from_slice(&rate_bps.to_be_bytes()),
            CtrlMsg::Hello {
                auth,
                nonce,
                public,
            } => {
                out.push(u8::from(*auth));
                out.extend_from_slice(nonce);
                out.extend_from_slice(public);
            }
            CtrlMsg::Challenge { nonce, public } => {
                out.extend_from_slice(nonce);
                out.extend_from_slice(public);
            }
            CtrlMsg::Proof { proof } => out.extend_from_slice(proof),
            CtrlMsg::Welcome { auth, proof } => {
                out.push(u8::from(*auth));
                out.extend_from_slice(proof);
            }
        }
        Ok(())
    }

    /// Convenience: the whole frame (prefix + body) in a fresh buffer.
    pub fn to_frame(&self) -> Result<Vec<u8>, CtrlError> {
        let mut out = Vec::with_capacity(LEN_PREFIX + self.body_len());
        self.encode(&mut out)?;
        Ok(out)
    }

    /// Decodes one body (the bytes after the length prefix). Rejects anything `encode` would
    /// not produce, including trailing bytes.
    pub fn decode_body(body: &[u8]) -> Result<CtrlMsg, CtrlError> {
        if body.len() > MAX_BODY as usize {
            return Err(CtrlError::TooLarge(
                u32::try_from(body.len()).unwrap_or(u32::MAX),
            ));
        }
        let mut r = Reader { rest: body };
        let version = r.u8()?;
        if version != VERSION {
            return Err(CtrlError::BadVersion(version));
        }
        let kind = r.u8()?;
        let msg = match kind {
            kind::FLOW_START => {
                let job_id = r.u32()?;
                let tensor_id = r.u32()?;
                let round = r.u32()?;
                let layer = r.u16()?;
                let dtype_code = r.u8()?;
                let size_bytes = r.u64()?;
                let segment_payload = r.u32()?;
                let segment_count = r.u32()?;
                let loss_bound = LossBound::from_ppm(r.u32()?)?;
                let flags = r.u8()?;
                // Bit 0: the stage; bits 1-3: the priority; the rest reserved.
                if flags >> (PRIORITY_SHIFT + 3) != 0 {
                    return Err(CtrlError::BadFlags(flags));
                }
                let stage = if flags & FLAG_PULL != 0 {
                    Stage::Pull
                } else {
                    Stage::Push
                };
                let priority = (flags >> PRIORITY_SHIFT) & MAX_PRIORITY;
                let flow_nonce = r.array()?;
                let count = usize::from(r.u8()?);
                if count == 0 || count > MAX_SOURCES {
                    return Err(CtrlError::BadSources);
                }
                let mut sources = Vec::with_capacity(count);
                for _ in 0..count {
                    let addr = match r.u8()? {
                        4 => std::net::IpAddr::from(r.array::<4>()?),
                        6 => std::net::IpAddr::from(r.array::<16>()?),
                        _ => return Err(CtrlError::BadSources),
                    };
                    let src = DataSource {
                        addr,
                        port: r.u16()?,
                        ports: r.u16()?,
                    };
                    if !src.is_valid() {
                        return Err(CtrlError::BadSources);
                    }
                    sources.push(src);
                }
                CtrlMsg::FlowStart(FlowStart {
                    job_id,
                    tensor_id,
                    round,
                    layer,
                    dtype_code,
                    size_bytes,
                    segment_payload,
                    segment_count,
                    loss_bound,
                    stage,
                    priority,
                    flow_nonce,
                    sources,
                })
            }
            kind::FLOW_ACCEPT => CtrlMsg::FlowAccept {
                job_id: r.u32()?,
                tensor_id: r.u32()?,
                round: r.u32()?,
                data_port: r.u16()?,
            },
            kind::FLOW_REJECT => {
                let job_id = r.u32()?;
                let tensor_id = r.u32()?;
                let round = r.u32()?;
                let raw = r.u8()?;
                let code = RejectCode::from_code(raw).ok_or(CtrlError::BadRejectCode(raw))?;
                CtrlMsg::FlowReject {
                    job_id,
                    tensor_id,
                    round,
                    code,
                    reason: r.string()?,
                }
            }
            kind::FLOW_STOP => CtrlMsg::FlowStop {
                pass: r.u32()?,
                segments_sent: r.u32()?,
            },
            kind::RETRANSMIT_REQUEST => {
                let pass = r.u32()?;
                let count = r.u32()? as usize;
                // Refuse a count the remaining bytes cannot hold before allocating for it.
                if count > r.rest.len() / 8 {
                    return Err(CtrlError::Truncated);
                }
                let mut ranges = Vec::with_capacity(count);
                for _ in 0..count {
                    ranges.push(SegRange {
                        start: r.u32()?,
                        len: r.u32()?,
                    });
                }
                check_ranges(&ranges)?;
                CtrlMsg::RetransmitRequest { pass, ranges }
            }
            kind::FLOW_FINISH => CtrlMsg::FlowFinish {
                received_segments: r.u32()?,
            },
            kind::FINISH_CONFIRM => CtrlMsg::FinishConfirm,
            kind::RATE_REPORT => CtrlMsg::RateReport {
                period_ns: r.u64()?,
                bytes: r.u64()?,
                packets: r.u64()?,
                ce_packets: r.u64()?,
            },
            kind::ABORT => CtrlMsg::Abort {
                code: r.u8()?,
                reason: r.string()?,
            },
            kind::ECN_REPORT => {
                let mut queues = [QueueEcn::default(); ECN_QUEUES];
                for q in &mut queues {
                    q.packets = r.u32()?;
                    q.ce = r.u32()?;
                }
                CtrlMsg::EcnReport { queues }
            }
            kind::RATE_GRANT => match r.u64()? {
                0 => return Err(CtrlError::ZeroGrant),
                rate_bps => CtrlMsg::RateGrant { rate_bps },
            },
            kind::HELLO => CtrlMsg::Hello {
                auth: r.flag()?,
                nonce: r.array()?,
                public: r.array()?,
            },
            kind::CHALLENGE => CtrlMsg::Challenge {
                nonce: r.array()?,
                public: r.array()?,
            },
            kind::PROOF => CtrlMsg::Proof { proof: r.array()? },
            kind::WELCOME => CtrlMsg::Welcome {
                auth: r.flag()?,
                proof: r.array()?,
            },
            other => return Err(CtrlError::UnknownKind(other)),
        };
        if !r.rest.is_empty() {
            return Err(CtrlError::TrailingBytes(r.rest.len()));
        }
        Ok(msg)
    }
}

/// Writes a `u16`-length-prefixed string; callers have checked `s.len() <= MAX_REASON`.
fn put_str(out: &mut Vec<u8>, s: &str) {
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Bounds-checked big-endian cursor over a body.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn array<const N: usize>(&mut self) -> Result<[u8; N], CtrlError> {
        let (head, tail) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or(CtrlError::Truncated)?;
        self.rest = tail;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, CtrlError> {
        Ok(u8::from_be_bytes(self.array()?))
    }

    /// A flags byte whose only defined bit is bit 0.
    fn flag(&mut self) -> Result<bool, CtrlError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(CtrlError::BadFlags(other)),
        }
    }

    fn u16(&mut self) -> Result<u16, CtrlError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, CtrlError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, CtrlError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], CtrlError> {
        let (head, tail) = self.rest.split_at_checked(n).ok_or(CtrlError::Truncated)?;
        self.rest = tail;
        Ok(head)
    }

    fn string(&mut self) -> Result<String, CtrlError> {
        let len = usize::from(self.u16()?);
        if len > MAX_REASON {
            return Err(CtrlError::ReasonTooLong(len));
        }
        let raw = self.bytes(len)?;
        let s = std::str::from_utf8(raw).map_err(|_| CtrlError::BadUtf8)?;
        Ok(s.to_owned())
    }
}

/// Incremental framer for the control byte stream: push bytes as they arrive, pull whole
/// messages out.
///
/// Errors: [`CtrlError::TooLarge`] for an announced length over [`MAX_BODY`] is reported as
/// soon as the 4-byte prefix is buffered and is sticky (the stream cannot be resynchronised,
/// so the frame is not consumed and every later `next` repeats it); so is
/// [`CtrlError::BadSeal`]. Any other error is a bad body in an intact frame: that frame is
/// consumed, so the caller may choose to continue, though the protocol's answer to either is
/// normally `Abort` and close.
///
/// On an authenticated connection every frame is followed by a tag (the seal):
/// [`Decoder::set_trailer`] says how long, and [`Decoder::next_checked`] hands each frame and
/// its tag to the caller's check before the body is decoded.
#[derive(Debug, Clone, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Start of unconsumed bytes in `buf`; consumed bytes are dropped lazily on `push` so a
    /// burst of small messages costs O(bytes), not O(bytes x messages).
    start: usize,
    /// Bytes of seal after every frame (0: none).
    trailer: usize,
    /// A seal failed: nothing after it is trusted.
    bad_seal: bool,
}

impl Decoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// From the next frame on, every frame is followed by `len` bytes of seal.
    pub fn set_trailer(&mut self, len: usize) {
        self.trailer = len;
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered but not yet returned as messages.
    pub fn buffered(&self) -> usize {
        self.buf.len().saturating_sub(self.start)
    }

    /// The next whole message, `Ok(None)` if more bytes are needed.
    // Not an Iterator: the item is fallible and `None` means "not yet", not "finished".
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<CtrlMsg>, CtrlError> {
        self.next_checked(|_, _| true)
    }

    /// The next whole message, after `check(frame, seal)` accepted the frame (length prefix
    /// and body) and the [`Decoder::set_trailer`] bytes after it. A refused frame is
    /// [`CtrlError::BadSeal`], sticky like an oversized length.
    pub fn next_checked(
        &mut self,
        check: impl FnOnce(&[u8], &[u8]) -> bool,
    ) -> Result<Option<CtrlMsg>, CtrlError> {
        if self.bad_seal {
            return Err(CtrlError::BadSeal);
        }
        let avail = self.buf.get(self.start..).unwrap_or_default();
        let Some(prefix) = avail.first_chunk::<LEN_PREFIX>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*prefix);
        if len > MAX_BODY {
            return Err(CtrlError::TooLarge(len));
        }
        // len <= 1 MiB, so this neither overflows nor truncates.
        let frame_len = LEN_PREFIX + len as usize;
        let Some(sealed) = avail.get(..frame_len + self.trailer) else {
            return Ok(None);
        };
        let (frame, seal) = sealed.split_at(frame_len);
        if !check(frame, seal) {
            self.bad_seal = true;
            return Err(CtrlError::BadSeal);
        }
        let res = CtrlMsg::decode_body(&frame[LEN_PREFIX..]);
        self.start += frame_len + self.trailer;
        if self.start >= self.buf.len() {
            // Everything consumed: reset cheaply instead of draining later.
            self.buf.clear();
            self.start = 0;
        }
        res.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_start() -> FlowStart {
        FlowStart {
            job_id: 0x0102_0304,
            tensor_id: 7,
            round: 42,
            layer: 3,
            dtype_code: 1,
            size_bytes: 10_000,
            segment_payload: 1024,
            segment_count: 10,
            loss_bound: LossBound::from_ppm(50_000).unwrap(),
            stage: Stage::Pull,
            priority: 0,
            flow_nonce: std::array::from_fn(|i| i as u8 + 1),
            sources: vec![DataSource {
                addr: std::net::IpAddr::from([198, 18, 0, 2]),
                port: 4791,
                ports: 1,
            }],
        }
    }

    fn samples() -> Vec<CtrlMsg> {
        vec![
            CtrlMsg::FlowStart(sample_start()),
            CtrlMsg::FlowStart(FlowStart {
                stage: Stage::Push,
                loss_bound: LossBound::RELIABLE,
                sources: vec![
                    DataSource {
                        addr: std::net::IpAddr::from([0u8; 16]),
                        port: 7000,
                        ports: 8,
                    },
                    DataSource {
                        addr: "2001:db8::1".parse().unwrap(),
                        port: 65535,
                        ports: 1,
                    },
                ],
                ..sample_start()
            }),
            CtrlMsg::FlowAccept {
                job_id: 1,
                tensor_id: 2,
                round: 3,
                data_port: 40000,
            },
            CtrlMsg::FlowReject {
                job_id: 1,
                tensor_id: 2,
                round: 3,
                code: RejectCode::SizeMismatch,
                reason: "size 10 != 12 ✓".into(),
            },
            CtrlMsg::FlowStop {
                pass: 0,
                segments_sent: 10,
            },
            CtrlMsg::RetransmitRequest {
                pass: 1,
                ranges: vec![SegRange { start: 0, len: 2 }, SegRange { start: 2, len: 1 }],
            },
            CtrlMsg::RetransmitRequest {
                pass: 2,
                ranges: vec![],
            },
            CtrlMsg::FlowFinish {
                received_segments: 9,
            },
            CtrlMsg::FinishConfirm,
            CtrlMsg::RateReport {
                period_ns: 200_000,
                bytes: u64::MAX,
                packets: 3,
                ce_packets: 1,
            },
            CtrlMsg::Abort {
                code: 9,
                reason: String::new(),
            },
            CtrlMsg::EcnReport {
                queues: std::array::from_fn(|q| QueueEcn {
                    packets: 1000 * q as u32,
                    ce: if q == 7 { u32::MAX } else { q as u32 },
                }),
            },
            CtrlMsg::RateGrant {
                rate_bps: 12_500_000,
            },
            CtrlMsg::Hello {
                auth: true,
                nonce: [7; HANDSHAKE_NONCE_LEN],
                public: [8; HANDSHAKE_PUBLIC_LEN],
            },
            CtrlMsg::Challenge {
                nonce: [1; HANDSHAKE_NONCE_LEN],
                public: [2; HANDSHAKE_PUBLIC_LEN],
            },
            CtrlMsg::Proof {
                proof: [3; HANDSHAKE_PROOF_LEN],
            },
            CtrlMsg::Welcome {
                auth: false,
                proof: [0; HANDSHAKE_PROOF_LEN],
            },
        ]
    }

    fn body_of(m: &CtrlMsg) -> Vec<u8> {
        let frame = m.to_frame().unwrap();
        assert_eq!(frame.len(), LEN_PREFIX + m.body_len());
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4);
        frame[4..].to_vec()
    }

    #[test]
    fn round_trip_every_message() {
        for m in samples() {
            let body = body_of(&m);
            assert_eq!(body[0], VERSION);
            assert_eq!(body[1], m.kind());
            assert_eq!(CtrlMsg::decode_body(&body).unwrap(), m, "{m:?}");
        }
    }

    #[test]
    fn flow_start_layout_is_byte_exact() {
        let body = body_of(&CtrlMsg::FlowStart(sample_start()));
        let expect: Vec<u8> = [
            &[VERSION, 1][..],
            &[1, 2, 3, 4],
            &[0, 0, 0, 7],
            &[0, 0, 0, 42],
            &[0, 3],
            &[1],
            &10_000u64.to_be_bytes(),
            &[0, 0, 4, 0],
            &[0, 0, 0, 10],
            &50_000u32.to_be_bytes(),
            &[1],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            &[1],
            &[4, 198, 18, 0, 2],
            &4791u16.to_be_bytes(),
            &[0, 1],
        ]
        .concat();
        assert_eq!(body, expect);
        assert_eq!(body.len(), 64);
    }

    #[test]
    fn rate_grant_layout_is_byte_exact_and_never_zero() {
        let body = body_of(&CtrlMsg::RateGrant {
            rate_bps: 0x0102_0304_0506_0708,
        });
        assert_eq!(body, [VERSION, 11, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            CtrlMsg::decode_body(&[VERSION, 11, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(CtrlError::ZeroGrant)
        );
        assert_eq!(
            CtrlMsg::RateGrant { rate_bps: 0 }.to_frame(),
            Err(CtrlError::ZeroGrant)
        );
    }

    #[test]
    fn body_sizes() {
        let lens: Vec<usize> = samples().iter().map(|m| body_of(m).len()).collect();
        let reason = "size 10 != 12 ✓".len();
        assert_eq!(
            lens,
            vec![
                64,
                97,
                16,
                17 + reason,
                10,
                26,
                10,
                6,
                2,
                34,
                5,
                66,
                10,
                67,
                66,
                34,
                35
            ]
        );
    }

    #[test]
    fn error_truncated() {
        for m in samples() {
            let body = body_of(&m);
            for cut in 0..body.len() {
                assert_eq!(
                    CtrlMsg::decode_body(&body[..cut]),
                    Err(CtrlError::Truncated),
                    "{m:?} cut {cut}"
                );
            }
        }
        // A range count the body cannot hold is refused before allocating.
        let mut b = vec![VERSION, kind::RETRANSMIT_REQUEST, 0, 0, 0, 0];
        b.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::Truncated));
    }

    #[test]
    fn error_version_kind_trailing() {
        // Older peers (version 1: before the handshake and data sources; version 2: before
        // the priority) and newer ones are refused by version.
        assert_eq!(CtrlMsg::decode_body(&[1, 7]), Err(CtrlError::BadVersion(1)));
        assert_eq!(CtrlMsg::decode_body(&[2, 7]), Err(CtrlError::BadVersion(2)));
        assert_eq!(CtrlMsg::decode_body(&[4, 7]), Err(CtrlError::BadVersion(4)));
        assert_eq!(
            CtrlMsg::decode_body(&[VERSION, 0]),
            Err(CtrlError::UnknownKind(0))
        );
        assert_eq!(
            CtrlMsg::decode_body(&[VERSION, 16]),
            Err(CtrlError::UnknownKind(16))
        );
        assert_eq!(
            CtrlMsg::decode_body(&[VERSION, 7, 0]),
            Err(CtrlError::TrailingBytes(1))
        );
        let mut b = body_of(&CtrlMsg::FlowStop {
            pass: 1,
            segments_sent: 2,
        });
        b.extend_from_slice(&[0, 0, 0]);
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::TrailingBytes(3)));
    }

    #[test]
    fn error_loss_bound_and_flags() {
        let mut b = body_of(&CtrlMsg::FlowStart(sample_start()));
        b[33..37].copy_from_slice(&1_000_001u32.to_be_bytes());
        assert_eq!(
            CtrlMsg::decode_body(&b),
            Err(CtrlError::BadLossBound(1_000_001))
        );
        b[33..37].copy_from_slice(&1_000_000u32.to_be_bytes());
        assert!(CtrlMsg::decode_body(&b).is_ok());
        // Bit 0 the stage, bits 1-3 the priority (here 5), the rest reserved.
        b[37] = 0x0b;
        match CtrlMsg::decode_body(&b) {
            Ok(CtrlMsg::FlowStart(f)) => {
                assert_eq!((f.stage, f.priority), (Stage::Pull, 5));
            }
            other => panic!("{other:?}"),
        }
        b[37] = 0x10;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadFlags(0x10)));
        b[37] = 0x80;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadFlags(0x80)));
        let mut f = sample_start();
        f.priority = 8;
        assert_eq!(
            CtrlMsg::FlowStart(f).validate(),
            Err(CtrlError::BadPriority(8))
        );
        let mut h = body_of(&CtrlMsg::Hello {
            auth: false,
            nonce: [0; HANDSHAKE_NONCE_LEN],
            public: [0; HANDSHAKE_PUBLIC_LEN],
        });
        h[2] = 2;
        assert_eq!(CtrlMsg::decode_body(&h), Err(CtrlError::BadFlags(2)));
    }

    #[test]
    fn error_sources() {
        let ok = body_of(&CtrlMsg::FlowStart(sample_start()));
        // Byte 54 is the source count, 55 the family, 56..60 the address, 60..62 the port,
        // 62..64 the number of ports.
        let mut b = ok.clone();
        b[54] = 0;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadSources));
        let mut b = ok.clone();
        b[54] = MAX_SOURCES as u8 + 1;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadSources));
        let mut b = ok.clone();
        b[55] = 5;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadSources));
        let mut b = ok.clone();
        b[62..64].copy_from_slice(&0u16.to_be_bytes());
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadSources));
        let mut b = ok;
        b[60..62].copy_from_slice(&65535u16.to_be_bytes());
        b[62..64].copy_from_slice(&2u16.to_be_bytes());
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadSources));
        for sources in [
            vec![],
            vec![DataSource::single("198.18.0.1:1".parse().unwrap()); MAX_SOURCES + 1],
            vec![DataSource {
                addr: std::net::IpAddr::from([198, 18, 0, 1]),
                port: 65535,
                ports: 2,
            }],
        ] {
            let m = CtrlMsg::FlowStart(FlowStart {
                sources,
                ..sample_start()
            });
            assert_eq!(m.to_frame(), Err(CtrlError::BadSources));
        }
    }

    #[test]
    fn sealed_frames_are_checked_before_decoding_and_a_bad_seal_is_sticky() {
        let msgs = [
            CtrlMsg::FinishConfirm,
            CtrlMsg::FlowFinish {
                received_segments: 4,
            },
        ];
        let mut stream = Vec::new();
        for m in &msgs {
            let frame = m.to_frame().unwrap();
            stream.extend_from_slice(&frame);
            // A stand-in seal: the frame's length byte repeated (the real one is an HMAC).
            stream.extend_from_slice(&[frame[3]; 4]);
        }
        let mut d = Decoder::new();
        d.set_trailer(4);
        d.push(&stream[..stream.len() - 1]);
        let check = |frame: &[u8], seal: &[u8]| seal.iter().all(|&b| b == frame[3]);
        assert_eq!(d.next_checked(check), Ok(Some(msgs[0].clone())));
        assert_eq!(d.next_checked(check), Ok(None), "seal not complete yet");
        d.push(&stream[stream.len() - 1..]);
        assert_eq!(d.next_checked(check), Ok(Some(msgs[1].clone())));
        d.push(&stream);
        assert_eq!(d.next_checked(|_, _| false), Err(CtrlError::BadSeal));
        assert_eq!(d.next_checked(check), Err(CtrlError::BadSeal), "sticky");
    }

    #[test]
    fn error_reject_code_utf8_reason_len() {
        let m = CtrlMsg::FlowReject {
            job_id: 1,
            tensor_id: 2,
            round: 3,
            code: RejectCode::Busy,
            reason: "ab".into(),
        };
        let mut b = body_of(&m);
        b[14] = 6;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadRejectCode(6)));
        b[14] = 255;
        assert!(matches!(
            CtrlMsg::decode_body(&b),
            Ok(CtrlMsg::FlowReject {
                code: RejectCode::Other,
                ..
            })
        ));
        b[17] = 0xff;
        assert_eq!(CtrlMsg::decode_body(&b), Err(CtrlError::BadUtf8));

        let mut b = vec![VERSION, kind::ABORT, 0];
        b.extend_from_slice(&1025u16.to_be_bytes());
        b.extend_from_slice(&[b'x'; 1025]);
        assert_eq!(
            CtrlMsg::decode_body(&b),
            Err(CtrlError::ReasonTooLong(1025))
        );
    }

    #[test]
    fn reject_codes_round_trip() {
        for c in 0..=255u8 {
            if let Some(rc) = RejectCode::from_code(c) {
                assert_eq!(rc.code(), c);
            }
        }
        assert_eq!(
            (0..=255u8)
                .filter(|&c| RejectCode::from_code(c).is_some())
                .count(),
            6
        );
    }

    #[test]
    fn encode_refuses_unencodable() {
        let mut out = vec![9];
        let long = CtrlMsg::Abort {
            code: 1,
            reason: "é".repeat(513),
        };
        assert_eq!(long.encode(&mut out), Err(CtrlError::ReasonTooLong(1026)));
        let ok = CtrlMsg::Abort {
            code: 1,
            reason: "x".repeat(MAX_REASON),
        };
        assert!(ok.encode(&mut Vec::new()).is_ok());
        let bad_ranges = [
            vec![SegRange { start: 0, len: 0 }],
            vec![SegRange {
                start: u32::MAX,
                len: 1,
            }],
            vec![SegRange { start: 5, len: 1 }, SegRange { start: 1, len: 1 }],
            vec![SegRange { start: 0, len: 3 }, SegRange { start: 2, len: 1 }],
        ];
        for ranges in bad_ranges {
            let m = CtrlMsg::RetransmitRequest { pass: 0, ranges };
            assert_eq!(m.encode(&mut out), Err(CtrlError::BadRanges));
        }
        let edge = CtrlMsg::RetransmitRequest {
            pass: 0,
            ranges: vec![SegRange {
                start: u32::MAX - 1,
                len: 1,
            }],
        };
        assert_eq!(CtrlMsg::decode_body(&body_of(&edge)).unwrap(), edge);
        let too_many = CtrlMsg::RetransmitRequest {
            pass: 0,
            ranges: (0..=MAX_RANGES as u32)
                .map(|i| SegRange { start: i, len: 1 })
                .collect(),
        };
        assert!(matches!(
            too_many.encode(&mut out),
            Err(CtrlError::TooLarge(_))
        ));
        assert_eq!(out, vec![9], "failed encodes leave the buffer alone");
        let max = CtrlMsg::RetransmitRequest {
            pass: 0,
            ranges: (0..MAX_RANGES as u32)
                .map(|i| SegRange { start: i, len: 1 })
                .collect(),
        };
        let frame = max.to_frame().unwrap();
        assert!(frame.len() - 4 <= MAX_BODY as usize);
        let mut d = Decoder::new();
        d.push(&frame);
        assert_eq!(d.next().unwrap(), Some(max));
    }

    #[test]
    fn error_bad_ranges_on_decode() {
        let enc = |pairs: &[(u32, u32)]| {
            let mut b = vec![VERSION, kind::RETRANSMIT_REQUEST, 0, 0, 0, 1];
            b.extend_from_slice(&(pairs.len() as u32).to_be_bytes());
            for (s, l) in pairs {
                b.extend_from_slice(&s.to_be_bytes());
                b.extend_from_slice(&l.to_be_bytes());
            }
            b
        };
        for bad in [
            &[(0, 0)][..],
            &[(u32::MAX, 2)],
            &[(4, 2), (5, 1)],
            &[(4, 2), (0, 1)],
            &[(1, 1), (1, 1)],
        ] {
            assert_eq!(CtrlMsg::decode_body(&enc(bad)), Err(CtrlError::BadRanges));
        }
        assert!(CtrlMsg::decode_body(&enc(&[(0, 2), (2, 2), (9, 1)])).is_ok());
    }

    #[test]
    fn error_too_large() {
        let mut d = Decoder::new();
        d.push(&(MAX_BODY + 1).to_be_bytes());
        assert_eq!(d.next(), Err(CtrlError::TooLarge(MAX_BODY + 1)));
        // Sticky: the stream cannot be resynchronised.
        d.push(&[0; 16]);
        assert_eq!(d.next(), Err(CtrlError::TooLarge(MAX_BODY + 1)));
        let big = vec![0u8; MAX_BODY as usize + 1];
        assert_eq!(
            CtrlMsg::decode_body(&big),
            Err(CtrlError::TooLarge(MAX_BODY + 1))
        );
    }

    #[test]
    fn decoder_byte_at_a_time_and_bad_frame_skipped() {
        let mut stream = Vec::new();
        for m in samples() {
            m.encode(&mut stream).unwrap();
        }
        // A well-framed but bad body between valid ones.
        stream.extend_from_slice(&[0, 0, 0, 2, 9, 9]);
        CtrlMsg::FinishConfirm.encode(&mut stream).unwrap();
        let mut d = Decoder::new();
        let mut got = Vec::new();
        let mut errs = Vec::new();
        for b in &stream {
            d.push(std::slice::from_ref(b));
            loop {
                match d.next() {
                    Ok(Some(m)) => got.push(m),
                    Ok(None) => break,
                    Err(e) => errs.push(e),
                }
            }
        }
        let mut want = samples();
        want.push(CtrlMsg::FinishConfirm);
        assert_eq!(got, want);
        assert_eq!(errs, vec![CtrlError::BadVersion(9)]);
        assert_eq!(d.buffered(), 0);
        // Zero-length body: framed, but too short for version + kind.
        d.push(&[0, 0, 0, 0]);
        assert_eq!(d.next(), Err(CtrlError::Truncated));
        assert_eq!(d.next(), Ok(None));
    }

    #[test]
    fn loss_bound_rules() {
        assert_eq!(LossBound::RELIABLE.ppm(), 0);
        assert_eq!(LossBound::default(), LossBound::RELIABLE);
        assert_eq!(
            LossBound::from_ppm(1_000_001),
            Err(CtrlError::BadLossBound(1_000_001))
        );
        assert_eq!(LossBound::from_fraction(0.05).unwrap().ppm(), 50_000);
        assert_eq!(LossBound::from_fraction(1.0).unwrap().ppm(), 1_000_000);
        assert_eq!(LossBound::from_fraction(0.0).unwrap(), LossBound::RELIABLE);
        for bad in [
            f64::NAN,
            -0.001,
            1.000_001,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            assert_eq!(LossBound::from_fraction(bad), Err(CtrlError::BadFraction));
        }
        assert_eq!(LossBound::from_ppm(250_000).unwrap().as_fraction(), 0.25);

        let b = LossBound::from_ppm(100_000).unwrap(); // 10 %
        assert!(b.is_met(90, 100));
        assert!(!b.is_met(89, 100));
        assert!(b.is_met(0, 0));
        assert_eq!(b.min_received(100), 90);
        assert_eq!(b.min_received(101), 91); // 90.9 rounds up
        assert!(LossBound::RELIABLE.is_met(u32::MAX, u32::MAX));
        assert!(!LossBound::RELIABLE.is_met(u32::MAX - 1, u32::MAX));
        assert_eq!(LossBound::RELIABLE.min_received(u32::MAX), u32::MAX);
        let all = LossBound::from_ppm(1_000_000).unwrap();
        assert!(all.is_met(0, u32::MAX));
        assert_eq!(all.min_received(u32::MAX), 0);
        // 1 ppm of 1e6 segments: exactly one may be lost.
        let one = LossBound::from_ppm(1).unwrap();
        assert!(one.is_met(999_999, 1_000_000));
        assert!(!one.is_met(999_998, 1_000_000));
    }

    #[test]
    fn seg_range_helpers() {
        assert_eq!(SegRange { start: 3, len: 4 }.end(), 7);
        assert_eq!(
            SegRange {
                start: u32::MAX,
                len: 5
            }
            .end(),
            u32::MAX
        );
        assert!(SegRange { start: 3, len: 4 }.contains(6));
        assert!(!SegRange { start: 3, len: 4 }.contains(7));
        assert_eq!(
            SegRange::coalesce([9, 1, 2, 3, 3, 7, u32::MAX, 8]),
            vec![
                SegRange { start: 1, len: 3 },
                SegRange { start: 7, len: 3 },
                SegRange {
                    start: u32::MAX,
                    len: 1
                }
            ]
        );
        assert!(SegRange::coalesce([]).is_empty());
    }

    #[test]
    fn segment_layout_check() {
        let f = sample_start();
        assert!(f.segment_layout_ok());
        assert!(!FlowStart {
            segment_count: 9,
            ..f.clone()
        }
        .segment_layout_ok());
        assert!(!FlowStart {
            segment_payload: 0,
            ..f.clone()
        }
        .segment_layout_ok());
        assert!(FlowStart {
            size_bytes: 0,
            segment_count: 0,
            ..f
        }
        .segment_layout_ok());
    }

    fn arb_reason() -> impl Strategy<Value = String> {
        // Mix of ASCII and multi-byte chars, up to the byte limit.
        prop::collection::vec(any::<char>(), 0..300).prop_map(|cs| {
            let mut s = String::new();
            for c in cs {
                if s.len() + c.len_utf8() > MAX_REASON {
                    break;
                }
                s.push(c);
            }
            s
        })
    }

    fn arb_ranges() -> impl Strategy<Value = Vec<SegRange>> {
        prop::collection::btree_set(any::<u32>(), 0..64)
            .prop_map(|set| SegRange::coalesce(set.into_iter().flat_map(|i| [i, i / 2 + 1])))
    }

    fn arb_reject() -> impl Strategy<Value = RejectCode> {
        prop::sample::select(vec![
            RejectCode::UnknownTensor,
            RejectCode::SizeMismatch,
            RejectCode::DtypeMismatch,
            RejectCode::BadSegmentLayout,
            RejectCode::Busy,
            RejectCode::Other,
        ])
    }

    fn arb_sources() -> impl Strategy<Value = Vec<DataSource>> {
        let addr = prop_oneof![
            any::<[u8; 4]>().prop_map(std::net::IpAddr::from),
            any::<[u8; 16]>().prop_map(std::net::IpAddr::from),
        ];
        prop::collection::vec(
            (addr, any::<u16>(), 1..=u16::MAX).prop_map(|(addr, port, ports)| DataSource {
                addr,
                port,
                // Clamp into a valid range: port + ports - 1 <= 65535.
                ports: (u32::from(ports).min(65_536 - u32::from(port)) as u16).max(1),
            }),
            1..=MAX_SOURCES,
        )
    }

    fn arb_msg() -> impl Strategy<Value = CtrlMsg> {
        prop_oneof![
            (
                (any::<u32>(), any::<u32>(), any::<u32>(), any::<u16>()),
                (any::<u8>(), any::<u64>(), any::<u32>(), any::<u32>()),
                (
                    0..=1_000_000u32,
                    any::<[u8; FLOW_NONCE_LEN]>(),
                    any::<bool>(),
                    0..=MAX_PRIORITY,
                ),
                arb_sources(),
            )
                .prop_map(
                    |((j, t, r, l), (d, s, p, c), (ppm, nonce, pull, prio), sources)| {
                        CtrlMsg::FlowStart(FlowStart {
                            job_id: j,
                            tensor_id: t,
                            round: r,
                            layer: l,
                            dtype_code: d,
                            size_bytes: s,
                            segment_payload: p,
                            segment_count: c,
                            loss_bound: LossBound::from_ppm(ppm).unwrap(),
                            stage: if pull { Stage::Pull } else { Stage::Push },
                            priority: prio,
                            flow_nonce: nonce,
                            sources,
                        })
                    }
                ),
            (any::<u32>(), any::<u32>(), any::<u32>(), any::<u16>()).prop_map(
                |(job_id, tensor_id, round, data_port)| CtrlMsg::FlowAccept {
                    job_id,
                    tensor_id,
                    round,
                    data_port
                }
            ),
            (
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                arb_reject(),
                arb_reason()
            )
                .prop_map(|(job_id, tensor_id, round, code, reason)| {
                    CtrlMsg::FlowReject {
                        job_id,
                        tensor_id,
                        round,
                        code,
                        reason,
                    }
                }),
            (any::<u32>(), any::<u32>()).prop_map(|(pass, segments_sent)| CtrlMsg::FlowStop {
                pass,
                segments_sent
            }),
            (any::<u32>(), arb_ranges())
                .prop_map(|(pass, ranges)| CtrlMsg::RetransmitRequest { pass, ranges }),
            any::<u32>().prop_map(|received_segments| CtrlMsg::FlowFinish { received_segments }),
            Just(CtrlMsg::FinishConfirm),
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
                |(period_ns, bytes, packets, ce_packets)| CtrlMsg::RateReport {
                    period_ns,
                    bytes,
                    packets,
                    ce_packets
                }
            ),
            (any::<u8>(), arb_reason()).prop_map(|(code, reason)| CtrlMsg::Abort { code, reason }),
            proptest::array::uniform8((any::<u32>(), any::<u32>())).prop_map(|a| {
                CtrlMsg::EcnReport {
                    queues: a.map(|(packets, ce)| QueueEcn { packets, ce }),
                }
            }),
            (1..=u64::MAX).prop_map(|rate_bps| CtrlMsg::RateGrant { rate_bps }),
            (
                any::<bool>(),
                any::<[u8; HANDSHAKE_NONCE_LEN]>(),
                any::<[u8; HANDSHAKE_PUBLIC_LEN]>()
            )
                .prop_map(|(auth, nonce, public)| CtrlMsg::Hello {
                    auth,
                    nonce,
                    public
                }),
            (
                any::<[u8; HANDSHAKE_NONCE_LEN]>(),
                any::<[u8; HANDSHAKE_PUBLIC_LEN]>()
            )
                .prop_map(|(nonce, public)| CtrlMsg::Challenge { nonce, public }),
            any::<[u8; HANDSHAKE_PROOF_LEN]>().prop_map(|proof| CtrlMsg::Proof { proof }),
            (any::<bool>(), any::<[u8; HANDSHAKE_PROOF_LEN]>())
                .prop_map(|(auth, proof)| CtrlMsg::Welcome { auth, proof }),
        ]
    }

    proptest! {
        #[test]
        fn prop_round_trip(m in arb_msg()) {
            let frame = m.to_frame().unwrap();
            prop_assert_eq!(frame.len(), LEN_PREFIX + m.body_len());
            prop_assert_eq!(CtrlMsg::decode_body(&frame[LEN_PREFIX..]).unwrap(), m);
        }

        #[test]
        fn prop_decode_arbitrary_is_canonical(
            kind in 0u8..13,
            rest in prop::collection::vec(any::<u8>(), 0..128),
        ) {
            // Steer most inputs past the version/kind checks so field decoding is exercised.
            let mut body = vec![VERSION, kind];
            body.extend_from_slice(&rest);
            for b in [&body[..], &rest[..]] {
                if let Ok(m) = CtrlMsg::decode_body(b) {
                    let frame = m.to_frame().unwrap();
                    prop_assert_eq!(&frame[LEN_PREFIX..], b);
                }
            }
        }

        #[test]
        fn prop_decoder_arbitrary_bytes_never_panics(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..16),
        ) {
            let mut d = Decoder::new();
            for c in &chunks {
                d.push(c);
                for _ in 0..8 {
                    match d.next() {
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => break,
                    }
                }
            }
        }

        #[test]
        fn prop_decoder_reassembles_any_chunking(
            msgs in prop::collection::vec(arb_msg(), 0..8),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
        ) {
            let mut stream = Vec::new();
            for m in &msgs {
                m.encode(&mut stream).unwrap();
            }
            let mut points: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
            points.push(0);
            points.push(stream.len());
            points.sort_unstable();
            let mut d = Decoder::new();
            let mut got = Vec::new();
            for w in points.windows(2) {
                d.push(&stream[w[0]..w[1]]);
                while let Some(m) = d.next().unwrap() {
                    got.push(m);
                }
            }
            prop_assert_eq!(got, msgs);
            prop_assert_eq!(d.buffered(), 0);
        }
    }
}
