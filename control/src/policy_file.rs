//! Policy files: TOML (or JSON, by the `.json` extension) to [`Policy`] and back.
//!
//! Every field is optional; what is missing comes from [`Policy::gradwire`]. A file:
//!
//! ```toml
//! name = "GRADWIRE"             # SONiC object name prefix
//! port_buffer = "512KiB"        # thresholds must fit in it
//! ports = ["Ethernet0", "Ethernet4"]
//! asic = "spectrum1"            # round thresholds to 96-byte cells
//!
//! [thresholds]                  # either base + step ...
//! base = "64KiB"
//! step = 0.5
//! # queues = ["256KiB", "224KiB", "192KiB", "160KiB", "128KiB", "96KiB", "64KiB"]
//! #                             # ... or one per data queue, queue 0 first
//!
//! [dscp]                        # omit for gradwire's code points
//! default_tc = 0                # traffic class of every DSCP not in `map`
//! control = [48]                # the DSCPs allowed into queue 7
//! map = { 46 = 6, 40 = 5, 34 = 4, 26 = 3, 18 = 2, 10 = 1, 48 = 7 }
//!
//! tc_to_queue = [0, 1, 2, 3, 4, 5, 6, 7]
//! ```
//!
//! Sizes are a number of bytes or a string with a unit (`"64KiB"`, `"64KB"` = 64000).
//! Errors name the file and the field; a value that parses but is out of range is reported
//! by [`Policy::validate`] with the field's name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::asic::Asic;
use crate::policy::{Policy, PolicyError, ThresholdSpec, DATA_QUEUES, NUM_DSCP};
use gradwire_units::{Bytes, SizeValue, UnitError};

/// A policy file as written; see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    /// SONiC object name prefix.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Per-port buffer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_buffer: Option<SizeValue>,
    /// Ports or interfaces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<String>>,
    /// ASIC name (`spectrum1`..`spectrum5`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub asic: Option<String>,
    /// Thresholds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thresholds: Option<ThresholdsFile>,
    /// DSCP classification.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dscp: Option<DscpFile>,
    /// Queue of each traffic class 0..=7.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tc_to_queue: Option<Vec<i64>>,
}

/// The `[thresholds]` table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdsFile {
    /// T.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<SizeValue>,
    /// d.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<f64>,
    /// Explicit thresholds, queue 0 first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queues: Option<Vec<SizeValue>>,
}

/// The `[dscp]` table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DscpFile {
    /// Traffic class of DSCPs not in `map`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_tc: Option<i64>,
    /// Control DSCPs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control: Option<Vec<i64>>,
    /// DSCP (as a key) -> traffic class.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map: Option<BTreeMap<String, i64>>,
}

/// A policy file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// Reading failed.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Writing failed.
    #[error("{path}: cannot write: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not valid TOML, or a field of the wrong type or name.
    #[error("{path}: {source}")]
    Toml {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line, column and key.
        source: toml::de::Error,
    },
    /// Not valid JSON, or a field of the wrong type or name.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        source: serde_json::Error,
    },
    /// A field that parses but means nothing.
    #[error("{path}: field `{field}`: {message}")]
    Field {
        /// The file.
        path: PathBuf,
        /// Dotted field name.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A size that does not parse.
    #[error("{path}: field `{field}`: {source}")]
    Size {
        /// The file.
        path: PathBuf,
        /// Dotted field name.
        field: String,
        /// Why.
        source: UnitError,
    },
    /// The policy as a whole is invalid.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        source: PolicyError,
    },
}

