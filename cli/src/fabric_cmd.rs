//! `gradwire testbed up|down|status` and `gradwire fabric run|stats`.
//!
//! A testbed is a topology file built as network namespaces `gwt<name>-<node>`
//! ([`FabricNet::up_persistent`]) plus one fabric process (`gradwire fabric run`, re-executed
//! from this binary, detached in its own process group) that forwards between the switch
//! ports. Everything a later command needs lives in the stats directory
//! ([`crate::stats::stats_dir`]):
//!
//! - `testbed-<name>.json`: the record (topology file, fabric pid, namespaces);
//! - `fabric-<name>.json`: the fabric's stats, atomically replaced every 200 ms;
//! - `fabric-<name>.log`: the fabric's stdout and stderr (kept after `down`).

use std::error::Error;
use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gradwire::testbed::{delete_netns, is_root, netns_path};
use gradwire_fabric::netns::{cli_prefix, ns_name, FabricNet};
use gradwire_fabric::run::{write_stats, Fabric, FabricConfig, FabricStats};
use gradwire_fabric::topology::Topology;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::args::{
    FabricRunArgs, FabricStatsArgs, TestbedDownArgs, TestbedStatusArgs, TestbedUpArgs,
};
use crate::stats::{stats_dir, u};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// How long `testbed up` waits for the fabric to publish `running: true`.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `testbed down` waits after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// A `running` stats file not updated for this long belongs to a fabric that died.
const STALE_AFTER_S: u64 = 5;
/// Where namespace handles live.
const NETNS_DIR: &str = "/run/netns";

/// What `testbed up` records for `down`, `status` and `fabric stats`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TestbedState {
    name: String,
    /// Absolute path of the topology file.
    file: PathBuf,
    /// The fabric process.
    pid: i32,
    prefix: String,
    hosts: Vec<HostState>,
    switches: Vec<SwitchState>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct HostState {
    name: String,
    ip: Ipv4Addr,
    netns: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SwitchState {
    name: String,
    netns: String,
}

impl TestbedState {
    fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.switches
            .iter()
            .map(|s| s.netns.as_str())
            .chain(self.hosts.iter().map(|h| h.netns.as_str()))
    }
}

fn state_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("testbed-{name}.json"))
}

fn stats_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("fabric-{name}.json"))
}

fn log_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("fabric-{name}.log"))
}

/// A topology (testbed) name: 1..=8 of a-z 0-9, starting with a letter.
fn is_name(s: &str) -> bool {
    (1..=8).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && s.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
}

fn load_topology(path: &Path) -> Res<Topology> {
    // The error names the file and the field already.
    Topology::load(path).map_err(|e| format!("topology {e}").into())
}

fn read_state(dir: &Path, name: &str) -> Res<Option<TestbedState>> {
    let path = state_path(dir, name);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: cannot read: {e}", path.display()).into()),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| format!("{}: not a testbed record: {e}", path.display()).into())
}

fn write_state(dir: &Path, st: &TestbedState) -> Res {
    let path = state_path(dir, &st.name);
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec_pretty(st)?;
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("{}: cannot write: {e}", path.display()).into())
}

/// Every testbed record in `dir`, sorted by name.
fn all_states(dir: &Path) -> Vec<TestbedState> {
    let mut out: Vec<TestbedState> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let f = e.file_name();
            let name = f
                .to_str()?
                .strip_prefix("testbed-")?
                .strip_suffix(".json")?;
            read_state(dir, name).ok().flatten()
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The process state letter from /proc/<pid>/stat (`R`, `S`, `Z`, ...), if it exists.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may contain anything, so look after the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether `pid` is a live process (a zombie is not).
fn pid_running(pid: i32) -> bool {
    pid > 1 && proc_state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// Whether `pid` is the `gradwire fabric run ... --prefix <prefix>` we started, and not some
/// other process that got a recycled pid.
fn is_fabric_process(pid: i32, prefix: &str) -> bool {
    let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
    let exe_ok = args.first().is_some_and(|a0| {
        Path::new(std::ffi::OsStr::from_bytes(a0))
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("gradwire"))
    });
    let has = |w: &str| args.contains(&w.as_bytes());
    let prefix_ok = args
        .windows(2)
        .any(|w| w[0] == b"--prefix" && w[1] == prefix.as_bytes());
    exe_ok && has("fabric") && has("run") && prefix_ok
}

/// Live `gradwire fabric run --prefix <prefix>` processes, found through /proc: for a testbed
/// whose record is missing or damaged (an interrupted `up`).
fn find_fabric_processes(prefix: &str) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid_running(pid) && is_fabric_process(pid, prefix))
        .collect();
    out.sort_unstable();
    out
}

