//! `gradwire bench`: AF_XDP against kernel UDP on the same veth pair between two network
//! namespaces, in one run: transmit only, receive only, and whole bounded-loss transfers.
//!
//! Every phase reports packets per second, Gbit/s and CPU time per packet. CPU time is counted
//! system-wide from `/proc/stat` (all cores, user + system + softirq), because on veth much of
//! the per-packet work runs in softirq context outside this process; it therefore includes
//! both ends and the generator. The phases:
//!
//! - `tx`: host 0 sends pre-built gradwire datagrams as fast as the datapath takes them for
//!   `--seconds`; host 1's XDP classifier counts and drops them (fault injection p = 1), the
//!   cheapest possible sink, so the figure is dominated by the sending path.
//! - `rx`: the same AF_XDP generator on host 0 for both; host 1 receives with the datapath
//!   under test and counts datagrams. Throughput is what the receiver got.
//! - `transfer`: `--count` bounded-loss transfers of `--size` through the whole protocol
//!   (rate control, control channel, placement into the tensor).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Args;
use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, BusyPoll, PollMode};
use gradwire::ctrl_listener::{CtrlListener, ListenerConfig};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::{tos, Datapath, RxMeta, TxMeta};
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};
use gradwire::wire::header;
use gradwire_ebpf::{XdpConfig, XdpProgram};
use gradwire_netns::{Testbed, TestbedConfig};
use serde::Serialize;

type Res<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const DATA_PORT: u16 = 7000;
const CTRL_PORT: u16 = 7001;
const DSCP: u8 = 10;

/// With `--engine` the cores belong to the workers, not to the benchmark threads.
static ENGINE_OWNS_CORES: AtomicBool = AtomicBool::new(false);

/// Options of `gradwire bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Seconds per tx/rx phase.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Payload bytes per packet (gradwire header excluded).
    #[arg(long, default_value_t = 1440)]
    pub payload: usize,
    /// Packets per datapath call.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Queues per veth end (AF_XDP binds one socket per queue).
    #[arg(long, default_value_t = 1)]
    pub queues: u32,
    /// Pin the sending and receiving threads to these cores (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub cores: Vec<usize>,
    /// Busy-poll instead of wake-on-demand (needs a core per thread).
    #[arg(long)]
    pub busy_poll: bool,
    /// XDP attach mode for the AF_XDP runs: auto, native or generic. Generic by default:
    /// on veth, native XDP copies every skb-borne packet into a page-pool page first
    /// (`skb_pp_cow_data`), which measured slower than generic mode (docs/benchmarks.md).
    #[arg(long, default_value = "generic")]
    pub xdp_mode: gradwire_ebpf::AttachMode,
    /// AF_XDP through the engine: one pinned worker per queue (`--cores` are the workers').
    #[arg(long)]
    pub engine: bool,
    /// UMEM frame size.
    #[arg(long, default_value_t = 4096)]
    pub frame_size: u32,
    /// Tensor size of the transfer phase: bytes, or with a unit (e.g. 64MiB, 1G).
    #[arg(long, default_value = "64MiB", value_parser = |s: &str| -> Result<usize, String> {
        let b = gradwire_units::parse_size(s).map_err(|e| e.to_string())?;
        usize::try_from(b.0).map_err(|_| format!("{s:?} does not fit this machine's memory"))
    })]
    pub size: usize,
    /// Transfers in the transfer phase.
    #[arg(long, default_value_t = 4)]
    pub count: u32,
    /// Phases to run.
    #[arg(long, value_delimiter = ',', default_value = "tx,rx,transfer")]
    pub phases: Vec<String>,
    /// Datapaths to run (both by default; one alone is useful under a profiler).
    #[arg(long, value_delimiter = ',', default_value = "afxdp,udp")]
    pub datapaths: Vec<String>,
    /// One JSON object: {"afxdp": {...}, "udp": {...}, "ratio_pps": {...}, ...}.
    #[arg(long)]
    pub json: bool,
}

/// One phase's figures.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PhaseResult {
    /// Packets counted (sent for tx, received for rx and transfer).
    pub packets: u64,
    /// Payload-carrying datagram bytes counted.
    pub bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// Busy CPU seconds, all cores.
    pub cpu_seconds: f64,
    /// Million packets per second.
    pub mpps: f64,
    /// Gbit/s of datagram bytes.
    pub gbps: f64,
    /// System-wide CPU nanoseconds per packet.
    pub cpu_ns_per_packet: f64,
    /// Packets per busy CPU-second.
    pub packets_per_cpu_second: f64,
}

