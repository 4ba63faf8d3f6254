//! `gradwire experiment mlnet` and `gradwire experiment priority`: see
//! `gradwire_experiment::mlnet`. Run, print a table (or the JSON), write the report and a plot.

use std::error::Error;
use std::path::Path;

use gradwire_collective::tree::Strategy;
use gradwire_experiment::csv_field;
use gradwire_experiment::mlnet::{
    run_mlnet, run_priority, MlnetConfig, MlnetReport, PriorityConfig, PriorityMode,
    PriorityReport, RunSettings, Transport,
};
use plotters::prelude::*;

use crate::args::{MlnetArgs, PriorityArgs};
use crate::experiment::{register_font, LINE_COLORS};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

fn need_root() -> Res {
    if !gradwire_netns::is_root() {
        return Err("gradwire experiment needs root (network namespaces, XDP, AF_XDP)".into());
    }
    Ok(())
}

pub fn mlnet(a: &MlnetArgs) -> Res {
    need_root()?;
    let defaults = MlnetConfig::new(Path::new("."));
    let strategies = a
        .strategies
        .iter()
        .map(|s| s.parse::<Strategy>())
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = MlnetConfig {
        topology: a.topology.clone().unwrap_or(defaults.topology.clone()),
        strategies,
        servers: a.servers.clone(),
        workers: a.workers,
        model_bytes: a.model_bytes,
        iterations: a.iterations,
        seed: a.seed,
        settings: RunSettings {
            transport: if a.transport == "flow" {
                Transport::Flow
            } else {
                Transport::Msg
            },
            grants: a.grants == "on",
            ..defaults.settings.clone()
        },
    };
    let report = run_mlnet(&cfg)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("trees on the {} transport", report.transport.name());
        println!(
            "{:<8} {:>7} {:>12} {:>8} {:>11} {:>6}  error",
            "strategy", "servers", "makespan_ms", "vs_star", "cross-rack", "valid"
        );
        for r in &report.results {
            println!(
                "{:<8} {:>7} {:>12.1} {:>8.2} {:>11} {:>6}  {}",
                r.strategy,
                r.servers,
                r.makespan_ms,
                r.vs_star,
                r.cross_rack_edges,
                if r.valid { "yes" } else { "NO" },
                r.error.as_deref().unwrap_or("")
            );
        }
    }
    if let Some(dir) = &a.out {
        let mut csv = String::from(
            "strategy,servers,makespan_ms,vs_star,cross_rack_edges,frames_per_s_peak,valid,error\n",
        );
        for r in &report.results {
            csv.push_str(&format!(
                "{},{},{:.3},{:.6},{},{:.0},{},{}\n",
                r.strategy,
                r.servers,
                r.makespan_ms,
                r.vs_star,
                r.cross_rack_edges,
                r.fabric.frames_per_s_peak,
                r.valid,
                csv_field(r.error.as_deref().unwrap_or(""))
            ));
        }
        write_outputs(dir, "mlnet", &report, &csv, |p| plot_mlnet(&report, p))?;
    }
    if report.results.iter().any(|r| r.error.is_some()) {
        return Err("some runs failed (see the error column)".into());
    }
    if report.results.iter().any(|r| !r.valid) {
        return Err(
            "some runs are NOT VALID (the fabric fell behind its clock): they have no \
                    vs_star figure"
                .into(),
        );
    }
    Ok(())
}

/// `DIR/NAME.json` (the report), `DIR/NAME.csv` and `DIR/NAME.png` (drawn by `plot`).
fn write_outputs(
    dir: &Path,
    name: &str,
    report: &impl serde::Serialize,
    csv: &str,
    plot: impl FnOnce(&Path) -> Res,
) -> Res {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_vec_pretty(report)?,
    )?;
    std::fs::write(dir.join(format!("{name}.csv")), csv)?;
    register_font()?;
    plot(&dir.join(format!("{name}.png")))?;
    eprintln!(
        "wrote {0}/{name}.json, {0}/{name}.csv and {0}/{name}.png",
        dir.display()
    );
    Ok(())
}

/// The largest finite value (0 when there is none): the top of a plot's axis.
fn largest(values: impl Iterator<Item = f64>) -> f64 {
    values.filter(|x| x.is_finite()).fold(0.0, f64::max)
}

