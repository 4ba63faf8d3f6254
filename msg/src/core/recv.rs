//! The receiving half: placement by offset (copy or reduce), the bitmap, DLCP's bound and
//! the time bound, ACK/NACK/DONE, and data kept for messages not posted yet.

use std::time::{Duration, Instant};

use super::send::TAIL_COPY_MIN_SEGS;
use super::{Core, CtrlOp, Ended, Event, MsgError, PassOrder, Place, RecvOpts};
use crate::mem::BufId;
use crate::reduce::combine_into;
use crate::wire::{flags, Ctrl, DataHeader, MAX_BITMAP, NACK_GAP};

/// What a finished receive got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvReport {
    /// Segments of the message.
    pub segments: u32,
    /// Segments that never arrived (their bytes are as they were before the receive).
    pub missing: u32,
    /// What ended it.
    pub ended: Ended,
    /// Which segments arrived (bit i of word i/64); `None` when all did.
    pub arrived: Option<Vec<u64>>,
    /// Each segment's meta word (0 where missing), when the receive asked to keep them.
    pub meta: Vec<u64>,
    /// Passes the sender made (1: nothing resent).
    pub passes: u32,
    /// The message's length (the posted range's, or less for an `up_to` receive).
    pub len: u32,
    /// When the first placed segment arrived (on the clock the core is driven with; for
    /// data kept before the receive was posted, its arrival, not the posting). `None` when
    /// nothing was placed. With `last_at`, a receiver times a message's packets (passive
    /// throughput measurement) without a clock of its own in the core.
    pub first_at: Option<Instant>,
    /// When the last placed segment arrived.
    pub last_at: Option<Instant>,
}

impl RecvReport {
    /// Whether segment `seg` arrived.
    pub fn has(&self, seg: usize) -> bool {
        match &self.arrived {
            None => seg < self.segments as usize,
            Some(w) => w.get(seg / 64).is_some_and(|x| x & (1 << (seg % 64)) != 0),
        }
    }

    /// The byte ranges (from the start of the message, within its `len`) of the segments
    /// that never arrived, for segments of `seg_payload` bytes: what a receiver zero-fills
    /// or skips when it checks the rest.
    pub fn missing_ranges(&self, seg_payload: usize) -> Vec<std::ops::Range<usize>> {
        if self.arrived.is_none() {
            return Vec::new();
        }
        let len = self.len as usize;
        (0..self.segments as usize)
            .filter(|&i| !self.has(i))
            .map(|i| (i * seg_payload).min(len)..((i + 1) * seg_payload).min(len))
            .collect()
    }
}

/// A posted receive.
#[derive(Debug)]
pub(super) struct RecvMsg {
    pub(super) buf: BufId,
    start: usize,
    total: u32,
    nsegs: u32,
    /// The length is known: the posted one, or (`up_to`) learned from the first segment.
    known: bool,
    opts: RecvOpts,
    need: u32,
    got: Vec<u64>,
    count: u32,
    ce: u32,
    /// One past the highest first-pass position received (the segment order of a rotated
    /// message: `rot` first).
    highest: u32,
    order: PassOrder,
    meta: Vec<u64>,
    since_ack: u32,
    /// Segments below this were looked at for gaps (first pass only), and how many missing
    /// ones among them the loss bound absorbs (not asked for).
    gap_checked: u32,
    gap_tolerated: u32,
    /// Segments the gap scan found missing (named or tolerated), for the receiver's budget.
    gap_lost: u32,
    /// When we last asked the silent sender whether it is alive.
    pinged: Option<Instant>,
    /// The highest pass the sender said it finished.
    pass_end: Option<u8>,
    heard: Instant,
    /// Arrival of the first and the last placed segment.
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    /// The loss ranges' budgets (empty: the message's bound alone).
    ranges: Vec<RangeBudget>,
    /// With ranges: the missing segments the bound absorbs (not asked for), and how many.
    tolerated: Vec<u64>,
    tolerated_count: u32,
}

