//! The `gradwire-ctl` command line, as a library function so tests (and the hw-configs
//! generator) run it in-process.
//!
//! ```text
//! gradwire-ctl render --target sonic|sonic-patch|onyx|nvue|mlnx-qos|dcb|fabric
//!                     --base-threshold 64KiB --step 0.5 --ports Ethernet0..60:4
//!                     [--asic spectrum1] [--policy FILE] [--buffer 512KiB] [--current FILE]
//! gradwire-ctl thresholds --model FILE [--buffer SIZE] [--theta 0.5] [--arrival-rate 95]
//!                     [--service-rate 100] [--emit-policy FILE] [--json] ...
//! gradwire-ctl validate FILE [--target T]
//! gradwire-ctl diff --target T --current FILE [render's policy flags]
//! gradwire-ctl gen-hw-configs [--out DIR] [--check]
//! ```

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::asic::Asic;
use crate::model::{load_model, ModelError};
use crate::optimizer::{self, OptError, Params, Solution};
use crate::policy::{Policy, PolicyError, ThresholdSpec, DATA_QUEUES};
use crate::policy_file::{load_policy, policy_to_toml, FileError};
use crate::render::{self, parse_port_list, sonic, PortListError, RenderError, Target};
use gradwire_units::{parse_size, Bytes, UnitError};

/// gradwire switch control: render QoS configs for switches and NICs, optimise thresholds.
#[derive(Debug, Parser)]
#[command(name = "gradwire-ctl", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Render a QoS policy for one target to stdout.
    Render(RenderArgs),
    /// Optimise per-queue thresholds for a model (DLCP Appendix B).
    Thresholds(ThresholdArgs),
    /// Check a policy file.
    Validate(ValidateArgs),
    /// Show what applying the policy would change on a switch, from its current config.
    Diff(DiffArgs),
    /// Regenerate hw-configs/ (or check it is up to date).
    GenHwConfigs(GenArgs),
}

/// The flags that make a policy.
#[derive(Debug, Clone, Default, Args)]
pub struct PolicyArgs {
    /// Lowest threshold T (queue 6, front layers), e.g. 64KiB (KiB = 1024, KB = 1000).
    // Values may start with '-' so that `--base-threshold -5` reaches the size parser and its
    // clear message instead of failing in clap as an unknown flag (same for the other
    // numeric flags below).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub base_threshold: Option<String>,
    /// Step d >= 0: queue 6-k gets T*(1+k*d).
    #[arg(long, value_name = "D", allow_negative_numbers = true)]
    pub step: Option<f64>,
    /// Ports: comma-separated; PREFIXa..b or PREFIXa..b:step expand (Ethernet0..60:4, 1/1..16).
    #[arg(long, value_name = "LIST")]
    pub ports: Option<String>,
    /// Switch ASIC, for cell rounding: spectrum1..spectrum5.
    #[arg(long, value_name = "ASIC")]
    pub asic: Option<String>,
    /// Policy file (TOML, or JSON by extension); the other flags override it.
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// Per-port buffer the thresholds must fit in (default 512KiB, at most 1GiB).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub buffer: Option<String>,
    /// Name of the SONiC maps and profiles (default GRADWIRE).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
}

/// `render`.
#[derive(Debug, Args)]
pub struct RenderArgs {
    /// sonic, sonic-patch, onyx, nvue, mlnx-qos, dcb or fabric.
    #[arg(long, value_name = "TARGET")]
    pub target: Target,
    /// Policy flags.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// sonic-patch only: the switch's config (`sonic-cfggen -d --print-data`) to patch
    /// exactly against.
    #[arg(long, value_name = "FILE")]
    pub current: Option<PathBuf>,
}

