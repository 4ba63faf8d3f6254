//! Drivers that run the protocol cores over a [`Datapath`] and a [`CtrlChannel`], and the
//! user-facing API mirroring DLCP's primitives: [`Sender::send`] (`dlcp_send(tensor,
//! prio_func)`) and [`Receiver::recv`] (`dlcp_recv(tensor, loss_bound)`).
//!
//! One transfer runs on the calling thread: the sender alternates between pacing segments
//! out and reading the control channel; the receiver alternates between a receive batch
//! (waiting at most until the next rate report is due) and the control channel. Every wait is
//! bounded, and no progress for `idle_timeout` is an error, never a hang.
//!
//! ```
//! use std::net::SocketAddr;
//! use gradwire::ctrl_channel::MemCtrl;
//! use gradwire::datapath::loopback::Loopback;
//! use gradwire::flow::{fixed_priority, Tag};
//! use gradwire::tensor::{DType, Tensor};
//! use gradwire::transport::{recv_tensor, send_tensor, RecvOptions, SendOptions, TransferConfig};
//!
//! let a: SocketAddr = "127.0.0.1:9000".parse().unwrap();
//! let b: SocketAddr = "127.0.0.1:9001".parse().unwrap();
//! let (mut dp_a, mut dp_b) = Loopback::pair(a, b, 1472, 1 << 16);
//! let (mut ctl_a, mut ctl_b) = MemCtrl::pair();
//! let cfg = TransferConfig::default();
//!
//! let mut grads = Tensor::zeros(DType::F32, 100_000);
//! grads.fill_pattern(7);
//! let mut out = Tensor::zeros(DType::F32, 100_000);
//! let opts = SendOptions::new(1, 42);
//! let recv_opts = RecvOptions::new(1, 42);
//! let prio = fixed_priority(Tag { dscp: 10, ect: true });
//! let report = std::thread::scope(|s| {
//!     let cfg2 = cfg.clone();
//!     s.spawn(move || send_tensor(&mut dp_a, &mut ctl_a, b.ip(), &grads, &opts, &prio, &cfg2).unwrap());
//!     recv_tensor(&mut dp_b, &mut ctl_b, &mut out, &recv_opts, &cfg).unwrap()
//! });
//! assert!(report.delivered_fraction >= 0.9);
//! ```

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::auth::JobKey;
use crate::bitmap::SegmentBitmap;
use crate::ctrl_channel::{ChannelError, CtrlChannel, TcpCtrl, DEFAULT_CONTROL_DSCP};
use crate::ctrl_listener::CtrlListener;
use crate::datapath::{DataSource, Datapath, DatapathError, DatapathStats, RxMeta, TxMeta};
use crate::flow::receiver::{ReceiverPhase, ReceiverStats};
use crate::flow::sender::SenderPhase;
use crate::flow::{
    DataOrigin, FlowId, LossDefaults, PriorityFn, ProtoError, ReceiverFlow, RecvSpec, RejectCounts,
    SegmentInfo, SenderConfig, SenderFlow, SenderStats,
};
use crate::grant::GrantConfig;
use crate::grant_pool::GrantPool;
use crate::message::{CtrlMsg, LossBound, Stage, FLOW_NONCE_LEN, MAX_REASON};
use crate::rate::RateConfig;
use crate::tensor::{segment_payload_for, LayoutError, SegmentLayout, Tensor};
use crate::wire::header;

/// What to do with segments that were never received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingFill {
    /// Zero them (a missing gradient contributes nothing).
    #[default]
    Zero,
    /// Leave the buffer's previous contents (e.g. last round's values).
    Keep,
}

/// Transfer configuration shared by both ends.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferConfig {
    /// IP MTU: segments carry `mtu - IP - UDP - gradwire header` bytes, in whole elements.
    pub mtu: usize,
    /// Sender rate control and pacing.
    pub sender: SenderConfig,
    /// Data packets per datapath call.
    pub batch: usize,
    /// No progress (data or control) for this long is an error.
    pub idle_timeout: Duration,
    /// Longest wait for the peer to connect or to answer the rendezvous.
    pub connect_timeout: Duration,
    /// DSCP of the control channel (None: leave the socket's TOS alone).
    pub control_dscp: Option<u8>,
    /// Default loss bounds per stage.
    pub loss_defaults: LossDefaults,
    /// The receiver gives up on a flow whose passes keep ending with no new segment for this
    /// long (the control channel works but the data path does not); zero: never. Congestion
    /// is not a reason: passes that deliver nothing back off (up to `max_backoff`) instead.
    pub no_progress_timeout: Duration,
    /// Longest wait of a receiver before asking again after passes that delivered nothing.
    pub max_backoff: Duration,
    /// The receiver's downlink rate, which its grants share out; `None`: the line rate of
    /// `sender.rate`.
    pub receive_capacity_bps: Option<u64>,
    /// The grant allocator this receiver shares with the other receivers of its host (see
    /// [`GrantPool`]); `None`: a private one per transfer.
    pub grant_pool: Option<GrantPool>,
    /// A [`Sender`] starts each flow at the rate its previous flow to the same receiver
    /// ended at (until the first grant, or as the ECN mode's start).
    pub rate_memory: bool,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            mtu: 1500,
            sender: SenderConfig::new(25_000_000_000),
            batch: 32,
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            control_dscp: Some(DEFAULT_CONTROL_DSCP),
            loss_defaults: LossDefaults::default(),
            no_progress_timeout: Duration::from_nanos(
                crate::flow::receiver::DEFAULT_NO_PROGRESS_NS,
            ),
            max_backoff: Duration::from_nanos(crate::flow::receiver::DEFAULT_MAX_BACKOFF_NS),
            receive_capacity_bps: None,
            grant_pool: None,
            rate_memory: true,
        }
    }
}