/// One loss range of a receive: the bytes it may do without, and has done without.
#[derive(Debug)]
struct RangeBudget {
    start: usize,
    end: usize,
    budget: usize,
    lost: usize,
}

impl RecvMsg {
    pub(super) fn new(
        now: Instant,
        msg: u32,
        buf: BufId,
        start: usize,
        total: u32,
        nsegs: u32,
        opts: RecvOpts,
    ) -> RecvMsg {
        let lose = (opts.loss_bound * f64::from(nsegs)).floor() as u32;
        let ranges: Vec<RangeBudget> = opts
            .ranges
            .iter()
            .map(|r| RangeBudget {
                start: r.start,
                end: r.end,
                budget: (opts.loss_bound * r.len() as f64).floor() as usize,
                lost: 0,
            })
            .collect();
        let tolerated = if ranges.is_empty() {
            Vec::new()
        } else {
            vec![0; (nsegs as usize).div_ceil(64)]
        };
        RecvMsg {
            buf,
            start,
            total,
            nsegs,
            known: !opts.up_to,
            need: nsegs - lose.min(nsegs),
            got: vec![0; (nsegs as usize).div_ceil(64)],
            count: 0,
            ce: 0,
            highest: 0,
            order: PassOrder::new(opts.rotate && !opts.up_to, msg, nsegs),
            meta: if opts.keep_meta {
                vec![0; nsegs as usize]
            } else {
                Vec::new()
            },
            since_ack: 0,
            gap_checked: 0,
            gap_tolerated: 0,
            gap_lost: 0,
            pinged: None,
            pass_end: None,
            heard: now,
            first_at: None,
            last_at: None,
            ranges,
            tolerated,
            tolerated_count: 0,
            opts,
        }
    }

    fn is_tolerated(&self, seg: u32) -> bool {
        self.tolerated
            .get(seg as usize / 64)
            .is_some_and(|w| w & (1 << (seg % 64)) != 0)
    }

    /// With ranges: does without segment `seg` (of `seg_payload` bytes) if the message's
    /// bound and every range it overlaps can absorb it.
    fn tolerate(&mut self, seg: u32, seg_payload: usize) -> bool {
        if self.is_tolerated(seg) {
            return true;
        }
        if self.tolerated_count >= self.nsegs - self.need {
            return false;
        }
        let a = seg as usize * seg_payload;
        let b = (a + seg_payload).min(self.total as usize);
        let first = self.ranges.partition_point(|r| r.end <= a);
        let overlap = |r: &RangeBudget| r.end.min(b).saturating_sub(r.start.max(a));
        let hit = self.ranges[first..].iter().take_while(|r| r.start < b);
        if hit.clone().any(|r| r.lost + overlap(r) > r.budget) {
            return false;
        }
        for r in self.ranges[first..].iter_mut().take_while(|r| r.start < b) {
            r.lost += overlap(r);
        }
        self.tolerated[seg as usize / 64] |= 1 << (seg % 64);
        self.tolerated_count += 1;
        true
    }

    /// Whether the receive may end within its bound once the sender ended a pass.
    fn within_bound(&self) -> bool {
        if self.ranges.is_empty() {
            self.count >= self.need
        } else {
            self.count + self.tolerated_count >= self.nsegs
        }
    }

    /// With ranges, after a pass: does without what the bound absorbs and returns the rest
    /// as a NACK bitmap (at most MAX_BITMAP bytes; `None` when nothing else is needed).
    fn ranged_nack(&mut self, seg_payload: usize) -> Option<(u32, Vec<u8>, u32)> {
        let mut named: Vec<u32> = Vec::new();
        for seg in 0..self.nsegs {
            if self.has(seg) || self.tolerate(seg, seg_payload) {
                continue;
            }
            if named
                .first()
                .is_some_and(|&f| seg - f >= MAX_BITMAP as u32 * 8)
            {
                break;
            }
            named.push(seg);
        }
        bitmap_of(&named)
    }

    pub(super) fn next_timer(&self, peer_timeout: Duration, alive_at: Option<Instant>) -> Instant {
        let idle = (self.silent_since(alive_at) + peer_timeout).min(self.next_ping(peer_timeout));
        match self.opts.deadline {
            Some(d) => d.min(idle),
            None => idle,
        }
    }

