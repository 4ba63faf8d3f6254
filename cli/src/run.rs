//! The commands: demo (both ends in one process), send and recv (two hosts). They run on the
//! message layer ([`crate::p2p`]) unless the run needs the flow transport (a job secret,
//! the AF_XDP engine, several queues, port spraying, or `--transport flow`), which is here.

use std::error::Error;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use gradwire::afxdp::engine::{Engine, EngineConfig};
use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, AfXdpStats, BusyPoll, PollMode};
use gradwire::ctrl_channel::{CtrlChannel, MemCtrl, TcpCtrl};
use gradwire::datapath::fault::{FaultConfig, FaultInjector};
use gradwire::datapath::loopback::Loopback;
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::{fixed_priority, RejectCounts, SenderConfig, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::rate::RateConfig;
use gradwire::transport::{
    recv_tensor, send_tensor, MissingFill, RecvOptions, RecvReport, SendOptions, SendReport,
    TransferConfig,
};
use gradwire_netns::{Testbed, TestbedConfig};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{Common, DatapathKind, DemoArgs, RecvArgs, SendArgs, TransportKind};
use crate::report::{Summary, Xfer};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// Tensor id used by the CLI; each transfer is a new round of it.
const TENSOR_ID: u32 = 1;
/// DSCP of data packets from the CLI (AF11); per-layer tagging is the library's job.
const DATA_TAG: Tag = Tag {
    dscp: 10,
    ect: true,
};

fn transfer_config(c: &Common) -> Res<TransferConfig> {
    let mut rate = RateConfig::new(c.line_rate);
    rate.delta = c.delta;
    rate.period_ns = c.period_us.saturating_mul(1000);
    rate.additive_increase = c.additive_increase;
    rate.min_rate_bps = rate.min_rate_bps.min(c.line_rate);
    if !(c.timeout.is_finite() && c.timeout > 0.0 && c.timeout < 86_400.0) {
        return Err(format!(
            "--timeout {} must be a positive number of seconds",
            c.timeout
        )
        .into());
    }
    let cfg = TransferConfig {
        mtu: c.mtu,
        sender: SenderConfig {
            rate,
            ..SenderConfig::with_mode(c.rate_mode, c.line_rate)
        },
        idle_timeout: Duration::from_secs_f64(c.timeout),
        connect_timeout: Duration::from_secs_f64(c.timeout.max(10.0)),
        ..TransferConfig::default()
    };
    cfg.validate()?;
    Ok(cfg)
}

fn faults(c: &Common) -> FaultConfig {
    FaultConfig::loss(c.inject_loss)
}

/// AF_XDP datapath configuration from the command line.
fn afxdp_config(c: &Common, ifname: &str, local: SocketAddr, inject_loss: f64) -> AfXdpConfig {
    let a = &c.afxdp;
    let mut x = AfXdpConfig::new(ifname, local);
    x.queues = a.queues.clone();
    x.xdp_mode = a.xdp_mode;
    x.batch = a.batch;
    x.socket.frame_size = a.frame_size;
    x.socket.ring_size = a.ring_size;
    x.socket.frames = a.ring_size.saturating_mul(2).max(x.socket.frames);
    x.socket.hugepages = !a.no_hugepages;
    x.socket.zero_copy = !a.no_zero_copy;
    x.neighbors = a.neighbors.clone();
    if a.busy_poll {
        x.poll = PollMode::BusyPoll;
        x.socket.busy_poll = Some(BusyPoll {
            usecs: 50,
            budget: 64,
        });
    }
    if inject_loss > 0.0 {
        x.fault_drop = vec![(DATA_TAG.dscp, inject_loss)];
    }
    x
}

/// Pin the calling thread to `cores[i]` when cores were given (with --engine the cores
/// belong to the workers instead).
fn pin(c: &Common, i: usize) -> Res {
    if c.afxdp.engine {
        return Ok(());
    }
    if let Some(&core) = c.afxdp.cores.get(i) {
        let ok = core_affinity::set_for_current(core_affinity::CoreId { id: core });
        if !ok {
            return Err(format!("cannot pin to core {core} (see nproc)").into());
        }
    }
    Ok(())
}

/// The AF_XDP datapath: single-threaded, or the engine with pinned per-queue workers.
fn open_afxdp(
    c: &Common,
    ifname: &str,
    local: SocketAddr,
    inject_loss: f64,
    spray_ports: u16,
) -> Res<Box<dyn Datapath>> {
    let mut x = afxdp_config(c, ifname, local, inject_loss);
    x.spray_ports = spray_ports;
    Ok(if c.afxdp.engine {
        Box::new(Engine::start(EngineConfig {
            afxdp: x,
            cores: c.afxdp.cores.clone(),
        })?)
    } else {
        Box::new(AfXdpDatapath::open(x)?)
    })
}

/// The data datapath for send/recv on this host.
fn host_datapath(
    c: &Common,
    local: SocketAddr,
    inject_loss: f64,
    cmd: &str,
    spray_ports: u16,
) -> Res<Box<dyn Datapath>> {
    let udp = UdpConfig {
        max_datagram: c.mtu.saturating_sub(28).max(64),
        spray_ports,
        ..UdpConfig::default()
    };
    Ok(match c.datapath {
        DatapathKind::Udp => Box::new(FaultInjector::new(UdpDatapath::bind(local, udp)?, FaultConfig::loss(inject_loss))?),
        DatapathKind::Afxdp => {
            let ifname = c.afxdp.ifname.as_deref().ok_or_else(|| {
                format!("gradwire {cmd} --datapath afxdp needs --ifname (the interface that holds {})", local.ip())
            })?;
            if local.ip().is_unspecified() || local.port() == 0 {
                return Err(format!(
                    "gradwire {cmd} --datapath afxdp needs a concrete local address and port (got {local}): AF_XDP builds its own IP and UDP headers"
                )
                .into());
            }
            open_afxdp(c, ifname, local, inject_loss, spray_ports)?
        }
        DatapathKind::Loopback => {
            return Err(format!(
                "gradwire {cmd} runs between hosts: use --datapath udp or afxdp (the loopback datapath only exists inside one process; try `gradwire demo --datapath loopback`)"
            )
            .into())
        }
    })
}

fn send_opts(c: &Common, round: u32) -> Res<SendOptions> {
    Ok(SendOptions {
        round,
        stage: Stage::Push,
        loss_bound: Some(LossBound::from_fraction(c.loss_bound)?),
        ..SendOptions::new(c.job, TENSOR_ID)
    })
}

fn recv_opts(c: &Common, round: u32) -> Res<RecvOptions> {
    Ok(RecvOptions {
        round: Some(round),
        loss_bound: Some(LossBound::from_fraction(c.loss_bound)?),
        fill: if c.keep_missing {
            MissingFill::Keep
        } else {
            MissingFill::Zero
        },
        ..RecvOptions::new(c.job, TENSOR_ID)
    })
}

/// Every delivered segment equals the sender's bytes.
fn verify(r: &RecvReport, sent: &[u8], got: &[u8]) -> bool {
    (0..r.segments).filter(|&i| r.bitmap.get(i)).all(|i| {
        r.layout.segment(i).is_some_and(|(off, len)| {
            let range = off as usize..off as usize + len;
            sent.get(range.clone()) == got.get(range)
        })
    })
}

fn progress(c: &Common) -> ProgressBar {
    let total = c.size.saturating_mul(u64::from(c.count));
    if c.json || total < (256 << 20) {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
    {
        pb.set_style(style);
    }
    pb
}

fn xfer_from(i: u32, r: &RecvReport, s: Option<&SendReport>, verified: Option<bool>) -> Xfer {
    Xfer {
        index: i + 1,
        segments: r.segments,
        received_segments: r.received_segments,
        delivered_fraction: r.delivered_fraction,
        rounds: Some(r.rounds),
        fct_us: s.map_or(r.fct, |s| s.fct).as_secs_f64() * 1e6,
        packets_sent: s.map(|s| s.stats.packets),
        retransmitted: s.map(|s| s.stats.retransmitted),
        rate_halvings: s.map(|s| s.stats.halvings),
        duplicates: Some(r.stats.duplicates),
        rejected: Some(r.rejected),
        invalid: None,
        ended: None,
        verified,
    }
}

/// Run `count` transfers between two ends in this process.
#[allow(clippy::too_many_arguments)]
fn run_pair<DA, CA, DB, CB>(
    c: &Common,
    cfg: &TransferConfig,
    mut dpa: DA,
    mut ca: CA,
    dst_ip: IpAddr,
    mut dpb: DB,
    mut cb: CB,
    datapath: &'static str,
) -> Res<Summary>
where
    DA: Datapath + Send,
    CA: CtrlChannel + Send,
    DB: Datapath,
    CB: CtrlChannel,
{
    let mut sent = c.tensor()?;
    sent.fill_pattern(0x6772_6164);
    let mut got = c.tensor()?;
    let pb = progress(c);
    let prio = fixed_priority(DATA_TAG);
    let start = Instant::now();
    let (recvs, sends) = std::thread::scope(|s| -> Res<_> {
        let sent_ref = &sent;
        let prio = &prio;
        let sender = s.spawn(move || -> Res<Vec<SendReport>> {
            let mut out = Vec::new();
            for round in 0..c.count {
                out.push(send_tensor(
                    &mut dpa,
                    &mut ca,
                    dst_ip,
                    sent_ref,
                    &send_opts(c, round)?,
                    prio,
                    cfg,
                )?);
            }
            Ok(out)
        });
        let mut recvs = Vec::new();
        for round in 0..c.count {
            match recv_tensor(&mut dpb, &mut cb, &mut got, &recv_opts(c, round)?, cfg) {
                Ok(r) => {
                    let ok = verify(&r, sent.as_bytes(), got.as_bytes());
                    pb.inc(c.size);
                    recvs.push((r, ok));
                }
                Err(e) => {
                    // Drop our ends so the sender notices too, then report both sides.
                    drop(cb);
                    let se = sender.join().map_err(|_| "sender thread panicked")?;
                    return Err(match se {
                        Err(se) => format!("receiver: {e}; sender: {se}").into(),
                        Ok(_) => e.into(),
                    });
                }
            }
        }
        let sends = sender.join().map_err(|_| "sender thread panicked")??;
        Ok((recvs, sends))
    })?;
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    let delivered: u64 = recvs.iter().map(|(r, _)| r.stats.bytes).sum();
    let xfers = recvs
        .iter()
        .zip(&sends)
        .enumerate()
        .map(|(i, ((r, ok), s))| xfer_from(i as u32, r, Some(s), Some(*ok)))
        .collect();
    Ok(Summary::new(
        "demo",
        datapath,
        c.dtype.to_string(),
        c.size,
        c.loss_bound,
        c.inject_loss,
        delivered,
        elapsed,
        xfers,
    ))
}

/// Whether this run goes on the flow transport: asked for, or needed (authentication,
/// the engine, several queues and port spraying exist only there).
fn on_flow(c: &Common, spray_ports: u16) -> Res<bool> {
    let secret = job_key(c)?.is_some();
    let needs = secret || c.afxdp.engine || c.afxdp.queues.len() > 1 || spray_ports > 1;
    match c.transport {
        TransportKind::Flow => Ok(true),
        TransportKind::Auto => Ok(needs),
        TransportKind::Msg if secret => Err("an authenticated job (a job secret in --secret-file or GRADWIRE_JOB_SECRET) runs on the flow transport only: drop --transport msg, or the secret".into()),
        TransportKind::Msg => Ok(false),
    }
}

/// `gradwire demo`: both ends in this process.
pub fn demo(a: &DemoArgs) -> Res {
    let c = &a.common;
    let summary = if on_flow(c, 1)? {
        demo_flow(c)?
    } else {
        crate::p2p::demo(c)?
    };
    summary.print(c.json);
    if summary.verified == Some(false) {
        return Err("some delivered bytes differ from the sender's".into());
    }
    Ok(())
}

/// The demo on the flow transport, over the in-memory pair, UDP on 127.0.0.1 or AF_XDP.
fn demo_flow(c: &Common) -> Res<Summary> {
    let cfg = transfer_config(c)?;
    let summary = match c.datapath {
        DatapathKind::Loopback => {
            let x = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 1);
            let y = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 2);
            let max = c.mtu.saturating_sub(28).max(64);
            let (dpa, dpb) = Loopback::pair(x, y, max, 1 << 16);
            let dpb = FaultInjector::new(dpb, faults(c))?;
            let (ca, cb) = MemCtrl::pair();
            run_pair(c, &cfg, dpa, ca, y.ip(), dpb, cb, "loopback")?
        }
        DatapathKind::Udp => {
            let lo = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
            let udp = UdpConfig {
                max_datagram: c.mtu.saturating_sub(28).max(64),
                ..UdpConfig::default()
            };
            // The listener runs the server side of the handshake while we connect.
            let listener = control_listener(c, &cfg, lo)?;
            let ctrl_addr = listener.local_addr();
            let dpa = UdpDatapath::bind(lo, udp.clone())?;
            let dpb = FaultInjector::new(UdpDatapath::bind(lo, udp)?, faults(c))?;
            let ca = TcpCtrl::connect_with(
                ctrl_addr,
                cfg.connect_timeout,
                cfg.control_dscp,
                job_key(c)?.as_ref(),
            )?;
            let cb = listener.accept(cfg.connect_timeout)?;
            run_pair(c, &cfg, dpa, ca, ctrl_addr.ip(), dpb, cb, "udp")?
        }
        DatapathKind::Afxdp => demo_afxdp(c, &cfg)?,
    };
    Ok(summary)
}

