//! MLNET on the emulated fabric: aggregation/multicast trees against the direct parameter
//! server (Fig. 1's direction) and job prioritization (Fig. 3's direction).
//!
//! A *job* here is MLNET's synchronous parameter-server training: `W` workers and `S`
//! servers; the model is split evenly over the servers, and every iteration each worker
//! pushes its gradients of every server's shard and pulls the shard back. For each server,
//! the push is aggregated up a tree rooted at the server and the pull is multicast down the
//! same tree (`gradwire-collective`'s pipelined tree all-reduce: the server's `finish` of a
//! chunk stands in for its update); STAR is today's direct parameter server (the tree of
//! depth 1), RACK one aggregator per rack, BINARY in-degree 2. A worker starts iteration
//! `i + 1` only when all of its servers' iteration `i` is done. The makespan of a job is
//! from the moment all its ranks are connected to the end of its last iteration.
//!
//! Every rank of every tree is a thread inside its host's namespace with its own
//! communicator and links (kernel UDP datapaths, TCP control), found through a rendezvous
//! at its server; all receivers of one host (every job's) share one grant pool of the host
//! link's capacity. Nothing blocks without a bound: connecting, every transfer, and the
//! gates that start the run and each iteration have timeouts, and a failing rank breaks the
//! gates it waits on so the others fail fast with the reason.
//!
//! Priorities: a job's priority (0 = most urgent, as gradwire-qos's data priorities) picks
//! the DSCP of its data packets, so the fabric's strict-priority queues serve the urgent
//! job first, and is its receivers' class in their host's grant pool, so a receiving host
//! grants its downlink to the most urgent job's flows and lets the others trickle
//! (`priority` modes). `fifo` puts every job in the same queue and class. Every host has
//! one grant pool for all jobs, as MLNET's one communication process per host would.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gradwire::flow::SenderConfig;
use gradwire::grant::GrantConfig;
use gradwire::grant_pool::GrantPool;
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::TransferConfig;
use gradwire_collective::aggregate::ReduceOp;
use gradwire_collective::comm::{
    Algorithm, AllReduceOptions, AllReduceReport, CommConfig, Communicator, TensorMut,
};
use gradwire_collective::group::{AllReduceAlgo, GroupConfig, GroupReduceOptions, PendingGroup};
use gradwire_collective::link::{tree_edges, Links, NetLinkConfig};
use gradwire_collective::tree::{Strategy, Tree};
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig, FabricStats};
use gradwire_fabric::topology::Topology;
use gradwire_netns::spawn_in_netns;
use serde::Serialize;

use crate::ExperimentError;

/// One job to run.
#[derive(Debug, Clone, Serialize)]
pub struct JobPlan {
    /// Job id (also picks its rendezvous ports).
    pub job: u32,
    /// Priority, 0 = most urgent.
    pub priority: u8,
    /// DSCP of its data packets.
    pub dscp: u8,
    /// The priority its senders announce, i.e. its flows' class in the receiving hosts'
    /// grant pools (0 = most urgent).
    pub grant_class: u8,
    /// Server hosts (topology host indices).
    pub servers: Vec<usize>,
    /// Worker hosts.
    pub workers: Vec<usize>,
    /// Tree strategy.
    #[serde(serialize_with = "strategy_name")]
    pub strategy: Strategy,
    /// f32 elements of each server's shard.
    pub shard_elems: usize,
    /// Iterations.
    pub iterations: u32,
}

fn strategy_name<S: serde::Serializer>(s: &Strategy, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(&s.to_string())
}

/// What one job did.
#[derive(Debug, Clone, Serialize)]
pub struct JobOutcome {
    /// Job id.
    pub job: u32,
    /// Makespan, ms (NaN when it failed).
    pub makespan_ms: f64,
    /// Mean iteration time, ms.
    pub iteration_ms_mean: f64,
    /// Edges of its trees that cross racks (one tree per server).
    pub cross_rack_edges: usize,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// Settings shared by the runs.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// Longest wait for a connection, a peer's part of an operation, or a gate.
    pub timeout: Duration,
    /// The rate-control period, ns (2 ms on the emulated links, as the incast experiment).
    pub period_ns: u64,
    /// Loss bound of every transfer.
    pub loss_bound: LossBound,
    /// Blocks per pipeline chunk (flows; the message layer's tree pipelines
    /// `gradwire_collective::algo::tree::PIPELINE_BLOCKS`, also 64).
    pub pipeline_blocks: usize,
    /// Which protocol carries the trees.
    pub transport: Transport,
    /// On the message layer: receiver grants (off: every sender's own window only, for the
    /// ablation).
    pub grants: bool,
}

/// Which protocol carries a run's trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The message layer: one endpoint per rank (`gradwire_collective::group::Group`),
    /// receivers scheduling incast with grants of their own (one budget per endpoint).
    Msg,
    /// The flow transport: links per tree edge, one rate-grant pool per host shared by every
    /// job there, with priority classes (the priority experiment needs those).
    Flow,
}

impl Transport {
    /// `msg` or `flow`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Msg => "msg",
            Transport::Flow => "flow",
        }
    }
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            timeout: Duration::from_secs(60),
            period_ns: 2_000_000,
            loss_bound: LossBound::RELIABLE,
            pipeline_blocks: 64,
            transport: Transport::Flow,
            grants: true,
        }
    }
}

