//! What every all-reduce algorithm holds and does alike: its region until it starts, the
//! registered buffer, the block layout and contributor sets, the messages still outstanding,
//! the step reports and the start time. An algorithm keeps only its own message plan.

use std::time::Instant;

use gradwire::flow::tos_per_segment;
use gradwire::tagging::DlcpTagger;
use gradwire_msg::core::{Place, RecvOpts, RecvReport};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{OpCx, OpError, Step};

use super::{
    check_spec, outcome, ranges_within, step_bound, Chunks, Masks, ReduceOutcome, ReduceSpec,
    StepReport,
};

/// The state shared by ring, direct and tree all-reduce.
#[derive(Debug)]
pub(crate) struct Reduction {
    pub(crate) spec: ReduceSpec,
    region: Option<Region>,
    buf: Option<BufId>,
    /// Blocks of the tensor, in `world` chunks (ring, direct) or one (tree).
    pub(crate) chunks: Chunks,
    /// Who is summed in each block, kept only under a loss bound.
    pub(crate) masks: Option<Masks>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) sends_left: usize,
    /// Data segments sent so far, resends included.
    segments_sent: u64,
    pub(crate) recvs_left: usize,
    pub(crate) steps: Vec<StepReport>,
    started: Option<Instant>,
    /// When the current reduce-scatter step could start.
    step_started: Option<Instant>,
    /// DLCP's tagger of the lossy steps (the layer's DSCP, ECT above the tensor's magnitude
    /// threshold), when they are tagged.
    tagger: Option<DlcpTagger>,
}

impl Reduction {
    pub(crate) fn new(region: Region, spec: ReduceSpec) -> Reduction {
        Reduction {
            spec,
            region: Some(region),
            buf: None,
            chunks: Chunks::new(0, 1, 1),
            masks: None,
            rank: 0,
            world: 1,
            sends_left: 0,
            segments_sent: 0,
            recvs_left: 0,
            steps: Vec::new(),
            started: None,
            step_started: None,
            tagger: None,
        }
    }

    /// Starts the operation: notes the time, learns rank and world, checks the spec against
    /// the region, lays its blocks out in one chunk per rank (`per_rank`) or one chunk, and
    /// registers it. Returns the buffer.
    pub(crate) fn begin(&mut self, cx: &mut OpCx<'_>, per_rank: bool) -> Result<BufId, OpError> {
        self.started = Some(cx.now());
        self.step_started = self.started;
        self.rank = usize::from(cx.rank());
        self.world = usize::from(cx.world());
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        check_spec(&self.spec, region.len(), self.world).map_err(OpError::Invalid)?;
        let parts = if per_rank { self.world } else { 1 };
        self.chunks = Chunks::new(region.len(), cx.seg_payload(), parts);
        if self.spec.tagging == super::Tagging::Magnitude && self.spec.lossy() && self.world > 1 {
            let threshold = gradwire::tagging::magnitude_threshold_of(
                region.as_slice(),
                self.spec.dtype,
                &gradwire::tagging::MagnitudeConfig::default(),
            );
            // No threshold (raw bytes): every segment important, as untagged.
            self.tagger = threshold.map(|t| DlcpTagger {
                dscp: self.spec.tos >> 2,
                threshold: Some(t),
            });
        }
        let buf = cx.register(region);
        self.buf = Some(buf);
        Ok(buf)
    }

    /// The next reduce-scatter step can start now (its time bound and its `waited` run
    /// from here).
    pub(crate) fn step_starts(&mut self, now: Instant) {
        self.step_started = Some(now);
    }

    /// Reports a finished reduce-scatter receive from `peer`.
    pub(crate) fn record_step(&mut self, now: Instant, peer: u16, r: &RecvReport) {
        self.steps.push(StepReport {
            peer: usize::from(peer),
            ended: r.ended,
            missing: r.missing,
            segments: r.segments,
            waited: now.saturating_duration_since(self.step_started.unwrap_or(now)),
        });
    }

    /// Tracks contributor sets from here on when `lossy` (this rank alone in every block).
    pub(crate) fn track_sets(&mut self, lossy: bool) {
        if lossy {
            self.masks = Some(Masks::only(self.chunks.blocks(), self.rank));
        }
    }

    /// The registered buffer (an error before `begin` or after the outcome).
    pub(crate) fn buf(&self) -> Result<BufId, OpError> {
        self.buf.ok_or_else(|| OpError::Invalid("no buffer".into()))
    }

    /// A reduce-scatter receive of the tensor's `bytes` carrying `carried` ranks' partial
    /// sum: summed in as it lands, under its share of the loss bound (each of the spec's
    /// ranges on its own) and the step's time bound, with the senders' contributor sets when
    /// they are tracked.
    pub(crate) fn sum_opts(
        &self,
        deadline: Option<Instant>,
        bytes: &std::ops::Range<usize>,
        carried: usize,
    ) -> RecvOpts {
        let loss_bound = step_bound(self.spec.loss_bound, self.world, carried);
        let ranges = if loss_bound > 0.0 {
            ranges_within(&self.spec.ranges, bytes)
        } else {
            Vec::new()
        };
        RecvOpts {
            place: Place::Reduce(self.spec.op.combine(), self.spec.dtype),
            loss_bound,
            ranges,
            keep_meta: self.masks.is_some(),
            deadline,
            up_to: false,
            skip_meta_zero: false,
            patient: false,
            rotate: self.spec.lossy(),
        }
    }

    /// The TOS byte of each segment of a lossy step's send of `bytes`: DLCP's tag, the one
    /// the point-to-point send gives (empty: untagged, the spec's TOS).
    pub(crate) fn tags(&self, bytes: &[u8], seg_payload: usize) -> Vec<u8> {
        match &self.tagger {
            None => Vec::new(),
            Some(t) => tos_per_segment(
                bytes,
                seg_payload,
                self.spec.layer,
                self.spec.dtype,
                &t.priority_fn(),
            ),
        }
    }

    /// A receive of finished values: reliable (every rank must end with the same values),
    /// with their contributor sets when they are tracked.
    pub(crate) fn result_opts(&self) -> RecvOpts {
        RecvOpts {
            keep_meta: self.masks.is_some(),
            ..RecvOpts::default()
        }
    }

    /// A send of the reduction has completed after `segments` data segments.
    pub(crate) fn sent(&mut self, segments: u32) {
        self.sends_left = self.sends_left.saturating_sub(1);
        self.segments_sent += u64::from(segments);
    }

    /// The outcome once no send or receive is outstanding (the region handed back).
    pub(crate) fn finish(
        &mut self,
        cx: &mut OpCx<'_>,
        algorithm: &'static str,
    ) -> Step<ReduceOutcome> {
        if self.sends_left > 0 || self.recvs_left > 0 {
            return Ok(None);
        }
        let region = self.buf.take().and_then(|b| cx.unregister(b));
        let now = cx.now();
        let mut out = outcome(
            region,
            algorithm,
            &self.chunks,
            self.masks.as_ref(),
            self.world,
            std::mem::take(&mut self.steps),
            now.saturating_duration_since(self.started.unwrap_or(now)),
        );
        out.segments_sent = self.segments_sent;
        Ok(Some(out))
    }
}
