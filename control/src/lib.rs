//! gradwire switch control: the QoS policy DLCP needs from switches and NICs, rendered for
//! each target, and the threshold optimizer of DLCP Appendix B.
//!
//! - [`asic`]: the switch ASICs whose buffer cell size is known. Sizes (bytes, Onyx KB,
//!   cells) and their grammar are `gradwire_units`, shared with the `gradwire` CLI and the
//!   topology files.
//! - [`policy`]: the typed policy (DSCP -> traffic class -> queue, strict priority, one
//!   ECN/drop threshold per data queue) and its validation. The traffic classes themselves
//!   (layer -> priority -> queue -> DSCP) come from `gradwire-qos`, the definition the data
//!   plane tags packets with.
//! - [`policy_file`]: TOML/JSON policy files.
//! - [`mod@render`]: SONiC (config_db fragment, JSON Patch, diff), Onyx, NVUE, `mlnx_qos`, `dcb`.
//! - [`model`] and [`optimizer`]: per-layer model sizes and the M/M/1/m threshold optimizer.
//! - [`cli`]: the `gradwire-ctl` command line; [`hwconfigs`]: the files under `hw-configs/`.
//!
//! `docs/switch-control.md` describes the model, every output, units and rounding, the
//! optimizer's mathematics and how to apply configurations safely.

pub mod asic;
pub mod cli;
pub mod hwconfigs;
pub mod model;
pub mod optimizer;
pub mod policy;
pub mod policy_file;
pub mod render;

pub use asic::Asic;
pub use gradwire_units::{Bytes, Cells, Kilobytes};
pub use policy::{Policy, PolicyError, ThresholdSpec};
pub use render::{render, RenderError, Target};
