//! Why an [`XdpIo`](super::XdpIo) call failed: [`XdpIoError`], with the OS error kept as the
//! source and, where there is one, what to do about it.

use std::net::{IpAddr, SocketAddr};

use gradwire::afxdp::AfXdpError;
use gradwire::datapath::DatapathError;

/// Why an [`XdpIo`](super::XdpIo) call failed. OS errors are kept as sources, with what to do.
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
