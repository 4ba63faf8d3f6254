//! Short versions of the MLNET experiments (seconds, root): every strategy completes on the
//! oversubscribed leaf-spine with every server count asked for, and the fabric stays valid.
//! Invariants only, never timings (those are in docs/results.md).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use gradwire_collective::tree::Strategy;
use gradwire_experiment::mlnet::{
    run_mlnet, run_priority, MlnetConfig, PriorityConfig, PriorityMode,
};
use gradwire_netns::require_root;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn short_mlnet_runs_every_strategy() {
    if !require_root("short_mlnet_runs_every_strategy") {
        return;
    }
    let cfg = MlnetConfig {
        strategies: vec![Strategy::Star, Strategy::Rack, Strategy::BINARY],
        servers: vec![1, 2],
        model_bytes: 256 << 10,
        iterations: 1,
        ..MlnetConfig::new(&root())
    };
    let report = run_mlnet(&cfg).unwrap();
    assert_eq!(report.results.len(), 6);
    for r in &report.results {
        assert!(
            r.error.is_none(),
            "{}/{}: {:?}",
            r.strategy,
            r.servers,
            r.error
        );
        assert!(r.makespan_ms.is_finite() && r.makespan_ms > 0.0, "{r:?}");
        assert!(r.vs_star.is_finite());
    }
    // RACK crosses the core once per remote rack and server; STAR once per remote worker.
    let star = report
        .results
        .iter()
        .find(|r| r.strategy == "star")
        .unwrap();
    let rack = report
        .results
        .iter()
        .find(|r| r.strategy == "rack")
        .unwrap();
    assert!(rack.cross_rack_edges < star.cross_rack_edges);
}

#[test]
fn short_priority_runs_every_mode_and_the_urgent_job_finishes_first() {
    if !require_root("short_priority_runs_every_mode_and_the_urgent_job_finishes_first") {
        return;
    }
    let cfg = PriorityConfig {
        jobs: 3,
        workers: 3,
        model_bytes: 128 << 10,
        iterations: 1,
        repetitions: 1,
        ..PriorityConfig::new(&root())
    };
    let report = run_priority(&cfg).unwrap();
    assert_eq!(report.results.len(), 3 * PriorityMode::ALL.len());
    for r in &report.results {
        assert!(r.error.is_none(), "{r:?}");
        assert!(r.makespan_ms.is_finite() && r.makespan_ms > 0.0);
    }
    // Every job of a repetition has the same placement and priority in every mode, and
    // the priorities are distinct.
    let prios: Vec<u8> = report.results[..3].iter().map(|r| r.priority).collect();
    let mut distinct = prios.clone();
    distinct.dedup();
    assert_eq!(distinct.len(), 3);
    // On one bottleneck, strict priority serves the urgent job first: an ordering within
    // one run, not a timing threshold (the figures are in docs/results.md).
    let pair = report.pair.unwrap();
    assert!(pair.error.is_none(), "{pair:?}");
    assert!(pair.urgent_ms < pair.background_ms, "{pair:?}");
}
