//! An AF_XDP socket: its UMEM, its four rings, and the bind to one (interface, queue).
//!
//! Zero-copy is requested when configured and the driver supports it; otherwise (veth, or a
//! driver without AF_XDP zero-copy) the socket binds in copy mode, and the mode in use is
//! reported. need_wakeup is always requested: without it the kernel polls the rings itself and
//! burns a core even when idle.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::ring::Ring;
use super::syscall;
use super::umem::Umem;

/// How the socket moves packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BindMode {
    /// The NIC DMAs straight into the UMEM.
    ZeroCopy,
    /// The kernel copies between its buffers and the UMEM (veth, generic XDP).
    Copy,
}

/// Socket-level configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketConfig {
    /// Frames in the UMEM.
    pub frames: u32,
    /// Frame size (2048 or 4096).
    pub frame_size: u32,
    /// Entries in each of the four rings (power of two).
    pub ring_size: u32,
    /// Put the UMEM on 2 MiB huge pages when available.
    pub hugepages: bool,
    /// Try zero-copy first.
    pub zero_copy: bool,
    /// `SO_PREFER_BUSY_POLL` + `SO_BUSY_POLL` (µs) + `SO_BUSY_POLL_BUDGET`, for busy-poll cores.
    pub busy_poll: Option<BusyPoll>,
}

/// Busy-poll socket options (real hosts; needs the NIC's napi_defer_hard_irqs and
/// gro_flush_timeout set, see docs/tuning.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyPoll {
    /// `SO_BUSY_POLL`, microseconds.
    pub usecs: u32,
    /// `SO_BUSY_POLL_BUDGET`, packets per poll.
    pub budget: u32,
}

impl Default for SocketConfig {
    fn default() -> Self {
        SocketConfig {
            frames: 4096,
            frame_size: 4096,
            ring_size: 2048,
            hugepages: true,
            zero_copy: true,
            busy_poll: None,
        }
    }
}

/// Kernel counters of one socket (`XDP_STATISTICS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelStats {
    /// Dropped for other reasons (e.g. no room).
    pub rx_dropped: u64,
    /// Dropped because of invalid descriptors on RX.
    pub rx_invalid_descs: u64,
    /// Dropped because of invalid descriptors on TX.
    pub tx_invalid_descs: u64,
    /// Dropped because the RX ring was full.
    pub rx_ring_full: u64,
    /// Times the FILL ring was empty when a packet arrived.
    pub rx_fill_ring_empty_descs: u64,
    /// Times the TX ring was empty when the kernel looked.
    pub tx_ring_empty_descs: u64,
}

/// A bound AF_XDP socket with its own UMEM.
#[derive(Debug)]
pub struct XskSocket {
    // Field order is drop order: rings are unmapped before the socket closes, the UMEM last.
    pub(crate) fill: Ring<u64>,
    pub(crate) comp: Ring<u64>,
    pub(crate) rx: Ring<libc::xdp_desc>,
    pub(crate) tx: Ring<libc::xdp_desc>,
    fd: OwnedFd,
    pub(crate) umem: Umem,
    mode: BindMode,
    ifindex: u32,
    queue: u32,
}

/// A step of setting up an AF_XDP socket that failed: which one, and the OS error with its
/// code, followed in the message by what to do about it ([`gradwire_ebpf::error::hint`]).
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}{}", gradwire_ebpf::error::hint_suffix(source.raw_os_error()))]
pub struct SocketError {
    /// The step: the system call or socket option, with its arguments.
    pub op: String,
    /// The OS error.
    pub source: io::Error,
}

