//! Experiments and network benchmarks that run in network namespaces: [`netbench`]
//! (`gradwire bench`: AF_XDP against kernel UDP between two namespaces), [`fabricbench`]
//! (`gradwire-fabric-bench`: the emulated switch's forwarding rate per core against kernel
//! forwarding), and, at the top level, the incast experiment below.
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

pub mod fabricbench;
pub mod netbench;
pub mod workload;

mod flows;
mod report;

pub use flows::{run, Variant, VariantKind};
pub use report::{print_table, quantile, ExperimentReport, VariantResult};
pub use workload::{TensorSpec, Workload};

use std::path::PathBuf;

/// What to run.
#[derive(Debug, Clone)]
pub struct IncastConfig {
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
    /// Namespaces.
    #[error(transparent)]
    Testbed(#[from] gradwire_netns::NetnsError),
    /// Fabric.
    #[error(transparent)]
    Fabric(#[from] gradwire_fabric::run::FabricError),
    /// Anything else, with context.
    #[error("{0}")]
    Other(String),
}
