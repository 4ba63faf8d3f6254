//! The AF_XDP datapath: gradwire's kernel-bypass path.
//!
//! One [`socket::XskSocket`] per configured queue, each with its own UMEM, and one XDP
//! classifier ([`gradwire_ebpf::XdpProgram`]) on the interface that redirects gradwire's UDP
//! port to those sockets and passes everything else (ARP, ssh, the TCP control channel) to
//! the kernel.
//!
//! Receive: descriptors come off the RX ring pointing into UMEM frames; the frame is parsed
//! in place ([`crate::wire::frame::parse`], checksums verified) and the datagram slice handed
//! to the caller, who copies the payload once, straight into the tensor; the frame then goes
//! back to the FILL ring in batches. Transmit: the caller writes the datagram (header and
//! payload, one copy from the tensor) into a free UMEM frame after room for the
//! Ethernet/IP/UDP headers, which [`crate::wire::frame::emit_headers`] then fills in front;
//! descriptors go to the TX ring in batches and completions are reaped back to the free list.
//!
//! Waiting is wake-on-demand by default (a short spin on the RX ring, then `poll()` on the
//! socket), which is what tests and 2-core machines need; busy-poll mode spins and drives
//! NAPI with `recvfrom(MSG_DONTWAIT)` instead, for pinned cores on real hosts.
//!
//! The layering follows s2n-quic-xdp: [`syscall`] (the raw calls), [`umem`], [`ring`],
//! [`socket`], and this module on top; only the first three and [`engine`] (frames lent
//! between threads) contain `unsafe`.

pub mod engine;
pub mod neigh;
pub mod port;
pub mod ring;
pub mod socket;
pub mod syscall;
pub mod umem;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use gradwire_ebpf::{AttachMode, XdpConfig, XdpCounters, XdpProgram};

use crate::datapath::{DataSource, Datapath, DatapathError, DatapathStats, Deliver, Fill, RxMeta};
use crate::wire::frame::{self, FrameMeta};
use crate::wire::Ecn;

pub use socket::{BindMode, BusyPoll, KernelStats, SocketConfig, SocketError};

/// Bytes the kernel leaves in front of a received packet in its UMEM frame
/// (`XDP_PACKET_HEADROOM`).
pub const RX_HEADROOM: usize = 256;

/// How a thread waits for packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// Spin `spin` times on the RX ring, then sleep in `poll()` until a packet or the timeout.
    /// For tests, CI and shared machines.
    WakeOnDemand {
        /// Ring checks before sleeping.
        spin: u32,
    },
    /// Never sleep: spin on the rings and drive NAPI with `recvfrom(MSG_DONTWAIT)`. For pinned
    /// cores on real hosts and benchmarks; starves a small machine.
    BusyPoll,
}

/// Configuration of an AF_XDP datapath.
#[derive(Debug, Clone, PartialEq)]
pub struct AfXdpConfig {
    /// Interface (in the calling thread's network namespace).
    pub ifname: String,
    /// Queues to bind, one socket each.
    pub queues: Vec<u32>,
    /// Our IP address and gradwire UDP port (the classifier redirects this port).
    pub local: SocketAddr,
    /// UMEM and ring sizes, huge pages, zero-copy, busy-poll socket options.
    pub socket: SocketConfig,
    /// Descriptors per ring operation.
    pub batch: usize,
    /// How to wait.
    pub poll: PollMode,
    /// How to attach the XDP program.
    pub xdp_mode: AttachMode,
    /// Static neighbours (IP -> MAC), consulted before the kernel's neighbour table.
    pub neighbors: Vec<(IpAddr, [u8; 6])>,
    /// Peer filter in XDP: `Some(list)` (the default, empty) accepts gradwire packets only
    /// from these sources plus every flow's announced data sources, added when a receiver
    /// accepts the flow ([`Datapath::admit_peers`]), so traffic from anyone else is dropped
    /// before it reaches user space. `None` turns the filter off (raw packet generators in
    /// benchmarks); the receiver's own peer binding still applies.
    pub allowlist: Option<Vec<IpAddr>>,
    /// Fault injection in XDP: drop probability per DSCP (0..=63), for loss tests.
    pub fault_drop: Vec<(u8, f64)>,
    /// IP TTL / hop limit of sent packets.
    pub hop_limit: u8,
    /// Per-packet spraying (DLCP §3.2.3): source ports `local.port()` .. `+ spray_ports - 1`,
    /// rotating per packet, so that switches hashing flows for ECMP spread one transfer over
    /// their paths. 1 = one source port.
    pub spray_ports: u16,
}

