//! System calls and throughput of `gradwire_msg::io::udp` moving a volume of 1472-byte
//! datagrams over loopback, with GSO/GRO and without.
//!
//! `cargo run --release -p gradwire-msg --example udp_io_rate [MiB] [ipv4|ipv6]` (default 64 MiB
//! over IPv4); each of GSO+GRO, GSO only, GRO only and neither is run 5 times, the median shown. A receiver thread drains one socket; the sender keeps at most 8 MiB in flight
//! (the receiver publishes its count), so the figures measure the I/O path, not loss. With GSO
//! the sender gives bundles of 40 datagrams, 64 bundles per `send`; without it, single-datagram
//! bundles, 64 per `send` (what a caller does when `max_segments()` is 1).

use std::io::IoSlice;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire_msg::io::udp::{Transmit, UdpConfig, UdpIo, UdpStats};

const SEG: usize = 1472;
const WINDOW: u64 = 8 << 20;
const STALL: Duration = Duration::from_secs(3);
const REPEATS: usize = 5;

struct Run {
    tx: UdpStats,
    rx: UdpStats,
    rx_waits: u64,
    secs: f64,
    bytes: u64,
}

fn run(lo: SocketAddr, total: u64, gso: bool, gro: bool) -> Result<Run, String> {
    let cfg = |gso, gro| UdpConfig {
        gso,
        gro,
        ..UdpConfig::default()
    };
    let mut tx = UdpIo::bind(lo, &cfg(gso, false)).map_err(|e| e.to_string())?;
    let mut rx = UdpIo::bind(lo, &cfg(false, gro)).map_err(|e| e.to_string())?;
    if tx.gso_enabled() != gso || rx.gro_enabled() != gro {
        eprintln!("note: GSO {} / GRO {}", tx.gso_enabled(), rx.gro_enabled());
    }
    let dst = rx.local_addr();
    let got = Arc::new(AtomicU64::new(0));
    let got_rx = Arc::clone(&got);
    let receiver = std::thread::spawn(move || -> Result<(UdpStats, u64), String> {
        let mut bytes = 0u64;
        let mut waits = 0u64;
        let mut last = Instant::now();
        while bytes < total {
            let mut n = 0u64;
            rx.recv(&mut |_, d| n += d.len() as u64)
                .map_err(|e| e.to_string())?;
            if n > 0 {
                bytes += n;
                got_rx.store(bytes, Ordering::Release);
                last = Instant::now();
            } else if last.elapsed() > STALL {
                return Err(format!("receiver stalled at {bytes} of {total} bytes"));
            } else {
                rx.wait(Some(Duration::from_millis(100)), false)
                    .map_err(|e| e.to_string())?;
                waits += 1;
            }
        }
        Ok((rx.stats(), waits))
    });

    let per_bundle = if tx.gso_enabled() { 40 } else { 1 };
    let data: Vec<u8> = (0..SEG * per_bundle).map(|i| (i % 251) as u8).collect();
    // iovs[n - 1]: a bundle of n datagrams (the last bundle may be short).
    let iovs: Vec<[IoSlice<'_>; 1]> = (1..=per_bundle)
        .map(|n| [IoSlice::new(&data[..n * SEG])])
        .collect();
    let datagrams_total = total / SEG as u64;
    let t0 = Instant::now();
    let mut sent = 0u64;
    let mut batch: Vec<Transmit<'_>> = Vec::with_capacity(64);
    let mut last = Instant::now();
    while sent < datagrams_total {
        let in_flight = (sent * SEG as u64).saturating_sub(got.load(Ordering::Acquire));
        if in_flight >= WINDOW {
            if last.elapsed() > STALL {
                break;
            }
            std::thread::yield_now();
            continue;
        }
        batch.clear();
        let mut planned = sent;
        while batch.len() < 64 && planned < datagrams_total {
            let n = per_bundle.min((datagrams_total - planned) as usize);
            batch.push(Transmit {
                dst,
                tos: 0,
                segment_size: SEG,
                iov: &iovs[n - 1],
            });
            planned += n as u64;
        }
        let n = tx.send(&batch).map_err(|e| e.to_string())?;
        sent += batch[..n]
            .iter()
            .map(|t| (t.iov[0].len() / SEG) as u64)
            .sum::<u64>();
        if n > 0 {
            last = Instant::now();
        } else {
            tx.wait(Some(Duration::from_millis(10)), true)
                .map_err(|e| e.to_string())?;
        }
    }
    let sent_bytes = sent * SEG as u64;
    let (rx_stats, rx_waits) = receiver
        .join()
        .map_err(|_| "receiver panicked".to_string())??;
    let secs = t0.elapsed().as_secs_f64();
    Ok(Run {
        tx: tx.stats(),
        rx: rx_stats,
        rx_waits,
        secs,
        bytes: sent_bytes.min(rx_stats.recv_bytes),
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let lo: SocketAddr = match args.next().as_deref() {
        Some("ipv6") => (Ipv6Addr::LOCALHOST, 0).into(),
        _ => (Ipv4Addr::LOCALHOST, 0).into(),
    };
    let total = (mib << 20) / SEG as u64 * SEG as u64;
    println!(
        "{mib} MiB in {} datagrams of {SEG} B over {}, median of {REPEATS} runs",
        total / SEG as u64,
        lo.ip()
    );
    println!(
        "{:<8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9} {:>6} {:>7} {:>7}",
        "mode",
        "send_sys",
        "recv_sys",
        "(empty)",
        "rx_waits",
        "recv_buf",
        "datagrams",
        "drops",
        "ms",
        "Gbit/s"
    );
    for (mode, gso, gro) in [
        ("GSO+GRO", true, true),
        ("GSO", true, false),
        ("GRO", false, true),
        ("plain", false, false),
    ] {
        let mut runs = Vec::new();
        for _ in 0..REPEATS {
            match run(lo, total, gso, gro) {
                Ok(r) => runs.push(r),
                Err(e) => println!("{mode:<8} failed: {e}"),
            }
        }
        runs.sort_by(|a, b| a.secs.total_cmp(&b.secs));
        if let Some(r) = runs.get(runs.len() / 2) {
            println!(
                "{:<8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9} {:>6} {:>7.1} {:>7.2}",
                mode,
                r.tx.send_syscalls,
                r.rx.recv_syscalls,
                r.rx.recv_empty,
                r.rx_waits,
                r.rx.recv_buffers,
                r.rx.recv_datagrams,
                r.rx.recv_kernel_drops,
                r.secs * 1e3,
                r.bytes as f64 * 8.0 / r.secs / 1e9
            );
        }
    }
}
