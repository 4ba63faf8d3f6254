//! The reliable control channel: kernel TCP in production, an in-memory pair in tests.
//!
//! Control messages are few and small (a handful per tensor plus one rate report per
//! period), so a plain TCP stream with `TCP_NODELAY` carries them. The socket is tagged with
//! the control DSCP so switches serve it from the reserved highest-priority queue (DLCP §4.1:
//! "we reserve a separate priority for them").
//!
//! Every TCP connection opens with the handshake of [`gradwire_proto::handshake`], within a
//! time bound: [`TcpCtrl::connect`] / [`TcpCtrl::connect_with`] / [`TcpCtrl::client_handshake`]
//! run the client side, [`TcpCtrl::accept_handshake`] (and the
//! [`CtrlListener`](crate::ctrl_listener::CtrlListener)) the server side. While it runs, a
//! frame may announce at most [`MAX_HANDSHAKE_BODY`] bytes and nothing beyond one frame is
//! buffered, so a peer that does not speak gradwire costs a fixed few hundred bytes for at
//! most the timeout. With a job key the connection is authenticated: every frame after the
//! handshake is followed by a [`CTRL_TAG_LEN`]-byte seal, verified before the frame is decoded;
//! a frame that fails is [`ChannelError::Malformed`] with [`CtrlError::BadSeal`], and nothing
//! after it is read.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use gradwire_proto::auth::{
    CtrlOpener, CtrlSealer, Ephemeral, JobKey, Role, SessionKeys, CTRL_TAG_LEN, NONCE_LEN,
};
use gradwire_proto::handshake::{
    ClientHandshake, HandshakeError, Refusal, ServerHandshake, Step, ABORT_AUTH,
};
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeSpec;

use crate::message::{CtrlError, CtrlMsg, Decoder, LEN_PREFIX};

/// DSCP of the control channel by default: the one definition in `gradwire-qos`, which the
/// switch policy maps to the reserved highest-priority queue.
pub const DEFAULT_CONTROL_DSCP: u8 = gradwire_qos::CONTROL_DSCP;

/// Longest body a handshake frame may announce. `Hello`, `Challenge`, `Proof` and `Welcome`
/// are at most 66 bytes; the `Abort` carrying a refusal's reason is the longest, under 200.
/// Anything longer is garbage, refused as soon as its length prefix arrives, without
/// buffering it.
pub const MAX_HANDSHAKE_BODY: u32 = 256;

/// Bound on a handshake's time that [`crate::ctrl_listener::ListenerConfig`] uses by default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// Bytes one handshake keeps of its peer's stream: one whole frame and its seal.
const HANDSHAKE_BUF: usize = LEN_PREFIX + MAX_HANDSHAKE_BODY as usize + CTRL_TAG_LEN;

