//! Bounded-loss aggregation (DLCP Appendix A), with no I/O.
//!
//! A tensor is cut into *blocks* of `block_elems` elements, the unit of loss accounting: a
//! block either arrived whole from a peer or it did not. Every partial aggregate travels with
//! its [`Contributors`]: for each block, the set of ranks whose gradients are summed in it.
//! Adding a peer's partial sum adds its values and unites the sets, block by block, for the
//! blocks that arrived; a block that did not arrive keeps the local partial and its set.
//! Finishing divides each block by *its own* contributor count (never by the world size when
//! some contributions are missing), so a lost segment costs that block a few contributors,
//! never a wrong average, and the sets are the per-layer loss report.
//!
//! The collective layer chooses `block_elems` so that blocks are exactly the transport's
//! segments (then "a block arrived" is "its segment arrived"); any other size is still
//! correct, only coarser: a block counts as arrived only if every byte of it did.

use std::ops::Range;

use gradwire::tensor::DType;
use half::{bf16, f16};

/// What an all-reduce computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// The sum over all ranks. A block some ranks' contributions to which were lost is the
    /// average over the ranks that arrived, times the world size: the unbiased estimate of the
    /// sum (exact when nothing was lost).
    #[default]
    Sum,
    /// The average over the ranks whose contribution to the block arrived.
    Average,
    /// The element-wise minimum (reliable only: a loss bound is refused).
    Min,
    /// The element-wise maximum (reliable only).
    Max,
    /// The element-wise product (reliable only).
    Product,
}

impl ReduceOp {
    /// How a reduce-scatter step combines an arriving contribution with the accumulator.
    pub fn combine(self) -> gradwire_msg::reduce::Combine {
        use gradwire_msg::reduce::Combine;
        match self {
            ReduceOp::Sum | ReduceOp::Average => Combine::Sum,
            ReduceOp::Min => Combine::Min,
            ReduceOp::Max => Combine::Max,
            ReduceOp::Product => Combine::Product,
        }
    }

    /// The name in reports, options and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Average => "average",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        }
    }

    /// The op named `s` (as [`ReduceOp::name`] gives it).
    pub fn parse(s: &str) -> Option<ReduceOp> {
        [
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ]
        .into_iter()
        .find(|o| o.name() == s)
    }

    /// Whether a block missing some ranks' contributions still has a meaning (a sum or an
    /// average can be estimated from the ranks that arrived; a min, max or product cannot).
    pub fn tolerates_loss(self) -> bool {
        matches!(self, ReduceOp::Sum | ReduceOp::Average)
    }
}

/// Why an aggregation input was refused (the input came from the network).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AggregateError {
    /// A contributor set of the wrong length.
    #[error("contributor sets: expected {expected} bytes for the blocks, got {got}")]
    MaskLength {
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// A contributor set names a rank outside the job, or no rank at all.
    #[error("contributor set of block {block} is invalid (names a rank >= the world size {world} or none)")]
    MaskInvalid {
        /// Block.
        block: usize,
        /// World size.
        world: usize,
    },
    /// A peer's partial sum names a rank already summed here: adding it would count that
    /// rank twice.
    #[error("block {block}: the incoming partial sum repeats a contribution already summed here")]
    Overlap {
        /// Block.
        block: usize,
    },
    /// Buffers of different sizes or types.
    #[error("aggregation buffers differ: {0}")]
    Shape(&'static str),
}

/// How a tensor of `elems` elements is cut into blocks and the blocks into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    elems: usize,
    block_elems: usize,
}

impl BlockLayout {
    /// Blocks of `block_elems` elements (at least 1); the last may be short.
    pub fn new(elems: usize, block_elems: usize) -> BlockLayout {
        BlockLayout {
            elems,
            block_elems: block_elems.max(1),
        }
    }

    /// Elements in the tensor.
    pub fn elems(&self) -> usize {
        self.elems
    }

    /// Elements per block.
    pub fn block_elems(&self) -> usize {
        self.block_elems
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.elems.div_ceil(self.block_elems)
    }

    /// Elements of block `b`.
    pub fn block(&self, b: usize) -> Range<usize> {
        let start = (b * self.block_elems).min(self.elems);
        start..(start + self.block_elems).min(self.elems)
    }

