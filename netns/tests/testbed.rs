//! The namespace kit's testbed (`gradwire_netns::Testbed`): connectivity over a veth pair
//! and over the bridge, the configuration it promises (addresses, MACs, queues, offloads, no
//! IPv6, static neighbours), bounded commands, and teardown in every situation: drop, explicit
//! `down`, a panicking closure, a stale namespace of a dead process, and a SIGKILLed process.
//!
//! Every test needs root and skips with a visible message otherwise (fails instead with
//! `GRADWIRE_REQUIRE_PRIV=1`). Packets only travel inside the namespaces the tests create, with
//! addresses from 198.18.0.0/15; every wait is bounded.

use gradwire_netns::{
    cleanup_stale, netns_path, require_root, NetnsError, Testbed, TestbedConfig, HOST_IFNAME,
};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Bound on every wait for a packet, a connection or a cleanup to happen.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Set in the child process of `reaper_removes_namespaces_of_a_sigkilled_process`.
const REAPER_CHILD_ENV: &str = "GRADWIRE_TESTBED_REAPER_CHILD";

fn up(hosts: usize) -> Testbed {
    Testbed::up(&TestbedConfig::with_hosts(hosts)).expect("testbed up")
}

fn exists(ns: &str) -> bool {
    netns_path(ns).exists()
}

/// Sends one datagram from host `from` to host `to` (port `port`) with kernel sockets and
/// returns what arrived and from where.
fn udp_once(tb: &Testbed, from: usize, to: usize, port: u16) -> (Vec<u8>, SocketAddr) {
    let dst = SocketAddrV4::new(tb.host(to).ipv4, port);
    // Created inside host `to`; used afterwards from this thread, the socket stays there.
    let rx = tb
        .run_in(to, move || UdpSocket::bind(dst))
        .expect("enter receiver")
        .expect("bind receiver");
    rx.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let src_ip = tb.host(from).ipv4;
    let payload = format!("gradwire testbed {from}->{to}").into_bytes();
    let sent = payload.clone();
    tb.run_in(from, move || -> std::io::Result<usize> {
        UdpSocket::bind(SocketAddrV4::new(src_ip, 0))?.send_to(&sent, dst)
    })
    .expect("enter sender")
    .expect("send");
    let mut buf = [0u8; 256];
    let (n, peer) = rx
        .recv_from(&mut buf)
        .unwrap_or_else(|e| panic!("no datagram {from}->{to} within {TIMEOUT:?}: {e}"));
    assert_eq!(&buf[..n], &payload[..]);
    (buf[..n].to_vec(), peer)
}

#[test]
fn udp_between_two_hosts() {
    if !require_root("udp_between_two_hosts") {
        return;
    }
    let tb = up(2);
    assert_eq!(tb.len(), 2);
    assert!(tb.switch_netns().is_none(), "two hosts need no bridge");
    let (_, peer) = udp_once(&tb, 0, 1, 47100);
    assert_eq!(peer.ip(), tb.host(0).ipv4);
    udp_once(&tb, 1, 0, 47101);
    tb.down().expect("clean teardown");
}

#[test]
fn tcp_connect_between_two_hosts() {
    if !require_root("tcp_connect_between_two_hosts") {
        return;
    }
    let tb = up(2);
    let addr = SocketAddrV4::new(tb.host(1).ipv4, 47200);
    let listener = tb
        .run_in(1, move || TcpListener::bind(addr))
        .expect("enter server")
        .expect("listen");
    // Non-blocking accept polled against a deadline: std's accept has no timeout.
    listener.set_nonblocking(true).expect("nonblocking");
    let client = tb
        .spawn_in(0, move || -> std::io::Result<Vec<u8>> {
            let mut s = TcpStream::connect_timeout(&addr.into(), TIMEOUT)?;
            s.set_read_timeout(Some(TIMEOUT))?;
            s.write_all(b"ping")?;
            let mut reply = Vec::new();
            s.read_to_end(&mut reply)?;
            Ok(reply)
        })
        .expect("enter client");
    let deadline = Instant::now() + TIMEOUT;
    let (mut conn, peer) = loop {
        match listener.accept() {
            Ok(c) => break c,
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("no connection within {TIMEOUT:?}: {e}"),
        }
    };
    assert_eq!(peer.ip(), tb.host(0).ipv4);
    conn.set_nonblocking(false).expect("blocking");
    conn.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut req = [0u8; 4];
    conn.read_exact(&mut req).expect("request");
    assert_eq!(&req, b"ping");
    conn.write_all(b"pong").expect("reply");
    drop(conn);
    let reply = client.join().expect("client thread").expect("client io");
    assert_eq!(reply, b"pong");
}

