//! One endpoint per rank: a socket, a [`Core`], and a progress thread that runs the core and
//! the operations submitted to it (quinn's `Endpoint` with Gloo's algorithms on top).
//!
//! Set-up is two-phase so it rides on any rendezvous: [`Endpoint::bind`] binds the socket and
//! tells the address; once every rank's address is known, [`Bound::start`] starts the
//! progress thread. A datagram is handed to the core only if its source address is a
//! peer's; anything else is counted and dropped.
//!
//! In an authenticated job ([`EndpointConfig::auth`]) each rank also draws a member key when
//! it binds and publishes its [`Bound::member`] entry with its address; [`Bound::start_sealed`]
//! takes every rank's entry, and from then on every datagram is sealed with the key of its
//! pair of ranks and opened before the core sees it ([`crate::seal`]).
//!
//! The progress thread sends every batch the core produced before it receives again, so a
//! message's memory is never read after its operation ended. It blocks in `poll(2)` when
//! there is nothing to do (several ranks share a core on small machines).

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire_proto::auth::{JobKey, MemberEntry, MemberKey};

use crate::core::{Core, CoreConfig, Event, Stats, TxBatch};
use crate::io::udp::{IoError, UdpConfig, UdpIo};
use crate::io::{BoxError, DatagramIo, Transmit, Waker};
use crate::op::{Erased, Handle, Op, OpCx, OpError, OpEvent, Route, Slot, Typed};
use crate::seal::{OpenError, Sealing};
use crate::wire;

/// How an endpoint is set up.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// The core's settings (job, rank, world, timers, window).
    pub core: CoreConfig,
    /// Address to bind (port 0: any).
    pub bind: SocketAddr,
    /// Path MTU: sets the segment size.
    pub mtu: usize,
    /// Socket settings.
    pub udp: UdpConfig,
    /// Testing: drop this fraction of arriving data segments before the core sees them.
    pub inject_loss: f64,
    /// Seed of `inject_loss`.
    pub seed: u64,
    /// The job key of an authenticated job: every datagram is sealed with the key of its pair
    /// of ranks ([`crate::seal`]), and the endpoint starts only with every rank's proven
    /// member key ([`Bound::start_sealed`]). `None`: plain datagrams, peers bound by address.
    pub auth: Option<Arc<JobKey>>,
}

impl EndpointConfig {
    /// Rank `rank` of `world` in `job`, bound at `bind`, a 1500-byte MTU, default timers.
    pub fn new(job: u32, rank: u16, world: u16, bind: SocketAddr) -> EndpointConfig {
        EndpointConfig {
            core: CoreConfig::new(job, rank, world),
            bind,
            mtu: 1500,
            udp: UdpConfig::default(),
            inject_loss: 0.0,
            seed: 0,
            auth: None,
        }
    }
}

/// Why an endpoint could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The socket.
    #[error("message-layer socket: {0}")]
    Io(#[from] IoError),
    /// The peer table.
    #[error("peer table: {0}")]
    Peers(String),
    /// The progress thread.
    #[error("could not start the progress thread: {0}")]
    Thread(std::io::Error),
    /// The socket would not let the peers in (AF_XDP: a peer's neighbour entry, the XDP
    /// allowlist map).
    #[error("letting the peers in: {0} (check that every peer's address is reachable from this host's interface)")]
    Admit(#[source] crate::io::BoxError),
    /// Authentication: a member key could not be made, a peer's is not proven, or the
    /// endpoint was started the wrong way for its configuration.
    #[error("message-layer authentication: {0}")]
    Auth(String),
    /// A peer's member key is not proven with this job's key, or unusable.
    #[error("rank {rank}'s message-layer member key is refused: {source}")]
    Member {
        /// The peer.
        rank: u16,
        /// Why.
        #[source]
        source: gradwire_proto::auth::AuthError,
    },
}

/// A bound, not yet started endpoint.
#[derive(Debug)]
pub struct Bound {
    cfg: EndpointConfig,
    io: Box<dyn DatagramIo>,
    /// This rank's member key (authenticated jobs).
    member: Option<Arc<MemberKey>>,
}

impl std::fmt::Debug for dyn DatagramIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DatagramIo({})", self.local_addr())
    }
}