    /// Blocks of chunk `c` when the blocks are shared out over `chunks` chunks as evenly as
    /// whole blocks allow (chunks may be empty when there are fewer blocks than chunks).
    pub fn chunk_blocks(&self, chunks: usize, c: usize) -> Range<usize> {
        let n = self.blocks();
        let chunks = chunks.max(1);
        (n * c / chunks)..(n * (c + 1) / chunks)
    }

    /// Elements of the blocks `blocks`.
    pub fn elems_of(&self, blocks: &Range<usize>) -> Range<usize> {
        if blocks.is_empty() {
            let at = self.block(blocks.start).start;
            return at..at;
        }
        self.block(blocks.start).start..self.block(blocks.end - 1).end
    }

    /// Chunks of at most `max_blocks` blocks each, in order (for pipelining).
    pub fn pipeline_chunks(&self, max_blocks: usize) -> Vec<Range<usize>> {
        let max_blocks = max_blocks.max(1);
        let n = self.blocks();
        (0..n.div_ceil(max_blocks))
            .map(|i| i * max_blocks..((i + 1) * max_blocks).min(n))
            .collect()
    }
}

/// For each block, the set of ranks whose contributions it sums: `words` 64-bit words per
/// block, bit `r` of the set = rank `r`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contributors {
    world: usize,
    words: usize,
    masks: Vec<u64>,
}

impl Contributors {
    /// `blocks` blocks, each contributed by `rank` alone (a rank's own gradient).
    pub fn only(blocks: usize, world: usize, rank: usize) -> Contributors {
        let mut c = Contributors::none(blocks, world);
        for b in 0..blocks {
            c.insert(b, rank);
        }
        c
    }

    /// `blocks` blocks contributed by every rank (what a loss-free aggregate carries).
    pub fn all(blocks: usize, world: usize) -> Contributors {
        let mut c = Contributors::none(blocks, world);
        for b in 0..blocks {
            for r in 0..world {
                c.insert(b, r);
            }
        }
        c
    }

    /// `blocks` empty sets.
    pub fn none(blocks: usize, world: usize) -> Contributors {
        let words = world.div_ceil(64).max(1);
        Contributors {
            world,
            words,
            masks: vec![0; blocks * words],
        }
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.masks.len() / self.words
    }

    /// World size the sets range over.
    pub fn world(&self) -> usize {
        self.world
    }

    fn set(&self, b: usize) -> &[u64] {
        &self.masks[b * self.words..(b + 1) * self.words]
    }

    /// Add `rank` to block `b`'s set (ignored when out of range).
    pub fn insert(&mut self, b: usize, rank: usize) {
        if rank < self.world && b < self.blocks() {
            self.masks[b * self.words + rank / 64] |= 1 << (rank % 64);
        }
    }

    /// Whether `rank` contributed to block `b`.
    pub fn contains(&self, b: usize, rank: usize) -> bool {
        rank < self.world && b < self.blocks() && self.set(b)[rank / 64] & (1 << (rank % 64)) != 0
    }

