//! One round of multi-root synchronization at one node, as a state machine over chunk
//! events (no I/O: the node loop feeds it chunks and sends what it returns).
//!
//! The tensor is cut into chunks; each chunk belongs to one root and travels its root's
//! tree: up in aggregate-forward mode (a node waits for the chunk from every child in that
//! tree, adds its own, and forwards one chunk to its parent), then down from the root
//! (forward-only, to the children). Chunks of different roots, and the chunks of one root,
//! pipeline freely. A chunk sent on an auxiliary path carries its whole path and is only
//! forwarded by the nodes on it; the last node takes it as its child's contribution.

use std::collections::BTreeMap;

use crate::policy::RoundPolicy;

/// Which way a chunk travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Up the tree: a partial sum.
    Push,
    /// Down the tree: the result.
    Pull,
}

/// A chunk's identity and route, as carried in its metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMeta {
    /// Policy version the sender used.
    pub version: u32,
    /// Round.
    pub round: u32,
    /// Up or down.
    pub phase: Phase,
    /// The chunk's root.
    pub root: usize,
    /// Chunk index in the tensor.
    pub chunk: usize,
    /// The node sequence of an auxiliary path (empty on a primary edge).
    pub path: Vec<usize>,
    /// Index in `path` of the node the chunk is at.
    pub hop: usize,
}

/// What the round asks the node loop to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send `values` (elements of the chunk) to `to`.
    Send {
        /// Next hop.
        to: usize,
        /// Metadata.
        meta: ChunkMeta,
        /// The chunk's values.
        values: Vec<f32>,
    },
}

/// Why a chunk was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    /// The policy cannot run this round (this node is not in it, no chunk plan).
    #[error("policy: {0}")]
    Policy(String),
    /// The chunk does not fit the round's policy (wrong root, chunk, size, sender).
    #[error("chunk from node {from} does not fit round {round}'s policy: {why}")]
    Unexpected {
        /// Sender.
        from: usize,
        /// Round.
        round: u32,
        /// What is wrong.
        why: String,
    },
}

/// Check that an auxiliary chunk from `from` reached `me` where its path says.
fn check_hop(me: usize, from: usize, meta: &ChunkMeta) -> Result<(), String> {
    let at = meta.path.get(meta.hop).copied();
    if at != Some(me) || meta.hop == 0 || meta.path.get(meta.hop - 1) != Some(&from) {
        return Err(format!(
            "auxiliary path {:?} does not reach node {me} from node {from} at hop {}",
            meta.path, meta.hop
        ));
    }
    Ok(())
}

/// Source routing (§VII-B): an auxiliary chunk that has not reached the end of its path
/// goes on to the next node, whatever round or policy this node is in. `None` for a chunk
/// that ends here (or a primary one).
pub fn relay(
    me: usize,
    from: usize,
    meta: &ChunkMeta,
    values: &[f32],
) -> Result<Option<Action>, String> {
    if meta.path.is_empty() || meta.hop + 1 >= meta.path.len() {
        return Ok(None);
    }
    check_hop(me, from, meta)?;
    Ok(Some(Action::Send {
        to: meta.path[meta.hop + 1],
        meta: ChunkMeta {
            hop: meta.hop + 1,
            ..meta.clone()
        },
        values: values.to_vec(),
    }))
}

/// One node's state in one round.
#[derive(Debug)]
pub struct RoundState {
    me: usize,
    round: u32,
    policy: RoundPolicy,
    chunks: Vec<std::ops::Range<usize>>,
    /// Per chunk: the partial sum so far and the children still missing (push phase).
    partial: Vec<Vec<f32>>,
    missing: Vec<usize>,
    /// Per chunk: the result, once it has come down (or been finished here).
    result: Vec<Option<Vec<f32>>>,
    done: usize,
    /// Children that have contributed to each chunk (each at most once).
    seen: Vec<Vec<bool>>,
    /// Chunks a node forwards on auxiliary paths it is the middle of, by (root, chunk).
    forwarded: BTreeMap<(usize, usize), usize>,
    world: usize,
}

