//! Operations started without waiting: each `start_` call returns a [`Work`] at once, and
//! several run together on the message layer's progress thread (a training framework's
//! asynchronous collectives: several DDP buckets in flight, communication overlapping the
//! backward pass).
//!
//! A started operation works on a [`Region`]: owned bytes, or the caller's memory lent with
//! [`Region::borrowed`]. Lent memory must stay valid and untouched until the `Work` is waited
//! for or dropped; dropping an unfinished `Work` cancels the operation and waits for it, so
//! that is always enough.
//!
//! Ranks must start the same operations in the same order (the message numbers of the
//! ranks follow that order), as with the blocking calls.

use std::time::Instant;

use gradwire::tagging::DlcpTagger;
use gradwire_collective::aggregate::Contributors;
use gradwire_collective::algo::bcast::BroadcastOutcome;
use gradwire_collective::algo::ReduceOutcome;
use gradwire_collective::group::{self, Group, GroupReduceOptions};
use gradwire_msg::core::RecvReport;
use gradwire_msg::p2p::SendDone;

pub use gradwire_msg::mem::Region;

use crate::{
    data_dscp, loss_bound, BroadcastReport, DType, P2pOptions, PriorityFn, RecvSummary,
    ReduceOptions, ReduceReport, SendSummary, Session, SessionError,
};

/// What a started operation ended with.
#[derive(Debug)]
pub enum Outcome {
    /// An all-reduce or reduce-scatter.
    Reduced(ReduceReport),
    /// A broadcast.
    Broadcast(BroadcastReport),
    /// An all-gather or a barrier.
    Done,
    /// A send.
    Sent(SendSummary),
    /// A receive.
    Received(RecvSummary),
}

/// A started operation: test it, or wait for its [`Outcome`] (see the module doc for the
/// memory it was given).
#[derive(Debug)]
#[must_use = "dropping a Work cancels its operation"]
pub struct Work {
    pending: Pending,
    started: Instant,
}

#[derive(Debug)]
enum Pending {
    Reduce {
        work: group::Work<ReduceOutcome>,
        dtype: DType,
        elems: usize,
        world: usize,
        block_bytes: usize,
    },
    Gather(group::Work<ReduceOutcome>),
    Broadcast {
        work: group::Work<BroadcastOutcome>,
        block_elems: usize,
    },
    Barrier(group::Work<()>),
    Send {
        work: group::Work<SendDone>,
        segments: u32,
        bytes: u64,
    },
    Recv {
        work: group::Work<(Option<Region>, RecvReport)>,
        peer: usize,
        tensor: u32,
        loss_bound: f64,
        seg: usize,
    },
}

impl Work {
    fn new(pending: Pending) -> Work {
        Work {
            pending,
            started: Instant::now(),
        }
    }

    /// Whether the operation has completed.
    pub fn test(&self) -> bool {
        match &self.pending {
            Pending::Reduce { work, .. } | Pending::Gather(work) => work.test(),
            Pending::Broadcast { work, .. } => work.test(),
            Pending::Barrier(work) => work.test(),
            Pending::Send { work, .. } => work.test(),
            Pending::Recv { work, .. } => work.test(),
        }
    }

    /// Runs `f` when the operation completes (now if it has), on the progress thread, with
    /// whether it succeeded: keep it quick (wake a waiter), and do not wait on the session.
    pub fn on_complete(&self, f: impl FnOnce(bool) + Send + 'static) {
        match &self.pending {
            Pending::Reduce { work, .. } | Pending::Gather(work) => work.on_complete(f),
            Pending::Broadcast { work, .. } => work.on_complete(f),
            Pending::Barrier(work) => work.on_complete(f),
            Pending::Send { work, .. } => work.on_complete(f),
            Pending::Recv { work, .. } => work.on_complete(f),
        }
    }

