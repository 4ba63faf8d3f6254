//! `gradwire demo`, `send` and `recv` on the message layer (`gradwire-msg`).
//!
//! Each side is one [`Endpoint`] of a job of two ranks: the receiver is rank 0, the sender
//! rank 1. A tensor is one message under the loss bound, received in place into a buffer
//! allocated once. There is no handshake per tensor: both sides run the same sequence of
//! operations (the sender `count` sends, the receiver `count` receives, in order), so the
//! layer numbers the messages 0, 1, 2, ... on both sides by itself, and a message that
//! arrives before its receive is posted is kept until it is.
//!
//! Between two hosts, one TCP connection sets the run up before any data moves (the
//! endpoint needs its peer's data address before it starts, and the receiver learns the
//! sender's only then): the sender sends one JSON line with the run's parameters and its
//! data address, the receiver checks them against its own, starts its endpoint with that
//! address as its only peer (peer binding; over AF_XDP also the XDP allowlist) and answers
//! with its data address or why it refuses. Then the connection closes and everything else
//! is datagrams of the layer. In the demo both ends live in this process and know each
//! other's address, so there is no set-up at all.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use gradwire::afxdp::AfXdpStats;
use gradwire::afxdp::BusyPoll;
use gradwire::flow::RejectCounts;
use gradwire::tensor::Tensor;
use gradwire_msg::core::{CoreConfig, Ended, RecvOpts, RecvReport, SendOpts};
use gradwire_msg::endpoint::{Bound, Endpoint, EndpointConfig, EndpointStats};
use gradwire_msg::io::xdp::{XdpIo, XdpIoConfig, XdpMonitor};
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Handle, OpError};
use gradwire_msg::p2p::{self, Recv};
use gradwire_netns::{Testbed, TestbedConfig};
use serde::{Deserialize, Serialize};

use crate::args::{Common, DatapathKind, RecvArgs, SendArgs};
use crate::loopio::MemIo;
use crate::report::{Summary, Xfer};
use crate::stats::{EndpointCounters, StatsFile};

type Res<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The receiver's rank.
const RECEIVER: u16 = 0;
/// The sender's rank.
const SENDER: u16 = 1;
/// TOS byte of data segments: DSCP 10 (AF11, the flow transport's CLI tag), ECT(0).
const DATA_TOS: u8 = (10 << 2) | 0b10;
/// The DSCP the AF_XDP classifier's fault injection drops.
const DATA_DSCP: u8 = DATA_TOS >> 2;
/// The demo's pattern seed (every transfer the same tensor, as the flow transport's demo).
const DEMO_SEED: u64 = 0x6772_6164;
/// How long an operation may run at most. A dead or silent peer fails it much earlier (the
/// layer's peer timeout, `--timeout`): this only bounds a peer that keeps making progress.
const BACKSTOP: Duration = Duration::from_secs(24 * 3600);
/// The set-up's protocol name and version (in the first JSON line).
const SETUP_PROTO: &str = "gradwire-p2p";
const SETUP_VERSION: u32 = 1;
/// Longest set-up line.
const SETUP_MAX: u64 = 4096;

/// Checks what the message layer needs of the common options.
fn check(c: &Common) -> Res {
    if !(c.timeout.is_finite() && c.timeout > 0.0 && c.timeout < 86_400.0) {
        return Err(format!(
            "--timeout {} must be a positive number of seconds",
            c.timeout
        )
        .into());
    }
    if !(576..=9000).contains(&c.mtu) {
        return Err(format!(
            "--mtu {} is outside 576..=9000: give the path's IP MTU (1500 on most Ethernet)",
            c.mtu
        )
        .into());
    }
    if c.loss_bound >= 1.0 {
        return Err("--loss-bound 1 would let a transfer end with nothing: give a bound below 1 (0 = reliable)".into());
    }
    if c.size > u64::from(u32::MAX) {
        return Err(format!(
            "--size {} is larger than the 4 GiB one message of the layer holds: send smaller tensors",
            c.size
        )
        .into());
    }
    Ok(())
}

/// Rank `rank`'s endpoint settings; `inject_loss`: the receiving endpoint's own fault
/// injection (over AF_XDP the classifier injects it instead).
fn endpoint_config(c: &Common, rank: u16, bind: SocketAddr, inject_loss: f64) -> EndpointConfig {
    let mut e = EndpointConfig::new(c.job, rank, 2, bind);
    e.mtu = c.mtu;
    e.core.peer_timeout = Duration::from_secs_f64(c.timeout);
    e.inject_loss = inject_loss;
    e.seed = u64::from(c.job);
    e
}

