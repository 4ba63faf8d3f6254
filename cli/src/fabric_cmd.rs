//! `gradwire testbed up|down|status` and `gradwire fabric run|stats`: arguments in, text or
//! JSON out. The work (namespaces, the background fabric process, its state files in
//! [`crate::stats::stats_dir`], readiness and stopping, reading the stats back) is
//! [`gradwire_fabric::supervise`]; the stats are [`gradwire_fabric::stats::FabricStats`].

use std::error::Error;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use gradwire_fabric::run::FabricConfig;
use gradwire_fabric::stats::{read_stats_with_text, FabricStats};
use gradwire_fabric::supervise::{
    is_stale, load_topology, now_unix, DownTarget, FabricProgram, LaunchOptions, StopOutcome,
    StoppedFabric, TestbedRecord, Testbeds,
};
use gradwire_fabric::topology::Topology;
use gradwire_units::human_size;

use crate::args::{
    FabricRunArgs, FabricStatsArgs, TestbedDownArgs, TestbedStatusArgs, TestbedUpArgs,
};
use crate::stats::stats_dir;

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// The testbeds in the stats directory, whose fabrics are this program's `fabric run`.
fn testbeds() -> Res<Testbeds> {
    Ok(Testbeds::new(
        stats_dir(),
        FabricProgram::this_program(&["fabric", "run"])?,
    ))
}

/// A plain text table: `rows[0]` is the header; columns flagged in `right` are right-aligned.
fn table(rows: &[Vec<String>], right: &[bool]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let w = width[c];
            if right.get(c).copied().unwrap_or(false) {
                line.push_str(&format!("{cell:>w$}"));
            } else {
                line.push_str(&format!("{cell:<w$}"));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|s| (*s).to_owned()).collect()
}

/// `gradwire testbed up FILE`.
pub fn testbed_up(a: &TestbedUpArgs) -> Res {
    let topo = load_topology(&a.file)?;
    let opts = LaunchOptions {
        xdp_mode: a.fabric.xdp_mode,
        seed: a.fabric.seed,
    };
    let up = testbeds()?.up(&topo, &a.file, opts)?;
    print!("{}", describe_up(&topo, &up.record, &up.log));
    Ok(())
}

fn describe_up(topo: &Topology, st: &TestbedRecord, log: &Path) -> String {
    let mut out = format!(
        "testbed {} is up: {} hosts, {} switch{}; fabric pid {} (log {})\n\n",
        st.name,
        st.hosts.len(),
        st.switches.len(),
        if st.switches.len() == 1 { "" } else { "es" },
        st.pid,
        log.display()
    );
    let mut hosts = vec![row(["HOST", "ADDRESS", "NAMESPACE", "UPLINK"])];
    for (h, plan) in st.hosts.iter().zip(&topo.hosts) {
        let uplink = topo.switches.get(plan.switch).map_or(String::new(), |s| {
            let rate = s.ports.get(plan.port).map_or(0, |p| p.link.rate_bps);
            format!("{} ({})", s.name, fmt_rate(rate))
        });
        hosts.push(vec![
            h.name.clone(),
            h.ip.to_string(),
            h.netns.clone(),
            uplink,
        ]);
    }
    out.push_str(&table(&hosts, &[]));
    out.push('\n');
    let mut sws = vec![row(["SWITCH", "PORTS", "NAMESPACE", "ECMP"])];
    for (s, plan) in st.switches.iter().zip(&topo.switches) {
        sws.push(vec![
            s.name.clone(),
            plan.ports.len().to_string(),
            s.netns.clone(),
            plan.ecmp.to_string(),
        ]);
    }
    out.push_str(&table(&sws, &[false, true]));
    let h0 = st.hosts.first().map_or("<ns>", |h| h.netns.as_str());
    let ip1 = st
        .hosts
        .get(1)
        .map_or(String::from("<address>"), |h| h.ip.to_string());
    out.push_str(&format!(
        "\nrun a command on a host:  ip netns exec {h0} ping -c 3 {ip1}\n\
         fabric counters:          gradwire fabric stats {}\n\
         tear it down:             gradwire testbed down {}\n",
        st.name, st.name
    ));
    out
}

/// The line about one fabric process `down` dealt with.
fn stop_line(f: &StoppedFabric) -> String {
    let pid = f.pid;
    match f.outcome {
        StopOutcome::NotRunning => format!("fabric (pid {pid}) was not running"),
        StopOutcome::NotTheFabric => format!(
            "pid {pid} is no longer the fabric (another process has that pid); not signalled"
        ),
        StopOutcome::Stopped { .. } => format!("fabric (pid {pid}) stopped"),
        StopOutcome::Killed => format!(
            "fabric (pid {pid}) killed: it did not stop within {}s of SIGTERM",
            gradwire_fabric::supervise::STOP_TIMEOUT.as_secs()
        ),
    }
}

