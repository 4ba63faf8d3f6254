//! Algorithm 3 (§VI-B): edge-disjoint auxiliary paths by repeated shortest paths.
//!
//! For an ordered pair `(u, v)`, find the fastest path, remove its links from the graph, and
//! repeat on the pruned graph until `v` is out of reach. Path 0 is the primary path; the rest
//! are auxiliary paths that share no link with each other or with it. Each later path was also
//! available when an earlier one was chosen, so the list comes out sorted by transfer delay,
//! which is the priority order the sender polls auxiliary paths in (§VI-A).
//!
//! Auxiliary paths carry chunks forward-only, relayed by the nodes on the path, so a path's
//! delay is the sum of its hops' transfer delays. A chunk sent on one carries the node sequence
//! (PATH) so that forwarding follows the sender's view of the policy (§VII-B).

use crate::fapt::{MultiRootFapt, Tree};
use crate::graph::{GraphError, LinkId, Overlay};
use serde::{Deserialize, Serialize};

/// A path through the overlay with its summed transfer delay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Path {
    /// Nodes from source to destination, both included (the PATH metadata).
    pub nodes: Vec<usize>,
    /// Summed directed transfer delay of its hops, seconds.
    pub delay: f64,
}

impl Path {
    /// The overlay links the path uses, in order.
    pub fn links(&self, overlay: &Overlay) -> Vec<LinkId> {
        self.nodes
            .windows(2)
            .filter_map(|w| overlay.link_between(w[0], w[1]))
            .collect()
    }
}

/// Algorithm 3 for `from -> to`, starting from the overlay minus the links in `removed`:
/// repeated shortest paths, each pruning its links, until `to` is out of reach.
fn disjoint_paths(
    overlay: &Overlay,
    from: usize,
    to: usize,
    bytes: u64,
    mut removed: Vec<bool>,
) -> Vec<Path> {
    let mut paths = Vec::new();
    if from == to {
        return paths;
    }
    loop {
        let sp = overlay.shortest_paths_to_filtered(to, bytes, &|l| !removed[l.0]);
        let (Some(nodes), Some(delay)) = (sp.path(from), sp.delay(from)) else {
            return paths;
        };
        for w in nodes.windows(2) {
            if let Some(l) = overlay.link_between(w[0], w[1]) {
                removed[l.0] = true;
            }
        }
        paths.push(Path { nodes, delay });
    }
}

/// Algorithm 3 for one ordered pair: the primary path then the auxiliary paths, pairwise
/// edge-disjoint and sorted by delay. Empty if `from == to` or `to` is unreachable; `bytes`
/// is the volume hops are costed with (a chunk).
pub fn edge_disjoint_paths(
    overlay: &Overlay,
    from: usize,
    to: usize,
    bytes: u64,
) -> Result<Vec<Path>, GraphError> {
    overlay.check_node(from)?;
    overlay.check_node(to)?;
    Ok(disjoint_paths(
        overlay,
        from,
        to,
        bytes,
        vec![false; overlay.num_links()],
    ))
}

/// Algorithm 3's result for every ordered pair.
#[derive(Debug, Clone, PartialEq)]
pub struct PathTable {
    num_nodes: usize,
    /// `paths[from * n + to]`.
    paths: Vec<Vec<Path>>,
}

impl PathTable {
    /// Runs Algorithm 3 for every ordered pair of `overlay`'s nodes.
    pub fn compute(overlay: &Overlay, bytes: u64) -> Self {
        let n = overlay.num_nodes();
        let paths = (0..n * n)
            .map(|i| {
                disjoint_paths(
                    overlay,
                    i / n,
                    i % n,
                    bytes,
                    vec![false; overlay.num_links()],
                )
            })
            .collect();
        PathTable {
            num_nodes: n,
            paths,
        }
    }

    /// Primary then auxiliary paths from `from` to `to` (empty for unknown or equal nodes).
    pub fn get(&self, from: usize, to: usize) -> &[Path] {
        if from < self.num_nodes && to < self.num_nodes {
            &self.paths[from * self.num_nodes + to]
        } else {
            &[]
        }
    }
}

/// One tree edge's transmission options at the child (the sender).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EdgePaths {
    /// The sender.
    pub child: usize,
    /// The receiver (aggregates; auxiliary relays only forward).
    pub parent: usize,
    /// The primary route: `[child, parent]` over their link, or the fastest overlay path when
    /// no link joins them (STAR, BKT).
    pub primary: Vec<usize>,
    /// Auxiliary paths, fastest first: edge-disjoint with each other and with `primary`.
    pub auxiliary: Vec<Path>,
}

