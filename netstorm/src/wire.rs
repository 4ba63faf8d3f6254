//! NetStorm's messages on gradwire's connections: link reports and topology requests (node →
//! scheduler), policy updates and confirmations (scheduler → node), and the metadata of every
//! model chunk (node → node).
//!
//! Every message is one self-delimiting frame, big-endian:
//!
//! ```text
//! off size field
//! 0   4    magic      "GWNS"
//! 4   1    version    VERSION (1); anything else is rejected
//! 5   1    kind       1 LinkReport, 2 TopologyRequest, 3 PolicyUpdate, 4 PolicyConfirm,
//!                     5 Chunk (a ChunkHeader)
//! 6   4    body_len   bytes after the header, at most Kind::max_body (checked before
//!                     anything is read or allocated)
//! 10  ..   body       exactly body_len bytes, laid out per kind below
//! ```
//!
//! Bodies:
//!
//! ```text
//! LinkReport       from u16, to u16, throughput_bps u64, samples u16 (>= 1),
//!                  measured_at_round u32                                       (18 bytes)
//! TopologyRequest  node u16, version u32 (held; 0 = none yet), round u32         (10 bytes)
//! PolicyConfirm    version u32 (>= 1), round u32                                  (8 bytes)
//! PolicyUpdate     version u32 (>= 1), round u32, policy:
//!   nodes u8 (1..=64), trees u8,
//!   per tree (roots strictly increasing): root u16, share u32,
//!       parent u16 x nodes (0xFFFF = none: the root's own entry),
//!   aux_edges u16,
//!   per edge ((from, to) strictly increasing, a child -> parent edge of some tree):
//!       from u16, to u16, paths u8 (1..=63), per path: len u8 (2..=64), node u16 x len
//! Chunk            version u32 (>= 1), round u32, root u16, chunk u32,
//!                  flags u8 (bit 0 IS_AUX, bit 1 PULL; others zero), hop u8,
//!                  path_len u8, path u16 x path_len                    (17 + 2 x path_len)
//! ```
//!
//! Parsing is strict so that every accepted frame is canonical (re-emitting it gives the same
//! bytes): unknown flag bits, unordered or repeated roots and edges, a `0xFFFF` parent that is
//! not the root's, and trailing bytes are all errors. A policy is checked as it is parsed:
//! every parent vector is a tree spanning all nodes with exactly one root, its own; every
//! auxiliary path runs from its edge's child to its parent without repeating a node.
//!
//! # Where the chunk header goes
//!
//! The runtime (`gradwire-wan`'s chunk channels) sends each chunk as two flows on the link
//! between the two nodes: a small reliable *meta* flow whose caller metadata is the
//! [`ChunkHeader`] frame, then the data flow with the values. A node forwarding an
//! auxiliary chunk re-emits the header with the next `hop` (a few dozen bytes) ahead of the
//! same values. The frame's own length field makes the header self-delimiting although the
//! path varies in length, so a transport that carries metadata and data in one message can
//! prepend the frame to the payload instead ([`ChunkHeader::split`] separates them).
//!
//! # Auxiliary chunks (§VII-B)
//!
//! With IS_AUX set, `path` is the full node sequence chosen by the chunk's source
//! (`path[0]`) and `hop` is the index in `path` of the node this copy is sent **to**
//! (`1..path.len()`): that node forwards it to `path[hop + 1]` with `hop + 1`, whatever its
//! own policy says, and the last node consumes it as if it had come from `path[0]` directly.
//! Without IS_AUX, `path` is empty and `hop` is 0.

use thiserror::Error;

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GWNS";
/// The one version spoken.
pub const VERSION: u8 = 1;
/// Magic, version, kind and body length.
pub const HEADER_LEN: usize = 10;
/// Most nodes a policy describes; node ids are below this in every message.
pub const MAX_NODES: usize = 64;
/// Most nodes on an auxiliary path (a simple path never has more than the nodes).
pub const MAX_PATH_LEN: usize = 64;
/// Most auxiliary paths per edge: edge-disjoint paths between two nodes of a simple graph
/// number at most `MAX_NODES - 1`.
pub const MAX_AUX_PATHS_PER_EDGE: usize = MAX_NODES - 1;
/// Largest encoded policy. One without auxiliary paths takes at most 8,580 bytes; the rest is
/// room for auxiliary paths. A scheduler whose policy is larger must keep fewer of them.
pub const MAX_POLICY_LEN: usize = 1 << 20;
/// The parent entry of a tree's root on the wire.
pub const NO_PARENT: u16 = 0xFFFF;
/// The version a node holds before its first policy.
pub const NO_VERSION: u32 = 0;

/// Field offsets of the frame header.
pub mod field {
    use core::ops::Range;
    /// Magic.
    pub const MAGIC: Range<usize> = 0..4;
    /// Version.
    pub const VERSION: usize = 4;
    /// Kind.
    pub const KIND: usize = 5;
    /// Body length.
    pub const BODY_LEN: Range<usize> = 6..10;
    /// Start of the body.
    pub const BODY: usize = 10;
}

const LINK_REPORT_LEN: usize = 18;
const TOPOLOGY_REQUEST_LEN: usize = 10;
const POLICY_CONFIRM_LEN: usize = 8;
const CHUNK_FIXED_LEN: usize = 17;
const FLAG_AUX: u8 = 1 << 0;
const FLAG_PULL: u8 = 1 << 1;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Kind {
    /// [`LinkReport`].
    LinkReport = 1,
    /// [`TopologyRequest`].
    TopologyRequest = 2,
    /// [`PolicyUpdate`].
    PolicyUpdate = 3,
    /// [`PolicyConfirm`].
    PolicyConfirm = 4,
    /// [`ChunkHeader`].
    Chunk = 5,
}

impl Kind {
    /// The kind of a kind byte.
    pub const fn from_u8(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::LinkReport),
            2 => Some(Kind::TopologyRequest),
            3 => Some(Kind::PolicyUpdate),
            4 => Some(Kind::PolicyConfirm),
            5 => Some(Kind::Chunk),
            _ => None,
        }
    }

    /// Largest body of this kind: a longer `body_len` is rejected from the header alone.
    pub const fn max_body(self) -> usize {
        match self {
            Kind::LinkReport => LINK_REPORT_LEN,
            Kind::TopologyRequest => TOPOLOGY_REQUEST_LEN,
            Kind::PolicyUpdate => 8 + MAX_POLICY_LEN,
            Kind::PolicyConfirm => POLICY_CONFIRM_LEN,
            Kind::Chunk => CHUNK_FIXED_LEN + 2 * MAX_PATH_LEN,
        }
    }
}

/// What is wrong with a frame or a message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    /// Fewer bytes than the frame needs.
    #[error("truncated NetStorm frame: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes needed (at least).
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// More bytes than the frame's length.
    #[error("{0} bytes after the end of the NetStorm frame")]
    Trailing(usize),
    /// Not our magic.
    #[error(
        "not a NetStorm frame (starts with {0:02x?}): is the peer a gradwire node of this job?"
    )]
    BadMagic([u8; 4]),
    /// Another version.
    #[error("NetStorm wire version {0} is not supported (this side speaks {VERSION}): run the same gradwire version on the scheduler and every node")]
    BadVersion(u8),
    /// Unknown kind byte.
    #[error("unknown NetStorm frame kind {0}")]
    UnknownKind(u8),
    /// A valid frame of another kind than the caller wanted.
    #[error("expected a {expected:?} frame, got a {got:?}")]
    WrongKind {
        /// Wanted.
        expected: Kind,
        /// Got.
        got: Kind,
    },
    /// A body (or a policy) beyond its bound.
    #[error("{kind:?} body of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// The frame's kind.
        kind: Kind,
        /// Its length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The header's body length does not match the body's fields.
    #[error("{kind:?} body length {body_len} does not match its fields")]
    BodyLength {
        /// The frame's kind.
        kind: Kind,
        /// The header's body length.
        body_len: usize,
    },
    /// The output buffer is too small for the message.
    #[error("buffer of {got} bytes is too small for a {needed}-byte message")]
    BufferTooSmall {
        /// Bytes the message takes.
        needed: usize,
        /// Bytes in the buffer.
        got: usize,
    },
    /// A field out of range.
    #[error("{field} {value} is out of range: {why}")]
    Field {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The rule it breaks.
        why: &'static str,
    },
    /// A parent vector that is not a tree rooted at its root.
    #[error("root {root}'s parents are not a tree rooted at {root}: node {node} {why}")]
    NotATree {
        /// The tree's root.
        root: u16,
        /// The offending node.
        node: u16,
        /// What is wrong.
        why: &'static str,
    },
    /// An auxiliary path that does not fit its edge.
    #[error("auxiliary path for edge {from} -> {to}: {why}")]
    BadPath {
        /// The edge's child.
        from: u16,
        /// The edge's parent.
        to: u16,
        /// What is wrong.
        why: &'static str,
    },
}

