//! `gradwire job`: the launcher environment and job-file errors of `job worker`; ranks in
//! network namespaces started as torchrun and srun would (every result checked by the
//! workers themselves); `job run` on the shipped 4-rank job file; and a missing or killed
//! rank ending the job with an error naming a rank, within a bounded time.
//!
//! The namespace tests need root: without it they print a visible SKIPPED line, or fail when
//! GRADWIRE_REQUIRE_PRIV=1. Namespaces are removed by the netns kit's guards and every child
//! process is killed by its guard, also when a test fails half-way. Their outcomes depend on
//! the ranks' timeouts, so each holds [`FabricLock`] (no fabric or timed test beside them).
//!
//! A `job run` gets more time from the harness than its own `--deadline`, so its own cleanup
//! (stop the ranks, remove the namespaces) is what ends a slow run; past the harness's bound
//! it gets SIGTERM (the same cleanup), and SIGKILL only if that does not end it. Its workers
//! die with it even then (`killing_job_run_leaves_no_worker_running`).

#![allow(clippy::unwrap_used)]

mod common;

use common::{ChildGuard, TempDir};

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire_netns::{FabricLock, Testbed, TestbedConfig};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_gradwire");
const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../control/models/resnet50.toml"
);
const JOB4: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/job4.toml");
/// What `job run` prints once every rank has finished an iteration (job_cmd.rs).
const ALL_ITERATING: &str = "every rank is iterating";
/// The harness waits this much longer than a `job run`'s own `--deadline`.
const BEYOND_DEADLINE: Duration = Duration::from_secs(30);
/// After SIGTERM at the harness's bound, this long for the process's own cleanup.
const TERM_GRACE: Duration = Duration::from_secs(20);

/// The harness's bound for a `job run --deadline secs`: its own deadline and cleanup first.
fn beyond(deadline_secs: u64) -> Duration {
    Duration::from_secs(deadline_secs) + BEYOND_DEADLINE
}

