//! The communicator: collective operations of one rank over its [`Links`].
//!
//! - **All-reduce, ring**: reduce-scatter then all-gather over `world - 1` steps each; at
//!   every step a rank sends one chunk to the next rank while it receives another from the
//!   previous one.
//! - **All-reduce, tree** (MLNET's aggregation and multicast trees): the tensor is cut into
//!   pipeline chunks; each chunk is summed up the tree (an aggregator adds its children's
//!   chunk to its own and forwards one chunk upstream) and the root's result is multicast
//!   down the same tree. Chunks pipeline: a node receives chunk k+1 from its children while
//!   chunk k travels up, and results flow down while later chunks still go up (one thread
//!   per link and direction).
//! - **Broadcast**: a ring pipeline from the root.
//! - **Barrier**: two reliable token laps around the ring (everyone arrived; everyone may go).
//!
//! Every transfer has the loss bound the caller gives (DLCP): with `p > 0` a block may miss
//! some contributions, and the result of each block is the average over those that arrived
//! ([`crate::aggregate`]); each partial sum travels with its contributor sets (a small
//! reliable flow after each chunk). With `p = 0` nothing is lost and the sets are known
//! without sending them.
//!
//! All ranks must call the same operations in the same order (as with MPI and NCCL): the
//! flow ids (job, an id per chunk and step, an operation counter as the round) confirm it.

use std::ops::Range;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradwire::flow::{fixed_priority, PriorityFn, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{
    MissingFill, RecvOptions, RecvReport, SendOptions, SendReport, TransferConfig,
};

use crate::aggregate::{
    accumulate, adopt_or_finish, arrived_blocks, finish, BlockLayout, Contributors, Partial,
    ReduceOp,
};
use crate::algo::ReduceOutcome;
use crate::error::CollectiveError;
use crate::link::{InLink, Links, OutLink};
use crate::tree::Tree;

/// A caller's buffer as the tensor an operation works on in place: an element type and the
/// bytes. Operations read and write these bytes directly, so a binding can hand over the
/// memory of a numpy array or a C array without copying it into a [`Tensor`] first.
#[derive(Debug)]
pub struct TensorMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

impl<'a> TensorMut<'a> {
    /// `bytes` as elements of `dtype`: its length must be a whole number of elements.
    pub fn new(dtype: DType, bytes: &'a mut [u8]) -> Result<TensorMut<'a>, CollectiveError> {
        if bytes.len() % dtype.elem_size() != 0 {
            return Err(CollectiveError::Config(format!(
                "a buffer of {} bytes is not a whole number of {dtype} elements ({} bytes each)",
                bytes.len(),
                dtype.elem_size()
            )));
        }
        Ok(TensorMut { dtype, bytes })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.bytes.len() / self.dtype.elem_size()
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl<'a> From<&'a mut Tensor> for TensorMut<'a> {
    fn from(t: &'a mut Tensor) -> TensorMut<'a> {
        TensorMut {
            dtype: t.dtype(),
            bytes: t.as_bytes_mut(),
        }
    }
}

/// How a communicator runs its operations.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Transport configuration of every transfer.
    pub transfer: TransferConfig,
    /// Loss bound of an operation that names none: reliable by default.
    pub loss_bound: LossBound,
    /// Elements per aggregation block; `None`: exactly one transport segment.
    pub block_elems: Option<usize>,
    /// Blocks per pipeline chunk of the tree algorithms.
    pub pipeline_blocks: usize,
    /// Longest wait for a peer to start its part of an operation (a peer still computing,
    /// or dead): then the operation fails naming the peer.
    pub op_timeout: Duration,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            transfer: TransferConfig::default(),
            loss_bound: LossBound::RELIABLE,
            block_elems: None,
            pipeline_blocks: 64,
            op_timeout: Duration::from_secs(30),
        }
    }
}

/// Which all-reduce algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Algorithm {
    /// Reduce-scatter then all-gather around the ring of ranks.
    Ring,
    /// Aggregate up and multicast down this tree (it must span every rank).
    Tree(Tree),
}

/// Options of one all-reduce.
#[derive(Debug, Clone, PartialEq)]
pub struct AllReduceOptions {
    /// Sum or average.
    pub op: ReduceOp,
    /// Loss bound of every transfer; `None`: the communicator's default.
    pub loss_bound: Option<LossBound>,
    /// The tensor's layer (DLCP tagging: the DSCP below).
    pub layer: u16,
    /// DSCP of the data packets.
    pub dscp: u8,
    /// The algorithm.
    pub algorithm: Algorithm,
}

impl Default for AllReduceOptions {
    fn default() -> Self {
        AllReduceOptions {
            op: ReduceOp::Sum,
            loss_bound: None,
            layer: 0,
            dscp: 0,
            algorithm: Algorithm::Ring,
        }
    }
}

/// What an all-reduce did: the per-block loss telemetry.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AllReduceReport {
    /// `ring` or `tree`.
    pub algorithm: &'static str,
    /// Elements reduced.
    pub elems: usize,
    /// Elements per block.
    pub block_elems: usize,
    /// Blocks with every rank's contribution.
    pub complete_blocks: usize,
    /// Blocks in the tensor.
    pub blocks: usize,
    /// Mean over blocks of the fraction of ranks summed in the block.
    pub delivered_fraction: f64,
    /// For each rank, the fraction of blocks its contribution reached.
    pub rank_delivered: Vec<f64>,
    /// Wall time of the operation.
    pub elapsed: Duration,
    /// Payload bytes this rank sent (data flows, first transmissions and retransmissions).
    pub bytes_sent: u64,
    /// Who is summed in each block of the result.
    #[serde(skip)]
    pub contributors: Contributors,
}

