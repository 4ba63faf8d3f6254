//! The state machines of one endpoint, with no I/O and no clock of their own (quinn-proto's
//! shape): datagrams in ([`Core::handle_datagram`]), timers in ([`Core::handle_timeout`]),
//! datagrams out ([`Core::poll_transmit`]) and events out ([`Core::poll_event`]). Time is
//! an argument, so tests run on a virtual clock.
//!
//! A message is a range of a registered buffer sent from one rank to another, numbered on
//! its channel (sender -> receiver) by the layer: both sides reserve numbers in the same
//! order ([`Core::reserve_sends`], [`Core::reserve_recvs`]), as every rank starts the same
//! operations in the same order. There is no handshake: the sender starts at once, within
//! its peer's congestion window; the receiver answers at the end of every pass (a segment
//! flagged LAST) with DONE or a NACK bitmap of what is missing, and with progress ACKs on
//! the way. A sender that hears nothing for a retransmission timeout (SRTT + 4 RTTVAR, a
//! 1 ms floor) asks with POLL, backing off; a peer silent for `peer_timeout` fails the
//! message naming it. Every control frame is idempotent.
//!
//! Data for a message the receiver has not posted yet is kept, bounded in bytes, and placed
//! when it is posted (a peer a step ahead is the normal case, not an error).
//!
//! Incast is the receiver's to schedule ([`grant`]): it grants each peer sending to it a
//! share of one budget of segments in flight, so many senders offer one window together.

pub mod grant;
mod recv;
mod rtt;
mod send;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use gradwire_proto::tensor::DType;

use crate::mem::{BufId, Buffers, Region};
use crate::wire::{self, Ctrl, CtrlOp, DataHeader};

pub use recv::RecvReport;
use recv::{RecvMsg, Unexpected};
pub use rtt::{Rtt, Window};
use send::SendMsg;

/// How an endpoint's core behaves.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Job id: datagrams of another job are refused.
    pub job: u32,
    /// This rank.
    pub rank: u16,
    /// Ranks in the job.
    pub world: u16,
    /// Payload bytes per data segment (a multiple of 8, so every dtype's elements and every
    /// block line up across messages).
    pub seg_payload: usize,
    /// RTO before the first RTT sample.
    pub rto_initial: Duration,
    /// Floor of the RTO.
    pub rto_min: Duration,
    /// Ceiling of the RTO and of the POLL back-off.
    pub rto_max: Duration,
    /// A peer that says nothing about a message for this long fails it, named.
    pub peer_timeout: Duration,
    /// Initial congestion window, segments (the unscheduled first window).
    pub init_cwnd: u32,
    /// Largest congestion window, segments.
    pub max_cwnd: u32,
    /// A receiver acknowledges progress every this many segments.
    pub ack_every: u32,
    /// In a first pass, a segment this many segments below the highest one received is
    /// taken as lost and named at once in a gap NACK, so the sender resends it within the
    /// pass instead of a pass later (a margin for paths that reorder; 0: no gap NACKs).
    pub gap_reorder: u32,
    /// Bytes of data kept for messages not posted yet, over all peers.
    pub unexpected_limit: usize,
    /// How far ahead of the receiver's reservations an unposted message may be numbered.
    pub unexpected_window: u32,
    /// TOS byte of control frames (DSCP << 2).
    pub ctrl_tos: u8,
    /// Segments per bundle (the GSO limit of the socket).
    pub max_bundle: usize,
    /// Receiver grants ([`grant`]): a receiver splits one budget of segments in flight
    /// towards it over the peers sending to it, and a sender keeps what it was granted.
    /// On by default; off: neither side grants nor waits (each sender's own window only),
    /// the ablation. A rank with them off still talks to ranks with them on.
    pub grants: bool,
    /// Retransmitted segments go ECN-capable (ECT(0)) whatever their first pass's tag: a
    /// switch marks them above its threshold instead of dropping them again. Off: resent as
    /// first sent.
    pub retransmit_ect: bool,
    /// First-pass segments a sender may keep in flight towards a peer before that peer's
    /// first grant (the unscheduled first window).
    pub unscheduled: u32,
    /// The receiver's initial budget of segments in flight towards it (it adapts within
    /// [`CoreConfig::ack_every`] and [`CoreConfig::max_cwnd`]).
    pub grant_window: u32,
}

