//! Ethernet II framing, with at most one IEEE 802.1Q VLAN tag.
//!
//! ```text
//! untagged:                        tagged (802.1Q):
//! off size field                   off size field
//! 0   6    destination MAC         0   6    destination MAC
//! 6   6    source MAC              6   6    source MAC
//! 12  2    ethertype               12  2    0x8100 (TPID)
//! 14  ..   payload                 14  2    TCI: PCP(3) DEI(1) VID(12)
//!                                  16  2    ethertype
//!                                  18  ..   payload
//! ```
//!
//! The frame check sequence is not part of the buffer (NICs and AF_XDP strip it). Ethernet
//! padding of short frames is part of the payload here; upper layers bound their payload by
//! their own length fields. Only one tag is understood: a second tag (QinQ) shows up as the
//! inner ethertype `0x8100`, which the IP layer rejects as not-IP.

use super::{Error, Result};
use core::ops::Range;

/// Ethertype values gradwire cares about.
pub mod ethertype {
    /// IPv4.
    pub const IPV4: u16 = 0x0800;
    /// IPv6.
    pub const IPV6: u16 = 0x86dd;
    /// IEEE 802.1Q VLAN tag (TPID).
    pub const VLAN: u16 = 0x8100;
    /// IEEE 802.1ad service tag (TPID); parsed like an 802.1Q tag (the XDP classifier accepts
    /// both, so the user-space parser must too).
    pub const QINQ: u16 = 0x88A8;
}

/// Field offsets.
pub mod field {
    use core::ops::Range;
    /// Destination MAC.
    pub const DST: Range<usize> = 0..6;
    /// Source MAC.
    pub const SRC: Range<usize> = 6..12;
    /// Outer ethertype, or the TPID of a VLAN tag.
    pub const ETHERTYPE: Range<usize> = 12..14;
    /// VLAN tag control information (only when tagged).
    pub const VLAN_TCI: Range<usize> = 14..16;
    /// Inner ethertype (only when tagged).
    pub const VLAN_ETHERTYPE: Range<usize> = 16..18;
}

/// Length of an untagged Ethernet II header.
pub const HEADER_LEN: usize = 14;
/// Length of an Ethernet II header with one 802.1Q tag.
pub const VLAN_HEADER_LEN: usize = 18;
/// Largest 802.1Q VLAN identifier.
pub const MAX_VID: u16 = 0x0fff;

/// A zero-copy view of an Ethernet II frame.
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

    /// Checks that the buffer holds the whole header (including the VLAN tag if present).
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN || (self.is_tagged() && len < VLAN_HEADER_LEN) {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn get<const N: usize>(&self, r: Range<usize>) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buffer.as_ref()[r]);
        out
    }

    /// Destination MAC address.
    pub fn dst_addr(&self) -> [u8; 6] {
        self.get(field::DST)
    }

    /// Source MAC address.
    pub fn src_addr(&self) -> [u8; 6] {
        self.get(field::SRC)
    }

    /// The outer ethertype field (`0x8100` for a tagged frame).
    ///
    /// Unlike the other getters this one never panics, since `check_len` itself depends on it:
    /// a buffer too short to hold it reads as 0.
    pub fn ethertype(&self) -> u16 {
        self.buffer
            .as_ref()
            .get(field::ETHERTYPE)
            .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]))
    }

    /// Whether the frame carries an 802.1Q tag.
    pub fn is_tagged(&self) -> bool {
        matches!(self.ethertype(), ethertype::VLAN | ethertype::QINQ)
    }

    /// The 802.1Q tag control information, if tagged.
    pub fn vlan_tci(&self) -> Option<u16> {
        self.is_tagged()
            .then(|| u16::from_be_bytes(self.get(field::VLAN_TCI)))
    }

    /// The VLAN identifier (low 12 bits of the TCI), if tagged.
    pub fn vlan_id(&self) -> Option<u16> {
        self.vlan_tci().map(|tci| tci & MAX_VID)
    }

    /// The ethertype of the payload: the inner one for a tagged frame.
    pub fn payload_ethertype(&self) -> u16 {
        if self.is_tagged() {
            u16::from_be_bytes(self.get(field::VLAN_ETHERTYPE))
        } else {
            self.ethertype()
        }
    }

    /// Header length: 14, or 18 with a VLAN tag.
    pub fn header_len(&self) -> usize {
        if self.is_tagged() {
            VLAN_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload (everything after the header, including any Ethernet padding).
    pub fn payload(&self) -> &'a [u8] {
        let data = self.buffer.as_ref();
        data.get(self.header_len()..).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the destination MAC. Panics if the buffer is shorter than the header.
    pub fn set_dst_addr(&mut self, mac: [u8; 6]) {
        self.buffer.as_mut()[field::DST].copy_from_slice(&mac);
    }

    /// Sets the source MAC. Panics if the buffer is shorter than the header.
    pub fn set_src_addr(&mut self, mac: [u8; 6]) {
        self.buffer.as_mut()[field::SRC].copy_from_slice(&mac);
    }

    /// Sets the outer ethertype. Panics if the buffer is shorter than the header.
    pub fn set_ethertype(&mut self, value: u16) {
        self.buffer.as_mut()[field::ETHERTYPE].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets the VLAN TCI and inner ethertype (the outer ethertype must already be `0x8100`).
    /// Panics if the buffer is shorter than the tagged header.
    pub fn set_vlan(&mut self, tci: u16, inner_ethertype: u16) {
        let data = self.buffer.as_mut();
        data[field::VLAN_TCI].copy_from_slice(&tci.to_be_bytes());
        data[field::VLAN_ETHERTYPE].copy_from_slice(&inner_ethertype.to_be_bytes());
    }

    /// The payload, mutably.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        self.buffer.as_mut().get_mut(start..).unwrap_or(&mut [])
    }
}

/// High-level contents of an Ethernet II header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    /// Source MAC.
    pub src_addr: [u8; 6],
    /// Destination MAC.
    pub dst_addr: [u8; 6],
    /// Ethertype of the payload (the inner one if tagged).
    pub ethertype: u16,
    /// 802.1Q VLAN identifier; PCP and DEI are not represented (parsed as ignored, emitted 0).
    pub vlan: Option<u16>,
}

