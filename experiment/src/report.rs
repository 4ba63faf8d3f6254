//! Summaries: FCT, iteration time, delivered fraction, what the switches did.

use std::time::Duration;

use gradwire_fabric::run::FabricStats;
use serde::Serialize;

use crate::flows::Variant;

/// One tensor transfer.
#[derive(Debug, Clone, Serialize)]
pub struct FlowRecord {
    /// Iteration.
    pub iteration: u32,
    /// Push (worker -> server) or pull.
    pub push: bool,
    /// Sending host index.
    pub src: usize,
    /// Receiving host index.
    pub dst: usize,
    /// Tensor id.
    pub tensor: u32,
    /// Layer (0 = front).
    pub layer: u32,
    /// Tensor bytes.
    pub bytes: u64,
    /// Flow completion time, microseconds (sender: start of send to the receiver's
    /// confirmation).
    pub fct_us: f64,
    /// Fraction of segments delivered (TCP: 1).
    pub delivered_fraction: f64,
    /// Delivered bytes that differ from what was sent (must be 0).
    pub wrong_bytes: u64,
}

/// The figures of one variant.
#[derive(Debug, Clone, Serialize)]
pub struct VariantResult {
    /// The variant.
    pub variant: Variant,
    /// Why it did not run, if it did not.
    pub skipped: Option<String>,
    /// Tensor transfers.
    pub flows: usize,
    /// Mean FCT, ms.
    pub fct_avg_ms: f64,
    /// 99th percentile FCT, ms.
    pub fct_p99_ms: f64,
    /// Mean FCT of the front third of the layers, ms (what the next forward pass waits for).
    pub fct_front_avg_ms: f64,
    /// Mean iteration time (push + pull phases), ms.
    pub iteration_avg_ms: f64,
    /// Every iteration, ms.
    pub iterations_ms: Vec<f64>,
    /// Lowest delivered fraction of any tensor.
    pub delivered_min: f64,
    /// Mean delivered fraction.
    pub delivered_avg: f64,
    /// Delivered bytes that were wrong (must be 0).
    pub wrong_bytes: u64,
    /// CE marks by all switches.
    pub switch_marked: u64,
    /// Threshold drops (not-ECT above a queue's threshold) by all switches.
    pub switch_dropped_threshold: u64,
    /// Shared-buffer drops by all switches.
    pub switch_dropped_buffer: u64,
    /// The fabric fell behind its clock: the run is not valid.
    pub fabric_behind: bool,
    /// Fabric departure lag p99, microseconds.
    pub fabric_lag_p99_us: f64,
    /// Late departures / departures.
    pub fabric_late: (u64, u64),
    /// Every flow, for further analysis.
    #[serde(skip)]
    pub records: Vec<FlowRecord>,
}

impl VariantResult {
    /// A variant that could not run here.
    pub fn skipped(v: &Variant, why: String) -> VariantResult {
        VariantResult {
            variant: v.clone(),
            skipped: Some(why),
            flows: 0,
            fct_avg_ms: 0.0,
            fct_p99_ms: 0.0,
            fct_front_avg_ms: 0.0,
            iteration_avg_ms: 0.0,
            iterations_ms: Vec::new(),
            delivered_min: 0.0,
            delivered_avg: 0.0,
            wrong_bytes: 0,
            switch_marked: 0,
            switch_dropped_threshold: 0,
            switch_dropped_buffer: 0,
            fabric_behind: false,
            fabric_lag_p99_us: 0.0,
            fabric_late: (0, 0),
            records: Vec::new(),
        }
    }
}

/// The whole experiment.
#[derive(Debug, Clone, Serialize)]
pub struct ExperimentReport {
    /// Topology file.
    pub topology: String,
    /// Model.
    pub model: String,
    /// Tensor size scale.
    pub scale: f64,
    /// Iterations per variant.
    pub iterations: u32,
    /// Workers.
    pub workers: usize,
    /// Servers.
    pub servers: usize,
    /// Bytes each worker pushes per iteration.
    pub bytes_per_worker: u64,
    /// Tensors each worker pushes per iteration.
    pub tensors_per_worker: usize,
    /// Host link rate.
    pub link_rate_bps: u64,
    /// Per variant.
    pub results: Vec<VariantResult>,
}

