//! Per-member keys of an authenticated job's message layer: each rank's X25519 key pair for
//! one run, published with its address and proven with the job key, and one AES-128-GCM key
//! per direction of every pair of ranks.
//!
//! ```text
//!  K_job --HKDF-Expand("gradwire members v2")--> K_m (HMAC-SHA256 key)
//!
//!  member proof of rank r = HMAC-SHA256(K_m, "gradwire member proof v2" || job || r || P_r)
//!
//!  pair {a, b}, a < b:
//!    PRK_ab = HKDF-Extract(salt = "gradwire pair v2" || job || a || b || P_a || P_b,
//!                          ikm  = HKDF-Expand(K_job, "gradwire pair ikm v2") || X25519(x_a, P_b))
//!    key a -> b = HKDF-Expand(PRK_ab, "gradwire packets v2" || a || b)   (AES-128-GCM)
//!    key b -> a = HKDF-Expand(PRK_ab, "gradwire packets v2" || b || a)
//! ```
//!
//! `job` is u32 and ranks u16, big-endian; `P_r` is rank r's X25519 public key, `x_r` its
//! private key ([`MemberKey`], drawn fresh for every run and never leaving the rank).
//!
//! Why: the job secret alone (which every member holds) does not give a pair's keys, the
//! X25519 agreement of the two ranks does, so no third member can compute them, and a
//! packet that opens under the key of `a -> b` was sealed by `a` (or by `b`, which would
//! only be lying to itself). The secret is mixed in too, so an entry in the table that a
//! stranger forged (no valid proof) is refused before any key is derived, and keys are
//! bound to the job and to both public keys. One key per direction: each side numbers its
//! own packets from 0 for the GCM nonce, with no coordination.

use core::fmt;

use ring::{aead, hmac};
use zeroize::Zeroizing;

use super::{expand_bytes, expand_key, extract, AuthError, JobKey, PUBLIC_LEN};

/// Bytes of a member proof (a full HMAC-SHA256 tag).
pub const MEMBER_PROOF_LEN: usize = 32;
/// Bytes of a [`MemberEntry`] as bytes ([`MemberEntry::to_bytes`]): public key, then proof.
pub const MEMBER_ENTRY_LEN: usize = PUBLIC_LEN + MEMBER_PROOF_LEN;
/// Bytes of a packet's authentication tag (AES-128-GCM).
pub const PACKET_TAG_LEN: usize = 16;

mod label {
    pub(super) const MEMBERS: &[u8] = b"gradwire members v2";
    pub(super) const MEMBER_PROOF: &[u8] = b"gradwire member proof v2";
    pub(super) const PAIR_SALT: &[u8] = b"gradwire pair v2";
    pub(super) const PAIR_IKM: &[u8] = b"gradwire pair ikm v2";
    pub(super) const PACKETS: &[u8] = b"gradwire packets v2";
}

/// A rank's X25519 key pair for one run of a job: the private half stays in this process
/// (wiped on drop); the public half goes in the rank's table entry with its
/// [`MemberEntry::proof`].
pub struct MemberKey {
    secret: x25519_dalek::StaticSecret,
    public: [u8; PUBLIC_LEN],
}

impl fmt::Debug for MemberKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MemberKey(<redacted>)")
    }
}

/// What a rank publishes about its member key: the public key and the proof, made with the
/// job key, that a member of the job published it for this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberEntry {
    /// The rank's X25519 public key.
    pub public: [u8; PUBLIC_LEN],
    /// HMAC-SHA256 with the job's member key over job, rank and `public`.
    pub proof: [u8; MEMBER_PROOF_LEN],
}

impl MemberEntry {
    /// The public key, then the proof.
    pub fn to_bytes(&self) -> [u8; MEMBER_ENTRY_LEN] {
        let mut b = [0u8; MEMBER_ENTRY_LEN];
        b[..PUBLIC_LEN].copy_from_slice(&self.public);
        b[PUBLIC_LEN..].copy_from_slice(&self.proof);
        b
    }

