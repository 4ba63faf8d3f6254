//! A group: one rank's endpoint of the message layer and the collectives over it, blocking
//! (wait on the operation's handle) or asynchronous (the handle itself).
//!
//! Set-up is two-phase like the session's: [`PendingGroup::bind`] binds the socket and gives
//! the address; with every rank's address, [`PendingGroup::start`] starts the endpoint.
//! Every rank must start the same operations in the same order (as with MPI and NCCL).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gradwire::auth::MemberEntry;
use gradwire::tensor::DType;
use gradwire_msg::core::{RecvOpts, RecvReport, SendOpts};
use gradwire_msg::endpoint::{Bound, Endpoint, EndpointConfig, EndpointError, EndpointStats};
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Handle, OpError};

use crate::aggregate::ReduceOp;
use crate::algo::barrier::Barrier;
use crate::algo::bcast::{Broadcast, BroadcastOutcome};
use crate::algo::direct::Direct;
use crate::algo::ring::{Halves, Ring};
use crate::algo::tree::TreeAllReduce;
use crate::algo::{ReduceOutcome, ReduceSpec, Tagging};
use crate::comm::TensorMut;
use crate::deadline::{StepDeadline, StepTimes};
use crate::error::CollectiveError;
use crate::tree::Tree;
use gradwire_msg::p2p::{Recv, Send, SendDone};

/// How a group is set up.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// The endpoint's settings (job, rank, world, timers, socket).
    pub endpoint: EndpointConfig,
    /// Longest wait for one operation; then it is cancelled. A silent peer fails earlier,
    /// after the core's peer timeout, naming it.
    pub op_timeout: Duration,
    /// Move the datagrams over an AF_XDP socket on this interface (queue 0) instead of
    /// kernel UDP, the XDP allowlist holding the job's peers (cargo feature `afxdp`; root).
    pub afxdp_ifname: Option<String>,
}

impl GroupConfig {
    /// Rank `rank` of `world` in `job` at `ip` (any port), with a `timeout` for a silent peer.
    pub fn new(job: u32, rank: usize, world: usize, ip: IpAddr, timeout: Duration) -> GroupConfig {
        let mut endpoint =
            EndpointConfig::new(job, rank as u16, world as u16, SocketAddr::new(ip, 0));
        endpoint.core.peer_timeout = timeout;
        GroupConfig {
            endpoint,
            op_timeout: timeout.saturating_mul(4),
            afxdp_ifname: None,
        }
    }
}

/// Which all-reduce algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllReduceAlgo {
    /// Two-phase up to 32 KiB or for two ranks, ring above.
    #[default]
    Auto,
    /// Reduce-scatter then all-gather around the ring.
    Ring,
    /// The two-phase all-to-all all-reduce.
    Direct,
}

impl AllReduceAlgo {
    /// `auto`, `ring` or `direct`.
    pub fn parse(s: &str) -> Option<AllReduceAlgo> {
        match s {
            "auto" => Some(AllReduceAlgo::Auto),
            "ring" => Some(AllReduceAlgo::Ring),
            "direct" => Some(AllReduceAlgo::Direct),
            _ => None,
        }
    }

    /// The algorithm `Auto` picks for `bytes` over `world` ranks: the two-phase algorithm
    /// moves the same bytes per rank as the ring in two rounds instead of 2 (world - 1), which
    /// wins while a step's latency matters; above 32 KiB every rank receiving from all others
    /// at once (an incast the layer does not yet schedule with grants) costs more than the
    /// ring's rounds. Measured with 4 ranks (docs/results.md, all-reduce against Gloo): on
    /// the emulated fabric two-phase 0.55x Gloo's time at 16 KiB (ring 0.59x) but 1.5-2.3x at
    /// 256 KiB-1 MiB (ring 1.03-1.09x); on loopback the two are within noise above 16 KiB.
    pub fn resolve(self, bytes: usize, world: usize) -> AllReduceAlgo {
        match self {
            AllReduceAlgo::Auto if world <= 2 || bytes <= 32 << 10 => AllReduceAlgo::Direct,
            AllReduceAlgo::Auto => AllReduceAlgo::Ring,
            other => other,
        }
    }
}