impl CoreConfig {
    /// Rank `rank` of `world` in `job`, defaults elsewhere: 1432-byte segments (a 1500-byte
    /// MTU over IPv4), RTO 5 ms initially and within [1 ms, 200 ms], 30 s peer timeout, a
    /// 128-segment first window.
    pub fn new(job: u32, rank: u16, world: u16) -> CoreConfig {
        CoreConfig {
            job,
            rank,
            world,
            seg_payload: 1432,
            rto_initial: Duration::from_millis(5),
            rto_min: Duration::from_millis(1),
            rto_max: Duration::from_millis(200),
            peer_timeout: Duration::from_secs(30),
            init_cwnd: 128,
            max_cwnd: 16384,
            ack_every: 32,
            gap_reorder: 16,
            unexpected_limit: 64 << 20,
            unexpected_window: 1 << 16,
            ctrl_tos: gradwire_qos::CONTROL_DSCP << 2,
            max_bundle: 64,
            grants: true,
            retransmit_ect: true,
            unscheduled: 64,
            grant_window: 128,
        }
    }

    /// Payload bytes per segment for a path MTU over IPv4 (`ipv6`: IPv6): what is left after
    /// the IP, UDP and data headers, rounded down to 8 bytes.
    pub fn seg_payload_for_mtu(mtu: usize, ipv6: bool) -> usize {
        let ip = if ipv6 { 40 } else { 20 };
        (mtu.saturating_sub(ip + 8 + wire::DATA_HEADER_LEN) / 8 * 8).max(8)
    }
}

/// The message number of an ABORT that gives up every message with its sender.
pub const ABORT_ALL: u32 = u32::MAX;

/// Aborts remembered per peer for messages not posted yet (a bound on what a peer can make
/// us hold).
const MAX_ABORTED: usize = 4096;

/// What a receive does with arriving bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Copy them into the buffer.
    Copy,
    /// Combine them into the buffer element-wise (a reduce-scatter step: a sum, or a min, max
    /// or product).
    Reduce(crate::reduce::Combine, DType),
}

/// Options of a posted send.
#[derive(Debug, Clone, Default)]
pub struct SendOpts {
    /// TOS byte of the data (DSCP << 2 | ECN).
    pub tos: u8,
    /// DNN layer (carried in every segment).
    pub layer: u16,
    /// One word per segment for the receiver (a contributor set); empty: zeros.
    pub meta: Vec<u64>,
    /// One TOS byte per segment (DLCP's priority function: DSCP by layer, ECN-capable by
    /// gradient magnitude); empty: `tos` for all.
    pub tos_per_segment: Vec<u8>,
    /// Send the first pass starting at a segment derived from the message number and
    /// wrapping round ([`rotation`]), so what a loss or time bound leaves out is not the
    /// same part of a tensor in every message. The receive must say `rotate` too.
    pub rotate: bool,
}

/// Options of a posted receive.
#[derive(Debug, Clone)]
pub struct RecvOpts {
    /// Copy or reduce.
    pub place: Place,
    /// DLCP's loss bound: the message may end with at most this fraction of its segments
    /// missing, once the sender has sent every segment once.
    pub loss_bound: f64,
    /// The message ends at this instant with what arrived (a time bound).
    pub deadline: Option<Instant>,
    /// Keep each segment's meta word for the report.
    pub keep_meta: bool,
    /// The message may be shorter than the posted range (variable-length messages: headers,
    /// chunks): its length comes with its first segment, and the report gives it.
    pub up_to: bool,
    /// A segment whose meta word is 0 counts as arrived but its bytes are not placed (a
    /// relay's "I do not hold this block": the receiver keeps its own).
    pub skip_meta_zero: bool,
    /// Wait for the message as long as the peer answers: a receive posted ahead of a message
    /// that may come much later (a stream of chunks whose sender decides when) fails only
    /// when the peer itself has been silent for the peer timeout (no PONG to the receive's
    /// PINGs, no datagram at all), not when the message alone made no progress.
    pub patient: bool,
    /// Byte ranges of the message (ascending, disjoint, within it: the parameters a tensor
    /// coalesces) each held to the loss bound on its own, besides the message as a whole:
    /// a missing segment is done without only if every range it overlaps can lose its
    /// bytes, so a small range never carries a large one's losses (DLCP's bound per tensor).
    /// Empty: the message alone. Not with `up_to`.
    pub ranges: Vec<Range<usize>>,
    /// The sender rotates the first pass ([`SendOpts::rotate`]): gaps are looked for in
    /// the order it sends. Not with `up_to`.
    pub rotate: bool,
}

impl Default for RecvOpts {
    fn default() -> Self {
        RecvOpts {
            place: Place::Copy,
            loss_bound: 0.0,
            deadline: None,
            keep_meta: false,
            up_to: false,
            skip_meta_zero: false,
            patient: false,
            ranges: Vec::new(),
            rotate: false,
        }
    }
}

/// The segment a rotated message of `nsegs` segments starts its first pass at: message
/// numbers times the golden ratio, so successive messages start evenly spread over it.
/// Sender and receiver derive it alike.
pub fn rotation(msg: u32, nsegs: u32) -> u32 {
    let frac = u64::from(msg).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    ((frac * u64::from(nsegs)) >> 32) as u32
}