    /// [`MemberEntry::to_bytes`] read back; `None` unless exactly [`MEMBER_ENTRY_LEN`] bytes.
    pub fn from_bytes(b: &[u8]) -> Option<MemberEntry> {
        let (public, proof) = b.split_first_chunk::<PUBLIC_LEN>()?;
        Some(MemberEntry {
            public: *public,
            proof: proof.try_into().ok()?,
        })
    }
}

impl MemberKey {
    /// A fresh key from `rng` (the OS's random source in the drivers).
    pub fn generate(rng: &dyn ring::rand::SecureRandom) -> Result<MemberKey, AuthError> {
        let mut bytes = Zeroizing::new([0u8; 32]);
        rng.fill(&mut bytes[..]).map_err(|_| AuthError::Random)?;
        let secret = x25519_dalek::StaticSecret::from(*bytes);
        let public = x25519_dalek::PublicKey::from(&secret).to_bytes();
        Ok(MemberKey { secret, public })
    }

    /// The public key.
    pub fn public(&self) -> &[u8; PUBLIC_LEN] {
        &self.public
    }

    /// This rank's entry for the table: its public key, proven with `key` for `rank` of
    /// `job`.
    pub fn entry(&self, key: &JobKey, job: u32, rank: u16) -> MemberEntry {
        MemberEntry {
            public: self.public,
            proof: key.member_proof(job, rank, &self.public),
        }
    }

    /// The X25519 agreement of this key with `peer`'s, whose entry `theirs` is checked first:
    /// its proof must verify for `peer` of `job`, and the result must be contributory (no
    /// low-order public key). For keys of another kind than packets' between the two (the
    /// NetStorm scheduler's connections: [`JobKey::session`] over it).
    pub fn agree(
        &self,
        key: &JobKey,
        job: u32,
        peer: u16,
        theirs: &MemberEntry,
    ) -> Result<Zeroizing<[u8; 32]>, AuthError> {
        if !key.verify_member_proof(job, peer, &theirs.public, &theirs.proof) {
            return Err(AuthError::BadMemberProof);
        }
        let shared = self
            .secret
            .diffie_hellman(&x25519_dalek::PublicKey::from(theirs.public));
        if !shared.was_contributory() {
            return Err(AuthError::BadPublicKey);
        }
        Ok(Zeroizing::new(*shared.as_bytes()))
    }

    /// The keys between this rank (`me`) and `peer`, whose entry `theirs` is checked first:
    /// its proof must verify for `peer` of `job`, and the agreement must be contributory (no
    /// low-order public key). `send` seals what this rank sends to `peer`, `recv` opens what
    /// `peer` sends here.
    pub fn pair(
        &self,
        key: &JobKey,
        job: u32,
        me: u16,
        peer: u16,
        theirs: &MemberEntry,
    ) -> Result<PairKeys, AuthError> {
        let shared = self.agree(key, job, peer, theirs)?;
        let ((lo, p_lo), (hi, p_hi)) = if me < peer {
            ((me, &self.public), (peer, &theirs.public))
        } else {
            ((peer, &theirs.public), (me, &self.public))
        };
        let mut salt = Vec::with_capacity(label::PAIR_SALT.len() + 8 + 2 * PUBLIC_LEN);
        salt.extend_from_slice(label::PAIR_SALT);
        salt.extend_from_slice(&job.to_be_bytes());
        salt.extend_from_slice(&lo.to_be_bytes());
        salt.extend_from_slice(&hi.to_be_bytes());
        salt.extend_from_slice(p_lo);
        salt.extend_from_slice(p_hi);
        let mut ikm = Zeroizing::new([0u8; 64]);
        expand_bytes(&key.job, &[label::PAIR_IKM], &mut ikm[..32]);
        ikm[32..].copy_from_slice(&shared[..]);
        let prk = extract(&salt, &ikm[..]);
        let direction = |from: u16, to: u16| {
            let (from, to) = (from.to_be_bytes(), to.to_be_bytes());
            let info: [&[u8]; 3] = [label::PACKETS, &from, &to];
            let k: aead::UnboundKey = expand_key(&prk, &info, &aead::AES_128_GCM);
            PacketKey {
                key: aead::LessSafeKey::new(k),
            }
        };
        Ok(PairKeys {
            send: direction(me, peer),
            recv: direction(peer, me),
        })
    }
}

