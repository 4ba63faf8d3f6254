//! The engine: one poll-mode worker thread per queue, pinned to its core, owning that queue's
//! AF_XDP socket; the API thread (the one running the protocol) talks to the workers over
//! crossbeam channels and is itself a [`Datapath`].
//!
//! Frames move by ownership, never by copy:
//!
//! ```text
//!  worker q (pinned)                                   API thread (protocol driver)
//!  RX ring -> parse frame in place -> RxItem batch --->  recv(): datagram slice from the UMEM
//!                                                        -> deliver() copies the payload once
//!  FILL ring <- refill batch <------------------------   into the tensor; frames handed back
//!  free TX frames (initial, completions) ------------->  send(): fill() writes the datagram
//!                                                        into a lent frame, headers in front
//!  TX ring <- transmit batch <------------------------   (payload copied once, from the tensor)
//! ```
//!
//! A frame address is owned by exactly one party at a time (the kernel, its worker, or the
//! API thread), and only the owner touches its bytes; that is what makes the shared UMEM
//! accessors sound. Workers sleep in `poll()` on their socket and an eventfd the API thread
//! signals after handing them work (wake-on-demand), or spin (busy-poll).
#![allow(unsafe_code)]

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use gradwire_ebpf::XdpProgram;
use nix::sys::eventfd::{EfdFlags, EventFd};

use super::neigh;
use super::socket::{BindMode, SocketError, XskSocket};
use super::umem::SharedUmem;
use super::{syscall, AfXdpConfig, AfXdpError, AfXdpStats, KernelStats, PollMode, QueueStats};
use crate::datapath::{Datapath, DatapathError, DatapathStats, Deliver, Fill, RxMeta};
use crate::wire::frame;

/// Engine configuration: the AF_XDP settings plus the cores of the workers.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Interface, queues, sockets, XDP options.
    pub afxdp: AfXdpConfig,
    /// Core of each queue's worker, in queue order (empty: not pinned).
    pub cores: Vec<usize>,
}

/// One received datagram, lent to the API thread.
#[derive(Debug, Clone, Copy)]
struct RxItem {
    queue: u16,
    /// Frame base (returned to FILL).
    frame: u64,
    /// Datagram start and length within the UMEM.
    addr: u64,
    len: u32,
    src: SocketAddr,
    tos: u8,
}

enum Cmd {
    Refill(Vec<u64>),
    Transmit(Vec<libc::xdp_desc>),
}

/// Counters a worker updates and anyone can read.
#[derive(Debug, Default)]
struct WorkerStats {
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    rx_malformed: AtomicU64,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    fill_empty: AtomicU64,
    sleeps: AtomicU64,
    kicks: AtomicU64,
    kernel: Mutex<KernelStats>,
}

struct WorkerHandle {
    queue: u32,
    core: Option<usize>,
    mode: BindMode,
    hugepages: bool,
    umem: SharedUmem,
    frame_size: u32,
    cmd: Sender<Cmd>,
    free_tx: Receiver<Vec<u64>>,
    wake: Arc<EventFd>,
    stats: Arc<WorkerStats>,
    thread: Option<JoinHandle<()>>,
    /// Free TX frames lent to the API thread.
    pool: Vec<u64>,
}

/// The engine's API side: a [`Datapath`] whose packets are moved by pinned workers.
pub struct Engine {
    cfg: AfXdpConfig,
    workers: Vec<WorkerHandle>,
    rx: Receiver<Vec<RxItem>>,
    pending: std::collections::VecDeque<RxItem>,
    stop: Arc<AtomicBool>,
    failure: Arc<Mutex<Option<String>>>,
    xdp: XdpProgram,
    /// The live flows' sources in the classifier's allowlist.
    admitted: super::PeerAdmissions,
    src_mac: [u8; 6],
    neigh: neigh::Neighbors,
    ident: u16,
    tx_next: usize,
    tx_ring_full: u64,
    stats: DatapathStats,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("ifname", &self.cfg.ifname)
            .field("queues", &self.cfg.queues)
            .finish_non_exhaustive()
    }
}

/// Pin the calling thread to `core`. The core is named directly: `get_core_ids` only lists
/// the cores of the caller's current affinity mask, which a pinned parent narrows.
fn pin(core: usize) -> bool {
    core_affinity::set_for_current(core_affinity::CoreId { id: core })
}

