//! Command-line arguments.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use gradwire::addr::resolve;
use gradwire::rate::RateMode;
use gradwire::tensor::{DType, Tensor};
use gradwire_units::{parse_rate, parse_size};

/// gradwire: a bounded-loss-tolerant transport for distributed DNN training traffic.
#[derive(Debug, Parser)]
#[command(name = "gradwire", version, about, args_override_self = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run complete exchanges on this machine (sender and receiver in one process), on the
    /// message layer (see --transport).
    Demo(DemoArgs),
    /// Send tensors to a `gradwire recv` on another host (message layer: one TCP set-up, then
    /// one message per tensor).
    Send(SendArgs),
    /// Receive tensors from a `gradwire send`.
    Recv(RecvArgs),
    /// Show the counters of running `gradwire send`/`recv` processes.
    Stats(StatsArgs),
    /// Benchmark AF_XDP against kernel UDP between two namespaces (root).
    Bench(gradwire_experiment::netbench::BenchArgs),
    /// Topology testbeds: namespaces, links and an emulated switch fabric (root).
    Testbed(TestbedArgs),
    /// The emulated switch fabric of a testbed: run it, or show its counters.
    Fabric(FabricArgs),
    /// Experiments on the emulated fabric (root).
    Experiment(ExperimentArgs),
    /// Collective jobs: all-reduce a model's layers over every rank of a job.
    Job(JobArgs),
    /// NetStorm over a WAN: one node per site synchronizes a model over multi-root trees.
    Wan(WanArgs),
}

#[derive(Debug, Args)]
pub struct WanArgs {
    #[command(subcommand)]
    pub command: WanCommand,
}

#[derive(Debug, Subcommand)]
pub enum WanCommand {
    /// One site's node (one process per site): links to every other node through the
    /// rendezvous at rank 0 (--master), asks the scheduler for each round's policy, and
    /// synchronizes a synthetic model every round, checking every element of the average.
    /// Rank 0 can run the scheduler too (--serve-scheduler, with --topology).
    Node(WanNodeArgs),
}

/// A NetStorm strategy: star, bkt, mst, fapt, mr-fapt, mr-fapt+aware, mr-fapt+aware+aux.
pub fn parse_strategy(s: &str) -> Result<gradwire_wan::scheduler::Strategy, String> {
    s.trim().parse()
}

/// A sender rate-control mode: grant, ecn or fig7.
pub fn parse_rate_mode(s: &str) -> Result<RateMode, String> {
    RateMode::from_name(s.trim())
        .ok_or_else(|| format!("unknown rate mode {s:?}: expected grant, ecn or fig7"))
}

/// Seconds, above 0.
pub fn parse_secs(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e7 => Ok(v),
        _ => Err(format!("{s:?}: give a positive number of seconds")),
    }
}

/// NetStorm's hyper-parameters (Table II); unset ones take the paper's defaults.
#[derive(Debug, Clone, Default, Args)]
pub struct NetStormArgs {
    /// CHUNK_SIZE: most elements per chunk (paper: 1000000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub chunk_size: Option<u64>,
    /// PROBE_CHUNK_SIZE: only chunks above this many bytes time a link (paper: 2000000).
    #[arg(long)]
    pub probe_chunk_size: Option<u64>,
    /// PROBE_CHUNK_NUM: chunks per link throughput estimate (paper: 4).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub probe_chunk_num: Option<u64>,
    /// PRIMARY_BUSY_BOUND: chunks in flight beyond which a primary path is busy (paper: 2).
    #[arg(long)]
    pub primary_busy_bound: Option<usize>,
    /// AUXILIARY_QUEUE_LENGTH: chunks in flight an auxiliary path takes (paper: 1).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub aux_queue_length: Option<u64>,
    /// UPDATE_TIME: seconds between policy refreshes (paper: 5).
    #[arg(long, value_parser = parse_secs)]
    pub update_time: Option<f64>,
    /// NUM_ROOT_SERVERS: roots of the multi-root trees (default: every node).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub roots: Option<u64>,
}