/// Counters of an endpoint: the core's and the driver's.
#[derive(Debug, Clone, Default)]
pub struct EndpointStats {
    /// The core's counters.
    pub core: Stats,
    /// Datagrams from an address that is no peer's.
    pub unknown_source: u64,
    /// Authenticated jobs: datagrams from a peer's address that did not open (plain, forged,
    /// altered, or sealed for another job or pair of ranks).
    pub unauthenticated: u64,
    /// Authenticated jobs: sealed datagrams whose packet number was taken already (replays).
    pub replayed: u64,
    /// Data segments dropped by `inject_loss`.
    pub injected_drops: u64,
    /// Peers' hosts reporting their socket closed (ICMP port unreachable).
    pub unreachable_reports: u64,
    /// Datagrams received.
    pub datagrams_in: u64,
    /// Datagrams sent.
    pub datagrams_out: u64,
    /// Send system calls.
    pub send_calls: u64,
    /// Receive system calls that returned data.
    pub recv_calls: u64,
}

enum Cmd {
    Submit(u64, Box<dyn Erased>),
    Cancel(u64),
    AbortAll(u16),
}

struct Shared {
    stats: Mutex<EndpointStats>,
    down: Mutex<Option<String>>,
    /// Set when the endpoint is dropped: the progress thread stops even though handles
    /// that outlive the endpoint still hold senders of its command channel (for `cancel`).
    closing: std::sync::atomic::AtomicBool,
}

/// A started endpoint.
pub struct Endpoint {
    tx: Option<mpsc::Sender<Cmd>>,
    waker: Waker,
    thread: Option<JoinHandle<()>>,
    local: SocketAddr,
    rank: u16,
    world: u16,
    seg_payload: usize,
    next_id: AtomicU64,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Endpoint(rank {} of {} at {})",
            self.rank, self.world, self.local
        )
    }
}

impl Endpoint {
    /// Binds a kernel UDP socket.
    pub fn bind(cfg: EndpointConfig) -> Result<Bound, EndpointError> {
        let io = UdpIo::bind(cfg.bind, &cfg.udp)?;
        Endpoint::with_io(cfg, Box::new(io))
    }

    /// An endpoint over a datagram socket of any kind (AF_XDP, ...), bound already;
    /// `cfg.bind` and `cfg.udp` are not used. Sealed datagrams carry
    /// [`crate::seal::OVERHEAD`] more bytes, taken from the segments' payload.
    pub fn with_io(
        mut cfg: EndpointConfig,
        io: Box<dyn DatagramIo>,
    ) -> Result<Bound, EndpointError> {
        let member = match cfg.auth {
            None => None,
            Some(_) => Some(Arc::new(
                MemberKey::generate(&ring::rand::SystemRandom::new())
                    .map_err(|e| EndpointError::Auth(e.to_string()))?,
            )),
        };
        let overhead = if member.is_some() {
            crate::seal::OVERHEAD
        } else {
            0
        };
        cfg.core.seg_payload = CoreConfig::seg_payload_for_mtu(
            cfg.mtu.saturating_sub(overhead),
            io.local_addr().is_ipv6(),
        );
        cfg.core.max_bundle = io.max_segments().max(1);
        Ok(Bound { cfg, io, member })
    }
}

impl Bound {
    /// The bound address (what the other ranks need).
    pub fn local_addr(&self) -> SocketAddr {
        self.io.local_addr()
    }

    /// Payload bytes per data segment (what [`Endpoint::seg_payload`] will say).
    pub fn seg_payload(&self) -> usize {
        self.cfg.core.seg_payload
    }

