//! The parameter server over in-memory links (every rank a thread): synchronous runs are
//! exact on STAR and BINARY trees, a stale-synchronous run keeps every pull within the bound
//! and still ends at the exact result, bounded loss averages each block over the workers
//! the server names, and dead or missing ranks are errors naming them, never hangs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gradwire::datapath::fault::FaultConfig;
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire_collective::link::{tree_edges, Links, MemLinkConfig};
use gradwire_collective::ps::{PsConfig, PsError, PsNode, PsStats, PullReport};
use gradwire_collective::tree::{Strategy, Tree};
use half::f16;

mod common;
use common::{grad, initial, replay, Pace, LR};

const JOB: u32 = 11;

fn f32_tensor(v: &[f32]) -> Tensor {
    Tensor::from_f32(v)
}

fn grads(r: usize, c: u64, elems: usize) -> Vec<f32> {
    (0..elems).map(|e| grad(r, c, e)).collect()
}

fn values(t: &Tensor) -> Vec<f32> {
    match t.dtype() {
        DType::F32 => t.as_f32().unwrap().to_vec(),
        DType::F16 => t.as_f16().unwrap().iter().map(|x| x.to_f32()).collect(),
        _ => unreachable!(),
    }
}

/// The exact weights after each clock when every worker's gradients are applied:
/// `w[c + 1] = w[c] - LR * mean over workers of grad(r, c)`.
fn trajectory(workers: &[usize], clocks: u64, elems: usize) -> Vec<Vec<f32>> {
    let mut out = vec![initial(elems)];
    for c in 0..clocks {
        let prev = out.last().unwrap();
        let next = (0..elems)
            .map(|e| {
                let sum: f32 = workers.iter().map(|&r| grad(r, c, e)).sum();
                prev[e] - LR * (sum / workers.len() as f32)
            })
            .collect();
        out.push(next);
    }
    out
}

fn tree(strategy: Strategy, world: usize) -> Tree {
    let members: Vec<usize> = (0..world).collect();
    Tree::build(strategy, 0, &members, &vec![0; world]).unwrap()
}

fn cfg() -> PsConfig {
    let mut c = PsConfig {
        learning_rate: LR,
        op_timeout: Duration::from_secs(10),
        keep_updates: 64,
        ..PsConfig::default()
    };
    c.transfer.sender = gradwire::flow::SenderConfig::new(2_000_000_000);
    c
}

fn links(tree: &Tree, world: usize, fault: Option<FaultConfig>) -> Vec<Links> {
    Links::in_memory(
        world,
        &tree_edges(tree),
        &MemLinkConfig {
            fault,
            ..MemLinkConfig::default()
        },
    )
    .unwrap()
}

