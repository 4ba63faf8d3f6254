//! The two-phase all-reduce: every rank sends chunk q of its tensor to rank q and reduces
//! the chunks it receives into its own (phase 1), then sends its finished chunk to every
//! rank (phase 2). The same bytes per rank as the ring in two message rounds instead of
//! `2 (world - 1)`: the better choice for small tensors and small worlds.

use gradwire_msg::core::SendOpts;
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use super::reduction::Reduction;
use super::{check_mask, finish_chunk, ReduceOutcome, ReduceSpec};

/// The two-phase all-reduce over one region.
#[derive(Debug)]
pub struct Direct {
    r: Reduction,
    send_base: Vec<u32>,
    recv_base: Vec<u32>,
    phase1_left: usize,
}

impl Direct {
    /// A two-phase all-reduce over `region`.
    pub fn new(region: Region, spec: ReduceSpec) -> Direct {
        Direct {
            r: Reduction::new(region, spec),
            send_base: Vec::new(),
            recv_base: Vec::new(),
            phase1_left: 0,
        }
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.r.world).filter(move |&q| q != self.r.rank)
    }

    /// Phase 2: the finished chunk to every rank.
    fn broadcast_own(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let r = &mut self.r;
        let buf = r.buf()?;
        let masks = r.masks.as_ref();
        finish_chunk(&r.spec, &r.chunks, r.rank, cx.buf_mut(buf), masks, r.world);
        let range = r.chunks.bytes(r.rank);
        if range.is_empty() {
            return Ok(());
        }
        let meta = match masks {
            Some(m) => m.meta(r.chunks.block_range(r.rank)),
            None => Vec::new(),
        };
        for q in (0..r.world).filter(|&q| q != r.rank) {
            let opts = SendOpts {
                tos: r.spec.tos,
                layer: r.spec.layer,
                meta: meta.clone(),
                tos_per_segment: Vec::new(),
                rotate: false,
            };
            cx.send(q as u16, self.send_base[q] + 1, buf, range.clone(), opts)?;
            r.sends_left += 1;
        }
        Ok(())
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        if self.phase1_left > 0 {
            return Ok(None);
        }
        self.r.finish(cx, "direct")
    }
}

impl Op for Direct {
    type Output = ReduceOutcome;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        let buf = self.r.begin(cx, true)?;
        let (rank, world) = (self.r.rank, self.r.world);
        self.r.track_sets(self.r.spec.lossy() && world > 1);
        self.send_base = vec![0; world];
        self.recv_base = vec![0; world];
        let own = self.r.chunks.bytes(rank);
        for q in self.peers().collect::<Vec<_>>() {
            let peer = q as u16;
            self.send_base[q] = cx.reserve_sends(peer, 2)?;
            self.recv_base[q] = cx.reserve_recvs(peer, 2)?;
            // Phase 1 in: q's contribution to my chunk, added as it lands.
            if own.is_empty() {
                cx.skip_recv(peer, self.recv_base[q])?;
            } else {
                let deadline = self.r.spec.step_deadline.map(|d| cx.now() + d);
                let opts = self.r.sum_opts(deadline, &own, 1);
                cx.recv(peer, self.recv_base[q], buf, own.clone(), opts)?;
                self.phase1_left += 1;
                self.r.recvs_left += 1;
            }
            // Phase 2 in: q's finished chunk (reliable).
            let theirs = self.r.chunks.bytes(q);
            if theirs.is_empty() {
                cx.skip_recv(peer, self.recv_base[q] + 1)?;
            } else {
                let opts = self.r.result_opts();
                cx.recv(peer, self.recv_base[q] + 1, buf, theirs.clone(), opts)?;
                self.r.recvs_left += 1;
                // Phase 1 out: my contribution to q's chunk (under a bound, each segment
                // names me as its only contributor, which q checks).
                let meta = match &self.r.masks {
                    Some(_) => vec![1u64 << rank; self.r.chunks.block_range(q).len().max(1)],
                    None => Vec::new(),
                };
                let opts = SendOpts {
                    tos: self.r.spec.tos,
                    layer: self.r.spec.layer,
                    meta,
                    tos_per_segment: self.r.tags(&cx.buf(buf)[theirs.clone()], cx.seg_payload()),
                    // What a bound leaves out moves from message to message.
                    rotate: self.r.spec.lossy(),
                };
                cx.send(peer, self.send_base[q], buf, theirs, opts)?;
                self.r.sends_left += 1;
            }
        }
        if self.phase1_left == 0 {
            self.broadcast_own(cx)?;
        }
        self.done(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        match ev {
            OpEvent::Sent { segments, .. } => self.r.sent(segments),
            OpEvent::Received { peer, msg, report } => {
                self.r.recvs_left = self.r.recvs_left.saturating_sub(1);
                let q = usize::from(peer);
                if msg == self.recv_base[q] {
                    self.r.record_step(cx.now(), peer, &report);
                    if let Some(m) = &mut self.r.masks {
                        for (i, b) in self.r.chunks.block_range(self.r.rank).enumerate() {
                            if report.has(i) {
                                // q's own contribution: exactly {q}.
                                let got = report.meta.get(i).copied().unwrap_or(0);
                                check_mask(got, self.r.world, q, !(1u64 << q), peer, b)?;
                                m.words[b] |= 1 << q;
                            }
                        }
                    }
                    self.phase1_left = self.phase1_left.saturating_sub(1);
                    if self.phase1_left == 0 {
                        self.broadcast_own(cx)?;
                    }
                } else if let Some(m) = &mut self.r.masks {
                    for (i, b) in self.r.chunks.block_range(q).enumerate() {
                        let got = report.meta.get(i).copied().unwrap_or(0);
                        check_mask(got, self.r.world, q, 0, peer, b)?;
                        m.words[b] = got;
                    }
                }
            }
        }
        self.done(cx)
    }
}
