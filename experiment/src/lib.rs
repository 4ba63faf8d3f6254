//! Experiments and network benchmarks that run in network namespaces: [`netbench`]
//! (`gradwire bench`: AF_XDP against kernel UDP between two namespaces), [`fabricbench`]
//! (`gradwire-fabric-bench`: the emulated switch's forwarding rate per core against kernel
//! forwarding), [`mlnet`] (`gradwire experiment mlnet / priority`: MLNET's aggregation trees
//! and job priorities), [`wan`] (`gradwire experiment wan`: NetStorm's strategies on the
//! emulated WAN, one `gradwire wan node` per site through `gradwire-launch`), and, at the top
//! level, the incast experiment below.
//!
//! The DLCP parameter-server incast (§5.2's direction) on the emulated leaf-spine, gradwire
//! against kernel TCP on the same topology and workload.
//!
//! Workload: every worker pushes one gradient tensor per layer of a model (ResNet-50 by
//! default, sizes from the shipped layer file, scaled by `scale` so that an iteration takes
//! about a second at the emulated link rates) to the parameter servers, back layers first as
//! backpropagation produces them, then pulls the same tensors back, front layers first.
//! Tensors go to a server chosen at random (seeded, the same for every worker); a tensor
//! larger than `split_bytes` is split evenly over all servers (as in DLCP's simulations).
//! All (worker, server) pairs run at once, so every server's link sees an incast. Each pair
//! sends its tensors back to back over one connection: a gradwire `Sender` (one flow per
//! tensor) or one TCP connection (length known to both sides, a one-byte application
//! acknowledgement after each tensor).
//!
//! A tensor's flow completion time (FCT) is measured by its sender, from the start of the
//! send to the receiver's confirmation: `Sender::send` returning (after `FlowFinish`, i.e.
//! the loss bound met) for gradwire, the acknowledgement for TCP. The iteration time is the
//! push phase plus the pull phase, each from its start until the last pair finished.
//!
//! Every delivered byte is checked against the values the sender generated; missing segments
//! (gradwire with p > 0) are counted, never wrong.
//!
//! The baselines are kernel TCP on the same fabric and flows: CUBIC, BBR, CUBIC with ECN and
//! DCTCP (gradwire-ebpf's BPF `gw_dctcp`), each optionally with the hosts' routes carrying a
//! 10 ms `rto_min` ([`Variant`]). Two [`Regime`]s ship as topology + policy files. Failures
//! never end a run: a failed flow is recorded with its reason and counted, a variant whose
//! setup fails is reported with its error, and the report ([`ExperimentReport`]) gives FCT
//! quantiles with bootstrap confidence intervals, size buckets, iteration time, drops per data
//! packet, the fabric's validity and the ratios of each gradwire variant to the best TCP
//! baseline.

pub mod fabricbench;
pub mod mlnet;
pub mod netbench;
pub mod wan;
pub mod workload;

mod flows;
mod flows_msg;
mod report;
mod tcp_host;

pub use flows::{run, Variant, VariantKind, VARIANT_GRAMMAR};
pub use flows_msg::MsgSettings;
pub use report::{
    bootstrap, csv_field, print_table, quantile, write_flows_csv, Bootstrap, BucketStats, Estimate,
    Excluded, ExperimentReport, FctSummary, FlowFailure, FlowRecord, Ratio, SizeBucket, Statistic,
    TcpSettings, VariantResult, CSV_COLUMNS,
};
pub use workload::{TensorSpec, Workload};

use std::path::{Path, PathBuf};

/// The two settings the experiment ships, each a topology + policy file in `testbeds/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Regime {
    /// `testbeds/ps-incast.toml` + `fabric-policy.toml`: 100 Mbit/s links, 20 us, switch
    /// buffers of many bandwidth-delay products; TCP keeps the kernel's 200 ms minimum RTO.
    Current,
    /// `testbeds/ps-incast-paper.toml` + `fabric-policy-paper.toml`: switch buffers of about
    /// one bandwidth-delay product per port, fan-in 8, and TCP with a 10 ms minimum RTO (DLCP's
    /// evaluation settings, scaled to the emulated links).
    Paper,
}

