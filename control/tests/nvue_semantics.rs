//! NVUE output checked independently of the renderer: the rendered commands are parsed
//! against the command shapes listed for Cumulus Linux NVUE in
//! `/work/shared/reference/switch-qos-formats.md` (a command of any other shape fails the
//! test), folded into the configuration they would leave on the switch, and compared with
//! the policy worked out by hand here: DSCP -> switch priority -> traffic class, strict
//! scheduling, per data traffic class min = max threshold (rounded up to the ASIC's cell),
//! ECN marking and RED dropping, nothing for the control class, no PFC, and `nv config apply`
//! last. The golden files (`golden.rs`) pin the exact text; this pins the meaning, so a
//! golden file regenerated from a wrong renderer still fails here.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;

use gradwire_control::cli::run;

fn render_nvue(args: &[&str]) -> String {
    let mut full = vec!["gradwire-ctl", "render", "--target", "nvue"];
    full.extend_from_slice(args);
    let mut out = Vec::new();
    run(full, &mut out).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    String::from_utf8(out).unwrap()
}

/// One traffic class's `congestion-control` settings.
#[derive(Debug, Default, Clone, PartialEq)]
struct Congestion {
    min: Option<u64>,
    max: Option<u64>,
    probability: Option<u64>,
    ecn: Option<String>,
    red: Option<String>,
}

/// What the commands leave configured in the `default-global` profiles.
#[derive(Debug, Default)]
struct NvueConfig {
    trust: Option<String>,
    dscp_to_prio: BTreeMap<u8, u8>,
    prio_to_tc: BTreeMap<u8, u8>,
    scheduler: BTreeMap<u8, String>,
    congestion: BTreeMap<u8, Congestion>,
    applied_last: bool,
}

fn num<T: std::str::FromStr>(s: &str, line: &str) -> T {
    s.parse()
        .unwrap_or_else(|_| panic!("{s:?} is not a number in {line:?}"))
}

/// Parses NVUE commands into the configuration they set; panics on any command that is not
/// one of the documented shapes, and on a setting made twice with different values.
fn parse(text: &str) -> NvueConfig {
    let mut c = NvueConfig::default();
    let commands: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for (i, line) in commands.iter().enumerate() {
        let w: Vec<&str> = line.split_whitespace().collect();
        c.applied_last = false;
        match w.as_slice() {
            ["nv", "config", "apply"] => {
                assert_eq!(i, commands.len() - 1, "`nv config apply` must come last");
                c.applied_last = true;
            }
            ["nv", "set", "qos", "mapping", "default-global", "trust", t] => {
                c.trust = Some((*t).to_owned());
            }
            ["nv", "set", "qos", "mapping", "default-global", "dscp", d, "switch-priority", p] => {
                let (d, p): (u8, u8) = (num(d, line), num(p, line));
                assert!(d < 64 && p < 8, "{line}");
                let old = c.dscp_to_prio.insert(d, p);
                assert!(old.is_none(), "DSCP {d} set twice");
            }
            ["nv", "set", "qos", "egress-queue-mapping", "default-global", "switch-priority", p, "traffic-class", tc] =>
            {
                let (p, tc): (u8, u8) = (num(p, line), num(tc, line));
                assert!(p < 8 && tc < 8, "{line}");
                let old = c.prio_to_tc.insert(p, tc);
                assert!(old.is_none(), "switch priority {p} set twice");
            }
            ["nv", "set", "qos", "egress-scheduler", "default-global", "traffic-class", tcs, "mode", m] => {
                for tc in tcs.split(',') {
                    let tc: u8 = num(tc, line);
                    assert!(tc < 8, "{line}");
                    c.scheduler.insert(tc, (*m).to_owned());
                }
            }
            ["nv", "set", "qos", "congestion-control", "default-global", "traffic-class", tc, key, value] =>
            {
                let tc: u8 = num(tc, line);
                assert!(tc < 8, "{line}");
                let e = c.congestion.entry(tc).or_default();
                let slot = match *key {
                    "min-threshold" => {
                        e.min = Some(num(value, line));
                        continue;
                    }
                    "max-threshold" => {
                        e.max = Some(num(value, line));
                        continue;
                    }
                    "probability" => {
                        e.probability = Some(num(value, line));
                        continue;
                    }
                    "ecn" => &mut e.ecn,
                    "red" => &mut e.red,
                    _ => panic!("undocumented congestion-control setting: {line}"),
                };
                *slot = Some((*value).to_owned());
            }
            _ => panic!("not a documented NVUE command shape: {line}"),
        }
    }
    c
}

/// The policy, worked out by hand: which queue each DSCP goes to and each data queue's
/// threshold in bytes as the switch gets it.
struct Expected {
    dscp_to_queue: [u8; 64],
    thresholds: [u64; 7],
}

/// Rounds up to whole buffer cells (Spectrum-2 and -3: 144 bytes).
fn cells_144(b: u64) -> u64 {
    b.div_ceil(144) * 144
}

/// gradwire's DSCP plan: one code point per data queue, 48 for control, everything else to
/// queue 0.
fn gradwire_dscp_map() -> [u8; 64] {
    let mut m = [0u8; 64];
    for (q, d) in [0usize, 10, 18, 26, 34, 40, 46].iter().enumerate() {
        m[*d] = q as u8;
    }
    m[48] = 7;
    m
}

