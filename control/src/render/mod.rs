//! Renderers: one [`Policy`] to the configuration syntax of each target.
//!
//! | target | output | threshold unit |
//! |---|---|---|
//! | [`Target::Sonic`] | `config_db.json` fragment | bytes |
//! | [`Target::SonicPatch`] | JSON Patch for `config apply-patch` | bytes |
//! | [`Target::Onyx`] | Onyx CLI commands | KB (1024 B) |
//! | [`Target::Nvue`] | Cumulus NVUE `nv set` commands | bytes |
//! | [`Target::MlnxQos`] | `mlnx_qos` shell script for ConnectX hosts | none (hosts do not mark) |
//! | [`Target::Dcb`] | iproute2 `dcb` shell script | none |
//! | [`Target::Fabric`] | JSON for gradwire's emulated switch (`fabric/`) | bytes |
//!
//! Only syntax listed in `/work/shared/reference/switch-qos-formats.md` is emitted. Where a
//! target has no known command for part of the policy (Onyx's DSCP map, removing an NVUE
//! setting) the output says so in a comment and lists what must be configured by hand.
//! With a known ASIC, byte thresholds are rounded up to whole cells; every text output
//! carries a comment table of requested and effective thresholds.

use std::fmt;
use std::str::FromStr;

use crate::policy::{Policy, PolicyError, QueueThreshold, DATA_QUEUES};

pub mod fabric;
mod host;
mod json;
mod nvue;
mod onyx;
pub mod sonic;

pub use json::Json;

/// An output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// SONiC `config_db.json` fragment.
    Sonic,
    /// SONiC JSON Patch for `config apply-patch`.
    SonicPatch,
    /// NVIDIA Onyx CLI.
    Onyx,
    /// Cumulus Linux NVUE.
    Nvue,
    /// ConnectX host, `mlnx_qos`.
    MlnxQos,
    /// Linux host, iproute2 `dcb`.
    Dcb,
    /// gradwire's emulated switch (`gradwire-fabric`).
    Fabric,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 7] = [
        Target::Sonic,
        Target::SonicPatch,
        Target::Onyx,
        Target::Nvue,
        Target::MlnxQos,
        Target::Dcb,
        Target::Fabric,
    ];

    /// Name on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Target::Sonic => "sonic",
            Target::SonicPatch => "sonic-patch",
            Target::Onyx => "onyx",
            Target::Nvue => "nvue",
            Target::MlnxQos => "mlnx-qos",
            Target::Dcb => "dcb",
            Target::Fabric => "fabric",
        }
    }

    /// Whether the target is a host NIC (no thresholds, ports are interfaces).
    pub const fn is_host(self) -> bool {
        matches!(self, Target::MlnxQos | Target::Dcb)
    }

    /// What a port of this target looks like, for messages.
    const fn port_form(self) -> &'static str {
        match self {
            Target::Sonic | Target::SonicPatch => "EthernetN (SONiC port name)",
            Target::Onyx => "U/P or U/P/S (Onyx interface ethernet name, e.g. 1/1)",
            Target::Nvue => "swpN or swpNsM (Cumulus port name)",
            Target::MlnxQos | Target::Dcb | Target::Fabric => {
                "a Linux interface name: 1..15 of A-Z a-z 0-9 _ . -"
            }
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Target::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown target {s:?} (sonic, sonic-patch, onyx, nvue, mlnx-qos, dcb, fabric)"
                )
            })
    }
}

/// Why a policy cannot be rendered for a target.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// The policy itself is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The target needs ports and none were given.
    #[error("target {target}: no ports given (--ports or `ports` in the policy)")]
    NoPorts {
        /// The target.
        target: Target,
    },
    /// A port name that is not legal for the target.
    #[error("target {target}: port {port:?} is not a legal name; expected {form}")]
    BadPort {
        /// The target.
        target: Target,
        /// The port.
        port: String,
        /// What a port looks like.
        form: &'static str,
    },
    /// Converting to the target's unit made two different thresholds equal.
    #[error("target {target}: queues {a} and {b} both round to {value} {unit}; use a larger step or base")]
    UnitCollapse {
        /// The target.
        target: Target,
        /// One queue.
        a: u8,
        /// The other.
        b: u8,
        /// The common value.
        value: u64,
        /// The unit.
        unit: &'static str,
    },
    /// A value does not fit the target's field.
    #[error("target {target}: {what}")]
    OutOfRange {
        /// The target.
        target: Target,
        /// What.
        what: String,
    },
    /// The current configuration given for a diff or patch is unusable.
    #[error("current configuration: {0}")]
    Current(String),
}

/// Render `policy` for `target` (for [`Target::SonicPatch`] without a current config; see
/// [`sonic::render_patch`] for the exact patch against one).
pub fn render(policy: &Policy, target: Target) -> Result<String, RenderError> {
    check(policy, target)?;
    match target {
        Target::Sonic => sonic::render_fragment(policy),
        Target::SonicPatch => sonic::render_patch(policy, None),
        Target::Onyx => onyx::render(policy),
        Target::Nvue => nvue::render(policy),
        Target::MlnxQos => host::render_mlnx_qos(policy),
        Target::Dcb => host::render_dcb(policy),
        Target::Fabric => fabric::render(policy),
    }
}

