//! `gradwire job`: collective jobs over gradwire-collective.
//!
//! - `job worker` is one rank, started by whatever launcher the cluster uses (torchrun, Slurm
//!   `srun`, Open MPI `mpirun`, a PMI launcher): the rank and world size come from the
//!   launcher's variables, rank 0's rendezvous address from `MASTER_ADDR`/`MASTER_PORT` or the
//!   job file. Each iteration all-reduces one tensor per layer of a model file, with values
//!   that are a known function of (rank, layer, element), so every result is checked: exactly
//!   with `p = 0`, against the contributors the report names otherwise. A wrong result is an
//!   error, not a statistic.
//! - `job run` plays the launcher on one machine: one network namespace per host address of a
//!   job file on a private bridge, every rank its own `job worker` process in its host's
//!   namespace with torchrun's variables, an overall deadline, and teardown on every path.
//!
//! Every wait in a worker is bounded (`--timeout`), so a dead or missing rank ends the job
//! with an error naming it instead of a hang.

use std::collections::BTreeMap;
use std::error::Error;
use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire::flow::SenderConfig;
use gradwire::job_secret::load_secret;
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::TransferConfig;
use gradwire_collective::aggregate::ReduceOp;
use gradwire_collective::comm::{
    Algorithm, AllReduceOptions, AllReduceReport, CommConfig, Communicator,
};
use gradwire_collective::error::CollectiveError;
use gradwire_collective::job::{JobError, JobSpec, LaunchEnv, LAUNCHER_VAR};
use gradwire_collective::link::{ring_edges, tree_edges, Links, NetLinkConfig};
use gradwire_collective::tree::Tree;
use gradwire_netns::testbed::host_mac;
use gradwire_netns::{IpBatch, NamespaceSet, Veth, VethEnd};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{JobAlgorithm, JobOp, JobRunArgs, JobWorkerArgs};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// Period of the input values in the element index (see [`input`]).
const PERIOD: usize = 23;
/// The job id when neither a job file nor `--job` gives one.
const DEFAULT_JOB: u32 = 1;
/// Rendezvous port of `job run` when the job file names no master.
const DEFAULT_MASTER_PORT: u16 = 29500;
/// Largest scale: more is a typo, not a bigger model.
const MAX_SCALE: f64 = 100.0;
/// Longest idle time of one transfer (no data or control progress at all).
const MAX_IDLE: Duration = Duration::from_secs(5);
/// Hosts of a `job run`: one veth port each on the bridge, MACs from the netns kit.
const MAX_RUN_HOSTS: usize = gradwire_netns::testbed::MAX_HOSTS;
/// The host interface and the bridge of `job run`'s namespaces.
const HOST_IF: &str = "gw0";
const BRIDGE: &str = "br0";
/// Prefix length of `job run`'s addresses: all of 198.18.0.0/15 is on the one bridge.
const RUN_PREFIX_LEN: u8 = 15;
/// What a worker prints per iteration starts with this after `rank R`; `job run` counts them.
const ITERATION_MARK: &str = ": iteration ";
/// `job run` sets this in its workers' environment to its own pid: a worker that finds it
/// dies with that process (see [`die_with_launcher`]).
const PARENT_VAR: &str = "GRADWIRE_JOB_RUN_PARENT";
/// What `job run` prints on stderr once every rank has finished its first iteration (the
/// job is under way: tests wait for it instead of guessing a time).
const ALL_ITERATING: &str = "every rank is iterating";

