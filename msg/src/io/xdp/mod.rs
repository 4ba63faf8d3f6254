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
//!
//! # Layout
//!
//! One job per file:
//!
//! - `mod.rs` (this file): [`XdpIoConfig`], [`XdpIo::open`] (the port's kernel socket, the
//!   datapath), the accessors, [`XdpIo::wait`] and the [`DatagramIo`] implementation.
//! - `error.rs`: [`XdpIoError`].
//! - `peers.rs`: [`XdpIo::allow_peers`]: the classifier's allowlist and the peers' Ethernet
//!   addresses.
//! - `send.rs`: [`XdpIo::send`]: checking and planning bundles, whole or not at all, onto the TX
//!   ring, and dropping what goes to a destination without an Ethernet address.
//! - `fill.rs`: cutting the planned bundles into datagrams, one frame at a time.
//! - `recv.rs`: [`XdpIo::recv`].
//! - `monitor.rs`: the counters ([`XdpIoStats`]) and the [`XdpMonitor`] that reads them from
//!   another thread.

mod error;
mod fill;
mod monitor;
mod peers;
mod recv;
mod send;

use std::cell::Cell;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, PollMode};
use gradwire::datapath::Datapath;
use socket2::{Domain, Protocol, Socket, Type};

use super::{BoxError, DatagramIo, Readiness, RecvMeta, Transmit, Waker};
use fill::Planned;
use monitor::MonitorShared;

pub use error::XdpIoError;
pub use monitor::{XdpIoStats, XdpMonitor, XdpSnapshot};

pub use gradwire::afxdp::{AfXdpStats, BindMode, QueueStats, SocketConfig};
pub use gradwire_ebpf::{AttachMode, XdpCounters};

/// Most segments of one bundle (the same as UDP's GSO limit): the core's bundle size.
pub const MAX_SEGMENTS: usize = 64;

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

    /// A handle that wakes [`XdpIo::wait`] from any thread.
    pub fn waker(&self) -> Waker {
        self.waker.clone()
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
        let Some(xsk) = self.dp.socket_fds().next() else {
            return Err(XdpIoError::Wait {
                local: self.local,
                source: std::io::Error::from(std::io::ErrorKind::NotConnected),
            });
        };
        let mut ready = self
            .waker
            .wait_beside(xsk, timeout, want_write)
            .map_err(|e| XdpIoError::Wait {
                local: self.local,
                source: e.into(),
            })?;
        if ready.woken {
            self.serve_monitor();
        }
        // The AF_XDP socket has no error queue.
        ready.errors = false;
        Ok(ready)
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

    fn admit_peers(&mut self, peers: &[SocketAddr]) -> Result<(), BoxError> {
        Ok(XdpIo::allow_peers(self, peers)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_only() {
        fn check<T: Send>() {}
        check::<XdpIo>();
        fn check_sync<T: Send + Sync>() {}
        check_sync::<XdpMonitor>();
    }
}