/// Cores the machine has online.
fn online_cores() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .max(
            nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
                .ok()
                .flatten()
                .map_or(0, |n| n as usize),
        )
}

struct Worker {
    sock: XskSocket,
    poll: PollMode,
    batch: usize,
    port: u16,
    cmd: Receiver<Cmd>,
    rx_out: Sender<Vec<RxItem>>,
    free_out: Sender<Vec<u64>>,
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    stats: Arc<WorkerStats>,
    refill: Vec<u64>,
    tx_pending: Vec<libc::xdp_desc>,
}

impl Worker {
    fn run(mut self) -> Result<(), String> {
        let mut descs = Vec::with_capacity(self.batch);
        let mut comp = Vec::with_capacity(self.sock.comp.size() as usize);
        let mut last_kernel = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let mut work = false;
            loop {
                match self.cmd.try_recv() {
                    Ok(Cmd::Refill(a)) => self.refill.extend(a),
                    Ok(Cmd::Transmit(d)) => self.tx_pending.extend(d),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return Ok(()),
                }
                work = true;
            }
            // TX: submit, kick (copy mode transmits only inside sendto), reap completions.
            if !self.tx_pending.is_empty() {
                let n = self.sock.tx.produce(&self.tx_pending);
                if n > 0 {
                    let bytes: u64 = self.tx_pending[..n].iter().map(|d| u64::from(d.len)).sum();
                    self.stats.tx_packets.fetch_add(n as u64, Ordering::Relaxed);
                    self.stats.tx_bytes.fetch_add(bytes, Ordering::Relaxed);
                    self.tx_pending.drain(..n);
                    work = true;
                }
                if self.sock.mode() == BindMode::Copy || self.sock.tx.needs_wakeup() {
                    self.stats.kicks.fetch_add(1, Ordering::Relaxed);
                    syscall::kick(self.sock.raw_fd()).map_err(|e| format!("TX kick: {e}"))?;
                }
            }
            comp.clear();
            if self
                .sock
                .comp
                .consume(self.sock.comp.size() as usize, &mut comp)
                > 0
            {
                // A closed channel means the API side is gone; the stop flag ends us next.
                let _ = self.free_out.send(std::mem::take(&mut comp));
                comp.reserve(self.sock.comp.size() as usize);
                work = true;
            }
            // RX: parse in place, lend the datagrams out in one batch.
            descs.clear();
            if self.sock.rx.consume(self.batch, &mut descs) > 0 {
                work = true;
                let mut out = Vec::with_capacity(descs.len());
                for d in &descs {
                    let base = self.sock.umem.frame_base(d.addr);
                    let parsed = self.sock.umem.get(d.addr, d.len as usize).map(frame::parse);
                    match parsed {
                        Some(Ok(f)) if f.dst.port() == self.port => {
                            // The datagram's position in the UMEM, from its slice.
                            let off = f.datagram.as_ptr() as usize
                                - self
                                    .sock
                                    .umem
                                    .get(d.addr, 0)
                                    .map_or(0, |s| s.as_ptr() as usize);
                            out.push(RxItem {
                                queue: self.sock.queue() as u16,
                                frame: base,
                                addr: d.addr + off as u64,
                                len: f.datagram.len() as u32,
                                src: f.src,
                                tos: (f.dscp << 2) | f.ecn.bits(),
                            });
                        }
                        _ => {
                            self.stats.rx_malformed.fetch_add(1, Ordering::Relaxed);
                            self.refill.push(base);
                        }
                    }
                }
                let bytes: u64 = out.iter().map(|i| u64::from(i.len)).sum();
                self.stats
                    .rx_packets
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                self.stats.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
                if !out.is_empty() && self.rx_out.send(out).is_err() {
                    return Ok(());
                }
            }
            if !self.refill.is_empty() {
                if !self.sock.refill(&mut self.refill) {
                    self.stats.fill_empty.fetch_add(1, Ordering::Relaxed);
                }
                if self.sock.fill.needs_wakeup() {
                    let _ = syscall::recv_kick(self.sock.raw_fd());
                }
            }
            if last_kernel.elapsed() > Duration::from_millis(100) {
                if let (Ok(k), Ok(mut slot)) = (self.sock.kernel_stats(), self.stats.kernel.lock())
                {
                    *slot = k;
                }
                last_kernel = Instant::now();
            }
            if work {
                continue;
            }
            match self.poll {
                PollMode::BusyPoll => {
                    let _ = syscall::recv_kick(self.sock.raw_fd());
                    std::hint::spin_loop();
                }
                PollMode::WakeOnDemand { spin } => {
                    let mut ready = false;
                    for _ in 0..spin {
                        if self.sock.rx.available() > 0 || !self.cmd.is_empty() {
                            ready = true;
                            break;
                        }
                        std::hint::spin_loop();
                    }
                    if !ready {
                        self.stats.sleeps.fetch_add(1, Ordering::Relaxed);
                        let fds = [self.sock.raw_fd(), self.wake.as_fd().as_raw_fd()];
                        // Bounded so the stop flag is seen even without a wakeup.
                        syscall::poll_many(&fds, 100).map_err(|e| format!("poll: {e}"))?;
                        // Clear a pending wakeup; nothing pending is fine (non-blocking).
                        let _ = self.wake.read();
                    }
                }
            }
        }
        Ok(())
    }
}

