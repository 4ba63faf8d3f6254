//! `gradwire job`: the launcher environment and job-file errors of `job worker`; ranks in
//! network namespaces started as torchrun and srun would (every result checked by the
//! workers themselves); `job run` on the shipped 4-rank job file; and a missing or killed
//! rank ending the job with an error naming a rank, within a bounded time.
//!
//! The namespace tests need root: without it they print a visible SKIPPED line, or fail when
//! GRADWIRE_REQUIRE_PRIV=1. Namespaces are removed by the netns kit's guards and every child
//! process is killed by its guard, also when a test fails half-way.

#![allow(clippy::unwrap_used)]

mod common;

use common::{ChildGuard, TempDir};

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire_netns::{Testbed, TestbedConfig};

const BIN: &str = env!("CARGO_BIN_EXE_gradwire");
const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../control/models/resnet50.toml"
);
const JOB4: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/job4.toml");

/// Every variable a launcher or the job layer reads: tests set exactly the ones they mean.
const LAUNCH_VARS: [&str; 16] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "PMI_RANK",
    "PMI_SIZE",
    "GRADWIRE_LAUNCHER",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GRADWIRE_JOB_SECRET",
    "GRADWIRE_LOG",
];

/// `gradwire job worker args` (inside namespace `netns` if given) with only `vars` set of the
/// launcher variables.
fn worker_cmd(netns: Option<&str>, vars: &[(&str, String)], args: &[&str]) -> Command {
    let mut c = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, BIN]);
            c
        }
        None => Command::new(BIN),
    };
    c.args(["job", "worker"]).args(args);
    for v in LAUNCH_VARS {
        c.env_remove(v);
    }
    for (k, v) in vars {
        c.env(k, v);
    }
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// A running process whose output is read as it comes (no pipe can fill up); stderr lines
/// are also sent on `lines`.
struct Proc {
    guard: ChildGuard,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    lines: mpsc::Receiver<String>,
}

/// How a process ended.
#[derive(Debug)]
struct Ended {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Proc {
        let mut guard = ChildGuard::spawn(cmd);
        let mut stdout = guard.child().stdout.take().unwrap();
        let stderr = guard.child().stderr.take().unwrap();
        let out = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s
        });
        let (tx, lines) = mpsc::channel();
        let err = std::thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                all.push_str(&line);
                all.push('\n');
                let _ = tx.send(line);
            }
            all
        });
        Proc {
            guard,
            out: Some(out),
            err: Some(err),
            lines,
        }
    }

    /// Waits until a stderr line contains `text`, at most `within`.
    fn wait_line(&self, text: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(text) => return,
                Ok(_) => {}
                Err(e) => panic!("no stderr line with {text:?} within {within:?}: {e}"),
            }
        }
    }

    fn pid(&mut self) -> u32 {
        self.guard.child().id()
    }

    fn kill(&mut self) {
        let c = self.guard.child();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    fn finish(mut self, status: ExitStatus) -> Ended {
        self.guard.0 = None;
        Ended {
            status,
            stdout: self.out.take().unwrap().join().unwrap(),
            stderr: self.err.take().unwrap().join().unwrap(),
        }
    }
}

