//! IPv4 header (RFC 791).
//!
//! ```text
//! off size field
//! 0   1    version (high nibble, = 4) | IHL (low nibble, header length in 32-bit words, >= 5)
//! 1   1    DSCP (high 6 bits) | ECN (low 2 bits, RFC 3168)
//! 2   2    total length (header + payload)
//! 4   2    identification
//! 6   2    flags (bit 14 DF, bit 13 MF) | fragment offset (13 bits, 8-byte units)
//! 8   1    TTL
//! 9   1    protocol (17 = UDP)
//! 10  2    header checksum (RFC 1071 over the header only)
//! 12  4    source address
//! 16  4    destination address
//! 20  ..   options (IHL > 5; skipped on parse, never emitted)
//! IHL*4 .. payload, up to `total length`
//! ```
//!
//! Bytes after `total length` (Ethernet padding) are ignored. [`Repr`] describes an unfragmented
//! datagram without options, which is all gradwire sends; fragments are rejected on parse
//! because gradwire sizes its datagrams to the MTU and never reassembles.

use super::{checksum, Ecn, Error, Result};
use core::net::Ipv4Addr;

/// Field offsets.
pub mod field {
    use core::ops::Range;
    /// Version and IHL.
    pub const VER_IHL: usize = 0;
    /// DSCP and ECN.
    pub const DSCP_ECN: usize = 1;
    /// Total length.
    pub const LENGTH: Range<usize> = 2..4;
    /// Identification.
    pub const IDENT: Range<usize> = 4..6;
    /// Flags and fragment offset.
    pub const FLG_OFF: Range<usize> = 6..8;
    /// Time to live.
    pub const TTL: usize = 8;
    /// Protocol.
    pub const PROTOCOL: usize = 9;
    /// Header checksum.
    pub const CHECKSUM: Range<usize> = 10..12;
    /// Source address.
    pub const SRC_ADDR: Range<usize> = 12..16;
    /// Destination address.
    pub const DST_ADDR: Range<usize> = 16..20;
}

/// Length of a header without options.
pub const HEADER_LEN: usize = 20;
/// IP protocol number of UDP.
pub const PROTOCOL_UDP: u8 = 17;

const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET_MASK: u16 = 0x1fff;