impl AfXdpConfig {
    /// Defaults for `ifname` and `local`: queue 0, wake-on-demand, auto XDP mode.
    pub fn new(ifname: impl Into<String>, local: SocketAddr) -> AfXdpConfig {
        AfXdpConfig {
            ifname: ifname.into(),
            queues: vec![0],
            local,
            socket: SocketConfig::default(),
            batch: 64,
            poll: PollMode::WakeOnDemand { spin: 4 },
            xdp_mode: AttachMode::Auto,
            neighbors: Vec::new(),
            allowlist: Some(Vec::new()),
            fault_drop: Vec::new(),
            hop_limit: 64,
            spray_ports: 1,
        }
    }
}

/// Why an AF_XDP datapath, engine or raw port could not be set up.
///
/// Errors from the kernel keep its code ([`AfXdpError::raw_os_error`]); their message names
/// the step that failed and ends with what to do ([`gradwire_ebpf::error::hint`]).
#[derive(Debug, thiserror::Error)]
pub enum AfXdpError {
    /// Bad configuration.
    #[error("AF_XDP configuration: {0}")]
    Config(String),
    /// The interface does not exist in this network namespace.
    #[error("interface {ifname:?} not found in this network namespace: {source}")]
    NoInterface {
        /// Interface.
        ifname: String,
        /// OS error.
        source: nix::Error,
    },
    /// The XDP program could not be loaded or attached.
    #[error("XDP classifier on {ifname}: {source}")]
    Xdp {
        /// Interface.
        ifname: String,
        /// Loader error.
        source: gradwire_ebpf::XdpError,
    },
    /// An AF_XDP socket (or its worker) could not be set up.
    #[error("AF_XDP socket on {ifname} queue {queue}: {source}")]
    Socket {
        /// Interface.
        ifname: String,
        /// Queue.
        queue: u32,
        /// The step that failed, with the OS error.
        source: socket::SocketError,
    },
}

impl AfXdpError {
    /// The OS error code (`errno`) behind this error, when the kernel refused something.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            AfXdpError::Config(_) => None,
            AfXdpError::NoInterface { source, .. } => Some(*source as i32),
            AfXdpError::Xdp { source, .. } => source.raw_os_error(),
            AfXdpError::Socket { source, .. } => source.raw_os_error(),
        }
    }
}

/// The index of `ifname` in the calling thread's network namespace.
pub(crate) fn ifindex(ifname: &str) -> Result<u32, AfXdpError> {
    nix::net::if_::if_nametoindex(ifname).map_err(|source| AfXdpError::NoInterface {
        ifname: ifname.to_owned(),
        source,
    })
}

/// Loads the classifier configured by `xc` and attaches it to `ifname`.
pub(crate) fn attach_classifier(
    ifname: &str,
    ifindex: u32,
    xc: &XdpConfig,
) -> Result<XdpProgram, AfXdpError> {
    XdpProgram::attach(ifindex, xc).map_err(|source| AfXdpError::Xdp {
        ifname: ifname.to_owned(),
        source,
    })
}

/// Binds a socket (with its own UMEM) to queue `queue` of `ifname` and registers it with the
/// classifier `xdp`, so that the queue's packets are redirected to it.
pub(crate) fn bind_registered(
    ifname: &str,
    ifindex: u32,
    xdp: &XdpProgram,
    queue: u32,
    cfg: &SocketConfig,
) -> Result<socket::XskSocket, AfXdpError> {
    let sock =
        socket::XskSocket::bind(ifindex, queue, cfg).map_err(|source| AfXdpError::Socket {
            ifname: ifname.to_owned(),
            queue,
            source,
        })?;
    xdp.register_xsk(queue, std::os::fd::AsFd::as_fd(sock.fd()))
        .map_err(|source| AfXdpError::Xdp {
            ifname: ifname.to_owned(),
            source,
        })?;
    Ok(sock)
}