impl TransferConfig {
    /// The rate-control parameters.
    pub fn rate(&self) -> &RateConfig {
        &self.sender.rate
    }

    /// The pool a receiver draws its grants from: the shared one, or a new private one for
    /// the capacity and report period configured here.
    pub fn grant_pool(&self) -> GrantPool {
        self.grant_pool.clone().unwrap_or_else(|| {
            GrantPool::new(GrantConfig::new(
                self.receive_capacity_bps
                    .unwrap_or(self.sender.rate.line_rate_bps),
                self.sender.rate.period_ns,
            ))
        })
    }

    /// Check every parameter.
    pub fn validate(&self) -> Result<(), TransferError> {
        if !(68..=65_535).contains(&self.mtu) {
            return Err(TransferError::Config(format!(
                "mtu {} is outside 68..=65535",
                self.mtu
            )));
        }
        if self.batch == 0 {
            return Err(TransferError::Config("batch must be at least 1".into()));
        }
        if self.idle_timeout.is_zero() {
            return Err(TransferError::Config(
                "idle timeout must be positive".into(),
            ));
        }
        self.sender
            .rate
            .validate()
            .map_err(|e| TransferError::Config(e.to_string()))
    }
}

/// Options of one send.
#[derive(Debug, Clone, PartialEq)]
pub struct SendOptions {
    /// Job id.
    pub job: u32,
    /// Tensor id.
    pub tensor: u32,
    /// Round (iteration).
    pub round: u32,
    /// Layer of the tensor (for tagging).
    pub layer: u16,
    /// Push or pull.
    pub stage: Stage,
    /// Loss bound; `None` takes the stage default.
    pub loss_bound: Option<LossBound>,
}

impl SendOptions {
    /// Push of round 0, layer 0, default bound.
    pub fn new(job: u32, tensor: u32) -> SendOptions {
        SendOptions {
            job,
            tensor,
            round: 0,
            layer: 0,
            stage: Stage::Push,
            loss_bound: None,
        }
    }
}

/// Options of one receive.
#[derive(Debug, Clone, PartialEq)]
pub struct RecvOptions {
    /// Job id.
    pub job: u32,
    /// Tensor id.
    pub tensor: u32,
    /// Required round, or any.
    pub round: Option<u32>,
    /// Loss bound to enforce; `None` takes the sender's (which defaults per stage).
    pub loss_bound: Option<LossBound>,
    /// What happens to segments never received.
    pub fill: MissingFill,
    /// `None`: the flow must be the size of the receiver's tensor. `Some(max)`: the sender
    /// sizes the flow, up to `max` bytes of the tensor's dtype, and the tensor is replaced by
    /// a zeroed one of the announced size once the flow is accepted (so a sequence of
    /// differently sized messages needs no separate flow to announce each size). A larger
    /// flow is rejected before anything is allocated, unless it is exactly the tensor's own
    /// size.
    pub max_bytes: Option<u64>,
}

impl RecvOptions {
    /// Any round, the sender's bound, zero-fill, the tensor's size.
    pub fn new(job: u32, tensor: u32) -> RecvOptions {
        RecvOptions {
            job,
            tensor,
            round: None,
            loss_bound: None,
            fill: MissingFill::Zero,
            max_bytes: None,
        }
    }
}

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The control channel failed.
    #[error(transparent)]
    Channel(#[from] ChannelError),
    /// The datapath failed.
    #[error("{datapath} datapath: {source}")]
    Datapath {
        /// Which datapath.
        datapath: &'static str,
        /// Error.
        source: DatapathError,
    },
    /// The peer broke the protocol, rejected the flow, or aborted.
    #[error("{flow}: {source}")]
    Protocol {
        /// Flow.
        flow: FlowId,
        /// What happened.
        source: ProtoError,
    },
    /// No progress for the idle timeout.
    #[error("peer {peer} stalled: no progress for {timeout:?} while {during} ({flow})")]
    Stalled {
        /// Peer.
        peer: String,
        /// Timeout.
        timeout: Duration,
        /// What we were waiting for.
        during: &'static str,
        /// Flow.
        flow: FlowId,
    },
    /// The tensor cannot be cut into segments.
    #[error("tensor layout: {0}")]
    Layout(#[from] LayoutError),
    /// Invalid configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The operating system's random number generator failed (getrandom).
    #[error(
        "the system random number generator failed: check that /dev/urandom or getrandom(2) works"
    )]
    Random,
}