fn field(field: &'static str, value: impl Into<u64>, why: &'static str) -> WireError {
    WireError::Field {
        field,
        value: value.into(),
        why,
    }
}

/// A view of the frame at the start of a buffer (smoltcp style): field accessors over the
/// bytes, nothing copied.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps `buffer` without checking anything: accessors may panic on a short buffer.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps `buffer` after [`Packet::check_len`].
    pub fn new_checked(buffer: T) -> Result<Packet<T>, WireError> {
        let p = Packet::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// The buffer holds the header and the whole body the header announces (it may hold
    /// more: the next frame, or a chunk's payload).
    pub fn check_len(&self) -> Result<(), WireError> {
        let got = self.buffer.as_ref().len();
        if got < HEADER_LEN {
            return Err(WireError::Truncated {
                needed: HEADER_LEN,
                got,
            });
        }
        let needed = HEADER_LEN.saturating_add(self.body_len());
        if got < needed {
            return Err(WireError::Truncated { needed, got });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The magic bytes.
    pub fn magic(&self) -> [u8; 4] {
        let b = self.buffer.as_ref();
        [b[0], b[1], b[2], b[3]]
    }

    /// The version byte.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }

    /// The raw kind byte.
    pub fn kind_byte(&self) -> u8 {
        self.buffer.as_ref()[field::KIND]
    }

    /// The header's body length.
    pub fn body_len(&self) -> usize {
        let b = &self.buffer.as_ref()[field::BODY_LEN];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
    }

    /// The frame's total length: header and body.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN.saturating_add(self.body_len())
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.buffer.as_ref()[field::BODY..self.frame_len()]
    }
}

/// Checks the header at the start of `buf` (magic, version, kind, the body length within the
/// kind's bound) and returns the kind and the frame's total length. A reader of a byte stream
/// reads [`HEADER_LEN`] bytes, calls this, then reads the rest: nothing unbounded is read or
/// allocated.
pub fn frame_len(buf: &[u8]) -> Result<(Kind, usize), WireError> {
    if buf.len() < HEADER_LEN {
        return Err(WireError::Truncated {
            needed: HEADER_LEN,
            got: buf.len(),
        });
    }
    let p = Packet::new_unchecked(buf);
    if p.magic() != MAGIC {
        return Err(WireError::BadMagic(p.magic()));
    }
    if p.version() != VERSION {
        return Err(WireError::BadVersion(p.version()));
    }
    let kind = Kind::from_u8(p.kind_byte()).ok_or(WireError::UnknownKind(p.kind_byte()))?;
    let len = p.body_len();
    if len > kind.max_body() {
        return Err(WireError::TooLong {
            kind,
            len,
            max: kind.max_body(),
        });
    }
    Ok((kind, HEADER_LEN + len))
}

/// A cursor over a body whose length the header fixed: running out of bytes means the
/// fields and the body length disagree.
struct Reader<'a> {
    kind: Kind,
    body: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let s =
            self.body
                .get(self.pos..self.pos.saturating_add(n))
                .ok_or(WireError::BodyLength {
                    kind: self.kind,
                    body_len: self.body.len(),
                })?;
        self.pos += n;
        Ok(s)
    }
    fn remaining(&self) -> usize {
        self.body.len() - self.pos
    }
    /// `count` items of at least `min` bytes each fit in what is left: checked before a
    /// `Vec` of `count` is allocated.
    fn room_for(&self, count: usize, min: usize) -> Result<(), WireError> {
        if count.saturating_mul(min) > self.remaining() {
            return Err(WireError::BodyLength {
                kind: self.kind,
                body_len: self.body.len(),
            });
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    fn finish(&self) -> Result<(), WireError> {
        if self.pos != self.body.len() {
            return Err(WireError::BodyLength {
                kind: self.kind,
                body_len: self.body.len(),
            });
        }
        Ok(())
    }
}

/// Writes into a buffer whose length was checked against the message's length.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }
    fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }
    fn u16(&mut self, v: u16) {
        self.put(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_be_bytes());
    }
}

fn check_node(name: &'static str, node: u16, nodes: usize) -> Result<(), WireError> {
    if usize::from(node) >= nodes {
        return Err(field(name, node, "node ids are below the number of nodes"));
    }
    Ok(())
}

/// A message body: what [`Message`] and the per-type `parse`/`emit` share.
trait Body: Sized {
    const KIND: Kind;
    fn validate(&self) -> Result<(), WireError>;
    fn body_len(&self) -> usize;
    fn emit_body(&self, w: &mut Writer<'_>);
    fn parse_body(r: &mut Reader<'_>) -> Result<Self, WireError>;
}

/// Writes `m`'s frame at the start of `buf`: checks `m` first (what `parse` would reject is
/// not written) and that `buf` can hold it.
fn emit_frame<B: Body>(m: &B, buf: &mut [u8]) -> Result<usize, WireError> {
    m.validate()?;
    let body_len = m.body_len();
    let kind = B::KIND;
    if body_len > kind.max_body() {
        return Err(WireError::TooLong {
            kind,
            len: body_len,
            max: kind.max_body(),
        });
    }
    let needed = HEADER_LEN + body_len;
    if buf.len() < needed {
        return Err(WireError::BufferTooSmall {
            needed,
            got: buf.len(),
        });
    }
    let mut w = Writer { buf, pos: 0 };
    w.put(&MAGIC);
    w.u8(VERSION);
    w.u8(kind as u8);
    w.u32(body_len as u32);
    m.emit_body(&mut w);
    debug_assert_eq!(w.pos, needed, "{kind:?} body_len disagrees with emit_body");
    Ok(needed)
}

/// Passive awareness (§V): a node's measurement of one directed link, to the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkReport {
    /// The sending end (`< MAX_NODES`).
    pub from: u16,
    /// The receiving end (`< MAX_NODES`, not `from`).
    pub to: u16,
    /// Measured throughput, bit/s.
    pub throughput_bps: u64,
    /// Chunks the estimate is made of (at least 1).
    pub samples: u16,
    /// The training round of the last sample.
    pub measured_at_round: u32,
}

impl Body for LinkReport {
    const KIND: Kind = Kind::LinkReport;
    fn validate(&self) -> Result<(), WireError> {
        check_node("link report from", self.from, MAX_NODES)?;
        check_node("link report to", self.to, MAX_NODES)?;
        if self.from == self.to {
            return Err(field("link report to", self.to, "a link joins two nodes"));
        }
        if self.samples == 0 {
            return Err(field(
                "link report samples",
                0u16,
                "a report needs a sample",
            ));
        }
        Ok(())
    }
    fn body_len(&self) -> usize {
        LINK_REPORT_LEN
    }
    fn emit_body(&self, w: &mut Writer<'_>) {
        w.u16(self.from);
        w.u16(self.to);
        w.u64(self.throughput_bps);
        w.u16(self.samples);
        w.u32(self.measured_at_round);
    }
    fn parse_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(LinkReport {
            from: r.u16()?,
            to: r.u16()?,
            throughput_bps: r.u64()?,
            samples: r.u16()?,
            measured_at_round: r.u32()?,
        })
    }
}

