//! BPF_PROG_TEST_RUN fixtures: for each kind of frame, the verdict and the exact change of
//! every counter. No network is needed (the program is loaded, not attached), but loading
//! needs root: without it each test prints `SKIPPED: needs root` to stderr and returns,
//! unless `GRADWIRE_REQUIRE_PRIV=1`, in which case it fails.
//!
//! Observed on kernel 6.18: a test run performs no redirect; `bpf_redirect_map` on a queue
//! without a registered socket returns the fallback, so good gradwire frames come back as
//! `XDP_PASS` and count as `to_kernel` (see `tests/xsk_redirect.rs` for the socket case).
//! The kernel refuses test frames shorter than 14 bytes with EINVAL before the program runs.

mod common;

use std::net::IpAddr;

use common::*;
use gradwire_ebpf::{XdpConfig, XdpCounters, XdpError, XDP_DROP, XDP_PASS};

macro_rules! root_or_skip {
    ($name:expr) => {
        if !require_root($name) {
            return;
        }
    };
}

fn cfg() -> XdpConfig {
    XdpConfig::new(vec![PORT])
}

#[test]
fn ipv4_every_dscp_and_ecn_including_ce() {
    root_or_skip!("ipv4_every_dscp_and_ecn_including_ce");
    let p = load(&cfg());
    for dscp in 0..64u8 {
        for ecn in 0..4u8 {
            let f = Frame::v4().dscp_ecn(dscp, ecn).build();
            let (v, d) = run(&p, &f);
            assert_eq!(v, XDP_PASS, "dscp {dscp} ecn {ecn}");
            assert_eq!(
                d,
                expect_to_kernel(dscp << 2 | ecn, f.len()),
                "dscp {dscp} ecn {ecn}"
            );
        }
    }
    // Every (DSCP, ECN) pair now has exactly one packet; 64 of them are CE.
    let c = p.counters().unwrap();
    assert_eq!(c.classes.len(), 256);
    assert!(c.classes.iter().all(|k| k.packets == 1));
    assert_eq!(c.ce_packets, 64);
    assert_eq!(c.gradwire.packets, 256);
    assert_eq!(c.to_kernel.packets, 256);
}

#[test]
fn ipv6_every_dscp_and_ecn_including_ce() {
    root_or_skip!("ipv6_every_dscp_and_ecn_including_ce");
    let p = load(&cfg());
    for dscp in 0..64u8 {
        for ecn in 0..4u8 {
            let f = Frame::v6().dscp_ecn(dscp, ecn).build();
            let (v, d) = run(&p, &f);
            assert_eq!(v, XDP_PASS, "dscp {dscp} ecn {ecn}");
            assert_eq!(
                d,
                expect_to_kernel(dscp << 2 | ecn, f.len()),
                "dscp {dscp} ecn {ecn}"
            );
        }
    }
    let c = p.counters().unwrap();
    assert_eq!(c.classes.len(), 256);
    assert_eq!(c.ce_packets, 64);
}

#[test]
fn one_vlan_tag_8021q_and_8021ad() {
    root_or_skip!("one_vlan_tag_8021q_and_8021ad");
    let p = load(&cfg());
    for tpid in [ETH_P_8021Q, ETH_P_8021AD] {
        for base in [Frame::v4(), Frame::v6()] {
            let fr = base.vlan(tpid).dscp_ecn(26, 3);
            let f = fr.build();
            let (v, d) = run(&p, &f);
            assert_eq!(v, XDP_PASS, "tpid {tpid:#x} {:?}", fr.l3);
            assert_eq!(d, expect_to_kernel(26 << 2 | 3, f.len()));
        }
    }
}

#[test]
fn two_vlan_tags_are_not_parsed() {
    root_or_skip!("two_vlan_tags_are_not_parsed");
    let p = load(&cfg());
    for base in [Frame::v4(), Frame::v6()] {
        let f = base.vlan(ETH_P_8021AD).vlan(ETH_P_8021Q).build();
        let (v, d) = run(&p, &f);
        assert_eq!(v, XDP_PASS);
        assert_eq!(d, expect_passed(f.len()));
    }
}

