//! DCTCP as a BPF congestion control (`gradwire_ebpf::tcp_cc`), against the real kernel:
//! registration and its kernel-wide scope, a byte-exact transfer between two namespaces with
//! ECN negotiated and the RFC 8257 Alpha recurrence checked on an unmarked path, DCTCP
//! against CUBIC through the emulated switch (marks instead of drops), and unregistration.
//!
//! A registration is kernel-wide, so the tests of this binary take turns ([`serial`]).

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use gradwire_control::render::fabric::FabricQos;
use gradwire_ebpf::tcp_cc::{self, Dctcp, DctcpSocketStats, TcpCcError, DCTCP_NAME};
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig, FabricStats};
use gradwire_fabric::topology::{default_policy, Topology};
use gradwire_netns::{require_root, run_in_netns, Testbed, TestbedConfig};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrIn};

const PORT: u16 = 5201;
/// Bound on every blocking socket call, so a failing test ends.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// One registration at a time in this process (and it is the only test binary that
/// registers).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls `cond` until it holds or `within` passes; returns whether it held. For states the
/// kernel reaches asynchronously (an ACK still in flight) and announces by nothing we could
/// wait on.
fn wait_for(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// A listener on `ip:PORT` in `netns` using congestion control `cc` (accepted sockets inherit
/// it).
fn listen(netns: &str, ip: Ipv4Addr, cc: &'static str) -> TcpListener {
    run_in_netns(netns, move || {
        let l = TcpListener::bind((ip, PORT)).unwrap();
        tcp_cc::set_congestion_control(&l, cc).unwrap();
        l
    })
    .unwrap()
}

/// A TCP connection from `netns` to `dst` whose socket uses `cc` from before the SYN (so
/// that the SYN already asks for ECN when `cc` needs it).
fn connect(netns: &str, dst: Ipv4Addr, cc: &'static str) -> TcpStream {
    run_in_netns(netns, move || {
        let fd = socket::socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        tcp_cc::set_congestion_control(&fd, cc).unwrap();
        socket::connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::from(SocketAddrV4::new(dst, PORT)),
        )
        .unwrap();
        let s = TcpStream::from(fd);
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        s
    })
    .unwrap()
}

/// Connects `senders` (namespaces) to the listener, one connection each, and accepts them:
/// (sender socket, receiver socket) pairs. The handshake completes in the backlog, so
/// accepting after connecting never blocks.
fn connect_all(
    senders: &[&str],
    l: &TcpListener,
    dst: Ipv4Addr,
    cc: &'static str,
) -> Vec<(TcpStream, TcpStream)> {
    senders
        .iter()
        .map(|ns| {
            let s = connect(ns, dst, cc);
            let local = s.local_addr().unwrap();
            let (r, peer) = l.accept().unwrap();
            assert_eq!(peer, local, "accepted the connection just made");
            (s, r)
        })
        .collect()
}

/// Byte `i` of flow `flow`'s payload: position-dependent, so a lost, duplicated or reordered
/// byte shows.
fn pattern(flow: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 13) ^ flow.wrapping_mul(101)) as u8
}

/// Sends `bytes` on every pair at once and checks that each receiver got exactly its flow's
/// bytes; returns the pairs for inspection.
fn transfer(pairs: Vec<(TcpStream, TcpStream)>, bytes: usize) -> Vec<(TcpStream, TcpStream)> {
    let mut handles = Vec::new();
    for (flow, (mut s, mut r)) in pairs.into_iter().enumerate() {
        r.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        let writer = thread::spawn(move || {
            let chunk = 64 * 1024;
            let mut buf = vec![0u8; chunk];
            let mut sent = 0;
            while sent < bytes {
                let n = chunk.min(bytes - sent);
                for (k, b) in buf[..n].iter_mut().enumerate() {
                    *b = pattern(flow, sent + k);
                }
                s.write_all(&buf[..n]).unwrap();
                sent += n;
            }
            s.shutdown(Shutdown::Write).unwrap();
            s
        });
        let reader = thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            let mut got = 0usize;
            loop {
                let n = r.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                for (k, b) in buf[..n].iter().enumerate() {
                    assert_eq!(*b, pattern(flow, got + k), "flow {flow}: byte {}", got + k);
                }
                got += n;
            }
            (r, got)
        });
        handles.push((writer, reader));
    }
    handles
        .into_iter()
        .enumerate()
        .map(|(flow, (w, r))| {
            let s = w.join().unwrap();
            let (r, got) = r.join().unwrap();
            assert_eq!(got, bytes, "flow {flow}: received bytes");
            (s, r)
        })
        .collect()
}

fn stats(d: &Dctcp, sock: &TcpStream) -> DctcpSocketStats {
    d.socket_stats(sock)
        .unwrap()
        .expect("the socket used gw_dctcp, so it has DCTCP storage")
}

