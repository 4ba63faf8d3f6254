//! One site's node from start to finish (`gradwire wan node`): the synthetic
//! [`Workload`], its message-layer endpoint, whose address every other node learns by the
//! rendezvous at rank 0's address (the master), the scheduler served on rank 0
//! (`--serve-scheduler`, master port + 1, over the [`overlay`](crate::overlay) of the
//! topology file; its port bound before the rendezvous, served after it with every node's
//! published address, from which alone a connection may speak for that node) or reached
//! elsewhere, N verified rounds
//! on the node loop ([`Node`]), then a final barrier (a second rendezvous at master port +
//! 2) so that no node closes its endpoint while another still needs it.
//!
//! Every wait is bounded by `--timeout`; a node that does not come, a dead peer, a scheduler
//! that does not answer end the node with an error naming it ([`NodeError`]), a timeout's
//! error naming the configured wait that fired. With `--json`, a failed node also prints a
//! [`NodeFailure`] on stdout: the nodes its error blames and the timeout that fired, as
//! data.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use gradwire_fabric::topology::Topology;
use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
use gradwire_netstorm::config::NetStormConfig;
use gradwire_proto::auth::{JobKey, MemberEntry, MEMBER_ENTRY_LEN};
use gradwire_proto::rate::RateMode;
use gradwire_rendezvous::{self as rendezvous, RendezvousConfig, RendezvousError};
use serde::{Deserialize, Serialize};

use crate::error::WanError;
use crate::node::{Node, NodeConfig};
use crate::overlay::{overlay_from_topology, SiteError};
use crate::scheduler::{self, SchedulerConfig, SchedulerReport, Strategy};
use crate::seal::ControlAuth;
use crate::workload::{check_round, Workload, WrongElement};

/// The rendezvous port at rank 0 when nothing else is said; the scheduler listens on the
/// next port and the final barrier on the one after.
pub const DEFAULT_MASTER_PORT: u16 = 29_500;
/// What a node prints on stderr per round after `node R`; the experiment counts them.
pub const ROUND_MARK: &str = ": round ";

/// Where a node finds the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerRole {
    /// This node (rank 0) runs it, listening on this address.
    Serve(SocketAddr),
    /// It runs at this address.
    At(SocketAddr),
}

impl SchedulerRole {
    /// The address nodes connect to.
    pub fn addr(self) -> SocketAddr {
        match self {
            SchedulerRole::Serve(a) | SchedulerRole::At(a) => a,
        }
    }
}

/// What one node runs.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// This node (site).
    pub rank: usize,
    /// Nodes.
    pub world: usize,
    /// The job id of its endpoint and rendezvous.
    pub job: u32,
    /// This node's address.
    pub ip: IpAddr,
    /// Rank 0's rendezvous address.
    pub master: SocketAddr,
    /// The scheduler.
    pub scheduler: SchedulerRole,
    /// The strategy (the scheduler's; the node takes its options from it).
    pub strategy: Strategy,
    /// The topology the scheduler's overlay comes from (needed to serve the scheduler).
    pub topology: Option<PathBuf>,
    /// The synthetic model.
    pub workload: Workload,
    /// Most rounds.
    pub iterations: u32,
    /// Stop after the round in which this much time has passed since the first (all nodes
    /// stop after the same round).
    pub duration: Option<Duration>,
    /// Longest wait for the set-up, each round and the final barrier.
    pub timeout: Duration,
    /// Line rate of this node's senders, bit/s, as the experiment budgets its frames. Not
    /// applied since the chunks moved onto the message layer: the layer has no pacer, its
    /// congestion window sets the rate (issue #23 follow-up).
    pub rate_bps: u64,
    /// The flow transport's rate control; not applied on the message layer (see `rate_bps`).
    pub rate_mode: RateMode,
    /// The flow transport's rate report period, ns; not applied on the message layer.
    pub period_ns: u64,
    /// NetStorm's options (the strategy switches awareness and auxiliary paths).
    pub netstorm: NetStormConfig,
    /// The job key of an authenticated job (from its secret): every chunk datagram sealed
    /// with its pair of nodes' key, every scheduler connection authenticated
    /// ([`crate::seal`]; the scheduler is then node 0's). `None`: a plain job.
    pub auth: Option<Arc<JobKey>>,
}