/// A barrier with a deadline that a failing party can break, so nobody waits for a rank
/// that is gone.
#[derive(Debug)]
struct Gate {
    parties: usize,
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Gate {
    fn new(parties: usize) -> Arc<Gate> {
        Arc::new(Gate {
            parties,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        })
    }

    fn wait(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock().map_err(|_| "gate poisoned".to_string())?;
        if s.2 {
            return Err("another rank of the job failed".into());
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.parties {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while s.1 == generation && !s.2 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                s.2 = true;
                self.cv.notify_all();
                return Err(format!("the other ranks did not arrive within {timeout:?}"));
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .map_err(|_| "gate poisoned".to_string())?
                .0;
        }
        if s.1 == generation {
            return Err("another rank of the job failed".into());
        }
        Ok(())
    }

    fn break_all(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.2 = true;
            self.cv.notify_all();
        }
    }
}

fn link_rate(topo: &Topology, host: usize) -> u64 {
    let h = &topo.hosts[host];
    topo.switches[h.switch].ports[h.port].link.rate_bps
}

/// The rack (leaf switch) of every host.
pub fn host_racks(topo: &Topology) -> Vec<usize> {
    topo.hosts.iter().map(|h| h.switch).collect()
}

/// The tree of server `j` of `plan`: local rank 0 is the server, 1.. the workers in order.
fn server_tree(plan: &JobPlan, j: usize, racks: &[usize]) -> Result<(Vec<usize>, Tree), String> {
    let mut hosts = vec![plan.servers[j]];
    hosts.extend(&plan.workers);
    let rack_of: Vec<usize> = hosts.iter().map(|&h| racks[h]).collect();
    let members: Vec<usize> = (0..hosts.len()).collect();
    let tree = Tree::build(plan.strategy, 0, &members, &rack_of).map_err(|e| e.to_string())?;
    Ok((hosts, tree))
}

/// Rank `local`'s input at element `e` in iteration `it`: the server (rank 0) adds nothing,
/// a worker a small integer in -11..=11 that changes with the rank, the iteration and the
/// element. Sums of a few of them are exact in f32 in any order, so the result of a reliable
/// all-reduce is known exactly, and a stale or partial one differs.
pub fn input(local: usize, it: u32, e: usize) -> f32 {
    if local == 0 {
        return 0.0;
    }
    ((local * 7 + it as usize * 5 + e * 3) % 23) as f32 - 11.0
}

fn fill_input(v: &mut [f32], local: usize, it: u32) {
    for (e, x) in v.iter_mut().enumerate() {
        *x = input(local, it, e);
    }
}

/// Check one rank's result of iteration `it` of a sum all-reduce over `world` ranks whose
/// inputs are [`input`]. `exact` (a reliable loss bound): every block has every rank's
/// contribution and every element is the exact sum. Otherwise each block is the sum over the
/// contributors its report names, scaled to the world (`ReduceOp::Sum`), and names at least
/// one.
pub fn check_all_reduce(
    got: &[f32],
    report: &AllReduceReport,
    world: usize,
    it: u32,
    exact: bool,
) -> Result<(), String> {
    let wrong = |what: String| {
        format!(
            "WRONG RESULT of the all-reduce in iteration {it}: {what}; the collective is broken"
        )
    };
    if got.len() != report.elems {
        return Err(wrong(format!(
            "{} elements, the report says {}",
            got.len(),
            report.elems
        )));
    }
    let be = report.block_elems.max(1);
    if report.blocks != got.len().div_ceil(be) || report.contributors.blocks() != report.blocks {
        return Err(wrong(format!(
            "{} blocks of {be} elements for {} elements ({} contributor sets)",
            report.blocks,
            got.len(),
            report.contributors.blocks()
        )));
    }
    for b in 0..report.blocks {
        let ranks = report.contributors.ranks(b);
        if exact && ranks.len() != world {
            return Err(wrong(format!(
                "block {b} sums ranks {ranks:?}, not all {world} (the loss bound is 0)"
            )));
        }
        if ranks.is_empty() || ranks.iter().any(|&r| r >= world) {
            return Err(wrong(format!("block {b} names contributors {ranks:?}")));
        }
        let factor = world as f32 / ranks.len() as f32;
        let end = ((b + 1) * be).min(got.len());
        for (e, &g) in got.iter().enumerate().take(end).skip(b * be) {
            let sum: f32 = ranks.iter().map(|&r| input(r, it, e)).sum();
            let want = if ranks.len() == world {
                sum
            } else {
                sum * factor
            };
            let ok = if exact {
                g == want
            } else {
                (g - want).abs() <= 1e-5 * want.abs().max(1.0)
            };
            if !ok {
                return Err(wrong(format!(
                    "element {e} is {g}, expected {want} (the sum over ranks {ranks:?})"
                )));
            }
        }
    }
    Ok(())
}

/// What a rank of one tree is, for [`LayerRank::run`].
struct RankCtx {
    job: u32,
    local: usize,
    world: usize,
    ip: IpAddr,
    iterations: u32,
    shard: usize,
    timeout: Duration,
    exact: bool,
    grants: bool,
}

/// A rank of one tree on the message layer: its endpoint's address goes into the tree's
/// table, and the group starts once every rank's is there.
struct LayerRank {
    table: Arc<Mutex<Vec<Option<SocketAddr>>>>,
    gate: Arc<Gate>,
    tree: Tree,
    opts: GroupReduceOptions,
}

impl LayerRank {
    /// Binds, exchanges addresses, then the timed iterations (each result kept and checked
    /// after the loop, as on flows). Returns the loop's start and end.
    fn run(
        self,
        c: &RankCtx,
        start_gate: &Gate,
        host_gate: &Gate,
    ) -> Result<(Instant, Instant), String> {
        let mut cfg = GroupConfig::new(c.job, c.local, c.world, c.ip, c.timeout);
        cfg.endpoint.core.grants = c.grants;
        let pending = PendingGroup::bind(cfg).map_err(|e| e.to_string())?;
        self.table
            .lock()
            .map_err(|_| "address table poisoned".to_string())?[c.local] = Some(pending.address());
        self.gate.wait(c.timeout)?;
        let addrs: Option<Vec<SocketAddr>> = self
            .table
            .lock()
            .map_err(|_| "address table poisoned".to_string())?
            .iter()
            .copied()
            .collect();
        let addrs = addrs.ok_or("a rank of the tree published no address")?;
        let group = pending.start(addrs).map_err(|e| e.to_string())?;
        timed_iterations(c, "", start_gate, host_gate, |t| {
            let before = group.stats().core.payload_bytes_sent;
            let out = group
                .all_reduce_tree(TensorMut::from(t), &self.tree, &self.opts)
                .map_err(|e| e.to_string())?;
            let sent = group.stats().core.payload_bytes_sent.saturating_sub(before);
            Ok(AllReduceReport::of_outcome(
                out,
                c.shard,
                group.block_bytes() / 4,
                c.world,
                sent,
            ))
        })
    }
}

/// The timed loop of one rank, either transport: after the start gate, `iterations` times
/// fill the input, all-reduce it with `reduce`, keep the result and wait for the host's
/// other trees; then check every kept result, so a tree that skipped work is an error, not
/// a faster run. Errors of `reduce` and of the checks start with `label`; a gate's error is
/// returned as it is. Returns the loop's start and end.
fn timed_iterations(
    c: &RankCtx,
    label: &str,
    start_gate: &Gate,
    host_gate: &Gate,
    mut reduce: impl FnMut(&mut Tensor) -> Result<AllReduceReport, String>,
) -> Result<(Instant, Instant), String> {
    let mut t = Tensor::zeros(DType::F32, c.shard);
    let mut results = Vec::with_capacity(c.iterations as usize);
    start_gate.wait(c.timeout)?;
    let start = Instant::now();
    for it in 0..c.iterations {
        if let Some(v) = t.as_f32_mut() {
            fill_input(v, c.local, it);
        }
        let report = reduce(&mut t).map_err(|e| format!("{label}{e}"))?;
        results.push((t.as_f32().map(<[f32]>::to_vec), report));
        host_gate.wait(c.timeout)?;
    }
    let end = Instant::now();
    for (it, (got, report)) in results.iter().enumerate() {
        let got = got.as_deref().unwrap_or_default();
        check_all_reduce(got, report, c.world, it as u32, c.exact)
            .map_err(|e| format!("{label}{e}"))?;
    }
    Ok((start, end))
}

/// Run `jobs` at once on a running fabric (`net` built from `topo`); outcomes in job order.
pub fn run_jobs(
    topo: &Topology,
    net: &FabricNet,
    jobs: &[JobPlan],
    settings: &RunSettings,
) -> Vec<JobOutcome> {
    let racks = host_racks(topo);
    let total_threads: usize = jobs
        .iter()
        .map(|p| p.servers.len() * (p.workers.len() + 1))
        .sum();
    let start_gate = Gate::new(total_threads);
    type Done = Result<(Instant, Instant), String>;
    let mut per_job: Vec<(Vec<std::thread::JoinHandle<Done>>, usize, Option<String>)> = Vec::new();
    // One grant pool per host, shared by every receiver of every job there: the host's
    // downlink is one capacity (MLNET's per-host process arbitrates between its jobs).
    let pools: Vec<GrantPool> = (0..topo.hosts.len())
        .map(|h| GrantPool::new(GrantConfig::new(link_rate(topo, h), settings.period_ns)))
        .collect();
    for plan in jobs {
        let mut handles = Vec::new();
        let mut setup_error = None;
        let mut cross = 0;
        // Per-host iteration gates: a worker's trees wait for each other every iteration.
        let mut host_gates = std::collections::BTreeMap::new();
        for j in 0..plan.servers.len() {
            if let Ok((hosts, _)) = server_tree(plan, j, &racks) {
                for h in hosts {
                    *host_gates.entry(h).or_insert(0usize) += 1;
                }
            }
        }
        let host_gates: std::collections::BTreeMap<usize, Arc<Gate>> = host_gates
            .into_iter()
            .map(|(h, n)| (h, Gate::new(n)))
            .collect();
        for j in 0..plan.servers.len() {
            let (hosts, tree) = match server_tree(plan, j, &racks) {
                Ok(t) => t,
                Err(e) => {
                    setup_error = Some(e);
                    start_gate.break_all();
                    break;
                }
            };
            let local_racks: Vec<usize> = hosts.iter().map(|&h| racks[h]).collect();
            cross += tree.cross_rack_edges(&local_racks);
            let master = SocketAddr::new(
                IpAddr::V4(topo.hosts[hosts[0]].ip),
                30_000 + (plan.job as u16 % 200) * 16 + j as u16,
            );
            let edges = tree_edges(&tree);
            // The message layer's ranks publish their endpoint addresses here and start once
            // every rank of the tree has.
            let table: Arc<Mutex<Vec<Option<SocketAddr>>>> =
                Arc::new(Mutex::new(vec![None; hosts.len()]));
            let table_gate = Gate::new(hosts.len());
            for (local, &h) in hosts.iter().enumerate() {
                let Some(ns) = net.host_ns(h) else {
                    setup_error = Some(format!("no namespace for host {h}"));
                    start_gate.break_all();
                    break;
                };
                let ip = IpAddr::V4(topo.hosts[h].ip);
                let world = hosts.len();
                let rate = link_rate(topo, h);
                let mut sender = SenderConfig::new(rate);
                sender.rate.period_ns = settings.period_ns;
                // Announced in every FlowStart: the receiving hosts' grant pools serve the
                // most urgent job's flows first.
                sender.priority = plan.grant_class;
                let comm_cfg = CommConfig {
                    transfer: TransferConfig {
                        sender,
                        idle_timeout: Duration::from_secs(20),
                        grant_pool: pools.get(h).cloned(),
                        ..TransferConfig::default()
                    },
                    loss_bound: settings.loss_bound,
                    pipeline_blocks: settings.pipeline_blocks,
                    op_timeout: settings.timeout,
                    ..CommConfig::default()
                };
                let opts = AllReduceOptions {
                    op: ReduceOp::Sum,
                    dscp: plan.dscp,
                    algorithm: Algorithm::Tree(tree.clone()),
                    ..AllReduceOptions::default()
                };
                let link_cfg = NetLinkConfig {
                    connect_timeout: settings.timeout,
                    ..NetLinkConfig::default()
                };
                let (edges, gate) = (edges.clone(), start_gate.clone());
                let host_gate = host_gates[&h].clone();
                let (job, iterations, shard, timeout) = (
                    plan.job,
                    plan.iterations,
                    plan.shard_elems,
                    settings.timeout,
                );
                let exact = settings.loss_bound == LossBound::RELIABLE;
                let on_layer = LayerRank {
                    table: table.clone(),
                    gate: table_gate.clone(),
                    tree: tree.clone(),
                    opts: GroupReduceOptions {
                        op: ReduceOp::Sum,
                        loss_bound: settings.loss_bound.as_fraction(),
                        algorithm: AllReduceAlgo::Auto,
                        dscp: plan.dscp,
                        layer: 0,
                        ..GroupReduceOptions::default()
                    },
                };
                let transport = settings.transport;
                let grants = settings.grants;
                let run = move || -> Done {
                    let fail = |e: String| {
                        host_gate.break_all();
                        gate.break_all();
                        e
                    };
                    let ctx = RankCtx {
                        job,
                        local,
                        world,
                        ip,
                        iterations,
                        shard,
                        timeout,
                        exact,
                        grants,
                    };
                    if transport == Transport::Msg {
                        return on_layer
                            .run(&ctx, &gate, &host_gate)
                            .map_err(|e| fail(format!("rank {local} on {ip}: {e}")));
                    }
                    let links =
                        Links::connect(job, local, world, ip, master, &edges, None, &link_cfg)
                            .map_err(|e| fail(format!("rank {local} on {ip}: {e}")))?;
                    let mut comm =
                        Communicator::new(links, job, comm_cfg).map_err(|e| fail(e.to_string()))?;
                    let label = format!("rank {local} on {ip}: ");
                    timed_iterations(&ctx, &label, &gate, &host_gate, |t| {
                        comm.all_reduce(t, &opts).map_err(|e| e.to_string())
                    })
                    .map_err(fail)
                };
                match spawn_in_netns(ns, run) {
                    Ok(hd) => handles.push(hd),
                    Err(e) => {
                        setup_error = Some(format!("entering {ns}: {e}"));
                        start_gate.break_all();
                        break;
                    }
                }
            }
        }
        per_job.push((handles, cross, setup_error));
    }
    jobs.iter()
        .zip(per_job)
        .map(|(plan, (handles, cross, setup_error))| {
            let mut first = None::<Instant>;
            let mut last = None::<Instant>;
            let mut error = setup_error;
            for h in handles {
                match h.join() {
                    Ok(Ok((s, e))) => {
                        first = Some(first.map_or(s, |f| f.min(s)));
                        last = Some(last.map_or(e, |l| l.max(e)));
                    }
                    Ok(Err(e)) => {
                        error.get_or_insert(e);
                    }
                    Err(_) => {
                        error.get_or_insert("a rank thread panicked".into());
                    }
                }
            }
            let makespan_ms = match (first, last, &error) {
                (Some(f), Some(l), None) => l.duration_since(f).as_secs_f64() * 1e3,
                _ => f64::NAN,
            };
            JobOutcome {
                job: plan.job,
                makespan_ms,
                iteration_ms_mean: makespan_ms / plan.iterations.max(1) as f64,
                cross_rack_edges: cross,
                error,
            }
        })
        .collect()
}

/// How the emulated fabric kept up during a run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct FabricHealth {
    /// The fabric kept its clock: the run counts as a result.
    pub valid: bool,
    /// Departure lag p99, us.
    pub lag_p99_us: f64,
    /// Late departures.
    pub late: u64,
    /// Departures.
    pub departures: u64,
    /// Frames the switches forwarded per second over the whole run (every hop counts: the
    /// fabric's work).
    pub frames_per_s_mean: f64,
    /// The most in any window of at least [`FrameMeter::WINDOW_S`] (the demand that decides
    /// whether one core keeps up; it forwards about 185 k frames/s at best).
    pub frames_per_s_peak: f64,
}

