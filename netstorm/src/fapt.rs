//! Fastest aggregation path trees (FAPT): Algorithm 1 (quality scores, the root set, the
//! fastest aggregation paths) and Algorithm 2 (the multi-root FAPT refreshed from the latest
//! link throughputs), with Theorem 1's synchronization delay.
//!
//! The model (§III-A): gradients flow from the leaves to the root, and a node forwards only
//! after it has aggregated everything from its children. Theorem 1 shows that a tree's
//! synchronization delay is then the largest sum of transfer delays along a leaf-to-root path
//! (the blockage delays along the slowest path are zero). Every tree rooted at `r` routes each
//! node `v` along some path to `r`, which costs at least `v`'s shortest-path distance `d(v, r)`,
//! so every tree's delay is at least `max_v d(v, r)`; the shortest-path tree toward `r` reaches
//! that bound with every node at once. Hence the FAPT is a shortest-path tree over transfer
//! delays (Definition 2), one Dijkstra per root.
//!
//! Multi-root (Definition 3): each root leads its own tree over a share of the chunks; trees
//! share links but carry different bytes, so minimizing each tree minimizes the slowest one.
//! A root's quality score is `S = 1 / delay` of its FAPT; the `k` best nodes become the roots at
//! the first run and then stay fixed ([`Planner`]), because moving a root would migrate its
//! model segment across the WAN.

use crate::graph::{GraphError, Overlay, ShortestPaths};
use serde::{Deserialize, Serialize};

/// A spanning tree rooted at `root`: every other node has a parent, gradients flow up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TreeRepr", into = "TreeRepr")]
pub struct Tree {
    root: usize,
    parent: Vec<Option<usize>>,
    /// Per node, its children ascending.
    children: Vec<Vec<usize>>,
    depth: Vec<usize>,
}

/// What a [`Tree`] serializes to: the root and the parent array.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TreeRepr {
    root: usize,
    parent: Vec<Option<usize>>,
}

impl TryFrom<TreeRepr> for Tree {
    type Error = TreeError;
    fn try_from(r: TreeRepr) -> Result<Self, TreeError> {
        Tree::from_parents(r.root, r.parent)
    }
}

impl From<Tree> for TreeRepr {
    fn from(t: Tree) -> Self {
        TreeRepr {
            root: t.root,
            parent: t.parent,
        }
    }
}

/// A parent array that is not a spanning tree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    /// A root or parent beyond the node count.
    #[error("node {node} does not exist in a tree of {num_nodes} nodes")]
    NodeOutOfRange {
        /// The index.
        node: usize,
        /// The tree's size.
        num_nodes: usize,
    },
    /// The root has a parent.
    #[error("the root {root} has parent {parent}: the root must have none")]
    RootHasParent {
        /// The root.
        root: usize,
        /// Its parent.
        parent: usize,
    },
    /// A node other than the root without a parent.
    #[error("node {node} has no parent but is not the root {root}: every other node needs one")]
    NoParent {
        /// The node.
        node: usize,
        /// The root.
        root: usize,
    },
    /// Parents that loop instead of reaching the root.
    #[error("node {node}'s parents loop without reaching the root {root}")]
    Cycle {
        /// A node on or leading into the loop.
        node: usize,
        /// The root.
        root: usize,
    },
}

