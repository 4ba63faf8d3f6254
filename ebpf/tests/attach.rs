//! Attaching to real interfaces: a veth pair between two network namespaces this test creates
//! with the namespace kit (names `gw<pid>t<n>-a`/`-b`, addresses in 198.18.0.0/15, removed by
//! the kit's teardown rule even when an assertion fails, and by its reaper if the test process
//! is killed; every step bounded in time). Nothing is ever attached outside these namespaces:
//! the work runs on threads that entered them.
//!
//! Needs root: without it the tests print `SKIPPED: needs root` to stderr and return, unless
//! `GRADWIRE_REQUIRE_PRIV=1`, in which case they fail.

mod common;

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{require_root, PORT};
use gradwire_ebpf::{query_attached, AttachMode, XdpAttachedMode, XdpConfig, XdpError, XdpProgram};
use gradwire_netns::{
    cmd, enter, new_netns_prefix, spawn_in_netns, IpBatch, NamespaceSet, Veth, VethEnd,
};

const TEST_TIMEOUT: Duration = Duration::from_secs(90);
/// Interface names live inside the private namespaces, so they can be fixed.
const IF_A: &str = "a0";
const IF_B: &str = "b0";
const ADDR_A: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 1);
const ADDR_B: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 2);

const CHILD_NS_ENV: &str = "GRADWIRE_EBPF_TEST_CHILD_NS";
const CHILD_UNPRIV_ENV: &str = "GRADWIRE_EBPF_TEST_CHILD_UNPRIV";

/// Two namespaces joined by a veth pair (one queue each way, so native XDP works on veth).
/// Dropping it removes both by the kit's teardown rule.
struct Lab {
    a: String,
    b: String,
    _set: NamespaceSet,
}

impl Lab {
    fn up() -> Lab {
        let prefix = new_netns_prefix();
        let (a, b) = (format!("{prefix}-a"), format!("{prefix}-b"));
        // Exists before the veth, so a failure below cleans up.
        let set = NamespaceSet::temporary("ebpf attach test", &[a.clone(), b.clone()])
            .expect("create namespaces");
        Veth {
            a: VethEnd {
                netns: &a,
                ifname: IF_A,
                mac: None,
            },
            b: VethEnd {
                netns: &b,
                ifname: IF_B,
                mac: None,
            },
            mtu: None,
            queues: Some(1),
        }
        .create()
        .expect("veth");
        for (ns, ifname, addr) in [(&a, IF_A, ADDR_A), (&b, IF_B, ADDR_B)] {
            IpBatch::new()
                .addr(ifname, addr.into(), 24)
                .up(ifname)
                .apply(ns)
                .expect("address and link up");
        }
        Lab { a, b, _set: set }
    }
}

