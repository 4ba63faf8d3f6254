//! Per-packet fixtures shared by the criterion bench `benches/per_packet.rs` and the
//! `gradwire-perpacket` binary, so that both measure exactly the same code on exactly the same
//! memory.
//!
//! # Setup
//!
//! Every fixture works on a tensor of [`SEGMENTS`] full segments of [`PAYLOAD`] (1440) bytes,
//! 46 603 x 1440 B = 64 MiB - 544 B of f32, which is twice the L3 of most servers, so
//! consecutive packets land in consecutive, cache-cold 1440-byte windows of the tensor, as they
//! do in a real transfer. Packets are processed in segment order; after the last segment the
//! fixture needs a new *lap* ([`PerPacket::new_lap`], never timed), which rebuilds the protocol
//! flow so that every timed packet is a first copy (a duplicate would skip the copy).
//!
//! Received packets are pre-built, one per segment, by the send path itself
//! ([`SendFixture`]), in a pool of [`SLOT`]-byte slots (like an AF_XDP UMEM or a receive
//! ring): 46 603 x 1536 B, so the source bytes are cold too.
//!
//! # Operations
//!
//! - `memcpy_1440` ([`MemcpyFixture`]): `copy_from_slice` of the 1440-byte payload of the
//!   pre-built datagram for segment `i` into the tensor at `i * 1440`. Same source bytes and
//!   same destination walk as `recv_place`: the baseline the receive path is compared with.
//! - `recv_place` ([`RecvFixture`] without frames): what `transport::recv_tensor`'s `place`
//!   closure does with one datagram: `ReceiverFlow::on_datagram` (peer binding: the source
//!   against the flow's announced sources; `header::Packet::new_checked`,
//!   `header::Repr::parse`; `on_data`: flow match, `SegmentLayout::locate` bounds check, rate
//!   meter, bitmap bit, the one 1440-byte copy into the tensor, counters, loss-bound check)
//!   and the reject accounting.
//! - `recv_frame_place` ([`RecvFixture`] with frames): `frame::parse` of a whole
//!   Ethernet/IPv4/UDP frame (IPv4 header checksum and UDP checksum verified over the 1480
//!   UDP bytes), then the same as `recv_place` on the datagram, with the source from the IP
//!   and UDP headers and CE from the IP header: the AF_XDP receive path.
//! - `recv_place_auth`, `recv_frame_place_auth` ([`RecvFixture::authenticated`]): the same
//!   for an authenticated flow, through the same `on_datagram`: peer binding, parse, the kind,
//!   ids and pass checks, `auth::FlowKey::open` (copy of the 1440-byte ciphertext and tag into
//!   the flow's reused scratch buffer, AES-128-GCM verify and decrypt in place there), and
//!   `on_data` with the plaintext. The packets are AuthData datagrams (1488 bytes; frames 1530
//!   bytes) sealed by the send path.
//! - `recv_place_unbound` ([`RecvFixture::unbound`]): `recv_place` without the peer check
//!   (`new_checked` + `Repr::parse` + `on_data`, the place closure from before peer binding):
//!   `recv_place / recv_place_unbound` is what peer binding costs.
//! - `send_build` ([`SendFixture`] without frames): what `transport::send_tensor`'s `fill`
//!   closure does for one datagram: `SenderFlow::next_segment`, the priority function call,
//!   `Repr::emit` of the 32-byte header and the 1440-byte copy of the segment from the tensor
//!   into one of 32 rotating 1472-byte transmit buffers (the UDP datapath's batch).
//!   `SenderFlow::on_sent` (once per batch in the transport) is not included.
//! - `send_build_frame` ([`SendFixture`] with frames): the same, with the datagram written at
//!   offset 42 of a frame buffer, then `frame::emit_headers` (Ethernet, IPv4 with header
//!   checksum, UDP with checksum over the datagram).
//! - `send_build_auth`, `send_build_frame_auth` ([`SendFixture::authenticated`]): the same
//!   with an AuthData header and `auth::FlowKey::seal` (AES-128-GCM encryption of the payload
//!   in place, the tag after it) before the frame headers.
//!
//! The authenticated fixtures keep the 1440-byte payload, so that plain and authenticated
//! costs compare at equal payloads; on a 1500-byte MTU an authenticated datagram has room for
//! [`DATA_TAG_LEN`] bytes less (1424), and its 1530-byte frame here is over the standard
//! 1514 (`frame::parse` does not judge the MTU). The keys are derived from a fixed bench secret
//! outside the timed part.
//! - `send_build_tagged` ([`SendFixture::with_tagging`]): `send_build` with DLCP's default
//!   priority function (layer DSCP, mean |g| of the segment against the tensor's sampled
//!   median) instead of a fixed tag. [`threshold_estimate_time`] measures the once-per-tensor
//!   sample median.
//!
//! Nothing here performs I/O; the numbers are CPU cost per packet on one core.

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use gradwire_proto::auth::{
    FlowKey, JobKey, JobSecret, Transcript, DATA_TAG_LEN, NONCE_LEN, PUBLIC_LEN,
};
use gradwire_proto::datagram::{RxMeta, TxMeta};
use gradwire_proto::flow::{
    fixed_priority, DataOrigin, FlowId, PriorityFn, ReceiverFlow, RecvSpec, RejectCounts,
    SegmentInfo, SenderConfig, SenderFlow, Tag,
};
use gradwire_proto::message::{CtrlMsg, FlowStart, LossBound, Stage, FLOW_NONCE_LEN};
use gradwire_proto::tagging::{DlcpTagger, MagnitudeConfig};
use gradwire_proto::tensor::{DType, SegmentLayout, Tensor};
use gradwire_proto::wire::frame::{self, Ecn, FrameMeta};
use gradwire_proto::wire::header::{self, HEADER_LEN};

