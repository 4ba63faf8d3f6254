//! The C example as a C user builds it: scripts/capi.sh installs the libraries this test was
//! built with, the header and the pkg-config files into a scratch prefix; gcc compiles
//! examples/c/allreduce.c with `pkg-config --cflags --libs gradwire` (shared) and
//! `gradwire-static`; three rank processes run the job on 127.0.0.1 and, as root, in three
//! network namespaces on a bridge. Every rank must exit 0 and print its lines; every child is
//! killed if the test fails or a rank outlives its deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::programs::{lib_dir, repo, run};

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gradwire_netns::require_root;
use gradwire_netns::testbed::{host_ipv4, Testbed, TestbedConfig};

const WORLD: usize = 3;
/// Generous: a debug build of three ranks on two cores takes a few seconds.
const RUN_DEADLINE: Duration = Duration::from_secs(90);

struct Binaries {
    shared: PathBuf,
    static_: PathBuf,
}

/// Installs through scripts/capi.sh and compiles the example twice, once per test binary.
fn binaries() -> &'static Binaries {
    static B: OnceLock<Binaries> = OnceLock::new();
    B.get_or_init(|| {
        let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-c-example");
        let _ = std::fs::remove_dir_all(&scratch);
        let prefix = scratch.join("prefix");
        let printed = run(
            Command::new("bash")
                .arg(repo().join("scripts/capi.sh"))
                .arg("--from")
                .arg(lib_dir())
                .arg("--prefix")
                .arg(&prefix),
            "scripts/capi.sh",
        );
        let pkg_path = prefix.join("lib/pkgconfig");
        assert!(
            printed.contains(&format!("PKG_CONFIG_PATH={}", pkg_path.display())),
            "capi.sh printed {printed:?}"
        );
        let src = repo().join("examples/c/allreduce.c");
        let shared = scratch.join("allreduce");
        let static_ = scratch.join("allreduce-static");
        // Exactly the README's commands, plus warnings as errors and an rpath for the shared
        // library.
        let cc = |pc: &str, extra: &str, out: &Path| {
            let line = format!(
                "gcc -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror {} \
                 $(pkg-config --cflags --libs {pc}) {extra} -o {}",
                src.display(),
                out.display()
            );
            run(
                Command::new("sh")
                    .arg("-c")
                    .arg(&line)
                    .env("PKG_CONFIG_PATH", &pkg_path),
                &line,
            );
        };
        cc(
            "gradwire",
            "-Wl,-rpath,$(pkg-config --variable=libdir gradwire)",
            &shared,
        );
        cc("gradwire-static", "", &static_);
        // The static binary needs no gradwire library at run time.
        let ldd = run(Command::new("ldd").arg(&static_), "ldd");
        assert!(!ldd.contains("gradwire"), "{ldd}");
        Binaries { shared, static_ }
    })
}

/// Rank processes, killed when dropped (a failing test leaves none behind).
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for every rank (killing them all at the deadline) and returns each one's output;
/// panics unless every rank exited 0.
fn wait_all(mut ranks: Ranks) -> Vec<String> {
    let start = Instant::now();
    let mut status = vec![None; ranks.0.len()];
    while status.iter().any(Option::is_none) {
        for (i, c) in ranks.0.iter_mut().enumerate() {
            if status[i].is_none() {
                status[i] = c.try_wait().unwrap();
            }
        }
        if start.elapsed() > RUN_DEADLINE {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut outputs = Vec::new();
    for (i, c) in ranks.0.iter_mut().enumerate() {
        if status[i].is_none() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut out = String::new();
        c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        c.stderr.take().unwrap().read_to_string(&mut out).unwrap();
        outputs.push(out);
    }
    for (i, s) in status.iter().enumerate() {
        match s {
            Some(s) if s.success() => {}
            Some(s) => panic!("rank {i} exited with {s}:\n{}", outputs.join("\n")),
            None => panic!(
                "rank {i} still ran after {RUN_DEADLINE:?} (killed):\n{}",
                outputs.join("\n")
            ),
        }
    }
    outputs
}

fn check_lines(outputs: &[String], address: impl Fn(usize) -> String) {
    for (r, out) in outputs.iter().enumerate() {
        let mut want = vec![
            format!("rank {r}: gradwire {}", env!("CARGO_PKG_VERSION")),
            format!("address {}", address(r)),
            format!("rank {r}: all-reduce ok: 10000 elements exact"),
            "delivered fraction 1.000".to_owned(),
            format!("rank {r}: broadcast ok"),
            format!("rank {r}: barrier ok"),
            format!("rank {r}: done"),
        ];
        match r {
            0 => want.push("rank 0: send ok".into()),
            1 => want.push("rank 1: recv ok: delivered fraction 1.000".into()),
            _ => {}
        }
        for w in want {
            assert!(out.contains(&w), "rank {r} did not print {w:?}:\n{out}");
        }
    }
}

fn spawn(mut cmd: Command, rank: usize, master_addr: &str, port: u16) -> Child {
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", WORLD.to_string())
        .env("MASTER_ADDR", master_addr)
        .env("MASTER_PORT", port.to_string())
        .env_remove("GW_LOCAL_IP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

#[test]
fn the_c_example_runs_three_ranks_on_loopback_shared_and_static() {
    let b = binaries();
    for bin in [&b.shared, &b.static_] {
        // Reserved until the job is over: rank 0 binds it, nobody else can.
        let port = common::MasterPort::reserve();
        let mut ranks = Ranks(Vec::new());
        for r in 0..WORLD {
            ranks
                .0
                .push(spawn(Command::new(bin), r, "127.0.0.1", port.port));
        }
        let outputs = wait_all(ranks);
        check_lines(&outputs, |_| "127.0.0.1".into());
    }
}

#[test]
fn the_c_example_reports_a_bad_master_and_exits_non_zero() {
    let b = binaries();
    let out = Command::new(&b.shared)
        .args(["0", "2", "127.0.0.1:99999", "127.0.0.1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rendezvous failed") && err.contains("GW_ERR_INVALID_ARGUMENT"),
        "{err}"
    );
}

#[test]
fn the_c_example_runs_three_ranks_in_network_namespaces() {
    if !require_root("the_c_example_runs_three_ranks_in_network_namespaces") {
        return;
    }
    let b = binaries();
    let tb = Testbed::up(&TestbedConfig::with_hosts(WORLD)).unwrap();
    let master = host_ipv4(0).to_string();
    let mut ranks = Ranks(Vec::new());
    for r in 0..WORLD {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &tb.host(r).netns])
            .arg(&b.shared);
        ranks.0.push(spawn(cmd, r, &master, 29_500));
    }
    // On a failure the ranks are killed as `wait_all` unwinds, then the testbed's drop
    // tears the namespaces down.
    let outputs = wait_all(ranks);
    tb.down().unwrap();
    // Each rank found its own address towards the master on its own.
    check_lines(&outputs, |r| host_ipv4(r).to_string());
}
