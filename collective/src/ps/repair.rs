//! Routing around failed ranks: the repaired tree every survivor computes from the same
//! inputs, and the spare links a repair needs.

use std::collections::BTreeSet;

use crate::tree::{Tree, TreeError};

/// The tree after the failures in `dead`: each dead node's children re-attached to the
/// nearest live ancestor ([`Tree::reparent`]), or MLNET's STAR fallback ([`Tree::star`], the
/// `bool` is then true) once more than `max_reparents` nodes failed or when a re-attachment
/// needs a link [`fault_tolerant_edges`] does not provide (a dead parent and grandparent).
/// Every rank computes it from the same inputs, so all survivors agree on the tree.
pub fn repaired_tree(
    original: &Tree,
    dead: &[usize],
    max_reparents: usize,
) -> Result<(Tree, bool), TreeError> {
    let mut dead = dead.to_vec();
    dead.sort_unstable();
    dead.dedup();
    let mut t = original.clone();
    for &d in &dead {
        t = t.reparent(d)?;
    }
    if dead.is_empty() {
        return Ok((t, false));
    }
    let ft: BTreeSet<(usize, usize)> = fault_tolerant_edges(original).into_iter().collect();
    if dead.len() > max_reparents || t.edges().iter().any(|e| !ft.contains(e)) {
        return Ok((t.star(), true));
    }
    Ok((t, false))
}

/// The links a route-around job needs ([`PsConfig::reroute`](super::PsConfig::reroute)), directed `(from, to)`, each
/// once: the tree's edges both ways, every node <-> its grandparent (where children re-attach
/// when their parent dies), and the root <-> every member (failure news, and the STAR
/// fallback). The extra links stay idle, kept alive by heartbeats, until a failure needs them.
pub fn fault_tolerant_edges(tree: &Tree) -> Vec<(usize, usize)> {
    let root = tree.root();
    let mut set = BTreeSet::new();
    for m in tree.members() {
        let ups = [
            tree.parent(m),
            tree.grandparent(m),
            (m != root).then_some(root),
        ];
        for q in ups.into_iter().flatten() {
            set.insert((m, q));
            set.insert((q, m));
        }
    }
    set.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Strategy;

    #[test]
    fn one_failure_reparents_more_fall_back_to_star() {
        let members: Vec<usize> = (0..7).collect();
        let t = Tree::build(Strategy::BINARY, 0, &members, &[0; 7]).unwrap();
        let interior: Vec<usize> = (1..7).filter(|&r| !t.children(r).is_empty()).collect();
        let d = interior[0];
        let (r, star) = repaired_tree(&t, &[d], 1).unwrap();
        assert!(!star);
        assert_eq!(r, t.reparent(d).unwrap());
        assert_eq!(repaired_tree(&t, &[], 1).unwrap(), (t.clone(), false));
        // Two failures: STAR over the survivors.
        let (s, star) = repaired_tree(&t, &[interior[1], d, d], 1).unwrap();
        assert!(star);
        assert_eq!(s.height(), 1);
        assert!(!s.contains(d) && !s.contains(interior[1]));
        assert_eq!(s.len(), 5);
        // Allowed two re-parentings, siblings both go to the root (links exist) ...
        let (two, star) = repaired_tree(&t, &interior, 2).unwrap();
        assert!(!star);
        assert_eq!(two.height(), 1);
        // ... but a dead parent and grandparent would need a link nobody has.
        let chain = Tree::build(Strategy::Degree(1), 0, &[0, 1, 2, 3, 4], &[0; 5]).unwrap();
        let (c, star) = repaired_tree(&chain, &[1], 3).unwrap();
        assert!(!star && c.parent(2) == Some(0));
        let (c, star) = repaired_tree(&chain, &[2, 3], 3).unwrap();
        assert!(star, "{c:?}");
        assert_eq!(
            repaired_tree(&chain, &[0], 3).unwrap_err(),
            TreeError::RootFailed(0)
        );
    }

    #[test]
    fn spare_links_cover_every_repair() {
        let members: Vec<usize> = (0..9).collect();
        for strat in [Strategy::BINARY, Strategy::Degree(1), Strategy::Degree(3)] {
            let t = Tree::build(strat, 0, &members, &[0; 9]).unwrap();
            let e: BTreeSet<(usize, usize)> = fault_tolerant_edges(&t).into_iter().collect();
            assert_eq!(e.len(), fault_tolerant_edges(&t).len());
            for d in 1..9 {
                let (r, _) = repaired_tree(&t, &[d], 1).unwrap();
                for (c, p) in r.edges() {
                    assert!(
                        e.contains(&(c, p)) && e.contains(&(p, c)),
                        "{strat}: {c}-{p}"
                    );
                }
            }
            for (c, p) in t.star().edges() {
                assert!(e.contains(&(c, p)) && e.contains(&(p, c)));
            }
        }
    }
}
