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
    // a flag's value is reported against the flag, not the policy-file field
    assert!(
        stderr(&o).contains("--base-threshold: the base threshold T must be > 0"),
        "{}",
        stderr(&o)
    );
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

/// Negative values reach gradwire's own validation (clap used to reject them as unknown
/// flags), and errors about a flag's value name the flag.
#[test]
fn negative_numbers_get_clear_flag_errors() {
    let render = |extra: &[&str]| {
        let mut a = vec!["render", "--target", "sonic", "--ports", "Ethernet0"];
        a.extend_from_slice(extra);
        ctl(&a)
    };
    let o = render(&["--base-threshold", "64KiB", "--step", "-0.5"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("--step: the step d must be a finite number >= 0, got -0.5"),
        "{e}"
    );
    assert!(
        !e.contains("thresholds.step") && !e.contains("unexpected argument"),
        "{e}"
    );
    let o = render(&["--base-threshold", "-5", "--step", "0.5"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("--base-threshold: \"-5\" is not a size"), "{e}");
    let o = render(&[
        "--base-threshold",
        "64KiB",
        "--step",
        "0.5",
        "--buffer",
        "-1MiB",
    ]);
    assert!(stderr(&o).contains("--buffer:"), "{}", stderr(&o));
    let o = render(&[
        "--base-threshold",
        "64KiB",
        "--step",
        "0.5",
        "--buffer",
        "2GiB",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("--buffer:") && e.contains("1 GiB"), "{e}");
    let o = ctl(&[
        "thresholds",
        "--model",
        models().join("vgg16.toml").to_str().unwrap(),
        "--theta",
        "-0.5",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("theta"), "{}", stderr(&o));
    let o = ctl(&[
        "thresholds",
        "--model",
        models().join("vgg16.toml").to_str().unwrap(),
        "--step",
        "-1",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--step:"), "{}", stderr(&o));
}

/// With a policy of explicit thresholds, a lone --step is what is wrong, not a missing
/// --base-threshold.
#[test]
fn explicit_policy_with_a_lone_flag_names_that_flag() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/custom-policy.toml");
    let f = f.to_str().unwrap();
    for (flag, value) in [("--step", "1"), ("--base-threshold", "64KiB")] {
        let o = ctl(&["render", "--target", "sonic", "--policy", f, flag, value]);
        assert_eq!(o.status.code(), Some(1));
        let e = stderr(&o);
        assert!(
            e.starts_with(&format!("gradwire-ctl: {flag}: ")) && e.contains("explicit thresholds"),
            "{flag}: {e}"
        );
    }
}

/// A negative or fractional size in a policy file names the field and the accepted forms
/// (it used to be serde's "did not match any variant of untagged enum SizeValue").
#[test]
fn bad_sizes_in_policy_files_name_the_field_and_the_forms() {
    for (text, field, given) in [
        (
            "[thresholds]\nbase = -5\nstep = 0.5\n",
            "thresholds.base",
            "-5",
        ),
        (
            "port_buffer = 1.5\n[thresholds]\nbase = 1\nstep = 0.5\n",
            "port_buffer",
            "1.5",
        ),
        (
            "[thresholds]\nqueues = [7, 6, 5, 4, 3, 2, -1]\n",
            "thresholds.queues[6]",
            "-1",
        ),
    ] {
        let f = tmp("sizes.toml");
        std::fs::write(&f, text).unwrap();
        let o = ctl(&["validate", f.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{text}");
        let e = stderr(&o);
        assert!(
            e.contains(&format!("field `{field}`: {given} is not a size")),
            "{text}: {e}"
        );
        assert!(e.contains("65536") && e.contains("64KiB"), "{text}: {e}");
        assert!(!e.contains("untagged enum"), "{text}: {e}");
    }
    let f = tmp("sizes.json");
    std::fs::write(&f, r#"{"thresholds": {"base": -5, "step": 0.5}}"#).unwrap();
    let o = ctl(&["validate", f.to_str().unwrap()]);
    assert!(
        stderr(&o).contains("field `thresholds.base`: -5 is not a size"),
        "{}",
        stderr(&o)
    );
}

/// A threshold too large to round up to cells is an overflow error, not a saturated
/// 18446744073709551615 B blamed on the buffer; a buffer above 1 GiB is refused.
#[test]
fn overflow_and_huge_buffers_are_validation_errors() {
    let f = tmp("huge.toml");
    std::fs::write(
        &f,
        "asic = \"spectrum1\"\n[thresholds]\nqueues = [\"18446744073709551615\", 6, 5, 4, 3, 2, 1]\n",
    )
    .unwrap();
    let o = ctl(&["validate", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("queue 0") && e.contains("overflow"), "{e}");
    assert!(!e.contains("exceeds the port buffer"), "{e}");
    std::fs::write(
        &f,
        "port_buffer = \"2GiB\"\n[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n",
    )
    .unwrap();
    let o = ctl(&["validate", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let e = stderr(&o);
    assert!(
        e.contains("field `port_buffer`") && e.contains("1 GiB"),
        "{e}"
    );
}

/// `validate FILE` without --target still checks port names: all must be legal for at
/// least one target.
#[test]
fn validate_without_target_checks_port_names() {
    for (ports, needle) in [
        (r#"["Ethernet0", "1/1"]"#, "mix"),
        (
            r#"["a b"]"#,
            "\"a b\" is not a legal port name for any target",
        ),
    ] {
        let f = tmp("ports.toml");
        std::fs::write(
            &f,
            format!("ports = {ports}\n[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n"),
        )
        .unwrap();
        let o = ctl(&["validate", f.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{ports}: {}", stdout(&o));
        let e = stderr(&o);
        assert!(
            e.contains("field `ports`") && e.contains(needle),
            "{ports}: {e}"
        );
    }
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/custom-policy.toml");
    let o = ctl(&["validate", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("port names legal for: sonic, sonic-patch, mlnx-qos, dcb"),
        "{}",
        stdout(&o)
    );
}

/// Rendering SONiC warns on stderr (the JSON on stdout stays clean) about what the output
/// cannot change: PFC / lossless buffers, and for the fragment, pfc_enable itself.
#[test]
fn sonic_render_warns_about_pfc_and_buffers() {
    let base = [
        "--base-threshold",
        "64KiB",
        "--step",
        "0.5",
        "--ports",
        "Ethernet0",
    ];
    let mut a = vec!["render", "--target", "sonic"];
    a.extend_from_slice(&base);
    let o = ctl(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let _: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let e = stderr(&o);
    assert!(e.contains("cannot remove PORT_QOS_MAP pfc_enable"), "{e}");
    assert!(e.contains("BUFFER_PG") && e.contains("BUFFER_QUEUE"), "{e}");
    let cur = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sonic-running.json");
    let mut a = vec![
        "render",
        "--target",
        "sonic-patch",
        "--current",
        cur.to_str().unwrap(),
    ];
    a.extend_from_slice(&base);
    let o = ctl(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let _: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let e = stderr(&o);
    assert!(
        e.contains("BUFFER_PG|Ethernet0|3-4") && e.contains("BUFFER_QUEUE|Ethernet0|3-4"),
        "{e}"
    );
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
