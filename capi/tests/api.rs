//! The C API as C uses it, called through the same exported functions from threads on
//! 127.0.0.1: every set-up path, every operation with exact results, the reports and
//! delivered fractions, the priority function, and the errors a C caller can cause.

#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code)]

mod common;

use std::ffi::{c_int, c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gradwire_c::*;

fn f32_sum(world: u32, e: usize) -> f32 {
    (0..world).map(|r| input(r, e)).sum()
}

/// The priority function of the tests: counts its calls in the `AtomicUsize` at ctx and tags
/// segments whose first element is >= 1 as urgent.
unsafe extern "C" fn count_and_tag(ctx: *mut c_void, seg: *const gw_segment_info) -> gw_tag {
    // SAFETY: ctx is the test's AtomicUsize, seg a valid segment during the call.
    let (calls, seg) = unsafe { (&*ctx.cast::<AtomicUsize>(), &*seg) };
    calls.fetch_add(1, Ordering::Relaxed);
    assert_eq!(seg.dtype, GW_DTYPE_F32);
    assert_eq!(seg.layer, 3);
    // SAFETY: payload holds len bytes during the call.
    let payload = unsafe { std::slice::from_raw_parts(seg.payload, seg.len) };
    let first = f32::from_le_bytes(payload[..4].try_into().unwrap());
    gw_tag {
        dscp: if first >= 1.0 { 46 } else { 10 },
        ect: first < 1.0,
    }
}

#[test]
fn three_ranks_all_reduce_broadcast_barrier_and_send_recv_exactly() {
    const WORLD: u32 = 3;
    const ELEMS: usize = 10_000;
    const P2P: usize = 30_000;
    let calls = AtomicUsize::new(0);
    let reports = with_sessions(
        WORLD,
        |_| {},
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |r, s| unsafe {
            let (mut rank, mut world) = (u32::MAX, 0);
            ok(gw_session_rank(s.0, &mut rank));
            ok(gw_session_world(s.0, &mut world));
            assert_eq!((rank, world), (r, WORLD));

            // All-reduce (sum), exact when reliable.
            let mut g: Vec<f32> = (0..ELEMS).map(|e| input(r, e)).collect();
            let mut rep = gw_reduce_report::default();
            ok(gw_all_reduce(
                s.0,
                g.as_mut_ptr().cast(),
                ELEMS,
                GW_DTYPE_F32,
                GW_OP_SUM,
                ptr::null(),
                &mut rep,
            ));
            for (e, &x) in g.iter().enumerate() {
                assert_eq!(x, f32_sum(WORLD, e), "rank {r} element {e}");
            }
            assert_eq!(rep.elems, ELEMS);
            assert_eq!(rep.complete_blocks, rep.blocks);
            assert_eq!(rep.delivered_fraction, 1.0);
            // The fractions: length first, then the values.
            let mut n = usize::MAX;
            ok(gw_last_block_delivered(s.0, ptr::null_mut(), 0, &mut n));
            assert_eq!(n, rep.blocks);
            let mut blocks = vec![0.0; n];
            ok(gw_last_block_delivered(s.0, blocks.as_mut_ptr(), n, &mut n));
            assert!(blocks.iter().all(|&b| b == 1.0), "{blocks:?}");
            let mut ranks = [0.0; 8];
            ok(gw_last_rank_delivered(s.0, ranks.as_mut_ptr(), 8, &mut n));
            assert_eq!(n, WORLD as usize);
            assert_eq!(&ranks[..3], &[1.0; 3]);
            // A short buffer gets what fits; the length is still the whole.
            let mut one = [0.0];
            ok(gw_last_block_delivered(s.0, one.as_mut_ptr(), 1, &mut n));
            assert_eq!((one[0], n), (1.0, rep.blocks));

            // Average, with options.
            let mut a: Vec<f32> = (0..ELEMS).map(|e| input(r, e) * 3.0).collect();
            let opts = gw_op_options {
                layer: 1,
                num_layers: 4,
                ..gw_op_options_default()
            };
            ok(gw_all_reduce(
                s.0,
                a.as_mut_ptr().cast(),
                ELEMS,
                GW_DTYPE_F32,
                GW_OP_AVERAGE,
                &opts,
                ptr::null_mut(),
            ));
            for (e, &x) in a.iter().enumerate() {
                assert!((x - f32_sum(WORLD, e)).abs() < 1e-4, "average {e}: {x}");
            }

            // Each algorithm by name gives the exact sum.
            for algorithm in [GW_ALGO_RING, GW_ALGO_DIRECT, GW_ALGO_AUTO] {
                let mut v: Vec<f32> = (0..ELEMS).map(|e| input(r, e)).collect();
                let opts = gw_op_options {
                    algorithm,
                    ..gw_op_options_default()
                };
                ok(gw_all_reduce(
                    s.0,
                    v.as_mut_ptr().cast(),
                    ELEMS,
                    GW_DTYPE_F32,
                    GW_OP_SUM,
                    &opts,
                    ptr::null_mut(),
                ));
                for (e, &x) in v.iter().enumerate() {
                    assert_eq!(x, f32_sum(WORLD, e), "algorithm {algorithm}, element {e}");
                }
            }

            // Broadcast from rank 2.
            let mut b: Vec<f32> = (0..ELEMS)
                .map(|e| if r == 2 { e as f32 } else { -1.0 })
                .collect();
            let mut brep = gw_broadcast_report::default();
            ok(gw_broadcast(
                s.0,
                2,
                b.as_mut_ptr().cast(),
                ELEMS,
                GW_DTYPE_F32,
                ptr::null(),
                &mut brep,
            ));
            assert!(b.iter().enumerate().all(|(e, &x)| x == e as f32));
            assert_eq!(brep.received_blocks, brep.blocks);
            assert_eq!(brep.blocks, ELEMS.div_ceil(brep.block_elems));
            let mut n = usize::MAX;
            ok(gw_last_broadcast_received(s.0, ptr::null_mut(), 0, &mut n));
            assert_eq!(n, brep.blocks);
            let mut flags = vec![false; n];
            ok(gw_last_broadcast_received(
                s.0,
                flags.as_mut_ptr(),
                n,
                &mut n,
            ));
            assert!(flags.iter().all(|&f| f), "{flags:?}");

            ok(gw_barrier(s.0));

            // DLCP send/recv 0 -> 1 with the C priority function.
            let opts = gw_p2p_options {
                tensor: 5,
                layer: 3,
                num_layers: 8,
                loss_bound: 0.0,
            };
            let want: Vec<f32> = (0..P2P).map(|e| (e % 1000) as f32 / 500.0).collect();
            let mut segments = 0;
            if r == 0 {
                let mut rep = gw_send_report::default();
                ok(gw_send(
                    s.0,
                    1,
                    want.as_ptr().cast(),
                    P2P,
                    GW_DTYPE_F32,
                    &opts,
                    Some(count_and_tag),
                    ptr::from_ref(&calls).cast_mut().cast(),
                    &mut rep,
                ));
                assert_eq!(rep.bytes, (P2P * 4) as u64);
                segments = rep.segments;
            } else if r == 1 {
                let mut got = vec![0.0f32; P2P];
                let mut rep = gw_recv_report::default();
                ok(gw_recv(
                    s.0,
                    0,
                    got.as_mut_ptr().cast(),
                    P2P,
                    GW_DTYPE_F32,
                    &opts,
                    &mut rep,
                ));
                assert_eq!(got, want);
                assert_eq!(rep.received_segments, rep.segments);
                assert_eq!(rep.delivered_fraction, 1.0);
                let mut n = usize::MAX;
                ok(gw_last_recv_missing(
                    s.0,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    0,
                    &mut n,
                ));
                assert_eq!(n, 0, "nothing is missing");
            }
            ok(gw_barrier(s.0));
            segments
        },
    );
    let segments = reports[0] as usize;
    assert!(segments > 1);
    assert!(
        calls.load(Ordering::Relaxed) >= segments,
        "the priority function ran {} times for {segments} segments",
        calls.load(Ordering::Relaxed)
    );
}

#[test]
fn default_tagging_and_half_precision_work_without_options() {
    const ELEMS: usize = 4_096;
    with_sessions(
        2,
        |_| {},
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |r, s| unsafe {
            // f16 all-reduce of small integers: exact.
            let mut h: Vec<u16> = (0..ELEMS).map(|e| half_bits(input(r, e))).collect();
            ok(gw_all_reduce(
                s.0,
                h.as_mut_ptr().cast(),
                ELEMS,
                GW_DTYPE_F16,
                GW_OP_SUM,
                ptr::null(),
                ptr::null_mut(),
            ));
            for (e, &x) in h.iter().enumerate() {
                assert_eq!(x, half_bits(f32_sum(2, e)), "element {e}");
            }
            // Raw bytes with DLCP's default tagging (no priority function, no options).
            let bytes: Vec<u8> = (0..5_000u32).map(|i| (i % 251) as u8).collect();
            if r == 0 {
                ok(gw_send(
                    s.0,
                    1,
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    GW_DTYPE_RAW,
                    ptr::null(),
                    None,
                    ptr::null_mut(),
                    ptr::null_mut(),
                ));
            } else {
                let mut got = vec![0u8; bytes.len()];
                ok(gw_recv(
                    s.0,
                    0,
                    got.as_mut_ptr().cast(),
                    got.len(),
                    GW_DTYPE_RAW,
                    ptr::null(),
                    ptr::null_mut(),
                ));
                assert_eq!(got, bytes);
            }
        },
    );
}

/// IEEE binary16 bits of a small non-negative integer (exact).
fn half_bits(x: f32) -> u16 {
    if x == 0.0 {
        return 0;
    }
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let mant = (bits >> 13) & 0x3ff;
    ((exp as u32) << 10 | mant) as u16
}

#[test]
fn loss_within_the_bound_shows_in_the_report_and_the_fractions() {
    const ELEMS: usize = 200_000;
    let out = with_sessions(
        3,
        |c| {
            c.inject_loss = 0.03;
            c.seed = 7 + u64::from(c.rank);
            c.loss_bound = 0.05;
        },
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |r, s| unsafe {
            let mut g: Vec<f32> = (0..ELEMS).map(|e| input(r, e)).collect();
            let mut rep = gw_reduce_report::default();
            ok(gw_all_reduce(
                s.0,
                g.as_mut_ptr().cast(),
                ELEMS,
                GW_DTYPE_F32,
                GW_OP_SUM,
                ptr::null(),
                &mut rep,
            ));
            let mut n = 0;
            ok(gw_last_block_delivered(s.0, ptr::null_mut(), 0, &mut n));
            let mut blocks = vec![0.0; n];
            ok(gw_last_block_delivered(s.0, blocks.as_mut_ptr(), n, &mut n));
            (rep, blocks)
        },
    );
    for (rep, blocks) in &out {
        assert_eq!(blocks.len(), rep.blocks);
        let mean = blocks.iter().sum::<f64>() / blocks.len() as f64;
        assert!(
            (mean - rep.delivered_fraction).abs() < 1e-9,
            "{mean} vs {rep:?}"
        );
        assert!(
            rep.delivered_fraction <= 1.0 && rep.delivered_fraction >= 0.9,
            "{rep:?}"
        );
        let complete = blocks.iter().filter(|&&b| b == 1.0).count();
        assert_eq!(complete, rep.complete_blocks);
    }
    assert!(
        out.iter().any(|(r, _)| r.complete_blocks < r.blocks),
        "3 % injected loss with a 5 % bound should leave some blocks short"
    );
}

/// An in-process all-gather between threads, behind the C callback.
struct Gather {
    world: usize,
    slots: Mutex<Vec<Vec<u8>>>,
    barrier: Barrier,
    calls: AtomicUsize,
}

struct RankCtx<'a> {
    rank: usize,
    gather: &'a Gather,
}