impl Repr {
    /// Parses a checked packet. Any ethertype is accepted here; callers decide what they carry.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Result<Repr> {
        packet.check_len()?;
        Ok(Repr {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            ethertype: packet.payload_ethertype(),
            vlan: packet.vlan_id(),
        })
    }

    /// Header length this repr emits.
    pub const fn header_len(&self) -> usize {
        if self.vlan.is_some() {
            VLAN_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }

    /// Minimum buffer length for [`Self::emit`] (the header; the payload is the caller's).
    pub const fn buffer_len(&self) -> usize {
        self.header_len()
    }

    /// Writes the header. `Oversize` if the buffer is too short or the VLAN id exceeds 12 bits.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(
        &self,
        packet: &mut Packet<&mut T>,
    ) -> Result<()> {
        if packet.buffer.as_ref().len() < self.header_len() {
            return Err(Error::Oversize);
        }
        packet.set_dst_addr(self.dst_addr);
        packet.set_src_addr(self.src_addr);
        match self.vlan {
            Some(vid) if vid > MAX_VID => return Err(Error::Oversize),
            Some(vid) => {
                packet.set_ethertype(ethertype::VLAN);
                packet.set_vlan(vid, self.ethertype);
            }
            None => packet.set_ethertype(self.ethertype),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TAGGED: [u8; 20] = [
        0x02, 0, 0, 0, 0, 0x0b, 0x02, 0, 0, 0, 0, 0x0a, 0x81, 0x00, 0xe0, 0x2a, 0x08, 0x00, 0x45,
        0x00,
    ];

    #[test]
    fn parse_tagged() {
        let p = Packet::new_checked(&TAGGED[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.dst_addr, [2, 0, 0, 0, 0, 0x0b]);
        assert_eq!(r.src_addr, [2, 0, 0, 0, 0, 0x0a]);
        assert_eq!(r.vlan, Some(42)); // PCP 7 is ignored
        assert_eq!(r.ethertype, ethertype::IPV4);
        assert_eq!(p.payload(), &[0x45, 0x00]);
    }

    #[test]
    fn truncated() {
        assert_eq!(
            Packet::new_checked(&TAGGED[..13]).unwrap_err(),
            Error::Truncated
        );
        // Long enough for an untagged header but not for the tag it announces.
        assert_eq!(
            Packet::new_checked(&TAGGED[..17]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(Packet::new_unchecked(&[][..]).ethertype(), 0);
    }

    #[test]
    fn emit_rejects_oversize() {
        let r = Repr {
            src_addr: [0; 6],
            dst_addr: [0; 6],
            ethertype: 0x0800,
            vlan: Some(4096),
        };
        let mut buf = [0u8; 18];
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..])),
            Err(Error::Oversize)
        );
        let r = Repr { vlan: None, ..r };
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..13])),
            Err(Error::Oversize)
        );
    }

    proptest! {
        #[test]
        fn repr_round_trip(src in any::<[u8; 6]>(), dst in any::<[u8; 6]>(),
                           et in any::<u16>().prop_filter("not a tag", |e| *e != ethertype::VLAN && *e != ethertype::QINQ),
                           vlan in proptest::option::of(0u16..=MAX_VID),
                           payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let r = Repr { src_addr: src, dst_addr: dst, ethertype: et, vlan };
            let mut buf = vec![0u8; r.buffer_len() + payload.len()];
            let mut p = Packet::new_unchecked(&mut buf[..]);
            r.emit(&mut p).unwrap();
            p.payload_mut().copy_from_slice(&payload);
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(p.header_len(), r.header_len());
            prop_assert_eq!(p.payload(), &payload[..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = Repr::parse(&p);
                let _ = p.payload();
            }
        }
    }
}