/// Payload bytes per segment, as the endpoint computes it.
fn seg_payload(c: &Common, ipv6: bool) -> usize {
    CoreConfig::seg_payload_for_mtu(c.mtu, ipv6)
}

/// AF_XDP socket settings from the command line; `inject_loss` goes to the classifier.
fn xdp_config(c: &Common, ifname: &str, local: SocketAddr, inject_loss: f64) -> Res<XdpIoConfig> {
    let a = &c.afxdp;
    if a.engine || a.queues.len() > 1 {
        return Err("--engine and several --queues run on the flow transport only (give --transport flow): the message layer's AF_XDP socket is one queue, driven by the endpoint's progress thread".into());
    }
    let mut x = XdpIoConfig::new(ifname, local);
    x.queue = a.queues.first().copied().unwrap_or(0);
    x.xdp_mode = a.xdp_mode;
    x.batch = a.batch;
    x.socket.frame_size = a.frame_size;
    x.socket.ring_size = a.ring_size;
    x.socket.frames = a.ring_size.saturating_mul(2).max(x.socket.frames);
    x.socket.hugepages = !a.no_hugepages;
    x.socket.zero_copy = !a.no_zero_copy;
    if a.busy_poll {
        x.socket.busy_poll = Some(BusyPoll {
            usecs: 50,
            budget: 64,
        });
    }
    x.neighbors = a.neighbors.clone();
    if inject_loss > 0.0 {
        x.fault_drop = vec![(DATA_DSCP, inject_loss)];
    }
    Ok(x)
}

/// Pins the calling thread (and so the progress thread it starts next) to `--cores[i]`.
fn pin(c: &Common, i: usize) -> Res {
    if let Some(&core) = c.afxdp.cores.get(i) {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
            return Err(format!("cannot pin to core {core} (see nproc)").into());
        }
    }
    Ok(())
}

/// What one send did.
#[derive(Debug, Clone)]
struct Sent {
    missing: u32,
    fct: Duration,
    before: EndpointStats,
    after: EndpointStats,
}

/// What one receive got.
#[derive(Debug, Clone)]
struct Got {
    report: RecvReport,
    took: Duration,
    verified: bool,
    delivered_bytes: u64,
    before: EndpointStats,
    after: EndpointStats,
}

fn send_one(ep: &Endpoint, t: &mut Tensor) -> Res<Sent> {
    let before = ep.stats();
    let start = Instant::now();
    let opts = SendOpts {
        tos: DATA_TOS,
        ..SendOpts::default()
    };
    let missing = ep
        .run_borrowed(t.as_bytes_mut(), BACKSTOP, |region| {
            p2p::Send::new(region, RECEIVER, opts)
        })
        .map_err(|e| format!("sending to the receiver (rank {RECEIVER}): {e}"))?
        .missing;
    let fct = start.elapsed();
    Ok(Sent {
        missing,
        fct,
        before,
        after: ep.stats(),
    })
}

/// A receive handle and when it was posted.
type Posted = (Handle<(Option<Region>, RecvReport)>, Instant);