/// The topology request (TRP, §VII-A): a node asks for the policy of `round` before its
/// PUSH and blocks until the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopologyRequest {
    /// The asking node (`< MAX_NODES`).
    pub node: u16,
    /// The policy version the node holds ([`NO_VERSION`] before its first).
    pub version: u32,
    /// The round about to be pushed.
    pub round: u32,
}

impl Body for TopologyRequest {
    const KIND: Kind = Kind::TopologyRequest;
    fn validate(&self) -> Result<(), WireError> {
        check_node("topology request node", self.node, MAX_NODES)
    }
    fn body_len(&self) -> usize {
        TOPOLOGY_REQUEST_LEN
    }
    fn emit_body(&self, w: &mut Writer<'_>) {
        w.u16(self.node);
        w.u32(self.version);
        w.u32(self.round);
    }
    fn parse_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(TopologyRequest {
            node: r.u16()?,
            version: r.u32()?,
            round: r.u32()?,
        })
    }
}

/// The answer to a [`TopologyRequest`] when the node holds the round's policy already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyConfirm {
    /// The round's policy version (at least 1).
    pub version: u32,
    /// The round the request was for (lets a node check the answer is to its request).
    pub round: u32,
}

impl Body for PolicyConfirm {
    const KIND: Kind = Kind::PolicyConfirm;
    fn validate(&self) -> Result<(), WireError> {
        if self.version == NO_VERSION {
            return Err(field("policy version", 0u32, "versions start at 1"));
        }
        Ok(())
    }
    fn body_len(&self) -> usize {
        POLICY_CONFIRM_LEN
    }
    fn emit_body(&self, w: &mut Writer<'_>) {
        w.u32(self.version);
        w.u32(self.round);
    }
    fn parse_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(PolicyConfirm {
            version: r.u32()?,
            round: r.u32()?,
        })
    }
}

/// The answer to a [`TopologyRequest`] when the node holds another policy than the round's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PolicyUpdate {
    /// The round's policy version (at least 1).
    pub version: u32,
    /// The round the request was for.
    pub round: u32,
    /// The round's policy.
    pub policy: Policy,
}

impl Body for PolicyUpdate {
    const KIND: Kind = Kind::PolicyUpdate;
    fn validate(&self) -> Result<(), WireError> {
        if self.version == NO_VERSION {
            return Err(field("policy version", 0u32, "versions start at 1"));
        }
        self.policy.validate()
    }
    fn body_len(&self) -> usize {
        8 + self.policy.encoded_len()
    }
    fn emit_body(&self, w: &mut Writer<'_>) {
        w.u32(self.version);
        w.u32(self.round);
        self.policy.emit(w);
    }
    fn parse_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(PolicyUpdate {
            version: r.u32()?,
            round: r.u32()?,
            policy: Policy::parse(r)?,
        })
    }
}

/// One root's aggregation tree and its share of the chunks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RootTree {
    /// The root (the parameter server of this tree's chunks).
    pub root: u16,
    /// Weight of this root's share of the chunks (§IV-C: proportional to its quality score).
    pub share: u32,
    /// Parent of every node, by node id; `None` for the root only.
    pub parent: Vec<Option<u16>>,
}

impl RootTree {
    /// The parent of `node` (`None` for the root and for an unknown node).
    pub fn parent_of(&self, node: u16) -> Option<u16> {
        self.parent.get(usize::from(node)).copied().flatten()
    }

