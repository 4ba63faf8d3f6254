//! Topology files: hosts, switches, links (rate, delay, loss) and the QoS policy, and the
//! plan derived from them (addresses, MAC addresses, interface names, routes). Pure: reading
//! the file is the only I/O, building namespaces is [`crate::netns`]'s job.
//!
//! ```toml
//! name = "incast"                 # 1..=8 of a-z 0-9; namespaces are named after it
//! policy = "fabric-policy.toml"   # a gradwire-ctl policy file, relative to this file
//!
//! [defaults]                      # for every link that does not say otherwise
//! rate = "1Gbit"                  # bit/s: 1Gbit = 1G, 200Mbit = 200M, 1.5Gbit (gradwire-units)
//! delay = "20us"                  # one-way propagation: 20us, 2ms, 1.5ms (gradwire-units)
//! loss = 0.0                      # probability a packet is lost on the link
//! ecmp = "flow"                   # per switch: flow (5-tuple hash) or packet (spraying)
//!
//! [[switch]]
//! name = "s0"
//!
//! [[host]]
//! name = "h"                      # with count: h0, h1, ...
//! count = 3
//! uplink = "s0"                   # one link to this switch, with the defaults
//!
//! [[link]]                        # switch-switch links (or host-switch without `uplink`)
//! a = "s0"
//! b = "s1"
//! rate = "10Gbit"
//! ```
//!
//! Rates and delays are spelled as on every gradwire command line (the `gradwire-units`
//! grammar) and checked against the range the emulator runs ([`MIN_RATE_BPS`]..=
//! [`MAX_RATE_BPS`], delays up to [`MAX_DELAY`]). A topology has no address fields: every
//! address is derived from the host's position, as follows.
//!
//! Buffers, thresholds and rates that change over time (in `[defaults]` or per `[[link]]`;
//! `schedule` per switch-switch link only):
//!
//! ```toml
//! [defaults]
//! buffer = "auto"                 # per port, shared by its 8 queues: a size ("1MB", "512KiB",
//!                                 # 600000) or "auto" (the default, see below)
//! thresholds = "policy"           # the policy's per-queue ECN/drop thresholds, or "none":
//!                                 # tail drop at the buffer only (a WAN router)
//! period = "80s"                  # repeat every link's schedule with this period
//!
//! [[link]]
//! a = "s0"
//! b = "s1"
//! rate = "10Mbit"                 # from 0 (and from the start of every period)
//! delay = "30ms"
//! schedule = [{ at = "20s", rate = "3Mbit" }, { at = "40s", rate = "15.5Mbit" }]
//! period = "60s"                  # optional; without it the last step stays for good
//! ```
//!
//! `buffer = "auto"` is [`AUTO_BUFFER_BDPS`] bandwidth-delay products of the link (its highest
//! scheduled rate times its round trip, 2 x delay), and never less than the policy's port
//! buffer: a 15.5 Mbit/s, 30 ms link gets 232 500 bytes, a 155 Mbit/s one 2.3 MB, a LAN link
//! the policy's 192 KiB. Schedule times count from the fabric's start; both directions of the
//! link change together.
//!
//! Addressing (all inside 198.18.0.0/15): host `i` (in file order after expansion) gets
//! `198.18.1.0 + i` as a /32, a route to 198.18.0.0/15 via the virtual gateway
//! [`GATEWAY`] on its uplink, and permanent neighbour entries mapping the gateway and every
//! other host to the switch port's MAC, so neither the kernel nor an AF_XDP sender ever ARPs.
//! Switches route each host's /32 over all shortest paths (hop count), ECMP among them.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use gradwire_control::policy::{Policy, ThresholdSpec};
use gradwire_control::policy_file;
use gradwire_control::render::fabric::FabricQos;
use gradwire_units::{Bytes, SizeValue, WrittenValue};
use serde::{Deserialize, Serialize};

use crate::schedule::{RateSchedule, RateStep, ScheduleError};

/// The virtual gateway every host routes through (no interface holds it).
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);

/// Interface name of every host's uplink.
pub const HOST_IFNAME: &str = "eth0";

/// Largest number of hosts (addresses 198.18.1.0 .. 198.19.255.255 would allow more; the
/// bound keeps setup time and MAC numbering simple).
pub const MAX_HOSTS: usize = 1000;

/// Largest number of switches, and of ports on one switch.
pub const MAX_SWITCHES: usize = 64;
/// Ports per switch.
pub const MAX_PORTS: usize = 64;

/// Why a topology is not usable. Every message names the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// Reading or decoding the file.
    #[error(transparent)]
    File(#[from] policy_file::FileError),
    /// A semantic problem.
    #[error("{path}: {msg}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },
}

/// ECMP mode of a switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ecmp {
    /// Hash of (source, destination, protocol, ports): one path per flow.
    #[default]
    Flow,
    /// Round robin per packet over the equal-cost ports (spraying).
    Packet,
}

impl fmt::Display for Ecmp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ecmp::Flow => "flow",
            Ecmp::Packet => "packet",
        })
    }
}

