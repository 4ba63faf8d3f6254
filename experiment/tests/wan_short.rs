//! Short NetStorm runs on `testbeds/wan4.toml` (root; seconds to tens of seconds each), one
//! `gradwire wan node` process per site as `gradwire experiment wan` runs them:
//! - every strategy gives every node the same, exact average (each node checks every
//!   element of every round), and `+aux` sends and relays chunks on auxiliary paths;
//! - a site that stops answering (its process killed mid-run) makes every other node fail
//!   with an error naming it, or naming the node whose failure it caused (whose own error
//!   names it), as its failure report says (the blamed nodes as data); a timeout that fired
//!   is the configured one, and the node waited it in full;
//! - a link whose rate drops is avoided by the trees of a later refresh (awareness on);
//! - policies that change between rounds (UPDATE_TIME 0.2 s) lose nothing and do not
//!   deadlock: every round of every node verified.
//!
//! Invariants only, never timings; the tests run one at a time, and never beside another
//! fabric (each runs a fabric and four processes, and holds the [`FabricLock`]). Every test
//! first checks that its fabric kept its clock (else it fails with the reason: the run
//! tested the machine's load, not the code). The tests run the `gradwire` executable of this
//! build (`cargo build -p gradwire-cli` first, before taking the lock; a no-op when `cargo
//! test --workspace` built it), or `GRADWIRE_BIN`. Everything runs in namespaces the driver
//! creates and removes, bounded by the nodes' timeouts and the driver's deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use gradwire_experiment::wan::{
    network_topology, run_strategy, summarize, Network, NodeFault, WanConfig, WanResult, WAN4,
};
use gradwire_fabric::topology::Topology;
use gradwire_netns::{require_root, FabricLock};
use gradwire_wan::scheduler::Strategy;

/// One fabric at a time, in this binary and in any other test or process: each test runs a
/// fabric and four node processes, and two at once on a 2-core machine push the fabric
/// behind its clock and stretch rounds past what the timing-dependent tests allow. A test
/// that failed while holding it leaves nothing behind (its driver tore down). The
/// `gradwire` executable is built first: a `cargo build` under the lock would hold up every
/// other fabric for its whole length.
fn serial() -> FabricLock {
    gradwire_exe();
    FabricLock::acquire().expect("the fabric lock")
}

/// The fabric kept its clock, checked before anything else: a fabric that fell behind
/// stretches rounds and starves links, so every other check would judge the machine's load
/// instead of the code.
fn assert_fabric_kept_its_clock(r: &WanResult) {
    assert!(
        r.fabric.valid,
        "{} on the {} network: the fabric fell behind its clock, so this run tests nothing: {} \
         ({:?})",
        r.strategy,
        r.network,
        r.exclusion().unwrap_or_default(),
        r.fabric
    );
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The workspace's Rust sources and manifests modified after `exe` was built (`exe` itself
/// when it cannot be read): a stale binary would test old code and pass.
fn newer_sources(exe: &Path) -> Vec<PathBuf> {
    let Ok(built) = std::fs::metadata(exe).and_then(|m| m.modified()) else {
        return vec![exe.to_owned()];
    };
    let mut newer = Vec::new();
    let mut dirs = vec![root()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    dirs.push(path);
                }
            } else if (name.ends_with(".rs")
                || name == "Cargo.toml"
                || name == "Cargo.lock"
                // The XDP programs ebpf/build.rs compiles into the binary.
                || (path.starts_with(root().join("ebpf"))
                    && (name.ends_with(".c") || name.ends_with(".h"))))
                && e.metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t > built)
            {
                newer.push(path);
            }
        }
    }
    newer
}

