//! Sizes, rates and addresses as users write them: the `gradwire` command line, the
//! `gradwire-ctl` command line, policy files and topology files accept the same spellings
//! and refuse a bad one with the same message (the `gradwire-units` grammar); `--to` takes
//! a host name.

#![allow(clippy::unwrap_used)]

mod common;

use common::{gradwire, ChildGuard, TempDir};

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A topology that `testbed up` refuses while reading it (before any namespace exists).
fn topology(rate: &str, policy: Option<&str>) -> String {
    let policy = policy.map_or(String::new(), |p| format!("policy = \"{p}\"\n"));
    format!(
        "name = \"spell\"\n{policy}[defaults]\nrate = \"{rate}\"\ndelay = \"20us\"\n\
         [[switch]]\nname = \"s0\"\n[[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n"
    )
}

fn ctl(args: &[&str]) -> String {
    let mut out = Vec::new();
    let args = std::iter::once("gradwire-ctl").chain(args.iter().copied());
    gradwire_control::cli::run(args, &mut out)
        .unwrap_err()
        .to_string()
}

#[test]
fn a_bad_rate_reads_the_same_on_the_command_line_and_in_a_topology() {
    let dir = TempDir::new("gw-spellings", "rate");
    for bad in ["25Gbps", "100", "fast", "64KiB"] {
        let want = gradwire_units::parse_rate(bad).unwrap_err().to_string();
        let o = gradwire(&["demo", "--datapath", "loopback", "--line-rate", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        assert!(stderr(&o).contains(&want), "{bad}: {}", stderr(&o));

        let file = dir.write("t.toml", &topology(bad, None));
        let o = gradwire(&["testbed", "up", &file]);
        assert_eq!(o.status.code(), Some(1), "{bad}");
        let e = stderr(&o);
        assert!(
            e.contains(&format!("field `defaults.rate`: {want}")),
            "{bad}: {e}"
        );
    }
    // ... and the good spellings are good in both.
    for good in ["25G", "25Gbit", "200Mbit", "200M"] {
        let cli = gradwire_units::parse_rate(good).unwrap();
        let qos = gradwire_control::render::fabric::FabricQos::from_policy(
            &gradwire_fabric::topology::default_policy(),
        )
        .unwrap();
        let t = gradwire_fabric::topology::Topology::from_toml(&topology(good, None), qos).unwrap();
        assert_eq!(t.switches[0].ports[0].link.rate_bps, cli.bps(), "{good}");
    }
}

#[test]
fn a_bad_size_reads_the_same_in_gradwire_gradwire_ctl_and_a_policy_file() {
    let dir = TempDir::new("gw-spellings", "size");
    for bad in ["64KiBs", "KiB", "1.5KiB", "99999999999999999999"] {
        let want = gradwire_units::parse_size(bad).unwrap_err().to_string();
        let o = gradwire(&["demo", "--datapath", "loopback", "--size", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        assert!(stderr(&o).contains(&want), "{bad}: {}", stderr(&o));

        let e = ctl(&[
            "render",
            "--target",
            "sonic",
            "--ports",
            "Ethernet0",
            "--base-threshold",
            bad,
            "--step",
            "0.5",
        ]);
        assert_eq!(e, format!("--base-threshold: {want}"), "{bad}");

        // The topology's policy file, read by gradwire-control's policy-file reader.
        let policy = dir.write(
            "p.toml",
            &format!("port_buffer = \"{bad}\"\n[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n"),
        );
        let file = dir.write("t.toml", &topology("1Gbit", Some(&policy)));
        let o = gradwire(&["testbed", "up", &file]);
        assert_eq!(o.status.code(), Some(1), "{bad}");
        let e = stderr(&o);
        assert!(
            e.contains(&format!("field `port_buffer`: {want}")),
            "{bad}: {e}"
        );
    }
}

#[test]
fn a_host_name_that_does_not_resolve_is_named() {
    let o = gradwire(&["send", "--to", "no-such-host.invalid:7070"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("cannot resolve host name \"no-such-host.invalid\""),
        "{e}"
    );
    let o = gradwire(&["recv", "--listen", "hostb"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("\"hostb\" has no port"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn send_to_localhost_reaches_a_receiver_on_127_0_0_1() {
    let common = [
        "--size",
        "64KiB",
        "--count",
        "1",
        "--loss-bound",
        "0",
        "--timeout",
        "20",
    ];
    // `localhost` is 127.0.0.1, shared with everything else on this host, and the receiver
    // binds its port itself (nothing can hold it for it): a port found taken (control or the
    // data port after it) is retried with another, the whole start again.
    let base = 20_000 + (std::process::id() % 6_000) as u16 * 2;
    let mut taken = Vec::new();
    let (mut recv, port) = loop {
        assert!(taken.len() < 8, "every port tried was in use: {taken:?}");
        let port = base + 2 * taken.len() as u16;
        let mut recv = ChildGuard(Some(
            Command::new(env!("CARGO_BIN_EXE_gradwire"))
                .args(["recv", "--listen", &format!("127.0.0.1:{port}")])
                .args(["--accept-timeout", "60"])
                .args(common)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ));
        // The receiver says it waits once its control socket listens; its other lines (a
        // failure) are kept until its stderr ends.
        let (tx, rx) = mpsc::channel();
        let err = recv.child().stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut said = Vec::new();
        let listening = loop {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(line) if line.contains("waiting for a sender") => break true,
                Ok(line) => said.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break false,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("receiver never listened"),
            }
        };
        if listening {
            break (recv, port);
        }
        let status = recv.0.take().unwrap().wait().unwrap();
        let said = said.join("\n");
        assert!(
            said.contains("Address already in use"),
            "receiver exited ({status}) before listening: {said}"
        );
        taken.push(port);
    };

    let to = format!("localhost:{port}");
    let o = gradwire(&[&["send", "--to", &to, "--json"][..], &common[..]].concat());
    assert!(o.status.success(), "send --to {to}: {}", stderr(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["role"], "send");
    assert_eq!(s["count"], 1);
    assert!(recv.child().wait().unwrap().success());
}
