//! Shared by the AF_XDP tests and the `xdp_io_bench` example: endpoints of two ranks in the
//! two namespaces of a testbed (each on an AF_XDP or a kernel UDP socket), a watchdog, and
//! one small operation that moves a message each way.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire_msg::core::{RecvOpts, RecvReport, SendOpts};
use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
use gradwire_msg::io::udp::{UdpConfig, UdpIo};
use gradwire_msg::io::xdp::{XdpIo, XdpIoConfig, XdpMonitor};
use gradwire_msg::io::DatagramIo;
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};
use gradwire_netns::{Testbed, HOST_IFNAME};

/// The socket under an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`XdpIo`] on the host's veth, queue 0.
    Xdp,
    /// [`UdpIo`] with GSO/GRO.
    Udp,
}

/// An AF_XDP socket's settings for host address `ip`: the testbed's interface, no huge pages
/// (the test machines have none reserved).
pub fn xdp_config(ip: IpAddr, port: u16) -> XdpIoConfig {
    let mut c = XdpIoConfig::new(HOST_IFNAME, SocketAddr::new(ip, port));
    c.socket.hugepages = false;
    c
}

// Lives for a moment, moved once per rank.
#[allow(clippy::large_enum_variant)]
enum Opened {
    Xdp(XdpIo),
    Udp(UdpIo),
}

impl Opened {
    fn local_addr(&self) -> SocketAddr {
        match self {
            Opened::Xdp(x) => x.local_addr(),
            Opened::Udp(u) => u.local_addr(),
        }
    }
}

/// Started endpoints, by rank, with the monitors of their AF_XDP sockets.
pub struct Ranks {
    pub eps: Vec<Endpoint>,
    pub monitors: Vec<Option<XdpMonitor>>,
    pub addrs: Vec<SocketAddr>,
}

/// Starts rank `i` of `kinds.len()` on host `i` of `tb` (job 7), its socket on `port`
/// (0: any), every endpoint's configuration passed through `tweak` first. Each socket is
/// opened, given its peers and started inside its host's namespace, so the progress threads
/// live there (they resolve neighbours in it).
pub fn start(tb: &Testbed, kinds: &[Kind], port: u16, tweak: fn(&mut EndpointConfig)) -> Ranks {
    start_with(
        tb,
        kinds,
        port,
        move |c: &mut EndpointConfig| tweak(c),
        |_| {},
    )
}

/// [`start`], every AF_XDP socket's configuration passed through `xdp` first.
pub fn start_with(
    tb: &Testbed,
    kinds: &[Kind],
    port: u16,
    tweak: impl Fn(&mut EndpointConfig) + Clone + Send + 'static,
    xdp: impl Fn(&mut XdpIoConfig) + Clone + Send + 'static,
) -> Ranks {
    let world = u16::try_from(kinds.len()).unwrap();
    let mut opened = Vec::new();
    for (i, &kind) in kinds.iter().enumerate() {
        let ip = IpAddr::V4(tb.host(i).ipv4);
        let xdp = xdp.clone();
        let o = tb
            .run_in(i, move || match kind {
                Kind::Xdp => {
                    let mut c = xdp_config(ip, port);
                    xdp(&mut c);
                    Opened::Xdp(XdpIo::open(&c).expect("XdpIo"))
                }
                Kind::Udp => Opened::Udp(
                    UdpIo::bind(SocketAddr::new(ip, port), &UdpConfig::default()).expect("UdpIo"),
                ),
            })
            .unwrap();
        opened.push(o);
    }
    let addrs: Vec<SocketAddr> = opened.iter().map(Opened::local_addr).collect();
    let mut eps = Vec::new();
    let mut monitors = Vec::new();
    for (i, o) in opened.into_iter().enumerate() {
        let peers = addrs.clone();
        let rank = u16::try_from(i).unwrap();
        let tweak = tweak.clone();
        let (ep, mon) = tb
            .run_in(i, move || {
                let (io, mon): (Box<dyn DatagramIo>, _) = match o {
                    Opened::Xdp(mut x) => {
                        x.allow_peers(&peers).expect("allow_peers");
                        let m = x.monitor();
                        (Box::new(x), Some(m))
                    }
                    Opened::Udp(u) => (Box::new(u), None),
                };
                let mut cfg = EndpointConfig::new(7, rank, world, peers[usize::from(rank)]);
                tweak(&mut cfg);
                let ep = Endpoint::with_io(cfg, io)
                    .expect("bind")
                    .start(peers)
                    .expect("start");
                (ep, mon)
            })
            .unwrap();
        eps.push(ep);
        monitors.push(mon);
    }
    Ranks {
        eps,
        monitors,
        addrs,
    }
}

/// `len` bytes that differ per `seed` and per position.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// One message to `peer` and one from it, of the same length: posted together (`send_first`),
/// or the send only once the receive finished (the answering side of a ping-pong).
#[derive(Debug)]
pub struct Swap {
    peer: u16,
    send_first: bool,
    tx: Option<Region>,
    rx: Option<Region>,
    bufs: Option<(BufId, BufId)>,
    sent: bool,
    report: Option<RecvReport>,
}

impl Swap {
    /// Sends `tx` to `peer` and receives into `rx` (same length).
    pub fn new(peer: u16, send_first: bool, tx: Region, rx: Region) -> Swap {
        Swap {
            peer,
            send_first,
            tx: Some(tx),
            rx: Some(rx),
            bufs: None,
            sent: false,
            report: None,
        }
    }

    fn post_send(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let (tb, _) = self
            .bufs
            .ok_or_else(|| OpError::Invalid("not started".into()))?;
        let len = cx.buf(tb).len();
        let msg = cx.reserve_sends(self.peer, 1)?;
        cx.send(self.peer, msg, tb, 0..len, SendOpts::default())
    }
}

impl Op for Swap {
    /// The two regions back (sent, received) and the receive's report.
    type Output = (Region, Region, RecvReport);

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<Self::Output> {
        let (Some(tx), Some(rx)) = (self.tx.take(), self.rx.take()) else {
            return Err(OpError::Invalid("started twice".into()));
        };
        let len = rx.len();
        let tb = cx.register(tx);
        let rb = cx.register(rx);
        self.bufs = Some((tb, rb));
        let msg = cx.reserve_recvs(self.peer, 1)?;
        cx.recv(self.peer, msg, rb, 0..len, RecvOpts::default())?;
        if self.send_first {
            self.post_send(cx)?;
        }
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<Self::Output> {
        match ev {
            OpEvent::Sent { .. } => self.sent = true,
            OpEvent::Received { report, .. } => {
                self.report = Some(report);
                if !self.send_first {
                    self.post_send(cx)?;
                }
            }
        }
        if !self.sent {
            return Ok(None);
        }
        let Some(report) = self.report.take() else {
            return Ok(None);
        };
        let (tb, rb) = self.bufs.take().expect("started");
        let tx = cx.unregister(tb).expect("send buffer");
        let rx = cx.unregister(rb).expect("receive buffer");
        Ok(Some((tx, rx, report)))
    }
}

/// Aborts the process (the namespaces' reaper then removes them; XDP programs and AF_XDP
/// sockets go with the process) if a test is still running after its time bound.
pub struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    /// Arms a watchdog of `bound` for `what`.
    pub fn arm(what: &'static str, bound: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let d = Arc::clone(&done);
        std::thread::spawn(move || {
            let end = Instant::now() + bound;
            while Instant::now() < end {
                if d.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !d.load(Ordering::Relaxed) {
                eprintln!("{what}: still running after {bound:?}: aborting");
                std::process::abort();
            }
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
    }
}