impl Regime {
    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Regime::Current => "current",
            Regime::Paper => "paper",
        }
    }

    /// Topology file, relative to the repository root.
    pub fn topology_file(self) -> &'static str {
        match self {
            Regime::Current => "testbeds/ps-incast.toml",
            Regime::Paper => "testbeds/ps-incast-paper.toml",
        }
    }

    /// `rto_min` of TCP variants that name none, ms (`None`: the kernel's default, 200 ms).
    pub fn tcp_rto_min_ms(self) -> Option<u32> {
        match self {
            Regime::Current => None,
            Regime::Paper => Some(10),
        }
    }

    /// The variants a default run compares: [`Variant::defaults`] plus the TCP baselines
    /// (BBR, CUBIC with ECN, and in the current regime each TCP variant again with the paper's
    /// 10 ms minimum RTO; the paper regime uses 10 ms already).
    pub fn variants(self) -> Vec<Variant> {
        let mut v = Variant::defaults();
        let at = v
            .iter()
            .position(|x| x.name == "tcp-dctcp")
            .map_or(v.len(), |i| i + 1);
        let extra: &[&str] = match self {
            Regime::Current => &[
                "tcp-bbr",
                "tcp-cubic-ecn",
                "tcp-cubic-rto10",
                "tcp-bbr-rto10",
                "tcp-cubic-ecn-rto10",
                "tcp-dctcp-rto10",
            ],
            Regime::Paper => &["tcp-bbr", "tcp-cubic-ecn"],
        };
        v.splice(at..at, Variant::list(extra));
        v
    }
}

/// Make the receiver of the first pair of the push phase of `iteration` fail after
/// `after_tensors` tensors: checks that the harness records failures and carries on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiverFault {
    /// Iteration in which it fails.
    pub iteration: u32,
    /// Tensors it receives before failing.
    pub after_tensors: usize,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct IncastConfig {
    /// Regime the settings come from (named in the report).
    pub regime: Regime,
    /// Topology file (`testbeds/ps-incast.toml`): hosts named `ps*` are servers, the others
    /// workers.
    pub topology: PathBuf,
    /// Model layer file (`control/models/resnet50.toml`).
    pub model: PathBuf,
    /// Tensor size scale (1.0 = the model's real sizes).
    pub scale: f64,
    /// Tensors larger than this (after scaling) are split over all servers.
    pub split_bytes: u64,
    /// Iterations per variant.
    pub iterations: u32,
    /// Variants to run, in order.
    pub variants: Vec<Variant>,
    /// Seed of tensor placement and contents.
    pub seed: u64,
    /// Source ports gradwire sprays over (ablation `nospray` uses 1).
    pub spray_ports: u16,
    /// gradwire's rate-control period (the receiver's RateReport interval), ns. The paper's
    /// 200 us is about 2.4 base RTTs of its 100G network; the emulated links are 500 times
    /// slower and their RTT is several times longer, so the default scales it to 2 ms.
    pub period_ns: u64,
    /// `rto_min` of TCP variants that do not name one (`-rto<ms>`), ms; `None`: the kernel's.
    pub tcp_rto_min_ms: Option<u32>,
    /// Confidence intervals.
    pub bootstrap: Bootstrap,
    /// Fault injection for the harness's own tests; `None` in real runs.
    pub receiver_fault: Option<ReceiverFault>,
}

impl IncastConfig {
    /// The defaults of `regime` with files under the repository root `root`: ResNet-50 at
    /// 1/32 scale, tensors above 4 MB x scale split, 20 iterations, the regime's variants,
    /// seed 1, 8 spray ports, 2 ms period, 1000 bootstrap resamples at 95 %.
    pub fn new(regime: Regime, root: &Path) -> IncastConfig {
        let scale = 1.0 / 32.0;
        IncastConfig {
            regime,
            topology: root.join(regime.topology_file()),
            model: root.join("control/models/resnet50.toml"),
            scale,
            split_bytes: ((4u64 << 20) as f64 * scale) as u64,
            iterations: 20,
            variants: regime.variants(),
            seed: 1,
            spray_ports: 8,
            period_ns: 2_000_000,
            tcp_rto_min_ms: regime.tcp_rto_min_ms(),
            bootstrap: Bootstrap::default(),
            receiver_fault: None,
        }
    }
}

/// Why an experiment could not run.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// Topology.
    #[error(transparent)]
    Topology(#[from] gradwire_fabric::topology::TopologyError),
    /// Model file.
    #[error(transparent)]
    Model(#[from] gradwire_control::model::ModelError),
    /// Anything else, with context.
    #[error("{0}")]
    Other(String),
}
