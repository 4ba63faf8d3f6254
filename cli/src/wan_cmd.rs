//! `gradwire wan node` (one site of a NetStorm job: `gradwire_wan::site`) and `gradwire
//! experiment wan` (every strategy on the emulated WAN: `gradwire_experiment::wan`). Parse,
//! run, print, plot.

use std::error::Error;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use gradwire_experiment::wan::{run_wan, Network, WanConfig, WanReport, WAN4};
use gradwire_netstorm::config::NetStormConfig;
use gradwire_wan::site::{run_node, NodeOutput, NodeSpec, SchedulerRole, ROUND_MARK};
use gradwire_wan::workload::Workload;
use plotters::prelude::*;

use crate::args::{NetStormArgs, WanExperimentArgs, WanNodeArgs};
use crate::experiment::{register_font, LINE_COLORS};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// NetStorm's options: `base`, with what the command line sets.
fn netstorm_config(base: NetStormConfig, a: &NetStormArgs) -> NetStormConfig {
    let usize_of = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    NetStormConfig {
        chunk_size: a.chunk_size.map_or(base.chunk_size, usize_of),
        probe_chunk_size: a.probe_chunk_size.unwrap_or(base.probe_chunk_size),
        probe_chunk_num: a.probe_chunk_num.map_or(base.probe_chunk_num, usize_of),
        primary_busy_bound: a.primary_busy_bound.unwrap_or(base.primary_busy_bound),
        auxiliary_queue_length: a
            .aux_queue_length
            .map_or(base.auxiliary_queue_length, usize_of),
        update_time: a
            .update_time
            .map_or(base.update_time, Duration::from_secs_f64),
        num_roots: a.roots.map(usize_of).or(base.num_roots),
        ..base
    }
}

/// The local address the kernel would use towards `master` (a connected UDP socket sends
/// nothing).
fn local_ip_towards(master: SocketAddr) -> Res<IpAddr> {
    let any: SocketAddr = if master.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(any)?;
    s.connect(master).map_err(|e| {
        format!("cannot find this host's address towards the master {master}: {e}; pass --host")
    })?;
    Ok(s.local_addr()?.ip())
}