/// The `q` quantile (0 <= q <= 1) of `v`, which is sorted, by nearest rank: the smallest
/// value with at least a fraction `q` of the values at or below it (so always one of the
/// values, never interpolated); 0 for no values. The one percentile helper of the
/// workspace: the `gradwire` CLI's FCT percentiles use it too.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

pub(crate) fn summarize(
    v: &Variant,
    records: Vec<FlowRecord>,
    iterations: Vec<Duration>,
    st: &FabricStats,
) -> VariantResult {
    let mut f: Vec<f64> = records.iter().map(|r| r.fct_us / 1e3).collect();
    f.sort_by(f64::total_cmp);
    let n = f.len().max(1) as f64;
    let layers = records.iter().map(|r| r.layer).max().unwrap_or(0) + 1;
    let front: Vec<f64> = records
        .iter()
        .filter(|r| r.layer * 3 < layers)
        .map(|r| r.fct_us / 1e3)
        .collect();
    let mut marked = 0;
    let mut thr = 0;
    let mut buf = 0;
    for p in st.switches.iter().flat_map(|s| &s.ports) {
        let q = p.egress.sum();
        marked += q.marked;
        thr += q.dropped_threshold;
        buf += q.dropped_buffer;
    }
    let its: Vec<f64> = iterations.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    VariantResult {
        variant: v.clone(),
        skipped: None,
        flows: records.len(),
        fct_avg_ms: f.iter().sum::<f64>() / n,
        fct_p99_ms: quantile(&f, 0.99),
        fct_front_avg_ms: front.iter().sum::<f64>() / front.len().max(1) as f64,
        iteration_avg_ms: its.iter().sum::<f64>() / its.len().max(1) as f64,
        iterations_ms: its,
        delivered_min: records
            .iter()
            .map(|r| r.delivered_fraction)
            .fold(1.0, f64::min),
        delivered_avg: records.iter().map(|r| r.delivered_fraction).sum::<f64>() / n,
        wrong_bytes: records.iter().map(|r| r.wrong_bytes).sum(),
        switch_marked: marked,
        switch_dropped_threshold: thr,
        switch_dropped_buffer: buf,
        fabric_behind: st.lag.behind,
        fabric_lag_p99_us: st.lag.p99_ns as f64 / 1e3,
        fabric_late: (st.lag.late, st.lag.departures),
        records,
    }
}

/// Prints the comparison table.
pub fn print_table(r: &ExperimentReport) {
    println!(
        "{} on {}: {} workers, {} servers, {} tensors / {:.1} MB per worker per iteration (scale {}), links {} Mbit/s, {} iterations",
        r.model,
        r.topology,
        r.workers,
        r.servers,
        r.tensors_per_worker,
        r.bytes_per_worker as f64 / 1e6,
        r.scale,
        r.link_rate_bps / 1_000_000,
        r.iterations
    );
    println!(
        "{:<15} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7}",
        "variant",
        "fct avg",
        "fct p99",
        "front avg",
        "iteration",
        "deliv min",
        "deliv avg",
        "marked",
        "drop thr",
        "drop buf",
        "valid"
    );
    for v in &r.results {
        if let Some(why) = &v.skipped {
            println!("{:<15} skipped: {why}", v.variant.name);
            continue;
        }
        println!(
            "{:<15} {:>7.1}ms {:>7.1}ms {:>8.1}ms {:>8.0}ms {:>9.4} {:>9.4} {:>8} {:>8} {:>8} {:>7}",
            v.variant.name,
            v.fct_avg_ms,
            v.fct_p99_ms,
            v.fct_front_avg_ms,
            v.iteration_avg_ms,
            v.delivered_min,
            v.delivered_avg,
            v.switch_marked,
            v.switch_dropped_threshold,
            v.switch_dropped_buffer,
            if v.fabric_behind { "BEHIND" } else { "yes" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantile() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
        assert_eq!(quantile(&[], 0.99), 0.0);
    }
}
