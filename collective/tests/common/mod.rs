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

/// Paces a slow worker against the fast ones with a condition, not a sleep: before its push
/// of clock `c` the slow worker waits until every fast worker has pulled at clock
/// `min(c + s, last)`, as far ahead as stale synchronous parallel allows. Such a pull is then
/// served while the slow worker's clock-`c` gradients are not in, so it is stale by a full
/// `s`: certain, not a matter of timing. If pulls never run ahead (stale synchronous parallel
/// silently synchronous), the fast workers are stuck in that pull: the slow worker gives up
/// after `patience` (once; it then stops waiting) and the callers' "some pull was stale"
/// check fails.
pub struct Pace {
    fast: Vec<usize>,
    staleness: u64,
    last: u64,
    patience: std::time::Duration,
    /// `pulled[r]`: pulls worker `r` has completed; whether the slow worker gave up.
    state: std::sync::Mutex<(Vec<u64>, bool)>,
    cv: std::sync::Condvar,
}

impl Pace {
    /// Fast workers `fast` of a `world`-rank job running `clocks` clocks with staleness `s`.
    pub fn new(world: usize, fast: Vec<usize>, staleness: u64, clocks: u64) -> Pace {
        Pace {
            fast,
            staleness,
            last: clocks.saturating_sub(1),
            patience: std::time::Duration::from_secs(5),
            state: std::sync::Mutex::new((vec![0; world], false)),
            cv: std::sync::Condvar::new(),
        }
    }

    /// A fast worker `r` completed its pull at clock `c`.
    pub fn pulled(&self, r: usize, c: u64) {
        let mut st = self.state.lock().unwrap();
        st.0[r] = st.0[r].max(c + 1);
        self.cv.notify_all();
    }

    /// The slow worker, before its push of clock `c`: wait for the fast workers' pulls.
    pub fn hold(&self, c: u64) {
        let want = (c + self.staleness).min(self.last) + 1;
        let st = self.state.lock().unwrap();
        if st.1 {
            return;
        }
        let (mut st, timeout) = self
            .cv
            .wait_timeout_while(st, self.patience, |st| {
                self.fast.iter().any(|&r| st.0[r] < want)
            })
            .unwrap();
        if timeout.timed_out() {
            st.1 = true;
        }
    }
}
