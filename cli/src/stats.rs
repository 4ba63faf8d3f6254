//! Live statistics: every `gradwire send`/`recv` writes its counters ([`ProcessStats`]) to a
//! small JSON file after each transfer (on the message layer its endpoint's counters, on the
//! flow transport its datapath's) (`/run/gradwire/<pid>.json`, or under `$TMPDIR` when
//! /run is not writable); `gradwire stats` reads the files of the processes still alive back as
//! the same type and prints them. A file that does not decode is an error naming it.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gradwire::afxdp::{AfXdpStats, BindMode};
use gradwire::datapath::DatapathStats;
use gradwire::flow::RejectCounts;
use serde::{Deserialize, Serialize};

use crate::args::StatsArgs;

/// Where stats files live.
pub fn stats_dir() -> PathBuf {
    let run = Path::new("/run/gradwire");
    if std::fs::create_dir_all(run).is_ok() {
        return run.to_path_buf();
    }
    std::env::temp_dir().join(format!("gradwire-{}", nix::unistd::geteuid()))
}

/// What a `gradwire send`/`recv` process publishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessStats {
    /// The process.
    pub pid: u32,
    /// `send` or `recv`.
    pub role: String,
    /// Datapath name (`udp`, `afxdp`, ...).
    pub datapath: String,
    /// `msg` (the message layer) or `flow` (the flow transport).
    pub protocol: String,
    /// Wall-clock time of this snapshot, seconds since the epoch.
    pub updated_unix: u64,
    /// Transfers finished.
    pub transfers: u32,
    /// The datapath's counters (flow transport; `null` on the message layer).
    #[serde(deserialize_with = "Option::deserialize")]
    pub stats: Option<DatapathStats>,
    /// The endpoint's counters (message layer; `null` on the flow transport).
    #[serde(deserialize_with = "Option::deserialize")]
    pub endpoint: Option<EndpointCounters>,
    /// AF_XDP counters, for the AF_XDP datapath (`null` otherwise; the field must be there).
    #[serde(deserialize_with = "Option::deserialize")]
    pub afxdp: Option<AfXdpStats>,
    /// Data datagrams a receiver refused, by reason, over all its transfers (zero for a
    /// sender): foreign sources, bad tags, stale rounds, ... (on the message layer only
    /// `foreign_source`; the endpoint's `refused` counts the rest).
    pub rejected: RejectCounts,
}

/// The counters of a message-layer endpoint, as `gradwire stats` and `--json` show them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointCounters {
    /// Datagrams sent.
    pub datagrams_out: u64,
    /// Datagrams received.
    pub datagrams_in: u64,
    /// Send system calls (AF_XDP: send calls of the socket).
    pub send_calls: u64,
    /// Receive calls that returned data.
    pub recv_calls: u64,
    /// Data segments sent for the first time.
    pub data_sent: u64,
    /// Data segments sent again.
    pub data_resent: u64,
    /// Payload bytes sent (first transmissions and resends).
    pub payload_bytes_sent: u64,
    /// Data segments placed into a tensor.
    pub data_placed: u64,
    /// Data segments that arrived again after being placed.
    pub data_duplicate: u64,
    /// Control frames sent (acks, resend requests, polls).
    pub ctrl_sent: u64,
    /// Control frames received and acted on.
    pub ctrl_received: u64,
    /// Datagrams from an address that is not the peer's (peer binding): dropped.
    pub unknown_source: u64,
    /// Datagrams from the peer's address the layer refused: malformed, another job, wrong
    /// ranks, out of range.
    pub refused: u64,
    /// Data segments dropped by the endpoint's fault injection (`--inject-loss` over UDP
    /// and loopback).
    pub injected_drops: u64,
    /// Resend requests (NACK frames) sent.
    pub nacks: u64,
}

