//! Kernel UDP I/O of the message layer (`gradwire_msg::io::udp`) on loopback: GSO bundles,
//! GRO receive, per-bundle TOS, several destinations per call, the waker, timeouts, bind
//! errors and a flood into a tiny receive buffer. Every test is bounded by a deadline.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::IoSlice;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire_msg::io::udp::{IoError, Readiness, RecvMeta, Transmit, UdpConfig, UdpIo};

/// Longest any test waits for datagrams.
const DEADLINE: Duration = Duration::from_secs(5);
/// Payload of a full Ethernet-MTU IPv4 datagram.
const SEG: usize = 1472;

fn lo4() -> SocketAddr {
    (Ipv4Addr::LOCALHOST, 0).into()
}

fn lo6() -> SocketAddr {
    (Ipv6Addr::LOCALHOST, 0).into()
}

fn bind(addr: SocketAddr, gso: bool, gro: bool) -> UdpIo {
    let cfg = UdpConfig {
        gso,
        gro,
        ..UdpConfig::default()
    };
    UdpIo::bind(addr, &cfg).unwrap()
}

/// Receives until `n` datagrams arrived or the deadline passed.
fn recv_n(io: &mut UdpIo, n: usize) -> Vec<(RecvMeta, Vec<u8>)> {
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::new();
    while got.len() < n {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let k = io.recv(&mut |m, d| got.push((m, d.to_vec()))).unwrap();
        if k == 0 {
            io.wait(Some(deadline - now), false).unwrap();
        }
    }
    got
}

/// Asserts nothing more arrives within 50 ms.
fn assert_quiet(io: &mut UdpIo) {
    io.wait(Some(Duration::from_millis(50)), false).unwrap();
    let extra = io.recv(&mut |_, _| {}).unwrap();
    assert_eq!(extra, 0, "unexpected datagrams");
}

/// A bundle as a caller builds it: per datagram a 16-byte header slice and a payload slice.
struct Bundle {
    /// [header0, payload0, header1, payload1, ...]
    parts: Vec<Vec<u8>>,
    /// What each datagram must look like on arrival.
    datagrams: Vec<Vec<u8>>,
}

impl Bundle {
    /// `full` datagrams of `seg` bytes, then one of `last` bytes (none when 0).
    fn new(tag: u8, full: usize, seg: usize, last: usize) -> Bundle {
        let mut parts = Vec::new();
        let mut datagrams = Vec::new();
        let sizes = std::iter::repeat_n(seg, full).chain((last > 0).then_some(last));
        for (i, size) in sizes.enumerate() {
            assert!(size >= 16);
            let mut hdr = vec![tag; 16];
            hdr[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let payload: Vec<u8> = (0..size - 16)
                .map(|j| (j as u8).wrapping_mul(31) ^ (i as u8) ^ tag)
                .collect();
            datagrams.push([hdr.as_slice(), payload.as_slice()].concat());
            parts.push(hdr);
            parts.push(payload);
        }
        Bundle { parts, datagrams }
    }

    fn iov(&self) -> Vec<IoSlice<'_>> {
        self.parts.iter().map(|p| IoSlice::new(p)).collect()
    }

    fn bytes(&self) -> Vec<u8> {
        self.parts.concat()
    }
}

fn payloads(got: &[(RecvMeta, Vec<u8>)]) -> Vec<Vec<u8>> {
    got.iter().map(|(_, d)| d.clone()).collect()
}

