//! Policy formulation cost on the scheduler (§IV-B's complexity, measured): what one refresh
//! every UPDATE_TIME costs on the paper's 9-site overlay and on a 15-site one (§IX-D's
//! largest cluster).
//!
//! - `refresh`: Algorithm 1 + 2 from scratch (fastest paths for all pairs, scores, top-k roots,
//!   one FAPT per root), with every node a root.
//! - `aux_per_tree_edge`: Algorithm 3 for every edge of every root's tree (what the runtime
//!   ships as auxiliary paths).
//! - `aux_all_pairs`: Algorithm 3 for every ordered pair.
//!
//! ```text
//! cargo bench -p gradwire-netstorm --bench policy -- --warm-up-time 1 --measurement-time 2
//! ```

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use gradwire_netstorm::aux::{multi_root_edge_paths, PathTable};
use gradwire_netstorm::fapt::Planner;
use gradwire_netstorm::graph::Overlay;
use std::hint::black_box;

const MBIT: f64 = 1e6;
/// A 1 M-element f32 chunk.
const CHUNK_BYTES: u64 = 4_000_000;

/// An Internet2-like backbone of 9 sites, links of 20-155 Mbit/s.
fn nine_sites() -> Overlay {
    let mut o = Overlay::with_names(["sea", "svl", "lax", "slc", "kc", "hou", "chi", "atl", "nyc"])
        .expect("distinct names");
    for (a, b, mbit) in [
        (0, 1, 100.0),
        (0, 3, 45.0),
        (1, 2, 155.0),
        (1, 3, 20.0),
        (2, 3, 60.0),
        (2, 5, 80.0),
        (3, 4, 120.0),
        (4, 5, 35.0),
        (4, 6, 155.0),
        (5, 7, 90.0),
        (6, 7, 25.0),
        (6, 8, 140.0),
        (7, 8, 70.0),
    ] {
        o.add_link(a, b, mbit * MBIT).expect("valid link");
    }
    o
}

/// A ring of 15 sites with chords, deterministic rates of 20-155 Mbit/s.
fn fifteen_sites() -> Overlay {
    let n = 15;
    let mut o = Overlay::new(n);
    let rate = |i: usize| (20 + (i * 37) % 136) as f64 * MBIT;
    for v in 0..n {
        o.add_link(v, (v + 1) % n, rate(v)).expect("valid link");
    }
    for v in (0..n).step_by(3) {
        o.add_link(v, (v + 5) % n, rate(v + n)).expect("valid link");
    }
    o
}

fn policy(c: &mut Criterion) {
    let mut g = c.benchmark_group("policy");
    for (name, overlay) in [("9_sites", nine_sites()), ("15_sites", fifteen_sites())] {
        g.bench_with_input(BenchmarkId::new("refresh", name), &overlay, |b, o| {
            b.iter(|| {
                let mut planner = Planner::new(None, CHUNK_BYTES);
                black_box(planner.refresh(black_box(o)).expect("connected"))
            })
        });
        let plan = Planner::new(None, CHUNK_BYTES)
            .refresh(&overlay)
            .expect("connected");
        g.bench_with_input(
            BenchmarkId::new("aux_per_tree_edge", name),
            &overlay,
            |b, o| {
                b.iter(|| {
                    black_box(multi_root_edge_paths(black_box(o), &plan, CHUNK_BYTES).expect("ok"))
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("aux_all_pairs", name), &overlay, |b, o| {
            b.iter(|| black_box(PathTable::compute(black_box(o), CHUNK_BYTES)))
        });
    }
    g.finish();
}

criterion_group!(benches, policy);
criterion_main!(benches);
