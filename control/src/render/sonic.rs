//! SONiC: CONFIG_DB objects for the policy, as a `config_db.json` fragment, as a JSON Patch
//! for `config apply-patch`, and as a field-by-field diff against a running config.
//!
//! Objects (every value a string, as CONFIG_DB requires):
//! - `DSCP_TO_TC_MAP|NAME`: all 64 DSCPs, so no DSCP is left to a platform default;
//! - `TC_TO_QUEUE_MAP|NAME`: traffic classes 0..=7;
//! - `SCHEDULER|NAME_STRICT`: `type` `STRICT`;
//! - `WRED_PROFILE|NAME_Qq` for each data queue q: `wred_green_enable` `true`, `ecn`
//!   `ecn_green` (mark ECT, drop non-ECT above the threshold), `green_min_threshold` =
//!   `green_max_threshold` in bytes, `green_drop_probability` `100`;
//! - `QUEUE|port|q` for queues 0..=7 of every port: the scheduler, and the WRED profile on
//!   data queues only; the control queue must have none (so no early drop);
//! - `PORT_QOS_MAP|port`: `dscp_to_tc_map` and `tc_to_queue_map`, and no `pfc_enable`:
//!   gradwire's policy has PFC off on every queue (DLCP drops, it does not pause), while a
//!   default Mellanox SONiC config keeps `pfc_enable` `"3,4"`, which would make data queues 3
//!   and 4 lossless. The patch removes the field; the `config_db.json` fragment cannot (it is
//!   merged by `config load`), so rendering it warns.
//!
//! Against a running config the patch also removes `QUEUE|port|a-b` range entries on the
//! policy's ports before adding the per-queue entries, so no range keeps binding an old
//! scheduler or WRED profile to the same queues.
//!
//! The buffer configuration (`BUFFER_PG`, `BUFFER_QUEUE`, and the `tc_to_pg_map` field) is not
//! in the reference gradwire renders against, so it is left alone; [`warnings`] tells the
//! operator what to check there.
//!
//! Packets are all green (nothing polices them), so yellow and red settings are left alone.

use serde_json::Value;

use super::json::Json;
use super::RenderError;
use crate::policy::Policy;

/// One CONFIG_DB object as the policy wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// Table name.
    pub table: &'static str,
    /// Key inside the table (`Ethernet0|3` for QUEUE).
    pub key: String,
    /// Fields in order; `None` means the field must be absent.
    pub fields: Vec<(&'static str, Option<String>)>,
}

/// The tables written, in dependency order (maps and profiles before their users).
pub const TABLES: [&str; 6] = [
    "DSCP_TO_TC_MAP",
    "TC_TO_QUEUE_MAP",
    "SCHEDULER",
    "WRED_PROFILE",
    "QUEUE",
    "PORT_QOS_MAP",
];

/// The objects the policy needs, in output order. The policy must be valid for SONiC
/// ([`super::check`]).
pub fn objects(policy: &Policy) -> Result<Vec<Object>, RenderError> {
    let th = policy.thresholds()?;
    let mut out = Vec::new();
    out.push(Object {
        table: "DSCP_TO_TC_MAP",
        key: policy.name.clone(),
        fields: DSCP_KEYS
            .iter()
            .zip(policy.dscp_to_tc.iter())
            .map(|(k, tc)| (*k, Some(tc.to_string())))
            .collect(),
    });
    out.push(Object {
        table: "TC_TO_QUEUE_MAP",
        key: policy.name.clone(),
        fields: DSCP_KEYS[..8]
            .iter()
            .zip(policy.tc_to_queue.iter())
            .map(|(k, q)| (*k, Some(q.to_string())))
            .collect(),
    });
    out.push(Object {
        table: "SCHEDULER",
        key: policy.scheduler_name(),
        fields: vec![("type", Some("STRICT".into()))],
    });
    for t in &th {
        let bytes = t.effective.0.to_string();
        out.push(Object {
            table: "WRED_PROFILE",
            key: policy.wred_name(t.queue),
            fields: vec![
                ("wred_green_enable", Some("true".into())),
                ("ecn", Some("ecn_green".into())),
                ("green_min_threshold", Some(bytes.clone())),
                ("green_max_threshold", Some(bytes)),
                ("green_drop_probability", Some("100".into())),
            ],
        });
    }
    for port in &policy.ports {
        for q in 0..gradwire_qos::NUM_QUEUES {
            let wred = (q != gradwire_qos::CONTROL_QUEUE).then(|| policy.wred_name(q));
            out.push(Object {
                table: "QUEUE",
                key: format!("{port}|{q}"),
                fields: vec![
                    ("scheduler", Some(policy.scheduler_name())),
                    ("wred_profile", wred),
                ],
            });
        }
    }
    for port in &policy.ports {
        out.push(Object {
            table: "PORT_QOS_MAP",
            key: port.clone(),
            fields: vec![
                ("dscp_to_tc_map", Some(policy.name.clone())),
                ("tc_to_queue_map", Some(policy.name.clone())),
                // PFC off on every queue: the field must be absent (no value means "none").
                ("pfc_enable", None),
            ],
        });
    }
    Ok(out)
}