/// (1) 40 segments of 1472 bytes and a short last one, in one `send`: exactly those 41
/// datagrams arrive, in order, byte for byte; with GRO the receiver needed fewer buffers.
#[test]
fn gso_bundle_of_41_datagrams_arrives_whole_and_in_order() {
    for lo in [lo4(), lo6()] {
        let mut tx = bind(lo, true, true);
        let mut rx = bind(lo, true, true);
        assert!(
            tx.gso_enabled() && rx.gro_enabled(),
            "Linux 6 has UDP GSO and GRO"
        );
        assert_eq!(tx.max_segments(), 64);
        let b = Bundle::new(1, 40, SEG, 300);
        let iov = b.iov();
        let t = Transmit {
            dst: rx.local_addr(),
            tos: 0,
            segment_size: SEG,
            iov: &iov,
        };
        assert_eq!(tx.send(&[t]).unwrap(), 1);
        let s = tx.stats();
        assert_eq!(s.send_syscalls, 1, "one sendmmsg for the bundle");
        assert_eq!((s.send_bundles, s.send_datagrams), (1, 41));
        assert_eq!(s.send_bytes, (40 * SEG + 300) as u64);

        let got = recv_n(&mut rx, 41);
        assert_eq!(payloads(&got), b.datagrams, "{lo}");
        assert!(got.iter().all(|(m, _)| m.src == tx.local_addr()));
        assert_quiet(&mut rx);
        let r = rx.stats();
        assert_eq!(r.recv_datagrams, 41);
        assert_eq!(r.recv_bytes, (40 * SEG + 300) as u64);
        assert!(
            r.recv_buffers < 41,
            "GRO should coalesce: {} buffers for 41 datagrams",
            r.recv_buffers
        );
    }
}

/// (2) With GSO off on the sender and GRO off on the receiver (and the mixed cases) the same
/// bundle arrives byte for byte the same; without GSO it still takes one `sendmmsg`.
#[test]
fn without_gso_or_gro_the_bytes_are_the_same() {
    let b = Bundle::new(2, 40, SEG, 300);
    for lo in [lo4(), lo6()] {
        for (gso, gro) in [(true, true), (false, false), (true, false), (false, true)] {
            let mut tx = bind(lo, gso, true);
            let mut rx = bind(lo, true, gro);
            assert_eq!(tx.gso_enabled(), gso);
            assert_eq!(rx.gro_enabled(), gro);
            assert_eq!(tx.max_segments(), if gso { 64 } else { 1 });
            let iov = b.iov();
            let t = Transmit {
                dst: rx.local_addr(),
                tos: 0,
                segment_size: SEG,
                iov: &iov,
            };
            assert_eq!(tx.send(&[t]).unwrap(), 1);
            assert_eq!(tx.stats().send_syscalls, 1, "41 datagrams fit one sendmmsg");
            assert_eq!(tx.stats().send_datagrams, 41);
            let got = recv_n(&mut rx, 41);
            assert_eq!(payloads(&got), b.datagrams, "{lo} gso {gso} gro {gro}");
            assert_quiet(&mut rx);
            if !gro {
                assert_eq!(rx.stats().recv_buffers, 41, "one buffer per datagram");
            }
        }
    }
}

/// Datagram boundaries need not fall on slice boundaries, with or without GSO, and a bundle
/// above one IP packet (64 x 1472 B) is cut into several GSO sends within the same call.
#[test]
fn bundles_cut_anywhere_and_above_64k_arrive_intact() {
    for gso in [true, false] {
        let mut tx = bind(lo4(), gso, true);
        let mut rx = bind(lo4(), true, true);
        let b = Bundle::new(3, 64, SEG, 0);
        let bytes = b.bytes();
        let iov: Vec<IoSlice<'_>> = bytes.chunks(1000).map(IoSlice::new).collect();
        let t = Transmit {
            dst: rx.local_addr(),
            tos: 0,
            segment_size: SEG,
            iov: &iov,
        };
        assert!(bytes.len() > tx.max_bundle_bytes());
        assert_eq!(tx.send(&[t]).unwrap(), 1);
        // 64 datagrams: two GSO msghdrs, or 64 plain ones: one sendmmsg either way.
        assert_eq!(tx.stats().send_syscalls, 1);
        assert_eq!(tx.stats().send_datagrams, 64);
        let got = recv_n(&mut rx, 64);
        assert_eq!(payloads(&got), b.datagrams, "gso {gso}");
        assert_quiet(&mut rx);
    }
}

