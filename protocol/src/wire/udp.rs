//! UDP header (RFC 768), with checksums over the IPv4 or IPv6 pseudo-header.
//!
//! ```text
//! off size field
//! 0   2    source port
//! 2   2    destination port
//! 4   2    length (header + payload, >= 8)
//! 6   2    checksum (pseudo-header + header + payload)
//! 8   ..   payload, up to `length`
//! ```
//!
//! Checksum rules: a computed checksum of 0 is transmitted as `0xffff` (both are zero in one's
//! complement; 0 on the wire means "no checksum"). A received 0 is accepted for IPv4 (RFC 768)
//! and rejected for IPv6 (RFC 8200 §8.1 makes the checksum mandatory).

use super::{checksum, Error, Result};
use core::net::IpAddr;

/// Field offsets.
pub mod field {
    use core::ops::Range;
    /// Source port.
    pub const SRC_PORT: Range<usize> = 0..2;
    /// Destination port.
    pub const DST_PORT: Range<usize> = 2..4;
    /// Length.
    pub const LENGTH: Range<usize> = 4..6;
    /// Checksum.
    pub const CHECKSUM: Range<usize> = 6..8;
}

/// UDP header length.
pub const HEADER_LEN: usize = 8;
/// IP protocol / next header number of UDP.
pub const PROTOCOL: u8 = 17;

/// Partial sum of the pseudo-header for `src`/`dst` and UDP length `len`.
/// Mixed IPv4/IPv6 addresses -> `BadIpHeader`.
pub fn pseudo_header(src: &IpAddr, dst: &IpAddr, len: u16) -> Result<u64> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => Ok(checksum::pseudo_header_v4(s, d, PROTOCOL, len)),
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            Ok(checksum::pseudo_header_v6(s, d, PROTOCOL, u32::from(len)))
        }
        _ => Err(Error::BadIpHeader),
    }
}

/// A zero-copy view of a UDP datagram.
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

    /// Shorter than 8 bytes or than the length field -> `Truncated`; length field < 8 ->
    /// `LengthMismatch`. A buffer longer than the length field is accepted here (the payload is
    /// bounded by the field); [`super::frame::parse`] additionally requires equality with the
    /// IP payload length.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let field_len = usize::from(self.len());
        if field_len < HEADER_LEN {
            return Err(Error::LengthMismatch);
        }
        if len < field_len {
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

    /// Source port.
    pub fn src_port(&self) -> u16 {
        self.u16_at(field::SRC_PORT)
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        self.u16_at(field::DST_PORT)
    }

    /// Length field (header + payload).
    pub fn len(&self) -> u16 {
        self.u16_at(field::LENGTH)
    }

    /// Whether the datagram has no payload.
    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) <= HEADER_LEN
    }

    /// Checksum field.
    pub fn checksum(&self) -> u16 {
        self.u16_at(field::CHECKSUM)
    }

    /// Verifies the checksum over the pseudo-header, header and payload (up to the length
    /// field). A zero field means "no checksum": accepted for IPv4, rejected for IPv6. Mixed
    /// address families never verify.
    pub fn verify_checksum(&self, src: &IpAddr, dst: &IpAddr) -> bool {
        if self.checksum() == 0 {
            return src.is_ipv4() && dst.is_ipv4();
        }
        let Ok(ph) = pseudo_header(src, dst, self.len()) else {
            return false;
        };
        let data = self.buffer.as_ref();
        let Some(dgram) = data.get(..usize::from(self.len())) else {
            return false;
        };
        checksum::fold(checksum::sum(dgram, ph)) == 0xffff
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload, bounded by the length field.
    pub fn payload(&self) -> &'a [u8] {
        let range = HEADER_LEN..usize::from(self.len());
        self.buffer.as_ref().get(range).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set_u16(&mut self, r: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets the source port. Panics on a short buffer, as do all setters.
    pub fn set_src_port(&mut self, v: u16) {
        self.set_u16(field::SRC_PORT, v)
    }

    /// Sets the destination port.
    pub fn set_dst_port(&mut self, v: u16) {
        self.set_u16(field::DST_PORT, v)
    }

    /// Sets the length field.
    pub fn set_len(&mut self, v: u16) {
        self.set_u16(field::LENGTH, v)
    }

    /// Sets the checksum field.
    pub fn set_checksum(&mut self, v: u16) {
        self.set_u16(field::CHECKSUM, v)
    }

    /// Computes and stores the checksum over header and payload (up to the length field, which
    /// must already be set and within the buffer). A computed 0 is stored as `0xffff`.
    pub fn fill_checksum(&mut self, src: &IpAddr, dst: &IpAddr) -> Result<()> {
        let len = self.len();
        let ph = pseudo_header(src, dst, len)?;
        self.set_checksum(0);
        let dgram = self
            .buffer
            .as_ref()
            .get(..usize::from(len))
            .ok_or(Error::Oversize)?;
        let c = !checksum::fold(checksum::sum(dgram, ph));
        self.set_checksum(if c == 0 { 0xffff } else { c });
        Ok(())
    }

    /// The payload, mutably (bounded by the length field).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = HEADER_LEN..usize::from(self.len());
        self.buffer.as_mut().get_mut(range).unwrap_or(&mut [])
    }
}