/// `thresholds`.
#[derive(Debug, Args)]
pub struct ThresholdArgs {
    /// Model file: per-layer parameter counts (control/models/*.toml).
    #[arg(long, value_name = "FILE")]
    pub model: PathBuf,
    /// Port buffer B (default 512KiB).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub buffer: Option<String>,
    /// Small-gradient share θ (default 0.5).
    #[arg(long, allow_negative_numbers = true)]
    pub theta: Option<f64>,
    /// Total arrival rate λ (any unit, same as --service-rate; default 95).
    #[arg(long, value_name = "RATE", allow_negative_numbers = true)]
    pub arrival_rate: Option<f64>,
    /// Total service rate μ (default 100).
    #[arg(long, value_name = "RATE", allow_negative_numbers = true)]
    pub service_rate: Option<f64>,
    /// Packet size (default 1500).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub packet_size: Option<String>,
    /// c^S: small-gradient loss cost, one value or 7 (queue 0 first; default 1).
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    pub cost_small: Option<String>,
    /// c^L: large-gradient loss cost, one value or 7 (queue 0 first; default 10).
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    pub cost_large: Option<String>,
    /// Exponent e of f(r) = c·w·r^e (default 1).
    #[arg(long, value_name = "E", allow_negative_numbers = true)]
    pub cost_exponent: Option<f64>,
    /// Do not weight costs by the queue's share of the model.
    #[arg(long)]
    pub no_share_weight: bool,
    /// Most buffer units in the exact search (default 1024).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_units: Option<u32>,
    /// Also compare with the arithmetic sequence for this step (besides the defaults).
    #[arg(long, value_name = "D", allow_negative_numbers = true)]
    pub step: Option<f64>,
    /// Write a policy file with the optimised thresholds (for `render --policy`).
    #[arg(long, value_name = "FILE")]
    pub emit_policy: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The policy file.
    pub file: PathBuf,
    /// Also check it renders for this target (port names, units). Without it the port
    /// names are still checked: all of them must be legal for at least one target.
    #[arg(long, value_name = "TARGET")]
    pub target: Option<Target>,
}