/// Result of a send.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SendReport {
    /// Flow.
    pub flow: FlowId,
    /// Tensor size.
    pub size_bytes: u64,
    /// Segments in the tensor.
    pub segments: u32,
    /// Counters.
    pub stats: SenderStats,
    /// Flow completion time: FlowStart sent to FlowFinish received.
    pub fct: Duration,
    /// Paced rate at the end, bit/s.
    pub final_rate_bps: u64,
    /// Datapath counters after the send.
    pub datapath: DatapathStats,
}

/// Result of a receive: what the paper's `dlcp_recv` returns, and more.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecvReport {
    /// Flow.
    pub flow: FlowId,
    /// Tensor size.
    pub size_bytes: u64,
    /// Segments in the tensor.
    pub segments: u32,
    /// Segments received.
    pub received_segments: u32,
    /// Fraction of segments received (also of bytes, up to the short last segment).
    pub delivered_fraction: f64,
    /// Loss bound enforced, as a fraction.
    pub loss_bound: f64,
    /// Retransmission rounds (requests sent).
    pub rounds: u32,
    /// Counters and timestamps.
    pub stats: ReceiverStats,
    /// Packets refused (none touched the tensor).
    pub rejected: RejectCounts,
    /// FlowStart accepted to bound met.
    pub fct: Duration,
    /// FlowStart accepted to FinishConfirm.
    pub total: Duration,
    /// What was done to missing segments.
    pub fill: MissingFill,
    /// Which segments arrived: average each block over only the workers that delivered it.
    #[serde(skip)]
    pub bitmap: SegmentBitmap,
    /// Segment layout (maps bitmap bits to byte ranges).
    #[serde(skip)]
    pub layout: SegmentLayout,
}

impl RecvReport {
    /// Byte ranges `(offset, len)` of the segments that were *not* received.
    pub fn missing_byte_ranges(&self) -> Vec<(u64, usize)> {
        (0..self.segments)
            .filter(|&i| !self.bitmap.get(i))
            .filter_map(|i| self.layout.segment(i))
            .collect()
    }
}

fn dp_err(datapath: &'static str) -> impl Fn(DatapathError) -> TransferError {
    move |source| TransferError::Datapath { datapath, source }
}

/// Codes of the `Abort` message a failing end sends so its peer learns why.
pub mod abort_code {
    /// The peer broke the protocol.
    pub const PROTOCOL: u8 = 1;
    /// Our datapath failed.
    pub const DATAPATH: u8 = 2;
    /// The peer made no progress for the idle timeout.
    pub const STALLED: u8 = 3;
    /// A local error (configuration, tensor layout).
    pub const LOCAL: u8 = 4;
    /// The peer sent an undecodable control message.
    pub const MALFORMED: u8 = 5;
    /// The handshake refused the peer (job secret missing, wrong or unexpected).
    pub const AUTH: u8 = crate::handshake::ABORT_AUTH;
}

/// Tell the peer, best effort, why this end gives up; then return the error.
fn abort_peer<T, C: CtrlChannel + ?Sized>(
    ctrl: &mut C,
    r: Result<T, TransferError>,
) -> Result<T, TransferError> {
    let Err(e) = r else { return r };
    let code = match &e {
        // The peer already knows, or the channel is gone.
        TransferError::Protocol {
            source: ProtoError::Rejected { .. } | ProtoError::Aborted { .. },
            ..
        }
        | TransferError::Channel(
            ChannelError::Closed { .. }
            | ChannelError::Io { .. }
            | ChannelError::WriteStalled { .. }
            | ChannelError::Refused { .. }
            | ChannelError::Handshake { .. }
            | ChannelError::AcceptTimeout { .. },
        ) => return Err(e),
        TransferError::Protocol { .. } => abort_code::PROTOCOL,
        TransferError::Channel(ChannelError::Malformed { .. }) => abort_code::MALFORMED,
        TransferError::Channel(ChannelError::Encode(_)) => abort_code::LOCAL,
        TransferError::Datapath { .. } => abort_code::DATAPATH,
        TransferError::Stalled { .. } => abort_code::STALLED,
        TransferError::Layout(_) | TransferError::Config(_) | TransferError::Random => {
            abort_code::LOCAL
        }
    };
    let mut reason = e.to_string();
    if reason.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
    }
    // Best effort: the error we return matters more than whether the peer heard it.
    let _ = ctrl.send(&CtrlMsg::Abort { code, reason });
    Err(e)
}

