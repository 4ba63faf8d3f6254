//! A control listener that holds nothing for clients that do not complete the handshake.
//!
//! [`CtrlListener::bind`] starts one background thread that accepts connections and runs
//! their handshakes ([`gradwire_proto::handshake`], server side) side by side, nonblocking,
//! in one `ppoll` loop that sleeps until a socket is readable, the next handshake deadline
//! passes, or the listener is dropped (an eventfd). A connection costs a socket and a buffer
//! of one handshake frame (under 300 bytes) until it completes, and no more than that:
//!
//! - **time**: each handshake must complete within
//!   [`ListenerConfig::handshake_timeout`] of its accept (2 s by default), whatever the peer
//!   sends meanwhile (a byte every 100 ms does not extend it);
//! - **size**: a frame announcing more than
//!   [`MAX_HANDSHAKE_BODY`](crate::ctrl_channel::MAX_HANDSHAKE_BODY) bytes, or bytes that do not
//!   decode, end it at once;
//! - **count**: at most [`ListenerConfig::max_pending`] handshakes are in progress (64 by
//!   default); a new connection beyond that evicts the oldest one that has not sent a whole
//!   message yet (else the oldest), so idle and trickling connections cannot lock a real
//!   sender out, they only age out in front of it;
//! - completed connections wait in a queue of [`ListenerConfig::max_ready`] for
//!   [`CtrlListener::accept`]; when it is full, a newly completed one is closed.
//!
//! Every dropped connection gets one log line (`log` facade, level warn) with its address and
//! why, and is counted in [`ListenerStats`].
//!
//! **Remaining risk.** A client that opens `max_pending` connections and sends a `Hello` on
//! each faster than a real sender completes its handshake (one round trip plain, two
//! authenticated, plus an HMAC) evicts it every time; on a LAN that is tens of thousands of
//! connections per second from a host that can reach the port. The sender sees its
//! connection closed and must retry. On a plain listener any client that speaks the
//! handshake is accepted (there is nothing to check it against): the receiver's idle timeout
//! bounds one that then says nothing. Connection floods below the TCP layer (SYN floods) are the kernel's to absorb (SYN
//! cookies). Neither mode of the handshake protects the data path; see the peer binding and
//! the authenticated datagrams.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, TrySendError};
use gradwire_proto::auth::{JobKey, NONCE_LEN};
use log::warn;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;

use crate::ctrl_channel::{
    ChannelError, HandshakeFailure, Handshaking, TcpCtrl, DEFAULT_HANDSHAKE_TIMEOUT,
};

/// Connections accepted per loop turn at most, so handshakes under way are read between
/// batches of a connection flood.
const ACCEPT_BATCH: usize = 16;
/// How long accepting pauses after the process ran out of file descriptors (or another
/// accept error), so the loop does not spin on a listener that stays readable.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// How a [`CtrlListener`] runs handshakes.
#[derive(Debug)]
pub struct ListenerConfig {
    /// The job key: only authenticated senders holding the same secret are accepted. `None`:
    /// only unauthenticated senders are.
    pub key: Option<JobKey>,
    /// Bound on each handshake, from its accept.
    pub handshake_timeout: Duration,
    /// Handshakes in progress at most; a new connection beyond evicts the oldest.
    pub max_pending: usize,
    /// Completed connections waiting for [`CtrlListener::accept`] at most.
    pub max_ready: usize,
    /// DSCP of the accepted connections (None leaves the TOS alone).
    pub dscp: Option<u8>,
    /// Plain listeners of one link: the token its client must send as its `Hello`'s nonce
    /// ([`gradwire_proto::handshake::ServerHandshake::with_link_token`]), handed to it out
    /// of band (a job's endpoint table). A connection without it is refused before it
    /// counts as established, so it never waits in the ready queue. Ignored with a `key`.
    pub link_token: Option<[u8; NONCE_LEN]>,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        ListenerConfig {
            key: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_pending: 64,
            max_ready: 16,
            dscp: Some(crate::ctrl_channel::DEFAULT_CONTROL_DSCP),
            link_token: None,
        }
    }
}

/// What a listener did with the connections it accepted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ListenerStats {
    /// Handshakes completed and queued for [`CtrlListener::accept`] (a queued connection whose
    /// client has gone by the time it is taken is counted here and in `closed`).
    pub accepted: u64,
    /// Dropped: the handshake did not complete in time.
    pub timed_out: u64,
    /// Dropped: bytes that are not a handshake message (oversized, undecodable, another
    /// protocol version, a message out of place).
    pub malformed: u64,
    /// Dropped: refused (authentication modes differ, the secrets differ), by us or the peer.
    pub refused: u64,
    /// Dropped: the oldest handshake when `max_pending` were in progress.
    pub evicted: u64,
    /// Dropped: the peer closed (or reset) the connection, or the socket failed.
    pub closed: u64,
    /// Closed after completing: `max_ready` connections were already waiting for `accept`.
    pub queue_full: u64,
    /// Handshakes in progress now.
    pub pending: u64,
}