    /// The children of `node`, in increasing id order.
    pub fn children(&self, node: u16) -> impl Iterator<Item = u16> + '_ {
        self.parent
            .iter()
            .enumerate()
            .filter(move |(_, p)| **p == Some(node))
            .map(|(c, _)| c as u16)
    }

    fn validate(&self, nodes: usize) -> Result<(), WireError> {
        check_node("tree root", self.root, nodes)?;
        if self.parent.len() != nodes {
            return Err(field(
                "parent vector length",
                self.parent.len() as u64,
                "a tree has one parent entry per node",
            ));
        }
        let not_tree = |node: usize, why| WireError::NotATree {
            root: self.root,
            node: node as u16,
            why,
        };
        for (v, p) in self.parent.iter().enumerate() {
            match *p {
                None if v != usize::from(self.root) => {
                    return Err(not_tree(v, "has no parent but is not the root"))
                }
                Some(_) if v == usize::from(self.root) => {
                    return Err(not_tree(v, "is the root but has a parent"))
                }
                Some(p) if usize::from(p) >= nodes => {
                    return Err(not_tree(v, "has a parent that is not a node"))
                }
                Some(p) if usize::from(p) == v => return Err(not_tree(v, "is its own parent")),
                _ => {}
            }
        }
        // Every walk up reaches the root within `nodes` steps, or there is a cycle.
        for start in 0..nodes {
            let mut v = start;
            let mut steps = 0;
            while let Some(p) = self.parent[v] {
                v = usize::from(p);
                steps += 1;
                if steps > nodes {
                    return Err(not_tree(
                        start,
                        "is on or above a cycle, not under the root",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The auxiliary paths (§VI) of one child → parent edge, fastest first.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AuxPaths {
    /// The edge's child: every path starts here.
    pub from: u16,
    /// The edge's parent: every path ends here.
    pub to: u16,
    /// Full node sequences, each without a repeated node, none twice.
    pub paths: Vec<Vec<u16>>,
}

impl AuxPaths {
    fn validate(&self, nodes: usize) -> Result<(), WireError> {
        check_node("auxiliary edge from", self.from, nodes)?;
        check_node("auxiliary edge to", self.to, nodes)?;
        let bad = |why| WireError::BadPath {
            from: self.from,
            to: self.to,
            why,
        };
        if self.paths.is_empty() || self.paths.len() > MAX_AUX_PATHS_PER_EDGE {
            return Err(bad("an edge has 1 to MAX_AUX_PATHS_PER_EDGE (63) paths"));
        }
        for (i, path) in self.paths.iter().enumerate() {
            validate_path(path, nodes).map_err(bad)?;
            if path.first() != Some(&self.from) || path.last() != Some(&self.to) {
                return Err(bad("a path runs from the edge's child to its parent"));
            }
            if self.paths[..i].contains(path) {
                return Err(bad("the same path is listed twice"));
            }
        }
        Ok(())
    }
}

/// A source route: 2 to [`MAX_PATH_LEN`] nodes, each below `nodes`, none twice.
fn validate_path(path: &[u16], nodes: usize) -> Result<(), &'static str> {
    if path.len() < 2 || path.len() > MAX_PATH_LEN {
        return Err("a path has 2 to MAX_PATH_LEN (64) nodes");
    }
    let mut seen = 0u64;
    for &v in path {
        if usize::from(v) >= nodes {
            return Err("a path's nodes are below the number of nodes");
        }
        let bit = 1u64 << v;
        if seen & bit != 0 {
            return Err("a path visits a node twice");
        }
        seen |= bit;
    }
    Ok(())
}

/// A NetStorm policy (§VII): the multi-root trees (primary paths), the chunk shares per root
/// and the auxiliary paths. Always valid: built by [`Policy::new`] or parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Policy {
    nodes: u16,
    trees: Vec<RootTree>,
    aux: Vec<AuxPaths>,
}

impl Policy {
    /// A policy over `nodes` nodes (ids `0..nodes`). Trees are put in root order and edges
    /// in `(from, to)` order, edges without paths dropped; then checked: 1 to [`MAX_NODES`]
    /// nodes, at least one tree, distinct roots, every parent vector a tree rooted at its
    /// root, shares not all zero, each auxiliary edge a child → parent edge of some tree and
    /// listed once, its paths from the child to the parent without a repeated node, and the
    /// encoding within [`MAX_POLICY_LEN`].
    pub fn new(
        nodes: u16,
        mut trees: Vec<RootTree>,
        mut aux: Vec<AuxPaths>,
    ) -> Result<Policy, WireError> {
        trees.sort_by_key(|t| t.root);
        aux.retain(|a| !a.paths.is_empty());
        aux.sort_by_key(|a| (a.from, a.to));
        let p = Policy { nodes, trees, aux };
        p.validate()?;
        Ok(p)
    }

    /// Number of nodes.
    pub fn nodes(&self) -> u16 {
        self.nodes
    }

    /// The trees, in root order.
    pub fn trees(&self) -> &[RootTree] {
        &self.trees
    }

    /// The tree of `root`.
    pub fn tree(&self, root: u16) -> Option<&RootTree> {
        self.trees
            .binary_search_by_key(&root, |t| t.root)
            .ok()
            .map(|i| &self.trees[i])
    }

    /// The roots, increasing.
    pub fn roots(&self) -> impl Iterator<Item = u16> + '_ {
        self.trees.iter().map(|t| t.root)
    }

    /// Auxiliary paths of every edge that has some, in `(from, to)` order.
    pub fn aux(&self) -> &[AuxPaths] {
        &self.aux
    }

    /// The auxiliary paths of the edge `from -> to`, fastest first (empty if none).
    pub fn aux_paths(&self, from: u16, to: u16) -> &[Vec<u16>] {
        self.aux
            .binary_search_by_key(&(from, to), |a| (a.from, a.to))
            .map(|i| &self.aux[i].paths[..])
            .unwrap_or(&[])
    }

    /// Bytes of the policy's encoding inside a [`PolicyUpdate`].
    pub fn encoded_len(&self) -> usize {
        let n = usize::from(self.nodes);
        let trees = self.trees.len() * (6 + 2 * n);
        let aux: usize = self
            .aux
            .iter()
            .map(|a| 5 + a.paths.iter().map(|p| 1 + 2 * p.len()).sum::<usize>())
            .sum();
        2 + trees + 2 + aux
    }

    fn validate(&self) -> Result<(), WireError> {
        let n = usize::from(self.nodes);
        if n == 0 || n > MAX_NODES {
            return Err(field(
                "policy nodes",
                self.nodes,
                "a policy has 1 to 64 nodes",
            ));
        }
        if self.trees.is_empty() {
            return Err(field("policy trees", 0u8, "a policy has at least one root"));
        }
        for (i, t) in self.trees.iter().enumerate() {
            if i > 0 && self.trees[i - 1].root >= t.root {
                return Err(field(
                    "tree root",
                    t.root,
                    "roots are listed in increasing order, each once",
                ));
            }
            t.validate(n)?;
        }
        if self.trees.iter().all(|t| t.share == 0) {
            return Err(field("root shares", 0u8, "at least one root has a share"));
        }
        if self.aux.len() > n * (n - 1) {
            return Err(field(
                "auxiliary edges",
                self.aux.len() as u64,
                "at most one entry per directed edge",
            ));
        }
        for (i, a) in self.aux.iter().enumerate() {
            if i > 0 && (self.aux[i - 1].from, self.aux[i - 1].to) >= (a.from, a.to) {
                return Err(WireError::BadPath {
                    from: a.from,
                    to: a.to,
                    why: "edges are listed in increasing (from, to) order, each once",
                });
            }
            a.validate(n)?;
            if !self.trees.iter().any(|t| t.parent_of(a.from) == Some(a.to)) {
                return Err(WireError::BadPath {
                    from: a.from,
                    to: a.to,
                    why: "the edge is not a child -> parent edge of any tree",
                });
            }
        }
        let len = self.encoded_len();
        if len > MAX_POLICY_LEN {
            return Err(WireError::TooLong {
                kind: Kind::PolicyUpdate,
                len,
                max: MAX_POLICY_LEN,
            });
        }
        Ok(())
    }

    fn emit(&self, w: &mut Writer<'_>) {
        w.u8(self.nodes as u8);
        w.u8(self.trees.len() as u8);
        for t in &self.trees {
            w.u16(t.root);
            w.u32(t.share);
            for p in &t.parent {
                w.u16(p.unwrap_or(NO_PARENT));
            }
        }
        w.u16(self.aux.len() as u16);
        for a in &self.aux {
            w.u16(a.from);
            w.u16(a.to);
            w.u8(a.paths.len() as u8);
            for p in &a.paths {
                w.u8(p.len() as u8);
                for &v in p {
                    w.u16(v);
                }
            }
        }
    }

    fn parse(r: &mut Reader<'_>) -> Result<Policy, WireError> {
        let nodes = r.u8()?;
        let n = usize::from(nodes);
        if n == 0 || n > MAX_NODES {
            return Err(field("policy nodes", nodes, "a policy has 1 to 64 nodes"));
        }
        let ntrees = usize::from(r.u8()?);
        if ntrees == 0 || ntrees > n {
            return Err(field(
                "policy trees",
                ntrees as u64,
                "a policy has 1 to `nodes` roots",
            ));
        }
        r.room_for(ntrees, 6 + 2 * n)?;
        let mut trees = Vec::with_capacity(ntrees);
        for _ in 0..ntrees {
            let root = r.u16()?;
            let share = r.u32()?;
            let mut parent = Vec::with_capacity(n);
            for _ in 0..n {
                let p = r.u16()?;
                // Only the root's entry may be NO_PARENT; a NO_PARENT elsewhere is rejected
                // by the tree check, and any other value >= nodes as not a node.
                parent.push((p != NO_PARENT).then_some(p));
            }
            trees.push(RootTree {
                root,
                share,
                parent,
            });
        }
        let naux = usize::from(r.u16()?);
        if naux > n * (n - 1) {
            return Err(field(
                "auxiliary edges",
                naux as u64,
                "at most one entry per directed edge",
            ));
        }
        // An entry is at least from, to, a count and one path of two nodes.
        r.room_for(naux, 5 + 5)?;
        let mut aux = Vec::with_capacity(naux);
        for _ in 0..naux {
            let from = r.u16()?;
            let to = r.u16()?;
            let npaths = usize::from(r.u8()?);
            if npaths == 0 || npaths > MAX_AUX_PATHS_PER_EDGE {
                return Err(WireError::BadPath {
                    from,
                    to,
                    why: "an edge has 1 to MAX_AUX_PATHS_PER_EDGE (63) paths",
                });
            }
            r.room_for(npaths, 5)?;
            let mut paths = Vec::with_capacity(npaths);
            for _ in 0..npaths {
                let len = usize::from(r.u8()?);
                if !(2..=MAX_PATH_LEN).contains(&len) {
                    return Err(WireError::BadPath {
                        from,
                        to,
                        why: "a path has 2 to MAX_PATH_LEN (64) nodes",
                    });
                }
                r.room_for(len, 2)?;
                let mut path = Vec::with_capacity(len);
                for _ in 0..len {
                    path.push(r.u16()?);
                }
                paths.push(path);
            }
            aux.push(AuxPaths { from, to, paths });
        }
        // No sorting here: out-of-order input is rejected by validate, so that an accepted
        // policy re-encodes to the same bytes.
        let p = Policy {
            nodes: u16::from(nodes),
            trees,
            aux,
        };
        p.validate()?;
        Ok(p)
    }
}

/// Which way a chunk travels in its root's tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Up, child to parent: a partial aggregate (PUSH).
    Push,
    /// Down, parent to child: the root's final aggregate (PULL).
    Pull,
}

/// The metadata of a model chunk, prepended to its payload (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHeader {
    /// The policy version the sender used for this round (at least 1).
    pub version: u32,
    /// The training round.
    pub round: u32,
    /// The root whose tree the chunk belongs to (`< MAX_NODES`).
    pub root: u16,
    /// The chunk's id within the round.
    pub chunk: u32,
    /// Up or down the tree.
    pub phase: Phase,
    /// IS_AUX: the chunk travels on an auxiliary path, source-routed by `path`.
    pub is_aux: bool,
    /// PATH: the full node sequence when `is_aux` (2 to [`MAX_PATH_LEN`] distinct nodes),
    /// empty otherwise.
    pub path: Vec<u16>,
    /// When `is_aux`: index in `path` of the node this copy is sent to (`1..path.len()`);
    /// 0 otherwise.
    pub hop: u8,
}

impl ChunkHeader {
    /// A chunk on the primary path (the tree edge).
    pub fn primary(version: u32, round: u32, root: u16, chunk: u32, phase: Phase) -> Self {
        ChunkHeader {
            version,
            round,
            root,
            chunk,
            phase,
            is_aux: false,
            path: Vec::new(),
            hop: 0,
        }
    }

    /// The same chunk sent on the auxiliary path `path` instead (its first hop is
    /// `path[1]`), e.g. one of [`Policy::aux_paths`] when the primary path is busy (§VI-A).
    pub fn via(&self, path: &[u16]) -> Result<ChunkHeader, WireError> {
        let h = ChunkHeader {
            is_aux: true,
            path: path.to_vec(),
            hop: 1,
            ..self.clone()
        };
        h.validate()?;
        Ok(h)
    }

    /// The node this copy is addressed to, for an auxiliary chunk (`path[hop]`).
    pub fn receiver(&self) -> Option<u16> {
        self.is_aux
            .then(|| self.path.get(usize::from(self.hop)).copied())
            .flatten()
    }

    /// The node whose data this is: `path[0]` for an auxiliary chunk; `None` for a primary
    /// one (the sender is the peer of the connection it came on).
    pub fn origin(&self) -> Option<u16> {
        self.is_aux.then(|| self.path.first().copied()).flatten()
    }

    /// For an auxiliary chunk not yet at the end of its path: the next node and the header
    /// to send it with (`hop + 1`). `None` at the last node (which consumes it) and for a
    /// primary chunk.
    pub fn forwarded(&self) -> Option<(u16, ChunkHeader)> {
        if !self.is_aux {
            return None;
        }
        let next = *self.path.get(usize::from(self.hop) + 1)?;
        let h = ChunkHeader {
            hop: self.hop + 1,
            ..self.clone()
        };
        Some((next, h))
    }

    /// Splits a chunk message into its header and the payload after it.
    pub fn split(buf: &[u8]) -> Result<(ChunkHeader, &[u8]), WireError> {
        match Message::parse_prefix(buf)? {
            (Message::Chunk(h), used) => Ok((h, &buf[used..])),
            (m, _) => Err(WireError::WrongKind {
                expected: Kind::Chunk,
                got: m.kind(),
            }),
        }
    }
}

impl Body for ChunkHeader {
    const KIND: Kind = Kind::Chunk;
    fn validate(&self) -> Result<(), WireError> {
        if self.version == NO_VERSION {
            return Err(field("chunk policy version", 0u32, "versions start at 1"));
        }
        check_node("chunk root", self.root, MAX_NODES)?;
        if self.is_aux {
            validate_path(&self.path, MAX_NODES).map_err(|why| WireError::BadPath {
                from: self.path.first().copied().unwrap_or(0),
                to: self.path.last().copied().unwrap_or(0),
                why,
            })?;
            if self.hop == 0 || usize::from(self.hop) >= self.path.len() {
                return Err(field(
                    "chunk hop",
                    self.hop,
                    "an auxiliary chunk's hop indexes its path after the source",
                ));
            }
        } else if !self.path.is_empty() || self.hop != 0 {
            return Err(field(
                "chunk path length",
                self.path.len() as u64,
                "a primary chunk has no path and hop 0",
            ));
        }
        Ok(())
    }
    fn body_len(&self) -> usize {
        CHUNK_FIXED_LEN + 2 * self.path.len()
    }
    fn emit_body(&self, w: &mut Writer<'_>) {
        w.u32(self.version);
        w.u32(self.round);
        w.u16(self.root);
        w.u32(self.chunk);
        let mut flags = 0;
        if self.is_aux {
            flags |= FLAG_AUX;
        }
        if self.phase == Phase::Pull {
            flags |= FLAG_PULL;
        }
        w.u8(flags);
        w.u8(self.hop);
        w.u8(self.path.len() as u8);
        for &v in &self.path {
            w.u16(v);
        }
    }
    fn parse_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let version = r.u32()?;
        let round = r.u32()?;
        let root = r.u16()?;
        let chunk = r.u32()?;
        let flags = r.u8()?;
        if flags & !(FLAG_AUX | FLAG_PULL) != 0 {
            return Err(field(
                "chunk flags",
                flags,
                "only IS_AUX and PULL are defined",
            ));
        }
        let hop = r.u8()?;
        let len = usize::from(r.u8()?);
        if len > MAX_PATH_LEN {
            return Err(field("chunk path length", len as u64, "at most 64 nodes"));
        }
        r.room_for(len, 2)?;
        let mut path = Vec::with_capacity(len);
        for _ in 0..len {
            path.push(r.u16()?);
        }
        Ok(ChunkHeader {
            version,
            round,
            root,
            chunk,
            phase: if flags & FLAG_PULL != 0 {
                Phase::Pull
            } else {
                Phase::Push
            },
            is_aux: flags & FLAG_AUX != 0,
            path,
            hop,
        })
    }
}

