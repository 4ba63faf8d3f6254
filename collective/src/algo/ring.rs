//! Ring all-reduce: `world - 1` reduce-scatter steps (each arriving segment is added into
//! the chunk as it lands), then `world - 1` all-gather steps (reliable). The reduce-scatter
//! receives are posted when the operation starts, the all-gather receives once every
//! reduce-scatter receive of this rank has ended (data that comes earlier is kept by the
//! layer); a step's send is posted when the step before it has received. Rank r ends the
//! reduce-scatter owning chunk r.
//!
//! Why the all-gather waits: an all-gather receive writes a chunk that a reduce-scatter
//! receive also adds into (with 3 ranks, the first reduce-scatter step's and the last
//! all-gather step's). Without time bounds the reduce-scatter one has always ended first (the
//! all-gather data depends on it through the ring), but a step cut short by its deadline
//! breaks that chain: a late reduce-scatter segment could then be added onto the finished
//! values, and that rank would end with values the others do not have.

use gradwire_msg::core::SendOpts;
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use super::reduction::Reduction;
use super::{
    check_mask, digest, finish_chunk, post_digest, send_digest, take_digest, ReduceOutcome,
    ReduceSpec, DIGEST_LEN,
};

/// Which halves of the ring run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halves {
    /// Reduce-scatter then all-gather: an all-reduce.
    Both,
    /// Reduce-scatter only: rank r's chunk r holds the result.
    ReduceScatter,
    /// All-gather only: every rank's chunk r (its own) goes to everyone.
    AllGather,
}

/// The ring operation over one region.
#[derive(Debug)]
pub struct Ring {
    r: Reduction,
    halves: Halves,
    next: u16,
    send_base: u32,
    recv_base: u32,
    /// Steps of each half (0 when the half does not run).
    rs_steps: usize,
    ag_steps: usize,
    /// Reduce-scatter receives not ended yet (the all-gather receives wait for 0).
    rs_left: usize,
    /// With [`ReduceSpec::verify_results`]: the owners' digests and the chunks' own.
    check: Option<Check>,
}

/// The all-gather's check ([`ReduceSpec::verify_results`]): every chunk's owner sends the
/// digest of its finished chunk straight to every rank (not round the ring), which compares
/// the chunk it got from its predecessor. Message plan per pair, after the ring's own: one
/// digest message each way (so `next` and `prev` have `steps + 1`).
#[derive(Debug)]
struct Check {
    /// Per chunk (= its owner's rank): the digest its owner sent, and the one of the chunk
    /// as it arrived here.
    owner: Vec<Option<[u8; DIGEST_LEN]>>,
    arrived: Vec<Option<[u8; DIGEST_LEN]>>,
    /// Per peer: the message number and buffer of its digest's receive.
    recv: Vec<Option<(u32, BufId)>>,
    /// Per peer: the message number of this rank's digest to it.
    send: Vec<Option<u32>>,
}

impl Ring {
    /// A ring over `region` (the whole tensor).
    pub fn new(region: Region, spec: ReduceSpec, halves: Halves) -> Ring {
        Ring {
            r: Reduction::new(region, spec),
            halves,
            next: 0,
            send_base: 0,
            recv_base: 0,
            rs_steps: 0,
            ag_steps: 0,
            rs_left: 0,
            check: None,
        }
    }

    /// Posts every all-gather receive (once no reduce-scatter receive can add into a chunk).
    fn post_all_gather(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let buf = self.r.buf()?;
        let prev = ((self.r.rank + self.r.world - 1) % self.r.world) as u16;
        for s in 0..self.ag_steps {
            let c = self.r.chunks.sub(self.r.rank, s + 1);
            let opts = self.r.result_opts();
            let k = (self.rs_steps + s) as u32;
            cx.recv(prev, self.recv_base + k, buf, self.r.chunks.bytes(c), opts)?;
        }
        Ok(())
    }

    fn rs_send(&mut self, cx: &mut OpCx<'_>, s: usize) -> Result<(), OpError> {
        let c = self.r.chunks.sub(self.r.rank, s + 1);
        self.send(cx, s, c)
    }

    fn ag_send(&mut self, cx: &mut OpCx<'_>, s: usize) -> Result<(), OpError> {
        let c = self.r.chunks.sub(self.r.rank, s);
        #[cfg(test)]
        if s > 0 && self.r.spec.tamper == Some(self.r.rank) {
            let (buf, at) = (self.r.buf()?, self.r.chunks.bytes(c).start);
            if let Some(b) = cx.buf_mut(buf).get_mut(at) {
                *b ^= 0x40;
            }
        }
        self.send(cx, self.rs_steps + s, c)
    }