    /// Authenticated jobs: this rank's member key, for what else the rank authenticates
    /// with it (NetStorm's scheduler connections). `None` in a plain job.
    pub fn member_key(&self) -> Option<Arc<MemberKey>> {
        self.member.clone()
    }

    /// Authenticated jobs: this rank's member entry (its public key, proven with the job
    /// key), to publish with its address. `None` in a plain job.
    pub fn member(&self) -> Option<MemberEntry> {
        let (m, key) = (self.member.as_ref()?, self.cfg.auth.as_ref()?);
        Some(m.entry(key, self.cfg.core.job, self.cfg.core.rank))
    }

    /// Starts the progress thread with every rank's address (`peers[rank]`; this rank's own
    /// entry is ignored). Plain jobs only: an authenticated endpoint starts with
    /// [`Bound::start_sealed`].
    pub fn start(self, peers: Vec<SocketAddr>) -> Result<Endpoint, EndpointError> {
        if self.cfg.auth.is_some() {
            return Err(EndpointError::Auth(
                "this endpoint has a job key: start it with start_sealed and every rank's \
                 member entry"
                    .into(),
            ));
        }
        self.launch(peers, None)
    }

    /// Starts an authenticated endpoint with every rank's address and member entry
    /// (`members[rank]` from rank `rank`, as published; this rank's own is ignored; `None`
    /// for a rank this one never talks to: nothing is sent to it or taken from it). Fails
    /// naming the first rank whose entry is not proven with this job's key.
    pub fn start_sealed(
        self,
        peers: Vec<SocketAddr>,
        members: &[Option<MemberEntry>],
    ) -> Result<Endpoint, EndpointError> {
        let (Some(key), Some(member)) = (self.cfg.auth.as_ref(), self.member.as_ref()) else {
            return Err(EndpointError::Auth(
                "this endpoint has no job key (EndpointConfig::auth): start it with start".into(),
            ));
        };
        let (job, rank, world) = (self.cfg.core.job, self.cfg.core.rank, self.cfg.core.world);
        if members.len() != usize::from(world) {
            return Err(EndpointError::Peers(format!(
                "{} member keys for a world of {world}",
                members.len()
            )));
        }
        let sealing = Sealing::new(key, job, rank, member, members)
            .map_err(|(rank, source)| EndpointError::Member { rank, source })?;
        self.launch(peers, Some(sealing))
    }

    fn launch(
        self,
        peers: Vec<SocketAddr>,
        seal: Option<Sealing>,
    ) -> Result<Endpoint, EndpointError> {
        let world = self.cfg.core.world;
        let rank = self.cfg.core.rank;
        if peers.len() != usize::from(world) {
            return Err(EndpointError::Peers(format!(
                "{} addresses for a world of {world}",
                peers.len()
            )));
        }
        let mut by_addr = HashMap::new();
        for (r, a) in peers.iter().enumerate() {
            if r != usize::from(rank) && by_addr.insert(*a, r as u16).is_some() {
                return Err(EndpointError::Peers(format!(
                    "{a} is given for two ranks: every rank needs its own address"
                )));
            }
        }
        let mut io = self.io;
        let others: Vec<SocketAddr> = peers
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != usize::from(rank))
            .map(|(_, a)| *a)
            .collect();
        io.admit_peers(&others).map_err(EndpointError::Admit)?;
        let local = io.local_addr();
        let waker = io.waker();
        let shared = Arc::new(Shared {
            stats: Mutex::new(EndpointStats::default()),
            down: Mutex::new(None),
            closing: std::sync::atomic::AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel();
        let mut driver = Driver {
            core: Core::new(self.cfg.core.clone()),
            io,
            peers,
            by_addr,
            rx,
            ops: HashMap::new(),
            routes: HashMap::new(),
            batch: TxBatch::default(),
            stats: EndpointStats::default(),
            shared: shared.clone(),
            inject_loss: self.cfg.inject_loss,
            rng: fastrand::Rng::with_seed(self.cfg.seed ^ u64::from(rank)),
            seal,
            scratch: Vec::new(),
            arena: Vec::new(),
        };
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("gradwire-msg-{rank}"))
            .spawn(move || {
                let why =
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.run())) {
                        Ok(Ok(())) => "the endpoint was shut down".to_string(),
                        Ok(Err(e)) => format!("socket error: {e}"),
                        Err(_) => "the progress thread panicked (a bug: please report it)".into(),
                    };
                driver.fail_all(&why);
                *sh.down.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
            })
            .map_err(EndpointError::Thread)?;
        Ok(Endpoint {
            tx: Some(tx),
            waker,
            thread: Some(thread),
            local,
            rank,
            world,
            seg_payload: self.cfg.core.seg_payload,
            next_id: AtomicU64::new(1),
            shared,
        })
    }
}

