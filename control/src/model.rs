//! DNN model files: the per-layer parameter counts the threshold optimizer needs.
//!
//! TOML (or JSON by extension), front (input-side) layer first:
//!
//! ```toml
//! name = "ResNet-50"
//! total_params = 25557032   # optional; checked against the sum of the layers
//! bytes_per_param = 4       # optional, default 4 (fp32 gradients)
//!
//! [[layers]]
//! name = "conv1+bn1"
//! params = 9536
//! ```
//!
//! `control/models/` ships ResNet-50, VGG-16 and BERT-base, with how each count was derived.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::policy_file::{decode, read_text, FileError};

/// One layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    /// Name, for reports.
    pub name: String,
    /// Trainable parameters (= gradients per iteration).
    pub params: u64,
}

/// A model: its layers, front first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnnModel {
    /// Name.
    pub name: String,
    /// Sum of the layers' parameters, if the file states it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_params: Option<u64>,
    /// Bytes per gradient value.
    #[serde(default = "default_bpp")]
    pub bytes_per_param: u32,
    /// Layers, front (input side) first.
    pub layers: Vec<Layer>,
}

fn default_bpp() -> u32 {
    4
}

/// A model file that cannot be used. Same causes and messages as a policy file's
/// ([`FileError`]: unreadable, bad TOML/JSON, or an unusable field).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct ModelError(#[from] pub FileError);

impl DnnModel {
    /// Sum of the layers' parameters (saturating).
    pub fn params(&self) -> u64 {
        self.layers
            .iter()
            .fold(0u64, |a, l| a.saturating_add(l.params))
    }

    /// Layer sizes in parameters, front first.
    pub fn sizes(&self) -> Vec<u64> {
        self.layers.iter().map(|l| l.params).collect()
    }

    /// Check the model; `path` is for messages.
    pub fn check(&self, path: &Path) -> Result<(), ModelError> {
        let err = |field: String, message: String| {
            ModelError(FileError::Field {
                path: path.into(),
                field,
                message,
            })
        };
        if self.layers.is_empty() {
            return Err(err("layers".into(), "no layers".into()));
        }
        if u32::try_from(self.layers.len()).is_err() {
            return Err(err("layers".into(), "too many layers".into()));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.params == 0 {
                return Err(err(
                    format!("layers[{i}].params"),
                    format!("layer {:?} has no parameters; leave it out", l.name),
                ));
            }
        }
        let sum = self
            .layers
            .iter()
            .try_fold(0u64, |a, l| a.checked_add(l.params))
            .ok_or_else(|| err("layers".into(), "parameter count overflows".into()))?;
        if let Some(t) = self.total_params {
            if t != sum {
                return Err(err(
                    "total_params".into(),
                    format!("says {t} but the layers sum to {sum}"),
                ));
            }
        }
        if self.bytes_per_param == 0 {
            return Err(err("bytes_per_param".into(), "must be > 0".into()));
        }
        Ok(())
    }
}

/// Parse model text (TOML, or JSON by `path`'s extension) and check it.
pub fn parse_model(path: &Path, text: &str) -> Result<DnnModel, ModelError> {
    let m: DnnModel = decode(path, text)?;
    m.check(path)?;
    Ok(m)
}

/// Read, parse and check a model file.
pub fn load_model(path: &Path) -> Result<DnnModel, ModelError> {
    parse_model(path, &read_text(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks() {
        let p = Path::new("m.toml");
        let m = parse_model(
            p,
            "name = \"x\"\ntotal_params = 3\n[[layers]]\nname = \"a\"\nparams = 1\n[[layers]]\nname = \"b\"\nparams = 2\n",
        )
        .unwrap();
        assert_eq!(m.sizes(), [1, 2]);
        assert_eq!(m.bytes_per_param, 4);
        let e = |t: &str| parse_model(p, t).unwrap_err().to_string();
        assert!(e("name = \"x\"\nlayers = []\n").contains("field `layers`"));
        let m = e("name = \"x\"\ntotal_params = 4\n[[layers]]\nname = \"a\"\nparams = 1\n");
        assert!(m.contains("total_params") && m.contains("sum to 1"), "{m}");
        let m = e("name = \"x\"\n[[layers]]\nname = \"a\"\nparams = 0\n");
        assert!(m.contains("layers[0].params"), "{m}");
        let m = e("name = \"x\"\n[[layers]]\nname = \"a\"\nparams = -1\n");
        assert!(m.starts_with("m.toml:"), "{m}");
        let m = e("name = \"x\"\n[[layers]]\nname = \"a\"\nparms = 1\n");
        assert!(m.contains("parms"), "{m}");
        let m = parse_model(Path::new("m.json"), "{\"name\": 1}")
            .unwrap_err()
            .to_string();
        assert!(m.starts_with("m.json:"), "{m}");
    }
}
