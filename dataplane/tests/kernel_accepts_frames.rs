//! The Linux kernel accepts the frames `wire::frame::emit_headers` builds.
//!
//! Two private network namespaces of the namespace kit (`gw<pid>t<n>-a`, `-b`) joined by a
//! veth pair. In `a` an AF_PACKET socket injects raw Ethernet frames on the veth; in `b`
//! ordinary kernel UDP sockets must receive exactly the datagram bytes. Sockets stay bound to the namespace they
//! were created in, so each namespace is entered only briefly, on a throwaway thread, to create
//! its sockets; all sending and receiving then happens on the test thread.
//!
//! Negative controls prove the kernel really verifies what we compute: a veth skb injected by
//! AF_PACKET arrives `CHECKSUM_NONE`, so frames whose checksums are wrong in a single field
//! must be dropped while the otherwise identical correct frame is delivered.
//!
//! Addresses: IPv4 only from 198.18.0.0/15 (benchmarking range), IPv6 only link-local on the
//! veth. Needs root; without it the test prints `SKIPPED: needs root` unless
//! `GRADWIRE_REQUIRE_PRIV=1`, in which case it fails. The same holds for the IPv6 half on a
//! kernel without IPv6.

use gradwire::wire::frame::{self, Ecn, FrameMeta};
use gradwire::wire::header::{self, Flags, Kind};
use gradwire_netns::{
    exec_in_netns, link, new_netns_prefix, require_root, run_in_netns, skip_part, IpBatch,
    NamespaceSet, Veth, VethEnd, COMMAND_TIMEOUT,
};
use nix::sys::socket::{sendto, socket, AddressFamily, LinkAddr, MsgFlags, SockFlag, SockType};
use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

const MAC_A: [u8; 6] = [0x02, 0x67, 0x77, 0x00, 0x00, 0x0a];
const MAC_B: [u8; 6] = [0x02, 0x67, 0x77, 0x00, 0x00, 0x0b];
const IP_A: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const IP_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const LL_A: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0xa);
const LL_B: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0xb);
const PORT_SRC: u16 = 40000;
const PORT_V4: u16 = 47000;
const PORT_V6: u16 = 47001;
const VETH_A: &str = "gw0";
const VETH_B: &str = "gw1";

/// How long to wait for an expected datagram, and how long to keep listening afterwards for
/// datagrams that must not arrive.
const RECV_TIMEOUT: Duration = Duration::from_secs(3);
const QUIET_PERIOD: Duration = Duration::from_millis(300);

/// Two namespaces of the namespace kit joined by a veth pair; dropping it deletes them (by the
/// kit's teardown rule), also when the test panics, and the kit's reaper deletes them if the
/// test process is killed.
struct Namespaces {
    a: String,
    b: String,
    _set: NamespaceSet,
}

impl Namespaces {
    fn create() -> Namespaces {
        let prefix = new_netns_prefix();
        let (a, b) = (format!("{prefix}-a"), format!("{prefix}-b"));
        let set = NamespaceSet::temporary("kernel_accepts_frames", &[a.clone(), b.clone()])
            .expect("create namespaces");
        Veth {
            a: VethEnd {
                netns: &a,
                ifname: VETH_A,
                mac: Some(MAC_A),
            },
            b: VethEnd {
                netns: &b,
                ifname: VETH_B,
                mac: Some(MAC_B),
            },
            mtu: None,
            queues: None,
        }
        .create()
        .expect("veth pair");
        IpBatch::new()
            .addr(VETH_A, IP_A.into(), 24)
            .up(VETH_A)
            .apply(&a)
            .expect("configure a");
        IpBatch::new()
            .addr(VETH_B, IP_B.into(), 24)
            .up(VETH_B)
            .apply(&b)
            .expect("configure b");
        Namespaces { a, b, _set: set }
    }

