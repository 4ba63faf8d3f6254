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

/// A peer's chunks held by node 0 (delivered, not yet taken) may not exceed this.
const BUDGET: usize = 1 << 20;

/// Node 0's channels with a peer budget of [`BUDGET`] and chunks of 128 KiB at most (the
/// budget holds several), node 1 as a raw endpoint (job `job`), and a 64 KiB chunk message.
fn budgeted(job: u32) -> (Endpoint, Channels, Vec<u8>) {
    let mut eps = endpoints(2, job, PEER_TIMEOUT);
    let raw = eps.pop().unwrap();
    let node = Channels::start(
        eps.pop().unwrap(),
        ChannelConfig {
            peer_budget: BUDGET,
            ..ChannelConfig::new(10, 128 << 10)
        },
    );
    let chunk = encode_chunk(b"r", &Tensor::from_f32(&values(16 * 1024)), Duration::ZERO).unwrap();
    (raw, node, chunk)
}

#[test]
fn a_peer_that_sends_faster_than_the_node_takes_is_failed_at_its_budget() {
    // Node 0 holds at most BUDGET bytes of node 1's chunks that it has not taken.
    let (raw, node, chunk) = budgeted(3);
    // Node 1 sends chunk after chunk of 64 KiB of values, 8 times the budget in all, while
    // node 0 takes none.
    let n = 8 * BUDGET / chunk.len() + 1;
    let sent: Vec<_> = (0..n).map(|_| raw_send(&raw, chunk.clone())).collect();
    // What node 0 holds for node 1, read off the events once node 1 has stopped: every
    // chunk's bytes until its channel failed (if it did).
    let mut held = 0usize;
    let mut failed = None;
    let deadline = std::time::Instant::now() + WAIT;
    while failed.is_none() && std::time::Instant::now() < deadline {
        match node.events().recv_timeout(Duration::from_secs(2)) {
            Ok(Event::Chunk(c)) => held += c.sample.bytes as usize,
            Ok(Event::Failed { peer, error, .. }) => failed = Some((peer, error)),
            Ok(other) => panic!("{other:?}"),
            // Nothing for 2 s: node 1 has sent all it could.
            Err(_) => break,
        }
    }
    let ok = sent.iter().filter(|h| h.test()).count();
    eprintln!(
        "node 1 sent {n} chunks of {} bytes ({} done); node 0 held {held} bytes of them; \
         failure: {failed:?}",
        chunk.len(),
        ok
    );
    let (peer, error) = failed.unwrap_or_else(|| {
        panic!("node 0 held {held} bytes of node 1's chunks, the budget {BUDGET}, and kept on")
    });
    assert_eq!(peer, 1);
    assert!(held <= BUDGET, "node 0 held {held} bytes, above {BUDGET}");
    // The channels' own count agrees: nothing was taken.
    assert_eq!(node.held(1), held);
    assert!(error.contains(&BUDGET.to_string()), "{error}");
    assert!(error.contains("rank 1"), "{error}");
    drop(sent);
}

#[test]
fn a_peer_at_most_a_round_ahead_of_a_node_that_takes_its_chunks_is_never_failed() {
    let (raw, node, chunk) = budgeted(5);
    // Node 1 sends rounds of 7 chunks (448 KiB, under half the budget), each once the
    // previous is delivered, so it is at most a round ahead of what node 0 has taken; 8
    // times the budget in all.
    let (per_round, rounds) = (7, 8 * BUDGET / (7 * chunk.len()) + 1);
    let sender = std::thread::spawn(move || {
        for _ in 0..rounds {
            let sent: Vec<_> = (0..per_round)
                .map(|_| raw_send(&raw, chunk.clone()))
                .collect();
            for h in sent {
                h.wait_timeout(WAIT).unwrap().unwrap();
            }
        }
        raw
    });
    let mut most = 0;
    for i in 0..per_round * rounds {
        match node.events().recv_timeout(WAIT) {
            Ok(Event::Chunk(c)) => {
                most = most.max(node.held(1));
                node.taken(c.from, c.sample.bytes);
            }
            other => panic!("chunk {i} of {}: {other:?}", per_round * rounds),
        }
    }
    eprintln!("node 0 held at most {most} bytes of node 1's chunks");
    assert!(most <= BUDGET);
    assert_eq!(node.held(1), 0);
    drop(sender.join().unwrap());
}

#[test]
fn relays_for_a_slow_next_hop_are_refused_at_the_budget_naming_who_asked() {
    // Node 0 relays node 2's auxiliary chunks to node 1, which receives nothing: beyond the
    // depth they wait in node 0's queue for node 1.
    let mut eps = endpoints(3, 4, PEER_TIMEOUT);
    let _two = eps.pop().unwrap();
    let _slow = eps.pop().unwrap();
    let mut node = Channels::start(
        eps.pop().unwrap(),
        ChannelConfig {
            peer_budget: BUDGET,
            // Chunks of 128 KiB at most: the budget holds several.
            ..ChannelConfig::new(10, 128 << 10)
        },
    );
    let out = Outgoing {
        meta: b"relay".to_vec(),
        data: Tensor::from_f32(&values(16 * 1024)),
    };
    let n = 8 * BUDGET / out.data.len_bytes() + gradwire_wan::channel::DEFAULT_DEPTH;
    let mut queued = 0usize;
    let mut refused = None;
    for _ in 0..n {
        match node.relay(1, &out, 2) {
            Ok(()) => queued += out.data.len_bytes(),
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    eprintln!(
        "node 0 accepted {queued} bytes of relays for node 1 ({} chunks in flight); refusal: \
         {refused:?}",
        node.in_flight(1)
    );
    let e = refused.unwrap_or_else(|| {
        panic!("node 0 queued {queued} bytes of relays for node 1, the budget {BUDGET}")
    });
    assert!(
        e.contains("node 2") && e.contains(&BUDGET.to_string()),
        "{e}"
    );
    assert!(node.queued_bytes(1) <= BUDGET, "{}", node.queued_bytes(1));
    // Node 0's own chunks are no relays: they still queue (they are bounded by its model).
    node.send(1, &out).unwrap();
}