impl PhaseResult {
    fn new(packets: u64, bytes: u64, seconds: f64, cpu_seconds: f64) -> PhaseResult {
        let per = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        PhaseResult {
            packets,
            bytes,
            seconds,
            cpu_seconds,
            mpps: per(packets as f64, seconds) / 1e6,
            gbps: per(bytes as f64 * 8.0, seconds) / 1e9,
            cpu_ns_per_packet: per(cpu_seconds * 1e9, packets as f64),
            packets_per_cpu_second: per(packets as f64, cpu_seconds),
        }
    }
}

/// Busy and total jiffies of all CPUs from `/proc/stat`.
fn cpu_jiffies() -> Res<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().ok_or("empty /proc/stat")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 5 {
        return Err("unexpected /proc/stat format".into());
    }
    // user nice system idle iowait irq softirq steal ...; idle and iowait are not busy.
    let total: u64 = v.iter().take(8).sum();
    Ok((total - v[3] - v[4], total))
}

pub(crate) struct CpuClock {
    jiffies: u64,
    at: Instant,
}

impl CpuClock {
    pub(crate) fn start() -> Res<CpuClock> {
        Ok(CpuClock {
            jiffies: cpu_jiffies()?.0,
            at: Instant::now(),
        })
    }
    /// (wall seconds, busy CPU seconds) since start.
    pub(crate) fn stop(&self) -> Res<(f64, f64)> {
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as f64;
        let busy = cpu_jiffies()?.0.saturating_sub(self.jiffies) as f64 / hz;
        Ok((self.at.elapsed().as_secs_f64(), busy))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Afxdp,
    Udp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Afxdp => "afxdp",
            Kind::Udp => "udp",
        }
    }
}

fn pin(cores: &[usize], i: usize) {
    if let Some(&c) = cores.get(i) {
        if ENGINE_OWNS_CORES.load(Ordering::Relaxed) {
            return;
        }
        if !core_affinity::set_for_current(core_affinity::CoreId { id: c }) {
            eprintln!("gradwire bench: cannot pin to core {c}; running unpinned");
        }
    }
}

fn afxdp_config(a: &BenchArgs, ip: IpAddr) -> AfXdpConfig {
    let mut c = AfXdpConfig::new("gw0", SocketAddr::new(ip, DATA_PORT));
    c.queues = (0..a.queues).collect();
    c.batch = a.batch;
    c.xdp_mode = a.xdp_mode;
    c.socket.frame_size = a.frame_size;
    // The rx phase's generator is not a flow, so nothing would admit it to the classifier's
    // allowlist: the bench's two hosts are each other's peers from the start.
    c.allowlist = Some(vec![
        gradwire_netns::testbed::host_ipv4(0).into(),
        gradwire_netns::testbed::host_ipv4(1).into(),
    ]);
    if a.busy_poll {
        c.poll = PollMode::BusyPoll;
        c.socket.busy_poll = Some(BusyPoll {
            usecs: 50,
            budget: 64,
        });
    }
    c
}

fn open(kind: Kind, a: &BenchArgs, ip: IpAddr) -> Res<Box<dyn Datapath>> {
    Ok(match kind {
        Kind::Afxdp if a.engine => Box::new(gradwire::afxdp::engine::Engine::start(
            gradwire::afxdp::engine::EngineConfig {
                afxdp: afxdp_config(a, ip),
                cores: a.cores.clone(),
            },
        )?),
        Kind::Afxdp => Box::new(AfXdpDatapath::open(afxdp_config(a, ip))?),
        Kind::Udp => Box::new(UdpDatapath::bind(
            SocketAddr::new(ip, DATA_PORT),
            UdpConfig {
                batch: a.batch,
                ..UdpConfig::default()
            },
        )?),
    })
}

/// A valid gradwire datagram with `payload` bytes.
fn datagram(payload: usize) -> Vec<u8> {
    let repr = header::Repr {
        kind: header::Kind::Data,
        flags: header::Flags::EMPTY,
        pass: 0,
        job_id: 1,
        tensor_id: 1,
        round: 0,
        offset: 0,
        seq: 0,
        length: payload as u16,
        layer: 0,
    };
    let mut buf = vec![0x5au8; header::HEADER_LEN + payload];
    let mut pkt = header::Packet::new_unchecked(&mut buf[..]);
    // A payload within u16 always fits the buffer built for it.
    let _ = repr.emit(&mut pkt);
    buf
}