/// Why a job command failed (besides the collective layer's and the job file's own errors).
#[derive(Debug, thiserror::Error)]
pub enum JobCmdError {
    #[error(
        "job file {file} lists {file_world} ranks but the launcher ({launcher}) started \
         {env_world}: start as many ranks as the job file lists, or fix the file"
    )]
    WorldMismatch {
        file: String,
        file_world: usize,
        env_world: usize,
        launcher: String,
    },
    #[error(
        "no rendezvous address: set MASTER_ADDR and MASTER_PORT (rank 0's address and a free \
         port), or give a job file with master = \"IP:PORT\""
    )]
    NoMaster,
    #[error("--job {arg} disagrees with the job file's job = {file}: drop --job or fix the file")]
    JobIdMismatch { arg: u32, file: u32 },
    #[error(
        "cannot find this host's address towards the master {master}: {source}; pass --host \
         with this rank's IP address"
    )]
    LocalAddr {
        master: SocketAddr,
        source: std::io::Error,
    },
    #[error("rank {rank} of {world}: {source}")]
    Collective {
        rank: usize,
        world: usize,
        source: CollectiveError,
    },
    #[error(
        "rank {rank}: WRONG RESULT in iteration {iteration}, layer {layer} ({name}), element \
         {elem}: got {got}, expected {want} ({what}); the all-reduce is broken"
    )]
    Verify {
        rank: usize,
        iteration: u32,
        layer: usize,
        name: String,
        elem: usize,
        got: f32,
        want: f32,
        what: String,
    },
    #[error(
        "rank {rank}: iteration {iteration}, layer {layer} ({name}): {complete} of {blocks} \
         blocks complete with loss bound 0; a reliable all-reduce must sum every rank"
    )]
    Incomplete {
        rank: usize,
        iteration: u32,
        layer: usize,
        name: String,
        complete: usize,
        blocks: usize,
    },
    #[error(
        "--scale {0}: use a number above 0 and at most {MAX_SCALE} (1 = the model's real sizes)"
    )]
    Scale(f64),
    #[error("--{what} {value}: give a positive number of seconds")]
    Seconds { what: &'static str, value: f64 },
    #[error("model {0}: it has no layers; give a model file with [[layers]] entries")]
    NoLayers(String),
    /// The model file's own message names the file.
    #[error("model {0}")]
    Model(Box<gradwire_control::model::ModelError>),
    #[error("the tree for --algorithm {algorithm}: {source}")]
    Tree {
        algorithm: String,
        source: gradwire_collective::tree::TreeError,
    },
    #[error(
        "job file {file}: rank {rank}'s host {host} is not a host address in 198.18.0.0/15: \
         `gradwire job run` puts every host in its own network namespace on a private bridge \
         and only uses the benchmarking range there; use addresses 198.18.0.1-198.19.255.254, \
         or start the ranks on real hosts with `gradwire job worker`"
    )]
    NotBenchmarkRange {
        file: String,
        rank: usize,
        host: IpAddr,
    },
    #[error(
        "job file {file}: master {master} is not rank 0's host {host}: rank 0 serves the \
         rendezvous at the master address, so use {host}:PORT"
    )]
    MasterNotRank0 {
        file: String,
        master: SocketAddr,
        host: IpAddr,
    },
    #[error(
        "job file {file}: {hosts} distinct hosts; `gradwire job run` builds at most \
         {MAX_RUN_HOSTS} namespaces"
    )]
    TooManyHosts { file: String, hosts: usize },
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("cannot start rank {rank}: {source}")]
    Spawn { rank: usize, source: std::io::Error },
    #[error("{}", failure_message(.failed, .stopped))]
    RankFailed {
        /// (rank, how it ended, what it printed on stderr).
        failed: Vec<(usize, String, String)>,
        /// Ranks stopped because of the failure.
        stopped: Vec<usize>,
    },
    #[error(
        "the job did not finish within --deadline {secs}s: rank(s) {running:?} still running; \
         stopped them (raise --deadline for larger models or more iterations)"
    )]
    Deadline { secs: f64, running: Vec<usize> },
    #[error("interrupted: stopped every rank and removed the namespaces")]
    Interrupted,
    #[error("cannot ask to die with the `job run` that started this rank: {0}")]
    ParentDeathSignal(nix::Error),
    #[error("the `job run` that started this rank (pid {pid}) is gone: not starting without it")]
    LauncherGone { pid: u32 },
    #[error("rank {rank} exited 0 but its report is not valid JSON ({source}): {stdout:?}")]
    BadReport {
        rank: usize,
        source: serde_json::Error,
        stdout: String,
    },
}

fn failure_message(failed: &[(usize, String, String)], stopped: &[usize]) -> String {
    let mut m = String::new();
    for (i, (rank, how, stderr)) in failed.iter().enumerate() {
        if i > 0 {
            m.push_str("; ");
        }
        m.push_str(&format!("rank {rank} failed ({how})"));
        let said = stderr.trim();
        if !said.is_empty() {
            m.push_str(&format!(": {said}"));
        }
    }
    if !stopped.is_empty() {
        m.push_str(&format!("; stopped rank(s) {stopped:?}"));
    }
    m
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

/// Rank `rank`'s value of element `e` of layer `layer`: small integers, so f32 sums over any
/// number of ranks (up to 4096 x 11 < 2^24) are exact in any order. Periodic in `e`.
fn input(rank: usize, layer: usize, e: usize) -> f32 {
    (((rank % PERIOD) * 7 + (layer % PERIOD) * 5 + (e % PERIOD) * 3) % PERIOD) as f32 - 11.0
}

/// Per residue of the element index, the sum of `input` over `ranks`.
fn residue_sums(ranks: impl Iterator<Item = usize> + Clone, layer: usize) -> [f32; PERIOD] {
    let mut s = [0.0f32; PERIOD];
    for (k, slot) in s.iter_mut().enumerate() {
        *slot = ranks.clone().map(|r| input(r, layer, k)).sum();
    }
    s
}

/// One layer of the workload.
#[derive(Debug, Clone)]
struct LayerWork {
    name: String,
    elems: usize,
    /// The exact p = 0 result per residue (sum, or sum times 1/world as the library scales).
    want: [f32; PERIOD],
}

fn seconds(what: &'static str, value: f64) -> Result<Duration, JobCmdError> {
    if value.is_finite() && value > 0.0 && value < 1e7 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(JobCmdError::Seconds { what, value })
    }
}

fn reduce_op(op: JobOp) -> ReduceOp {
    match op {
        JobOp::Sum => ReduceOp::Sum,
        JobOp::Average => ReduceOp::Average,
    }
}

fn op_name(op: JobOp) -> &'static str {
    match op {
        JobOp::Sum => "sum",
        JobOp::Average => "average",
    }
}

