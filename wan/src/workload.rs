//! The synthetic workload of a WAN job: a model file's layers scaled and flattened into one
//! f32 tensor, plus one control element.
//!
//! Node `r`'s input in round `k` at element `e` is a small integer, [`input`]`(r, k, e)`, so
//! the sum over the nodes is exact in any order and the average the runtime computes
//! (`sum / world`, correctly rounded) is known exactly: every element of every result is
//! compared with it ([`check_round`]); a wrong element fails the node with its position. The
//! control element carries each node's wish to go on (1, or 0 once its `--duration` has
//! passed): every node gets the same average, so all stop after the same round without a
//! protocol of their own (the element is checked to be `k / world` for a whole `k`, below 1
//! when this node said 0).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Period of the inputs in the element index.
pub const PERIOD: usize = 23;
/// Largest scale (more is a typo, not a bigger model).
pub const MAX_SCALE: f64 = 100.0;

/// Node `rank`'s value of element `e` in round `round`: an integer in -11..=11, periodic in
/// `e` with [`PERIOD`], different in every round (a stale result is caught).
pub fn input(rank: usize, round: u32, e: usize) -> f32 {
    let v = ((rank % PERIOD) * 7 + (round as usize % PERIOD) * 5 + (e % PERIOD) * 3) % PERIOD;
    v as f32 - 11.0
}

/// Per residue of the element index, the exact average over nodes `0..world` in `round`, as
/// the runtime computes it: the exact f32 sum (small integers) divided by `world`.
pub fn expected(world: usize, round: u32) -> [f32; PERIOD] {
    let mut want = [0.0f32; PERIOD];
    for (k, w) in want.iter_mut().enumerate() {
        let sum: f32 = (0..world).map(|r| input(r, round, k)).sum();
        *w = sum / world as f32;
    }
    want
}

/// The synthetic model: a layer file's layers scaled, flattened into one tensor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Workload {
    /// The model's name.
    pub model: String,
    /// The scale.
    pub scale: f64,
    /// Layers (name, elements), front first.
    pub layers: Vec<(String, usize)>,
    /// Model elements (the tensor has one more, the control element).
    pub elems: usize,
}

/// A model file that cannot be used, or a bad scale.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// Bad scale.
    #[error(
        "--scale {0}: use a number above 0 and at most {MAX_SCALE} (1 = the model's real size)"
    )]
    Scale(f64),
    /// The model file's own message names the file.
    #[error("model {0}")]
    Model(#[from] gradwire_control::model::ModelError),
    /// No layers.
    #[error("model {0}: it has no layers; give a model file with [[layers]] entries")]
    NoLayers(String),
}

impl Workload {
    /// `path`'s layers at `scale` (every layer at least one element).
    pub fn load(path: &Path, scale: f64) -> Result<Workload, WorkloadError> {
        if !(scale.is_finite() && scale > 0.0 && scale <= MAX_SCALE) {
            return Err(WorkloadError::Scale(scale));
        }
        let model = gradwire_control::model::load_model(path)?;
        if model.layers.is_empty() {
            return Err(WorkloadError::NoLayers(path.display().to_string()));
        }
        let layers: Vec<(String, usize)> = model
            .layers
            .iter()
            // Saturating float-to-int; bounded by MAX_SCALE x a layer's count.
            .map(|l| {
                (
                    l.name.clone(),
                    (l.params as f64 * scale).round().max(1.0) as usize,
                )
            })
            .collect();
        let elems = layers.iter().map(|l| l.1).sum();
        Ok(Workload {
            model: model.name,
            scale,
            layers,
            elems,
        })
    }

    /// Node `rank`'s tensor in `round`: the model's elements, then the control element
    /// (1 = go on after this round, 0 = stop).
    pub fn tensor(&self, rank: usize, round: u32, go_on: bool) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.elems + 1);
        v.extend((0..self.elems).map(|e| input(rank, round, e)));
        v.push(if go_on { 1.0 } else { 0.0 });
        v
    }

    /// The layer holding element `e` and `e`'s index in it.
    pub fn locate(&self, e: usize) -> (&str, usize) {
        let mut start = 0;
        for (name, n) in &self.layers {
            if e < start + n {
                return (name, e - start);
            }
            start += n;
        }
        ("control element", e - start)
    }
}

/// A result that is not the exact average.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "node {rank}: WRONG RESULT in round {round}: element {elem} ({layer}[{index}]) is {got}, \
     expected {want} ({what}); the synchronization is broken"
)]
pub struct WrongElement {
    /// The node.
    pub rank: usize,
    /// The round.
    pub round: u32,
    /// The element.
    pub elem: usize,
    /// Its layer.
    pub layer: String,
    /// Its index in the layer.
    pub index: usize,
    /// What came.
    pub got: f32,
    /// What should have.
    pub want: f32,
    /// What the expected value is.
    pub what: String,
}

