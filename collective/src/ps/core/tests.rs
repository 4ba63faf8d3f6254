//! The aggregator and its helpers, with no I/O: driven by events and a clock passed in.

use super::*;
use crate::aggregate::test_bytes::{f32_bytes, f32_of};
use proptest::prelude::*;

#[test]
fn the_loss_bound_is_split_over_the_hops() {
    let p = LossBound::from_fraction(0.05).unwrap();
    assert_eq!(hop_bound(p, 1), p);
    assert_eq!(hop_bound(p, 2).ppm(), 25_000);
    assert_eq!(hop_bound(p, 0), p);
    assert_eq!(hop_bound(LossBound::RELIABLE, 3), LossBound::RELIABLE);
    // Too small to split: reliable, never more loss than asked for.
    assert_eq!(
        hop_bound(LossBound::from_ppm(2).unwrap(), 3),
        LossBound::RELIABLE
    );
}

#[test]
fn the_update_is_exact_for_small_values() {
    let mut w = f32_bytes(&[1.0, -2.0, 3.5]);
    apply_update(DType::F32, &mut w, &f32_bytes(&[0.5, 1.0, -2.0]), 0.5).unwrap();
    assert_eq!(f32_of(&w), vec![0.75, -2.5, 4.5]);
    let mut h: Vec<u8> = [half::f16::from_f32(1.0), half::f16::from_f32(4.0)]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let g: Vec<u8> = [half::f16::from_f32(2.0), half::f16::from_f32(-1.0)]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    apply_update(DType::F16, &mut h, &g, 0.25).unwrap();
    assert_eq!(half::f16::from_le_bytes([h[0], h[1]]).to_f32(), 0.5);
    assert_eq!(half::f16::from_le_bytes([h[2], h[3]]).to_f32(), 4.25);
    assert!(apply_update(DType::F32, &mut w, &[0u8; 4], 1.0).is_err());
}

#[test]
fn sets_must_stay_inside_the_subtree() {
    let world = 6;
    let mut allowed = Contributors::none(1, world);
    allowed.insert(0, 2);
    allowed.insert(0, 4);
    let mut sets = Contributors::none(3, world);
    sets.insert(0, 2);
    sets.insert(1, 4);
    sets.insert(1, 2);
    assert!(sets_within(&sets, &allowed));
    sets.insert(2, 5);
    assert!(!sets_within(&sets, &allowed));
}

proptest! {
    /// Whatever order and loss versions arrive with, each block holds the newest
    /// version whose block reached it, and never goes back.
    #[test]
    fn merge_keeps_the_newest_block_that_arrived(
        arrivals in proptest::collection::vec(
            (0u64..20, proptest::collection::vec(any::<bool>(), 4)), 0..30),
    ) {
        let (bb, blocks) = (8usize, 4usize);
        let value = |clock: u64, b: usize| (clock * 10 + b as u64) as f32;
        let mut w = vec![0u8; bb * blocks];
        let mut have = vec![0u64; blocks];
        let mut best: Vec<Option<u64>> = vec![None; blocks];
        for (clock, arrived) in arrivals {
            let incoming = f32_bytes(
                &(0..blocks).flat_map(|b| [value(clock, b); 2]).collect::<Vec<_>>(),
            );
            let before = have.clone();
            merge_blocks(&mut w, &mut have, &incoming, &vec![clock; blocks], &arrived, bb);
            for b in 0..blocks {
                if arrived[b] {
                    best[b] = best[b].max(Some(clock));
                }
                prop_assert!(have[b] >= before[b]);
                prop_assert_eq!(have[b], best[b].map_or(0, |c| c + 1));
                if let Some(c) = best[b] {
                    prop_assert_eq!(f32_of(&w[b * bb..(b + 1) * bb]), vec![value(c, b); 2]);
                }
            }
        }
    }
}

// The aggregator driven by events alone: what it sends is its outbox.

use crate::ps::repair::fault_tolerant_edges;
use crate::ps::state::Ctx;
use crate::ps::types::PsConfig;
use crate::tree::Strategy;
use gradwire::transport::TransferConfig;

const ELEMS: usize = 10;

fn binary7() -> Tree {
    let members: Vec<usize> = (0..7).collect();
    Tree::build(Strategy::BINARY, 0, &members, &[0; 7]).unwrap()
}

/// Rank `rank`'s context on `t` with every spare link, a zero model of `ELEMS` f32 in blocks
/// of 4.
fn ctx_of(t: &Tree, rank: usize, cfg: &PsConfig) -> Ctx {
    let peers = fault_tolerant_edges(t)
        .into_iter()
        .filter(|&(a, _)| a == rank)
        .map(|(_, b)| b)
        .collect();
    let model = Tensor::from_f32(&[0.0; ELEMS]);
    Ctx::new(
        rank,
        t.len(),
        1,
        t.clone(),
        peers,
        &model,
        4,
        cfg,
        TransferConfig::default(),
    )
}

