//! Golden-file tests: every renderer's output for fixed policies, byte for byte.
//!
//! The files live in `control/tests/golden/`. After an intended change, regenerate them
//! with `UPDATE_GOLDEN=1 cargo test -p gradwire-control --test golden` and review the diff.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use gradwire_control::cli::run;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

fn ctl(args: &[&str]) -> String {
    let mut full = vec!["gradwire-ctl"];
    full.extend_from_slice(args);
    let mut out = Vec::new();
    run(full, &mut out).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    String::from_utf8(out).unwrap()
}

fn check(name: &str, actual: &str) {
    let path = dir().join("golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; create it with UPDATE_GOLDEN=1", path.display()));
    if expected != actual {
        let line = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
        panic!(
            "golden file {name} differs at line {}:\n  expected: {:?}\n  actual:   {:?}\n\
             rerun with UPDATE_GOLDEN=1 to accept the new output",
            line + 1,
            expected.lines().nth(line),
            actual.lines().nth(line)
        );
    }
}

const SWITCH: [&str; 6] = [
    "--base-threshold",
    "64KiB",
    "--step",
    "0.5",
    "--asic",
    "spectrum1",
];

fn render(target: &str, extra: &[&str]) -> String {
    let mut args = vec!["render", "--target", target];
    args.extend_from_slice(extra);
    ctl(&args)
}

fn with(base: &[&'static str], more: &[&'static str]) -> Vec<&'static str> {
    base.iter().chain(more).copied().collect()
}

#[test]
fn sonic_fragment() {
    check(
        "sonic.json",
        &render("sonic", &with(&SWITCH, &["--ports", "Ethernet0,Ethernet4"])),
    );
}

#[test]
fn sonic_patch_blind() {
    check(
        "sonic-patch.json",
        &render(
            "sonic-patch",
            &with(&SWITCH, &["--ports", "Ethernet0,Ethernet4"]),
        ),
    );
}

#[test]
fn sonic_patch_against_running_config() {
    let cur = dir().join("fixtures/sonic-running.json");
    let cur = cur.to_str().unwrap();
    check(
        "sonic-patch-current.json",
        &render(
            "sonic-patch",
            &with(&SWITCH, &["--ports", "Ethernet0,Ethernet4", "--current"])
                .into_iter()
                .chain([cur])
                .collect::<Vec<_>>(),
        ),
    );
    let mut args = vec![
        "diff",
        "--target",
        "sonic",
        "--current",
        cur,
        "--ports",
        "Ethernet0,Ethernet4",
    ];
    args.extend_from_slice(&SWITCH);
    check("sonic-diff.txt", &ctl(&args));
}

#[test]
fn onyx() {
    check(
        "onyx.txt",
        &render("onyx", &with(&SWITCH, &["--ports", "1/1,1/2"])),
    );
    let cur = dir().join("fixtures/onyx-running.txt");
    let mut args = vec![
        "diff",
        "--target",
        "onyx",
        "--current",
        cur.to_str().unwrap(),
        "--ports",
        "1/1",
    ];
    args.extend_from_slice(&SWITCH);
    check("onyx-diff.txt", &ctl(&args));
}

#[test]
fn nvue() {
    check(
        "nvue.txt",
        &render(
            "nvue",
            &[
                "--base-threshold",
                "64KiB",
                "--step",
                "0.5",
                "--asic",
                "spectrum2",
            ],
        ),
    );
}

#[test]
fn hosts() {
    check(
        "mlnx-qos.sh",
        &render("mlnx-qos", &["--ports", "enp1s0f0np0"]),
    );
    check("dcb.sh", &render("dcb", &["--ports", "enp1s0f0np0"]));
    check("dcb-noports.sh", &render("dcb", &[]));
}

#[test]
fn custom_policy_every_target() {
    let p = dir().join("fixtures/custom-policy.toml");
    let p = p.to_str().unwrap();
    check("custom-sonic.json", &render("sonic", &["--policy", p]));
    check(
        "custom-onyx.txt",
        &render("onyx", &["--policy", p, "--ports", "1/3"]),
    );
    check(
        "custom-nvue.txt",
        &render("nvue", &["--policy", p, "--ports", "swp1"]),
    );
    check(
        "custom-mlnx-qos.sh",
        &render("mlnx-qos", &["--policy", p, "--ports", "eth2"]),
    );
    check(
        "custom-dcb.sh",
        &render("dcb", &["--policy", p, "--ports", "eth2"]),
    );
}

#[test]
fn no_asic_means_no_rounding() {
    check(
        "nvue-noasic.txt",
        &render("nvue", &["--base-threshold", "100000", "--step", "0.3"]),
    );
}