unsafe extern "C" fn allgather(
    ctx: *mut c_void,
    mine: *const u8,
    len: usize,
    all: *mut u8,
) -> c_int {
    // SAFETY: ctx is the test's RankCtx; mine holds len bytes, all world * len.
    let ctx = unsafe { &*ctx.cast::<RankCtx<'_>>() };
    let g = ctx.gather;
    g.calls.fetch_add(1, Ordering::Relaxed);
    // SAFETY: as above.
    let mine = unsafe { std::slice::from_raw_parts(mine, len) };
    g.slots.lock().unwrap()[ctx.rank] = mine.to_vec();
    g.barrier.wait();
    {
        let slots = g.slots.lock().unwrap();
        // SAFETY: as above.
        let all = unsafe { std::slice::from_raw_parts_mut(all, g.world * len) };
        for (r, s) in slots.iter().enumerate() {
            assert_eq!(s.len(), len, "every rank gathers the same length");
            all[r * len..(r + 1) * len].copy_from_slice(s);
        }
    }
    // Nobody overwrites a slot of the next round before everyone has read this one.
    g.barrier.wait();
    0
}

unsafe extern "C" fn failing_allgather(
    _: *mut c_void,
    _: *const u8,
    _: usize,
    _: *mut u8,
) -> c_int {
    -5
}

/// One all-reduce on every rank of a set-up session, checked exactly.
fn check_all_reduce(r: u32, world: u32, s: &Session) {
    let mut g: Vec<f32> = (0..1000).map(|e| input(r, e)).collect();
    ok(s.sum_f32(&mut g));
    assert!(g.iter().enumerate().all(|(e, &x)| x == f32_sum(world, e)));
}

#[test]
fn a_session_set_up_through_the_callers_all_gather() {
    const WORLD: u32 = 3;
    let gather = Gather {
        world: WORLD as usize,
        slots: Mutex::new(vec![Vec::new(); WORLD as usize]),
        barrier: Barrier::new(WORLD as usize),
        calls: AtomicUsize::new(0),
    };
    std::thread::scope(|sc| {
        for r in 0..WORLD {
            let gather = &gather;
            sc.spawn(move || {
                let ctx = RankCtx {
                    rank: r as usize,
                    gather,
                };
                let cfg = config(r, WORLD);
                let mut s = ptr::null_mut();
                // SAFETY: valid config, callback honouring the contract, ctx alive.
                ok(unsafe {
                    gw_session_init(
                        &cfg,
                        Some(allgather),
                        ptr::from_ref(&ctx).cast_mut().cast(),
                        &mut s,
                    )
                });
                let s = Session(s);
                check_all_reduce(r, WORLD, &s);
            });
        }
    });
    assert_eq!(gather.calls.load(Ordering::Relaxed), 2 * WORLD as usize);

    // A failing callback is a set-up error naming it.
    let cfg = config(0, 2);
    let mut s = ptr::null_mut();
    // SAFETY: valid arguments.
    let rc = unsafe { gw_session_init(&cfg, Some(failing_allgather), ptr::null_mut(), &mut s) };
    let m = fails(rc, GW_ERR_SETUP);
    assert!(m.contains("all-gather callback") && m.contains("-5"), "{m}");
    assert!(s.is_null());
    // SAFETY: valid arguments but no callback.
    let rc = unsafe { gw_session_init(&cfg, None, ptr::null_mut(), &mut s) };
    fails(rc, GW_ERR_NULL);
}

#[test]
fn a_session_set_up_in_two_phases_with_the_callers_exchange() {
    const WORLD: u32 = 3;
    let mut eps: Vec<*mut gw_endpoint> = Vec::new();
    let mut table: Vec<Vec<u8>> = Vec::new();
    for r in 0..WORLD {
        let cfg = config(r, WORLD);
        let mut ep = ptr::null_mut();
        // SAFETY: valid config and out-pointer.
        ok(unsafe { gw_endpoint_bind(&cfg, &mut ep) });
        let (mut p, mut n) = (ptr::null(), 0);
        // SAFETY: a live endpoint; the bytes live until connect.
        ok(unsafe { gw_endpoint_address(ep, &mut p, &mut n) });
        // SAFETY: gw_endpoint_address gave n bytes at p.
        table.push(unsafe { std::slice::from_raw_parts(p, n) }.to_vec());
        eps.push(ep);
    }
    struct Ep(*mut gw_endpoint);
    // SAFETY: each endpoint is used by exactly one thread below.
    unsafe impl Send for Ep {}
    let ptrs: Vec<*const u8> = table.iter().map(|a| a.as_ptr()).collect();
    let lens: Vec<usize> = table.iter().map(Vec::len).collect();
    struct Table(Vec<*const u8>);
    // SAFETY: the pointers are only read, and `table` outlives the threads.
    unsafe impl Sync for Table {}
    let ptrs = Table(ptrs);
    std::thread::scope(|sc| {
        for (r, ep) in eps.into_iter().enumerate() {
            let ep = Ep(ep);
            let (ptrs, lens) = (&ptrs, &lens);
            sc.spawn(move || {
                let ep = ep;
                let mut s = ptr::null_mut();
                // SAFETY: a live endpoint, a table of WORLD addresses, an out-pointer.
                ok(unsafe {
                    gw_endpoint_connect(ep.0, ptrs.0.as_ptr(), lens.as_ptr(), lens.len(), &mut s)
                });
                let s = Session(s);
                // The endpoint is spent but still freed by its owner.
                let (mut p, mut n) = (ptr::null(), 0);
                // SAFETY: a live (spent) endpoint.
                fails(
                    unsafe { gw_endpoint_address(ep.0, &mut p, &mut n) },
                    GW_ERR_INVALID_ARGUMENT,
                );
                let mut s2 = ptr::null_mut();
                // SAFETY: as above.
                let m = fails(
                    unsafe {
                        gw_endpoint_connect(
                            ep.0,
                            ptrs.0.as_ptr(),
                            lens.as_ptr(),
                            lens.len(),
                            &mut s2,
                        )
                    },
                    GW_ERR_INVALID_ARGUMENT,
                );
                assert!(m.contains("already"), "{m}");
                // SAFETY: freed once.
                unsafe { gw_endpoint_free(ep.0) };
                check_all_reduce(r as u32, WORLD, &s);
            });
        }
    });
}

#[test]
fn null_pointers_bad_arguments_and_overflow_are_refused_with_messages() {
    // SAFETY: every pointer passed is NULL on purpose or valid; the library checks them.
    unsafe {
        let cfg = config(0, 2);
        // Reserved for the whole test: should a check be missing, rank 0 would serve on this
        // port, never on one another test is using.
        let port = MasterPort::reserve();
        let m = port.master();
        let mut s = ptr::null_mut();
        fails(
            gw_session_rendezvous(ptr::null(), m.as_ptr(), &mut s),
            GW_ERR_NULL,
        );
        fails(
            gw_session_rendezvous(&cfg, ptr::null(), &mut s),
            GW_ERR_NULL,
        );
        fails(
            gw_session_rendezvous(&cfg, m.as_ptr(), ptr::null_mut()),
            GW_ERR_NULL,
        );
        let no_ip = gw_config_default(0, 2, ptr::null());
        assert!(fails(
            gw_session_rendezvous(&no_ip, m.as_ptr(), &mut s),
            GW_ERR_NULL
        )
        .contains("ip"));
        let bad_utf8 = gw_config_default(0, 2, c"\xff\xfe".as_ptr());
        fails(
            gw_session_rendezvous(&bad_utf8, m.as_ptr(), &mut s),
            GW_ERR_UTF8,
        );
        let not_ip = gw_config_default(0, 2, c"gradwire".as_ptr());
        let msg = fails(
            gw_session_rendezvous(&not_ip, m.as_ptr(), &mut s),
            GW_ERR_INVALID_ARGUMENT,
        );
        assert!(msg.contains("not an IP address"), "{msg}");
        let rank_out = config(2, 2);
        let msg = fails(
            gw_session_rendezvous(&rank_out, m.as_ptr(), &mut s),
            GW_ERR_INVALID_ARGUMENT,
        );
        assert!(msg.contains("rank 2"), "{msg}");
        let mut lossy = config(0, 2);
        lossy.loss_bound = 1.0;
        fails(
            gw_session_rendezvous(&lossy, m.as_ptr(), &mut s),
            GW_ERR_INVALID_ARGUMENT,
        );
        let mut short_secret = config(0, 2);
        short_secret.secret = b"short".as_ptr();
        short_secret.secret_len = 5;
        fails(
            gw_session_rendezvous(&short_secret, m.as_ptr(), &mut s),
            GW_ERR_INVALID_ARGUMENT,
        );
        let mut null_secret = config(0, 2);
        null_secret.secret_len = 16;
        fails(
            gw_session_rendezvous(&null_secret, m.as_ptr(), &mut s),
            GW_ERR_NULL,
        );
        for bad in [c"nohost", c"127.0.0.1:99999", c"127.0.0.1"] {
            let msg = fails(
                gw_session_rendezvous(&cfg, bad.as_ptr(), &mut s),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(msg.contains("master"), "{msg}");
        }
        assert!(s.is_null(), "no session is written on failure");

        // NULL handles.
        gw_session_free(ptr::null_mut());
        gw_endpoint_free(ptr::null_mut());
        let mut x = [0.0f32; 4];
        fails(
            gw_all_reduce(
                ptr::null_mut(),
                x.as_mut_ptr().cast(),
                4,
                GW_DTYPE_F32,
                GW_OP_SUM,
                ptr::null(),
                ptr::null_mut(),
            ),
            GW_ERR_NULL,
        );
        fails(gw_barrier(ptr::null_mut()), GW_ERR_NULL);
        let mut n = 0;
        fails(
            gw_last_block_delivered(ptr::null(), ptr::null_mut(), 0, &mut n),
            GW_ERR_NULL,
        );
        fails(gw_endpoint_bind(&cfg, ptr::null_mut()), GW_ERR_NULL);
        let mut ep = ptr::null_mut();
        fails(gw_endpoint_bind(ptr::null(), &mut ep), GW_ERR_NULL);
        fails(
            gw_endpoint_connect(ptr::null_mut(), ptr::null(), ptr::null(), 0, &mut s),
            GW_ERR_NULL,
        );
        let (mut p, mut len) = (ptr::null(), 0);
        fails(
            gw_endpoint_address(ptr::null(), &mut p, &mut len),
            GW_ERR_NULL,
        );

        // Names, version, and the message being per thread and cleared by a success.
        assert_eq!(CStr::from_ptr(gw_error_name(GW_ERR_BUSY)), c"GW_ERR_BUSY");
        assert_eq!(CStr::from_ptr(gw_error_name(1234)), c"GW_ERR_UNKNOWN");
        assert_eq!(
            CStr::from_ptr(gw_version()).to_str().unwrap(),
            env!("CARGO_PKG_VERSION")
        );
        fails(gw_barrier(ptr::null_mut()), GW_ERR_NULL);
        assert_eq!(std::thread::spawn(message).join().unwrap(), "");
        assert!(!message().is_empty());
        assert_eq!(gw_last_error_peer(), -1);
    }
}

#[test]
fn buffers_dtypes_ops_and_options_are_checked_on_a_live_session() {
    with_sessions(
        2,
        |_| {},
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |r, s| unsafe {
            if r == 1 {
                // Rank 1 only waits for rank 0's checks, then joins the final barrier.
                ok(gw_barrier(s.0));
                return;
            }
            let mut n = usize::MAX;
            ok(gw_last_block_delivered(s.0, ptr::null_mut(), 0, &mut n));
            assert_eq!(n, 0, "no all-reduce yet");
            fails(
                gw_last_block_delivered(s.0, ptr::null_mut(), 4, &mut n),
                GW_ERR_NULL,
            );
            fails(
                gw_last_rank_delivered(s.0, ptr::null_mut(), 0, ptr::null_mut()),
                GW_ERR_NULL,
            );
            let mut x = [1.0f32; 8];
            let buf: *mut c_void = x.as_mut_ptr().cast();
            let reduce = |buf, count, dtype, op, opts: *const gw_op_options| {
                gw_all_reduce(s.0, buf, count, dtype, op, opts, ptr::null_mut())
            };
            let m = fails(
                reduce(buf, 8, 9, GW_OP_SUM, ptr::null()),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(m.contains("dtype 9"), "{m}");
            let m = fails(
                reduce(buf, 8, GW_DTYPE_F32, 5, ptr::null()),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(m.contains("op 5"), "{m}");
            let m = fails(
                reduce(buf, usize::MAX / 2, GW_DTYPE_F32, GW_OP_SUM, ptr::null()),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(m.contains("overflows"), "{m}");
            fails(
                reduce(ptr::null_mut(), 8, GW_DTYPE_F32, GW_OP_SUM, ptr::null()),
                GW_ERR_NULL,
            );
            let m = fails(
                reduce(buf, 8, GW_DTYPE_RAW, GW_OP_SUM, ptr::null()),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(m.contains("raw"), "{m}");
            let bad_dscp = gw_op_options {
                dscp: 64,
                ..gw_op_options_default()
            };
            fails(
                reduce(buf, 8, GW_DTYPE_F32, GW_OP_SUM, &bad_dscp),
                GW_ERR_INVALID_ARGUMENT,
            );
            let bad_bound = gw_op_options {
                loss_bound: 1.5,
                ..gw_op_options_default()
            };
            fails(
                reduce(buf, 8, GW_DTYPE_F32, GW_OP_SUM, &bad_bound),
                GW_ERR_INVALID_ARGUMENT,
            );
            let bad_layer = gw_op_options {
                layer: 4,
                num_layers: 4,
                ..gw_op_options_default()
            };
            fails(
                reduce(buf, 8, GW_DTYPE_F32, GW_OP_SUM, &bad_layer),
                GW_ERR_INVALID_ARGUMENT,
            );
            let bad_algorithm = gw_op_options {
                algorithm: 7,
                ..gw_op_options_default()
            };
            let m = fails(
                reduce(buf, 8, GW_DTYPE_F32, GW_OP_SUM, &bad_algorithm),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(m.contains("GW_ALGO_RING"), "{m}");
            for d in [f64::NAN, -5.0, f64::INFINITY] {
                let bad_deadline = gw_op_options {
                    step_deadline_ms: d,
                    ..gw_op_options_default()
                };
                fails(
                    reduce(buf, 8, GW_DTYPE_F32, GW_OP_SUM, &bad_deadline),
                    GW_ERR_INVALID_ARGUMENT,
                );
            }
            fails(
                gw_send(
                    s.0,
                    1,
                    ptr::null(),
                    4,
                    GW_DTYPE_F32,
                    ptr::null(),
                    None,
                    ptr::null_mut(),
                    ptr::null_mut(),
                ),
                GW_ERR_NULL,
            );
            fails(
                gw_recv(s.0, 0, buf, 8, -1, ptr::null(), ptr::null_mut()),
                GW_ERR_INVALID_ARGUMENT,
            );
            // DLCP's default tagging needs the layer below num_layers.
            let bad_layer = gw_p2p_options {
                layer: 4,
                num_layers: 4,
                ..gw_p2p_options_default()
            };
            let m = fails(
                gw_send(
                    s.0,
                    1,
                    buf,
                    8,
                    GW_DTYPE_F32,
                    &bad_layer,
                    None,
                    ptr::null_mut(),
                    ptr::null_mut(),
                ),
                GW_ERR_INVALID_ARGUMENT,
            );
            assert!(m.contains("num_layers 4"), "{m}");
            for peer in [0, 2, u32::MAX] {
                let m = fails(
                    gw_send(
                        s.0,
                        peer,
                        buf,
                        8,
                        GW_DTYPE_F32,
                        ptr::null(),
                        None,
                        ptr::null_mut(),
                        ptr::null_mut(),
                    ),
                    GW_ERR_INVALID_ARGUMENT,
                );
                assert!(m.contains(&peer.to_string()) || m.contains("itself"), "{m}");
            }
            // None of these reached the peer: the session still works.
            ok(gw_barrier(s.0));
        },
    );
}

/// What `hold_in_first_segment` shares with the test: it tells the test it is inside
/// gw_send (so the session's lock is held) and waits there until the test says go.
struct Hold {
    first: std::sync::atomic::AtomicBool,
    inside: Mutex<std::sync::mpsc::Sender<()>>,
    go: Mutex<std::sync::mpsc::Receiver<()>>,
}

/// A priority function that, on its first call, holds the sending gw_send until the test is
/// done with its concurrent calls.
unsafe extern "C" fn hold_in_first_segment(ctx: *mut c_void, _: *const gw_segment_info) -> gw_tag {
    // SAFETY: ctx is the test's Hold, alive during the gw_send.
    let hold = unsafe { &*ctx.cast::<Hold>() };
    if hold.first.swap(false, Ordering::SeqCst) {
        // Errors mean the test thread is gone (it panicked): then just go on (no unwinding
        // out of an extern "C" function).
        let _ = hold.inside.lock().map(|tx| tx.send(()));
        let _ = hold
            .go
            .lock()
            .map(|rx| rx.recv_timeout(Duration::from_secs(30)));
    }
    gw_tag { dscp: 0, ect: true }
}

#[test]
fn a_second_thread_on_a_busy_session_gets_gw_err_busy() {
    let port = MasterPort::reserve();
    let m = port.master();
    let (m0, m1) = (&m, &m);
    let (inside_tx, inside) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let hold = Hold {
        first: true.into(),
        inside: Mutex::new(inside_tx),
        go: Mutex::new(go_rx),
    };
    let data = vec![1.0f32; 20_000];
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let s = Session::rendezvous(&config(1, 2), m1);
            let mut got = vec![0.0f32; data.len()];
            // SAFETY: a live session and a buffer of got.len() f32.
            ok(unsafe {
                gw_recv(
                    s.0,
                    0,
                    got.as_mut_ptr().cast(),
                    got.len(),
                    GW_DTYPE_F32,
                    ptr::null(),
                    ptr::null_mut(),
                )
            });
            assert_eq!(got, data);
            // SAFETY: a live session.
            ok(unsafe { gw_barrier(s.0) });
        });
        let s = Session::rendezvous(&config(0, 2), m0);
        std::thread::scope(|inner| {
            let (s, data, hold) = (&s, &data, &hold);
            let sending = inner.spawn(move || {
                // SAFETY: a live session, a buffer of data.len() f32, a priority function
                // honouring the contract with its ctx.
                ok(unsafe {
                    gw_send(
                        s.0,
                        1,
                        data.as_ptr().cast(),
                        data.len(),
                        GW_DTYPE_F32,
                        ptr::null(),
                        Some(hold_in_first_segment),
                        ptr::from_ref(hold).cast_mut().cast(),
                        ptr::null_mut(),
                    )
                })
            });
            // The sender is inside gw_send, in its priority function, holding the session.
            inside
                .recv_timeout(Duration::from_secs(30))
                .expect("the priority function was never called");
            // SAFETY: a live session, used at once by the thread above on purpose.
            let m = fails(unsafe { gw_barrier(s.0) }, GW_ERR_BUSY);
            assert!(m.contains("one thread at a time"), "{m}");
            let mut x = [0.0f32; 4];
            let rc = s.sum_f32(&mut x);
            fails(rc, GW_ERR_BUSY);
            // Rank and world do not need the session's lock.
            let mut rank = 9;
            // SAFETY: a live session.
            ok(unsafe { gw_session_rank(s.0, &mut rank) });
            assert_eq!(rank, 0);
            go.send(()).unwrap();
            sending.join().unwrap();
        });
        // The refused calls left the session usable.
        // SAFETY: a live session.
        ok(unsafe { gw_barrier(s.0) });
    });
}

#[test]
fn a_peer_that_never_comes_is_an_error_within_the_timeout() {
    // Rank 0 serves the rendezvous; rank 1 never comes.
    let port = MasterPort::reserve();
    let m = port.master();
    let mut cfg = config(0, 2);
    cfg.timeout_ms = 1500;
    let mut s = ptr::null_mut();
    let t = Instant::now();
    // SAFETY: valid arguments.
    let rc = unsafe { gw_session_rendezvous(&cfg, m.as_ptr(), &mut s) };
    let took = t.elapsed();
    let msg = fails(rc, GW_ERR_SETUP);
    assert!(s.is_null());
    assert!(
        took < Duration::from_secs(10),
        "failed after {took:?}: {msg}"
    );

    // Rank 1 with a master that never answers: a listener this test holds and never
    // accepts from (the kernel completes the connection; no rendezvous reply ever comes).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let m = master(silent.local_addr().unwrap().port());
    let mut cfg = config(1, 2);
    cfg.timeout_ms = 1500;
    let t = Instant::now();
    // SAFETY: valid arguments.
    let rc = unsafe { gw_session_rendezvous(&cfg, m.as_ptr(), &mut s) };
    let took = t.elapsed();
    let msg = fails(rc, GW_ERR_SETUP);
    assert!(
        took < Duration::from_secs(10),
        "failed after {took:?}: {msg}"
    );
}

#[test]
fn a_peer_gone_mid_job_fails_the_operation_with_its_rank() {
    let port = MasterPort::reserve();
    let m = port.master();
    let (m0, m1) = (&m, &m);
    // Both ranks finish set-up before rank 1 leaves: its set-up can end before rank 0's
    // (rank 0 still accepting its links), and leaving then would fail rank 0's set-up instead
    // of its all-reduce. (A barrier that fails rather than hangs if one rank's set-up fails.)
    let (meet0, meet1) = Meet::pair();
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let mut c = config(1, 2);
            c.timeout_ms = 3000;
            let s = Session::rendezvous(&c, m1);
            meet1.sync();
            // Joins, then leaves without a word (its links closed before rank 0 starts).
            drop(s);
            meet1.sync();
        });
        let mut c = config(0, 2);
        c.timeout_ms = 3000;
        let s = Session::rendezvous(&c, m0);
        meet0.sync();
        meet0.sync();
        let mut x = vec![1.0f32; 50_000];
        let t = Instant::now();
        let rc = s.sum_f32(&mut x);
        assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
        let msg = fails(rc, GW_ERR_PEER);
        assert_eq!(gw_last_error_peer(), 1, "{msg}");
        // The session is unusable afterwards, and says so.
        // SAFETY: a live session.
        let rc = unsafe { gw_barrier(s.0) };
        assert_ne!(rc, GW_OK);
    });
}

