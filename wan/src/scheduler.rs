//! The scheduler (NetStorm §VIII-B): the network collector (link reports into the overlay),
//! policy formulation (Algorithms 2 and 3, or a baseline's tree) and policy consistency
//! (§VII-A: a topology request before each PUSH; the policy is pinned per round).
//!
//! **One policy per round.** A refresh may happen while some nodes of round `r` have asked
//! and others have not. Every topology request of round `r` is answered with the policy the
//! first request of round `r` got ([`SchedulerState`], model-checked in the scheduler
//! crate), so all nodes of a round run one policy; a new version takes effect from the next
//! round that no node has started.
//!
//! **Connections.** Every wait on a node connection is bounded: its first frame within
//! [`HELLO_TIMEOUT`] of its accept, every frame within [`FRAME_TIMEOUT`] of its first byte,
//! every answer taken within the frame timeout; between frames a node may idle for as long
//! as it computes. At most [`CONNECTIONS_PER_NODE`] per node of the job are served at once;
//! when all places are taken, a new connection takes the place of the one silent longest
//! (for at least [`EVICT_IDLE`]) among those that have not spoken yet, so connections that
//! never speak cannot lock a node out.
//!
//! **Who speaks for a node.** A connection's first frame names its node, and it speaks for
//! that node only: a message for another drops it. When the scheduler knows the nodes'
//! addresses ([`SchedulerConfig::node_ips`]; the site fills them from the rendezvous), a
//! connection speaks for node `k` only from node `k`'s address, else it is dropped with a
//! warning naming both. At most one connection speaks for a node: a newer one (from the
//! right address) replaces the older, which is closed, since a node that reconnects after a
//! network blip must get in. Without a job secret this binds by IP address only: anyone who
//! can open a TCP connection from a node's address (on its host, or on the path) can speak
//! for it, and can take its connection away. NetStorm jobs cannot use a job secret yet: the
//! message layer they run on does not seal packets, and the scheduler's TCP frames carry
//! none (docs/security.md).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::consistency::SchedulerState;
use gradwire_netstorm::graph::Overlay;
use gradwire_netstorm::wire::{frame_len, Kind, Message, Policy, TopologyRequest, HEADER_LEN};

use crate::error::WanError;
use crate::plan::{formulate, Planner};
use crate::policy::parents;
use crate::seal::{ControlAuth, Seal, HELLO_LEN, TAG_LEN};

/// How the scheduler builds policies: NetStorm's, and the baselines, in one code path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Strategy {
    /// One parameter server (MXNet): every node's parent is the root.
    Star,
    /// MLNET's balanced k-ary tree.
    Bkt,
    /// TSEngine's maximum-throughput spanning tree.
    Mst,
    /// One fastest-aggregation-path tree (the best root).
    Fapt,
    /// Multi-root FAPT, from the first measurements only.
    MrFapt,
    /// Multi-root FAPT refreshed from passive link reports.
    MrFaptAware,
    /// ... with auxiliary paths.
    MrFaptAwareAux,
}

impl Strategy {
    /// Every strategy, in the experiment's order.
    pub const ALL: [Strategy; 7] = [
        Strategy::Star,
        Strategy::Bkt,
        Strategy::Mst,
        Strategy::Fapt,
        Strategy::MrFapt,
        Strategy::MrFaptAware,
        Strategy::MrFaptAwareAux,
    ];

    /// The name used in files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Star => "star",
            Strategy::Bkt => "bkt",
            Strategy::Mst => "mst",
            Strategy::Fapt => "fapt",
            Strategy::MrFapt => "mr-fapt",
            Strategy::MrFaptAware => "mr-fapt+aware",
            Strategy::MrFaptAwareAux => "mr-fapt+aware+aux",
        }
    }

    /// Refreshes the policy from link reports.
    pub fn aware(self) -> bool {
        matches!(self, Strategy::MrFaptAware | Strategy::MrFaptAwareAux)
    }

    /// Uses auxiliary paths.
    pub fn aux(self) -> bool {
        self == Strategy::MrFaptAwareAux
    }

    /// The options NetStorm runs this strategy with: awareness and auxiliary paths switched
    /// as the strategy says.
    pub fn netstorm(self, base: &NetStormConfig) -> NetStormConfig {
        NetStormConfig {
            enable_awareness: self.aware(),
            enable_aux_path: self.aux(),
            ..base.clone()
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Strategy::ALL.iter().map(|x| x.name()).collect();
                format!("unknown strategy {s:?} (one of {})", names.join(", "))
            })
    }
}