/// What `gradwire wan node --json` prints.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeOutput {
    /// This node.
    pub rank: usize,
    /// Nodes.
    pub world: usize,
    /// The strategy.
    pub strategy: String,
    /// The model.
    pub model: String,
    /// Its scale.
    pub scale: f64,
    /// Elements synchronized per round (the model's and the control element).
    pub elements: usize,
    /// Rounds run.
    pub rounds: u32,
    /// Per round: milliseconds from the PUSH to the last result chunk (the runtime's).
    pub sync_ms: Vec<f64>,
    /// Per round: when it started (before the topology request), ms since the Unix epoch.
    pub round_start_unix_ms: Vec<f64>,
    /// Per round: the policy version.
    pub versions: Vec<u32>,
    /// Chunks relayed on auxiliary paths.
    pub relayed: usize,
    /// Chunks sent on auxiliary paths.
    pub sent_aux: usize,
    /// Link reports sent.
    pub link_reports: usize,
    /// Every element of every round was the exact average.
    pub verified: bool,
    /// The scheduler's report, on the node that served it.
    pub scheduler: Option<SchedulerReport>,
}

/// Why a node failed; every message names the node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Bad arguments.
    #[error("node {rank}: {what}")]
    Invalid {
        /// The node.
        rank: usize,
        /// What is wrong and what to do.
        what: String,
    },
    /// The topology file.
    #[error("node {rank}: {error}")]
    Topology {
        /// The node.
        rank: usize,
        /// What the topology reader said.
        error: String,
    },
    /// The scheduler could not start.
    #[error("node {rank}: cannot serve the scheduler on {addr}: {error}")]
    SchedulerStart {
        /// The node.
        rank: usize,
        /// The address.
        addr: SocketAddr,
        /// Why.
        error: String,
    },
    /// The nodes could not find each other (a node that did not come, a bad address
    /// table) or this node's socket could not be bound.
    #[error(
        "node {rank}: connecting to the other {others} nodes through the rendezvous at \
         {master}: {error}"
    )]
    Connect {
        /// The node.
        rank: usize,
        /// Other nodes.
        others: usize,
        /// Rank 0's address.
        master: SocketAddr,
        /// What went wrong (the rendezvous names the missing ranks).
        error: String,
        /// The ranks that never joined, when the rendezvous timed out.
        missing: Vec<usize>,
    },
    /// The runtime failed (a dead peer, a round that did not finish, the scheduler).
    #[error("node {rank}, round {round}: {}", unprefixed(*rank, error))]
    Runtime {
        /// The node.
        rank: usize,
        /// The round.
        round: u32,
        /// What the runtime said.
        error: WanError,
    },
    /// The scheduler, served by another node, stopped answering: that node failed.
    #[error(
        "node {rank}, round {round}: the scheduler, served by node {host}, stopped answering \
         (node {host} failed or stopped): {error}"
    )]
    SchedulerLost {
        /// The node.
        rank: usize,
        /// The round.
        round: u32,
        /// The node serving the scheduler.
        host: usize,
        /// What the runtime said.
        error: WanError,
    },
    /// A wrong result.
    #[error(transparent)]
    Wrong(#[from] WrongElement),
    /// The final barrier failed (a node that stopped after the last round).
    #[error(
        "node {rank}: after the last round, waiting for every node to finish (barrier at \
         {addr}): {error}"
    )]
    Barrier {
        /// The node.
        rank: usize,
        /// Its address.
        addr: SocketAddr,
        /// What the rendezvous said (it names the missing ranks).
        error: String,
        /// The ranks that never joined, when it timed out.
        missing: Vec<usize>,
    },
}

