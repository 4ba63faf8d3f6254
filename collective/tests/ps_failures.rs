//! The parameter server routes around failures (MLNET §3.1), over in-memory links holding
//! `fault_tolerant_edges` (every rank a thread): an interior aggregator killed mid-run is
//! replaced by its parent (its children re-attach and re-send what it never forwarded), two
//! killed aggregators make the job fall back to STAR, and a killed server is an error naming
//! it at every worker, never a hang. Every run ends at the exact result of the contributions
//! the server says it applied.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gradwire::tensor::{DType, Tensor};
use gradwire_collective::link::{Links, MemLinkConfig};
use gradwire_collective::ps::{
    fault_tolerant_edges, PsConfig, PsError, PsNode, PsStats, UpdateRecord,
};
use gradwire_collective::tree::{Strategy, Tree};

mod common;
use common::{grad, initial, LR};

const JOB: u32 = 12;
/// Generous bound on anything that must not hang.
const BOUND: Duration = Duration::from_secs(15);

fn grads(r: usize, c: u64, elems: usize) -> Tensor {
    Tensor::from_f32(&(0..elems).map(|e| grad(r, c, e)).collect::<Vec<_>>())
}

fn values(t: &Tensor) -> Vec<f32> {
    t.as_f32().unwrap().to_vec()
}

/// The weights after the recorded updates: every block averaged over exactly the workers
/// the record names.
fn replay(updates: &[UpdateRecord], block_elems: usize, elems: usize) -> Vec<f32> {
    common::replay(updates, block_elems, elems).pop().unwrap()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-4 * y.abs().max(1.0))
}

