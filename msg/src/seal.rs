//! Sealing of an authenticated job's datagrams: every data segment and control frame between
//! two ranks goes inside a sealed datagram ([`wire::SealedHeader`]), encrypted and
//! authenticated with the key of its direction (`gradwire_proto::auth::PairKeys`: from the
//! job secret and the two ranks' X25519 agreement, so no third member can make one).
//!
//! A datagram is opened before the core sees it, with the key of the rank its source address
//! belongs to: a datagram that does not open, was sealed for another job or rank, or whose
//! packet number was seen already (a replay, [`ReplayWindow`]) is refused and counted. So
//! peer binding no longer rests on addresses: a forged source address or an on-path host
//! that rewrites packets gets nothing past this module.
//!
//! Packet numbers count each direction's datagrams from 0; a resent segment is a new packet
//! with a new number, so the GCM nonce is never reused under a key. Keys are fresh for every
//! run (each rank draws a new member key when it binds).

use gradwire_proto::auth::{AuthError, JobKey, MemberEntry, MemberKey, PairKeys, PACKET_TAG_LEN};

use crate::wire::{self, SealedHeader, SEALED_HEADER_LEN};

/// How far behind the newest packet number an older one is still taken (packets a path
/// reordered): 4096 datagrams, more than a window of GSO bundles.
pub const REPLAY_WINDOW: u64 = 4096;

const WORDS: usize = (REPLAY_WINDOW / 64) as usize;

/// Which packet numbers of one direction were taken: the newest and a bitmap of the
/// [`REPLAY_WINDOW`] before it (RFC 4303's sliding window, sized for reordering paths).
#[derive(Clone)]
pub struct ReplayWindow {
    /// One past the highest number taken (0: none yet).
    top: u64,
    bits: Box<[u64; WORDS]>,
}

impl std::fmt::Debug for ReplayWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplayWindow(top {})", self.top)
    }
}

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow {
            top: 0,
            bits: Box::new([0; WORDS]),
        }
    }
}

impl ReplayWindow {
    fn bit(pn: u64) -> (usize, u64) {
        let i = pn % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    /// Whether `pn` is new: above every number taken, or within the window and not taken.
    pub fn is_new(&self, pn: u64) -> bool {
        if pn >= self.top {
            return true;
        }
        if self.top - pn > REPLAY_WINDOW {
            return false;
        }
        let (w, m) = Self::bit(pn);
        self.bits[w] & m == 0
    }

    /// Takes `pn` (call only after [`Self::is_new`] and the tag verified).
    pub fn take(&mut self, pn: u64) {
        if pn >= self.top {
            let fresh = pn - self.top + 1;
            if fresh >= REPLAY_WINDOW {
                self.bits.fill(0);
            } else {
                for q in self.top..=pn {
                    let (w, m) = Self::bit(q);
                    self.bits[w] &= !m;
                }
            }
            self.top = pn + 1;
        }
        let (w, m) = Self::bit(pn);
        self.bits[w] |= m;
    }
}

/// Why a datagram was not opened (each counted; none reaches the core).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Not a sealed datagram: a plain one in an authenticated job, or malformed.
    #[error(
        "not a sealed datagram ({0}): the sender runs without the job secret, or it is garbage"
    )]
    NotSealed(gradwire_proto::wire::Error),
    /// Sealed for another job, from another rank than its address's, or to another rank.
    #[error("sealed for another job or pair of ranks")]
    Misdirected,
    /// The tag did not verify under the pair's key: forged or altered.
    #[error("the tag does not verify under the pair's key: forged or altered")]
    BadTag,
    /// The packet number was taken already or is older than the window: a replay.
    #[error("packet number seen already or older than the replay window: a replay")]
    Replayed,
}

struct Peer {
    keys: PairKeys,
    next_pn: u64,
    window: ReplayWindow,
}

/// One rank's keys with every peer, its packet numbers and its replay windows.
pub struct Sealing {
    job: u32,
    rank: u16,
    peers: Vec<Option<Peer>>,
}

impl std::fmt::Debug for Sealing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Sealing(rank {} of {}, <keys redacted>)",
            self.rank,
            self.peers.len()
        )
    }
}