/// Payload bytes per packet: a 1500-byte IPv4 MTU minus IPv4, UDP and gradwire headers.
pub const PAYLOAD: usize = frame::payload_capacity(1500, false);
/// Gradwire datagram length: header + payload (1472).
pub const DATAGRAM_LEN: usize = HEADER_LEN + PAYLOAD;
/// Ethernet frame length: Ethernet + IPv4 + UDP + datagram (1514).
pub const FRAME_LEN: usize = frame::HEADER_LEN_V4 + DATAGRAM_LEN;
/// Stride of packet buffers (pre-built receive packets, transmit buffers).
pub const SLOT: usize = 1536;
/// Segments in the bench tensor: as many full segments as fit 64 MiB.
pub const SEGMENTS: u32 = ((64 << 20) / PAYLOAD) as u32;
/// Transmit buffers the send fixtures rotate through (the default transport batch).
pub const TX_BUFFERS: usize = 32;
/// Wire time of one full-size packet at 100 Gbit/s, in ns: (1500 + 14 Ethernet + 4 FCS +
/// 8 preamble + 12 inter-frame gap) bytes x 8 / 100.
pub const NS_PER_PACKET_100G: f64 = (1500.0 + 38.0) * 8.0 / 100.0;
/// Full-size (1500-byte MTU) packets per second at 25 Gbit/s line rate, Ethernet overheads
/// included: 25e9 / ((1500 + 38) x 8) = 2.03 M.
pub const PPS_25G: f64 = 25e9 / ((1500.0 + 38.0) * 8.0);
/// The same at 100 Gbit/s: 8.13 M.
pub const PPS_100G: f64 = 100e9 / ((1500.0 + 38.0) * 8.0);

/// Cores that processing `pps` packets per second needs at `ns_per_packet` each:
/// ns/packet x packets/s / 1e9 (one core does 1e9 ns of work per second).
pub fn cores_needed(ns_per_packet: f64, pps: f64) -> f64 {
    ns_per_packet * pps / 1e9
}

