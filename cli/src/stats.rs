//! Live statistics: every `gradwire send`/`recv` writes its counters to a small JSON file after
//! each transfer (`/run/gradwire/<pid>.json`, or under `$TMPDIR` when /run is not writable);
//! `gradwire stats` reads the files of the processes still alive and prints them.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gradwire::afxdp::AfXdpStats;
use gradwire::datapath::DatapathStats;
use serde_json::{json, Value};

use crate::args::StatsArgs;

/// Where stats files live.
pub fn stats_dir() -> PathBuf {
    let run = Path::new("/run/gradwire");
    if std::fs::create_dir_all(run).is_ok() {
        return run.to_path_buf();
    }
    std::env::temp_dir().join(format!("gradwire-{}", nix::unistd::geteuid()))
}

/// This process's stats file; removed when dropped.
#[derive(Debug)]
pub struct StatsFile {
    path: Option<PathBuf>,
    role: &'static str,
    datapath: &'static str,
}

impl StatsFile {
    pub fn new(role: &'static str, datapath: &'static str) -> StatsFile {
        let dir = stats_dir();
        let path = std::fs::create_dir_all(&dir)
            .ok()
            .map(|()| dir.join(format!("{}.json", std::process::id())));
        StatsFile {
            path,
            role,
            datapath,
        }
    }

    /// Replace the file's contents (atomically, by rename). Failures only cost visibility.
    pub fn write(&self, transfers: u32, dp: DatapathStats, afxdp: Option<AfXdpStats>) {
        let Some(path) = &self.path else { return };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs();
        let v = json!({
            "pid": std::process::id(),
            "role": self.role,
            "datapath": self.datapath,
            "updated_unix": now,
            "transfers": transfers,
            "stats": dp,
            "afxdp": afxdp,
        });
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, v.to_string()).is_ok() {
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

/// Field `k` of a JSON object as u64 (0 when absent).
pub(crate) fn u(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn pk(v: &Value, k: &str) -> u64 {
    v.get(k).map_or(0, |c| u(c, "packets"))
}

/// Print AF_XDP socket and classifier counters (from their JSON form).
pub fn print_afxdp_value(who: &str, st: &Value) {
    let ifname = st.get("ifname").and_then(Value::as_str).unwrap_or("?");
    let mode = st.get("xdp_mode").and_then(Value::as_str).unwrap_or("?");
    println!("afxdp {who} on {ifname} (XDP {mode}):");
    for q in st
        .get("queues")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let k = q.get("kernel").cloned().unwrap_or(Value::Null);
        println!(
            "  queue {}{} {} hugepages={}  rx {} pkts {} B  tx {} pkts {} B  malformed {}  tx_ring_full {}  fill_empty {}  sleeps {}  kicks {}",
            u(q, "queue"),
            q.get("core").and_then(Value::as_u64).map_or(String::new(), |c| format!(" (core {c})")),
            q.get("mode").and_then(Value::as_str).unwrap_or("?"),
            q.get("hugepages").and_then(Value::as_bool).unwrap_or(false),
            u(q, "rx_packets"),
            u(q, "rx_bytes"),
            u(q, "tx_packets"),
            u(q, "tx_bytes"),
            u(q, "rx_malformed"),
            u(q, "tx_ring_full"),
            u(q, "fill_empty"),
            u(q, "sleeps"),
            u(q, "kicks"),
        );
        println!(
            "    kernel: rx_dropped {}  rx_ring_full {}  fill_ring_empty {}  tx_ring_empty {}  invalid descs rx {} tx {}",
            u(&k, "rx_dropped"),
            u(&k, "rx_ring_full"),
            u(&k, "rx_fill_ring_empty_descs"),
            u(&k, "tx_ring_empty_descs"),
            u(&k, "rx_invalid_descs"),
            u(&k, "tx_invalid_descs"),
        );
    }
    if let Some(x) = st.get("xdp").filter(|x| !x.is_null()) {
        println!(
            "  xdp: gradwire {}  redirected {}  to_kernel {}  passed {}  drop truncated {} not_allowed {} fault {}  CE {}",
            pk(x, "gradwire"),
            pk(x, "redirected"),
            pk(x, "to_kernel"),
            pk(x, "passed"),
            pk(x, "drop_truncated"),
            pk(x, "drop_not_allowed"),
            pk(x, "drop_fault"),
            u(x, "ce_packets"),
        );
        const ECN: [&str; 4] = ["not-ect", "ect1", "ect0", "ce"];
        for c in x
            .get("classes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            println!(
                "    dscp {:>2} {:<7} {} pkts {} B",
                u(c, "dscp"),
                ECN[(u(c, "ecn") & 3) as usize],
                u(c, "packets"),
                u(c, "bytes")
            );
        }
    }
}

/// Print AF_XDP counters.
pub fn print_afxdp(who: &str, st: &AfXdpStats) {
    match serde_json::to_value(st) {
        Ok(v) => print_afxdp_value(who, &v),
        Err(e) => eprintln!("gradwire: cannot show AF_XDP stats: {e}"),
    }
}

fn alive(pid: i32) -> bool {
    // EPERM: the process exists but belongs to someone else.
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Stats of live gradwire processes.
pub fn collect(dir: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
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
        if let Some(v) = std::fs::read_to_string(&p)
            .ok()
            .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        {
            out.push(v);
        }
    }
    out.sort_by_key(|v| u(v, "pid"));
    out
}

/// `gradwire stats`.
pub fn run(a: &StatsArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let dir = a.dir.clone().unwrap_or_else(stats_dir);
    loop {
        let all = collect(&dir);
        if a.json {
            println!("{}", Value::Array(all));
        } else if all.is_empty() {
            println!(
                "no running gradwire send/recv (stats files in {})",
                dir.display()
            );
        } else {
            for v in &all {
                let s = v.get("stats").cloned().unwrap_or(Value::Null);
                println!(
                    "pid {} {} over {}: {} transfers; tx {} pkts {} B (dropped {}), rx {} pkts {} B (dropped {})",
                    u(v, "pid"),
                    v.get("role").and_then(Value::as_str).unwrap_or("?"),
                    v.get("datapath").and_then(Value::as_str).unwrap_or("?"),
                    u(v, "transfers"),
                    u(&s, "tx_packets"),
                    u(&s, "tx_bytes"),
                    u(&s, "tx_dropped"),
                    u(&s, "rx_packets"),
                    u(&s, "rx_bytes"),
                    u(&s, "rx_dropped"),
                );
                if let Some(x) = v.get("afxdp").filter(|x| !x.is_null()) {
                    print_afxdp_value("", x);
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

    #[test]
    fn files_of_dead_processes_are_ignored_and_removed() {
        let dir = std::env::temp_dir().join(format!("gw-stats-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(format!("{}.json", std::process::id())),
            r#"{"pid": 1, "role": "recv"}"#,
        )
        .unwrap();
        // pid 0x7ffffffe is never a live process.
        std::fs::write(dir.join("2147483646.json"), "{}").unwrap();
        std::fs::write(dir.join("junk.json"), "{}").unwrap();
        let got = collect(&dir);
        assert_eq!(got.len(), 1);
        assert!(!dir.join("2147483646.json").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