/// Shared counters of a listener's thread.
#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    timed_out: AtomicU64,
    malformed: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    closed: AtomicU64,
    queue_full: AtomicU64,
    pending: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ListenerStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ListenerStats {
            accepted: g(&self.accepted),
            timed_out: g(&self.timed_out),
            malformed: g(&self.malformed),
            refused: g(&self.refused),
            evicted: g(&self.evicted),
            closed: g(&self.closed),
            queue_full: g(&self.queue_full),
            pending: g(&self.pending),
        }
    }

    /// Counts a failed handshake under its reason.
    fn failed(&self, f: &HandshakeFailure) {
        Counters::bump(match f {
            HandshakeFailure::TimedOut { .. } => &self.timed_out,
            HandshakeFailure::Oversized(_)
            | HandshakeFailure::Garbage(_)
            | HandshakeFailure::Protocol(_) => &self.malformed,
            HandshakeFailure::Refused(_) | HandshakeFailure::PeerRefused(_) => &self.refused,
            HandshakeFailure::Closed
            | HandshakeFailure::Io(_)
            | HandshakeFailure::Stalled
            | HandshakeFailure::Encode(_)
            | HandshakeFailure::Random => &self.closed,
        });
    }
}

/// A TCP control listener that runs every connection's handshake in a background thread
/// and hands out only the connections that completed it. Dropping it stops the thread and
/// closes every socket it holds.
#[derive(Debug)]
pub struct CtrlListener {
    local: SocketAddr,
    ready: crossbeam_channel::Receiver<TcpCtrl>,
    counters: Arc<Counters>,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl CtrlListener {
    /// Listens on `addr` (port 0: any free port, see [`CtrlListener::local_addr`]) and starts
    /// the handshake thread.
    pub fn bind(addr: SocketAddr, cfg: ListenerConfig) -> Result<CtrlListener, ChannelError> {
        let io = |source| ChannelError::Io {
            peer: format!("listener {addr}"),
            source,
        };
        let listener = TcpListener::bind(addr).map_err(io)?;
        listener.set_nonblocking(true).map_err(io)?;
        let local = listener.local_addr().map_err(io)?;
        let stop = Arc::new(
            EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| io(e.into()))?,
        );
        let (ready_tx, ready) = crossbeam_channel::bounded(cfg.max_ready.max(1));
        let counters = Arc::new(Counters::default());
        let acceptor = Acceptor {
            listener,
            local,
            stop: Arc::clone(&stop),
            ready: ready_tx,
            counters: Arc::clone(&counters),
            handshake_timeout: cfg.handshake_timeout,
            max_pending: cfg.max_pending.max(1),
            dscp: cfg.dscp,
            link_token: cfg.link_token,
        };
        let key = cfg.key;
        let thread = std::thread::Builder::new()
            .name(format!("gw-ctrl-listen-{}", local.port()))
            .spawn(move || acceptor.run(key.as_ref()))
            .map_err(io)?;
        Ok(CtrlListener {
            local,
            ready,
            counters,
            stop,
            thread: Some(thread),
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next connection that completed its handshake, waiting at most `timeout`.
    /// Connections whose client has gone since they completed (closed or reset while nobody
    /// accepted) are skipped, counted in `closed` and logged.
    pub fn accept(&self, timeout: Duration) -> Result<TcpCtrl, ChannelError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let c = self.accept_queued(left, timeout)?;
            if !c.peer_gone() {
                return Ok(c);
            }
            Counters::bump(&self.counters.closed);
            warn!(
                "control listener {}: dropped {}: the client closed the connection while it \
                 waited for accept()",
                self.local,
                c.peer_addr()
            );
        }
    }

    /// The next queued connection, waiting at most `left` (of the caller's `timeout`).
    fn accept_queued(&self, left: Duration, timeout: Duration) -> Result<TcpCtrl, ChannelError> {
        match self.ready.recv_timeout(left) {
            Ok(c) => Ok(c),
            Err(RecvTimeoutError::Timeout) => Err(ChannelError::AcceptTimeout {
                local: self.local.to_string(),
                timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(ChannelError::Io {
                peer: format!("listener {}", self.local),
                source: std::io::Error::other("the control listener's thread stopped"),
            }),
        }
    }

    /// What the listener did so far.
    pub fn stats(&self) -> ListenerStats {
        self.counters.snapshot()
    }
}

impl Drop for CtrlListener {
    fn drop(&mut self) {
        // The thread polls the eventfd: one write wakes it, and it returns at once, closing
        // the listening socket and every handshake under way; queued connections close with
        // `self.ready`.
        if self.stop.write(1).is_err() {
            warn!(
                "control listener {}: cannot signal its thread to stop",
                self.local
            );
        }
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                warn!("control listener {}: its thread panicked", self.local);
            }
        }
    }
}

/// One connection whose handshake is under way.
#[derive(Debug)]
struct Pending<'k> {
    hs: Handshaking<'k>,
    deadline: Instant,
}

