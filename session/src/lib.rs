//! gradwire for embedding: one rank's [`Session`] of a training job, the API under the C
//! library (`capi/`) and the Python package (`python/`).
//!
//! A session is set up in two phases so that it can ride on the rendezvous the caller
//! already has: [`Endpoint::bind`] binds this rank's sockets and gives the bytes every other
//! rank needs ([`Endpoint::address`]); the caller all-gathers them (torch.distributed's
//! store, `MPI_Allgatherv`, ...) and [`Endpoint::connect`] makes the links. Without such an
//! engine, [`Session::rendezvous`] uses gradwire's own (rank 0 serves it).
//!
//! Operations work in place on the caller's bytes ([`Session::all_reduce`],
//! [`Session::broadcast`]): a binding hands over the memory of a numpy array or a C array.
//! Point-to-point [`Session::send`] and [`Session::recv`] copy once into and out of a
//! segment-aligned transport buffer.
//!
//! Every error has a stable [`ErrorKind`]. A session is `Send` but runs one operation at a
//! time (`&mut self`); share it behind a mutex.
#![deny(unsafe_code)]

mod error;
mod work;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use gradwire::auth::{JobKey, JobSecret};
use gradwire::flow::SenderConfig;
use gradwire::message::LossBound;
use gradwire::tagging::DlcpTagger;
use gradwire::transport::TransferConfig;
use gradwire_collective::comm::{Algorithm, AllReduceOptions, CommConfig, Communicator, TensorMut};
use gradwire_collective::group::{Group, GroupConfig, PendingGroup};
use gradwire_collective::job::MAX_RANKS;
use gradwire_collective::link::{Links, NetLinkConfig, PendingLinks};

pub use gradwire::datapath::fault::FaultConfig;
pub use gradwire::flow::{SegmentInfo, Tag};
pub use gradwire::tensor::DType;
pub use gradwire_collective::aggregate::{Contributors, ReduceOp};
pub use gradwire_collective::algo::Tagging;
pub use gradwire_collective::comm::MAX_P2P_TENSOR;
pub use gradwire_collective::deadline::StepDeadline;
pub use gradwire_collective::group::AllReduceAlgo;
pub use gradwire_collective::link::MAX_ENDPOINT_LEN;

pub use error::{ErrorKind, SessionError};
pub use work::{Outcome, Region, Work};

/// A priority function: the tag (DSCP, ECN-capable) of each segment of a sent tensor.
pub type PriorityFn<'a> = gradwire::flow::PriorityFn<'a>;

/// The longest idle wait inside one transfer before it counts as stalled (the operation's
/// own timeout may be longer: a peer may still be computing before it starts).
const MAX_IDLE: Duration = Duration::from_secs(5);

/// The smallest MTU a session takes (IPv4's minimum datagram size).
pub const MIN_MTU: usize = 576;
/// The largest MTU a session takes (one UDP datagram; loopback's MTU is 65536).
pub const MAX_MTU: usize = 65_535;

/// How a session is set up and runs.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The job's id: every rank gives the same.
    pub job: u32,
    /// This rank, below `world`.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// This rank's address: every link binds there.
    pub ip: IpAddr,
    /// Loss bound of operations that name none, a fraction in [0, 1): 0 is reliable.
    pub loss_bound: f64,
    /// Set-up deadline, and the longest wait for a peer in an operation.
    pub timeout: Duration,
    /// The job's secret (at least 16 bytes): every link authenticated and its data packets
    /// tagged; `None`: no authentication.
    pub secret: Option<Vec<u8>>,
    /// Testing: drop this fraction of arriving data packets (0: off).
    pub inject_loss: f64,
    /// Seed of `inject_loss`.
    pub seed: u64,
    /// Links between every pair of ranks, for [`Session::send`] and [`Session::recv`]; the
    /// collectives need only the ring. A full mesh costs about five file descriptors per
    /// peer (a listener, two TCP connections, two UDP sockets): turn it off above a few
    /// hundred ranks, or raise `ulimit -n`.
    pub point_to_point: bool,
    /// The senders' line rate in bit/s; `None`: the transport's default.
    pub rate_bps: Option<u64>,
    /// The network's MTU in bytes (the message layer's segments fill it): 1500 by default;
    /// 9000 on a jumbo-frame network, up to 65535 on loopback (one host), where fewer,
    /// larger segments cost less per byte. Every rank gives the same.
    pub mtu: usize,
    /// Run all-reduce, broadcast and barrier on the message layer (one socket per rank, no
    /// handshake per message; docs/design.md). In an authenticated job (`secret`) every
    /// datagram is sealed with its pair of ranks' key.
    pub message_layer: bool,
}