/// `diff`.
#[derive(Debug, Args)]
pub struct DiffArgs {
    /// sonic (or sonic-patch), onyx or nvue.
    #[arg(long, value_name = "TARGET")]
    pub target: Target,
    /// Current config: config_db JSON for SONiC, the running commands for Onyx/NVUE.
    #[arg(long, value_name = "FILE")]
    pub current: PathBuf,
    /// Policy flags.
    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// `gen-hw-configs`.
#[derive(Debug, Args)]
pub struct GenArgs {
    /// Output directory.
    #[arg(long, value_name = "DIR", default_value = "hw-configs")]
    pub out: PathBuf,
    /// Do not write; fail if any file differs.
    #[arg(long)]
    pub check: bool,
}

/// What can go wrong on the command line.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad arguments, or --help / --version.
    #[error("{0}")]
    Clap(#[from] clap::Error),
    /// A flag's value.
    #[error("--{flag}: {source}")]
    Unit {
        /// Flag.
        flag: &'static str,
        /// Why.
        source: UnitError,
    },
    /// A flag's value.
    #[error("--{flag}: {message}")]
    Flag {
        /// Flag.
        flag: &'static str,
        /// Why.
        message: String,
    },
    /// --ports.
    #[error("--ports: {0}")]
    Ports(#[from] PortListError),
    /// A policy file.
    #[error(transparent)]
    File(#[from] FileError),
    /// Rendering.
    #[error(transparent)]
    Render(#[from] RenderError),
    /// The policy built from flags.
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyError),
    /// A model file.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The optimizer.
    #[error("thresholds: {0}")]
    Opt(#[from] OptError),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A current-config file that is not JSON.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// Writing to stdout failed.
    #[error("writing output: {0}")]
    Output(std::io::Error),
    /// gen-hw-configs --check found differences.
    #[error("hw-configs out of date ({0}); run scripts/gen-hw-configs.sh")]
    Stale(String),
}

/// Default T and d for host targets, which do not use thresholds.
const HOST_DEFAULT: (Bytes, f64) = (Bytes(64 * 1024), 0.5);

/// Build the policy from flags (and a policy file). Not validated.
pub fn build_policy(a: &PolicyArgs, target: Option<Target>) -> Result<Policy, CliError> {
    let base = a
        .base_threshold
        .as_deref()
        .map(|s| {
            parse_size(s).map_err(|source| CliError::Unit {
                flag: "base-threshold",
                source,
            })
        })
        .transpose()?;
    let mut p = match &a.policy {
        Some(f) => {
            let mut p = load_policy(f)?;
            p.thresholds = match (base, a.step, &p.thresholds) {
                (None, None, t) => t.clone(),
                (Some(b), Some(d), _) => ThresholdSpec::Arithmetic { base: b, step: d },
                (Some(b), None, ThresholdSpec::Arithmetic { step, .. }) => {
                    ThresholdSpec::Arithmetic {
                        base: b,
                        step: *step,
                    }
                }
                (None, Some(d), ThresholdSpec::Arithmetic { base, .. }) => {
                    ThresholdSpec::Arithmetic {
                        base: *base,
                        step: d,
                    }
                }
                (b, _, ThresholdSpec::Explicit(_)) => {
                    // Name the flag that was given alone, not the one that is missing.
                    return Err(CliError::Flag {
                        flag: if b.is_some() { "base-threshold" } else { "step" },
                        message: format!(
                            "{} has explicit thresholds; give both --base-threshold and --step to replace them",
                            f.display()
                        ),
                    });
                }
            };
            p
        }
        None => {
            let (b, d) = match (base, a.step) {
                (Some(b), Some(d)) => (b, d),
                _ if target.is_some_and(Target::is_host) => (
                    base.unwrap_or(HOST_DEFAULT.0),
                    a.step.unwrap_or(HOST_DEFAULT.1),
                ),
                (None, _) => {
                    return Err(CliError::Flag {
                        flag: "base-threshold",
                        message: "missing (or give --policy FILE)".into(),
                    })
                }
                (Some(_), None) => {
                    return Err(CliError::Flag {
                        flag: "step",
                        message: "missing (or give --policy FILE)".into(),
                    })
                }
            };
            Policy::gradwire(ThresholdSpec::Arithmetic { base: b, step: d })
        }
    };
    if let Some(ports) = &a.ports {
        p.ports = parse_port_list(ports)?;
    }
    if let Some(asic) = &a.asic {
        p.asic = Some(asic.parse::<Asic>().map_err(|e| CliError::Flag {
            flag: "asic",
            message: e.to_string(),
        })?);
    }
    if let Some(b) = &a.buffer {
        p.port_buffer = parse_size(b).map_err(|source| CliError::Unit {
            flag: "buffer",
            source,
        })?;
    }
    if let Some(n) = &a.name {
        p.name = n.clone();
    }
    Ok(p)
}

fn read(path: &Path) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|source| CliError::Io {
        path: path.into(),
        source,
    })
}

fn read_json(path: &Path) -> Result<serde_json::Value, CliError> {
    serde_json::from_str(&read(path)?).map_err(|source| CliError::Json {
        path: path.into(),
        source,
    })
}

/// Run the command line `args` (program name first), writing results to `out`. Warnings
/// (see [`run_with_warnings`]) are dropped.
pub fn run<I, T>(args: I, out: &mut dyn Write) -> Result<(), CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run_with_warnings(args, out, &mut std::io::sink())
}

/// Run the command line `args` (program name first), writing results to `out` and
/// warnings for the operator (things the output cannot change or cannot see, e.g. SONiC's
/// lossless buffer settings) to `warn`. The binary passes stdout and stderr.
pub fn run_with_warnings<I, T>(
    args: I,
    out: &mut dyn Write,
    warn: &mut dyn Write,
) -> Result<(), CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args)?;
    let mut warnings = Vec::new();
    let text = match cli.command {
        Command::Render(a) => render_cmd(&a, &mut warnings)?,
        Command::Thresholds(a) => thresholds_cmd(&a)?,
        Command::Validate(a) => validate_cmd(&a)?,
        Command::Diff(a) => diff_cmd(&a)?,
        Command::GenHwConfigs(a) => gen_cmd(&a)?,
    };
    out.write_all(text.as_bytes()).map_err(CliError::Output)?;
    for w in &warnings {
        let prefix = if w.starts_with("WARNING") {
            "gradwire-ctl: "
        } else {
            ""
        };
        writeln!(warn, "{prefix}{w}").map_err(CliError::Output)?;
    }
    Ok(())
}