/// The order of a message's first pass: from segment `first`, wrapping round.
#[derive(Debug, Clone, Copy)]
pub(super) struct PassOrder {
    first: u32,
    nsegs: u32,
}

impl PassOrder {
    /// In order (`rotate` false), or from [`rotation`]`(msg, nsegs)`.
    pub(super) fn new(rotate: bool, msg: u32, nsegs: u32) -> PassOrder {
        let first = if rotate { rotation(msg, nsegs) } else { 0 };
        PassOrder { first, nsegs }
    }

    /// The segment sent at first-pass position `pos`.
    pub(super) fn seg_at(self, pos: u32) -> u32 {
        if self.first == 0 {
            pos
        } else {
            (pos + self.first) % self.nsegs
        }
    }

    /// The first-pass position of segment `seg`.
    pub(super) fn pos_of(self, seg: u32) -> u32 {
        if self.first == 0 {
            seg
        } else {
            (seg + self.nsegs - self.first) % self.nsegs
        }
    }
}

/// What ended a receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every segment arrived.
    Complete,
    /// Enough arrived under the loss bound after the sender's first pass.
    Bound,
    /// The deadline passed.
    Deadline,
}

/// Why a message failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    /// The message made no progress for the peer timeout.
    #[error("{}", silent_text(*.peer, *.msg, *.waited, *.alive))]
    PeerSilent {
        /// The peer.
        peer: u16,
        /// The message.
        msg: u32,
        /// How long it made no progress.
        waited: Duration,
        /// Whether the peer still answered (it did not call the operation, or it waits on
        /// another rank) rather than being dead or cut off.
        alive: bool,
    },
    /// The peer's socket is closed: its host answered a datagram with ICMP port unreachable.
    #[error("rank {peer}'s socket is closed (its host reports the port unreachable): the process exited or left the job")]
    Unreachable {
        /// The peer.
        peer: u16,
        /// The message.
        msg: u32,
    },
    /// The peer gave the message up because its operation failed.
    #[error("{}", aborted_text(*.peer, *.msg, *.culprit))]
    Aborted {
        /// The peer.
        peer: u16,
        /// The message.
        msg: u32,
        /// The rank the peer's operation failed on, if it named one.
        culprit: Option<u16>,
    },
}

fn aborted_text(peer: u16, msg: u32, culprit: Option<u16>) -> String {
    match culprit {
        Some(c) if c != peer => format!(
            "rank {peer} gave up message {msg}: its operation failed on rank {c} (see the \
             error about rank {c})"
        ),
        _ => format!("rank {peer} gave up message {msg}: its operation failed or was cancelled"),
    }
}

fn silent_text(peer: u16, msg: u32, waited: Duration, alive: bool) -> String {
    if alive {
        format!(
            "rank {peer} is alive but made no progress on message {msg} for {waited:?}: it has \
             not called this operation, or it waits on another rank (see that rank's error)"
        )
    } else {
        format!(
            "rank {peer} said nothing about message {msg} for {waited:?}: it is dead, hung or \
             unreachable"
        )
    }
}

/// Something the core tells its driver.
#[derive(Debug, Clone)]
pub enum Event {
    /// A send finished: the receiver has it (with `missing` segments left out under its bound).
    Sent {
        /// Receiver.
        peer: u16,
        /// Message.
        msg: u32,
        /// Segments the receiver did without.
        missing: u32,
        /// Data segments this side sent for the message: the first pass, retransmissions
        /// and tail probes.
        segments: u32,
    },
    /// A receive finished.
    Received {
        /// Sender.
        peer: u16,
        /// Message.
        msg: u32,
        /// What arrived.
        report: RecvReport,
    },
    /// A message failed.
    Failed {
        /// The peer.
        peer: u16,
        /// Message.
        msg: u32,
        /// `true`: a send; `false`: a receive.
        send: bool,
        /// Why.
        error: MsgError,
    },
}

/// Why a post was refused (a caller's mistake, never the network's).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PostError {
    /// No such peer.
    #[error("rank {0} is not in the job (or is this rank)")]
    Peer(u16),
    /// No such buffer or range.
    #[error("the buffer range {0:?} is not registered")]
    Range(Range<usize>),
    /// The message number is in use.
    #[error("message {msg} to or from rank {peer} is already posted")]
    Busy {
        /// Peer.
        peer: u16,
        /// Message.
        msg: u32,
    },
    /// Too long for one message.
    #[error("a message of {0} bytes is longer than the 4 GiB a message can hold")]
    TooLong(usize),
    /// Per-segment words (meta or TOS) do not match the segments.
    #[error("{got} per-segment values (meta words or TOS bytes) for a message of {want} segments")]
    Meta {
        /// Given.
        got: usize,
        /// Segments.
        want: usize,
    },
    /// A loss bound outside [0, 1).
    #[error("loss bound {0} is not in [0, 1)")]
    Bound(f64),
    /// Loss ranges that are not ascending, disjoint, non-empty ranges within the message,
    /// or ranges on a receive of unknown length.
    #[error("loss ranges must be ascending, disjoint, non-empty ranges within the {len}-byte message, on a receive of known length: {why}")]
    Ranges {
        /// The message's length.
        len: usize,
        /// What is wrong.
        why: String,
    },
}