/// Every variable a launcher or the job layer reads: tests set exactly the ones they mean.
const LAUNCH_VARS: [&str; 17] = [
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
    "GRADWIRE_JOB_RUN_PARENT",
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

    /// Still running (not yet reaped)?
    fn running(&mut self) -> bool {
        self.guard
            .0
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
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

/// Polls until every process has exited or `until`; true if they all did.
fn reap_until(procs: &mut [(Proc, Option<ExitStatus>)], until: Instant) -> bool {
    loop {
        for (p, s) in procs.iter_mut().filter(|(_, s)| s.is_none()) {
            *s = p.guard.child().try_wait().unwrap();
        }
        if procs.iter().all(|(_, s)| s.is_some()) {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Proc {
    /// On a failure path: SIGTERM first, so a `job run` stops its ranks and removes its
    /// namespaces itself; [`TERM_GRACE`] for that; then the guard's SIGKILL and reap.
    fn drop(&mut self) {
        if !self.running() {
            return;
        }
        let _ = kill(Pid::from_raw(self.pid() as i32), Signal::SIGTERM);
        let until = Instant::now() + TERM_GRACE;
        while self.running() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A process found under /proc: its pid, its start time (clock ticks after boot: with the
/// pid, its identity, as pids are recycled), whether it runs `gradwire`, its RANK variable.
#[derive(Debug, Clone)]
struct Found {
    pid: u32,
    start: u64,
    worker: bool,
    rank: Option<String>,
}

/// (state, ppid, start time) of `pid` from /proc/PID/stat.
fn stat_of(pid: u32) -> Option<(char, u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name: state, ppid, ..., start time (field 22 of stat).
    let f: Vec<&str> = stat.rsplit_once(") ")?.1.split(' ').collect();
    Some((
        f.first()?.chars().next()?,
        f.get(1)?.parse().ok()?,
        f.get(19)?.parse().ok()?,
    ))
}

/// The processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<Found> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|d| {
            let pid: u32 = d.file_name().to_str()?.parse().ok()?;
            let (_, ppid, start) = stat_of(pid)?;
            if ppid != parent {
                return None;
            }
            let exe = std::fs::read_link(d.path().join("exe")).ok()?;
            let env = std::fs::read(d.path().join("environ")).ok()?;
            let rank = env
                .split(|&b| b == 0)
                .find_map(|v| v.strip_prefix(b"RANK="))
                .map(|v| String::from_utf8_lossy(v).into_owned());
            Some(Found {
                pid,
                start,
                worker: exe.ends_with("gradwire"),
                rank,
            })
        })
        .collect()
}

/// A `job run`'s workers: its `gradwire` children (`ip netns exec` execs the worker without
/// forking).
fn workers_of(parent: u32) -> Vec<Found> {
    children_of(parent)
        .into_iter()
        .filter(|c| c.worker)
        .collect()
}

/// Is this process still running (not gone, not a zombie, not a recycled pid)?
fn alive(p: &Found) -> bool {
    stat_of(p.pid).is_some_and(|(state, _, start)| start == p.start && !matches!(state, 'Z' | 'X'))
}

/// Processes that are not this test's children: SIGKILLed on drop if still alive, so a
/// failing test leaves none of them running.
struct Strays(Vec<Found>);

impl Drop for Strays {
    fn drop(&mut self) {
        for p in self.0.iter().filter(|p| alive(p)) {
            let _ = kill(Pid::from_raw(p.pid as i32), Signal::SIGKILL);
        }
    }
}

/// Waits for every process, at most `within` in all. Past that, SIGTERM to what still runs
/// (a `job run` then stops its ranks and removes its namespaces), [`TERM_GRACE`] for that,
/// and a panic (the guards SIGKILL and reap whatever is left).
fn wait_all(procs: Vec<Proc>, within: Duration) -> Vec<Ended> {
    let mut procs: Vec<(Proc, Option<ExitStatus>)> = procs.into_iter().map(|p| (p, None)).collect();
    if !reap_until(&mut procs, Instant::now() + within) {
        let running: Vec<usize> = (0..procs.len()).filter(|&i| procs[i].1.is_none()).collect();
        for &i in &running {
            let pid = Pid::from_raw(procs[i].0.pid() as i32);
            let _ = kill(pid, Signal::SIGTERM);
        }
        let ended = reap_until(&mut procs, Instant::now() + TERM_GRACE);
        panic!(
            "process(es) {running:?} still running after {within:?}; sent SIGTERM, {}",
            if ended {
                "which ended them"
            } else {
                "which did not end them within the grace (killed)"
            }
        );
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

fn run_plain(cmd: &mut Command, within: Duration) -> Ended {
    let p = Proc::spawn(cmd);
    wait_all(vec![p], within).pop().unwrap()
}

/// Bound for commands that end before any deadline of theirs matters (argument errors).
const QUICK: Duration = Duration::from_secs(30);

#[test]
fn worker_without_launcher_variables_names_them() {
    let e = run_plain(&mut worker_cmd(None, &[], &["--model", MODEL]), QUICK);
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
    let e = run_plain(
        &mut worker_cmd(None, &[("RANK", "1".into())], &["--model", MODEL]),
        QUICK,
    );
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("RANK is set but WORLD_SIZE is not"),
        "{}",
        e.stderr
    );
}

#[test]
fn worker_refuses_a_job_file_of_another_world_size() {
    let e = run_plain(
        &mut worker_cmd(
            None,
            &[("RANK", "0".into()), ("WORLD_SIZE", "2".into())],
            &["--model", MODEL, "--job-file", JOB4],
        ),
        QUICK,
    );
    assert_eq!(e.status.code(), Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("lists 4 ranks") && e.stderr.contains("started 2"),
        "{}",
        e.stderr
    );
    // No master anywhere: said so, with what to set.
    let e = run_plain(
        &mut worker_cmd(
            None,
            &[("RANK", "0".into()), ("WORLD_SIZE", "2".into())],
            &["--model", MODEL],
        ),
        QUICK,
    );
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
        QUICK,
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
    let _fabric_lock = FabricLock::acquire().unwrap();
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
    let _fabric_lock = FabricLock::acquire().unwrap();
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
        beyond(40),
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
        beyond(40),
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
    let _fabric_lock = FabricLock::acquire().unwrap();
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
        beyond(60),
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
        QUICK,
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
    let _fabric_lock = FabricLock::acquire().unwrap();
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
    // Every rank is in its all-reduces once the run says so; then kill rank 2.
    run.wait_line(ALL_ITERATING, Duration::from_secs(45));
    let workers = workers_of(run.pid());
    let victim = workers
        .iter()
        .find(|w| w.rank.as_deref() == Some("2"))
        .unwrap_or_else(|| panic!("no worker with RANK=2 among {workers:?}"));
    kill(Pid::from_raw(victim.pid as i32), Signal::SIGKILL).unwrap();
    let e = wait_all(vec![run], beyond(60)).pop().unwrap();
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
    let _fabric_lock = FabricLock::acquire().unwrap();
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
    // Both survivors blame rank 2: directly (its socket is closed, or it fell silent) or
    // through the other survivor's ABORT naming it.
    for e in &ended {
        assert!(e.stderr.contains(" of 3: rank 2: "), "{}", e.stderr);
    }
    tb.down().unwrap();
}

/// While alive, orphans of this process's descendants are reparented to it (not to init), so
/// it can wait for them; the previous setting comes back on drop.
struct Subreaper(bool);

impl Subreaper {
    fn on() -> Subreaper {
        let was = nix::sys::prctl::get_child_subreaper().unwrap();
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        Subreaper(was)
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        let _ = nix::sys::prctl::set_child_subreaper(self.0);
    }
}

#[test]
fn killing_job_run_leaves_no_worker_running() {
    if !gradwire_netns::require_root("killing_job_run_leaves_no_worker_running") {
        return;
    }
    let _fabric_lock = FabricLock::acquire().unwrap();
    // `job run`'s children become ours when it dies: waited for here, not left to init.
    // (The other tests of this binary that may run meanwhile orphan nothing.)
    let _subreaper = Subreaper::on();
    let mut run = Proc::spawn(
        Command::new(BIN)
            .args(["job", "run", JOB4, "--iterations", "100000"])
            .args(["--scale", "0.001", "--model", MODEL])
            .args(["--timeout", "5", "--deadline", "120"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    run.wait_line(ALL_ITERATING, Duration::from_secs(45));
    let parent = run.pid();
    // Its workers, and the netns kit's reaper (a shell that removes the namespaces when its
    // creator dies).
    let children = Strays(children_of(parent));
    let workers: Vec<&Found> = children.0.iter().filter(|c| c.worker).collect();
    assert_eq!(workers.len(), 4, "{:?}", children.0);
    // Rank 2 hangs (stopped): a worker that prints nothing never finds its launcher's pipes
    // closed, and this one would never end on its own. The others stall on it.
    let hung = workers
        .iter()
        .find(|w| w.rank.as_deref() == Some("2"))
        .unwrap();
    kill(Pid::from_raw(hung.pid as i32), Signal::SIGSTOP).unwrap();

    // SIGKILL: `job run` runs none of its own cleanup; only the kernel can end its workers.
    run.kill();
    let (tx, ended) = mpsc::channel();
    for c in &children.0 {
        let (tx, pid) = (tx.clone(), c.pid);
        std::thread::spawn(move || {
            let _ = tx.send((pid, waitpid(Pid::from_raw(pid as i32), None)));
        });
    }
    drop(tx);
    let mut left: Vec<u32> = children.0.iter().map(|c| c.pid).collect();
    let until = Instant::now() + Duration::from_secs(30);
    while !left.is_empty() {
        let Ok((pid, how)) = ended.recv_timeout(until.saturating_duration_since(Instant::now()))
        else {
            let left: Vec<&Found> = children
                .0
                .iter()
                .filter(|c| left.contains(&c.pid))
                .collect();
            panic!("still running 30 s after their `job run` was killed: {left:?}");
        };
        assert!(
            how.is_ok(),
            "waiting for {pid}: {how:?} (not reparented to the test?)"
        );
        left.retain(|&p| p != pid);
    }
    // The reaper has run: none of the run's namespaces is left.
    let prefix = format!("gw{parent}t");
    let stale: Vec<String> = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(
        stale.is_empty(),
        "namespaces left by the killed run: {stale:?}"
    );
}