/// Receives `c.count` tensors in order, each into a buffer allocated once, zero-fills what is
/// missing (unless `--keep-missing`) and checks every delivered byte against the pattern
/// `expect(round)` writes. The next receive is posted before a finished one is checked, so a
/// sender that starts its next tensor at once finds it posted (data for a receive not posted
/// yet is only kept, not acknowledged, and would stall the sender on its timers). `done` sees
/// every transfer as it finishes.
fn recv_all(
    c: &Common,
    ep: &Endpoint,
    seg: usize,
    mut expect: impl FnMut(u32, &mut Tensor),
    mut done: impl FnMut(u32, &Got),
) -> Res<Vec<Got>> {
    let size = usize::try_from(c.size).map_err(|_| "--size does not fit this machine's memory")?;
    let opts = RecvOpts {
        loss_bound: c.loss_bound,
        ..RecvOpts::default()
    };
    let post = |buf: Vec<u8>| -> Posted {
        (
            ep.submit(Recv::new(Region::owned(buf), SENDER, opts.clone())),
            Instant::now(),
        )
    };
    let mut want = c.tensor()?;
    let mut pending: std::collections::VecDeque<Posted> =
        (0..c.count.min(2)).map(|_| post(vec![0u8; size])).collect();
    let mut before = ep.stats();
    let mut prev_done = Instant::now();
    let mut gots = Vec::new();
    for round in 0..c.count {
        let Some((h, posted)) = pending.pop_front() else {
            break;
        };
        let (region, report) =
            wait(h).map_err(|e| format!("receiving from the sender (rank {SENDER}): {e}"))?;
        let now = Instant::now();
        // Time of this transfer alone: from when it could start (posted, and the one before
        // it finished) to its end.
        let took = now.saturating_duration_since(posted.max(prev_done));
        prev_done = now;
        let after = ep.stats();
        let mut buf = region
            .and_then(Region::into_vec)
            .ok_or("the message layer did not hand the receive buffer back")?;
        let missing = report.missing_ranges(seg);
        if !c.keep_missing {
            for r in &missing {
                buf[r.clone()].fill(0);
            }
        }
        expect(round, &mut want);
        // Every byte outside the missing segments must be the sender's.
        let want = want.as_bytes();
        let mut verified = true;
        let mut at = 0;
        for r in missing.iter().chain(std::iter::once(&(size..size))) {
            verified &= buf[at..r.start] == want[at..r.start];
            at = r.end;
        }
        let missing_bytes: usize = missing.iter().map(|r| r.len()).sum();
        if round + 2 < c.count {
            pending.push_back(post(buf));
        }
        let g = Got {
            report,
            took,
            verified,
            delivered_bytes: (size - missing_bytes) as u64,
            before: std::mem::replace(&mut before, after.clone()),
            after,
        };
        done(round, &g);
        gots.push(g);
    }
    Ok(gots)
}

/// Waits for an operation; after [`BACKSTOP`] it is cancelled (and still waited for).
fn wait<T>(h: Handle<T>) -> Result<T, OpError> {
    match h.wait_timeout(BACKSTOP) {
        Ok(r) => r,
        Err(h) => {
            h.cancel();
            h.wait()
        }
    }
}

fn ended(e: Ended) -> &'static str {
    match e {
        Ended::Complete => "complete",
        Ended::Bound => "loss bound",
        Ended::Deadline => "deadline",
    }
}

/// One record of the table from what the receiver got and what the sender did (each when
/// this process saw it); `segments` when only the sender's side is known.
fn xfer(i: u32, got: Option<&Got>, sent: Option<&Sent>, segments: u32) -> Xfer {
    let segments = got.map_or(segments, |g| g.report.segments);
    let missing = got.map_or_else(|| sent.map_or(0, |s| s.missing), |g| g.report.missing);
    let received = segments.saturating_sub(missing);
    Xfer {
        index: i + 1,
        segments,
        received_segments: received,
        delivered_fraction: if segments == 0 {
            1.0
        } else {
            f64::from(received) / f64::from(segments)
        },
        rounds: got.map(|g| g.report.passes.saturating_sub(1)),
        fct_us: sent
            .map_or_else(|| got.map_or(Duration::ZERO, |g| g.took), |s| s.fct)
            .as_secs_f64()
            * 1e6,
        packets_sent: sent.map(|s| {
            (s.after.core.data_sent + s.after.core.data_resent)
                .saturating_sub(s.before.core.data_sent + s.before.core.data_resent)
        }),
        retransmitted: sent.map(|s| {
            s.after
                .core
                .data_resent
                .saturating_sub(s.before.core.data_resent)
        }),
        rate_halvings: None,
        duplicates: got.map(|g| {
            g.after
                .core
                .data_duplicate
                .saturating_sub(g.before.core.data_duplicate)
        }),
        rejected: got.map(|g| RejectCounts {
            foreign_source: g
                .after
                .unknown_source
                .saturating_sub(g.before.unknown_source),
            ..RejectCounts::default()
        }),
        invalid: got.map(|g| g.after.core.refused.saturating_sub(g.before.core.refused)),
        ended: got.map(|g| ended(g.report.ended)),
        verified: got.map(|g| g.verified),
    }
}

/// The summary of a run on the message layer.
#[allow(clippy::too_many_arguments)]
fn summary(
    c: &Common,
    role: &'static str,
    datapath: &'static str,
    gots: &[Got],
    sents: &[Sent],
    segments: u32,
    delivered: u64,
    elapsed: Duration,
) -> Summary {
    let n = gots.len().max(sents.len());
    let xfers = (0..n)
        .map(|i| xfer(i as u32, gots.get(i), sents.get(i), segments))
        .collect();
    let mut s = Summary::new(
        role,
        datapath,
        c.dtype.to_string(),
        c.size,
        c.loss_bound,
        c.inject_loss,
        delivered,
        elapsed,
        xfers,
    );
    s.protocol = "msg";
    s
}

