//! The plain C structs and constants of the interface, and their conversions to and from the
//! session's Rust types (safe code: pointers are read in `ffi`).
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::net::IpAddr;
use std::ptr;
use std::time::Duration;

use gradwire_session::{
    AllReduceAlgo, BroadcastReport, DType, P2pOptions, RecvSummary, ReduceOp, ReduceOptions,
    ReduceReport, SendSummary, SessionConfig, StepDeadline,
};

use crate::error::CError;

/// Element type of a buffer: one of the GW_DTYPE_* constants. An int rather than a C enum,
/// so a wrong value is an error (GW_ERR_INVALID_ARGUMENT) instead of undefined behaviour.
pub type gw_dtype = i32;
/// Opaque bytes (element size 1): send/recv only.
pub const GW_DTYPE_RAW: gw_dtype = 0;
/// IEEE 754 binary32 (float).
pub const GW_DTYPE_F32: gw_dtype = 1;
/// IEEE 754 binary16.
pub const GW_DTYPE_F16: gw_dtype = 2;
/// bfloat16.
pub const GW_DTYPE_BF16: gw_dtype = 3;

/// What an all-reduce computes: one of the GW_OP_* constants.
pub type gw_op = i32;
/// The sum over all ranks. A block whose contributions from some ranks were lost (only with a
/// loss bound > 0) is the average over the ranks that arrived times the world size.
pub const GW_OP_SUM: gw_op = 0;
/// The average over the ranks whose contribution to each block arrived.
pub const GW_OP_AVERAGE: gw_op = 1;

/// An all-reduce algorithm (gw_op_options.algorithm).
pub type gw_algo = i32;
/// Two-phase up to 32 KiB or for two ranks, ring above.
pub const GW_ALGO_AUTO: gw_algo = 0;
/// Reduce-scatter then all-gather around the ring of ranks.
pub const GW_ALGO_RING: gw_algo = 1;
/// The two-phase all-reduce: every rank reduces its own chunk, then sends it to all.
pub const GW_ALGO_DIRECT: gw_algo = 2;

/// `gw_op_options.step_deadline_ms`: learn each step's time bound from the steps seen.
pub const GW_STEP_DEADLINE_ADAPTIVE: f64 = -1.0;

pub(crate) fn dtype(d: gw_dtype) -> Result<DType, CError> {
    match d {
        GW_DTYPE_RAW => Ok(DType::Raw),
        GW_DTYPE_F32 => Ok(DType::F32),
        GW_DTYPE_F16 => Ok(DType::F16),
        GW_DTYPE_BF16 => Ok(DType::Bf16),
        _ => Err(CError::invalid(format!(
            "dtype {d} is not one of GW_DTYPE_RAW (0), GW_DTYPE_F32 (1), GW_DTYPE_F16 (2), \
             GW_DTYPE_BF16 (3)"
        ))),
    }
}

pub(crate) fn dtype_code(d: DType) -> gw_dtype {
    match d {
        DType::Raw => GW_DTYPE_RAW,
        DType::F32 => GW_DTYPE_F32,
        DType::F16 => GW_DTYPE_F16,
        DType::Bf16 => GW_DTYPE_BF16,
    }
}

pub(crate) fn op(o: gw_op) -> Result<ReduceOp, CError> {
    match o {
        GW_OP_SUM => Ok(ReduceOp::Sum),
        GW_OP_AVERAGE => Ok(ReduceOp::Average),
        _ => Err(CError::invalid(format!(
            "op {o} is not one of GW_OP_SUM (0), GW_OP_AVERAGE (1)"
        ))),
    }
}

/// The byte length of `count` elements of `dtype`, or an error if it overflows.
pub(crate) fn byte_len(count: usize, dtype: DType) -> Result<usize, CError> {
    count.checked_mul(dtype.elem_size()).ok_or_else(|| {
        CError::invalid(format!(
            "count {count} of {dtype:?} elements overflows the address space"
        ))
    })
}

