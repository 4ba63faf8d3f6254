//! The core on a virtual clock: cores exchange datagrams through an in-memory network that
//! can drop them.

use std::time::{Duration, Instant};

use super::*;
use crate::mem::Region;

/// Decides whether the n-th datagram (counting all) is dropped.
type Drop = Box<dyn FnMut(u64, &[u8]) -> bool>;

struct Net {
    cores: Vec<Core>,
    now: Instant,
    sent: u64,
    dropped: u64,
    drop: Drop,
    /// Datagrams in flight: (to, from, tos, bytes).
    wire: Vec<(u16, u16, u8, Vec<u8>)>,
    /// Every datagram put on the wire (dropped ones too), as (tos, bytes), when tracing.
    trace: Option<Vec<(u8, Vec<u8>)>>,
    events: Vec<Vec<Event>>,
}

impl Net {
    fn new(world: u16, drop: Drop) -> Net {
        Net::with(world, drop, |_| {})
    }

    fn with(world: u16, drop: Drop, tweak: impl Fn(&mut CoreConfig)) -> Net {
        let cores = (0..world)
            .map(|r| {
                let mut c = CoreConfig::new(9, r, world);
                c.seg_payload = 64;
                c.peer_timeout = Duration::from_secs(2);
                tweak(&mut c);
                Core::new(c)
            })
            .collect();
        Net {
            cores,
            now: Instant::now(),
            sent: 0,
            dropped: 0,
            drop,
            wire: Vec::new(),
            trace: None,
            events: (0..world).map(|_| Vec::new()).collect(),
        }
    }

    /// Moves every pending datagram once; returns whether anything moved.
    fn step(&mut self) -> bool {
        let mut batch = TxBatch::default();
        for (r, core) in self.cores.iter_mut().enumerate() {
            core.poll_transmit(self.now, &mut batch, 16);
            for c in batch.ctrl.drain(..) {
                self.wire.push((c.peer, r as u16, c.tos, c.bytes));
            }
            for b in &batch.bundles {
                for s in b.segs.clone() {
                    let (buf, range) = batch.payloads[s].clone();
                    let mut d = batch.headers[s].to_vec();
                    d.extend_from_slice(core.buffers().get(buf, range).expect("payload"));
                    assert!(
                        d.len() <= b.segment_size,
                        "a segment longer than its bundle's size"
                    );
                    self.wire.push((b.peer, r as u16, b.tos, d));
                }
            }
        }
        let moved = !self.wire.is_empty();
        for (to, from, tos, d) in std::mem::take(&mut self.wire) {
            if let Some(t) = &mut self.trace {
                t.push((tos, d.clone()));
            }
            self.sent += 1;
            if (self.drop)(self.sent, &d) {
                self.dropped += 1;
                continue;
            }
            self.cores[usize::from(to)].handle_datagram(self.now, from, tos, &d);
        }
        for (r, core) in self.cores.iter_mut().enumerate() {
            while let Some(e) = core.poll_event() {
                self.events[r].push(e);
            }
        }
        moved
    }

    /// Runs until quiet, advancing the clock to the next timer when nothing moves, until
    /// `limit` of virtual time passed.
    fn run(&mut self, limit: Duration) {
        self.run_with(limit, |_| true);
    }

    /// As [`Net::run`], calling `after_step` after every step that moved datagrams; it
    /// returns `false` to stop.
    fn run_with(&mut self, limit: Duration, mut after_step: impl FnMut(&mut Net) -> bool) {
        let end = self.now + limit;
        while self.now < end {
            if self.step() {
                self.now += Duration::from_micros(20);
                if !after_step(self) {
                    return;
                }
                continue;
            }
            match self.cores.iter().filter_map(Core::next_timeout).min() {
                Some(t) if t < end => {
                    self.now = t.max(self.now);
                    for c in &mut self.cores {
                        c.handle_timeout(self.now);
                    }
                }
                _ => break,
            }
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Rank 0 sends `data` to rank 1 as message 0; returns rank 1's buffer id.
fn one_message(net: &mut Net, data: &[u8], opts: RecvOpts) -> BufId {
    let now = net.now;
    let src = net.cores[0].register(Region::owned(data.to_vec()));
    let dst = net.cores[1].register(Region::owned(vec![0; data.len()]));
    assert_eq!(net.cores[0].reserve_sends(1, 1), Ok(0));
    assert_eq!(net.cores[1].reserve_recvs(0, 1), Ok(0));
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..data.len(), opts)
        .expect("post recv");
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("post send");
    dst
}

fn received(net: &Net, rank: usize) -> Vec<RecvReport> {
    net.events[rank]
        .iter()
        .filter_map(|e| match e {
            Event::Received { report, .. } => Some(report.clone()),
            _ => None,
        })
        .collect()
}

/// Every failure `rank` saw, sends and receives, in order.
fn failures(net: &Net, rank: usize) -> Vec<MsgError> {
    net.events[rank]
        .iter()
        .filter_map(|e| match e {
            Event::Failed { error, .. } => Some(error.clone()),
            _ => None,
        })
        .collect()
}

fn sent(net: &Net, rank: usize) -> usize {
    net.events[rank]
        .iter()
        .filter(|e| matches!(e, Event::Sent { .. }))
        .count()
}

#[test]
fn a_message_arrives_whole_with_little_control() {
    let mut net = Net::new(2, Box::new(|_, _| false));
    let data = pattern(64 * 1000 + 17, 3);
    let dst = one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_secs(1));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    let r = received(&net, 1);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].missing, r[0].ended), (0, Ended::Complete));
    assert_eq!(sent(&net, 0), 1);
    let s0 = net.cores[0].stats().clone();
    let s1 = net.cores[1].stats().clone();
    assert_eq!(s0.data_sent, 1001);
    assert_eq!(s0.data_resent, 0);
    // ACK every 32 segments and one DONE: 3 % of the data frames.
    assert!(
        s1.ctrl_sent * 10 < s0.data_sent,
        "{} control frames",
        s1.ctrl_sent
    );
}

#[test]
fn lost_segments_are_resent_until_nothing_is_missing() {
    let mut net = Net::new(2, Box::new(|n, d| d[1] == wire::KIND_DATA && n % 7 == 3));
    let data = pattern(64 * 500, 1);
    let dst = one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_secs(2));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    assert_eq!(received(&net, 1)[0].ended, Ended::Complete);
    assert_eq!(sent(&net, 0), 1);
    assert!(net.cores[0].stats().data_resent > 0);
    assert!(net.cores[1].stats().nacks > 0);
}

