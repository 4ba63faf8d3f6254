//! Summaries: FCT quantiles with bootstrap confidence intervals, FCT by size bucket, iteration
//! time, drops per data packet, delivered fraction, failed flows, what the switches did, and
//! the ratios of each gradwire variant to the best TCP baseline of the same run.
//!
//! One quantile definition ([`quantile`], nearest rank) serves every figure here and the
//! bootstrap ([`bootstrap`]) resamples with it, so a CI brackets the same statistic the table
//! shows.

use std::io::{self, Write};
use std::time::Duration;

use gradwire_fabric::run::FabricStats;
use serde::Serialize;

use crate::flows::{Variant, VariantKind};

/// One tensor transfer (completed or failed).
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
    /// confirmation). For a failed flow: the time until its sender gave up (0 if it never
    /// started).
    pub fct_us: f64,
    /// Fraction of segments delivered (TCP: 1; a failed flow: what the receiver reported, 0
    /// if it reported nothing).
    pub delivered_fraction: f64,
    /// Delivered bytes that differ from what was sent (must be 0).
    pub wrong_bytes: u64,
    /// Data packets the sender sent for this tensor, retransmissions included (gradwire: its
    /// datagram socket's transmit counter; TCP: `TCP_INFO` `tcpi_data_segs_out`).
    pub data_packets: u64,
    /// Why the flow failed (error of the sender or receiver, a timeout, or an earlier failure
    /// on the same connection); `None`: completed.
    pub error: Option<String>,
}

impl FlowRecord {
    /// Phase name, as in the CSV.
    pub fn phase(&self) -> &'static str {
        if self.push {
            "push"
        } else {
            "pull"
        }
    }

    /// The flow completed (sender confirmed, receiver delivered).
    pub fn completed(&self) -> bool {
        self.error.is_none()
    }
}

/// A failed flow as listed in the JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct FlowFailure {
    /// Iteration.
    pub iteration: u32,
    /// `push` or `pull`.
    pub phase: &'static str,
    /// Sending host index.
    pub src: usize,
    /// Receiving host index.
    pub dst: usize,
    /// Tensor id.
    pub tensor: u32,
    /// Why.
    pub error: String,
}

/// A statistic and its bootstrap confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    /// The statistic of the sample.
    pub value: f64,
    /// Lower end of the confidence interval.
    pub lo: f64,
    /// Upper end of the confidence interval.
    pub hi: f64,
}

impl Estimate {
    /// A value without an interval (lo = hi = value).
    pub fn exact(value: f64) -> Estimate {
        Estimate {
            value,
            lo: value,
            hi: value,
        }
    }
}

/// What [`bootstrap`] estimates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Statistic {
    /// The `q` quantile by nearest rank ([`quantile`]).
    Quantile(f64),
    /// The arithmetic mean.
    Mean,
}

/// Settings of the percentile bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Bootstrap {
    /// Resamples (with replacement, of the sample's size).
    pub resamples: u32,
    /// Confidence level (0.95: the 2.5 % and 97.5 % quantiles of the resampled statistic).
    pub level: f64,
    /// Seed of the resampling.
    pub seed: u64,
}

impl Default for Bootstrap {
    fn default() -> Self {
        Bootstrap {
            resamples: 1000,
            level: 0.95,
            seed: 1,
        }
    }
}

/// Index (0-based) of the nearest-rank `q` quantile in a sorted slice of `n > 0` values.
fn rank_index(n: usize, q: f64) -> usize {
    ((q * n as f64).ceil() as usize).clamp(1, n) - 1
}

/// The `q` quantile (0 <= q <= 1) of `v`, which is sorted, by nearest rank: the smallest
/// value with at least a fraction `q` of the values at or below it (so always one of the
/// values, never interpolated); 0 for no values. The one percentile helper of the
/// workspace: the `gradwire` CLI's FCT percentiles use it too.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[rank_index(v.len(), q)]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// `s` of `v` (any order; quantiles reorder `v` in place, in linear time).
fn evaluate(v: &mut [f64], s: Statistic) -> f64 {
    match s {
        Statistic::Mean => mean(v),
        Statistic::Quantile(_) if v.is_empty() => 0.0,
        Statistic::Quantile(q) => {
            let i = rank_index(v.len(), q);
            *v.select_nth_unstable_by(i, f64::total_cmp).1
        }
    }
}

/// Percentile bootstrap: each statistic of `sample` with its confidence interval, from
/// `b.resamples` resamples drawn with replacement (seeded: the same sample gives the same
/// intervals). The interval is the `(1 - level) / 2` and `(1 + level) / 2` quantiles of the
/// resampled statistic. Fewer than two values: the interval is the value itself.
pub fn bootstrap(sample: &[f64], stats: &[Statistic], b: &Bootstrap) -> Vec<Estimate> {
    let mut work = sample.to_vec();
    let points: Vec<f64> = stats.iter().map(|&s| evaluate(&mut work, s)).collect();
    let n = sample.len();
    if n < 2 || b.resamples == 0 {
        return points.into_iter().map(Estimate::exact).collect();
    }
    let mut rng = fastrand::Rng::with_seed(b.seed);
    let mut draws = vec![Vec::with_capacity(b.resamples as usize); stats.len()];
    for _ in 0..b.resamples {
        for x in work.iter_mut() {
            *x = sample[rng.usize(..n)];
        }
        for (d, &s) in draws.iter_mut().zip(stats) {
            d.push(evaluate(&mut work, s));
        }
    }
    let tail = ((1.0 - b.level) / 2.0).clamp(0.0, 0.5);
    points
        .into_iter()
        .zip(draws)
        .map(|(value, mut d)| {
            d.sort_by(f64::total_cmp);
            Estimate {
                value,
                lo: quantile(&d, tail),
                hi: quantile(&d, 1.0 - tail),
            }
        })
        .collect()
}