fn cfg() -> PsConfig {
    PsConfig {
        learning_rate: 0.5,
        keep_updates: 8,
        ..PsConfig::default()
    }
}

/// Child `c`'s sum: `v` in every element, its whole subtree in every block.
fn child_sum(ctx: &Ctx, c: usize, v: f32) -> Option<ChildSum> {
    let blocks = ctx.blocks();
    let mut sets = Contributors::none(blocks, ctx.world);
    for b in 0..blocks {
        sets.unite(b, &ctx.subtree0[c], 0);
    }
    Some(ChildSum {
        values: Tensor::from_f32(&[v; ELEMS]),
        sets,
        arrived: vec![true; blocks],
    })
}

fn child(ctx: &Ctx, c: usize, clock: u64, v: f32) -> AggIn {
    AggIn::Child {
        peer: c,
        epoch: 0,
        clock,
        sum: child_sum(ctx, c, v),
    }
}

/// The pushes in an outbox: `(to, clock, tree version, values)`.
fn pushes(out: &[(usize, Out)]) -> Vec<(usize, u64, u64, Option<Vec<f32>>)> {
    out.iter()
        .filter_map(|(to, m)| match m {
            Out::Push(p, epoch) => Some((
                *to,
                p.clock,
                *epoch,
                p.values.as_ref().map(|v| v.as_f32().unwrap().to_vec()),
            )),
            _ => None,
        })
        .collect()
}

fn interior(t: &Tree) -> (usize, Vec<usize>) {
    let d = t.children(t.root())[0];
    (d, t.children(d).to_vec())
}

#[test]
fn a_worker_sends_one_sum_per_clock_once_its_own_push_and_every_child_are_in() {
    let t = binary7();
    let (w, kids) = interior(&t);
    let ctx = ctx_of(&t, w, &cfg());
    let mut agg = Agg::new(&ctx, ctx.peers.clone());
    // Any order: a child, the worker's own push, the other child.
    agg.handle(child(&ctx, kids[1], 0, 2.0));
    agg.handle(AggIn::Own {
        clock: 0,
        grads: Some(Tensor::from_f32(&[1.0; ELEMS])),
    });
    assert!(pushes(&agg.outbox).is_empty(), "clock 0 is not complete");
    agg.handle(child(&ctx, kids[0], 0, 3.0));
    // Reliable, the whole subtree in every block: the sets are implied, not sent.
    let sent = pushes(&std::mem::take(&mut agg.outbox));
    assert_eq!(sent, vec![(t.root(), 0, 0, Some(vec![6.0; ELEMS]))]);
    // A child's sum for a clock that is not due is a protocol error naming the child.
    agg.handle(child(&ctx, kids[0], 2, 1.0));
    assert!(agg.broken);
    let st = ctx.shared.lock();
    assert!(
        matches!(&st.error, Some(PsError::Protocol { peer, .. }) if *peer == kids[0]),
        "{:?}",
        st.error
    );
}

#[test]
fn the_server_applies_the_exact_average_and_sends_the_version_to_its_children() {
    let t = binary7();
    let ctx = ctx_of(&t, 0, &cfg());
    let mut agg = Agg::new(&ctx, ctx.peers.clone());
    let kids = t.children(0).to_vec();
    // Each child's sum holds one gradient of 1.0 per worker of its subtree.
    for &c in &kids {
        let n = ctx.subtree0[c].count(0) as f32;
        agg.handle(child(&ctx, c, 0, n));
    }
    let st = ctx.shared.lock();
    assert_eq!(st.cache.weights_clock(), Some(1));
    // Average 1.0 over the 6 workers, learning rate 0.5.
    assert_eq!(st.weights.as_f32().unwrap(), &[-0.5; ELEMS]);
    assert_eq!(st.updates.len(), 1);
    assert_eq!(st.updates[0].complete_blocks, ctx.blocks());
    drop(st);
    let versions: Vec<(usize, u64)> = agg
        .outbox
        .iter()
        .filter_map(|(to, m)| match m {
            Out::Weights(v) => Some((*to, v.clock)),
            _ => None,
        })
        .collect();
    assert_eq!(versions, kids.iter().map(|&c| (c, 1)).collect::<Vec<_>>());
}