/// "0".."63" as static strings, so field names need no allocation.
const DSCP_KEYS: [&str; 64] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
    "17", "18", "19", "20", "21", "22", "23", "24", "25", "26", "27", "28", "29", "30", "31", "32",
    "33", "34", "35", "36", "37", "38", "39", "40", "41", "42", "43", "44", "45", "46", "47", "48",
    "49", "50", "51", "52", "53", "54", "55", "56", "57", "58", "59", "60", "61", "62", "63",
];

fn object_json(o: &Object) -> Json {
    Json::Obj(
        o.fields
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| ((*k).to_string(), Json::Str(v.clone()))))
            .collect(),
    )
}

/// The objects grouped by table, as a `config_db.json` fragment.
pub fn fragment(objs: &[Object]) -> Json {
    let mut tables: Vec<(String, Json)> = Vec::new();
    for t in TABLES {
        let members: Vec<(String, Json)> = objs
            .iter()
            .filter(|o| o.table == t)
            .map(|o| (o.key.clone(), object_json(o)))
            .collect();
        if !members.is_empty() {
            tables.push((t.to_string(), Json::Obj(members)));
        }
    }
    Json::Obj(tables)
}

/// The `config_db.json` fragment (for `config load`, or to read).
pub fn render_fragment(policy: &Policy) -> Result<String, RenderError> {
    Ok(fragment(&objects(policy)?).pretty())
}

/// One JSON Patch (RFC 6902) operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatchOp {
    /// `add`, `replace` or `remove`.
    pub op: &'static str,
    /// JSON Pointer (RFC 6901).
    pub path: String,
    /// The value for `add` and `replace`.
    pub value: Option<Json>,
}

/// Escape one JSON Pointer token (RFC 6901: `~` -> `~0`, `/` -> `~1`).
pub fn pointer_token(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

fn ptr(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| format!("/{}", pointer_token(p)))
        .collect()
}

/// One field-level difference between the running config and the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The field is missing and will be added.
    Add {
        /// `TABLE|key`.
        object: String,
        /// Field.
        field: String,
        /// New value.
        value: String,
    },
    /// The field has another value.
    Replace {
        /// `TABLE|key`.
        object: String,
        /// Field.
        field: String,
        /// Current value (JSON text).
        old: String,
        /// New value.
        value: String,
    },
    /// The field must go.
    Remove {
        /// `TABLE|key`.
        object: String,
        /// Field.
        field: String,
        /// Current value (JSON text).
        old: String,
    },
    /// A whole entry must go: a `QUEUE|port|a-b` range on one of the policy's ports,
    /// replaced by the per-queue entries.
    RemoveEntry {
        /// `TABLE|key`.
        object: String,
        /// Current entry (JSON text).
        old: String,
    },
}

/// Patch and changes against a running config, plus the number of fields already right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The JSON Patch.
    pub ops: Vec<PatchOp>,
    /// What changes, field by field.
    pub changes: Vec<Change>,
    /// Fields that already have the wanted value.
    pub unchanged: usize,
}

fn as_object<'a>(
    v: &'a Value,
    what: &str,
) -> Result<&'a serde_json::Map<String, Value>, RenderError> {
    v.as_object()
        .ok_or_else(|| RenderError::Current(format!("{what} is not a JSON object")))
}

