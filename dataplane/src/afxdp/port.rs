//! A raw-frame AF_XDP port: whole Ethernet frames in and out of one (interface, queue), with
//! no parsing and no addressing of its own.
//!
//! This is what a software switch needs (the emulated switch in `fabric/` owns one per switch
//! port): frames are copied out of the RX ring's UMEM frame into the caller's buffer through a
//! callback, and copied from the caller's buffer into a free TX frame. The transport's
//! [`super::AfXdpDatapath`] instead parses gradwire UDP in place; both share [`socket`],
//! [`super::umem`] and [`super::ring`].
//!
//! The XDP program in front of the port must redirect every frame to this socket (the
//! classifier's switch-port mode, [`gradwire_ebpf::XdpConfig::switch_port`]); [`RawPort::open`]
//! attaches it. Setting a port up takes the same steps as the datapath (classifier, socket and
//! UMEM, XSKMAP entry) and fails with the same [`AfXdpError`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd, RawFd};

use gradwire_ebpf::{AttachMode, XdpConfig, XdpCounters, XdpError, XdpProgram};

use super::socket::{self, BindMode, KernelStats, SocketConfig};
use super::{syscall, AfXdpError};

/// Most `sendto` calls one [`RawPort::flush`] makes (each sends up to 32 frames in copy mode).
const MAX_KICKS: usize = 64;

/// Counters of one raw port.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RawPortStats {
    /// Frames received.
    pub rx_packets: u64,
    /// Bytes received (whole frames).
    pub rx_bytes: u64,
    /// Frames sent.
    pub tx_packets: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Frames refused by [`RawPort::send`]: no free TX frame or TX ring room, or larger than a
    /// UMEM frame.
    pub tx_refused: u64,
    /// TX kicks (`sendto`).
    pub kicks: u64,
}

/// One AF_XDP socket on queue 0 of an interface, with the switch-port XDP program attached.
pub struct RawPort {
    // Field order is drop order: the socket leaves the XSKMAP before the program detaches.
    sock: socket::XskSocket,
    xdp: XdpProgram,
    ifname: String,
    /// TX frames not in flight.
    free_tx: Vec<u64>,
    /// RX frames consumed and not yet back on FILL.
    refill: Vec<u64>,
    rx_descs: Vec<libc::xdp_desc>,
    tx_descs: Vec<libc::xdp_desc>,
    comp: Vec<u64>,
    stats: RawPortStats,
}

impl std::fmt::Debug for RawPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawPort")
            .field("ifname", &self.ifname)
            .field("mode", &self.sock.mode())
            .finish_non_exhaustive()
    }
}

impl RawPort {
    /// Attaches the switch-port XDP program to `ifname` (in the calling thread's network
    /// namespace) in `mode` and binds a socket to its queue 0. The socket keeps the namespace
    /// it was created in, so one thread may own ports of many namespaces.
    pub fn open(ifname: &str, mode: AttachMode, cfg: &SocketConfig) -> Result<RawPort, AfXdpError> {
        let ifindex = super::ifindex(ifname)?;
        // The port list is not consulted in switch-port mode but must be valid.
        let mut xc = XdpConfig::new(vec![1]);
        xc.switch_port = true;
        xc.mode = mode;
        let xdp = super::attach_classifier(ifname, ifindex, &xc)?;
        let sock = super::bind_registered(ifname, ifindex, &xdp, 0, cfg)?;
        let (refill, free_tx) = sock.initial_frames();
        let ring = cfg.ring_size as usize;
        let mut port = RawPort {
            sock,
            xdp,
            ifname: ifname.to_owned(),
            free_tx,
            refill,
            rx_descs: Vec::with_capacity(ring),
            tx_descs: Vec::with_capacity(ring),
            comp: Vec::with_capacity(ring),
            stats: RawPortStats::default(),
        };
        port.give_back();
        Ok(port)
    }

