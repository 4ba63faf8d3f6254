//! The gradwire data header: a fixed 32-byte big-endian header at the start of every UDP
//! datagram, followed by exactly `length` payload bytes and, in an authenticated datagram, a
//! 16-byte tag.
//!
//! ```text
//! off size field
//! 0   1    version    VERSION (1); anything else is rejected
//! 1   1    kind       1 = Data, 2 = AuthData (a TAG_LEN-byte tag follows the payload)
//! 2   1    flags      bit0 RETRANSMIT, bit1 LAST, bit2 IMPORTANT; unknown bits preserved
//! 3   1    pass       retransmission pass (0 = first transmission), wraps
//! 4   4    job_id
//! 8   4    tensor_id
//! 12  4    round      training iteration
//! 16  8    offset     byte offset of the payload in the tensor
//! 24  4    seq        per-flow packet sequence number
//! 28  2    length     payload length in bytes
//! 30  2    layer      layer index of the tensor
//! 32  ..   payload    exactly `length` bytes (AuthData: AES-128-GCM ciphertext)
//! 32+length  tag      AuthData only: TAG_LEN (16) bytes, the AES-128-GCM tag over the
//!                     32 header bytes (AAD) and the payload; see `crate::auth`
//! ```
//!
//! The 64-bit `offset` sits at an 8-byte-aligned offset so the header can be read with plain
//! loads. A datagram is exact (UDP preserves boundaries), so trailing bytes after the payload
//! (after the tag for AuthData) are an error rather than padding.
//!
//! # Check order
//!
//! Parsing checks lengths first, then the version, then the kind. How many bytes a datagram
//! must have depends on its kind, so the length check reads the raw kind byte only to size
//! the trailer ([`tag_len`]: 16 when byte 1 is AuthData's 2, 0 for any other value) and does not
//! judge it: a datagram whose kind byte is unknown is still length-checked as a tag-less one,
//! and is then rejected by [`Repr::parse`] as `UnknownKind` exactly as before AuthData
//! existed. The version byte does not change the length rule (a datagram of another version
//! with a consistent length is `BadVersion`, as before). The header version stays 1: an old
//! receiver that does not know kind 2 drops AuthData datagrams as `LengthMismatch` (the tag
//! looks like trailing bytes), never places them.

use super::{Error, Result};

/// Field offsets.
pub mod field {
    use core::ops::Range;
    /// Version.
    pub const VERSION: usize = 0;
    /// Kind.
    pub const KIND: usize = 1;
    /// Flags.
    pub const FLAGS: usize = 2;
    /// Retransmission pass.
    pub const PASS: usize = 3;
    /// Job id.
    pub const JOB_ID: Range<usize> = 4..8;
    /// Tensor id.
    pub const TENSOR_ID: Range<usize> = 8..12;
    /// Training round.
    pub const ROUND: Range<usize> = 12..16;
    /// Byte offset in the tensor.
    pub const OFFSET: Range<usize> = 16..24;
    /// Per-flow sequence number.
    pub const SEQ: Range<usize> = 24..28;
    /// Payload length.
    pub const LENGTH: Range<usize> = 28..30;
    /// Layer index.
    pub const LAYER: Range<usize> = 30..32;
    /// Start of the payload.
    pub const PAYLOAD: usize = 32;
}

/// Header length in bytes.
pub const HEADER_LEN: usize = 32;
/// The only header version this code speaks.
pub const VERSION: u8 = 1;
/// Length of the authentication tag after the payload of an [`Kind::AuthData`] datagram.
pub const TAG_LEN: usize = 16;

/// Packet kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// A segment of gradient data.
    Data = 1,
    /// A segment of gradient data in an authenticated flow: the payload is AES-128-GCM
    /// ciphertext and a [`TAG_LEN`]-byte tag follows it (see `crate::auth::FlowKey`).
    AuthData = 2,
}

impl Kind {
    /// Bytes that follow the payload in a datagram of this kind: [`TAG_LEN`] for AuthData,
    /// 0 for Data.
    pub const fn tag_len(self) -> usize {
        match self {
            Kind::Data => 0,
            Kind::AuthData => TAG_LEN,
        }
    }
}

impl TryFrom<u8> for Kind {
    type Error = Error;
    fn try_from(v: u8) -> Result<Kind> {
        match v {
            1 => Ok(Kind::Data),
            2 => Ok(Kind::AuthData),
            _ => Err(Error::UnknownKind),
        }
    }
}