/// The demo's pattern: the same tensor every transfer (as the flow transport's demo), filled
/// once.
fn demo_pattern() -> impl FnMut(u32, &mut Tensor) {
    let mut filled = false;
    move |_, t: &mut Tensor| {
        if !filled {
            t.fill_pattern(DEMO_SEED);
            filled = true;
        }
    }
}

/// Both ends in this process: the sender on a thread, the receiver here.
fn run_local(c: &Common, tx: Endpoint, rx: Endpoint, datapath: &'static str) -> Res<Summary> {
    let seg = seg_payload(c, rx.local_addr().is_ipv6());
    let start = Instant::now();
    let (gots, sent) = std::thread::scope(|s| -> Res<_> {
        let sender = s.spawn(|| -> Res<Vec<Sent>> {
            let mut t = c.tensor()?;
            t.fill_pattern(DEMO_SEED);
            (0..c.count).map(|_| send_one(&tx, &mut t)).collect()
        });
        let gots = recv_all(c, &rx, seg, demo_pattern(), |_, _| {});
        let sent = sender.join().map_err(|_| "sender thread panicked")?;
        Ok((gots, sent))
    })?;
    let elapsed = start.elapsed();
    let (gots, sents) = match (gots, sent) {
        (Ok(g), Ok(s)) => (g, s),
        (Err(re), Err(se)) => return Err(format!("receiver: {re}; sender: {se}").into()),
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => return Err(e),
    };
    let delivered = gots.iter().map(|g| g.delivered_bytes).sum();
    let mut s = summary(c, "demo", datapath, &gots, &sents, 0, delivered, elapsed);
    s.endpoint_sender = Some(EndpointCounters::from(&tx.stats()));
    s.endpoint_receiver = Some(EndpointCounters::from(&rx.stats()));
    Ok(s)
}

/// `gradwire demo` on the message layer.
pub fn demo(c: &Common) -> Res<Summary> {
    check(c)?;
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    match c.datapath {
        DatapathKind::Loopback => {
            let (a, b) = (SocketAddr::new(lo, 1), SocketAddr::new(lo, 2));
            let (tx_io, rx_io) = MemIo::pair(a, b, 1 << 16)
                .map_err(|e| format!("loopback datapath: eventfd: {e}"))?;
            let rx = Endpoint::with_io(
                endpoint_config(c, RECEIVER, b, c.inject_loss),
                Box::new(rx_io),
            )?;
            let tx = Endpoint::with_io(endpoint_config(c, SENDER, a, 0.0), Box::new(tx_io))?;
            let peers = vec![b, a];
            run_local(c, tx.start(peers.clone())?, rx.start(peers)?, "loopback")
        }
        DatapathKind::Udp => {
            let any = SocketAddr::new(lo, 0);
            let rx = Endpoint::bind(endpoint_config(c, RECEIVER, any, c.inject_loss))?;
            let tx = Endpoint::bind(endpoint_config(c, SENDER, any, 0.0))?;
            let peers = vec![rx.local_addr(), tx.local_addr()];
            run_local(c, tx.start(peers.clone())?, rx.start(peers)?, "udp")
        }
        DatapathKind::Afxdp => demo_afxdp(c),
    }
}

/// Counters of one side's AF_XDP socket, read from its progress thread.
fn snapshot(m: Option<&XdpMonitor>) -> Option<AfXdpStats> {
    m.and_then(|m| m.snapshot(Duration::from_secs(2)))
        .map(|s| s.afxdp)
}

/// One end of the AF_XDP demo, in its namespace: its socket, peer allowlist and endpoint.
fn xdp_endpoint(
    c: &Common,
    rank: u16,
    ifname: &str,
    local: SocketAddr,
    peer: SocketAddr,
    inject_loss: f64,
) -> Res<(Endpoint, XdpMonitor)> {
    let mut io = XdpIo::open(&xdp_config(c, ifname, local, inject_loss)?)?;
    io.allow_peers(&[peer])?;
    let monitor = io.monitor();
    let mut peers = vec![local, local];
    peers[usize::from(rank)] = io.local_addr();
    peers[usize::from(1 - rank)] = peer;
    let ep = Endpoint::with_io(endpoint_config(c, rank, local, 0.0), Box::new(io))?.start(peers)?;
    Ok((ep, monitor))
}

type SideOutcome<T> = (Vec<T>, Option<AfXdpStats>, EndpointCounters, Duration);

