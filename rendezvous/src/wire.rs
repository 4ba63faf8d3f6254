//! The rendezvous frames, encoded and decoded without I/O.
//!
//! Every frame is a 10-byte header, `magic "GWRV" | version u8 = 1 | kind u8 | body length
//! u32`, and a body (all integers big-endian):
//!
//! | kind | frame  | body                                                              |
//! |------|--------|-------------------------------------------------------------------|
//! | 1    | Join   | job u32, rank u32, world u32, payload (u32 length + bytes)         |
//! | 2    | Table  | job u32, world u32, `world` times a payload (u32 length + bytes)   |
//! | 3    | Refuse | reason (u16 length + at most 256 bytes of UTF-8)                  |
//! | 4    | Hello  | nonce (32 bytes), X25519 public key (32 bytes): an authenticated join's opening |
//! | 5    | Challenge | nonce (32 bytes), X25519 public key (32 bytes): rank 0's answer to a Hello |
//! | 6    | Sealed | proof (32 bytes), one Join or Table frame, tag (16 bytes)          |
//!
//! An authenticated job (a job secret) opens with Hello and Challenge; the joining rank's
//! `Sealed` carries its Join with its proof of the secret over both nonces and keys, rank
//! 0's carries the Table with its own proof, and each inner frame is tagged with the
//! connection's key of its direction (`crate::auth`).
//!
//! The body length lets a reader take exactly one frame off a stream, bounded before
//! anything is read; the decoders check it against the fields, so a frame has exactly one
//! encoding. Decoders take one whole frame and never panic.

use crate::MAX_RANKS;

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GWRV";
/// The one version spoken.
pub const VERSION: u8 = 1;
/// Magic, version, kind, body length.
pub const HEADER_LEN: usize = 10;
/// Longest refusal reason, in bytes.
pub const MAX_REASON: usize = 256;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A rank's payload, to rank 0.
    Join = 1,
    /// All payloads, from rank 0.
    Table = 2,
    /// Rank 0's refusal of a join.
    Refuse = 3,
    /// An authenticated join's opening: the joiner's nonce and ephemeral key.
    Hello = 4,
    /// Rank 0's answer to a Hello: its nonce and ephemeral key.
    Challenge = 5,
    /// A proof of the job secret, one Join or Table frame, and its tag.
    Sealed = 6,
}

/// Bytes of a Hello's or a Challenge's body: a nonce and an X25519 public key.
pub const GREETING_LEN: usize = 64;
/// Bytes of a proof of the job secret.
pub const PROOF_LEN: usize = 32;
/// Bytes of a Sealed frame's tag.
pub const TAG_LEN: usize = 16;

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::Join),
            2 => Some(Kind::Table),
            3 => Some(Kind::Refuse),
            4 => Some(Kind::Hello),
            5 => Some(Kind::Challenge),
            6 => Some(Kind::Sealed),
            _ => None,
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame kind.
    pub kind: Kind,
    /// Bytes after the header (within the kind's bound).
    pub body_len: usize,
}

/// A rank's join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Join {
    /// Job id.
    pub job: u32,
    /// The joining rank, `< world`.
    pub rank: u32,
    /// World size, `1..=MAX_RANKS`.
    pub world: u32,
    /// The rank's payload.
    pub payload: Vec<u8>,
}

/// Everyone's payloads, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Job id.
    pub job: u32,
    /// One payload per rank (`1..=MAX_RANKS` of them).
    pub payloads: Vec<Vec<u8>>,
}

/// Rank 0's refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refuse {
    /// Why (at most [`MAX_REASON`] bytes on the wire; longer reasons are cut).
    pub reason: String,
}

/// Any frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// See [`Join`].
    Join(Join),
    /// See [`Table`].
    Table(Table),
    /// See [`Refuse`].
    Refuse(Refuse),
    /// A nonce and an X25519 public key ([`Kind::Hello`] or [`Kind::Challenge`]).
    Greeting(Kind, Greeting),
    /// See [`Sealed`].
    Sealed(Sealed),
}

/// A Hello's or a Challenge's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    /// A fresh random nonce.
    pub nonce: [u8; 32],
    /// A fresh ephemeral X25519 public key.
    pub public: [u8; 32],
}

/// A frame of an authenticated job: a proof, an inner frame, its tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// The sender's proof of the job secret over the connection's transcript.
    pub proof: [u8; PROOF_LEN],
    /// One whole Join or Table frame.
    pub inner: Vec<u8>,
    /// The inner frame's tag under the connection's key of the sender's direction.
    pub tag: [u8; TAG_LEN],
}

