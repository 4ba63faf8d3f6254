//! Running the variants: one fresh fabric per variant, phases of concurrent pairs.
//!
//! Nothing here aborts the experiment once it runs: a flow that fails (an error of its
//! sender or receiver, a thread that gives no result in time) becomes a [`FlowRecord`] with
//! its reason, the rest of the phase and of the run goes on, and a variant whose setup fails
//! is reported with its error while the next variant runs. Every blocking call is bounded
//! (gradwire's connect and idle timeouts, TCP socket timeouts, bounded accepts) and the phase
//! waits for its threads at most until a deadline, after which a thread is left to end on its
//! own timeouts and its pair is recorded as failed.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire::ctrl_listener::{CtrlListener, ListenerConfig};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::{fixed_priority, SenderConfig, Tag};
use gradwire::grant::{GrantConfig, GrantPolicy};
use gradwire::grant_pool::GrantPool;
use gradwire::message::LossBound;
use gradwire::rate::RateMode;
use gradwire::tagging::{DlcpTagger, MagnitudeConfig};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{
    accept_within, Receiver, RecvOptions, SendOptions, Sender, TransferConfig,
};
use gradwire_control::model::load_model;
use gradwire_ebpf::tcp_cc;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig};
use gradwire_fabric::topology::Topology;
use gradwire_netns::spawn_in_netns;
use serde::Serialize;

use crate::flows_msg::{self, MsgSettings};
use crate::report::{summarize, ExperimentReport, FlowRecord, TcpSettings, VariantResult};
use crate::tcp_host::{data_segs_out, resolve_congestion, HostTcp};
use crate::workload::{tensor_values, TensorSpec, Workload};
use crate::{ExperimentError, IncastConfig, ReceiverFault};

/// What a variant runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum VariantKind {
    /// gradwire over kernel UDP.
    Gradwire {
        /// Loss bound p.
        loss_bound: f64,
        /// DLCP tagging (layer DSCP, magnitude ECT); off: one DSCP, everything ECT.
        tagging: bool,
        /// Source-port spraying; off: one source port.
        spray: bool,
        /// Rate control; off: Figure 7 with Δ = 10⁹, the sender never leaves line rate.
        rate_control: bool,
        /// The congestion-control choices (mode and ablations).
        cc: GwCongestion,
    },
    /// gradwire on the message layer ([`crate::flows_msg`]): one endpoint per host, the
    /// receivers' grants.
    Msg(MsgSettings),
    /// Kernel TCP.
    Tcp {
        /// `cubic`, `bbr`, `dctcp` (gradwire-ebpf's `gw_dctcp`), ...
        congestion: String,
        /// ECN on (`net.ipv4.tcp_ecn = 1` in every host namespace); always on for DCTCP.
        ecn: bool,
        /// `rto_min` on every host route, ms; `None`: the regime's default
        /// ([`IncastConfig::tcp_rto_min_ms`]).
        rto_min_ms: Option<u32>,
    },
}

/// gradwire's congestion control in a variant: the rate mode and each mechanism that can be
/// switched off as an ablation (`-fig7`, `-ecn`, `-noce`, `-nomem`, `-bigburst`, `-noimp`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GwCongestion {
    /// grant (default), ecn or fig7.
    #[serde(serialize_with = "mode_name")]
    pub mode: RateMode,
    /// The receivers' grant target reacts to CE marks (off: fixed at 90 % of capacity).
    pub grant_ce: bool,
    /// Each flow starts at the rate the previous one to the same receiver ended at.
    pub rate_memory: bool,
    /// The mode's burst allowance (grant/ecn: half a report period at the rate, 2-32 frames);
    /// off: the
    /// paper's 64 packets.
    pub small_burst: bool,
    /// Retransmitted segments go ECN-capable.
    pub retransmit_ect: bool,
    /// Receivers grant shortest-remaining-first (2 flows at once) instead of fair shares.
    pub shortest_first: bool,
}

impl Default for GwCongestion {
    fn default() -> Self {
        GwCongestion {
            mode: RateMode::Grant,
            grant_ce: true,
            rate_memory: true,
            small_burst: true,
            retransmit_ect: true,
            shortest_first: false,
        }
    }
}

fn mode_name<S: serde::Serializer>(m: &RateMode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(m.name())
}

/// A named variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Variant {
    /// Name in tables and on the command line.
    pub name: String,
    /// What it runs.
    pub kind: VariantKind,
}

/// The variant grammar, for messages and `--help`.
pub const VARIANT_GRAMMAR: &str =
    "gw-p<percent>[-notag][-nospray][-norc][-fig7|-ecn][-noce][-nomem][-bigburst][-noimp][-srpt|-fair], \
     msg-p<percent>[-notag][-nogrants] or tcp-<congestion>[-ecn][-rto<ms>]";

impl Variant {
    /// A variant by name (see [`VARIANT_GRAMMAR`]): `gw-p<percent>` followed by ablation
    /// suffixes, or `tcp-<congestion>` followed by `-ecn` (ECN on) and/or `-rto<ms>` (the
    /// hosts' routes carry `rto_min <ms>ms`). A new mode is one more arm in the suffix match
    /// of its family.
    pub fn parse(name: &str) -> Result<Variant, String> {
        if let Some(rest) = name.strip_prefix("tcp-") {
            return Ok(Variant {
                name: name.into(),
                kind: parse_tcp(name, rest)?,
            });
        }
        if let Some(rest) = name.strip_prefix("msg-p") {
            return Ok(Variant {
                name: name.into(),
                kind: parse_msg(name, rest)?,
            });
        }
        let rest = name
            .strip_prefix("gw-p")
            .ok_or_else(|| format!("variant {name:?}: expected {VARIANT_GRAMMAR}"))?;
        let mut parts = rest.split('-');
        let pct = percent(name, parts.next())?;
        let (mut tagging, mut spray, mut rate_control) = (true, true, true);
        let mut cc = GwCongestion::default();
        for p in parts {
            match p {
                "notag" => tagging = false,
                "nospray" => spray = false,
                "norc" => rate_control = false,
                "fig7" => {
                    // The paper's machine as the paper specifies it.
                    cc.mode = RateMode::Fig7;
                    cc.small_burst = false;
                    cc.retransmit_ect = false;
                }
                "ecn" => cc.mode = RateMode::Ecn,
                "noce" => cc.grant_ce = false,
                "nomem" => cc.rate_memory = false,
                "bigburst" => cc.small_burst = false,
                "noimp" => cc.retransmit_ect = false,
                "srpt" => cc.shortest_first = true,
                "fair" => cc.shortest_first = false,
                other => return Err(format!("variant {name:?}: unknown ablation {other:?}")),
            }
        }
        Ok(Variant {
            name: name.into(),
            kind: VariantKind::Gradwire {
                loss_bound: pct / 100.0,
                tagging,
                spray,
                rate_control,
                cc,
            },
        })
    }