    /// How many ranks contributed to block `b`.
    pub fn count(&self, b: usize) -> usize {
        if b >= self.blocks() {
            return 0;
        }
        self.set(b).iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The ranks that contributed to block `b`, ascending.
    pub fn ranks(&self, b: usize) -> Vec<usize> {
        (0..self.world).filter(|&r| self.contains(b, r)).collect()
    }

    /// Whether block `b` here and block `ob` of `other` name a rank in common.
    pub fn overlaps(&self, b: usize, other: &Contributors, ob: usize) -> bool {
        (0..self.words.min(other.words))
            .any(|w| self.masks[b * self.words + w] & other.masks[ob * other.words + w] != 0)
    }

    /// Block `b` here becomes the union of itself and block `ob` of `other`.
    pub fn unite(&mut self, b: usize, other: &Contributors, ob: usize) {
        for w in 0..self.words.min(other.words) {
            self.masks[b * self.words + w] |= other.masks[ob * other.words + w];
        }
    }

    /// Block `b` here becomes a copy of block `ob` of `other`.
    pub fn assign(&mut self, b: usize, other: &Contributors, ob: usize) {
        for w in 0..self.words {
            self.masks[b * self.words + w] =
                other.masks.get(ob * other.words + w).copied().unwrap_or(0);
        }
    }

    /// The sets of `blocks` as little-endian bytes (what travels next to a partial sum).
    pub fn encode(&self, blocks: Range<usize>) -> Vec<u8> {
        self.masks[blocks.start * self.words..blocks.end * self.words]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    /// Bytes per block in [`Contributors::encode`].
    pub fn encoded_block_len(&self) -> usize {
        self.words * 8
    }

    /// Parse the sets of `blocks` blocks received from a peer: exact length, no rank beyond
    /// the world, and no empty set unless `allow_empty` (a broadcast forwards "I do not have
    /// this block" as an empty set).
    pub fn decode(
        bytes: &[u8],
        blocks: usize,
        world: usize,
        allow_empty: bool,
    ) -> Result<Contributors, AggregateError> {
        let mut c = Contributors::none(blocks, world);
        let expected = blocks * c.words * 8;
        if bytes.len() != expected {
            return Err(AggregateError::MaskLength {
                expected,
                got: bytes.len(),
            });
        }
        for (i, w) in bytes.chunks_exact(8).enumerate() {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            c.masks[i] = u64::from_le_bytes(a);
        }
        for b in 0..blocks {
            let beyond = c.set(b).iter().enumerate().any(|(wi, &w)| {
                let first = wi * 64;
                let valid = world.saturating_sub(first).min(64);
                valid < 64 && w >> valid != 0
            });
            if beyond || (!allow_empty && c.count(b) == 0) {
                return Err(AggregateError::MaskInvalid { block: b, world });
            }
        }
        Ok(c)
    }
}

/// Which of `blocks` blocks (of `block_bytes` bytes each, the last possibly short) arrived
/// whole, given the byte ranges `(offset, len)` the transport reports missing.
pub fn arrived_blocks(missing: &[(u64, usize)], block_bytes: usize, blocks: usize) -> Vec<bool> {
    let block_bytes = block_bytes.max(1) as u64;
    let mut arrived = vec![true; blocks];
    for &(off, len) in missing {
        if len == 0 {
            continue;
        }
        let first = (off / block_bytes) as usize;
        let last = ((off + len as u64 - 1) / block_bytes) as usize;
        for b in first..=last.min(blocks.saturating_sub(1)) {
            if let Some(a) = arrived.get_mut(b) {
                *a = false;
            }
        }
    }
    arrived
}

fn for_each_elem(dtype: DType, dst: &mut [u8], src: &[u8], f: impl Fn(f32, f32) -> f32) {
    match dtype {
        DType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                let a = f32::from_le_bytes([d[0], d[1], d[2], d[3]]);
                let b = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&f(a, b).to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let a = f16::from_le_bytes([d[0], d[1]]).to_f32();
                let b = f16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&f16::from_f32(f(a, b)).to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let a = bf16::from_le_bytes([d[0], d[1]]).to_f32();
                let b = bf16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&bf16::from_f32(f(a, b)).to_le_bytes());
            }
        }
        // Raw bytes have no arithmetic: the collective layer refuses them before this.
        DType::Raw => {}
    }
}

/// `dst += src`, element by element, in `dtype` (f16 and bf16 are added in f32 and rounded).
pub fn add_into(dtype: DType, dst: &mut [u8], src: &[u8]) -> Result<(), AggregateError> {
    if dst.len() != src.len() {
        return Err(AggregateError::Shape("add_into: lengths differ"));
    }
    for_each_elem(dtype, dst, src, |a, b| a + b);
    Ok(())
}

/// `buf *= factor`, element by element, in `dtype`.
pub fn scale(dtype: DType, buf: &mut [u8], factor: f32) {
    let copy = buf.to_vec();
    for_each_elem(dtype, buf, &copy, |a, _| a * factor);
}

/// `buf /= divisor`, element by element, in `dtype`.
fn divide(dtype: DType, buf: &mut [u8], divisor: f32) {
    let copy = buf.to_vec();
    for_each_elem(dtype, buf, &copy, |a, _| a / divisor);
}

/// Finish one block of a partial sum of `count` contributions: the average over them, or
/// (`Sum`) the sum, exact when all `world` ranks contributed and scaled up from the average
/// otherwise.
pub fn finish_block(op: ReduceOp, dtype: DType, block: &mut [u8], count: usize, world: usize) {
    match op {
        ReduceOp::Sum if count >= world => {}
        ReduceOp::Sum => scale(dtype, block, world as f32 / count.max(1) as f32),
        ReduceOp::Average if count <= 1 => {}
        // Divided, not multiplied by 1/count: the same bits as `sum / count` in torch.
        ReduceOp::Average => divide(dtype, block, count as f32),
        ReduceOp::Min | ReduceOp::Max | ReduceOp::Product => {}
    }
}

