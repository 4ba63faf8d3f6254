//! `gradwire wan node` on loopback (no root): three nodes, one process each, synchronize a
//! small model with every strategy, each node checking every element of every round, and
//! `+aux` sends and relays chunks on auxiliary paths; a node that never comes and a node
//! that dies mid-run end the others with errors naming it, read from the failure report a
//! node prints with `--json` (the nodes it blames and the timeout that fired, as data: no
//! message is parsed); a timeout that fired is the configured one, and the node waited it
//! in full by its own clock; a topology that is not a WAN of sites is refused with its
//! reason. Every child is killed by its guard if a test fails half-way, and every wait is
//! bounded by a hang guard far beyond what the run takes (at least 5x the longest timeout
//! a node is given: only a hang trips it, never a slow machine).
//!
//! Each job has a loopback address of its own (127.x.y.z, unique per job and process), so
//! no node can ever meet another job's, whatever the other tests run meanwhile; a port
//! on it can only be taken by a wildcard listener, and a run whose node reports its port in
//! use (EADDRINUSE) is run again on another address and port.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{ChildGuard, TempDir};

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire_wan::site::NodeFailure;

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

/// A loopback address for the next job: 127.(80 + job).(pid / 254 % 256).(1 + pid % 254),
/// so that jobs of this process differ in the second byte and processes (pids less than
/// 65 024 apart) in the last two. Other tests use 127.0.0.1 and 127.61-127.64.
fn job_ip() -> Ipv4Addr {
    static NEXT: AtomicU8 = AtomicU8::new(0);
    let k = NEXT.fetch_add(1, Ordering::Relaxed);
    assert!(k < 100, "more than 100 jobs in one test process");
    let pid = std::process::id();
    Ipv4Addr::new(127, 80 + k, (pid / 254 % 256) as u8, (1 + pid % 254) as u8)
}

struct Job {
    dir: TempDir,
    ip: Ipv4Addr,
    master: SocketAddr,
}

impl Job {
    fn new(tag: &str) -> Job {
        let dir = TempDir::new("gw-wan", tag);
        dir.write("w3.toml", TOPO3);
        dir.write("tiny.toml", MODEL);
        let ip = job_ip();
        // Rendezvous, scheduler (+1) and final barrier (+2) on the job's own address; a
        // retried job gets other ports too (a wildcard listener may hold these).
        let master = SocketAddr::from((ip, 29_500 + 3 * u16::from(ip.octets()[1] - 80)));
        Job { dir, ip, master }
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
            .args(["--master", &self.master.to_string()])
            .args(["--host", &self.ip.to_string()])
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

/// Waits for every child, at most `limit` (a hang guard: the guards kill them all when it
/// fails); their outputs in order.
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

/// A node could not bind a port the test found free: another process took it meanwhile.
fn port_taken(stderr: &str) -> bool {
    stderr.contains("Address already in use") || stderr.contains("os error 98")
}

/// How many runs a test makes before a port race is a failure.
const ATTEMPTS: usize = 5;

/// The failure report a failed node printed on stdout (`--json`).
fn failure(o: &Output) -> NodeFailure {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no failure report on stdout ({e}): {}\nstderr: {}",
            text(&o.stdout),
            text(&o.stderr)
        )
    })
}

/// A timeout that fired is `timeout`, the message says so, and the node waited it in full by
/// its own clock (a lower bound: load only makes a wait longer).
fn assert_timeout_is(f: &NodeFailure, timeout: f64) {
    if let Some(t) = f.timeout_s {
        assert_eq!(t, timeout, "node {}: {}", f.rank, f.error);
        let waited = f.waited_s.expect("a timeout without the time waited");
        assert!(
            waited >= timeout,
            "node {} gave up after {waited} s: {}",
            f.rank,
            f.error
        );
        assert!(
            f.error.contains(&format!(
                "within {:?}, the round timeout",
                Duration::from_secs_f64(timeout)
            )),
            "node {}: the error does not say which timeout fired: {}",
            f.rank,
            f.error
        );
    }
}

