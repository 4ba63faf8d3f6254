//! Why a worker or a job run failed.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use gradwire_collective::error::CollectiveError;
use gradwire_collective::job::JobError;

use crate::run::MAX_RUN_HOSTS;
use crate::workload::MAX_SCALE;

/// Why a worker or a job run failed. Every message says what to check or do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
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
    /// The job secret's key file or variable.
    #[error(transparent)]
    Secret(#[from] gradwire::job_secret::SecretError),
    /// A loss bound outside 0..=1.
    #[error(transparent)]
    LossBound(#[from] gradwire::message::CtrlError),
    /// The `--topology` file.
    #[error(transparent)]
    Topology(Box<gradwire_fabric::supervise::SuperviseError>),
    /// Building or removing the namespaces.
    #[error(transparent)]
    Netns(#[from] gradwire_netns::NetnsError),
    #[error("job host {host} is not a host of {topology}: its hosts are {known}")]
    NotTopologyHost {
        host: Ipv4Addr,
        topology: String,
        known: String,
    },
    #[error("starting the emulated fabric: {0}")]
    FabricStart(gradwire_fabric::run::FabricError),
    #[error("the testbed has fewer namespaces than hosts")]
    FewerNamespaces,
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