#[derive(Debug, Args)]
pub struct WanNodeArgs {
    /// This node's rank (site index: host i of the topology).
    #[arg(long)]
    pub rank: usize,
    /// Nodes (sites).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub world: u64,
    /// Rank 0's rendezvous address, IP:PORT (rank 0 listens there).
    #[arg(long, value_parser = resolve)]
    pub master: SocketAddr,
    /// This node's IP address (default: the address this host reaches the master from).
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Job id of the flows and the rendezvous (every node the same).
    #[arg(long, default_value_t = 15)]
    pub job: u32,
    /// The scheduler's address, IP:PORT (default: the master's IP, its port + 1).
    #[arg(long, value_parser = resolve, conflicts_with = "serve_scheduler")]
    pub scheduler: Option<SocketAddr>,
    /// Run the scheduler in this node (rank 0), on the master's IP and --scheduler-port.
    #[arg(long)]
    pub serve_scheduler: bool,
    /// The scheduler's port with --serve-scheduler (default: the master's port + 1).
    #[arg(long)]
    pub scheduler_port: Option<u16>,
    /// Strategy: star, bkt, mst, fapt, mr-fapt, mr-fapt+aware, mr-fapt+aware+aux (the
    /// scheduler's; every node must give the same).
    #[arg(long, default_value = "mr-fapt+aware+aux", value_parser = parse_strategy)]
    pub strategy: gradwire_wan::scheduler::Strategy,
    /// WAN topology file: the scheduler's overlay (needed with --serve-scheduler). Site i is
    /// host i; its switch-switch links to other sites are the overlay's links, with their
    /// starting rates.
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Model layer file: its layers, scaled and flattened, are the synchronized tensor.
    #[arg(long, default_value = "control/models/alexnet.toml")]
    pub model: PathBuf,
    /// Model scale (1 = the model's real size; every layer at least one element).
    #[arg(long, default_value_t = 0.01)]
    pub scale: f64,
    /// Most rounds.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub iterations: u32,
    /// Stop after the round in which this many seconds have passed since the first (every
    /// node stops after the same round).
    #[arg(long, value_parser = parse_secs)]
    pub duration: Option<f64>,
    /// Longest wait, in seconds, for the other nodes to come, for each round, and for the
    /// final barrier: then the node fails naming what it waited for.
    #[arg(long, default_value_t = 120.0, value_parser = parse_secs)]
    pub timeout: f64,
    /// Line rate the node's senders never exceed, bits per second with a unit (e.g. 100M).
    /// Not applied since the chunks are messages of the message layer, which has no pacer
    /// (its congestion window sets the rate); accepted for the experiment's frame budget.
    #[arg(long, default_value = "1Gbit", value_parser = |s: &str| parse_rate(s).map(|r| r.bps()))]
    pub rate: u64,
    /// The flow transport's sender rate control: grant, ecn or fig7. Not applied on the
    /// message layer (see --rate).
    #[arg(long, default_value = "grant", value_parser = parse_rate_mode)]
    pub rate_mode: RateMode,
    /// The flow transport's rate-control period, microseconds. Not applied on the message
    /// layer (see --rate).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(50..=1_000_000))]
    pub period_us: u64,
    #[command(flatten)]
    pub netstorm: NetStormArgs,
    /// Print one JSON report (the per-round lines go to stderr); on failure, the error with
    /// the nodes it blames and the timeout that fired, if one did.
    #[arg(long)]
    pub json: bool,
    /// Authenticated job: the job secret's key file (mode 0600); or set GRADWIRE_JOB_SECRET.
    /// Every node needs the same secret: chunks are sealed per pair of nodes, scheduler
    /// connections authenticated, and node 0 serves the scheduler.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct JobArgs {
    #[command(subcommand)]
    pub command: JobCommand,
}

#[derive(Debug, Subcommand)]
pub enum JobCommand {
    /// One rank of a job, as torchrun, srun or mpirun start it: rank and world size from
    /// RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE
    /// or PMI_RANK/PMI_SIZE; rank 0's rendezvous address from MASTER_ADDR/MASTER_PORT or the
    /// job file.
    Worker(JobWorkerArgs),
    /// Every rank of a job file as its own process on this machine, one network namespace
    /// per host address (root; addresses in 198.18.0.0/15).
    Run(JobRunArgs),
}

/// An all-reduce algorithm: the ring, the two-phase all-reduce, the message layer's choice,
/// or a tree of a strategy (rooted at rank 0).
pub use gradwire_job::JobAlgorithm;

/// Parse "ring", "direct", "auto", "star", "rack", "binary" or "d=N".
pub fn parse_algorithm(s: &str) -> Result<JobAlgorithm, String> {
    s.parse()
}

/// Reduction of a job's all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum JobOp {
    Sum,
    Average,
}

