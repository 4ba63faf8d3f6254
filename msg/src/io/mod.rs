//! Datagram I/O of an endpoint: one module per kernel mechanism, behind [`DatagramIo`].
//!
//! - [`udp`]: kernel UDP with segmentation offload (GSO/GRO) and `sendmmsg`/`recvmmsg`.
//! - `xdp` (cargo feature `afxdp`): an AF_XDP socket on one queue, over gradwire's AF_XDP
//!   datapath, with the XDP classifier's allowlist holding the job's peers.

pub mod udp;
#[cfg(feature = "afxdp")]
pub mod xdp;

use std::net::SocketAddr;
use std::time::Duration;

pub use udp::{Readiness, RecvMeta, Transmit, Waker};

/// The error of a datagram socket of any kind (each keeps its OS error as its source).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What the endpoint's progress thread needs from a datagram socket.
pub trait DatagramIo: Send + 'static {
    /// The address peers send to.
    fn local_addr(&self) -> SocketAddr;
    /// Most datagrams one [`Transmit`] bundle may carry.
    fn max_segments(&self) -> usize;
    /// Sends bundles; returns how many (from the front) were taken, fewer only when the
    /// socket would block.
    fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, BoxError>;
    /// Hands every queued datagram to `f` without blocking; returns how many.
    fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, BoxError>;
    /// Blocks until readable (writable with `want_write`), woken, or `timeout`.
    fn wait(&self, timeout: Option<Duration>, want_write: bool) -> Result<Readiness, BoxError>;
    /// Wakes [`DatagramIo::wait`] from another thread.
    fn waker(&self) -> Waker;
    /// Destinations reported unreachable since the last call (a peer whose socket closed).
    fn take_unreachable(&mut self) -> Vec<SocketAddr> {
        Vec::new()
    }
    /// Lets the job's peers in below the endpoint, where the socket kind filters sources
    /// itself (AF_XDP: the XDP allowlist); kernel UDP has nothing to do (the endpoint refuses
    /// unknown sources either way). Called once, before the progress thread starts.
    fn admit_peers(&mut self, peers: &[SocketAddr]) -> Result<(), BoxError> {
        let _ = peers;
        Ok(())
    }
}

impl DatagramIo for udp::UdpIo {
    fn local_addr(&self) -> SocketAddr {
        udp::UdpIo::local_addr(self)
    }

    fn max_segments(&self) -> usize {
        udp::UdpIo::max_segments(self)
    }

    fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, BoxError> {
        Ok(udp::UdpIo::send(self, batch)?)
    }

    fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, BoxError> {
        Ok(udp::UdpIo::recv(self, f)?)
    }

    fn wait(&self, timeout: Option<Duration>, want_write: bool) -> Result<Readiness, BoxError> {
        Ok(udp::UdpIo::wait(self, timeout, want_write)?)
    }

    fn waker(&self) -> Waker {
        udp::UdpIo::waker(self)
    }

    fn take_unreachable(&mut self) -> Vec<SocketAddr> {
        udp::UdpIo::take_unreachable(self)
    }
}