impl RoundState {
    /// Start round `round` at node `me` with `input` (this node's contribution) under
    /// `policy`; returns the state and the first sends (leaves send at once).
    pub fn start(
        me: usize,
        round: u32,
        mut policy: RoundPolicy,
        input: &[f32],
        chunk_elems: usize,
        routes: &dyn Fn(usize, usize) -> Option<Vec<usize>>,
    ) -> Result<(RoundState, Vec<Action>), SyncError> {
        let world = policy.world();
        if me >= world {
            return Err(SyncError::Policy(format!(
                "node {me} is not in round {round}'s {world}-node policy"
            )));
        }
        let chunks = policy
            .chunks(input.len(), chunk_elems)
            .map_err(SyncError::Policy)?;
        let n = chunks.len();
        let mut st = RoundState {
            me,
            round,
            partial: chunks.iter().map(|r| input[r.clone()].to_vec()).collect(),
            missing: (0..n)
                .map(|c| policy.children(policy.root_of_chunk(c), me).len())
                .collect(),
            result: vec![None; n],
            done: 0,
            seen: vec![vec![false; world]; n],
            forwarded: BTreeMap::new(),
            chunks,
            policy,
            world,
        };
        let mut out = Vec::new();
        for c in 0..n {
            if st.missing[c] == 0 {
                st.complete_push(c, routes, &mut out);
            }
        }
        Ok((st, out))
    }

    /// The round.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// The policy version of the round.
    pub fn version(&self) -> u32 {
        self.policy.version
    }

    /// Every chunk's result is here.
    pub fn finished(&self) -> bool {
        self.done == self.result.len()
    }

    /// The synchronized tensor, once [`RoundState::finished`].
    pub fn output(&self) -> Option<Vec<f32>> {
        if !self.finished() {
            return None;
        }
        let mut v = Vec::with_capacity(self.chunks.last().map_or(0, |r| r.end));
        for r in &self.result {
            v.extend_from_slice(r.as_deref()?);
        }
        Some(v)
    }

    /// Chunks still missing their result (for an error message).
    pub fn pending(&self) -> usize {
        self.result.len() - self.done
    }

    /// Whether this round still needs a chunk that `peer` would send: a contribution from
    /// a child (directly), or a result from a parent. (A relay on an auxiliary path is not
    /// counted: its chunk may also come another way when the sender re-plans.)
    pub fn waits_on(&self, peer: usize) -> bool {
        (0..self.result.len()).any(|c| {
            let root = self.policy.root_of_chunk(c);
            let child_missing = self.missing[c] > 0
                && self.policy.children(root, self.me).contains(&peer)
                && !self.seen[c][peer];
            let parent_missing =
                self.result[c].is_none() && self.policy.parent(root, self.me) == Some(peer);
            child_missing || parent_missing
        })
    }

    /// Chunks relayed on auxiliary paths through this node.
    pub fn relayed(&self) -> usize {
        self.forwarded.values().sum()
    }