/// Counters of one queue's socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueStats {
    /// Queue id.
    pub queue: u32,
    /// Core the queue's worker is pinned to (engine with cores; None otherwise).
    pub core: Option<usize>,
    /// Copy or zero-copy.
    pub mode: Option<BindMode>,
    /// UMEM on huge pages.
    pub hugepages: bool,
    /// Packets delivered.
    pub rx_packets: u64,
    /// Bytes delivered (datagram bytes).
    pub rx_bytes: u64,
    /// Frames that were not valid gradwire UDP frames for us (dropped, counted).
    pub rx_malformed: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Bytes sent (whole frames).
    pub tx_bytes: u64,
    /// Send attempts that found no free frame or no TX ring room.
    pub tx_ring_full: u64,
    /// Times the FILL ring could not be refilled completely.
    pub fill_empty: u64,
    /// Times this thread slept in `poll()`.
    pub sleeps: u64,
    /// TX kicks (`sendto`).
    pub kicks: u64,
    /// The kernel's own counters.
    pub kernel: KernelStats,
}

/// Everything the AF_XDP datapath counts: per socket, and the classifier's per-DSCP/ECN view.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct AfXdpStats {
    /// Interface.
    pub ifname: String,
    /// XDP attach mode in use.
    pub xdp_mode: Option<AttachMode>,
    /// Per queue.
    pub queues: Vec<QueueStats>,
    /// The classifier's counters.
    pub xdp: Option<XdpCounters>,
}

impl AfXdpStats {
    /// The AF_XDP counters of any datapath that has them (an [`AfXdpDatapath`], an
    /// [`engine::Engine`], or a wrapper around one), through [`Datapath::backend_stats`].
    pub fn of(dp: &(impl Datapath + ?Sized)) -> Option<AfXdpStats> {
        dp.backend_stats()?
            .downcast::<AfXdpStats>()
            .ok()
            .map(|b| *b)
    }
}

struct Queue {
    sock: socket::XskSocket,
    /// TX frames not in flight.
    free_tx: Vec<u64>,
    /// RX frames consumed and not yet back on FILL.
    refill: Vec<u64>,
    rx_descs: Vec<libc::xdp_desc>,
    tx_descs: Vec<libc::xdp_desc>,
    comp: Vec<u64>,
    stats: QueueStats,
}

impl Queue {
    fn reap_completions(&mut self) {
        self.sock
            .reap_completions(&mut self.comp, &mut self.free_tx);
    }

    fn refill(&mut self) {
        if !self.sock.refill(&mut self.refill) {
            self.stats.fill_empty += 1;
        }
    }
}

/// The AF_XDP datapath.
pub struct AfXdpDatapath {
    cfg: AfXdpConfig,
    // Sockets before the program: they are closed (and leave the XSKMAP) before it detaches.
    queues: Vec<Queue>,
    xdp: XdpProgram,
    /// The live flows' sources in the classifier's allowlist.
    admitted: PeerAdmissions,
    src_mac: [u8; 6],
    neigh: neigh::Neighbors,
    ident: u16,
    tx_next: usize,
    rx_next: usize,
    stats: DatapathStats,
}

impl std::fmt::Debug for AfXdpDatapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AfXdpDatapath")
            .field("ifname", &self.cfg.ifname)
            .field("queues", &self.cfg.queues)
            .field("local", &self.cfg.local)
            .finish_non_exhaustive()
    }
}

/// What both the single-thread datapath and the engine set up first: a checked configuration,
/// the interface, and the classifier attached to it.
pub(crate) struct Attached {
    pub(crate) ifindex: u32,
    pub(crate) src_mac: [u8; 6],
    pub(crate) xdp: XdpProgram,
}