impl SessionConfig {
    /// Rank `rank` of `world` at `ip`, with the defaults: job 1, reliable, 30 s timeout.
    pub fn new(rank: usize, world: usize, ip: IpAddr) -> SessionConfig {
        SessionConfig {
            job: 1,
            rank,
            world,
            ip,
            loss_bound: 0.0,
            timeout: Duration::from_secs(30),
            secret: None,
            inject_loss: 0.0,
            seed: 0,
            point_to_point: true,
            rate_bps: None,
            mtu: 1500,
            message_layer: true,
        }
    }

    fn check(&self) -> Result<(), SessionError> {
        let bad = |m: String| Err(SessionError::InvalidArgument(m));
        if self.world == 0 || self.world > MAX_RANKS {
            return bad(format!(
                "the world size {} is not in 1..={MAX_RANKS}",
                self.world
            ));
        }
        if self.rank >= self.world {
            return bad(format!(
                "rank {} is not below the world size {}",
                self.rank, self.world
            ));
        }
        if self.ip.is_unspecified() {
            return bad(format!(
                "{} is not an address peers can reach: give this rank's own address",
                self.ip
            ));
        }
        loss_bound(self.loss_bound)?;
        if !(MIN_MTU..=MAX_MTU).contains(&self.mtu) {
            return bad(format!(
                "mtu {} is not in {MIN_MTU}..={MAX_MTU}: give the network's MTU (1500 on \
                 Ethernet, 9000 with jumbo frames, up to 65535 on loopback)",
                self.mtu
            ));
        }
        if !(0.0..=1.0).contains(&self.inject_loss) {
            return bad(format!(
                "inject_loss {} is not a fraction in [0, 1]",
                self.inject_loss
            ));
        }
        if self.timeout.is_zero() {
            return bad("the timeout must be above zero".into());
        }
        if self.rate_bps == Some(0) {
            return bad("rate_bps must be above zero".into());
        }
        Ok(())
    }

    /// This rank's flow-transport links: none when the message layer runs everything (its one
    /// socket reaches every peer); else to and from every other rank with `point_to_point`,
    /// else its ring neighbours (only this rank's edges: a big world costs no more than its
    /// peers).
    fn edges(&self) -> Vec<(usize, usize)> {
        let (r, n) = (self.rank, self.world);
        if self.uses_message_layer() {
            Vec::new()
        } else if self.point_to_point {
            (0..n)
                .filter(|&q| q != r)
                .flat_map(|q| [(r, q), (q, r)])
                .collect()
        } else if n < 2 {
            Vec::new()
        } else {
            vec![(r, (r + 1) % n), ((r + n - 1) % n, r)]
        }
    }

    /// Whether this session runs its collectives on the message layer.
    fn uses_message_layer(&self) -> bool {
        self.message_layer
    }

    /// Binds the message layer's socket if the session uses it (sealed with the job key in
    /// an authenticated job).
    fn bind_group(&self, secret: Option<&JobSecret>) -> Result<Option<PendingGroup>, SessionError> {
        if !self.uses_message_layer() {
            return Ok(None);
        }
        let mut g = GroupConfig::new(self.job, self.rank, self.world, self.ip, self.timeout);
        g.endpoint.inject_loss = self.inject_loss;
        g.endpoint.mtu = self.mtu;
        g.endpoint.seed = self.seed;
        g.endpoint.auth = secret.map(|s| Arc::new(JobKey::new(s)));
        Ok(Some(PendingGroup::bind(g)?))
    }

    /// The link configuration with what the message layer publishes.
    fn link_config_with(&self, group: Option<&PendingGroup>) -> NetLinkConfig {
        let mut c = self.link_config();
        c.msg_port = group.map(|g| g.address().port());
        c.msg_member = group.and_then(PendingGroup::member);
        c
    }

