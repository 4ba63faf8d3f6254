//! gradwire across the emulated leaf-spine, over kernel UDP and over AF_XDP: with per-flow
//! ECMP at the leaves, one transfer stays on one spine, and rotating the source port over 16
//! values (host-side spraying, DLCP §3.2.3) spreads it over both; every delivered byte is
//! checked. Paths are counted at the spines' egress queue that carries the data DSCP, so the
//! TCP control channel (its own DSCP, its own queue) does not blur the split.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::*;
use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};
use gradwire_ebpf::AttachMode;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig, FabricStats};
use gradwire_fabric::topology::Topology;
use gradwire_netns::{require_root, spawn_in_netns};

const DATA_PORT: u16 = 7000;
const CTRL_PORT: u16 = 7100;
/// DSCP 10: queue 1 of the policy.
const DSCP: u8 = 10;
const QUEUE: usize = 1;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Udp,
    Afxdp,
}

fn datapath(kind: Kind, local: SocketAddr, spray: u16) -> Box<dyn Datapath> {
    match kind {
        Kind::Udp => {
            let cfg = UdpConfig {
                spray_ports: spray,
                ..UdpConfig::default()
            };
            Box::new(UdpDatapath::bind(local, cfg).unwrap())
        }
        Kind::Afxdp => {
            let mut c = AfXdpConfig::new("eth0", local);
            c.socket.hugepages = false;
            c.xdp_mode = AttachMode::Generic;
            c.spray_ports = spray;
            Box::new(AfXdpDatapath::open(c).unwrap())
        }
    }
}

fn cfg() -> TransferConfig {
    let mut c = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    // The emulated links run at 200 Mbit/s.
    c.sender.rate.line_rate_bps = 200_000_000;
    c
}

/// One reliable transfer of `bytes` from host `from` to host `to`, every byte checked.
fn transfer(net: &FabricNet, topo: &Topology, kind: Kind, from: usize, to: usize, spray: u16) {
    let bytes = 4 << 20;
    let elems = bytes / 4;
    let rx_ip = IpAddr::V4(topo.hosts[to].ip);
    let tx_ip = IpAddr::V4(topo.hosts[from].ip);
    let receiver = spawn_in_netns(net.host_ns(to).unwrap(), move || {
        let listener = gradwire::ctrl_listener::CtrlListener::bind(
            SocketAddr::new(rx_ip, CTRL_PORT),
            gradwire::ctrl_listener::ListenerConfig::default(),
        )
        .unwrap();
        let dp = datapath(kind, SocketAddr::new(rx_ip, DATA_PORT), 1);
        let mut r = Receiver::accept(&listener, dp, cfg()).unwrap();
        let mut got = Tensor::zeros(DType::F32, elems);
        let report = r.recv(&mut got, &RecvOptions::new(1, 1)).unwrap();
        let mut want = Tensor::zeros(DType::F32, elems);
        want.fill_pattern(5);
        assert!(
            got.as_bytes() == want.as_bytes(),
            "{kind:?}: tensor differs"
        );
        report
    })
    .unwrap();
    let sender = spawn_in_netns(net.host_ns(from).unwrap(), move || {
        let dp = datapath(kind, SocketAddr::new(tx_ip, DATA_PORT), spray);
        let ctrl = connect_retry(SocketAddr::new(rx_ip, CTRL_PORT));
        let mut s = Sender::with_channel(ctrl, dp, cfg()).unwrap();
        let mut t = Tensor::zeros(DType::F32, elems);
        t.fill_pattern(5);
        let opts = SendOptions {
            loss_bound: Some(LossBound::RELIABLE),
            ..SendOptions::new(1, 1)
        };
        s.send(
            &t,
            &opts,
            &fixed_priority(Tag {
                dscp: DSCP,
                ect: true,
            }),
        )
        .unwrap()
    })
    .unwrap();
    sender.join().expect("sender panicked");
    let r = receiver.join().expect("receiver panicked");
    assert_eq!(r.delivered_fraction, 1.0);
    // Every spray port was announced: peer binding refused none of the sender's datagrams.
    assert_eq!(r.rejected.foreign_source, 0, "{kind:?}: {}", r.rejected);
}

/// Data packets each spine sent towards the leaves so far.
fn per_spine(st: &FabricStats) -> [u64; 2] {
    ["spine0", "spine1"].map(|s| {
        st.switch(s)
            .unwrap()
            .ports
            .iter()
            .map(|p| p.egress.queues[QUEUE].dequeued_pkts)
            .sum()
    })
}

#[test]
fn host_spraying_spreads_one_transfer_over_both_spines() {
    if !require_root("host_spraying_spreads_one_transfer_over_both_spines") {
        return;
    }
    let topo = leaf_spine_per_flow();
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let (a1, b2) = (
        topo.host_index("a1").unwrap(),
        topo.host_index("b2").unwrap(),
    );
    let mut last = [0u64; 2];
    for (kind, spray) in [
        (Kind::Udp, 1),
        (Kind::Udp, 16),
        (Kind::Afxdp, 1),
        (Kind::Afxdp, 16),
    ] {
        transfer(&net, &topo, kind, a1, b2, spray);
        assert!(fabric.wait_idle(Duration::from_secs(10)));
        let now = per_spine(&fabric.stats().unwrap());
        let d = [now[0] - last[0], now[1] - last[1]];
        last = now;
        let total = d[0] + d[1];
        let share = d[0].min(d[1]) as f64 / total as f64;
        eprintln!(
            "{kind:?} spray {spray}: spine0 {} spine1 {} (smaller share {share:.2})",
            d[0], d[1]
        );
        // 4 MiB is at least 2913 full segments.
        assert!(
            total >= 2913,
            "{kind:?}: {total} data packets crossed the spines"
        );
        if spray == 1 {
            assert_eq!(share, 0.0, "{kind:?}: one flow must stay on one spine");
        } else {
            assert!(share >= 0.2, "{kind:?}: spraying used the spines {d:?}");
        }
    }
    let st = fabric.stop().unwrap();
    net.down().unwrap();
    eprintln!("lag {:?}", st.lag);
}