impl From<&gradwire_msg::endpoint::EndpointStats> for EndpointCounters {
    fn from(s: &gradwire_msg::endpoint::EndpointStats) -> Self {
        EndpointCounters {
            datagrams_out: s.datagrams_out,
            datagrams_in: s.datagrams_in,
            send_calls: s.send_calls,
            recv_calls: s.recv_calls,
            data_sent: s.core.data_sent,
            data_resent: s.core.data_resent,
            payload_bytes_sent: s.core.payload_bytes_sent,
            data_placed: s.core.data_placed,
            data_duplicate: s.core.data_duplicate,
            ctrl_sent: s.core.ctrl_sent,
            ctrl_received: s.core.ctrl_received,
            unknown_source: s.unknown_source,
            refused: s.core.refused,
            injected_drops: s.injected_drops,
            nacks: s.core.nacks,
        }
    }
}

/// Prints an endpoint's counters.
pub fn print_endpoint(who: &str, e: &EndpointCounters) {
    println!(
        "endpoint{}{who}: datagrams out {} in {} (send calls {}, recv calls {}); data segments sent {} resent {} placed {} duplicate {}; control out {} in {} (nacks {}); refused: foreign_source {} invalid {}; injected drops {}",
        if who.is_empty() { "" } else { " " },
        e.datagrams_out,
        e.datagrams_in,
        e.send_calls,
        e.recv_calls,
        e.data_sent,
        e.data_resent,
        e.data_placed,
        e.data_duplicate,
        e.ctrl_sent,
        e.ctrl_received,
        e.nacks,
        e.unknown_source,
        e.refused,
        e.injected_drops,
    );
}

/// A stats file of a live process that could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum ProcessStatsError {
    /// Reading it.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Its contents.
    #[error("{}: not gradwire send/recv stats: {source} (written by another gradwire version?)", path.display())]
    Decode {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: serde_json::Error,
    },
}

/// This process's stats file; removed when dropped.
#[derive(Debug)]
pub struct StatsFile {
    path: Option<PathBuf>,
    role: &'static str,
    datapath: &'static str,
    protocol: &'static str,
}

impl StatsFile {
    pub fn new(role: &'static str, datapath: &'static str, protocol: &'static str) -> StatsFile {
        let dir = stats_dir();
        let path = std::fs::create_dir_all(&dir)
            .ok()
            .map(|()| dir.join(format!("{}.json", std::process::id())));
        StatsFile {
            path,
            role,
            datapath,
            protocol,
        }
    }

    /// Replace the file's contents with a flow-transport process's counters.
    pub fn write(
        &self,
        transfers: u32,
        dp: DatapathStats,
        afxdp: Option<AfXdpStats>,
        rejected: RejectCounts,
    ) {
        self.publish(transfers, Some(dp), None, afxdp, rejected);
    }

    /// Replace the file's contents with a message-layer process's counters.
    pub fn write_msg(
        &self,
        transfers: u32,
        endpoint: EndpointCounters,
        afxdp: Option<AfXdpStats>,
        rejected: RejectCounts,
    ) {
        self.publish(transfers, None, Some(endpoint), afxdp, rejected);
    }

