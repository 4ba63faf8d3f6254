//! The chunks of a round's tensor under its policy: cut into chunks of at most CHUNK_SIZE
//! elements and assigned to the roots in proportion to their shares, interleaved, the same
//! on every node (NetStorm §IV-C).

use std::collections::BTreeMap;
use std::ops::Range;

use gradwire_netstorm::shares::assign_chunks;
use gradwire_netstorm::wire::Policy;

/// Chunk `c` of the plan: its elements and its root.
pub fn chunk_plan(
    policy: &Policy,
    elems: usize,
    chunk_elems: usize,
) -> Result<Vec<(Range<usize>, u16)>, String> {
    let roots: Vec<u16> = policy.roots().collect();
    let shares: Vec<f64> = policy.trees().iter().map(|t| f64::from(t.share)).collect();
    let plan = assign_chunks(&[elems], chunk_elems, &shares).map_err(|e| e.to_string())?;
    Ok(plan.into_iter().map(|a| (a.range, roots[a.slot])).collect())
}

/// Auxiliary paths of every tree edge `(child, parent)`, fastest first.
pub fn aux_map(policy: &Policy) -> BTreeMap<(u16, u16), Vec<Vec<u16>>> {
    policy
        .aux()
        .iter()
        .map(|a| ((a.from, a.to), a.paths.clone()))
        .collect()
}

/// Each tree's parent vector, for reports.
pub fn parents(policy: &Policy) -> Vec<Vec<Option<usize>>> {
    policy
        .trees()
        .iter()
        .map(|t| t.parent.iter().map(|p| p.map(usize::from)).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_netstorm::wire::RootTree;

    #[test]
    fn chunks_cover_the_tensor_and_follow_the_shares() {
        let t = |root: u16, share, parent| RootTree {
            root,
            share,
            parent,
        };
        let p = Policy::new(
            3,
            vec![
                t(0, 3, vec![None, Some(0), Some(0)]),
                t(2, 1, vec![Some(2), Some(2), None]),
            ],
            Vec::new(),
        )
        .unwrap();
        let plan = chunk_plan(&p, 1000, 100).unwrap();
        assert_eq!(plan.len(), 10);
        assert_eq!(plan.iter().map(|c| c.0.len()).sum::<usize>(), 1000);
        let to0 = plan.iter().filter(|c| c.1 == 0).count();
        assert!(
            (7..=8).contains(&to0),
            "{to0} of 10 chunks to the root with 3/4 of the share"
        );
        assert_eq!(parents(&p)[1], vec![Some(2), Some(2), None]);
    }
}