/// The flag a policy error is about, when that value came from a flag (not the file).
fn flag_of(a: &PolicyArgs, e: &PolicyError) -> Option<&'static str> {
    let given = |v: bool, flag: &'static str| v.then_some(flag);
    match e {
        PolicyError::ZeroBase => given(a.base_threshold.is_some(), "base-threshold"),
        PolicyError::BadStep { .. } | PolicyError::StepTooSmall { .. } => {
            given(a.step.is_some(), "step")
        }
        PolicyError::ThresholdOverflow { .. } => given(a.step.is_some(), "step")
            .or_else(|| given(a.base_threshold.is_some(), "base-threshold")),
        PolicyError::ZeroBuffer | PolicyError::BufferTooLarge { .. } => {
            given(a.buffer.is_some(), "buffer")
        }
        PolicyError::BadName { .. } => given(a.name.is_some(), "name"),
        PolicyError::DuplicatePort { .. } => given(a.ports.is_some(), "ports"),
        _ => None,
    }
}

/// A render error, with policy errors about a flag's value reported against the flag
/// (`--step: ...`) rather than the policy-file field (`field `thresholds.step`: ...`).
fn flag_error(a: &PolicyArgs, e: RenderError) -> CliError {
    match e {
        RenderError::Policy(pe) => match flag_of(a, &pe) {
            Some(flag) => {
                let m = pe.to_string();
                let message = m
                    .strip_prefix("field `")
                    .and_then(|r| r.split_once("`: "))
                    .map_or(m.clone(), |(_, rest)| rest.to_string());
                CliError::Flag { flag, message }
            }
            None => CliError::Render(RenderError::Policy(pe)),
        },
        e => CliError::Render(e),
    }
}

fn render_cmd(a: &RenderArgs, warnings: &mut Vec<String>) -> Result<String, CliError> {
    let p = build_policy(&a.policy, Some(a.target))?;
    let fe = |e| flag_error(&a.policy, e);
    let text = match (&a.current, a.target) {
        (None, t) => render::render(&p, t).map_err(fe)?,
        (Some(c), Target::SonicPatch) => {
            render::check(&p, Target::SonicPatch).map_err(fe)?;
            let cur = read_json(c)?;
            let text = sonic::render_patch(&p, Some(&cur)).map_err(|e| with_file(e, c))?;
            warnings.extend(sonic::warnings(&p, Some(&cur), false));
            return Ok(text);
        }
        (Some(_), t) => {
            return Err(CliError::Flag {
                flag: "current",
                message: format!(
                    "only for --target sonic-patch (not {t}); see `gradwire-ctl diff`"
                ),
            })
        }
    };
    match a.target {
        Target::Sonic => warnings.extend(sonic::warnings(&p, None, true)),
        Target::SonicPatch => warnings.extend(sonic::warnings(&p, None, false)),
        _ => {}
    }
    Ok(text)
}

fn with_file(e: RenderError, path: &Path) -> RenderError {
    match e {
        RenderError::Current(m) => RenderError::Current(format!("{}: {m}", path.display())),
        e => e,
    }
}

fn validate_cmd(a: &ValidateArgs) -> Result<String, CliError> {
    let p = crate::policy_file::load_valid_policy(&a.file)?;
    // Without --target, port names must still be legal for at least one target (all of
    // them for the same one); with it, for that target.
    let fits = render::targets_for_ports(&p.ports);
    if a.target.is_none() && fits.is_empty() {
        return Err(FileError::Field {
            path: a.file.clone(),
            field: "ports".into(),
            message: render::no_target_message(&p.ports),
        }
        .into());
    }
    if let Some(t) = a.target {
        render::render(&p, t)?;
    }
    let th = p.thresholds()?;
    let mut s = format!("{}: ok\n", a.file.display());
    let list: Vec<String> = th
        .iter()
        .rev()
        .map(|t| format!("q{}={}", t.queue, t.effective.0))
        .collect();
    let _ = writeln!(s, "  thresholds (bytes, effective): {}", list.join(" "));
    let _ = writeln!(
        s,
        "  port buffer {} B, {} ports, asic {}",
        p.port_buffer.0,
        p.ports.len(),
        p.asic.map_or("-", |x| x.name())
    );
    match a.target {
        Some(t) => {
            let _ = writeln!(s, "  renders for {t}");
        }
        None if !p.ports.is_empty() => {
            let names: Vec<&str> = fits.iter().map(|t| t.name()).collect();
            let _ = writeln!(
                s,
                "  port names legal for: {} (give --target to check one target fully)",
                names.join(", ")
            );
        }
        None => {}
    }
    Ok(s)
}

