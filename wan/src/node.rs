//! A general node (NetStorm §VIII-A): it trains (the caller's input), asks the scheduler for
//! the round's policy before each PUSH, pushes, aggregates, forwards and pulls chunks over
//! its chunk channels, relays auxiliary chunks, and reports the links it measured.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use gradwire::tensor::Tensor;
use gradwire::transport::TransferConfig;
use gradwire_collective::link::Links;
use gradwire_netstorm::awareness::{Estimator, LinkMonitor};
use gradwire_netstorm::config::NetStormConfig;

use crate::channel::{self, ChannelConfig, ChunkTx, Event, Outgoing};
use crate::control::{Answer, SchedulerClient};
use crate::error::WanError;
use crate::meta;
use crate::sync::{Action, ChunkMeta, RoundState};

/// How a node runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node.
    pub rank: usize,
    /// The job id of its flows.
    pub job: u32,
    /// NetStorm's options (chunk size, auxiliary paths, awareness).
    pub netstorm: NetStormConfig,
    /// The transport.
    pub transfer: TransferConfig,
    /// DSCP of the chunks.
    pub dscp: u8,
    /// Longest wait for a round (for the scheduler's answer or a peer's chunk).
    pub round_timeout: Duration,
}

/// What a node measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeReport {
    /// This node.
    pub rank: usize,
    /// Per round: milliseconds from the PUSH (after the scheduler's answer) to the last
    /// result chunk.
    pub sync_ms: Vec<f64>,
    /// Per round: the policy version it ran under.
    pub versions: Vec<u32>,
    /// Chunks this node relayed on auxiliary paths.
    pub relayed: usize,
    /// Chunks this node sent on auxiliary paths.
    pub sent_aux: usize,
    /// Link reports sent to the scheduler.
    pub link_reports: usize,
}

/// A running node: its channels and its scheduler connection.
#[derive(Debug)]
pub struct Node {
    cfg: NodeConfig,
    txs: Vec<Option<ChunkTx>>,
    events: crossbeam_channel::Receiver<Event>,
    stop: Arc<AtomicBool>,
    rx_threads: Vec<std::thread::JoinHandle<()>>,
    scheduler: SchedulerClient,
    version: u32,
    round: u32,
    /// Chunks that came before this node knew their round's policy (§VII-A, Case 2).
    early: Vec<(usize, ChunkMeta, Vec<f32>)>,
    /// Peers whose links to this node have closed.
    closed: Vec<usize>,
    monitor: LinkMonitor,
    report: NodeReport,
}

impl Node {
    /// A node over `links` (to every other node), talking to the scheduler at `scheduler`.
    pub fn start(links: Links, scheduler: SocketAddr, cfg: NodeConfig) -> Result<Node, WanError> {
        let epoch = Instant::now();
        let (tx_events, events) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let ccfg = ChannelConfig {
            job: cfg.job,
            transfer: cfg.transfer.clone(),
            dscp: cfg.dscp,
        };
        // Receivers look at `stop` between chunks every second.
        let mut rx_cfg = ccfg.clone();
        rx_cfg.transfer.connect_timeout = Duration::from_secs(1);
        let (outs, ins) = links.split();
        let mut txs = Vec::with_capacity(outs.len());
        for l in outs {
            txs.push(match l {
                Some(l) => Some(channel::spawn_tx(
                    l,
                    ccfg.clone(),
                    epoch,
                    tx_events.clone(),
                )?),
                None => None,
            });
        }
        let mut rx_threads = Vec::new();
        for l in ins.into_iter().flatten() {
            rx_threads.push(channel::spawn_rx(
                l,
                rx_cfg.clone(),
                epoch,
                tx_events.clone(),
                Arc::clone(&stop),
            )?);
        }
        let scheduler = SchedulerClient::connect(scheduler, cfg.rank, cfg.round_timeout)?;
        let ns = &cfg.netstorm;
        let monitor = LinkMonitor::new(
            ns.probe_chunk_size,
            ns.probe_chunk_num,
            Estimator::Dispersion,
        );
        Ok(Node {
            report: NodeReport {
                rank: cfg.rank,
                sync_ms: Vec::new(),
                versions: Vec::new(),
                relayed: 0,
                sent_aux: 0,
                link_reports: 0,
            },
            cfg,
            txs,
            events,
            stop,
            rx_threads,
            scheduler,
            version: 0,
            round: 0,
            early: Vec::new(),
            closed: Vec::new(),
            monitor,
        })
    }