    /// A chunk arrived from `from`.
    pub fn on_chunk(
        &mut self,
        from: usize,
        meta: ChunkMeta,
        values: Vec<f32>,
        routes: &dyn Fn(usize, usize) -> Option<Vec<usize>>,
    ) -> Result<Vec<Action>, SyncError> {
        let bad = |why: String| SyncError::Unexpected {
            from,
            round: self.round,
            why,
        };
        let c = meta.chunk;
        let range = self
            .chunks
            .get(c)
            .ok_or_else(|| bad(format!("chunk {c} of {}", self.chunks.len())))?
            .clone();
        if meta.root != self.policy.root_of_chunk(c) {
            return Err(bad(format!(
                "chunk {c} has root {}, not {}",
                meta.root,
                self.policy.root_of_chunk(c)
            )));
        }
        if values.len() != range.len() {
            return Err(bad(format!(
                "chunk {c} has {} elements, not {}",
                values.len(),
                range.len()
            )));
        }
        let mut out = Vec::new();
        // An auxiliary chunk in the middle of its path: forward only (source-routed, so an
        // outdated path still delivers).
        if !meta.path.is_empty() {
            check_hop(self.me, from, &meta).map_err(bad)?;
            if let Some(a) = relay(self.me, from, &meta, &values).map_err(bad)? {
                *self.forwarded.entry((meta.root, c)).or_default() += 1;
                out.push(a);
                return Ok(out);
            }
        }
        // The sender, as the tree sees it: an auxiliary path's first node.
        let origin = meta.path.first().copied().unwrap_or(from);
        match meta.phase {
            Phase::Push => {
                let root = meta.root;
                if !self.policy.children(root, self.me).contains(&origin) {
                    return Err(bad(format!(
                        "node {origin} is not a child of {} in root {root}'s tree",
                        self.me
                    )));
                }
                if std::mem::replace(&mut self.seen[c][origin], true) {
                    return Err(bad(format!("node {origin} sent chunk {c} twice")));
                }
                for (a, b) in self.partial[c].iter_mut().zip(&values) {
                    *a += b;
                }
                self.missing[c] -= 1;
                if self.missing[c] == 0 {
                    self.complete_push(c, routes, &mut out);
                }
            }
            Phase::Pull => {
                if self.policy.parent(meta.root, self.me) != Some(origin) {
                    return Err(bad(format!(
                        "node {origin} is not the parent of {} in root {}'s tree",
                        self.me, meta.root
                    )));
                }
                if self.result[c].is_some() {
                    return Err(bad(format!("chunk {c}'s result came twice")));
                }
                self.deliver(c, values, &mut out);
            }
        }
        Ok(out)
    }

    /// Every child's chunk `c` is in: send the partial sum up, or finish it at the root.
    fn complete_push(
        &mut self,
        c: usize,
        routes: &dyn Fn(usize, usize) -> Option<Vec<usize>>,
        out: &mut Vec<Action>,
    ) {
        let root = self.policy.root_of_chunk(c);
        let values = std::mem::take(&mut self.partial[c]);
        match self.policy.parent(root, self.me) {
            Some(parent) => {
                let path = routes(self.me, parent).unwrap_or_default();
                let to = path.get(1).copied().unwrap_or(parent);
                out.push(Action::Send {
                    to,
                    meta: ChunkMeta {
                        version: self.policy.version,
                        round: self.round,
                        phase: Phase::Push,
                        root,
                        chunk: c,
                        hop: usize::from(!path.is_empty()),
                        path,
                    },
                    values,
                });
            }
            None => {
                // The root: the sum over every node, averaged.
                let n = self.world as f32;
                let avg: Vec<f32> = values.iter().map(|v| v / n).collect();
                self.deliver(c, avg, out);
            }
        }
    }

