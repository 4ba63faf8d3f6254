//! A JSON tree that keeps the order it was built in, and its pretty printer.
//!
//! `serde_json::Value` sorts object keys (the workspace does not enable `preserve_order`, and
//! turning it on would change every crate's JSON), which would print DSCP "10" before "2"
//! and "Ethernet12" before "Ethernet4". Rendered files are read by people and diffed, so
//! they keep the natural order.

use std::fmt::Write as _;

/// An ordered JSON value (only what the renderers produce: strings, objects, arrays).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Json {
    /// A string.
    Str(String),
    /// An object, members in order.
    Obj(Vec<(String, Json)>),
    /// An array.
    Arr(Vec<Json>),
}

impl Json {
    /// Pretty-printed with 4-space indentation (like `sonic-cfggen --print-data`) and a
    /// trailing newline.
    pub fn pretty(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, 0);
        out.push('\n');
        out
    }

    /// As a `serde_json::Value` (order lost), for comparisons.
    pub fn to_value(&self) -> serde_json::Value {
        match self {
            Json::Str(s) => serde_json::Value::String(s.clone()),
            Json::Arr(a) => serde_json::Value::Array(a.iter().map(Json::to_value).collect()),
            Json::Obj(o) => serde_json::Value::Object(
                o.iter().map(|(k, v)| (k.clone(), v.to_value())).collect(),
            ),
        }
    }

    fn write(&self, out: &mut String, indent: usize) {
        match self {
            Json::Str(s) => out.push_str(&quote(s)),
            Json::Obj(members) if members.is_empty() => out.push_str("{}"),
            Json::Arr(items) if items.is_empty() => out.push_str("[]"),
            Json::Obj(members) => {
                out.push_str("{\n");
                for (i, (k, v)) in members.iter().enumerate() {
                    pad(out, indent + 1);
                    out.push_str(&quote(k));
                    out.push_str(": ");
                    v.write(out, indent + 1);
                    out.push_str(if i + 1 < members.len() { ",\n" } else { "\n" });
                }
                pad(out, indent);
                out.push('}');
            }
            Json::Arr(items) => {
                out.push_str("[\n");
                for (i, v) in items.iter().enumerate() {
                    pad(out, indent + 1);
                    v.write(out, indent + 1);
                    out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
                }
                pad(out, indent);
                out.push(']');
            }
        }
    }
}

fn pad(out: &mut String, indent: usize) {
    for _ in 0..indent {
        out.push_str("    ");
    }
}

/// A JSON string literal.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_and_parses_back() {
        let j = Json::Obj(vec![
            ("b".into(), Json::Str("x\"y\\\n\u{1}".into())),
            (
                "a".into(),
                Json::Arr(vec![Json::Str("1".into()), Json::Obj(vec![])]),
            ),
            ("c".into(), Json::Arr(vec![])),
        ]);
        let text = j.pretty();
        assert!(
            text.find("\"b\"").unwrap() < text.find("\"a\"").unwrap(),
            "order kept"
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v, j.to_value());
    }
}
