//! Supervision of background fabrics: the library behind `gradwire testbed up|down|status`
//! and `gradwire fabric run|stats`, so that the command line only parses and prints.
//!
//! A testbed is a topology file built as network namespaces `gwt<name>-<node>`
//! ([`FabricNet::up_persistent`]) plus one fabric process that forwards between the switch
//! ports. [`Testbeds::up`] starts that process from a [`FabricProgram`] (the command line
//! re-executes itself as `gradwire fabric run FILE --prefix P --stats PATH --xdp-mode M
//! --seed N`), detached in its own process group so that it outlives the command that started
//! it, and returns once the fabric has published stats saying it runs. Everything a later
//! command needs lives in one state directory ([`Testbeds::dir`]):
//!
//! - `testbed-<name>.json`: the record ([`TestbedRecord`]: topology file, fabric pid,
//!   namespaces), written before the fabric is waited for, so that an interrupted `up` still
//!   leaves what `down` needs;
//! - `fabric-<name>.json`: the fabric's stats ([`crate::stats`]), replaced every stats interval,
//!   its last snapshot written as the fabric stops;
//! - `fabric-<name>.log`: the fabric's stdout and stderr, removed by `down` only when the fabric
//!   stopped in order and left its final stats.
//!
//! Stale state: a record whose fabric died makes `up` refuse and `down` clean up; `down` also
//! finds namespaces named like the testbed and fabric processes of its prefix that no record
//! knows (an `up` interrupted before its record was written). A pid is signalled only while
//! its command line is still the fabric's, never a process that reused the pid.

use std::ffi::OsStr;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gradwire_ebpf::AttachMode;
use gradwire_netns::{delete_netns, is_root, namespaces_with_prefix, netns_path, NetnsError};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::netns::{ns_name, FabricNet};
use crate::run::{Fabric, FabricConfig, FabricError};
use crate::stats::{read_stats, FabricStats, StatsFileError, StatsPublisher};
use crate::topology::{Topology, TopologyError};

/// How long [`Testbeds::up`] waits for the fabric to publish `running: true`.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`Testbeds::down`] waits after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// A `running` stats snapshot older than this belongs to a fabric that died.
pub const STALE_AFTER_S: u64 = 5;
/// How often a wait for a process or a file looks again.
const POLL: Duration = Duration::from_millis(50);

/// The namespace prefix of the supervised testbed `name` (`gwt<name>`): stable, so that
/// `gradwire testbed down` finds it again, and never matched by the namespace kit's stale
/// cleanup (a digit would have to follow `gw`).
pub fn testbed_prefix(name: &str) -> String {
    format!("gwt{name}")
}

