//! End-to-end transfers of a 64 MiB tensor over the in-memory and the kernel UDP datapaths,
//! under injected loss, reordering and duplication: the loss bound holds, every delivered
//! byte is the sender's byte, and untouched bytes follow the fill option.

#![allow(clippy::unwrap_used)]

mod common;

use common::Recorder;

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use gradwire::ctrl_channel::MemCtrl;
use gradwire::datapath::fault::{FaultConfig, FaultInjector};
use gradwire::datapath::loopback::Loopback;
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{
    recv_tensor, send_tensor, MissingFill, Receiver, RecvOptions, RecvReport, SendOptions, Sender,
    TransferConfig, TransferError,
};

const SIZE: usize = 64 << 20;

fn sender_tensor() -> Tensor {
    let mut t = Tensor::zeros(DType::F32, SIZE / 4);
    t.fill_pattern(0xfeed);
    t
}

/// Check the bound, byte equality of delivered segments and the fill of missing ones.
fn check(report: &RecvReport, sent: &Tensor, got: &Tensor, before: u8, bound: f64) {
    assert!(
        report.delivered_fraction >= 1.0 - bound - 1e-12,
        "delivered {} < 1 - {bound}",
        report.delivered_fraction
    );
    assert_eq!(report.received_segments, report.bitmap.count_ones());
    let (s, g) = (sent.as_bytes(), got.as_bytes());
    for i in 0..report.segments {
        let (off, len) = report.layout.segment(i).unwrap();
        let r = off as usize..off as usize + len;
        if report.bitmap.get(i) {
            assert!(
                s[r.clone()] == g[r],
                "segment {i} differs from the sender's bytes"
            );
        } else {
            let want = match report.fill {
                MissingFill::Zero => 0,
                MissingFill::Keep => before,
            };
            assert!(
                g[r].iter().all(|&b| b == want),
                "missing segment {i} not filled with {want}"
            );
        }
    }
}

fn addrs() -> (SocketAddr, SocketAddr) {
    (
        "198.18.0.1:7000".parse().unwrap(),
        "198.18.0.2:7000".parse().unwrap(),
    )
}

/// One loopback transfer with faults on the receive side.
fn loopback_case(faults: FaultConfig, bound: f64, fill: MissingFill) -> RecvReport {
    let (a, b) = addrs();
    let (mut tx, rx) = Loopback::pair(a, b, 1472, 1 << 16);
    let mut rx = FaultInjector::new(rx, faults).unwrap();
    transfer_over(&mut tx, &mut rx, b, bound, fill)
}

/// One 64 MiB transfer from `tx` to `rx` (receiver at `to`) over an in-memory control
/// channel, checked byte by byte against the bound.
fn transfer_over<T: Datapath + Send, R: Datapath>(
    tx: &mut T,
    rx: &mut R,
    to: SocketAddr,
    bound: f64,
    fill: MissingFill,
) -> RecvReport {
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    let sent = sender_tensor();
    let before = 0xAB;
    let mut got = Tensor::zeros(DType::F32, SIZE / 4);
    got.as_bytes_mut().fill(before);
    let bound_lb = LossBound::from_fraction(bound).unwrap();
    let opts = SendOptions {
        loss_bound: Some(bound_lb),
        ..SendOptions::new(3, 17)
    };
    let ropts = RecvOptions {
        fill,
        ..RecvOptions::new(3, 17)
    };
    let prio = fixed_priority(Tag {
        dscp: 10,
        ect: true,
    });
    let report = std::thread::scope(|s| {
        let c = cfg.clone();
        let sent = &sent;
        let h = s.spawn(move || send_tensor(tx, &mut ca, to.ip(), sent, &opts, &prio, &c));
        let r = recv_tensor(rx, &mut cb, &mut got, &ropts, &cfg).unwrap();
        let sr = h.join().unwrap().unwrap();
        assert_eq!(sr.segments, r.segments);
        assert!(sr.stats.packets >= u64::from(r.received_segments));
        r
    });
    check(&report, &sent, &got, before, bound);
    report
}