/// `gradwire testbed down FILE|NAME`.
pub fn testbed_down(a: &TestbedDownArgs) -> Res {
    let target = DownTarget::parse(&a.target)?;
    let report = testbeds()?.down(target)?;
    let name = &report.name;
    if let Some(e) = &report.ignored_record {
        eprintln!("gradwire: warning: ignoring the testbed record: {e}");
    }
    if !report.was_up {
        println!("testbed {name} is not up");
        return Ok(());
    }
    if let Some(f) = &report.fabric {
        println!("{}", stop_line(f));
        if let StopOutcome::Stopped {
            final_stats: Some(s),
        } = &f.outcome
        {
            println!("  {}", summary(s));
        } else if let Some(log) = &f.log_kept {
            println!("  its log is kept: {}", log.display());
        }
    }
    for f in &report.strays {
        println!("{} (not in the testbed record)", stop_line(f));
    }
    report.result()?;
    println!(
        "testbed {name} is down: {} namespaces removed",
        report.removed
    );
    Ok(())
}

/// `gradwire testbed status`.
pub fn testbed_status(a: &TestbedStatusArgs) -> Res {
    let tb = testbeds()?;
    let all = tb.status();
    if a.json {
        println!("{}", serde_json::to_string(&all)?);
        return Ok(());
    }
    if all.is_empty() {
        println!("no testbed is up (records in {})", tb.dir().display());
        return Ok(());
    }
    let mut rows = vec![row(["TESTBED", "FABRIC", "HOSTS", "SWITCHES", "FILE"])];
    for s in &all {
        let r = &s.record;
        let fabric = if s.running {
            format!("pid {} running", r.pid)
        } else {
            format!("pid {} STOPPED", r.pid)
        };
        rows.push(vec![
            r.name.clone(),
            fabric,
            r.hosts.len().to_string(),
            r.switches.len().to_string(),
            r.file.display().to_string(),
        ]);
    }
    print!("{}", table(&rows, &[false, false, true, true]));
    if all.iter().any(|s| !s.running) {
        println!("a stopped fabric forwards nothing: `gradwire testbed down NAME` and up again");
    }
    Ok(())
}

/// `gradwire fabric run FILE`.
pub fn fabric_run(a: &FabricRunArgs) -> Res {
    let topo = load_topology(&a.file)?;
    let plan = testbeds()?.plan_run(&topo, &a.file, a.prefix.as_deref(), a.stats.clone())?;
    // Before opening the ports: a SIGTERM during setup must still end in an orderly exit.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .map_err(|e| format!("cannot install a handler for signal {sig}: {e}"))?;
    }
    let cfg = FabricConfig {
        xdp_mode: a.fabric.xdp_mode,
        seed: a.fabric.seed,
        max_lag_ns: a.max_lag_us.saturating_mul(1000),
        ..FabricConfig::default()
    };
    let mode = cfg.xdp_mode;
    let ports: usize = topo.switches.iter().map(|s| s.ports.len()).sum();
    let last = plan.run(&topo, cfg, &stop, || {
        eprintln!(
            "gradwire fabric: {}: {} switch(es), {ports} ports open (XDP {mode}, namespaces \
             {}-*); stats in {}; SIGTERM or Ctrl-C stops it",
            topo.name,
            topo.switches.len(),
            plan.prefix,
            plan.stats_path.display()
        );
    })?;
    if let Some(s) = last {
        eprintln!("gradwire fabric: {}", summary(&s));
    }
    Ok(())
}

/// One line about a fabric's final stats.
fn summary(s: &FabricStats) -> String {
    let t = s.totals();
    let l = &s.lag;
    let mut line = format!(
        "{} stopped after {:.1} s: {} frames forwarded, {} delivered, {} lost on links, {} \
         ECN-marked, {} dropped; lag mean {} p99 {} worst {} ({}/{} late)",
        s.topology,
        s.uptime_s,
        t.forwarded,
        t.delivered,
        t.lost,
        t.marked,
        t.dropped,
        fmt_ns(l.mean_ns),
        fmt_ns(l.p99_ns),
        fmt_ns(l.worst_ns),
        l.late,
        l.departures
    );
    if l.behind {
        line.push_str("; BEHIND: results of this run are not valid");
    }
    line
}

/// `gradwire fabric stats [NAME|PATH]`.
pub fn fabric_stats(a: &FabricStatsArgs) -> Res {
    let source = testbeds()?.stats_source(a.target.as_deref())?;
    loop {
        // Read back typed even for `--json`: a file that is not fabric stats is an error.
        let (stats, text) = read_stats_with_text(&source.path)?;
        let mut shown = if a.json {
            text
        } else {
            render_stats(&stats, source.alive(), now_unix())
        };
        if !shown.ends_with('\n') {
            shown.push('\n');
        }
        let mut out = std::io::stdout().lock();
        match out.write_all(shown.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => {}
            // `gradwire fabric stats | head`: the reader has seen enough.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(format!("cannot write to stdout: {e}").into()),
        }
        drop(out);
        match a.watch {
            Some(secs) if secs > 0.0 && secs.is_finite() => {
                std::thread::sleep(Duration::from_secs_f64(secs));
                if !a.json {
                    println!();
                }
            }
            _ => return Ok(()),
        }
    }
}

