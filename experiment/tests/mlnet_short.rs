//! Short versions of the MLNET experiments (seconds, root): every strategy completes on the
//! oversubscribed leaf-spine with every server count asked for, and the fabric stays valid.
//! Invariants only, never timings (those are in docs/results.md).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use gradwire_collective::tree::Strategy;
use gradwire_experiment::mlnet::{run_mlnet, MlnetConfig};
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
