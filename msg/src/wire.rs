//! The message layer's frames: data segments and control frames, big-endian, in the codec
//! style of `gradwire_proto::wire` (a validated `Repr` with `parse`/`emit`, errors of
//! [`gradwire_proto::wire::Error`], no allocation, no panic on any input).
//!
//! Every gradwire datagram starts with the same 8-byte prefix (`version`, `kind`, one byte
//! the kind defines, one more, `job`); the flow protocol's data header
//! (`gradwire_proto::wire::header`) uses kinds 1 and 2, the message layer kinds 3, 5 and 6.
//!
//! ```text
//! Data segment (kind 3), 40-byte header then `length` payload bytes:
//! off size field
//! 0   1    version   1
//! 1   1    kind      3
//! 2   1    flags     bit0 RETRANSMIT, bit1 LAST (last segment of this pass), bit2 IMPORTANT
//! 3   1    pass      retransmission pass (0 = first transmission), wraps
//! 4   4    job
//! 8   2    src       sender's rank
//! 10  2    dst       receiver's rank
//! 12  4    msg       message number on the src -> dst channel (allocated by the layer)
//! 16  8    offset    byte offset of the payload in the message
//! 24  4    total     message length in bytes
//! 28  2    length    payload bytes
//! 30  2    layer     DNN layer of the tensor (DLCP tagging)
//! 32  8    meta      per-segment word for the layer's user (a contributor set)
//! 40  ..   payload
//!
//! Control frame (kind 5), 32-byte header then `bitmap_len` bytes:
//! 0   1    version   1
//! 1   1    kind      5
//! 2   1    op        1 ACK, 2 DONE, 3 NACK, 4 POLL, 5 ABORT, 6 PING, 7 PONG, 8 GRANT
//! 3   1    pass      the pass it answers (ACK/DONE/NACK) or asks about (POLL)
//! 4   4    job
//! 8   2    src       sender of this frame
//! 10  2    dst
//! 12  4    msg       the message (numbered on the channel of its data: for ACK, DONE and
//!                    NACK the channel dst -> src)
//! 16  4    a         ACK/DONE: distinct segments received; NACK: first segment of the bitmap;
//!                    GRANT: the sender's first pass may send segments below a
//! 20  4    b         ACK/DONE: segments that arrived CE-marked; NACK: bits in the bitmap
//! 24  4    c         DONE: segments left missing; ABORT: reason code; NACK: 0 at the end
//!                    of a pass, NACK_GAP (1) for a gap seen within a first pass
//! 28  2    bitmap_len
//! 30  2    reserved  0
//! 32  ..   bitmap    NACK: bit i (LSB first in byte i/8) set = segment a+i is missing
//!
//! Sealed datagram (kind 6, authenticated jobs), 24-byte header (the AEAD's associated data),
//! then one data segment or control frame encrypted, then a 16-byte tag:
//! 0   1    version   1
//! 1   1    kind      6
//! 2   2    reserved  0
//! 4   4    job
//! 8   2    src       sender's rank (its pair key opens the datagram)
//! 10  2    dst       receiver's rank
//! 12  4    reserved  0
//! 16  8    pn        packet number on the src -> dst direction: the GCM nonce, never reused
//! 24  ..   sealed    the inner datagram (kind 3 or 5), AES-128-GCM ciphertext
//! ..  16   tag
//! ```

use gradwire_proto::wire::Error;

/// Result of a codec function.
pub type Result<T> = core::result::Result<T, Error>;