#[test]
fn endpoint_connect_refuses_a_wrong_world_and_oversized_lengths_before_reading_them() {
    let cfg = config(0, 2);
    let mut ep = ptr::null_mut();
    // SAFETY: valid config and out-pointer.
    ok(unsafe { gw_endpoint_bind(&cfg, &mut ep) });
    let (mut p, mut n) = (ptr::null(), 0);
    // SAFETY: a live endpoint.
    ok(unsafe { gw_endpoint_address(ep, &mut p, &mut n) });
    let tiny = [0u8; 4];
    let addrs = [p, tiny.as_ptr()];
    let mut s = ptr::null_mut();
    // Lengths from another rank that no address has: refused before a slice of that length is
    // made over the 4 bytes at tiny (reading them would be out of bounds).
    for huge in [usize::MAX, isize::MAX as usize + 1, 64 * 1024 + 1] {
        let lens = [n, huge];
        // SAFETY: a live endpoint; the arrays hold 2 entries; addrs[1] is *not* valid for
        // lens[1] bytes, which the library must refuse without reading.
        let rc = unsafe { gw_endpoint_connect(ep, addrs.as_ptr(), lens.as_ptr(), 2, &mut s) };
        let m = fails(rc, GW_ERR_SETUP);
        assert!(
            m.contains("lens[1]") && m.contains(&huge.to_string()),
            "{m}"
        );
    }
    // A world other than the configured one, before anything is allocated for it (usize::MAX
    // entries would not fit in memory; the arrays hold 2).
    let lens = [n, tiny.len()];
    for world in [0, 1, 3, usize::MAX] {
        // SAFETY: as above; the library must not read past the 2 entries.
        let rc = unsafe { gw_endpoint_connect(ep, addrs.as_ptr(), lens.as_ptr(), world, &mut s) };
        let m = fails(rc, GW_ERR_INVALID_ARGUMENT);
        assert!(
            m.contains(&format!("world is {world}")) && m.contains("2-rank"),
            "{m}"
        );
    }
    assert!(s.is_null(), "no session is written on failure");
    // None of these spent the endpoint: its address is still there.
    let (mut p2, mut n2) = (ptr::null(), 0);
    // SAFETY: a live endpoint.
    ok(unsafe { gw_endpoint_address(ep, &mut p2, &mut n2) });
    assert_eq!((p2, n2), (p, n));
    // SAFETY: freed once.
    unsafe { gw_endpoint_free(ep) };
}

