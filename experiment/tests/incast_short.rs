//! A short version of the incast experiment (seconds): every variant kind once, tiny tensors,
//! one iteration. Checks invariants only, never timings: every tensor flow completed, every
//! delivered byte is right, gradwire delivered at least 1 - p of every tensor, TCP all of it.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use gradwire_experiment::{run, IncastConfig, Variant, VariantKind};
use gradwire_netns::require_root;

#[test]
fn short_incast_keeps_the_invariants() {
    if !require_root("short_incast_keeps_the_invariants") {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let variants: Vec<Variant> = ["gw-p10", "gw-p0", "tcp-cubic", "gw-p1-notag-nospray-norc"]
        .iter()
        .map(|n| Variant::parse(n).unwrap())
        .collect();
    let cfg = IncastConfig {
        topology: root.join("testbeds/ps-incast.toml"),
        model: root.join("control/models/resnet50.toml"),
        scale: 1.0 / 1024.0,
        split_bytes: 4096,
        iterations: 1,
        variants: variants.clone(),
        seed: 7,
        spray_ports: 4,
        period_ns: 2_000_000,
    };
    let r = run(&cfg).unwrap();
    assert_eq!(r.results.len(), variants.len());
    let tensors = r.tensors_per_worker * r.workers * 2; // push and pull
    for v in &r.results {
        assert!(v.skipped.is_none(), "{}: {:?}", v.variant.name, v.skipped);
        assert_eq!(
            v.flows, tensors,
            "{}: every tensor flow completed",
            v.variant.name
        );
        assert_eq!(
            v.wrong_bytes, 0,
            "{}: delivered bytes are right",
            v.variant.name
        );
        let p = match v.variant.kind {
            VariantKind::Gradwire { loss_bound, .. } => loss_bound,
            VariantKind::Tcp { .. } => 0.0,
        };
        assert!(
            v.delivered_min >= 1.0 - p - 1e-9,
            "{}: delivered {} < 1 - {p}",
            v.variant.name,
            v.delivered_min
        );
        for rec in &v.records {
            assert!(rec.fct_us > 0.0);
        }
        eprintln!(
            "{}: fct avg {:.1} ms p99 {:.1} ms, marked {}, dropped {} (fabric behind: {})",
            v.variant.name,
            v.fct_avg_ms,
            v.fct_p99_ms,
            v.switch_marked,
            v.switch_dropped_threshold,
            v.fabric_behind
        );
    }
}
