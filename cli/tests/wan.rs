//! `gradwire wan node` on loopback (no root): three nodes, one process each, synchronize a
//! small model with every strategy, each node checking every element of every round; a node
//! that never comes and a node that dies mid-run end the others with errors naming it,
//! within the timeout; a topology that is not a WAN of sites is refused with its reason.
//! Every child is killed by its guard if a test fails half-way.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{ChildGuard, TempDir};

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gradwire");
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Three sites in a line plus a shortcut: a-b fast, b-c slow, a-c slower.
const TOPO3: &str = r#"
name = "w3"
[defaults]
rate = "100Mbit"
thresholds = "none"
[[switch]]
name = "a"
[[switch]]
name = "b"
[[switch]]
name = "c"
[[host]]
name = "ha"
uplink = "a"
[[host]]
name = "hb"
uplink = "b"
[[host]]
name = "hc"
uplink = "c"
[[link]]
a = "a"
b = "b"
rate = "50Mbit"
[[link]]
a = "b"
b = "c"
rate = "20Mbit"
[[link]]
a = "a"
b = "c"
rate = "10Mbit"
"#;

const MODEL: &str = "name = \"tiny\"\n[[layers]]\nname = \"w\"\nparams = 40000\n\
                     [[layers]]\nname = \"b\"\nparams = 1001\n";

const STRATEGIES: [&str; 7] = [
    "star",
    "bkt",
    "mst",
    "fapt",
    "mr-fapt",
    "mr-fapt+aware",
    "mr-fapt+aware+aux",
];

/// A rendezvous port whose next two (scheduler, final barrier) are free too.
fn free_ports() -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < 65_000 && (1..=2).all(|k| TcpListener::bind(("127.0.0.1", p + k)).is_ok()) {
            return p;
        }
    }
    panic!("no three consecutive free ports on 127.0.0.1");
}

struct Job {
    dir: TempDir,
    master: SocketAddr,
}

impl Job {
    fn new(tag: &str) -> Job {
        let dir = TempDir::new("gw-wan", tag);
        dir.write("w3.toml", TOPO3);
        dir.write("tiny.toml", MODEL);
        let master = SocketAddr::from(([127, 0, 0, 1], free_ports()));
        Job { dir, master }
    }

    /// `gradwire wan node` for `rank` of `world` with `extra` arguments; rank 0 serves the
    /// scheduler with `topology` (default: the three sites).
    fn node_in(
        &self,
        rank: usize,
        world: usize,
        strategy: &str,
        topology: Option<&str>,
        extra: &[&str],
    ) -> Command {
        let mut c = Command::new(BIN);
        c.args(["wan", "node", "--rank", &rank.to_string()])
            .args(["--world", &world.to_string()])
            .args(["--master", &self.master.to_string(), "--host", "127.0.0.1"])
            .args(["--strategy", strategy, "--json"])
            .args(["--model", self.dir.0.join("tiny.toml").to_str().unwrap()])
            .args(["--scale", "1", "--rate", "1Gbit", "--chunk-size", "5000"])
            .args(["--probe-chunk-size", "10000", "--update-time", "0.2"])
            .args(extra)
            .env("GRADWIRE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if rank == 0 {
            let default = self.dir.0.join("w3.toml");
            c.args(["--serve-scheduler", "--topology"])
                .arg(topology.unwrap_or(default.to_str().unwrap()));
        }
        c
    }

    fn node(&self, rank: usize, strategy: &str, extra: &[&str]) -> Command {
        self.node_in(rank, 3, strategy, None, extra)
    }
}

/// Waits for every child, at most `limit`; their outputs in order.
fn wait_all(children: Vec<ChildGuard>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    let mut children = children;
    loop {
        let done = children
            .iter_mut()
            .all(|c| matches!(c.child().try_wait(), Ok(Some(_))));
        if done {
            break;
        }
        assert!(
            start.elapsed() < limit,
            "the nodes did not finish within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .map(ChildGuard::wait_with_output)
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn three_nodes_get_the_exact_average_with_every_strategy() {
    for s in STRATEGIES {
        let job = Job::new(&format!("all-{}", s.replace('+', "_")));
        let children: Vec<ChildGuard> = (0..3)
            .map(|r| {
                ChildGuard::spawn(&mut job.node(r, s, &["--iterations", "3", "--timeout", "20"]))
            })
            .collect();
        let outs = wait_all(children, Duration::from_secs(90));
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.status.success(),
                "{s}: node {r} failed: {}",
                text(&o.stderr)
            );
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["verified"], true, "{s}: {v}");
            assert_eq!(v["rank"], r);
            assert_eq!(v["rounds"], 3, "{s}: {v}");
            assert_eq!(v["elements"], 41_002);
            assert_eq!(v["sync_ms"].as_array().unwrap().len(), 3);
            assert_eq!(v["strategy"], s);
            if r == 0 {
                let policies = v["scheduler"]["policies"].as_array().unwrap();
                assert!(!policies.is_empty(), "{s}: {v}");
            } else {
                assert!(v["scheduler"].is_null());
            }
        }
    }
}

