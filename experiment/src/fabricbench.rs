//! `gradwire-fabric-bench`: how many packets the emulated switch forwards per core, against
//! the Linux kernel forwarding the same traffic in the same namespaces (the baseline, run in
//! the same process right after).
//!
//! Setup: one switch, two hosts, links emulated at a rate far above what the machine can
//! produce (so the switch's own cost, not its emulated line rate, is the limit). The sender
//! blasts 1514-byte frames with kernel UDP, cycling over the 8 queues (the 7 data DSCPs and
//! the control DSCP, half of them ECN-capable). The receiver's XDP classifier counts and drops
//! every frame (fault injection at 100 %), so nothing above XDP costs CPU there.
//!
//! Reported per phase: frames delivered per second (wall), busy CPU of all cores from
//! /proc/stat (on veth the senders' softirqs run the switch port's XDP program and the copy
//! into the UMEM, so only the system-wide figure is comparable between fabric and kernel),
//! and for the fabric the CPU time of its own thread: delivered frames per second of that
//! thread's CPU is the "per core" forwarding rate.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use gradwire_control::render::fabric::FabricQos;
use gradwire_ebpf::{AttachMode, XdpConfig, XdpProgram};
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig};
use gradwire_fabric::topology::{default_policy, Topology};
use gradwire_netns::{exec_in_netns, spawn_in_netns};
use gradwire_qos::{CONTROL_DSCP, DATA_DSCP};
use serde::Serialize;

use crate::netbench::CpuClock;

type Res<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const PORT: u16 = 7000;
const PAYLOAD: usize = 1472;

/// Options.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "gradwire-fabric-bench",
    about = "Forwarding rate of the emulated switch vs kernel forwarding (root)"
)]
pub struct FabricBenchArgs {
    /// Seconds per phase.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Emulated link rate, bits per second with a unit (high, so that it is not the limit).
    #[arg(long, default_value = "40Gbit")]
    pub rate: gradwire_units::BitRate,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// "fabric" or "kernel".
    pub name: &'static str,
    /// Datagrams the sender's kernel accepted.
    pub sent: u64,
    /// Frames that reached the receiver.
    pub delivered: u64,
    /// Wall seconds.
    pub seconds: f64,
    /// Busy CPU seconds, all cores.
    pub cpu_seconds: f64,
    /// Delivered frames per wall second.
    pub pps: f64,
    /// Delivered frames per busy CPU-second (all cores).
    pub pkts_per_cpu_second: f64,
    /// Fabric only: CPU seconds of the fabric's thread.
    pub fabric_thread_cpu_seconds: Option<f64>,
    /// Fabric only: delivered frames per CPU-second of the fabric thread (per core).
    pub pps_per_fabric_core: Option<f64>,
    /// Fabric only: lag of departures (mean, p99, worst, ns) and whether it fell behind.
    pub lag: Option<gradwire_fabric::run::LagStats>,
    /// Fabric only: where frames that were sent but not delivered went, summed over ports:
    /// (kernel socket drops before the fabric saw them (`rx_dropped`: RX ring full or no FILL entry),
    /// frames the TX ring refused, egress queue drops).
    pub fabric_drops: Option<(u64, u64, u64)>,
}

/// The whole result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Frame length on the wire (without FCS).
    pub frame_bytes: usize,
    /// Fabric phase.
    pub fabric: Phase,
    /// Kernel forwarding phase.
    pub kernel: Phase,
    /// fabric / kernel, delivered frames per system-wide CPU-second.
    pub ratio_pkts_per_cpu_second: f64,
    /// fabric / kernel, delivered frames per wall second.
    pub ratio_pps: f64,
}

fn topology(rate: &str) -> Res<Topology> {
    let qos = FabricQos::from_policy(&default_policy())?;
    let text = format!(
        "name = \"fb\"\n[defaults]\nrate = \"{rate}\"\n[[switch]]\nname = \"s0\"\n\
         [[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n"
    );
    Ok(Topology::from_toml(&text, qos)?)
}