#[test]
fn a_broadcast_root_outside_the_job_is_an_invalid_argument() {
    with_sessions(
        2,
        |_| {},
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |_, s| unsafe {
            let mut x = [1.0f32; 8];
            for root in [2, 7, u32::MAX] {
                let m = fails(
                    gw_broadcast(
                        s.0,
                        root,
                        x.as_mut_ptr().cast(),
                        x.len(),
                        GW_DTYPE_F32,
                        ptr::null(),
                        ptr::null_mut(),
                    ),
                    GW_ERR_INVALID_ARGUMENT,
                );
                assert!(m.contains(&format!("root {root}")), "{m}");
            }
            assert_eq!(x, [1.0; 8], "an argument error leaves the buffer untouched");
            // Refused before anything was sent: the session still works.
            ok(gw_barrier(s.0));
        },
    );
}

#[test]
fn a_ring_only_session_refuses_transfers_off_the_ring_and_says_why() {
    const WORLD: u32 = 3;
    let want: Vec<f32> = (0..1000).map(|e| e as f32).collect();
    with_sessions(
        WORLD,
        |c| c.point_to_point = false,
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |r, s| unsafe {
            let mut buf = vec![0.0f32; want.len()];
            let send = |peer| {
                gw_send(
                    s.0,
                    peer,
                    want.as_ptr().cast(),
                    want.len(),
                    GW_DTYPE_F32,
                    ptr::null(),
                    None,
                    ptr::null_mut(),
                    ptr::null_mut(),
                )
            };
            if r == 0 {
                // Rank 0 is linked to rank 1 (next) and from rank 2 (previous) only.
                let m = fails(send(2), GW_ERR_INVALID_ARGUMENT);
                assert!(
                    m.contains("no link to rank 2") && m.contains("point_to_point"),
                    "{m}"
                );
                let m = fails(
                    gw_recv(
                        s.0,
                        1,
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        GW_DTYPE_F32,
                        ptr::null(),
                        ptr::null_mut(),
                    ),
                    GW_ERR_INVALID_ARGUMENT,
                );
                assert!(
                    m.contains("no link from rank 1") && m.contains("point_to_point"),
                    "{m}"
                );
                // Along the ring it works.
                ok(send(1));
            } else if r == 1 {
                ok(gw_recv(
                    s.0,
                    0,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    GW_DTYPE_F32,
                    ptr::null(),
                    ptr::null_mut(),
                ));
                assert_eq!(buf, want);
            }
            ok(gw_barrier(s.0));
        },
    );
}

