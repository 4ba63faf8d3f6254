//! Every rendered SONiC object uses only the tables, field names and values that the
//! SONiC YANG models allow, as listed in `/work/shared/reference/switch-qos-formats.md`
//! (sonic-buildimage's sonic-dscp-tc-map, sonic-tc-queue-map, sonic-scheduler,
//! sonic-wred-profile, sonic-queue and sonic-port-qos-map models). The lists below are
//! copied from that file; a field or value not listed there fails the test.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use gradwire_control::render::sonic;
use gradwire_control::render::{check, Target};
use gradwire_control::{Asic, Bytes};
use gradwire_control::{Policy, ThresholdSpec};
use proptest::prelude::*;
use serde_json::Value;

/// `[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}`
fn legal_name(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(x) if x.is_ascii_alphanumeric())
        && s.len() <= 32
        && c.all(|x| x.is_ascii_alphanumeric() || x == '-' || x == '_')
}

fn uint(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0')))
        .then(|| s.parse().ok())
        .flatten()
}

fn in_range(s: &str, lo: u64, hi: u64) -> bool {
    uint(s).is_some_and(|v| (lo..=hi).contains(&v))
}

const ECN: [&str; 8] = [
    "ecn_none",
    "ecn_green",
    "ecn_yellow",
    "ecn_red",
    "ecn_green_yellow",
    "ecn_green_red",
    "ecn_yellow_red",
    "ecn_all",
];
const SCHED_TYPES: [&str; 3] = ["STRICT", "DWRR", "WRR"];
const COLOURS: [&str; 3] = ["green", "yellow", "red"];