/// How the scheduler runs.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Nodes in the job.
    pub world: usize,
    /// The strategy.
    pub strategy: Strategy,
    /// NetStorm's options (UPDATE_TIME, roots, chunk shares).
    pub netstorm: NetStormConfig,
    /// The overlay as first measured (link rates before any report).
    pub overlay: Overlay,
    /// Bytes a tree edge carries per round: the model's (its values, in bytes). It weighs
    /// each link's transfer delay, latency + bytes / throughput, as the paper's "transfer
    /// delay of the full tensor" (§IV-B), so on slow links bandwidth, not latency, decides.
    pub round_bytes: u64,
    /// Each node's address (by node id), when known: a connection speaks for node `k` only
    /// from `node_ips[k]` (IPv4-mapped IPv6 addresses count as their IPv4 address). `None`:
    /// any address may claim any node (tests, and a scheduler started before the nodes'
    /// addresses are known).
    pub node_ips: Option<Vec<IpAddr>>,
    /// Authenticated jobs: every connection opens with a node's hello and carries a tag
    /// after every frame ([`crate::seal`]); a connection that cannot prove it is the node it
    /// names is refused. `None`: plain frames.
    pub auth: Option<ControlAuth>,
}

impl SchedulerConfig {
    /// What [`spawn`] checks before it serves: the overlay and the node addresses fit the
    /// world, and the first policy can be formulated. For a caller that starts the scheduler
    /// later (once the nodes' addresses are known) and wants a bad configuration to fail
    /// early.
    pub fn validate(&self) -> Result<(), WanError> {
        self.first_policy(&mut Planner::default()).map(|_| ())
    }

    /// The checks of [`SchedulerConfig::validate`], and the first policy.
    fn first_policy(&self, planner: &mut Planner) -> Result<Policy, WanError> {
        if self.overlay.num_nodes() != self.world {
            return Err(WanError::Config(format!(
                "the overlay has {} sites for a {}-node job",
                self.overlay.num_nodes(),
                self.world
            )));
        }
        if let Some(ips) = &self.node_ips {
            if ips.len() != self.world {
                return Err(WanError::Config(format!(
                    "{} node addresses for a {}-node job: give one per node, by node id",
                    ips.len(),
                    self.world
                )));
            }
        }
        formulate(
            self.strategy,
            &self.overlay,
            planner,
            &self.netstorm,
            self.round_bytes,
        )
    }
}

/// A policy the scheduler formulated.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicyRecord {
    /// Its version.
    pub version: u32,
    /// When, in milliseconds since the scheduler started.
    pub at_ms: f64,
    /// Each tree's parent vector (root order).
    pub parents: Vec<Vec<Option<usize>>>,
}

impl PolicyRecord {
    /// Whether some tree has an edge between `a` and `b` (either way).
    pub fn uses_link(&self, a: usize, b: usize) -> bool {
        self.parents.iter().any(|t| {
            t.get(a).copied().flatten() == Some(b) || t.get(b).copied().flatten() == Some(a)
        })
    }
}

/// What the scheduler did (a node's output carries it as written here, on the node that
/// served it).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerReport {
    /// Policies formulated, the first included.
    pub policies: Vec<PolicyRecord>,
    /// Link reports received.
    pub link_reports: usize,
    /// Topology requests answered.
    pub requests: usize,
}

#[derive(Debug)]
struct State {
    cfg: SchedulerConfig,
    planner: Planner,
    overlay: Overlay,
    /// Versions and the per-round pins (the model-checked consistency module).
    consistency: SchedulerState,
    last_refresh: Instant,
    started: Instant,
    report: SchedulerReport,
}