/// Send pre-built datagrams to `dst` until `stop` or `secs`; returns (packets, bytes).
fn blast(
    dp: &mut dyn Datapath,
    dst: SocketAddr,
    payload: usize,
    batch: usize,
    secs: f64,
    stop: &AtomicBool,
) -> Res<(u64, u64)> {
    let d = datagram(payload);
    let meta = TxMeta {
        dst,
        tos: tos(DSCP, 0b10),
    };
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (mut n, mut bytes) = (0u64, 0u64);
    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        let sent = dp.send(batch, &mut |buf: &mut [u8]| {
            let out = buf.get_mut(..d.len())?;
            out.copy_from_slice(&d);
            Some((d.len(), meta))
        })?;
        n += sent as u64;
        bytes += (sent * d.len()) as u64;
    }
    Ok((n, bytes))
}

fn tx_phase(tb: &Testbed, kind: Kind, a: &BenchArgs) -> Res<PhaseResult> {
    let (ip0, ip1) = (IpAddr::V4(tb.host(0).ipv4), IpAddr::V4(tb.host(1).ipv4));
    let barrier = Arc::new(Barrier::new(3));
    let done = Arc::new(AtomicBool::new(false));
    let (b1, d1) = (barrier.clone(), done.clone());
    let sink = tb.spawn_in(1, move || -> Res<u64> {
        let mut xc = XdpConfig::new(vec![DATA_PORT]);
        xc.fault_drop[usize::from(DSCP)] = 1.0;
        let prog = XdpProgram::attach("gw0", &xc)?;
        b1.wait();
        while !d1.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(prog.counters()?.drop_fault.packets)
    })?;
    let (b0, a0) = (barrier.clone(), a.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let s0 = stop.clone();
    let source = tb.spawn_in(0, move || -> Res<(u64, u64)> {
        pin(&a0.cores, 0);
        let mut dp = open(kind, &a0, ip0);
        let r = match &mut dp {
            Ok(dp) => {
                b0.wait();
                blast(
                    dp.as_mut(),
                    SocketAddr::new(ip1, DATA_PORT),
                    a0.payload,
                    a0.batch,
                    a0.seconds,
                    &s0,
                )
            }
            Err(_) => {
                b0.wait();
                Ok((0, 0))
            }
        };
        dp?;
        r
    })?;
    barrier.wait();
    let clock = CpuClock::start()?;
    let sent = source.join().map_err(|_| "sender panicked")?;
    let (secs, cpu) = clock.stop()?;
    done.store(true, Ordering::Relaxed);
    let seen = sink.join().map_err(|_| "sink panicked")??;
    let (packets, bytes) = sent?;
    let _ = seen;
    Ok(PhaseResult::new(packets, bytes, secs, cpu))
}

fn rx_phase(tb: &Testbed, kind: Kind, a: &BenchArgs) -> Res<PhaseResult> {
    let (ip0, ip1) = (IpAddr::V4(tb.host(0).ipv4), IpAddr::V4(tb.host(1).ipv4));
    let barrier = Arc::new(Barrier::new(3));
    let stop = Arc::new(AtomicBool::new(false));
    let (b1, s1, a1) = (barrier.clone(), stop.clone(), a.clone());
    let receiver = tb.spawn_in(1, move || -> Res<(u64, u64)> {
        pin(&a1.cores, 1);
        let dp = open(kind, &a1, ip1);
        b1.wait();
        let mut dp = dp?;
        let (mut n, mut bytes) = (0u64, 0u64);
        let mut quiet = 0;
        // Count until the generator stopped and the queue stayed empty for a moment.
        while !s1.load(Ordering::Relaxed) || quiet < 5 {
            let got = dp.recv(
                a1.batch,
                Duration::from_millis(2),
                &mut |_: &RxMeta, d: &[u8]| {
                    n += 1;
                    bytes += d.len() as u64;
                },
            )?;
            quiet = if got == 0 { quiet + 1 } else { 0 };
        }
        Ok((n, bytes))
    })?;
    let (b0, s0, a0) = (barrier.clone(), stop.clone(), a.clone());
    let generator = tb.spawn_in(0, move || -> Res<(u64, u64)> {
        pin(&a0.cores, 0);
        let dp = open(Kind::Afxdp, &a0, ip0);
        b0.wait();
        let never = AtomicBool::new(false);
        let r = blast(
            dp?.as_mut(),
            SocketAddr::new(ip1, DATA_PORT),
            a0.payload,
            a0.batch,
            a0.seconds,
            &never,
        );
        s0.store(true, Ordering::Relaxed);
        r
    })?;
    barrier.wait();
    let clock = CpuClock::start()?;
    let gen = generator.join().map_err(|_| "generator panicked")?;
    let got = receiver.join().map_err(|_| "receiver panicked")?;
    let (secs, cpu) = clock.stop()?;
    gen?;
    let (packets, bytes) = got?;
    Ok(PhaseResult::new(packets, bytes, secs, cpu))
}

fn transfer_phase(tb: &Testbed, kind: Kind, a: &BenchArgs) -> Res<PhaseResult> {
    let (ip0, ip1) = (IpAddr::V4(tb.host(0).ipv4), IpAddr::V4(tb.host(1).ipv4));
    let elems = a.size / 4;
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(30),
        batch: a.batch,
        ..TransferConfig::default()
    };
    let barrier = Arc::new(Barrier::new(3));
    let (b1, a1, c1) = (barrier.clone(), a.clone(), cfg.clone());
    let receiver = tb.spawn_in(1, move || -> Res<u64> {
        pin(&a1.cores, 1);
        let listener =
            CtrlListener::bind(SocketAddr::new(ip1, CTRL_PORT), ListenerConfig::default())?;
        let dp = open(kind, &a1, ip1);
        b1.wait();
        let mut rx = Receiver::accept(&listener, dp?, c1)?;
        let mut t = Tensor::zeros(DType::F32, elems);
        let mut packets = 0;
        for round in 0..a1.count {
            let r = rx.recv(
                &mut t,
                &RecvOptions {
                    round: Some(round),
                    ..RecvOptions::new(1, 1)
                },
            )?;
            packets += r.stats.placed + r.stats.duplicates;
        }
        Ok(packets)
    })?;
    let (b0, a0) = (barrier.clone(), a.clone());
    let sender = tb.spawn_in(0, move || -> Res<u64> {
        pin(&a0.cores, 0);
        let dp = open(kind, &a0, ip0);
        b0.wait();
        let mut tx = Sender::connect(SocketAddr::new(ip1, CTRL_PORT), dp?, cfg)?;
        let mut t = Tensor::zeros(DType::F32, elems);
        t.fill_pattern(1);
        let prio = fixed_priority(Tag {
            dscp: DSCP,
            ect: true,
        });
        let mut bytes = 0;
        for round in 0..a0.count {
            let opts = SendOptions {
                round,
                loss_bound: Some(LossBound::from_fraction(0.01)?),
                ..SendOptions::new(1, 1)
            };
            let s = tx.send(&t, &opts, &prio)?;
            bytes += s.stats.payload_bytes + s.stats.packets * header::HEADER_LEN as u64;
        }
        Ok(bytes)
    })?;
    barrier.wait();
    let clock = CpuClock::start()?;
    let sent = sender.join().map_err(|_| "sender panicked")?;
    let got = receiver.join().map_err(|_| "receiver panicked")?;
    let (secs, cpu) = clock.stop()?;
    let bytes = sent?;
    let packets = got?;
    Ok(PhaseResult::new(packets, bytes, secs, cpu))
}