/// `gradwire wan node`.
pub fn node(a: &WanNodeArgs) -> Res {
    let world = usize::try_from(a.world)?;
    let ip = match a.host {
        Some(ip) => ip,
        None => local_ip_towards(a.master)?,
    };
    let scheduler = if a.serve_scheduler {
        SchedulerRole::Serve(SocketAddr::new(
            ip,
            a.scheduler_port
                .unwrap_or_else(|| a.master.port().wrapping_add(1)),
        ))
    } else {
        SchedulerRole::At(
            a.scheduler
                .unwrap_or_else(|| SocketAddr::new(a.master.ip(), a.master.port().wrapping_add(1))),
        )
    };
    let workload = Workload::load(&a.model, a.scale)?;
    let spec = NodeSpec {
        rank: a.rank,
        world,
        job: a.job,
        ip,
        master: a.master,
        scheduler,
        strategy: a.strategy,
        topology: a.topology.clone(),
        workload,
        iterations: a.iterations,
        duration: a.duration.map(Duration::from_secs_f64),
        timeout: Duration::from_secs_f64(a.timeout),
        rate_bps: a.rate,
        rate_mode: a.rate_mode,
        period_ns: a.period_us * 1000,
        netstorm: netstorm_config(NetStormConfig::default(), &a.netstorm),
        auth: gradwire::job_secret::load_secret(a.secret_file.as_deref())?
            .map(|s| std::sync::Arc::new(gradwire::auth::JobKey::new(&s))),
    };
    let (rank, most) = (a.rank, a.iterations);
    let out = match run_node(&spec, |round, ms| {
        let line = format!("node {rank}{ROUND_MARK}{}/{most}: {ms:.1} ms", round + 1);
        if a.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }) {
        Ok(out) => out,
        Err(e) => {
            // The error's causes as data (the nodes it blames, the timeout that fired).
            if a.json {
                println!("{}", serde_json::to_string_pretty(&e.failure(rank))?);
            }
            return Err(e.into());
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_node(&out);
    }
    Ok(())
}

fn print_node(o: &NodeOutput) {
    let n = o.sync_ms.len().max(1) as f64;
    println!(
        "node {} of {} ({}): {} rounds of {} x {} ({} f32 elements), sync {:.1} ms mean, policy \
         versions {:?}, {} chunks sent and {} relayed on auxiliary paths, {} link reports",
        o.rank,
        o.world,
        o.strategy,
        o.rounds,
        o.model,
        o.scale,
        o.elements,
        o.sync_ms.iter().sum::<f64>() / n,
        {
            let mut v = o.versions.clone();
            v.dedup();
            v
        },
        o.sent_aux,
        o.relayed,
        o.link_reports
    );
    if let Some(s) = &o.scheduler {
        println!(
            "scheduler: {} policies, {} topology requests, {} link reports",
            s.policies.len(),
            s.requests,
            s.link_reports
        );
    }
    println!("verified: every element of every round is the exact average over the nodes");
}

fn need_root() -> Res {
    if !gradwire_netns::is_root() {
        return Err("gradwire experiment wan needs root (network namespaces, XDP, AF_XDP)".into());
    }
    Ok(())
}

/// `gradwire experiment wan`.
pub fn experiment(a: &WanExperimentArgs) -> Res {
    need_root()?;
    let mut cfg = WanConfig::new(Path::new("."), std::env::current_exe()?);
    if a.quick {
        // wan4 drops its fastest link at 10 s: 20 s covers before and after.
        cfg.topology = WAN4.into();
        cfg.scale = 0.002;
        cfg.iterations = 50;
        cfg.duration = Some(Duration::from_secs(20));
        cfg.timeout = Duration::from_secs(30);
        cfg.netstorm.chunk_size = 20_000;
        cfg.netstorm.probe_chunk_size = 40_000;
    }
    cfg.model = a.model.clone();
    if let Some(t) = &a.topology {
        cfg.topology = t.clone();
    }
    cfg.scale = a.scale.unwrap_or(cfg.scale);
    cfg.iterations = a.iterations.unwrap_or(cfg.iterations);
    if let Some(d) = a.duration {
        cfg.duration = Some(Duration::from_secs_f64(d));
    }
    if let Some(t) = a.timeout {
        cfg.timeout = Duration::from_secs_f64(t);
    }
    if let Some(s) = &a.strategies {
        cfg.strategies = s.clone();
    }
    cfg.networks = a
        .networks
        .iter()
        .map(|n| n.parse::<Network>())
        .collect::<Result<_, _>>()?;
    cfg.rate_bps = a.rate;
    cfg.rate_mode = a.rate_mode;
    cfg.period_ns = a.period_us * 1000;
    cfg.netstorm = netstorm_config(cfg.netstorm, &a.netstorm);
    cfg.repeats = a.repeats;
    cfg.max_attempts = a.max_attempts;
    // Ctrl-C and SIGTERM end the run in order: stop the nodes, the fabric, the namespaces.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    cfg.stop = stop;
    let report = run_wan(&cfg)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    write_outputs(&a.out, &report)?;
    if report.results.iter().any(|r| r.error.is_some()) {
        return Err(format!(
            "some runs failed (see the error column and {}/wan.json)",
            a.out.display()
        )
        .into());
    }
    if !report.targets.all_runs_valid {
        return Err(format!(
            "some runs are NOT VALID; the figures and targets leave them out (see \
             targets.excluded in {}/wan.json)",
            a.out.display()
        )
        .into());
    }
    Ok(())
}

fn met(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "met",
        Some(false) => "NOT MET",
        None => "not judged (no valid run of a strategy it needs)",
    }
}