/// What every rank of a job does; `gradwire job run` passes these on to its workers.
#[derive(Debug, Clone, Args)]
pub struct JobOptions {
    /// All-reduce algorithm: ring, direct (two-phase) or auto (two-phase up to 32 KiB, ring
    /// above); or a tree rooted at rank 0: star, rack (one aggregator per rack), binary, or
    /// d=N (at most N children per node). All run on the message layer, except in an
    /// authenticated job (ring and trees on the flow transport).
    #[arg(long, default_value = "ring", value_parser = parse_algorithm)]
    pub algorithm: JobAlgorithm,
    /// Model layer file: one all-reduce per layer and iteration.
    #[arg(long, default_value = "control/models/resnet50.toml")]
    pub model: PathBuf,
    /// Tensor size scale (1 = the model's real gradient sizes); every layer has at least one
    /// element.
    #[arg(long, default_value_t = 0.01)]
    pub scale: f64,
    /// Iterations (one all-reduce of every layer each).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub iterations: u32,
    /// Loss bound p of every transfer (0 = reliable: results are checked to be exact).
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub loss_bound: f64,
    /// Sum or average over the ranks.
    #[arg(long, value_enum, default_value = "sum")]
    pub op: JobOp,
    /// Line rate every sender never exceeds, bits per second with a unit (e.g. 1Gbit, 200M).
    #[arg(long, default_value = "1Gbit", value_parser = |s: &str| parse_rate(s).map(|r| r.bps()))]
    pub rate: u64,
    /// Longest wait, in seconds, for the rendezvous, each link, and a peer to start its part
    /// of an operation: then the rank fails naming what it waited for.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
}

#[derive(Debug, Args)]
pub struct JobWorkerArgs {
    /// Job file (TOML or JSON): job id, master, and each rank's host and rack. Its world
    /// size must match the launcher's.
    #[arg(long)]
    pub job_file: Option<PathBuf>,
    /// This rank's IP address (default: the job file's entry, else the address this host
    /// reaches the master from).
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Job id without a job file (with one, it must agree).
    #[arg(long)]
    pub job: Option<u32>,
    /// Authenticated job: the job secret's key file (mode 0600); or set GRADWIRE_JOB_SECRET.
    /// Every rank needs the same secret.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    #[command(flatten)]
    pub opts: JobOptions,
    /// Print one JSON report (the per-iteration lines go to stderr).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct JobRunArgs {
    /// Job file (TOML or JSON); its hosts become namespaces on one bridge, or the hosts of
    /// --topology.
    pub file: PathBuf,
    /// Run the ranks on this testbed topology's hosts (emulated switches, links and QoS, as
    /// `gradwire testbed`) instead of one bridge: every job host must be one of its host
    /// addresses (198.18.1.1, 198.18.1.2, ... in the file's host order).
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,
    #[command(flatten)]
    pub opts: JobOptions,
    /// Authenticated job: the job secret's key file (mode 0600), handed to every rank.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Seconds the whole job may take before every rank is stopped.
    #[arg(long, default_value_t = 600.0)]
    pub deadline: f64,
    /// Print the workers' reports as one JSON array.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ExperimentArgs {
    #[command(subcommand)]
    pub command: ExperimentCommand,
}

#[derive(Debug, Subcommand)]
pub enum ExperimentCommand {
    /// DLCP's parameter-server incast on the leaf-spine: gradwire against kernel TCP, with
    /// ablations. Prints a table; --json for everything.
    Incast(IncastArgs),
    /// MLNET's aggregation/multicast trees against the direct parameter server (STAR, RACK,
    /// BINARY, any d) on an oversubscribed leaf-spine, for several server counts.
    Mlnet(MlnetArgs),
    /// MLNET's job prioritization: concurrent jobs with random priorities, FIFO against
    /// strict-priority switch queues, with and without trees.
    Priority(PriorityArgs),
    /// NetStorm on the emulated WAN: every strategy (star, bkt, mst, fapt, mr-fapt,
    /// mr-fapt+aware, mr-fapt+aware+aux) on a static and a dynamic network, one `gradwire wan
    /// node` process per site, each run repeated (--repeats, default 2) and a run whose fabric
    /// fell behind its clock retried (--max-attempts, default 3); settings whose frame budget
    /// is above what the fabric forwards on one core are refused before anything runs. Writes
    /// wan.json, wan.csv, wan.png and wan-rates.png.
    Wan(WanExperimentArgs),
}

