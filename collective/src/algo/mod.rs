//! Collective algorithms on the message layer: each is an operation (`gradwire_msg::op::Op`)
//! that runs on the endpoint's progress thread over buffers registered once, posts every
//! message it can up front and reacts to completions (no thread or handshake per step).
//!
//! - [`ring`]: reduce-scatter then all-gather around the ring (also each half alone);
//! - [`direct`]: the two-phase all-to-all all-reduce (each rank reduces its own chunk, then
//!   sends it to everyone): two message rounds, for small worlds and small tensors;
//! - [`tree`]: MLNET's aggregation and multicast trees, pipelined in chunks;
//! - [`bcast`]: binomial-tree broadcast; [`barrier`]: dissemination barrier;
//!   point-to-point transfers are `gradwire_msg::p2p`.
//!
//! Bounded loss (DLCP): with a loss bound p > 0 the reduce-scatter half may end a step with
//! up to p of its segments missing; who is summed in each block travels in the segments'
//! meta word (a rank bit-set, so lossy reductions are limited to 64 ranks) and each block
//! is finished over its contributors ([`crate::aggregate::finish_block`]). The all-gather
//! half is always reliable, so every rank ends with the same values and the same sets.
//!
//! The bound is a bound on what each block's result misses: a block's delivered fraction is
//! the share of ranks summed in it, and the bound holds for the tensor's elements on
//! average, and for each of the spec's `ranges` (the parameters a tensor coalesces) on its
//! own. A segment lost on a hop that carries `k` ranks' partial sum costs its blocks `k` of
//! the `world` contributions, so a receive carrying `k` does without at most
//! `min(p, p * world / ((world - 1) * k))` of each range (see [`step_bound`]): the hops
//! together lose at most p.

pub mod barrier;
pub mod bcast;
pub mod direct;
pub mod ring;
pub mod tree;

mod reduction;

use std::ops::Range;
use std::time::Duration;

use gradwire::tensor::DType;
use gradwire_msg::core::{Ended, RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{OpCx, OpError};

use crate::aggregate::{finish_block, Contributors, ReduceOp};

/// Largest world a lossy reduction supports (contributor sets are one 64-bit word).
pub const MAX_LOSSY_WORLD: usize = 64;

/// Options of a reduction.
#[derive(Debug, Clone)]
pub struct ReduceSpec {
    /// Element type.
    pub dtype: DType,
    /// Sum or average.
    pub op: ReduceOp,
    /// DLCP loss bound of the reduce-scatter half (0: reliable).
    pub loss_bound: f64,
    /// TOS byte of the data (DSCP << 2 | ECN).
    pub tos: u8,
    /// DNN layer.
    pub layer: u16,
    /// A time bound per lossy step (OptiReduce): a reduce-scatter receive ends at most this
    /// long after its step could start, with what arrived (`None`: only the loss bound).
    pub step_deadline: Option<Duration>,
    /// Byte ranges of the tensor (ascending, disjoint) each held to the loss bound on its
    /// own: a parameter of a coalesced bucket delivers at least `1 - loss_bound` whatever
    /// its neighbours lose. Empty: the tensor as a whole.
    pub ranges: std::sync::Arc<[Range<usize>]>,
    /// DLCP's magnitude tagging of the lossy steps (§3.2.2): a reduce-scatter segment whose
    /// mean |g| is below the tensor's threshold (the median |g| of a sample, taken when the
    /// operation starts) goes not-ECT, the first a congested switch drops; the others stay
    /// ECN-capable. Only under a loss or time bound; results always go ECN-capable.
    pub tagging: Tagging,
    /// Ring: every chunk's owner also sends the digest of its finished chunk (SHA-256 of its
    /// values and contributor sets) straight to every rank, which checks the chunk it got
    /// through the ring against it: a rank that changed a chunk it forwarded is an error
    /// naming the ranks it came through, never a silently different result. Costs one hash
    /// of the tensor per rank and `world - 1` small messages per rank. Tree: the root sends
    /// the digest of the whole result to every rank below its children, alike. (Two-phase:
    /// nothing is forwarded, nothing to check.)
    pub verify_results: bool,
    /// Tests: this rank changes a byte of every chunk it forwards in the all-gather.
    #[cfg(test)]
    pub(crate) tamper: Option<usize>,
}

/// How the segments of a bounded reduction's lossy steps are tagged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Tagging {
    /// DLCP's default (§3.2.2): the layer's DSCP, and ECN-capable only where the segment's
    /// mean |g| reaches the tensor's threshold (the median |g| of a 0.1 % sample).
    #[default]
    Magnitude,
    /// The layer's DSCP, every segment ECN-capable.
    Layer,
}

