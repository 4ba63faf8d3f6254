//! Operations per CPU-second of the message layer over AF_XDP ([`XdpIo`]) against kernel UDP
//! with GSO/GRO ([`UdpIo`]), on the same veth pair between two namespaces, in one run.
//!
//! `sudo cargo run --release -p gradwire-msg --features afxdp --example xdp_io_bench --
//! [--size BYTES] [--seconds S] [--repeats N] [--only xdp|udp] [--no-offload]
//! [--xdp-mode auto|native|generic] [--batch N] [--mtu BYTES]`
//!
//! `--mtu` sets the veths' MTU and the endpoints' (default 1500; AF_XDP frames of 4096 bytes
//! carry up to 3826).
//!
//! An operation is one message of `--size` bytes (default 1 MiB) delivered: rank 0 sends to
//! rank 1, which answers with a message of the same size once it has it (ping-pong), each
//! pair being two operations. Each repeat runs AF_XDP endpoints for `--seconds` (default 3),
//! then UDP ones (the order alternates between repeats); endpoints are started afresh for
//! each, so the XDP program is only attached while AF_XDP is measured (an XDP program on a
//! veth turns off the segmentation offloads the UDP path lives on). CPU time is counted
//! system-wide from `/proc/stat` (user + system + softirq of every core, as `gradwire
//! bench` does), because on a veth much of the work runs in softirq context outside the
//! endpoints' threads: it covers both ends and the driver of the runs, and anything else the
//! machine runs meanwhile. So the runs also report "own" CPU: this process's threads (with
//! tick accounting, softirq work done in their context is charged to them) and the kernel's
//! softirq threads, which is what matters on a machine others use; on an idle one the two
//! agree.
//!
//! TX checksum offload stays on on the veths (`--no-offload` turns it off): with it off the
//! kernel refuses UDP segmentation offload, and UDP falls back to one datagram per `msghdr`.
//! AF_XDP computes its checksums in software either way.
//!
//! Holds the fabric lock for the whole run. Needs root.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/net.rs"]
mod net;

use std::time::{Duration, Instant};

use gradwire_msg::endpoint::Endpoint;
use gradwire_msg::io::xdp::{AttachMode, XdpSnapshot};
use gradwire_msg::mem::Region;
use gradwire_netns::{FabricLock, Testbed, TestbedConfig};

use net::{pattern, start_with, Kind, Swap};

const PORT: u16 = 7400;

/// Busy jiffies of all CPUs from `/proc/stat` (user nice system irq softirq steal).
fn busy_jiffies() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    assert!(v.len() >= 8, "unexpected /proc/stat format");
    let total: u64 = v.iter().take(8).sum();
    total - v[3] - v[4]
}

/// User + system ticks of process (or thread) `pid` from `/proc/<pid>/stat`, 0 if gone.
fn task_ticks(pid: &str) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // After the command name in parentheses: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// The kernel's softirq threads, which do receive work on a veth when a CPU is busy.
fn ksoftirqd_pids() -> Vec<String> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.starts_with("ksoftirqd/") {
            pids.push(pid);
        }
    }
    pids
}

/// CPU ticks this benchmark accounts to itself: its own threads (user + system, which with
/// tick accounting includes the softirq work done in their context, the bulk of a veth's)
/// and the softirq threads.
fn own_ticks(ksoftirqd: &[String]) -> u64 {
    task_ticks("self") + ksoftirqd.iter().map(|p| task_ticks(p)).sum::<u64>()
}

fn clk_tck() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64
}

struct Args {
    size: usize,
    seconds: f64,
    repeats: usize,
    only: Option<Kind>,
    offload: bool,
    xdp_mode: AttachMode,
    batch: usize,
    mtu: usize,
}

fn args() -> Args {
    let mut a = Args {
        size: 1 << 20,
        seconds: 3.0,
        repeats: 5,
        only: None,
        offload: true,
        xdp_mode: AttachMode::Auto,
        batch: 32,
        mtu: 1500,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--size" => a.size = val().parse().expect("--size BYTES"),
            "--seconds" => a.seconds = val().parse().expect("--seconds S"),
            "--repeats" => a.repeats = val().parse().expect("--repeats N"),
            "--only" => {
                a.only = Some(match val().as_str() {
                    "xdp" => Kind::Xdp,
                    "udp" => Kind::Udp,
                    o => panic!("--only xdp|udp, not {o}"),
                })
            }
            "--no-offload" => a.offload = false,
            "--xdp-mode" => a.xdp_mode = val().parse().expect("--xdp-mode auto|native|generic"),
            "--batch" => a.batch = val().parse().expect("--batch N"),
            "--mtu" => a.mtu = val().parse().expect("--mtu BYTES (68..=3826)"),
            o => panic!("unknown argument {o} (see the example's documentation)"),
        }
    }
    a
}

struct Run {
    kind: Kind,
    ops: u64,
    secs: f64,
    /// Busy CPU seconds, all cores (`/proc/stat`).
    cpu: f64,
    /// CPU seconds of this process and the softirq threads.
    own: f64,
    xdp: Option<XdpSnapshot>,
}

/// One ping-pong between ranks 0 and 1; returns the buffers for the next.
fn ping_pong(eps: &[Endpoint], bufs: Vec<(Region, Region)>) -> Vec<(Region, Region)> {
    let handles: Vec<_> = bufs
        .into_iter()
        .enumerate()
        .map(|(r, (tx, rx))| eps[r].submit(Swap::new(1 - r as u16, r == 0, tx, rx)))
        .collect();
    handles
        .into_iter()
        .map(|h| match h.wait_timeout(Duration::from_secs(30)) {
            Ok(Ok((tx, rx, _))) => (tx, rx),
            Ok(Err(e)) => panic!("ping-pong failed: {e}"),
            Err(_) => panic!("ping-pong stuck for 30 s"),
        })
        .collect()
}

