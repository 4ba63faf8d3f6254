//! The reliable control channel: kernel TCP in production, an in-memory pair in tests.
//!
//! Control messages are few and small (a handful per tensor plus one rate report per
//! period), so a plain TCP stream with `TCP_NODELAY` carries them. The socket is tagged with
//! the control DSCP so switches serve it from the reserved highest-priority queue (DLCP §4.1:
//! "we reserve a separate priority for them").

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeSpec;

use crate::message::{CtrlError, CtrlMsg, Decoder};

/// DSCP of the control channel by default: the one definition in `gradwire-qos`, which the
/// switch policy maps to the reserved highest-priority queue.
pub const DEFAULT_CONTROL_DSCP: u8 = gradwire_qos::CONTROL_DSCP;

/// Why the control channel failed.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// An OS error on the stream.
    #[error("control channel to {peer}: {source}")]
    Io {
        /// Peer.
        peer: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The peer closed the stream.
    #[error("control channel to {peer} closed by the peer")]
    Closed {
        /// Peer.
        peer: String,
    },
    /// The peer sent bytes that are not a valid control message.
    #[error("malformed control message from {peer}: {source}")]
    Malformed {
        /// Peer.
        peer: String,
        /// Decode error.
        source: CtrlError,
    },
    /// A message of ours could not be encoded (a bug or an oversized request).
    #[error("cannot encode control message: {0}")]
    Encode(CtrlError),
    /// Writing did not complete in time: the peer stopped reading.
    #[error("control channel to {peer}: write stalled for {timeout:?}")]
    WriteStalled {
        /// Peer.
        peer: String,
        /// How long we waited.
        timeout: Duration,
    },
}

/// A reliable, ordered message channel.
pub trait CtrlChannel {
    /// Peer description for errors.
    fn peer(&self) -> String;
    /// The peer's IP address, where the channel has one: a receiver binds a flow's wildcard
    /// data sources to it (an in-memory channel has none).
    fn peer_ip(&self) -> Option<std::net::IpAddr> {
        None
    }
    /// The session keys of an authenticated channel (the handshake proved the job secret on
    /// both ends): the drivers derive each flow's data key from them. `None`: plain channel.
    fn session(&self) -> Option<&gradwire_proto::auth::SessionKeys> {
        None
    }
    /// Send one message (reliably, in order).
    fn send(&mut self, msg: &CtrlMsg) -> Result<(), ChannelError>;
    /// Receive one message, waiting at most `timeout` (zero: don't wait).
    fn recv(&mut self, timeout: Duration) -> Result<Option<CtrlMsg>, ChannelError>;
}

/// The control channel over a TCP stream.
#[derive(Debug)]
pub struct TcpCtrl {
    stream: TcpStream,
    peer: SocketAddr,
    dec: Decoder,
    out: Vec<u8>,
    buf: Box<[u8]>,
    write_timeout: Duration,
}

impl TcpCtrl {
    /// Wrap a connected stream, tagging it with `dscp` (None leaves the TOS alone).
    pub fn new(stream: TcpStream, dscp: Option<u8>) -> Result<TcpCtrl, ChannelError> {
        let peer = stream.peer_addr().map_err(|source| ChannelError::Io {
            peer: "?".into(),
            source,
        })?;
        let err = |source| ChannelError::Io {
            peer: peer.to_string(),
            source,
        };
        stream.set_nodelay(true).map_err(err)?;
        stream.set_nonblocking(true).map_err(err)?;
        if let Some(d) = dscp {
            let tos = i32::from(d & 0x3f) << 2;
            let r = if peer.is_ipv4() {
                setsockopt(&stream, sockopt::Ipv4Tos, &tos)
            } else {
                setsockopt(&stream, sockopt::Ipv6TClass, &tos)
            };
            r.map_err(|e| err(e.into()))?;
        }
        Ok(TcpCtrl {
            stream,
            peer,
            dec: Decoder::new(),
            out: Vec::new(),
            buf: vec![0u8; 64 * 1024].into_boxed_slice(),
            write_timeout: Duration::from_secs(10),
        })
    }