impl FabricHealth {
    /// A run whose fabric never reported (it did not start, or published nothing).
    pub fn unknown() -> FabricHealth {
        FabricHealth {
            valid: false,
            lag_p99_us: f64::NAN,
            late: 0,
            departures: 0,
            frames_per_s_mean: f64::NAN,
            frames_per_s_peak: f64::NAN,
        }
    }

    /// From the fabric's final figures (`None`: it published none, not valid) and the frame
    /// rates `meter` saw during the run.
    pub fn of(stats: Option<&FabricStats>, meter: &FrameMeter) -> FabricHealth {
        let Some(s) = stats else {
            return FabricHealth::unknown();
        };
        let mut meter = meter.clone();
        meter.sample(s);
        FabricHealth {
            valid: !s.lag.behind,
            lag_p99_us: s.lag.p99_ns as f64 / 1e3,
            late: s.lag.late,
            departures: s.lag.departures,
            frames_per_s_mean: if s.uptime_s > 0.0 {
                s.totals().forwarded as f64 / s.uptime_s
            } else {
                f64::NAN
            },
            frames_per_s_peak: meter.peak(),
        }
    }
}

/// The fabric's forwarding rate from its published snapshots (frames forwarded, uptime):
/// the peak over windows of at least [`FrameMeter::WINDOW_S`].
#[derive(Debug, Clone, Default)]
pub struct FrameMeter {
    window: Option<(f64, u64)>,
    peak: Option<f64>,
}