#[test]
fn loopback_no_loss() {
    let r = loopback_case(FaultConfig::default(), 0.01, MissingFill::Zero);
    assert_eq!(r.rounds, 0);
    assert!(r.delivered_fraction >= 0.99);
}

#[test]
fn loopback_1pct_loss_with_reorder_and_duplicates() {
    let f = FaultConfig {
        drop: 0.01,
        reorder: 0.05,
        duplicate: 0.02,
        seed: 1,
        ..FaultConfig::default()
    };
    let r = loopback_case(f, 0.005, MissingFill::Keep);
    assert!(r.stats.duplicates > 0);
}

#[test]
fn loopback_5pct_loss_bound_1pct_needs_retransmission() {
    let f = FaultConfig {
        drop: 0.05,
        reorder: 0.05,
        duplicate: 0.01,
        seed: 2,
        ..FaultConfig::default()
    };
    let r = loopback_case(f, 0.01, MissingFill::Zero);
    assert!(
        r.rounds >= 1,
        "5% loss cannot meet a 1% bound without retransmission"
    );
}

#[test]
fn loopback_20pct_loss_bound_10pct() {
    let f = FaultConfig {
        drop: 0.20,
        reorder: 0.05,
        duplicate: 0.01,
        seed: 3,
        ..FaultConfig::default()
    };
    let r = loopback_case(f, 0.10, MissingFill::Keep);
    assert!(r.rounds >= 1);
}

#[test]
fn loopback_reliable_with_5pct_loss_delivers_everything() {
    let f = FaultConfig {
        drop: 0.05,
        reorder: 0.05,
        duplicate: 0.01,
        seed: 4,
        ..FaultConfig::default()
    };
    let r = loopback_case(f, 0.0, MissingFill::Zero);
    assert_eq!(r.received_segments, r.segments);
    assert_eq!(r.delivered_fraction, 1.0);
}

/// The same over kernel UDP sockets on 127.0.0.1 with a real TCP control channel.
fn udp_case(faults: FaultConfig, bound: f64) -> RecvReport {
    let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let listener = gradwire::ctrl_listener::CtrlListener::bind(
        lo,
        gradwire::ctrl_listener::ListenerConfig::default(),
    )
    .unwrap();
    let ctrl_addr = listener.local_addr();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        sender: gradwire::flow::SenderConfig::new(5_000_000_000),
        ..TransferConfig::default()
    };
    let sent = sender_tensor();
    let mut got = Tensor::zeros(DType::F32, SIZE / 4);
    got.as_bytes_mut().fill(0x5A);
    let opts = SendOptions {
        loss_bound: Some(LossBound::from_fraction(bound).unwrap()),
        ..SendOptions::new(9, 1)
    };
    let prio = fixed_priority(Tag {
        dscp: 26,
        ect: false,
    });
    std::thread::scope(|s| {
        let c = cfg.clone();
        let sent = &sent;
        let h = s.spawn(move || {
            let dp = UdpDatapath::bind(lo, UdpConfig::default()).unwrap();
            let mut tx = Sender::connect(ctrl_addr, dp, c).unwrap();
            tx.send(sent, &opts, &prio)
        });
        let dp = UdpDatapath::bind(lo, UdpConfig::default()).unwrap();
        let dp = FaultInjector::new(dp, faults).unwrap();
        let mut rx = Receiver::accept(&listener, dp, cfg.clone()).unwrap();
        let r = rx.recv(&mut got, &RecvOptions::new(9, 1)).unwrap();
        h.join().unwrap().unwrap();
        check(&r, sent, &got, 0x5A, bound);
        r
    })
}

/// Loss plus reordering and duplication on the receive side, as in the loopback cases.
fn udp_faults(drop: f64, seed: u64) -> FaultConfig {
    FaultConfig {
        drop,
        reorder: 0.05,
        duplicate: 0.01,
        seed,
        ..FaultConfig::default()
    }
}

#[test]
fn udp_no_injected_loss() {
    udp_case(FaultConfig::default(), 0.01);
}

#[test]
fn udp_1pct_loss_with_reorder_and_duplicates() {
    let r = udp_case(udp_faults(0.01, 21), 0.005);
    assert!(r.stats.duplicates > 0);
}