/// The last `n` lines of a file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return "(empty)".to_owned();
    }
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Reads a stats file as JSON; `None` if missing or half-written.
fn read_stats(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

fn not_root(what: &str) -> Box<dyn Error + Send + Sync> {
    format!(
        "{what} needs root (effective uid {}): it creates network namespaces and attaches XDP \
         programs; run it with sudo",
        nix::unistd::geteuid()
    )
    .into()
}

/// Sends `sig`, ignoring a process that is gone already.
fn signal(pid: i32, sig: Signal) -> Res {
    match kill(Pid::from_raw(pid), sig) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(e) => Err(format!("cannot send {sig} to the fabric (pid {pid}): {e}").into()),
    }
}

/// Waits until `pid` is gone, at most `timeout`.
fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while pid_running(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]. Returns a line for the user and whether the
/// fabric stopped in order (then its log ends with its summary and is of no further use).
fn stop_fabric(pid: i32, prefix: &str) -> Res<(String, bool)> {
    if !pid_running(pid) {
        return Ok((format!("fabric (pid {pid}) was not running"), false));
    }
    if !is_fabric_process(pid, prefix) {
        return Ok((
            format!(
                "pid {pid} is no longer the fabric (another process has that pid); not signalled"
            ),
            false,
        ));
    }
    signal(pid, Signal::SIGTERM)?;
    if wait_gone(pid, STOP_TIMEOUT) {
        return Ok((format!("fabric (pid {pid}) stopped"), true));
    }
    signal(pid, Signal::SIGKILL)?;
    if wait_gone(pid, Duration::from_secs(2)) {
        Ok((
            format!(
                "fabric (pid {pid}) killed: it did not stop within {}s of SIGTERM",
                STOP_TIMEOUT.as_secs()
            ),
            false,
        ))
    } else {
        Err(format!("fabric (pid {pid}) survived SIGKILL").into())
    }
}

/// The fabric's final summary line from its log, without the `gradwire fabric: ` prefix.
fn final_summary(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("gradwire fabric: "))
        .find(|l| l.contains(" stopped after "))
        .map(str::to_owned)
}

/// Namespaces under /run/netns named `<prefix>-<node>` (node of a-z 0-9).
fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| {
            n.strip_prefix(prefix)
                .and_then(|r| r.strip_prefix('-'))
                .is_some_and(|node| {
                    !node.is_empty()
                        && node
                            .bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
                })
        })
        .collect();
    out.sort();
    out
}

/// A plain text table: `rows[0]` is the header; columns flagged in `right` are right-aligned.
fn table(rows: &[Vec<String>], right: &[bool]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let w = width[c];
            if right.get(c).copied().unwrap_or(false) {
                line.push_str(&format!("{cell:>w$}"));
            } else {
                line.push_str(&format!("{cell:<w$}"));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|s| (*s).to_owned()).collect()
}

/// `gradwire testbed up FILE`.
pub fn testbed_up(a: &TestbedUpArgs) -> Res {
    let topo = load_topology(&a.file)?;
    if !is_root() {
        return Err(not_root("gradwire testbed up"));
    }
    let name = topo.name.clone();
    let dir = stats_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    if let Some(st) = read_state(&dir, &name)? {
        return Err(if pid_running(st.pid) {
            format!(
                "testbed {name:?} is already up (fabric pid {}); `gradwire testbed down {name}` \
                 it first",
                st.pid
            )
        } else {
            format!(
                "testbed {name:?} is left over: its fabric (pid {}) is not running; `gradwire \
                 testbed down {name}` cleans it up",
                st.pid
            )
        }
        .into());
    }
    let file = std::fs::canonicalize(&a.file).map_err(|e| format!("{}: {e}", a.file.display()))?;
    let net = FabricNet::up_persistent(&topo)?;
    let prefix = net.prefix().to_owned();

    let stats = stats_path(&dir, &name);
    let log = log_path(&dir, &name);
    let _ = std::fs::remove_file(&stats);
    let child = match spawn_fabric(a, &file, &prefix, &stats, &log) {
        Ok(c) => c,
        Err(e) => {
            teardown(net);
            return Err(e);
        }
    };
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    let state = TestbedState {
        name: name.clone(),
        file,
        pid,
        prefix: prefix.clone(),
        hosts: topo
            .hosts
            .iter()
            .zip(net.host_namespaces())
            .map(|(h, ns)| HostState {
                name: h.name.clone(),
                ip: h.ip,
                netns: ns.clone(),
            })
            .collect(),
        switches: topo
            .switches
            .iter()
            .zip(net.switch_namespaces())
            .map(|(s, ns)| SwitchState {
                name: s.name.clone(),
                netns: ns.clone(),
            })
            .collect(),
    };
    // Recorded before the wait, so that an interrupted `up` still leaves what `down` needs.
    if let Err(e) = write_state(&dir, &state) {
        abort_start(child, net);
        return Err(e);
    }
    if let Err(e) = wait_started(child, &stats, &log) {
        let _ = std::fs::remove_file(state_path(&dir, &name));
        let _ = std::fs::remove_file(&stats);
        teardown(net);
        return Err(e);
    }

    print!("{}", describe_up(&topo, &state, &log));
    Ok(())
}

