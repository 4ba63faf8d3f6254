//! The `gradwire-ctl` binary end to end: exit codes, messages naming the file and field,
//! and `thresholds` feeding `render`. Also: no input file makes the parsers panic.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gradwire_control::model::parse_model;
use gradwire_control::policy_file::{parse_policy_file, policy_from_file};
use proptest::prelude::*;

fn ctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gradwire-ctl"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gradwire-ctl-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models")
}

#[test]
fn help_lists_the_subcommands() {
    let o = ctl(&["--help"]);
    assert!(o.status.success());
    for s in ["render", "thresholds", "validate", "diff", "gen-hw-configs"] {
        assert!(stdout(&o).contains(s), "{s}");
    }
    let o = ctl(&["render", "--help"]);
    for f in [
        "--target",
        "--base-threshold",
        "--step",
        "--ports",
        "--asic",
        "--policy",
    ] {
        assert!(stdout(&o).contains(f), "{f}");
    }
    let o = ctl(&["thresholds", "--help"]);
    for f in ["--model", "--buffer", "--emit-policy"] {
        assert!(stdout(&o).contains(f), "{f}");
    }
}

#[test]
fn every_target_renders() {
    for (t, ports) in [
        ("sonic", "Ethernet0..8:4"),
        ("sonic-patch", "Ethernet0"),
        ("onyx", "1/1..2"),
        ("nvue", "swp1"),
        ("mlnx-qos", "enp1s0f0"),
        ("dcb", "enp1s0f0"),
    ] {
        let o = ctl(&[
            "render",
            "--target",
            t,
            "--base-threshold",
            "64KiB",
            "--step",
            "0.5",
            "--ports",
            ports,
            "--asic",
            "spectrum2",
        ]);
        assert!(o.status.success(), "{t}: {}", stderr(&o));
        assert!(!stdout(&o).is_empty());
    }
}