/// `gradwire demo --datapath afxdp`: two namespaces joined by a veth pair, an endpoint on an
/// AF_XDP socket in each; loss is injected by the receiver's XDP classifier.
fn demo_afxdp(c: &Common) -> Res<Summary> {
    if !gradwire_netns::is_root() {
        return Err("gradwire demo --datapath afxdp needs root (it creates network namespaces and attaches XDP programs); run it with sudo, or use --datapath udp".into());
    }
    // veth: generic XDP measured faster than native there (docs/benchmarks.md).
    let mut c = c.clone();
    if c.afxdp.xdp_mode == gradwire_ebpf::AttachMode::Auto {
        c.afxdp.xdp_mode = gradwire_ebpf::AttachMode::Generic;
    }
    // Refuse what the layer cannot do before building anything.
    xdp_config(
        &c,
        "",
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        0.0,
    )?;
    let tb = Testbed::up(&TestbedConfig {
        queues: 1,
        mtu: c.mtu as u32,
        ..TestbedConfig::default()
    })?;
    let port = 7000;
    let tx_addr = SocketAddr::new(IpAddr::V4(tb.host(0).ipv4), port);
    let rx_addr = SocketAddr::new(IpAddr::V4(tb.host(1).ipv4), port);
    let ifname = tb.host(0).ifname.clone();
    let (rc, rif) = (c.clone(), ifname.clone());
    let receiver = tb.spawn_in(1, move || -> Res<SideOutcome<Got>> {
        pin(&rc, 1)?;
        let (ep, mon) = xdp_endpoint(&rc, RECEIVER, &rif, rx_addr, tx_addr, rc.inject_loss)?;
        let seg = seg_payload(&rc, false);
        let start = Instant::now();
        let gots = recv_all(&rc, &ep, seg, demo_pattern(), |_, _| {})?;
        let elapsed = start.elapsed();
        Ok((gots, snapshot(Some(&mon)), (&ep.stats()).into(), elapsed))
    })?;
    let sc = c.clone();
    let sender = tb.spawn_in(0, move || -> Res<SideOutcome<Sent>> {
        pin(&sc, 0)?;
        let (ep, mon) = xdp_endpoint(&sc, SENDER, &ifname, tx_addr, rx_addr, 0.0)?;
        let mut t = sc.tensor()?;
        t.fill_pattern(DEMO_SEED);
        let start = Instant::now();
        let sents = (0..sc.count)
            .map(|_| send_one(&ep, &mut t))
            .collect::<Res<Vec<_>>>()?;
        let elapsed = start.elapsed();
        Ok((sents, snapshot(Some(&mon)), (&ep.stats()).into(), elapsed))
    })?;
    let sres = sender.join().map_err(|_| "sender thread panicked")?;
    let rres = receiver.join().map_err(|_| "receiver thread panicked")?;
    let ((gots, rx_afxdp, rx_ep, elapsed), (sents, tx_afxdp, tx_ep, _)) = match (rres, sres) {
        (Ok(r), Ok(s)) => (r, s),
        (Err(re), Err(se)) => return Err(format!("receiver: {re}; sender: {se}").into()),
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => return Err(e),
    };
    let delivered = gots.iter().map(|g| g.delivered_bytes).sum();
    let mut s = summary(&c, "demo", "afxdp", &gots, &sents, 0, delivered, elapsed);
    s.afxdp_sender = tx_afxdp;
    s.afxdp_receiver = rx_afxdp;
    s.endpoint_sender = Some(tx_ep);
    s.endpoint_receiver = Some(rx_ep);
    tb.down()?;
    Ok(s)
}

/// The set-up line a sender sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hello {
    proto: String,
    version: u32,
    job: u32,
    dtype: String,
    size: u64,
    count: u32,
    loss_bound: f64,
    mtu: usize,
    /// The sender's data address (an unspecified IP: the one it connected from).
    data: SocketAddr,
}

/// The receiver's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Reply {
    /// The receiver's data address (an unspecified IP: the one the sender connected to), or
    /// `None` when it refuses.
    data: Option<SocketAddr>,
    /// Why it refuses.
    error: Option<String>,
}

fn hello_of(c: &Common, data: SocketAddr) -> Hello {
    Hello {
        proto: SETUP_PROTO.into(),
        version: SETUP_VERSION,
        job: c.job,
        dtype: c.dtype.to_string(),
        size: c.size,
        count: c.count,
        loss_bound: c.loss_bound,
        mtu: c.mtu,
        data,
    }
}