const JOB: u32 = 7;
const TENSOR_ID: u32 = 42;
const ROUND: u32 = 3;
const LAYER: u16 = 5;
const NOW_NS: u64 = 1_000;
const SRC: &str = "198.18.0.1:40000";
const DST: &str = "198.18.0.2:9000";
/// The bench job's secret and handshake nonces (fixed: the keys are the same every run).
const SECRET: [u8; 32] = [0x5a; 32];
/// The bench session's handshake transcript and X25519 shared secret (fixed: the per-packet
/// paths only need some session's flow key).
const TRANSCRIPT: Transcript = Transcript {
    client_nonce: [0xc1; NONCE_LEN],
    server_nonce: [0x5e; NONCE_LEN],
    client_public: [0xc2; PUBLIC_LEN],
    server_public: [0x5f; PUBLIC_LEN],
};
const SHARED: [u8; 32] = [0x77; 32];

/// One per-packet operation over a fixture.
pub trait PerPacket {
    /// The bench name of the operation.
    fn name(&self) -> &'static str;
    /// Packets left in the current lap; [`Self::op`] may be called this many times before
    /// [`Self::new_lap`].
    fn remaining(&self) -> u64;
    /// Processes one packet (the timed part). Only call while [`Self::remaining`] > 0.
    fn op(&mut self);
    /// Starts a new lap (not timed): checks that the packets of the lap so far were all
    /// processed as intended (panics on a bench bug), then resets the flow and the walk.
    fn new_lap(&mut self);
}

/// Runs `packets` operations and returns the time spent in them, excluding the lap resets.
pub fn time_packets<P: PerPacket + ?Sized>(p: &mut P, packets: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = packets;
    while left > 0 {
        if p.remaining() == 0 {
            p.new_lap();
        }
        let n = left.min(p.remaining());
        let t = Instant::now();
        for _ in 0..n {
            p.op();
        }
        total += t.elapsed();
        left -= n;
    }
    total
}

/// Runs one whole lap untimed (faults in every page, trains the branch predictors) and
/// starts a fresh one.
pub fn warm_up<P: PerPacket + ?Sized>(p: &mut P) {
    p.new_lap();
    while p.remaining() > 0 {
        p.op();
    }
    p.new_lap();
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("constant socket address")
}

fn tensor_bytes(segments: u32) -> usize {
    segments as usize * PAYLOAD
}

/// A zeroed f32 tensor of `segments` full segments, every page written once.
fn zero_tensor(segments: u32) -> Tensor {
    let mut t = Tensor::zeros(DType::F32, tensor_bytes(segments) / DType::F32.elem_size());
    t.as_bytes_mut().fill(0);
    t
}

/// A sender flow for the bench tensor that has been accepted (is sending), and its FlowStart,
/// which announces `flow_nonce`.
fn sender_flow(segments: u32, flow_nonce: [u8; FLOW_NONCE_LEN]) -> (SenderFlow, FlowStart) {
    let layout = SegmentLayout::new(tensor_bytes(segments) as u64, 4, PAYLOAD)
        .expect("bench segment layout is valid");
    let id = FlowId {
        job: JOB,
        tensor: TENSOR_ID,
        round: ROUND,
    };
    let (mut flow, msg) = SenderFlow::new(
        id,
        layout,
        DType::F32,
        LAYER,
        LossBound::RELIABLE,
        Stage::Push,
        DataOrigin {
            flow_nonce,
            ..DataOrigin::single(addr(SRC))
        },
        &SenderConfig::new(100_000_000_000),
        0,
    );
    let CtrlMsg::FlowStart(start) = msg else {
        unreachable!("SenderFlow::new returns a FlowStart");
    };
    let accept = CtrlMsg::FlowAccept {
        job_id: JOB,
        tensor_id: TENSOR_ID,
        round: ROUND,
        data_port: addr(DST).port(),
    };
    flow.on_ctrl(accept, 0)
        .expect("sender takes the FlowAccept");
    (flow, start)
}

/// The flow nonce of lap `lap`.
fn lap_nonce(lap: u64) -> [u8; FLOW_NONCE_LEN] {
    let mut nonce = [0u8; FLOW_NONCE_LEN];
    nonce[..8].copy_from_slice(&lap.to_be_bytes());
    nonce
}

