//! AF_XDP: the datagram socket of an endpoint over gradwire's kernel-bypass datapath.
//!
//! [`XdpIo`] puts [`gradwire::afxdp::AfXdpDatapath`] behind [`DatagramIo`]: a rank's channels
//! ride one AF_XDP socket on one receive queue, every peer's datagrams arrive on it and are
//! demultiplexed in user space (the endpoint maps each source address to its rank), and the
//! XDP classifier in front of the socket lets through only the job's peers
//! ([`XdpIo::allow_peers`]). Nothing of AF_XDP is done here: the datapath binds the socket
//! and its UMEM, attaches the classifier, resolves neighbours, frames and parses packets; this
//! module maps the endpoint's bundles, readiness and wake-ups onto it.
//!
//! - **Open** ([`XdpIo::open`]): gradwire's XDP classifier is attached to the interface
//!   (native mode where the driver has it, generic otherwise) and steers UDP to the local port
//!   to one AF_XDP socket bound to the configured queue (zero-copy where the driver can; on a
//!   veth, queue 0 in copy mode). The local address is the interface's IP (or the one given)
//!   and the UDP port given; port 0 takes a free one. Either way the port is held by a kernel
//!   UDP socket for the life of the `XdpIo`, so no kernel socket of this host takes it (that
//!   socket never sees a datagram the classifier steers).
//! - **Peers** ([`XdpIo::allow_peers`]): the classifier's allowlist holds exactly the peers'
//!   addresses; datagrams to the port from any other address are dropped in XDP, before they
//!   reach user space, and counted (`drop_not_allowed` of [`XdpCounters`]). Call it with the
//!   job's addresses before [`crate::endpoint::Bound::start`]; until then nothing gets through.
//!   It also resolves each peer's Ethernet address once, so the progress thread never waits
//!   for ARP (call it in the interface's network namespace).
//! - **Send**: every [`Transmit`] bundle is cut into datagrams at its `segment_size`, each
//!   copied from the iovec into a free UMEM frame behind room for the headers, which the
//!   datapath then writes (Ethernet, IPv4/IPv6 with the bundle's TOS byte, UDP, checksums in
//!   software); descriptors go to the TX ring `batch` at a time, each batch with one `sendto`
//!   kick (copy mode transmits only inside it, at most 32 frames per call). A bundle is sent
//!   whole or not at all: it is started only when the free TX frames and ring entries hold all
//!   its datagrams, so a bundle reported as not sent was not partly sent either.
//! - **Receive**: frames come off the RX ring and are parsed in place (lengths and checksums
//!   verified, [`gradwire_proto::wire::frame::parse`]); each UDP payload to our port is handed
//!   to the callback with its source address and TOS byte, then its frame goes back to the
//!   FILL ring. Anything else that reaches the socket (malformed, or to another port) is
//!   counted in [`XdpIoStats::rx_dropped`] and dropped; no input panics.
//! - **Wait**: `ppoll(2)` on the AF_XDP socket and an eventfd [`Waker`]. In copy mode the
//!   kernel also transmits what the TX ring holds when polled.
//!
//! Limits: one `XdpIo` per interface (it owns the interface's XDP program); peers on-link
//! (IPv4 neighbours come from the kernel's ARP table, IPv6 ones must be configured in
//! [`XdpIoConfig::neighbors`]); datagrams of at most [`XdpIo::max_datagram`] bytes (3798 with
//! 4096-byte frames), and no larger than the interface's MTU allows: give the endpoint the
//! interface's MTU ([`crate::endpoint::EndpointConfig::mtu`]). A receiving classifier drops
//! datagrams shorter than a gradwire header (32 bytes; counted as `drop_truncated`): every
//! frame of the message layer is longer, but an empty bundle, which kernel UDP delivers as an
//! empty datagram, never arrives.

use std::cell::Cell;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::IoSlice;
use std::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, AfXdpError, PollMode};
use gradwire::datapath::{Datapath, DatapathError, TxMeta};
use nix::errno::Errno;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::time::TimeSpec;
use socket2::{Domain, Protocol, Socket, Type};

use super::{BoxError, DatagramIo, Readiness, RecvMeta, Transmit, Waker};

pub use gradwire::afxdp::{AfXdpStats, BindMode, QueueStats, SocketConfig};
pub use gradwire_ebpf::{AttachMode, XdpCounters};

/// Most segments of one bundle (the same as UDP's GSO limit): the core's bundle size.
pub const MAX_SEGMENTS: usize = 64;
/// How long a destination without an Ethernet address is not tried again (resolving it takes
/// the sending thread up to a second).
const UNREACHABLE_BACKOFF: Duration = Duration::from_secs(10);
/// How long [`XdpIo::allow_peers`] waits for each peer's Ethernet address.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(1);
/// Timeouts at or above this many seconds wait forever (and cannot overflow a `timespec`).
const FOREVER_SECS: u64 = 100 * 365 * 24 * 3600;