/// Validate the policy and its ports for a target.
pub fn check(policy: &Policy, target: Target) -> Result<(), RenderError> {
    policy.validate()?;
    let needs_ports = matches!(target, Target::Sonic | Target::SonicPatch | Target::Onyx);
    if needs_ports && policy.ports.is_empty() {
        return Err(RenderError::NoPorts { target });
    }
    for p in &policy.ports {
        if !port_is_legal(target, p) {
            return Err(RenderError::BadPort {
                target,
                port: p.clone(),
                form: target.port_form(),
            });
        }
    }
    Ok(())
}

/// Whether `port` is a legal port name for `target`.
pub fn port_is_legal(target: Target, port: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit());
    match target {
        Target::Sonic | Target::SonicPatch => port.strip_prefix("Ethernet").is_some_and(digits),
        Target::Onyx => {
            let parts: Vec<&str> = port.split('/').collect();
            (2..=3).contains(&parts.len()) && parts.iter().all(|p| digits(p))
        }
        Target::Nvue => port.strip_prefix("swp").is_some_and(|rest| {
            let mut it = rest.splitn(2, 's');
            let base = it.next().unwrap_or("");
            digits(base) && it.next().is_none_or(digits)
        }),
        Target::MlnxQos | Target::Dcb | Target::Fabric => {
            !port.is_empty()
                && port.len() <= 15
                && port != "."
                && port != ".."
                && port
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
        }
    }
}

/// The targets for which every one of `ports` is a legal name, in [`Target::ALL`] order
/// (every target when `ports` is empty).
pub fn targets_for_ports(ports: &[String]) -> Vec<Target> {
    Target::ALL
        .into_iter()
        .filter(|t| ports.iter().all(|p| port_is_legal(*t, p)))
        .collect()
}

/// Why no target accepts all of `ports`, for messages: a port no target accepts, or the
/// fact that the names mix the forms of different targets.
pub fn no_target_message(ports: &[String]) -> String {
    let forms: Vec<String> = [Target::Sonic, Target::Onyx, Target::Nvue, Target::Dcb]
        .into_iter()
        .map(|t| t.port_form().to_string())
        .collect();
    match ports
        .iter()
        .find(|p| Target::ALL.into_iter().all(|t| !port_is_legal(t, p)))
    {
        Some(p) => format!(
            "{p:?} is not a legal port name for any target; expected one of: {}",
            forms.join("; ")
        ),
        None => format!(
            "the port names mix the forms of different targets, so no one target accepts all of them ({}); expected one of: {}",
            ports.join(","),
            forms.join("; ")
        ),
    }
}

/// Why a `--ports` list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("port list {list:?}: {reason}")]
pub struct PortListError {
    /// The list.
    pub list: String,
    /// What is wrong.
    pub reason: String,
}

/// Most ports one list may expand to.
pub const MAX_PORTS: usize = 4096;

/// Parse a port list: comma-separated names, where `PREFIXa..b` or `PREFIXa..b:step`
/// expands to `PREFIXa`, `PREFIX(a+step)`, ... up to `b` (e.g. `Ethernet0..60:4`,
/// `1/1..16`, `swp1..32`). Names are checked per target by [`check`].
pub fn parse_port_list(list: &str) -> Result<Vec<String>, PortListError> {
    let err = |reason: String| PortListError {
        list: list.into(),
        reason,
    };
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(err("empty item".into()));
        }
        let Some((left, right)) = item.split_once("..") else {
            out.push(item.to_string());
            continue;
        };
        let digits_at = left
            .rfind(|c: char| !c.is_ascii_digit())
            .map_or(0, |i| i + 1);
        let (prefix, start) = left.split_at(digits_at);
        let (end, step) = match right.split_once(':') {
            Some((e, s)) => (e, s),
            None => (right, "1"),
        };
        let num = |s: &str, what: &str| {
            s.parse::<u32>()
                .map_err(|_| err(format!("{item:?}: {what} {s:?} is not a number")))
        };
        let (a, b, s) = (num(start, "start")?, num(end, "end")?, num(step, "step")?);
        if s == 0 || b < a {
            return Err(err(format!("{item:?}: need start <= end and step >= 1")));
        }
        let mut n = a;
        while n <= b {
            if out.len() >= MAX_PORTS {
                return Err(err(format!("more than {MAX_PORTS} ports")));
            }
            out.push(format!("{prefix}{n}"));
            n = match n.checked_add(s) {
                Some(x) => x,
                None => break,
            };
        }
    }
    Ok(out)
}

