//! A general node (NetStorm §VIII-A): it trains (the caller's input), asks the scheduler for
//! the round's policy before each PUSH, pushes, aggregates, forwards and pulls chunks over
//! its chunk channels, relays auxiliary chunks, and reports the links it measured.
//!
//! The protocol is the model-checked state machine of the netstorm crate
//! ([`NodeState`]); this loop moves its outputs onto the channels and the channels' chunks
//! into it, and makes the one decision the state machine leaves to the runtime: whether a
//! PUSH goes on its primary edge or, when that edge is busy, on an auxiliary path (§VI-A).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use gradwire_msg::endpoint::Endpoint;
use gradwire_netstorm::awareness::{ChunkSample, Estimator, LinkMonitor};
use gradwire_netstorm::config::NetStormConfig;
use gradwire_netstorm::consistency::{NodeState, Output, Payload};
use gradwire_netstorm::wire::{ChunkHeader, LinkReport, Message, Phase};

use gradwire_proto::tensor::Tensor;

use crate::channel::{self, ChannelConfig, Channels, Event, Outgoing};
use crate::control::SchedulerClient;
use crate::error::WanError;
use crate::policy::{aux_map, chunk_plan};

/// How a node runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node (its endpoint's rank).
    pub rank: usize,
    /// NetStorm's options (chunk size, auxiliary paths, awareness).
    pub netstorm: NetStormConfig,
    /// DSCP of the chunks.
    pub dscp: u8,
    /// Longest wait for a round (for the scheduler's answer or a peer's chunk).
    pub round_timeout: Duration,
    /// Most bytes held for one peer ([`ChannelConfig::peer_budget`]): its chunks received
    /// and not yet taken by this loop, and the relays it asked for that wait for a slow next
    /// hop. [`channel::budget_for_model`] of the model's bytes fits every correct run; each
    /// round raises it to that for the round's input anyway.
    pub peer_budget: usize,
    /// Authenticated jobs: the scheduler connection's keys ([`crate::seal`]). `None`: plain.
    pub control_auth: Option<crate::seal::ControlAuth>,
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

/// A chunk's values; partial sums add up element by element.
#[derive(Debug, Clone, PartialEq)]
struct Values(Vec<f32>);

impl Payload for Values {
    fn accumulate(&mut self, other: &Self) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a += b;
        }
    }

    /// A partial sum of another length would be added in part: refused instead.
    fn same_shape(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
    }
}

/// A running node: its channels and its scheduler connection.
#[derive(Debug)]
pub struct Node {
    cfg: NodeConfig,
    channels: Channels,
    scheduler: SchedulerClient,
    state: NodeState<Values>,
    /// Peers whose links to this node have closed (finished, or dead).
    closed: Vec<usize>,
    monitor: LinkMonitor,
    report: NodeReport,
}