/// Waits for every process, at most `within` in all; past that, panics (the guards kill
/// whatever still runs).
fn wait_all(procs: Vec<Proc>, within: Duration) -> Vec<Ended> {
    let deadline = Instant::now() + within;
    let mut procs: Vec<(Proc, Option<ExitStatus>)> = procs.into_iter().map(|p| (p, None)).collect();
    loop {
        for (p, s) in procs.iter_mut().filter(|(_, s)| s.is_none()) {
            *s = p.guard.child().try_wait().unwrap();
        }
        if procs.iter().all(|(_, s)| s.is_some()) {
            break;
        }
        let running: Vec<usize> = (0..procs.len()).filter(|&i| procs[i].1.is_none()).collect();
        assert!(
            Instant::now() < deadline,
            "process(es) {running:?} still running after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    procs
        .into_iter()
        .map(|(p, s)| p.finish(s.unwrap()))
        .collect()
}

fn json_of(e: &Ended) -> serde_json::Value {
    assert!(
        e.status.success(),
        "worker failed ({}): {}",
        e.status,
        e.stderr
    );
    serde_json::from_str(&e.stdout).unwrap_or_else(|err| panic!("{err}: {:?}", e.stdout))
}

fn run_plain(cmd: &mut Command) -> Ended {
    let p = Proc::spawn(cmd);
    wait_all(vec![p], Duration::from_secs(30)).pop().unwrap()
}

#[test]
fn worker_without_launcher_variables_names_them() {
    let e = run_plain(&mut worker_cmd(None, &[], &["--model", MODEL]));
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    for v in [
        "RANK/WORLD_SIZE",
        "SLURM_PROCID/SLURM_NTASKS",
        "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE",
    ] {
        assert!(e.stderr.contains(v), "{v}: {}", e.stderr);
    }
    assert!(!e.stderr.contains("panicked"), "{}", e.stderr);
}

#[test]
fn worker_with_rank_but_no_world_size_says_so() {
    let e = run_plain(&mut worker_cmd(
        None,
        &[("RANK", "1".into())],
        &["--model", MODEL],
    ));
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("RANK is set but WORLD_SIZE is not"),
        "{}",
        e.stderr
    );
}

#[test]
fn worker_refuses_a_job_file_of_another_world_size() {
    let e = run_plain(&mut worker_cmd(
        None,
        &[("RANK", "0".into()), ("WORLD_SIZE", "2".into())],
        &["--model", MODEL, "--job-file", JOB4],
    ));
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("lists 4 ranks") && e.stderr.contains("started 2"),
        "{}",
        e.stderr
    );
    // No master anywhere: said so, with what to set.
    let e = run_plain(&mut worker_cmd(
        None,
        &[("RANK", "0".into()), ("WORLD_SIZE", "2".into())],
        &["--model", MODEL],
    ));
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(e.stderr.contains("MASTER_ADDR"), "{}", e.stderr);
}

#[test]
fn job_run_refuses_hosts_outside_the_benchmark_range() {
    let dir = TempDir::new("gw-job", "range");
    let file = dir.write(
        "job.toml",
        "job = 1\n[[rank]]\nrank = 0\nhost = \"10.1.2.3\"\n[[rank]]\nrank = 1\nhost = \"198.18.0.2\"\n",
    );
    let e = run_plain(
        Command::new(BIN)
            .args(["job", "run", &file, "--model", MODEL])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("198.18.0.0/15") && e.stderr.contains("10.1.2.3"),
        "{}",
        e.stderr
    );
}

fn testbed(hosts: usize) -> Testbed {
    Testbed::up(&TestbedConfig {
        // Kernel UDP only: no need for ethtool to turn checksum offload off.
        tx_checksum_offload: true,
        ..TestbedConfig::with_hosts(hosts)
    })
    .unwrap()
}

const SMALL: [&str; 6] = ["--model", MODEL, "--scale", "0.001", "--timeout", "10"];

#[test]
fn four_workers_in_namespaces_under_torchrun_and_slurm_variables() {
    if !gradwire_netns::require_root(
        "four_workers_in_namespaces_under_torchrun_and_slurm_variables",
    ) {
        return;
    }
    let tb = testbed(4);
    let master = tb.host(0).ipv4.to_string();

    // torchrun: RANK/WORLD_SIZE, MASTER_ADDR/MASTER_PORT; each rank finds its own address.
    let procs: Vec<Proc> = (0..4)
        .map(|r| {
            let vars = [
                ("RANK", r.to_string()),
                ("WORLD_SIZE", "4".to_string()),
                ("MASTER_ADDR", master.clone()),
                ("MASTER_PORT", "29500".to_string()),
            ];
            let args = [&SMALL[..], &["--iterations", "2", "--json"]].concat();
            Proc::spawn(&mut worker_cmd(Some(&tb.host(r).netns), &vars, &args))
        })
        .collect();
    for (r, e) in wait_all(procs, Duration::from_secs(45)).iter().enumerate() {
        let v = json_of(e);
        assert_eq!(v["rank"], r);
        assert_eq!(v["world"], 4);
        assert_eq!(v["launcher"], "torchrun");
        assert_eq!(v["algorithm"], "ring");
        assert_eq!(v["host"], tb.host(r).ipv4.to_string());
        assert_eq!(v["verified"], true);
        assert_eq!(v["layers"], 54);
        let its = v["iterations"].as_array().unwrap();
        assert_eq!(its.len(), 2);
        for it in its {
            assert_eq!(it["delivered_fraction_min"], 1.0);
        }
    }

    // srun: SLURM_PROCID/SLURM_NTASKS; the master and the hosts from a job file; a tree.
    let dir = TempDir::new("gw-job", "slurm");
    let mut text = format!("job = 9\nmaster = \"{master}:29501\"\n");
    for r in 0..4 {
        text.push_str(&format!(
            "[[rank]]\nrank = {r}\nhost = \"{}\"\n",
            tb.host(r).ipv4
        ));
    }
    let file = dir.write("job.toml", &text);
    let procs: Vec<Proc> = (0..4)
        .map(|r| {
            let vars = [
                ("SLURM_PROCID", r.to_string()),
                ("SLURM_NTASKS", "4".to_string()),
            ];
            let args = [
                &SMALL[..],
                &[
                    "--iterations",
                    "2",
                    "--json",
                    "--algorithm",
                    "binary",
                    "--job-file",
                    &file,
                ],
            ]
            .concat();
            Proc::spawn(&mut worker_cmd(Some(&tb.host(r).netns), &vars, &args))
        })
        .collect();
    for (r, e) in wait_all(procs, Duration::from_secs(45)).iter().enumerate() {
        let v = json_of(e);
        assert_eq!(v["rank"], r);
        assert_eq!(v["launcher"], "slurm");
        assert_eq!(v["job"], 9);
        assert_eq!(v["algorithm"], "binary");
        assert_eq!(v["master"], format!("{master}:29501"));
        assert_eq!(v["verified"], true);
        assert_eq!(v["iterations"].as_array().unwrap().len(), 2);
    }
    tb.down().unwrap();
}