/// A GSO send of exactly the largest IP packet's payload (65507 B over IPv4, 65527 B over
/// IPv6) goes out as one message; larger bundles are cut, never refused.
#[test]
fn largest_gso_bundles_fit_one_message() {
    // 13 x 5039 = 65507 and 7 x 9361 = 65527: the exact limits (loopback MTU is 64 KiB).
    for (lo, seg, segs) in [(lo4(), 5039, 13), (lo6(), 9361, 7)] {
        let mut tx = bind(lo, true, true);
        let mut rx = bind(lo, true, true);
        assert_eq!(seg * segs, tx.max_bundle_bytes());
        for extra in [0, 1] {
            let b = Bundle::new(4, segs, seg, extra * 100);
            let iov = b.iov();
            let t = Transmit {
                dst: rx.local_addr(),
                tos: 0,
                segment_size: seg,
                iov: &iov,
            };
            let before = tx.stats().send_syscalls;
            assert_eq!(tx.send(&[t]).unwrap(), 1, "{lo} +{extra}");
            assert_eq!(tx.stats().send_syscalls - before, 1);
            let got = recv_n(&mut rx, segs + extra);
            assert_eq!(payloads(&got), b.datagrams, "{lo} +{extra}");
        }
        assert_quiet(&mut rx);
    }
}

/// (3) Several bundles to two destinations in one `send`: one system call, each receiver
/// gets its own bundles, in order.
#[test]
fn bundles_to_two_destinations_in_one_send() {
    for lo in [lo4(), lo6()] {
        let mut tx = bind(lo, true, true);
        let mut a = bind(lo, true, true);
        let mut b = bind(lo, true, true);
        let a1 = Bundle::new(0xa1, 10, SEG, 100);
        let b1 = Bundle::new(0xb1, 5, SEG, 0);
        let a2 = Bundle::new(0xa2, 3, 1000, 0);
        let b2 = Bundle::new(0xb2, 0, 0, 500);
        let (a1v, b1v, a2v, b2v) = (a1.iov(), b1.iov(), a2.iov(), b2.iov());
        let batch = [
            Transmit {
                dst: a.local_addr(),
                tos: 0,
                segment_size: SEG,
                iov: &a1v,
            },
            Transmit {
                dst: b.local_addr(),
                tos: 0,
                segment_size: SEG,
                iov: &b1v,
            },
            Transmit {
                dst: a.local_addr(),
                tos: 0,
                segment_size: 1000,
                iov: &a2v,
            },
            Transmit {
                dst: b.local_addr(),
                tos: 0,
                segment_size: 500,
                iov: &b2v,
            },
        ];
        assert_eq!(tx.send(&batch).unwrap(), 4);
        let s = tx.stats();
        assert_eq!(s.send_syscalls, 1);
        assert_eq!((s.send_bundles, s.send_datagrams), (4, 11 + 5 + 3 + 1));
        let got_a = recv_n(&mut a, 14);
        let got_b = recv_n(&mut b, 6);
        assert_eq!(
            payloads(&got_a),
            [a1.datagrams, a2.datagrams].concat(),
            "{lo}"
        );
        assert_eq!(
            payloads(&got_b),
            [b1.datagrams, b2.datagrams].concat(),
            "{lo}"
        );
        assert_quiet(&mut a);
        assert_quiet(&mut b);
    }
}

/// (4) The TOS byte of each bundle (DSCP and ECN, e.g. EF with ECT(1)) is the one each of its
/// datagrams arrives with, GSO bundles included, on IPv4 and IPv6.
#[test]
fn tos_of_each_bundle_is_seen_on_receive() {
    let tos_values = [0xb8 | 0x01, 0x02, 0, 0x28 | 0x02, 0x03];
    for lo in [lo4(), lo6()] {
        let mut tx = bind(lo, true, true);
        let mut rx = bind(lo, true, true);
        let bundles: Vec<Bundle> = (0..tos_values.len())
            .map(|i| Bundle::new(i as u8, 3, SEG, 200))
            .collect();
        let iovs: Vec<Vec<IoSlice<'_>>> = bundles.iter().map(Bundle::iov).collect();
        let batch: Vec<Transmit<'_>> = iovs
            .iter()
            .zip(tos_values)
            .map(|(iov, tos)| Transmit {
                dst: rx.local_addr(),
                tos,
                segment_size: SEG,
                iov,
            })
            .collect();
        assert_eq!(tx.send(&batch).unwrap(), batch.len());
        let got = recv_n(&mut rx, 4 * tos_values.len());
        let want: Vec<Vec<u8>> = bundles.iter().flat_map(|b| b.datagrams.clone()).collect();
        assert_eq!(payloads(&got), want);
        for (k, (meta, _)) in got.iter().enumerate() {
            assert_eq!(meta.tos, tos_values[k / 4], "{lo}: datagram {k}");
        }
    }
}