/// Whether a port applies the policy's per-queue thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Thresholds {
    /// The policy's ECN-mark/drop threshold per queue (DLCP's switch).
    #[default]
    #[serde(rename = "policy")]
    Policy,
    /// None: every queue fills up to the shared buffer, then tail drop (a WAN router).
    #[serde(rename = "none")]
    Off,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultsFile {
    rate: Option<WrittenValue>,
    delay: Option<WrittenValue>,
    loss: Option<f64>,
    ecmp: Option<Ecmp>,
    buffer: Option<SizeValue>,
    thresholds: Option<Thresholds>,
    period: Option<WrittenValue>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepFile {
    at: WrittenValue,
    rate: WrittenValue,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct SwitchFile {
    name: String,
    ecmp: Option<Ecmp>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostFile {
    name: String,
    count: Option<usize>,
    uplink: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkFile {
    a: String,
    b: String,
    rate: Option<WrittenValue>,
    delay: Option<WrittenValue>,
    loss: Option<f64>,
    buffer: Option<SizeValue>,
    thresholds: Option<Thresholds>,
    schedule: Option<Vec<StepFile>>,
    period: Option<WrittenValue>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopologyFile {
    name: String,
    policy: Option<String>,
    #[serde(default)]
    defaults: DefaultsFile,
    #[serde(default, rename = "switch")]
    switches: Vec<SwitchFile>,
    #[serde(default, rename = "host")]
    hosts: Vec<HostFile>,
    #[serde(default, rename = "link")]
    links: Vec<LinkFile>,
}

/// Rate, delay, loss and buffering of a link (both directions).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkSpec {
    /// Bits per second at the fabric's start (the schedule, if any, changes it later).
    pub rate_bps: u64,
    /// One-way propagation delay, ns.
    pub delay_ns: u64,
    /// Loss probability per packet.
    pub loss: f64,
    /// Buffer of the port at each end, bytes, shared by its queues.
    pub buffer_bytes: u64,
    /// Whether the policy's per-queue thresholds apply.
    pub thresholds: Thresholds,
    /// The rate over time, for a link whose rate changes.
    pub schedule: Option<RateSchedule>,
}

impl LinkSpec {
    /// The rate at `t_ns` since the fabric's start.
    pub fn rate_at(&self, t_ns: u64) -> u64 {
        self.schedule
            .as_ref()
            .map_or(self.rate_bps, |s| s.rate_at(t_ns))
    }
}

/// A host of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostPlan {
    /// Name from the file (expanded).
    pub name: String,
    /// Its address (/32).
    pub ip: Ipv4Addr,
    /// MAC of its `eth0`.
    pub mac: [u8; 6],
    /// Switch it hangs off.
    pub switch: usize,
    /// Port of that switch.
    pub port: usize,
}

/// One port of a switch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PortPlan {
    /// Interface name inside the switch namespace (`p0`, `p1`, ...).
    pub ifname: String,
    /// Its MAC.
    pub mac: [u8; 6],
    /// What is at the other end.
    pub peer: Peer,
    /// MAC at the other end (the next hop the switch writes as destination).
    pub peer_mac: [u8; 6],
    /// The link's rate, delay and loss (egress of this port).
    pub link: LinkSpec,
}

/// The other end of a switch port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Peer {
    /// Host index.
    Host(usize),
    /// (switch index, port index).
    Switch(usize, usize),
}

/// A switch of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SwitchPlan {
    /// Name from the file.
    pub name: String,
    /// ECMP mode.
    pub ecmp: Ecmp,
    /// Ports, in link order.
    pub ports: Vec<PortPlan>,
    /// Destination host address -> equal-cost egress ports (sorted).
    pub routes: BTreeMap<Ipv4Addr, Vec<usize>>,
}

/// A validated topology with everything derived.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Topology {
    /// Name (namespace prefix).
    pub name: String,
    /// The file it came from (for messages), if any.
    pub source: Option<PathBuf>,
    /// The queue configuration of every switch port.
    pub qos: FabricQos,
    /// Hosts.
    pub hosts: Vec<HostPlan>,
    /// Switches.
    pub switches: Vec<SwitchPlan>,
}

/// Slowest link rate the emulator runs.
pub const MIN_RATE_BPS: u64 = 1_000;
/// Fastest link rate the emulator runs.
pub const MAX_RATE_BPS: u64 = 400_000_000_000;
/// Longest one-way link delay.
pub const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(10);
/// `buffer = "auto"`: this many bandwidth-delay products (highest rate x 2 x delay), at least
/// the policy's port buffer. Two, so that a TCP-like flow over the link alone can fill it and
/// a burst of a second one still fits.
pub const AUTO_BUFFER_BDPS: u64 = 2;
/// Smallest port buffer: two full frames.
pub const MIN_BUFFER_BYTES: u64 = 2 * 1514;
/// Largest port buffer (every port may hold this much memory).
pub const MAX_BUFFER_BYTES: u64 = 1 << 30;

/// The buffer `auto` gives a link of highest rate `max_rate_bps` and one-way delay
/// `delay_ns`, given the policy's port buffer.
pub fn auto_buffer_bytes(max_rate_bps: u64, delay_ns: u64, policy_buffer: u64) -> u64 {
    let bdp = (u128::from(max_rate_bps) * 2)
        .saturating_mul(u128::from(delay_ns))
        .saturating_mul(u128::from(AUTO_BUFFER_BDPS))
        / 8
        / 1_000_000_000;
    let want = bdp.min(u128::from(MAX_BUFFER_BYTES));
    (want as u64).max(policy_buffer)
}

/// A port buffer as written: `Some(bytes)`, or `None` for "auto".
fn link_buffer(v: &SizeValue) -> Result<Option<u64>, String> {
    if matches!(v, SizeValue::Text(t) if t.trim().eq_ignore_ascii_case("auto")) {
        return Ok(None);
    }
    let b = v.bytes().map_err(|e| format!("{e}, or \"auto\""))?.0;
    if !(MIN_BUFFER_BYTES..=MAX_BUFFER_BYTES).contains(&b) {
        return Err(format!(
            "{b} bytes: must be within {MIN_BUFFER_BYTES}..={MAX_BUFFER_BYTES} (two full frames \
             to 1 GiB), or \"auto\""
        ));
    }
    Ok(Some(b))
}

/// A time in a schedule, ns.
fn schedule_time(v: &WrittenValue) -> Result<u64, String> {
    let d = v.duration().map_err(|e| e.to_string())?;
    u64::try_from(d.as_nanos()).map_err(|_| format!("{:?}: too far in the future", v.0))
}

/// A link's settings as written (its own, else the defaults'), before resolution.
struct RawLink<'a> {
    rate: Option<&'a WrittenValue>,
    delay: Option<&'a WrittenValue>,
    loss: Option<f64>,
    buffer: Option<&'a SizeValue>,
    thresholds: Option<Thresholds>,
    schedule: Option<&'a [StepFile]>,
    period: Option<&'a WrittenValue>,
}