/// Auxiliary paths for every edge of `tree` (one entry per non-root node, by child
/// ascending). They come from Algorithm 3 run on the overlay minus the primary route's links,
/// so they never share a link with the primary one. For a FAPT edge whose link is the unique
/// fastest child -> parent path, this is exactly Algorithm 3's paths 1.. for the pair.
pub fn tree_edge_paths(
    overlay: &Overlay,
    tree: &Tree,
    bytes: u64,
) -> Result<Vec<EdgePaths>, GraphError> {
    if tree.num_nodes() != overlay.num_nodes() {
        return Err(GraphError::DifferentOverlays {
            what: "node count (tree vs overlay)",
        });
    }
    tree.edges()
        .map(|(child, parent)| {
            let primary = match overlay.link_between(child, parent) {
                Some(_) => vec![child, parent],
                None => overlay
                    .shortest_paths_to(parent, bytes)?
                    .path(child)
                    .ok_or_else(|| overlay.disconnected(parent, vec![child]))?,
            };
            let mut removed = vec![false; overlay.num_links()];
            for w in primary.windows(2) {
                if let Some(l) = overlay.link_between(w[0], w[1]) {
                    removed[l.0] = true;
                }
            }
            let auxiliary = disjoint_paths(overlay, child, parent, bytes, removed);
            Ok(EdgePaths {
                child,
                parent,
                primary,
                auxiliary,
            })
        })
        .collect()
}

/// [`tree_edge_paths`] for each tree of a multi-root FAPT, in tree order.
pub fn multi_root_edge_paths(
    overlay: &Overlay,
    plan: &MultiRootFapt,
    bytes: u64,
) -> Result<Vec<Vec<EdgePaths>>, GraphError> {
    plan.trees
        .iter()
        .map(|t| tree_edge_paths(overlay, &t.tree, bytes))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baselines::star;
    use crate::fapt::fapt;

    const MBIT: f64 = 1e6;
    const MB: u64 = 1_000_000;

    /// 0-1 direct (fast), 0-2-1 and 0-3-1 (slower), 2-3 cross link.
    fn diamond() -> Overlay {
        let mut o = Overlay::new(4);
        o.add_link(0, 1, 8.0 * MBIT).unwrap();
        o.add_link(0, 2, 4.0 * MBIT).unwrap();
        o.add_link(2, 1, 4.0 * MBIT).unwrap();
        o.add_link(0, 3, 2.0 * MBIT).unwrap();
        o.add_link(3, 1, 2.0 * MBIT).unwrap();
        o.add_link(2, 3, 8.0 * MBIT).unwrap();
        o
    }

    #[test]
    fn repeated_shortest_paths_on_the_pruned_graph() {
        let o = diamond();
        let paths = edge_disjoint_paths(&o, 0, 1, MB).unwrap();
        let nodes: Vec<_> = paths.iter().map(|p| p.nodes.clone()).collect();
        assert_eq!(nodes, vec![vec![0, 1], vec![0, 2, 1], vec![0, 3, 1]]);
        let delays: Vec<_> = paths.iter().map(|p| p.delay).collect();
        assert_eq!(delays, vec![1.0, 4.0, 8.0]);
        assert!(edge_disjoint_paths(&o, 2, 2, MB).unwrap().is_empty());
        assert!(edge_disjoint_paths(&o, 0, 4, MB).is_err());
        let table = PathTable::compute(&o, MB);
        assert_eq!(table.get(0, 1), paths.as_slice());
        assert!(table.get(0, 9).is_empty());
    }

    #[test]
    fn tree_edges_exclude_the_primary_link() {
        let o = diamond();
        let t = fapt(&o, 1, MB).unwrap();
        let edges = tree_edge_paths(&o, &t, MB).unwrap();
        let e0 = edges.iter().find(|e| e.child == 0).unwrap();
        assert_eq!(e0.primary, vec![0, 1]);
        assert_eq!(
            e0.auxiliary
                .iter()
                .map(|p| p.nodes.clone())
                .collect::<Vec<_>>(),
            vec![vec![0, 2, 1], vec![0, 3, 1]]
        );
    }

    #[test]
    fn star_edge_without_a_link_routes_its_primary_over_the_fastest_path() {
        let mut line = Overlay::new(3);
        line.add_link(0, 1, MBIT).unwrap();
        line.add_link(1, 2, MBIT).unwrap();
        let t = star(3, 0).unwrap();
        let edges = tree_edge_paths(&line, &t, MB).unwrap();
        let e2 = edges.iter().find(|e| e.child == 2).unwrap();
        assert_eq!(e2.primary, vec![2, 1, 0]);
        assert!(e2.auxiliary.is_empty());
        // A tree over other nodes than the overlay's is refused.
        assert!(tree_edge_paths(&diamond(), &t, MB).is_err());
    }
}
