//! DLCP's default packet tagging (§3.2.2): layer -> priority -> DSCP, and gradient magnitude
//! -> ECN-capable or not.
//!
//! - **Layer.** Layer `x` of `L` gets data priority ⌊x·P/L⌋ over the P = 7 data priorities
//!   (front layers highest), then the DSCP that priority's switch queue is classified by; both
//!   steps come from `gradwire-qos`, the one definition the control crate renders switch
//!   policies from. The control DSCP is never produced for data.
//! - **Magnitude.** A segment is *important*, and sent ECT(0) so that a switch above its
//!   threshold marks rather than drops it, when the mean |g| of its elements is at least a
//!   per-tensor threshold: by default the median |g| of a 0.1 % random sample of the
//!   tensor's elements (fraction and quantile configurable; drawn as whole cache lines, so
//!   the estimate costs a few cache misses, not one per sample). Segments below it go not-ECT and
//!   are the ones a congested switch drops first.
//!
//! [`DlcpTagger::for_tensor`] estimates the threshold once per tensor (the sample costs a few
//! microseconds per million elements); [`DlcpTagger::tag`] is the per-segment priority
//! function, usable wherever a [`PriorityFn`](crate::flow::PriorityFn) is. f32, f16 and bf16
//! are supported; a raw tensor has no magnitudes, so all its segments are important.

use half::{bf16, f16};

use crate::flow::{SegmentInfo, Tag};
use crate::tensor::{DType, Tensor};

/// How the magnitude threshold is estimated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MagnitudeConfig {
    /// Fraction of the elements sampled (DLCP: 0.1 %).
    pub sample_fraction: f64,
    /// Quantile of the sampled |g| used as the threshold (DLCP: the median, 0.5).
    pub quantile: f64,
    /// At least this many samples (small tensors), at most all elements.
    pub min_samples: usize,
    /// Seed of the sampler (a tensor's threshold is reproducible).
    pub seed: u64,
}

impl Default for MagnitudeConfig {
    fn default() -> Self {
        MagnitudeConfig {
            sample_fraction: 0.001,
            quantile: 0.5,
            min_samples: 64,
            seed: 0x9d1c_9e2a,
        }
    }
}

/// Why a configuration is unusable.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum TaggingError {
    /// `sample_fraction` not within (0, 1].
    #[error("sample fraction {0} must be within (0, 1]")]
    BadFraction(f64),
    /// `quantile` not within [0, 1].
    #[error("quantile {0} must be within [0, 1]")]
    BadQuantile(f64),
    /// `layers` is 0 or `layer` is not below it.
    #[error("layer {layer} of {layers}: need layers >= 1 and layer < layers")]
    BadLayer {
        /// The layer.
        layer: u32,
        /// The number of layers.
        layers: u32,
    },
}

impl MagnitudeConfig {
    /// Checks the fields.
    pub fn validate(&self) -> Result<(), TaggingError> {
        if !(self.sample_fraction > 0.0 && self.sample_fraction <= 1.0) {
            return Err(TaggingError::BadFraction(self.sample_fraction));
        }
        if !(0.0..=1.0).contains(&self.quantile) {
            return Err(TaggingError::BadQuantile(self.quantile));
        }
        Ok(())
    }
}

/// |g| of element `i` of a tensor's bytes, as f32. NaN stays NaN (sorted last).
fn abs_at(bytes: &[u8], dtype: DType, i: usize) -> Option<f32> {
    let e = dtype.elem_size();
    let b = bytes.get(i * e..i * e + e)?;
    Some(match dtype {
        DType::F32 => f32_of(b).abs(),
        DType::F16 => f16_of(b).abs(),
        DType::Bf16 => bf16_of(b).abs(),
        DType::Raw => return None,
    })
}

// One element from exactly its bytes (native order, as the tensor stores it). Separate
// functions rather than a match per element so that `mean_abs`'s loop is monomorphic.
fn f32_of(c: &[u8]) -> f32 {
    f32::from_ne_bytes([c[0], c[1], c[2], c[3]])
}