/// Compare the policy's objects with a running config (`sonic-cfggen -d --print-data`)
/// and produce the exact patch: `add` for missing tables, objects and fields, `replace` for
/// fields with another value, `remove` for fields that must be absent. Nothing the policy
/// does not mention is touched.
pub fn plan(objs: &[Object], current: &Value) -> Result<Plan, RenderError> {
    let cur = as_object(current, "the file")?;
    let mut plan = Plan {
        ops: Vec::new(),
        changes: Vec::new(),
        unchanged: 0,
    };
    for t in TABLES {
        let mine: Vec<&Object> = objs.iter().filter(|o| o.table == t).collect();
        if mine.is_empty() {
            continue;
        }
        let add_all = |plan: &mut Plan, o: &Object| {
            for (f, v) in &o.fields {
                if let Some(v) = v {
                    plan.changes.push(Change::Add {
                        object: format!("{}|{}", o.table, o.key),
                        field: (*f).into(),
                        value: v.clone(),
                    });
                }
            }
        };
        let Some(cur_table) = cur.get(t) else {
            plan.ops.push(PatchOp {
                op: "add",
                path: ptr(&[t]),
                value: Some(Json::Obj(
                    mine.iter()
                        .map(|o| (o.key.clone(), object_json(o)))
                        .collect(),
                )),
            });
            for o in mine {
                add_all(&mut plan, o);
            }
            continue;
        };
        let cur_table = as_object(cur_table, &format!("table {t}"))?;
        if t == "QUEUE" {
            // Range keys (`Ethernet0|3-4`) on the policy's ports go first, so that the
            // per-queue entries added below are the only ones binding those queues.
            let ports: Vec<&str> = mine
                .iter()
                .filter_map(|o| o.key.rsplit_once('|').map(|(p, _)| p))
                .collect();
            for (key, old) in cur_table {
                let Some((port, idx)) = key.rsplit_once('|') else {
                    continue;
                };
                if idx.contains('-') && index_range(idx).is_some() && ports.contains(&port) {
                    plan.ops.push(PatchOp {
                        op: "remove",
                        path: ptr(&[t, key]),
                        value: None,
                    });
                    plan.changes.push(Change::RemoveEntry {
                        object: format!("{t}|{key}"),
                        old: old.to_string(),
                    });
                }
            }
        }
        for o in mine {
            let Some(cur_obj) = cur_table.get(&o.key) else {
                plan.ops.push(PatchOp {
                    op: "add",
                    path: ptr(&[t, &o.key]),
                    value: Some(object_json(o)),
                });
                add_all(&mut plan, o);
                continue;
            };
            let cur_obj = as_object(cur_obj, &format!("{t}|{}", o.key))?;
            let object = format!("{t}|{}", o.key);
            for (f, want) in &o.fields {
                let path = ptr(&[t, &o.key, f]);
                match (want, cur_obj.get(*f)) {
                    (Some(v), None) => {
                        plan.ops.push(PatchOp {
                            op: "add",
                            path,
                            value: Some(Json::Str(v.clone())),
                        });
                        plan.changes.push(Change::Add {
                            object: object.clone(),
                            field: (*f).into(),
                            value: v.clone(),
                        });
                    }
                    (Some(v), Some(Value::String(old))) if old == v => plan.unchanged += 1,
                    (Some(v), Some(old)) => {
                        plan.ops.push(PatchOp {
                            op: "replace",
                            path,
                            value: Some(Json::Str(v.clone())),
                        });
                        plan.changes.push(Change::Replace {
                            object: object.clone(),
                            field: (*f).into(),
                            old: old.to_string(),
                            value: v.clone(),
                        });
                    }
                    (None, Some(old)) => {
                        plan.ops.push(PatchOp {
                            op: "remove",
                            path,
                            value: None,
                        });
                        plan.changes.push(Change::Remove {
                            object: object.clone(),
                            field: (*f).into(),
                            old: old.to_string(),
                        });
                    }
                    (None, None) => plan.unchanged += 1,
                }
            }
        }
    }
    Ok(plan)
}