impl AfXdpConfig {
    /// Check the configuration and attach the XDP classifier to the interface.
    pub(crate) fn attach(&self) -> Result<Attached, AfXdpError> {
        let sc = &self.socket;
        if self.queues.is_empty() {
            return Err(AfXdpError::Config("at least one queue is needed".into()));
        }
        if self.batch == 0 || self.batch > sc.ring_size as usize {
            return Err(AfXdpError::Config(format!(
                "batch {} must be within 1..=ring size {}",
                self.batch, sc.ring_size
            )));
        }
        if sc.frames < 2 * sc.ring_size {
            return Err(AfXdpError::Config(format!(
                "{} UMEM frames cannot feed a FILL ring and a TX ring of {} each (need at least {})",
                sc.frames,
                sc.ring_size,
                2 * sc.ring_size
            )));
        }
        if self.local.port() == 0 {
            return Err(AfXdpError::Config(
                "the local UDP port must be set (the classifier matches on it)".into(),
            ));
        }
        if self.spray_ports == 0
            || u32::from(self.local.port()) + u32::from(self.spray_ports) > 65_536
        {
            return Err(AfXdpError::Config(format!(
                "spray_ports {} must be >= 1 and leave port {} + {} - 1 within 65535",
                self.spray_ports,
                self.local.port(),
                self.spray_ports
            )));
        }
        let ifindex = ifindex(&self.ifname)?;
        let src_mac = neigh::interface_mac(&self.ifname).ok_or_else(|| {
            AfXdpError::Config(format!("interface {} has no Ethernet address", self.ifname))
        })?;
        let mut xc = XdpConfig::new(vec![self.local.port()]);
        xc.mode = self.xdp_mode;
        xc.allowlist = self.allowlist.clone();
        for &(dscp, p) in &self.fault_drop {
            let slot = xc.fault_drop.get_mut(usize::from(dscp)).ok_or_else(|| {
                AfXdpError::Config(format!("fault injection DSCP {dscp} is not within 0..=63"))
            })?;
            *slot = p;
        }
        let xdp = attach_classifier(&self.ifname, ifindex, &xc)?;
        Ok(Attached {
            ifindex,
            src_mac,
            xdp,
        })
    }

    /// The sources this datapath's datagrams come from: its address, one port per spray port.
    pub(crate) fn data_sources(&self) -> Vec<DataSource> {
        vec![DataSource {
            addr: self.local.ip(),
            port: self.local.port(),
            ports: self.spray_ports.max(1),
        }]
    }

    /// Bind the socket of queue `q` and register it with the classifier.
    pub(crate) fn bind_queue(&self, a: &Attached, q: u32) -> Result<socket::XskSocket, AfXdpError> {
        bind_registered(&self.ifname, a.ifindex, &a.xdp, q, &self.socket)
    }

    /// The Ethernet/IP/UDP header fields of a datagram to `meta.dst` via `dst_mac`.
    pub(crate) fn frame_meta(
        &self,
        src_mac: [u8; 6],
        dst_mac: [u8; 6],
        meta: &crate::datapath::TxMeta,
        ident: u16,
    ) -> FrameMeta {
        // Rotating the source port per packet sprays one transfer over ECMP paths.
        let spray = ident % self.spray_ports.max(1);
        FrameMeta {
            src_mac,
            dst_mac,
            src: SocketAddr::new(self.local.ip(), self.local.port().wrapping_add(spray)),
            dst: meta.dst,
            dscp: meta.tos >> 2,
            ecn: Ecn::from_bits(meta.tos),
            hop_limit: self.hop_limit,
            ident,
        }
    }
}

/// The flows' sources admitted to the classifier's allowlist, counted per address: an address
/// leaves the allowlist when the last flow from it ends, so the allowlist holds the live
/// flows' peers (and the configured ones, which never leave) instead of every peer ever seen.
#[derive(Debug, Default)]
pub(crate) struct PeerAdmissions {
    flows: std::collections::HashMap<IpAddr, u32>,
}

