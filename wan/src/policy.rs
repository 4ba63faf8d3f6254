//! The policy a round runs under, as the node loop uses it: NetStorm's [`Policy`] (one tree
//! per root with its chunk share, the auxiliary paths of the tree edges), its version, and
//! the chunks of the round's tensor assigned to the roots.

use std::collections::BTreeMap;
use std::ops::Range;

use gradwire_netstorm::shares::assign_chunks;
use gradwire_netstorm::wire::Policy;

/// One round's policy at a node.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundPolicy {
    /// Version (the scheduler's counter, from 1).
    pub version: u32,
    /// Trees, shares and auxiliary paths.
    pub policy: Policy,
    /// Chunk -> root, fixed by [`RoundPolicy::chunks`].
    assignment: Vec<usize>,
}

impl RoundPolicy {
    /// Version `version` of `policy`.
    pub fn new(version: u32, policy: Policy) -> RoundPolicy {
        RoundPolicy {
            version,
            policy,
            assignment: Vec::new(),
        }
    }

    /// Nodes in the job.
    pub fn world(&self) -> usize {
        usize::from(self.policy.nodes())
    }

    /// Cut `elems` into chunks of at most `chunk_elems` and give each a root in proportion
    /// to the shares, interleaved (every node computes the same assignment).
    pub fn chunks(
        &mut self,
        elems: usize,
        chunk_elems: usize,
    ) -> Result<Vec<Range<usize>>, String> {
        let roots: Vec<usize> = self.policy.roots().map(usize::from).collect();
        let shares: Vec<f64> = self
            .policy
            .trees()
            .iter()
            .map(|t| f64::from(t.share))
            .collect();
        let plan = assign_chunks(&[elems], chunk_elems, &shares).map_err(|e| e.to_string())?;
        self.assignment = plan.iter().map(|a| roots[a.slot]).collect();
        Ok(plan.into_iter().map(|a| a.range).collect())
    }

    /// The root of chunk `c`'s tree.
    pub fn root_of_chunk(&self, c: usize) -> usize {
        self.assignment.get(c).copied().unwrap_or(0)
    }

    /// `node`'s parent in `root`'s tree.
    pub fn parent(&self, root: usize, node: usize) -> Option<usize> {
        let (root, node) = (u16::try_from(root).ok()?, u16::try_from(node).ok()?);
        self.policy.tree(root)?.parent_of(node).map(usize::from)
    }

    /// `node`'s children in `root`'s tree.
    pub fn children(&self, root: usize, node: usize) -> Vec<usize> {
        let (Ok(root), Ok(node)) = (u16::try_from(root), u16::try_from(node)) else {
            return Vec::new();
        };
        self.policy
            .tree(root)
            .map_or_else(Vec::new, |t| t.children(node).map(usize::from).collect())
    }

    /// Auxiliary paths of every tree edge `(child, parent)`, fastest first.
    pub fn aux_map(&self) -> BTreeMap<(usize, usize), Vec<Vec<usize>>> {
        self.policy
            .aux()
            .iter()
            .map(|a| {
                (
                    (usize::from(a.from), usize::from(a.to)),
                    a.paths
                        .iter()
                        .map(|p| p.iter().map(|&v| usize::from(v)).collect())
                        .collect(),
                )
            })
            .collect()
    }

    /// Each tree's parent vector, for reports.
    pub fn parents(&self) -> Vec<Vec<Option<usize>>> {
        self.policy
            .trees()
            .iter()
            .map(|t| t.parent.iter().map(|p| p.map(usize::from)).collect())
            .collect()
    }
}