/// The AES-128-GCM key of the bench flow `start` announces, as both ends derive it after the
/// handshake (not timed).
fn flow_key(start: &FlowStart) -> FlowKey {
    let secret = JobSecret::new(SECRET.to_vec()).expect("32-byte bench secret");
    JobKey::new(&secret).session(&TRANSCRIPT, &SHARED).flow_key(
        start.job_id,
        start.tensor_id,
        start.round,
        &start.flow_nonce,
    )
}

/// A receiver flow that accepted `start` into a tensor of `segments` segments.
/// The receiver of the bench flow `start`; keyed like the transport's when `auth`.
fn receiver_flow(start: &FlowStart, segments: u32, auth: bool) -> ReceiverFlow {
    let spec = RecvSpec {
        job: JOB,
        tensor: TENSOR_ID,
        round: Some(ROUND),
        dtype: DType::F32,
        size_bytes: tensor_bytes(segments) as u64,
        max_payload: PAYLOAD,
        loss_bound: None,
    };
    let (mut flow, _accept) =
        ReceiverFlow::accept(start, &spec, addr(SRC).ip(), addr(DST).port(), 100_000, 0)
            .expect("receiver accepts the bench flow");
    if auth {
        flow.authenticate(flow_key(start));
    }
    flow
}

/// The send path: builds one datagram (or frame) per call, as `send_tensor`'s fill closure.
pub struct SendFixture {
    frames: bool,
    tagged: bool,
    /// Authenticated: AuthData datagrams sealed with this flow's key.
    key: Option<FlowKey>,
    /// Laps so far: each lap is a new flow with a new flow nonce, so an authenticated
    /// fixture never seals the same (seq, pass) twice under one key.
    laps: u64,
    segments: u32,
    tensor: Tensor,
    flow: SenderFlow,
    /// The current flow's FlowStart.
    start: FlowStart,
    prio: Box<PriorityFn<'static>>,
    dst: SocketAddr,
    src: SocketAddr,
    /// [`TX_BUFFERS`] slots of [`SLOT`] bytes.
    bufs: Vec<u8>,
    slot: usize,
    ident: u16,
    payload_bytes: u64,
    built: u32,
}

impl std::fmt::Debug for SendFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendFixture")
            .field("frames", &self.frames)
            .field("authenticated", &self.key.is_some())
            .field("segments", &self.segments)
            .field("built", &self.built)
            .finish_non_exhaustive()
    }
}

impl SendFixture {
    /// A sender of a pattern-filled tensor of `segments` segments; with `frames`, each
    /// packet is a whole Ethernet/IPv4/UDP frame.
    pub fn new(frames: bool, segments: u32) -> SendFixture {
        Self::with_tagging(frames, false, segments)
    }

    /// [`SendFixture::new`] for an authenticated flow: AuthData datagrams, payload sealed
    /// with the flow's AES-128-GCM key (`send_build_auth`, `send_build_frame_auth`).
    pub fn authenticated(frames: bool, segments: u32) -> SendFixture {
        let mut f = Self::new(frames, segments);
        f.key = Some(flow_key(&f.start));
        f
    }