/// Tensor size classes of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SizeBucket {
    /// Below 20 KB (20 000 bytes).
    #[serde(rename = "<20KB")]
    Small,
    /// 20 KB up to 100 KB (excluded).
    #[serde(rename = "20-100KB")]
    Medium,
    /// 100 KB (100 000 bytes) and more.
    #[serde(rename = ">=100KB")]
    Large,
}

impl SizeBucket {
    /// Every bucket, small first.
    pub const ALL: [SizeBucket; 3] = [SizeBucket::Small, SizeBucket::Medium, SizeBucket::Large];

    /// The bucket of a tensor of `bytes`.
    pub fn of(bytes: u64) -> SizeBucket {
        match bytes {
            0..20_000 => SizeBucket::Small,
            20_000..100_000 => SizeBucket::Medium,
            _ => SizeBucket::Large,
        }
    }

    /// Label in tables and JSON.
    pub fn label(self) -> &'static str {
        match self {
            SizeBucket::Small => "<20KB",
            SizeBucket::Medium => "20-100KB",
            SizeBucket::Large => ">=100KB",
        }
    }
}

/// FCT of the completed flows of one size bucket and phase.
#[derive(Debug, Clone, Serialize)]
pub struct BucketStats {
    /// Size bucket.
    pub bucket: SizeBucket,
    /// `push`, `pull` or `all`.
    pub phase: &'static str,
    /// Completed flows.
    pub flows: usize,
    /// Mean FCT, ms.
    pub mean_ms: f64,
    /// p99 FCT, ms.
    pub p99_ms: f64,
}

/// The FCT statistics with confidence intervals, ms, over completed flows.
#[derive(Debug, Clone, Serialize)]
pub struct FctSummary {
    /// Median.
    pub p50: Estimate,
    /// 99th percentile.
    pub p99: Estimate,
    /// 99.9th percentile.
    pub p999: Estimate,
    /// Mean.
    pub mean: Estimate,
}

impl FctSummary {
    fn of(fct_ms: &[f64], b: &Bootstrap) -> FctSummary {
        let s = [
            Statistic::Quantile(0.5),
            Statistic::Quantile(0.99),
            Statistic::Quantile(0.999),
            Statistic::Mean,
        ];
        let e = bootstrap(fct_ms, &s, b);
        FctSummary {
            p50: e[0],
            p99: e[1],
            p999: e[2],
            mean: e[3],
        }
    }

    fn empty() -> FctSummary {
        let z = Estimate::exact(0.0);
        FctSummary {
            p50: z,
            p99: z,
            p999: z,
            mean: z,
        }
    }
}

/// TCP settings a variant ran with (as read back from the namespaces after setting them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TcpSettings {
    /// The kernel congestion control the sockets used (`cubic`, `bbr`, `gw_dctcp`, ...).
    pub congestion: String,
    /// `net.ipv4.tcp_ecn` in every host namespace during the run.
    pub tcp_ecn: u8,
    /// `rto_min` on the hosts' routes during the run, ms (`None`: the kernel's 200 ms).
    pub rto_min_ms: Option<u32>,
}

/// How data packets are counted for the drops-per-data-packet figure.
pub const DATA_PACKETS_SOURCE: &str = "gradwire: datagrams the sender's data socket transmitted \
     (all passes); TCP: TCP_INFO tcpi_data_segs_out of the sender's socket (data segments \
     including retransmissions, no pure ACKs); summed over every flow of the variant's run";