    /// The digest of chunk `c` as this rank holds it.
    fn digest_of(&self, cx: &OpCx<'_>, c: usize) -> Result<[u8; DIGEST_LEN], OpError> {
        let buf = self.r.buf()?;
        let values = cx.buf(buf).get(self.r.chunks.bytes(c)).unwrap_or(&[]);
        let sets = self
            .r
            .masks
            .as_ref()
            .map(|m| m.meta(self.r.chunks.block_range(c)))
            .unwrap_or_default();
        Ok(digest(b"gradwire ring chunk v1", c as u64, values, &sets))
    }

    /// Reserves and posts the check's messages (after the ring's own, on every pair).
    fn start_check(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let (rank, w) = (self.r.rank, self.r.world);
        let mut check = Check {
            owner: vec![None; w],
            arrived: vec![None; w],
            recv: vec![None; w],
            send: vec![None; w],
        };
        for q in (0..w).filter(|&q| q != rank) {
            let peer = q as u16;
            check.send[q] = Some(cx.reserve_sends(peer, 1)?);
            check.recv[q] = Some(post_digest(cx, peer)?);
        }
        self.r.sends_left += w - 1;
        self.r.recvs_left += w - 1;
        self.check = Some(check);
        Ok(())
    }

    /// This rank's chunk is final: its digest goes to every rank.
    fn send_digests(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let Some(sends) = self.check.as_ref().map(|c| c.send.clone()) else {
            return Ok(());
        };
        let d = self.digest_of(cx, self.r.rank)?;
        for (q, msg) in sends.iter().enumerate() {
            if let Some(msg) = msg {
                send_digest(cx, q as u16, *msg, &d)?;
            }
        }
        Ok(())
    }

    /// A digest message from `peer` arrived, if `msg` is one: keeps it and checks its chunk.
    fn on_digest(&mut self, cx: &mut OpCx<'_>, peer: u16, msg: u32) -> Result<bool, OpError> {
        let q = usize::from(peer);
        let Some(check) = self.check.as_mut() else {
            return Ok(false);
        };
        let Some(&Some((m, buf))) = check.recv.get(q) else {
            return Ok(false);
        };
        if m != msg {
            return Ok(false);
        }
        check.owner[q] = Some(take_digest(cx, buf));
        self.compare(q)?;
        Ok(true)
    }

    /// Chunk `c` is checked once both its owner's digest and its own are in.
    fn compare(&self, c: usize) -> Result<(), OpError> {
        let Some(check) = &self.check else {
            return Ok(());
        };
        let (Some(Some(want)), Some(Some(got))) = (check.owner.get(c), check.arrived.get(c)) else {
            return Ok(());
        };
        if want == got {
            return Ok(());
        }
        let w = self.r.world;
        let prev = (self.r.rank + w - 1) % w;
        // The ranks that forwarded it here: c + 1, ..., prev.
        let path: Vec<usize> = (1..w)
            .map(|i| (c + i) % w)
            .take_while(|&x| x != self.r.rank)
            .collect();
        let reason = if path.is_empty() {
            format!(
                "sent its own chunk {c} with another digest than the chunk's (it is rank {c}'s)"
            )
        } else {
            format!(
                "forwarded chunk {c} changed: it does not match the digest of its owner, rank \
                 {c}, sent here directly; one of the ranks it came through ({path:?}) changed it"
            )
        };
        Err(OpError::Data {
            peer: prev as u16,
            reason,
        })
    }

    fn send(&mut self, cx: &mut OpCx<'_>, k: usize, c: usize) -> Result<(), OpError> {
        let meta = match &self.r.masks {
            Some(m) => m.meta(self.r.chunks.block_range(c)),
            None => Vec::new(),
        };
        let buf = self.r.buf()?;
        let bytes = self.r.chunks.bytes(c);
        let lossy_step = k < self.rs_steps;
        let opts = SendOpts {
            tos: self.r.spec.tos,
            layer: self.r.spec.layer,
            meta,
            tos_per_segment: if lossy_step {
                self.r.tags(&cx.buf(buf)[bytes.clone()], cx.seg_payload())
            } else {
                Vec::new()
            },
            // The reduce-scatter's lossy steps: what a bound leaves out moves from message
            // to message (the receive rotates alike).
            rotate: self.r.spec.lossy() && lossy_step,
        };
        cx.send(self.next, self.send_base + k as u32, buf, bytes, opts)
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        self.r.finish(cx, "ring")
    }
}

