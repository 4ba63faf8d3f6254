//! Which tensors each worker pushes to which server, and their contents.

use gradwire::tensor::Tensor;
use gradwire_control::model::DnnModel;

/// One tensor a worker exchanges with one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor id (unique over the workload): `layer * 16 + part`.
    pub id: u32,
    /// Layer index, 0 = front (input side).
    pub layer: u32,
    /// f32 elements.
    pub elems: usize,
    /// Server index.
    pub server: usize,
}

/// The tensors of one iteration, per server, in layer order (front first).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Layers of the model.
    pub layers: u32,
    /// `per_server[s]`: what every worker exchanges with server `s`, front layer first.
    pub per_server: Vec<Vec<TensorSpec>>,
}

impl Workload {
    /// Builds the workload of `model` for `servers` servers.
    pub fn new(
        model: &DnnModel,
        scale: f64,
        servers: usize,
        split_bytes: u64,
        seed: u64,
    ) -> Workload {
        let servers = servers.max(1);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut per_server = vec![Vec::new(); servers];
        for (layer, l) in model.layers.iter().enumerate() {
            let elems = ((l.params as f64 * scale).round() as usize).max(1);
            let layer = layer as u32;
            if (elems as u64) * 4 > split_bytes && servers > 1 {
                let part = elems.div_ceil(servers);
                for (s, list) in per_server.iter_mut().enumerate() {
                    let e = part.min(elems.saturating_sub(s * part)).max(1);
                    list.push(TensorSpec {
                        id: layer * 16 + s as u32,
                        layer,
                        elems: e,
                        server: s,
                    });
                }
            } else {
                let s = rng.usize(..servers);
                per_server[s].push(TensorSpec {
                    id: layer * 16,
                    layer,
                    elems,
                    server: s,
                });
            }
        }
        Workload {
            layers: model.layers.len() as u32,
            per_server,
        }
    }

    /// Bytes one worker pushes per iteration.
    pub fn bytes_per_worker(&self) -> u64 {
        self.per_server
            .iter()
            .flatten()
            .map(|t| t.elems as u64 * 4)
            .sum()
    }
}

/// The gradient values `sender` sends for tensor `t` in `iteration` (push and pull differ by
/// `sender`): small symmetric values whose magnitudes vary, so that magnitude tagging has a
/// median to split at. Deterministic, so the receiver can check every delivered byte.
pub fn tensor_values(t: &TensorSpec, sender: usize, iteration: u32) -> Tensor {
    let seed = (u64::from(t.id) << 32) ^ ((sender as u64) << 16) ^ u64::from(iteration);
    let mut rng = fastrand::Rng::with_seed(seed);
    let v: Vec<f32> = (0..t.elems)
        .map(|_| (rng.f32() * 2.0 - 1.0) * 1e-3)
        .collect();
    Tensor::from_f32(&v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_control::model::load_model;
    use std::path::Path;

    #[test]
    fn resnet50_workload_covers_every_layer_once_per_worker() {
        let m = load_model(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../control/models/resnet50.toml"),
        )
        .unwrap();
        let w = Workload::new(&m, 1.0 / 32.0, 2, 4 << 20 >> 5, 3);
        let mut layers: Vec<u32> = w.per_server.iter().flatten().map(|t| t.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        assert_eq!(layers.len(), m.layers.len());
        // Scaled sizes add up to the model's parameters / 32 (rounding per tensor).
        let elems: u64 = w.per_server.iter().flatten().map(|t| t.elems as u64).sum();
        let want = m.params() as f64 / 32.0;
        assert!((elems as f64 - want).abs() < 200.0, "{elems} vs {want}");
        // The big fc layer is split over both servers.
        let fc = m.layers.len() as u32 - 1;
        assert_eq!(
            w.per_server
                .iter()
                .flatten()
                .filter(|t| t.layer == fc)
                .count(),
            2
        );
        // Ids are unique.
        let mut ids: Vec<u32> = w.per_server.iter().flatten().map(|t| t.id).collect();
        ids.sort_unstable();
        let n = ids.len();
        ids.dedup();
        assert_eq!(ids.len(), n);
        assert_eq!(
            tensor_values(&w.per_server[0][0], 1, 0).as_bytes(),
            tensor_values(&w.per_server[0][0], 1, 0).as_bytes()
        );
    }
}
