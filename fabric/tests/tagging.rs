//! DLCP's default tagging on the wire: a tensor whose segments alternate between small and
//! large gradients is sent with `DlcpTagger` across the emulated switch to an AF_XDP
//! receiver; the receiver's XDP classifier sees every packet with the layer's DSCP, ECT(0)
//! exactly on the large-gradient segments and not-ECT on the others, and nothing with the
//! control DSCP; the receiver's per-queue ECN counts reach the sender and match the classifier.
//! The tensor is built so that the sampled threshold is the large magnitude whatever the
//! sample, so the ECT check always runs.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::*;
use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath};
use gradwire::message::LossBound;
use gradwire::tagging::{DlcpTagger, MagnitudeConfig};
use gradwire::tensor::Tensor;
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};
use gradwire_ebpf::AttachMode;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig};
use gradwire_netns::{require_root, spawn_in_netns};
use gradwire_qos::{layer_dscp, CONTROL_DSCP};

const DATA_PORT: u16 = 7000;
const CTRL_PORT: u16 = 7100;
/// Elements per full segment of f32 at MTU 1500 (1440 bytes).
const SEG_ELEMS: usize = 360;
const SEGMENTS: usize = 400;
const LAYER: u32 = 40;
const LAYERS: u32 = 161;

fn cfg() -> TransferConfig {
    let mut c = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    c.sender.rate.line_rate_bps = 200_000_000;
    c
}

/// Segment `s` is small (even s) or large (odd s). Every element of a large segment has
/// |g| = 1.0; a small segment alternates |g| = 1.0 and 0.01 element by element, so its mean
/// |g| is 0.505 and it is not important. Signs are mixed.
///
/// Why this shape: the tagger's threshold is the median of whole 64-byte cache lines (16
/// f32) drawn at random. Segments start at even elements and lines at multiples of 16, so the
/// part of any line inside a small segment holds as many 1.0 as 0.01, and every line holds
/// at least as many 1.0 as 0.01: the median of any sample is 1.0. The large segments are then
/// exactly the important ones, deterministically, whatever the sampler draws.
fn gradients() -> Tensor {
    let v: Vec<f32> = (0..SEGMENTS * SEG_ELEMS)
        .map(|i| {
            let large = (i / SEG_ELEMS) % 2 == 1;
            let m = if large || i % 2 == 0 { 1.0 } else { 0.01 };
            if (i / 2) % 2 == 0 {
                m
            } else {
                -m
            }
        })
        .collect();
    Tensor::from_f32(&v)
}