/// Bytes after the payload for a raw kind byte, as the length check uses it: [`TAG_LEN`] for
/// AuthData, 0 for Data and for every unknown kind (which [`Repr::parse`] then rejects as
/// `UnknownKind`; see the module doc's check order).
pub const fn tag_len(kind: u8) -> usize {
    if kind == Kind::AuthData as u8 {
        TAG_LEN
    } else {
        0
    }
}

impl From<Kind> for u8 {
    fn from(k: Kind) -> u8 {
        k as u8
    }
}

/// Header flags. Unknown bits are carried through parse/emit unchanged so that a newer sender's
/// flags do not make an older receiver drop packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(pub u8);

impl Flags {
    /// No flags.
    pub const EMPTY: Flags = Flags(0);
    /// Sent in a retransmission pass.
    pub const RETRANSMIT: Flags = Flags(1 << 0);
    /// Last segment of the tensor.
    pub const LAST: Flags = Flags(1 << 1);
    /// The sender judged the segment's gradients large; it is sent ECN-capable.
    pub const IMPORTANT: Flags = Flags(1 << 2);

    /// Raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Whether all bits of `other` are set.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Sets the bits of `other`.
    pub fn insert(&mut self, other: Flags) {
        self.0 |= other.0;
    }

    /// Clears the bits of `other`.
    pub fn remove(&mut self, other: Flags) {
        self.0 &= !other.0;
    }
}

impl core::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        Flags(self.0 | rhs.0)
    }
}

/// A zero-copy view of a gradwire datagram (header + payload, + tag for AuthData).
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

    /// Shorter than 32 bytes or than 32 + `length` + tag -> `Truncated`; longer than
    /// 32 + `length` + tag -> `LengthMismatch`, where tag is [`tag_len`] of the raw kind byte
    /// (16 for AuthData, else 0). Neither version nor kind is judged here.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let want = HEADER_LEN + usize::from(self.length()) + tag_len(self.kind());
        match len.cmp(&want) {
            core::cmp::Ordering::Less => Err(Error::Truncated),
            core::cmp::Ordering::Greater => Err(Error::LengthMismatch),
            core::cmp::Ordering::Equal => Ok(()),
        }
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn bytes<const N: usize>(&self, r: core::ops::Range<usize>) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buffer.as_ref()[r]);
        out
    }

    /// Version byte.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }

    /// Raw kind byte (see [`Kind::try_from`]).
    pub fn kind(&self) -> u8 {
        self.buffer.as_ref()[field::KIND]
    }

    /// Flags, unknown bits included.
    pub fn flags(&self) -> Flags {
        Flags(self.buffer.as_ref()[field::FLAGS])
    }

    /// Retransmission pass.
    pub fn pass(&self) -> u8 {
        self.buffer.as_ref()[field::PASS]
    }

    /// Job id.
    pub fn job_id(&self) -> u32 {
        u32::from_be_bytes(self.bytes(field::JOB_ID))
    }

    /// Tensor id.
    pub fn tensor_id(&self) -> u32 {
        u32::from_be_bytes(self.bytes(field::TENSOR_ID))
    }

    /// Training round.
    pub fn round(&self) -> u32 {
        u32::from_be_bytes(self.bytes(field::ROUND))
    }

    /// Byte offset of the payload in the tensor.
    pub fn offset(&self) -> u64 {
        u64::from_be_bytes(self.bytes(field::OFFSET))
    }

    /// Per-flow sequence number.
    pub fn seq(&self) -> u32 {
        u32::from_be_bytes(self.bytes(field::SEQ))
    }

    /// Payload length field.
    pub fn length(&self) -> u16 {
        u16::from_be_bytes(self.bytes(field::LENGTH))
    }

    /// Layer index.
    pub fn layer(&self) -> u16 {
        u16::from_be_bytes(self.bytes(field::LAYER))
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload: `length` bytes after the header, without the tag of an AuthData datagram
    /// (clamped to the buffer, so this never panics even on an unchecked view of at least 32
    /// bytes).
    pub fn payload(&self) -> &'a [u8] {
        let data = self.buffer.as_ref();
        let end = (field::PAYLOAD + usize::from(self.length())).min(data.len());
        data.get(field::PAYLOAD..end).unwrap_or(&[])
    }

    /// The tag after the payload: [`TAG_LEN`] bytes for AuthData, empty for any other kind
    /// (clamped to the buffer like [`Self::payload`]).
    pub fn tag(&self) -> &'a [u8] {
        let data = self.buffer.as_ref();
        let start = (field::PAYLOAD + usize::from(self.length())).min(data.len());
        let end = (start + tag_len(self.kind())).min(data.len());
        data.get(start..end).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn put(&mut self, r: core::ops::Range<usize>, v: &[u8]) {
        self.buffer.as_mut()[r].copy_from_slice(v);
    }

    /// Sets the version. Panics on a buffer shorter than 32 bytes, as do all setters.
    pub fn set_version(&mut self, v: u8) {
        self.buffer.as_mut()[field::VERSION] = v;
    }

    /// Sets the raw kind byte.
    pub fn set_kind(&mut self, v: u8) {
        self.buffer.as_mut()[field::KIND] = v;
    }

    /// Sets the flags.
    pub fn set_flags(&mut self, v: Flags) {
        self.buffer.as_mut()[field::FLAGS] = v.0;
    }

    /// Sets the retransmission pass.
    pub fn set_pass(&mut self, v: u8) {
        self.buffer.as_mut()[field::PASS] = v;
    }

    /// Sets the job id.
    pub fn set_job_id(&mut self, v: u32) {
        self.put(field::JOB_ID, &v.to_be_bytes())
    }

    /// Sets the tensor id.
    pub fn set_tensor_id(&mut self, v: u32) {
        self.put(field::TENSOR_ID, &v.to_be_bytes())
    }

    /// Sets the training round.
    pub fn set_round(&mut self, v: u32) {
        self.put(field::ROUND, &v.to_be_bytes())
    }

    /// Sets the tensor byte offset.
    pub fn set_offset(&mut self, v: u64) {
        self.put(field::OFFSET, &v.to_be_bytes())
    }

    /// Sets the sequence number.
    pub fn set_seq(&mut self, v: u32) {
        self.put(field::SEQ, &v.to_be_bytes())
    }

    /// Sets the payload length field.
    pub fn set_length(&mut self, v: u16) {
        self.put(field::LENGTH, &v.to_be_bytes())
    }

    /// Sets the layer index.
    pub fn set_layer(&mut self, v: u16) {
        self.put(field::LAYER, &v.to_be_bytes())
    }

    /// The payload, mutably (`length` bytes after the header, without an AuthData tag,
    /// clamped to the buffer).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let len = usize::from(self.length());
        let data = self.buffer.as_mut();
        let end = (field::PAYLOAD + len).min(data.len());
        data.get_mut(field::PAYLOAD..end).unwrap_or(&mut [])
    }
}