#[test]
fn a_bound_ends_the_message_with_at_most_p_missing() {
    let mut net = Net::new(2, Box::new(|n, d| d[1] == wire::KIND_DATA && n % 20 == 0));
    let data = pattern(64 * 1000, 5);
    let opts = RecvOpts {
        loss_bound: 0.1,
        ..RecvOpts::default()
    };
    let dst = one_message(&mut net, &data, opts);
    net.run(Duration::from_secs(2));
    let r = received(&net, 1);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].ended, Ended::Bound);
    assert!(
        r[0].missing > 0 && r[0].missing <= 100,
        "missing {}",
        r[0].missing
    );
    assert_eq!(
        net.cores[0].stats().data_resent,
        0,
        "nothing resent under the bound"
    );
    let got = net.cores[1].buffer(dst).expect("buffer");
    for seg in 0..1000 {
        let range = seg * 64..seg * 64 + 64;
        if r[0].has(seg) {
            assert_eq!(got[range.clone()], data[range]);
        } else {
            assert!(
                got[range].iter().all(|&b| b == 0),
                "a missing segment was written"
            );
        }
    }
    assert_eq!(sent(&net, 0), 1);
}

#[test]
fn lost_control_is_recovered_by_poll_on_a_millisecond_timer() {
    // Drop every control frame for the first 5 ms of virtual time.
    let start = Instant::now();
    let clock = std::rc::Rc::new(std::cell::Cell::new(start));
    let c2 = clock.clone();
    let mut net = Net::new(
        2,
        Box::new(move |_, d| {
            d[1] == wire::KIND_CTRL && c2.get() < start + Duration::from_millis(5)
        }),
    );
    net.now = start;
    let data = pattern(64 * 10, 2);
    let dst = one_message(&mut net, &data, RecvOpts::default());
    let end = start + Duration::from_secs(1);
    while net.now < end && sent(&net, 0) == 0 {
        clock.set(net.now);
        net.run(Duration::from_millis(1));
        if !net.step() {
            net.now += Duration::from_millis(1);
            for c in &mut net.cores {
                c.handle_timeout(net.now);
            }
        }
    }
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    assert_eq!(sent(&net, 0), 1);
    assert!(net.cores[0].stats().polls > 0);
    assert!(
        net.now < start + Duration::from_millis(60),
        "recovered only after {:?}: a TCP-like 200 ms RTO",
        net.now - start
    );
}

#[test]
fn data_before_the_receive_is_posted_is_kept_and_placed() {
    let mut net = Net::new(2, Box::new(|_, _| false));
    let data = pattern(64 * 40, 9);
    let src = net.cores[0].register(Region::owned(data.clone()));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    let now = net.now;
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("send");
    net.run(Duration::from_millis(3));
    assert!(net.cores[1].stats().unexpected_kept >= 40);
    assert_eq!(sent(&net, 0), 0);
    let dst = net.cores[1].register(Region::owned(vec![0; data.len()]));
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    let now = net.now;
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..data.len(), RecvOpts::default())
        .expect("recv");
    net.run(Duration::from_secs(1));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    assert_eq!(sent(&net, 0), 1);
}

#[test]
fn sum_placement_adds_each_segment_once() {
    let mut net = Net::new(2, Box::new(|n, d| d[1] == wire::KIND_DATA && n % 5 == 0));
    let vals: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let opts = RecvOpts {
        place: Place::Reduce(crate::reduce::Combine::Sum, DType::F32),
        ..RecvOpts::default()
    };
    let now = net.now;
    let src = net.cores[0].register(Region::owned(bytes.clone()));
    let dst = net.cores[1].register(Region::owned(bytes.clone()));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..bytes.len(), opts)
        .expect("recv");
    net.cores[0]
        .post_send(now, 1, 0, src, 0..bytes.len(), SendOpts::default())
        .expect("send");
    net.run(Duration::from_secs(1));
    let got = net.cores[1].buffer(dst).expect("buffer");
    for (i, c) in got.chunks_exact(4).enumerate() {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        assert_eq!(v, 2.0 * i as f32, "element {i}");
    }
}

#[test]
fn forged_and_malformed_datagrams_are_refused_and_never_placed() {
    let mut net = Net::with(3, Box::new(|_, _| false), |_| {});
    let dst = net.cores[1].register(Region::owned(vec![0; 128]));
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    let now = net.now;
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..128, RecvOpts::default())
        .expect("recv");
    let good = DataHeader {
        flags: 0,
        pass: 0,
        job: 9,
        src: 0,
        dst: 1,
        msg: 0,
        offset: 0,
        total: 128,
        length: 64,
        layer: 0,
        meta: 0,
    };
    let frame = |h: DataHeader| {
        let mut b = [0u8; wire::DATA_HEADER_LEN];
        h.emit(&mut b);
        let mut v = b.to_vec();
        v.extend(std::iter::repeat_n(0xAB, usize::from(h.length)));
        v
    };
    let core = &mut net.cores[1];
    // Rank 2 claims to be rank 0; another job; another receiver; a misaligned offset; a
    // wrong total; a short middle segment; garbage.
    core.handle_datagram(now, 2, 0, &frame(good));
    core.handle_datagram(now, 0, 0, &frame(DataHeader { job: 8, ..good }));
    core.handle_datagram(now, 0, 0, &frame(DataHeader { dst: 2, ..good }));
    core.handle_datagram(
        now,
        0,
        0,
        &frame(DataHeader {
            offset: 8,
            length: 8,
            ..good
        }),
    );
    core.handle_datagram(now, 0, 0, &frame(DataHeader { total: 192, ..good }));
    core.handle_datagram(now, 0, 0, &frame(DataHeader { length: 32, ..good }));
    core.handle_datagram(now, 0, 0, &[1, 3, 0, 0, 0, 0, 0, 9]);
    core.handle_datagram(now, 7, 0, &frame(good));
    assert_eq!(core.stats().refused, 8);
    assert_eq!(core.stats().data_placed, 0);
    assert!(core.buffer(dst).expect("buffer").iter().all(|&b| b == 0));
    // Far ahead of anything reserved: dropped, not kept.
    core.handle_datagram(
        now,
        0,
        0,
        &frame(DataHeader {
            msg: 1 << 30,
            ..good
        }),
    );
    assert_eq!(core.stats().unexpected_dropped, 1);
    // The genuine segment is placed once; its duplicate is counted.
    core.handle_datagram(now, 0, 0, &frame(good));
    core.handle_datagram(now, 0, 0, &frame(good));
    assert_eq!(core.stats().data_placed, 1);
    assert_eq!(core.stats().data_duplicate, 1);
}