/// The model's layers at `scale` (at least one element each).
fn model_layers(path: &Path, scale: f64) -> Result<(String, Vec<(String, usize)>), JobCmdError> {
    if !(scale.is_finite() && scale > 0.0 && scale <= MAX_SCALE) {
        return Err(JobCmdError::Scale(scale));
    }
    let shown = path.display().to_string();
    let model =
        gradwire_control::model::load_model(path).map_err(|e| JobCmdError::Model(Box::new(e)))?;
    if model.layers.is_empty() {
        return Err(JobCmdError::NoLayers(shown));
    }
    let layers = model
        .layers
        .iter()
        .map(|l| {
            // Saturating float-to-int; at most 100 x a u64 count, far beyond any memory.
            let elems = (l.params as f64 * scale).round().max(1.0) as usize;
            (l.name.clone(), elems)
        })
        .collect();
    Ok((model.name, layers))
}

/// The local address the kernel would use towards `master` (a connected UDP socket sends
/// nothing).
fn local_ip_towards(master: SocketAddr) -> Result<IpAddr, JobCmdError> {
    let err = |source| JobCmdError::LocalAddr { master, source };
    let any: SocketAddr = if master.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(any).map_err(err)?;
    s.connect(master).map_err(err)?;
    Ok(s.local_addr().map_err(err)?.ip())
}

/// A worker started by `job run` (its pid in [`PARENT_VAR`]) asks the kernel for SIGKILL when
/// that process dies, so a `job run` killed outright (SIGKILL, no cleanup of its own) leaves
/// no rank running. `ip netns exec` execs the worker without forking, so `job run` is this
/// process's parent; it spawns the ranks from its main thread, which lives as long as it does
/// (the signal follows the thread that forked). If `job run` died before the request took
/// effect, the parent is already someone else: stop here.
fn die_with_launcher() -> Result<(), JobCmdError> {
    let Some(pid) = std::env::var(PARENT_VAR)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    else {
        return Ok(());
    };
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .map_err(JobCmdError::ParentDeathSignal)?;
    if i64::from(nix::unistd::getppid().as_raw()) != i64::from(pid) {
        return Err(JobCmdError::LauncherGone { pid });
    }
    Ok(())
}