impl JobKey {
    fn member_key(&self) -> hmac::Key {
        expand_key(&self.job, &[label::MEMBERS], hmac::HMAC_SHA256)
    }

    fn member_msg(job: u32, rank: u16, public: &[u8; PUBLIC_LEN]) -> Vec<u8> {
        let mut m = Vec::with_capacity(label::MEMBER_PROOF.len() + 6 + PUBLIC_LEN);
        m.extend_from_slice(label::MEMBER_PROOF);
        m.extend_from_slice(&job.to_be_bytes());
        m.extend_from_slice(&rank.to_be_bytes());
        m.extend_from_slice(public);
        m
    }

    /// The proof that a member of `job` published `public` as `rank`'s member key.
    pub fn member_proof(
        &self,
        job: u32,
        rank: u16,
        public: &[u8; PUBLIC_LEN],
    ) -> [u8; MEMBER_PROOF_LEN] {
        let tag = hmac::sign(&self.member_key(), &Self::member_msg(job, rank, public));
        let mut out = [0u8; MEMBER_PROOF_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Whether `proof` is [`JobKey::member_proof`] of `public` for `rank` of `job` (constant
    /// time, `ring::hmac::verify`).
    pub fn verify_member_proof(
        &self,
        job: u32,
        rank: u16,
        public: &[u8; PUBLIC_LEN],
        proof: &[u8],
    ) -> bool {
        hmac::verify(
            &self.member_key(),
            &Self::member_msg(job, rank, public),
            proof,
        )
        .is_ok()
    }
}

/// The two keys of a pair of ranks, from one side.
pub struct PairKeys {
    /// Seals what this side sends.
    pub send: PacketKey,
    /// Opens what the other side sends.
    pub recv: PacketKey,
}

impl fmt::Debug for PairKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PairKeys(<redacted>)")
    }
}

/// One direction's AES-128-GCM key. The GCM nonce is `[0; 4] || pn (u64 BE)`: the sender
/// numbers its packets on the direction from 0 and never reuses a number (a resent packet
/// gets a new one), which is what makes the nonce unique for the key.
pub struct PacketKey {
    key: aead::LessSafeKey,
}

impl fmt::Debug for PacketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PacketKey(<redacted>)")
    }
}

fn packet_nonce(pn: u64) -> aead::Nonce {
    let mut n = [0u8; aead::NONCE_LEN];
    n[4..].copy_from_slice(&pn.to_be_bytes());
    aead::Nonce::assume_unique_for_key(n)
}