/// High-level contents of a gradwire data header (the payload and tag are not included; the
/// version is implied, always [`VERSION`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    /// Packet kind.
    pub kind: Kind,
    /// Flags (unknown bits preserved).
    pub flags: Flags,
    /// Retransmission pass (0 = first transmission).
    pub pass: u8,
    /// Job id.
    pub job_id: u32,
    /// Tensor id.
    pub tensor_id: u32,
    /// Training round.
    pub round: u32,
    /// Byte offset of the payload in the tensor.
    pub offset: u64,
    /// Per-flow sequence number.
    pub seq: u32,
    /// Payload length in bytes.
    pub length: u16,
    /// Layer index.
    pub layer: u16,
}

impl Repr {
    /// Parses a datagram: length checks as in [`Packet::check_len`], then version
    /// (`BadVersion`) and kind (`UnknownKind`).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Result<Repr> {
        packet.check_len()?;
        if packet.version() != VERSION {
            return Err(Error::BadVersion);
        }
        Ok(Repr {
            kind: Kind::try_from(packet.kind())?,
            flags: packet.flags(),
            pass: packet.pass(),
            job_id: packet.job_id(),
            tensor_id: packet.tensor_id(),
            round: packet.round(),
            offset: packet.offset(),
            seq: packet.seq(),
            length: packet.length(),
            layer: packet.layer(),
        })
    }

    /// Header length (always 32).
    pub const fn header_len(&self) -> usize {
        HEADER_LEN
    }

    /// Header plus payload length, plus [`TAG_LEN`] for AuthData: the whole datagram.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.length as usize + self.kind.tag_len()
    }

    /// Writes the header; the payload and tag areas are left alone (the caller fills them,
    /// before or after; `crate::auth::FlowKey::seal` writes the tag). `Oversize` if the buffer
    /// is shorter than [`Self::buffer_len`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(
        &self,
        packet: &mut Packet<&mut T>,
    ) -> Result<()> {
        if packet.buffer.as_ref().len() < self.buffer_len() {
            return Err(Error::Oversize);
        }
        packet.set_version(VERSION);
        packet.set_kind(self.kind.into());
        packet.set_flags(self.flags);
        packet.set_pass(self.pass);
        packet.set_job_id(self.job_id);
        packet.set_tensor_id(self.tensor_id);
        packet.set_round(self.round);
        packet.set_offset(self.offset);
        packet.set_seq(self.seq);
        packet.set_length(self.length);
        packet.set_layer(self.layer);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn sample_repr(length: u16) -> Repr {
        Repr {
            kind: Kind::Data,
            flags: Flags::LAST | Flags::IMPORTANT,
            pass: 2,
            job_id: 0x0102_0304,
            tensor_id: 0x0506_0708,
            round: 0x090a_0b0c,
            offset: 0x0d0e_0f10_1112_1314,
            seq: 0x1516_1718,
            length,
            layer: 0x191a,
        }
    }

    #[test]
    fn byte_layout() {
        let mut buf = [0u8; 35];
        sample_repr(3)
            .emit(&mut Packet::new_unchecked(&mut buf[..]))
            .unwrap();
        buf[32..].copy_from_slice(b"abc");
        let expect: [u8; 32] = [
            1, 1, 0b110, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
            21, 22, 23, 24, 0, 3, 25, 26,
        ];
        assert_eq!(buf[..32], expect);
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(Repr::parse(&p).unwrap(), sample_repr(3));
        assert_eq!(p.payload(), b"abc");
    }

    #[test]
    fn flags() {
        let mut f = Flags(0x80);
        f.insert(Flags::RETRANSMIT);
        assert!(f.contains(Flags::RETRANSMIT));
        assert!(!f.contains(Flags::LAST));
        f.remove(Flags::RETRANSMIT);
        assert_eq!(f.bits(), 0x80);
        // Unknown bits survive a round trip.
        let r = Repr {
            flags: Flags(0xf8),
            ..sample_repr(0)
        };
        let mut buf = [0u8; 32];
        r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&buf[..])).unwrap().flags,
            Flags(0xf8)
        );
    }

    #[test]
    fn errors() {
        let mut buf = [0u8; 36];
        sample_repr(3)
            .emit(&mut Packet::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(
            Packet::new_checked(&buf[..31]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&buf[..34]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&buf[..]).unwrap_err(),
            Error::LengthMismatch
        );
        let ok = &mut buf[..35];
        ok[0] = 2;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&ok[..])),
            Err(Error::BadVersion)
        );
        ok[0] = VERSION;
        ok[1] = 0;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&ok[..])),
            Err(Error::UnknownKind)
        );
        // 2 is AuthData since issue 12; the first unknown kind is 3.
        assert_eq!(Kind::try_from(2), Ok(Kind::AuthData));
        assert_eq!(Kind::try_from(3), Err(Error::UnknownKind));
        assert_eq!(
            sample_repr(4).emit(&mut Packet::new_unchecked(&mut buf[..35])),
            Err(Error::Oversize)
        );
        // An unchecked view's payload() clamps instead of panicking.
        assert_eq!(Packet::new_unchecked(&buf[..33]).payload().len(), 1);
    }

    #[test]
    fn auth_data_layout_and_errors() {
        let r = Repr {
            kind: Kind::AuthData,
            ..sample_repr(3)
        };
        assert_eq!(r.buffer_len(), HEADER_LEN + 3 + TAG_LEN);
        let mut buf = vec![0u8; r.buffer_len() + 1];
        r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
        buf[32..35].copy_from_slice(b"abc");
        for (i, b) in buf[35..51].iter_mut().enumerate() {
            *b = 0xe0 + i as u8;
        }
        assert_eq!(buf[field::KIND], 2);
        let whole = &buf[..51];
        let p = Packet::new_checked(whole).unwrap();
        assert_eq!(Repr::parse(&p).unwrap(), r);
        assert_eq!(p.payload(), b"abc");
        assert_eq!(p.tag(), &whole[35..]);
        // Without its tag (what a plain Data datagram of the same length looks like), with
        // part of it, or with trailing bytes.
        assert_eq!(
            Packet::new_checked(&buf[..35]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&buf[..50]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&buf[..]).unwrap_err(),
            Error::LengthMismatch
        );
        // The same bytes with kind Data: the tag is trailing bytes.
        let mut plain = whole.to_vec();
        plain[field::KIND] = Kind::Data as u8;
        assert_eq!(
            Packet::new_checked(&plain[..]).unwrap_err(),
            Error::LengthMismatch
        );
        let p = Packet::new_checked(&plain[..35]).unwrap();
        assert_eq!(p.tag(), b"");
        assert_eq!(p.payload(), b"abc");
        // Length first, then version, then kind: a bad version on a consistent AuthData
        // datagram is BadVersion; an unknown kind is length-checked as tag-less.
        let mut v = whole.to_vec();
        v[field::VERSION] = 2;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])),
            Err(Error::BadVersion)
        );
        let mut k = whole.to_vec();
        k[field::KIND] = 3;
        assert_eq!(
            Packet::new_checked(&k[..]).unwrap_err(),
            Error::LengthMismatch
        );
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&k[..35])),
            Err(Error::UnknownKind)
        );
        // Unchecked views clamp the tag like the payload.
        assert_eq!(Packet::new_unchecked(&whole[..40]).tag(), &whole[35..40]);
        assert_eq!(Packet::new_unchecked(&whole[..33]).tag(), b"");
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..50])),
            Err(Error::Oversize)
        );
    }

    prop_compose! {
        pub(crate) fn any_repr(max_len: u16)(
            flags in any::<u8>(), pass in any::<u8>(), job_id in any::<u32>(),
            tensor_id in any::<u32>(), round in any::<u32>(), offset in any::<u64>(),
            seq in any::<u32>(), length in 0..=max_len, layer in any::<u16>(),
        ) -> Repr {
            Repr { kind: Kind::Data, flags: Flags(flags), pass, job_id, tensor_id, round, offset,
                   seq, length, layer }
        }
    }

    proptest! {
        #[test]
        fn repr_round_trip(r in any_repr(2000), fill in any::<u8>()) {
            let mut buf = vec![fill; r.buffer_len()];
            r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(p.payload().len(), usize::from(r.length));
            prop_assert!(p.payload().iter().all(|b| *b == fill));
        }

        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Repr::parse(&Packet::new_unchecked(&buf[..]));
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.payload(), p.offset(), p.layer());
            }
        }

        #[test]
        fn arbitrary_header_with_exact_payload(hdr in any::<[u8; 32]>()) {
            // Make the length consistent so parse gets past check_len and exercises the
            // version/kind checks on random bytes (an AuthData kind byte adds its tag).
            let len = usize::from(u16::from_be_bytes([hdr[28], hdr[29]]));
            let mut buf = hdr.to_vec();
            buf.resize(HEADER_LEN + len + tag_len(hdr[1]), 0);
            match Repr::parse(&Packet::new_unchecked(&buf[..])) {
                Ok(r) => prop_assert!(
                    hdr[0] == VERSION && matches!(hdr[1], 1 | 2) && r.length as usize == len
                ),
                Err(e) => prop_assert!(matches!(e, Error::BadVersion | Error::UnknownKind)),
            }
        }

        #[test]
        fn auth_data_round_trip(
            r in any_repr(2000), fill in any::<u8>(), tag in any::<[u8; TAG_LEN]>(),
        ) {
            let r = Repr { kind: Kind::AuthData, ..r };
            let len = usize::from(r.length);
            prop_assert_eq!(r.buffer_len(), HEADER_LEN + len + TAG_LEN);
            let mut buf = vec![fill; r.buffer_len()];
            r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
            buf[HEADER_LEN + len..].copy_from_slice(&tag);
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(p.payload().len(), len);
            prop_assert!(p.payload().iter().all(|b| *b == fill));
            prop_assert_eq!(p.tag(), &tag[..]);
            // Cut anywhere in the tag or the end of the payload: Truncated (a missing tag is
            // never taken for a tag-less datagram); one byte more: LengthMismatch.
            let from = (buf.len() - TAG_LEN - 2).max(HEADER_LEN);
            for n in (from..buf.len()).chain([HEADER_LEN]) {
                prop_assert_eq!(Packet::new_checked(&buf[..n]).unwrap_err(), Error::Truncated);
            }
            buf.push(fill);
            prop_assert_eq!(Packet::new_checked(&buf[..]).unwrap_err(), Error::LengthMismatch);
        }

        #[test]
        fn kind_byte_sets_the_trailer(r in any_repr(64), kind in any::<u8>()) {
            // The same header and payload bytes with each kind byte: exactly
            // 32 + length + tag_len(kind) bytes pass the length check.
            let want = HEADER_LEN + usize::from(r.length) + tag_len(kind);
            let mut buf = vec![0u8; HEADER_LEN + usize::from(r.length) + TAG_LEN + 1];
            r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
            buf[field::KIND] = kind;
            for n in want.saturating_sub(TAG_LEN + 1)..buf.len() {
                let got = Packet::new_checked(&buf[..n]).map(|_| ());
                let expect = match n.cmp(&want) {
                    core::cmp::Ordering::Less => Err(Error::Truncated),
                    core::cmp::Ordering::Greater => Err(Error::LengthMismatch),
                    core::cmp::Ordering::Equal => Ok(()),
                };
                prop_assert_eq!(got, expect, "kind {} len {}", kind, n);
            }
        }
    }
}