/// What is wrong with a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the frame needs.
    #[error("truncated frame: {need} bytes needed, {have} present")]
    Truncated {
        /// Bytes needed (at least).
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// More bytes than the header's length.
    #[error("{0} bytes after the end of the frame")]
    Trailing(usize),
    /// Not our magic.
    #[error("not a gradwire rendezvous frame (starts with {0:02x?})")]
    BadMagic([u8; 4]),
    /// Another version.
    #[error("rendezvous version {0} is not supported (this side speaks {VERSION}): run the same gradwire version on every rank")]
    Version(u8),
    /// Unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A valid frame of the wrong kind.
    #[error("expected a {expected:?} frame, got a {got:?}")]
    WrongKind {
        /// Wanted.
        expected: Kind,
        /// Got.
        got: Kind,
    },
    /// A length beyond its bound.
    #[error("{what} of {len} bytes exceeds the limit of {max} (max_payload must be the same on every rank)")]
    TooLarge {
        /// What.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The bound.
        max: u64,
    },
    /// The header's body length does not match the fields.
    #[error("body length {body_len} does not match the frame's fields")]
    BodyLength {
        /// The header's body length.
        body_len: usize,
    },
    /// A field out of range.
    #[error("{field} {value} is out of range ({why})")]
    Field {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The rule.
        why: &'static str,
    },
    /// The refusal reason is not UTF-8.
    #[error("refusal reason is not UTF-8")]
    Utf8,
}

/// Largest body of a `Table` of `world` payloads of up to `max_payload` bytes.
pub fn table_body_limit(world: usize, max_payload: usize) -> u64 {
    (world as u64)
        .saturating_mul((max_payload as u64).saturating_add(4))
        .saturating_add(8)
}

fn body_limit(kind: Kind, max_payload: usize) -> u64 {
    match kind {
        Kind::Join => (max_payload as u64).saturating_add(16),
        Kind::Table => table_body_limit(MAX_RANKS, max_payload),
        Kind::Refuse => 2 + MAX_REASON as u64,
        Kind::Hello | Kind::Challenge => GREETING_LEN as u64,
        Kind::Sealed => body_limit(Kind::Table, max_payload)
            .saturating_add((HEADER_LEN + PROOF_LEN + TAG_LEN) as u64),
    }
}

/// Magic, version and kind of the header at the start of `buf`, and its body length.
fn raw_header(buf: &[u8]) -> Result<(Kind, u32), WireError> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Err(WireError::Truncated {
            need: HEADER_LEN,
            have: buf.len(),
        });
    };
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if h[4] != VERSION {
        return Err(WireError::Version(h[4]));
    }
    let kind = Kind::from_u8(h[5]).ok_or(WireError::UnknownKind(h[5]))?;
    Ok((kind, u32::from_be_bytes([h[6], h[7], h[8], h[9]])))
}

/// The body length, if within the kind's bound for `max_payload`.
fn bounded(kind: Kind, len: u32, max_payload: usize) -> Result<usize, WireError> {
    let max = body_limit(kind, max_payload);
    if u64::from(len) > max {
        return Err(WireError::TooLarge {
            what: "frame body",
            len: u64::from(len),
            max,
        });
    }
    usize::try_from(len).map_err(|_| WireError::TooLarge {
        what: "frame body",
        len: u64::from(len),
        max: usize::MAX as u64,
    })
}

/// Decodes the header at the start of `buf` (which may hold more), checking the body
/// length against the kind's bound for `max_payload`.
pub fn decode_header(buf: &[u8], max_payload: usize) -> Result<Header, WireError> {
    let (kind, len) = raw_header(buf)?;
    let body_len = bounded(kind, len, max_payload)?;
    Ok(Header { kind, body_len })
}

/// Checks the header (the kind first, so a frame of another kind is reported as such
/// whatever its length) and that `frame` is exactly one frame; returns the body.
fn split(frame: &[u8], expected: Kind, max_payload: usize) -> Result<&[u8], WireError> {
    let (kind, len) = raw_header(frame)?;
    expect(kind, expected)?;
    let total = HEADER_LEN + bounded(kind, len, max_payload)?;
    if frame.len() < total {
        return Err(WireError::Truncated {
            need: total,
            have: frame.len(),
        });
    }
    if frame.len() > total {
        return Err(WireError::Trailing(frame.len() - total));
    }
    Ok(&frame[HEADER_LEN..])
}