impl AllReduceReport {
    /// The report of a message-layer all-reduce ([`crate::group::Group`]) in this shape, so
    /// one set of checks reads both engines: `elems` reduced in blocks of `block_elems`
    /// over `world` ranks, `bytes_sent` by this rank.
    pub fn of_outcome(
        out: ReduceOutcome,
        elems: usize,
        block_elems: usize,
        world: usize,
        bytes_sent: u64,
    ) -> AllReduceReport {
        let contributors = out
            .contributors
            .unwrap_or_else(|| Contributors::all(out.blocks, world));
        let blocks = out.blocks.max(1) as f64;
        let delivered_fraction = (0..out.blocks)
            .map(|b| contributors.count(b) as f64 / world as f64)
            .sum::<f64>()
            / blocks;
        let rank_delivered = (0..world)
            .map(|q| {
                (0..out.blocks)
                    .filter(|&b| contributors.contains(b, q))
                    .count() as f64
                    / blocks
            })
            .collect();
        AllReduceReport {
            algorithm: out.algorithm,
            elems,
            block_elems,
            complete_blocks: out.complete_blocks,
            blocks: out.blocks,
            delivered_fraction: if out.blocks == 0 {
                1.0
            } else {
                delivered_fraction
            },
            rank_delivered,
            elapsed: out.elapsed,
            bytes_sent,
            contributors,
        }
    }

    fn new(
        algorithm: &'static str,
        layout: &BlockLayout,
        contributors: Contributors,
        elapsed: Duration,
        bytes_sent: u64,
    ) -> AllReduceReport {
        let blocks = layout.blocks();
        let world = contributors.world();
        let complete_blocks = (0..blocks)
            .filter(|&b| contributors.count(b) == world)
            .count();
        let delivered_fraction = if blocks == 0 {
            1.0
        } else {
            (0..blocks)
                .map(|b| contributors.count(b) as f64 / world as f64)
                .sum::<f64>()
                / blocks as f64
        };
        let rank_delivered = (0..world)
            .map(|r| {
                if blocks == 0 {
                    1.0
                } else {
                    (0..blocks).filter(|&b| contributors.contains(b, r)).count() as f64
                        / blocks as f64
                }
            })
            .collect();
        AllReduceReport {
            algorithm,
            elems: layout.elems(),
            block_elems: layout.block_elems(),
            complete_blocks,
            blocks,
            delivered_fraction,
            rank_delivered,
            elapsed,
            bytes_sent,
            contributors,
        }
    }
}

/// What a broadcast delivered to this rank.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BroadcastReport {
    /// Blocks in the tensor.
    pub blocks: usize,
    /// Blocks that hold the root's values here (the others kept their previous contents).
    pub received_blocks: usize,
    /// Elements per block.
    pub block_elems: usize,
    /// Which blocks arrived.
    #[serde(skip)]
    pub arrived: Vec<bool>,
    /// Wall time.
    pub elapsed: Duration,
}

// Flow ids: the kind of transfer in the top bits, then the step and the chunk.
const KIND_REDUCE: u32 = 1;
const KIND_GATHER: u32 = 2;
const KIND_UP: u32 = 3;
const KIND_DOWN: u32 = 4;
const KIND_BCAST: u32 = 5;
const KIND_BARRIER: u32 = 6;
const KIND_P2P: u32 = 7;
/// Tensor ids a point-to-point transfer may use: the bits below the kind.
pub const MAX_P2P_TENSOR: u32 = (1 << 27) - 1;
/// Set on the contributor-set flow that follows a chunk.
const SETS_BIT: u32 = 1 << 31;

fn flow_tensor(kind: u32, step: usize, chunk: usize) -> u32 {
    (kind << 27) | (((step & 0x7ff) as u32) << 16) | (chunk & 0xffff) as u32
}

/// The flow ids of a ring all-reduce's reduce-scatter, for tests that forge a peer from the
/// wire (not an API: flow ids are internal to the communicator's links). A forged peer built
/// on these follows any change here instead of silently missing the victim's flows.
#[doc(hidden)]
pub mod flow_ids {
    /// Set on the contributor-set flow that follows a chunk.
    pub const SETS_BIT: u32 = super::SETS_BIT;

    /// The flow id of reduce-scatter step `step`'s transfer of chunk `chunk`.
    pub fn reduce_scatter(step: usize, chunk: usize) -> u32 {
        super::flow_tensor(super::KIND_REDUCE, step, chunk)
    }
}

/// Options of one point-to-point transfer ([`Communicator::send`], [`Communicator::recv`]):
/// both ends give the same tensor id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct P2pOptions {
    /// The caller's id of the tensor, at most [`MAX_P2P_TENSOR`].
    pub tensor: u32,
    /// The tensor's layer (the priority function sees it).
    pub layer: u16,
    /// Loss bound; `None`: the communicator's default.
    pub loss_bound: Option<LossBound>,
}

/// One rank's end of a collective job.
#[derive(Debug)]
pub struct Communicator {
    links: Links,
    cfg: CommConfig,
    job: u32,
    /// Operations so far: the round of every flow of the next one.
    seq: u32,
    /// Point-to-point transfers sent to and received from each peer so far: the round of
    /// the next one (only the two ends count them, so they are apart from `seq`).
    p2p_sent: Vec<u32>,
    p2p_received: Vec<u32>,
    /// Why an earlier operation failed: its links may be mid-flow, so no later one runs.
    failed: Option<String>,
}

/// A chunk as it travels: values and, unless the operation is reliable, contributor sets.
struct Part {
    values: Tensor,
    sets: Option<Contributors>,
    arrived: Vec<bool>,
}

/// The blocks and flows of one ring step.
struct RingStep {
    send: Range<usize>,
    recv: Range<usize>,
    send_x: Xfer,
    recv_x: Xfer,
}