    /// The gradwire comparison (on flows and on the message layer), the ablations of the
    /// first incast experiment (tagging,
    /// spraying, rate control) and of the congestion control (the paper's Figure 7, the
    /// sender-side ECN reaction instead of grants, grants without CE reaction, no rate
    /// memory, the paper's burst, plain retransmissions), with CUBIC and DCTCP; [`crate::Regime::variants`] adds the other TCP baselines.
    pub fn defaults() -> Vec<Variant> {
        Variant::list(&[
            "gw-p1",
            "gw-p10",
            "gw-p0",
            "msg-p1",
            "msg-p10",
            "tcp-cubic",
            "tcp-dctcp",
            "gw-p1-notag",
            "gw-p1-nospray",
            "gw-p1-norc",
            "gw-p1-fig7",
            "gw-p1-ecn",
            "gw-p1-noce",
            "gw-p1-nomem",
            "gw-p1-bigburst",
            "gw-p1-noimp",
        ])
    }

    /// Variants by name; names that do not parse are left out (for built-in lists).
    pub(crate) fn list(names: &[&str]) -> Vec<Variant> {
        names
            .iter()
            .filter_map(|n| Variant::parse(n).ok())
            .collect()
    }
}

/// The loss bound of a variant name, a percentage 0..=50.
fn percent(name: &str, p: Option<&str>) -> Result<f64, String> {
    p.and_then(|p| p.parse().ok())
        .filter(|p: &f64| (0.0..=50.0).contains(p))
        .ok_or_else(|| format!("variant {name:?}: the loss bound must be a percentage 0..=50"))
}

/// `<percent>[-notag][-nogrants]` after the `msg-p`.
fn parse_msg(name: &str, rest: &str) -> Result<VariantKind, String> {
    let mut parts = rest.split('-');
    let mut s = MsgSettings {
        loss_bound: percent(name, parts.next())? / 100.0,
        tagging: true,
        grants: true,
    };
    for p in parts {
        match p {
            "notag" => s.tagging = false,
            "nogrants" => s.grants = false,
            other => {
                return Err(format!(
                    "variant {name:?}: unknown option {other:?} of the message layer \
                     (expected -notag or -nogrants)"
                ))
            }
        }
    }
    Ok(VariantKind::Msg(s))
}

/// `tcp-<congestion>[-ecn][-rto<ms>]` after the `tcp-`.
fn parse_tcp(name: &str, rest: &str) -> Result<VariantKind, String> {
    let mut parts = rest.split('-');
    let cc = parts.next().unwrap_or_default();
    if cc.is_empty() || !cc.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(format!("variant {name:?}: bad congestion control name"));
    }
    let mut ecn = cc == "dctcp";
    let mut rto_min_ms = None;
    for p in parts {
        match p {
            "ecn" => ecn = true,
            _ if p.starts_with("rto") => {
                let ms = p[3..]
                    .parse::<u32>()
                    .ok()
                    .filter(|ms| (1..=1000).contains(ms))
                    .ok_or_else(|| {
                        format!("variant {name:?}: -rto<ms> takes 1..=1000 milliseconds")
                    })?;
                rto_min_ms = Some(ms);
            }
            other => {
                return Err(format!(
                    "variant {name:?}: unknown TCP option {other:?} (expected -ecn or -rto<ms>)"
                ))
            }
        }
    }
    Ok(VariantKind::Tcp {
        congestion: cc.into(),
        ecn,
        rto_min_ms,
    })
}

/// (delivered fraction, wrong bytes) of one received tensor.
pub(crate) type Received = (f64, u64);

/// One tensor its sender completed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Sent {
    pub(crate) fct_us: f64,
    pub(crate) data_packets: u64,
}

/// Why one side of a pair stopped, at the tensor after the ones it completed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stop {
    error: String,
    /// Time spent on the tensor it stopped at, microseconds (0: not started).
    elapsed_us: f64,
    /// Data packets sent for that tensor.
    data_packets: u64,
}

impl Stop {
    pub(crate) fn new(error: String) -> Stop {
        Stop {
            error,
            elapsed_us: 0.0,
            data_packets: 0,
        }
    }
}

/// Records one tensor a sender finished, or makes its failure the pair's stop, with the time
/// and packets spent on it.
pub(crate) fn tensor_done(
    out: &mut Vec<Sent>,
    sent: Sent,
    res: Result<(), Stop>,
) -> Result<(), Stop> {
    match res {
        Ok(()) => {
            out.push(sent);
            Ok(())
        }
        Err(stop) => Err(Stop {
            elapsed_us: sent.fct_us,
            data_packets: sent.data_packets,
            ..stop
        }),
    }
}

/// What one side (sender or receiver) of a pair did: the tensors it completed, in order, and
/// why it stopped if it did not complete them all.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Outcome<T> {
    done: Vec<T>,
    stopped: Option<Stop>,
}

impl<T> Outcome<T> {
    /// Nothing done: `error` at the first tensor.
    pub(crate) fn failed(error: String) -> Outcome<T> {
        Outcome {
            done: Vec::new(),
            stopped: Some(Stop::new(error)),
        }
    }

    pub(crate) fn of(done: Vec<T>, result: Result<(), Stop>) -> Outcome<T> {
        Outcome {
            done,
            stopped: result.err(),
        }
    }
}

/// One direction of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Push,
    Pull,
}

/// A sender -> receiver pair of one phase.
#[derive(Debug, Clone)]
pub(crate) struct Pair {
    pub(crate) job: u32,
    pub(crate) src: usize,
    pub(crate) dst: usize,
    /// Seeds the values (the worker's index for push, 1000 + server index for pull).
    pub(crate) sender_id: usize,
    pub(crate) tensors: Vec<TensorSpec>,
}