impl Sealing {
    /// `rank`'s keys with every other rank of `job`, from its own member key and every rank's
    /// entry (`entries[r]` for rank `r`; this rank's own is ignored; `None`: a rank this one
    /// never talks to, to which nothing is sealed and from which nothing opens). Fails
    /// naming the first rank whose entry is not proven with `key` or whose public key is
    /// unusable.
    pub fn new(
        key: &JobKey,
        job: u32,
        rank: u16,
        member: &MemberKey,
        entries: &[Option<MemberEntry>],
    ) -> Result<Sealing, (u16, AuthError)> {
        let mut peers = Vec::with_capacity(entries.len());
        for (r, e) in entries.iter().enumerate() {
            let r = r as u16;
            let Some(e) = e.as_ref().filter(|_| r != rank) else {
                peers.push(None);
                continue;
            };
            let keys = member.pair(key, job, rank, r, e).map_err(|err| (r, err))?;
            peers.push(Some(Peer {
                keys,
                next_pn: 0,
                window: ReplayWindow::default(),
            }));
        }
        Ok(Sealing { job, rank, peers })
    }

    /// Rank 0 of two with fixed keys, for the fuzz target.
    #[doc(hidden)]
    pub fn for_fuzzing() -> Sealing {
        let rng = ring::rand::SystemRandom::new();
        let key = JobKey::new(
            &gradwire_proto::auth::JobSecret::new(vec![7; 32]).expect("a 32-byte secret"),
        );
        let m: Vec<MemberKey> = (0..2)
            .map(|_| MemberKey::generate(&rng).expect("the OS's random source"))
            .collect();
        let entries: Vec<Option<MemberEntry>> = (0..2)
            .map(|r| Some(m[r].entry(&key, 1, r as u16)))
            .collect();
        Sealing::new(&key, 1, 0, &m[0], &entries).expect("entries of the same key")
    }

    /// Appends the sealed datagram of `parts` (an inner datagram in pieces: a header and a
    /// payload) to `peer`, under its next packet number; `false` (nothing appended) when
    /// `peer` is not another rank of the job (the core only sends to those).
    pub fn seal(&mut self, peer: u16, parts: &[&[u8]], out: &mut Vec<u8>) -> bool {
        let Some(Some(p)) = self.peers.get_mut(usize::from(peer)) else {
            return false;
        };
        let h = SealedHeader {
            job: self.job,
            src: self.rank,
            dst: peer,
            pn: p.next_pn,
        };
        p.next_pn += 1;
        let mut hdr = [0u8; SEALED_HEADER_LEN];
        h.emit(&mut hdr);
        out.extend_from_slice(&hdr);
        let body = out.len();
        for part in parts {
            out.extend_from_slice(part);
        }
        let tag = p.keys.send.seal(h.pn, &hdr, &mut out[body..]);
        out.extend_from_slice(&tag);
        true
    }

    /// Opens a datagram that arrived from `from`'s address: checks its header (this job,
    /// from `from`, to this rank), its packet number against the replay window and its tag;
    /// returns the inner datagram (in `scratch`). Nothing is returned and no state changes
    /// unless all hold.
    pub fn open<'s>(
        &mut self,
        from: u16,
        d: &[u8],
        scratch: &'s mut Vec<u8>,
    ) -> Result<&'s [u8], OpenError> {
        let (h, sealed) = SealedHeader::parse(d).map_err(OpenError::NotSealed)?;
        if h.job != self.job || h.src != from || h.dst != self.rank {
            return Err(OpenError::Misdirected);
        }
        let Some(Some(p)) = self.peers.get_mut(usize::from(from)) else {
            return Err(OpenError::Misdirected);
        };
        if !p.window.is_new(h.pn) {
            return Err(OpenError::Replayed);
        }
        scratch.clear();
        scratch.extend_from_slice(sealed);
        let len = p
            .keys
            .recv
            .open(h.pn, &d[..SEALED_HEADER_LEN], scratch)
            .map_err(|_| OpenError::BadTag)?
            .len();
        p.window.take(h.pn);
        Ok(&scratch[..len])
    }
}