    /// [`SendFixture::new`], with DLCP's default tagging when `tagged` (layer 5 of 161, the
    /// magnitude threshold sampled from the tensor; each segment's mean |g| is computed):
    /// `send_build_tagged`.
    pub fn with_tagging(frames: bool, tagged: bool, segments: u32) -> SendFixture {
        let mut tensor = zero_tensor(segments);
        tensor.fill_pattern(1);
        let (flow, start) = sender_flow(segments, lap_nonce(0));
        let prio: Box<PriorityFn<'static>> = if tagged {
            let tagger = DlcpTagger::for_tensor(&tensor, 5, 161, &MagnitudeConfig::default())
                .expect("valid tagging configuration");
            Box::new(tagger.priority_fn())
        } else {
            Box::new(fixed_priority(Tag {
                dscp: 10,
                ect: true,
            }))
        };
        SendFixture {
            frames,
            tagged,
            key: None,
            laps: 0,
            segments,
            tensor,
            flow,
            start,
            prio,
            dst: addr(DST),
            src: addr(SRC),
            bufs: vec![0u8; TX_BUFFERS * SLOT],
            slot: 0,
            ident: 0,
            payload_bytes: 0,
            built: 0,
        }
    }

    /// The source tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Builds the next packet into transmit slot `slot`; returns its length and metadata.
    ///
    /// The datagram part is `send_tensor`'s fill closure line by line, plus the seal of an
    /// authenticated flow.
    #[inline]
    fn build(&mut self, slot: usize) -> Option<(usize, TxMeta)> {
        let hl = if self.frames { frame::HEADER_LEN_V4 } else { 0 };
        let whole = self.bufs.get_mut(slot * SLOT..(slot + 1) * SLOT)?;
        let buf = &mut whole[hl..];
        let bytes = self.tensor.as_bytes();
        // --- send_tensor's fill closure ---
        let (index, repr) = self.flow.next_segment()?;
        let (off, len) = (repr.offset as usize, usize::from(repr.length));
        let seg = bytes.get(off..off + len)?;
        let tag = (self.prio)(&SegmentInfo {
            index,
            offset: repr.offset,
            layer: repr.layer,
            dtype: self.tensor.dtype(),
            payload: seg,
        });
        let mut repr = repr;
        if tag.ect {
            repr.flags.insert(header::Flags::IMPORTANT);
        }
        if self.key.is_some() {
            repr.kind = header::Kind::AuthData;
        }
        let total = repr.buffer_len();
        let out = buf.get_mut(..total)?;
        let mut pkt = header::Packet::new_unchecked(&mut *out);
        repr.emit(&mut pkt).ok()?;
        pkt.payload_mut().copy_from_slice(seg);
        if let Some(key) = &self.key {
            key.seal(out).ok()?;
        }
        self.payload_bytes += len as u64;
        let tx = TxMeta {
            dst: self.dst,
            tos: tag.tos(),
        };
        // --- end of the fill closure ---
        if !self.frames {
            return Some((total, tx));
        }
        let meta = FrameMeta {
            src_mac: [0x02, 0, 0, 0, 0, 0x0a],
            dst_mac: [0x02, 0, 0, 0, 0, 0x0b],
            src: self.src,
            dst: self.dst,
            dscp: tag.dscp,
            ecn: if tag.ect { Ecn::Ect0 } else { Ecn::NotEct },
            hop_limit: 64,
            ident: self.ident,
        };
        self.ident = self.ident.wrapping_add(1);
        let n = frame::emit_headers(whole, &meta, total).ok()?;
        Some((n, tx))
    }

    /// Builds the next packet and returns a copy of it (for pre-building receive packets).
    fn build_copy(&mut self, out: &mut [u8]) -> Option<usize> {
        let (n, _) = self.build(0)?;
        out.get_mut(..n)?.copy_from_slice(self.bufs.get(..n)?);
        self.built += 1;
        Some(n)
    }
}

impl PerPacket for SendFixture {
    fn name(&self) -> &'static str {
        match (self.frames, self.tagged, self.key.is_some()) {
            (true, _, true) => "send_build_frame_auth",
            (false, _, true) => "send_build_auth",
            (true, _, false) => "send_build_frame",
            (false, true, false) => "send_build_tagged",
            (false, false, false) => "send_build",
        }
    }

    fn remaining(&self) -> u64 {
        u64::from(self.segments - self.built)
    }

    #[inline]
    fn op(&mut self) {
        let slot = self.slot;
        self.slot = if slot + 1 == TX_BUFFERS { 0 } else { slot + 1 };
        let r = self.build(slot);
        black_box(r);
        self.built += 1;
    }

    fn new_lap(&mut self) {
        assert_eq!(
            self.payload_bytes,
            u64::from(self.built) * PAYLOAD as u64,
            "{}: every packet of the lap was built in full",
            self.name()
        );
        // A new flow with a new flow nonce (and so a new key when authenticated) per lap, as a
        // real sender has per flow.
        self.laps += 1;
        (self.flow, self.start) = sender_flow(self.segments, lap_nonce(self.laps));
        if self.key.is_some() {
            self.key = Some(flow_key(&self.start));
        }
        self.built = 0;
        self.payload_bytes = 0;
    }
}