#[test]
fn loss_within_the_bound_shows_which_broadcast_blocks_and_recv_bytes_arrived() {
    const ELEMS: usize = 100_000;
    let out = with_sessions(
        2,
        |c| {
            c.inject_loss = 0.1;
            c.seed = 3 + u64::from(c.rank);
            c.loss_bound = 0.3;
        },
        // SAFETY: every call gets a live session and buffers of the counts it is given.
        |r, s| unsafe {
            // Broadcast from rank 0: rank 1's blocks that did not arrive keep their -1.
            let mut b: Vec<f32> = (0..ELEMS)
                .map(|e| if r == 0 { e as f32 } else { -1.0 })
                .collect();
            let mut brep = gw_broadcast_report::default();
            ok(gw_broadcast(
                s.0,
                0,
                b.as_mut_ptr().cast(),
                ELEMS,
                GW_DTYPE_F32,
                ptr::null(),
                &mut brep,
            ));
            let mut n = 0;
            ok(gw_last_broadcast_received(s.0, ptr::null_mut(), 0, &mut n));
            let mut flags = vec![false; n];
            ok(gw_last_broadcast_received(
                s.0,
                flags.as_mut_ptr(),
                n,
                &mut n,
            ));
            assert_eq!(n, brep.blocks);
            assert_eq!(
                flags.iter().filter(|&&f| f).count(),
                brep.received_blocks,
                "{brep:?}"
            );
            for (blk, &arrived) in flags.iter().enumerate() {
                let lo = blk * brep.block_elems;
                let hi = (lo + brep.block_elems).min(ELEMS);
                let root_values = (lo..hi).all(|e| b[e] == e as f32);
                let kept = (lo..hi).all(|e| b[e] == -1.0);
                assert!(
                    if arrived { root_values } else { kept },
                    "rank {r} block {blk}: arrived {arrived}"
                );
            }

            // Ones from rank 0 to rank 1: the missing ranges are exactly the zeros.
            let ones = vec![1.0f32; ELEMS];
            let mut missing = Vec::new();
            if r == 0 {
                ok(gw_send(
                    s.0,
                    1,
                    ones.as_ptr().cast(),
                    ELEMS,
                    GW_DTYPE_F32,
                    ptr::null(),
                    None,
                    ptr::null_mut(),
                    ptr::null_mut(),
                ));
            } else {
                let mut got = vec![0.5f32; ELEMS];
                let mut rep = gw_recv_report::default();
                ok(gw_recv(
                    s.0,
                    0,
                    got.as_mut_ptr().cast(),
                    ELEMS,
                    GW_DTYPE_F32,
                    ptr::null(),
                    &mut rep,
                ));
                let mut n = usize::MAX;
                ok(gw_last_recv_missing(
                    s.0,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    0,
                    &mut n,
                ));
                let (mut offs, mut lens) = (vec![0u64; n], vec![0usize; n]);
                ok(gw_last_recv_missing(
                    s.0,
                    offs.as_mut_ptr(),
                    lens.as_mut_ptr(),
                    n,
                    &mut n,
                ));
                assert_eq!(n, offs.len());
                let mut zero = vec![false; ELEMS];
                let mut end = 0;
                for (&o, &l) in offs.iter().zip(&lens) {
                    let o = o as usize;
                    assert!(o >= end && l > 0, "ranges in order, not empty: {offs:?}");
                    assert!(o % 4 == 0 && l % 4 == 0 && o + l <= ELEMS * 4);
                    zero[o / 4..(o + l) / 4].fill(true);
                    end = o + l;
                }
                for (e, &x) in got.iter().enumerate() {
                    assert_eq!(x, if zero[e] { 0.0 } else { 1.0 }, "element {e}");
                }
                let missing_segments = rep.segments - rep.received_segments;
                assert!(
                    (missing_segments == 0) == offs.is_empty(),
                    "{rep:?} {offs:?}"
                );
                missing = offs;
            }
            ok(gw_barrier(s.0));
            (brep, missing)
        },
    );
    // With 10 % injected loss and a 30 % bound, something is short somewhere.
    let (b1, missing) = &out[1];
    assert!(
        b1.received_blocks < b1.blocks || !missing.is_empty(),
        "10 % loss should leave a broadcast block or a received segment missing: {out:?}"
    );
}

