//! The parameter server's message header and the codecs of its small side data (block
//! clocks), with no I/O. Every decoder refuses what does not fit instead of panicking.

pub(super) const HEADER_LEN: usize = 16;
pub(super) const MAGIC: u8 = 0x50;
/// Header flag: a contributor-set message (push) or block-clock message (weights) follows
/// the values.
pub(super) const F_SIDE: u8 = 1;
/// Header flag: an empty push (nobody in the subtree contributed to this clock).
pub(super) const F_EMPTY: u8 = 2;
/// Longest failure reason carried.
pub(super) const MAX_REASON: usize = 2048;
/// A block the sender does not hold (weights block clocks).
pub(super) const NOT_HELD: u64 = u64::MAX;
/// Bytes of a version digest (SHA-256, as the collectives' result digests).
pub(super) const DIGEST_LEN: usize = crate::algo::DIGEST_LEN;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Heartbeat = 1,
    Bye = 2,
    Push = 3,
    Weights = 4,
    Fail = 5,
    Tree = 6,
    Adopt = 7,
    /// The server's digest of version `clock` (body: 32 bytes), straight to a worker.
    Digest = 8,
}

/// The header that starts every message: `[magic, kind, flags, 0, len u32, clock u64]`, LE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) kind: Kind,
    pub(super) flags: u8,
    /// Fail: reason bytes; tree: dead ranks; push: the sender's tree version at attachment;
    /// adopt: the tree version.
    pub(super) len: u32,
    /// Push and weights: the clock; fail: the rank that failed; tree: the version; adopt:
    /// the first clock the new parent wants.
    pub(super) clock: u64,
}

impl Header {
    pub(super) fn new(kind: Kind, flags: u8, clock: u64) -> Header {
        Header {
            kind,
            flags,
            len: 0,
            clock,
        }
    }

    pub(super) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        b[1] = self.kind as u8;
        b[2] = self.flags;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.clock.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() != HEADER_LEN || b[0] != MAGIC || b[3] != 0 {
            return Err("malformed message header".into());
        }
        let kind = match b[1] {
            1 => Kind::Heartbeat,
            2 => Kind::Bye,
            3 => Kind::Push,
            4 => Kind::Weights,
            5 => Kind::Fail,
            6 => Kind::Tree,
            7 => Kind::Adopt,
            8 => Kind::Digest,
            k => return Err(format!("unknown message kind {k}")),
        };
        let flags = b[2];
        if flags & !(F_SIDE | F_EMPTY) != 0 {
            return Err(format!("unknown header flags {flags:#x}"));
        }
        let mut len = [0u8; 4];
        len.copy_from_slice(&b[4..8]);
        let mut clock = [0u8; 8];
        clock.copy_from_slice(&b[8..16]);
        Ok(Header {
            kind,
            flags,
            len: u32::from_le_bytes(len),
            clock: u64::from_le_bytes(clock),
        })
    }
}

impl Header {
    /// Bytes of the body that follows the header in the same message: a failure's reason, a
    /// tree update's dead ranks (8 bytes each); nothing for the other kinds.
    pub(super) fn body_len(&self) -> usize {
        match self.kind {
            Kind::Fail => self.len as usize,
            Kind::Tree => (self.len as usize).saturating_mul(8),
            Kind::Digest => DIGEST_LEN,
            _ => 0,
        }
    }
}

/// A header message: the header, then its body.
pub(super) fn encode_msg(h: &Header, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(body);
    out
}

/// Splits a received header message into its header and body; refuses a body that is not
/// the length its header says.
pub(super) fn decode_msg(b: &[u8]) -> Result<(Header, &[u8]), String> {
    let (head, body) = b.split_at(HEADER_LEN.min(b.len()));
    let h = Header::decode(head)?;
    if body.len() != h.body_len() {
        return Err(format!(
            "a {:?} message with {} body bytes where its header says {}",
            h.kind,
            body.len(),
            h.body_len()
        ));
    }
    Ok((h, body))
}

/// The message header's codec, for the fuzz target `ps_header` (not an API: the header is
/// internal to the parameter server's links).
#[doc(hidden)]
pub mod header_codec {
    /// Bytes of a message header.
    pub const LEN: usize = super::HEADER_LEN;

    /// Decode `b` as a message header and encode what was decoded again: `Ok` exactly when
    /// `b` is a valid header.
    pub fn decode_encode(b: &[u8]) -> Result<[u8; LEN], String> {
        super::Header::decode(b).map(|h| h.encode())
    }
}

