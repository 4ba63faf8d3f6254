//! Only a flow's peer may write a tensor (root only; three namespaces on one bridge).
//!
//! Host 0 sends several rounds of a patterned tensor to host 1 with loss bound 0, so every
//! byte must arrive and is compared; host 2 attacks while the transfers run:
//!
//! - plain job, both datapaths: well-formed data datagrams with valid checksums and the live
//!   flow's ids, from host 2's own address (and the sender's port). Kernel UDP: the receiver's
//!   peer binding drops and counts them (`foreign_source`). AF_XDP: the classifier's
//!   allowlist, filled with the flow's announced sources, drops them before user space.
//! - authenticated job: host 2 takes the sender's address too (spoofed source, the sender's
//!   port), sends forged authenticated datagrams (tags under a key it does not have), and
//!   replays the sender's own datagrams of an earlier round, captured as they were sent.
//!   Every one is refused and counted (`bad_tag`, `stale_round`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Recorder, Sent};

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, AfXdpStats};
use gradwire::auth::{JobKey, JobSecret};
use gradwire::ctrl_channel::TcpCtrl;
use gradwire::ctrl_listener::{CtrlListener, ListenerConfig};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::{fixed_priority, RejectCounts, Tag};
use gradwire::message::LossBound;
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};
use gradwire::wire::header;
use gradwire_netns::{require_root, Testbed, TestbedConfig};

const DATA_PORT: u16 = 7100;
const CTRL_PORT: u16 = 7101;
const JOB: u32 = 3;
const TENSOR: u32 = 9;
const ROUNDS: u32 = 3;
/// 2 MiB of f32 per round.
const ELEMS: usize = 512 * 1024;
/// The attacker's budget: it stops after this many datagrams or seconds, whichever first.
const ATTACK_PACKETS: u64 = 200_000;
const ATTACK_TIME: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Udp,
    Afxdp,
}

fn cfg() -> TransferConfig {
    let mut c = TransferConfig {
        idle_timeout: Duration::from_secs(20),
        ..TransferConfig::default()
    };
    // Slow enough (about 40 ms a round) for the attack to overlap every round.
    c.sender.rate.line_rate_bps = 400_000_000;
    c
}

fn pattern(round: u32) -> Tensor {
    let mut t = Tensor::zeros(DType::F32, ELEMS);
    t.fill_pattern(u64::from(round) + 100);
    t
}

fn datapath(kind: Kind, ip: IpAddr) -> Box<dyn Datapath + Send> {
    let local = SocketAddr::new(ip, DATA_PORT);
    match kind {
        Kind::Udp => Box::new(UdpDatapath::bind(local, UdpConfig::default()).expect("UDP")),
        Kind::Afxdp => {
            let mut c = AfXdpConfig::new("gw0", local);
            c.socket.hugepages = false;
            Box::new(AfXdpDatapath::open(c).expect("AF_XDP datapath"))
        }
    }
}

/// A data datagram with the live flow's ids for full segment `index` (f32 at MTU 1500:
/// 1440 bytes, or 1424 beside the tag), junk payload; `AuthData` with a tag of junk when
/// `auth`. Only peer binding or the tag tells it from the sender's.
fn forged(round: u32, index: u32, auth: bool) -> Vec<u8> {
    let payload: usize = if auth { 1424 } else { 1440 };
    let repr = header::Repr {
        kind: if auth {
            header::Kind::AuthData
        } else {
            header::Kind::Data
        },
        flags: header::Flags::default(),
        pass: 0,
        job_id: JOB,
        tensor_id: TENSOR,
        round,
        offset: u64::from(index) * payload as u64,
        seq: index,
        length: payload as u16,
        layer: 0,
    };
    let tag = if auth { header::TAG_LEN } else { 0 };
    let mut buf = vec![0xEE; header::HEADER_LEN + payload + tag];
    repr.emit(&mut header::Packet::new_unchecked(&mut buf[..]))
        .unwrap();
    buf
}

/// What the attacker sends.
enum Attack {
    /// Forged datagrams for every round, plain or authenticated.
    Forge { auth: bool },
    /// Forged authenticated datagrams, then replays of the captured datagrams of round 0
    /// once the sender has finished it.
    ForgeAndReplay {
        captured: Arc<Mutex<Vec<Sent>>>,
        /// Cleared when round 0 is over: the capture is complete.
        recording: Arc<AtomicBool>,
    },
}

