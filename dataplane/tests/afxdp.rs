//! The transport over AF_XDP between network namespaces (root only): 64 MiB tensors under
//! loss injected by the XDP classifier, interop with the kernel UDP datapath both ways, and
//! malformed and foreign packets that must be dropped, counted and never touch a tensor.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use gradwire::afxdp::engine::{Engine, EngineConfig};
use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, AfXdpStats, QueueStats};
use gradwire::datapath::fault::{FaultConfig, FaultInjector};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{
    Receiver, RecvOptions, RecvReport, SendOptions, SendReport, Sender, TransferConfig,
};
use gradwire_netns::{require_root, Testbed, TestbedConfig};

const DATA_PORT: u16 = 7000;
const CTRL_PORT: u16 = 7001;
const DSCP: u8 = 10;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Afxdp,
    Udp,
    /// Pinned per-queue workers on queues 0 and 1.
    Engine,
}

fn cfg() -> TransferConfig {
    TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    }
}

/// A datapath of `kind` on host address `ip`, dropping received data with probability `loss`
/// (in XDP for AF_XDP, in the fault injector for UDP).
fn datapath(kind: Kind, ip: IpAddr, loss: f64) -> Box<dyn Datapath> {
    let local = SocketAddr::new(ip, DATA_PORT);
    match kind {
        Kind::Afxdp => {
            let mut c = AfXdpConfig::new("gw0", local);
            c.socket.hugepages = false;
            if loss > 0.0 {
                c.fault_drop = vec![(DSCP, loss)];
            }
            Box::new(AfXdpDatapath::open(c).expect("AF_XDP datapath"))
        }
        Kind::Engine => {
            let mut c = AfXdpConfig::new("gw0", local);
            c.socket.hugepages = false;
            c.queues = vec![0, 1];
            if loss > 0.0 {
                c.fault_drop = vec![(DSCP, loss)];
            }
            Box::new(
                Engine::start(EngineConfig {
                    afxdp: c,
                    cores: engine_cores(),
                })
                .expect("AF_XDP engine"),
            )
        }
        Kind::Udp => {
            let dp = UdpDatapath::bind(local, UdpConfig::default()).expect("UDP datapath");
            Box::new(
                FaultInjector::new(
                    dp,
                    FaultConfig {
                        seed: 5,
                        ..FaultConfig::loss(loss)
                    },
                )
                .unwrap(),
            )
        }
    }
}

fn pattern(elems: usize, seed: u64) -> Tensor {
    let mut t = Tensor::zeros(DType::F32, elems);
    t.fill_pattern(seed);
    t
}

/// One transfer from host 0 (`tx`) to host 1 (`rx`); returns both reports after checking the
/// bound and every delivered byte.
fn transfer(
    tb: &Testbed,
    tx: Kind,
    rx: Kind,
    bytes: usize,
    loss: f64,
    bound: f64,
) -> (SendReport, RecvReport) {
    let t = transfer_with_stats(tb, tx, rx, bytes, loss, bound);
    (t.send, t.recv)
}

/// What one transfer reports: both ends' reports and their AF_XDP counters (per queue, with
/// the cores of the engine's workers; `None` for kernel UDP), read when each end finished.
struct Transfer {
    send: SendReport,
    recv: RecvReport,
    tx_stats: Option<AfXdpStats>,
    rx_stats: Option<AfXdpStats>,
}

