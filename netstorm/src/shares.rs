//! Multi-root load balancing (§IV-C(a)): tensors split into chunks of at most CHUNK_SIZE
//! elements, and chunks shared among the roots in proportion to their quality scores.
//!
//! - A tensor of at most CHUNK_SIZE elements stays whole; a larger one is cut into
//!   `ceil(elems / CHUNK_SIZE)` chunks of near-equal size (they differ by at most one element).
//!   The paper's "similarly sized" chunks: no tiny tail chunk that every probe filter would drop
//!   and that would skew a root's share.
//! - Root `i` gets `S_i / sum(S)` of the chunks, rounded by largest remainder (Hamilton): counts
//!   sum exactly to the number of chunks and each is within one chunk of its exact quota.
//! - Chunks go to roots in a smooth weighted round robin, so that every root starts working at
//!   once instead of the first root receiving a long run of consecutive chunks.
//!
//! Everything is deterministic: ties go to the lower root slot.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Impossible share requests.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SharesError {
    /// CHUNK_SIZE of zero elements.
    #[error("chunk_size is 0: chunks need at least 1 element")]
    ZeroChunkSize,
    /// A score that is negative, infinite or NaN.
    #[error("root slot {slot} has quality score {score}: scores must be finite and >= 0")]
    BadScore {
        /// The root's position in the scores.
        slot: usize,
        /// The value.
        score: f64,
    },
    /// Chunks to share but no root with a positive score.
    #[error(
        "{chunks} chunks to share but no root has a positive quality score: give at least one"
    )]
    NoRoot {
        /// The chunk count.
        chunks: usize,
    },
}

/// The element ranges of a tensor of `elems` elements cut into chunks of at most `chunk_size`
/// (near-equal sizes; one chunk if it fits; none for an empty tensor).
pub fn chunk_ranges(elems: usize, chunk_size: usize) -> Result<Vec<Range<usize>>, SharesError> {
    if chunk_size == 0 {
        return Err(SharesError::ZeroChunkSize);
    }
    let count = elems.div_ceil(chunk_size);
    let (base, extra) = match elems.checked_div(count) {
        Some(base) => (base, elems % count),
        None => (0, 0),
    };
    let mut start = 0;
    Ok((0..count)
        .map(|i| {
            // The first `extra` chunks take one element more.
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect())
}

/// Splits `total` chunks among root slots in proportion to `scores` by largest remainder:
/// exact total, each count within one of `total * S_i / sum(S)`, zero for a zero score.
pub fn proportional_counts(total: usize, scores: &[f64]) -> Result<Vec<usize>, SharesError> {
    for (slot, &score) in scores.iter().enumerate() {
        if !score.is_finite() || score < 0.0 {
            return Err(SharesError::BadScore { slot, score });
        }
    }
    let sum: f64 = scores.iter().sum();
    if total == 0 {
        return Ok(vec![0; scores.len()]);
    }
    if sum <= 0.0 {
        return Err(SharesError::NoRoot { chunks: total });
    }
    let quotas: Vec<f64> = scores.iter().map(|s| total as f64 * s / sum).collect();
    let mut counts: Vec<usize> = quotas.iter().map(|q| q.floor() as usize).collect();
    let assigned: usize = counts.iter().sum();
    // Floating point can round a quota's floor up; never hand out more than `total`.
    if assigned > total {
        return proportional_counts_exact_fallback(total, scores);
    }
    let mut remaining = total - assigned;
    let mut by_remainder: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] > 0.0).collect();
    by_remainder.sort_by(|&x, &y| {
        let (rx, ry) = (quotas[x] - quotas[x].floor(), quotas[y] - quotas[y].floor());
        ry.total_cmp(&rx).then(x.cmp(&y))
    });
    // Mathematically remaining < number of positive scores; cycle in case rounding says
    // otherwise, so the total stays exact.
    for &slot in by_remainder.iter().cycle() {
        if remaining == 0 {
            break;
        }
        counts[slot] += 1;
        remaining -= 1;
    }
    Ok(counts)
}

/// Rounding made the floors exceed the total (only with extreme score ratios): hand out
/// chunks one at a time to the slot furthest below its quota.
fn proportional_counts_exact_fallback(
    total: usize,
    scores: &[f64],
) -> Result<Vec<usize>, SharesError> {
    let sum: f64 = scores.iter().sum();
    let mut counts = vec![0usize; scores.len()];
    for _ in 0..total {
        let slot = (0..scores.len())
            .filter(|&i| scores[i] > 0.0)
            .max_by(|&x, &y| {
                let dx = total as f64 * scores[x] / sum - counts[x] as f64;
                let dy = total as f64 * scores[y] / sum - counts[y] as f64;
                dx.total_cmp(&dy).then(y.cmp(&x))
            })
            .ok_or(SharesError::NoRoot { chunks: total })?;
        counts[slot] += 1;
    }
    Ok(counts)
}