fn diff_cmd(a: &DiffArgs) -> Result<String, CliError> {
    let p = build_policy(&a.policy, Some(a.target))?;
    render::check(&p, a.target).map_err(|e| flag_error(&a.policy, e))?;
    match a.target {
        Target::Sonic | Target::SonicPatch => {
            let cur = read_json(&a.current)?;
            let objs = sonic::objects(&p)?;
            let plan = sonic::plan(&objs, &cur).map_err(|e| with_file(e, &a.current))?;
            let mut s = sonic::render_changes(&plan);
            for w in sonic::warnings(&p, Some(&cur), false) {
                let _ = writeln!(s, "# {w}");
            }
            Ok(s)
        }
        Target::Onyx | Target::Nvue => {
            let current = read(&a.current)?;
            let have: std::collections::HashSet<&str> = current
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .collect();
            let rendered = render::render(&p, a.target)?;
            let cmds: Vec<&str> = rendered
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .collect();
            let new: Vec<&&str> = cmds.iter().filter(|c| !have.contains(**c)).collect();
            let mut s = format!(
                "# {}: {} of {} commands not in the current config (lines compared verbatim; removals are not detected)\n",
                a.target,
                new.len(),
                cmds.len()
            );
            for c in new {
                let _ = writeln!(s, "+ {c}");
            }
            Ok(s)
        }
        t => Err(CliError::Flag {
            flag: "target",
            message: format!(
                "no diff for host target {t}: the host scripts are idempotent, rerun them"
            ),
        }),
    }
}

fn parse_costs(flag: &'static str, s: &str) -> Result<[f64; DATA_QUEUES], CliError> {
    let vals: Result<Vec<f64>, _> = s.split(',').map(|v| v.trim().parse::<f64>()).collect();
    let vals = vals.map_err(|e| CliError::Flag {
        flag,
        message: format!("{s:?}: {e}"),
    })?;
    match vals.len() {
        1 => Ok([vals[0]; DATA_QUEUES]),
        DATA_QUEUES => {
            let mut out = [0.0; DATA_QUEUES];
            out.copy_from_slice(&vals);
            Ok(out)
        }
        n => Err(CliError::Flag {
            flag,
            message: format!("give 1 or {DATA_QUEUES} values (queue 0 first), got {n}"),
        }),
    }
}

/// Optimizer parameters from the flags.
pub fn params_from(a: &ThresholdArgs) -> Result<Params, CliError> {
    let mut p = Params::default();
    if let Some(b) = &a.buffer {
        p.buffer = parse_size(b).map_err(|source| CliError::Unit {
            flag: "buffer",
            source,
        })?;
    }
    if let Some(s) = &a.packet_size {
        p.packet_size = parse_size(s).map_err(|source| CliError::Unit {
            flag: "packet-size",
            source,
        })?;
    }
    if let Some(t) = a.theta {
        p.theta = t;
    }
    if let Some(r) = a.arrival_rate {
        p.arrival_rate = r;
    }
    if let Some(r) = a.service_rate {
        p.service_rate = r;
    }
    if let Some(c) = &a.cost_small {
        p.cost.small = parse_costs("cost-small", c)?;
    }
    if let Some(c) = &a.cost_large {
        p.cost.large = parse_costs("cost-large", c)?;
    }
    if let Some(e) = a.cost_exponent {
        p.cost.exponent = e;
    }
    p.cost.weight_by_share = !a.no_share_weight;
    if let Some(u) = a.max_units {
        p.max_units = u;
    }
    Ok(p)
}