impl State {
    /// The network collector: a link's new throughput.
    fn collect(&mut self, from: usize, to: usize, bps: f64) {
        self.report.link_reports += 1;
        if self.cfg.strategy.aware() && bps > 0.0 {
            // Pairs that are not overlay links (a star's edges) are not in the overlay.
            let _ = self.overlay.set_throughput(from, to, bps);
        }
    }

    /// Policy formulation from the current view; a changed policy is a new version.
    fn refresh(&mut self) -> Result<(), WanError> {
        let next = formulate(
            self.cfg.strategy,
            &self.overlay,
            &mut self.planner,
            &self.cfg.netstorm,
            self.cfg.round_bytes,
        )?;
        self.last_refresh = Instant::now();
        if &next != self.consistency.policy() {
            let parents = parents(&next);
            let version = self
                .consistency
                .install(next)
                .map_err(|e| WanError::Plan(e.to_string()))?;
            self.report.policies.push(PolicyRecord {
                version,
                at_ms: self.started.elapsed().as_secs_f64() * 1e3,
                parents,
            });
        }
        Ok(())
    }

    /// A TRP: refresh first when UPDATE_TIME has passed and the round is not pinned yet.
    fn answer(&mut self, req: &TopologyRequest) -> Result<Message, WanError> {
        self.report.requests += 1;
        if self.cfg.strategy.aware()
            && self.consistency.pinned(req.round).is_none()
            && self.last_refresh.elapsed() >= self.cfg.netstorm.update_time
        {
            self.refresh()?;
        }
        let reply = self
            .consistency
            .on_request(req)
            .map_err(|e| WanError::Plan(e.to_string()))?;
        Ok(reply.into())
    }
}

/// A running scheduler.
#[derive(Debug)]
pub struct SchedulerHandle {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<SchedulerReport, WanError>>>,
}

impl SchedulerHandle {
    /// Where nodes connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the network collector does with a link report: the throughput of `from -> to`
    /// is now `bps` (aware strategies; others keep their first view). For operators (a
    /// link known to be degraded) and tests.
    pub fn report_link(&self, from: usize, to: usize, bps: f64) -> Result<(), WanError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| WanError::Internal("scheduler state poisoned".into()))?;
        st.collect(from, to, bps);
        Ok(())
    }

    /// Stop serving and return what happened.
    pub fn stop(mut self) -> Result<SchedulerReport, WanError> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            _ => Err(WanError::Internal("the scheduler thread panicked".into())),
        }
    }
}

impl Drop for SchedulerHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Start the scheduler on `listener`: the first policy is formulated from `cfg.overlay`.
pub fn spawn(listener: TcpListener, cfg: SchedulerConfig) -> Result<SchedulerHandle, WanError> {
    spawn_with(listener, cfg, ConnectionOptions::default())
}

/// How the scheduler treats its node connections: the defaults are the constants; tests
/// shorten them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionOptions {
    /// A connection is dropped when a frame that has started is not complete within this
    /// ([`FRAME_TIMEOUT`]).
    pub frame_timeout: Duration,
    /// A connection is dropped when its first frame is not complete within this of its
    /// accept ([`HELLO_TIMEOUT`]).
    pub hello_timeout: Duration,
}

impl Default for ConnectionOptions {
    fn default() -> Self {
        ConnectionOptions {
            frame_timeout: FRAME_TIMEOUT,
            hello_timeout: HELLO_TIMEOUT,
        }
    }
}

