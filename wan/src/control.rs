//! The control connection between a node and the scheduler: a TCP stream of NetStorm
//! frames ([`gradwire_netstorm::wire`]), each bounded by its kind before it is read.
//!
//! Node -> scheduler: link reports, and a topology request (TRP) before each PUSH. Scheduler -> node: the round's policy (an update) or a confirmation that the
//! node's version is current.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use gradwire_netstorm::consistency::Reply;
use gradwire_netstorm::wire::{frame_len, Message, TopologyRequest, WireError, HEADER_LEN};

use crate::error::{TimedOut, WanError};

/// Write one NetStorm frame.
pub fn write_frame(s: &mut TcpStream, m: &Message) -> std::io::Result<()> {
    let bytes = m
        .to_vec()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    s.write_all(&bytes)
}

/// Read one NetStorm frame: its header first, whose bounded length says how much more to
/// read (the stream's read timeout bounds the wait).
pub fn read_frame(s: &mut TcpStream) -> std::io::Result<Message> {
    let bad = |e: WireError| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let mut buf = vec![0u8; HEADER_LEN];
    s.read_exact(&mut buf)?;
    let (_, total) = frame_len(&buf).map_err(bad)?;
    buf.resize(total, 0);
    s.read_exact(&mut buf[HEADER_LEN..])?;
    Message::parse(&buf).map_err(bad)
}

/// A node's end of the control connection.
#[derive(Debug)]
pub struct SchedulerClient {
    stream: TcpStream,
    addr: SocketAddr,
    /// The read timeout: the longest wait for an answer (the node's round timeout).
    timeout: Duration,
}

impl SchedulerClient {
    /// Connect, retrying until `timeout` (the scheduler may still be starting).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self, WanError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(WanError::Scheduler {
                        addr,
                        error: format!(
                            "no connection within {timeout:?}, the round timeout (last: {e}; \
                             is the scheduler running?)"
                        ),
                        timed_out: Some(TimedOut {
                            timeout,
                            waited: started.elapsed(),
                        }),
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let io = |e: std::io::Error| WanError::Scheduler {
            addr,
            error: e.to_string(),
            timed_out: None,
        };
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        Ok(SchedulerClient {
            stream,
            addr,
            timeout,
        })
    }

    fn err(&self, error: String) -> WanError {
        WanError::Scheduler {
            addr: self.addr,
            error,
            timed_out: None,
        }
    }

    /// Send one message.
    pub fn send(&mut self, m: &Message) -> Result<(), WanError> {
        write_frame(&mut self.stream, m).map_err(|e| self.err(format!("sending: {e}")))
    }

    /// TRP: send the request and block for the answer (the read timeout bounds the wait).
    pub fn request(&mut self, req: TopologyRequest) -> Result<Reply, WanError> {
        let round = req.round;
        self.send(&Message::TopologyRequest(req))?;
        let asked = Instant::now();
        let answer = read_frame(&mut self.stream).map_err(|e| {
            let waited = asked.elapsed();
            // The read timeout is the round timeout: say so, not "os error 11".
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                WanError::Scheduler {
                    addr: self.addr,
                    error: format!(
                        "waiting for round {round}'s policy: no answer within {:?}, the round \
                         timeout (waited {waited:.1?})",
                        self.timeout
                    ),
                    timed_out: Some(TimedOut {
                        timeout: self.timeout,
                        waited,
                    }),
                }
            } else {
                self.err(format!("waiting for round {round}'s policy: {e}"))
            }
        })?;
        match answer {
            Message::PolicyUpdate(u) => Ok(Reply::Update(u)),
            Message::PolicyConfirm(c) => Ok(Reply::Confirm(c)),
            other => Err(self.err(format!(
                "a {:?} in answer to a topology request",
                other.kind()
            ))),
        }
    }
}