impl Pair {
    /// A stop of this pair's sender: `what` failed with `err`.
    pub(crate) fn sender_stop(&self, what: &str, err: &dyn std::fmt::Display) -> Stop {
        Stop::new(format!(
            "sender of job {} on host {}: {what}: {err}",
            self.job, self.src
        ))
    }

    /// A stop of this pair's receiver: `what` failed with `err`.
    pub(crate) fn receiver_stop(&self, what: &str, err: &dyn std::fmt::Display) -> Stop {
        Stop::new(format!(
            "receiver of job {} on host {}: {what}: {err}",
            self.job, self.dst
        ))
    }
}

/// How long the phase waits for every receiver to listen.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// TCP sockets' read and write timeouts (gradwire's are its idle and connect timeouts).
const TCP_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a receiver waits for its sender to connect.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs every variant of `cfg`. Fails only when the topology or model cannot be read; once
/// variants run, failures are part of the report (see the module docs).
pub fn run(cfg: &IncastConfig) -> Result<ExperimentReport, ExperimentError> {
    let topo = Topology::load(&cfg.topology)?;
    let model = load_model(&cfg.model)?;
    let servers: Vec<usize> = (0..topo.hosts.len())
        .filter(|&h| topo.hosts[h].name.starts_with("ps"))
        .collect();
    let workers: Vec<usize> = (0..topo.hosts.len())
        .filter(|h| !servers.contains(h))
        .collect();
    if servers.is_empty() || workers.is_empty() {
        return Err(ExperimentError::Other(format!(
            "{}: need hosts named ps* (servers) and others (workers)",
            cfg.topology.display()
        )));
    }
    let wl = Workload::new(&model, cfg.scale, servers.len(), cfg.split_bytes, cfg.seed);
    let mut results = Vec::new();
    for v in &cfg.variants {
        eprintln!("experiment: variant {} ...", v.name);
        let r = run_variant(cfg, &topo, &wl, &servers, &workers, v);
        match (&r.skipped, &r.error) {
            (Some(why), _) => eprintln!("experiment: variant {} skipped: {why}", v.name),
            (None, err) => eprintln!(
                "experiment: variant {}: {} flows, {} failed, valid: {}{}",
                v.name,
                r.flows,
                r.failed_flows,
                r.valid,
                err.as_ref()
                    .map(|e| format!(", error: {e}"))
                    .unwrap_or_default()
            ),
        }
        results.push(r);
    }
    let mut report = ExperimentReport {
        regime: cfg.regime.name().into(),
        topology: cfg.topology.display().to_string(),
        model: model.name.clone(),
        scale: cfg.scale,
        iterations: cfg.iterations,
        workers: workers.len(),
        servers: servers.len(),
        bytes_per_worker: wl.bytes_per_worker(),
        tensors_per_worker: wl.per_server.iter().map(Vec::len).sum(),
        link_rate_bps: link_rate(&topo, workers[0]),
        tcp_rto_min_ms: cfg.tcp_rto_min_ms,
        bootstrap: cfg.bootstrap,
        data_packets_source: crate::report::DATA_PACKETS_SOURCE,
        results,
        ratios: Vec::new(),
        ratios_vs_dctcp: Vec::new(),
        excluded: Vec::new(),
    };
    report.compute_ratios();
    Ok(report)
}

fn link_rate(topo: &Topology, host: usize) -> u64 {
    let h = &topo.hosts[host];
    topo.switches[h.switch].ports[h.port].link.rate_bps
}

fn pairs(phase: Phase, wl: &Workload, servers: &[usize], workers: &[usize]) -> Vec<Pair> {
    let mut out = Vec::new();
    for (wi, &w) in workers.iter().enumerate() {
        for (si, &s) in servers.iter().enumerate() {
            let mut tensors = wl.per_server[si].clone();
            let job = (wi * servers.len() + si) as u32 + 1;
            out.push(match phase {
                // Backpropagation produces the back layers first.
                Phase::Push => {
                    tensors.reverse();
                    Pair {
                        job,
                        src: w,
                        dst: s,
                        sender_id: wi,
                        tensors,
                    }
                }
                // The next forward pass needs the front layers first.
                Phase::Pull => Pair {
                    job: job + 10_000,
                    src: s,
                    dst: w,
                    sender_id: 1000 + si,
                    tensors,
                },
            });
        }
    }
    out
}

/// The error, plus what removing the testbed said if that failed too.
fn with_teardown(error: String, down: Result<(), gradwire_netns::NetnsError>) -> String {
    match down {
        Ok(()) => error,
        Err(e) => format!("{error} (and removing the testbed: {e})"),
    }
}