/// Any NetStorm message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Message {
    /// See [`LinkReport`].
    LinkReport(LinkReport),
    /// See [`TopologyRequest`].
    TopologyRequest(TopologyRequest),
    /// See [`PolicyUpdate`].
    PolicyUpdate(PolicyUpdate),
    /// See [`PolicyConfirm`].
    PolicyConfirm(PolicyConfirm),
    /// See [`ChunkHeader`].
    Chunk(ChunkHeader),
}

impl Message {
    /// The frame kind.
    pub fn kind(&self) -> Kind {
        match self {
            Message::LinkReport(_) => Kind::LinkReport,
            Message::TopologyRequest(_) => Kind::TopologyRequest,
            Message::PolicyUpdate(_) => Kind::PolicyUpdate,
            Message::PolicyConfirm(_) => Kind::PolicyConfirm,
            Message::Chunk(_) => Kind::Chunk,
        }
    }

    fn validate(&self) -> Result<(), WireError> {
        match self {
            Message::LinkReport(m) => m.validate(),
            Message::TopologyRequest(m) => m.validate(),
            Message::PolicyUpdate(m) => m.validate(),
            Message::PolicyConfirm(m) => m.validate(),
            Message::Chunk(m) => m.validate(),
        }
    }

    fn body_len(&self) -> usize {
        match self {
            Message::LinkReport(m) => m.body_len(),
            Message::TopologyRequest(m) => m.body_len(),
            Message::PolicyUpdate(m) => m.body_len(),
            Message::PolicyConfirm(m) => m.body_len(),
            Message::Chunk(m) => m.body_len(),
        }
    }