impl Op for Ring {
    type Output = ReduceOutcome;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        let buf = self.r.begin(cx, true)?;
        let w = self.r.world;
        if w == 1 {
            if self.halves != Halves::AllGather {
                finish_chunk(&self.r.spec, &self.r.chunks, 0, cx.buf_mut(buf), None, 1);
            }
            return self.done(cx);
        }
        self.r
            .track_sets(self.r.spec.lossy() && self.halves != Halves::AllGather);
        self.rs_steps = if self.halves == Halves::AllGather {
            0
        } else {
            w - 1
        };
        self.ag_steps = if self.halves == Halves::ReduceScatter {
            0
        } else {
            w - 1
        };
        let steps = (self.rs_steps + self.ag_steps) as u32;
        self.next = ((self.r.rank + 1) % w) as u16;
        let prev = ((self.r.rank + w - 1) % w) as u16;
        self.send_base = cx.reserve_sends(self.next, steps)?;
        self.recv_base = cx.reserve_recvs(prev, steps)?;
        self.r.sends_left = steps as usize;
        self.r.recvs_left = steps as usize;
        if self.r.spec.verify_results && self.ag_steps > 0 {
            self.start_check(cx)?;
        }
        for s in 0..self.rs_steps {
            // Step s carries the partial sum of s + 1 ranks.
            let c = self.r.chunks.sub(self.r.rank, s + 2);
            let bytes = self.r.chunks.bytes(c);
            let opts = self.r.sum_opts(None, &bytes, s + 1);
            cx.recv(prev, self.recv_base + s as u32, buf, bytes, opts)?;
        }
        self.rs_left = self.rs_steps;
        if self.rs_steps == 0 {
            self.post_all_gather(cx)?;
        }
        if let (Some(d), true) = (self.r.spec.step_deadline, self.rs_steps > 0) {
            let now = cx.now();
            cx.set_deadline(prev, self.recv_base, now + d);
        }
        if self.rs_steps > 0 {
            self.rs_send(cx, 0)?;
        } else {
            self.send_digests(cx)?;
            self.ag_send(cx, 0)?;
        }
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        match ev {
            OpEvent::Sent { segments, .. } => self.r.sent(segments),
            OpEvent::Received { peer, msg, report } => {
                self.r.recvs_left = self.r.recvs_left.saturating_sub(1);
                if self.on_digest(cx, peer, msg)? {
                    return self.done(cx);
                }
                let k = msg.wrapping_sub(self.recv_base) as usize;
                let prev = usize::from(peer);
                if k < self.rs_steps {
                    self.rs_left = self.rs_left.saturating_sub(1);
                    if self.rs_left == 0 {
                        self.post_all_gather(cx)?;
                    }
                    let c = self.r.chunks.sub(self.r.rank, k + 2);
                    self.r.record_step(cx.now(), peer, &report);
                    if let Some(m) = &mut self.r.masks {
                        for (i, b) in self.r.chunks.block_range(c).enumerate() {
                            if report.has(i) {
                                let got = report.meta.get(i).copied().unwrap_or(0);
                                check_mask(got, self.r.world, prev, m.words[b], peer, b)?;
                                m.words[b] |= got;
                            }
                        }
                    }
                    if k + 1 < self.rs_steps {
                        // The next step can start now: its time bound runs from here.
                        let now = cx.now();
                        self.r.step_starts(now);
                        if let Some(d) = self.r.spec.step_deadline {
                            cx.set_deadline(peer, self.recv_base + k as u32 + 1, now + d);
                        }
                        self.rs_send(cx, k + 1)?;
                    } else {
                        // Chunk `rank` is reduced: finish it, then the all-gather starts.
                        if let Ok(buf) = self.r.buf() {
                            let bytes = cx.buf_mut(buf);
                            finish_chunk(
                                &self.r.spec,
                                &self.r.chunks,
                                self.r.rank,
                                bytes,
                                self.r.masks.as_ref(),
                                self.r.world,
                            );
                        }
                        if self.ag_steps > 0 {
                            self.send_digests(cx)?;
                            self.ag_send(cx, 0)?;
                        }
                    }
                } else {
                    let s = k - self.rs_steps;
                    let c = self.r.chunks.sub(self.r.rank, s + 1);
                    if let Some(m) = &mut self.r.masks {
                        for (i, b) in self.r.chunks.block_range(c).enumerate() {
                            let got = report.meta.get(i).copied().unwrap_or(0);
                            // The chunk's owner (rank c) is always summed in its chunk.
                            check_mask(got, self.r.world, c, 0, peer, b)?;
                            m.words[b] = got;
                        }
                    }
                    if self.check.is_some() {
                        let d = self.digest_of(cx, c)?;
                        if let Some(check) = self.check.as_mut() {
                            check.arrived[c] = Some(d);
                        }
                        self.compare(c)?;
                    }
                    if s + 1 < self.ag_steps {
                        self.ag_send(cx, s + 1)?;
                    }
                }
            }
        }
        self.done(cx)
    }
}
