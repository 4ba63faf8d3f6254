//! The control listener under attack, and the handshake's authentication end to end.
//!
//! 1. In namespaces (root): host 1 receives a patterned 4 MiB tensor from host 0 through a
//!    [`CtrlListener`] while host 2 floods the control port with idle connections, garbage,
//!    huge length prefixes, Hellos followed by silence and a byte-per-100 ms slow loris. The
//!    transfer completes byte for byte, the listener counts (and logs) every drop, and once
//!    the flood stops and the handshake timeout passes, no descriptor is left behind. Plain
//!    and authenticated listeners.
//! 2. On 127.0.0.1: senders without the secret, with another secret, or with one towards a
//!    plain receiver are refused with a clear error on the sender's side and counted on the
//!    listener; matching secrets connect and messages round-trip sealed.
//! 3. On 127.0.0.1: a proxy that flips one byte of a sealed frame after the handshake makes the
//!    receiving end fail with `BadSeal` instead of accepting the message.
//!
//! The tests take one lock: they count the process's open descriptors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradwire::ctrl_channel::{ChannelError, CtrlChannel, TcpCtrl};
use gradwire::ctrl_listener::{CtrlListener, ListenerConfig, ListenerStats};
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::flow::{fixed_priority, SenderConfig, Tag};
use gradwire::message::{CtrlError, CtrlMsg, LossBound};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{Receiver, RecvOptions, SendOptions, Sender, TransferConfig};
use gradwire_netns::privilege::require_root;
use gradwire_netns::testbed::{Testbed, TestbedConfig};
use gradwire_proto::auth::{JobKey, JobSecret};

const CTRL_PORT: u16 = 7400;
const DATA_PORT: u16 = 7401;
/// 4 MiB of f32.
const ELEMS: usize = 1 << 20;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// One test at a time: they count the process's descriptors.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts the listener's log lines (one per dropped connection) and keeps a few.
struct CountingLogger {
    lines: AtomicU64,
    samples: Mutex<Vec<String>>,
}

static LOGGER: CountingLogger = CountingLogger {
    lines: AtomicU64::new(0),
    samples: Mutex::new(Vec::new()),
};

impl log::Log for CountingLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.target().starts_with("gradwire::ctrl_listener")
    }

    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let line = r.args().to_string();
            if line.contains(": dropped ") {
                self.lines.fetch_add(1, Ordering::Relaxed);
            }
            let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
            if s.len() < 4000 {
                s.push(line);
            }
        }
    }

    fn flush(&self) {}
}

fn install_logger() {
    // Fails only when already installed (by an earlier test in this process).
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Warn);
}

