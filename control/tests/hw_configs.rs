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
        "sn2100-sonic/qos-patch-25g.json",
        "sn2100-onyx/qos.onyx",
        "sn2100-onyx/qos-25g.onyx",
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
    assert_eq!(lines.len(), 4 * 2 + 4, "{text}");
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
    // PFC explicitly off on every priority (DLCP drops, it does not pause)
    assert_eq!(
        lines[3],
        "dcb pfc set dev eth9 prio-pfc 0:off 1:off 2:off 3:off 4:off 5:off 6:off 7:off"
    );
    assert!(lines[4].contains("dev eth10"));
    assert_eq!(lines[8], "mlnx_qos -i eth9 --trust dscp");
    assert_eq!(lines[9].matches("--dscp2prio set,").count(), 64);
    assert!(lines[9].contains("--dscp2prio set,48,7"));
    assert_eq!(lines[10], "mlnx_qos -i eth9 -p 0,1,2,3,4,5,6,7 -s strict,strict,strict,strict,strict,strict,strict,strict");
    assert_eq!(lines[11], "mlnx_qos -i eth9 -f 0,0,0,0,0,0,0,0");
}

/// 25G and 100G each ship switch thresholds for their speed (the host scripts are the
/// same on purpose), and the host READMEs point at the matching switch files.
#[test]
fn each_speed_has_its_switch_config() {
    let files = generate().unwrap();
    let q6 = |f: &str| -> u64 {
        let ops: Vec<serde_json::Value> = serde_json::from_str(&files[f]).unwrap();
        let wred = ops
            .iter()
            .find(|o| o["path"] == "/WRED_PROFILE/GRADWIRE_Q6")
            .unwrap();
        wred["value"]["green_min_threshold"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    // Spectrum-1 cells: 16 KiB -> 16416 B, 64 KiB -> 65568 B
    assert_eq!(q6("sn2100-sonic/qos-patch-25g.json"), 16416);
    assert_eq!(q6("sn2100-sonic/qos-patch.json"), 65568);
    assert!(files["sn2100-onyx/qos-25g.onyx"]
        .contains("interface ethernet 1/1 traffic-class 6 congestion-control both minimum-absolute 16 maximum-absolute 16"));
    let r25 = &files["connectx-25g/README.md"];
    let r100 = &files["connectx-100g/README.md"];
    assert!(
        r25.contains("qos-patch-25g.json") && r25.contains("qos-25g.onyx") && r25.contains("16KiB"),
        "{r25}"
    );
    assert!(
        r100.contains("qos-patch.json") && r100.contains("64KiB") && !r100.contains("-25g."),
        "{r100}"
    );
}