/// Arithmetic thresholds: queue 6 gets `base`, each lower queue `step * base` more.
fn arithmetic(base: f64, step: f64, round: fn(u64) -> u64) -> [u64; 7] {
    std::array::from_fn(|q| round((base * (1.0 + step * (6 - q) as f64)).round() as u64))
}

fn check(text: &str, want: &Expected) {
    let c = parse(text);
    assert!(c.applied_last, "the commands must end in `nv config apply`");
    assert_eq!(c.trust.as_deref(), Some("l3"), "trust DSCP");
    // Every DSCP mapped, each to the traffic class of its queue (the identity priority ->
    // traffic class mapping of gradwire's policies).
    assert_eq!(c.dscp_to_prio.len(), 64, "every DSCP is mapped");
    assert_eq!(c.prio_to_tc.len(), 8, "every switch priority is mapped");
    for d in 0..64u8 {
        let tc = c.prio_to_tc[&c.dscp_to_prio[&d]];
        assert_eq!(tc, want.dscp_to_queue[usize::from(d)], "DSCP {d}");
    }
    // Strict priority on every traffic class.
    assert_eq!(c.scheduler.len(), 8, "{:?}", c.scheduler);
    assert!(
        c.scheduler.values().all(|m| m == "strict"),
        "{:?}",
        c.scheduler
    );
    // Early drop and marking on the data classes only, at one threshold each (min = max,
    // probability 100: a step, DLCP's threshold), ECT marked, non-ECT dropped.
    assert!(
        !c.congestion.contains_key(&7),
        "the control class has no early drop"
    );
    for (q, t) in want.thresholds.iter().enumerate() {
        let got = c
            .congestion
            .get(&(q as u8))
            .unwrap_or_else(|| panic!("traffic class {q} has no congestion control"));
        let expect = Congestion {
            min: Some(*t),
            max: Some(*t),
            probability: Some(100),
            ecn: Some("enable".into()),
            red: Some("enable".into()),
        };
        assert_eq!(got, &expect, "traffic class {q}");
    }
    // No PFC: gradwire's queues are lossy, and no command above configures pause frames.
    assert!(!text.to_lowercase().contains("pfc"), "PFC must stay off");
}

#[test]
fn nvue_commands_carry_the_gradwire_policy() {
    let text = render_nvue(&[
        "--base-threshold",
        "64KiB",
        "--step",
        "0.5",
        "--asic",
        "spectrum2",
    ]);
    check(
        &text,
        &Expected {
            dscp_to_queue: gradwire_dscp_map(),
            thresholds: arithmetic(65536.0, 0.5, cells_144),
        },
    );
}

#[test]
fn nvue_without_an_asic_keeps_thresholds_unrounded() {
    let text = render_nvue(&["--base-threshold", "100000", "--step", "0.3"]);
    let want = Expected {
        dscp_to_queue: gradwire_dscp_map(),
        thresholds: arithmetic(100_000.0, 0.3, |b| b),
    };
    assert_eq!(
        want.thresholds,
        [280_000, 250_000, 220_000, 190_000, 160_000, 130_000, 100_000]
    );
    check(&text, &want);
}

#[test]
fn nvue_commands_carry_a_custom_policy() {
    // control/tests/fixtures/custom-policy.toml, read by hand: thresholds per queue 0..6,
    // control DSCPs 48 and 56, a few data DSCPs moved, Spectrum-3 (144-byte cells).
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/custom-policy.toml");
    let text = render_nvue(&["--policy", p.to_str().unwrap(), "--ports", "swp1"]);
    let mut dscp_to_queue = [0u8; 64];
    for (d, q) in [
        (48, 7),
        (56, 7),
        (46, 6),
        (40, 5),
        (32, 4),
        (24, 3),
        (16, 2),
        (8, 1),
    ] {
        dscp_to_queue[d] = q;
    }
    let thresholds = [
        400 * 1024,
        300 * 1024,
        200 * 1024,
        150 * 1024,
        100 * 1024,
        50_000,
        20_000,
    ]
    .map(cells_144);
    check(
        &text,
        &Expected {
            dscp_to_queue,
            thresholds,
        },
    );
}

#[test]
fn the_parser_refuses_what_the_reference_does_not_list() {
    // The checker itself: an undocumented command shape, a PFC setting or a missing commit
    // must fail, or the checks above would prove nothing.
    let good = render_nvue(&["--base-threshold", "100000", "--step", "0.3"]);
    let undocumented = good.replace(
        "nv config apply",
        "nv set qos pfc default-global switch-priority 3\nnv config apply",
    );
    assert!(std::panic::catch_unwind(|| parse(&undocumented)).is_err());
    let unapplied = good.replace("nv config apply", "");
    assert!(!parse(&unapplied).applied_last);
    let wrong_threshold = good.replace("min-threshold 100000", "min-threshold 100144");
    let want = Expected {
        dscp_to_queue: gradwire_dscp_map(),
        thresholds: arithmetic(100_000.0, 0.3, |b| b),
    };
    assert!(std::panic::catch_unwind(|| check(&wrong_threshold, &want)).is_err());
}
