//! Crypto of authenticated jobs: the key schedule from a job secret, the handshake proofs and
//! ephemeral X25519 exchange of the control channel, control-frame tags, and per-flow
//! AES-128-GCM for data datagrams.
//!
//! Everything comes from `ring` (HKDF-SHA256, HMAC-SHA256, X25519, AES-128-GCM); nothing here is
//! home-made beyond choosing labels and byte layouts. No I/O: nonces are arguments (the caller
//! draws them from the OS's random source), and so are the ids a flow key is bound to.
//!
//! # Key schedule
//!
//! ```text
//!  job secret (16..=4096 bytes from a key file or the environment; never derived from a password)
//!     |
//!     | HKDF-Extract(salt = "gradwire job key v2")
//!     v
//!   K_job ---HKDF-Expand("gradwire handshake v2")---> K_hs
//!     |                                                |
//!     |        client proof = HMAC-SHA256(K_hs, "gradwire client proof v2" || T)
//!     |        server proof = HMAC-SHA256(K_hs, "gradwire server proof v2" || T)
//!     |        T = Nc || Ns || Pc || Ps (the transcript)
//!     |
//!     | HKDF-Expand("gradwire session v2") = S (32 bytes)
//!     v
//!   PRK_s = HKDF-Extract(salt = T, ikm = S || X25519(eph, peer's P))   one per connection
//!     |
//!     +--HKDF-Expand("gradwire ctrl c2s v2")--> HMAC key, frames client -> server
//!     +--HKDF-Expand("gradwire ctrl s2c v2")--> HMAC key, frames server -> client
//!     +--HKDF-Expand("gradwire data v2" || job || tensor || round || flow nonce)
//!                                           --> AES-128-GCM key of one flow (16 bytes)
//! ```
//!
//! `Nc` and `Ns` are the client's and the server's [`NONCE_LEN`]-byte random handshake nonces,
//! `Pc` and `Ps` their ephemeral X25519 public keys ([`Ephemeral`], one per handshake),
//! `job`, `tensor` and `round` are u32 big-endian, the flow nonce is [`FLOW_NONCE_LEN`] random
//! bytes the sender puts in its FlowStart. Why it is built this way:
//!
//! - **Proofs** use distinct labels per direction, so a server cannot pass a client's proof
//!   back as its own (reflection), and cover the whole transcript, so a recorded proof is
//!   worthless in a handshake with a fresh nonce or key. The client proves first and the
//!   server only in its sealed `Welcome`, so a stranger at the control port never sees a
//!   value it could test guesses of the secret against. They are compared in constant time
//!   (`ring::hmac::verify`).
//! - **Session keys** need the job secret *and* the X25519 shared secret of the connection's
//!   two ephemeral keys: a job member that only watches another connection's handshake cannot
//!   derive them, and they are gone when the ephemeral keys are (forward secrecy). They also
//!   depend on both nonces: every control connection gets keys of its own,
//!   so frames and data recorded from an earlier connection do not verify in a later one.
//! - **Control frames** carry HMAC-SHA256(key of the direction, seq_be64 || frame) truncated
//!   to [`CTRL_TAG_LEN`] bytes; `seq` counts frames per direction from 0 and is implicit
//!   (both ends count), so a replayed, dropped, reordered or reflected frame fails.
//! - **Flow keys** are bound to the flow's ids and a random flow nonce: a datagram of one
//!   flow, round or earlier transfer of the same ids does not verify under another flow's
//!   key, and the GCM nonce only has to be unique within one flow.
//!
//! # Data datagrams
//!
//! An authenticated datagram is a [`header`] datagram of kind
//! [`Kind::AuthData`](crate::wire::header::Kind::AuthData):
//!
//! ```text
//! | header (32 B, AAD) | payload (`length` B, AES-128-GCM ciphertext) | tag (16 B) |
//!
//! GCM nonce (12 B) = 00 00 00 00 | seq (u32 BE) | pass (u8) | 00 00 00
//! ```
//!
//! The whole header is authenticated, so job, tensor, round, offset, seq, pass, length, flags
//! and layer cannot be changed without the tag failing; seq and pass also make the nonce.
//!
//! # Key material in memory
//!
//! [`JobSecret`] owns the secret's bytes and wipes them on drop (`zeroize`); the 32-byte
//! intermediate `S` is wiped after use. Derived keys live inside `ring`'s key objects, which
//! do not wipe themselves on drop; they are never exposed as bytes.

use core::fmt;

use ring::{aead, agreement, hkdf, hmac};
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use crate::wire::{self, header};

mod members;
pub use members::{
    MemberEntry, MemberKey, PacketKey, PairKeys, MEMBER_ENTRY_LEN, MEMBER_PROOF_LEN, PACKET_TAG_LEN,
};

pub use crate::wire::header::TAG_LEN as DATA_TAG_LEN;

/// Shortest job secret accepted, in bytes (128 bits).
pub const MIN_SECRET_LEN: usize = 16;
/// Longest job secret accepted, in bytes: bounds what a key file may make us read and hash.
pub const MAX_SECRET_LEN: usize = 4096;
/// Length of each side's random handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a handshake proof (a full HMAC-SHA256 tag).
pub const PROOF_LEN: usize = 32;
/// Length of a control-frame tag (HMAC-SHA256 truncated to 128 bits).
pub const CTRL_TAG_LEN: usize = 16;
/// Length of the random per-flow nonce carried in FlowStart, bound into the flow key.
pub const FLOW_NONCE_LEN: usize = 16;

/// HKDF salt and info labels. Versioned ("v2") so a changed schedule never silently
/// interoperates with an old one.
mod label {
    pub(super) const JOB_SALT: &[u8] = b"gradwire job key v2";
    pub(super) const HANDSHAKE: &[u8] = b"gradwire handshake v2";
    pub(super) const SERVER_PROOF: &[u8; PROOF_LABEL_LEN] = b"gradwire server proof v2";
    pub(super) const CLIENT_PROOF: &[u8; PROOF_LABEL_LEN] = b"gradwire client proof v2";
    pub(super) const SESSION: &[u8] = b"gradwire session v2";
    pub(super) const CTRL_C2S: &[u8] = b"gradwire ctrl c2s v2";
    pub(super) const CTRL_S2C: &[u8] = b"gradwire ctrl s2c v2";
    pub(super) const DATA: &[u8] = b"gradwire data v2";
    /// Both proof labels have this length, so a proof's message has a fixed layout.
    pub(super) const PROOF_LABEL_LEN: usize = 24;
}