/// (5) The waker wakes a thread blocked in `wait(None)` from another thread within 1 s, and
/// waking after the socket is gone is harmless.
#[test]
fn waker_wakes_a_blocked_wait_from_another_thread() {
    let io = bind(lo4(), true, true);
    let waker = io.waker();
    let (done_tx, done_rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = io.wait(None, false);
        done_tx
            .send((r.map_err(|e| e.to_string()), t0.elapsed()))
            .unwrap();
        drop(io);
    });
    std::thread::sleep(Duration::from_millis(100));
    let woke_at = Instant::now();
    waker.wake();
    let (r, blocked) = done_rx
        .recv_timeout(Duration::from_secs(1))
        .expect("wait did not return within 1 s of wake");
    assert!(woke_at.elapsed() < Duration::from_secs(1));
    let r = r.unwrap();
    assert!(r.woken && !r.readable, "{r:?}");
    assert!(
        blocked >= Duration::from_millis(90),
        "wait returned early: {blocked:?}"
    );
    th.join().unwrap();
    // The socket is dropped; the waker still holds the eventfd.
    waker.wake();
    waker.clone().wake();
}

/// A wake before the wait is kept, and the wait drains it.
#[test]
fn a_wake_before_the_wait_is_kept_and_drained() {
    let io = bind(lo6(), true, true);
    let w = io.waker();
    w.wake();
    w.wake();
    let t0 = Instant::now();
    let r = io.wait(Some(Duration::from_secs(2)), false).unwrap();
    assert!(
        r.woken && t0.elapsed() < Duration::from_millis(500),
        "{r:?}"
    );
    let r = io.wait(Some(Duration::from_millis(20)), false).unwrap();
    assert_eq!(r, Readiness::default(), "the eventfd was drained");
}

/// (6) `wait` with a 50 ms timeout and nothing to do returns not-readable after about 50 ms;
/// asking for write readiness returns at once.
#[test]
fn wait_times_out_and_reports_writable() {
    let io = bind(lo4(), true, true);
    let t0 = Instant::now();
    let r = io.wait(Some(Duration::from_millis(50)), false).unwrap();
    let took = t0.elapsed();
    assert_eq!(r, Readiness::default());
    assert!(took >= Duration::from_millis(49), "returned after {took:?}");
    assert!(took < Duration::from_secs(1), "returned after {took:?}");
    let t0 = Instant::now();
    let r = io.wait(Some(Duration::from_secs(2)), true).unwrap();
    assert!(r.writable && !r.readable && !r.woken, "{r:?}");
    assert!(t0.elapsed() < Duration::from_millis(500));
}

/// A queued datagram makes `wait` return readable.
#[test]
fn wait_returns_readable_when_a_datagram_is_queued() {
    let mut tx = bind(lo4(), true, true);
    let rx = bind(lo4(), true, true);
    let data = [7u8; 100];
    let iov = [IoSlice::new(&data)];
    let t = Transmit {
        dst: rx.local_addr(),
        tos: 0,
        segment_size: 100,
        iov: &iov,
    };
    assert_eq!(tx.send(&[t]).unwrap(), 1);
    let r = rx.wait(Some(DEADLINE), false).unwrap();
    assert!(r.readable && !r.woken, "{r:?}");
}

/// (7) Binding an address in use fails with an error that names the address and says what
/// to do.
#[test]
fn binding_an_address_in_use_names_it() {
    for lo in [lo4(), lo6()] {
        let first = bind(lo, true, true);
        let addr = first.local_addr();
        let e = UdpIo::bind(addr, &UdpConfig::default()).unwrap_err();
        assert!(
            matches!(e, IoError::Bind { addr: a, .. } if a == addr),
            "{e:?}"
        );
        assert_eq!(e.raw_os_error(), Some(libc::EADDRINUSE));
        let msg = e.to_string();
        assert!(msg.contains(&addr.to_string()), "{msg}");
        assert!(msg.contains("address in use: pick another port"), "{msg}");
        assert!(
            std::error::Error::source(&e).is_some(),
            "the OS error is kept"
        );
    }
}

