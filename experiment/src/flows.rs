//! Running the variants: one fresh fabric per variant, phases of concurrent pairs.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::LossBound;
use gradwire::tagging::{DlcpTagger, MagnitudeConfig};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};
use gradwire_control::model::load_model;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig};
use gradwire_fabric::topology::Topology;
use gradwire_netns::spawn_in_netns;
use serde::Serialize;

use crate::report::{summarize, ExperimentReport, FlowRecord, VariantResult};
use crate::workload::{tensor_values, TensorSpec, Workload};
use crate::{ExperimentError, IncastConfig};

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
        /// Rate control; off: Δ = 10⁹, the sender never halves.
        rate_control: bool,
    },
    /// Kernel TCP with this congestion control.
    Tcp {
        /// `cubic`, `dctcp`, ...
        congestion: String,
    },
}

/// A named variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Variant {
    /// Name in tables and on the command line.
    pub name: String,
    /// What it runs.
    pub kind: VariantKind,
}

impl Variant {
    /// A variant by name: `gw-p<percent>[-notag][-nospray][-norc]` or `tcp-<congestion>`.
    pub fn parse(name: &str) -> Result<Variant, String> {
        if let Some(cc) = name.strip_prefix("tcp-") {
            if cc.is_empty() || !cc.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(format!("variant {name:?}: bad congestion control name"));
            }
            return Ok(Variant {
                name: name.into(),
                kind: VariantKind::Tcp {
                    congestion: cc.into(),
                },
            });
        }
        let rest = name.strip_prefix("gw-p").ok_or_else(|| {
            format!("variant {name:?}: expected gw-p<percent>[-notag][-nospray][-norc] or tcp-<cc>")
        })?;
        let mut parts = rest.split('-');
        let pct: f64 = parts
            .next()
            .and_then(|p| p.parse().ok())
            .filter(|p: &f64| (0.0..=50.0).contains(p))
            .ok_or_else(|| {
                format!("variant {name:?}: the loss bound must be a percentage 0..=50")
            })?;
        let (mut tagging, mut spray, mut rate_control) = (true, true, true);
        for p in parts {
            match p {
                "notag" => tagging = false,
                "nospray" => spray = false,
                "norc" => rate_control = false,
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
            },
        })
    }

    /// The comparison and ablations.
    pub fn defaults() -> Vec<Variant> {
        [
            "gw-p1",
            "gw-p10",
            "gw-p0",
            "tcp-cubic",
            "tcp-dctcp",
            "gw-p1-notag",
            "gw-p1-nospray",
            "gw-p1-norc",
        ]
        .iter()
        .filter_map(|n| Variant::parse(n).ok())
        .collect()
    }
}

/// Congestion controls this kernel offers.
fn available_cc() -> Vec<String> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

/// (delivered fraction, wrong bytes) of one received tensor.
type Received = (f64, u64);

/// One direction of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Push,
    Pull,
}

/// A sender -> receiver pair of one phase.
#[derive(Debug, Clone)]
struct Pair {
    job: u32,
    src: usize,
    dst: usize,
    /// Seeds the values (the worker's index for push, 1000 + server index for pull).
    sender_id: usize,
    tensors: Vec<TensorSpec>,
}

/// Runs every variant of `cfg`.
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
    let cc = available_cc();
    let mut results = Vec::new();
    for v in &cfg.variants {
        if let VariantKind::Tcp { congestion } = &v.kind {
            if !cc.contains(congestion) {
                results.push(VariantResult::skipped(
                    v,
                    format!(
                        "this kernel offers no {congestion} (tcp_available_congestion_control: {})",
                        cc.join(" ")
                    ),
                ));
                continue;
            }
        }
        eprintln!("experiment: variant {} ...", v.name);
        results.push(run_variant(cfg, &topo, &wl, &servers, &workers, v)?);
    }
    Ok(ExperimentReport {
        topology: cfg.topology.display().to_string(),
        model: model.name.clone(),
        scale: cfg.scale,
        iterations: cfg.iterations,
        workers: workers.len(),
        servers: servers.len(),
        bytes_per_worker: wl.bytes_per_worker(),
        tensors_per_worker: wl.per_server.iter().map(Vec::len).sum(),
        link_rate_bps: link_rate(&topo, workers[0]),
        results,
    })
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

