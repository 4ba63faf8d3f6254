//! The sending half: segments out within the peer's window, passes of retransmissions on
//! NACKs, POLL on a timer.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{Bundle, Core, CtrlOp, Event, PassOrder, SendOpts, TxBatch};
use crate::mem::BufId;
use crate::wire::{self, flags, Ctrl, DataHeader};

/// Messages of at least this many segments send each pass's LAST segment twice, and their
/// receiver answers the pass twice (DONE or NACK): a lost LAST, NACK or DONE otherwise costs
/// a retransmission timeout, and the timeout covers the queue a window fills at a slow link
/// (tens of milliseconds at 100 Mbit/s), where one more segment and one more control frame
/// cost microseconds. Smaller messages (barrier tokens, small transfers) are not doubled.
pub(super) const TAIL_COPY_MIN_SEGS: u32 = 4;

/// A message being sent.
#[derive(Debug)]
pub(super) struct SendMsg {
    pub(super) buf: BufId,
    start: usize,
    total: u32,
    nsegs: u32,
    opts: SendOpts,
    /// Next position of the first pass (segment `seg_at(next)`).
    next: u32,
    /// The first pass's order (in order unless the message is rotated).
    order: PassOrder,
    pass: u8,
    /// Segments to resend in this pass, and which are queued or sent in it.
    resend: VecDeque<u32>,
    queued: Vec<u64>,
    /// The LAST segment (or a POLL) of `pass` went out.
    finished_pass: bool,
    /// The receiver's count of distinct segments and one past the highest first-pass
    /// position it has seen.
    acked: u32,
    highest: u32,
    ce: u32,
    /// When the LAST segment or POLL of this pass went out, and POLLs unanswered.
    last_tx: Option<Instant>,
    polls: u32,
    /// A first-pass segment timed for an RTT sample, and when it went: the ACK that first
    /// shows the receiver past it gives the sample (one at a time, as TCP times segments).
    /// So the RTO follows the time an ACK takes while a window is queued on the path, not
    /// only the end-of-pass round trip, and a sender whose window waits in a slow queue does
    /// not time out and halve it.
    probe: Option<(u32, Instant)>,
    /// Data segments sent for this message so far (every pass, probes included).
    segments_out: u32,
    /// The LAST segment to send once more, right behind itself, and the pass that got its
    /// copy (see [`TAIL_COPY_MIN_SEGS`]).
    tail_copy: Option<(u32, u8)>,
    copied_pass: Option<u8>,
    pub(super) timer: Option<Instant>,
    heard: Instant,
}

impl SendMsg {
    pub(super) fn new(
        now: Instant,
        msg: u32,
        buf: BufId,
        start: usize,
        total: u32,
        nsegs: u32,
        opts: SendOpts,
    ) -> SendMsg {
        let order = PassOrder::new(opts.rotate, msg, nsegs);
        SendMsg {
            buf,
            start,
            total,
            nsegs,
            opts,
            next: 0,
            order,
            pass: 0,
            resend: VecDeque::new(),
            queued: Vec::new(),
            finished_pass: false,
            acked: 0,
            highest: 0,
            ce: 0,
            last_tx: None,
            polls: 0,
            probe: None,
            segments_out: 0,
            tail_copy: None,
            copied_pass: None,
            timer: None,
            heard: now,
        }
    }

    /// First-pass segments sent beyond what the receiver has seen.
    pub(super) fn in_flight(&self) -> u32 {
        if self.pass == 0 {
            self.next.saturating_sub(self.highest)
        } else {
            0
        }
    }

    /// Whether the message has segments it may send with `room` in the window.
    pub(super) fn can_send(&self, room: u32) -> bool {
        self.tail_copy.is_some()
            || !self.resend.is_empty()
            || (self.pass == 0 && self.next < self.nsegs && room > 0)
    }

    /// More room came (a grant grew): a first pass that waited for it need not ask.
    pub(super) fn clear_stall_timer(&mut self) {
        if self.pass == 0 && !self.finished_pass {
            self.timer = None;
        }
    }

    fn seg_range(&self, seg: u32, seg_payload: usize) -> (usize, usize) {
        let off = seg as usize * seg_payload;
        let len = (self.total as usize).saturating_sub(off).min(seg_payload);
        (off, len)
    }

    /// The TOS byte of segment `seg`: its own tag, or the message's.
    fn tos_of(&self, seg: u32) -> u8 {
        self.opts
            .tos_per_segment
            .get(seg as usize)
            .copied()
            .unwrap_or(self.opts.tos)
    }