#[test]
fn udp_5pct_loss_bound_1pct() {
    let r = udp_case(udp_faults(0.05, 22), 0.01);
    assert!(r.rounds >= 1);
}

#[test]
fn udp_20pct_loss_bound_10pct() {
    let r = udp_case(udp_faults(0.20, 23), 0.10);
    assert!(r.rounds >= 1);
}

#[test]
fn udp_reliable_with_5pct_loss_delivers_everything() {
    let r = udp_case(udp_faults(0.05, 24), 0.0);
    assert_eq!(r.received_segments, r.segments);
}

#[test]
fn receiver_rejects_wrong_size_with_clear_error() {
    let (a, b) = addrs();
    let (mut tx, mut rx) = Loopback::pair(a, b, 1472, 1024);
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig::default();
    let sent = Tensor::zeros(DType::F32, 1000);
    let mut got = Tensor::zeros(DType::F32, 999);
    let prio = fixed_priority(Tag {
        dscp: 0,
        ect: false,
    });
    std::thread::scope(|s| {
        let c = cfg.clone();
        let h = s.spawn(move || {
            send_tensor(
                &mut tx,
                &mut ca,
                b.ip(),
                &sent,
                &SendOptions::new(1, 1),
                &prio,
                &c,
            )
        });
        let e = recv_tensor(&mut rx, &mut cb, &mut got, &RecvOptions::new(1, 1), &cfg).unwrap_err();
        assert!(
            e.to_string()
                .contains("4000 bytes offered, 3996 bytes registered"),
            "{e}"
        );
        let e = h.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("SizeMismatch"), "{e}");
    });
}

#[test]
fn sender_that_disappears_mid_transfer_is_an_error_not_a_hang() {
    let (a, b) = addrs();
    let (mut tx, mut rx) = Loopback::pair(a, b, 1472, 1 << 16);
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_millis(300),
        ..TransferConfig::default()
    };
    let mut got = Tensor::zeros(DType::F32, 1 << 20);
    // A "sender" that does the rendezvous, sends a few segments and then goes silent (its
    // ends stay open, so only the idle timeout can notice).
    let sent = sender_tensor();
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            use gradwire::ctrl_channel::CtrlChannel;
            use gradwire::message::CtrlMsg;
            let mut small = Tensor::zeros(DType::F32, 1 << 20);
            small
                .as_bytes_mut()
                .copy_from_slice(&sent.as_bytes()[..4 << 20]);
            let layout = gradwire::tensor::SegmentLayout::for_tensor(&small, 1500, false).unwrap();
            ca.send(&CtrlMsg::FlowStart(gradwire::message::FlowStart {
                job_id: 1,
                tensor_id: 2,
                round: 0,
                layer: 0,
                dtype_code: DType::F32.code(),
                size_bytes: small.len_bytes() as u64,
                segment_payload: layout.segment_payload() as u32,
                segment_count: layout.count(),
                loss_bound: LossBound::RELIABLE,
                stage: gradwire::message::Stage::Push,
                priority: 0,
                flow_nonce: [0; 16],
                sources: vec![gradwire::message::DataSource::single(a)],
            }))
            .unwrap();
            assert!(matches!(
                ca.recv(Duration::from_secs(5)).unwrap(),
                Some(CtrlMsg::FlowAccept { .. })
            ));
            // The flow's share of the receiver's capacity follows the acceptance.
            assert!(matches!(
                ca.recv(Duration::from_secs(5)).unwrap(),
                Some(CtrlMsg::RateGrant { .. })
            ));
            let _ = tx.send(0, &mut |_: &mut [u8]| None);
            // The receiver gives up after its idle timeout and tells us why.
            match ca.recv(Duration::from_secs(3)).unwrap() {
                Some(CtrlMsg::Abort { code, reason }) => {
                    assert_eq!(code, gradwire::transport::abort_code::STALLED);
                    assert!(reason.contains("stalled"), "{reason}");
                }
                other => panic!("expected Abort, got {other:?}"),
            }
            drop(ca);
        });
        let e = recv_tensor(&mut rx, &mut cb, &mut got, &RecvOptions::new(1, 2), &cfg).unwrap_err();
        assert!(matches!(e, TransferError::Stalled { .. }), "{e}");
        assert!(e.to_string().contains("stalled"), "{e}");
    });
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn receiver_that_disconnects_is_a_clear_error() {
    let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let listener = TcpListener::bind(lo).unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(2),
        ..TransferConfig::default()
    };
    let h = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let mut s = gradwire::ctrl_channel::TcpCtrl::accept_handshake(
            s,
            None,
            None,
            Duration::from_secs(10),
        )
        .unwrap();
        // Disconnect once the sender has started the transfer (its FlowStart arrived), not
        // after some time: closing with the request unread resets the connection.
        use gradwire::ctrl_channel::CtrlChannel;
        assert!(s.recv(Duration::from_secs(10)).unwrap().is_some());
        drop(s);
    });
    let dp = UdpDatapath::bind(lo, UdpConfig::default()).unwrap();
    let mut tx = Sender::connect(addr, dp, cfg).unwrap();
    let t = Tensor::zeros(DType::F32, 1000);
    let e = tx
        .send(
            &t,
            &SendOptions::new(1, 1),
            &fixed_priority(Tag {
                dscp: 0,
                ect: false,
            }),
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("closed by the peer") || e.to_string().contains("reset"),
        "{e}"
    );
    h.join().unwrap();
    assert_eq!(tx.datapath().stats().tx_packets, 0);
}