/// One variant on a fresh testbed and fabric. Never fails: a setup error is the result's
/// `error`, flows that failed are records with their reason.
fn run_variant(
    cfg: &IncastConfig,
    topo: &Topology,
    wl: &Workload,
    servers: &[usize],
    workers: &[usize],
    v: &Variant,
) -> VariantResult {
    if matches!(v.kind, VariantKind::Msg(_)) && cfg.receiver_fault.is_some() {
        let why = "the injected receiver fault is for the flow and TCP variants (a message-layer \
                   receiver has no connection of its own to fail)";
        return VariantResult::skipped(v, why.into());
    }
    // TCP: the congestion control that runs (DCTCP registered for the variant's duration) and
    // the host settings, or why this machine cannot run the variant.
    let mut tcp_plan = None;
    let mut _dctcp_registration = None;
    if let VariantKind::Tcp {
        congestion,
        ecn,
        rto_min_ms,
    } = &v.kind
    {
        match resolve_congestion(congestion) {
            Ok((name, registration)) => {
                _dctcp_registration = registration;
                tcp_plan = Some((name, *ecn, rto_min_ms.or(cfg.tcp_rto_min_ms)));
            }
            Err(why) => return VariantResult::skipped(v, why),
        }
    }
    let net = match FabricNet::up(topo) {
        Ok(n) => n,
        Err(e) => return VariantResult::failed(v, format!("building the testbed: {e}")),
    };
    let fabric = match spawn(topo, net.switch_namespaces(), FabricConfig::default()) {
        Ok(f) => f,
        Err(e) => {
            let why = with_teardown(format!("starting the fabric: {e}"), net.down());
            return VariantResult::failed(v, why);
        }
    };
    let mut host_tcp = None;
    let mut settings = None;
    if let Some((cc, ecn, rto)) = &tcp_plan {
        match HostTcp::apply(net.host_namespaces(), *ecn, *rto) {
            Ok(h) => {
                settings = Some(TcpSettings {
                    congestion: cc.clone(),
                    tcp_ecn: h.tcp_ecn,
                    rto_min_ms: *rto,
                });
                host_tcp = Some(h);
            }
            Err(e) => {
                drop(fabric.stop());
                let why = with_teardown(format!("TCP host settings: {e}"), net.down());
                return VariantResult::failed(v, why);
            }
        }
    }
    let cc = settings.as_ref().map(|s| s.congestion.as_str());
    let hosts = match &v.kind {
        VariantKind::Msg(s) => match flows_msg::Hosts::up(topo, &net, s) {
            Ok(h) => Some(h),
            Err(e) => {
                drop(fabric.stop());
                let why = with_teardown(format!("message-layer endpoints: {e}"), net.down());
                return VariantResult::failed(v, why);
            }
        },
        _ => None,
    };
    let mut flows = Vec::new();
    let mut iterations = Vec::new();
    for it in 0..cfg.iterations {
        let mut total = Duration::ZERO;
        for phase in [Phase::Push, Phase::Pull] {
            let ps = pairs(phase, wl, servers, workers);
            let (took, mut recs) = match &hosts {
                Some(h) => flows_msg::run_phase(h, topo, wl.layers, phase, it, &ps),
                None => run_phase(cfg, topo, &net, wl, v, cc, phase, it, &ps),
            };
            total += took;
            flows.append(&mut recs);
        }
        iterations.push(total);
    }
    if let Some(h) = &hosts {
        eprintln!("experiment: {}: message layer: {}", v.name, h.counters());
    }
    // The endpoints go before the fabric: their goodbyes still find their peers.
    drop(hosts);
    let mut errors = Vec::new();
    if let Some(h) = host_tcp {
        if let Err(e) = h.restore() {
            errors.push(format!("restoring the TCP host settings: {e}"));
        }
    }
    if !fabric.wait_idle(Duration::from_secs(10)) {
        eprintln!(
            "experiment: warning: the fabric did not drain after {}",
            v.name
        );
    }
    let stats = fabric.stop();
    if let Err(e) = net.down() {
        errors.push(format!("removing the testbed: {e}"));
    }
    let mut r = summarize(v, flows, iterations, stats.as_ref(), &cfg.bootstrap);
    r.tcp = settings;
    errors.extend(r.error.take());
    r.error = (!errors.is_empty()).then(|| errors.join("; "));
    r
}

/// How long a phase may take before its unfinished pairs count as failed: a minute plus 30
/// times the time the busiest host link needs for its bytes at line rate.
pub(crate) fn phase_deadline(topo: &Topology, pairs: &[Pair]) -> Duration {
    let mut per_host = vec![0u64; topo.hosts.len()];
    for p in pairs {
        let bytes: u64 = p.tensors.iter().map(|t| t.elems as u64 * 4).sum();
        per_host[p.src] += bytes;
        per_host[p.dst] += bytes;
    }
    let busiest = (0..topo.hosts.len())
        .map(|h| per_host[h] as f64 * 8.0 / link_rate(topo, h).max(1) as f64)
        .fold(0.0, f64::max);
    Duration::from_secs(60) + Duration::from_secs_f64(30.0 * busiest)
}

/// Waits until `out` has every outcome or `deadline` passes (or every thread is gone).
fn collect<T>(
    rx: &mpsc::Receiver<(usize, Outcome<T>)>,
    out: &mut [Option<Outcome<T>>],
    deadline: Instant,
) {
    while out.iter().any(Option::is_none) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((i, o)) => out[i] = Some(o),
            Err(_) => break,
        }
    }
}

/// Joins the threads that gave their outcome or ended (a panic becomes the pair's error);
/// leaves the others to end on their own timeouts and fills in their pairs' errors.
fn finish_threads<T>(
    role: &str,
    threads: Vec<(usize, JoinHandle<()>)>,
    out: &mut [Option<Outcome<T>>],
    waited: Duration,
) {
    let mut abandoned = 0;
    for (i, h) in threads {
        if out[i].is_some() || h.is_finished() {
            if h.join().is_err() && out[i].is_none() {
                out[i] = Some(Outcome::failed(format!("the {role} thread panicked")));
            }
        } else {
            abandoned += 1;
        }
    }
    for o in out.iter_mut().filter(|o| o.is_none()) {
        *o = Some(Outcome::failed(format!(
            "timeout: the {role} gave no result within {:.0} s",
            waited.as_secs_f64()
        )));
    }
    if abandoned > 0 {
        eprintln!(
            "experiment: warning: {abandoned} {role} thread(s) still running at the phase \
             deadline, left to end on their own timeouts"
        );
    }
}