/// Host 2 attacks from `from` until `stop` (or its budget runs out); returns datagrams sent.
fn attack(
    tb: &Testbed,
    from: SocketAddr,
    to: SocketAddr,
    what: Attack,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64)> {
    tb.spawn_in(2, move || {
        let s = UdpSocket::bind(from).expect("attacker socket");
        let mut replays = 0u64;
        let start = Instant::now();
        let mut sent = 0u64;
        let mut i = 0u32;
        while !stop.load(Ordering::Relaxed)
            && sent < ATTACK_PACKETS
            && start.elapsed() < ATTACK_TIME
        {
            let batch: Vec<Vec<u8>> = match &what {
                Attack::Forge { auth } => (0..ROUNDS).map(|r| forged(r, i % 64, *auth)).collect(),
                Attack::ForgeAndReplay {
                    captured,
                    recording,
                } => {
                    let mut b = vec![forged(1, i % 64, true), forged(2, i % 64, true)];
                    if !recording.load(Ordering::Acquire) {
                        let c = captured.lock().unwrap();
                        if !c.is_empty() {
                            let replay = c[i as usize % c.len()].0.clone();
                            // As captured, and with the round field rewritten to the
                            // rounds being received now (the header is authenticated).
                            for round in [1u32, 2] {
                                let mut r = replay.clone();
                                r[12..16].copy_from_slice(&round.to_be_bytes());
                                b.push(r);
                            }
                            b.push(replay);
                            replays += 3;
                        }
                    }
                    b
                }
            };
            for d in &batch {
                // A full socket buffer or ICMP-refused port is fine: keep trying.
                if s.send_to(d, to).is_ok() {
                    sent += 1;
                }
            }
            i = i.wrapping_add(1);
            if i % 16 == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        (sent, replays)
    })
    .unwrap()
}

struct Outcome {
    rejected: RejectCounts,
    rx_stats: Option<AfXdpStats>,
    attack_sent: u64,
    /// Of those, replays of the sender's captured round-0 datagrams.
    replays_sent: u64,
}

/// ROUNDS transfers host 0 -> host 1 under `what` from `from`; every round's bytes must be
/// exactly the pattern.
fn run(
    tb: &Testbed,
    kind: Kind,
    secret: Option<&'static [u8]>,
    from: SocketAddr,
    what: impl FnOnce(Arc<Mutex<Vec<Sent>>>, Arc<AtomicBool>) -> Attack,
) -> Outcome {
    let rx_ip = IpAddr::V4(tb.host(1).ipv4);
    let tx_ip = IpAddr::V4(tb.host(0).ipv4);
    let key = |s: Option<&[u8]>| s.map(|s| JobKey::new(&JobSecret::new(s.to_vec()).unwrap()));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let receiver = tb
        .spawn_in(1, move || {
            let listener = CtrlListener::bind(
                SocketAddr::new(rx_ip, CTRL_PORT),
                ListenerConfig {
                    key: key(secret),
                    ..ListenerConfig::default()
                },
            )
            .unwrap();
            let dp = datapath(kind, rx_ip);
            ready_tx.send(()).unwrap();
            let ctrl = listener.accept(Duration::from_secs(20)).unwrap();
            let mut r = Receiver::with_channel(ctrl, dp, cfg()).unwrap();
            let mut rejected = RejectCounts::default();
            for round in 0..ROUNDS {
                let mut got = Tensor::zeros(DType::F32, ELEMS);
                let opts = RecvOptions {
                    round: Some(round),
                    loss_bound: Some(LossBound::RELIABLE),
                    ..RecvOptions::new(JOB, TENSOR)
                };
                let rep = r.recv(&mut got, &opts).unwrap();
                assert!(
                    got.as_bytes() == pattern(round).as_bytes(),
                    "round {round}: the received tensor differs from the sender's"
                );
                rejected.add(&rep.rejected);
            }
            (rejected, AfXdpStats::of(r.datapath()))
        })
        .unwrap();
    ready_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("receiver never got ready");
    let captured = Arc::new(Mutex::new(Vec::new()));
    let recording = Arc::new(AtomicBool::new(true));
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = attack(
        tb,
        from,
        SocketAddr::new(rx_ip, DATA_PORT),
        what(captured.clone(), recording.clone()),
        stop.clone(),
    );
    let sender = tb
        .spawn_in(0, move || {
            // The attacker's capture: the sender's own datagrams of round 0.
            let dp = Recorder {
                recorded: captured,
                recording: recording.clone(),
                ..Recorder::new(datapath(kind, tx_ip))
            };
            let k = key(secret);
            let ctrl = TcpCtrl::connect_with(
                SocketAddr::new(rx_ip, CTRL_PORT),
                Duration::from_secs(10),
                None,
                k.as_ref(),
            )
            .unwrap();
            let mut s = Sender::with_channel(ctrl, dp, cfg()).unwrap();
            let prio = fixed_priority(Tag {
                dscp: 10,
                ect: false,
            });
            for round in 0..ROUNDS {
                let opts = SendOptions {
                    round,
                    loss_bound: Some(LossBound::RELIABLE),
                    ..SendOptions::new(JOB, TENSOR)
                };
                s.send(&pattern(round), &opts, &prio).unwrap();
                recording.store(false, Ordering::Release);
            }
        })
        .unwrap();
    let sent = sender.join();
    let received = receiver.join();
    stop.store(true, Ordering::Relaxed);
    let (attack_sent, replays_sent) = attacker.join().expect("attacker panicked");
    sent.expect("sender panicked");
    let (rejected, rx_stats) = received.expect("receiver panicked");
    Outcome {
        rejected,
        rx_stats,
        attack_sent,
        replays_sent,
    }
}

#[test]
fn a_third_host_never_writes_a_tensor() {
    if !require_root("peer binding") {
        return;
    }
    let tb = Testbed::up(&TestbedConfig {
        hosts: 3,
        ..TestbedConfig::default()
    })
    .expect("testbed");
    let attacker = SocketAddr::new(IpAddr::V4(tb.host(2).ipv4), DATA_PORT);
    for kind in [Kind::Udp, Kind::Afxdp] {
        let o = run(&tb, kind, None, attacker, |_, _| Attack::Forge {
            auth: false,
        });
        assert!(
            o.attack_sent > 100,
            "{kind:?}: the attacker sent only {}",
            o.attack_sent
        );
        match kind {
            Kind::Udp => assert!(
                o.rejected.foreign_source > 0,
                "{kind:?}: no forged datagram reached the receiver's check: {:?}",
                o.rejected
            ),
            Kind::Afxdp => {
                // Dropped in XDP: user space never saw one.
                let xdp = o
                    .rx_stats
                    .as_ref()
                    .and_then(|s| s.xdp.clone())
                    .expect("XDP counters");
                assert!(xdp.drop_not_allowed.packets > 0, "{xdp:?}");
                assert_eq!(o.rejected.foreign_source, 0, "{:?}", o.rejected);
            }
        }
        eprintln!(
            "{kind:?}: attacker sent {}, receiver refused {}, XDP dropped {:?}",
            o.attack_sent,
            o.rejected,
            o.rx_stats
                .and_then(|s| s.xdp)
                .map(|x| x.drop_not_allowed.packets)
        );
    }
    tb.down().expect("teardown");
}

#[test]
fn an_authenticated_job_refuses_spoofed_sources_and_replays() {
    if !require_root("authenticated job") {
        return;
    }
    let tb = Testbed::up(&TestbedConfig {
        hosts: 3,
        ..TestbedConfig::default()
    })
    .expect("testbed");
    // Host 2 takes host 0's address as well: its datagrams carry the sender's source
    // address and port, which peer binding alone cannot tell apart.
    let sender_ip = tb.host(0).ipv4;
    let ns = tb.host(2).netns.clone();
    let cidr = format!("{sender_ip}/32");
    gradwire_netns::cmd::ip(
        Some(&ns),
        &["-n", &ns, "addr", "add", &cidr, "dev", &tb.host(2).ifname],
    )
    .expect("spoofed address");
    let spoofed = SocketAddr::new(IpAddr::V4(sender_ip), DATA_PORT);
    let o = run(
        &tb,
        Kind::Udp,
        Some(b"the job secret: 32 random bytes!"),
        spoofed,
        |captured, recording| Attack::ForgeAndReplay {
            captured,
            recording,
        },
    );
    eprintln!(
        "authenticated: attacker sent {} ({} replays), receiver refused {}",
        o.attack_sent, o.replays_sent, o.rejected
    );
    assert!(
        o.attack_sent > 100,
        "the attacker sent only {}",
        o.attack_sent
    );
    // Forged tags under a key the attacker does not have.
    assert!(o.rejected.bad_tag > 0, "{:?}", o.rejected);
    // Round 0's captured datagrams were replayed while rounds 1 and 2 ran, as captured and
    // with the round rewritten: the bytes of every round matched its own pattern (checked by
    // the receiver), so not one was placed; they are refused as stale rounds or bad tags.
    assert!(
        o.replays_sent > 0,
        "no replay was sent during rounds 1 and 2"
    );
    assert!(o.rejected.stale_round > 0, "{:?}", o.rejected);
    tb.down().expect("teardown");
}