/// A zero-copy view of an IPv4 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packet<T> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it; getters may panic until [`Self::check_len`] passed.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps a buffer and checks that every getter is safe to call.
    pub fn new_checked(buffer: T) -> Result<Packet<T>> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks the length-related fields against each other and the buffer:
    /// shorter than 20 bytes or than the announced header/total length -> `Truncated`;
    /// version != 4, IHL < 5 or total length < header length -> `BadIpHeader`.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        // The version is checked here, not in Repr::parse, so that a non-IPv4 header is
        // reported as such rather than as whatever its IHL nibble happens to imply.
        if self.version() != 4 || self.header_len() < HEADER_LEN {
            return Err(Error::BadIpHeader);
        }
        if len < self.header_len() {
            return Err(Error::Truncated);
        }
        let total = usize::from(self.total_len());
        if total < self.header_len() {
            return Err(Error::BadIpHeader);
        }
        if len < total {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn u16_at(&self, r: core::ops::Range<usize>) -> u16 {
        let d = &self.buffer.as_ref()[r];
        u16::from_be_bytes([d[0], d[1]])
    }

    /// Version field (4 for a valid header).
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }

    /// Header length in bytes (IHL * 4).
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::VER_IHL] & 0x0f) * 4
    }

    /// Differentiated services codepoint (6 bits).
    pub fn dscp(&self) -> u8 {
        self.buffer.as_ref()[field::DSCP_ECN] >> 2
    }

    /// ECN codepoint.
    pub fn ecn(&self) -> Ecn {
        Ecn::from_bits(self.buffer.as_ref()[field::DSCP_ECN])
    }

    /// Total length (header + payload).
    pub fn total_len(&self) -> u16 {
        self.u16_at(field::LENGTH)
    }

    /// Identification.
    pub fn ident(&self) -> u16 {
        self.u16_at(field::IDENT)
    }

    /// Don't-fragment flag.
    pub fn dont_frag(&self) -> bool {
        self.u16_at(field::FLG_OFF) & FLAG_DF != 0
    }

    /// More-fragments flag.
    pub fn more_frags(&self) -> bool {
        self.u16_at(field::FLG_OFF) & FLAG_MF != 0
    }

    /// Fragment offset in bytes.
    pub fn frag_offset(&self) -> u16 {
        (self.u16_at(field::FLG_OFF) & FRAG_OFFSET_MASK) << 3
    }

    /// Whether this packet is a fragment of a larger datagram.
    pub fn is_fragment(&self) -> bool {
        self.more_frags() || self.frag_offset() != 0
    }

    /// Time to live.
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }

    /// Protocol number of the payload.
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }

    /// Header checksum field.
    pub fn checksum(&self) -> u16 {
        self.u16_at(field::CHECKSUM)
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv4Addr {
        let d = &self.buffer.as_ref()[field::SRC_ADDR];
        Ipv4Addr::new(d[0], d[1], d[2], d[3])
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv4Addr {
        let d = &self.buffer.as_ref()[field::DST_ADDR];
        Ipv4Addr::new(d[0], d[1], d[2], d[3])
    }

    /// Whether the header checksum (over the whole header, options included) verifies.
    pub fn verify_checksum(&self) -> bool {
        let hdr = &self.buffer.as_ref()[..self.header_len()];
        checksum::fold(checksum::sum(hdr, 0)) == 0xffff
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload: from the end of the header (options skipped) to `total length`.
    pub fn payload(&self) -> &'a [u8] {
        let range = self.header_len()..usize::from(self.total_len());
        self.buffer.as_ref().get(range).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set_u16(&mut self, r: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets version and IHL (in bytes; must be a multiple of 4). Panics on a short buffer, as
    /// do all setters.
    pub fn set_version_header_len(&mut self, version: u8, header_len: usize) {
        self.buffer.as_mut()[field::VER_IHL] = (version << 4) | ((header_len / 4) as u8 & 0x0f);
    }

    /// Sets DSCP (low 6 bits used) and ECN.
    pub fn set_dscp_ecn(&mut self, dscp: u8, ecn: Ecn) {
        self.buffer.as_mut()[field::DSCP_ECN] = (dscp << 2) | ecn.bits();
    }

    /// Sets the total length.
    pub fn set_total_len(&mut self, v: u16) {
        self.set_u16(field::LENGTH, v)
    }

    /// Sets the identification.
    pub fn set_ident(&mut self, v: u16) {
        self.set_u16(field::IDENT, v)
    }

    /// Sets flags to DF-or-nothing and the fragment offset to 0.
    pub fn set_unfragmented(&mut self, dont_frag: bool) {
        self.set_u16(field::FLG_OFF, if dont_frag { FLAG_DF } else { 0 })
    }

    /// Sets the raw flags/fragment-offset field.
    pub fn set_flags_frag_raw(&mut self, v: u16) {
        self.set_u16(field::FLG_OFF, v)
    }

    /// Sets the TTL.
    pub fn set_hop_limit(&mut self, v: u8) {
        self.buffer.as_mut()[field::TTL] = v;
    }

    /// Sets the protocol.
    pub fn set_protocol(&mut self, v: u8) {
        self.buffer.as_mut()[field::PROTOCOL] = v;
    }

    /// Sets the checksum field.
    pub fn set_checksum(&mut self, v: u16) {
        self.set_u16(field::CHECKSUM, v)
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, a: Ipv4Addr) {
        self.buffer.as_mut()[field::SRC_ADDR].copy_from_slice(&a.octets());
    }

    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, a: Ipv4Addr) {
        self.buffer.as_mut()[field::DST_ADDR].copy_from_slice(&a.octets());
    }

    /// Recomputes the header checksum over `header_len()` bytes.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let hl = self.header_len();
        let c = checksum::checksum(&self.buffer.as_ref()[..hl]);
        self.set_checksum(c);
    }

    /// The payload, mutably (bounded by `total length`).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = self.header_len()..usize::from(self.total_len());
        self.buffer.as_mut().get_mut(range).unwrap_or(&mut [])
    }
}

/// High-level contents of an unfragmented IPv4 header without options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    /// Source address.
    pub src_addr: Ipv4Addr,
    /// Destination address.
    pub dst_addr: Ipv4Addr,
    /// Payload protocol.
    pub protocol: u8,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// TTL.
    pub hop_limit: u8,
    /// DSCP, 0..=63.
    pub dscp: u8,
    /// ECN codepoint.
    pub ecn: Ecn,
    /// Identification.
    pub ident: u16,
    /// Don't-fragment flag.
    pub dont_frag: bool,
}

