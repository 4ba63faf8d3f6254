//! Why a [`UdpIo`](super::UdpIo) call failed: [`IoError`], each OS error kept as its source,
//! and the hint appended to its message saying what to do about it.
//!
//! Kept apart from the socket so that its code reads as what it does, and what a failure
//! means (and what to do about it) is in one place.

use std::net::SocketAddr;

/// Why a [`UdpIo`](super::UdpIo) call failed. Every OS error is kept as the source.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum IoError {
    /// The configuration cannot work.
    #[error("UDP socket configuration: {0}")]
    Config(&'static str),
    /// Creating or setting up the socket (or its eventfd) failed.
    #[error("UDP socket for {addr}: {op}: {source}{}", hint(source))]
    Setup {
        /// The step (system call or socket option).
        op: &'static str,
        /// The address being bound.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// `bind(2)` failed.
    #[error("UDP bind to {addr}: {source}{}", hint(source))]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The kernel refused to send the first bundle of the batch.
    #[error("UDP sendmmsg from {local} to {dst}: {source}{}", hint(source))]
    Send {
        /// This socket's address.
        local: SocketAddr,
        /// The refused bundle's destination.
        dst: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first bundle of the batch cannot be sent as given (nothing was sent).
    #[error("UDP send from {local} to {dst}: {reason}")]
    Transmit {
        /// This socket's address.
        local: SocketAddr,
        /// The bundle's destination.
        dst: SocketAddr,
        /// What is wrong with it and what to do.
        reason: &'static str,
    },
    /// `recvmmsg(2)` failed.
    #[error("UDP recvmmsg on {local}: {source}{}", hint(source))]
    Recv {
        /// This socket's address.
        local: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// `ppoll(2)` failed.
    #[error("UDP wait (ppoll) on {local}: {source}{}", hint(source))]
    Wait {
        /// This socket's address.
        local: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

impl IoError {
    /// The OS error code (`errno`), when the kernel refused.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            IoError::Setup { source, .. }
            | IoError::Bind { source, .. }
            | IoError::Send { source, .. }
            | IoError::Recv { source, .. }
            | IoError::Wait { source, .. } => source.raw_os_error(),
            IoError::Config(_) | IoError::Transmit { .. } => None,
        }
    }
}

/// What to do about an OS error, appended to its message.
pub(super) fn hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EADDRINUSE) => {
            ": address in use: pick another port, or stop the process that holds this one"
        }
        Some(libc::EADDRNOTAVAIL) => {
            ": address not available here: bind an address of a local interface (see `ip addr`)"
        }
        Some(libc::EACCES | libc::EPERM) => {
            ": permission denied: ports below 1024 need CAP_NET_BIND_SERVICE, and a firewall \
             rule may reject this traffic"
        }
        Some(libc::EMSGSIZE) => {
            ": message too long: keep segment_size within the path MTU (1472 B for IPv4 on \
             1500 B Ethernet) and a datagram under 64 KiB"
        }
        Some(libc::EINVAL) => {
            ": invalid argument: a GSO segment larger than the interface MTU allows, or an \
             address of the wrong family"
        }
        Some(libc::ENETUNREACH | libc::EHOSTUNREACH) => {
            ": no route to the destination: check the routing table (`ip route get`)"
        }
        Some(libc::EAFNOSUPPORT) => {
            ": address family not supported: IPv4 and IPv6 peers need a socket of their family"
        }
        Some(libc::EMFILE | libc::ENFILE) => ": too many open files: raise the limit (`ulimit -n`)",
        Some(libc::ENOMEM | libc::ENOBUFS) => {
            ": out of kernel memory: lower socket_buffer or recv_batch"
        }
        Some(libc::EIO) => ": I/O error from the device: try with gso off",
        _ => "",
    }
}
