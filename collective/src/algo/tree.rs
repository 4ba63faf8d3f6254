//! MLNET's aggregation and multicast tree as one operation: the tensor is cut into pipeline
//! chunks; each chunk is summed up the tree (an aggregator adds its children's chunk to its
//! own as it lands and forwards one chunk upstream once every child's has arrived) and the
//! root's result is multicast down the same tree. Chunks pipeline: a node forwards chunk k
//! up while chunk k + 1 still arrives, and results flow down while later chunks go up.
//! Every receive is posted when the operation starts.

use gradwire_msg::core::SendOpts;
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use super::reduction::Reduction;
use super::{
    check_mask, digest, finish_blocks, post_digest, send_digest, take_digest, ReduceOutcome,
    ReduceSpec, DIGEST_LEN,
};
use crate::tree::Tree;

/// Blocks per pipeline chunk.
pub const PIPELINE_BLOCKS: usize = 64;

/// The tree all-reduce over one region.
#[derive(Debug)]
pub struct TreeAllReduce {
    /// Its blocks in one chunk (one segment's payload each).
    r: Reduction,
    tree: Tree,
    /// Pipeline chunks: (byte range, block range).
    pipeline: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    parent: Option<u16>,
    children: Vec<u16>,
    /// Message numbers: up from each child, up to the parent, down from the parent, down to
    /// each child (first of `pipeline.len()` each).
    up_from: Vec<u32>,
    up_to: u32,
    down_from: u32,
    down_to: Vec<u32>,
    /// Per chunk, children whose part has not arrived yet.
    waiting: Vec<usize>,
    /// With [`ReduceSpec::verify_results`]: the root's digest of the result.
    check: Option<TreeCheck>,
}

/// The multicast's check ([`ReduceSpec::verify_results`]): the root sends the digest of the
/// whole result straight to every rank below its children (their copy came through
/// aggregators), one message per such pair; each compares its copy once all of it is in.
#[derive(Debug, Default)]
struct TreeCheck {
    /// Root: the message number of its digest to each such rank.
    sends: Vec<(u16, u32)>,
    /// Chunks reduced at the root, or results in at another rank.
    chunks: usize,
    /// Another rank: its receive of the root's digest, and the digest once in.
    recv: Option<(u32, BufId)>,
    want: Option<[u8; DIGEST_LEN]>,
}

impl TreeAllReduce {
    /// A tree all-reduce of `region` over `tree`, which must span every rank.
    pub fn new(region: Region, spec: ReduceSpec, tree: Tree) -> TreeAllReduce {
        TreeAllReduce {
            r: Reduction::new(region, spec),
            tree,
            pipeline: Vec::new(),
            parent: None,
            children: Vec::new(),
            up_from: Vec::new(),
            up_to: 0,
            down_from: 0,
            down_to: Vec::new(),
            waiting: Vec::new(),
            check: None,
        }
    }

    /// The digest of the whole result as this rank holds it.
    fn result_digest(&self, cx: &OpCx<'_>) -> Result<[u8; DIGEST_LEN], OpError> {
        let values = cx.buf(self.r.buf()?);
        let sets = self
            .r
            .masks
            .as_ref()
            .map(|m| m.meta(0..self.r.chunks.blocks()))
            .unwrap_or_default();
        Ok(digest(b"gradwire tree result v1", 0, values, &sets))
    }

    /// Reserves and posts the check's messages (after the tree's own).
    fn start_check(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let root = self.tree.root();
        let mut check = TreeCheck::default();
        let below_children = |r: usize| self.tree.depth(r).is_some_and(|d| d >= 2);
        if self.r.rank == root {
            for q in (0..self.r.world).filter(|&q| below_children(q)) {
                check.sends.push((q as u16, cx.reserve_sends(q as u16, 1)?));
            }
            self.r.sends_left += check.sends.len();
        } else if below_children(self.r.rank) {
            check.recv = Some(post_digest(cx, root as u16)?);
            self.r.recvs_left += 1;
        }
        self.check = Some(check);
        Ok(())
    }

