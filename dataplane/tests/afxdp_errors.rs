//! AF_XDP and XDP setup errors provoked for real on a namespace testbed (root only): each one
//! keeps the kernel's error code (`raw_os_error`) and its message names the step that failed
//! and ends with what to do about it (`gradwire_ebpf::error::hint`).
//!
//! - EBUSY: a second socket on a queue another AF_XDP socket holds (datapath, raw port and the
//!   bare socket layer);
//! - EINVAL: a queue id the veth does not have (datapath and engine);
//! - EPERM: a child process without privileges loads the classifier or opens a socket;
//! - ENOBUFS: a child process without CAP_IPC_LOCK and with a 1 MiB locked-memory limit
//!   registers a 16 MiB UMEM (the kernel charges the UMEM to RLIMIT_MEMLOCK and answers
//!   ENOBUFS, not ENOMEM, when it does not fit).
//!
//! The children are this test binary run again through `ip netns exec` (so they start inside
//! the testbed's namespace) and util-linux's `setpriv` / `prlimit`, which drop the privileges
//! and lower the limit before exec; each prints a marker line the parent checks, so a child
//! that ran no test cannot pass.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use gradwire::afxdp::engine::{Engine, EngineConfig};
use gradwire::afxdp::port::RawPort;
use gradwire::afxdp::socket::XskSocket;
use gradwire::afxdp::{AfXdpConfig, AfXdpDatapath, AfXdpError, SocketConfig};
use gradwire_ebpf::{AttachMode, XdpError};
use gradwire_netns::{require_root, Testbed, TestbedConfig};
use nix::errno::Errno;

const DATA_PORT: u16 = 7000;
/// Set (to the child's name) in the environment of a child process.
const CHILD_ENV: &str = "GRADWIRE_AFXDP_ERRORS_CHILD";
/// Bound on a child process, which sets up (and fails to set up) one datapath or socket.
const CHILD_TIMEOUT: Duration = Duration::from_secs(60);

fn testbed(name: &str, queues: u32) -> Option<Testbed> {
    if !require_root(name) {
        return None;
    }
    Some(
        Testbed::up(&TestbedConfig {
            queues,
            ..TestbedConfig::default()
        })
        .expect("testbed"),
    )
}

/// Sockets without huge pages (no fallback notice), trying zero-copy first as by default.
fn socket_config() -> SocketConfig {
    SocketConfig {
        hugepages: false,
        ..SocketConfig::default()
    }
}

/// A datapath configuration for host 0 of a testbed on `queues`.
fn config(queues: Vec<u32>) -> AfXdpConfig {
    let ip = IpAddr::V4(gradwire_netns::testbed::host_ipv4(0));
    let mut c = AfXdpConfig::new("gw0", SocketAddr::new(ip, DATA_PORT));
    c.socket = socket_config();
    c.queues = queues;
    c
}

/// Asserts that `msg` says what to do about `errno`: the hint itself, after "hint: ".
fn assert_hint(msg: &str, errno: Errno) {
    println!("{errno}: {msg}");
    let hint = gradwire_ebpf::error::hint(errno as i32).expect("a hint for this errno");
    assert!(
        msg.contains(&format!("; hint: {hint}")),
        "no {errno} hint in: {msg}"
    );
}

/// The error of `r`, which must have failed.
fn failure<T>(r: Result<T, AfXdpError>, what: &str) -> AfXdpError {
    match r {
        Ok(_) => panic!("{what} succeeded"),
        Err(e) => e,
    }
}