impl Tree {
    /// The tree with `parent[v]` as `v`'s parent; `parent[root]` must be `None` and every other
    /// node's parent chain must reach the root.
    pub fn from_parents(root: usize, parent: Vec<Option<usize>>) -> Result<Self, TreeError> {
        let n = parent.len();
        let range = |node: usize| {
            if node < n {
                Ok(())
            } else {
                Err(TreeError::NodeOutOfRange { node, num_nodes: n })
            }
        };
        range(root)?;
        if let Some(p) = parent[root] {
            return Err(TreeError::RootHasParent { root, parent: p });
        }
        let mut children = vec![Vec::new(); n];
        for (v, p) in parent.iter().enumerate() {
            match *p {
                Some(p) => {
                    range(p)?;
                    children[p].push(v);
                }
                None if v != root => return Err(TreeError::NoParent { node: v, root }),
                None => {}
            }
        }
        // Depths top-down from the root; a node never reached sits on a loop.
        let mut depth = vec![usize::MAX; n];
        depth[root] = 0;
        let mut queue = vec![root];
        let mut i = 0;
        while let Some(&u) = queue.get(i) {
            i += 1;
            for &c in &children[u] {
                depth[c] = depth[u] + 1;
                queue.push(c);
            }
        }
        if let Some(node) = depth.iter().position(|&d| d == usize::MAX) {
            return Err(TreeError::Cycle { node, root });
        }
        Ok(Tree {
            root,
            parent,
            children,
            depth,
        })
    }

    /// The root.
    pub fn root(&self) -> usize {
        self.root
    }

    /// Number of nodes spanned.
    pub fn num_nodes(&self) -> usize {
        self.parent.len()
    }

    /// `v`'s parent (`None` for the root or an unknown node).
    pub fn parent(&self, v: usize) -> Option<usize> {
        self.parent.get(v).copied().flatten()
    }

    /// The parent array.
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parent
    }

    /// `v`'s children, ascending.
    pub fn children(&self, v: usize) -> &[usize] {
        self.children.get(v).map_or(&[], Vec::as_slice)
    }

    /// Hops from `v` to the root (0 for the root). Panics on an unknown node.
    pub fn depth(&self, v: usize) -> usize {
        self.depth[v]
    }

    /// The largest depth.
    pub fn height(&self) -> usize {
        self.depth.iter().copied().max().unwrap_or(0)
    }

    /// The nodes from `v` up to the root, both included. Panics on an unknown node.
    pub fn path_to_root(&self, v: usize) -> Vec<usize> {
        let mut path = Vec::with_capacity(self.depth[v] + 1);
        let mut u = v;
        path.push(u);
        while let Some(p) = self.parent[u] {
            path.push(p);
            u = p;
        }
        path
    }

    /// Nodes without children, ascending (the root alone in a one-node tree).
    pub fn leaves(&self) -> Vec<usize> {
        (0..self.num_nodes())
            .filter(|&v| self.children[v].is_empty())
            .collect()
    }

    /// The edges `(child, parent)`, by child ascending.
    pub fn edges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.parent
            .iter()
            .enumerate()
            .filter_map(|(c, p)| p.map(|p| (c, p)))
    }

    /// Nodes by depth descending (ties by index): every child before its parent, the order in
    /// which aggregation completes.
    pub fn bottom_up(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.num_nodes()).collect();
        order.sort_by_key(|&v| (std::cmp::Reverse(self.depth[v]), v));
        order
    }

    /// Whether every tree edge is an overlay link.
    pub fn uses_only_links(&self, overlay: &Overlay) -> bool {
        self.edges()
            .all(|(c, p)| overlay.link_between(c, p).is_some())
    }

    /// Per node, the summed transfer delay (seconds) of its path to the root, each edge costed
    /// by [`Overlay::edge_delay`] for `bytes` in the child -> parent direction.
    pub fn delays_to_root(&self, overlay: &Overlay, bytes: u64) -> Result<Vec<f64>, GraphError> {
        if overlay.num_nodes() != self.num_nodes() {
            return Err(GraphError::DifferentOverlays {
                what: "node count (tree vs overlay)",
            });
        }
        let mut delay = vec![0.0; self.num_nodes()];
        // Top-down, the same summation order as Dijkstra's, so a FAPT's figures match exactly.
        for v in self.bottom_up().into_iter().rev() {
            if let Some(p) = self.parent[v] {
                delay[v] = delay[p] + overlay.edge_delay(v, p, bytes)?;
            }
        }
        Ok(delay)
    }

    /// Theorem 1: the tree's synchronization delay, the largest summed transfer delay of a
    /// leaf-to-root path (seconds, for `bytes` per edge).
    pub fn sync_delay(&self, overlay: &Overlay, bytes: u64) -> Result<f64, GraphError> {
        Ok(self
            .delays_to_root(overlay, bytes)?
            .into_iter()
            .fold(0.0, f64::max))
    }
}