#[test]
fn protocol_violation_aborts_with_a_reason_the_peer_sees() {
    use gradwire::ctrl_channel::CtrlChannel;
    use gradwire::message::CtrlMsg;
    let (a, b) = addrs();
    let (_tx, mut rx) = Loopback::pair(a, b, 1472, 1024);
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig::default();
    let mut got = Tensor::zeros(DType::F32, 1000);
    std::thread::scope(|s| {
        s.spawn(|| {
            let t = Tensor::zeros(DType::F32, 1000);
            let layout = gradwire::tensor::SegmentLayout::for_tensor(&t, 1500, false).unwrap();
            ca.send(&CtrlMsg::FlowStart(gradwire::message::FlowStart {
                job_id: 1,
                tensor_id: 2,
                round: 0,
                layer: 0,
                dtype_code: DType::F32.code(),
                size_bytes: 4000,
                segment_payload: layout.segment_payload() as u32,
                segment_count: layout.count(),
                loss_bound: LossBound::RELIABLE,
                stage: gradwire::message::Stage::Push,
                priority: 0,
                flow_nonce: [0; 16],
                sources: vec![gradwire::message::DataSource::single(a)],
            }))
            .unwrap();
            assert!(matches!(
                ca.recv(Duration::from_secs(5)).unwrap(),
                Some(CtrlMsg::FlowAccept { .. })
            ));
            // The flow's share of the receiver's capacity follows the acceptance.
            assert!(matches!(
                ca.recv(Duration::from_secs(5)).unwrap(),
                Some(CtrlMsg::RateGrant { .. })
            ));
            // FinishConfirm before any FlowFinish: a protocol violation.
            ca.send(&CtrlMsg::FinishConfirm).unwrap();
            match ca.recv(Duration::from_secs(5)).unwrap() {
                Some(CtrlMsg::Abort { code, reason }) => {
                    assert_eq!(code, gradwire::transport::abort_code::PROTOCOL);
                    assert!(reason.contains("unexpected FinishConfirm"), "{reason}");
                }
                other => panic!("expected Abort, got {other:?}"),
            }
        });
        let e = recv_tensor(&mut rx, &mut cb, &mut got, &RecvOptions::new(1, 2), &cfg).unwrap_err();
        assert!(e.to_string().contains("unexpected FinishConfirm"), "{e}");
    });
}