impl PacketKey {
    /// Encrypts `body` in place as packet `pn`, authenticating `aad` with it; returns the tag.
    /// The caller must never seal two packets with one `pn` under this key.
    pub fn seal(&self, pn: u64, aad: &[u8], body: &mut [u8]) -> [u8; PACKET_TAG_LEN] {
        // ring fails only for bodies over 2^36 bytes; datagrams are at most 64 KiB.
        let tag = self
            .key
            .seal_in_place_separate_tag(packet_nonce(pn), aead::Aad::from(aad), body)
            .expect("a datagram is far below AES-GCM's 64 GiB limit");
        let mut out = [0u8; PACKET_TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Verifies and decrypts `sealed` (ciphertext then the [`PACKET_TAG_LEN`]-byte tag) in
    /// place as packet `pn` with `aad`; returns the plaintext, a prefix of `sealed`. Nothing
    /// is returned unless the tag verified.
    pub fn open<'a>(
        &self,
        pn: u64,
        aad: &[u8],
        sealed: &'a mut [u8],
    ) -> Result<&'a mut [u8], AuthError> {
        self.key
            .open_in_place(packet_nonce(pn), aead::Aad::from(aad), sealed)
            .map_err(|_| AuthError::BadTag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::JobSecret;
    use ring::rand::SystemRandom;

    fn job_key(fill: u8) -> JobKey {
        JobKey::new(&JobSecret::new(vec![fill; 32]).expect("secret"))
    }

    fn members(n: usize) -> Vec<MemberKey> {
        (0..n)
            .map(|_| MemberKey::generate(&SystemRandom::new()).expect("key"))
            .collect()
    }

    #[test]
    fn both_ends_of_a_pair_agree_and_each_direction_has_its_own_key() {
        let k = job_key(1);
        let m = members(2);
        let (e0, e1) = (m[0].entry(&k, 7, 0), m[1].entry(&k, 7, 1));
        let a = m[0].pair(&k, 7, 0, 1, &e1).expect("0 with 1");
        let b = m[1].pair(&k, 7, 1, 0, &e0).expect("1 with 0");
        let mut body = b"gradient bytes".to_vec();
        let tag = a.send.seal(5, b"hdr", &mut body);
        assert_ne!(&body[..], b"gradient bytes", "the body is encrypted");
        let mut sealed = [body.clone(), tag.to_vec()].concat();
        assert_eq!(
            b.recv.open(5, b"hdr", &mut sealed).expect("opens"),
            b"gradient bytes"
        );
        // Not under the other direction's key, another packet number or another header.
        for (key, pn, aad) in [
            (&b.send, 5, &b"hdr"[..]),
            (&a.recv, 5, b"hdr"),
            (&b.recv, 6, b"hdr"),
            (&b.recv, 5, b"hdR"),
        ] {
            let mut s = [body.clone(), tag.to_vec()].concat();
            assert_eq!(key.open(pn, aad, &mut s), Err(AuthError::BadTag));
        }
    }

    #[test]
    fn a_third_member_cannot_compute_a_pairs_keys() {
        let k = job_key(1);
        let m = members(3);
        let e: Vec<MemberEntry> = (0..3).map(|r| m[r].entry(&k, 7, r as u16)).collect();
        let honest = m[0].pair(&k, 7, 0, 1, &e[1]).expect("0 with 1");
        // Rank 2 holds the secret and both public keys; the best it can do is pretend to
        // be rank 1 with its own private key (what a forged entry would make rank 0 use).
        let forged = m[2].pair(&k, 7, 1, 0, &e[0]).expect("2 as 1");
        let mut body = b"from rank 2".to_vec();
        let tag = forged.send.seal(0, b"", &mut body);
        let mut sealed = [body, tag.to_vec()].concat();
        assert_eq!(
            honest.recv.open(0, b"", &mut sealed),
            Err(AuthError::BadTag)
        );
    }

    #[test]
    fn entries_are_bound_to_job_rank_key_and_secret() {
        let k = job_key(1);
        let m = members(2);
        let e1 = m[1].entry(&k, 7, 1);
        assert!(m[0].pair(&k, 7, 0, 1, &e1).is_ok());
        assert_eq!(MemberEntry::from_bytes(&e1.to_bytes()), Some(e1));
        assert_eq!(MemberEntry::from_bytes(&e1.to_bytes()[1..]), None);
        let wrong = [
            (job_key(2), 7, 1, e1),
            (job_key(1), 8, 1, e1),
            (job_key(1), 7, 2, e1),
            (
                job_key(1),
                7,
                1,
                MemberEntry {
                    public: *m[0].public(),
                    ..e1
                },
            ),
        ];
        for (key, job, peer, entry) in wrong {
            assert_eq!(
                m[0].pair(&key, job, 0, peer, &entry).map(|_| ()),
                Err(AuthError::BadMemberProof)
            );
        }
        // A low-order public key, even proven, is refused.
        let zero = MemberEntry {
            public: [0; PUBLIC_LEN],
            proof: k.member_proof(7, 1, &[0; PUBLIC_LEN]),
        };
        assert_eq!(
            m[0].pair(&k, 7, 0, 1, &zero).map(|_| ()),
            Err(AuthError::BadPublicKey)
        );
    }
}