/// Why no FAPT could be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaptError {
    /// The overlay is malformed or disconnected (the error names the unreachable nodes).
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// More roots asked for than there are nodes.
    #[error(
        "num_roots is {requested} but the overlay has {num_nodes} nodes: set num_roots to at most \
         {num_nodes} (or leave it unset for one root per node)"
    )]
    TooManyRoots {
        /// The configured count.
        requested: usize,
        /// The overlay's size.
        num_nodes: usize,
    },
    /// No roots asked for.
    #[error("num_roots is 0: at least one root is needed")]
    NoRoots,
    /// A fixed root given twice.
    #[error("root {0} is given twice: give each root once")]
    DuplicateRoot(usize),
    /// The overlay's size changed after the roots were fixed.
    #[error(
        "the overlay had {before} nodes when the roots were chosen and has {after} now: a planner \
         serves one overlay; start a new one for a new set of sites"
    )]
    NodeCountChanged {
        /// Nodes when the roots were chosen.
        before: usize,
        /// Nodes now.
        after: usize,
    },
    /// A zero-byte delay volume, which makes every tree cost nothing.
    #[error("the delay volume is 0 bytes: cost trees with the bytes an edge carries (at least 1)")]
    ZeroBytes,
}

/// One node's quality as a root (Algorithm 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RootScore {
    /// The candidate root.
    pub node: usize,
    /// Theorem 1's delay of its FAPT, seconds.
    pub sync_delay: f64,
    /// `S = 1 / sync_delay`; 1 for a one-node overlay, whose tree costs nothing.
    pub score: f64,
}

impl RootScore {
    fn new(node: usize, sync_delay: f64) -> Self {
        let score = if sync_delay > 0.0 {
            1.0 / sync_delay
        } else {
            1.0
        };
        RootScore {
            node,
            sync_delay,
            score,
        }
    }
}

/// Algorithm 1's path set: the fastest aggregation path between every ordered pair of nodes,
/// as one shortest-path tree toward each node.
#[derive(Debug, Clone, PartialEq)]
pub struct FastestPaths {
    toward: Vec<ShortestPaths>,
}