#[test]
fn a_stale_gradwire_bin_is_refused() {
    let dir = std::env::temp_dir().join(format!("gw-stale-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let old = dir.join("gradwire");
    let f = std::fs::File::create(&old).unwrap();
    // Built in 1970: every source is newer.
    f.set_modified(std::time::SystemTime::UNIX_EPOCH).unwrap();
    drop(f);
    let newer = newer_sources(&old);
    for f in ["ebpf/build.rs", "ebpf/Cargo.toml", "Cargo.lock"] {
        assert!(newer.iter().any(|p| p.ends_with(f)), "{f} not checked");
    }
    assert!(
        newer
            .iter()
            .any(|p| p.starts_with(root().join("ebpf")) && p.extension().is_some_and(|e| e == "c")),
        "the BPF C sources are not checked"
    );
    assert_eq!(
        newer_sources(&dir.join("missing")),
        vec![dir.join("missing")]
    );
    // The test binary itself was built after every source it was compiled from.
    let me = std::env::current_exe().unwrap();
    let fresh: Vec<_> = newer_sources(&me)
        .into_iter()
        .filter(|p| p.starts_with(root().join("experiment")))
        .collect();
    assert!(fresh.is_empty(), "{fresh:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `gradwire` executable of this build: `GRADWIRE_BIN`, else built next to this test
/// (target/<profile>/gradwire).
fn gradwire_exe() -> PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        if let Some(p) = std::env::var_os("GRADWIRE_BIN") {
            let p = PathBuf::from(p);
            let newer = newer_sources(&p);
            assert!(
                newer.is_empty(),
                "GRADWIRE_BIN={} is older than the sources it would test ({:?} changed since \
                 it was built): rebuild it or unset GRADWIRE_BIN",
                p.display(),
                &newer[..newer.len().min(3)]
            );
            return p;
        }
        // target/<profile>/deps/wan_short-<hash>
        let me = std::env::current_exe().unwrap();
        let profile = me.parent().and_then(Path::parent).unwrap().to_owned();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "--locked",
            "-p",
            "gradwire-cli",
            "--bin",
            "gradwire",
        ])
        .current_dir(root());
        if profile.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo to build gradwire");
        assert!(
            status.success(),
            "building gradwire failed ({status}); build it (cargo build -p gradwire-cli) or set \
             GRADWIRE_BIN"
        );
        let exe = profile.join("gradwire");
        assert!(exe.exists(), "{} was not built", exe.display());
        exe
    })
    .clone()
}

/// A small model file in a directory removed on drop.
struct TinyModel {
    dir: PathBuf,
}