impl<'a> RawLink<'a> {
    fn defaults(d: &'a DefaultsFile) -> RawLink<'a> {
        RawLink {
            rate: d.rate.as_ref(),
            delay: d.delay.as_ref(),
            loss: d.loss,
            buffer: d.buffer.as_ref(),
            thresholds: d.thresholds,
            schedule: None,
            period: None,
        }
    }
}

/// Resolves a link's settings; `field` names it in errors (`defaults`, `link[3]`), and a
/// value inherited from `[defaults]` is named there.
fn resolve_link(
    field: &str,
    own: &RawLink<'_>,
    d: &DefaultsFile,
    qos: &FabricQos,
) -> Result<LinkSpec, String> {
    let pick = |mine: bool, key: &str| {
        if mine {
            format!("{field}.{key}")
        } else {
            format!("defaults.{key}")
        }
    };
    let rate_bps = match own.rate.or(d.rate.as_ref()) {
        Some(r) => link_rate(r)
            .map_err(|e| format!("field `{}`: {e}", pick(own.rate.is_some(), "rate")))?,
        None => 1_000_000_000,
    };
    let delay_ns = match own.delay.or(d.delay.as_ref()) {
        Some(v) => link_delay(v)
            .map_err(|e| format!("field `{}`: {e}", pick(own.delay.is_some(), "delay")))?,
        None => 0,
    };
    let loss = own.loss.or(d.loss).unwrap_or(0.0);
    check_loss(loss).map_err(|e| format!("field `{}`: {e}", pick(own.loss.is_some(), "loss")))?;
    let thresholds = own.thresholds.or(d.thresholds).unwrap_or_default();
    let schedule = match own.schedule {
        None => {
            if own.period.is_some() {
                return Err(format!(
                    "field `{field}.period`: there is no `schedule` to repeat; add one or \
                     remove `period`"
                ));
            }
            None
        }
        Some(steps) => {
            let mut out = Vec::with_capacity(steps.len());
            for (j, st) in steps.iter().enumerate() {
                let at_ns = schedule_time(&st.at)
                    .map_err(|e| format!("field `{field}.schedule[{j}].at`: {e}"))?;
                let rate_bps = link_rate(&st.rate)
                    .map_err(|e| format!("field `{field}.schedule[{j}].rate`: {e}"))?;
                out.push(RateStep { at_ns, rate_bps });
            }
            let period = own.period.or(d.period.as_ref());
            let pfield = pick(own.period.is_some(), "period");
            let period_ns = period
                .map(schedule_time)
                .transpose()
                .map_err(|e| format!("field `{pfield}`: {e}"))?;
            let sched = RateSchedule::new(rate_bps, out, period_ns).map_err(|e| match e {
                ScheduleError::NotIncreasing { index, .. } | ScheduleError::ZeroRate { index } => {
                    format!("field `{field}.schedule[{index}]`: {e}")
                }
                ScheduleError::PeriodTooShort { .. } | ScheduleError::ShortPeriod { .. } => {
                    format!("field `{pfield}`: {e}")
                }
                ScheduleError::Empty => {
                    format!("field `{field}.schedule`: {e}; remove `schedule` for a fixed rate")
                }
            })?;
            Some(sched)
        }
    };
    let max_rate = schedule.as_ref().map_or(rate_bps, RateSchedule::max_bps);
    let bfield = pick(own.buffer.is_some(), "buffer");
    let buffer_bytes = match own
        .buffer
        .or(d.buffer.as_ref())
        .map(link_buffer)
        .transpose()
        .map_err(|e| format!("field `{bfield}`: {e}"))?
        .flatten()
    {
        Some(b) => b,
        None => auto_buffer_bytes(max_rate, delay_ns, qos.port_buffer_bytes),
    };
    if thresholds == Thresholds::Policy {
        let highest = qos
            .thresholds_bytes
            .iter()
            .enumerate()
            .filter_map(|(q, t)| t.map(|t| (q, t)))
            .max_by_key(|&(_, t)| t);
        if let Some((q, t)) = highest.filter(|&(_, t)| t > buffer_bytes) {
            return Err(format!(
                "field `{bfield}`: {buffer_bytes} bytes is below the policy's threshold of \
                 queue {q} ({t} bytes), which could then never be reached; raise the buffer or \
                 set thresholds = \"none\""
            ));
        }
    }
    Ok(LinkSpec {
        rate_bps: schedule.as_ref().map_or(rate_bps, |s| s.rate_at(0)),
        delay_ns,
        loss,
        buffer_bytes,
        thresholds,
        schedule,
    })
}

/// A link rate in bit/s: the `gradwire-units` grammar, then the emulator's range.
fn link_rate(v: &WrittenValue) -> Result<u64, String> {
    let bps = v.rate().map_err(|e| e.to_string())?.bps();
    if !(MIN_RATE_BPS..=MAX_RATE_BPS).contains(&bps) {
        return Err(format!("rate {:?}: must be within 1Kbit..400Gbit", v.0));
    }
    Ok(bps)
}

/// A one-way link delay in ns: the `gradwire-units` grammar, then at most [`MAX_DELAY`].
fn link_delay(v: &WrittenValue) -> Result<u64, String> {
    let d = v.duration().map_err(|e| e.to_string())?;
    if d > MAX_DELAY {
        return Err(format!("delay {:?}: must be within 0..10s", v.0));
    }
    // At most 10 s: fits.
    Ok(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn legal_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && s.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
}

/// Address of host `i`.
pub fn host_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 1, 0)) + i as u32)
}

/// MAC of host `i`'s `eth0`.
pub fn host_mac(i: usize) -> [u8; 6] {
    [0x02, 0x67, 0x68, 0x00, (i >> 8) as u8, i as u8]
}

/// MAC of port `p` of switch `s`.
pub fn port_mac(s: usize, p: usize) -> [u8; 6] {
    [0x02, 0x67, 0x73, s as u8, 0x00, p as u8]
}

