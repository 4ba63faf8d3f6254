//! `gradwire experiment mlnet|priority|wan` end to end on small settings (root; about a minute
//! each): the built binary writes its report, CSV and plot; the report parses; every row is a
//! checked, valid result (each all-reduce's result checked, each NetStorm round verified);
//! and the derived figures and targets are what the rows give, not constants (NetStorm's 5x
//! target judged on the rows of star and mr-fapt+aware+aux; mlnet and priority have no
//! targets, their ratios are checked against the rows). Each test holds the fabric lock (one
//! emulated fabric at a time) for the whole run of the binary. A run whose fabric fell behind
//! its clock fails the test with that reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use gradwire_netns::{require_root, FabricLock};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A fresh output directory under the target's temporary directory.
fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gw-exp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Kills the child if the test gives up on it (SIGTERM first: the experiments tear down their
/// namespaces on it; then SIGKILL).
struct Reaper(u32);

impl Reaper {
    fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0 as i32), sig);
    }
}

/// Run `gradwire ARGS` from the repository root, at most `limit`; its output.
fn gradwire(args: &[&str], limit: Duration) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_gradwire"))
        .args(args)
        .current_dir(root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting gradwire");
    let reaper = Reaper(child.id());
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => {
            waiter.join().unwrap();
            out.unwrap()
        }
        Err(_) => {
            reaper.signal(nix::sys::signal::Signal::SIGTERM);
            if rx.recv_timeout(Duration::from_secs(60)).is_err() {
                reaper.signal(nix::sys::signal::Signal::SIGKILL);
                let _ = rx.recv();
            }
            let _ = waiter.join();
            panic!("gradwire {args:?} did not end within {limit:?}; stopped it");
        }
    }
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The CSV's header and rows, split at commas (the fields checked here hold none).
fn csv(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text
        .lines()
        .map(|l| l.split(',').map(str::to_owned).collect());
    let header = lines.next().expect("a header");
    (header, lines.collect())
}

fn column(header: &[String], name: &str) -> usize {
    header
        .iter()
        .position(|h| h == name)
        .unwrap_or_else(|| panic!("no column {name} in {header:?}"))
}

