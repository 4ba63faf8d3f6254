//! WAN links on the emulated fabric (issue 15): a 30 ms link adds 60 ms to a round trip, and a
//! flow's throughput follows the link's rate schedule, judged on what the fabric itself
//! delivered over its own clock and, more loosely, on what the receiver got.
//!
//! Two sites, one switch and one host each: h0 - s0 ==WAN== s1 - h1. The host links are fast
//! and short (100 Mbit/s, 20 us), so the WAN link is the only thing that matters. The tests
//! take a lock so that they never run at the same time: each needs the fabric thread to keep
//! its clock, and two fabrics plus their traffic on this 2-core machine could make each other
//! late.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig, FabricStats, PortStats};
use gradwire_netns::{require_root, spawn_in_netns};

fn two_sites(name: &str, wan: &str) -> String {
    format!(
        r#"
name = "{name}"
[defaults]
rate = "100Mbit"
delay = "20us"
[[switch]]
name = "s0"
[[switch]]
name = "s1"
[[host]]
name = "h0"
uplink = "s0"
[[host]]
name = "h1"
uplink = "s1"
[[link]]
a = "s0"
b = "s1"
{wan}
"#
    )
}

/// (scheduling policy, real-time priority) of this process's thread named `name`, from
/// /proc (fields 41 and 40 of its `stat`).
fn thread_policy(name: &str) -> Option<(u32, u32)> {
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            // Fields after "pid (comm)" start at field 3.
            let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            return Some((f.get(41 - 3)?.parse().ok()?, f.get(40 - 3)?.parse().ok()?));
        }
    }
    None
}

/// The WAN port of switch `sw` (its only port towards a switch).
fn wan_port<'a>(st: &'a FabricStats, sw: &str) -> &'a PortStats {
    st.switch(sw)
        .unwrap()
        .ports
        .iter()
        .find(|p| p.peer.starts_with("switch"))
        .unwrap()
}