/// The patch without a running config. It assumes the six tables exist and every port has
/// a `PORT_QOS_MAP` entry (true after SONiC's default QoS config): gradwire's own objects
/// and the `QUEUE` entries are added whole (overwriting any earlier ones of the same key),
/// the `PORT_QOS_MAP` fields one by one so the port's other QoS fields stay. A field that
/// must be absent (`pfc_enable`) gets `add` (of an empty value) then `remove`: JSON Patch
/// `remove` fails on a missing member, and the pair leaves the field absent whether or not
/// it was there. Range entries (`QUEUE|Ethernet0|3-4`) cannot be seen without the running
/// config; give it ([`plan`]) for a patch that is exact on any switch.
pub fn blind_ops(objs: &[Object]) -> Vec<PatchOp> {
    let mut ops = Vec::new();
    for t in TABLES {
        for o in objs.iter().filter(|o| o.table == t) {
            if t == "PORT_QOS_MAP" {
                for (f, v) in &o.fields {
                    let path = ptr(&[t, &o.key, f]);
                    match v {
                        Some(v) => ops.push(PatchOp {
                            op: "add",
                            path,
                            value: Some(Json::Str(v.clone())),
                        }),
                        None => {
                            ops.push(PatchOp {
                                op: "add",
                                path: path.clone(),
                                value: Some(Json::Str(String::new())),
                            });
                            ops.push(PatchOp {
                                op: "remove",
                                path,
                                value: None,
                            });
                        }
                    }
                }
            } else {
                ops.push(PatchOp {
                    op: "add",
                    path: ptr(&[t, &o.key]),
                    value: Some(object_json(o)),
                });
            }
        }
    }
    ops
}

/// A patch as JSON text.
pub fn ops_json(ops: &[PatchOp]) -> Json {
    Json::Arr(
        ops.iter()
            .map(|op| {
                let mut m = vec![
                    ("op".to_string(), Json::Str(op.op.into())),
                    ("path".to_string(), Json::Str(op.path.clone())),
                ];
                if let Some(v) = &op.value {
                    m.push(("value".to_string(), v.clone()));
                }
                Json::Obj(m)
            })
            .collect(),
    )
}

/// The JSON Patch for `config apply-patch`: exact against `current` when given, else
/// [`blind_ops`].
pub fn render_patch(policy: &Policy, current: Option<&Value>) -> Result<String, RenderError> {
    let objs = objects(policy)?;
    let ops = match current {
        Some(c) => plan(&objs, c)?.ops,
        None => blind_ops(&objs),
    };
    Ok(ops_json(&ops).pretty())
}

/// The plan's changes as text, one line per field (or removed range entry), after a
/// summary line.
pub fn render_changes(plan: &Plan) -> String {
    let (mut add, mut rep, mut rem, mut entries) = (0, 0, 0, 0);
    let mut body = String::new();
    for c in &plan.changes {
        match c {
            Change::RemoveEntry { object, old } => {
                entries += 1;
                body.push_str(&format!(
                    "- {object} (whole range entry, replaced by per-queue entries; was {old})\n"
                ));
            }
            Change::Add {
                object,
                field,
                value,
            } => {
                add += 1;
                body.push_str(&format!("+ {object}: {field} = {value:?}\n"));
            }
            Change::Replace {
                object,
                field,
                old,
                value,
            } => {
                rep += 1;
                body.push_str(&format!("~ {object}: {field} = {old} -> {value:?}\n"));
            }
            Change::Remove { object, field, old } => {
                rem += 1;
                body.push_str(&format!("- {object}: {field} (was {old})\n"));
            }
        }
    }
    let ranges = if entries > 0 {
        format!(", {entries} QUEUE range entries to remove")
    } else {
        String::new()
    };
    format!(
        "# sonic: {add} fields to add, {rep} to change, {rem} to remove{ranges}, {} already as wanted\n{body}",
        plan.unchanged
    )
}

/// `a` or `a-b` with a <= b, both queue or priority-group indices 0..=7.
fn index_range(s: &str) -> Option<(u8, u8)> {
    let num = |x: &str| {
        (!x.is_empty() && x.len() <= 2 && x.bytes().all(|b| b.is_ascii_digit()))
            .then(|| x.parse::<u8>().ok())
            .flatten()
            .filter(|v| *v < gradwire_qos::NUM_QUEUES)
    };
    match s.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b)?);
            (a <= b).then_some((a, b))
        }
        None => num(s).map(|a| (a, a)),
    }
}