#[test]
fn other_udp_ports_pass_untouched() {
    root_or_skip!("other_udp_ports_pass_untouched");
    let p = load(&cfg());
    for port in [OTHER_PORT, 53, 0, 22, u16::MAX] {
        for base in [Frame::v4(), Frame::v6(), Frame::v4().vlan(ETH_P_8021Q)] {
            let f = base.port(port).build();
            let (v, d) = run(&p, &f);
            assert_eq!(v, XDP_PASS, "port {port}");
            assert_eq!(d, expect_passed(f.len()), "port {port}");
        }
    }
}

#[test]
fn all_eight_configured_ports_match() {
    root_or_skip!("all_eight_configured_ports_match");
    let ports: Vec<u16> = (0..8).map(|i| 9000 + i * 11).collect();
    let p = load(&XdpConfig::new(ports.clone()));
    for port in &ports {
        let f = Frame::v4().port(*port).build();
        assert_eq!(
            run(&p, &f),
            (XDP_PASS, expect_to_kernel(0, f.len())),
            "port {port}"
        );
    }
    for port in [PORT, 9001, 8999] {
        let f = Frame::v6().port(port).build();
        assert_eq!(
            run(&p, &f),
            (XDP_PASS, expect_passed(f.len())),
            "port {port}"
        );
    }
}

#[test]
fn arp_and_tcp_pass() {
    root_or_skip!("arp_and_tcp_pass");
    let p = load(&cfg());
    let f = arp();
    assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
    // TCP to the gradwire port number (e.g. a control channel on the same port).
    for base in [Frame::v4(), Frame::v6()] {
        let mut fr = base;
        fr.proto = 6;
        let f = fr.build();
        assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
    }
}

#[test]
fn ipv4_fragments_pass() {
    root_or_skip!("ipv4_fragments_pass");
    let p = load(&cfg());
    // First fragment (MF, offset 0), middle (MF, offset), last (offset only).
    for frag in [0x2000u16, 0x2000 | 185, 185] {
        let mut fr = Frame::v4();
        fr.l3 = L3::V4 {
            src: SRC4,
            options: vec![],
            frag,
            tot_len: None,
        };
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_PASS, expect_passed(f.len())),
            "frag {frag:#x}"
        );
    }
}

#[test]
fn ipv4_options_are_skipped() {
    root_or_skip!("ipv4_options_are_skipped");
    let p = load(&cfg());
    // IHL 6 and IHL 15: the UDP header sits after the options.
    for opts in [vec![1u8, 1, 1, 0], vec![1u8; 40]] {
        let mut fr = Frame::v4().dscp_ecn(10, 2);
        fr.l3 = L3::V4 {
            src: SRC4,
            options: opts.clone(),
            frag: 0,
            tot_len: None,
        };
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_PASS, expect_to_kernel(10 << 2 | 2, f.len()))
        );
        // Same with another port: the port is read at the right place.
        let f = fr.port(OTHER_PORT).build();
        assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
    }
}

#[test]
fn malformed_ip_headers_pass_to_the_kernel() {
    root_or_skip!("malformed_ip_headers_pass_to_the_kernel");
    let p = load(&cfg());
    // IHL < 5 and a wrong version nibble: not parseable as IP, the kernel drops them.
    let mut f = Frame::v4().build();
    f[14] = 0x44;
    assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
    let mut f = Frame::v4().build();
    f[14] = 0x65;
    assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
    let mut f = Frame::v6().build();
    f[14] = 0x40;
    assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
}

#[test]
fn ipv6_extension_headers_pass() {
    root_or_skip!("ipv6_extension_headers_pass");
    let p = load(&cfg());
    let mut fr = Frame::v6();
    fr.l3 = L3::V6 {
        src: SRC6,
        hop_by_hop: true,
        payload_len: None,
    };
    let f = fr.build();
    assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
}