fn print_report(r: &WanReport) {
    println!(
        "NetStorm on {} ({} sites): {} x {} ({} f32 elements), at most {} rounds{} per run",
        r.topology,
        r.sites,
        r.workload.model,
        r.workload.scale,
        r.workload.elems + 1,
        r.iterations,
        r.duration_s
            .map(|d| format!(" or {d:.0} s"))
            .unwrap_or_default()
    );
    println!(
        "senders per flow at their site's fastest WAN link; frame budget {:.0} frames/s \
         (limit {:.0})",
        r.frame_budget.total_fps, r.frame_budget.limit_fps
    );
    println!(
        "{:<18} {:<8} {:>3} {:>8} {:>7} {:>12} {:>11} {:>9} {:>9} {:>10} {:>6}  excluded because",
        "strategy",
        "network",
        "run",
        "attempts",
        "rounds",
        "sync_ms_mean",
        "vs_star",
        "policies",
        "aux",
        "peak_fps",
        "valid"
    );
    for x in &r.results {
        println!(
            "{:<18} {:<8} {:>3} {:>8} {:>7} {:>12.1} {:>10.2}x {:>9} {:>9} {:>10.0} {:>6}  {}",
            x.strategy,
            x.network,
            x.repeat + 1,
            x.attempts.len(),
            x.rounds,
            x.sync_ms_mean,
            x.speedup_vs_star,
            x.policies,
            x.aux_chunks,
            x.fabric.frames_per_s_peak,
            if x.valid { "yes" } else { "NO" },
            x.exclusion().unwrap_or_default()
        );
    }
    println!("over the valid runs (min / median / max):");
    for f in &r.figures {
        println!(
            "{:<18} {:<8} {}/{} valid  sync {:.1} / {:.1} / {:.1} ms  vs star {:.2} / {:.2} / {:.2}x",
            f.strategy,
            f.network,
            f.valid_runs,
            f.runs,
            f.sync_ms.min,
            f.sync_ms.median,
            f.sync_ms.max,
            f.speedup_vs_star.min,
            f.speedup_vs_star.median,
            f.speedup_vs_star.max
        );
    }
    let t = &r.targets;
    for (name, target) in [
        ("5x star (dynamic)", &t.netstorm_5x_star_dynamic),
        ("each mechanism helps (dynamic)", &t.each_mechanism_helps),
        (
            "each mechanism helps (static)",
            &t.each_mechanism_helps_static,
        ),
        ("fapt beats bkt and mst", &t.fapt_beats_bkt_and_mst),
    ] {
        let figures: Vec<String> = target
            .figures
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect();
        println!(
            "target {name}: {} ({})",
            met(target.met),
            figures.join(", ")
        );
    }
    if !t.all_runs_valid {
        println!("some runs are NOT VALID (the fabric fell behind its clock, or a node failed)");
    }
}

/// wan.json, wan.csv, wan.png and wan-rates.png in `dir`.
fn write_outputs(dir: &Path, r: &WanReport) -> Res {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("wan.json"), serde_json::to_vec_pretty(r)?)?;
    let mut csv = String::from(
        "strategy,network,repeat,attempts,rounds,sync_ms_mean,sync_ms_median,speedup_vs_star,\
         round_ms_mean,policies,aux_chunks,relayed,link_reports,frames_per_s_peak,valid,\
         verified\n",
    );
    for x in &r.results {
        csv.push_str(&format!(
            "{},{},{},{},{},{:.1},{:.1},{:.3},{:.1},{},{},{},{},{:.0},{},{}\n",
            x.strategy,
            x.network,
            x.repeat,
            x.attempts.len(),
            x.rounds,
            x.sync_ms_mean,
            x.sync_ms_median,
            x.speedup_vs_star,
            x.round_ms_mean,
            x.policies,
            x.aux_chunks,
            x.relayed,
            x.link_reports,
            x.fabric.frames_per_s_peak,
            x.valid,
            x.verified
        ));
    }
    std::fs::write(dir.join("wan.csv"), csv)?;
    register_font()?;
    plot_bars(r, &dir.join("wan.png"))?;
    plot_rates(r, &dir.join("wan-rates.png"))?;
    eprintln!(
        "wrote {0}/wan.json, {0}/wan.csv, {0}/wan.png and {0}/wan-rates.png",
        dir.display()
    );
    Ok(())
}

/// The largest finite value (0 when there is none): the top of a plot's axis.
fn largest(values: impl Iterator<Item = f64>) -> f64 {
    values.filter(|x| x.is_finite()).fold(0.0, f64::max)
}

/// Strategies in report order.
fn strategies(r: &WanReport) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for x in &r.results {
        if !names.contains(&x.strategy) {
            names.push(x.strategy.clone());
        }
    }
    names
}

