//! `gradwire experiment incast`: see `gradwire_experiment`. Runs it, prints the table (or the
//! JSON), writes the report, the flows and the plots.

use std::error::Error;
use std::io::Write;
use std::path::Path;

use gradwire_experiment::{
    print_table, run, write_flows_csv, Bootstrap, ExperimentReport, IncastConfig, Variant,
    VariantKind, VariantResult,
};
use plotters::coord::ranged1d::SegmentValue;
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
    let defaults = IncastConfig::new(a.regime, Path::new("."));
    let variants = match &a.variants {
        None => defaults.variants.clone(),
        Some(names) => names
            .iter()
            .map(|n| Variant::parse(n))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let cfg = IncastConfig {
        topology: a.topology.clone().unwrap_or(defaults.topology.clone()),
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
        bootstrap: Bootstrap {
            resamples: a.resamples,
            seed: a.seed,
            ..Bootstrap::default()
        },
        ..defaults
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
        let mut csv = std::io::BufWriter::new(std::fs::File::create(dir.join("incast-flows.csv"))?);
        write_flows_csv(&report, &mut csv)?;
        csv.flush()?;
        register_font()?;
        plot_bars(&report, &dir.join("incast-fct.png"))?;
        plot_cdf(&report, &dir.join("incast-cdf.png"))?;
        eprintln!(
            "wrote {0}/incast.json, {0}/incast-flows.csv, {0}/incast-fct.png and {0}/incast-cdf.png",
            dir.display()
        );
    }
    if let Some(path) = &a.plot {
        register_font()?;
        plot_bars(&report, path)?;
        eprintln!("wrote {}", path.display());
    }
    let wrong: u64 = report.results.iter().map(|v| v.wrong_bytes).sum();
    if wrong > 0 {
        return Err(format!("{wrong} delivered bytes differ from what was sent").into());
    }
    Ok(())
}

/// The font the plots' text is drawn with (Debian's fonts-dejavu-core, which
/// `scripts/deps.sh` installs).
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

pub(crate) fn register_font() -> Res {
    static REGISTERED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let font = std::fs::read(FONT).map_err(|e| {
        format!("plots need the font {FONT} (apt-get install fonts-dejavu-core; scripts/deps.sh does): {e}")
    })?;
    // register_font keeps a 'static reference; it is registered once per process.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| format!("{FONT} is not a usable TrueType font"))?;
    let _ = REGISTERED.set(());
    Ok(())
}

/// The variants that produced figures, in report order.
fn plotted(r: &ExperimentReport) -> Res<Vec<&VariantResult>> {
    let runs: Vec<_> = r
        .results
        .iter()
        .filter(|v| v.skipped.is_none() && v.flows > v.failed_flows)
        .collect();
    if runs.is_empty() {
        return Err("nothing to plot: no variant completed a flow".into());
    }
    Ok(runs)
}

/// A variant's label: its name, marked when its run is not valid or lost flows.
fn label(v: &VariantResult) -> String {
    let mut s = v.variant.name.clone();
    if !v.valid {
        s.push_str(" (NOT VALID)");
    }
    if v.failed_flows > 0 {
        s.push_str(&format!(" ({} failed)", v.failed_flows));
    }
    s
}

fn title(r: &ExperimentReport) -> String {
    format!(
        "{} incast, {} regime: {} workers -> {} servers, {} Mbit/s links, {:.1} MB per worker per iteration, {} iterations",
        r.model,
        r.regime,
        r.workers,
        r.servers,
        r.link_rate_bps / 1_000_000,
        r.bytes_per_worker as f64 / 1e6,
        r.iterations
    )
}

/// Bar colour: gradwire on flows blue, on the message layer green, TCP orange, runs that are
/// not valid grey.
fn bar_color(v: &VariantResult) -> RGBColor {
    match (&v.variant.kind, v.valid) {
        (_, false) => RGBColor(170, 170, 170),
        (VariantKind::Tcp { .. }, _) => RGBColor(230, 120, 30),
        (VariantKind::Gradwire { .. }, _) => RGBColor(40, 90, 180),
        (VariantKind::Msg(_), _) => RGBColor(40, 150, 90),
    }
}