/// Check a config_db fragment; returns the violations.
fn violations(doc: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    let tables = doc.as_object().unwrap();
    let names = |t: &str| -> Vec<String> {
        tables
            .get(t)
            .and_then(Value::as_object)
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    };
    let (dscp_maps, tc_maps, scheds, wreds) = (
        names("DSCP_TO_TC_MAP"),
        names("TC_TO_QUEUE_MAP"),
        names("SCHEDULER"),
        names("WRED_PROFILE"),
    );
    const KNOWN: [&str; 7] = [
        "DSCP_TO_TC_MAP",
        "TC_TO_QUEUE_MAP",
        "TC_TO_PRIORITY_GROUP_MAP",
        "SCHEDULER",
        "WRED_PROFILE",
        "QUEUE",
        "PORT_QOS_MAP",
    ];
    for (table, objs) in tables {
        if !KNOWN.contains(&table.as_str()) {
            bad.push(format!("table {table} is not one gradwire may write"));
            continue;
        }
        let Some(objs) = objs.as_object() else {
            bad.push(format!("{table} is not an object"));
            continue;
        };
        for (key, fields) in objs {
            let at = format!("{table}|{key}");
            let Some(fields) = fields.as_object() else {
                bad.push(format!("{at} is not an object"));
                continue;
            };
            let mut f: BTreeMap<&str, &str> = BTreeMap::new();
            for (k, v) in fields {
                match v.as_str() {
                    Some(s) => {
                        f.insert(k, s);
                    }
                    None => bad.push(format!("{at} {k}: value {v} is not a string")),
                }
            }
            let mut field_ok = |name: &str, ok: bool, v: &str| {
                if !ok {
                    bad.push(format!("{at}: field {name} = {v:?} not allowed"));
                }
            };
            match table.as_str() {
                "DSCP_TO_TC_MAP" => {
                    field_ok("<name>", legal_name(key), key);
                    for (k, v) in &f {
                        field_ok(k, in_range(k, 0, 63) && in_range(v, 0, 7), v);
                    }
                }
                "TC_TO_QUEUE_MAP" | "TC_TO_PRIORITY_GROUP_MAP" => {
                    field_ok("<name>", legal_name(key), key);
                    for (k, v) in &f {
                        field_ok(k, in_range(k, 0, 7) && in_range(v, 0, 7), v);
                    }
                }
                "SCHEDULER" => {
                    field_ok("<name>", legal_name(key), key);
                    for (k, v) in &f {
                        let ok = match *k {
                            "type" => SCHED_TYPES.contains(v),
                            "weight" => in_range(v, 1, 100),
                            "meter_type" => !v.is_empty(),
                            "cir" | "pir" | "cbs" | "pbs" => uint(v).is_some(),
                            _ => false,
                        };
                        field_ok(k, ok, v);
                    }
                    if let Some(p) = f.get("pir") {
                        let ok = f
                            .get("cir")
                            .and_then(|c| uint(c))
                            .is_some_and(|c| uint(p).is_some_and(|p| p >= c));
                        field_ok("pir", ok, p);
                    }
                }
                "WRED_PROFILE" => {
                    field_ok("<name>", legal_name(key), key);
                    for (k, v) in &f {
                        let ok = if *k == "ecn" {
                            ECN.contains(v)
                        } else if let Some(c) = k
                            .strip_prefix("wred_")
                            .and_then(|r| r.strip_suffix("_enable"))
                        {
                            COLOURS.contains(&c) && (*v == "true" || *v == "false")
                        } else if let Some(c) = k
                            .strip_suffix("_min_threshold")
                            .or_else(|| k.strip_suffix("_max_threshold"))
                        {
                            COLOURS.contains(&c) && uint(v).is_some()
                        } else if let Some(c) = k.strip_suffix("_drop_probability") {
                            COLOURS.contains(&c) && in_range(v, 0, 100)
                        } else {
                            false
                        };
                        field_ok(k, ok, v);
                    }
                    for c in COLOURS {
                        let min = f
                            .get(format!("{c}_min_threshold").as_str())
                            .and_then(|v| uint(v));
                        let max = f
                            .get(format!("{c}_max_threshold").as_str())
                            .and_then(|v| uint(v));
                        if let (Some(a), Some(b)) = (min, max) {
                            field_ok(&format!("{c}_max_threshold"), b >= a, &b.to_string());
                        }
                    }
                }
                "QUEUE" => {
                    let (port, q) = key.split_once('|').unwrap_or((key, ""));
                    let q_ok = in_range(q, 0, 7)
                        || q.split_once('-').is_some_and(|(a, b)| {
                            in_range(a, 0, 7) && in_range(b, 0, 7) && uint(a) <= uint(b)
                        });
                    field_ok("<key>", !port.is_empty() && q_ok, key);
                    for (k, v) in &f {
                        let ok = match *k {
                            "scheduler" => scheds.iter().any(|s| s == v),
                            "wred_profile" => wreds.iter().any(|s| s == v),
                            _ => false,
                        };
                        field_ok(k, ok, v);
                    }
                }
                "PORT_QOS_MAP" => {
                    for (k, v) in &f {
                        let ok = match *k {
                            "dscp_to_tc_map" => dscp_maps.iter().any(|s| s == v),
                            "tc_to_queue_map" => tc_maps.iter().any(|s| s == v),
                            "tc_to_pg_map" => {
                                names("TC_TO_PRIORITY_GROUP_MAP").iter().any(|s| s == v)
                            }
                            "scheduler" => scheds.iter().any(|s| s == v),
                            "pfc_enable" => v.split(',').all(|x| in_range(x, 0, 7)),
                            _ => false,
                        };
                        field_ok(k, ok, v);
                    }
                }
                _ => {}
            }
        }
    }
    bad
}