impl FastestPaths {
    /// Runs Dijkstra toward every node. Fails, naming them, if some nodes cannot reach others.
    pub fn compute(overlay: &Overlay, bytes: u64) -> Result<Self, FaptError> {
        if bytes == 0 {
            return Err(FaptError::ZeroBytes);
        }
        overlay.check_connected()?;
        let toward = (0..overlay.num_nodes())
            .map(|t| overlay.shortest_paths_to(t, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(FastestPaths { toward })
    }

    /// The shortest-path tree toward `target`; panics on an unknown node.
    pub fn toward(&self, target: usize) -> &ShortestPaths {
        &self.toward[target]
    }

    /// The fastest aggregation path `from ... to`; `None` for unknown nodes.
    pub fn path(&self, from: usize, to: usize) -> Option<Vec<usize>> {
        self.toward.get(to)?.path(from)
    }

    /// Its summed transfer delay, seconds.
    pub fn delay(&self, from: usize, to: usize) -> Option<f64> {
        self.toward.get(to)?.delay(from)
    }

    /// The FAPT rooted at `root`: every node's parent is its next hop toward the root.
    pub fn fapt(&self, root: usize) -> Tree {
        let parent = self.toward[root].next_hops().to_vec();
        // FastestPaths::compute checked connectivity, so every chain reaches the root.
        Tree::from_parents(root, parent).unwrap_or_else(|e| unreachable!("connected overlay: {e}"))
    }

    /// Theorem 1's delay of the FAPT rooted at `root`: its farthest node's distance.
    pub fn fapt_delay(&self, root: usize) -> f64 {
        let sp = &self.toward[root];
        (0..self.toward.len())
            .filter_map(|v| sp.delay(v))
            .fold(0.0, f64::max)
    }

    /// Every node's quality score as a root, indexed by node.
    pub fn scores(&self) -> Vec<RootScore> {
        (0..self.toward.len())
            .map(|r| RootScore::new(r, self.fapt_delay(r)))
            .collect()
    }
}

/// The FAPT rooted at `root` for edges carrying `bytes`: a shortest-path tree toward the root
/// over child -> parent transfer delays. Fails, naming them, if some nodes cannot reach it.
pub fn fapt(overlay: &Overlay, root: usize, bytes: u64) -> Result<Tree, FaptError> {
    if bytes == 0 {
        return Err(FaptError::ZeroBytes);
    }
    let sp = overlay.shortest_paths_to(root, bytes)?;
    let unreachable = sp.unreachable();
    if !unreachable.is_empty() {
        return Err(overlay.disconnected(root, unreachable).into());
    }
    Ok(Tree::from_parents(root, sp.next_hops().to_vec())
        .unwrap_or_else(|e| unreachable!("every node reaches the root: {e}")))
}

/// The `k` best-scoring candidates, best first: by FAPT delay ascending, ties by node index.
pub fn top_k(scores: &[RootScore], k: usize) -> Vec<RootScore> {
    let mut ranked = scores.to_vec();
    ranked.sort_by(|x, y| {
        x.sync_delay
            .total_cmp(&y.sync_delay)
            .then(x.node.cmp(&y.node))
    });
    ranked.truncate(k);
    ranked
}

/// One root's tree in a multi-root FAPT.
#[derive(Debug, Clone, PartialEq)]
pub struct RootTree {
    /// The root.
    pub root: usize,
    /// Its FAPT under the latest throughputs.
    pub tree: Tree,
    /// Theorem 1's delay of `tree` now, seconds.
    pub sync_delay: f64,
    /// `1 / sync_delay` now.
    pub score: f64,
}

/// Algorithm 2's result: one FAPT per root, plus the path set it was built from.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiRootFapt {
    /// The trees, in the order of [`Planner::roots`] (best initial score first).
    pub trees: Vec<RootTree>,
    /// Algorithm 1's fastest paths between all pairs, under the same throughputs.
    pub paths: FastestPaths,
}

impl MultiRootFapt {
    /// The roots, in tree order.
    pub fn roots(&self) -> Vec<usize> {
        self.trees.iter().map(|t| t.root).collect()
    }

    /// Definition 3's cost: the slowest tree's delay.
    pub fn cost(&self) -> f64 {
        self.trees.iter().map(|t| t.sync_delay).fold(0.0, f64::max)
    }

    /// The tree led by `root`.
    pub fn tree_for(&self, root: usize) -> Option<&RootTree> {
        self.trees.iter().find(|t| t.root == root)
    }
}

/// The scheduler's policy formulation state: the root set, chosen at the first refresh and
/// then fixed, and the delay volume trees are costed with.
#[derive(Debug, Clone, PartialEq)]
pub struct Planner {
    num_roots: Option<usize>,
    bytes: u64,
    /// Roots given by the user (the user plane's custom topology), scored at the first refresh.
    fixed: Option<Vec<usize>>,
    /// The root set with the scores it was chosen with; `None` before the first refresh.
    roots: Option<Vec<RootScore>>,
    num_nodes: Option<usize>,
}

impl Planner {
    /// A planner that picks `num_roots` roots (all nodes if `None`, NUM_ROOT_SERVERS = 9 of 9 in
    /// the paper) at its first refresh. `bytes` is the volume each tree edge is costed with,
    /// e.g. a chunk's size: with zero link latency it only scales delays and the trees do not
    /// depend on it; with latency, larger volumes weigh throughput over latency.
    pub fn new(num_roots: Option<usize>, bytes: u64) -> Self {
        Planner {
            num_roots,
            bytes,
            fixed: None,
            roots: None,
            num_nodes: None,
        }
    }