impl PeerAdmissions {
    /// The distinct (canonical) addresses of `peers`.
    fn addrs(peers: &[DataSource]) -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = peers.iter().map(|p| p.addr.to_canonical()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// One more flow from each of `peers`: the first one adds the address to the allowlist
    /// (when the filter is on). All or nothing: on an error (a full allowlist) the addresses
    /// admitted by this call are released again.
    pub(crate) fn admit(
        &mut self,
        cfg: &AfXdpConfig,
        xdp: &XdpProgram,
        peers: &[DataSource],
    ) -> Result<(), DatapathError> {
        if cfg.allowlist.is_none() {
            return Ok(());
        }
        let addrs = Self::addrs(peers);
        for (i, &addr) in addrs.iter().enumerate() {
            let n = self.flows.entry(addr).or_insert(0);
            if *n == 0 {
                if let Err(e) = xdp.allow(addr) {
                    self.flows.remove(&addr);
                    let done: Vec<DataSource> = addrs[..i]
                        .iter()
                        .map(|&a| DataSource {
                            addr: a,
                            port: 0,
                            ports: 1,
                        })
                        .collect();
                    // Best effort: the admission error is the one to report.
                    let _ = self.release(cfg, xdp, &done);
                    return Err(DatapathError::AdmitPeer {
                        peer: addr,
                        reason: e.to_string(),
                    });
                }
            }
            *n += 1;
        }
        Ok(())
    }

    /// One flow fewer from each of `peers`: the last one removes the address from the
    /// allowlist, unless it is a configured one.
    pub(crate) fn release(
        &mut self,
        cfg: &AfXdpConfig,
        xdp: &XdpProgram,
        peers: &[DataSource],
    ) -> Result<(), DatapathError> {
        let Some(configured) = &cfg.allowlist else {
            return Ok(());
        };
        // Every address is counted down even if removing one fails; the first error is
        // reported.
        let mut first = Ok(());
        for addr in Self::addrs(peers) {
            let Some(n) = self.flows.get_mut(&addr) else {
                continue;
            };
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.flows.remove(&addr);
                if !configured.iter().any(|c| c.to_canonical() == addr) {
                    if let Err(e) = xdp.disallow(addr) {
                        first = first.and(Err(DatapathError::ReleasePeer {
                            peer: addr,
                            reason: e.to_string(),
                        }));
                    }
                }
            }
        }
        first
    }
}

impl AfXdpDatapath {
    /// Attach the classifier to `cfg.ifname` and bind one socket per queue.
    pub fn open(cfg: AfXdpConfig) -> Result<AfXdpDatapath, AfXdpError> {
        let attached = cfg.attach()?;
        let sc = &cfg.socket;
        let mut queues = Vec::with_capacity(cfg.queues.len());
        for &q in &cfg.queues {
            let sock = cfg.bind_queue(&attached, q)?;
            let (fill, free_tx) = sock.initial_frames();
            let mut queue = Queue {
                stats: QueueStats {
                    queue: q,
                    mode: Some(sock.mode()),
                    hugepages: sock.hugepages(),
                    ..QueueStats::default()
                },
                sock,
                free_tx,
                refill: fill,
                rx_descs: Vec::with_capacity(cfg.batch),
                tx_descs: Vec::with_capacity(cfg.batch),
                comp: Vec::with_capacity(sc.ring_size as usize),
            };
            queue.refill();
            queues.push(queue);
        }
        let neigh_map = neigh::Neighbors::new(&cfg.neighbors);
        let Attached { xdp, src_mac, .. } = attached;
        Ok(AfXdpDatapath {
            queues,
            xdp,
            admitted: PeerAdmissions::default(),
            src_mac,
            neigh: neigh_map,
            ident: 0,
            tx_next: 0,
            rx_next: 0,
            stats: DatapathStats::default(),
            cfg,
        })
    }

    /// Per-socket and classifier counters.
    pub fn afxdp_stats(&self) -> AfXdpStats {
        AfXdpStats {
            ifname: self.cfg.ifname.clone(),
            xdp_mode: self.xdp.attach_mode(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueStats {
                    kernel: q.sock.kernel_stats().unwrap_or_default(),
                    ..q.stats
                })
                .collect(),
            xdp: self.xdp.counters().ok(),
        }
    }

    /// The XDP classifier (counters, fault injection, allowlist).
    pub fn xdp(&self) -> &XdpProgram {
        &self.xdp
    }

    /// Records the Ethernet address of neighbour `ip`, so sending to it never waits for
    /// resolution (which reads the ARP table of the *sending* thread's network namespace):
    /// for callers that resolve their peers ahead of time, with [`neigh::resolve`].
    pub fn add_neighbor(&mut self, ip: IpAddr, mac: [u8; 6]) {
        self.neigh.insert(ip, mac);
    }

    /// The sockets' file descriptors, one per queue in configuration order, for callers that
    /// wait with `poll(2)` on descriptors of their own as well (an eventfd): `POLLIN` when the
    /// RX ring holds frames, `POLLOUT` when the TX ring has room; in copy mode a `poll()` also
    /// transmits what the TX ring holds.
    pub fn socket_fds(&self) -> impl Iterator<Item = std::os::fd::BorrowedFd<'_>> + '_ {
        self.queues
            .iter()
            .map(|q| std::os::fd::AsFd::as_fd(q.sock.fd()))
    }