/// Checks a receive's loss ranges against its message of `len` bytes.
fn check_ranges(opts: &RecvOpts, len: usize) -> Result<(), PostError> {
    let bad = |why: String| Err(PostError::Ranges { len, why });
    if opts.ranges.is_empty() {
        return Ok(());
    }
    if opts.up_to {
        return bad("the receive is up_to".into());
    }
    let mut end = 0;
    for r in &opts.ranges {
        if r.start < end || r.start >= r.end || r.end > len {
            return bad(format!("{r:?} after a range ending at {end}"));
        }
        end = r.end;
    }
    Ok(())
}

/// Counters of an endpoint (monotonic).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Data segments sent, first transmissions.
    pub data_sent: u64,
    /// Data segments resent.
    pub data_resent: u64,
    /// Payload bytes sent (first transmissions and resends).
    pub payload_bytes_sent: u64,
    /// Control frames sent.
    pub ctrl_sent: u64,
    /// Data segments placed.
    pub data_placed: u64,
    /// Duplicate data segments (already placed).
    pub data_duplicate: u64,
    /// Control frames received and acted on.
    pub ctrl_received: u64,
    /// Datagrams refused: malformed, another job, wrong ranks, out of range, wrong shape.
    pub refused: u64,
    /// Segments kept for messages not posted yet.
    pub unexpected_kept: u64,
    /// Segments dropped because the unexpected store was full or too far ahead.
    pub unexpected_dropped: u64,
    /// POLLs sent on a timer.
    pub polls: u64,
    /// NACK frames sent at the end of a pass.
    pub nacks: u64,
    /// Gap NACKs sent within a first pass (segments seen lost before the pass ended).
    pub gap_nacks: u64,
    /// Segments resent within their first pass on a gap NACK.
    pub gap_resent: u64,
    /// GRANT frames sent (incast scheduling).
    pub grants: u64,
    /// Second copies of a pass's LAST segment (messages of 4 segments or more).
    pub tail_copies: u64,
}

impl std::ops::AddAssign<&Stats> for Stats {
    /// Adds another endpoint's counters (totals over a job's endpoints).
    fn add_assign(&mut self, o: &Stats) {
        self.data_sent += o.data_sent;
        self.data_resent += o.data_resent;
        self.payload_bytes_sent += o.payload_bytes_sent;
        self.ctrl_sent += o.ctrl_sent;
        self.data_placed += o.data_placed;
        self.data_duplicate += o.data_duplicate;
        self.ctrl_received += o.ctrl_received;
        self.refused += o.refused;
        self.unexpected_kept += o.unexpected_kept;
        self.unexpected_dropped += o.unexpected_dropped;
        self.polls += o.polls;
        self.nacks += o.nacks;
        self.gap_nacks += o.gap_nacks;
        self.gap_resent += o.gap_resent;
        self.grants += o.grants;
        self.tail_copies += o.tail_copies;
    }
}

/// A run of data segments to one peer for one GSO send.
#[derive(Debug, Clone)]
pub struct Bundle {
    /// Destination rank.
    pub peer: u16,
    /// TOS byte.
    pub tos: u8,
    /// Bytes of every datagram but the last.
    pub segment_size: usize,
    /// Its segments in [`TxBatch::headers`] / [`TxBatch::payloads`].
    pub segs: Range<usize>,
}

/// A control frame to send.
#[derive(Debug, Clone)]
pub struct CtrlTx {
    /// Destination rank.
    pub peer: u16,
    /// TOS byte.
    pub tos: u8,
    /// The frame.
    pub bytes: Vec<u8>,
}

/// Datagrams the core wants sent. A driver sends a whole batch before it hands the core
/// anything else: payloads name registered memory that stays valid until then.
#[derive(Debug, Default)]
pub struct TxBatch {
    /// Data bundles.
    pub bundles: Vec<Bundle>,
    /// Segment headers.
    pub headers: Vec<[u8; wire::DATA_HEADER_LEN]>,
    /// Segment payloads: buffer and range.
    pub payloads: Vec<(BufId, Range<usize>)>,
    /// Control frames.
    pub ctrl: Vec<CtrlTx>,
}

