//! The scheduler (NetStorm §VIII-B): the network collector (link reports into the overlay),
//! policy formulation (Algorithms 2 and 3, or a baseline's tree) and policy consistency
//! (§VII-A: a topology request before each PUSH; the policy is pinned per round).
//!
//! **One policy per round.** A refresh may happen while some nodes of round `r` have asked
//! and others have not. Every topology request of round `r` is answered with the policy the
//! first request of round `r` got ([`SchedulerState`], model-checked in the scheduler
//! crate), so all nodes of a round run one policy; a new version takes effect from the next
//! round that no node has started.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::consistency::SchedulerState;
use gradwire_netstorm::graph::Overlay;
use gradwire_netstorm::wire::{frame_len, Kind, Message, TopologyRequest, HEADER_LEN};

use crate::error::WanError;
use crate::plan::{formulate, Planner};
use crate::policy::parents;

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
    spawn_with_frame_timeout(listener, cfg, FRAME_TIMEOUT)
}

/// [`spawn`], with a connection dropped when a frame that has started is not complete within
/// `frame_timeout` (default [`FRAME_TIMEOUT`]; tests shorten it).
pub fn spawn_with_frame_timeout(
    listener: TcpListener,
    cfg: SchedulerConfig,
    frame_timeout: Duration,
) -> Result<SchedulerHandle, WanError> {
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let mut planner = Planner::default();
    let overlay = cfg.overlay.clone();
    if overlay.num_nodes() != cfg.world {
        return Err(WanError::Config(format!(
            "the overlay has {} sites for a {}-node job",
            overlay.num_nodes(),
            cfg.world
        )));
    }
    let first = formulate(
        cfg.strategy,
        &overlay,
        &mut planner,
        &cfg.netstorm,
        cfg.round_bytes,
    )?;
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
        .spawn(move || serve(listener, shared, flag, frame_timeout))?;
    Ok(SchedulerHandle {
        addr,
        state,
        stop,
        thread: Some(thread),
    })
}

/// Most node connections served at once, per node of the job (a node keeps one; a few more
/// cover reconnections); further connections are closed at once.
pub const CONNECTIONS_PER_NODE: usize = 4;

fn serve(
    listener: TcpListener,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    frame_timeout: Duration,
) -> Result<SchedulerReport, WanError> {
    let cap = {
        let st = state
            .lock()
            .map_err(|_| WanError::Internal("scheduler state poisoned".into()))?;
        CONNECTIONS_PER_NODE * st.cfg.world.max(1)
    };
    let mut conns: Vec<std::thread::JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        // Finished connections leave the list: it holds the live ones only.
        conns.retain(|c| !c.is_finished());
        match listener.accept() {
            Ok((s, peer)) if conns.len() >= cap => {
                log::warn!(
                    "scheduler: refused a connection from {peer}: {cap} node connections are \
                     open already"
                );
                drop(s);
            }
            Ok((s, _)) => {
                let state = Arc::clone(&state);
                let stop = Arc::clone(&stop);
                match std::thread::Builder::new()
                    .name("netstorm-node-conn".into())
                    .spawn(move || connection(s, &state, &stop, frame_timeout))
                {
                    Ok(c) => conns.push(c),
                    // Out of threads for now: this connection is closed, the next is tried.
                    Err(e) => log::warn!("scheduler: could not serve a connection: {e}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            // E.g. out of file descriptors: keep serving the connections there are, and try
            // again shortly.
            Err(e) => {
                log::warn!("scheduler: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
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

/// Fill `buf` by `deadline` (`frame_timeout` after the frame's first byte), looking at `stop`
/// every [`IDLE_POLL`].
fn read_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    frame_timeout: Duration,
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
                "a frame not complete within {frame_timeout:?} ({got} of {len} bytes)"
            ))
        },
    )
}

/// Write `m` within `frame_timeout` in all, looking at `stop` every [`IDLE_POLL`]: a node
/// that does not read its answers cannot hold a connection thread, nor [`SchedulerHandle::stop`].
fn write_by(
    s: &mut TcpStream,
    m: &Message,
    frame_timeout: Duration,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let bytes = m.to_vec().map_err(ended)?;
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
/// within `frame_timeout` ([`FRAME_TIMEOUT`]), looking at `stop` meanwhile. A frame is never read in part and
/// then abandoned, which would leave the stream in the middle of a frame; only the kinds a
/// node sends are read past their header (the others would be up to a megabyte).
fn next_frame(
    s: &mut TcpStream,
    stop: &AtomicBool,
    frame_timeout: Duration,
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
    let deadline = deadline_in(frame_timeout);
    let mut buf = vec![0u8; HEADER_LEN];
    read_by(s, &mut buf, deadline, frame_timeout, stop)?;
    let (kind, total) = frame_len(&buf).map_err(ended)?;
    if !matches!(kind, Kind::LinkReport | Kind::TopologyRequest) {
        return Err(ended(format!(
            "a {kind:?} frame, which only the scheduler sends"
        )));
    }
    buf.resize(total, 0);
    read_by(s, &mut buf[HEADER_LEN..], deadline, frame_timeout, stop)?;
    Message::parse(&buf).map(Some).map_err(ended)
}

/// One node's connection: answer its requests, collect its reports, until it closes. The
/// connection speaks for the node named by its first message and for no other: a message
/// for another node (a report of a link into another node, another node's request) drops
/// it, so one connection cannot steer the policy for the whole job.
fn connection(mut s: TcpStream, state: &Mutex<State>, stop: &AtomicBool, frame_timeout: Duration) {
    if s.set_nonblocking(false).is_err() {
        return;
    }
    let _ = s.set_nodelay(true);
    let mut node: Option<u16> = None;
    while !stop.load(Ordering::Acquire) {
        let msg = match next_frame(&mut s, stop, frame_timeout) {
            Ok(Some(m)) => m,
            Ok(None) => continue,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    log::warn!("scheduler: dropped a connection that sent an invalid frame: {e}");
                }
                return;
            }
        };
        let claims = match &msg {
            // A node measures the links into itself.
            Message::LinkReport(r) => r.to,
            Message::TopologyRequest(r) => r.node,
            // Only the scheduler sends these: `next_frame` refused them at their header.
            Message::PolicyUpdate(_) | Message::PolicyConfirm(_) | Message::Chunk(_) => return,
        };
        match node {
            Some(n) if n != claims => {
                log::warn!("scheduler: dropped node {n}'s connection: it spoke for node {claims}");
                return;
            }
            _ => node = Some(claims),
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
                    log::warn!("scheduler: node {}: {e}", req.node);
                    return;
                }
            },
            Message::PolicyUpdate(_) | Message::PolicyConfirm(_) | Message::Chunk(_) => return,
        };
        drop(st);
        if let Some(m) = reply {
            if let Err(e) = write_by(&mut s, &m, frame_timeout, stop) {
                log::warn!("scheduler: dropped node {claims}'s connection: {e}");
                return;
            }
        }
    }
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