impl NodeError {
    /// The nodes this error names as a possible cause, ascending: the runtime's
    /// ([`WanError::blamed`]), the node serving a lost scheduler, the ranks that never joined
    /// a rendezvous. What `gradwire wan node --json` reports as data on failure.
    pub fn blamed(&self) -> Vec<usize> {
        let mut out = match self {
            NodeError::Runtime { error, .. } => error.blamed(),
            NodeError::SchedulerLost { host, error, .. } => {
                let mut v = error.blamed();
                v.push(*host);
                v
            }
            NodeError::Connect { missing, .. } | NodeError::Barrier { missing, .. } => {
                missing.clone()
            }
            _ => Vec::new(),
        };
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The failure as `gradwire wan node --json` prints it on stdout.
    pub fn failure(&self, rank: usize) -> NodeFailure {
        let timed_out = match self {
            NodeError::Runtime { error, .. } | NodeError::SchedulerLost { error, .. } => {
                error.timed_out()
            }
            _ => None,
        };
        NodeFailure {
            rank,
            error: self.to_string(),
            blamed: self.blamed(),
            timeout_s: timed_out.map(|t| t.timeout.as_secs_f64()),
            waited_s: timed_out.map(|t| t.waited.as_secs_f64()),
        }
    }
}

/// What `gradwire wan node --json` prints on stdout when it fails (the error goes to stderr
/// too): the error with its causes as data, so that nobody parses the message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeFailure {
    /// This node.
    pub rank: usize,
    /// The error's message.
    pub error: String,
    /// The nodes it names as a possible cause ([`NodeError::blamed`]), ascending.
    pub blamed: Vec<usize>,
    /// The configured timeout that fired (a round's, or the scheduler's answer), seconds.
    pub timeout_s: Option<f64>,
    /// How long the node waited before it gave up, by its own clock, seconds.
    pub waited_s: Option<f64>,
}

/// The ranks a rendezvous reports as never joined (empty for any other failure).
fn never_joined(e: &RendezvousError) -> Vec<usize> {
    match e {
        RendezvousError::Timeout { missing, .. } => missing.clone(),
        _ => Vec::new(),
    }
}

/// `error`'s message without a leading `node {rank}: ` (the runtime's errors name the node;
/// ours already did).
fn unprefixed(rank: usize, error: &WanError) -> String {
    let m = error.to_string();
    m.strip_prefix(&format!("node {rank}: "))
        .map_or_else(|| m.clone(), str::to_owned)
}

/// Ceiling of the message layer's retransmission timeout on a WAN. The layer's default
/// (200 ms) is set for a data centre; WAN round trips are 60-180 ms on wan9 and more behind
/// full router buffers, and a sender whose RTO fires before an answer can come counts its
/// window lost and halves it, every RTO, down to the floor (measured: fapt's rounds went
/// from 5.9 s to 88 s). The RTO still follows SRTT + 4 RTTVAR below this.
pub const WAN_RTO_MAX: Duration = Duration::from_secs(3);
/// The RTO before the first round-trip sample: RFC 6298's 1 s, above any WAN round trip, for
/// the same reason.
pub const WAN_RTO_INITIAL: Duration = Duration::from_secs(1);

/// A receiver acknowledges progress every this many segments on a WAN (the layer's default:
/// 32). A sender whose window is below the ACK interval hears nothing until its RTO, counts
/// the window lost and halves it again: harmless at data-centre RTOs of a millisecond, a
/// spiral at WAN RTOs (measured on wan9: a star root took in 0.6 Mbit/s). Every second
/// segment, as TCP's delayed ACK, keeps the sender's window clocked down to its floor of 2.
pub const WAN_ACK_EVERY: u32 = 2;

/// Largest rendezvous payload: one endpoint address as text (`[v6]:port` fits), and in an
/// authenticated job a newline and the node's member entry in hex.
const MAX_ADDR_PAYLOAD: usize = 64 + 1 + 2 * MEMBER_ENTRY_LEN;