/// A sequence of root slots in which slot `i` appears exactly `counts[i]` times, spread
/// evenly (smooth weighted round robin; ties to the lower slot).
pub fn interleave(counts: &[usize]) -> Vec<usize> {
    let total: usize = counts.iter().sum();
    let weights: Vec<i128> = counts.iter().map(|&c| c as i128).collect();
    let mut current = vec![0i128; counts.len()];
    let mut order = Vec::with_capacity(total);
    for _ in 0..total {
        for (c, w) in current.iter_mut().zip(&weights) {
            *c += w;
        }
        let mut pick = 0;
        for i in 1..current.len() {
            if current[i] > current[pick] {
                pick = i;
            }
        }
        current[pick] -= total as i128;
        order.push(pick);
    }
    order
}

/// One chunk of a model and the root slot that aggregates it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkAssignment {
    /// The tensor's index in the model.
    pub tensor: usize,
    /// The chunk's elements within the tensor.
    pub range: Range<usize>,
    /// The root slot: an index into the scores given (and so into the root list they came
    /// from, e.g. [`crate::fapt::Planner::roots`]).
    pub slot: usize,
}

/// Chunks every tensor of a model (`tensor_elems[t]` elements each, in model order) and
/// assigns the chunks to root slots in proportion to `scores`, interleaved in model order.
pub fn assign_chunks(
    tensor_elems: &[usize],
    chunk_size: usize,
    scores: &[f64],
) -> Result<Vec<ChunkAssignment>, SharesError> {
    let mut chunks = Vec::new();
    for (tensor, &elems) in tensor_elems.iter().enumerate() {
        for range in chunk_ranges(elems, chunk_size)? {
            chunks.push((tensor, range));
        }
    }
    let counts = proportional_counts(chunks.len(), scores)?;
    Ok(chunks
        .into_iter()
        .zip(interleave(&counts))
        .map(|((tensor, range), slot)| ChunkAssignment {
            tensor,
            range,
            slot,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_tensors_stay_whole_and_large_ones_split_evenly() {
        assert_eq!(chunk_ranges(0, 10).unwrap(), Vec::<Range<usize>>::new());
        assert_eq!(chunk_ranges(7, 10).unwrap(), vec![0..7]);
        assert_eq!(chunk_ranges(10, 10).unwrap(), vec![0..10]);
        assert_eq!(chunk_ranges(11, 10).unwrap(), vec![0..6, 6..11]);
        assert_eq!(chunk_ranges(25, 10).unwrap(), vec![0..9, 9..17, 17..25]);
        assert_eq!(chunk_ranges(5, 0), Err(SharesError::ZeroChunkSize));
    }

    #[test]
    fn largest_remainder_is_exact() {
        assert_eq!(
            proportional_counts(10, &[1.0, 1.0, 1.0]).unwrap(),
            vec![4, 3, 3]
        );
        assert_eq!(
            proportional_counts(10, &[3.0, 1.0, 0.0]).unwrap(),
            vec![8, 2, 0]
        );
        assert_eq!(
            proportional_counts(2, &[1.0, 1.0, 1.0]).unwrap(),
            vec![1, 1, 0]
        );
        assert_eq!(proportional_counts(0, &[0.0]).unwrap(), vec![0]);
        assert_eq!(
            proportional_counts(1, &[0.0, 0.0]),
            Err(SharesError::NoRoot { chunks: 1 })
        );
        assert!(matches!(
            proportional_counts(1, &[1.0, f64::NAN]),
            Err(SharesError::BadScore { slot: 1, .. })
        ));
        assert_eq!(
            proportional_counts(5, &[1e300, 1e-300]).unwrap(),
            vec![5, 0]
        );
        assert_eq!(
            proportional_counts_exact_fallback(7, &[2.0, 1.0, 0.0]).unwrap(),
            proportional_counts(7, &[2.0, 1.0, 0.0]).unwrap()
        );
    }

    #[test]
    fn interleave_spreads_exact_counts() {
        assert_eq!(interleave(&[2, 1]), vec![0, 1, 0]);
        assert_eq!(interleave(&[1, 1, 1]), vec![0, 1, 2]);
        assert_eq!(interleave(&[0, 3]), vec![1, 1, 1]);
        assert!(interleave(&[]).is_empty());
    }

    #[test]
    fn model_chunks_cover_every_tensor_once() {
        let a = assign_chunks(&[25, 3, 0, 10], 10, &[2.0, 1.0]).unwrap();
        let got: Vec<_> = a
            .iter()
            .map(|c| (c.tensor, c.range.clone(), c.slot))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0..9, 0),
                (0, 9..17, 1),
                (0, 17..25, 0),
                (1, 0..3, 1),
                (3, 0..10, 0)
            ]
        );
    }
}