impl SocketError {
    /// The OS error code (`errno`), when the kernel refused.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

/// Names the step an io error comes from, keeping the error itself.
fn ctx(op: &'static str) -> impl Fn(io::Error) -> SocketError {
    move |source| SocketError {
        op: op.to_owned(),
        source,
    }
}

impl XskSocket {
    /// Create the UMEM, the socket and its rings, and bind to `(ifindex, queue)`.
    pub fn bind(ifindex: u32, queue: u32, cfg: &SocketConfig) -> Result<XskSocket, SocketError> {
        let umem =
            Umem::new(cfg.frames, cfg.frame_size, cfg.hugepages).map_err(|source| SocketError {
                op: format!("UMEM of {} frames of {} bytes", cfg.frames, cfg.frame_size),
                source,
            })?;
        let fd = syscall::xsk_socket().map_err(ctx("socket(AF_XDP)"))?;
        let (base, len) = umem.area();
        syscall::umem_reg(&fd, base, len, cfg.frame_size, 0).map_err(ctx("XDP_UMEM_REG"))?;
        for (opt, what) in [
            (libc::XDP_UMEM_FILL_RING, "XDP_UMEM_FILL_RING"),
            (libc::XDP_UMEM_COMPLETION_RING, "XDP_UMEM_COMPLETION_RING"),
            (libc::XDP_RX_RING, "XDP_RX_RING"),
            (libc::XDP_TX_RING, "XDP_TX_RING"),
        ] {
            syscall::setsockopt(&fd, libc::SOL_XDP, opt, &cfg.ring_size).map_err(ctx(what))?;
        }
        let (off, off_len) =
            syscall::getsockopt_xdp::<libc::xdp_mmap_offsets>(&fd, libc::XDP_MMAP_OFFSETS)
                .map_err(ctx("XDP_MMAP_OFFSETS"))?;
        if off_len != std::mem::size_of::<libc::xdp_mmap_offsets>() {
            return Err(SocketError {
                op: "XDP_MMAP_OFFSETS".into(),
                source: io::Error::new(
                    io::ErrorKind::Unsupported,
                    "kernel too old for AF_XDP ring flags (need Linux 5.4 or newer)",
                ),
            });
        }
        let fill = Ring::map(
            &fd,
            &off.fr,
            cfg.ring_size,
            libc::XDP_UMEM_PGOFF_FILL_RING as i64,
        )
        .map_err(ctx("mmap FILL ring"))?;
        let comp = Ring::map(
            &fd,
            &off.cr,
            cfg.ring_size,
            libc::XDP_UMEM_PGOFF_COMPLETION_RING as i64,
        )
        .map_err(ctx("mmap COMPLETION ring"))?;
        let rx = Ring::map(&fd, &off.rx, cfg.ring_size, libc::XDP_PGOFF_RX_RING)
            .map_err(ctx("mmap RX ring"))?;
        let tx = Ring::map(&fd, &off.tx, cfg.ring_size, libc::XDP_PGOFF_TX_RING)
            .map_err(ctx("mmap TX ring"))?;
        if let Some(bp) = cfg.busy_poll {
            let one: libc::c_int = 1;
            syscall::setsockopt(&fd, libc::SOL_SOCKET, libc::SO_PREFER_BUSY_POLL, &one)
                .map_err(ctx("SO_PREFER_BUSY_POLL"))?;
            let us = bp.usecs as libc::c_int;
            syscall::setsockopt(&fd, libc::SOL_SOCKET, libc::SO_BUSY_POLL, &us)
                .map_err(ctx("SO_BUSY_POLL"))?;
            let budget = bp.budget as libc::c_int;
            syscall::setsockopt(&fd, libc::SOL_SOCKET, libc::SO_BUSY_POLL_BUDGET, &budget)
                .map_err(ctx("SO_BUSY_POLL_BUDGET"))?;
        }
        let wake = libc::XDP_USE_NEED_WAKEUP;
        let mode = if cfg.zero_copy
            && syscall::bind(&fd, ifindex, queue, libc::XDP_ZEROCOPY | wake).is_ok()
        {
            BindMode::ZeroCopy
        } else {
            // A socket just closed on this queue is released asynchronously by the kernel;
            // until then bind says EBUSY. Retry briefly rather than fail a quick restart.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            loop {
                match syscall::bind(&fd, ifindex, queue, libc::XDP_COPY | wake) {
                    Ok(()) => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY)
                            && std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    Err(source) => {
                        return Err(SocketError {
                            op: format!("bind to ifindex {ifindex} queue {queue} in copy mode"),
                            source,
                        })
                    }
                }
            }
            BindMode::Copy
        };
        Ok(XskSocket {
            fill,
            comp,
            rx,
            tx,
            fd,
            umem,
            mode,
            ifindex,
            queue,
        })
    }

    /// The socket's file descriptor (for the XSKMAP).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Raw fd.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Copy or zero-copy.
    pub fn mode(&self) -> BindMode {
        self.mode
    }

    /// Interface index.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Queue id.
    pub fn queue(&self) -> u32 {
        self.queue
    }

    /// Whether the UMEM is on huge pages.
    pub fn hugepages(&self) -> bool {
        self.umem.hugepages()
    }

    /// The UMEM split every user of a socket starts from: the first half of the frames (at
    /// most one ring's worth) to put on the FILL ring, the second half free for TX.
    pub(crate) fn initial_frames(&self) -> (Vec<u64>, Vec<u64>) {
        let (frames, ring) = (self.umem.frames(), self.fill.size());
        let half = frames / 2;
        let fill = (0..half.min(ring))
            .map(|i| self.umem.frame_addr(i))
            .collect();
        let free_tx = (half..frames).map(|i| self.umem.frame_addr(i)).collect();
        (fill, free_tx)
    }

    /// Puts as many of `pending` on the FILL ring as fit and removes them from it; returns
    /// false when some did not fit (the ring was full).
    pub(crate) fn refill(&mut self, pending: &mut Vec<u64>) -> bool {
        if pending.is_empty() {
            return true;
        }
        let n = self.fill.produce(pending);
        let all = n == pending.len();
        pending.drain(..n);
        all
    }

    /// Moves every completed TX frame into `free` (`scratch` is a reusable buffer).
    pub(crate) fn reap_completions(&mut self, scratch: &mut Vec<u64>, free: &mut Vec<u64>) {
        scratch.clear();
        let n = self.comp.size() as usize;
        self.comp.consume(n, scratch);
        free.extend_from_slice(scratch);
    }

    /// The kernel's counters for this socket.
    pub fn kernel_stats(&self) -> io::Result<KernelStats> {
        let (s, _) =
            syscall::getsockopt_xdp::<libc::xdp_statistics>(&self.fd, libc::XDP_STATISTICS)?;
        Ok(KernelStats {
            rx_dropped: s.rx_dropped,
            rx_invalid_descs: s.rx_invalid_descs,
            tx_invalid_descs: s.tx_invalid_descs,
            rx_ring_full: s.rx_ring_full,
            rx_fill_ring_empty_descs: s.rx_fill_ring_empty_descs,
            tx_ring_empty_descs: s.tx_ring_empty_descs,
        })
    }
}
