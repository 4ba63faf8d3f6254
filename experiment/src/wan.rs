//! NetStorm on the emulated WAN (../shared/papers/netstorm.txt §IX; issue 15): every strategy
//! of [`gradwire_wan`] synchronizes a synthetic model over the sites of a WAN topology, on a
//! static and on a dynamic network, one process per site. This module is the experiment
//! only; what runs at each site is [`gradwire_wan::site`] (`gradwire wan node`), on the
//! synthetic [`gradwire_wan::workload`], over the topology's sites and the scheduler's
//! overlay ([`gradwire_wan::overlay`]).
//!
//! **The experiment** ([`run_wan`], `gradwire experiment wan`): for each network and
//! strategy, a fresh set of namespaces and a fresh fabric ([`run_strategy`]); one `gradwire wan
//! node` process per site in its host's namespace (`ip netns exec`), rank 0 serving the
//! scheduler; their JSON reports collected; the fabric stopped and the namespaces removed on
//! every path (errors, the deadline, Ctrl-C through [`WanConfig::stop`]). The *dynamic*
//! network is the topology file as written (its links' rate schedules run from the fabric's
//! start); the *static* one has every rate fixed at its value at the start
//! ([`network_topology`], the one place the two differ). Each run lasts
//! [`WanConfig::duration`] (40 s from the fabric's start by default: wan9's first two rates,
//! the same for every strategy; `None` means the schedule's span, [`schedule_span`]) or
//! `iterations` rounds, whichever comes first.
//!
//! **Figures.** A round's synchronization time is the slowest node's (`NodeReport::sync_ms`,
//! from its PUSH to its last result chunk); a run's `sync_ms_mean` is their mean. A run is
//! valid when the fabric kept its clock ([`FabricHealth`]), every node reported with every
//! round verified, and nothing failed; only valid runs count. Each strategy runs
//! [`WanConfig::repeats`] times per network; its figures ([`WanFigure`]) are the min, median
//! and max over its valid runs, and its `speedup_vs_star` star's median over its own. The
//! targets compare medians; a target whose strategy has no valid run is not judged, and the
//! report lists every run left out and why ([`Targets::excluded`]).
//!
//! **Valid by construction.** The fabric forwards on one core. Each node's senders run at its
//! site's fastest WAN link ([`site_rate_cap`]) rather than the 100 Mbit/s of its host link,
//! so frames that could never cross the WAN are not offered to be forwarded and dropped;
//! [`frame_budget`] bounds the frames per second a run may need from the link rates, and the
//! experiment refuses settings above [`FRAME_BUDGET_FPS`]. Each run's measured frame rate
//! (mean and peak, from the fabric's counters) is in its report, and a run whose fabric still
//! fell behind is run again, up to [`WanConfig::max_attempts`] times, each attempt recorded.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use gradwire::rate::RateMode;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig, FabricHandle};
use gradwire_fabric::topology::{ScheduledLink, Topology};
use gradwire_launch::{Ended, RankCommand, Ranks, Supervision};
use gradwire_netstorm::config::NetStormConfig;
use gradwire_wan::overlay::{overlay_from_topology, site_links, SiteLink};
use gradwire_wan::scheduler::Strategy;
use gradwire_wan::site::{unix_ms, NodeFailure, NodeOutput, DEFAULT_MASTER_PORT, ROUND_MARK};
use gradwire_wan::workload::Workload;
use serde::Serialize;

use crate::mlnet::{FabricHealth, FrameMeter};
use crate::ExperimentError;

/// The experiment's topology (9 sites).
pub const WAN9: &str = "testbeds/wan9.toml";
/// The short topology for CI (4 sites, short delays).
pub const WAN4: &str = "testbeds/wan4.toml";
/// The paper's model.
pub const ALEXNET: &str = "control/models/alexnet.toml";
/// Lines of a node's stderr kept in the report.
const STDERR_TAIL: usize = 20;
/// The network a run emulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Network {
    /// Every link at its starting rate for good.
    Static,
    /// The links' rate schedules as the topology file writes them.
    Dynamic,
}

impl Network {
    /// Both, in report order.
    pub const ALL: [Network; 2] = [Network::Static, Network::Dynamic];

    /// Name in files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Network::Static => "static",
            Network::Dynamic => "dynamic",
        }
    }
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Network {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Network::ALL
            .into_iter()
            .find(|n| n.name() == s.trim())
            .ok_or_else(|| format!("unknown network {s:?} (static or dynamic)"))
    }
}

/// The topology the fabric runs for `network`: the only place static and dynamic differ.
pub fn network_topology(topo: &Topology, network: Network) -> Topology {
    match network {
        Network::Static => topo.clone().without_schedules(),
        Network::Dynamic => topo.clone(),
    }
}

/// The longest schedule period of `topo`'s links (else the last step's time), seconds;
/// `None` without schedules.
pub fn schedule_span(topo: &Topology) -> Option<f64> {
    let links: Vec<ScheduledLink> = topo.scheduled_links();
    links
        .iter()
        .map(|l| {
            l.schedule
                .period_ns()
                .unwrap_or_else(|| l.schedule.steps().last().map_or(0, |s| s.at_ns))
                as f64
                / 1e9
        })
        .reduce(f64::max)
}

// ---------------------------------------------------------------------------------------
// What the fabric must forward
// ---------------------------------------------------------------------------------------

/// Bits of a full-size frame on the wire (1500-byte IP packet, Ethernet header, FCS,
/// preamble and gap): the unit of the frame budget.
pub const FRAME_BITS: f64 = 1538.0 * 8.0;

/// The most frames per second a run may need by [`frame_budget`]: 60 % of what the fabric
/// forwards on one core at best (185 k frames/s in its benchmark's big batches). The budget
/// is a pessimistic bound (every node sending to every other at once and every WAN link full
/// both ways); each run's measured peak is in its [`FabricHealth`].
pub const FRAME_BUDGET_FPS: f64 = 110_000.0;

/// The fastest rate site `rank`'s WAN links ever run at (over their schedules), bit/s; its
/// host link's rate when it has none. A node's senders are held to it: a flow cannot leave
/// the site faster, and offering the 100 Mbit/s of the host link to 2-15 Mbit/s WAN links
/// only makes the fabric forward and drop frames that never get through (the runs that fell
/// behind).
pub fn site_rate_cap(topo: &Topology, links: &[SiteLink], rank: usize) -> u64 {
    let h = &topo.hosts[rank];
    let host = topo.switches[h.switch].ports[h.port].link.rate_bps;
    links
        .iter()
        .filter(|l| l.a == rank || l.b == rank)
        .map(|l| {
            l.schedule
                .iter()
                .flat_map(|s| s.steps.iter().map(|st| st.1))
                .fold(l.rate_bps, u64::max)
        })
        .max()
        .map_or(host, |wan| wan.min(host))
}

/// An upper bound of the data frames per second the fabric forwards in a run, from link
/// rates: every frame a host sends is forwarded at its site's switch, and every frame that
/// crosses a WAN link once more at the far switch (a star's frames to non-neighbours cross a
/// few; their WAN hops are still bounded by the links' rates).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FrameBudget {
    /// Frames/s entering from the hosts: each node's senders at their rate, one flow to every
    /// other node at once, at most its host link.
    pub from_hosts_fps: f64,
    /// Frames/s over the WAN links, every link full both ways at its fastest rate.
    pub over_wan_fps: f64,
    /// The sum: what the fabric forwards at most (control frames are a few per chunk).
    pub total_fps: f64,
    /// [`FRAME_BUDGET_FPS`].
    pub limit_fps: f64,
}

