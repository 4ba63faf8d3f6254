//! The `gradwire` binary end to end: demo on every datapath, send/recv between two
//! processes on a loopback address (on the message layer, and authenticated on the flow
//! transport), peer binding against a stranger, and clear errors for bad input or a peer
//! that never comes or dies.

#![allow(clippy::unwrap_used)]

mod common;

use common::{gradwire, ChildGuard};

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Whether some socket listens on TCP `addr` of this network namespace (the kernel's own
/// table, `/proc/net/tcp`: the local address as hex of the address in memory order, then
/// the port; state `0A` is LISTEN). Looking does not connect, so the listener's single
/// `accept` is left for the real peer.
fn tcp_listening(addr: SocketAddrV4) -> bool {
    let want = format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(addr.ip().octets()),
        addr.port()
    );
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.get(1) == Some(&want.as_str()) && f.get(3) == Some(&"0A")
    })
}

/// Waits until `child` listens on `addr`, at most 20 s; fails at once with the child's
/// output if it exits first.
fn wait_listening(child: &mut ChildGuard, addr: SocketAddrV4) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tcp_listening(addr) {
        if let Some(status) = child.child().try_wait().unwrap() {
            let out = child.0.take().unwrap().wait_with_output().unwrap();
            panic!(
                "receiver exited ({status}) before listening: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            Instant::now() < deadline,
            "receiver never listened on {addr}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where a test's receiver listens (TCP `port`, UDP data on `port + 1`): a loopback address
/// of this process alone (its id in the low 22 bits of 127.64.0.0/10) and a fixed port per
/// test, below the ephemeral range, so nothing else listens or connects from there. Nothing
/// is found free and bound again later: parallel tests and other runs cannot take it.
fn own_addr(port: u16) -> SocketAddrV4 {
    let pid = std::process::id() & 0x3f_ffff;
    SocketAddrV4::new(Ipv4Addr::from(0x7f40_0000 | pid), port)
}

/// Data segments resent over every transfer of a report.
fn retransmitted(v: &serde_json::Value) -> u64 {
    v["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["retransmitted"].as_u64().unwrap())
        .sum()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn demo_json_over_both_datapaths() {
    for dp in ["loopback", "udp"] {
        let out = gradwire(&[
            "demo",
            "--datapath",
            dp,
            "--size",
            "4MiB",
            "--count",
            "3",
            "--inject-loss",
            "0.05",
            "--loss-bound",
            "0.01",
            "--json",
        ]);
        let v = json(&out);
        assert_eq!(v["datapath"], dp);
        assert_eq!(v["protocol"], "msg");
        assert_eq!(v["size_bytes"], 4 << 20);
        assert_eq!(v["loss_bound"], 0.01);
        assert!(v["delivered_fraction"].as_f64().unwrap() >= 0.99);
        // The layer resends as soon as it sees a gap, mostly within the first pass, so the
        // resent segments (not the passes) say that 5% loss was repaired down to 1%.
        assert!(
            retransmitted(&v) >= 1,
            "5% loss cannot meet 1% without resending: {v}"
        );
        // The receiving endpoint injected the loss.
        let drops = v["endpoint_receiver"]["injected_drops"].as_u64().unwrap();
        assert!(drops > 0, "{v}");
        assert!(v["goodput_gbps"].as_f64().unwrap() > 0.0);
        assert!(v["fct_p99_us"].as_f64().unwrap() >= v["fct_p50_us"].as_f64().unwrap());
        assert_eq!(v["verified"], true);
        assert_eq!(v["transfers"].as_array().unwrap().len(), 3);
    }
}

#[test]
fn demo_table_and_f16_reliable() {
    let out = gradwire(&[
        "demo",
        "--datapath",
        "loopback",
        "--size",
        "1000000",
        "--count",
        "2",
        "--dtype",
        "f16",
        "--loss-bound",
        "0",
        "--inject-loss",
        "0.1",
        "--keep-missing",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("summary: delivered min 100.000%"), "{text}");
    assert!(text.contains("every delivered byte verified"), "{text}");
}

#[test]
fn send_and_recv_between_two_processes() {
    let addr = own_addr(7_101);
    let listen = addr.to_string();
    let common = [
        "--size",
        "8MiB",
        "--count",
        "3",
        "--loss-bound",
        "0.02",
        "--json",
        "--timeout",
        "20",
    ];
    let mut recv = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(["recv", "--listen", &listen, "--inject-loss", "0.05"])
            .args(["--accept-timeout", "20"])
            .args(common)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    // One send, once the receiver listens (it prints nothing before that in --json mode, so
    // the kernel's socket table says when).
    wait_listening(&mut recv, addr);
    let send = gradwire(&[&["send", "--to", &listen][..], &common[..]].concat());
    // A failed send fails here, and the guard ends the receiver.
    let s = json(&send);
    let rout = recv.wait_with_output();
    let r = json(&rout);
    assert_eq!(s["role"], "send");
    assert_eq!(r["role"], "recv");
    assert_eq!(
        (&s["protocol"], &r["protocol"]),
        (&"msg".into(), &"msg".into())
    );
    assert_eq!(
        r["verified"], true,
        "receiver checked every delivered byte against the pattern"
    );
    assert!(r["delivered_fraction"].as_f64().unwrap() >= 0.98);
    assert!(s["delivered_fraction"].as_f64().unwrap() >= 0.98);
    assert_eq!(r["count"], 3);
}

#[test]
fn bad_input_gets_a_clear_error() {
    let out = gradwire(&["demo", "--loss-bound", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a probability"));

    let out = gradwire(&["demo", "--size", "10", "--dtype", "f32", "--count", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a whole number of f32 elements"));

    let out = gradwire(&["send", "--to", "127.0.0.1:9", "--datapath", "loopback"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use --datapath udp"));

    let out = gradwire(&["demo", "--mtu", "40", "--count", "1", "--size", "4KiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mtu"));
    // ... and on the flow transport too.
    let out = gradwire(&[
        "demo",
        "--transport",
        "flow",
        "--mtu",
        "40",
        "--count",
        "1",
        "--size",
        "4KiB",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mtu"));

    // Nobody listens there: a clear connection error, quickly.
    let addr = own_addr(7_103);
    let out = gradwire(&[
        "send",
        "--to",
        &addr.to_string(),
        "--size",
        "4KiB",
        "--count",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("set-up connection to {addr}")) && err.contains("refused"),
        "{err}"
    );

    // Nobody connects: a clear error after the accept timeout, not a hang.
    let out = gradwire(&[
        "recv",
        "--listen",
        &addr.to_string(),
        "--accept-timeout",
        "0.3",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no sender set a run up") && err.contains("--accept-timeout"),
        "{err}"
    );
}

#[test]
fn demo_over_afxdp_in_namespaces() {
    if !gradwire_netns::require_root("demo_over_afxdp_in_namespaces") {
        return;
    }
    let out = gradwire(&[
        "demo",
        "--datapath",
        "afxdp",
        "--size",
        "8MiB",
        "--count",
        "3",
        "--inject-loss",
        "0.05",
        "--loss-bound",
        "0.01",
        "--no-hugepages",
        "--json",
    ]);
    let v = json(&out);
    assert_eq!(v["datapath"], "afxdp");
    assert_eq!(v["protocol"], "msg");
    assert_eq!(v["verified"], true);
    assert!(v["delivered_fraction"].as_f64().unwrap() >= 0.99);
    assert!(retransmitted(&v) >= 1, "{v}");
    // Over AF_XDP the classifier injects the loss, not the endpoint.
    assert_eq!(v["endpoint_receiver"]["injected_drops"], 0);
    // The receiver's classifier dropped about 5% (fault injection) and redirected the rest.
    let x = &v["afxdp_receiver"]["xdp"];
    let fault = x["drop_fault"]["packets"].as_u64().unwrap();
    let redirected = x["redirected"]["packets"].as_u64().unwrap();
    assert!(
        fault > 0 && redirected > 10 * fault,
        "fault {fault} redirected {redirected}"
    );
    assert_eq!(
        v["afxdp_receiver"]["queues"][0]["mode"], "copy",
        "veth binds in copy mode"
    );
}

/// An AF_XDP demo that fails after its namespaces are up (an AF_XDP socket that cannot be
/// opened: frames of 1000 bytes) says why and leaves no namespace behind.
#[test]
fn a_failing_afxdp_demo_removes_its_namespaces() {
    if !gradwire_netns::require_root("a_failing_afxdp_demo_removes_its_namespaces") {
        return;
    }
    let child = Command::new(env!("CARGO_BIN_EXE_gradwire"))
        .args(["demo", "--datapath", "afxdp", "--frame-size", "1000"])
        .args(["--size", "1MiB", "--count", "1", "--timeout", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let prefix = format!("{}{}t", gradwire_netns::ns::PREFIX, child.id());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("1000"),
        "the error names the bad frame size: {err}"
    );
    let left: Vec<String> = std::fs::read_dir(gradwire_netns::NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

#[test]
fn demo_over_the_engine_uses_both_queues_and_pinned_workers() {
    if !gradwire_netns::require_root("demo_over_the_engine_uses_both_queues_and_pinned_workers") {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        // Visible, and a failure under GRADWIRE_REQUIRE_PRIV=1.
        gradwire_netns::skip_part(
            "demo_over_the_engine_uses_both_queues_and_pinned_workers",
            "two pinned workers",
            &format!("needs 2 cores, this machine has {cores}"),
        );
        return;
    }
    let out = gradwire(&[
        "demo",
        "--datapath",
        "afxdp",
        "--engine",
        "--xdp-mode",
        "native",
        "--queues",
        "0,1",
        "--cores",
        "0,1",
        "--size",
        "8MiB",
        "--count",
        "2",
        "--loss-bound",
        "0.01",
        "--no-hugepages",
        "--json",
    ]);
    // Native XDP: on veth only the native path records which receive queue a packet took
    // (generic XDP sees every packet on queue 0).
    let v = json(&out);
    assert_eq!(
        v["protocol"], "flow",
        "the engine exists on the flow transport only"
    );
    assert_eq!(v["verified"], true);
    let queues = v["afxdp_receiver"]["queues"].as_array().unwrap();
    assert_eq!(queues.len(), 2);
    for (i, q) in queues.iter().enumerate() {
        assert_eq!(q["core"], i, "worker of queue {i} pinned to core {i}");
        assert!(
            q["rx_packets"].as_u64().unwrap() > 0,
            "queue {i} received nothing: {q}"
        );
    }
}

/// An authenticated job between two processes: the receiver has the secret in its
/// environment; a sender without it and one with another secret are refused at the
/// rendezvous with a clear error (and the receiver keeps waiting), one with the same secret in
/// a key file gets through, and a key file other users can read is refused.
#[test]
fn authenticated_send_and_recv_refuse_a_sender_without_the_secret() {
    const SECRET: &str = "0123456789abcdef-the-job-secret";
    let dir = common::TempDir::new("gw-cli", "secret");
    let key = dir.write("job.key", &format!("{SECRET}\n"));
    let wrong = dir.write("wrong.key", "fedcba9876543210-another-secret\n");
    let open = dir.write("open.key", &format!("{SECRET}\n"));
    use std::os::unix::fs::PermissionsExt;
    for (p, mode) in [(&key, 0o600), (&wrong, 0o600), (&open, 0o644)] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let addr = own_addr(7_105);
    let listen = addr.to_string();
    let common = [
        "--size",
        "1MiB",
        "--count",
        "2",
        "--loss-bound",
        "0",
        "--json",
    ];
    let mut recv = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .env("GRADWIRE_JOB_SECRET", SECRET)
            .args(["recv", "--listen", &listen, "--accept-timeout", "30"])
            .args(["--timeout", "20"])
            .args(common)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    wait_listening(&mut recv, addr);
    let send = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .env_remove("GRADWIRE_JOB_SECRET")
            .args(["send", "--to", &listen, "--timeout", "20"])
            .args(common)
            .args(extra)
            .output()
            .unwrap()
    };
    // A sender without the secret runs on the message layer, which the receiver (on the
    // flow transport, as every authenticated job) does not answer: it says so.
    let plain = send(&[]);
    assert_eq!(plain.status.code(), Some(1));
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(err.contains("give both ends the same --transport"), "{err}");
    // On the flow transport it is refused for want of the secret.
    let plain = send(&["--transport", "flow"]);
    assert_eq!(plain.status.code(), Some(1));
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(err.contains("requires an authenticated job"), "{err}");

    let mismatch = send(&["--secret-file", &wrong]);
    assert_eq!(mismatch.status.code(), Some(1));
    let err = String::from_utf8_lossy(&mismatch.stderr);
    assert!(err.contains("job secret"), "{err}");

    let loose = send(&["--secret-file", &open]);
    assert_eq!(loose.status.code(), Some(1));
    let err = String::from_utf8_lossy(&loose.stderr);
    assert!(err.contains("chmod 600"), "{err}");

    let s = json(&send(&["--secret-file", &key]));
    let rout = recv.wait_with_output();
    let r = json(&rout);
    assert_eq!(
        (&s["protocol"], &r["protocol"]),
        (&"flow".into(), &"flow".into())
    );
    assert_eq!(s["count"], 2);
    assert_eq!(r["verified"], true);
    assert_eq!(r["delivered_fraction"], 1.0);
}

/// Peer binding on the message layer: while a receiver waits, a connection that sends
/// garbage at the set-up is refused (and the receiver keeps waiting), and a stranger sends a
/// stream of well-formed data segments (this job, the sender's rank, every message number)
/// at the receiver's data port from its own socket, before and during the transfers. None is
/// placed: every delivered byte is the sender's, and the receiver counts the stranger's
/// datagrams as foreign.
#[test]
fn a_strangers_datagrams_never_reach_the_tensor() {
    use gradwire_msg::wire::{DataHeader, DATA_HEADER_LEN};
    use std::io::{BufRead, BufReader, Write};
    use std::sync::atomic::{AtomicBool, Ordering};

    let addr = own_addr(7_107);
    let listen = addr.to_string();
    let data = SocketAddrV4::new(*addr.ip(), addr.port() + 1);
    let size = 1usize << 20;
    let common = [
        "--size",
        "1MiB",
        "--count",
        "3",
        "--loss-bound",
        "0",
        "--json",
        "--timeout",
        "20",
    ];
    let mut recv = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(["recv", "--listen", &listen, "--accept-timeout", "30"])
            .args(common)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    wait_listening(&mut recv, addr);

    // Garbage at the set-up: refused with a reason.
    let mut junk = std::net::TcpStream::connect(addr).unwrap();
    junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    BufReader::new(&junk).read_line(&mut answer).unwrap();
    assert!(answer.contains("not gradwire's"), "{answer}");
    drop(junk);

    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let stranger = s.spawn(|| {
            let sock = std::net::UdpSocket::bind((*addr.ip(), 0)).unwrap();
            let mut d = vec![0xEEu8; DATA_HEADER_LEN + 1024];
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for msg in 0..3u32 {
                    for seg in 0..8u64 {
                        let h = DataHeader {
                            job: 1,
                            src: 1,
                            dst: 0,
                            msg,
                            offset: seg * 1024,
                            total: size as u32,
                            length: 1024,
                            ..DataHeader::default()
                        };
                        let mut hdr = [0u8; DATA_HEADER_LEN];
                        h.emit(&mut hdr);
                        d[..DATA_HEADER_LEN].copy_from_slice(&hdr);
                        // Refused or not, the socket may be gone at the end: ignore errors.
                        if sock.send_to(&d, data).is_ok() {
                            sent += 1;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            sent
        });
        // Let the stranger's datagrams queue before the sender sets the run up.
        std::thread::sleep(Duration::from_millis(100));
        let send = gradwire(&[&["send", "--to", &listen][..], &common[..]].concat());
        let rout = recv.wait_with_output();
        stop.store(true, Ordering::Relaxed);
        let sent = stranger.join().unwrap();
        let s = json(&send);
        let r = json(&rout);
        assert_eq!(s["count"], 3);
        assert_eq!(r["verified"], true, "every delivered byte is the sender's");
        assert_eq!(r["delivered_fraction"], 1.0);
        let foreign = r["endpoint_receiver"]["unknown_source"].as_u64().unwrap();
        assert!(
            sent > 0 && foreign > 0,
            "stranger sent {sent}, receiver counted {foreign}"
        );
        let per_transfer: u64 = r["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["rejected"]["foreign_source"].as_u64().unwrap())
            .sum();
        assert!(per_transfer <= foreign);
        assert_eq!(
            r["endpoint_receiver"]["refused"], 0,
            "nothing came from the sender's address but the sender's own"
        );
    });
}

/// A sender that dies mid-transfer: the receiver fails within its timeout, naming the sender's
/// rank, and does not hang.
#[test]
fn a_sender_that_dies_mid_transfer_is_named_within_the_timeout() {
    let addr = own_addr(7_109);
    let listen = addr.to_string();
    // Many large transfers, so the sender is still sending when it is killed.
    let common = [
        "--size",
        "64MiB",
        "--count",
        "1000",
        "--loss-bound",
        "0",
        "--timeout",
        "3",
    ];
    let mut recv = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args([
                "recv",
                "--listen",
                &listen,
                "--accept-timeout",
                "30",
                "--json",
            ])
            .args(common)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    wait_listening(&mut recv, addr);
    let mut send = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(["send", "--to", &listen, "--json"])
            .args(common)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        send.child().try_wait().unwrap().is_none(),
        "the sender finished 1000 x 64 MiB in 1.5 s?"
    );
    send.child().kill().unwrap();
    let killed = Instant::now();
    // The receiver must end by itself: the guard kills it only if this test fails.
    loop {
        if recv.child().try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "the receiver still waits 20 s after its sender died"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = recv.wait_with_output();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1"), "{err}");
}

/// One scrape of `gradwire stats --prometheus` at `addr`: the body of `GET /metrics`.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.to_owned()
}

/// The value of `metric` for process `pid` in an exposition, if there is a sample.
fn sample(body: &str, metric: &str, pid: u32) -> Option<f64> {
    let want = format!("{metric}{{pid=\"{pid}\",");
    body.lines()
        .find(|l| l.starts_with(&want))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
}

/// `gradwire stats --prometheus` scraped while a send/recv pair runs (200 transfers of 4 MiB):
/// the receiver's endpoint counters appear with its pid, role, datapath and protocol, and
/// grow from one scrape to a later one while the transfers go on; the sender's transfers
/// counter too. A request for anything but /metrics is a 404.
#[test]
fn prometheus_scrapes_see_the_counters_grow_while_transfers_run() {
    use std::io::BufRead;
    let addr = own_addr(7_111);
    let listen = addr.to_string();
    let common = ["--size", "4MiB", "--count", "200", "--timeout", "30"];
    let mut recv = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(["recv", "--listen", &listen, "--accept-timeout", "30"])
            .args(common)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    wait_listening(&mut recv, addr);
    let mut stats = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(["stats", "--prometheus", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut first = String::new();
    std::io::BufReader::new(stats.child().stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let server = first
        .trim()
        .strip_prefix("serving Prometheus metrics on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("stats printed {first:?}"))
        .to_owned();
    let mut send = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_gradwire"))
            .args(["send", "--to", &listen])
            .args(common)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let (recv_pid, send_pid) = (recv.child().id(), send.child().id());
    let mut seen = Vec::new();
    let mut sender_transfers = 0.0f64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while send.child().try_wait().unwrap().is_none() && Instant::now() < deadline {
        let body = scrape(&server);
        if let Some(v) = sample(&body, "gradwire_endpoint_datagrams_in_total", recv_pid) {
            assert!(
                body.contains(&format!(
                    "gradwire_endpoint_datagrams_in_total{{pid=\"{recv_pid}\",role=\"recv\",datapath=\"udp\",protocol=\"msg\"}}"
                )),
                "{body}"
            );
            seen.push(v);
        }
        if let Some(t) = sample(&body, "gradwire_transfers_total", send_pid) {
            sender_transfers = sender_transfers.max(t);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(send.wait_with_output().status.success());
    assert!(recv.wait_with_output().status.success());
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]),
        "a counter went down: {seen:?}"
    );
    assert!(
        seen.first() < seen.last(),
        "the receiver's counter did not grow between scrapes during the run: {seen:?}"
    );
    assert!(
        sender_transfers >= 1.0,
        "the sender's transfers were never scraped"
    );
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(&server).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 404"), "{text}");
}
