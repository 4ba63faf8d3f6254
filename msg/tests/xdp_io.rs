//! The message layer over AF_XDP between two network namespaces joined by a veth (root only):
//! a 4 MiB message each way between two `XdpIo` endpoints, interoperation with a kernel UDP
//! endpoint both ways, and datagrams from outside the allowlist that must be dropped in XDP,
//! counted, and never reach the endpoint or its core.
//!
//! Every test holds [`FabricLock`] (it times traffic through namespaces), runs under a
//! watchdog, and tears its testbed down on any exit: the `Testbed` on drop or unwinding, the
//! namespaces' reaper if the process dies; the XDP programs and AF_XDP sockets close with their
//! endpoints (or the process). Without root they are reported as skipped, unless
//! `GRADWIRE_REQUIRE_PRIV=1`, which makes them fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/net.rs"]
mod net;

use std::io::IoSlice;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use gradwire_msg::core::{Ended, Stats};
use gradwire_msg::endpoint::Endpoint;
use gradwire_msg::io::xdp::{BindMode, XdpIo, XdpIoError, XdpMonitor, XdpSnapshot};
use gradwire_msg::io::{Readiness, RecvMeta, Transmit};
use gradwire_msg::mem::Region;
use gradwire_netns::{require_root, FabricLock, Testbed, TestbedConfig};

use net::{pattern, start, xdp_config, Kind, Swap, Watchdog};

const PORT: u16 = 7300;
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Root, the fabric lock and a two-host testbed, or `None` (skipped).
fn setup(name: &str) -> Option<(FabricLock, Testbed)> {
    if !require_root(name) {
        return None;
    }
    let lock = FabricLock::acquire().expect("the fabric lock");
    let tb = Testbed::up(&TestbedConfig::default()).expect("testbed");
    Some((lock, tb))
}