    fn link_config(&self) -> NetLinkConfig {
        NetLinkConfig {
            connect_timeout: self.timeout,
            fault: (self.inject_loss > 0.0).then(|| FaultConfig {
                drop: self.inject_loss,
                seed: self.seed,
                ..FaultConfig::default()
            }),
            ..NetLinkConfig::default()
        }
    }

    fn comm_config(&self) -> Result<CommConfig, SessionError> {
        let defaults = TransferConfig::default();
        let sender = match self.rate_bps {
            Some(r) => SenderConfig::new(r),
            None => defaults.sender.clone(),
        };
        Ok(CommConfig {
            transfer: TransferConfig {
                sender,
                idle_timeout: self.timeout.min(MAX_IDLE),
                ..defaults
            },
            loss_bound: loss_bound(self.loss_bound)?,
            op_timeout: self.timeout,
            ..CommConfig::default()
        })
    }

    fn secret(&self) -> Result<Option<JobSecret>, SessionError> {
        self.secret
            .as_ref()
            .map(|s| {
                JobSecret::new(s.clone())
                    .map_err(|e| SessionError::InvalidArgument(format!("job secret: {e}")))
            })
            .transpose()
    }
}

/// A loss bound from a fraction in [0, 1).
fn loss_bound(p: f64) -> Result<LossBound, SessionError> {
    if !(0.0..1.0).contains(&p) {
        return Err(SessionError::InvalidArgument(format!(
            "loss bound {p} is not a fraction in [0, 1)"
        )));
    }
    LossBound::from_fraction(p).map_err(|e| SessionError::InvalidArgument(e.to_string()))
}

/// A session between its two set-up phases: sockets bound, the address to exchange ready.
#[derive(Debug)]
pub struct Endpoint {
    cfg: SessionConfig,
    pending: PendingLinks,
    group: Option<PendingGroup>,
}

impl Endpoint {
    /// Phase 1: check `cfg` and bind this rank's sockets.
    pub fn bind(cfg: SessionConfig) -> Result<Endpoint, SessionError> {
        cfg.check()?;
        let secret = cfg.secret()?;
        let group = cfg.bind_group(secret.as_ref())?;
        let link_cfg = cfg.link_config_with(group.as_ref());
        let pending = Links::bind(
            cfg.job,
            cfg.rank,
            cfg.world,
            cfg.ip,
            &cfg.edges(),
            secret.as_ref(),
            &link_cfg,
        )?;
        Ok(Endpoint {
            cfg,
            pending,
            group,
        })
    }

    /// The bytes every other rank needs from this one (at most [`MAX_ENDPOINT_LEN`]).
    pub fn address(&self) -> &[u8] {
        self.pending.endpoint()
    }

    /// Phase 2: connect, given `table[r]` = rank `r`'s [`Endpoint::address`] for every rank
    /// (this one's included).
    pub fn connect(self, table: &[Vec<u8>]) -> Result<Session, SessionError> {
        let comm_cfg = self.cfg.comm_config()?;
        let links = self.pending.finish(table)?;
        Session::over(links, self.cfg, comm_cfg, self.group)
    }
}

/// Options of an all-reduce or a broadcast.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReduceOptions {
    /// Sum or average (the average of each block is over the ranks summed in it).
    pub op: ReduceOp,
    /// Loss bound, a fraction in [0, 1); `None`: the session's.
    pub loss_bound: Option<f64>,
    /// The tensor's layer, 0 = front (DLCP tagging).
    pub layer: u16,
    /// Layers of the model: with the layer, picks the DSCP (front layers more urgent); 0:
    /// unknown, the lowest data priority.
    pub num_layers: u16,
    /// DSCP of the data packets, instead of the layer's.
    pub dscp: Option<u8>,
    /// The all-reduce algorithm on the message layer (`Auto`: two-phase up to 32 KiB or for
    /// two ranks, ring otherwise).
    pub algorithm: AllReduceAlgo,
    /// A time bound per reduce-scatter step on the message layer (OptiReduce): a step ends
    /// at most this long after it could start, with what arrived (fixed, or adaptive from the
    /// steps this session saw); the report says which steps did.
    pub step_deadline: StepDeadline,
    /// Element ranges of the tensor (ascending, disjoint: the parameters it coalesces) each
    /// held to the loss bound on its own, so every parameter delivers at least
    /// `1 - loss_bound` however they are coalesced (message layer only). Empty: the tensor
    /// as a whole.
    pub ranges: Vec<std::ops::Range<usize>>,
    /// Tagging of the lossy steps' segments on the message layer (default: DLCP's, the
    /// layer's DSCP and ECN-capable by gradient magnitude).
    pub tagging: Tagging,
    /// Ring all-reduce on the message layer: every rank checks each chunk it got through
    /// the ring against its owner's digest, sent to it directly, so a rank that changed a
    /// chunk it forwarded is an error naming the path, never a different result (the
    /// two-phase algorithm needs no check: every chunk comes from its owner). Every rank
    /// must give the same value.
    pub verify_results: bool,
}