/// [`transfer`], keeping the datapaths' counters.
fn transfer_with_stats(
    tb: &Testbed,
    tx: Kind,
    rx: Kind,
    bytes: usize,
    loss: f64,
    bound: f64,
) -> Transfer {
    let elems = bytes / 4;
    let rx_ip = IpAddr::V4(tb.host(1).ipv4);
    let tx_ip = IpAddr::V4(tb.host(0).ipv4);
    let receiver = tb
        .spawn_in(1, move || {
            let listener = gradwire::ctrl_listener::CtrlListener::bind(
                SocketAddr::new(rx_ip, CTRL_PORT),
                gradwire::ctrl_listener::ListenerConfig::default(),
            )
            .unwrap();
            let dp = datapath(rx, rx_ip, loss);
            let mut r = Receiver::accept(&listener, dp, cfg()).unwrap();
            let mut got = Tensor::zeros(DType::F32, elems);
            got.as_bytes_mut().fill(0xAB);
            let report = r.recv(&mut got, &RecvOptions::new(4, 2)).unwrap();
            let sent = pattern(elems, 99);
            for i in 0..report.segments {
                let (off, len) = report.layout.segment(i).unwrap();
                let range = off as usize..off as usize + len;
                if report.bitmap.get(i) {
                    assert!(
                        got.as_bytes()[range.clone()] == sent.as_bytes()[range],
                        "segment {i} differs"
                    );
                } else {
                    assert!(
                        got.as_bytes()[range].iter().all(|&b| b == 0),
                        "missing segment {i} not zeroed"
                    );
                }
            }
            (report, AfXdpStats::of(&**r.datapath()))
        })
        .unwrap();
    let sender = tb
        .spawn_in(0, move || {
            let dp = datapath(tx, tx_ip, 0.0);
            let ctrl = connect_retry(SocketAddr::new(rx_ip, CTRL_PORT));
            let mut s = Sender::with_channel(ctrl, dp, cfg()).unwrap();
            let t = pattern(elems, 99);
            let opts = SendOptions {
                loss_bound: Some(LossBound::from_fraction(bound).unwrap()),
                ..SendOptions::new(4, 2)
            };
            let report = s
                .send(
                    &t,
                    &opts,
                    &fixed_priority(Tag {
                        dscp: DSCP,
                        ect: true,
                    }),
                )
                .unwrap();
            (report, AfXdpStats::of(&**s.datapath()))
        })
        .unwrap();
    let (s, tx_stats) = sender.join().expect("sender panicked");
    let (r, rx_stats) = receiver.join().expect("receiver panicked");
    assert!(
        r.delivered_fraction >= 1.0 - bound - 1e-12,
        "delivered {} < 1 - {bound}",
        r.delivered_fraction
    );
    Transfer {
        send: s,
        recv: r,
        tx_stats,
        rx_stats,
    }
}

/// Connects the control channel ([`gradwire_netns::connect_retry`] for up to 10 s while the
/// receiver starts up).
fn connect_retry(addr: SocketAddr) -> gradwire::ctrl_channel::TcpCtrl {
    let stream = gradwire_netns::connect_retry(addr, Duration::from_secs(10)).expect("connect");
    gradwire::ctrl_channel::TcpCtrl::client_handshake(stream, None, None, Duration::from_secs(10))
        .expect("control channel")
}

fn testbed() -> Option<Testbed> {
    if !require_root("afxdp") {
        return None;
    }
    Some(Testbed::up(&TestbedConfig::default()).expect("testbed"))
}

#[test]
fn afxdp_64mib_under_xdp_injected_loss() {
    let Some(tb) = testbed() else { return };
    for (loss, bound) in [
        (0.0, 0.01),
        (0.01, 0.005),
        (0.05, 0.01),
        (0.20, 0.10),
        (0.05, 0.0),
    ] {
        let (s, r) = transfer(&tb, Kind::Afxdp, Kind::Afxdp, 64 << 20, loss, bound);
        if loss > bound {
            assert!(
                r.rounds >= 1,
                "loss {loss} > bound {bound} needs a retransmission round"
            );
        }
        if bound == 0.0 {
            assert_eq!(r.received_segments, r.segments);
        }
        assert!(s.stats.packets >= u64::from(r.received_segments));
        eprintln!(
            "afxdp loss {loss} bound {bound}: delivered {:.4} rounds {} fct {:?}",
            r.delivered_fraction, r.rounds, r.fct
        );
    }
}

