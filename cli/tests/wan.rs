//! `gradwire wan node` on loopback (no root): three nodes, one process each, synchronize a
//! small model with every strategy, each node checking every element of every round, and
//! `+aux` sends and relays chunks on auxiliary paths; a node that never comes and a node
//! that dies mid-run end the others with errors naming it (a round timeout being the
//! configured one); a topology that is not a WAN of sites is refused with its reason.
//! Every child is killed by its guard if a test fails half-way, and every wait is bounded
//! by a deadline far beyond what the run takes (a hang guard, never a timing).
//!
//! The nodes bind the rendezvous, scheduler and barrier ports themselves, so a port found
//! free may be taken before they bind it: a run whose node reports the port in use
//! (EADDRINUSE) is run again on new ports.

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

/// A rendezvous port whose next two (scheduler, final barrier) are free too, when looked.
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

/// The number at the start of `s` (all its leading digits).
fn number(s: &str) -> Option<usize> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().ok()
}

/// The list `[a, b, ...]` at the start of `s`, every element a number.
fn list(s: &str) -> Vec<usize> {
    let body = s
        .strip_prefix('[')
        .and_then(|r| r.split_once(']'))
        .map(|(b, _)| b)
        .unwrap_or_else(|| panic!("not a list: {s}"));
    if body.trim().is_empty() {
        return Vec::new();
    }
    body.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .unwrap_or_else(|_| panic!("not a node list: [{body}]"))
        })
        .collect()
}

/// The nodes an error names as the cause, parsed exactly: a broken "link with node N", the
/// nodes whose links closed ("links closed by nodes [..]", "links closed before by nodes
/// [..]"), the node serving a lost scheduler ("served by node N"), the ranks that "never
/// joined". The failing node's own prefix ("node R: ...") is not a cause.
fn blamed(e: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for (key, is_list) in [
        ("link with node ", false),
        ("served by node ", false),
        ("links closed by nodes ", true),
        ("links closed before by nodes ", true),
        ("rank(s) ", true),
    ] {
        for (at, _) in e.match_indices(key) {
            let rest = &e[at + key.len()..];
            if is_list {
                out.extend(list(rest));
            } else if let Some(n) = number(rest) {
                out.push(n);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[test]
fn the_error_parser_reads_node_numbers_and_lists_exactly() {
    assert_eq!(
        blamed("node 0, round 3: link with node 12: closed (links closed before by nodes [2])"),
        vec![2, 12]
    );
    assert_eq!(
        blamed("node 1, round 2: round 2 did not finish within 8s (3 chunks still missing; links closed by nodes [20, 0]): ..."),
        vec![0, 20]
    );
    assert_eq!(blamed("rank(s) [1, 2] never joined"), vec![1, 2]);
    // What a substring match took for node 2: another number, a longer list, the failing
    // node's own prefix.
    assert_eq!(blamed("links closed by nodes [21]"), vec![21]);
    assert!(!blamed("node 2, round 1: link with node 0: closed").contains(&2));
    assert!(!blamed("node 1: link with node 23: closed").contains(&2));
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
    let at = err.find("rank(s) ").expect("no ranks named") + "rank(s) ".len();
    assert_eq!(list(&err[at..]), vec![1, 2], "{err}");
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
    // Each survivor fails; a hang guard far beyond the 8 s timeout bounds the wait (the
    // guards kill everything when it fails).
    let statuses: Vec<_> = wait_all(children.drain(..2).collect(), Duration::from_secs(180))
        .into_iter()
        .map(|o| o.status)
        .collect();
    for (r, s) in statuses.iter().enumerate() {
        assert!(!s.success(), "node {r} succeeded although node 2 died");
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
    for (r, e) in errors.iter().enumerate() {
        eprintln!("node {r}'s error: {e}");
        // A round that timed out did so after the configured timeout.
        if e.contains("did not finish within") {
            assert!(e.contains("did not finish within 8s"), "node {r}: {e}");
        }
    }
    // Each error names node 2, or the survivor whose failure caused it (its links closed
    // as it exited), whose own error names node 2: the cause is always traceable. Exit
    // order is not failure order, so the chain is followed by what the errors say.
    let blames: Vec<Vec<usize>> = errors.iter().map(|e| blamed(e)).collect();
    for r in 0..2 {
        let other = 1 - r;
        assert!(
            blames[r].contains(&2) || (blames[r].contains(&other) && blames[other].contains(&2)),
            "node {r}'s error leads to node 2 through no chain of errors: {} (node {other}: {})",
            errors[r],
            errors[other]
        );
    }
}