/// Send `tensor` to the receiver at `dst_ip` over an established control channel.
///
/// On failure the peer is sent an `Abort` with the reason (best effort), so both ends report
/// the same cause.
pub fn send_tensor<D: Datapath + ?Sized, C: CtrlChannel + ?Sized>(
    dp: &mut D,
    ctrl: &mut C,
    dst_ip: IpAddr,
    tensor: &Tensor,
    opts: &SendOptions,
    prio: &PriorityFn<'_>,
    cfg: &TransferConfig,
) -> Result<SendReport, TransferError> {
    let r = send_tensor_inner(dp, ctrl, dst_ip, tensor, opts, prio, cfg);
    abort_peer(ctrl, r)
}

fn send_tensor_inner<D: Datapath + ?Sized, C: CtrlChannel + ?Sized>(
    dp: &mut D,
    ctrl: &mut C,
    dst_ip: IpAddr,
    tensor: &Tensor,
    opts: &SendOptions,
    prio: &PriorityFn<'_>,
    cfg: &TransferConfig,
) -> Result<SendReport, TransferError> {
    cfg.validate()?;
    let clock = Instant::now();
    let now = || clock.elapsed().as_nanos() as u64;
    let flow_id = FlowId {
        job: opts.job,
        tensor: opts.tensor,
        round: opts.round,
    };
    let proto = |source| TransferError::Protocol {
        flow: flow_id,
        source,
    };
    // An authenticated flow's datagrams end with a tag: the payload makes room for it.
    let tag_len = if ctrl.session().is_some() {
        header::TAG_LEN
    } else {
        0
    };
    let payload = segment_payload_for(
        cfg.mtu.saturating_sub(tag_len),
        dst_ip.is_ipv6(),
        tensor.dtype(),
        dp.max_datagram().saturating_sub(tag_len),
    )
    .unwrap_or(0);
    let layout = SegmentLayout::new(
        tensor.len_bytes() as u64,
        tensor.dtype().elem_size(),
        payload,
    )?;
    let bound = opts.loss_bound.unwrap_or(match opts.stage {
        Stage::Push => cfg.loss_defaults.push,
        Stage::Pull => cfg.loss_defaults.pull,
    });
    let flow_nonce: [u8; FLOW_NONCE_LEN] =
        crate::ctrl_channel::random_bytes().map_err(|_| TransferError::Random)?;
    let (mut flow, start) = SenderFlow::new(
        flow_id,
        layout,
        tensor.dtype(),
        opts.layer,
        bound,
        opts.stage,
        DataOrigin {
            sources: dp.data_sources(),
            flow_nonce,
        },
        &cfg.sender,
        now(),
    );
    if let Some(session) = ctrl.session() {
        flow.authenticate(session.flow_key(opts.job, opts.tensor, opts.round, &flow_nonce));
    }
    ctrl.send(&start)?;

    // Rendezvous.
    let deadline = Instant::now() + cfg.connect_timeout;
    while flow.phase() == SenderPhase::AwaitAccept {
        let left = deadline.saturating_duration_since(Instant::now());
        match ctrl.recv(left)? {
            Some(m) => {
                flow.on_ctrl(m, now()).map_err(proto)?;
            }
            None => {
                return Err(TransferError::Stalled {
                    peer: ctrl.peer(),
                    timeout: cfg.connect_timeout,
                    during: "waiting for FlowAccept",
                    flow: flow_id,
                })
            }
        }
    }
    let dst = SocketAddr::new(dst_ip, flow.data_port().unwrap_or(0));
    let bytes = tensor.as_bytes();
    let mut last_progress = Instant::now();
    let period = Duration::from_nanos(cfg.rate().period_ns);

    while flow.phase() != SenderPhase::Done {
        // Control first: a FlowFinish stops us mid-pass.
        while flow.phase() != SenderPhase::Done {
            let Some(m) = ctrl.recv(Duration::ZERO)? else {
                break;
            };
            last_progress = Instant::now();
            if let Some(reply) = flow.on_ctrl(m, now()).map_err(proto)? {
                ctrl.send(&reply)?;
            }
        }
        match flow.phase() {
            SenderPhase::Sending => {
                let t = now();
                let budget = flow.budget(t).min(cfg.batch);
                if budget == 0 {
                    let wait = Duration::from_nanos(flow.next_send_at(t).saturating_sub(t));
                    if let Some(m) = ctrl.recv(wait.min(period))? {
                        last_progress = Instant::now();
                        if let Some(reply) = flow.on_ctrl(m, now()).map_err(proto)? {
                            ctrl.send(&reply)?;
                        }
                    }
                    continue;
                }
                let mut payload_bytes = 0u64;
                let important = flow.retransmit_important();
                let sent = dp
                    .send(budget, &mut |buf: &mut [u8]| {
                        let (index, repr) = flow.next_segment()?;
                        let (off, len) = (repr.offset as usize, usize::from(repr.length));
                        let seg = bytes.get(off..off + len)?;
                        let tag = prio(&SegmentInfo {
                            index,
                            offset: repr.offset,
                            layer: repr.layer,
                            dtype: tensor.dtype(),
                            payload: seg,
                        });
                        let mut tag = tag;
                        tag.ect |= important;
                        let mut repr = repr;
                        if tag.ect {
                            repr.flags.insert(header::Flags::IMPORTANT);
                        }
                        let total = header::HEADER_LEN + len + flow.tag_len();
                        let out = buf.get_mut(..total)?;
                        let mut pkt = header::Packet::new_unchecked(&mut *out);
                        repr.emit(&mut pkt).ok()?;
                        pkt.payload_mut().copy_from_slice(seg);
                        if let Some(key) = flow.data_key() {
                            key.seal(out).ok()?;
                        }
                        payload_bytes += len as u64;
                        Some((
                            total,
                            TxMeta {
                                dst,
                                tos: tag.tos(),
                            },
                        ))
                    })
                    .map_err(dp_err(dp.name()))?;
                flow.on_sent(sent as u64, payload_bytes, now());
                if flow.nonces_exhausted() {
                    return Err(proto(ProtoError::NoncesExhausted));
                }
                if sent > 0 {
                    last_progress = Instant::now();
                }
                if let Some(stop) = flow.poll_pass_end() {
                    ctrl.send(&stop)?;
                }
            }
            SenderPhase::AwaitVerdict => {
                if let Some(m) = ctrl.recv(period.max(Duration::from_millis(1)))? {
                    last_progress = Instant::now();
                    if let Some(reply) = flow.on_ctrl(m, now()).map_err(proto)? {
                        ctrl.send(&reply)?;
                    }
                } else if last_progress.elapsed() > cfg.idle_timeout {
                    return Err(TransferError::Stalled {
                        peer: ctrl.peer(),
                        timeout: cfg.idle_timeout,
                        during: "waiting for FlowFinish or a retransmission request",
                        flow: flow_id,
                    });
                }
            }
            SenderPhase::AwaitAccept | SenderPhase::Done => {}
        }
    }
    Ok(SendReport {
        flow: flow_id,
        size_bytes: layout.size_bytes(),
        segments: layout.count(),
        stats: flow.stats(),
        fct: clock.elapsed(),
        final_rate_bps: flow.rate_bps(),
        datapath: dp.stats(),
    })
}