/// Ranks 0 and 1 swap messages of `len` bytes (patterns `seed` and `seed + 1`); checks both
/// arrive byte for byte.
fn swap(eps: &[Endpoint], len: usize, seed: u64) {
    let handles: Vec<_> = eps
        .iter()
        .enumerate()
        .map(|(r, ep)| {
            let tx = Region::owned(pattern(len, seed + r as u64));
            let rx = Region::owned(vec![0xA5; len]);
            ep.submit(Swap::new(1 - r as u16, true, tx, rx))
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (_, rx, report) = match h.wait_timeout(OP_TIMEOUT) {
            Ok(res) => res.unwrap_or_else(|e| panic!("rank {r}: {e}")),
            Err(h) => {
                h.cancel();
                panic!(
                    "rank {r}: no swap within {OP_TIMEOUT:?}: {:?}",
                    h.wait().err()
                );
            }
        };
        assert_eq!(report.ended, Ended::Complete, "rank {r}");
        let got = rx.into_vec().unwrap();
        let want = pattern(len, seed + 1 - r as u64);
        assert!(got == want, "rank {r}: the {len}-byte message differs");
    }
}

/// Every datagram the core was handed, whatever it made of it.
fn core_seen(s: &Stats) -> u64 {
    s.refused
        + s.ctrl_received
        + s.data_placed
        + s.data_duplicate
        + s.unexpected_kept
        + s.unexpected_dropped
}

fn snapshot(m: &XdpMonitor) -> XdpSnapshot {
    m.snapshot(Duration::from_secs(5))
        .expect("the progress thread answers the monitor")
}

#[test]
fn four_mib_each_way_between_two_xdp_endpoints() {
    let Some((_lock, tb)) = setup("xdp_io four_mib_each_way") else {
        return;
    };
    let _dog = Watchdog::arm("four_mib_each_way", Duration::from_secs(120));
    let ranks = start(&tb, &[Kind::Xdp, Kind::Xdp], PORT, |_| {});
    swap(&ranks.eps, 4 << 20, 1);
    // And again on the same channels (message numbers 1), a size that ends mid-segment.
    swap(&ranks.eps, (4 << 20) + 1001, 10);
    for (r, m) in ranks.monitors.iter().enumerate() {
        let s = snapshot(m.as_ref().unwrap());
        let q = s.afxdp.queues[0];
        let xdp = s.afxdp.xdp.clone().unwrap();
        eprintln!(
            "rank {r}: {:?} mode, {:?}; xdp redirected {} passed {} dropped-not-allowed {}",
            q.mode, s.io, xdp.redirected.packets, xdp.passed.packets, xdp.drop_not_allowed.packets
        );
        assert_eq!(q.mode, Some(BindMode::Copy), "a veth binds in copy mode");
        // Both messages came through the AF_XDP socket, not the kernel's UDP stack.
        let min = 2 * ((4 << 20) / 1432) as u64;
        assert!(s.io.rx_datagrams >= min, "rank {r}: {:?}", s.io);
        assert!(
            xdp.redirected.packets >= s.io.rx_datagrams,
            "rank {r}: {xdp:?}"
        );
        assert_eq!(xdp.to_kernel.packets, 0, "rank {r}");
        assert_eq!(xdp.drop_not_allowed.packets, 0, "rank {r}");
        assert_eq!(s.io.rx_dropped, 0, "rank {r}");
        assert!(s.io.tx_datagrams >= min, "rank {r}: {:?}", s.io);
        let st = ranks.eps[r].stats();
        assert_eq!(st.unknown_source, 0, "rank {r}");
    }
}

#[test]
fn xdp_and_kernel_udp_endpoints_interoperate_both_ways() {
    let Some((_lock, tb)) = setup("xdp_io interop") else {
        return;
    };
    let _dog = Watchdog::arm("interop", Duration::from_secs(120));
    for kinds in [[Kind::Xdp, Kind::Udp], [Kind::Udp, Kind::Xdp]] {
        let ranks = start(&tb, &kinds, PORT, |_| {});
        swap(&ranks.eps, 1 << 20, 20);
        swap(&ranks.eps, 3000, 30);
        let x = kinds.iter().position(|k| *k == Kind::Xdp).unwrap();
        let s = snapshot(ranks.monitors[x].as_ref().unwrap());
        eprintln!("{kinds:?}: AF_XDP rank {x}: {:?}", s.io);
        assert!(s.io.rx_datagrams >= ((1 << 20) / 1432) as u64, "{:?}", s.io);
        assert!(s.io.tx_datagrams >= ((1 << 20) / 1432) as u64, "{:?}", s.io);
        for ep in &ranks.eps {
            assert_eq!(ep.stats().unknown_source, 0);
        }
    }
}

/// Sends `n` datagrams that look like the layer's (version 1, a control kind, 64 bytes: past
/// the classifier's length check) from `from` to `to`, inside host `host`.
fn send_from(tb: &Testbed, host: usize, from: SocketAddr, to: SocketAddr, n: usize) {
    tb.run_in(host, move || {
        let s = UdpSocket::bind(from).unwrap();
        let mut d = [0u8; 64];
        d[0] = 1;
        d[1] = 5;
        d[2] = 6; // PING
        d[4..8].copy_from_slice(&7u32.to_be_bytes());
        for _ in 0..n {
            s.send_to(&d, to).unwrap();
        }
    })
    .unwrap();
}

/// Waits until `f` of a fresh snapshot holds, at most 5 s; returns the snapshot.
fn wait_for(m: &XdpMonitor, what: &str, f: impl Fn(&XdpSnapshot) -> bool) -> XdpSnapshot {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let s = snapshot(m);
        if f(&s) {
            return s;
        }
        assert!(Instant::now() < end, "{what}: {:?} {:?}", s.io, s.afxdp.xdp);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn datagrams_from_outside_the_allowlist_never_reach_the_core() {
    let Some((_lock, tb)) = setup("xdp_io allowlist") else {
        return;
    };
    let _dog = Watchdog::arm("allowlist", Duration::from_secs(120));
    // A second address on host 1 that is no rank's.
    let foreign = Ipv4Addr::new(198, 18, 0, 77);
    tb.exec(1, &["ip", "addr", "add", "198.18.0.77/24", "dev", "gw0"])
        .unwrap();
    let ranks = start(&tb, &[Kind::Xdp, Kind::Xdp], PORT, |_| {});
    swap(&ranks.eps, 100_000, 40);
    let m0 = ranks.monitors[0].as_ref().unwrap();
    let before = snapshot(m0);
    let xdp0 = before.afxdp.xdp.clone().unwrap();
    let st0 = ranks.eps[0].stats();
    let core0 = core_seen(&st0.core);
    assert_eq!(st0.unknown_source, 0);

    // From the foreign address: dropped in XDP, counted there, never seen above it.
    const N: usize = 50;
    let to = ranks.addrs[0];
    send_from(&tb, 1, SocketAddr::new(IpAddr::V4(foreign), 0), to, N);
    let after = wait_for(m0, "foreign datagrams dropped in XDP", |s| {
        s.afxdp.xdp.as_ref().unwrap().drop_not_allowed.packets
            >= xdp0.drop_not_allowed.packets + N as u64
    });
    let xdp1 = after.afxdp.xdp.clone().unwrap();
    eprintln!(
        "foreign: drop_not_allowed {} -> {}",
        xdp0.drop_not_allowed.packets, xdp1.drop_not_allowed.packets
    );
    assert_eq!(
        xdp1.drop_not_allowed.packets - xdp0.drop_not_allowed.packets,
        N as u64
    );
    assert_eq!(
        after.io.rx_datagrams, before.io.rx_datagrams,
        "nothing reached the AF_XDP socket"
    );
    let st = ranks.eps[0].stats();
    assert_eq!(st.unknown_source, 0, "nothing reached the endpoint");
    assert_eq!(
        st.datagrams_in, st0.datagrams_in,
        "nothing reached the endpoint"
    );
    assert_eq!(core_seen(&st.core), core0, "nothing reached the core");

    // The control: a peer's address from another port passes XDP (it filters addresses) and
    // reaches the socket, where the endpoint refuses it as from no rank: still not the core.
    let peer_ip = ranks.addrs[1].ip();
    send_from(&tb, 1, SocketAddr::new(peer_ip, 0), to, N);
    let end = Instant::now() + Duration::from_secs(5);
    while ranks.eps[0].stats().unknown_source < N as u64 {
        assert!(Instant::now() < end, "{:?}", ranks.eps[0].stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = ranks.eps[0].stats();
    assert_eq!(st.unknown_source, N as u64);
    assert_eq!(st.datagrams_in, st0.datagrams_in + N as u64);
    assert_eq!(
        core_seen(&st.core),
        core0,
        "the endpoint kept them from the core"
    );
    let s = snapshot(m0);
    assert_eq!(
        s.afxdp.xdp.unwrap().drop_not_allowed.packets,
        xdp1.drop_not_allowed.packets
    );
    // The endpoints still talk.
    swap(&ranks.eps, 100_000, 50);
}

/// Receives on `io` until `n` datagrams arrived or 5 s passed.
fn recv_n(io: &mut XdpIo, n: usize) -> Vec<(RecvMeta, Vec<u8>)> {
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(5);
    while got.len() < n && Instant::now() < end {
        io.wait(Some(Duration::from_millis(50)), false).unwrap();
        io.recv(&mut |m, d| got.push((m, d.to_vec()))).unwrap();
    }
    got
}

/// The socket itself, without an endpoint: bundles cut at their segment size across slice
/// boundaries, each datagram with its bundle's TOS byte and our source address; what the
/// receiving classifier drops (a datagram shorter than a gradwire header) and what the
/// socket drops (a kernel UDP datagram whose checksum the sender left to an offload the veth
/// does not perform) counted; `wait` timing out, woken and readable.
#[test]
fn xdp_io_sends_bundles_with_their_tos_and_counts_what_it_drops() {
    if !require_root("xdp_io socket") {
        return;
    }
    let _lock = FabricLock::acquire().expect("the fabric lock");
    // TX checksum offload on: kernel UDP then sends partial checksums across the veth.
    let tb = Testbed::up(&TestbedConfig {
        tx_checksum_offload: true,
        ..TestbedConfig::default()
    })
    .expect("testbed");
    let _dog = Watchdog::arm("xdp_io socket", Duration::from_secs(60));
    let ips = [0, 1].map(|i| IpAddr::V4(tb.host(i).ipv4));
    // Port 0: the kernel picks a free one, which the socket then holds.
    let opened: Vec<XdpIo> = (0..2)
        .map(|i| {
            let ip = ips[i];
            tb.run_in(i, move || XdpIo::open(&xdp_config(ip, 0)).unwrap())
                .unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = opened.iter().map(XdpIo::local_addr).collect();
    assert!(addrs.iter().all(|a| a.port() != 0), "{addrs:?}");
    let mut ios: Vec<XdpIo> = opened
        .into_iter()
        .enumerate()
        .map(|(i, mut io)| {
            let peers = addrs.clone();
            tb.run_in(i, move || {
                io.allow_peers(&peers).unwrap();
                io
            })
            .unwrap()
        })
        .collect();
    assert_eq!(ios[0].allowed_peers(), vec![ips[1]]);
    let mut b = ios.pop().unwrap();
    let mut a = ios.pop().unwrap();

    // wait: times out with nothing set, then a wake from another thread ends it.
    let t = Instant::now();
    let r = b.wait(Some(Duration::from_millis(50)), false).unwrap();
    assert_eq!(r, Readiness::default());
    assert!(t.elapsed() >= Duration::from_millis(45));
    let w = b.waker();
    let waker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        w.wake();
    });
    let r = b.wait(Some(Duration::from_secs(5)), false).unwrap();
    assert!(r.woken && !r.readable, "{r:?}");
    waker.join().unwrap();
    assert!(a.wait(Some(Duration::ZERO), true).unwrap().writable);

    // Bundles: 5 datagrams of 1000 (the last 500) cut across slices; an empty one; one of 37.
    let data = pattern(4500, 3);
    let small = pattern(37, 4);
    let parts = [&data[..7], &data[7..7], &data[7..1500], &data[1500..]];
    let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    let small_iov = [IoSlice::new(&small)];
    let dst = b.local_addr();
    let batch = [
        Transmit {
            dst,
            tos: (26 << 2) | 2,
            segment_size: 1000,
            iov: &iov,
        },
        Transmit {
            dst,
            tos: 0xb8,
            segment_size: 0,
            iov: &[],
        },
        Transmit {
            dst,
            tos: 1,
            segment_size: 1000,
            iov: &small_iov,
        },
    ];
    assert_eq!(a.send(&batch).unwrap(), 3);
    let s = a.stats();
    assert_eq!((s.tx_bundles, s.tx_datagrams), (3, 7), "{s:?}");
    let got = recv_n(&mut b, 6);
    let want: Vec<(u8, Vec<u8>)> = data
        .chunks(1000)
        .map(|c| ((26 << 2) | 2, c.to_vec()))
        .chain([(1, small.clone())])
        .collect();
    let seen: Vec<(u8, Vec<u8>)> = got.iter().map(|(m, d)| (m.tos, d.clone())).collect();
    assert_eq!(seen, want);
    assert!(got.iter().all(|(m, _)| m.src == a.local_addr()));
    let xb = b.afxdp_stats().xdp.unwrap();
    assert_eq!(xb.drop_truncated.packets, 1, "the empty datagram: {xb:?}");
    assert_eq!(b.stats().rx_datagrams, 6);

    // Refused bundles: nothing sent, the destination named.
    let big = vec![0u8; 5000];
    let big_iov = [IoSlice::new(&big)];
    for t in [
        Transmit {
            dst,
            tos: 0,
            segment_size: 5000,
            iov: &big_iov,
        },
        Transmit {
            dst: "[2001:db8::1]:7".parse().unwrap(),
            tos: 0,
            segment_size: 10,
            iov: &small_iov,
        },
        Transmit {
            dst,
            tos: 0,
            segment_size: 0,
            iov: &small_iov,
        },
    ] {
        let e = a.send(&[t]).unwrap_err();
        assert!(matches!(e, XdpIoError::Transmit { .. }), "{e}");
        assert!(e.to_string().contains(&t.dst.ip().to_string()), "{e}");
    }
    assert_eq!(a.stats().tx_datagrams, 7);

    // Kernel UDP from b's host with a partial checksum reaches a's socket and is dropped.
    let to = a.local_addr();
    let from = SocketAddr::new(ips[1], 0);
    send_from(&tb, 1, from, to, 3);
    let end = Instant::now() + Duration::from_secs(5);
    let mut delivered = 0;
    while a.stats().rx_dropped < 3 {
        assert!(Instant::now() < end, "{:?}", a.stats());
        a.wait(Some(Duration::from_millis(50)), false).unwrap();
        delivered += a.recv(&mut |_, _| {}).unwrap();
    }
    assert_eq!(delivered, 0);
    assert_eq!(a.stats().rx_dropped, 3);
    drop((a, b));
    drop(tb);
}