fn f16_of(c: &[u8]) -> f32 {
    f16::from_ne_bytes([c[0], c[1]]).to_f32()
}

fn bf16_of(c: &[u8]) -> f32 {
    bf16::from_ne_bytes([c[0], c[1]]).to_f32()
}

/// The threshold for `tensor`: the configured quantile of |g| over a random sample of its
/// elements (whole cache lines drawn uniformly with replacement, so every element is equally
/// likely). `None` for a raw or empty tensor.
pub fn magnitude_threshold(tensor: &Tensor, cfg: &MagnitudeConfig) -> Option<f32> {
    sample_threshold(tensor.as_bytes(), tensor.dtype(), cfg)
}

/// [`magnitude_threshold`] of `bytes` holding elements of `dtype` (`None` for raw bytes).
pub fn magnitude_threshold_of(bytes: &[u8], dtype: DType, cfg: &MagnitudeConfig) -> Option<f32> {
    sample_threshold(bytes, dtype, cfg)
}

fn sample_threshold(bytes: &[u8], dtype: DType, cfg: &MagnitudeConfig) -> Option<f32> {
    if dtype == DType::Raw {
        return None;
    }
    let elems = bytes.len() / dtype.elem_size();
    if elems == 0 {
        return None;
    }
    let want = ((elems as f64 * cfg.sample_fraction).ceil() as usize)
        .max(cfg.min_samples)
        .min(elems);
    // Cluster sampling: whole 64-byte cache lines at uniformly random line positions. Every
    // element is equally likely to be drawn (so the estimate stays unbiased), but each cache
    // miss yields 16 or 32 samples instead of one: on a tensor far larger than the cache
    // this is what keeps the estimate at a few percent of sending the tensor.
    let per_line = (64 / dtype.elem_size()).min(elems);
    let lines = elems / per_line;
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let mut s: Vec<f32> = Vec::with_capacity(want + per_line);
    while s.len() < want {
        let first = rng.usize(..lines) * per_line;
        s.extend((first..first + per_line).filter_map(|i| abs_at(bytes, dtype, i)));
    }
    if s.is_empty() {
        return None;
    }
    let k = ((s.len() - 1) as f64 * cfg.quantile.clamp(0.0, 1.0)).round() as usize;
    let (_, v, _) = s.select_nth_unstable_by(k, |a, b| a.total_cmp(b));
    Some(*v)
}

/// Mean |g| of a segment's elements (0 for an empty or raw segment). A trailing partial
/// element (which a valid segment never has) is ignored. Summed in eight f32 lanes so that
/// the compiler vectorises it: this runs once per packet on the send path.
pub fn mean_abs(payload: &[u8], dtype: DType) -> f32 {
    fn lanes<const W: usize>(payload: &[u8], conv: impl Fn(&[u8]) -> f32) -> (f32, usize) {
        let mut acc = [0.0f32; 8];
        let block = 8 * W;
        let mut blocks = payload.chunks_exact(block);
        for b in &mut blocks {
            for (k, a) in acc.iter_mut().enumerate() {
                *a += conv(&b[k * W..k * W + W]).abs();
            }
        }
        let rest = blocks.remainder();
        let mut tail = 0.0f32;
        for c in rest.chunks_exact(W) {
            tail += conv(c).abs();
        }
        (acc.iter().sum::<f32>() + tail, payload.len() / W)
    }
    let (sum, n) = match dtype {
        DType::F32 => lanes::<4>(payload, f32_of),
        DType::F16 => lanes::<2>(payload, f16_of),
        DType::Bf16 => lanes::<2>(payload, bf16_of),
        DType::Raw => return 0.0,
    };
    if n == 0 {
        0.0
    } else {
        sum / n as f32
    }
}

/// DLCP's default priority function for one tensor of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DlcpTagger {
    /// DSCP of the tensor's layer.
    pub dscp: u8,
    /// Magnitude threshold; `None`: every segment is important (raw tensors, or tagging by
    /// magnitude switched off).
    pub threshold: Option<f32>,
}