/// Why a testbed could not be brought up, down, or looked at.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The topology file could not be read or is invalid (the error names file and field).
    #[error("topology {0}")]
    Topology(#[source] TopologyError),
    /// Building or removing namespaces needs root.
    #[error(
        "{what} needs root (effective uid {euid}): it creates network namespaces and attaches \
         XDP programs; run it with sudo"
    )]
    NotRoot {
        /// The command.
        what: &'static str,
        /// The effective uid we run as.
        euid: u32,
    },
    /// A file or directory of the state directory, or the program itself.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the path.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A testbed record that does not decode.
    #[error("{}: not a testbed record: {source}", path.display())]
    Record {
        /// The record file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: serde_json::Error,
    },
    /// The fabric's stats file.
    #[error(transparent)]
    Stats(#[from] StatsFileError),
    /// Building or removing the namespaces.
    #[error(transparent)]
    Namespaces(#[from] NetnsError),
    /// Opening the fabric's ports.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// `up` of a testbed whose fabric runs.
    #[error(
        "testbed {name:?} is already up (fabric pid {pid}); `gradwire testbed down {name}` it \
         first"
    )]
    AlreadyUp {
        /// Testbed.
        name: String,
        /// Its fabric.
        pid: i32,
    },
    /// `up` of a testbed whose namespaces exist without a record (an interrupted `up`).
    #[error(
        "testbed {name:?} is already up (namespace {netns} exists); `gradwire testbed down \
         {name}` it first"
    )]
    NamespaceExists {
        /// Testbed.
        name: String,
        /// The namespace found.
        netns: String,
    },
    /// `up` of a testbed whose record outlived its fabric.
    #[error(
        "testbed {name:?} is left over: its fabric (pid {pid}) is not running; `gradwire \
         testbed down {name}` cleans it up"
    )]
    LeftOver {
        /// Testbed.
        name: String,
        /// Its dead fabric.
        pid: i32,
    },
    /// The fabric process exited before it was ready.
    #[error("the fabric exited during startup ({status}); its log {}:\n{tail}", log.display())]
    ExitedDuringStartup {
        /// How it exited.
        status: ExitStatus,
        /// Its log.
        log: PathBuf,
        /// The last lines of the log.
        tail: String,
    },
    /// The fabric process did not get ready in time (it was killed).
    #[error(
        "the fabric did not start within {}s; its log {}:\n{tail}",
        START_TIMEOUT.as_secs(),
        log.display()
    )]
    StartTimeout {
        /// Its log.
        log: PathBuf,
        /// The last lines of the log.
        tail: String,
    },
    /// Signalling the fabric failed.
    #[error("cannot send {signal} to the fabric (pid {pid}): {source}")]
    Signal {
        /// The signal.
        signal: Signal,
        /// The fabric.
        pid: i32,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// The fabric is still there after SIGKILL.
    #[error("fabric (pid {pid}) survived SIGKILL")]
    SurvivedKill {
        /// The fabric.
        pid: i32,
    },
    /// `down` could not remove everything; the record stays for another try.
    #[error(
        "testbed {name}: teardown left problems (record kept in {}): {}",
        record.display(),
        problems.join("; ")
    )]
    Teardown {
        /// Testbed.
        name: String,
        /// Its record.
        record: PathBuf,
        /// What went wrong.
        problems: Vec<String>,
    },
    /// `down` of something that is neither a file nor a testbed name.
    #[error("{target:?} is neither a topology file nor a testbed name (1..=8 of a-z 0-9)")]
    NotATarget {
        /// As given.
        target: String,
    },
    /// `fabric stats` of something that is neither a stats file nor a testbed name.
    #[error("{target:?} is neither a testbed name (1..=8 of a-z 0-9) nor a stats file; {hint}")]
    NotAStatsTarget {
        /// As given.
        target: String,
        /// Which testbeds run.
        hint: RunningHint,
    },
    /// A stats file path that does not exist.
    #[error("{path}: no such stats file")]
    NoStatsFile {
        /// As given.
        path: String,
    },
    /// A testbed without a stats file.
    #[error("no fabric stats for testbed {name:?} ({} does not exist); {hint}", path.display())]
    NoStats {
        /// Testbed.
        name: String,
        /// Where its stats would be.
        path: PathBuf,
        /// Which testbeds run.
        hint: RunningHint,
    },
    /// `fabric stats` without a name when none runs.
    #[error("{0}")]
    NoneRunning(RunningHint),
    /// `fabric stats` without a name when several run.
    #[error(
        "{} testbeds are running ({}); name one: `gradwire fabric stats NAME`",
        names.len(),
        names.join(", ")
    )]
    SeveralRunning {
        /// Their names.
        names: Vec<String>,
    },
    /// `fabric run` of a testbed whose namespaces are not there.
    #[error(
        "switch {switch}: network namespace {netns} does not exist; build the testbed with \
         `gradwire testbed up {}` (which also starts its fabric)",
        file.display()
    )]
    NoNamespace {
        /// Switch.
        switch: String,
        /// Its namespace.
        netns: String,
        /// The topology file.
        file: PathBuf,
    },
    /// `fabric run` of a testbed that has a fabric already.
    #[error(
        "testbed {name} already has a fabric running (pid {pid}); two would fight over the \
         switch ports"
    )]
    FabricRunning {
        /// Testbed.
        name: String,
        /// The other fabric.
        pid: i32,
    },
}

/// The running testbeds, for error messages that say what exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningHint(pub Vec<String>);

impl std::fmt::Display for RunningHint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("no testbed is running; start one with `gradwire testbed up FILE`")
        } else {
            write!(f, "running testbeds: {}", self.0.join(", "))
        }
    }
}

fn io_error(context: String) -> impl FnOnce(std::io::Error) -> SuperviseError {
    move |source| SuperviseError::Io { context, source }
}

fn not_root(what: &'static str) -> SuperviseError {
    SuperviseError::NotRoot {
        what,
        euid: nix::unistd::geteuid().as_raw(),
    }
}

/// What `up` records for `down`, `status` and `fabric stats`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestbedRecord {
    /// Testbed (topology) name.
    pub name: String,
    /// Absolute path of the topology file.
    pub file: PathBuf,
    /// The fabric process.
    pub pid: i32,
    /// Namespace prefix.
    pub prefix: String,
    /// Hosts, in topology order.
    pub hosts: Vec<HostRecord>,
    /// Switches, in topology order.
    pub switches: Vec<SwitchRecord>,
}

/// A host of a testbed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    /// Name in the topology.
    pub name: String,
    /// Its address.
    pub ip: Ipv4Addr,
    /// Its namespace.
    pub netns: String,
}

/// A switch of a testbed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchRecord {
    /// Name in the topology.
    pub name: String,
    /// Its namespace.
    pub netns: String,
}

impl TestbedRecord {
    /// Every namespace, switches first.
    pub fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.switches
            .iter()
            .map(|s| s.netns.as_str())
            .chain(self.hosts.iter().map(|h| h.netns.as_str()))
    }
}

/// A record and whether its fabric process lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestbedStatus {
    /// The record.
    #[serde(flatten)]
    pub record: TestbedRecord,
    /// The fabric process lives.
    pub running: bool,
}