#[test]
fn registers_and_carries_a_byte_exact_transfer_with_ecn() {
    if !require_root("registers_and_carries_a_byte_exact_transfer_with_ecn") {
        return;
    }
    let _turn = serial();
    let dctcp = Dctcp::register().unwrap();
    assert_eq!(dctcp.name(), DCTCP_NAME);
    assert!(tcp_cc::is_registered(DCTCP_NAME).unwrap());

    let tb = Testbed::up(&TestbedConfig::default()).unwrap();
    let (a, b) = (tb.host(0).clone(), tb.host(1).clone());
    // Kernel-wide: a namespace created after the registration lists it too.
    let listed_inside = tb.run_in(1, tcp_cc::available).unwrap().unwrap();
    assert!(
        listed_inside.iter().any(|n| n == DCTCP_NAME),
        "{listed_inside:?}"
    );

    const BYTES: usize = 4 << 20;
    let l = listen(&b.netns, b.ipv4, DCTCP_NAME);
    let pairs = connect_all(&[a.netns.as_str()], &l, b.ipv4, DCTCP_NAME);
    let pairs = transfer(pairs, BYTES);
    let (s, r) = &pairs[0];
    assert_eq!(tcp_cc::congestion_control(s).unwrap(), DCTCP_NAME);
    assert_eq!(tcp_cc::congestion_control(r).unwrap(), DCTCP_NAME);

    // Every data byte and the FIN acknowledged, as the sender's program counted them.
    let acked = BYTES as u64 + 1;
    let done = wait_for(Duration::from_secs(5), || {
        stats(&dctcp, s).counters.acked_bytes >= acked
    });
    let st = stats(&dctcp, s);
    let rt = stats(&dctcp, r);
    eprintln!("sender {st:?}\nreceiver {rt:?}");
    assert!(done, "acked {} of {acked}", st.counters.acked_bytes);
    assert_eq!(st.counters.acked_bytes, acked);
    assert_eq!(st.counters.sockets, 1);
    assert!(st.ecn_negotiated() && rt.ecn_negotiated(), "ECN negotiated");
    // A veth marks nothing: no ECE, no CE, and Alpha followed RFC 8257's recurrence with
    // M = 0 from 1.0, window by window.
    assert_eq!(st.counters.marked_bytes, 0);
    assert_eq!(rt.counters.ce_flips, 0);
    assert!(st.counters.windows > 0);
    assert_eq!(
        st.alpha_fixed,
        tcp_cc::alpha_after_unmarked_windows(st.counters.windows)
    );
    // The data arrived ECN-capable: the receiving kernel saw ECT packets.
    assert!(rt.ect_received(), "receiver saw ECT");
    // The kernel's own report (inet_diag, independent of the program) names it too.
    let ss = tb.exec(0, &["ss", "-tin"]).unwrap();
    let info = ss
        .lines()
        .skip_while(|line| !line.contains(&format!("{}:{PORT}", b.ipv4)))
        .nth(1)
        .unwrap_or_default();
    assert!(info.contains(DCTCP_NAME), "ss: {ss}");
    let totals = dctcp.counters().unwrap();
    assert!(
        totals.sockets >= 2 && totals.acked_bytes >= acked,
        "{totals:?}"
    );

    drop(pairs);
    drop(l);
    tb.down().unwrap();
    dctcp.unregister().unwrap();
}

#[test]
fn drop_unregisters_and_a_name_is_registered_once() {
    if !require_root("drop_unregisters_and_a_name_is_registered_once") {
        return;
    }
    let _turn = serial();
    let first = Dctcp::register().unwrap();
    let second = Dctcp::register().unwrap_err();
    assert!(
        matches!(second, TcpCcError::AlreadyRegistered { .. }),
        "{second}"
    );
    assert_eq!(
        second.raw_os_error(),
        Some(nix::errno::Errno::EEXIST as i32)
    );
    drop(first);
    assert!(!tcp_cc::is_registered(DCTCP_NAME).unwrap());

    // Selecting it now fails with ENOENT and says what to do.
    let sock = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let e = tcp_cc::set_congestion_control(&sock, DCTCP_NAME).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(nix::errno::Errno::ENOENT as i32));
    assert!(e.to_string().contains("Dctcp::register"), "{e}");

    // It can be registered again, and unregistered explicitly.
    let again = Dctcp::register().unwrap();
    assert!(tcp_cc::is_registered(DCTCP_NAME).unwrap());
    tcp_cc::set_congestion_control(&sock, DCTCP_NAME).unwrap();
    again.unregister().unwrap();
    assert!(!tcp_cc::is_registered(DCTCP_NAME).unwrap());
    // A socket that selected it keeps it after the unregistration.
    assert_eq!(tcp_cc::congestion_control(&sock).unwrap(), DCTCP_NAME);
}