/// The figures of one variant.
#[derive(Debug, Clone, Serialize)]
pub struct VariantResult {
    /// The variant.
    pub variant: Variant,
    /// Why it did not run, if it did not (what this machine lacks).
    pub skipped: Option<String>,
    /// Why its setup or teardown failed, if it did (flows that ran before are kept).
    pub error: Option<String>,
    /// TCP settings (TCP variants).
    pub tcp: Option<TcpSettings>,
    /// Tensor transfers attempted (completed + failed).
    pub flows: usize,
    /// Flows that failed.
    pub failed_flows: usize,
    /// The first failures (at most [`MAX_LISTED_FAILURES`]; the CSV has them all).
    pub failures: Vec<FlowFailure>,
    /// FCT p50, p99, p99.9 and mean with bootstrap CIs, ms (completed flows).
    pub fct_ms: FctSummary,
    /// Mean FCT, ms (= `fct_ms.mean.value`).
    pub fct_avg_ms: f64,
    /// 99th percentile FCT, ms (= `fct_ms.p99.value`).
    pub fct_p99_ms: f64,
    /// Mean FCT of the front third of the layers, ms (what the next forward pass waits for).
    pub fct_front_avg_ms: f64,
    /// FCT per size bucket, for push, pull and both.
    pub buckets: Vec<BucketStats>,
    /// Mean iteration time (push + pull phases) with bootstrap CI, ms.
    pub iteration_ms: Estimate,
    /// Mean iteration time, ms (= `iteration_ms.value`).
    pub iteration_avg_ms: f64,
    /// Every iteration, ms.
    pub iterations_ms: Vec<f64>,
    /// Lowest delivered fraction of any completed tensor.
    pub delivered_min: f64,
    /// Mean delivered fraction of the completed tensors.
    pub delivered_avg: f64,
    /// Delivered bytes that were wrong (must be 0).
    pub wrong_bytes: u64,
    /// Data packets the senders sent (see [`DATA_PACKETS_SOURCE`]).
    pub data_packets: u64,
    /// (Threshold + buffer drops of all switches) / data packets sent.
    pub drops_per_data_packet: f64,
    /// CE marks by all switches.
    pub switch_marked: u64,
    /// Threshold drops (not-ECT above a queue's threshold) by all switches.
    pub switch_dropped_threshold: u64,
    /// Shared-buffer drops by all switches.
    pub switch_dropped_buffer: u64,
    /// The fabric kept its clock and published its figures: the run counts as a result.
    pub valid: bool,
    /// The fabric fell behind its clock: the run is not valid.
    pub fabric_behind: bool,
    /// Fabric departure lag p99, microseconds.
    pub fabric_lag_p99_us: f64,
    /// Late departures / departures.
    pub fabric_late: (u64, u64),
    /// Every flow, for further analysis (written to the CSV).
    #[serde(skip)]
    pub records: Vec<FlowRecord>,
}

/// At most this many failures are listed per variant in the JSON.
pub const MAX_LISTED_FAILURES: usize = 50;

impl VariantResult {
    /// A variant that could not run here.
    pub fn skipped(v: &Variant, why: String) -> VariantResult {
        VariantResult {
            skipped: Some(why),
            ..Self::empty(v)
        }
    }

    /// A variant whose setup failed before any flow ran.
    pub fn failed(v: &Variant, why: String) -> VariantResult {
        VariantResult {
            error: Some(why),
            ..Self::empty(v)
        }
    }

    fn empty(v: &Variant) -> VariantResult {
        VariantResult {
            variant: v.clone(),
            skipped: None,
            error: None,
            tcp: None,
            flows: 0,
            failed_flows: 0,
            failures: Vec::new(),
            fct_ms: FctSummary::empty(),
            fct_avg_ms: 0.0,
            fct_p99_ms: 0.0,
            fct_front_avg_ms: 0.0,
            buckets: Vec::new(),
            iteration_ms: Estimate::exact(0.0),
            iteration_avg_ms: 0.0,
            iterations_ms: Vec::new(),
            delivered_min: 0.0,
            delivered_avg: 0.0,
            wrong_bytes: 0,
            data_packets: 0,
            drops_per_data_packet: 0.0,
            switch_marked: 0,
            switch_dropped_threshold: 0,
            switch_dropped_buffer: 0,
            valid: false,
            fabric_behind: false,
            fabric_lag_p99_us: 0.0,
            fabric_late: (0, 0),
            records: Vec::new(),
        }
    }

    /// Usable as a headline result: it ran, kept the fabric's clock, and every flow is
    /// accounted for: completed, none failed, no wrong byte.
    pub fn is_headline(&self) -> bool {
        self.exclusion(None).is_none()
    }

    /// Why this variant cannot be a headline result (`None`: it can). `expected_flows`: the
    /// flows the workload has (every one must have a completed record).
    pub fn exclusion(&self, expected_flows: Option<usize>) -> Option<String> {
        if let Some(why) = &self.skipped {
            return Some(format!("skipped: {why}"));
        }
        if let Some(e) = &self.error {
            return Some(format!("failed: {e}"));
        }
        if !self.valid {
            return Some(format!(
                "the fabric fell behind its clock ({} of {} departures late)",
                self.fabric_late.0, self.fabric_late.1
            ));
        }
        if self.flows == 0 {
            return Some("no flow ran".into());
        }
        if self.failed_flows > 0 {
            return Some(format!(
                "{} of {} flows failed",
                self.failed_flows, self.flows
            ));
        }
        if let Some(n) = expected_flows.filter(|&n| n != self.flows) {
            return Some(format!(
                "{} flows recorded, the workload has {n}",
                self.flows
            ));
        }
        if self.wrong_bytes > 0 {
            return Some(format!("{} delivered bytes were wrong", self.wrong_bytes));
        }
        None
    }

    /// p99 FCT (ms) of the completed pushes of tensors of at least 100 KB.
    pub fn push_large_p99_ms(&self) -> Option<f64> {
        self.buckets
            .iter()
            .find(|b| b.bucket == SizeBucket::Large && b.phase == "push" && b.flows > 0)
            .map(|b| b.p99_ms)
    }
}