/// Options of a point-to-point transfer: both ends give the same tensor id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct P2pOptions {
    /// The caller's id of the tensor, at most [`MAX_P2P_TENSOR`].
    pub tensor: u32,
    /// The tensor's layer, 0 = front (the priority function sees it; with DLCP's default
    /// tagging it picks the DSCP).
    pub layer: u16,
    /// Layers of the model (DLCP's default tagging: front layers more urgent); 0: unknown,
    /// the lowest data priority.
    pub num_layers: u16,
    /// Loss bound, a fraction in [0, 1); `None`: the session's.
    pub loss_bound: Option<f64>,
}

/// What an all-reduce did: the per-layer loss telemetry.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReduceReport {
    /// Elements reduced.
    pub elems: usize,
    /// Blocks (the unit of aggregation: one transport segment).
    pub blocks: usize,
    /// Elements per block: block `b` is elements `b * block_elems ..`.
    pub block_elems: usize,
    /// Blocks with every rank's contribution.
    pub complete_blocks: usize,
    /// Mean over blocks of the fraction of ranks summed in the block.
    pub delivered_fraction: f64,
    /// For each rank, the fraction of blocks its contribution reached.
    pub rank_delivered: Vec<f64>,
    /// For each block, the fraction of ranks summed in it.
    pub block_delivered: Vec<f64>,
    /// Wall time, seconds.
    pub elapsed_s: f64,
    /// Payload bytes this rank sent.
    pub bytes_sent: u64,
    /// Which ranks are summed in each block of the result (`block_delivered` counts them).
    #[serde(skip)]
    pub contributors: Contributors,
}

/// What a broadcast delivered here.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BroadcastReport {
    /// Blocks in the tensor.
    pub blocks: usize,
    /// Blocks that hold the root's values (the others kept their contents).
    pub received_blocks: usize,
    /// Elements per block: block `b` is elements `b * block_elems ..`.
    pub block_elems: usize,
    /// For each block, whether it holds the root's values.
    pub block_received: Vec<bool>,
    /// Wall time, seconds.
    pub elapsed_s: f64,
}

/// What a send did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SendSummary {
    /// Segments of the tensor.
    pub segments: u32,
    /// Bytes of the tensor.
    pub bytes: u64,
    /// Segments sent again (retransmission passes).
    pub retransmitted_segments: u64,
    /// FlowStart to FlowFinish, seconds.
    pub elapsed_s: f64,
    /// Paced rate at the end, bit/s.
    pub final_rate_bps: u64,
}

/// What a receive delivered.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecvSummary {
    /// Segments of the tensor.
    pub segments: u32,
    /// Segments received (the others are zero).
    pub received_segments: u32,
    /// Fraction of segments received.
    pub delivered_fraction: f64,
    /// Byte ranges `(offset, length)` of the segments that did not arrive: they are zero.
    pub missing: Vec<(u64, usize)>,
    /// The loss bound enforced.
    pub loss_bound: f64,
    /// Retransmission rounds asked for.
    pub rounds: u32,
    /// Wall time, seconds.
    pub elapsed_s: f64,
}

/// One rank's end of a job.
#[derive(Debug)]
pub struct Session {
    cfg: SessionConfig,
    comm: Communicator,
    /// The message layer, when the session runs its collectives there.
    group: Option<Group>,
}

