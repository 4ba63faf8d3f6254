//! `gradwire stats --prometheus ADDR`: the counters of every running `gradwire send`/`recv`
//! ([`ProcessStats`], any datapath, either transport) in Prometheus's text exposition
//! format (version 0.0.4), served over HTTP at `/metrics`.
//!
//! Names follow Prometheus's conventions: `gradwire_` then the record's section and field
//! (`gradwire_endpoint_datagrams_in_total`, `gradwire_afxdp_queues_rx_bytes_total`,
//! `gradwire_afxdp_xdp_classes_packets_total`), `_total` on counters, bytes as `_bytes`.
//! Every sample carries the process's `pid`, `role`, `datapath` and `protocol`; string and
//! boolean fields of a section, and the fields that name a thing rather than count
//! ([`LABEL_FIELDS`]: the queue, its core, the DSCP and ECN of a class), become labels of the
//! counters beside them, so a queue's or a class's counters are one series each. Refusals
//! are one counter with a `reason` label. The files are rewritten after every transfer, so a
//! scrape sees the counters as of the last finished transfer.
//!
//! The server is deliberately small: one connection at a time, a request line and headers
//! of at most 8 KiB read within 2 s, the answer written within 2 s; anything but `GET
//! /metrics` is a 404.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::stats::{collect, ProcessStats};

/// Fields that name what their neighbours count: labels, not counters.
pub const LABEL_FIELDS: &[&str] = &["queue", "core", "dscp", "ecn"];
/// Longest request accepted (request line and headers).
const MAX_REQUEST: usize = 8 * 1024;
/// Longest wait for a request, and for the answer to be taken.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

type Labels = Vec<(String, String)>;

/// One sample: metric name, labels, value.
struct Sample {
    name: String,
    labels: Labels,
    value: f64,
}

fn metric_name(parts: &[&str]) -> String {
    let mut n = String::from("gradwire");
    for p in parts {
        n.push('_');
        n.extend(
            p.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
        );
    }
    n
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The counters of `v` (an object) under `path`, with `labels` and its own label fields.
fn walk(path: &mut Vec<String>, v: &Value, labels: &Labels, out: &mut Vec<Sample>) {
    let Value::Object(map) = v else { return };
    let mut mine = labels.clone();
    for (k, f) in map {
        let label = match f {
            Value::String(s) => Some(s.clone()),
            Value::Bool(b) => Some(b.to_string()),
            Value::Number(n) if LABEL_FIELDS.contains(&k.as_str()) => Some(n.to_string()),
            _ => None,
        };
        if let Some(l) = label {
            mine.push((k.clone(), l));
        }
    }
    for (k, f) in map {
        if LABEL_FIELDS.contains(&k.as_str()) {
            continue;
        }
        path.push(k.clone());
        match f {
            Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    let parts: Vec<&str> = path.iter().map(String::as_str).collect();
                    out.push(Sample {
                        name: format!("{}_total", metric_name(&parts)),
                        labels: mine.clone(),
                        value: x,
                    });
                }
            }
            Value::Object(_) => walk(path, f, &mine, out),
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    // Elements without a naming field of their own are told apart by index.
                    let named = item
                        .as_object()
                        .is_some_and(|o| LABEL_FIELDS.iter().any(|l| o.contains_key(*l)));
                    let mut l = mine.clone();
                    if !named {
                        l.push(("index".into(), i.to_string()));
                    }
                    walk(path, item, &l, out);
                }
            }
            _ => {}
        }
        path.pop();
    }
}

/// Every process's counters in the text exposition format.
pub fn render(all: &[ProcessStats]) -> String {
    let mut samples = Vec::new();
    for p in all {
        let base: Labels = vec![
            ("pid".into(), p.pid.to_string()),
            ("role".into(), p.role.clone()),
            ("datapath".into(), p.datapath.clone()),
            ("protocol".into(), p.protocol.clone()),
        ];
        samples.push(Sample {
            name: "gradwire_transfers_total".into(),
            labels: base.clone(),
            value: f64::from(p.transfers),
        });
        samples.push(Sample {
            name: "gradwire_stats_updated_seconds".into(),
            labels: base.clone(),
            value: p.updated_unix as f64,
        });
        let sections = [
            ("endpoint", serde_json::to_value(p.endpoint).ok()),
            ("datapath", serde_json::to_value(p.stats).ok()),
            ("afxdp", serde_json::to_value(&p.afxdp).ok()),
        ];
        for (name, v) in sections {
            if let Some(v) = v {
                walk(&mut vec![name.to_owned()], &v, &base, &mut samples);
            }
        }
        if let Ok(Value::Object(reasons)) = serde_json::to_value(p.rejected) {
            for (reason, n) in reasons {
                if let Some(x) = n.as_f64() {
                    let mut labels = base.clone();
                    labels.push(("reason".into(), reason));
                    samples.push(Sample {
                        name: "gradwire_rejected_datagrams_total".into(),
                        labels,
                        value: x,
                    });
                }
            }
        }
    }
    let mut by_name: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    for s in samples {
        by_name.entry(s.name.clone()).or_default().push(s);
    }
    let mut text = String::new();
    for (name, samples) in by_name {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let help = match name.as_str() {
            "gradwire_stats_updated_seconds" => {
                "When the process last published its counters, seconds since the epoch."
            }
            "gradwire_rejected_datagrams_total" => "Data datagrams a receiver refused, by reason.",
            _ => "A gradwire counter (gradwire stats --json has the same field).",
        };
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for s in samples {
            let labels: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            text.push_str(&format!("{name}{{{}}} {}\n", labels.join(","), s.value));
        }
    }
    text
}