/// Header version this code speaks.
pub const VERSION: u8 = 1;
/// Kind of a data segment.
pub const KIND_DATA: u8 = 3;
/// Kind of a control frame.
pub const KIND_CTRL: u8 = 5;
/// Kind of a sealed datagram.
pub const KIND_SEALED: u8 = 6;
/// Data header length.
pub const DATA_HEADER_LEN: usize = 40;
/// Sealed header length.
pub const SEALED_HEADER_LEN: usize = 24;
/// Authentication tag after a sealed datagram's body.
pub const SEALED_TAG_LEN: usize = 16;
/// Bytes sealing adds to a datagram.
pub const SEALED_OVERHEAD: usize = SEALED_HEADER_LEN + SEALED_TAG_LEN;
/// Control header length.
pub const CTRL_HEADER_LEN: usize = 32;
/// A NACK's `c`: a gap seen within the sender's first pass, not the end of a pass (the
/// sender resends the named segments and goes on with the pass).
pub const NACK_GAP: u32 = 1;
/// Longest NACK bitmap in one frame (8192 segments).
pub const MAX_BITMAP: usize = 1024;

/// Data flags.
pub mod flags {
    /// Sent in a retransmission pass.
    pub const RETRANSMIT: u8 = 1 << 0;
    /// Last segment of this pass: the receiver answers with DONE or NACK.
    pub const LAST: u8 = 1 << 1;
    /// The sender judged the segment's gradients large (sent ECN-capable).
    pub const IMPORTANT: u8 = 1 << 2;
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

/// The kind byte of a datagram, after checking the version (`None`: too short).
pub fn kind(datagram: &[u8]) -> Result<u8> {
    if datagram.len() < 8 {
        return Err(Error::Truncated);
    }
    if datagram[0] != VERSION {
        return Err(Error::BadVersion);
    }
    Ok(datagram[1])
}

/// A data segment's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataHeader {
    /// Flags ([`flags`]); unknown bits preserved.
    pub flags: u8,
    /// Retransmission pass.
    pub pass: u8,
    /// Job id.
    pub job: u32,
    /// Sender's rank.
    pub src: u16,
    /// Receiver's rank.
    pub dst: u16,
    /// Message number on the src -> dst channel.
    pub msg: u32,
    /// Byte offset of the payload in the message.
    pub offset: u64,
    /// Message length.
    pub total: u32,
    /// Payload length.
    pub length: u16,
    /// Layer.
    pub layer: u16,
    /// Per-segment word of the layer's user.
    pub meta: u64,
}

impl DataHeader {
    /// Parses a data segment: the header and a payload of exactly `length` bytes, inside the
    /// message (`offset + length <= total`). Returns the header and the payload.
    pub fn parse(d: &[u8]) -> Result<(DataHeader, &[u8])> {
        if d.len() < DATA_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if d[0] != VERSION {
            return Err(Error::BadVersion);
        }
        if d[1] != KIND_DATA {
            return Err(Error::UnknownKind);
        }
        let h = DataHeader {
            flags: d[2],
            pass: d[3],
            job: be32(d, 4),
            src: be16(d, 8),
            dst: be16(d, 10),
            msg: be32(d, 12),
            offset: be64(d, 16),
            total: be32(d, 24),
            length: be16(d, 28),
            layer: be16(d, 30),
            meta: be64(d, 32),
        };
        let want = DATA_HEADER_LEN + usize::from(h.length);
        if d.len() < want {
            return Err(Error::Truncated);
        }
        if d.len() > want {
            return Err(Error::LengthMismatch);
        }
        match h.offset.checked_add(u64::from(h.length)) {
            Some(end) if end <= u64::from(h.total) => {}
            _ => return Err(Error::LengthMismatch),
        }
        Ok((h, &d[DATA_HEADER_LEN..]))
    }

    /// Writes the header into `out[..40]`.
    pub fn emit(&self, out: &mut [u8; DATA_HEADER_LEN]) {
        out[0] = VERSION;
        out[1] = KIND_DATA;
        out[2] = self.flags;
        out[3] = self.pass;
        out[4..8].copy_from_slice(&self.job.to_be_bytes());
        out[8..10].copy_from_slice(&self.src.to_be_bytes());
        out[10..12].copy_from_slice(&self.dst.to_be_bytes());
        out[12..16].copy_from_slice(&self.msg.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..28].copy_from_slice(&self.total.to_be_bytes());
        out[28..30].copy_from_slice(&self.length.to_be_bytes());
        out[30..32].copy_from_slice(&self.layer.to_be_bytes());
        out[32..40].copy_from_slice(&self.meta.to_be_bytes());
    }
}