    /// A planner with the roots given (in this order) instead of chosen by score.
    pub fn with_roots(roots: Vec<usize>, bytes: u64) -> Self {
        Planner {
            num_roots: Some(roots.len()),
            bytes,
            fixed: Some(roots),
            roots: None,
            num_nodes: None,
        }
    }

    /// The delay volume, bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The root set with the scores it was chosen with (best first), fixed since the first
    /// refresh; `None` before it. These scores are the stable basis for chunk shares
    /// ([`crate::shares`]): shares that followed every refresh would move model segments
    /// between roots, which fixing the roots exists to avoid.
    pub fn roots(&self) -> Option<&[RootScore]> {
        self.roots.as_deref()
    }

    /// Algorithm 2: builds the multi-root FAPT from `overlay`'s latest throughputs, choosing
    /// the roots by Algorithm 1 on the first call and keeping them afterwards.
    pub fn refresh(&mut self, overlay: &Overlay) -> Result<MultiRootFapt, FaptError> {
        let n = overlay.num_nodes();
        if let Some(before) = self.num_nodes {
            if before != n {
                return Err(FaptError::NodeCountChanged { before, after: n });
            }
        }
        let paths = FastestPaths::compute(overlay, self.bytes)?;
        let roots = match &self.roots {
            Some(roots) => roots.clone(),
            None => {
                let chosen = self.choose_roots(n, &paths)?;
                self.roots = Some(chosen.clone());
                self.num_nodes = Some(n);
                chosen
            }
        };
        let trees = roots
            .iter()
            .map(|r| {
                let tree = paths.fapt(r.node);
                let now = RootScore::new(r.node, paths.fapt_delay(r.node));
                RootTree {
                    root: r.node,
                    tree,
                    sync_delay: now.sync_delay,
                    score: now.score,
                }
            })
            .collect();
        Ok(MultiRootFapt { trees, paths })
    }