#[test]
fn truncated_udp_and_gradwire_header_are_dropped() {
    root_or_skip!("truncated_udp_and_gradwire_header_are_dropped");
    let p = load(&cfg());
    for base in [Frame::v4(), Frame::v6(), Frame::v6().vlan(ETH_P_8021Q)] {
        // Gradwire header cut short (consistent lengths, UDP length 8 + 31).
        let f = base.clone().body(31).build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "short header"
        );
        // No gradwire header at all.
        let f = base.clone().body(0).build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "no header"
        );
        // Exactly the header and no payload is fine.
        let f = base.clone().body(32).build();
        assert_eq!(
            run(&p, &f),
            (XDP_PASS, expect_to_kernel(0, f.len())),
            "exact header"
        );
        // UDP length field below the header length, frame long enough.
        let mut fr = base.clone();
        fr.udp_len = Some(8 + 31);
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "udp len 39"
        );
        // UDP length field below 8.
        fr.udp_len = Some(4);
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "udp len 4"
        );
        // UDP length says more than the IP payload and the frame hold.
        fr.udp_len = Some(8 + 132 + 1);
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "udp len too big"
        );
        // UDP length shorter than the IP payload is legal (the kernel trims): accepted.
        fr.udp_len = Some(8 + 100);
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_PASS, expect_to_kernel(0, f.len())),
            "udp len < ip"
        );
    }
}

#[test]
fn inconsistent_ip_lengths_are_dropped() {
    root_or_skip!("inconsistent_ip_lengths_are_dropped");
    let p = load(&cfg());
    let l4 = 8 + 132u16;
    // IPv4 total length: beyond the frame, shorter than IP + UDP headers, shorter than UDP
    // length says.
    for tot in [20 + l4 + 1, 20 + 4, 20 + l4 - 1, 0] {
        let mut fr = Frame::v4();
        fr.l3 = L3::V4 {
            src: SRC4,
            options: vec![],
            frag: 0,
            tot_len: Some(tot),
        };
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "tot_len {tot}"
        );
    }
    // IPv6 payload length likewise.
    for plen in [l4 + 1, 4, l4 - 1, 0] {
        let mut fr = Frame::v6();
        fr.l3 = L3::V6 {
            src: SRC6,
            hop_by_hop: false,
            payload_len: Some(plen),
        };
        let f = fr.build();
        assert_eq!(
            run(&p, &f),
            (XDP_DROP, expect_truncated(f.len())),
            "payload_len {plen}"
        );
    }
    // Ethernet padding after a complete datagram is fine.
    let mut f = Frame::v4().build();
    f.extend_from_slice(&[0; 16]);
    assert_eq!(
        run(&p, &f),
        (XDP_PASS, expect_to_kernel(0, f.len())),
        "trailing padding"
    );
}

/// Every prefix of a good frame: shorter than the UDP header -> not identifiable, passed;
/// UDP header present but the datagram cut -> gradwire, dropped as truncated; shorter than
/// Ethernet -> refused by the kernel, no counter moves.
#[test]
fn frames_cut_at_every_layer() {
    root_or_skip!("frames_cut_at_every_layer");
    let p = load(&cfg());
    let mut with_options = Frame::v4().vlan(ETH_P_8021Q);
    with_options.l3 = L3::V4 {
        src: SRC4,
        options: vec![1; 12],
        frag: 0,
        tot_len: None,
    };
    let cases = [
        Frame::v4(),
        Frame::v6(),
        Frame::v4().vlan(ETH_P_8021Q),
        Frame::v6().vlan(ETH_P_8021AD),
        with_options,
    ];
    for fr in cases {
        let full = fr.build();
        let udp_end = fr.l4_offset() + 8;
        for len in 0..full.len() {
            let f = &full[..len];
            if len < 14 {
                let before = p.counters().unwrap();
                let err = p.test_run(f).expect_err("kernel must refuse < 14 bytes");
                assert!(matches!(err, XdpError::TestRun { .. }), "{err}");
                assert_eq!(p.counters().unwrap(), before, "len {len}");
                continue;
            }
            let (v, d) = run(&p, f);
            if len < udp_end {
                assert_eq!(
                    (v, d),
                    (XDP_PASS, expect_passed(len)),
                    "len {len} {:?}",
                    fr.l3
                );
            } else {
                assert_eq!(
                    (v, d),
                    (XDP_DROP, expect_truncated(len)),
                    "len {len} {:?}",
                    fr.l3
                );
            }
        }
        assert_eq!(run(&p, &full), (XDP_PASS, expect_to_kernel(0, full.len())));
    }
}