/// Runs the receiver (classifier that counts and drops) in `ns` until `stop`; returns the
/// frames it saw.
fn receiver(
    ns: &str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Res<std::thread::JoinHandle<Res<u64>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = spawn_in_netns(ns, move || -> Res<u64> {
        let mut cfg = XdpConfig::new(vec![PORT]);
        cfg.mode = AttachMode::Generic;
        cfg.fault_drop = [1.0; 64];
        let prog = XdpProgram::attach("eth0", &cfg);
        let prog = match prog {
            Ok(p) => {
                let _ = tx.send(Ok(()));
                p
            }
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return Err(e.into());
            }
        };
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(prog.counters()?.classes_total().packets)
    })?;
    rx.recv()?
        .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { e.into() })?;
    Ok(h)
}

/// Blasts for `seconds` from `ns`, cycling over the 8 queues; returns datagrams sent.
fn sender(ns: &str, src: std::net::Ipv4Addr, dst: SocketAddr, seconds: f64) -> Res<u64> {
    let h = spawn_in_netns(ns, move || -> std::io::Result<u64> {
        let tos: Vec<u8> = DATA_DSCP
            .iter()
            .chain([&CONTROL_DSCP])
            .enumerate()
            .map(|(i, d)| d << 2 | if i % 2 == 0 { 2 } else { 0 })
            .collect();
        let mut socks = Vec::new();
        for (i, t) in tos.iter().enumerate() {
            let s = UdpSocket::bind((src, 30_000 + i as u16))?;
            nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv4Tos, &i32::from(*t))
                .map_err(std::io::Error::from)?;
            socks.push(s);
        }
        let payload = vec![0xa5u8; PAYLOAD];
        let end = Instant::now() + Duration::from_secs_f64(seconds);
        let mut sent = 0u64;
        let mut k = 0usize;
        while Instant::now() < end {
            for _ in 0..64 {
                if socks[k % socks.len()].send_to(&payload, dst).is_ok() {
                    sent += 1;
                }
                k += 1;
            }
        }
        Ok(sent)
    })?;
    h.join()
        .map_err(|_| "sender thread panicked")?
        .map_err(Into::into)
}

fn phase(
    name: &'static str,
    net: &FabricNet,
    topo: &Topology,
    seconds: f64,
) -> Res<(u64, u64, f64, f64)> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rx = receiver(net.host_ns(1).ok_or("no host 1")?, stop.clone())?;
    let dst = SocketAddr::from((topo.hosts[1].ip, PORT));
    let clock = CpuClock::start()?;
    let sent = sender(
        net.host_ns(0).ok_or("no host 0")?,
        topo.hosts[0].ip,
        dst,
        seconds,
    )?;
    // Let the last frames through before the counters are read.
    std::thread::sleep(Duration::from_millis(100));
    let (wall, cpu) = clock.stop()?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let delivered = rx
        .join()
        .map_err(|_| format!("{name}: receiver panicked"))??;
    Ok((sent, delivered, wall, cpu))
}

fn mk(name: &'static str, sent: u64, delivered: u64, wall: f64, cpu: f64) -> Phase {
    let per = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Phase {
        name,
        sent,
        delivered,
        seconds: wall,
        cpu_seconds: cpu,
        pps: per(delivered as f64, wall),
        pkts_per_cpu_second: per(delivered as f64, cpu),
        fabric_thread_cpu_seconds: None,
        pps_per_fabric_core: None,
        lag: None,
        fabric_drops: None,
    }
}

/// Makes switch namespace `ns` a kernel router for `topo`'s hosts (the baseline).
fn kernel_router(ns: &str, topo: &Topology) -> Res {
    let t = Duration::from_secs(10);
    exec_in_netns(ns, &["sysctl", "-qw", "net.ipv4.ip_forward=1"], t)?;
    exec_in_netns(ns, &["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"], t)?;
    let s = &topo.switches[0];
    for h in &topo.hosts {
        let p = &s.ports[h.port];
        let mac = gradwire_fabric::topology::mac_string(&h.mac);
        let ip = h.ip.to_string();
        let route = format!("{ip}/32");
        exec_in_netns(ns, &["ip", "route", "replace", &route, "dev", &p.ifname], t)?;
        exec_in_netns(
            ns,
            &[
                "ip",
                "neigh",
                "replace",
                &ip,
                "lladdr",
                &mac,
                "dev",
                &p.ifname,
                "nud",
                "permanent",
            ],
            t,
        )?;
    }
    Ok(())
}