/// What a control frame says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CtrlOp {
    /// Progress: the receiver has `a` distinct segments (`b` CE-marked).
    Ack = 1,
    /// The receiver finished the message (`c` segments left missing under its bound).
    Done = 2,
    /// Resend the segments set in the bitmap (from segment `a`, `b` bits).
    Nack = 3,
    /// The sender asks where the message stands; the receiver answers ACK, DONE or NACK.
    Poll = 4,
    /// The sender gave the message up (`c`: reason): the receiver fails it.
    Abort = 5,
    /// The receiver, waiting long for a message, asks whether its sender is alive.
    Ping = 6,
    /// The sender is alive (`a` = 1: it has posted the message).
    Pong = 7,
    /// The receiver lets the sender's first pass go up to segment `a` (exclusive): its
    /// share of the receiver's budget of segments in flight towards it (incast control).
    Grant = 8,
}

impl TryFrom<u8> for CtrlOp {
    type Error = Error;
    fn try_from(v: u8) -> Result<CtrlOp> {
        Ok(match v {
            1 => CtrlOp::Ack,
            2 => CtrlOp::Done,
            3 => CtrlOp::Nack,
            4 => CtrlOp::Poll,
            5 => CtrlOp::Abort,
            6 => CtrlOp::Ping,
            7 => CtrlOp::Pong,
            8 => CtrlOp::Grant,
            _ => return Err(Error::UnknownKind),
        })
    }
}

/// A control frame's header (the NACK bitmap follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ctrl {
    /// What it says.
    pub op: CtrlOp,
    /// Pass answered or asked about.
    pub pass: u8,
    /// Job id.
    pub job: u32,
    /// Sender of this frame.
    pub src: u16,
    /// Receiver of this frame.
    pub dst: u16,
    /// Message.
    pub msg: u32,
    /// Field a (see the module doc).
    pub a: u32,
    /// Field b.
    pub b: u32,
    /// Field c.
    pub c: u32,
}

impl Ctrl {
    /// Parses a control frame; returns it and its bitmap (empty unless NACK). A NACK's bitmap
    /// must hold exactly `b` bits (rounded up to bytes) and at most [`MAX_BITMAP`] bytes.
    pub fn parse(d: &[u8]) -> Result<(Ctrl, &[u8])> {
        if d.len() < CTRL_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if d[0] != VERSION {
            return Err(Error::BadVersion);
        }
        if d[1] != KIND_CTRL {
            return Err(Error::UnknownKind);
        }
        let c = Ctrl {
            op: CtrlOp::try_from(d[2])?,
            pass: d[3],
            job: be32(d, 4),
            src: be16(d, 8),
            dst: be16(d, 10),
            msg: be32(d, 12),
            a: be32(d, 16),
            b: be32(d, 20),
            c: be32(d, 24),
        };
        let blen = usize::from(be16(d, 28));
        if d.len() < CTRL_HEADER_LEN + blen {
            return Err(Error::Truncated);
        }
        if d.len() > CTRL_HEADER_LEN + blen {
            return Err(Error::LengthMismatch);
        }
        let want = if c.op == CtrlOp::Nack {
            (c.b as usize).div_ceil(8)
        } else {
            0
        };
        if blen != want || blen > MAX_BITMAP {
            return Err(Error::LengthMismatch);
        }
        Ok((c, &d[CTRL_HEADER_LEN..]))
    }