/// Receive one tensor into `tensor` over an established control channel.
///
/// On failure the peer is sent an `Abort` with the reason (best effort).
pub fn recv_tensor<D: Datapath + ?Sized, C: CtrlChannel + ?Sized>(
    dp: &mut D,
    ctrl: &mut C,
    tensor: &mut Tensor,
    opts: &RecvOptions,
    cfg: &TransferConfig,
) -> Result<RecvReport, TransferError> {
    let mut admitted = Vec::new();
    let r = recv_tensor_inner(dp, ctrl, tensor, opts, cfg, &mut admitted);
    // The flow is over, however it ended: its sources leave the datapath's filter.
    if let Err(e) = dp.release_peers(&admitted) {
        log::warn!("{} datapath: {e}", dp.name());
    }
    abort_peer(ctrl, r)
}

/// `admitted` gets the sources admitted to the datapath's filter, for the caller to release.
fn recv_tensor_inner<D: Datapath + ?Sized, C: CtrlChannel + ?Sized>(
    dp: &mut D,
    ctrl: &mut C,
    tensor: &mut Tensor,
    opts: &RecvOptions,
    cfg: &TransferConfig,
    admitted: &mut Vec<DataSource>,
) -> Result<RecvReport, TransferError> {
    cfg.validate()?;
    let clock = Instant::now();
    let now = || clock.elapsed().as_nanos() as u64;
    let ipv6 = dp.local_addr().is_ipv6();
    // An authenticated channel carries authenticated flows only (their datagrams end with a
    // tag); a plain one, plain flows only: the handshake decided which, for the connection.
    let tag_len = if ctrl.session().is_some() {
        header::TAG_LEN
    } else {
        0
    };
    let mut spec = RecvSpec {
        job: opts.job,
        tensor: opts.tensor,
        round: opts.round,
        dtype: tensor.dtype(),
        size_bytes: tensor.len_bytes() as u64,
        max_payload: segment_payload_for(
            cfg.mtu.saturating_sub(tag_len),
            ipv6,
            tensor.dtype(),
            dp.max_datagram().saturating_sub(tag_len),
        )
        .unwrap_or(0),
        loss_bound: opts.loss_bound,
    };
    let mut rejected = RejectCounts::default();
    let unknown = FlowId {
        job: opts.job,
        tensor: opts.tensor,
        round: opts.round.unwrap_or(0),
    };

    // Rendezvous: wait for FlowStart, dropping whatever data arrives meanwhile (stale). The
    // wait wakes as soon as a control message arrives; its bound only paces the draining of
    // stale datagrams, so an idle receiver (a collective waiting for its peer's next chunk)
    // wakes 50 times a second, not 1000.
    let deadline = Instant::now() + cfg.connect_timeout;
    let start = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(m) = ctrl.recv(left.min(Duration::from_millis(20)))? {
            match m {
                CtrlMsg::FlowStart(s) => break s,
                CtrlMsg::Abort { code, reason } => {
                    return Err(TransferError::Protocol {
                        flow: unknown,
                        source: ProtoError::Aborted { code, reason },
                    })
                }
                other => {
                    return Err(TransferError::Protocol {
                        flow: unknown,
                        source: ProtoError::Unexpected {
                            what: crate::flow::msg_name(&other),
                            state: "waiting for FlowStart",
                        },
                    })
                }
            }
        }
        dp.recv(cfg.batch, Duration::ZERO, &mut |_: &RxMeta, _: &[u8]| {
            rejected.stale_round += 1
        })
        .map_err(dp_err(dp.name()))?;
        if Instant::now() >= deadline {
            return Err(TransferError::Stalled {
                peer: ctrl.peer(),
                timeout: cfg.connect_timeout,
                during: "waiting for FlowStart",
                flow: unknown,
            });
        }
    };
    // A sender-sized flow: within the caller's bound and in whole elements of its dtype,
    // the flow is accepted at the announced size, and the tensor replaced only once
    // `accept` has checked the flow's ids (a rejected FlowStart leaves the caller's tensor
    // as it was). Anything else keeps the tensor's size, and `accept` rejects the mismatch.
    let mut resize = None;
    if let Some(max) = opts.max_bytes {
        let whole = start.size_bytes % tensor.dtype().elem_size() as u64 == 0;
        if start.size_bytes <= max && whole && start.size_bytes != spec.size_bytes {
            if let Ok(n) = usize::try_from(start.size_bytes) {
                spec.size_bytes = start.size_bytes;
                resize = Some(n);
            }
        }
    }
    let control_peer = ctrl
        .peer_ip()
        .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
    let (mut flow, accept) = match ReceiverFlow::accept(
        &start,
        &spec,
        control_peer,
        dp.local_addr().port(),
        cfg.rate().period_ns,
        now(),
    ) {
        Ok(ok) => {
            if let Some(n) = resize {
                *tensor =
                    Tensor::zeros_bytes(tensor.dtype(), n).ok_or(TransferError::Protocol {
                        flow: unknown,
                        source: ProtoError::Unexpected {
                            what: "a size that is not whole elements",
                            state: "accepting",
                        },
                    })?;
            }
            ok
        }
        Err(reject) => {
            ctrl.send(&reject)?;
            let flow = FlowId {
                job: start.job_id,
                tensor: start.tensor_id,
                round: start.round,
            };
            let source = match reject {
                CtrlMsg::FlowReject { code, reason, .. } => {
                    ProtoError::Rejected { flow, code, reason }
                }
                _ => ProtoError::Unexpected {
                    what: "reject",
                    state: "accepting",
                },
            };
            return Err(TransferError::Protocol { flow, source });
        }
    };
    flow.set_no_progress_timeout(
        u64::try_from(cfg.no_progress_timeout.as_nanos()).unwrap_or(u64::MAX),
    );
    flow.set_max_backoff(u64::try_from(cfg.max_backoff.as_nanos()).unwrap_or(u64::MAX));
    if let Some(session) = ctrl.session() {
        flow.authenticate(session.flow_key(
            start.job_id,
            start.tensor_id,
            start.round,
            &start.flow_nonce,
        ));
    }
    // Before FlowAccept: the sender sends nothing earlier, so its first packet gets through.
    dp.admit_peers(flow.peers()).map_err(dp_err(dp.name()))?;
    admitted.extend_from_slice(flow.peers());
    // This flow's share of the downlink, announced right after FlowAccept (by `poll`).
    let pool = cfg.grant_pool();
    let remaining = |f: &ReceiverFlow| f.layout().size_bytes().saturating_sub(f.stats().bytes);
    // The job priority the sender announced is the flow's class in the downlink's pool: the
    // most urgent flows present share it, the others trickle (MLNET §3.2).
    let class = start.priority;
    let mut membership = pool.join_class(flow.layout().size_bytes(), class);
    flow.set_grant(membership.grant_bps(remaining(&flow)));
    let flow_id = flow.id();
    let proto = |source| TransferError::Protocol {
        flow: flow_id,
        source,
    };
    ctrl.send(&accept)?;
    // The grant goes right behind the acceptance: the sender paces at it from the start.
    send_due(&mut flow, ctrl, &pool, class, now())?;

    let period = Duration::from_nanos(cfg.rate().period_ns);
    let mut last_progress = Instant::now();
    let buf = tensor.as_bytes_mut();
    let mut place =
        |flow: &mut ReceiverFlow, rejected: &mut RejectCounts, meta: &RxMeta, d: &[u8], t: u64| {
            if let Err(e) = flow.on_datagram(meta.src, d, buf, meta.tos, t) {
                rejected.count_datagram(e);
            }
        };
    while !flow.is_done() {
        let t = now();
        let seen = |f: &ReceiverFlow| f.stats().placed + f.stats().duplicates;
        let before = seen(&flow);
        dp.recv(cfg.batch, period, &mut |meta: &RxMeta, d: &[u8]| {
            place(&mut flow, &mut rejected, meta, d, t)
        })
        .map_err(dp_err(dp.name()))?;
        // Only data of this flow is progress: junk aimed at the port must not keep a stalled
        // transfer alive.
        if seen(&flow) > before {
            last_progress = Instant::now();
        }
        if flow.wants_data() {
            flow.set_grant(membership.grant_bps(remaining(&flow)));
        } else {
            membership.leave();
        }
        send_due(&mut flow, ctrl, &pool, class, now())?;
        while !flow.is_done() {
            let Some(m) = ctrl.recv(Duration::ZERO)? else {
                break;
            };
            last_progress = Instant::now();
            if matches!(m, CtrlMsg::FlowStop { .. }) && flow.phase() == ReceiverPhase::Receiving {
                // Data sent before FlowStop may still sit in the socket: place it before
                // deciding what to ask for again.
                let t = now();
                // Bounded: a flood on the data port cannot hold the control channel hostage.
                for _ in 0..1024 {
                    let n = dp
                        .recv(cfg.batch, Duration::ZERO, &mut |meta: &RxMeta, d: &[u8]| {
                            place(&mut flow, &mut rejected, meta, d, t)
                        })
                        .map_err(dp_err(dp.name()))?;
                    if n == 0 {
                        break;
                    }
                }
                send_due(&mut flow, ctrl, &pool, class, now())?;
            }
            if let Some(reply) = flow.on_ctrl(m, now()).map_err(proto)? {
                ctrl.send(&reply)?;
            }
        }
        if last_progress.elapsed() > cfg.idle_timeout {
            return Err(TransferError::Stalled {
                peer: ctrl.peer(),
                timeout: cfg.idle_timeout,
                during: match flow.phase() {
                    ReceiverPhase::Receiving => "receiving data",
                    _ => "waiting for FinishConfirm",
                },
                flow: flow_id,
            });
        }
    }
    let layout = *flow.layout();
    let bitmap = flow.bitmap().clone();
    if opts.fill == MissingFill::Zero {
        for i in (0..layout.count()).filter(|&i| !bitmap.get(i)) {
            if let Some((off, len)) = layout.segment(i) {
                if let Some(dst) = buf.get_mut(off as usize..off as usize + len) {
                    dst.fill(0);
                }
            }
        }
    }
    let stats = flow.stats();
    let ns = |t: Option<u64>| Duration::from_nanos(t.unwrap_or(0).saturating_sub(stats.start_ns));
    Ok(RecvReport {
        flow: flow_id,
        size_bytes: layout.size_bytes(),
        segments: layout.count(),
        received_segments: bitmap.count_ones(),
        delivered_fraction: bitmap.fraction(),
        loss_bound: flow.loss_bound().as_fraction(),
        rounds: stats.retransmit_requests,
        stats,
        rejected,
        fct: ns(stats.bound_met_ns),
        total: ns(stats.done_ns),
        fill: opts.fill,
        bitmap,
        layout,
    })
}