/// A raw IPv4 socket that gets a copy of every UDP packet this host receives, IP header
/// included (needs CAP_NET_RAW), with a receive buffer big enough for a whole test's packets
/// (none dropped while the reader is behind). std has no raw sockets: the fd is made with
/// libc's socket() and read through UdpSocket, whose recv and read timeout are the same
/// system calls.
fn udp_sniffer() -> std::net::UdpSocket {
    use std::os::fd::FromRawFd;
    extern "C" {
        fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
        fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: u32) -> c_int;
    }
    const AF_INET: c_int = 2;
    const SOCK_RAW: c_int = 3;
    const IPPROTO_UDP: c_int = 17;
    const SOL_SOCKET: c_int = 1;
    const SO_RCVBUFFORCE: c_int = 33;
    // SAFETY: socket() takes plain integers and returns a new fd or -1.
    let fd = unsafe { socket(AF_INET, SOCK_RAW, IPPROTO_UDP) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd this function owns; UdpSocket closes it on drop.
    let sock = unsafe { std::net::UdpSocket::from_raw_fd(fd) };
    let size: c_int = 64 << 20;
    // SAFETY: a live fd and a c_int option value of the length given.
    let rc = unsafe {
        setsockopt(
            fd,
            SOL_SOCKET,
            SO_RCVBUFFORCE,
            ptr::from_ref(&size).cast(),
            4,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", std::io::Error::last_os_error());
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    sock
}

/// The datagram that ends a sniff: sent after every case is over, to a port nobody uses.
const SNIFF_END: &[u8] = b"gradwire sniff: end of the test's packets";
const SNIFF_END_PORT: u16 = 9;

/// One gradwire data packet as the sniffer saw it.
#[derive(Debug, Clone, Copy)]
struct Sniffed {
    tensor: u32,
    offset: u64,
    /// Retransmission pass (0: first transmission).
    pass: u8,
    dscp: u8,
    ecn: u8,
}

/// Reads `sock` until the end datagram, returning every gradwire data packet seen before it.
/// A packet is identified by its own header (flow's tensor id, offset), never by when it
/// came: packets of different cases can never be mixed up. Panics after 60 s without the
/// end datagram.
fn sniff_until_end(sock: &std::net::UdpSocket) -> Vec<Sniffed> {
    use gradwire::wire::header::{field, HEADER_LEN, VERSION};
    // Flow packets (kinds 1, 2) carry the point-to-point tensor id below kind 7's bits;
    // message-layer segments (kind 3) carry it in their meta word.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut pkt = vec![0u8; 65_536];
    let mut seen = Vec::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "no end datagram within 60 s ({} packets seen)",
            seen.len()
        );
        let Ok(n) = sock.recv(&mut pkt) else { continue };
        let pkt = &pkt[..n];
        let ihl = usize::from(pkt[0] & 0x0f) * 4;
        let (tos, udp) = (pkt[1], &pkt[ihl..]);
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        let payload = &udp[8..];
        if dport == SNIFF_END_PORT && payload == SNIFF_END {
            return seen;
        }
        assert!(
            payload.len() >= 8 && payload[field::VERSION] == VERSION,
            "a UDP packet that is not a gradwire packet: {payload:?}"
        );
        let tensor = match payload[field::KIND] {
            // The message layer (the session's transfers): the tensor id rides in each
            // segment's meta word; control frames go at the control DSCP, not checked here.
            // On loopback a raw socket sees a GSO bundle whole: its segments back to back.
            gradwire_msg::wire::KIND_DATA => {
                let mut rest = payload;
                while !rest.is_empty() {
                    let len = gradwire_msg::wire::DATA_HEADER_LEN
                        + usize::from(u16::from_be_bytes([rest[28], rest[29]]));
                    let (seg, tail) = rest.split_at(len.min(rest.len()));
                    let (h, _) = gradwire_msg::wire::DataHeader::parse(seg).unwrap_or_else(|e| {
                        panic!("a bad message-layer segment ({e}), {} bytes", seg.len())
                    });
                    rest = tail;
                    if h.total == 0 {
                        continue; // a barrier's empty message (the session's set-up)
                    }
                    seen.push(Sniffed {
                        tensor: h.meta as u32,
                        offset: h.offset,
                        pass: h.pass,
                        dscp: tos >> 2,
                        ecn: tos & 0b11,
                    });
                }
                continue;
            }
            gradwire_msg::wire::KIND_CTRL => continue,
            _ => {
                assert!(
                    payload.len() >= HEADER_LEN,
                    "a short flow packet: {payload:?}"
                );
                let be32 =
                    |r: std::ops::Range<usize>| u32::from_be_bytes(payload[r].try_into().unwrap());
                be32(field::TENSOR_ID) & !(7 << 27)
            }
        };
        seen.push(Sniffed {
            tensor,
            offset: u64::from_be_bytes(payload[field::OFFSET].try_into().unwrap()),
            pass: payload[field::PASS],
            dscp: tos >> 2,
            ecn: tos & 0b11,
        });
    }
}