    /// Enables IPv6 on the veth (the kit disables it in new namespaces) and adds the
    /// link-local addresses; `false` if the kernel has no IPv6, which is a visible skip of the
    /// IPv6 half, or a failure under `GRADWIRE_REQUIRE_PRIV=1`.
    fn add_ipv6(&self) -> bool {
        for (ns, dev, addr) in [(&self.a, VETH_A, LL_A), (&self.b, VETH_B, LL_B)] {
            match link::enable_ipv6(ns, dev) {
                Ok(()) => {}
                Err(e) if link::is_ipv6_missing(&e) => {
                    skip_part(
                        "kernel_accepts_emitted_frames",
                        "IPv6 half",
                        &format!("the kernel has no IPv6: {e}"),
                    );
                    return false;
                }
                Err(e) => panic!("{e}"),
            }
            IpBatch::new()
                .addr6_nodad(dev, addr, 64)
                .apply(ns)
                .unwrap_or_else(|e| panic!("IPv6 link-local address: {e}"));
        }
        true
    }
}

/// Runs `f` on a fresh thread that has joined network namespace `name`. Only that thread
/// switches namespace; sockets it creates stay in `name` after it exits.
fn in_netns<R: Send + 'static>(name: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    run_in_netns(name, f).unwrap_or_else(|e| panic!("{e}"))
}

/// The raw-frame sender in namespace `a`.
struct Injector {
    fd: OwnedFd,
    link: LinkAddr,
}

impl Injector {
    fn open(ns: &str) -> Injector {
        in_netns(ns, || {
            // Protocol 0: transmit only, the socket never receives.
            let fd = socket(
                AddressFamily::Packet,
                SockType::Raw,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .expect("AF_PACKET socket");
            // getifaddrs reports a sockaddr_ll (ifindex, MAC) per interface: exactly the
            // destination address sendto needs, without building one by hand.
            let link = nix::ifaddrs::getifaddrs()
                .expect("getifaddrs")
                .filter(|ifa| ifa.interface_name == VETH_A)
                .find_map(|ifa| ifa.address.and_then(|a| a.as_link_addr().copied()))
                .expect("link address of the veth");
            Injector { fd, link }
        })
    }

    fn send(&self, frame: &[u8]) {
        let n = sendto(self.fd.as_raw_fd(), frame, &self.link, MsgFlags::empty()).expect("sendto");
        assert_eq!(n, frame.len());
    }
}

fn udp_socket(ns: &str, addr: SocketAddr) -> UdpSocket {
    in_netns(ns, move || {
        let s = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        s.set_read_timeout(Some(RECV_TIMEOUT)).expect("timeout");
        s
    })
}

/// A gradwire datagram whose payload is `tag`, so each frame is recognisable on receipt.
fn datagram(seq: u32, tag: &[u8]) -> Vec<u8> {
    let repr = header::Repr {
        kind: Kind::Data,
        flags: Flags::IMPORTANT,
        pass: 0,
        job_id: 7,
        tensor_id: 3,
        round: 1,
        offset: u64::from(seq) * 1440,
        seq,
        length: u16::try_from(tag.len()).expect("short tag"),
        layer: 2,
    };
    let mut d = vec![0u8; repr.buffer_len()];
    repr.emit(&mut header::Packet::new_unchecked(&mut d[..]))
        .expect("emit header");
    d[header::HEADER_LEN..].copy_from_slice(tag);
    d
}

/// Builds a frame the way the AF_XDP path does: datagram copied in place, then headers.
fn build(meta: &FrameMeta, dgram: &[u8]) -> Vec<u8> {
    let hl = frame::header_len(meta.src.is_ipv6());
    let mut buf = vec![0u8; hl + dgram.len()];
    buf[hl..].copy_from_slice(dgram);
    let n = frame::emit_headers(&mut buf, meta, dgram.len()).expect("emit_headers");
    assert_eq!(n, buf.len());
    // Our own parser must agree before we ask the kernel.
    assert_eq!(frame::parse(&buf).expect("self-parse").datagram, dgram);
    buf
}

/// Offsets of the UDP checksum within an emitted frame.
fn udp_csum_at(ipv6: bool) -> std::ops::Range<usize> {
    let start = frame::header_len(ipv6) - 2;
    start..start + 2
}

/// Receives until `expected` datagrams have all arrived (or the timeout passes), then listens
/// for a quiet period, and returns everything received with the sender's address.
fn collect(sock: &UdpSocket, expected: &BTreeSet<Vec<u8>>) -> Vec<(Vec<u8>, SocketAddr)> {
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    let deadline = Instant::now() + RECV_TIMEOUT;
    let mut quiet_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let until = quiet_until.unwrap_or(deadline);
        if now >= until {
            break;
        }
        sock.set_read_timeout(Some(until - now)).expect("timeout");
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => got.push((buf[..n].to_vec(), from)),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(e) => panic!("recv_from: {e}"),
        }
        let have: BTreeSet<Vec<u8>> = got.iter().map(|(d, _)| d.clone()).collect();
        if quiet_until.is_none() && expected.is_subset(&have) {
            quiet_until = Some(Instant::now() + QUIET_PERIOD);
        }
    }
    got
}

