//! scripts/switch-apply.sh, run for real but against local files: dry runs must not call
//! ssh at all, and `--apply` talks only to a fake `ssh` placed first in PATH that records
//! what it was asked to do. No test contacts a switch.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Fake {
    dir: PathBuf,
    log: PathBuf,
}

/// A directory with an `ssh` that logs its arguments and stdin, and answers
/// `sonic-cfggen -d --print-data` with the fixture config.
fn fake_ssh(tag: &str) -> Fake {
    let dir = std::env::temp_dir().join(format!("gradwire-ssh-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("ssh.log");
    let fixture = root().join("control/tests/fixtures/sonic-running.json");
    let script = format!(
        "#!/bin/sh\necho \"ARGS: $*\" >> '{log}'\ncase \"$*\" in\n  *sonic-cfggen*) cat '{fixture}' ;;\n  *) echo 'STDIN:' >> '{log}'; cat >> '{log}' ;;\nesac\n",
        log = log.display(),
        fixture = fixture.display()
    );
    let ssh = dir.join("ssh");
    std::fs::write(&ssh, script).unwrap();
    Command::new("chmod").arg("+x").arg(&ssh).status().unwrap();
    Fake { dir, log }
}

fn apply_script(fake: &Fake, args: &[&str]) -> Output {
    let path = format!(
        "{}:{}",
        fake.dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("bash")
        .arg(root().join("scripts/switch-apply.sh"))
        .args(args)
        .env("PATH", path)
        .env("GRADWIRE_CTL", env!("CARGO_BIN_EXE_gradwire-ctl"))
        .output()
        .unwrap()
}

fn out(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const POLICY: [&str; 9] = [
    "--",
    "--base-threshold",
    "64KiB",
    "--step",
    "0.5",
    "--asic",
    "spectrum1",
    "--ports",
    "Ethernet0,Ethernet4",
];

#[test]
fn sonic_dry_run_shows_the_diff_and_sends_nothing() {
    let fake = fake_ssh("sonic-dry");
    let cur = root().join("control/tests/fixtures/sonic-running.json");
    let mut args = vec![
        "--target",
        "sonic",
        "--host",
        "admin@sw1",
        "--current",
        cur.to_str().unwrap(),
    ];
    args.extend_from_slice(&POLICY);
    let o = apply_script(&fake, &args);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("DRY RUN"), "{text}");
    assert!(
        text.contains("- QUEUE|Ethernet0|7: wred_profile (was \"AZURE_LOSSLESS\")"),
        "{text}"
    );
    assert!(
        text.contains("~ PORT_QOS_MAP|Ethernet0: dscp_to_tc_map = \"AZURE\" -> \"GRADWIRE\""),
        "{text}"
    );
    assert!(text.contains("\"op\": \"remove\""), "{text}");
    assert!(
        text.contains("sudo config apply-patch /tmp/gradwire-qos-patch.json"),
        "{text}"
    );
    assert!(!fake.log.exists(), "a dry run called ssh");
}

#[test]
fn sonic_dry_run_without_current_config() {
    let fake = fake_ssh("sonic-dry-nocur");
    let mut args = vec!["--target", "sonic", "--host", "sw1"];
    args.extend_from_slice(&POLICY);
    let o = apply_script(&fake, &args);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("no --current given"), "{text}");
    assert!(
        text.contains("+ SCHEDULER|GRADWIRE_STRICT: type = \"STRICT\""),
        "{text}"
    );
    assert!(!fake.log.exists(), "a dry run called ssh");
}

#[test]
fn sonic_apply_fetches_patches_and_applies_through_ssh() {
    let fake = fake_ssh("sonic-apply");
    let mut args = vec![
        "--target",
        "sonic",
        "--host",
        "admin@sw1",
        "--apply",
        "--yes",
    ];
    args.extend_from_slice(&POLICY);
    let o = apply_script(&fake, &args);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    let log = std::fs::read_to_string(&fake.log).unwrap();
    let fetch = log
        .find("ARGS: admin@sw1 sonic-cfggen -d --print-data")
        .unwrap();
    let copy = log
        .find("ARGS: admin@sw1 cat > /tmp/gradwire-qos-patch.json")
        .unwrap();
    let apply = log
        .find("ARGS: admin@sw1 sudo config apply-patch /tmp/gradwire-qos-patch.json")
        .unwrap();
    assert!(fetch < copy && copy < apply, "{log}");
    // what was copied is the exact patch against the fetched config
    let patch_text = &log[copy..apply];
    let json_start = patch_text.find('[').unwrap();
    let patch: serde_json::Value = serde_json::from_str(&patch_text[json_start..]).unwrap();
    assert!(patch
        .as_array()
        .unwrap()
        .iter()
        .any(|op| op["op"] == "remove" && op["path"] == "/QUEUE/Ethernet0|7/wred_profile"));
    // PFC off: the fixture's pfc_enable "3,4" goes
    assert!(patch
        .as_array()
        .unwrap()
        .iter()
        .any(|op| op["op"] == "remove" && op["path"] == "/PORT_QOS_MAP/Ethernet0/pfc_enable"));
    // the operator is told the change is not persisted, and about lossless buffers
    assert!(text.contains("running CONFIG_DB only"), "{text}");
    assert!(text.contains("BUFFER_PG|Ethernet0|3-4"), "{text}");
}

/// `--apply --current FILE` would patch against a possibly stale file: refused, and
/// nothing is contacted.
#[test]
fn sonic_apply_refuses_a_saved_current_config() {
    let fake = fake_ssh("sonic-apply-current");
    let cur = root().join("control/tests/fixtures/sonic-running.json");
    let mut args = vec![
        "--target",
        "sonic",
        "--host",
        "admin@sw1",
        "--apply",
        "--yes",
        "--current",
        cur.to_str().unwrap(),
    ];
    args.extend_from_slice(&POLICY);
    let o = apply_script(&fake, &args);
    let text = out(&o);
    assert_eq!(o.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--current is for dry runs") && text.contains("stale"),
        "{text}"
    );
    assert!(!fake.log.exists(), "refused before contacting anything");
}

/// No target's persistence command is in the reference: --save says so and does nothing.
#[test]
fn save_is_refused_with_the_reason() {
    let fake = fake_ssh("save");
    let cfg = root().join("hw-configs/sn2100-onyx/qos.onyx");
    for (target, extra, needle) in [
        ("sonic", &POLICY[..], "running CONFIG_DB"),
        ("onyx", &["--config", cfg.to_str().unwrap()][..], "Onyx"),
        ("nvue", &POLICY[..5], "nv config apply"),
    ] {
        let mut args = vec![
            "--target", target, "--host", "sw", "--apply", "--yes", "--save",
        ];
        args.extend_from_slice(extra);
        let o = apply_script(&fake, &args);
        let text = out(&o);
        assert_eq!(o.status.code(), Some(2), "{target}: {text}");
        assert!(
            text.contains("--save: the reference") && text.contains(needle),
            "{target}: {text}"
        );
        assert!(text.contains("nothing was done"), "{target}: {text}");
    }
    assert!(
        !fake.log.exists(),
        "--save refused before contacting anything"
    );
}

#[test]
fn onyx_and_nvue_dry_runs() {
    let fake = fake_ssh("cli-dry");
    let cur = root().join("control/tests/fixtures/onyx-running.txt");
    let cfg = root().join("hw-configs/sn2100-onyx/qos.onyx");
    let o = apply_script(
        &fake,
        &[
            "--target",
            "onyx",
            "--host",
            "sw2",
            "--config",
            cfg.to_str().unwrap(),
            "--current",
            cur.to_str().unwrap(),
        ],
    );
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("of 272 commands are not in"), "{text}");
    assert!(
        !text.contains("+ interface ethernet 1/1 qos trust L3"),
        "already present: {text}"
    );
    assert!(
        text.contains("+ interface ethernet 1/16 traffic-class 0 congestion-control both"),
        "{text}"
    );
    assert!(!text.contains("+ #"), "comments are not commands: {text}");
    let o = apply_script(
        &fake,
        &[
            "--target",
            "nvue",
            "--host",
            "sw3",
            "--",
            "--base-threshold",
            "64KiB",
            "--step",
            "0.5",
        ],
    );
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("+ nv config apply"), "{text}");
    assert!(text.contains("ssh sw3 bash -s"), "{text}");
    assert!(!fake.log.exists(), "a dry run called ssh");
}

#[test]
fn bad_arguments_are_refused() {
    let fake = fake_ssh("bad");
    for args in [
        vec!["--target", "cisco", "--host", "x", "--", "--step", "1"],
        vec!["--target", "sonic", "--", "--step", "1"],
        vec!["--target", "onyx", "--host", "x"],
        vec![
            "--target",
            "sonic",
            "--host",
            "x",
            "--config",
            "/etc/hostname",
        ],
    ] {
        let o = apply_script(&fake, &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", out(&o));
    }
    assert!(!fake.log.exists());
}
