//! The workload of a collective job and the checks of its results.
//!
//! Each iteration all-reduces one tensor per layer of a model file, with values that are a
//! known function of (rank, layer, element), [`input`]: small integers, so every result is
//! known exactly and checked element by element: exactly with `p = 0` ([`check_exact`]),
//! against the contributors the report names otherwise ([`check_named`]). A wrong result is
//! an error naming the rank, iteration, layer and element, not a statistic.

use std::path::Path;

use gradwire::tensor::Tensor;
use gradwire_collective::aggregate::ReduceOp;
use gradwire_collective::comm::AllReduceReport;

use crate::error::Error;

/// Period of the input values in the element index (see [`input`]).
pub const PERIOD: usize = 23;
/// Largest scale: more is a typo, not a bigger model.
pub const MAX_SCALE: f64 = 100.0;

/// Rank `rank`'s value of element `e` of layer `layer`: small integers, so f32 sums over any
/// number of ranks (up to 4096 x 11 < 2^24) are exact in any order. Periodic in `e`.
pub fn input(rank: usize, layer: usize, e: usize) -> f32 {
    (((rank % PERIOD) * 7 + (layer % PERIOD) * 5 + (e % PERIOD) * 3) % PERIOD) as f32 - 11.0
}

/// Per residue of the element index, the sum of `input` over `ranks`.
pub fn residue_sums(ranks: impl Iterator<Item = usize> + Clone, layer: usize) -> [f32; PERIOD] {
    let mut s = [0.0f32; PERIOD];
    for (k, slot) in s.iter_mut().enumerate() {
        *slot = ranks.clone().map(|r| input(r, layer, k)).sum();
    }
    s
}

/// One layer of the workload.
#[derive(Debug, Clone)]
pub struct LayerWork {
    /// The layer's name.
    pub name: String,
    /// Its elements.
    pub elems: usize,
    /// The exact p = 0 result per residue (sum, or sum times 1/world as the library scales).
    pub want: [f32; PERIOD],
}

/// The model's layers at `scale` (at least one element each).
pub fn model_layers(path: &Path, scale: f64) -> Result<(String, Vec<(String, usize)>), Error> {
    if !(scale.is_finite() && scale > 0.0 && scale <= MAX_SCALE) {
        return Err(Error::Scale(scale));
    }
    let shown = path.display().to_string();
    let model = gradwire_control::model::load_model(path).map_err(|e| Error::Model(Box::new(e)))?;
    if model.layers.is_empty() {
        return Err(Error::NoLayers(shown));
    }
    let layers = model
        .layers
        .iter()
        .map(|l| {
            // Saturating float-to-int; at most 100 x a u64 count, far beyond any memory.
            let elems = (l.params as f64 * scale).round().max(1.0) as usize;
            (l.name.clone(), elems)
        })
        .collect();
    Ok((model.name, layers))
}

/// Where a result is checked: the error names it.
#[derive(Debug)]
pub struct Site<'a> {
    /// This rank.
    pub rank: usize,
    /// Ranks.
    pub world: usize,
    /// The iteration.
    pub iteration: u32,
    /// The layer's index.
    pub layer: usize,
    /// The layer.
    pub work: &'a LayerWork,
    /// The reduction.
    pub op: ReduceOp,
}

impl Site<'_> {
    fn wrong(&self, elem: usize, got: f32, want: f32, what: String) -> Error {
        Error::Verify {
            rank: self.rank,
            iteration: self.iteration,
            layer: self.layer,
            name: self.work.name.clone(),
            elem,
            got,
            want,
            what,
        }
    }
}