/// The [`FrameBudget`] of `topo` when node `r` sends at `rate_of(r)` per flow.
pub fn frame_budget(
    topo: &Topology,
    links: &[SiteLink],
    rate_of: impl Fn(usize) -> u64,
) -> FrameBudget {
    let world = topo.hosts.len();
    let from_hosts: f64 = (0..world)
        .map(|r| {
            let h = &topo.hosts[r];
            let host = topo.switches[h.switch].ports[h.port].link.rate_bps as f64;
            (rate_of(r) as f64 * world.saturating_sub(1) as f64).min(host)
        })
        .sum::<f64>()
        / FRAME_BITS;
    let over_wan: f64 = links
        .iter()
        .map(|l| {
            let fastest = l
                .schedule
                .iter()
                .flat_map(|s| s.steps.iter().map(|st| st.1))
                .fold(l.rate_bps, u64::max);
            2.0 * fastest as f64
        })
        .sum::<f64>()
        / FRAME_BITS;
    FrameBudget {
        from_hosts_fps: from_hosts,
        over_wan_fps: over_wan,
        total_fps: from_hosts + over_wan,
        limit_fps: FRAME_BUDGET_FPS,
    }
}

// ---------------------------------------------------------------------------------------
// The experiment
// ---------------------------------------------------------------------------------------

/// Kill one node's process after it finished some rounds (the experiment's own tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeFault {
    /// The node.
    pub rank: usize,
    /// Rounds it finishes first.
    pub after_rounds: u32,
}

/// `gradwire experiment wan`.
#[derive(Debug, Clone)]
pub struct WanConfig {
    /// The `gradwire` executable (its `wan node` subcommand runs each site).
    pub exe: PathBuf,
    /// WAN topology.
    pub topology: PathBuf,
    /// Model layer file.
    pub model: PathBuf,
    /// Model scale.
    pub scale: f64,
    /// Most rounds per run.
    pub iterations: u32,
    /// Length of each run (`None`: the schedule's span, see [`schedule_span`]; without
    /// schedules, `iterations` rounds).
    pub duration: Option<Duration>,
    /// Strategies, in order (star first for the speed-ups).
    pub strategies: Vec<Strategy>,
    /// Networks, in order.
    pub networks: Vec<Network>,
    /// NetStorm's options (the strategy switches awareness and auxiliary paths).
    pub netstorm: NetStormConfig,
    /// Each node's longest wait for the set-up, a round and the final barrier.
    pub timeout: Duration,
    /// Senders' line rate, bit/s (`None`: the host link's rate).
    pub rate_bps: Option<u64>,
    /// Senders' rate control.
    pub rate_mode: RateMode,
    /// Its period, ns (2 ms: the emulated links' round trips are milliseconds, not the
    /// 200 us of gradwire's default for 100G).
    pub period_ns: u64,
    /// Job id.
    pub job: u32,
    /// Set (Ctrl-C) to stop every node and tear down.
    pub stop: Arc<AtomicBool>,
    /// Kill a node mid-run (tests).
    pub fault: Option<NodeFault>,
    /// Runs of every strategy on every network: the figures are their spread.
    pub repeats: u32,
    /// Attempts at one run whose fabric fell behind its clock before it counts as not valid
    /// (each attempt is recorded).
    pub max_attempts: u32,
}

impl WanConfig {
    /// Defaults with files under the repository root `root`: wan9, AlexNet at 1 % (611 k
    /// elements, 2.4 MB), every strategy on both networks, twice each (a run whose fabric fell
    /// behind up to 3 attempts), at most 200 rounds in 40 s from each fabric's start (the
    /// schedule's first two rates; a round that starts within it is finished), chunks of
    /// 50 000 elements (13 per round) and probes above 100 kB, a 120 s timeout, grant rate
    /// control with a 2 ms period, senders at their site's fastest WAN link
    /// ([`site_rate_cap`]). 28 runs of about 50 s: about 25 minutes.
    ///
    /// Why not the paper's sizes: wan9's rates are the paper's divided by 10, so AlexNet at
    /// full size would take minutes per round. Why not smaller chunks: each chunk costs its
    /// link about four round trips of handshakes (a meta flow and a data flow, each with
    /// FlowStart/FlowAccept and FlowStop/FlowFinish), about 0.2 s on wan9's 30 ms links,
    /// measured as the slope of the round time over the chunk count; 50 000 elements
    /// (200 kB, 0.2 s at 8 Mbit/s) keep that cost at about half a chunk's transfer while
    /// giving the nine roots a chunk each.
    pub fn new(root: &Path, exe: PathBuf) -> WanConfig {
        WanConfig {
            exe,
            topology: root.join(WAN9),
            model: root.join(ALEXNET),
            scale: 0.01,
            iterations: 200,
            duration: Some(Duration::from_secs(40)),
            strategies: Strategy::ALL.to_vec(),
            networks: Network::ALL.to_vec(),
            netstorm: NetStormConfig {
                chunk_size: 50_000,
                probe_chunk_size: 100_000,
                ..NetStormConfig::default()
            },
            timeout: Duration::from_secs(120),
            rate_bps: None,
            rate_mode: RateMode::Grant,
            period_ns: 2_000_000,
            job: 15,
            stop: Arc::new(AtomicBool::new(false)),
            fault: None,
            repeats: 2,
            max_attempts: 3,
        }
    }
}

/// One node process of a run.
#[derive(Debug, Clone, Serialize)]
pub struct NodeRun {
    /// The node.
    pub rank: usize,
    /// Its report, when it succeeded.
    pub output: Option<NodeOutput>,
    /// Why it failed (its last error line, or how it ended).
    pub error: Option<String>,
    /// Its failure report, when it failed and wrote one (`gradwire wan node --json`).
    pub failure: Option<NodeFailure>,
    /// Seconds from the start of the processes to its end.
    pub ended_s: f64,
    /// The last lines it wrote to stderr besides its per-round lines (warnings, the error).
    pub stderr_tail: Vec<String>,
}

/// One run (a strategy on a network) on a fresh fabric.
#[derive(Debug, Clone, Serialize)]
pub struct RunOutcome {
    /// Every node.
    pub nodes: Vec<NodeRun>,
    /// How the fabric kept up.
    pub fabric: FabricHealth,
    /// Seconds from the fabric's start to the nodes' start.
    pub nodes_started_s: f64,
    /// When the fabric started, ms since the Unix epoch.
    pub fabric_start_unix_ms: f64,
    /// Why the run as a whole failed (set-up, deadline, interrupt).
    pub error: Option<String>,
}

impl RunOutcome {
    /// The error of the node that failed first (usually the cause; the others follow),
    /// else the run's.
    pub fn first_error(&self) -> Option<String> {
        let mut failed: Vec<&NodeRun> = self.nodes.iter().filter(|n| n.error.is_some()).collect();
        failed.sort_by(|a, b| a.ended_s.total_cmp(&b.ended_s));
        failed
            .into_iter()
            .find_map(|n| {
                n.error.as_ref().map(|e| {
                    // Most errors name their node already.
                    if e.starts_with(&format!("node {}", n.rank)) {
                        e.clone()
                    } else {
                        format!("node {}: {e}", n.rank)
                    }
                })
            })
            .or_else(|| self.error.clone())
    }
}