/// Start a node on every rank of `tree` (one thread each) and run `f` on it.
fn run_job<T: Send>(
    tree: &Tree,
    world: usize,
    fault: Option<FaultConfig>,
    cfg: &PsConfig,
    initial: &Tensor,
    f: impl Fn(PsNode) -> T + Sync,
) -> Vec<T> {
    let links = links(tree, world, fault);
    std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .map(|l| {
                let f = &f;
                s.spawn(move || {
                    let node = PsNode::start(l, tree.clone(), JOB, initial, cfg.clone()).unwrap();
                    f(node)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

enum Outcome {
    Server {
        clock: u64,
        weights: Vec<f32>,
        stats: PsStats,
    },
    Worker {
        rank: usize,
        pulls: Vec<(PullReport, Vec<f32>)>,
        stats: PsStats,
    },
}

/// Every worker: `clocks` iterations of (pull, push, clock), then a final synchronous pull.
/// The server waits for the last clock. `slow`: a worker held back by `pace` before each
/// push; `started[r]`: pushes worker `r` has begun.
#[allow(clippy::too_many_arguments)]
fn iterate(
    mut node: PsNode,
    clocks: u64,
    elems: usize,
    slow: Option<usize>,
    pace: Option<&Pace>,
    started: &[AtomicU64],
    max_lead: &AtomicI64,
) -> Outcome {
    if node.is_server() {
        let clock = node.wait_clock(clocks, Duration::from_secs(20)).unwrap();
        let (c, w) = node.weights();
        assert_eq!(c, clock);
        let stats = node.shutdown().unwrap();
        return Outcome::Server {
            clock,
            weights: values(&w),
            stats,
        };
    }
    let r = node.rank();
    let mut w = Tensor::zeros(DType::F32, elems);
    let mut pulls = Vec::new();
    for c in 0..clocks {
        let rep = node.pull(&mut w, None).unwrap();
        // The staleness bound, on every pull.
        assert!(
            pull_ok(rep.weights_clock, node.worker_clock(), 2),
            "rank {r}: {rep:?} at clock {}",
            node.worker_clock()
        );
        if let Some(slow) = slow {
            if r != slow {
                let lead = c as i64 - started[slow].load(Ordering::SeqCst) as i64;
                max_lead.fetch_max(lead, Ordering::SeqCst);
                if let Some(p) = pace {
                    p.pulled(r, c);
                }
            } else if let Some(p) = pace {
                p.hold(c);
            }
        }
        pulls.push((rep, values(&w)));
        started[r].store(c + 1, Ordering::SeqCst);
        node.push(&f32_tensor(&grads(r, c, elems))).unwrap();
        assert_eq!(node.clock(), c + 1);
    }
    let rep = node.pull(&mut w, Some(0)).unwrap();
    pulls.push((rep, values(&w)));
    let stats = node.shutdown().unwrap();
    Outcome::Worker {
        rank: r,
        pulls,
        stats,
    }
}

fn pull_ok(weights_clock: u64, c_worker: u64, s: u64) -> bool {
    weights_clock + s >= c_worker
}

#[test]
fn synchronous_runs_are_exact_on_star_and_binary_trees() {
    let (world, clocks, elems) = (5, 5, 3_000);
    let want = trajectory(&[1, 2, 3, 4], clocks, elems);
    let started: Vec<AtomicU64> = (0..world).map(|_| AtomicU64::new(0)).collect();
    let lead = AtomicI64::new(0);
    for strategy in [Strategy::Star, Strategy::BINARY] {
        let t = tree(strategy, world);
        let out = run_job(
            &t,
            world,
            None,
            &cfg(),
            &f32_tensor(&initial(elems)),
            |node| iterate(node, clocks, elems, None, None, &started, &lead),
        );
        for o in out {
            match o {
                Outcome::Server {
                    clock,
                    weights,
                    stats,
                } => {
                    assert_eq!(clock, clocks);
                    assert_eq!(weights, want[clocks as usize], "{strategy}: server");
                    assert_eq!(stats.updates_applied, clocks);
                    assert_eq!(stats.updates.len(), clocks as usize);
                    for u in &stats.updates {
                        assert_eq!(u.complete_blocks, u.contributors.blocks());
                        assert_eq!(u.delivered_fraction, 1.0);
                    }
                    assert_eq!(stats.dropped_clocks, 0);
                }
                Outcome::Worker { rank, pulls, stats } => {
                    assert_eq!(pulls.len(), clocks as usize + 1);
                    for (c, (rep, w)) in pulls.iter().enumerate() {
                        // s = 0: the pull at clock c returns exactly version c.
                        assert_eq!(rep.weights_clock, c as u64, "{strategy}: rank {rank}");
                        assert_eq!(rep.delivered_fraction, 1.0);
                        assert_eq!(w, &want[c], "{strategy}: rank {rank} clock {c}");
                    }
                    assert_eq!((stats.pushes, stats.pulls), (clocks, clocks + 1));
                    assert_eq!(stats.sums_sent, clocks);
                    assert_eq!(stats.dropped_clocks, 0);
                }
            }
        }
    }
}

#[test]
fn half_precision_models_are_exact_too() {
    let (world, clocks, elems) = (5, 3, 2_000);
    let want = trajectory(&[1, 2, 3, 4], clocks, elems);
    let t = tree(Strategy::BINARY, world);
    let half = |v: &[f32]| {
        let mut t = Tensor::zeros(DType::F16, v.len());
        for (d, &x) in t.as_f16_mut().unwrap().iter_mut().zip(v) {
            *d = f16::from_f32(x);
        }
        t
    };
    let out = run_job(
        &t,
        world,
        None,
        &cfg(),
        &half(&initial(elems)),
        |mut node| {
            if node.is_server() {
                node.wait_clock(clocks, Duration::from_secs(20)).unwrap();
                let w = values(&node.weights().1);
                node.shutdown().unwrap();
                return w;
            }
            let r = node.rank();
            let mut w = Tensor::zeros(DType::F16, elems);
            for c in 0..clocks {
                assert_eq!(node.pull(&mut w, None).unwrap().weights_clock, c);
                assert_eq!(values(&w), want[c as usize]);
                node.push(&half(&grads(r, c, elems))).unwrap();
                node.clock();
            }
            node.pull(&mut w, None).unwrap();
            node.shutdown().unwrap();
            values(&w)
        },
    );
    for w in out {
        assert_eq!(w, want[clocks as usize]);
    }
}

#[test]
fn stale_synchronous_pulls_stay_within_the_bound_and_end_exact() {
    let (world, clocks, elems) = (5, 8, 2_000);
    let want = trajectory(&[1, 2, 3, 4], clocks, elems);
    let slow = 4;
    for strategy in [Strategy::Star, Strategy::BINARY] {
        let started: Vec<AtomicU64> = (0..world).map(|_| AtomicU64::new(0)).collect();
        let max_lead = AtomicI64::new(i64::MIN);
        let t = tree(strategy, world);
        let c = PsConfig {
            staleness: 2,
            ..cfg()
        };
        let pace = Pace::new(world, vec![1, 2, 3], 2, clocks);
        let out = run_job(&t, world, None, &c, &f32_tensor(&initial(elems)), |node| {
            iterate(
                node,
                clocks,
                elems,
                Some(slow),
                Some(&pace),
                &started,
                &max_lead,
            )
        });
        for o in out {
            match o {
                Outcome::Server { weights, .. } => {
                    // Whoever was fast, each clock's sum is the same: the exact result.
                    assert_eq!(weights, want[clocks as usize], "{strategy}: server");
                }
                Outcome::Worker { rank, pulls, .. } => {
                    for (c, (rep, w)) in pulls.iter().enumerate() {
                        let c = c as u64;
                        let s = if c == clocks { 0 } else { 2 };
                        assert!(pull_ok(rep.weights_clock, c, s), "rank {rank}: {rep:?}");
                        assert!(rep.weights_clock <= clocks);
                        // Whatever version came, it is exactly that version.
                        assert_eq!(w, &want[rep.weights_clock as usize], "rank {rank}");
                    }
                    assert_eq!(pulls.last().unwrap().0.weights_clock, clocks);
                }
            }
        }
        // A fast worker ran ahead of the slow one by exactly s = 2 clocks: the slow worker
        // holds its push of clock c until the fast ones have pulled at c + s, so a lead of s
        // is certain, and the bound allows no more. Less means pulls were served fresher
        // than s allows (a bound off by one, or silently synchronous).
        let lead = max_lead.load(Ordering::SeqCst);
        assert!(lead <= 2, "{strategy}: a worker ran {lead} clocks ahead");
        assert_eq!(
            lead, 2,
            "{strategy}: no worker ever ran the full s = 2 ahead"
        );
    }
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-4 * b.abs().max(1.0)
}

#[test]
fn with_loss_every_block_is_averaged_over_the_workers_named() {
    let (world, clocks, elems) = (5, 4, 20_000);
    let mut incomplete = 0;
    for strategy in [Strategy::Star, Strategy::BINARY] {
        let t = tree(strategy, world);
        // 4 % of the data segments arriving at every node are dropped (the links carry only
        // the set-up; the nodes' message-layer endpoints carry everything else).
        let c = PsConfig {
            loss_bound: LossBound::from_fraction(0.05).unwrap(),
            inject_loss: 0.04,
            ..cfg()
        };
        let block_elems = AtomicU64::new(0);
        let out = run_job(
            &t,
            world,
            None,
            &c,
            &f32_tensor(&initial(elems)),
            |mut node| {
                block_elems.store(node.block_elems() as u64, Ordering::SeqCst);
                if node.is_server() {
                    node.wait_clock(clocks, Duration::from_secs(20)).unwrap();
                    let w = values(&node.weights().1);
                    let stats = node.shutdown().unwrap();
                    return (w, Vec::new(), stats);
                }
                let r = node.rank();
                let mut w = Tensor::zeros(DType::F32, elems);
                let mut pulls = Vec::new();
                for c in 0..clocks {
                    let rep = node.pull(&mut w, None).unwrap();
                    pulls.push((rep, values(&w)));
                    node.push(&f32_tensor(&grads(r, c, elems))).unwrap();
                    node.clock();
                }
                let rep = node.pull(&mut w, None).unwrap();
                pulls.push((rep, values(&w)));
                let stats = node.shutdown().unwrap();
                (Vec::new(), pulls, stats)
            },
        );
        let be = block_elems.load(Ordering::SeqCst) as usize;
        let server = out.iter().find(|o| o.2.server).unwrap();
        let updates = &server.2.updates;
        assert_eq!(updates.len(), clocks as usize);
        for u in updates {
            // Each worker's gradients reach at least 95 % of the blocks (the bound is end to
            // end: each hop of the tree gets its share).
            assert!(u.delivered_fraction >= 0.95, "{strategy}: {u:?}");
            incomplete += u.contributors.blocks() - u.complete_blocks;
        }
        let versions = replay(updates, be, elems);
        let last = &versions[clocks as usize];
        for (e, (&got, &want)) in server.0.iter().zip(last).enumerate() {
            assert!(
                close(got, want),
                "{strategy}: server element {e}: {got} != {want}"
            );
        }
        for (_, pulls, stats) in out.iter().filter(|o| !o.2.server) {
            for (c, (rep, w)) in pulls.iter().enumerate() {
                assert!(
                    rep.delivered_fraction >= 0.95,
                    "{strategy}: rank {}: {rep:?}",
                    stats.rank
                );
                // s = 0: still exactly version c (versions only come from whole clocks).
                assert_eq!(rep.weights_clock, c as u64);
                // Each block holds that version's values, or (lost on the way) an older
                // version's; the fraction at exactly that version is what the report says.
                let v = rep.weights_clock as usize;
                let mut exact = 0;
                for (b, block) in w.chunks(be).enumerate() {
                    let at = |k: usize| {
                        block
                            .iter()
                            .zip(&versions[k][b * be..])
                            .all(|(&x, &y)| x.is_finite() && close(x, y))
                    };
                    if at(v) {
                        exact += 1;
                    } else {
                        assert!(
                            (0..v).any(at),
                            "{strategy}: rank {} block {b} of version {v} matches no version",
                            stats.rank
                        );
                    }
                }
                let blocks = w.len().div_ceil(be);
                assert!(exact as f64 / blocks as f64 >= rep.delivered_fraction - 1e-9);
            }
        }
    }
    assert!(
        incomplete > 0,
        "the injected loss reached no gradient block"
    );
}

#[test]
fn a_clock_without_a_push_contributes_nothing() {
    let (world, elems) = (4, 1_000);
    // 0 -> {1, 2}, 1 -> {3}: rank 1 (an aggregator) skips its push of clock 0.
    let t = tree(Strategy::BINARY, world);
    assert!(!t.children(1).is_empty() || !t.children(2).is_empty());
    let skipper = (1..world).find(|&r| !t.children(r).is_empty()).unwrap();
    let pushers: Vec<usize> = (1..world).filter(|&r| r != skipper).collect();
    let want = trajectory(&pushers, 1, elems);
    let out = run_job(
        &t,
        world,
        None,
        &cfg(),
        &f32_tensor(&initial(elems)),
        |mut node| {
            if node.is_server() {
                node.wait_clock(1, Duration::from_secs(20)).unwrap();
                let w = values(&node.weights().1);
                let stats = node.shutdown().unwrap();
                assert_eq!(stats.updates[0].contributors.ranks(0), pushers);
                return w;
            }
            let r = node.rank();
            let mut w = Tensor::zeros(DType::F32, elems);
            node.pull(&mut w, None).unwrap();
            if r != skipper {
                node.push(&f32_tensor(&grads(r, 0, elems))).unwrap();
            }
            node.clock();
            node.pull(&mut w, None).unwrap();
            let stats = node.shutdown().unwrap();
            assert_eq!(stats.empty_clocks, u64::from(r == skipper));
            values(&w)
        },
    );
    for w in out {
        assert_eq!(w, want[1]);
    }
}

/// A failed rank is an error here (no route-around, see `tests/ps_failures.rs` for that).
fn short_cfg() -> PsConfig {
    let mut c = cfg();
    c.reroute = false;
    c.op_timeout = Duration::from_secs(2);
    c.transfer.idle_timeout = Duration::from_secs(2);
    c
}

/// A worker whose process never starts (`drop_links`: its links are gone too; otherwise
/// they exist but nobody serves them): the others fail naming a rank or a timeout, in
/// bounded time.
fn missing_worker(drop_links: bool) {
    let world = 5;
    let elems = 500;
    let t = tree(Strategy::Star, world);
    let mut all = links(&t, world, None);
    let held = all.remove(3);
    assert_eq!(held.rank(), 3);
    // Kept alive (but never served) until the others are done, or gone at once.
    let held = (!drop_links).then_some(held);
    std::thread::scope(|s| run_without(s, all, &t, elems, drop_links));
    drop(held);
}

fn run_without<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    all: Vec<Links>,
    t: &'s Tree,
    elems: usize,
    drop_links: bool,
) {
    let hs: Vec<_> = all
        .into_iter()
        .map(|l| {
            s.spawn(move || {
                let started = Instant::now();
                let mut node =
                    PsNode::start(l, t.clone(), JOB, &f32_tensor(&initial(elems)), short_cfg())
                        .unwrap();
                let err = if node.is_server() {
                    node.wait_clock(1, Duration::from_secs(5)).unwrap_err()
                } else {
                    let r = node.rank();
                    let mut w = Tensor::zeros(DType::F32, elems);
                    // Version 0 may or may not arrive before the failure is known.
                    match node.pull(&mut w, None) {
                        Ok(_) => {
                            node.push(&f32_tensor(&grads(r, 0, elems))).unwrap();
                            node.clock();
                            node.pull(&mut w, None).unwrap_err()
                        }
                        Err(e) => e,
                    }
                };
                let _ = node.shutdown();
                (err, started.elapsed())
            })
        })
        .collect();
    let results: Vec<(PsError, Duration)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    for (e, took) in &results {
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                PsError::Timeout { .. } | PsError::Peer { .. } | PsError::Collective(_)
            ),
            "{msg}"
        );
        assert!(msg.contains("rank") || msg.contains("timed out"), "{msg}");
        // Bounded: op_timeout (2 s) per phase, far from a hang.
        assert!(*took < Duration::from_secs(15), "took {took:?}: {msg}");
    }
    // The server, at least, names the missing rank.
    assert!(
        results
            .iter()
            .any(|(e, _)| e.to_string().contains("rank 3")),
        "drop_links {drop_links}: {:?}",
        results.iter().map(|r| r.0.to_string()).collect::<Vec<_>>()
    );
}

#[test]
fn a_worker_that_never_starts_is_an_error_not_a_hang() {
    missing_worker(false);
    missing_worker(true);
}

#[test]
fn a_dropped_node_is_an_error_naming_it_not_a_hang() {
    let (world, elems) = (3, 500);
    let t = tree(Strategy::Star, world);
    let errors = run_job(
        &t,
        world,
        None,
        &short_cfg(),
        &f32_tensor(&initial(elems)),
        |mut node| {
            let started = Instant::now();
            let r = node.rank();
            let mut w = Tensor::zeros(DType::F32, elems);
            let err = if node.is_server() {
                node.wait_clock(2, Duration::from_secs(5)).unwrap_err()
            } else {
                if r == 2 {
                    node.pull(&mut w, None).unwrap();
                    node.push(&f32_tensor(&grads(r, 0, elems))).unwrap();
                    node.clock();
                    drop(node); // leaves without shutdown: must not block
                    return None;
                }
                // Rank 2 may leave at any point of this (its push of clock 0 may or may not
                // have reached the server first): whichever call fails first must name it.
                let mut clock = |c: u64| {
                    node.pull(&mut w, None)?;
                    node.push(&f32_tensor(&grads(r, c, elems)))?;
                    node.clock();
                    Ok::<_, PsError>(())
                };
                match clock(0).and_then(|()| clock(1)).and_then(|()| clock(2)) {
                    Ok(()) => panic!("rank {r}: three clocks passed without rank 2"),
                    Err(e) => e,
                }
            };
            let _ = node.shutdown();
            assert!(started.elapsed() < Duration::from_secs(15));
            Some(err.to_string())
        },
    );
    let errors: Vec<String> = errors.into_iter().flatten().collect();
    assert_eq!(errors.len(), 2);
    for e in &errors {
        assert!(e.contains("rank"), "{e}");
    }
    assert!(errors.iter().any(|e| e.contains("rank 2")), "{errors:?}");
}

#[test]
fn wrong_use_is_an_error_and_the_node_goes_on() {
    let (world, elems) = (3, 100);
    let t = tree(Strategy::Star, world);
    // Set-up errors.
    let mut ls = links(&t, world, None);
    let l0 = ls.remove(0);
    assert!(matches!(
        PsNode::start(l0, t.clone(), JOB, &Tensor::zeros(DType::Raw, 8), cfg()),
        Err(PsError::Config(_))
    ));
    let small = tree(Strategy::Star, 2);
    let l2 = ls.pop().unwrap();
    assert!(matches!(
        PsNode::start(l2, small, JOB, &f32_tensor(&initial(elems)), cfg()),
        Err(PsError::Config(_))
    ));

    let want = trajectory(&[1, 2], 1, elems);
    let out = run_job(
        &t,
        world,
        None,
        &cfg(),
        &f32_tensor(&initial(elems)),
        |mut node| {
            let mut w = Tensor::zeros(DType::F32, elems);
            if node.is_server() {
                assert!(matches!(
                    node.pull(&mut w, None),
                    Err(PsError::NotAWorker { rank: 0, .. })
                ));
                assert!(matches!(
                    node.push(&w),
                    Err(PsError::NotAWorker { rank: 0, .. })
                ));
                node.wait_clock(1, Duration::from_secs(20)).unwrap();
                let v = values(&node.weights().1);
                node.shutdown().unwrap();
                return v;
            }
            let r = node.rank();
            node.pull(&mut w, None).unwrap();
            let g = f32_tensor(&grads(r, 0, elems));
            node.push(&g).unwrap();
            assert!(matches!(
                node.push(&g),
                Err(PsError::AlreadyPushed { clock: 0 })
            ));
            let mut wrong = Tensor::zeros(DType::F16, elems);
            assert!(matches!(
                node.pull(&mut wrong, None),
                Err(PsError::Mismatch { .. })
            ));
            assert!(matches!(node.push(&wrong), Err(PsError::Mismatch { .. })));
            let mut short = Tensor::zeros(DType::F32, elems - 1);
            assert!(matches!(
                node.pull(&mut short, None),
                Err(PsError::Mismatch { .. })
            ));
            // Nothing of that reached the server: the run goes on exactly.
            assert_eq!(node.clock(), 1);
            let rep = node.pull(&mut w, None).unwrap();
            assert_eq!(rep.weights_clock, 1);
            node.shutdown().unwrap();
            values(&w)
        },
    );
    for v in out {
        assert_eq!(v, want[1]);
    }
}

/// The header codec the fuzz target `ps_header` drives, through the same public path: a
/// valid header re-encodes to itself, a damaged or cut one is refused.
#[test]
fn the_fuzzed_header_codec_accepts_exactly_valid_headers() {
    use gradwire_collective::ps::header_codec::{decode_encode, LEN};
    let mut h = [0u8; LEN];
    h[0] = 0x50; // magic
    h[1] = 3; // push
    h[2] = 1; // a side message follows
    h[8] = 7; // clock 7
    assert_eq!(decode_encode(&h), Ok(h));
    assert!(decode_encode(&h[..LEN - 1]).is_err());
    assert!(decode_encode(&[&h[..], &[0]].concat()).is_err());
    for (i, bad) in [(0, 0x51), (1, 9), (2, 0x80), (3, 1)] {
        let mut b = h;
        b[i] = bad;
        assert!(decode_encode(&b).is_err(), "byte {i} = {bad:#x} accepted");
    }
}