#[test]
fn tagged_transfer_shows_layer_dscp_and_magnitude_ecn_at_the_receiver() {
    if !require_root("tagged_transfer_shows_layer_dscp_and_magnitude_ecn_at_the_receiver") {
        return;
    }
    let topo = topo(
        "name = \"tag\"\n[defaults]\nrate = \"200Mbit\"\n[[switch]]\nname = \"s0\"\n\
         [[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n",
    );
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let rx_ip = IpAddr::V4(topo.hosts[1].ip);
    let tx_ip = IpAddr::V4(topo.hosts[0].ip);
    let receiver = spawn_in_netns(net.host_ns(1).unwrap(), move || {
        let listener = gradwire::ctrl_listener::CtrlListener::bind(
            SocketAddr::new(rx_ip, CTRL_PORT),
            gradwire::ctrl_listener::ListenerConfig::default(),
        )
        .unwrap();
        let mut c = AfXdpConfig::new("eth0", SocketAddr::new(rx_ip, DATA_PORT));
        c.socket.hugepages = false;
        c.xdp_mode = AttachMode::Generic;
        let dp = AfXdpDatapath::open(c).unwrap();
        let mut r = Receiver::accept(&listener, dp, cfg()).unwrap();
        let mut got = gradients();
        got.as_bytes_mut().fill(0);
        let report = r.recv(&mut got, &RecvOptions::new(1, 1)).unwrap();
        assert!(got.as_bytes() == gradients().as_bytes(), "tensor differs");
        let xdp = gradwire::afxdp::AfXdpStats::of(r.datapath())
            .expect("AF_XDP datapath")
            .xdp
            .unwrap();
        (report, xdp)
    })
    .unwrap();
    let sender = spawn_in_netns(net.host_ns(0).unwrap(), move || {
        let dp = gradwire::datapath::udp::UdpDatapath::bind(
            SocketAddr::new(tx_ip, DATA_PORT),
            gradwire::datapath::udp::UdpConfig::default(),
        )
        .unwrap();
        let ctrl = connect_retry(SocketAddr::new(rx_ip, CTRL_PORT));
        let mut s = Sender::with_channel(ctrl, dp, cfg()).unwrap();
        let t = gradients();
        let tagger =
            DlcpTagger::for_tensor(&t, LAYER, LAYERS, &MagnitudeConfig::default()).unwrap();
        let opts = SendOptions {
            loss_bound: Some(LossBound::RELIABLE),
            layer: LAYER as u16,
            ..SendOptions::new(1, 1)
        };
        let report = s.send(&t, &opts, &tagger.priority_fn()).unwrap();
        (report, tagger)
    })
    .unwrap();
    let (sent, tagger) = sender.join().expect("sender panicked");
    let (got, xdp) = receiver.join().expect("receiver panicked");
    assert!(fabric.wait_idle(Duration::from_secs(10)));
    let st = fabric.stop().unwrap();
    net.down().unwrap();

    // The tensor guarantees the median (see `gradients`).
    let t = tagger.threshold.unwrap();
    assert_eq!(t, 1.0, "threshold");
    let dscp = layer_dscp(LAYER, LAYERS);
    assert_eq!(tagger.dscp, dscp);
    let packets = sent.stats.packets;
    eprintln!(
        "threshold {t}, dscp {dscp}, sent {packets}, classes {:?}",
        xdp.classes
    );
    assert_eq!(got.delivered_fraction, 1.0);
    // The switch may drop not-ECT packets above its threshold (the transfer is reliable, so
    // the sender retransmits them) and marks ECT ones instead: every packet sent either
    // reached the receiver's classifier or was dropped for being not-ECT.
    let port = st
        .switch("s0")
        .unwrap()
        .ports
        .iter()
        .find(|p| p.peer == "host h1")
        .unwrap();
    let q = port.egress.sum();
    assert_eq!(q.dropped_buffer, 0);
    let ect = xdp.class(dscp, 2).packets + xdp.class(dscp, 3).packets;
    let not_ect = xdp.class(dscp, 0).packets;
    eprintln!(
        "ECT {ect} (CE {}), not-ECT {not_ect}, switch marked {} dropped {}",
        xdp.class(dscp, 3).packets,
        q.marked,
        q.dropped_threshold
    );
    assert_eq!(
        ect + not_ect,
        xdp.classes_total().packets,
        "only the layer's DSCP"
    );
    assert_eq!(xdp.classes_total().packets + q.dropped_threshold, packets);
    assert_eq!(xdp.class(dscp, 3).packets, q.marked, "CE = switch marks");
    let half = SEGMENTS as u64 / 2;
    // Important segments are never dropped, so each was sent, and arrived, once, ECT. A
    // small-gradient segment the switch dropped (not-ECT above the threshold) is sent again,
    // and retransmissions are ECN-capable in grant mode (`retransmit_ect`): so ECT is exactly
    // the large-gradient segments plus the retransmissions, and not-ECT exactly the
    // small-gradient segments that got through the first time.
    let retransmitted = sent.stats.retransmitted;
    assert_eq!(
        retransmitted, q.dropped_threshold,
        "each drop sent again once"
    );
    assert_eq!(
        ect,
        half + retransmitted,
        "exactly the large-gradient segments and the retransmissions are ECT"
    );
    assert_eq!(
        not_ect,
        half - q.dropped_threshold,
        "every small-gradient segment the switch did not drop arrived, not-ECT"
    );
    assert_eq!(
        xdp.class(CONTROL_DSCP, 0).packets + xdp.class(CONTROL_DSCP, 2).packets,
        0
    );
    let _ = st;
}