#[test]
fn usage_errors_exit_2_and_bad_values_exit_1() {
    let o = ctl(&["render", "--target", "juniper"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = ctl(&[
        "render",
        "--target",
        "sonic",
        "--base-threshold",
        "0",
        "--step",
        "0.5",
        "--ports",
        "Ethernet0",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("thresholds.base"), "{}", stderr(&o));
    let o = ctl(&[
        "render",
        "--target",
        "sonic",
        "--base-threshold",
        "1MiB",
        "--step",
        "0.5",
        "--ports",
        "Ethernet0",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("exceeds the port buffer"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&[
        "render",
        "--target",
        "sonic",
        "--base-threshold",
        "64KiB",
        "--step",
        "0.5",
    ]);
    assert!(stderr(&o).contains("no ports"), "{}", stderr(&o));
}

#[test]
fn bad_policy_files_name_file_and_field() {
    for (text, field) in [
        (
            "[thresholds]\nbase = \"64KiB\"\nstep = -1\n",
            "thresholds.step",
        ),
        (
            "[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n[dscp]\nmap = { 48 = 3 }\n",
            "dscp.map",
        ),
        (
            "[thresholds]\nbase = \"64KiB\"\nstep = 0.5\nports = 3\n",
            "ports",
        ),
        (
            "name = \"a b\"\n[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n",
            "name",
        ),
        (
            "[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n[dscp]\nmap = { 10 = 9 }\n",
            "dscp.map.10",
        ),
        (
            "[thresholds]\nqueues = [1, 2, 3, 4, 5, 6, \"7 furlongs\"]\n",
            "thresholds.queues[6]",
        ),
        (
            "port_buffer = \"1KiB\"\n[thresholds]\nbase = \"64KiB\"\nstep = 0\n",
            "port buffer",
        ),
        ("[thresholds\n", "p.toml"),
    ] {
        let f = tmp("p.toml");
        std::fs::write(&f, text).unwrap();
        let o = ctl(&["validate", f.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{text}");
        let e = stderr(&o);
        assert!(e.contains("p.toml"), "{text}: {e}");
        assert!(e.contains(field), "{text}: wanted {field} in {e}");
    }
    let o = ctl(&["validate", "/nonexistent/policy.toml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("/nonexistent/policy.toml"));
}

#[test]
fn validate_accepts_a_good_file_and_checks_targets() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/custom-policy.toml");
    let f = f.to_str().unwrap();
    let o = ctl(&["validate", f]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("ok"));
    let o = ctl(&["validate", f, "--target", "sonic"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // its ports are SONiC names, not Onyx ones
    let o = ctl(&["validate", f, "--target", "onyx"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("Ethernet8"), "{}", stderr(&o));
}

#[test]
fn thresholds_feed_render() {
    let pol = tmp("resnet.toml");
    let m = models().join("resnet50.toml");
    let o = ctl(&[
        "thresholds",
        "--model",
        m.to_str().unwrap(),
        "--buffer",
        "512KiB",
        "--emit-policy",
        pol.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report = stdout(&o);
    assert!(
        report.contains("optimised cost") && report.contains("best arithmetic cost"),
        "{report}"
    );
    let o = ctl(&["validate", pol.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&[
        "render",
        "--target",
        "sonic",
        "--policy",
        pol.to_str().unwrap(),
        "--ports",
        "Ethernet0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    // the JSON report and the rendered profiles agree on every threshold
    let o = ctl(&["thresholds", "--model", m.to_str().unwrap(), "--json"]);
    let rep: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    for q in rep["optimized"]["queues"].as_array().unwrap() {
        let queue = q["queue"].as_u64().unwrap();
        let want = q["threshold"].as_u64().unwrap().to_string();
        assert_eq!(
            doc["WRED_PROFILE"][format!("GRADWIRE_Q{queue}")]["green_min_threshold"],
            want.as_str()
        );
    }
    assert!(
        rep["optimized"]["total_cost"].as_f64().unwrap()
            < rep["best_arithmetic_cost"].as_f64().unwrap()
    );
    // --base-threshold alone cannot replace explicit thresholds
    let o = ctl(&[
        "render",
        "--target",
        "sonic",
        "--policy",
        pol.to_str().unwrap(),
        "--ports",
        "Ethernet0",
        "--step",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("explicit thresholds"), "{}", stderr(&o));
}

#[test]
fn bad_model_files_are_reported() {
    let f = tmp("m.toml");
    std::fs::write(
        &f,
        "name = \"x\"\ntotal_params = 5\n[[layers]]\nname = \"a\"\nparams = 4\n",
    )
    .unwrap();
    let o = ctl(&["thresholds", "--model", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("m.toml") && stderr(&o).contains("total_params"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&[
        "thresholds",
        "--model",
        models().join("vgg16.toml").to_str().unwrap(),
        "--theta",
        "1.5",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("theta"), "{}", stderr(&o));
}

proptest! {
    #[test]
    fn arbitrary_policy_text_never_panics(text in ".{0,300}") {
        for name in ["p.toml", "p.json"] {
            let path = Path::new(name);
            if let Ok(f) = parse_policy_file(path, &text) {
                if let Ok(p) = policy_from_file(path, &f) {
                    let _ = p.validate();
                    for t in gradwire_control::Target::ALL {
                        let _ = gradwire_control::render(&p, t);
                    }
                }
            }
        }
    }

    #[test]
    fn arbitrary_model_text_never_panics(text in ".{0,300}") {
        let _ = parse_model(Path::new("m.toml"), &text);
        let _ = parse_model(Path::new("m.json"), &text);
    }

    #[test]
    fn structured_policy_files_never_panic(base in any::<u64>(), step in any::<f64>(),
                                          buf in any::<u64>(), tc in -3i64..12, dscp in 0u32..80) {
        let text = format!(
            "port_buffer = {buf}\nports = [\"Ethernet0\"]\nasic = \"spectrum1\"\n[thresholds]\nbase = {base}\nstep = {step:?}\n[dscp]\nmap = {{ {dscp} = {tc} }}\n"
        );
        let path = Path::new("p.toml");
        if let Ok(f) = parse_policy_file(path, &text) {
            if let Ok(p) = policy_from_file(path, &f) {
                for t in gradwire_control::Target::ALL {
                    let _ = gradwire_control::render(&p, t);
                }
            }
        }
    }
}