/// One gradwire variant against a TCP baseline of the same run: gradwire / baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// The gradwire variant.
    pub variant: String,
    /// The TCP baseline.
    pub baseline: String,
    /// p99 FCT of pushes of tensors >= 100 KB (target in the current regime: <= 0.5).
    pub p99_push_large: Option<f64>,
    /// Overall p99 FCT (current regime: <= 0.8; paper regime against DCTCP: <= 0.5).
    pub p99: Option<f64>,
    /// Mean FCT (paper regime against DCTCP: < 1).
    pub mean_fct: Option<f64>,
    /// Mean iteration time (current regime: <= 1.0).
    pub mean_iteration: Option<f64>,
    /// The gradwire variant's switch drops per data packet (current regime: < 0.05).
    pub drops_per_data_packet: f64,
    /// The baseline's.
    pub baseline_drops_per_data_packet: f64,
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite() && b.is_finite()).then(|| a / b)
}

impl Ratio {
    fn of(g: &VariantResult, t: &VariantResult) -> Ratio {
        Ratio {
            variant: g.variant.name.clone(),
            baseline: t.variant.name.clone(),
            p99_push_large: g
                .push_large_p99_ms()
                .zip(t.push_large_p99_ms())
                .and_then(|(a, b)| ratio(a, b)),
            p99: ratio(g.fct_p99_ms, t.fct_p99_ms),
            mean_fct: ratio(g.fct_avg_ms, t.fct_avg_ms),
            mean_iteration: ratio(g.iteration_avg_ms, t.iteration_avg_ms),
            drops_per_data_packet: g.drops_per_data_packet,
            baseline_drops_per_data_packet: t.drops_per_data_packet,
        }
    }
}

/// The ratios of every usable gradwire variant to the TCP baseline `pick` chooses among the
/// usable TCP variants (none usable: no ratios).
fn ratios_against(
    results: &[VariantResult],
    usable: &dyn Fn(&VariantResult) -> bool,
    pick: impl Fn(&[&VariantResult]) -> Option<usize>,
) -> Vec<Ratio> {
    let tcp: Vec<&VariantResult> = results
        .iter()
        .filter(|v| usable(v) && matches!(v.variant.kind, VariantKind::Tcp { .. }))
        .collect();
    let Some(base) = pick(&tcp).map(|i| tcp[i]) else {
        return Vec::new();
    };
    results
        .iter()
        .filter(|v| {
            usable(v)
                && matches!(
                    v.variant.kind,
                    VariantKind::Gradwire { .. } | VariantKind::Msg(_)
                )
        })
        .map(|g| Ratio::of(g, base))
        .collect()
}

/// Each usable gradwire variant against the best usable TCP baseline (lowest overall p99).
pub fn ratios_to_best_tcp(results: &[VariantResult], expected_flows: Option<usize>) -> Vec<Ratio> {
    let usable = |v: &VariantResult| v.exclusion(expected_flows).is_none();
    ratios_against(results, &usable, |tcp| {
        (0..tcp.len()).min_by(|&a, &b| tcp[a].fct_p99_ms.total_cmp(&tcp[b].fct_p99_ms))
    })
}

/// Each usable gradwire variant against the TCP variant named `name` (e.g. `tcp-dctcp`), if
/// it ran and is usable.
pub fn ratios_to(
    results: &[VariantResult],
    name: &str,
    expected_flows: Option<usize>,
) -> Vec<Ratio> {
    let usable = |v: &VariantResult| v.exclusion(expected_flows).is_none();
    ratios_against(results, &usable, |tcp| {
        tcp.iter().position(|v| v.variant.name == name)
    })
}

/// The whole experiment.
#[derive(Debug, Clone, Serialize)]
pub struct ExperimentReport {
    /// Regime (`current` or `paper`).
    pub regime: String,
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
    /// `rto_min` of TCP variants that do not name one, ms (`None`: the kernel's 200 ms).
    pub tcp_rto_min_ms: Option<u32>,
    /// Bootstrap of the confidence intervals.
    pub bootstrap: Bootstrap,
    /// How data packets are counted.
    pub data_packets_source: &'static str,
    /// Per variant.
    pub results: Vec<VariantResult>,
    /// Every valid gradwire variant against the best valid TCP baseline (lowest p99). Runs
    /// that are not valid, skipped, or failed entirely take no part.
    pub ratios: Vec<Ratio>,
    /// Every valid gradwire variant against `tcp-dctcp` (the paper regime's target), if it ran.
    pub ratios_vs_dctcp: Vec<Ratio>,
    /// The variants no ratio uses, and why (a headline needs a valid run with every flow of
    /// the workload completed and right).
    pub excluded: Vec<Excluded>,
}

/// A variant left out of the ratios.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Excluded {
    /// The variant.
    pub variant: String,
    /// Why.
    pub reason: String,
}

impl ExperimentReport {
    /// Fills [`ExperimentReport::ratios`] and [`ExperimentReport::ratios_vs_dctcp`] from the
    /// results.
    pub fn compute_ratios(&mut self) {
        let expected = self.expected_flows();
        self.ratios = ratios_to_best_tcp(&self.results, Some(expected));
        self.ratios_vs_dctcp = ratios_to(&self.results, "tcp-dctcp", Some(expected));
        self.excluded = self
            .results
            .iter()
            .filter_map(|v| {
                v.exclusion(Some(expected)).map(|reason| Excluded {
                    variant: v.variant.name.clone(),
                    reason,
                })
            })
            .collect();
    }