impl Endpoint {
    /// This rank.
    pub fn rank(&self) -> u16 {
        self.rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> u16 {
        self.world
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Payload bytes per data segment: what the MTU leaves after the headers (and, in an
    /// authenticated job, the seal).
    pub fn seg_payload(&self) -> usize {
        self.seg_payload
    }

    /// Counters as of the progress thread's last loop, or of the last operation to complete,
    /// whichever is later.
    pub fn stats(&self) -> EndpointStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Submits an operation. Operations start in submission order on every rank, which is
    /// what keeps the ranks' message numbers in step: submit the same operations in the same
    /// order everywhere.
    pub fn submit<O: Op>(&self, op: O) -> Handle<O::Output> {
        let slot = Slot::new();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let typed = Typed {
            op,
            out: None,
            slot: slot.clone(),
        };
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(Cmd::Submit(id, Box::new(typed))).is_ok());
        if !sent {
            let why = self
                .shared
                .down
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| "the endpoint is shut down".into());
            slot.complete(Err(OpError::Down(why)));
        }
        self.waker.wake();
        let tx = self.tx.clone();
        let waker = self.waker.clone();
        Handle {
            slot,
            cancel: Some(Box::new(move || {
                if let Some(tx) = &tx {
                    let _ = tx.send(Cmd::Cancel(id));
                }
                waker.wake();
            })),
        }
    }

    /// Submits an operation and waits for it; after `timeout` it is cancelled (and still
    /// waited for, so its memory is free when this returns).
    pub fn run<O: Op>(&self, op: O, timeout: Duration) -> Result<O::Output, OpError> {
        match self.submit(op).wait_timeout(timeout) {
            Ok(r) => r,
            Err(h) => {
                h.cancel();
                h.wait()
            }
        }
    }
}

impl Endpoint {
    /// Runs an operation over the caller's memory without copying it: `make` gets a region
    /// over `bytes` and builds the operation. Returns only once the progress thread has let
    /// go of the region (after `timeout` the operation is cancelled and still waited for).
    #[allow(unsafe_code)]
    pub fn run_borrowed<O: Op>(
        &self,
        bytes: &mut [u8],
        timeout: Duration,
        make: impl FnOnce(crate::mem::Region) -> O,
    ) -> Result<O::Output, OpError> {
        // SAFETY: the region is only used by the operation, which the progress thread ends
        // (cancelling its messages and unregistering the region) before it completes the
        // handle; `run` waits for the handle even after a timeout or cancel, and a progress
        // thread that stops fails every operation the same way. So `bytes`, borrowed
        // mutably for this whole call, outlives every use of the region.
        let region = unsafe { crate::mem::Region::borrowed(bytes) };
        self.run(make(region), timeout)
    }
}

impl Endpoint {
    /// Makes every peer give up everything with this rank, naming `culprit` as the rank it
    /// failed on: for a runtime whose operations are isolated (`Op::isolated`), which fails
    /// because of one peer and leaves, so its other peers learn who failed rather than only
    /// that this rank left. Sent before the endpoint closes, even if it is dropped at once.
    pub fn abort_all(&self, culprit: u16) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Cmd::AbortAll(culprit));
            self.waker.wake();
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.tx = None;
        self.shared.closing.store(true, Ordering::Release);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Running {
    op: Box<dyn Erased>,
    bufs: Vec<crate::mem::BufId>,
}

struct Driver {
    core: Core,
    io: Box<dyn DatagramIo>,
    peers: Vec<SocketAddr>,
    by_addr: HashMap<SocketAddr, u16>,
    rx: mpsc::Receiver<Cmd>,
    ops: HashMap<u64, Running>,
    routes: HashMap<Route, u64>,
    batch: TxBatch,
    stats: EndpointStats,
    shared: Arc<Shared>,
    inject_loss: f64,
    rng: fastrand::Rng,
    /// Authenticated jobs: the pair keys, packet numbers and replay windows.
    seal: Option<Sealing>,
    /// Where a sealed datagram is opened.
    scratch: Vec<u8>,
    /// Where a batch's datagrams are sealed before they are sent.
    arena: Vec<u8>,
}

/// After the endpoint is dropped its progress thread goes on answering until nothing has
/// arrived for this long: a peer whose last DONE (or ACK) was lost asks again, and a socket
/// closed at once would fail that peer's operation although everything arrived (the last
/// barrier of a job under loss). Anything about another message gets an ABORT naming this
/// rank, so peers that expect more of it fail at once. An endpoint idle this long before the
/// drop closes at once.
const LINGER_QUIET: Duration = Duration::from_millis(100);
/// The longest a dropped endpoint lingers.
const LINGER_MAX: Duration = Duration::from_secs(1);

impl Driver {
    fn run(&mut self) -> Result<(), BoxError> {
        let mut closing: Option<Instant> = None;
        let mut last_heard = Instant::now()
            .checked_sub(LINGER_QUIET)
            .unwrap_or_else(Instant::now);
        loop {
            let now = Instant::now();
            if let Some(at) = closing {
                if now.saturating_duration_since(last_heard) >= LINGER_QUIET
                    || now.saturating_duration_since(at) >= LINGER_MAX
                {
                    let _ = self.transmit(now);
                    return Ok(());
                }
            }
            // Commands.
            while closing.is_none() {
                match self.rx.try_recv() {
                    Ok(Cmd::Submit(id, op)) => self.start(now, id, op),
                    Ok(Cmd::Cancel(id)) => self.end(
                        id,
                        Err(OpError::Cancelled("cancelled by its caller".into())),
                    ),
                    Ok(Cmd::AbortAll(culprit)) => {
                        let (me, world) = (self.core.config().rank, self.core.config().world);
                        for p in (0..world).filter(|&p| p != me) {
                            self.core.abort_peer(p, Some(culprit));
                        }
                    }
                    Err(mpsc::TryRecvError::Empty)
                        if !self.shared.closing.load(Ordering::Acquire) =>
                    {
                        break
                    }
                    // Dropped: what is queued (an ABORT of everything) goes out below, and
                    // the endpoint lingers while its peers still talk to it, answering only
                    // about finished messages (`Core::close`).
                    Err(_) => {
                        self.fail_all("the endpoint was shut down");
                        self.core.close();
                        closing = Some(now);
                    }
                }
            }
            // Input.
            let (mut got, mut drained) = (0, false);
            for _ in 0..8 {
                let (core, by_addr, stats) = (&mut self.core, &self.by_addr, &mut self.stats);
                let (loss, rng) = (self.inject_loss, &mut self.rng);
                let (seal, scratch) = (&mut self.seal, &mut self.scratch);
                let n = self.io.recv(&mut |meta, d| {
                    let Some(&r) = by_addr.get(&meta.src) else {
                        stats.unknown_source += 1;
                        return;
                    };
                    let d = match seal.as_mut() {
                        None => d,
                        Some(s) => match s.open(r, d, scratch) {
                            Ok(inner) => inner,
                            Err(e) => return refused(stats, r, meta.src, e),
                        },
                    };
                    if loss > 0.0 && d.get(1) == Some(&wire::KIND_DATA) && rng.f64() < loss {
                        stats.injected_drops += 1;
                    } else {
                        core.handle_datagram(now, r, meta.tos, d);
                    }
                })?;
                if n == 0 {
                    drained = true;
                    break;
                }
                self.stats.recv_calls += 1;
                self.stats.datagrams_in += n as u64;
                got += n;
                last_heard = now;
                self.dispatch(now);
            }
            // Only with nothing left to read: a closed peer's last datagrams (its DONE) are
            // queued before the ICMP error its exit causes, and complete what they can.
            if drained {
                self.check_unreachable();
            }
            if self.core.next_timeout().is_some_and(|t| t <= now) {
                self.core.handle_timeout(now);
            }
            self.dispatch(now);
            // Output.
            let sent = self.transmit(now)?;
            self.publish();
            if got == 0 && sent == 0 && !self.core.wants_transmit() {
                let timeout = self
                    .core
                    .next_timeout()
                    .map(|t| t.saturating_duration_since(Instant::now()))
                    .unwrap_or(Duration::from_millis(100))
                    .min(Duration::from_millis(if closing.is_some() {
                        10
                    } else {
                        100
                    }));
                // An error wakes the wait; the next turn receives, then takes the error.
                self.io.wait(Some(timeout), false)?;
            }
        }
    }