/// The listener thread's state.
struct Acceptor {
    listener: TcpListener,
    local: SocketAddr,
    stop: Arc<EventFd>,
    ready: crossbeam_channel::Sender<TcpCtrl>,
    counters: Arc<Counters>,
    handshake_timeout: Duration,
    max_pending: usize,
    dscp: Option<u8>,
    link_token: Option<[u8; NONCE_LEN]>,
}

impl Acceptor {
    fn drop_conn(&self, peer: SocketAddr, why: &HandshakeFailure) {
        self.counters.failed(why);
        warn!("control listener {}: dropped {peer}: {why}", self.local);
    }

    /// A completed handshake: queue it for `accept`, or close it if the queue is full.
    /// False when the listener is gone.
    fn complete(&self, hs: Handshaking<'_>) -> bool {
        let peer = hs.peer();
        match self.ready.try_send(hs.into_ctrl()) {
            Ok(()) => {
                Counters::bump(&self.counters.accepted);
                true
            }
            Err(TrySendError::Full(c)) => {
                Counters::bump(&self.counters.queue_full);
                warn!(
                    "control listener {}: dropped {peer}: handshake complete, but {} \
                     connections already wait for accept()",
                    self.local,
                    self.ready.len()
                );
                drop(c);
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// Answers what arrived on one handshake: Some(it) while it is still under way.
    fn advance<'k>(&self, mut p: Pending<'k>) -> Option<Pending<'k>> {
        match p.hs.advance() {
            Ok(false) => Some(p),
            Ok(true) => {
                self.complete(p.hs);
                None
            }
            Err(f) => {
                self.drop_conn(p.hs.peer(), &f);
                None
            }
        }
    }

    /// A new connection: start its handshake, answer what it already sent.
    fn admit<'k>(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        key: Option<&'k JobKey>,
        pending: &mut VecDeque<Pending<'k>>,
    ) {
        let hs = prepare(&stream, self.dscp)
            .and_then(|()| Handshaking::server(stream, peer, key, self.link_token));
        let hs = match hs {
            Ok(hs) => hs,
            Err(f) => return self.drop_conn(peer, &f),
        };
        let p = Pending {
            hs,
            deadline: Instant::now() + self.handshake_timeout,
        };
        let Some(p) = self.advance(p) else { return };
        if pending.len() >= self.max_pending {
            // The oldest that has not sent a whole message yet, else the oldest: a real
            // sender's Hello arrives one round trip after its connect, so idle and trickling
            // connections go first, however many there are.
            let victim = pending.iter().position(|p| !p.hs.heard_from()).unwrap_or(0);
            if let Some(old) = pending.remove(victim) {
                Counters::bump(&self.counters.evicted);
                warn!(
                    "control listener {}: dropped {}: evicted: {} handshakes pending",
                    self.local,
                    old.hs.peer(),
                    self.max_pending
                );
            }
        }
        pending.push_back(p);
    }

