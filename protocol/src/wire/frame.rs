//! Whole frames: Ethernet II + IPv4 or IPv6 + UDP around a gradwire datagram.
//!
//! As emitted (no VLAN tag, no IP options):
//!
//! ```text
//!            IPv4                         IPv6
//! 0   14  Ethernet II               0   14  Ethernet II
//! 14  20  IPv4 header (DF set)      14  40  IPv6 header
//! 34  8   UDP header                54  8   UDP header
//! 42  32  gradwire header           62  32  gradwire header
//! 74  ..  payload                   94  ..  payload
//! ```
//!
//! [`emit_headers`] is built for a zero-copy transmit path: the datagram (gradwire header and
//! payload) is written first, at `header_len(ipv6)`, straight into the frame buffer, and the
//! Ethernet/IP/UDP headers are then put in front of it with both checksums computed in place.
//!
//! [`parse`] validates everything a kernel would before handing a UDP payload to a socket,
//! and additionally accepts one 802.1Q tag. It is strict where gradwire can afford to be: the
//! UDP length must equal the IP payload length exactly (Linux would trim a longer IP payload),
//! and IPv4 fragments and IPv6 extension headers are rejected since gradwire never sends them.

use super::{ethernet, ipv4, ipv6, udp, Error, Result};
use core::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};

pub use super::Ecn;

/// Frame header length without VLAN tag: Ethernet + IPv4 + UDP.
pub const HEADER_LEN_V4: usize = ethernet::HEADER_LEN + ipv4::HEADER_LEN + udp::HEADER_LEN;
/// Frame header length without VLAN tag: Ethernet + IPv6 + UDP.
pub const HEADER_LEN_V6: usize = ethernet::HEADER_LEN + ipv6::HEADER_LEN + udp::HEADER_LEN;

/// Length of the headers [`emit_headers`] writes: 42 for IPv4, 62 for IPv6.
pub const fn header_len(ipv6: bool) -> usize {
    if ipv6 {
        HEADER_LEN_V6
    } else {
        HEADER_LEN_V4
    }
}

/// Gradwire payload bytes that fit one packet for a given IP MTU: MTU - IP header - UDP header
/// - gradwire header (1440 for IPv4 and 1420 for IPv6 at MTU 1500). 0 if nothing fits.
pub const fn payload_capacity(mtu: usize, ipv6: bool) -> usize {
    let ip = if ipv6 {
        ipv6::HEADER_LEN
    } else {
        ipv4::HEADER_LEN
    };
    mtu.saturating_sub(ip + udp::HEADER_LEN + super::header::HEADER_LEN)
}

/// Addressing and IP-level marking of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameMeta {
    /// Source MAC.
    pub src_mac: [u8; 6],
    /// Destination MAC (the next hop's).
    pub dst_mac: [u8; 6],
    /// Source IP and UDP port.
    pub src: SocketAddr,
    /// Destination IP and UDP port; must be the same family as `src`.
    pub dst: SocketAddr,
    /// DSCP, 0..=63.
    pub dscp: u8,
    /// ECN codepoint.
    pub ecn: Ecn,
    /// IPv4 TTL / IPv6 hop limit.
    pub hop_limit: u8,
    /// IPv4 identification; ignored for IPv6.
    pub ident: u16,
}