    /// One more chunk of the result is final here: at the root, once all are, the digest
    /// goes out; at another rank, once all are in and so is the digest, they are compared.
    fn result_chunk(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let n = self.pipeline.len();
        let Some(check) = self.check.as_mut() else {
            return Ok(());
        };
        check.chunks += 1;
        if check.chunks < n {
            return Ok(());
        }
        if !check.sends.is_empty() {
            let d = self.result_digest(cx)?;
            let sends = self
                .check
                .as_ref()
                .map(|c| c.sends.clone())
                .unwrap_or_default();
            for (q, msg) in sends {
                send_digest(cx, q, msg, &d)?;
            }
            return Ok(());
        }
        self.compare(cx)
    }

    /// Compares this rank's result with the root's digest once both are whole.
    fn compare(&self, cx: &OpCx<'_>) -> Result<(), OpError> {
        let Some(check) = &self.check else {
            return Ok(());
        };
        let (Some(want), true) = (check.want, check.chunks >= self.pipeline.len()) else {
            return Ok(());
        };
        if self.result_digest(cx)? == want {
            return Ok(());
        }
        // The aggregators it came through: this rank's ancestors below the root.
        let path: Vec<usize> =
            std::iter::successors(self.tree.parent(self.r.rank), |&a| self.tree.parent(a))
                .filter(|&a| a != self.tree.root())
                .collect();
        Err(OpError::Data {
            peer: self.parent.unwrap_or(0),
            reason: format!(
                "the result changed on its way down: it does not match the digest the root, \
                 rank {}, sent here directly; one of the ranks it came through ({path:?}) \
                 changed it",
                self.tree.root()
            ),
        })
    }

    fn meta(&self, k: usize) -> Vec<u64> {
        match &self.r.masks {
            Some(m) => m.meta(self.pipeline[k].1.clone()),
            None => Vec::new(),
        }
    }

    /// Chunk `k` has every child's part: send it up, or (root) finish it and start it down.
    fn chunk_reduced(&mut self, cx: &mut OpCx<'_>, k: usize) -> Result<(), OpError> {
        let buf = self.r.buf()?;
        let (bytes, _) = self.pipeline[k].clone();
        match self.parent {
            Some(parent) => {
                let opts = SendOpts {
                    tos: self.r.spec.tos,
                    layer: self.r.spec.layer,
                    meta: self.meta(k),
                    tos_per_segment: self.r.tags(&cx.buf(buf)[bytes.clone()], cx.seg_payload()),
                    rotate: self.r.spec.lossy(),
                };
                cx.send(parent, self.up_to + k as u32, buf, bytes, opts)?;
                self.r.sends_left += 1;
            }
            None => {
                let blocks = self.pipeline[k].1.clone();
                let region = cx.buf_mut(buf);
                if let Some(b) = region.get_mut(bytes) {
                    finish_blocks(
                        &self.r.spec,
                        &self.r.chunks,
                        blocks,
                        b,
                        self.r.masks.as_ref(),
                        self.r.world,
                    );
                }
                self.send_down(cx, k)?;
                self.result_chunk(cx)?;
            }
        }
        Ok(())
    }

    fn send_down(&mut self, cx: &mut OpCx<'_>, k: usize) -> Result<(), OpError> {
        let buf = self.r.buf()?;
        let (bytes, _) = self.pipeline[k].clone();
        #[cfg(test)]
        if self.parent.is_some() && self.r.spec.tamper == Some(self.r.rank) {
            if let Some(b) = cx.buf_mut(buf).get_mut(bytes.start) {
                *b ^= 0x40;
            }
        }
        for (i, &c) in self.children.clone().iter().enumerate() {
            let opts = SendOpts {
                tos: self.r.spec.tos,
                layer: self.r.spec.layer,
                meta: self.meta(k),
                tos_per_segment: Vec::new(),
                rotate: false,
            };
            cx.send(c, self.down_to[i] + k as u32, buf, bytes.clone(), opts)?;
            self.r.sends_left += 1;
        }
        Ok(())
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        self.r.finish(cx, "tree")
    }
}

