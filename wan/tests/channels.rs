//! The chunk channels on the message layer, against a peer that is a bare endpoint sending
//! whatever the test wants: a chunk arrives whole with its timing; a forged chunk (a header
//! that does not fit the message) ends the channel naming the peer; a chunk above the
//! receiver's bound is refused by the layer and never delivered, and the sender refuses to
//! send one; a peer that leaves closes its channel. Loopback, every wait bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::endpoints;
use gradwire_msg::core::SendOpts;
use gradwire_msg::endpoint::Endpoint;
use gradwire_msg::mem::Region;
use gradwire_msg::p2p::Send;
use gradwire_proto::tensor::Tensor;
use gradwire_wan::channel::{encode_chunk, ChannelConfig, Channels, Event, Outgoing, HEAD};

/// The endpoints' peer timeout: a silent peer is checked on after a quarter of it.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for an event that must come.
const WAIT: Duration = Duration::from_secs(20);

/// Node 0's channels (values up to `max_bytes` per chunk) and node 1 as a bare endpoint.
fn pair(max_bytes: usize) -> (Channels, Endpoint) {
    let mut eps = endpoints(2, 3, PEER_TIMEOUT);
    let raw = eps.pop().unwrap();
    let node = Channels::start(eps.pop().unwrap(), ChannelConfig::new(10, max_bytes));
    (node, raw)
}

fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.5).collect()
}

/// Node 1 sends `bytes` to node 0 as one message (not waiting for it).
fn raw_send(
    raw: &Endpoint,
    bytes: Vec<u8>,
) -> gradwire_msg::op::Handle<gradwire_msg::p2p::SendDone> {
    raw.submit(Send::new(Region::owned(bytes), 0, SendOpts::default()))
}

#[test]
fn a_chunk_arrives_whole_with_its_timing_and_a_peer_that_leaves_closes_the_channel() {
    let (node, raw) = pair(1 << 20);
    let v = values(3000);
    let msg = encode_chunk(b"hi", &Tensor::from_f32(&v), Duration::from_millis(5)).unwrap();
    let len = msg.len();
    raw_send(&raw, msg).wait_timeout(WAIT).unwrap().unwrap();
    match node.events().recv_timeout(WAIT).unwrap() {
        Event::Chunk(c) => {
            assert_eq!((c.from, c.meta.as_slice()), (1, &b"hi"[..]));
            assert_eq!(c.data.as_f32().unwrap(), &v[..]);
            assert_eq!(c.sample.bytes, (HEAD + 2 + 12_000) as u64);
            assert_eq!(len, HEAD + 2 + 12_000);
            assert_eq!(c.sample.sent_at, Duration::from_millis(5));
            // 12,017 bytes in segments of at most 1,432: 9 packets.
            assert_eq!(c.sample.packets, 9);
            assert!(
                c.sample.first_arrival <= c.sample.last_arrival,
                "{:?}",
                c.sample
            );
        }
        other => panic!("{other:?}"),
    }
    drop(raw);
    match node.events().recv_timeout(WAIT).unwrap() {
        Event::Closed { peer: 1 } => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_forged_chunk_ends_the_channel_naming_the_peer() {
    let (node, raw) = pair(1 << 20);
    let mut msg = encode_chunk(b"x", &Tensor::from_f32(&values(10)), Duration::ZERO).unwrap();
    msg[4] = 99; // no such dtype
    raw_send(&raw, msg);
    match node.events().recv_timeout(WAIT).unwrap() {
        Event::Failed { peer: 1, error, .. } => {
            assert!(error.contains("rank 1 sent invalid data"), "{error}");
            assert!(error.contains("unknown dtype code 99"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    // A header whose lengths do not add up to the message: refused the same way.
    let (node, raw) = pair(1 << 20);
    let mut msg = encode_chunk(b"x", &Tensor::from_f32(&values(10)), Duration::ZERO).unwrap();
    msg[0..4].copy_from_slice(&39u32.to_be_bytes());
    raw_send(&raw, msg);
    match node.events().recv_timeout(WAIT).unwrap() {
        Event::Failed { peer: 1, error, .. } => {
            assert!(error.contains("for a header saying"), "{error}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_chunk_above_the_bound_is_refused_never_delivered_and_never_sent() {
    // Node 0 posts receives of 1,000 bytes of values (and the header): node 1's chunk of
    // 4,000 is refused by the layer segment by segment, never placed nor delivered.
    let (mut node, raw) = pair(1000);
    let big = encode_chunk(b"", &Tensor::from_f32(&values(1000)), Duration::ZERO).unwrap();
    let _pending = raw_send(&raw, big);
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while std::time::Instant::now() < deadline {
        if let Ok(ev) = node.events().recv_timeout(Duration::from_millis(50)) {
            panic!("a chunk above the bound produced {ev:?}");
        }
    }
    let s = node.stats().core;
    assert!(s.refused > 0, "{s:?}");
    assert_eq!(s.data_placed, 0, "{s:?}");
    // The sending side refuses it before anything goes out.
    let out = Outgoing {
        meta: vec![],
        data: Tensor::from_f32(&values(251)),
    };
    let e = node.send(1, &out).unwrap_err();
    assert!(e.contains("above this job's 1000"), "{e}");
    // As it refuses a peer that is no other node.
    assert!(node.send(0, &out).is_err() && node.send(2, &out).is_err());
}

#[test]
fn chunks_beyond_the_receivers_depth_wait_and_go_in_order_as_slots_free() {
    let (mut node, raw) = pair(1 << 20);
    let n = 3 * gradwire_wan::channel::DEFAULT_DEPTH;
    for i in 0..n {
        let out = Outgoing {
            meta: vec![i as u8],
            data: Tensor::from_f32(&values(100 + i)),
        };
        node.send(1, &out).unwrap();
    }
    assert_eq!(node.in_flight(1), n);
    // Node 1 takes them one by one, as a chunk stream does.
    let rx = std::thread::spawn(move || {
        (0..n)
            .map(|_| {
                let opts = gradwire_msg::core::RecvOpts {
                    up_to: true,
                    ..Default::default()
                };
                let r = raw.run(
                    gradwire_msg::p2p::Recv::new(Region::owned(vec![0; 4096]), 0, opts),
                    WAIT,
                );
                let (region, report) = r.unwrap();
                let bytes = region.unwrap().into_vec().unwrap();
                let (_, _, meta) =
                    gradwire_wan::channel::decode_chunk(&bytes[..report.len as usize]).unwrap();
                meta[0]
            })
            .collect::<Vec<u8>>()
    });
    // Node 0 sends what waits as slots free, on each delivery.
    let mut delivered = 0;
    while delivered < n {
        match node.events().recv_timeout(WAIT).unwrap() {
            Event::Sent { to: 1 } => {
                delivered += 1;
                node.pump(1);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(node.in_flight(1), 0);
    let order = rx.join().unwrap();
    assert_eq!(order, (0..n as u8).collect::<Vec<_>>());
}