    /// Since when the receive counts its peer silent: the last progress, or for a patient
    /// receive the peer's last datagram of any kind if later (its PONGs keep it waiting).
    fn silent_since(&self, alive_at: Option<Instant>) -> Instant {
        match alive_at {
            Some(t) if self.opts.patient => self.heard.max(t),
            _ => self.heard,
        }
    }

    /// A receive that heard nothing for a quarter of the peer timeout asks the sender whether
    /// it is alive (a sender that is computing, or waiting on another rank, answers), so
    /// only a dead or cut-off peer is blamed.
    fn next_ping(&self, peer_timeout: Duration) -> Instant {
        let every = peer_timeout / 4;
        self.pinged.unwrap_or(self.heard).max(self.heard) + every
    }

    /// An `up_to` receive learns its length from its first segment (at most the posted
    /// range's); `false` if the sender's length does not fit.
    fn learn(&mut self, total: u32, seg_payload: usize) -> bool {
        if self.known {
            return true;
        }
        if total > self.total {
            return false;
        }
        let nsegs = (total as usize).div_ceil(seg_payload).max(1) as u32;
        let lose = (self.opts.loss_bound * f64::from(nsegs)).floor() as u32;
        self.total = total;
        self.nsegs = nsegs;
        self.need = nsegs - lose.min(nsegs);
        self.got = vec![0; (nsegs as usize).div_ceil(64)];
        if self.opts.keep_meta {
            self.meta = vec![0; nsegs as usize];
        }
        self.known = true;
        true
    }

    pub(super) fn set_deadline(&mut self, at: Instant) {
        self.opts.deadline = Some(at);
    }

    fn has(&self, seg: u32) -> bool {
        self.got[seg as usize / 64] & (1 << (seg % 64)) != 0
    }

    /// Missing segments from the first one, as a NACK bitmap of at most MAX_BITMAP bytes
    /// (segment 0 alone while an `up_to` receive does not know its length yet).
    fn missing_bitmap(&self) -> Option<(u32, Vec<u8>, u32)> {
        if !self.known {
            return Some((0, vec![1], 1));
        }
        let first = (0..self.nsegs).find(|&s| !self.has(s))?;
        let bits = (self.nsegs - first).min(MAX_BITMAP as u32 * 8);
        let mut map = vec![0u8; (bits as usize).div_ceil(8)];
        for b in 0..bits {
            if !self.has(first + b) {
                map[(b / 8) as usize] |= 1 << (b % 8);
            }
        }
        Some((first, map, bits))
    }

    /// In a first pass, the segments now far enough below the highest one received to be
    /// taken as lost (`reorder` segments of margin) and not looked at before, as a gap NACK
    /// bitmap. The first losses, as many as the loss bound allows, are not asked for: only
    /// what the bound cannot absorb is resent (DLCP). Each segment is looked at once, so the
    /// work is linear in the message.
    fn new_gaps(&mut self, reorder: u32, seg_payload: usize) -> Option<(u32, Vec<u8>, u32)> {
        if reorder == 0 || self.pass_end.is_some() || !self.known || self.count >= self.highest {
            return None;
        }
        let limit = self.highest.saturating_sub(reorder);
        if limit <= self.gap_checked {
            return None;
        }
        let may_lose = self.nsegs - self.need;
        let mut named: Vec<u32> = Vec::new();
        let mut pos = self.gap_checked;
        while pos < limit {
            let seg = self.order.seg_at(pos);
            if !self.has(seg) {
                let absorbed = if self.ranges.is_empty() {
                    self.gap_tolerated < may_lose
                } else {
                    self.tolerate(seg, seg_payload)
                };
                if absorbed {
                    self.gap_tolerated += 1;
                } else {
                    // A bitmap holds at most MAX_BITMAP * 8 ascending segments (a rotated
                    // message wraps to segment 0): the rest next time.
                    if named
                        .first()
                        .is_some_and(|&f| seg < f || seg - f >= MAX_BITMAP as u32 * 8)
                    {
                        break;
                    }
                    named.push(seg);
                }
                self.gap_lost += 1;
            }
            pos += 1;
        }
        self.gap_checked = pos;
        bitmap_of(&named)
    }
}