#[test]
fn job_run_runs_the_shipped_job_file() {
    if !gradwire_netns::require_root("job_run_runs_the_shipped_job_file") {
        return;
    }
    let e = run_plain(
        Command::new(BIN)
            .args(["job", "run", JOB4, "--iterations", "2", "--scale", "0.001"])
            .args([
                "--model",
                MODEL,
                "--timeout",
                "10",
                "--deadline",
                "40",
                "--json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let v = json_of(&e);
    let reports = v.as_array().unwrap();
    assert_eq!(reports.len(), 4);
    for (r, rep) in reports.iter().enumerate() {
        assert_eq!(rep["rank"], r);
        assert_eq!(rep["world"], 4);
        assert_eq!(rep["job"], 4);
        assert_eq!(rep["host"], format!("198.18.50.{}", r + 1));
        assert_eq!(rep["master"], "198.18.50.1:29500");
        assert_eq!(rep["verified"], true);
        assert_eq!(rep["iterations"].as_array().unwrap().len(), 2);
    }

    // The rack tree over the file's two racks, as a table.
    let e = run_plain(
        Command::new(BIN)
            .args(["job", "run", JOB4, "--iterations", "1", "--scale", "0.001"])
            .args(["--model", MODEL, "--timeout", "10", "--deadline", "40"])
            .args(["--algorithm", "rack", "--op", "average"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    assert!(e.status.success(), "{}", e.stderr);
    for r in 0..4 {
        assert!(
            e.stdout.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.first() == Some(&r.to_string().as_str())
                    && f.get(1) == Some(&format!("198.18.50.{}", r + 1).as_str())
                    && f.last() == Some(&"yes")
            }),
            "no verified row for rank {r}: {}",
            e.stdout
        );
    }
}

#[test]
fn job_run_on_a_testbed_topology() {
    if !gradwire_netns::require_root("job_run_on_a_testbed_topology") {
        return;
    }
    let job = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/job-mlnet6.toml");
    let topology = concat!(env!("CARGO_MANIFEST_DIR"), "/../testbeds/mlnet.toml");
    let e = run_plain(
        Command::new(BIN)
            .args([
                "job",
                "run",
                job,
                "--topology",
                topology,
                "--algorithm",
                "rack",
            ])
            .args(["--iterations", "1", "--scale", "0.0005", "--model", MODEL])
            .args(["--timeout", "15", "--deadline", "60", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let v = json_of(&e);
    let reports = v.as_array().unwrap();
    assert_eq!(reports.len(), 6);
    for rep in reports {
        assert_eq!(rep["verified"], true, "{rep}");
    }
    // A job host that is not one of the topology's hosts is refused before anything runs.
    let e = run_plain(
        Command::new(BIN)
            .args(["job", "run", JOB4, "--topology", topology, "--model", MODEL])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    assert!(!e.status.success());
    assert!(
        e.stderr.contains("198.18.50.1 is not a host of"),
        "{}",
        e.stderr
    );
}

#[test]
fn job_run_names_a_rank_that_died() {
    if !gradwire_netns::require_root("job_run_names_a_rank_that_died") {
        return;
    }
    let mut run = Proc::spawn(
        Command::new(BIN)
            .args([
                "job",
                "run",
                JOB4,
                "--iterations",
                "100000",
                "--scale",
                "0.001",
            ])
            .args(["--model", MODEL, "--timeout", "5", "--deadline", "60"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    // The workers are the run's children (`ip netns exec` becomes the worker); rank 2 is the
    // one with RANK=2. Wait until it exists, then kill it.
    let parent = run.pid();
    let deadline = Instant::now() + Duration::from_secs(30);
    let victim = loop {
        let found = std::fs::read_dir("/proc").unwrap().flatten().find_map(|d| {
            let pid: u32 = d.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(d.path().join("stat")).ok()?;
            let ppid: u32 = stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()?;
            let env = std::fs::read(d.path().join("environ")).ok()?;
            let is_rank2 = env.split(|&b| b == 0).any(|v| v == b"RANK=2");
            let exe = std::fs::read_link(d.path().join("exe")).ok()?;
            (ppid == parent && is_rank2 && exe.ends_with("gradwire")).then_some(pid)
        });
        if let Some(pid) = found {
            break pid;
        }
        assert!(Instant::now() < deadline, "rank 2 never started");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let it get into the all-reduces.
    std::thread::sleep(Duration::from_millis(500));
    let status = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let e = wait_all(vec![run], Duration::from_secs(30)).pop().unwrap();
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("rank 2 failed") && e.stderr.contains("SIGKILL"),
        "{}",
        e.stderr
    );
    assert!(!e.stderr.contains("panicked"), "{}", e.stderr);
}

#[test]
fn a_missing_or_killed_rank_ends_the_others_with_an_error_naming_a_rank() {
    if !gradwire_netns::require_root(
        "a_missing_or_killed_rank_ends_the_others_with_an_error_naming_a_rank",
    ) {
        return;
    }
    let tb = testbed(3);
    let master = tb.host(0).ipv4.to_string();
    let start = |r: usize, port: &str, extra: &[&str]| {
        let vars = [
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".to_string()),
            ("MASTER_ADDR", master.clone()),
            ("MASTER_PORT", port.to_string()),
        ];
        let args = [
            &["--model", MODEL, "--scale", "0.001", "--timeout", "3"][..],
            extra,
        ]
        .concat();
        Proc::spawn(&mut worker_cmd(Some(&tb.host(r).netns), &vars, &args))
    };

    // Rank 2 never starts: rank 0's rendezvous names it; rank 1 gets no table. Both within
    // the 3 s timeout (plus start-up), far below the bound here.
    let procs = vec![
        start(0, "29500", &["--iterations", "2"]),
        start(1, "29500", &["--iterations", "2"]),
    ];
    let ended = wait_all(procs, Duration::from_secs(25));
    for (r, e) in ended.iter().enumerate() {
        assert_eq!(e.status.code(), Some(1), "rank {r}: {}", e.stderr);
        assert!(
            e.stderr.contains(&format!("rank {r} of 3")),
            "rank {r}: {}",
            e.stderr
        );
        assert!(!e.stderr.contains("panicked"), "{}", e.stderr);
    }
    assert!(
        ended[0].stderr.contains("rank(s) [2] never joined"),
        "{}",
        ended[0].stderr
    );

    // Rank 2 is killed once it has finished an iteration: both others fail, naming it.
    let procs: Vec<Proc> = (0..3)
        .map(|r| start(r, "29502", &["--iterations", "100000", "--json"]))
        .collect();
    procs[2].wait_line("rank 2: iteration 1/", Duration::from_secs(20));
    let mut procs = procs;
    procs[2].kill();
    let killed = procs.pop().unwrap();
    drop(killed);
    let ended = wait_all(procs, Duration::from_secs(25));
    for (r, e) in ended.iter().enumerate() {
        assert_eq!(e.status.code(), Some(1), "rank {r}: {}", e.stderr);
        assert!(!e.stderr.contains("panicked"), "{}", e.stderr);
    }
    assert!(
        ended.iter().any(|e| e.stderr.contains("link with rank 2")),
        "{:?}",
        ended.iter().map(|e| &e.stderr).collect::<Vec<_>>()
    );
    tb.down().unwrap();
}