/// Results of one datapath.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DatapathResult {
    /// Transmit only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tx: Option<PhaseResult>,
    /// Receive only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rx: Option<PhaseResult>,
    /// Whole transfers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer: Option<PhaseResult>,
}

/// AF_XDP / UDP ratios per phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ratios {
    /// Transmit only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tx: Option<f64>,
    /// Receive only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rx: Option<f64>,
    /// Whole transfers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer: Option<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// AF_XDP figures.
    pub afxdp: DatapathResult,
    /// Kernel UDP figures.
    pub udp: DatapathResult,
    /// AF_XDP packets per second over UDP's, per phase.
    pub ratio_pps: Ratios,
    /// AF_XDP packets per CPU-second over UDP's, per phase.
    pub ratio_pkts_per_cpu_second: Ratios,
    /// Machine and settings.
    pub setup: serde_json::Value,
}

fn ratio(
    a: Option<PhaseResult>,
    b: Option<PhaseResult>,
    f: fn(&PhaseResult) -> f64,
) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if f(&b) > 0.0 => Some(f(&a) / f(&b)),
        _ => None,
    }
}

/// Run the benchmark.
pub fn run(a: &BenchArgs) -> Res {
    if !gradwire_netns::is_root() {
        return Err(
            "gradwire bench needs root (it creates network namespaces and attaches XDP programs)"
                .into(),
        );
    }
    if !(a.seconds > 0.0 && a.seconds < 3600.0)
        || a.payload == 0
        || a.payload > 3000
        || a.batch == 0
    {
        return Err(
            "--seconds must be in (0, 3600), --payload in 1..=3000, --batch at least 1".into(),
        );
    }
    for p in &a.phases {
        if !["tx", "rx", "transfer"].contains(&p.as_str()) {
            return Err(format!("unknown phase {p:?} (tx, rx, transfer)").into());
        }
    }
    ENGINE_OWNS_CORES.store(a.engine, Ordering::Relaxed);
    let tb = Testbed::up(&TestbedConfig {
        queues: a.queues,
        ..TestbedConfig::default()
    })?;
    let mut res = [DatapathResult::default(), DatapathResult::default()];
    for d in &a.datapaths {
        if !["afxdp", "udp"].contains(&d.as_str()) {
            return Err(format!("unknown datapath {d:?} (afxdp, udp)").into());
        }
    }
    for (i, kind) in [Kind::Afxdp, Kind::Udp].into_iter().enumerate() {
        if !a.datapaths.iter().any(|d| d == kind.name()) {
            continue;
        }
        for p in &a.phases {
            if !a.json {
                eprintln!("gradwire bench: {} {} ...", kind.name(), p);
            }
            let r = match p.as_str() {
                "tx" => tx_phase(&tb, kind, a)?,
                "rx" => rx_phase(&tb, kind, a)?,
                _ => transfer_phase(&tb, kind, a)?,
            };
            match p.as_str() {
                "tx" => res[i].tx = Some(r),
                "rx" => res[i].rx = Some(r),
                _ => res[i].transfer = Some(r),
            }
        }
    }
    tb.down()?;
    let [x, u] = res;
    let rp = |f: fn(&PhaseResult) -> f64| Ratios {
        tx: ratio(x.tx, u.tx, f),
        rx: ratio(x.rx, u.rx, f),
        transfer: ratio(x.transfer, u.transfer, f),
    };
    let report = BenchReport {
        ratio_pps: rp(|p| p.mpps),
        ratio_pkts_per_cpu_second: rp(|p| p.packets_per_cpu_second),
        setup: serde_json::json!({
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            "link": "veth pair between two network namespaces",
            "seconds": a.seconds, "payload": a.payload, "batch": a.batch, "queues": a.queues,
            "busy_poll": a.busy_poll, "engine": a.engine, "xdp_mode": a.xdp_mode, "frame_size": a.frame_size, "cores": a.cores,
            "transfer_size": a.size, "transfer_count": a.count, "datapaths": a.datapaths,
        }),
        afxdp: x,
        udp: u,
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{:<9} {:<6} {:>10} {:>8} {:>9} {:>14} {:>16}",
        "phase", "path", "packets", "Mpps", "Gbit/s", "CPU ns/packet", "packets/CPU-s"
    );
    for (name, pick) in [
        (
            "tx",
            (|d: &DatapathResult| d.tx) as fn(&DatapathResult) -> Option<PhaseResult>,
        ),
        ("rx", |d: &DatapathResult| d.rx),
        ("transfer", |d: &DatapathResult| d.transfer),
    ] {
        for (path, d) in [("afxdp", &report.afxdp), ("udp", &report.udp)] {
            if let Some(p) = pick(d) {
                println!(
                    "{:<9} {:<6} {:>10} {:>8.3} {:>9.2} {:>14.0} {:>16.0}",
                    name,
                    path,
                    p.packets,
                    p.mpps,
                    p.gbps,
                    p.cpu_ns_per_packet,
                    p.packets_per_cpu_second
                );
            }
        }
    }
    let show = |r: &Ratios| {
        [("tx", r.tx), ("rx", r.rx), ("transfer", r.transfer)]
            .iter()
            .filter_map(|(n, v)| v.map(|v| format!("{n} {v:.2}x")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "AF_XDP / UDP packets per second: {}",
        show(&report.ratio_pps)
    );
    println!(
        "AF_XDP / UDP packets per CPU-second (system-wide): {}",
        show(&report.ratio_pkts_per_cpu_second)
    );
    Ok(())
}