#[test]
fn ebusy_when_another_af_xdp_socket_holds_the_queue() {
    let Some(tb) = testbed("ebusy_when_another_af_xdp_socket_holds_the_queue", 1) else {
        return;
    };
    let ifindex = tb.host(0).ifindex;
    tb.run_in(0, move || {
        // No classifier needed: a socket holds its queue from bind on.
        let first = XskSocket::bind(ifindex, 0, &socket_config()).expect("first socket");

        let err = failure(
            AfXdpDatapath::open(config(vec![0])),
            "datapath on a taken queue",
        );
        assert_eq!(err.raw_os_error(), Some(Errno::EBUSY as i32), "{err}");
        assert!(
            matches!(err, AfXdpError::Socket { queue: 0, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!(
                "AF_XDP socket on gw0 queue 0: bind to ifindex {ifindex} queue 0 in copy mode: "
            )),
            "{msg}"
        );
        assert_hint(&msg, Errno::EBUSY);
        // The OS error is the source, not a string.
        let source = std::error::Error::source(&err).expect("a source");
        let io = std::error::Error::source(source)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .expect("the io::Error under the step");
        assert_eq!(io.raw_os_error(), Some(Errno::EBUSY as i32));

        // The raw port (one error type with the datapath) and the bare socket layer agree.
        let err = failure(
            RawPort::open("gw0", AttachMode::Auto, &socket_config()),
            "raw port on a taken queue",
        );
        assert_eq!(err.raw_os_error(), Some(Errno::EBUSY as i32), "{err}");
        assert_hint(&err.to_string(), Errno::EBUSY);
        let err = XskSocket::bind(ifindex, 0, &socket_config()).expect_err("second bare socket");
        assert_eq!(err.raw_os_error(), Some(Errno::EBUSY as i32), "{err}");
        assert_hint(&err.to_string(), Errno::EBUSY);

        // With the first socket gone the queue is free, so it was what the kernel refused.
        drop(first);
        let dp = AfXdpDatapath::open(config(vec![0])).expect("datapath once the queue is free");
        // A second classifier on the interface is refused before the kernel is asked, with
        // the way out in the message.
        let err = failure(AfXdpDatapath::open(config(vec![0])), "second classifier");
        assert!(
            matches!(
                err,
                AfXdpError::Xdp {
                    source: XdpError::AlreadyAttached { .. },
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("ip link set dev gw0 xdp off"),
            "{err}"
        );
        drop(dp);
    })
    .expect("enter host 0");
}

#[test]
fn einval_for_a_queue_the_veth_does_not_have() {
    let Some(tb) = testbed("einval_for_a_queue_the_veth_does_not_have", 1) else {
        return;
    };
    let ifindex = tb.host(0).ifindex;
    tb.run_in(0, move || {
        let err = failure(AfXdpDatapath::open(config(vec![1])), "datapath on queue 1");
        assert_eq!(err.raw_os_error(), Some(Errno::EINVAL as i32), "{err}");
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!(
                "AF_XDP socket on gw0 queue 1: bind to ifindex {ifindex} queue 1 in copy mode: "
            )),
            "{msg}"
        );
        assert_hint(&msg, Errno::EINVAL);
        assert!(msg.contains("ethtool -l"), "{msg}");

        // The engine binds queue 0, then fails on queue 1 the same way (and cleans up).
        let err = failure(
            Engine::start(EngineConfig {
                afxdp: config(vec![0, 1]),
                cores: vec![],
            }),
            "engine on queues 0 and 1",
        );
        assert_eq!(err.raw_os_error(), Some(Errno::EINVAL as i32), "{err}");
        assert!(
            matches!(err, AfXdpError::Socket { queue: 1, .. }),
            "{err:?}"
        );
        assert_hint(&err.to_string(), Errno::EINVAL);
        // Nothing was left attached: queue 0 works.
        drop(AfXdpDatapath::open(config(vec![0])).expect("queue 0 after the failures"));
    })
    .expect("enter host 0");
}

/// Runs child test `name` inside host 0's namespace behind `wrapper` (commands that change
/// the process's privileges or limits and exec the rest), and checks that it ran and passed.
fn run_child(tb: &Testbed, name: &str, wrapper: &[&str]) {
    let exe = std::env::current_exe().expect("test binary");
    let exe = exe.to_str().expect("UTF-8 path of the test binary");
    let env = format!("{CHILD_ENV}={name}");
    let mut args = vec!["env", env.as_str()];
    args.extend_from_slice(wrapper);
    args.extend_from_slice(&[exe, "--exact", name, "--ignored", "--nocapture"]);
    let out = tb
        .exec_timeout(0, &args, CHILD_TIMEOUT)
        .unwrap_or_else(|e| panic!("child {name}: {e}"));
    eprintln!("child {name}:\n{out}");
    assert!(
        out.contains(&format!("CHILD {name} ok")),
        "child {name} did not run its checks: {out}"
    );
}

/// Whether this process is child `name` (else the ignored child test does nothing).
fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == name)
}

