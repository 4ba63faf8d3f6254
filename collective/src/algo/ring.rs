//! Ring all-reduce: `world - 1` reduce-scatter steps (each arriving segment is added into
//! the chunk as it lands), then `world - 1` all-gather steps (reliable). Every receive of the
//! operation is posted when it starts; a step's send is posted when the step before it has
//! received. Rank r ends the reduce-scatter owning chunk r.

use std::time::Instant;

use gradwire_msg::core::{Place, RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use super::{
    check_mask, check_spec, finish_chunk, outcome, step, Chunks, Masks, ReduceOutcome, ReduceSpec,
    StepReport,
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
    spec: ReduceSpec,
    halves: Halves,
    region: Option<Region>,
    buf: Option<BufId>,
    chunks: Chunks,
    masks: Option<Masks>,
    rank: usize,
    world: usize,
    next: u16,
    send_base: u32,
    recv_base: u32,
    /// Steps of each half (0 when the half does not run).
    rs_steps: usize,
    ag_steps: usize,
    sends_left: usize,
    recvs_left: usize,
    steps: Vec<StepReport>,
    started: Option<Instant>,
}

impl Ring {
    /// A ring over `region` (the whole tensor).
    pub fn new(region: Region, spec: ReduceSpec, halves: Halves) -> Ring {
        Ring {
            spec,
            halves,
            chunks: Chunks::new(0, 1, 1),
            region: Some(region),
            buf: None,
            masks: None,
            rank: 0,
            world: 1,
            next: 0,
            send_base: 0,
            recv_base: 0,
            rs_steps: 0,
            ag_steps: 0,
            sends_left: 0,
            recvs_left: 0,
            steps: Vec::new(),
            started: None,
        }
    }

    fn rs_send(&mut self, cx: &mut OpCx<'_>, s: usize) -> Result<(), OpError> {
        let c = self.chunks.sub(self.rank, s + 1);
        self.send(cx, s, c)
    }

    fn ag_send(&mut self, cx: &mut OpCx<'_>, s: usize) -> Result<(), OpError> {
        let c = self.chunks.sub(self.rank, s);
        self.send(cx, self.rs_steps + s, c)
    }

    fn send(&mut self, cx: &mut OpCx<'_>, k: usize, c: usize) -> Result<(), OpError> {
        let meta = match &self.masks {
            Some(m) => m.meta(self.chunks.block_range(c)),
            None => Vec::new(),
        };
        let opts = SendOpts {
            tos: self.spec.tos,
            layer: self.spec.layer,
            meta,
            tos_per_segment: Vec::new(),
        };
        let buf = self
            .buf
            .ok_or_else(|| OpError::Invalid("no buffer".into()))?;
        cx.send(
            self.next,
            self.send_base + k as u32,
            buf,
            self.chunks.bytes(c),
            opts,
        )
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        if self.sends_left > 0 || self.recvs_left > 0 {
            return Ok(None);
        }
        let region = self.buf.take().and_then(|b| cx.unregister(b));
        Ok(Some(outcome(
            region,
            "ring",
            &self.chunks,
            self.masks.as_ref(),
            self.world,
            std::mem::take(&mut self.steps),
            cx.now()
                .saturating_duration_since(self.started.unwrap_or_else(|| cx.now())),
        )))
    }
}

impl Op for Ring {
    type Output = ReduceOutcome;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        self.started = Some(cx.now());
        self.rank = usize::from(cx.rank());
        self.world = usize::from(cx.world());
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        check_spec(&self.spec, region.len(), self.world).map_err(OpError::Invalid)?;
        self.chunks = Chunks::new(region.len(), cx.seg_payload(), self.world);
        let buf = cx.register(region);
        self.buf = Some(buf);
        let w = self.world;
        if w == 1 {
            if self.halves != Halves::AllGather {
                finish_chunk(&self.spec, &self.chunks, 0, cx.buf_mut(buf), None, 1);
            }
            return self.done(cx);
        }
        let lossy = self.spec.loss_bound > 0.0 && self.halves != Halves::AllGather;
        if lossy {
            self.masks = Some(Masks::only(self.chunks.blocks(), self.rank));
        }
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
        self.next = ((self.rank + 1) % w) as u16;
        let prev = ((self.rank + w - 1) % w) as u16;
        self.send_base = cx.reserve_sends(self.next, steps)?;
        self.recv_base = cx.reserve_recvs(prev, steps)?;
        for s in 0..self.rs_steps {
            let c = self.chunks.sub(self.rank, s + 2);
            let opts = RecvOpts {
                place: Place::Sum(self.spec.dtype),
                loss_bound: self.spec.loss_bound,
                deadline: None,
                keep_meta: lossy,
                up_to: false,
                skip_meta_zero: false,
                patient: false,
            };
            cx.recv(
                prev,
                self.recv_base + s as u32,
                buf,
                self.chunks.bytes(c),
                opts,
            )?;
        }
        for s in 0..self.ag_steps {
            let c = self.chunks.sub(self.rank, s + 1);
            let opts = RecvOpts {
                keep_meta: lossy,
                ..RecvOpts::default()
            };
            let k = (self.rs_steps + s) as u32;
            cx.recv(prev, self.recv_base + k, buf, self.chunks.bytes(c), opts)?;
        }
        if let (Some(d), true) = (self.spec.step_deadline, self.rs_steps > 0) {
            let now = cx.now();
            cx.set_deadline(prev, self.recv_base, now + d);
        }
        self.sends_left = steps as usize;
        self.recvs_left = steps as usize;
        if self.rs_steps > 0 {
            self.rs_send(cx, 0)?;
        } else {
            self.ag_send(cx, 0)?;
        }
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        match ev {
            OpEvent::Sent { .. } => self.sends_left = self.sends_left.saturating_sub(1),
            OpEvent::Received { peer, msg, report } => {
                self.recvs_left = self.recvs_left.saturating_sub(1);
                let k = msg.wrapping_sub(self.recv_base) as usize;
                let prev = usize::from(peer);
                if k < self.rs_steps {
                    let c = self.chunks.sub(self.rank, k + 2);
                    self.steps.push(step(peer, &report));
                    if let Some(m) = &mut self.masks {
                        for (i, b) in self.chunks.block_range(c).enumerate() {
                            if report.has(i) {
                                let got = report.meta.get(i).copied().unwrap_or(0);
                                check_mask(got, self.world, prev, m.words[b], peer, b)?;
                                m.words[b] |= got;
                            }
                        }
                    }
                    if k + 1 < self.rs_steps {
                        // The next step can start now: its time bound runs from here.
                        if let Some(d) = self.spec.step_deadline {
                            let now = cx.now();
                            cx.set_deadline(peer, self.recv_base + k as u32 + 1, now + d);
                        }
                        self.rs_send(cx, k + 1)?;
                    } else {
                        // Chunk `rank` is reduced: finish it, then the all-gather starts.
                        if let Some(buf) = self.buf {
                            let bytes = cx.buf_mut(buf);
                            finish_chunk(
                                &self.spec,
                                &self.chunks,
                                self.rank,
                                bytes,
                                self.masks.as_ref(),
                                self.world,
                            );
                        }
                        if self.ag_steps > 0 {
                            self.ag_send(cx, 0)?;
                        }
                    }
                } else {
                    let s = k - self.rs_steps;
                    let c = self.chunks.sub(self.rank, s + 1);
                    if let Some(m) = &mut self.masks {
                        for (i, b) in self.chunks.block_range(c).enumerate() {
                            let got = report.meta.get(i).copied().unwrap_or(0);
                            // The chunk's owner (rank c) is always summed in its chunk.
                            check_mask(got, self.world, c, 0, peer, b)?;
                            m.words[b] = got;
                        }
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