    /// Chunk `c`'s result is here: keep it and pass it down.
    fn deliver(&mut self, c: usize, values: Vec<f32>, out: &mut Vec<Action>) {
        let root = self.policy.root_of_chunk(c);
        for child in self.policy.children(root, self.me) {
            out.push(Action::Send {
                to: child,
                meta: ChunkMeta {
                    version: self.policy.version,
                    round: self.round,
                    phase: Phase::Pull,
                    root,
                    chunk: c,
                    path: Vec::new(),
                    hop: 0,
                },
                values: values.clone(),
            });
        }
        self.result[c] = Some(values);
        self.done += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_netstorm::wire::{AuxPaths, Policy, RootTree};
    use std::collections::VecDeque;

    /// 4 nodes, two roots: root 0's tree 1->0, 2->1, 3->0; root 3's tree 0->3, 1->3, 2->1;
    /// edge 2->1 has the auxiliary path 2-3-1 (node 3 relays).
    fn policy() -> RoundPolicy {
        let t0 = RootTree {
            root: 0,
            share: 2,
            parent: vec![None, Some(0), Some(1), Some(0)],
        };
        let t3 = RootTree {
            root: 3,
            share: 1,
            parent: vec![Some(3), Some(3), Some(1), None],
        };
        let aux = vec![AuxPaths {
            from: 2,
            to: 1,
            paths: vec![vec![2, 3, 1]],
        }];
        RoundPolicy::new(1, Policy::new(4, vec![t0, t3], aux).unwrap())
    }

    fn input(node: usize, e: usize) -> f32 {
        ((node * 5 + e * 3) % 7) as f32
    }

    /// Run one round with deliveries in an order picked by `seed`; `aux` sends every chunk
    /// of the 2->1 edge on its auxiliary path.
    fn run(seed: u64, aux: bool) -> Vec<Vec<f32>> {
        let n = 4;
        let elems = 103;
        let mut rng = fastrand::Rng::with_seed(seed);
        let route =
            |me: usize, parent: usize| (aux && (me, parent) == (2, 1)).then(|| vec![2, 3, 1]);
        let mut states = Vec::new();
        let mut queue: VecDeque<(usize, usize, ChunkMeta, Vec<f32>)> = VecDeque::new();
        for me in 0..n {
            let inp: Vec<f32> = (0..elems).map(|e| input(me, e)).collect();
            let (st, acts) = RoundState::start(me, 0, policy(), &inp, 10, &route).unwrap();
            states.push(st);
            for Action::Send { to, meta, values } in acts {
                queue.push_back((me, to, meta, values));
            }
        }
        while !queue.is_empty() {
            // Any message in flight may arrive next.
            let i = rng.usize(..queue.len());
            let (from, to, meta, values) = queue.remove(i).unwrap();
            let acts = states[to].on_chunk(from, meta, values, &route).unwrap();
            for Action::Send {
                to: next,
                meta,
                values,
            } in acts
            {
                queue.push_back((to, next, meta, values));
            }
        }
        states
            .iter()
            .map(|s| {
                assert!(s.finished());
                s.output().unwrap()
            })
            .collect()
    }

    #[test]
    fn every_delivery_order_gives_every_node_the_average() {
        let want: Vec<f32> = (0..103)
            .map(|e| (0..4).map(|n| input(n, e)).sum::<f32>() / 4.0)
            .collect();
        for seed in 0..50 {
            for aux in [false, true] {
                for out in run(seed, aux) {
                    assert_eq!(out, want, "seed {seed} aux {aux}");
                }
            }
        }
    }

    #[test]
    fn chunks_that_do_not_fit_the_policy_are_refused() {
        let route = |_: usize, _: usize| None;
        let (mut st, _) = RoundState::start(1, 0, policy(), &[0.0; 20], 10, &route).unwrap();
        let meta = |root, chunk, phase| ChunkMeta {
            version: 1,
            round: 0,
            phase,
            root,
            chunk,
            path: Vec::new(),
            hop: 0,
        };
        let c0_root = policy_root(0);
        // A chunk id beyond the tensor, a wrong root, a wrong size, a non-child.
        assert!(st
            .on_chunk(2, meta(c0_root, 9, Phase::Push), vec![0.0; 10], &route)
            .is_err());
        assert!(st
            .on_chunk(2, meta(5 - c0_root, 0, Phase::Push), vec![0.0; 10], &route)
            .is_err());
        assert!(st
            .on_chunk(2, meta(c0_root, 0, Phase::Push), vec![0.0; 3], &route)
            .is_err());
        assert!(st
            .on_chunk(3, meta(c0_root, 0, Phase::Push), vec![0.0; 10], &route)
            .is_err());
        // An auxiliary path that does not pass here.
        let mut m = meta(c0_root, 0, Phase::Push);
        m.path = vec![2, 0, 3];
        m.hop = 1;
        assert!(st.on_chunk(2, m, vec![0.0; 10], &route).is_err());
        // The same child twice.
        assert!(st
            .on_chunk(2, meta(c0_root, 0, Phase::Push), vec![0.0; 10], &route)
            .is_ok());
        assert!(st
            .on_chunk(2, meta(c0_root, 0, Phase::Push), vec![0.0; 10], &route)
            .is_err());
        // A node outside the policy.
        assert!(RoundState::start(7, 0, policy(), &[0.0; 20], 10, &route).is_err());
    }

    /// The root of chunk 0 of a 20-element tensor in 10-element chunks.
    fn policy_root(c: usize) -> usize {
        let mut p = policy();
        p.chunks(20, 10).unwrap();
        p.root_of_chunk(c)
    }
}