impl FrameMeter {
    /// Shortest window, seconds (the fabric publishes every 200 ms).
    pub const WINDOW_S: f64 = 1.0;

    /// Takes one snapshot into account.
    pub fn sample(&mut self, s: &FabricStats) {
        let (t, f) = (s.uptime_s, s.totals().forwarded);
        match self.window {
            None => self.window = Some((t, f)),
            Some((t0, f0)) if t - t0 >= Self::WINDOW_S => {
                let rate = f.saturating_sub(f0) as f64 / (t - t0);
                self.peak = Some(self.peak.map_or(rate, |p| p.max(rate)));
                self.window = Some((t, f));
            }
            Some(_) => {}
        }
    }

    /// The peak so far (NaN before a whole window).
    pub fn peak(&self) -> f64 {
        self.peak.unwrap_or(f64::NAN)
    }
}

/// Build the fabric of `topo`, run `jobs`, tear it down; outcomes and how the fabric kept
/// its clock (whether the run is valid).
pub fn run_on_fresh_fabric(
    topo: &Topology,
    jobs: &[JobPlan],
    settings: &RunSettings,
) -> Result<(Vec<JobOutcome>, FabricHealth), ExperimentError> {
    let net = FabricNet::up(topo).map_err(|e| ExperimentError::Other(format!("testbed: {e}")))?;
    let fabric = match spawn(topo, net.switch_namespaces(), FabricConfig::default()) {
        Ok(f) => f,
        Err(e) => {
            let down = net.down();
            return Err(ExperimentError::Other(format!(
                "starting the fabric: {e}{}",
                down.err()
                    .map(|d| format!("; teardown: {d}"))
                    .unwrap_or_default()
            )));
        }
    };
    // The jobs run on this thread; a second one samples the fabric's frame rate until they
    // are done (the channel closing ends it at once).
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let fabric_ref = &fabric;
    let (outcomes, mut meter) = std::thread::scope(|scope| {
        let sampler = scope.spawn(move || {
            let mut meter = FrameMeter::default();
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                done_rx.recv_timeout(Duration::from_millis(200))
            {
                if let Some(s) = fabric_ref.stats() {
                    meter.sample(&s);
                }
            }
            meter
        });
        let outcomes = run_jobs(topo, &net, jobs, settings);
        drop(done_tx);
        (outcomes, sampler.join().unwrap_or_default())
    });
    let _ = fabric.wait_idle(Duration::from_secs(10));
    let stats = fabric.stop();
    if let Some(s) = &stats {
        meter.sample(s);
    }
    let down = net.down();
    let health = FabricHealth::of(stats.as_ref(), &meter);
    down.map_err(|e| ExperimentError::Other(format!("removing the testbed: {e}")))?;
    Ok((outcomes, health))
}