    fn is_queued(&self, seg: u32) -> bool {
        self.queued
            .get(seg as usize / 64)
            .is_some_and(|w| w & (1 << (seg % 64)) != 0)
    }

    fn set_queued(&mut self, seg: u32) {
        let w = seg as usize / 64;
        if self.queued.len() <= w {
            self.queued.resize(w + 1, 0);
        }
        self.queued[w] |= 1 << (seg % 64);
    }
}

impl Core {
    /// Fills `out` with what may be sent now: control frames, then data bundles round-robin
    /// over peers (retransmissions first, then first-pass segments within the window).
    pub fn poll_transmit(&mut self, now: Instant, out: &mut TxBatch, max_bundles: usize) {
        out.clear();
        out.ctrl.extend(self.ctrl.drain(..));
        let world = self.peers.len();
        let seg_payload = self.cfg.seg_payload;
        let max_bundle = self.cfg.max_bundle.max(1);
        let retransmit_ect = self.cfg.retransmit_ect;
        for k in 0..world {
            if out.bundles.len() >= max_bundles {
                break;
            }
            let i = (self.rr + k) % world;
            let window = self.send_window(i);
            let p = &mut self.peers[i];
            let mut room = window.saturating_sub(p.in_flight());
            let rto = p.rtt.rto();
            for (&msg, s) in p.sends.iter_mut() {
                while out.bundles.len() < max_bundles && s.can_send(room) {
                    let first = out.headers.len();
                    let retransmit = !s.resend.is_empty() || s.tail_copy.is_some();
                    let mut last_seg_len = None;
                    let mut bundle_tos = None;
                    while out.headers.len() - first < max_bundle && last_seg_len.is_none() {
                        let next = if let Some((seg, _)) = s.tail_copy {
                            Some(seg)
                        } else if retransmit {
                            s.resend.front().copied()
                        } else if room > 0 && s.next < s.nsegs {
                            Some(s.order.seg_at(s.next))
                        } else {
                            None
                        };
                        let Some(seg) = next else {
                            break;
                        };
                        // A bundle has one TOS byte: a segment tagged otherwise starts the next.
                        // The LAST's copy goes as the LAST went.
                        let copy = s.tail_copy.is_some_and(|(c, _)| c == seg);
                        let mut tos = s.tos_of(seg);
                        if let Some((_, t)) = s.tail_copy.filter(|_| copy) {
                            tos = t;
                        } else if retransmit && retransmit_ect && tos & 3 == 0 {
                            // What the bound still needs is important: marked above a
                            // switch's threshold, not dropped again (DLCP; the window and
                            // the grants react to the marks).
                            tos |= 0b10;
                        }
                        if bundle_tos.is_some_and(|t| t != tos) {
                            break;
                        }
                        bundle_tos = Some(tos);
                        let is_last = if copy {
                            s.tail_copy = None;
                            true
                        } else if retransmit {
                            s.resend.pop_front();
                            // Resends within the first pass (gap NACKs) go ahead of its new
                            // segments, the last of which ends it.
                            s.resend.is_empty() && (s.pass > 0 || s.next == s.nsegs)
                        } else {
                            if s.probe.is_none() {
                                s.probe = Some((s.next, now));
                            }
                            s.next += 1;
                            room -= 1;
                            s.next == s.nsegs
                        };
                        let (off, len) = s.seg_range(seg, seg_payload);
                        let mut fl = if retransmit { flags::RETRANSMIT } else { 0 };
                        if is_last {
                            fl |= flags::LAST;
                        }
                        if tos & 3 != 0 {
                            fl |= flags::IMPORTANT;
                        }
                        let h = DataHeader {
                            flags: fl,
                            pass: s.pass,
                            job: self.cfg.job,
                            src: self.cfg.rank,
                            dst: i as u16,
                            msg,
                            offset: off as u64,
                            total: s.total,
                            length: len as u16,
                            layer: s.opts.layer,
                            meta: s.opts.meta.get(seg as usize).copied().unwrap_or(0),
                        };
                        let mut hb = [0u8; wire::DATA_HEADER_LEN];
                        h.emit(&mut hb);
                        out.headers.push(hb);
                        out.payloads
                            .push((s.buf, s.start + off..s.start + off + len));
                        self.stats.payload_bytes_sent += len as u64;
                        s.segments_out = s.segments_out.saturating_add(1);
                        if copy {
                            self.stats.tail_copies += 1;
                        } else if retransmit {
                            self.stats.data_resent += 1;
                        } else {
                            self.stats.data_sent += 1;
                        }
                        // A short segment must end a GSO bundle.
                        if len < seg_payload || is_last {
                            last_seg_len = Some(len);
                        }
                        if is_last {
                            s.finished_pass = true;
                            s.last_tx = Some(now);
                            s.polls = 0;
                            s.timer = Some(now + rto);
                            if !copy
                                && s.nsegs >= TAIL_COPY_MIN_SEGS
                                && s.copied_pass != Some(s.pass)
                            {
                                s.tail_copy = Some((seg, tos));
                                s.copied_pass = Some(s.pass);
                            }
                        }
                    }
                    let n = out.headers.len() - first;
                    if n == 0 {
                        break;
                    }
                    out.bundles.push(Bundle {
                        peer: i as u16,
                        tos: bundle_tos.unwrap_or(s.opts.tos),
                        segment_size: if n == 1 {
                            wire::DATA_HEADER_LEN + last_seg_len.unwrap_or(seg_payload)
                        } else {
                            wire::DATA_HEADER_LEN + seg_payload
                        },
                        segs: first..first + n,
                    });
                }
                // Blocked by the window with the pass unfinished: make sure a lost ACK is
                // asked about rather than waited for.
                if s.pass == 0 && s.next < s.nsegs && room == 0 && s.timer.is_none() {
                    s.timer = Some(now + rto);
                }
            }
        }
        self.rr = (self.rr + 1) % world.max(1);
    }

