#![allow(clippy::unwrap_used, clippy::expect_used)]
//! NetStorm's algorithms against brute force on small random overlays (3-6 nodes): the FAPT
//! against every spanning tree, the MST against every spanning tree, the root set against the
//! scores, Algorithm 3's paths against their definition, and the chunk shares against exact
//! quotas. Seeds are fixed so every run checks the same cases.

use gradwire_netstorm::aux::{edge_disjoint_paths, tree_edge_paths, PathTable};
use gradwire_netstorm::baselines::{bkt, mst, star};
use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::fapt::{fapt, FastestPaths, Planner, Tree};
use gradwire_netstorm::graph::{LinkSpec, Overlay};
use gradwire_netstorm::shares::{assign_chunks, chunk_ranges, interleave, proportional_counts};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::collections::BTreeSet;

const MBIT: f64 = 1e6;
/// A 1 M-element f32 chunk.
const CHUNK_BYTES: u64 = 4_000_000;

fn config() -> Config {
    Config {
        cases: 96,
        rng_seed: RngSeed::Fixed(0x6e65_7473_746f_726d),
        failure_persistence: None,
        ..Config::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
}

/// A connected overlay of 3-6 nodes: a random spanning tree plus random extra links, with
/// throughputs of 20-155 Mbit/s in 5 Mbit/s steps (so that ties happen) and, sometimes,
/// different throughputs each way.
fn overlays() -> impl Strategy<Value = Overlay> {
    (3usize..=6)
        .prop_flat_map(|n| {
            let pairs = n * (n - 1) / 2;
            (
                Just(n),
                prop::collection::vec(any::<prop::sample::Index>(), n - 1),
                prop::collection::vec(any::<bool>(), pairs),
                prop::collection::vec((4u32..=31, prop::option::of(4u32..=31)), pairs),
            )
        })
        .prop_map(|(n, tree_parents, extra, rates)| {
            let mut wanted = BTreeSet::new();
            for v in 1..n {
                let p = tree_parents[v - 1].index(v);
                wanted.insert((p, v));
            }
            let mut i = 0;
            for a in 0..n {
                for b in a + 1..n {
                    if extra[i] {
                        wanted.insert((a, b));
                    }
                    i += 1;
                }
            }
            let mut o = Overlay::new(n);
            for (k, &(a, b)) in wanted.iter().enumerate() {
                let (ab, ba) = rates[k % rates.len()];
                let ab = f64::from(ab) * 5.0 * MBIT;
                let ba = ba.map_or(ab, |r| f64::from(r) * 5.0 * MBIT);
                o.add_link_spec(LinkSpec {
                    throughput_ab_bps: ab,
                    throughput_ba_bps: ba,
                    ..LinkSpec::symmetric(a, b, ab)
                })
                .unwrap();
            }
            o
        })
}

/// Every spanning tree of `overlay` rooted at `root` (each node's parent is a neighbour and
/// the parents reach the root).
fn all_spanning_trees(overlay: &Overlay, root: usize) -> Vec<Tree> {
    let n = overlay.num_nodes();
    let choices: Vec<Vec<Option<usize>>> = (0..n)
        .map(|v| {
            if v == root {
                vec![None]
            } else {
                overlay.neighbours(v).map(Some).collect()
            }
        })
        .collect();
    let mut digits = vec![0usize; n];
    let mut trees = Vec::new();
    loop {
        let parent = (0..n).map(|v| choices[v][digits[v]]).collect();
        if let Ok(t) = Tree::from_parents(root, parent) {
            trees.push(t);
        }
        let mut v = 0;
        loop {
            if v == n {
                return trees;
            }
            digits[v] += 1;
            if digits[v] < choices[v].len() {
                break;
            }
            digits[v] = 0;
            v += 1;
        }
    }
}

fn tree_links(t: &Tree, o: &Overlay) -> Vec<f64> {
    t.edges()
        .map(|(c, p)| o.link(o.link_between(c, p).unwrap()).min_throughput())
        .collect()
}

proptest! {
    #![proptest_config(config())]

    /// Theorem 1 / Definition 2: the FAPT's delay is the minimum over all spanning trees rooted
    /// at the root, and the FAPT is one of them.
    #[test]
    fn fapt_delay_is_minimal_over_all_spanning_trees(o in overlays()) {
        let paths = FastestPaths::compute(&o, CHUNK_BYTES).unwrap();
        for root in 0..o.num_nodes() {
            let t = fapt(&o, root, CHUNK_BYTES).unwrap();
            prop_assert_eq!(t.num_nodes(), o.num_nodes());
            prop_assert!(t.uses_only_links(&o));
            prop_assert_eq!(&t, &paths.fapt(root));
            let delay = t.sync_delay(&o, CHUNK_BYTES).unwrap();
            prop_assert_eq!(delay, paths.fapt_delay(root));
            let all = all_spanning_trees(&o, root);
            prop_assert!(all.contains(&t));
            let best = all
                .iter()
                .map(|t| t.sync_delay(&o, CHUNK_BYTES).unwrap())
                .fold(f64::INFINITY, f64::min);
            prop_assert!(close(delay, best), "FAPT {} vs best {}", delay, best);
            // Each node's path in the FAPT is its fastest path to the root.
            let to_root = t.delays_to_root(&o, CHUNK_BYTES).unwrap();
            for (v, &d) in to_root.iter().enumerate() {
                prop_assert_eq!(Some(d), paths.delay(v, root));
                prop_assert_eq!(Some(t.path_to_root(v)), paths.path(v, root));
            }
        }
    }

    /// TSEngine's tree maximizes both the summed and the bottleneck link throughput.
    #[test]
    fn mst_maximizes_total_and_bottleneck_throughput(o in overlays(), root in any::<prop::sample::Index>()) {
        let root = root.index(o.num_nodes());
        let t = mst(&o, root).unwrap();
        prop_assert_eq!(t.root(), root);
        prop_assert!(t.uses_only_links(&o));
        let score = |t: &Tree| {
            let l = tree_links(t, &o);
            (l.iter().sum::<f64>(), l.iter().copied().fold(f64::INFINITY, f64::min))
        };
        let (total, bottleneck) = score(&t);
        let all = all_spanning_trees(&o, root);
        let best_total = all.iter().map(|t| score(t).0).fold(0.0, f64::max);
        let best_bottleneck = all.iter().map(|t| score(t).1).fold(0.0, f64::max);
        prop_assert!(close(total, best_total), "{} vs {}", total, best_total);
        prop_assert_eq!(bottleneck, best_bottleneck);
    }

    /// Algorithm 1 picks the k best-scoring roots, and Algorithm 2 keeps them while the
    /// throughputs change, rebuilding each root's FAPT from the new throughputs.
    #[test]
    fn roots_are_the_k_best_and_stay_fixed(
        o in overlays(),
        k in any::<prop::sample::Index>(),
        new_rates in prop::collection::vec(1u32..=40, 30),
    ) {
        let n = o.num_nodes();
        let k = 1 + k.index(n);
        let mut planner = Planner::new(Some(k), CHUNK_BYTES);
        let plan = planner.refresh(&o).unwrap();
        let roots = plan.roots();
        prop_assert_eq!(roots.len(), k);
        // Brute-force scores: the best tree delay for each candidate root.
        let best: Vec<f64> = (0..n)
            .map(|r| {
                all_spanning_trees(&o, r)
                    .iter()
                    .map(|t| t.sync_delay(&o, CHUNK_BYTES).unwrap())
                    .fold(f64::INFINITY, f64::min)
            })
            .collect();
        for &r in &roots {
            for v in (0..n).filter(|v| !roots.contains(v)) {
                prop_assert!(best[r] <= best[v] * (1.0 + 1e-9), "root {} ({}) worse than {} ({})", r, best[r], v, best[v]);
            }
        }
        for (t, s) in plan.trees.iter().zip(planner.roots().unwrap()) {
            prop_assert_eq!(t.root, s.node);
            prop_assert!(close(t.sync_delay, best[t.root]));
            prop_assert!(close(s.score, 1.0 / best[t.root]));
        }
        let initial = planner.roots().unwrap().to_vec();

        let mut changed = o.clone();
        for (i, link) in o.links().iter().enumerate() {
            let (a, b) = link.endpoints();
            changed.set_throughput(a, b, f64::from(new_rates[(2 * i) % 30]) * 3.0 * MBIT).unwrap();
            changed.set_throughput(b, a, f64::from(new_rates[(2 * i + 1) % 30]) * 3.0 * MBIT).unwrap();
        }
        let again = planner.refresh(&changed).unwrap();
        prop_assert_eq!(again.roots(), roots);
        prop_assert_eq!(planner.roots().unwrap(), initial.as_slice());
        for t in &again.trees {
            prop_assert_eq!(&t.tree, &fapt(&changed, t.root, CHUNK_BYTES).unwrap());
            prop_assert_eq!(t.sync_delay, t.tree.sync_delay(&changed, CHUNK_BYTES).unwrap());
        }
    }

    /// A link whose throughput collapses leaves every tree of the next refresh when another
    /// route exists.
    #[test]
    fn collapsed_link_is_avoided_at_the_next_refresh(o in overlays(), pick in any::<prop::sample::Index>()) {
        let mut planner = Planner::new(None, CHUNK_BYTES);
        let plan = planner.refresh(&o).unwrap();
        let used: BTreeSet<usize> = plan
            .trees
            .iter()
            .flat_map(|t| t.tree.edges().map(|(c, p)| o.link_between(c, p).unwrap().0).collect::<Vec<_>>())
            .collect();
        // Used links that are not bridges (the overlay stays connected without them).
        let candidates: Vec<usize> = used
            .into_iter()
            .filter(|&l| {
                let mut without = Overlay::new(o.num_nodes());
                for (i, link) in o.links().iter().enumerate() {
                    if i != l {
                        let (a, b) = link.endpoints();
                        without.add_link(a, b, link.min_throughput()).unwrap();
                    }
                }
                without.check_connected().is_ok()
            })
            .collect();
        prop_assume!(!candidates.is_empty());
        let victim = candidates[pick.index(candidates.len())];
        let (a, b) = o.links()[victim].endpoints();
        let mut dropped = o.clone();
        // 20 Mbit/s at worst per hop elsewhere; 10 kbit/s makes the link the slowest route.
        dropped.set_link_throughput(a, b, 10e3).unwrap();
        let next = planner.refresh(&dropped).unwrap();
        for t in &next.trees {
            prop_assert!(
                t.tree.edges().all(|(c, p)| (c.min(p), c.max(p)) != (a.min(b), a.max(b))),
                "tree rooted at {} still uses {}-{}", t.root, a, b
            );
        }
    }

    /// Algorithm 3: valid, pairwise edge-disjoint paths, sorted by delay, the first the
    /// fastest path, and no further path once they are all removed.
    #[test]
    fn auxiliary_paths_are_edge_disjoint_and_ranked(o in overlays()) {
        let n = o.num_nodes();
        let table = PathTable::compute(&o, CHUNK_BYTES);
        for u in 0..n {
            for v in (0..n).filter(|&v| v != u) {
                let paths = edge_disjoint_paths(&o, u, v, CHUNK_BYTES).unwrap();
                prop_assert_eq!(table.get(u, v), paths.as_slice());
                prop_assert!(!paths.is_empty());
                let fastest = o.shortest_paths_to(v, CHUNK_BYTES).unwrap();
                prop_assert_eq!(Some(paths[0].nodes.clone()), fastest.path(u));
                prop_assert_eq!(Some(paths[0].delay), fastest.delay(u));
                let mut seen = BTreeSet::new();
                for w in paths.windows(2) {
                    prop_assert!(w[0].delay <= w[1].delay);
                }
                for p in &paths {
                    prop_assert_eq!(p.nodes.first(), Some(&u));
                    prop_assert_eq!(p.nodes.last(), Some(&v));
                    let distinct: BTreeSet<_> = p.nodes.iter().collect();
                    prop_assert_eq!(distinct.len(), p.nodes.len(), "path revisits a node");
                    let mut sum = 0.0;
                    for hop in p.nodes.windows(2) {
                        let l = o.link_between(hop[0], hop[1]);
                        prop_assert!(l.is_some(), "hop {}-{} is not a link", hop[0], hop[1]);
                        prop_assert!(seen.insert(l.unwrap()), "link shared by two paths");
                        sum += o.transfer_delay(hop[0], hop[1], CHUNK_BYTES).unwrap();
                    }
                    prop_assert!(close(sum, p.delay));
                }
                // Maximal: without the used links, v is out of u's reach.
                let mut pruned = Overlay::new(n);
                for (i, link) in o.links().iter().enumerate() {
                    if !seen.iter().any(|l| l.0 == i) {
                        let (a, b) = link.endpoints();
                        pruned.add_link(a, b, link.min_throughput()).unwrap();
                    }
                }
                prop_assert_eq!(pruned.shortest_paths_to(v, CHUNK_BYTES).unwrap().delay(u), None);
            }
        }
    }

    /// Per tree edge, the auxiliary paths avoid the primary link and each other.
    #[test]
    fn tree_edge_auxiliary_paths_avoid_the_primary(o in overlays(), root in any::<prop::sample::Index>()) {
        let root = root.index(o.num_nodes());
        for tree in [fapt(&o, root, CHUNK_BYTES).unwrap(), star(o.num_nodes(), root).unwrap(), bkt(o.num_nodes(), root, 2).unwrap()] {
            let edges = tree_edge_paths(&o, &tree, CHUNK_BYTES).unwrap();
            prop_assert_eq!(edges.len(), o.num_nodes() - 1);
            for e in &edges {
                prop_assert_eq!(tree.parent(e.child), Some(e.parent));
                prop_assert_eq!(e.primary.first(), Some(&e.child));
                prop_assert_eq!(e.primary.last(), Some(&e.parent));
                let mut seen = BTreeSet::new();
                for hop in e.primary.windows(2) {
                    prop_assert!(seen.insert(o.link_between(hop[0], hop[1]).unwrap()));
                }
                for p in &e.auxiliary {
                    prop_assert_eq!(p.nodes.first(), Some(&e.child));
                    prop_assert_eq!(p.nodes.last(), Some(&e.parent));
                    for l in p.links(&o) {
                        prop_assert!(seen.insert(l), "auxiliary path shares a link");
                    }
                }
            }
        }
    }

    /// Chunk counts per root sum exactly and sit within one chunk of the exact quota.
    #[test]
    fn shares_are_exact_and_proportional(
        total in 0usize..500,
        scores in prop::collection::vec(prop_oneof![Just(0.0), 0.001f64..100.0], 1..10),
    ) {
        prop_assume!(total == 0 || scores.iter().any(|&s| s > 0.0));
        let counts = proportional_counts(total, &scores).unwrap();
        prop_assert_eq!(counts.iter().sum::<usize>(), total);
        let sum: f64 = scores.iter().sum();
        for (c, s) in counts.iter().zip(&scores) {
            if *s == 0.0 {
                prop_assert_eq!(*c, 0);
            } else {
                let quota = total as f64 * s / sum;
                prop_assert!((*c as f64 - quota).abs() < 1.0, "count {} quota {}", c, quota);
            }
        }
        let order = interleave(&counts);
        prop_assert_eq!(order.len(), total);
        for (slot, &c) in counts.iter().enumerate() {
            prop_assert_eq!(order.iter().filter(|&&s| s == slot).count(), c);
        }
    }

    /// Chunking covers each tensor exactly with chunks of at most CHUNK_SIZE, near-equal.
    #[test]
    fn chunks_cover_tensors(
        tensors in prop::collection::vec(0usize..5000, 0..12),
        chunk_size in 1usize..1200,
        scores in prop::collection::vec(0.01f64..10.0, 1..9),
    ) {
        let chunks = assign_chunks(&tensors, chunk_size, &scores).unwrap();
        for (t, &elems) in tensors.iter().enumerate() {
            let mine: Vec<_> = chunks.iter().filter(|c| c.tensor == t).collect();
            prop_assert_eq!(mine.len(), elems.div_ceil(chunk_size));
            let mut next = 0;
            for c in &mine {
                prop_assert_eq!(c.range.start, next);
                prop_assert!(!c.range.is_empty() && c.range.len() <= chunk_size);
                prop_assert!(c.slot < scores.len());
                next = c.range.end;
            }
            prop_assert_eq!(next, elems);
            if let (Some(min), Some(max)) = (mine.iter().map(|c| c.range.len()).min(), mine.iter().map(|c| c.range.len()).max()) {
                prop_assert!(max - min <= 1);
            }
            prop_assert_eq!(chunk_ranges(elems, chunk_size).unwrap(), mine.iter().map(|c| c.range.clone()).collect::<Vec<_>>());
        }
        let counts = proportional_counts(chunks.len(), &scores).unwrap();
        for (slot, &c) in counts.iter().enumerate() {
            prop_assert_eq!(chunks.iter().filter(|x| x.slot == slot).count(), c);
        }
    }

    /// STAR is one level; BKT is a heap of arity k with the root first, of minimal height.
    #[test]
    fn star_and_bkt_shapes(n in 1usize..40, root in any::<prop::sample::Index>(), k in 1usize..6) {
        let root = root.index(n);
        let s = star(n, root).unwrap();
        prop_assert_eq!(s.root(), root);
        prop_assert!(s.edges().all(|(_, p)| p == root));
        prop_assert_eq!(s.height(), usize::from(n > 1));

        let t = bkt(n, root, k).unwrap();
        prop_assert_eq!(t.root(), root);
        let order: Vec<usize> = std::iter::once(root).chain((0..n).filter(|&v| v != root)).collect();
        for (pos, &v) in order.iter().enumerate().skip(1) {
            prop_assert_eq!(t.parent(v), Some(order[(pos - 1) / k]));
        }
        for v in 0..n {
            prop_assert!(t.children(v).len() <= k);
        }
        // Minimal height: the smallest h with 1 + k + ... + k^h >= n.
        let (mut h, mut capacity, mut level) = (0, 1usize, 1usize);
        while capacity < n {
            level *= k;
            capacity += level;
            h += 1;
        }
        prop_assert_eq!(t.height(), h);
    }
}

/// Figure 1's point on a constructed overlay: a chain of fast links (which the MST takes)
/// against slower direct links to the root (which the FAPT mostly takes, because aggregation
/// waits for the slowest leaf-to-root sum); BKT ignores the links, and STAR is stuck with the
/// last site's very slow direct link.
#[test]
fn fapt_beats_mst_bkt_and_star_on_a_figure_1_style_overlay() {
    let mut o = Overlay::with_names(["root", "a", "b", "c", "d"]).unwrap();
    // Chain root-a-b-c-d at 100 Mbit/s; b and c also reach the root directly at 50 Mbit/s,
    // d at 10 Mbit/s.
    for v in 1..5 {
        o.add_link(v - 1, v, 100.0 * MBIT).unwrap();
    }
    o.add_link(0, 2, 50.0 * MBIT).unwrap();
    o.add_link(0, 3, 50.0 * MBIT).unwrap();
    o.add_link(0, 4, 10.0 * MBIT).unwrap();
    // 12.5 MB: 1 s over 100 Mbit/s, 2 s over 50 Mbit/s, 10 s over 10 Mbit/s.
    let bytes = 12_500_000;
    let delay = |t: &Tree| t.sync_delay(&o, bytes).unwrap();

    let f = fapt(&o, 0, bytes).unwrap();
    // b ties (2 s direct or via a) and takes the direct link (fewer hops); d goes via c.
    assert_eq!(f.parents(), &[None, Some(0), Some(0), Some(0), Some(3)]);
    assert!(close(delay(&f), 3.0));

    let m = mst(&o, 0).unwrap();
    assert_eq!(m.parents(), &[None, Some(0), Some(1), Some(2), Some(3)]);
    assert!(close(delay(&m), 4.0));

    // BKT: a, b under the root; c, d under a, which no link joins them to: c -> a costs the
    // fastest path c-b-a (2 s), d -> a costs d-c-b-a (3 s).
    let b = bkt(5, 0, 2).unwrap();
    assert_eq!(b.parents(), &[None, Some(0), Some(0), Some(1), Some(1)]);
    assert!(close(delay(&b), 4.0));

    let s = star(5, 0).unwrap();
    assert!(close(delay(&s), 10.0));

    assert!(delay(&f) < delay(&m) && delay(&f) < delay(&b) && delay(&f) < delay(&s));
    // And the single-root planner, asked for one root, prefers a better-placed one.
    let plan = Planner::new(Some(1), bytes).refresh(&o).unwrap();
    assert!(plan.cost() <= delay(&f));
}

/// The scenario of the WAN test, without a network: a link in use collapses, and the next
/// refresh routes around it while the roots stay.
#[test]
fn a_collapsed_link_is_routed_around_with_the_same_roots() {
    let mut o = Overlay::new(4);
    o.add_link(0, 1, 100.0 * MBIT).unwrap();
    o.add_link(1, 2, 100.0 * MBIT).unwrap();
    o.add_link(2, 3, 100.0 * MBIT).unwrap();
    o.add_link(3, 0, 60.0 * MBIT).unwrap();
    let before = o.clone();
    let mut planner = Planner::new(Some(2), CHUNK_BYTES);
    let first = planner.refresh(&o).unwrap();
    assert!(first
        .trees
        .iter()
        .any(|t| t.tree.parent(1) == Some(0) || t.tree.parent(0) == Some(1)));
    o.set_link_throughput(0, 1, 1.0 * MBIT).unwrap();
    // The collector's check with the default UPDATE_RATE (0: any change is significant).
    let change = o.max_relative_change(&before).unwrap();
    assert!(NetStormConfig::default().is_significant_change(change));
    let second = planner.refresh(&o).unwrap();
    assert_eq!(second.roots(), first.roots());
    for t in &second.trees {
        assert!(t.tree.parent(1) != Some(0) && t.tree.parent(0) != Some(1));
        assert!(t.sync_delay > 0.0);
    }
}
