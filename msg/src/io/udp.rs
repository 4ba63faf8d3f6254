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
//! calls, the zeroed `mmsghdr` template, and the `Send`/`Sync` promise of the header arrays.
#![allow(unsafe_code)]

use std::io::IoSlice;
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{getsockopt, setsockopt, sockopt};
use nix::sys::time::TimeSpec;
use socket2::{Domain, Protocol, Socket, Type};

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
/// Control-message bytes per sent `msghdr`: `UDP_SEGMENT` (u16) and `IP_TOS`/`IPV6_TCLASS` (int).
const SEND_CMSG_SPACE: usize = 64;
/// Control-message bytes per received `msghdr`: `UDP_GRO`, `IP_TOS`, `IPV6_TCLASS`,
/// `SO_RXQ_OVFL` (24 bytes each on 64-bit), with room to spare.
const RECV_CMSG_SPACE: usize = 128;
/// Timeouts at or above this many seconds wait forever (and cannot overflow a `timespec`).
const FOREVER_SECS: u64 = 100 * 365 * 24 * 3600;

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
    /// `send` calls that stopped early because the socket would block (`EAGAIN`/`ENOBUFS`).
    pub send_would_block: u64,
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

/// Wakes a thread blocked in [`UdpIo::wait`]. Cheap to clone, `Send + Sync`; keeps the eventfd
/// open, so waking after the socket is gone is harmless.
#[derive(Clone, Debug)]
pub struct Waker {
    fd: Arc<OwnedFd>,
}

impl Waker {
    /// A waker over a new nonblocking eventfd, for a [`super::DatagramIo`] of another kind:
    /// its `wait` polls the waker's descriptor ([`AsFd`]) for `POLLIN` beside its socket and,
    /// when it fired, reads the counter back to 0 (an 8-byte `read`; `EAGAIN` when another
    /// reader drained it first).
    pub fn new() -> std::io::Result<Waker> {
        let efd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(Waker {
            fd: Arc::new(OwnedFd::from(efd)),
        })
    }

    /// Makes the next (or current) [`UdpIo::wait`] return with `woken`. Never blocks, never
    /// panics; a counter already at its maximum stays woken.
    pub fn wake(&self) {
        // EAGAIN only when the counter is about to overflow: it is already signalled.
        let _ = nix::unistd::write(&*self.fd, &1u64.to_ne_bytes());
    }
}

impl AsFd for Waker {
    /// The eventfd: readable while woken.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Why a [`UdpIo`] call failed. Every OS error is kept as the source.
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
fn hint(e: &std::io::Error) -> &'static str {
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

// ---------------------------------------------------------------------------------------------
// Control messages and socket addresses, in the kernel's layout, in safe code.

/// `CMSG_ALIGN` unit: the kernel aligns control messages to `sizeof(long)`.
const CMSG_ALIGN_TO: usize = std::mem::size_of::<libc::c_long>();
const USIZE: usize = std::mem::size_of::<usize>();

const fn cmsg_align(n: usize) -> usize {
    (n + CMSG_ALIGN_TO - 1) & !(CMSG_ALIGN_TO - 1)
}

/// Bytes of the (aligned) `cmsghdr`: `size_t cmsg_len; int cmsg_level; int cmsg_type;`.
const CMSG_HDR: usize = cmsg_align(USIZE + 2 * std::mem::size_of::<libc::c_int>());

/// `CMSG_LEN(data)`.
const fn cmsg_len(data: usize) -> usize {
    CMSG_HDR + data
}

/// `CMSG_SPACE(data)`.
const fn cmsg_space(data: usize) -> usize {
    CMSG_HDR + cmsg_align(data)
}

/// A control-message buffer aligned like `cmsghdr`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct CmsgBuf<const N: usize>([u8; N]);

/// Appends control messages to a buffer.
struct CmsgWriter<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl<'a> CmsgWriter<'a> {
    fn new(buf: &'a mut [u8]) -> Self {
        CmsgWriter { buf, len: 0 }
    }

    /// Appends one message; false (and nothing written) when it does not fit.
    fn push(&mut self, level: libc::c_int, ty: libc::c_int, data: &[u8]) -> bool {
        let space = cmsg_space(data.len());
        let Some(out) = self.buf.get_mut(self.len..self.len + space) else {
            return false;
        };
        out.fill(0);
        out[..USIZE].copy_from_slice(&cmsg_len(data.len()).to_ne_bytes());
        out[USIZE..USIZE + 4].copy_from_slice(&level.to_ne_bytes());
        out[USIZE + 4..USIZE + 8].copy_from_slice(&ty.to_ne_bytes());
        out[CMSG_HDR..CMSG_HDR + data.len()].copy_from_slice(data);
        self.len += space;
        true
    }
}

/// What the receive control messages of one buffer said.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct RecvCmsgs {
    /// `UDP_GRO`: the segment size of a coalesced buffer.
    stride: Option<usize>,
    /// `IP_TOS` or `IPV6_TCLASS`.
    tos: Option<u8>,
    /// `SO_RXQ_OVFL`: the socket's drop counter.
    drops: Option<u32>,
}