/// Two senders into one receiver behind one switch whose link to the receiver is the
/// bottleneck (100 Mbit/s; senders' links 1 Gbit/s). Best-effort (DSCP 0) traffic uses
/// queue 0, which marks ECT packets and drops others above its threshold.
const TOPO: &str = r#"
name = "dct"
[defaults]
rate = "1Gbit"
delay = "20us"
[[switch]]
name = "s0"
[[host]]
name = "h"
count = 2
uplink = "s0"
[[host]]
name = "r"
[[link]]
a = "r"
b = "s0"
rate = "100Mbit"
"#;

/// (marked, dropped) on the switch port towards host `r`.
fn bottleneck(st: &FabricStats) -> (u64, u64) {
    let sw = st.switch("s0").unwrap();
    let port = sw.ports.iter().find(|p| p.peer == "host r").unwrap();
    let sum = port.egress.sum();
    (sum.marked, sum.dropped_threshold + sum.dropped_buffer)
}

#[test]
fn dctcp_is_marked_where_cubic_is_dropped_at_a_shared_bottleneck() {
    if !require_root("dctcp_is_marked_where_cubic_is_dropped_at_a_shared_bottleneck") {
        return;
    }
    let _turn = serial();
    let dctcp = Dctcp::register().unwrap();
    let qos = FabricQos::from_policy(&default_policy()).unwrap();
    let topo = Topology::from_toml(TOPO, qos).unwrap();
    // One fabric at a time (across test binaries too): a second one on this machine's
    // two cores makes both fall behind their clock.
    let _fabric_lock = gradwire_netns::FabricLock::acquire().unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fabric = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let rx = topo.hosts[2].ip;
    assert_eq!(topo.hosts[2].name, "r");
    let senders = [net.host_ns(0).unwrap(), net.host_ns(1).unwrap()];
    let rx_ns = net.host_ns(2).unwrap();
    const BYTES: usize = 6 << 20;

    // Phase 1: two DCTCP flows.
    let l = listen(rx_ns, rx, DCTCP_NAME);
    let pairs = transfer(connect_all(&senders, &l, rx, DCTCP_NAME), BYTES);
    drop(l);
    assert!(fabric.wait_idle(Duration::from_secs(10)), "fabric drained");
    let after_dctcp = bottleneck(&fabric.stats().unwrap());
    let sender_stats: Vec<DctcpSocketStats> = pairs.iter().map(|(s, _)| stats(&dctcp, s)).collect();
    let receiver_stats: Vec<DctcpSocketStats> =
        pairs.iter().map(|(_, r)| stats(&dctcp, r)).collect();
    drop(pairs);

    // Phase 2: the same with CUBIC (ECN off, the namespaces' default).
    let l = listen(rx_ns, rx, "cubic");
    let pairs = transfer(connect_all(&senders, &l, rx, "cubic"), BYTES);
    for (s, _) in &pairs {
        assert!(dctcp.socket_stats(s).unwrap().is_none(), "cubic socket");
    }
    drop((l, pairs));
    assert!(fabric.wait_idle(Duration::from_secs(10)), "fabric drained");
    let st = fabric.stop().unwrap();
    let after_cubic = bottleneck(&st);
    net.down().unwrap();

    let dctcp_phase = after_dctcp;
    let cubic_phase = (after_cubic.0 - after_dctcp.0, after_cubic.1 - after_dctcp.1);
    eprintln!(
        "bottleneck (marked, dropped): DCTCP {dctcp_phase:?}, CUBIC {cubic_phase:?}; lag {:?}",
        st.lag
    );
    for (i, (s, r)) in sender_stats.iter().zip(&receiver_stats).enumerate() {
        eprintln!(
            "flow {i}: alpha {:.3}, {:?}; receiver {:?}",
            s.alpha(),
            s.counters,
            r.counters
        );
        assert!(s.ecn_negotiated() && r.ecn_negotiated(), "flow {i}: ECN");
        assert!(r.ect_received(), "flow {i}: ECT data");
        // The switch's marks were echoed back and counted, window by window ...
        assert!(s.counters.marked_bytes > 0, "flow {i}: marked bytes");
        assert!(s.counters.marked_windows > 0, "flow {i}: marked windows");
        assert!(r.counters.ce_flips > 0, "flow {i}: receiver saw CE");
        // ... which kept Alpha above its unmarked decay and made the sender reduce.
        assert!(
            s.alpha_fixed >= tcp_cc::alpha_after_unmarked_windows(s.counters.windows),
            "flow {i}"
        );
        assert!(s.counters.reductions > 0, "flow {i}: reductions");
    }
    assert!(dctcp_phase.0 > 0, "the switch marked DCTCP's packets");
    assert_eq!(cubic_phase.0, 0, "CUBIC's packets are not ECN-capable");
    assert!(cubic_phase.1 > 0, "CUBIC overflowed the threshold");
    assert!(
        dctcp_phase.1 < cubic_phase.1,
        "DCTCP drops {} not below CUBIC's {}",
        dctcp_phase.1,
        cubic_phase.1
    );
    dctcp.unregister().unwrap();
}