/// Whether a path is JSON (by extension); everything else is TOML.
pub fn is_json(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// Decode file text as TOML, or as JSON when `path` ends in `.json`; errors name the file.
/// Policy and model files share it.
pub fn decode<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, FileError> {
    if is_json(path) {
        serde_json::from_str(text).map_err(|source| FileError::Json {
            path: path.into(),
            source,
        })
    } else {
        toml::from_str(text).map_err(|source| FileError::Toml {
            path: path.into(),
            source,
        })
    }
}

/// Read a file's text; the error names the file.
pub fn read_text(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(|source| FileError::Io {
        path: path.into(),
        source,
    })
}

/// Parse file text (TOML or JSON by `path`'s extension) into a [`PolicyFile`].
pub fn parse_policy_file(path: &Path, text: &str) -> Result<PolicyFile, FileError> {
    decode(path, text)
}

/// Read, parse and convert a policy file. The result is not yet validated (flags may
/// still change it); call [`Policy::validate`].
pub fn load_policy(path: &Path) -> Result<Policy, FileError> {
    let text = read_text(path)?;
    let file = parse_policy_file(path, &text)?;
    policy_from_file(path, &file)
}

/// Load and validate.
pub fn load_valid_policy(path: &Path) -> Result<Policy, FileError> {
    let p = load_policy(path)?;
    p.validate().map_err(|source| FileError::Invalid {
        path: path.into(),
        source,
    })?;
    Ok(p)
}

fn field_err(path: &Path, field: &str, message: String) -> FileError {
    FileError::Field {
        path: path.into(),
        field: field.into(),
        message,
    }
}

fn size(path: &Path, field: &str, v: &SizeValue) -> Result<Bytes, FileError> {
    v.bytes().map_err(|source| FileError::Size {
        path: path.into(),
        field: field.into(),
        source,
    })
}

fn small_int(path: &Path, field: &str, v: i64, max: u8, what: &str) -> Result<u8, FileError> {
    u8::try_from(v)
        .ok()
        .filter(|x| *x <= max)
        .ok_or_else(|| field_err(path, field, format!("{what} {v} is out of range 0..={max}")))
}

/// Convert a parsed file; `path` is only used in messages.
pub fn policy_from_file(path: &Path, f: &PolicyFile) -> Result<Policy, FileError> {
    let thresholds = match &f.thresholds {
        None => {
            return Err(field_err(
                path,
                "thresholds",
                "missing: give `base` and `step`, or `queues`".into(),
            ))
        }
        Some(t) => match (&t.base, t.step, &t.queues) {
            (Some(b), Some(step), None) => ThresholdSpec::Arithmetic {
                base: size(path, "thresholds.base", b)?,
                step,
            },
            (None, None, Some(qs)) => {
                if qs.len() != DATA_QUEUES {
                    return Err(field_err(
                        path,
                        "thresholds.queues",
                        format!(
                            "needs exactly {DATA_QUEUES} sizes (data queues 0..=6, queue 0 first), got {}",
                            qs.len()
                        ),
                    ));
                }
                let mut out = [Bytes(0); DATA_QUEUES];
                for (i, q) in qs.iter().enumerate() {
                    out[i] = size(path, &format!("thresholds.queues[{i}]"), q)?;
                }
                ThresholdSpec::Explicit(out)
            }
            _ => {
                return Err(field_err(
                    path,
                    "thresholds",
                    "give either `base` and `step` (arithmetic sequence) or `queues` (explicit), not a mix".into(),
                ))
            }
        },
    };
    let mut p = Policy::gradwire(thresholds);
    if let Some(n) = &f.name {
        p.name = n.clone();
    }
    if let Some(b) = &f.port_buffer {
        p.port_buffer = size(path, "port_buffer", b)?;
    }
    if let Some(ports) = &f.ports {
        p.ports = ports.clone();
    }
    if let Some(a) = &f.asic {
        p.asic = Some(
            a.parse::<Asic>()
                .map_err(|e| field_err(path, "asic", e.to_string()))?,
        );
    }
    if let Some(d) = &f.dscp {
        if let Some(map) = &d.map {
            let default_tc = match d.default_tc {
                Some(v) => small_int(path, "dscp.default_tc", v, 7, "traffic class")?,
                None => 0,
            };
            let mut tcs = [default_tc; NUM_DSCP];
            for (k, v) in map {
                let field = format!("dscp.map.{k}");
                let dscp: u8 = k
                    .trim()
                    .parse::<u8>()
                    .ok()
                    .filter(|d| usize::from(*d) < NUM_DSCP)
                    .ok_or_else(|| {
                        field_err(path, &field, format!("key {k:?} is not a DSCP 0..=63"))
                    })?;
                tcs[usize::from(dscp)] = small_int(path, &field, *v, 7, "traffic class")?;
            }
            // Keys like "7" and "07" name the same DSCP: refuse rather than pick one.
            let mut seen = [false; NUM_DSCP];
            for k in map.keys() {
                if let Ok(d) = k.trim().parse::<u8>() {
                    if std::mem::replace(&mut seen[usize::from(d)], true) {
                        return Err(field_err(
                            path,
                            &format!("dscp.map.{k}"),
                            format!("DSCP {d} is given twice"),
                        ));
                    }
                }
            }
            p.dscp_to_tc = tcs;
        } else if d.default_tc.is_some() {
            return Err(field_err(
                path,
                "dscp.default_tc",
                "only meaningful together with `dscp.map`".into(),
            ));
        }
        if let Some(c) = &d.control {
            let mut out = Vec::with_capacity(c.len());
            for (i, v) in c.iter().enumerate() {
                out.push(small_int(
                    path,
                    &format!("dscp.control[{i}]"),
                    *v,
                    63,
                    "DSCP",
                )?);
            }
            p.control_dscp = out;
        }
    }
    if let Some(t) = &f.tc_to_queue {
        if t.len() != 8 {
            return Err(field_err(
                path,
                "tc_to_queue",
                format!(
                    "needs exactly 8 queue indices (traffic class 0 first), got {}",
                    t.len()
                ),
            ));
        }
        for (tc, q) in t.iter().enumerate() {
            p.tc_to_queue[tc] = small_int(path, &format!("tc_to_queue[{tc}]"), *q, 7, "queue")?;
        }
    }
    Ok(p)
}

/// The file form of a policy. The DSCP table and `tc_to_queue` are written only when they
/// differ from gradwire's defaults.
pub fn policy_to_file(p: &Policy) -> PolicyFile {
    let default = Policy::gradwire(p.thresholds.clone());
    let thresholds = match &p.thresholds {
        ThresholdSpec::Arithmetic { base, step } => ThresholdsFile {
            base: Some(SizeValue::Text(base.to_string())),
            step: Some(*step),
            queues: None,
        },
        ThresholdSpec::Explicit(t) => ThresholdsFile {
            base: None,
            step: None,
            queues: Some(t.iter().map(|b| SizeValue::Bytes(b.0)).collect()),
        },
    };
    let dscp = if p.dscp_to_tc != default.dscp_to_tc || p.control_dscp != default.control_dscp {
        let map = p
            .dscp_to_tc
            .iter()
            .enumerate()
            .filter(|(_, tc)| **tc != 0)
            .map(|(d, tc)| (d.to_string(), i64::from(*tc)))
            .collect();
        Some(DscpFile {
            default_tc: Some(0),
            control: Some(p.control_dscp.iter().map(|d| i64::from(*d)).collect()),
            map: Some(map),
        })
    } else {
        None
    };
    PolicyFile {
        name: (p.name != default.name).then(|| p.name.clone()),
        port_buffer: Some(SizeValue::Text(p.port_buffer.to_string())),
        ports: (!p.ports.is_empty()).then(|| p.ports.clone()),
        asic: p.asic.map(|a| a.name().to_string()),
        thresholds: Some(thresholds),
        dscp,
        tc_to_queue: (p.tc_to_queue != default.tc_to_queue)
            .then(|| p.tc_to_queue.iter().map(|q| i64::from(*q)).collect()),
    }
}

/// A policy as TOML, after a comment header (each line of `header` prefixed with `# `).
pub fn policy_to_toml(p: &Policy, header: &str) -> String {
    let mut out = String::new();
    for line in header.lines() {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
    // Serialising plain strings, numbers, arrays and tables cannot fail.
    out.push_str(&toml::to_string(&policy_to_file(p)).unwrap_or_default());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Policy, FileError> {
        let path = Path::new("p.toml");
        policy_from_file(path, &parse_policy_file(path, text)?)
    }

    #[test]
    fn minimal_file() {
        let p = parse("[thresholds]\nbase = \"64KiB\"\nstep = 0.5\n").unwrap();
        assert_eq!(
            p,
            Policy::gradwire(ThresholdSpec::Arithmetic {
                base: Bytes(65536),
                step: 0.5
            })
        );
    }

    #[test]
    fn full_file() {
        let p = parse(
            r#"
name = "DLCP"
port_buffer = 1048576
ports = ["Ethernet0", "Ethernet4"]
asic = "spectrum2"
tc_to_queue = [0, 1, 2, 3, 4, 5, 6, 7]
[thresholds]
queues = ["448KiB", 400000, "300KB", "200KiB", "100KiB", "50KiB", "10KiB"]
[dscp]
default_tc = 1
control = [48, 56]
map = { 48 = 7, 56 = 7, 46 = 6 }
"#,
        )
        .unwrap();
        p.validate().unwrap();
        assert_eq!(p.name, "DLCP");
        assert_eq!(p.asic, Some(Asic::Spectrum2));
        assert_eq!(p.dscp_queue(56), 7);
        assert_eq!(p.dscp_queue(0), 1);
        assert_eq!(p.dscp_queue(46), 6);
        let ThresholdSpec::Explicit(t) = p.thresholds else {
            panic!("explicit")
        };
        assert_eq!(t[1], Bytes(400000));
        assert_eq!(t[2], Bytes(300000));
    }

    #[test]
    fn round_trip_through_toml() {
        let mut p = parse("[thresholds]\nbase = \"64KiB\"\nstep = 0.25\n").unwrap();
        p.ports = vec!["Ethernet0".into()];
        p.asic = Some(Asic::Spectrum1);
        let text = policy_to_toml(&p, "test");
        assert_eq!(parse(&text).unwrap(), p);
        p.thresholds = ThresholdSpec::Explicit([Bytes(9); 7]);
        p.dscp_to_tc[56] = 7;
        p.control_dscp.push(56);
        p.tc_to_queue = [0, 1, 2, 3, 4, 5, 7, 6];
        let text = policy_to_toml(&p, "test");
        assert_eq!(parse(&text).unwrap(), p);
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = |t: &str| parse(t).unwrap_err().to_string();
        let m = e("");
        assert!(m.contains("p.toml") && m.contains("thresholds"), "{m}");
        let m = e("[thresholds]\nbase = \"64QiB\"\nstep = 1\n");
        assert!(
            m.contains("thresholds.base") && m.contains("unknown size unit"),
            "{m}"
        );
        let m = e("[thresholds]\nbase = 1\nstep = 1\nqueues = []\n");
        assert!(m.contains("not a mix"), "{m}");
        let m = e("[thresholds]\nqueues = [1, 2]\n");
        assert!(
            m.contains("thresholds.queues") && m.contains("exactly 7"),
            "{m}"
        );
        let m = e("colour = 1\n[thresholds]\nbase = 1\nstep = 1\n");
        assert!(m.contains("p.toml") && m.contains("colour"), "{m}");
        let m = e("[thresholds]\nbase = 1\nstep = \"x\"\n");
        assert!(m.contains("step"), "{m}");
        let m = e("[thresholds]\nbase = 1\nstep = 1\n[dscp]\nmap = { 64 = 1 }\n");
        assert!(m.contains("dscp.map.64"), "{m}");
        let m = e("[thresholds]\nbase = 1\nstep = 1\n[dscp]\nmap = { 7 = 1, 07 = 2 }\n");
        assert!(m.contains("twice"), "{m}");
        let m = e("[thresholds]\nbase = 1\nstep = 1\n[dscp]\nmap = { 1 = 8 }\n");
        assert!(
            m.contains("dscp.map.1") && m.contains("traffic class 8"),
            "{m}"
        );
        let m = e("[thresholds]\nbase = 1\nstep = 1\n[dscp]\ncontrol = [-1]\n");
        assert!(m.contains("dscp.control[0]"), "{m}");
        let m = e("[thresholds]\nbase = 1\nstep = 1\n[dscp]\ndefault_tc = 2\n");
        assert!(m.contains("dscp.default_tc"), "{m}");
        let m = e("tc_to_queue = [1]\n[thresholds]\nbase = 1\nstep = 1\n");
        assert!(m.contains("tc_to_queue"), "{m}");
        let m = e("tc_to_queue = [0,1,2,3,4,5,6,99]\n[thresholds]\nbase = 1\nstep = 1\n");
        assert!(m.contains("tc_to_queue[7]"), "{m}");
        let m = e("asic = \"tofino\"\n[thresholds]\nbase = 1\nstep = 1\n");
        assert!(m.contains("field `asic`"), "{m}");
        let m = e("[thresholds\n");
        assert!(m.contains("p.toml"), "{m}");
    }

    #[test]
    fn json_files() {
        let path = Path::new("p.json");
        let f = parse_policy_file(path, r#"{"thresholds": {"base": "1KiB", "step": 1}}"#).unwrap();
        let p = policy_from_file(path, &f).unwrap();
        p.validate().unwrap();
        let err = parse_policy_file(path, "{").unwrap_err().to_string();
        assert!(err.starts_with("p.json:"), "{err}");
    }

    #[test]
    fn missing_file() {
        let err = load_policy(Path::new("/nonexistent/x.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/nonexistent/x.toml") && err.contains("cannot read"),
            "{err}"
        );
    }
}