/// Processes, fabric and namespaces of a run; dropping it kills, stops and removes all.
struct Testbed {
    net: Option<FabricNet>,
    fabric: Option<FabricHandle>,
    ranks: Ranks,
    meter: FrameMeter,
}

impl Testbed {
    /// Stop everything; the fabric's health and the teardown's error.
    fn down(mut self) -> (FabricHealth, Option<String>) {
        self.ranks.kill_running();
        let stats = self.fabric.take().and_then(|f| {
            let _ = f.wait_idle(Duration::from_secs(5));
            f.stop()
        });
        let health = FabricHealth::of(stats.as_ref(), &self.meter);
        let err = self
            .net
            .take()
            .and_then(|n| n.down().err())
            .map(|e| format!("removing the testbed: {e}"));
        (health, err)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.ranks.kill_running();
        if let Some(f) = self.fabric.take() {
            let _ = f.stop();
        }
        if let Some(n) = self.net.take() {
            let _ = n.down();
        }
    }
}

/// The `wan node` arguments of rank `rank`.
fn node_args(
    cfg: &WanConfig,
    topo_path: &Path,
    model: &Path,
    topo: &Topology,
    strategy: Strategy,
    rank: usize,
    duration: Option<Duration>,
) -> Vec<String> {
    let h = &topo.hosts[rank];
    let master = SocketAddr::new(IpAddr::V4(topo.hosts[0].ip), DEFAULT_MASTER_PORT);
    let rate = cfg.rate_bps.unwrap_or_else(|| {
        site_links(topo).map_or(topo.switches[h.switch].ports[h.port].link.rate_bps, |l| {
            site_rate_cap(topo, &l, rank)
        })
    });
    let ns = &cfg.netstorm;
    let mut v: Vec<String> = vec![
        "wan".into(),
        "node".into(),
        "--rank".into(),
        rank.to_string(),
        "--world".into(),
        topo.hosts.len().to_string(),
        "--host".into(),
        h.ip.to_string(),
        "--master".into(),
        master.to_string(),
        "--job".into(),
        cfg.job.to_string(),
        "--strategy".into(),
        strategy.name().into(),
        "--topology".into(),
        topo_path.display().to_string(),
        "--model".into(),
        model.display().to_string(),
        "--scale".into(),
        cfg.scale.to_string(),
        "--iterations".into(),
        cfg.iterations.to_string(),
        "--timeout".into(),
        cfg.timeout.as_secs_f64().to_string(),
        "--rate".into(),
        format!("{rate}bit"),
        "--rate-mode".into(),
        cfg.rate_mode.name().into(),
        "--period-us".into(),
        (cfg.period_ns / 1000).to_string(),
        "--chunk-size".into(),
        ns.chunk_size.to_string(),
        "--probe-chunk-size".into(),
        ns.probe_chunk_size.to_string(),
        "--probe-chunk-num".into(),
        ns.probe_chunk_num.to_string(),
        "--primary-busy-bound".into(),
        ns.primary_busy_bound.to_string(),
        "--aux-queue-length".into(),
        ns.auxiliary_queue_length.to_string(),
        "--update-time".into(),
        ns.update_time.as_secs_f64().to_string(),
        "--json".into(),
    ];
    if let Some(k) = ns.num_roots {
        v.push("--roots".into());
        v.push(k.to_string());
    }
    if let Some(d) = duration {
        v.push("--duration".into());
        v.push(d.as_secs_f64().to_string());
    }
    if rank == 0 {
        v.push("--serve-scheduler".into());
    } else {
        v.push("--scheduler".into());
        v.push(SocketAddr::new(master.ip(), master.port() + 1).to_string());
    }
    v
}

fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned())
}

/// The last line of a failed node's stderr that says what went wrong.
fn error_line(stderr: &str) -> Option<String> {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    lines
        .iter()
        .rev()
        .find(|l| l.contains("error:"))
        .or(lines.last())
        .map(|l| l.trim().trim_start_matches("gradwire: error: ").to_owned())
}

/// Run `strategy` once on a fresh fabric of `topo` (already the network's variant, see
/// [`network_topology`]); `topo_path` is the file the scheduler reads (the rates at the
/// start are the same in both variants). Never leaves a process, a fabric or a namespace
/// behind.
pub fn run_strategy(
    cfg: &WanConfig,
    topo: &Topology,
    topo_path: &Path,
    strategy: Strategy,
    duration: Option<Duration>,
) -> RunOutcome {
    let world = topo.hosts.len();
    let failed = |e: String| RunOutcome {
        nodes: Vec::new(),
        fabric: FabricHealth::unknown(),
        nodes_started_s: 0.0,
        fabric_start_unix_ms: 0.0,
        error: Some(e),
    };
    let net = match FabricNet::up(topo) {
        Ok(n) => n,
        Err(e) => return failed(format!("building the testbed: {e}")),
    };
    let mut bed = Testbed {
        net: None,
        fabric: None,
        ranks: Ranks::new(),
        meter: FrameMeter::default(),
    };
    match spawn(topo, net.switch_namespaces(), FabricConfig::default()) {
        Ok(f) => bed.fabric = Some(f),
        Err(e) => {
            let _ = net.down();
            return failed(format!("starting the fabric: {e}"));
        }
    }
    let fabric_start = SystemTime::now();
    let fabric_t0 = Instant::now();
    let host_ns: Vec<String> = (0..world)
        .filter_map(|i| net.host_ns(i).map(str::to_owned))
        .collect();
    bed.net = Some(net);
    // `node R: round K/N ...` on a node's stderr: node R finished K rounds.
    let (tx, rx) = mpsc::channel::<(usize, u32)>();
    let topo_path = absolute(topo_path);
    let model = absolute(&cfg.model);
    // The nodes' clock (their end times, the deadline) starts now, not at the fabric's.
    bed.ranks = Ranks::new();
    let nodes_started_s = fabric_t0.elapsed().as_secs_f64();
    let mut setup_error = None;
    for (rank, ns) in host_ns.iter().enumerate() {
        let cmd = RankCommand {
            netns: Some(ns.clone()),
            program: cfg.exe.clone(),
            args: node_args(cfg, &topo_path, &model, topo, strategy, rank, duration),
            ..RankCommand::default()
        };
        let tx = tx.clone();
        let mark = format!("node {rank}{ROUND_MARK}");
        let started = bed.ranks.start(&cmd, move |line| {
            let Some(rest) = line.strip_prefix(&mark) else {
                return false;
            };
            let k = rest
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok());
            if let Some(k) = k {
                let _ = tx.send((rank, k));
            }
            true
        });
        if let Err(e) = started {
            setup_error = Some(format!(
                "starting node {rank} ({} in {ns}): {e}",
                cfg.exe.display()
            ));
            break;
        }
    }
    drop(tx);
    // Nodes bound each wait themselves; this only catches what they cannot.
    let deadline =
        cfg.timeout * 3 + duration.unwrap_or_else(|| cfg.timeout * cfg.iterations.min(1000));
    let mut run_error = setup_error;
    if run_error.is_none() {
        let mut faulted = false;
        let mut sampled = Instant::now();
        let (fabric, meter) = (&bed.fabric, &mut bed.meter);
        let how = Supervision {
            deadline,
            stop: &cfg.stop,
            end_on_failure: false,
        };
        let ended = bed.ranks.supervise(&how, |ranks| {
            // The fabric publishes every 200 ms; its frame counters give the run's frame
            // rate.
            if sampled.elapsed() >= Duration::from_millis(200) {
                sampled = Instant::now();
                if let Some(st) = fabric.as_ref().and_then(FabricHandle::stats) {
                    meter.sample(&st);
                }
            }
            while let Ok((rank, k)) = rx.try_recv() {
                if let Some(f) = cfg.fault.filter(|f| f.rank == rank && k >= f.after_rounds) {
                    if !faulted {
                        ranks.kill(f.rank);
                        faulted = true;
                    }
                }
            }
        });
        run_error = match ended {
            Ended::AllExited | Ended::Failed(_) => None,
            Ended::Interrupted => Some("interrupted".into()),
            Ended::Deadline { running } => Some(format!(
                "the run did not end within {deadline:?}: node(s) {running:?} still running; \
                 stopped them"
            )),
        };
    }
    let now_s = bed.ranks.elapsed().as_secs_f64();
    let outputs = std::mem::take(&mut bed.ranks).finish();
    let (fabric, down_error) = bed.down();
    let mut nodes = Vec::new();
    for o in outputs {
        let rank = o.rank;
        let (st, ended_s) = match o.ended {
            Some((s, t)) => (Some(s), t.as_secs_f64()),
            None => (None, now_s),
        };
        let (stdout, stderr) = (o.stdout, o.stderr);
        let tail: Vec<String> = {
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            lines[lines.len().saturating_sub(STDERR_TAIL)..]
                .iter()
                .map(|l| (*l).to_owned())
                .collect()
        };
        let run = match st {
            Some(s) if s.success() => match serde_json::from_str::<NodeOutput>(&stdout) {
                Ok(out) => NodeRun {
                    rank,
                    output: Some(out),
                    error: None,
                    failure: None,
                    ended_s,
                    stderr_tail: tail,
                },
                Err(e) => NodeRun {
                    rank,
                    output: None,
                    error: Some(format!("exited 0 but its report is not valid JSON: {e}")),
                    failure: None,
                    ended_s,
                    stderr_tail: tail,
                },
            },
            Some(s) => NodeRun {
                rank,
                output: None,
                error: Some(error_line(&stderr).unwrap_or_else(|| format!("ended: {s}"))),
                failure: serde_json::from_str(&stdout).ok(),
                ended_s,
                stderr_tail: tail,
            },
            None => NodeRun {
                rank,
                output: None,
                error: Some("stopped by the experiment".into()),
                failure: None,
                ended_s,
                stderr_tail: tail,
            },
        };
        nodes.push(run);
    }
    RunOutcome {
        nodes,
        fabric,
        nodes_started_s,
        fabric_start_unix_ms: unix_ms(fabric_start),
        error: run_error.or(down_error),
    }
}