/// One pre-built packet per segment, in [`SLOT`]-byte slots, as the send path emits them
/// (sealed for an authenticated flow), and the flow's FlowStart.
fn prebuilt_packets(frames: bool, auth: bool, segments: u32) -> (Vec<u8>, FlowStart) {
    let mut send = if auth {
        SendFixture::authenticated(frames, segments)
    } else {
        SendFixture::new(frames, segments)
    };
    let start = send.start.clone();
    let want = packet_len(frames, auth);
    let mut pool = vec![0u8; segments as usize * SLOT];
    for slot in pool.chunks_exact_mut(SLOT) {
        let n = send
            .build_copy(slot)
            .expect("send path builds every segment");
        assert_eq!(n, want);
    }
    (pool, start)
}

/// Length of a bench packet: a datagram or a frame, with the tag when authenticated.
const fn packet_len(frames: bool, auth: bool) -> usize {
    let d = DATAGRAM_LEN + if auth { DATA_TAG_LEN } else { 0 };
    if frames {
        frame::HEADER_LEN_V4 + d
    } else {
        d
    }
}

/// The receive path: places one pre-built datagram (or frame) per call into a 64 MiB tensor.
#[derive(Debug)]
pub struct RecvFixture {
    frames: bool,
    /// Authenticated flow: sealed packets, the flow keyed like the transport's.
    auth: bool,
    /// Placement without the peer check (parse + `on_data`): the receive path as it was
    /// before peer binding, the other half of the comparison that measures what binding costs.
    unbound: bool,
    segments: u32,
    packets: Vec<u8>,
    tensor: Tensor,
    start: FlowStart,
    flow: ReceiverFlow,
    meta: RxMeta,
    rejected: RejectCounts,
    next: u32,
}

impl RecvFixture {
    /// A receiver of `segments` segments; with `frames`, packets are whole
    /// Ethernet/IPv4/UDP frames and go through `frame::parse` first.
    pub fn new(frames: bool, segments: u32) -> RecvFixture {
        Self::build(frames, false, segments)
    }

    /// [`RecvFixture::new`] for an authenticated flow: sealed AuthData packets, opened
    /// before placement (`recv_place_auth`, `recv_frame_place_auth`).
    pub fn authenticated(frames: bool, segments: u32) -> RecvFixture {
        Self::build(frames, true, segments)
    }

    /// The plain datagram receive path without the peer check (`recv_place_unbound`): what
    /// `recv_place` costs beyond it is the price of peer binding.
    pub fn unbound(segments: u32) -> RecvFixture {
        RecvFixture {
            unbound: true,
            ..Self::build(false, false, segments)
        }
    }

    fn build(frames: bool, auth: bool, segments: u32) -> RecvFixture {
        let (packets, start) = prebuilt_packets(frames, auth, segments);
        let flow = receiver_flow(&start, segments, auth);
        RecvFixture {
            frames,
            auth,
            unbound: false,
            segments,
            packets,
            tensor: zero_tensor(segments),
            start,
            flow,
            meta: RxMeta {
                src: addr(SRC),
                tos: 0,
            },
            rejected: RejectCounts::default(),
            next: 0,
        }
    }

    /// The receive tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Packets placed in the current lap.
    pub fn placed(&self) -> u64 {
        self.flow.stats().placed
    }
}