#[test]
fn eperm_without_privileges() {
    let Some(tb) = testbed("eperm_without_privileges", 1) else {
        return;
    };
    let nobody = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--",
    ];
    run_child(&tb, "child_without_privileges", &nobody);
}

/// Child side of `eperm_without_privileges`: user `nobody`, no capabilities.
#[test]
#[ignore = "helper process of eperm_without_privileges"]
fn child_without_privileges() {
    if !is_child("child_without_privileges") {
        return;
    }
    assert!(!nix::unistd::geteuid().is_root());
    // Loading the classifier is the first thing the kernel refuses.
    let err = failure(
        AfXdpDatapath::open(config(vec![0])),
        "unprivileged datapath",
    );
    assert_eq!(err.raw_os_error(), Some(Errno::EPERM as i32), "{err}");
    assert!(
        matches!(
            err,
            AfXdpError::Xdp {
                source: XdpError::PermissionDenied { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert_hint(&err.to_string(), Errno::EPERM);
    // And an AF_XDP socket on its own: socket(2) needs CAP_NET_RAW.
    let ifindex = nix::net::if_::if_nametoindex("gw0").expect("gw0 in the testbed namespace");
    let err = XskSocket::bind(ifindex, 0, &socket_config()).expect_err("unprivileged socket");
    assert_eq!(err.raw_os_error(), Some(Errno::EPERM as i32), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with("socket(AF_XDP): "), "{msg}");
    assert_hint(&msg, Errno::EPERM);
    println!("CHILD child_without_privileges ok");
}

#[test]
fn enobufs_when_the_umem_exceeds_the_locked_memory_limit() {
    let Some(tb) = testbed("enobufs_when_the_umem_exceeds_the_locked_memory_limit", 1) else {
        return;
    };
    // Root without CAP_IPC_LOCK (which would exempt it from the limit), locked memory 1 MiB.
    let limited = [
        "setpriv",
        "--inh-caps=-ipc_lock",
        "--bounding-set=-ipc_lock",
        "--",
        "prlimit",
        "--memlock=1048576",
        "--",
    ];
    run_child(&tb, "child_with_a_small_locked_memory_limit", &limited);
}

/// Child side of `enobufs_when_the_umem_exceeds_the_locked_memory_limit`.
#[test]
#[ignore = "helper process of enobufs_when_the_umem_exceeds_the_locked_memory_limit"]
fn child_with_a_small_locked_memory_limit() {
    if !is_child("child_with_a_small_locked_memory_limit") {
        return;
    }
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let memlock = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .expect("a locked-memory line");
    assert_eq!(
        memlock.split_whitespace().nth(3),
        Some("1048576"),
        "prlimit set the limit: {memlock}"
    );
    // 4096 frames of 4096 bytes: 16 MiB to register.
    let c = config(vec![0]);
    assert!(u64::from(c.socket.frames) * u64::from(c.socket.frame_size) > 1 << 20);
    let err = failure(
        AfXdpDatapath::open(c),
        "datapath over the locked-memory limit",
    );
    assert_eq!(err.raw_os_error(), Some(Errno::ENOBUFS as i32), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("AF_XDP socket on gw0 queue 0: XDP_UMEM_REG: "),
        "{msg}"
    );
    assert_hint(&msg, Errno::ENOBUFS);
    assert!(msg.contains("ulimit -l"), "{msg}");
    println!("CHILD child_with_a_small_locked_memory_limit ok");
}
