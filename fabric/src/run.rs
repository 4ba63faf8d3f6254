//! The fabric process: every switch of a topology in one event loop on one thread.
//!
//! Each switch port is a [`RawPort`] (an AF_XDP socket plus the classifier in switch-port
//! mode) created inside its switch's namespace; sockets keep their namespace, so one thread
//! serves them all. One loop iteration: read every port's RX ring (timestamp = now), forward
//! ([`Forwarder`]) and enqueue into the egress port's [`EgressPort`] at that time; then send
//! every departure whose delivery time has come; then sleep in `ppoll()` on all sockets until
//! the next scheduled departure or rate change, or a packet arrives (wake-on-demand; nothing
//! spins). A link with a rate schedule ([`crate::schedule`]) changes rate at each step's time on
//! the fabric's clock (since [`Fabric::open`]), both of its ports at once; the stats show each
//! port's rate in force.
//!
//! Queueing is decided on the emulated clock, so a slow iteration delays *when* a frame is
//! put on the wire but not the order, marks or drops. How late frames go out is measured per
//! departure (lag = send time - scheduled delivery time, [`crate::lag`]); when more than
//! [`FabricConfig::max_late_fraction`] of departures are later than
//! [`FabricConfig::max_lag_ns`], the stats say `behind: true` and the run must not be used as
//! a result. The stats ([`FabricStats`], [`crate::stats`]) are published to a file every
//! [`FabricConfig::stats_interval`] when [`FabricConfig::stats_path`] is set.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gradwire::afxdp::port::RawPort;
use gradwire::afxdp::{AfXdpError, SocketConfig};
use gradwire_ebpf::AttachMode;
use gradwire_netns::with_netns;
use nix::poll::{PollFd, PollFlags};

use crate::forward::{Forwarder, Pkt, PortMacs};
use crate::lag::LagHist;
use crate::sched::{ConfigError, EgressPort, PortConfig, NUM_QUEUES};
use crate::schedule::RateSchedule;
use crate::stats::StatsPublisher;
pub use crate::stats::{FabricStats, LagStats, PortStats, SwitchStats};
use crate::topology::{Ecmp, Peer, Thresholds, Topology};

/// Fabric settings that are not part of the topology.
#[derive(Debug, Clone)]
pub struct FabricConfig {
    /// XDP attach mode of the switch ports (generic is faster than native on veth, which
    /// copies every frame into a page-pool page first).
    pub xdp_mode: AttachMode,
    /// UMEM and rings of each port.
    pub socket: SocketConfig,
    /// Frames read per port per iteration.
    pub batch: usize,
    /// A departure later than this is late.
    pub max_lag_ns: u64,
    /// More late departures than this fraction: the run fell behind.
    pub max_late_fraction: f64,
    /// Where to publish the stats as JSON (atomically replaced), if anywhere.
    pub stats_path: Option<PathBuf>,
    /// How often stats are published.
    pub stats_interval: Duration,
    /// Seed of the link-loss generators (each port derives its own).
    pub seed: u64,
    /// Run the loop's thread under `SCHED_FIFO` at this priority (1..=99), `None` for normal
    /// scheduling. The fabric is the network: it must keep its clock while the hosts'
    /// processes compete for the same cores. Under the default CFS scheduling, a fabric that
    /// wakes for every departure waits behind busy training processes (measured on wan9 with
    /// 9 TCP flows on this loaded 2-core machine: 7 % of departures over 1 ms late, with
    /// `nice -10` 6 %, under `SCHED_FIFO` 0.2 %). It only runs when a frame or a departure is
    /// due, so it takes a core only when the emulated network needs one. If the priority cannot
    /// be set, the fabric says so on stderr once and runs normally.
    pub realtime_priority: Option<i32>,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            xdp_mode: AttachMode::Generic,
            // 8 MiB of UMEM per port: 2048 frames on FILL absorb a 2048-frame burst while the
            // loop sleeps.
            socket: SocketConfig {
                frames: 4096,
                frame_size: 2048,
                ring_size: 2048,
                hugepages: false,
                zero_copy: false,
                busy_poll: None,
            },
            batch: 64,
            max_lag_ns: 1_000_000,
            max_late_fraction: 0.01,
            stats_path: None,
            stats_interval: Duration::from_millis(200),
            seed: 1,
            realtime_priority: Some(10),
        }
    }
}

