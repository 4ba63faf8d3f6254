//! `gradwire testbed` and `gradwire fabric` end to end: clear errors for bad input (any user),
//! and as root a whole testbed life cycle: up, a TCP transfer between two hosts through the
//! emulated switch, the fabric's counters, status, down. The JSON the commands print is read
//! back as the library's types ([`TestbedStatus`], [`FabricStats`]). Every wait is for a
//! condition, bounded; every process a test starts is stopped when the test ends, passing or
//! failing (the fabric by `testbed down` in a guard).

#![allow(clippy::unwrap_used)]

mod common;

use common::{ChildGuard, TempDir};

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire_fabric::stats::FabricStats;
use gradwire_fabric::supervise::TestbedStatus;
use gradwire_netns::{require_root, run_in_netns, spawn_in_netns};

/// Runs `gradwire args`, killed after `timeout`; `None` if it had to be killed.
fn try_gradwire(args: &[&str], timeout: Duration) -> Option<Output> {
    let mut child = ChildGuard(Some(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .ok()?,
    ));
    let mut so = child.child().stdout.take()?;
    let mut se = child.child().stderr.take()?;
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Ok(Some(s)) = child.child().try_wait() {
            break s;
        }
        if Instant::now() >= deadline {
            // Dropping the guard kills it.
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Some(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

fn gradwire(args: &[&str], timeout: Duration) -> Output {
    try_gradwire(args, timeout).unwrap_or_else(|| {
        panic!(
            "`gradwire {}` did not finish within {timeout:?}",
            args.join(" ")
        )
    })
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Fails with `args` and returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = gradwire(args, Duration::from_secs(20));
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "`gradwire {}` succeeded: {}",
        args.join(" "),
        text(&out.stdout)
    );
    assert!(err.starts_with("gradwire: error: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Succeeds with `args` and returns its stdout.
fn succeeds(args: &[&str], timeout: Duration) -> String {
    let out = gradwire(args, timeout);
    assert!(
        out.status.success(),
        "`gradwire {}` failed: {}{}",
        args.join(" "),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// A name unique to this test run: `<letter>` + the last 5 digits of the pid.
fn unique_name(letter: char) -> String {
    format!("{letter}{:05}", std::process::id() % 100_000)
}

fn topology(name: &str) -> String {
    format!(
        "name = \"{name}\"\n\n[defaults]\nrate = \"100Mbit\"\ndelay = \"20us\"\n\n\
         [[switch]]\nname = \"s0\"\n\n[[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n"
    )
}

#[test]
fn up_of_a_missing_file_names_it() {
    let err = fails(&["testbed", "up", "/nonexistent.toml"]);
    assert!(err.contains("/nonexistent.toml"), "{err}");
    assert!(err.contains("cannot read"), "{err}");
}

#[test]
fn up_of_a_malformed_topology_names_the_field() {
    let dir = TempDir::new("gradwire-testbed-cli", "bad");
    let bad_name = dir.write(
        "badname.toml",
        "name = \"Bad!\"\n[[switch]]\nname = \"s0\"\n",
    );
    let err = fails(&["testbed", "up", &bad_name]);
    assert!(err.contains(&bad_name), "{err}");
    assert!(err.contains("field `name`"), "{err}");

    let bad_rate = dir.write("badrate.toml", &topology("ok").replace("100Mbit", "fast"));
    let err = fails(&["testbed", "up", &bad_rate]);
    assert!(err.contains("field `defaults.rate`"), "{err}");

    let not_toml = dir.write("garbage.toml", "name = \n");
    let err = fails(&["testbed", "up", &not_toml]);
    assert!(err.contains(&not_toml), "{err}");
}

#[test]
fn stats_of_an_unknown_testbed_fail_clearly() {
    let err = fails(&["fabric", "stats", "nosuch"]);
    assert!(
        err.contains("no fabric stats for testbed \"nosuch\""),
        "{err}"
    );
    assert!(err.contains("fabric-nosuch.json"), "{err}");
    let err = fails(&["fabric", "stats", "Not/A/Name"]);
    assert!(err.contains("Not/A/Name"), "{err}");
}

#[test]
fn fabric_run_without_its_namespaces_points_to_testbed_up() {
    let dir = TempDir::new("gradwire-testbed-cli", "run");
    let name = unique_name('n');
    let file = dir.write("t.toml", &topology(&name));
    let err = fails(&["fabric", "run", &file]);
    assert!(
        err.contains(&format!("gwt{name}-s0 does not exist")),
        "{err}"
    );
    assert!(err.contains("gradwire testbed up"), "{err}");
}

#[test]
fn down_of_something_not_up_says_so() {
    let name = unique_name('d');
    let out = succeeds(&["testbed", "down", &name], Duration::from_secs(20));
    assert_eq!(out.trim(), format!("testbed {name} is not up"));
    let err = fails(&["testbed", "down", "../etc"]);
    assert!(
        err.contains("neither a topology file nor a testbed name"),
        "{err}"
    );
}

/// Runs `gradwire testbed down NAME` when dropped, so that a failing test leaves nothing.
struct Down(String);

impl Drop for Down {
    fn drop(&mut self) {
        match try_gradwire(&["testbed", "down", &self.0], Duration::from_secs(30)) {
            Some(o) if o.status.success() => {}
            Some(o) => eprintln!("cleanup: testbed down {}: {}", self.0, text(&o.stderr)),
            None => eprintln!("cleanup: testbed down {} timed out", self.0),
        }
    }
}

fn proc_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next())
            .is_some_and(|c| c == 'Z' || c == 'X'),
    }
}

const PAYLOAD: usize = 1_000_000;
const PORT: u16 = 5001;
/// Bound of every wait for the network (a hang guard, not a speed requirement).
const NET_TIMEOUT: Duration = Duration::from_secs(20);

/// 1 MB from host 0's namespace to host 1's over TCP; returns what host 1 received. The client
/// connects once the server listens (it says so on a channel); if the client fails, the test
/// thread drops `_client_alive` as it unwinds and the server stops waiting for it.
fn transfer(src_ns: &str, dst_ns: &str, dst: Ipv4Addr) -> Vec<u8> {
    let (listening_tx, listening) = mpsc::sync_channel::<()>(1);
    let (_client_alive, client_alive) = mpsc::channel::<()>();
    let server = spawn_in_netns(dst_ns, move || -> std::io::Result<Vec<u8>> {
        let l = TcpListener::bind((dst, PORT))?;
        l.set_nonblocking(true)?;
        let _ = listening_tx.send(());
        let deadline = Instant::now() + NET_TIMEOUT;
        let mut s = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(std::io::Error::other(format!(
                            "no connection within {NET_TIMEOUT:?}"
                        )));
                    }
                    // Waits a little for the next connection attempt, and ends at once when
                    // the test thread is gone.
                    if let Err(mpsc::RecvTimeoutError::Disconnected) =
                        client_alive.recv_timeout(Duration::from_millis(10))
                    {
                        return Err(std::io::Error::other("the client gave up"));
                    }
                }
                Err(e) => return Err(e),
            }
        };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        let mut v = Vec::with_capacity(PAYLOAD);
        s.read_to_end(&mut v)?;
        Ok(v)
    })
    .unwrap();
    if listening.recv_timeout(NET_TIMEOUT).is_err() {
        // It failed before listening (or hangs): its error says why.
        let why = server.join().map(|r| r.map(|v| v.len()));
        panic!("the server in {dst_ns} did not listen: {why:?}");
    }
    let sent = run_in_netns(src_ns, move || -> std::io::Result<()> {
        let mut s = TcpStream::connect_timeout(&(dst, PORT).into(), Duration::from_secs(5))?;
        s.set_write_timeout(Some(Duration::from_secs(15)))?;
        let data: Vec<u8> = (0..PAYLOAD).map(|i| (i % 251) as u8).collect();
        s.write_all(&data)?;
        s.shutdown(std::net::Shutdown::Write)
    })
    .unwrap();
    sent.unwrap();
    server.join().unwrap().unwrap()
}