/// Settings of an [`XdpIo`].
#[derive(Debug, Clone, PartialEq)]
pub struct XdpIoConfig {
    /// Interface, in the calling thread's network namespace.
    pub ifname: String,
    /// Receive queue to bind (one socket per queue: the NIC's flow steering must bring the
    /// job's traffic to it; a veth with one queue: 0).
    pub queue: u32,
    /// Local address: an unspecified IP takes the interface's first address of that family;
    /// port 0 takes a free port.
    pub local: SocketAddr,
    /// UMEM and ring sizes, huge pages, zero-copy, busy-poll socket options.
    pub socket: SocketConfig,
    /// Descriptors per ring operation, 1..=ring size (each TX batch ends with one `sendto`).
    /// Default 32: copy mode transmits at most 32 frames per `sendto`.
    pub batch: usize,
    /// How to attach the XDP program (default: native where the driver has it).
    pub xdp_mode: AttachMode,
    /// Static neighbours (IP -> MAC), used before the kernel's neighbour table; IPv6 peers
    /// need one.
    pub neighbors: Vec<(IpAddr, [u8; 6])>,
    /// Filter sources in XDP: only [`XdpIo::allow_peers`]' addresses get through. Default
    /// true; false lets any source through to the endpoint's own check.
    pub allowlist: bool,
    /// Fault injection in XDP: drop probability of arriving datagrams per DSCP, for tests.
    pub fault_drop: Vec<(u8, f64)>,
    /// IP TTL / hop limit of sent packets. Default 64.
    pub hop_limit: u8,
    /// Most datagrams one [`XdpIo::recv`] hands over, >= 1. Default 1024.
    pub recv_budget: usize,
}

impl XdpIoConfig {
    /// Queue 0 of `ifname` at `local`, with the datapath's socket defaults (4096 frames of
    /// 4096 bytes, rings of 2048, huge pages and zero-copy when available).
    pub fn new(ifname: impl Into<String>, local: SocketAddr) -> XdpIoConfig {
        XdpIoConfig {
            ifname: ifname.into(),
            queue: 0,
            local,
            socket: SocketConfig::default(),
            batch: 32,
            xdp_mode: AttachMode::Auto,
            neighbors: Vec::new(),
            allowlist: true,
            fault_drop: Vec::new(),
            hop_limit: 64,
            recv_budget: 1024,
        }
    }
}