    fn run(self, key: Option<&JobKey>) {
        let mut pending: VecDeque<Pending<'_>> = VecDeque::new();
        let mut accept_paused_until: Option<Instant> = None;
        loop {
            let now = Instant::now();
            // Expire first: a handshake past its deadline is dropped whatever it sent.
            while let Some(i) = pending.iter().position(|p| p.deadline <= now) {
                if let Some(p) = pending.remove(i) {
                    let why = HandshakeFailure::TimedOut {
                        waiting_for: p.hs.waiting_for(),
                        after: self.handshake_timeout,
                    };
                    self.drop_conn(p.hs.peer(), &why);
                }
            }
            self.counters
                .pending
                .store(pending.len() as u64, Ordering::Relaxed);
            if accept_paused_until.is_some_and(|t| t <= now) {
                accept_paused_until = None;
            }
            let wake = pending
                .iter()
                .map(|p| p.deadline)
                .chain(accept_paused_until)
                .min();
            let timeout = wake.map(|t| TimeSpec::from_duration(t.saturating_duration_since(now)));

            // [stop, listener (unless paused), pending...]
            let listening = accept_paused_until.is_none();
            let mut fds = Vec::with_capacity(2 + pending.len());
            fds.push(PollFd::new(self.stop.as_fd(), PollFlags::POLLIN));
            if listening {
                fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
            }
            fds.extend(
                pending
                    .iter()
                    .map(|p| PollFd::new(p.hs.fd(), PollFlags::POLLIN)),
            );
            match ppoll(&mut fds, timeout, None) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    // Not expected with valid descriptors; pause rather than spin.
                    warn!("control listener {}: poll failed: {e}", self.local);
                    std::thread::sleep(ACCEPT_PAUSE);
                    continue;
                }
            }
            let ready: Vec<bool> = fds
                .iter()
                .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
                .collect();
            drop(fds);
            if ready[0] {
                return;
            }
            let first = if listening { 2 } else { 1 };
            let listener_ready = listening && ready[1];

            // Handshakes under way, before new connections: a flood of accepts cannot delay
            // the answer to a sender whose message already arrived.
            let mut still = VecDeque::with_capacity(pending.len());
            for (i, p) in pending.drain(..).enumerate() {
                if ready[first + i] {
                    still.extend(self.advance(p));
                } else {
                    still.push_back(p);
                }
            }
            pending = still;

            if listener_ready {
                for _ in 0..ACCEPT_BATCH {
                    match self.listener.accept() {
                        Ok((stream, peer)) => self.admit(stream, peer, key, &mut pending),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                            ) => {}
                        Err(e) => {
                            // Out of descriptors (EMFILE/ENFILE) or memory: the connection
                            // stays in the kernel's backlog; try again shortly.
                            warn!(
                                "control listener {}: accept failed: {e}; pausing {:?}",
                                self.local, ACCEPT_PAUSE
                            );
                            accept_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                            break;
                        }
                    }
                }
            }
        }
    }
}