/// `gradwire testbed status --json`, read back as the library's type.
fn status() -> Vec<TestbedStatus> {
    let out = succeeds(&["testbed", "status", "--json"], Duration::from_secs(10));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status JSON: {e}: {out}"))
}

/// `gradwire fabric stats NAME --json`, read back as the library's type.
fn fabric_stats(name: &str) -> FabricStats {
    let out = succeeds(
        &["fabric", "stats", name, "--json"],
        Duration::from_secs(10),
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("fabric stats JSON: {e}: {out}"))
}

#[test]
fn testbed_life_cycle_with_tcp_through_the_fabric() {
    if !require_root("testbed_life_cycle_with_tcp_through_the_fabric") {
        return;
    }
    let dir = TempDir::new("gradwire-testbed-cli", "life");
    let name = unique_name('t');
    let file = dir.write("tb.toml", &topology(&name));
    // The testbed's fabric is the only one running while this test does (across binaries).
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let _down = Down(name.clone());

    let out = succeeds(&["testbed", "up", &file], Duration::from_secs(30));
    eprintln!("{out}");
    assert!(
        out.contains(&format!("testbed {name} is up: 2 hosts, 1 switch;")),
        "{out}"
    );
    assert!(out.contains(&format!("gwt{name}-h0")), "{out}");
    assert!(out.contains("198.18.1.1"), "{out}");
    assert!(
        out.contains(&format!("ip netns exec gwt{name}-h0")),
        "{out}"
    );
    assert!(
        out.contains(&format!("gradwire fabric stats {name}")),
        "{out}"
    );

    // A second `up` of the same testbed is refused.
    let err = fails(&["testbed", "up", &file]);
    assert!(err.contains("already up"), "{err}");

    let all = status();
    let me = all
        .iter()
        .find(|t| t.record.name == name)
        .unwrap_or_else(|| panic!("{name} not in {all:?}"))
        .clone();
    assert!(me.running, "{me:?}");
    assert_eq!(me.record.file, std::fs::canonicalize(&file).unwrap());
    let pid = me.record.pid;
    let hosts = &me.record.hosts;
    assert_eq!(hosts.len(), 2);
    let ns: Vec<String> = me.record.namespaces().map(str::to_owned).collect();
    assert_eq!(ns.len(), 3);
    for n in &ns {
        assert!(Path::new("/run/netns").join(n).exists(), "{n} missing");
    }
    let table = succeeds(&["testbed", "status"], Duration::from_secs(10));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&name) && l.contains(&format!("pid {pid} running"))),
        "{table}"
    );

    // `up` returned once the fabric published that it runs.
    let before = fabric_stats(&name);
    assert_eq!(before.topology, name);
    assert!(before.running, "{before:?}");

    let got = transfer(&hosts[0].netns, &hosts[1].netns, hosts[1].ip);
    assert_eq!(got.len(), PAYLOAD);
    assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));

    // At least ceil(1 MB / 1460 B of payload per frame) data segments crossed the switch (plus
    // ACKs and the handshake). The stats file trails the fabric by a stats interval: wait for
    // the snapshot that shows them (bounded; failing, the message shows the last snapshot).
    let min_segments = PAYLOAD.div_ceil(1460) as u64;
    let to_h1 = |s: &FabricStats| {
        s.switch("s0")
            .and_then(|sw| sw.ports.iter().find(|p| p.peer == "host h1"))
            .map_or(0, |p| p.egress.delivered_pkts)
    };
    let deadline = Instant::now() + NET_TIMEOUT;
    let stats = loop {
        let s = fabric_stats(&name);
        if to_h1(&s) >= min_segments {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the fabric never reported {min_segments} frames delivered to h1: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(stats.topology, name);
    assert!(stats.running);
    assert_eq!(stats.switches.len(), 1);
    let sw = &stats.switches[0];
    assert_eq!(sw.name, "s0");
    let forwarded = sw.forward.forwarded;
    assert!(
        forwarded >= 700 && forwarded >= min_segments,
        "{:?}",
        sw.forward
    );
    assert_eq!(sw.forward.no_route, 0, "{:?}", sw.forward);
    for p in &sw.ports {
        let delivered = p.egress.delivered_pkts;
        assert!(delivered > 0, "port {} delivered nothing: {p:?}", p.ifname);
        if p.peer == "host h1" {
            assert!(delivered >= min_segments, "{p:?}");
        }
    }
    assert!(stats.lag.departures >= forwarded.min(min_segments));
    assert!(stats.updated_unix >= before.updated_unix);

    let human = succeeds(&["fabric", "stats", &name], Duration::from_secs(10));
    eprintln!("{human}");
    assert!(human.starts_with(&format!("fabric {name}: up ")), "{human}");
    assert!(!human.contains("fabric stopped"), "{human}");
    assert!(human.contains("switch s0 (ecmp flow): rx "), "{human}");
    assert!(
        human
            .lines()
            .any(|l| l.split_whitespace().take(4).eq(["s0", "p1", "host", "h1"])),
        "{human}"
    );

    let out = succeeds(&["testbed", "down", &name], Duration::from_secs(30));
    assert!(
        out.contains(&format!("fabric (pid {pid}) stopped")),
        "{out}"
    );
    // It stopped in order: its final stats (running: false) give the summary, and they count
    // at least what the running fabric reported.
    let summary = out
        .lines()
        .find_map(|l| l.strip_prefix(&format!("  {name} stopped after ")))
        .unwrap_or_else(|| panic!("no final summary: {out}"));
    let final_forwarded: u64 = summary
        .split_once(" s: ")
        .and_then(|(_, r)| r.split_once(" frames forwarded"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no forwarded count in {summary:?}"));
    assert!(final_forwarded >= forwarded, "{summary}");
    assert!(
        out.contains(&format!("testbed {name} is down: 3 namespaces removed")),
        "{out}"
    );
    for n in &ns {
        assert!(
            !Path::new("/run/netns").join(n).exists(),
            "{n} still exists"
        );
    }
    assert!(proc_gone(pid), "fabric pid {pid} still running");
    assert!(
        !status().iter().any(|t| t.record.name == name),
        "{name} still recorded"
    );
    let err = fails(&["fabric", "stats", &name]);
    assert!(err.contains("no fabric stats"), "{err}");
    // Idempotent.
    let out = succeeds(&["testbed", "down", &file], Duration::from_secs(30));
    assert_eq!(out.trim(), format!("testbed {name} is not up"));
}