fn read_i32(b: &[u8]) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

fn parse_cmsgs(buf: &[u8]) -> RecvCmsgs {
    let mut out = RecvCmsgs::default();
    let mut off = 0;
    while let Some(hdr) = buf.get(off..off + CMSG_HDR) {
        let Some(len) = hdr
            .get(..USIZE)
            .and_then(|b| b.try_into().ok())
            .map(usize::from_ne_bytes)
        else {
            break;
        };
        let (Some(level), Some(ty)) = (read_i32(&hdr[USIZE..]), read_i32(&hdr[USIZE + 4..])) else {
            break;
        };
        if len < CMSG_HDR {
            break;
        }
        let Some(data) = buf.get(off + CMSG_HDR..off + len) else {
            break;
        };
        match (level, ty) {
            (libc::SOL_UDP, libc::UDP_GRO) => {
                out.stride = read_i32(data).and_then(|s| usize::try_from(s).ok());
            }
            (libc::IPPROTO_IP, libc::IP_TOS) => out.tos = data.first().copied(),
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                out.tos = read_i32(data).map(|t| (t & 0xff) as u8);
            }
            (libc::SOL_SOCKET, libc::SO_RXQ_OVFL) => {
                out.drops = read_i32(data).map(|d| d as u32);
            }
            _ => {}
        }
        off += cmsg_align(len);
    }
    out
}

/// A socket address buffer in the kernel's layout (`sockaddr_in` or `sockaddr_in6`).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct RawAddr([u8; SIN6_LEN]);

const SIN_LEN: usize = std::mem::size_of::<libc::sockaddr_in>();
const SIN6_LEN: usize = std::mem::size_of::<libc::sockaddr_in6>();
const AF_INET: [u8; 2] = (libc::AF_INET as libc::sa_family_t).to_ne_bytes();
const AF_INET6: [u8; 2] = (libc::AF_INET6 as libc::sa_family_t).to_ne_bytes();

impl RawAddr {
    const ZERO: RawAddr = RawAddr([0; SIN6_LEN]);