fn spawn_fabric(
    a: &TestbedUpArgs,
    file: &Path,
    prefix: &str,
    stats: &Path,
    log: &Path,
) -> Res<Child> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let out = File::create(log).map_err(|e| format!("{}: cannot create: {e}", log.display()))?;
    let err = out.try_clone()?;
    Command::new(&exe)
        .arg("fabric")
        .arg("run")
        .arg(file)
        .arg("--prefix")
        .arg(prefix)
        .arg("--stats")
        .arg(stats)
        .arg("--xdp-mode")
        .arg(a.fabric.xdp_mode.to_string())
        .arg("--seed")
        .arg(a.fabric.seed.to_string())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        // Its own process group: a Ctrl-C meant for the shell's foreground job is not for it.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start `{} fabric run`: {e}", exe.display()).into())
}

/// Kills a fabric that is not up yet and removes the namespaces.
fn abort_start(mut child: Child, net: FabricNet) {
    let _ = child.kill();
    let _ = child.wait();
    teardown(net);
}

/// Removes the namespaces of a testbed that did not come up.
fn teardown(net: FabricNet) {
    if let Err(e) = net.down() {
        eprintln!("gradwire: warning: removing the namespaces again: {e}");
    }
}

/// Waits until the fabric publishes `running: true`, or exits, or [`START_TIMEOUT`] passes.
fn wait_started(mut child: Child, stats: &Path, log: &Path) -> Res {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let exited = match child.try_wait() {
            Ok(e) => e,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("cannot watch the starting fabric: {e}").into());
            }
        };
        if let Some(status) = exited {
            return Err(format!(
                "the fabric exited during startup ({status}); its log {}:\n{}",
                log.display(),
                tail(log, 20)
            )
            .into());
        }
        if read_stats(stats).is_some_and(|v| v["running"] == Value::Bool(true)) {
            // Not waited for: it lives on when this process exits.
            drop(child);
            return Ok(());
        }
        if Instant::now() >= deadline {
            let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
            let _ = signal(pid, Signal::SIGTERM);
            std::thread::sleep(Duration::from_millis(500));
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the fabric did not start within {}s; its log {}:\n{}",
                START_TIMEOUT.as_secs(),
                log.display(),
                tail(log, 20)
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn describe_up(topo: &Topology, st: &TestbedState, log: &Path) -> String {
    let mut out = format!(
        "testbed {} is up: {} hosts, {} switch{}; fabric pid {} (log {})\n\n",
        st.name,
        st.hosts.len(),
        st.switches.len(),
        if st.switches.len() == 1 { "" } else { "es" },
        st.pid,
        log.display()
    );
    let mut hosts = vec![row(["HOST", "ADDRESS", "NAMESPACE", "UPLINK"])];
    for (h, plan) in st.hosts.iter().zip(&topo.hosts) {
        let uplink = topo.switches.get(plan.switch).map_or(String::new(), |s| {
            let rate = s.ports.get(plan.port).map_or(0, |p| p.link.rate_bps);
            format!("{} ({})", s.name, fmt_rate(rate))
        });
        hosts.push(vec![
            h.name.clone(),
            h.ip.to_string(),
            h.netns.clone(),
            uplink,
        ]);
    }
    out.push_str(&table(&hosts, &[]));
    out.push('\n');
    let mut sws = vec![row(["SWITCH", "PORTS", "NAMESPACE", "ECMP"])];
    for (s, plan) in st.switches.iter().zip(&topo.switches) {
        sws.push(vec![
            s.name.clone(),
            plan.ports.len().to_string(),
            s.netns.clone(),
            plan.ecmp.to_string(),
        ]);
    }
    out.push_str(&table(&sws, &[false, true]));
    let h0 = st.hosts.first().map_or("<ns>", |h| h.netns.as_str());
    let ip1 = st
        .hosts
        .get(1)
        .map_or(String::from("<address>"), |h| h.ip.to_string());
    out.push_str(&format!(
        "\nrun a command on a host:  ip netns exec {h0} ping -c 3 {ip1}\n\
         fabric counters:          gradwire fabric stats {}\n\
         tear it down:             gradwire testbed down {}\n",
        st.name, st.name
    ));
    out
}

/// `gradwire testbed down FILE|NAME`.
pub fn testbed_down(a: &TestbedDownArgs) -> Res {
    let arg = Path::new(&a.target);
    let (name, topo) = if arg.is_file() {
        let t = load_topology(arg)?;
        (t.name.clone(), Some(t))
    } else if is_name(&a.target) {
        (a.target.clone(), None)
    } else {
        return Err(format!(
            "{:?} is neither a topology file nor a testbed name (1..=8 of a-z 0-9)",
            a.target
        )
        .into());
    };
    let dir = stats_dir();
    // A damaged record must not keep a testbed from coming down: its namespaces are still
    // found by name.
    let state = read_state(&dir, &name).unwrap_or_else(|e| {
        eprintln!("gradwire: warning: ignoring the testbed record: {e}");
        None
    });
    let prefix = cli_prefix(&name);
    let mut namespaces = namespaces_with_prefix(&prefix);
    if let Some(st) = &state {
        namespaces.extend(st.namespaces().map(str::to_owned));
    }
    namespaces.sort();
    namespaces.dedup();
    namespaces.retain(|ns| netns_path(ns).exists());

    let recorded = state.as_ref().map(|st| st.pid);
    let strays: Vec<i32> = find_fabric_processes(&prefix)
        .into_iter()
        .filter(|p| Some(*p) != recorded)
        .collect();

    if state.is_none() && namespaces.is_empty() && strays.is_empty() {
        let _ = std::fs::remove_file(state_path(&dir, &name));
        let _ = std::fs::remove_file(stats_path(&dir, &name));
        println!("testbed {name} is not up");
        return Ok(());
    }
    if !is_root() {
        return Err(not_root("gradwire testbed down"));
    }
    let mut errors: Vec<String> = Vec::new();
    if let Some(st) = &state {
        let log = log_path(&dir, &name);
        match stop_fabric(st.pid, &st.prefix) {
            Ok((line, clean)) => {
                println!("{line}");
                match final_summary(&log).filter(|_| clean) {
                    Some(summary) => {
                        println!("  {summary}");
                        let _ = std::fs::remove_file(&log);
                    }
                    None if log.exists() => println!("  its log is kept: {}", log.display()),
                    None => {}
                }
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    for pid in strays {
        match stop_fabric(pid, &prefix) {
            Ok((line, _)) => println!("{line} (not in the testbed record)"),
            Err(e) => errors.push(e.to_string()),
        }
    }
    // The topology, for `down_by_name`: the one named, else the recorded file if it is still
    // there and still describes this testbed.
    let topo = topo.or_else(|| {
        state
            .as_ref()
            .and_then(|st| Topology::load(&st.file).ok())
            .filter(|t| t.name == name)
    });
    let mut removed = 0;
    if let Some(t) = &topo {
        match FabricNet::down_by_name(t) {
            Ok(n) => removed += n,
            Err(e) => errors.push(e.to_string()),
        }
    }
    // Whatever is left: namespaces recorded, or named like this testbed's.
    for ns in &namespaces {
        match delete_netns(ns) {
            Ok(true) => removed += 1,
            Ok(false) => {}
            Err(e) => errors.push(e.to_string()),
        }
    }
    if !errors.is_empty() {
        return Err(format!(
            "testbed {name}: teardown left problems (record kept in {}): {}",
            state_path(&dir, &name).display(),
            errors.join("; ")
        )
        .into());
    }
    for p in [
        state_path(&dir, &name),
        stats_path(&dir, &name),
        stats_path(&dir, &name).with_extension("tmp"),
    ] {
        let _ = std::fs::remove_file(p);
    }
    println!("testbed {name} is down: {removed} namespaces removed");
    Ok(())
}

/// `gradwire testbed status`.
pub fn testbed_status(a: &TestbedStatusArgs) -> Res {
    let dir = stats_dir();
    let states = all_states(&dir);
    if a.json {
        let v: Vec<Value> = states
            .iter()
            .map(|s| {
                let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
                if let Some(o) = v.as_object_mut() {
                    o.insert("running".into(), Value::Bool(pid_running(s.pid)));
                }
                v
            })
            .collect();
        println!("{}", Value::Array(v));
        return Ok(());
    }
    if states.is_empty() {
        println!("no testbed is up (records in {})", dir.display());
        return Ok(());
    }
    let mut rows = vec![row(["TESTBED", "FABRIC", "HOSTS", "SWITCHES", "FILE"])];
    for s in &states {
        let fabric = if pid_running(s.pid) {
            format!("pid {} running", s.pid)
        } else {
            format!("pid {} STOPPED", s.pid)
        };
        rows.push(vec![
            s.name.clone(),
            fabric,
            s.hosts.len().to_string(),
            s.switches.len().to_string(),
            s.file.display().to_string(),
        ]);
    }
    print!("{}", table(&rows, &[false, false, true, true]));
    if states.iter().any(|s| !pid_running(s.pid)) {
        println!("a stopped fabric forwards nothing: `gradwire testbed down NAME` and up again");
    }
    Ok(())
}

/// `gradwire fabric run FILE`.
pub fn fabric_run(a: &FabricRunArgs) -> Res {
    let topo = load_topology(&a.file)?;
    let name = topo.name.clone();
    let prefix = a.prefix.clone().unwrap_or_else(|| cli_prefix(&name));
    let switch_ns: Vec<String> = topo
        .switches
        .iter()
        .map(|s| ns_name(&prefix, &s.name))
        .collect();
    for (s, ns) in topo.switches.iter().zip(&switch_ns) {
        if !netns_path(ns).exists() {
            return Err(format!(
                "switch {}: network namespace {ns} does not exist; build the testbed with \
                 `gradwire testbed up {}` (which also starts its fabric)",
                s.name,
                a.file.display()
            )
            .into());
        }
    }
    if !is_root() {
        return Err(not_root("gradwire fabric run"));
    }
    let dir = stats_dir();
    let me = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    if let Some(st) = read_state(&dir, &name).ok().flatten() {
        if st.pid != me && st.prefix == prefix && pid_running(st.pid) {
            return Err(format!(
                "testbed {name} already has a fabric running (pid {}); two would fight over the \
                 switch ports",
                st.pid
            )
            .into());
        }
    }
    let path = a.stats.clone().unwrap_or_else(|| stats_path(&dir, &name));
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    }
    // Before opening the ports: a SIGTERM during setup must still end in an orderly exit.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .map_err(|e| format!("cannot install a handler for signal {sig}: {e}"))?;
    }
    let cfg = FabricConfig {
        xdp_mode: a.fabric.xdp_mode,
        seed: a.fabric.seed,
        max_lag_ns: a.max_lag_us.saturating_mul(1000),
        stats_path: Some(path.clone()),
        ..FabricConfig::default()
    };
    let mode = cfg.xdp_mode;
    let mut fabric = Fabric::open(&topo, &switch_ns, cfg)?;
    let ports: usize = topo.switches.iter().map(|s| s.ports.len()).sum();
    eprintln!(
        "gradwire fabric: {name}: {} switch(es), {ports} ports open (XDP {mode}, namespaces \
         {prefix}-*); stats in {}; SIGTERM or Ctrl-C stops it",
        topo.switches.len(),
        path.display()
    );
    let mut warned = false;
    let mut last: Option<FabricStats> = None;
    fabric.run(&stop, |s| {
        if let Err(e) = write_stats(&path, s) {
            if !warned {
                eprintln!(
                    "gradwire fabric: cannot write stats to {}: {e}",
                    path.display()
                );
                warned = true;
            }
        }
        if !s.running {
            last = Some(s.clone());
        }
    });
    drop(fabric);
    if let Some(s) = last {
        eprintln!("gradwire fabric: {}", summary(&s));
    }
    Ok(())
}

/// One line about a fabric's final stats.
fn summary(s: &FabricStats) -> String {
    let (mut forwarded, mut delivered, mut lost, mut marked, mut dropped) = (0, 0, 0, 0, 0);
    for sw in &s.switches {
        forwarded += sw.forward.forwarded;
        for p in &sw.ports {
            delivered += p.egress.delivered_pkts;
            lost += p.egress.lost_pkts;
            let q = p.egress.sum();
            marked += q.marked;
            dropped += q.dropped_threshold + q.dropped_buffer;
        }
    }
    let l = &s.lag;
    let mut line = format!(
        "{} stopped after {:.1} s: {forwarded} frames forwarded, {delivered} delivered, \
         {lost} lost on links, {marked} ECN-marked, {dropped} dropped; lag mean {} p99 {} \
         worst {} ({}/{} late)",
        s.topology,
        s.uptime_s,
        fmt_ns(l.mean_ns),
        fmt_ns(l.p99_ns),
        fmt_ns(l.worst_ns),
        l.late,
        l.departures
    );
    if l.behind {
        line.push_str("; BEHIND: results of this run are not valid");
    }
    line
}

/// `gradwire fabric stats [NAME|PATH]`.
pub fn fabric_stats(a: &FabricStatsArgs) -> Res {
    let dir = stats_dir();
    let (path, pid) = resolve_stats(&dir, a.target.as_deref())?;
    loop {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let mut shown = if a.json {
            text
        } else {
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| format!("{}: not fabric stats: {e}", path.display()))?;
            let alive = pid.map(pid_running);
            render_stats(&v, alive, now_unix())
        };
        if !shown.ends_with('\n') {
            shown.push('\n');
        }
        let mut out = std::io::stdout().lock();
        match out.write_all(shown.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => {}
            // `gradwire fabric stats | head`: the reader has seen enough.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(format!("cannot write to stdout: {e}").into()),
        }
        drop(out);
        match a.watch {
            Some(secs) if secs > 0.0 && secs.is_finite() => {
                std::thread::sleep(Duration::from_secs_f64(secs));
                if !a.json {
                    println!();
                }
            }
            _ => return Ok(()),
        }
    }
}

/// The stats file to show and the pid of its fabric, if recorded.
fn resolve_stats(dir: &Path, target: Option<&str>) -> Res<(PathBuf, Option<i32>)> {
    let states = all_states(dir);
    let running: Vec<&TestbedState> = states.iter().filter(|s| pid_running(s.pid)).collect();
    let names = |v: &[&TestbedState]| {
        v.iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let hint = if running.is_empty() {
        "no testbed is running; start one with `gradwire testbed up FILE`".to_owned()
    } else {
        format!("running testbeds: {}", names(&running))
    };
    match target {
        Some(t) if t.contains('/') || t.ends_with(".json") => {
            let p = PathBuf::from(t);
            if !p.is_file() {
                return Err(format!("{t}: no such stats file").into());
            }
            Ok((p, None))
        }
        Some(t) => {
            if !is_name(t) {
                return Err(format!(
                    "{t:?} is neither a testbed name (1..=8 of a-z 0-9) nor a stats file; {hint}"
                )
                .into());
            }
            let p = stats_path(dir, t);
            if !p.is_file() {
                return Err(format!(
                    "no fabric stats for testbed {t:?} ({} does not exist); {hint}",
                    p.display()
                )
                .into());
            }
            let pid = states.iter().find(|s| s.name == t).map(|s| s.pid);
            Ok((p, pid))
        }
        None => match running.as_slice() {
            [one] => Ok((stats_path(dir, &one.name), Some(one.pid))),
            [] => Err(hint.into()),
            _ => Err(format!(
                "{} testbeds are running ({}); name one: `gradwire fabric stats NAME`",
                running.len(),
                names(&running)
            )
            .into()),
        },
    }
}

fn arr<'a>(v: &'a Value, k: &str) -> &'a [Value] {
    v.get(k)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn fmt_ns(ns: u64) -> String {
    let f = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2}ms", f / 1e6)
    } else {
        format!("{:.2}s", f / 1e9)
    }
}