#[test]
fn four_hosts_through_the_bridge() {
    if !require_root("four_hosts_through_the_bridge") {
        return;
    }
    let tb = up(4);
    let sw = tb.switch_netns().expect("a switch namespace").to_owned();
    assert!(exists(&sw));
    assert_eq!(tb.namespaces().len(), 5);
    let (_, peer) = udp_once(&tb, 0, 3, 47300);
    assert_eq!(peer.ip(), tb.host(0).ipv4);
    udp_once(&tb, 3, 0, 47301);
    udp_once(&tb, 2, 1, 47302);
    let names = tb.namespaces().to_vec();
    drop(tb);
    assert!(names.iter().all(|n| !exists(n)), "left behind: {names:?}");
}

/// `"key":value` from `ip -j` output (one object), quotes stripped. Good enough for the flat
/// fields compared here, without a JSON dependency.
fn json_field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let start = json.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &json[start..];
    let end = rest.find([',', '}'])?;
    Some(rest[..end].trim_matches('"'))
}

#[test]
fn hosts_are_configured_as_reported() {
    if !require_root("hosts_are_configured_as_reported") {
        return;
    }
    let config = TestbedConfig {
        hosts: 3,
        queues: 2,
        mtu: 9000,
        tx_checksum_offload: false,
    };
    let tb = Testbed::up(&config).expect("testbed up");
    for (i, h) in tb.hosts().iter().enumerate() {
        assert_eq!(h.index, i);
        assert_eq!(h.ifname, HOST_IFNAME);
        assert_eq!(h.ipv4.octets(), [198, 18, 0, i as u8 + 1]);
        assert!(h.netns.starts_with(&format!("gw{}t", std::process::id())));

        let link = tb
            .exec(i, &["ip", "-d", "-j", "link", "show", "dev", "gw0"])
            .expect("ip link");
        assert_eq!(json_field(&link, "ifindex"), Some(&*h.ifindex.to_string()));
        assert_eq!(json_field(&link, "address"), Some(&*h.mac_string()));
        assert_eq!(json_field(&link, "mtu"), Some("9000"));
        assert_eq!(json_field(&link, "num_tx_queues"), Some("2"), "{link}");
        assert_eq!(json_field(&link, "num_rx_queues"), Some("2"), "{link}");
        assert_eq!(json_field(&link, "operstate"), Some("UP"), "{link}");

        let addr = tb
            .exec(i, &["ip", "-j", "-4", "addr", "show", "dev", "gw0"])
            .expect("addr");
        assert_eq!(
            json_field(&addr, "local"),
            Some(&*h.ipv4.to_string()),
            "{addr}"
        );
        assert_eq!(json_field(&addr, "prefixlen"), Some("24"), "{addr}");

        // No IPv6 at all, hence certainly no global address.
        let v6 = tb
            .exec(i, &["ip", "-6", "addr", "show"])
            .expect("ip -6 addr");
        assert!(v6.trim().is_empty(), "host {i} has IPv6: {v6}");

        let offload = tb.exec(i, &["ethtool", "-k", "gw0"]).expect("ethtool");
        assert!(offload.contains("tx-checksumming: off"), "{offload}");

        let neigh = tb
            .exec(i, &["ip", "neigh", "show", "dev", "gw0"])
            .expect("neigh");
        for other in tb.hosts().iter().filter(|o| o.index != i) {
            let line = neigh
                .lines()
                .find(|l| l.starts_with(&format!("{} ", other.ipv4)))
                .unwrap_or_else(|| panic!("host {i}: no neighbour {}: {neigh}", other.ipv4));
            assert!(
                line.contains(&other.mac_string()) && line.contains("PERMANENT"),
                "{line}"
            );
        }
        let lo = tb
            .exec(i, &["ip", "-j", "link", "show", "dev", "lo"])
            .expect("lo");
        assert!(lo.contains("\"UP\""), "{lo}");
    }
    // Three hosts talk through the bridge with jumbo frames, unfragmented.
    let dst = SocketAddrV4::new(tb.host(2).ipv4, 47400);
    let rx = tb.run_in(2, move || UdpSocket::bind(dst)).unwrap().unwrap();
    rx.set_read_timeout(Some(TIMEOUT)).unwrap();
    let src = tb.host(0).ipv4;
    tb.run_in(0, move || {
        let s = UdpSocket::bind(SocketAddrV4::new(src, 0)).unwrap();
        s.send_to(&[7u8; 8000], dst).unwrap();
    })
    .unwrap();
    let mut buf = vec![0u8; 9000];
    let (n, _) = rx.recv_from(&mut buf).expect("jumbo datagram");
    assert_eq!(n, 8000);
}

