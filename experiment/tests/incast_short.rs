//! A short version of the incast experiment (seconds): every variant kind once (flows, the
//! message layer, TCP), tiny tensors,
//! one iteration. Checks invariants only, never timings: every tensor flow completed, every
//! delivered byte is right, gradwire delivered at least 1 - p of every tensor, TCP all of it,
//! the TCP host settings were in force; and a receiver that fails mid-run costs only its own
//! flows, which the report counts and explains. Every test holds the fabric lock, and a run
//! whose fabric fell behind its clock fails the test (its results are no evidence).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use gradwire_experiment::{
    run, write_flows_csv, IncastConfig, ReceiverFault, Regime, Variant, VariantKind,
};
use gradwire_netns::{require_root, FabricLock};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Tiny tensors, one iteration, the current regime's testbed.
fn short(variants: &[&str]) -> IncastConfig {
    IncastConfig {
        scale: 1.0 / 1024.0,
        split_bytes: 4096,
        iterations: 1,
        variants: variants
            .iter()
            .map(|n| Variant::parse(n).unwrap())
            .collect(),
        seed: 7,
        spray_ports: 4,
        period_ns: 2_000_000,
        ..IncastConfig::new(Regime::Current, &root())
    }
}

#[test]
fn short_incast_keeps_the_invariants() {
    if !require_root("short_incast_keeps_the_invariants") {
        return;
    }
    let _fabric = FabricLock::acquire().unwrap();
    let cfg = short(&[
        "gw-p10",
        "gw-p0",
        "tcp-cubic",
        "gw-p1-notag-nospray-norc",
        "tcp-cubic-ecn-rto10",
        "msg-p10",
        "msg-p0-notag-nogrants",
    ]);
    let variants = cfg.variants.clone();
    let r = run(&cfg).unwrap();
    assert_eq!(r.results.len(), variants.len());
    let tensors = r.tensors_per_worker * r.workers * 2; // push and pull
    for v in &r.results {
        assert!(v.skipped.is_none(), "{}: {:?}", v.variant.name, v.skipped);
        assert!(v.error.is_none(), "{}: {:?}", v.variant.name, v.error);
        assert!(
            v.valid,
            "{}: the fabric fell behind its clock (late {}/{} departures): the run is no result",
            v.variant.name, v.fabric_late.0, v.fabric_late.1
        );
        assert_eq!(
            v.flows, tensors,
            "{}: every tensor flow completed",
            v.variant.name
        );
        assert_eq!(v.failed_flows, 0, "{}: {:?}", v.variant.name, v.failures);
        assert_eq!(
            v.wrong_bytes, 0,
            "{}: delivered bytes are right",
            v.variant.name
        );
        let p = match v.variant.kind {
            VariantKind::Gradwire { loss_bound, .. } => loss_bound,
            VariantKind::Msg(s) => s.loss_bound,
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
            assert!(rec.data_packets > 0, "{}: {rec:?}", v.variant.name);
        }
        // The CIs bracket their statistic.
        for (_, e) in v.fct_ms.quantiles() {
            assert!(
                e.lo <= e.value && e.value <= e.hi,
                "{}: {e:?}",
                v.variant.name
            );
        }
        assert!(v.data_packets > 0);
        assert!(
            v.is_headline(),
            "{}: {:?}",
            v.variant.name,
            v.exclusion(None)
        );
        eprintln!(
            "{}: fct avg {:.1} ms p99 {:.1} ms, marked {}, dropped {}, drops/pkt {:.4} (valid: {})",
            v.variant.name,
            v.fct_avg_ms,
            v.fct_p99_ms,
            v.switch_marked,
            v.switch_dropped_threshold,
            v.drops_per_data_packet,
            v.valid
        );
    }
    let by_name = |n: &str| r.results.iter().find(|v| v.variant.name == n).unwrap();
    let cubic = by_name("tcp-cubic").tcp.clone().unwrap();
    assert_eq!(cubic.congestion, "cubic");
    assert_eq!(cubic.rto_min_ms, None);
    let tuned = by_name("tcp-cubic-ecn-rto10").tcp.clone().unwrap();
    assert_eq!((tuned.tcp_ecn, tuned.rto_min_ms), (1, Some(10)));
}

#[test]
fn a_failing_receiver_is_recorded_and_the_run_goes_on() {
    if !require_root("a_failing_receiver_is_recorded_and_the_run_goes_on") {
        return;
    }
    let _fabric = FabricLock::acquire().unwrap();
    let cfg = IncastConfig {
        iterations: 2,
        receiver_fault: Some(ReceiverFault {
            iteration: 0,
            after_tensors: 1,
        }),
        ..short(&["gw-p10", "tcp-cubic"])
    };
    let r = run(&cfg).unwrap();
    let per_iteration = r.tensors_per_worker * r.workers * 2;
    for v in &r.results {
        let name = &v.variant.name;
        assert!(v.skipped.is_none() && v.error.is_none(), "{name}: {v:?}");
        assert!(
            v.valid,
            "{name}: the fabric fell behind its clock (late {}/{} departures): the run is no \
             result",
            v.fabric_late.0, v.fabric_late.1
        );
        assert_eq!(
            v.flows,
            2 * per_iteration,
            "{name}: every flow has a record"
        );
        // The faulty pair's tensors after the first fail, nothing else does.
        let pair_tensors = v
            .records
            .iter()
            .filter(|f| {
                f.iteration == 0 && f.push && (f.src, f.dst) == (v.records[0].src, v.records[0].dst)
            })
            .count();
        assert!(v.failed_flows > 0, "{name}: the failure is counted");
        assert!(
            v.failed_flows < pair_tensors,
            "{name}: {} failed",
            v.failed_flows
        );
        assert!(
            v.failures
                .iter()
                .any(|f| f.error.contains("injected fault")),
            "{name}: {:?}",
            v.failures
        );
        assert!(
            v.records
                .iter()
                .filter(|f| f.iteration == 1)
                .all(|f| f.completed()),
            "{name}: the next iteration runs normally"
        );
        assert_eq!(v.wrong_bytes, 0);
        assert!(
            v.fct_ms.p99.value > 0.0,
            "{name}: figures from the completed flows"
        );
    }
    // A variant that lost flows is no headline, and the report says why.
    for v in &r.results {
        assert!(!v.is_headline(), "{}", v.variant.name);
        assert!(
            r.excluded
                .iter()
                .any(|x| x.variant == v.variant.name && x.reason.contains("failed")),
            "{:?}",
            r.excluded
        );
    }
    assert!(r.ratios.is_empty(), "{:?}", r.ratios);
    let mut csv = Vec::new();
    write_flows_csv(&r, &mut csv).unwrap();
    let csv = String::from_utf8(csv).unwrap();
    assert!(csv
        .lines()
        .any(|l| l.contains(",1,") && l.contains("injected fault")));
}
