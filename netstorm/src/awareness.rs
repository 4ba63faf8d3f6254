//! Passive network awareness (NetStorm §V): link throughput measured from the training
//! traffic itself, with no probe traffic, and without synchronized clocks.
//!
//! NetStorm times each model chunk from the sender's send timestamp to the receiver's arrival
//! timestamp and divides bytes by the summed one-way times (Eq. 17). That needs the two
//! clocks synchronized (the paper runs NTP and a proxy per parent): any offset between them
//! adds to every one-way time. gradwire measures with the receiver's clock alone instead:
//!
//! - **Receive-side dispersion** ([`dispersion_throughput`]): a chunk is a train of segments
//!   sent back to back at the sender's rate; the receiver sees its first and last packet
//!   arrive, and `bytes / (last - first)` is the rate the path delivered. Both timestamps are
//!   the receiver's, so a clock offset cannot enter. It is the default.
//! - **Differences of one-way delays** ([`owd_slope_throughput`]): for chunks of different
//!   sizes, each one-way time is `offset + propagation + bytes / throughput`; the slope of
//!   the one-way times against the sizes is `1 / throughput`, and the constant offset falls
//!   out of the slope. It needs chunks of at least two sizes.
//!
//! [`eq17_throughput`] is the paper's estimate, kept to show what an offset does to it.
//!
//! A [`LinkMonitor`] keeps PROBE_CHUNK_NUM samples of chunks of at least PROBE_CHUNK_SIZE
//! bytes per directed link (smaller chunks are dominated by per-message costs, §V) and
//! produces a report when it has them.

use std::collections::BTreeMap;
use std::time::Duration;

/// One chunk's transfer over one link, as the two ends saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkSample {
    /// Payload bytes of the chunk.
    pub bytes: u64,
    /// When the sender started sending it, on the **sender's** clock.
    pub sent_at: Duration,
    /// When its first data packet arrived, on the **receiver's** clock.
    pub first_arrival: Duration,
    /// When its last data packet arrived, on the **receiver's** clock.
    pub last_arrival: Duration,
    /// Packets the chunk arrived in (the first packet's bytes do not count in the spacing).
    pub packets: u32,
}

/// The paper's Eq. 17: bytes over summed one-way times (`last_arrival - sent_at`), in bit/s.
/// Correct only when the clocks agree: an offset adds to every one-way time (a negative sum
/// gives `None`).
pub fn eq17_throughput(samples: &[ChunkSample]) -> Option<f64> {
    let bytes: u64 = samples.iter().map(|s| s.bytes).sum();
    let secs: f64 = samples
        .iter()
        .map(|s| s.last_arrival.as_secs_f64() - s.sent_at.as_secs_f64())
        .sum();
    (bytes > 0 && secs > 0.0).then(|| bytes as f64 * 8.0 / secs)
}

/// Receive-side dispersion, in bit/s: the bytes after each chunk's first packet over the
/// time from its first to its last packet, summed over the samples. Uses only the
/// receiver's clock. `None` without a chunk of at least two packets spread over time.
pub fn dispersion_throughput(samples: &[ChunkSample]) -> Option<f64> {
    let mut bytes = 0f64;
    let mut secs = 0f64;
    for s in samples {
        let spread = s.last_arrival.checked_sub(s.first_arrival)?;
        if s.packets < 2 || spread.is_zero() {
            continue;
        }
        // The first packet's arrival starts the clock: it carries no spacing.
        bytes += s.bytes as f64 * f64::from(s.packets - 1) / f64::from(s.packets);
        secs += spread.as_secs_f64();
    }
    (bytes > 0.0 && secs > 0.0).then(|| bytes * 8.0 / secs)
}