/// Per strategy, one bar per network: the median over the valid runs of the mean
/// synchronization time, a whisker from the lowest to the highest, the median speed-up over
/// star above; a strategy without a valid run is marked "no valid run".
fn plot_bars(r: &WanReport, path: &Path) -> Res {
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    let root = BitMapBackend::new(path, (1200, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let names = strategies(r);
    let mut networks: Vec<String> = Vec::new();
    for x in &r.results {
        if !networks.contains(&x.network) {
            networks.push(x.network.clone());
        }
    }
    let top = largest(r.figures.iter().map(|f| f.sync_ms.max)) * 1.2 + 1.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "NetStorm on {} ({} sites, {} x {}): mean synchronization time",
                r.topology, r.sites, r.workload.model, r.workload.scale
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..names.len().max(1) as f64, 0f64..top)
        .map_err(|x| e(&x))?;
    let labels = names.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len() * 4 + 1)
        .x_label_formatter(&|x| {
            let i = x - 0.5;
            if (i - i.round()).abs() < 1e-6 && i >= -1e-6 {
                labels.get(i.round() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("mean synchronization time per round (ms)")
        .draw()
        .map_err(|x| e(&x))?;
    let width = 0.8 / networks.len().max(1) as f64;
    for (k, net) in networks.iter().enumerate() {
        let color = LINE_COLORS[k % LINE_COLORS.len()];
        let figure = |s: &String| {
            r.figures
                .iter()
                .find(|f| &f.strategy == s && &f.network == net)
        };
        let bars: Vec<(f64, f64, f64, f64, f64)> = names
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                figure(s).filter(|f| f.valid_runs > 0).map(|f| {
                    let x0 = i as f64 + 0.1 + k as f64 * width;
                    (
                        x0,
                        f.sync_ms.median,
                        f.sync_ms.min,
                        f.sync_ms.max,
                        f.speedup_vs_star.median,
                    )
                })
            })
            .collect();
        chart
            .draw_series(bars.iter().map(|&(x0, y, ..)| {
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, y)], color.filled())
            }))
            .map_err(|x| e(&x))?
            .label(format!("{net} network"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
        chart
            .draw_series(bars.iter().map(|&(x0, _, lo, hi, _)| {
                let mid = x0 + width * 0.45;
                PathElement::new(vec![(mid, lo), (mid, hi)], BLACK.stroke_width(2))
            }))
            .map_err(|x| e(&x))?;
        // Strategies that ran without a valid run are marked where their bar would be.
        let failed: Vec<f64> = names
            .iter()
            .enumerate()
            .filter(|(_, s)| figure(s).is_some_and(|f| f.valid_runs == 0))
            .map(|(i, _)| i as f64 + 0.1 + k as f64 * width)
            .collect();
        chart
            .draw_series(failed.iter().map(|&x0| {
                Text::new(
                    "no valid run",
                    (x0, top * 0.02),
                    ("sans-serif", 13).into_font().color(&color),
                )
            }))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(
                bars.iter()
                    .filter(|b| b.4.is_finite())
                    .map(|&(x0, _, _, hi, s)| {
                        Text::new(
                            format!("{s:.1}x"),
                            (x0, hi + top * 0.01),
                            ("sans-serif", 13).into_font(),
                        )
                    }),
            )
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// Top: every scheduled link's rate over the run; bottom: each strategy's per-round
/// synchronization time against the round's start, on the dynamic network.
fn plot_rates(r: &WanReport, path: &Path) -> Res {
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    let root = BitMapBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (upper, lower) = root.split_vertically(420);
    // The first valid run of each strategy (the others are in wan.json).
    let dynamic: Vec<_> = r
        .results
        .iter()
        .filter(|x| x.network == Network::Dynamic.name() && x.valid)
        .filter(|x| {
            !r.results.iter().any(|y| {
                y.valid && y.network == x.network && y.strategy == x.strategy && y.repeat < x.repeat
            })
        })
        .collect();
    let end = largest(
        dynamic
            .iter()
            .flat_map(|x| {
                x.round_start_s
                    .iter()
                    .zip(&x.sync_ms)
                    .map(|(s, ms)| s + ms / 1e3)
            })
            .chain(r.duration_s),
    )
    .max(1.0);
    // Rates: each link's steps, repeated by its period, up to the end of the longest run.
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for l in &r.links {
        let Some(sc) = &l.schedule else {
            continue;
        };
        let (steps, period) = (&sc.steps, &sc.period_s);
        let mut pts = Vec::new();
        let mut rate = l.rate_bps as f64 / 1e6;
        let mut base = 0.0;
        pts.push((0.0, rate));
        'periods: loop {
            for &(at, bps) in steps {
                let t = base + at;
                if t > end {
                    break 'periods;
                }
                pts.push((t, rate));
                rate = bps as f64 / 1e6;
                pts.push((t, rate));
            }
            match period {
                Some(p) if *p > 0.0 && base + p <= end => {
                    base += p;
                    let t = base;
                    pts.push((t, rate));
                    rate = l.rate_bps as f64 / 1e6;
                    pts.push((t, rate));
                }
                _ => break,
            }
        }
        pts.push((end, rate));
        series.push((format!("{}-{}", l.a_switch, l.b_switch), pts));
    }
    let top_rate = largest(series.iter().flat_map(|s| s.1.iter().map(|p| p.1))) * 1.1 + 0.1;
    let any_rates = !series.is_empty();
    let mut chart = ChartBuilder::on(&upper)
        .caption(
            format!(
                "{}: link rates (dynamic network){}",
                r.topology,
                if series.is_empty() {
                    " - the topology has no rate schedule"
                } else {
                    ""
                }
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..end, 0f64..top_rate)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the fabric's start")
        .y_desc("rate (Mbit/s)")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        chart
            .draw_series(std::iter::once(PathElement::new(
                pts,
                color.stroke_width(2),
            )))
            .map_err(|x| e(&x))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    if any_rates {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 11))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }

    let top_ms = largest(dynamic.iter().flat_map(|x| x.sync_ms.iter().copied())) * 1.1 + 1.0;
    let mut chart = ChartBuilder::on(&lower)
        .caption(
            "synchronization time per round (dynamic network)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..end, 0f64..top_ms)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("round start, seconds since the fabric's start")
        .y_desc("synchronization time (ms)")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, x) in dynamic.iter().enumerate() {
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        let pts: Vec<(f64, f64)> = x
            .round_start_s
            .iter()
            .copied()
            .zip(x.sync_ms.iter().copied())
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .collect();
        chart
            .draw_series(std::iter::once(PathElement::new(
                pts.clone(),
                color.stroke_width(2),
            )))
            .map_err(|x| e(&x))?
            .label(format!("{} ({:.0} ms mean)", x.strategy, x.sync_ms_mean))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|x| e(&x))?;
    }
    if !dynamic.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{Cli, Command, ExperimentCommand, WanCommand};
    use clap::Parser;
    use gradwire_wan::scheduler::Strategy;

    #[test]
    fn the_node_and_experiment_commands_parse() {
        let c = Cli::try_parse_from([
            "gradwire",
            "wan",
            "node",
            "--rank",
            "0",
            "--world",
            "9",
            "--master",
            "198.18.1.0:29500",
            "--serve-scheduler",
            "--strategy",
            "mr-fapt+aware",
            "--topology",
            "testbeds/wan9.toml",
            "--rate",
            "100M",
            "--chunk-size",
            "5000",
            "--update-time",
            "0.5",
            "--duration",
            "80",
        ])
        .unwrap();
        let Command::Wan(w) = c.command else {
            panic!("not wan")
        };
        let WanCommand::Node(n) = w.command;
        assert_eq!(n.strategy, Strategy::MrFaptAware);
        assert_eq!(n.rate, 100_000_000);
        assert!(n.serve_scheduler);
        assert_eq!(n.duration, Some(80.0));
        let ns = netstorm_config(NetStormConfig::default(), &n.netstorm);
        assert_eq!(ns.chunk_size, 5000);
        assert_eq!(ns.update_time, Duration::from_millis(500));
        assert_eq!(
            ns.probe_chunk_num,
            NetStormConfig::default().probe_chunk_num
        );
        // A bad strategy names the good ones; --scheduler and --serve-scheduler exclude
        // each other.
        let e = Cli::try_parse_from([
            "gradwire",
            "wan",
            "node",
            "--rank",
            "0",
            "--world",
            "2",
            "--master",
            "1.2.3.4:5",
            "--strategy",
            "tree",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("mr-fapt+aware+aux"), "{e}");
        assert!(Cli::try_parse_from([
            "gradwire",
            "wan",
            "node",
            "--rank",
            "0",
            "--world",
            "2",
            "--master",
            "1.2.3.4:5",
            "--serve-scheduler",
            "--scheduler",
            "1.2.3.4:6",
        ])
        .is_err());
        let c = Cli::try_parse_from([
            "gradwire",
            "experiment",
            "wan",
            "--out",
            "/tmp/x",
            "--strategies",
            "star,mr-fapt+aware+aux",
            "--networks",
            "dynamic",
            "--quick",
        ])
        .unwrap();
        let Command::Experiment(x) = c.command else {
            panic!("not experiment")
        };
        let ExperimentCommand::Wan(w) = x.command else {
            panic!("not wan")
        };
        assert_eq!(
            w.strategies,
            Some(vec![Strategy::Star, Strategy::MrFaptAwareAux])
        );
        assert!(w.quick);
        assert_eq!(w.networks, vec!["dynamic".to_owned()]);
    }
}