/// Why an [`XdpIo`] call failed. OS errors are kept as sources, with what to do.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum XdpIoError {
    /// The configuration cannot work.
    #[error("AF_XDP socket configuration: {0}")]
    Config(String),
    /// The interface has no address to use as the local one.
    #[error(
        "interface {ifname:?} has no {family} address in this network namespace: give the \
         local address explicitly, or add one"
    )]
    NoAddress {
        /// Interface.
        ifname: String,
        /// "IPv4" or "IPv6".
        family: &'static str,
    },
    /// The kernel UDP socket that holds the port could not be bound.
    #[error(
        "AF_XDP socket on {ifname}: holding UDP port {addr} with a kernel socket: {source} \
         (the address must be one of the interface's, and the port free)"
    )]
    Reserve {
        /// Interface.
        ifname: String,
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The datapath (classifier, socket, UMEM) could not be set up.
    #[error(transparent)]
    Open(#[from] AfXdpError),
    /// The eventfd of the waker.
    #[error("AF_XDP socket on {ifname}: eventfd for the waker: {source}")]
    Waker {
        /// Interface.
        ifname: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The classifier's allowlist refused a change.
    #[error("XDP allowlist of {ifname}: {source}")]
    Allowlist {
        /// Interface.
        ifname: String,
        /// The map error (it says whether the allowlist is full).
        source: gradwire_ebpf::XdpError,
    },
    /// A peer address this socket cannot reach.
    #[error("peer {peer} for the AF_XDP socket at {local}: {reason}")]
    Peer {
        /// This socket's address.
        local: SocketAddr,
        /// The peer.
        peer: SocketAddr,
        /// What is wrong and what to do.
        reason: &'static str,
    },
    /// No Ethernet address for a peer.
    #[error(
        "no Ethernet address for peer {peer} from {ifname}: it is not on-link, not answering \
         ARP, or IPv6 without an entry in XdpIoConfig::neighbors"
    )]
    NoNeighbor {
        /// Interface.
        ifname: String,
        /// The peer.
        peer: IpAddr,
    },
    /// The first bundle of the batch cannot be sent as given (nothing was sent).
    #[error("AF_XDP send from {local} to {dst}: {reason}")]
    Transmit {
        /// This socket's address.
        local: SocketAddr,
        /// The bundle's destination.
        dst: SocketAddr,
        /// What is wrong with it and what to do.
        reason: &'static str,
    },
    /// The datapath failed to send or receive.
    #[error("AF_XDP {op} on {local}: {source}")]
    Datapath {
        /// "send" or "receive".
        op: &'static str,
        /// This socket's address.
        local: SocketAddr,
        /// The datapath's error (with the OS error).
        source: DatapathError,
    },
    /// `ppoll(2)` failed.
    #[error("AF_XDP wait (ppoll) on {local}: {source}")]
    Wait {
        /// This socket's address.
        local: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

impl XdpIoError {
    /// The OS error code (`errno`), when the kernel refused.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            XdpIoError::Reserve { source, .. }
            | XdpIoError::Waker { source, .. }
            | XdpIoError::Wait { source, .. } => source.raw_os_error(),
            XdpIoError::Open(e) => e.raw_os_error(),
            XdpIoError::Allowlist { source, .. } => source.raw_os_error(),
            XdpIoError::Datapath {
                source: DatapathError::Io { source, .. },
                ..
            } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Counters of one [`XdpIo`], for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpIoStats {
    /// `send` calls.
    pub send_calls: u64,
    /// `send` calls that stopped early: the next bundle did not fit the free TX frames.
    pub send_would_block: u64,
    /// Bundles sent whole.
    pub tx_bundles: u64,
    /// Datagrams put on the TX ring.
    pub tx_datagrams: u64,
    /// Their UDP payload bytes.
    pub tx_bytes: u64,
    /// Datagrams dropped because their destination has no Ethernet address (the bundle counts
    /// as sent, as if the network had lost it).
    pub tx_no_neighbor: u64,
    /// `recv` calls.
    pub recv_calls: u64,
    /// Datagrams handed to `recv`'s callback.
    pub rx_datagrams: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// Frames that reached the socket but were not valid UDP to our port: dropped.
    pub rx_dropped: u64,
    /// `wait` calls (each one `ppoll`).
    pub waits: u64,
}

/// Everything an [`XdpMonitor`] reports.
#[derive(Debug, Clone)]
pub struct XdpSnapshot {
    /// This socket's counters.
    pub io: XdpIoStats,
    /// The datapath's: the socket's and the kernel's per queue, and the classifier's
    /// (`xdp.drop_not_allowed` counts datagrams from addresses outside the allowlist).
    pub afxdp: AfXdpStats,
}

#[derive(Debug, Default)]
struct MonitorShared {
    requested: AtomicBool,
    latest: Mutex<(u64, Option<XdpSnapshot>)>,
    cv: Condvar,
}

/// Reads an [`XdpIo`]'s counters from another thread while an endpoint's progress thread
/// owns it: a request wakes that thread, which answers on its next loop.
#[derive(Debug, Clone)]
pub struct XdpMonitor {
    shared: Arc<MonitorShared>,
    waker: Waker,
}

impl XdpMonitor {
    /// Fresh counters, or `None` when the owning thread did not answer within `timeout`
    /// (it is gone, or the socket is not being driven).
    pub fn snapshot(&self, timeout: Duration) -> Option<XdpSnapshot> {
        let end = Instant::now() + timeout;
        let mut st = self.shared.latest.lock().unwrap_or_else(|e| e.into_inner());
        let asked = st.0;
        self.shared.requested.store(true, Ordering::Release);
        self.waker.wake();
        while st.0 == asked {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.1.clone()
    }
}

/// One bundle of a `send`, checked.
#[derive(Debug, Clone, Copy)]
struct Planned {
    /// Index in the batch.
    bundle: usize,
    /// Destination in this socket's family.
    dst: SocketAddr,
    tos: u8,
    /// Datagram size (the last may be shorter).
    seg: usize,
    /// Bundle bytes.
    total: usize,
    /// Datagrams (1 for an empty bundle).
    datagrams: usize,
    /// Dropped rather than sent: the destination has no Ethernet address.
    drop: bool,
}

/// Hands the planned bundles' datagrams to the datapath one frame at a time.
struct Filler<'p, 'b, 'i> {
    batch: &'b [Transmit<'i>],
    plan: &'p mut [Planned],
    /// Current plan entry; bundles before it were handed out whole.
    at: usize,
    /// Datagrams of `plan[at]` handed out.
    emitted: usize,
    /// Bytes of `plan[at]` handed out.
    off: usize,
    /// Position in `plan[at]`'s iovec: slice, byte in it.
    slice: usize,
    inner: usize,
    /// Plan entry of the datagram handed out last, and its length.
    last: usize,
    last_len: usize,
    /// Datagrams and payload bytes handed out.
    handed: usize,
    bytes: usize,
}

impl Filler<'_, '_, '_> {
    fn skip_to(&mut self, at: usize) {
        self.at = at;
        self.emitted = 0;
        self.off = 0;
        self.slice = 0;
        self.inner = 0;
    }

    /// Datagrams still to hand out.
    fn left(&self) -> usize {
        let mut n: usize = self
            .plan
            .iter()
            .skip(self.at)
            .filter(|p| !p.drop)
            .map(|p| p.datagrams)
            .sum();
        if self.plan.get(self.at).is_some_and(|p| !p.drop) {
            n = n.saturating_sub(self.emitted);
        }
        n
    }

    /// Writes the next datagram into `buf`; `None` when every planned bundle is out.
    fn next(&mut self, buf: &mut [u8]) -> Option<(usize, TxMeta)> {
        loop {
            let p = *self.plan.get(self.at)?;
            if p.drop || self.emitted >= p.datagrams {
                self.skip_to(self.at + 1);
                continue;
            }
            let t = self.batch.get(p.bundle)?;
            let len = p.seg.min(p.total.saturating_sub(self.off));
            let out = buf.get_mut(..len)?;
            copy_from_iov(t.iov, &mut self.slice, &mut self.inner, out);
            self.off += len;
            self.emitted += 1;
            self.last = self.at;
            self.last_len = len;
            self.handed += 1;
            self.bytes += len;
            if self.emitted == p.datagrams {
                self.skip_to(self.at + 1);
            }
            return Some((
                len,
                TxMeta {
                    dst: p.dst,
                    tos: p.tos,
                },
            ));
        }
    }
}

/// Copies the next `out.len()` bytes of `iov` from (`slice`, `inner`) on, advancing them.
fn copy_from_iov(iov: &[IoSlice<'_>], slice: &mut usize, inner: &mut usize, mut out: &mut [u8]) {
    while !out.is_empty() {
        let Some(s) = iov.get(*slice) else { break };
        let rest = s.get(*inner..).unwrap_or_default();
        let n = rest.len().min(out.len());
        let (head, tail) = std::mem::take(&mut out).split_at_mut(n);
        head.copy_from_slice(&rest[..n]);
        out = tail;
        *inner += n;
        if *inner >= s.len() {
            *slice += 1;
            *inner = 0;
        }
    }
}

/// The first address of `family` on `ifname` (IPv6: a global one before a link-local one).
fn interface_ip(ifname: &str, v6: bool) -> Option<IpAddr> {
    let mut link_local = None;
    for a in nix::ifaddrs::getifaddrs().ok()? {
        if a.interface_name != ifname {
            continue;
        }
        let Some(addr) = a.address else { continue };
        if !v6 {
            if let Some(sin) = addr.as_sockaddr_in() {
                return Some(IpAddr::V4(sin.ip()));
            }
        } else if let Some(sin6) = addr.as_sockaddr_in6() {
            let ip = sin6.ip();
            if ip.segments()[0] & 0xffc0 == 0xfe80 {
                link_local = link_local.or(Some(IpAddr::V6(ip)));
            } else {
                return Some(IpAddr::V6(ip));
            }
        }
    }
    link_local
}

/// A kernel UDP socket bound to `addr`: holds the port (and picks one for port 0).
fn reserve_port(addr: SocketAddr) -> std::io::Result<(Socket, SocketAddr)> {
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // It never reads: keep what the kernel might queue to it (frames the classifier passes
    // on, e.g. before the socket is registered) small.
    let _ = sock.set_recv_buffer_size(1);
    sock.bind(&addr.into())?;
    let local = sock
        .local_addr()?
        .as_socket()
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::AddrNotAvailable))?;
    Ok((sock, local))
}