/// `gradwire experiment mlnet`: STAR vs trees for several server counts.
#[derive(Debug, Clone)]
pub struct MlnetConfig {
    /// Topology (`testbeds/mlnet.toml`).
    pub topology: PathBuf,
    /// Strategies.
    pub strategies: Vec<Strategy>,
    /// Server counts.
    pub servers: Vec<usize>,
    /// Workers.
    pub workers: usize,
    /// Model size in bytes (split over the servers).
    pub model_bytes: u64,
    /// Iterations per run.
    pub iterations: u32,
    /// Seed of the placement of servers and workers on hosts.
    pub seed: u64,
    /// Shared settings.
    pub settings: RunSettings,
}

impl MlnetConfig {
    /// Defaults with files under the repository root `root`: STAR, RACK, BINARY; 1, 2 and 4
    /// servers; 8 workers; a 512 KiB model; 3 iterations; seed 1.
    pub fn new(root: &std::path::Path) -> MlnetConfig {
        MlnetConfig {
            topology: root.join("testbeds/mlnet.toml"),
            strategies: vec![Strategy::Star, Strategy::Rack, Strategy::BINARY],
            servers: vec![1, 2, 4],
            workers: 8,
            model_bytes: 512 << 10,
            iterations: 3,
            seed: 1,
            settings: RunSettings::default(),
        }
    }
}

/// One run of the MLNET experiment.
#[derive(Debug, Clone, Serialize)]
pub struct MlnetResult {
    /// `star`, `rack`, `binary` or `d=N`.
    pub strategy: String,
    /// Parameter servers.
    pub servers: usize,
    /// Makespan of all iterations, ms.
    pub makespan_ms: f64,
    /// Mean iteration, ms.
    pub iteration_ms_mean: f64,
    /// Makespan / STAR's at the same server count (NaN unless both runs are valid).
    pub vs_star: f64,
    /// Tree edges crossing racks, summed over the servers' trees.
    pub cross_rack_edges: usize,
    /// A result: the fabric kept its clock and every rank finished with every all-reduce
    /// checked (no error).
    pub valid: bool,
    /// How the fabric kept up.
    pub fabric: FabricHealth,
    /// Why it failed.
    pub error: Option<String>,
}

impl MlnetResult {
    /// The result of `strategy` with `servers` servers: valid only when the fabric kept its
    /// clock and the job has no error (every all-reduce checked); `vs_star` to be filled in.
    pub fn of(
        strategy: Strategy,
        servers: usize,
        o: &JobOutcome,
        health: FabricHealth,
    ) -> MlnetResult {
        MlnetResult {
            strategy: strategy.to_string(),
            servers,
            makespan_ms: o.makespan_ms,
            iteration_ms_mean: o.iteration_ms_mean,
            vs_star: f64::NAN,
            cross_rack_edges: o.cross_rack_edges,
            valid: health.valid && o.error.is_none(),
            fabric: health,
            error: o.error.clone(),
        }
    }
}

/// The MLNET experiment's report.
#[derive(Debug, Clone, Serialize)]
pub struct MlnetReport {
    /// Topology name.
    pub topology: String,
    /// Workers.
    pub workers: usize,
    /// Model bytes.
    pub model_bytes: u64,
    /// Iterations per run.
    pub iterations: u32,
    /// The protocol that carried the trees: `msg` or `flow`.
    pub transport: Transport,
    /// On the message layer, whether receivers granted.
    pub grants: bool,
    /// Runs.
    pub results: Vec<MlnetResult>,
}

/// Hosts in a seeded random order: the first ones serve, the next ones work.
fn placement(hosts: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..hosts).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut order);
    order
}

/// Run the MLNET experiment.
pub fn run_mlnet(cfg: &MlnetConfig) -> Result<MlnetReport, ExperimentError> {
    let topo = Topology::load(&cfg.topology)?;
    let order = placement(topo.hosts.len(), cfg.seed);
    let mut results = Vec::new();
    for &s in &cfg.servers {
        if s + cfg.workers > topo.hosts.len() {
            return Err(ExperimentError::Other(format!(
                "{s} servers + {} workers need more than the topology's {} hosts",
                cfg.workers,
                topo.hosts.len()
            )));
        }
        let first = results.len();
        for (i, &strategy) in cfg.strategies.iter().enumerate() {
            let plan = JobPlan {
                job: 1 + i as u32,
                priority: 0,
                dscp: gradwire_qos::priority_dscp(0),
                grant_class: 0,
                servers: order[..s].to_vec(),
                workers: order[s..s + cfg.workers].to_vec(),
                strategy,
                shard_elems: (cfg.model_bytes / 4 / s as u64).max(1) as usize,
                iterations: cfg.iterations,
            };
            eprintln!("mlnet: {strategy} with {s} server(s)...");
            let (outcomes, health) = run_on_fresh_fabric(&topo, &[plan], &cfg.settings)?;
            results.push(MlnetResult::of(strategy, s, &outcomes[0], health));
        }
        relative_to_star(&mut results[first..]);
    }
    Ok(MlnetReport {
        topology: topo.name.clone(),
        workers: cfg.workers,
        model_bytes: cfg.model_bytes,
        iterations: cfg.iterations,
        transport: cfg.settings.transport,
        grants: cfg.settings.grants,
        results,
    })
}