fn fragment(p: &Policy) -> Value {
    check(p, Target::Sonic).unwrap();
    let text = gradwire_control::render(p, Target::Sonic).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The values carried by the blind patch, applied to tables that exist.
fn patched(p: &Policy) -> Value {
    let text = gradwire_control::render(p, Target::SonicPatch).unwrap();
    let ops: Vec<Value> = serde_json::from_str(&text).unwrap();
    let mut doc = serde_json::json!({});
    for t in sonic::TABLES {
        doc[t] = serde_json::json!({});
    }
    for port in &p.ports {
        doc["PORT_QOS_MAP"][port] = serde_json::json!({});
    }
    for op in ops {
        let path: Vec<&str> = op["path"].as_str().unwrap()[1..].split('/').collect();
        match (op["op"].as_str().unwrap(), path.as_slice()) {
            ("add", [t, k]) => doc[*t][*k] = op["value"].clone(),
            ("add", [t, k, f]) => doc[*t][*k][*f] = op["value"].clone(),
            // only the add-then-remove of a field that must be absent (pfc_enable)
            ("remove", [t, k, f]) => {
                assert!(doc[*t][*k].as_object_mut().unwrap().remove(*f).is_some());
            }
            other => panic!("unexpected op {other:?}"),
        }
    }
    doc
}

fn policy(base: u64, step: f64) -> Policy {
    let mut p = Policy::gradwire(ThresholdSpec::Arithmetic {
        base: Bytes(base),
        step,
    });
    p.ports = vec!["Ethernet0".into(), "Ethernet4".into()];
    p
}

#[test]
fn checker_rejects_what_yang_rejects() {
    let bad = serde_json::json!({
        "DSCP_TO_TC_MAP": {"_x": {"64": "1", "3": "8"}},
        "SCHEDULER": {"s": {"type": "PRIORITY", "weight": "0"}},
        "WRED_PROFILE": {"w": {"ecn": "ecn_blue", "green_min_threshold": "10",
            "green_max_threshold": "5", "green_drop_probability": "101", "colour": "x"}},
        "QUEUE": {"Ethernet0|8": {"wred_profile": "nope", "scheduler": 1}},
        "PORT_QOS_MAP": {"Ethernet0": {"pfc_enable": "9"}},
        "BUFFER_PROFILE": {}
    });
    let v = violations(&bad);
    for needle in [
        "<name>",
        "64",
        "type",
        "weight",
        "ecn",
        "green_max_threshold",
        "green_drop_probability",
        "colour",
        "Ethernet0|8",
        "wred_profile",
        "not a string",
        "pfc_enable",
        "BUFFER_PROFILE",
    ] {
        assert!(
            v.iter().any(|x| x.contains(needle)),
            "{needle} not caught: {v:#?}"
        );
    }
}

#[test]
fn default_policy_is_yang_clean() {
    for asic in [None, Some(Asic::Spectrum1), Some(Asic::Spectrum4)] {
        let mut p = policy(65536, 0.5);
        p.asic = asic;
        assert_eq!(violations(&fragment(&p)), Vec::<String>::new());
        assert_eq!(violations(&patched(&p)), Vec::<String>::new());
        assert_eq!(fragment(&p), patched(&p), "patch carries the fragment");
    }
}

#[test]
fn custom_policy_file_is_yang_clean() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/custom-policy.toml");
    let p = gradwire_control::policy_file::load_valid_policy(&path).unwrap();
    assert_eq!(violations(&fragment(&p)), Vec::<String>::new());
}

#[test]
fn hw_config_sonic_files_are_yang_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../hw-configs/sn2100-sonic");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("qos-config_db.json")).unwrap())
            .unwrap();
    assert_eq!(violations(&doc), Vec::<String>::new());
}

proptest! {
    #[test]
    fn any_valid_policy_is_yang_clean(base in 1u64..100_000, step in 0.0f64..4.0,
                                      ai in 0usize..6, map in proptest::collection::vec(0u8..7, 64),
                                      nports in 1usize..5, name in "[A-Za-z0-9][-A-Za-z0-9_]{0,24}") {
        let mut p = policy(base, step);
        p.asic = Asic::ALL.get(ai).copied();
        p.port_buffer = gradwire_control::policy::MAX_PORT_BUFFER;
        p.name = name;
        for (d, tc) in map.iter().enumerate() { p.dscp_to_tc[d] = *tc; }
        p.dscp_to_tc[48] = 7;
        p.ports = (0..nports).map(|i| format!("Ethernet{}", i * 4)).collect();
        prop_assume!(p.validate().is_ok());
        let doc = fragment(&p);
        prop_assert_eq!(violations(&doc), Vec::<String>::new());
        prop_assert_eq!(violations(&patched(&p)), Vec::<String>::new());

        // Every DSCP maps to exactly one queue in what the switch receives.
        let map = doc["DSCP_TO_TC_MAP"][p.name.as_str()].as_object().unwrap();
        let tcq = doc["TC_TO_QUEUE_MAP"][p.name.as_str()].as_object().unwrap();
        prop_assert_eq!(map.len(), 64);
        for d in 0..64u8 {
            let tc = map[&d.to_string()].as_str().unwrap();
            let q: u8 = tcq[tc].as_str().unwrap().parse().unwrap();
            prop_assert_eq!(q, p.dscp_queue(d));
        }
        // Rendered thresholds fall strictly with the queue index for d > 0 (queue 6 =
        // front layers = lowest) and are all equal for d = 0.
        let th: Vec<u64> = (0..7)
            .map(|q| doc["WRED_PROFILE"][format!("{}_Q{q}", p.name)]["green_min_threshold"]
                .as_str().unwrap().parse().unwrap())
            .collect();
        for q in 1..7 {
            if step > 0.0 {
                prop_assert!(th[q] < th[q - 1], "{:?}", th);
            } else {
                prop_assert_eq!(th[q], th[0]);
            }
        }
    }
}