impl ReduceSpec {
    /// Whether a reduce-scatter step may end short (a loss bound or a time bound): then
    /// contributor sets are kept, so a block is finished over who is really in it.
    pub(crate) fn lossy(&self) -> bool {
        self.loss_bound > 0.0 || self.step_deadline.is_some()
    }
}

/// The loss bound of a receive that carries `carried` ranks' partial sum, in a reduction
/// of `world` ranks under `p`: what it misses costs each block `carried / world` of its
/// contributions, and at most `world - 1` such receives feed a block, so each gets
/// `p / (world - 1)` of the loss (never more than `p` itself).
pub(crate) fn step_bound(p: f64, world: usize, carried: usize) -> f64 {
    if p <= 0.0 || world < 2 {
        return 0.0;
    }
    let share = p * world as f64 / ((world - 1) as f64 * carried.max(1) as f64);
    share.min(p)
}

/// The spec's ranges within `bytes` (a receive's part of the tensor), from its start.
pub(crate) fn ranges_within(ranges: &[Range<usize>], bytes: &Range<usize>) -> Vec<Range<usize>> {
    let first = ranges.partition_point(|r| r.end <= bytes.start);
    ranges[first..]
        .iter()
        .take_while(|r| r.start < bytes.end)
        .map(|r| r.start.max(bytes.start) - bytes.start..r.end.min(bytes.end) - bytes.start)
        .filter(|r| !r.is_empty())
        .collect()
}

/// How one lossy receive of a reduction ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepReport {
    /// The sender.
    pub peer: usize,
    /// What ended it.
    pub ended: Ended,
    /// Segments it ended without.
    pub missing: u32,
    /// Segments of the message.
    pub segments: u32,
    /// From when the step could start (its sender's data was due) to its end: what an
    /// adaptive time bound learns from.
    pub waited: Duration,
}

/// What a reduction did.
#[derive(Debug)]
pub struct ReduceOutcome {
    /// The memory the operation worked on (owned buffers come back here).
    pub region: Option<Region>,
    /// `ring` or `direct`.
    pub algorithm: &'static str,
    /// Blocks (one segment each).
    pub blocks: usize,
    /// Blocks with every rank summed in.
    pub complete_blocks: usize,
    /// Who is summed in each block; `None` when the reduction was reliable (everyone).
    pub contributors: Option<Contributors>,
    /// Segments this rank received short under the bound.
    pub missing_segments: u64,
    /// How each reduce-scatter receive of this rank ended (the loss bound, the deadline, or
    /// complete), in order of arrival.
    pub steps: Vec<StepReport>,
    /// Data segments this rank sent for the operation, resends included (this operation's
    /// own, whatever else runs on the endpoint).
    pub segments_sent: u64,
    /// Wall time on the progress thread.
    pub elapsed: Duration,
}

/// The tensor cut into `world` chunks of whole blocks (block = one segment's payload).
#[derive(Debug, Clone)]
pub(crate) struct Chunks {
    len: usize,
    block: usize,
    per_chunk: usize,
    world: usize,
}

impl Chunks {
    pub(crate) fn new(len: usize, block: usize, world: usize) -> Chunks {
        let blocks = len.div_ceil(block.max(1));
        Chunks {
            len,
            block: block.max(1),
            per_chunk: blocks.div_ceil(world.max(1)),
            world: world.max(1),
        }
    }

    /// Blocks in the tensor.
    pub(crate) fn blocks(&self) -> usize {
        self.len.div_ceil(self.block)
    }