/// A node's rendezvous payload: its address, and its member entry in hex when it has one.
fn payload(addr: SocketAddr, member: Option<MemberEntry>) -> String {
    let mut p = addr.to_string();
    if let Some(m) = member {
        p.push('\n');
        for b in m.to_bytes() {
            p.push_str(&format!("{b:02x}"));
        }
    }
    p
}

/// A member entry from its hex text.
fn member_from_hex(hex: &str) -> Option<MemberEntry> {
    if hex.len() != 2 * MEMBER_ENTRY_LEN {
        return None;
    }
    let mut bytes = [0u8; MEMBER_ENTRY_LEN];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    MemberEntry::from_bytes(&bytes)
}

/// Every node's endpoint address from the rendezvous table (one `ip:port` in text per node,
/// in rank order); an entry that is not an address, is unspecified or repeats another's is
/// refused naming its node.
pub fn endpoint_table(table: &[Vec<u8>]) -> Result<Vec<SocketAddr>, String> {
    Ok(node_table(table)?.into_iter().map(|(a, _)| a).collect())
}

/// [`endpoint_table`] with each node's member entry (authenticated jobs; `None` where a
/// node published none).
pub fn node_table(table: &[Vec<u8>]) -> Result<Vec<(SocketAddr, Option<MemberEntry>)>, String> {
    let mut out: Vec<(SocketAddr, Option<MemberEntry>)> = Vec::with_capacity(table.len());
    for (rank, entry) in table.iter().enumerate() {
        let text = std::str::from_utf8(entry).unwrap_or("");
        let (addr, member) = match text.split_once('\n') {
            Some((a, m)) => (
                a,
                Some(member_from_hex(m).ok_or_else(|| {
                    format!("node {rank}'s rendezvous entry has a malformed member key")
                })?),
            ),
            None => (text, None),
        };
        let a: SocketAddr = addr.parse().map_err(|_| {
            format!(
                "node {rank}'s rendezvous entry is not an ip:port address ({} bytes): is \
                 it a gradwire wan node of the same version?",
                entry.len()
            )
        })?;
        if a.ip().is_unspecified() || a.port() == 0 {
            return Err(format!(
                "node {rank} published {a}, which no peer can send to: give it a concrete \
                 address (--ip)"
            ));
        }
        if let Some(other) = out.iter().position(|(b, _)| *b == a) {
            return Err(format!(
                "nodes {other} and {rank} both published {a}: every node needs its own address"
            ));
        }
        out.push((a, member));
    }
    Ok(out)
}

/// This node's endpoint, started with every node's address (returned too, by node id):
/// bound at `spec.ip`, its address published through the rendezvous at `spec.master`. A
/// peer silent for `spec.timeout` fails the links with it. In an authenticated job the
/// endpoint is sealed, and the scheduler connections' keys come back too.
fn connect(spec: &NodeSpec) -> Result<(Endpoint, Vec<SocketAddr>, Option<ControlAuth>), NodeError> {
    let rank = spec.rank;
    let failed = |error: String, missing: Vec<usize>| NodeError::Connect {
        rank,
        others: spec.world - 1,
        master: spec.master,
        error,
        missing,
    };
    let (r, w) = match (u16::try_from(rank), u16::try_from(spec.world)) {
        (Ok(r), Ok(w)) => (r, w),
        _ => {
            return Err(failed(
                format!("a world of {} is beyond 16-bit ranks", spec.world),
                vec![],
            ))
        }
    };
    let mut cfg = EndpointConfig::new(spec.job, r, w, SocketAddr::new(spec.ip, 0));
    cfg.core.peer_timeout = spec.timeout;
    cfg.core.rto_max = WAN_RTO_MAX;
    cfg.core.rto_initial = WAN_RTO_INITIAL;
    cfg.core.ack_every = WAN_ACK_EVERY;
    cfg.auth.clone_from(&spec.auth);
    let bound = Endpoint::bind(cfg).map_err(|e| failed(e.to_string(), vec![]))?;
    let me = payload(bound.local_addr(), bound.member());
    let table = rendezvous::exchange(
        spec.master,
        spec.job,
        rank,
        spec.world,
        me.as_bytes(),
        &RendezvousConfig {
            timeout: spec.timeout,
            max_payload: MAX_ADDR_PAYLOAD,
            key: spec.auth.clone(),
        },
    )
    .map_err(|e| failed(e.to_string(), never_joined(&e)))?;
    let nodes = node_table(&table).map_err(|e| failed(e, vec![]))?;
    let addrs: Vec<SocketAddr> = nodes.iter().map(|(a, _)| *a).collect();
    let members: Vec<Option<MemberEntry>> = nodes.iter().map(|(_, m)| *m).collect();
    if let Some(n) = members
        .iter()
        .position(|m| m.is_some() != spec.auth.is_some())
    {
        return Err(failed(
            format!(
                "node {n} is {} and this node is {}: give every node the same job secret",
                if members[n].is_some() {
                    "authenticated"
                } else {
                    "not authenticated"
                },
                if spec.auth.is_some() {
                    "authenticated"
                } else {
                    "not"
                }
            ),
            vec![],
        ));
    }
    let control = match (&spec.auth, bound.member_key()) {
        (Some(key), Some(me)) => Some(ControlAuth::new(
            key.clone(),
            spec.job,
            me,
            members.iter().copied().flatten().collect(),
        )),
        _ => None,
    };
    let started = match control {
        None => bound.start(addrs.clone()),
        Some(_) => bound.start_sealed(addrs.clone(), &members),
    };
    let endpoint = started.map_err(|e| failed(e.to_string(), vec![]))?;
    Ok((endpoint, addrs, control))
}