    fn choose_roots(&self, n: usize, paths: &FastestPaths) -> Result<Vec<RootScore>, FaptError> {
        let scores = paths.scores();
        if let Some(fixed) = &self.fixed {
            if fixed.is_empty() {
                return Err(FaptError::NoRoots);
            }
            let mut chosen: Vec<RootScore> = Vec::with_capacity(fixed.len());
            for &r in fixed {
                let s = *scores.get(r).ok_or(GraphError::NodeOutOfRange {
                    node: r,
                    num_nodes: n,
                })?;
                if chosen.iter().any(|c| c.node == r) {
                    return Err(FaptError::DuplicateRoot(r));
                }
                chosen.push(s);
            }
            return Ok(chosen);
        }
        let k = self.num_roots.unwrap_or(n);
        if k == 0 {
            return Err(FaptError::NoRoots);
        }
        if k > n {
            return Err(FaptError::TooManyRoots {
                requested: k,
                num_nodes: n,
            });
        }
        Ok(top_k(&scores, k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MBIT: f64 = 1e6;
    const MB: u64 = 1_000_000;

    #[test]
    fn tree_from_parents_validates() {
        let t = Tree::from_parents(1, vec![Some(1), None, Some(0), Some(1)]).unwrap();
        assert_eq!(t.children(1), &[0, 3]);
        assert_eq!(t.depth(2), 2);
        assert_eq!(t.height(), 2);
        assert_eq!(t.path_to_root(2), vec![2, 0, 1]);
        assert_eq!(t.leaves(), vec![2, 3]);
        assert_eq!(t.bottom_up(), vec![2, 0, 3, 1]);
        assert_eq!(t.edges().collect::<Vec<_>>(), vec![(0, 1), (2, 0), (3, 1)]);
        assert_eq!(
            Tree::from_parents(0, vec![Some(1), None]),
            Err(TreeError::RootHasParent { root: 0, parent: 1 })
        );
        assert_eq!(
            Tree::from_parents(0, vec![None, None]),
            Err(TreeError::NoParent { node: 1, root: 0 })
        );
        assert!(matches!(
            Tree::from_parents(0, vec![None, Some(2), Some(1)]),
            Err(TreeError::Cycle { root: 0, .. })
        ));
        assert_eq!(
            Tree::from_parents(3, vec![None]),
            Err(TreeError::NodeOutOfRange {
                node: 3,
                num_nodes: 1
            })
        );
    }

    #[test]
    fn fapt_is_the_shortest_path_tree() {
        // Square 0-1-2-3-0 with a slow 0-1 side: node 1 reaches root 0 faster via 2 and 3.
        let mut o = Overlay::new(4);
        o.add_link(0, 1, MBIT).unwrap();
        o.add_link(1, 2, 8.0 * MBIT).unwrap();
        o.add_link(2, 3, 8.0 * MBIT).unwrap();
        o.add_link(3, 0, 8.0 * MBIT).unwrap();
        let t = fapt(&o, 0, MB).unwrap();
        assert_eq!(t.parents(), &[None, Some(2), Some(3), Some(0)]);
        assert!((t.sync_delay(&o, MB).unwrap() - 3.0).abs() < 1e-12);
        assert!(t.uses_only_links(&o));
    }

    #[test]
    fn fapt_names_unreachable_nodes() {
        let mut o = Overlay::with_names(["a", "b", "c"]).unwrap();
        o.add_link(0, 1, MBIT).unwrap();
        let err = fapt(&o, 0, MB).unwrap_err();
        assert!(err.to_string().contains("2 (c)"), "{err}");
        assert!(matches!(
            Planner::new(None, MB).refresh(&o),
            Err(FaptError::Graph(GraphError::Disconnected { .. }))
        ));
        assert_eq!(fapt(&o, 0, 0), Err(FaptError::ZeroBytes));
    }

    #[test]
    fn planner_refuses_bad_root_counts() {
        let mut o = Overlay::new(2);
        o.add_link(0, 1, MBIT).unwrap();
        assert_eq!(
            Planner::new(Some(3), MB).refresh(&o),
            Err(FaptError::TooManyRoots {
                requested: 3,
                num_nodes: 2
            })
        );
        assert_eq!(
            Planner::new(Some(0), MB).refresh(&o),
            Err(FaptError::NoRoots)
        );
        assert_eq!(
            Planner::with_roots(vec![1, 1], MB).refresh(&o),
            Err(FaptError::DuplicateRoot(1))
        );
        let mut p = Planner::with_roots(vec![1], MB);
        let plan = p.refresh(&o).unwrap();
        assert_eq!(plan.roots(), vec![1]);
        let mut bigger = Overlay::new(3);
        bigger.add_link(0, 1, MBIT).unwrap();
        bigger.add_link(1, 2, MBIT).unwrap();
        assert_eq!(
            p.refresh(&bigger),
            Err(FaptError::NodeCountChanged {
                before: 2,
                after: 3
            })
        );
    }

    #[test]
    fn one_node_overlay_is_its_own_tree() {
        let o = Overlay::new(1);
        let plan = Planner::new(None, MB).refresh(&o).unwrap();
        assert_eq!(plan.trees.len(), 1);
        assert_eq!(plan.trees[0].sync_delay, 0.0);
        assert_eq!(plan.trees[0].score, 1.0);
    }

    #[test]
    fn tree_serializes_as_root_and_parents() {
        // serde's value deserializers stand in for a format crate.
        use serde::de::value::{Error, MapDeserializer};
        let t = Tree::from_parents(0, vec![None, Some(0)]).unwrap();
        let repr = TreeRepr::from(t.clone());
        assert_eq!((repr.root, repr.parent.clone()), (0, vec![None, Some(0)]));
        assert_eq!(Tree::try_from(repr), Ok(t));
        let bad = TreeRepr {
            root: 0,
            parent: vec![None, None],
        };
        assert!(Tree::try_from(bad).is_err());
        // A root alone (no parent field) is refused by serde, not panicking.
        let de: MapDeserializer<'_, _, Error> =
            MapDeserializer::new(vec![("root", 0u64)].into_iter());
        assert!(Tree::deserialize(de).is_err());
    }
}