/// A topology (testbed) name: 1..=8 of a-z 0-9, starting with a letter.
pub fn is_testbed_name(s: &str) -> bool {
    (1..=8).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && s.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
}

/// Loads a topology file.
pub fn load_topology(path: &Path) -> Result<Topology, SuperviseError> {
    Topology::load(path).map_err(SuperviseError::Topology)
}

/// The process state letter from /proc/<pid>/stat (`R`, `S`, `Z`, ...), if it exists.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may contain anything, so look after the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether `pid` is a live process (a zombie is not).
pub fn pid_running(pid: i32) -> bool {
    pid > 1 && proc_state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// Whether a stats snapshot is older than [`STALE_AFTER_S`] at `now_unix`.
pub fn is_stale(stats: &FabricStats, now_unix: u64) -> bool {
    now_unix.saturating_sub(stats.updated_unix) > STALE_AFTER_S
}

/// Seconds since the epoch.
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The program that runs a fabric in the foreground, and how its processes are recognised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricProgram {
    /// The executable.
    pub program: PathBuf,
    /// The arguments selecting the fabric runner (`["fabric", "run"]`). [`Testbeds::up`]
    /// appends `FILE --prefix P --stats PATH --xdp-mode M --seed N`.
    pub subcommand: Vec<String>,
}

impl FabricProgram {
    /// This executable, run with `subcommand`.
    pub fn this_program(subcommand: &[&str]) -> Result<FabricProgram, SuperviseError> {
        let program =
            std::env::current_exe().map_err(io_error("cannot find this program".to_owned()))?;
        Ok(FabricProgram {
            program,
            subcommand: subcommand.iter().map(|s| (*s).to_owned()).collect(),
        })
    }

    /// Whether process `pid` is this program's fabric for `prefix` (and not some other
    /// process that got a recycled pid).
    pub fn is_running_as(&self, pid: i32, prefix: &str) -> bool {
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            return false;
        };
        let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
        let ours = self.program.file_name();
        let exe_ok = args
            .first()
            .is_some_and(|a0| Path::new(OsStr::from_bytes(a0)).file_name() == ours);
        let sub_ok = self.subcommand.iter().all(|w| args.contains(&w.as_bytes()));
        let prefix_ok = args
            .windows(2)
            .any(|w| w[0] == b"--prefix" && w[1] == prefix.as_bytes());
        exe_ok && sub_ok && prefix_ok
    }

    /// Live fabric processes of `prefix`, found through /proc.
    fn find(&self, prefix: &str) -> Vec<i32> {
        let mut out: Vec<i32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid_running(pid) && self.is_running_as(pid, prefix))
            .collect();
        out.sort_unstable();
        out
    }
}

/// Settings of a background fabric that are not in the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchOptions {
    /// XDP attach mode of the switch ports.
    pub xdp_mode: AttachMode,
    /// Seed of the link-loss generators and packet ECMP.
    pub seed: u64,
}

/// A testbed `up` built.
#[derive(Debug, Clone)]
pub struct UpTestbed {
    /// Its record.
    pub record: TestbedRecord,
    /// The fabric's log.
    pub log: PathBuf,
}

/// What `down` is asked to take down.
#[derive(Debug)]
pub struct DownTarget {
    /// Testbed name.
    pub name: String,
    /// The topology, when given as a file.
    pub topology: Option<Topology>,
}

impl DownTarget {
    /// A topology file (when `target` is a file) or a testbed name.
    pub fn parse(target: &str) -> Result<DownTarget, SuperviseError> {
        let path = Path::new(target);
        if path.is_file() {
            let t = load_topology(path)?;
            Ok(DownTarget {
                name: t.name.clone(),
                topology: Some(t),
            })
        } else if is_testbed_name(target) {
            Ok(DownTarget {
                name: target.to_owned(),
                topology: None,
            })
        } else {
            Err(SuperviseError::NotATarget {
                target: target.to_owned(),
            })
        }
    }
}

/// How a fabric process ended.
#[derive(Debug, Clone, PartialEq)]
pub enum StopOutcome {
    /// It was not running.
    NotRunning,
    /// The pid belongs to another process now: not signalled.
    NotTheFabric,
    /// It stopped on SIGTERM; its final stats, if it wrote them.
    Stopped {
        /// The last snapshot (`running: false`).
        final_stats: Option<Box<FabricStats>>,
    },
    /// It had to be killed ([`STOP_TIMEOUT`] after SIGTERM).
    Killed,
}

/// One fabric process `down` dealt with.
#[derive(Debug, Clone, PartialEq)]
pub struct StoppedFabric {
    /// The pid.
    pub pid: i32,
    /// What happened.
    pub outcome: StopOutcome,
    /// Its log, if still there (kept unless it stopped in order with final stats).
    pub log_kept: Option<PathBuf>,
}