impl PerPacket for RecvFixture {
    fn name(&self) -> &'static str {
        match (self.frames, self.auth, self.unbound) {
            (_, _, true) => "recv_place_unbound",
            (true, true, _) => "recv_frame_place_auth",
            (false, true, _) => "recv_place_auth",
            (true, false, _) => "recv_frame_place",
            (false, false, _) => "recv_place",
        }
    }

    fn remaining(&self) -> u64 {
        u64::from(self.segments - self.next)
    }

    #[inline]
    fn op(&mut self) {
        let at = self.next as usize * SLOT;
        self.next += 1;
        let len = packet_len(self.frames, self.auth);
        let (src, d, tos) = if self.frames {
            let Ok(f) = frame::parse(&self.packets[at..at + len]) else {
                self.rejected.malformed += 1;
                return;
            };
            (f.src, f.datagram, (f.dscp << 2) | f.ecn.bits())
        } else {
            (self.meta.src, &self.packets[at..at + len], self.meta.tos)
        };
        let buf = self.tensor.as_bytes_mut();
        if self.unbound {
            // The place closure as it was before peer binding.
            let Ok(pkt) = header::Packet::new_checked(d) else {
                self.rejected.malformed += 1;
                return;
            };
            let Ok(repr) = header::Repr::parse(&pkt) else {
                self.rejected.malformed += 1;
                return;
            };
            if let Err(e) = self.flow.on_data(&repr, pkt.payload(), buf, tos, NOW_NS) {
                self.rejected.count(e);
            }
            return;
        }
        // --- recv_tensor's place closure: peer binding, parse, (open), place ---
        if let Err(e) = self.flow.on_datagram(src, d, buf, tos, NOW_NS) {
            self.rejected.count_datagram(e);
        }
    }

    fn new_lap(&mut self) {
        assert_eq!(
            self.rejected.total(),
            0,
            "{}: packets rejected: {:?}",
            self.name(),
            self.rejected
        );
        let s = self.flow.stats();
        assert_eq!(
            (s.placed, s.duplicates),
            (u64::from(self.next), 0),
            "{}: every packet of the lap was a first copy",
            self.name()
        );
        self.flow = receiver_flow(&self.start, self.segments, self.auth);
        self.next = 0;
    }
}

/// The baseline: a bare 1440-byte `copy_from_slice` per packet, with the same source bytes
/// (the payloads of the pre-built datagrams) and the same destination walk as `recv_place`.
#[derive(Debug)]
pub struct MemcpyFixture {
    segments: u32,
    packets: Vec<u8>,
    tensor: Tensor,
    next: u32,
}

impl MemcpyFixture {
    /// A copy walk over `segments` segments.
    pub fn new(segments: u32) -> MemcpyFixture {
        MemcpyFixture {
            segments,
            packets: prebuilt_packets(false, false, segments).0,
            tensor: zero_tensor(segments),
            next: 0,
        }
    }

    /// The destination tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

impl PerPacket for MemcpyFixture {
    fn name(&self) -> &'static str {
        "memcpy_1440"
    }

    fn remaining(&self) -> u64 {
        u64::from(self.segments - self.next)
    }

    #[inline]
    fn op(&mut self) {
        let i = black_box(self.next as usize);
        self.next += 1;
        let src = &self.packets[i * SLOT + HEADER_LEN..i * SLOT + DATAGRAM_LEN];
        let dst = &mut self.tensor.as_bytes_mut()[i * PAYLOAD..(i + 1) * PAYLOAD];
        dst.copy_from_slice(black_box(src));
        black_box(dst);
    }

    fn new_lap(&mut self) {
        self.next = 0;
    }
}

/// The eleven operations, in report order.
pub const OPS: [&str; 11] = [
    "memcpy_1440",
    "recv_place",
    "recv_frame_place",
    "send_build",
    "send_build_frame",
    "send_build_tagged",
    "recv_place_auth",
    "recv_frame_place_auth",
    "send_build_auth",
    "send_build_frame_auth",
    "recv_place_unbound",
];

/// The plain receive path and the same without peer binding: their ratio is what binding
/// costs.
pub const PEER_BINDING_PAIR: (&str, &str) = ("recv_place", "recv_place_unbound");

/// Each authenticated operation and the plain one it is compared with.
pub const AUTH_PAIRS: [(&str, &str); 4] = [
    ("recv_place_auth", "recv_place"),
    ("recv_frame_place_auth", "recv_frame_place"),
    ("send_build_auth", "send_build"),
    ("send_build_frame_auth", "send_build_frame"),
];