fn expect(kind: Kind, expected: Kind) -> Result<(), WireError> {
    if kind == expected {
        Ok(())
    } else {
        Err(WireError::WrongKind {
            expected,
            got: kind,
        })
    }
}

/// Reads fields off a body; running short means the body length lied.
struct Body<'a> {
    rest: &'a [u8],
    body_len: usize,
}

impl<'a> Body<'a> {
    fn new(body: &'a [u8]) -> Body<'a> {
        Body {
            rest: body,
            body_len: body.len(),
        }
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let Some((head, tail)) = self.rest.split_at_checked(n) else {
            return Err(WireError::BodyLength {
                body_len: self.body_len,
            });
        };
        self.rest = tail;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.bytes(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.bytes(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn payload(&mut self, max_payload: usize) -> Result<&'a [u8], WireError> {
        let len = self.u32()?;
        if u64::from(len) > max_payload as u64 {
            return Err(WireError::TooLarge {
                what: "payload",
                len: u64::from(len),
                max: max_payload as u64,
            });
        }
        // len <= max_payload, a usize.
        self.bytes(len as usize)
    }

    fn end(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError::BodyLength {
                body_len: self.body_len,
            })
        }
    }
}

fn world_ok(world: u32) -> Result<(), WireError> {
    if world == 0 || world as usize > MAX_RANKS {
        return Err(WireError::Field {
            field: "world size",
            value: u64::from(world),
            why: "must be 1..=4096",
        });
    }
    Ok(())
}

fn rank_ok(rank: u32, world: u32) -> Result<(), WireError> {
    if rank >= world {
        return Err(WireError::Field {
            field: "rank",
            value: u64::from(rank),
            why: "must be below the world size",
        });
    }
    Ok(())
}

fn len_u32(what: &'static str, n: usize) -> Result<u32, WireError> {
    u32::try_from(n).map_err(|_| WireError::TooLarge {
        what,
        len: n as u64,
        max: u64::from(u32::MAX),
    })
}

fn frame(kind: Kind, body: Vec<u8>) -> Result<Vec<u8>, WireError> {
    let len = len_u32("frame body", body.len())?;
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(kind as u8);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Encodes a join (world `1..=MAX_RANKS`, rank below it, payload length fits u32).
pub fn encode_join(j: &Join) -> Result<Vec<u8>, WireError> {
    world_ok(j.world)?;
    rank_ok(j.rank, j.world)?;
    let len = len_u32("payload", j.payload.len())?;
    let mut body = Vec::with_capacity(16 + j.payload.len());
    body.extend_from_slice(&j.job.to_be_bytes());
    body.extend_from_slice(&j.rank.to_be_bytes());
    body.extend_from_slice(&j.world.to_be_bytes());
    body.extend_from_slice(&len.to_be_bytes());
    body.extend_from_slice(&j.payload);
    frame(Kind::Join, body)
}

/// Decodes one whole join frame with payload at most `max_payload`.
pub fn decode_join(frame: &[u8], max_payload: usize) -> Result<Join, WireError> {
    let body = split(frame, Kind::Join, max_payload)?;
    let mut b = Body::new(body);
    let job = b.u32()?;
    let rank = b.u32()?;
    let world = b.u32()?;
    world_ok(world)?;
    rank_ok(rank, world)?;
    let payload = b.payload(max_payload)?.to_vec();
    b.end()?;
    Ok(Join {
        job,
        rank,
        world,
        payload,
    })
}

/// Encodes a table (`1..=MAX_RANKS` payloads, total fits the u32 body length).
pub fn encode_table(t: &Table) -> Result<Vec<u8>, WireError> {
    let world = len_u32("world size", t.payloads.len())?;
    world_ok(world)?;
    let size: usize = t.payloads.iter().map(|p| 4 + p.len()).sum();
    let mut body = Vec::with_capacity(8usize.saturating_add(size));
    body.extend_from_slice(&t.job.to_be_bytes());
    body.extend_from_slice(&world.to_be_bytes());
    for p in &t.payloads {
        body.extend_from_slice(&len_u32("payload", p.len())?.to_be_bytes());
        body.extend_from_slice(p);
    }
    frame(Kind::Table, body)
}

/// Decodes one whole table frame with payloads at most `max_payload` each.
pub fn decode_table(frame: &[u8], max_payload: usize) -> Result<Table, WireError> {
    let body = split(frame, Kind::Table, max_payload)?;
    let mut b = Body::new(body);
    let job = b.u32()?;
    let world = b.u32()?;
    world_ok(world)?;
    let mut payloads = Vec::with_capacity(world as usize);
    for _ in 0..world {
        payloads.push(b.payload(max_payload)?.to_vec());
    }
    b.end()?;
    Ok(Table { job, payloads })
}

/// Encodes a refusal, cutting the reason to [`MAX_REASON`] bytes at a character
/// boundary.
pub fn encode_refuse(r: &Refuse) -> Vec<u8> {
    let mut end = r.reason.len().min(MAX_REASON);
    while !r.reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = &r.reason.as_bytes()[..end];
    let mut body = Vec::with_capacity(2 + reason.len());
    // end <= 256.
    body.extend_from_slice(&(end as u16).to_be_bytes());
    body.extend_from_slice(reason);
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(Kind::Refuse as u8);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decodes one whole refusal frame.
pub fn decode_refuse(frame: &[u8]) -> Result<Refuse, WireError> {
    let body = split(frame, Kind::Refuse, 0)?;
    let mut b = Body::new(body);
    let len = b.u16()?;
    if usize::from(len) > MAX_REASON {
        return Err(WireError::TooLarge {
            what: "refusal reason",
            len: u64::from(len),
            max: MAX_REASON as u64,
        });
    }
    let bytes = b.bytes(usize::from(len))?;
    b.end()?;
    let reason = std::str::from_utf8(bytes).map_err(|_| WireError::Utf8)?;
    Ok(Refuse {
        reason: reason.to_owned(),
    })
}

/// Encodes a Hello or a Challenge.
pub fn encode_greeting(kind: Kind, g: &Greeting) -> Result<Vec<u8>, WireError> {
    if !matches!(kind, Kind::Hello | Kind::Challenge) {
        return Err(WireError::WrongKind {
            expected: Kind::Hello,
            got: kind,
        });
    }
    frame(kind, [g.nonce, g.public].concat())
}

/// Decodes one whole Hello or Challenge frame of kind `kind`.
pub fn decode_greeting(frame: &[u8], kind: Kind) -> Result<Greeting, WireError> {
    let body = split(frame, kind, 0)?;
    let mut b = Body::new(body);
    let mut g = Greeting {
        nonce: [0; 32],
        public: [0; 32],
    };
    g.nonce.copy_from_slice(b.bytes(32)?);
    g.public.copy_from_slice(b.bytes(32)?);
    b.end()?;
    Ok(g)
}

/// Encodes a Sealed frame.
pub fn encode_sealed(s: &Sealed) -> Result<Vec<u8>, WireError> {
    frame(
        Kind::Sealed,
        [&s.proof[..], &s.inner[..], &s.tag[..]].concat(),
    )
}

/// Decodes one whole Sealed frame whose inner frame is a Join or a Table (checked as a
/// frame, not decoded: it is decoded once its tag verified).
pub fn decode_sealed(frame: &[u8], max_payload: usize) -> Result<Sealed, WireError> {
    let body = split(frame, Kind::Sealed, max_payload)?;
    let body_len = body.len();
    let short = || WireError::BodyLength { body_len };
    let inner_len = body_len
        .checked_sub(PROOF_LEN + TAG_LEN)
        .ok_or_else(short)?;
    let mut b = Body::new(body);
    let mut s = Sealed {
        proof: [0; PROOF_LEN],
        inner: Vec::new(),
        tag: [0; TAG_LEN],
    };
    s.proof.copy_from_slice(b.bytes(PROOF_LEN)?);
    let inner = b.bytes(inner_len)?;
    let h = decode_header(inner, max_payload)?;
    if !matches!(h.kind, Kind::Join | Kind::Table) {
        return Err(WireError::WrongKind {
            expected: Kind::Join,
            got: h.kind,
        });
    }
    if HEADER_LEN + h.body_len != inner.len() {
        return Err(short());
    }
    s.inner = inner.to_vec();
    s.tag.copy_from_slice(b.bytes(TAG_LEN)?);
    b.end()?;
    Ok(s)
}

/// Decodes one whole frame of any kind.
pub fn decode(frame: &[u8], max_payload: usize) -> Result<Frame, WireError> {
    match raw_header(frame)?.0 {
        Kind::Join => decode_join(frame, max_payload).map(Frame::Join),
        Kind::Table => decode_table(frame, max_payload).map(Frame::Table),
        Kind::Refuse => decode_refuse(frame).map(Frame::Refuse),
        k @ (Kind::Hello | Kind::Challenge) => {
            decode_greeting(frame, k).map(|g| Frame::Greeting(k, g))
        }
        Kind::Sealed => decode_sealed(frame, max_payload).map(Frame::Sealed),
    }
}