/// Options of an all-reduce.
#[derive(Debug, Clone, Default)]
pub struct GroupReduceOptions {
    /// Sum or average.
    pub op: ReduceOp,
    /// DLCP loss bound of the reduce-scatter half (0: reliable).
    pub loss_bound: f64,
    /// Algorithm.
    pub algorithm: AllReduceAlgo,
    /// DSCP of the data.
    pub dscp: u8,
    /// DNN layer.
    pub layer: u16,
    /// A time bound per reduce-scatter step: none, fixed, or adaptive from the steps this
    /// group's blocking calls saw (see [`crate::deadline`]).
    pub step_deadline: StepDeadline,
    /// Element ranges of the tensor (ascending, disjoint: the parameters it coalesces) each
    /// held to the loss bound on its own. Empty: the tensor as a whole.
    pub ranges: Vec<std::ops::Range<usize>>,
    /// Tagging of the lossy steps' segments (default: DLCP's, by gradient magnitude).
    pub tagging: Tagging,
    /// Check every all-gather chunk against its owner's digest, sent to each rank directly
    /// (ring only; see [`ReduceSpec::verify_results`]).
    pub verify_results: bool,
    /// Tests: this rank changes the chunks it forwards ([`ReduceSpec`]'s `tamper`).
    #[cfg(test)]
    pub(crate) tamper: Option<usize>,
}

/// A group before its endpoint starts.
#[derive(Debug)]
pub struct PendingGroup {
    bound: Bound,
    cfg: GroupConfig,
}

impl PendingGroup {
    /// Binds this rank's socket.
    pub fn bind(cfg: GroupConfig) -> Result<PendingGroup, CollectiveError> {
        let bound = match &cfg.afxdp_ifname {
            None => Endpoint::bind(cfg.endpoint.clone())
                .map_err(|e| CollectiveError::Setup(e.to_string()))?,
            Some(ifname) => bind_afxdp(&cfg, ifname)?,
        };
        Ok(PendingGroup { bound, cfg })
    }

    /// The address every other rank needs.
    pub fn address(&self) -> SocketAddr {
        self.bound.local_addr()
    }

    /// Authenticated groups (`cfg.endpoint.auth`): this rank's member entry, to publish with
    /// its address.
    pub fn member(&self) -> Option<MemberEntry> {
        self.bound.member()
    }

    /// Starts the endpoint with `table[r]` = rank r's address (plain groups).
    pub fn start(self, table: Vec<SocketAddr>) -> Result<Group, CollectiveError> {
        let ep = self
            .bound
            .start(table)
            .map_err(|e| CollectiveError::Setup(e.to_string()))?;
        Ok(self.cfg.group(ep))
    }

    /// Starts an authenticated group's endpoint with every rank's address and member entry
    /// (`members[r]` as rank r published it): every datagram sealed with its pair of ranks'
    /// key.
    pub fn start_sealed(
        self,
        table: Vec<SocketAddr>,
        members: &[MemberEntry],
    ) -> Result<Group, CollectiveError> {
        let members: Vec<Option<MemberEntry>> = members.iter().copied().map(Some).collect();
        let ep = self
            .bound
            .start_sealed(table, &members)
            .map_err(|e| match e {
                EndpointError::Member { rank, source } => CollectiveError::PeerSetup {
                    peer: usize::from(rank),
                    reason: format!("its message-layer member key is refused: {source}"),
                },
                e => CollectiveError::Setup(e.to_string()),
            })?;
        Ok(self.cfg.group(ep))
    }
}