#[test]
fn three_nodes_get_the_exact_average_with_every_strategy() {
    for s in STRATEGIES {
        let mut attempt = 0;
        let outs = loop {
            attempt += 1;
            let job = Job::new(&format!("all-{}-{attempt}", s.replace('+', "_")));
            let children: Vec<ChildGuard> = (0..3)
                .map(|r| {
                    ChildGuard::spawn(&mut job.node(
                        r,
                        s,
                        &["--iterations", "3", "--timeout", "20"],
                    ))
                })
                .collect();
            let outs = wait_all(children, Duration::from_secs(120));
            if attempt < ATTEMPTS && outs.iter().any(|o| port_taken(&text(&o.stderr))) {
                continue;
            }
            break outs;
        };
        let (mut sent_aux, mut relayed) = (0, 0);
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
            sent_aux += v["sent_aux"].as_u64().unwrap();
            relayed += v["relayed"].as_u64().unwrap();
            if r == 0 {
                let policies = v["scheduler"]["policies"].as_array().unwrap();
                assert!(!policies.is_empty(), "{s}: {v}");
            } else {
                assert!(v["scheduler"].is_null());
            }
        }
        // Auxiliary paths carry chunks with `+aux` only; every one sent has a relay (the
        // direct link is the primary edge), and the averages above are still exact.
        if s.ends_with("+aux") {
            assert!(
                sent_aux > 0 && relayed > 0,
                "{s}: {sent_aux} chunks sent and {relayed} relayed on auxiliary paths"
            );
        } else {
            assert_eq!((sent_aux, relayed), (0, 0), "{s}");
        }
    }
}

#[test]
fn a_node_that_never_comes_is_named_when_the_rendezvous_times_out() {
    let mut attempt = 0;
    let out = loop {
        attempt += 1;
        let job = Job::new(&format!("missing-{attempt}"));
        let child = ChildGuard::spawn(&mut job.node(0, "mr-fapt", &["--timeout", "2"]));
        let out = wait_all(vec![child], Duration::from_secs(60)).remove(0);
        if attempt < ATTEMPTS && port_taken(&text(&out.stderr)) {
            continue;
        }
        break out;
    };
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("node 0")
            && err.contains("rendezvous timed out")
            && err.contains("never joined"),
        "{err}"
    );
    // The report names exactly the ranks that never came, as data.
    let f = failure(&out);
    assert_eq!(f.rank, 0);
    assert_eq!(f.blamed, vec![1, 2], "{}", f.error);
    assert!(err.contains(&f.error), "{err} vs {}", f.error);
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

/// What a node's stderr reader saw.
enum Seen {
    /// Node 2 finished its second round.
    Round2,
    /// A node could not bind its port.
    PortTaken,
}

#[test]
fn a_node_that_dies_mid_run_fails_the_others_naming_it() {
    let extra = [
        "--iterations",
        "100000",
        "--duration",
        "60",
        "--timeout",
        "8",
    ];
    let mut attempt = 0;
    let (_job, mut children, readers) = loop {
        attempt += 1;
        let job = Job::new(&format!("dead-{attempt}"));
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
                            let _ = tx.send(Seen::Round2);
                        }
                        if port_taken(&line) {
                            let _ = tx.send(Seen::PortTaken);
                        }
                        kept.push(line);
                    }
                    kept
                })
            })
            .collect();
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Seen::Round2) => break (job, children, readers),
            // The guards kill this attempt's nodes; the readers end with their pipes.
            Ok(Seen::PortTaken) if attempt < ATTEMPTS => continue,
            Ok(Seen::PortTaken) => panic!("a port was taken in each of {ATTEMPTS} attempts"),
            Err(e) => panic!("node 2 never finished two rounds ({e})"),
        }
    };
    children[2].child().kill().unwrap();
    // Each survivor fails; a hang guard of 180 s, 22x the 8 s timeout, bounds the wait (the
    // guards kill everything when it fails). That each ended by the timeout, not the guard,
    // is what its report says: a closed link, or the 8 s timeout fired.
    let outs = wait_all(children.drain(..2).collect(), Duration::from_secs(180));
    for (r, o) in outs.iter().enumerate() {
        assert!(
            !o.status.success(),
            "node {r} succeeded although node 2 died"
        );
    }
    // The readers end with the pipes; the survivors' last lines say how they ended.
    for (r, h) in readers.into_iter().enumerate().take(2) {
        let lines = h.join().unwrap();
        eprintln!("node {r}'s last line: {:?}", lines.last());
    }
    let failures: Vec<NodeFailure> = outs.iter().map(failure).collect();
    for (r, f) in failures.iter().enumerate() {
        eprintln!("node {r}'s failure: {f:?}");
        assert_eq!(f.rank, r);
        assert_timeout_is(f, 8.0);
    }
    // Each error names node 2, or the survivor whose failure caused it (its links closed
    // as it exited), whose own error names node 2: the cause is always traceable. Exit
    // order is not failure order, so the chain is followed by what the reports say.
    for r in 0..2 {
        let other = 1 - r;
        let (mine, theirs) = (&failures[r], &failures[other]);
        assert!(
            mine.blamed.contains(&2)
                || (mine.blamed.contains(&other) && theirs.blamed.contains(&2)),
            "node {r}'s error leads to node 2 through no chain of errors: {mine:?} (node \
             {other}: {theirs:?})"
        );
    }
}