#[test]
fn the_server_routes_around_a_dead_aggregator_then_falls_back_to_star() {
    let t = binary7();
    let ctx = ctx_of(&t, 0, &cfg());
    let mut agg = Agg::new(&ctx, ctx.peers.clone());
    let (d, orphans) = interior(&t);
    // The server got d's sum of clock 0 (its whole subtree), then d died.
    agg.handle(child(&ctx, d, 0, 3.0));
    agg.outbox.clear();
    agg.handle(AggIn::Down {
        peer: d,
        reason: "silent".into(),
    });
    let out = std::mem::take(&mut agg.outbox);
    // Every other live link hears of the dead rank ...
    let told: Vec<usize> = out
        .iter()
        .filter(|(_, m)| matches!(m, Out::Tree(dead) if **dead == vec![d]))
        .map(|(to, _)| *to)
        .collect();
    assert_eq!(told, (1..7).filter(|&r| r != d).collect::<Vec<_>>());
    // ... and d's children are adopted from clock 1: d's sum of clock 0 held theirs.
    let adopted: Vec<(usize, u64, u64)> = out
        .iter()
        .filter_map(|(to, m)| match m {
            Out::Adopt { version, from } => Some((*to, *version, *from)),
            _ => None,
        })
        .collect();
    assert_eq!(
        adopted,
        orphans.iter().map(|&c| (c, 1, 1)).collect::<Vec<_>>()
    );
    {
        let st = ctx.shared.lock();
        assert_eq!(
            (st.dead.clone(), st.tree_version, st.fell_back),
            (vec![d], 1, false)
        );
    }
    // A second failure (max_reparents 1): STAR, every worker adopted from the next clock.
    let other = t.children(0)[1];
    agg.handle(AggIn::Down {
        peer: other,
        reason: "closed".into(),
    });
    let adopted: BTreeSet<usize> = agg
        .outbox
        .iter()
        .filter_map(|(to, m)| {
            matches!(
                m,
                Out::Adopt {
                    version: 2,
                    from: 0
                }
            )
            .then_some(*to)
        })
        .collect();
    let survivors: BTreeSet<usize> = (1..7).filter(|&r| r != d && r != other).collect();
    assert_eq!(adopted, survivors);
    assert!(ctx.shared.lock().fell_back);
}

#[test]
fn an_orphan_resends_the_sums_its_dead_parent_did_not_pass_on() {
    let t = binary7();
    let (d, kids) = interior(&t);
    let leaf = kids[0];
    let ctx = ctx_of(&t, leaf, &cfg());
    let mut agg = Agg::new(&ctx, ctx.peers.clone());
    for c in 0..2 {
        agg.handle(AggIn::Own {
            clock: c,
            grads: Some(Tensor::from_f32(&[c as f32 + 1.0; ELEMS])),
        });
    }
    let sent: Vec<(usize, u64)> = pushes(&std::mem::take(&mut agg.outbox))
        .into_iter()
        .map(|p| (p.0, p.1))
        .collect();
    assert_eq!(sent, vec![(d, 0), (d, 1)]);
    // The server says d is dead: the leaf detaches and keeps its sums ...
    agg.handle(AggIn::Tree(vec![d]));
    assert!(pushes(&agg.outbox).is_empty());
    // ... until the grandparent adopts it from clock 1 (d passed clock 0 on): clock 1 again,
    // stamped with the new tree version.
    agg.handle(AggIn::Adopt {
        peer: t.root(),
        version: 1,
        from: 1,
    });
    assert_eq!(
        pushes(&agg.outbox),
        vec![(t.root(), 1, 1, Some(vec![2.0; ELEMS]))]
    );
}

#[test]
fn heartbeats_go_to_links_idle_for_a_period_on_a_virtual_clock() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let mut b = Beats::new(Duration::from_millis(200), &[1, 2], t0);
    assert_eq!(b.next(), Some(ms(200)));
    assert!(b.due(ms(100)).is_empty());
    b.sent(1, ms(150));
    assert_eq!(b.due(ms(200)), vec![2]);
    // An earlier time than a link's last message changes nothing.
    b.sent(1, ms(50));
    assert!(b.due(ms(300)).is_empty());
    assert_eq!(b.next(), Some(ms(350)));
    assert_eq!(b.due(ms(350)), vec![1]);
    assert_eq!(b.due(ms(400)), vec![2]);
    // An ended link gets none.
    b.stop(2);
    assert_eq!(b.due(ms(10_000)), vec![1]);
    b.stop(1);
    assert_eq!(b.next(), None);
    assert!(b.due(ms(20_000)).is_empty());
}

#[test]
fn a_link_heard_from_then_silent_for_the_timeout_has_failed_on_a_virtual_clock() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let mut l = Liveness::new(Duration::from_millis(1_000));
    // Never heard from: the set-up and the layer judge it, not this.
    assert!(l.silent(ms(5_000)).is_empty());
    l.heard(1, ms(5_000), false);
    l.heard(2, ms(5_000), false);
    l.heard(1, ms(5_800), false);
    assert_eq!(l.silent(ms(6_000)), vec![2]);
    // Reported once.
    assert!(l.silent(ms(6_100)).is_empty());
    // A message's data on the way: the layer watches its progress, however long it takes.
    l.heard(1, ms(6_200), true);
    assert!(l.silent(ms(60_000)).is_empty());
    l.heard(1, ms(60_000), false);
    assert!(l.silent(ms(60_999)).is_empty());
    assert_eq!(l.silent(ms(61_000)), vec![1]);
    // An ended link is never reported, even if something late arrives on it.
    l.heard(3, ms(61_000), false);
    l.stop(3);
    l.heard(3, ms(61_500), false);
    assert!(l.silent(ms(99_000)).is_empty());
}
