//! Kernel UDP with segmentation offload: the datagram socket of one endpoint.
//!
//! One socket per rank carries every peer's traffic, so it moves bytes the way the kernel does
//! best:
//!
//! - **Send**: a [`Transmit`] *bundle* is a run of equal-size datagrams (the last may be
//!   shorter) to one destination, given as an iovec list. With UDP segmentation offload
//!   (`UDP_SEGMENT`, "GSO") the kernel cuts the bundle into datagrams itself, so one `msghdr`
//!   carries up to 64 datagrams; one `sendmmsg(2)` carries up to [`MAX_SEND_MSGS`] such
//!   `msghdr`s, each with its own destination, TOS byte (`IP_TOS` / `IPV6_TCLASS` control
//!   message) and segment size.
//! - **Receive**: with `UDP_GRO` the kernel may hand back several datagrams of one flow
//!   coalesced in one buffer, with their stride in a control message; one `recvmmsg(2)` fills up
//!   to [`UdpConfig::recv_batch`] buffers. [`UdpIo::recv`] splits every buffer at its stride, so
//!   callers always see single datagrams, each with its source and TOS byte (`IP_RECVTOS` /
//!   `IPV6_RECVTCLASS`: ECN CE marks are visible).
//! - **Wait**: `ppoll(2)` on the socket and an eventfd [`Waker`], so another thread can wake the
//!   progress thread when it posts work.
//!
//! GSO is probed at bind (`setsockopt(UDP_SEGMENT, 0)`, which changes nothing when it works).
//! Some devices only refuse it at send time, with `EIO`: the socket then turns GSO off for good,
//! logs one warning and resends the refused bundle datagram by datagram. Without GSO every
//! datagram is its own `msghdr` (still up to 64 per `sendmmsg`); without GRO every buffer holds
//! one datagram.
//!
//! # Why raw `libc` rather than `nix`'s `sendmmsg`/`recvmmsg`
//!
//! nix 0.31's multi-message calls do not fit this socket: `sendmmsg` applies one control
//! message list to every message of a call (we need a TOS byte and a GSO size per bundle),
//! counting its results reads address slots it never initialised, and `recvmmsg` does not
//! reset `msg_controllen`/`msg_namelen` between calls, so a reused `MultiHeaders` loses control
//! messages after the first call (and a fresh one per call allocates on the hot path). This
//! module therefore fills `mmsghdr`s itself, from buffers allocated once at bind. Control
//! messages and socket addresses are encoded and decoded in safe code, byte by byte, after the
//! kernel's ABI (checked against `libc` in the tests); the only `unsafe` are the two system
//! calls, the zeroed `mmsghdr` template, and the `Send`/`Sync` promise of the header arrays,
//! all in `mmsg.rs`, the one file of this module that allows `unsafe` code (besides the
//! test of `cmsg.rs` that checks the layout against `libc::CMSG_LEN`).
//!
//! # Layout
//!
//! One job per file:
//!
//! - `mod.rs` (this file): the public types (configuration, [`Transmit`], [`RecvMeta`],
//!   [`Readiness`], [`UdpStats`]), the [`UdpIo`] socket itself with [`UdpIo::bind`], its
//!   accessors and [`UdpIo::wait`].
//! - `error.rs`: [`IoError`] and the hint appended to each OS error.
//! - `waker.rs`: the eventfd [`Waker`].
//! - `send.rs`: [`UdpIo::send`], cutting bundles into `msghdr`s, and the GSO fallback.
//! - `recv.rs`: [`UdpIo::recv`], splitting GRO buffers into datagrams.
//! - `errqueue.rs`: the ICMP error queue ([`UdpIo::take_unreachable`]).
//! - `mmsg.rs`: the raw `mmsghdr`/`iovec` arrays and the `sendmmsg`/`recvmmsg` calls.
//! - `cmsg.rs`: control messages (`UDP_SEGMENT`, `IP_TOS`, `UDP_GRO`, ...) encoded and parsed.
//! - `sockaddr.rs`: socket addresses in the kernel's layout.