#[derive(Debug, Args)]
pub struct WanExperimentArgs {
    /// Write wan.json, wan.csv, wan.png and wan-rates.png into this directory.
    #[arg(long)]
    pub out: PathBuf,
    /// WAN topology (default testbeds/wan9.toml; testbeds/wan4.toml with --quick).
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Model layer file.
    #[arg(long, default_value = "control/models/alexnet.toml")]
    pub model: PathBuf,
    /// Model scale (default 0.01; 0.002 with --quick).
    #[arg(long)]
    pub scale: Option<f64>,
    /// Most rounds per run (default 200; 50 with --quick).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub iterations: Option<u32>,
    /// Seconds per run, counted from each fabric's start so that every strategy sees the same
    /// rates (default 40: wan9's first two rate steps; 20 with --quick).
    #[arg(long, value_parser = parse_secs)]
    pub duration: Option<f64>,
    /// Strategies, comma-separated (default: all, star first).
    #[arg(long, value_delimiter = ',', value_parser = parse_strategy)]
    pub strategies: Option<Vec<gradwire_wan::scheduler::Strategy>>,
    /// Networks, comma-separated: static (every rate fixed at its start), dynamic (the
    /// topology's rate schedules).
    #[arg(long, value_delimiter = ',', default_value = "static,dynamic")]
    pub networks: Vec<String>,
    /// A short run: testbeds/wan4.toml, a small model, 20 s per run.
    #[arg(long)]
    pub quick: bool,
    /// Runs of each strategy on each network; the figures are their spread (min, median,
    /// max over the valid ones).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub repeats: u32,
    /// Attempts at a run whose fabric fell behind its clock before it counts as not valid.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub max_attempts: u32,
    /// Each node's longest wait for the others, a round and the final barrier, seconds
    /// (default 120; 30 with --quick).
    #[arg(long, value_parser = parse_secs)]
    pub timeout: Option<f64>,
    /// Senders' line rate (default: each host link's rate): the frame budget's; not applied
    /// by the nodes since their chunks are messages of the message layer (no pacer).
    #[arg(long, value_parser = |s: &str| parse_rate(s).map(|r| r.bps()))]
    pub rate: Option<u64>,
    /// The flow transport's rate control, passed to every node, which no longer applies it
    /// (see `gradwire wan node`).
    #[arg(long, default_value = "grant", value_parser = parse_rate_mode)]
    pub rate_mode: RateMode,
    /// The senders' rate-control period, microseconds.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(50..=1_000_000))]
    pub period_us: u64,
    #[command(flatten)]
    pub netstorm: NetStormArgs,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct MlnetArgs {
    /// Topology file.
    #[arg(long)]
    pub topology: Option<std::path::PathBuf>,
    /// Strategies: star, rack, binary, d=N.
    #[arg(long, value_delimiter = ',', default_value = "star,rack,binary")]
    pub strategies: Vec<String>,
    /// Server counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub servers: Vec<usize>,
    /// Workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Model size (split over the servers), e.g. 512KiB, 1M.
    #[arg(long, default_value = "512KiB", value_parser = |s: &str| parse_size(s).map(|b| b.0))]
    pub model_bytes: u64,
    /// Iterations per run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub iterations: u32,
    /// Seed of the placement of servers and workers.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Protocol of the trees: msg (the message layer, grants per endpoint) or flow (the flow
    /// transport, one rate-grant pool per host).
    #[arg(long, default_value = "msg", value_parser = ["msg", "flow"])]
    pub transport: String,
    /// On the message layer, receiver grants (off: each sender's own window only).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub grants: String,
    /// Write mlnet.json, mlnet.csv and mlnet.png into this directory.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PriorityArgs {
    /// Topology file.
    #[arg(long)]
    pub topology: Option<std::path::PathBuf>,
    /// Concurrent jobs per run.
    #[arg(long, default_value_t = 4)]
    pub jobs: usize,
    /// Workers per job (one server each).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Model size per job, e.g. 512KiB.
    #[arg(long, default_value = "512KiB", value_parser = |s: &str| parse_size(s).map(|b| b.0))]
    pub model_bytes: u64,
    /// Iterations per job.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub iterations: u32,
    /// Repetitions with other random priorities and placements.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repetitions: u32,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write priority.json, priority.csv and priority.png into this directory.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct IncastArgs {
    /// Settings to run: current (testbeds/ps-incast.toml: 100 Mbit/s, buffers of many BDPs,
    /// TCP with the kernel's 200 ms minimum RTO) or paper (testbeds/ps-incast-paper.toml:
    /// buffers of about one BDP per port, fan-in 8, TCP with a 10 ms minimum RTO).
    #[arg(long, value_enum, default_value = "current")]
    pub regime: gradwire_experiment::Regime,
    /// Topology file instead of the regime's: hosts named ps* are parameter servers, the
    /// others workers.
    #[arg(long)]
    pub topology: Option<std::path::PathBuf>,
    /// Model layer file.
    #[arg(long, default_value = "control/models/resnet50.toml")]
    pub model: std::path::PathBuf,
    /// Tensor size scale (1 = the model's real gradient sizes).
    #[arg(long, default_value_t = 1.0 / 32.0)]
    pub scale: f64,
    /// Split tensors larger than this (after scaling) over all servers (default 4 MB x scale,
    /// DLCP's 4 MB threshold at this scale; e.g. 128KiB, 1M).
    #[arg(long, value_parser = |s: &str| parse_size(s).map(|b| b.0))]
    pub split_bytes: Option<u64>,
    /// Iterations per variant (the reported figures use at least 20).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub iterations: u32,
    /// Variants, comma-separated: gw-p<percent>[-notag][-nospray][-norc] (flows),
    /// msg-p<percent>[-notag][-nogrants] (the message layer), tcp-<congestion>[-ecn][-rto<ms>]
    /// (default: the regime's: gw-p1, gw-p10, gw-p0, msg-p1, msg-p10, TCP CUBIC, DCTCP, BBR
    /// and CUBIC with ECN (current regime: each also with -rto10), and the gradwire ablations
    /// gw-p1-notag, gw-p1-nospray, gw-p1-norc, ...).
    #[arg(long, value_delimiter = ',')]
    pub variants: Option<Vec<String>>,
    /// Source ports gradwire sprays each transfer over.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub spray_ports: u16,
    /// gradwire's rate-control period in microseconds (the paper's 200 us is for 100G; the
    /// default scales it to the emulated links' longer RTT).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(50..=1_000_000))]
    pub period_us: u64,
    /// Seed of tensor placement and contents, and of the bootstrap.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Bootstrap resamples of the confidence intervals (95 %).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub resamples: u32,
    /// Print the whole report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write incast.json (the report), incast-flows.csv (every flow), incast-fct.png (p50,
    /// p99, p99.9 FCT with CIs per variant) and incast-cdf.png (FCT CDFs) into this directory.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Also draw the FCT bars (as incast-fct.png) into this PNG file.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub struct TestbedArgs {
    #[command(subcommand)]
    pub command: TestbedCommand,
}

#[derive(Debug, Subcommand)]
pub enum TestbedCommand {
    /// Build the namespaces of a topology file and start its fabric in the background.
    Up(TestbedUpArgs),
    /// Stop a testbed's fabric and remove its namespaces (nothing up: says so, exits 0).
    Down(TestbedDownArgs),
    /// List the testbeds that are up.
    Status(TestbedStatusArgs),
}

#[derive(Debug, Args)]
pub struct TestbedUpArgs {
    /// Topology file (e.g. testbeds/incast.toml).
    pub file: PathBuf,
    #[command(flatten)]
    pub fabric: FabricOptions,
}

#[derive(Debug, Args)]
pub struct TestbedDownArgs {
    /// Topology file or testbed name.
    pub target: String,
}

#[derive(Debug, Args)]
pub struct TestbedStatusArgs {
    /// One JSON array of the testbed records (with `running`).
    #[arg(long)]
    pub json: bool,
}

/// Options of the fabric process.
#[derive(Debug, Clone, Args)]
pub struct FabricOptions {
    /// XDP attach mode of the switch ports: generic (fastest on veth), native or auto.
    #[arg(long, default_value = "generic")]
    pub xdp_mode: gradwire_ebpf::AttachMode,
    /// Seed of the link-loss generators and packet ECMP.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct FabricArgs {
    #[command(subcommand)]
    pub command: FabricCommand,
}

#[derive(Debug, Subcommand)]
pub enum FabricCommand {
    /// Run the fabric of a testbed in the foreground until SIGTERM/SIGINT (root; `gradwire
    /// testbed up` starts one in the background).
    Run(FabricRunArgs),
    /// Show a fabric's counters: lag, forwarding, and per port and queue.
    Stats(FabricStatsArgs),
}

#[derive(Debug, Args)]
pub struct FabricRunArgs {
    /// Topology file.
    pub file: PathBuf,
    /// Namespace prefix of the testbed (default gwt<name>, as `gradwire testbed up` builds).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Where to publish the stats as JSON (default <stats dir>/fabric-<name>.json).
    #[arg(long)]
    pub stats: Option<PathBuf>,
    #[command(flatten)]
    pub fabric: FabricOptions,
    /// A departure later than this many microseconds is late; too many late ones and the
    /// run is marked behind (not valid).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub max_lag_us: u64,
}

#[derive(Debug, Args)]
pub struct FabricStatsArgs {
    /// Testbed name or stats file (default: the only running testbed).
    pub target: Option<String>,
    /// Print the stats file's JSON unchanged.
    #[arg(long)]
    pub json: bool,
    /// Print again every SECONDS.
    #[arg(long)]
    pub watch: Option<f64>,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// Directory of the stats files (default /run/gradwire).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Print again every SECONDS.
    #[arg(long)]
    pub watch: Option<f64>,
    /// One JSON array.
    #[arg(long)]
    pub json: bool,
    /// Serve the counters in Prometheus's text format at http://ADDR/metrics until stopped
    /// (e.g. 127.0.0.1:9464; port 0: any, the address is printed).
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["json", "watch"])]
    pub prometheus: Option<std::net::SocketAddr>,
}