#[test]
fn a_silent_peer_fails_the_message_naming_it() {
    let mut net = Net::new(2, Box::new(|_, _| true));
    let data = pattern(64 * 4, 0);
    one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_secs(5));
    let failed: Vec<_> = net.events[0]
        .iter()
        .filter_map(|e| match e {
            Event::Failed {
                peer,
                send: true,
                error,
                ..
            } => Some((*peer, error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, 1);
    assert!(matches!(
        failed[0].1,
        MsgError::PeerSilent {
            peer: 1,
            alive: false,
            ..
        }
    ));
    let recv_failed = net.events[1].iter().any(|e| {
        matches!(
            e,
            Event::Failed {
                peer: 0,
                send: false,
                ..
            }
        )
    });
    assert!(recv_failed, "the receiver names the silent sender too");
}

#[test]
fn a_deadline_ends_the_receive_with_what_arrived() {
    // Every retransmission is lost: only the deadline can end it.
    let mut net = Net::new(
        2,
        Box::new(|n, d| d[1] == wire::KIND_DATA && (d[2] & 1 != 0 || n == 2)),
    );
    let data = pattern(64 * 10, 4);
    let opts = RecvOpts {
        deadline: Some(net.now + Duration::from_millis(20)),
        ..RecvOpts::default()
    };
    one_message(&mut net, &data, opts);
    net.run(Duration::from_millis(100));
    let r = received(&net, 1);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].ended, Ended::Deadline);
    assert_eq!(r[0].missing, 1);
    assert_eq!(sent(&net, 0), 1, "the sender hears DONE");
}

#[test]
fn empty_messages_are_tokens() {
    let mut net = Net::new(2, Box::new(|_, _| false));
    one_message(&mut net, &[], RecvOpts::default());
    net.run(Duration::from_millis(10));
    assert_eq!(received(&net, 1).len(), 1);
    assert_eq!(sent(&net, 0), 1);
}

#[test]
fn a_live_peer_that_never_receives_fails_the_send_as_alive_not_dead() {
    let mut net = Net::new(2, Box::new(|_, _| false));
    let data = pattern(64 * 4, 0);
    let src = net.cores[0].register(Region::owned(data.clone()));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    let now = net.now;
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("send");
    // Rank 1 keeps the data and answers every POLL, but never posts the receive.
    net.run(Duration::from_secs(5));
    let failed = failures(&net, 0);
    assert_eq!(failed.len(), 1, "{failed:?}");
    match &failed[0] {
        MsgError::PeerSilent {
            peer: 1,
            alive: true,
            waited,
            ..
        } => {
            assert!(*waited >= Duration::from_secs(2), "failed after {waited:?}")
        }
        other => panic!("{other:?}"),
    }
    assert!(failed[0].to_string().contains("alive but made no progress"));
}

#[test]
fn segments_tagged_differently_go_in_separate_bundles_with_their_own_tos() {
    let mut cfg = CoreConfig::new(9, 0, 2);
    cfg.seg_payload = 64;
    let mut core = Core::new(cfg);
    let now = Instant::now();
    let buf = core.register(Region::owned(pattern(64 * 5, 1)));
    core.reserve_sends(1, 1).expect("peer");
    let tags = vec![0x0a, 0x0a, 0xb8, 0xb8, 0x0a];
    let opts = SendOpts {
        tos: 0,
        tos_per_segment: tags.clone(),
        ..SendOpts::default()
    };
    core.post_send(now, 1, 0, buf, 0..64 * 5, opts)
        .expect("send");
    let mut tx = TxBatch::default();
    core.poll_transmit(now, &mut tx, 16);
    let got: Vec<(u8, usize)> = tx.bundles.iter().map(|b| (b.tos, b.segs.len())).collect();
    // Then the LAST segment's second copy (TAIL_COPY_MIN_SEGS), tagged as itself.
    assert_eq!(got, vec![(0x0a, 2), (0xb8, 2), (0x0a, 1), (0x0a, 1)]);
    for (s, hb) in tx.headers.iter().enumerate() {
        let (h, _) = DataHeader::parse(&[&hb[..], &vec![0u8; 64][..]].concat()).expect("header");
        let important = h.flags & wire::flags::IMPORTANT != 0;
        let seg = (h.offset / 64) as usize;
        assert_eq!(seg, s.min(4), "segment {s}");
        assert_eq!(important, tags[seg] & 3 != 0, "segment {s}");
    }
    let bad = SendOpts {
        tos_per_segment: vec![0; 3],
        ..SendOpts::default()
    };
    core.reserve_sends(1, 1).expect("peer");
    assert!(matches!(
        core.post_send(now, 1, 1, buf, 0..64 * 5, bad),
        Err(PostError::Meta { got: 3, want: 5 })
    ));
}

#[test]
fn an_up_to_receive_learns_its_length_even_when_the_first_segments_are_lost() {
    // Every segment of the first pass is lost: the receiver knows no length when the
    // sender polls, asks for segment 0, learns the length from it and NACKs the rest.
    let mut net = Net::new(2, Box::new(|_, d| d[1] == wire::KIND_DATA && d[3] == 0));
    let data = pattern(64 * 10 + 5, 6);
    let now = net.now;
    let src = net.cores[0].register(Region::owned(data.clone()));
    let dst = net.cores[1].register(Region::owned(vec![0; 64 * 100]));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    let opts = RecvOpts {
        up_to: true,
        ..RecvOpts::default()
    };
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..64 * 100, opts)
        .expect("recv");
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("send");
    net.run(Duration::from_secs(2));
    let r = received(&net, 1);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].len, r[0].segments, r[0].missing), (645, 11, 0));
    assert_eq!(&net.cores[1].buffer(dst).expect("buffer")[..645], &data[..]);
    assert_eq!(sent(&net, 0), 1);

    // A message longer than the posted range is refused, never placed.
    let mut net = Net::new(2, Box::new(|_, _| false));
    let now = net.now;
    let src = net.cores[0].register(Region::owned(pattern(200, 1)));
    let dst = net.cores[1].register(Region::owned(vec![0; 100]));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    let opts = RecvOpts {
        up_to: true,
        ..RecvOpts::default()
    };
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..100, opts)
        .expect("recv");
    net.cores[0]
        .post_send(now, 1, 0, src, 0..200, SendOpts::default())
        .expect("send");
    net.run(Duration::from_millis(50));
    assert!(net.cores[1].stats().refused > 0);
    assert_eq!(net.cores[1].stats().data_placed, 0);
    assert!(received(&net, 1).is_empty());
}