/// What `down` did.
#[derive(Debug)]
pub struct DownReport {
    /// Testbed.
    pub name: String,
    /// Something was up (a record, a namespace or a fabric process).
    pub was_up: bool,
    /// The record could not be read, so it was ignored: the namespaces were found by name.
    pub ignored_record: Option<SuperviseError>,
    /// The recorded fabric.
    pub fabric: Option<StoppedFabric>,
    /// Fabric processes of this testbed that were not in the record.
    pub strays: Vec<StoppedFabric>,
    /// Namespaces removed.
    pub removed: usize,
    /// What went wrong (then the record is kept; see [`DownReport::result`]).
    pub problems: Vec<String>,
    record: PathBuf,
}

impl DownReport {
    /// `Err` with every problem if the teardown was not complete.
    pub fn result(&self) -> Result<(), SuperviseError> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(SuperviseError::Teardown {
                name: self.name.clone(),
                record: self.record.clone(),
                problems: self.problems.clone(),
            })
        }
    }
}

/// Where `fabric stats` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsSource {
    /// The stats file.
    pub path: PathBuf,
    /// The fabric's pid, when a record names it.
    pub pid: Option<i32>,
}

impl StatsSource {
    /// Whether the fabric's process lives, if its pid is known.
    pub fn alive(&self) -> Option<bool> {
        self.pid.map(pid_running)
    }
}

/// What `fabric run` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPlan {
    /// Namespace prefix.
    pub prefix: String,
    /// Namespace of each switch, in topology order.
    pub switch_ns: Vec<String>,
    /// Where stats are published.
    pub stats_path: PathBuf,
}

/// The testbeds of one state directory.
#[derive(Debug, Clone)]
pub struct Testbeds {
    dir: PathBuf,
    program: FabricProgram,
}