impl TxBatch {
    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.bundles.clear();
        self.headers.clear();
        self.payloads.clear();
        self.ctrl.clear();
    }

    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.bundles.is_empty() && self.ctrl.is_empty()
    }
}

/// Per-peer state.
#[derive(Debug)]
struct Peer {
    rtt: Rtt,
    win: Window,
    sends: BTreeMap<u32, SendMsg>,
    recvs: HashMap<u32, RecvMsg>,
    unexpected: HashMap<u32, Unexpected>,
    send_next: u32,
    recv_next: u32,
    /// When a valid datagram last came from this peer.
    alive_at: Option<Instant>,
    /// Messages the peer gave up (ABORT) before this rank posted them, with the culprit:
    /// posting one fails it at once.
    aborted_sends: HashMap<u32, Option<u16>>,
    aborted_recvs: HashMap<u32, Option<u16>>,
    /// The peer gave up every message with this rank (its operations failed on this rank,
    /// `Some(culprit)` naming the rank they failed on).
    gave_up: Option<Option<u16>>,
    /// Every receive numbered below this is finished; `done` holds finished ones above it.
    done_below: u32,
    done: BTreeSet<u32>,
    /// Grants in both directions.
    grants: grant::PeerGrants,
}

impl Peer {
    fn is_done(&self, msg: u32) -> bool {
        msg < self.done_below || self.done.contains(&msg)
    }

    fn mark_done(&mut self, msg: u32) {
        if msg >= self.done_below {
            self.done.insert(msg);
        }
        while self.done.remove(&self.done_below) {
            self.done_below += 1;
        }
    }

    /// First-pass segments sent and not yet seen by the receiver.
    fn in_flight(&self) -> u32 {
        self.sends.values().map(SendMsg::in_flight).sum()
    }
}

/// The state of one endpoint.
#[derive(Debug)]
pub struct Core {
    cfg: CoreConfig,
    peers: Vec<Peer>,
    buffers: Buffers,
    events: VecDeque<Event>,
    ctrl: VecDeque<CtrlTx>,
    stats: Stats,
    unexpected_bytes: usize,
    /// Round-robin start of the next transmit poll.
    rr: usize,
    /// The receiver's budget of segments in flight towards it.
    budget: Window,
    /// The endpoint is closing ([`Core::close`]): only finished messages are answered.
    closing: bool,
}

impl Core {
    /// A core with no messages.
    pub fn new(cfg: CoreConfig) -> Core {
        let peers = (0..cfg.world)
            .map(|_| Peer {
                rtt: Rtt::new(cfg.rto_initial, cfg.rto_min, cfg.rto_max),
                // Never below the ACK interval (see Window::with_floor).
                win: Window::with_floor(cfg.init_cwnd, cfg.max_cwnd, cfg.ack_every),
                sends: BTreeMap::new(),
                recvs: HashMap::new(),
                unexpected: HashMap::new(),
                send_next: 0,
                recv_next: 0,
                alive_at: None,
                aborted_sends: HashMap::new(),
                aborted_recvs: HashMap::new(),
                gave_up: None,
                done_below: 0,
                done: BTreeSet::new(),
                grants: grant::PeerGrants::default(),
            })
            .collect();
        let budget = Window::with_floor(cfg.grant_window, cfg.max_cwnd, cfg.ack_every);
        Core {
            cfg,
            peers,
            buffers: Buffers::default(),
            events: VecDeque::new(),
            ctrl: VecDeque::new(),
            stats: Stats::default(),
            unexpected_bytes: 0,
            rr: 0,
            budget,
            closing: false,
        }
    }

    /// The endpoint is going away but its socket stays open a little (lingering): a peer
    /// that asks again about a message this rank finished (its DONE was lost) still gets the
    /// DONE, while data, POLLs and PINGs about any other message get an ABORT naming this
    /// rank, so a peer that expects more of it fails at once instead of seeing it alive.
    pub fn close(&mut self) {
        self.closing = true;
    }

    /// While closing: tells peer `i` that this rank gave up message `msg` (`our_send`: the
    /// message this rank would send, else the one it would receive), naming itself.
    fn refuse_closing(&mut self, i: usize, msg: u32, our_send: bool) {
        let mut c = self.ctrl_to(i, CtrlOp::Abort, msg, 0);
        c.a = u32::from(self.cfg.rank) + 1;
        // b = 1: about the frame's receiver's send (we give up our receive).
        c.b = u32::from(!our_send);
        self.ctrl_frame(i, c, &[]);
    }

    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The registered buffers (a driver resolves [`TxBatch::payloads`] here).
    pub fn buffers(&self) -> &Buffers {
        &self.buffers
    }

    /// Registers memory for messages.
    pub fn register(&mut self, region: Region) -> BufId {
        self.buffers.insert(region)
    }