    /// Waits for the outcome (at most the session's timeout from the start).
    pub fn wait(self) -> Result<Outcome, SessionError> {
        let elapsed = |t: Instant| t.elapsed().as_secs_f64();
        Ok(match self.pending {
            Pending::Reduce {
                work,
                dtype,
                elems,
                world,
                block_bytes,
            } => Outcome::Reduced(reduce_report(
                work.wait()?,
                dtype,
                elems,
                world,
                block_bytes,
            )),
            Pending::Gather(work) => {
                work.wait()?;
                Outcome::Done
            }
            Pending::Broadcast { work, block_elems } => {
                let received = work.wait()?.received;
                Outcome::Broadcast(BroadcastReport {
                    blocks: received.len(),
                    received_blocks: received.iter().filter(|&&r| r).count(),
                    block_elems,
                    block_received: received,
                    elapsed_s: elapsed(self.started),
                })
            }
            Pending::Barrier(work) => {
                work.wait()?;
                Outcome::Done
            }
            Pending::Send {
                work,
                segments,
                bytes,
            } => Outcome::Sent(send_summary(work.wait()?, segments, bytes, self.started)),
            Pending::Recv {
                work,
                peer,
                tensor,
                loss_bound,
                seg,
            } => {
                let (mut region, r) = work.wait_tensor(peer, tensor)?;
                let len = region.as_ref().map_or(0, Region::len);
                let summary = recv_summary(&r, len, seg, loss_bound, elapsed(self.started));
                if let Some(region) = &mut region {
                    zero_missing(region.as_mut_slice(), &summary.missing);
                }
                Outcome::Received(summary)
            }
        })
    }
}

/// A send's summary (`segments` of `bytes`, started at `started`).
pub(crate) fn send_summary(
    done: SendDone,
    segments: u32,
    bytes: u64,
    started: Instant,
) -> SendSummary {
    SendSummary {
        segments,
        bytes,
        // Segments beyond one of each: this message's own resends and probes.
        retransmitted_segments: u64::from(done.segments).saturating_sub(u64::from(segments)),
        elapsed_s: started.elapsed().as_secs_f64(),
        final_rate_bps: 0,
    }
}

/// A reduction's report from its outcome.
pub(crate) fn reduce_report(
    r: ReduceOutcome,
    dtype: DType,
    elems: usize,
    world: usize,
    block_bytes: usize,
) -> ReduceReport {
    let contributors = r
        .contributors
        .unwrap_or_else(|| Contributors::all(r.blocks, world));
    let block_delivered: Vec<f64> = (0..r.blocks)
        .map(|b| contributors.count(b) as f64 / world.max(1) as f64)
        .collect();
    let delivered_fraction = if r.blocks == 0 {
        1.0
    } else {
        block_delivered.iter().sum::<f64>() / r.blocks as f64
    };
    let rank_delivered = (0..world)
        .map(|q| {
            if r.blocks == 0 {
                1.0
            } else {
                (0..r.blocks)
                    .filter(|&b| contributors.contains(b, q))
                    .count() as f64
                    / r.blocks as f64
            }
        })
        .collect();
    ReduceReport {
        elems,
        blocks: r.blocks,
        block_elems: block_bytes / dtype.elem_size(),
        complete_blocks: r.complete_blocks,
        delivered_fraction,
        rank_delivered,
        block_delivered,
        elapsed_s: r.elapsed.as_secs_f64(),
        bytes_sent: r.segments_sent * block_bytes as u64,
        contributors,
    }
}

/// A receive's summary from its report (`len` bytes, `seg` per segment).
pub(crate) fn recv_summary(
    r: &RecvReport,
    len: usize,
    seg: usize,
    loss_bound: f64,
    elapsed_s: f64,
) -> RecvSummary {
    let missing = (0..r.segments as usize)
        .filter(|&s| !r.has(s))
        .map(|s| ((s * seg) as u64, seg.min(len.saturating_sub(s * seg))))
        .collect();
    let received = r.segments - r.missing;
    RecvSummary {
        missing,
        segments: r.segments,
        received_segments: received,
        delivered_fraction: f64::from(received) / f64::from(r.segments.max(1)),
        loss_bound,
        rounds: r.passes.saturating_sub(1),
        elapsed_s,
    }
}

/// Zeroes the ranges that did not arrive, as the flow transport leaves them.
pub(crate) fn zero_missing(bytes: &mut [u8], missing: &[(u64, usize)]) {
    for &(at, len) in missing {
        let at = at as usize;
        if let Some(b) = bytes.get_mut(at..at.saturating_add(len).min(bytes.len())) {
            b.fill(0);
        }
    }
}