/// One transfer's identity and bound.
#[derive(Clone, Copy)]
struct Xfer {
    job: u32,
    round: u32,
    tensor: u32,
    bound: LossBound,
    layer: u16,
    dscp: u8,
    stage: Stage,
}

impl Communicator {
    /// A communicator over `links` for job `job`.
    pub fn new(links: Links, job: u32, cfg: CommConfig) -> Result<Communicator, CollectiveError> {
        let world = links.world();
        let mut cfg = cfg;
        cfg.transfer.connect_timeout = cfg.op_timeout;
        cfg.transfer
            .validate()
            .map_err(|e| CollectiveError::Config(e.to_string()))?;
        if cfg.pipeline_blocks == 0 {
            return Err(CollectiveError::Config(
                "pipeline_blocks must be at least 1".into(),
            ));
        }
        Ok(Communicator {
            links,
            cfg,
            job,
            seq: 0,
            p2p_sent: vec![0; world],
            p2p_received: vec![0; world],
            failed: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.links.rank()
    }

    /// World size.
    pub fn world(&self) -> usize {
        self.links.world()
    }

    /// The configuration.
    pub fn config(&self) -> &CommConfig {
        &self.cfg
    }

    /// Refuse to start an operation after one failed.
    fn usable(&self) -> Result<(), CollectiveError> {
        match &self.failed {
            Some(why) => Err(CollectiveError::Unusable(why.clone())),
            None => Ok(()),
        }
    }

    /// Remember a failure: the links are left mid-flow and the peers' operation counters
    /// may differ, so this communicator runs nothing more.
    fn note<T>(&mut self, r: Result<T, CollectiveError>) -> Result<T, CollectiveError> {
        // Errors found before any transfer started (bad arguments, a missing link) leave
        // the links as they were.
        if let Err(
            e @ (CollectiveError::Link { .. }
            | CollectiveError::Aggregate { .. }
            | CollectiveError::ThreadPanicked),
        ) = &r
        {
            self.failed.get_or_insert_with(|| e.to_string());
        }
        r
    }

    fn next_round(&mut self) -> u32 {
        let r = self.seq;
        self.seq = self.seq.wrapping_add(1);
        r
    }

    /// Elements per block for `dtype`: the configured size, or one segment of the links.
    fn block_elems(&mut self, dtype: DType, peer: usize) -> Result<usize, CollectiveError> {
        if let Some(b) = self.cfg.block_elems {
            // At most the largest tensor a block could describe (no overflow in bytes).
            return Ok(b.clamp(1, isize::MAX as usize / 8));
        }
        let mtu = self.cfg.transfer.mtu;
        let payload = self
            .links
            .out(peer)?
            .segment_payload(dtype, mtu)
            .ok_or_else(|| CollectiveError::Config(format!("mtu {mtu} leaves no payload")))?;
        Ok(payload / dtype.elem_size())
    }

    /// All-reduce `tensor` in place over every rank.
    pub fn all_reduce<'t>(
        &mut self,
        tensor: impl Into<TensorMut<'t>>,
        opts: &AllReduceOptions,
    ) -> Result<AllReduceReport, CollectiveError> {
        let tensor = &mut tensor.into();
        if tensor.dtype() == DType::Raw {
            return Err(CollectiveError::Config(
                "all-reduce needs f32, f16 or bf16 elements, not raw bytes".into(),
            ));
        }
        if !opts.op.tolerates_loss() {
            return Err(CollectiveError::Config(format!(
                "the flow transport (authenticated jobs) all-reduces only sum and average, not \
                 {}: run the job on the message layer (no job secret) for min, max and product",
                opts.op.name()
            )));
        }
        self.usable()?;
        let r = match &opts.algorithm {
            Algorithm::Ring => self.ring_all_reduce(tensor, opts),
            Algorithm::Tree(tree) => {
                let tree = tree.clone();
                self.tree_all_reduce(tensor, opts, &tree)
            }
        };
        self.note(r)
    }

    fn ring_all_reduce(
        &mut self,
        tensor: &mut TensorMut<'_>,
        opts: &AllReduceOptions,
    ) -> Result<AllReduceReport, CollectiveError> {
        let started = Instant::now();
        let (n, r) = (self.world(), self.rank());
        let dtype = tensor.dtype();
        let es = dtype.elem_size();
        let round = self.next_round();
        if n == 1 {
            let layout = BlockLayout::new(tensor.elems(), tensor.elems().max(1));
            let sets = Contributors::all(layout.blocks(), 1);
            return Ok(AllReduceReport::new(
                "ring",
                &layout,
                sets,
                started.elapsed(),
                0,
            ));
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let block_elems = self.block_elems(dtype, next)?;
        let layout = BlockLayout::new(tensor.elems(), block_elems);
        let bb = block_elems * es;
        let bound = opts.loss_bound.unwrap_or(self.cfg.loss_bound);
        let reliable = bound == LossBound::RELIABLE;
        let mut sets = Contributors::only(layout.blocks(), n, r);
        let mut bytes_sent = 0;
        let cfg = self.cfg.transfer.clone();
        let job = self.job;
        let xfer = |kind, step, chunk, stage| Xfer {
            job,
            round,
            tensor: flow_tensor(kind, step, chunk),
            bound,
            layer: opts.layer,
            dscp: opts.dscp,
            stage,
        };

        // Reduce-scatter: after step s, chunk (r - s - 1) holds the sum of ranks r-s-1..=r.
        for s in 0..n - 1 {
            let send_c = (r + n - s) % n;
            let recv_c = (r + 2 * n - s - 1) % n;
            let rb = layout.chunk_blocks(n, recv_c);
            let step = RingStep {
                send: layout.chunk_blocks(n, send_c),
                recv: rb.clone(),
                send_x: xfer(KIND_REDUCE, s, send_c, Stage::Push),
                recv_x: xfer(KIND_REDUCE, s, recv_c, Stage::Push),
            };
            let (sent, got) =
                self.ring_step(tensor, &sets, &layout, &step, (next, prev), reliable, &cfg)?;
            bytes_sent += sent;
            let Some(mut part) = got else { continue };
            // Reliable: the partial from `prev` at step s sums ranks prev-s..=prev.
            let in_sets = part.sets.take().unwrap_or_else(|| {
                let mut c = Contributors::none(rb.len(), n);
                for b in 0..rb.len() {
                    for k in 0..=s {
                        c.insert(b, (prev + n - k) % n);
                    }
                }
                c
            });
            let elems = layout.elems_of(&rb);
            let values = &mut tensor.as_bytes_mut()[elems.start * es..elems.end * es];
            let mut local = Partial {
                dtype,
                values,
                contributors: &mut sets,
                first_block: rb.start,
            };
            accumulate(
                &mut local,
                part.values.as_bytes(),
                &in_sets,
                &part.arrived,
                bb,
            )
            .map_err(|source| CollectiveError::Aggregate { peer: prev, source })?;
        }

        // This rank now owns chunk r + 1: finish it.
        let own = layout.chunk_blocks(n, (r + 1) % n);
        {
            let elems = layout.elems_of(&own);
            let values = &mut tensor.as_bytes_mut()[elems.start * es..elems.end * es];
            let mut local = Partial {
                dtype,
                values,
                contributors: &mut sets,
                first_block: own.start,
            };
            finish(&mut local, bb, opts.op, n);
        }

        // All-gather: pass the finished chunks around.
        for s in 0..n - 1 {
            let send_c = (r + 1 + n - s) % n;
            let recv_c = (r + n - s) % n;
            let rb = layout.chunk_blocks(n, recv_c);
            let step = RingStep {
                send: layout.chunk_blocks(n, send_c),
                recv: rb.clone(),
                send_x: xfer(KIND_GATHER, s, send_c, Stage::Pull),
                recv_x: xfer(KIND_GATHER, s, recv_c, Stage::Pull),
            };
            let (sent, got) =
                self.ring_step(tensor, &sets, &layout, &step, (next, prev), reliable, &cfg)?;
            bytes_sent += sent;
            let Some(mut part) = got else { continue };
            let in_sets = part
                .sets
                .take()
                .unwrap_or_else(|| Contributors::all(rb.len(), n));
            let elems = layout.elems_of(&rb);
            let values = &mut tensor.as_bytes_mut()[elems.start * es..elems.end * es];
            let mut local = Partial {
                dtype,
                values,
                contributors: &mut sets,
                first_block: rb.start,
            };
            adopt_or_finish(
                &mut local,
                part.values.as_bytes(),
                &in_sets,
                &part.arrived,
                bb,
                opts.op,
                n,
            )
            .map_err(|source| CollectiveError::Aggregate { peer: prev, source })?;
        }
        Ok(AllReduceReport::new(
            "ring",
            &layout,
            sets,
            started.elapsed(),
            bytes_sent,
        ))
    }

    /// One ring step: send the `send` blocks of `tensor` (with their sets unless reliable)
    /// to `next` while receiving the `recv` blocks from `prev`.
    #[allow(clippy::too_many_arguments)]
    fn ring_step(
        &mut self,
        tensor: &TensorMut<'_>,
        sets: &Contributors,
        layout: &BlockLayout,
        step: &RingStep,
        (next, prev): (usize, usize),
        reliable: bool,
        cfg: &TransferConfig,
    ) -> Result<(u64, Option<Part>), CollectiveError> {
        let (n, dtype) = (self.world(), tensor.dtype());
        let out_vals = slice_tensor(tensor, layout, &step.send);
        let out_sets = (!reliable).then(|| sets.encode(step.send.clone()));
        let (ol, il) = self.links.out_and_in(next, prev)?;
        let (sent, got) = std::thread::scope(|sc| {
            let h = sc.spawn(|| send_part(ol, &out_vals, out_sets.as_deref(), &step.send_x, cfg));
            let got = recv_part(
                il,
                dtype,
                layout,
                &step.recv,
                n,
                !reliable,
                false,
                &step.recv_x,
                cfg,
            );
            (h.join().map_err(|_| CollectiveError::ThreadPanicked), got)
        });
        Ok((sent??, got?))
    }

    fn tree_all_reduce(
        &mut self,
        tensor: &mut TensorMut<'_>,
        opts: &AllReduceOptions,
        tree: &Tree,
    ) -> Result<AllReduceReport, CollectiveError> {
        let started = Instant::now();
        let (n, r) = (self.world(), self.rank());
        let dtype = tensor.dtype();
        let es = dtype.elem_size();
        let round = self.next_round();
        if (0..n).any(|q| !tree.contains(q)) {
            return Err(CollectiveError::Config(format!(
                "the all-reduce tree must span all {n} ranks (it has {:?})",
                tree.members()
            )));
        }
        if n == 1 {
            let layout = BlockLayout::new(tensor.elems(), tensor.elems().max(1));
            let sets = Contributors::all(layout.blocks(), 1);
            return Ok(AllReduceReport::new(
                "tree",
                &layout,
                sets,
                started.elapsed(),
                0,
            ));
        }
        let parent = tree.parent(r);
        let children: Vec<usize> = tree.children(r).to_vec();
        let any_peer = parent.or(children.first().copied()).unwrap_or(0);
        let block_elems = self.block_elems(dtype, any_peer)?;
        let layout = BlockLayout::new(tensor.elems(), block_elems);
        let bb = block_elems * es;
        let bound = opts.loss_bound.unwrap_or(self.cfg.loss_bound);
        let reliable = bound == LossBound::RELIABLE;
        let chunks = layout.pipeline_chunks(self.cfg.pipeline_blocks);
        check_chunks(chunks.len())?;
        let cfg = self.cfg.transfer.clone();
        let job = self.job;
        let xfer = |kind, chunk, stage| Xfer {
            job,
            round,
            tensor: flow_tensor(kind, 0, chunk),
            bound,
            layer: opts.layer,
            dscp: opts.dscp,
            stage,
        };
        // With p = 0 the sets are known: a child's partial sums its whole subtree.
        let subtree_sets = |child: usize, blocks: usize| {
            let mut c = Contributors::none(blocks, n);
            let mut stack = vec![child];
            while let Some(q) = stack.pop() {
                for b in 0..blocks {
                    c.insert(b, q);
                }
                stack.extend_from_slice(tree.children(q));
            }
            c
        };

        let mut to: Vec<usize> = parent.into_iter().collect();
        to.extend(&children);
        let mut from = children.clone();
        from.extend(parent);
        let (outs, ins) = self.links.many(&to, &from)?;
        let mut outs = outs.into_iter();
        let mut ins = ins.into_iter();
        let up_out = if parent.is_some() { outs.next() } else { None };
        let down_outs: Vec<&mut OutLink> = outs.collect();
        let child_ins: Vec<&mut InLink> = ins.by_ref().take(children.len()).collect();
        let down_in = ins.next();

        let own_sets = Contributors::only(layout.blocks(), n, r);
        let input = tensor.as_bytes().to_vec();
        type Done = (Range<usize>, Vec<u8>, Contributors);
        let (results, sent): (Vec<Done>, u64) = std::thread::scope(|sc| {
            let mut handles = Vec::new();
            // Children's chunks in.
            let mut child_rx = Vec::new();
            for il in child_ins {
                let (tx, rx) = mpsc::sync_channel::<Part>(2);
                child_rx.push(rx);
                let chunks = &chunks;
                let layout = &layout;
                let cfg = &cfg;
                handles.push(sc.spawn(move || -> Result<u64, CollectiveError> {
                    for (k, blocks) in chunks.iter().enumerate() {
                        let x = xfer(KIND_UP, k, Stage::Push);
                        let part =
                            recv_part(il, dtype, layout, blocks, n, !reliable, false, &x, cfg)?
                                .ok_or(CollectiveError::Config("empty pipeline chunk".into()))?;
                        if tx.send(part).is_err() {
                            break;
                        }
                    }
                    Ok(0)
                }));
            }
            // Our partial sums up.
            let (up_tx, up_rx) = mpsc::sync_channel::<(Tensor, Option<Vec<u8>>)>(2);
            if let Some(ol) = up_out {
                let cfg = &cfg;
                handles.push(sc.spawn(move || -> Result<u64, CollectiveError> {
                    let mut sent = 0;
                    for (k, (vals, sets)) in up_rx.iter().enumerate() {
                        let x = xfer(KIND_UP, k, Stage::Push);
                        sent += send_part(ol, &vals, sets.as_deref(), &x, cfg)?;
                    }
                    Ok(sent)
                }));
            }
            // Finished chunks down to each child.
            let mut down_txs = Vec::new();
            for ol in down_outs {
                let (tx, rx) = mpsc::sync_channel::<(Tensor, Option<Vec<u8>>)>(2);
                down_txs.push(tx);
                let cfg = &cfg;
                handles.push(sc.spawn(move || -> Result<u64, CollectiveError> {
                    let mut sent = 0;
                    for (k, (vals, sets)) in rx.iter().enumerate() {
                        let x = xfer(KIND_DOWN, k, Stage::Pull);
                        sent += send_part(ol, &vals, sets.as_deref(), &x, cfg)?;
                    }
                    Ok(sent)
                }));
            }
            // Results from the parent, applied to our partials (lost blocks: our own
            // subtree's average), then forwarded.
            let (partial_tx, partial_rx) = mpsc::sync_channel::<(Vec<u8>, Contributors)>(2);
            let (done_tx, done_rx) = mpsc::channel::<(Range<usize>, Vec<u8>, Contributors)>();
            {
                let chunks = &chunks;
                let layout = &layout;
                let cfg = &cfg;
                let op = opts.op;
                handles.push(sc.spawn(move || -> Result<u64, CollectiveError> {
                    let mut down_in = down_in;
                    'chunks: for (k, blocks) in chunks.iter().enumerate() {
                        let Ok((mut vals, mut csets)) = partial_rx.recv() else {
                            break;
                        };
                        let mut local = Partial {
                            dtype,
                            values: &mut vals,
                            contributors: &mut csets,
                            first_block: 0,
                        };
                        match down_in.as_deref_mut() {
                            Some(il) => {
                                let x = xfer(KIND_DOWN, k, Stage::Pull);
                                let mut part = recv_part(
                                    il, dtype, layout, blocks, n, !reliable, false, &x, cfg,
                                )?
                                .ok_or(CollectiveError::Config("empty pipeline chunk".into()))?;
                                let in_sets = part
                                    .sets
                                    .take()
                                    .unwrap_or_else(|| Contributors::all(blocks.len(), n));
                                adopt_or_finish(
                                    &mut local,
                                    part.values.as_bytes(),
                                    &in_sets,
                                    &part.arrived,
                                    bb,
                                    op,
                                    n,
                                )
                                .map_err(|source| {
                                    CollectiveError::Aggregate {
                                        peer: parent.unwrap_or(0),
                                        source,
                                    }
                                })?;
                            }
                            None => finish(&mut local, bb, op, n),
                        }
                        // A child's sender that is gone failed (its thread reports why): stop
                        // feeding every child, so none gets a later chunk under this one's id.
                        let s = (!reliable).then(|| csets.encode(0..blocks.len()));
                        for tx in &down_txs {
                            if tx.send((tensor_of(dtype, &vals), s.clone())).is_err() {
                                break 'chunks;
                            }
                        }
                        if done_tx.send((blocks.clone(), vals, csets)).is_err() {
                            break;
                        }
                    }
                    Ok(0)
                }));
            }
            // The aggregation itself, chunk by chunk, on this thread.
            let mut main_err = None;
            for blocks in &chunks {
                let elems = layout.elems_of(blocks);
                let mut vals = input[elems.start * es..elems.end * es].to_vec();
                let mut csets = Contributors::none(blocks.len(), n);
                for b in 0..blocks.len() {
                    csets.unite(b, &own_sets, blocks.start + b);
                }
                let mut failed = false;
                for (rx, &c) in child_rx.iter().zip(&children) {
                    let Ok(mut part) = rx.recv() else {
                        failed = true;
                        break;
                    };
                    let in_sets = part
                        .sets
                        .take()
                        .unwrap_or_else(|| subtree_sets(c, blocks.len()));
                    let mut local = Partial {
                        dtype,
                        values: &mut vals,
                        contributors: &mut csets,
                        first_block: 0,
                    };
                    if let Err(source) = accumulate(
                        &mut local,
                        part.values.as_bytes(),
                        &in_sets,
                        &part.arrived,
                        bb,
                    ) {
                        main_err = Some(CollectiveError::Aggregate { peer: c, source });
                        failed = true;
                        break;
                    }
                }
                if failed {
                    break;
                }
                if parent.is_some() {
                    let s = (!reliable).then(|| csets.encode(0..blocks.len()));
                    if up_tx.send((tensor_of(dtype, &vals), s)).is_err() {
                        break;
                    }
                }
                if partial_tx.send((vals, csets)).is_err() {
                    break;
                }
            }
            drop(up_tx);
            drop(partial_tx);
            drop(child_rx);
            let results: Vec<_> = done_rx.iter().collect();
            let mut first_err = main_err;
            let mut sent = 0;
            for h in handles {
                match h.join() {
                    Ok(Ok(b)) => sent += b,
                    Ok(Err(e)) => {
                        first_err.get_or_insert(e);
                    }
                    Err(_) => {
                        first_err.get_or_insert(CollectiveError::ThreadPanicked);
                    }
                }
            }
            match first_err {
                Some(e) => Err(e),
                None => Ok((results, sent)),
            }
        })?;
        if results.len() != chunks.len() {
            return Err(CollectiveError::Config(
                "tree all-reduce ended early without an error (a bug: please report it)".into(),
            ));
        }
        let mut sets = Contributors::none(layout.blocks(), n);
        let out = tensor.as_bytes_mut();
        for (blocks, vals, csets) in results {
            let elems = layout.elems_of(&blocks);
            out[elems.start * es..elems.end * es].copy_from_slice(&vals);
            for b in 0..blocks.len() {
                sets.assign(blocks.start + b, &csets, b);
            }
        }
        Ok(AllReduceReport::new(
            "tree",
            &layout,
            sets,
            started.elapsed(),
            sent,
        ))
    }

    /// Broadcast `tensor` from `root` to every rank, pipelined along the ring in chunks.
    /// With a loss bound, blocks that did not arrive keep their previous contents here and
    /// are reported; a rank never forwards a block it does not hold.
    pub fn broadcast<'t>(
        &mut self,
        tensor: impl Into<TensorMut<'t>>,
        root: usize,
        loss_bound: Option<LossBound>,
    ) -> Result<BroadcastReport, CollectiveError> {
        let tensor = &mut tensor.into();
        self.usable()?;
        let r = self.broadcast_inner(tensor, root, loss_bound);
        self.note(r)
    }