/// `gradwire job worker`.
pub fn worker(a: &JobWorkerArgs) -> Res {
    die_with_launcher()?;
    let env = LaunchEnv::from_env()?;
    let (rank, world) = (env.rank, env.world);
    let spec = a.job_file.as_deref().map(JobSpec::load).transpose()?;
    if let (Some(s), Some(f)) = (&spec, &a.job_file) {
        if s.world() != world {
            return Err(JobCmdError::WorldMismatch {
                file: f.display().to_string(),
                file_world: s.world(),
                env_world: world,
                launcher: env.launcher.to_string(),
            }
            .into());
        }
    }
    let job = match (&spec, a.job) {
        (Some(s), Some(arg)) if arg != s.job => {
            return Err(JobCmdError::JobIdMismatch { arg, file: s.job }.into())
        }
        (Some(s), _) => s.job,
        (None, arg) => arg.unwrap_or(DEFAULT_JOB),
    };
    let master = env
        .master
        .or_else(|| spec.as_ref().and_then(|s| s.master))
        // A job of one rank has nobody to meet: the rendezvous does no I/O.
        .or_else(|| (world == 1).then(|| (Ipv4Addr::LOCALHOST, DEFAULT_MASTER_PORT).into()))
        .ok_or(JobCmdError::NoMaster)?;
    let ip = match a
        .host
        .or_else(|| spec.as_ref().and_then(|s| s.rank(rank)).map(|r| r.host))
    {
        Some(ip) => ip,
        None => local_ip_towards(master)?,
    };
    let rack_of = spec
        .as_ref()
        .map_or_else(|| vec![0; world], JobSpec::rack_of);
    let o = &a.opts;
    let timeout = seconds("timeout", o.timeout)?;
    let (model_name, layer_sizes) = model_layers(&o.model, o.scale)?;
    let op = reduce_op(o.op);
    let bound = LossBound::from_fraction(o.loss_bound)?;
    let reliable = bound == LossBound::RELIABLE;
    let secret = load_secret(a.secret_file.as_deref())?;

    let coll = |source| JobCmdError::Collective {
        rank,
        world,
        source,
    };
    let algorithm = match o.algorithm {
        JobAlgorithm::Ring => Algorithm::Ring,
        JobAlgorithm::Tree(strategy) => {
            let members: Vec<usize> = (0..world).collect();
            Algorithm::Tree(
                Tree::build(strategy, 0, &members, &rack_of).map_err(|source| {
                    JobCmdError::Tree {
                        algorithm: o.algorithm.to_string(),
                        source,
                    }
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

    let net = NetLinkConfig {
        connect_timeout: timeout,
        ..NetLinkConfig::default()
    };
    let links = Links::connect(job, rank, world, ip, master, &edges, secret.as_ref(), &net)
        .map_err(coll)?;
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
    let mut comm = Communicator::new(links, job, cfg).map_err(coll)?;

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
            let r = comm.all_reduce(&mut t, &opts).map_err(coll)?;
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
        let line = format!(
            "rank {rank}{ITERATION_MARK}{iteration}/{}: {:.1} ms, delivered min {:.3}%",
            o.iterations,
            it.ms,
            100.0 * it.delivered_fraction_min
        );
        if a.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
        report.iterations.push(it);
    }
    comm.barrier().map_err(coll)?;
    report.verified = true;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_worker_table(&report);
    }
    Ok(())
}

/// Where a result is checked.
struct Site<'a> {
    rank: usize,
    world: usize,
    iteration: u32,
    layer: usize,
    work: &'a LayerWork,
    op: ReduceOp,
}

impl Site<'_> {
    fn wrong(&self, elem: usize, got: f32, want: f32, what: String) -> JobCmdError {
        JobCmdError::Verify {
            rank: self.rank,
            iteration: self.iteration,
            layer: self.layer,
            name: self.work.name.clone(),
            elem,
            got,
            want,
            what,
        }
    }
}

/// `p = 0`: every block complete and every element exactly the expected value.
fn check_exact(at: &Site<'_>, t: &Tensor, r: &AllReduceReport) -> Result<(), JobCmdError> {
    if r.complete_blocks != r.blocks {
        return Err(JobCmdError::Incomplete {
            rank: at.rank,
            iteration: at.iteration,
            layer: at.layer,
            name: at.work.name.clone(),
            complete: r.complete_blocks,
            blocks: r.blocks,
        });
    }
    let got = t.as_f32().unwrap_or(&[]);
    if got.len() != at.work.elems {
        return Err(at.wrong(got.len(), f32::NAN, f32::NAN, "result length".into()));
    }
    for (e, &g) in got.iter().enumerate() {
        let want = at.work.want[e % PERIOD];
        if g != want {
            let what = match at.op {
                ReduceOp::Sum => format!("the exact sum over ranks 0..{}", at.world),
                ReduceOp::Average => format!("the exact average over ranks 0..{}", at.world),
            };
            return Err(at.wrong(e, g, want, what));
        }
    }
    Ok(())
}

/// `p > 0`: every block is the average of exactly the contributions the report names (times
/// the world size for a sum), within f32 rounding.
fn check_named(at: &Site<'_>, t: &Tensor, r: &AllReduceReport) -> Result<(), JobCmdError> {
    let got = t.as_f32().unwrap_or(&[]);
    let be = r.block_elems.max(1);
    for b in 0..r.blocks {
        let ranks = r.contributors.ranks(b);
        if ranks.is_empty() {
            return Err(at.wrong(
                b * be,
                f32::NAN,
                f32::NAN,
                format!("block {b} has no contributor"),
            ));
        }
        let sums = residue_sums(ranks.iter().copied(), at.layer);
        let n = ranks.len() as f32;
        for e in b * be..((b + 1) * be).min(got.len()) {
            let mean = sums[e % PERIOD] / n;
            let want = match at.op {
                ReduceOp::Average => mean,
                ReduceOp::Sum => mean * at.world as f32,
            };
            if (got[e] - want).abs() > 1e-4 * want.abs().max(1.0) {
                return Err(at.wrong(
                    e,
                    got[e],
                    want,
                    format!("from the contributions of ranks {ranks:?}"),
                ));
            }
        }
    }
    Ok(())
}

fn print_worker_table(r: &WorkerReport) {
    println!(
        "rank {} of {} ({}), job {}, host {} (master {}): {} all-reduce ({}) of {} x {}: {} \
         layers, {} f32 elements per iteration, loss bound {}",
        r.rank,
        r.world,
        r.launcher,
        r.job,
        r.host,
        r.master,
        r.algorithm,
        r.op,
        r.model,
        r.scale,
        r.layers,
        r.elements,
        r.loss_bound
    );
    println!(
        "{:>9} {:>10} {:>14} {:>10}",
        "iteration", "ms", "delivered min", "sent MB"
    );
    for it in &r.iterations {
        println!(
            "{:>9} {:>10.1} {:>13.3}% {:>10.3}",
            it.iteration,
            it.ms,
            100.0 * it.delivered_fraction_min,
            it.bytes_sent as f64 / 1e6
        );
    }
    let exact = r.loss_bound == 0.0;
    println!(
        "verified: every element of every result {}",
        if exact {
            format!("is the exact {} over the {} ranks", r.op, r.world)
        } else {
            "is the average of the contributions its report names".to_owned()
        }
    );
}

// ---------------------------------------------------------------------------------------
// job run
// ---------------------------------------------------------------------------------------

/// A host address `job run` may use: inside 198.18.0.0/15, neither its network nor its
/// broadcast address.
fn in_bench_range(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip.to_canonical() {
        IpAddr::V4(a) => {
            let o = a.octets();
            let inside = o[0] == 198 && (o[1] & 0xfe) == 18;
            let edge = a == Ipv4Addr::new(198, 18, 0, 0) || a == Ipv4Addr::new(198, 19, 255, 255);
            (inside && !edge).then_some(a)
        }
        IpAddr::V6(_) => None,
    }
}

/// The job's distinct hosts (in rank order of first appearance), each rank's host index, and
/// the master; checked for a namespace run.
fn plan(
    spec: &JobSpec,
    file: &str,
) -> Result<(Vec<Ipv4Addr>, Vec<usize>, SocketAddr), JobCmdError> {
    let mut hosts: Vec<Ipv4Addr> = Vec::new();
    let mut host_of = Vec::with_capacity(spec.world());
    // A loaded spec holds ranks 0..world in order, at least one.
    for (r, entry) in spec.ranks.iter().enumerate() {
        let a = in_bench_range(entry.host).ok_or(JobCmdError::NotBenchmarkRange {
            file: file.to_owned(),
            rank: r,
            host: entry.host,
        })?;
        let i = match hosts.iter().position(|&h| h == a) {
            Some(i) => i,
            None => {
                hosts.push(a);
                hosts.len() - 1
            }
        };
        host_of.push(i);
    }
    if hosts.len() > MAX_RUN_HOSTS {
        return Err(JobCmdError::TooManyHosts {
            file: file.to_owned(),
            hosts: hosts.len(),
        });
    }
    let host0 = match host_of.first() {
        Some(&h) => IpAddr::V4(hosts[h]),
        None => return Err(JobError::Invalid(format!("{file}: no ranks")).into()),
    };
    let master = spec
        .master
        .unwrap_or_else(|| SocketAddr::new(host0, DEFAULT_MASTER_PORT));
    if master.ip().to_canonical() != host0 {
        return Err(JobCmdError::MasterNotRank0 {
            file: file.to_owned(),
            master,
            host: host0,
        });
    }
    Ok((hosts, host_of, master))
}

/// Where the ranks run.
enum Place {
    /// Namespaces on one bridge.
    Bridge(NamespaceSet),
    /// A testbed topology's namespaces with its emulated fabric running.
    Fabric {
        net: gradwire_fabric::netns::FabricNet,
        fabric: gradwire_fabric::run::FabricHandle,
    },
}

impl Place {
    /// Stop the fabric (if any) and remove the namespaces.
    fn down(self) -> Res {
        match self {
            Place::Bridge(set) => set.down()?,
            Place::Fabric { net, fabric } => {
                let stats = fabric.stop();
                if stats.as_ref().is_some_and(|s| s.lag.behind) {
                    eprintln!(
                        "gradwire job run: the emulated fabric fell behind its clock: timings of this run are not valid"
                    );
                }
                net.down()?;
            }
        }
        Ok(())
    }
}

/// The namespaces of `topology`'s hosts (with its fabric running) for the job's `hosts`, each
/// of which must be one of the topology's host addresses.
fn on_topology(topology: &Path, hosts: &[Ipv4Addr]) -> Res<(Place, Vec<String>)> {
    let topo = gradwire_fabric::supervise::load_topology(topology)?;
    let mut index = Vec::with_capacity(hosts.len());
    for h in hosts {
        let i = topo.hosts.iter().position(|t| t.ip == *h).ok_or_else(|| {
            let known: Vec<String> = topo
                .hosts
                .iter()
                .map(|t| format!("{} = {}", t.name, t.ip))
                .collect();
            format!(
                "job host {h} is not a host of {}: its hosts are {}",
                topology.display(),
                known.join(", ")
            )
        })?;
        index.push(i);
    }
    let net = gradwire_fabric::netns::FabricNet::up(&topo)?;
    let fabric = match gradwire_fabric::run::spawn(
        &topo,
        net.switch_namespaces(),
        gradwire_fabric::run::FabricConfig::default(),
    ) {
        Ok(f) => f,
        Err(e) => {
            let _ = net.down();
            return Err(format!("starting the emulated fabric: {e}").into());
        }
    };
    let host_ns = index
        .iter()
        .map(|&i| net.host_ns(i).map(str::to_owned))
        .collect::<Option<Vec<_>>>()
        .ok_or("the testbed has fewer namespaces than hosts")?;
    Ok((Place::Fabric { net, fabric }, host_ns))
}

/// One namespace per host, each with `gw0` on one bridge in a switch namespace; removed when
/// the returned set is dropped or torn down (and by the kit's reaper if this process dies).
fn build_namespaces(hosts: &[Ipv4Addr]) -> gradwire_netns::Result<(NamespaceSet, Vec<String>)> {
    let prefix = gradwire_netns::new_netns_prefix();
    let host_ns: Vec<String> = (0..hosts.len()).map(|i| format!("{prefix}h{i}")).collect();
    let sw = format!("{prefix}sw");
    let mut all = host_ns.clone();
    all.push(sw.clone());
    let set = NamespaceSet::temporary("gradwire job run", &all)?;
    gradwire_netns::link::add_bridge(&sw, BRIDGE)?;
    let mut ports = IpBatch::new();
    for (i, ns) in host_ns.iter().enumerate() {
        let port = format!("h{i}");
        Veth {
            a: VethEnd {
                netns: ns,
                ifname: HOST_IF,
                mac: Some(host_mac(i)),
            },
            b: VethEnd {
                netns: &sw,
                ifname: &port,
                mac: None,
            },
            mtu: Some(1500),
            queues: None,
        }
        .create()?;
        ports.master(&port, BRIDGE).up(&port);
    }
    ports.up(BRIDGE).apply(&sw)?;
    for (i, ns) in host_ns.iter().enumerate() {
        let mut b = IpBatch::new();
        b.addr(HOST_IF, hosts[i].into(), RUN_PREFIX_LEN).up(HOST_IF);
        for (j, h) in hosts.iter().enumerate().filter(|&(j, _)| j != i) {
            b.neighbour(HOST_IF, (*h).into(), &host_mac(j));
        }
        b.apply(ns)?;
    }
    Ok((set, host_ns))
}

/// The worker processes; dropping this kills and reaps whatever still runs.
struct Ranks {
    children: Vec<Option<Child>>,
    readers: Vec<(JoinHandle<String>, JoinHandle<String>)>,
}

impl Ranks {
    fn kill_running(&mut self) -> Vec<usize> {
        let mut stopped = Vec::new();
        for (r, c) in self.children.iter_mut().enumerate() {
            if let Some(child) = c {
                if matches!(child.try_wait(), Ok(None)) {
                    stopped.push(r);
                }
                let _ = child.kill();
                let _ = child.wait();
            }
            *c = None;
        }
        stopped
    }

    /// Each rank's (stdout, stderr minus progress lines), once every child is gone.
    fn outputs(mut self) -> Vec<(String, String)> {
        self.kill_running();
        std::mem::take(&mut self.readers)
            .into_iter()
            .map(|(o, e)| (o.join().unwrap_or_default(), e.join().unwrap_or_default()))
            .collect()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_running();
    }
}

/// The arguments every worker of `job run` gets.
fn worker_args(a: &JobRunArgs, file: &Path, model: &Path) -> Vec<String> {
    let o = &a.opts;
    let mut v: Vec<String> = vec![
        "job".into(),
        "worker".into(),
        "--json".into(),
        "--job-file".into(),
        file.display().to_string(),
        "--algorithm".into(),
        o.algorithm.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--scale".into(),
        o.scale.to_string(),
        "--iterations".into(),
        o.iterations.to_string(),
        "--loss-bound".into(),
        o.loss_bound.to_string(),
        "--op".into(),
        op_name(o.op).into(),
        "--rate".into(),
        format!("{}bit", o.rate),
        "--timeout".into(),
        o.timeout.to_string(),
    ];
    if let Some(s) = &a.secret_file {
        v.push("--secret-file".into());
        v.push(s.display().to_string());
    }
    v
}

fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned())
}