#[test]
fn allowlist_drops_foreign_sources() {
    root_or_skip!("allowlist_drops_foreign_sources");
    let mut c = cfg();
    c.allowlist = Some(vec![IpAddr::V4(SRC4), IpAddr::V6(SRC6)]);
    let mut p = load(&c);
    let tos = 46 << 2 | 1;
    let ok4 = Frame::v4().dscp_ecn(46, 1).build();
    let ok6 = Frame::v6().dscp_ecn(46, 1).build();
    let bad4 = Frame::v4().dscp_ecn(46, 1).src4(FOREIGN4).build();
    let bad6 = Frame::v6().dscp_ecn(46, 1).src6(FOREIGN6).build();
    assert_eq!(run(&p, &ok4), (XDP_PASS, expect_to_kernel(tos, ok4.len())));
    assert_eq!(run(&p, &ok6), (XDP_PASS, expect_to_kernel(tos, ok6.len())));
    // Dropped, but counted in the class table (it shows what arrived).
    assert_eq!(
        run(&p, &bad4),
        (XDP_DROP, expect_not_allowed(tos, bad4.len()))
    );
    assert_eq!(
        run(&p, &bad6),
        (XDP_DROP, expect_not_allowed(tos, bad6.len()))
    );
    // Non-gradwire traffic from a foreign source is not the allowlist's business.
    let other = Frame::v4().src4(FOREIGN4).port(OTHER_PORT).build();
    assert_eq!(run(&p, &other), (XDP_PASS, expect_passed(other.len())));
    // An IPv4 source never matches an IPv6 entry with the same leading bytes.
    let mut v6_lookalike = [0u8; 16];
    v6_lookalike[..4].copy_from_slice(&FOREIGN4.octets());
    p.allow(IpAddr::from(v6_lookalike)).unwrap();
    assert_eq!(
        run(&p, &bad4),
        (XDP_DROP, expect_not_allowed(tos, bad4.len()))
    );

    // Runtime changes.
    p.allow(IpAddr::V4(FOREIGN4)).unwrap();
    assert_eq!(
        run(&p, &bad4),
        (XDP_PASS, expect_to_kernel(tos, bad4.len()))
    );
    p.disallow(IpAddr::V4(FOREIGN4)).unwrap();
    p.disallow(IpAddr::V4(FOREIGN4)).unwrap(); // absent: not an error
    assert_eq!(
        run(&p, &bad4),
        (XDP_DROP, expect_not_allowed(tos, bad4.len()))
    );
    // IPv4-mapped form of an allowed address is the same entry.
    p.disallow("::ffff:198.18.0.2".parse().unwrap()).unwrap();
    assert_eq!(
        run(&p, &ok4),
        (XDP_DROP, expect_not_allowed(tos, ok4.len()))
    );
    p.set_allowlist_enabled(false).unwrap();
    assert_eq!(
        run(&p, &bad6),
        (XDP_PASS, expect_to_kernel(tos, bad6.len()))
    );
}

#[test]
fn empty_allowlist_drops_all_gradwire() {
    root_or_skip!("empty_allowlist_drops_all_gradwire");
    let mut c = cfg();
    c.allowlist = Some(vec![]);
    let p = load(&c);
    let f = Frame::v6().build();
    assert_eq!(run(&p, &f), (XDP_DROP, expect_not_allowed(0, f.len())));
    let f = arp();
    assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
}

