//! The topologies NetStorm is compared with (§IX-B), as the same [`Tree`] type so that one
//! runtime executes them all:
//!
//! - STAR (MXNet's parameter server): every node's parent is the root.
//! - BKT (MLNET's balanced k-ary tree): the root first, then the other nodes in index order,
//!   laid out as a k-ary heap (the node at position `p > 0` has the one at `(p - 1) / k` as
//!   parent). It ignores the network, as MLNET does.
//! - MST (TSEngine): the maximum-throughput spanning tree, which prefers the fastest links and
//!   so maximizes both the total and the bottleneck throughput, rooted at the root.
//!
//! STAR and BKT may join sites that no overlay link joins. The fabric routes any host pair, so
//! such an edge is run as is; its modelled cost ([`Tree::sync_delay`]) is the fastest overlay
//! path's delay ([`Overlay::pair_delay`]).

use crate::fapt::{Tree, TreeError};
use crate::graph::{GraphError, Overlay};

/// A baseline that cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BaselineError {
    /// A balanced tree with no children per node.
    #[error("BKT arity is 0: a balanced k-ary tree needs k >= 1")]
    ZeroArity,
    /// The root is not a node, or no nodes.
    #[error(transparent)]
    Tree(#[from] TreeError),
    /// The overlay is malformed or disconnected.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// STAR: all `num_nodes` nodes send to `root` directly.
pub fn star(num_nodes: usize, root: usize) -> Result<Tree, BaselineError> {
    check_root(num_nodes, root)?;
    let parent = (0..num_nodes)
        .map(|v| (v != root).then_some(root))
        .collect();
    Ok(Tree::from_parents(root, parent)?)
}

/// BKT: a balanced `k`-ary tree over `root` then the other nodes in index order, as a heap.
/// `k = 1` is a chain; `k >= num_nodes - 1` is the star.
pub fn bkt(num_nodes: usize, root: usize, k: usize) -> Result<Tree, BaselineError> {
    if k == 0 {
        return Err(BaselineError::ZeroArity);
    }
    check_root(num_nodes, root)?;
    let order: Vec<usize> = std::iter::once(root)
        .chain((0..num_nodes).filter(|&v| v != root))
        .collect();
    let mut parent = vec![None; num_nodes];
    for (pos, &v) in order.iter().enumerate().skip(1) {
        parent[v] = Some(order[(pos - 1) / k]);
    }
    Ok(Tree::from_parents(root, parent)?)
}

/// MST: the maximum spanning tree of `overlay` weighted by each link's slower direction
/// (Kruskal, heaviest first, ties by link id), rooted at `root`.
pub fn mst(overlay: &Overlay, root: usize) -> Result<Tree, BaselineError> {
    overlay.check_node(root)?;
    overlay.check_connected()?;
    let n = overlay.num_nodes();
    let mut order: Vec<usize> = (0..overlay.num_links()).collect();
    let links = overlay.links();
    order.sort_by(|&x, &y| {
        links[y]
            .min_throughput()
            .total_cmp(&links[x].min_throughput())
            .then(x.cmp(&y))
    });
    let mut set: Vec<usize> = (0..n).collect();
    fn find(set: &mut [usize], mut v: usize) -> usize {
        while set[v] != v {
            set[v] = set[set[v]];
            v = set[v];
        }
        v
    }
    let mut adjacent = vec![Vec::new(); n];
    for i in order {
        let (a, b) = links[i].endpoints();
        let (ra, rb) = (find(&mut set, a), find(&mut set, b));
        if ra != rb {
            set[ra] = rb;
            adjacent[a].push(b);
            adjacent[b].push(a);
        }
    }
    // Orient the tree toward the root.
    let mut parent = vec![None; n];
    let mut seen = vec![false; n];
    seen[root] = true;
    let mut stack = vec![root];
    while let Some(u) = stack.pop() {
        for &v in &adjacent[u] {
            if !seen[v] {
                seen[v] = true;
                parent[v] = Some(u);
                stack.push(v);
            }
        }
    }
    Ok(Tree::from_parents(root, parent)?)
}

fn check_root(num_nodes: usize, root: usize) -> Result<(), TreeError> {
    if root < num_nodes {
        Ok(())
    } else {
        Err(TreeError::NodeOutOfRange {
            node: root,
            num_nodes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_shape() {
        let t = star(4, 2).unwrap();
        assert_eq!(t.parents(), &[Some(2), Some(2), None, Some(2)]);
        assert_eq!(t.height(), 1);
        assert!(star(3, 3).is_err());
        assert_eq!(star(1, 0).unwrap().parents(), &[None]);
    }

    #[test]
    fn bkt_is_a_heap_with_the_root_first() {
        // Order [2, 0, 1, 3, 4, 5]; positions 1, 2 under 2; 3, 4 under 0; 5 under 1.
        let t = bkt(6, 2, 2).unwrap();
        assert_eq!(
            t.parents(),
            &[Some(2), Some(2), None, Some(0), Some(0), Some(1)]
        );
        assert_eq!(t.height(), 2);
        assert_eq!(
            bkt(4, 0, 1).unwrap().parents(),
            &[None, Some(0), Some(1), Some(2)]
        );
        assert_eq!(bkt(4, 0, 3).unwrap(), star(4, 0).unwrap());
        assert_eq!(bkt(4, 0, 0), Err(BaselineError::ZeroArity));
    }

    #[test]
    fn mst_takes_the_fastest_links() {
        let mut o = Overlay::new(4);
        o.add_link(0, 1, 10.0).unwrap();
        o.add_link(1, 2, 100.0).unwrap();
        o.add_link(2, 3, 100.0).unwrap();
        o.add_link(0, 3, 50.0).unwrap();
        o.add_link(0, 2, 20.0).unwrap();
        let t = mst(&o, 0).unwrap();
        // Links 1-2, 2-3, 0-3 (the heaviest three that do not close a cycle).
        assert_eq!(t.parents(), &[None, Some(2), Some(3), Some(0)]);
        assert!(t.uses_only_links(&o));
        let mut cut = Overlay::new(3);
        cut.add_link(0, 1, 1.0).unwrap();
        assert!(matches!(
            mst(&cut, 0),
            Err(BaselineError::Graph(GraphError::Disconnected { .. }))
        ));
    }
}