/// A partial aggregate of some blocks of a tensor: values (a partial sum, in the tensor's
/// dtype) and, per block, who is summed in it.
#[derive(Debug)]
pub struct Partial<'a> {
    /// Element type.
    pub dtype: DType,
    /// The values, `layout.elems_of(blocks)` elements.
    pub values: &'a mut [u8],
    /// Who is summed in each block (indexed from 0 = the first block of `values`).
    pub contributors: &'a mut Contributors,
    /// Offset of `values`' first block in `contributors`.
    pub first_block: usize,
}

/// Accumulate a peer's partial sum into `local` for the blocks that arrived: values added,
/// sets united. `block_bytes` is the byte size of a whole block; `incoming` covers the same
/// blocks as `local.values`; `incoming_sets` has one set per block of it.
pub fn accumulate(
    local: &mut Partial<'_>,
    incoming: &[u8],
    incoming_sets: &Contributors,
    arrived: &[bool],
    block_bytes: usize,
) -> Result<(), AggregateError> {
    if incoming.len() != local.values.len() {
        return Err(AggregateError::Shape("accumulate: value lengths differ"));
    }
    for (i, (dst, src)) in local
        .values
        .chunks_mut(block_bytes.max(1))
        .zip(incoming.chunks(block_bytes.max(1)))
        .enumerate()
    {
        if arrived.get(i).copied().unwrap_or(false) && incoming_sets.count(i) > 0 {
            if local
                .contributors
                .overlaps(local.first_block + i, incoming_sets, i)
            {
                return Err(AggregateError::Overlap {
                    block: local.first_block + i,
                });
            }
            add_into(local.dtype, dst, src)?;
            local
                .contributors
                .unite(local.first_block + i, incoming_sets, i);
        }
    }
    Ok(())
}

/// Replace `local`'s blocks by a peer's finished blocks where they arrived; where they did not,
/// finish `local`'s own partial (its own contributors' average) instead. Returns how many
/// blocks arrived.
pub fn adopt_or_finish(
    local: &mut Partial<'_>,
    incoming: &[u8],
    incoming_sets: &Contributors,
    arrived: &[bool],
    block_bytes: usize,
    op: ReduceOp,
    world: usize,
) -> Result<usize, AggregateError> {
    if incoming.len() != local.values.len() {
        return Err(AggregateError::Shape("adopt: value lengths differ"));
    }
    let mut got = 0;
    for (i, (dst, src)) in local
        .values
        .chunks_mut(block_bytes.max(1))
        .zip(incoming.chunks(block_bytes.max(1)))
        .enumerate()
    {
        let b = local.first_block + i;
        if arrived.get(i).copied().unwrap_or(false) && incoming_sets.count(i) > 0 {
            dst.copy_from_slice(src);
            local.contributors.assign(b, incoming_sets, i);
            got += 1;
        } else {
            finish_block(op, local.dtype, dst, local.contributors.count(b), world);
        }
    }
    Ok(got)
}

/// Finish every block of `local` (the owner's blocks after the reduce phase).
pub fn finish(local: &mut Partial<'_>, block_bytes: usize, op: ReduceOp, world: usize) {
    for (i, dst) in local.values.chunks_mut(block_bytes.max(1)).enumerate() {
        let count = local.contributors.count(local.first_block + i);
        finish_block(op, local.dtype, dst, count, world);
    }
}