/// One run in the report.
#[derive(Debug, Clone, Serialize)]
pub struct WanResult {
    /// Strategy name.
    pub strategy: String,
    /// `static` or `dynamic`.
    pub network: String,
    /// Mean over rounds of the slowest node's synchronization time, ms.
    pub sync_ms_mean: f64,
    /// Its median.
    pub sync_ms_median: f64,
    /// Star's median (over its valid runs) over this one's mean, on the same network; NaN
    /// unless this run is valid.
    pub speedup_vs_star: f64,
    /// A result: the fabric kept its clock, every node finished verified, no error, at least
    /// one round.
    pub valid: bool,
    /// Every node's every element was the exact average.
    pub verified: bool,
    /// Rounds.
    pub rounds: u32,
    /// Per round: the slowest node's synchronization time, ms.
    pub sync_ms: Vec<f64>,
    /// Per round: when rank 0 started it, seconds since the fabric's start.
    pub round_start_s: Vec<f64>,
    /// Mean time from one round's start to the next at rank 0 (everything a round costs:
    /// topology request, synchronization, checks), ms.
    pub round_ms_mean: f64,
    /// Policies the scheduler formulated (the first included).
    pub policies: usize,
    /// Policy versions the nodes ran.
    pub versions_used: Vec<u32>,
    /// Chunks sent on auxiliary paths, all nodes.
    pub aux_chunks: usize,
    /// Chunk hops relayed on auxiliary paths, all nodes.
    pub relayed: usize,
    /// Link reports the nodes sent.
    pub link_reports: usize,
    /// How the fabric kept up.
    pub fabric: FabricHealth,
    /// Why it failed.
    pub error: Option<String>,
    /// Which of the repeated runs of this strategy on this network (0 first).
    pub repeat: u32,
    /// Every attempt at this run, the last one is this result: an attempt whose fabric fell
    /// behind its clock is run again (up to [`WanConfig::max_attempts`]).
    pub attempts: Vec<Attempt>,
    /// Every node's outcome.
    pub nodes: Vec<NodeRun>,
}

/// One attempt at a run.
#[derive(Debug, Clone, Serialize)]
pub struct Attempt {
    /// It counts as a result.
    pub valid: bool,
    /// Why not, if not.
    pub excluded_because: Option<String>,
    /// How the fabric kept up.
    pub fabric: FabricHealth,
    /// Rounds every node finished.
    pub rounds: u32,
}

impl WanResult {
    /// Why this run is no result (`None`: it is valid): its error, the fabric falling behind,
    /// a node without a verified report, no round.
    pub fn exclusion(&self) -> Option<String> {
        if let Some(e) = &self.error {
            return Some(format!("failed: {e}"));
        }
        if !self.fabric.valid {
            return Some(format!(
                "the fabric fell behind its clock ({} of {} departures late, peak {:.0} \
                 frames/s)",
                self.fabric.late, self.fabric.departures, self.fabric.frames_per_s_peak
            ));
        }
        if !self.verified {
            return Some("not every node reported a verified result".into());
        }
        if self.rounds == 0 || !self.sync_ms_mean.is_finite() {
            return Some("no round finished".into());
        }
        None
    }

    fn attempt(&self) -> Attempt {
        Attempt {
            valid: self.valid,
            excluded_because: self.exclusion(),
            fabric: self.fabric,
            rounds: self.rounds,
        }
    }
}

/// Lowest, median and highest of a figure over the valid repeated runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Lowest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Highest.
    pub max: f64,
}

impl Spread {
    /// Of the finite values of `v` (NaN throughout when there is none).
    pub fn of(v: &[f64]) -> Spread {
        Spread {
            min: crate::mlnet::quantile(v, 0.0),
            median: crate::mlnet::quantile(v, 0.5),
            max: crate::mlnet::quantile(v, 1.0),
        }
    }
}

/// One strategy on one network over its repeated runs.
#[derive(Debug, Clone, Serialize)]
pub struct WanFigure {
    /// Strategy name.
    pub strategy: String,
    /// `static` or `dynamic`.
    pub network: String,
    /// Runs (repeats).
    pub runs: usize,
    /// Of those, valid: the sample of the figures.
    pub valid_runs: usize,
    /// Mean synchronization time of each valid run, ms: spread.
    pub sync_ms: Spread,
    /// Star's median over each valid run's mean, on the same network: spread.
    pub speedup_vs_star: Spread,
    /// Peak frame rate of the fabric, frames/s, over the valid runs: spread.
    pub frames_per_s_peak: Spread,
}