/// Why a secret was refused or a datagram did not authenticate.
#[derive(thiserror::Error, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// The job secret is shorter than [`MIN_SECRET_LEN`].
    #[error(
        "job secret is {len} bytes; use at least {MIN_SECRET_LEN} random bytes \
         (e.g. `head -c 32 /dev/urandom > job.key`)"
    )]
    SecretTooShort {
        /// Length of the refused secret.
        len: usize,
    },
    /// The job secret is longer than [`MAX_SECRET_LEN`].
    #[error(
        "job secret is {len} bytes, more than the {MAX_SECRET_LEN} allowed: check that it names \
         the key file, and use {MIN_SECRET_LEN} to {MAX_SECRET_LEN} random bytes \
         (e.g. `head -c 32 /dev/urandom > job.key`)"
    )]
    SecretTooLong {
        /// Length of the refused secret.
        len: usize,
    },
    /// The tag did not verify: the datagram was altered or forged, belongs to another flow,
    /// round or session, or the two ends hold different job secrets. Drop it.
    #[error(
        "authentication tag does not verify (altered, forged or from another flow/session, or \
         the peers hold different job secrets); dropped"
    )]
    BadTag,
    /// A plain Data datagram reached an authenticated flow. Drop it.
    #[error(
        "unauthenticated data datagram on an authenticated flow; dropped (the sender must run \
         with the same job secret)"
    )]
    Unauthenticated,
    /// [`FlowKey::seal`] was given a datagram whose kind is not AuthData.
    #[error(
        "datagram to seal is not of kind AuthData: emit its header with Kind::AuthData and \
         leave {} bytes of room for the tag after the payload",
        header::TAG_LEN
    )]
    NotAuthData,
    /// The datagram is not a well-formed gradwire datagram (see [`wire::Error`]).
    #[error("malformed authenticated datagram: {0}")]
    Malformed(wire::Error),
    /// The random number generator failed while making an ephemeral key.
    #[error("the system random number generator failed: check that getrandom(2) works")]
    Random,
    /// The peer's X25519 public key is unusable (a low-order point: the shared secret would
    /// be zero). Close the connection, or refuse the peer's table entry.
    #[error("the peer's X25519 public key is invalid (low-order point)")]
    BadPublicKey,
    /// A rank's member key in the table is not proven with this job's key: it was forged
    /// or altered on its way, or that rank holds another job secret.
    #[error(
        "the member key is not proven with this job's secret (forged or altered in the \
         table, or that rank holds another secret): give every rank the same secret"
    )]
    BadMemberProof,
}

/// `N` bytes from `rng` (the drivers pass the OS's random source,
/// `ring::rand::SystemRandom`): handshake nonces, link tokens, flow nonces.
pub fn random<const N: usize>(rng: &dyn ring::rand::SecureRandom) -> Result<[u8; N], AuthError> {
    let mut b = [0u8; N];
    rng.fill(&mut b).map_err(|_| AuthError::Random)?;
    Ok(b)
}

/// A [`hkdf::KeyType`] for HKDF output of any length (only [`expand_bytes`] uses it).
struct OutLen(usize);

impl hkdf::KeyType for OutLen {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Extract with SHA-256 (RFC 5869 2.2).
fn extract(salt: &[u8], ikm: &[u8]) -> hkdf::Prk {
    hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(ikm)
}

/// HKDF-Expand with SHA-256 (RFC 5869 2.3) of `info` (the concatenation of its slices) into
/// `out`.
fn expand_bytes(prk: &hkdf::Prk, info: &[&[u8]], out: &mut [u8]) {
    // ring refuses only outputs longer than 255 hash lengths (8160 bytes); callers here ask for
    // at most 42.
    prk.expand(info, OutLen(out.len()))
        .and_then(|okm| okm.fill(out))
        .expect("HKDF-Expand output within 255 x 32 bytes");
}

/// HKDF-Expand straight into a `ring` key object of type `K` (`len` gives the algorithm and
/// thereby the length), so the key bytes never sit in our memory.
fn expand_key<'a, L, K>(prk: &'a hkdf::Prk, info: &'a [&'a [u8]], len: L) -> K
where
    L: hkdf::KeyType,
    K: From<hkdf::Okm<'a, L>>,
{
    // Every `L` used here is an algorithm of at most 32 bytes of output.
    K::from(
        prk.expand(info, len)
            .expect("HKDF-Expand output within 255 x 32 bytes"),
    )
}

/// The shared secret of a job, as read from a key file or the environment. Its bytes are
/// wiped when it is dropped, and never printed.
pub struct JobSecret {
    bytes: Zeroizing<Vec<u8>>,
}

impl JobSecret {
    /// Takes `bytes` as they are (no trimming, no decoding) and checks only their length:
    /// [`MIN_SECRET_LEN`]..=[`MAX_SECRET_LEN`]. The bytes are wiped on drop, also when refused.
    pub fn new(bytes: Vec<u8>) -> Result<JobSecret, AuthError> {
        let bytes = Zeroizing::new(bytes);
        let len = bytes.len();
        if len < MIN_SECRET_LEN {
            return Err(AuthError::SecretTooShort { len });
        }
        if len > MAX_SECRET_LEN {
            return Err(AuthError::SecretTooLong { len });
        }
        Ok(JobSecret { bytes })
    }
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobSecret(<redacted>, {} bytes)", self.bytes.len())
    }
}

/// The job key `K_job` and the handshake key derived from it: what both ends of a control
/// connection hold before the handshake. Build it once per job and share it.
pub struct JobKey {
    job: hkdf::Prk,
    handshake: hmac::Key,
}

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(<redacted>)")
    }
}

/// Bytes of an X25519 public key (`Hello`, `Challenge`).
pub const PUBLIC_LEN: usize = 32;

/// What both ends of one handshake said in the clear: the two nonces and the two ephemeral
/// X25519 public keys. Proofs and session keys are bound to all of it, so neither a proof
/// nor a key of one handshake is worth anything in another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    /// The client's `Hello` nonce.
    pub client_nonce: [u8; NONCE_LEN],
    /// The server's `Challenge` nonce.
    pub server_nonce: [u8; NONCE_LEN],
    /// The client's ephemeral public key (`Hello`).
    pub client_public: [u8; PUBLIC_LEN],
    /// The server's ephemeral public key (`Challenge`).
    pub server_public: [u8; PUBLIC_LEN],
}