fn run(tb: &Testbed, kind: Kind, a: &Args) -> Run {
    let (mode, batch) = (a.xdp_mode, a.batch);
    let ranks = start_with(
        tb,
        &[kind, kind],
        PORT,
        |_| {},
        move |c| {
            c.xdp_mode = mode;
            c.batch = batch;
        },
    );
    let mut bufs: Vec<(Region, Region)> = (0..2)
        .map(|r| {
            (
                Region::owned(pattern(a.size, r)),
                Region::owned(vec![0; a.size]),
            )
        })
        .collect();
    // Warm up: windows open, pages touched, neighbours cached.
    for _ in 0..5 {
        bufs = ping_pong(&ranks.eps, bufs);
    }
    let hz = clk_tck();
    let ksoftirqd = ksoftirqd_pids();
    let o0 = own_ticks(&ksoftirqd);
    let j0 = busy_jiffies();
    let t0 = Instant::now();
    let mut ops = 0u64;
    while t0.elapsed().as_secs_f64() < a.seconds {
        bufs = ping_pong(&ranks.eps, bufs);
        ops += 2;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = busy_jiffies().saturating_sub(j0) as f64 / hz;
    let own = own_ticks(&ksoftirqd).saturating_sub(o0) as f64 / hz;
    let xdp = ranks.monitors[0]
        .as_ref()
        .and_then(|m| m.snapshot(Duration::from_secs(5)));
    // The last answer matches what rank 1 sent.
    assert!(bufs[0].1.as_slice() == pattern(a.size, 1).as_slice());
    Run {
        kind,
        ops,
        secs,
        cpu,
        own,
        xdp,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn main() {
    let a = args();
    if !gradwire_netns::is_root() {
        eprintln!("xdp_io_bench needs root (network namespaces, XDP, AF_XDP)");
        std::process::exit(2);
    }
    let _lock = FabricLock::acquire().expect("the fabric lock");
    let tb = Testbed::up(&TestbedConfig {
        tx_checksum_offload: a.offload,
        mtu: u32::try_from(a.mtu).expect("--mtu"),
        ..TestbedConfig::default()
    })
    .expect("testbed");
    println!(
        "message layer, {} B messages, ping-pong, {} s per run, {} repeats, TX checksum \
         offload {}, XDP mode {}, AF_XDP batch {}, MTU {}, {} CPUs",
        a.size,
        a.seconds,
        a.repeats,
        if a.offload { "on" } else { "off" },
        a.xdp_mode,
        a.batch,
        a.mtu,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>6} {:>4} {:>8} {:>9} {:>8} {:>8} {:>12} {:>8} {:>12}",
        "repeat", "io", "ops", "ops/s", "Gbit/s", "CPU-s", "ops/CPU-s", "own-s", "ops/own-s"
    );
    let mut runs: Vec<(usize, Run)> = Vec::new();
    for rep in 0..a.repeats {
        let order = if rep % 2 == 0 {
            [Kind::Xdp, Kind::Udp]
        } else {
            [Kind::Udp, Kind::Xdp]
        };
        for kind in order {
            if a.only.is_some_and(|o| o != kind) {
                continue;
            }
            let r = run(&tb, kind, &a);
            println!(
                "{:>6} {:>4} {:>8} {:>9.1} {:>8.2} {:>8.2} {:>12.1} {:>8.2} {:>12.1}",
                rep,
                if kind == Kind::Xdp { "xdp" } else { "udp" },
                r.ops,
                r.ops as f64 / r.secs,
                r.ops as f64 * a.size as f64 * 8.0 / r.secs / 1e9,
                r.cpu,
                r.ops as f64 / r.cpu,
                r.own,
                r.ops as f64 / r.own
            );
            if let Some(s) = &r.xdp {
                let q = s.afxdp.queues.first().copied().unwrap_or_default();
                println!(
                    "         xdp rank 0: {:?} mode; tx {} rx {} datagrams, {} send calls, {} \
                     would-block, {} kicks, {} waits; kernel {:?}",
                    q.mode,
                    s.io.tx_datagrams,
                    s.io.rx_datagrams,
                    s.io.send_calls,
                    s.io.send_would_block,
                    q.kicks,
                    s.io.waits,
                    q.kernel
                );
            }
            runs.push((rep, r));
        }
    }
    let per = |k: Kind, own: bool| -> Vec<f64> {
        runs.iter()
            .filter(|(_, r)| r.kind == k)
            .map(|(_, r)| r.ops as f64 / if own { r.own } else { r.cpu })
            .collect()
    };
    for (own, what) in [(false, "ops/CPU-s (system-wide)"), (true, "ops/own-CPU-s")] {
        let (x, u) = (per(Kind::Xdp, own), per(Kind::Udp, own));
        let ratios: Vec<f64> = x.iter().zip(&u).map(|(x, u)| x / u).collect();
        println!(
            "median {what}: xdp {:.1}, udp {:.1}; xdp/udp per repeat {}, median {:.2} \
             (target >= 1.3)",
            median(x),
            median(u),
            ratios
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
            median(ratios.clone())
        );
    }
    drop(tb);
}