    /// Peers whose host reports their socket closed fail their messages now.
    fn check_unreachable(&mut self) {
        for a in self.io.take_unreachable() {
            if let Some(&r) = self.by_addr.get(&a) {
                self.stats.unreachable_reports += 1;
                self.core.peer_unreachable(r);
            }
        }
    }

    fn publish(&mut self) {
        self.stats.core = self.core.stats().clone();
        if let Ok(mut s) = self.shared.stats.try_lock() {
            *s = self.stats.clone();
        }
    }

    /// [`Driver::publish`], waiting for a reader that holds the lock (it only clones).
    fn publish_now(&mut self) {
        self.stats.core = self.core.stats().clone();
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
    }

    fn cx<'a>(
        core: &'a mut Core,
        routes: &'a mut HashMap<Route, u64>,
        bufs: &'a mut Vec<crate::mem::BufId>,
        now: Instant,
        id: u64,
    ) -> OpCx<'a> {
        OpCx {
            core,
            now,
            routes,
            id,
            bufs,
        }
    }

    fn start(&mut self, now: Instant, id: u64, mut op: Box<dyn Erased>) {
        let mut bufs = Vec::new();
        let r = op.start(&mut Self::cx(
            &mut self.core,
            &mut self.routes,
            &mut bufs,
            now,
            id,
        ));
        self.ops.insert(id, Running { op, bufs });
        match r {
            Ok(false) => {}
            Ok(true) => self.end(id, Ok(())),
            Err(e) => self.end(id, Err(e)),
        }
    }

    /// Ends an operation: cancels what it left posted, unregisters its buffers, then hands
    /// the result to its handle.
    fn end(&mut self, id: u64, r: Result<(), OpError>) {
        let Some(mut run) = self.ops.remove(&id) else {
            return;
        };
        let mine: Vec<Route> = self
            .routes
            .iter()
            .filter(|(_, o)| **o == id)
            .map(|(k, _)| *k)
            .collect();
        // A failed (or cancelled) operation tells the peers of its unfinished messages, naming
        // the rank it failed on, so theirs fail now and name that rank too.
        // Invalid arguments start nothing on the peers' side: no one is told.
        let culprit = match &r {
            Ok(()) | Err(OpError::Invalid(_)) => None,
            Err(e) => Some(e.peer()),
        };
        for (peer, msg, send) in mine {
            self.routes.remove(&(peer, msg, send));
            match culprit {
                Some(c) => self.core.abort(peer, msg, send, c),
                None if send => self.core.cancel_send(peer, msg),
                None => self.core.cancel_recv(peer, msg),
            }
        }
        // The ranks may now disagree on where they are in their sequence of operations, and
        // this rank's group refuses further ones: every peer gives up everything with it, now,
        // naming the rank this operation failed on. Not for an isolated operation, whose
        // messages are independent of every other operation's.
        if let (Some(c), false) = (culprit, run.op.isolated()) {
            let (me, world) = (self.core.config().rank, self.core.config().world);
            for p in (0..world).filter(|&p| p != me) {
                self.core.abort_peer(p, c);
            }
        }
        for b in run.bufs.drain(..) {
            self.core.unregister(b);
        }
        // Counters first, so a waiter that reads them after its handle completes sees
        // everything its operation did (per-transfer retransmissions, duplicates).
        self.publish_now();
        match r {
            Ok(()) => run.op.deliver(),
            Err(e) => run.op.fail(e),
        }
    }

    fn dispatch(&mut self, now: Instant) {
        while let Some(ev) = self.core.poll_event() {
            let (route, ev) = match ev {
                Event::Sent {
                    peer,
                    msg,
                    missing,
                    segments,
                } => (
                    (peer, msg, true),
                    Ok(OpEvent::Sent {
                        peer,
                        msg,
                        missing,
                        segments,
                    }),
                ),
                Event::Received { peer, msg, report } => (
                    (peer, msg, false),
                    Ok(OpEvent::Received { peer, msg, report }),
                ),
                Event::Failed {
                    peer,
                    msg,
                    send,
                    error,
                } => ((peer, msg, send), Err(OpError::Peer(error))),
            };
            let Some(id) = self.routes.remove(&route) else {
                continue;
            };
            let r = match ev {
                Err(e) => Err(e),
                Ok(ev) => match self.ops.get_mut(&id) {
                    None => continue,
                    Some(run) => run.op.on_event(
                        ev,
                        &mut Self::cx(&mut self.core, &mut self.routes, &mut run.bufs, now, id),
                    ),
                },
            };
            match r {
                Ok(false) => {}
                Ok(true) => self.end(id, Ok(())),
                Err(e) => self.end(id, Err(e)),
            }
        }
    }

    /// Sends everything the core has now; returns datagrams sent.
    fn transmit(&mut self, now: Instant) -> Result<usize, BoxError> {
        let mut total = 0;
        loop {
            self.core.poll_transmit(now, &mut self.batch, 32);
            if self.batch.is_empty() {
                return Ok(total);
            }
            let bufs = self.core.buffers();
            let (iov, spans) = match self.seal.as_mut() {
                None => gather(&self.batch, bufs),
                Some(seal) => gather_sealed(&self.batch, bufs, seal, &mut self.arena),
            };
            let tx: Vec<Transmit<'_>> = spans
                .iter()
                .map(|(peer, tos, seg, r)| Transmit {
                    dst: self.peers[usize::from(*peer)],
                    tos: *tos,
                    segment_size: *seg,
                    iov: &iov[r.clone()],
                })
                .collect();
            let mut done = 0;
            while done < tx.len() {
                let n = self.io.send(&tx[done..])?;
                self.stats.send_calls += 1;
                done += n;
                if n == 0 {
                    self.io.wait(Some(Duration::from_millis(10)), true)?;
                }
            }
            total += self.batch.headers.len() + self.batch.ctrl.len();
            self.stats.datagrams_out += (self.batch.headers.len() + self.batch.ctrl.len()) as u64;
        }
    }

    fn fail_all(&mut self, why: &str) {
        let ids: Vec<u64> = self.ops.keys().copied().collect();
        for id in ids {
            self.end(id, Err(OpError::Down(why.to_string())));
        }
        // Operations submitted but never started.
        while let Ok(cmd) = self.rx.try_recv() {
            if let Cmd::Submit(_, mut op) = cmd {
                op.fail(OpError::Down(why.to_string()));
            }
        }
    }
}