    /// Replace the file's contents (atomically, by rename). Failures only cost visibility.
    fn publish(
        &self,
        transfers: u32,
        dp: Option<DatapathStats>,
        endpoint: Option<EndpointCounters>,
        afxdp: Option<AfXdpStats>,
        rejected: RejectCounts,
    ) {
        let Some(path) = &self.path else { return };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs();
        let v = ProcessStats {
            pid: std::process::id(),
            role: self.role.to_owned(),
            datapath: self.datapath.to_owned(),
            protocol: self.protocol.to_owned(),
            updated_unix: now,
            transfers,
            stats: dp,
            endpoint,
            afxdp,
            rejected,
        };
        let Ok(text) = serde_json::to_vec(&v) else {
            return;
        };
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

impl Drop for StatsFile {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The name of a bind mode as in the JSON.
fn bind_mode_name(mode: Option<BindMode>) -> &'static str {
    match mode {
        Some(BindMode::ZeroCopy) => "zerocopy",
        Some(BindMode::Copy) => "copy",
        None => "?",
    }
}

/// Print AF_XDP socket and classifier counters.
pub fn print_afxdp(who: &str, st: &AfXdpStats) {
    let mode = st.xdp_mode.map_or("?".to_owned(), |m| m.to_string());
    println!("afxdp {who} on {} (XDP {mode}):", st.ifname);
    for q in &st.queues {
        let k = &q.kernel;
        println!(
            "  queue {}{} {} hugepages={}  rx {} pkts {} B  tx {} pkts {} B  malformed {}  tx_ring_full {}  fill_empty {}  sleeps {}  kicks {}",
            q.queue,
            q.core.map_or(String::new(), |c| format!(" (core {c})")),
            bind_mode_name(q.mode),
            q.hugepages,
            q.rx_packets,
            q.rx_bytes,
            q.tx_packets,
            q.tx_bytes,
            q.rx_malformed,
            q.tx_ring_full,
            q.fill_empty,
            q.sleeps,
            q.kicks,
        );
        println!(
            "    kernel: rx_dropped {}  rx_ring_full {}  fill_ring_empty {}  tx_ring_empty {}  invalid descs rx {} tx {}",
            k.rx_dropped,
            k.rx_ring_full,
            k.rx_fill_ring_empty_descs,
            k.tx_ring_empty_descs,
            k.rx_invalid_descs,
            k.tx_invalid_descs,
        );
    }
    if let Some(x) = &st.xdp {
        println!(
            "  xdp: gradwire {}  redirected {}  to_kernel {}  passed {}  drop truncated {} not_allowed {} fault {}  CE {}",
            x.gradwire.packets,
            x.redirected.packets,
            x.to_kernel.packets,
            x.passed.packets,
            x.drop_truncated.packets,
            x.drop_not_allowed.packets,
            x.drop_fault.packets,
            x.ce_packets,
        );
        const ECN: [&str; 4] = ["not-ect", "ect1", "ect0", "ce"];
        for c in &x.classes {
            println!(
                "    dscp {:>2} {:<7} {} pkts {} B",
                c.dscp,
                ECN[usize::from(c.ecn & 3)],
                c.packets,
                c.bytes
            );
        }
    }
}

fn alive(pid: i32) -> bool {
    // EPERM: the process exists but belongs to someone else.
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Stats of live gradwire processes, by pid. Files of dead processes are removed.
pub fn collect(dir: &Path) -> Result<Vec<ProcessStats>, ProcessStatsError> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(out);
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        let Some(pid) = p
            .file_stem()
            .and_then(|s| s.to_str())
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if !alive(pid) {
            // Left by a process that was killed: not live stats.
            let _ = std::fs::remove_file(&p);
            continue;
        }
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            // The process finished (and removed its file) since the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(ProcessStatsError::Read { path: p, source }),
        };
        let v = serde_json::from_str(&text)
            .map_err(|source| ProcessStatsError::Decode { path: p, source })?;
        out.push(v);
    }
    out.sort_by_key(|v: &ProcessStats| v.pid);
    Ok(out)
}