/// Fill in `vs_star` of runs at one server count: a valid run's makespan over STAR's when
/// STAR's run is valid too; NaN otherwise (a figure comes from valid, checked runs only).
pub fn relative_to_star(results: &mut [MlnetResult]) {
    let star_ms = results
        .iter()
        .find(|r| r.strategy == "star" && r.valid)
        .map_or(f64::NAN, |r| r.makespan_ms);
    for r in results {
        r.vs_star = if r.valid {
            r.makespan_ms / star_ms
        } else {
            f64::NAN
        };
    }
}

/// How the concurrent jobs of the priority experiment share the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PriorityMode {
    /// Every job's data in one switch queue (first come, first served); STAR.
    Fifo,
    /// Each job's data in the queue of its priority (strict priority); STAR.
    Priority,
    /// Priority queues and RACK trees.
    #[serde(rename = "priority+trees")]
    PriorityTrees,
}

impl PriorityMode {
    /// Name in reports: `fifo`, `priority`, `priority+trees`.
    pub fn name(self) -> &'static str {
        match self {
            PriorityMode::Fifo => "fifo",
            PriorityMode::Priority => "priority",
            PriorityMode::PriorityTrees => "priority+trees",
        }
    }

    /// All modes, in report order.
    pub const ALL: [PriorityMode; 3] = [
        PriorityMode::Fifo,
        PriorityMode::Priority,
        PriorityMode::PriorityTrees,
    ];
}

/// `gradwire experiment priority`: concurrent jobs with random priorities.
#[derive(Debug, Clone)]
pub struct PriorityConfig {
    /// Topology (`testbeds/mlnet.toml`).
    pub topology: PathBuf,
    /// Concurrent jobs.
    pub jobs: usize,
    /// Workers per job.
    pub workers: usize,
    /// Model bytes per job (one server per job).
    pub model_bytes: u64,
    /// Iterations per job.
    pub iterations: u32,
    /// Repetitions with different seeds (more jobs for the CDF).
    pub repetitions: u32,
    /// Seed of priorities and placement.
    pub seed: u64,
    /// Modes to run.
    pub modes: Vec<PriorityMode>,
    /// Also run the two-job comparison ([`PairResult`]).
    pub pair: bool,
    /// Shared settings.
    pub settings: RunSettings,
}

impl PriorityConfig {
    /// Defaults: 4 jobs of 1 server + 4 workers placed at random on the 12 hosts (so jobs
    /// share links), distinct priorities in random order, 512 KiB models, 2 iterations, 3
    /// repetitions, all modes.
    pub fn new(root: &std::path::Path) -> PriorityConfig {
        PriorityConfig {
            topology: root.join("testbeds/mlnet.toml"),
            jobs: 4,
            workers: 4,
            model_bytes: 512 << 10,
            iterations: 2,
            repetitions: 3,
            seed: 1,
            modes: PriorityMode::ALL.to_vec(),
            pair: true,
            settings: RunSettings::default(),
        }
    }
}

/// One job of one run of the priority experiment.
#[derive(Debug, Clone, Serialize)]
pub struct PriorityResult {
    /// `fifo`, `priority` or `priority+trees`.
    pub mode: &'static str,
    /// Repetition.
    pub repetition: u32,
    /// Job id.
    pub job: u32,
    /// Priority (0 = most urgent).
    pub priority: u8,
    /// Makespan, ms.
    pub makespan_ms: f64,
    /// A result: the fabric kept its clock and the job finished with every all-reduce
    /// checked (no error).
    pub valid: bool,
    /// The fabric kept its clock during the run.
    pub fabric_valid: bool,
    /// Why the job failed.
    pub error: Option<String>,
}

/// Median and tail of one mode's makespans.
#[derive(Debug, Clone, Serialize)]
pub struct ModeSummary {
    /// Mode.
    pub mode: &'static str,
    /// Valid jobs, the figures' sample.
    pub jobs: usize,
    /// Jobs left out: not valid (the fabric fell behind, or the job failed).
    pub excluded: usize,
    /// Median makespan, ms.
    pub median_ms: f64,
    /// 95th percentile makespan, ms.
    pub p95_ms: f64,
    /// Largest makespan, ms.
    pub max_ms: f64,
}

/// The priority experiment's report.
#[derive(Debug, Clone, Serialize)]
pub struct PriorityReport {
    /// Topology name.
    pub topology: String,
    /// Jobs per run.
    pub jobs: usize,
    /// Workers per job.
    pub workers: usize,
    /// Model bytes per job.
    pub model_bytes: u64,
    /// Iterations per job.
    pub iterations: u32,
    /// Every job of every run.
    pub results: Vec<PriorityResult>,
    /// Per mode.
    pub summary: Vec<ModeSummary>,
    /// Two jobs on one bottleneck, with priorities (when asked for).
    pub pair: Option<PairResult>,
}

/// Two jobs whose servers share one host (one downlink: the bottleneck), the urgent one
/// (priority 0) alone and then beside a background job (priority 6), in the priority mode,
/// repeated: the figures are the medians over the repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct PairResult {
    /// The urgent job alone, ms (median).
    pub alone_ms: f64,
    /// The urgent job beside the background job, ms (median).
    pub urgent_ms: f64,
    /// The background job, ms (median).
    pub background_ms: f64,
    /// Median of `urgent / alone` over the repetitions (each pair of runs back to back).
    pub urgent_vs_alone: f64,
    /// Every valid repetition's `urgent / alone`.
    pub ratios: Vec<f64>,
    /// Every repetition is valid (both runs kept the fabric's clock, no job failed, every
    /// all-reduce checked); the figures come from the valid ones only.
    pub valid: bool,
    /// The repetitions left out of the figures, and why.
    pub excluded: Vec<String>,
    /// Why a job failed.
    pub error: Option<String>,
}

/// The pair of [`PairResult`]: both servers on host 0, the urgent job's workers on hosts
/// 4..=7, the background job's on 8..=11 (other racks of `testbeds/mlnet.toml`).
pub fn pair_jobs(
    cfg: &PriorityConfig,
    hosts: usize,
) -> Result<(JobPlan, JobPlan), ExperimentError> {
    if hosts < 12 {
        return Err(ExperimentError::Other(format!(
            "the two-job run needs 12 hosts, the topology has {hosts}"
        )));
    }
    let job = |id: u32, priority: u8, workers: Vec<usize>| JobPlan {
        job: id,
        priority,
        dscp: gradwire_qos::priority_dscp(priority),
        grant_class: priority,
        servers: vec![0],
        workers,
        strategy: Strategy::Star,
        shard_elems: (cfg.model_bytes / 4).max(1) as usize,
        iterations: cfg.iterations,
    };
    Ok((job(1, 0, (4..8).collect()), job(2, 6, (8..12).collect())))
}