/// `p = 0`: every block complete and every element exactly the expected value.
pub fn check_exact(at: &Site<'_>, t: &Tensor, r: &AllReduceReport) -> Result<(), Error> {
    if r.complete_blocks != r.blocks {
        return Err(Error::Incomplete {
            rank: at.rank,
            iteration: at.iteration,
            layer: at.layer,
            name: at.work.name.clone(),
            complete: r.complete_blocks,
            blocks: r.blocks,
        });
    }
    let got = t.as_f32().unwrap_or(&[]);
    if got.len() != at.work.elems {
        return Err(at.wrong(got.len(), f32::NAN, f32::NAN, "result length".into()));
    }
    for (e, &g) in got.iter().enumerate() {
        let want = at.work.want[e % PERIOD];
        if g != want {
            let what = format!("the exact {} over ranks 0..{}", at.op.name(), at.world);
            return Err(at.wrong(e, g, want, what));
        }
    }
    Ok(())
}

/// `p > 0`: every block is the average of exactly the contributions the report names (times
/// the world size for a sum), within f32 rounding.
pub fn check_named(at: &Site<'_>, t: &Tensor, r: &AllReduceReport) -> Result<(), Error> {
    let got = t.as_f32().unwrap_or(&[]);
    let be = r.block_elems.max(1);
    for b in 0..r.blocks {
        let ranks = r.contributors.ranks(b);
        if ranks.is_empty() {
            return Err(at.wrong(
                b * be,
                f32::NAN,
                f32::NAN,
                format!("block {b} has no contributor"),
            ));
        }
        let sums = residue_sums(ranks.iter().copied(), at.layer);
        let n = ranks.len() as f32;
        for e in b * be..((b + 1) * be).min(got.len()) {
            let mean = sums[e % PERIOD] / n;
            // A job runs sum or average (the CLI's JobOp); only those are lossy.
            let want = match at.op {
                ReduceOp::Average => mean,
                _ => mean * at.world as f32,
            };
            if (got[e] - want).abs() > 1e-4 * want.abs().max(1.0) {
                return Err(at.wrong(
                    e,
                    got[e],
                    want,
                    format!("from the contributions of ranks {ranks:?}"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use gradwire::tensor::DType;
    use std::time::Duration;

    #[test]
    fn inputs_are_small_periodic_integers() {
        for r in 0..50 {
            for l in 0..30 {
                for e in 0..100 {
                    let v = input(r, l, e);
                    assert!((-11.0..=11.0).contains(&v) && v.fract() == 0.0);
                    assert_eq!(v, input(r, l, e + PERIOD));
                }
            }
        }
        // Residue sums are the element-wise sums.
        let s = residue_sums(0..5, 3);
        for e in 0..2 * PERIOD {
            let direct: f32 = (0..5).map(|r| input(r, 3, e)).sum();
            assert_eq!(s[e % PERIOD], direct);
        }
    }

    #[test]
    fn exact_check_catches_a_wrong_element() {
        let work = LayerWork {
            name: "l".into(),
            elems: 50,
            want: residue_sums(0..2, 0),
        };
        let at = Site {
            rank: 0,
            world: 2,
            iteration: 1,
            layer: 0,
            work: &work,
            op: ReduceOp::Sum,
        };
        let mut t = Tensor::zeros(DType::F32, 50);
        for (e, x) in t.as_f32_mut().unwrap().iter_mut().enumerate() {
            *x = input(0, 0, e) + input(1, 0, e);
        }
        let layout_report = |complete| AllReduceReport {
            algorithm: "ring",
            elems: 50,
            block_elems: 50,
            complete_blocks: complete,
            blocks: 1,
            delivered_fraction: 1.0,
            rank_delivered: vec![1.0, 1.0],
            elapsed: Duration::ZERO,
            bytes_sent: 0,
            contributors: gradwire_collective::aggregate::Contributors::all(1, 2),
        };
        check_exact(&at, &t, &layout_report(1)).unwrap();
        assert!(matches!(
            check_exact(&at, &t, &layout_report(0)),
            Err(Error::Incomplete { .. })
        ));
        check_named(&at, &t, &layout_report(1)).unwrap();
        t.as_f32_mut().unwrap()[17] += 1.0;
        let e = check_exact(&at, &t, &layout_report(1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("element 17") && e.contains("WRONG RESULT"),
            "{e}"
        );
        assert!(check_named(&at, &t, &layout_report(1)).is_err());
    }
}