impl Transcript {
    /// Nc || Ns || Pc || Ps.
    fn bytes(&self) -> [u8; 2 * NONCE_LEN + 2 * PUBLIC_LEN] {
        let mut b = [0u8; 2 * NONCE_LEN + 2 * PUBLIC_LEN];
        let parts: [&[u8]; 4] = [
            &self.client_nonce,
            &self.server_nonce,
            &self.client_public,
            &self.server_public,
        ];
        let mut at = 0;
        for part in parts {
            b[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        b
    }
}

/// The message a handshake proof is the HMAC of: label || transcript.
fn proof_msg(
    label: &[u8; label::PROOF_LABEL_LEN],
    t: &Transcript,
) -> [u8; label::PROOF_LABEL_LEN + 2 * NONCE_LEN + 2 * PUBLIC_LEN] {
    let mut m = [0u8; label::PROOF_LABEL_LEN + 2 * NONCE_LEN + 2 * PUBLIC_LEN];
    let (l, rest) = m.split_at_mut(label::PROOF_LABEL_LEN);
    l.copy_from_slice(label);
    rest.copy_from_slice(&t.bytes());
    m
}

/// One end's ephemeral X25519 key for one handshake: its public half goes in `Hello` or
/// `Challenge`, the private half is used once, to agree on the connection's shared secret,
/// and is gone after that (forward secrecy; and a job member that only watches another
/// connection's handshake cannot derive its keys).
pub struct Ephemeral {
    key: agreement::EphemeralPrivateKey,
    public: [u8; PUBLIC_LEN],
}

impl fmt::Debug for Ephemeral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Ephemeral(<redacted>)")
    }
}

impl Ephemeral {
    /// A fresh key from `rng` (the caller's: `ring::rand::SystemRandom` in the drivers).
    pub fn generate(rng: &dyn ring::rand::SecureRandom) -> Result<Ephemeral, AuthError> {
        let key = agreement::EphemeralPrivateKey::generate(&agreement::X25519, rng)
            .map_err(|_| AuthError::Random)?;
        let pk = key.compute_public_key().map_err(|_| AuthError::Random)?;
        let mut public = [0u8; PUBLIC_LEN];
        public.copy_from_slice(pk.as_ref());
        Ok(Ephemeral { key, public })
    }

    /// The public key to send.
    pub fn public(&self) -> &[u8; PUBLIC_LEN] {
        &self.public
    }

    /// X25519 with the peer's public key: the shared secret (wiped on drop). Refuses a peer
    /// key that makes the result all zeros (a low-order point).
    pub fn agree(self, peer: &[u8; PUBLIC_LEN]) -> Result<Zeroizing<[u8; 32]>, AuthError> {
        let peer = agreement::UnparsedPublicKey::new(&agreement::X25519, peer);
        agreement::agree_ephemeral(self.key, &peer, |shared| {
            let mut out = Zeroizing::new([0u8; 32]);
            out.copy_from_slice(shared);
            out
        })
        .map_err(|_| AuthError::BadPublicKey)
    }
}

impl JobKey {
    /// `K_job = HKDF-Extract(salt = "gradwire job key v2", ikm = secret)` and
    /// `K_hs = HKDF-Expand(K_job, "gradwire handshake v2")`.
    pub fn new(secret: &JobSecret) -> JobKey {
        let job = extract(label::JOB_SALT, &secret.bytes);
        let handshake = expand_key(&job, &[label::HANDSHAKE], hmac::HMAC_SHA256);
        JobKey { job, handshake }
    }

    fn proof(&self, label: &[u8; label::PROOF_LABEL_LEN], t: &Transcript) -> [u8; PROOF_LEN] {
        let tag = hmac::sign(&self.handshake, &proof_msg(label, t));
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// The server's proof that it holds the job secret, for this handshake:
    /// HMAC-SHA256(K_hs, "gradwire server proof v2" || transcript).
    pub fn server_proof(&self, t: &Transcript) -> [u8; PROOF_LEN] {
        self.proof(label::SERVER_PROOF, t)
    }

    /// The client's proof that it holds the job secret, for this handshake:
    /// HMAC-SHA256(K_hs, "gradwire client proof v2" || transcript).
    pub fn client_proof(&self, t: &Transcript) -> [u8; PROOF_LEN] {
        self.proof(label::CLIENT_PROOF, t)
    }

    /// Whether `proof` (as received, any length) is the server's proof for this handshake.
    /// Constant time in the proof's contents (`ring::hmac::verify`).
    pub fn verify_server_proof(&self, t: &Transcript, proof: &[u8]) -> bool {
        hmac::verify(&self.handshake, &proof_msg(label::SERVER_PROOF, t), proof).is_ok()
    }

    /// Whether `proof` (as received, any length) is the client's proof for this handshake.
    /// Constant time in the proof's contents (`ring::hmac::verify`).
    pub fn verify_client_proof(&self, t: &Transcript, proof: &[u8]) -> bool {
        hmac::verify(&self.handshake, &proof_msg(label::CLIENT_PROOF, t), proof).is_ok()
    }

    /// The keys of one control connection, after a handshake with this transcript and X25519
    /// shared secret `shared`: `PRK_s = HKDF-Extract(salt = transcript, ikm =
    /// HKDF-Expand(K_job, "gradwire session v2") || shared)`. Both halves are needed: the job
    /// secret (so only job members) and the ephemeral exchange (so only these two ends).
    /// Derive it only once the peer's proof verified.
    pub fn session(&self, t: &Transcript, shared: &[u8; 32]) -> SessionKeys {
        let mut ikm = Zeroizing::new([0u8; 64]);
        expand_bytes(&self.job, &[label::SESSION], &mut ikm[..32]);
        ikm[32..].copy_from_slice(shared);
        SessionKeys {
            prk: extract(&t.bytes(), &ikm[..]),
        }
    }
}

/// Which end of a control connection: the client connects (the sender of tensors), the
/// server listens (the receiver).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The end that connected.
    Client,
    /// The end that accepted.
    Server,
}

/// The session key `PRK_s` of one control connection, from which its control-frame keys
/// and its flows' data keys are derived.
pub struct SessionKeys {
    prk: hkdf::Prk,
}

impl fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKeys(<redacted>)")
    }
}