/// Why the receiver refuses a sender's parameters, if it does.
fn mismatch(mine: &Hello, theirs: &Hello) -> Option<String> {
    if theirs.proto != SETUP_PROTO || theirs.version != SETUP_VERSION {
        return Some(format!(
            "set-up {} version {} is not {SETUP_PROTO} version {SETUP_VERSION}: run the same gradwire on both hosts",
            theirs.proto, theirs.version
        ));
    }
    let diff = [
        ("--job", mine.job.to_string(), theirs.job.to_string()),
        ("--dtype", mine.dtype.clone(), theirs.dtype.clone()),
        ("--size", mine.size.to_string(), theirs.size.to_string()),
        ("--count", mine.count.to_string(), theirs.count.to_string()),
        (
            "--loss-bound",
            mine.loss_bound.to_string(),
            theirs.loss_bound.to_string(),
        ),
        ("--mtu", mine.mtu.to_string(), theirs.mtu.to_string()),
    ];
    let bad: Vec<String> = diff
        .iter()
        .filter(|(_, a, b)| a != b)
        .map(|(k, a, b)| format!("{k} {b} (receiver: {a})"))
        .collect();
    (!bad.is_empty()).then(|| {
        format!(
            "the sender's {} differ from the receiver's: give both ends the same",
            bad.join(", ")
        )
    })
}

/// Reads one JSON line of at most [`SETUP_MAX`] bytes.
fn read_line<T: for<'de> Deserialize<'de>>(s: &TcpStream) -> Result<T, String> {
    let mut line = String::new();
    let mut r = BufReader::new(std::io::Read::take(s, SETUP_MAX));
    match r.read_line(&mut line) {
        Ok(0) => return Err("the connection closed before a set-up line came".into()),
        Ok(_) if !line.ends_with('\n') => {
            return Err(format!(
                "no set-up line within {SETUP_MAX} bytes (not a gradwire of this version?)"
            ))
        }
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Err("no set-up line came in time".into())
        }
        Err(e) => return Err(format!("reading the set-up line: {e}")),
    }
    serde_json::from_str(line.trim_end())
        .map_err(|e| format!("the set-up line is not gradwire's ({e})"))
}

fn write_line<T: Serialize>(mut s: &TcpStream, v: &T) -> std::io::Result<()> {
    let mut text = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    text.push(b'\n');
    s.write_all(&text)
}

/// A socket of one side, opened but not started (AF_XDP waits for its peer's address to
/// fill the allowlist).
enum Opened {
    Udp(Bound),
    Xdp(Box<XdpIo>, EndpointConfig),
}

impl Opened {
    fn open(c: &Common, rank: u16, local: SocketAddr, inject_loss: f64, cmd: &str) -> Res<Opened> {
        Ok(match c.datapath {
            DatapathKind::Udp => {
                Opened::Udp(Endpoint::bind(endpoint_config(c, rank, local, inject_loss))?)
            }
            DatapathKind::Afxdp => {
                let ifname = c.afxdp.ifname.as_deref().ok_or_else(|| {
                    format!("gradwire {cmd} --datapath afxdp needs --ifname (the interface that holds {})", local.ip())
                })?;
                let io = XdpIo::open(&xdp_config(c, ifname, local, inject_loss)?)?;
                Opened::Xdp(Box::new(io), endpoint_config(c, rank, local, 0.0))
            }
            DatapathKind::Loopback => return Err(format!(
                "gradwire {cmd} runs between hosts: use --datapath udp or afxdp (the loopback datapath only exists inside one process; try `gradwire demo --datapath loopback`)"
            )
            .into()),
        })
    }

    fn local_addr(&self) -> SocketAddr {
        match self {
            Opened::Udp(b) => b.local_addr(),
            Opened::Xdp(io, _) => io.local_addr(),
        }
    }

    /// Starts the endpoint with `peer` as the other rank.
    fn start(self, rank: u16, peer: SocketAddr) -> Res<(Endpoint, Option<XdpMonitor>)> {
        let local = self.local_addr();
        let mut peers = vec![local, local];
        peers[usize::from(1 - rank)] = peer;
        Ok(match self {
            Opened::Udp(b) => (b.start(peers)?, None),
            Opened::Xdp(mut io, cfg) => {
                io.allow_peers(&[peer])?;
                let m = io.monitor();
                (Endpoint::with_io(cfg, io)?.start(peers)?, Some(m))
            }
        })
    }
}

/// An unspecified IP in `a` replaced by `ip`.
fn fill_ip(a: SocketAddr, ip: IpAddr) -> SocketAddr {
    if a.ip().is_unspecified() {
        SocketAddr::new(ip, a.port())
    } else {
        a
    }
}