#[test]
fn fault_injection_p1_drops_p0_passes() {
    root_or_skip!("fault_injection_p1_drops_p0_passes");
    let mut c = cfg();
    c.fault_drop[46] = 1.0;
    let p = load(&c);
    let ef = Frame::v4().dscp_ecn(46, 2).build();
    let be = Frame::v4().dscp_ecn(0, 2).build();
    for _ in 0..100 {
        assert_eq!(
            run(&p, &ef),
            (XDP_DROP, expect_fault(46 << 2 | 2, ef.len()))
        );
        assert_eq!(run(&p, &be), (XDP_PASS, expect_to_kernel(2, be.len())));
    }
    p.set_fault_drop(46, 0.0).unwrap();
    for _ in 0..100 {
        assert_eq!(
            run(&p, &ef),
            (XDP_PASS, expect_to_kernel(46 << 2 | 2, ef.len()))
        );
    }
    p.set_fault_drop(0, 1.0).unwrap();
    let f6 = Frame::v6().dscp_ecn(0, 0).build();
    assert_eq!(run(&p, &f6), (XDP_DROP, expect_fault(0, f6.len())));
    // Out of range arguments.
    assert!(matches!(
        p.set_fault_drop(64, 0.5),
        Err(XdpError::InvalidConfig(_))
    ));
    assert!(matches!(
        p.set_fault_drop(1, 1.01),
        Err(XdpError::InvalidConfig(_))
    ));
    assert!(matches!(
        p.set_fault_drop(1, f64::NAN),
        Err(XdpError::InvalidConfig(_))
    ));
}

#[test]
fn fault_injection_half_drops_about_half() {
    root_or_skip!("fault_injection_half_drops_about_half");
    let p = load(&cfg());
    p.set_fault_drop(8, 0.5).unwrap();
    let f = Frame::v4().dscp_ecn(8, 0).build();
    let n = 4000;
    let mut dropped = 0;
    for _ in 0..n {
        let (v, _) = p.test_run(&f).unwrap();
        if v == XDP_DROP {
            dropped += 1;
        }
    }
    let c = p.counters().unwrap();
    assert_eq!(c.drop_fault.packets, dropped);
    assert_eq!(c.to_kernel.packets, n - dropped);
    assert_eq!(c.class(8, 0).packets, n);
    // Binomial(4000, 0.5): sd ~32; 6 sd either side.
    assert!((1800..=2200).contains(&dropped), "dropped {dropped} of {n}");
}

#[test]
fn allowlist_is_checked_before_fault_injection() {
    root_or_skip!("allowlist_is_checked_before_fault_injection");
    let mut c = cfg();
    c.allowlist = Some(vec![IpAddr::V4(SRC4)]);
    c.fault_drop[0] = 1.0;
    let p = load(&c);
    let foreign = Frame::v4().src4(FOREIGN4).build();
    assert_eq!(
        run(&p, &foreign),
        (XDP_DROP, expect_not_allowed(0, foreign.len()))
    );
    let ok = Frame::v4().build();
    assert_eq!(run(&p, &ok), (XDP_DROP, expect_fault(0, ok.len())));
}

#[test]
fn disabled_classifier_passes_everything() {
    root_or_skip!("disabled_classifier_passes_everything");
    let mut p = load(&cfg());
    p.set_enabled(false).unwrap();
    for f in [Frame::v4().build(), Frame::v6().body(3).build(), arp()] {
        assert_eq!(run(&p, &f), (XDP_PASS, expect_passed(f.len())));
    }
    p.set_enabled(true).unwrap();
    let f = Frame::v4().build();
    assert_eq!(run(&p, &f), (XDP_PASS, expect_to_kernel(0, f.len())));
}