/// (8) A flood into a receiver with a tiny socket buffer: the receiver drops (or the sender
/// is told to wait), nothing panics, and the counters add up.
#[test]
fn flood_into_a_tiny_receive_buffer_keeps_counters_consistent() {
    let tiny = UdpConfig {
        socket_buffer: 1,
        ..UdpConfig::default()
    };
    let mut rx = UdpIo::bind(lo4(), &tiny).unwrap();
    let big = bind(lo4(), true, true);
    assert!(
        rx.socket_buffers().0 < big.socket_buffers().0,
        "the buffer is tiny"
    );
    let mut tx = bind(lo4(), true, true);
    let b = Bundle::new(8, 0, 0, SEG);
    let iov = b.iov();
    let one = Transmit {
        dst: rx.local_addr(),
        tos: 0,
        segment_size: SEG,
        iov: &iov,
    };
    let batch = vec![one; 500];
    let mut accepted = 0u64;
    let mut received = 0u64;
    let mut check = |_: RecvMeta, d: &[u8]| {
        assert_eq!(d, &b.datagrams[0][..]);
        received += 1;
    };
    // Two rounds: the second round's datagrams report the first round's drops.
    for _ in 0..2 {
        for _ in 0..4 {
            let n = tx.send(&batch).unwrap();
            assert!(n <= batch.len());
            accepted += n as u64;
        }
        while rx.recv(&mut check).unwrap() > 0 {}
    }
    let s = tx.stats();
    assert_eq!(s.send_bundles, accepted);
    assert_eq!(s.send_datagrams, accepted, "one datagram per bundle");
    let r = rx.stats();
    assert_eq!(r.recv_datagrams, received);
    assert!(received > 0, "some datagrams get through");
    assert!(
        received < accepted || accepted < 8 * 500,
        "a 4 KiB buffer cannot hold {accepted} datagrams"
    );
    assert!(
        r.recv_kernel_drops > 0,
        "SO_RXQ_OVFL reports the drops: {r:?}"
    );
    assert!(
        r.recv_datagrams + r.recv_kernel_drops <= s.send_datagrams,
        "received {} + dropped {} > sent {}",
        r.recv_datagrams,
        r.recv_kernel_drops,
        s.send_datagrams
    );
    assert_eq!(r.recv_truncated + r.recv_malformed, 0);
}

/// Bad bundles are refused without panicking and without sending anything; bundles before a
/// bad one go out and the bad one is reported by the next call.
#[test]
fn bad_bundles_are_refused_with_their_destination() {
    let mut tx = bind(lo4(), true, true);
    let mut rx = bind(lo4(), true, true);
    let data = [1u8; 64];
    let iov = [IoSlice::new(&data)];
    let good = Transmit {
        dst: rx.local_addr(),
        tos: 0,
        segment_size: 64,
        iov: &iov,
    };
    let zero_seg = Transmit {
        segment_size: 0,
        ..good
    };
    let v6_dst = Transmit {
        dst: (Ipv6Addr::LOCALHOST, 9).into(),
        ..good
    };
    assert_eq!(tx.send(&[]).unwrap(), 0);
    assert_eq!(tx.stats().send_syscalls, 0);
    for bad in [zero_seg, v6_dst] {
        let e = tx.send(&[bad]).unwrap_err();
        assert!(matches!(e, IoError::Transmit { .. }), "{e}");
        assert!(e.to_string().contains(&bad.dst.to_string()), "{e}");
        assert_eq!(tx.send(&[good, bad, good]).unwrap(), 1);
    }
    assert_eq!(tx.stats().send_datagrams, 2);
    assert_eq!(recv_n(&mut rx, 2).len(), 2);
    // An oversized datagram: the kernel's EMSGSIZE, named with the destination.
    let huge = vec![0u8; 70_000];
    let iov = [IoSlice::new(&huge)];
    let e = tx
        .send(&[Transmit {
            segment_size: huge.len(),
            iov: &iov,
            ..good
        }])
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE), "{e}");
    assert!(e.to_string().contains(&rx.local_addr().to_string()), "{e}");
}

/// An empty bundle is one empty datagram; a segment size above the total is one datagram.
#[test]
fn empty_and_single_datagram_bundles() {
    let mut tx = bind(lo6(), true, true);
    let mut rx = bind(lo6(), true, true);
    let data = [5u8; 300];
    let iov = [IoSlice::new(&data)];
    let batch = [
        Transmit {
            dst: rx.local_addr(),
            tos: 0,
            segment_size: 0,
            iov: &[],
        },
        Transmit {
            dst: rx.local_addr(),
            tos: 0,
            segment_size: 9000,
            iov: &iov,
        },
    ];
    assert_eq!(tx.send(&batch).unwrap(), 2);
    let got = recv_n(&mut rx, 2);
    assert_eq!(payloads(&got), vec![vec![], data.to_vec()]);
}

