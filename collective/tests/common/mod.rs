//! The synthetic model the parameter-server tests train: small-integer weights and
//! gradients, so every sum, mean over 4 workers and step of `LR` is exact in f32 (and f16),
//! and the replay of what the server says it applied.

#![allow(dead_code)]

use gradwire_collective::ps::UpdateRecord;

/// Learning rate.
pub const LR: f32 = 0.5;

/// Initial weight of element `e`.
pub fn init(e: usize) -> f32 {
    (e % 11) as f32 - 5.0
}

/// Worker `r`'s gradient of clock `c` at element `e`.
pub fn grad(r: usize, c: u64, e: usize) -> f32 {
    ((r * 3 + c as usize * 5 + e * 7) % 9) as f32 - 4.0
}

/// The initial weights.
pub fn initial(elems: usize) -> Vec<f32> {
    (0..elems).map(init).collect()
}

/// The server's weights after each recorded update (the initial ones first): every block
/// averaged over exactly the workers the record names; a block nobody reached is not
/// updated.
pub fn replay(updates: &[UpdateRecord], block_elems: usize, elems: usize) -> Vec<Vec<f32>> {
    let mut out = vec![initial(elems)];
    for (c, u) in updates.iter().enumerate() {
        assert_eq!(u.clock, c as u64, "the server keeps every update, in order");
        let prev = &out[out.len() - 1];
        let next = (0..elems)
            .map(|e| {
                let ranks = u.contributors.ranks(e / block_elems);
                if ranks.is_empty() {
                    return prev[e];
                }
                let sum: f32 = ranks.iter().map(|&r| grad(r, u.clock, e)).sum();
                prev[e] - LR * (sum / ranks.len() as f32)
            })
            .collect();
        out.push(next);
    }
    out
}
