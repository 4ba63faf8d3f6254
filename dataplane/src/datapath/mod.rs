//! Datapaths: the one small trait through which the protocol moves data packets.
//!
//! A datapath sends a batch of datagrams (gradwire header + payload; the datapath owns any
//! encapsulation below it) and receives a batch, handing each datagram to a callback as a
//! borrowed slice so the caller can copy the payload once, straight into the tensor. The
//! callback style lets a kernel-bypass datapath ([`crate::afxdp`]) lend its UMEM frames
//! without an intermediate copy, and lets the transmit side write payloads directly into the
//! datapath's own buffers.
//!
//! Implementations:
//! - [`loopback::Loopback`]: an in-memory pair, for deterministic tests and demos.
//! - [`udp::UdpDatapath`]: kernel UDP sockets with `sendmmsg`/`recvmmsg`, the portable path
//!   and the baseline kernel bypass has to beat.
//! - [`crate::afxdp::AfXdpDatapath`] and [`crate::afxdp::engine::Engine`]: AF_XDP sockets
//!   behind gradwire's XDP classifier, single-threaded or with pinned per-queue workers.
//! - [`multipath::MultiPath`]: round robin over several datapaths (one per interface or next
//!   hop), host-side spraying by source-routed choice.
//! - [`fault::FaultInjector`]: wraps any datapath and drops, duplicates, reorders or delays
//!   what it receives, seeded, so loss tests do not need netem.

use std::net::SocketAddr;
use std::time::Duration;

pub mod fault;
pub mod loopback;
pub mod multipath;
pub mod udp;

pub use gradwire_proto::datagram::{tos, RxMeta, TxMeta};
pub use gradwire_proto::message::DataSource;

/// Counters every datapath keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DatapathStats {
    /// Datagrams handed to the network.
    pub tx_packets: u64,
    /// Bytes handed to the network (datagram bytes).
    pub tx_bytes: u64,
    /// Datagrams the datapath could not send (local queue full, ENOBUFS) and dropped.
    pub tx_dropped: u64,
    /// Datagrams delivered to the caller.
    pub rx_packets: u64,
    /// Bytes delivered to the caller.
    pub rx_bytes: u64,
    /// Datagrams dropped on receive (e.g. by fault injection or a full queue).
    pub rx_dropped: u64,
}

/// Per-packet-path error of a datapath: the OS error, nothing allocated.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The operating system refused an operation.
    #[error("{op}: {source}")]
    Io {
        /// The operation (e.g. "sendmmsg").
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The other end of an in-memory datapath is gone.
    #[error("datapath peer closed")]
    Closed,
    /// A kernel-bypass datapath has no Ethernet address for this destination.
    #[error(
        "no Ethernet address known for {0} (not on-link, not answering ARP, or IPv6 without a \
         configured static neighbour)"
    )]
    NoNeighbor(std::net::IpAddr),
    /// A filter below the datapath (the XDP classifier's allowlist) refused a flow's peer.
    #[error("cannot admit data source {peer} to the XDP classifier's allowlist: {reason}")]
    AdmitPeer {
        /// The peer address.
        peer: std::net::IpAddr,
        /// Why (the map error, which says whether the allowlist is full).
        reason: String,
    },
    /// A finished flow's peer could not be removed from the XDP classifier's allowlist (it
    /// stays allowed; the receiver's own peer binding still applies).
    #[error("cannot remove data source {peer} from the XDP classifier's allowlist: {reason}")]
    ReleasePeer {
        /// The peer address.
        peer: std::net::IpAddr,
        /// Why (the map error).
        reason: String,
    },
}

/// Filler for one transmit slot: write a datagram into the buffer, return its length and
/// metadata, or `None` when there is nothing more to send in this batch.
pub type Fill<'a> = dyn FnMut(&mut [u8]) -> Option<(usize, TxMeta)> + 'a;

/// Consumer of one received datagram.
pub type Deliver<'a> = dyn FnMut(&RxMeta, &[u8]) + 'a;

/// A datapath moves datagrams; the protocol core drives it.
pub trait Datapath {
    /// Short name for reports ("loopback", "udp", "afxdp").
    fn name(&self) -> &'static str;

    /// The address peers send to.
    fn local_addr(&self) -> SocketAddr;

    /// Largest datagram (gradwire header + payload) this datapath carries.
    fn max_datagram(&self) -> usize;

    /// Send up to `max` datagrams. `fill` is called for consecutive slots until it returns
    /// `None` or `max` is reached; every filled datagram is either sent or counted in
    /// `tx_dropped`. Returns how many were filled.
    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError>;

    /// Receive up to `max` datagrams, waiting at most `timeout` for the first one. Each is
    /// handed to `deliver`. Returns how many were delivered (0 on timeout).
    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError>;

    /// Counters so far.
    fn stats(&self) -> DatapathStats;

    /// Every source address and port range the datagrams this datapath sends come from: the
    /// sender announces them in `FlowStart`, and the receiver accepts the flow's data from
    /// these only (peer binding). An unspecified address (a wildcard-bound socket) stands for
    /// the control connection's source address.
    fn data_sources(&self) -> Vec<DataSource> {
        vec![DataSource::single(self.local_addr())]
    }

    /// Lets datagrams from `peers` through whatever filters traffic below this datapath (the
    /// AF_XDP classifier's allowlist, so that foreign traffic never reaches user space). A
    /// receiver calls it when it accepts a flow; datapaths without such a filter do nothing
    /// (the receiver's own peer check still applies).
    fn admit_peers(&mut self, peers: &[DataSource]) -> Result<(), DatapathError> {
        let _ = peers;
        Ok(())
    }

    /// Undoes one [`Self::admit_peers`] when the flow ends (the AF_XDP allowlist keeps only
    /// live flows' peers). Datapaths without a filter do nothing.
    fn release_peers(&mut self, peers: &[DataSource]) -> Result<(), DatapathError> {
        let _ = peers;
        Ok(())
    }

    /// Counters only one kind of datapath keeps (the AF_XDP datapath: per-socket and XDP
    /// classifier counters), as a snapshot for reports. Callers downcast to the type they know
    /// (`gradwire::afxdp::AfXdpStats::of`), so this trait names no backend. `None` where there
    /// is nothing beyond [`DatapathStats`].
    fn backend_stats(&self) -> Option<BackendStats> {
        None
    }
}

/// A snapshot of backend-specific counters (see [`Datapath::backend_stats`]).
pub type BackendStats = Box<dyn std::any::Any + Send>;

impl<D: Datapath + ?Sized> Datapath for Box<D> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn local_addr(&self) -> SocketAddr {
        (**self).local_addr()
    }
    fn max_datagram(&self) -> usize {
        (**self).max_datagram()
    }
    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        (**self).send(max, fill)
    }
    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        (**self).recv(max, timeout, deliver)
    }
    fn stats(&self) -> DatapathStats {
        (**self).stats()
    }
    fn backend_stats(&self) -> Option<BackendStats> {
        (**self).backend_stats()
    }
    fn data_sources(&self) -> Vec<DataSource> {
        (**self).data_sources()
    }
    fn admit_peers(&mut self, peers: &[DataSource]) -> Result<(), DatapathError> {
        (**self).admit_peers(peers)
    }
    fn release_peers(&mut self, peers: &[DataSource]) -> Result<(), DatapathError> {
        (**self).release_peers(peers)
    }
}