#[test]
fn a_node_that_never_comes_is_named_within_the_timeout() {
    let job = Job::new("missing");
    let start = Instant::now();
    let out = job
        .node(0, "mr-fapt", &["--timeout", "2"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("node 0") && err.contains("[1, 2]") && err.contains("never joined"),
        "{err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_topology_that_is_not_a_wan_of_sites_is_refused() {
    let job = Job::new("badtopo");
    // Four hosts on each leaf of the MLNET leaf-spine: not one site per switch.
    let mlnet = format!("{ROOT}/testbeds/mlnet.toml");
    let out = job
        .node_in(0, 12, "fapt", Some(&mlnet), &["--timeout", "2"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("node 0") && err.contains("share switch leaf0"),
        "{err}"
    );
    // The site count must be the world size.
    let out = job
        .node_in(0, 2, "fapt", None, &["--timeout", "2"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("3 sites") && err.contains("--world is 2"),
        "{err}"
    );
    // A file that does not exist.
    let out = job
        .node_in(
            0,
            3,
            "fapt",
            Some("/nonexistent/wan.toml"),
            &["--timeout", "2"],
        )
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("/nonexistent/wan.toml"), "{err}");
}

#[test]
fn a_node_that_dies_mid_run_fails_the_others_naming_it() {
    let job = Job::new("dead");
    let extra = [
        "--iterations",
        "100000",
        "--duration",
        "60",
        "--timeout",
        "8",
    ];
    let mut children: Vec<ChildGuard> = (0..3)
        .map(|r| ChildGuard::spawn(&mut job.node(r, "mr-fapt+aware+aux", &extra)))
        .collect();
    // Every node's stderr is drained (its per-round lines would fill the pipe); node 2's
    // second round triggers its death.
    let (tx, rx) = mpsc::channel();
    let readers: Vec<_> = children
        .iter_mut()
        .enumerate()
        .map(|(r, c)| {
            let stderr = c.child().stderr.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if r == 2 && line.starts_with("node 2: round 2/") {
                        let _ = tx.send(());
                    }
                    kept.push(line);
                }
                kept
            })
        })
        .collect();
    rx.recv_timeout(Duration::from_secs(60))
        .expect("node 2 never finished two rounds");
    children[2].child().kill().unwrap();
    let killed = Instant::now();
    // Each survivor fails within the timeout; record when.
    let mut ended: Vec<Option<Duration>> = vec![None, None];
    while ended.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate().take(2) {
            if ended[r].is_none() {
                if let Some(s) = c.child().try_wait().unwrap() {
                    assert!(!s.success(), "node {r} succeeded although node 2 died");
                    ended[r] = Some(killed.elapsed());
                }
            }
        }
        assert!(
            killed.elapsed() < Duration::from_secs(8 + 10),
            "nodes still run {:?} after node 2 died (timeout 8 s): {ended:?}",
            killed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let errors: Vec<String> = readers
        .into_iter()
        .take(2)
        .map(|h| {
            let lines = h.join().unwrap();
            lines
                .iter()
                .rev()
                .find(|l| l.contains("error:"))
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    // Each error names node 2, or the survivor whose failure caused it (its links closed
    // as it exited), whose own error names node 2: the cause is always traceable. Exit
    // order is not failure order, so the chain is followed by what the errors say.
    let names =
        |e: &str, n: usize| e.contains(&format!("node {n}")) || e.contains(&format!("[{n}"));
    for r in 0..2 {
        let other = 1 - r;
        assert!(
            names(&errors[r], 2) || (names(&errors[r], other) && names(&errors[other], 2)),
            "node {r}'s error leads to node 2 through no chain of errors: {} (node {other}: {})",
            errors[r],
            errors[other]
        );
    }
}
