//! Deterministic tests of the two protocol cores driven directly: a virtual clock, and the
//! test decides exactly which segments are lost.

use crate::message::{
    CtrlMsg, DataSource, FlowStart, LossBound, QueueEcn, RejectCode, SegRange, Stage, ECN_QUEUES,
};
use crate::rate::{RateConfig, RateMode, RateState};
use crate::tensor::{DType, PlaceError, SegmentLayout, Tensor};
use crate::wire::header;

use super::receiver::ReceiverPhase;
use super::sender::SenderPhase;
use super::*;

const ID: FlowId = FlowId {
    job: 7,
    tensor: 3,
    round: 11,
};
const MS: u64 = 1_000_000;
/// The sender's data source in these tests.
const SENDER: std::net::SocketAddr = std::net::SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 0, 1)),
    5000,
);

fn layout(elems: usize) -> SegmentLayout {
    SegmentLayout::new(elems as u64 * 4, 4, 1440).unwrap()
}

fn spec(elems: usize, bound: Option<LossBound>) -> RecvSpec {
    RecvSpec {
        job: ID.job,
        tensor: ID.tensor,
        round: None,
        dtype: DType::F32,
        size_bytes: elems as u64 * 4,
        max_payload: 1440,
        loss_bound: bound,
    }
}

fn bound(p: f64) -> LossBound {
    LossBound::from_fraction(p).unwrap()
}

struct Pair {
    s: SenderFlow,
    r: ReceiverFlow,
    src: Tensor,
    dst: Tensor,
    now: u64,
}

impl Pair {
    /// Rendezvous for a tensor of `elems` f32 with sender bound `p`, the sender in DLCP's
    /// Figure 7 mode (the rate tests below are about that machine; grant mode has its own).
    fn new(elems: usize, p: f64) -> Pair {
        Pair::with_mode(elems, p, RateMode::Fig7)
    }

    fn with_mode(elems: usize, p: f64, mode: RateMode) -> Pair {
        let mut src = Tensor::zeros(DType::F32, elems);
        src.fill_pattern(1);
        let cfg = SenderConfig::with_mode(mode, 10_000_000_000);
        let (mut s, start) = SenderFlow::new(
            ID,
            layout(elems),
            DType::F32,
            2,
            bound(p),
            Stage::Push,
            DataOrigin::single(SENDER),
            &cfg,
            0,
        );
        let CtrlMsg::FlowStart(fs) = start else {
            panic!("not a FlowStart")
        };
        assert_eq!(fs.segment_count, layout(elems).count());
        let (r, accept) =
            ReceiverFlow::accept(&fs, &spec(elems, None), SENDER.ip(), 6000, 200_000, 0).unwrap();
        assert_eq!(s.on_ctrl(accept, 0).unwrap(), None);
        assert_eq!(s.phase(), SenderPhase::Sending);
        assert_eq!(s.data_port(), Some(6000));
        Pair {
            s,
            r,
            dst: Tensor::zeros(DType::F32, elems),
            src,
            now: 0,
        }
    }

    /// The datagram of segment `repr` with the source's bytes, counted as sent now.
    fn emit_sent(&mut self, repr: &header::Repr) -> Vec<u8> {
        let (off, len) = (repr.offset as usize, repr.length as usize);
        let mut buf = vec![0u8; header::HEADER_LEN + len];
        let mut pkt = header::Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut pkt).unwrap();
        pkt.payload_mut()
            .copy_from_slice(&self.src.as_bytes()[off..off + len]);
        self.s.on_sent(1, len as u64, self.now);
        buf
    }

    /// Send the rest of the current pass; segments for which `lose(index)` is true vanish.
    /// Stops early (like the driver) if the receiver finishes. Returns the receiver's
    /// messages in order.
    fn pass(&mut self, mut lose: impl FnMut(u32) -> bool) -> Vec<CtrlMsg> {
        let mut to_sender = Vec::new();
        while let Some((index, repr)) = self.s.next_segment() {
            self.now += 1000;
            let buf = self.emit_sent(&repr);
            if !lose(index) {
                let pkt = header::Packet::new_checked(&buf[..]).unwrap();
                let repr = header::Repr::parse(&pkt).unwrap();
                self.r
                    .on_data(
                        &repr,
                        pkt.payload(),
                        self.dst.as_bytes_mut(),
                        // DSCP 46 (queue 6), every third packet CE-marked by a switch.
                        46 << 2 | if index % 3 == 0 { 3 } else { 2 },
                        self.now,
                    )
                    .unwrap();
            }
            while let Some(m) = self.r.poll(self.now) {
                if matches!(m, CtrlMsg::FlowFinish { .. }) {
                    let reply = self.s.on_ctrl(m.clone(), self.now).unwrap();
                    assert_eq!(reply, Some(CtrlMsg::FinishConfirm));
                    to_sender.push(m);
                    return to_sender;
                }
                to_sender.push(m);
            }
        }
        if let Some(stop) = self.s.poll_pass_end() {
            assert_eq!(self.s.phase(), SenderPhase::AwaitVerdict);
            // FlowStop arrives 10 us after the pass's last packet (ten of its 1 us gaps): the
            // arrivals have paused, so the receiver answers at once.
            self.now += 10_000;
            if let Some(reply) = self.r.on_ctrl(stop, self.now).unwrap() {
                to_sender.push(reply);
            }
            while let Some(m) = self.r.poll(self.now) {
                to_sender.push(m);
            }
        }
        to_sender
    }

    fn assert_bytes_match(&self) {
        let l = *self.r.layout();
        for i in 0..l.count() {
            let (off, len) = l.segment(i).unwrap();
            let r = off as usize..off as usize + len;
            if self.r.bitmap().get(i) {
                assert_eq!(self.src.as_bytes()[r.clone()], self.dst.as_bytes()[r]);
            } else {
                assert!(self.dst.as_bytes()[r].iter().all(|&b| b == 0));
            }
        }
    }
}

#[test]
fn clean_network_finishes_as_soon_as_bound_is_met() {
    // 100 segments, bound 5%: FlowFinish after the 95th segment; the sender stops mid-pass.
    let mut p = Pair::new(36_000, 0.05);
    assert_eq!(p.r.layout().count(), 100);
    let msgs = p.pass(|_| false);
    assert_eq!(
        msgs.last(),
        Some(&CtrlMsg::FlowFinish {
            received_segments: 95
        })
    );
    assert_eq!(p.s.phase(), SenderPhase::Done);
    assert_eq!(p.s.stats().packets, 95);
    assert_eq!(p.r.phase(), ReceiverPhase::FinishSent);
    assert_eq!(p.r.on_ctrl(CtrlMsg::FinishConfirm, p.now).unwrap(), None);
    assert!(p.r.is_done());
    p.assert_bytes_match();
}

