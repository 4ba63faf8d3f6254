//! Fuzzes whole received frames: `wire::frame::parse` (Ethernet, one optional 802.1Q tag,
//! IPv4/IPv6, UDP) and, on success, the gradwire header in the datagram
//! (`header::Packet::new_checked` + `header::Repr::parse`).
//!
//! The first input byte picks a mode, the rest is the frame. Mode bit 0 rewrites the IP and UDP
//! length fields to match the bytes present, bit 1 recomputes the IPv4 header and UDP
//! checksums, bits 2/3 force the ethertype, IP version and protocol of IPv6/IPv4 UDP, so that
//! the fuzzer reaches the later checks and the gradwire header; with bits 0-3 clear the frame
//! is parsed exactly as given.
//!
//! Properties checked:
//! - no input makes any of these panic;
//! - an accepted frame's `datagram` lies inside the frame buffer, and source and destination
//!   are of the same address family;
//! - parse/emit round trip: re-emitting the frame from `ParsedFrame::meta()` with
//!   `frame::emit_headers` (untagged, checksums recomputed) succeeds and parses back to the same
//!   `ParsedFrame`, VLAN tag aside;
//! - an accepted gradwire header spans the whole datagram and re-emits to identical bytes.
#![no_main]

use core::net::IpAddr;
use gradwire_proto::wire::{ethernet, frame, header, ipv4, ipv6, udp};
use libfuzzer_sys::fuzz_target;

/// Best-effort repair of lengths (`fix_len`) and checksums (`fix_sum`); leaves anything it
/// cannot make sense of alone, since `frame::parse` rejects that anyway.
fn fix_up(buf: &mut [u8], mode: u8) {
    let (fix_len, fix_sum) = (mode & 1 != 0, mode & 2 != 0);
    let Ok(eth) = ethernet::Packet::new_checked(&buf[..]) else {
        return;
    };
    let hl = eth.header_len();
    // Bits 2 and 3: make this an IPv6 / IPv4 UDP frame (ethertype, IP version, protocol).
    let force = match mode & 0x0c {
        0x04 => Some((ethernet::ethertype::IPV6, 6u8, 6usize)),
        0x08 => Some((ethernet::ethertype::IPV4, 4u8, 9usize)),
        _ => None,
    };
    if let Some((ethertype, version, proto_at)) = force {
        if buf.len() > hl + proto_at {
            buf[hl - 2..hl].copy_from_slice(&ethertype.to_be_bytes());
            buf[hl] = (version << 4) | (buf[hl] & 0x0f);
            buf[hl + proto_at] = udp::PROTOCOL;
        }
    }
    let Ok(eth) = ethernet::Packet::new_checked(&buf[..]) else {
        return;
    };
    let ethertype = eth.payload_ethertype();
    let ip = &mut buf[hl..];
    let (src, dst, udp_range) = match ethertype {
        ethernet::ethertype::IPV4 => {
            if fix_len && ip.len() >= ipv4::HEADER_LEN {
                let total = u16::try_from(ip.len()).unwrap_or(u16::MAX);
                ip[2..4].copy_from_slice(&total.to_be_bytes());
            }
            let Ok(mut p) = ipv4::Packet::new_checked(&mut ip[..]) else {
                return;
            };
            if fix_sum {
                p.fill_checksum();
            }
            let range = p.header_len()..usize::from(p.total_len());
            (IpAddr::V4(p.src_addr()), IpAddr::V4(p.dst_addr()), range)
        }
        ethernet::ethertype::IPV6 => {
            if fix_len && ip.len() >= ipv6::HEADER_LEN {
                let plen = u16::try_from(ip.len() - ipv6::HEADER_LEN).unwrap_or(u16::MAX);
                ip[4..6].copy_from_slice(&plen.to_be_bytes());
            }
            let Ok(p) = ipv6::Packet::new_checked(&ip[..]) else {
                return;
            };
            let range = ipv6::HEADER_LEN..ipv6::HEADER_LEN + usize::from(p.payload_len());
            (IpAddr::V6(p.src_addr()), IpAddr::V6(p.dst_addr()), range)
        }
        _ => return,
    };
    let Some(u) = ip.get_mut(udp_range) else {
        return;
    };
    if u.len() < udp::HEADER_LEN {
        return;
    }
    if fix_len {
        let len = u16::try_from(u.len()).unwrap_or(u16::MAX);
        u[4..6].copy_from_slice(&len.to_be_bytes());
    }
    if fix_sum {
        let _ = udp::Packet::new_unchecked(&mut u[..]).fill_checksum(&src, &dst);
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, raw)) = input.split_first() else {
        return;
    };
    let mut owned;
    let data: &[u8] = if mode & 0x0f == 0 {
        raw
    } else {
        owned = raw.to_vec();
        fix_up(&mut owned, mode);
        &owned
    };
    let Ok(parsed) = frame::parse(data) else {
        return;
    };

    let outer = data.as_ptr_range();
    let inner = parsed.datagram.as_ptr_range();
    assert!(
        outer.start <= inner.start && inner.end <= outer.end,
        "datagram escapes the frame buffer"
    );
    assert_eq!(parsed.src.is_ipv6(), parsed.dst.is_ipv6(), "mixed families");

    // Re-emit the way the transmit path does: datagram first, headers in front of it.
    let hl = frame::header_len(parsed.src.is_ipv6());
    let mut buf = vec![0u8; hl + parsed.datagram.len()];
    buf[hl..].copy_from_slice(parsed.datagram);
    let emitted = frame::emit_headers(&mut buf, &parsed.meta(), parsed.datagram.len());
    assert_eq!(emitted, Ok(buf.len()), "re-emitting {parsed:?}");
    let reparsed = frame::parse(&buf);
    let expect = frame::ParsedFrame {
        vlan: None,
        datagram: &buf[hl..],
        ..parsed
    };
    assert_eq!(reparsed, Ok(expect), "re-emitted frame parses differently");

    let d = parsed.datagram;
    let Ok(pkt) = header::Packet::new_checked(d) else {
        return;
    };
    let Ok(repr) = header::Repr::parse(&pkt) else {
        return;
    };
    assert_eq!(repr.buffer_len(), d.len(), "gradwire length vs datagram");
    assert_eq!(pkt.payload(), &d[header::HEADER_LEN..], "payload view");
    let mut out = vec![0u8; repr.buffer_len()];
    assert!(
        repr.emit(&mut header::Packet::new_unchecked(&mut out[..]))
            .is_ok(),
        "emit of a parsed header failed: {repr:?}"
    );
    assert_eq!(&out[..header::HEADER_LEN], &d[..header::HEADER_LEN]);
});