impl TinyModel {
    fn new(tag: &str, layers: &[u64]) -> TinyModel {
        let dir = std::env::temp_dir().join(format!("gradwire-wan-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut text = format!(
            "name = \"tiny\"\ntotal_params = {}\n",
            layers.iter().sum::<u64>()
        );
        for (i, n) in layers.iter().enumerate() {
            text.push_str(&format!("\n[[layers]]\nname = \"l{i}\"\nparams = {n}\n"));
        }
        std::fs::write(dir.join("tiny.toml"), text).unwrap();
        TinyModel { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.join("tiny.toml")
    }
}

impl Drop for TinyModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(model: &TinyModel) -> WanConfig {
    let mut cfg = WanConfig::new(&root(), gradwire_exe());
    cfg.topology = root().join(WAN4);
    cfg.model = model.path();
    cfg.scale = 1.0;
    cfg.iterations = 2;
    cfg.duration = None;
    cfg.timeout = Duration::from_secs(20);
    cfg.netstorm.chunk_size = 8_000;
    cfg.netstorm.probe_chunk_size = 16_000;
    cfg
}

fn run(cfg: &WanConfig, network: Network, strategy: Strategy) -> WanResult {
    let topo = Topology::load(&cfg.topology).unwrap();
    let variant = network_topology(&topo, network);
    let duration = cfg.duration;
    summarize(
        strategy,
        network,
        run_strategy(cfg, &variant, &cfg.topology, strategy, duration),
    )
}

fn assert_verified(r: &WanResult, rounds: u32) {
    assert_fabric_kept_its_clock(r);
    assert!(r.error.is_none(), "{}: {:?}", r.strategy, r.error);
    assert!(r.verified, "{}: not verified", r.strategy);
    assert!(
        r.valid,
        "{}: not a result: {}",
        r.strategy,
        r.exclusion().unwrap_or_default()
    );
    assert_eq!(r.nodes.len(), 4, "{}", r.strategy);
    for n in &r.nodes {
        let o = n.output.as_ref().unwrap();
        assert!(o.verified && o.rounds >= rounds, "{}: {o:?}", r.strategy);
        assert_eq!(o.sync_ms.len(), o.rounds as usize);
    }
}

#[test]
fn every_strategy_gives_every_node_the_exact_average() {
    if !require_root("every_strategy_gives_every_node_the_exact_average") {
        return;
    }
    let _serial = serial();
    let model = TinyModel::new("all", &[30_000, 20_000, 10_007]);
    let cfg = config(&model);
    for s in Strategy::ALL {
        let r = run(&cfg, Network::Static, s);
        assert_verified(&r, 2);
        assert_eq!(r.rounds, 2, "{s}");
        assert!(r.policies >= 1, "{s}: the scheduler reported no policy");
        assert_aux(&r, s.aux());
    }
}

/// `+aux` sent chunks on auxiliary paths, each relayed at least once (the direct link is
/// the primary edge), and the averages were still exact (checked before); the others none.
fn assert_aux(r: &WanResult, aux: bool) {
    if aux {
        assert!(
            r.aux_chunks > 0 && r.relayed > 0,
            "{}: {} chunks sent and {} relayed on auxiliary paths",
            r.strategy,
            r.aux_chunks,
            r.relayed
        );
    } else {
        assert_eq!((r.aux_chunks, r.relayed), (0, 0), "{}", r.strategy);
    }
}

#[test]
fn a_site_that_stops_answering_fails_the_others_naming_it() {
    if !require_root("a_site_that_stops_answering_fails_the_others_naming_it") {
        return;
    }
    let _serial = serial();
    let model = TinyModel::new("dead", &[30_000, 20_000]);
    let mut cfg = config(&model);
    cfg.iterations = 100_000;
    cfg.duration = Some(Duration::from_secs(60));
    cfg.timeout = Duration::from_secs(10);
    cfg.fault = Some(NodeFault {
        rank: 2,
        after_rounds: 2,
    });
    let r = run(&cfg, Network::Static, Strategy::MrFaptAwareAux);
    assert_fabric_kept_its_clock(&r);
    let dead = &r.nodes[2];
    assert!(dead.output.is_none(), "node 2 was not killed: {dead:?}");
    let survivors: Vec<_> = r.nodes.iter().filter(|n| n.rank != 2).collect();
    let mut blames = Vec::new();
    for n in &survivors {
        let e = n
            .error
            .as_deref()
            .unwrap_or_else(|| panic!("node {} did not fail although node 2 died: {n:?}", n.rank));
        // Its failure report (`--json`) gives the nodes it blames and the timeout that
        // fired as data.
        let f = n
            .failure
            .as_ref()
            .unwrap_or_else(|| panic!("node {} wrote no failure report: {e} ({n:?})", n.rank));
        assert_eq!(f.rank, n.rank);
        // A timeout that fired is the configured one, the message says so, and the node
        // waited it in full by its own clock (a lower bound: load only makes a wait longer;
        // the driver's deadline bounds the rest).
        if let Some(t) = f.timeout_s {
            assert_eq!(t, cfg.timeout.as_secs_f64(), "node {}: {}", n.rank, f.error);
            let waited = f.waited_s.expect("a timeout without the time waited");
            assert!(
                waited >= t,
                "node {} gave up after {waited} s: {}",
                n.rank,
                f.error
            );
            assert!(
                f.error
                    .contains(&format!("within {:?}, the round timeout", cfg.timeout)),
                "node {}: the error does not say which timeout fired: {}",
                n.rank,
                f.error
            );
        }
        blames.push((n.rank, f.blamed.clone(), f.error.clone()));
    }
    assert_traceable(&blames, 2);
}

/// Every error names `dead`, or a node whose error does (a node that failed because a
/// neighbour failed before it names that neighbour): the cause is always traceable. Each
/// entry: the node, the nodes its failure report blames, its error.
fn assert_traceable(errors: &[(usize, Vec<usize>, String)], dead: usize) {
    let mut traced = vec![dead];
    loop {
        let more: Vec<usize> = errors
            .iter()
            .filter(|(r, b, _)| !traced.contains(r) && traced.iter().any(|k| b.contains(k)))
            .map(|(r, ..)| *r)
            .collect();
        if more.is_empty() {
            break;
        }
        traced.extend(more);
    }
    for (r, b, e) in errors {
        assert!(
            traced.contains(r),
            "node {r}'s error leads to node {dead} through no chain of errors: {e} (blames \
             {b:?}; all: {errors:?})"
        );
    }
}

/// wan4's s0-s1 (sites 0 and 1) drops from the fastest link (16 Mbit/s) to the slowest
/// (2 Mbit/s) 10 s after the fabric starts.
const DROP_S: f64 = 10.0;

#[test]
fn a_link_whose_rate_drops_is_avoided_at_the_next_refresh() {
    if !require_root("a_link_whose_rate_drops_is_avoided_at_the_next_refresh") {
        return;
    }
    let _serial = serial();
    let model = TinyModel::new("drop", &[120_000, 80_000]);
    let mut cfg = config(&model);
    cfg.iterations = 100_000;
    cfg.duration = Some(Duration::from_secs(22));
    cfg.netstorm.chunk_size = 25_000;
    cfg.netstorm.probe_chunk_size = 50_000;
    cfg.netstorm.probe_chunk_num = 2;
    cfg.netstorm.update_time = Duration::from_secs(1);
    let r = run(&cfg, Network::Dynamic, Strategy::MrFaptAware);
    assert_verified(&r, 1);
    let sched = r.nodes[0]
        .output
        .as_ref()
        .and_then(|o| o.scheduler.clone())
        .expect("rank 0 serves the scheduler and reports it");
    let first = sched.policies.first().unwrap();
    assert!(
        first.uses_link(0, 1),
        "the first policy does not use s0-s1, the fastest link, so its drop tests nothing: {first:?}"
    );
    let last = sched.policies.last().unwrap();
    // The scheduler starts after the fabric: its clock is behind the schedule's.
    assert!(
        last.at_ms / 1e3 >= DROP_S - 1.0,
        "no policy after the drop at {DROP_S} s: {:?}",
        sched.policies
    );
    assert!(
        !last.uses_link(0, 1),
        "the last policy (at {:.1} s) still uses s0-s1 after its drop: {last:?} (all: {:?})",
        last.at_ms / 1e3,
        sched.policies
    );
    assert!(r.link_reports > 0, "no link reports with awareness on");
}

#[test]
fn policy_switches_between_rounds_lose_nothing_and_do_not_deadlock() {
    if !require_root("policy_switches_between_rounds_lose_nothing_and_do_not_deadlock") {
        return;
    }
    let _serial = serial();
    let model = TinyModel::new("switch", &[120_000, 80_000]);
    let mut cfg = config(&model);
    cfg.iterations = 100_000;
    cfg.duration = Some(Duration::from_secs(24));
    cfg.netstorm.chunk_size = 25_000;
    cfg.netstorm.probe_chunk_size = 50_000;
    cfg.netstorm.probe_chunk_num = 2;
    cfg.netstorm.update_time = Duration::from_millis(200);
    let r = run(&cfg, Network::Dynamic, Strategy::MrFaptAwareAux);
    assert_verified(&r, 2);
    assert!(
        r.policies >= 2 && r.versions_used.len() >= 2,
        "the policy never changed ({} policies, versions used {:?}): nothing was switched",
        r.policies,
        r.versions_used
    );
    // Every node ran every round (the control element stops all after the same one).
    let rounds: Vec<u32> = r
        .nodes
        .iter()
        .map(|n| n.output.as_ref().unwrap().rounds)
        .collect();
    assert!(rounds.iter().all(|&k| k == rounds[0]), "{rounds:?}");
    assert_aux(&r, true);
}