/// Run the two-job comparison of [`PairResult`], `cfg.repetitions` times.
pub fn run_pair(cfg: &PriorityConfig) -> Result<PairResult, ExperimentError> {
    let topo = Topology::load(&cfg.topology)?;
    let (urgent, background) = pair_jobs(cfg, topo.hosts.len())?;
    let (mut alone_v, mut urgent_v, mut background_v, mut ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut excluded = Vec::new();
    let mut error = None;
    for rep in 0..cfg.repetitions.max(1) {
        eprintln!("priority: two jobs, repetition {rep}: the urgent job alone...");
        let (alone, h1) = run_on_fresh_fabric(&topo, std::slice::from_ref(&urgent), &cfg.settings)?;
        eprintln!("priority: two jobs, repetition {rep}: beside a background job...");
        let (both, h2) =
            run_on_fresh_fabric(&topo, &[urgent.clone(), background.clone()], &cfg.settings)?;
        if let Some(e) = alone.iter().chain(&both).find_map(|o| o.error.clone()) {
            excluded.push(format!("repetition {rep}: a job failed: {e}"));
            error.get_or_insert(e);
            continue;
        }
        if !(h1.valid && h2.valid) {
            excluded.push(format!(
                "repetition {rep}: the fabric fell behind its clock (late departures: alone \
                 {}/{}, beside {}/{})",
                h1.late, h1.departures, h2.late, h2.departures
            ));
            continue;
        }
        alone_v.push(alone[0].makespan_ms);
        urgent_v.push(both[0].makespan_ms);
        background_v.push(both[1].makespan_ms);
        ratios.push(both[0].makespan_ms / alone[0].makespan_ms);
    }
    Ok(PairResult {
        alone_ms: quantile(&alone_v, 0.5),
        urgent_ms: quantile(&urgent_v, 0.5),
        background_ms: quantile(&background_v, 0.5),
        urgent_vs_alone: quantile(&ratios, 0.5),
        valid: excluded.is_empty() && !ratios.is_empty(),
        ratios,
        excluded,
        error,
    })
}

/// The `q`-quantile (linear interpolation) of `v`; NaN when empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// The jobs of repetition `rep`: random priorities and placements, the same in every mode.
pub fn priority_jobs(
    cfg: &PriorityConfig,
    hosts: usize,
    rep: u32,
    mode: PriorityMode,
) -> Vec<JobPlan> {
    let mut rng = fastrand::Rng::with_seed(cfg.seed.wrapping_add(u64::from(rep) * 7919));
    // Distinct priorities in random order (as many as there are data queues; more jobs
    // share the last ones).
    let levels = usize::from(gradwire_qos::NUM_DATA_QUEUES);
    let mut priorities: Vec<u8> = (0..cfg.jobs).map(|i| i.min(levels - 1) as u8).collect();
    rng.shuffle(&mut priorities);
    (0..cfg.jobs)
        .map(|i| {
            let mut order: Vec<usize> = (0..hosts).collect();
            rng.shuffle(&mut order);
            let priority = priorities[i];
            JobPlan {
                job: 1 + i as u32,
                priority,
                dscp: match mode {
                    PriorityMode::Fifo => gradwire_qos::priority_dscp(0),
                    _ => gradwire_qos::priority_dscp(priority),
                },
                grant_class: match mode {
                    PriorityMode::Fifo => 0,
                    _ => priority,
                },
                servers: vec![order[0]],
                workers: order[1..=cfg.workers.min(hosts - 1)].to_vec(),
                strategy: match mode {
                    PriorityMode::PriorityTrees => Strategy::Rack,
                    _ => Strategy::Star,
                },
                shard_elems: (cfg.model_bytes / 4).max(1) as usize,
                iterations: cfg.iterations,
            }
        })
        .collect()
}

/// Per mode, the makespans of its valid jobs (the fabric kept its clock, every all-reduce
/// checked); the others are counted as excluded.
pub fn summarize_modes(modes: &[PriorityMode], results: &[PriorityResult]) -> Vec<ModeSummary> {
    modes
        .iter()
        .map(|m| {
            let of_mode = || results.iter().filter(|r| r.mode == m.name());
            let v: Vec<f64> = of_mode()
                .filter(|r| r.valid)
                .map(|r| r.makespan_ms)
                .collect();
            ModeSummary {
                mode: m.name(),
                jobs: v.len(),
                excluded: of_mode().filter(|r| !r.valid).count(),
                median_ms: quantile(&v, 0.5),
                p95_ms: quantile(&v, 0.95),
                max_ms: quantile(&v, 1.0),
            }
        })
        .collect()
}

/// Run the priority experiment.
pub fn run_priority(cfg: &PriorityConfig) -> Result<PriorityReport, ExperimentError> {
    let topo = Topology::load(&cfg.topology)?;
    if cfg.workers + 1 > topo.hosts.len() {
        return Err(ExperimentError::Other(format!(
            "a job of 1 server + {} workers needs more than the topology's {} hosts",
            cfg.workers,
            topo.hosts.len()
        )));
    }
    let mut results = Vec::new();
    for rep in 0..cfg.repetitions {
        for &mode in &cfg.modes {
            let jobs = priority_jobs(cfg, topo.hosts.len(), rep, mode);
            eprintln!("priority: repetition {rep}, {}...", mode.name());
            let (outcomes, health) = run_on_fresh_fabric(&topo, &jobs, &cfg.settings)?;
            eprintln!(
                "priority: valid {} (late {}/{} departures, lag p99 {:.0} us)",
                health.valid, health.late, health.departures, health.lag_p99_us
            );
            for (plan, o) in jobs.iter().zip(outcomes) {
                results.push(PriorityResult {
                    mode: mode.name(),
                    repetition: rep,
                    job: plan.job,
                    priority: plan.priority,
                    makespan_ms: o.makespan_ms,
                    valid: health.valid && o.error.is_none(),
                    fabric_valid: health.valid,
                    error: o.error,
                });
            }
        }
    }
    let summary = summarize_modes(&cfg.modes, &results);
    Ok(PriorityReport {
        topology: topo.name.clone(),
        jobs: cfg.jobs,
        workers: cfg.workers,
        model_bytes: cfg.model_bytes,
        iterations: cfg.iterations,
        results,
        summary,
        pair: if cfg.pair { Some(run_pair(cfg)?) } else { None },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_collective::aggregate::Contributors;

    /// A report of `elems` elements in blocks of `be` with the sets `contributors`.
    fn report(elems: usize, be: usize, contributors: Contributors) -> AllReduceReport {
        AllReduceReport {
            algorithm: "tree",
            elems,
            block_elems: be,
            complete_blocks: 0,
            blocks: elems.div_ceil(be),
            delivered_fraction: 1.0,
            rank_delivered: Vec::new(),
            elapsed: Duration::ZERO,
            bytes_sent: 0,
            contributors,
        }
    }

    /// What a correct sum all-reduce of [`input`] gives, block by block over `c`'s sets.
    fn reduced(elems: usize, be: usize, world: usize, it: u32, c: &Contributors) -> Vec<f32> {
        (0..elems)
            .map(|e| {
                let ranks = c.ranks(e / be);
                let sum: f32 = ranks.iter().map(|&r| input(r, it, e)).sum();
                if ranks.len() == world {
                    sum
                } else {
                    sum * (world as f32 / ranks.len() as f32)
                }
            })
            .collect()
    }

    #[test]
    fn a_complete_exact_sum_passes_and_anything_else_is_wrong() {
        let (elems, be, world) = (100usize, 16, 5);
        let all = Contributors::all(elems.div_ceil(be), world);
        let good = reduced(elems, be, world, 2, &all);
        let r = report(elems, be, all.clone());
        assert_eq!(check_all_reduce(&good, &r, world, 2, true), Ok(()));
        // A skipped contribution (one worker's input missing from one element).
        let mut skipped = good.clone();
        skipped[37] -= input(3, 2, 37);
        let e = check_all_reduce(&skipped, &r, world, 2, true).unwrap_err();
        assert!(
            e.contains("WRONG RESULT") && e.contains("element 37"),
            "{e}"
        );
        // A stale result (the previous iteration's).
        let stale = reduced(elems, be, world, 1, &all);
        assert!(check_all_reduce(&stale, &r, world, 2, true).is_err());
        // Nothing done at all: the rank's own input.
        let own: Vec<f32> = (0..elems).map(|e| input(2, 2, e)).collect();
        assert!(check_all_reduce(&own, &r, world, 2, true).is_err());
        // Short.
        assert!(check_all_reduce(&good[..50], &r, world, 2, true).is_err());
    }

    #[test]
    fn with_loss_blocks_are_checked_against_their_contributors() {
        let (elems, be, world) = (64, 16, 4);
        let mut c = Contributors::all(4, world);
        // Block 1 lost ranks 2 and 3.
        let mut partial = Contributors::none(4, world);
        for b in 0..4 {
            for r in 0..world {
                if b != 1 || r < 2 {
                    partial.insert(b, r);
                }
            }
        }
        let got = reduced(elems, be, world, 0, &partial);
        // Not exact: fine at p > 0 against the reported sets ...
        assert_eq!(
            check_all_reduce(&got, &report(elems, be, partial.clone()), world, 0, false),
            Ok(())
        );
        // ... but an error at p = 0, where every block must be complete.
        let e = check_all_reduce(&got, &report(elems, be, partial), world, 0, true).unwrap_err();
        assert!(e.contains("block 1"), "{e}");
        // Values that do not match the sets the report names.
        assert!(check_all_reduce(&got, &report(elems, be, c.clone()), world, 0, false).is_err());
        // An empty set is never a result.
        c = Contributors::none(4, world);
        assert!(check_all_reduce(&got, &report(elems, be, c), world, 0, false).is_err());
    }

    fn run(strategy: &str, ms: f64, valid: bool, error: Option<&str>) -> MlnetResult {
        let o = JobOutcome {
            job: 1,
            makespan_ms: ms,
            iteration_ms_mean: ms,
            cross_rack_edges: 0,
            error: error.map(str::to_owned),
        };
        let health = FabricHealth {
            valid,
            ..FabricHealth::unknown()
        };
        MlnetResult::of(strategy.parse().unwrap(), 1, &o, health)
    }

    #[test]
    fn ratios_to_star_come_from_valid_runs_only() {
        let mut r = vec![
            run("star", 100.0, true, None),
            run("rack", 50.0, true, None),
            run("binary", 10.0, false, None),
            run("d=3", f64::NAN, true, Some("rank 2: WRONG RESULT")),
        ];
        relative_to_star(&mut r);
        assert_eq!(r[1].vs_star, 0.5);
        assert!(
            r[2].vs_star.is_nan(),
            "a run that fell behind has no figure"
        );
        assert!(
            !r[3].valid && r[3].fabric.valid,
            "a run with an error is not valid, though its fabric kept its clock"
        );
        // STAR not valid: no ratio at all.
        r[0].valid = false;
        relative_to_star(&mut r);
        assert!(r.iter().all(|x| x.vs_star.is_nan()));
    }

    #[test]
    fn mode_summaries_leave_out_invalid_jobs_and_count_them() {
        let job = |mode: PriorityMode, ms: f64, valid: bool| PriorityResult {
            mode: mode.name(),
            repetition: 0,
            job: 1,
            priority: 0,
            makespan_ms: ms,
            valid,
            fabric_valid: valid,
            error: None,
        };
        let results = vec![
            job(PriorityMode::Fifo, 100.0, true),
            job(PriorityMode::Fifo, 1.0, false),
            job(PriorityMode::Fifo, 300.0, true),
            job(PriorityMode::Priority, 5.0, false),
        ];
        let s = summarize_modes(&[PriorityMode::Fifo, PriorityMode::Priority], &results);
        assert_eq!((s[0].jobs, s[0].excluded), (2, 1));
        assert_eq!(s[0].median_ms, 200.0);
        assert_eq!((s[1].jobs, s[1].excluded), (0, 1));
        assert!(s[1].median_ms.is_nan());
    }
}