/// The buffer tables gradwire reads (to warn) but never writes: they are not in the
/// reference it renders against.
const BUFFER_TABLES: [&str; 2] = ["BUFFER_PG", "BUFFER_QUEUE"];

/// Warnings for the operator about what the SONiC output does not change: lossless (PFC)
/// buffer settings, and, without a running config, `pfc_enable` and range keys the output
/// cannot see. `fragment` is true for the `config_db.json` fragment, which cannot remove
/// fields. Each string is one line.
pub fn warnings(policy: &Policy, current: Option<&Value>, fragment: bool) -> Vec<String> {
    let mut w = Vec::new();
    let ports = policy.ports.join(",");
    w.push("WARNING: PFC and lossless buffers.".into());
    w.push(
        "  gradwire's policy has PFC off on every queue (DLCP drops, it does not pause).".into(),
    );
    if fragment {
        w.push(
            "  This config_db fragment cannot remove PORT_QOS_MAP pfc_enable: `config load`".into(),
        );
        w.push(
            "  merges fields, so a pfc_enable already on the switch (a default Mellanox SONiC"
                .into(),
        );
        w.push("  config has \"3,4\") stays and keeps data queues 3 and 4 lossless. Use".into());
        w.push("  --target sonic-patch (with --current), which removes it.".into());
    } else {
        w.push(format!(
            "  The patch leaves no PORT_QOS_MAP pfc_enable on {ports} (removed where present)."
        ));
    }
    let mut found = Vec::new();
    if let Some(cur) = current {
        for port in &policy.ports {
            let pfc: Vec<u8> = cur
                .get("PORT_QOS_MAP")
                .and_then(|t| t.get(port))
                .and_then(|o| o.get("pfc_enable"))
                .and_then(Value::as_str)
                .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
                .unwrap_or_default();
            for table in BUFFER_TABLES {
                let Some(entries) = cur.get(table).and_then(Value::as_object) else {
                    continue;
                };
                for (key, entry) in entries {
                    let Some((p, idx)) = key.rsplit_once('|') else {
                        continue;
                    };
                    let Some((a, b)) = index_range(idx) else {
                        continue;
                    };
                    let lossless_name = entry.to_string().to_ascii_lowercase().contains("lossless");
                    let had_pfc = pfc.iter().any(|q| (a..=b).contains(q));
                    if p == port && (lossless_name || had_pfc) {
                        found.push(format!("    {table}|{key}: {entry}"));
                    }
                }
            }
        }
    }
    w.push("  gradwire does not change tc_to_pg_map or the buffer tables (BUFFER_PG,".into());
    w.push("  BUFFER_QUEUE): they are not in the reference it renders against.".into());
    let has_tables = current.is_some_and(|c| BUFFER_TABLES.iter().any(|t| c.get(t).is_some()));
    match current {
        Some(_) if !has_tables => {
            w.push(
                "  The running config given has neither table, so gradwire cannot list the".into(),
            );
            w.push("  entries to check.".into());
        }
        Some(_) if found.is_empty() => {
            w.push(
                "  The running config has no BUFFER_PG/BUFFER_QUEUE entry on these ports that"
                    .into(),
            );
            w.push("  names a lossless profile or covers a priority with PFC enabled.".into());
        }
        Some(_) => {
            w.push(
                "  These entries on the policy's ports still look lossless (the profile name"
                    .into(),
            );
            w.push("  says lossless, or they cover a priority that has PFC enabled now):".into());
            w.extend(found);
        }
        None => {
            w.push(
                "  Without the running config (--current) gradwire cannot see them; a default"
                    .into(),
            );
            w.push(
                "  Mellanox SONiC config has lossless BUFFER_PG and BUFFER_QUEUE entries for 3-4."
                    .into(),
            );
        }
    }
    w.push(
        "  Check on the switch that no lossless (PFC) buffer profile is left on the priority"
            .into(),
    );
    w.push(
        "  groups and queues that carry gradwire data (queues 0-6; 3-4 on a default Mellanox"
            .into(),
    );
    w.push(
        "  SONiC config), and move them to lossy profiles with your SONiC version's buffer".into(),
    );
    w.push("  tools; until then those queues may not drop the way DLCP expects.".into());
    if current.is_none() && !fragment {
        w.push(
            "WARNING: without --current the patch cannot see QUEUE range entries such as".into(),
        );
        w.push(
            "  `QUEUE|Ethernet0|3-4`, which would keep binding the old scheduler and WRED".into(),
        );
        w.push("  profile; render with --current (from `sonic-cfggen -d --print-data`) to remove them.".into());
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::ThresholdSpec;
    use gradwire_units::Bytes;

    fn policy() -> Policy {
        let mut p = Policy::gradwire(ThresholdSpec::Arithmetic {
            base: Bytes(65536),
            step: 0.5,
        });
        p.ports = vec!["Ethernet0".into(), "Ethernet4".into()];
        p
    }

    /// Apply add/replace/remove ops (object members only, as generated) to a document.
    fn apply(doc: &mut Value, ops: &[PatchOp]) {
        for op in ops {
            let tokens: Vec<String> = op.path[1..]
                .split('/')
                .map(|t| t.replace("~1", "/").replace("~0", "~"))
                .collect();
            let (last, parents) = tokens.split_last().unwrap();
            let mut cur = &mut *doc;
            for t in parents {
                cur = cur
                    .get_mut(t)
                    .expect("parent exists (RFC 6902 add requires it)");
            }
            let obj = cur.as_object_mut().unwrap();
            match op.op {
                "add" => {
                    obj.insert(last.clone(), op.value.as_ref().unwrap().to_value());
                }
                "replace" => {
                    assert!(obj.contains_key(last), "replace needs the member");
                    obj.insert(last.clone(), op.value.as_ref().unwrap().to_value());
                }
                "remove" => {
                    assert!(obj.remove(last).is_some(), "remove needs the member");
                }
                other => panic!("unexpected op {other}"),
            }
        }
    }

    fn contains(doc: &Value, objs: &[Object]) {
        for o in objs {
            let got = &doc[o.table][&o.key];
            for (f, v) in &o.fields {
                match v {
                    Some(v) => assert_eq!(
                        got[*f],
                        Value::String(v.clone()),
                        "{}|{} {f}",
                        o.table,
                        o.key
                    ),
                    None => assert!(
                        got.get(*f).is_none(),
                        "{}|{} {f} must be absent",
                        o.table,
                        o.key
                    ),
                }
            }
        }
    }

    #[test]
    fn fragment_shape() {
        let objs = objects(&policy()).unwrap();
        let v = fragment(&objs).to_value();
        assert_eq!(
            v["DSCP_TO_TC_MAP"]["GRADWIRE"].as_object().unwrap().len(),
            64
        );
        assert_eq!(v["DSCP_TO_TC_MAP"]["GRADWIRE"]["46"], "6");
        assert_eq!(v["DSCP_TO_TC_MAP"]["GRADWIRE"]["48"], "7");
        assert_eq!(v["SCHEDULER"]["GRADWIRE_STRICT"]["type"], "STRICT");
        assert_eq!(
            v["WRED_PROFILE"]["GRADWIRE_Q6"]["green_min_threshold"],
            "65536"
        );
        assert_eq!(
            v["WRED_PROFILE"]["GRADWIRE_Q0"]["green_max_threshold"],
            "262144"
        );
        assert_eq!(v["QUEUE"]["Ethernet4|6"]["wred_profile"], "GRADWIRE_Q6");
        assert!(v["QUEUE"]["Ethernet4|7"].get("wred_profile").is_none());
        assert_eq!(
            v["PORT_QOS_MAP"]["Ethernet0"]["tc_to_queue_map"],
            "GRADWIRE"
        );
    }

    #[test]
    fn patch_against_empty_config_adds_tables() {
        let objs = objects(&policy()).unwrap();
        let mut doc = serde_json::json!({});
        let p = plan(&objs, &doc).unwrap();
        assert_eq!(p.ops.len(), 6);
        assert!(p.ops.iter().all(|o| o.op == "add"));
        apply(&mut doc, &p.ops);
        contains(&doc, &objs);
        // applying again changes nothing
        let again = plan(&objs, &doc).unwrap();
        assert!(again.ops.is_empty() && again.changes.is_empty());
        assert!(again.unchanged > 0);
    }

    #[test]
    fn patch_against_a_default_switch_is_minimal() {
        let objs = objects(&policy()).unwrap();
        let mut doc = serde_json::json!({
            "DSCP_TO_TC_MAP": {"AZURE": {"0": "1"}},
            "SCHEDULER": {"scheduler.0": {"type": "DWRR", "weight": "14"}},
            "WRED_PROFILE": {"AZURE_LOSSLESS": {"ecn": "ecn_all"}},
            "QUEUE": {
                "Ethernet0|7": {"scheduler": "scheduler.0", "wred_profile": "AZURE_LOSSLESS"},
                "Ethernet0|3": {"scheduler": "GRADWIRE_STRICT"}
            },
            "PORT_QOS_MAP": {"Ethernet0": {"dscp_to_tc_map": "AZURE", "pfc_enable": "3,4"}},
            "PORT": {"Ethernet0": {"speed": "100000"}}
        });
        let before = doc.clone();
        let p = plan(&objs, &doc).unwrap();
        assert!(p
            .ops
            .iter()
            .any(|o| o.op == "remove" && o.path == "/QUEUE/Ethernet0|7/wred_profile"));
        assert!(p
            .ops
            .iter()
            .any(|o| o.op == "replace" && o.path == "/PORT_QOS_MAP/Ethernet0/dscp_to_tc_map"));
        assert!(p
            .ops
            .iter()
            .any(|o| o.op == "add" && o.path == "/TC_TO_QUEUE_MAP"));
        assert!(p
            .ops
            .iter()
            .any(|o| o.op == "add" && o.path == "/QUEUE/Ethernet0|3/wred_profile"));
        apply(&mut doc, &p.ops);
        contains(&doc, &objs);
        // untouched: other tables, other objects, other fields
        assert_eq!(doc["PORT"], before["PORT"]);
        assert_eq!(
            doc["DSCP_TO_TC_MAP"]["AZURE"],
            before["DSCP_TO_TC_MAP"]["AZURE"]
        );
        // PFC off on every queue: the default "3,4" goes, the port's other fields stay.
        assert!(p
            .ops
            .iter()
            .any(|o| o.op == "remove" && o.path == "/PORT_QOS_MAP/Ethernet0/pfc_enable"));
        assert!(doc["PORT_QOS_MAP"]["Ethernet0"].get("pfc_enable").is_none());
        let text = render_changes(&p);
        assert!(
            text.contains("- PORT_QOS_MAP|Ethernet0: pfc_enable (was \"3,4\")"),
            "{text}"
        );
        assert!(
            text.contains("- QUEUE|Ethernet0|7: wred_profile (was \"AZURE_LOSSLESS\")"),
            "{text}"
        );
        assert!(
            text.contains("~ PORT_QOS_MAP|Ethernet0: dscp_to_tc_map = \"AZURE\" -> \"GRADWIRE\""),
            "{text}"
        );
    }

    #[test]
    fn blind_patch_applies_to_a_config_with_the_tables() {
        let objs = objects(&policy()).unwrap();
        let mut doc = serde_json::json!({
            "DSCP_TO_TC_MAP": {}, "TC_TO_QUEUE_MAP": {}, "SCHEDULER": {}, "WRED_PROFILE": {},
            "QUEUE": {"Ethernet0|7": {"scheduler": "x", "wred_profile": "y"}},
            "PORT_QOS_MAP": {"Ethernet0": {"pfc_enable": "3"}, "Ethernet4": {}}
        });
        apply(&mut doc, &blind_ops(&objs));
        contains(&doc, &objs);
        // pfc_enable ends absent whether it was there (Ethernet0) or not (Ethernet4).
        assert!(doc["PORT_QOS_MAP"]["Ethernet0"].get("pfc_enable").is_none());
        assert!(doc["PORT_QOS_MAP"]["Ethernet4"].get("pfc_enable").is_none());
    }

    #[test]
    fn queue_range_entries_on_policy_ports_are_removed_first() {
        let objs = objects(&policy()).unwrap();
        let mut doc = serde_json::json!({
            "SCHEDULER": {"scheduler.1": {"type": "DWRR", "weight": "15"}},
            "WRED_PROFILE": {"AZURE_LOSSLESS": {"ecn": "ecn_all"}},
            "QUEUE": {
                "Ethernet0|3-4": {"scheduler": "scheduler.1", "wred_profile": "AZURE_LOSSLESS"},
                "Ethernet0|0-2": {"scheduler": "scheduler.1"},
                "Ethernet4|5": {"scheduler": "scheduler.1"},
                "Ethernet8|3-4": {"scheduler": "scheduler.1", "wred_profile": "AZURE_LOSSLESS"}
            },
            "PORT_QOS_MAP": {"Ethernet0": {}, "Ethernet4": {}}
        });
        let p = plan(&objs, &doc).unwrap();
        let pos = |path: &str| p.ops.iter().position(|o| o.path == path);
        let range = pos("/QUEUE/Ethernet0|3-4").expect("range removed");
        assert_eq!(p.ops[range].op, "remove");
        assert_eq!(p.ops[pos("/QUEUE/Ethernet0|0-2").unwrap()].op, "remove");
        assert!(
            range < pos("/QUEUE/Ethernet0|3").unwrap(),
            "removed before the adds"
        );
        assert!(pos("/QUEUE/Ethernet8|3-4").is_none(), "not a policy port");
        apply(&mut doc, &p.ops);
        contains(&doc, &objs);
        let queue = doc["QUEUE"].as_object().unwrap();
        assert!(!queue.contains_key("Ethernet0|3-4") && !queue.contains_key("Ethernet0|0-2"));
        assert!(queue.contains_key("Ethernet8|3-4"));
        let text = render_changes(&p);
        assert!(text.contains("2 QUEUE range entries to remove"), "{text}");
        assert!(
            text.contains("- QUEUE|Ethernet0|3-4 (whole range entry"),
            "{text}"
        );
        // idempotent
        assert!(plan(&objs, &doc).unwrap().ops.is_empty());
    }

    #[test]
    fn warnings_name_lossless_buffer_entries() {
        let cur = serde_json::json!({
            "PORT_QOS_MAP": {"Ethernet0": {"pfc_enable": "3,4"}},
            "BUFFER_PG": {
                "Ethernet0|3-4": {"profile": "pg_lossless_100000_5m_profile"},
                "Ethernet0|0": {"profile": "ingress_lossy_profile"},
                "Ethernet8|3-4": {"profile": "pg_lossless_100000_5m_profile"}
            },
            "BUFFER_QUEUE": {
                "Ethernet4|3-4": {"profile": "egress_lossless_profile"},
                "Ethernet0|3-4": {"profile": "NULL"}
            }
        });
        let w = warnings(&policy(), Some(&cur), false).join("\n");
        assert!(w.contains("BUFFER_PG|Ethernet0|3-4"), "{w}");
        assert!(w.contains("BUFFER_QUEUE|Ethernet4|3-4"), "{w}");
        assert!(
            w.contains("BUFFER_QUEUE|Ethernet0|3-4"),
            "PFC was on for 3-4: {w}"
        );
        assert!(!w.contains("Ethernet0|0:"), "lossy: {w}");
        assert!(!w.contains("Ethernet8"), "not a policy port: {w}");
        let w = warnings(&policy(), None, true).join("\n");
        assert!(w.contains("cannot remove PORT_QOS_MAP pfc_enable"), "{w}");
        let w = warnings(&policy(), None, false).join("\n");
        assert!(w.contains("QUEUE range entries"), "{w}");
    }

    #[test]
    fn bad_current_configs_are_errors() {
        let objs = objects(&policy()).unwrap();
        assert!(plan(&objs, &serde_json::json!([])).is_err());
        assert!(plan(&objs, &serde_json::json!({"QUEUE": 5})).is_err());
        assert!(plan(&objs, &serde_json::json!({"QUEUE": {"Ethernet0|0": "x"}})).is_err());
    }

    #[test]
    fn pointer_escaping() {
        assert_eq!(pointer_token("a/b~c"), "a~1b~0c");
        assert_eq!(ptr(&["QUEUE", "Ethernet0|1"]), "/QUEUE/Ethernet0|1");
    }
}