/// The AF_XDP socket of an endpoint: one queue of one interface, behind gradwire's XDP
/// classifier (see the [module documentation](self)).
pub struct XdpIo {
    // Drop order: the datapath (sockets, then the classifier) before the port's holder.
    dp: AfXdpDatapath,
    _port: Socket,
    ifname: String,
    local: SocketAddr,
    waker: Waker,
    batch: usize,
    recv_budget: usize,
    max_datagram: usize,
    /// Most datagrams the TX frames and ring can ever hold at once.
    tx_capacity: usize,
    allowlist: bool,
    /// The peers' addresses in the allowlist.
    allowed: BTreeSet<IpAddr>,
    statics: HashSet<IpAddr>,
    /// Destinations without an Ethernet address, and when that was found.
    unreachable: HashMap<IpAddr, Instant>,
    plan: Vec<Planned>,
    stats: XdpIoStats,
    /// `wait` calls (`wait` takes `&self`).
    waits: Cell<u64>,
    monitor: Arc<MonitorShared>,
}

impl std::fmt::Debug for XdpIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpIo")
            .field("ifname", &self.ifname)
            .field("local", &self.local)
            .field("allowed", &self.allowed)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl XdpIo {
    /// Attaches gradwire's classifier to `cfg.ifname`, binds an AF_XDP socket to `cfg.queue`
    /// and holds the local UDP port; see the [module documentation](self). The classifier's
    /// allowlist starts empty (unless `cfg.allowlist` is false): call [`XdpIo::allow_peers`].
    /// Needs root (or `CAP_BPF` + `CAP_NET_ADMIN` + `CAP_NET_RAW`).
    pub fn open(cfg: &XdpIoConfig) -> Result<XdpIo, XdpIoError> {
        let sc = &cfg.socket;
        if cfg.batch == 0 || cfg.batch > sc.ring_size as usize {
            return Err(XdpIoError::Config(format!(
                "batch {} must be within 1..={} (the ring size)",
                cfg.batch, sc.ring_size
            )));
        }
        if cfg.recv_budget == 0 {
            return Err(XdpIoError::Config(
                "recv_budget must be at least 1 datagram per recv (1024 is a good start)".into(),
            ));
        }
        let ip = if cfg.local.ip().is_unspecified() {
            let v6 = cfg.local.is_ipv6();
            interface_ip(&cfg.ifname, v6).ok_or_else(|| XdpIoError::NoAddress {
                ifname: cfg.ifname.clone(),
                family: if v6 { "IPv6" } else { "IPv4" },
            })?
        } else {
            cfg.local.ip().to_canonical()
        };
        let want = match (ip, cfg.local) {
            // A link-local address binds with its interface as the scope.
            (IpAddr::V6(v6), SocketAddr::V6(given)) if v6.segments()[0] & 0xffc0 == 0xfe80 => {
                let scope = match given.scope_id() {
                    0 => nix::net::if_::if_nametoindex(cfg.ifname.as_str()).unwrap_or(0),
                    s => s,
                };
                SocketAddr::V6(SocketAddrV6::new(v6, given.port(), 0, scope))
            }
            _ => SocketAddr::new(ip, cfg.local.port()),
        };
        let (port, local) = reserve_port(want).map_err(|source| XdpIoError::Reserve {
            ifname: cfg.ifname.clone(),
            addr: want,
            source,
        })?;
        // Frames of an IPv6 address come out with flow info and scope id 0: so must ours.
        let local = SocketAddr::new(local.ip(), local.port());

        let mut ac = AfXdpConfig::new(cfg.ifname.clone(), local);
        ac.queues = vec![cfg.queue];
        ac.socket = cfg.socket.clone();
        ac.batch = cfg.batch;
        // `recv` never waits in the datapath: `wait` polls.
        ac.poll = PollMode::WakeOnDemand { spin: 0 };
        ac.xdp_mode = cfg.xdp_mode;
        ac.neighbors = cfg.neighbors.clone();
        ac.allowlist = cfg.allowlist.then(Vec::new);
        ac.fault_drop = cfg.fault_drop.clone();
        ac.hop_limit = cfg.hop_limit;
        // One source port: the endpoint knows a peer by its exact address.
        ac.spray_ports = 1;
        let dp = AfXdpDatapath::open(ac)?;
        let waker = Waker::new().map_err(|source| XdpIoError::Waker {
            ifname: cfg.ifname.clone(),
            source,
        })?;
        let tx_frames = sc.frames - sc.frames / 2;
        let tx_capacity = tx_frames.min(sc.ring_size) as usize;
        Ok(XdpIo {
            max_datagram: dp.max_datagram(),
            dp,
            _port: port,
            ifname: cfg.ifname.clone(),
            local,
            waker,
            batch: cfg.batch,
            recv_budget: cfg.recv_budget,
            tx_capacity,
            allowlist: cfg.allowlist,
            allowed: BTreeSet::new(),
            statics: cfg
                .neighbors
                .iter()
                .map(|(ip, _)| ip.to_canonical())
                .collect(),
            unreachable: HashMap::new(),
            plan: Vec::with_capacity(MAX_SEGMENTS),
            stats: XdpIoStats::default(),
            waits: Cell::new(0),
            monitor: Arc::new(MonitorShared::default()),
        })
    }

    /// The address peers send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The interface.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// Most segments one bundle should carry ([`MAX_SEGMENTS`]); larger bundles are sent too,
    /// up to the TX frames the socket has.
    pub fn max_segments(&self) -> usize {
        MAX_SEGMENTS.min(self.tx_capacity).max(1)
    }

    /// Largest datagram (UDP payload) a frame holds: the endpoint's segments must fit it.
    pub fn max_datagram(&self) -> usize {
        self.max_datagram
    }

    /// Copy or zero-copy.
    pub fn mode(&self) -> Option<BindMode> {
        self.dp.afxdp_stats().queues.first().and_then(|q| q.mode)
    }

    /// Makes the classifier's allowlist hold exactly the IP addresses of `peers` (this
    /// socket's own address, if given, is left out), so that datagrams to our port from any
    /// other address are dropped in XDP and never reach user space. Call it with every rank's
    /// address before starting the endpoint, and again whenever the job's peers change.
    ///
    /// The classifier filters by IP address: a datagram from a peer's address but another
    /// port gets through and is refused by the endpoint (counted as from an unknown source).
    ///
    /// Each new peer's Ethernet address is resolved here, once (IPv4: the kernel's ARP table
    /// of the calling thread's network namespace, waiting up to a second per peer; IPv6:
    /// [`XdpIoConfig::neighbors`]), so the thread that sends never waits for it, whatever
    /// namespace it runs in. A peer without one, or of the other address family, is an error
    /// before anything is changed.
    pub fn allow_peers(&mut self, peers: &[SocketAddr]) -> Result<(), XdpIoError> {
        let mine = self.local.ip();
        let mut want = BTreeSet::new();
        for &peer in peers {
            let ip = peer.ip().to_canonical();
            if ip == mine {
                continue;
            }
            let reason = if ip.is_ipv4() != mine.is_ipv4() {
                Some(
                    "of the other address family: an AF_XDP socket reaches peers of its own \
                     family only",
                )
            } else if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
                Some("not a host's address")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(XdpIoError::Peer {
                    local: self.local,
                    peer,
                    reason,
                });
            }
            want.insert(ip);
        }
        let mut found = Vec::new();
        for &ip in want.difference(&self.allowed) {
            if self.statics.contains(&ip) {
                continue;
            }
            match gradwire::afxdp::neigh::resolve(ip, RESOLVE_TIMEOUT) {
                Some(mac) => found.push((ip, mac)),
                None => {
                    return Err(XdpIoError::NoNeighbor {
                        ifname: self.ifname.clone(),
                        peer: ip,
                    })
                }
            }
        }
        if self.allowlist {
            let err = |source| XdpIoError::Allowlist {
                ifname: self.ifname.clone(),
                source,
            };
            let xdp = self.dp.xdp();
            for &ip in want.difference(&self.allowed) {
                xdp.allow(ip).map_err(err)?;
            }
            for &ip in self.allowed.difference(&want) {
                xdp.disallow(ip).map_err(err)?;
            }
        }
        for (ip, mac) in found {
            self.dp.add_neighbor(ip, mac);
        }
        self.allowed = want;
        self.unreachable.clear();
        Ok(())
    }

    /// The peer addresses [`XdpIo::allow_peers`] last set.
    pub fn allowed_peers(&self) -> Vec<IpAddr> {
        self.allowed.iter().copied().collect()
    }

    /// The counters so far.
    pub fn stats(&self) -> XdpIoStats {
        XdpIoStats {
            rx_dropped: self.dp.stats().rx_dropped,
            waits: self.waits.get(),
            ..self.stats
        }
    }

    /// The datapath's counters: per queue (with the kernel's) and the classifier's.
    pub fn afxdp_stats(&self) -> AfXdpStats {
        self.dp.afxdp_stats()
    }

    /// A handle to read the counters from another thread once the socket is handed to an
    /// endpoint.
    pub fn monitor(&self) -> XdpMonitor {
        XdpMonitor {
            shared: Arc::clone(&self.monitor),
            waker: self.waker.clone(),
        }
    }

    /// A handle that wakes [`XdpIo::wait`] from any thread.
    pub fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// Answers a monitor's request, if one is pending.
    fn serve_monitor(&self) {
        if !self.monitor.requested.swap(false, Ordering::AcqRel) {
            return;
        }
        let snap = XdpSnapshot {
            io: self.stats(),
            afxdp: self.dp.afxdp_stats(),
        };
        let mut st = self
            .monitor
            .latest
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        st.0 += 1;
        st.1 = Some(snap);
        self.monitor.cv.notify_all();
    }

    /// The destination in this socket's family.
    fn map_dst(&self, dst: SocketAddr) -> Result<SocketAddr, &'static str> {
        match (self.local, dst) {
            (SocketAddr::V4(_), SocketAddr::V4(_)) | (SocketAddr::V6(_), SocketAddr::V6(_)) => {
                match dst {
                    SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
                        Some(_) => Err("IPv4-mapped destination on an IPv6 AF_XDP socket: \
                                        give the peer's IPv6 address"),
                        None => Ok(SocketAddr::new(IpAddr::V6(*a.ip()), a.port())),
                    },
                    v4 => Ok(v4),
                }
            }
            (SocketAddr::V4(_), SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
                Some(ip) => Ok(SocketAddr::V4(SocketAddrV4::new(ip, a.port()))),
                None => Err(
                    "IPv6 destination on an IPv4 AF_XDP socket: open one on an IPv6 \
                             address to reach IPv6 peers",
                ),
            },
            (SocketAddr::V6(_), SocketAddr::V4(_)) => Err(
                "IPv4 destination on an IPv6 AF_XDP socket: open one on an IPv4 address to \
                 reach IPv4 peers",
            ),
        }
    }

    /// Checks bundle `i` of `batch`.
    fn check(
        &self,
        batch: &[Transmit<'_>],
        i: usize,
        now: Instant,
    ) -> Result<Planned, &'static str> {
        let Some(t) = batch.get(i) else {
            return Err("no such bundle");
        };
        let total = t.iov.iter().fold(0usize, |a, s| a.saturating_add(s.len()));
        if total > 0 && t.segment_size == 0 {
            return Err("segment_size is 0 in a non-empty bundle: give the datagram size");
        }
        let seg = t.segment_size.min(total);
        if seg > self.max_datagram {
            return Err(
                "a datagram larger than an AF_XDP frame holds (XdpIo::max_datagram): \
                        lower the MTU, or use 4096-byte frames",
            );
        }
        let dst = self.map_dst(t.dst)?;
        let datagrams = if total == 0 { 1 } else { total.div_ceil(seg) };
        if datagrams > self.tx_capacity {
            return Err(
                "more datagrams in one bundle than the socket has TX frames: send \
                        smaller bundles (XdpIo::max_segments)",
            );
        }
        let drop = self
            .unreachable
            .get(&dst.ip())
            .is_some_and(|&at| now.saturating_duration_since(at) < UNREACHABLE_BACKOFF);
        Ok(Planned {
            bundle: i,
            dst,
            tos: t.tos,
            seg,
            total,
            datagrams,
            drop,
        })
    }

    /// Sends bundles: every datagram framed and put on the TX ring, in batches of
    /// [`XdpIoConfig::batch`] with one kick each, then the ring flushed.
    ///
    /// Returns how many bundles (from the front of `batch`) were sent. Fewer than
    /// `batch.len()` when the next bundle does not fit the free TX frames (it was not sent at
    /// all; [`XdpIo::wait`] with `want_write` then waits for the ring), or when a later bundle
    /// is invalid: that bundle is then first in the next call, which reports its error. `Err`
    /// means the first bundle of `batch` was refused (nothing was sent). A bundle to an
    /// address without an Ethernet address counts as sent and is dropped
    /// ([`XdpIoStats::tx_no_neighbor`]); that address is not tried again for 10 s.
    pub fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, XdpIoError> {
        self.stats.send_calls += 1;
        let now = Instant::now();
        let mut done = 0usize;
        let mut room = self.dp.tx_room();
        let mut flushed = false;
        while done < batch.len() {
            // The bundles from `done` on that fit the room whole.
            let mut plan = std::mem::take(&mut self.plan);
            plan.clear();
            let mut need = 0usize;
            let mut refused = None;
            for i in done..batch.len() {
                match self.check(batch, i, now) {
                    Ok(p) => {
                        let n = if p.drop { 0 } else { p.datagrams };
                        if need + n > room {
                            break;
                        }
                        need += n;
                        plan.push(p);
                    }
                    Err(reason) => {
                        refused = Some((batch[i].dst, reason));
                        break;
                    }
                }
            }
            if plan.is_empty() {
                self.plan = plan;
                if let Some((dst, reason)) = refused {
                    if done == 0 {
                        return Err(XdpIoError::Transmit {
                            local: self.local,
                            dst,
                            reason,
                        });
                    }
                    break;
                }
                if flushed {
                    self.stats.send_would_block += 1;
                    break;
                }
                // Push out what the ring holds, reap what the kernel finished, look again.
                self.flush()?;
                room = self.dp.tx_room();
                flushed = true;
                continue;
            }
            let sent = self.transmit(batch, &mut plan);
            self.plan = plan;
            match sent {
                Ok(n) if n > 0 => {
                    done += n;
                    flushed = false;
                    room = self.dp.tx_room();
                }
                Ok(_) => {
                    // The datapath took nothing although the room was there: try once more
                    // after a flush, then report the socket full.
                    if flushed {
                        self.stats.send_would_block += 1;
                        break;
                    }
                    self.flush()?;
                    room = self.dp.tx_room();
                    flushed = true;
                }
                Err(e) if done == 0 => return Err(e),
                Err(_) => break,
            }
        }
        self.flush()?;
        Ok(done)
    }

    /// Kicks the TX ring until the kernel took everything (copy mode) and reaps completions.
    fn flush(&mut self) -> Result<(), XdpIoError> {
        self.dp.flush_tx().map_err(|source| XdpIoError::Datapath {
            op: "send",
            local: self.local,
            source,
        })
    }

    /// Hands the datagrams of `plan` (bundles `plan[0].bundle..`, consecutive) to the
    /// datapath; returns how many of its bundles were sent whole (or dropped).
    fn transmit(
        &mut self,
        batch: &[Transmit<'_>],
        plan: &mut [Planned],
    ) -> Result<usize, XdpIoError> {
        let mut fill = Filler {
            batch,
            plan,
            at: 0,
            emitted: 0,
            off: 0,
            slice: 0,
            inner: 0,
            last: 0,
            last_len: 0,
            handed: 0,
            bytes: 0,
        };
        let mut result = Ok(());
        loop {
            let left = fill.left();
            if left == 0 {
                break;
            }
            let before = fill.handed;
            match self.dp.send(left, &mut |b| fill.next(b)) {
                Ok(_) if fill.handed == before => break,
                Ok(_) => {}
                Err(DatapathError::NoNeighbor(ip)) => {
                    // The datagram handed out last was refused, and it was the first of its
                    // bundle (a bundle has one destination, whose address the datapath caches
                    // once found); everything handed out before it was sent. That bundle and
                    // the later ones to the same address are dropped, as the network would.
                    fill.handed = fill.handed.saturating_sub(1);
                    fill.bytes = fill.bytes.saturating_sub(fill.last_len);
                    let last = fill.last;
                    for p in fill.plan[last..].iter_mut() {
                        if p.dst.ip() == ip && !p.drop {
                            p.drop = true;
                            self.stats.tx_no_neighbor += p.datagrams as u64;
                        }
                    }
                    fill.skip_to(last + 1);
                    if self.unreachable.insert(ip, Instant::now()).is_none() {
                        log::warn!(
                            "AF_XDP {}: no Ethernet address for {ip}; dropping what is sent \
                             to it, trying again in {UNREACHABLE_BACKOFF:?}",
                            self.local
                        );
                    }
                }
                Err(source) => {
                    result = Err(XdpIoError::Datapath {
                        op: "send",
                        local: self.local,
                        source,
                    });
                    break;
                }
            }
        }
        let whole = if fill.left() == 0 {
            fill.plan.len()
        } else {
            fill.at
        };
        self.stats.tx_datagrams += fill.handed as u64;
        self.stats.tx_bytes += fill.bytes as u64;
        self.stats.tx_bundles += fill.plan[..whole].iter().filter(|p| !p.drop).count() as u64;
        match result {
            Err(e) if whole == 0 => Err(e),
            _ => Ok(whole),
        }
    }
}