    /// Bytes of the encoded frame.
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }

    /// Parses exactly one frame: `buf` must end where the frame ends.
    pub fn parse(buf: &[u8]) -> Result<Message, WireError> {
        let (m, used) = Message::parse_prefix(buf)?;
        if used != buf.len() {
            return Err(WireError::Trailing(buf.len() - used));
        }
        Ok(m)
    }

    /// Parses the frame at the start of `buf` (more may follow: the next frame, or a chunk's
    /// payload) and returns it with its length. Checks, in order: the header's length, magic,
    /// version, kind, the body length against the kind's bound, the body's presence, then
    /// every field.
    pub fn parse_prefix(buf: &[u8]) -> Result<(Message, usize), WireError> {
        let (kind, len) = frame_len(buf)?;
        let p = Packet::new_checked(buf)?;
        let mut r = Reader {
            kind,
            body: p.body(),
            pos: 0,
        };
        let fixed = |r: &Reader<'_>, want: usize| {
            if r.body.len() != want {
                return Err(WireError::BodyLength {
                    kind,
                    body_len: r.body.len(),
                });
            }
            Ok(())
        };
        let m = match kind {
            Kind::LinkReport => {
                fixed(&r, LINK_REPORT_LEN)?;
                Message::LinkReport(LinkReport::parse_body(&mut r)?)
            }
            Kind::TopologyRequest => {
                fixed(&r, TOPOLOGY_REQUEST_LEN)?;
                Message::TopologyRequest(TopologyRequest::parse_body(&mut r)?)
            }
            Kind::PolicyConfirm => {
                fixed(&r, POLICY_CONFIRM_LEN)?;
                Message::PolicyConfirm(PolicyConfirm::parse_body(&mut r)?)
            }
            Kind::PolicyUpdate => Message::PolicyUpdate(PolicyUpdate::parse_body(&mut r)?),
            Kind::Chunk => Message::Chunk(ChunkHeader::parse_body(&mut r)?),
        };
        r.finish()?;
        m.validate()?;
        Ok((m, len))
    }

    /// Writes the frame at the start of `buf` and returns its length. Checks the message
    /// first (what [`Message::parse`] would reject is not written) and that `buf` can hold
    /// [`Message::buffer_len`] bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        match self {
            Message::LinkReport(m) => emit_frame(m, buf),
            Message::TopologyRequest(m) => emit_frame(m, buf),
            Message::PolicyUpdate(m) => emit_frame(m, buf),
            Message::PolicyConfirm(m) => emit_frame(m, buf),
            Message::Chunk(m) => emit_frame(m, buf),
        }
    }

    /// The encoded frame.
    pub fn to_vec(&self) -> Result<Vec<u8>, WireError> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

/// `parse`, `emit`, `buffer_len` and `to_vec` on each message type, through [`Message`].
macro_rules! repr {
    ($t:ident, $kind:ident) => {
        impl $t {
            /// Parses exactly one frame of this kind ([`WireError::WrongKind`] for another).
            pub fn parse(buf: &[u8]) -> Result<$t, WireError> {
                match Message::parse(buf)? {
                    Message::$kind(m) => Ok(m),
                    other => Err(WireError::WrongKind {
                        expected: Kind::$kind,
                        got: other.kind(),
                    }),
                }
            }

            /// Bytes of the encoded frame.
            pub fn buffer_len(&self) -> usize {
                HEADER_LEN + self.body_len()
            }

            /// Writes the frame at the start of `buf`; see [`Message::emit`].
            pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
                emit_frame(self, buf)
            }

            /// The encoded frame.
            pub fn to_vec(&self) -> Result<Vec<u8>, WireError> {
                let mut v = vec![0; self.buffer_len()];
                emit_frame(self, &mut v)?;
                Ok(v)
            }
        }

        impl From<$t> for Message {
            fn from(m: $t) -> Message {
                Message::$kind(m)
            }
        }
    };
}