    /// A control frame about one of our sends (ACK, DONE, NACK).
    pub(super) fn on_send_ctrl(&mut self, now: Instant, i: usize, c: &Ctrl, bitmap: &[u8]) {
        let p = &mut self.peers[i];
        let Some(s) = p.sends.get_mut(&c.msg) else {
            return; // finished or cancelled: control frames are idempotent
        };
        // Only progress counts against the peer timeout: an ACK that says nothing new (a
        // receiver that holds our data but has not posted its receive) keeps the peer alive,
        // not the message.
        let progress = c.a > s.acked || c.c > s.highest;
        if c.op != CtrlOp::Ack || progress {
            s.heard = now;
        }
        match c.op {
            CtrlOp::Ack => {
                if let Some((pos, sent)) = s.probe {
                    // Karn: not when a POLL may have asked for this ACK.
                    if c.c > pos {
                        if s.polls == 0 {
                            p.rtt.sample(now.saturating_duration_since(sent));
                        }
                        s.probe = None;
                    }
                }
                if c.a > s.acked {
                    let marked = c.b.saturating_sub(s.ce);
                    p.win.on_ack(c.a - s.acked, marked);
                    s.acked = c.a.min(s.nsegs);
                    s.ce = s.ce.max(c.b);
                }
                s.highest = s.highest.max(c.c.min(s.nsegs));
                // Only progress ends a stall: an ACK that answers a POLL with nothing new (the
                // POLL, at the control DSCP, overtook data still queued, or the data is lost)
                // leaves the backing-off timer running.
                if progress {
                    s.polls = 0;
                    if !s.finished_pass {
                        s.timer = None;
                    }
                }
            }
            CtrlOp::Done => {
                if c.pass == s.pass && s.polls == 0 {
                    if let Some(t) = s.last_tx {
                        p.rtt.sample(now.saturating_duration_since(t));
                    }
                }
                if s.pass == 0 && c.c > 0 {
                    p.win.on_pass_loss(c.c, s.nsegs);
                }
                let segments = p.sends.remove(&c.msg).map_or(0, |s| s.segments_out);
                self.events.push_back(Event::Sent {
                    peer: i as u16,
                    msg: c.msg,
                    missing: c.c,
                    segments,
                });
            }
            CtrlOp::Nack if c.c == wire::NACK_GAP => {
                // Lost within the first pass: resend ahead of the pass's new segments, or at
                // once when every segment of the pass has gone out (a window queued at a slow
                // link leaves the sender long before it arrives: waiting for the pass's NACK
                // would cost the whole queue and a round trip). The last resend carries LAST,
                // so the receiver answers for the pass again. A gap NACK of a later pass is
                // stale: that pass's NACK names what is still missing.
                if c.pass != 0 || s.pass != 0 {
                    return;
                }
                for bit in 0..c.b.min(bitmap.len() as u32 * 8) {
                    if bitmap[(bit / 8) as usize] & (1 << (bit % 8)) == 0 {
                        continue;
                    }
                    let seg = c.a.saturating_add(bit);
                    if seg < s.nsegs && s.order.pos_of(seg) < s.next && !s.is_queued(seg) {
                        s.set_queued(seg);
                        s.resend.push_back(seg);
                        self.stats.gap_resent += 1;
                        if s.probe.is_some_and(|(p, _)| p == s.order.pos_of(seg)) {
                            s.probe = None;
                        }
                    }
                }
            }
            CtrlOp::Nack => {
                let fresh = c.pass == s.pass && s.finished_pass;
                let same_answer = c.pass.wrapping_add(1) == s.pass;
                if !fresh && !same_answer {
                    return;
                }
                if fresh {
                    if s.polls == 0 {
                        if let Some(t) = s.last_tx {
                            p.rtt.sample(now.saturating_duration_since(t));
                        }
                    }
                    let missing: u32 = bitmap.iter().map(|b| b.count_ones()).sum();
                    if s.pass == 0 {
                        p.win.on_pass_loss(missing, s.nsegs);
                    }
                    s.pass = s.pass.wrapping_add(1);
                    s.finished_pass = false;
                    s.queued.clear();
                    s.polls = 0;
                    s.timer = None;
                    s.highest = s.nsegs;
                }
                for bit in 0..c.b.min(bitmap.len() as u32 * 8) {
                    if bitmap[(bit / 8) as usize] & (1 << (bit % 8)) == 0 {
                        continue;
                    }
                    let seg = c.a.saturating_add(bit);
                    if seg < s.nsegs && !s.is_queued(seg) {
                        s.set_queued(seg);
                        s.resend.push_back(seg);
                    }
                }
                if fresh && s.resend.is_empty() {
                    // Nothing named: ask again after a timeout rather than spin.
                    s.finished_pass = true;
                    s.timer = Some(now + p.rtt.rto());
                }
            }
            CtrlOp::Poll | CtrlOp::Abort | CtrlOp::Ping | CtrlOp::Pong | CtrlOp::Grant => {}
        }
    }