#[test]
fn afxdp_interoperates_with_kernel_udp_both_ways() {
    let Some(tb) = testbed() else { return };
    let (_, r) = transfer(&tb, Kind::Afxdp, Kind::Udp, 8 << 20, 0.0, 0.0);
    assert_eq!(
        r.received_segments, r.segments,
        "kernel UDP accepted every AF_XDP frame"
    );
    let (_, r) = transfer(&tb, Kind::Udp, Kind::Afxdp, 8 << 20, 0.0, 0.0);
    assert_eq!(
        r.received_segments, r.segments,
        "AF_XDP parsed every kernel UDP frame"
    );
}

/// A gradwire datagram with `payload` and the given header fields.
fn datagram(
    job: u32,
    tensor: u32,
    round: u32,
    offset: u64,
    payload: &[u8],
    version: u8,
) -> Vec<u8> {
    use gradwire::wire::header::{Flags, Kind as HKind, Packet, Repr, HEADER_LEN};
    let repr = Repr {
        kind: HKind::Data,
        flags: Flags::EMPTY,
        pass: 0,
        job_id: job,
        tensor_id: tensor,
        round,
        offset,
        seq: 0,
        length: payload.len() as u16,
        layer: 0,
    };
    let mut buf = vec![0u8; HEADER_LEN + payload.len()];
    let mut pkt = Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut pkt).unwrap();
    pkt.payload_mut().copy_from_slice(payload);
    buf[0] = version;
    buf
}