#[test]
fn commands_in_hosts_are_bounded_and_errors_explain() {
    if !require_root("commands_in_hosts_are_bounded_and_errors_explain") {
        return;
    }
    let tb = up(2);
    let start = Instant::now();
    let err = tb
        .exec_timeout(0, &["sleep", "30"], Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(err, NetnsError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));

    let err = tb
        .exec(1, &["ip", "link", "show", "dev", "nonexistent0"])
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("nonexistent0") && msg.contains(&tb.host(1).netns),
        "{msg}"
    );

    assert!(matches!(
        tb.run_in(7, || ()),
        Err(NetnsError::NoSuchHost { index: 7, hosts: 2 })
    ));
    assert!(matches!(
        Testbed::up(&TestbedConfig::with_hosts(1)),
        Err(NetnsError::InvalidConfig(_))
    ));
}

#[test]
fn namespaces_are_gone_after_drop_and_down() {
    if !require_root("namespaces_are_gone_after_drop_and_down") {
        return;
    }
    let tb = up(2);
    let names = tb.namespaces().to_vec();
    assert_eq!(names.len(), 2);
    assert!(names.iter().all(|n| exists(n)));
    drop(tb);
    assert!(names.iter().all(|n| !exists(n)), "left behind: {names:?}");

    let tb = up(3);
    let names = tb.namespaces().to_vec();
    tb.down().expect("clean teardown");
    assert!(names.iter().all(|n| !exists(n)), "left behind: {names:?}");
}

#[test]
fn namespaces_are_gone_after_a_panicking_closure() {
    if !require_root("namespaces_are_gone_after_a_panicking_closure") {
        return;
    }
    let names = Mutex::new(Vec::new());
    let result = catch_unwind(AssertUnwindSafe(|| {
        let tb = up(2);
        *names.lock().unwrap() = tb.namespaces().to_vec();
        tb.run_in(1, || panic!("intentional panic inside the namespace"))
            .expect("enter namespace");
    }));
    assert!(result.is_err(), "the closure's panic must reach the caller");
    let names = names.into_inner().unwrap();
    assert_eq!(names.len(), 2);
    assert!(names.iter().all(|n| !exists(n)), "left behind: {names:?}");
}

/// The teardown rule: a socket that outlives its namespace keeps the namespace object alive,
/// but not its devices. A thread stays inside host 0 holding a socket while the testbed goes
/// down; from inside, the veth must be gone at once and the socket must have no route.
#[test]
fn teardown_removes_the_devices_of_a_namespace_a_socket_still_holds() {
    if !require_root("teardown_removes_the_devices_of_a_namespace_a_socket_still_holds") {
        return;
    }
    let tb = up(2);
    let (src, dst) = (tb.host(0).ipv4, SocketAddrV4::new(tb.host(1).ipv4, 47500));
    let names = tb.namespaces().to_vec();
    let (ready_tx, ready_rx) = mpsc::channel();
    let (check_tx, check_rx) = mpsc::channel::<()>();
    let inside = tb
        .spawn_in(0, move || {
            let sock = UdpSocket::bind(SocketAddrV4::new(src, 0)).expect("bind in host 0");
            sock.send_to(b"before", dst).expect("send before teardown");
            ready_tx.send(()).expect("report ready");
            // Bounded: the test thread either sends or drops the sender.
            let _ = check_rx.recv_timeout(TIMEOUT);
            let ifindex = nix::net::if_::if_nametoindex(HOST_IFNAME);
            let send = sock.send_to(b"after", dst).map(drop);
            (ifindex, send)
        })
        .expect("enter host 0");
    ready_rx.recv_timeout(TIMEOUT).expect("socket ready");
    tb.down().expect("clean teardown");
    assert!(names.iter().all(|n| !exists(n)), "left behind: {names:?}");
    check_tx.send(()).expect("thread waiting");
    let (ifindex, send) = inside.join().expect("thread in host 0");
    assert_eq!(
        ifindex,
        Err(nix::errno::Errno::ENODEV),
        "the veth survived teardown in a namespace pinned by a socket"
    );
    let err = send.expect_err("a send without any device must fail");
    assert_eq!(
        err.raw_os_error(),
        Some(nix::errno::Errno::ENETUNREACH as i32),
        "{err}"
    );
}

