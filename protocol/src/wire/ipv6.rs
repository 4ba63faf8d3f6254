//! IPv6 fixed header (RFC 8200).
//!
//! ```text
//! off size field
//! 0   4    version (4 bits, = 6) | traffic class (8 bits: DSCP 6 | ECN 2) | flow label (20 bits)
//! 4   2    payload length (bytes after this 40-byte header)
//! 6   1    next header (17 = UDP)
//! 7   1    hop limit
//! 8   16   source address
//! 24  16   destination address
//! 40  ..   payload, up to `payload length`
//! ```
//!
//! Extension headers are not walked: gradwire never sends them, so a next header other than
//! UDP is reported as not-UDP by [`super::frame::parse`]. Jumbograms (payload length 0 with a
//! hop-by-hop option) are likewise unsupported. Bytes after the payload (Ethernet padding) are
//! ignored.

use super::{Ecn, Error, Result};
use core::net::Ipv6Addr;

/// Field offsets.
pub mod field {
    use core::ops::Range;
    /// Version, traffic class and flow label.
    pub const VER_TC_FLOW: Range<usize> = 0..4;
    /// Payload length.
    pub const LENGTH: Range<usize> = 4..6;
    /// Next header.
    pub const NXT_HDR: usize = 6;
    /// Hop limit.
    pub const HOP_LIMIT: usize = 7;
    /// Source address.
    pub const SRC_ADDR: Range<usize> = 8..24;
    /// Destination address.
    pub const DST_ADDR: Range<usize> = 24..40;
}

/// Length of the fixed header.
pub const HEADER_LEN: usize = 40;
/// Largest flow label.
pub const MAX_FLOW_LABEL: u32 = 0x000f_ffff;

/// A zero-copy view of an IPv6 packet.
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

    /// Shorter than 40 bytes or than 40 + payload length -> `Truncated`; version != 6 ->
    /// `BadIpHeader`.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if self.version() != 6 {
            return Err(Error::BadIpHeader);
        }
        if len < HEADER_LEN + usize::from(self.payload_len()) {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn first_word(&self) -> u32 {
        let d = &self.buffer.as_ref()[field::VER_TC_FLOW];
        u32::from_be_bytes([d[0], d[1], d[2], d[3]])
    }

    /// Version field (6 for a valid header).
    pub fn version(&self) -> u8 {
        (self.first_word() >> 28) as u8
    }

    /// Traffic class byte (DSCP << 2 | ECN).
    pub fn traffic_class(&self) -> u8 {
        (self.first_word() >> 20) as u8
    }

    /// DSCP (6 bits).
    pub fn dscp(&self) -> u8 {
        self.traffic_class() >> 2
    }

    /// ECN codepoint.
    pub fn ecn(&self) -> Ecn {
        Ecn::from_bits(self.traffic_class())
    }

    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        self.first_word() & MAX_FLOW_LABEL
    }

    /// Payload length.
    pub fn payload_len(&self) -> u16 {
        let d = &self.buffer.as_ref()[field::LENGTH];
        u16::from_be_bytes([d[0], d[1]])
    }

    /// Next header.
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NXT_HDR]
    }

    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }

    fn addr(&self, r: core::ops::Range<usize>) -> Ipv6Addr {
        let mut o = [0u8; 16];
        o.copy_from_slice(&self.buffer.as_ref()[r]);
        Ipv6Addr::from(o)
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv6Addr {
        self.addr(field::SRC_ADDR)
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv6Addr {
        self.addr(field::DST_ADDR)
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload, bounded by the payload length field.
    pub fn payload(&self) -> &'a [u8] {
        let range = HEADER_LEN..HEADER_LEN + usize::from(self.payload_len());
        self.buffer.as_ref().get(range).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets version, traffic class and flow label (masked to 20 bits). Panics on a short
    /// buffer, as do all setters.
    pub fn set_ver_tc_flow(&mut self, version: u8, traffic_class: u8, flow_label: u32) {
        let w = (u32::from(version & 0x0f) << 28)
            | (u32::from(traffic_class) << 20)
            | (flow_label & MAX_FLOW_LABEL);
        self.buffer.as_mut()[field::VER_TC_FLOW].copy_from_slice(&w.to_be_bytes());
    }

    /// Sets the payload length.
    pub fn set_payload_len(&mut self, v: u16) {
        self.buffer.as_mut()[field::LENGTH].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets the next header.
    pub fn set_next_header(&mut self, v: u8) {
        self.buffer.as_mut()[field::NXT_HDR] = v;
    }

    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        self.buffer.as_mut()[field::HOP_LIMIT] = v;
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::SRC_ADDR].copy_from_slice(&a.octets());
    }

    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::DST_ADDR].copy_from_slice(&a.octets());
    }

    /// The payload, mutably (bounded by the payload length field).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = HEADER_LEN..HEADER_LEN + usize::from(self.payload_len());
        self.buffer.as_mut().get_mut(range).unwrap_or(&mut [])
    }
}