/// Time to estimate the magnitude threshold of `tensor` (DLCP's 0.1 % sample median), best
/// of `runs`: the per-tensor part of tagging, compared with sending the whole tensor.
pub fn threshold_estimate_time(tensor: &Tensor, runs: u32) -> Duration {
    (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            black_box(gradwire_proto::tagging::magnitude_threshold(
                black_box(tensor),
                &MagnitudeConfig::default(),
            ));
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: u32 = 100;

    #[test]
    fn sizes() {
        assert_eq!((PAYLOAD, DATAGRAM_LEN, FRAME_LEN), (1440, 1472, 1514));
        assert_eq!(SEGMENTS, 46_603);
        assert!(tensor_bytes(SEGMENTS) <= 64 << 20);
        assert!((NS_PER_PACKET_100G - 123.04).abs() < 1e-9);
    }

    #[test]
    fn receive_paths_reproduce_the_tensor() {
        let want = SendFixture::new(false, SMALL).tensor().as_bytes().to_vec();
        let fixtures = [(false, false), (true, false), (false, true), (true, true)]
            .map(|(frames, auth)| RecvFixture::build(frames, auth, SMALL));
        for mut r in fixtures.into_iter().chain([RecvFixture::unbound(SMALL)]) {
            for _ in 0..2 {
                assert!(time_packets(&mut r, u64::from(SMALL)) > Duration::ZERO);
                assert_eq!(r.placed(), u64::from(SMALL));
                assert_eq!(r.tensor().as_bytes(), &want[..], "{}", r.name());
                r.new_lap();
            }
        }
        let mut m = MemcpyFixture::new(SMALL);
        warm_up(&mut m);
        assert_eq!(m.tensor().as_bytes(), &want[..]);
    }

    #[test]
    fn send_paths_build_parsable_packets() {
        for (frames, auth) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut s = if auth {
                SendFixture::authenticated(frames, SMALL)
            } else {
                SendFixture::new(frames, SMALL)
            };
            // Several laps, across lap boundaries.
            time_packets(&mut s, u64::from(SMALL) * 3 + 7);
            let (n, tx) = s.build(0).expect("a packet");
            assert_eq!(n, packet_len(frames, auth));
            let d = if frames {
                frame::parse(&s.bufs[..n]).expect("valid frame").datagram
            } else {
                &s.bufs[..n]
            };
            let repr = header::Repr::parse(&header::Packet::new_checked(d).expect("datagram"))
                .expect("header");
            assert_eq!(repr.offset, 7 * PAYLOAD as u64);
            assert!(repr.flags.contains(header::Flags::IMPORTANT));
            assert_eq!(tx.tos, (10 << 2) | 0b10);
            let seg = &s.tensor().as_bytes()[7 * PAYLOAD..8 * PAYLOAD];
            if auth {
                assert_eq!(repr.kind, header::Kind::AuthData);
                // The lap's key opens it (the fourth lap: a key of its own); the first lap's
                // does not.
                assert_eq!(s.laps, 3);
                let mut scratch = Vec::new();
                assert_eq!(flow_key(&s.start).open(d, &mut scratch), Ok(seg));
                let (_, first) = sender_flow(SMALL, lap_nonce(0));
                assert!(flow_key(&first).open(d, &mut scratch).is_err());
            } else {
                assert_eq!(repr.kind, header::Kind::Data);
                assert_eq!(
                    header::Packet::new_checked(d).expect("datagram").payload(),
                    seg
                );
            }
        }
    }

    #[test]
    fn names_and_line_rates() {
        for (frames, auth) in [(false, false), (true, false), (false, true), (true, true)] {
            assert!(OPS.contains(&RecvFixture::build(frames, auth, 2).name()));
            let s = if auth {
                SendFixture::authenticated(frames, 2)
            } else {
                SendFixture::new(frames, 2)
            };
            assert!(OPS.contains(&s.name()));
        }
        for (a, p) in AUTH_PAIRS {
            assert!(OPS.contains(&a) && OPS.contains(&p) && a.starts_with(p));
        }
        assert!((PPS_25G / 1e6 - 2.032).abs() < 1e-3);
        assert!((PPS_100G / 1e6 - 8.127).abs() < 1e-3);
        assert!((cores_needed(500.0, 2e6) - 1.0).abs() < 1e-12);
    }
}