/// What the receiving namespace hands back: verified reports, its AF_XDP counters, elapsed.
type ReceiverOutcome = (Vec<(RecvReport, bool)>, Option<AfXdpStats>, Duration);

/// `gradwire demo --datapath afxdp`: two network namespaces joined by a veth pair, the
/// receiver in one and the sender in the other, each with its own XDP classifier and AF_XDP
/// socket; loss is injected by the receiver's classifier.
fn demo_afxdp(c: &Common, cfg: &TransferConfig) -> Res<Summary> {
    if !gradwire_netns::is_root() {
        return Err("gradwire demo --datapath afxdp needs root (it creates network namespaces and attaches XDP programs); run it with sudo, or use --datapath udp".into());
    }
    // The demo's links are veth, where native XDP first copies every skb-borne packet into a
    // page-pool page; generic mode measured faster there (docs/benchmarks.md).
    let mut c = c.clone();
    if c.afxdp.xdp_mode == gradwire_ebpf::AttachMode::Auto {
        c.afxdp.xdp_mode = gradwire_ebpf::AttachMode::Generic;
    }
    let c = &c;
    let queues = c.afxdp.queues.iter().max().map_or(1, |q| q + 1);
    let tb = Testbed::up(&TestbedConfig {
        queues,
        mtu: c.mtu as u32,
        ..TestbedConfig::default()
    })?;
    let (tx_ip, rx_ip) = (IpAddr::V4(tb.host(0).ipv4), IpAddr::V4(tb.host(1).ipv4));
    let data_port = 7000;
    let ctrl_addr = SocketAddr::new(rx_ip, 7001);
    let ifname = tb.host(0).ifname.clone();
    let pb = progress(c);
    let (rc, rcfg, rif, rpb) = (c.clone(), cfg.clone(), ifname.clone(), pb.clone());
    let receiver = tb.spawn_in(1, move || -> Res<ReceiverOutcome> {
        pin(&rc, 1)?;
        let listener = control_listener(&rc, &rcfg, ctrl_addr)?;
        let dp = open_afxdp(
            &rc,
            &rif,
            SocketAddr::new(rx_ip, data_port),
            rc.inject_loss,
            1,
        )?;
        let mut rx = gradwire::transport::Receiver::accept(&listener, dp, rcfg)?;
        let mut sent = rc.tensor()?;
        sent.fill_pattern(0x6772_6164);
        let mut got = rc.tensor()?;
        let mut out = Vec::new();
        let start = Instant::now();
        for round in 0..rc.count {
            let r = rx.recv(&mut got, &recv_opts(&rc, round)?)?;
            let ok = verify(&r, sent.as_bytes(), got.as_bytes());
            rpb.inc(rc.size);
            out.push((r, ok));
        }
        let elapsed = start.elapsed();
        Ok((out, AfXdpStats::of(rx.datapath()), elapsed))
    })?;
    let (sc, scfg) = (c.clone(), cfg.clone());
    let sender = tb.spawn_in(0, move || -> Res<(Vec<SendReport>, Option<AfXdpStats>)> {
        pin(&sc, 0)?;
        let mut t = sc.tensor()?;
        t.fill_pattern(0x6772_6164);
        let dp = open_afxdp(&sc, &ifname, SocketAddr::new(tx_ip, data_port), 0.0, 1)?;
        // The receiver starts in parallel: retry the control connection for a while.
        let key = job_key(&sc)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let ctrl = loop {
            match TcpCtrl::connect_with(
                ctrl_addr,
                scfg.connect_timeout,
                scfg.control_dscp,
                key.as_ref(),
            ) {
                Ok(c) => break c,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(e.into()),
            }
        };
        let mut tx = gradwire::transport::Sender::with_channel(ctrl, dp, scfg)?;
        let prio = fixed_priority(DATA_TAG);
        let mut out = Vec::new();
        for round in 0..sc.count {
            out.push(tx.send(&t, &send_opts(&sc, round)?, &prio)?);
        }
        Ok((out, AfXdpStats::of(tx.datapath())))
    })?;
    let sres = sender.join().map_err(|_| "sender thread panicked")?;
    let rres = receiver.join().map_err(|_| "receiver thread panicked")?;
    pb.finish_and_clear();
    let (recvs, rstats, elapsed) = match (rres, &sres) {
        (Ok(r), _) => r,
        (Err(re), Err(se)) => return Err(format!("receiver: {re}; sender: {se}").into()),
        (Err(re), Ok(_)) => return Err(re),
    };
    let (sends, sstats) = sres?;
    let delivered: u64 = recvs.iter().map(|(r, _)| r.stats.bytes).sum();
    let xfers = recvs
        .iter()
        .zip(&sends)
        .enumerate()
        .map(|(i, ((r, ok), s))| xfer_from(i as u32, r, Some(s), Some(*ok)))
        .collect();
    let mut summary = Summary::new(
        "demo",
        "afxdp",
        c.dtype.to_string(),
        c.size,
        c.loss_bound,
        c.inject_loss,
        delivered,
        elapsed,
        xfers,
    );
    summary.afxdp_sender = sstats;
    summary.afxdp_receiver = rstats;
    tb.down()?;
    Ok(summary)
}