    /// Timers of sends: POLL with exponential back-off, failure after the peer timeout
    /// without progress (returned, for [`Core::push_failures`]).
    pub(super) fn send_timers(&mut self, now: Instant) -> Vec<Event> {
        let mut out = Vec::new();
        let peer_timeout = self.cfg.peer_timeout;
        let rto_max = self.cfg.rto_max;
        for i in 0..self.peers.len() {
            let mut polls = Vec::new();
            let mut failed = Vec::new();
            {
                let p = &mut self.peers[i];
                let rto = p.rtt.rto();
                for (&msg, s) in p.sends.iter_mut() {
                    let Some(t) = s.timer else { continue };
                    if t > now {
                        continue;
                    }
                    let waited = now.saturating_duration_since(s.heard);
                    if waited >= peer_timeout {
                        failed.push((msg, waited));
                        continue;
                    }
                    // A first pass stalled with segments in flight: probe the tail (TCP's
                    // tail loss probe). Resending the last segment sent makes the receiver see
                    // the pass's highest segment, so if the window's last segments were all
                    // lost, its gap NACK names them and the POLL's ACK frees the window; if
                    // they are only queued behind a slow bottleneck (a window can take longer
                    // than an RTO to drain there) it costs one duplicate. Taking the window
                    // for lost instead (counting nothing in flight) sent a second window on
                    // top of the queued one: a 4 MiB ring on 100 Mbit/s links took 894 ms with
                    // 901 POLLs, against 552 ms and 41 without. Nor does a stall halve the
                    // window: on a loaded host most stalls are a receiver not yet scheduled,
                    // and congestion shows as CE marks and gaps, which do.
                    if s.pass == 0 && !s.finished_pass && s.next > s.highest {
                        let tail = s.order.seg_at(s.next - 1);
                        if !s.resend.contains(&tail) {
                            s.set_queued(tail);
                            s.resend.push_back(tail);
                        }
                    }
                    s.polls += 1;
                    s.last_tx = Some(now);
                    let backoff = rto
                        .saturating_mul(1u32 << s.polls.min(16))
                        .min(rto_max.max(rto));
                    s.timer = Some(now + backoff.max(Duration::from_micros(100)));
                    polls.push((msg, s.pass, s.finished_pass, s.next));
                }
                for (msg, _) in &failed {
                    p.sends.remove(msg);
                }
            }
            for (msg, pass, finished, next) in polls {
                self.stats.polls += 1;
                let mut c = self.ctrl_to(i, CtrlOp::Poll, msg, pass);
                c.c = u32::from(finished);
                c.a = next;
                self.ctrl_frame(i, c, &[]);
            }
            for (msg, waited) in failed {
                out.push(self.silent(i, msg, true, waited, now));
            }
        }
        out
    }
}