fn stats_of(ep: &Endpoint, mon: Option<&XdpMonitor>) -> (EndpointCounters, Option<AfXdpStats>) {
    let st = ep.stats();
    let counters = EndpointCounters::from(&st);
    (
        counters,
        mon.and_then(|m| m.snapshot(Duration::from_secs(1)))
            .map(|s| s.afxdp),
    )
}

/// `gradwire send` on the message layer.
pub fn send(a: &SendArgs) -> Res {
    let c = &a.common;
    check(c)?;
    if a.spray_ports > 1 {
        return Err("--spray-ports runs on the flow transport only (give --transport flow on both ends): the message layer knows its peer by one address".into());
    }
    let mut t = c.tensor()?;
    let bind = a.bind.unwrap_or_else(|| {
        let ip: IpAddr = if a.to.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        SocketAddr::new(ip, 0)
    });
    pin(c, 0)?;
    let opened = Opened::open(c, SENDER, bind, 0.0, "send")?;
    let timeout = Duration::from_secs_f64(c.timeout);
    let conn = TcpStream::connect_timeout(&a.to, timeout.max(Duration::from_secs(1))).map_err(|e| {
        format!(
            "set-up connection to {}: {e} (is `gradwire recv --listen {}` running there, and the port open?)",
            a.to, a.to
        )
    })?;
    conn.set_read_timeout(Some(timeout.max(Duration::from_secs(1))))?;
    let _ = conn.set_nodelay(true);
    write_line(&conn, &hello_of(c, opened.local_addr()))
        .map_err(|e| format!("set-up connection to {}: sending the parameters: {e}", a.to))?;
    let reply: Reply = read_line(&conn).map_err(|e| {
        format!(
            "set-up with {}: {e} (a receiver on the flow transport, an authenticated job or --transport flow, does not speak the message layer's set-up: give both ends the same --transport)",
            a.to
        )
    })?;
    let peer = match (reply.data, reply.error) {
        (_, Some(e)) => return Err(format!("the receiver at {} refused: {e}", a.to).into()),
        (Some(d), None) => fill_ip(d, a.to.ip()),
        (None, None) => return Err(format!("the receiver at {} sent no data address", a.to).into()),
    };
    drop(conn);
    let (ep, mon) = opened.start(SENDER, peer)?;
    let stats_file = StatsFile::new("send", c.datapath.name(), "msg");
    // Visible to `gradwire stats` from the start, not only after the first transfer.
    let (counters, afxdp) = stats_of(&ep, mon.as_ref());
    stats_file.write_msg(0, counters, afxdp, RejectCounts::default());
    let segments = u32::try_from(
        c.size
            .div_ceil(seg_payload(c, peer.is_ipv6()) as u64)
            .max(1),
    )
    .unwrap_or(u32::MAX);
    let start = Instant::now();
    let mut sents = Vec::new();
    let mut delivered = 0u64;
    for round in 0..c.count {
        // The receiver regenerates the same pattern to verify.
        t.fill_pattern(u64::from(round));
        let s = send_one(&ep, &mut t)?;
        delivered += (u64::from(segments.saturating_sub(s.missing)) * c.size)
            .checked_div(u64::from(segments))
            .unwrap_or(0);
        sents.push(s);
        let (counters, afxdp) = stats_of(&ep, mon.as_ref());
        stats_file.write_msg(round + 1, counters, afxdp, RejectCounts::default());
    }
    let elapsed = start.elapsed();
    let mut s = summary(
        c,
        "send",
        c.datapath.name(),
        &[],
        &sents,
        segments,
        delivered,
        elapsed,
    );
    let (counters, afxdp) = stats_of(&ep, mon.as_ref());
    s.endpoint_sender = Some(counters);
    s.afxdp_sender = afxdp;
    s.print(c.json);
    Ok(())
}