    /// Unregisters a buffer, cancelling every message still on it first.
    pub fn unregister(&mut self, id: BufId) -> Option<Region> {
        for p in &mut self.peers {
            p.sends.retain(|_, s| s.buf != id);
            let gone: Vec<u32> = p
                .recvs
                .iter()
                .filter(|(_, r)| r.buf == id)
                .map(|(m, _)| *m)
                .collect();
            for m in gone {
                p.recvs.remove(&m);
                p.mark_done(m);
            }
        }
        self.buffers.remove(id)
    }

    /// A buffer's bytes (the owner reads results here).
    pub fn buffer(&self, id: BufId) -> Option<&[u8]> {
        self.buffers.whole(id)
    }

    /// A buffer's bytes, mutably. Writing a range a posted send covers changes what is sent.
    pub fn buffer_mut(&mut self, id: BufId) -> Option<&mut [u8]> {
        self.buffers.whole_mut(id)
    }

    fn peer_index(&self, peer: u16) -> Result<usize, PostError> {
        if peer == self.cfg.rank || peer >= self.cfg.world {
            return Err(PostError::Peer(peer));
        }
        Ok(usize::from(peer))
    }

    /// Reserves `n` consecutive message numbers for sends to `peer`; returns the first.
    pub fn reserve_sends(&mut self, peer: u16, n: u32) -> Result<u32, PostError> {
        let i = self.peer_index(peer)?;
        let p = &mut self.peers[i];
        let base = p.send_next;
        p.send_next = p.send_next.wrapping_add(n);
        Ok(base)
    }

    /// Reserves `n` consecutive message numbers for receives from `peer`; returns the first.
    pub fn reserve_recvs(&mut self, peer: u16, n: u32) -> Result<u32, PostError> {
        let i = self.peer_index(peer)?;
        let p = &mut self.peers[i];
        let base = p.recv_next;
        p.recv_next = p.recv_next.wrapping_add(n);
        Ok(base)
    }

    /// Marks a reserved receive number as never used (so the bookkeeping of finished
    /// numbers moves past it).
    pub fn skip_recv(&mut self, peer: u16, msg: u32) -> Result<(), PostError> {
        let i = self.peer_index(peer)?;
        let p = &mut self.peers[i];
        if let Some(u) = p.unexpected.remove(&msg) {
            self.unexpected_bytes -= u.bytes;
        }
        p.mark_done(msg);
        Ok(())
    }

    fn segments(&self, len: usize) -> usize {
        len.div_ceil(self.cfg.seg_payload).max(1)
    }

    /// Posts a send of `range` of buffer `buf` to `peer` as message `msg`; it starts at the
    /// next [`Core::poll_transmit`].
    pub fn post_send(
        &mut self,
        now: Instant,
        peer: u16,
        msg: u32,
        buf: BufId,
        range: Range<usize>,
        opts: SendOpts,
    ) -> Result<(), PostError> {
        let i = self.peer_index(peer)?;
        if self.buffers.get(buf, range.clone()).is_none() {
            return Err(PostError::Range(range));
        }
        let total = u32::try_from(range.len()).map_err(|_| PostError::TooLong(range.len()))?;
        let nsegs = self.segments(range.len());
        for given in [opts.meta.len(), opts.tos_per_segment.len()] {
            if given != 0 && given != nsegs {
                return Err(PostError::Meta {
                    got: given,
                    want: nsegs,
                });
            }
        }
        let p = &mut self.peers[i];
        if p.sends.contains_key(&msg) {
            return Err(PostError::Busy { peer, msg });
        }
        if let Some(culprit) = p.aborted_sends.remove(&msg).or(p.gave_up) {
            self.events.push_back(Event::Failed {
                peer,
                msg,
                send: true,
                error: MsgError::Aborted { peer, msg, culprit },
            });
            return Ok(());
        }
        p.sends.insert(
            msg,
            SendMsg::new(now, msg, buf, range.start, total, nsegs as u32, opts),
        );
        Ok(())
    }