    /// Writes the frame (header and `bitmap`) at the start of `out`; returns its length.
    /// `out` must hold `CTRL_HEADER_LEN + bitmap.len()` bytes and the bitmap at most
    /// [`MAX_BITMAP`] bytes (else `Truncated`/`LengthMismatch`, nothing written).
    pub fn emit(&self, bitmap: &[u8], out: &mut [u8]) -> Result<usize> {
        let len = CTRL_HEADER_LEN + bitmap.len();
        if bitmap.len() > MAX_BITMAP {
            return Err(Error::LengthMismatch);
        }
        let Some(out) = out.get_mut(..len) else {
            return Err(Error::Truncated);
        };
        out[0] = VERSION;
        out[1] = KIND_CTRL;
        out[2] = self.op as u8;
        out[3] = self.pass;
        out[4..8].copy_from_slice(&self.job.to_be_bytes());
        out[8..10].copy_from_slice(&self.src.to_be_bytes());
        out[10..12].copy_from_slice(&self.dst.to_be_bytes());
        out[12..16].copy_from_slice(&self.msg.to_be_bytes());
        out[16..20].copy_from_slice(&self.a.to_be_bytes());
        out[20..24].copy_from_slice(&self.b.to_be_bytes());
        out[24..28].copy_from_slice(&self.c.to_be_bytes());
        out[28..30].copy_from_slice(&(bitmap.len() as u16).to_be_bytes());
        out[30..32].copy_from_slice(&[0, 0]);
        out[32..].copy_from_slice(bitmap);
        Ok(len)
    }
}

/// A sealed datagram's header (its body and tag follow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SealedHeader {
    /// Job id.
    pub job: u32,
    /// Sender's rank.
    pub src: u16,
    /// Receiver's rank.
    pub dst: u16,
    /// Packet number on the src -> dst direction.
    pub pn: u64,
}

impl SealedHeader {
    /// Parses a sealed datagram: returns its header and the rest (sealed body and tag), which
    /// holds at least a control header and the tag. The header bytes are `d[..24]`, the
    /// associated data to open it with.
    pub fn parse(d: &[u8]) -> Result<(SealedHeader, &[u8])> {
        if d.len() < SEALED_HEADER_LEN + CTRL_HEADER_LEN + SEALED_TAG_LEN {
            return Err(Error::Truncated);
        }
        if d[0] != VERSION {
            return Err(Error::BadVersion);
        }
        if d[1] != KIND_SEALED {
            return Err(Error::UnknownKind);
        }
        if d[2..4] != [0, 0] || d[12..16] != [0; 4] {
            return Err(Error::LengthMismatch);
        }
        let h = SealedHeader {
            job: be32(d, 4),
            src: be16(d, 8),
            dst: be16(d, 10),
            pn: be64(d, 16),
        };
        Ok((h, &d[SEALED_HEADER_LEN..]))
    }