fn secret(fill: u8) -> JobKey {
    JobKey::new(&JobSecret::new(vec![fill; 32]).unwrap())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits (bounded) until `f` holds, returning its last value.
fn wait_until<T>(what: &str, limit: Duration, mut f: impl FnMut() -> (bool, T)) -> T {
    let deadline = Instant::now() + limit;
    loop {
        let (ok, v) = f();
        if ok {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pattern(seed: u64) -> Tensor {
    let mut t = Tensor::zeros(DType::F32, ELEMS);
    t.fill_pattern(seed);
    t
}

fn transfer_cfg() -> TransferConfig {
    TransferConfig {
        idle_timeout: Duration::from_secs(20),
        sender: SenderConfig::new(2_000_000_000),
        ..TransferConfig::default()
    }
}

/// What host 2 sent.
#[derive(Debug, Default)]
struct FloodCounts {
    idle: AtomicU64,
    garbage: AtomicU64,
    huge_prefix: AtomicU64,
    hello_then_silence: AtomicU64,
    slow_loris: AtomicU64,
}

impl FloodCounts {
    fn total(&self) -> u64 {
        [
            &self.idle,
            &self.garbage,
            &self.huge_prefix,
            &self.hello_then_silence,
            &self.slow_loris,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

fn connect(to: SocketAddr) -> Option<TcpStream> {
    TcpStream::connect_timeout(&to, Duration::from_secs(1)).ok()
}

fn hello_frame(auth: bool) -> Vec<u8> {
    CtrlMsg::Hello {
        auth,
        nonce: [0x42; 32],
        // A valid point is not needed: the attacker never gets past the Challenge.
        public: [0x43; 32],
    }
    .to_frame()
    .unwrap()
}

/// Host 2's attackers, each its own thread in host 2's namespace, all bounded: they stop on
/// `stop` or after `limit`, and close every socket they opened when they return.
fn flood(
    tb: &Testbed,
    to: SocketAddr,
    auth_listener: bool,
    stop: &Arc<AtomicBool>,
    counts: &Arc<FloodCounts>,
) -> Vec<JoinHandle<()>> {
    let limit = Duration::from_secs(60);
    let mut hs = Vec::new();
    let go = |f: Box<dyn FnOnce() + Send>| tb.spawn_in(2, f).unwrap();

    // Hundreds of idle connections: a burst of 300 (more than the listener's 64 handshake
    // slots: evictions), then held and churned (oldest closed, one opened) every 100 ms, a
    // rate at which the slots outlive the handshake timeout (timeouts).
    let (s, c) = (Arc::clone(stop), Arc::clone(counts));
    hs.push(go(Box::new(move || {
        let t0 = Instant::now();
        let mut held = std::collections::VecDeque::new();
        while !s.load(Ordering::Relaxed) && t0.elapsed() < limit {
            if let Some(st) = connect(to) {
                c.idle.fetch_add(1, Ordering::Relaxed);
                held.push_back(st);
            }
            if held.len() > 300 {
                held.pop_front();
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    })));

    // Garbage bytes and huge length prefixes, one connection each every 10 ms, held until
    // the listener closes them.
    let (s, c) = (Arc::clone(stop), Arc::clone(counts));
    hs.push(go(Box::new(move || {
        let t0 = Instant::now();
        let mut held = Vec::new();
        let mut i = 0u64;
        while !s.load(Ordering::Relaxed) && t0.elapsed() < limit {
            if let Some(mut st) = connect(to) {
                let bytes: Vec<u8> = if i % 2 == 0 {
                    c.garbage.fetch_add(1, Ordering::Relaxed);
                    // A plausible length, then junk.
                    let mut b = vec![0, 0, 0, 40];
                    b.extend((0..40).map(|j| (i as u8).wrapping_mul(31).wrapping_add(j)));
                    b
                } else {
                    c.huge_prefix.fetch_add(1, Ordering::Relaxed);
                    let mut b = u32::MAX.to_be_bytes().to_vec();
                    b.extend([0xAA; 64]);
                    b
                };
                let _ = st.write_all(&bytes);
                held.push(st);
            }
            i += 1;
            held.truncate(64);
            std::thread::sleep(Duration::from_millis(10));
        }
    })));

    // A Hello then silence, one every 100 ms. On an authenticated listener the Hello asks for
    // authentication and the Proof never comes; on a plain one (where a plain Hello would
    // complete the handshake) half a Hello arrives and the rest never does.
    let (s, c) = (Arc::clone(stop), Arc::clone(counts));
    hs.push(go(Box::new(move || {
        let t0 = Instant::now();
        let mut held = Vec::new();
        while !s.load(Ordering::Relaxed) && t0.elapsed() < limit {
            if let Some(mut st) = connect(to) {
                c.hello_then_silence.fetch_add(1, Ordering::Relaxed);
                let hello = if auth_listener {
                    hello_frame(true)
                } else {
                    hello_frame(false)[..20].to_vec()
                };
                let _ = st.write_all(&hello);
                held.push(st);
            }
            held.truncate(100);
            std::thread::sleep(Duration::from_millis(100));
        }
    })));

    // Slow loris: 8 connections sending a Hello one byte per 100 ms each (71 bytes: 7.1 s,
    // longer than the handshake timeout); a connection the listener closed is replaced.
    let (s, c) = (Arc::clone(stop), Arc::clone(counts));
    hs.push(go(Box::new(move || {
        let t0 = Instant::now();
        let hello = hello_frame(auth_listener);
        let mut conns: Vec<(TcpStream, usize)> = Vec::new();
        while !s.load(Ordering::Relaxed) && t0.elapsed() < limit {
            while conns.len() < 8 {
                match connect(to) {
                    Some(st) => {
                        c.slow_loris.fetch_add(1, Ordering::Relaxed);
                        conns.push((st, 0));
                    }
                    None => break,
                }
            }
            conns.retain_mut(|(st, sent)| {
                if *sent >= hello.len() {
                    return false;
                }
                let ok = st.write_all(&hello[*sent..*sent + 1]).is_ok();
                *sent += 1;
                ok
            });
            std::thread::sleep(Duration::from_millis(100));
        }
    })));
    hs
}

/// Host 1 receives, host 0 sends, host 2 floods; then checks bytes, counters and descriptors.
fn transfer_under_flood(auth: bool) {
    let name = if auth {
        "ctrl_listener flood (authenticated)"
    } else {
        "ctrl_listener flood (plain)"
    };
    if !require_root(name) {
        return;
    }
    let _serial = serial();
    install_logger();
    let tb = Testbed::up(&TestbedConfig::with_hosts(3)).expect("testbed");
    let (ip0, ip1) = (IpAddr::V4(tb.host(0).ipv4), IpAddr::V4(tb.host(1).ipv4));
    let ctrl_addr = SocketAddr::new(ip1, CTRL_PORT);
    let cfg = ListenerConfig {
        key: auth.then(|| secret(7)),
        handshake_timeout: HANDSHAKE_TIMEOUT,
        ..ListenerConfig::default()
    };
    let listener = Arc::new(
        tb.run_in(1, move || CtrlListener::bind(ctrl_addr, cfg))
            .unwrap()
            .expect("listener"),
    );
    let logged_before = LOGGER.lines.load(Ordering::Relaxed);
    let fds_before = open_fds();

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(FloodCounts::default());
    let flooders = flood(&tb, ctrl_addr, auth, &stop, &counts);
    // Stops the flood however this test ends, so no thread outlives it.
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop_guard = StopOnDrop(Arc::clone(&stop));

    // The flood is at full strength: more connections than handshake slots.
    wait_until("flood at full strength", Duration::from_secs(20), || {
        let s = listener.stats();
        (s.evicted > 0 && s.malformed > 0, ())
    });

    let l = Arc::clone(&listener);
    let receiver = tb
        .spawn_in(1, move || {
            let ctrl = l.accept(Duration::from_secs(30)).expect("a sender");
            let dp =
                UdpDatapath::bind(SocketAddr::new(ip1, DATA_PORT), UdpConfig::default()).unwrap();
            let mut r = Receiver::with_channel(ctrl, dp, transfer_cfg()).unwrap();
            let mut got = Tensor::zeros(DType::F32, ELEMS);
            got.as_bytes_mut().fill(0x5A);
            let report = r.recv(&mut got, &RecvOptions::new(3, 9)).expect("receive");
            (report, got)
        })
        .unwrap();
    let sender_key = auth.then(|| secret(7));
    let sender = tb
        .spawn_in(0, move || {
            let t0 = Instant::now();
            // A real client retries a connection the listener dropped (evicted by the flood).
            let mut attempts = 0u64;
            let ctrl = loop {
                attempts += 1;
                match TcpCtrl::connect_with(ctrl_addr, HANDSHAKE_TIMEOUT, None, sender_key.as_ref())
                {
                    Ok(c) => break c,
                    Err(e) => {
                        assert!(
                            attempts < 20,
                            "no connection after {attempts} attempts: {e}"
                        );
                        eprintln!("sender: attempt {attempts} failed: {e}");
                    }
                }
            };
            assert_eq!(ctrl.is_authenticated(), sender_key.is_some());
            let dp = UdpDatapath::bind(SocketAddr::new(ip0, 0), UdpConfig::default()).unwrap();
            let mut s = Sender::with_channel(ctrl, dp, transfer_cfg()).unwrap();
            let opts = SendOptions {
                loss_bound: Some(LossBound::RELIABLE),
                ..SendOptions::new(3, 9)
            };
            let prio = fixed_priority(Tag {
                dscp: 10,
                ect: false,
            });
            let report = s.send(&pattern(0xC0FFEE), &opts, &prio).expect("send");
            (report, attempts, t0.elapsed())
        })
        .unwrap();
    let (sent, attempts, took) = sender.join().expect("sender thread");
    let (report, got) = receiver.join().expect("receiver thread");
    let during = listener.stats();
    // Let the flood go on until handshakes have timed out too (slow loris, Hellos without
    // the rest), not only been evicted.
    wait_until("handshakes timing out", Duration::from_secs(15), || {
        (listener.stats().timed_out >= 8, ())
    });

    drop(stop_guard);
    for f in flooders {
        f.join().expect("flood thread");
    }
    let opened = counts.total();

    // Bytes exact.
    assert_eq!(report.received_segments, report.segments);
    assert_eq!(sent.segments, report.segments);
    assert!(
        got.as_bytes() == pattern(0xC0FFEE).as_bytes(),
        "received tensor differs from the sent pattern"
    );

    // Every flood connection is gone once the handshake timeout passed.
    let after = wait_until(
        "no handshake pending",
        HANDSHAKE_TIMEOUT + Duration::from_secs(3),
        || {
            let s = listener.stats();
            (s.pending == 0, s)
        },
    );
    let fds_after = wait_until(
        "descriptors back to the baseline",
        Duration::from_secs(5),
        || {
            let n = open_fds();
            (n == fds_before, n)
        },
    );
    let dropped = dropped(&after);
    let logged = LOGGER.lines.load(Ordering::Relaxed) - logged_before;
    eprintln!(
        "{name}: flood opened {opened} connections ({counts:?}); listener {after:?}; \
         {logged} log lines; sender connected after {attempts} attempt(s), transfer of \
         {} MiB took {took:?}; fds before {fds_before} after {fds_after}; stats during the \
         transfer {during:?}",
        (ELEMS * 4) >> 20
    );
    assert_eq!(after.accepted, 1, "only the sender completed a handshake");
    assert!(after.evicted > 0 && after.timed_out > 0 && after.malformed > 0);
    if auth {
        // Hellos without a Proof time out; nothing is refused (the flood sends none).
        assert_eq!(after.refused, 0);
    }
    // Every connection the flood opened was dropped (counted as closed when the flood's own
    // close came first), and so was every failed attempt of the sender.
    assert_eq!(
        dropped,
        opened + attempts - 1,
        "{after:?} vs {opened} opened and {attempts} attempts"
    );
    assert_eq!(logged, dropped, "one log line per dropped connection");
    let samples = LOGGER.samples.lock().unwrap();
    // A handshake that timed out says what it waited for: the Hello (idle, slow) or, on an
    // authenticated listener, the Proof (Hello then silence); which of those time out rather
    // than being evicted depends on timing, so on an authenticated listener either counts.
    let timed_out =
        |l: &str| l.contains("no Hello within 2s") || (auth && l.contains("no Proof within 2s"));
    assert!(
        samples.iter().any(|l| timed_out(l)),
        "no log line of a handshake that timed out"
    );
    for want in ["garbage: ", "evicted: 64 handshakes pending"] {
        assert!(
            samples.iter().any(|l| l.contains(want)),
            "no log line with {want:?}"
        );
    }
    drop(samples);
    drop(listener);
    tb.down().expect("teardown");
}

fn dropped(s: &ListenerStats) -> u64 {
    s.timed_out + s.malformed + s.refused + s.evicted + s.closed + s.queue_full
}

#[test]
fn plain_transfer_completes_under_a_control_port_flood() {
    transfer_under_flood(false);
}

#[test]
fn authenticated_transfer_completes_under_a_control_port_flood() {
    transfer_under_flood(true);
}

fn local_listener(key: Option<JobKey>) -> CtrlListener {
    CtrlListener::bind(
        "127.0.0.1:0".parse().unwrap(),
        ListenerConfig {
            key,
            ..ListenerConfig::default()
        },
    )
    .unwrap()
}

fn refusal(r: Result<TcpCtrl, ChannelError>) -> String {
    match r {
        Err(e @ ChannelError::Refused { .. }) => e.to_string(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn rendezvous_refuses_senders_without_the_secret() {
    let _serial = serial();
    let t = Duration::from_secs(5);
    let good = secret(1);
    let authed = local_listener(Some(secret(1)));
    let addr = authed.local_addr();

    let e = refusal(TcpCtrl::connect(addr, t, None));
    assert!(
        e.contains(
            "this receiver requires an authenticated job: start the sender with the job's \
             secret (GRADWIRE_JOB_SECRET or --secret-file)"
        ),
        "{e}"
    );
    let wrong = secret(2);
    let e = refusal(TcpCtrl::connect_with(addr, t, None, Some(&wrong)));
    assert!(
        e.contains(
            "job secret mismatch: the sender's proof does not verify with the receiver's job \
             secret"
        ),
        "{e}"
    );
    let s = wait_until("both refusals counted", t, || {
        let s = authed.stats();
        (s.refused == 2, s)
    });
    assert_eq!((s.accepted, s.pending), (0, 0));

    let plain = local_listener(None);
    let e = refusal(TcpCtrl::connect_with(
        plain.local_addr(),
        t,
        None,
        Some(&good),
    ));
    assert!(e.contains("runs without a job secret"), "{e}");
    wait_until("refusal counted", t, || (plain.stats().refused == 1, ()));

    // Matching secrets: connected, authenticated, messages round-trip sealed.
    let same = secret(1);
    let mut c = TcpCtrl::connect_with(addr, t, None, Some(&same)).unwrap();
    let mut s = authed.accept(t).unwrap();
    assert!(c.is_authenticated() && s.is_authenticated());
    c.send(&CtrlMsg::FlowStop {
        pass: 1,
        segments_sent: 2,
    })
    .unwrap();
    assert_eq!(
        s.recv(t).unwrap(),
        Some(CtrlMsg::FlowStop {
            pass: 1,
            segments_sent: 2
        })
    );
    s.send(&CtrlMsg::FlowFinish {
        received_segments: 2,
    })
    .unwrap();
    assert_eq!(
        c.recv(t).unwrap(),
        Some(CtrlMsg::FlowFinish {
            received_segments: 2
        })
    );
    assert_eq!(authed.stats().accepted, 1);
}

/// Forwards `from` to `to` until either closes or `stop`; XORs the byte at stream offset
/// `flip` (if any) with 0x01.
fn pump(mut from: TcpStream, mut to: TcpStream, flip: Option<u64>, stop: Arc<AtomicBool>) {
    from.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let mut offset = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        if let Some(f) = flip {
            if (offset..offset + n as u64).contains(&f) {
                buf[(f - offset) as usize] ^= 0x01;
            }
        }
        offset += n as u64;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// A proxy between a client and `upstream` that flips the byte at `c2s` of the
/// client-to-server stream or `s2c` of the other direction.
fn tampering_proxy(
    upstream: SocketAddr,
    c2s: Option<u64>,
    s2c: Option<u64>,
    stop: &Arc<AtomicBool>,
) -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::clone(stop);
    let h = std::thread::spawn(move || {
        l.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < deadline && !stop.load(Ordering::Relaxed) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(_) => return,
            }
        };
        client.set_nonblocking(false).unwrap();
        let server = TcpStream::connect(upstream).unwrap();
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let st = Arc::clone(&stop);
        let a = std::thread::spawn(move || pump(client, server, c2s, st));
        pump(s2, c2, s2c, stop);
        a.join().unwrap();
    });
    (addr, h)
}

/// Bytes of the handshake on the wire: Hello (4 + 2 + 1 + 32 + 32) and Proof (4 + 2 + 32)
/// from the client; Challenge (4 + 2 + 32 + 32) and the sealed Welcome (4 + 2 + 1 + 32, then
/// 16) from the server.
const C2S_HANDSHAKE: u64 = 71 + 38;
const S2C_HANDSHAKE: u64 = 70 + 55;

#[test]
fn a_flipped_byte_in_a_sealed_frame_is_bad_seal_not_a_message() {
    let _serial = serial();
    let t = Duration::from_secs(5);
    let k = secret(3);
    let listener = local_listener(Some(secret(3)));
    let msg = CtrlMsg::FlowStop {
        pass: 7,
        segments_sent: 1000,
    };
    // FlowStop is 14 bytes on the wire (prefix 4, body 10), then its 16-byte tag. Client to
    // server: flip a byte of the first sealed frame's body (its pass); server to client: a
    // byte of the first sealed frame's tag after the Welcome.
    for (c2s, s2c) in [
        (Some(C2S_HANDSHAKE + 6), None),
        (None, Some(S2C_HANDSHAKE + 14 + 3)),
    ] {
        let stop = Arc::new(AtomicBool::new(false));
        let (proxy, h) = tampering_proxy(listener.local_addr(), c2s, s2c, &stop);
        let c = TcpCtrl::connect_with(proxy, t, None, Some(&k)).expect("handshake intact");
        let s = listener.accept(t).unwrap();
        let (mut from, mut to) = if c2s.is_some() { (c, s) } else { (s, c) };
        from.send(&msg).unwrap();
        match to.recv(t) {
            Err(ChannelError::Malformed {
                source: CtrlError::BadSeal,
                ..
            }) => {}
            other => panic!("tampered frame: expected BadSeal, got {other:?}"),
        }
        // Sticky: the next (intact) frame is not read either.
        from.send(&msg).unwrap();
        assert!(matches!(
            to.recv(t),
            Err(ChannelError::Malformed {
                source: CtrlError::BadSeal,
                ..
            })
        ));
        stop.store(true, Ordering::Relaxed);
        drop((from, to));
        h.join().unwrap();
    }
    // Without the proxy the same message goes through.
    let mut c = TcpCtrl::connect_with(listener.local_addr(), t, None, Some(&k)).unwrap();
    let mut s = listener.accept(t).unwrap();
    c.send(&msg).unwrap();
    assert_eq!(s.recv(t).unwrap(), Some(msg));
}