/// [`crate::ctrl_channel`]'s stream setup, as a handshake failure.
fn prepare(stream: &TcpStream, dscp: Option<u8>) -> Result<(), HandshakeFailure> {
    crate::ctrl_channel::prepare_stream(stream, dscp).map_err(HandshakeFailure::Io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctrl_channel::CtrlChannel;
    use crate::message::CtrlMsg;
    use gradwire_proto::auth::JobSecret;
    use std::io::Write;

    const T: Duration = Duration::from_secs(5);

    fn refusal_line(r: gradwire_proto::handshake::Refusal) -> String {
        HandshakeFailure::Refused(r).to_string()
    }

    /// Whether our end of `st` was closed (EOF or reset), waiting at most 100 ms.
    fn is_closed(st: &mut TcpStream) -> bool {
        st.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut b = [0u8; 1];
        match std::io::Read::read(st, &mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == ErrorKind::ConnectionReset,
        }
    }

    fn key(fill: u8) -> JobKey {
        JobKey::new(&JobSecret::new(vec![fill; 32]).unwrap())
    }

    fn listener(key: Option<JobKey>, timeout: Duration, max_pending: usize) -> CtrlListener {
        CtrlListener::bind(
            "127.0.0.1:0".parse().unwrap(),
            ListenerConfig {
                key,
                handshake_timeout: timeout,
                max_pending,
                ..ListenerConfig::default()
            },
        )
        .unwrap()
    }

    /// Waits (bounded) until `f(stats)` holds.
    fn wait_stats(l: &CtrlListener, f: impl Fn(&ListenerStats) -> bool) -> ListenerStats {
        let deadline = Instant::now() + T;
        loop {
            let s = l.stats();
            if f(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "condition never held: {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn accepts_plain_and_authenticated_and_counts() {
        let l = listener(None, T, 64);
        let mut c = TcpCtrl::connect(l.local_addr(), T, None).unwrap();
        let mut s = l.accept(T).unwrap();
        c.send(&CtrlMsg::FinishConfirm).unwrap();
        assert_eq!(s.recv(T).unwrap(), Some(CtrlMsg::FinishConfirm));
        assert_eq!(l.stats().accepted, 1);

        let k = key(1);
        let la = listener(Some(key(1)), T, 64);
        let mut c = TcpCtrl::connect_with(la.local_addr(), T, None, Some(&k)).unwrap();
        let mut s = la.accept(T).unwrap();
        assert!(c.is_authenticated() && s.is_authenticated());
        s.send(&CtrlMsg::RateGrant { rate_bps: 5 }).unwrap();
        assert_eq!(c.recv(T).unwrap(), Some(CtrlMsg::RateGrant { rate_bps: 5 }));
        // Refusals are counted; the sender hears why.
        let e = TcpCtrl::connect(la.local_addr(), T, None).unwrap_err();
        assert!(
            e.to_string().contains("requires an authenticated job"),
            "{e}"
        );
        wait_stats(&la, |s| s.refused == 1 && s.accepted == 1);
    }

    #[test]
    fn a_client_gone_before_accept_is_skipped() {
        let l = listener(None, T, 64);
        let gone = TcpCtrl::connect(l.local_addr(), T, None).unwrap();
        wait_stats(&l, |s| s.accepted == 1);
        drop(gone);
        let mut c = TcpCtrl::connect(l.local_addr(), T, None).unwrap();
        wait_stats(&l, |s| s.accepted == 2);
        // The first completed connection's client closed: accept hands out the second.
        let mut s = l.accept(T).unwrap();
        c.send(&CtrlMsg::FinishConfirm).unwrap();
        assert_eq!(s.recv(T).unwrap(), Some(CtrlMsg::FinishConfirm));
        assert_eq!(l.stats().closed, 1);
    }

    #[test]
    fn accept_times_out_with_a_clear_error() {
        let l = listener(None, T, 64);
        let e = l.accept(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, ChannelError::AcceptTimeout { .. }), "{e}");
        assert!(e.to_string().contains("no sender completed"), "{e}");
    }

    #[test]
    fn idle_garbage_and_oversized_connections_are_dropped_and_counted() {
        let l = listener(None, Duration::from_millis(300), 64);
        let addr = l.local_addr();
        let idle: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[0, 0, 0, 3, 0xff, 0xff, 0xff]).unwrap();
        let mut huge = TcpStream::connect(addr).unwrap();
        huge.write_all(&u32::MAX.to_be_bytes()).unwrap();
        let s = wait_stats(&l, |s| s.malformed == 2);
        assert_eq!(s.timed_out, 0);
        let s = wait_stats(&l, |s| s.timed_out == 5 && s.pending == 0);
        assert_eq!(s.accepted, 0);
        drop(idle);
        // A real sender still gets through.
        let _c = TcpCtrl::connect(addr, T, None).unwrap();
        l.accept(T).unwrap();
    }

    #[test]
    fn the_oldest_pending_handshake_is_evicted() {
        let l = listener(None, T, 4);
        let addr = l.local_addr();
        let idle: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let s = wait_stats(&l, |s| s.evicted == 6);
        assert_eq!(s.pending, 4);
        // The evicted ones are the first six: closed on our side.
        for (i, mut st) in idle.into_iter().enumerate() {
            assert_eq!(is_closed(&mut st), i < 6, "connection {i}");
        }
        let _c = TcpCtrl::connect(addr, T, None).unwrap();
        l.accept(T).unwrap();
    }

    #[test]
    fn connections_that_spoke_are_evicted_last() {
        let l = listener(Some(key(1)), T, 4);
        let addr = l.local_addr();
        // An authenticating client whose Hello was answered (it owes the Proof).
        let mut spoke = TcpStream::connect(addr).unwrap();
        let hello = CtrlMsg::Hello {
            auth: true,
            nonce: [1; 32],
            public: *crate::ctrl_channel::random_ephemeral().unwrap().public(),
        };
        spoke.write_all(&hello.to_frame().unwrap()).unwrap();
        let mut challenge = [0u8; 70];
        spoke.set_read_timeout(Some(T)).unwrap();
        std::io::Read::read_exact(&mut spoke, &mut challenge).unwrap();
        let idle: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let s = wait_stats(&l, |s| s.evicted == 7);
        assert_eq!(s.pending, 4);
        assert!(!is_closed(&mut spoke), "the client that spoke was evicted");
        drop(idle);
    }

    #[test]
    fn drop_closes_everything_promptly() {
        let l = listener(None, Duration::from_secs(60), 64);
        let addr = l.local_addr();
        let mut idle = TcpStream::connect(addr).unwrap();
        wait_stats(&l, |s| s.pending == 1);
        let t = Instant::now();
        drop(l);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(is_closed(&mut idle));
        assert!(TcpStream::connect(addr).is_err(), "no longer listening");
    }

    #[test]
    fn refusal_log_lines_name_the_reason() {
        assert_eq!(
            refusal_line(gradwire_proto::handshake::Refusal::UnauthenticatedPeer),
            "refused: unauthenticated sender"
        );
        assert!(
            refusal_line(gradwire_proto::handshake::Refusal::SecretMismatch)
                .contains("secret mismatch")
        );
    }
}