fn fmt_rate(bps: u64) -> String {
    for (div, unit) in [
        (1_000_000_000, "Gbit"),
        (1_000_000, "Mbit"),
        (1_000, "Kbit"),
    ] {
        if bps >= div {
            return if bps % div == 0 {
                format!("{}{unit}", bps / div)
            } else {
                format!("{:.1}{unit}", bps as f64 / div as f64)
            };
        }
    }
    format!("{bps}bit")
}

fn fmt_bytes(b: u64) -> String {
    let f = b as f64;
    if b < 10_000 {
        format!("{b}")
    } else if b < 10_000_000 {
        format!("{:.1}K", f / 1e3)
    } else {
        format!("{:.1}M", f / 1e6)
    }
}

/// The human form of a fabric stats file. `alive`: whether the fabric's pid lives, if known.
fn render_stats(v: &Value, alive: Option<bool>, now: u64) -> String {
    let topology = v.get("topology").and_then(Value::as_str).unwrap_or("?");
    let running = v.get("running").and_then(Value::as_bool).unwrap_or(false);
    let updated = u(v, "updated_unix");
    let stale = now.saturating_sub(updated) > STALE_AFTER_S;
    let stopped = !running || alive == Some(false) || stale;
    let uptime = v.get("uptime_s").and_then(Value::as_f64).unwrap_or(0.0);
    let cpu = v
        .get("loop_cpu_s")
        .and_then(Value::as_f64)
        .map_or(String::new(), |c| format!(", loop cpu {c:.1} s"));
    let mut out = format!(
        "fabric {topology}: up {uptime:.1} s{cpu}{}\n",
        if stopped {
            format!(
                " (fabric stopped; last update {}s ago)",
                now.saturating_sub(updated)
            )
        } else {
            String::new()
        }
    );
    let lag = v.get("lag").cloned().unwrap_or(Value::Null);
    out.push_str(&format!(
        "lag: mean {}  p99 {}  worst {}  late {}/{} departures (bound {})\n",
        fmt_ns(u(&lag, "mean_ns")),
        fmt_ns(u(&lag, "p99_ns")),
        fmt_ns(u(&lag, "worst_ns")),
        u(&lag, "late"),
        u(&lag, "departures"),
        fmt_ns(u(&lag, "max_lag_ns")),
    ));
    if lag.get("behind").and_then(Value::as_bool).unwrap_or(false) {
        out.push_str(
            "BEHIND: results of this run are not valid (the fabric sent too many frames later \
             than scheduled; lower the link rates or the load)\n",
        );
    }
    let switches = arr(v, "switches");
    for sw in switches {
        let f = sw.get("forward").cloned().unwrap_or(Value::Null);
        out.push_str(&format!(
            "switch {} (ecmp {}): rx {}  forwarded {}  no_route {}  ttl_expired {}  malformed {}  \
             not_ipv4 {}\n",
            sw.get("name").and_then(Value::as_str).unwrap_or("?"),
            sw.get("ecmp").and_then(Value::as_str).unwrap_or("?"),
            u(&f, "rx"),
            u(&f, "forwarded"),
            u(&f, "no_route"),
            u(&f, "ttl_expired"),
            u(&f, "malformed"),
            u(&f, "not_ipv4"),
        ));
    }
    out.push('\n');
    let mut rows = vec![row([
        "SWITCH",
        "PORT",
        "PEER",
        "RATE",
        "DELIVERED",
        "LOST",
        "Q",
        "ENQ",
        "DEQ",
        "MARKED",
        "DROP_THR",
        "DROP_BUF",
        "MAXDEPTH",
        "DEPTH",
    ])];
    let mut warnings = Vec::new();
    for sw in switches {
        let sname = sw.get("name").and_then(Value::as_str).unwrap_or("?");
        for p in arr(sw, "ports") {
            let e = p.get("egress").cloned().unwrap_or(Value::Null);
            let ifname = p.get("ifname").and_then(Value::as_str).unwrap_or("?");
            let mut head = vec![
                sname.to_owned(),
                ifname.to_owned(),
                p.get("peer")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_owned(),
                fmt_rate(u(p, "rate_bps")),
                u(&e, "delivered_pkts").to_string(),
                u(&e, "lost_pkts").to_string(),
            ];
            let depth = arr(p, "depth_bytes");
            let mut any = false;
            for (q, qc) in arr(&e, "queues").iter().enumerate() {
                let offered =
                    u(qc, "enqueued_pkts") + u(qc, "dropped_threshold") + u(qc, "dropped_buffer");
                if offered == 0 {
                    continue;
                }
                let mut r = std::mem::replace(&mut head, vec![String::new(); 6]);
                r.extend([
                    q.to_string(),
                    u(qc, "enqueued_pkts").to_string(),
                    u(qc, "dequeued_pkts").to_string(),
                    u(qc, "marked").to_string(),
                    u(qc, "dropped_threshold").to_string(),
                    u(qc, "dropped_buffer").to_string(),
                    fmt_bytes(u(qc, "max_depth_bytes")),
                    fmt_bytes(depth.get(q).and_then(Value::as_u64).unwrap_or(0)),
                ]);
                rows.push(r);
                any = true;
            }
            if !any {
                head.extend(std::iter::repeat_n("-".to_owned(), 8));
                rows.push(head);
            }
            let k = p.get("kernel").cloned().unwrap_or(Value::Null);
            let s = p.get("socket").cloned().unwrap_or(Value::Null);
            let kdrops = u(&k, "rx_dropped") + u(&k, "rx_ring_full");
            let refused = u(&s, "tx_refused");
            if kdrops > 0 || refused > 0 {
                warnings.push(format!(
                    "{sname} {ifname}: {kdrops} frames dropped by the kernel before the fabric \
                     saw them, {refused} refused by the TX ring"
                ));
            }
        }
    }
    let mut right = vec![false, false, false, true, true, true];
    right.extend([true; 8]);
    out.push_str(&table(&rows, &right));
    for w in warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_formats() {
        assert!(is_name("incast"));
        assert!(is_name("t12345"));
        assert!(!is_name("9abc"));
        assert!(!is_name("toolongname"));
        assert!(!is_name("../x"));
        assert!(!is_name(""));
        assert_eq!(fmt_rate(200_000_000), "200Mbit");
        assert_eq!(fmt_rate(10_000_000_000), "10Gbit");
        assert_eq!(fmt_rate(1_500_000), "1.5Mbit");
        assert_eq!(fmt_ns(640), "640ns");
        assert_eq!(fmt_ns(65_535), "65.5us");
        assert_eq!(fmt_ns(2_500_000), "2.50ms");
        assert_eq!(fmt_bytes(1538), "1538");
        assert_eq!(fmt_bytes(45_100), "45.1K");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &[row(["A", "NUM"]), row(["long", "7"]), row(["x", "1234"])],
            &[false, true],
        );
        assert_eq!(t, "A      NUM\nlong     7\nx     1234\n");
    }

    fn sample(running: bool, behind: bool) -> Value {
        let mut queues = vec![
            serde_json::json!({"enqueued_pkts": 0, "dequeued_pkts": 0, "marked": 0,
            "dropped_threshold": 0, "dropped_buffer": 0, "max_depth_bytes": 0});
            8
        ];
        queues[1] = serde_json::json!({"enqueued_pkts": 900, "dequeued_pkts": 899, "marked": 12,
            "dropped_threshold": 3, "dropped_buffer": 0, "max_depth_bytes": 45_100});
        serde_json::json!({
            "topology": "incast", "running": running, "uptime_s": 12.34, "updated_unix": 1000,
            "lag": {"departures": 1800, "late": 2, "max_lag_ns": 1_000_000, "worst_ns": 2_500_000,
                    "mean_ns": 9000, "p99_ns": 65_535, "behind": behind},
            "switches": [{"name": "s0", "ecmp": "flow",
                "forward": {"rx": 1810, "forwarded": 1800, "not_ipv4": 10, "malformed": 0,
                            "ttl_expired": 0, "no_route": 0},
                "ports": [
                    {"ifname": "p0", "peer": "host h0", "rate_bps": 200_000_000, "delay_ns": 20000,
                     "loss": 0.0, "egress": {"queues": queues, "delivered_pkts": 899,
                     "lost_pkts": 0}, "depth_bytes": [0, 1538, 0, 0, 0, 0, 0, 0],
                     "socket": {"tx_refused": 0}, "kernel": {"rx_dropped": 0}},
                    {"ifname": "p1", "peer": "host h1", "rate_bps": 200_000_000, "delay_ns": 20000,
                     "loss": 0.0, "egress": {"queues": [], "delivered_pkts": 0, "lost_pkts": 0},
                     "depth_bytes": [0, 0, 0, 0, 0, 0, 0, 0],
                     "socket": {"tx_refused": 5}, "kernel": {"rx_dropped": 0}}
                ]}]
        })
    }

    #[test]
    fn render_shows_active_queues_and_state() {
        let out = render_stats(&sample(true, false), Some(true), 1001);
        assert!(out.starts_with("fabric incast: up 12.3 s\n"), "{out}");
        assert!(out.contains("forwarded 1800"), "{out}");
        assert!(out.contains("p99 65.5us"), "{out}");
        assert!(!out.contains("BEHIND"), "{out}");
        let p0 = out
            .lines()
            .find(|l| l.starts_with("s0") && l.contains("p0"))
            .unwrap();
        let cells: Vec<&str> = p0.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "s0", "p0", "host", "h0", "200Mbit", "899", "0", "1", "900", "899", "12", "3", "0",
                "45.1K", "1538"
            ]
        );
        let p1 = out.lines().find(|l| l.contains(" p1 ")).unwrap();
        assert_eq!(
            p1.split_whitespace().collect::<Vec<_>>()[..7],
            ["s0", "p1", "host", "h1", "200Mbit", "0", "0"]
        );
        assert!(
            out.contains("warning: s0 p1: 0 frames dropped by the kernel"),
            "{out}"
        );

        let out = render_stats(&sample(true, true), Some(false), 1001);
        assert!(out.contains("(fabric stopped"), "{out}");
        assert!(
            out.contains("BEHIND: results of this run are not valid"),
            "{out}"
        );
        let out = render_stats(&sample(true, false), None, 1100);
        assert!(out.contains("(fabric stopped"), "stale file: {out}");
        let out = render_stats(&sample(false, false), None, 1000);
        assert!(out.contains("(fabric stopped"), "{out}");
    }
}