fn run_variant(
    cfg: &IncastConfig,
    topo: &Topology,
    wl: &Workload,
    servers: &[usize],
    workers: &[usize],
    v: &Variant,
) -> Result<VariantResult, ExperimentError> {
    let net = FabricNet::up(topo)?;
    let fabric = spawn(topo, net.switch_namespaces(), FabricConfig::default())?;
    let mut flows = Vec::new();
    let mut iterations = Vec::new();
    for it in 0..cfg.iterations {
        let mut total = Duration::ZERO;
        for phase in [Phase::Push, Phase::Pull] {
            let ps = pairs(phase, wl, servers, workers);
            let (took, mut recs) = run_phase(cfg, topo, &net, wl, v, phase, it, &ps)?;
            total += took;
            flows.append(&mut recs);
        }
        iterations.push(total);
    }
    let st = fabric.wait_idle(Duration::from_secs(10));
    let stats = fabric
        .stop()
        .ok_or_else(|| ExperimentError::Other("the fabric published no stats".into()))?;
    net.down()?;
    if !st {
        eprintln!(
            "experiment: warning: the fabric did not drain after {}",
            v.name
        );
    }
    Ok(summarize(v, flows, iterations, &stats))
}

/// Starts every receiver, waits until all listen, then starts every sender; returns the
/// phase's duration (first send to last completion) and its flows.
#[allow(clippy::too_many_arguments)]
fn run_phase(
    cfg: &IncastConfig,
    topo: &Topology,
    net: &FabricNet,
    wl: &Workload,
    v: &Variant,
    phase: Phase,
    it: u32,
    pairs: &[Pair],
) -> Result<(Duration, Vec<FlowRecord>), ExperimentError> {
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let mut receivers: Vec<JoinHandle<Result<Vec<Received>, String>>> = Vec::new();
    for p in pairs {
        let ns = net
            .host_ns(p.dst)
            .ok_or_else(|| ExperimentError::Other(format!("no host {}", p.dst)))?;
        let ip = IpAddr::V4(topo.hosts[p.dst].ip);
        let (p2, v2, ready) = (p.clone(), v.clone(), ready_tx.clone());
        let period = cfg.period_ns;
        receivers.push(spawn_in_netns(ns, move || {
            receive(&p2, &v2, ip, it, period, &ready)
        })?);
    }
    drop(ready_tx);
    for _ in pairs {
        match ready_rx.recv_timeout(Duration::from_secs(20)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ExperimentError::Other(e)),
            Err(_) => return Err(ExperimentError::Other("a receiver never started".into())),
        }
    }
    let start = Instant::now();
    let mut senders: Vec<JoinHandle<Result<Vec<f64>, String>>> = Vec::new();
    for p in pairs {
        let ns = net
            .host_ns(p.src)
            .ok_or_else(|| ExperimentError::Other(format!("no host {}", p.src)))?;
        let src_ip = IpAddr::V4(topo.hosts[p.src].ip);
        let dst_ip = IpAddr::V4(topo.hosts[p.dst].ip);
        let rate = link_rate(topo, p.src);
        let (p2, v2) = (p.clone(), v.clone());
        let (layers, spray, period) = (wl.layers, cfg.spray_ports, cfg.period_ns);
        senders.push(spawn_in_netns(ns, move || {
            send(&p2, &v2, src_ip, dst_ip, rate, layers, spray, it, period)
        })?);
    }
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let mut fcts = Vec::new();
    for h in senders {
        match h.join() {
            Ok(Ok(f)) => fcts.push(f),
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a sender panicked".into()),
        }
    }
    let took = start.elapsed();
    let mut got = Vec::new();
    for h in receivers {
        match h.join() {
            Ok(Ok(r)) => got.push(r),
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a receiver panicked".into()),
        }
    }
    if let Some(e) = errors.first() {
        return Err(ExperimentError::Other(format!(
            "variant {} {phase:?} iteration {it}: {e} ({} errors)",
            v.name,
            errors.len()
        )));
    }
    for ((p, f), r) in pairs.iter().zip(fcts).zip(got) {
        for ((t, fct), (delivered, wrong)) in p.tensors.iter().zip(f).zip(r) {
            out.push(FlowRecord {
                iteration: it,
                push: phase == Phase::Push,
                src: p.src,
                dst: p.dst,
                tensor: t.id,
                layer: t.layer,
                bytes: t.elems as u64 * 4,
                fct_us: fct,
                delivered_fraction: delivered,
                wrong_bytes: wrong,
            });
        }
    }
    Ok((took, out))
}

fn data_port(peer: usize) -> u16 {
    7000 + peer as u16
}