/// What `record_tags` returned for each segment offset.
type Tags = Mutex<std::collections::HashMap<u64, gw_tag>>;

/// A priority function whose tags vary by segment (DSCP and ECN both), recording what it
/// returned for each offset into the `Tags` at ctx.
unsafe extern "C" fn record_tags(ctx: *mut c_void, seg: *const gw_segment_info) -> gw_tag {
    // SAFETY: ctx is the test's Tags, seg a valid segment during the call.
    let (tags, seg) = unsafe { (&*ctx.cast::<Tags>(), &*seg) };
    let tag = gw_tag {
        dscp: ((seg.index * 7 + 3) % 64) as u8,
        ect: seg.index % 3 == 0,
    };
    // Poisoned only if the test already failed: no unwinding out of an extern "C" function.
    if let Ok(mut t) = tags.lock() {
        t.insert(seg.offset, tag);
    }
    tag
}

/// How one case's sender tags its segments.
#[derive(Clone, Copy)]
enum Tagging {
    /// DLCP's default: the DSCP of `layer` of `num_layers`.
    Default {
        layer: u16,
        num_layers: u16,
        dscp: u8,
    },
    /// The C priority function `record_tags`.
    Function,
}

/// Sends one tensor per case from rank 0 to rank 1 in a namespace of its own (so that the
/// only UDP packets on its loopback are this test's) and checks every data packet's DSCP (and,
/// for a priority function, ECN) against what the sender was told to put there.
fn check_dscp_on_the_wire(test: &str, cases: &[Tagging]) {
    use std::sync::Arc;

    if !gradwire_netns::require_root(test) {
        return;
    }
    let ns = format!("{}-dscp", gradwire_netns::new_netns_prefix());
    let set = gradwire_netns::NamespaceSet::temporary("capi dscp test", std::slice::from_ref(&ns))
        .unwrap();
    gradwire_netns::cmd::ip(Some(&ns), &["link", "set", "lo", "up"]).unwrap();

    // The sniffer is reading-ready (its socket exists) before any rank starts.
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let sniffer = gradwire_netns::spawn_in_netns(&ns, move || {
        let sock = udp_sniffer();
        ready_tx.send(()).unwrap();
        sniff_until_end(&sock)
    })
    .unwrap();
    ready
        .recv_timeout(Duration::from_secs(30))
        .expect("the sniffer did not start");
    let tags: Arc<Vec<Tags>> = Arc::new(cases.iter().map(|_| Tags::default()).collect());
    let cases: Arc<Vec<Tagging>> = Arc::new(cases.to_vec());
    // A fresh namespace: nothing else can hold this port.
    let m = master(29_500);
    let ranks: Vec<_> = (0..2u32)
        .map(|r| {
            let (m, cases, tags) = (m.clone(), cases.clone(), tags.clone());
            gradwire_netns::spawn_in_netns(&ns, move || {
                let s = Session::rendezvous(&config(r, 2), &m);
                let data: Vec<f32> = (0..20_000).map(|e| (e % 7) as f32).collect();
                for (i, case) in cases.iter().enumerate() {
                    let (layer, num_layers, f) = match *case {
                        Tagging::Default {
                            layer, num_layers, ..
                        } => (layer, num_layers, None),
                        Tagging::Function => (2, 4, Some(record_tags as _)),
                    };
                    let opts = gw_p2p_options {
                        tensor: i as u32,
                        layer,
                        num_layers,
                        ..gw_p2p_options_default()
                    };
                    let mut buf = vec![0.0f32; data.len()];
                    // SAFETY: a live session, buffers of data.len() f32, a priority function
                    // honouring the contract with its ctx (the case's Tags, alive here).
                    ok(unsafe {
                        if r == 0 {
                            gw_send(
                                s.0,
                                1,
                                data.as_ptr().cast(),
                                data.len(),
                                GW_DTYPE_F32,
                                &opts,
                                f,
                                ptr::from_ref(&tags[i]).cast_mut().cast(),
                                ptr::null_mut(),
                            )
                        } else {
                            gw_recv(
                                s.0,
                                0,
                                buf.as_mut_ptr().cast(),
                                buf.len(),
                                GW_DTYPE_F32,
                                &opts,
                                ptr::null_mut(),
                            )
                        }
                    });
                    if r == 1 {
                        assert_eq!(buf, data, "case {i}");
                    }
                }
            })
            .unwrap()
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|h| h.join()).collect();
    // Every packet the receiver took is in the sniffer's queue before this datagram (raw
    // sockets get a copy before UDP delivery); late retransmissions may come after it and are
    // simply not checked.
    let end = gradwire_netns::spawn_in_netns(&ns, || {
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        u.send_to(SNIFF_END, ("127.0.0.1", SNIFF_END_PORT)).unwrap();
    })
    .unwrap()
    .join();
    let sniffed = sniffer.join();
    set.down().unwrap();
    for r in results {
        r.unwrap_or_else(|p| std::panic::resume_unwind(p));
    }
    end.unwrap_or_else(|p| std::panic::resume_unwind(p));
    let sniffed = sniffed.unwrap_or_else(|p| std::panic::resume_unwind(p));

    for p in &sniffed {
        assert!(
            (0..cases.len() as u32).any(|i| p.tensor == i),
            "a packet of no case's flow: {p:?}"
        );
    }
    for (i, case) in cases.iter().enumerate() {
        let pkts: Vec<&Sniffed> = sniffed.iter().filter(|p| p.tensor == i as u32).collect();
        assert!(pkts.len() > 1, "case {i}: {} packets seen", pkts.len());
        match *case {
            Tagging::Default {
                layer,
                num_layers,
                dscp,
            } => {
                for p in &pkts {
                    assert_eq!(
                        p.dscp, dscp,
                        "layer {layer} of {num_layers}: DSCP {dscp} expected: {p:?}"
                    );
                }
            }
            Tagging::Function => {
                let tags = tags[i].lock().unwrap();
                let dscps: std::collections::BTreeSet<u8> = tags.values().map(|t| t.dscp).collect();
                assert!(
                    dscps.len() > 3,
                    "the function's tags should vary: {dscps:?}"
                );
                for p in &pkts {
                    let want = tags
                        .get(&p.offset)
                        .unwrap_or_else(|| panic!("the function never tagged {p:?}"));
                    assert_eq!(p.dscp, want.dscp, "{p:?}: the function said {want:?}");
                    // Retransmission passes may make a segment ECN-capable on their own.
                    if p.pass == 0 || want.ect {
                        let ecn = if want.ect { 0b10 } else { 0 };
                        assert_eq!(p.ecn, ecn, "{p:?}: the function said {want:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn default_tagging_puts_the_layers_dscp_on_the_data_packets() {
    // (layer, num_layers, the DSCP DLCP gives it: front layers more urgent; 0 layers: DSCP 0)
    let cases = [(0, 4, 46), (3, 4, 10), (1, 4, 40), (5, 0, 0)].map(|(layer, num_layers, dscp)| {
        Tagging::Default {
            layer,
            num_layers,
            dscp,
        }
    });
    check_dscp_on_the_wire(
        "default_tagging_puts_the_layers_dscp_on_the_data_packets",
        &cases,
    );
}

#[test]
fn a_c_priority_function_sets_each_packets_dscp_and_ecn_on_the_wire() {
    // Between two default-tagged tensors: each case's packets are told apart by their flow.
    let cases = [
        Tagging::Default {
            layer: 0,
            num_layers: 4,
            dscp: 46,
        },
        Tagging::Function,
        Tagging::Default {
            layer: 3,
            num_layers: 4,
            dscp: 10,
        },
    ];
    check_dscp_on_the_wire(
        "a_c_priority_function_sets_each_packets_dscp_and_ecn_on_the_wire",
        &cases,
    );
}

#[test]
fn forged_aggregation_data_from_a_peer_is_gw_err_data_naming_it() {
    // A forged rank 1 (a real endpoint, a hand-made message: tests/common/forge.rs) sends
    // rank 0's first all-reduce its contribution under a contributor set that also claims
    // rank 0's (counted twice if accepted), leaves rank 1 out, or names a rank outside the job.
    for (mask, what) in [
        (0b11, "names a rank it cannot carry"),
        (0b01, "leaves out the rank whose values it carries"),
        (1 << 5, "names a rank beyond the world"),
    ] {
        let mut cfg = config(0, 2);
        cfg.loss_bound = 0.1; // contributor sets travel only with a loss bound
        let mut ep = ptr::null_mut();
        // SAFETY: valid config and out-pointer.
        ok(unsafe { gw_endpoint_bind(&cfg, &mut ep) });
        let (mut p, mut n) = (ptr::null(), 0);
        // SAFETY: a live endpoint.
        ok(unsafe { gw_endpoint_address(ep, &mut p, &mut n) });
        // SAFETY: gw_endpoint_address gave n bytes at p.
        let mine = unsafe { std::slice::from_raw_parts(p, n) }.to_vec();
        let forged = forge::ForgedRank::bind(
            1,
            std::net::Ipv4Addr::LOCALHOST.into(),
            Duration::from_secs(10),
        );
        let table = [mine, forged.endpoint()];
        let (meet0, meet1) = Meet::pair();
        std::thread::scope(|sc| {
            // Dropped as soon as this closure fails: the forged rank then stops at once.
            let meet0 = meet0;
            let table = &table;
            sc.spawn(move || {
                let links = forged.connect_and_forge(table, 8, 1.0, mask);
                // Its links stay up until rank 0 has seen the data and checked the outcome.
                meet1.sync();
                drop(links);
            });
            let ptrs = [table[0].as_ptr(), table[1].as_ptr()];
            let lens = [table[0].len(), table[1].len()];
            let mut s = ptr::null_mut();
            // SAFETY: a live endpoint, a table of 2 addresses, an out-pointer.
            ok(unsafe { gw_endpoint_connect(ep, ptrs.as_ptr(), lens.as_ptr(), 2, &mut s) });
            // SAFETY: freed once (spent by connect).
            unsafe { gw_endpoint_free(ep) };
            let s = Session(s);
            let mut x = [2.0f32; 8];
            let rc = s.sum_f32(&mut x);
            let m = fails(rc, GW_ERR_DATA);
            assert!(m.contains(what), "mask {mask:#b}: {m}");
            assert_eq!(gw_last_error_peer(), 1, "{m}");
            // The session stopped part-way: it says so rather than running on.
            // SAFETY: a live session.
            fails(unsafe { gw_barrier(s.0) }, GW_ERR_UNUSABLE);
            meet0.sync();
        });
    }
}