impl Op for TreeAllReduce {
    type Output = ReduceOutcome;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        let (rank, world) = (usize::from(cx.rank()), usize::from(cx.world()));
        if self.tree.len() != world || !self.tree.contains(rank) {
            return Err(OpError::Invalid(format!(
                "the tree has {} members for a {world}-rank job: it must span every rank",
                self.tree.len(),
            )));
        }
        let buf = self.r.begin(cx, false)?;
        let seg = cx.seg_payload();
        let blocks = self.r.chunks.blocks();
        let len = self.r.chunks.bytes(0).end;
        self.pipeline = (0..blocks.div_ceil(PIPELINE_BLOCKS).max(1))
            .map(|k| {
                let b = k * PIPELINE_BLOCKS..((k + 1) * PIPELINE_BLOCKS).min(blocks);
                ((b.start * seg).min(len)..(b.end * seg).min(len), b)
            })
            .collect();
        let n = self.pipeline.len() as u32;
        self.r.track_sets(self.r.spec.lossy() && world > 1);
        self.parent = self.tree.parent(self.r.rank).map(|p| p as u16);
        self.children = self
            .tree
            .children(self.r.rank)
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
        for k in 0..self.pipeline.len() {
            let bytes = self.pipeline[k].0.clone();
            for (i, &c) in self.children.clone().iter().enumerate() {
                let deadline = self.r.spec.step_deadline.map(|d| cx.now() + d);
                // A child's part carries its whole subtree's sum.
                let carried = subtree_size(&self.tree, usize::from(c));
                let opts = self.r.sum_opts(deadline, &bytes, carried);
                cx.recv(c, self.up_from[i] + k as u32, buf, bytes.clone(), opts)?;
                self.r.recvs_left += 1;
            }
            if let Some(p) = self.parent {
                let opts = self.r.result_opts();
                cx.recv(p, self.down_from + k as u32, buf, bytes, opts)?;
                self.r.recvs_left += 1;
            }
        }
        if self.r.spec.verify_results && world > 2 {
            self.start_check(cx)?;
        }
        self.waiting = vec![self.children.len(); self.pipeline.len()];
        if self.children.is_empty() {
            for k in 0..self.pipeline.len() {
                self.chunk_reduced(cx, k)?;
            }
        }
        self.done(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<ReduceOutcome> {
        match ev {
            OpEvent::Sent { segments, .. } => self.r.sent(segments),
            OpEvent::Received { peer, msg, report } => {
                self.r.recvs_left = self.r.recvs_left.saturating_sub(1);
                let n = self.pipeline.len() as u32;
                let digest_msg = self.check.as_ref().and_then(|c| c.recv);
                if let Some((_, dbuf)) =
                    digest_msg.filter(|&(m, _)| usize::from(peer) == self.tree.root() && m == msg)
                {
                    let d = take_digest(cx, dbuf);
                    if let Some(c) = self.check.as_mut() {
                        c.want = Some(d);
                    }
                    self.compare(cx)?;
                    return self.done(cx);
                }
                if Some(peer) == self.parent && msg.wrapping_sub(self.down_from) < n {
                    // The root's result of chunk k: keep its sets, pass it on.
                    let k = msg.wrapping_sub(self.down_from) as usize;
                    let root = self.tree.root();
                    if let Some(m) = &mut self.r.masks {
                        for (i, b) in self.pipeline[k].1.clone().enumerate() {
                            let got = report.meta.get(i).copied().unwrap_or(0);
                            check_mask(got, self.r.world, root, 0, peer, b)?;
                            m.words[b] = got;
                        }
                    }
                    self.send_down(cx, k)?;
                    self.result_chunk(cx)?;
                } else if let Some(i) = self.children.iter().position(|&c| c == peer) {
                    let k = msg.wrapping_sub(self.up_from[i]) as usize;
                    if k >= self.pipeline.len() {
                        return Err(OpError::Invalid(format!("message {msg} from rank {peer}")));
                    }
                    self.r.record_step(cx.now(), peer, &report);
                    if let Some(m) = &mut self.r.masks {
                        for (j, b) in self.pipeline[k].1.clone().enumerate() {
                            if report.has(j) {
                                let got = report.meta.get(j).copied().unwrap_or(0);
                                check_mask(
                                    got,
                                    self.r.world,
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

/// Ranks in the subtree under `rank` (itself included).
fn subtree_size(tree: &Tree, rank: usize) -> usize {
    1 + tree
        .children(rank)
        .iter()
        .map(|&c| subtree_size(tree, c))
        .sum::<usize>()
}