/// A job's configuration. Get one from gw_config_default() and change the fields you need;
/// gradwire copies what it needs during the call it is passed to.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gw_config {
    /// Job id; every rank of a job uses the same (default 1).
    pub job: u32,
    /// This rank, 0 <= rank < world.
    pub rank: u32,
    /// Number of ranks.
    pub world: u32,
    /// This rank's IP address (text, IPv4 or IPv6): every link binds there.
    pub ip: *const c_char,
    /// Loss bound of operations that name none, in [0, 1); 0 = reliable (default).
    pub loss_bound: f64,
    /// Set-up deadline and per-operation peer timeout in milliseconds (default 30000).
    pub timeout_ms: u64,
    /// Build links between every pair of ranks (default true), for gw_send/gw_recv between
    /// any two ranks. false: only the ring's links (what the collectives need; about five
    /// file descriptors fewer per peer), so a rank can only gw_send to rank + 1 and gw_recv
    /// from rank - 1 (mod world).
    pub point_to_point: bool,
    /// TESTING: drop this fraction of data packets on arrival (default 0 = off).
    pub inject_loss: f64,
    /// Seed of inject_loss.
    pub seed: u64,
    /// Sender's starting/paced rate cap in bits per second; 0 = the transport default.
    pub rate_bps: u64,
    /// The job secret (at least 16 bytes, the same on every rank): every datagram sealed
    /// with its pair of ranks' key.
    /// NULL (default): no authentication.
    pub secret: *const u8,
    /// Length of secret in bytes.
    pub secret_len: usize,
    /// The network's MTU in bytes, the same on every rank (default 1500; 9000 with jumbo
    /// frames; up to 65535 on loopback, a one-host job). 0: the default.
    pub mtu: u32,
}

impl gw_config {
    pub(crate) fn defaults(rank: u32, world: u32, ip: *const c_char) -> gw_config {
        // The session's own defaults, so the two never drift apart.
        let d = SessionConfig::new(rank as usize, world as usize, IpAddr::from([0, 0, 0, 0]));
        gw_config {
            job: d.job,
            rank,
            world,
            ip,
            loss_bound: d.loss_bound,
            timeout_ms: u64::try_from(d.timeout.as_millis()).unwrap_or(u64::MAX),
            point_to_point: d.point_to_point,
            inject_loss: d.inject_loss,
            seed: d.seed,
            rate_bps: d.rate_bps.unwrap_or(0),
            secret: ptr::null(),
            secret_len: 0,
            mtu: u32::try_from(d.mtu).unwrap_or(0),
        }
    }

    /// The session's configuration, given the strings and bytes `ffi` read from the pointers.
    pub(crate) fn to_session(
        self,
        ip: &str,
        secret: Option<&[u8]>,
    ) -> Result<SessionConfig, CError> {
        let ip: IpAddr = ip.trim().parse().map_err(|_| {
            CError::invalid(format!(
                "gw_config.ip {ip:?} is not an IP address: give this rank's IPv4 or IPv6 \
                 address, e.g. \"198.18.0.1\""
            ))
        })?;
        let mut cfg = SessionConfig::new(self.rank as usize, self.world as usize, ip);
        cfg.job = self.job;
        cfg.loss_bound = self.loss_bound;
        cfg.timeout = Duration::from_millis(self.timeout_ms);
        cfg.point_to_point = self.point_to_point;
        cfg.inject_loss = self.inject_loss;
        cfg.seed = self.seed;
        cfg.rate_bps = (self.rate_bps != 0).then_some(self.rate_bps);
        cfg.secret = secret.map(<[u8]>::to_vec);
        if self.mtu != 0 {
            cfg.mtu = self.mtu as usize;
        }
        Ok(cfg)
    }
}

/// Options of gw_all_reduce and gw_broadcast; NULL means gw_op_options_default().
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gw_op_options {
    /// Loss bound of this operation in [0, 1); negative: the session's (gw_config.loss_bound).
    pub loss_bound: f64,
    /// The tensor's layer, counted from the input: 0 = the front (input) layer, the most
    /// urgent (its gradients are needed first by the next forward pass; DLCP tagging).
    pub layer: u16,
    /// Number of layers of the model: with layer, picks the DSCP (layer < num_layers, else
    /// GW_ERR_INVALID_ARGUMENT); 0: unknown, the lowest data priority (DSCP 0).
    pub num_layers: u16,
    /// DSCP to send with (0..63), overriding the layer's; -1: from the layer.
    pub dscp: c_int,
    /// All-reduce algorithm: GW_ALGO_AUTO (two-phase up to 32 KiB or for two ranks, ring
    /// above), GW_ALGO_RING or GW_ALGO_DIRECT (two-phase).
    pub algorithm: gw_algo,
    /// A time bound per reduce-scatter step of an all-reduce, milliseconds (OptiReduce); 0:
    /// none, only the loss bound ends a step early; GW_STEP_DEADLINE_ADAPTIVE (-1): learned
    /// from the steps this session saw (1.5 x their 95th percentile, at least 1 ms).
    pub step_deadline_ms: f64,
}