fn ctrl_port(peer: usize) -> u16 {
    8000 + peer as u16
}

fn transfer_config(rate_bps: u64, rate_control: bool, period_ns: u64) -> TransferConfig {
    let mut c = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    c.sender.rate.line_rate_bps = rate_bps;
    c.sender.rate.period_ns = period_ns;
    if !rate_control {
        // Δ = 10^9: the send rate is never "more than Δ times" a receive rate above 1 bit/s,
        // so the sender never halves (rate control validates Δ as finite).
        c.sender.rate.delta = 1e9;
    }
    c
}

/// Receives every tensor of `p`; returns (delivered fraction, wrong bytes) per tensor.
fn receive(
    p: &Pair,
    v: &Variant,
    ip: IpAddr,
    it: u32,
    period_ns: u64,
    ready: &mpsc::Sender<Result<(), String>>,
) -> Result<Vec<Received>, String> {
    let e = |what: &str, err: &dyn std::fmt::Display| {
        format!("receiver of job {} on host {}: {what}: {err}", p.job, p.dst)
    };
    // A setup failure is reported to the phase (which waits for every receiver) and returned.
    let setup_failed = |m: String| {
        let _ = ready.send(Err(m.clone()));
        m
    };
    let listener = TcpListener::bind(SocketAddr::new(ip, ctrl_port(p.src)))
        .map_err(|err| setup_failed(e("listen", &err)))?;
    let mut out = Vec::with_capacity(p.tensors.len());
    match &v.kind {
        VariantKind::Gradwire { .. } => {
            let dp = UdpDatapath::bind(SocketAddr::new(ip, data_port(p.src)), UdpConfig::default())
                .map_err(|err| setup_failed(e("bind data socket", &err)))?;
            let _ = ready.send(Ok(()));
            let mut r = Receiver::accept(
                &listener,
                dp,
                transfer_config(1_000_000_000, true, period_ns),
            )
            .map_err(|err| e("accept", &err))?;
            for t in &p.tensors {
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
        VariantKind::Tcp { .. } => {
            let _ = ready.send(Ok(()));
            let (mut s, _) = listener.accept().map_err(|err| e("accept", &err))?;
            s.set_read_timeout(Some(Duration::from_secs(60)))
                .map_err(|err| e("timeout", &err))?;
            for t in &p.tensors {
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
    Ok(out)
}

/// Sends every tensor of `p`; returns the FCT of each in microseconds.
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
) -> Result<Vec<f64>, String> {
    let e = |what: &str, err: &dyn std::fmt::Display| {
        format!("sender of job {} on host {}: {what}: {err}", p.job, p.src)
    };
    let ctrl = SocketAddr::new(dst, ctrl_port(p.src));
    let mut fcts = Vec::with_capacity(p.tensors.len());
    match &v.kind {
        VariantKind::Gradwire {
            loss_bound,
            tagging,
            spray,
            rate_control,
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
                transfer_config(rate_bps, *rate_control, period_ns),
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
                res.map_err(|err| e(&format!("tensor {}", t.id), &err))?;
                fcts.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        VariantKind::Tcp { congestion } => {
            let mut s = TcpStream::connect_timeout(&ctrl, Duration::from_secs(10))
                .map_err(|err| e("connect", &err))?;
            s.set_nodelay(true).map_err(|err| e("nodelay", &err))?;
            let name = std::ffi::OsString::from(congestion);
            nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::TcpCongestion, &name)
                .map_err(|err| e("TCP_CONGESTION", &err))?;
            s.set_read_timeout(Some(Duration::from_secs(60)))
                .map_err(|err| e("timeout", &err))?;
            let mut ack = [0u8; 1];
            for t in &p.tensors {
                let tensor = tensor_values(t, p.sender_id, it);
                let t0 = Instant::now();
                s.write_all(tensor.as_bytes())
                    .map_err(|err| e(&format!("write tensor {}", t.id), &err))?;
                s.read_exact(&mut ack).map_err(|err| e("ack", &err))?;
                fcts.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    Ok(fcts)
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
                rate_control: true
            }
        );
        assert!(matches!(
            Variant::parse("tcp-cubic").unwrap().kind,
            VariantKind::Tcp { .. }
        ));
        assert!(Variant::parse("gw-p99").is_err());
        assert!(Variant::parse("gw-p1-fast").is_err());
        assert!(Variant::parse("udp").is_err());
        assert_eq!(Variant::defaults().len(), 8);
    }
}