/// A whole tensor over two paths at once (host-side multipath, one datapath per path), with
/// loss and reordering on one of them: every datagram alternates paths, everything the bound
/// needs arrives, every byte is right.
#[test]
fn multipath_round_robin_transfer() {
    use gradwire::datapath::multipath::MultiPath;
    let (a, b) = addrs();
    let (a2, b2): (SocketAddr, SocketAddr) = (
        "198.18.1.1:7000".parse().unwrap(),
        "198.18.1.2:7000".parse().unwrap(),
    );
    let (tx1, rx1) = Loopback::pair(a, b, 1472, 1 << 15);
    let (tx2, rx2) = Loopback::pair(a2, b2, 1472, 1 << 15);
    let lossy = FaultInjector::new(
        rx2,
        FaultConfig {
            drop: 0.02,
            reorder: 0.05,
            ..FaultConfig::default()
        },
    )
    .unwrap();
    let mut tx = MultiPath::new(vec![Box::new(tx1), Box::new(tx2)], 1).unwrap();
    let mut rx = MultiPath::new(vec![Box::new(rx1), Box::new(lossy)], 1).unwrap();
    let report = transfer_over(&mut tx, &mut rx, b, 0.005, MissingFill::Zero);
    let per = tx.sent_per_path();
    let total = per[0] + per[1];
    assert!(
        per[0].abs_diff(per[1]) <= 1 + total / 100,
        "uneven split {per:?}"
    );
    assert!(
        report.rounds >= 1,
        "2 % loss on one path needs a retransmission round"
    );
    // Both paths' sources were announced: nothing from the second path was foreign.
    assert_eq!(report.rejected.foreign_source, 0, "{}", report.rejected);
    assert_eq!(tx.data_sources().len(), 2);
}

/// One transfer of a 4 MiB tensor over the loopback datapath with `drop` random loss at the
/// receiver, with no explicit loss bound on either side, in `stage`.
fn default_bound_case(stage: gradwire::message::Stage, drop: f64) -> RecvReport {
    let (a, b) = addrs();
    let (mut tx, rx) = Loopback::pair(a, b, 1472, 1 << 16);
    let mut rx = FaultInjector::new(rx, FaultConfig::loss(drop)).unwrap();
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    let elems = (4 << 20) / 4;
    let mut sent = Tensor::zeros(DType::F32, elems);
    sent.fill_pattern(0xdef);
    let mut got = Tensor::zeros(DType::F32, elems);
    let opts = SendOptions {
        stage,
        ..SendOptions::new(5, 6)
    };
    assert_eq!(opts.loss_bound, None, "no explicit bound");
    let ropts = RecvOptions::new(5, 6);
    assert_eq!(ropts.loss_bound, None, "no explicit bound");
    let prio = fixed_priority(Tag {
        dscp: 10,
        ect: true,
    });
    let report = std::thread::scope(|s| {
        let c = cfg.clone();
        let sent = &sent;
        let h = s.spawn(move || send_tensor(&mut tx, &mut ca, b.ip(), sent, &opts, &prio, &c));
        let r = recv_tensor(&mut rx, &mut cb, &mut got, &ropts, &cfg).unwrap();
        h.join().unwrap().unwrap();
        r
    });
    check(&report, &sent, &got, 0, report.loss_bound);
    report
}

#[test]
fn transfers_without_a_bound_use_the_documented_stage_defaults() {
    use gradwire::message::Stage;
    // docs/protocol.md: "the library defaults (`LossDefaults`), used when the sender gives no
    // explicit bound, are push 10 % (100 000 ppm), pull 1 % (10 000 ppm)".
    let d = gradwire::flow::LossDefaults::default();
    assert_eq!(d.push, LossBound::from_ppm(100_000).unwrap());
    assert_eq!(d.pull, LossBound::from_ppm(10_000).unwrap());
    assert_eq!(TransferConfig::default().loss_defaults, d);

    // 5 % loss: within push's 10 %, so the first pass is enough; beyond pull's 1 %, so a pull
    // needs retransmission. The receiver reports the bound it enforced.
    let push = default_bound_case(Stage::Push, 0.05);
    assert_eq!(push.loss_bound, 0.10, "push default");
    assert!(push.delivered_fraction >= 0.90);
    assert_eq!(push.rounds, 0, "5% loss meets a 10% bound in one pass");
    assert!(push.delivered_fraction < 1.0, "the loss was not repaired");

    let pull = default_bound_case(Stage::Pull, 0.05);
    assert_eq!(pull.loss_bound, 0.01, "pull default");
    assert!(pull.delivered_fraction >= 0.99);
    assert!(
        pull.rounds >= 1,
        "5% loss cannot meet 1% without retransmission"
    );
}