/// Accepts senders on `listener` until one's parameters match `mine` (the others are told
/// why and logged) or `until` passes. Returns the sender's data address.
fn accept(
    listener: &TcpListener,
    mine: &Hello,
    until: Instant,
    json: bool,
) -> Res<(TcpStream, SocketAddr)> {
    listener.set_nonblocking(true)?;
    loop {
        let (conn, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= until {
                    return Err(format!(
                        "no sender set a run up on {} in time (--accept-timeout): start `gradwire send --to {}` on the other host, or check the firewall",
                        listener.local_addr()?,
                        listener.local_addr()?
                    )
                    .into());
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(format!("accepting a sender: {e}").into()),
        };
        conn.set_nonblocking(false)?;
        // A connection that says nothing must not keep the port: a short read timeout.
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let refused = match read_line::<Hello>(&conn) {
            Err(e) => e,
            Ok(h) => match mismatch(mine, &h) {
                Some(e) => e,
                None => return Ok((conn, fill_ip(h.data, from.ip()))),
            },
        };
        let _ = write_line(
            &conn,
            &Reply {
                data: None,
                error: Some(refused.clone()),
            },
        );
        if !json {
            eprintln!("gradwire recv: refused {from}: {refused}; still waiting");
        }
    }
}

/// `gradwire recv` on the message layer.
pub fn recv(a: &RecvArgs) -> Res {
    let c = &a.common;
    check(c)?;
    if !(a.accept_timeout.is_finite() && a.accept_timeout > 0.0 && a.accept_timeout < 1e9) {
        return Err(format!(
            "--accept-timeout {} must be a positive number of seconds",
            a.accept_timeout
        )
        .into());
    }
    let data = a
        .data
        .unwrap_or_else(|| SocketAddr::new(a.listen.ip(), a.listen.port().wrapping_add(1)));
    pin(c, 0)?;
    // Over UDP the endpoint drops data segments itself; over AF_XDP the classifier does.
    let opened = Opened::open(c, RECEIVER, data, c.inject_loss, "recv")?;
    let listener =
        TcpListener::bind(a.listen).map_err(|e| format!("cannot listen on {}: {e}", a.listen))?;
    let local = opened.local_addr();
    if !c.json {
        eprintln!(
            "gradwire recv: set-up on {}, data on {local}; waiting for a sender",
            a.listen
        );
    }
    let until = Instant::now() + Duration::from_secs_f64(a.accept_timeout);
    let (conn, peer) = accept(&listener, &hello_of(c, local), until, c.json)?;
    drop(listener);
    let (ep, mon) = opened.start(RECEIVER, peer)?;
    // Answer only once the endpoint (and the allowlist) holds the sender.
    write_line(
        &conn,
        &Reply {
            data: Some(local),
            error: None,
        },
    )
    .map_err(|e| format!("answering the sender at {peer}: {e}"))?;
    drop(conn);
    if !c.json {
        eprintln!("gradwire recv: sender {peer} (plain job, not authenticated)");
    }
    let stats_file = StatsFile::new("recv", c.datapath.name(), "msg");
    let (counters, afxdp) = stats_of(&ep, mon.as_ref());
    stats_file.write_msg(0, counters, afxdp, RejectCounts::default());
    let seg = seg_payload(c, local.is_ipv6());
    let start = Instant::now();
    let mut rejected = RejectCounts::default();
    // The sender fills round r with pattern r.
    let gots = recv_all(
        c,
        &ep,
        seg,
        |round, t| t.fill_pattern(u64::from(round)),
        |round, _| {
            let (counters, afxdp) = stats_of(&ep, mon.as_ref());
            rejected.foreign_source = counters.unknown_source;
            stats_file.write_msg(round + 1, counters, afxdp, rejected);
        },
    )?;
    let elapsed = start.elapsed();
    let delivered = gots.iter().map(|g| g.delivered_bytes).sum();
    let mut s = summary(
        c,
        "recv",
        c.datapath.name(),
        &gots,
        &[],
        0,
        delivered,
        elapsed,
    );
    let (counters, afxdp) = stats_of(&ep, mon.as_ref());
    s.endpoint_receiver = Some(counters);
    s.afxdp_receiver = afxdp;
    s.print(c.json);
    if s.verified == Some(false) {
        return Err("some delivered bytes differ from the sender's".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_with_other_parameters_is_refused_naming_them() {
        let a: SocketAddr = "10.0.0.1:7071".parse().unwrap();
        let mine = Hello {
            proto: SETUP_PROTO.into(),
            version: SETUP_VERSION,
            job: 1,
            dtype: "f32".into(),
            size: 1 << 20,
            count: 8,
            loss_bound: 0.01,
            mtu: 1500,
            data: a,
        };
        assert_eq!(mismatch(&mine, &mine.clone()), None);
        let theirs = Hello {
            size: 1 << 21,
            mtu: 9000,
            ..mine.clone()
        };
        let e = mismatch(&mine, &theirs).unwrap();
        assert!(e.contains("--size 2097152 (receiver: 1048576)"), "{e}");
        assert!(e.contains("--mtu 9000 (receiver: 1500)"), "{e}");
        let old = Hello {
            version: 0,
            ..mine.clone()
        };
        assert!(mismatch(&mine, &old).unwrap().contains("version"));
    }
}