fn is_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        bytes.len() > 1000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The median as the experiments compute it (linear interpolation).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let pos = 0.5 * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn experiment_mlnet_writes_checked_rows_and_ratios_from_them() {
    if !require_root("experiment_mlnet_writes_checked_rows_and_ratios_from_them") {
        return;
    }
    let _fabric = FabricLock::acquire().unwrap();
    let dir = out_dir("mlnet");
    let out = gradwire(
        &[
            "experiment",
            "mlnet",
            "--strategies",
            "star,rack",
            "--servers",
            "1",
            "--workers",
            "4",
            "--model-bytes",
            "128KiB",
            "--iterations",
            "2",
            "--out",
            dir.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    ok(&out, "experiment mlnet");
    let report = json(&dir.join("mlnet.json"));
    let rows = report["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert!(
            r["valid"].as_bool().unwrap(),
            "the fabric fell behind its clock: {}",
            r["fabric"]
        );
        assert!(f(&r["makespan_ms"]) > 0.0, "{r}");
        assert!(f(&r["fabric"]["frames_per_s_mean"]) > 0.0, "{r}");
    }
    // vs_star is each row's makespan over STAR's row.
    let star = f(&rows[0]["makespan_ms"]);
    assert_eq!(rows[0]["strategy"], "star");
    for r in rows {
        assert!(close(f(&r["vs_star"]), f(&r["makespan_ms"]) / star), "{r}");
    }
    let (header, lines) = csv(&dir.join("mlnet.csv"));
    assert_eq!(lines.len(), 2);
    let (valid, vs, err) = (
        column(&header, "valid"),
        column(&header, "vs_star"),
        column(&header, "error"),
    );
    for (line, r) in lines.iter().zip(rows) {
        assert_eq!(line[valid], "true");
        assert_eq!(line[err], "");
        let v: f64 = line[vs].parse().unwrap();
        assert!((v - f(&r["vs_star"])).abs() < 1e-5, "{line:?} vs {r}");
    }
    is_png(&dir.join("mlnet.png"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn experiment_priority_summarizes_the_valid_rows() {
    if !require_root("experiment_priority_summarizes_the_valid_rows") {
        return;
    }
    let _fabric = FabricLock::acquire().unwrap();
    let dir = out_dir("priority");
    let out = gradwire(
        &[
            "experiment",
            "priority",
            "--jobs",
            "2",
            "--workers",
            "2",
            "--model-bytes",
            "64KiB",
            "--iterations",
            "1",
            "--repetitions",
            "1",
            "--out",
            dir.to_str().unwrap(),
        ],
        Duration::from_secs(400),
    );
    ok(&out, "experiment priority");
    let report = json(&dir.join("priority.json"));
    let rows = report["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 3, "2 jobs in each of the 3 modes");
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["valid"].as_bool().unwrap(), "fabric fell behind: {r}");
    }
    // Each mode's summary is the median and maximum of its rows.
    for s in report["summary"].as_array().unwrap() {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r["mode"] == s["mode"])
            .map(|r| f(&r["makespan_ms"]))
            .collect();
        assert_eq!(s["jobs"].as_u64(), Some(v.len() as u64));
        assert_eq!(s["excluded"].as_u64(), Some(0));
        assert!(close(f(&s["median_ms"]), median(v.clone())), "{s}");
        assert!(close(
            f(&s["max_ms"]),
            v.iter().copied().fold(0.0, f64::max)
        ));
    }
    let pair = &report["pair"];
    assert!(
        pair["error"].is_null() && pair["valid"].as_bool().unwrap(),
        "{pair}"
    );
    let ratios: Vec<f64> = pair["ratios"].as_array().unwrap().iter().map(f).collect();
    assert_eq!(ratios.len(), 1);
    assert!(close(f(&pair["urgent_vs_alone"]), ratios[0]));
    assert!(close(
        ratios[0],
        f(&pair["urgent_ms"]) / f(&pair["alone_ms"])
    ));
    let (header, lines) = csv(&dir.join("priority.csv"));
    assert_eq!(lines.len(), rows.len());
    let valid = column(&header, "valid");
    assert!(lines.iter().all(|l| l[valid] == "true"));
    is_png(&dir.join("priority.png"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn experiment_wan_quick_judges_targets_on_its_rows() {
    if !require_root("experiment_wan_quick_judges_targets_on_its_rows") {
        return;
    }
    let _fabric = FabricLock::acquire().unwrap();
    let dir = out_dir("wan");
    let out = gradwire(
        &[
            "experiment",
            "wan",
            "--quick",
            "--strategies",
            "star,mr-fapt+aware+aux",
            "--networks",
            "dynamic",
            "--repeats",
            "2",
            "--duration",
            "5",
            "--out",
            dir.to_str().unwrap(),
        ],
        Duration::from_secs(400),
    );
    ok(&out, "experiment wan --quick");
    let report = json(&dir.join("wan.json"));
    assert_eq!(report["repeats"].as_u64(), Some(2));
    let budget = &report["frame_budget"];
    assert!(
        f(&budget["total_fps"]) <= f(&budget["limit_fps"]),
        "{budget}"
    );
    let rows = report["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "2 strategies x 2 repeats");
    for r in rows {
        // The fabric's clock first: behind it, every other figure judges the machine's load.
        assert!(
            r["fabric"]["valid"].as_bool().unwrap(),
            "the fabric fell behind its clock: {}",
            r["fabric"]
        );
        assert!(r["error"].is_null(), "{}", r["error"]);
        assert!(
            r["valid"].as_bool().unwrap() && r["verified"].as_bool().unwrap(),
            "not a result (a round not verified?): {r}"
        );
        assert!(r["rounds"].as_u64().unwrap() > 0);
        assert!(!r["attempts"].as_array().unwrap().is_empty());
        assert!(f(&r["fabric"]["frames_per_s_mean"]) > 0.0);
    }
    // The figures are the spread of the rows, the speed-ups star's median over them.
    let sync = |s: &str| -> Vec<f64> {
        rows.iter()
            .filter(|r| r["strategy"] == s)
            .map(|r| f(&r["sync_ms_mean"]))
            .collect()
    };
    let star = median(sync("star"));
    for fig in report["figures"].as_array().unwrap() {
        let v = sync(fig["strategy"].as_str().unwrap());
        assert_eq!(fig["valid_runs"].as_u64(), Some(2));
        assert!(
            close(f(&fig["sync_ms"]["median"]), median(v.clone())),
            "{fig}"
        );
        assert!(close(
            f(&fig["sync_ms"]["min"]),
            v.iter().copied().fold(f64::INFINITY, f64::min)
        ));
        let best = v.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(
            close(f(&fig["speedup_vs_star"]["max"]), star / best),
            "{fig}"
        );
    }
    // Targets: the 5x one is judged on these rows: its figure is the ratio of the two
    // strategies' medians, and it is met exactly when that ratio is at least 5.
    let t = &report["targets"];
    let pro = median(sync("mr-fapt+aware+aux"));
    let five = &t["netstorm_5x_star_dynamic"];
    let speedup = f(&five["figures"]["speedup"]);
    assert!(
        close(speedup, star / pro),
        "{five}: star {star} ms, pro {pro} ms"
    );
    assert!(close(f(&five["figures"]["star_sync_ms"]), star), "{five}");
    assert!(
        close(f(&five["figures"]["mr-fapt+aware+aux_sync_ms"]), pro),
        "{five}"
    );
    assert_eq!(five["met"].as_bool(), Some(speedup >= 5.0), "{five}");
    // Only what ran is judged: fapt, bkt and mst did not run, so the chain and the FAPT
    // target are not (the chain still shows the one median it has).
    let chain = &t["each_mechanism_helps"];
    assert!(chain["met"].is_null(), "{chain}");
    assert!(
        close(f(&chain["figures"]["mr-fapt+aware+aux_sync_ms"]), pro),
        "{chain}"
    );
    assert!(t["each_mechanism_helps_static"]["met"].is_null(), "{t}");
    assert!(t["fapt_beats_bkt_and_mst"]["met"].is_null(), "{t}");
    assert_eq!(t["all_runs_valid"], true);
    assert_eq!(t["excluded"].as_array().unwrap().len(), 0);
    let (header, lines) = csv(&dir.join("wan.csv"));
    assert_eq!(lines.len(), 4);
    let (valid, repeat) = (column(&header, "valid"), column(&header, "repeat"));
    assert!(lines.iter().all(|l| l[valid] == "true"));
    let repeats: Vec<&str> = lines.iter().map(|l| l[repeat].as_str()).collect();
    assert_eq!(repeats, ["0", "1", "0", "1"]);
    is_png(&dir.join("wan.png"));
    is_png(&dir.join("wan-rates.png"));
    let _ = std::fs::remove_dir_all(&dir);
}