#[test]
fn a_30ms_link_adds_60ms_to_the_round_trip() {
    if !require_root("a_30ms_link_adds_60ms_to_the_round_trip") {
        return;
    }
    let topo = topo(&two_sites(
        "rtt",
        "rate = \"10Mbit\"\ndelay = \"30ms\"\nthresholds = \"none\"",
    ));
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let (h0, h1) = (topo.hosts[0].ip, topo.hosts[1].ip);
    // The fabric's loop runs under SCHED_FIFO (policy 1) at priority 10 by default, so that
    // the probes' own threads do not delay it. (It sets that as its loop starts.)
    let deadline = Instant::now() + Duration::from_secs(5);
    while thread_policy("fabric rtt") != Some((1, 10)) {
        assert!(
            Instant::now() < deadline,
            "fabric thread policy {:?}",
            thread_policy("fabric rtt")
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    // A UDP echo on h1, until told to stop (bounded by its read timeout).
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let echo = spawn_in_netns(net.host_ns(1).unwrap(), move || {
        let s = UdpSocket::bind((h1, 7001)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        ready_tx.send(()).unwrap();
        let mut buf = [0u8; 256];
        let mut echoed = 0u32;
        while !stop2.load(Ordering::Relaxed) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                s.send_to(&buf[..n], from).unwrap();
                echoed += 1;
            }
        }
        echoed
    })
    .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();

    // 20 probes 50 ms apart, each waiting at most 1 s for its answer.
    let rtts = spawn_in_netns(net.host_ns(0).unwrap(), move || {
        let s = UdpSocket::bind((h0, 7002)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let dst = SocketAddr::from((h1, 7001));
        let mut rtts = Vec::new();
        for seq in 0u32..20 {
            let t = Instant::now();
            s.send_to(&seq.to_be_bytes(), dst).unwrap();
            let mut buf = [0u8; 16];
            // A late answer to an earlier probe is skipped; a lost one ends the wait.
            while let Ok(n) = s.recv(&mut buf) {
                if n == 4 && buf[..4] == seq.to_be_bytes() {
                    rtts.push(t.elapsed());
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        rtts
    })
    .unwrap()
    .join()
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    let echoed = echo.join().unwrap();
    let st = fabric.stop().unwrap();
    net.down().unwrap();

    let mut sorted = rtts.clone();
    sorted.sort();
    eprintln!(
        "{} of 20 probes answered ({echoed} echoed); RTT min {:?} median {:?} max {:?}; lag {:?}",
        rtts.len(),
        sorted.first(),
        sorted.get(sorted.len() / 2),
        sorted.last(),
        st.lag
    );
    // Nothing is lost on this link and nothing queues: all probes come back.
    assert_eq!(
        rtts.len(),
        20,
        "probes lost; fabric stats {:?}",
        st.totals()
    );
    // The fabric never delivers before the emulated time, so no round trip can be shorter than
    // the two propagation delays (plus four 20 us host links and serialisation).
    let floor = Duration::from_millis(60);
    assert!(sorted[0] >= floor, "RTT {:?} below 60 ms", sorted[0]);
    // Upper bounds are generous: a loaded 2-core machine delays the fabric thread, the echo and
    // the prober. The best of 20 probes is within 15 ms of 60 ms, the median within 40 ms.
    assert!(
        sorted[0] < Duration::from_millis(75),
        "best RTT {:?}",
        sorted[0]
    );
    assert!(
        sorted[10] < Duration::from_millis(100),
        "median RTT {:?}",
        sorted[10]
    );
    // And the fabric says why: 30 ms on both ends of the WAN link.
    for sw in ["s0", "s1"] {
        assert_eq!(wan_port(&st, sw).delay_ns, 30_000_000);
    }
    assert_eq!(st.totals().dropped + st.totals().lost, 0);
}

/// A snapshot's time and the s0 -> s1 port's delivered bytes and rate, with the reverse
/// port's rate.
#[derive(Debug, Clone, Copy)]
struct Sample {
    t: f64,
    delivered: u64,
    rate: u64,
    reverse_rate: u64,
}

#[test]
fn throughput_follows_the_rate_schedule() {
    if !require_root("throughput_follows_the_rate_schedule") {
        return;
    }
    // 8 Mbit/s, 2 Mbit/s from 2.5 s, 6 Mbit/s from 4.5 s, over a 30 ms link.
    let topo = topo(&two_sites(
        "sched",
        "rate = \"8Mbit\"\ndelay = \"30ms\"\n\
         schedule = [{ at = \"2.5s\", rate = \"2Mbit\" }, { at = \"4.5s\", rate = \"6Mbit\" }]",
    ));
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let cfg = FabricConfig {
        stats_interval: Duration::from_millis(100),
        ..FabricConfig::default()
    };
    let fabric = spawn(&topo, net.switch_namespaces(), cfg).unwrap();
    let (h0, h1) = (topo.hosts[0].ip, topo.hosts[1].ip);

    // The receiver notes when each datagram arrived.
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let receiver = spawn_in_netns(net.host_ns(1).unwrap(), move || {
        let s = UdpSocket::bind((h1, PORT)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        ready_tx.send(()).unwrap();
        let mut buf = vec![0u8; 2048];
        let mut got = Vec::new();
        while !stop2.load(Ordering::Relaxed) {
            if let Ok(n) = s.recv(&mut buf) {
                got.push((Instant::now(), n));
            }
        }
        got
    })
    .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();

    // The sender offers 12 Mbit/s (1000 full frames a second), more than the link ever
    // carries, from 0.3 s to 6.8 s after the fabric started (the test's clock starts when
    // `spawn` returned, within a millisecond of the fabric's own).
    let t0 = Instant::now();
    let sender = spawn_in_netns(net.host_ns(0).unwrap(), move || {
        let s = UdpSocket::bind((h0, 9000)).unwrap();
        let payload = vec![7u8; PAYLOAD];
        let dst = SocketAddr::from((h1, PORT));
        let (start, end) = (Duration::from_millis(300), Duration::from_millis(6_800));
        let mut k = 0u32;
        loop {
            let due = start + Duration::from_millis(u64::from(k));
            if due >= end {
                break;
            }
            // Pacing (the traffic's shape), not synchronisation.
            if let Some(wait) = due.checked_sub(t0.elapsed()) {
                std::thread::sleep(wait);
            }
            let _ = s.send_to(&payload, dst);
            k += 1;
        }
        k
    })
    .unwrap();

    // The fabric's own view, every 50 ms (it publishes every 100 ms).
    let mut samples: Vec<Sample> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sender.is_finished() {
        assert!(Instant::now() < deadline, "the sender did not finish");
        if let Some(st) = fabric.stats() {
            let (fwd, rev) = (wan_port(&st, "s0"), wan_port(&st, "s1"));
            let s = Sample {
                t: st.uptime_s,
                delivered: fwd.egress.delivered_bytes,
                rate: fwd.rate_bps,
                reverse_rate: rev.rate_bps,
            };
            if samples.last().is_none_or(|l| l.t < s.t) {
                samples.push(s);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = sender.join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let got = receiver.join().unwrap();
    let st = fabric.stop().unwrap();
    net.down().unwrap();
    eprintln!(
        "sent {sent}, received {}; {} snapshots; lag {:?}",
        got.len(),
        samples.len(),
        st.lag
    );

    // Every snapshot shows the rate in force at its time, on both ends of the link (a snapshot
    // within 20 ms of a change may show either side of it).
    let due = |t: f64| match t {
        t if t < 2.5 => 8_000_000,
        t if t < 4.5 => 2_000_000,
        _ => 6_000_000,
    };
    for s in &samples {
        if [2.5, 4.5].iter().all(|c| (s.t - c).abs() > 0.02) {
            assert_eq!((s.rate, s.reverse_rate), (due(s.t), due(s.t)), "{s:?}");
        }
    }
    for sw in ["s0", "s1"] {
        let p = wan_port(&st, sw);
        assert_eq!((p.rate_bps, p.egress.rate_changes), (6_000_000, 2), "{sw}");
    }

    // What the fabric delivered over its own clock, in windows clear of the changes (and of
    // the start and end of the flow): the link's rate, in frame bytes (the wire also carries
    // 24 bytes of preamble, gap and FCS per 1514-byte frame). The fabric's accounting is
    // exact; 10 % covers snapshots taken late on a loaded machine.
    let frame_share = 1514.0 / 1538.0;
    let at = |t: f64| {
        *samples
            .iter()
            .min_by(|a, b| (a.t - t).abs().total_cmp(&(b.t - t).abs()))
            .unwrap()
    };
    let windows = [(0.8, 2.4, 8e6), (3.0, 4.4, 2e6), (5.0, 6.5, 6e6)];
    for (lo, hi, rate) in windows {
        let (a, b) = (at(lo), at(hi));
        let bps = (b.delivered - a.delivered) as f64 * 8.0 / (b.t - a.t);
        let want = rate * frame_share;
        eprintln!(
            "fabric {lo}..{hi} s: {:.2} Mbit/s (link {:.1})",
            bps / 1e6,
            rate / 1e6
        );
        assert!(
            (bps / want - 1.0).abs() < 0.10,
            "{lo}..{hi}: {bps} vs {want}"
        );
    }
    // What the receiver got (UDP payload bytes) in the same windows on the test's clock, 30 ms
    // later: the same rates, more loosely (20 %), as its clock and the fabric's differ by the
    // thread start-up and the receiver may be scheduled late.
    for (lo, hi, rate) in windows {
        let (lo_i, hi_i) = (
            t0 + Duration::from_secs_f64(lo + 0.03),
            t0 + Duration::from_secs_f64(hi + 0.03),
        );
        let bytes: usize = got
            .iter()
            .filter(|(t, _)| (lo_i..hi_i).contains(t))
            .map(|(_, n)| n)
            .sum();
        let bps = bytes as f64 * 8.0 / (hi - lo);
        let want = rate * PAYLOAD as f64 / 1538.0;
        eprintln!("receiver {lo}..{hi} s: {:.2} Mbit/s", bps / 1e6);
        assert!(
            (bps / want - 1.0).abs() < 0.20,
            "{lo}..{hi}: {bps} vs {want}"
        );
    }
    // The excess was dropped at the buffer (tail drop; ECT-less UDP above the policy's
    // thresholds is dropped there first), never on the link.
    assert_eq!(st.totals().lost, 0);
}