/// Starts every receiver, waits (bounded) until they listen, then starts the senders of the
/// pairs whose receiver listens; returns the phase's duration (first send to last sender
/// result) and one record per tensor of every pair, failed ones included.
#[allow(clippy::too_many_arguments)]
fn run_phase(
    cfg: &IncastConfig,
    topo: &Topology,
    net: &FabricNet,
    wl: &Workload,
    v: &Variant,
    tcp_cc: Option<&str>,
    phase: Phase,
    it: u32,
    pairs: &[Pair],
) -> (Duration, Vec<FlowRecord>) {
    let n = pairs.len();
    let mut got: Vec<Option<Outcome<Received>>> = vec![None; n];
    let mut sent: Vec<Option<Outcome<Sent>>> = vec![None; n];
    let (ready_tx, ready_rx) = mpsc::channel::<(usize, bool)>();
    let (got_tx, got_rx) = mpsc::channel::<(usize, Outcome<Received>)>();
    let pools = grant_pools(topo, pairs, v, cfg.period_ns);
    let mut receivers = Vec::new();
    for (i, p) in pairs.iter().enumerate() {
        let Some(ns) = net.host_ns(p.dst) else {
            got[i] = Some(Outcome::failed(format!("no host {}", p.dst)));
            continue;
        };
        let ip = IpAddr::V4(topo.hosts[p.dst].ip);
        let fault = cfg
            .receiver_fault
            .filter(|f| f.iteration == it && phase == Phase::Push && i == 0)
            .map(|f: ReceiverFault| f.after_tensors);
        let (p2, v2, cc) = (p.clone(), v.clone(), tcp_cc.map(String::from));
        let (ready, done, period) = (ready_tx.clone(), got_tx.clone(), cfg.period_ns);
        let (capacity, pool) = (link_rate(topo, p.dst), pools.get(&p.dst).cloned());
        let spawned = spawn_in_netns(ns, move || {
            let mut out = Vec::with_capacity(p2.tensors.len());
            let res = receive(
                &p2,
                &v2,
                ip,
                it,
                period,
                capacity,
                pool,
                cc.as_deref(),
                fault,
                &ready,
                i,
                &mut out,
            );
            let _ = done.send((i, Outcome::of(out, res)));
        });
        match spawned {
            Ok(h) => receivers.push((i, h)),
            Err(e) => got[i] = Some(Outcome::failed(format!("receiver thread: {e}"))),
        }
    }
    drop((ready_tx, got_tx));
    let mut listening = vec![false; n];
    let ready_by = Instant::now() + READY_TIMEOUT;
    for _ in 0..receivers.len() {
        match ready_rx.recv_timeout(ready_by.saturating_duration_since(Instant::now())) {
            Ok((i, ok)) => listening[i] = ok,
            Err(_) => break,
        }
    }
    let start = Instant::now();
    let (sent_tx, sent_rx) = mpsc::channel::<(usize, Outcome<Sent>)>();
    let mut senders = Vec::new();
    for (i, p) in pairs.iter().enumerate() {
        if !listening[i] {
            sent[i] = Some(Outcome::failed(
                "sender not started: its receiver was not listening".into(),
            ));
            continue;
        }
        let Some(ns) = net.host_ns(p.src) else {
            sent[i] = Some(Outcome::failed(format!("no host {}", p.src)));
            continue;
        };
        let src_ip = IpAddr::V4(topo.hosts[p.src].ip);
        let dst_ip = IpAddr::V4(topo.hosts[p.dst].ip);
        let rate = link_rate(topo, p.src);
        let (p2, v2, cc, done) = (
            p.clone(),
            v.clone(),
            tcp_cc.map(String::from),
            sent_tx.clone(),
        );
        let (layers, spray, period) = (wl.layers, cfg.spray_ports, cfg.period_ns);
        let spawned = spawn_in_netns(ns, move || {
            let mut out = Vec::with_capacity(p2.tensors.len());
            let res = send(
                &p2,
                &v2,
                src_ip,
                dst_ip,
                rate,
                layers,
                spray,
                it,
                period,
                cc.as_deref(),
                &mut out,
            );
            let _ = done.send((i, Outcome::of(out, res)));
        });
        match spawned {
            Ok(h) => senders.push((i, h)),
            Err(e) => sent[i] = Some(Outcome::failed(format!("sender thread: {e}"))),
        }
    }
    drop(sent_tx);
    let deadline = phase_deadline(topo, pairs);
    collect(&sent_rx, &mut sent, start + deadline);
    let took = start.elapsed();
    // Receivers end shortly after their senders (or on their own timeouts).
    let grace = ACCEPT_TIMEOUT + Duration::from_secs(10);
    collect(
        &got_rx,
        &mut got,
        Instant::now().max(start + deadline) + grace,
    );
    finish_threads("sender", senders, &mut sent, deadline);
    finish_threads("receiver", receivers, &mut got, deadline + grace);
    let mut out = Vec::new();
    for ((p, s), r) in pairs.iter().zip(sent).zip(got) {
        // finish_threads filled in every missing outcome.
        out.extend(merge(
            p,
            phase == Phase::Push,
            it,
            s.unwrap_or_else(|| Outcome::failed("no result".into())),
            r.unwrap_or_else(|| Outcome::failed("no result".into())),
        ));
    }
    (took, out)
}

/// One record per tensor of `p` from what its sender and receiver did. A tensor is completed
/// when both completed it; otherwise its error is the sender's and/or receiver's error at that
/// tensor, or, for the tensors after a failure, that failure.
pub(crate) fn merge(
    p: &Pair,
    push: bool,
    it: u32,
    sent: Outcome<Sent>,
    got: Outcome<Received>,
) -> Vec<FlowRecord> {
    let stops = [
        (sent.done.len(), sent.stopped.as_ref(), "sender"),
        (got.done.len(), got.stopped.as_ref(), "receiver"),
    ];
    let first = stops
        .iter()
        .filter_map(|&(at, s, _)| s.map(|s| (at, s)))
        .min_by_key(|&(at, _)| at)
        .map(|(_, s)| s.error.clone())
        .unwrap_or_else(|| "unknown".into());
    p.tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let s = sent.done.get(i);
            let r = got.done.get(i);
            let here: Vec<&Stop> = stops
                .iter()
                .filter(|&&(at, _, _)| at == i)
                .filter_map(|&(_, st, _)| st)
                .collect();
            let sender_stop = sent.stopped.as_ref().filter(|_| sent.done.len() == i);
            let error = if s.is_some() && r.is_some() {
                None
            } else if here.is_empty() {
                Some(format!(
                    "after an earlier failure on this connection: {first}"
                ))
            } else {
                Some(
                    here.iter()
                        .map(|s| s.error.as_str())
                        .collect::<Vec<_>>()
                        .join("; "),
                )
            };
            FlowRecord {
                iteration: it,
                push,
                src: p.src,
                dst: p.dst,
                tensor: t.id,
                layer: t.layer,
                bytes: t.elems as u64 * 4,
                fct_us: s
                    .map(|s| s.fct_us)
                    .or(sender_stop.map(|s| s.elapsed_us))
                    .unwrap_or(0.0),
                delivered_fraction: r.map_or(0.0, |r| r.0),
                wrong_bytes: r.map_or(0, |r| r.1),
                data_packets: s
                    .map(|s| s.data_packets)
                    .or(sender_stop.map(|s| s.data_packets))
                    .unwrap_or(0),
                error,
            }
        })
        .collect()
}