impl Default for gw_op_options {
    fn default() -> Self {
        gw_op_options {
            loss_bound: -1.0,
            layer: 0,
            num_layers: 0,
            dscp: -1,
            algorithm: GW_ALGO_AUTO,
            step_deadline_ms: 0.0,
        }
    }
}

fn loss_bound(b: f64) -> Option<f64> {
    // NaN is passed on, for the session to refuse.
    (b.is_nan() || b >= 0.0).then_some(b)
}

impl gw_op_options {
    pub(crate) fn to_session(self, op: ReduceOp) -> Result<ReduceOptions, CError> {
        let dscp = match self.dscp {
            -1 => None,
            d => Some(u8::try_from(d).ok().filter(|&d| d < 64).ok_or_else(|| {
                CError::invalid(format!(
                    "gw_op_options.dscp {d} is not a DSCP (0..63) nor -1 (the layer's)"
                ))
            })?),
        };
        let algorithm = match self.algorithm {
            GW_ALGO_AUTO => AllReduceAlgo::Auto,
            GW_ALGO_RING => AllReduceAlgo::Ring,
            GW_ALGO_DIRECT => AllReduceAlgo::Direct,
            a => {
                return Err(CError::invalid(format!(
                    "gw_op_options.algorithm {a} is not GW_ALGO_AUTO (0), GW_ALGO_RING (1) or \
                     GW_ALGO_DIRECT (2)"
                )))
            }
        };
        let d = self.step_deadline_ms;
        let step_deadline = if d == GW_STEP_DEADLINE_ADAPTIVE {
            StepDeadline::ADAPTIVE
        } else if d == 0.0 {
            StepDeadline::None
        } else if d > 0.0 && d <= 1e9 {
            StepDeadline::Fixed(std::time::Duration::from_secs_f64(d / 1e3))
        } else {
            return Err(CError::invalid(format!(
                "gw_op_options.step_deadline_ms {d} is not a number of milliseconds (0: none, \
                 GW_STEP_DEADLINE_ADAPTIVE: adaptive)"
            )));
        };
        Ok(ReduceOptions {
            op,
            loss_bound: loss_bound(self.loss_bound),
            layer: self.layer,
            num_layers: self.num_layers,
            dscp,
            algorithm,
            step_deadline,
            ..ReduceOptions::default()
        })
    }
}

/// Options of gw_send and gw_recv; NULL means gw_p2p_options_default(). Sender and receiver
/// of one tensor give the same tensor id.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gw_p2p_options {
    /// Tensor id, to tell apart several tensors between the same two ranks.
    pub tensor: u32,
    /// The tensor's layer, 0 = the front (input) layer, the most urgent. The priority
    /// function sees it; with DLCP's default tagging (no priority function) it picks the DSCP
    /// together with num_layers.
    pub layer: u16,
    /// Number of layers of the model, for DLCP's default tagging: the sender needs layer <
    /// num_layers (else GW_ERR_INVALID_ARGUMENT); 0: unknown, the lowest data priority (DSCP
    /// 0). Not used by gw_recv nor with a priority function.
    pub num_layers: u16,
    /// Loss bound of this transfer in [0, 1) (the receiver's decides); negative: the
    /// session's.
    pub loss_bound: f64,
}

impl Default for gw_p2p_options {
    fn default() -> Self {
        gw_p2p_options {
            tensor: 0,
            layer: 0,
            num_layers: 0,
            loss_bound: -1.0,
        }
    }
}

