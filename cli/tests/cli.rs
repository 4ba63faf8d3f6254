//! The `gradwire` binary end to end: demo on both datapaths, send/recv between two
//! processes on a loopback address, and clear errors for bad input.

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
        assert_eq!(v["size_bytes"], 4 << 20);
        assert_eq!(v["loss_bound"], 0.01);
        assert!(v["delivered_fraction"].as_f64().unwrap() >= 0.99);
        assert!(
            v["rounds"].as_u64().unwrap() >= 1,
            "5% loss cannot meet 1% without a round"
        );
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
        err.contains(&format!("control channel to {addr}")) && err.contains("refused"),
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
        err.contains("no sender completed a control handshake"),
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
    assert_eq!(v["verified"], true);
    assert!(v["delivered_fraction"].as_f64().unwrap() >= 0.99);
    assert!(v["rounds"].as_u64().unwrap() >= 1);
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
    let plain = send(&[]);
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
    assert_eq!(s["count"], 2);
    assert_eq!(r["verified"], true);
    assert_eq!(r["delivered_fraction"], 1.0);
}