/// Three panels (p50, p99, p99.9 FCT), one horizontal bar per variant with its bootstrap CI
/// as a whisker; variant names on the vertical axis, where long names stay readable.
fn plot_bars(r: &ExperimentReport, path: &Path) -> Res {
    let runs = plotted(r)?;
    let names: Vec<String> = runs.iter().map(|v| label(v)).collect();
    let height = 160 + 34 * runs.len() as u32;
    let root = BitMapBackend::new(path, (1800, height.max(480))).into_drawing_area();
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let caption = format!(
        "{} (FCT, ms; whiskers: {:.0} % bootstrap CI)",
        title(r),
        r.bootstrap.level * 100.0
    );
    let root = root
        .titled(&caption, ("sans-serif", 20))
        .map_err(|x| e(&x))?;
    // Row of variant `i`: the first variant on top. A discrete range includes its end, so
    // 0..=last gives exactly one row per variant.
    let last = runs.len() as u32 - 1;
    let row = |i: usize| last - i as u32;
    let panels = root.split_evenly((1, 3));
    for (k, panel) in panels.iter().enumerate() {
        let pick = |v: &VariantResult| v.fct_ms.quantiles()[k].1;
        let (name, _) = runs[0].fct_ms.quantiles()[k];
        let top = runs.iter().map(|v| pick(v).hi).fold(0.0f64, f64::max) * 1.1 + 1e-9;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{name} FCT (ms)"), ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(if k == 0 { 260 } else { 20 })
            .build_cartesian_2d(0f64..top, (0u32..last).into_segmented())
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(runs.len())
            .y_label_formatter(&|y| match y {
                SegmentValue::CenterOf(y) if k == 0 && *y <= last => {
                    names.get((last - *y) as usize).cloned().unwrap_or_default()
                }
                _ => String::new(),
            })
            .y_label_style(("sans-serif", 15))
            .x_label_style(("sans-serif", 14))
            .x_desc("ms")
            .draw()
            .map_err(|x| e(&x))?;
        for (i, v) in runs.iter().enumerate() {
            let est = pick(v);
            let y = row(i);
            chart
                .draw_series(
                    Histogram::horizontal(&chart)
                        .style(bar_color(v).filled())
                        .margin(6)
                        .data([(y, est.value)]),
                )
                .map_err(|x| e(&x))?;
            let mid = || SegmentValue::CenterOf(y);
            let whisker = ShapeStyle::from(&BLACK).stroke_width(2);
            chart
                .draw_series([PathElement::new(
                    vec![(est.lo, mid()), (est.hi, mid())],
                    whisker,
                )])
                .map_err(|x| e(&x))?;
            chart
                .draw_series([est.lo, est.hi].map(|x| Circle::new((x, mid()), 3, BLACK.filled())))
                .map_err(|x| e(&x))?;
            chart
                .draw_series([Text::new(
                    format!("{:.1}", est.value),
                    (est.hi + top * 0.01, mid()),
                    ("sans-serif", 13),
                )])
                .map_err(|x| e(&x))?;
        }
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// Distinct line colours (Tableau 20, darker tones first).
pub(crate) const LINE_COLORS: [RGBColor; 20] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(174, 199, 232),
    RGBColor(255, 187, 120),
    RGBColor(152, 223, 138),
    RGBColor(255, 152, 150),
    RGBColor(197, 176, 213),
    RGBColor(196, 156, 148),
    RGBColor(247, 182, 210),
    RGBColor(199, 199, 199),
    RGBColor(219, 219, 141),
    RGBColor(158, 218, 229),
];

/// The FCT CDF of every variant on one log-x chart: gradwire thick, TCP thin, a legend with
/// every name.
fn plot_cdf(r: &ExperimentReport, path: &Path) -> Res {
    let runs = plotted(r)?;
    let curves: Vec<Vec<f64>> = runs
        .iter()
        .map(|v| {
            let mut f: Vec<f64> = v
                .records
                .iter()
                .filter(|x| x.completed())
                .map(|x| (x.fct_us / 1e3).max(1e-3))
                .collect();
            f.sort_by(f64::total_cmp);
            f
        })
        .collect();
    let lo = curves
        .iter()
        .filter_map(|c| c.first())
        .fold(f64::INFINITY, |a, &b| a.min(b));
    let hi = curves
        .iter()
        .filter_map(|c| c.last())
        .fold(0.0f64, |a, &b| a.max(b));
    let (lo, hi) = (lo.max(1e-3) * 0.8, hi.max(lo * 2.0) * 1.25);
    let root = BitMapBackend::new(path, (1400, 900)).into_drawing_area();
    let e = |err: &dyn std::fmt::Display| format!("plot {}: {err}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title(r), ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("flow completion time (ms, log scale)")
        .y_desc("fraction of flows")
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, (v, c)) in runs.iter().zip(&curves).enumerate() {
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        let width = match v.variant.kind {
            VariantKind::Gradwire { .. } | VariantKind::Msg(_) => 3,
            VariantKind::Tcp { .. } => 2,
        };
        let n = c.len().max(1) as f64;
        // A step curve: at each FCT the fraction of flows done jumps.
        let mut pts = Vec::with_capacity(2 * c.len());
        for (k, &x) in c.iter().enumerate() {
            pts.push((x, k as f64 / n));
            pts.push((x, (k + 1) as f64 / n));
        }
        let style = color.stroke_width(width);
        chart
            .draw_series([PathElement::new(pts, style)])
            .map_err(|x| e(&x))?
            .label(label(v))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