mod cmsg;
mod error;
mod errqueue;
mod mmsg;
mod recv;
mod send;
mod sockaddr;
mod waker;

use std::io::IoSlice;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{getsockopt, setsockopt, sockopt};
use socket2::{Domain, Protocol, Socket, Type};

use mmsg::{RxState, TxState};

pub use error::IoError;
pub use waker::Waker;

/// Most `msghdr`s (bundles, or datagrams without GSO) one `sendmmsg` call carries.
pub const MAX_SEND_MSGS: usize = 64;
/// The kernel's limit on the segments of one GSO send (`UDP_MAX_SEGMENTS`).
pub const UDP_MAX_SEGMENTS: usize = 64;
/// Most iovec entries of one `msghdr` (`UIO_MAXIOV`).
pub const MAX_IOV: usize = 1024;
/// Most receive buffers one `recvmmsg` call fills (the kernel caps `vlen` at `UIO_MAXIOV`).
pub const MAX_RECV_BATCH: usize = 1024;
/// Most bytes of one receive buffer.
pub const MAX_RECV_BUFFER: usize = 1 << 20;
/// UDP payload bytes of the largest IPv4 datagram (65535 - 20 - 8): one GSO send's limit.
const MAX_PAYLOAD_V4: usize = 65_507;
/// UDP payload bytes of the largest IPv6 datagram without jumbograms (65535 - 8).
const MAX_PAYLOAD_V6: usize = 65_527;
/// A coalesced GRO buffer is at most one IP packet: smaller receive buffers would truncate it,
/// so GRO stays off below this size.
const GRO_MIN_BUFFER: usize = 65_535;

/// Settings of a [`UdpIo`] socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// Bytes asked for each of the socket's receive and send buffers (`SO_RCVBUFFORCE` /
    /// `SO_SNDBUFFORCE` when privileged, else `SO_RCVBUF` / `SO_SNDBUF`, capped by
    /// `net.core.rmem_max`/`wmem_max`); 0 keeps the kernel's default. Default 32 MiB.
    pub socket_buffer: usize,
    /// Use UDP segmentation offload on send when the kernel has it. Default true.
    pub gso: bool,
    /// Use UDP receive coalescing when the kernel has it (needs `recv_buffer_len` >= 65535).
    /// Default true.
    pub gro: bool,
    /// Receive buffers per `recvmmsg` call, 1..=1024. Default 32.
    pub recv_batch: usize,
    /// Bytes per receive buffer, 1..=1 MiB; a larger datagram is counted truncated and dropped.
    /// Default 65536 (a whole GRO bundle).
    pub recv_buffer_len: usize,
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            socket_buffer: 32 << 20,
            gso: true,
            gro: true,
            recv_batch: 32,
            recv_buffer_len: 65_536,
        }
    }
}

impl UdpConfig {
    fn check(&self) -> Result<(), IoError> {
        if !(1..=MAX_RECV_BATCH).contains(&self.recv_batch) {
            return Err(IoError::Config(
                "recv_batch must be 1..=1024 buffers per recvmmsg (32 is a good start)",
            ));
        }
        if !(1..=MAX_RECV_BUFFER).contains(&self.recv_buffer_len) {
            return Err(IoError::Config(
                "recv_buffer_len must be 1..=1048576 bytes (65536 holds a whole GRO bundle)",
            ));
        }
        Ok(())
    }
}

/// One send bundle: equal-size datagrams (the last may be shorter) to one destination.
#[derive(Debug, Clone, Copy)]
pub struct Transmit<'a> {
    /// Where every datagram of the bundle goes.
    pub dst: SocketAddr,
    /// The IP TOS / IPv6 traffic-class byte: DSCP << 2 | ECN. 0 keeps the socket's default (0).
    pub tos: u8,
    /// Bytes of every datagram but the last (the GSO segment size); equal to the total when
    /// the bundle is one datagram (a larger value is taken as the total).
    pub segment_size: usize,
    /// The bundle's bytes, gathered in order: e.g. [header0, payload0, header1, payload1, ...];
    /// the total is cut into datagrams of `segment_size`. Datagram boundaries need not fall on
    /// slice boundaries. An empty total sends one empty datagram.
    pub iov: &'a [IoSlice<'a>],
}