/// The JSON report of `thresholds --json`.
#[derive(Debug, serde::Serialize)]
struct Report<'a> {
    model: &'a str,
    layers: usize,
    params: u64,
    parameters: &'a Params,
    optimized: &'a Solution,
    arithmetic: &'a [optimizer::ArithmeticBaseline],
    best_arithmetic_cost: Option<f64>,
}

fn thresholds_cmd(a: &ThresholdArgs) -> Result<String, CliError> {
    let model = load_model(&a.model)?;
    let p = params_from(a)?;
    let opt = optimizer::optimize(&model, &p)?;
    let mut steps = optimizer::BASELINE_STEPS.to_vec();
    if let Some(d) = a.step {
        if !(d.is_finite() && d >= 0.0) {
            return Err(CliError::Flag {
                flag: "step",
                message: "must be a finite number >= 0".into(),
            });
        }
        if !steps.contains(&d) {
            steps.push(d);
        }
    }
    let base = optimizer::best_arithmetic(&model, &p, &steps, 24)?;
    let best = base
        .iter()
        .map(|b| b.solution.total_cost)
        .fold(None, |m: Option<f64>, c| Some(m.map_or(c, |m| m.min(c))));

    if let Some(path) = &a.emit_policy {
        let mut pol = Policy::gradwire(ThresholdSpec::Explicit(opt.thresholds()));
        pol.port_buffer = p.buffer;
        pol.validate().map_err(|source| FileError::Invalid {
            path: path.clone(),
            source,
        })?;
        let header = format!(
            "gradwire QoS policy with thresholds optimised by `gradwire-ctl thresholds` (DLCP Appendix B)\n\
             model {} ({} layers), θ = {}, λ = {}, μ = {}, buffer {} B, packets {} B\n\
             modelled cost {:.6e} (best arithmetic sequence: {})\n\
             render with: gradwire-ctl render --policy THIS_FILE --target ... --ports ...",
            model.name,
            model.layers.len(),
            p.theta,
            p.arrival_rate,
            p.service_rate,
            p.buffer.0,
            p.packet_size.0,
            opt.total_cost,
            best.map_or("none fits".into(), |c| format!("{c:.6e}")),
        );
        std::fs::write(path, policy_to_toml(&pol, &header)).map_err(|source| CliError::Io {
            path: path.clone(),
            source,
        })?;
    }

    if a.json {
        let r = Report {
            model: &model.name,
            layers: model.layers.len(),
            params: model.params(),
            parameters: &p,
            optimized: &opt,
            arithmetic: &base,
            best_arithmetic_cost: best,
        };
        let mut s = serde_json::to_string_pretty(&r).map_err(|e| CliError::Flag {
            flag: "json",
            message: e.to_string(),
        })?;
        s.push('\n');
        return Ok(s);
    }

    let mut s = String::new();
    let _ = writeln!(
        s,
        "model {}: {} layers, {} parameters ({} B of gradients)",
        model.name,
        model.layers.len(),
        model.params(),
        model
            .params()
            .saturating_mul(u64::from(model.bytes_per_param))
    );
    let _ = writeln!(
        s,
        "theta {}, arrival {} / service {} (load {:.3}), buffer {} B, packets {} B",
        p.theta,
        p.arrival_rate,
        p.service_rate,
        p.arrival_rate / p.service_rate,
        p.buffer.0,
        p.packet_size.0
    );
    let _ = writeln!(
        s,
        "cost f_S = {:?}*w*r^{}, f_L = {:?}*w*r^{} (w = queue share: {})",
        p.cost.small[0], p.cost.exponent, p.cost.large[0], p.cost.exponent, p.cost.weight_by_share
    );
    let _ = writeln!(s);
    table(&mut s, &opt);
    let _ = writeln!(s, "optimised cost: {:.6e}", opt.total_cost);
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "arithmetic sequence T*(1, ..., 1+6d), best T per d, queue sizes optimised:"
    );
    for b in &base {
        let _ = writeln!(
            s,
            "  d = {:<5} T = {:>7} B  cost {:.6e}",
            b.step, b.base.0, b.solution.total_cost
        );
    }
    if base.is_empty() {
        let _ = writeln!(s, "  no arithmetic sequence fits the buffer");
    }
    if let Some(b) = best {
        let _ = writeln!(
            s,
            "best arithmetic cost {:.6e}; optimised / arithmetic = {:.4}",
            b,
            opt.total_cost / b
        );
    }
    if let Some(path) = &a.emit_policy {
        let _ = writeln!(s, "policy written to {}", path.display());
    }
    Ok(s)
}