impl gw_p2p_options {
    pub(crate) fn to_session(self) -> P2pOptions {
        P2pOptions {
            tensor: self.tensor,
            layer: self.layer,
            num_layers: self.num_layers,
            loss_bound: loss_bound(self.loss_bound),
        }
    }
}

/// What a priority function sees of one segment (one packet's payload) of a tensor.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gw_segment_info {
    /// Segment index.
    pub index: u32,
    /// Byte offset of the segment in the tensor.
    pub offset: u64,
    /// Layer of the tensor (gw_p2p_options.layer; 0 = the front layer).
    pub layer: u16,
    /// Element type of the tensor.
    pub dtype: gw_dtype,
    /// The segment's bytes (valid during the call only; not aligned to the element type:
    /// read elements with memcpy).
    pub payload: *const u8,
    /// Number of bytes at payload.
    pub len: usize,
}

/// A segment's packet marking: DSCP (0..63; higher bits are ignored) and whether it is sent
/// ECN-capable (ECT(0)), which lets a switch mark or selectively drop it first under
/// congestion.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gw_tag {
    /// DSCP code point, 0..63.
    pub dscp: u8,
    /// Send as ECT(0) (true) or not-ECT (false).
    pub ect: bool,
}

/// DLCP's priority function: the tag of one segment. Called on gradwire's sending threads,
/// possibly several at once, only during the gw_send it was given to; it must be thread-safe
/// for ctx, must not call gradwire on the same session (GW_ERR_BUSY), and must return
/// normally (no longjmp, no C++ exception).
pub type gw_priority_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, segment: *const gw_segment_info) -> gw_tag>;

/// The caller's all-gather for gw_session_init: every rank passes `len` bytes at `mine`, and
/// the callback writes all ranks' bytes into `all` (world * len bytes, rank r's at r * len),
/// like MPI_Allgather(mine, len, MPI_BYTE, all, len, MPI_BYTE, comm). Return 0 on success,
/// anything else on failure. gradwire calls it twice, with the same `len` on every rank each
/// time: first to gather the addresses' lengths (len = 8), then the addresses padded to the
/// longest.
pub type gw_allgather_fn = Option<
    unsafe extern "C" fn(ctx: *mut c_void, mine: *const u8, len: usize, all: *mut u8) -> c_int,
>;

/// What an all-reduce did. The per-block and per-rank delivered fractions are read after the
/// call with gw_last_block_delivered() and gw_last_rank_delivered().
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gw_reduce_report {
    /// Elements reduced.
    pub elems: usize,
    /// Blocks the buffer was cut into (block b = elements [b * block_elems, (b+1) * block_elems)).
    pub blocks: usize,
    /// Elements per block (the last block may be shorter).
    pub block_elems: usize,
    /// Blocks every rank's contribution reached.
    pub complete_blocks: usize,
    /// Mean over blocks of (ranks summed / world); 1.0 when nothing was lost.
    pub delivered_fraction: f64,
    /// Wall time of the operation in seconds.
    pub elapsed_s: f64,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
}

impl From<&ReduceReport> for gw_reduce_report {
    fn from(r: &ReduceReport) -> Self {
        gw_reduce_report {
            elems: r.elems,
            blocks: r.blocks,
            block_elems: r.block_elems,
            complete_blocks: r.complete_blocks,
            delivered_fraction: r.delivered_fraction,
            elapsed_s: r.elapsed_s,
            bytes_sent: r.bytes_sent,
        }
    }
}

/// What a broadcast did. Which blocks arrived: gw_last_broadcast_received().
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gw_broadcast_report {
    /// Blocks of the buffer (block b = elements [b * block_elems, (b+1) * block_elems)).
    pub blocks: usize,
    /// Elements per block (the last block may be shorter).
    pub block_elems: usize,
    /// Blocks that hold the root's values (all of them at the root, and without loss); the
    /// others kept their previous contents.
    pub received_blocks: usize,
    /// Wall time of the operation in seconds.
    pub elapsed_s: f64,
}

impl From<&BroadcastReport> for gw_broadcast_report {
    fn from(r: &BroadcastReport) -> Self {
        gw_broadcast_report {
            blocks: r.blocks,
            block_elems: r.block_elems,
            received_blocks: r.received_blocks,
            elapsed_s: r.elapsed_s,
        }
    }
}

