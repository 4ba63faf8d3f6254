//! `gradwire experiment incast`: see `gradwire_experiment`.

use std::error::Error;
use std::io::Write;

use gradwire_experiment::{print_table, run, ExperimentReport, IncastConfig, Variant, VariantKind};
use plotters::prelude::*;

use crate::args::IncastArgs;

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

pub fn incast(a: &IncastArgs) -> Res {
    if !gradwire_netns::is_root() {
        return Err("gradwire experiment needs root (network namespaces, XDP, AF_XDP)".into());
    }
    if !(a.scale > 0.0 && a.scale <= 1.0) {
        return Err(format!("--scale {} must be within (0, 1]", a.scale).into());
    }
    let variants = match &a.variants {
        None => Variant::defaults(),
        Some(names) => names
            .iter()
            .map(|n| Variant::parse(n))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let cfg = IncastConfig {
        topology: a.topology.clone(),
        model: a.model.clone(),
        scale: a.scale,
        split_bytes: a
            .split_bytes
            .unwrap_or(((4u64 << 20) as f64 * a.scale) as u64),
        iterations: a.iterations,
        variants,
        seed: a.seed,
        spray_ports: a.spray_ports,
        period_ns: a.period_us * 1000,
    };
    let report = run(&cfg)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("incast.json"), serde_json::to_vec_pretty(&report)?)?;
        let mut csv = std::fs::File::create(dir.join("incast-flows.csv"))?;
        writeln!(csv, "variant,iteration,phase,src,dst,tensor,layer,bytes,fct_us,delivered_fraction,wrong_bytes")?;
        for v in &report.results {
            for r in &v.records {
                writeln!(
                    csv,
                    "{},{},{},{},{},{},{},{},{:.1},{:.6},{}",
                    v.variant.name,
                    r.iteration,
                    if r.push { "push" } else { "pull" },
                    r.src,
                    r.dst,
                    r.tensor,
                    r.layer,
                    r.bytes,
                    r.fct_us,
                    r.delivered_fraction,
                    r.wrong_bytes
                )?;
            }
        }
        eprintln!("wrote {}/incast.json and incast-flows.csv", dir.display());
    }
    if let Some(path) = &a.plot {
        plot(&report, path)?;
        eprintln!("wrote {}", path.display());
    }
    let wrong: u64 = report.results.iter().map(|v| v.wrong_bytes).sum();
    if wrong > 0 {
        return Err(format!("{wrong} delivered bytes differ from what was sent").into());
    }
    Ok(())
}

/// The font the plot's text is drawn with (Debian's fonts-dejavu-core, which
/// `scripts/deps.sh` installs).
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Two bar charts side by side, mean and p99 FCT per variant; gradwire blue, TCP orange,
/// runs in which the fabric fell behind hatched grey (not valid).
fn plot(r: &ExperimentReport, path: &std::path::Path) -> Res {
    let font = std::fs::read(FONT).map_err(|e| {
        format!("--plot needs the font {FONT} (apt-get install fonts-dejavu-core; scripts/deps.sh does): {e}")
    })?;
    // register_font keeps a 'static reference; the plot is drawn once per process.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| format!("{FONT} is not a usable TrueType font"))?;
    let runs: Vec<_> = r.results.iter().filter(|v| v.skipped.is_none()).collect();
    if runs.is_empty() {
        return Err("nothing to plot: every variant was skipped".into());
    }
    let names: Vec<String> = runs.iter().map(|v| v.variant.name.clone()).collect();
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let title = format!(
        "{} incast: {} workers -> {} servers, {} Mbit/s links, {:.1} MB per worker per iteration, {} iterations",
        r.model,
        r.workers,
        r.servers,
        r.link_rate_bps / 1_000_000,
        r.bytes_per_worker as f64 / 1e6,
        r.iterations
    );
    let root = root.titled(&title, ("sans-serif", 22)).map_err(|x| e(&x))?;
    let panels = root.split_evenly((1, 2));
    let n = runs.len() as u32;
    for (panel, (label, pick)) in panels
        .iter()
        .zip([("mean FCT (ms)", 0usize), ("p99 FCT (ms)", 1usize)])
    {
        let value = |i: usize| {
            let v = runs[i];
            if pick == 0 {
                v.fct_avg_ms
            } else {
                v.fct_p99_ms
            }
        };
        let top = (0..runs.len()).map(value).fold(0.0f64, f64::max) * 1.15 + 1e-9;
        let mut chart = ChartBuilder::on(panel)
            .caption(label, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(60)
            .y_label_area_size(60)
            .build_cartesian_2d((0u32..n).into_segmented(), 0f64..top)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(runs.len())
            .x_label_formatter(&|x| match x {
                SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .x_label_style(("sans-serif", 14))
            .y_desc("ms")
            .draw()
            .map_err(|x| e(&x))?;
        for (i, v) in runs.iter().enumerate() {
            let color = match (&v.variant.kind, v.fabric_behind) {
                (_, true) => RGBColor(170, 170, 170),
                (VariantKind::Tcp { .. }, _) => RGBColor(230, 120, 30),
                (VariantKind::Gradwire { .. }, _) => RGBColor(40, 90, 180),
            };
            chart
                .draw_series(
                    Histogram::vertical(&chart)
                        .style(color.filled())
                        .margin(14)
                        .data([(i as u32, value(i))]),
                )
                .map_err(|x| e(&x))?;
        }
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