/// Writes Ethernet, IP and UDP headers in front of a datagram of `datagram_len` bytes that the
/// caller has already placed at `buf[header_len(ipv6)..]`, and returns the frame length.
///
/// Computes the IPv4 header checksum and the UDP checksum (a computed 0 is sent as `0xffff`),
/// sets DF on IPv4, and writes no VLAN tag. Errors: `BadIpHeader` if `src` and `dst` are of
/// different families; `Oversize` if DSCP exceeds 63, the datagram does not fit the IP/UDP
/// length fields, or the frame does not fit `buf`.
pub fn emit_headers(buf: &mut [u8], meta: &FrameMeta, datagram_len: usize) -> Result<usize> {
    let (src_ip, dst_ip) = (meta.src.ip(), meta.dst.ip());
    let ipv6 = match (src_ip, dst_ip) {
        (IpAddr::V4(_), IpAddr::V4(_)) => false,
        (IpAddr::V6(_), IpAddr::V6(_)) => true,
        _ => return Err(Error::BadIpHeader),
    };
    if meta.dscp > 63 {
        return Err(Error::Oversize);
    }
    let total = header_len(ipv6)
        .checked_add(datagram_len)
        .ok_or(Error::Oversize)?;
    let frame = buf.get_mut(..total).ok_or(Error::Oversize)?;
    let udp_len = udp::HEADER_LEN + datagram_len;

    let (eth_buf, rest) = frame.split_at_mut(ethernet::HEADER_LEN);
    let ethertype = if ipv6 {
        ethernet::ethertype::IPV6
    } else {
        ethernet::ethertype::IPV4
    };
    ethernet::Repr {
        src_addr: meta.src_mac,
        dst_addr: meta.dst_mac,
        ethertype,
        vlan: None,
    }
    .emit(&mut ethernet::Packet::new_unchecked(eth_buf))?;

    let udp_buf = match (src_ip, dst_ip) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let (ip_buf, udp_buf) = rest.split_at_mut(ipv4::HEADER_LEN);
            ipv4::Repr {
                src_addr: s,
                dst_addr: d,
                protocol: udp::PROTOCOL,
                payload_len: udp_len,
                hop_limit: meta.hop_limit,
                dscp: meta.dscp,
                ecn: meta.ecn,
                ident: meta.ident,
                // gradwire sizes datagrams to the path MTU; fragmenting would only turn one
                // loss into several.
                dont_frag: true,
            }
            .emit(&mut ipv4::Packet::new_unchecked(ip_buf))?;
            udp_buf
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let (ip_buf, udp_buf) = rest.split_at_mut(ipv6::HEADER_LEN);
            ipv6::Repr {
                src_addr: s,
                dst_addr: d,
                next_header: udp::PROTOCOL,
                payload_len: udp_len,
                hop_limit: meta.hop_limit,
                dscp: meta.dscp,
                ecn: meta.ecn,
                flow_label: 0,
            }
            .emit(&mut ipv6::Packet::new_unchecked(ip_buf))?;
            udp_buf
        }
        _ => return Err(Error::BadIpHeader),
    };

    udp::Repr {
        src_port: meta.src.port(),
        dst_port: meta.dst.port(),
        payload_len: datagram_len,
    }
    .emit(&mut udp::Packet::new_unchecked(udp_buf), &src_ip, &dst_ip)?;
    Ok(total)
}

/// A validated received frame. `datagram` borrows from the frame buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParsedFrame<'a> {
    /// Source MAC.
    pub src_mac: [u8; 6],
    /// Destination MAC.
    pub dst_mac: [u8; 6],
    /// Source IP and UDP port (IPv6: flow info and scope id are 0).
    pub src: SocketAddr,
    /// Destination IP and UDP port.
    pub dst: SocketAddr,
    /// DSCP.
    pub dscp: u8,
    /// ECN codepoint (e.g. CE marked by a switch).
    pub ecn: Ecn,
    /// IPv4 TTL / IPv6 hop limit as received.
    pub hop_limit: u8,
    /// IPv4 identification; 0 for IPv6.
    pub ident: u16,
    /// 802.1Q VLAN id, if the frame was tagged.
    pub vlan: Option<u16>,
    /// The UDP payload: gradwire header + payload, bounded by the UDP length (Ethernet padding
    /// excluded).
    pub datagram: &'a [u8],
}

