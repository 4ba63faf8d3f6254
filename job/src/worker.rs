//! One rank of a collective job (`gradwire job worker`), started by whatever launcher the
//! cluster uses (torchrun, Slurm `srun`, Open MPI `mpirun`, a PMI launcher, or `gradwire job
//! run`): the rank and world size come from the launcher's variables, rank 0's rendezvous
//! address from `MASTER_ADDR`/`MASTER_PORT` or the job file. Each iteration all-reduces one
//! tensor per layer of a model file and checks every element of every result
//! ([`crate::workload`]).
//!
//! Every wait is bounded (`--timeout`), so a dead or missing rank ends the job with an error
//! naming it instead of a hang.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use gradwire::flow::SenderConfig;
use gradwire::job_secret::load_secret;
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::TransferConfig;
use gradwire_collective::aggregate::ReduceOp;
use gradwire_collective::comm::{
    Algorithm, AllReduceOptions, AllReduceReport, CommConfig, Communicator, TensorMut,
};
use gradwire_collective::group::{AllReduceAlgo, GroupConfig, GroupReduceOptions, PendingGroup};
use gradwire_collective::job::{JobSpec, LaunchEnv};
use gradwire_collective::link::{ring_edges, tree_edges, Links, NetLinkConfig};
use gradwire_collective::tree::{ParseStrategyError, Strategy, Tree};

use crate::error::Error;
use crate::workload::{
    check_exact, check_named, input, model_layers, residue_sums, LayerWork, Site,
};

/// The job id when neither a job file nor `--job` gives one.
pub const DEFAULT_JOB: u32 = 1;
/// Rank 0's rendezvous port when nothing names one (a job of one rank; `job run` when the
/// job file names no master).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Longest idle time of one transfer (no data or control progress at all).
const MAX_IDLE: Duration = Duration::from_secs(5);
/// What a worker's line per iteration starts with after `rank R` ([`iteration_line`]);
/// `job run` counts them.
pub const ITERATION_MARK: &str = ": iteration ";

/// An all-reduce algorithm: the ring, the two-phase all-reduce, the message layer's choice
/// between them, or a tree of a strategy (rooted at rank 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobAlgorithm {
    /// The ring.
    Ring,
    /// The two-phase (all-to-all) all-reduce, on the message layer.
    Direct,
    /// Two-phase up to 32 KiB (or two ranks), ring above, on the message layer.
    Auto,
    /// A tree of this strategy (on the flow transport).
    Tree(Strategy),
}

impl std::fmt::Display for JobAlgorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobAlgorithm::Ring => f.write_str("ring"),
            JobAlgorithm::Direct => f.write_str("direct"),
            JobAlgorithm::Auto => f.write_str("auto"),
            JobAlgorithm::Tree(s) => write!(f, "{s}"),
        }
    }
}

impl FromStr for JobAlgorithm {
    type Err = String;

    /// "ring", "direct", "auto", "star", "rack", "binary" or "d=N": what [`JobAlgorithm`]'s
    /// `Display` writes.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ring" => return Ok(JobAlgorithm::Ring),
            "direct" => return Ok(JobAlgorithm::Direct),
            "auto" => return Ok(JobAlgorithm::Auto),
            _ => {}
        }
        s.parse()
            .map(JobAlgorithm::Tree)
            .map_err(|e: ParseStrategyError| format!("{e}, or \"ring\", \"direct\", \"auto\""))
    }
}

/// What every rank of a job does; `gradwire job run` passes these on to its workers.
#[derive(Debug, Clone)]
pub struct JobOptions {
    /// All-reduce algorithm.
    pub algorithm: JobAlgorithm,
    /// Model layer file: one all-reduce per layer and iteration.
    pub model: PathBuf,
    /// Tensor size scale (1 = the model's real gradient sizes).
    pub scale: f64,
    /// Iterations.
    pub iterations: u32,
    /// Loss bound p of every transfer (0 = reliable: results are checked to be exact).
    pub loss_bound: f64,
    /// Sum or average over the ranks.
    pub op: ReduceOp,
    /// Line rate every sender never exceeds, bit/s.
    pub rate: u64,
    /// Longest wait, in seconds, for the rendezvous, each link, and a peer.
    pub timeout: f64,
}