impl Node {
    /// A node over `endpoint` (started, with every node's address; its peer timeout is how
    /// long a silent peer is waited for), talking to the scheduler at `scheduler` (connected
    /// at the first round's topology request, from the endpoint's address, retrying for up
    /// to the round timeout).
    pub fn start(
        endpoint: Endpoint,
        scheduler: SocketAddr,
        cfg: NodeConfig,
    ) -> Result<Node, WanError> {
        cfg.netstorm
            .validate()
            .map_err(|e| WanError::Config(e.to_string()))?;
        // f32 chunks: the channels carry at most MAX_CHUNK_BYTES of values per chunk.
        if cfg.netstorm.chunk_size > channel::MAX_CHUNK_BYTES / 4 {
            return Err(WanError::Config(format!(
                "chunk_size {} elements is above the chunk channels' {} (f32): give a smaller \
                 CHUNK_SIZE",
                cfg.netstorm.chunk_size,
                channel::MAX_CHUNK_BYTES / 4
            )));
        }
        let me = u16::try_from(cfg.rank)
            .map_err(|_| WanError::Config(format!("node {} is beyond 16-bit ids", cfg.rank)))?;
        if endpoint.rank() != me {
            return Err(WanError::Config(format!(
                "node {} was given the endpoint of node {}",
                cfg.rank,
                endpoint.rank()
            )));
        }
        let local = endpoint.local_addr().ip();
        // f32 chunks: a posted receive holds the largest chunk of this job's CHUNK_SIZE.
        let channels = Channels::start(
            endpoint,
            ChannelConfig {
                peer_budget: cfg.peer_budget,
                ..ChannelConfig::new(cfg.dscp, cfg.netstorm.chunk_size.saturating_mul(4))
            },
        );
        // Connected at the first frame: the scheduler closes a connection that stays silent
        // past its first-frame timeout, and the first round may come later than that. From
        // the endpoint's address, the one the node published: the scheduler takes a node's
        // frames only from there.
        let mut scheduler = SchedulerClient::new(scheduler, cfg.round_timeout).from_ip(local);
        if let Some(auth) = &cfg.control_auth {
            scheduler = scheduler.authenticated(auth.clone(), cfg.rank as u16);
        }
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
            channels,
            scheduler,
            state: NodeState::new(me, 0),
            closed: Vec::new(),
            monitor,
        })
    }

    fn peer_err(&self, peer: usize, error: impl ToString) -> WanError {
        self.peer_err_via(peer, error, None)
    }

    fn peer_err_via(&self, peer: usize, error: impl ToString, culprit: Option<usize>) -> WanError {
        WanError::Peer {
            rank: self.cfg.rank,
            peer,
            error: error.to_string(),
            closed: self.closed.clone(),
            culprit,
        }
    }

    /// One synchronization round: returns the average of every node's `input`.
    pub fn synchronize(&mut self, input: &[f32]) -> Result<Vec<f32>, WanError> {
        let round = self.state.round();
        // Chunks of a model this size are no flood (f32 values).
        self.channels
            .raise_budget(channel::budget_for_model(input.len().saturating_mul(4)));
        let proto =
            |e: gradwire_netstorm::consistency::ConsistencyError| WanError::Protocol(e.to_string());
        // Topology request before the PUSH (§VII-A): block for the round's policy.
        let mut trp = None;
        for o in self.state.begin_round(round).map_err(proto)? {
            if let Output::Request(r) = o {
                trp = Some(r);
            }
        }
        let trp = trp.ok_or_else(|| WanError::Internal("no topology request".into()))?;
        let reply = self.scheduler.request(trp)?;
        self.state.on_reply(reply).map_err(proto)?;
        let (version, policy) = self
            .state
            .policy()
            .ok_or_else(|| WanError::Internal("adopted no policy".into()))?;
        let policy = policy.clone();
        let world = usize::from(policy.nodes());
        let plan = chunk_plan(&policy, input.len(), self.cfg.netstorm.chunk_size)
            .map_err(WanError::Config)?;
        let aux = aux_map(&policy);
        let started = Instant::now();
        let mut results: Vec<Option<Vec<f32>>> = vec![None; plan.len()];
        let own = plan
            .iter()
            .enumerate()
            .map(|(c, (r, root))| (*root, c as u32, Values(input[r.clone()].to_vec())))
            .collect();
        let outs = self.state.contribute(own).map_err(proto)?;
        let mut done = self.perform(outs, &aux, &mut results, None)?;
        let deadline = started + self.cfg.round_timeout;
        while !done {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = match self.channels.events().recv_timeout(left) {
                Ok(ev) => ev,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(WanError::RoundTimeout {
                        rank: self.cfg.rank,
                        round,
                        pending: results.iter().filter(|r| r.is_none()).count(),
                        timeout: self.cfg.round_timeout,
                        waited: started.elapsed(),
                        closed: self.closed.clone(),
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(WanError::Internal("the chunk channels are gone".into()))
                }
            };
            match ev {
                // A message slot to `to` is free: send what waits for it.
                Event::Sent { to } => self.channels.pump(to),
                // A peer that finished may leave; if this round still needed it, the round
                // times out naming it.
                Event::Closed { peer } => self.closed.push(peer),
                Event::Failed {
                    peer,
                    error,
                    culprit,
                } => {
                    self.channels.give_up(culprit.unwrap_or(peer));
                    return Err(self.peer_err_via(peer, error, culprit));
                }
                Event::Chunk(c) => {
                    // Off the channels' books: the round's state holds it from here.
                    self.channels.taken(c.from, c.sample.bytes);
                    self.measure(c.from, c.sample)?;
                    let header = ChunkHeader::parse(&c.meta)
                        .map_err(|e| self.peer_err(c.from, format!("invalid chunk header: {e}")))?;
                    let values = c
                        .data
                        .as_f32()
                        .map(<[f32]>::to_vec)
                        .ok_or_else(|| self.peer_err(c.from, "a chunk that is not f32"))?;
                    let from = u16::try_from(c.from)
                        .map_err(|_| self.peer_err(c.from, "a node id beyond 16 bits"))?;
                    let outs = self
                        .state
                        .on_chunk(from, header, Values(values))
                        .map_err(|e| self.peer_err(c.from, e))?;
                    done = self.perform(outs, &aux, &mut results, Some(c.from))?;
                }
            }
        }
        self.report
            .sync_ms
            .push(started.elapsed().as_secs_f64() * 1e3);
        self.report.versions.push(version);
        // The roots hold sums; every node divides the same sum the same way.
        let n = world as f32;
        let mut out = Vec::with_capacity(input.len());
        for (c, (r, (range, root))) in results.into_iter().zip(&plan).enumerate() {
            let r =
                r.ok_or_else(|| WanError::Internal("a finished round without a result".into()))?;
            if r.len() != range.len() {
                // The result came down the chunk's tree: its parent here sent it.
                let from = policy
                    .tree(*root)
                    .and_then(|t| t.parent_of(self.cfg.rank as u16))
                    .map_or(usize::from(*root), usize::from);
                return Err(self.peer_err(
                    from,
                    format!(
                        "the result of chunk {c} has {} elements where the chunk has {}",
                        r.len(),
                        range.len()
                    ),
                ));
            }
            out.extend(r.iter().map(|v| v / n));
        }
        Ok(out)
    }

    /// Carry out the state machine's outputs, those of a chunk from `from` (`None`: this
    /// node's own); `true` once the round is done.
    fn perform(
        &mut self,
        outs: Vec<Output<Values>>,
        aux: &BTreeMap<(u16, u16), Vec<Vec<u16>>>,
        results: &mut [Option<Vec<f32>>],
        from: Option<usize>,
    ) -> Result<bool, WanError> {
        let mut done = false;
        for o in outs {
            match o {
                Output::Send {
                    to,
                    header,
                    payload,
                } => {
                    let (to, header) = self.route(to, header, aux)?;
                    // Another node's chunk on its auxiliary path: `from` asked for it.
                    let relay_for = from.filter(|_| header.is_aux && header.hop != 1);
                    if header.is_aux {
                        if header.hop == 1 {
                            self.report.sent_aux += 1;
                        } else {
                            self.report.relayed += 1;
                        }
                    }
                    let meta = header
                        .to_vec()
                        .map_err(|e| WanError::Internal(e.to_string()))?;
                    let out = Outgoing {
                        meta,
                        data: Tensor::from_f32(&payload.0),
                    };
                    match relay_for {
                        Some(asked_by) => {
                            if let Err(e) = self.channels.relay(usize::from(to), &out, asked_by) {
                                // The link with the node that asked fails, as a channel's
                                // failure does: every peer gives up naming it.
                                self.channels.give_up(asked_by);
                                return Err(self.peer_err(asked_by, e));
                            }
                        }
                        None => self.channels.send(usize::from(to), &out).map_err(|e| {
                            WanError::Internal(format!("a chunk for node {to}: {e}"))
                        })?,
                    }
                }
                Output::Result { chunk, payload, .. } => {
                    if let Some(slot) = results.get_mut(chunk as usize) {
                        *slot = Some(payload.0);
                    }
                }
                Output::RoundDone { .. } => done = true,
                Output::Request(_) | Output::Adopted { .. } => {}
            }
        }
        Ok(done)
    }

    /// A PUSH goes on its primary edge unless that edge has PRIMARY_BUSY_BOUND chunks
    /// queued; then on the fastest auxiliary path whose first hop has fewer than
    /// AUXILIARY_QUEUE_LENGTH; when all are busy, on the primary edge after all (§VI-A).
    fn route(
        &self,
        to: u16,
        header: ChunkHeader,
        aux: &BTreeMap<(u16, u16), Vec<Vec<u16>>>,
    ) -> Result<(u16, ChunkHeader), WanError> {
        let ns = &self.cfg.netstorm;
        if !ns.enable_aux_path || header.is_aux || header.phase != Phase::Push {
            return Ok((to, header));
        }
        let queued = |q: u16| self.channels.in_flight(usize::from(q));
        if queued(to) < ns.primary_busy_bound {
            return Ok((to, header));
        }
        let me = self.state.me();
        let Some(paths) = aux.get(&(me, to)) else {
            return Ok((to, header));
        };
        for p in paths {
            if let Some(&first) = p.get(1) {
                if queued(first) < ns.auxiliary_queue_length {
                    let h = header
                        .via(p)
                        .map_err(|e| WanError::Internal(e.to_string()))?;
                    return Ok((first, h));
                }
            }
        }
        Ok((to, header))
    }

    /// Feed the passive measurement; report a link when it has enough chunks.
    fn measure(&mut self, from: usize, s: ChunkSample) -> Result<(), WanError> {
        if !self.cfg.netstorm.enable_awareness {
            return Ok(());
        }
        if let Some(m) = self.monitor.record(from, self.cfg.rank, s) {
            let report = LinkReport {
                from: u16::try_from(m.from).unwrap_or(u16::MAX),
                to: self.state.me(),
                throughput_bps: m.throughput_bps as u64,
                samples: u16::try_from(m.samples).unwrap_or(u16::MAX),
                measured_at_round: self.state.round(),
            };
            self.scheduler.send(&Message::LinkReport(report))?;
            self.report.link_reports += 1;
        }
        Ok(())
    }

    /// What the node measured so far.
    pub fn report(&self) -> &NodeReport {
        &self.report
    }

    /// The channels' endpoint counters (datagrams, refusals, resends).
    pub fn stats(&self) -> gradwire_msg::endpoint::EndpointStats {
        self.channels.stats()
    }

    /// Delivers every chunk sent (those waiting for a message slot too), up to the round
    /// timeout; whether all were. Chunks go out only while the node handles its events, so
    /// a node that waits on anything else after its last round (a barrier) calls this
    /// first: its peers may still need its last results.
    pub fn flush(&mut self) -> bool {
        self.channels.flush(self.cfg.round_timeout)
    }

    /// Finish delivering what was sent (up to the round timeout: peers may still need this
    /// node's last results), then close the endpoint: its socket closes, which the peers
    /// see as this node's links closing.
    pub fn shutdown(mut self) -> NodeReport {
        self.channels.flush(self.cfg.round_timeout);
        self.report
    }
}
