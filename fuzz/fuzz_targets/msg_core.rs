//! Fuzzes an endpoint's core with datagrams from a peer, as its socket would deliver them:
//! the core has a receive posted (copy or f32 sum, with or without a loss bound) and a send
//! in flight, and every input is handed to `Core::handle_datagram`, with timers fired between
//! them.
//!
//! Properties checked:
//! - nothing panics, whatever the bytes;
//! - nothing outside the posted receive's range of the buffer is ever written (a guard band
//!   around it stays intact);
//! - counters stay consistent: segments placed never exceed the message's segments.
#![no_main]

use std::time::{Duration, Instant};

use gradwire_msg::core::{Core, CoreConfig, Place, RecvOpts, SendOpts, TxBatch};
use gradwire_msg::mem::Region;
use gradwire_proto::tensor::DType;
use libfuzzer_sys::fuzz_target;

const GUARD: usize = 64;
const LEN: usize = 4 * 64 * 5 + 12;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut cfg = CoreConfig::new(3, 1, 3);
    cfg.seg_payload = 64;
    let mut core = Core::new(cfg);
    let now = Instant::now();
    let buf = core.register(Region::owned(vec![0xEE; LEN + 2 * GUARD]));
    let place = if mode & 1 == 0 {
        Place::Copy
    } else {
        Place::Reduce(gradwire_msg::reduce::Combine::Sum, DType::F32)
    };
    let opts = RecvOpts {
        place,
        loss_bound: if mode & 2 == 0 { 0.0 } else { 0.25 },
        keep_meta: mode & 4 != 0,
        deadline: None,
        up_to: mode & 8 != 0,
        skip_meta_zero: mode & 16 != 0,
        patient: mode & 32 != 0,
        // Per-range budgets (not with up_to): three parameters, one smaller than a segment.
        ranges: if mode & 64 != 0 && mode & 8 == 0 {
            vec![0..LEN / 3, LEN / 3 + 5..LEN / 3 + 40, LEN / 2..LEN]
        } else {
            Vec::new()
        },
        rotate: mode & 128 != 0,
    };
    let _ = core.reserve_recvs(0, 1);
    core.post_recv(now, 0, 0, buf, GUARD..GUARD + LEN, opts).expect("post");
    let _ = core.reserve_sends(0, 1);
    let send = SendOpts {
        rotate: mode & 128 != 0,
        ..SendOpts::default()
    };
    core.post_send(now, 0, 0, buf, GUARD..GUARD + LEN, send)
        .expect("post");
    let mut tx = TxBatch::default();
    let mut t = now;
    // Inputs: [len_hi, len_lo, from, bytes...]*
    let mut rest = rest;
    while rest.len() >= 3 {
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]])) % 1600;
        let from = u16::from(rest[2] % 4);
        rest = &rest[3..];
        let take = len.min(rest.len());
        let (d, r) = rest.split_at(take);
        rest = r;
        core.handle_datagram(t, from, from as u8, d);
        core.poll_transmit(t, &mut tx, 4);
        while core.poll_event().is_some() {}
        t += Duration::from_millis(3);
        core.handle_timeout(t);
    }
    let b = core.buffer(buf).expect("buffer");
    assert!(b[..GUARD].iter().all(|&x| x == 0xEE), "written before the receive");
    assert!(b[GUARD + LEN..].iter().all(|&x| x == 0xEE), "written after the receive");
    assert!(core.stats().data_placed <= (LEN as u64).div_ceil(64));
});