#[test]
fn malformed_and_foreign_packets_are_dropped_counted_and_touch_nothing() {
    use gradwire::ctrl_channel::{CtrlChannel, TcpCtrl};
    use gradwire::message::{CtrlMsg, FlowStart, Stage};
    if !require_root("afxdp malformed") {
        return;
    }
    let tb = Testbed::up(&TestbedConfig {
        hosts: 3,
        ..TestbedConfig::default()
    })
    .expect("testbed");
    let (ip0, ip1, ip2) = (
        IpAddr::V4(tb.host(0).ipv4),
        IpAddr::V4(tb.host(1).ipv4),
        IpAddr::V4(tb.host(2).ipv4),
    );
    const ELEMS: usize = 3600; // 14400 bytes: 10 segments of 1440
    let receiver = tb
        .spawn_in(1, move || {
            let listener = gradwire::ctrl_listener::CtrlListener::bind(
                SocketAddr::new(ip1, CTRL_PORT),
                gradwire::ctrl_listener::ListenerConfig::default(),
            )
            .unwrap();
            let mut c = AfXdpConfig::new("gw0", SocketAddr::new(ip1, DATA_PORT));
            c.socket.hugepages = false;
            c.allowlist = Some(vec![ip0]);
            let dp = AfXdpDatapath::open(c).unwrap();
            let mut r = Receiver::accept(&listener, dp, cfg()).unwrap();
            let mut got = Tensor::zeros(DType::F32, ELEMS);
            let report = r.recv(&mut got, &RecvOptions::new(4, 2)).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            (report, got, r.datapath().afxdp_stats())
        })
        .unwrap();
    let (accepted_tx, accepted_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let fake = tb
        .spawn_in(0, move || {
            let t = pattern(ELEMS, 7);
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut ctrl = loop {
                match TcpCtrl::connect(
                    SocketAddr::new(ip1, CTRL_PORT),
                    Duration::from_secs(1),
                    None,
                ) {
                    Ok(c) => break c,
                    Err(e) => {
                        assert!(Instant::now() < deadline, "{e}");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            };
            ctrl.send(&CtrlMsg::FlowStart(FlowStart {
                job_id: 4,
                tensor_id: 2,
                round: 0,
                layer: 0,
                dtype_code: DType::F32.code(),
                size_bytes: 14_400,
                segment_payload: 1440,
                segment_count: 10,
                loss_bound: LossBound::RELIABLE,
                stage: Stage::Push,
                priority: 0,
                flow_nonce: [0; 16],
                // The data socket below: peer binding accepts data from it only.
                sources: vec![gradwire::message::DataSource::single(SocketAddr::new(
                    ip0, DATA_PORT,
                ))],
            }))
            .unwrap();
            let Some(CtrlMsg::FlowAccept { data_port, .. }) =
                ctrl.recv(Duration::from_secs(5)).unwrap()
            else {
                panic!("no FlowAccept")
            };
            let dst = SocketAddr::new(ip1, data_port);
            // The flow is live: let the foreign host try, then carry on.
            accepted_tx.send(()).unwrap();
            go_rx.recv_timeout(Duration::from_secs(10)).unwrap();
            let s = UdpSocket::bind(SocketAddr::new(ip0, DATA_PORT)).unwrap();
            let junk = [0xEEu8; 1440];
            let bad: Vec<Vec<u8>> = vec![
                vec![1, 1, 0, 0, 0, 0, 0, 4, 0, 0], // truncated gradwire header: dropped in XDP
                datagram(4, 2, 0, 0, &junk, 9),     // bad version
                datagram(5, 2, 0, 0, &junk, 1),     // unknown job
                datagram(4, 3, 0, 0, &junk, 1),     // unknown tensor
                datagram(4, 2, 1, 0, &junk, 1),     // other round
                datagram(4, 2, 0, 14_400, &junk, 1), // outside the tensor
                datagram(4, 2, 0, 720, &junk[..720], 1), // not a segment
                datagram(4, 2, 0, 0, &junk[..1438], 1), // not whole elements
            ];
            for d in &bad {
                s.send_to(d, dst).unwrap();
            }
            // Then the real data, and the protocol to the end.
            for i in 0..10u64 {
                let off = i as usize * 1440;
                s.send_to(
                    &datagram(4, 2, 0, off as u64, &t.as_bytes()[off..off + 1440], 1),
                    dst,
                )
                .unwrap();
            }
            ctrl.send(&CtrlMsg::FlowStop {
                pass: 0,
                segments_sent: 10,
            })
            .unwrap();
            loop {
                match ctrl.recv(Duration::from_secs(5)).unwrap() {
                    Some(CtrlMsg::FlowFinish { received_segments }) => {
                        assert_eq!(received_segments, 10);
                        ctrl.send(&CtrlMsg::FinishConfirm).unwrap();
                        break;
                    }
                    // Reports and the flow's share of the receiver's downlink.
                    Some(CtrlMsg::RateReport { .. } | CtrlMsg::RateGrant { .. }) => {}
                    // The 10 good packets, whatever queue their DSCP selects; the malformed
                    // and foreign ones never reach the flow.
                    Some(CtrlMsg::EcnReport { queues }) => {
                        assert_eq!(queues.iter().map(|q| q.packets).sum::<u32>(), 10);
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        })
        .unwrap();
    accepted_rx
        .recv_timeout(Duration::from_secs(15))
        .expect("fake sender never got FlowAccept");
    // The foreign host sends well-formed segments: the allowlist must drop them in XDP.
    tb.run_in(2, move || {
        let s = UdpSocket::bind(SocketAddr::new(ip2, 0)).unwrap();
        for _ in 0..5 {
            s.send_to(
                &datagram(4, 2, 0, 0, &[0xEE; 1440], 1),
                SocketAddr::new(ip1, DATA_PORT),
            )
            .unwrap();
        }
    })
    .unwrap();
    go_tx.send(()).unwrap();
    fake.join().expect("fake sender panicked");
    let (report, got, stats) = receiver.join().expect("receiver panicked");
    assert_eq!(
        got.as_bytes(),
        pattern(ELEMS, 7).as_bytes(),
        "junk changed a tensor byte"
    );
    let rej = report.rejected;
    assert_eq!(
        (
            rej.malformed,
            rej.unknown_job,
            rej.unknown_tensor,
            rej.stale_round,
            rej.out_of_bounds,
            rej.misaligned
        ),
        (1, 1, 1, 1, 1, 1),
        "{rej:?}"
    );
    // 1438 bytes: not whole f32 elements.
    assert_eq!(rej.not_element_multiple, 1, "{rej:?}");
    let xdp = stats.xdp.expect("XDP counters");
    assert_eq!(xdp.drop_truncated.packets, 1, "{xdp:?}");
    assert_eq!(xdp.drop_not_allowed.packets, 5, "{xdp:?}");
    assert_eq!(stats.queues[0].rx_malformed, 0);
}

/// Without static neighbours, an AF_XDP sender finds the receiver's MAC through the kernel's
/// ARP (`afxdp::neigh::resolve`: one kernel datagram to the peer's discard port, then the ARP
/// table) and the transfer delivers every byte. The control channel is in memory, so nothing
/// else crosses the veth that could make the kernel resolve the peer first.
#[test]
fn afxdp_resolves_the_peer_through_arp_without_static_neighbours() {
    use gradwire::ctrl_channel::MemCtrl;
    use gradwire::transport::{recv_tensor, send_tensor};
    let Some(tb) = testbed() else { return };
    let (tx_ip, rx_ip) = (tb.host(0).ipv4, tb.host(1).ipv4);
    // Remove the testbed's permanent entries, both ways.
    for (host, peer) in [(0, rx_ip), (1, tx_ip)] {
        tb.exec(
            host,
            &["ip", "neigh", "del", &peer.to_string(), "dev", "gw0"],
        )
        .expect("delete the static neighbour");
        let left = tb
            .exec(host, &["ip", "-4", "neigh", "show", "dev", "gw0"])
            .unwrap();
        assert_eq!(left.trim(), "", "host {host} still has neighbours");
    }
    const ELEMS: usize = (4 << 20) / 4;
    let (mut tx_ctrl, mut rx_ctrl) = MemCtrl::pair();
    let (rx_ip, tx_ip) = (IpAddr::V4(rx_ip), IpAddr::V4(tx_ip));
    let receiver = tb
        .spawn_in(1, move || {
            let mut dp = datapath(Kind::Afxdp, rx_ip, 0.0);
            let mut got = Tensor::zeros(DType::F32, ELEMS);
            let opts = RecvOptions::new(4, 2);
            let report = recv_tensor(&mut *dp, &mut rx_ctrl, &mut got, &opts, &cfg()).unwrap();
            (report, got)
        })
        .unwrap();
    let sender = tb
        .spawn_in(0, move || {
            let mut dp = datapath(Kind::Afxdp, tx_ip, 0.0);
            let opts = SendOptions {
                loss_bound: Some(LossBound::RELIABLE),
                ..SendOptions::new(4, 2)
            };
            let prio = fixed_priority(Tag {
                dscp: DSCP,
                ect: true,
            });
            let t = pattern(ELEMS, 5);
            let report = send_tensor(&mut *dp, &mut tx_ctrl, rx_ip, &t, &opts, &prio, &cfg());
            (report.unwrap(), dp.stats())
        })
        .unwrap();
    let (s, tx_stats) = sender.join().expect("sender panicked");
    let (r, got) = receiver.join().expect("receiver panicked");
    assert_eq!(r.received_segments, r.segments);
    assert_eq!(got.as_bytes(), pattern(ELEMS, 5).as_bytes(), "bytes differ");
    assert_eq!(
        tx_stats.tx_dropped, 0,
        "no frame went unaddressed: {tx_stats:?}"
    );
    assert!(s.stats.packets >= u64::from(r.segments));
    // The sender's kernel learnt the receiver's real address, dynamically.
    let entry = tb
        .exec(
            0,
            &[
                "ip",
                "-4",
                "neigh",
                "show",
                &rx_ip.to_string(),
                "dev",
                "gw0",
            ],
        )
        .unwrap();
    assert!(
        entry.contains(&format!("lladdr {}", tb.host(1).mac_string())),
        "{entry}"
    );
    assert!(!entry.contains("PERMANENT"), "{entry}");
}

/// Cores of the engine's workers (queue 0 on core 0, queue 1 on core 1) when the machine has
/// two; none otherwise.
fn engine_cores() -> Vec<usize> {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 {
        vec![0, 1]
    } else {
        vec![]
    }
}

/// Checks what the engine of one end reports per queue: both queues, each worker on the core
/// it was given, and traffic through each queue (`packets` reads a queue's count).
fn check_engine_queues(
    end: &str,
    stats: Option<&AfXdpStats>,
    packets: impl Fn(&QueueStats) -> u64,
) -> u64 {
    let stats = stats.unwrap_or_else(|| panic!("{end}: no AF_XDP counters"));
    let queues: Vec<u32> = stats.queues.iter().map(|q| q.queue).collect();
    assert_eq!(queues, [0, 1], "{end}: {stats:?}");
    let cores = engine_cores();
    let mut total = 0;
    for (i, q) in stats.queues.iter().enumerate() {
        assert_eq!(
            q.core,
            cores.get(i).copied(),
            "{end}: core of queue {}",
            q.queue
        );
        assert!(
            packets(q) > 0,
            "{end}: nothing went through queue {}: {q:?}",
            q.queue
        );
        assert_eq!(q.rx_malformed, 0, "{end}: queue {}: {q:?}", q.queue);
        total += packets(q);
    }
    total
}

#[test]
fn engine_with_pinned_workers_on_two_queues() {
    if !require_root("afxdp engine") {
        return;
    }
    if engine_cores().is_empty() {
        gradwire_netns::skip_part(
            "engine_with_pinned_workers_on_two_queues",
            "pinning the workers",
            "the machine has one core; the workers run unpinned",
        );
    }
    let tb = Testbed::up(&TestbedConfig {
        queues: 2,
        ..TestbedConfig::default()
    })
    .expect("testbed");
    for (loss, bound) in [(0.0, 0.01), (0.05, 0.01), (0.05, 0.0)] {
        let t = transfer_with_stats(&tb, Kind::Engine, Kind::Engine, 64 << 20, loss, bound);
        let (s, r) = (&t.send, &t.recv);
        if bound == 0.0 {
            assert_eq!(r.received_segments, r.segments);
        }
        assert!(s.stats.packets >= u64::from(r.received_segments));
        // The sender's API thread alternates its TX queues; on veth the receiving end's
        // native XDP sees each packet on the queue it was sent from, so both workers of each
        // end carry traffic, and every segment the receiver has came through one of them.
        check_engine_queues("sender", t.tx_stats.as_ref(), |q| q.tx_packets);
        let received = check_engine_queues("receiver", t.rx_stats.as_ref(), |q| q.rx_packets);
        assert!(
            received >= u64::from(r.received_segments),
            "the receiver's queues counted {received} packets for {} segments",
            r.received_segments
        );
        eprintln!(
            "engine loss {loss} bound {bound}: delivered {:.4} rounds {} fct {:?}; per queue \
             tx {:?} rx {:?}",
            r.delivered_fraction,
            r.rounds,
            r.fct,
            t.tx_stats
                .as_ref()
                .map(|s| s.queues.iter().map(|q| q.tx_packets).collect::<Vec<_>>()),
            t.rx_stats
                .as_ref()
                .map(|s| s.queues.iter().map(|q| q.rx_packets).collect::<Vec<_>>()),
        );
    }
    // Interop with the single-thread datapath and kernel UDP.
    let (_, r) = transfer(&tb, Kind::Engine, Kind::Udp, 8 << 20, 0.0, 0.0);
    assert_eq!(r.received_segments, r.segments);
    let (_, r) = transfer(&tb, Kind::Afxdp, Kind::Engine, 8 << 20, 0.0, 0.0);
    assert_eq!(r.received_segments, r.segments);
}