impl DlcpTagger {
    /// The tagger for layer `layer` (0 = front) of `layers`, with the threshold estimated from
    /// `tensor`.
    pub fn for_tensor(
        tensor: &Tensor,
        layer: u32,
        layers: u32,
        cfg: &MagnitudeConfig,
    ) -> Result<DlcpTagger, TaggingError> {
        cfg.validate()?;
        if layers == 0 || layer >= layers {
            return Err(TaggingError::BadLayer { layer, layers });
        }
        Ok(DlcpTagger {
            dscp: gradwire_qos::layer_dscp(layer, layers),
            threshold: magnitude_threshold(tensor, cfg),
        })
    }

    /// The tag of one segment: the layer's DSCP, ECT when its mean |g| reaches the threshold.
    /// A segment whose mean is NaN (a NaN element) is important: it must not be dropped
    /// silently.
    pub fn tag(&self, seg: &SegmentInfo<'_>) -> Tag {
        let ect = match self.threshold {
            None => true,
            Some(t) => {
                let m = mean_abs(seg.payload, seg.dtype);
                m.is_nan() || m >= t
            }
        };
        Tag {
            dscp: self.dscp,
            ect,
        }
    }

    /// [`DlcpTagger::tag`] as a closure, for `SendOptions` and `send_tensor`.
    pub fn priority_fn(self) -> impl Fn(&SegmentInfo<'_>) -> Tag + Sync {
        move |s| self.tag(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_qos::{CONTROL_DSCP, DATA_DSCP};

    fn seg<'a>(payload: &'a [u8], dtype: DType) -> SegmentInfo<'a> {
        SegmentInfo {
            index: 0,
            offset: 0,
            layer: 0,
            dtype,
            payload,
        }
    }

    #[test]
    fn layers_map_front_highest_and_never_to_control() {
        // L < P: 3 layers spread over queues 6, 4, 2.
        let d: Vec<u8> = (0..3).map(|x| gradwire_qos::layer_dscp(x, 3)).collect();
        assert_eq!(d, vec![DATA_DSCP[6], DATA_DSCP[4], DATA_DSCP[2]]);
        // L > P: 161 layers (ResNet-50's parameter tensors) share the 7 queues in order.
        let q: Vec<u8> = (0..161)
            .map(|x| gradwire_qos::layer_queue(x, 161))
            .collect();
        assert_eq!(q[0], 6);
        assert_eq!(q[160], 0);
        assert!(q.windows(2).all(|w| w[0] >= w[1]), "monotone");
        for x in 0..161 {
            let dscp = gradwire_qos::layer_dscp(x, 161);
            assert_ne!(dscp, CONTROL_DSCP);
        }
        let t = Tensor::from_f32(&[1.0; 8]);
        let m = MagnitudeConfig::default();
        assert!(DlcpTagger::for_tensor(&t, 3, 3, &m).is_err());
        assert!(DlcpTagger::for_tensor(&t, 0, 0, &m).is_err());
    }

    #[test]
    fn known_distribution_is_split_at_the_median() {
        // Segments of 4 elements alternate |g| = 1 and |g| = 3 (signs mixed): the median of
        // all |g| lies at 1 or 3, so with quantile 0.5 the small ones are not important,
        // the large ones are. Use quantile 0.75 to make the boundary unambiguous: 3.
        let vals: Vec<f32> = (0..4000)
            .map(|i| {
                let m = if (i / 4) % 2 == 0 { 1.0 } else { 3.0 };
                if i % 3 == 0 {
                    -m
                } else {
                    m
                }
            })
            .collect();
        let t = Tensor::from_f32(&vals);
        let cfg = MagnitudeConfig {
            sample_fraction: 1.0,
            quantile: 0.75,
            ..MagnitudeConfig::default()
        };
        let tagger = DlcpTagger::for_tensor(&t, 0, 10, &cfg).unwrap();
        assert_eq!(tagger.threshold, Some(3.0));
        let b = t.as_bytes();
        for s in 0..1000 {
            let tag = tagger.tag(&seg(&b[s * 16..s * 16 + 16], DType::F32));
            assert_eq!(tag.ect, s % 2 == 1, "segment {s}");
            assert_eq!(tag.dscp, gradwire_qos::layer_dscp(0, 10));
        }
    }