/// Which datapath carries the data packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatapathKind {
    /// In-memory pair inside one process (demo only).
    Loopback,
    /// Kernel UDP sockets with sendmmsg/recvmmsg.
    Udp,
    /// AF_XDP sockets behind gradwire's XDP classifier (root; the demo builds namespaces).
    Afxdp,
}

impl DatapathKind {
    pub fn name(self) -> &'static str {
        match self {
            DatapathKind::Loopback => "loopback",
            DatapathKind::Udp => "udp",
            DatapathKind::Afxdp => "afxdp",
        }
    }
}

/// Which protocol a `demo`, `send` or `recv` runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// The message layer, unless the run needs the flow transport: a job secret
    /// (--secret-file or GRADWIRE_JOB_SECRET), --engine, several --queues, --spray-ports > 1.
    Auto,
    /// The message layer (gradwire-msg): one endpoint per side, a tensor is one message,
    /// no handshake per tensor; one TCP connection sets a two-host run up.
    Msg,
    /// The flow transport: a handshaked flow per tensor over a TCP control channel.
    Flow,
}

/// Options every command shares.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// Protocol: auto (the message layer, or the flow transport where only it can do what
    /// was asked), msg or flow. Both ends of a send/recv must run the same one.
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: TransportKind,
    /// Authenticated job: the job secret's key file (mode 0600, at least 16 bytes; e.g.
    /// `head -c 32 /dev/urandom > job.key`). Or set GRADWIRE_JOB_SECRET. Every rank needs the
    /// same secret; the secret itself is never a command-line argument.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<std::path::PathBuf>,
    /// Datapath for data packets.
    #[arg(long, value_enum, default_value = "udp")]
    pub datapath: DatapathKind,
    /// Tensor size: bytes, or with a unit (K = 1000, KiB = 1024; e.g. 1500, 64KiB, 64M).
    #[arg(long, default_value = "64MiB", value_parser = |s: &str| parse_size(s).map(|b| b.0))]
    pub size: u64,
    /// Number of tensors transferred, one after another.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub count: u32,
    /// Element type.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// Loss bound p: the receiver finishes once 1-p of the segments arrived (0 = reliable).
    /// On the message layer the receiver's bound governs; send and recv must give the same.
    #[arg(long, default_value_t = 0.01, value_parser = parse_fraction)]
    pub loss_bound: f64,
    /// Receiver-side random drop probability of arriving data packets (fault injection; no
    /// netem needed). Where it is injected: over afxdp the receiver's XDP classifier drops
    /// data packets (DSCP 10) before its socket; over udp and loopback, on the message layer,
    /// the receiving endpoint drops data segments before placing them (the flow transport: a
    /// fault injector under the receiver's datapath). Control is never dropped.
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub inject_loss: f64,
    /// IP MTU of the path.
    #[arg(long, default_value_t = 1500)]
    pub mtu: usize,
    /// Line rate the sender never exceeds, in bits per second with a unit (e.g. 25G =
    /// 25Gbit, 200Mbit, 1.5Gbit); on a receiver, the downlink capacity its grants share out.
    /// Flow transport only, as --rate-mode, --delta, --period-us and --additive-increase: the
    /// message layer paces with its own congestion window (acks and ECN marks).
    #[arg(long, default_value = "25G", value_parser = |s: &str| parse_rate(s).map(|r| r.bps()))]
    pub line_rate: u64,
    /// How the sender chooses its rate: grant (pace at the receiver's share of its
    /// downlink, the default), ecn (react to the CE fraction the receiver reports,
    /// DCTCP-style) or fig7 (DLCP's Figure 7: line-rate start, halve when send > Δ x receive).
    #[arg(long, default_value = "grant", value_parser = |s: &str| RateMode::from_name(s).ok_or_else(|| format!("unknown rate mode {s:?}: expected grant, ecn or fig7")))]
    pub rate_mode: RateMode,
    /// Rate-control factor Δ of the fig7 mode: halve when send rate > Δ x receive rate.
    #[arg(long, default_value_t = 2.0)]
    pub delta: f64,
    /// Rate-report period in microseconds.
    #[arg(long, default_value_t = 200)]
    pub period_us: u64,
    /// Additive increase per period, as a fraction of the line rate.
    #[arg(long, default_value_t = 0.05)]
    pub additive_increase: f64,
    /// Seconds without progress before a transfer fails (on the message layer: a peer silent
    /// this long is named in the error).
    #[arg(long, default_value_t = 10.0)]
    pub timeout: f64,
    /// Keep the previous contents of missing segments instead of zero-filling them.
    #[arg(long)]
    pub keep_missing: bool,
    /// Job id carried in every packet.
    #[arg(long, default_value_t = 1)]
    pub job: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub afxdp: AfXdpArgs,
}