/// The final barrier's address: master port + 2.
pub fn barrier_addr(master: SocketAddr) -> SocketAddr {
    SocketAddr::new(master.ip(), master.port().wrapping_add(2))
}

/// Run one node; `progress(round, sync_ms)` after each verified round.
pub fn run_node(
    spec: &NodeSpec,
    mut progress: impl FnMut(u32, f64),
) -> Result<NodeOutput, NodeError> {
    let rank = spec.rank;
    let invalid = |what: String| NodeError::Invalid { rank, what };
    if spec.world == 0 || rank >= spec.world {
        return Err(invalid(format!(
            "rank {rank} is not below the world size {}: ranks are 0..world",
            spec.world
        )));
    }
    if spec.iterations == 0 {
        return Err(invalid("--iterations 0: run at least one round".into()));
    }
    let netstorm = spec.strategy.netstorm(&spec.netstorm);
    netstorm.validate().map_err(|e| invalid(format!("{e}")))?;
    if spec.auth.is_some() && rank != 0 && matches!(spec.scheduler, SchedulerRole::Serve(_)) {
        return Err(invalid(
            "in an authenticated job node 0 serves the scheduler (its member key is the \
             scheduler's): serve it from rank 0"
                .into(),
        ));
    }
    // The scheduler's port first: the other nodes connect to it once their links are up.
    let prepared = match spec.scheduler {
        SchedulerRole::Serve(addr) => Some((addr, prepare_scheduler(spec, &netstorm, addr)?)),
        SchedulerRole::At(_) => None,
    };
    let (endpoint, addrs, control) = connect(spec)?;
    // Served once every node's address is known: a connection speaks for a node only from
    // that node's address. Nodes that connect meanwhile wait in the listen backlog.
    let served = match prepared {
        Some((addr, (listener, mut cfg))) => {
            cfg.node_ips = Some(addrs.iter().map(SocketAddr::ip).collect());
            cfg.auth.clone_from(&control);
            Some(
                scheduler::spawn(listener, cfg).map_err(|e| NodeError::SchedulerStart {
                    rank,
                    addr,
                    error: e.to_string(),
                })?,
            )
        }
        None => None,
    };
    let cfg = NodeConfig {
        rank,
        netstorm,
        dscp: gradwire_qos::priority_dscp(0),
        round_timeout: spec.timeout,
        // The model's values and the control element, f32.
        peer_budget: crate::channel::budget_for_model((spec.workload.elems + 1).saturating_mul(4)),
        control_auth: control,
    };
    // The node that serves the scheduler, when it is the master's host (rank 0): a lost
    // scheduler connection then means that node failed, and the error says so.
    let scheduler_node = match spec.scheduler {
        SchedulerRole::At(a) if a.ip() == spec.master.ip() => Some(0),
        _ => None,
    };
    let runtime = |round: u32| {
        move |error: WanError| match (error, scheduler_node) {
            (error @ WanError::Scheduler { .. }, Some(host)) if rank != host => {
                NodeError::SchedulerLost {
                    rank,
                    round,
                    host,
                    error,
                }
            }
            (error, _) => NodeError::Runtime { rank, round, error },
        }
    };
    let mut node = Node::start(endpoint, spec.scheduler.addr(), cfg).map_err(runtime(0))?;
    let w = &spec.workload;
    let mut starts = Vec::new();
    let mut rounds = 0u32;
    let first = Instant::now();
    let result = (|| -> Result<(), NodeError> {
        for round in 0..spec.iterations {
            let go_on =
                round + 1 < spec.iterations && spec.duration.is_none_or(|d| first.elapsed() < d);
            let t = w.tensor(rank, round, go_on);
            starts.push(unix_ms(SystemTime::now()));
            let got = node.synchronize(&t).map_err(runtime(round))?;
            let all_go_on = check_round(w, spec.world, rank, round, go_on, &got)?;
            rounds = round + 1;
            progress(
                round,
                node.report().sync_ms.last().copied().unwrap_or(f64::NAN),
            );
            if !all_go_on {
                break;
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        drop(node);
        return Err(e);
    }
    // This node's last results reach its peers before it waits for them (its queued chunks
    // go out only while it handles its channels' events); whatever did not is the peers'
    // round timeout to report. Nobody closes its endpoint while another node may still
    // need it.
    node.flush();
    let bar = barrier_addr(spec.master);
    rendezvous::exchange(
        bar,
        spec.job,
        rank,
        spec.world,
        b"done",
        &RendezvousConfig {
            timeout: spec.timeout,
            key: spec.auth.clone(),
            ..RendezvousConfig::default()
        },
    )
    .map_err(|e| NodeError::Barrier {
        rank,
        addr: bar,
        error: e.to_string(),
        missing: never_joined(&e),
    })?;
    let report = node.shutdown();
    let scheduler = match served {
        Some(h) => Some(h.stop().map_err(runtime(rounds))?),
        None => None,
    };
    Ok(NodeOutput {
        rank,
        world: spec.world,
        strategy: spec.strategy.name().to_owned(),
        model: w.model.clone(),
        scale: w.scale,
        elements: w.elems + 1,
        rounds,
        sync_ms: report.sync_ms,
        round_start_unix_ms: starts,
        versions: report.versions,
        relayed: report.relayed,
        sent_aux: report.sent_aux,
        link_reports: report.link_reports,
        verified: true,
        scheduler,
    })
}

/// `t` in milliseconds since the Unix epoch: the clock of [`NodeOutput::round_start_unix_ms`].
pub fn unix_ms(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// The scheduler for `spec`, on `addr`, over the overlay of `spec.topology`: its listener,
/// bound now (a busy port fails the node before the rendezvous), and its configuration,
/// checked now; it is spawned once the rendezvous has given every node's address
/// ([`SchedulerConfig::node_ips`]).
fn prepare_scheduler(
    spec: &NodeSpec,
    netstorm: &NetStormConfig,
    addr: SocketAddr,
) -> Result<(TcpListener, SchedulerConfig), NodeError> {
    let rank = spec.rank;
    let path = spec.topology.as_ref().ok_or_else(|| NodeError::Invalid {
        rank,
        what: "serving the scheduler needs --topology (its overlay comes from the topology's \
               inter-site links)"
            .into(),
    })?;
    let topo = Topology::load(path).map_err(|e| NodeError::Topology {
        rank,
        error: e.to_string(),
    })?;
    let site = |e: SiteError| NodeError::Topology {
        rank,
        error: e.to_string(),
    };
    if topo.hosts.len() != spec.world {
        return Err(site(SiteError::World {
            topology: topo.name.clone(),
            hosts: topo.hosts.len(),
            world: spec.world,
        }));
    }
    let overlay = overlay_from_topology(&topo).map_err(site)?;
    let cfg = SchedulerConfig {
        world: spec.world,
        strategy: spec.strategy,
        netstorm: netstorm.clone(),
        overlay,
        // The whole model crosses every tree edge each round (aggregated on the way up,
        // the total on the way down): the volume the transfer delays are costed with.
        round_bytes: spec.workload.elems as u64 * 4,
        // Known after the rendezvous.
        node_ips: None,
        auth: None,
    };
    cfg.validate().map_err(|e| NodeError::SchedulerStart {
        rank,
        addr,
        error: e.to_string(),
    })?;
    let listener = TcpListener::bind(addr).map_err(|e| NodeError::SchedulerStart {
        rank,
        addr,
        error: format!("{e}; give a free port (--scheduler-port)"),
    })?;
    Ok((listener, cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_barrier_and_the_endpoint_table() {
        let m: SocketAddr = "198.18.1.0:29500".parse().unwrap();
        assert_eq!(barrier_addr(m).port(), 29_502);
        let t = |v: &[&[u8]]| endpoint_table(&v.iter().map(|e| e.to_vec()).collect::<Vec<_>>());
        assert_eq!(
            t(&[b"10.0.0.1:5000", b"[fd00::2]:5001"]).unwrap(),
            vec![
                "10.0.0.1:5000".parse::<SocketAddr>().unwrap(),
                "[fd00::2]:5001".parse().unwrap()
            ]
        );
        // Not an address, not UTF-8, unspecified, port 0, the same address twice: refused
        // naming the node.
        for (bad, node) in [
            (t(&[b"10.0.0.1:5000", b"hello"]), "node 1"),
            (t(&[&[0xff, 0xfe]]), "node 0"),
            (t(&[b"0.0.0.0:5000"]), "node 0"),
            (t(&[b"10.0.0.1:0"]), "node 0"),
            (t(&[b"10.0.0.1:5000", b"10.0.0.1:5000"]), "nodes 0 and 1"),
        ] {
            let e = bad.unwrap_err();
            assert!(e.contains(node), "{e}");
        }
    }

    #[test]
    fn a_failure_report_carries_the_blamed_nodes_and_the_timeout_as_data() {
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let lost = NodeError::SchedulerLost {
            rank: 2,
            round: 4,
            host: 0,
            error: WanError::Scheduler {
                addr,
                error: "waiting for round 4's policy: no answer within 8s".into(),
                timed_out: Some(crate::error::TimedOut {
                    timeout: Duration::from_secs(8),
                    waited: Duration::from_millis(8_100),
                }),
            },
        };
        let f = lost.failure(2);
        assert_eq!(f.blamed, vec![0]);
        assert_eq!((f.timeout_s, f.waited_s), (Some(8.0), Some(8.1)));
        assert_eq!(f.error, lost.to_string());
        let peer = NodeError::Runtime {
            rank: 1,
            round: 2,
            error: WanError::Peer {
                rank: 1,
                peer: 3,
                error: "closed".into(),
                closed: vec![2],
                culprit: None,
            },
        };
        assert_eq!(peer.failure(1).blamed, vec![2, 3]);
        assert_eq!(peer.failure(1).timeout_s, None);
        let connect = NodeError::Connect {
            rank: 0,
            others: 2,
            master: addr,
            error: "rank(s) [1, 2] never joined".into(),
            missing: vec![1, 2],
        };
        assert_eq!(connect.failure(0).blamed, vec![1, 2]);
        let back: NodeFailure =
            serde_json::from_str(&serde_json::to_string(&connect.failure(0)).unwrap()).unwrap();
        assert_eq!(back, connect.failure(0));
    }
}