/// `gradwire stats`.
pub fn run(a: &StatsArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let dir = a.dir.clone().unwrap_or_else(stats_dir);
    if let Some(addr) = a.prometheus {
        return crate::prometheus::serve(addr, &dir);
    }
    loop {
        let all = collect(&dir)?;
        if a.json {
            println!("{}", serde_json::to_string(&all)?);
        } else if all.is_empty() {
            println!(
                "no running gradwire send/recv (stats files in {})",
                dir.display()
            );
        } else {
            for v in &all {
                println!(
                    "pid {} {} over {} ({}): {} transfers",
                    v.pid,
                    v.role,
                    v.datapath,
                    if v.protocol == "msg" {
                        "message layer"
                    } else {
                        "flow transport"
                    },
                    v.transfers,
                );
                if let Some(s) = &v.stats {
                    println!(
                        "  tx {} pkts {} B (dropped {}), rx {} pkts {} B (dropped {})",
                        s.tx_packets,
                        s.tx_bytes,
                        s.tx_dropped,
                        s.rx_packets,
                        s.rx_bytes,
                        s.rx_dropped,
                    );
                }
                if let Some(e) = &v.endpoint {
                    print_endpoint("", e);
                }
                if v.rejected.total() > 0 {
                    println!("  refused data datagrams: {}", v.rejected);
                }
                if let Some(x) = &v.afxdp {
                    print_afxdp("", x);
                }
            }
        }
        match a.watch {
            Some(secs) if secs > 0.0 && secs.is_finite() => {
                std::thread::sleep(Duration::from_secs_f64(secs))
            }
            _ => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(pid: u32) -> ProcessStats {
        ProcessStats {
            pid,
            role: "recv".into(),
            datapath: "udp".into(),
            protocol: "flow".into(),
            updated_unix: 1000,
            transfers: 3,
            stats: Some(DatapathStats {
                rx_packets: 7,
                ..DatapathStats::default()
            }),
            endpoint: None,
            afxdp: None,
            rejected: RejectCounts {
                foreign_source: 4,
                bad_tag: 2,
                ..RejectCounts::default()
            },
        }
    }

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("gw-stats-test-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    #[test]
    fn files_of_dead_processes_are_ignored_and_removed() {
        let d = dir("dead");
        let dir = &d.0;
        std::fs::write(
            dir.join(format!("{}.json", std::process::id())),
            serde_json::to_string(&record(std::process::id())).unwrap(),
        )
        .unwrap();
        // pid 0x7ffffffe is never a live process.
        std::fs::write(dir.join("2147483646.json"), "{}").unwrap();
        std::fs::write(dir.join("junk.json"), "{}").unwrap();
        let got = collect(dir).unwrap();
        assert_eq!(got.len(), 1);
        let want = record(std::process::id());
        assert_eq!(
            (
                got[0].pid,
                &got[0].role,
                got[0].transfers,
                got[0].stats,
                got[0].rejected
            ),
            (
                want.pid,
                &want.role,
                want.transfers,
                want.stats,
                want.rejected
            )
        );
        assert!(!dir.join("2147483646.json").exists());
    }

    #[test]
    fn a_message_layer_record_reads_back_with_its_endpoint_counters() {
        let d = dir("msg");
        let path = d.0.join(format!("{}.json", std::process::id()));
        let mut st = gradwire_msg::endpoint::EndpointStats {
            unknown_source: 5,
            datagrams_in: 40,
            ..Default::default()
        };
        st.core.data_resent = 3;
        let v = ProcessStats {
            protocol: "msg".into(),
            stats: None,
            endpoint: Some(EndpointCounters::from(&st)),
            ..record(std::process::id())
        };
        std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
        let got = collect(&d.0).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].protocol, "msg");
        assert_eq!(got[0].stats, None);
        let e = got[0].endpoint.unwrap();
        assert_eq!(
            (e.unknown_source, e.datagrams_in, e.data_resent),
            (5, 40, 3)
        );
        // `endpoint` may be null, but not absent.
        let mut j = serde_json::to_value(&v).unwrap();
        j.as_object_mut().unwrap().remove("endpoint");
        std::fs::write(&path, j.to_string()).unwrap();
        let e = collect(&d.0).unwrap_err().to_string();
        assert!(e.contains("missing field `endpoint`"), "{e}");
    }

    #[test]
    fn a_live_process_file_with_a_missing_field_is_an_error_naming_it() {
        let d = dir("missing");
        let path = d.0.join(format!("{}.json", std::process::id()));
        let mut v = serde_json::to_value(record(std::process::id())).unwrap();
        v["stats"].as_object_mut().unwrap().remove("rx_packets");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = collect(&d.0).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(e.contains("missing field `rx_packets`"), "{e}");

        // `afxdp` may be null, but not absent.
        let mut v = serde_json::to_value(record(std::process::id())).unwrap();
        v.as_object_mut().unwrap().remove("afxdp");
        std::fs::write(&path, v.to_string()).unwrap();
        let e = collect(&d.0).unwrap_err().to_string();
        assert!(e.contains("missing field `afxdp`"), "{e}");
    }
}
