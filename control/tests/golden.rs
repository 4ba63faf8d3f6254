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

fn patch_ops(text: &str) -> Vec<(String, String)> {
    let ops: Vec<serde_json::Value> = serde_json::from_str(text).unwrap();
    ops.iter()
        .map(|o| {
            (
                o["op"].as_str().unwrap().to_string(),
                o["path"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Default Mellanox SONiC keeps `pfc_enable "3,4"`, making data queues 3 and 4 lossless;
/// gradwire's policy has PFC off on every queue, so the patch must remove it (exact patch)
/// or leave it absent (blind patch: add then remove).
#[test]
fn sonic_patches_turn_pfc_off() {
    let cur = dir().join("fixtures/sonic-running.json");
    let mut args = vec!["--ports", "Ethernet0,Ethernet4", "--current"];
    args.push(cur.to_str().unwrap());
    let ops = patch_ops(&render(
        "sonic-patch",
        &with(&SWITCH, &[])
            .into_iter()
            .chain(args)
            .collect::<Vec<_>>(),
    ));
    assert!(
        ops.contains(&("remove".into(), "/PORT_QOS_MAP/Ethernet0/pfc_enable".into())),
        "{ops:?}"
    );
    // Ethernet4 has no pfc_enable: nothing to remove there
    assert!(!ops
        .iter()
        .any(|(_, p)| p == "/PORT_QOS_MAP/Ethernet4/pfc_enable"));
    let ops = patch_ops(&render(
        "sonic-patch",
        &with(&SWITCH, &["--ports", "Ethernet0,Ethernet4"]),
    ));
    for port in ["Ethernet0", "Ethernet4"] {
        let path = format!("/PORT_QOS_MAP/{port}/pfc_enable");
        let last = ops.iter().rposition(|(_, p)| *p == path).expect("touched");
        assert_eq!(ops[last].0, "remove", "{ops:?}");
    }
}

/// `QUEUE|Ethernet0|3-4` range entries on the policy's ports are removed before the
/// per-queue entries are added; other ports' ranges stay.
#[test]
fn sonic_patch_removes_queue_ranges() {
    let cur = dir().join("fixtures/sonic-running-ranges.json");
    let cur = cur.to_str().unwrap();
    let text = render(
        "sonic-patch",
        &with(&SWITCH, &["--ports", "Ethernet0,Ethernet4", "--current"])
            .into_iter()
            .chain([cur])
            .collect::<Vec<_>>(),
    );
    check("sonic-patch-ranges.json", &text);
    let ops = patch_ops(&text);
    let pos = |path: &str| ops.iter().position(|(_, p)| p == path);
    for key in [
        "Ethernet0|0-2",
        "Ethernet0|3-4",
        "Ethernet0|5-6",
        "Ethernet4|3-4",
    ] {
        let i = pos(&format!("/QUEUE/{key}")).unwrap_or_else(|| panic!("{key}: {ops:?}"));
        assert_eq!(ops[i].0, "remove");
        let port = key.split('|').next().unwrap();
        let first_add = pos(&format!("/QUEUE/{port}|0")).unwrap();
        assert!(i < first_add, "{key} removed before the per-queue entries");
    }
    assert!(pos("/QUEUE/Ethernet8|3-4").is_none(), "not a policy port");
    assert_eq!(
        ops.iter().filter(|(o, _)| o == "remove").count(),
        4 + 2,
        "{ops:?}"
    );
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