impl Repr {
    /// Parses and validates a header: length fields (see [`Packet::check_len`]), checksum
    /// (`BadChecksum`) and fragmentation (`Fragmented`). Options are skipped.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Result<Repr> {
        packet.check_len()?;
        if !packet.verify_checksum() {
            return Err(Error::BadChecksum);
        }
        if packet.is_fragment() {
            return Err(Error::Fragmented);
        }
        Ok(Repr {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            protocol: packet.protocol(),
            payload_len: usize::from(packet.total_len()) - packet.header_len(),
            hop_limit: packet.hop_limit(),
            dscp: packet.dscp(),
            ecn: packet.ecn(),
            ident: packet.ident(),
            dont_frag: packet.dont_frag(),
        })
    }

    /// Header length this repr emits (no options).
    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    /// Header plus payload length.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }

    /// Writes the header, checksum included. The payload area is not touched.
    /// `Oversize` if the buffer is shorter than the header, DSCP exceeds 63 or the total length
    /// exceeds 65535.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(
        &self,
        packet: &mut Packet<&mut T>,
    ) -> Result<()> {
        let total = u16::try_from(self.buffer_len()).map_err(|_| Error::Oversize)?;
        if packet.buffer.as_ref().len() < HEADER_LEN || self.dscp > 63 {
            return Err(Error::Oversize);
        }
        packet.set_version_header_len(4, HEADER_LEN);
        packet.set_dscp_ecn(self.dscp, self.ecn);
        packet.set_total_len(total);
        packet.set_ident(self.ident);
        packet.set_unfragmented(self.dont_frag);
        packet.set_hop_limit(self.hop_limit);
        packet.set_protocol(self.protocol);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        packet.fill_checksum();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The classic example header with its checksum filled in, plus 4 payload bytes and 2
    /// bytes of trailing padding.
    fn sample() -> Vec<u8> {
        let mut v = vec![
            0x45, 0x00, 0x00, 0x18, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7, 1, 2, 3, 4, 0xee, 0xee,
        ];
        let c = checksum::checksum(&v[..20]);
        v[10..12].copy_from_slice(&c.to_be_bytes());
        v
    }

    #[test]
    fn known_header_checksum() {
        let mut p = Packet::new_unchecked(vec![
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ]);
        p.fill_checksum();
        assert_eq!(p.checksum(), 0xb861);
        assert!(p.verify_checksum());
    }

    #[test]
    fn parse_sample_ignores_padding() {
        let buf = sample();
        let p = Packet::new_checked(&buf[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.payload_len, 4);
        assert_eq!(r.src_addr, Ipv4Addr::new(192, 168, 0, 1));
        assert!(r.dont_frag);
        assert_eq!(p.payload(), &[1, 2, 3, 4]);
    }

    #[test]
    fn errors() {
        let good = sample();
        assert_eq!(
            Packet::new_checked(&good[..19]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&good[..23]).unwrap_err(),
            Error::Truncated
        );

        let mut b = good.clone();
        b[0] = 0x65; // version 6
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadIpHeader);
        b[0] = 0x44; // IHL 4
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadIpHeader);
        b[0] = 0x4f; // IHL 15 = 60 bytes > buffer
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::Truncated);

        let mut b = good.clone();
        b[3] = 19; // total length < header length
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadIpHeader);

        let mut b = good.clone();
        b[8] = 0x3f; // TTL changed, checksum stale
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::BadChecksum)
        );

        for flags in [0x2000u16, 0x0001, 0x6000] {
            let mut p = Packet::new_unchecked(good.clone());
            p.set_flags_frag_raw(flags);
            p.fill_checksum();
            let b = p.into_inner();
            assert_eq!(
                Repr::parse(&Packet::new_unchecked(&b[..])),
                Err(Error::Fragmented)
            );
        }
    }

    #[test]
    fn options_are_skipped() {
        // IHL 6: one 4-byte option (NOP NOP NOP EOL).
        let mut b = [0u8; 28];
        let mut p = Packet::new_unchecked(&mut b[..]);
        p.set_version_header_len(4, 24);
        p.set_total_len(28);
        p.set_protocol(17);
        p.set_hop_limit(1);
        p.payload_mut().copy_from_slice(&[9, 8, 7, 6]);
        b[20..24].copy_from_slice(&[1, 1, 1, 0]);
        let mut p = Packet::new_unchecked(&mut b[..]);
        p.fill_checksum();
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!(Repr::parse(&p).unwrap().payload_len, 4);
        assert_eq!(p.payload(), &[9, 8, 7, 6]);
    }

    #[test]
    fn emit_oversize() {
        let r = Repr {
            src_addr: Ipv4Addr::LOCALHOST,
            dst_addr: Ipv4Addr::LOCALHOST,
            protocol: 17,
            payload_len: 65536 - 20,
            hop_limit: 64,
            dscp: 0,
            ecn: Ecn::NotEct,
            ident: 0,
            dont_frag: true,
        };
        let mut buf = [0u8; 20];
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..])),
            Err(Error::Oversize)
        );
        let r = Repr {
            payload_len: 0,
            dscp: 64,
            ..r
        };
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..])),
            Err(Error::Oversize)
        );
        let r = Repr { dscp: 63, ..r };
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..19])),
            Err(Error::Oversize)
        );
        assert_eq!(r.emit(&mut Packet::new_unchecked(&mut buf[..])), Ok(()));
    }

    proptest! {
        #[test]
        fn repr_round_trip(src in any::<[u8; 4]>(), dst in any::<[u8; 4]>(), protocol in any::<u8>(),
                           payload_len in 0usize..1500, hop_limit in any::<u8>(),
                           dscp in 0u8..64, ecn in 0u8..4, ident in any::<u16>(),
                           dont_frag in any::<bool>(), pad in 0usize..8) {
            let r = Repr {
                src_addr: src.into(), dst_addr: dst.into(), protocol, payload_len, hop_limit,
                dscp, ecn: Ecn::from_bits(ecn), ident, dont_frag,
            };
            let mut buf = vec![0xa5u8; r.buffer_len() + pad];
            r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(p.payload().len(), payload_len);
        }

        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..80)) {
            let p = Packet::new_unchecked(&buf[..]);
            let _ = Repr::parse(&p);
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.payload(), p.verify_checksum(), p.frag_offset(), p.src_addr());
            }
        }
    }
}