/// One rank: what the launcher did not say.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Job file: job id, master, and each rank's host and rack.
    pub job_file: Option<PathBuf>,
    /// This rank's IP address (default: the job file's entry, else the address this host
    /// reaches the master from).
    pub host: Option<IpAddr>,
    /// Job id without a job file (with one, it must agree).
    pub job: Option<u32>,
    /// The job secret's key file (or `GRADWIRE_JOB_SECRET`).
    pub secret_file: Option<PathBuf>,
    /// What every rank does.
    pub opts: JobOptions,
}

/// One iteration of a worker's report.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct IterationReport {
    pub iteration: u32,
    /// Wall time of the iteration's all-reduces.
    pub ms: f64,
    /// Lowest delivered fraction over the iteration's layers.
    pub delivered_fraction_min: f64,
    /// Payload bytes this rank sent.
    pub bytes_sent: u64,
}

/// What `job worker --json` prints.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WorkerReport {
    pub rank: usize,
    pub world: usize,
    pub launcher: String,
    pub job: u32,
    pub host: IpAddr,
    pub master: SocketAddr,
    pub algorithm: String,
    pub op: String,
    pub loss_bound: f64,
    pub model: String,
    pub scale: f64,
    pub iterations: Vec<IterationReport>,
    pub layers: usize,
    /// Elements all-reduced per iteration (f32).
    pub elements: u64,
    /// Every element of every result was checked: the exact sum (or average) with `p = 0`,
    /// the average of the contributions the report names otherwise.
    pub verified: bool,
}

/// The name of a reduction in reports and on the command line.
pub fn op_name(op: ReduceOp) -> &'static str {
    op.name()
}

/// `value` seconds of `--what`, if a positive number.
pub fn seconds(what: &'static str, value: f64) -> Result<Duration, Error> {
    if value.is_finite() && value > 0.0 && value < 1e7 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(Error::Seconds { what, value })
    }
}

/// The line a worker prints after rank `rank`'s iteration `it` of `iterations`
/// (`rank R` + [`ITERATION_MARK`] + ...).
pub fn iteration_line(rank: usize, it: &IterationReport, iterations: u32) -> String {
    format!(
        "rank {rank}{ITERATION_MARK}{}/{iterations}: {:.1} ms, delivered min {:.3}%",
        it.iteration,
        it.ms,
        100.0 * it.delivered_fraction_min
    )
}

/// The local address the kernel would use towards `master` (a connected UDP socket sends
/// nothing).
fn local_ip_towards(master: SocketAddr) -> Result<IpAddr, Error> {
    let err = |source| Error::LocalAddr { master, source };
    let any: SocketAddr = if master.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(any).map_err(err)?;
    s.connect(master).map_err(err)?;
    Ok(s.local_addr().map_err(err)?.ip())
}

/// A worker started by `job run` asks the kernel for SIGKILL when that process dies
/// ([`gradwire_launch::die_with_launcher`]), so a `job run` killed outright (SIGKILL, no
/// cleanup of its own) leaves no rank running. Call it first thing; nothing to do when no
/// launcher of ours started this process.
pub fn die_with_launcher() -> Result<(), Error> {
    gradwire_launch::die_with_launcher().map_err(|e| match e {
        gradwire_launch::DeathError::Signal(e) => Error::ParentDeathSignal(e),
        gradwire_launch::DeathError::LauncherGone { pid } => Error::LauncherGone { pid },
    })
}