/// `aa:bb:..` form.
pub fn mac_string(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl Topology {
    /// Reads and validates a topology file (TOML, or JSON by extension). The policy path is
    /// relative to the file.
    pub fn load(path: &Path) -> Result<Topology, TopologyError> {
        let text = policy_file::read_text(path)?;
        let file: TopologyFile = policy_file::decode(path, &text)?;
        let bad = |msg: String| TopologyError::Invalid {
            path: path.display().to_string(),
            msg,
        };
        let policy = match &file.policy {
            Some(p) => {
                let pp = path.parent().unwrap_or(Path::new(".")).join(p);
                policy_file::load_valid_policy(&pp)?
            }
            None => default_policy(),
        };
        let qos =
            FabricQos::from_policy(&policy).map_err(|e| bad(format!("field `policy`: {e}")))?;
        let mut t = Topology::build(&file, qos).map_err(bad)?;
        t.source = Some(path.to_owned());
        Ok(t)
    }

    /// Parses topology text (TOML) with the given queue configuration; for tests and
    /// generated topologies.
    pub fn from_toml(text: &str, qos: FabricQos) -> Result<Topology, String> {
        let file: TopologyFile = toml::from_str(text).map_err(|e| e.to_string())?;
        Topology::build(&file, qos)
    }

    fn build(f: &TopologyFile, qos: FabricQos) -> Result<Topology, String> {
        qos.validate().map_err(|e| format!("policy: {e}"))?;
        if !legal_name(&f.name, 8) {
            return Err(format!(
                "field `name`: {:?} must be 1..=8 characters of a-z 0-9, starting with a letter",
                f.name
            ));
        }
        let d = &f.defaults;
        let def_link = resolve_link("defaults", &RawLink::defaults(d), d, &qos)?;
        if let Some(p) = &d.period {
            schedule_time(p).map_err(|e| format!("field `defaults.period`: {e}"))?;
        }
        let def_ecmp = d.ecmp.unwrap_or_default();

        // Names: switches, then hosts (expanded), all distinct.
        let mut names: BTreeMap<String, Node> = BTreeMap::new();
        let mut switches: Vec<SwitchPlan> = Vec::new();
        for (i, s) in f.switches.iter().enumerate() {
            if !legal_name(&s.name, 12) {
                return Err(format!(
                    "field `switch[{i}].name`: {:?} must be 1..=12 characters of a-z 0-9, starting with a letter",
                    s.name
                ));
            }
            if names.insert(s.name.clone(), Node::Switch(i)).is_some() {
                return Err(format!(
                    "field `switch[{i}].name`: {:?} is used twice",
                    s.name
                ));
            }
            switches.push(SwitchPlan {
                name: s.name.clone(),
                ecmp: s.ecmp.unwrap_or(def_ecmp),
                ports: Vec::new(),
                routes: BTreeMap::new(),
            });
        }
        if switches.is_empty() || switches.len() > MAX_SWITCHES {
            return Err(format!(
                "field `switch`: {} switches, need 1..={MAX_SWITCHES}",
                switches.len()
            ));
        }
        let mut host_names: Vec<String> = Vec::new();
        let mut links: Vec<(String, String, LinkSpec, String)> = Vec::new();
        for (i, h) in f.hosts.iter().enumerate() {
            let expanded: Vec<String> = match h.count {
                None => vec![h.name.clone()],
                Some(0) => return Err(format!("field `host[{i}].count`: must be >= 1")),
                Some(n) if n > MAX_HOSTS => {
                    return Err(format!("field `host[{i}].count`: at most {MAX_HOSTS}"))
                }
                Some(n) => (0..n).map(|k| format!("{}{k}", h.name)).collect(),
            };
            for name in expanded {
                if !legal_name(&name, 12) {
                    return Err(format!(
                        "field `host[{i}].name`: {name:?} must be 1..=12 characters of a-z 0-9, starting with a letter (count included)"
                    ));
                }
                if names
                    .insert(name.clone(), Node::Host(host_names.len()))
                    .is_some()
                {
                    return Err(format!("field `host[{i}].name`: {name:?} is used twice"));
                }
                if let Some(up) = &h.uplink {
                    links.push((
                        name.clone(),
                        up.clone(),
                        def_link.clone(),
                        format!("host[{i}].uplink"),
                    ));
                }
                host_names.push(name);
            }
        }
        if host_names.len() < 2 || host_names.len() > MAX_HOSTS {
            return Err(format!(
                "field `host`: {} hosts, need 2..={MAX_HOSTS}",
                host_names.len()
            ));
        }
        for (i, l) in f.links.iter().enumerate() {
            let own = RawLink {
                rate: l.rate.as_ref(),
                delay: l.delay.as_ref(),
                loss: l.loss,
                buffer: l.buffer.as_ref(),
                thresholds: l.thresholds,
                schedule: l.schedule.as_deref(),
                period: l.period.as_ref(),
            };
            let spec = resolve_link(&format!("link[{i}]"), &own, d, &qos)?;
            links.push((l.a.clone(), l.b.clone(), spec, format!("link[{i}]")));
        }

        // Wire the links.
        let mut hosts: Vec<Option<HostPlan>> = vec![None; host_names.len()];
        for (a, b, spec, field) in &links {
            let na = *names
                .get(a)
                .ok_or_else(|| format!("field `{field}`: unknown node {a:?}"))?;
            let nb = *names
                .get(b)
                .ok_or_else(|| format!("field `{field}`: unknown node {b:?}"))?;
            match (na, nb) {
                (Node::Host(_), Node::Host(_)) => {
                    return Err(format!(
                        "field `{field}`: {a:?} and {b:?} are both hosts; hosts connect to switches"
                    ))
                }
                (Node::Switch(x), Node::Switch(y)) if x == y => {
                    return Err(format!("field `{field}`: a link from {a:?} to itself"))
                }
                (Node::Switch(x), Node::Switch(y)) => {
                    let px = switches[x].ports.len();
                    let py = switches[y].ports.len();
                    switches[x].ports.push(PortPlan {
                        ifname: format!("p{px}"),
                        mac: port_mac(x, px),
                        peer: Peer::Switch(y, py),
                        peer_mac: port_mac(y, py),
                        link: spec.clone(),
                    });
                    switches[y].ports.push(PortPlan {
                        ifname: format!("p{py}"),
                        mac: port_mac(y, py),
                        peer: Peer::Switch(x, px),
                        peer_mac: port_mac(x, px),
                        link: spec.clone(),
                    });
                }
                (Node::Host(h), Node::Switch(s)) | (Node::Switch(s), Node::Host(h)) => {
                    if spec.schedule.is_some() {
                        return Err(format!(
                            "field `{field}.schedule`: only a link between two switches can \
                             change its rate; {:?}'s own egress is shaped by a qdisc at the \
                             fixed rate",
                            host_names[h]
                        ));
                    }
                    if hosts[h].is_some() {
                        return Err(format!(
                            "field `{field}`: host {:?} already has its one link",
                            host_names[h]
                        ));
                    }
                    let p = switches[s].ports.len();
                    switches[s].ports.push(PortPlan {
                        ifname: format!("p{p}"),
                        mac: port_mac(s, p),
                        peer: Peer::Host(h),
                        peer_mac: host_mac(h),
                        link: spec.clone(),
                    });
                    hosts[h] = Some(HostPlan {
                        name: host_names[h].clone(),
                        ip: host_ip(h),
                        mac: host_mac(h),
                        switch: s,
                        port: p,
                    });
                }
            }
        }
        let hosts: Vec<HostPlan> = hosts
            .into_iter()
            .enumerate()
            .map(|(i, h)| h.ok_or_else(|| format!("host {:?} has no link", host_names[i])))
            .collect::<Result<_, _>>()?;
        if let Some(s) = switches.iter().find(|s| s.ports.len() > MAX_PORTS) {
            return Err(format!(
                "switch {:?} has {} ports, at most {MAX_PORTS}",
                s.name,
                s.ports.len()
            ));
        }

        // Routes: BFS from each host's switch over switch-switch links; a switch forwards to
        // every neighbour one hop closer.
        for h in &hosts {
            let mut dist = vec![usize::MAX; switches.len()];
            let mut q = VecDeque::from([h.switch]);
            dist[h.switch] = 0;
            while let Some(s) = q.pop_front() {
                for p in &switches[s].ports {
                    if let Peer::Switch(t, _) = p.peer {
                        if dist[t] == usize::MAX {
                            dist[t] = dist[s] + 1;
                            q.push_back(t);
                        }
                    }
                }
            }
            for s in 0..switches.len() {
                if dist[s] == usize::MAX {
                    return Err(format!(
                        "switch {:?} cannot reach host {:?}",
                        switches[s].name, h.name
                    ));
                }
                let ports: Vec<usize> = if s == h.switch {
                    vec![h.port]
                } else {
                    switches[s]
                        .ports
                        .iter()
                        .enumerate()
                        .filter(
                            |(_, p)| matches!(p.peer, Peer::Switch(t, _) if dist[t] + 1 == dist[s]),
                        )
                        .map(|(i, _)| i)
                        .collect()
                };
                switches[s].routes.insert(h.ip, ports);
            }
        }
        Ok(Topology {
            name: f.name.clone(),
            source: None,
            qos,
            hosts,
            switches,
        })
    }

    /// Host index by name.
    pub fn host_index(&self, name: &str) -> Option<usize> {
        self.hosts.iter().position(|h| h.name == name)
    }

    /// Switch index by name.
    pub fn switch_index(&self, name: &str) -> Option<usize> {
        self.switches.iter().position(|s| s.name == name)
    }

    /// The port of `host`'s switch that leads to it, as (switch, port).
    pub fn host_port(&self, host: usize) -> Option<(usize, usize)> {
        self.hosts.get(host).map(|h| (h.switch, h.port))
    }

    /// Every switch-switch link whose rate changes over time, once, ordered by the first
    /// switch's position in the file: for experiments that plot or expect the rates.
    pub fn scheduled_links(&self) -> Vec<ScheduledLink> {
        let mut out = Vec::new();
        for (si, s) in self.switches.iter().enumerate() {
            for (pi, p) in s.ports.iter().enumerate() {
                if let (Peer::Switch(t, tp), Some(sched)) = (p.peer, &p.link.schedule) {
                    if (si, pi) < (t, tp) {
                        out.push(ScheduledLink {
                            a: s.name.clone(),
                            b: self.switches[t].name.clone(),
                            schedule: sched.clone(),
                        });
                    }
                }
            }
        }
        out
    }

    /// The same network with every rate fixed at its value at the start: a static variant of
    /// a topology with schedules (the same file for "static" and "dynamic" runs).
    pub fn without_schedules(mut self) -> Topology {
        for p in self.switches.iter_mut().flat_map(|s| s.ports.iter_mut()) {
            p.link.schedule = None;
        }
        self
    }
}

/// A switch-switch link with a rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScheduledLink {
    /// One end (the switch listed first in the topology).
    pub a: String,
    /// The other end.
    pub b: String,
    /// Its rate over time.
    pub schedule: RateSchedule,
}

