//! Chunk metadata and control messages in NetStorm's wire format
//! ([`gradwire_netstorm::wire`]), converted to the runtime's types.

use gradwire_netstorm::wire::{
    ChunkHeader, Kind, LinkReport, Message, Phase as WirePhase, PolicyConfirm, PolicyUpdate,
    TopologyRequest, WireError,
};

use crate::policy::RoundPolicy;
use crate::sync::{ChunkMeta, Phase};

/// A control message between a node and the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub enum Msg {
    /// A measured link (node -> scheduler).
    LinkReport {
        /// Sender.
        from: usize,
        /// Receiver (the reporting node).
        to: usize,
        /// Throughput, bit/s.
        throughput_bps: u64,
        /// Chunks measured.
        samples: usize,
        /// The reporting node's round.
        round: u32,
    },
    /// TRP before a PUSH (node -> scheduler).
    TopologyRequest {
        /// The node.
        node: usize,
        /// The policy version it holds (0: none).
        version: u32,
        /// The round it is about to start.
        round: u32,
    },
    /// The round's policy (scheduler -> node).
    PolicyUpdate(u32, RoundPolicy),
    /// The node's version is the round's (scheduler -> node).
    PolicyConfirm {
        /// The version.
        version: u32,
        /// The round.
        round: u32,
    },
}

fn node16(v: usize) -> Result<u16, WireError> {
    u16::try_from(v).map_err(|_| WireError::Field {
        field: "node",
        value: v as u64,
        why: "node ids fit 16 bits",
    })
}

/// Encode a control message.
pub fn encode_msg(m: &Msg) -> Result<Vec<u8>, WireError> {
    let w = match m {
        Msg::LinkReport {
            from,
            to,
            throughput_bps,
            samples,
            round,
        } => Message::LinkReport(LinkReport {
            from: node16(*from)?,
            to: node16(*to)?,
            throughput_bps: *throughput_bps,
            samples: u16::try_from(*samples).unwrap_or(u16::MAX),
            measured_at_round: *round,
        }),
        Msg::TopologyRequest {
            node,
            version,
            round,
        } => Message::TopologyRequest(TopologyRequest {
            node: node16(*node)?,
            version: *version,
            round: *round,
        }),
        Msg::PolicyUpdate(round, p) => Message::PolicyUpdate(PolicyUpdate {
            version: p.version,
            round: *round,
            policy: p.policy.clone(),
        }),
        Msg::PolicyConfirm { version, round } => Message::PolicyConfirm(PolicyConfirm {
            version: *version,
            round: *round,
        }),
    };
    emit(&w)
}

fn emit(w: &Message) -> Result<Vec<u8>, WireError> {
    let mut buf = vec![0u8; w.buffer_len()];
    let n = w.emit(&mut buf)?;
    buf.truncate(n);
    Ok(buf)
}

/// Decode a control message.
pub fn decode_msg(b: &[u8]) -> Result<Msg, WireError> {
    Ok(match Message::parse(b)? {
        Message::LinkReport(r) => Msg::LinkReport {
            from: usize::from(r.from),
            to: usize::from(r.to),
            throughput_bps: r.throughput_bps,
            samples: usize::from(r.samples),
            round: r.measured_at_round,
        },
        Message::TopologyRequest(t) => Msg::TopologyRequest {
            node: usize::from(t.node),
            version: t.version,
            round: t.round,
        },
        Message::PolicyUpdate(u) => {
            Msg::PolicyUpdate(u.round, RoundPolicy::new(u.version, u.policy))
        }
        Message::PolicyConfirm(c) => Msg::PolicyConfirm {
            version: c.version,
            round: c.round,
        },
        Message::Chunk(_) => {
            return Err(WireError::Field {
                field: "kind",
                value: Kind::Chunk as u64,
                why: "a chunk header is not a control message",
            })
        }
    })
}

/// Encode a chunk's metadata.
pub fn encode(m: &ChunkMeta) -> Result<Vec<u8>, WireError> {
    let phase = match m.phase {
        Phase::Push => WirePhase::Push,
        Phase::Pull => WirePhase::Pull,
    };
    let h = ChunkHeader {
        version: m.version,
        round: m.round,
        root: node16(m.root)?,
        chunk: u32::try_from(m.chunk).map_err(|_| WireError::Field {
            field: "chunk",
            value: m.chunk as u64,
            why: "chunk ids fit 32 bits",
        })?,
        phase,
        is_aux: !m.path.is_empty(),
        path: m
            .path
            .iter()
            .map(|&v| node16(v))
            .collect::<Result<_, _>>()?,
        hop: u8::try_from(m.hop).map_err(|_| WireError::Field {
            field: "hop",
            value: m.hop as u64,
            why: "a path has at most 64 nodes",
        })?,
    };
    emit(&Message::Chunk(h))
}

/// Decode a chunk's metadata.
pub fn decode(b: &[u8]) -> Result<ChunkMeta, WireError> {
    let h = match Message::parse(b)? {
        Message::Chunk(h) => h,
        other => {
            return Err(WireError::WrongKind {
                expected: Kind::Chunk,
                got: other.kind(),
            })
        }
    };
    Ok(ChunkMeta {
        version: h.version,
        round: h.round,
        phase: match h.phase {
            WirePhase::Push => Phase::Push,
            WirePhase::Pull => Phase::Pull,
        },
        root: usize::from(h.root),
        chunk: h.chunk as usize,
        path: h.path.iter().map(|&v| usize::from(v)).collect(),
        hop: usize::from(h.hop),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_metadata_round_trips() {
        let m = ChunkMeta {
            version: 3,
            round: 9,
            phase: Phase::Push,
            root: 2,
            chunk: 17,
            path: vec![1, 4, 2],
            hop: 1,
        };
        assert_eq!(decode(&encode(&m).unwrap()).unwrap(), m);
        let primary = ChunkMeta {
            path: Vec::new(),
            hop: 0,
            phase: Phase::Pull,
            ..m
        };
        assert_eq!(decode(&encode(&primary).unwrap()).unwrap(), primary);
        assert!(decode(&[1, 2, 3]).is_err());
    }

    #[test]
    fn control_messages_round_trip() {
        for m in [
            Msg::TopologyRequest {
                node: 3,
                version: 0,
                round: 5,
            },
            Msg::PolicyConfirm {
                version: 2,
                round: 5,
            },
            Msg::LinkReport {
                from: 1,
                to: 3,
                throughput_bps: 12_000_000,
                samples: 4,
                round: 5,
            },
        ] {
            assert_eq!(decode_msg(&encode_msg(&m).unwrap()).unwrap(), m);
        }
    }
}