/// Comment lines describing the policy, shared by the text renderers.
pub(crate) fn summary_lines(policy: &Policy, th: &[QueueThreshold; DATA_QUEUES]) -> Vec<String> {
    let mut v = Vec::new();
    let spec = match &policy.thresholds {
        crate::policy::ThresholdSpec::Arithmetic { base, step } => format!(
            "thresholds T*(1, 1+d, ..., 1+6d), T = {} B ({base}), d = {step}; queue 6 (front layers) lowest",
            base.0
        ),
        crate::policy::ThresholdSpec::Explicit(_) => {
            "thresholds: explicit per queue (e.g. from `gradwire-ctl thresholds`)".into()
        }
    };
    v.push(spec);
    let asic = match policy.asic {
        Some(a) => format!(
            "ASIC {a}: thresholds rounded up to {}-byte cells",
            a.cell_size().0
        ),
        None => "ASIC not given: thresholds not rounded to cells".into(),
    };
    v.push(format!("{asic}; port buffer {} B", policy.port_buffer.0));
    v.push("queue  requested B  effective B  DSCPs".into());
    v.push(format!(
        "  7    control: strict, no early drop      {}",
        dscp_list(&policy.dscps_of_queue(7))
    ));
    for t in th.iter().rev() {
        v.push(format!(
            "  {}    {:>11}  {:>11}  {}",
            t.queue,
            t.requested.0,
            t.effective.0,
            dscp_list(&policy.dscps_of_queue(t.queue))
        ));
    }
    v
}

/// A short DSCP list: ranges collapsed (`0-9,11-17`).
pub(crate) fn dscp_list(d: &[u8]) -> String {
    if d.is_empty() {
        return "-".into();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < d.len() {
        let mut j = i;
        while j + 1 < d.len() && d[j + 1] == d[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            d[i].to_string()
        } else {
            format!("{}-{}", d[i], d[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// Quote a string for POSIX sh (single quotes).
pub(crate) fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_lists() {
        assert_eq!(
            parse_port_list("Ethernet0..12:4").unwrap(),
            ["Ethernet0", "Ethernet4", "Ethernet8", "Ethernet12"]
        );
        assert_eq!(parse_port_list("1/1..3").unwrap(), ["1/1", "1/2", "1/3"]);
        assert_eq!(
            parse_port_list("swp1, swp3..4").unwrap(),
            ["swp1", "swp3", "swp4"]
        );
        assert_eq!(parse_port_list("eth0").unwrap(), ["eth0"]);
        assert!(parse_port_list("").is_err());
        assert!(parse_port_list("a,,b").is_err());
        assert!(parse_port_list("Ethernet8..4").is_err());
        assert!(parse_port_list("Ethernet0..8:0").is_err());
        assert!(parse_port_list("Ethernet..8").is_err());
        assert!(parse_port_list("x0..99999999").is_err());
        assert_eq!(
            parse_port_list("p4294967295..4294967295").unwrap(),
            ["p4294967295"]
        );
    }

    #[test]
    fn port_names_per_target() {
        use Target::*;
        assert!(port_is_legal(Sonic, "Ethernet0"));
        assert!(!port_is_legal(Sonic, "Ethernet"));
        assert!(!port_is_legal(Sonic, "eth0"));
        assert!(!port_is_legal(SonicPatch, "Ethernet0|1"));
        assert!(port_is_legal(Onyx, "1/1"));
        assert!(port_is_legal(Onyx, "1/1/2"));
        assert!(!port_is_legal(Onyx, "Eth1/1"));
        assert!(!port_is_legal(Onyx, "1/"));
        assert!(port_is_legal(Nvue, "swp1"));
        assert!(port_is_legal(Nvue, "swp1s2"));
        assert!(!port_is_legal(Nvue, "swp"));
        assert!(!port_is_legal(Nvue, "swp1s"));
        assert!(port_is_legal(Dcb, "enp65s0f0np0"));
        assert!(port_is_legal(MlnxQos, "eth0.100"));
        assert!(!port_is_legal(Dcb, "a b"));
        assert!(!port_is_legal(Dcb, "$(reboot)"));
        assert!(!port_is_legal(Dcb, "sixteen-chars-xx"));
        assert!(!port_is_legal(Dcb, ".."));
    }

    #[test]
    fn targets_for_port_lists() {
        let v = |l: &[&str]| -> Vec<String> { l.iter().map(|s| s.to_string()).collect() };
        assert_eq!(targets_for_ports(&[]), Target::ALL.to_vec());
        assert_eq!(
            targets_for_ports(&v(&["Ethernet0", "Ethernet4"])),
            [
                Target::Sonic,
                Target::SonicPatch,
                Target::MlnxQos,
                Target::Dcb,
                Target::Fabric
            ]
        );
        assert_eq!(targets_for_ports(&v(&["1/1"])), [Target::Onyx]);
        assert!(targets_for_ports(&v(&["Ethernet0", "1/1"])).is_empty());
        assert!(no_target_message(&v(&["Ethernet0", "1/1"])).contains("mix"));
        assert!(no_target_message(&v(&["a b"])).contains("\"a b\" is not a legal port name"));
    }

    #[test]
    fn target_names() {
        for t in Target::ALL {
            assert_eq!(t.name().parse::<Target>(), Ok(t));
        }
        assert!("cisco".parse::<Target>().is_err());
    }

    #[test]
    fn dscp_ranges() {
        assert_eq!(dscp_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(dscp_list(&[]), "-");
        assert_eq!(sh_quote("a'b"), r"'a'\''b'");
    }
}