    /// Most datagrams the next [`Datapath::send`] could take without blocking, over as many
    /// calls as it needs: the free TX frames (completions reaped first) or the free TX ring
    /// entries of the queue that call uses, whichever is fewer. A caller that must not send
    /// part of a group of datagrams checks the group fits first.
    pub fn tx_room(&mut self) -> usize {
        let qi = self.tx_next % self.queues.len().max(1);
        let Some(q) = self.queues.get_mut(qi) else {
            return 0;
        };
        q.reap_completions();
        let ring_free = q.sock.tx.size().saturating_sub(q.sock.tx.pending()) as usize;
        q.free_tx.len().min(ring_free)
    }

    /// Hands the kernel everything on the TX rings, then reaps completions. In copy mode the
    /// kernel transmits at most 32 frames per `sendto` (its TX batch), so a [`Datapath::send`]
    /// of more, or one it cut short (device busy), leaves frames on the ring until the next
    /// kick: this kicks each copy-mode queue until its ring is empty, stopping early when a
    /// kick moves nothing (at most 64 kicks per queue). Zero-copy queues are kicked when the
    /// driver asks to be woken.
    pub fn flush_tx(&mut self) -> Result<(), DatapathError> {
        let io = |source| DatapathError::Io {
            op: "AF_XDP sendto",
            source,
        };
        for q in &mut self.queues {
            match q.sock.mode() {
                BindMode::Copy => {
                    let mut pending = q.sock.tx.pending();
                    for _ in 0..64 {
                        if pending == 0 {
                            break;
                        }
                        q.stats.kicks += 1;
                        syscall::kick(q.sock.raw_fd()).map_err(io)?;
                        let now = q.sock.tx.pending();
                        if now >= pending {
                            break;
                        }
                        pending = now;
                    }
                }
                BindMode::ZeroCopy => {
                    if q.sock.tx.pending() > 0 && q.sock.tx.needs_wakeup() {
                        q.stats.kicks += 1;
                        syscall::kick(q.sock.raw_fd()).map_err(io)?;
                    }
                }
            }
            q.reap_completions();
        }
        Ok(())
    }