/// Bytes sealing adds to every datagram.
pub const OVERHEAD: usize = wire::SEALED_OVERHEAD;
const _: () = assert!(wire::SEALED_TAG_LEN == PACKET_TAG_LEN);

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_proto::auth::JobSecret;
    use ring::rand::SystemRandom;

    /// An inner datagram's header: a sealed body holds at least a control header.
    const HDR: &[u8; 32] = b"a control header of 32 bytes....";

    fn pair() -> (Sealing, Sealing, MemberKey) {
        let key = JobKey::new(&JobSecret::new(vec![3; 32]).expect("secret"));
        let rng = SystemRandom::new();
        let m: Vec<MemberKey> = (0..3)
            .map(|_| MemberKey::generate(&rng).expect("key"))
            .collect();
        let e: Vec<Option<MemberEntry>> = (0..3)
            .map(|r| Some(m[r].entry(&key, 4, r as u16)))
            .collect();
        let a = Sealing::new(&key, 4, 0, &m[0], &e).expect("rank 0");
        let b = Sealing::new(&key, 4, 1, &m[1], &e).expect("rank 1");
        let third = MemberKey::generate(&rng).expect("key");
        (a, b, third)
    }

    #[test]
    fn sealed_datagrams_open_once_and_only_at_their_peer() {
        let (mut a, mut b, _) = pair();
        let mut wire = Vec::new();
        assert!(a.seal(1, &[HDR, b"payload"], &mut wire));
        assert!(!a.seal(0, &[HDR], &mut Vec::new()), "not to itself");
        assert_eq!(wire.len(), 32 + 7 + OVERHEAD);
        let inner = [&HDR[..], b"payload"].concat();
        let mut s = Vec::new();
        assert_eq!(b.open(0, &wire, &mut s), Ok(&inner[..]));
        // The same datagram again is a replay.
        assert_eq!(b.open(0, &wire, &mut s), Err(OpenError::Replayed));
        // From another rank's address, or with one bit changed: refused.
        let mut w2 = Vec::new();
        assert!(a.seal(1, &[HDR, b"payload"], &mut w2));
        assert_eq!(b.open(2, &w2, &mut s), Err(OpenError::Misdirected));
        for at in [5, 20, SEALED_HEADER_LEN + 3, w2.len() - 1] {
            let mut bad = w2.clone();
            bad[at] ^= 1;
            assert!(b.open(0, &bad, &mut s).is_err(), "flipped byte {at}");
        }
        // The untouched one still opens: failures change nothing.
        assert_eq!(b.open(0, &w2, &mut s), Ok(&inner[..]));
        // A plain datagram is not sealed.
        assert!(matches!(
            b.open(0, &[1, 3, 0, 0, 0, 0, 0, 4], &mut s),
            Err(OpenError::NotSealed(_))
        ));
    }

    #[test]
    fn a_member_cannot_seal_as_another() {
        // Rank 2 holds the secret but not rank 0's private key: it seals as rank 0 with its
        // own member key and rank 1's published entry.
        let (_, mut b, third) = pair();
        let key = JobKey::new(&JobSecret::new(vec![3; 32]).expect("secret"));
        let mut forger = Sealing::new(
            &key,
            4,
            0,
            &third,
            &[Some(third.entry(&key, 4, 0)), Some(third.entry(&key, 4, 1))],
        )
        .expect("its own keys");
        let mut wire = Vec::new();
        assert!(forger.seal(1, &[HDR], &mut wire));
        let mut s = Vec::new();
        assert_eq!(b.open(0, &wire, &mut s), Err(OpenError::BadTag));
    }

    #[test]
    fn the_window_takes_reordered_packets_once_and_refuses_old_ones() {
        let mut w = ReplayWindow::default();
        for pn in [5, 3, 4, 0, 10_000, 9_000, 6_000] {
            assert!(w.is_new(pn), "{pn}");
            w.take(pn);
            assert!(!w.is_new(pn), "{pn} again");
        }
        assert!(!w.is_new(5), "far behind the newest");
        assert!(w.is_new(9_999) && !w.is_new(10_000 - REPLAY_WINDOW - 1));
        // A jump past the whole window forgets the old bits.
        w.take(30_000);
        assert!(w.is_new(30_000 - 5) && !w.is_new(30_000));
    }
}