/// [`spawn`], with the connections' timeouts of `opts`.
pub fn spawn_with(
    listener: TcpListener,
    cfg: SchedulerConfig,
    opts: ConnectionOptions,
) -> Result<SchedulerHandle, WanError> {
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let mut planner = Planner::default();
    let first = cfg.first_policy(&mut planner)?;
    let overlay = cfg.overlay.clone();
    let started = Instant::now();
    let state = Arc::new(Mutex::new(State {
        report: SchedulerReport {
            policies: vec![PolicyRecord {
                version: 1,
                at_ms: 0.0,
                parents: parents(&first),
            }],
            ..SchedulerReport::default()
        },
        planner,
        overlay,
        consistency: SchedulerState::new(first),
        last_refresh: started,
        started,
        cfg,
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let shared = Arc::clone(&state);
    let thread = std::thread::Builder::new()
        .name("netstorm-scheduler".into())
        .spawn(move || serve(listener, shared, flag, opts))?;
    Ok(SchedulerHandle {
        addr,
        state,
        stop,
        thread: Some(thread),
    })
}

/// Most node connections served at once, per node of the job: a node keeps one (at most one
/// speaks for each node), the rest is room for reconnections. When every place is taken, a
/// new connection takes the place of the one silent longest (for at least [`EVICT_IDLE`])
/// among those that have not spoken yet, so idle connections cannot keep a node out; while
/// none has been silent that long (every one of them sends, or has just come), new ones
/// wait in the listen backlog, in order, and are accepted as places free.
pub const CONNECTIONS_PER_NODE: usize = 4;
/// How long a new connection has, from its accept, to complete its first frame. A node sends
/// its topology request (or a link report) as soon as it has connected
/// ([`SchedulerClient`](crate::control::SchedulerClient) connects right before its first
/// frame), so a connection silent this long is no node's, and its place is freed.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Least silence of a connection that gives its place to a new one when all are taken:
/// longer than a node takes from connecting to its first frame. The rendezvous's, as the
/// rule is ([`gradwire_rendezvous::stalest`]).
pub const EVICT_IDLE: Duration = gradwire_rendezvous::EVICT_IDLE;

/// A live connection, as the accept loop sees it.
#[derive(Debug)]
struct Live {
    id: u64,
    peer: SocketAddr,
    /// The connection's socket: shutting it down ends the connection's thread at its next
    /// read or write.
    socket: TcpStream,
    /// When it was accepted, or last started or finished a frame.
    heard: Instant,
    /// The node its first frame named.
    node: Option<u16>,
}

/// The live connections, shared by the accept loop and the connection threads.
type Registry = Arc<Mutex<Vec<Live>>>;

/// A connection thread's place in the [`Registry`]: freed when the thread ends, however it
/// ends.
struct Place {
    id: u64,
    registry: Registry,
}

impl Place {
    /// Whether the connection still has its place: not evicted, nor replaced by a newer
    /// connection of its node (whose socket was shut down, but frames read before the shut
    /// down may still be in hand).
    fn held(&self) -> bool {
        self.registry
            .lock()
            .is_ok_and(|r| r.iter().any(|l| l.id == self.id))
    }

    /// The connection was heard from now.
    fn heard(&self) {
        if let Ok(mut r) = self.registry.lock() {
            if let Some(l) = r.iter_mut().find(|l| l.id == self.id) {
                l.heard = Instant::now();
            }
        }
    }

    /// The connection now speaks for `node`: any other live connection of `node` is closed.
    /// The newer wins, as a node that reconnects after a network blip must get in (its old
    /// connection may look alive for minutes); the address check before this makes sure
    /// the newer comes from the node's address, when the scheduler knows it.
    fn bind(&self, node: u16, peer: SocketAddr) {
        let Ok(mut r) = self.registry.lock() else {
            return;
        };
        r.retain(|l| {
            if l.id == self.id || l.node != Some(node) {
                return true;
            }
            // Its thread sees the socket shut down at its next read or write and ends.
            let _ = l.socket.shutdown(std::net::Shutdown::Both);
            log::warn!(
                "scheduler: node {node} connected again from {peer}: closed its older \
                 connection from {}",
                l.peer
            );
            false
        });
        if let Some(l) = r.iter_mut().find(|l| l.id == self.id) {
            l.node = Some(node);
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Ok(mut r) = self.registry.lock() {
            r.retain(|l| l.id != self.id);
        }
    }
}

/// Room for one more connection when `cap` are live: the one silent longest, for at least
/// [`EVICT_IDLE`], of those that have not spoken yet is closed; `false` when none has been
/// silent that long. A connection that speaks for a node is never evicted: there is one per
/// node at most ([`Place::bind`]), a quarter of the places, and its node may compute for
/// minutes between frames.
fn make_room(registry: &Mutex<Vec<Live>>, cap: usize) -> bool {
    let Ok(mut r) = registry.lock() else {
        return false;
    };
    if r.len() < cap {
        return true;
    }
    let victim = gradwire_rendezvous::stalest(&r, |l| l.node.is_none().then_some(l.heard));
    let Some(i) = victim else { return false };
    let l = r.swap_remove(i);
    // Its thread sees the socket shut down at its next read or write (within IDLE_POLL) and
    // ends: threads exceed the cap by the evicted ones for that long at most.
    let _ = l.socket.shutdown(std::net::Shutdown::Both);
    log::warn!(
        "scheduler: closed the connection from {}, silent for {:?} without a frame, to make \
         room: {cap} node connections were open",
        l.peer,
        l.heard.elapsed()
    );
    true
}

fn serve(
    listener: TcpListener,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    opts: ConnectionOptions,
) -> Result<SchedulerReport, WanError> {
    let cap = {
        let st = state
            .lock()
            .map_err(|_| WanError::Internal("scheduler state poisoned".into()))?;
        CONNECTIONS_PER_NODE * st.cfg.world.max(1)
    };
    let registry: Registry = Arc::new(Mutex::new(Vec::new()));
    let mut next_id = 0u64;
    let mut conns: Vec<std::thread::JoinHandle<()>> = Vec::new();
    let mut full = false;
    // A newcomer accepted while every place was taken, first in line for the next place
    // (the ones after it wait in the listen backlog, in order).
    let mut waiting: Option<(TcpStream, SocketAddr)> = None;
    while !stop.load(Ordering::Acquire) {
        // Finished connections leave the list: it holds the live ones only.
        conns.retain(|c| !c.is_finished());
        let (s, peer) = match waiting.take() {
            Some(w) => w,
            None => match listener.accept() {
                Ok(w) => w,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                // E.g. out of file descriptors: keep serving the connections there are, and
                // try again shortly.
                Err(e) => {
                    log::warn!("scheduler: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            },
        };
        // Every place taken and none to free: the newcomer waits rather than being closed,
        // so a node that connects while a flood holds every place gets in as the flood's
        // connections go stale.
        if !make_room(&registry, cap) {
            if !full {
                log::warn!(
                    "scheduler: {cap} node connections are open, none silent for \
                     {EVICT_IDLE:?} without a frame: new ones wait"
                );
            }
            full = true;
            waiting = Some((s, peer));
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        full = false;
        let socket = match s.try_clone() {
            Ok(c) => c,
            Err(e) => {
                log::warn!("scheduler: could not serve a connection from {peer}: {e}");
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        let accepted = Instant::now();
        if let Ok(mut r) = registry.lock() {
            r.push(Live {
                id,
                peer,
                socket,
                heard: accepted,
                node: None,
            });
        }
        let place = Place {
            id,
            registry: Arc::clone(&registry),
        };
        let state = Arc::clone(&state);
        let stop = Arc::clone(&stop);
        match std::thread::Builder::new()
            .name("netstorm-node-conn".into())
            .spawn(move || connection(s, peer, accepted, place, &state, &stop, opts))
        {
            Ok(c) => conns.push(c),
            // Out of threads for now: this connection is closed (its place freed
            // with the closure), the next is tried.
            Err(e) => log::warn!("scheduler: could not serve a connection: {e}"),
        }
    }
    for c in conns {
        let _ = c.join();
    }
    let st = state
        .lock()
        .map_err(|_| WanError::Internal("scheduler state poisoned".into()))?;
    Ok(st.report.clone())
}

/// How long a connection has for a whole frame once its first byte has come.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a connection looks at the stop flag, idle or mid-frame.
const IDLE_POLL: Duration = Duration::from_millis(200);

/// Why a connection ends.
fn ended(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

/// `frame_timeout` from now (a timeout too long for the clock is no timeout: a year stands in
/// for it).
fn deadline_in(frame_timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(frame_timeout)
        .unwrap_or(now + Duration::from_secs(365 * 24 * 3600))
}

/// Moves `len` bytes by `deadline`, looking at `stop` every [`IDLE_POLL`]: `step(done,
/// timeout)` reads or writes what is left from byte `done` with the socket's timeout set to
/// `timeout`, and returns how many it moved (0: the stream ended, an error of kind
/// `closed`); `overdue(done)` is the error when the deadline passes.
fn move_by(
    len: usize,
    deadline: Instant,
    stop: &AtomicBool,
    closed: std::io::ErrorKind,
    mut step: impl FnMut(usize, Duration) -> std::io::Result<usize>,
    overdue: impl Fn(usize) -> std::io::Error,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        if stop.load(Ordering::Acquire) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                "the scheduler is stopping",
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(overdue(done));
        }
        match step(done, left.min(IDLE_POLL)) {
            Ok(0) => return Err(std::io::Error::new(closed, "closed")),
            Ok(n) => done += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fill `buf` by `deadline`, looking at `stop` every [`IDLE_POLL`]; `limit` says which
/// limit the deadline is, for the error when it passes.
fn read_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    limit: &str,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let len = buf.len();
    move_by(
        len,
        deadline,
        stop,
        std::io::ErrorKind::UnexpectedEof,
        |got, timeout| {
            s.set_read_timeout(Some(timeout))?;
            s.read(&mut buf[got..])
        },
        |got| {
            ended(format!(
                "a frame not complete {limit} ({got} of {len} bytes)"
            ))
        },
    )
}

/// Write `m` (and, authenticated, its tag) within `frame_timeout` in all, looking at `stop`
/// every [`IDLE_POLL`]: a node that does not read its answers cannot hold a connection
/// thread, nor [`SchedulerHandle::stop`].
fn write_by(
    s: &mut TcpStream,
    m: &Message,
    seal: Option<&mut Seal>,
    frame_timeout: Duration,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let mut bytes = m.to_vec().map_err(ended)?;
    if let Some(seal) = seal {
        let tag = seal.tag(&bytes);
        bytes.extend_from_slice(&tag);
    }
    write_bytes_by(s, &bytes, frame_timeout, stop)
}

/// Write `bytes` within `frame_timeout` in all, looking at `stop` every [`IDLE_POLL`].
fn write_bytes_by(
    s: &mut TcpStream,
    bytes: &[u8],
    frame_timeout: Duration,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    move_by(
        bytes.len(),
        deadline_in(frame_timeout),
        stop,
        std::io::ErrorKind::WriteZero,
        |sent, timeout| {
            s.set_write_timeout(Some(timeout))?;
            s.write(&bytes[sent..])
        },
        |sent| {
            ended(format!(
                "an answer not taken within {frame_timeout:?} ({sent} of {} bytes)",
                bytes.len()
            ))
        },
    )
}

/// Wait up to [`IDLE_POLL`] for a frame to start (`Ok(None)`: none did), then read all of it
/// within `frame_timeout` ([`FRAME_TIMEOUT`]) and by `hello` (the first frame's deadline and
/// the first-frame timeout), looking at `stop` meanwhile. A frame is never read in part and
/// then abandoned, which would leave the stream in the middle of a frame; only the kinds a
/// node sends are read past their header (the others would be up to a megabyte).
fn next_frame(
    s: &mut TcpStream,
    stop: &AtomicBool,
    frame_timeout: Duration,
    hello: Option<(Instant, Duration)>,
    place: &Place,
    seal: Option<&mut Seal>,
) -> std::io::Result<Option<Message>> {
    s.set_read_timeout(Some(IDLE_POLL))?;
    match s.peek(&mut [0u8; 1]) {
        Ok(0) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed",
            ))
        }
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    }
    place.heard();
    let frame_by = deadline_in(frame_timeout);
    let (deadline, limit) = match hello {
        Some((by, t)) if by < frame_by => (
            by,
            format!("within {t:?} of connecting, the first-frame timeout"),
        ),
        _ => (
            frame_by,
            format!("within {frame_timeout:?}, the frame timeout"),
        ),
    };
    let mut buf = vec![0u8; HEADER_LEN];
    read_by(s, &mut buf, deadline, &limit, stop)?;
    let (kind, total) = frame_len(&buf).map_err(ended)?;
    if !matches!(kind, Kind::LinkReport | Kind::TopologyRequest) {
        return Err(ended(format!(
            "a {kind:?} frame, which only the scheduler sends"
        )));
    }
    buf.resize(total, 0);
    read_by(s, &mut buf[HEADER_LEN..], deadline, &limit, stop)?;
    if let Some(seal) = seal {
        let mut tag = [0u8; TAG_LEN];
        read_by(s, &mut tag, deadline, &limit, stop)?;
        if !seal.check(&buf, &tag) {
            return Err(ended(
                "a frame whose tag does not verify: not from the node its hello named, or \
                 altered",
            ));
        }
    }
    let m = Message::parse(&buf).map_err(ended)?;
    place.heard();
    Ok(Some(m))
}

/// Whether a connection from `from` may speak for `node`: from the node's address when the
/// scheduler knows it (IPv4-mapped IPv6 addresses count as their IPv4 address).
fn from_its_address(cfg: &SchedulerConfig, node: u16, from: IpAddr) -> Result<(), String> {
    let Some(ips) = &cfg.node_ips else {
        return Ok(());
    };
    match ips.get(usize::from(node)).map(IpAddr::to_canonical) {
        Some(ip) if ip == from.to_canonical() => Ok(()),
        Some(ip) => Err(format!("it spoke for node {node}, whose address is {ip}")),
        None => Err(format!(
            "it spoke for node {node}, beyond the job's {} nodes",
            ips.len()
        )),
    }
}

/// One node's connection, accepted from `peer` at `accepted`: answer its requests, collect
/// its reports, until it closes. Its first frame must be complete within the first-frame
/// timeout ([`HELLO_TIMEOUT`]); after that it may idle between frames for as long as its
/// node computes. The connection speaks for the node named by its first message and for no
/// other: a message for another node (a report of a link into another node, another node's
/// request) drops it, so one connection cannot steer the policy for the whole job.
fn connection(
    mut s: TcpStream,
    peer: SocketAddr,
    accepted: Instant,
    place: Place,
    state: &Mutex<State>,
    stop: &AtomicBool,
    opts: ConnectionOptions,
) {
    if s.set_nonblocking(false).is_err() {
        return;
    }
    let _ = s.set_nodelay(true);
    let hello_by = accepted
        .checked_add(opts.hello_timeout)
        .unwrap_or_else(|| deadline_in(opts.hello_timeout));
    let auth = match state.lock() {
        Ok(st) => st.cfg.auth.clone(),
        Err(_) => return,
    };
    // Authenticated: the node's hello first, within the first-frame timeout.
    let (mut seal, named) = match auth {
        None => (None, None),
        Some(auth) => match authenticate(&mut s, &auth, peer, hello_by, state, stop, &opts) {
            Some((node, seal)) => {
                place.heard();
                (Some(seal), Some(node))
            }
            None => return,
        },
    };
    let mut node: Option<u16> = None;
    while !stop.load(Ordering::Acquire) {
        let hello = node.is_none().then_some((hello_by, opts.hello_timeout));
        let msg = match next_frame(
            &mut s,
            stop,
            opts.frame_timeout,
            hello,
            &place,
            seal.as_mut(),
        ) {
            Ok(Some(m)) => m,
            Ok(None) if node.is_none() && Instant::now() >= hello_by => {
                log::warn!(
                    "scheduler: closed the connection from {peer}: no frame within {:?} of \
                     connecting, the first-frame timeout",
                    opts.hello_timeout
                );
                return;
            }
            Ok(None) => continue,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    log::warn!("scheduler: dropped the connection from {peer}: {e}");
                }
                return;
            }
        };
        if !place.held() {
            return;
        }
        let claims = match &msg {
            // A node measures the links into itself.
            Message::LinkReport(r) => r.to,
            Message::TopologyRequest(r) => r.node,
            // Only the scheduler sends these: `next_frame` refused them at their header.
            Message::PolicyUpdate(_) | Message::PolicyConfirm(_) | Message::Chunk(_) => return,
        };
        match node {
            Some(n) if n != claims => {
                log::warn!(
                    "scheduler: dropped node {n}'s connection from {peer}: it spoke for node \
                     {claims}"
                );
                return;
            }
            Some(_) => {}
            None if named.is_some_and(|n| n != claims) => {
                log::warn!(
                    "scheduler: dropped a connection from {peer}: its hello named node {:?}, \
                     its frame spoke for node {claims}",
                    named
                );
                return;
            }
            None => {
                let Ok(st) = state.lock() else { return };
                if let Err(why) = from_its_address(&st.cfg, claims, peer.ip()) {
                    log::warn!("scheduler: dropped a connection from {}: {why}", peer.ip());
                    return;
                }
                drop(st);
                place.bind(claims, peer);
                node = Some(claims);
            }
        }
        let Ok(mut st) = state.lock() else { return };
        let reply = match msg {
            Message::LinkReport(r) => {
                st.collect(
                    usize::from(r.from),
                    usize::from(r.to),
                    r.throughput_bps as f64,
                );
                None
            }
            Message::TopologyRequest(req) => match st.answer(&req) {
                Ok(m) => Some(m),
                Err(e) => {
                    log::warn!("scheduler: node {} from {peer}: {e}", req.node);
                    return;
                }
            },
            Message::PolicyUpdate(_) | Message::PolicyConfirm(_) | Message::Chunk(_) => return,
        };
        drop(st);
        if let Some(m) = reply {
            if let Err(e) = write_by(&mut s, &m, seal.as_mut(), opts.frame_timeout, stop) {
                log::warn!("scheduler: dropped node {claims}'s connection from {peer}: {e}");
                return;
            }
        }
    }
}

/// An authenticated connection's hello: reads it by `hello_by`, checks the node it names
/// (beyond the job, another address, an entry that does not verify: refused, one log line),
/// answers with the scheduler's nonce. `None`: the connection is over.
fn authenticate(
    s: &mut TcpStream,
    auth: &ControlAuth,
    peer: SocketAddr,
    hello_by: Instant,
    state: &Mutex<State>,
    stop: &AtomicBool,
    opts: &ConnectionOptions,
) -> Option<(u16, Seal)> {
    let mut hello = [0u8; HELLO_LEN];
    let limit = format!(
        "within {:?} of connecting, the first-frame timeout",
        opts.hello_timeout
    );
    if let Err(e) = read_by(s, &mut hello, hello_by, &limit, stop) {
        if e.kind() == std::io::ErrorKind::InvalidData {
            log::warn!("scheduler: closed the connection from {peer}: its hello: {e}");
        }
        return None;
    }
    let (node, nonce, seal) = match auth.server(&hello) {
        Ok(x) => x,
        Err(why) => {
            log::warn!("scheduler: refused a connection from {peer}: {why}");
            return None;
        }
    };
    let from = state
        .lock()
        .ok()
        .map(|st| from_its_address(&st.cfg, node, peer.ip()))?;
    if let Err(why) = from {
        log::warn!("scheduler: refused a connection from {}: {why}", peer.ip());
        return None;
    }
    if let Err(e) = write_bytes_by(s, &nonce, opts.frame_timeout, stop) {
        log::warn!("scheduler: dropped node {node}'s connection from {peer}: {e}");
        return None;
    }
    Some((node, seal))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_uses_the_links_of_its_trees_either_way() {
        let p = PolicyRecord {
            version: 1,
            at_ms: 0.0,
            parents: vec![vec![None, Some(0), Some(1)]],
        };
        assert!(p.uses_link(1, 0) && p.uses_link(0, 1) && p.uses_link(2, 1));
        assert!(!p.uses_link(0, 2));
    }
}