/// Ascending segments (spanning at most MAX_BITMAP * 8) as a NACK bitmap: first, bits, count.
fn bitmap_of(named: &[u32]) -> Option<(u32, Vec<u8>, u32)> {
    let (&first, &last) = (named.first()?, named.last()?);
    let bits = last - first + 1;
    let mut map = vec![0u8; (bits as usize).div_ceil(8)];
    for &s in named {
        let b = s - first;
        map[(b / 8) as usize] |= 1 << (b % 8);
    }
    Some((first, map, bits))
}

/// A segment kept for a message not posted yet.
#[derive(Debug)]
pub(super) struct KeptSeg {
    pub(super) header: DataHeader,
    pub(super) payload: Vec<u8>,
    pub(super) tos: u8,
    /// When it arrived (the report's `first_at`/`last_at` are arrivals, not the posting).
    pub(super) at: Instant,
}

/// Data kept for a message not posted yet.
#[derive(Debug, Default)]
pub(super) struct Unexpected {
    pub(super) segs: Vec<KeptSeg>,
    pub(super) bytes: usize,
    pub(super) pass_end: Option<u8>,
    seen: std::collections::HashSet<u64>,
}

impl Core {
    pub(super) fn on_data(
        &mut self,
        now: Instant,
        i: usize,
        h: &DataHeader,
        payload: &[u8],
        tos: u8,
    ) {
        if h.pass == 0 {
            self.note_arrival(now, i, tos & 3 == 3);
        }
        let p = &mut self.peers[i];
        if let Some(r) = p.recvs.get(&h.msg) {
            // The second copy of a LAST this pass already had (TAIL_COPY_MIN_SEGS) asks
            // nothing new: the pass was answered (twice).
            let answered = r.pass_end.is_some_and(|q| q >= h.pass);
            self.place(now, now, i, h.msg, h, payload, tos);
            if h.flags & flags::LAST != 0 && !answered {
                self.end_of_pass(now, i, h.msg, h.pass);
            }
            return;
        }
        if p.is_done(h.msg) {
            self.stats.data_duplicate += 1;
            // The sender missed our DONE: say it again when it ends a pass.
            if h.flags & flags::LAST != 0 {
                let mut c = self.ctrl_to(i, CtrlOp::Done, h.msg, h.pass);
                c.a = h.total;
                self.ctrl_frame(i, c, &[]);
            }
            return;
        }
        if self.closing {
            if h.flags & flags::LAST != 0 || h.pass > 0 {
                self.refuse_closing(i, h.msg, false);
            }
            return;
        }
        let ahead = h.msg.wrapping_sub(p.recv_next);
        let behind_reserved =
            h.msg.wrapping_sub(p.done_below) < p.recv_next.wrapping_sub(p.done_below);
        if !behind_reserved && ahead >= self.cfg.unexpected_window {
            self.stats.unexpected_dropped += 1;
            return;
        }
        if self.unexpected_bytes + payload.len() > self.cfg.unexpected_limit {
            self.stats.unexpected_dropped += 1;
            return;
        }
        let u = p.unexpected.entry(h.msg).or_default();
        if h.flags & flags::LAST != 0 {
            u.pass_end = Some(u.pass_end.map_or(h.pass, |q| q.max(h.pass)));
        }
        if !u.seen.insert(h.offset) {
            self.stats.data_duplicate += 1;
            return;
        }
        u.bytes += payload.len();
        u.segs.push(KeptSeg {
            header: *h,
            payload: payload.to_vec(),
            tos,
            at: now,
        });
        self.unexpected_bytes += payload.len();
        self.stats.unexpected_kept += 1;
    }