/// How long a write may wait for the peer to read once the connection is established.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// The peer sent bytes that are not a valid control message, or (authenticated
    /// connection) a frame whose seal does not verify ([`CtrlError::BadSeal`]). Fatal: close.
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
    /// The handshake refused the connection: the peer refused us (an `Abort` with code
    /// [`ABORT_AUTH`], its reason says why and what to do), or we refused it (authentication
    /// modes differ, the job secrets differ).
    #[error("control channel to {peer} refused at the handshake: {reason}")]
    Refused {
        /// Peer.
        peer: String,
        /// Why, and what to do.
        reason: String,
    },
    /// The handshake did not complete: no answer in time, a peer that is not a gradwire
    /// endpoint of this control protocol version, or one that broke the handshake.
    #[error("control channel to {peer}: handshake failed: {reason}")]
    Handshake {
        /// Peer.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// No sender completed a handshake on a [`crate::ctrl_listener::CtrlListener`] in time.
    #[error(
        "no sender completed a control handshake on {local} within {timeout:?}: is the sender \
         started, pointed at this address, and holding the same job secret (or none)?"
    )]
    AcceptTimeout {
        /// The listener's address.
        local: String,
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

/// The control channel over a TCP stream, after its handshake.
#[derive(Debug)]
pub struct TcpCtrl {
    stream: TcpStream,
    peer: SocketAddr,
    dec: Decoder,
    out: Vec<u8>,
    buf: Box<[u8]>,
    write_timeout: Duration,
    /// Authenticated connections: seals the frames we send.
    sealer: Option<CtrlSealer>,
    /// Authenticated connections: verifies the frames we receive.
    opener: Option<CtrlOpener>,
    /// Authenticated connections: the session's keys (flows derive their data keys).
    session: Option<SessionKeys>,
}

/// `TCP_NODELAY`, nonblocking and the DSCP on a connected stream; its peer's address.
fn prepare(stream: &TcpStream, dscp: Option<u8>) -> Result<SocketAddr, ChannelError> {
    let peer = stream.peer_addr().map_err(|source| ChannelError::Io {
        peer: "?".into(),
        source,
    })?;
    prepare_stream(stream, dscp).map_err(|source| ChannelError::Io {
        peer: peer.to_string(),
        source,
    })?;
    Ok(peer)
}

/// `TCP_NODELAY`, nonblocking and the DSCP (None leaves the TOS alone).
pub(crate) fn prepare_stream(stream: &TcpStream, dscp: Option<u8>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_nonblocking(true)?;
    if let Some(d) = dscp {
        let tos = i32::from(d & 0x3f) << 2;
        let v4 = stream.local_addr()?.is_ipv4();
        let r = if v4 {
            setsockopt(stream, sockopt::Ipv4Tos, &tos)
        } else {
            setsockopt(stream, sockopt::Ipv6TClass, &tos)
        };
        r.map_err(std::io::Error::from)?;
    }
    Ok(())
}

/// Waits up to `timeout` for `flags` on `fd`; false on timeout or a signal.
fn wait_fd(fd: BorrowedFd<'_>, flags: PollFlags, timeout: Duration) -> std::io::Result<bool> {
    let mut fds = [PollFd::new(fd, flags)];
    match ppoll(&mut fds, Some(TimeSpec::from_duration(timeout)), None) {
        Ok(n) => Ok(n > 0),
        Err(nix::errno::Errno::EINTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `N` fresh bytes from the OS's random source: the handshake's and the flows' nonces (they
/// key authenticated sessions and flows, so they must neither be predictable nor repeat).
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N], gradwire_proto::auth::AuthError> {
    gradwire_proto::auth::random(&ring::rand::SystemRandom::new())
}

/// A fresh random link token for [`TcpCtrl::connect_link`] and
/// [`ListenerConfig::link_token`](crate::ctrl_listener::ListenerConfig::link_token): as
/// unpredictable as a handshake nonce, because it is what tells a job's rank apart from
/// another process at its address.
pub fn fresh_link_token() -> Result<[u8; NONCE_LEN], ChannelError> {
    random_bytes().map_err(|_| ChannelError::Io {
        peer: "the OS random source".into(),
        source: std::io::Error::other("no random bytes for a link token"),
    })
}

/// A fresh handshake nonce.
fn handshake_nonce() -> Result<[u8; NONCE_LEN], HandshakeFailure> {
    random_bytes().map_err(|_| HandshakeFailure::Random)
}

/// A fresh ephemeral X25519 key from the OS's random source (one per handshake).
pub(crate) fn random_ephemeral() -> Result<Ephemeral, HandshakeFailure> {
    Ephemeral::generate(&ring::rand::SystemRandom::new()).map_err(|_| HandshakeFailure::Random)
}

impl TcpCtrl {
    /// Connect to `addr` and run the plain (unauthenticated) handshake, all within `timeout`.
    pub fn connect(
        addr: SocketAddr,
        timeout: Duration,
        dscp: Option<u8>,
    ) -> Result<TcpCtrl, ChannelError> {
        TcpCtrl::connect_with(addr, timeout, dscp, None)
    }

    /// Connect to `addr` and run the handshake, authenticated when `key` is given, all within
    /// `timeout`. A receiver in the other mode, or with another job secret, refuses:
    /// [`ChannelError::Refused`] with its reason.
    pub fn connect_with(
        addr: SocketAddr,
        timeout: Duration,
        dscp: Option<u8>,
        key: Option<&JobKey>,
    ) -> Result<TcpCtrl, ChannelError> {
        TcpCtrl::connect_from(None, addr, timeout, dscp, key)
    }

    /// [`TcpCtrl::connect_with`] from the local address `local` (port chosen by the kernel):
    /// on a host with several addresses the connection then comes from the one the peer
    /// expects, not from whichever the routing table picks.
    pub fn connect_from(
        local: Option<IpAddr>,
        addr: SocketAddr,
        timeout: Duration,
        dscp: Option<u8>,
        key: Option<&JobKey>,
    ) -> Result<TcpCtrl, ChannelError> {
        TcpCtrl::connect_link(local, addr, timeout, dscp, key, None)
    }

    /// [`TcpCtrl::connect_from`] to a link's listener that published `token`: a plain
    /// `Hello` carries it as its nonce (see [`ListenerConfig::link_token`](crate::ctrl_listener::ListenerConfig::link_token));
    /// an authenticated one does not need it.
    pub fn connect_link(
        local: Option<IpAddr>,
        addr: SocketAddr,
        timeout: Duration,
        dscp: Option<u8>,
        key: Option<&JobKey>,
        token: Option<[u8; NONCE_LEN]>,
    ) -> Result<TcpCtrl, ChannelError> {
        let deadline = Instant::now() + timeout;
        let io = |source| ChannelError::Io {
            peer: addr.to_string(),
            source,
        };
        let stream = match local {
            None => TcpStream::connect_timeout(&addr, timeout).map_err(io)?,
            Some(ip) => {
                let sock = socket2::Socket::new(
                    socket2::Domain::for_address(addr),
                    socket2::Type::STREAM,
                    Some(socket2::Protocol::TCP),
                )
                .map_err(io)?;
                sock.bind(&SocketAddr::new(ip, 0).into()).map_err(io)?;
                sock.connect_timeout(&addr.into(), timeout).map_err(io)?;
                sock.into()
            }
        };
        TcpCtrl::client_until(stream, dscp, key, token, deadline, timeout)
    }

    /// The client side of the handshake on a stream that is already connected (e.g. with
    /// retries while the receiver starts up), within `timeout`.
    pub fn client_handshake(
        stream: TcpStream,
        dscp: Option<u8>,
        key: Option<&JobKey>,
        timeout: Duration,
    ) -> Result<TcpCtrl, ChannelError> {
        TcpCtrl::client_until(stream, dscp, key, None, Instant::now() + timeout, timeout)
    }

    fn client_until(
        stream: TcpStream,
        dscp: Option<u8>,
        key: Option<&JobKey>,
        token: Option<[u8; NONCE_LEN]>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<TcpCtrl, ChannelError> {
        let peer = prepare(&stream, dscp)?;
        Handshaking::client(stream, peer, key, token)
            .and_then(|hs| hs.run_until(deadline, timeout))
            .map_err(|f| f.into_channel_error(peer))
    }

    /// The server side of the handshake on an accepted stream, within `timeout`: requires an
    /// authenticated client when `key` is given and refuses one otherwise. A refused client is
    /// told why (`Abort` code [`ABORT_AUTH`]) before the stream is closed. A listener that
    /// must not be held up by clients that do not speak is
    /// [`CtrlListener`](crate::ctrl_listener::CtrlListener).
    pub fn accept_handshake(
        stream: TcpStream,
        dscp: Option<u8>,
        key: Option<&JobKey>,
        timeout: Duration,
    ) -> Result<TcpCtrl, ChannelError> {
        let deadline = Instant::now() + timeout;
        let peer = prepare(&stream, dscp)?;
        Handshaking::server(stream, peer, key, None)
            .and_then(|hs| hs.run_until(deadline, timeout))
            .map_err(|f| f.into_channel_error(peer))
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The session's keys on an authenticated connection (flows derive their data keys
    /// from them); `None` on a plain one.
    pub fn session(&self) -> Option<&SessionKeys> {
        self.session.as_ref()
    }

    /// Whether the handshake authenticated both ends (every frame is sealed).
    pub fn is_authenticated(&self) -> bool {
        self.session.is_some()
    }

    /// Whether the peer has closed or reset the connection (looked at without blocking or
    /// reading): a connection that completed its handshake but whose client has gone since.
    pub fn peer_gone(&self) -> bool {
        // Bytes that came right behind the handshake (a FlowStart, say) are a message to
        // read, whatever the socket says now.
        if self.dec.buffered() > 0 {
            return false;
        }
        // The stream is non-blocking: a peek that would block means the peer is there and
        // quiet; 0 bytes means it closed; data pending means it is there.
        match self.stream.peek(&mut [0u8; 1]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
        }
    }

    fn wait(&self, flags: PollFlags, timeout: Duration) -> Result<bool, ChannelError> {
        wait_fd(self.stream.as_fd(), flags, timeout).map_err(|source| ChannelError::Io {
            peer: self.peer.to_string(),
            source,
        })
    }
}

impl CtrlChannel for TcpCtrl {
    fn peer(&self) -> String {
        self.peer.to_string()
    }

    fn peer_ip(&self) -> Option<std::net::IpAddr> {
        Some(self.peer.ip())
    }

    fn session(&self) -> Option<&SessionKeys> {
        self.session.as_ref()
    }

    fn send(&mut self, msg: &CtrlMsg) -> Result<(), ChannelError> {
        self.out.clear();
        msg.encode(&mut self.out).map_err(ChannelError::Encode)?;
        if let Some(sealer) = &mut self.sealer {
            let tag = sealer.seal(&self.out);
            self.out.extend_from_slice(&tag);
        }
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
            let Self { dec, opener, .. } = self;
            // An authenticated frame is decoded only after its seal verified.
            let next = dec.next_checked(|frame, seal| match opener {
                Some(o) => o.open(frame, seal),
                None => true,
            });
            match next {
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

/// Why a handshake did not complete: what the listener counts and logs, and what
/// [`HandshakeFailure::into_channel_error`] reports to a caller.
#[derive(Debug)]
pub(crate) enum HandshakeFailure {
    /// The deadline passed while waiting for `waiting_for`.
    TimedOut {
        /// What had not arrived.
        waiting_for: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer closed or reset the connection.
    Closed,
    /// An OS error on the socket.
    Io(std::io::Error),
    /// The peer does not read our few handshake bytes.
    Stalled,
    /// A frame announcing more than [`MAX_HANDSHAKE_BODY`] bytes.
    Oversized(u32),
    /// A frame that does not decode (or, sealed, does not verify).
    Garbage(CtrlError),
    /// A message out of place, or the peer aborted for another reason than authentication.
    Protocol(HandshakeError),
    /// We refused the peer (it was told why).
    Refused(Refusal),
    /// The peer refused us with this reason.
    PeerRefused(String),
    /// One of our handshake messages did not encode (a bug).
    Encode(CtrlError),
    /// The OS random source failed.
    Random,
}

impl std::fmt::Display for HandshakeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeFailure::TimedOut { waiting_for, after } => {
                write!(f, "no {waiting_for} within {after:?}")
            }
            HandshakeFailure::Closed => f.write_str("closed by the peer during the handshake"),
            HandshakeFailure::Io(e) => write!(f, "socket error during the handshake: {e}"),
            HandshakeFailure::Stalled => {
                f.write_str("the peer does not read the handshake's few bytes")
            }
            HandshakeFailure::Oversized(n) => write!(
                f,
                "garbage: a {n}-byte message announced during the handshake (at most \
                 {MAX_HANDSHAKE_BODY})"
            ),
            HandshakeFailure::Garbage(e) => write!(f, "garbage: {e}"),
            HandshakeFailure::Protocol(e) => write!(f, "protocol error: {e}"),
            HandshakeFailure::Refused(r) => f.write_str(match r {
                Refusal::UnauthenticatedPeer => "refused: unauthenticated sender",
                Refusal::AuthenticationUnavailable => {
                    "refused: authenticated sender, and this end has no job secret"
                }
                Refusal::SecretMismatch => "refused: secret mismatch (the proof does not verify)",
                Refusal::ServerNotProven => {
                    "refused: the receiver's proof does not verify (wrong secret?)"
                }
                Refusal::Downgrade => "refused: the receiver offered no authentication",
                Refusal::BadPublicKey => "refused: invalid ephemeral X25519 public key",
                Refusal::LinkToken => "refused: the Hello lacks this link's token",
            }),
            HandshakeFailure::PeerRefused(reason) => write!(f, "refused by the peer: {reason}"),
            HandshakeFailure::Encode(e) => write!(f, "cannot encode a handshake message: {e}"),
            HandshakeFailure::Random => f.write_str("the OS random source failed"),
        }
    }
}

impl HandshakeFailure {
    /// The error a caller of [`TcpCtrl::connect_with`] or [`TcpCtrl::accept_handshake`] sees.
    pub(crate) fn into_channel_error(self, peer: SocketAddr) -> ChannelError {
        let peer = peer.to_string();
        match self {
            HandshakeFailure::Io(source) => ChannelError::Io { peer, source },
            HandshakeFailure::Encode(e) => ChannelError::Encode(e),
            HandshakeFailure::Refused(r) => ChannelError::Refused {
                peer,
                reason: r.reason().to_owned(),
            },
            HandshakeFailure::PeerRefused(reason) => ChannelError::Refused { peer, reason },
            HandshakeFailure::Random => ChannelError::Io {
                peer,
                source: std::io::Error::other("the OS random source failed"),
            },
            f @ (HandshakeFailure::TimedOut { .. }
            | HandshakeFailure::Closed
            | HandshakeFailure::Garbage(_)
            | HandshakeFailure::Oversized(_)) => ChannelError::Handshake {
                peer,
                reason: format!(
                    "{f} (is a gradwire endpoint of control protocol version {} there?)",
                    crate::message::VERSION
                ),
            },
            f @ (HandshakeFailure::Stalled | HandshakeFailure::Protocol(_)) => {
                ChannelError::Handshake {
                    peer,
                    reason: f.to_string(),
                }
            }
        }
    }
}

/// Which end of the handshake.
#[derive(Debug)]
enum Side<'k> {
    Client(ClientHandshake<'k>),
    Server(ServerHandshake<'k>),
}

/// A connection whose handshake is under way, with nonblocking I/O: [`Handshaking::advance`]
/// reads what has arrived and answers it. It buffers at most one frame.
#[derive(Debug)]
pub(crate) struct Handshaking<'k> {
    stream: TcpStream,
    peer: SocketAddr,
    side: Side<'k>,
    buf: [u8; HANDSHAKE_BUF],
    len: usize,
    /// Frames received so far (what a timeout was waiting for).
    frames_in: usize,
    sealer: Option<CtrlSealer>,
    opener: Option<CtrlOpener>,
    session: Option<SessionKeys>,
    done: bool,
}

impl<'k> Handshaking<'k> {
    /// The client side on a prepared stream; sends the `Hello`.
    /// The client side on a prepared stream; sends the `Hello`, whose nonce is the link's
    /// `token` when a plain client has one (an authenticated one always draws a fresh nonce:
    /// it goes into the transcript).
    pub(crate) fn client(
        stream: TcpStream,
        peer: SocketAddr,
        key: Option<&'k JobKey>,
        token: Option<[u8; NONCE_LEN]>,
    ) -> Result<Handshaking<'k>, HandshakeFailure> {
        let nonce = match (key, token) {
            (None, Some(t)) => t,
            _ => handshake_nonce()?,
        };
        let (hs, hello) = ClientHandshake::new(key, nonce, random_ephemeral()?);
        let mut h = Handshaking::with_side(stream, peer, Side::Client(hs));
        h.write_frame(&hello)?;
        Ok(h)
    }

    /// The server side on a prepared stream; waits for the `Hello`.
    /// The server side on a prepared stream; waits for the `Hello` (a plain one must carry
    /// `token` when there is one).
    pub(crate) fn server(
        stream: TcpStream,
        peer: SocketAddr,
        key: Option<&'k JobKey>,
        token: Option<[u8; NONCE_LEN]>,
    ) -> Result<Handshaking<'k>, HandshakeFailure> {
        let mut hs = ServerHandshake::new(key, handshake_nonce()?, random_ephemeral()?);
        if let Some(t) = token {
            hs = hs.with_link_token(t);
        }
        Ok(Handshaking::with_side(stream, peer, Side::Server(hs)))
    }

    fn with_side(stream: TcpStream, peer: SocketAddr, side: Side<'k>) -> Handshaking<'k> {
        Handshaking {
            stream,
            peer,
            side,
            buf: [0; HANDSHAKE_BUF],
            len: 0,
            frames_in: 0,
            sealer: None,
            opener: None,
            session: None,
            done: false,
        }
    }

    /// The peer's address.
    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The socket, to poll it.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }

    /// Whether a whole handshake message arrived from the peer.
    pub(crate) fn heard_from(&self) -> bool {
        self.frames_in > 0
    }

    /// What the handshake waits for now, for a timeout's message.
    pub(crate) fn waiting_for(&self) -> &'static str {
        match (&self.side, self.frames_in) {
            (Side::Client(_), 0) => "answer to our Hello",
            (Side::Client(_), _) => "Welcome",
            (Side::Server(_), 0) => "Hello",
            (Side::Server(_), _) => "Proof",
        }
    }

    /// Reads what the peer sent (without blocking) and answers it. True once the handshake
    /// is complete ([`Handshaking::into_ctrl`] then gives the channel).
    pub(crate) fn advance(&mut self) -> Result<bool, HandshakeFailure> {
        while !self.done {
            while let Some(msg) = self.next_frame()? {
                self.frames_in += 1;
                if self.on_msg(msg)? {
                    self.done = true;
                    return Ok(true);
                }
            }
            // next_frame consumed or refused every whole frame, and one frame with its seal
            // fits the buffer: there is room.
            match self.stream.read(&mut self.buf[self.len..]) {
                Ok(0) => return Err(HandshakeFailure::Closed),
                Ok(n) => self.len += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                    return Err(HandshakeFailure::Closed)
                }
                Err(e) => return Err(HandshakeFailure::Io(e)),
            }
        }
        Ok(true)
    }

    /// Blocks (polling the socket) until the handshake completes, fails or `deadline`.
    fn run_until(
        mut self,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<TcpCtrl, HandshakeFailure> {
        loop {
            if self.advance()? {
                return Ok(self.into_ctrl());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HandshakeFailure::TimedOut {
                    waiting_for: self.waiting_for(),
                    after: timeout,
                });
            }
            wait_fd(self.stream.as_fd(), PollFlags::POLLIN, left).map_err(HandshakeFailure::Io)?;
        }
    }

    /// The next whole frame in the buffer, consumed; `None` until one is complete.
    fn next_frame(&mut self) -> Result<Option<CtrlMsg>, HandshakeFailure> {
        let Some(prefix) = self.buf[..self.len].first_chunk::<LEN_PREFIX>() else {
            return Ok(None);
        };
        let body_len = u32::from_be_bytes(*prefix);
        if body_len > MAX_HANDSHAKE_BODY {
            return Err(HandshakeFailure::Oversized(body_len));
        }
        // At most MAX_HANDSHAKE_BODY: fits the buffer with its seal.
        let frame_len = LEN_PREFIX + body_len as usize;
        if self.len < frame_len {
            return Ok(None);
        }
        let decoded = CtrlMsg::decode_body(&self.buf[LEN_PREFIX..frame_len]);
        let consumed = match &mut self.opener {
            None => frame_len,
            // A client whose Proof the server refused is told so unsealed (the server has
            // no session to seal with); an Abort is the only unsealed message accepted here,
            // and all it can do is end the handshake.
            Some(_) if matches!(decoded, Ok(CtrlMsg::Abort { .. })) => frame_len,
            Some(opener) => {
                let end = frame_len + CTRL_TAG_LEN;
                if self.len < end {
                    return Ok(None);
                }
                if !opener.open(&self.buf[..frame_len], &self.buf[frame_len..end]) {
                    // Only a client has an opener during the handshake, waiting for the
                    // sealed Welcome: a server that cannot seal it does not hold the secret.
                    return Err(HandshakeFailure::Refused(Refusal::ServerNotProven));
                }
                end
            }
        };
        self.buf.copy_within(consumed..self.len, 0);
        self.len -= consumed;
        decoded.map(Some).map_err(HandshakeFailure::Garbage)
    }

    /// Feeds one message to the state machine and sends its answer. True when established.
    fn on_msg(&mut self, msg: CtrlMsg) -> Result<bool, HandshakeFailure> {
        let step = match &mut self.side {
            Side::Client(c) => c.on_msg(msg),
            Side::Server(s) => s.on_msg(msg),
        };
        match step {
            Ok(Step::Send(m)) => {
                self.write_frame(&m)?;
                // A client that has sent its Proof seals and verifies from here on.
                if let Side::Client(c) = &self.side {
                    if let (Some(s), None) = (c.session(), &self.sealer) {
                        let (sealer, opener) = s.control(Role::Client);
                        self.sealer = Some(sealer);
                        self.opener = Some(opener);
                    }
                }
                Ok(false)
            }
            Ok(Step::Established { send, session }) => {
                if let (Some(s), Side::Server(_)) = (&session, &self.side) {
                    // The server's Welcome is its first sealed frame.
                    let (sealer, opener) = s.control(Role::Server);
                    self.sealer = Some(sealer);
                    self.opener = Some(opener);
                }
                if let Some(m) = send {
                    self.write_frame(&m)?;
                }
                self.session = session;
                Ok(true)
            }
            Err(e) => {
                if let Some(abort) = e.abort() {
                    // Best effort: the peer may be gone, and the refusal stands either way.
                    let _ = self.write_frame(&abort);
                }
                Err(match e {
                    HandshakeError::Refused(r) => HandshakeFailure::Refused(r),
                    HandshakeError::PeerAborted { code, reason } if code == ABORT_AUTH => {
                        HandshakeFailure::PeerRefused(reason)
                    }
                    other => HandshakeFailure::Protocol(other),
                })
            }
        }
    }

    /// Writes one frame (sealed once sealing has started) without blocking: the handshake's
    /// few bytes fit any fresh socket's send buffer, so a short write means a peer that does
    /// not read.
    fn write_frame(&mut self, msg: &CtrlMsg) -> Result<(), HandshakeFailure> {
        let mut out = Vec::with_capacity(msg.body_len() + LEN_PREFIX + CTRL_TAG_LEN);
        msg.encode(&mut out).map_err(HandshakeFailure::Encode)?;
        if let Some(sealer) = &mut self.sealer {
            let tag = sealer.seal(&out);
            out.extend_from_slice(&tag);
        }
        let mut written = 0;
        while written < out.len() {
            match self.stream.write(&out[written..]) {
                Ok(0) => return Err(HandshakeFailure::Closed),
                Ok(n) => written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return Err(HandshakeFailure::Stalled)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) =>
                {
                    return Err(HandshakeFailure::Closed)
                }
                Err(e) => return Err(HandshakeFailure::Io(e)),
            }
        }
        Ok(())
    }

    /// The established channel. Bytes that arrived after the handshake's last frame are
    /// kept for it.
    pub(crate) fn into_ctrl(self) -> TcpCtrl {
        let mut dec = Decoder::new();
        if self.opener.is_some() {
            dec.set_trailer(CTRL_TAG_LEN);
        }
        dec.push(&self.buf[..self.len]);
        TcpCtrl {
            stream: self.stream,
            peer: self.peer,
            dec,
            out: Vec::new(),
            buf: vec![0u8; 64 * 1024].into_boxed_slice(),
            write_timeout: WRITE_TIMEOUT,
            sealer: self.sealer,
            opener: self.opener,
            session: self.session,
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
    use gradwire_proto::auth::JobSecret;
    use std::net::TcpListener;

    const T: Duration = Duration::from_secs(5);

    fn key(fill: u8) -> JobKey {
        JobKey::new(&JobSecret::new(vec![fill; 32]).unwrap())
    }

    /// A connected pair after the handshake: (client, server), or each side's error.
    fn handshake(
        client_key: Option<&JobKey>,
        server_key: Option<&JobKey>,
    ) -> (Result<TcpCtrl, ChannelError>, Result<TcpCtrl, ChannelError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::scope(|s| {
            let server = s.spawn(|| {
                let (stream, _) = l.accept().unwrap();
                TcpCtrl::accept_handshake(stream, None, server_key, T)
            });
            let client = TcpCtrl::connect_with(addr, T, Some(DEFAULT_CONTROL_DSCP), client_key);
            (client, server.join().unwrap())
        })
    }

    fn pair() -> (TcpCtrl, TcpCtrl) {
        let (a, b) = handshake(None, None);
        (a.unwrap(), b.unwrap())
    }

    /// A raw client that has sent `bytes` to a server running `accept_handshake` with `key`.
    fn server_after_raw(
        bytes: &[u8],
        key: Option<&JobKey>,
        timeout: Duration,
    ) -> (Result<TcpCtrl, ChannelError>, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        raw.write_all(bytes).unwrap();
        let (s, _) = l.accept().unwrap();
        (TcpCtrl::accept_handshake(s, None, key, timeout), raw)
    }

    fn frame(m: &CtrlMsg) -> Vec<u8> {
        m.to_frame().unwrap()
    }

    fn hello(auth: bool) -> Vec<u8> {
        frame(&CtrlMsg::Hello {
            auth,
            nonce: [7; NONCE_LEN],
            public: [0; 32],
        })
    }

    #[test]
    fn tcp_round_trip_and_close_is_an_error() {
        let (mut a, mut b) = pair();
        assert!(!a.is_authenticated() && a.session().is_none());
        assert!(!b.is_authenticated());
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
    fn authenticated_round_trip_is_sealed_both_ways() {
        let (k1, k2) = (key(1), key(1));
        let (a, b) = handshake(Some(&k1), Some(&k2));
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        assert!(a.is_authenticated() && b.is_authenticated());
        // Both ends hold the same session: equal flow keys.
        let nonce = [9u8; gradwire_proto::auth::FLOW_NONCE_LEN];
        let fa = a.session().unwrap().flow_key(1, 2, 3, &nonce);
        let fb = b.session().unwrap().flow_key(1, 2, 3, &nonce);
        let (hdr, mut d) = (gradwire_proto::wire::header::HEADER_LEN, Vec::new());
        let repr = gradwire_proto::wire::header::Repr {
            kind: gradwire_proto::wire::header::Kind::AuthData,
            flags: gradwire_proto::wire::header::Flags::EMPTY,
            pass: 0,
            job_id: 1,
            tensor_id: 2,
            round: 3,
            offset: 0,
            seq: 0,
            length: 4,
            layer: 0,
        };
        d.resize(repr.buffer_len(), 0);
        repr.emit(&mut gradwire_proto::wire::header::Packet::new_unchecked(
            &mut d[..],
        ))
        .unwrap();
        d[hdr..hdr + 4].copy_from_slice(b"abcd");
        fa.seal(&mut d).unwrap();
        assert_eq!(fb.open(&d, &mut Vec::new()).unwrap(), b"abcd");
        for i in 0..50u32 {
            a.send(&CtrlMsg::FlowStop {
                pass: i,
                segments_sent: i,
            })
            .unwrap();
            b.send(&CtrlMsg::RateGrant {
                rate_bps: u64::from(i) + 1,
            })
            .unwrap();
        }
        for i in 0..50u32 {
            assert_eq!(
                b.recv(T).unwrap(),
                Some(CtrlMsg::FlowStop {
                    pass: i,
                    segments_sent: i
                })
            );
            assert_eq!(
                a.recv(T).unwrap(),
                Some(CtrlMsg::RateGrant {
                    rate_bps: u64::from(i) + 1
                })
            );
        }
    }

    #[test]
    fn modes_and_secrets_that_differ_are_refused_on_both_ends() {
        let (k1, k2) = (key(1), key(2));
        let refused = |r: Result<TcpCtrl, ChannelError>| match r {
            Err(ChannelError::Refused { reason, .. }) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let (c, s) = handshake(None, Some(&k1));
        let c = refused(c);
        assert!(c.contains("requires an authenticated job"), "{c}");
        assert!(c.contains("GRADWIRE_JOB_SECRET or --secret-file"), "{c}");
        assert_eq!(refused(s), c);
        let (c, s) = handshake(Some(&k1), None);
        assert!(refused(c).contains("without a job secret"));
        assert!(refused(s).contains("without a job secret"));
        // The client proves first: the server refuses it, and the client hears why.
        let (c, s) = handshake(Some(&k1), Some(&k2));
        let s = refused(s);
        assert!(s.contains("job secret mismatch"), "{s}");
        assert_eq!(refused(c), s, "the client hears the server's reason");
    }

    #[test]
    fn a_peer_that_stops_reading_stalls_the_write_into_an_error() {
        // Documented (docs/protocol.md, Timers): writing one control message while the peer
        // does not read fails with `WriteStalled` after the write-stall limit, 10 s.
        let (mut a, peer) = pair();
        assert_eq!(
            a.write_timeout,
            Duration::from_secs(10),
            "the documented limit"
        );
        // The peer never reads; small buffers on both ends fill quickly.
        setsockopt(&peer.stream, sockopt::RcvBuf, &4096).unwrap();
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
    fn garbage_after_the_handshake_is_a_clear_error() {
        let (b, mut raw) = server_after_raw(&hello(false), None, T);
        let mut b = b.unwrap();
        raw.write_all(&[0, 0, 0, 2, 9, 9]).unwrap();
        let e = b.recv(Duration::from_secs(2)).unwrap_err();
        assert!(matches!(e, ChannelError::Malformed { .. }), "{e}");
    }

    #[test]
    fn garbage_during_the_handshake_is_a_handshake_error() {
        // Not a gradwire frame, a version-1 peer, a message out of place.
        let v1 = {
            let mut f = hello(false);
            f[LEN_PREFIX] = 1;
            f
        };
        for (bytes, want) in [
            (vec![0, 0, 0, 2, 9, 9], "garbage"),
            (v1, "version 1"),
            (
                frame(&CtrlMsg::FinishConfirm),
                "expected Hello, got FinishConfirm",
            ),
        ] {
            let (r, _raw) = server_after_raw(&bytes, None, T);
            match r {
                Err(ChannelError::Handshake { reason, .. }) => {
                    assert!(reason.contains(want), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_huge_length_prefix_is_refused_at_once() {
        // 1 MiB announced: refused on the prefix, long before any body or the timeout.
        let t = Instant::now();
        let (r, _raw) = server_after_raw(&(1u32 << 20).to_be_bytes(), None, T);
        let Err(ChannelError::Handshake { reason, .. }) = r else {
            panic!("{r:?}")
        };
        assert!(reason.contains("1048576-byte message"), "{reason}");
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn silence_times_out_on_both_sides() {
        let limit = Duration::from_millis(200);
        let t = Instant::now();
        let (r, _raw) = server_after_raw(&[], None, limit);
        let Err(ChannelError::Handshake { reason, .. }) = r else {
            panic!("{r:?}")
        };
        assert!(reason.contains("no Hello within 200ms"), "{reason}");
        assert!(t.elapsed() >= limit && t.elapsed() < limit + Duration::from_secs(2));
        // A server that accepts (the kernel does) and never answers.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let e = TcpCtrl::connect(l.local_addr().unwrap(), limit, None).unwrap_err();
        assert!(
            matches!(&e, ChannelError::Handshake { reason, .. } if reason.contains("no answer to our Hello within 200ms")),
            "{e}"
        );
        // A Hello then silence from an authenticating client: no Proof in time.
        let k = key(1);
        let (r, _raw) = server_after_raw(&hello(true), Some(&k), limit);
        let Err(ChannelError::Handshake { reason, .. }) = r else {
            panic!("{r:?}")
        };
        assert!(reason.contains("no Proof within 200ms"), "{reason}");
    }

    #[test]
    fn bytes_right_behind_the_handshake_are_kept() {
        // A client that does not wait for the Welcome: its first message arrives with the
        // Hello, maybe in the same segment, and must not be lost.
        let mut bytes = hello(false);
        bytes.extend(frame(&CtrlMsg::FinishConfirm));
        let (b, mut raw) = server_after_raw(&bytes, None, T);
        let mut b = b.unwrap();
        assert_eq!(b.recv(T).unwrap(), Some(CtrlMsg::FinishConfirm));
        // The raw client got the Welcome.
        let welcome = CtrlMsg::Welcome {
            auth: false,
            proof: [0; 32],
        };
        let mut got = vec![0u8; frame(&welcome).len()];
        raw.read_exact(&mut got).unwrap();
        assert_eq!(got, frame(&welcome));
    }

    #[test]
    fn an_unsealed_frame_on_an_authenticated_connection_is_bad_seal() {
        // A raw client that does the authenticated handshake by hand, then sends one frame
        // without its seal (as a peer without the session keys would).
        let k = key(1);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        let nc = [3u8; NONCE_LEN];
        let eph = random_ephemeral().unwrap();
        let pc = *eph.public();
        raw.write_all(&frame(&CtrlMsg::Hello {
            auth: true,
            nonce: nc,
            public: pc,
        }))
        .unwrap();
        std::thread::scope(|s| {
            let server = s.spawn(|| {
                let (st, _) = l.accept().unwrap();
                TcpCtrl::accept_handshake(st, None, Some(&k), T)
            });
            let mut dec = Decoder::new();
            let mut buf = [0u8; 256];
            let (ns, ps) = loop {
                let n = raw.read(&mut buf).unwrap();
                assert!(n > 0);
                dec.push(&buf[..n]);
                if let Some(CtrlMsg::Challenge { nonce, public }) = dec.next().unwrap() {
                    break (nonce, public);
                }
            };
            let t = gradwire_proto::auth::Transcript {
                client_nonce: nc,
                server_nonce: ns,
                client_public: pc,
                server_public: ps,
            };
            raw.write_all(&frame(&CtrlMsg::Proof {
                proof: k.client_proof(&t),
            }))
            .unwrap();
            let mut b = server.join().unwrap().unwrap();
            assert!(b.is_authenticated());
            let mut unsealed = frame(&CtrlMsg::FinishConfirm);
            unsealed.extend([0u8; CTRL_TAG_LEN]);
            raw.write_all(&unsealed).unwrap();
            let e = b.recv(T).unwrap_err();
            assert!(
                matches!(
                    e,
                    ChannelError::Malformed {
                        source: CtrlError::BadSeal,
                        ..
                    }
                ),
                "{e}"
            );
            // Sticky: nothing after it is read.
            assert!(matches!(b.recv(T), Err(ChannelError::Malformed { .. })));
        });
    }
}