/// Runs both phases.
pub fn run(a: &FabricBenchArgs) -> Res<Report> {
    if !gradwire_netns::is_root() {
        return Err("gradwire-fabric-bench needs root (namespaces, XDP, AF_XDP)".into());
    }
    let topo = topology(&a.rate.to_string())?;
    let net = FabricNet::up(&topo)?;

    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default())?;
    let before = fabric.stats().map_or(0.0, |s| s.loop_cpu_s);
    let (sent, delivered, wall, cpu) = phase("fabric", &net, &topo, a.seconds)?;
    let st = fabric.stop().ok_or("fabric published no stats")?;
    let mut f = mk("fabric", sent, delivered, wall, cpu);
    let thread_cpu = st.loop_cpu_s - before;
    f.fabric_thread_cpu_seconds = Some(thread_cpu);
    f.pps_per_fabric_core = Some(if thread_cpu > 0.0 {
        delivered as f64 / thread_cpu
    } else {
        0.0
    });
    f.lag = Some(st.lag);
    let ports = st.switches.iter().flat_map(|s| &s.ports);
    f.fabric_drops = Some(ports.fold((0, 0, 0), |(r, t, e), p| {
        let q = p.egress.sum();
        (
            r + p.kernel.rx_dropped,
            t + p.socket.tx_refused,
            e + q.dropped_buffer + q.dropped_threshold,
        )
    }));

    // The same namespaces, the kernel forwarding instead (no XDP on the switch ports now).
    kernel_router(&net.switch_namespaces()[0], &topo)?;
    let (sent, delivered, wall, cpu) = phase("kernel", &net, &topo, a.seconds)?;
    let k = mk("kernel", sent, delivered, wall, cpu);
    net.down()?;
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { 0.0 };
    Ok(Report {
        frame_bytes: PAYLOAD + 42,
        ratio_pkts_per_cpu_second: ratio(f.pkts_per_cpu_second, k.pkts_per_cpu_second),
        ratio_pps: ratio(f.pps, k.pps),
        fabric: f,
        kernel: k,
    })
}

/// Prints a report as a table.
pub fn print(r: &Report) {
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>12} {:>14}",
        "phase", "sent", "delivered", "kpps", "kpkt/CPU-s", "kpps/fab-core"
    );
    for p in [&r.fabric, &r.kernel] {
        println!(
            "{:<8} {:>10} {:>10} {:>10.1} {:>12.1} {:>14}",
            p.name,
            p.sent,
            p.delivered,
            p.pps / 1e3,
            p.pkts_per_cpu_second / 1e3,
            p.pps_per_fabric_core
                .map_or("-".to_string(), |v| format!("{:.1}", v / 1e3))
        );
    }
    if let Some(l) = &r.fabric.lag {
        println!(
            "fabric thread CPU {:.2} s of {:.2} s; lag mean {:.1} us p99 <= {:.1} us worst {:.1} us{}",
            r.fabric.fabric_thread_cpu_seconds.unwrap_or(0.0),
            r.fabric.seconds,
            l.mean_ns as f64 / 1e3,
            l.p99_ns as f64 / 1e3,
            l.worst_ns as f64 / 1e3,
            if l.behind { "  BEHIND" } else { "" }
        );
    }
    if let Some((r, t, e)) = r.fabric.fabric_drops {
        println!("fabric drops: socket RX {r}, TX refused {t}, egress queues {e}");
    }
    println!(
        "fabric/kernel: {:.2}x delivered per system CPU-second, {:.2}x delivered per second",
        r.ratio_pkts_per_cpu_second, r.ratio_pps
    );
}