/// `gradwire job run`.
pub fn run(a: &JobRunArgs) -> Res {
    let file_shown = a.file.display().to_string();
    let spec = JobSpec::load(&a.file)?;
    let (hosts, host_of, master) = plan(&spec, &file_shown)?;
    let deadline = seconds("deadline", a.deadline)?;
    seconds("timeout", a.opts.timeout)?;
    // Fail here, once, rather than in every rank.
    let (model_name, layers) = model_layers(&a.opts.model, a.opts.scale)?;
    // The workers read the same file (or GRADWIRE_JOB_SECRET, which they inherit).
    load_secret(a.secret_file.as_deref())?;
    let exe = std::env::current_exe()?;
    let args = worker_args(a, &absolute(&a.file), &absolute(&a.opts.model));

    // Ctrl-C and SIGTERM end the run in order: stop the ranks, remove the namespaces.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let (place, host_ns) = match &a.topology {
        Some(t) => on_topology(t, &hosts)?,
        None => {
            let (set, ns) = build_namespaces(&hosts)?;
            (Place::Bridge(set), ns)
        }
    };
    if !a.json {
        let elements: usize = layers.iter().map(|l| l.1).sum();
        println!(
            "job {}: {} ranks on {} hosts (namespaces {}...), master {master}, {} all-reduce ({}) \
             of {} x {}: {} layers, {elements} f32 elements, {} iterations, loss bound {}",
            spec.job,
            spec.world(),
            hosts.len(),
            host_ns.first().map_or("", String::as_str),
            a.opts.algorithm,
            op_name(a.opts.op),
            model_name,
            a.opts.scale,
            layers.len(),
            a.opts.iterations,
            a.opts.loss_bound
        );
    }
    let outcome = run_ranks(
        a, &spec, &exe, &args, &host_ns, &host_of, master, deadline, &stop,
    );
    let down = place.down();
    let reports = outcome?;
    down?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print_run_table(&reports);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_ranks(
    a: &JobRunArgs,
    spec: &JobSpec,
    exe: &Path,
    args: &[String],
    host_ns: &[String],
    host_of: &[usize],
    master: SocketAddr,
    deadline: Duration,
    stop: &AtomicBool,
) -> Res<Vec<WorkerReport>> {
    let world = spec.world();
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        let pb = ProgressBar::new(world as u64 * u64::from(a.opts.iterations));
        if let Ok(style) =
            ProgressStyle::with_template("{bar:40} {pos}/{len} rank-iterations {elapsed}")
        {
            pb.set_style(style);
        }
        pb
    };
    let mut ranks = Ranks {
        children: Vec::with_capacity(world),
        readers: Vec::with_capacity(world),
    };
    let mut local_rank: BTreeMap<usize, usize> = BTreeMap::new();
    // Ranks that have finished their first iteration.
    let iterating = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    for (r, &h) in host_of.iter().enumerate() {
        let lr = local_rank.entry(h).or_insert(0);
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &host_ns[h]])
            .arg(exe)
            .args(args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", lr.to_string())
            .env("MASTER_ADDR", master.ip().to_string())
            .env("MASTER_PORT", master.port().to_string())
            // Launcher variables this process may have inherited (a Slurm allocation) must
            // not contradict ours.
            .env(LAUNCHER_VAR, "torchrun")
            // The worker dies with this process, however it ends (`die_with_launcher`).
            .env(PARENT_VAR, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        *lr += 1;
        let mut child = cmd
            .spawn()
            .map_err(|source| JobCmdError::Spawn { rank: r, source })?;
        let out = child.stdout.take();
        let err = child.stderr.take();
        ranks.children.push(Some(child));
        let out_reader = std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut o) = out {
                let _ = o.read_to_string(&mut s);
            }
            s
        });
        let pb2 = pb.clone();
        let iterating = Arc::clone(&iterating);
        let err_reader = std::thread::spawn(move || {
            let mut kept = String::new();
            let mut first = true;
            if let Some(e) = err {
                for line in BufReader::new(e).lines() {
                    let Ok(line) = line else { break };
                    if line.starts_with(&format!("rank {r}{ITERATION_MARK}")) {
                        pb2.inc(1);
                        if std::mem::take(&mut first)
                            && iterating.fetch_add(1, Ordering::SeqCst) + 1 == world
                        {
                            pb2.suspend(|| eprintln!("gradwire job run: {ALL_ITERATING}"));
                        }
                    } else {
                        kept.push_str(&line);
                        kept.push('\n');
                    }
                }
            }
            kept
        });
        ranks.readers.push((out_reader, err_reader));
    }

    let mut status: Vec<Option<ExitStatus>> = vec![None; world];
    let ended = loop {
        if stop.load(Ordering::Relaxed) {
            break Err(JobCmdError::Interrupted);
        }
        let mut failed = Vec::new();
        for (r, c) in ranks.children.iter_mut().enumerate() {
            if status[r].is_some() {
                continue;
            }
            if let Some(child) = c {
                if let Ok(Some(s)) = child.try_wait() {
                    status[r] = Some(s);
                    if !s.success() {
                        failed.push(r);
                    }
                }
            }
        }
        if !failed.is_empty() {
            break Ok(Some(failed));
        }
        if status.iter().all(Option::is_some) {
            break Ok(None);
        }
        if started.elapsed() > deadline {
            let running = (0..world).filter(|&r| status[r].is_none()).collect();
            break Err(JobCmdError::Deadline {
                secs: a.deadline,
                running,
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stopped = ranks.kill_running();
    pb.finish_and_clear();
    let outputs = ranks.outputs();
    match ended {
        Err(e) => Err(e.into()),
        Ok(Some(failed)) => {
            let failed = failed
                .into_iter()
                .map(|r| {
                    let how = status[r].map_or_else(|| "?".to_owned(), |s| s.to_string());
                    (r, how, outputs[r].1.trim().replace('\n', " | "))
                })
                .collect();
            Err(JobCmdError::RankFailed { failed, stopped }.into())
        }
        Ok(None) => {
            let mut reports = Vec::with_capacity(world);
            for (r, (stdout, stderr)) in outputs.into_iter().enumerate() {
                // Warnings a successful rank logged.
                for line in stderr.lines() {
                    eprintln!("rank {r}: {line}");
                }
                let rep: WorkerReport =
                    serde_json::from_str(&stdout).map_err(|source| JobCmdError::BadReport {
                        rank: r,
                        source,
                        stdout: stdout.clone(),
                    })?;
                reports.push(rep);
            }
            Ok(reports)
        }
    }
}

fn print_run_table(reports: &[WorkerReport]) {
    println!(
        "{:>5} {:<16} {:>10} {:>10} {:>10} {:>14} {:>10} {:>9}",
        "rank", "host", "iterations", "mean ms", "max ms", "delivered min", "sent MB", "verified"
    );
    for r in reports {
        let n = r.iterations.len().max(1) as f64;
        let mean = r.iterations.iter().map(|i| i.ms).sum::<f64>() / n;
        let max = r.iterations.iter().map(|i| i.ms).fold(0.0, f64::max);
        let dmin = r
            .iterations
            .iter()
            .map(|i| i.delivered_fraction_min)
            .fold(1.0, f64::min);
        let sent: u64 = r.iterations.iter().map(|i| i.bytes_sent).sum();
        println!(
            "{:>5} {:<16} {:>10} {:>10.1} {:>10.1} {:>13.3}% {:>10.3} {:>9}",
            r.rank,
            r.host.to_string(),
            r.iterations.len(),
            mean,
            max,
            100.0 * dmin,
            sent as f64 / 1e6,
            if r.verified { "yes" } else { "NO" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_small_periodic_integers() {
        for r in 0..50 {
            for l in 0..30 {
                for e in 0..100 {
                    let v = input(r, l, e);
                    assert!((-11.0..=11.0).contains(&v) && v.fract() == 0.0);
                    assert_eq!(v, input(r, l, e + PERIOD));
                }
            }
        }
        // Residue sums are the element-wise sums.
        let s = residue_sums(0..5, 3);
        for e in 0..2 * PERIOD {
            let direct: f32 = (0..5).map(|r| input(r, 3, e)).sum();
            assert_eq!(s[e % PERIOD], direct);
        }
    }

    #[test]
    fn algorithms_and_the_job_commands_parse() {
        use crate::args::{parse_algorithm, Cli, Command, JobCommand};
        use clap::Parser;
        use gradwire_collective::tree::Strategy;
        assert_eq!(parse_algorithm("Ring"), Ok(JobAlgorithm::Ring));
        assert_eq!(
            parse_algorithm("binary"),
            Ok(JobAlgorithm::Tree(Strategy::BINARY))
        );
        assert_eq!(
            parse_algorithm("d=3"),
            Ok(JobAlgorithm::Tree(Strategy::Degree(3)))
        );
        let e = parse_algorithm("quad").unwrap_err();
        assert!(e.contains("\"ring\"") && e.contains("d=N"), "{e}");
        // What `job run` hands its workers parses back to the same options.
        for alg in ["ring", "star", "rack", "binary", "d=5"] {
            assert_eq!(
                parse_algorithm(&parse_algorithm(alg).unwrap().to_string()),
                parse_algorithm(alg)
            );
        }
        let c = Cli::try_parse_from([
            "gradwire",
            "job",
            "run",
            "j.toml",
            "--algorithm",
            "rack",
            "--op",
            "average",
            "--rate",
            "200M",
            "--deadline",
            "9",
        ])
        .unwrap();
        let Command::Job(j) = c.command else {
            panic!("not job")
        };
        let JobCommand::Run(r) = j.command else {
            panic!("not run")
        };
        assert_eq!(r.opts.op, JobOp::Average);
        assert_eq!(r.opts.rate, 200_000_000);
        let args = worker_args(&r, Path::new("/j.toml"), Path::new("/m.toml"));
        let mut full = vec!["gradwire".to_owned()];
        full.extend(args);
        let c = Cli::try_parse_from(full).unwrap();
        let Command::Job(j) = c.command else {
            panic!("not job")
        };
        let JobCommand::Worker(w) = j.command else {
            panic!("not worker")
        };
        assert!(w.json);
        assert_eq!(w.job_file.as_deref(), Some(Path::new("/j.toml")));
        assert_eq!(w.opts.algorithm, r.opts.algorithm);
        assert_eq!(w.opts.rate, r.opts.rate);
        assert_eq!(w.opts.op, r.opts.op);
        assert_eq!(w.opts.scale, r.opts.scale);
        assert_eq!(w.opts.timeout, r.opts.timeout);
        assert!(Cli::try_parse_from(["gradwire", "job", "worker", "--scale", "x"]).is_err());
    }

    #[test]
    fn bench_range() {
        for ok in [
            "198.18.0.1",
            "198.19.255.254",
            "198.18.50.4",
            "::ffff:198.18.1.1",
        ] {
            assert!(in_bench_range(ok.parse().unwrap()).is_some(), "{ok}");
        }
        for bad in [
            "198.18.0.0",
            "198.19.255.255",
            "198.20.0.1",
            "10.0.0.1",
            "fd00::1",
        ] {
            assert!(in_bench_range(bad.parse().unwrap()).is_none(), "{bad}");
        }
    }

    fn spec_of(text: &str) -> JobSpec {
        JobSpec::from_toml_str(text).unwrap()
    }

    #[test]
    fn plan_checks_hosts_and_master() {
        let s = spec_of(
            r#"job = 1
master = "198.18.0.1:29600"
[[rank]]
rank = 0
host = "198.18.0.1"
[[rank]]
rank = 1
host = "198.18.0.2"
[[rank]]
rank = 2
host = "198.18.0.1"
"#,
        );
        let (hosts, host_of, master) = plan(&s, "f").unwrap();
        assert_eq!(hosts.len(), 2);
        assert_eq!(host_of, vec![0, 1, 0]);
        assert_eq!(master.port(), 29600);

        let s = spec_of("job = 1\n[[rank]]\nrank = 0\nhost = \"10.0.0.1\"\n");
        let e = plan(&s, "f").unwrap_err().to_string();
        assert!(e.contains("198.18.0.0/15") && e.contains("10.0.0.1"), "{e}");

        let s = spec_of(
            "job = 1\nmaster = \"198.18.0.9:1\"\n[[rank]]\nrank = 0\nhost = \"198.18.0.1\"\n",
        );
        let e = plan(&s, "f").unwrap_err().to_string();
        assert!(e.contains("not rank 0's host"), "{e}");

        let s = spec_of("job = 1\n[[rank]]\nrank = 0\nhost = \"198.18.0.7\"\n");
        assert_eq!(
            plan(&s, "f").unwrap().2,
            "198.18.0.7:29500".parse().unwrap()
        );
    }

    #[test]
    fn exact_check_catches_a_wrong_element() {
        let work = LayerWork {
            name: "l".into(),
            elems: 50,
            want: residue_sums(0..2, 0),
        };
        let at = Site {
            rank: 0,
            world: 2,
            iteration: 1,
            layer: 0,
            work: &work,
            op: ReduceOp::Sum,
        };
        let mut t = Tensor::zeros(DType::F32, 50);
        for (e, x) in t.as_f32_mut().unwrap().iter_mut().enumerate() {
            *x = input(0, 0, e) + input(1, 0, e);
        }
        let layout_report = |complete| AllReduceReport {
            algorithm: "ring",
            elems: 50,
            block_elems: 50,
            complete_blocks: complete,
            blocks: 1,
            delivered_fraction: 1.0,
            rank_delivered: vec![1.0, 1.0],
            elapsed: Duration::ZERO,
            bytes_sent: 0,
            contributors: gradwire_collective::aggregate::Contributors::all(1, 2),
        };
        check_exact(&at, &t, &layout_report(1)).unwrap();
        assert!(matches!(
            check_exact(&at, &t, &layout_report(0)),
            Err(JobCmdError::Incomplete { .. })
        ));
        check_named(&at, &t, &layout_report(1)).unwrap();
        t.as_f32_mut().unwrap()[17] += 1.0;
        let e = check_exact(&at, &t, &layout_report(1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("element 17") && e.contains("WRONG RESULT"),
            "{e}"
        );
        assert!(check_named(&at, &t, &layout_report(1)).is_err());
    }
}