impl XdpIo {
    /// Hands every datagram on the RX ring to `f` (up to [`XdpIoConfig::recv_budget`]),
    /// without blocking, each with its source address and TOS byte, and gives the frames back
    /// to the kernel. Returns how many: 0 when nothing is queued.
    pub fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, XdpIoError> {
        self.serve_monitor();
        self.stats.recv_calls += 1;
        let mut total = 0usize;
        let mut bytes = 0usize;
        while total < self.recv_budget {
            let dropped = self.dp.stats().rx_dropped;
            let max = self.batch.min(self.recv_budget - total);
            let n = self
                .dp
                .recv(max, Duration::ZERO, &mut |m, d| {
                    bytes += d.len();
                    f(
                        RecvMeta {
                            src: m.src,
                            tos: m.tos,
                        },
                        d,
                    );
                })
                .map_err(|source| XdpIoError::Datapath {
                    op: "receive",
                    local: self.local,
                    source,
                })?;
            total += n;
            // A batch of frames dropped as malformed delivers nothing but may hide more.
            if n == 0 && self.dp.stats().rx_dropped == dropped {
                break;
            }
        }
        self.stats.rx_datagrams += total as u64;
        self.stats.rx_bytes += bytes as u64;
        Ok(total)
    }

    /// Blocks until the RX ring holds frames (or the TX ring has room, when `want_write`),
    /// the [`Waker`] fires, or `timeout` passes (`None`: forever). Drains the waker. A signal
    /// ends the wait early with nothing set.
    pub fn wait(
        &self,
        timeout: Option<Duration>,
        want_write: bool,
    ) -> Result<Readiness, XdpIoError> {
        self.serve_monitor();
        self.waits.set(self.waits.get() + 1);
        let mut events = PollFlags::POLLIN;
        if want_write {
            events |= PollFlags::POLLOUT;
        }
        let Some(xsk) = self.dp.socket_fds().next() else {
            return Err(XdpIoError::Wait {
                local: self.local,
                source: std::io::Error::from(std::io::ErrorKind::NotConnected),
            });
        };
        let mut fds = [
            PollFd::new(xsk, events),
            PollFd::new(self.waker.as_fd(), PollFlags::POLLIN),
        ];
        let ts = timeout
            .filter(|d| d.as_secs() < FOREVER_SECS)
            .map(TimeSpec::from_duration);
        match ppoll(&mut fds, ts, None) {
            Ok(_) => {}
            Err(Errno::EINTR) => return Ok(Readiness::default()),
            Err(e) => {
                return Err(XdpIoError::Wait {
                    local: self.local,
                    source: e.into(),
                })
            }
        }
        let sock = fds[0].revents().unwrap_or(PollFlags::empty());
        let woken = fds[1]
            .revents()
            .unwrap_or(PollFlags::empty())
            .contains(PollFlags::POLLIN);
        if woken {
            let mut b = [0u8; 8];
            // Nonblocking: EAGAIN if another waiter drained it first.
            let _ = nix::unistd::read(&self.waker, &mut b);
            self.serve_monitor();
        }
        Ok(Readiness {
            readable: sock.intersects(PollFlags::POLLIN | PollFlags::POLLERR),
            writable: want_write && sock.contains(PollFlags::POLLOUT),
            woken,
            errors: false,
        })
    }
}