    /// Posts a receive of message `msg` from `peer` into `range` of buffer `buf` (the
    /// message must have exactly that length). Data that arrived early is placed now.
    pub fn post_recv(
        &mut self,
        now: Instant,
        peer: u16,
        msg: u32,
        buf: BufId,
        range: Range<usize>,
        opts: RecvOpts,
    ) -> Result<(), PostError> {
        let i = self.peer_index(peer)?;
        if self.buffers.get(buf, range.clone()).is_none() {
            return Err(PostError::Range(range));
        }
        if !(0.0..1.0).contains(&opts.loss_bound) {
            return Err(PostError::Bound(opts.loss_bound));
        }
        let total = u32::try_from(range.len()).map_err(|_| PostError::TooLong(range.len()))?;
        check_ranges(&opts, range.len())?;
        let nsegs = self.segments(range.len()) as u32;
        {
            let p = &self.peers[i];
            if p.recvs.contains_key(&msg) || p.is_done(msg) {
                return Err(PostError::Busy { peer, msg });
            }
        }
        let gave_up = self.peers[i].gave_up;
        if let Some(culprit) = self.peers[i].aborted_recvs.remove(&msg).or(gave_up) {
            let p = &mut self.peers[i];
            p.mark_done(msg);
            if let Some(u) = p.unexpected.remove(&msg) {
                self.unexpected_bytes -= u.bytes;
            }
            self.events.push_back(Event::Failed {
                peer,
                msg,
                send: false,
                error: MsgError::Aborted { peer, msg, culprit },
            });
            return Ok(());
        }
        let r = RecvMsg::new(now, msg, buf, range.start, total, nsegs, opts);
        self.peers[i].recvs.insert(msg, r);
        if let Some(u) = self.peers[i].unexpected.remove(&msg) {
            self.unexpected_bytes -= u.bytes;
            for seg in u.segs {
                self.place(now, seg.at, i, msg, &seg.header, &seg.payload, seg.tos);
            }
            if let Some(pass) = u.pass_end {
                self.end_of_pass(now, i, msg, pass);
            }
        }
        Ok(())
    }

    /// Sets (or moves) the deadline of a posted receive: it ends at `at` with what arrived.
    pub fn set_deadline(&mut self, peer: u16, msg: u32, at: Instant) {
        if let Ok(i) = self.peer_index(peer) {
            if let Some(r) = self.peers[i].recvs.get_mut(&msg) {
                r.set_deadline(at);
            }
        }
    }

    /// Cancels a send (nothing more is sent; the receiver is not told).
    pub fn cancel_send(&mut self, peer: u16, msg: u32) {
        if let Ok(i) = self.peer_index(peer) {
            self.peers[i].sends.remove(&msg);
        }
    }