fn data_port(peer: usize) -> u16 {
    7000 + peer as u16
}

fn ctrl_port(peer: usize) -> u16 {
    8000 + peer as u16
}

/// The transfer configuration of a gradwire variant on a host whose link runs at `rate_bps`.
fn transfer_config(
    rate_bps: u64,
    rate_control: bool,
    cc: &GwCongestion,
    period_ns: u64,
) -> TransferConfig {
    let mode = if rate_control {
        cc.mode
    } else {
        RateMode::Fig7
    };
    let mut sender = SenderConfig::with_mode(mode, rate_bps);
    sender.rate.period_ns = period_ns;
    sender.retransmit_ect = cc.retransmit_ect;
    if !cc.small_burst {
        sender.burst_bytes = SenderConfig::with_mode(RateMode::Fig7, rate_bps).burst_bytes;
    }
    if !rate_control {
        // Δ = 10^9: the send rate is never "more than Δ times" a receive rate above 1 bit/s,
        // so the sender never halves (rate control validates Δ as finite).
        sender.rate.delta = 1e9;
    }
    TransferConfig {
        sender,
        idle_timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(20),
        rate_memory: cc.rate_memory,
        ..TransferConfig::default()
    }
}

/// One grant pool per receiving host, shared by its receiver threads: the downlink's
/// capacity split over the flows into it.
fn grant_pools(
    topo: &Topology,
    pairs: &[Pair],
    v: &Variant,
    period_ns: u64,
) -> BTreeMap<usize, GrantPool> {
    let VariantKind::Gradwire { cc, .. } = &v.kind else {
        return BTreeMap::new();
    };
    let mut pools = BTreeMap::new();
    for p in pairs {
        pools.entry(p.dst).or_insert_with(|| {
            let mut g = GrantConfig::new(link_rate(topo, p.dst), period_ns);
            g.ce_reaction = cc.grant_ce;
            if cc.shortest_first {
                g.policy = GrantPolicy::ShortestFirst { overcommit: 2 };
            }
            GrantPool::new(g)
        });
    }
    pools
}

/// Receives every tensor of `p` into `out` ((delivered fraction, wrong bytes) per tensor);
/// stops at the first error. Tells `ready` (as pair `index`) whether it listens. `fault`:
/// stop with an error after that many tensors (the harness's own failure test).
#[allow(clippy::too_many_arguments)]
fn receive(
    p: &Pair,
    v: &Variant,
    ip: IpAddr,
    it: u32,
    period_ns: u64,
    capacity_bps: u64,
    pool: Option<GrantPool>,
    tcp_cc: Option<&str>,
    fault: Option<usize>,
    ready: &mpsc::Sender<(usize, bool)>,
    index: usize,
    out: &mut Vec<Received>,
) -> Result<(), Stop> {
    let e = |what: &str, err: &dyn std::fmt::Display| p.receiver_stop(what, err);
    // A setup failure is reported to the phase (which waits for every receiver) and returned.
    let setup_failed = |s: Stop| {
        let _ = ready.send((index, false));
        s
    };
    let injected = |i: usize| {
        (fault == Some(i)).then(|| {
            Stop::new(format!(
                "receiver of job {} on host {}: injected fault: stops after {i} tensors",
                p.job, p.dst
            ))
        })
    };
    let ctrl = SocketAddr::new(ip, ctrl_port(p.src));
    match &v.kind {
        VariantKind::Gradwire { cc, .. } => {
            let listener = CtrlListener::bind(ctrl, ListenerConfig::default())
                .map_err(|err| setup_failed(e("listen", &err)))?;
            let dp = UdpDatapath::bind(SocketAddr::new(ip, data_port(p.src)), UdpConfig::default())
                .map_err(|err| setup_failed(e("bind data socket", &err)))?;
            let _ = ready.send((index, true));
            let mut cfg = transfer_config(capacity_bps, true, cc, period_ns);
            cfg.grant_pool = pool;
            let mut r = Receiver::accept(&listener, dp, cfg).map_err(|err| e("accept", &err))?;
            for (i, t) in p.tensors.iter().enumerate() {
                if let Some(stop) = injected(i) {
                    return Err(stop);
                }
                let mut got = Tensor::zeros(DType::F32, t.elems);
                let opts = RecvOptions {
                    round: Some(it),
                    ..RecvOptions::new(p.job, t.id)
                };
                let rep = r
                    .recv(&mut got, &opts)
                    .map_err(|err| e(&format!("tensor {}", t.id), &err))?;
                let want = tensor_values(t, p.sender_id, it);
                let mut wrong = 0u64;
                for i in 0..rep.segments {
                    if !rep.bitmap.get(i) {
                        continue;
                    }
                    if let Some((off, len)) = rep.layout.segment(i) {
                        let r = off as usize..off as usize + len;
                        let (a, b) = (&got.as_bytes()[r.clone()], &want.as_bytes()[r]);
                        wrong += a.iter().zip(b).filter(|(x, y)| x != y).count() as u64;
                    }
                }
                out.push((rep.delivered_fraction, wrong));
            }
        }
        VariantKind::Msg(_) => {
            let _ = ready.send((index, false));
            return Err(Stop::new(
                "a message-layer variant has no flow receivers".into(),
            ));
        }
        VariantKind::Tcp { .. } => {
            let listener =
                TcpListener::bind(ctrl).map_err(|err| setup_failed(e("listen", &err)))?;
            if let Some(cc) = tcp_cc {
                // Accepted sockets inherit the listener's congestion control (DCTCP's
                // receiver half runs where the accepting socket uses it).
                tcp_cc::set_congestion_control(&listener, cc)
                    .map_err(|err| setup_failed(e("TCP_CONGESTION", &err)))?;
            }
            let _ = ready.send((index, true));
            let mut s =
                accept_within(&listener, ACCEPT_TIMEOUT).map_err(|err| e("accept", &err))?;
            s.set_read_timeout(Some(TCP_IO_TIMEOUT))
                .and_then(|()| s.set_write_timeout(Some(TCP_IO_TIMEOUT)))
                .map_err(|err| e("timeout", &err))?;
            for (i, t) in p.tensors.iter().enumerate() {
                if let Some(stop) = injected(i) {
                    return Err(stop);
                }
                let mut buf = vec![0u8; t.elems * 4];
                s.read_exact(&mut buf)
                    .map_err(|err| e(&format!("read tensor {}", t.id), &err))?;
                let want = tensor_values(t, p.sender_id, it);
                let wrong = buf
                    .iter()
                    .zip(want.as_bytes())
                    .filter(|(x, y)| x != y)
                    .count() as u64;
                s.write_all(&[1]).map_err(|err| e("ack", &err))?;
                out.push((1.0, wrong));
            }
        }
    }
    Ok(())
}