    /// Places one segment of posted receive `msg` (checked against its shape), then ends the
    /// receive if it is complete or, after a finished pass, within its bound. `arrived`: when
    /// the segment arrived (`now`, or earlier for data kept before the receive was posted).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn place(
        &mut self,
        now: Instant,
        arrived: Instant,
        i: usize,
        msg: u32,
        h: &DataHeader,
        payload: &[u8],
        tos: u8,
    ) {
        let seg_payload = self.cfg.seg_payload;
        let ack_every = self.ack_interval(i);
        let Some(r) = self.peers[i].recvs.get_mut(&msg) else {
            return;
        };
        if !r.learn(h.total, seg_payload) {
            self.stats.refused += 1;
            return;
        }
        let seg = (h.offset / seg_payload as u64) as u32;
        let want_len = (r.total as usize)
            .saturating_sub(seg as usize * seg_payload)
            .min(seg_payload);
        if h.total != r.total
            || h.offset % seg_payload as u64 != 0
            || seg >= r.nsegs
            || usize::from(h.length) != want_len
        {
            self.stats.refused += 1;
            return;
        }
        r.heard = now;
        if r.has(seg) {
            self.stats.data_duplicate += 1;
            return;
        }
        let at = r.start + h.offset as usize;
        let Some(dst) = self.buffers.get_mut(r.buf, at..at + payload.len()) else {
            self.stats.refused += 1;
            return;
        };
        let skip = r.opts.skip_meta_zero && h.meta == 0;
        match r.opts.place {
            _ if skip => {}
            Place::Copy => dst.copy_from_slice(payload),
            Place::Reduce(combine, dtype) => {
                if !combine_into(combine, dtype, dst, payload) {
                    self.stats.refused += 1;
                    return;
                }
            }
        }
        self.stats.data_placed += 1;
        r.first_at = Some(r.first_at.map_or(arrived, |t| t.min(arrived)));
        r.last_at = Some(r.last_at.map_or(arrived, |t| t.max(arrived)));
        r.got[seg as usize / 64] |= 1 << (seg % 64);
        r.count += 1;
        if r.is_tolerated(seg) {
            // Done without, then it came after all.
            r.tolerated[seg as usize / 64] &= !(1 << (seg % 64));
            r.tolerated_count -= 1;
        }
        r.highest = r.highest.max(r.order.pos_of(seg) + 1);
        if tos & 3 == 3 {
            r.ce += 1;
        }
        if let Some(m) = r.meta.get_mut(seg as usize) {
            *m = h.meta;
        }
        r.since_ack += 1;
        let complete = r.count == r.nsegs;
        let bound = r.pass_end.is_some() && r.within_bound();
        let ack = r.since_ack >= ack_every;
        let lost_before = r.gap_lost;
        let gaps = if complete || bound {
            None
        } else {
            r.new_gaps(self.cfg.gap_reorder, seg_payload)
        };
        let lost = r.gap_lost - lost_before;
        self.note_gaps(lost);
        if complete {
            self.finish(i, msg, Ended::Complete);
        } else if bound {
            self.finish(i, msg, Ended::Bound);
        } else {
            if ack {
                self.send_ack(i, msg);
                // The budget moved with these arrivals: shares follow it.
                self.regrant(now, None);
            }
            if let Some((first, map, bits)) = gaps {
                let mut c = self.ctrl_to(i, CtrlOp::Nack, msg, h.pass);
                c.a = first;
                c.b = bits;
                c.c = NACK_GAP;
                self.stats.gap_nacks += 1;
                self.ctrl_frame(i, c, &map);
            }
        }
    }

    fn send_ack(&mut self, i: usize, msg: u32) {
        let Some(r) = self.peers[i].recvs.get_mut(&msg) else {
            return;
        };
        r.since_ack = 0;
        let (a, b, c) = (r.count, r.ce, r.highest);
        let mut f = self.ctrl_to(i, CtrlOp::Ack, msg, 0);
        f.a = a;
        f.b = b;
        f.c = c;
        self.ctrl_frame(i, f, &[]);
    }

    /// The sender finished pass `pass`: end the receive within its bound, or ask for what
    /// is missing.
    pub(super) fn end_of_pass(&mut self, _now: Instant, i: usize, msg: u32, pass: u8) {
        let Some(r) = self.peers[i].recvs.get_mut(&msg) else {
            return;
        };
        r.pass_end = Some(r.pass_end.map_or(pass, |q| q.max(pass)));
        if r.count == r.nsegs {
            return self.finish(i, msg, Ended::Complete);
        }
        let nack = if r.ranges.is_empty() {
            if r.count >= r.need {
                return self.finish(i, msg, Ended::Bound);
            }
            r.missing_bitmap()
        } else {
            let nack = r.ranged_nack(self.cfg.seg_payload);
            if nack.is_none() {
                return self.finish(i, msg, Ended::Bound);
            }
            nack
        };
        if let Some((first, map, bits)) = nack {
            let twice = r.nsegs >= TAIL_COPY_MIN_SEGS;
            let mut c = self.ctrl_to(i, CtrlOp::Nack, msg, pass);
            c.a = first;
            c.b = bits;
            self.stats.nacks += 1;
            self.ctrl_frame(i, c, &map);
            if twice {
                self.ctrl_frame(i, c, &map);
            }
        }
    }

    /// Ends receive `msg`: DONE to the sender, the report to the driver.
    pub(super) fn finish(&mut self, i: usize, msg: u32, ended: Ended) {
        let p = &mut self.peers[i];
        let Some(r) = p.recvs.remove(&msg) else {
            return;
        };
        p.mark_done(msg);
        let missing = r.nsegs - r.count;
        let mut c = self.ctrl_to(i, CtrlOp::Done, msg, r.pass_end.unwrap_or(0));
        c.a = r.count;
        c.b = r.ce;
        c.c = missing;
        self.ctrl_frame(i, c, &[]);
        if r.nsegs >= TAIL_COPY_MIN_SEGS {
            self.ctrl_frame(i, c, &[]);
        }
        self.events.push_back(Event::Received {
            peer: i as u16,
            msg,
            report: RecvReport {
                segments: r.nsegs,
                missing,
                ended,
                arrived: if missing == 0 { None } else { Some(r.got) },
                meta: r.meta,
                passes: r.pass_end.map_or(1, |p| u32::from(p) + 1),
                len: r.total,
                first_at: r.first_at,
                last_at: r.last_at,
            },
        });
    }

    /// A control frame about one of our receives (POLL, ABORT).
    pub(super) fn on_recv_ctrl(&mut self, now: Instant, i: usize, c: &Ctrl) {
        let p = &mut self.peers[i];
        if c.op == CtrlOp::Abort {
            // b = 1: the peer gave up receiving our send; 0: sending to our receive.
            let culprit = c.a.checked_sub(1).and_then(|r| u16::try_from(r).ok());
            if c.msg == super::ABORT_ALL {
                return self.peer_gave_up(i, culprit);
            }
            let send = c.b == 1;
            let posted = if send {
                p.sends.remove(&c.msg).is_some()
            } else {
                let r = p.recvs.remove(&c.msg).is_some();
                if r {
                    p.mark_done(c.msg);
                }
                r
            };
            if !posted {
                // Not posted yet (this rank is behind): it fails when it is, at once. A finished
                // receive's abort is stale; the number of remembered aborts is bounded.
                let stale = !send && p.is_done(c.msg);
                let known = if send {
                    &mut p.aborted_sends
                } else {
                    &mut p.aborted_recvs
                };
                if !stale && known.len() < super::MAX_ABORTED {
                    known.insert(c.msg, culprit);
                }
                return;
            }
            if posted {
                self.events.push_back(Event::Failed {
                    peer: i as u16,
                    msg: c.msg,
                    send,
                    error: MsgError::Aborted {
                        peer: i as u16,
                        msg: c.msg,
                        culprit,
                    },
                });
            }
            return;
        }
        if let Some(r) = p.recvs.get_mut(&c.msg) {
            // A POLL is the sender working on the message; a PONG only says it is alive.
            if c.op != CtrlOp::Pong {
                r.heard = now;
            }
            match c.op {
                CtrlOp::Poll if c.c != 0 => self.end_of_pass(now, i, c.msg, c.pass),
                CtrlOp::Poll => {
                    self.send_ack(i, c.msg);
                    // A sender stalled on its window may have lost our GRANT.
                    self.regrant(now, Some(i));
                }
                CtrlOp::Pong => {}
                _ => {}
            }
            return;
        }
        if c.op != CtrlOp::Poll {
            return;
        }
        self.regrant(now, Some(i));
        let p = &mut self.peers[i];
        if p.is_done(c.msg) {
            let f = self.ctrl_to(i, CtrlOp::Done, c.msg, c.pass);
            self.ctrl_frame(i, f, &[]);
        } else if self.closing {
            self.refuse_closing(i, c.msg, false);
        } else {
            // Not posted yet: say we are alive and what we hold, so the sender keeps waiting.
            let held = p.unexpected.get(&c.msg).map_or(0, |u| u.segs.len() as u32);
            let mut f = self.ctrl_to(i, CtrlOp::Ack, c.msg, c.pass);
            f.a = held;
            f.c = held;
            self.ctrl_frame(i, f, &[]);
        }
    }

    pub(super) fn on_ctrl(&mut self, now: Instant, i: usize, c: &Ctrl, bitmap: &[u8]) {
        match c.op {
            CtrlOp::Ack | CtrlOp::Done | CtrlOp::Nack => self.on_send_ctrl(now, i, c, bitmap),
            CtrlOp::Grant => self.on_grant(i, c),
            CtrlOp::Poll | CtrlOp::Abort | CtrlOp::Pong => self.on_recv_ctrl(now, i, c),
            CtrlOp::Ping if self.closing => self.refuse_closing(i, c.msg, true),
            CtrlOp::Ping => {
                let posted = self.peers[i].sends.contains_key(&c.msg);
                let mut f = self.ctrl_to(i, CtrlOp::Pong, c.msg, 0);
                f.a = u32::from(posted);
                self.ctrl_frame(i, f, &[]);
            }
        }
    }

    /// Fires the timers due at `now`: POLLs and failures of sends, deadlines and failures of
    /// receives.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut failed = self.send_timers(now);
        let peer_timeout = self.cfg.peer_timeout;
        for i in 0..self.peers.len() {
            let mut due = Vec::new();
            let mut pings = Vec::new();
            let alive_at = self.peers[i].alive_at;
            for (&msg, r) in self.peers[i].recvs.iter_mut() {
                let silent = now.saturating_duration_since(r.silent_since(alive_at));
                if r.opts.deadline.is_some_and(|d| d <= now) {
                    due.push((msg, None));
                } else if silent >= peer_timeout {
                    due.push((msg, Some(silent)));
                } else if r.next_ping(peer_timeout) <= now {
                    r.pinged = Some(now);
                    pings.push(msg);
                }
            }
            for msg in pings {
                let f = self.ctrl_to(i, CtrlOp::Ping, msg, 0);
                self.ctrl_frame(i, f, &[]);
            }
            for (msg, silent) in due {
                match silent {
                    None => self.finish(i, msg, Ended::Deadline),
                    Some(waited) => {
                        let p = &mut self.peers[i];
                        p.recvs.remove(&msg);
                        p.mark_done(msg);
                        failed.push(self.silent(i, msg, false, waited, now));
                    }
                }
            }
        }
        self.push_failures(failed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(segments: u32, len: u32, arrived: Option<Vec<u64>>) -> RecvReport {
        RecvReport {
            segments,
            missing: 0,
            ended: Ended::Bound,
            arrived,
            meta: Vec::new(),
            passes: 1,
            len,
            first_at: None,
            last_at: None,
        }
    }

    #[test]
    fn missing_ranges_follow_the_bitmap_and_the_short_last_segment() {
        assert!(report(3, 25, None).missing_ranges(10).is_empty());
        // Segments 0 and 2 arrived, 1 and 3 (the short last one) did not.
        let r = report(4, 35, Some(vec![0b0101]));
        assert_eq!(r.missing_ranges(10), vec![10..20, 30..35]);
    }
}