/// The receiver's datapath, wrapped: tells `drained` (once) when a receive call comes back
/// empty after at least `expect` datagrams went through, i.e. the receiver has read every
/// datagram that was waiting.
struct DrainProbe<D> {
    inner: D,
    seen: usize,
    expect: usize,
    drained: Option<std::sync::mpsc::Sender<usize>>,
}

impl<D: Datapath> Datapath for DrainProbe<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }
    fn max_datagram(&self) -> usize {
        self.inner.max_datagram()
    }
    fn send(
        &mut self,
        max: usize,
        fill: &mut gradwire::datapath::Fill<'_>,
    ) -> Result<usize, gradwire::datapath::DatapathError> {
        self.inner.send(max, fill)
    }
    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut gradwire::datapath::Deliver<'_>,
    ) -> Result<usize, gradwire::datapath::DatapathError> {
        let n = self.inner.recv(max, timeout, deliver)?;
        self.seen += n;
        if n == 0 && self.seen >= self.expect {
            if let Some(tx) = self.drained.take() {
                let _ = tx.send(self.seen);
            }
        }
        Ok(n)
    }
    fn stats(&self) -> gradwire::datapath::DatapathStats {
        self.inner.stats()
    }
}

#[test]
fn late_packets_of_the_previous_flow_are_dropped_as_stale() {
    // docs/protocol.md: late packets of a finished flow still queued when the next receive
    // starts are drained as `stale_round` before its FlowStart; after it they fail the round
    // check (also `stale_round`); they never touch the tensor.
    const LATE: usize = 100;
    let (a, b) = addrs();
    let (tx, rx) = Loopback::pair(a, b, 1472, 1 << 16);
    let mut tx = Recorder::new(tx);
    let mut rx = DrainProbe {
        inner: rx,
        seen: 0,
        expect: usize::MAX,
        drained: None,
    };
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    let prio = fixed_priority(Tag {
        dscp: 10,
        ect: true,
    });
    let elems = (1 << 20) / 4;
    let tensor = |round: u32| {
        let mut t = Tensor::zeros(DType::F32, elems);
        t.fill_pattern(u64::from(round) + 100);
        t
    };
    let round_opts = |round: u32| {
        (
            SendOptions {
                round,
                loss_bound: Some(LossBound::RELIABLE),
                ..SendOptions::new(7, 8)
            },
            RecvOptions {
                round: Some(round),
                ..RecvOptions::new(7, 8)
            },
        )
    };

    // Flow N (round 0), recorded.
    let (sopts, ropts) = round_opts(0);
    let first = tensor(0);
    let mut got = Tensor::zeros(DType::F32, elems);
    let r0 = std::thread::scope(|s| {
        let (tx, ca, c, first, prio) = (&mut tx, &mut ca, cfg.clone(), &first, &prio);
        let h = s.spawn(move || send_tensor(tx, ca, b.ip(), first, &sopts, prio, &c));
        let r = recv_tensor(&mut rx, &mut cb, &mut got, &ropts, &cfg).unwrap();
        h.join().unwrap().unwrap();
        r
    });
    assert_eq!(r0.rejected.stale_round, 0);
    assert!(got.as_bytes() == first.as_bytes());
    assert!(tx.recorded.lock().unwrap().len() >= 2 * LATE);

    // Late packets of flow N: LATE queued before flow N+1 starts, LATE more arriving in the
    // middle of it (played back ahead of the sender's first batch of data, so after FlowStart).
    let mut late = tx.take_recorded();
    late.truncate(2 * LATE);
    tx.replay = late.split_off(LATE);
    tx.send_raw(late);

    // Flow N+1 (round 1): the sender starts only once the receiver has drained the queue
    // while waiting for FlowStart, so both paths are taken, in this order.
    let (sopts, ropts) = round_opts(1);
    let second = tensor(1);
    let mut got = Tensor::zeros(DType::F32, elems);
    got.as_bytes_mut().fill(0xAB);
    let (drained_tx, drained_rx) = std::sync::mpsc::channel();
    rx.seen = 0;
    rx.expect = LATE;
    rx.drained = Some(drained_tx);
    let r1 = std::thread::scope(|s| {
        let (tx, ca, c, second, prio) = (&mut tx, &mut ca, cfg.clone(), &second, &prio);
        let h = s.spawn(move || {
            let n = drained_rx
                .recv_timeout(Duration::from_secs(10))
                .expect("the receiver never drained the late packets");
            assert_eq!(n, LATE, "only the late packets were queued");
            send_tensor(tx, ca, b.ip(), second, &sopts, prio, &c)
        });
        let r = recv_tensor(&mut rx, &mut cb, &mut got, &ropts, &cfg).unwrap();
        h.join().unwrap().unwrap();
        r
    });
    assert!(tx.replay.is_empty(), "the late packets were played back");
    assert_eq!(
        r1.rejected,
        gradwire::flow::RejectCounts {
            stale_round: 2 * LATE as u64,
            ..Default::default()
        },
        "every late packet, and nothing else, refused as stale"
    );
    assert_eq!(r1.received_segments, r1.segments);
    assert!(
        got.as_bytes() == second.as_bytes(),
        "flow N+1's tensor is exactly its sender's"
    );
}