impl Session {
    /// Both phases with gradwire's own rendezvous at `master` (rank 0 serves it there).
    pub fn rendezvous(cfg: SessionConfig, master: SocketAddr) -> Result<Session, SessionError> {
        cfg.check()?;
        let secret = cfg.secret()?;
        let comm_cfg = cfg.comm_config()?;
        let group = cfg.bind_group(secret.as_ref())?;
        let link_cfg = cfg.link_config_with(group.as_ref());
        let links = Links::connect(
            cfg.job,
            cfg.rank,
            cfg.world,
            cfg.ip,
            master,
            &cfg.edges(),
            secret.as_ref(),
            &link_cfg,
        )?;
        Session::over(links, cfg, comm_cfg, group)
    }

    fn over(
        links: Links,
        cfg: SessionConfig,
        comm_cfg: CommConfig,
        group: Option<PendingGroup>,
    ) -> Result<Session, SessionError> {
        let group = match group {
            None => None,
            Some(g) => {
                let g = g.start_from(&links)?;
                // No connection is made on the layer: a barrier proves every rank is there
                // (a rank whose socket is gone is named at once, a silent one after the
                // timeout).
                g.barrier()?;
                Some(g)
            }
        };
        let comm = Communicator::new(links, cfg.job, comm_cfg)?;
        Ok(Session { cfg, comm, group })
    }

    /// Whether the collectives run on the message layer.
    pub fn message_layer(&self) -> bool {
        self.group.is_some()
    }

    /// The message layer's counters (`None` when the session does not use it).
    pub fn message_stats(&self) -> Option<gradwire_msg::endpoint::EndpointStats> {
        self.group.as_ref().map(Group::stats)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.cfg.world
    }

    /// The configuration the session was made with.
    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    /// All-reduce `bytes` (elements of `dtype`: f32, f16 or bf16) in place over every rank.
    pub fn all_reduce(
        &mut self,
        dtype: DType,
        bytes: &mut [u8],
        opts: &ReduceOptions,
    ) -> Result<ReduceReport, SessionError> {
        let tensor = float_tensor(dtype, bytes)?;
        if let Some(g) = &self.group {
            let o = self.group_options(opts)?;
            let elems = tensor.elems();
            let r = g.all_reduce(tensor, &o)?;
            return Ok(work::reduce_report(
                r,
                dtype,
                elems,
                self.cfg.world,
                g.block_bytes(),
            ));
        }
        if !opts.ranges.is_empty() && opts.loss_bound.unwrap_or(self.cfg.loss_bound) > 0.0 {
            return Err(SessionError::InvalidArgument(
                "a loss bound per range (per parameter) needs the message layer, and this \
                 session runs on the flow transport (message_layer off): all-reduce without \
                 ranges, or turn the message layer on"
                    .into(),
            ));
        }
        let o = AllReduceOptions {
            op: opts.op,
            loss_bound: opts.loss_bound.map(loss_bound).transpose()?,
            layer: opts.layer,
            dscp: data_dscp(opts)?,
            algorithm: Algorithm::Ring,
        };
        let r = self.comm.all_reduce(tensor, &o)?;
        let world = r.contributors.world();
        let block_delivered = (0..r.blocks)
            .map(|b| r.contributors.count(b) as f64 / world.max(1) as f64)
            .collect();
        Ok(ReduceReport {
            elems: r.elems,
            blocks: r.blocks,
            block_elems: r.block_elems,
            complete_blocks: r.complete_blocks,
            delivered_fraction: r.delivered_fraction,
            rank_delivered: r.rank_delivered,
            block_delivered,
            elapsed_s: r.elapsed.as_secs_f64(),
            bytes_sent: r.bytes_sent,
            contributors: r.contributors,
        })
    }