/// Why the fabric could not start.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// Entering a switch namespace.
    #[error("switch {switch}: {source}")]
    Netns {
        /// Switch.
        switch: String,
        /// Why (names the namespace).
        source: gradwire_netns::NetnsError,
    },
    /// Opening a port.
    #[error("switch {switch}: {source}")]
    Port {
        /// Switch.
        switch: String,
        /// Why.
        source: AfXdpError,
    },
    /// A port's queue configuration.
    #[error("switch {switch} port {port}: {source}")]
    Config {
        /// Switch.
        switch: String,
        /// Port.
        port: String,
        /// Why.
        source: ConfigError,
    },
    /// Wrong number of namespaces for the topology.
    #[error("{0}")]
    Mismatch(String),
    /// The fabric thread could not be started or died during setup.
    #[error("fabric thread: {0}")]
    Thread(String),
}

struct PortRt {
    raw: RawPort,
    egress: EgressPort<Pkt>,
    peer: String,
    /// The link's rate over time, if it changes.
    schedule: Option<RateSchedule>,
    /// When the schedule says something next (fabric ns).
    next_change: Option<u64>,
}

impl PortRt {
    /// Applies every scheduled rate change due by `now`, each at its own time.
    fn apply_schedule(&mut self, now: u64) {
        let Some(s) = &self.schedule else { return };
        while let Some(at) = self.next_change.filter(|&at| at <= now) {
            // Rates in a schedule are checked above 0 when the topology is read.
            let _ = self.egress.set_rate(at, s.rate_at(at));
            self.next_change = s.next_change_after(at);
        }
    }
}

struct SwitchRt {
    name: String,
    ecmp: Ecmp,
    fwd: Forwarder,
    ports: Vec<PortRt>,
}

/// The running fabric (not `Send`: its sockets and XDP programs stay on the thread that
/// opened them; use [`spawn`] for a background fabric).
pub struct Fabric {
    topology: String,
    switches: Vec<SwitchRt>,
    pool: Vec<Vec<u8>>,
    scratch: Vec<(usize, Vec<u8>)>,
    cfg: FabricConfig,
    start: Instant,
    lag: LagHist,
    iterations: u64,
    sleeps: u64,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

impl Fabric {
    /// Opens every port of every switch of `topo`; `switch_ns[i]` is switch i's namespace.
    pub fn open(
        topo: &Topology,
        switch_ns: &[String],
        cfg: FabricConfig,
    ) -> Result<Fabric, FabricError> {
        if switch_ns.len() != topo.switches.len() {
            return Err(FabricError::Mismatch(format!(
                "{} switch namespaces for {} switches",
                switch_ns.len(),
                topo.switches.len()
            )));
        }
        // Departure times are scheduled to the microsecond; the default 50 us timer slack
        // would make every sleep that much late.
        let _ = nix::sys::prctl::set_timerslack(1_000);
        let mut thresholds = [None; NUM_QUEUES];
        for (q, t) in topo
            .qos
            .thresholds_bytes
            .iter()
            .take(NUM_QUEUES)
            .enumerate()
        {
            thresholds[q] = *t;
        }
        let mut switches = Vec::with_capacity(topo.switches.len());
        for (si, s) in topo.switches.iter().enumerate() {
            let netns = &switch_ns[si];
            let mut ports = Vec::with_capacity(s.ports.len());
            for (pi, p) in s.ports.iter().enumerate() {
                // Sockets keep the namespace they were created in: one thread serves them all.
                let raw = with_netns(netns, || {
                    RawPort::open(&p.ifname, cfg.xdp_mode, &cfg.socket)
                })
                .map_err(|source| FabricError::Netns {
                    switch: s.name.clone(),
                    source,
                })?
                .map_err(|source| FabricError::Port {
                    switch: s.name.clone(),
                    source,
                })?;
                let pc = PortConfig {
                    rate_bps: p.link.rate_bps,
                    delay_ns: p.link.delay_ns,
                    buffer_bytes: p.link.buffer_bytes,
                    thresholds: match p.link.thresholds {
                        Thresholds::Policy => thresholds,
                        Thresholds::Off => [None; NUM_QUEUES],
                    },
                    loss: p.link.loss,
                    seed: cfg
                        .seed
                        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                        .wrapping_add((si * 1000 + pi) as u64),
                    ..PortConfig::default()
                };
                let egress = EgressPort::new(pc).map_err(|source| FabricError::Config {
                    switch: s.name.clone(),
                    port: p.ifname.clone(),
                    source,
                })?;
                let peer = match p.peer {
                    Peer::Host(h) => format!("host {}", topo.hosts[h].name),
                    Peer::Switch(t, tp) => format!(
                        "switch {} {}",
                        topo.switches[t].name, topo.switches[t].ports[tp].ifname
                    ),
                };
                let schedule = p.link.schedule.clone();
                let next_change = schedule.as_ref().and_then(|s| s.next_change_after(0));
                ports.push(PortRt {
                    raw,
                    egress,
                    peer,
                    schedule,
                    next_change,
                });
            }
            let macs = s
                .ports
                .iter()
                .map(|p| PortMacs {
                    own: p.mac,
                    peer: p.peer_mac,
                })
                .collect();
            let fwd = Forwarder::new(
                s.routes.clone(),
                macs,
                &topo.qos.dscp_to_queue,
                s.ecmp,
                cfg.seed.wrapping_add(si as u64),
            );
            switches.push(SwitchRt {
                name: s.name.clone(),
                ecmp: s.ecmp,
                fwd,
                ports,
            });
        }
        Ok(Fabric {
            topology: topo.name.clone(),
            switches,
            pool: Vec::new(),
            scratch: Vec::new(),
            cfg,
            start: Instant::now(),
            lag: LagHist::default(),
            iterations: 0,
            sleeps: 0,
        })
    }

    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// One iteration without sleeping: receive, forward, enqueue, send what is due. Returns
    /// the number of frames received.
    pub fn step(&mut self) -> usize {
        self.iterations += 1;
        let now = self.now_ns();
        let batch = self.cfg.batch;
        let mut received = 0;
        // Rate changes first: frames read now are queued behind the rate in force now.
        for port in self.switches.iter_mut().flat_map(|s| &mut s.ports) {
            port.apply_schedule(now);
        }
        for sw in &mut self.switches {
            let (pool, scratch) = (&mut self.pool, &mut self.scratch);
            for (pi, port) in sw.ports.iter_mut().enumerate() {
                received += port.raw.recv(batch, |frame| {
                    let mut buf = pool.pop().unwrap_or_default();
                    buf.clear();
                    buf.extend_from_slice(frame);
                    scratch.push((pi, buf));
                });
            }
            for (_, mut buf) in scratch.drain(..) {
                match sw.fwd.forward(&mut buf) {
                    Ok((eg, meta)) => match sw.ports.get_mut(eg) {
                        Some(port) => {
                            let (_, back) = port.egress.enqueue(now, meta, Pkt { data: buf });
                            if let Some(b) = back {
                                pool.push(b.data);
                            }
                        }
                        None => pool.push(buf),
                    },
                    Err(_) => pool.push(buf),
                }
            }
        }
        let now = self.now_ns();
        for sw in &mut self.switches {
            for port in &mut sw.ports {
                let mut sent = false;
                while let Some(d) = port.egress.poll(now) {
                    self.lag
                        .add(now.saturating_sub(d.deliver_ns), self.cfg.max_lag_ns);
                    if !d.lost {
                        // A refused frame (TX ring full) is counted by the port.
                        sent |= port.raw.send(&d.pkt.data);
                    }
                    self.pool.push(d.pkt.data);
                }
                if sent || port.raw.tx_pending() > 0 {
                    // Errors here are transient (ENOBUFS and the like are absorbed by kick).
                    let _ = port.raw.flush();
                }
            }
        }
        received
    }