/// High-level contents of an IPv6 fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    /// Source address.
    pub src_addr: Ipv6Addr,
    /// Destination address.
    pub dst_addr: Ipv6Addr,
    /// Next header.
    pub next_header: u8,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// Hop limit.
    pub hop_limit: u8,
    /// DSCP, 0..=63.
    pub dscp: u8,
    /// ECN codepoint.
    pub ecn: Ecn,
    /// Flow label, 0..=0xfffff.
    pub flow_label: u32,
}

impl Repr {
    /// Parses a header (length/version checks only: IPv6 has no header checksum).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Result<Repr> {
        packet.check_len()?;
        Ok(Repr {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            next_header: packet.next_header(),
            payload_len: usize::from(packet.payload_len()),
            hop_limit: packet.hop_limit(),
            dscp: packet.dscp(),
            ecn: packet.ecn(),
            flow_label: packet.flow_label(),
        })
    }

    /// Header length (always 40).
    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    /// Header plus payload length.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }

    /// Writes the header. `Oversize` if the buffer is shorter than the header, or the payload
    /// length, DSCP or flow label does not fit its field.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(
        &self,
        packet: &mut Packet<&mut T>,
    ) -> Result<()> {
        let len = u16::try_from(self.payload_len).map_err(|_| Error::Oversize)?;
        if packet.buffer.as_ref().len() < HEADER_LEN
            || self.dscp > 63
            || self.flow_label > MAX_FLOW_LABEL
        {
            return Err(Error::Oversize);
        }
        packet.set_ver_tc_flow(6, (self.dscp << 2) | self.ecn.bits(), self.flow_label);
        packet.set_payload_len(len);
        packet.set_next_header(self.next_header);
        packet.set_hop_limit(self.hop_limit);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn field_packing() {
        let mut b = [0u8; 44];
        let mut p = Packet::new_unchecked(&mut b[..]);
        p.set_ver_tc_flow(6, 0xb9, 0x12345);
        p.set_payload_len(4);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!(&b[..4], &[0x6b, 0x91, 0x23, 0x45]);
        assert_eq!(
            (p.dscp(), p.ecn(), p.flow_label()),
            (0x2e, Ecn::Ect1, 0x12345)
        );
    }

    #[test]
    fn errors() {
        let mut b = [0u8; 44];
        Packet::new_unchecked(&mut b[..]).set_ver_tc_flow(6, 0, 0);
        Packet::new_unchecked(&mut b[..]).set_payload_len(5);
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::Truncated);
        assert_eq!(Packet::new_checked(&b[..39]).unwrap_err(), Error::Truncated);
        b[0] = 0x40;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadIpHeader);
        let r = Repr {
            src_addr: Ipv6Addr::LOCALHOST,
            dst_addr: Ipv6Addr::LOCALHOST,
            next_header: 17,
            payload_len: 65536,
            hop_limit: 1,
            dscp: 0,
            ecn: Ecn::NotEct,
            flow_label: 0,
        };
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut b[..])),
            Err(Error::Oversize)
        );
        let r = Repr {
            payload_len: 0,
            flow_label: 0x10_0000,
            ..r
        };
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut b[..])),
            Err(Error::Oversize)
        );
    }

    proptest! {
        #[test]
        fn repr_round_trip(src in any::<[u8; 16]>(), dst in any::<[u8; 16]>(),
                           next_header in any::<u8>(), payload_len in 0usize..1500,
                           hop_limit in any::<u8>(), dscp in 0u8..64, ecn in 0u8..4,
                           flow_label in 0u32..=MAX_FLOW_LABEL, pad in 0usize..8) {
            let r = Repr {
                src_addr: src.into(), dst_addr: dst.into(), next_header, payload_len, hop_limit,
                dscp, ecn: Ecn::from_bits(ecn), flow_label,
            };
            let mut buf = vec![0x5au8; r.buffer_len() + pad];
            r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(p.payload().len(), payload_len);
        }

        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Repr::parse(&Packet::new_unchecked(&buf[..]));
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = p.payload();
            }
        }
    }
}
