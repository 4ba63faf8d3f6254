//! Fuzzes the receiver's data placement path: "a remote peer can never write outside a tensor
//! buffer".
//!
//! The first 6 input bytes describe a small registered tensor (dtype, loss bound, up to 1024
//! elements, segment payload); a `ReceiverFlow` is built for it with `ReceiverFlow::accept`
//! exactly as `transport::recv_tensor` does. The rest is a sequence of operations: datagrams
//! (op byte, 2-byte length, then the bytes; op bits 0-2 optionally patch the length field,
//! the flow ids, or the offset and size to a segment's, so that the fuzzer gets past the cheap
//! checks; bit 3 marks the packet CE) that go through
//! `header::Packet::new_checked` + `header::Repr::parse` + `ReceiverFlow::on_data`, or
//! control events (`FlowStop`, `FinishConfirm`, `poll`). The tensor is the middle of a buffer
//! with 64 guard bytes on each side.
//!
//! Properties checked, after every datagram:
//! - the guard bytes are untouched;
//! - the tensor changed only if `on_data` returned `Ok(true)`, and then only in
//!   `[offset, offset + len)`, which holds exactly the payload and is one segment of the
//!   flow's layout that had not been placed before; `Ok(false)` only for such a segment that
//!   was already placed; nothing is accepted once the flow is done;
//! - the flow's bitmap counts exactly the segments placed;
//! - a `RetransmitRequest` names exactly the segments not placed and encodes; a `FlowFinish`
//!   reports the number placed.
#![no_main]

use gradwire_proto::message::{CtrlMsg, FlowStart, LossBound, Stage};
use gradwire_proto::flow::{ReceiverFlow, RecvSpec};
use gradwire_proto::tensor::DType;
use gradwire_proto::wire::header::{self, Packet, Repr};
use libfuzzer_sys::fuzz_target;

/// The flow's announced data source (the placement checks under test come after peer binding).
const SENDER: std::net::SocketAddr = std::net::SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 0, 1)),
    9000,
);

const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xA5;
const JOB: u32 = 0x1020_3040;
const TENSOR: u32 = 7;
const ROUND: u32 = 3;
/// Largest payload the receiver accepts (IPv4 at MTU 1500).
const MAX_PAYLOAD: usize = 1440;

/// Takes `n` bytes off the front of `input`, or `None` if fewer remain.
fn take<'a>(input: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    let (head, tail) = input.split_at_checked(n)?;
    *input = tail;
    Some(head)
}