    #[test]
    fn f16_and_bf16_agree_with_f32() {
        let vals: Vec<f32> = (0..2048).map(|i| ((i % 17) as f32 - 8.0) / 4.0).collect();
        let f16s: Vec<u8> = vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_ne_bytes())
            .collect();
        let bf16s: Vec<u8> = vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_ne_bytes())
            .collect();
        let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let cfg = MagnitudeConfig {
            sample_fraction: 1.0,
            ..MagnitudeConfig::default()
        };
        let t32 = sample_threshold(&f32s, DType::F32, &cfg).unwrap();
        // Values are multiples of 1/4 up to 2: exact in all three types.
        assert_eq!(sample_threshold(&f16s, DType::F16, &cfg), Some(t32));
        assert_eq!(sample_threshold(&bf16s, DType::Bf16, &cfg), Some(t32));
        for (a, b) in [(0, 64), (64, 200)] {
            let m32 = mean_abs(&f32s[a * 4..b * 4], DType::F32);
            assert!(m32 > 0.0);
            assert_eq!(mean_abs(&f16s[a * 2..b * 2], DType::F16), m32);
            assert_eq!(mean_abs(&bf16s[a * 2..b * 2], DType::Bf16), m32);
        }
        assert_eq!(sample_threshold(&[1, 2, 3], DType::Raw, &cfg), None);
        assert_eq!(mean_abs(&[], DType::F32), 0.0);
    }

    #[test]
    fn sampled_median_is_unbiased() {
        // |g| of g ~ U(-1, 1) is U(0, 1): median 0.5. 1M elements, 0.1 % = 1000 samples; the
        // median of 1000 uniform samples has sd ~ 0.016. Over 40 seeds the mean estimate is
        // within 0.01 of 0.5 (sd of the mean ~ 0.0025) and every estimate within 0.08.
        let mut rng = fastrand::Rng::with_seed(7);
        let vals: Vec<f32> = (0..1_000_000).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let t = Tensor::from_f32(&vals);
        let mut sum = 0.0;
        for seed in 0..40 {
            let cfg = MagnitudeConfig {
                seed,
                ..MagnitudeConfig::default()
            };
            let m = magnitude_threshold(&t, &cfg).unwrap();
            assert!((m - 0.5).abs() < 0.08, "seed {seed}: {m}");
            sum += f64::from(m);
        }
        let mean = sum / 40.0;
        assert!((mean - 0.5).abs() < 0.01, "mean estimate {mean}");
    }

    #[test]
    fn nan_and_raw_are_important() {
        let t = Tensor::from_f32(&[0.1, 0.2, 5.0, 6.0]);
        let tagger = DlcpTagger::for_tensor(&t, 1, 2, &MagnitudeConfig::default()).unwrap();
        let nan = f32::NAN.to_ne_bytes();
        assert!(tagger.tag(&seg(&nan, DType::F32)).ect);
        let raw = Tensor::zeros(DType::Raw, 100);
        let rt = DlcpTagger::for_tensor(&raw, 0, 1, &MagnitudeConfig::default()).unwrap();
        assert_eq!(rt.threshold, None);
        assert!(rt.tag(&seg(&[0u8; 10], DType::Raw)).ect);
        let bad = MagnitudeConfig {
            quantile: 1.5,
            ..MagnitudeConfig::default()
        };
        assert_eq!(
            DlcpTagger::for_tensor(&t, 0, 1, &bad),
            Err(TaggingError::BadQuantile(1.5))
        );
    }
}