/// Deletes a hand-made namespace at the end of the test, whatever happens.
struct HandMade(String);

impl HandMade {
    fn create(name: String) -> HandMade {
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip");
        assert!(status.success(), "ip netns add {name}");
        HandMade(name)
    }
}

impl Drop for HandMade {
    fn drop(&mut self) {
        if exists(&self.0) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
}

/// A child process killed and reaped when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pid_alive(pid: i32) -> bool {
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

#[test]
fn cleanup_stale_removes_only_namespaces_of_dead_processes() {
    if !require_root("cleanup_stale_removes_only_namespaces_of_dead_processes") {
        return;
    }
    let me = std::process::id();
    // A pid nobody has: above pid_max on most machines, and checked anyway.
    let dead = (900_000..999_999)
        .rev()
        .find(|&p| !pid_alive(p))
        .expect("a free pid");
    // The testbed counter part carries our pid so that parallel runs use distinct names.
    let stale = HandMade::create(format!("gw{dead}t{me}h0"));
    // A live process other than us, started (and ended) by this test; killed on drop should
    // an assertion fail first.
    let mut sleeper = KillOnDrop(
        Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleep"),
    );
    let live = HandMade::create(format!("gw{}t{me}h0", sleeper.0.id()));
    // Names of other shapes are never ours, whatever the pid.
    let foreign = HandMade::create(format!("gwx{dead}t{me}h0"));

    cleanup_stale().expect("cleanup_stale");
    // Parallel tests run cleanup_stale too (in Testbed::up), so only the outcome is checked.
    assert!(!exists(&stale.0), "stale namespace {} survived", stale.0);
    assert!(
        exists(&live.0),
        "namespace of live pid {} was removed",
        sleeper.0.id()
    );
    assert!(exists(&foreign.0), "foreign name {} was removed", foreign.0);

    sleeper.0.kill().expect("kill sleep");
    // Reaped, or the zombie would still count as alive.
    sleeper.0.wait().expect("reap sleep");
    cleanup_stale().expect("cleanup_stale");
    assert!(!exists(&live.0), "namespace of the now dead pid survived");
    assert!(exists(&foreign.0));
}

/// The child half of the next test: builds a testbed, prints its namespaces and waits to be
/// killed. Does nothing in a normal run.
#[test]
#[ignore = "helper process of reaper_removes_namespaces_of_a_sigkilled_process"]
fn reaper_child() {
    if std::env::var_os(REAPER_CHILD_ENV).is_none() {
        return;
    }
    let tb = up(3);
    println!("NAMESPACES {}", tb.namespaces().join(" "));
    std::io::stdout().flush().unwrap();
    // Bounded even if the parent never kills us; then Drop cleans up normally.
    thread::sleep(Duration::from_secs(30));
}

#[test]
fn reaper_removes_namespaces_of_a_sigkilled_process() {
    if !require_root("reaper_removes_namespaces_of_a_sigkilled_process") {
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args([
            "reaper_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(REAPER_CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child test process");
    let stdout = child.stdout.take().expect("child stdout");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // The harness prints `test reaper_child ... ` without a newline before it.
            if let Some((_, names)) = line.split_once("NAMESPACES ") {
                let _ = tx.send(names.split(' ').map(str::to_owned).collect::<Vec<_>>());
                return;
            }
        }
    });
    let names = rx.recv_timeout(Duration::from_secs(20));
    // SIGKILL: no destructor, no signal handler, nothing in the child can react.
    child.kill().expect("kill child");
    child.wait().expect("reap child");
    let names = names.expect("child reported its namespaces");
    assert_eq!(names.len(), 4);

    let deadline = Instant::now() + TIMEOUT;
    while names.iter().any(|n| exists(n)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<_> = names.iter().filter(|n| exists(n)).cloned().collect();
    if !left.is_empty() {
        // Do not leak them even when the assertion fails: their creator is dead now.
        let _ = cleanup_stale();
    }
    assert!(left.is_empty(), "the reaper left {left:?}");
}