impl Common {
    /// A zeroed tensor of `--size` bytes of `--dtype` (what every transfer moves).
    pub fn tensor(&self) -> Result<Tensor, String> {
        let size =
            usize::try_from(self.size).map_err(|_| "--size does not fit this machine's memory")?;
        Tensor::zeros_bytes(self.dtype, size).ok_or_else(|| {
            format!(
                "--size {} is not a whole number of {} elements ({} bytes each)",
                self.size,
                self.dtype,
                self.dtype.elem_size()
            )
        })
    }
}

/// Options of the AF_XDP datapath.
#[derive(Debug, Clone, Args)]
pub struct AfXdpArgs {
    /// Interface for --datapath afxdp (send/recv; the demo uses its own namespaces).
    #[arg(long)]
    pub ifname: Option<String>,
    /// Queues to bind, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub queues: Vec<u32>,
    /// XDP attach mode: auto (native, else generic), native or generic.
    #[arg(long, default_value = "auto")]
    pub xdp_mode: gradwire_ebpf::AttachMode,
    /// UMEM frame size (2048 or 4096).
    #[arg(long, default_value_t = 4096)]
    pub frame_size: u32,
    /// Entries per AF_XDP ring (power of two).
    #[arg(long, default_value_t = 2048)]
    pub ring_size: u32,
    /// Packets per datapath batch.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Spin on the rings instead of sleeping in poll() (real hosts with pinned cores only).
    #[arg(long)]
    pub busy_poll: bool,
    /// Do not try 2 MiB huge pages for the UMEM.
    #[arg(long)]
    pub no_hugepages: bool,
    /// Do not request zero-copy (copy mode only).
    #[arg(long)]
    pub no_zero_copy: bool,
    /// Static neighbour for the peer, IP=MAC (repeatable); otherwise the kernel's ARP table.
    #[arg(long = "neighbor", value_parser = parse_neighbor)]
    pub neighbors: Vec<(std::net::IpAddr, [u8; 6])>,
    /// Pin to these cores, comma separated: with --engine one per queue for the workers;
    /// without, the transfer threads (sender first, then receiver; on the message layer the
    /// endpoint's progress thread with them).
    #[arg(long, value_delimiter = ',')]
    pub cores: Vec<usize>,
    /// Move packets with pinned per-queue worker threads (the engine) instead of the
    /// calling thread (flow transport only).
    #[arg(long)]
    pub engine: bool,
}