impl DatagramIo for XdpIo {
    fn local_addr(&self) -> SocketAddr {
        XdpIo::local_addr(self)
    }

    fn max_segments(&self) -> usize {
        XdpIo::max_segments(self)
    }

    fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, BoxError> {
        Ok(XdpIo::send(self, batch)?)
    }

    fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, BoxError> {
        Ok(XdpIo::recv(self, f)?)
    }

    fn wait(&self, timeout: Option<Duration>, want_write: bool) -> Result<Readiness, BoxError> {
        Ok(XdpIo::wait(self, timeout, want_write)?)
    }

    fn waker(&self) -> Waker {
        XdpIo::waker(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(bundle: usize, tos: u8, seg: usize, total: usize) -> Planned {
        Planned {
            bundle,
            dst: "198.18.0.2:7000".parse().unwrap(),
            tos,
            seg,
            total,
            datagrams: if total == 0 { 1 } else { total.div_ceil(seg) },
            drop: false,
        }
    }

    /// The filler cuts bundles at their segment size across slice boundaries, emits an
    /// empty bundle as one empty datagram, skips dropped bundles, and stops at the end.
    #[test]
    fn filler_cuts_bundles_across_slices() {
        let data: Vec<u8> = (0..=255u8).cycle().take(2500).collect();
        let parts = [&data[..7], &data[7..7], &data[7..1500], &data[1500..]];
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let other = [IoSlice::new(&data[..100])];
        let dst: SocketAddr = "198.18.0.2:7000".parse().unwrap();
        let batch = [
            Transmit {
                dst,
                tos: 0x28,
                segment_size: 1000,
                iov: &iov,
            },
            Transmit {
                dst,
                tos: 1,
                segment_size: 0,
                iov: &[],
            },
            Transmit {
                dst,
                tos: 2,
                segment_size: 64,
                iov: &other,
            },
            Transmit {
                dst,
                tos: 3,
                segment_size: 1000,
                iov: &other,
            },
        ];
        let mut plan = vec![
            planned(0, 0x28, 1000, 2500),
            planned(1, 1, 0, 0),
            Planned {
                drop: true,
                ..planned(2, 2, 64, 100)
            },
            planned(3, 3, 100, 100),
        ];
        let mut fill = Filler {
            batch: &batch,
            plan: &mut plan,
            at: 0,
            emitted: 0,
            off: 0,
            slice: 0,
            inner: 0,
            last: 0,
            last_len: 0,
            handed: 0,
            bytes: 0,
        };
        assert_eq!(fill.left(), 5);
        let mut out = Vec::new();
        let mut buf = vec![0u8; 3000];
        while let Some((len, meta)) = fill.next(&mut buf) {
            out.push((buf[..len].to_vec(), meta.tos));
            assert_eq!(fill.left(), 5 - out.len());
        }
        assert_eq!(out.len(), 5);
        assert_eq!(out[0], (data[..1000].to_vec(), 0x28));
        assert_eq!(out[1], (data[1000..2000].to_vec(), 0x28));
        assert_eq!(out[2], (data[2000..].to_vec(), 0x28));
        assert_eq!(out[3], (Vec::new(), 1));
        assert_eq!(out[4], (data[..100].to_vec(), 3));
        assert_eq!((fill.handed, fill.bytes, fill.last), (5, 2600, 3));
        assert!(fill.next(&mut buf).is_none());
    }

    /// A buffer too small for the next datagram stops the filler without losing its place.
    #[test]
    fn filler_stops_on_a_short_buffer() {
        let data = [7u8; 300];
        let iov = [IoSlice::new(&data)];
        let batch = [Transmit {
            dst: "198.18.0.2:7000".parse().unwrap(),
            tos: 0,
            segment_size: 200,
            iov: &iov,
        }];
        let mut plan = vec![planned(0, 0, 200, 300)];
        let mut fill = Filler {
            batch: &batch,
            plan: &mut plan,
            at: 0,
            emitted: 0,
            off: 0,
            slice: 0,
            inner: 0,
            last: 0,
            last_len: 0,
            handed: 0,
            bytes: 0,
        };
        assert!(fill.next(&mut [0u8; 100]).is_none());
        assert_eq!(fill.left(), 2);
        let mut buf = [0u8; 200];
        assert_eq!(fill.next(&mut buf).map(|x| x.0), Some(200));
        assert_eq!(fill.next(&mut buf).map(|x| x.0), Some(100));
        assert_eq!(fill.left(), 0);
    }

    #[test]
    fn send_only() {
        fn check<T: Send>() {}
        check::<XdpIo>();
        fn check_sync<T: Send + Sync>() {}
        check_sync::<XdpMonitor>();
    }
}
