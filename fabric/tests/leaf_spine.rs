//! The shipped leaf-spine topology (2 spines, 2 leaves, 4 hosts per leaf) built in namespaces:
//! per-packet spraying splits one flow evenly over both spines, and kernel TCP works across
//! three emulated switches (the baseline of the incast experiment). Per-flow ECMP keeps each
//! flow on one spine.
//!
//! Nothing here assumes that a loaded machine keeps up: every datagram sent must either reach
//! the receiver or be counted as lost by the fabric or the kernel (switch queue drops, link
//! loss, TX refusals, AF_XDP ring drops, interface drops in every namespace), and spreading
//! and stickiness are judged on what the switches report they received.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::*;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig, FabricStats, SwitchStats};
use gradwire_fabric::topology::Topology;
use gradwire_netns::{require_root, run_in_netns, spawn_in_netns};
use gradwire_qos::{queue_dscp, NUM_QUEUES};

/// ECN field of an ECN-capable transport.
const ECT0: u8 = 2;

/// Frames the fabric or the kernel counted as lost, over the whole testbed. A counter may
/// also include frames that are not the test's (it only ever loosens the bound), but every
/// place where a test frame can vanish is in it.
#[derive(Debug, Default)]
struct Losses {
    /// Threshold and shared-buffer drops in switch egress queues.
    queue_drops: u64,
    /// Random loss on emulated links.
    link_lost: u64,
    /// Frames a switch port could not put on its TX ring.
    tx_refused: u64,
    /// The kernel's AF_XDP drops at switch ports (RX ring full, no FILL entry, bad
    /// descriptor): frames the fabric never saw.
    xsk_drops: u64,
    /// Forwarding errors (malformed, TTL expired, no route; not-IPv4 frames are not ours).
    forward_errors: u64,
    /// Interface RX and TX drop counters in every host and switch namespace (veth backlog
    /// full and the like).
    netdev_drops: u64,
}

impl Losses {
    /// Everything the fabric's `stats` and the interfaces of `net` count as lost.
    fn of(net: &FabricNet, stats: &FabricStats) -> Losses {
        let mut l = Losses::default();
        for s in &stats.switches {
            let f = &s.forward;
            l.forward_errors += f.malformed + f.ttl_expired + f.no_route;
            for p in &s.ports {
                let q = p.egress.sum();
                l.queue_drops += q.dropped_threshold + q.dropped_buffer;
                l.link_lost += p.egress.lost_pkts;
                l.tx_refused += p.socket.tx_refused;
                let k = &p.kernel;
                l.xsk_drops += k.rx_dropped + k.rx_ring_full + k.rx_invalid_descs;
            }
        }
        l.netdev_drops = net
            .host_namespaces()
            .iter()
            .chain(net.switch_namespaces())
            .map(|ns| netdev_drops(ns))
            .sum();
        l
    }

    fn total(&self) -> u64 {
        self.queue_drops
            + self.link_lost
            + self.tx_refused
            + self.xsk_drops
            + self.forward_errors
            + self.netdev_drops
    }
}

/// RX plus TX drops of every interface in namespace `netns`, from the kernel's per-namespace
/// `/proc/thread-self/net/dev` (the calling thread's namespace, which `run_in_netns` sets).
fn netdev_drops(netns: &str) -> u64 {
    run_in_netns(netns, || {
        let text = std::fs::read_to_string("/proc/thread-self/net/dev").unwrap();
        // Two header lines, then `name: 8 RX counters 8 TX counters`; drops are the fourth
        // of each group.
        text.lines()
            .skip(2)
            .filter_map(|line| line.split_once(':'))
            .map(|(_, counters)| {
                let v: Vec<u64> = counters
                    .split_whitespace()
                    .map(|c| c.parse().unwrap())
                    .collect();
                v[3] + v[11]
            })
            .sum()
    })
    .unwrap()
}

/// Checks that `received` of the `sent` datagrams arrived and that the fabric and the
/// kernel counted every one that did not.
fn assert_accounted(sent: u64, received: u64, losses: &Losses, stats: &FabricStats) {
    eprintln!(
        "sent {sent} received {received} losses {losses:?} lag {:?}",
        stats.lag
    );
    assert!(received <= sent, "received {received} of {sent}");
    assert!(
        sent - received <= losses.total(),
        "{} of {sent} datagrams vanished where nothing counted them ({losses:?}; lag {:?})",
        sent - received - losses.total(),
        stats.lag
    );
    // The run measured the fabric, not its losses.
    assert!(
        2 * received >= sent,
        "only {received} of {sent} arrived ({losses:?})"
    );
}