/// The kernel reports the buffers it gave; a 0 size keeps its default.
#[test]
fn socket_buffers_are_reported() {
    let big = bind(lo4(), true, true);
    let default = UdpIo::bind(
        lo4(),
        &UdpConfig {
            socket_buffer: 0,
            ..UdpConfig::default()
        },
    )
    .unwrap();
    let (r, s) = big.socket_buffers();
    let (dr, ds) = default.socket_buffers();
    assert!(dr > 0 && ds > 0);
    assert!(r >= dr && s >= ds, "({r}, {s}) vs default ({dr}, {ds})");
    let is_root = nix::unistd::geteuid().is_root();
    if is_root && r < 32 << 20 {
        eprintln!("SO_RCVBUFFORCE refused (no CAP_NET_ADMIN?): got {r} bytes");
    }
}

#[test]
fn a_destination_whose_socket_closed_is_reported_unreachable() {
    for lo in [lo4(), lo6()] {
        let mut io = bind(lo, true, true);
        let gone = bind(lo, true, true).local_addr(); // bound, then closed at once
        let live = bind(lo, true, true);
        let bytes = [7u8; 100];
        let iov = [IoSlice::new(&bytes)];
        for dst in [gone, live.local_addr()] {
            let t = Transmit {
                dst,
                tos: 0,
                segment_size: bytes.len(),
                iov: &iov,
            };
            assert_eq!(io.send(&[t]).expect("send"), 1);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut seen = Vec::new();
        while seen.is_empty() && Instant::now() < deadline {
            let r = io
                .wait(Some(Duration::from_millis(50)), false)
                .expect("wait");
            if r.readable {
                io.recv(&mut |_, _| {}).expect("recv");
            }
            seen.extend(io.take_unreachable());
        }
        assert_eq!(
            seen,
            vec![gone],
            "{lo}: only the closed port is unreachable"
        );
        assert!(io.stats().icmp_errors >= 1);
        // The error is consumed: the socket is quiet again and keeps working.
        assert!(io.take_unreachable().is_empty());
        let r = io
            .wait(Some(Duration::from_millis(50)), false)
            .expect("wait");
        assert!(
            !r.errors,
            "{lo}: an error left queued would wake every wait"
        );
    }
}

/// A datagram queued behind an ICMP error is received by the same call that reports the
/// error: the endpoint fails a peer only after taking in what it sent before it closed (its
/// last DONE must not be lost to the error that its exit causes).
#[test]
fn data_queued_behind_an_icmp_error_is_received_in_the_same_call() {
    for lo in [lo4(), lo6()] {
        let mut io = bind(lo, true, true);
        let gone = bind(lo, true, true).local_addr();
        let mut live = bind(lo, true, true);
        let bytes = [9u8; 64];
        let iov = [IoSlice::new(&bytes)];
        let t = Transmit {
            dst: gone,
            tos: 0,
            segment_size: bytes.len(),
            iov: &iov,
        };
        assert_eq!(io.send(&[t]).expect("send"), 1);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !io
            .wait(Some(Duration::from_millis(50)), false)
            .expect("wait")
            .errors
        {
            assert!(Instant::now() < deadline, "{lo}: no ICMP error arrived");
        }
        let t = Transmit {
            dst: io.local_addr(),
            tos: 0,
            segment_size: bytes.len(),
            iov: &iov,
        };
        assert_eq!(live.send(&[t]).expect("send"), 1);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !io
            .wait(Some(Duration::from_millis(50)), false)
            .expect("wait")
            .readable
        {
            assert!(
                Instant::now() < deadline,
                "{lo}: the datagram did not arrive"
            );
        }
        let mut got = 0;
        let n = io.recv(&mut |_, d| got += d.len()).expect("recv");
        assert_eq!(
            (n, got),
            (1, bytes.len()),
            "{lo}: the error hid the datagram"
        );
        assert_eq!(io.take_unreachable(), vec![gone], "{lo}");
    }
}