#[test]
fn loss_above_bound_requests_exactly_the_missing_ranges() {
    let mut p = Pair::new(36_000, 0.01);
    let lost = [3u32, 4, 5, 50, 98, 99];
    let msgs = p.pass(|i| lost.contains(&i));
    let req = msgs
        .iter()
        .find(|m| matches!(m, CtrlMsg::RetransmitRequest { .. }))
        .unwrap();
    assert_eq!(
        req,
        &CtrlMsg::RetransmitRequest {
            pass: 0,
            ranges: vec![
                SegRange { start: 3, len: 3 },
                SegRange { start: 50, len: 1 },
                SegRange { start: 98, len: 2 }
            ]
        }
    );
    assert_eq!(p.s.on_ctrl(req.clone(), p.now).unwrap(), None);
    assert_eq!(p.s.phase(), SenderPhase::Sending);
    assert_eq!(p.s.rate_state(), RateState::LineRateStart);
    // Second pass: only the six, flagged as retransmissions, in pass 1. 1% of 100 = 1
    // segment may be missing, so the receiver finishes after five of them.
    let (idx, repr) = p.s.next_segment().unwrap();
    assert_eq!((idx, repr.pass), (3, 1));
    assert!(repr.flags.contains(header::Flags::RETRANSMIT));
    // Put it back by replaying the pass from a fresh view: deliver that one too.
    let mut buf = vec![0u8; 32 + 1440];
    let mut pkt = header::Packet::new_unchecked(&mut buf[..]);
    repr.emit(&mut pkt).unwrap();
    pkt.payload_mut()
        .copy_from_slice(&p.src.as_bytes()[3 * 1440..4 * 1440]);
    let pkt = header::Packet::new_checked(&buf[..]).unwrap();
    assert_eq!(
        p.r.on_data(&repr, pkt.payload(), p.dst.as_bytes_mut(), 0, p.now),
        Ok(true)
    );
    let msgs = p.pass(|_| false);
    assert_eq!(
        msgs.last(),
        Some(&CtrlMsg::FlowFinish {
            received_segments: 99
        })
    );
    assert_eq!(p.s.stats().passes, 2);
    assert_eq!(
        p.s.stats().retransmitted,
        4,
        "three more sent in pass 1 via pass(), one by hand"
    );
    assert_eq!(p.r.stats().retransmit_requests, 1);
    p.assert_bytes_match();
}