#[derive(Debug, Clone, Copy)]
enum Node {
    Switch(usize),
    Host(usize),
}

fn check_loss(p: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(format!("{p} is not a probability within 0..=1"))
    }
}

/// The policy used when a topology names none; the same as `testbeds/fabric-policy.toml`:
/// the gradwire policy with T = 15 KB, d = 0.5 and a 192 KiB port buffer, sized for emulated
/// links of 100 Mbit/s to 1 Gbit/s.
pub fn default_policy() -> Policy {
    let mut p = Policy::gradwire(ThresholdSpec::Arithmetic {
        base: Bytes(15_000),
        step: 0.5,
    });
    p.name = "GWFABRIC".into();
    p.port_buffer = Bytes(192 * 1024);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qos() -> FabricQos {
        FabricQos::from_policy(&default_policy()).unwrap()
    }

    const LEAF_SPINE: &str = r#"
name = "ls"
[defaults]
rate = "1Gbit"
delay = "10us"
ecmp = "packet"
[[switch]]
name = "spine0"
[[switch]]
name = "spine1"
[[switch]]
name = "leaf0"
[[switch]]
name = "leaf1"
[[host]]
name = "a"
count = 4
uplink = "leaf0"
[[host]]
name = "b"
count = 4
uplink = "leaf1"
[[link]]
a = "leaf0"
b = "spine0"
[[link]]
a = "leaf0"
b = "spine1"
[[link]]
a = "leaf1"
b = "spine0"
[[link]]
a = "leaf1"
b = "spine1"
rate = "100Mbit"
"#;

    #[test]
    fn leaf_spine_routes_use_both_spines() {
        let t = Topology::from_toml(LEAF_SPINE, qos()).unwrap();
        assert_eq!(t.hosts.len(), 8);
        assert_eq!(t.hosts[5].name, "b1");
        assert_eq!(t.hosts[5].ip, Ipv4Addr::new(198, 18, 1, 5));
        let leaf0 = &t.switches[t.switch_index("leaf0").unwrap()];
        // 4 host ports then 2 uplinks.
        assert_eq!(leaf0.ports.len(), 6);
        assert_eq!(leaf0.routes[&t.hosts[5].ip], vec![4, 5]);
        assert_eq!(leaf0.routes[&t.hosts[1].ip], vec![1]);
        let spine0 = &t.switches[0];
        assert_eq!(spine0.routes[&t.hosts[0].ip].len(), 1);
        assert_eq!(spine0.routes[&t.hosts[7].ip].len(), 1);
        let leaf1 = &t.switches[3];
        assert_eq!(leaf1.ports[5].link.rate_bps, 100_000_000);
        assert_eq!(leaf1.ports[4].link.rate_bps, 1_000_000_000);
        assert_eq!(leaf1.ports[4].link.delay_ns, 10_000);
        assert_eq!(leaf1.ecmp, Ecmp::Packet);
        // The peer MAC of a leaf uplink is the spine's port MAC.
        let Peer::Switch(s, p) = leaf0.ports[4].peer else {
            panic!("uplink peer must be a switch")
        };
        assert_eq!(leaf0.ports[4].peer_mac, t.switches[s].ports[p].mac);
    }

    #[test]
    fn units() {
        // The file's rates and delays: the gradwire-units grammar, then the emulator's range.
        let parse_rate = |s: &str| link_rate(&WrittenValue(s.into()));
        let parse_delay = |s: &str| link_delay(&WrittenValue(s.into()));
        assert_eq!(parse_rate("1Gbit").unwrap(), 1_000_000_000);
        assert_eq!(parse_rate("250Mbit").unwrap(), 250_000_000);
        assert_eq!(parse_rate("1.5 Gbit").unwrap(), 1_500_000_000);
        assert!(parse_rate("100").unwrap_err().contains("unit"));
        assert!(parse_rate("1Tbit").unwrap_err().contains("unknown unit"));
        assert!(parse_rate("0bit").is_err());
        assert_eq!(parse_delay("20us").unwrap(), 20_000);
        assert_eq!(parse_delay("1.5ms").unwrap(), 1_500_000);
        assert!(parse_delay("5").is_err());
        assert_eq!(parse_rate("25G").unwrap(), 25_000_000_000);
        assert_eq!(parse_rate("200M").unwrap(), 200_000_000);
        assert_eq!(parse_delay("2ms").unwrap(), 2_000_000);
        assert!(parse_rate("800G").unwrap_err().contains("400Gbit"));
        assert!(parse_delay("11s").unwrap_err().contains("0..10s"));
        // Every refusal of the grammar reads as it does on the command line.
        for bad in ["100", "fast", "25Gbps", "64KiB"] {
            assert_eq!(
                parse_rate(bad).unwrap_err(),
                gradwire_units::parse_rate(bad).unwrap_err().to_string()
            );
        }
        assert_eq!(
            parse_delay("5").unwrap_err(),
            gradwire_units::parse_duration("5").unwrap_err().to_string()
        );
    }

    #[test]
    fn a_number_where_a_rate_belongs_gets_the_grammars_message() {
        let text = "name = \"n\"\n[defaults]\nrate = 100\n[[switch]]\nname = \"s0\"\n\
                    [[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n";
        let e = Topology::from_toml(text, qos()).unwrap_err();
        let want = gradwire_units::parse_rate("100").unwrap_err().to_string();
        assert_eq!(e, format!("field `defaults.rate`: {want}"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = |s: &str| Topology::from_toml(s, qos()).unwrap_err();
        assert!(e("name = \"Bad\"\n").contains("field `name`"));
        let base = "name = \"t\"\n[[switch]]\nname = \"s\"\n";
        assert!(e(base).contains("field `host`"));
        let two = format!("{base}[[host]]\nname = \"h\"\ncount = 2\nuplink = \"s\"\n");
        Topology::from_toml(&two, qos()).unwrap();
        assert!(e(&format!("{two}[[link]]\na = \"h0\"\nb = \"nope\"\n")).contains("unknown node"));
        assert!(e(&format!("{two}[[link]]\na = \"h0\"\nb = \"h1\"\n")).contains("both hosts"));
        assert!(e(&format!("{two}[[link]]\na = \"h0\"\nb = \"s\"\n")).contains("one link"));
        let lossy = two.replace("[[switch]]", "[defaults]\nloss = 2.0\n[[switch]]");
        assert!(e(&lossy).contains("defaults.loss"));
        let cut = format!(
            "{two}[[switch]]\nname = \"island\"\n[[host]]\nname = \"x\"\nuplink = \"island\"\n"
        );
        assert!(e(&cut).contains("cannot reach"));
        assert!(e("name = \"t\"\nbogus = 1\n").contains("bogus"));
    }

    /// Two sites: hosts h0 on s0 and h1 on s1, one switch-switch link with `link` appended.
    fn two_sites(defaults: &str, link: &str) -> String {
        format!(
            "name = \"w\"\n[defaults]\nrate = \"100Mbit\"\n{defaults}\n\
             [[switch]]\nname = \"s0\"\n[[switch]]\nname = \"s1\"\n\
             [[host]]\nname = \"h0\"\nuplink = \"s0\"\n[[host]]\nname = \"h1\"\nuplink = \"s1\"\n\
             [[link]]\na = \"s0\"\nb = \"s1\"\n{link}\n"
        )
    }

    #[test]
    fn a_schedule_reaches_both_ends_of_its_link() {
        let text = two_sites(
            "period = \"90s\"",
            "rate = \"10Mbit\"\ndelay = \"30ms\"\nloss = 0.0002\n\
             schedule = [{ at = \"20s\", rate = \"3Mbit\" }, { at = \"40s\", rate = \"15.5Mbit\" }]",
        );
        let t = Topology::from_toml(&text, qos()).unwrap();
        let (a, b) = (&t.switches[0].ports[1].link, &t.switches[1].ports[1].link);
        assert_eq!(a, b, "both directions of the link");
        let s = a.schedule.as_ref().unwrap();
        assert_eq!(s.period_ns(), Some(90_000_000_000), "from defaults.period");
        let sec = 1_000_000_000u64;
        let rates: Vec<u64> = [0, 19, 20, 39, 40, 89, 90, 110]
            .iter()
            .map(|&x| a.rate_at(x * sec))
            .collect();
        let m = 1_000_000;
        assert_eq!(
            rates,
            [
                10 * m,
                10 * m,
                3 * m,
                3 * m,
                15_500_000,
                15_500_000,
                10 * m,
                3 * m
            ]
        );
        assert_eq!(
            (a.rate_bps, a.delay_ns, a.loss),
            (10 * m, 30_000_000, 0.0002)
        );
        // Host links keep the defaults and no schedule.
        assert!(t.switches[0].ports[0].link.schedule.is_none());
        let links = t.scheduled_links();
        assert_eq!(links.len(), 1);
        assert_eq!((links[0].a.as_str(), links[0].b.as_str()), ("s0", "s1"));
        // The static variant: the rate at the start, for good.
        let fixed = t.without_schedules();
        assert!(fixed.scheduled_links().is_empty());
        assert_eq!(fixed.switches[1].ports[1].link.rate_at(25 * sec), 10 * m);
        // A step at 0 sets the rate at the start.
        let text = two_sites("", "schedule = [{ at = \"0s\", rate = \"7Mbit\" }]");
        let t = Topology::from_toml(&text, qos()).unwrap();
        assert_eq!(t.switches[0].ports[1].link.rate_bps, 7 * m);
    }

    #[test]
    fn buffers_default_to_two_bdps_and_thresholds_can_be_off() {
        let policy = qos().port_buffer_bytes;
        assert_eq!(policy, 192 * 1024);
        // 15.5 Mbit/s x 60 ms round trip = 116 250 bytes; two of them.
        assert_eq!(auto_buffer_bytes(15_500_000, 30_000_000, policy), 232_500);
        assert_eq!(
            auto_buffer_bytes(155_000_000, 30_000_000, policy),
            2_325_000
        );
        // A LAN link: the policy's buffer.
        assert_eq!(auto_buffer_bytes(100_000_000, 20_000, policy), policy);
        assert_eq!(auto_buffer_bytes(u64::MAX, u64::MAX, 0), MAX_BUFFER_BYTES);
        // The highest scheduled rate sizes the buffer.
        let text = two_sites(
            "",
            "rate = \"2Mbit\"\ndelay = \"30ms\"\nschedule = [{ at = \"1s\", rate = \"15.5Mbit\" }]",
        );
        let t = Topology::from_toml(&text, qos()).unwrap();
        let l = &t.switches[0].ports[1].link;
        assert_eq!(
            (l.buffer_bytes, l.thresholds),
            (232_500, Thresholds::Policy)
        );
        assert_eq!(t.switches[0].ports[0].link.buffer_bytes, policy);
        // Explicit sizes, "auto" spelled out, thresholds off in defaults and overridden.
        let text = two_sites(
            "buffer = \"auto\"\nthresholds = \"none\"",
            "buffer = \"1MB\"\nthresholds = \"policy\"",
        );
        let t = Topology::from_toml(&text, qos()).unwrap();
        let (host, wan) = (&t.switches[0].ports[0].link, &t.switches[0].ports[1].link);
        assert_eq!(
            (host.buffer_bytes, host.thresholds),
            (policy, Thresholds::Off)
        );
        assert_eq!(
            (wan.buffer_bytes, wan.thresholds),
            (1_000_000, Thresholds::Policy)
        );
        // Without thresholds a buffer may be below them.
        let text = two_sites("thresholds = \"none\"\nbuffer = 20000", "");
        let t = Topology::from_toml(&text, qos()).unwrap();
        assert_eq!(t.switches[1].ports[1].link.buffer_bytes, 20_000);
    }

    #[test]
    fn schedule_and_buffer_errors_name_the_field() {
        let e = |defaults: &str, link: &str| {
            Topology::from_toml(&two_sites(defaults, link), qos()).unwrap_err()
        };
        let steps = |a: &str, b: &str| {
            format!("schedule = [{{ at = \"{a}\", rate = \"5Mbit\" }}, {{ at = \"{b}\", rate = \"2Mbit\" }}]")
        };
        let m = e("", &steps("20s", "10s"));
        assert!(
            m.starts_with("field `link[0].schedule[1]`: step 1: `at` must be at least 1ms later"),
            "{m}"
        );
        assert!(m.contains("10s is not after 20s"), "{m}");
        let m = e("", &steps("20s", "20s"));
        assert!(m.contains("link[0].schedule[1]"), "{m}");
        let m = e("", &steps("20", "30s"));
        assert!(m.starts_with("field `link[0].schedule[0].at`: "), "{m}");
        let m = e("", "schedule = [{ at = \"1s\", rate = \"0bit\" }]");
        assert!(m.starts_with("field `link[0].schedule[0].rate`: "), "{m}");
        let m = e("", "schedule = [{ at = \"1s\", rate = \"5\" }]");
        let want = gradwire_units::parse_rate("5").unwrap_err().to_string();
        assert_eq!(m, format!("field `link[0].schedule[0].rate`: {want}"));
        let m = e("", "schedule = []");
        assert!(
            m.starts_with("field `link[0].schedule`: a schedule needs"),
            "{m}"
        );
        let m = e("", &format!("{}\nperiod = \"15s\"", steps("5s", "20s")));
        assert!(
            m.starts_with("field `link[0].period`: `period` (15s) must be longer"),
            "{m}"
        );
        let m = e("period = \"10s\"", &steps("5s", "20s"));
        assert!(m.starts_with("field `defaults.period`: "), "{m}");
        let m = e("period = \"fast\"", "");
        assert!(m.starts_with("field `defaults.period`: "), "{m}");
        let m = e("", "period = \"60s\"");
        assert!(
            m.contains("field `link[0].period`: there is no `schedule`"),
            "{m}"
        );
        let m = e(
            "",
            "schedule = [{ at = \"1s\", rate = \"5Mbit\", loss = 0.1 }]",
        );
        assert!(
            m.contains("unknown field `loss`, expected `at` or `rate`"),
            "{m}"
        );
        // Buffers: the grammar, the range, and below a threshold of the policy.
        let m = e("", "buffer = \"lots\"");
        assert!(
            m.starts_with("field `link[0].buffer`: ") && m.contains("\"auto\""),
            "{m}"
        );
        let m = e("buffer = 100", "");
        assert!(
            m.starts_with("field `defaults.buffer`: 100 bytes: must be within"),
            "{m}"
        );
        let m = e("", "buffer = \"20KB\"");
        assert!(
            m.starts_with("field `link[0].buffer`: 20000 bytes is below"),
            "{m}"
        );
        assert!(
            m.contains("queue 0 (60000 bytes)") && m.contains("thresholds = \"none\""),
            "{m}"
        );
        let m = e("", "thresholds = \"some\"");
        assert!(
            m.contains("unknown variant `some`, expected `policy` or `none`"),
            "{m}"
        );
        // A schedule on a host's link.
        let text = two_sites("", "").replace(
            "[[host]]\nname = \"h1\"\nuplink = \"s1\"",
            "[[host]]\nname = \"h1\"\n[[link]]\na = \"h1\"\nb = \"s1\"\n\
             schedule = [{ at = \"1s\", rate = \"5Mbit\" }]",
        );
        let m = Topology::from_toml(&text, qos()).unwrap_err();
        assert!(
            m.starts_with("field `link[0].schedule`: only a link between two switches"),
            "{m}"
        );
    }

    #[test]
    fn shipped_topologies_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbeds");
        for f in ["incast.toml", "leaf-spine.toml"] {
            let t = Topology::load(&dir.join(f)).unwrap();
            assert!(t.hosts.len() >= 3, "{f}");
        }
        let ls = Topology::load(&dir.join("leaf-spine.toml")).unwrap();
        // The shipped policy file and the built-in default are the same policy.
        assert_eq!(ls.qos, qos());
        assert_eq!(ls.switches.len(), 4);
        assert_eq!(ls.hosts.len(), 8);
    }

    /// The switch-switch links of `t`, once each.
    fn wan_links(t: &Topology) -> Vec<&LinkSpec> {
        let mut out = Vec::new();
        for (si, s) in t.switches.iter().enumerate() {
            for (pi, p) in s.ports.iter().enumerate() {
                if matches!(p.peer, Peer::Switch(x, xp) if (si, pi) < (x, xp)) {
                    out.push(&p.link);
                }
            }
        }
        out
    }

    #[test]
    fn the_shipped_wans_are_the_papers_scaled() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbeds");
        let t = Topology::load(&dir.join("wan9.toml")).unwrap();
        assert_eq!((t.hosts.len(), t.switches.len()), (9, 9));
        for (i, h) in t.hosts.iter().enumerate() {
            // One host per site, in site order.
            assert_eq!(
                (h.switch, h.name.clone()),
                (i, format!("h{}", t.switches[i].name))
            );
            assert_eq!(h.ip, host_ip(i));
        }
        let links = wan_links(&t);
        assert_eq!(links.len(), 14);
        assert_eq!(t.scheduled_links().len(), 14);
        let sec = 1_000_000_000u64;
        for l in &links {
            assert_eq!((l.delay_ns, l.loss), (30_000_000, 0.0002));
            assert_eq!(l.thresholds, Thresholds::Off);
            let s = l.schedule.as_ref().unwrap();
            assert_eq!(s.period_ns(), Some(80 * sec));
            let at: Vec<u64> = s.steps().iter().map(|x| x.at_ns / sec).collect();
            assert_eq!(at, [20, 40, 60]);
            // The paper's 20-155 Mbit/s divided by 10, at every step.
            for r in std::iter::once(s.base_bps()).chain(s.steps().iter().map(|x| x.rate_bps)) {
                assert!((2_000_000..=15_500_000).contains(&r), "{r}");
            }
            // Two BDPs at the highest rate, at least the policy's buffer.
            let want = auto_buffer_bytes(s.max_bps(), 30_000_000, 192 * 1024);
            assert_eq!(l.buffer_bytes, want);
            assert!(l.buffer_bytes >= 192 * 1024);
        }
        // Both ends of the range occur; the graph is irregular (degrees 2 to 4).
        let all: Vec<u64> = links
            .iter()
            .map(|l| l.schedule.as_ref().unwrap().max_bps())
            .collect();
        assert!(all.contains(&15_500_000));
        let degrees: Vec<usize> = t
            .switches
            .iter()
            .map(|s| {
                s.ports
                    .iter()
                    .filter(|p| matches!(p.peer, Peer::Switch(..)))
                    .count()
            })
            .collect();
        assert_eq!(degrees.iter().min(), Some(&2));
        assert_eq!(degrees.iter().max(), Some(&4));
        // Host links: fast LANs.
        let lan = &t.switches[0].ports[t.hosts[0].port].link;
        assert_eq!(
            (lan.rate_bps, lan.loss, lan.schedule.is_none()),
            (100_000_000, 0.0, true)
        );

        let t = Topology::load(&dir.join("wan4.toml")).unwrap();
        assert_eq!((t.hosts.len(), t.switches.len()), (4, 4));
        let links = wan_links(&t);
        assert_eq!(links.len(), 5);
        for l in &links {
            assert!((1_000_000..=2_000_000).contains(&l.delay_ns));
            assert_eq!(l.loss, 0.0);
        }
        let drop = t.scheduled_links();
        assert_eq!(drop.len(), 1);
        assert_eq!((drop[0].a.as_str(), drop[0].b.as_str()), ("s0", "s1"));
        let s = &drop[0].schedule;
        assert_eq!((s.rate_at(0), s.rate_at(10 * sec)), (16_000_000, 2_000_000));
        assert_eq!(s.period_ns(), None);
    }
}