/// Packets offered to each egress port of switch `s` whose peer is named like `peer`, in
/// queue `queue` (or all queues for `None`), in port order.
fn arrivals_towards(s: &SwitchStats, peer: &str, queue: Option<usize>) -> Vec<u64> {
    s.ports
        .iter()
        .filter(|p| p.peer.starts_with(peer))
        .map(|p| match queue {
            Some(q) => p.egress.queues[q].arrivals(),
            None => p.egress.sum().arrivals(),
        })
        .collect()
}

/// Sends `bytes` over kernel TCP from host `from` to host `to` and returns what arrived.
fn tcp_transfer(net: &FabricNet, topo: &Topology, from: usize, to: usize, bytes: usize) -> Vec<u8> {
    let dst = topo.hosts[to].ip;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = spawn_in_netns(net.host_ns(to).unwrap(), move || {
        let l = TcpListener::bind((dst, 5001)).unwrap();
        ready_tx.send(()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut v = Vec::new();
        s.read_to_end(&mut v).unwrap();
        v
    })
    .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    run_in_netns(net.host_ns(from).unwrap(), move || {
        let to = SocketAddr::from((dst, 5001));
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5)).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(&pattern(bytes)).unwrap();
    })
    .unwrap();
    server.join().unwrap()
}

fn pattern(bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i * 7 + i / 1500) as u8).collect()
}

