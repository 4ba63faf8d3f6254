//! Roles: a member that says what only another role may say (a weights version from a leaf,
//! a tree update or a failure it has no standing to declare) changes nothing at the others.
//! Seven ranks on a BINARY tree (root 0; 1 and 4 under it; 2, 3 under 1; 5, 6 under 4: the
//! tree lays members out in pre-order), the links of `fault_tolerant_edges` in memory; leaf 3
//! attacks, or aggregator 1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use gradwire::tensor::{DType, Tensor};

use crate::link::{Links, MemLinkConfig};
use crate::ps::core::{Out, VersionMsg};
use crate::ps::{fault_tolerant_edges, PsConfig, PsNode, PsStats};
use crate::tree::{Strategy, Tree};

const JOB: u32 = 25;
const ELEMS: usize = 64;
const CLOCKS: u64 = 4;
const ATTACKER: usize = 3;
/// A value no honest rank ever computes.
const FORGED: f32 = 42.0;

fn tree() -> Tree {
    let members: Vec<usize> = (0..7).collect();
    Tree::build(Strategy::BINARY, 0, &members, &[0; 7]).unwrap()
}

fn cfg() -> PsConfig {
    PsConfig {
        learning_rate: 0.5,
        op_timeout: Duration::from_secs(8),
        ..PsConfig::default()
    }
}

/// What a rank saw.
#[derive(Debug)]
struct Seen {
    rank: usize,
    /// The newest weights clock any pull returned, and whether any pulled value was the
    /// forged one.
    max_clock: u64,
    forged_seen: bool,
    /// The first error of the run (pull, push, wait or shutdown), as text.
    error: Option<String>,
    stats: Option<PsStats>,
}

/// Runs `CLOCKS` synchronous clocks on every rank; `attacker` calls `attack` on its node
/// after its first pull, then goes on as an honest worker as far as it can.
fn run(attacker: usize, attack: &(dyn Fn(&PsNode) + Sync)) -> Vec<Seen> {
    run_with(cfg(), attacker, attack)
}