fn table(s: &mut String, sol: &Solution) {
    let _ = writeln!(
        s,
        "queue  layers   share    rho      S'(pk)  L'(pk)  threshold B  queue B   r_small    r_large    cost"
    );
    for q in &sol.queues {
        let layers = q
            .load
            .layers
            .map_or("-".to_string(), |(a, b)| format!("{a}-{b}"));
        let _ = writeln!(
            s,
            "  {}    {:<7}  {:<7.4}  {:<7.4}  {:>6.1}  {:>6.1}  {:>11}  {:>8}  {:<9.3e}  {:<9.3e}  {:.3e}",
            q.load.queue,
            layers,
            q.load.share,
            q.load.rho,
            q.small_packets,
            q.large_packets,
            q.threshold.0,
            q.queue_size.0,
            q.loss_small,
            q.loss_large,
            q.cost
        );
    }
}

fn gen_cmd(a: &GenArgs) -> Result<String, CliError> {
    let files = crate::hwconfigs::generate()?;
    if a.check {
        let stale = crate::hwconfigs::compare(&a.out, &files);
        return if stale.is_empty() {
            Ok(format!(
                "{}: {} files up to date\n",
                a.out.display(),
                files.len()
            ))
        } else {
            Err(CliError::Stale(stale.join(", ")))
        };
    }
    for (rel, text) in &files {
        let path = a.out.join(rel);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| CliError::Io {
                path: dir.into(),
                source,
            })?;
        }
        std::fs::write(&path, text).map_err(|source| CliError::Io {
            path: path.clone(),
            source,
        })?;
    }
    Ok(format!(
        "wrote {} files under {}\n",
        files.len(),
        a.out.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_str(args: &[&str]) -> Result<String, CliError> {
        let mut out = Vec::new();
        let mut full = vec!["gradwire-ctl"];
        full.extend_from_slice(args);
        run(full, &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn render_needs_thresholds_for_switches_only() {
        let e = run_str(&["render", "--target", "sonic", "--ports", "Ethernet0"]).unwrap_err();
        assert!(e.to_string().contains("--base-threshold"), "{e}");
        let e = run_str(&[
            "render",
            "--target",
            "sonic",
            "--base-threshold",
            "64KiB",
            "--ports",
            "Ethernet0",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("--step"), "{e}");
        run_str(&["render", "--target", "dcb"]).unwrap();
    }

    #[test]
    fn flag_errors_are_clear() {
        let e = run_str(&[
            "render",
            "--target",
            "sonic",
            "--base-threshold",
            "64QB",
            "--step",
            "1",
        ])
        .unwrap_err();
        assert!(e.to_string().starts_with("--base-threshold:"), "{e}");
        let e = run_str(&["render", "--target", "cisco"]).unwrap_err();
        assert!(e.to_string().contains("unknown target"), "{e}");
        let e = run_str(&[
            "render",
            "--target",
            "onyx",
            "--base-threshold",
            "1KiB",
            "--step",
            "1",
            "--ports",
            "Ethernet0",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("not a legal name"), "{e}");
        let e = run_str(&[
            "render",
            "--target",
            "onyx",
            "--base-threshold",
            "1KiB",
            "--step",
            "1",
            "--ports",
            "1/1",
            "--current",
            "x.json",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("--current"), "{e}");
        let e = run_str(&["thresholds", "--model", "/nonexistent.toml"]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent.toml"), "{e}");
    }

    #[test]
    fn cost_lists() {
        assert_eq!(parse_costs("x", "2").unwrap(), [2.0; 7]);
        assert_eq!(parse_costs("x", "0,1,2,3,4,5,6").unwrap()[6], 6.0);
        assert!(parse_costs("x", "1,2").is_err());
        assert!(parse_costs("x", "a").is_err());
    }
}