    /// Bytes of chunk `c`.
    pub(crate) fn bytes(&self, c: usize) -> Range<usize> {
        let start = (c * self.per_chunk * self.block).min(self.len);
        let end = ((c + 1) * self.per_chunk * self.block).min(self.len);
        start..end
    }

    /// Blocks of chunk `c` (empty for an empty chunk, whatever its byte offset).
    pub(crate) fn block_range(&self, c: usize) -> Range<usize> {
        let blocks = self.blocks();
        (c * self.per_chunk).min(blocks)..((c + 1) * self.per_chunk).min(blocks)
    }

    /// `(x - y) mod world`.
    pub(crate) fn sub(&self, x: usize, y: usize) -> usize {
        (x + self.world * 2 - y % self.world) % self.world
    }
}

/// Per-block contributor sets as rank bit-sets (only kept for lossy reductions).
#[derive(Debug, Clone)]
pub(crate) struct Masks {
    pub(crate) words: Vec<u64>,
}

impl Masks {
    pub(crate) fn only(blocks: usize, rank: usize) -> Masks {
        Masks {
            words: vec![1u64 << rank; blocks],
        }
    }

    /// The sets of `blocks`, as meta words of the segments that carry them.
    pub(crate) fn meta(&self, blocks: Range<usize>) -> Vec<u64> {
        let n = blocks.len().max(1);
        let mut v = self
            .words
            .get(blocks)
            .map(<[u64]>::to_vec)
            .unwrap_or_default();
        v.resize(n, 0);
        v
    }

    pub(crate) fn count(&self, b: usize) -> usize {
        self.words.get(b).map_or(0, |w| w.count_ones() as usize)
    }

    pub(crate) fn to_contributors(&self, world: usize) -> Contributors {
        let mut c = Contributors::none(self.words.len(), world);
        for (b, w) in self.words.iter().enumerate() {
            for r in 0..world.min(64) {
                if w & (1 << r) != 0 {
                    c.insert(b, r);
                }
            }
        }
        c
    }
}

/// Bytes of a result digest (SHA-256).
pub(crate) const DIGEST_LEN: usize = 32;

/// The digest an owner sends of what it finished ([`ReduceSpec::verify_results`]): part
/// `index` of an operation (`label` says which kind), its values and, under a loss bound,
/// its contributor sets.
pub(crate) fn digest(label: &[u8], index: u64, values: &[u8], sets: &[u64]) -> [u8; DIGEST_LEN] {
    let mut h = ::ring::digest::Context::new(&::ring::digest::SHA256);
    h.update(label);
    h.update(&index.to_le_bytes());
    h.update(&(values.len() as u64).to_le_bytes());
    h.update(values);
    for w in sets {
        h.update(&w.to_le_bytes());
    }
    let mut out = [0u8; DIGEST_LEN];
    out.copy_from_slice(h.finish().as_ref());
    out
}

/// Reserves and posts the receive of one digest message from `peer` (reliable, into a
/// buffer of its own): its message number and buffer.
pub(crate) fn post_digest(cx: &mut OpCx<'_>, peer: u16) -> Result<(u32, BufId), OpError> {
    let msg = cx.reserve_recvs(peer, 1)?;
    let buf = cx.register(Region::owned(vec![0u8; DIGEST_LEN]));
    cx.recv(peer, msg, buf, 0..DIGEST_LEN, RecvOpts::default())?;
    Ok((msg, buf))
}

/// Sends `d` as message `msg` to `peer` (reliable).
pub(crate) fn send_digest(
    cx: &mut OpCx<'_>,
    peer: u16,
    msg: u32,
    d: &[u8; DIGEST_LEN],
) -> Result<(), OpError> {
    let buf = cx.register(Region::owned(d.to_vec()));
    cx.send(peer, msg, buf, 0..DIGEST_LEN, SendOpts::default())
}

/// The digest a posted receive got, its buffer released.
pub(crate) fn take_digest(cx: &mut OpCx<'_>, buf: BufId) -> [u8; DIGEST_LEN] {
    let mut d = [0u8; DIGEST_LEN];
    d.copy_from_slice(cx.buf(buf).get(..DIGEST_LEN).unwrap_or(&[0; DIGEST_LEN]));
    cx.unregister(buf);
    d
}