/// Check node `rank`'s result of `round` (`world` nodes; this node asked to go on or not):
/// every model element is the exact average, the control element `k / world` for a whole
/// `k` (below `world` if this node said stop). Returns whether every node wants to go on.
pub fn check_round(
    w: &Workload,
    world: usize,
    rank: usize,
    round: u32,
    go_on: bool,
    got: &[f32],
) -> Result<bool, WrongElement> {
    let wrong = |elem: usize, got: f32, want: f32, what: String| {
        let (layer, index) = w.locate(elem);
        WrongElement {
            rank,
            round,
            elem,
            layer: layer.to_owned(),
            index,
            got,
            want,
            what,
        }
    };
    if got.len() != w.elems + 1 {
        return Err(wrong(
            got.len().min(w.elems),
            f32::NAN,
            f32::NAN,
            format!(
                "the result has {} elements, not {} (the model and the control element)",
                got.len(),
                w.elems + 1
            ),
        ));
    }
    let want = expected(world, round);
    for (e, &g) in got[..w.elems].iter().enumerate() {
        let x = want[e % PERIOD];
        if g != x {
            return Err(wrong(
                e,
                g,
                x,
                format!("the exact average over nodes 0..{world}"),
            ));
        }
    }
    let flag = got[w.elems];
    let n = world as f32;
    let k = (0..=world).find(|&k| k as f32 / n == flag);
    match k {
        Some(k) if go_on || k < world => Ok(k == world),
        _ => Err(wrong(
            w.elems,
            flag,
            if go_on { 1.0 } else { 0.0 },
            format!(
                "k/{world} for a whole k (the nodes that want to go on){}",
                if go_on {
                    ""
                } else {
                    ", below 1 since this node said stop"
                }
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(elems: &[usize]) -> Workload {
        Workload {
            model: "m".into(),
            scale: 1.0,
            layers: elems
                .iter()
                .enumerate()
                .map(|(i, &n)| (format!("l{i}"), n))
                .collect(),
            elems: elems.iter().sum(),
        }
    }

    /// The average each node computes, as the runtime does: sum, then divide.
    fn average(w: &Workload, world: usize, round: u32, go_on: &[bool]) -> Vec<f32> {
        let mut sum = vec![0.0f32; w.elems + 1];
        for (r, &g) in go_on.iter().enumerate().take(world) {
            for (s, x) in sum.iter_mut().zip(w.tensor(r, round, g)) {
                *s += x;
            }
        }
        sum.iter().map(|s| s / world as f32).collect()
    }

    #[test]
    fn inputs_are_small_integers_and_the_average_is_exact() {
        for r in 0..40 {
            for k in 0..30 {
                for e in 0..50 {
                    let v = input(r, k, e);
                    assert!((-11.0..=11.0).contains(&v) && v.fract() == 0.0);
                    assert_eq!(v, input(r, k, e + PERIOD));
                }
            }
        }
        // Rounds differ, so a stale result is caught.
        assert_ne!(expected(9, 0), expected(9, 1));
        let w = workload(&[30, 1, 17]);
        for world in [1, 2, 4, 9] {
            let got = average(&w, world, 3, &vec![true; world]);
            assert_eq!(check_round(&w, world, 0, 3, true, &got), Ok(true));
        }
    }

    #[test]
    fn a_wrong_element_is_found_and_named() {
        let w = workload(&[30, 1, 17]);
        let mut got = average(&w, 4, 2, &[true; 4]);
        got[31] += 0.25;
        let e = check_round(&w, 4, 1, 2, true, &got).unwrap_err();
        assert_eq!(
            (e.elem, e.layer.as_str(), e.index, e.rank),
            (31, "l2", 0, 1)
        );
        assert!(e.to_string().contains("WRONG RESULT in round 2"), "{e}");
        // Another round's result is wrong too.
        let stale = average(&w, 4, 1, &[true; 4]);
        assert!(check_round(&w, 4, 1, 2, true, &stale).is_err());
        // Too short.
        assert!(check_round(&w, 4, 1, 2, true, &got[..10]).is_err());
    }

    #[test]
    fn the_control_element_stops_everyone_after_the_same_round() {
        let w = workload(&[5]);
        // One node past its duration: everyone stops.
        let go = [true, false, true];
        let got = average(&w, 3, 0, &go);
        for (r, &g) in go.iter().enumerate() {
            assert_eq!(check_round(&w, 3, r, 0, g, &got), Ok(false));
        }
        // A node that said stop but sees "everyone goes on" was not heard.
        let all = average(&w, 3, 0, &[true; 3]);
        assert!(check_round(&w, 3, 1, 0, false, &all).is_err());
        // Not k/world.
        let mut bad = all.clone();
        bad[5] = 0.4;
        assert!(check_round(&w, 3, 0, 0, true, &bad).is_err());
    }
}