    /// Flows of the workload per variant: every worker's tensors, pushed and pulled, every
    /// iteration.
    pub fn expected_flows(&self) -> usize {
        self.iterations as usize * self.workers * self.tensors_per_worker * 2
    }
}

fn bucket_stats(records: &[&FlowRecord]) -> Vec<BucketStats> {
    let mut out = Vec::new();
    for bucket in SizeBucket::ALL {
        for phase in ["push", "pull", "all"] {
            let mut f: Vec<f64> = records
                .iter()
                .filter(|r| SizeBucket::of(r.bytes) == bucket)
                .filter(|r| phase == "all" || r.phase() == phase)
                .map(|r| r.fct_us / 1e3)
                .collect();
            f.sort_by(f64::total_cmp);
            out.push(BucketStats {
                bucket,
                phase,
                flows: f.len(),
                mean_ms: mean(&f),
                p99_ms: quantile(&f, 0.99),
            });
        }
    }
    out
}

/// The figures of one variant's run. `stats`: the fabric's final figures (`None`: it published
/// none, and the run is not valid).
pub(crate) fn summarize(
    v: &Variant,
    records: Vec<FlowRecord>,
    iterations: Vec<Duration>,
    stats: Option<&FabricStats>,
    b: &Bootstrap,
) -> VariantResult {
    let done: Vec<&FlowRecord> = records.iter().filter(|r| r.completed()).collect();
    let fct: Vec<f64> = done.iter().map(|r| r.fct_us / 1e3).collect();
    let fct_ms = FctSummary::of(&fct, b);
    let layers = records.iter().map(|r| r.layer).max().unwrap_or(0) + 1;
    let front: Vec<f64> = done
        .iter()
        .filter(|r| r.layer * 3 < layers)
        .map(|r| r.fct_us / 1e3)
        .collect();
    let (mut marked, mut thr, mut buf) = (0, 0, 0);
    for p in stats
        .iter()
        .flat_map(|s| &s.switches)
        .flat_map(|s| &s.ports)
    {
        let q = p.egress.sum();
        marked += q.marked;
        thr += q.dropped_threshold;
        buf += q.dropped_buffer;
    }
    let its: Vec<f64> = iterations.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let iteration_ms = bootstrap(&its, &[Statistic::Mean], b)[0];
    let data_packets: u64 = records.iter().map(|r| r.data_packets).sum();
    let failures: Vec<FlowFailure> = records
        .iter()
        .filter_map(|r| {
            r.error.as_ref().map(|e| FlowFailure {
                iteration: r.iteration,
                phase: r.phase(),
                src: r.src,
                dst: r.dst,
                tensor: r.tensor,
                error: e.clone(),
            })
        })
        .collect();
    let behind = stats.is_none_or(|s| s.lag.behind);
    VariantResult {
        variant: v.clone(),
        skipped: None,
        error: stats
            .is_none()
            .then(|| "the fabric published no statistics".to_string()),
        tcp: None,
        flows: records.len(),
        failed_flows: failures.len(),
        failures: failures.into_iter().take(MAX_LISTED_FAILURES).collect(),
        fct_avg_ms: fct_ms.mean.value,
        fct_p99_ms: fct_ms.p99.value,
        fct_ms,
        fct_front_avg_ms: mean(&front),
        buckets: bucket_stats(&done),
        iteration_avg_ms: iteration_ms.value,
        iteration_ms,
        iterations_ms: its,
        delivered_min: done
            .iter()
            .map(|r| r.delivered_fraction)
            .fold(1.0, f64::min),
        delivered_avg: mean(
            &done
                .iter()
                .map(|r| r.delivered_fraction)
                .collect::<Vec<_>>(),
        ),
        wrong_bytes: records.iter().map(|r| r.wrong_bytes).sum(),
        data_packets,
        drops_per_data_packet: if data_packets == 0 {
            0.0
        } else {
            (thr + buf) as f64 / data_packets as f64
        },
        switch_marked: marked,
        switch_dropped_threshold: thr,
        switch_dropped_buffer: buf,
        valid: !behind,
        fabric_behind: behind,
        fabric_lag_p99_us: stats.map_or(0.0, |s| s.lag.p99_ns as f64 / 1e3),
        fabric_late: stats.map_or((0, 0), |s| (s.lag.late, s.lag.departures)),
        records,
    }
}

/// Columns of `incast-flows.csv`, in order.
pub const CSV_COLUMNS: [&str; 14] = [
    "variant",
    "iteration",
    "phase",
    "src",
    "dst",
    "tensor",
    "layer",
    "bytes",
    "fct_us",
    "delivered_fraction",
    "wrong_bytes",
    "data_packets",
    "failed",
    "error",
];

