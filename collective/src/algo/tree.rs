//! MLNET's aggregation and multicast tree as one operation: the tensor is cut into pipeline
//! chunks; each chunk is summed up the tree (an aggregator adds its children's chunk to its
//! own as it lands and forwards one chunk upstream once every child's has arrived) and the
//! root's result is multicast down the same tree. Chunks pipeline: a node forwards chunk k
//! up while chunk k + 1 still arrives, and results flow down while later chunks go up.
//! Every receive is posted when the operation starts.

use gradwire_msg::core::{Place, RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use super::{
    check_mask, check_spec, finish_blocks, outcome, step, Chunks, Masks, ReduceOutcome, ReduceSpec,
    StepReport,
};
use crate::tree::Tree;

/// Blocks per pipeline chunk.
pub const PIPELINE_BLOCKS: usize = 64;

/// The tree all-reduce over one region.
#[derive(Debug)]
pub struct TreeAllReduce {
    spec: ReduceSpec,
    tree: Tree,
    region: Option<Region>,
    buf: Option<BufId>,
    /// Blocks of the tensor (one segment's payload each).
    layout: Chunks,
    /// Pipeline chunks: (byte range, block range).
    chunks: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    masks: Option<Masks>,
    rank: usize,
    world: usize,
    parent: Option<u16>,
    children: Vec<u16>,
    /// Message numbers: up from each child, up to the parent, down from the parent, down to
    /// each child (first of `chunks.len()` each).
    up_from: Vec<u32>,
    up_to: u32,
    down_from: u32,
    down_to: Vec<u32>,
    /// Per chunk, children whose part has not arrived yet.
    waiting: Vec<usize>,
    sends_left: usize,
    recvs_left: usize,
    steps: Vec<StepReport>,
    started: Option<std::time::Instant>,
}

impl TreeAllReduce {
    /// A tree all-reduce of `region` over `tree`, which must span every rank.
    pub fn new(region: Region, spec: ReduceSpec, tree: Tree) -> TreeAllReduce {
        TreeAllReduce {
            spec,
            tree,
            region: Some(region),
            buf: None,
            layout: Chunks::new(0, 1, 1),
            chunks: Vec::new(),
            masks: None,
            rank: 0,
            world: 1,
            parent: None,
            children: Vec::new(),
            up_from: Vec::new(),
            up_to: 0,
            down_from: 0,
            down_to: Vec::new(),
            waiting: Vec::new(),
            sends_left: 0,
            recvs_left: 0,
            steps: Vec::new(),
            started: None,
        }
    }

    fn meta(&self, k: usize) -> Vec<u64> {
        match &self.masks {
            Some(m) => m.meta(self.chunks[k].1.clone()),
            None => Vec::new(),
        }
    }

    fn buf(&self) -> Result<BufId, OpError> {
        self.buf.ok_or_else(|| OpError::Invalid("no buffer".into()))
    }

    /// Chunk `k` has every child's part: send it up, or (root) finish it and start it down.
    fn chunk_reduced(&mut self, cx: &mut OpCx<'_>, k: usize) -> Result<(), OpError> {
        let buf = self.buf()?;
        let (bytes, _) = self.chunks[k].clone();
        match self.parent {
            Some(parent) => {
                let opts = SendOpts {
                    tos: self.spec.tos,
                    layer: self.spec.layer,
                    meta: self.meta(k),
                    tos_per_segment: Vec::new(),
                };
                cx.send(parent, self.up_to + k as u32, buf, bytes, opts)?;
                self.sends_left += 1;
            }
            None => {
                let blocks = self.chunks[k].1.clone();
                let region = cx.buf_mut(buf);
                if let Some(b) = region.get_mut(bytes) {
                    finish_blocks(
                        &self.spec,
                        &self.layout,
                        blocks,
                        b,
                        self.masks.as_ref(),
                        self.world,
                    );
                }
                self.send_down(cx, k)?;
            }
        }
        Ok(())
    }

    fn send_down(&mut self, cx: &mut OpCx<'_>, k: usize) -> Result<(), OpError> {
        let buf = self.buf()?;
        let (bytes, _) = self.chunks[k].clone();
        for (i, &c) in self.children.clone().iter().enumerate() {
            let opts = SendOpts {
                tos: self.spec.tos,
                layer: self.spec.layer,
                meta: self.meta(k),
                tos_per_segment: Vec::new(),
            };
            cx.send(c, self.down_to[i] + k as u32, buf, bytes.clone(), opts)?;
            self.sends_left += 1;
        }
        Ok(())
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        if self.sends_left > 0 || self.recvs_left > 0 {
            return Ok(None);
        }
        let region = self.buf.take().and_then(|b| cx.unregister(b));
        let elapsed = cx
            .now()
            .saturating_duration_since(self.started.unwrap_or_else(|| cx.now()));
        Ok(Some(outcome(
            region,
            "tree",
            &self.layout,
            self.masks.as_ref(),
            self.world,
            std::mem::take(&mut self.steps),
            elapsed,
        )))
    }
}

impl Op for TreeAllReduce {
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
        if self.tree.len() != self.world || !self.tree.contains(self.rank) {
            return Err(OpError::Invalid(format!(
                "the tree has {} members for a {}-rank job: it must span every rank",
                self.tree.len(),
                self.world
            )));
        }
        let seg = cx.seg_payload();
        self.layout = Chunks::new(region.len(), seg, 1);
        let blocks = self.layout.blocks();
        let len = region.len();
        self.chunks = (0..blocks.div_ceil(PIPELINE_BLOCKS).max(1))
            .map(|k| {
                let b = k * PIPELINE_BLOCKS..((k + 1) * PIPELINE_BLOCKS).min(blocks);
                ((b.start * seg).min(len)..(b.end * seg).min(len), b)
            })
            .collect();
        let n = self.chunks.len() as u32;
        let buf = cx.register(region);
        self.buf = Some(buf);
        let lossy = self.spec.loss_bound > 0.0 && self.world > 1;
        if lossy {
            self.masks = Some(Masks::only(blocks, self.rank));
        }
        self.parent = self.tree.parent(self.rank).map(|p| p as u16);
        self.children = self
            .tree
            .children(self.rank)
            .iter()
            .map(|&c| c as u16)
            .collect();
        // Reservations, in one order every rank derives from the tree.
        for &c in &self.children.clone() {
            self.up_from.push(cx.reserve_recvs(c, n)?);
        }
        if let Some(p) = self.parent {
            self.up_to = cx.reserve_sends(p, n)?;
            self.down_from = cx.reserve_recvs(p, n)?;
        }
        for &c in &self.children.clone() {
            self.down_to.push(cx.reserve_sends(c, n)?);
        }
        for k in 0..self.chunks.len() {
            let bytes = self.chunks[k].0.clone();
            for (i, &c) in self.children.clone().iter().enumerate() {
                let opts = RecvOpts {
                    place: Place::Sum(self.spec.dtype),
                    loss_bound: self.spec.loss_bound,
                    keep_meta: lossy,
                    deadline: self.spec.step_deadline.map(|d| cx.now() + d),
                    up_to: false,
                    skip_meta_zero: false,
                    patient: false,
                };
                cx.recv(c, self.up_from[i] + k as u32, buf, bytes.clone(), opts)?;
                self.recvs_left += 1;
            }
            if let Some(p) = self.parent {
                let opts = RecvOpts {
                    keep_meta: lossy,
                    ..RecvOpts::default()
                };
                cx.recv(p, self.down_from + k as u32, buf, bytes, opts)?;
                self.recvs_left += 1;
            }
        }
        self.waiting = vec![self.children.len(); self.chunks.len()];
        if self.children.is_empty() {
            for k in 0..self.chunks.len() {
                self.chunk_reduced(cx, k)?;
            }
        }
        self.done(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        match ev {
            OpEvent::Sent { .. } => self.sends_left = self.sends_left.saturating_sub(1),
            OpEvent::Received { peer, msg, report } => {
                self.recvs_left = self.recvs_left.saturating_sub(1);
                let n = self.chunks.len() as u32;
                if Some(peer) == self.parent && msg.wrapping_sub(self.down_from) < n {
                    // The root's result of chunk k: keep its sets, pass it on.
                    let k = msg.wrapping_sub(self.down_from) as usize;
                    let root = self.tree.root();
                    if let Some(m) = &mut self.masks {
                        for (i, b) in self.chunks[k].1.clone().enumerate() {
                            let got = report.meta.get(i).copied().unwrap_or(0);
                            check_mask(got, self.world, root, 0, peer, b)?;
                            m.words[b] = got;
                        }
                    }
                    self.send_down(cx, k)?;
                } else if let Some(i) = self.children.iter().position(|&c| c == peer) {
                    let k = msg.wrapping_sub(self.up_from[i]) as usize;
                    if k >= self.chunks.len() {
                        return Err(OpError::Invalid(format!("message {msg} from rank {peer}")));
                    }
                    self.steps.push(step(peer, &report));
                    if let Some(m) = &mut self.masks {
                        for (j, b) in self.chunks[k].1.clone().enumerate() {
                            if report.has(j) {
                                let got = report.meta.get(j).copied().unwrap_or(0);
                                check_mask(
                                    got,
                                    self.world,
                                    usize::from(peer),
                                    m.words[b],
                                    peer,
                                    b,
                                )?;
                                m.words[b] |= got;
                            }
                        }
                    }
                    self.waiting[k] = self.waiting[k].saturating_sub(1);
                    if self.waiting[k] == 0 {
                        self.chunk_reduced(cx, k)?;
                    }
                }
            }
        }
        self.done(cx)
    }
}