impl Session {
    /// The message layer's group, which started operations need.
    fn layer(&self) -> Result<&Group, SessionError> {
        self.group.as_ref().ok_or_else(|| {
            SessionError::InvalidArgument(
                "operations started without waiting need the message layer, and this session \
                 runs on the flow transport (message_layer off): use the \
                 blocking calls, or turn the message layer on"
                    .into(),
            )
        })
    }

    /// Bytes per block (one segment's payload): the unit of a reduction's loss telemetry and
    /// of the chunks of reduce-scatter and all-gather ([`Session::chunk`]).
    pub fn block_bytes(&self) -> Result<usize, SessionError> {
        Ok(self.layer()?.block_bytes())
    }

    /// The byte range of rank `c`'s chunk of a `len`-byte tensor in
    /// [`Session::start_reduce_scatter`] and [`Session::start_all_gather`] (whole blocks:
    /// a tensor of `world * k * block_bytes()` bytes has chunks of `k` blocks).
    pub fn chunk(&self, len: usize, c: usize) -> Result<std::ops::Range<usize>, SessionError> {
        Ok(self.layer()?.chunk(len, c))
    }

    pub(crate) fn group_options(
        &self,
        o: &ReduceOptions,
    ) -> Result<GroupReduceOptions, SessionError> {
        let bound = o.loss_bound.unwrap_or(self.cfg.loss_bound);
        loss_bound(bound)?;
        Ok(GroupReduceOptions {
            op: o.op,
            loss_bound: bound,
            algorithm: o.algorithm,
            dscp: data_dscp(o)?,
            layer: o.layer,
            step_deadline: o.step_deadline,
            ranges: o.ranges.clone(),
            tagging: o.tagging,
            verify_results: o.verify_results,
        })
    }

    /// Starts an all-reduce of `region` (elements of `dtype`) in place.
    pub fn start_all_reduce(
        &self,
        dtype: DType,
        region: Region,
        opts: &ReduceOptions,
    ) -> Result<Work, SessionError> {
        self.start_reduction(dtype, region, opts, Group::start_all_reduce)
    }

    /// Starts a reduce-scatter of `region` in place: this rank's chunk
    /// ([`Session::chunk`]) ends with the reduction of every rank's chunk at that place.
    pub fn start_reduce_scatter(
        &self,
        dtype: DType,
        region: Region,
        opts: &ReduceOptions,
    ) -> Result<Work, SessionError> {
        self.start_reduction(dtype, region, opts, Group::start_reduce_scatter)
    }

    fn start_reduction(
        &self,
        dtype: DType,
        region: Region,
        opts: &ReduceOptions,
        start: impl FnOnce(
            &Group,
            DType,
            Region,
            &GroupReduceOptions,
        ) -> Result<
            group::Work<ReduceOutcome>,
            gradwire_collective::error::CollectiveError,
        >,
    ) -> Result<Work, SessionError> {
        let g = self.layer()?;
        float_dtype(dtype)?;
        let elems = region.len() / dtype.elem_size();
        let work = start(g, dtype, region, &self.group_options(opts)?)?;
        Ok(Work::new(Pending::Reduce {
            work,
            dtype,
            elems,
            world: self.cfg.world,
            block_bytes: g.block_bytes(),
        }))
    }

    /// Starts an all-gather of `region` in place: rank r's chunk ([`Session::chunk`]),
    /// filled by rank r, reaches every rank. Reliable; any bytes.
    pub fn start_all_gather(&self, region: Region) -> Result<Work, SessionError> {
        Ok(Work::new(Pending::Gather(
            self.layer()?.start_all_gather(region)?,
        )))
    }

    /// Starts a broadcast of `region` from `root` under the options' loss bound (the
    /// session's when `None`). Any bytes: `dtype` only sets the report's block size.
    pub fn start_broadcast(
        &self,
        root: usize,
        dtype: DType,
        region: Region,
        opts: &ReduceOptions,
    ) -> Result<Work, SessionError> {
        let g = self.layer()?;
        let bound = opts.loss_bound.unwrap_or(self.cfg.loss_bound);
        loss_bound(bound)?;
        let work = g.start_broadcast(region, root, bound)?;
        Ok(Work::new(Pending::Broadcast {
            work,
            block_elems: g.block_bytes() / dtype.elem_size(),
        }))
    }