/// A CSV field: quoted (with doubled quotes) when it holds a comma, quote or line break.
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Writes every flow of every variant as CSV ([`CSV_COLUMNS`]; `failed` is 0 or 1, `error`
/// empty for completed flows).
pub fn write_flows_csv(r: &ExperimentReport, w: &mut impl Write) -> io::Result<()> {
    writeln!(w, "{}", CSV_COLUMNS.join(","))?;
    for v in &r.results {
        for f in &v.records {
            writeln!(
                w,
                "{},{},{},{},{},{},{},{},{:.1},{:.6},{},{},{},{}",
                csv_field(&v.variant.name),
                f.iteration,
                f.phase(),
                f.src,
                f.dst,
                f.tensor,
                f.layer,
                f.bytes,
                f.fct_us,
                f.delivered_fraction,
                f.wrong_bytes,
                f.data_packets,
                u8::from(!f.completed()),
                csv_field(f.error.as_deref().unwrap_or(""))
            )?;
        }
    }
    Ok(())
}

fn ci(e: &Estimate) -> String {
    format!("{:.1} [{:.1}-{:.1}]", e.value, e.lo, e.hi)
}

/// Prints the comparison table.
pub fn print_table(r: &ExperimentReport) {
    println!(
        "{} on {} (regime {}): {} workers, {} servers, {} tensors / {:.1} MB per worker per iteration (scale {}), links {} Mbit/s, {} iterations; FCT in ms with {:.0} % bootstrap CIs",
        r.model,
        r.topology,
        r.regime,
        r.workers,
        r.servers,
        r.tensors_per_worker,
        r.bytes_per_worker as f64 / 1e6,
        r.scale,
        r.link_rate_bps / 1_000_000,
        r.iterations,
        r.bootstrap.level * 100.0
    );
    println!(
        "{:<20} {:>20} {:>22} {:>22} {:>8} {:>10} {:>10} {:>9} {:>9} {:>7} {:>6} valid (late/departures)",
        "variant",
        "fct p50",
        "fct p99",
        "fct p99.9",
        "mean",
        "push>=100K",
        "iteration",
        "drops/pkt",
        "deliv min",
        "marked",
        "failed",
    );
    for v in &r.results {
        if let Some(why) = &v.skipped {
            println!("{:<20} skipped: {why}", v.variant.name);
            continue;
        }
        if v.flows == 0 {
            let why = v.error.as_deref().unwrap_or("no flows");
            println!("{:<20} failed: {why}", v.variant.name);
            continue;
        }
        println!(
            "{:<20} {:>20} {:>22} {:>22} {:>8.1} {:>10.1} {:>10.0} {:>9.4} {:>9.4} {:>7} {:>6} {} ({} / {})",
            v.variant.name,
            ci(&v.fct_ms.p50),
            ci(&v.fct_ms.p99),
            ci(&v.fct_ms.p999),
            v.fct_ms.mean.value,
            v.push_large_p99_ms().unwrap_or(0.0),
            v.iteration_ms.value,
            v.drops_per_data_packet,
            v.delivered_min,
            v.switch_marked,
            v.failed_flows,
            if v.valid { "yes" } else { "NO" },
            v.fabric_late.0,
            v.fabric_late.1,
        );
        if let Some(e) = &v.error {
            println!("{:<20}   error: {e}", "");
        }
    }
    for (title, rs) in [
        ("against the best TCP baseline", &r.ratios),
        ("against tcp-dctcp", &r.ratios_vs_dctcp),
    ] {
        if rs.is_empty() {
            continue;
        }
        println!("ratios {title} (gradwire / TCP; valid runs with every flow completed only):");
        let f = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
        for x in rs {
            println!(
                "  {:<18} vs {:<20} p99 push>=100KB {:>5}  p99 {:>5}  mean {:>5}  iteration {:>5}  drops/pkt {:.4} vs {:.4}",
                x.variant,
                x.baseline,
                f(x.p99_push_large),
                f(x.p99),
                f(x.mean_fct),
                f(x.mean_iteration),
                x.drops_per_data_packet,
                x.baseline_drops_per_data_packet
            );
        }
    }
    for x in &r.excluded {
        println!("  not in the ratios: {}: {}", x.variant, x.reason);
    }
}

impl FctSummary {
    /// The three quantiles, labelled, for plots and tables.
    pub fn quantiles(&self) -> [(&'static str, Estimate); 3] {
        [("p50", self.p50), ("p99", self.p99), ("p99.9", self.p999)]
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
    /// Uniform(0, 1) sample of `n` values (seeded).
    fn uniform(n: usize, seed: u64) -> Vec<f64> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..n).map(|_| rng.f64()).collect()
    }

    #[test]
    fn bootstrap_brackets_the_true_quantiles_of_a_known_distribution() {
        let v = uniform(5000, 3);
        let b = Bootstrap::default();
        let s = [
            Statistic::Quantile(0.5),
            Statistic::Quantile(0.99),
            Statistic::Mean,
        ];
        let e = bootstrap(&v, &s, &b);
        for (est, truth) in e.iter().zip([0.5, 0.99, 0.5]) {
            assert!(est.lo <= est.value && est.value <= est.hi, "{est:?}");
            assert!(est.lo <= truth && truth <= est.hi, "{est:?} misses {truth}");
            // Standard error of the median of 5000 U(0,1) is about 0.007: a 95 % CI about
            // 0.03 wide, not degenerate and not wild.
            assert!(est.hi - est.lo > 0.001 && est.hi - est.lo < 0.06, "{est:?}");
        }
        // The point value is the nearest-rank quantile of the sample itself.
        let mut sorted = v.clone();
        sorted.sort_by(f64::total_cmp);
        assert_eq!(e[1].value, quantile(&sorted, 0.99));
        // Seeded: the same intervals again.
        assert_eq!(bootstrap(&v, &s, &b), e);
    }

    #[test]
    fn bootstrap_mean_interval_covers_about_95_percent() {
        // 200 samples of 100 values from U(0, 1): the 95 % CI of the mean should contain 0.5
        // in about 190 of them (binomial sd about 3; the percentile bootstrap undercovers a
        // little at n = 100).
        let b = Bootstrap {
            resamples: 400,
            ..Bootstrap::default()
        };
        let covered = (0..200)
            .filter(|&k| {
                let e = bootstrap(&uniform(100, 100 + k), &[Statistic::Mean], &b)[0];
                e.lo <= 0.5 && 0.5 <= e.hi
            })
            .count();
        assert!((175..=200).contains(&covered), "{covered} of 200");
    }

    #[test]
    fn bootstrap_of_tiny_samples_is_the_value() {
        let b = Bootstrap::default();
        assert_eq!(
            bootstrap(&[], &[Statistic::Quantile(0.99)], &b),
            vec![Estimate::exact(0.0)]
        );
        assert_eq!(
            bootstrap(&[4.0], &[Statistic::Mean], &b),
            vec![Estimate::exact(4.0)]
        );
    }

    fn rec(bytes: u64, push: bool, fct_ms: f64, error: Option<&str>) -> FlowRecord {
        FlowRecord {
            iteration: 0,
            push,
            src: 0,
            dst: 8,
            tensor: 16,
            layer: 1,
            bytes,
            fct_us: fct_ms * 1e3,
            delivered_fraction: 1.0,
            wrong_bytes: 0,
            data_packets: bytes.div_ceil(1440),
            error: error.map(String::from),
        }
    }

    #[test]
    fn size_buckets() {
        assert_eq!(SizeBucket::of(0), SizeBucket::Small);
        assert_eq!(SizeBucket::of(19_999), SizeBucket::Small);
        assert_eq!(SizeBucket::of(20_000), SizeBucket::Medium);
        assert_eq!(SizeBucket::of(99_999), SizeBucket::Medium);
        assert_eq!(SizeBucket::of(100_000), SizeBucket::Large);
        let recs = [
            rec(10_000, true, 1.0, None),
            rec(10_000, false, 3.0, None),
            rec(150_000, true, 10.0, None),
            rec(150_000, true, 30.0, None),
            // Failed flows take no part in the FCT figures.
            rec(150_000, true, 999.0, Some("sender: peer gone")),
        ];
        let done: Vec<&FlowRecord> = recs.iter().filter(|r| r.completed()).collect();
        let b = bucket_stats(&done);
        let get = |k, ph| b.iter().find(|x| x.bucket == k && x.phase == ph).unwrap();
        assert_eq!(get(SizeBucket::Small, "all").flows, 2);
        assert_eq!(get(SizeBucket::Small, "all").mean_ms, 2.0);
        assert_eq!(get(SizeBucket::Small, "pull").p99_ms, 3.0);
        assert_eq!(get(SizeBucket::Large, "push").flows, 2);
        assert_eq!(get(SizeBucket::Large, "push").p99_ms, 30.0);
        assert_eq!(get(SizeBucket::Large, "push").mean_ms, 20.0);
        assert_eq!(get(SizeBucket::Medium, "all").flows, 0);
    }

    fn variant(name: &str) -> Variant {
        Variant::parse(name).unwrap()
    }

    #[test]
    fn summary_counts_failures_and_drops_per_data_packet() {
        let recs = vec![
            rec(150_000, true, 10.0, None),
            rec(10_000, false, 2.0, None),
            rec(150_000, true, 50.0, Some("receiver: injected fault")),
        ];
        let packets: u64 = recs.iter().map(|r| r.data_packets).sum();
        let r = summarize(
            &variant("gw-p1"),
            recs,
            vec![Duration::from_millis(100), Duration::from_millis(300)],
            None,
            &Bootstrap::default(),
        );
        assert_eq!((r.flows, r.failed_flows), (3, 1));
        assert_eq!(r.failures[0].error, "receiver: injected fault");
        assert_eq!(r.failures[0].phase, "push");
        assert_eq!(r.fct_p99_ms, 10.0);
        assert_eq!(r.fct_avg_ms, 6.0);
        assert_eq!(r.iteration_avg_ms, 200.0);
        assert_eq!(r.data_packets, packets);
        // No fabric figures: not valid, and said why.
        assert!(!r.valid && r.error.is_some());
        assert!(!r.is_headline());
    }

    fn result(name: &str, p99: f64, valid: bool) -> VariantResult {
        let mut r = summarize(
            &variant(name),
            vec![rec(150_000, true, p99, None)],
            vec![Duration::from_millis(p99 as u64 * 10)],
            None,
            &Bootstrap::default(),
        );
        // Synthetic figures of a run whose fabric reported (valid or behind).
        r.error = None;
        r.valid = valid;
        r.fabric_behind = !valid;
        r.drops_per_data_packet = p99 / 1000.0;
        r
    }

    fn report_of(results: Vec<VariantResult>) -> ExperimentReport {
        ExperimentReport {
            regime: "current".into(),
            topology: "t".into(),
            model: "m".into(),
            scale: 1.0,
            iterations: 1,
            workers: 1,
            servers: 1,
            bytes_per_worker: 0,
            // One push and one pull: the 2 records of `result` + one more below.
            tensors_per_worker: 1,
            link_rate_bps: 0,
            tcp_rto_min_ms: None,
            bootstrap: Bootstrap::default(),
            data_packets_source: DATA_PACKETS_SOURCE,
            results,
            ratios: Vec::new(),
            ratios_vs_dctcp: Vec::new(),
            excluded: Vec::new(),
        }
    }

    /// `name` with `done` completed flows and `failed` failed ones.
    fn with_flows(name: &str, p99: f64, done: usize, failed: usize) -> VariantResult {
        let recs: Vec<FlowRecord> = (0..done)
            .map(|_| rec(150_000, true, p99, None))
            .chain((0..failed).map(|_| rec(150_000, true, 1.0, Some("timed out"))))
            .collect();
        let mut r = summarize(
            &variant(name),
            recs,
            vec![Duration::from_millis(p99 as u64 * 10)],
            None,
            &Bootstrap::default(),
        );
        r.error = None;
        r.valid = true;
        r.fabric_behind = false;
        r
    }

    #[test]
    fn a_variant_that_lost_flows_is_no_headline_and_is_listed() {
        // gw-p1 failed one of its two flows: its p99 over the one that completed would look
        // fine, but half its workload is missing.
        let mut report = report_of(vec![
            with_flows("gw-p1", 10.0, 1, 1),
            with_flows("gw-p10", 20.0, 2, 0),
            with_flows("tcp-cubic", 100.0, 2, 0),
            // Best p99, but only one of the workload's two flows has a record.
            with_flows("tcp-bbr", 50.0, 1, 0),
        ]);
        assert_eq!(report.expected_flows(), 2);
        report.compute_ratios();
        let names: Vec<&str> = report.ratios.iter().map(|r| r.variant.as_str()).collect();
        assert_eq!(names, ["gw-p10"]);
        assert_eq!(report.ratios[0].baseline, "tcp-cubic");
        assert_eq!(
            report.excluded,
            vec![
                Excluded {
                    variant: "gw-p1".into(),
                    reason: "1 of 2 flows failed".into()
                },
                Excluded {
                    variant: "tcp-bbr".into(),
                    reason: "1 flows recorded, the workload has 2".into()
                },
            ]
        );
        // Even more completed than failed is not enough.
        assert!(!with_flows("gw-p0", 1.0, 10, 1).is_headline());
        assert!(with_flows("gw-p0", 1.0, 10, 0).is_headline());
        // Wrong bytes: excluded.
        let mut w = with_flows("gw-p0", 1.0, 2, 0);
        w.wrong_bytes = 3;
        assert!(w.exclusion(Some(2)).unwrap().contains("wrong"));
    }

    #[test]
    fn ratios_use_the_best_valid_tcp_baseline() {
        let results = vec![
            result("gw-p1", 50.0, true),
            result("gw-p10", 40.0, false),
            result("tcp-cubic", 200.0, true),
            result("tcp-bbr", 100.0, true),
            // Best p99 but not valid: not a baseline.
            result("tcp-dctcp", 20.0, false),
        ];
        let r = ratios_to_best_tcp(&results, None);
        assert_eq!(r.len(), 1, "the invalid gradwire run takes no part");
        assert_eq!(
            (r[0].variant.as_str(), r[0].baseline.as_str()),
            ("gw-p1", "tcp-bbr")
        );
        assert_eq!(r[0].p99, Some(0.5));
        assert_eq!(r[0].p99_push_large, Some(0.5));
        assert_eq!(r[0].mean_iteration, Some(0.5));
        assert_eq!(r[0].baseline_drops_per_data_packet, 0.1);
        assert!(ratios_to(&results, "tcp-dctcp", None).is_empty());
        assert_eq!(ratios_to(&results, "tcp-cubic", None)[0].p99, Some(0.25));
    }

    #[test]
    fn csv_has_the_documented_columns() {
        let mut v = result("tcp-cubic", 5.0, true);
        v.records.push(rec(
            10_000,
            false,
            1.0,
            Some("sender of job 1: write, \"broken\" pipe"),
        ));
        let report = report_of(vec![v]);
        let mut out = Vec::new();
        write_flows_csv(&report, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let header: Vec<&str> = lines[0].split(',').collect();
        for col in [
            "variant",
            "iteration",
            "phase",
            "src",
            "dst",
            "tensor",
            "bytes",
            "fct_us",
            "delivered_fraction",
            "failed",
            "error",
        ] {
            assert!(header.contains(&col), "{col} missing from {header:?}");
        }
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[1],
            "tcp-cubic,0,push,0,8,16,1,150000,5000.0,1.000000,0,105,0,"
        );
        // A failed flow: failed = 1, its error quoted (commas and quotes inside).
        assert!(
            lines[2].ends_with(",1,\"sender of job 1: write, \"\"broken\"\" pipe\""),
            "{}",
            lines[2]
        );
    }
}