    /// Broadcast `bytes` from `root` to every rank, in place (`opts.op` is not used).
    pub fn broadcast(
        &mut self,
        root: usize,
        dtype: DType,
        bytes: &mut [u8],
        opts: &ReduceOptions,
    ) -> Result<BroadcastReport, SessionError> {
        let tensor = TensorMut::new(dtype, bytes)?;
        let bound = opts.loss_bound.map(loss_bound).transpose()?;
        if let Some(g) = &self.group {
            if root >= self.cfg.world {
                return Err(SessionError::InvalidArgument(format!(
                    "root {root} is not a rank of this {}-rank job",
                    self.cfg.world
                )));
            }
            let p = opts.loss_bound.unwrap_or(self.cfg.loss_bound);
            let started = std::time::Instant::now();
            let mut tensor = tensor;
            let received = g.broadcast(tensor.as_bytes_mut(), root, p)?;
            let blocks = received.len();
            return Ok(BroadcastReport {
                block_elems: g.block_bytes() / dtype.elem_size(),
                received_blocks: received.iter().filter(|&&r| r).count(),
                block_received: received,
                blocks,
                elapsed_s: started.elapsed().as_secs_f64(),
            });
        }
        let r = self.comm.broadcast(tensor, root, bound)?;
        Ok(BroadcastReport {
            block_elems: r.block_elems,
            block_received: r.arrived,
            blocks: r.blocks,
            received_blocks: r.received_blocks,
            elapsed_s: r.elapsed.as_secs_f64(),
        })
    }

    /// Wait until every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), SessionError> {
        if let Some(g) = &self.group {
            return Ok(g.barrier()?);
        }
        Ok(self.comm.barrier()?)
    }

    /// DLCP's send of one tensor to `peer`, each segment tagged by `priority` (`None`: DLCP's
    /// default tagging, the layer's DSCP and ECN-capable by gradient magnitude).
    pub fn send(
        &mut self,
        peer: usize,
        dtype: DType,
        bytes: &[u8],
        opts: &P2pOptions,
        priority: Option<&PriorityFn<'_>>,
    ) -> Result<SendSummary, SessionError> {
        self.check_p2p_link(peer, true)?;
        let o = p2p_options(opts)?;
        if self.group.is_some() {
            // One copy, into the message's own buffer.
            let (work, segments, len) =
                self.post_send(peer, dtype, Region::owned(bytes.to_vec()), opts, priority)?;
            let started = std::time::Instant::now();
            return Ok(work::send_summary(work.wait()?, segments, len, started));
        }
        let tensor = p2p_tensor(dtype, bytes.len()).map(|mut t| {
            t.as_bytes_mut().copy_from_slice(bytes);
            t
        })?;
        let report = match priority {
            Some(f) => self.comm.send(peer, &tensor, &o, f)?,
            None => {
                let tagger = DlcpTagger {
                    dscp: data_dscp(&ReduceOptions {
                        layer: opts.layer,
                        num_layers: opts.num_layers,
                        ..ReduceOptions::default()
                    })?,
                    threshold: gradwire::tagging::magnitude_threshold(
                        &tensor,
                        &gradwire::tagging::MagnitudeConfig::default(),
                    ),
                };
                self.comm.send(peer, &tensor, &o, &tagger.priority_fn())?
            }
        };
        Ok(SendSummary {
            segments: report.segments,
            bytes: report.size_bytes,
            retransmitted_segments: report.stats.retransmitted,
            elapsed_s: report.fct.as_secs_f64(),
            final_rate_bps: report.final_rate_bps,
        })
    }

    /// Receive one tensor from `peer` into `bytes` (the sender's length and dtype).
    pub fn recv(
        &mut self,
        peer: usize,
        dtype: DType,
        bytes: &mut [u8],
        opts: &P2pOptions,
    ) -> Result<RecvSummary, SessionError> {
        self.check_p2p_link(peer, false)?;
        let mut tensor = p2p_tensor(dtype, bytes.len())?;
        let o = p2p_options(opts)?;
        if let Some(g) = &self.group {
            self.check_peer(peer)?;
            let bound = opts.loss_bound.unwrap_or(self.cfg.loss_bound);
            loss_bound(bound)?;
            let started = std::time::Instant::now();
            let r = g.recv(peer, bytes, opts.tensor, bound)?;
            let summary = work::recv_summary(
                &r,
                bytes.len(),
                g.block_bytes(),
                bound,
                started.elapsed().as_secs_f64(),
            );
            // Segments that never arrived are zero, as on the flow transport.
            work::zero_missing(bytes, &summary.missing);
            return Ok(summary);
        }
        let r = self.comm.recv(peer, &mut tensor, &o)?;
        bytes.copy_from_slice(tensor.as_bytes());
        Ok(RecvSummary {
            missing: r.missing_byte_ranges(),
            segments: r.segments,
            received_segments: r.received_segments,
            delivered_fraction: r.delivered_fraction,
            loss_bound: r.loss_bound,
            rounds: r.rounds,
            elapsed_s: r.total.as_secs_f64(),
        })
    }
}