/// Makespan against the number of servers, one line per strategy; runs that are not valid
/// drawn as hollow points.
fn plot_mlnet(r: &MlnetReport, path: &Path) -> Res {
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let max_s = r.results.iter().map(|x| x.servers).max().unwrap_or(1);
    let top = largest(r.results.iter().map(|x| x.makespan_ms)) * 1.15 + 1.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "MLNET trees ({}) on {} ({} workers, {:.1} MB model, {} iterations): makespan",
                r.transport.name(),
                r.topology,
                r.workers,
                r.model_bytes as f64 / 1e6,
                r.iterations
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.5f64..max_s as f64 + 0.5, 0f64..top)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("parameter servers")
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 {
                format!("{}", x.round())
            } else {
                String::new()
            }
        })
        .y_desc("makespan (ms)")
        .draw()
        .map_err(|x| e(&x))?;
    let mut names: Vec<&str> = Vec::new();
    for x in &r.results {
        if !names.contains(&x.strategy.as_str()) {
            names.push(&x.strategy);
        }
    }
    for (i, name) in names.iter().enumerate() {
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        let pts: Vec<(f64, f64, bool)> = r
            .results
            .iter()
            .filter(|x| x.strategy == *name && x.makespan_ms.is_finite())
            .map(|x| (x.servers as f64, x.makespan_ms, x.valid))
            .collect();
        chart
            .draw_series(std::iter::once(PathElement::new(
                pts.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(),
                color.stroke_width(3),
            )))
            .map_err(|x| e(&x))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(pts.iter().map(|p| {
                let style = if p.2 {
                    color.filled()
                } else {
                    color.stroke_width(2)
                };
                Circle::new((p.0, p.1), 6, style)
            }))
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

pub fn priority(a: &PriorityArgs) -> Res {
    need_root()?;
    let defaults = PriorityConfig::new(Path::new("."));
    let cfg = PriorityConfig {
        topology: a.topology.clone().unwrap_or(defaults.topology.clone()),
        jobs: a.jobs,
        workers: a.workers,
        model_bytes: a.model_bytes,
        iterations: a.iterations,
        repetitions: a.repetitions,
        seed: a.seed,
        modes: PriorityMode::ALL.to_vec(),
        ..defaults
    };
    let report = run_priority(&cfg)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{:<15} {:>5} {:>10} {:>10} {:>10}",
            "mode", "jobs", "median_ms", "p95_ms", "max_ms"
        );
        for s in &report.summary {
            println!(
                "{:<15} {:>5} {:>10.1} {:>10.1} {:>10.1}",
                s.mode, s.jobs, s.median_ms, s.p95_ms, s.max_ms
            );
        }
        if let Some(p) = &report.pair {
            println!(
                "two jobs on one bottleneck (medians of {} repetitions): urgent alone {:.1} ms, beside a background job {:.1} ms ({:.2}x; each: {}), background {:.1} ms{}{}",
                p.ratios.len(),
                p.alone_ms,
                p.urgent_ms,
                p.urgent_vs_alone,
                p.ratios
                    .iter()
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                p.background_ms,
                if p.valid { "" } else { " (NOT VALID)" },
                p.error.as_deref().map(|e| format!(" error: {e}")).unwrap_or_default()
            );
        }
        let invalid = report.results.iter().filter(|r| !r.valid).count();
        if invalid > 0 {
            println!("{invalid} job results come from runs that are NOT VALID (fabric behind)");
        }
    }
    if let Some(dir) = &a.out {
        let mut csv = String::from("mode,repetition,job,priority,makespan_ms,valid,error\n");
        for r in &report.results {
            csv.push_str(&format!(
                "{},{},{},{},{:.3},{},{}\n",
                r.mode,
                r.repetition,
                r.job,
                r.priority,
                r.makespan_ms,
                r.valid,
                csv_field(r.error.as_deref().unwrap_or(""))
            ));
        }
        write_outputs(dir, "priority", &report, &csv, |p| {
            plot_priority(&report, p)
        })?;
    }
    if report.results.iter().any(|r| r.error.is_some())
        || report.pair.as_ref().is_some_and(|p| p.error.is_some())
    {
        return Err("some jobs failed (see priority.json)".into());
    }
    if report.results.iter().any(|r| !r.valid) || report.pair.as_ref().is_some_and(|p| !p.valid) {
        return Err(
            "some runs are NOT VALID (the fabric fell behind its clock): the summaries \
                    leave them out (see priority.json)"
                .into(),
        );
    }
    Ok(())
}

/// The CDF of job makespans per mode.
fn plot_priority(r: &PriorityReport, path: &Path) -> Res {
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let top = largest(r.results.iter().map(|x| x.makespan_ms)) * 1.05 + 1.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{} concurrent jobs with random priorities on {}: makespan CDF",
                r.jobs, r.topology
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..top, 0f64..1.0)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("job makespan (ms)")
        .y_desc("fraction of jobs")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, s) in r.summary.iter().enumerate() {
        let mut v: Vec<f64> = r
            .results
            .iter()
            .filter(|x| x.mode == s.mode && x.makespan_ms.is_finite())
            .map(|x| x.makespan_ms)
            .collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let mut pts = vec![(0.0, 0.0)];
        for (k, x) in v.iter().enumerate() {
            pts.push((*x, k as f64 / n));
            pts.push((*x, (k + 1) as f64 / n));
        }
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        chart
            .draw_series(std::iter::once(PathElement::new(
                pts,
                color.stroke_width(3),
            )))
            .map_err(|x| e(&x))?
            .label(format!("{} (median {:.0} ms)", s.mode, s.median_ms))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
