//! The control connection between a node and the scheduler: a TCP stream of NetStorm
//! frames ([`gradwire_netstorm::wire`]), each bounded by its kind before it is read.
//!
//! Node -> scheduler: link reports, and a topology request (TRP) before each PUSH. Scheduler -> node: the round's policy (an update) or a confirmation that the
//! node's version is current.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use gradwire_netstorm::consistency::Reply;
use gradwire_netstorm::wire::{frame_len, Message, TopologyRequest, WireError, HEADER_LEN};

use crate::error::{TimedOut, WanError};
use crate::seal::{ControlAuth, Seal, TAG_LEN};

/// Read one NetStorm frame: its header first, whose bounded length says how much more to
/// read (the stream's read timeout bounds the wait).
pub fn read_frame(s: &mut TcpStream) -> std::io::Result<Message> {
    read_sealed(s, None)
}

/// [`read_frame`], then (authenticated) its tag, checked before the frame is parsed.
fn read_sealed(s: &mut TcpStream, seal: Option<&mut Seal>) -> std::io::Result<Message> {
    let bad = |e: WireError| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let mut buf = vec![0u8; HEADER_LEN];
    s.read_exact(&mut buf)?;
    let (_, total) = frame_len(&buf).map_err(bad)?;
    buf.resize(total, 0);
    s.read_exact(&mut buf[HEADER_LEN..])?;
    if let Some(seal) = seal {
        let mut tag = [0u8; TAG_LEN];
        s.read_exact(&mut tag)?;
        if !seal.check(&buf, &tag) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a frame whose tag does not verify (altered, or not from the scheduler)",
            ));
        }
    }
    Message::parse(&buf).map_err(bad)
}

/// A node's end of the control connection. It connects right before its first frame, not
/// when it is made: the scheduler closes a connection whose first frame has not come within
/// [`HELLO_TIMEOUT`](crate::scheduler::HELLO_TIMEOUT), and a node may compute for longer than
/// that before its first round.
#[derive(Debug)]
pub struct SchedulerClient {
    stream: Option<TcpStream>,
    addr: SocketAddr,
    /// The local address the connection comes from (`None`: the routing table's choice).
    from: Option<IpAddr>,
    /// The read timeout: the longest wait for an answer (the node's round timeout), and for
    /// the connection.
    timeout: Duration,
    /// Authenticated jobs: the keys, and the node this client speaks for.
    auth: Option<(ControlAuth, u16)>,
    /// The connection's tags (authenticated jobs), made with the connection.
    seal: Option<Seal>,
}

impl SchedulerClient {
    /// A client of the scheduler at `addr`, connecting at its first frame (retrying until
    /// `timeout`: the scheduler may still be starting).
    pub fn new(addr: SocketAddr, timeout: Duration) -> Self {
        SchedulerClient {
            stream: None,
            addr,
            from: None,
            timeout,
            auth: None,
            seal: None,
        }
    }

    /// Authenticates the connection as `node` of an authenticated job ([`crate::seal`]): a
    /// hello when it connects, a tag after every frame each way.
    pub fn authenticated(mut self, auth: ControlAuth, node: u16) -> Self {
        self.auth = Some((auth, node));
        self
    }

    /// Connects from local address `ip` (port chosen by the kernel), the address the node
    /// published: the scheduler accepts a node only from that address, and on a host with
    /// several addresses (or a loopback alias such as 127.0.0.3, which the kernel would
    /// leave for 127.0.0.1) the routing table may pick another. An unspecified `ip` leaves
    /// the choice to the routing table.
    pub fn from_ip(mut self, ip: IpAddr) -> Self {
        self.from = Some(ip).filter(|ip| !ip.is_unspecified());
        self
    }

    /// Connect now, retrying until `timeout` (the scheduler may still be starting); the first
    /// frame must follow within the scheduler's first-frame timeout.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self, WanError> {
        let mut c = Self::new(addr, timeout);
        c.conn()?;
        Ok(c)
    }

    /// The connection and (authenticated) its tags, made now if there is none yet (the
    /// hello exchanged).
    fn conn(&mut self) -> Result<(&mut TcpStream, Option<&mut Seal>), WanError> {
        let (addr, from, timeout) = (self.addr, self.from, self.timeout);
        if self.stream.is_none() {
            let mut s = open(addr, from, timeout)?;
            if let Some((auth, node)) = &self.auth {
                let seal = auth
                    .client(&mut s, *node)
                    .map_err(|e| WanError::Scheduler {
                        addr,
                        error: format!(
                            "authenticating the connection as node {node}: {e} (does the \
                         scheduler run with the same job secret?)"
                        ),
                        timed_out: None,
                    })?;
                self.seal = Some(seal);
            }
            self.stream = Some(s);
        }
        let s = self
            .stream
            .as_mut()
            .ok_or_else(|| WanError::Internal("no scheduler connection".into()))?;
        Ok((s, self.seal.as_mut()))
    }

    fn err(&self, error: String) -> WanError {
        scheduler_error(self.addr, error)
    }

    /// Send one message (with its tag, authenticated).
    pub fn send(&mut self, m: &Message) -> Result<(), WanError> {
        let addr = self.addr;
        let mut bytes = m.to_vec().map_err(|e| self.err(format!("sending: {e}")))?;
        let (s, seal) = self.conn()?;
        if let Some(seal) = seal {
            let tag = seal.tag(&bytes);
            bytes.extend_from_slice(&tag);
        }
        s.write_all(&bytes)
            .map_err(|e| scheduler_error(addr, format!("sending: {e}")))
    }

    /// TRP: send the request and block for the answer (the read timeout bounds the wait).
    pub fn request(&mut self, req: TopologyRequest) -> Result<Reply, WanError> {
        let round = req.round;
        self.send(&Message::TopologyRequest(req))?;
        let asked = Instant::now();
        let (s, seal) = self.conn()?;
        let answer = read_sealed(s, seal).map_err(|e| {
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

fn scheduler_error(addr: SocketAddr, error: String) -> WanError {
    WanError::Scheduler {
        addr,
        error,
        timed_out: None,
    }
}

/// One connection attempt to `addr` from local address `from` (`None`: the routing table's
/// choice), within `timeout`.
fn connect_once(
    addr: SocketAddr,
    from: Option<IpAddr>,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let Some(ip) = from else {
        return TcpStream::connect_timeout(&addr, timeout);
    };
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.bind(&SocketAddr::new(ip, 0).into())?;
    sock.connect_timeout(&addr.into(), timeout)?;
    Ok(sock.into())
}

/// Connect to the scheduler at `addr` from `from`, retrying until `timeout` (it may still be
/// starting).
fn open(addr: SocketAddr, from: Option<IpAddr>, timeout: Duration) -> Result<TcpStream, WanError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let stream = loop {
        match connect_once(addr, from, Duration::from_secs(1)) {
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
    Ok(stream)
}