impl Session {
    /// A peer of a point-to-point transfer on the message layer: another rank of the job.
    fn check_peer(&self, peer: usize) -> Result<(), SessionError> {
        if peer >= self.cfg.world || peer == self.cfg.rank {
            return Err(SessionError::InvalidArgument(format!(
                "rank {peer} is not another rank of this {}-rank job (this is rank {})",
                self.cfg.world, self.cfg.rank
            )));
        }
        Ok(())
    }

    /// Without `point_to_point` a session has its ring links only: send to the next rank,
    /// receive from the previous one.
    fn check_p2p_link(&self, peer: usize, sending: bool) -> Result<(), SessionError> {
        let (r, n) = (self.cfg.rank, self.cfg.world);
        if self.cfg.point_to_point || peer >= n || peer == r {
            return Ok(()); // the communicator names a bad peer itself
        }
        let (ring_peer, what) = if sending {
            ((r + 1) % n, "send to the next rank")
        } else {
            ((r + n - 1) % n, "receive from the previous rank")
        };
        if peer == ring_peer {
            return Ok(());
        }
        Err(SessionError::InvalidArgument(format!(
            "rank {r} has no link {} rank {peer}: with point_to_point off a session can only \
             {what} ({ring_peer}); set point_to_point on every rank (Python: \
             point_to_point=True; C: gw_config.point_to_point) for transfers between any pair",
            if sending { "to" } else { "from" }
        )))
    }
}

/// `bytes` as an f32, f16 or bf16 tensor.
fn float_tensor(dtype: DType, bytes: &mut [u8]) -> Result<TensorMut<'_>, SessionError> {
    if dtype == DType::Raw {
        return Err(SessionError::InvalidArgument(
            "an all-reduce needs f32, f16 or bf16 elements, not raw bytes".into(),
        ));
    }
    Ok(TensorMut::new(dtype, bytes)?)
}

fn p2p_tensor(dtype: DType, len: usize) -> Result<gradwire::tensor::Tensor, SessionError> {
    whole_elems(dtype, len)?;
    Ok(gradwire::tensor::Tensor::zeros(
        dtype,
        len / dtype.elem_size(),
    ))
}

/// `len` bytes must be a whole number of `dtype` elements.
fn whole_elems(dtype: DType, len: usize) -> Result<(), SessionError> {
    if len % dtype.elem_size() != 0 {
        return Err(SessionError::InvalidArgument(format!(
            "a buffer of {len} bytes is not a whole number of {dtype} elements ({} bytes each)",
            dtype.elem_size()
        )));
    }
    Ok(())
}

fn p2p_options(opts: &P2pOptions) -> Result<gradwire_collective::comm::P2pOptions, SessionError> {
    Ok(gradwire_collective::comm::P2pOptions {
        tensor: opts.tensor,
        layer: opts.layer,
        loss_bound: opts.loss_bound.map(loss_bound).transpose()?,
    })
}

/// The DSCP of an operation's data: the caller's, or its layer's (front layers more urgent).
fn data_dscp(opts: &ReduceOptions) -> Result<u8, SessionError> {
    if let Some(d) = opts.dscp {
        if d > gradwire_qos::MAX_DSCP {
            return Err(SessionError::InvalidArgument(format!(
                "DSCP {d} is above {}",
                gradwire_qos::MAX_DSCP
            )));
        }
        return Ok(d);
    }
    if opts.num_layers == 0 {
        return Ok(gradwire_qos::DATA_DSCP[0]);
    }
    if opts.layer >= opts.num_layers {
        return Err(SessionError::InvalidArgument(format!(
            "layer {} is not below num_layers {}",
            opts.layer, opts.num_layers
        )));
    }
    Ok(gradwire_qos::layer_dscp(
        u32::from(opts.layer),
        u32::from(opts.num_layers),
    ))
}