/// Checks a contributor set that arrived from `peer` for a block: within the world, naming
/// `must` (who certainly contributed) and none of `must_not` (already summed here: a
/// duplicate would count twice).
pub(crate) fn check_mask(
    m: u64,
    world: usize,
    must: usize,
    must_not: u64,
    peer: u16,
    block: usize,
) -> Result<(), gradwire_msg::op::OpError> {
    let all = if world >= 64 {
        u64::MAX
    } else {
        (1u64 << world) - 1
    };
    let why = if m & !all != 0 {
        "names a rank beyond the world"
    } else if m & (1 << must) == 0 {
        "leaves out the rank whose values it carries"
    } else if m & must_not != 0 {
        "names a rank it cannot carry (one already summed here, or not its sender)"
    } else {
        return Ok(());
    };
    Err(gradwire_msg::op::OpError::Data {
        peer,
        reason: format!("the contributor set {m:#x} of block {block} {why}"),
    })
}

/// Finishes `blocks` of a tensor whose bytes from the first of them on are `bytes`.
pub(crate) fn finish_blocks(
    spec: &ReduceSpec,
    layout: &Chunks,
    blocks: Range<usize>,
    bytes: &mut [u8],
    masks: Option<&Masks>,
    world: usize,
) {
    for (i, blk) in bytes.chunks_mut(layout.block).enumerate() {
        let count = masks.map_or(world, |m| m.count(blocks.start + i));
        finish_block(spec.op, spec.dtype, blk, count, world);
    }
}

/// Finishes the blocks of `chunk` in `bytes` (a sum over `count` contributors becomes the
/// requested sum or average).
pub(crate) fn finish_chunk(
    spec: &ReduceSpec,
    chunks: &Chunks,
    c: usize,
    bytes: &mut [u8],
    masks: Option<&Masks>,
    world: usize,
) {
    let range = chunks.bytes(c);
    let first = chunks.block_range(c).start;
    if let Some(region) = bytes.get_mut(range) {
        for (i, blk) in region.chunks_mut(chunks.block).enumerate() {
            let count = masks.map_or(world, |m| m.count(first + i));
            finish_block(spec.op, spec.dtype, blk, count, world);
        }
    }
}

/// A summary from the masks at the end of a reduction.
pub(crate) fn outcome(
    region: Option<Region>,
    algorithm: &'static str,
    chunks: &Chunks,
    masks: Option<&Masks>,
    world: usize,
    steps: Vec<StepReport>,
    elapsed: Duration,
) -> ReduceOutcome {
    let blocks = chunks.blocks();
    let complete_blocks = match masks {
        None => blocks,
        Some(m) => (0..blocks).filter(|&b| m.count(b) == world).count(),
    };
    ReduceOutcome {
        region,
        algorithm,
        blocks,
        complete_blocks,
        contributors: masks.map(|m| m.to_contributors(world)),
        missing_segments: steps.iter().map(|s| u64::from(s.missing)).sum(),
        steps,
        segments_sent: 0,
        elapsed,
    }
}

/// Checks a reduction's arguments.
pub(crate) fn check_spec(spec: &ReduceSpec, len: usize, world: usize) -> Result<(), String> {
    if len % spec.dtype.elem_size() != 0 {
        return Err(format!(
            "{len} bytes is not a whole number of {} elements",
            spec.dtype
        ));
    }
    if !(0.0..1.0).contains(&spec.loss_bound) {
        return Err(format!("loss bound {} is not in [0, 1)", spec.loss_bound));
    }
    let mut end = 0;
    for r in spec.ranges.iter() {
        if r.start < end || r.start >= r.end || r.end > len {
            return Err(format!(
                "loss range {r:?} (bytes) is not after {end}, non-empty and within the \
                 {len}-byte tensor: give ascending, disjoint element ranges"
            ));
        }
        end = r.end;
    }
    if spec.lossy() && world > MAX_LOSSY_WORLD {
        return Err(format!(
            "a bounded-loss or time-bounded reduction supports at most {MAX_LOSSY_WORLD} ranks \
             (this job has {world}): use loss bound 0 and no step deadline"
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