    /// Wait for RX on any queue (wake-on-demand) or spin (busy-poll) up to `timeout`.
    fn wait_rx(&mut self, timeout: Duration) -> Result<(), DatapathError> {
        let io = |source| DatapathError::Io {
            op: "AF_XDP poll",
            source,
        };
        match self.cfg.poll {
            PollMode::WakeOnDemand { spin } => {
                for _ in 0..spin {
                    if self.queues.iter_mut().any(|q| q.sock.rx.available() > 0) {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
                if timeout.is_zero() {
                    return Ok(());
                }
                let ms = i32::try_from(timeout.as_millis().max(1)).unwrap_or(i32::MAX);
                if let [q] = self.queues.as_mut_slice() {
                    q.stats.sleeps += 1;
                    syscall::poll_in(q.sock.raw_fd(), ms).map_err(io)?;
                } else {
                    let fds: Vec<i32> = self.queues.iter().map(|q| q.sock.raw_fd()).collect();
                    syscall::poll_many(&fds, ms).map_err(io)?;
                }
                Ok(())
            }
            PollMode::BusyPoll => {
                let deadline = Instant::now() + timeout;
                loop {
                    for q in &mut self.queues {
                        syscall::recv_kick(q.sock.raw_fd()).map_err(io)?;
                        if q.sock.rx.available() > 0 {
                            return Ok(());
                        }
                    }
                    if Instant::now() >= deadline {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
            }
        }
    }

    fn rx_once(&mut self, max: usize, deliver: &mut Deliver<'_>) -> usize {
        let mut n = 0;
        let port = self.cfg.local.port();
        let nq = self.queues.len();
        for k in 0..nq {
            if n >= max {
                break;
            }
            let q = &mut self.queues[(self.rx_next + k) % nq];
            q.rx_descs.clear();
            q.sock
                .rx
                .consume((max - n).min(self.cfg.batch), &mut q.rx_descs);
            for d in &q.rx_descs {
                let base = q.sock.umem.frame_base(d.addr);
                match q.sock.umem.get(d.addr, d.len as usize).map(frame::parse) {
                    Some(Ok(f)) if f.dst.port() == port => {
                        let meta = RxMeta {
                            src: f.src,
                            tos: (f.dscp << 2) | f.ecn.bits(),
                        };
                        deliver(&meta, f.datagram);
                        q.stats.rx_packets += 1;
                        q.stats.rx_bytes += f.datagram.len() as u64;
                        self.stats.rx_packets += 1;
                        self.stats.rx_bytes += f.datagram.len() as u64;
                        n += 1;
                    }
                    _ => {
                        q.stats.rx_malformed += 1;
                        self.stats.rx_dropped += 1;
                    }
                }
                q.refill.push(base);
            }
            q.refill();
            if q.sock.fill.needs_wakeup() {
                // Zero-copy drivers stop taking FILL entries until woken.
                let _ = syscall::recv_kick(q.sock.raw_fd());
            }
        }
        self.rx_next = (self.rx_next + 1) % nq;
        n
    }
}

impl Datapath for AfXdpDatapath {
    fn name(&self) -> &'static str {
        "afxdp"
    }

    fn local_addr(&self) -> SocketAddr {
        self.cfg.local
    }

    fn max_datagram(&self) -> usize {
        // Received frames start XDP_PACKET_HEADROOM (256 B) into their UMEM frame in copy
        // mode, so a datagram must fit behind that as well as behind our own headers.
        let frame_room = (self.cfg.socket.frame_size as usize)
            .saturating_sub(RX_HEADROOM + frame::header_len(self.cfg.local.is_ipv6()));
        frame_room.min(65_507)
    }

    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        let ipv6 = self.cfg.local.is_ipv6();
        let hdr = frame::header_len(ipv6);
        let max_dgram = self.max_datagram();
        let nq = self.queues.len();
        let qi = self.tx_next % nq;
        self.tx_next = self.tx_next.wrapping_add(1);
        self.queues[qi].reap_completions();
        let limit = {
            let q = &mut self.queues[qi];
            max.min(self.cfg.batch)
                .min(q.free_tx.len())
                .min(q.sock.tx.free() as usize)
        };
        if limit == 0 {
            let q = &mut self.queues[qi];
            q.stats.tx_ring_full += 1;
            q.stats.kicks += 1;
            syscall::kick(q.sock.raw_fd()).map_err(|source| DatapathError::Io {
                op: "AF_XDP sendto",
                source,
            })?;
            return Ok(0);
        }
        let mut filled = 0;
        let mut bytes = 0u64;
        let mut result = Ok(());
        while filled < limit {
            let Some(addr) = self.queues[qi].free_tx.pop() else {
                break;
            };
            let frame_size = self.cfg.socket.frame_size as usize;
            let Some(dgram) = self.queues[qi]
                .sock
                .umem
                .get_mut(addr, frame_size)
                .and_then(|buf| buf.get_mut(hdr..hdr + max_dgram))
            else {
                self.queues[qi].free_tx.push(addr);
                break;
            };
            let Some((len, meta)) = fill(dgram) else {
                self.queues[qi].free_tx.push(addr);
                break;
            };
            filled += 1;
            let dst_mac = match self.neigh.mac(meta.dst.ip()) {
                Ok(m) => m,
                Err(e) => {
                    self.queues[qi].free_tx.push(addr);
                    self.stats.tx_dropped += 1;
                    result = Err(e);
                    break;
                }
            };
            self.ident = self.ident.wrapping_add(1);
            let fm = self
                .cfg
                .frame_meta(self.src_mac, dst_mac, &meta, self.ident);
            let q = &mut self.queues[qi];
            let Some(buf) = q.sock.umem.get_mut(addr, frame_size) else {
                q.free_tx.push(addr);
                break;
            };
            match frame::emit_headers(buf, &fm, len.min(max_dgram)) {
                Ok(total) => {
                    q.tx_descs.push(libc::xdp_desc {
                        addr,
                        len: total as u32,
                        options: 0,
                    });
                    q.stats.tx_bytes += total as u64;
                    bytes += total as u64;
                }
                Err(_) => {
                    // Cannot happen for a datagram that fits the frame; never send garbage.
                    q.free_tx.push(addr);
                    self.stats.tx_dropped += 1;
                }
            }
        }
        let q = &mut self.queues[qi];
        let pushed = q.sock.tx.produce(&q.tx_descs);
        // `limit` bounded the batch by the ring's free space, so everything fits; anything
        // that did not (a concurrent change cannot happen: we are the only producer) is freed.
        for d in q.tx_descs.drain(pushed..) {
            q.free_tx.push(d.addr);
        }
        q.tx_descs.clear();
        q.stats.tx_packets += pushed as u64;
        self.stats.tx_packets += pushed as u64;
        self.stats.tx_bytes += bytes;
        // Copy mode transmits only inside sendto(); zero-copy only when the driver asks.
        if pushed > 0 && (q.sock.mode() == BindMode::Copy || q.sock.tx.needs_wakeup()) {
            q.stats.kicks += 1;
            syscall::kick(q.sock.raw_fd()).map_err(|source| DatapathError::Io {
                op: "AF_XDP sendto",
                source,
            })?;
        }
        result.map(|()| filled)
    }

    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        let n = self.rx_once(max, deliver);
        if n > 0 {
            return Ok(n);
        }
        self.wait_rx(timeout)?;
        Ok(self.rx_once(max, deliver))
    }

    fn stats(&self) -> DatapathStats {
        self.stats
    }

    fn backend_stats(&self) -> Option<crate::datapath::BackendStats> {
        Some(Box::new(AfXdpDatapath::afxdp_stats(self)))
    }

    fn data_sources(&self) -> Vec<DataSource> {
        self.cfg.data_sources()
    }

    fn admit_peers(&mut self, peers: &[DataSource]) -> Result<(), DatapathError> {
        self.admitted.admit(&self.cfg, &self.xdp, peers)
    }

    fn release_peers(&mut self, peers: &[DataSource]) -> Result<(), DatapathError> {
        self.admitted.release(&self.cfg, &self.xdp, peers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The allowlist holds the live flows' peers: an address joins with its first flow,
    /// stays while any flow from it lives, and leaves with its last one, unless configured.
    #[test]
    fn allowlist_holds_the_live_flows_peers() {
        if !gradwire_netns::require_root("allowlist admissions") {
            return;
        }
        let configured: IpAddr = [198, 18, 0, 9].into();
        let mut cfg = AfXdpConfig::new("lo", "198.18.0.2:7000".parse().unwrap());
        cfg.allowlist = Some(vec![configured]);
        let xdp = XdpProgram::load_detached(&XdpConfig::new(vec![7000])).unwrap();
        let src = |s: &str| DataSource::single(s.parse().unwrap());
        let (a, b) = (src("198.18.0.1:7000"), src("[::ffff:198.18.0.3]:7000"));
        let mut adm = PeerAdmissions::default();
        let allowed = |ip: [u8; 4]| xdp.is_allowed(ip.into()).unwrap();
        adm.admit(&cfg, &xdp, &[a, b]).unwrap();
        adm.admit(&cfg, &xdp, &[a, src("198.18.0.1:7001")]).unwrap();
        assert!(allowed([198, 18, 0, 1]) && allowed([198, 18, 0, 3]));
        adm.release(&cfg, &xdp, &[a, b]).unwrap();
        assert!(
            allowed([198, 18, 0, 1]),
            "a second flow from .1 still lives"
        );
        assert!(!allowed([198, 18, 0, 3]), "the last flow from .3 ended");
        adm.release(&cfg, &xdp, &[a]).unwrap();
        assert!(!allowed([198, 18, 0, 1]));
        // A configured address never leaves; releasing an unknown one is harmless.
        let c = DataSource::single(SocketAddr::new(configured, 1));
        xdp.allow(configured).unwrap();
        adm.admit(&cfg, &xdp, &[c]).unwrap();
        adm.release(&cfg, &xdp, &[c, src("198.18.0.77:1")]).unwrap();
        assert!(allowed([198, 18, 0, 9]));
        // With the filter off nothing is admitted.
        cfg.allowlist = None;
        adm.admit(&cfg, &xdp, &[src("198.18.0.5:1")]).unwrap();
        assert!(!allowed([198, 18, 0, 5]));
    }
}