/// Runs `f` on a thread inside `ns`, failing the test if it takes longer than `TEST_TIMEOUT`
/// (the caller's `Lab` then still deletes the namespaces).
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let h = spawn_in_netns(ns, move || {
        let _ = tx.send(f());
    })
    .expect("enter namespace");
    match rx.recv_timeout(TEST_TIMEOUT) {
        Ok(v) => {
            let _ = h.join();
            v
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => panic!("namespace thread ended without a result"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("timed out after {TEST_TIMEOUT:?}"),
    }
}

fn cfg(mode: AttachMode) -> XdpConfig {
    XdpConfig {
        mode,
        ..XdpConfig::new(vec![PORT])
    }
}

/// The `prog/xdp` line of `ip -d link show`, if any (an independent check of the query).
fn xdp_in_link_show(ns: &str, ifname: &str) -> Option<String> {
    let out =
        cmd::ip(Some(ns), &["-n", ns, "-d", "link", "show", "dev", ifname]).expect("ip link show");
    out.lines()
        .find(|l| l.contains("prog/xdp"))
        .map(|l| l.trim().to_owned())
}

#[test]
fn attach_refuse_second_and_detach_on_veth() {
    if !require_root("attach_refuse_second_and_detach_on_veth") {
        return;
    }
    let lab = Lab::up();
    let ns_b = lab.b.clone();
    let ns_a = lab.a.clone();
    in_ns(&lab.a, move || {
        assert_eq!(query_attached(IF_A).unwrap(), None);
        let p = XdpProgram::attach(IF_A, &cfg(AttachMode::Auto)).expect("attach auto");
        // veth has native XDP.
        assert_eq!(p.attach_mode(), Some(AttachMode::Native));
        assert_eq!(p.ifname(), Some(IF_A));
        let q = query_attached(IF_A).unwrap().expect("attached");
        assert_eq!((q.prog_id, q.mode), (p.prog_id(), XdpAttachedMode::Native));
        let shown = xdp_in_link_show(&ns_a, IF_A).expect("ip shows the program");
        assert!(shown.contains(&format!("id {}", p.prog_id())), "{shown}");

        // A second program is refused, whatever the mode and however the interface is named.
        let ifindex = p.ifindex().unwrap();
        for (iface, mode) in [
            (gradwire_ebpf::Iface::from(IF_A), AttachMode::Auto),
            (gradwire_ebpf::Iface::from(IF_A), AttachMode::Generic),
            (gradwire_ebpf::Iface::from(ifindex), AttachMode::Native),
        ] {
            let err = XdpProgram::attach(iface, &cfg(mode)).expect_err("second attach");
            match &err {
                XdpError::AlreadyAttached {
                    ifname,
                    prog_id,
                    mode,
                    ..
                } => {
                    assert_eq!((ifname.as_str(), *prog_id), (IF_A, p.prog_id()));
                    assert_eq!(*mode, XdpAttachedMode::Native);
                }
                other => panic!("expected AlreadyAttached, got {other}"),
            }
            let msg = err.to_string();
            assert!(
                msg.contains(IF_A) && msg.contains(&p.prog_id().to_string()),
                "{msg}"
            );
            assert!(msg.contains("refusing"), "{msg}");
        }
        // The first program is still the one attached.
        assert_eq!(
            query_attached(IF_A).unwrap().map(|q| q.prog_id),
            Some(p.prog_id())
        );

        // The kernel UDP path keeps working with the classifier attached: a truncated
        // gradwire datagram is dropped, a good one reaches the socket, ARP goes through.
        let rx = UdpSocket::bind(SocketAddrV4::new(ADDR_A, PORT)).expect("bind in A");
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let sender = spawn_in_netns(&ns_b, move || {
            let tx = UdpSocket::bind(SocketAddrV4::new(ADDR_B, 0)).expect("bind in B");
            tx.send_to(&[0x11; 20], SocketAddrV4::new(ADDR_A, PORT))
                .expect("send short");
            tx.send_to(&[0x22; 96], SocketAddrV4::new(ADDR_A, PORT))
                .expect("send good");
        })
        .expect("enter B");
        let mut buf = [0u8; 256];
        let (n, from) = rx
            .recv_from(&mut buf)
            .expect("kernel UDP receive with XDP attached");
        sender.join().unwrap();
        assert_eq!((n, from.ip()), (96, std::net::IpAddr::V4(ADDR_B)));
        assert_eq!(buf[0], 0x22, "the short datagram must have been dropped");
        let c = p.counters().unwrap();
        assert_eq!(c.gradwire.packets, 2, "{c:?}");
        assert_eq!(c.drop_truncated.packets, 1, "{c:?}");
        assert_eq!(c.to_kernel.packets, 1, "{c:?}");
        assert_eq!(c.class(0, 0).packets, 1, "{c:?}");
        assert!(c.passed.packets >= 1, "ARP must have passed: {c:?}");

        // Dropping detaches.
        drop(p);
        assert_eq!(query_attached(IF_A).unwrap(), None);
        assert_eq!(xdp_in_link_show(&ns_a, IF_A), None);
    });
}

#[test]
fn generic_mode_fallback_and_errors() {
    if !require_root("generic_mode_fallback_and_errors") {
        return;
    }
    let lab = Lab::up();
    in_ns(&lab.b, || {
        // Explicit generic mode, explicit detach.
        let p = XdpProgram::attach(IF_B, &cfg(AttachMode::Generic)).expect("generic");
        assert_eq!(p.attach_mode(), Some(AttachMode::Generic));
        let q = query_attached(IF_B).unwrap().expect("attached");
        assert_eq!((q.prog_id, q.mode), (p.prog_id(), XdpAttachedMode::Generic));
        p.detach().expect("detach");
        assert_eq!(query_attached(IF_B).unwrap(), None);

        // Loopback has no native XDP: Auto falls back to generic (with a line on stderr),
        // Native is an error that says so.
        let p = XdpProgram::attach("lo", &cfg(AttachMode::Auto)).expect("auto on lo");
        assert_eq!(p.attach_mode(), Some(AttachMode::Generic));
        assert_eq!(
            query_attached("lo").unwrap().map(|q| q.mode),
            Some(XdpAttachedMode::Generic)
        );
        drop(p);
        assert_eq!(query_attached("lo").unwrap(), None);
        let err = XdpProgram::attach("lo", &cfg(AttachMode::Native)).expect_err("native on lo");
        assert!(
            matches!(
                err,
                XdpError::Attach {
                    mode: AttachMode::Native,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("lo"), "{err}");
        assert_eq!(query_attached("lo").unwrap(), None);

        // Unknown interfaces.
        for iface in [
            gradwire_ebpf::Iface::from("nosuch0"),
            gradwire_ebpf::Iface::from(999_999u32),
        ] {
            let err = XdpProgram::attach(iface.clone(), &cfg(AttachMode::Auto)).expect_err("bogus");
            assert!(
                matches!(err, XdpError::NoSuchInterface { .. }),
                "{iface}: {err}"
            );
            assert!(matches!(
                query_attached(iface),
                Err(XdpError::NoSuchInterface { .. })
            ));
        }
    });
}

/// Reads the child's stdout until a line containing `marker` (libtest may have printed
/// `test name ... ` before it on the same line) and returns what follows the marker, bounded
/// in time.
fn wait_for_line(child: &mut Child, marker: &'static str) -> Option<String> {
    let out = child.stdout.take()?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(i) = line.find(marker) {
                let _ = tx.send(line[i + marker.len()..].to_owned());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30)).ok()
}

fn child_test(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    cmd
}

/// A process holding the attachment is SIGKILLed: the kernel detaches its bpf_link.
#[test]
fn process_death_detaches() {
    if !require_root("process_death_detaches") {
        return;
    }
    let lab = Lab::up();
    let mut child = child_test("child_attach_and_wait")
        .env(CHILD_NS_ENV, &lab.a)
        .spawn()
        .expect("spawn child");
    struct Reap<'a>(&'a mut Child);
    impl Drop for Reap<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let reap = Reap(&mut child);
    let line = wait_for_line(reap.0, "ATTACHED ").expect("child attached within 30 s");
    let child_prog: u32 = line.trim().parse().expect("prog id");
    let ns = lab.a.clone();
    let before = in_ns(&lab.a, || query_attached(IF_A).unwrap());
    assert_eq!(before.map(|q| q.prog_id), Some(child_prog));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(reap.0.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill child");
    let _ = reap.0.wait();
    drop(reap);
    let gone = in_ns(&ns, || {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match query_attached(IF_A).unwrap() {
                None => return true,
                Some(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                Some(_) => return false,
            }
        }
    });
    assert!(
        gone,
        "XDP program still attached after its process was killed"
    );
}

/// Child side of `process_death_detaches` (does nothing when run directly).
#[test]
#[ignore = "helper process of process_death_detaches"]
fn child_attach_and_wait() {
    let Some(ns) = std::env::var_os(CHILD_NS_ENV) else {
        return;
    };
    enter(&ns.to_string_lossy()).expect("enter the namespace");
    let p = XdpProgram::attach(IF_A, &cfg(AttachMode::Auto)).expect("child attach");
    println!("ATTACHED {}", p.prog_id());
    // Killed by the parent long before this ends.
    thread::sleep(Duration::from_secs(60));
    drop(p);
}

/// Without privileges, loading is a clear error and querying still works.
#[test]
fn unprivileged_load_is_a_clear_error() {
    if !require_root("unprivileged_load_is_a_clear_error") {
        return;
    }
    // Root is needed to drop to `nobody` for the child.
    let mut child = child_test("child_unprivileged")
        .env(CHILD_UNPRIV_ENV, "1")
        .uid(65534)
        .gid(65534)
        .spawn()
        .expect("spawn child");
    let line = wait_for_line(&mut child, "UNPRIV ");
    let status = child.wait().expect("wait child");
    assert!(status.success(), "child failed: {status}");
    assert_eq!(line.as_deref(), Some("ok"));
}

/// Child side of `unprivileged_load_is_a_clear_error`.
#[test]
#[ignore = "helper process of unprivileged_load_is_a_clear_error"]
fn child_unprivileged() {
    if std::env::var_os(CHILD_UNPRIV_ENV).is_none() {
        return;
    }
    assert!(!nix::unistd::geteuid().is_root());
    let err = XdpProgram::load_detached(&XdpConfig::new(vec![PORT])).expect_err("must fail");
    assert!(matches!(err, XdpError::PermissionDenied { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("root") && msg.contains("CAP_BPF"), "{msg}");
    let err = XdpProgram::attach("lo", &XdpConfig::new(vec![PORT])).expect_err("must fail");
    assert!(matches!(err, XdpError::PermissionDenied { .. }), "{err}");
    // Querying needs no privilege.
    assert_eq!(query_attached("lo").expect("unprivileged query"), None);
    println!("UNPRIV ok");
}