/// Sends every tensor of `p`, recording the FCT and data packets of each in `out`; stops at
/// the first error (which carries the time and packets spent on the tensor it stopped at).
#[allow(clippy::too_many_arguments)]
fn send(
    p: &Pair,
    v: &Variant,
    src: IpAddr,
    dst: IpAddr,
    rate_bps: u64,
    layers: u32,
    spray_ports: u16,
    it: u32,
    period_ns: u64,
    tcp_cc: Option<&str>,
    out: &mut Vec<Sent>,
) -> Result<(), Stop> {
    let e = |what: &str, err: &dyn std::fmt::Display| p.sender_stop(what, err);
    let ctrl = SocketAddr::new(dst, ctrl_port(p.src));
    match &v.kind {
        VariantKind::Gradwire {
            loss_bound,
            tagging,
            spray,
            rate_control,
            cc,
        } => {
            let k = if *spray { spray_ports.max(1) } else { 1 };
            let udp = UdpConfig {
                spray_ports: k,
                ..UdpConfig::default()
            };
            // Distinct source ports per destination on this host.
            let local = SocketAddr::new(src, 20_000 + 64 * p.dst as u16);
            let dp = UdpDatapath::bind(local, udp).map_err(|err| e("bind", &err))?;
            let mut s = Sender::connect(
                ctrl,
                dp,
                transfer_config(rate_bps, *rate_control, cc, period_ns),
            )
            .map_err(|err| e("connect", &err))?;
            let bound = LossBound::from_fraction(*loss_bound).map_err(|err| e("bound", &err))?;
            for t in &p.tensors {
                let tensor = tensor_values(t, p.sender_id, it);
                let opts = SendOptions {
                    round: it,
                    layer: u16::try_from(t.layer).unwrap_or(u16::MAX),
                    loss_bound: Some(bound),
                    ..SendOptions::new(p.job, t.id)
                };
                let packets_before = s.datapath().stats().tx_packets;
                let t0 = Instant::now();
                let res = if *tagging {
                    let tagger = DlcpTagger::for_tensor(
                        &tensor,
                        t.layer,
                        layers,
                        &MagnitudeConfig::default(),
                    )
                    .map_err(|err| e("tagging", &err))?;
                    s.send(&tensor, &opts, &tagger.priority_fn())
                } else {
                    // All one priority (the middle data queue), all ECN-capable.
                    let tag = Tag {
                        dscp: gradwire_qos::DATA_DSCP[3],
                        ect: true,
                    };
                    s.send(&tensor, &opts, &fixed_priority(tag))
                };
                let sent = Sent {
                    fct_us: t0.elapsed().as_secs_f64() * 1e6,
                    data_packets: s.datapath().stats().tx_packets - packets_before,
                };
                let res = res
                    .map(|_| ())
                    .map_err(|err| e(&format!("tensor {}", t.id), &err));
                tensor_done(out, sent, res)?;
            }
        }
        VariantKind::Msg(_) => {
            return Err(Stop::new(
                "a message-layer variant has no flow senders".into(),
            ));
        }
        VariantKind::Tcp { .. } => {
            let mut s = TcpStream::connect_timeout(&ctrl, ACCEPT_TIMEOUT)
                .map_err(|err| e("connect", &err))?;
            s.set_nodelay(true).map_err(|err| e("nodelay", &err))?;
            if let Some(cc) = tcp_cc {
                tcp_cc::set_congestion_control(&s, cc).map_err(|err| e("TCP_CONGESTION", &err))?;
            }
            s.set_read_timeout(Some(TCP_IO_TIMEOUT))
                .and_then(|()| s.set_write_timeout(Some(TCP_IO_TIMEOUT)))
                .map_err(|err| e("timeout", &err))?;
            let mut ack = [0u8; 1];
            for t in &p.tensors {
                let tensor = tensor_values(t, p.sender_id, it);
                let segs_before = data_segs_out(&s).map_err(|err| e("TCP_INFO", &err))?;
                let t0 = Instant::now();
                let res = s
                    .write_all(tensor.as_bytes())
                    .map_err(|err| format!("write tensor {}: {err}", t.id))
                    .and_then(|()| s.read_exact(&mut ack).map_err(|err| format!("ack: {err}")));
                let sent = Sent {
                    fct_us: t0.elapsed().as_secs_f64() * 1e6,
                    data_packets: data_segs_out(&s).map_or(0, |n| n.saturating_sub(segs_before)),
                };
                let res = res.map_err(|err| e(&format!("tensor {}", t.id), &err));
                tensor_done(out, sent, res)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_names() {
        assert_eq!(
            Variant::parse("gw-p1-nospray").unwrap().kind,
            VariantKind::Gradwire {
                loss_bound: 0.01,
                tagging: true,
                spray: false,
                rate_control: true,
                cc: GwCongestion::default(),
            }
        );
        assert!(matches!(
            Variant::parse("tcp-cubic").unwrap().kind,
            VariantKind::Tcp { .. }
        ));
        assert!(Variant::parse("gw-p99").is_err());
        assert!(Variant::parse("gw-p1-fast").is_err());
        assert!(Variant::parse("udp").is_err());
        assert_eq!(Variant::defaults().len(), 16);
    }

    #[test]
    fn congestion_control_variant_names() {
        let cc = |n: &str| match Variant::parse(n).map(|v| v.kind) {
            Ok(VariantKind::Gradwire { cc, .. }) => cc,
            other => panic!("{n}: {other:?}"),
        };
        assert_eq!(cc("gw-p1"), GwCongestion::default());
        let fig7 = cc("gw-p1-fig7");
        assert_eq!(
            (fig7.mode, fig7.small_burst, fig7.retransmit_ect),
            (RateMode::Fig7, false, false)
        );
        assert_eq!(cc("gw-p1-ecn").mode, RateMode::Ecn);
        assert!(!cc("gw-p1-noce").grant_ce);
        assert!(!cc("gw-p1-nomem").rate_memory);
        assert!(!cc("gw-p1-bigburst").small_burst);
        assert!(!cc("gw-p1-noimp").retransmit_ect);
        // The transfer configuration follows.
        let t = transfer_config(100_000_000, true, &cc("gw-p1-fig7"), 2_000_000);
        assert_eq!(t.sender.mode, RateMode::Fig7);
        assert_eq!(t.sender.burst_bytes, 64 * 1538);
        let t = transfer_config(100_000_000, true, &cc("gw-p1"), 2_000_000);
        assert_eq!(
            (t.sender.mode, t.sender.burst_bytes),
            (RateMode::Grant, 32 * 1538)
        );
        assert!(t.rate_memory && t.sender.retransmit_ect);
        let t = transfer_config(100_000_000, false, &cc("gw-p1"), 2_000_000);
        assert_eq!((t.sender.mode, t.sender.rate.delta), (RateMode::Fig7, 1e9));
    }

    #[test]
    fn message_layer_variant_names() {
        assert_eq!(
            Variant::parse("msg-p1").unwrap().kind,
            VariantKind::Msg(MsgSettings {
                loss_bound: 0.01,
                tagging: true,
                grants: true,
            })
        );
        assert_eq!(
            Variant::parse("msg-p0-nogrants-notag").unwrap().kind,
            VariantKind::Msg(MsgSettings {
                loss_bound: 0.0,
                tagging: false,
                grants: false,
            })
        );
        for bad in ["msg-p", "msg-p60", "msg-p1-nospray", "msg-1"] {
            assert!(Variant::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tcp_variant_names() {
        let tcp = |n: &str| Variant::parse(n).map(|v| v.kind);
        assert_eq!(
            tcp("tcp-cubic-ecn-rto10"),
            Ok(VariantKind::Tcp {
                congestion: "cubic".into(),
                ecn: true,
                rto_min_ms: Some(10)
            })
        );
        assert_eq!(
            tcp("tcp-bbr"),
            Ok(VariantKind::Tcp {
                congestion: "bbr".into(),
                ecn: false,
                rto_min_ms: None
            })
        );
        // DCTCP runs with ECN whether or not the name says so.
        assert_eq!(
            tcp("tcp-dctcp-rto10"),
            Ok(VariantKind::Tcp {
                congestion: "dctcp".into(),
                ecn: true,
                rto_min_ms: Some(10)
            })
        );
        for bad in [
            "tcp-",
            "tcp-cubic-fast",
            "tcp-cubic-rto0",
            "tcp-cubic-rtox",
            "tcp-cu.bic",
        ] {
            assert!(tcp(bad).is_err(), "{bad}");
        }
    }

    fn pair(tensors: u32) -> Pair {
        Pair {
            job: 1,
            src: 0,
            dst: 8,
            sender_id: 0,
            tensors: (0..tensors)
                .map(|i| TensorSpec {
                    id: i * 16,
                    layer: i,
                    elems: 1000,
                    server: 0,
                })
                .collect(),
        }
    }

    fn sent(n: usize) -> Vec<Sent> {
        (0..n)
            .map(|i| Sent {
                fct_us: 100.0 + i as f64,
                data_packets: 3,
            })
            .collect()
    }

    #[test]
    fn a_receiver_that_fails_mid_pair_fails_its_tensor_and_the_rest() {
        let p = pair(5);
        // The receiver delivered two tensors and failed at the third; the sender completed two
        // and failed at the third (peer gone) after 7 ms and 4 packets.
        let s = Outcome {
            done: sent(2),
            stopped: Some(Stop {
                error: "sender: peer gone".into(),
                elapsed_us: 7000.0,
                data_packets: 4,
            }),
        };
        let r = Outcome {
            done: vec![(1.0, 0), (0.99, 0)],
            stopped: Some(Stop::new("receiver: injected fault".into())),
        };
        let recs = merge(&p, true, 3, s, r);
        assert_eq!(recs.len(), 5);
        assert!(recs[0].completed() && recs[1].completed());
        assert_eq!(recs[1].delivered_fraction, 0.99);
        assert_eq!(recs[1].fct_us, 101.0);
        let e2 = recs[2].error.as_deref().unwrap();
        assert!(
            e2.contains("peer gone") && e2.contains("injected fault"),
            "{e2}"
        );
        assert_eq!((recs[2].fct_us, recs[2].data_packets), (7000.0, 4));
        for r in &recs[3..] {
            let e = r.error.as_deref().unwrap();
            assert!(e.starts_with("after an earlier failure"), "{e}");
            assert_eq!(
                (r.fct_us, r.data_packets, r.delivered_fraction),
                (0.0, 0, 0.0)
            );
        }
        assert!(recs
            .iter()
            .all(|r| r.iteration == 3 && r.push && r.dst == 8));
    }

    #[test]
    fn a_sender_without_a_result_fails_every_tensor_of_its_pair() {
        let p = pair(3);
        let recs = merge(
            &p,
            false,
            0,
            Outcome::failed("timeout: the sender gave no result within 60 s".into()),
            Outcome {
                done: vec![(1.0, 0)],
                stopped: Some(Stop::new("receiver: peer stalled".into())),
            },
        );
        assert!(recs[0].error.as_deref().unwrap().contains("timeout"));
        // Tensor 1: the receiver failed there, the sender never got to it.
        assert!(recs[1].error.as_deref().unwrap().contains("stalled"));
        assert!(recs[2]
            .error
            .as_deref()
            .unwrap()
            .contains("earlier failure"));
        assert!(recs.iter().all(|r| !r.push && !r.completed()));
    }

    #[test]
    fn complete_outcomes_give_completed_records() {
        let p = pair(2);
        let recs = merge(
            &p,
            true,
            0,
            Outcome::of(sent(2), Ok(())),
            Outcome::of(vec![(1.0, 0), (1.0, 0)], Ok(())),
        );
        assert!(recs.iter().all(FlowRecord::completed));
        assert_eq!(recs[1].bytes, 4000);
    }
}
