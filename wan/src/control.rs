//! The control connection between a node and the scheduler: length-prefixed frames (`u32`
//! big-endian length, at most [`MAX_FRAME`] bytes) of NetStorm's messages
//! ([`gradwire_netstorm::wire`]).
//!
//! Node -> scheduler: link reports, and a topology request (TRP) before each PUSH. Scheduler -> node: the round's policy (an update) or a confirmation that the
//! node's version is current.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use gradwire_netstorm::awareness::Measurement;

use crate::error::WanError;
use crate::meta::{self, Msg};
use crate::policy::RoundPolicy;

/// Largest control frame: bounds what a peer can make the other end allocate.
pub const MAX_FRAME: usize = 1 << 20;

/// Write one frame.
pub fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame too long"))?;
    let mut buf = Vec::with_capacity(4 + bytes.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(bytes);
    s.write_all(&buf)
}

/// Read one frame (the stream's read timeout bounds the wait).
pub fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a control frame of {len} bytes is above {MAX_FRAME}"),
        ));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// The scheduler's answer to a topology request.
#[derive(Debug)]
pub enum Answer {
    /// A newer policy.
    Update(RoundPolicy),
    /// The node's version is the round's.
    Confirm(u32),
}

/// A node's end of the control connection.
#[derive(Debug)]
pub struct SchedulerClient {
    rank: usize,
    stream: TcpStream,
    addr: SocketAddr,
    /// The last policy received (a confirmation refers to it).
    held: Option<RoundPolicy>,
}

impl SchedulerClient {
    /// Connect (retrying until `timeout`: the scheduler may still be starting) and say hello.
    pub fn connect(addr: SocketAddr, rank: usize, timeout: Duration) -> Result<Self, WanError> {
        let deadline = std::time::Instant::now() + timeout;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if std::time::Instant::now() >= deadline => {
                    return Err(WanError::Scheduler {
                        addr,
                        error: format!("connect: {e} (is the scheduler running?)"),
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let io = |e: std::io::Error| WanError::Scheduler {
            addr,
            error: e.to_string(),
        };
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        Ok(SchedulerClient {
            rank,
            stream,
            addr,
            held: None,
        })
    }

    fn send(&mut self, m: &Msg) -> Result<(), WanError> {
        let bytes = meta::encode_msg(m).map_err(|e| WanError::Internal(e.to_string()))?;
        write_frame(&mut self.stream, &bytes).map_err(|e| WanError::Scheduler {
            addr: self.addr,
            error: format!("sending: {e}"),
        })
    }

    /// TRP: ask for round `round`'s policy, holding `version`; blocks for the answer.
    pub fn request(&mut self, version: u32, round: u32) -> Result<Answer, WanError> {
        self.send(&Msg::TopologyRequest {
            node: self.rank,
            version,
            round,
        })?;
        let bytes = read_frame(&mut self.stream).map_err(|e| WanError::Scheduler {
            addr: self.addr,
            error: format!("waiting for round {round}'s policy: {e}"),
        })?;
        match meta::decode_msg(&bytes).map_err(|e| WanError::Scheduler {
            addr: self.addr,
            error: format!("invalid answer: {e}"),
        })? {
            Msg::PolicyUpdate(r, p) if r == round => {
                self.held = Some(p.clone());
                Ok(Answer::Update(p))
            }
            Msg::PolicyConfirm { version, round: r } if r == round => Ok(Answer::Confirm(version)),
            other => Err(WanError::Scheduler {
                addr: self.addr,
                error: format!("unexpected answer to a topology request: {other:?}"),
            }),
        }
    }

    /// The policy a confirmation of `version` refers to.
    pub fn current(&self, version: u32) -> Result<RoundPolicy, WanError> {
        match &self.held {
            Some(p) if p.version == version => Ok(p.clone()),
            _ => Err(WanError::Scheduler {
                addr: self.addr,
                error: format!("confirmed version {version}, which this node never received"),
            }),
        }
    }

    /// Report a measured link.
    pub fn report(&mut self, m: &Measurement, round: u32) -> Result<(), WanError> {
        self.send(&Msg::LinkReport {
            from: m.from,
            to: m.to,
            throughput_bps: m.throughput_bps as u64,
            samples: m.samples,
            round,
        })
    }
}