/// Where each datagram of a batch goes: `(peer, TOS, GSO segment size, its slices in the iov)`.
type Spans = Vec<(u16, u8, usize, std::ops::Range<usize>)>;

/// A batch's datagrams as they are: headers and payloads straight from registered memory.
fn gather<'a>(batch: &'a TxBatch, bufs: &'a crate::mem::Buffers) -> (Vec<IoSlice<'a>>, Spans) {
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(batch.headers.len() * 2 + batch.ctrl.len());
    let mut spans = Vec::with_capacity(batch.bundles.len() + batch.ctrl.len());
    for c in &batch.ctrl {
        spans.push((c.peer, c.tos, c.bytes.len(), iov.len()..iov.len() + 1));
        iov.push(IoSlice::new(&c.bytes));
    }
    for b in &batch.bundles {
        let start = iov.len();
        for s in b.segs.clone() {
            iov.push(IoSlice::new(&batch.headers[s]));
            let (buf, range) = &batch.payloads[s];
            let payload = bufs.get(*buf, range.clone()).unwrap_or(&[]);
            if !payload.is_empty() {
                iov.push(IoSlice::new(payload));
            }
        }
        spans.push((b.peer, b.tos, b.segment_size, start..iov.len()));
    }
    (iov, spans)
}

/// A batch's datagrams sealed into `arena`, one slice each (the payload's one copy is the
/// one encryption needs anyway: the tensor is never written).
fn gather_sealed<'a>(
    batch: &TxBatch,
    bufs: &crate::mem::Buffers,
    seal: &mut Sealing,
    arena: &'a mut Vec<u8>,
) -> (Vec<IoSlice<'a>>, Spans) {
    arena.clear();
    let mut dgrams = Vec::with_capacity(batch.headers.len() + batch.ctrl.len());
    let mut spans = Vec::with_capacity(batch.bundles.len() + batch.ctrl.len());
    // The core sends only to the job's other ranks, which all have keys; a datagram for
    // any other rank could not be sealed and is not sent.
    let mut seal_one = |peer: u16, parts: &[&[u8]], arena: &mut Vec<u8>| {
        let at = arena.len();
        seal.seal(peer, parts, arena).then(|| {
            dgrams.push(at..arena.len());
            dgrams.len() - 1
        })
    };
    for c in &batch.ctrl {
        if let Some(i) = seal_one(c.peer, &[&c.bytes], arena) {
            let size = c.bytes.len() + crate::seal::OVERHEAD;
            spans.push((c.peer, c.tos, size, i..i + 1));
        }
    }
    for b in &batch.bundles {
        let mut sealed: Option<std::ops::Range<usize>> = None;
        for s in b.segs.clone() {
            let (buf, range) = &batch.payloads[s];
            let payload = bufs.get(*buf, range.clone()).unwrap_or(&[]);
            if let Some(i) = seal_one(b.peer, &[&batch.headers[s], payload], arena) {
                sealed = Some(sealed.map_or(i..i + 1, |r| r.start..i + 1));
            }
        }
        if let Some(r) = sealed {
            spans.push((b.peer, b.tos, b.segment_size + crate::seal::OVERHEAD, r));
        }
    }
    let arena: &'a [u8] = arena;
    (
        dgrams
            .into_iter()
            .map(|r| IoSlice::new(&arena[r]))
            .collect(),
        spans,
    )
}

/// Counts a datagram from `r`'s address that did not open, with one log line for the first
/// of each kind and then every 10,000th (a flood must not flood the log).
fn refused(stats: &mut EndpointStats, r: u16, src: SocketAddr, e: OpenError) {
    let n = match e {
        OpenError::Replayed => {
            stats.replayed += 1;
            stats.replayed
        }
        _ => {
            stats.unauthenticated += 1;
            stats.unauthenticated
        }
    };
    if n % 10_000 == 1 {
        log::warn!(
            "message layer: refused a datagram from {src} (rank {r}'s address): {e} \
             ({n} so far)"
        );
    }
}