/// Answers one connection: the exposition for `GET /metrics`, 404 otherwise.
fn answer(mut s: TcpStream, dir: &Path) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut req = Vec::new();
    let mut chunk = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk)?;
        if n == 0 || req.len() + n > MAX_REQUEST {
            return Ok(());
        }
        req.extend_from_slice(&chunk[..n]);
    }
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (status, kind, body) = match (words.next(), words.next()) {
        (Some("GET"), Some("/metrics")) => match collect(dir) {
            Ok(all) => (
                "200 OK",
                "text/plain; version=0.0.4; charset=utf-8",
                render(&all),
            ),
            Err(e) => (
                "500 Internal Server Error",
                "text/plain; charset=utf-8",
                format!("{e}\n"),
            ),
        },
        _ => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "gradwire serves its counters at /metrics\n".into(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())
}

/// Serves `/metrics` on `addr` until the process is stopped; prints the address it serves
/// on first (with port 0, the port the kernel chose).
pub fn serve(addr: SocketAddr, dir: &Path) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let l = TcpListener::bind(addr)
        .map_err(|e| format!("--prometheus {addr}: {e} (give a free address and port)"))?;
    println!(
        "serving Prometheus metrics on http://{}/metrics",
        l.local_addr()?
    );
    let _ = std::io::stdout().flush();
    for conn in l.incoming() {
        match conn {
            Ok(s) => {
                let peer = s.peer_addr().ok();
                if let Err(e) = answer(s, dir) {
                    log::warn!("stats: scrape from {peer:?}: {e}");
                }
            }
            Err(e) => {
                log::warn!("stats: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::EndpointCounters;
    use gradwire::flow::RejectCounts;

    #[test]
    fn a_message_layer_record_becomes_counters_with_the_process_labels() {
        let p = ProcessStats {
            pid: 42,
            role: "recv".into(),
            datapath: "udp".into(),
            protocol: "msg".into(),
            updated_unix: 1_700_000_000,
            transfers: 3,
            stats: None,
            endpoint: Some(EndpointCounters {
                datagrams_in: 1234,
                ..EndpointCounters::default()
            }),
            afxdp: None,
            rejected: RejectCounts {
                foreign_source: 5,
                ..RejectCounts::default()
            },
        };
        let text = render(&[p]);
        let labels = r#"pid="42",role="recv",datapath="udp",protocol="msg""#;
        assert!(
            text.contains("# TYPE gradwire_endpoint_datagrams_in_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "gradwire_endpoint_datagrams_in_total{{{labels}}} 1234\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("gradwire_transfers_total{{{labels}}} 3\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "gradwire_rejected_datagrams_total{{{labels},reason=\"foreign_source\"}} 5\n"
            )),
            "{text}"
        );
        assert!(
            text.contains("# TYPE gradwire_stats_updated_seconds gauge\n"),
            "{text}"
        );
        // Every sample line is `name{labels} value` under its TYPE line.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
            assert!(
                series.starts_with("gradwire_") && series.ends_with('}'),
                "{line}"
            );
        }
    }

    #[test]
    fn queues_and_classes_are_labels_and_strings_are_escaped() {
        let mut samples = Vec::new();
        let v = serde_json::json!({
            "ifname": "ve\"th0",
            "queues": [{"queue": 0, "core": 1, "rx_packets": 10}, {"queue": 1, "rx_packets": 20}],
            "xdp": {"classes": [{"dscp": 10, "ecn": 2, "packets": 7}]}
        });
        walk(&mut vec!["afxdp".into()], &v, &vec![], &mut samples);
        let find = |name: &str, value: f64| {
            samples
                .iter()
                .find(|s| s.name == name && s.value == value)
                .unwrap_or_else(|| panic!("no {name} {value}"))
        };
        let q0 = find("gradwire_afxdp_queues_rx_packets_total", 10.0);
        assert!(q0.labels.contains(&("queue".into(), "0".into())));
        assert!(q0.labels.contains(&("core".into(), "1".into())));
        let q1 = find("gradwire_afxdp_queues_rx_packets_total", 20.0);
        assert!(q1.labels.contains(&("queue".into(), "1".into())));
        let c = find("gradwire_afxdp_xdp_classes_packets_total", 7.0);
        assert!(c.labels.contains(&("dscp".into(), "10".into())));
        assert_eq!(escape("ve\"th0"), "ve\\\"th0");
    }
}