impl SessionKeys {
    /// The (sealer for frames this role sends, opener for frames it receives), both at
    /// sequence number 0. Keys: HKDF-Expand(PRK_s, "gradwire ctrl c2s v2") for frames from
    /// the client to the server, "gradwire ctrl s2c v2" for the other direction. Call once
    /// per connection: a second pair would start counting from 0 again.
    pub fn control(&self, role: Role) -> (CtrlSealer, CtrlOpener) {
        let c2s: hmac::Key = expand_key(&self.prk, &[label::CTRL_C2S], hmac::HMAC_SHA256);
        let s2c: hmac::Key = expand_key(&self.prk, &[label::CTRL_S2C], hmac::HMAC_SHA256);
        let (send, recv) = match role {
            Role::Client => (c2s, s2c),
            Role::Server => (s2c, c2s),
        };
        (
            CtrlSealer { key: send, seq: 0 },
            CtrlOpener { key: recv, seq: 0 },
        )
    }

    /// The AES-128-GCM key of one flow: HKDF-Expand(PRK_s, "gradwire data v2" || job ||
    /// tensor || round (u32 BE each) || flow_nonce). Both ends derive it from the flow's
    /// FlowStart.
    pub fn flow_key(
        &self,
        job: u32,
        tensor: u32,
        round: u32,
        flow_nonce: &[u8; FLOW_NONCE_LEN],
    ) -> FlowKey {
        let (job, tensor, round) = (job.to_be_bytes(), tensor.to_be_bytes(), round.to_be_bytes());
        let info: [&[u8]; 5] = [label::DATA, &job, &tensor, &round, flow_nonce];
        let key: aead::UnboundKey = expand_key(&self.prk, &info, &aead::AES_128_GCM);
        FlowKey {
            key: aead::LessSafeKey::new(key),
        }
    }
}

/// HMAC-SHA256(key, seq_be64 || frame): the untruncated control-frame MAC.
fn ctrl_mac(key: &hmac::Key, seq: u64, frame: &[u8]) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(&seq.to_be_bytes());
    ctx.update(frame);
    ctx.sign()
}

/// Tags the control frames one end sends, numbering them from 0.
pub struct CtrlSealer {
    key: hmac::Key,
    seq: u64,
}

impl fmt::Debug for CtrlSealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CtrlSealer(<redacted>, seq {})", self.seq)
    }
}

impl CtrlSealer {
    /// The tag of the next frame sent: HMAC-SHA256(key, seq_be64 || frame) truncated to
    /// [`CTRL_TAG_LEN`] bytes; then seq + 1. Frames must reach the peer in the order they
    /// were sealed (the control channel is a byte stream). 2^64 frames cannot be reached (584
    /// years at 10^9 per second), so seq does not wrap in practice.
    pub fn seal(&mut self, frame: &[u8]) -> [u8; CTRL_TAG_LEN] {
        let mac = ctrl_mac(&self.key, self.seq, frame);
        self.seq = self.seq.wrapping_add(1);
        let mut tag = [0u8; CTRL_TAG_LEN];
        tag.copy_from_slice(&mac.as_ref()[..CTRL_TAG_LEN]);
        tag
    }
}

/// Verifies the control frames one end receives, in order from sequence number 0.
pub struct CtrlOpener {
    key: hmac::Key,
    seq: u64,
}

impl fmt::Debug for CtrlOpener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CtrlOpener(<redacted>, seq {})", self.seq)
    }
}

impl CtrlOpener {
    /// Whether `tag` is the tag of `frame` as the next frame in sequence. The comparison is
    /// constant time (`subtle`: `ring` 0.17 deprecated its public constant-time compare, and
    /// `ring::hmac::verify` checks only whole, untruncated tags). Seq advances only on
    /// success, so a replayed, reordered, reflected or altered frame fails and a good frame
    /// after it still verifies; the caller should close the connection on the first failure
    /// anyway.
    pub fn open(&mut self, frame: &[u8], tag: &[u8]) -> bool {
        if tag.len() != CTRL_TAG_LEN {
            return false;
        }
        let mac = ctrl_mac(&self.key, self.seq, frame);
        let ok = bool::from(mac.as_ref()[..CTRL_TAG_LEN].ct_eq(tag));
        if ok {
            self.seq = self.seq.wrapping_add(1);
        }
        ok
    }
}

/// The AES-128-GCM key of one flow, for sealing (sender) or opening (receiver) its
/// [`Kind::AuthData`](header::Kind::AuthData) datagrams.
pub struct FlowKey {
    key: aead::LessSafeKey,
}

impl fmt::Debug for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FlowKey(<redacted>)")
    }
}

/// The GCM nonce of a datagram: `[0; 4] || seq (u32 BE) || pass || [0; 3]`.
fn gcm_nonce(seq: u32, pass: u8) -> aead::Nonce {
    let mut n = [0u8; aead::NONCE_LEN];
    n[4..8].copy_from_slice(&seq.to_be_bytes());
    n[8] = pass;
    aead::Nonce::assume_unique_for_key(n)
}