impl ParsedFrame<'_> {
    /// The addressing and marking of this frame, as a [`FrameMeta`] (for replies, logging or
    /// re-emission).
    pub fn meta(&self) -> FrameMeta {
        FrameMeta {
            src_mac: self.src_mac,
            dst_mac: self.dst_mac,
            src: self.src,
            dst: self.dst,
            dscp: self.dscp,
            ecn: self.ecn,
            hop_limit: self.hop_limit,
            ident: self.ident,
        }
    }
}

/// IP-layer results needed to finish parsing at the UDP layer.
struct IpPart<'a> {
    src: IpAddr,
    dst: IpAddr,
    dscp: u8,
    ecn: Ecn,
    hop_limit: u8,
    ident: u16,
    payload: &'a [u8],
}

fn parse_ipv4(bytes: &[u8]) -> Result<IpPart<'_>> {
    let ip = ipv4::Packet::new_checked(bytes)?;
    // Checksum, then fragmentation (a fragment's UDP header, if any, cannot be verified).
    let r = ipv4::Repr::parse(&ip)?;
    if r.protocol != udp::PROTOCOL {
        return Err(Error::NotUdp);
    }
    Ok(IpPart {
        src: IpAddr::V4(r.src_addr),
        dst: IpAddr::V4(r.dst_addr),
        dscp: r.dscp,
        ecn: r.ecn,
        hop_limit: r.hop_limit,
        ident: r.ident,
        payload: ip.payload(),
    })
}

fn parse_ipv6(bytes: &[u8]) -> Result<IpPart<'_>> {
    let ip = ipv6::Packet::new_checked(bytes)?;
    let r = ipv6::Repr::parse(&ip)?;
    // Extension headers (hop-by-hop, routing, fragment, ...) are not walked: gradwire never
    // sends them, so anything but UDP directly after the fixed header is NotUdp.
    if r.next_header != udp::PROTOCOL {
        return Err(Error::NotUdp);
    }
    Ok(IpPart {
        src: IpAddr::V6(r.src_addr),
        dst: IpAddr::V6(r.dst_addr),
        dscp: r.dscp,
        ecn: r.ecn,
        hop_limit: r.hop_limit,
        ident: 0,
        payload: ip.payload(),
    })
}

fn socket_addr(ip: IpAddr, port: u16) -> SocketAddr {
    match ip {
        IpAddr::V4(a) => SocketAddr::V4(SocketAddrV4::new(a, port)),
        IpAddr::V6(a) => SocketAddr::V6(SocketAddrV6::new(a, port, 0, 0)),
    }
}