    /// Interface name.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// The socket's fd, to wait on with `poll()`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.sock.fd().as_fd()
    }

    /// The socket's raw fd.
    pub fn raw_fd(&self) -> RawFd {
        self.sock.raw_fd()
    }

    /// Copy or zero-copy.
    pub fn mode(&self) -> BindMode {
        self.sock.mode()
    }

    /// XDP attach mode in use.
    pub fn xdp_mode(&self) -> Option<AttachMode> {
        self.xdp.attach_mode()
    }

    /// Counters.
    pub fn stats(&self) -> RawPortStats {
        self.stats
    }

    /// The kernel's socket counters (drops for a full RX ring or an empty FILL ring).
    pub fn kernel_stats(&self) -> io::Result<KernelStats> {
        self.sock.kernel_stats()
    }

    /// The XDP program's counters (`switched` counts every frame it handed over).
    pub fn xdp_counters(&self) -> Result<XdpCounters, XdpError> {
        self.xdp.counters()
    }

    /// Whether received frames are waiting.
    pub fn rx_ready(&mut self) -> bool {
        self.sock.rx.available() > 0
    }

    /// Hands up to `max` received frames to `f`, one at a time, and returns their number. The
    /// slice is valid only during the call: `f` copies what it keeps.
    pub fn recv(&mut self, max: usize, mut f: impl FnMut(&[u8])) -> usize {
        self.rx_descs.clear();
        let n = self.sock.rx.consume(max, &mut self.rx_descs);
        for d in &self.rx_descs {
            // A descriptor outside one frame cannot come from the kernel; skip rather than
            // trust it, but still return the frame.
            if let Some(frame) = self.sock.umem.get(d.addr, d.len as usize) {
                self.stats.rx_packets += 1;
                self.stats.rx_bytes += u64::from(d.len);
                f(frame);
            }
            self.refill.push(self.sock.umem.frame_base(d.addr));
        }
        self.give_back();
        n
    }

    fn give_back(&mut self) {
        // A full FILL ring keeps the rest for the next call.
        self.sock.refill(&mut self.refill);
        if self.sock.fill.needs_wakeup() {
            // Zero-copy drivers stop taking FILL entries until woken.
            let _ = syscall::recv_kick(self.sock.raw_fd());
        }
    }

    /// Queues `frame` for transmission (sent by [`RawPort::flush`]). Returns false, counting
    /// it in `tx_refused`, when no TX frame or ring slot is free or the frame does not fit a
    /// UMEM frame: the caller decides what a refused frame means (a switch drops it).
    pub fn send(&mut self, frame: &[u8]) -> bool {
        if self.free_tx.is_empty() {
            self.reap();
        }
        let room = self.sock.tx.free() as usize > self.tx_descs.len();
        let Some(addr) = self.free_tx.pop().filter(|_| room) else {
            self.stats.tx_refused += 1;
            return false;
        };
        let Some(buf) = self.sock.umem.get_mut(addr, frame.len()) else {
            self.free_tx.push(addr);
            self.stats.tx_refused += 1;
            return false;
        };
        buf.copy_from_slice(frame);
        self.tx_descs.push(libc::xdp_desc {
            addr,
            len: frame.len() as u32,
            options: 0,
        });
        self.stats.tx_packets += 1;
        self.stats.tx_bytes += frame.len() as u64;
        true
    }

    /// Puts the frames queued by [`RawPort::send`] on the TX ring and wakes the kernel.
    pub fn flush(&mut self) -> io::Result<()> {
        if !self.tx_descs.is_empty() {
            let pushed = self.sock.tx.produce(&self.tx_descs);
            // `send` reserved ring room for each descriptor; anything left is returned.
            for d in self.tx_descs.drain(pushed..) {
                self.free_tx.push(d.addr);
                self.stats.tx_packets -= 1;
                self.stats.tx_bytes -= u64::from(d.len);
                self.stats.tx_refused += 1;
            }
            self.tx_descs.clear();
            // Zero-copy transmits when the driver asks to be woken.
            if pushed > 0 && self.sock.mode() == BindMode::ZeroCopy && self.sock.tx.needs_wakeup() {
                self.stats.kicks += 1;
                syscall::kick(self.sock.raw_fd())?;
            }
        }
        // Copy mode transmits only inside sendto(), at most 32 frames per call (the kernel's
        // TX_BATCH_SIZE): kick until the ring is drained, bounded.
        if self.sock.mode() == BindMode::Copy {
            for _ in 0..MAX_KICKS {
                if self.sock.tx.pending() == 0 {
                    break;
                }
                self.stats.kicks += 1;
                syscall::kick(self.sock.raw_fd())?;
            }
        }
        self.reap();
        Ok(())
    }

    /// TX frames on the ring that the kernel has not taken yet.
    pub fn tx_pending(&mut self) -> u32 {
        self.sock.tx.pending()
    }

    fn reap(&mut self) {
        self.sock
            .reap_completions(&mut self.comp, &mut self.free_tx);
    }
}