/// Per-block clocks of a cache (`NOT_HELD` for blocks never received), and whether any block
/// differs from `version`.
pub(super) fn block_clocks(have: &[u64], version: u64) -> (Vec<u64>, bool) {
    let clocks: Vec<u64> = have
        .iter()
        .map(|&h| if h == 0 { NOT_HELD } else { h - 1 })
        .collect();
    let explicit = clocks.iter().any(|&c| c != version);
    (clocks, explicit)
}

pub(super) fn encode_clocks(clocks: &[u64]) -> Vec<u8> {
    clocks.iter().flat_map(|c| c.to_le_bytes()).collect()
}

pub(super) fn decode_clocks(bytes: &[u8], blocks: usize, version: u64) -> Result<Vec<u64>, String> {
    if bytes.len() != blocks * 8 {
        return Err(format!(
            "block clocks of {} bytes for {blocks} blocks",
            bytes.len()
        ));
    }
    let mut out = Vec::with_capacity(blocks);
    for (b, w) in bytes.chunks_exact(8).enumerate() {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        let c = u64::from_le_bytes(a);
        if c != NOT_HELD && c > version {
            return Err(format!(
                "block {b} claims clock {c}, newer than its version {version}"
            ));
        }
        out.push(c);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_round_trip_and_refusals() {
        for h in [
            Header::new(Kind::Heartbeat, 0, 0),
            Header::new(Kind::Push, F_SIDE, 7),
            Header::new(Kind::Push, F_EMPTY, u64::MAX),
            Header {
                kind: Kind::Fail,
                flags: 0,
                len: 42,
                clock: 3,
            },
        ] {
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
        let good = Header::new(Kind::Bye, 0, 1).encode();
        assert!(Header::decode(&good[..15]).is_err());
        let mut bad = good;
        bad[0] = 0;
        assert!(Header::decode(&bad).is_err());
        let mut bad = good;
        bad[1] = 9;
        assert!(Header::decode(&bad).unwrap_err().contains("kind 9"));
        let mut bad = good;
        bad[2] = 0x80;
        assert!(Header::decode(&bad).is_err());
    }

    #[test]
    fn block_clocks_encode_and_refuse_the_future() {
        let have = [0u64, 3, 4];
        let (c, explicit) = block_clocks(&have, 3);
        assert_eq!(c, vec![NOT_HELD, 2, 3]);
        assert!(explicit);
        assert_eq!(block_clocks(&[4, 4], 3), (vec![3, 3], false));
        let bytes = encode_clocks(&c);
        assert_eq!(decode_clocks(&bytes, 3, 3), Ok(c.clone()));
        assert!(decode_clocks(&bytes, 3, 2).unwrap_err().contains("newer"));
        assert!(decode_clocks(&bytes[..16], 3, 3).is_err());
    }

    #[test]
    fn header_messages_carry_exactly_their_body() {
        let mut fail = Header::new(Kind::Fail, 0, 4);
        fail.len = 3;
        let m = encode_msg(&fail, b"why");
        assert_eq!(decode_msg(&m), Ok((fail, &b"why"[..])));
        assert!(decode_msg(&m[..m.len() - 1]).is_err());
        let mut longer = m.clone();
        longer.push(0);
        assert!(decode_msg(&longer).is_err());
        let beat = encode_msg(&Header::new(Kind::Heartbeat, 0, 0), &[]);
        assert!(decode_msg(&beat).is_ok());
        assert!(decode_msg(&[beat.clone(), vec![1]].concat()).is_err());
        assert!(decode_msg(&beat[..3]).is_err());
        let mut tree = Header::new(Kind::Tree, 0, 2);
        tree.len = 2;
        assert!(decode_msg(&encode_msg(&tree, &[0; 16])).is_ok());
        assert!(decode_msg(&encode_msg(&tree, &[0; 8])).is_err());
    }

    proptest! {
        #[test]
        fn header_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(h) = Header::decode(&bytes) {
                // Canonical: whatever is accepted re-encodes to the same bytes.
                prop_assert_eq!(&h.encode()[..], &bytes[..]);
            }
        }

        #[test]
        fn headers_round_trip(
            kind in 1u8..=8,
            flags in 0u8..4,
            len in any::<u32>(),
            clock in any::<u64>(),
        ) {
            let kind = [Kind::Heartbeat, Kind::Bye, Kind::Push, Kind::Weights, Kind::Fail,
                Kind::Tree, Kind::Adopt, Kind::Digest][usize::from(kind - 1)];
            let h = Header { kind, flags, len, clock };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }
}