/// Parses and validates a received frame down to the UDP payload.
///
/// Checks, in order: Ethernet header (and one optional 802.1Q tag) present; ethertype IPv4 or
/// IPv6 (`NotIp`); IP version, IHL and lengths (`BadIpHeader`/`Truncated`); IPv4 header
/// checksum (`BadChecksum`); not a fragment (`Fragmented`); protocol UDP (`NotUdp`); UDP length
/// equal to the IP payload length (`LengthMismatch`); UDP checksum (`BadChecksum`; 0 is
/// accepted over IPv4 only). The gradwire header itself is not parsed here: use
/// [`super::header::Repr::parse`] on `datagram`.
pub fn parse(frame: &[u8]) -> Result<ParsedFrame<'_>> {
    let eth = ethernet::Packet::new_checked(frame)?;
    let eth_repr = ethernet::Repr::parse(&eth)?;
    let ip = match eth_repr.ethertype {
        ethernet::ethertype::IPV4 => parse_ipv4(eth.payload())?,
        ethernet::ethertype::IPV6 => parse_ipv6(eth.payload())?,
        _ => return Err(Error::NotIp),
    };

    let udp_pkt = udp::Packet::new_unchecked(ip.payload);
    if ip.payload.len() < udp::HEADER_LEN {
        return Err(Error::Truncated);
    }
    if usize::from(udp_pkt.len()) != ip.payload.len() {
        return Err(Error::LengthMismatch);
    }
    let u = udp::Repr::parse(&udp_pkt, &ip.src, &ip.dst)?;

    Ok(ParsedFrame {
        src_mac: eth_repr.src_addr,
        dst_mac: eth_repr.dst_addr,
        src: socket_addr(ip.src, u.src_port),
        dst: socket_addr(ip.dst, u.dst_port),
        dscp: ip.dscp,
        ecn: ip.ecn,
        hop_limit: ip.hop_limit,
        ident: ip.ident,
        vlan: eth_repr.vlan,
        datagram: udp_pkt.payload(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::checksum::tests::naive_checksum;
    use crate::wire::header::{self, tests::any_repr, tests::sample_repr};
    use core::net::{Ipv4Addr, Ipv6Addr};
    use proptest::prelude::*;

    const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
    const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];

    fn meta_v4() -> FrameMeta {
        FrameMeta {
            src_mac: MAC_A,
            dst_mac: MAC_B,
            src: "198.18.0.1:40000".parse().unwrap(),
            dst: "198.18.0.2:9000".parse().unwrap(),
            dscp: 26,
            ecn: Ecn::Ect0,
            hop_limit: 64,
            ident: 0x1234,
        }
    }

    fn meta_v6() -> FrameMeta {
        FrameMeta {
            src: "[fe80::a]:40000".parse().unwrap(),
            dst: "[fe80::b]:9000".parse().unwrap(),
            ident: 0,
            ..meta_v4()
        }
    }

    /// Builds a frame the way the transmit path does: datagram first, then headers.
    fn build(meta: &FrameMeta, hdr: &header::Repr, payload: &[u8]) -> Vec<u8> {
        let hl = header_len(meta.src.is_ipv6());
        let dlen = hdr.buffer_len();
        let mut buf = vec![0u8; hl + dlen];
        hdr.emit(&mut header::Packet::new_unchecked(&mut buf[hl..]))
            .unwrap();
        buf[hl + header::HEADER_LEN..].copy_from_slice(payload);
        let n = emit_headers(&mut buf, meta, dlen).unwrap();
        assert_eq!(n, buf.len());
        buf
    }

    fn sample_v4() -> Vec<u8> {
        build(&meta_v4(), &sample_repr(5), b"hello")
    }

    fn fix_ipv4_checksum(f: &mut [u8]) {
        let mut p = ipv4::Packet::new_unchecked(&mut f[14..34]);
        p.fill_checksum();
    }

    #[test]
    fn v4_layout_matches_docs() {
        let f = sample_v4();
        assert_eq!(f.len(), 42 + 32 + 5);
        assert_eq!(&f[0..6], &MAC_B);
        assert_eq!(&f[6..12], &MAC_A);
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        assert_eq!(f[14], 0x45);
        assert_eq!(f[15], (26 << 2) | 2);
        assert_eq!(&f[16..18], &(20u16 + 8 + 37).to_be_bytes());
        assert_eq!(&f[18..20], &[0x12, 0x34]);
        assert_eq!(&f[20..22], &[0x40, 0x00], "DF, offset 0");
        assert_eq!((f[22], f[23]), (64, 17));
        assert_eq!(
            naive_checksum(&f[14..34]),
            0,
            "IPv4 header checksum verifies"
        );
        assert_eq!(&f[26..30], &[198, 18, 0, 1]);
        assert_eq!(&f[30..34], &[198, 18, 0, 2]);
        assert_eq!(&f[34..36], &40000u16.to_be_bytes());
        assert_eq!(&f[36..38], &9000u16.to_be_bytes());
        assert_eq!(&f[38..40], &(8u16 + 37).to_be_bytes());
        // UDP checksum cross-checked with the naive byte-pair sum over an explicit
        // pseudo-header.
        let mut ph = vec![198, 18, 0, 1, 198, 18, 0, 2, 0, 17, 0, 45];
        ph.extend_from_slice(&f[34..]);
        assert_eq!(naive_checksum(&ph), 0);
        assert_eq!(f[42], header::VERSION);
        assert_eq!(&f[74..], b"hello");
    }

    #[test]
    fn v6_layout_matches_docs() {
        let f = build(&meta_v6(), &sample_repr(5), b"hello");
        assert_eq!(f.len(), 62 + 32 + 5);
        assert_eq!(&f[12..14], &[0x86, 0xdd]);
        assert_eq!(
            &f[14..18],
            &[0x66, 0xa0, 0, 0],
            "version 6, TC 0x6a, flow 0"
        );
        assert_eq!(&f[18..20], &45u16.to_be_bytes());
        assert_eq!((f[20], f[21]), (17, 64));
        assert_eq!(&f[58..60], &45u16.to_be_bytes());
        let mut ph = Vec::new();
        ph.extend_from_slice(&f[22..54]);
        ph.extend_from_slice(&[0, 0, 0, 45, 0, 0, 0, 17]);
        ph.extend_from_slice(&f[54..]);
        assert_eq!(naive_checksum(&ph), 0);
        assert_eq!(&f[94..], b"hello");
    }

    #[test]
    fn parse_round_trip_examples() {
        for meta in [meta_v4(), meta_v6()] {
            let f = build(&meta, &sample_repr(5), b"hello");
            let p = parse(&f).unwrap();
            assert_eq!(p.meta(), meta);
            assert_eq!(p.vlan, None);
            let h = header::Packet::new_checked(p.datagram).unwrap();
            assert_eq!(header::Repr::parse(&h).unwrap(), sample_repr(5));
            assert_eq!(h.payload(), b"hello");
        }
    }

    #[test]
    fn capacities() {
        assert_eq!((header_len(false), header_len(true)), (42, 62));
        assert_eq!(payload_capacity(1500, false), 1440);
        assert_eq!(payload_capacity(1500, true), 1420);
        assert_eq!(payload_capacity(40, true), 0);
        // A full-size v4 packet is a 1514-byte frame carrying a 1500-byte IP packet.
        let payload = vec![7u8; 1440];
        let f = build(&meta_v4(), &sample_repr(1440), &payload);
        assert_eq!(f.len(), 1514);
        assert_eq!(&f[16..18], &1500u16.to_be_bytes());
        assert_eq!(parse(&f).unwrap().datagram.len(), 1472);
    }

    #[test]
    fn ethernet_padding_is_ignored() {
        let f = sample_v4();
        let mut padded = f.clone();
        padded.extend_from_slice(&[0u8; 20]);
        assert_eq!(parse(&padded).unwrap(), parse(&f).unwrap());
    }

    #[test]
    fn vlan_tagged_frame_parses() {
        let f = sample_v4();
        let mut t = f[..12].to_vec();
        t.extend_from_slice(&[0x81, 0x00, 0x20, 0x64]); // PCP 1, VID 100
        t.extend_from_slice(&f[12..]);
        let p = parse(&t).unwrap();
        assert_eq!(p.vlan, Some(100));
        assert_eq!(p.datagram, parse(&f).unwrap().datagram);
        // A second tag is not IP.
        let mut qinq = t[..16].to_vec();
        qinq.extend_from_slice(&[0x81, 0x00, 0x00, 0x05]);
        qinq.extend_from_slice(&t[16..]);
        assert_eq!(parse(&qinq), Err(Error::NotIp));
    }

    #[test]
    fn udp_zero_checksum_rules() {
        let mut f = sample_v4();
        f[40..42].copy_from_slice(&[0, 0]);
        assert!(parse(&f).is_ok(), "IPv4: 0 = no checksum");
        let mut f = build(&meta_v6(), &sample_repr(5), b"hello");
        f[60..62].copy_from_slice(&[0, 0]);
        assert_eq!(
            parse(&f),
            Err(Error::BadChecksum),
            "IPv6: checksum mandatory"
        );
    }

    /// Every `wire::Error` variant, each from a crafted input.
    #[test]
    fn every_error_variant() {
        let good = sample_v4();
        let mut seen = Vec::new();
        let mut expect = |got: Result<()>, want: Error| {
            assert_eq!(got, Err(want));
            seen.push(want);
        };
        let frame = |b: &[u8]| parse(b).map(|_| ());
        let gw = |b: &[u8]| -> Result<()> {
            let p = parse(b)?;
            header::Repr::parse(&header::Packet::new_unchecked(p.datagram)).map(|_| ())
        };

        expect(frame(&good[..10]), Error::Truncated);
        expect(frame(&good[..60]), Error::Truncated);

        let mut b = good.clone();
        b[42] = 9;
        expect(gw(&b), Error::BadChecksum);
        // Re-emit with a bad gradwire version / kind so the UDP checksum is valid.
        let mut b = good.clone();
        b[42] = 9;
        emit_headers(&mut b, &meta_v4(), 37).unwrap();
        expect(gw(&b), Error::BadVersion);
        let mut b = good.clone();
        b[43] = 0x7f;
        emit_headers(&mut b, &meta_v4(), 37).unwrap();
        expect(gw(&b), Error::UnknownKind);
        // Datagram one byte longer than the gradwire length field.
        let mut b = good.clone();
        b.push(0);
        emit_headers(&mut b, &meta_v4(), 38).unwrap();
        expect(gw(&b), Error::LengthMismatch);
        // UDP length disagreeing with the IP payload length.
        let mut b = good.clone();
        b[39] -= 1;
        expect(frame(&b), Error::LengthMismatch);

        let mut b = good.clone();
        b[12..14].copy_from_slice(&[0x08, 0x06]); // ARP
        expect(frame(&b), Error::NotIp);

        let mut b = good.clone();
        b[23] = 6; // TCP
        fix_ipv4_checksum(&mut b);
        expect(frame(&b), Error::NotUdp);
        let mut b = build(&meta_v6(), &sample_repr(5), b"hello");
        b[20] = 0; // hop-by-hop extension header
        expect(frame(&b), Error::NotUdp);

        let mut b = good.clone();
        b[20] |= 0x20; // MF
        fix_ipv4_checksum(&mut b);
        expect(frame(&b), Error::Fragmented);

        let mut b = good.clone();
        b[14] = 0x44; // IHL 4
        expect(frame(&b), Error::BadIpHeader);
        let mixed = FrameMeta {
            dst: meta_v6().dst,
            ..meta_v4()
        };
        expect(
            emit_headers(&mut [0u8; 200], &mixed, 10).map(|_| ()),
            Error::BadIpHeader,
        );

        expect(
            emit_headers(&mut [0u8; 50], &meta_v4(), 10).map(|_| ()),
            Error::Oversize,
        );
        let big = FrameMeta {
            dscp: 64,
            ..meta_v4()
        };
        expect(
            emit_headers(&mut [0u8; 200], &big, 10).map(|_| ()),
            Error::Oversize,
        );
        expect(
            emit_headers(&mut vec![0u8; 70_000], &meta_v4(), 65_536 - 28).map(|_| ()),
            Error::Oversize,
        );

        let all = [
            Error::Truncated,
            Error::BadVersion,
            Error::UnknownKind,
            Error::LengthMismatch,
            Error::BadChecksum,
            Error::NotIp,
            Error::NotUdp,
            Error::Fragmented,
            Error::BadIpHeader,
            Error::Oversize,
        ];
        for e in all {
            assert!(seen.contains(&e), "{e:?} not produced");
        }
    }

    fn any_mac() -> impl Strategy<Value = [u8; 6]> {
        any::<[u8; 6]>()
    }

    fn any_meta(ipv6: bool) -> impl Strategy<Value = FrameMeta> {
        let addrs = if ipv6 {
            (
                any::<[u8; 16]>(),
                any::<[u8; 16]>(),
                any::<u16>(),
                any::<u16>(),
            )
                .prop_map(|(s, d, sp, dp)| {
                    (
                        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(s), sp, 0, 0)),
                        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(d), dp, 0, 0)),
                    )
                })
                .boxed()
        } else {
            (
                any::<[u8; 4]>(),
                any::<[u8; 4]>(),
                any::<u16>(),
                any::<u16>(),
            )
                .prop_map(|(s, d, sp, dp)| {
                    (
                        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(s), sp)),
                        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(d), dp)),
                    )
                })
                .boxed()
        };
        (
            addrs,
            any_mac(),
            any_mac(),
            0u8..64,
            0u8..4,
            any::<u8>(),
            any::<u16>(),
        )
            .prop_map(
                move |((src, dst), src_mac, dst_mac, dscp, ecn, hop_limit, ident)| FrameMeta {
                    src_mac,
                    dst_mac,
                    src,
                    dst,
                    dscp,
                    ecn: Ecn::from_bits(ecn),
                    hop_limit,
                    ident: if ipv6 { 0 } else { ident },
                },
            )
    }

    fn any_frame() -> impl Strategy<Value = (FrameMeta, header::Repr, Vec<u8>)> {
        (any::<bool>().prop_flat_map(any_meta), any_repr(1440)).prop_flat_map(|(m, h)| {
            let n = usize::from(h.length);
            (
                Just(m),
                Just(h),
                proptest::collection::vec(any::<u8>(), n..=n),
            )
        })
    }

    proptest! {
        #[test]
        fn frame_round_trip((meta, hdr, payload) in any_frame(), pad in 0usize..16) {
            let mut f = build(&meta, &hdr, &payload);
            f.resize(f.len() + pad, 0);
            let p = parse(&f).unwrap();
            prop_assert_eq!(p.meta(), meta);
            let h = header::Packet::new_checked(p.datagram).unwrap();
            prop_assert_eq!(header::Repr::parse(&h).unwrap(), hdr);
            prop_assert_eq!(h.payload(), &payload[..]);
        }

        #[test]
        fn parse_arbitrary_bytes_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&buf);
        }

        /// Valid frames with random damage (overwritten ranges, truncation) reach the deeper
        /// layers, which plain random bytes rarely do.
        #[test]
        fn parse_damaged_frames_never_panics((meta, hdr, payload) in any_frame(),
                                             at in any::<usize>(),
                                             junk in proptest::collection::vec(any::<u8>(), 1..8),
                                             cut in any::<usize>()) {
            let mut f = build(&meta, &hdr, &payload);
            let at = at % f.len();
            let end = (at + junk.len()).min(f.len());
            f[at..end].copy_from_slice(&junk[..end - at]);
            f.truncate(f.len() - cut % 8);
            if let Ok(p) = parse(&f) {
                let _ = header::Repr::parse(&header::Packet::new_unchecked(p.datagram));
            }
        }

        /// Any single-byte change in the IP header or the UDP part of a valid IPv4 frame is
        /// detected or shows up in the parse. The one exception is inherent to RFC 768: a UDP
        /// checksum field turned into 0 means "no checksum" over IPv4.
        #[test]
        fn single_byte_flip_is_detected((meta, hdr, payload) in (any_meta(false), any_repr(64))
                                            .prop_flat_map(|(m, h)| {
                                                let n = usize::from(h.length);
                                                (Just(m), Just(h),
                                                 proptest::collection::vec(any::<u8>(), n..=n))
                                            }),
                                        idx in any::<usize>(), x in 1u8..=255) {
            let f = build(&meta, &hdr, &payload);
            let orig = parse(&f).unwrap();
            let i = ethernet::HEADER_LEN + idx % (f.len() - ethernet::HEADER_LEN);
            let mut g = f.clone();
            g[i] ^= x;
            match parse(&g) {
                Err(_) => {}
                Ok(p) => {
                    let zeroed_udp_csum = (40..42).contains(&i) && g[40] == 0 && g[41] == 0;
                    prop_assert!(p != orig || zeroed_udp_csum, "undetected flip at {}", i);
                }
            }
        }
    }
}