/// Parse "198.18.0.2=02:00:00:00:00:01".
pub fn parse_neighbor(s: &str) -> Result<(std::net::IpAddr, [u8; 6]), String> {
    let (ip, mac) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not IP=MAC"))?;
    let ip = ip
        .trim()
        .parse()
        .map_err(|_| format!("{ip:?} is not an IP address"))?;
    let mac = gradwire::afxdp::neigh::parse_mac(mac.trim())
        .ok_or_else(|| format!("{mac:?} is not a MAC address"))?;
    Ok((ip, mac))
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct SendArgs {
    /// The receiver's --listen address: host:port or IP:port (a name is resolved once). The
    /// message layer sets the run up over one TCP connection there; the flow transport runs
    /// its control channel on it.
    #[arg(long, value_parser = resolve)]
    pub to: SocketAddr,
    /// Local address for the data socket, host:port or IP:port (port 0 picks one).
    #[arg(long, value_parser = resolve)]
    pub bind: Option<SocketAddr>,
    /// Spray each transfer over this many UDP source ports (the --bind port and the next
    /// ones, rotating per packet), so that switches hashing flows for ECMP use every path.
    /// Needs an explicit --bind port; flow transport only (the receiver needs --transport
    /// flow).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub spray_ports: u16,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct RecvArgs {
    /// TCP address to listen on for the sender (the message layer's set-up, or the flow
    /// transport's control channel): host:port or IP:port (a name is resolved once).
    #[arg(long, value_parser = resolve)]
    pub listen: SocketAddr,
    /// Data address, host:port or IP:port (default: the listen address with port+1).
    #[arg(long, value_parser = resolve)]
    pub data: Option<SocketAddr>,
    /// Seconds to wait for a sender to connect (and set the run up).
    #[arg(long, default_value_t = 300.0)]
    pub accept_timeout: f64,
    #[command(flatten)]
    pub common: Common,
}

/// Parse a probability in [0, 1].
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a probability in [0, 1]"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use gradwire_units::{BitRate, Bytes};

    #[test]
    fn sizes_rates_fractions() {
        // Sizes and rates are gradwire-units' grammar, as in every other place.
        assert_eq!(parse_size("1500"), Ok(Bytes(1500)));
        assert_eq!(parse_size("64MiB"), Ok(Bytes(64 << 20)));
        assert_eq!(parse_size("1G"), Ok(Bytes(1_000_000_000)));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
        assert_eq!(parse_rate("25G"), Ok(BitRate(25_000_000_000)));
        assert!(parse_rate("0").is_err());
        assert_eq!(parse_fraction("0.05"), Ok(0.05));
        assert!(parse_fraction("1.5").is_err());
        assert!(parse_fraction("nan").is_err());
    }

    #[test]
    fn units_and_host_names_as_users_write_them() {
        let c = Cli::try_parse_from([
            "gradwire",
            "send",
            "--to",
            "localhost:7070",
            "--line-rate",
            "200Mbit",
            "--size",
            "64KiB",
        ])
        .unwrap();
        let Command::Send(s) = c.command else {
            panic!("not send")
        };
        assert_eq!(s.to, "127.0.0.1:7070".parse().unwrap());
        assert_eq!(s.common.line_rate, 200_000_000);
        assert_eq!(s.common.size, 65536);
        for rate in ["25G", "25Gbit", "200M", "1.5Gbit"] {
            assert!(
                Cli::try_parse_from(["gradwire", "demo", "--line-rate", rate]).is_ok(),
                "{rate}"
            );
        }
        let e = Cli::try_parse_from(["gradwire", "demo", "--line-rate", "25Gbps"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&parse_rate("25Gbps").unwrap_err().to_string()),
            "{e}"
        );
        let e = Cli::try_parse_from(["gradwire", "recv", "--listen", "hostb"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"hostb\" has no port"), "{e}");
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "gradwire",
            "demo",
            "--datapath",
            "loopback",
            "--size",
            "1MiB",
            "--inject-loss",
            "0.05",
            "--loss-bound",
            "0.01",
            "--json",
        ])
        .unwrap();
        let Command::Demo(d) = c.command else {
            panic!("not demo")
        };
        assert_eq!(d.common.size, 1 << 20);
        assert!(d.common.json);
        assert!(Cli::try_parse_from(["gradwire", "demo", "--loss-bound", "2"]).is_err());
        let c = Cli::try_parse_from([
            "gradwire",
            "testbed",
            "up",
            "t.toml",
            "--xdp-mode",
            "native",
            "--seed",
            "7",
        ])
        .unwrap();
        let Command::Testbed(TestbedArgs {
            command: TestbedCommand::Up(u),
        }) = c.command
        else {
            panic!("not testbed up")
        };
        assert_eq!(u.fabric.xdp_mode, gradwire_ebpf::AttachMode::Native);
        assert_eq!(u.fabric.seed, 7);
        let c = Cli::try_parse_from(["gradwire", "fabric", "run", "t.toml"]).unwrap();
        let Command::Fabric(FabricArgs {
            command: FabricCommand::Run(r),
        }) = c.command
        else {
            panic!("not fabric run")
        };
        assert_eq!(r.fabric.xdp_mode, gradwire_ebpf::AttachMode::Generic);
        assert_eq!(r.max_lag_us, 1000);
        assert!(
            Cli::try_parse_from(["gradwire", "fabric", "stats", "--json", "--watch", "1"]).is_ok()
        );
        assert!(
            Cli::try_parse_from(["gradwire", "testbed", "up", "t.toml", "--xdp-mode", "x"])
                .is_err()
        );
    }
}