fn binary(world: usize) -> Tree {
    let members: Vec<usize> = (0..world).collect();
    Tree::build(Strategy::BINARY, 0, &members, &vec![0; world]).unwrap()
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

/// What a rank ended with.
#[derive(Debug)]
enum End {
    Server {
        weights: Vec<f32>,
        block_elems: usize,
        stats: PsStats,
        /// When each clock completed.
        completed: Vec<Instant>,
    },
    Worker {
        weights: Vec<f32>,
        stats: PsStats,
    },
    Killed {
        at: Instant,
    },
}

/// Every rank of `t` runs `clocks` iterations (synchronous unless `staleness`); worker
/// `kill[i].0` is dropped (no shutdown) right after its push of clock `kill[i].1`.
fn run_stale_with_kills(
    t: &Tree,
    clocks: u64,
    elems: usize,
    kill: &[(usize, u64)],
    staleness: u64,
) -> Vec<End> {
    let world = t.len();
    let links =
        Links::in_memory(world, &fault_tolerant_edges(t), &MemLinkConfig::default()).unwrap();
    let model = Tensor::from_f32(&initial(elems));
    std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .map(|l| {
                let (t, model) = (t.clone(), &model);
                s.spawn(move || {
                    let started = Instant::now();
                    let c = PsConfig { staleness, ..cfg() };
                    let mut node = PsNode::start(l, t, JOB, model, c).unwrap();
                    let r = node.rank();
                    if node.is_server() {
                        let mut completed = Vec::new();
                        for c in 1..=clocks {
                            node.wait_clock(c, Duration::from_secs(10)).unwrap();
                            completed.push(Instant::now());
                        }
                        let block_elems = node.block_elems();
                        let weights = values(&node.weights().1);
                        let stats = node.shutdown().unwrap();
                        assert!(started.elapsed() < BOUND * 2);
                        return End::Server {
                            weights,
                            block_elems,
                            stats,
                            completed,
                        };
                    }
                    let mut w = Tensor::zeros(DType::F32, elems);
                    for c in 0..clocks {
                        let rep = node.pull(&mut w, None).unwrap();
                        // The staleness bound holds through the repairs.
                        assert!(
                            rep.weights_clock + staleness >= c,
                            "rank {r}: {rep:?} at {c}"
                        );
                        if staleness == 0 {
                            assert_eq!(rep.weights_clock, c, "rank {r}");
                        }
                        node.push(&grads(r, c, elems)).unwrap();
                        node.clock();
                        if kill.contains(&(r, c)) {
                            drop(node); // dies without a word
                            return End::Killed { at: Instant::now() };
                        }
                    }
                    let rep = node.pull(&mut w, Some(0)).unwrap();
                    assert_eq!(rep.weights_clock, clocks);
                    let stats = node.shutdown().unwrap();
                    assert!(started.elapsed() < BOUND * 2);
                    End::Worker {
                        weights: values(&w),
                        stats,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn run_with_kills(t: &Tree, clocks: u64, elems: usize, kill: &[(usize, u64)]) -> Vec<End> {
    run_stale_with_kills(t, clocks, elems, kill, 0)
}

/// The survivors agree with the server, which matches the contributions it applied: every
/// survivor in every update, each dead rank only in a prefix of them.
fn check_exact(out: &[End], elems: usize, dead: &[usize], version: u64, star: bool) {
    let world = out.len();
    let End::Server {
        weights,
        block_elems,
        stats,
        ..
    } = &out[0]
    else {
        panic!("rank 0 is the server")
    };
    let survivors: Vec<usize> = (1..world).filter(|r| !dead.contains(r)).collect();
    assert!(close(weights, &replay(&stats.updates, *block_elems, elems)));
    let mut last_with: Vec<Option<u64>> = vec![None; world];
    for u in &stats.updates {
        for b in 0..u.contributors.blocks() {
            let ranks: BTreeSet<usize> = u.contributors.ranks(b).into_iter().collect();
            for s in &survivors {
                assert!(ranks.contains(s), "clock {}: survivor {s} missing", u.clock);
            }
            for &d in dead {
                if ranks.contains(&d) {
                    last_with[d] = Some(u.clock);
                }
            }
        }
    }
    for &d in dead {
        // A prefix: the clocks it pushed (and that got through) before it died.
        let n = stats
            .updates
            .iter()
            .filter(|u| u.contributors.contains(0, d))
            .count() as u64;
        assert_eq!(last_with[d].map_or(0, |c| c + 1), n, "rank {d}");
    }
    for e in out {
        let s = match e {
            End::Server { stats, .. } | End::Worker { stats, .. } => stats,
            End::Killed { .. } => continue,
        };
        assert_eq!(s.dead, dead, "rank {}", s.rank);
        assert_eq!(s.tree_version, version, "rank {}", s.rank);
        assert_eq!(s.fell_back_to_star, star, "rank {}", s.rank);
        if let End::Worker { weights: w, .. } = e {
            assert_eq!(w, weights, "rank {}", s.rank);
        }
    }
}

#[test]
fn the_spare_links_are_the_tree_the_grandparents_and_the_star() {
    let t = binary(7);
    let e: BTreeSet<(usize, usize)> = fault_tolerant_edges(&t).into_iter().collect();
    assert_eq!(e.len(), fault_tolerant_edges(&t).len(), "no duplicates");
    for m in 1..7 {
        let p = t.parent(m).unwrap();
        assert!(e.contains(&(m, p)) && e.contains(&(p, m)));
        assert!(e.contains(&(m, 0)) && e.contains(&(0, m)));
        if let Some(g) = t.grandparent(m) {
            assert!(e.contains(&(m, g)) && e.contains(&(g, m)));
        }
    }
    for &(a, b) in &e {
        assert_ne!(a, b);
        let related =
            |x: usize, y: usize| t.parent(x) == Some(y) || t.grandparent(x) == Some(y) || y == 0;
        assert!(related(a, b) || related(b, a), "{a} <-> {b}");
    }
}

#[test]
fn a_killed_aggregator_is_replaced_by_its_parent() {
    let (world, clocks, elems, at) = (7, 8, 2_000, 2);
    let t = binary(world);
    let victim = (1..world).find(|&r| !t.children(r).is_empty()).unwrap();
    let out = run_with_kills(&t, clocks, elems, &[(victim, at)]);
    check_exact(&out, elems, &[victim], 1, false);
    let End::Server {
        completed, stats, ..
    } = &out[0]
    else {
        panic!()
    };
    assert_eq!(stats.updates.len(), clocks as usize);
    // Its pushes up to clock `at - 1` were applied for sure (it pulled version `at`).
    assert!(stats.updates[..at as usize]
        .iter()
        .all(|u| u.contributors.contains(0, victim)));
    let killed = out
        .iter()
        .find_map(|e| match e {
            End::Killed { at } => Some(*at),
            _ => None,
        })
        .unwrap();
    // The next clock completes through the grandparent within the failure timeout plus an
    // iteration (generous slack for a loaded machine).
    let next = completed.iter().find(|&&c| c > killed).unwrap();
    let bound = cfg().failure_timeout + Duration::from_secs(5);
    assert!(
        next.duration_since(killed) < bound,
        "{:?}",
        next.duration_since(killed)
    );
}

#[test]
fn two_killed_aggregators_make_the_job_fall_back_to_star() {
    let (world, clocks, elems) = (7, 8, 2_000);
    let t = binary(world);
    let interior: Vec<usize> = (1..world).filter(|&r| !t.children(r).is_empty()).collect();
    assert!(interior.len() >= 2, "{interior:?}");
    let dead = vec![interior[0], interior[1]];
    let out = run_with_kills(&t, clocks, elems, &[(dead[0], 1), (dead[1], 4)]);
    check_exact(&out, elems, &dead, 2, true);
}

#[test]
fn a_killed_server_is_an_error_naming_it_at_every_worker() {
    let (world, elems) = (7, 1_000);
    let t = binary(world);
    let links =
        Links::in_memory(world, &fault_tolerant_edges(&t), &MemLinkConfig::default()).unwrap();
    let model = Tensor::from_f32(&initial(elems));
    let killed: Mutex<Option<Instant>> = Mutex::new(None);
    let errors: Vec<Option<(PsError, Duration)>> = std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .map(|l| {
                let (t, model, killed) = (t.clone(), &model, &killed);
                s.spawn(move || {
                    let mut node = PsNode::start(l, t, JOB, model, cfg()).unwrap();
                    if node.is_server() {
                        node.wait_clock(2, Duration::from_secs(10)).unwrap();
                        *killed.lock().unwrap() = Some(Instant::now());
                        drop(node);
                        return None;
                    }
                    let r = node.rank();
                    let mut w = Tensor::zeros(DType::F32, elems);
                    let mut err = None;
                    for c in 0..100 {
                        let step = node
                            .pull(&mut w, None)
                            .and_then(|_| node.push(&grads(r, c, elems)));
                        if let Err(e) = step {
                            err = Some(e);
                            break;
                        }
                        node.clock();
                    }
                    let err = err.expect("the server is gone: some call must fail");
                    let when = killed.lock().unwrap().expect("the server died first");
                    let took = when.elapsed();
                    let shut = Instant::now();
                    assert!(node.shutdown().is_err());
                    assert!(shut.elapsed() < BOUND);
                    Some((err, took))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bound = cfg().failure_timeout + Duration::from_secs(5);
    for (e, took) in errors.into_iter().flatten() {
        let msg = e.to_string();
        assert!(
            matches!(e, PsError::Peer { rank: 0, .. } | PsError::Failed(_)),
            "{msg}"
        );
        assert!(msg.contains("rank 0"), "{msg}");
        assert!(took < bound, "{took:?}: {msg}");
    }
}

/// A rank whose links exist but whose process never runs (no heartbeat, no data) is declared
/// dead after `failure_timeout` and routed around like a killed one.
#[test]
fn a_silent_aggregator_is_declared_dead_after_the_failure_timeout() {
    let (world, clocks, elems) = (7, 3, 1_000);
    let t = binary(world);
    let silent = (1..world).find(|&r| !t.children(r).is_empty()).unwrap();
    let mut links =
        Links::in_memory(world, &fault_tolerant_edges(&t), &MemLinkConfig::default()).unwrap();
    let held = links.remove(silent);
    let model = Tensor::from_f32(&initial(elems));
    let started = Instant::now();
    let out: Vec<(usize, Vec<f32>, PsStats)> = std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .map(|l| {
                let (t, model) = (t.clone(), &model);
                s.spawn(move || {
                    let mut node = PsNode::start(l, t, JOB, model, cfg()).unwrap();
                    let r = node.rank();
                    if node.is_server() {
                        node.wait_clock(clocks, Duration::from_secs(10)).unwrap();
                        let w = values(&node.weights().1);
                        return (r, w, node.shutdown().unwrap());
                    }
                    let mut w = Tensor::zeros(DType::F32, elems);
                    for c in 0..clocks {
                        node.pull(&mut w, None).unwrap();
                        node.push(&grads(r, c, elems)).unwrap();
                        node.clock();
                    }
                    node.pull(&mut w, Some(0)).unwrap();
                    (r, values(&w), node.shutdown().unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(held);
    // Nobody waited more than the failure timeout plus generous slack per clock.
    assert!(started.elapsed() < BOUND);
    let (_, server_w, server) = &out[0];
    assert!(server.server);
    for u in &server.updates {
        assert!(!u.contributors.contains(0, silent));
        assert_eq!(
            u.contributors.count(0),
            world - 2,
            "every live worker, every clock"
        );
    }
    assert_eq!(server.updates.len(), clocks as usize);
    for (r, w, s) in &out {
        assert_eq!(s.dead, vec![silent], "rank {r}");
        assert_eq!(s.tree_version, 1);
        assert!(!s.fell_back_to_star);
        assert_eq!(w, server_w, "rank {r}");
    }
}

/// Deeper down a chain (0 - 1 - 2 - 3 - 4) the grandparent is an aggregator, not the server:
/// rank 3 re-attaches to rank 1, which adopts it mid-run.
#[test]
fn in_a_chain_the_grandparent_aggregator_adopts_the_orphan() {
    let (world, clocks, elems) = (5, 6, 1_000);
    let members: Vec<usize> = (0..world).collect();
    let t = Tree::build(Strategy::Degree(1), 0, &members, &vec![0; world]).unwrap();
    assert_eq!(t.parent(3), Some(2));
    assert_eq!(t.grandparent(3), Some(1));
    let out = run_with_kills(&t, clocks, elems, &[(2, 3)]);
    check_exact(&out, elems, &[2], 1, false);
}

/// Stale-synchronous (s = 2): workers run ahead, so more clocks are in flight when the
/// aggregator dies; every pull stays within the bound and the result is still exact.
#[test]
fn a_killed_aggregator_under_staleness_keeps_the_bound_and_the_sums() {
    let (world, clocks, elems) = (7, 10, 1_000);
    let t = binary(world);
    let victim = (1..world)
        .rev()
        .find(|&r| !t.children(r).is_empty())
        .unwrap();
    let out = run_stale_with_kills(&t, clocks, elems, &[(victim, 4)], 2);
    check_exact(&out, elems, &[victim], 1, false);
}