impl PendingGroup {
    /// Starts the endpoint from the message-layer entries of a links table (every rank's
    /// address, and in an authenticated group every rank's member key): sealed when this
    /// group has a job key. A rank that published no address, or whose authentication
    /// differs from this one's (a member key where this rank has no secret, or none where
    /// it has one), fails the set-up naming it.
    pub fn start_from(self, links: &crate::link::Links) -> Result<Group, CollectiveError> {
        let setup = |peer: usize, reason: &str| CollectiveError::PeerSetup {
            peer,
            reason: reason.into(),
        };
        let table = links
            .msg_addrs()
            .iter()
            .enumerate()
            .map(|(r, a)| {
                a.ok_or_else(|| {
                    setup(
                        r,
                        "it runs no message layer: it has the message layer off, or runs an \
                         older gradwire; give every rank the same settings",
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let members = links.msg_members();
        if self.cfg.endpoint.auth.is_none() {
            if let Some(r) = members.iter().position(Option::is_some) {
                return Err(setup(
                    r,
                    "it is authenticated (a job secret there, none here): give every rank \
                     the same secret",
                ));
            }
            return self.start(table);
        }
        let members = members
            .iter()
            .enumerate()
            .map(|(r, m)| {
                m.ok_or_else(|| {
                    setup(
                        r,
                        "it published no message-layer member key: it runs without the job \
                         secret, or an older gradwire; give every rank the same secret",
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.start_sealed(table, &members)
    }
}

impl GroupConfig {
    fn group(self, ep: Endpoint) -> Group {
        Group {
            ep,
            cfg: self,
            failed: Arc::new(Mutex::new(None)),
            steps: std::sync::Mutex::new(StepTimes::default()),
        }
    }
}

/// The endpoint over an AF_XDP socket on `ifname` (its huge pages when the machine has
/// them reserved, else ordinary memory).
#[cfg(feature = "afxdp")]
fn bind_afxdp(cfg: &GroupConfig, ifname: &str) -> Result<Bound, CollectiveError> {
    use gradwire_msg::io::xdp::{XdpIo, XdpIoConfig};
    let mut x = XdpIoConfig::new(ifname, cfg.endpoint.bind);
    let io = match XdpIo::open(&x) {
        Ok(io) => io,
        Err(e) if x.socket.hugepages => {
            log::info!("AF_XDP socket on {ifname} without huge pages ({e})");
            x.socket.hugepages = false;
            XdpIo::open(&x)
                .map_err(|e| CollectiveError::Setup(format!("AF_XDP on {ifname}: {e}")))?
        }
        Err(e) => return Err(CollectiveError::Setup(format!("AF_XDP on {ifname}: {e}"))),
    };
    Endpoint::with_io(cfg.endpoint.clone(), Box::new(io))
        .map_err(|e| CollectiveError::Setup(e.to_string()))
}

#[cfg(not(feature = "afxdp"))]
fn bind_afxdp(_: &GroupConfig, ifname: &str) -> Result<Bound, CollectiveError> {
    Err(CollectiveError::Config(format!(
        "an AF_XDP socket on {ifname} was asked for, but gradwire-collective was built \
         without its `afxdp` feature: build with it (it needs clang and libbpf) or use UDP"
    )))
}

/// One rank's group. After an operation fails the ranks may disagree on where they are in
/// the sequence of operations, so the group refuses every later one (build a new group).
#[derive(Debug)]
pub struct Group {
    ep: Endpoint,
    cfg: GroupConfig,
    /// Why the group is unusable (shared with started operations, which set it on failure).
    failed: Arc<Mutex<Option<String>>>,
    /// Recent reduce-scatter steps, for adaptive time bounds.
    steps: std::sync::Mutex<StepTimes>,
}

fn op_err(e: OpError) -> CollectiveError {
    match e {
        OpError::Data { peer, reason } => CollectiveError::Data {
            peer: usize::from(peer),
            reason,
        },
        OpError::Invalid(m) => CollectiveError::Config(m),
        e => match e.peer() {
            Some(peer) => CollectiveError::Peer {
                peer: usize::from(peer),
                reason: e.to_string(),
            },
            None => CollectiveError::Unusable(e.to_string()),
        },
    }
}

/// Marks the group failed by `e` (unless it was an invalid argument, which started nothing).
fn fail(failed: &Mutex<Option<String>>, e: OpError) -> CollectiveError {
    if !matches!(e, OpError::Invalid(_)) {
        *failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
    }
    op_err(e)
}

/// An operation started on a group ([`Group::start_all_reduce`] and the other `start_`
/// calls): test it, or wait for its outcome. It is cancelled at the group's operation timeout
/// (counted from its start). Dropped before it completed, it is cancelled and waited for, so
/// the memory it was given is free once the `Work` is gone: a caller that lends it memory
/// ([`Region::borrowed`]) keeps that memory alive and untouched until the `Work` is dropped
/// or waited for.
#[must_use = "an operation's outcome says what it delivered; dropping it cancels the operation"]
pub struct Work<T> {
    handle: Option<Handle<T>>,
    failed: Arc<Mutex<Option<String>>>,
    deadline: Instant,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("done", &self.test()).finish()
    }
}

impl<T> Work<T> {
    /// Whether the operation has completed (its outcome is ready).
    pub fn test(&self) -> bool {
        self.handle.as_ref().is_none_or(Handle::test)
    }

    /// Waits for the outcome, at most until the operation's timeout (then it is cancelled
    /// and still waited for). A failure makes the group unusable.
    pub fn wait(mut self) -> Result<T, CollectiveError> {
        let Some(h) = self.handle.take() else {
            return Err(CollectiveError::Unusable(
                "the outcome was already taken".into(),
            ));
        };
        let left = self.deadline.saturating_duration_since(Instant::now());
        let r = match h.wait_timeout(left) {
            Ok(r) => r,
            Err(h) => {
                h.cancel();
                h.wait()
            }
        };
        r.map_err(|e| fail(&self.failed, e))
    }

    /// Runs `f` on the progress thread when the operation completes (now if it has), with
    /// whether it succeeded; the outcome stays for [`Work::wait`]. `f` must be quick and must
    /// not wait for an operation of this group.
    pub fn on_complete(&self, f: impl FnOnce(bool) + std::marker::Send + 'static) {
        match &self.handle {
            Some(h) => h.on_complete(move |r| f(r.is_ok())),
            None => f(false),
        }
    }
}

impl Work<(Option<Region>, RecvReport)> {
    /// Waits for a receive from `peer` started with [`Group::start_recv`] and checks that
    /// every segment was sent as tensor `tensor`.
    pub fn wait_tensor(
        self,
        peer: usize,
        tensor: u32,
    ) -> Result<(Option<Region>, RecvReport), CollectiveError> {
        let failed = Arc::clone(&self.failed);
        let (region, report) = self.wait()?;
        match wrong_tensor(peer, tensor, &report) {
            None => Ok((region, report)),
            Some(e) => Err(fail(&failed, e)),
        }
    }
}

impl<T> Drop for Work<T> {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            if !h.test() {
                h.cancel();
            }
            // Waited for even when cancelled: the operation may use its memory until then.
            let _ = h.wait();
        }
    }
}

impl Group {
    /// Refuses an operation after an earlier failure.
    fn usable(&self) -> Result<(), CollectiveError> {
        match &*self.failed.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(why) => Err(CollectiveError::Unusable(why.clone())),
            None => Ok(()),
        }
    }

    /// Runs one blocking operation: refused after a failure; a failure (other than invalid
    /// arguments, which start nothing) makes the group unusable.
    fn guard<T>(&self, f: impl FnOnce() -> Result<T, OpError>) -> Result<T, CollectiveError> {
        self.usable()?;
        f().map_err(|e| fail(&self.failed, e))
    }

    /// Submits `op` (refused after a failure): its handle, which marks the group failed if
    /// the operation fails and waits for it when dropped.
    fn start<O: gradwire_msg::op::Op>(&self, op: O) -> Result<Work<O::Output>, CollectiveError> {
        self.usable()?;
        Ok(Work {
            handle: Some(self.ep.submit(op)),
            failed: Arc::clone(&self.failed),
            deadline: Instant::now() + self.cfg.op_timeout,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        usize::from(self.ep.rank())
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        usize::from(self.ep.world())
    }

    /// The endpoint's counters.
    pub fn stats(&self) -> EndpointStats {
        self.ep.stats()
    }

    fn spec(&self, dtype: DType, o: &GroupReduceOptions) -> Result<ReduceSpec, CollectiveError> {
        if o.dscp > gradwire_qos::MAX_DSCP {
            return Err(CollectiveError::Config(format!(
                "DSCP {} is above {}",
                o.dscp,
                gradwire_qos::MAX_DSCP
            )));
        }
        o.step_deadline
            .validate()
            .map_err(CollectiveError::Config)?;
        if !o.op.tolerates_loss() && (o.loss_bound > 0.0 || o.step_deadline != StepDeadline::None) {
            return Err(CollectiveError::Config(format!(
                "a {} all-reduce is reliable only: a block missing some ranks has no {} to \
                 estimate, so give it loss bound 0 and no step deadline",
                o.op.name(),
                o.op.name()
            )));
        }
        let step_deadline = self
            .steps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bound(&o.step_deadline);
        Ok(ReduceSpec {
            dtype,
            op: o.op,
            loss_bound: o.loss_bound,
            // ECN-capable: switches mark rather than drop above their thresholds.
            tos: (o.dscp << 2) | 0b10,
            layer: o.layer,
            step_deadline,
            ranges: o
                .ranges
                .iter()
                .map(|r| {
                    r.start.saturating_mul(dtype.elem_size())
                        ..r.end.saturating_mul(dtype.elem_size())
                })
                .collect(),
            tagging: o.tagging,
            verify_results: o.verify_results,
            #[cfg(test)]
            tamper: o.tamper,
        })
    }

    /// The time bound the next reduction's steps would get under `d` (what an adaptive bound
    /// has learned so far).
    pub fn step_bound(&self, d: &StepDeadline) -> Option<Duration> {
        self.steps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bound(d)
    }

    /// Learns the steps of a finished reduction (for adaptive time bounds).
    fn learn(
        &self,
        r: Result<ReduceOutcome, CollectiveError>,
    ) -> Result<ReduceOutcome, CollectiveError> {
        if let Ok(out) = &r {
            let mut t = self.steps.lock().unwrap_or_else(PoisonError::into_inner);
            for s in &out.steps {
                t.record(s.waited);
            }
        }
        r
    }

    /// All-reduce of the caller's tensor in place.
    pub fn all_reduce(
        &self,
        t: TensorMut<'_>,
        o: &GroupReduceOptions,
    ) -> Result<ReduceOutcome, CollectiveError> {
        let spec = self.spec(t.dtype(), o)?;
        let algo = o.algorithm.resolve(t.as_bytes().len(), self.world());
        let mut t = t;
        let bytes = t.as_bytes_mut();
        self.learn(self.guard(|| {
            self.ep
                .run_borrowed(bytes, self.cfg.op_timeout, |r| all_reduce_op(algo, r, spec))
        }))
    }

    /// All-reduce in place over an MLNET aggregation/multicast tree (it must span every
    /// rank; every rank gives the same tree).
    pub fn all_reduce_tree(
        &self,
        t: TensorMut<'_>,
        tree: &Tree,
        o: &GroupReduceOptions,
    ) -> Result<ReduceOutcome, CollectiveError> {
        let spec = self.spec(t.dtype(), o)?;
        let mut t = t;
        let bytes = t.as_bytes_mut();
        self.learn(self.guard(|| {
            self.ep.run_borrowed(bytes, self.cfg.op_timeout, |r| {
                TreeAllReduce::new(r, spec, tree.clone())
            })
        }))
    }

    /// Starts an all-reduce of `region` (elements of `dtype`) in place; the outcome gives the
    /// region back. Its time bound is the one the group has learned so far; its own steps are
    /// not learned (only the blocking calls', which see their outcome).
    pub fn start_all_reduce(
        &self,
        dtype: DType,
        region: Region,
        o: &GroupReduceOptions,
    ) -> Result<Work<ReduceOutcome>, CollectiveError> {
        let spec = self.spec(dtype, o)?;
        let algo = o.algorithm.resolve(region.len(), self.world());
        self.start(all_reduce_op(algo, region, spec))
    }

    /// Starts a reduce-scatter of `region` in place (rank r's chunk r holds the result:
    /// [`Group::chunk`]).
    pub fn start_reduce_scatter(
        &self,
        dtype: DType,
        region: Region,
        o: &GroupReduceOptions,
    ) -> Result<Work<ReduceOutcome>, CollectiveError> {
        let spec = self.spec(dtype, o)?;
        self.start(Ring::new(region, spec, Halves::ReduceScatter))
    }

    /// Starts an all-gather of `region` in place: chunk r ([`Group::chunk`]), filled by rank
    /// r, reaches every rank.
    pub fn start_all_gather(&self, region: Region) -> Result<Work<ReduceOutcome>, CollectiveError> {
        self.start(Ring::new(region, gather_spec(), Halves::AllGather))
    }

    /// Starts a broadcast of `region` from `root`, each hop under `loss_bound` (0: reliable).
    pub fn start_broadcast(
        &self,
        region: Region,
        root: usize,
        loss_bound: f64,
    ) -> Result<Work<BroadcastOutcome>, CollectiveError> {
        self.check_rank(root, "root")?;
        self.start(Broadcast::new(region, root, 0b10, loss_bound))
    }

    /// Starts a barrier.
    pub fn start_barrier(&self) -> Result<Work<()>, CollectiveError> {
        self.start(Barrier::new())
    }

    /// Starts a send of `region` to `peer` as tensor `tensor`, each segment with its own TOS
    /// byte (as [`Group::send`]).
    pub fn start_send(
        &self,
        peer: usize,
        region: Region,
        tensor: u32,
        tos_per_segment: Vec<u8>,
    ) -> Result<Work<SendDone>, CollectiveError> {
        self.check_rank(peer, "peer")?;
        let segs = region.len().div_ceil(self.block_bytes()).max(1);
        let opts = SendOpts {
            tos: 0b10,
            meta: vec![u64::from(tensor); segs],
            tos_per_segment,
            ..SendOpts::default()
        };
        self.start(Send::new(region, peer as u16, opts))
    }

    /// Starts a receive of tensor `tensor` from `peer` into `region` (the sender's length)
    /// under `loss_bound`; wait with [`Work::wait_tensor`].
    pub fn start_recv(
        &self,
        peer: usize,
        region: Region,
        loss_bound: f64,
    ) -> Result<Work<(Option<Region>, RecvReport)>, CollectiveError> {
        self.check_rank(peer, "peer")?;
        let opts = RecvOpts {
            loss_bound,
            keep_meta: true,
            ..RecvOpts::default()
        };
        self.start(Recv::new(region, peer as u16, opts))
    }

    fn check_rank(&self, r: usize, what: &str) -> Result<(), CollectiveError> {
        if r >= self.world() || r == self.rank() && what == "peer" {
            return Err(CollectiveError::Config(format!(
                "{what} {r} is not another rank of this {}-rank job (this is rank {})",
                self.world(),
                self.rank()
            )));
        }
        Ok(())
    }

    /// Reduce-scatter in place: rank r's chunk r of the tensor holds the result (chunks are
    /// whole segments: [`Group::chunk`]).
    pub fn reduce_scatter(
        &self,
        t: TensorMut<'_>,
        o: &GroupReduceOptions,
    ) -> Result<ReduceOutcome, CollectiveError> {
        let spec = self.spec(t.dtype(), o)?;
        let mut t = t;
        self.learn(self.guard(|| {
            self.ep
                .run_borrowed(t.as_bytes_mut(), self.cfg.op_timeout, |r| {
                    Ring::new(r, spec, Halves::ReduceScatter)
                })
        }))
    }

    /// All-gather in place: every rank's chunk r (its own, filled by rank r) reaches all.
    pub fn all_gather(&self, bytes: &mut [u8]) -> Result<(), CollectiveError> {
        let spec = gather_spec();
        self.guard(|| {
            self.ep
                .run_borrowed(bytes, self.cfg.op_timeout, |r| {
                    Ring::new(r, spec, Halves::AllGather)
                })
                .map(|_| ())
        })
    }

    /// The byte range of chunk `c` of a `len`-byte tensor in reduce-scatter and all-gather.
    pub fn chunk(&self, len: usize, c: usize) -> std::ops::Range<usize> {
        let seg = self.ep.seg_payload();
        crate::algo::Chunks::new(len, seg, self.world()).bytes(c)
    }

    /// Runs any operation on this group's endpoint (tests build misbehaving ranks this way).
    #[doc(hidden)]
    pub fn run_op_for_tests<O: gradwire_msg::op::Op>(
        &self,
        op: O,
    ) -> Result<O::Output, CollectiveError> {
        self.guard(|| self.ep.run(op, self.cfg.op_timeout))
    }

    /// Bytes per block of a reduction (one segment's payload).
    pub fn block_bytes(&self) -> usize {
        self.ep.seg_payload()
    }

    /// Broadcast from `root` in place, each hop under `loss_bound` (0: reliable). Returns,
    /// for each block ([`Group::block_bytes`]), whether it holds the root's values (the
    /// others keep what they held).
    pub fn broadcast(
        &self,
        bytes: &mut [u8],
        root: usize,
        loss_bound: f64,
    ) -> Result<Vec<bool>, CollectiveError> {
        self.guard(|| {
            self.ep
                .run_borrowed(bytes, self.cfg.op_timeout, |r| {
                    Broadcast::new(r, root, 0b10, loss_bound)
                })
                .map(|o| o.received)
        })
    }

    /// Waits until every rank has entered the barrier.
    pub fn barrier(&self) -> Result<(), CollectiveError> {
        self.guard(|| self.ep.run(Barrier::new(), self.cfg.op_timeout))
    }

    /// Sends `bytes` to `peer` (copied once into an owned buffer) as tensor `tensor`, each
    /// segment with its own TOS byte (`tos_per_segment`, one per [`Group::block_bytes`]
    /// segment; empty: `dscp` and ECN-capable for all). Returns the segments resent.
    pub fn send(
        &self,
        peer: usize,
        bytes: &[u8],
        tensor: u32,
        dscp: u8,
        tos_per_segment: Vec<u8>,
    ) -> Result<u64, CollectiveError> {
        let segs = bytes.len().div_ceil(self.block_bytes()).max(1);
        let opts = SendOpts {
            tos: (dscp << 2) | 0b10,
            meta: vec![u64::from(tensor); segs],
            tos_per_segment,
            ..SendOpts::default()
        };
        let done = self.guard(|| {
            self.ep.run(
                Send::new(Region::owned(bytes.to_vec()), peer as u16, opts),
                self.cfg.op_timeout,
            )
        })?;
        // This message's own resends (the endpoint's counter also counts other messages').
        Ok(u64::from(done.segments).saturating_sub(segs as u64))
    }

    /// Receives tensor `tensor` from `peer` into `bytes` (the sender's length), under
    /// `loss_bound`. Transfers between two ranks match in the order both call them; a
    /// tensor id that differs from the sender's is an error naming both.
    pub fn recv(
        &self,
        peer: usize,
        bytes: &mut [u8],
        tensor: u32,
        loss_bound: f64,
    ) -> Result<RecvReport, CollectiveError> {
        let opts = RecvOpts {
            loss_bound,
            keep_meta: true,
            ..RecvOpts::default()
        };
        self.guard(|| {
            let (_, report) = self.ep.run_borrowed(bytes, self.cfg.op_timeout, |r| {
                Recv::new(r, peer as u16, opts)
            })?;
            match wrong_tensor(peer, tensor, &report) {
                None => Ok(report),
                Some(e) => Err(e),
            }
        })
    }
}

/// The all-reduce `algo` (resolved: ring or two-phase) over `region`.
fn all_reduce_op(algo: AllReduceAlgo, region: Region, spec: ReduceSpec) -> Either<Ring, Direct> {
    match algo {
        AllReduceAlgo::Ring => Either::A(Ring::new(region, spec, Halves::Both)),
        _ => Either::B(Direct::new(region, spec)),
    }
}

/// The spec of an all-gather: raw bytes, copied, reliable.
fn gather_spec() -> ReduceSpec {
    ReduceSpec {
        dtype: DType::Raw,
        op: ReduceOp::Sum,
        loss_bound: 0.0,
        tos: 0b10,
        layer: 0,
        step_deadline: None,
        ranges: Vec::new().into(),
        tagging: Tagging::Layer,
        verify_results: false,
        #[cfg(test)]
        tamper: None,
    }
}

/// The error when a receive from `peer` holds a segment of another tensor than `tensor`.
fn wrong_tensor(peer: usize, tensor: u32, report: &RecvReport) -> Option<OpError> {
    let theirs = (0..report.segments as usize)
        .filter(|&s| report.has(s))
        .map(|s| report.meta.get(s).copied().unwrap_or(0))
        .find(|&m| m != u64::from(tensor))?;
    Some(OpError::Data {
        peer: peer as u16,
        reason: format!(
            "it sent tensor {theirs} where this rank receives tensor {tensor}: call send and \
             recv for the same tensors in the same order on both ranks"
        ),
    })
}

/// One of two operations with the same output (so one call site can pick an algorithm).
#[derive(Debug)]
enum Either<A, B> {
    A(A),
    B(B),
}

impl<A, B> gradwire_msg::op::Op for Either<A, B>
where
    A: gradwire_msg::op::Op,
    B: gradwire_msg::op::Op<Output = A::Output>,
{
    type Output = A::Output;

    fn start(&mut self, cx: &mut gradwire_msg::op::OpCx<'_>) -> gradwire_msg::op::Step<A::Output> {
        match self {
            Either::A(a) => a.start(cx),
            Either::B(b) => b.start(cx),
        }
    }

    fn on_event(
        &mut self,
        ev: gradwire_msg::op::OpEvent,
        cx: &mut gradwire_msg::op::OpCx<'_>,
    ) -> gradwire_msg::op::Step<A::Output> {
        match self {
            Either::A(a) => a.on_event(ev, cx),
            Either::B(b) => b.on_event(ev, cx),
        }
    }
}
