//! docs/switch-control.md states facts about the code around it; these checks keep the
//! statements that reviews found wrong from drifting again.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn doc() -> String {
    std::fs::read_to_string(root().join("docs/switch-control.md")).unwrap()
}

/// The data plane's control channel takes its DSCP from gradwire-qos; the doc says so and
/// no longer says the data plane does not use the crate.
#[test]
fn doc_matches_the_data_plane_use_of_gradwire_qos() {
    let channel = std::fs::read_to_string(root().join("dataplane/src/ctrl_channel.rs")).unwrap();
    assert!(channel.contains("gradwire_qos::CONTROL_DSCP"));
    let d = doc();
    assert!(!d.contains("does not use `gradwire-qos`"), "stale claim");
    assert!(d.contains("imports `CONTROL_DSCP`"));
    assert!(d.contains("DLCP end-to-end issue"));
}

/// The RoCE collision (DSCP 26 / 48) is warned about, with how to move the code points.
#[test]
fn doc_warns_about_roce_code_points() {
    let d = doc();
    let w = &d[d
        .find("Warning: fabrics shared with RoCE")
        .expect("warning")..];
    let w = &w[..w.find("\n\n").unwrap_or(w.len())];
    for needle in ["26", "48", "CNP", "control = [", "map = {", "control_dscp"] {
        assert!(w.contains(needle), "{needle} in {w}");
    }
}

/// Persistence: the doc names, per target, that the reference has no save command, as
/// switch-apply.sh --save says.
#[test]
fn doc_explains_persistence() {
    let d = doc();
    assert!(d.contains("### Persistence"));
    assert!(d.contains("--save"));
    let script = std::fs::read_to_string(root().join("scripts/switch-apply.sh")).unwrap();
    assert!(script.contains("--save) save=1"));
}