/// Metadata of one received datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvMeta {
    /// The sender (IPv4-mapped IPv6 sources are given as IPv4).
    pub src: SocketAddr,
    /// The TOS / traffic-class byte it arrived with (ECN in the low two bits).
    pub tos: u8,
}

/// What [`UdpIo::wait`] saw. All false: the timeout passed (or a signal interrupted the wait).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Readiness {
    /// The socket has datagrams queued (or a pending error, which `recv` reports).
    pub readable: bool,
    /// The socket has send-buffer room (only asked when `want_write`).
    pub writable: bool,
    /// A [`Waker`] fired (its eventfd is drained).
    pub woken: bool,
    /// The socket's error queue holds ICMP errors ([`UdpIo::take_unreachable`] reads them).
    pub errors: bool,
}

/// Counters of one socket, for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdpStats {
    /// `sendmmsg` calls made (including ones that would block or failed).
    pub send_syscalls: u64,
    /// Bundles the kernel took whole.
    pub send_bundles: u64,
    /// Datagrams the kernel took (a GSO `msghdr` counts its segments).
    pub send_datagrams: u64,
    /// Payload bytes the kernel took.
    pub send_bytes: u64,
    /// `send` calls that stopped early because the socket would block (`EAGAIN`).
    pub send_would_block: u64,
    /// Datagrams the local stack dropped (`ENOBUFS` with `IP_RECVERR`: a full device queue,
    /// e.g. a veth whose XDP reader is behind). Counted as sent: the protocol recovers them
    /// as losses. Sending them again at once would repeat what the device did take and spin
    /// while the queue stays full (the socket stays writable).
    pub send_local_drops: u64,
    /// Times GSO was turned off after the kernel refused a GSO send with `EIO` (0 or 1).
    pub gso_fallbacks: u64,
    /// `recvmmsg` calls made (including ones that found nothing).
    pub recv_syscalls: u64,
    /// `recvmmsg` calls that found nothing queued (`EAGAIN`).
    pub recv_empty: u64,
    /// Buffers received (one per `msghdr`; a GRO buffer of many datagrams counts once).
    pub recv_buffers: u64,
    /// Datagrams handed to `recv`'s callback.
    pub recv_datagrams: u64,
    /// Payload bytes handed to `recv`'s callback.
    pub recv_bytes: u64,
    /// Buffers the kernel truncated (datagram larger than `recv_buffer_len`): the cut datagram
    /// is dropped, whole GRO segments before it are delivered.
    pub recv_truncated: u64,
    /// Buffers without a usable source address, dropped (never seen in practice).
    pub recv_malformed: u64,
    /// Datagrams the kernel dropped because the receive buffer was full (`SO_RXQ_OVFL`), as of
    /// the latest datagram received.
    pub recv_kernel_drops: u64,
    /// ICMP errors read from the socket's error queue.
    pub icmp_errors: u64,
}

/// The UDP socket of an endpoint: GSO sends, GRO receives, per-bundle TOS, an eventfd waker.
pub struct UdpIo {
    sock: Socket,
    local: SocketAddr,
    v6: bool,
    waker: Waker,
    gso: bool,
    gro: bool,
    buffers: (usize, usize),
    tx: TxState,
    rx: RxState,
    stats: UdpStats,
    /// `IP_RECVERR`/`IPV6_RECVERR` is on: ICMP errors are queued for us to read.
    recverr: bool,
    /// Destinations the kernel reported unreachable (ICMP port unreachable: no socket there
    /// any more), for [`UdpIo::take_unreachable`].
    unreachable: Vec<SocketAddr>,
    /// Test hook: the next GSO `sendmmsg` fails with `EIO`.
    #[cfg(test)]
    fail_gso_once: bool,
}