/// The job's key, from `--secret-file` or GRADWIRE_JOB_SECRET; `None`: a plain job.
fn job_key(
    c: &Common,
) -> Result<Option<gradwire::auth::JobKey>, gradwire::job_secret::SecretError> {
    gradwire::job_secret::load(c.secret_file.as_deref())
}

/// A control listener on `addr` that authenticates senders when the job has a secret.
fn control_listener(
    c: &Common,
    cfg: &TransferConfig,
    addr: SocketAddr,
) -> Result<gradwire::ctrl_listener::CtrlListener, Box<dyn std::error::Error + Send + Sync>> {
    let config = gradwire::ctrl_listener::ListenerConfig {
        key: job_key(c)?,
        dscp: cfg.control_dscp,
        ..Default::default()
    };
    gradwire::ctrl_listener::CtrlListener::bind(addr, config)
        .map_err(|e| format!("cannot listen on {addr}: {e}").into())
}

/// `gradwire send`: connect to a receiver and send `count` rounds of a pattern tensor.
pub fn send(a: &SendArgs) -> Res {
    if on_flow(&a.common, a.spray_ports)? {
        send_flow(a)
    } else {
        crate::p2p::send(a)
    }
}

/// `gradwire send` on the flow transport.
fn send_flow(a: &SendArgs) -> Res {
    let c = &a.common;
    let cfg = transfer_config(c)?;
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
    let mut dp = host_datapath(c, bind, 0.0, "send", a.spray_ports)?;
    let mut ctrl = TcpCtrl::connect_with(
        a.to,
        cfg.connect_timeout,
        cfg.control_dscp,
        job_key(c)?.as_ref(),
    )?;
    let stats_file = crate::stats::StatsFile::new("send", c.datapath.name(), "flow");
    let prio = fixed_priority(DATA_TAG);
    let pb = progress(c);
    let start = Instant::now();
    let mut xfers = Vec::new();
    let mut delivered = 0u64;
    for round in 0..c.count {
        // The receiver regenerates the same pattern to verify.
        t.fill_pattern(u64::from(round));
        let s = send_tensor(
            &mut dp,
            &mut ctrl,
            a.to.ip(),
            &t,
            &send_opts(c, round)?,
            &prio,
            &cfg,
        )?;
        let got = s.stats.receiver_segments.unwrap_or(0);
        delivered += (u64::from(got) * t.len_bytes() as u64)
            .checked_div(u64::from(s.segments))
            .unwrap_or(0);
        pb.inc(c.size);
        xfers.push(Xfer {
            index: round + 1,
            segments: s.segments,
            received_segments: got,
            delivered_fraction: if s.segments == 0 {
                1.0
            } else {
                f64::from(got) / f64::from(s.segments)
            },
            rounds: Some(s.stats.passes.saturating_sub(1)),
            fct_us: s.fct.as_secs_f64() * 1e6,
            packets_sent: Some(s.stats.packets),
            retransmitted: Some(s.stats.retransmitted),
            rate_halvings: Some(s.stats.halvings),
            duplicates: None,
            rejected: None,
            invalid: None,
            ended: None,
            verified: None,
        });
        stats_file.write(
            round + 1,
            dp.stats(),
            AfXdpStats::of(&dp),
            RejectCounts::default(),
        );
    }
    pb.finish_and_clear();
    let mut summary = Summary::new(
        "send",
        c.datapath.name(),
        c.dtype.to_string(),
        c.size,
        c.loss_bound,
        c.inject_loss,
        delivered,
        start.elapsed(),
        xfers,
    );
    summary.verified = None;
    summary.afxdp_sender = AfXdpStats::of(&dp);
    summary.print(c.json);
    Ok(())
}