    /// One synchronization round: returns the average of every node's `input`.
    pub fn synchronize(&mut self, input: &[f32]) -> Result<Vec<f32>, WanError> {
        let round = self.round;
        // Topology request before the PUSH (§VII-A): block for the round's policy.
        let (version, policy) = match self.scheduler.request(self.version, round)? {
            Answer::Update(p) => (p.version, p),
            Answer::Confirm(v) => (v, self.scheduler.current(v)?),
        };
        self.version = version;
        let started = Instant::now();
        let aux = policy.aux_map();
        let chunk_elems = self.cfg.netstorm.chunk_size;
        let (mut state, first) = {
            let routes = self.router(&aux);
            RoundState::start(self.cfg.rank, round, policy, input, chunk_elems, &routes)?
        };
        self.perform(first)?;
        for &peer in &self.closed {
            if state.waits_on(peer) {
                return Err(WanError::Peer {
                    rank: self.cfg.rank,
                    peer,
                    error: "it closed its link before this round (it stopped or died)".into(),
                });
            }
        }
        // Chunks that arrived early for this round.
        let early = std::mem::take(&mut self.early);
        for (from, m, values) in early {
            if m.round == round {
                let acts = {
                    let routes = self.router(&aux);
                    state.on_chunk(from, m, values, &routes)?
                };
                self.perform(acts)?;
            } else {
                self.early.push((from, m, values));
            }
        }
        let deadline = started + self.cfg.round_timeout;
        while !state.finished() {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = match self.events.recv_timeout(left) {
                Ok(ev) => ev,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(WanError::RoundTimeout {
                        rank: self.cfg.rank,
                        round,
                        pending: state.pending(),
                        timeout: self.cfg.round_timeout,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(WanError::Internal("the chunk channels are gone".into()))
                }
            };
            match ev {
                Event::Sent { .. } => {}
                Event::Closed { peer } => {
                    // A peer that finished may leave; one this round still waits for has
                    // died.
                    self.closed.push(peer);
                    if state.waits_on(peer) {
                        return Err(WanError::Peer {
                            rank: self.cfg.rank,
                            peer,
                            error: "it closed its link before sending what this round needs (it stopped or died)".into(),
                        });
                    }
                }
                Event::Failed { peer, error } => {
                    return Err(WanError::Peer {
                        rank: self.cfg.rank,
                        peer,
                        error,
                    })
                }
                Event::Chunk(c) => {
                    self.measure(c.from, c.sample)?;
                    let m = meta::decode(&c.meta).map_err(|why| WanError::Peer {
                        rank: self.cfg.rank,
                        peer: c.from,
                        error: format!("invalid chunk metadata: {why}"),
                    })?;
                    let values =
                        c.data
                            .as_f32()
                            .map(<[f32]>::to_vec)
                            .ok_or_else(|| WanError::Peer {
                                rank: self.cfg.rank,
                                peer: c.from,
                                error: "a chunk that is not f32".into(),
                            })?;
                    // Relays go on at once, whatever the round (source routing).
                    let relayed = crate::sync::relay(self.cfg.rank, c.from, &m, &values).map_err(
                        |error| WanError::Peer {
                            rank: self.cfg.rank,
                            peer: c.from,
                            error,
                        },
                    )?;
                    if let Some(a) = relayed {
                        self.report.relayed += 1;
                        self.perform(vec![a])?;
                        continue;
                    }
                    if m.round > round {
                        // A node already in the next round (it finished this one).
                        self.early.push((c.from, m, values));
                        continue;
                    }
                    if m.round < round {
                        return Err(WanError::Peer {
                            rank: self.cfg.rank,
                            peer: c.from,
                            error: format!(
                                "a chunk of round {}, which this node finished",
                                m.round
                            ),
                        });
                    }
                    let acts = {
                        let routes = self.router(&aux);
                        state.on_chunk(c.from, m, values, &routes)?
                    };
                    self.perform(acts)?;
                }
            }
        }
        self.report
            .sync_ms
            .push(started.elapsed().as_secs_f64() * 1e3);
        self.report.versions.push(state.version());
        self.round = self.round.wrapping_add(1);
        state
            .output()
            .ok_or_else(|| WanError::Internal("a finished round without its output".into()))
    }

    /// The route of a chunk up a tree edge: `None` for the primary edge, or an auxiliary
    /// path when the primary is busy and that path's first hop has room (§VI-A).
    fn router<'a>(
        &'a self,
        aux: &'a BTreeMap<(usize, usize), Vec<Vec<usize>>>,
    ) -> impl Fn(usize, usize) -> Option<Vec<usize>> + 'a {
        let ns = &self.cfg.netstorm;
        move |me: usize, parent: usize| {
            if !ns.enable_aux_path {
                return None;
            }
            let busy = |q: usize| {
                self.txs
                    .get(q)
                    .and_then(Option::as_ref)
                    .map_or(usize::MAX, ChunkTx::in_flight)
            };
            if busy(parent) < ns.primary_busy_bound {
                return None;
            }
            aux.get(&(me, parent))?
                .iter()
                .find(|p| p.len() >= 2 && busy(p[1]) < ns.auxiliary_queue_length)
                .cloned()
        }
    }

    fn perform(&mut self, actions: Vec<Action>) -> Result<(), WanError> {
        for a in actions {
            let Action::Send {
                to,
                meta: m,
                values,
            } = a;
            if !m.path.is_empty() && m.hop == 1 {
                self.report.sent_aux += 1;
            }
            let tx = self
                .txs
                .get(to)
                .and_then(Option::as_ref)
                .ok_or(WanError::Internal(format!("no channel to node {to}")))?;
            let out = Outgoing {
                meta: meta::encode(&m).map_err(|e| WanError::Internal(e.to_string()))?,
                data: Tensor::from_f32(&values),
            };
            if !tx.send(out) {
                return Err(WanError::Peer {
                    rank: self.cfg.rank,
                    peer: to,
                    error: "its channel has failed".into(),
                });
            }
        }
        Ok(())
    }

    /// Feed the passive measurement; report a link when it has enough chunks.
    fn measure(
        &mut self,
        from: usize,
        s: gradwire_netstorm::awareness::ChunkSample,
    ) -> Result<(), WanError> {
        if !self.cfg.netstorm.enable_awareness {
            return Ok(());
        }
        if let Some(m) = self.monitor.record(from, self.cfg.rank, s) {
            self.scheduler.report(&m, self.round)?;
            self.report.link_reports += 1;
        }
        Ok(())
    }

    /// What the node measured so far.
    pub fn report(&self) -> &NodeReport {
        &self.report
    }

    /// Finish sending what is queued (up to the round timeout: peers may still need this
    /// node's last results), then stop the channels.
    pub fn shutdown(mut self) -> NodeReport {
        let deadline = Instant::now() + self.cfg.round_timeout;
        while Instant::now() < deadline && self.txs.iter().flatten().any(|t| t.in_flight() > 0) {
            // Chunks that still arrive are not needed: this node has its results.
            let _ = self.events.recv_timeout(Duration::from_millis(50));
        }
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.txs.clear();
        for h in self.rx_threads.drain(..) {
            let _ = h.join();
        }
        self.report.clone()
    }
}