#[test]
fn counters_invariant_and_json() {
    root_or_skip!("counters_invariant_and_json");
    let mut c = cfg();
    c.allowlist = Some(vec![IpAddr::V4(SRC4)]);
    c.fault_drop[1] = 1.0;
    let p = load(&c);
    let frames = [
        Frame::v4().build(),
        Frame::v4().src4(FOREIGN4).build(),
        Frame::v4().dscp_ecn(1, 3).build(),
        Frame::v4().body(3).build(),
        Frame::v6().build(),
        arp(),
    ];
    for f in &frames {
        p.test_run(f).unwrap();
    }
    let k = p.counters().unwrap();
    let sum = |cs: &[gradwire_ebpf::Counter]| cs.iter().map(|c| c.packets).sum::<u64>();
    assert_eq!(
        k.gradwire.packets,
        sum(&[
            k.drop_truncated,
            k.drop_not_allowed,
            k.drop_fault,
            k.redirected,
            k.to_kernel
        ])
    );
    assert_eq!(k.gradwire.packets + k.passed.packets, frames.len() as u64);
    assert_eq!(
        k.classes_total().packets,
        k.gradwire.packets - k.drop_truncated.packets
    );
    assert_eq!(k.ce_packets, 1);
    let json = serde_json::to_value(&k).unwrap();
    assert_eq!(json["drop_not_allowed"]["packets"], 2); // FOREIGN4 and the IPv6 source
    assert_eq!(json["ce_packets"], 1);
    assert!(json["classes"].as_array().is_some_and(|a| !a.is_empty()));
    assert_eq!(XdpCounters::default().since(&k), XdpCounters::default());
}

#[test]
fn register_xsk_rejects_non_xdp_sockets() {
    root_or_skip!("register_xsk_rejects_non_xdp_sockets");
    use std::os::fd::AsFd;
    let p = load(&cfg());
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let err = p
        .register_xsk(0, udp.as_fd())
        .expect_err("a UDP socket is not an XSK");
    assert!(matches!(err, XdpError::Map { map: "xsks", .. }), "{err}");
    let err = p
        .register_xsk(64, udp.as_fd())
        .expect_err("queue 64 is out of range");
    assert!(matches!(err, XdpError::InvalidConfig(_)), "{err}");
    p.unregister_xsk(3).unwrap(); // empty slot: not an error
}

#[test]
fn invalid_configs_are_refused_before_loading() {
    // No privilege needed: validation happens first.
    for ports in [vec![], vec![0], vec![1, 1], (1..=9).collect::<Vec<u16>>()] {
        let err = load_err(&XdpConfig::new(ports.clone()));
        assert!(
            matches!(err, Some(XdpError::InvalidConfig(_))),
            "{ports:?}: {err:?}"
        );
    }
    let mut c = cfg();
    c.fault_drop[5] = 2.0;
    assert!(matches!(load_err(&c), Some(XdpError::InvalidConfig(_))));
}

fn load_err(c: &XdpConfig) -> Option<XdpError> {
    gradwire_ebpf::XdpProgram::load_detached(c).err()
}

#[test]
fn switch_port_mode_hands_every_frame_to_the_socket_slot() {
    root_or_skip!("switch_port_mode_hands_every_frame_to_the_socket_slot");
    let mut c = cfg();
    c.switch_port = true;
    // Neither the allowlist nor fault injection applies to a switch port.
    c.allowlist = Some(vec![IpAddr::V4(SRC4)]);
    c.fault_drop[0] = 1.0;
    let p = load(&c);
    let frames = [
        Frame::v4().build(),
        Frame::v4().src4(FOREIGN4).build(),
        Frame::v4().port(OTHER_PORT).build(),
        Frame::v4().body(3).build(),
        Frame::v6().build(),
        arp(),
    ];
    let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
    for f in &frames {
        // No socket is registered (and a test run performs no redirect): the fallback.
        let (v, out) = p.test_run(f).unwrap();
        assert_eq!(v, XDP_PASS);
        assert_eq!(&out, f, "switch mode must not modify the frame");
    }
    let k = p.counters().unwrap();
    assert_eq!(k.switched.packets, frames.len() as u64);
    assert_eq!(k.switched.bytes, bytes);
    assert_eq!(k.gradwire.packets + k.passed.packets, 0);
    assert!(k.classes.is_empty());
}