    /// Connect to `addr`, waiting at most `timeout`.
    pub fn connect(
        addr: SocketAddr,
        timeout: Duration,
        dscp: Option<u8>,
    ) -> Result<TcpCtrl, ChannelError> {
        let stream =
            TcpStream::connect_timeout(&addr, timeout).map_err(|source| ChannelError::Io {
                peer: addr.to_string(),
                source,
            })?;
        TcpCtrl::new(stream, dscp)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn wait(&self, flags: PollFlags, timeout: Duration) -> Result<bool, ChannelError> {
        let mut fds = [PollFd::new(self.stream.as_fd(), flags)];
        match ppoll(&mut fds, Some(TimeSpec::from_duration(timeout)), None) {
            Ok(n) => Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(ChannelError::Io {
                peer: self.peer.to_string(),
                source: e.into(),
            }),
        }
    }
}

impl CtrlChannel for TcpCtrl {
    fn peer(&self) -> String {
        self.peer.to_string()
    }

    fn peer_ip(&self) -> Option<std::net::IpAddr> {
        Some(self.peer.ip())
    }

    fn send(&mut self, msg: &CtrlMsg) -> Result<(), ChannelError> {
        self.out.clear();
        msg.encode(&mut self.out).map_err(ChannelError::Encode)?;
        let mut written = 0;
        let deadline = Instant::now() + self.write_timeout;
        while written < self.out.len() {
            match self.stream.write(&self.out[written..]) {
                Ok(0) => return Err(ChannelError::Closed { peer: self.peer() }),
                Ok(n) => written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ChannelError::WriteStalled {
                            peer: self.peer(),
                            timeout: self.write_timeout,
                        });
                    }
                    self.wait(PollFlags::POLLOUT, left)?;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) =>
                {
                    return Err(ChannelError::Closed { peer: self.peer() })
                }
                Err(source) => {
                    return Err(ChannelError::Io {
                        peer: self.peer(),
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<CtrlMsg>, ChannelError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.dec.next() {
                Ok(Some(m)) => return Ok(Some(m)),
                Ok(None) => {}
                Err(source) => {
                    return Err(ChannelError::Malformed {
                        peer: self.peer(),
                        source,
                    })
                }
            }
            match self.stream.read(&mut self.buf) {
                Ok(0) => return Err(ChannelError::Closed { peer: self.peer() }),
                Ok(n) => {
                    let Self { dec, buf, .. } = self;
                    dec.push(&buf[..n]);
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                    return Err(ChannelError::Closed { peer: self.peer() })
                }
                Err(source) => {
                    return Err(ChannelError::Io {
                        peer: self.peer(),
                        source,
                    })
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.wait(PollFlags::POLLIN, left)? {
                return Ok(None);
            }
        }
    }
}

/// One end of an in-memory control channel pair.
#[derive(Debug)]
pub struct MemCtrl {
    name: &'static str,
    tx: Sender<CtrlMsg>,
    rx: Receiver<CtrlMsg>,
}

impl MemCtrl {
    /// Two connected ends.
    pub fn pair() -> (MemCtrl, MemCtrl) {
        let (a_tx, b_rx) = crossbeam_channel::unbounded();
        let (b_tx, a_rx) = crossbeam_channel::unbounded();
        (
            MemCtrl {
                name: "mem:a",
                tx: a_tx,
                rx: a_rx,
            },
            MemCtrl {
                name: "mem:b",
                tx: b_tx,
                rx: b_rx,
            },
        )
    }
}

impl CtrlChannel for MemCtrl {
    fn peer(&self) -> String {
        self.name.to_string()
    }

    fn send(&mut self, msg: &CtrlMsg) -> Result<(), ChannelError> {
        // Validate exactly as the TCP channel would encode it, so tests catch oversize messages.
        msg.validate().map_err(ChannelError::Encode)?;
        self.tx
            .send(msg.clone())
            .map_err(|_| ChannelError::Closed { peer: self.peer() })
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<CtrlMsg>, ChannelError> {
        match self.rx.recv_timeout(timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => {
                // A zero timeout can race an in-flight send; crossbeam's try path covers it.
                Ok(None)
            }
            Err(RecvTimeoutError::Disconnected) => Err(ChannelError::Closed { peer: self.peer() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn tcp_round_trip_and_close_is_an_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut a =
            TcpCtrl::connect(addr, Duration::from_secs(2), Some(DEFAULT_CONTROL_DSCP)).unwrap();
        let (s, _) = l.accept().unwrap();
        let mut b = TcpCtrl::new(s, None).unwrap();
        assert!(b.recv(Duration::from_millis(5)).unwrap().is_none());
        a.send(&CtrlMsg::FinishConfirm).unwrap();
        a.send(&CtrlMsg::FlowStop {
            pass: 3,
            segments_sent: 9,
        })
        .unwrap();
        assert_eq!(
            b.recv(Duration::from_secs(2)).unwrap(),
            Some(CtrlMsg::FinishConfirm)
        );
        assert_eq!(
            b.recv(Duration::from_secs(2)).unwrap(),
            Some(CtrlMsg::FlowStop {
                pass: 3,
                segments_sent: 9
            })
        );
        drop(a);
        assert!(matches!(
            b.recv(Duration::from_secs(2)),
            Err(ChannelError::Closed { .. })
        ));
    }

    #[test]
    fn a_peer_that_stops_reading_stalls_the_write_into_an_error() {
        // Documented (docs/protocol.md, Timers): writing one control message while the peer
        // does not read fails with `WriteStalled` after the write-stall limit, 10 s.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut a = TcpCtrl::connect(addr, Duration::from_secs(2), None).unwrap();
        assert_eq!(
            a.write_timeout,
            Duration::from_secs(10),
            "the documented limit"
        );
        // The peer accepts and never reads; small buffers on both ends fill quickly.
        let (peer, _) = l.accept().unwrap();
        setsockopt(&peer, sockopt::RcvBuf, &4096).unwrap();
        setsockopt(&a.stream, sockopt::SndBuf, &4096).unwrap();
        // The limit itself is what is under test, not its size: a short one keeps this fast.
        let limit = Duration::from_millis(300);
        a.write_timeout = limit;
        let msg = CtrlMsg::Abort {
            code: 1,
            reason: "x".repeat(crate::message::MAX_REASON),
        };
        // The buffers take a bounded number of messages; the first send that cannot complete
        // must fail, after the limit and not much later.
        let mut accepted = 0usize;
        let (err, took) = loop {
            let t = Instant::now();
            match a.send(&msg) {
                Ok(()) => accepted += 1,
                Err(e) => break (e, t.elapsed()),
            }
            assert!(accepted < 10_000, "sends never stalled");
        };
        assert!(
            matches!(err, ChannelError::WriteStalled { timeout, .. } if timeout == limit),
            "{err}"
        );
        assert!(err.to_string().contains("write stalled"), "{err}");
        assert!(took >= limit, "gave up after {took:?}, before the limit");
        assert!(
            took < limit + Duration::from_secs(2),
            "gave up after {took:?}, long after the limit"
        );
        drop(peer);
    }

    #[test]
    fn garbage_from_peer_is_a_clear_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut raw = TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        let mut b = TcpCtrl::new(s, None).unwrap();
        raw.write_all(&[0, 0, 0, 2, 9, 9]).unwrap();
        let e = b.recv(Duration::from_secs(2)).unwrap_err();
        assert!(matches!(e, ChannelError::Malformed { .. }), "{e}");
    }
}