impl FlowKey {
    /// Seals a datagram in place. `datagram` is the 32-byte header (kind AuthData,
    /// `length` = payload bytes) | payload | [`DATA_TAG_LEN`] bytes of room, exactly. Encrypts
    /// the payload in place (AAD = the 32 header bytes) and writes the tag into the room.
    ///
    /// **Nonce uniqueness:** the GCM nonce is made of the header's seq and pass, so the
    /// sender must never seal two datagrams with the same (seq, pass) under one `FlowKey`
    /// (with AES-GCM a repeated nonce reveals the XOR of plaintexts and lets the MAC key be
    /// recovered, i.e. forgeries). The flow keeps seq strictly increasing and does not wrap it
    /// in authenticated mode; a new flow (new flow nonce) gets a new key.
    ///
    /// Errors: `Malformed` if the lengths do not match or the version is wrong, `NotAuthData`
    /// if the kind is not AuthData. The datagram is unchanged on error.
    pub fn seal(&self, datagram: &mut [u8]) -> Result<(), AuthError> {
        let repr = parse_auth(datagram).map_err(|e| match e {
            AuthError::Unauthenticated => AuthError::NotAuthData,
            e => e,
        })?;
        let nonce = gcm_nonce(repr.seq, repr.pass);
        let (hdr, rest) = datagram.split_at_mut(header::HEADER_LEN);
        let (payload, room) = rest.split_at_mut(usize::from(repr.length));
        // Fails only for payloads over 2^36 bytes; ours are at most 65535.
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, aead::Aad::from(&*hdr), payload)
            .map_err(|_| AuthError::Malformed(wire::Error::Oversize))?;
        room.copy_from_slice(tag.as_ref());
        Ok(())
    }

    /// Verifies and decrypts an AuthData datagram (as received: header + payload + tag,
    /// exactly) into `scratch` (the sealed payload and tag are copied there and opened in
    /// place: `ring` has no out-of-place open) and returns the plaintext payload, a prefix of
    /// `scratch`. Nothing is returned unless the tag verified; on error `scratch` is left
    /// empty. Reuse one `scratch` per receive loop: it grows to the largest datagram once
    /// (at most 32 + 65535 + 16 bytes, bounded by the length field).
    ///
    /// Errors: `Malformed` (lengths, version, unknown kind), `Unauthenticated` (a plain Data
    /// datagram), `BadTag`.
    pub fn open<'s>(
        &self,
        datagram: &[u8],
        scratch: &'s mut Vec<u8>,
    ) -> Result<&'s [u8], AuthError> {
        scratch.clear();
        let repr = parse_auth(datagram)?;
        self.open_parsed(&repr, datagram, scratch)
    }

    /// [`Self::open`] for a datagram whose header the caller has already parsed into
    /// `repr` (the receive path parses once). `datagram` must still be exactly that
    /// datagram: the lengths are checked again (cheaply), the header bytes are the AAD.
    pub fn open_parsed<'s>(
        &self,
        repr: &header::Repr,
        datagram: &[u8],
        scratch: &'s mut Vec<u8>,
    ) -> Result<&'s [u8], AuthError> {
        scratch.clear();
        if repr.kind != header::Kind::AuthData {
            return Err(AuthError::Unauthenticated);
        }
        if datagram.len() != header::HEADER_LEN + usize::from(repr.length) + header::TAG_LEN {
            return Err(AuthError::Malformed(wire::Error::LengthMismatch));
        }
        let (hdr, sealed) = datagram.split_at(header::HEADER_LEN);
        scratch.extend_from_slice(sealed);
        let nonce = gcm_nonce(repr.seq, repr.pass);
        let len = match self
            .key
            .open_in_place(nonce, aead::Aad::from(hdr), scratch.as_mut_slice())
        {
            Ok(plain) => plain.len(),
            Err(_) => {
                scratch.clear();
                return Err(AuthError::BadTag);
            }
        };
        Ok(&scratch[..len])
    }
}