impl Engine {
    /// Attach the classifier, bind one socket per queue, start one pinned worker per queue.
    pub fn start(cfg: EngineConfig) -> Result<Engine, AfXdpError> {
        let EngineConfig { afxdp: cfg, cores } = cfg;
        let sc = cfg.socket.clone();
        if cfg.queues.is_empty() {
            return Err(AfXdpError::Config("at least one queue is needed".into()));
        }
        if !cores.is_empty() && cores.len() != cfg.queues.len() {
            return Err(AfXdpError::Config(format!(
                "{} cores given for {} queues: give one core per queue, or none",
                cores.len(),
                cfg.queues.len()
            )));
        }
        if let Some(c) = cores.iter().find(|&&c| c >= online_cores()) {
            return Err(AfXdpError::Config(format!(
                "core {c} does not exist on this machine"
            )));
        }
        let attached = cfg.attach()?;
        let (rx_tx, rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let failure = Arc::new(Mutex::new(None));
        let mut workers = Vec::new();
        for (i, &q) in cfg.queues.iter().enumerate() {
            let sock = cfg.bind_queue(&attached, q)?;
            let (refill, pool) = sock.initial_frames();
            let (cmd_tx, cmd_rx) = bounded(1024);
            let (free_tx_tx, free_tx_rx) = unbounded();
            let wake = Arc::new(
                EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).map_err(
                    |e| AfXdpError::Socket {
                        ifname: cfg.ifname.clone(),
                        queue: q,
                        source: SocketError {
                            op: "eventfd for the worker's wakeups".into(),
                            source: e.into(),
                        },
                    },
                )?,
            );
            let stats = Arc::new(WorkerStats::default());
            let handle = WorkerHandle {
                queue: q,
                core: cores.get(i).copied(),
                mode: sock.mode(),
                hugepages: sock.hugepages(),
                umem: sock.umem.share(),
                frame_size: sc.frame_size,
                cmd: cmd_tx,
                free_tx: free_tx_rx,
                wake: Arc::clone(&wake),
                stats: Arc::clone(&stats),
                thread: None,
                pool,
            };
            let worker = Worker {
                sock,
                poll: cfg.poll,
                batch: cfg.batch,
                port: cfg.local.port(),
                cmd: cmd_rx,
                rx_out: rx_tx.clone(),
                free_out: free_tx_tx,
                wake,
                stop: Arc::clone(&stop),
                stats,
                refill,
                tx_pending: Vec::new(),
            };
            let core = cores.get(i).copied();
            let fail = Arc::clone(&failure);
            let thread = std::thread::Builder::new()
                .name(format!("gradwire-q{q}"))
                .spawn(move || {
                    if let Some(c) = core {
                        if !pin(c) {
                            *fail.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("cannot pin worker of queue {q} to core {c}"));
                            return;
                        }
                    }
                    if let Err(e) = worker.run() {
                        *fail.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(format!("worker of queue {q}: {e}"));
                    }
                })
                .map_err(|source| AfXdpError::Socket {
                    ifname: cfg.ifname.clone(),
                    queue: q,
                    source: SocketError {
                        op: "spawning the worker thread".into(),
                        source,
                    },
                })?;
            workers.push(WorkerHandle {
                thread: Some(thread),
                ..handle
            });
        }
        let neigh_map = neigh::Neighbors::new(&cfg.neighbors);
        let super::Attached { xdp, src_mac, .. } = attached;
        Ok(Engine {
            cfg,
            workers,
            rx,
            pending: std::collections::VecDeque::new(),
            stop,
            failure,
            xdp,
            admitted: super::PeerAdmissions::default(),
            src_mac,
            neigh: neigh_map,
            ident: 0,
            tx_next: 0,
            tx_ring_full: 0,
            stats: DatapathStats::default(),
        })
    }

    fn check_failure(&self) -> Result<(), DatapathError> {
        match self.failure.lock().ok().and_then(|g| g.clone()) {
            Some(msg) => Err(DatapathError::Io {
                op: "AF_XDP engine",
                source: std::io::Error::other(msg),
            }),
            None => Ok(()),
        }
    }

    /// Per-queue and classifier counters.
    pub fn afxdp_stats(&self) -> AfXdpStats {
        AfXdpStats {
            ifname: self.cfg.ifname.clone(),
            xdp_mode: self.xdp.attach_mode(),
            queues: self
                .workers
                .iter()
                .map(|w| {
                    let s = &w.stats;
                    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
                    QueueStats {
                        queue: w.queue,
                        core: w.core,
                        mode: Some(w.mode),
                        hugepages: w.hugepages,
                        rx_packets: l(&s.rx_packets),
                        rx_bytes: l(&s.rx_bytes),
                        rx_malformed: l(&s.rx_malformed),
                        tx_packets: l(&s.tx_packets),
                        tx_bytes: l(&s.tx_bytes),
                        tx_ring_full: 0,
                        fill_empty: l(&s.fill_empty),
                        sleeps: l(&s.sleeps),
                        kicks: l(&s.kicks),
                        kernel: s.kernel.lock().map(|k| *k).unwrap_or_default(),
                    }
                })
                .collect(),
            xdp: self.xdp.counters().ok(),
        }
    }

    /// Hand received frames back to their workers for the FILL ring.
    fn give_back(&mut self, frames: &mut [Vec<u64>]) {
        for (w, f) in self.workers.iter().zip(frames.iter_mut()) {
            if !f.is_empty() {
                // The worker may be gone (failure); then the frames are simply not reused.
                let _ = w.cmd.send(Cmd::Refill(std::mem::take(f)));
                let _ = w.wake.write(1);
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for w in &mut self.workers {
            let _ = w.wake.write(1);
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        // Sockets closed with their workers; the classifier detaches when `xdp` drops.
    }
}

impl Datapath for Engine {
    fn name(&self) -> &'static str {
        "afxdp"
    }

    fn local_addr(&self) -> SocketAddr {
        self.cfg.local
    }

    fn max_datagram(&self) -> usize {
        // See AfXdpDatapath::max_datagram: room behind the kernel's RX headroom.
        (self.cfg.socket.frame_size as usize)
            .saturating_sub(super::RX_HEADROOM + frame::header_len(self.cfg.local.is_ipv6()))
            .min(65_507)
    }

    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        self.check_failure()?;
        let nw = self.workers.len();
        let qi = self.tx_next % nw;
        self.tx_next = self.tx_next.wrapping_add(1);
        let hdr = frame::header_len(self.cfg.local.is_ipv6());
        let max_dgram = self.max_datagram();
        {
            let w = &mut self.workers[qi];
            while let Ok(f) = w.free_tx.try_recv() {
                w.pool.extend(f);
            }
            if w.pool.is_empty() {
                // Everything is in flight: wait briefly for completions.
                if let Ok(f) = w.free_tx.recv_timeout(Duration::from_millis(1)) {
                    w.pool.extend(f);
                }
            }
        }
        let limit = max.min(self.cfg.batch).min(self.workers[qi].pool.len());
        if limit == 0 {
            self.tx_ring_full += 1;
            return Ok(0);
        }
        let mut descs = Vec::with_capacity(limit);
        let mut result = Ok(());
        let mut filled = 0;
        while filled < limit {
            let Some(addr) = self.workers[qi].pool.pop() else {
                break;
            };
            let fs = self.workers[qi].frame_size as usize;
            // SAFETY: `addr` came from this worker's free-frame channel or pool: the kernel has
            // completed it and the worker no longer touches it, so the API thread owns it
            // exclusively until it is sent back in a Transmit command.
            let Some(buf) = (unsafe { self.workers[qi].umem.get_mut(addr, fs) }) else {
                self.workers[qi].pool.push(addr);
                break;
            };
            let Some(dgram) = buf.get_mut(hdr..hdr + max_dgram) else {
                self.workers[qi].pool.push(addr);
                break;
            };
            let Some((len, meta)) = fill(dgram) else {
                self.workers[qi].pool.push(addr);
                break;
            };
            filled += 1;
            let dst_mac = match self.neigh.mac(meta.dst.ip()) {
                Ok(m) => m,
                Err(e) => {
                    self.workers[qi].pool.push(addr);
                    result = Err(e);
                    break;
                }
            };
            self.ident = self.ident.wrapping_add(1);
            let fm = self
                .cfg
                .frame_meta(self.src_mac, dst_mac, &meta, self.ident);
            // SAFETY: as above; the frame is still exclusively ours.
            let Some(buf) = (unsafe { self.workers[qi].umem.get_mut(addr, fs) }) else {
                self.workers[qi].pool.push(addr);
                break;
            };
            match frame::emit_headers(buf, &fm, len.min(max_dgram)) {
                Ok(total) => {
                    descs.push(libc::xdp_desc {
                        addr,
                        len: total as u32,
                        options: 0,
                    });
                    self.stats.tx_packets += 1;
                    self.stats.tx_bytes += total as u64;
                }
                Err(_) => {
                    self.workers[qi].pool.push(addr);
                    self.stats.tx_dropped += 1;
                }
            }
        }
        if !descs.is_empty() {
            let w = &self.workers[qi];
            w.cmd
                .send(Cmd::Transmit(descs))
                .map_err(|_| DatapathError::Closed)?;
            let _ = w.wake.write(1);
        }
        result.map(|()| filled)
    }

    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        self.check_failure()?;
        if self.pending.is_empty() {
            match self.rx.recv_timeout(timeout) {
                Ok(b) => self.pending.extend(b),
                Err(RecvTimeoutError::Timeout) => return Ok(0),
                Err(RecvTimeoutError::Disconnected) => return Err(DatapathError::Closed),
            }
        }
        while self.pending.len() < max {
            match self.rx.try_recv() {
                Ok(b) => self.pending.extend(b),
                Err(_) => break,
            }
        }
        let mut back: Vec<Vec<u64>> = vec![Vec::new(); self.workers.len()];
        let mut n = 0;
        while n < max {
            let Some(item) = self.pending.pop_front() else {
                break;
            };
            let Some(w) = self
                .workers
                .iter()
                .position(|w| w.queue == u32::from(item.queue))
            else {
                continue;
            };
            // SAFETY: the worker lent this frame in an RxItem and will not touch it (or hand it
            // to the kernel) until we return it with Refill below.
            if let Some(d) = unsafe { self.workers[w].umem.get(item.addr, item.len as usize) } {
                deliver(
                    &RxMeta {
                        src: item.src,
                        tos: item.tos,
                    },
                    d,
                );
                self.stats.rx_packets += 1;
                self.stats.rx_bytes += u64::from(item.len);
                n += 1;
            }
            back[w].push(item.frame);
        }
        self.give_back(&mut back);
        Ok(n)
    }

    fn stats(&self) -> DatapathStats {
        self.stats
    }

    fn backend_stats(&self) -> Option<crate::datapath::BackendStats> {
        Some(Box::new(Engine::afxdp_stats(self)))
    }

    fn data_sources(&self) -> Vec<crate::datapath::DataSource> {
        self.cfg.data_sources()
    }

    fn admit_peers(&mut self, peers: &[crate::datapath::DataSource]) -> Result<(), DatapathError> {
        self.admitted.admit(&self.cfg, &self.xdp, peers)
    }

    fn release_peers(
        &mut self,
        peers: &[crate::datapath::DataSource],
    ) -> Result<(), DatapathError> {
        self.admitted.release(&self.cfg, &self.xdp, peers)
    }
}
