//! The two-phase all-reduce: every rank sends chunk q of its tensor to rank q and reduces
//! the chunks it receives into its own (phase 1), then sends its finished chunk to every
//! rank (phase 2). The same bytes per rank as the ring in two message rounds instead of
//! `2 (world - 1)`: the better choice for small tensors and small worlds.

use std::time::Instant;

use gradwire_msg::core::{Place, RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use super::{
    check_mask, check_spec, finish_chunk, outcome, step, Chunks, Masks, ReduceOutcome, ReduceSpec,
    StepReport,
};

/// The two-phase all-reduce over one region.
#[derive(Debug)]
pub struct Direct {
    spec: ReduceSpec,
    region: Option<Region>,
    buf: Option<BufId>,
    chunks: Chunks,
    masks: Option<Masks>,
    rank: usize,
    world: usize,
    send_base: Vec<u32>,
    recv_base: Vec<u32>,
    phase1_left: usize,
    sends_left: usize,
    recvs_left: usize,
    steps: Vec<StepReport>,
    started: Option<Instant>,
}

impl Direct {
    /// A two-phase all-reduce over `region`.
    pub fn new(region: Region, spec: ReduceSpec) -> Direct {
        Direct {
            spec,
            region: Some(region),
            buf: None,
            chunks: Chunks::new(0, 1, 1),
            masks: None,
            rank: 0,
            world: 1,
            send_base: Vec::new(),
            recv_base: Vec::new(),
            phase1_left: 0,
            sends_left: 0,
            recvs_left: 0,
            steps: Vec::new(),
            started: None,
        }
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world).filter(move |&q| q != self.rank)
    }

    /// Phase 2: the finished chunk to every rank.
    fn broadcast_own(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let buf = self
            .buf
            .ok_or_else(|| OpError::Invalid("no buffer".into()))?;
        finish_chunk(
            &self.spec,
            &self.chunks,
            self.rank,
            cx.buf_mut(buf),
            self.masks.as_ref(),
            self.world,
        );
        let range = self.chunks.bytes(self.rank);
        if range.is_empty() {
            return Ok(());
        }
        let meta = match &self.masks {
            Some(m) => m.meta(self.chunks.block_range(self.rank)),
            None => Vec::new(),
        };
        for q in self.peers().collect::<Vec<_>>() {
            let opts = SendOpts {
                tos: self.spec.tos,
                layer: self.spec.layer,
                meta: meta.clone(),
                tos_per_segment: Vec::new(),
            };
            cx.send(q as u16, self.send_base[q] + 1, buf, range.clone(), opts)?;
            self.sends_left += 1;
        }
        Ok(())
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        if self.sends_left > 0 || self.recvs_left > 0 || self.phase1_left > 0 {
            return Ok(None);
        }
        let region = self.buf.take().and_then(|b| cx.unregister(b));
        Ok(Some(outcome(
            region,
            "direct",
            &self.chunks,
            self.masks.as_ref(),
            self.world,
            std::mem::take(&mut self.steps),
            cx.now()
                .saturating_duration_since(self.started.unwrap_or_else(|| cx.now())),
        )))
    }
}

impl Op for Direct {
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
        let lossy = self.spec.loss_bound > 0.0 && self.world > 1;
        if lossy {
            self.masks = Some(Masks::only(self.chunks.blocks(), self.rank));
        }
        self.send_base = vec![0; self.world];
        self.recv_base = vec![0; self.world];
        let own = self.chunks.bytes(self.rank);
        for q in self.peers().collect::<Vec<_>>() {
            let peer = q as u16;
            self.send_base[q] = cx.reserve_sends(peer, 2)?;
            self.recv_base[q] = cx.reserve_recvs(peer, 2)?;
            // Phase 1 in: q's contribution to my chunk, added as it lands.
            if own.is_empty() {
                cx.skip_recv(peer, self.recv_base[q])?;
            } else {
                let opts = RecvOpts {
                    place: Place::Sum(self.spec.dtype),
                    loss_bound: self.spec.loss_bound,
                    keep_meta: lossy,
                    deadline: self.spec.step_deadline.map(|d| cx.now() + d),
                    up_to: false,
                    skip_meta_zero: false,
                    patient: false,
                };
                cx.recv(peer, self.recv_base[q], buf, own.clone(), opts)?;
                self.phase1_left += 1;
                self.recvs_left += 1;
            }
            // Phase 2 in: q's finished chunk (reliable).
            let theirs = self.chunks.bytes(q);
            if theirs.is_empty() {
                cx.skip_recv(peer, self.recv_base[q] + 1)?;
            } else {
                let opts = RecvOpts {
                    keep_meta: lossy,
                    ..RecvOpts::default()
                };
                cx.recv(peer, self.recv_base[q] + 1, buf, theirs.clone(), opts)?;
                self.recvs_left += 1;
                // Phase 1 out: my contribution to q's chunk (under a bound, each segment
                // names me as its only contributor, which q checks).
                let meta = match &self.masks {
                    Some(_) => vec![1u64 << self.rank; self.chunks.block_range(q).len().max(1)],
                    None => Vec::new(),
                };
                let opts = SendOpts {
                    tos: self.spec.tos,
                    layer: self.spec.layer,
                    meta,
                    tos_per_segment: Vec::new(),
                };
                cx.send(peer, self.send_base[q], buf, theirs, opts)?;
                self.sends_left += 1;
            }
        }
        if self.phase1_left == 0 {
            self.broadcast_own(cx)?;
        }
        self.done(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        match ev {
            OpEvent::Sent { .. } => self.sends_left = self.sends_left.saturating_sub(1),
            OpEvent::Received { peer, msg, report } => {
                self.recvs_left = self.recvs_left.saturating_sub(1);
                let q = usize::from(peer);
                if msg == self.recv_base[q] {
                    self.steps.push(step(peer, &report));
                    if let Some(m) = &mut self.masks {
                        for (i, b) in self.chunks.block_range(self.rank).enumerate() {
                            if report.has(i) {
                                // q's own contribution: exactly {q}.
                                let got = report.meta.get(i).copied().unwrap_or(0);
                                check_mask(got, self.world, q, !(1u64 << q), peer, b)?;
                                m.words[b] |= 1 << q;
                            }
                        }
                    }
                    self.phase1_left = self.phase1_left.saturating_sub(1);
                    if self.phase1_left == 0 {
                        self.broadcast_own(cx)?;
                    }
                } else if let Some(m) = &mut self.masks {
                    for (i, b) in self.chunks.block_range(q).enumerate() {
                        let got = report.meta.get(i).copied().unwrap_or(0);
                        check_mask(got, self.world, q, 0, peer, b)?;
                        m.words[b] = got;
                    }
                }
            }
        }
        self.done(cx)
    }
}
