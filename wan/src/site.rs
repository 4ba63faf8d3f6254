//! One site's node from start to finish (`gradwire wan node`): the synthetic
//! [`Workload`], links to every other node by the rendezvous at rank 0's address (the
//! master), the scheduler served on rank 0 (`--serve-scheduler`, master port + 1, over the
//! [`overlay`](crate::overlay) of the topology file) or reached elsewhere, N verified rounds
//! on the node loop ([`Node`]), then a final barrier (a second rendezvous at master port +
//! 2) so that no node closes its links while another still needs them.
//!
//! Every wait is bounded by `--timeout`; a node that does not come, a dead peer, a scheduler
//! that does not answer end the node with an error naming it ([`NodeError`]), a timeout's
//! error naming the configured wait that fired. With `--json`, a failed node also prints a
//! [`NodeFailure`] on stdout: the nodes its error blames and the timeout that fired, as
//! data.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use gradwire::flow::SenderConfig;
use gradwire::rate::RateMode;
use gradwire::transport::TransferConfig;
use gradwire_collective::error::CollectiveError;
use gradwire_collective::link::{Links, NetLinkConfig};
use gradwire_collective::rendezvous::{self, RendezvousConfig, RendezvousError};
use gradwire_fabric::topology::Topology;
use gradwire_netstorm::config::NetStormConfig;
use serde::{Deserialize, Serialize};

use crate::error::WanError;
use crate::node::{Node, NodeConfig};
use crate::overlay::{overlay_from_topology, SiteError};
use crate::scheduler::{self, SchedulerConfig, SchedulerReport, Strategy};
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
    /// The job id of its flows and rendezvous.
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
    /// Line rate of this node's senders, bit/s.
    pub rate_bps: u64,
    /// Their rate control.
    pub rate_mode: RateMode,
    /// Its period (the receivers' rate report interval), ns.
    pub period_ns: u64,
    /// NetStorm's options (the strategy switches awareness and auxiliary paths).
    pub netstorm: NetStormConfig,
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
    /// Links could not be set up (a node that did not come).
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
        /// What the collective layer said (it names the missing ranks).
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

/// Every ordered pair of `0..world`: the chunk channels' links.
pub fn all_pairs(world: usize) -> Vec<(usize, usize)> {
    (0..world)
        .flat_map(|a| (0..world).filter(move |&b| b != a).map(move |b| (a, b)))
        .collect()
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
    // The scheduler first: the other nodes connect to it once their links are up.
    let served = match spec.scheduler {
        SchedulerRole::Serve(addr) => Some(serve_scheduler(spec, &netstorm, addr)?),
        SchedulerRole::At(_) => None,
    };
    let links = Links::connect(
        spec.job,
        rank,
        spec.world,
        spec.ip,
        spec.master,
        &all_pairs(spec.world),
        None,
        &NetLinkConfig {
            connect_timeout: spec.timeout,
            ..NetLinkConfig::default()
        },
    )
    .map_err(|e| NodeError::Connect {
        rank,
        others: spec.world - 1,
        master: spec.master,
        error: e.to_string(),
        missing: match &e {
            CollectiveError::Rendezvous(r) => never_joined(r),
            _ => Vec::new(),
        },
    })?;
    let cfg = NodeConfig {
        rank,
        job: spec.job,
        netstorm,
        transfer: TransferConfig {
            sender: {
                let mut s = SenderConfig::with_mode(spec.rate_mode, spec.rate_bps);
                s.rate.period_ns = spec.period_ns;
                s
            },
            // A flow that makes no progress for a whole round fails it; less would fail
            // flows a congested WAN link starves for seconds (a star's incast).
            idle_timeout: spec.timeout,
            ..TransferConfig::default()
        },
        dscp: gradwire_qos::priority_dscp(0),
        round_timeout: spec.timeout,
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
    let mut node = Node::start(links, spec.scheduler.addr(), cfg).map_err(runtime(0))?;
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
    // Nobody closes its links while another node may still need them.
    let bar = barrier_addr(spec.master);
    rendezvous::exchange(
        bar,
        spec.job,
        rank,
        spec.world,
        b"done",
        &RendezvousConfig {
            timeout: spec.timeout,
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

/// The scheduler for `spec`, on `addr`, over the overlay of `spec.topology`.
fn serve_scheduler(
    spec: &NodeSpec,
    netstorm: &NetStormConfig,
    addr: SocketAddr,
) -> Result<scheduler::SchedulerHandle, NodeError> {
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
    let listener = TcpListener::bind(addr).map_err(|e| NodeError::SchedulerStart {
        rank,
        addr,
        error: format!("{e}; give a free port (--scheduler-port)"),
    })?;
    scheduler::spawn(
        listener,
        SchedulerConfig {
            world: spec.world,
            strategy: spec.strategy,
            netstorm: netstorm.clone(),
            overlay,
            // The whole model crosses every tree edge each round (aggregated on the way up,
            // the total on the way down): the volume the transfer delays are costed with.
            round_bytes: spec.workload.elems as u64 * 4,
        },
    )
    .map_err(|e| NodeError::SchedulerStart {
        rank,
        addr,
        error: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_and_the_barrier() {
        assert_eq!(all_pairs(3).len(), 6);
        assert!(all_pairs(3).iter().all(|(a, b)| a != b));
        let m: SocketAddr = "198.18.1.0:29500".parse().unwrap();
        assert_eq!(barrier_addr(m).port(), 29_502);
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