    fn broadcast_inner(
        &mut self,
        tensor: &mut TensorMut<'_>,
        root: usize,
        loss_bound: Option<LossBound>,
    ) -> Result<BroadcastReport, CollectiveError> {
        let started = Instant::now();
        let (n, r) = (self.world(), self.rank());
        if root >= n {
            return Err(CollectiveError::Config(format!(
                "broadcast root {root} is not a rank of this {n}-rank job"
            )));
        }
        let round = self.next_round();
        let dtype = tensor.dtype();
        let es = dtype.elem_size();
        if n == 1 {
            return Ok(BroadcastReport {
                blocks: 1,
                received_blocks: 1,
                block_elems: tensor.elems(),
                arrived: vec![true],
                elapsed: started.elapsed(),
            });
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let block_elems = self.block_elems(dtype, next)?;
        let layout = BlockLayout::new(tensor.elems(), block_elems);
        let bb = block_elems * es;
        let bound = loss_bound.unwrap_or(self.cfg.loss_bound);
        let reliable = bound == LossBound::RELIABLE;
        let chunks = layout.pipeline_chunks(self.cfg.pipeline_blocks);
        check_chunks(chunks.len())?;
        let cfg = self.cfg.transfer.clone();
        let job = self.job;
        let xfer = |chunk| Xfer {
            job,
            round,
            tensor: flow_tensor(KIND_BCAST, 0, chunk),
            bound,
            layer: 0,
            dscp: 0,
            stage: Stage::Pull,
        };
        let is_last = next == root;
        let mut arrived_all = vec![true; layout.blocks()];
        let (ol, il) = self.links.out_and_in(next, prev)?;
        let ol = (!is_last).then_some(ol);
        let il = (r != root).then_some(il);
        let data = tensor.as_bytes_mut();
        let outcome = std::thread::scope(|sc| -> Result<(), CollectiveError> {
            let (tx, rx) = mpsc::sync_channel::<(Tensor, Option<Vec<u8>>)>(2);
            let sender = ol.map(|ol| {
                let cfg = &cfg;
                sc.spawn(move || -> Result<u64, CollectiveError> {
                    let mut sent = 0;
                    for (k, (vals, sets)) in rx.iter().enumerate() {
                        sent += send_part(ol, &vals, sets.as_deref(), &xfer(k), cfg)?;
                    }
                    Ok(sent)
                })
            });
            let mut result = Ok(());
            let mut il = il;
            for (k, blocks) in chunks.iter().enumerate() {
                let elems = layout.elems_of(blocks);
                let here = &mut data[elems.start * es..elems.end * es];
                // "Held" sets: {root} for a block this rank holds, empty otherwise.
                let mut held = Contributors::none(blocks.len(), n);
                match il.as_deref_mut() {
                    None => {
                        for b in 0..blocks.len() {
                            held.insert(b, root);
                        }
                    }
                    Some(il) => {
                        let part = match recv_part(
                            il,
                            dtype,
                            &layout,
                            blocks,
                            n,
                            !reliable,
                            true,
                            &xfer(k),
                            &cfg,
                        ) {
                            Ok(Some(p)) => p,
                            Ok(None) => continue,
                            Err(e) => {
                                result = Err(e);
                                break;
                            }
                        };
                        let in_sets = part.sets.unwrap_or_else(|| {
                            let mut c = Contributors::none(blocks.len(), n);
                            for b in 0..blocks.len() {
                                c.insert(b, root);
                            }
                            c
                        });
                        for (b, (dst, src)) in here
                            .chunks_mut(bb)
                            .zip(part.values.as_bytes().chunks(bb))
                            .enumerate()
                        {
                            if part.arrived[b] && in_sets.contains(b, root) {
                                dst.copy_from_slice(src);
                                held.insert(b, root);
                            } else {
                                arrived_all[blocks.start + b] = false;
                            }
                        }
                    }
                }
                if sender.is_some() {
                    let s = (!reliable).then(|| held.encode(0..blocks.len()));
                    if tx.send((tensor_of(dtype, here), s)).is_err() {
                        break;
                    }
                }
            }
            drop(tx);
            if let Some(h) = sender {
                let sent = h.join().map_err(|_| CollectiveError::ThreadPanicked)?;
                result = result.and(sent.map(|_| ()));
            }
            result
        });
        outcome?;
        Ok(BroadcastReport {
            blocks: layout.blocks(),
            block_elems,
            received_blocks: arrived_all.iter().filter(|&&a| a).count(),
            arrived: arrived_all,
            elapsed: started.elapsed(),
        })
    }

    /// DLCP's send of one tensor to `peer` (the communicator must have a link to it), each
    /// segment tagged by `prio`. Both ends must send and receive their point-to-point
    /// transfers in the same order per pair.
    pub fn send(
        &mut self,
        peer: usize,
        tensor: &Tensor,
        opts: &P2pOptions,
        prio: &PriorityFn<'_>,
    ) -> Result<SendReport, CollectiveError> {
        self.usable()?;
        self.links.out(peer)?;
        let x = self.p2p_xfer(peer, opts, true)?;
        let cfg = self.cfg.transfer.clone();
        let r = self.links.out(peer).and_then(|l| {
            l.send(tensor, &x.send_opts(), prio, &cfg)
                .map_err(CollectiveError::link(peer))
        });
        self.note(r)
    }

    /// Receive one tensor from `peer` into `tensor` (the sender's size and type). Segments
    /// still missing when the loss bound is met are zero; the report says which.
    pub fn recv(
        &mut self,
        peer: usize,
        tensor: &mut Tensor,
        opts: &P2pOptions,
    ) -> Result<RecvReport, CollectiveError> {
        self.usable()?;
        self.links.inn(peer)?;
        let x = self.p2p_xfer(peer, opts, false)?;
        let cfg = self.cfg.transfer.clone();
        let r = self.links.inn(peer).and_then(|l| {
            l.recv(tensor, &x.recv_opts(), &cfg)
                .map_err(CollectiveError::link(peer))
        });
        self.note(r)
    }

    /// The identity of the next point-to-point transfer with `peer` in one direction.
    fn p2p_xfer(
        &mut self,
        peer: usize,
        opts: &P2pOptions,
        sending: bool,
    ) -> Result<Xfer, CollectiveError> {
        if peer >= self.world() || peer == self.rank() {
            return Err(CollectiveError::Config(format!(
                "rank {peer} is not another rank of this {}-rank job",
                self.world()
            )));
        }
        if opts.tensor > MAX_P2P_TENSOR {
            return Err(CollectiveError::Config(format!(
                "tensor id {} is above {MAX_P2P_TENSOR}",
                opts.tensor
            )));
        }
        let counter = if sending {
            &mut self.p2p_sent[peer]
        } else {
            &mut self.p2p_received[peer]
        };
        let round = *counter;
        *counter = counter.wrapping_add(1);
        Ok(Xfer {
            job: self.job,
            round,
            tensor: (KIND_P2P << 27) | opts.tensor,
            bound: opts.loss_bound.unwrap_or(self.cfg.loss_bound),
            layer: opts.layer,
            dscp: 0,
            stage: Stage::Push,
        })
    }

    /// Wait until every rank has entered the barrier: a reliable token goes around the ring
    /// twice (the first lap proves everyone arrived, the second releases everyone).
    pub fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.usable()?;
        let r = self.barrier_inner();
        self.note(r)
    }