impl std::fmt::Debug for UdpIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpIo")
            .field("local", &self.local)
            .field("gso", &self.gso)
            .field("gro", &self.gro)
            .field("socket_buffers", &self.buffers)
            .field("recv_batch", &self.rx.raw.hdrs.len())
            .field("recv_buffer_len", &self.rx.buf_len)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl AsFd for UdpIo {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// Sets both socket buffers to `size` (forced when privileged) and reads back what the kernel
/// gave (Linux reports twice the asked size, the other half being its bookkeeping).
fn set_buffers(sock: &Socket, size: usize) -> Result<(usize, usize), (&'static str, Errno)> {
    if size > 0 {
        // The kernel doubles the value in an int: stay clear of overflow.
        let size = size.min(i32::MAX as usize / 2);
        if setsockopt(sock, sockopt::RcvBufForce, &size).is_err() {
            if let Err(e) = setsockopt(sock, sockopt::RcvBuf, &size) {
                log::warn!("UDP: SO_RCVBUF {size}: {e}; keeping the default receive buffer");
            }
        }
        if setsockopt(sock, sockopt::SndBufForce, &size).is_err() {
            if let Err(e) = setsockopt(sock, sockopt::SndBuf, &size) {
                log::warn!("UDP: SO_SNDBUF {size}: {e}; keeping the default send buffer");
            }
        }
    }
    let rcv = getsockopt(sock, sockopt::RcvBuf).map_err(|e| ("getsockopt(SO_RCVBUF)", e))?;
    let snd = getsockopt(sock, sockopt::SndBuf).map_err(|e| ("getsockopt(SO_SNDBUF)", e))?;
    Ok((rcv, snd))
}

impl UdpIo {
    /// Opens a nonblocking UDP socket bound to `addr` (port 0: any free port), with large
    /// buffers, TOS reception, and GSO/GRO where the kernel has them and `cfg` allows.
    pub fn bind(addr: SocketAddr, cfg: &UdpConfig) -> Result<UdpIo, IoError> {
        cfg.check()?;
        let setup = |op: &'static str| {
            move |e: std::io::Error| IoError::Setup {
                op,
                addr,
                source: e,
            }
        };
        let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
            .map_err(setup("socket(SOCK_DGRAM, IPPROTO_UDP)"))?;
        sock.set_nonblocking(true)
            .map_err(setup("fcntl(O_NONBLOCK)"))?;
        let buffers = set_buffers(&sock, cfg.socket_buffer)
            .map_err(|(op, e)| setup(op)(std::io::Error::from(e)))?;
        sock.bind(&addr.into())
            .map_err(|source| IoError::Bind { addr, source })?;
        let local = sock
            .local_addr()
            .map_err(setup("getsockname"))?
            .as_socket()
            .ok_or_else(|| setup("getsockname")(std::io::Error::from(Errno::EAFNOSUPPORT)))?;
        let v6 = local.is_ipv6();

        // TOS of received datagrams (IPv4 ones too on an IPv6 socket, via IP_RECVTOS).
        if let Err(e) = setsockopt(&sock, sockopt::IpRecvTos, &true) {
            if !v6 {
                log::warn!("UDP {local}: IP_RECVTOS: {e}; received TOS will read 0");
            }
        }
        if v6 {
            if let Err(e) = setsockopt(&sock, sockopt::Ipv6RecvTClass, &true) {
                log::warn!("UDP {local}: IPV6_RECVTCLASS: {e}; received TOS will read 0");
            }
        }
        if let Err(e) = setsockopt(&sock, sockopt::RxqOvfl, &1) {
            log::debug!("UDP {local}: SO_RXQ_OVFL: {e}; kernel drops will not be counted");
        }
        // UDP_SEGMENT 0 is the default (no segmentation without a control message): setting it
        // tells whether the kernel knows GSO without changing anything.
        let gso = cfg.gso && setsockopt(&sock, sockopt::UdpGsoSegment, &0).is_ok();
        if cfg.gso && !gso {
            log::info!("UDP {local}: no UDP segmentation offload in this kernel; sending datagram by datagram");
        }
        let gro = cfg.gro
            && cfg.recv_buffer_len >= GRO_MIN_BUFFER
            && setsockopt(&sock, sockopt::UdpGroSegment, &true).is_ok();
        if cfg.gro && !gro {
            log::info!(
                "UDP {local}: UDP receive coalescing off (kernel without UDP_GRO, or \
                 recv_buffer_len {} < {GRO_MIN_BUFFER})",
                cfg.recv_buffer_len
            );
        }

        // ICMP errors for our datagrams (a peer's socket closed: port unreachable) are queued
        // on the socket's error queue rather than dropped, so a dead peer is noticed at once.
        let recverr = if v6 {
            setsockopt(&sock, sockopt::Ipv6RecvErr, &true)
        } else {
            setsockopt(&sock, sockopt::Ipv4RecvErr, &true)
        };
        if let Err(e) = &recverr {
            log::debug!("UDP {local}: IP_RECVERR: {e}; dead peers are noticed by timeout only");
        }
        let recverr = recverr.is_ok();
        let waker = Waker::new().map_err(setup("eventfd"))?;

        let batch = cfg.recv_batch;
        Ok(UdpIo {
            sock,
            local,
            v6,
            waker,
            gso,
            gro,
            buffers,
            tx: TxState::new(),
            rx: RxState::new(batch, cfg.recv_buffer_len),
            stats: UdpStats::default(),
            recverr,
            unreachable: Vec::new(),
            #[cfg(test)]
            fail_gso_once: false,
        })
    }

    /// The bound address (with the port the kernel chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Most segments one send bundle may carry in one `msghdr` (1 without GSO; the kernel's
    /// limit, 64, with it). Larger bundles are still sent, cut into several `msghdr`s.
    pub fn max_segments(&self) -> usize {
        if self.gso {
            UDP_MAX_SEGMENTS
        } else {
            1
        }
    }

    /// Most payload bytes one GSO `msghdr` may carry (one IP packet's worth: 65507 for IPv4,
    /// 65527 for IPv6). A bundle above it is cut at a segment boundary into several `msghdr`s.
    pub fn max_bundle_bytes(&self) -> usize {
        if self.v6 {
            MAX_PAYLOAD_V6
        } else {
            MAX_PAYLOAD_V4
        }
    }

    /// Whether sends use UDP segmentation offload (false from the start, or after an `EIO`).
    pub fn gso_enabled(&self) -> bool {
        self.gso
    }

    /// Whether receives ask for UDP coalescing.
    pub fn gro_enabled(&self) -> bool {
        self.gro
    }

    /// (receive, send) socket buffer bytes as the kernel reports them.
    pub fn socket_buffers(&self) -> (usize, usize) {
        self.buffers
    }

    /// The counters so far.
    pub fn stats(&self) -> UdpStats {
        self.stats
    }

    /// A handle that wakes [`UdpIo::wait`] from any thread.
    pub fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// Blocks until the socket is readable (or writable, when `want_write`), the [`Waker`]
    /// fires, or `timeout` passes (`None`: forever). Drains the waker. A signal ends the wait
    /// early with nothing set.
    pub fn wait(&self, timeout: Option<Duration>, want_write: bool) -> Result<Readiness, IoError> {
        self.waker
            .wait_beside(self.sock.as_fd(), timeout, want_write)
            .map_err(|e| IoError::Wait {
                local: self.local,
                source: e.into(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<UdpIo>();
        check::<Waker>();
    }

    #[test]
    fn bad_config_is_refused() {
        let lo = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        for cfg in [
            UdpConfig {
                recv_batch: 0,
                ..UdpConfig::default()
            },
            UdpConfig {
                recv_buffer_len: 0,
                ..UdpConfig::default()
            },
        ] {
            let e = UdpIo::bind(lo, &cfg).unwrap_err();
            assert!(matches!(e, IoError::Config(_)), "{e}");
        }
    }
}