    /// Cancels a receive (later data for it is refused as finished).
    pub fn cancel_recv(&mut self, peer: u16, msg: u32) {
        if let Ok(i) = self.peer_index(peer) {
            let p = &mut self.peers[i];
            p.recvs.remove(&msg);
            p.mark_done(msg);
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Smoothed RTT to a peer (`None` before a sample).
    pub fn srtt(&self, peer: u16) -> Option<Duration> {
        self.peers.get(usize::from(peer))?.rtt.srtt()
    }

    /// Whether any send has segments it may send now.
    pub fn wants_transmit(&self) -> bool {
        !self.ctrl.is_empty()
            || self.peers.iter().enumerate().any(|(i, p)| {
                let room = self.send_window(i).saturating_sub(p.in_flight());
                p.sends.values().any(|s| s.can_send(room))
            })
    }

    fn ctrl_frame(&mut self, peer: usize, c: Ctrl, bitmap: &[u8]) {
        let mut bytes = vec![0u8; wire::CTRL_HEADER_LEN + bitmap.len()];
        if c.emit(bitmap, &mut bytes).is_ok() {
            self.stats.ctrl_sent += 1;
            self.ctrl.push_back(CtrlTx {
                peer: peer as u16,
                tos: self.cfg.ctrl_tos,
                bytes,
            });
        }
    }

    fn ctrl_to(&self, peer: usize, op: CtrlOp, msg: u32, pass: u8) -> Ctrl {
        Ctrl {
            op,
            pass,
            job: self.cfg.job,
            src: self.cfg.rank,
            dst: peer as u16,
            msg,
            a: 0,
            b: 0,
            c: 0,
        }
    }

    /// A datagram from rank `from` (the driver has matched its source address to the rank),
    /// with the TOS byte it arrived with. Anything malformed, of another job, for another
    /// rank, claiming another sender or outside its message is refused and counted.
    pub fn handle_datagram(&mut self, now: Instant, from: u16, tos: u8, d: &[u8]) {
        let Ok(i) = self.peer_index(from) else {
            self.stats.refused += 1;
            return;
        };
        match wire::kind(d) {
            Ok(wire::KIND_DATA) => match DataHeader::parse(d) {
                Ok((h, payload))
                    if h.job == self.cfg.job && h.dst == self.cfg.rank && h.src == from =>
                {
                    self.peers[i].alive_at = Some(now);
                    self.on_data(now, i, &h, payload, tos)
                }
                _ => self.stats.refused += 1,
            },
            Ok(wire::KIND_CTRL) => match Ctrl::parse(d) {
                Ok((c, bitmap))
                    if c.job == self.cfg.job && c.dst == self.cfg.rank && c.src == from =>
                {
                    self.stats.ctrl_received += 1;
                    self.peers[i].alive_at = Some(now);
                    self.on_ctrl(now, i, &c, bitmap)
                }
                _ => self.stats.refused += 1,
            },
            _ => self.stats.refused += 1,
        }
    }

    /// A failure of `msg` with peer `i` after `waited` without progress; whether the peer
    /// still answers decides what it is blamed for.
    fn silent(&self, i: usize, msg: u32, send: bool, waited: Duration, now: Instant) -> Event {
        let alive = self.peers[i]
            .alive_at
            .is_some_and(|t| now.saturating_duration_since(t) < self.cfg.peer_timeout / 2);
        Event::Failed {
            peer: i as u16,
            msg,
            send,
            error: MsgError::PeerSilent {
                peer: i as u16,
                msg,
                waited,
                alive,
            },
        }
    }

    /// Queues failures with the dead peers' first: an operation fails on its first event,
    /// and a rank that waits on a live peer which itself waits on a dead one should name the
    /// dead one.
    fn push_failures(&mut self, mut failed: Vec<Event>) {
        failed.sort_by_key(|e| {
            matches!(
                e,
                Event::Failed {
                    error: MsgError::PeerSilent { alive: true, .. },
                    ..
                }
            )
        });
        self.events.extend(failed);
    }

    /// This rank's operations with `peer` failed (on rank `culprit`): tell it once (ABORT of
    /// every message, `msg` = `u32::MAX`), so its messages with this rank, posted or to
    /// come, fail at once naming the culprit.
    pub fn abort_peer(&mut self, peer: u16, culprit: Option<u16>) {
        let Ok(i) = self.peer_index(peer) else {
            return;
        };
        let mut c = self.ctrl_to(i, CtrlOp::Abort, ABORT_ALL, 0);
        c.a = culprit.map_or(0, |r| u32::from(r) + 1);
        self.ctrl_frame(i, c, &[]);
    }

    /// The peer's operations failed: fail every message with it, now and when posted.
    pub(super) fn peer_gave_up(&mut self, i: usize, culprit: Option<u16>) {
        let peer = i as u16;
        self.peers[i].gave_up = Some(culprit);
        self.fail_all(i, |msg| MsgError::Aborted { peer, msg, culprit });
    }

    /// Fails every message posted with peer `i`, each with `error(msg)`.
    fn fail_all(&mut self, i: usize, error: impl Fn(u32) -> MsgError) {
        let peer = i as u16;
        let p = &mut self.peers[i];
        let sends: Vec<u32> = std::mem::take(&mut p.sends).into_keys().collect();
        let recvs: Vec<u32> = p.recvs.drain().map(|(m, _)| m).collect();
        for &m in &recvs {
            p.mark_done(m);
        }
        let failed = sends
            .into_iter()
            .map(|m| (m, true))
            .chain(recvs.into_iter().map(|m| (m, false)))
            .map(|(msg, send)| Event::Failed {
                peer,
                msg,
                send,
                error: error(msg),
            });
        self.events.extend(failed);
    }

    /// Gives up a message of an operation that failed and tells the peer (ABORT, naming
    /// `culprit`, the rank the operation failed on), so the peer's operation fails now with
    /// the culprit's name instead of waiting for a timeout.
    pub fn abort(&mut self, peer: u16, msg: u32, send: bool, culprit: Option<u16>) {
        let Ok(i) = self.peer_index(peer) else {
            return;
        };
        let p = &mut self.peers[i];
        let posted = if send {
            p.sends.remove(&msg).is_some()
        } else {
            let r = p.recvs.remove(&msg).is_some();
            p.mark_done(msg);
            r
        };
        if posted {
            let mut c = self.ctrl_to(i, CtrlOp::Abort, msg, 0);
            // a: the culprit + 1 (0: none); b: 1 = about the frame's receiver's send (we gave
            // up our receive), 0 = about its receive (we gave up our send).
            c.a = culprit.map_or(0, |r| u32::from(r) + 1);
            c.b = u32::from(!send);
            self.ctrl_frame(i, c, &[]);
        }
    }

    /// The host of `peer` reports its socket closed: every message with it fails now (rather
    /// than after the peer timeout).
    pub fn peer_unreachable(&mut self, peer: u16) {
        let Ok(i) = self.peer_index(peer) else {
            return;
        };
        self.fail_all(i, |msg| MsgError::Unreachable { peer, msg });
    }

    /// The earliest instant a timer fires.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.peers
            .iter()
            .flat_map(|p| {
                p.sends.values().filter_map(|s| s.timer).chain(
                    p.recvs
                        .values()
                        .map(|r| r.next_timer(self.cfg.peer_timeout, p.alive_at)),
                )
            })
            .min()
    }
}

#[cfg(test)]
mod tests;