    fn barrier_inner(&mut self) -> Result<(), CollectiveError> {
        let (n, r) = (self.world(), self.rank());
        let round = self.next_round();
        if n == 1 {
            return Ok(());
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let cfg = self.cfg.transfer.clone();
        let x = |lap| Xfer {
            job: self.job,
            round,
            tensor: flow_tensor(KIND_BARRIER, lap, 0),
            bound: LossBound::RELIABLE,
            layer: 0,
            dscp: 0,
            stage: Stage::Push,
        };
        let token = Tensor::from_f32(&[1.0]);
        let layout = BlockLayout::new(1, 1);
        let pass_on = |links: &mut Links, lap: usize| -> Result<(), CollectiveError> {
            let prio = fixed_priority(Tag {
                dscp: 0,
                ect: false,
            });
            links
                .out(next)?
                .send(&token, &x(lap).send_opts(), &prio, &cfg)
                .map_err(CollectiveError::link(next))?;
            Ok(())
        };
        let wait_for = |links: &mut Links, lap: usize| -> Result<(), CollectiveError> {
            let inn = links.inn(prev)?;
            recv_part(
                inn,
                DType::F32,
                &layout,
                &(0..1),
                n,
                false,
                false,
                &x(lap),
                &cfg,
            )?;
            Ok(())
        };
        for lap in 0..2 {
            // Rank 0 starts each lap and ends it by receiving the token back (the second
            // lap stops at the last rank: everyone has been released by then).
            if r == 0 {
                pass_on(&mut self.links, lap)?;
                if lap == 0 {
                    wait_for(&mut self.links, lap)?;
                }
            } else {
                wait_for(&mut self.links, lap)?;
                if lap == 0 || next != 0 {
                    pass_on(&mut self.links, lap)?;
                }
            }
        }
        Ok(())
    }
}

impl Xfer {
    fn send_opts(&self) -> SendOptions {
        SendOptions {
            job: self.job,
            tensor: self.tensor,
            round: self.round,
            layer: self.layer,
            stage: self.stage,
            loss_bound: Some(self.bound),
        }
    }

