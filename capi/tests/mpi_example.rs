//! The MPI example (examples/c/mpi_allreduce.c) as an HPC user runs it: scripts/capi.sh
//! installs the library this test was built with; `mpicc` compiles the example against
//! `pkg-config gradwire-static`; `mpirun` starts three ranks on this host (Open MPI's TCP
//! transport on loopback), which exchange gradwire endpoints with MPI_Allgather and
//! all-reduce with both libraries. Every rank must check both results exact and exit 0.
//!
//! Needs Open MPI (`mpicc`, `mpirun`: scripts/deps.sh installs Debian's openmpi-bin and
//! libopenmpi-dev). Without them the test fails under `GRADWIRE_REQUIRE_PRIV=1` (CI) and
//! says so otherwise. mpirun and its ranks run in their own process group, killed when the
//! test ends however it ends.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use common::programs::{lib_dir, repo, run};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(180);

fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// mpirun and every rank it started, killed (the whole process group) when dropped.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group this test created; no memory is involved.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(-(self.0.id() as i32), libc::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

#[test]
fn mpi_ranks_all_reduce_with_gradwire_and_mpi_and_both_are_exact() {
    if !have("mpicc") || !have("mpirun") {
        let msg = "mpicc/mpirun not found: install Open MPI (scripts/deps.sh: openmpi-bin, \
                   libopenmpi-dev)";
        if std::env::var("GRADWIRE_REQUIRE_PRIV").as_deref() == Ok("1") {
            panic!("{msg} (GRADWIRE_REQUIRE_PRIV=1 forbids skipping)");
        }
        eprintln!("SKIPPED: {msg}");
        return;
    }
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-mpi-example");
    let _ = std::fs::remove_dir_all(&scratch);
    let prefix = scratch.join("prefix");
    run(
        Command::new("bash")
            .arg(repo().join("scripts/capi.sh"))
            .arg("--from")
            .arg(lib_dir())
            .arg("--prefix")
            .arg(&prefix),
        "scripts/capi.sh",
    );
    let exe = scratch.join("mpi_allreduce");
    let line = format!(
        "mpicc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror {} \
         $(pkg-config --cflags --libs gradwire-static) -o {}",
        repo().join("examples/c/mpi_allreduce.c").display(),
        exe.display()
    );
    run(
        Command::new("sh")
            .arg("-c")
            .arg(&line)
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")),
        &line,
    );
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", "3", "--mca", "btl", "self,tcp"])
        .args([
            "--mca",
            "btl_tcp_if_include",
            "lo",
            "--mca",
            "oob_tcp_if_include",
            "lo",
        ])
        .arg(&exe)
        .args(["--min", "64K", "--max", "1M", "--iters", "3"])
        // As root Open MPI refuses to start without these.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env_remove("GW_LOCAL_IP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut group = Group(cmd.spawn().expect("mpirun"));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = group.0.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > DEADLINE {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if status.is_none() {
        // Killed here (the output pipes close), so the reads below end.
        // SAFETY: as in Group::drop.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(-(group.0.id() as i32), libc::SIGKILL);
        }
    }
    let mut out = String::new();
    group
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    group
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = status.unwrap_or_else(|| panic!("mpirun still ran after {DEADLINE:?}:\n{out}"));
    assert!(status.success(), "mpirun exited with {status}:\n{out}");
    assert!(
        out.contains("results: exact on every rank, both libraries"),
        "{out}"
    );
    for bytes in ["65536", "262144", "1048576"] {
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().next() == Some(bytes)
                    && l.split_whitespace().count() == 4),
            "no timing row for {bytes}:\n{out}"
        );
    }
}