/// High-level contents of a UDP header. The payload is not part of the repr: it is written
/// into the packet's payload area before [`Repr::emit`] (which checksums it in place).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Payload length in bytes.
    pub payload_len: usize,
}

impl Repr {
    /// Parses a datagram and verifies its checksum against the given IP addresses
    /// (`BadChecksum` on failure, including a zero checksum over IPv6; `BadIpHeader` if the
    /// address families differ).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        packet: &Packet<&T>,
        src: &IpAddr,
        dst: &IpAddr,
    ) -> Result<Repr> {
        packet.check_len()?;
        if src.is_ipv4() != dst.is_ipv4() {
            return Err(Error::BadIpHeader);
        }
        if !packet.verify_checksum(src, dst) {
            return Err(Error::BadChecksum);
        }
        Ok(Repr {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            payload_len: usize::from(packet.len()) - HEADER_LEN,
        })
    }

    /// Header length (always 8).
    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    /// Header plus payload length.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }

    /// Writes the header and the checksum over the payload already in the buffer.
    /// `Oversize` if the buffer is shorter than `buffer_len()` or the length exceeds 65535;
    /// `BadIpHeader` for mixed address families.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(
        &self,
        packet: &mut Packet<&mut T>,
        src: &IpAddr,
        dst: &IpAddr,
    ) -> Result<()> {
        let len = u16::try_from(self.buffer_len()).map_err(|_| Error::Oversize)?;
        if packet.buffer.as_ref().len() < self.buffer_len() {
            return Err(Error::Oversize);
        }
        if src.is_ipv4() != dst.is_ipv4() {
            return Err(Error::BadIpHeader);
        }
        packet.set_src_port(self.src_port);
        packet.set_dst_port(self.dst_port);
        packet.set_len(len);
        packet.fill_checksum(src, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::checksum::tests::naive_checksum;
    use core::net::{Ipv4Addr, Ipv6Addr};
    use proptest::prelude::*;

    fn v4(a: [u8; 4]) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(a))
    }

    /// A hand-built datagram 198.18.0.1:4000 -> 198.18.0.2:5000 carrying "gradwire!"
    /// (9 bytes, so the odd trailing byte is exercised).
    fn hand_built() -> (Vec<u8>, IpAddr, IpAddr) {
        let mut d = vec![0x0f, 0xa0, 0x13, 0x88, 0x00, 0x11, 0x00, 0x00];
        d.extend_from_slice(b"gradwire!");
        (d, v4([198, 18, 0, 1]), v4([198, 18, 0, 2]))
    }

    #[test]
    fn checksum_matches_naive_pseudo_header_computation() {
        let (mut d, src, dst) = hand_built();
        let mut p = Packet::new_unchecked(&mut d[..]);
        p.fill_checksum(&src, &dst).unwrap();
        let got = p.checksum();

        // Independent computation: lay out the pseudo-header as bytes, append the datagram
        // with a zero checksum field, then sum byte pairs.
        let mut naive = vec![198, 18, 0, 1, 198, 18, 0, 2, 0, 17, 0x00, 0x11];
        naive.extend_from_slice(&[0x0f, 0xa0, 0x13, 0x88, 0x00, 0x11, 0x00, 0x00]);
        naive.extend_from_slice(b"gradwire!");
        assert_eq!(got, naive_checksum(&naive));

        let p = Packet::new_checked(&d[..]).unwrap();
        assert!(p.verify_checksum(&src, &dst));
        assert_eq!(Repr::parse(&p, &src, &dst).unwrap().payload_len, 9);
        assert_eq!(p.payload(), b"gradwire!");
    }

    #[test]
    fn zero_checksum_rules() {
        let (mut d, src, dst) = hand_built();
        Packet::new_unchecked(&mut d[..]).set_checksum(0);
        let p = Packet::new_checked(&d[..]).unwrap();
        assert!(
            Repr::parse(&p, &src, &dst).is_ok(),
            "v4: 0 means no checksum"
        );
        let s6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
        assert_eq!(
            Repr::parse(&p, &s6, &s6),
            Err(Error::BadChecksum),
            "v6: mandatory"
        );
        assert_eq!(Repr::parse(&p, &src, &s6), Err(Error::BadIpHeader));
    }

    #[test]
    fn computed_zero_is_sent_as_ffff() {
        // Choose the payload so that the sum over pseudo-header + header is 0xffff, which makes
        // the computed checksum 0.
        let src = v4([0, 0, 0, 0]);
        let dst = v4([0, 0, 0, 0]);
        let mut d = [0u8; 10];
        Packet::new_unchecked(&mut d[..]).set_len(10);
        // Pseudo-header: protocol 17 + length 10; header: length 10. Sum = 37.
        d[8..10].copy_from_slice(&(0xffff - 37u16).to_be_bytes());
        let mut p = Packet::new_unchecked(&mut d[..]);
        p.fill_checksum(&src, &dst).unwrap();
        assert_eq!(p.checksum(), 0xffff);
        assert!(p.verify_checksum(&src, &dst));
    }

    #[test]
    fn errors() {
        let (d, src, dst) = hand_built();
        assert_eq!(Packet::new_checked(&d[..7]).unwrap_err(), Error::Truncated);
        assert_eq!(Packet::new_checked(&d[..16]).unwrap_err(), Error::Truncated);
        let mut b = d.clone();
        b[5] = 7;
        assert_eq!(
            Packet::new_checked(&b[..]).unwrap_err(),
            Error::LengthMismatch
        );
        let mut b = d.clone();
        Packet::new_unchecked(&mut b[..])
            .fill_checksum(&src, &dst)
            .unwrap();
        b[9] ^= 1;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..]), &src, &dst),
            Err(Error::BadChecksum)
        );
        let r = Repr {
            src_port: 1,
            dst_port: 2,
            payload_len: 65528,
        };
        let mut big = vec![0u8; 65536];
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut big[..]), &src, &dst),
            Err(Error::Oversize)
        );
        let r = Repr {
            payload_len: 10,
            ..r
        };
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut big[..17]), &src, &dst),
            Err(Error::Oversize)
        );
    }

    fn addr_pair() -> impl Strategy<Value = (IpAddr, IpAddr)> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<[u8; 4]>()).prop_map(|(a, b)| (v4(a), v4(b))),
            (any::<[u8; 16]>(), any::<[u8; 16]>()).prop_map(|(a, b)| {
                (IpAddr::V6(Ipv6Addr::from(a)), IpAddr::V6(Ipv6Addr::from(b)))
            }),
        ]
    }

    proptest! {
        #[test]
        fn repr_round_trip((src, dst) in addr_pair(), src_port in any::<u16>(),
                           dst_port in any::<u16>(),
                           payload in proptest::collection::vec(any::<u8>(), 0..1500)) {
            let r = Repr { src_port, dst_port, payload_len: payload.len() };
            let mut buf = vec![0u8; r.buffer_len()];
            buf[HEADER_LEN..].copy_from_slice(&payload);
            r.emit(&mut Packet::new_unchecked(&mut buf[..]), &src, &dst).unwrap();
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_ne!(p.checksum(), 0);
            prop_assert_eq!(Repr::parse(&p, &src, &dst).unwrap(), r);
            prop_assert_eq!(p.payload(), &payload[..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic((src, dst) in addr_pair(),
                                       buf in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Repr::parse(&Packet::new_unchecked(&buf[..]), &src, &dst);
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.payload(), p.verify_checksum(&src, &dst));
            }
        }
    }
}