#[test]
fn leaf_spine_sprays_evenly_and_carries_tcp() {
    if !require_root("leaf_spine_sprays_evenly_and_carries_tcp") {
        return;
    }
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbeds/leaf-spine.toml");
    let topo = Topology::load(&file).unwrap();
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let a0 = topo.host_index("a0").unwrap();
    let b2 = topo.host_index("b2").unwrap();
    let rx = Receiver::start(net.host_ns(b2).unwrap(), topo.hosts[b2].ip);

    // One UDP flow (one 5-tuple), paced below the link rate so nothing should queue. It is
    // ECN-capable: the fabric timestamps arrivals when it reads them, so a stall of the fabric
    // thread on a loaded machine bunches paced frames into a burst that may cross a queue
    // threshold; ECT frames are then marked, not dropped. Whatever else a loaded machine
    // loses is counted somewhere and checked below.
    let n = 2000usize;
    let dst = SocketAddr::from((topo.hosts[b2].ip, PORT));
    let src = topo.hosts[a0].ip;
    let sent = spawn_in_netns(net.host_ns(a0).unwrap(), move || {
        let s = std::net::UdpSocket::bind((src, 9000)).unwrap();
        nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv4Tos, &i32::from(ECT0))
            .unwrap();
        let payload = vec![1u8; 1000];
        let mut sent = 0u64;
        for k in 0..n {
            // Count only what the kernel took.
            if s.send_to(&payload, dst).is_ok() {
                sent += 1;
            }
            // Pacing (the traffic's shape), not synchronisation.
            if k % 10 == 9 {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        sent
    })
    .unwrap()
    .join()
    .unwrap();
    assert!(fabric.wait_idle(Duration::from_secs(10)));
    let seen = rx.finish();
    let mid = fabric.stats().unwrap();
    let losses = Losses::of(&net, &mid);
    assert_accounted(sent, seen.classes_total().packets, &losses, &mid);

    // Spreading, as leaf0 decided it: per-packet round robin over its two uplinks offers them
    // the same number of frames, give or take one, whatever was lost before or after.
    let uplinks = arrivals_towards(mid.switch("leaf0").unwrap(), "switch spine", None);
    eprintln!("leaf0 offered its uplinks {uplinks:?}");
    assert_eq!(uplinks.len(), 2);
    assert!(
        uplinks[0].abs_diff(uplinks[1]) <= 1,
        "uneven spray {uplinks:?}"
    );
    // And as the spines saw it: what they forwarded differs by no more than what was lost.
    let via: Vec<u64> = ["spine0", "spine1"]
        .iter()
        .map(|s| mid.switch(s).unwrap().forward.forwarded)
        .collect();
    eprintln!("spine0 {} spine1 {} of {sent}", via[0], via[1]);
    assert!(via[0] + via[1] <= sent);
    assert!(
        via[0] + via[1] + losses.total() >= sent,
        "{via:?} {losses:?}"
    );
    assert!(
        via[0].abs_diff(via[1]) <= 1 + losses.total(),
        "uneven split {via:?} ({losses:?})"
    );

    // Kernel TCP across leaf, spine, leaf (sprayed per packet, so possibly reordered).
    let bytes = 3_000_000;
    let got = tcp_transfer(&net, &topo, a0, topo.host_index("b1").unwrap(), bytes);
    assert_eq!(got.len(), bytes);
    assert!(got == pattern(bytes), "TCP bytes differ");
    // And back within one leaf.
    let got = tcp_transfer(&net, &topo, topo.host_index("a3").unwrap(), a0, 500_000);
    assert!(got == pattern(500_000));

    let st = fabric.stop().unwrap();
    net.down().unwrap();
    let leaf0 = st.switch("leaf0").unwrap();
    assert_eq!(leaf0.forward.malformed + leaf0.forward.no_route, 0);
    eprintln!("lag {:?}", st.lag);
}

#[test]
fn per_flow_ecmp_keeps_a_flow_on_one_spine() {
    if !require_root("per_flow_ecmp_keeps_a_flow_on_one_spine") {
        return;
    }
    let topo = leaf_spine_per_flow();
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let a1 = topo.host_index("a1").unwrap();
    let b3 = topo.host_index("b3").unwrap();
    // A bound socket at the receiver, so that it answers with no ICMP that would cross the
    // spines too.
    let rx = Receiver::start(net.host_ns(b3).unwrap(), topo.hosts[b3].ip);
    let dst = SocketAddr::from((topo.hosts[b3].ip, PORT));
    let src = topo.hosts[a1].ip;
    // One flow (source port) per egress queue, each with the queue's DSCP, so that the spines'
    // per-queue counters tell the flows apart. ECN-capable: a queue above its threshold marks
    // rather than drops.
    const FLOWS: usize = NUM_QUEUES as usize;
    const PER_FLOW: usize = 100;
    let sent = spawn_in_netns(net.host_ns(a1).unwrap(), move || {
        let payload = vec![1u8; 200];
        let mut sent = [0u64; FLOWS];
        for (f, n) in sent.iter_mut().enumerate() {
            let s = std::net::UdpSocket::bind((src, 9100 + f as u16)).unwrap();
            let tos = queue_dscp(f as u8).unwrap() << 2 | ECT0;
            nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv4Tos, &i32::from(tos))
                .unwrap();
            for _ in 0..PER_FLOW {
                if s.send_to(&payload, dst).is_ok() {
                    *n += 1;
                }
            }
            // Pacing between flows (the traffic's shape), not synchronisation.
            std::thread::sleep(Duration::from_millis(2));
        }
        sent
    })
    .unwrap()
    .join()
    .unwrap();
    assert!(fabric.wait_idle(Duration::from_secs(10)));
    let seen = rx.finish();
    let st = fabric.stats().unwrap();
    let losses = Losses::of(&net, &st);
    let total: u64 = sent.iter().sum();
    assert_accounted(total, seen.classes_total().packets, &losses, &st);
    let st = fabric.stop().unwrap();
    net.down().unwrap();
    // Per flow, the frames that reached the spines' egress queues: whole flows, so one spine
    // saw each flow and the other none of it, however many frames were lost on the way.
    let per_spine: Vec<Vec<u64>> = ["spine0", "spine1"]
        .iter()
        .map(|s| {
            let sw = st.switch(s).unwrap();
            (0..FLOWS)
                .map(|q| arrivals_towards(sw, "switch leaf1", Some(q)).iter().sum())
                .collect()
        })
        .collect();
    eprintln!(
        "per-flow: spine0 {:?} spine1 {:?}",
        per_spine[0], per_spine[1]
    );
    for f in 0..FLOWS {
        let (a, b) = (per_spine[0][f], per_spine[1][f]);
        assert!(
            a == 0 || b == 0,
            "flow {f} was split: spine0 {a} spine1 {b}"
        );
        assert!(a + b <= sent[f], "flow {f}: {a} + {b} of {}", sent[f]);
    }
    // Both spines are used (all 8 flows on one spine has probability 2^-7 for a random hash;
    // the hash and its seed are fixed, so this holds or fails deterministically).
    let flows_via = |s: usize| per_spine[s].iter().filter(|&&n| n > 0).count();
    assert!(flows_via(0) > 0 && flows_via(1) > 0, "{per_spine:?}");
}