    /// Earliest scheduled event in any port (a departure or a rate change), in fabric
    /// nanoseconds.
    fn next_event(&self) -> Option<u64> {
        self.switches
            .iter()
            .flat_map(|s| &s.ports)
            .flat_map(|p| [p.egress.next_event_ns(), p.next_change])
            .flatten()
            .min()
    }

    /// Sleeps until a frame arrives or `until_ns` (fabric time), at most `cap`.
    fn wait(&mut self, until_ns: Option<u64>, cap: Duration) {
        let now = self.now_ns();
        let timeout = match until_ns {
            Some(t) if t <= now => return,
            Some(t) => Duration::from_nanos(t - now).min(cap),
            None => cap,
        };
        self.sleeps += 1;
        let mut fds: Vec<PollFd<'_>> = self
            .switches
            .iter()
            .flat_map(|s| &s.ports)
            .map(|p| PollFd::new(p.raw.fd(), PollFlags::POLLIN))
            .collect();
        let ts = nix::sys::time::TimeSpec::from_duration(timeout);
        // EINTR and the like: the loop simply goes round again.
        let _ = nix::poll::ppoll(&mut fds, Some(ts), None);
    }

    /// Runs until `stop` is set, calling `publish` with fresh stats every
    /// [`FabricConfig::stats_interval`] and once at the end.
    pub fn run(&mut self, stop: &AtomicBool, mut publish: impl FnMut(&FabricStats)) {
        if let Some(prio) = self.cfg.realtime_priority {
            if let Err(e) = set_realtime(prio) {
                eprintln!(
                    "gradwire fabric: cannot run the switches at real-time priority {prio} \
                     ({e}); they may fall behind their clock when the hosts keep the cores busy"
                );
            }
        }
        let mut next_publish = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let got = self.step();
            if Instant::now() >= next_publish {
                publish(&self.stats(true));
                next_publish = Instant::now() + self.cfg.stats_interval;
            }
            if got == 0 {
                let until = self.next_event();
                // Wake up now and then to notice `stop` and publish stats.
                self.wait(until, Duration::from_millis(20));
            }
        }
        publish(&self.stats(false));
    }