/// [`run`] with every node configured by `cfg`.
fn run_with(cfg: PsConfig, attacker: usize, attack: &(dyn Fn(&PsNode) + Sync)) -> Vec<Seen> {
    let t = tree();
    let links = Links::in_memory(7, &fault_tolerant_edges(&t), &MemLinkConfig::default()).unwrap();
    let model = Tensor::from_f32(&vec![1.0; ELEMS]);
    std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .map(|l| {
                let (t, model, cfg) = (t.clone(), &model, cfg.clone());
                s.spawn(move || {
                    let mut node = PsNode::start(l, t, JOB, model, cfg).unwrap();
                    let rank = node.rank();
                    let mut seen = Seen {
                        rank,
                        max_clock: 0,
                        forged_seen: false,
                        error: None,
                        stats: None,
                    };
                    let mut step = |node: &mut PsNode, c: u64| -> Result<(), String> {
                        if node.is_server() {
                            return node
                                .wait_clock(c + 1, Duration::from_secs(8))
                                .map(|_| ())
                                .map_err(|e| e.to_string());
                        }
                        let mut w = Tensor::zeros(DType::F32, ELEMS);
                        let rep = node.pull(&mut w, None).map_err(|e| e.to_string())?;
                        seen.max_clock = seen.max_clock.max(rep.weights_clock);
                        seen.forged_seen |= w.as_f32().unwrap().contains(&FORGED);
                        if rank == attacker && c == 0 {
                            attack(node);
                        }
                        let g = vec![0.01 * (rank as f32 + 1.0); ELEMS];
                        node.push(&Tensor::from_f32(&g))
                            .map_err(|e| e.to_string())?;
                        node.clock();
                        Ok(())
                    };
                    for c in 0..CLOCKS {
                        if let Err(e) = step(&mut node, c) {
                            seen.error = Some(e);
                            break;
                        }
                    }
                    match node.shutdown() {
                        Ok(st) => seen.stats = Some(st),
                        Err(e) => {
                            seen.error.get_or_insert(e.to_string());
                        }
                    }
                    seen
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A weights version of `clock` holding [`FORGED`] everywhere.
fn forged_version(clock: u64) -> Out {
    Out::Weights(Arc::new(VersionMsg {
        clock,
        weights: Tensor::from_f32(&vec![FORGED; ELEMS]),
        block_clocks: None,
    }))
}

#[test]
fn a_leaf_cannot_replace_the_servers_model() {
    let seen = run(ATTACKER, &|node| {
        node.forge(0, forged_version(1_000)); // to the server
        node.forge(1, forged_version(1_000)); // to its own aggregator
    });
    for s in &seen {
        assert!(
            !s.forged_seen,
            "rank {} pulled the forged weights: {s:?}",
            s.rank
        );
        assert!(
            s.max_clock <= CLOCKS,
            "rank {} saw clock {}: {s:?}",
            s.rank,
            s.max_clock
        );
    }
    // The server refuses loudly, naming it; so does its aggregator, unless the server's
    // failure reached it first (then the job has stopped anyway).
    let names_it = |r: usize| {
        let e = seen[r].error.as_deref().unwrap_or("");
        e.contains(&format!("rank {ATTACKER}")) && e.contains("weights")
    };
    assert!(names_it(0), "{:?}", seen[0]);
    let e1 = seen[1].error.as_deref().unwrap_or("");
    assert!(names_it(1) || e1.contains("rank 0"), "{:?}", seen[1]);
}

#[test]
fn a_leaf_cannot_declare_the_others_dead() {
    let seen = run(ATTACKER, &|node| {
        let others = Arc::new(vec![1, 2, 4, 5, 6]);
        node.forge(0, Out::Tree(others.clone()));
        node.forge(1, Out::Tree(others));
    });
    for s in &seen {
        assert!(s.error.is_none(), "rank {}: {s:?}", s.rank);
        let st = s.stats.as_ref().unwrap();
        assert!(st.dead.is_empty(), "rank {}: {st:?}", s.rank);
        // Synchronous: the last pull returns the version of clock CLOCKS - 1; the server
        // ends at CLOCKS.
        let want = if s.rank == 0 {
            (0, CLOCKS)
        } else {
            (CLOCKS - 1, st.model_clock)
        };
        assert_eq!((s.max_clock, st.model_clock), want, "rank {}", s.rank);
    }
    let refused: u64 = seen
        .iter()
        .map(|s| s.stats.as_ref().unwrap().claims_refused)
        .sum();
    assert!(refused >= 2, "{refused}");
}

#[test]
fn a_leaf_cannot_blame_an_innocent_rank() {
    let seen = run(ATTACKER, &|node| {
        node.forge_failure(5, "forged: rank 5 broke");
        // Long enough for the node's next tick to tell every neighbour.
        std::thread::sleep(Duration::from_millis(300));
    });
    for s in seen.iter().filter(|s| s.rank != ATTACKER) {
        let e = s.error.as_deref().unwrap_or("");
        assert!(!e.contains("forged"), "rank {} believed it: {s:?}", s.rank);
    }
    // The attacker left; the root routed around it and the others finished.
    let root = seen[0].stats.as_ref().expect("the root finished");
    assert_eq!(root.dead, vec![ATTACKER], "{root:?}");
    assert_eq!(root.model_clock, CLOCKS);
}

#[test]
fn an_aggregator_cannot_send_a_version_from_the_future() {
    // Rank 1 aggregates for 2 and 3 and passes versions down: it may, but no honest version
    // is newer than a worker's own clocks.
    assert_eq!(tree().children(1), &[2, 3]);
    let seen = run(1, &|node| {
        node.forge(2, forged_version(1_000));
        node.forge(3, forged_version(1_000));
    });
    for s in &seen {
        assert!(
            !s.forged_seen && s.max_clock <= CLOCKS,
            "rank {}: {s:?}",
            s.rank
        );
    }
    // A version queued behind one in flight is superseded by the next (genuine) one, so a
    // child may never get the forged one; one that does refuses it, naming rank 1.
    let refused = [2, 3].into_iter().filter(|&r| {
        let e = seen[r].error.as_deref().unwrap_or("");
        e.contains("rank 1") && e.contains("ahead")
    });
    assert!(refused.count() >= 1, "{seen:#?}");
}

/// Rank 1, before its own push of clock 0 (so the server cannot have made version 1 yet),
/// sends its children 2 and 3 a version 1 of its own making.
fn forge_next_version(node: &PsNode) {
    // The children push clock 0 meanwhile: version 1 is then not ahead of their clocks.
    std::thread::sleep(Duration::from_millis(200));
    node.forge(2, forged_version(1));
    node.forge(3, forged_version(1));
}

#[test]
fn an_aggregator_cannot_pass_down_weights_of_its_own_when_versions_are_checked() {
    // Unchecked, the children take it: a plausible clock, from the rank that passes them
    // every version.
    let seen = run(1, &forge_next_version);
    assert!(
        [2, 3].iter().any(|&r| seen[r].forged_seen),
        "unchecked, no child pulled the aggregator's version: {seen:#?}"
    );
    // Checked against the server's digest: never pulled, an error naming rank 1.
    let cfg = PsConfig {
        verify_versions: true,
        ..cfg()
    };
    let seen = run_with(cfg, 1, &forge_next_version);
    for s in &seen {
        assert!(
            !s.forged_seen,
            "rank {} pulled the forged version: {s:?}",
            s.rank
        );
    }
    for r in [2, 3] {
        let e = seen[r].error.as_deref().unwrap_or("");
        assert!(
            e.contains("rank 1") && e.contains("version 1"),
            "rank {r}: {:?}",
            seen[r]
        );
    }
}

#[test]
fn checked_versions_give_the_same_training_as_unchecked() {
    let plain = run(ATTACKER, &|_| {});
    let cfg = PsConfig {
        verify_versions: true,
        ..cfg()
    };
    let checked = run_with(cfg, ATTACKER, &|_| {});
    for (p, c) in plain.iter().zip(&checked) {
        assert!(p.error.is_none() && c.error.is_none(), "{p:?} {c:?}");
        // The same versions pulled; the last one may come after the node stopped.
        assert_eq!(p.max_clock, c.max_clock, "rank {}", p.rank);
        assert!(c.stats.as_ref().unwrap().model_clock + 1 >= CLOCKS, "{c:?}");
    }
    // The ranks below the server's children checked every version they took.
    for r in [2, 3, 5, 6] {
        let st = checked[r].stats.as_ref().unwrap();
        assert!(st.versions_verified >= CLOCKS, "rank {r}: {st:?}");
    }
    assert_eq!(checked[1].stats.as_ref().unwrap().versions_verified, 0);
}