/// Run one rank: set up from the launcher's variables and `w`, all-reduce and check every
/// iteration (`progress` gets each iteration's [`iteration_line`]), then a final barrier.
/// The report says `verified` only once every element of every result was checked.
pub fn run_worker(w: &WorkerSpec, mut progress: impl FnMut(&str)) -> Result<WorkerReport, Error> {
    let env = LaunchEnv::from_env()?;
    let (rank, world) = (env.rank, env.world);
    let spec = w.job_file.as_deref().map(JobSpec::load).transpose()?;
    if let (Some(s), Some(f)) = (&spec, &w.job_file) {
        if s.world() != world {
            return Err(Error::WorldMismatch {
                file: f.display().to_string(),
                file_world: s.world(),
                env_world: world,
                launcher: env.launcher.to_string(),
            });
        }
    }
    let job = match (&spec, w.job) {
        (Some(s), Some(arg)) if arg != s.job => {
            return Err(Error::JobIdMismatch { arg, file: s.job })
        }
        (Some(s), _) => s.job,
        (None, arg) => arg.unwrap_or(DEFAULT_JOB),
    };
    let master = env
        .master
        .or_else(|| spec.as_ref().and_then(|s| s.master))
        // A job of one rank has nobody to meet: the rendezvous does no I/O.
        .or_else(|| (world == 1).then(|| (Ipv4Addr::LOCALHOST, DEFAULT_MASTER_PORT).into()))
        .ok_or(Error::NoMaster)?;
    let ip = match w
        .host
        .or_else(|| spec.as_ref().and_then(|s| s.rank(rank)).map(|r| r.host))
    {
        Some(ip) => ip,
        None => local_ip_towards(master)?,
    };
    let rack_of = spec
        .as_ref()
        .map_or_else(|| vec![0; world], JobSpec::rack_of);
    let o = &w.opts;
    let timeout = seconds("timeout", o.timeout)?;
    let (model_name, layer_sizes) = model_layers(&o.model, o.scale)?;
    let op = o.op;
    let bound = LossBound::from_fraction(o.loss_bound)?;
    let reliable = bound == LossBound::RELIABLE;
    let secret = load_secret(w.secret_file.as_deref())?;

    let coll = |source| Error::Collective {
        rank,
        world,
        source,
    };
    let algorithm = match o.algorithm {
        JobAlgorithm::Ring | JobAlgorithm::Direct | JobAlgorithm::Auto => Algorithm::Ring,
        JobAlgorithm::Tree(strategy) => {
            let members: Vec<usize> = (0..world).collect();
            Algorithm::Tree(
                Tree::build(strategy, 0, &members, &rack_of).map_err(|source| Error::Tree {
                    algorithm: o.algorithm.to_string(),
                    source,
                })?,
            )
        }
    };
    // The barrier goes around the ring whatever the all-reduce algorithm.
    let mut edges = ring_edges(world);
    if let Algorithm::Tree(t) = &algorithm {
        edges.extend(tree_edges(t));
    }

    let all = 0..world;
    let layers: Vec<LayerWork> = layer_sizes
        .into_iter()
        .enumerate()
        .map(|(l, (name, elems))| {
            let mut want = residue_sums(all.clone(), l);
            if op == ReduceOp::Average && world > 1 {
                let f = 1.0 / world as f32;
                want.iter_mut().for_each(|w| *w *= f);
            }
            LayerWork { name, elems, want }
        })
        .collect();
    let elements: u64 = layers.iter().map(|l| l.elems as u64).sum();

    // Every job runs on the message layer (ring, two-phase, or the tree); an authenticated
    // one seals every datagram with its pair of ranks' key.
    let layer_algo = match o.algorithm {
        JobAlgorithm::Ring | JobAlgorithm::Tree(_) => Some(AllReduceAlgo::Ring),
        JobAlgorithm::Direct => Some(AllReduceAlgo::Direct),
        JobAlgorithm::Auto => Some(AllReduceAlgo::Auto),
    };
    let pending_group = match layer_algo {
        Some(_) => {
            let mut g = GroupConfig::new(job, rank, world, ip, timeout);
            g.endpoint.auth = secret
                .as_ref()
                .map(|s| std::sync::Arc::new(gradwire::auth::JobKey::new(s)));
            Some(PendingGroup::bind(g).map_err(coll)?)
        }
        None => None,
    };
    let net = NetLinkConfig {
        connect_timeout: timeout,
        msg_port: pending_group.as_ref().map(|g| g.address().port()),
        msg_member: pending_group.as_ref().and_then(PendingGroup::member),
        ..NetLinkConfig::default()
    };
    let links = Links::connect(job, rank, world, ip, master, &edges, secret.as_ref(), &net)
        .map_err(coll)?;
    let group = match pending_group {
        None => None,
        Some(g) => Some(g.start_from(&links).map_err(coll)?),
    };
    // The job's priority (job file; 0 = most urgent) picks the switch queue of its data and
    // its receivers' class in their host's grant pool (MLNET §3.2).
    let priority = spec.as_ref().map_or(0, |s| s.priority);
    let cfg = CommConfig {
        transfer: TransferConfig {
            sender: SenderConfig {
                priority,
                ..SenderConfig::new(o.rate)
            },
            idle_timeout: timeout.min(MAX_IDLE),
            ..TransferConfig::default()
        },
        loss_bound: bound,
        op_timeout: timeout,
        ..CommConfig::default()
    };
    // The flow transport's communicator only when the message layer does not run the job
    // (its links stay up meanwhile: closing them would look like a death to the peers).
    let (mut comm, _links) = match group {
        Some(_) => (None, Some(links)),
        None => (
            Some(Communicator::new(links, job, cfg).map_err(coll)?),
            None,
        ),
    };

    let mut report = WorkerReport {
        rank,
        world,
        launcher: env.launcher.to_string(),
        job,
        host: ip,
        master,
        algorithm: o.algorithm.to_string(),
        op: op_name(o.op).to_owned(),
        loss_bound: o.loss_bound,
        model: model_name,
        scale: o.scale,
        iterations: Vec::new(),
        layers: layers.len(),
        elements,
        verified: false,
    };
    for iteration in 1..=o.iterations {
        let started = Instant::now();
        let mut delivered_min = 1.0f64;
        let mut bytes_sent = 0;
        for (l, layer) in layers.iter().enumerate() {
            let mut t = Tensor::zeros(DType::F32, layer.elems);
            if let Some(v) = t.as_f32_mut() {
                v.iter_mut()
                    .enumerate()
                    .for_each(|(e, x)| *x = input(rank, l, e));
            }
            let opts = AllReduceOptions {
                op,
                loss_bound: Some(bound),
                layer: u16::try_from(l).unwrap_or(u16::MAX),
                dscp: gradwire_qos::priority_dscp(priority),
                algorithm: algorithm.clone(),
            };
            let r = match (&group, &mut comm, layer_algo) {
                (Some(g), _, Some(flat)) => {
                    let go = GroupReduceOptions {
                        op,
                        loss_bound: o.loss_bound,
                        algorithm: flat,
                        dscp: opts.dscp,
                        layer: opts.layer,
                        ..GroupReduceOptions::default()
                    };
                    let before = g.stats().core.payload_bytes_sent;
                    let out = match &algorithm {
                        Algorithm::Tree(tree) => {
                            g.all_reduce_tree(TensorMut::from(&mut t), tree, &go)
                        }
                        Algorithm::Ring => g.all_reduce(TensorMut::from(&mut t), &go),
                    }
                    .map_err(coll)?;
                    let sent = g.stats().core.payload_bytes_sent.saturating_sub(before);
                    AllReduceReport::of_outcome(out, layer.elems, g.block_bytes() / 4, world, sent)
                }
                (_, Some(comm), _) => comm.all_reduce(&mut t, &opts).map_err(coll)?,
                _ => unreachable_engine(rank, world)?,
            };
            let at = Site {
                rank,
                world,
                iteration,
                layer: l,
                work: layer,
                op,
            };
            if reliable {
                check_exact(&at, &t, &r)?;
            } else {
                check_named(&at, &t, &r)?;
            }
            delivered_min = delivered_min.min(r.delivered_fraction);
            bytes_sent += r.bytes_sent;
        }
        let it = IterationReport {
            iteration,
            ms: started.elapsed().as_secs_f64() * 1e3,
            delivered_fraction_min: delivered_min,
            bytes_sent,
        };
        progress(&iteration_line(rank, &it, o.iterations));
        report.iterations.push(it);
    }
    match (&group, &mut comm) {
        (Some(g), _) => g.barrier().map_err(coll)?,
        (_, Some(comm)) => comm.barrier().map_err(coll)?,
        _ => unreachable_engine(rank, world)?,
    }
    report.verified = true;
    Ok(report)
}

/// Neither engine: set-up makes one or the other, so this is a bug, reported, not a panic.
fn unreachable_engine<T>(rank: usize, world: usize) -> Result<T, Error> {
    Err(Error::Collective {
        rank,
        world,
        source: gradwire_collective::error::CollectiveError::Unusable(
            "no collective engine was set up (a bug: please report it)".into(),
        ),
    })
}