fn u16_le(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let Some(cfg) = take(&mut input, 6) else {
        return;
    };
    let Some(dtype) = DType::from_code(cfg[0] & 3) else {
        return;
    };
    let sender_bound = LossBound::from_ppm((u32::from(cfg[1]) * 4000).min(1_000_000))
        .unwrap_or(LossBound::RELIABLE);
    let elems = usize::from(u16_le(&cfg[2..4]) % 1025);
    let size = elems * dtype.elem_size();
    let seg = u32::from(u16_le(&cfg[4..6]) % 2048);
    let spec = RecvSpec {
        job: JOB,
        tensor: TENSOR,
        round: Some(ROUND),
        dtype,
        size_bytes: size as u64,
        max_payload: MAX_PAYLOAD,
        loss_bound: if cfg[0] & 4 != 0 {
            Some(LossBound::RELIABLE)
        } else {
            None
        },
    };
    let start = FlowStart {
        job_id: JOB,
        tensor_id: TENSOR,
        round: ROUND,
        layer: 0,
        dtype_code: dtype.code(),
        size_bytes: size as u64,
        segment_payload: seg,
        segment_count: if seg == 0 {
            0
        } else {
            u32::try_from((size as u64).div_ceil(u64::from(seg))).unwrap_or(u32::MAX)
        },
        loss_bound: sender_bound,
        stage: Stage::Push,
        priority: 0,
        flow_nonce: [0; 16],
        sources: vec![gradwire_proto::message::DataSource::single(SENDER)],
    };
    let mut now: u64 = 1_000_000;
    let Ok((mut flow, _accept)) = ReceiverFlow::accept(&start, &spec, SENDER.ip(), 9000, 100_000, now) else {
        return;
    };
    let layout = *flow.layout();
    let seg = layout.segment_payload();
    assert!(
        seg > 0 && seg <= MAX_PAYLOAD,
        "accepted segment payload {seg}"
    );
    let count = layout.count();

    let mut buffer = vec![GUARD_BYTE; GUARD + size + GUARD];
    let mut shadow = vec![GUARD_BYTE; size];
    let mut placed = vec![false; count as usize];
    let mut placed_n: u32 = 0;

    while let Some(op) = take(&mut input, 1).map(|b| b[0]) {
        now += 1_000;
        if op >= 0xf0 {
            match op & 3 {
                0 => {
                    let msg = CtrlMsg::FlowStop {
                        pass: 0,
                        segments_sent: count,
                    };
                    if let Ok(Some(reply)) = flow.on_ctrl(msg, now) {
                        check_reply(&reply, &placed, placed_n);
                    }
                }
                1 => {
                    let _ = flow.on_ctrl(CtrlMsg::FinishConfirm, now);
                }
                _ => {
                    while let Some(m) = flow.poll(now) {
                        check_reply(&m, &placed, placed_n);
                        if !matches!(m, CtrlMsg::FlowFinish { .. }) {
                            break;
                        }
                    }
                }
            }
            continue;
        }

        let Some(len) = take(&mut input, 2).map(u16_le) else {
            return;
        };
        let len = usize::from(len).min(input.len());
        let Some(raw) = take(&mut input, len) else {
            return;
        };
        let mut dg = raw.to_vec();
        if dg.len() >= header::HEADER_LEN {
            if op & 4 != 0 {
                // Aim at a segment boundary (or one past the last segment), sized like that
                // segment when it exists.
                let mut p = Packet::new_unchecked(&mut dg[..]);
                let index = p.offset() % (u64::from(count) + 1);
                p.set_offset(index * seg as u64);
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                if let Some((_, seg_len)) = layout.segment(index) {
                    dg.resize(header::HEADER_LEN + seg_len, 0x5a);
                }
            }
            let dg_len = dg.len();
            let mut p = Packet::new_unchecked(&mut dg[..]);
            if op & 1 != 0 {
                if let Ok(l) = u16::try_from(dg_len - header::HEADER_LEN) {
                    p.set_length(l);
                }
            }
            if op & 2 != 0 {
                p.set_version(header::VERSION);
                p.set_kind(1);
                p.set_job_id(JOB);
                p.set_tensor_id(TENSOR);
                p.set_round(ROUND);
            }
        }
        // TOS: the ECN bits and a DSCP from the op byte (CE when bit 3 is set).
        let tos = ((op & 0x70) << 1) | if op & 8 != 0 { 3 } else { 2 };

        let Ok(pkt) = Packet::new_checked(&dg[..]) else {
            continue;
        };
        let Ok(repr) = Repr::parse(&pkt) else {
            continue;
        };
        let payload = pkt.payload();
        let was_done = flow.is_done();
        let res = flow.on_data(&repr, payload, &mut buffer[GUARD..GUARD + size], tos, now);

        assert!(
            buffer[..GUARD].iter().all(|&b| b == GUARD_BYTE),
            "front guard overwritten by {repr:?} -> {res:?}"
        );
        assert!(
            buffer[GUARD + size..].iter().all(|&b| b == GUARD_BYTE),
            "back guard overwritten by {repr:?} -> {res:?}"
        );
        let tensor = &buffer[GUARD..GUARD + size];
        match res {
            Ok(new) => {
                assert!(!was_done, "data accepted after FinishConfirm: {repr:?}");
                let off = repr.offset;
                assert_eq!(off % seg as u64, 0, "accepted misaligned {repr:?}");
                let index = u32::try_from(off / seg as u64).unwrap_or(u32::MAX);
                assert_eq!(
                    layout.segment(index),
                    Some((off, payload.len())),
                    "accepted something that is not one segment: {repr:?}"
                );
                let (a, b) = (off as usize, off as usize + payload.len());
                let i = index as usize;
                if new {
                    assert!(!placed[i], "segment {index} placed twice as new");
                    placed[i] = true;
                    placed_n += 1;
                    assert_eq!(&tensor[a..b], payload, "payload not placed");
                    assert!(
                        tensor[..a] == shadow[..a] && tensor[b..] == shadow[b..],
                        "write outside [{a}, {b}) for {repr:?}"
                    );
                    shadow[a..b].copy_from_slice(payload);
                } else {
                    assert!(
                        placed[i],
                        "segment {index} reported duplicate, never placed"
                    );
                    assert!(
                        tensor == &shadow[..],
                        "duplicate {repr:?} wrote to the tensor"
                    );
                }
            }
            Err(e) => {
                assert!(
                    tensor == &shadow[..],
                    "rejected ({e:?}) {repr:?} wrote to the tensor"
                );
            }
        }
        assert_eq!(
            flow.bitmap().count_ones(),
            placed_n,
            "bitmap vs placed segments"
        );
    }
});

/// A message the receiver wants to send must agree with what was placed, and must encode.
fn check_reply(msg: &CtrlMsg, placed: &[bool], placed_n: u32) {
    match msg {
        CtrlMsg::RetransmitRequest { ranges, .. } => {
            let mut asked = vec![false; placed.len()];
            for r in ranges {
                for i in r.start..r.end() {
                    let slot = asked.get_mut(i as usize);
                    assert!(slot.is_some(), "retransmit of segment {i} past the end");
                    if let Some(s) = slot {
                        *s = true;
                    }
                }
            }
            for (i, (&p, &a)) in placed.iter().zip(&asked).enumerate() {
                assert_ne!(p, a, "segment {i}: placed {p}, retransmit asked {a}");
            }
        }
        CtrlMsg::FlowFinish { received_segments } => {
            assert_eq!(*received_segments, placed_n, "FlowFinish count");
        }
        _ => {}
    }
    assert!(
        msg.to_frame().is_ok(),
        "receiver produced unencodable {msg:?}"
    );
}
