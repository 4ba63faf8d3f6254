//! hw-configs/ is exactly what `scripts/gen-hw-configs.sh` generates: every file is
//! regenerated in memory and compared byte for byte; missing files, and extra files in the
//! generated directories, fail too.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use gradwire_control::hwconfigs::{compare, generate, HW_CONFIGS};

#[test]
fn checked_in_hw_configs_match_the_generator() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hw-configs");
    let files = generate().unwrap();
    let stale = compare(&dir, &files);
    assert!(
        stale.is_empty(),
        "hw-configs/ is out of date: {stale:#?}\nrun scripts/gen-hw-configs.sh and review the diff"
    );
}

#[test]
fn every_role_the_issue_asks_for_is_there() {
    let files = generate().unwrap();
    for f in [
        "sn2100-sonic/qos-config_db.json",
        "sn2100-sonic/qos-patch.json",
        "sn2100-onyx/qos.onyx",
        "cumulus-spectrum2/qos.nvue",
        "connectx-25g/mlnx-qos.sh",
        "connectx-25g/dcb.sh",
        "connectx-100g/mlnx-qos.sh",
        "connectx-100g/dcb.sh",
    ] {
        assert!(files.contains_key(f), "{f}");
    }
    for c in HW_CONFIGS {
        let readme = &files[&format!("{}/README.md", c.dir)];
        for f in c.files {
            assert!(readme.contains(f.name), "{} README names {}", c.dir, f.name);
        }
    }
    // SN2100 is Spectrum-1: thresholds in whole 96-byte cells
    let sonic: serde_json::Value =
        serde_json::from_str(&files["sn2100-sonic/qos-config_db.json"]).unwrap();
    for q in 0..7 {
        let t = sonic["WRED_PROFILE"][format!("GRADWIRE_Q{q}")]["green_min_threshold"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap();
        assert_eq!(t % 96, 0, "queue {q}: {t}");
    }
    assert_eq!(sonic["PORT_QOS_MAP"].as_object().unwrap().len(), 16);
}

#[test]
fn a_stale_file_is_detected() {
    let tmp = std::env::temp_dir().join(format!("gradwire-hw-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let files = generate().unwrap();
    for (rel, text) in &files {
        let p = tmp.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    assert!(compare(&tmp, &files).is_empty());
    std::fs::write(tmp.join("sn2100-onyx/qos.onyx"), "edited\n").unwrap();
    std::fs::write(tmp.join("sn2100-onyx/extra.txt"), "x").unwrap();
    std::fs::create_dir_all(tmp.join("other-tool")).unwrap();
    std::fs::write(tmp.join("other-tool/x.conf"), "not ours").unwrap();
    std::fs::remove_file(tmp.join("connectx-25g/dcb.sh")).unwrap();
    let stale = compare(&tmp, &files);
    let _ = std::fs::remove_dir_all(&tmp);
    assert_eq!(
        stale,
        [
            "connectx-25g/dcb.sh missing",
            "sn2100-onyx/qos.onyx differs",
            "sn2100-onyx/extra.txt is not generated"
        ]
    );
}

/// The host scripts run under plain sh and call the tools with the expected arguments
/// (fake `dcb` and `mlnx_qos` first in PATH log their arguments).
#[test]
fn host_scripts_run_with_fake_tools() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::temp_dir().join(format!("gradwire-hosttools-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log");
    for tool in ["dcb", "mlnx_qos"] {
        let p = dir.join(tool);
        std::fs::write(
            &p,
            format!("#!/bin/sh\necho \"{tool} $*\" >> '{}'\n", log.display()),
        )
        .unwrap();
        std::process::Command::new("chmod")
            .arg("+x")
            .arg(&p)
            .status()
            .unwrap();
    }
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |script: &str, args: &[&str]| {
        std::process::Command::new("sh")
            .arg(root.join(script))
            .args(args)
            .env("PATH", &path)
            .output()
            .unwrap()
    };
    let o = run("hw-configs/connectx-25g/dcb.sh", &["eth9", "eth10"]);
    assert!(o.status.success(), "{o:?}");
    let o = run("hw-configs/connectx-100g/mlnx-qos.sh", &["eth9"]);
    assert!(o.status.success(), "{o:?}");
    // without interfaces the scripts refuse
    let o = run("hw-configs/connectx-100g/dcb.sh", &[]);
    assert_eq!(o.status.code(), Some(2));
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3 * 2 + 3, "{text}");
    assert_eq!(lines[0], "dcb apptrust set dev eth9 order dscp pcp");
    assert!(
        lines[1].starts_with("dcb app replace dev eth9 dscp-prio 0:0 "),
        "{text}"
    );
    assert!(
        lines[1].contains(" 46:6 ") && lines[1].contains(" 48:7 ") && lines[1].ends_with(" 63:0")
    );
    assert_eq!(lines[1].split(' ').count(), 6 + 64);
    assert!(lines[2].ends_with(
        "tc-tsa 0:strict 1:strict 2:strict 3:strict 4:strict 5:strict 6:strict 7:strict"
    ));
    assert!(lines[3].contains("dev eth10"));
    assert_eq!(lines[6], "mlnx_qos -i eth9 --trust dscp");
    assert_eq!(lines[7].matches("--dscp2prio set,").count(), 64);
    assert!(lines[7].contains("--dscp2prio set,48,7"));
    assert_eq!(lines[8], "mlnx_qos -i eth9 -p 0,1,2,3,4,5,6,7 -s strict,strict,strict,strict,strict,strict,strict,strict");
}
