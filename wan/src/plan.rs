//! Policy formulation (§VIII-B): the strategy's trees from the scheduler's current view of
//! the overlay, in NetStorm's policy format. NetStorm's (Algorithms 1-3) and the baselines
//! go through this one function, so the experiment compares topologies and nothing else.
//!
//! The single-root strategies (STAR, BKT, MST, FAPT) use one root: the node whose FAPT is
//! fastest on the first view (NetStorm's quality score), kept for the run like NetStorm's
//! roots, so that they differ from each other only in the tree's shape.

use gradwire_netstorm::aux::multi_root_edge_paths;
use gradwire_netstorm::baselines::{bkt, mst, star};
use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::fapt::{fapt, FastestPaths, MultiRootFapt, Planner as FaptPlanner, Tree};
use gradwire_netstorm::graph::Overlay;
use gradwire_netstorm::wire::{AuxPaths, Policy, RootTree};

use crate::error::WanError;
use crate::scheduler::Strategy;

/// MLNET's balanced tree arity for BKT: binary, MLNET's best tree in gradwire's own MLNET
/// experiment (docs/results.md).
pub const BKT_ARITY: usize = 2;

/// What formulation remembers between refreshes: the roots, chosen once.
#[derive(Debug, Default)]
pub struct Planner {
    single_root: Option<usize>,
    multi: Option<FaptPlanner>,
}

fn plan_err(e: impl std::fmt::Display) -> WanError {
    WanError::Plan(e.to_string())
}

/// The policy of `strategy` on `overlay`; `bytes`: what a tree edge carries (weights the
/// transfer delays).
pub fn formulate(
    strategy: Strategy,
    overlay: &Overlay,
    planner: &mut Planner,
    ns: &NetStormConfig,
    bytes: u64,
) -> Result<Policy, WanError> {
    let n = overlay.num_nodes();
    let nodes = u16::try_from(n).map_err(plan_err)?;
    let root = match planner.single_root {
        Some(r) => r,
        None => {
            let scores = FastestPaths::compute(overlay, bytes)
                .map_err(plan_err)?
                .scores();
            let best = scores
                .iter()
                .max_by(|a, b| a.score.total_cmp(&b.score).then(b.node.cmp(&a.node)))
                .map(|s| s.node)
                .ok_or_else(|| WanError::Plan("the overlay has no nodes".into()))?;
            planner.single_root = Some(best);
            best
        }
    };
    let mut multi: Option<MultiRootFapt> = None;
    let trees: Vec<(Tree, f64)> = match strategy {
        Strategy::Star => vec![(star(n, root).map_err(plan_err)?, 1.0)],
        Strategy::Bkt => vec![(bkt(n, root, BKT_ARITY).map_err(plan_err)?, 1.0)],
        Strategy::Mst => vec![(mst(overlay, root).map_err(plan_err)?, 1.0)],
        Strategy::Fapt => vec![(fapt(overlay, root, bytes).map_err(plan_err)?, 1.0)],
        Strategy::MrFapt | Strategy::MrFaptAware | Strategy::MrFaptAwareAux => {
            let p = planner
                .multi
                .get_or_insert_with(|| FaptPlanner::new(ns.num_roots, bytes));
            let m = p.refresh(overlay).map_err(plan_err)?;
            // Shares from the scores the roots were chosen with: stable across refreshes, so
            // a refresh moves no model segment between roots (§IV-A).
            let scores = p.roots().unwrap_or(&[]);
            let share_of = |r: usize| scores.iter().find(|s| s.node == r).map_or(1.0, |s| s.score);
            let t = m
                .trees
                .iter()
                .map(|t| (t.tree.clone(), share_of(t.root)))
                .collect();
            multi = Some(m);
            t
        }
    };
    let max = trees.iter().map(|t| t.1).fold(0.0f64, f64::max);
    let mut roots = Vec::with_capacity(trees.len());
    for (t, score) in &trees {
        let parent = t
            .parents()
            .iter()
            .map(|p| p.map(u16::try_from).transpose())
            .collect::<Result<Vec<_>, _>>()
            .map_err(plan_err)?;
        // Shares as integers on the wire: the scores scaled to at most a million.
        let share = if max > 0.0 {
            ((score / max) * 1e6).round().max(1.0) as u32
        } else {
            1
        };
        roots.push(RootTree {
            root: u16::try_from(t.root()).map_err(plan_err)?,
            share,
            parent,
        });
    }
    let mut aux: Vec<AuxPaths> = Vec::new();
    if strategy.aux() {
        if let Some(m) = &multi {
            for edges in multi_root_edge_paths(overlay, m, bytes).map_err(plan_err)? {
                for e in edges {
                    let (from, to) = (
                        u16::try_from(e.child).map_err(plan_err)?,
                        u16::try_from(e.parent).map_err(plan_err)?,
                    );
                    // The same edge in several trees has the same paths: list it once.
                    if e.auxiliary.is_empty() || aux.iter().any(|a| (a.from, a.to) == (from, to)) {
                        continue;
                    }
                    let paths = e
                        .auxiliary
                        .iter()
                        .map(|p| p.nodes.iter().map(|&v| u16::try_from(v)).collect())
                        .collect::<Result<Vec<Vec<u16>>, _>>()
                        .map_err(plan_err)?;
                    aux.push(AuxPaths { from, to, paths });
                }
            }
        }
    }
    Policy::new(nodes, roots, aux).map_err(plan_err)
}