#[test]
fn an_abort_fails_the_peers_side_at_once_naming_the_culprit() {
    let mut net = Net::new(3, Box::new(|_, d| d[1] == wire::KIND_DATA));
    let data = pattern(64 * 8, 2);
    one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_millis(2));
    // Rank 1's operation failed on rank 2: it gives up its receive and says why.
    net.cores[1].abort(0, 0, false, Some(2));
    net.run(Duration::from_millis(2));
    let failed: Vec<_> = net.events[0]
        .iter()
        .filter_map(|e| match e {
            Event::Failed {
                error, send: true, ..
            } => Some(error.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        failed,
        vec![MsgError::Aborted {
            peer: 1,
            msg: 0,
            culprit: Some(2)
        }]
    );
    assert!(failed[0].to_string().contains("failed on rank 2"));
    // Idempotent: the message is gone on both sides; a second abort sends nothing.
    let before = net.cores[1].stats().ctrl_sent;
    net.cores[1].abort(0, 0, false, Some(2));
    assert_eq!(net.cores[1].stats().ctrl_sent, before);
}

#[test]
fn an_abort_before_the_receive_is_posted_fails_it_when_it_is() {
    let mut net = Net::new(3, Box::new(|_, _| false));
    let data = pattern(64 * 4, 3);
    let now = net.now;
    let src = net.cores[0].register(Region::owned(data.clone()));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("send");
    net.run(Duration::from_millis(1));
    // Rank 0's operation fails on rank 2 before rank 1 even posted the receive.
    net.cores[0].abort(1, 0, true, Some(2));
    net.run(Duration::from_millis(1));
    let dst = net.cores[1].register(Region::owned(vec![0; data.len()]));
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    let now = net.now;
    assert_eq!(
        net.cores[1].post_recv(now, 0, 0, dst, 0..data.len(), RecvOpts::default()),
        Ok(()),
        "posting an aborted message is not a caller's mistake"
    );
    net.run(Duration::from_millis(1));
    let failed: Vec<_> = net.events[1]
        .iter()
        .filter_map(|e| match e {
            Event::Failed {
                error, send: false, ..
            } => Some(error.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        failed,
        vec![MsgError::Aborted {
            peer: 0,
            msg: 0,
            culprit: Some(2)
        }]
    );
    assert!(
        received(&net, 1).is_empty(),
        "the kept data is not delivered"
    );
}

#[test]
fn a_full_window_whose_segments_were_all_lost_does_not_stall() {
    // A two-segment window: the first two segments are lost, so no ACK can ever come. The
    // sender must count them lost after an RTO and go on (they come back in a NACK pass).
    let mut net = Net::with(
        2,
        Box::new(|_, d| {
            d[1] == wire::KIND_DATA && d[3] == 0 && {
                let off =
                    u64::from_be_bytes([d[16], d[17], d[18], d[19], d[20], d[21], d[22], d[23]]);
                off < 128
            }
        }),
        |c| c.init_cwnd = 2,
    );
    let data = pattern(64 * 10, 7);
    let dst = one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_secs(1));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    assert_eq!(sent(&net, 0), 1, "the send completed");
    assert!(
        net.now < Instant::now() + Duration::from_millis(500),
        "no long stall"
    );
}

/// A sender whose message lasts many round trips (a 16-segment window, ACKs every 4), as a
/// large message on a real path does: gap NACKs reach it before its pass ends. (On the
/// virtual network a round trip is one step, and the default window sends a small
/// message's whole pass in one.)
fn ack_clocked(c: &mut CoreConfig) {
    c.init_cwnd = 16;
    c.max_cwnd = 16;
    c.ack_every = 4;
}

/// Drops the first transmission of the data segments (of 64 bytes) that `lose` picks.
fn drop_first_tx(lose: impl Fn(u64) -> bool + 'static) -> Drop {
    Box::new(move |_, d| {
        wire::DataHeader::parse(d)
            .is_ok_and(|(h, _)| h.flags & wire::flags::RETRANSMIT == 0 && lose(h.offset / 64))
    })
}

#[test]
fn a_gap_is_resent_within_the_first_pass() {
    // Segment 20 of 200 lost once: a gap NACK brings it back before the pass ends, so the
    // message needs no second pass and no end-of-pass NACK.
    let data = pattern(64 * 200, 4);
    let run = |reorder: u32| {
        let mut net = Net::with(2, drop_first_tx(|seg| seg == 20), |c| {
            c.gap_reorder = reorder;
            ack_clocked(c);
        });
        let dst = one_message(&mut net, &data, RecvOpts::default());
        net.run(Duration::from_secs(1));
        assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
        let r = received(&net, 1);
        assert_eq!((r.len(), r[0].ended, r[0].missing), (1, Ended::Complete, 0));
        (net.cores[0].stats().clone(), net.cores[1].stats().clone())
    };
    let (s0, s1) = run(16);
    assert_eq!((s1.gap_nacks, s1.nacks), (1, 0));
    assert_eq!((s0.gap_resent, s0.data_resent), (1, 1));
    // Without gap NACKs the same loss costs a second pass.
    let (s0, s1) = run(0);
    assert_eq!((s1.gap_nacks, s1.nacks), (0, 1));
    assert_eq!((s0.gap_resent, s0.data_resent), (0, 1));
}

#[test]
fn gap_nacks_ask_only_for_what_the_bound_cannot_absorb() {
    // 1000 segments under a 1 % bound may lose 10: of 30 early losses 20 are asked for.
    let lose = drop_first_tx(|seg| seg < 900 && seg % 30 == 7);
    let mut net = Net::with(2, lose, ack_clocked);
    let data = pattern(64 * 1000, 6);
    let opts = RecvOpts {
        loss_bound: 0.01,
        ..RecvOpts::default()
    };
    let dst = one_message(&mut net, &data, opts);
    net.run(Duration::from_secs(1));
    let r = received(&net, 1);
    assert_eq!((r.len(), r[0].ended, r[0].missing), (1, Ended::Bound, 10));
    let (s0, s1) = (net.cores[0].stats(), net.cores[1].stats());
    assert_eq!((s0.gap_resent, s0.data_resent), (20, 20));
    assert_eq!(s1.nacks, 0, "no end-of-pass NACK");
    let got = net.cores[1].buffer(dst).expect("buffer");
    for seg in 0..1000 {
        let range = seg * 64..seg * 64 + 64;
        if r[0].has(seg) {
            assert_eq!(got[range.clone()], data[range]);
        }
    }
}

#[test]
fn a_gap_nack_after_the_pass_ended_or_for_unsent_segments_changes_nothing() {
    let mut net = Net::new(2, Box::new(|_, _| false));
    let data = pattern(64 * 100, 7);
    let _ = one_message(&mut net, &data, RecvOpts::default());
    // Before anything was sent: segments the sender has not sent yet are not resent.
    let mut c = Ctrl {
        op: CtrlOp::Nack,
        pass: 0,
        job: 9,
        src: 1,
        dst: 0,
        msg: 0,
        a: 0,
        b: 8,
        c: wire::NACK_GAP,
    };
    let mut frame = vec![0u8; wire::CTRL_HEADER_LEN + 1];
    c.emit(&[0xff], &mut frame).expect("emit");
    let now = net.now;
    net.cores[0].handle_datagram(now, 1, 0, &frame);
    assert_eq!(net.cores[0].stats().gap_resent, 0);
    net.run(Duration::from_secs(1));
    assert_eq!(sent(&net, 0), 1);
    // After the message: ignored (control frames are idempotent).
    c.pass = 1;
    c.emit(&[0xff], &mut frame).expect("emit");
    let now = net.now;
    net.cores[0].handle_datagram(now, 1, 0, &frame);
    assert_eq!(net.cores[0].stats().gap_resent, 0);
    assert_eq!(net.cores[0].stats().data_resent, 0);
}

/// Rank 1 posts receive 0 from rank 0 (any length up to 64 x 8 bytes) with `patient`.
fn post_stream_recv(net: &mut Net, patient: bool) -> BufId {
    let now = net.now;
    let dst = net.cores[1].register(Region::owned(vec![0; 64 * 8]));
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    let opts = RecvOpts {
        up_to: true,
        patient,
        ..RecvOpts::default()
    };
    net.cores[1]
        .post_recv(now, 0, 0, dst, 0..64 * 8, opts)
        .expect("recv");
    dst
}

fn recv_failures(net: &Net) -> Vec<MsgError> {
    net.events[1]
        .iter()
        .filter_map(|e| match e {
            Event::Failed {
                send: false, error, ..
            } => Some(error.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_patient_receive_waits_while_its_peer_answers_and_fails_once_it_is_silent() {
    // A live sender with nothing to send for 2.5 peer timeouts: the patient receive keeps
    // waiting (the sender answers its PINGs), then takes the message when it comes.
    let mut net = Net::new(2, Box::new(|_, _| false));
    let dst = post_stream_recv(&mut net, true);
    net.run(Duration::from_secs(5));
    assert!(recv_failures(&net).is_empty(), "{:?}", net.events[1]);
    assert!(net.cores[1].stats().ctrl_received > 0, "no PONG came back");
    let data = pattern(64 * 3 + 7, 2);
    let src = net.cores[0].register(Region::owned(data.clone()));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    let now = net.now;
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("send");
    net.run(Duration::from_secs(1));
    let r = received(&net, 1);
    assert_eq!((r.len(), r[0].len, r[0].missing), (1, data.len() as u32, 0));
    assert_eq!(
        &net.cores[1].buffer(dst).expect("buffer")[..data.len()],
        &data[..]
    );

    // The same wait without `patient` fails: the message made no progress.
    let mut net = Net::new(2, Box::new(|_, _| false));
    post_stream_recv(&mut net, false);
    net.run(Duration::from_secs(5));
    let f = recv_failures(&net);
    assert!(
        matches!(
            f.as_slice(),
            [MsgError::PeerSilent {
                peer: 0,
                alive: true,
                ..
            }]
        ),
        "{f:?}"
    );

    // A dead sender (nothing of it arrives) fails the patient receive after the peer
    // timeout, as dead.
    let mut net = Net::new(2, Box::new(|_, _| true));
    post_stream_recv(&mut net, true);
    net.run(Duration::from_secs(5));
    match recv_failures(&net).as_slice() {
        [MsgError::PeerSilent {
            peer: 0,
            alive: false,
            waited,
            ..
        }] => assert!(*waited >= Duration::from_secs(2), "failed after {waited:?}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_report_times_the_first_and_last_arrival_even_of_data_kept_before_posting() {
    // The third datagram (a data segment) is lost: its resend, after the pass's NACK, is
    // the last to arrive, later than the first.
    let mut net = Net::new(2, Box::new(|n, d| d[1] == wire::KIND_DATA && n == 3));
    let start = net.now;
    one_message(&mut net, &pattern(64 * 10, 1), RecvOpts::default());
    net.run(Duration::from_secs(1));
    let r = received(&net, 1);
    let (first, last) = (r[0].first_at.expect("first"), r[0].last_at.expect("last"));
    assert!(
        start <= first && first < last,
        "{start:?} {first:?} {last:?}"
    );

    // Data kept before the receive is posted: the arrivals, not the posting.
    let mut net = Net::new(2, Box::new(|_, _| false));
    let data = pattern(64 * 4, 3);
    let src = net.cores[0].register(Region::owned(data.clone()));
    net.cores[0].reserve_sends(1, 1).expect("peer");
    let now = net.now;
    net.cores[0]
        .post_send(now, 1, 0, src, 0..data.len(), SendOpts::default())
        .expect("send");
    net.run(Duration::from_millis(3));
    net.now += Duration::from_millis(50);
    let posted = net.now;
    let dst = net.cores[1].register(Region::owned(vec![0; data.len()]));
    net.cores[1].reserve_recvs(0, 1).expect("peer");
    net.cores[1]
        .post_recv(posted, 0, 0, dst, 0..data.len(), RecvOpts::default())
        .expect("recv");
    net.run(Duration::from_secs(1));
    let r = received(&net, 1);
    let (first, last) = (r[0].first_at.expect("first"), r[0].last_at.expect("last"));
    assert!(
        first <= last && last < posted,
        "{first:?} {last:?} posted {posted:?}"
    );
}

/// Four senders (ranks 1-4) each send `segs` segments to rank 0 at once; returns the data
/// segments that reached rank 0 in each step of the network that moved any (segments in
/// flight towards it per round trip) and the net. `lose_grants`: GRANT frames to drop
/// first.
fn incast(
    segs: usize,
    tweak: impl Fn(&mut CoreConfig) + 'static,
    lose_grants: u32,
) -> (Vec<usize>, Net) {
    use std::cell::Cell;
    use std::rc::Rc;
    let arrivals = Rc::new(Cell::new(0usize));
    let grants_left = Rc::new(Cell::new(lose_grants));
    let (a, g) = (arrivals.clone(), grants_left.clone());
    let drop: Drop = Box::new(move |_, d| {
        let data_to_0 = d[1] == wire::KIND_DATA && d[10..12] == [0, 0];
        if data_to_0 {
            a.set(a.get() + 1);
        }
        let grant = d[1] == wire::KIND_CTRL && d[2] == CtrlOp::Grant as u8;
        if grant && g.get() > 0 {
            g.set(g.get() - 1);
            return true;
        }
        false
    });
    let mut net = Net::with(5, drop, move |c| {
        c.init_cwnd = 64;
        c.max_cwnd = 64;
        c.ack_every = 8;
        c.grants = true;
        tweak(c);
    });
    let len = segs * 64;
    let dst = net.cores[0].register(Region::owned(vec![0; 4 * len]));
    let now = net.now;
    for s in 1..5u16 {
        let data = pattern(len, s as u8);
        let src = net.cores[usize::from(s)].register(Region::owned(data));
        net.cores[usize::from(s)].reserve_sends(0, 1).expect("peer");
        net.cores[0].reserve_recvs(s, 1).expect("peer");
        let at = (usize::from(s) - 1) * len;
        net.cores[0]
            .post_recv(now, s, 0, dst, at..at + len, RecvOpts::default())
            .expect("recv");
        net.cores[usize::from(s)]
            .post_send(now, 0, 0, src, 0..len, SendOpts::default())
            .expect("send");
    }
    let mut per_step = Vec::new();
    net.run_with(Duration::from_secs(5), |net| {
        if arrivals.get() > 0 {
            per_step.push(arrivals.replace(0));
        }
        received(net, 0).len() < 4
    });
    for s in 1..5usize {
        let at = (s - 1) * len;
        assert_eq!(
            net.cores[0].buffer(dst).expect("buf")[at..at + len],
            pattern(len, s as u8)[..],
            "sender {s}'s message"
        );
    }
    assert_eq!(received(&net, 0).len(), 4);
    (per_step, net)
}

#[test]
fn receiver_grants_hold_an_incast_to_the_receivers_budget() {
    // Without grants every sender offers its own window: 4 x 64 segments per round trip.
    let (ungranted, net) = incast(400, |c| c.grants = false, 0);
    assert_eq!(net.cores[0].stats().grants, 0);
    assert_eq!(ungranted[0], 4 * 64, "{ungranted:?}");
    // With grants the four share the receiver's budget (32, growing to its max_cwnd, 64):
    // 4 x 8 unscheduled segments first, then their shares.
    let (granted, net) = incast(
        400,
        |c| {
            c.unscheduled = 8;
            c.grant_window = 32;
        },
        0,
    );
    assert!(net.cores[0].stats().grants > 0);
    assert_eq!(granted[0], 4 * 8, "{granted:?}");
    assert!(
        granted.iter().all(|&n| n <= 64),
        "{granted:?} (budget at most 64)"
    );
    for s in 1..5 {
        assert_eq!(net.cores[s].stats().data_resent, 0, "nothing was lost");
        let g = net.cores[s].granted_by(0).expect("a grant");
        assert!(
            (4..=32).contains(&g),
            "sender {s} was granted {g}: a share, not the budget"
        );
    }
    // A GRANT per share change, not per segment: 4 senders x 400 segments took a few.
    assert!(
        net.cores[0].stats().grants <= 16,
        "{} grants",
        net.cores[0].stats().grants
    );
}

#[test]
fn lost_grants_leave_the_senders_on_the_window_they_had_and_cost_no_hang() {
    // The first 6 GRANTs are lost: the senders keep what they had (their unscheduled 8, or
    // an older share) until a later GRANT, and every message completes.
    let (per_step, net) = incast(
        100,
        |c| {
            c.unscheduled = 8;
            c.grant_window = 32;
        },
        6,
    );
    assert!(per_step.iter().all(|&n| n <= 64), "{per_step:?}");
    assert!(net.cores[0].stats().grants > 6);
}

#[test]
fn ranks_configured_with_and_without_grants_still_finish() {
    // The receiver grants nothing: the senders keep their 8 unscheduled segments.
    let (per_step, net) = incast(
        100,
        |c| {
            c.grants = c.rank != 0;
            c.unscheduled = 8;
        },
        0,
    );
    assert_eq!(net.cores[0].stats().grants, 0);
    assert!(per_step.iter().all(|&n| n <= 4 * 8), "{per_step:?}");
    // The senders ignore the receiver's grants.
    let (per_step, _) = incast(100, |c| c.grants = c.rank == 0, 0);
    assert_eq!(per_step[0], 4 * 64, "{per_step:?}");
}

#[test]
fn acks_time_a_segment_so_the_rto_follows_a_queued_window() {
    let mut net = Net::with(2, Box::new(|_, _| false), |c| {
        c.ack_every = 8;
        c.init_cwnd = 16;
        c.max_cwnd = 16;
    });
    let data = pattern(64 * 400, 1);
    one_message(&mut net, &data, RecvOpts::default());
    assert_eq!(net.cores[0].srtt(1), None);
    // A few round trips: ACKs, no DONE yet.
    for _ in 0..6 {
        net.step();
        net.now += Duration::from_micros(20);
    }
    assert!(
        received(&net, 1).is_empty(),
        "the message is still under way"
    );
    assert!(
        net.cores[0].srtt(1).is_some(),
        "an ACK past the timed segment gave an RTT sample before the pass ended"
    );
}

#[test]
fn retransmissions_go_ecn_capable_unless_configured_not_to() {
    for ect in [true, false] {
        // The third datagram (a first-pass data segment) is lost once.
        let mut net = Net::with(2, Box::new(|n, _| n == 3), |c| c.retransmit_ect = ect);
        net.trace = Some(Vec::new());
        let data = pattern(64 * 8, 4);
        let now = net.now;
        let src = net.cores[0].register(Region::owned(data.clone()));
        let dst = net.cores[1].register(Region::owned(vec![0; data.len()]));
        net.cores[0].reserve_sends(1, 1).expect("peer");
        net.cores[1].reserve_recvs(0, 1).expect("peer");
        net.cores[1]
            .post_recv(now, 0, 0, dst, 0..data.len(), RecvOpts::default())
            .expect("recv");
        // DSCP 10, not ECN-capable: a tag a switch drops above its threshold.
        let opts = SendOpts {
            tos: 10 << 2,
            ..SendOpts::default()
        };
        net.cores[0]
            .post_send(now, 1, 0, src, 0..data.len(), opts)
            .expect("send");
        net.run(Duration::from_secs(2));
        assert_eq!(received(&net, 1).len(), 1);
        let data_tos: Vec<(u8, bool, u64, u8)> = net
            .trace
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, d)| d[1] == wire::KIND_DATA)
            .map(|(tos, d)| {
                let (h, _) = DataHeader::parse(&d).expect("header");
                // The LAST segment's copy (segment 7 again) goes as the LAST went.
                let copy = h.offset == 7 * 64 && h.flags & wire::flags::RETRANSMIT != 0;
                (
                    tos,
                    h.flags & wire::flags::RETRANSMIT != 0 && !copy,
                    h.offset / 64,
                    h.pass,
                )
            })
            .collect();
        assert!(data_tos.iter().any(|&(_, r, _, _)| r), "nothing was resent");
        let dbg = data_tos.clone();
        for (tos, resent, _, _) in data_tos {
            let want = if resent && ect {
                (10 << 2) | 0b10
            } else {
                10 << 2
            };
            assert_eq!(tos, want, "resent {resent}, retransmit_ect {ect}: {dbg:?}");
        }
    }
}

#[test]
fn counters_add_field_by_field() {
    let one = Stats {
        data_sent: 1,
        data_resent: 2,
        payload_bytes_sent: 3,
        ctrl_sent: 4,
        data_placed: 5,
        data_duplicate: 6,
        ctrl_received: 7,
        refused: 8,
        unexpected_kept: 9,
        unexpected_dropped: 10,
        polls: 11,
        nacks: 12,
        gap_nacks: 13,
        gap_resent: 14,
        grants: 15,
        tail_copies: 16,
    };
    let mut sum = one.clone();
    sum += &one;
    let twice = Stats {
        data_sent: 2,
        data_resent: 4,
        payload_bytes_sent: 6,
        ctrl_sent: 8,
        data_placed: 10,
        data_duplicate: 12,
        ctrl_received: 14,
        refused: 16,
        unexpected_kept: 18,
        unexpected_dropped: 20,
        polls: 22,
        nacks: 24,
        gap_nacks: 26,
        gap_resent: 28,
        grants: 30,
        tail_copies: 32,
    };
    assert_eq!(sum, twice);
}

#[test]
fn a_closing_core_still_confirms_what_it_finished_and_refuses_anything_else() {
    use std::cell::Cell;
    use std::rc::Rc;

    // Every control frame lost while the data goes through: rank 1 has the whole message,
    // rank 0 never heard so.
    let lose = Rc::new(Cell::new(true));
    let l = lose.clone();
    let mut net = Net::new(2, Box::new(move |_, d| l.get() && d[1] != wire::KIND_DATA));
    let data = pattern(64 * 8, 3);
    one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_millis(3));
    assert_eq!(received(&net, 1).len(), 1);
    assert_eq!(sent(&net, 0), 0);
    // Rank 1 leaves (its endpoint lingers): rank 0's POLL still gets the DONE.
    net.cores[1].close();
    lose.set(false);
    net.run(Duration::from_millis(50));
    assert_eq!(sent(&net, 0), 1, "{:?}", net.events[0]);
    // A new message to the closing rank fails at once, naming it as the rank that left.
    let now = net.now;
    let src = net.cores[0].register(Region::owned(vec![7; 64 * 4]));
    assert_eq!(net.cores[0].reserve_sends(1, 1), Ok(1));
    net.cores[0]
        .post_send(now, 1, 1, src, 0..64 * 4, SendOpts::default())
        .expect("post send");
    net.run(Duration::from_millis(50));
    let failed = failures(&net, 0);
    assert_eq!(
        failed,
        vec![MsgError::Aborted {
            peer: 1,
            msg: 1,
            culprit: Some(1)
        }]
    );
}

#[test]
fn loss_ranges_hold_each_range_to_the_bound_however_small() {
    // 1000 segments under a 10 % bound: the message may do without 100. A 118-byte range
    // over segments 100 and 101 may lose 11 bytes, so neither of its segments; the big
    // ranges around it lose every 20th segment, within their own budgets.
    let small = 100 * 64 + 10..102 * 64;
    let ranges = vec![0..100 * 64, small.clone(), 110 * 64..1000 * 64];
    let lose = |seg: u64| seg == 100 || seg == 101 || seg % 20 == 3;
    let data = pattern(64 * 1000, 8);
    for reorder in [0, 16] {
        for with_ranges in [false, true] {
            let mut net = Net::with(2, drop_first_tx(lose), |c| {
                c.gap_reorder = reorder;
                ack_clocked(c);
            });
            let opts = RecvOpts {
                loss_bound: 0.1,
                ranges: if with_ranges {
                    ranges.clone()
                } else {
                    Vec::new()
                },
                ..RecvOpts::default()
            };
            let dst = one_message(&mut net, &data, opts);
            net.run(Duration::from_secs(2));
            let r = received(&net, 1);
            assert_eq!(r.len(), 1, "reorder {reorder} ranges {with_ranges}");
            assert_eq!(r[0].ended, Ended::Bound);
            assert!(r[0].missing <= 100);
            let lost_in = |range: &std::ops::Range<usize>| {
                (0..1000)
                    .filter(|&s| !r[0].has(s))
                    .map(|s| {
                        (s * 64 + 64)
                            .min(range.end)
                            .saturating_sub((s * 64).max(range.start))
                    })
                    .sum::<usize>()
            };
            if with_ranges {
                for range in &ranges {
                    let lost = lost_in(range);
                    assert!(
                        lost as f64 <= 0.1 * range.len() as f64,
                        "range {range:?} lost {lost} bytes (reorder {reorder})"
                    );
                }
                assert!(r[0].has(100) && r[0].has(101), "the small range was resent");
            } else {
                // The message's bound alone absorbs the first losses, the small range's too.
                assert!(!r[0].has(100) && !r[0].has(101));
                assert_eq!(lost_in(&small), small.len());
            }
            let got = net.cores[1].buffer(dst).expect("buffer");
            for seg in (0..1000).filter(|&s| r[0].has(s)) {
                let range = seg * 64..seg * 64 + 64;
                assert_eq!(got[range.clone()], data[range]);
            }
        }
    }
}

#[test]
fn loss_ranges_that_are_not_ascending_disjoint_and_inside_are_refused() {
    let mut net = Net::new(2, Box::new(|_, _| false));
    let dst = net.cores[1].register(Region::owned(vec![0; 640]));
    assert_eq!(net.cores[1].reserve_recvs(0, 1), Ok(0));
    let now = net.now;
    for ranges in [
        vec![0..10, 5..20],
        vec![10..20, 0..5],
        std::iter::once(0..0).collect(),
        std::iter::once(600..700).collect(),
    ] {
        let opts = RecvOpts {
            loss_bound: 0.1,
            ranges: ranges.clone(),
            ..RecvOpts::default()
        };
        let e = net.cores[1].post_recv(now, 0, 0, dst, 0..640, opts);
        assert!(
            matches!(e, Err(PostError::Ranges { len: 640, .. })),
            "{ranges:?}: {e:?}"
        );
    }
    let opts = RecvOpts {
        ranges: std::iter::once(0..10).collect(),
        up_to: true,
        ..RecvOpts::default()
    };
    let e = net.cores[1].post_recv(now, 0, 0, dst, 0..640, opts);
    assert!(matches!(e, Err(PostError::Ranges { .. })), "{e:?}");
}

#[test]
fn a_rotated_message_starts_where_its_number_says_and_gaps_across_the_wrap_are_resent() {
    // 201 segments (a short last one): the first pass of a rotated message starts at
    // `rotation(msg, 201)` and wraps round. Segments lost either side of the wrap, and one
    // early in the pass, come back through gap NACKs within the first pass.
    let nsegs = 201u32;
    let msg = (0..64)
        .find(|&m| (60..140).contains(&rotation(m, nsegs)))
        .expect("a message");
    let rot = rotation(msg, nsegs);
    let data = pattern(64 * 200 + 20, 9);
    let lost = [nsegs - 2, nsegs - 1, 0, 1, (rot + 10) % nsegs];
    let mut net = Net::with(
        2,
        drop_first_tx(move |seg| lost.contains(&(seg as u32))),
        |c| {
            c.gap_reorder = 16;
            ack_clocked(c);
        },
    );
    net.trace = Some(Vec::new());
    let now = net.now;
    let src = net.cores[0].register(Region::owned(data.clone()));
    let dst = net.cores[1].register(Region::owned(vec![0; data.len()]));
    assert_eq!(net.cores[0].reserve_sends(1, msg + 1), Ok(0));
    assert_eq!(net.cores[1].reserve_recvs(0, msg + 1), Ok(0));
    let recv = RecvOpts {
        rotate: true,
        ..RecvOpts::default()
    };
    net.cores[1]
        .post_recv(now, 0, msg, dst, 0..data.len(), recv)
        .expect("post recv");
    let send = SendOpts {
        rotate: true,
        ..SendOpts::default()
    };
    net.cores[0]
        .post_send(now, 1, msg, src, 0..data.len(), send)
        .expect("post send");
    net.run(Duration::from_secs(1));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    let r = received(&net, 1);
    assert_eq!((r.len(), r[0].ended, r[0].missing), (1, Ended::Complete, 0));
    let (s0, s1) = (net.cores[0].stats(), net.cores[1].stats());
    assert_eq!(s1.nacks, 0, "everything came back within the first pass");
    assert!(s1.gap_nacks >= 2, "gap NACKs {}", s1.gap_nacks);
    assert_eq!(s0.data_resent, 5);
    let firsts: Vec<wire::DataHeader> = net
        .trace
        .take()
        .expect("trace")
        .iter()
        .filter_map(|(_, d)| wire::DataHeader::parse(d).ok().map(|(h, _)| h))
        .filter(|h| h.flags & wire::flags::RETRANSMIT == 0)
        .collect();
    assert_eq!(firsts.len(), nsegs as usize);
    assert_eq!(
        firsts[0].offset,
        u64::from(rot) * 64,
        "the pass starts at the rotation"
    );
    let last = firsts
        .iter()
        .find(|h| h.flags & wire::flags::LAST != 0)
        .expect("LAST");
    assert_eq!(
        last.offset,
        u64::from(rot - 1) * 64,
        "and ends just before it"
    );
}

#[test]
fn rotations_of_successive_messages_spread_over_the_message() {
    // 16 successive messages of 100 segments start in at least 9 of its 10 tenths.
    let tenths: std::collections::HashSet<u32> = (0..16).map(|m| rotation(m, 100) / 10).collect();
    assert!(tenths.len() >= 9, "{tenths:?}");
    assert!((0..1000).all(|m| rotation(m, 7) < 7));
    assert_eq!(rotation(12345, 1), 0);
}

#[test]
fn a_gap_nack_after_the_last_segment_went_out_is_answered_at_once() {
    // The whole first pass leaves at once (a window larger than the message), segment 20 and
    // the LAST segment are lost: the gap NACK for 20 reaches the sender after its pass has
    // gone out. It resends 20 at once, flagged LAST, so the receiver names 199 without
    // waiting for a POLL.
    let mut net = Net::with(2, drop_first_tx(|seg| seg == 20 || seg == 199), |c| {
        c.init_cwnd = 256;
        c.max_cwnd = 256;
        c.grants = false;
        c.gap_reorder = 16;
    });
    let data = pattern(64 * 200, 11);
    let dst = one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_secs(1));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    let r = received(&net, 1);
    assert_eq!((r.len(), r[0].ended, r[0].missing), (1, Ended::Complete, 0));
    let (s0, s1) = (net.cores[0].stats(), net.cores[1].stats());
    assert_eq!((s1.gap_nacks, s0.gap_resent), (1, 1), "{s0:?} {s1:?}");
    assert_eq!(s0.polls, 0, "nothing waited for a timer: {s0:?} {s1:?}");
    assert_eq!(s0.data_resent, 2, "20 and 199, each once");
}

#[test]
fn a_lost_last_segment_or_a_lost_done_costs_no_timeout() {
    // The LAST segment goes twice and the pass is answered twice: losing one of either
    // leaves the other, so nobody waits for a POLL.
    let data = pattern(64 * 50, 12);
    let done_dropped = std::rc::Rc::new(std::cell::Cell::new(false));
    let seen = done_dropped.clone();
    let drop: Drop = Box::new(move |_, d| {
        if let Ok((h, _)) = wire::DataHeader::parse(d) {
            return h.flags & wire::flags::RETRANSMIT == 0 && h.offset / 64 == 49;
        }
        if let Ok((c, _)) = Ctrl::parse(d) {
            if c.op == CtrlOp::Done && !seen.get() {
                seen.set(true);
                return true;
            }
        }
        false
    });
    let mut net = Net::new(2, drop);
    let dst = one_message(&mut net, &data, RecvOpts::default());
    net.run(Duration::from_secs(1));
    assert_eq!(net.cores[1].buffer(dst), Some(&data[..]));
    assert!(done_dropped.get(), "the first DONE was dropped");
    let (s0, s1) = (net.cores[0].stats(), net.cores[1].stats());
    assert_eq!(
        (s0.tail_copies, s0.data_resent, s0.polls),
        (1, 0, 0),
        "{s0:?}"
    );
    assert_eq!(s1.nacks, 0, "{s1:?}");
    assert_eq!(sent(&net, 0), 1, "the sender heard the second DONE");
    // A message of fewer segments is not doubled: one copy and one DONE less.
    let run = |segs: usize| {
        let mut net = Net::new(2, Box::new(|_, _| false));
        one_message(&mut net, &pattern(64 * segs, 1), RecvOpts::default());
        net.run(Duration::from_secs(1));
        (
            net.cores[0].stats().tail_copies,
            net.cores[1].stats().ctrl_sent,
        )
    };
    let ((c3, ctrl3), (c4, ctrl4)) = (run(3), run(4));
    assert_eq!((c3, c4), (0, 1));
    // The second DONE, and the one the LAST's copy gets when it finds the message done.
    assert_eq!(ctrl4, ctrl3 + 2);
}