fn fmt_ns(ns: u64) -> String {
    let f = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2}ms", f / 1e6)
    } else {
        format!("{:.2}s", f / 1e9)
    }
}

fn fmt_rate(bps: u64) -> String {
    for (div, unit) in [
        (1_000_000_000, "Gbit"),
        (1_000_000, "Mbit"),
        (1_000, "Kbit"),
    ] {
        if bps >= div {
            return if bps % div == 0 {
                format!("{}{unit}", bps / div)
            } else {
                format!("{:.1}{unit}", bps as f64 / div as f64)
            };
        }
    }
    format!("{bps}bit")
}

/// The human form of fabric stats. `alive`: whether the fabric's pid lives, if known.
fn render_stats(s: &FabricStats, alive: Option<bool>, now: u64) -> String {
    let stopped = !s.running || alive == Some(false) || is_stale(s, now);
    let mut out = format!(
        "fabric {}: up {:.1} s, loop cpu {:.1} s{}\n",
        s.topology,
        s.uptime_s,
        s.loop_cpu_s,
        if stopped {
            format!(
                " (fabric stopped; last update {}s ago)",
                now.saturating_sub(s.updated_unix)
            )
        } else {
            String::new()
        }
    );
    let lag = &s.lag;
    out.push_str(&format!(
        "lag: mean {}  p99 {}  worst {}  late {}/{} departures (bound {})\n",
        fmt_ns(lag.mean_ns),
        fmt_ns(lag.p99_ns),
        fmt_ns(lag.worst_ns),
        lag.late,
        lag.departures,
        fmt_ns(lag.max_lag_ns),
    ));
    if lag.behind {
        out.push_str(
            "BEHIND: results of this run are not valid (the fabric sent too many frames later \
             than scheduled; lower the link rates or the load)\n",
        );
    }
    for sw in &s.switches {
        let f = &sw.forward;
        out.push_str(&format!(
            "switch {} (ecmp {}): rx {}  forwarded {}  no_route {}  ttl_expired {}  malformed {}  \
             not_ipv4 {}\n",
            sw.name, sw.ecmp, f.rx, f.forwarded, f.no_route, f.ttl_expired, f.malformed, f.not_ipv4,
        ));
    }
    out.push('\n');
    let mut rows = vec![row([
        "SWITCH",
        "PORT",
        "PEER",
        "RATE",
        "DELIVERED",
        "LOST",
        "Q",
        "ENQ",
        "DEQ",
        "MARKED",
        "DROP_THR",
        "DROP_BUF",
        "MAXDEPTH",
        "DEPTH",
    ])];
    let mut warnings = Vec::new();
    for sw in &s.switches {
        for p in &sw.ports {
            let e = &p.egress;
            let mut head = vec![
                sw.name.clone(),
                p.ifname.clone(),
                p.peer.clone(),
                fmt_rate(p.rate_bps),
                e.delivered_pkts.to_string(),
                e.lost_pkts.to_string(),
            ];
            let mut any = false;
            for (q, (qc, depth)) in e.queues.iter().zip(&p.depth_bytes).enumerate() {
                if qc.arrivals() == 0 {
                    continue;
                }
                let mut r = std::mem::replace(&mut head, vec![String::new(); 6]);
                r.extend([
                    q.to_string(),
                    qc.enqueued_pkts.to_string(),
                    qc.dequeued_pkts.to_string(),
                    qc.marked.to_string(),
                    qc.dropped_threshold.to_string(),
                    qc.dropped_buffer.to_string(),
                    human_size(qc.max_depth_bytes),
                    human_size(*depth),
                ]);
                rows.push(r);
                any = true;
            }
            if !any {
                head.extend(std::iter::repeat_n("-".to_owned(), 8));
                rows.push(head);
            }
            let kdrops = p.kernel.rx_dropped + p.kernel.rx_ring_full;
            let refused = p.socket.tx_refused;
            if kdrops > 0 || refused > 0 {
                warnings.push(format!(
                    "{} {}: {kdrops} frames dropped by the kernel before the fabric saw them, \
                     {refused} refused by the TX ring",
                    sw.name, p.ifname
                ));
            }
        }
    }
    let mut right = vec![false, false, false, true, true, true];
    right.extend([true; 8]);
    out.push_str(&table(&rows, &right));
    for w in warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_fabric::run::{LagStats, PortStats, SwitchStats};
    use gradwire_fabric::sched::{PortCounters, QueueCounters};

    #[test]
    fn names_and_formats() {
        // Testbed names are gradwire_fabric::supervise's, tested there.
        assert_eq!(fmt_rate(200_000_000), "200Mbit");
        assert_eq!(fmt_rate(10_000_000_000), "10Gbit");
        assert_eq!(fmt_rate(1_500_000), "1.5Mbit");
        assert_eq!(fmt_ns(640), "640ns");
        assert_eq!(fmt_ns(65_535), "65.5us");
        assert_eq!(fmt_ns(2_500_000), "2.50ms");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &[row(["A", "NUM"]), row(["long", "7"]), row(["x", "1234"])],
            &[false, true],
        );
        assert_eq!(t, "A      NUM\nlong     7\nx     1234\n");
    }

    fn port(ifname: &str, peer: &str, egress: PortCounters, depth: [u64; 8]) -> PortStats {
        PortStats {
            ifname: ifname.into(),
            peer: peer.into(),
            rate_bps: 200_000_000,
            delay_ns: 20_000,
            loss: 0.0,
            egress,
            depth_bytes: depth,
            socket: Default::default(),
            kernel: Default::default(),
        }
    }

    fn sample(running: bool, behind: bool) -> FabricStats {
        let mut p0 = PortCounters::default();
        p0.queues[1] = QueueCounters {
            enqueued_pkts: 900,
            dequeued_pkts: 899,
            marked: 12,
            dropped_threshold: 3,
            max_depth_bytes: 45_100,
            ..QueueCounters::default()
        };
        p0.delivered_pkts = 899;
        let mut p1 = port("p1", "host h1", PortCounters::default(), [0; 8]);
        p1.socket.tx_refused = 5;
        FabricStats {
            topology: "incast".into(),
            running,
            uptime_s: 12.34,
            updated_unix: 1000,
            lag: LagStats {
                departures: 1800,
                late: 2,
                max_lag_ns: 1_000_000,
                worst_ns: 2_500_000,
                mean_ns: 9000,
                p99_ns: 65_535,
                behind,
            },
            iterations: 10,
            sleeps: 5,
            loop_cpu_s: 0.5,
            switches: vec![SwitchStats {
                name: "s0".into(),
                ecmp: gradwire_fabric::topology::Ecmp::Flow,
                forward: gradwire_fabric::forward::ForwardCounters {
                    rx: 1810,
                    forwarded: 1800,
                    not_ipv4: 10,
                    ..Default::default()
                },
                ports: vec![port("p0", "host h0", p0, [0, 1538, 0, 0, 0, 0, 0, 0]), p1],
            }],
        }
    }

    #[test]
    fn render_shows_active_queues_and_state() {
        let out = render_stats(&sample(true, false), Some(true), 1001);
        assert!(
            out.starts_with("fabric incast: up 12.3 s, loop cpu 0.5 s\n"),
            "{out}"
        );
        assert!(out.contains("forwarded 1800"), "{out}");
        assert!(out.contains("p99 65.5us"), "{out}");
        assert!(!out.contains("BEHIND"), "{out}");
        let p0 = out
            .lines()
            .find(|l| l.starts_with("s0") && l.contains("p0"))
            .unwrap();
        let cells: Vec<&str> = p0.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "s0", "p0", "host", "h0", "200Mbit", "899", "0", "1", "900", "899", "12", "3", "0",
                "44.0KiB", "1.5KiB"
            ]
        );
        let p1 = out.lines().find(|l| l.contains(" p1 ")).unwrap();
        assert_eq!(
            p1.split_whitespace().collect::<Vec<_>>()[..7],
            ["s0", "p1", "host", "h1", "200Mbit", "0", "0"]
        );
        assert!(
            out.contains("warning: s0 p1: 0 frames dropped by the kernel"),
            "{out}"
        );

        let out = render_stats(&sample(true, true), Some(false), 1001);
        assert!(out.contains("(fabric stopped"), "{out}");
        assert!(
            out.contains("BEHIND: results of this run are not valid"),
            "{out}"
        );
        let out = render_stats(&sample(true, false), None, 1100);
        assert!(out.contains("(fabric stopped"), "stale file: {out}");
        let out = render_stats(&sample(false, false), None, 1000);
        assert!(out.contains("(fabric stopped"), "{out}");
    }

    #[test]
    fn summary_sums_every_port() {
        let line = summary(&sample(false, true));
        assert_eq!(
            line,
            "incast stopped after 12.3 s: 1800 frames forwarded, 899 delivered, 0 lost on links, \
             12 ECN-marked, 3 dropped; lag mean 9.0us p99 65.5us worst 2.50ms (2/1800 late); \
             BEHIND: results of this run are not valid"
        );
    }
}