/// Sends the receiver's messages that are due, feeding each rate report's packet and CE
/// counts to the downlink's grant pool.
fn send_due<C: CtrlChannel + ?Sized>(
    flow: &mut ReceiverFlow,
    ctrl: &mut C,
    pool: &GrantPool,
    class: u8,
    now_ns: u64,
) -> Result<(), TransferError> {
    while let Some(m) = flow.poll(now_ns) {
        if let CtrlMsg::RateReport {
            packets,
            ce_packets,
            ..
        } = m
        {
            pool.record_class(packets, ce_packets, class);
        }
        ctrl.send(&m)?;
    }
    Ok(())
}

/// Accept one control connection on `listener`, waiting at most `timeout`.
pub fn accept_within(
    listener: &TcpListener,
    timeout: Duration,
) -> Result<TcpStream, TransferError> {
    let local = listener.local_addr().map_or("?".into(), |a| a.to_string());
    let io = |source| {
        TransferError::Channel(ChannelError::Io {
            peer: format!("listener {local}"),
            source,
        })
    };
    listener.set_nonblocking(true).map_err(io)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            // TcpCtrl sets the stream's own blocking mode.
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(TransferError::Stalled {
                        peer: local.clone(),
                        timeout,
                        during: "waiting for a sender to connect",
                        flow: FlowId {
                            job: 0,
                            tensor: 0,
                            round: 0,
                        },
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
}

/// The sending end of a control connection plus a datapath: `dlcp_send`.
#[derive(Debug)]
pub struct Sender<D> {
    dp: D,
    ctrl: TcpCtrl,
    cfg: TransferConfig,
    /// The rate the previous flow ended at (rate memory across tensors to this receiver).
    last_rate_bps: Option<u64>,
}

impl<D: Datapath> Sender<D> {
    /// Connect to a receiver's control address (a plain job).
    pub fn connect(
        ctrl_addr: SocketAddr,
        dp: D,
        cfg: TransferConfig,
    ) -> Result<Sender<D>, TransferError> {
        Sender::connect_with(ctrl_addr, dp, cfg, None)
    }

    /// Connect to a receiver's control address, proving the job secret when `key` is given
    /// (an authenticated job: every flow's data is then sealed).
    pub fn connect_with(
        ctrl_addr: SocketAddr,
        dp: D,
        cfg: TransferConfig,
        key: Option<&JobKey>,
    ) -> Result<Sender<D>, TransferError> {
        cfg.validate()?;
        let ctrl = TcpCtrl::connect_with(ctrl_addr, cfg.connect_timeout, cfg.control_dscp, key)?;
        Ok(Sender {
            dp,
            ctrl,
            cfg,
            last_rate_bps: None,
        })
    }

    /// A sender over an already connected control channel (e.g. one connected with retries
    /// while the receiver starts up).
    pub fn with_channel(
        ctrl: TcpCtrl,
        dp: D,
        cfg: TransferConfig,
    ) -> Result<Sender<D>, TransferError> {
        cfg.validate()?;
        Ok(Sender {
            dp,
            ctrl,
            cfg,
            last_rate_bps: None,
        })
    }

    /// Send a tensor, tagging each segment with `prio`.
    pub fn send(
        &mut self,
        tensor: &Tensor,
        opts: &SendOptions,
        prio: &PriorityFn<'_>,
    ) -> Result<SendReport, TransferError> {
        let ip = self.ctrl.peer_addr().ip();
        let remembered;
        let cfg = match self.last_rate_bps {
            Some(r) if self.cfg.rate_memory && self.cfg.sender.initial_rate_bps.is_none() => {
                let mut c = self.cfg.clone();
                c.sender.initial_rate_bps = Some(r);
                remembered = c;
                &remembered
            }
            _ => &self.cfg,
        };
        let report = send_tensor(&mut self.dp, &mut self.ctrl, ip, tensor, opts, prio, cfg)?;
        self.last_rate_bps = Some(report.final_rate_bps);
        Ok(report)
    }

    /// The datapath.
    pub fn datapath(&self) -> &D {
        &self.dp
    }
}

/// The receiving end: `dlcp_recv`.
#[derive(Debug)]
pub struct Receiver<D> {
    dp: D,
    ctrl: TcpCtrl,
    cfg: TransferConfig,
}

impl<D: Datapath> Receiver<D> {
    /// Wait (at most `cfg.connect_timeout`) for one sender to complete the handshake on
    /// `listener` (which authenticates it if the listener has the job's key; clients that do
    /// not speak or do not prove the secret never get this far).
    pub fn accept(
        listener: &CtrlListener,
        dp: D,
        cfg: TransferConfig,
    ) -> Result<Receiver<D>, TransferError> {
        cfg.validate()?;
        let ctrl = listener.accept(cfg.connect_timeout)?;
        Ok(Receiver { dp, ctrl, cfg })
    }

    /// A receiver over an already established control channel (e.g. one a
    /// `CtrlListener` accepted).
    pub fn with_channel(
        ctrl: TcpCtrl,
        dp: D,
        cfg: TransferConfig,
    ) -> Result<Receiver<D>, TransferError> {
        cfg.validate()?;
        Ok(Receiver { dp, ctrl, cfg })
    }

    /// Receive a tensor with the options' loss bound.
    pub fn recv(
        &mut self,
        tensor: &mut Tensor,
        opts: &RecvOptions,
    ) -> Result<RecvReport, TransferError> {
        recv_tensor(&mut self.dp, &mut self.ctrl, tensor, opts, &self.cfg)
    }

    /// The datapath.
    pub fn datapath(&self) -> &D {
        &self.dp
    }
}