#[test]
fn reliable_bound_repeats_rounds_until_everything_arrived() {
    let mut p = Pair::new(36_000, 0.0);
    let mut round = 0;
    loop {
        // Each pass loses every other segment it carries.
        let mut k = 0;
        let msgs = p.pass(|_| {
            k += 1;
            k % 2 == 0
        });
        match msgs
            .iter()
            .find(|m| !matches!(m, CtrlMsg::RateReport { .. } | CtrlMsg::EcnReport { .. }))
        {
            Some(CtrlMsg::RetransmitRequest { pass, ranges }) => {
                assert_eq!(*pass, round);
                let again = CtrlMsg::RetransmitRequest {
                    pass: *pass,
                    ranges: ranges.clone(),
                };
                p.s.on_ctrl(again, p.now).unwrap();
                round += 1;
            }
            Some(CtrlMsg::FlowFinish { received_segments }) => {
                assert_eq!(*received_segments, 100);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(round < 20);
    }
    assert!(
        round >= 6,
        "halving the missing set each round needs ~7 rounds, got {round}"
    );
    assert_eq!(p.r.bitmap().count_ones(), 100);
    p.assert_bytes_match();
}

#[test]
fn duplicates_and_reordering_are_harmless() {
    let mut p = Pair::new(3600, 0.0);
    let mut pkts = Vec::new();
    while let Some((_, repr)) = p.s.next_segment() {
        let (off, len) = (repr.offset as usize, repr.length as usize);
        let mut buf = vec![0u8; 32 + len];
        let mut pkt = header::Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut pkt).unwrap();
        pkt.payload_mut()
            .copy_from_slice(&p.src.as_bytes()[off..off + len]);
        pkts.push(buf);
    }
    assert_eq!(pkts.len(), 10);
    let order = [9usize, 0, 9, 5, 1, 1, 2, 8, 3, 4, 6, 7, 0];
    let mut fresh = 0;
    for &i in &order {
        let pkt = header::Packet::new_checked(&pkts[i][..]).unwrap();
        let repr = header::Repr::parse(&pkt).unwrap();
        fresh += usize::from(
            p.r.on_data(&repr, pkt.payload(), p.dst.as_bytes_mut(), 0, 1)
                .unwrap(),
        );
    }
    assert_eq!(fresh, 10);
    assert_eq!(p.r.stats().duplicates, 3);
    assert_eq!(p.dst.as_bytes(), p.src.as_bytes());
    // 13 packets with TOS 0 (queue 0), none CE: reported before FlowFinish.
    let mut want = [QueueEcn::default(); ECN_QUEUES];
    want[0].packets = 13;
    assert_eq!(p.r.poll(2), Some(CtrlMsg::EcnReport { queues: want }));
    assert_eq!(
        p.r.poll(2),
        Some(CtrlMsg::FlowFinish {
            received_segments: 10
        })
    );
}

#[test]
fn ecn_counts_per_queue_reach_the_sender() {
    let mut p = Pair::new(36_000, 0.5);
    let msgs = p.pass(|_| false);
    // Every packet carried DSCP 46 (queue 6); the pair marks every third one CE.
    let reports: Vec<&CtrlMsg> = msgs
        .iter()
        .filter(|m| matches!(m, CtrlMsg::EcnReport { .. }))
        .collect();
    let Some(CtrlMsg::EcnReport { queues }) = reports.last() else {
        panic!("no EcnReport in {msgs:?}");
    };
    let n = p.r.stats().placed as u32;
    assert_eq!(queues[6].packets, n);
    assert_eq!(queues[6].ce, n.div_ceil(3));
    assert!(queues
        .iter()
        .enumerate()
        .all(|(q, e)| q == 6 || e.packets == 0));
    assert_eq!(p.r.stats().ecn, *queues);
    // The final report precedes FlowFinish.
    let fin = msgs
        .iter()
        .position(|m| matches!(m, CtrlMsg::FlowFinish { .. }))
        .unwrap();
    assert!(matches!(msgs[fin - 1], CtrlMsg::EcnReport { .. }));
    // The sender keeps the latest (cumulative) report.
    for m in &reports {
        p.s.on_ctrl((*m).clone(), p.now).unwrap();
    }
    assert_eq!(p.s.stats().ecn, *queues);
    assert_eq!(p.s.stats().ecn_reports, reports.len() as u64);
}

#[test]
fn late_packets_after_finish_never_touch_the_buffer() {
    let mut p = Pair::new(3600, 0.5);
    let msgs = p.pass(|_| false);
    assert!(matches!(msgs.last(), Some(CtrlMsg::FlowFinish { .. })));
    p.r.on_ctrl(CtrlMsg::FinishConfirm, p.now).unwrap();
    let snapshot = p.dst.as_bytes().to_vec();
    let repr = header::Repr {
        kind: header::Kind::Data,
        flags: header::Flags::EMPTY,
        pass: 0,
        job_id: ID.job,
        tensor_id: ID.tensor,
        round: ID.round,
        offset: 9 * 1440,
        seq: 99,
        length: 1440,
        layer: 0,
    };
    let junk = vec![0xEE; 1440];
    assert_eq!(
        p.r.on_data(&repr, &junk, p.dst.as_bytes_mut(), 0, p.now),
        Err(PlaceError::StaleRound)
    );
    assert_eq!(p.dst.as_bytes(), &snapshot[..]);
}

#[test]
fn foreign_and_malicious_packets_are_refused_distinctly_and_write_nothing() {
    let mut p = Pair::new(3600, 0.0); // 14400 bytes, 10 segments
    let base = header::Repr {
        kind: header::Kind::Data,
        flags: header::Flags::EMPTY,
        pass: 0,
        job_id: ID.job,
        tensor_id: ID.tensor,
        round: ID.round,
        offset: 0,
        seq: 0,
        length: 1440,
        layer: 0,
    };
    let data = vec![0xAA; 1444];
    let cases: [(header::Repr, usize, PlaceError); 8] = [
        (
            header::Repr { job_id: 8, ..base },
            1440,
            PlaceError::UnknownJob,
        ),
        (
            header::Repr {
                tensor_id: 4,
                ..base
            },
            1440,
            PlaceError::UnknownTensor,
        ),
        (
            header::Repr { round: 10, ..base },
            1440,
            PlaceError::StaleRound,
        ),
        (
            header::Repr {
                offset: 13_000,
                ..base
            },
            1440,
            PlaceError::OutOfBounds,
        ),
        (
            header::Repr {
                offset: u64::MAX - 10,
                ..base
            },
            1440,
            PlaceError::OutOfBounds,
        ),
        (base, 1438, PlaceError::NotElementMultiple),
        (base, 1444, PlaceError::TooLong),
        (
            header::Repr {
                offset: 720,
                ..base
            },
            720,
            PlaceError::Misaligned,
        ),
    ];
    for (repr, len, want) in cases {
        assert_eq!(
            p.r.on_data(&repr, &data[..len], p.dst.as_bytes_mut(), 0, 1),
            Err(want)
        );
    }
    assert!(p.dst.as_bytes().iter().all(|&b| b == 0));
    assert_eq!(p.r.bitmap().count_ones(), 0);
}

/// The `FlowStart` a sender with `cfg` opens a pull of `elems` f32 with bound `p` with.
fn flow_start(cfg: &SenderConfig, elems: usize, p: f64) -> FlowStart {
    let (_, start) = SenderFlow::new(
        ID,
        layout(elems),
        DType::F32,
        0,
        bound(p),
        Stage::Pull,
        DataOrigin::single(SENDER),
        cfg,
        0,
    );
    let CtrlMsg::FlowStart(fs) = start else {
        panic!("a sender opens with FlowStart")
    };
    fs
}

#[test]
fn flow_start_announces_the_job_priority() {
    for (asked, announced) in [(0, 0), (5, 5), (200, 7)] {
        let cfg = SenderConfig {
            priority: asked,
            ..SenderConfig::new(1_000_000_000)
        };
        assert_eq!(
            flow_start(&cfg, 10, 0.0).priority,
            announced,
            "asked for {asked}"
        );
    }
}

#[test]
fn rendezvous_rejects_mismatches_with_reasons() {
    let fs = flow_start(&SenderConfig::new(1_000_000_000), 1000, 0.1);
    let check = |fs: &FlowStart, spec: &RecvSpec, code: RejectCode| match ReceiverFlow::accept(
        fs,
        spec,
        SENDER.ip(),
        1,
        200_000,
        0,
    ) {
        Err(CtrlMsg::FlowReject {
            code: c, reason, ..
        }) => {
            assert_eq!(c, code, "{reason}");
            assert!(!reason.is_empty());
        }
        other => panic!("expected reject {code:?}, got {other:?}"),
    };
    check(
        &fs,
        &RecvSpec {
            tensor: 9,
            ..spec(1000, None)
        },
        RejectCode::UnknownTensor,
    );
    check(
        &fs,
        &RecvSpec {
            job: 9,
            ..spec(1000, None)
        },
        RejectCode::UnknownTensor,
    );
    check(
        &fs,
        &RecvSpec {
            dtype: DType::F16,
            size_bytes: 4000,
            ..spec(1000, None)
        },
        RejectCode::DtypeMismatch,
    );
    check(&fs, &spec(999, None), RejectCode::SizeMismatch);
    check(
        &fs,
        &RecvSpec {
            max_payload: 1000,
            ..spec(1000, None)
        },
        RejectCode::BadSegmentLayout,
    );
    check(
        &FlowStart {
            segment_count: 2,
            ..fs.clone()
        },
        &spec(1000, None),
        RejectCode::BadSegmentLayout,
    );
    check(
        &FlowStart {
            segment_payload: 1442,
            ..fs.clone()
        },
        &spec(1000, None),
        RejectCode::BadSegmentLayout,
    );
    check(
        &fs,
        &RecvSpec {
            round: Some(1),
            ..spec(1000, None)
        },
        RejectCode::Other,
    );
    // The receiver's own bound wins over the sender's.
    let (r, _) = ReceiverFlow::accept(
        &fs,
        &spec(1000, Some(LossBound::RELIABLE)),
        SENDER.ip(),
        1,
        1,
        0,
    )
    .unwrap();
    assert_eq!(r.loss_bound(), LossBound::RELIABLE);
}

#[test]
fn sender_refuses_out_of_state_and_foreign_messages() {
    let mut p = Pair::new(3600, 0.0);
    assert!(matches!(
        p.s.on_ctrl(
            CtrlMsg::FlowAccept {
                job_id: 1,
                tensor_id: 3,
                round: 11,
                data_port: 1
            },
            0
        ),
        Err(ProtoError::WrongFlow { .. })
    ));
    assert!(matches!(
        p.s.on_ctrl(
            CtrlMsg::FlowAccept {
                job_id: 7,
                tensor_id: 3,
                round: 11,
                data_port: 1
            },
            0
        ),
        Err(ProtoError::Unexpected { .. })
    ));
    assert!(matches!(
        p.s.on_ctrl(CtrlMsg::FinishConfirm, 0),
        Err(ProtoError::Unexpected { .. })
    ));
    // A retransmission request while still sending pass 0 is a protocol violation.
    assert!(matches!(
        p.s.on_ctrl(
            CtrlMsg::RetransmitRequest {
                pass: 0,
                ranges: vec![]
            },
            0
        ),
        Err(ProtoError::Unexpected { .. })
    ));
    while p.s.next_segment().is_some() {}
    assert!(p.s.poll_pass_end().is_some());
    // Out-of-range segments.
    assert!(matches!(
        p.s.on_ctrl(
            CtrlMsg::RetransmitRequest {
                pass: 0,
                ranges: vec![SegRange { start: 8, len: 5 }]
            },
            0
        ),
        Err(ProtoError::BadRanges {
            start: 8,
            end: 13,
            count: 10
        })
    ));
    // A request for an older pass is stale: ignored.
    assert_eq!(
        p.s.on_ctrl(
            CtrlMsg::RetransmitRequest {
                pass: 7,
                ranges: vec![]
            },
            0
        ),
        Ok(None)
    );
    assert_eq!(p.s.phase(), SenderPhase::AwaitVerdict);
    assert!(matches!(
        p.s.on_ctrl(
            CtrlMsg::Abort {
                code: 1,
                reason: "out of memory".into()
            },
            0
        ),
        Err(ProtoError::Aborted { .. })
    ));
    // FlowFinish crossing our FlowStop: confirm and finish.
    assert_eq!(
        p.s.on_ctrl(
            CtrlMsg::FlowFinish {
                received_segments: 10
            },
            0
        ),
        Ok(Some(CtrlMsg::FinishConfirm))
    );
    assert_eq!(
        p.s.on_ctrl(
            CtrlMsg::RetransmitRequest {
                pass: 0,
                ranges: vec![]
            },
            0
        ),
        Ok(None)
    );
}

#[test]
fn receiver_ignores_flow_stop_after_finish_and_refuses_early_confirm() {
    let mut p = Pair::new(3600, 0.0);
    assert!(matches!(
        p.r.on_ctrl(CtrlMsg::FinishConfirm, 0),
        Err(ProtoError::Unexpected { .. })
    ));
    assert!(matches!(
        p.r.on_ctrl(CtrlMsg::FinishConfirm, 0),
        Err(ProtoError::Unexpected { .. })
    ));
    p.pass(|_| false);
    assert_eq!(p.r.phase(), ReceiverPhase::FinishSent);
    assert_eq!(
        p.r.on_ctrl(
            CtrlMsg::FlowStop {
                pass: 0,
                segments_sent: 10
            },
            0
        ),
        Ok(None)
    );
    assert!(matches!(
        p.r.on_ctrl(
            CtrlMsg::RateReport {
                period_ns: 1,
                bytes: 1,
                packets: 1,
                ce_packets: 0
            },
            0
        ),
        Err(ProtoError::Unexpected { .. })
    ));
}

#[test]
fn rate_reports_drive_the_rate_controller() {
    let mut p = Pair::new(360_000, 0.0);
    let line = p.s.rate_bps();
    // 1 ms of sending at 8 Gbit/s (1 MB), receiver saw 2 Mbit/s: congestion, halve.
    p.s.on_sent(1, 1_000_000 - 32, MS);
    p.s.on_ctrl(
        CtrlMsg::RateReport {
            period_ns: MS,
            bytes: 250,
            packets: 1,
            ce_packets: 1,
        },
        MS,
    )
    .unwrap();
    assert_eq!(p.s.rate_state(), RateState::CongestionAvoidance);
    assert_eq!(p.s.rate_bps(), line / 2);
    // Next period: receiver keeps up: additive increase of 5% of line rate.
    p.s.on_sent(1, 500_000 - 32, 2 * MS);
    p.s.on_ctrl(
        CtrlMsg::RateReport {
            period_ns: MS,
            bytes: 500_000,
            packets: 1,
            ce_packets: 0,
        },
        2 * MS,
    )
    .unwrap();
    assert_eq!(p.s.rate_bps(), line / 2 + line / 20);
    // An idle period (nothing sent) says nothing about congestion.
    p.s.on_ctrl(
        CtrlMsg::RateReport {
            period_ns: MS,
            bytes: 0,
            packets: 0,
            ce_packets: 0,
        },
        3 * MS,
    )
    .unwrap();
    assert_eq!(p.s.rate_bps(), line / 2 + line / 20);
    let st = p.s.stats();
    assert_eq!(
        (st.halvings, st.increases, st.rate_reports, st.ce_reported),
        (1, 1, 3, 1)
    );
}

#[test]
fn empty_tensor_finishes_at_once() {
    let cfg = SenderConfig::new(1_000_000_000);
    let l = SegmentLayout::new(0, 4, 1440).unwrap();
    let (mut s, start) = SenderFlow::new(
        ID,
        l,
        DType::F32,
        0,
        LossBound::RELIABLE,
        Stage::Push,
        DataOrigin::single(SENDER),
        &cfg,
        0,
    );
    let CtrlMsg::FlowStart(fs) = start else {
        panic!()
    };
    let (mut r, accept) = ReceiverFlow::accept(&fs, &spec(0, None), SENDER.ip(), 1, 1, 0).unwrap();
    s.on_ctrl(accept, 0).unwrap();
    assert_eq!(
        r.poll(0),
        Some(CtrlMsg::FlowFinish {
            received_segments: 0
        })
    );
    assert!(s.next_segment().is_none());
}

#[test]
fn a_data_path_that_delivers_nothing_backs_off_then_ends_in_an_error() {
    let mut q = Pair::new(3600, 0.0);
    q.r.set_no_progress_timeout(5 * MS);
    let stop = |pass| CtrlMsg::FlowStop {
        pass,
        segments_sent: 10,
    };
    let all = vec![SegRange { start: 0, len: 10 }];
    // First FlowStop: nothing arrived yet, one futile pass: the request waits 1 ms.
    assert_eq!(q.r.on_ctrl(stop(0), 0), Ok(None));
    assert_eq!(q.r.poll(MS - 1), None);
    assert_eq!(
        q.r.poll(MS),
        Some(CtrlMsg::RetransmitRequest {
            pass: 0,
            ranges: all.clone()
        })
    );
    assert_eq!(q.r.poll(MS), None, "sent once");
    // Second futile pass, still within the time limit: 2 ms.
    assert_eq!(q.r.on_ctrl(stop(1), 2 * MS), Ok(None));
    assert_eq!(q.r.poll(4 * MS - 1), None);
    assert!(q.r.poll(4 * MS).is_some());
    // The third ends after 5 ms without a new segment: give up, naming the counts.
    assert_eq!(
        q.r.on_ctrl(stop(2), 6 * MS),
        Err(ProtoError::NoDataProgress {
            passes: 3,
            received: 0,
            total: 10,
            idle_ms: 6,
        })
    );
    assert_eq!(q.r.stats().backoffs, 2);
    // Progress in between resets the count: the request goes at once.
    let mut p = Pair::new(3600, 0.0);
    let msgs = p.pass(|i| i != 3);
    let Some(req) = msgs
        .into_iter()
        .find(|m| matches!(m, CtrlMsg::RetransmitRequest { .. }))
    else {
        panic!()
    };
    p.s.on_ctrl(req, p.now).unwrap();
    let msgs = p.pass(|_| true);
    assert!(
        !msgs
            .iter()
            .any(|m| matches!(m, CtrlMsg::RetransmitRequest { .. })),
        "a futile pass waits"
    );
    p.now += 100 * MS;
    assert!(matches!(
        p.r.poll(p.now),
        Some(CtrlMsg::RetransmitRequest { pass: 1, .. })
    ));
    // Backoff is capped.
    let mut c = Pair::new(3600, 0.0);
    c.r.set_max_backoff(3 * MS);
    c.r.set_no_progress_timeout(0);
    for pass in 0..30 {
        let t = u64::from(pass) * 10 * MS;
        assert_eq!(c.r.on_ctrl(stop(pass), t), Ok(None));
        assert!(c.r.poll(t + 3 * MS).is_some(), "pass {pass}");
    }
}

#[test]
fn grant_mode_paces_at_the_receivers_grant() {
    let mut p = Pair::with_mode(360_000, 0.0, RateMode::Grant);
    let floor = RateConfig::new(10_000_000_000).min_rate_bps;
    // Before any grant: the floor, never line rate.
    assert_eq!(p.s.rate_bps(), floor);
    // The receiver announces the share its allocator computed, once.
    p.r.set_grant(2_000_000_000);
    let g = p.r.poll(0).unwrap();
    assert_eq!(
        g,
        CtrlMsg::RateGrant {
            rate_bps: 2_000_000_000
        }
    );
    assert_eq!(p.r.poll(0), None);
    p.s.on_ctrl(g, 0).unwrap();
    assert_eq!(p.s.rate_bps(), 2_000_000_000);
    // A small move is not worth a message; a move of 1/16 or more is.
    p.r.set_grant(2_000_000_000 + 2_000_000_000 / 32);
    assert_eq!(p.r.poll(0), None);
    p.r.set_grant(1_000_000_000);
    let g = p.r.poll(0).unwrap();
    p.s.on_ctrl(g, 0).unwrap();
    assert_eq!(p.s.rate_bps(), 1_000_000_000);
    // Rate reports do not move a granted rate, even with marks.
    p.s.on_sent(1, 1_000_000, MS);
    p.s.on_ctrl(
        CtrlMsg::RateReport {
            period_ns: MS,
            bytes: 250,
            packets: 10,
            ce_packets: 10,
        },
        MS,
    )
    .unwrap();
    assert_eq!(p.s.rate_bps(), 1_000_000_000);
    // Grants above line rate are capped at it.
    p.s.on_ctrl(CtrlMsg::RateGrant { rate_bps: u64::MAX }, MS)
        .unwrap();
    assert_eq!(p.s.rate_bps(), 10_000_000_000);
    p.s.on_ctrl(
        CtrlMsg::RateGrant {
            rate_bps: 1_000_000_000,
        },
        MS,
    )
    .unwrap();
    // A retransmission pass keeps the grant (Figure 7 would restart at line rate) and its
    // segments are important.
    let msgs = p.pass(|i| i % 2 == 0);
    let req = msgs
        .into_iter()
        .find(|m| matches!(m, CtrlMsg::RetransmitRequest { .. }))
        .unwrap();
    assert!(!p.s.retransmit_important());
    p.s.on_ctrl(req, p.now).unwrap();
    assert_eq!(p.s.rate_bps(), 1_000_000_000);
    assert!(p.s.retransmit_important());
    let st = p.s.stats();
    assert_eq!((st.grants, st.last_grant_bps), (4, Some(1_000_000_000)));
    assert_eq!(st.min_rate_bps, floor);
}

#[test]
fn grant_mode_starts_at_the_remembered_rate() {
    let start = |mode| {
        let mut cfg = SenderConfig::with_mode(mode, 10_000_000_000);
        cfg.initial_rate_bps = Some(3_000_000_000);
        let (s, _) = SenderFlow::new(
            ID,
            layout(100),
            DType::F32,
            0,
            LossBound::RELIABLE,
            Stage::Push,
            DataOrigin::single(SENDER),
            &cfg,
            0,
        );
        s
    };
    assert_eq!(start(RateMode::Grant).rate_bps(), 3_000_000_000);
    // ECN mode starts there too, Figure 7 at line rate whatever is remembered.
    assert_eq!(start(RateMode::Ecn).rate_bps(), 3_000_000_000);
    let fig7 = start(RateMode::Fig7);
    assert_eq!(fig7.rate_bps(), 10_000_000_000);
    assert!(!fig7.retransmit_important());
}

#[test]
fn ecn_mode_cuts_on_reported_marks() {
    let mut p = Pair::with_mode(360_000, 0.0, RateMode::Ecn);
    let line = p.s.rate_bps();
    assert_eq!(line, 10_000_000_000, "no memory: line rate");
    p.s.on_sent(1, 1_000_000, MS);
    p.s.on_ctrl(
        CtrlMsg::RateReport {
            period_ns: MS,
            bytes: 1_000_000,
            packets: 10,
            ce_packets: 10,
        },
        MS,
    )
    .unwrap();
    assert_eq!(p.s.rate_bps(), line / 2);
    // Grants are ignored in this mode.
    p.s.on_ctrl(CtrlMsg::RateGrant { rate_bps: 1 }, MS).unwrap();
    assert_eq!(p.s.rate_bps(), line / 2);
    assert_eq!(p.s.stats().halvings, 1);
}

/// Peer binding: only the sources announced in FlowStart may write the tensor; a datagram from
/// anyone else is counted and leaves every byte as it was, even when its ids are the flow's.
#[test]
fn only_announced_sources_write_the_tensor() {
    let elems = 10_000;
    let spray = DataSource {
        addr: std::net::IpAddr::from([0, 0, 0, 0]),
        port: 7000,
        ports: 4,
    };
    let second_nic = DataSource::single("198.18.1.1:9000".parse().unwrap());
    let (_, start) = SenderFlow::new(
        ID,
        layout(elems),
        DType::F32,
        2,
        bound(0.0),
        Stage::Push,
        DataOrigin {
            sources: vec![spray, second_nic],
            flow_nonce: [9; 16],
        },
        &SenderConfig::new(10_000_000_000),
        0,
    );
    let CtrlMsg::FlowStart(fs) = start else {
        panic!("not a FlowStart")
    };
    let control_peer = std::net::IpAddr::from([198, 18, 0, 7]);
    let (mut r, _) =
        ReceiverFlow::accept(&fs, &spec(elems, None), control_peer, 1, 200_000, 0).unwrap();
    // The wildcard source resolved to the control connection's address.
    assert_eq!(r.peers()[0].addr, control_peer);

    let mut src = Tensor::zeros(DType::F32, elems);
    src.fill_pattern(3);
    let datagram = |index: u32, payload: &[u8]| {
        let (off, len) = layout(elems).segment(index).unwrap();
        let repr = header::Repr {
            kind: header::Kind::Data,
            flags: header::Flags::default(),
            pass: 0,
            job_id: ID.job,
            tensor_id: ID.tensor,
            round: ID.round,
            offset: off,
            seq: index,
            length: len as u16,
            layer: 2,
        };
        let mut buf = vec![0u8; header::HEADER_LEN + len];
        let mut pkt = header::Packet::new_unchecked(&mut buf[..]);
        repr.emit(&mut pkt).unwrap();
        pkt.payload_mut()
            .copy_from_slice(&payload[off as usize..off as usize + len]);
        buf
    };
    let forged = vec![0xa5u8; elems * 4];
    let mut dst = Tensor::zeros(DType::F32, elems);
    let mut counts = RejectCounts::default();
    let foreign: [std::net::SocketAddr; 5] = [
        "198.18.0.99:7000".parse().unwrap(), // a third host, the sender's port
        "198.18.0.7:6999".parse().unwrap(),  // the sender's host, below the spray range
        "198.18.0.7:7004".parse().unwrap(),  // just past it
        "198.18.1.1:9001".parse().unwrap(),  // the second interface, another port
        "[2001:db8::7]:7000".parse().unwrap(),
    ];
    for (i, from) in foreign.iter().enumerate() {
        let res = r.on_datagram(
            *from,
            &datagram(i as u32, &forged),
            dst.as_bytes_mut(),
            0,
            1,
        );
        assert_eq!(res, Err(DataReject::ForeignSource), "{from}");
        counts.count_datagram(res.unwrap_err());
    }
    assert_eq!(counts.foreign_source, 5);
    assert_eq!(counts.total(), 5);
    assert_eq!(counts.to_string(), "foreign_source 5");
    assert_eq!(RejectCounts::default().to_string(), "none");
    let mut sum = counts;
    sum.add(&counts);
    assert_eq!((sum.foreign_source, sum.total()), (10, 10));
    assert!(
        dst.as_bytes().iter().all(|&b| b == 0),
        "a foreign datagram touched the tensor"
    );
    assert_eq!(r.stats().placed + r.stats().duplicates, 0);

    // Every announced source is accepted: each spray port, the second interface, and the
    // IPv4-mapped IPv6 spelling of the control peer (a dual-stack socket reports that).
    let ok: [std::net::SocketAddr; 4] = [
        "198.18.0.7:7000".parse().unwrap(),
        "198.18.0.7:7003".parse().unwrap(),
        "198.18.1.1:9000".parse().unwrap(),
        "[::ffff:198.18.0.7]:7001".parse().unwrap(),
    ];
    for (i, from) in ok.iter().enumerate() {
        let res = r.on_datagram(
            *from,
            &datagram(i as u32, src.as_bytes()),
            dst.as_bytes_mut(),
            0,
            1,
        );
        assert_eq!(res, Ok(true), "{from}");
    }
    // The forged copies of segments 0..4 did not pre-empt the real ones.
    let n = layout(elems).segment(4).unwrap().0 as usize;
    assert_eq!(&dst.as_bytes()[..n], &src.as_bytes()[..n]);
    // Malformed datagrams from a peer are counted as such, not placed.
    assert_eq!(
        r.on_datagram(ok[0], &[1, 1, 0], dst.as_bytes_mut(), 0, 1),
        Err(DataReject::Malformed)
    );
}

/// A reliable f32 sender of flow `id` from [`SENDER`], with flow nonce `nonce`.
fn reliable_sender(id: FlowId, layout: SegmentLayout, nonce: [u8; 16]) -> (SenderFlow, CtrlMsg) {
    SenderFlow::new(
        id,
        layout,
        DType::F32,
        2,
        bound(0.0),
        Stage::Push,
        DataOrigin {
            sources: vec![DataSource::single(SENDER)],
            flow_nonce: nonce,
        },
        &SenderConfig::new(10_000_000_000),
        0,
    )
}

/// The authenticated sender's next datagram of `src`, sealed as the driver seals it.
fn seal_next(s: &mut SenderFlow, src: &Tensor) -> Option<(header::Repr, Vec<u8>)> {
    let (_, repr) = s.next_segment()?;
    let (off, len) = (repr.offset as usize, usize::from(repr.length));
    let mut buf = vec![0u8; header::HEADER_LEN + len + s.tag_len()];
    repr.emit(&mut header::Packet::new_unchecked(&mut buf[..]))
        .unwrap();
    buf[header::HEADER_LEN..header::HEADER_LEN + len]
        .copy_from_slice(&src.as_bytes()[off..off + len]);
    s.data_key()?.seal(&mut buf).unwrap();
    Some((repr, buf))
}

/// A handshake transcript whose every byte is `fill` (the flows only need some session).
fn transcript(fill: u8) -> crate::auth::Transcript {
    crate::auth::Transcript {
        client_nonce: [fill; 32],
        server_nonce: [fill; 32],
        client_public: [fill; 32],
        server_public: [fill; 32],
    }
}

/// Authenticated flows: the sender's datagrams are sealed with the flow key; the receiver
/// places only datagrams of the current pass whose tag verifies, decrypted. A datagram with
/// the flow's ids but a wrong key (a host without the secret, or a spoofed source), a plain
/// one, a replay of an earlier pass, and a replay of an earlier round of the same tensor
/// (another flow, so another key) all leave the tensor untouched and are counted.
#[test]
fn authenticated_flow_places_only_sealed_datagrams_of_the_current_pass() {
    use crate::auth::{JobKey, JobSecret};
    let elems = 3600; // 10 segments of 1424 B (1440 minus the tag) + a short one
    let job = JobKey::new(&JobSecret::new(b"a job secret of 32 bytes, really".to_vec()).unwrap());
    let session = job.session(&transcript(1), &[2; 32]);
    let nonce = [7u8; 16];
    let layout = SegmentLayout::new(elems as u64 * 4, 4, 1424).unwrap();
    let mut src = Tensor::zeros(DType::F32, elems);
    src.fill_pattern(5);
    let (mut s, start) = reliable_sender(ID, layout, nonce);
    s.authenticate(session.flow_key(ID.job, ID.tensor, ID.round, &nonce));
    let CtrlMsg::FlowStart(fs) = start else {
        panic!("not a FlowStart")
    };
    let (mut r, accept) =
        ReceiverFlow::accept(&fs, &spec(elems, None), SENDER.ip(), 1, 200_000, 0).unwrap();
    r.authenticate(session.flow_key(fs.job_id, fs.tensor_id, fs.round, &fs.flow_nonce));
    assert!(r.is_authenticated());
    s.on_ctrl(accept, 0).unwrap();

    // Every datagram of pass 0, sealed as the driver does.
    let mut sealed = Vec::new();
    while let Some((repr, buf)) = seal_next(&mut s, &src) {
        assert_eq!(repr.kind, header::Kind::AuthData);
        let (off, len) = (repr.offset as usize, usize::from(repr.length));
        // Encrypted on the wire.
        assert_ne!(
            &buf[header::HEADER_LEN..header::HEADER_LEN + len],
            &src.as_bytes()[off..off + len]
        );
        sealed.push(buf);
    }
    assert_eq!(sealed.len(), layout.count() as usize);
    let mut dst = Tensor::zeros(DType::F32, elems);
    let mut counts = RejectCounts::default();
    let mut try_place = |r: &mut ReceiverFlow, d: &[u8], dst: &mut Tensor| {
        let res = r.on_datagram(SENDER, d, dst.as_bytes_mut(), 0, 1);
        if let Err(e) = res {
            counts.count_datagram(e);
        }
        res
    };

    // A host without the secret: the flow's ids, a tag under another key (here: another
    // session of the same job), from the sender's own (spoofed) address.
    let other = job
        .session(&transcript(3), &[4; 32])
        .flow_key(ID.job, ID.tensor, ID.round, &nonce);
    let mut forged = sealed[0].clone();
    forged[header::HEADER_LEN..header::HEADER_LEN + 1424].fill(0xa5);
    other.seal(&mut forged).unwrap();
    assert_eq!(
        try_place(&mut r, &forged, &mut dst),
        Err(DataReject::BadTag)
    );
    // A flipped byte of a real datagram.
    let mut flipped = sealed[1].clone();
    flipped[40] ^= 1;
    assert_eq!(
        try_place(&mut r, &flipped, &mut dst),
        Err(DataReject::BadTag)
    );
    // A plain datagram with the flow's ids.
    let mut plain = sealed[2].clone();
    plain.truncate(plain.len() - header::TAG_LEN);
    plain[1] = header::Kind::Data as u8;
    assert_eq!(
        try_place(&mut r, &plain, &mut dst),
        Err(DataReject::Unauthenticated)
    );
    assert!(
        dst.as_bytes().iter().all(|&b| b == 0),
        "a rejected datagram touched the tensor"
    );

    // Pass 0 loses segments 0..3; the rest arrive.
    for d in &sealed[3..] {
        assert_eq!(try_place(&mut r, d, &mut dst), Ok(true));
    }
    let stop = s.poll_pass_end().unwrap();
    let request = r.on_ctrl(stop, 10).unwrap().unwrap();
    assert!(matches!(
        request,
        CtrlMsg::RetransmitRequest { pass: 0, .. }
    ));
    // A replay of pass 0 after the request is stale, even for a missing segment.
    assert_eq!(
        try_place(&mut r, &sealed[0], &mut dst),
        Err(DataReject::StalePass)
    );
    s.on_ctrl(request, 20).unwrap();
    let mut pass1 = 0;
    while let Some((repr, buf)) = seal_next(&mut s, &src) {
        assert_eq!(repr.pass, 1);
        assert_eq!(try_place(&mut r, &buf, &mut dst), Ok(true));
        pass1 += 1;
    }
    assert_eq!(pass1, 3);
    assert_eq!(dst.as_bytes(), src.as_bytes());

    // The next round of the same tensor is another flow with another nonce: last round's
    // datagrams, replayed into it, are refused (stale round, or a tag under the old key).
    let next = FlowId {
        round: ID.round + 1,
        ..ID
    };
    let (_, start2) = reliable_sender(next, layout, [8; 16]);
    let CtrlMsg::FlowStart(fs2) = start2 else {
        panic!("not a FlowStart")
    };
    let (mut r2, _) =
        ReceiverFlow::accept(&fs2, &spec(elems, None), SENDER.ip(), 1, 200_000, 0).unwrap();
    r2.authenticate(session.flow_key(fs2.job_id, fs2.tensor_id, fs2.round, &fs2.flow_nonce));
    let mut dst2 = Tensor::zeros(DType::F32, elems);
    for d in &sealed {
        assert_eq!(
            r2.on_datagram(SENDER, d, dst2.as_bytes_mut(), 0, 1),
            Err(DataReject::Place(PlaceError::StaleRound))
        );
    }
    // Rewriting the round field does not help: the header is authenticated.
    let mut rewritten = sealed[0].clone();
    rewritten[12..16].copy_from_slice(&next.round.to_be_bytes());
    assert_eq!(
        r2.on_datagram(SENDER, &rewritten, dst2.as_bytes_mut(), 0, 1),
        Err(DataReject::BadTag)
    );
    assert!(dst2.as_bytes().iter().all(|&b| b == 0));
    assert_eq!(
        (counts.bad_tag, counts.unauthenticated, counts.stale_pass),
        (2, 1, 1)
    );
}

/// An authenticated sender never reuses a sequence number (its GCM nonce): after 2^32
/// datagrams it stops and says so.
#[test]
fn authenticated_sender_refuses_to_wrap_its_sequence_number() {
    use crate::auth::{JobKey, JobSecret};
    let job = JobKey::new(&JobSecret::new(vec![9; 16]).unwrap());
    let key = job
        .session(&transcript(0), &[0; 32])
        .flow_key(1, 2, 3, &[0; 16]);
    let mut p = Pair::new(3600, 0.0);
    p.s.authenticate(key);
    p.s.set_seq_for_test(u32::MAX);
    assert!(p.s.next_segment().is_some(), "seq u32::MAX is still unused");
    assert!(p.s.nonces_exhausted());
    assert!(p.s.next_segment().is_none());
}

/// An authenticated flow's current pass moves when the retransmission request is sent, not
/// when it is decided: a request held back by the backoff (the pass delivered nothing new)
/// still lets late packets of that pass in, and refuses them as stale once it is sent.
#[test]
fn a_held_back_request_keeps_its_pass_current_until_sent() {
    use crate::auth::{JobKey, JobSecret};
    let elems = 3600;
    let layout = SegmentLayout::new(elems as u64 * 4, 4, 1424).unwrap();
    let session =
        JobKey::new(&JobSecret::new(vec![4; 32]).unwrap()).session(&transcript(5), &[6; 32]);
    let nonce = [1u8; 16];
    let (mut s, start) = reliable_sender(ID, layout, nonce);
    s.authenticate(session.flow_key(ID.job, ID.tensor, ID.round, &nonce));
    let CtrlMsg::FlowStart(fs) = start else {
        panic!("not a FlowStart")
    };
    let (mut r, accept) =
        ReceiverFlow::accept(&fs, &spec(elems, None), SENDER.ip(), 1, 200_000, 0).unwrap();
    r.authenticate(session.flow_key(ID.job, ID.tensor, ID.round, &nonce));
    s.on_ctrl(accept, 0).unwrap();
    let mut src = Tensor::zeros(DType::F32, elems);
    src.fill_pattern(9);
    let sealed: Vec<Vec<u8>> = std::iter::from_fn(|| seal_next(&mut s, &src))
        .map(|(_, buf)| buf)
        .collect();
    // Pass 0 delivered nothing: its request is held back (1 ms at the first futile pass).
    let stop = s.poll_pass_end().unwrap();
    assert_eq!(r.on_ctrl(stop, 10).unwrap(), None);
    assert_eq!(r.stats().backoffs, 1);
    let mut dst = Tensor::zeros(DType::F32, elems);
    // A late packet of pass 0 during the backoff is still current: placed.
    assert_eq!(
        r.on_datagram(SENDER, &sealed[0], dst.as_bytes_mut(), 0, 20),
        Ok(true)
    );
    // The request goes out when due; from then on pass 0 is stale.
    let due = 10 + MS;
    let request = std::iter::from_fn(|| r.poll(due))
        .find(|m| matches!(m, CtrlMsg::RetransmitRequest { .. }))
        .expect("the held-back request");
    assert!(matches!(
        request,
        CtrlMsg::RetransmitRequest { pass: 0, .. }
    ));
    assert_eq!(
        r.on_datagram(SENDER, &sealed[1], dst.as_bytes_mut(), 0, due),
        Err(DataReject::StalePass)
    );
}

/// FlowStop overtakes a queue that is still draining (a WAN path: the sender emitted the
/// pass at line rate, the bottleneck delivers a segment per millisecond): the receiver holds
/// its request while segments keep arriving, and then asks only for the one really lost,
/// instead of every segment still queued.
#[test]
fn a_request_waits_for_a_draining_queue_and_asks_only_for_what_was_lost() {
    let mut p = Pair::new(36_000, 0.0);
    let mut queued = Vec::new();
    while let Some((index, repr)) = p.s.next_segment() {
        let buf = p.emit_sent(&repr);
        if index != 50 {
            queued.push(buf);
        }
    }
    let stop = p.s.poll_pass_end().unwrap();
    let deliver = |p: &mut Pair, buf: &[u8]| {
        let pkt = header::Packet::new_checked(buf).unwrap();
        let repr = header::Repr::parse(&pkt).unwrap();
        assert_eq!(
            p.r.on_data(&repr, pkt.payload(), p.dst.as_bytes_mut(), 0, p.now),
            Ok(true)
        );
    };
    let mut reqs = Vec::new();
    let poll = |p: &mut Pair, reqs: &mut Vec<CtrlMsg>| {
        while let Some(m) = p.r.poll(p.now) {
            if matches!(m, CtrlMsg::RetransmitRequest { .. }) {
                reqs.push(m);
            }
        }
    };
    // 20 segments, 1 ms apart; FlowStop 0.5 ms after the last.
    for buf in &queued[..20] {
        p.now += 1_000_000;
        deliver(&mut p, buf);
    }
    p.now += 500_000;
    assert_eq!(
        p.r.on_ctrl(stop, p.now).unwrap(),
        None,
        "asked while the queue drained"
    );
    assert_eq!(p.r.stats().drain_holds, 1);
    // The rest keeps coming: no request meanwhile.
    for buf in &queued[20..] {
        p.now += 1_000_000;
        deliver(&mut p, buf);
        poll(&mut p, &mut reqs);
    }
    assert!(
        reqs.is_empty(),
        "asked while segments still arrived: {reqs:?}"
    );
    // Arrivals pause for 3 gaps: still waiting; after 4, the request, for segment 50 only.
    p.now += 3_000_000;
    poll(&mut p, &mut reqs);
    assert!(reqs.is_empty());
    p.now += 1_100_000;
    poll(&mut p, &mut reqs);
    assert_eq!(
        reqs,
        vec![CtrlMsg::RetransmitRequest {
            pass: 0,
            ranges: vec![SegRange { start: 50, len: 1 }]
        }]
    );
    assert_eq!(p.r.stats().segments_requested, 1);
    // The retransmission is lost too: that pass brought nothing, so the next request backs
    // off (the segments that drained in during the hold count for pass 0, not for pass 1).
    p.s.on_ctrl(reqs[0].clone(), p.now).unwrap();
    let msgs = p.pass(|_| true);
    assert!(
        !msgs
            .iter()
            .any(|m| matches!(m, CtrlMsg::RetransmitRequest { .. })),
        "a futile pass answered at once: {msgs:?}"
    );
    assert_eq!(p.r.stats().backoffs, 1);
}

#[test]
fn tos_per_segment_asks_the_priority_function_about_each_segment_in_order() {
    // 25 bytes in segments of 10: offsets 0, 10, 20, the last one 5 bytes long.
    let bytes: Vec<u8> = (0..25).collect();
    let prio = |s: &SegmentInfo<'_>| {
        assert_eq!(u64::from(s.index) * 10, s.offset);
        assert_eq!((s.layer, s.dtype), (3, DType::Raw));
        assert_eq!(s.payload[0], s.offset as u8);
        Tag {
            dscp: s.index as u8 + 8,
            ect: s.payload.len() == 10,
        }
    };
    let tos = tos_per_segment(&bytes, 10, 3, DType::Raw, &prio);
    assert_eq!(tos, vec![(8 << 2) | 0b10, (9 << 2) | 0b10, 10 << 2]);
}