    /// Writes the header into `out[..24]`.
    pub fn emit(&self, out: &mut [u8; SEALED_HEADER_LEN]) {
        out[0] = VERSION;
        out[1] = KIND_SEALED;
        out[2..4].copy_from_slice(&[0, 0]);
        out[4..8].copy_from_slice(&self.job.to_be_bytes());
        out[8..10].copy_from_slice(&self.src.to_be_bytes());
        out[10..12].copy_from_slice(&self.dst.to_be_bytes());
        out[12..16].copy_from_slice(&[0; 4]);
        out[16..24].copy_from_slice(&self.pn.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(h: &DataHeader, payload: &[u8]) -> Vec<u8> {
        let mut hdr = [0u8; DATA_HEADER_LEN];
        h.emit(&mut hdr);
        let mut v = hdr.to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn data_round_trips_and_refuses_what_does_not_fit() {
        let h = DataHeader {
            flags: flags::LAST,
            pass: 2,
            job: 7,
            src: 1,
            dst: 3,
            msg: 99,
            offset: 1432,
            total: 4000,
            length: 5,
            layer: 12,
            meta: 0b1011,
        };
        let d = data(&h, b"hello");
        assert_eq!(DataHeader::parse(&d), Ok((h, &b"hello"[..])));
        assert_eq!(DataHeader::parse(&d[..44]), Err(Error::Truncated));
        let mut long = d.clone();
        long.push(0);
        assert_eq!(DataHeader::parse(&long), Err(Error::LengthMismatch));
        // A payload past the message's end is refused: it would be placed out of bounds.
        let past = DataHeader { offset: 3996, ..h };
        assert_eq!(
            DataHeader::parse(&data(&past, b"hello")),
            Err(Error::LengthMismatch)
        );
        let mut v2 = d.clone();
        v2[0] = 2;
        assert_eq!(DataHeader::parse(&v2), Err(Error::BadVersion));
        v2[0] = 1;
        v2[1] = KIND_CTRL;
        assert_eq!(DataHeader::parse(&v2), Err(Error::UnknownKind));
    }

    #[test]
    fn nack_bitmap_must_match_its_bit_count() {
        let c = Ctrl {
            op: CtrlOp::Nack,
            pass: 1,
            job: 1,
            src: 0,
            dst: 1,
            msg: 4,
            a: 10,
            b: 12,
            c: 0,
        };
        let mut buf = [0u8; 64];
        let n = c.emit(&[0xff, 0x0f], &mut buf).expect("fits");
        assert_eq!(Ctrl::parse(&buf[..n]), Ok((c, &[0xff, 0x0f][..])));
        let n = c.emit(&[0xff], &mut buf).expect("fits");
        assert_eq!(Ctrl::parse(&buf[..n]), Err(Error::LengthMismatch));
        let ack = Ctrl {
            op: CtrlOp::Ack,
            ..c
        };
        let n = ack.emit(&[1], &mut buf).expect("fits");
        assert_eq!(Ctrl::parse(&buf[..n]), Err(Error::LengthMismatch));
        assert_eq!(
            ack.emit(&[0; MAX_BITMAP + 1], &mut [0u8; 2048]),
            Err(Error::LengthMismatch)
        );
        assert_eq!(ack.emit(&[], &mut [0u8; 8]), Err(Error::Truncated));
    }

    #[test]
    fn sealed_header_round_trips_and_refuses_what_does_not_fit() {
        let h = SealedHeader {
            job: 9,
            src: 2,
            dst: 5,
            pn: u64::MAX - 1,
        };
        let mut d = vec![0u8; SEALED_HEADER_LEN + CTRL_HEADER_LEN + SEALED_TAG_LEN];
        let mut hdr = [0u8; SEALED_HEADER_LEN];
        h.emit(&mut hdr);
        d[..SEALED_HEADER_LEN].copy_from_slice(&hdr);
        let (got, rest) = SealedHeader::parse(&d).expect("parses");
        assert_eq!(got, h);
        assert_eq!(rest.len(), CTRL_HEADER_LEN + SEALED_TAG_LEN);
        assert_eq!(
            SealedHeader::parse(&d[..d.len() - 1]),
            Err(Error::Truncated)
        );
        let mut r = d.clone();
        r[13] = 1;
        assert_eq!(SealedHeader::parse(&r), Err(Error::LengthMismatch));
        r = d.clone();
        r[1] = KIND_DATA;
        assert_eq!(SealedHeader::parse(&r), Err(Error::UnknownKind));
    }

    proptest! {
        #[test]
        fn parsers_never_panic(d in proptest::collection::vec(any::<u8>(), 0..1600)) {
            let _ = DataHeader::parse(&d);
            let _ = Ctrl::parse(&d);
            let _ = SealedHeader::parse(&d);
            let _ = kind(&d);
        }

        #[test]
        fn parsed_data_lies_inside_its_message(mut d in proptest::collection::vec(any::<u8>(), 40..200)) {
            d[0] = VERSION;
            d[1] = KIND_DATA;
            if let Ok((h, p)) = DataHeader::parse(&d) {
                prop_assert_eq!(p.len(), usize::from(h.length));
                prop_assert!(h.offset + u64::from(h.length) <= u64::from(h.total));
            }
        }
    }
}