/// A receiver that lets the sender size the flow (`max_bytes`) gets a tensor of the
/// announced size with the sender's bytes; a flow above its bound is rejected before
/// anything is allocated, and the receiver keeps its tensor.
#[test]
fn a_sender_sized_flow_is_accepted_up_to_the_bound() {
    let (a, b) = addrs();
    let (mut tx, mut rx) = Loopback::pair(a, b, 1472, 1 << 16);
    let (mut ca, mut cb) = MemCtrl::pair();
    let cfg = TransferConfig {
        idle_timeout: Duration::from_secs(5),
        ..TransferConfig::default()
    };
    let prio = fixed_priority(Tag {
        dscp: 10,
        ect: true,
    });
    let ropts = RecvOptions {
        loss_bound: Some(LossBound::RELIABLE),
        max_bytes: Some(8192),
        ..RecvOptions::new(4, 9)
    };
    let sopts = SendOptions {
        loss_bound: Some(LossBound::RELIABLE),
        ..SendOptions::new(4, 9)
    };
    for bytes in [3000usize, 8192, 1] {
        let mut sent = Tensor::zeros(DType::Raw, bytes);
        sent.fill_pattern(bytes as u64);
        let mut got = Tensor::zeros(DType::Raw, 0);
        std::thread::scope(|s| {
            let (tx, ca, c, sent, prio, sopts) =
                (&mut tx, &mut ca, cfg.clone(), &sent, &prio, &sopts);
            let h = s.spawn(move || send_tensor(tx, ca, b.ip(), sent, sopts, prio, &c));
            recv_tensor(&mut rx, &mut cb, &mut got, &ropts, &cfg).unwrap();
            h.join().unwrap().unwrap();
        });
        assert_eq!(got.len_bytes(), bytes);
        assert!(got.as_bytes() == sent.as_bytes(), "{bytes} bytes differ");
    }
    // Above the bound: rejected on both sides, the receiver's tensor untouched.
    let sent = Tensor::zeros(DType::Raw, 8193);
    let mut got = Tensor::zeros(DType::Raw, 16);
    std::thread::scope(|s| {
        let (tx, ca, c, sent, prio, sopts) = (&mut tx, &mut ca, cfg.clone(), &sent, &prio, &sopts);
        let h = s.spawn(move || send_tensor(tx, ca, b.ip(), sent, sopts, prio, &c));
        assert!(recv_tensor(&mut rx, &mut cb, &mut got, &ropts, &cfg).is_err());
        assert!(h.join().unwrap().is_err());
    });
    assert_eq!(got.len_bytes(), 16);
}