    /// Writes `addr` (as std does: port big-endian, flow info and scope id as given); returns
    /// its `socklen_t`.
    fn encode(&mut self, addr: &SocketAddr) -> libc::socklen_t {
        let b = &mut self.0;
        *b = [0; SIN6_LEN];
        b[2..4].copy_from_slice(&addr.port().to_be_bytes());
        match addr {
            SocketAddr::V4(a) => {
                b[..2].copy_from_slice(&AF_INET);
                b[4..8].copy_from_slice(&a.ip().octets());
                SIN_LEN as libc::socklen_t
            }
            SocketAddr::V6(a) => {
                b[..2].copy_from_slice(&AF_INET6);
                b[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
                b[8..24].copy_from_slice(&a.ip().octets());
                b[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
                SIN6_LEN as libc::socklen_t
            }
        }
    }

    /// Reads the address the kernel wrote (`len` bytes); IPv4-mapped IPv6 comes out as IPv4.
    fn decode(&self, len: usize) -> Option<SocketAddr> {
        let b = &self.0;
        let port = u16::from_be_bytes([b[2], b[3]]);
        if b[..2] == AF_INET && len >= SIN_LEN {
            let ip = [b[4], b[5], b[6], b[7]];
            return Some(SocketAddr::V4(SocketAddrV4::new(ip.into(), port)));
        }
        if b[..2] == AF_INET6 && len >= SIN6_LEN {
            let ip: [u8; 16] = b[8..24].try_into().ok()?;
            let ip = std::net::Ipv6Addr::from(ip);
            if let Some(v4) = ip.to_ipv4_mapped() {
                return Some(SocketAddr::V4(SocketAddrV4::new(v4, port)));
            }
            let flow = u32::from_ne_bytes(b[4..8].try_into().ok()?);
            let scope = u32::from_ne_bytes(b[24..28].try_into().ok()?);
            return Some(SocketAddr::V6(SocketAddrV6::new(ip, port, flow, scope)));
        }
        None
    }
}

// ---------------------------------------------------------------------------------------------
// Message headers.

/// `mmsghdr`s and `iovec`s handed to the kernel. They hold raw pointers into this socket's
/// buffers (and, during a `send`, into the caller's bundle), written just before each system
/// call and never dereferenced by Rust code.
struct RawMsgs {
    hdrs: Vec<libc::mmsghdr>,
    iovs: Vec<libc::iovec>,
}

// SAFETY: the raw pointers inside are plain addresses between calls: they are rewritten before
// every system call that uses them and never read through by Rust code, so moving the arrays to
// another thread (Send) or sharing `&RawMsgs` (Sync, which gives access to nothing but the
// addresses' values) cannot cause a data race or a use after free.
unsafe impl Send for RawMsgs {}
// SAFETY: see `Send` above; `&RawMsgs` allows no write and no dereference.
unsafe impl Sync for RawMsgs {}

impl RawMsgs {
    /// `msgs` zeroed headers and an empty iovec list with room for `iovs` (send scratch).
    fn with_scratch(msgs: usize, iovs: usize) -> Self {
        let mut raw = RawMsgs::new(msgs, 0);
        raw.iovs.reserve(iovs);
        raw
    }

    /// `msgs` zeroed headers and `iovs` null iovecs.
    fn new(msgs: usize, iovs: usize) -> Self {
        // SAFETY: `mmsghdr` is integers and raw pointers only; all-zero (null pointers, zero
        // lengths) is a valid value of it.
        let zero: libc::mmsghdr = unsafe { std::mem::zeroed() };
        let iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        RawMsgs {
            hdrs: vec![zero; msgs],
            iovs: vec![iov; iovs],
        }
    }
}

/// Where a sent `msghdr`'s iovec list comes from.
#[derive(Debug, Clone, Copy)]
enum PieceIov {
    /// The bundle's own `IoSlice`s (ABI-compatible with `iovec`): the whole bundle in one go.
    Whole,
    /// `tx.raw.iovs[start..start + len]`: part of a bundle, cut at segment boundaries.
    Scratch { start: usize, len: usize },
}

/// One `msghdr` of a `sendmmsg` call: a whole bundle or a run of its segments.
#[derive(Debug, Clone, Copy)]
struct Piece {
    bundle: usize,
    segs: usize,
    bytes: usize,
    /// Offset in the bundle after this piece.
    end: usize,
    /// The bundle's last piece.
    last: bool,
    iov: PieceIov,
    namelen: libc::socklen_t,
    controllen: usize,
}

/// Walks a bundle's slices to cut it at arbitrary byte offsets.
struct IovWalk {
    idx: usize,
    inner: usize,
}

impl IovWalk {
    fn seek(iov: &[IoSlice<'_>], mut off: usize) -> Self {
        let mut idx = 0;
        while let Some(s) = iov.get(idx) {
            if off < s.len() {
                break;
            }
            off -= s.len();
            idx += 1;
        }
        IovWalk { idx, inner: off }
    }

    /// Appends iovecs for the next `len` bytes.
    fn take(&mut self, iov: &[IoSlice<'_>], mut len: usize, out: &mut Vec<libc::iovec>) {
        while len > 0 {
            let Some(s) = iov.get(self.idx) else { break };
            let rest = s.get(self.inner..).unwrap_or_default();
            let n = rest.len().min(len);
            if n > 0 {
                out.push(libc::iovec {
                    iov_base: rest.as_ptr().cast_mut().cast(),
                    iov_len: n,
                });
            }
            len -= n;
            self.inner += n;
            if self.inner >= s.len() {
                self.idx += 1;
                self.inner = 0;
            }
        }
    }
}

struct TxState {
    raw: RawMsgs,
    names: Vec<RawAddr>,
    cmsgs: Vec<CmsgBuf<SEND_CMSG_SPACE>>,
    pieces: Vec<Piece>,
}

struct RxState {
    raw: RawMsgs,
    names: Vec<RawAddr>,
    cmsgs: Vec<CmsgBuf<RECV_CMSG_SPACE>>,
    buf: Vec<u8>,
    buf_len: usize,
    /// Last `SO_RXQ_OVFL` value seen.
    drops_seen: u32,
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

        let efd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(|e| setup("eventfd")(e.into()))?;
        let waker = Waker {
            fd: Arc::new(OwnedFd::from(efd)),
        };

        let batch = cfg.recv_batch;
        Ok(UdpIo {
            sock,
            local,
            v6,
            waker,
            gso,
            gro,
            buffers,
            tx: TxState {
                raw: RawMsgs::with_scratch(MAX_SEND_MSGS, 4 * MAX_SEND_MSGS),
                names: vec![RawAddr::ZERO; MAX_SEND_MSGS],
                cmsgs: vec![CmsgBuf([0; SEND_CMSG_SPACE]); MAX_SEND_MSGS],
                pieces: Vec::with_capacity(MAX_SEND_MSGS),
            },
            rx: RxState {
                raw: RawMsgs::new(batch, batch),
                names: vec![RawAddr::ZERO; batch],
                cmsgs: vec![CmsgBuf([0; RECV_CMSG_SPACE]); batch],
                buf: vec![0; batch * cfg.recv_buffer_len],
                buf_len: cfg.recv_buffer_len,
                drops_seen: 0,
            },
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

    /// The destination as this socket's family wants it, and whether it is reached over IPv4
    /// (so its TOS goes in an `IP_TOS` control message).
    fn map_dst(&self, dst: SocketAddr) -> Result<(SocketAddr, bool), &'static str> {
        match (self.v6, dst) {
            (false, SocketAddr::V4(_)) => Ok((dst, true)),
            (false, SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
                Some(ip) => Ok((SocketAddr::V4(SocketAddrV4::new(ip, a.port())), true)),
                None => Err(
                    "IPv6 destination on an IPv4 socket: bind an IPv6 address (e.g. [::]) \
                     to reach IPv6 peers",
                ),
            },
            (true, SocketAddr::V4(a)) => {
                let ip = a.ip().to_ipv6_mapped();
                Ok((SocketAddr::V6(SocketAddrV6::new(ip, a.port(), 0, 0)), true))
            }
            (true, SocketAddr::V6(a)) => Ok((dst, a.ip().to_ipv4_mapped().is_some())),
        }
    }

    /// Fills `tx.pieces` (and their addresses, control messages and scratch iovecs) for one
    /// `sendmmsg`, from bundle `b` at byte `off` on. Err: bundle `b` itself is invalid.
    fn build(
        &mut self,
        batch: &[Transmit<'_>],
        mut b: usize,
        mut off: usize,
    ) -> Result<(), (SocketAddr, &'static str)> {
        self.tx.pieces.clear();
        self.tx.raw.iovs.clear();
        let max_payload = self.max_bundle_bytes();
        while let Some(t) = batch.get(b) {
            if self.tx.pieces.len() == MAX_SEND_MSGS {
                break;
            }
            let total = t.iov.iter().fold(0usize, |a, s| a.saturating_add(s.len()));
            let checked = if total > 0 && t.segment_size == 0 {
                Err("segment_size is 0 in a non-empty bundle: give the datagram size")
            } else if t.iov.len() > MAX_IOV {
                Err("more than 1024 slices in one bundle (the kernel's UIO_MAXIOV): gather fewer, larger slices")
            } else {
                self.map_dst(t.dst)
            };
            let (dst, via_v4) = match checked {
                Ok(d) => d,
                Err(reason) if self.tx.pieces.is_empty() => return Err((t.dst, reason)),
                // Send what is built; this bundle comes first next call and fails then.
                Err(_) => break,
            };
            let seg = t.segment_size.min(total);
            let per_piece = if self.gso && seg > 0 && seg <= usize::from(u16::MAX) {
                (max_payload / seg).clamp(1, UDP_MAX_SEGMENTS)
            } else {
                1
            };
            let mut walk = IovWalk::seek(t.iov, off);
            while self.tx.pieces.len() < MAX_SEND_MSGS {
                let bytes = per_piece.saturating_mul(seg).min(total - off);
                let end = off + bytes;
                let segs = if bytes == 0 { 1 } else { bytes.div_ceil(seg) };
                let iov = if off == 0 && end == total {
                    PieceIov::Whole
                } else {
                    let start = self.tx.raw.iovs.len();
                    walk.take(t.iov, bytes, &mut self.tx.raw.iovs);
                    PieceIov::Scratch {
                        start,
                        len: self.tx.raw.iovs.len() - start,
                    }
                };
                let i = self.tx.pieces.len();
                let namelen = self.tx.names[i].encode(&dst);
                let mut w = CmsgWriter::new(&mut self.tx.cmsgs[i].0);
                if segs > 1 {
                    let size = u16::try_from(seg).unwrap_or(u16::MAX);
                    w.push(libc::SOL_UDP, libc::UDP_SEGMENT, &size.to_ne_bytes());
                }
                if t.tos != 0 {
                    let tos = libc::c_int::from(t.tos).to_ne_bytes();
                    if via_v4 {
                        w.push(libc::IPPROTO_IP, libc::IP_TOS, &tos);
                    } else {
                        w.push(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &tos);
                    }
                }
                let controllen = w.len;
                self.tx.pieces.push(Piece {
                    bundle: b,
                    segs,
                    bytes,
                    end,
                    last: end == total,
                    iov,
                    namelen,
                    controllen,
                });
                off = end;
                if end == total {
                    break;
                }
            }
            if off == total {
                b += 1;
                off = 0;
            } else {
                break; // out of msghdrs mid-bundle
            }
        }
        Ok(())
    }

    /// One `sendmmsg` of the built pieces: how many the kernel took.
    fn sendmmsg(&mut self, batch: &[Transmit<'_>]) -> Result<usize, Errno> {
        #[cfg(test)]
        if self.fail_gso_once && self.tx.pieces.first().is_some_and(|p| p.segs > 1) {
            self.fail_gso_once = false;
            self.stats.send_syscalls += 1;
            return Err(Errno::EIO);
        }
        let names = self.tx.names.as_mut_ptr();
        let cmsgs = self.tx.cmsgs.as_mut_ptr();
        let iovs = self.tx.raw.iovs.as_mut_ptr();
        let pieces = &self.tx.pieces;
        for (i, (p, h)) in pieces.iter().zip(self.tx.raw.hdrs.iter_mut()).enumerate() {
            let m = &mut h.msg_hdr;
            m.msg_name = names.wrapping_add(i).cast();
            m.msg_namelen = p.namelen;
            match p.iov {
                PieceIov::Whole => {
                    let iov = batch.get(p.bundle).map_or(&[][..], |t| t.iov);
                    m.msg_iov = iov.as_ptr().cast_mut().cast();
                    m.msg_iovlen = iov.len() as _;
                }
                PieceIov::Scratch { start, len } => {
                    m.msg_iov = iovs.wrapping_add(start);
                    m.msg_iovlen = len as _;
                }
            }
            if p.controllen > 0 {
                m.msg_control = cmsgs.wrapping_add(i).cast();
            } else {
                m.msg_control = std::ptr::null_mut();
            }
            m.msg_controllen = p.controllen as _;
            m.msg_flags = 0;
            h.msg_len = 0;
        }
        let count = pieces.len().min(self.tx.raw.hdrs.len()) as libc::c_uint;
        self.stats.send_syscalls += 1;
        // SAFETY: `hdrs[..count]` were all filled above. Each `msg_name` points to a `RawAddr`
        // of `self.tx.names` (28 bytes >= `msg_namelen`), each `msg_control` to
        // `msg_controllen` initialised bytes of `self.tx.cmsgs` (or is null with length 0),
        // each `msg_iov` to `msg_iovlen` iovecs: either the caller's `IoSlice`s (guaranteed
        // ABI-compatible with `iovec`, borrowed through `batch` for this whole call) or entries
        // of `self.tx.raw.iovs` built from those slices in `build`, each within its slice. The
        // vectors are not touched between taking their pointers and the call, so the pointers
        // are valid; the kernel only reads all of it and writes nothing but `msg_len` in
        // `hdrs`, which we own mutably.
        let rc = unsafe {
            libc::sendmmsg(
                self.sock.as_raw_fd(),
                self.tx.raw.hdrs.as_mut_ptr(),
                count,
                libc::MSG_DONTWAIT,
            )
        };
        if rc < 0 {
            Err(Errno::last())
        } else {
            Ok(usize::try_from(rc).unwrap_or(0))
        }
    }

    /// Sends bundles with as few system calls as possible (`sendmmsg`, up to 64 `msghdr`s per
    /// call, one per GSO bundle).
    ///
    /// Returns how many bundles (from the front of `batch`) the kernel took. Fewer than
    /// `batch.len()` when the socket would block (`EAGAIN`/`ENOBUFS`), or when a later bundle
    /// fails: that bundle is then first in the next call, which reports its error. `Err` means
    /// the first bundle of `batch` was refused. A bundle sent as several `msghdr`s (without
    /// GSO, or above [`UdpIo::max_bundle_bytes`]) that the socket cuts short counts as not
    /// sent: sending it again repeats its first datagrams (the message layer drops
    /// duplicates).
    pub fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, IoError> {
        let (mut bundle, mut off) = (0usize, 0usize);
        while bundle < batch.len() {
            if let Err((dst, reason)) = self.build(batch, bundle, off) {
                return if bundle > 0 {
                    Ok(bundle)
                } else {
                    Err(IoError::Transmit {
                        local: self.local,
                        dst,
                        reason,
                    })
                };
            }
            match self.sendmmsg(batch) {
                Ok(0) => {
                    self.stats.send_would_block += 1;
                    return Ok(bundle);
                }
                Ok(n) => {
                    for p in self.tx.pieces.iter().take(n) {
                        self.stats.send_datagrams += p.segs as u64;
                        self.stats.send_bytes += p.bytes as u64;
                        if p.last {
                            self.stats.send_bundles += 1;
                            (bundle, off) = (p.bundle + 1, 0);
                        } else {
                            (bundle, off) = (p.bundle, p.end);
                        }
                    }
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN | Errno::ENOBUFS) => {
                    self.stats.send_would_block += 1;
                    return Ok(bundle);
                }
                // A pending ICMP error for an earlier datagram is reported by the next call,
                // which then sends nothing: read the error queue and send again.
                Err(
                    Errno::ECONNREFUSED
                    | Errno::EHOSTUNREACH
                    | Errno::ENETUNREACH
                    | Errno::EHOSTDOWN,
                ) if self.recverr => {
                    self.drain_errors();
                }
                Err(Errno::EIO)
                    if self.gso && self.tx.pieces.first().is_some_and(|p| p.segs > 1) =>
                {
                    // Some devices take UDP_SEGMENT at setsockopt and refuse it here: resend
                    // this bundle (from the same offset) datagram by datagram, for good.
                    self.gso = false;
                    self.stats.gso_fallbacks += 1;
                    let dst = batch.get(bundle).map_or(self.local, |t| t.dst);
                    log::warn!(
                        "UDP {}: the kernel refused a segmentation-offload send to {dst} (EIO): \
                         GSO is off for this socket, sending datagram by datagram",
                        self.local
                    );
                }
                Err(e) => {
                    if bundle > 0 {
                        return Ok(bundle);
                    }
                    let dst = batch.get(bundle).map_or(self.local, |t| t.dst);
                    return Err(IoError::Send {
                        local: self.local,
                        dst,
                        source: e.into(),
                    });
                }
            }
        }
        Ok(bundle)
    }

    /// Receives what is queued, without blocking: one `recvmmsg` (`MSG_DONTWAIT`) into the
    /// internal buffers, then `f` once per received *datagram* (a GRO buffer is split at its
    /// stride here, so `f` always sees single datagrams, in arrival order) with its metadata.
    /// Returns the number of datagrams: 0 when nothing is queued. Call again while it returns
    /// datagrams; one call moves at most `recv_batch` buffers.
    pub fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, IoError> {
        let rx = &mut self.rx;
        let buf_len = rx.buf_len;
        let count = rx.raw.hdrs.len().min(rx.raw.iovs.len());
        let base = rx.buf.as_mut_ptr();
        for (i, iov) in rx.raw.iovs.iter_mut().enumerate() {
            iov.iov_base = base.wrapping_add(i * buf_len).cast();
            iov.iov_len = buf_len;
        }
        let names = rx.names.as_mut_ptr();
        let cmsgs = rx.cmsgs.as_mut_ptr();
        let iovs = rx.raw.iovs.as_mut_ptr();
        for (i, h) in rx.raw.hdrs.iter_mut().enumerate() {
            let m = &mut h.msg_hdr;
            m.msg_name = names.wrapping_add(i).cast();
            m.msg_namelen = SIN6_LEN as libc::socklen_t;
            m.msg_iov = iovs.wrapping_add(i);
            m.msg_iovlen = 1;
            m.msg_control = cmsgs.wrapping_add(i).cast();
            m.msg_controllen = RECV_CMSG_SPACE as _;
            m.msg_flags = 0;
            h.msg_len = 0;
        }
        let received = loop {
            self.stats.recv_syscalls += 1;
            // SAFETY: `hdrs[..count]` were all filled just above: msg_name points to a
            // `RawAddr` of `rx.names` (28 writable bytes = msg_namelen), msg_control to a
            // `RECV_CMSG_SPACE`-byte buffer of `rx.cmsgs` (= msg_controllen), msg_iov to one
            // iovec of `rx.raw.iovs` covering `buf_len` bytes of `rx.buf` (chunk i of
            // `count * buf_len` bytes, in bounds since `buf` was allocated with
            // `recv_batch * buf_len` bytes and `count <= recv_batch`). All these vectors are
            // owned by `self`, mutably borrowed here, not resized or referenced between taking
            // their pointers and the call, and outlive it; the kernel writes only within those
            // lengths and into `hdrs`. A null timeout is allowed.
            let rc = unsafe {
                libc::recvmmsg(
                    self.sock.as_raw_fd(),
                    rx.raw.hdrs.as_mut_ptr(),
                    count as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if rc >= 0 {
                break usize::try_from(rc).unwrap_or(0).min(count);
            }
            match Errno::last() {
                Errno::EINTR => continue,
                Errno::EAGAIN => {
                    self.stats.recv_empty += 1;
                    return Ok(0);
                }
                // An ICMP error for one of our datagrams, reported once on the next call: read
                // the error queue (which destination) and carry on receiving.
                Errno::ECONNREFUSED
                | Errno::EHOSTUNREACH
                | Errno::ENETUNREACH
                | Errno::EHOSTDOWN
                    if self.recverr =>
                {
                    self.drain_errors();
                    return Ok(0);
                }
                e => {
                    return Err(IoError::Recv {
                        local: self.local,
                        source: e.into(),
                    })
                }
            }
        };

        let stats = &mut self.stats;
        stats.recv_buffers += received as u64;
        let mut datagrams = 0usize;
        for i in 0..received {
            let h = &rx.raw.hdrs[i];
            let len = (h.msg_len as usize).min(buf_len);
            let truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            // `size_t` with glibc, `socklen_t` with musl.
            #[allow(clippy::unnecessary_cast)]
            let controllen = (h.msg_hdr.msg_controllen as usize).min(RECV_CMSG_SPACE);
            let c = parse_cmsgs(&rx.cmsgs[i].0[..controllen]);
            if let Some(d) = c.drops {
                let delta = d.wrapping_sub(rx.drops_seen);
                if delta < 1 << 31 {
                    stats.recv_kernel_drops += u64::from(delta);
                    rx.drops_seen = d;
                }
            }
            let Some(src) = rx.names[i].decode(h.msg_hdr.msg_namelen as usize) else {
                stats.recv_malformed += 1;
                continue;
            };
            let meta = RecvMeta {
                src,
                tos: c.tos.unwrap_or(0),
            };
            let data = &rx.buf[i * buf_len..i * buf_len + len];
            if truncated {
                stats.recv_truncated += 1;
            }
            let stride = match c.stride {
                Some(s) if s > 0 => s,
                // One datagram; a truncated one is dropped.
                _ if truncated => continue,
                _ => len,
            };
            if len == 0 {
                f(meta, data);
                datagrams += 1;
                continue;
            }
            // A truncated GRO buffer: only its whole segments are datagrams.
            let whole = if truncated { len - len % stride } else { len };
            for d in data[..whole].chunks(stride) {
                f(meta, d);
                datagrams += 1;
                stats.recv_bytes += d.len() as u64;
            }
        }
        stats.recv_datagrams += datagrams as u64;
        Ok(datagrams)
    }

    /// Destinations the kernel reported unreachable since the last call (ICMP port
    /// unreachable: nothing listens there any more, e.g. the peer's process exited).
    pub fn take_unreachable(&mut self) -> Vec<SocketAddr> {
        if self.recverr {
            self.drain_errors();
        }
        std::mem::take(&mut self.unreachable)
    }

    /// Reads the socket's error queue (at most 64 entries per call): each entry is one ICMP
    /// error with the original destination as its address.
    fn drain_errors(&mut self) {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrStorage};
        let mut payload = [0u8; 64];
        // Room for the extended error and its offender address, and for the TOS/TCLASS and
        // other control messages the socket asks for on every message (an IPv6 socket gets
        // several): a truncated control area would hide the error.
        // Aligned like `struct cmsghdr`, which the kernel writes and nix reads in place.
        #[repr(align(8))]
        struct Control([u8; 512]);
        let mut cmsg = Control([0u8; 512]);
        for _ in 0..64 {
            let mut iov = [std::io::IoSliceMut::new(&mut payload)];
            let msg = match recvmsg::<SockaddrStorage>(
                self.sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg.0),
                MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(m) => m,
                Err(Errno::EINTR) => continue,
                Err(_) => return, // EAGAIN: the queue is empty
            };
            let dst = msg.address.and_then(|a| {
                a.as_sockaddr_in()
                    .map(|v4| SocketAddr::V4(SocketAddrV4::from(*v4)))
                    .or_else(|| {
                        a.as_sockaddr_in6()
                            .map(|v6| SocketAddr::V6(SocketAddrV6::from(*v6)))
                    })
            });
            let refused = msg.cmsgs().into_iter().flatten().any(|c| match c {
                ControlMessageOwned::Ipv4RecvErr(e, _) | ControlMessageOwned::Ipv6RecvErr(e, _) => {
                    e.ee_errno == libc::ECONNREFUSED as u32
                }
                _ => false,
            });
            self.stats.icmp_errors += 1;
            if let (Some(dst), true) = (dst, refused) {
                if !self.unreachable.contains(&dst) {
                    self.unreachable.push(dst);
                }
            }
        }
    }

    /// Blocks until the socket is readable (or writable, when `want_write`), the [`Waker`]
    /// fires, or `timeout` passes (`None`: forever). Drains the waker. A signal ends the wait
    /// early with nothing set.
    pub fn wait(&self, timeout: Option<Duration>, want_write: bool) -> Result<Readiness, IoError> {
        let mut events = PollFlags::POLLIN;
        if want_write {
            events |= PollFlags::POLLOUT;
        }
        let mut fds = [
            PollFd::new(self.sock.as_fd(), events),
            PollFd::new(self.waker.fd.as_fd(), PollFlags::POLLIN),
        ];
        let ts = timeout
            .filter(|d| d.as_secs() < FOREVER_SECS)
            .map(TimeSpec::from_duration);
        match ppoll(&mut fds, ts, None) {
            Ok(_) => {}
            Err(Errno::EINTR) => return Ok(Readiness::default()),
            Err(e) => {
                return Err(IoError::Wait {
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
            let _ = nix::unistd::read(&*self.waker.fd, &mut b);
        }
        Ok(Readiness {
            readable: sock.intersects(PollFlags::POLLIN | PollFlags::POLLERR),
            writable: want_write && sock.contains(PollFlags::POLLOUT),
            woken,
            errors: sock.contains(PollFlags::POLLERR),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::time::Instant;

    #[test]
    fn cmsg_layout_matches_libc() {
        for n in [1usize, 2, 4, 8, 13] {
            let len = u32::try_from(n).unwrap();
            // SAFETY: CMSG_LEN and CMSG_SPACE are arithmetic on their argument only.
            let (l, s) = unsafe { (libc::CMSG_LEN(len), libc::CMSG_SPACE(len)) };
            assert_eq!(cmsg_len(n), l as usize, "CMSG_LEN({n})");
            assert_eq!(cmsg_space(n), s as usize, "CMSG_SPACE({n})");
        }
        assert_eq!(CMSG_HDR, cmsg_align(std::mem::size_of::<libc::cmsghdr>()));
        assert_eq!(std::mem::offset_of!(libc::cmsghdr, cmsg_level), USIZE);
        assert_eq!(std::mem::offset_of!(libc::cmsghdr, cmsg_type), USIZE + 4);
        assert!(std::mem::align_of::<CmsgBuf<8>>() >= std::mem::align_of::<libc::cmsghdr>());
        // The send buffer holds both messages we may write.
        assert!(cmsg_space(2) + cmsg_space(4) <= SEND_CMSG_SPACE);
        assert!(4 * cmsg_space(4) <= RECV_CMSG_SPACE);
    }

    #[test]
    fn cmsgs_round_trip_and_bad_input_stops_parsing() {
        let mut buf = CmsgBuf([0u8; RECV_CMSG_SPACE]);
        let mut w = CmsgWriter::new(&mut buf.0);
        assert!(w.push(libc::SOL_UDP, libc::UDP_GRO, &1472i32.to_ne_bytes()));
        assert!(w.push(libc::IPPROTO_IP, libc::IP_TOS, &[0xb9]));
        assert!(w.push(libc::SOL_SOCKET, libc::SO_RXQ_OVFL, &7u32.to_ne_bytes()));
        let n = w.len;
        let c = parse_cmsgs(&buf.0[..n]);
        assert_eq!(
            c,
            RecvCmsgs {
                stride: Some(1472),
                tos: Some(0xb9),
                drops: Some(7)
            }
        );
        // Too small to hold another message: refused, nothing written.
        let mut small = [0u8; 20];
        let mut w = CmsgWriter::new(&mut small);
        assert!(!w.push(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &1i32.to_ne_bytes()));
        assert_eq!(w.len, 0);
        // A length running past the buffer, a zero length, or garbage: no panic, stops.
        let mut bad = buf.0;
        bad[..USIZE].copy_from_slice(&usize::MAX.to_ne_bytes());
        assert_eq!(parse_cmsgs(&bad[..n]), RecvCmsgs::default());
        bad[..USIZE].copy_from_slice(&0usize.to_ne_bytes());
        assert_eq!(parse_cmsgs(&bad[..n]), RecvCmsgs::default());
        for len in 0..n {
            let _ = parse_cmsgs(&buf.0[..len]);
        }
    }

    #[test]
    fn addresses_round_trip_in_kernel_layout() {
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in, sin_port), 2);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in, sin_addr), 4);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in6, sin6_flowinfo), 4);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in6, sin6_addr), 8);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in6, sin6_scope_id), 24);
        let mut raw = RawAddr::ZERO;
        let v4 = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 1), 0x1234));
        assert_eq!(raw.encode(&v4) as usize, SIN_LEN);
        assert_eq!(&raw.0[2..8], &[0x12, 0x34, 127, 0, 0, 1]);
        assert_eq!(raw.decode(SIN_LEN), Some(v4));
        assert_eq!(raw.decode(SIN_LEN - 1), None);
        let v6 = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::LOCALHOST, 4791, 5, 2));
        assert_eq!(raw.encode(&v6) as usize, SIN6_LEN);
        assert_eq!(raw.decode(SIN6_LEN), Some(v6));
        let mapped = SocketAddr::from((Ipv4Addr::new(10, 1, 2, 3).to_ipv6_mapped(), 9));
        raw.encode(&mapped);
        assert_eq!(
            raw.decode(SIN6_LEN),
            Some(SocketAddr::from((Ipv4Addr::new(10, 1, 2, 3), 9)))
        );
        assert_eq!(RawAddr::ZERO.decode(SIN6_LEN), None);
    }

    #[test]
    fn iov_walk_cuts_across_slices() {
        let data: Vec<u8> = (0..=255).collect();
        let parts = [&data[..10], &data[10..10], &data[10..100], &data[100..]];
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut out = Vec::new();
        for (off, len) in [(0, 256), (5, 7), (10, 90), (95, 161), (250, 100), (256, 1)] {
            out.clear();
            IovWalk::seek(&iov, off).take(&iov, len, &mut out);
            let got: usize = out.iter().map(|v| v.iov_len).sum();
            assert_eq!(got, len.min(256 - off.min(256)), "off {off} len {len}");
            if let Some(first) = out.first() {
                assert_eq!(first.iov_base.cast_const(), data[off..].as_ptr().cast());
            }
        }
    }

    #[test]
    fn send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<UdpIo>();
        check::<Waker>();
    }

    /// A GSO send the device refuses with EIO: GSO goes off, the bundle is resent datagram
    /// by datagram, byte for byte, in the same `send`.
    #[test]
    fn eio_on_gso_send_falls_back_to_datagrams() {
        let cfg = UdpConfig::default();
        let lo = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let mut tx = UdpIo::bind(lo, &cfg).unwrap();
        let mut rx = UdpIo::bind(lo, &cfg).unwrap();
        assert!(tx.gso_enabled(), "this test needs a kernel with UDP GSO");
        let seg = 1000;
        let data: Vec<u8> = (0..seg * 5 + 17).map(|i| (i * 7 % 251) as u8).collect();
        let iov = [IoSlice::new(&data[..3000]), IoSlice::new(&data[3000..])];
        tx.fail_gso_once = true;
        let t = Transmit {
            dst: rx.local_addr(),
            tos: 0,
            segment_size: seg,
            iov: &iov,
        };
        assert_eq!(tx.send(&[t]).unwrap(), 1);
        assert!(!tx.gso_enabled());
        assert_eq!(tx.max_segments(), 1);
        let s = tx.stats();
        assert_eq!(s.gso_fallbacks, 1);
        assert_eq!(
            s.send_syscalls, 2,
            "the refused call, then one sendmmsg of 6 datagrams"
        );
        assert_eq!((s.send_bundles, s.send_datagrams), (1, 6));
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < 6 && Instant::now() < deadline {
            rx.wait(Some(Duration::from_millis(100)), false).unwrap();
            rx.recv(&mut |_, d| got.push(d.to_vec())).unwrap();
        }
        let want: Vec<Vec<u8>> = data.chunks(seg).map(<[u8]>::to_vec).collect();
        assert_eq!(got, want);
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