    /// Starts a barrier.
    pub fn start_barrier(&self) -> Result<Work, SessionError> {
        Ok(Work::new(Pending::Barrier(self.layer()?.start_barrier()?)))
    }

    /// Starts DLCP's send of `region` to `peer`, each segment tagged by `priority` (`None`:
    /// the layer's DSCP, ECN-capable by gradient magnitude for float data).
    pub fn start_send(
        &self,
        peer: usize,
        dtype: DType,
        region: Region,
        opts: &P2pOptions,
        priority: Option<&PriorityFn<'_>>,
    ) -> Result<Work, SessionError> {
        let (work, segments, bytes) = self.post_send(peer, dtype, region, opts, priority)?;
        Ok(Work::new(Pending::Send {
            work,
            segments,
            bytes,
        }))
    }

    /// The send of `region` on the layer, tagged (the blocking `send` waits for it): its
    /// work, its segments and its length.
    pub(crate) fn post_send(
        &self,
        peer: usize,
        dtype: DType,
        region: Region,
        opts: &P2pOptions,
        priority: Option<&PriorityFn<'_>>,
    ) -> Result<(group::Work<SendDone>, u32, u64), SessionError> {
        let g = self.layer()?;
        self.check_peer(peer)?;
        check_tensor_id(opts.tensor)?;
        let bytes = region.as_slice();
        crate::whole_elems(dtype, bytes.len())?;
        let seg = g.block_bytes();
        let tags = match priority {
            Some(f) => gradwire::flow::tos_per_segment(bytes, seg, opts.layer, dtype, f),
            None => {
                // DLCP's default: the layer's DSCP, ECN-capable when its gradients are large.
                let tagger = DlcpTagger {
                    dscp: data_dscp(&ReduceOptions {
                        layer: opts.layer,
                        num_layers: opts.num_layers,
                        ..ReduceOptions::default()
                    })?,
                    threshold: gradwire::tagging::magnitude_threshold_of(
                        bytes,
                        dtype,
                        &gradwire::tagging::MagnitudeConfig::default(),
                    ),
                };
                gradwire::flow::tos_per_segment(
                    bytes,
                    seg,
                    opts.layer,
                    dtype,
                    &tagger.priority_fn(),
                )
            }
        };
        let (segments, len) = (bytes.len().div_ceil(seg).max(1) as u32, bytes.len() as u64);
        Ok((
            g.start_send(peer, region, opts.tensor, tags)?,
            segments,
            len,
        ))
    }

    /// Starts a receive of tensor `opts.tensor` from `peer` into `region` (the sender's
    /// length) under the options' loss bound; segments that did not arrive are zero.
    pub fn start_recv(
        &self,
        peer: usize,
        region: Region,
        opts: &P2pOptions,
    ) -> Result<Work, SessionError> {
        let g = self.layer()?;
        self.check_peer(peer)?;
        check_tensor_id(opts.tensor)?;
        let bound = opts.loss_bound.unwrap_or(self.cfg.loss_bound);
        loss_bound(bound)?;
        let work = g.start_recv(peer, region, bound)?;
        Ok(Work::new(Pending::Recv {
            work,
            peer,
            tensor: opts.tensor,
            loss_bound: bound,
            seg: g.block_bytes(),
        }))
    }
}

fn float_dtype(dtype: DType) -> Result<(), SessionError> {
    if dtype == DType::Raw {
        return Err(SessionError::InvalidArgument(
            "a reduction needs f32, f16 or bf16 elements, not raw bytes".into(),
        ));
    }
    Ok(())
}

fn check_tensor_id(tensor: u32) -> Result<(), SessionError> {
    if tensor > crate::MAX_P2P_TENSOR {
        return Err(SessionError::InvalidArgument(format!(
            "tensor id {tensor} is above {}",
            crate::MAX_P2P_TENSOR
        )));
    }
    Ok(())
}