impl Testbeds {
    /// Testbeds recorded in `dir`, whose fabrics are `program`.
    pub fn new(dir: PathBuf, program: FabricProgram) -> Testbeds {
        Testbeds { dir, program }
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The record of testbed `name`.
    pub fn record_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("testbed-{name}.json"))
    }

    /// The fabric stats of testbed `name`.
    pub fn stats_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("fabric-{name}.json"))
    }

    /// The fabric log of testbed `name`.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("fabric-{name}.log"))
    }

    /// The record of testbed `name`, `None` if there is none.
    pub fn record(&self, name: &str) -> Result<Option<TestbedRecord>, SuperviseError> {
        let path = self.record_path(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(format!("{}: cannot read", path.display()))(e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| SuperviseError::Record { path, source })
    }

    fn write_record(&self, rec: &TestbedRecord) -> Result<(), SuperviseError> {
        let path = self.record_path(&rec.name);
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_vec_pretty(rec).map_err(|source| SuperviseError::Record {
            path: path.clone(),
            source,
        })?;
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(io_error(format!("{}: cannot write", path.display())))
    }

    /// Every readable testbed record, sorted by name (a damaged one is left for `down`).
    pub fn records(&self) -> Vec<TestbedRecord> {
        let mut out: Vec<TestbedRecord> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let f = e.file_name();
                let name = f
                    .to_str()?
                    .strip_prefix("testbed-")?
                    .strip_suffix(".json")?;
                self.record(name).ok().flatten()
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Every record with whether its fabric lives.
    pub fn status(&self) -> Vec<TestbedStatus> {
        self.records()
            .into_iter()
            .map(|record| TestbedStatus {
                running: pid_running(record.pid),
                record,
            })
            .collect()
    }

    /// Builds the namespaces of `topo` (read from `file`) and starts its fabric in the
    /// background; returns once the fabric runs. On failure nothing is left behind.
    pub fn up(
        &self,
        topo: &Topology,
        file: &Path,
        opts: LaunchOptions,
    ) -> Result<UpTestbed, SuperviseError> {
        if !is_root() {
            return Err(not_root("gradwire testbed up"));
        }
        let name = topo.name.clone();
        std::fs::create_dir_all(&self.dir)
            .map_err(io_error(format!("cannot create {}", self.dir.display())))?;
        if let Some(rec) = self.record(&name)? {
            return Err(if pid_running(rec.pid) {
                SuperviseError::AlreadyUp { name, pid: rec.pid }
            } else {
                SuperviseError::LeftOver { name, pid: rec.pid }
            });
        }
        let file = std::fs::canonicalize(file).map_err(io_error(file.display().to_string()))?;
        let prefix = testbed_prefix(&name);
        let net =
            FabricNet::up_persistent(topo, &prefix, "gradwire testbed").map_err(|e| match e {
                NetnsError::AlreadyExists { netns } => SuperviseError::NamespaceExists {
                    name: name.clone(),
                    netns,
                },
                e => e.into(),
            })?;

        let stats = self.stats_path(&name);
        let log = self.log_path(&name);
        let _ = std::fs::remove_file(&stats);
        let child = match self.spawn(&file, &prefix, &stats, &log, opts) {
            Ok(c) => c,
            Err(e) => {
                remove_namespaces(net);
                return Err(e);
            }
        };
        let record = TestbedRecord {
            name: name.clone(),
            file,
            pid: i32::try_from(child.id()).unwrap_or(i32::MAX),
            prefix,
            hosts: topo
                .hosts
                .iter()
                .zip(net.host_namespaces())
                .map(|(h, ns)| HostRecord {
                    name: h.name.clone(),
                    ip: h.ip,
                    netns: ns.clone(),
                })
                .collect(),
            switches: topo
                .switches
                .iter()
                .zip(net.switch_namespaces())
                .map(|(s, ns)| SwitchRecord {
                    name: s.name.clone(),
                    netns: ns.clone(),
                })
                .collect(),
        };
        // Recorded before the wait, so that an interrupted `up` still leaves what `down` needs.
        if let Err(e) = self.write_record(&record) {
            kill_child(child);
            remove_namespaces(net);
            return Err(e);
        }
        if let Err(e) = wait_ready(child, &stats, &log) {
            let _ = std::fs::remove_file(self.record_path(&name));
            let _ = std::fs::remove_file(&stats);
            remove_namespaces(net);
            return Err(e);
        }
        Ok(UpTestbed { record, log })
    }

    fn spawn(
        &self,
        file: &Path,
        prefix: &str,
        stats: &Path,
        log: &Path,
        opts: LaunchOptions,
    ) -> Result<Child, SuperviseError> {
        let out =
            File::create(log).map_err(io_error(format!("{}: cannot create", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io_error(format!("{}: cannot duplicate", log.display())))?;
        Command::new(&self.program.program)
            .args(&self.program.subcommand)
            .arg(file)
            .arg("--prefix")
            .arg(prefix)
            .arg("--stats")
            .arg(stats)
            .arg("--xdp-mode")
            .arg(opts.xdp_mode.to_string())
            .arg("--seed")
            .arg(opts.seed.to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own process group: a Ctrl-C meant for the shell's foreground job is not
            // for it.
            .process_group(0)
            .spawn()
            .map_err(io_error(format!(
                "cannot start `{} {}`",
                self.program.program.display(),
                self.program.subcommand.join(" ")
            )))
    }

    /// Stops the fabric of a testbed and removes its namespaces, record and stats. A damaged
    /// record does not keep a testbed from coming down: its namespaces are found by name.
    pub fn down(&self, target: DownTarget) -> Result<DownReport, SuperviseError> {
        let DownTarget { name, topology } = target;
        let mut report = DownReport {
            record: self.record_path(&name),
            name: name.clone(),
            was_up: true,
            ignored_record: None,
            fabric: None,
            strays: Vec::new(),
            removed: 0,
            problems: Vec::new(),
        };
        let record = self.record(&name).unwrap_or_else(|e| {
            report.ignored_record = Some(e);
            None
        });
        let prefix = testbed_prefix(&name);
        let mut namespaces = namespaces_with_prefix(&prefix);
        if let Some(rec) = &record {
            namespaces.extend(rec.namespaces().map(str::to_owned));
        }
        namespaces.sort();
        namespaces.dedup();
        namespaces.retain(|ns| netns_path(ns).exists());

        let recorded = record.as_ref().map(|r| r.pid);
        let strays: Vec<i32> = self
            .program
            .find(&prefix)
            .into_iter()
            .filter(|p| Some(*p) != recorded)
            .collect();

        if record.is_none() && namespaces.is_empty() && strays.is_empty() {
            let _ = std::fs::remove_file(self.record_path(&name));
            let _ = std::fs::remove_file(self.stats_path(&name));
            report.was_up = false;
            return Ok(report);
        }
        if !is_root() {
            return Err(not_root("gradwire testbed down"));
        }
        if let Some(rec) = &record {
            let log = self.log_path(&name);
            match self.stop(rec.pid, &rec.prefix) {
                Ok(mut outcome) => {
                    if let StopOutcome::Stopped { final_stats } = &mut outcome {
                        *final_stats = read_stats(&self.stats_path(&name))
                            .ok()
                            .filter(|s| !s.running)
                            .map(Box::new);
                    }
                    let clean = matches!(
                        &outcome,
                        StopOutcome::Stopped {
                            final_stats: Some(_)
                        }
                    );
                    if clean {
                        // Its summary is in the final stats: the log has served its purpose.
                        let _ = std::fs::remove_file(&log);
                    }
                    report.fabric = Some(StoppedFabric {
                        pid: rec.pid,
                        outcome,
                        log_kept: (!clean && log.exists()).then_some(log),
                    });
                }
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        for pid in strays {
            match self.stop(pid, &prefix) {
                Ok(outcome) => report.strays.push(StoppedFabric {
                    pid,
                    outcome,
                    log_kept: None,
                }),
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        // The topology, for `down_by_name`: the one named, else the recorded file if it is
        // still there and still describes this testbed.
        let topology = topology.or_else(|| {
            record
                .as_ref()
                .and_then(|r| Topology::load(&r.file).ok())
                .filter(|t| t.name == name)
        });
        if let Some(t) = &topology {
            match FabricNet::down_by_name(t, &prefix) {
                Ok(n) => report.removed += n,
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        // Whatever is left: namespaces recorded, or named like this testbed's.
        for ns in &namespaces {
            match delete_netns(ns) {
                Ok(true) => report.removed += 1,
                Ok(false) => {}
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        if report.problems.is_empty() {
            let stats = self.stats_path(&name);
            for p in [self.record_path(&name), stats.with_extension("tmp"), stats] {
                let _ = std::fs::remove_file(p);
            }
        }
        Ok(report)
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    fn stop(&self, pid: i32, prefix: &str) -> Result<StopOutcome, SuperviseError> {
        if !pid_running(pid) {
            return Ok(StopOutcome::NotRunning);
        }
        if !self.program.is_running_as(pid, prefix) {
            return Ok(StopOutcome::NotTheFabric);
        }
        signal(pid, Signal::SIGTERM)?;
        if wait_gone(pid, STOP_TIMEOUT) {
            return Ok(StopOutcome::Stopped { final_stats: None });
        }
        signal(pid, Signal::SIGKILL)?;
        if wait_gone(pid, Duration::from_secs(2)) {
            Ok(StopOutcome::Killed)
        } else {
            Err(SuperviseError::SurvivedKill { pid })
        }
    }

    /// The stats file `fabric stats` shows for `target` (a testbed name or a stats file; by
    /// default the only running testbed), and the pid of its fabric if recorded.
    pub fn stats_source(&self, target: Option<&str>) -> Result<StatsSource, SuperviseError> {
        let records = self.records();
        let running: Vec<&TestbedRecord> = records.iter().filter(|r| pid_running(r.pid)).collect();
        let hint = || RunningHint(running.iter().map(|r| r.name.clone()).collect());
        match target {
            Some(t) if t.contains('/') || t.ends_with(".json") => {
                let path = PathBuf::from(t);
                if !path.is_file() {
                    return Err(SuperviseError::NoStatsFile { path: t.to_owned() });
                }
                Ok(StatsSource { path, pid: None })
            }
            Some(t) => {
                if !is_testbed_name(t) {
                    return Err(SuperviseError::NotAStatsTarget {
                        target: t.to_owned(),
                        hint: hint(),
                    });
                }
                let path = self.stats_path(t);
                if !path.is_file() {
                    return Err(SuperviseError::NoStats {
                        name: t.to_owned(),
                        path,
                        hint: hint(),
                    });
                }
                let pid = records.iter().find(|r| r.name == t).map(|r| r.pid);
                Ok(StatsSource { path, pid })
            }
            None => match running.as_slice() {
                [one] => Ok(StatsSource {
                    path: self.stats_path(&one.name),
                    pid: Some(one.pid),
                }),
                [] => Err(SuperviseError::NoneRunning(hint())),
                _ => Err(SuperviseError::SeveralRunning {
                    names: running.iter().map(|r| r.name.clone()).collect(),
                }),
            },
        }
    }

    /// Checks that the fabric of `topo` (from `file`) can run in the foreground: its switch
    /// namespaces exist, we are root, and no other fabric of this testbed runs. `prefix`
    /// defaults to the one `up` uses, `stats` to the testbed's stats file.
    pub fn plan_run(
        &self,
        topo: &Topology,
        file: &Path,
        prefix: Option<&str>,
        stats: Option<PathBuf>,
    ) -> Result<RunPlan, SuperviseError> {
        let name = &topo.name;
        let prefix = prefix.map_or_else(|| testbed_prefix(name), str::to_owned);
        let switch_ns: Vec<String> = topo
            .switches
            .iter()
            .map(|s| ns_name(&prefix, &s.name))
            .collect();
        for (s, ns) in topo.switches.iter().zip(&switch_ns) {
            if !netns_path(ns).exists() {
                return Err(SuperviseError::NoNamespace {
                    switch: s.name.clone(),
                    netns: ns.clone(),
                    file: file.to_path_buf(),
                });
            }
        }
        if !is_root() {
            return Err(not_root("gradwire fabric run"));
        }
        let me = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        if let Some(rec) = self.record(name).ok().flatten() {
            if rec.pid != me && rec.prefix == prefix && pid_running(rec.pid) {
                return Err(SuperviseError::FabricRunning {
                    name: name.clone(),
                    pid: rec.pid,
                });
            }
        }
        let stats_path = stats.unwrap_or_else(|| self.stats_path(name));
        if let Some(parent) = stats_path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(io_error(format!("cannot create {}", parent.display())))?;
        }
        Ok(RunPlan {
            prefix,
            switch_ns,
            stats_path,
        })
    }
}

impl RunPlan {
    /// Runs the fabric of `topo` on this thread until `stop` is set, publishing its stats;
    /// `opened` is called once every port is open. Returns the final stats.
    pub fn run(
        &self,
        topo: &Topology,
        cfg: FabricConfig,
        stop: &AtomicBool,
        opened: impl FnOnce(),
    ) -> Result<Option<FabricStats>, SuperviseError> {
        let cfg = FabricConfig {
            stats_path: Some(self.stats_path.clone()),
            ..cfg
        };
        let mut fabric = Fabric::open(topo, &self.switch_ns, cfg)?;
        opened();
        let mut publisher = StatsPublisher::new(self.stats_path.clone());
        let mut last = None;
        fabric.run(stop, |s| {
            publisher.publish(s);
            if !s.running {
                last = Some(s.clone());
            }
        });
        Ok(last)
    }
}

/// Sends `sig`, ignoring a process that is gone already.
fn signal(pid: i32, sig: Signal) -> Result<(), SuperviseError> {
    match kill(Pid::from_raw(pid), sig) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(source) => Err(SuperviseError::Signal {
            signal: sig,
            pid,
            source,
        }),
    }
}

/// Waits until `pid` is gone, at most `timeout`.
fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while pid_running(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

/// Kills a child that is not up yet and reaps it.
fn kill_child(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Removes the namespaces of a testbed that did not come up.
fn remove_namespaces(net: FabricNet) {
    if let Err(e) = net.down() {
        eprintln!("gradwire: warning: removing the namespaces again: {e}");
    }
}

/// Waits until the fabric publishes `running: true`, or exits, or [`START_TIMEOUT`] passes
/// (then it is stopped). On success the child is left running, not waited for.
fn wait_ready(mut child: Child, stats: &Path, log: &Path) -> Result<(), SuperviseError> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(SuperviseError::ExitedDuringStartup {
                    status,
                    log: log.to_path_buf(),
                    tail: tail(log, 20),
                })
            }
            Ok(None) => {}
            Err(e) => {
                kill_child(child);
                return Err(io_error("cannot watch the starting fabric".to_owned())(e));
            }
        }
        match read_stats(stats) {
            Ok(s) if s.running => return Ok(()),
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                kill_child(child);
                return Err(e.into());
            }
        }
        if Instant::now() >= deadline {
            let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
            // SIGTERM first, so that it detaches its XDP programs; then make sure.
            let _ = signal(pid, Signal::SIGTERM);
            let grace = Instant::now() + Duration::from_millis(500);
            while Instant::now() < grace && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(POLL);
            }
            kill_child(child);
            return Err(SuperviseError::StartTimeout {
                log: log.to_path_buf(),
                tail: tail(log, 20),
            });
        }
        std::thread::sleep(POLL);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn testbed_names() {
        assert!(is_testbed_name("incast"));
        assert!(is_testbed_name("t12345"));
        assert!(!is_testbed_name("9abc"));
        assert!(!is_testbed_name("toolongname"));
        assert!(!is_testbed_name("../x"));
        assert!(!is_testbed_name(""));
    }

    fn testbeds(tag: &str) -> Testbeds {
        let dir =
            std::env::temp_dir().join(format!("gradwire-supervise-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Testbeds::new(
            dir,
            FabricProgram {
                program: PathBuf::from("/nonexistent/gradwire"),
                subcommand: vec!["fabric".into(), "run".into()],
            },
        )
    }

    #[test]
    fn records_read_back_and_damaged_ones_name_their_file() {
        let tb = testbeds("records");
        let rec = TestbedRecord {
            name: "abc".into(),
            file: "/x/abc.toml".into(),
            // Never a live process: not running.
            pid: i32::MAX - 1,
            prefix: "gwtabc".into(),
            hosts: vec![HostRecord {
                name: "h0".into(),
                ip: Ipv4Addr::new(198, 18, 1, 1),
                netns: "gwtabc-h0".into(),
            }],
            switches: vec![SwitchRecord {
                name: "s0".into(),
                netns: "gwtabc-s0".into(),
            }],
        };
        tb.write_record(&rec).unwrap();
        assert_eq!(tb.record("abc").unwrap(), Some(rec.clone()));
        assert_eq!(tb.record("nope").unwrap(), None);
        assert_eq!(
            tb.status(),
            vec![TestbedStatus {
                record: rec.clone(),
                running: false
            }]
        );
        assert_eq!(
            rec.namespaces().collect::<Vec<_>>(),
            ["gwtabc-s0", "gwtabc-h0"]
        );
        // The status JSON is the record plus `running`.
        let v = serde_json::to_value(&tb.status()[0]).unwrap();
        assert_eq!(v["running"], false);
        assert_eq!(v["hosts"][0]["ip"], "198.18.1.1");

        std::fs::write(tb.record_path("bad"), r#"{"name": "bad", "pid": "x"}"#).unwrap();
        let e = tb.record("bad").unwrap_err().to_string();
        assert!(e.contains("testbed-bad.json: not a testbed record"), "{e}");
        // A damaged record is not listed (and does not hide the good ones).
        assert_eq!(tb.records().len(), 1);

        // Nothing runs: `fabric stats` without a name says so.
        let e = tb.stats_source(None).unwrap_err().to_string();
        assert!(e.starts_with("no testbed is running"), "{e}");
        let e = tb.stats_source(Some("abc")).unwrap_err().to_string();
        assert!(e.contains("no fabric stats for testbed \"abc\""), "{e}");
        let _ = std::fs::remove_dir_all(tb.dir());
    }

    #[test]
    fn a_left_over_record_blocks_up_and_down_cleans_it_up() {
        if !gradwire_netns::require_root("a_left_over_record_blocks_up_and_down_cleans_it_up") {
            return;
        }
        let tb = testbeds("leftover");
        let name = format!("l{:05}", std::process::id() % 100_000);
        // A fabric that died (its pid never lives), namespaces that do not exist.
        let rec = TestbedRecord {
            name: name.clone(),
            file: "/nonexistent/leftover.toml".into(),
            pid: i32::MAX - 1,
            prefix: testbed_prefix(&name),
            hosts: vec![],
            switches: vec![SwitchRecord {
                name: "s0".into(),
                netns: format!("{}-s0", testbed_prefix(&name)),
            }],
        };
        tb.write_record(&rec).unwrap();
        std::fs::write(tb.stats_path(&name), "{}").unwrap();

        let file = tb.dir().join("leftover.toml");
        std::fs::write(
            &file,
            format!(
                "name = \"{name}\"\n[[switch]]\nname = \"s0\"\n\
                 [[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n"
            ),
        )
        .unwrap();
        let topo = load_topology(&file).unwrap();
        let opts = LaunchOptions {
            xdp_mode: AttachMode::Generic,
            seed: 1,
        };
        let e = tb.up(&topo, &file, opts).unwrap_err();
        assert!(matches!(e, SuperviseError::LeftOver { .. }), "{e}");
        assert!(e.to_string().contains("is left over"), "{e}");
        // Refused before anything was built.
        assert!(!netns_path(&rec.switches[0].netns).exists());

        let report = tb.down(DownTarget::parse(&name).unwrap()).unwrap();
        assert!(report.was_up);
        assert!(report.ignored_record.is_none());
        assert_eq!(
            report.fabric.as_ref().map(|f| &f.outcome),
            Some(&StopOutcome::NotRunning)
        );
        assert_eq!(report.removed, 0);
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        report.result().unwrap();
        assert!(!tb.record_path(&name).exists());
        assert!(!tb.stats_path(&name).exists());
        // Idempotent: nothing is up any more.
        let report = tb.down(DownTarget::parse(&name).unwrap()).unwrap();
        assert!(!report.was_up);
        let _ = std::fs::remove_dir_all(tb.dir());
    }

    /// Kills and reaps the child when dropped, so that a failing test leaves nothing running.
    struct KillOnDrop(Child);

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_process_is_the_fabric_only_with_its_program_subcommand_and_prefix() {
        // A shell waiting on its stdin (`read` is a builtin: the shell stays the process), its
        // command line `sh -c 'read x' fabric run --prefix <prefix>`, the prefix unique to this
        // test process.
        let prefix = format!("gwtzz{}", std::process::id());
        let child = Command::new("sh")
            .args(["-c", "read x", "fabric", "run", "--prefix", &prefix])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let child = KillOnDrop(child);
        let pid = i32::try_from(child.0.id()).unwrap();
        let sh = FabricProgram {
            program: PathBuf::from("/bin/sh"),
            subcommand: vec!["fabric".into(), "run".into()],
        };
        assert!(pid_running(pid));
        // `spawn` returns once exec has begun, a moment before the kernel shows the new command
        // line: wait for it (bounded).
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.is_empty()) {
            assert!(Instant::now() < deadline, "no command line for pid {pid}");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(sh.is_running_as(pid, &prefix));
        assert_eq!(sh.find(&prefix), [pid]);
        // Another prefix, another program or another subcommand: not this fabric.
        assert!(!sh.is_running_as(pid, "gwtzz"));
        let other = FabricProgram {
            program: PathBuf::from("/usr/bin/gradwire"),
            ..sh.clone()
        };
        assert!(!other.is_running_as(pid, &prefix));
        let other = FabricProgram {
            subcommand: vec!["fabric".into(), "stats".into()],
            ..sh.clone()
        };
        assert!(!other.is_running_as(pid, &prefix));
        // This test process is no fabric; a pid that never lives is not running.
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(!sh.is_running_as(me, &prefix));
        assert!(!pid_running(i32::MAX - 1));
        drop(child);
        assert!(!pid_running(pid));
        assert!(sh.find(&prefix).is_empty());
    }
}