/// A run left out of the figures and the targets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Exclusion {
    /// Strategy name.
    pub strategy: String,
    /// Network.
    pub network: String,
    /// Which repeat.
    pub repeat: u32,
    /// Why.
    pub reason: String,
}

/// One target of the issue, judged on the medians of valid runs only.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// Met (`None`: no valid run of a strategy it needs).
    pub met: Option<bool>,
    /// What it asks.
    pub goal: String,
    /// The figures it was judged on.
    pub figures: BTreeMap<String, f64>,
}

/// The targets.
#[derive(Debug, Clone, Serialize)]
pub struct Targets {
    /// mr-fapt+aware+aux at least 5x star's synchronization speed on the dynamic network.
    pub netstorm_5x_star_dynamic: Target,
    /// Each added mechanism helps on the dynamic network: fapt -> mr-fapt -> mr-fapt+aware ->
    /// mr-fapt+aware+aux, each faster than the one before.
    pub each_mechanism_helps: Target,
    /// The same chain on the static network (awareness can only help where rates change).
    pub each_mechanism_helps_static: Target,
    /// FAPT beats BKT and MST on every network run.
    pub fapt_beats_bkt_and_mst: Target,
    /// Every run was valid (the fabric kept its clock) and verified.
    pub all_runs_valid: bool,
    /// The runs no figure or target uses, and why.
    pub excluded: Vec<Exclusion>,
}

/// The experiment's report.
#[derive(Debug, Clone, Serialize)]
pub struct WanReport {
    /// Topology name.
    pub topology: String,
    /// Sites (nodes).
    pub sites: usize,
    /// The inter-site links and their schedules.
    pub links: Vec<SiteLink>,
    /// The synthetic model.
    pub workload: Workload,
    /// Most rounds per run.
    pub iterations: u32,
    /// Length of each run, seconds (`None`: `iterations` rounds).
    pub duration_s: Option<f64>,
    /// NetStorm's options (before the strategy switches awareness and auxiliary paths).
    pub netstorm: NetStormConfig,
    /// The senders' rate control: `grant`, `ecn` or `fig7`.
    pub rate_mode: String,
    /// The rate-control period, ns.
    pub period_ns: u64,
    /// Each node's timeout, seconds.
    pub timeout_s: f64,
    /// Runs of each strategy on each network.
    pub repeats: u32,
    /// Most attempts at a run whose fabric fell behind.
    pub max_attempts: u32,
    /// Each node's senders' rate per flow, bit/s (its site's fastest WAN link unless given).
    pub sender_rate_bps: Vec<u64>,
    /// What the fabric may have to forward at these rates.
    pub frame_budget: FrameBudget,
    /// Every run.
    pub results: Vec<WanResult>,
    /// Per strategy and network, the spread over the valid runs.
    pub figures: Vec<WanFigure>,
    /// The targets.
    pub targets: Targets,
}