/// `gradwire recv`: accept one sender and receive `count` rounds, verifying the pattern.
pub fn recv(a: &RecvArgs) -> Res {
    if on_flow(&a.common, 1)? {
        recv_flow(a)
    } else {
        crate::p2p::recv(a)
    }
}

/// `gradwire recv` on the flow transport.
fn recv_flow(a: &RecvArgs) -> Res {
    let c = &a.common;
    let cfg = transfer_config(c)?;
    let data = a
        .data
        .unwrap_or_else(|| SocketAddr::new(a.listen.ip(), a.listen.port().wrapping_add(1)));
    // A lone receiver pins to the first of --cores (the demo uses the second).
    pin(c, 0)?;
    let mut dp = host_datapath(c, data, c.inject_loss, "recv", 1)?;
    let stats_file = crate::stats::StatsFile::new("recv", c.datapath.name(), "flow");
    let listener = control_listener(c, &cfg, a.listen)?;
    if !c.json {
        eprintln!(
            "gradwire recv: control on {}, data on {}; waiting for a sender",
            a.listen,
            dp.local_addr()
        );
    }
    if !(a.accept_timeout.is_finite() && a.accept_timeout > 0.0 && a.accept_timeout < 1e9) {
        return Err(format!(
            "--accept-timeout {} must be a positive number of seconds",
            a.accept_timeout
        )
        .into());
    }
    let mut ctrl = listener.accept(Duration::from_secs_f64(a.accept_timeout))?;
    let peer = ctrl.peer_addr();
    if !c.json {
        let how = if ctrl.is_authenticated() {
            "authenticated with the job secret"
        } else {
            "plain job, not authenticated"
        };
        eprintln!("gradwire recv: sender {peer} connected ({how})");
    }
    let mut got = c.tensor()?;
    let mut expect = c.tensor()?;
    let mut rejected = RejectCounts::default();
    let pb = progress(c);
    let start = Instant::now();
    let mut xfers = Vec::new();
    let mut delivered = 0u64;
    for round in 0..c.count {
        let r = recv_tensor(&mut dp, &mut ctrl, &mut got, &recv_opts(c, round)?, &cfg)?;
        expect.fill_pattern(u64::from(round));
        let ok = verify(&r, expect.as_bytes(), got.as_bytes());
        delivered += r.stats.bytes;
        pb.inc(c.size);
        xfers.push(xfer_from(round, &r, None, Some(ok)));
        rejected.add(&r.rejected);
        stats_file.write(round + 1, dp.stats(), AfXdpStats::of(&dp), rejected);
    }
    pb.finish_and_clear();
    let mut summary = Summary::new(
        "recv",
        c.datapath.name(),
        c.dtype.to_string(),
        c.size,
        c.loss_bound,
        c.inject_loss,
        delivered,
        start.elapsed(),
        xfers,
    );
    summary.afxdp_receiver = AfXdpStats::of(&dp);
    summary.print(c.json);
    if summary.verified == Some(false) {
        return Err("some delivered bytes differ from the sender's".into());
    }
    Ok(())
}