/// What a gw_send did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gw_send_report {
    /// Segments of the tensor.
    pub segments: u32,
    /// Bytes of the tensor.
    pub bytes: u64,
    /// Segments sent again after a loss.
    pub retransmitted_segments: u64,
    /// Wall time in seconds.
    pub elapsed_s: f64,
    /// The sender's rate at the end, bits per second.
    pub final_rate_bps: u64,
}

impl From<&SendSummary> for gw_send_report {
    fn from(r: &SendSummary) -> Self {
        gw_send_report {
            segments: r.segments,
            bytes: r.bytes,
            retransmitted_segments: r.retransmitted_segments,
            elapsed_s: r.elapsed_s,
            final_rate_bps: r.final_rate_bps,
        }
    }
}

/// What a gw_recv delivered.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gw_recv_report {
    /// Segments of the tensor.
    pub segments: u32,
    /// Segments that arrived (the others are zero-filled: gw_last_recv_missing() gives their
    /// byte ranges).
    pub received_segments: u32,
    /// received_segments / segments.
    pub delivered_fraction: f64,
    /// The loss bound the transfer ran with.
    pub loss_bound: f64,
    /// Retransmission rounds.
    pub rounds: u32,
    /// Wall time in seconds.
    pub elapsed_s: f64,
}

impl From<&RecvSummary> for gw_recv_report {
    fn from(r: &RecvSummary) -> Self {
        gw_recv_report {
            segments: r.segments,
            received_segments: r.received_segments,
            delivered_fraction: r.delivered_fraction,
            loss_bound: r.loss_bound,
            rounds: r.rounds,
            elapsed_s: r.elapsed_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_op_codes_round_trip_and_refuse_unknown_values() {
        for d in [DType::Raw, DType::F32, DType::F16, DType::Bf16] {
            assert_eq!(dtype(dtype_code(d)).unwrap(), d);
            // The codes are the transport's own control-channel codes.
            assert_eq!(dtype_code(d), i32::from(d.code()));
        }
        assert_eq!(dtype(4).unwrap_err().code, crate::GW_ERR_INVALID_ARGUMENT);
        assert_eq!(dtype(-1).unwrap_err().code, crate::GW_ERR_INVALID_ARGUMENT);
        assert_eq!(op(GW_OP_AVERAGE).unwrap(), ReduceOp::Average);
        assert_eq!(op(2).unwrap_err().code, crate::GW_ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn byte_len_refuses_overflow() {
        assert_eq!(byte_len(3, DType::F32).unwrap(), 12);
        assert!(byte_len(usize::MAX / 2 + 1, DType::F16).is_err());
    }

    #[test]
    fn options_map_negative_to_the_session_default_and_check_the_dscp() {
        let o = gw_op_options::default().to_session(ReduceOp::Sum).unwrap();
        assert_eq!((o.loss_bound, o.dscp), (None, None));
        let o = gw_op_options {
            loss_bound: 0.1,
            dscp: 46,
            ..gw_op_options::default()
        }
        .to_session(ReduceOp::Average)
        .unwrap();
        assert_eq!(
            (o.loss_bound, o.dscp, o.op),
            (Some(0.1), Some(46), ReduceOp::Average)
        );
        for bad in [64, -2, 1000] {
            let o = gw_op_options {
                dscp: bad,
                ..gw_op_options::default()
            };
            assert!(o.to_session(ReduceOp::Sum).is_err(), "dscp {bad}");
        }
        assert!(gw_p2p_options::default().to_session().loss_bound.is_none());
    }

    #[test]
    fn config_defaults_are_the_sessions_and_convert_back() {
        let c = gw_config::defaults(1, 3, ptr::null());
        let d = SessionConfig::new(1, 3, IpAddr::from([0, 0, 0, 0]));
        assert_eq!(c.job, d.job);
        assert_eq!(c.point_to_point, d.point_to_point);
        let s = c.to_session("127.0.0.1", None).unwrap();
        assert_eq!((s.rank, s.world, s.timeout), (1, 3, d.timeout));
        assert_eq!(s.rate_bps, d.rate_bps);
        assert!(c.to_session("not-an-ip", None).is_err());
    }
}