/// Differences of one-way delays, in bit/s: the least-squares slope of the one-way times
/// (`last_arrival - sent_at`, offset included) against the chunks' sizes is the time per
/// byte; a constant clock offset shifts every time equally and leaves the slope alone.
/// `None` unless the sizes differ and the slope is positive.
pub fn owd_slope_throughput(samples: &[ChunkSample]) -> Option<f64> {
    let n = samples.len() as f64;
    if samples.len() < 2 {
        return None;
    }
    // Centre both variables first: the offset (seconds since an arbitrary epoch on
    // another clock) is then subtracted before any product is formed.
    let owd = |s: &ChunkSample| s.last_arrival.as_secs_f64() - s.sent_at.as_secs_f64();
    let mean_x = samples.iter().map(|s| s.bytes as f64).sum::<f64>() / n;
    let mean_y = samples.iter().map(owd).sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0f64, 0f64);
    for s in samples {
        let dx = s.bytes as f64 - mean_x;
        sxy += dx * (owd(s) - mean_y);
        sxx += dx * dx;
    }
    if sxx <= 0.0 {
        return None;
    }
    let secs_per_byte = sxy / sxx;
    (secs_per_byte > 0.0).then(|| 8.0 / secs_per_byte)
}

/// Which estimate a [`LinkMonitor`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Estimator {
    /// [`dispersion_throughput`]: the receiver's clock alone.
    #[default]
    Dispersion,
    /// [`owd_slope_throughput`]: offsets cancel; needs chunks of different sizes.
    OwdSlope,
    /// [`eq17_throughput`]: the paper's, for synchronized clocks only.
    Eq17,
}

impl Estimator {
    /// The estimate of `samples`, in bit/s.
    pub fn estimate(self, samples: &[ChunkSample]) -> Option<f64> {
        match self {
            Estimator::Dispersion => dispersion_throughput(samples),
            Estimator::OwdSlope => owd_slope_throughput(samples),
            Estimator::Eq17 => eq17_throughput(samples),
        }
    }
}

/// A link's measured throughput, ready for the scheduler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// Sending node.
    pub from: usize,
    /// Receiving node.
    pub to: usize,
    /// Estimated throughput, bit/s.
    pub throughput_bps: f64,
    /// Chunks the estimate used.
    pub samples: usize,
}

/// Collects chunk samples per directed link and turns every PROBE_CHUNK_NUM large enough
/// ones into a [`Measurement`].
#[derive(Debug, Clone)]
pub struct LinkMonitor {
    probe_chunk_bytes: u64,
    probe_chunk_num: usize,
    estimator: Estimator,
    pending: BTreeMap<(usize, usize), Vec<ChunkSample>>,
}

impl LinkMonitor {
    /// Samples of at least `probe_chunk_bytes` count; `probe_chunk_num` (at least 1) of them
    /// make a measurement.
    pub fn new(probe_chunk_bytes: u64, probe_chunk_num: usize, estimator: Estimator) -> Self {
        LinkMonitor {
            probe_chunk_bytes,
            probe_chunk_num: probe_chunk_num.max(1),
            estimator,
            pending: BTreeMap::new(),
        }
    }