/// Little-endian f32 bytes to and from values, for the crate's tests.
#[cfg(test)]
pub(crate) mod test_bytes {
    /// The bytes of `v`.
    pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The values in `b`.
    pub(crate) fn f32_of(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::test_bytes::{f32_bytes, f32_of};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_blocks_and_chunks_cover_the_tensor_once() {
        let l = BlockLayout::new(10, 3);
        assert_eq!(l.blocks(), 4);
        assert_eq!(l.block(3), 9..10);
        let chunks: Vec<_> = (0..3).map(|c| l.chunk_blocks(3, c)).collect();
        assert_eq!(chunks, vec![0..1, 1..2, 2..4]);
        assert_eq!(l.elems_of(&(2..4)), 6..10);
        assert_eq!(l.elems_of(&(1..1)), 3..3);
        assert_eq!(l.pipeline_chunks(3), vec![0..3, 3..4]);
        // More chunks than blocks: some are empty, all are covered once.
        let l = BlockLayout::new(2, 1);
        let chunks: Vec<_> = (0..4).map(|c| l.chunk_blocks(4, c)).collect();
        assert_eq!(chunks.iter().map(|r| r.len()).sum::<usize>(), 2);
    }

    #[test]
    fn missing_bytes_mark_every_touched_block() {
        // Blocks of 8 bytes; bytes 10..13 lost (block 1) and 26..29 (block 3).
        let arrived = arrived_blocks(&[(10, 3), (26, 3)], 8, 5);
        assert_eq!(arrived, vec![true, false, true, false, true]);
        // A range straddling two blocks loses both.
        assert_eq!(arrived_blocks(&[(6, 4)], 8, 3), vec![false, false, true]);
        // Ranges past the end are ignored, never a panic.
        assert_eq!(arrived_blocks(&[(1000, 8)], 8, 2), vec![true, true]);
    }

    #[test]
    fn a_lost_block_is_averaged_over_the_ranks_that_arrived() {
        // World 3; rank 2 holds its own gradient and receives ranks 0+1's partial sum, whose
        // second block was lost.
        let world = 3;
        let mut sets = Contributors::only(2, world, 2);
        let mut values = f32_bytes(&[3.0, 3.0, 30.0, 30.0]);
        let incoming = f32_bytes(&[1.0 + 2.0, 1.0 + 2.0, 99.0, 99.0]);
        let mut in_sets = Contributors::only(2, world, 0);
        in_sets.insert(0, 1);
        in_sets.insert(1, 1);
        let mut p = Partial {
            dtype: DType::F32,
            values: &mut values,
            contributors: &mut sets,
            first_block: 0,
        };
        accumulate(&mut p, &incoming, &in_sets, &[true, false], 8).unwrap();
        finish(&mut p, 8, ReduceOp::Average, world);
        assert_eq!(f32_of(&values), vec![2.0, 2.0, 30.0, 30.0]);
        assert_eq!(sets.ranks(0), vec![0, 1, 2]);
        assert_eq!(sets.ranks(1), vec![2]);
    }

    #[test]
    fn a_partial_sum_that_repeats_a_rank_is_refused() {
        let world = 3;
        let mut sets = Contributors::only(1, world, 1);
        let mut values = f32_bytes(&[1.0]);
        let mut in_sets = Contributors::only(1, world, 0);
        in_sets.insert(0, 1); // claims rank 1, which is summed here already
        let mut p = Partial {
            dtype: DType::F32,
            values: &mut values,
            contributors: &mut sets,
            first_block: 0,
        };
        assert_eq!(
            accumulate(&mut p, &f32_bytes(&[5.0]), &in_sets, &[true], 4),
            Err(AggregateError::Overlap { block: 0 })
        );
    }

    #[test]
    fn sum_is_exact_when_complete_and_scaled_when_not() {
        let mut b = f32_bytes(&[6.0]);
        finish_block(ReduceOp::Sum, DType::F32, &mut b, 3, 3);
        assert_eq!(f32_of(&b), vec![6.0]);
        finish_block(ReduceOp::Sum, DType::F32, &mut b, 2, 4);
        assert_eq!(f32_of(&b), vec![12.0]);
    }

    #[test]
    fn half_types_add_in_f32() {
        let mut d: Vec<u8> = [f16::from_f32(1.5), f16::from_f32(-2.0)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let s: Vec<u8> = [f16::from_f32(2.5), f16::from_f32(0.5)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        add_into(DType::F16, &mut d, &s).unwrap();
        assert_eq!(f16::from_le_bytes([d[0], d[1]]).to_f32(), 4.0);
        assert_eq!(f16::from_le_bytes([d[2], d[3]]).to_f32(), -1.5);
        let mut d: Vec<u8> = bf16::from_f32(8.0).to_le_bytes().to_vec();
        scale(DType::Bf16, &mut d, 0.25);
        assert_eq!(bf16::from_le_bytes([d[0], d[1]]).to_f32(), 2.0);
        assert!(add_into(DType::F32, &mut [0u8; 4], &[0u8; 8]).is_err());
    }

    #[test]
    fn decode_refuses_forged_sets() {
        let c = Contributors::only(2, 3, 1);
        let bytes = c.encode(0..2);
        assert_eq!(Contributors::decode(&bytes, 2, 3, false).unwrap(), c);
        assert!(matches!(
            Contributors::decode(&bytes[..8], 2, 3, false),
            Err(AggregateError::MaskLength { .. })
        ));
        // Rank 5 in a world of 3.
        let mut forged = bytes.clone();
        forged[0] |= 1 << 5;
        assert!(matches!(
            Contributors::decode(&forged, 2, 3, false),
            Err(AggregateError::MaskInvalid { block: 0, .. })
        ));
        // An empty set.
        let empty = Contributors::none(2, 3).encode(0..2);
        assert!(Contributors::decode(&empty, 2, 3, false).is_err());
        assert!(Contributors::decode(&empty, 2, 3, true).is_ok());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200),
                               blocks in 0usize..8, world in 1usize..130) {
            let _ = Contributors::decode(&bytes, blocks, world, false);
        }

        /// Any sets encode to exactly `blocks` x `encoded_block_len` bytes that decode to the
        /// same sets, and a decoded input re-encodes to itself (the encoding is canonical).
        #[test]
        fn sets_round_trip_and_decoding_is_canonical(
            world in 1usize..200,
            members in proptest::collection::vec(proptest::collection::vec(any::<u16>(), 1..6), 0..6),
            noise in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let blocks = members.len();
            let mut c = Contributors::none(blocks, world);
            for (b, m) in members.iter().enumerate() {
                for &r in m {
                    c.insert(b, usize::from(r) % world);
                }
            }
            let bytes = c.encode(0..blocks);
            prop_assert_eq!(bytes.len(), blocks * c.encoded_block_len());
            let back = Contributors::decode(&bytes, blocks, world, false).unwrap();
            for b in 0..blocks {
                prop_assert_eq!(back.ranks(b), c.ranks(b));
            }
            prop_assert_eq!(back.encode(0..blocks), bytes);
            if let Ok(d) = Contributors::decode(&noise, 1, world, true) {
                prop_assert_eq!(d.encode(0..1), noise);
            }
        }

        /// However the pieces were lost along a chain of ranks, every block's result is the
        /// average of exactly the ranks its set names.
        #[test]
        fn chain_aggregation_averages_exactly_the_named_ranks(
            world in 2usize..9,
            blocks in 1usize..6,
            loss in proptest::collection::vec(any::<bool>(), 64),
        ) {
            let block_elems = 2;
            let input = |r: usize, e: usize| ((r + 1) * 10 + e) as f32;
            let elems = blocks * block_elems;
            // Rank 0's gradient, then ranks 1.. accumulate in a chain.
            let mut acc = f32_bytes(&(0..elems).map(|e| input(0, e)).collect::<Vec<_>>());
            let mut sets = Contributors::only(blocks, world, 0);
            for r in 1..world {
                let mut mine = f32_bytes(&(0..elems).map(|e| input(r, e)).collect::<Vec<_>>());
                let mut my_sets = Contributors::only(blocks, world, r);
                let arrived: Vec<bool> = (0..blocks).map(|b| !loss[(r * 7 + b) % 64]).collect();
                let mut p = Partial { dtype: DType::F32, values: &mut mine, contributors: &mut my_sets, first_block: 0 };
                accumulate(&mut p, &acc, &sets, &arrived, block_elems * 4).unwrap();
                acc = mine;
                sets = my_sets;
            }
            let mut p = Partial { dtype: DType::F32, values: &mut acc, contributors: &mut sets, first_block: 0 };
            finish(&mut p, block_elems * 4, ReduceOp::Average, world);
            let out = f32_of(&acc);
            for b in 0..blocks {
                let ranks = sets.ranks(b);
                prop_assert!(ranks.contains(&(world - 1)));
                for (e, &got) in out.iter().enumerate().skip(b * block_elems).take(block_elems) {
                    let want = ranks.iter().map(|&r| input(r, e)).sum::<f32>() / ranks.len() as f32;
                    prop_assert!((got - want).abs() <= want.abs() * 1e-6);
                }
            }
        }
    }
}