repr!(LinkReport, LinkReport);
repr!(TopologyRequest, TopologyRequest);
repr!(PolicyUpdate, PolicyUpdate);
repr!(PolicyConfirm, PolicyConfirm);
repr!(ChunkHeader, Chunk);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// SplitMix64: the policy generator's randomness, from one proptest seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn shuffle(&mut self, v: &mut [u16]) {
            for i in (1..v.len()).rev() {
                v.swap(i, self.below(i + 1));
            }
        }
    }

    /// A valid policy: random roots, random spanning trees, random simple auxiliary paths on
    /// some tree edges.
    fn random_policy(nodes: u16, seed: u64) -> Policy {
        let mut rng = Rng(seed);
        let n = usize::from(nodes);
        let mut ids: Vec<u16> = (0..nodes).collect();
        rng.shuffle(&mut ids);
        let nroots = 1 + rng.below(n.min(4));
        let mut trees = Vec::new();
        for (i, &root) in ids[..nroots].iter().enumerate() {
            let mut order: Vec<u16> = (0..nodes).filter(|&v| v != root).collect();
            rng.shuffle(&mut order);
            order.insert(0, root);
            let mut parent = vec![None; n];
            for k in 1..n {
                parent[usize::from(order[k])] = Some(order[rng.below(k)]);
            }
            let share = if i == 0 {
                1 + rng.below(1000) as u32
            } else {
                rng.next() as u32
            };
            trees.push(RootTree {
                root,
                share,
                parent,
            });
        }
        let mut edges: Vec<(u16, u16)> = trees
            .iter()
            .flat_map(|t| {
                t.parent
                    .iter()
                    .enumerate()
                    .filter_map(|(c, p)| p.map(|p| (c as u16, p)))
                    .collect::<Vec<_>>()
            })
            .collect();
        edges.sort_unstable();
        edges.dedup();
        let mut aux = Vec::new();
        for (from, to) in edges {
            if rng.below(2) == 0 {
                continue;
            }
            let mut paths: Vec<Vec<u16>> = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let mut middle: Vec<u16> = (0..nodes).filter(|&v| v != from && v != to).collect();
                rng.shuffle(&mut middle);
                middle.truncate(rng.below(middle.len().min(6) + 1));
                let mut path = vec![from];
                path.extend(middle);
                path.push(to);
                if !paths.contains(&path) {
                    paths.push(path);
                }
            }
            aux.push(AuxPaths { from, to, paths });
        }
        // Given out of order on purpose: `new` sorts.
        trees.reverse();
        aux.reverse();
        Policy::new(nodes, trees, aux).expect("generated policy is valid")
    }

    fn policy_strategy() -> impl Strategy<Value = Policy> {
        (prop_oneof![3 => 1u16..=8, 1 => 1u16..=64], any::<u64>())
            .prop_map(|(n, seed)| random_policy(n, seed))
    }

    fn chunk_strategy() -> impl Strategy<Value = ChunkHeader> {
        (
            1u32..,
            any::<u32>(),
            0u16..64,
            any::<u32>(),
            any::<bool>(),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(|(version, round, root, chunk, pull, aux, seed)| {
                let phase = if pull { Phase::Pull } else { Phase::Push };
                let h = ChunkHeader::primary(version, round, root, chunk, phase);
                if !aux {
                    return h;
                }
                let mut rng = Rng(seed);
                let mut ids: Vec<u16> = (0..64).collect();
                rng.shuffle(&mut ids);
                let len = 2 + rng.below(63);
                let mut a = h.via(&ids[..len]).expect("simple path");
                a.hop = 1 + rng.below(len - 1) as u8;
                a
            })
    }

    fn message_strategy() -> impl Strategy<Value = Message> {
        prop_oneof![
            (0u16..64, 0u16..63, any::<u64>(), 1u16.., any::<u32>()).prop_map(
                |(from, to, throughput_bps, samples, measured_at_round)| {
                    // `to` skips `from`.
                    let to = if to >= from { to + 1 } else { to };
                    Message::LinkReport(LinkReport {
                        from,
                        to,
                        throughput_bps,
                        samples,
                        measured_at_round,
                    })
                }
            ),
            (0u16..64, any::<u32>(), any::<u32>()).prop_map(|(node, version, round)| {
                Message::TopologyRequest(TopologyRequest {
                    node,
                    version,
                    round,
                })
            }),
            (1u32.., any::<u32>(), policy_strategy()).prop_map(|(version, round, policy)| {
                Message::PolicyUpdate(PolicyUpdate {
                    version,
                    round,
                    policy,
                })
            }),
            (1u32.., any::<u32>()).prop_map(|(version, round)| Message::PolicyConfirm(
                PolicyConfirm { version, round }
            )),
            chunk_strategy().prop_map(Message::Chunk),
        ]
    }

    /// Whatever `parse` accepts re-encodes to exactly the same bytes.
    fn assert_canonical(bytes: &[u8]) {
        if let Ok(m) = Message::parse(bytes) {
            assert_eq!(m.to_vec().expect("re-encode"), bytes, "{m:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn emit_parse_round_trip(m in message_strategy()) {
            let bytes = m.to_vec().expect("emit of a valid message");
            prop_assert_eq!(bytes.len(), m.buffer_len());
            prop_assert_eq!(&Message::parse(&bytes).expect("parse"), &m);
            prop_assert_eq!(frame_len(&bytes).expect("header"), (m.kind(), bytes.len()));
            // Truncations are truncations; one byte more is trailing.
            for cut in [0, 1, HEADER_LEN - 1, HEADER_LEN, bytes.len() / 2, bytes.len() - 1] {
                let r = Message::parse(&bytes[..cut]);
                prop_assert!(matches!(r, Err(WireError::Truncated { .. })), "cut {cut}: {r:?}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            prop_assert_eq!(Message::parse(&longer), Err(WireError::Trailing(1)));
            prop_assert_eq!(
                Message::parse_prefix(&longer).expect("prefix"),
                (m.clone(), bytes.len())
            );
            // The typed parsers agree.
            match &m {
                Message::LinkReport(x) => {
                    prop_assert_eq!(&LinkReport::parse(&bytes).unwrap(), x)
                }
                Message::TopologyRequest(x) => {
                    prop_assert_eq!(&TopologyRequest::parse(&bytes).unwrap(), x)
                }
                Message::PolicyUpdate(x) => {
                    prop_assert_eq!(&PolicyUpdate::parse(&bytes).unwrap(), x)
                }
                Message::PolicyConfirm(x) => {
                    prop_assert_eq!(&PolicyConfirm::parse(&bytes).unwrap(), x)
                }
                Message::Chunk(x) => prop_assert_eq!(&ChunkHeader::parse(&bytes).unwrap(), x),
            }
        }

        #[test]
        fn every_strict_prefix_is_truncated(m in message_strategy()) {
            let bytes = m.to_vec().unwrap();
            // Policies are long: every prefix of the small kinds, a sample of the others.
            let step = (bytes.len() / 64).max(1);
            for cut in (0..bytes.len()).step_by(step) {
                let r = Message::parse(&bytes[..cut]);
                prop_assert!(matches!(r, Err(WireError::Truncated { .. })), "cut {cut}: {r:?}");
            }
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = Message::parse(&bytes);
            let _ = Message::parse_prefix(&bytes);
            let _ = frame_len(&bytes);
            assert_canonical(&bytes);
        }

        #[test]
        fn parse_never_panics_on_mutated_frames(
            m in message_strategy(),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        ) {
            let mut bytes = m.to_vec().unwrap();
            for (at, b) in edits {
                let i = at % bytes.len();
                bytes[i] = b;
            }
            let _ = Message::parse_prefix(&bytes);
            assert_canonical(&bytes);
        }

        #[test]
        fn chunk_split_and_forward(
            h in chunk_strategy(),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut msg = h.to_vec().unwrap();
            msg.extend_from_slice(&payload);
            let (back, rest) = ChunkHeader::split(&msg).unwrap();
            prop_assert_eq!(&back, &h);
            prop_assert_eq!(rest, &payload[..]);
            if h.is_aux {
                prop_assert_eq!(h.receiver(), Some(h.path[usize::from(h.hop)]));
                prop_assert_eq!(h.origin(), Some(h.path[0]));
                match h.forwarded() {
                    Some((next, f)) => {
                        prop_assert_eq!(next, h.path[usize::from(h.hop) + 1]);
                        prop_assert_eq!(f.receiver(), Some(next));
                        // A forwarded header is still valid on the wire.
                        prop_assert_eq!(ChunkHeader::parse(&f.to_vec().unwrap()).unwrap(), f);
                    }
                    None => prop_assert_eq!(usize::from(h.hop), h.path.len() - 1),
                }
            } else {
                prop_assert_eq!(h.forwarded(), None);
                prop_assert_eq!(h.origin(), None);
            }
        }
    }

    fn chain_policy() -> Policy {
        // 1 -> 2 -> 0, with 1's auxiliary path through 3.
        Policy::new(
            4,
            vec![RootTree {
                root: 0,
                share: 1,
                parent: vec![None, Some(2), Some(0), Some(0)],
            }],
            vec![AuxPaths {
                from: 1,
                to: 2,
                paths: vec![vec![1, 3, 2]],
            }],
        )
        .unwrap()
    }

    fn update_bytes(p: &Policy) -> Vec<u8> {
        PolicyUpdate {
            version: 1,
            round: 0,
            policy: p.clone(),
        }
        .to_vec()
        .unwrap()
    }

    /// Offset of the first tree's parent vector in a PolicyUpdate frame.
    const PARENTS: usize = HEADER_LEN + 8 + 2 + 6;

    #[test]
    fn policy_accessors() {
        let p = chain_policy();
        assert_eq!(p.roots().collect::<Vec<_>>(), vec![0]);
        let t = p.tree(0).unwrap();
        assert_eq!(t.children(0).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(t.children(2).collect::<Vec<_>>(), vec![1]);
        assert_eq!(t.parent_of(1), Some(2));
        assert_eq!(t.parent_of(0), None);
        assert!(p.tree(1).is_none());
        assert_eq!(p.aux_paths(1, 2), &[vec![1, 3, 2]]);
        assert!(p.aux_paths(2, 0).is_empty());
        assert_eq!(update_bytes(&p).len(), HEADER_LEN + 8 + p.encoded_len());
    }

    #[test]
    fn invalid_trees_are_rejected() {
        let tree = |parent: Vec<Option<u16>>| {
            Policy::new(
                3,
                vec![RootTree {
                    root: 0,
                    share: 1,
                    parent,
                }],
                vec![],
            )
        };
        // A cycle 1 <-> 2 not under the root.
        assert!(matches!(
            tree(vec![None, Some(2), Some(1)]),
            Err(WireError::NotATree { root: 0, .. })
        ));
        // Two roots.
        assert!(matches!(
            tree(vec![None, None, Some(0)]),
            Err(WireError::NotATree { node: 1, .. })
        ));
        // The root has a parent.
        assert!(matches!(
            tree(vec![Some(1), Some(0), Some(0)]),
            Err(WireError::NotATree { node: 0, .. })
        ));
        // A parent that is not a node; a self-loop; a short vector.
        assert!(tree(vec![None, Some(7), Some(0)]).is_err());
        assert!(tree(vec![None, Some(1), Some(0)]).is_err());
        assert!(tree(vec![None, Some(0)]).is_err());
        assert!(tree(vec![None, Some(0), Some(1)]).is_ok());
        // All shares zero; duplicate roots; no tree.
        let t0 = RootTree {
            root: 0,
            share: 0,
            parent: vec![None, Some(0)],
        };
        assert!(Policy::new(2, vec![t0.clone()], vec![]).is_err());
        let t0 = RootTree { share: 1, ..t0 };
        assert!(Policy::new(2, vec![t0.clone(), t0.clone()], vec![]).is_err());
        assert!(Policy::new(2, vec![], vec![]).is_err());
        assert!(Policy::new(0, vec![], vec![]).is_err());
        assert!(Policy::new(65, vec![], vec![]).is_err());
    }

    #[test]
    fn invalid_aux_paths_are_rejected() {
        let with = |from, to, paths: Vec<Vec<u16>>| {
            Policy::new(
                4,
                chain_policy().trees().to_vec(),
                vec![AuxPaths { from, to, paths }],
            )
        };
        assert!(with(1, 2, vec![vec![1, 3, 2]]).is_ok());
        assert!(with(1, 2, vec![vec![1, 2]]).is_ok());
        // Wrong start, wrong end, a repeated node, a node out of range, the same path twice.
        for bad in [
            vec![vec![3, 1, 2]],
            vec![vec![1, 3]],
            vec![vec![1, 3, 1, 2]],
            vec![vec![1, 9, 2]],
            vec![vec![1, 3, 2], vec![1, 3, 2]],
            vec![vec![1]],
        ] {
            assert!(
                matches!(with(1, 2, bad.clone()), Err(WireError::BadPath { .. })),
                "{bad:?}"
            );
        }
        // Not a child -> parent edge of the tree (2 -> 1 is the reverse).
        assert!(matches!(
            with(2, 1, vec![vec![2, 3, 1]]),
            Err(WireError::BadPath { .. })
        ));
    }

    #[test]
    fn parse_rejects_what_new_rejects_and_noncanonical_orders() {
        let good = update_bytes(&chain_policy());
        assert!(Message::parse(&good).is_ok());
        // Node 1's parent -> 1 (a self-loop).
        let mut b = good.clone();
        b[PARENTS + 2..PARENTS + 4].copy_from_slice(&1u16.to_be_bytes());
        assert!(matches!(
            Message::parse(&b),
            Err(WireError::NotATree { .. })
        ));
        // Node 1's parent -> NO_PARENT (a second root).
        let mut b = good.clone();
        b[PARENTS + 2..PARENTS + 4].copy_from_slice(&NO_PARENT.to_be_bytes());
        assert!(matches!(
            Message::parse(&b),
            Err(WireError::NotATree { .. })
        ));
        // Two roots listed in decreasing order are rejected on the wire (new() would sort).
        let two = Policy::new(
            2,
            vec![
                RootTree {
                    root: 0,
                    share: 1,
                    parent: vec![None, Some(0)],
                },
                RootTree {
                    root: 1,
                    share: 1,
                    parent: vec![Some(1), None],
                },
            ],
            vec![],
        )
        .unwrap();
        let mut b = update_bytes(&two);
        let tree_len = 6 + 2 * 2;
        let first = HEADER_LEN + 8 + 2;
        let (a, rest) = b[first..first + 2 * tree_len].split_at(tree_len);
        let swapped = [rest, a].concat();
        b[first..first + 2 * tree_len].copy_from_slice(&swapped);
        assert!(matches!(
            Message::parse(&b),
            Err(WireError::Field {
                field: "tree root",
                ..
            })
        ));
    }

    #[test]
    fn header_checks_come_first_and_bound_allocation() {
        let good = TopologyRequest {
            node: 3,
            version: 2,
            round: 9,
        }
        .to_vec()
        .unwrap();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(Message::parse(&b), Err(WireError::BadMagic(_))));
        let mut b = good.clone();
        b[field::VERSION] = 2;
        assert_eq!(Message::parse(&b), Err(WireError::BadVersion(2)));
        let mut b = good.clone();
        b[field::KIND] = 9;
        assert_eq!(Message::parse(&b), Err(WireError::UnknownKind(9)));
        // A huge body length is refused from the header alone.
        let mut b = good[..HEADER_LEN].to_vec();
        b[field::KIND] = Kind::PolicyUpdate as u8;
        b[field::BODY_LEN].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(frame_len(&b), Err(WireError::TooLong { .. })));
        assert!(matches!(Message::parse(&b), Err(WireError::TooLong { .. })));
        // A fixed-size body with another length.
        let mut b = good.clone();
        b[field::BODY_LEN].copy_from_slice(&9u32.to_be_bytes());
        b.pop();
        assert!(matches!(
            Message::parse(&b),
            Err(WireError::BodyLength { .. })
        ));
        // A policy announcing more trees than its body holds fails before allocating them.
        let mut b = update_bytes(&chain_policy());
        b[HEADER_LEN + 8 + 1] = 4;
        assert!(matches!(
            Message::parse(&b),
            Err(WireError::BodyLength { .. })
        ));
        // Wrong kind for a typed parser.
        assert_eq!(
            PolicyConfirm::parse(&good),
            Err(WireError::WrongKind {
                expected: Kind::PolicyConfirm,
                got: Kind::TopologyRequest
            })
        );
        // Packet view.
        let p = Packet::new_checked(&good[..]).unwrap();
        assert_eq!(p.magic(), MAGIC);
        assert_eq!(p.kind_byte(), Kind::TopologyRequest as u8);
        assert_eq!(p.body().len(), 10);
        assert!(Packet::new_checked(&good[..good.len() - 1]).is_err());
    }

    #[test]
    fn emit_checks_the_message_and_the_buffer() {
        let h = ChunkHeader::primary(1, 0, 0, 5, Phase::Push);
        let mut small = [0u8; 5];
        assert!(matches!(
            h.emit(&mut small),
            Err(WireError::BufferTooSmall { .. })
        ));
        let mut big = [0u8; 64];
        assert_eq!(h.emit(&mut big), Ok(h.buffer_len()));
        // Invalid reprs are not written.
        let bad = [
            ChunkHeader {
                version: 0,
                ..h.clone()
            },
            ChunkHeader {
                root: 64,
                ..h.clone()
            },
            ChunkHeader {
                hop: 1,
                ..h.clone()
            },
            ChunkHeader {
                is_aux: true,
                ..h.clone()
            },
            ChunkHeader {
                is_aux: true,
                path: vec![1, 2, 1],
                hop: 1,
                ..h.clone()
            },
            ChunkHeader {
                is_aux: true,
                path: vec![1, 2],
                hop: 2,
                ..h.clone()
            },
            ChunkHeader {
                is_aux: true,
                path: vec![1, 2],
                hop: 0,
                ..h.clone()
            },
        ];
        for b in bad {
            assert!(b.emit(&mut big).is_err(), "{b:?}");
        }
        let r = LinkReport {
            from: 1,
            to: 1,
            throughput_bps: 5,
            samples: 1,
            measured_at_round: 0,
        };
        assert!(r.to_vec().is_err());
        assert!(LinkReport {
            samples: 0,
            to: 2,
            ..r
        }
        .to_vec()
        .is_err());
        assert!(PolicyConfirm {
            version: 0,
            round: 0
        }
        .to_vec()
        .is_err());
        assert!(TopologyRequest {
            node: 64,
            version: 0,
            round: 0
        }
        .to_vec()
        .is_err());
        // Unknown flag bits are rejected on the wire.
        let mut b = h.to_vec().unwrap();
        b[HEADER_LEN + 14] |= 0x80;
        assert!(matches!(
            Message::parse(&b),
            Err(WireError::Field {
                field: "chunk flags",
                ..
            })
        ));
    }

    #[test]
    fn largest_policy_without_aux_fits() {
        let n = MAX_NODES as u16;
        let trees = (0..n)
            .map(|root| RootTree {
                root,
                share: 1,
                parent: (0..n).map(|v| (v != root).then_some(root)).collect(),
            })
            .collect();
        let p = Policy::new(n, trees, vec![]).unwrap();
        assert_eq!(p.encoded_len(), 8580);
        let m = Message::PolicyUpdate(PolicyUpdate {
            version: 1,
            round: 0,
            policy: p,
        });
        assert_eq!(Message::parse(&m.to_vec().unwrap()).unwrap(), m);
    }
}