fn mean(v: &[f64]) -> f64 {
    let v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Summarize one run.
pub fn summarize(strategy: Strategy, network: Network, o: RunOutcome) -> WanResult {
    let outs: Vec<&NodeOutput> = o.nodes.iter().filter_map(|n| n.output.as_ref()).collect();
    let complete = !o.nodes.is_empty() && outs.len() == o.nodes.len() && o.error.is_none();
    let rounds = outs.iter().map(|n| n.rounds).min().unwrap_or(0);
    let sync_ms: Vec<f64> = (0..rounds as usize)
        .map(|k| {
            outs.iter()
                .filter_map(|n| n.sync_ms.get(k).copied())
                .fold(f64::NAN, f64::max)
        })
        .collect();
    let rank0 = outs.iter().find(|n| n.rank == 0);
    let round_start_s: Vec<f64> = rank0.map_or_else(Vec::new, |n| {
        n.round_start_unix_ms
            .iter()
            .map(|t| (t - o.fabric_start_unix_ms) / 1e3)
            .collect()
    });
    let round_ms: Vec<f64> = round_start_s
        .windows(2)
        .map(|w| (w[1] - w[0]) * 1e3)
        .collect();
    let mut versions_used: Vec<u32> = outs.iter().flat_map(|n| n.versions.clone()).collect();
    versions_used.sort_unstable();
    versions_used.dedup();
    let verified = complete && outs.iter().all(|n| n.verified);
    WanResult {
        strategy: strategy.name().to_owned(),
        network: network.name().to_owned(),
        sync_ms_mean: if complete { mean(&sync_ms) } else { f64::NAN },
        sync_ms_median: if complete {
            crate::mlnet::quantile(&sync_ms, 0.5)
        } else {
            f64::NAN
        },
        speedup_vs_star: f64::NAN,
        valid: o.fabric.valid && verified && rounds > 0,
        verified,
        rounds,
        sync_ms,
        round_start_s,
        round_ms_mean: mean(&round_ms),
        policies: rank0
            .and_then(|n| n.scheduler.as_ref())
            .map_or(0, |s| s.policies.len()),
        versions_used,
        aux_chunks: outs.iter().map(|n| n.sent_aux).sum(),
        relayed: outs.iter().map(|n| n.relayed).sum(),
        link_reports: outs.iter().map(|n| n.link_reports).sum(),
        fabric: o.fabric,
        error: o.first_error(),
        repeat: 0,
        attempts: Vec::new(),
        nodes: o.nodes,
    }
}

/// Star's median synchronization time over its valid runs on `network` (NaN if none).
fn star_median(results: &[WanResult], network: &str) -> f64 {
    let v: Vec<f64> = results
        .iter()
        .filter(|r| r.strategy == Strategy::Star.name() && r.network == network && r.valid)
        .map(|r| r.sync_ms_mean)
        .collect();
    crate::mlnet::quantile(&v, 0.5)
}

/// Fill in the speed-ups over star, per network: star's median over its valid runs over each
/// valid run's mean (NaN for a run that is not valid).
pub fn speedups(results: &mut [WanResult]) {
    let star: BTreeMap<String, f64> = results
        .iter()
        .map(|r| (r.network.clone(), star_median(results, &r.network)))
        .collect();
    for r in results {
        r.speedup_vs_star = match (r.valid, star.get(&r.network)) {
            (true, Some(s)) => s / r.sync_ms_mean,
            _ => f64::NAN,
        };
    }
}

/// Per strategy and network (in report order), the spread of the valid runs.
pub fn figures(results: &[WanResult]) -> Vec<WanFigure> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in results {
        let k = (r.strategy.clone(), r.network.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(strategy, network)| {
            let runs: Vec<&WanResult> = results
                .iter()
                .filter(|r| r.strategy == strategy && r.network == network)
                .collect();
            let valid: Vec<&&WanResult> = runs.iter().filter(|r| r.valid).collect();
            let star = star_median(results, &network);
            let of = |f: &dyn Fn(&WanResult) -> f64| {
                Spread::of(&valid.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            WanFigure {
                valid_runs: valid.len(),
                runs: runs.len(),
                sync_ms: of(&|r| r.sync_ms_mean),
                speedup_vs_star: of(&|r| star / r.sync_ms_mean),
                frames_per_s_peak: of(&|r| r.fabric.frames_per_s_peak),
                strategy,
                network,
            }
        })
        .collect()
}

/// Every run that is not valid, and why.
pub fn exclusions(results: &[WanResult]) -> Vec<Exclusion> {
    results
        .iter()
        .filter(|r| !r.valid)
        .map(|r| Exclusion {
            strategy: r.strategy.clone(),
            network: r.network.clone(),
            repeat: r.repeat,
            reason: r.exclusion().unwrap_or_else(|| "not valid".into()),
        })
        .collect()
}

/// The median synchronization time of `s` on `n` over its valid runs; `None` without one.
fn find(figures: &[WanFigure], s: Strategy, n: Network) -> Option<f64> {
    figures
        .iter()
        .find(|f| f.strategy == s.name() && f.network == n.name())
        .filter(|f| f.valid_runs > 0)
        .map(|f| f.sync_ms.median)
        .filter(|m| m.is_finite())
}

fn chain(figures: &[WanFigure], n: Network) -> Target {
    let steps = [
        Strategy::Fapt,
        Strategy::MrFapt,
        Strategy::MrFaptAware,
        Strategy::MrFaptAwareAux,
    ];
    let mut out = BTreeMap::new();
    let mut met = Some(true);
    for s in steps {
        match find(figures, s, n) {
            Some(ms) => {
                out.insert(format!("{}_sync_ms", s.name()), ms);
            }
            None => met = None,
        }
    }
    for w in steps.windows(2) {
        if let (Some(a), Some(b)) = (find(figures, w[0], n), find(figures, w[1], n)) {
            let gain = a / b;
            out.insert(format!("{}_over_{}", w[1].name(), w[0].name()), gain);
            if gain <= 1.0 {
                met = met.map(|_| false);
            }
        }
    }
    Target {
        met,
        goal: format!(
            "on the {n} network each added mechanism helps: fapt -> mr-fapt -> mr-fapt+aware \
             -> mr-fapt+aware+aux, each with a lower median (over valid runs) of the mean \
             synchronization time (the paper: awareness about +20 %, auxiliary paths up to \
             +65 %)"
        ),
        figures: out,
    }
}

/// Judge the targets on `results`: only valid runs count (a target whose strategy
/// has none is not judged), each strategy by its median over them; the runs left out are
/// listed.
pub fn targets(results: &[WanResult]) -> Targets {
    let figs = figures(results);
    let pro = find(&figs, Strategy::MrFaptAwareAux, Network::Dynamic);
    let star = find(&figs, Strategy::Star, Network::Dynamic);
    let mut f5 = BTreeMap::new();
    let met5 = match (pro, star) {
        (Some(p), Some(s)) => {
            f5.insert("speedup".into(), s / p);
            f5.insert("mr-fapt+aware+aux_sync_ms".into(), p);
            f5.insert("star_sync_ms".into(), s);
            Some(s / p >= 5.0)
        }
        _ => None,
    };
    let mut fb = BTreeMap::new();
    let mut met_b = None;
    for n in Network::ALL {
        let (Some(f), Some(b), Some(m)) = (
            find(&figs, Strategy::Fapt, n),
            find(&figs, Strategy::Bkt, n),
            find(&figs, Strategy::Mst, n),
        ) else {
            // A network that ran but lacks a valid run of one of the three: not judged.
            if results.iter().any(|r| r.network == n.name()) {
                met_b = None;
                fb.insert(format!("{n}_not_judged"), f64::NAN);
                break;
            }
            continue;
        };
        fb.insert(format!("{n}_fapt_sync_ms"), f);
        fb.insert(format!("{n}_bkt_sync_ms"), b);
        fb.insert(format!("{n}_mst_sync_ms"), m);
        met_b = Some(met_b.unwrap_or(true) && f < b && f < m);
    }
    Targets {
        netstorm_5x_star_dynamic: Target {
            met: met5,
            goal: "mr-fapt+aware+aux at least 5x star's synchronization speed on the dynamic \
                   network, medians over valid runs (the paper: 6.5-9.2x)"
                .into(),
            figures: f5,
        },
        each_mechanism_helps: chain(&figs, Network::Dynamic),
        each_mechanism_helps_static: chain(&figs, Network::Static),
        fapt_beats_bkt_and_mst: Target {
            met: met_b,
            goal: "single-root FAPT synchronizes faster than BKT and MST on every network run \
                   (medians over valid runs)"
                .into(),
            figures: fb,
        },
        all_runs_valid: !results.is_empty() && results.iter().all(|r| r.valid),
        excluded: exclusions(results),
    }
}

/// Run `strategy` on `network` until it is valid or `max_attempts` attempts fell behind: an
/// attempt whose fabric kept its clock (valid, or failed for another reason) is final.
fn run_repeat(
    cfg: &WanConfig,
    variant: &Topology,
    strategy: Strategy,
    network: Network,
    repeat: u32,
    duration: Option<Duration>,
) -> Result<WanResult, ExperimentError> {
    let mut attempts = Vec::new();
    loop {
        if cfg.stop.load(Ordering::Relaxed) {
            return Err(ExperimentError::Other(
                "interrupted: stopped every node and removed the namespaces".into(),
            ));
        }
        eprintln!(
            "wan: {strategy} on the {network} network, run {}/{}, attempt {}...",
            repeat + 1,
            cfg.repeats.max(1),
            attempts.len() + 1
        );
        let o = run_strategy(cfg, variant, &cfg.topology, strategy, duration);
        let mut r = summarize(strategy, network, o);
        attempts.push(r.attempt());
        eprintln!(
            "wan: {strategy} on the {network} network: {} rounds, sync {:.0} ms mean, {} \
             policies, {} aux chunks, peak {:.0} frames/s, valid {}{}",
            r.rounds,
            r.sync_ms_mean,
            r.policies,
            r.aux_chunks,
            r.fabric.frames_per_s_peak,
            r.valid,
            r.exclusion().map(|e| format!(" ({e})")).unwrap_or_default()
        );
        if cfg.stop.load(Ordering::Relaxed) {
            return Err(ExperimentError::Other(
                "interrupted: stopped every node and removed the namespaces".into(),
            ));
        }
        if r.valid || r.fabric.valid || attempts.len() >= cfg.max_attempts.max(1) as usize {
            r.repeat = repeat;
            r.attempts = attempts;
            return Ok(r);
        }
    }
}

/// Run the experiment: every network, every strategy, each on a fresh fabric.
pub fn run_wan(cfg: &WanConfig) -> Result<WanReport, ExperimentError> {
    let topo = Topology::load(&cfg.topology)?;
    let links = site_links(&topo).map_err(|e| ExperimentError::Other(e.to_string()))?;
    overlay_from_topology(&topo).map_err(|e| ExperimentError::Other(e.to_string()))?;
    if topo.hosts.len() < 2 {
        return Err(ExperimentError::Other(format!(
            "topology {} has {} site(s): NetStorm needs at least 2",
            topo.name,
            topo.hosts.len()
        )));
    }
    // Fail here, once, rather than in every node.
    let workload =
        Workload::load(&cfg.model, cfg.scale).map_err(|e| ExperimentError::Other(e.to_string()))?;
    if !cfg.exe.exists() {
        return Err(ExperimentError::Other(format!(
            "the gradwire executable {} does not exist",
            cfg.exe.display()
        )));
    }
    let duration = cfg
        .duration
        .or_else(|| schedule_span(&topo).map(Duration::from_secs_f64));
    let sender_rate_bps: Vec<u64> = (0..topo.hosts.len())
        .map(|r| {
            cfg.rate_bps
                .unwrap_or_else(|| site_rate_cap(&topo, &links, r))
        })
        .collect();
    let frame_budget = frame_budget(&topo, &links, |r| sender_rate_bps[r]);
    if frame_budget.total_fps > frame_budget.limit_fps {
        return Err(ExperimentError::Other(format!(
            "at these rates the fabric may have to forward {:.0} frames/s ({:.0} from the \
             hosts, {:.0} over the WAN links), more than the {:.0} it keeps up with here: \
             lower --rate or the topology's rates",
            frame_budget.total_fps,
            frame_budget.from_hosts_fps,
            frame_budget.over_wan_fps,
            frame_budget.limit_fps
        )));
    }
    let mut results = Vec::new();
    for &network in &cfg.networks {
        let variant = network_topology(&topo, network);
        for &strategy in &cfg.strategies {
            for repeat in 0..cfg.repeats.max(1) {
                results.push(run_repeat(
                    cfg, &variant, strategy, network, repeat, duration,
                )?);
            }
        }
    }
    speedups(&mut results);
    let targets = targets(&results);
    Ok(WanReport {
        topology: topo.name.clone(),
        sites: topo.hosts.len(),
        links,
        workload,
        iterations: cfg.iterations,
        duration_s: duration.map(|d| d.as_secs_f64()),
        netstorm: cfg.netstorm.clone(),
        rate_mode: cfg.rate_mode.name().to_owned(),
        period_ns: cfg.period_ns,
        timeout_s: cfg.timeout.as_secs_f64(),
        repeats: cfg.repeats.max(1),
        max_attempts: cfg.max_attempts.max(1),
        sender_rate_bps,
        frame_budget,
        figures: figures(&results),
        results,
        targets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_control::render::fabric::FabricQos;
    use gradwire_fabric::topology::default_policy;
    use gradwire_wan::scheduler::SchedulerReport;

    fn qos() -> FabricQos {
        FabricQos::from_policy(&default_policy()).unwrap()
    }

    /// Three sites, two inter-site links, one of them on a schedule.
    const THREE_SITES: &str = include_str!("../../wan/tests/fixtures/three_sites.toml");

    #[test]
    fn the_static_network_is_the_topology_without_its_schedules() {
        let t = Topology::from_toml(THREE_SITES, qos()).unwrap();
        assert_eq!(schedule_span(&t), Some(40.0));
        let st = network_topology(&t, Network::Static);
        assert_eq!(schedule_span(&st), None);
        assert_eq!(site_links(&st).unwrap()[0].rate_bps, 10_000_000);
        let dy = network_topology(&t, Network::Dynamic);
        assert_eq!(schedule_span(&dy), Some(40.0));
    }

    #[test]
    fn network_names() {
        assert_eq!("dynamic".parse::<Network>(), Ok(Network::Dynamic));
        assert!("wobbly".parse::<Network>().is_err());
    }

    /// A run of `world` nodes whose round `k` took `ms[k]` at node 0 and `ms[k] + 10 x rank`
    /// elsewhere, rounds starting every second from 2 s after the fabric.
    fn outcome(world: usize, ms: &[f64], valid: bool) -> RunOutcome {
        let nodes = (0..world)
            .map(|rank| NodeRun {
                rank,
                output: Some(NodeOutput {
                    rank,
                    world,
                    strategy: "x".into(),
                    model: "m".into(),
                    scale: 1.0,
                    elements: 10,
                    rounds: ms.len() as u32,
                    sync_ms: ms.iter().map(|m| m + 10.0 * rank as f64).collect(),
                    round_start_unix_ms: (0..ms.len())
                        .map(|k| 1_000_000.0 + 2_000.0 + 1_000.0 * k as f64)
                        .collect(),
                    versions: vec![1, 2],
                    relayed: 1,
                    sent_aux: 2,
                    link_reports: 3,
                    verified: true,
                    scheduler: (rank == 0).then(SchedulerReport::default),
                }),
                error: None,
                failure: None,
                ended_s: 5.0,
                stderr_tail: vec![],
            })
            .collect();
        RunOutcome {
            nodes,
            fabric: FabricHealth {
                valid,
                lag_p99_us: 1.0,
                late: if valid { 0 } else { 1 },
                departures: 1,
                frames_per_s_mean: 1000.0,
                frames_per_s_peak: 2000.0,
            },
            nodes_started_s: 0.1,
            fabric_start_unix_ms: 1_000_000.0,
            error: None,
        }
    }

    #[test]
    fn a_run_is_summarized_by_its_slowest_node_per_round() {
        let r = summarize(
            Strategy::Fapt,
            Network::Dynamic,
            outcome(3, &[100.0, 300.0], true),
        );
        assert_eq!(r.sync_ms, vec![120.0, 320.0]);
        assert_eq!(r.sync_ms_mean, 220.0);
        assert_eq!(r.round_start_s, vec![2.0, 3.0]);
        assert_eq!(r.round_ms_mean, 1000.0);
        assert_eq!((r.aux_chunks, r.relayed, r.link_reports), (6, 3, 9));
        assert_eq!(r.versions_used, vec![1, 2]);
        assert!(r.valid && r.verified && r.error.is_none());
        // A failed node: no figure, and the earliest failure is the run's error.
        let mut o = outcome(3, &[100.0], true);
        o.nodes[2].output = None;
        o.nodes[2].error = Some("node 2: died".into());
        o.nodes[2].ended_s = 1.0;
        o.nodes[1].output = None;
        o.nodes[1].error = Some("link with node 2 closed".into());
        o.nodes[1].ended_s = 2.0;
        let r = summarize(Strategy::Fapt, Network::Dynamic, o);
        assert!(r.sync_ms_mean.is_nan() && !r.valid);
        assert_eq!(r.error.as_deref(), Some("node 2: died"));
        // The fabric fell behind: verified, not valid.
        let r = summarize(Strategy::Fapt, Network::Static, outcome(2, &[5.0], false));
        assert!(r.verified && !r.valid);
    }

    #[test]
    fn speedups_and_targets() {
        let run = |s: Strategy, n: Network, ms: f64| summarize(s, n, outcome(2, &[ms], true));
        let mut results = vec![
            run(Strategy::Star, Network::Dynamic, 1000.0),
            run(Strategy::Bkt, Network::Dynamic, 500.0),
            run(Strategy::Mst, Network::Dynamic, 400.0),
            run(Strategy::Fapt, Network::Dynamic, 300.0),
            run(Strategy::MrFapt, Network::Dynamic, 250.0),
            run(Strategy::MrFaptAware, Network::Dynamic, 200.0),
            run(Strategy::MrFaptAwareAux, Network::Dynamic, 150.0),
            run(Strategy::Star, Network::Static, 800.0),
            run(Strategy::Fapt, Network::Static, 500.0),
            run(Strategy::Bkt, Network::Static, 400.0),
            run(Strategy::Mst, Network::Static, 600.0),
        ];
        speedups(&mut results);
        // The slowest node of each one-round run is rank 1 (+10 ms).
        let pro = &results[6];
        assert!((pro.speedup_vs_star - 1010.0 / 160.0).abs() < 1e-9);
        let t = targets(&results);
        assert_eq!(t.netstorm_5x_star_dynamic.met, Some(true));
        assert_eq!(t.each_mechanism_helps.met, Some(true));
        // Static: the chain is not complete.
        assert_eq!(t.each_mechanism_helps_static.met, None);
        // Static: FAPT is slower than BKT.
        assert_eq!(t.fapt_beats_bkt_and_mst.met, Some(false));
        assert!(t.all_runs_valid);
        assert!(t.excluded.is_empty());
        // A mechanism that does not help.
        results[5].sync_ms_mean = 100.0;
        assert_eq!(targets(&results).each_mechanism_helps.met, Some(false));
    }

    fn run(s: Strategy, n: Network, ms: f64, valid: bool, repeat: u32) -> WanResult {
        let mut r = summarize(s, n, outcome(2, &[ms], valid));
        r.repeat = repeat;
        r
    }

    /// The dynamic network's runs of the targets' strategies, `ms` each (star 1000 ms).
    fn dynamic(ms: [f64; 7], valid: [bool; 7]) -> Vec<WanResult> {
        let s = Strategy::ALL;
        (0..7)
            .map(|i| run(s[i], Network::Dynamic, ms[i], valid[i], 0))
            .collect()
    }

    #[test]
    fn a_run_whose_fabric_fell_behind_meets_no_target() {
        // The fast runs fell behind: had they counted, every target would be met.
        let fast = [1000.0, 500.0, 400.0, 100.0, 90.0, 80.0, 70.0];
        let mut all = [true; 7];
        let t = targets(&dynamic(fast, all));
        assert_eq!(t.netstorm_5x_star_dynamic.met, Some(true));
        assert_eq!(t.fapt_beats_bkt_and_mst.met, Some(true));
        all[6] = false; // mr-fapt+aware+aux
        all[3] = false; // fapt
        let mut results = dynamic(fast, all);
        speedups(&mut results);
        let t = targets(&results);
        assert_eq!(t.netstorm_5x_star_dynamic.met, None, "{t:?}");
        assert_eq!(t.fapt_beats_bkt_and_mst.met, None, "{t:?}");
        assert_eq!(t.each_mechanism_helps.met, None);
        assert!(results[6].speedup_vs_star.is_nan());
        assert!(!t.all_runs_valid);
        // The JSON says which runs were left out and why.
        let names: Vec<&str> = t.excluded.iter().map(|e| e.strategy.as_str()).collect();
        assert_eq!(names, ["fapt", "mr-fapt+aware+aux"]);
        assert!(
            t.excluded[0].reason.contains("fell behind its clock"),
            "{:?}",
            t.excluded
        );
        // Star itself fell behind: no speed-up at all.
        let mut results = dynamic(fast, [false, true, true, true, true, true, true]);
        speedups(&mut results);
        assert!(results.iter().all(|r| r.speedup_vs_star.is_nan()));
        assert_eq!(targets(&results).netstorm_5x_star_dynamic.met, None);
    }

    #[test]
    fn a_run_with_a_missing_node_or_a_wrong_result_is_excluded() {
        let fast = [1000.0, 500.0, 400.0, 100.0, 90.0, 80.0, 70.0];
        let mut results = dynamic(fast, [true; 7]);
        // A node that never reported: the run has no figure.
        let mut o = outcome(2, &[70.0], true);
        o.nodes[1].output = None;
        o.nodes[1].error = Some("node 1: stopped by the experiment".into());
        results[6] = summarize(Strategy::MrFaptAwareAux, Network::Dynamic, o);
        // A node whose result was wrong: verified false, though its time is finite.
        let mut o = outcome(2, &[100.0], true);
        if let Some(out) = o.nodes[0].output.as_mut() {
            out.verified = false;
        }
        results[3] = summarize(Strategy::Fapt, Network::Dynamic, o);
        assert!(!results[3].valid && results[3].sync_ms_mean.is_finite());
        let t = targets(&results);
        assert_eq!(t.netstorm_5x_star_dynamic.met, None);
        assert_eq!(t.fapt_beats_bkt_and_mst.met, None);
        let reasons: Vec<&str> = t.excluded.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(reasons.len(), 2);
        assert!(
            reasons.iter().any(|r| r.contains("verified")),
            "{reasons:?}"
        );
        assert!(reasons.iter().any(|r| r.contains("failed")), "{reasons:?}");
    }

    #[test]
    fn figures_are_the_spread_of_the_valid_repeats() {
        let results = vec![
            run(Strategy::Star, Network::Dynamic, 900.0, true, 0),
            run(Strategy::Star, Network::Dynamic, 1100.0, true, 1),
            run(Strategy::Star, Network::Dynamic, 10.0, false, 2),
            run(Strategy::Fapt, Network::Dynamic, 200.0, true, 0),
            run(Strategy::Fapt, Network::Dynamic, 300.0, true, 1),
            run(Strategy::Fapt, Network::Dynamic, 250.0, true, 2),
        ];
        let f = figures(&results);
        assert_eq!(f.len(), 2);
        // The slowest node of each one-round run is rank 1 (+10 ms).
        assert_eq!((f[0].runs, f[0].valid_runs), (3, 2));
        assert_eq!(
            f[0].sync_ms,
            Spread {
                min: 910.0,
                median: 1010.0,
                max: 1110.0
            }
        );
        assert_eq!(f[1].sync_ms.median, 260.0);
        assert_eq!(f[1].speedup_vs_star.max, 1010.0 / 210.0);
        assert_eq!(f[1].speedup_vs_star.min, 1010.0 / 310.0);
        let t = targets(&results);
        assert_eq!(t.excluded.len(), 1);
        assert_eq!(t.excluded[0].repeat, 2);
    }

    #[test]
    fn the_frame_budget_of_the_shipped_experiment_is_within_the_limit() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for file in [WAN9, WAN4] {
            let topo = Topology::load(&root.join(file)).unwrap();
            let links = site_links(&topo).unwrap();
            let caps: Vec<u64> = (0..topo.hosts.len())
                .map(|r| site_rate_cap(&topo, &links, r))
                .collect();
            // Every site's senders are held to its fastest WAN link, below the host link.
            assert!(caps.iter().all(|&c| c > 0 && c < 100_000_000), "{caps:?}");
            let b = frame_budget(&topo, &links, |r| caps[r]);
            eprintln!("{file}: {b:?}");
            assert!(b.total_fps <= b.limit_fps, "{file}: {b:?}");
        }
    }

    #[test]
    fn a_site_is_capped_at_its_fastest_wan_link_over_the_schedule() {
        let t = Topology::from_toml(THREE_SITES, qos()).unwrap();
        let links = site_links(&t).unwrap();
        // a: one link, 10 Mbit/s then 2; b: 10 and 4; c: 4.
        assert_eq!(site_rate_cap(&t, &links, 0), 10_000_000);
        assert_eq!(site_rate_cap(&t, &links, 1), 10_000_000);
        assert_eq!(site_rate_cap(&t, &links, 2), 4_000_000);
        let b = frame_budget(&t, &links, |r| site_rate_cap(&t, &links, r));
        let want_hosts = (2.0 * 10e6 + 2.0 * 10e6 + 2.0 * 4e6) / FRAME_BITS;
        assert!((b.from_hosts_fps - want_hosts).abs() < 1e-6, "{b:?}");
        assert!((b.over_wan_fps - 2.0 * 14e6 / FRAME_BITS).abs() < 1e-6);
    }
}