    /// A snapshot of every counter.
    pub fn stats(&self, running: bool) -> FabricStats {
        FabricStats {
            topology: self.topology.clone(),
            running,
            uptime_s: self.start.elapsed().as_secs_f64(),
            updated_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            lag: self
                .lag
                .stats(self.cfg.max_lag_ns, self.cfg.max_late_fraction),
            iterations: self.iterations,
            sleeps: self.sleeps,
            loop_cpu_s: thread_cpu_s(),
            switches: self
                .switches
                .iter()
                .map(|s| SwitchStats {
                    name: s.name.clone(),
                    ecmp: s.ecmp,
                    forward: s.fwd.counters(),
                    ports: s
                        .ports
                        .iter()
                        .map(|p| {
                            let c = p.egress.config();
                            let mut depth = [0u64; NUM_QUEUES];
                            for (q, d) in depth.iter_mut().enumerate() {
                                *d = p.egress.depth_bytes(q as u8);
                            }
                            PortStats {
                                ifname: p.raw.ifname().to_owned(),
                                peer: p.peer.clone(),
                                rate_bps: c.rate_bps,
                                delay_ns: c.delay_ns,
                                loss: c.loss,
                                egress: p.egress.counters().clone(),
                                depth_bytes: depth,
                                socket: p.raw.stats(),
                                kernel: p.raw.kernel_stats().unwrap_or_default(),
                            }
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Puts the calling thread (only it: Linux schedules threads) under `SCHED_FIFO` at `priority`.
fn set_realtime(priority: i32) -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: FFI call with no memory handed over: the kernel reads `param`, a valid
    // initialised struct on this stack, during the call, and changes only the scheduling of
    // the calling thread (pid 0).
    #[allow(unsafe_code)]
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// CPU time of the calling thread (the loop calls [`Fabric::stats`] itself).
fn thread_cpu_s() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 * 1e-6;
        t(u.user_time()) + t(u.system_time())
    })
}

/// A fabric running on its own thread.
#[derive(Debug)]
pub struct FabricHandle {
    stop: Arc<AtomicBool>,
    latest: Arc<Mutex<Option<FabricStats>>>,
    thread: Option<JoinHandle<()>>,
}

/// Starts the fabric for `topo` on a new thread; returns once every port is open (or the
/// first error).
pub fn spawn(
    topo: &Topology,
    switch_ns: &[String],
    cfg: FabricConfig,
) -> Result<FabricHandle, FabricError> {
    let stop = Arc::new(AtomicBool::new(false));
    let latest: Arc<Mutex<Option<FabricStats>>> = Arc::new(Mutex::new(None));
    let (tx, rx) = mpsc::sync_channel::<Result<(), FabricError>>(1);
    let (t, ns) = (topo.clone(), switch_ns.to_vec());
    let (stop2, latest2) = (Arc::clone(&stop), Arc::clone(&latest));
    let thread = std::thread::Builder::new()
        .name(format!("fabric {}", topo.name))
        .spawn(move || {
            let path = cfg.stats_path.clone();
            let mut fabric = match Fabric::open(&t, &ns, cfg) {
                Ok(f) => {
                    let _ = tx.send(Ok(()));
                    f
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut publisher = path.map(StatsPublisher::new);
            fabric.run(&stop2, |s| {
                if let Some(p) = &mut publisher {
                    p.publish(s);
                }
                if let Ok(mut l) = latest2.lock() {
                    *l = Some(s.clone());
                }
            });
        })
        .map_err(|e| FabricError::Thread(e.to_string()))?;
    match rx.recv() {
        Ok(Ok(())) => Ok(FabricHandle {
            stop,
            latest,
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(FabricError::Thread("died during setup".into()))
        }
    }
}

impl FabricHandle {
    /// The latest published stats (at most one stats interval old).
    pub fn stats(&self) -> Option<FabricStats> {
        self.latest.lock().ok().and_then(|l| l.clone())
    }

    /// Waits until nothing is queued or in flight in the fabric (as of a published
    /// snapshot), at most `timeout`; returns whether it got there.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut last_departures = None;
        loop {
            if let Some(s) = self.stats() {
                // Idle and two snapshots agree: nothing moved in between.
                if s.in_fabric() == 0 && last_departures == Some(s.lag.departures) {
                    return true;
                }
                last_departures = Some(s.lag.departures);
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Stops the fabric and returns its final stats (ports closed, programs detached).
    pub fn stop(mut self) -> Option<FabricStats> {
        self.halt();
        self.stats()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FabricHandle {
    fn drop(&mut self) {
        self.halt();
    }
}