/// Reads a counter of namespace `ns` from /proc/net: `table` is the row prefix of the
/// two-line tables in `snmp`/`netstat` (e.g. "Udp"), or "" for the name-value `snmp6` format.
fn net_counter(ns: &str, file: &str, table: &str, name: &str) -> u64 {
    let path = format!("/proc/net/{file}");
    let text = exec_in_netns(ns, &["cat", &path], COMMAND_TIMEOUT)
        .unwrap_or_else(|e| panic!("cannot read {path} in {ns}: {e}"));
    let value = if table.is_empty() {
        text.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(name)).then(|| it.next()).flatten()
        })
    } else {
        let prefix = format!("{table}:");
        let mut rows = text.lines().filter(|l| l.starts_with(&prefix));
        match (rows.next(), rows.next()) {
            (Some(names), Some(values)) => names
                .split_whitespace()
                .zip(values.split_whitespace())
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v),
            _ => None,
        }
    };
    value
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("counter {table}:{name} not found in {path}"))
}

#[test]
fn kernel_accepts_emitted_frames() {
    if !require_root("kernel_accepts_emitted_frames") {
        return;
    }
    let ns = Namespaces::create();
    let has_v6 = ns.add_ipv6();

    let inject = Injector::open(&ns.a);
    let rx4 = udp_socket(&ns.b, SocketAddr::from((IP_B, PORT_V4)));

    // ---- IPv4 ----
    let meta4 = FrameMeta {
        src_mac: MAC_A,
        dst_mac: MAC_B,
        src: SocketAddr::from((IP_A, PORT_SRC)),
        dst: SocketAddr::from((IP_B, PORT_V4)),
        dscp: 26,
        ecn: Ecn::Ect0,
        hop_limit: 64,
        ident: 1,
    };
    let ipv4_csum_at = 24..26;

    let d_bad_ip = datagram(1, b"v4 bad ip header checksum");
    let mut f_bad_ip = build(&meta4, &d_bad_ip);
    f_bad_ip[ipv4_csum_at.clone()].copy_from_slice(&[0x12, 0x34]);
    assert!(frame::parse(&f_bad_ip).is_err());

    let d_bad_udp = datagram(2, b"v4 bad udp checksum");
    let mut f_bad_udp = build(&meta4, &d_bad_udp);
    let at = udp_csum_at(false);
    let good_csum = u16::from_be_bytes([f_bad_udp[at.start], f_bad_udp[at.start + 1]]);
    // Off by one, and never 0 (which would mean "no checksum").
    let wrong = if good_csum == 1 { 2 } else { good_csum - 1 };
    f_bad_udp[at.clone()].copy_from_slice(&wrong.to_be_bytes());
    assert!(frame::parse(&f_bad_udp).is_err());

    // RFC 768: checksum 0 = none; the kernel must deliver it, as our parser does.
    let d_zero = datagram(3, b"v4 zero udp checksum");
    let mut f_zero = build(&meta4, &d_zero);
    f_zero[at.clone()].copy_from_slice(&[0, 0]);
    assert!(frame::parse(&f_zero).is_ok());

    let d_good = datagram(4, b"v4 good");
    let f_good = build(&meta4, &d_good);

    // Odd-length payload so the trailing-byte rule is exercised by the kernel too.
    let d_odd = datagram(5, b"v4 odd length payload");
    assert_eq!(d_odd.len() % 2, 1);
    let f_odd = build(&meta4, &d_odd);

    let ip_csum_errs = net_counter(&ns.b, "netstat", "IpExt", "InCsumErrors");
    let udp_csum_errs = net_counter(&ns.b, "snmp", "Udp", "InCsumErrors");
    let ect0 = net_counter(&ns.b, "netstat", "IpExt", "InECT0Pkts");
    for f in [&f_bad_ip, &f_bad_udp, &f_zero, &f_good, &f_odd] {
        inject.send(f);
    }
    let expected: BTreeSet<Vec<u8>> = [d_zero.clone(), d_good.clone(), d_odd.clone()].into();
    let got = collect(&rx4, &expected);
    let got_set: BTreeSet<Vec<u8>> = got.iter().map(|(d, _)| d.clone()).collect();
    assert!(
        !got_set.contains(&d_bad_ip),
        "kernel delivered a frame with a wrong IPv4 header checksum"
    );
    assert!(
        !got_set.contains(&d_bad_udp),
        "kernel delivered a frame with a wrong UDP checksum: it did not verify"
    );
    assert_eq!(got_set, expected, "IPv4 datagrams received");
    assert_eq!(got.len(), expected.len(), "no duplicates");
    for (_, from) in &got {
        assert_eq!(*from, meta4.src);
    }
    // The drops happened for the reason we intended, not e.g. a wrong MAC or route.
    assert_eq!(
        net_counter(&ns.b, "netstat", "IpExt", "InCsumErrors") - ip_csum_errs,
        1,
        "IPv4 header checksum errors"
    );
    assert_eq!(
        net_counter(&ns.b, "snmp", "Udp", "InCsumErrors") - udp_csum_errs,
        1,
        "UDP checksum errors"
    );
    // And the kernel reads the ECN codepoint where we put it (ECT(0) on every frame).
    assert!(net_counter(&ns.b, "netstat", "IpExt", "InECT0Pkts") - ect0 >= 4);

    // ---- IPv6 (link-local on the veth) ----
    if has_v6 {
        let rx6 = udp_socket(&ns.b, SocketAddr::from((Ipv6Addr::UNSPECIFIED, PORT_V6)));
        let meta6 = FrameMeta {
            src: SocketAddr::from((LL_A, PORT_SRC)),
            dst: SocketAddr::from((LL_B, PORT_V6)),
            ident: 0,
            ecn: Ecn::Ect1,
            ..meta4
        };
        let at6 = udp_csum_at(true);

        let d6_bad = datagram(11, b"v6 bad udp checksum");
        let mut f6_bad = build(&meta6, &d6_bad);
        f6_bad[at6.start] ^= 0x40;
        assert!(frame::parse(&f6_bad).is_err());

        // Mandatory over IPv6: a zero checksum must be dropped, as our parser does.
        let d6_zero = datagram(12, b"v6 zero udp checksum");
        let mut f6_zero = build(&meta6, &d6_zero);
        f6_zero[at6.clone()].copy_from_slice(&[0, 0]);
        assert!(frame::parse(&f6_zero).is_err());

        let d6_good = datagram(13, b"v6 good");
        let f6_good = build(&meta6, &d6_good);
        let d6_odd = datagram(14, b"v6 odd length!!");
        assert_eq!(d6_odd.len() % 2, 1);
        let f6_odd = build(&meta6, &d6_odd);

        let udp6_csum_errs = net_counter(&ns.b, "snmp6", "", "Udp6InCsumErrors");
        for f in [&f6_bad, &f6_zero, &f6_good, &f6_odd] {
            inject.send(f);
        }
        let expected: BTreeSet<Vec<u8>> = [d6_good.clone(), d6_odd.clone()].into();
        let got = collect(&rx6, &expected);
        let got_set: BTreeSet<Vec<u8>> = got.iter().map(|(d, _)| d.clone()).collect();
        assert!(
            !got_set.contains(&d6_bad),
            "kernel delivered a wrong IPv6 UDP checksum"
        );
        assert!(
            !got_set.contains(&d6_zero),
            "kernel delivered a zero IPv6 UDP checksum"
        );
        assert_eq!(got_set, expected, "IPv6 datagrams received");
        // Both the wrong and the zero checksum are counted as checksum errors.
        assert_eq!(
            net_counter(&ns.b, "snmp6", "", "Udp6InCsumErrors") - udp6_csum_errs,
            2,
            "UDPv6 checksum errors"
        );
        for (_, from) in &got {
            assert_eq!((from.ip(), from.port()), (meta6.src.ip(), PORT_SRC));
        }
    }
    drop(ns);
}