    fn recv_opts(&self) -> RecvOptions {
        RecvOptions {
            job: self.job,
            tensor: self.tensor,
            round: Some(self.round),
            loss_bound: Some(self.bound),
            fill: MissingFill::Zero,
            max_bytes: None,
        }
    }

    fn sets(&self) -> Xfer {
        Xfer {
            tensor: self.tensor | SETS_BIT,
            bound: LossBound::RELIABLE,
            ..*self
        }
    }
}

/// A flow id has 16 bits for the chunk: more chunks per operation would reuse ids.
fn check_chunks(chunks: usize) -> Result<(), CollectiveError> {
    if chunks > 0xffff {
        return Err(CollectiveError::Config(format!(
            "{chunks} pipeline chunks: at most 65535 per operation (raise pipeline_blocks or block_elems)"
        )));
    }
    Ok(())
}

fn tensor_of(dtype: DType, bytes: &[u8]) -> Tensor {
    let mut t = Tensor::zeros(dtype, bytes.len() / dtype.elem_size());
    t.as_bytes_mut().copy_from_slice(bytes);
    t
}

fn slice_tensor(t: &TensorMut<'_>, layout: &BlockLayout, blocks: &Range<usize>) -> Tensor {
    let es = t.dtype().elem_size();
    let e = layout.elems_of(blocks);
    tensor_of(t.dtype(), &t.as_bytes()[e.start * es..e.end * es])
}

/// Send a chunk (nothing for an empty one) and, when given, its contributor sets.
fn send_part(
    link: &mut OutLink,
    values: &Tensor,
    sets: Option<&[u8]>,
    x: &Xfer,
    cfg: &TransferConfig,
) -> Result<u64, CollectiveError> {
    if values.elems() == 0 {
        return Ok(0);
    }
    let peer = link.peer();
    let prio = fixed_priority(Tag {
        dscp: x.dscp,
        ect: true,
    });
    let report = link
        .send(values, &x.send_opts(), &prio, cfg)
        .map_err(CollectiveError::link(peer))?;
    let mut sent = report.stats.payload_bytes;
    if let Some(sets) = sets {
        let mut t = Tensor::zeros(DType::Raw, sets.len());
        t.as_bytes_mut().copy_from_slice(sets);
        let r = link
            .send(&t, &x.sets().send_opts(), &prio, cfg)
            .map_err(CollectiveError::link(peer))?;
        sent += r.stats.payload_bytes;
    }
    Ok(sent)
}

/// Receive the chunk of `blocks` (`None` for an empty one) and, when `with_sets`, its
/// contributor sets; which blocks arrived whole comes from the transport's report.
#[allow(clippy::too_many_arguments)]
fn recv_part(
    link: &mut InLink,
    dtype: DType,
    layout: &BlockLayout,
    blocks: &Range<usize>,
    world: usize,
    with_sets: bool,
    allow_empty_sets: bool,
    x: &Xfer,
    cfg: &TransferConfig,
) -> Result<Option<Part>, CollectiveError> {
    let elems = layout.elems_of(blocks);
    if elems.is_empty() {
        return Ok(None);
    }
    let peer = link.peer();
    let mut values = Tensor::zeros(dtype, elems.len());
    let report = link
        .recv(&mut values, &x.recv_opts(), cfg)
        .map_err(CollectiveError::link(peer))?;
    let bb = layout.block_elems() * dtype.elem_size();
    let arrived = arrived_blocks(&report.missing_byte_ranges(), bb, blocks.len());
    let sets = if with_sets {
        let probe = Contributors::none(1, world);
        let mut t = Tensor::zeros(DType::Raw, blocks.len() * probe.encoded_block_len());
        link.recv(&mut t, &x.sets().recv_opts(), cfg)
            .map_err(CollectiveError::link(peer))?;
        Some(
            Contributors::decode(t.as_bytes(), blocks.len(), world, allow_empty_sets)
                .map_err(|source| CollectiveError::Aggregate { peer, source })?,
        )
    } else {
        None
    };
    Ok(Some(Part {
        values,
        sets,
        arrived,
    }))
}
