//! Binomial-tree broadcast: relative to the root, rank v receives from v minus its highest
//! set bit and forwards to v + 2^k for every 2^k above v (ceil(log2 world) rounds).
//!
//! Under a loss bound p each hop may end with up to p of its segments missing. A relay
//! forwards its whole buffer, and every segment's meta word says whether the relay holds the
//! root's bytes there (1) or not (0), so a block lost on the way is never taken for the
//! root's by a rank further down; each rank reports which blocks hold the root's values.

use gradwire_msg::core::{RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

/// What a broadcast left here.
#[derive(Debug)]
pub struct BroadcastOutcome {
    /// The memory (an owned buffer comes back here).
    pub region: Option<Region>,
    /// For each block (one segment's payload), whether it holds the root's values.
    pub received: Vec<bool>,
}

/// Broadcast of one region from `root`.
#[derive(Debug)]
pub struct Broadcast {
    root: usize,
    tos: u8,
    loss_bound: f64,
    region: Option<Region>,
    buf: Option<BufId>,
    children: Vec<(u16, u32)>,
    /// Per segment: this rank holds the root's bytes.
    valid: Vec<bool>,
    sends_left: usize,
    recv_left: usize,
}

impl Broadcast {
    /// A broadcast of `region` (the root's is sent; the others' are overwritten where the
    /// root's bytes arrive), each hop under `loss_bound`.
    pub fn new(region: Region, root: usize, tos: u8, loss_bound: f64) -> Broadcast {
        Broadcast {
            root,
            tos,
            loss_bound,
            region: Some(region),
            buf: None,
            children: Vec::new(),
            valid: Vec::new(),
            sends_left: 0,
            recv_left: 0,
        }
    }

    fn forward(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let buf = self
            .buf
            .ok_or_else(|| OpError::Invalid("no buffer".into()))?;
        let len = cx.buf(buf).len();
        let meta: Vec<u64> = if self.loss_bound > 0.0 {
            self.valid.iter().map(|&v| u64::from(v)).collect()
        } else {
            Vec::new()
        };
        for (peer, msg) in std::mem::take(&mut self.children) {
            let opts = SendOpts {
                tos: self.tos,
                meta: meta.clone(),
                ..SendOpts::default()
            };
            cx.send(peer, msg, buf, 0..len, opts)?;
            self.sends_left += 1;
        }
        Ok(())
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<BroadcastOutcome> {
        if self.sends_left > 0 || self.recv_left > 0 {
            return Ok(None);
        }
        Ok(Some(BroadcastOutcome {
            region: self.buf.take().and_then(|b| cx.unregister(b)),
            received: std::mem::take(&mut self.valid),
        }))
    }
}

impl Op for Broadcast {
    type Output = BroadcastOutcome;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<BroadcastOutcome> {
        let w = usize::from(cx.world());
        let r = usize::from(cx.rank());
        if self.root >= w {
            return Err(OpError::Invalid(format!(
                "root {} is not a rank of this {w}-rank job",
                self.root
            )));
        }
        if !(0.0..1.0).contains(&self.loss_bound) {
            return Err(OpError::Invalid(format!(
                "loss bound {} is not in [0, 1)",
                self.loss_bound
            )));
        }
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        let len = region.len();
        let segs = len.div_ceil(cx.seg_payload()).max(1);
        let buf = cx.register(region);
        self.buf = Some(buf);
        let v = (r + w - self.root) % w;
        self.valid = vec![v == 0; segs];
        let abs = |x: usize| ((x + self.root) % w) as u16;
        // Children: v + 2^k for every 2^k above v.
        let mut bit = if v == 0 {
            1
        } else {
            1 << (usize::BITS - v.leading_zeros())
        };
        while v + bit < w {
            let child = abs(v + bit);
            let msg = cx.reserve_sends(child, 1)?;
            self.children.push((child, msg));
            bit *= 2;
        }
        if v == 0 {
            self.forward(cx)?;
        } else {
            let parent = abs(v - (1 << (usize::BITS - 1 - v.leading_zeros())));
            let msg = cx.reserve_recvs(parent, 1)?;
            let lossy = self.loss_bound > 0.0;
            let opts = RecvOpts {
                loss_bound: self.loss_bound,
                keep_meta: lossy,
                // Blocks the relay does not hold are not written: this rank keeps its own.
                skip_meta_zero: lossy,
                ..RecvOpts::default()
            };
            cx.recv(parent, msg, buf, 0..len, opts)?;
            self.recv_left = 1;
        }
        self.done(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<BroadcastOutcome> {
        match ev {
            OpEvent::Sent { .. } => self.sends_left = self.sends_left.saturating_sub(1),
            OpEvent::Received { peer, report, .. } => {
                self.recv_left = 0;
                for (s, valid) in self.valid.iter_mut().enumerate() {
                    *valid = report.has(s)
                        && (self.loss_bound == 0.0 || report.meta.get(s).copied() == Some(1));
                    if report.has(s)
                        && self.loss_bound > 0.0
                        && report.meta.get(s).copied() > Some(1)
                    {
                        return Err(OpError::Data {
                            peer,
                            reason: format!(
                                "segment {s} of a broadcast says {:?}, neither held (1) nor \
                                 missing (0)",
                                report.meta.get(s)
                            ),
                        });
                    }
                }
                self.forward(cx)?;
            }
        }
        self.done(cx)
    }
}