/// Length, version and kind checks of an AuthData datagram, in the header's order.
fn parse_auth(datagram: &[u8]) -> Result<header::Repr, AuthError> {
    let pkt = header::Packet::new_checked(datagram).map_err(AuthError::Malformed)?;
    let repr = header::Repr::parse(&pkt).map_err(AuthError::Malformed)?;
    match repr.kind {
        header::Kind::AuthData => Ok(repr),
        header::Kind::Data => Err(AuthError::Unauthenticated),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::header::{Flags, Kind, Repr, HEADER_LEN, TAG_LEN};
    use proptest::prelude::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    fn secret(fill: u8) -> JobSecret {
        JobSecret::new(vec![fill; 32]).expect("32-byte secret")
    }

    const NC: [u8; NONCE_LEN] = [0x11; NONCE_LEN];
    const NS: [u8; NONCE_LEN] = [0x22; NONCE_LEN];
    /// A handshake's transcript and X25519 shared secret (fixed: the schedule is what is
    /// tested here; the handshake tests run real key exchanges).
    const T: Transcript = Transcript {
        client_nonce: NC,
        server_nonce: NS,
        client_public: [0x44; PUBLIC_LEN],
        server_public: [0x55; PUBLIC_LEN],
    };
    const SHARED: [u8; 32] = [0x66; 32];
    const FLOW_NONCE: [u8; FLOW_NONCE_LEN] = [0x33; FLOW_NONCE_LEN];

    fn repr(kind: Kind, seq: u32, pass: u8, length: u16) -> Repr {
        Repr {
            kind,
            flags: Flags::LAST,
            pass,
            job_id: 7,
            tensor_id: 42,
            round: 3,
            offset: 1440 * u64::from(seq),
            seq,
            length,
            layer: 5,
        }
    }

    /// An unsealed AuthData datagram with `payload` and room for the tag.
    fn datagram(seq: u32, pass: u8, payload: &[u8]) -> Vec<u8> {
        let r = repr(Kind::AuthData, seq, pass, payload.len() as u16);
        let mut d = vec![0u8; r.buffer_len()];
        r.emit(&mut header::Packet::new_unchecked(&mut d[..]))
            .expect("room for the header");
        d[HEADER_LEN..HEADER_LEN + payload.len()].copy_from_slice(payload);
        d
    }

    fn flow_key() -> FlowKey {
        JobKey::new(&secret(1))
            .session(&T, &SHARED)
            .flow_key(7, 42, 3, &FLOW_NONCE)
    }

    fn sealed(key: &FlowKey, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut d = datagram(seq, 0, payload);
        key.seal(&mut d).expect("seal");
        d
    }

    #[test]
    fn hkdf_rfc5869_test_case_1() {
        let ikm = [0x0b; 22];
        let salt = hex("000102030405060708090a0b0c");
        let info = hex("f0f1f2f3f4f5f6f7f8f9");
        let prk = extract(&salt, &ikm);
        let mut okm = [0u8; 42];
        expand_bytes(&prk, &[&info], &mut okm);
        assert_eq!(
            okm.to_vec(),
            hex(
                "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf\
                 34007208d5b887185865"
            )
        );
        // Extract is HMAC(salt, ikm) (RFC 5869 2.2): the test case's PRK.
        let want_prk = hex("077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5");
        let k = hmac::Key::new(hmac::HMAC_SHA256, &salt);
        assert_eq!(hmac::sign(&k, &ikm).as_ref(), &want_prk[..]);
        // Info given in pieces is their concatenation (flow_key passes five pieces).
        let mut pieces = [0u8; 42];
        expand_bytes(&prk, &[&info[..3], &[], &info[3..]], &mut pieces);
        assert_eq!(pieces, okm);
        // expand_key yields the key of the same bytes as expand_bytes.
        let mut bytes = [0u8; 32];
        expand_bytes(&prk, &[&info], &mut bytes);
        let from_okm: hmac::Key = expand_key(&prk, &[&info], hmac::HMAC_SHA256);
        let from_bytes = hmac::Key::new(hmac::HMAC_SHA256, &bytes);
        assert_eq!(
            hmac::sign(&from_okm, b"m").as_ref(),
            hmac::sign(&from_bytes, b"m").as_ref()
        );
    }

    /// The whole schedule against values computed independently with Python's `cryptography`
    /// 48 (HMAC, HKDFExpand, AESGCM) from the labels and layouts in the module doc:
    /// secret = 00..1f, Nc = (c0..cf)x2, Ns = (50..5f)x2, Pc = (90..9f)x2, Ps = (60..6f)x2,
    /// X25519 shared secret (e0..ef)x2, frame "hello control", flow
    /// (7, 42, 3) with flow nonce a0..af, header (1, 2, flags 6, pass 2, job 7, tensor 42,
    /// round 3, offset 0x1122334455667788, seq 0x01020304, length 5, layer 9), payload "grads".
    /// It pins the wire format: a change of label or layout must fail here.
    #[test]
    fn known_answers_from_an_independent_implementation() {
        let secret = JobSecret::new((0u8..32).collect()).expect("secret");
        let nc: [u8; NONCE_LEN] = core::array::from_fn(|i| 0xc0 + (i % 16) as u8);
        let ns: [u8; NONCE_LEN] = core::array::from_fn(|i| 0x50 + (i % 16) as u8);
        let t = Transcript {
            client_nonce: nc,
            server_nonce: ns,
            client_public: core::array::from_fn(|i| 0x90 + (i % 16) as u8),
            server_public: core::array::from_fn(|i| 0x60 + (i % 16) as u8),
        };
        let shared: [u8; 32] = core::array::from_fn(|i| 0xe0 + (i % 16) as u8);
        let jk = JobKey::new(&secret);
        assert_eq!(
            jk.server_proof(&t).to_vec(),
            hex("13a69a179ea10d83d3ccff43dd5058191395ab4ecbeeb59c0c9abfc3f29eb768")
        );
        assert_eq!(
            jk.client_proof(&t).to_vec(),
            hex("c2a8bf9004ff9f4e6d7a829c13f666976c9411a6e3609abe52524533704b272f")
        );
        let session = jk.session(&t, &shared);
        let (mut c2s, _) = session.control(Role::Client);
        let (mut s2c, _) = session.control(Role::Server);
        assert_eq!(
            c2s.seal(b"hello control").to_vec(),
            hex("385b96ea9b6ace30f1c63cdb182d3285")
        );
        assert_eq!(
            c2s.seal(b"hello control").to_vec(),
            hex("87a47a50104ff16bd9d51d28c8c01e58")
        );
        assert_eq!(
            s2c.seal(b"hello control").to_vec(),
            hex("84bda7a4081997f1dc0813be9a60f876")
        );
        let fnonce: [u8; FLOW_NONCE_LEN] = core::array::from_fn(|i| 0xa0 + i as u8);
        let key = session.flow_key(7, 42, 3, &fnonce);
        let r = Repr {
            kind: Kind::AuthData,
            flags: Flags(6),
            pass: 2,
            job_id: 7,
            tensor_id: 42,
            round: 3,
            offset: 0x1122_3344_5566_7788,
            seq: 0x0102_0304,
            length: 5,
            layer: 9,
        };
        let mut d = vec![0u8; r.buffer_len()];
        r.emit(&mut header::Packet::new_unchecked(&mut d[..]))
            .expect("emit");
        d[HEADER_LEN..HEADER_LEN + 5].copy_from_slice(b"grads");
        key.seal(&mut d).expect("seal");
        let want = hex(
            "01020602000000070000002a0000000311223344556677880102030400050009421642cf3cae8d935498a1\
             f1dae80251b7d0f793b0",
        );
        assert_eq!(d, want);
        let mut scratch = Vec::new();
        assert_eq!(key.open(&want, &mut scratch), Ok(&b"grads"[..]));
    }

    #[test]
    fn secret_length_limits() {
        assert_eq!(
            JobSecret::new(vec![1; 15]).unwrap_err(),
            AuthError::SecretTooShort { len: 15 }
        );
        assert_eq!(
            JobSecret::new(Vec::new()).unwrap_err(),
            AuthError::SecretTooShort { len: 0 }
        );
        assert!(JobSecret::new(vec![1; MIN_SECRET_LEN]).is_ok());
        assert!(JobSecret::new(vec![1; MAX_SECRET_LEN]).is_ok());
        assert_eq!(
            JobSecret::new(vec![1; MAX_SECRET_LEN + 1]).unwrap_err(),
            AuthError::SecretTooLong { len: 4097 }
        );
        let msg = AuthError::SecretTooShort { len: 5 }.to_string();
        assert!(msg.contains("5 bytes") && msg.contains("at least 16") && msg.contains("urandom"));
        // Exact bytes: a trailing newline is part of the secret, so it changes the key.
        let a = JobKey::new(&JobSecret::new(b"0123456789abcdef".to_vec()).expect("16"));
        let b = JobKey::new(&JobSecret::new(b"0123456789abcdef\n".to_vec()).expect("17"));
        assert_ne!(a.server_proof(&T), b.server_proof(&T));
    }

    #[test]
    fn debug_never_prints_key_material() {
        let s = JobSecret::new(vec![0xab; 20]).expect("secret");
        assert_eq!(format!("{s:?}"), "JobSecret(<redacted>, 20 bytes)");
        let jk = JobKey::new(&s);
        let session = jk.session(&T, &SHARED);
        let (sealer, opener) = session.control(Role::Client);
        for text in [
            format!("{jk:?}"),
            format!("{session:?}"),
            format!("{sealer:?}"),
            format!("{opener:?}"),
            format!("{:?}", flow_key()),
        ] {
            assert!(text.contains("<redacted>"), "{text}");
            assert!(!text.contains("ab") && !text.contains("171"), "{text}");
        }
    }

    #[test]
    fn keys_are_shareable_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<JobKey>();
        send_sync::<SessionKeys>();
        send_sync::<FlowKey>();
        send_sync::<CtrlSealer>();
        send_sync::<CtrlOpener>();
    }

    #[test]
    fn proofs_verify_and_do_not_cross() {
        let jk = JobKey::new(&secret(1));
        let sp = jk.server_proof(&T);
        let cp = jk.client_proof(&T);
        assert_ne!(sp, cp);
        assert!(jk.verify_server_proof(&T, &sp));
        assert!(jk.verify_client_proof(&T, &cp));
        // No reflection: one side's proof is not the other's.
        assert!(!jk.verify_client_proof(&T, &sp));
        assert!(!jk.verify_server_proof(&T, &cp));
        // Bound to every part of the transcript, in its role.
        let swapped = Transcript {
            client_nonce: NS,
            server_nonce: NC,
            ..T
        };
        assert!(!jk.verify_server_proof(&swapped, &sp));
        for other in [
            Transcript {
                client_nonce: [0x12; NONCE_LEN],
                ..T
            },
            Transcript {
                server_nonce: [0x23; NONCE_LEN],
                ..T
            },
            Transcript {
                client_public: [0x45; PUBLIC_LEN],
                ..T
            },
            Transcript {
                server_public: [0x56; PUBLIC_LEN],
                ..T
            },
        ] {
            assert!(!jk.verify_server_proof(&other, &sp));
            assert!(!jk.verify_client_proof(&other, &cp));
        }
        // Another secret, a truncated, extended or empty proof.
        let other = JobKey::new(&secret(2));
        assert!(!other.verify_server_proof(&T, &sp));
        assert_ne!(other.server_proof(&T), sp);
        assert!(!jk.verify_server_proof(&T, &sp[..16]));
        assert!(!jk.verify_server_proof(&T, &[sp.as_slice(), &[0]].concat()));
        assert!(!jk.verify_server_proof(&T, &[]));
        // Deterministic: the peer computes the same.
        assert_eq!(JobKey::new(&secret(1)).server_proof(&T), sp);
    }

    #[test]
    fn x25519_agreement_is_symmetric_and_refuses_low_order_points() {
        let rng = ring::rand::SystemRandom::new();
        let (a, b) = (
            Ephemeral::generate(&rng).expect("a"),
            Ephemeral::generate(&rng).expect("b"),
        );
        let (pa, pb) = (*a.public(), *b.public());
        assert_ne!(pa, pb);
        assert_eq!(*a.agree(&pb).expect("a"), *b.agree(&pa).expect("b"));
        let c = Ephemeral::generate(&rng).expect("c");
        assert!(format!("{c:?}").contains("<redacted>"));
        assert_eq!(
            c.agree(&[0; PUBLIC_LEN]).unwrap_err(),
            AuthError::BadPublicKey
        );
    }

    #[test]
    fn control_frames_in_sequence() {
        let jk = JobKey::new(&secret(1));
        let (mut client_tx, mut client_rx) = jk.session(&T, &SHARED).control(Role::Client);
        let (mut server_tx, mut server_rx) = jk.session(&T, &SHARED).control(Role::Server);
        let t0 = client_tx.seal(b"frame 0");
        let t1 = client_tx.seal(b"frame 1");
        let t2 = client_tx.seal(b"frame 2");
        assert_ne!(
            t0,
            client_tx.seal(b"frame 0"),
            "same frame, next seq, other tag"
        );
        // Reordered: frame 1 before frame 0 fails, and does not advance the sequence.
        assert!(!server_rx.open(b"frame 1", &t1));
        assert!(server_rx.open(b"frame 0", &t0));
        // Replayed.
        assert!(!server_rx.open(b"frame 0", &t0));
        // Tampered frame, tampered tag, truncated tag.
        assert!(!server_rx.open(b"frame 2", &t1));
        let mut bad = t1;
        bad[15] ^= 1;
        assert!(!server_rx.open(b"frame 1", &bad));
        assert!(!server_rx.open(b"frame 1", &t1[..15]));
        assert!(server_rx.open(b"frame 1", &t1));
        assert!(server_rx.open(b"frame 2", &t2));
        // The other direction has its own key and sequence; a reflected frame fails.
        let s0 = server_tx.seal(b"frame 0");
        assert_ne!(s0, t0);
        assert!(!client_rx.open(b"frame 0", &t0));
        assert!(client_rx.open(b"frame 0", &s0));
        // Another session (other nonces) does not accept this session's frames.
        let (_, mut other_rx) = jk.session(&T, &[0x67; 32]).control(Role::Server);
        assert!(!other_rx.open(b"frame 0", &t0));
    }

    #[test]
    fn different_inputs_different_keys() {
        let jk = JobKey::new(&secret(1));
        let base = sealed(&flow_key(), 1, b"the same payload");
        let session = jk.session(&T, &SHARED);
        let variants = [
            session.flow_key(8, 42, 3, &FLOW_NONCE),
            session.flow_key(7, 43, 3, &FLOW_NONCE),
            session.flow_key(7, 42, 4, &FLOW_NONCE),
            session.flow_key(7, 42, 3, &[0x34; FLOW_NONCE_LEN]),
            jk.session(
                &Transcript {
                    client_nonce: [0x12; NONCE_LEN],
                    ..T
                },
                &SHARED,
            )
            .flow_key(7, 42, 3, &FLOW_NONCE),
            jk.session(
                &Transcript {
                    server_public: [0x56; PUBLIC_LEN],
                    ..T
                },
                &SHARED,
            )
            .flow_key(7, 42, 3, &FLOW_NONCE),
            // Same job and transcript, another X25519 secret: a job member that saw the
            // handshake but not the private keys derives another key.
            jk.session(&T, &[0x67; 32]).flow_key(7, 42, 3, &FLOW_NONCE),
            JobKey::new(&secret(2))
                .session(&T, &SHARED)
                .flow_key(7, 42, 3, &FLOW_NONCE),
        ];
        let mut scratch = Vec::new();
        let mut seen = vec![base[HEADER_LEN..].to_vec()];
        for k in &variants {
            // The same datagram sealed under another key: other ciphertext and tag, and the
            // original does not open under it (a replay into another flow, round or session).
            let d = sealed(k, 1, b"the same payload");
            assert_eq!(d[..HEADER_LEN], base[..HEADER_LEN]);
            assert!(!seen.contains(&d[HEADER_LEN..].to_vec()));
            seen.push(d[HEADER_LEN..].to_vec());
            assert_eq!(k.open(&base, &mut scratch), Err(AuthError::BadTag));
            assert!(scratch.is_empty());
        }
        // Deterministic on both ends.
        assert_eq!(sealed(&flow_key(), 1, b"the same payload"), base);
        // The schedule's labels are distinct.
        let labels = [
            label::JOB_SALT,
            label::HANDSHAKE,
            label::SERVER_PROOF,
            label::CLIENT_PROOF,
            label::SESSION,
            label::CTRL_C2S,
            label::CTRL_S2C,
            label::DATA,
        ];
        for (i, a) in labels.iter().enumerate() {
            assert!(labels[i + 1..].iter().all(|b| a != b));
        }
    }

    #[test]
    fn seal_open_round_trip_and_nonce() {
        let key = flow_key();
        let mut scratch = Vec::new();
        let d = sealed(&key, 9, b"gradients");
        assert_ne!(
            &d[HEADER_LEN..HEADER_LEN + 9],
            b"gradients",
            "payload is encrypted"
        );
        let p = header::Packet::new_checked(&d[..]).expect("sealed datagram parses");
        assert_eq!(p.payload().len(), 9);
        assert_eq!(p.tag().len(), TAG_LEN);
        assert_eq!(key.open(&d, &mut scratch), Ok(&b"gradients"[..]));
        // seq and pass make the nonce: same payload, other seq or pass, other ciphertext.
        let other_seq = sealed(&key, 10, b"gradients");
        let mut other_pass = datagram(9, 1, b"gradients");
        key.seal(&mut other_pass).expect("seal");
        assert_ne!(d[HEADER_LEN..], other_seq[HEADER_LEN..]);
        assert_ne!(d[HEADER_LEN..], other_pass[HEADER_LEN..]);
        // Scratch is reused: no growth after the first datagram of the largest size.
        let big = sealed(&key, 11, &[7u8; 1440]);
        assert_eq!(key.open(&big, &mut scratch).map(<[u8]>::len), Ok(1440));
        let cap = scratch.capacity();
        for seq in 12..20 {
            let d = sealed(&key, seq, &[seq as u8; 1440]);
            assert_eq!(key.open(&d, &mut scratch), Ok(&[seq as u8; 1440][..]));
        }
        assert_eq!(scratch.capacity(), cap);
    }

    #[test]
    fn plain_and_malformed_datagrams_are_refused() {
        let key = flow_key();
        let mut scratch = vec![1, 2, 3];
        // A plain Data datagram of the same flow.
        let r = repr(Kind::Data, 1, 0, 4);
        let mut plain = vec![0u8; r.buffer_len()];
        r.emit(&mut header::Packet::new_unchecked(&mut plain[..]))
            .expect("emit");
        assert_eq!(
            key.open(&plain, &mut scratch),
            Err(AuthError::Unauthenticated)
        );
        assert!(scratch.is_empty());
        assert_eq!(key.seal(&mut plain.clone()), Err(AuthError::NotAuthData));
        // The sealed datagram relabelled as Data is trailing bytes; cut to look like Data, it
        // is Unauthenticated, never placed.
        let d = sealed(&key, 1, b"abcd");
        let mut relabelled = d.clone();
        relabelled[1] = Kind::Data as u8;
        assert_eq!(
            key.open(&relabelled, &mut scratch),
            Err(AuthError::Malformed(wire::Error::LengthMismatch))
        );
        assert_eq!(
            key.open(&relabelled[..HEADER_LEN + 4], &mut scratch),
            Err(AuthError::Unauthenticated)
        );
        // Truncated (tag missing or cut), trailing bytes, bad version, unknown kind.
        for n in [0, 31, HEADER_LEN, HEADER_LEN + 4, d.len() - 1] {
            assert_eq!(
                key.open(&d[..n], &mut scratch),
                Err(AuthError::Malformed(wire::Error::Truncated)),
                "{n} bytes"
            );
        }
        let mut long = d.clone();
        long.push(0);
        assert_eq!(
            key.open(&long, &mut scratch),
            Err(AuthError::Malformed(wire::Error::LengthMismatch))
        );
        let mut v = d.clone();
        v[0] = 2;
        assert_eq!(
            key.open(&v, &mut scratch),
            Err(AuthError::Malformed(wire::Error::BadVersion))
        );
        // seal: no room for the tag, or trailing bytes; the datagram is left unchanged.
        let mut no_room = datagram(1, 0, b"abcd");
        no_room.truncate(HEADER_LEN + 4);
        let before = no_room.clone();
        assert_eq!(
            key.seal(&mut no_room),
            Err(AuthError::Malformed(wire::Error::Truncated))
        );
        assert_eq!(no_room, before);
        let mut extra = datagram(1, 0, b"abcd");
        extra.push(0);
        assert_eq!(
            key.seal(&mut extra),
            Err(AuthError::Malformed(wire::Error::LengthMismatch))
        );
    }

    prop_compose! {
        fn any_auth_datagram(max_len: usize)(
            flags in any::<u8>(), pass in any::<u8>(), job_id in any::<u32>(),
            tensor_id in any::<u32>(), round in any::<u32>(), offset in any::<u64>(),
            seq in any::<u32>(), layer in any::<u16>(),
            payload in proptest::collection::vec(any::<u8>(), 0..=max_len),
        ) -> (Vec<u8>, Vec<u8>) {
            let r = Repr { kind: Kind::AuthData, flags: Flags(flags), pass, job_id, tensor_id,
                           round, offset, seq, length: payload.len() as u16, layer };
            let mut d = vec![0u8; r.buffer_len()];
            r.emit(&mut header::Packet::new_unchecked(&mut d[..])).expect("emit");
            d[HEADER_LEN..HEADER_LEN + payload.len()].copy_from_slice(&payload);
            (d, payload)
        }
    }

    proptest! {
        #[test]
        fn seal_open_round_trip((mut d, payload) in any_auth_datagram(1440)) {
            let key = flow_key();
            let hdr = d[..HEADER_LEN].to_vec();
            key.seal(&mut d).expect("seal");
            prop_assert_eq!(&d[..HEADER_LEN], &hdr[..], "header untouched");
            prop_assert_eq!(d.len(), HEADER_LEN + payload.len() + TAG_LEN);
            let mut scratch = Vec::new();
            prop_assert_eq!(key.open(&d, &mut scratch), Ok(&payload[..]));
            let repr = Repr::parse(&header::Packet::new_checked(&d[..]).expect("parses"))
                .expect("parses");
            prop_assert_eq!(usize::from(repr.length), payload.len());
        }

        #[test]
        fn any_bit_flip_fails((mut d, _) in any_auth_datagram(1440), bit in any::<usize>()) {
            let key = flow_key();
            key.seal(&mut d).expect("seal");
            // Header, payload or tag: every bit is covered.
            let bit = bit % (d.len() * 8);
            d[bit / 8] ^= 1 << (bit % 8);
            let mut scratch = Vec::new();
            prop_assert!(key.open(&d, &mut scratch).is_err(), "bit {} accepted", bit);
            prop_assert!(scratch.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_open(buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            let key = flow_key();
            let mut scratch = Vec::new();
            prop_assert!(key.open(&buf, &mut scratch).is_err());
            let mut copy = buf.clone();
            if key.seal(&mut copy).is_ok() {
                prop_assert_eq!(
                    key.open(&copy, &mut scratch).map(<[u8]>::to_vec),
                    Ok(buf[HEADER_LEN..buf.len() - TAG_LEN].to_vec())
                );
            }
        }
    }
}