    /// Record one chunk received by `to` from `from`; returns a measurement when this
    /// sample completes a set (the set then starts over). Tiny chunks are ignored, and so
    /// is a set from which no estimate follows.
    pub fn record(&mut self, from: usize, to: usize, s: ChunkSample) -> Option<Measurement> {
        if s.bytes < self.probe_chunk_bytes {
            return None;
        }
        let set = self.pending.entry((from, to)).or_default();
        set.push(s);
        if set.len() < self.probe_chunk_num {
            return None;
        }
        let samples = std::mem::take(set);
        let throughput_bps = self.estimator.estimate(&samples)?;
        Some(Measurement {
            from,
            to,
            throughput_bps,
            samples: samples.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A chunk of `bytes` in `packets` over a path of `bps` with `prop` propagation, sent at
    /// `t` (true time); the receiver's clock reads true time + `offset`.
    fn chunk(bytes: u64, packets: u32, bps: f64, prop: f64, t: f64, offset: f64) -> ChunkSample {
        let serial = bytes as f64 * 8.0 / bps;
        let per_packet = serial / f64::from(packets);
        let first = t + prop + per_packet + offset;
        let last = t + prop + serial + offset;
        ChunkSample {
            bytes,
            sent_at: Duration::from_secs_f64(t),
            first_arrival: Duration::from_secs_f64(first),
            last_arrival: Duration::from_secs_f64(last),
            packets,
        }
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b
    }

    #[test]
    fn a_ten_second_clock_offset_leaves_the_estimates_alone() {
        let bps = 40e6;
        let sizes = [2_000_000u64, 3_000_000, 2_500_000, 4_000_000];
        let run = |offset: f64| -> Vec<ChunkSample> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &b)| chunk(b, (b / 1400) as u32, bps, 0.030, 100.0 + i as f64, offset))
                .collect()
        };
        let (synced, skewed) = (run(0.0), run(10.0));
        for est in [dispersion_throughput, owd_slope_throughput] {
            let a = est(&synced).unwrap();
            let b = est(&skewed).unwrap();
            assert!(close(a, bps, 0.01), "{a} vs {bps}");
            assert!(close(b, a, 1e-6), "offset changed the estimate: {b} vs {a}");
        }
        // The paper's Eq. 17 with synchronized clocks is near (propagation biases it low) ...
        let eq17 = eq17_throughput(&synced).unwrap();
        assert!(eq17 < bps && eq17 > 0.8 * bps, "{eq17}");
        // ... and off by more than an order of magnitude with a 10 s offset.
        let skew17 = eq17_throughput(&skewed).unwrap();
        assert!(skew17 < 0.1 * bps, "{skew17}");
        // A receiver clock 10 s *behind* makes its one-way times negative: no estimate.
        assert_eq!(eq17_throughput(&run(-10.0)), None);
        assert!(close(
            dispersion_throughput(&run(-10.0)).unwrap(),
            bps,
            0.01
        ));
    }

    #[test]
    fn equal_sizes_give_no_slope_and_single_packets_no_spacing() {
        let same: Vec<_> = (0..4)
            .map(|i| chunk(1_000_000, 700, 10e6, 0.01, f64::from(i), 3.0))
            .collect();
        assert_eq!(owd_slope_throughput(&same), None);
        assert!(dispersion_throughput(&same).is_some());
        let single = [chunk(1400, 1, 10e6, 0.01, 0.0, 0.0)];
        assert_eq!(dispersion_throughput(&single), None);
        assert_eq!(dispersion_throughput(&[]), None);
        assert_eq!(owd_slope_throughput(&single), None);
    }

    #[test]
    fn the_monitor_filters_tiny_chunks_and_reports_every_set() {
        let mut m = LinkMonitor::new(1_000_000, 2, Estimator::Dispersion);
        let big = chunk(2_000_000, 1400, 20e6, 0.03, 0.0, 7.0);
        let tiny = chunk(10_000, 8, 1e6, 0.03, 0.0, 7.0);
        assert_eq!(m.record(0, 1, tiny), None);
        assert_eq!(m.record(0, 1, big), None);
        // Another link's sample does not complete this one's set.
        assert_eq!(m.record(1, 0, big), None);
        let r = m.record(0, 1, big).unwrap();
        assert_eq!((r.from, r.to, r.samples), (0, 1, 2));
        assert!(close(r.throughput_bps, 20e6, 0.01));
        // The set starts over.
        assert_eq!(m.record(0, 1, big), None);
    }

    proptest! {
        #[test]
        fn offsets_never_change_dispersion_or_slope(
            bps in 1e6f64..1e9,
            prop in 0.0f64..0.1,
            offset in -1000.0f64..1000.0,
            sizes in proptest::collection::vec(100_000u64..5_000_000, 2..8),
        ) {
            let run = |off: f64| -> Vec<ChunkSample> {
                sizes.iter().enumerate()
                    .map(|(i, &b)| chunk(b, (b / 1400).max(2) as u32, bps, prop, 2000.0 + i as f64, off))
                    .collect()
            };
            let (a, b) = (run(0.0), run(offset));
            let d = (dispersion_throughput(&a).unwrap(), dispersion_throughput(&b).unwrap());
            prop_assert!(close(d.0, bps, 1e-3) && close(d.1, d.0, 1e-3));
            if let (Some(x), Some(y)) = (owd_slope_throughput(&a), owd_slope_throughput(&b)) {
                prop_assert!(close(y, x, 1e-3), "{} vs {}", x, y);
            }
        }
    }
}
