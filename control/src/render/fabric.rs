//! The emulated switch's queue configuration (`gradwire-fabric`), from the same policy the
//! hardware renderers use, so the software twin runs exactly what a SONiC or Onyx switch is
//! given: the DSCP -> queue map, strict priority over 8 queues, one ECN-mark/drop threshold
//! per data queue (effective, i.e. cell-rounded when the policy names an ASIC) and the port
//! buffer. The fabric reads this JSON (or the policy file itself, through [`FabricQos::from_policy`]).

use serde::{Deserialize, Serialize};

use crate::policy::{Policy, NUM_DSCP};
use crate::render::RenderError;

/// Queue configuration of every port of an emulated switch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricQos {
    /// Policy name.
    pub name: String,
    /// Always `"strict"`: queue 7 first, then 6, ... 0.
    pub scheduler: String,
    /// Queue (0..=7) of every DSCP, indexed by DSCP (64 entries).
    pub dscp_to_queue: Vec<u8>,
    /// Threshold in bytes of each queue 0..=7; `None` (JSON null) for the control queue 7,
    /// which only the shared buffer limits. Above it an ECN-capable packet is marked CE and
    /// any other packet dropped.
    pub thresholds_bytes: Vec<Option<u64>>,
    /// Shared buffer of one egress port, bytes; tail drop beyond it.
    pub port_buffer_bytes: u64,
}

impl FabricQos {
    /// The fabric configuration of a (validated here) policy.
    pub fn from_policy(p: &Policy) -> Result<FabricQos, RenderError> {
        let th = p.thresholds()?;
        let mut thresholds_bytes: Vec<Option<u64>> =
            th.iter().map(|t| Some(t.effective.0)).collect();
        thresholds_bytes.push(None);
        Ok(FabricQos {
            name: p.name.clone(),
            scheduler: "strict".into(),
            dscp_to_queue: (0..NUM_DSCP as u8).map(|d| p.dscp_queue(d)).collect(),
            thresholds_bytes,
            port_buffer_bytes: p.port_buffer.0,
        })
    }

    /// Checks a configuration read from a file: 64 DSCPs to queues 0..=7, 8 thresholds, each
    /// non-zero and within the buffer, strict scheduler.
    pub fn validate(&self) -> Result<(), String> {
        if self.scheduler != "strict" {
            return Err(format!(
                "field `scheduler`: {:?} is not supported (only \"strict\")",
                self.scheduler
            ));
        }
        if self.dscp_to_queue.len() != NUM_DSCP {
            return Err(format!(
                "field `dscp_to_queue`: {} entries, need {NUM_DSCP}",
                self.dscp_to_queue.len()
            ));
        }
        if let Some((d, q)) = self.dscp_to_queue.iter().enumerate().find(|(_, q)| **q > 7) {
            return Err(format!(
                "field `dscp_to_queue[{d}]`: queue {q} is not within 0..=7"
            ));
        }
        if self.thresholds_bytes.len() != 8 {
            return Err(format!(
                "field `thresholds_bytes`: {} entries, need 8 (queue 7 may be null)",
                self.thresholds_bytes.len()
            ));
        }
        if self.port_buffer_bytes == 0 {
            return Err("field `port_buffer_bytes`: must be > 0".into());
        }
        for (q, t) in self.thresholds_bytes.iter().enumerate() {
            match t {
                Some(0) => return Err(format!("field `thresholds_bytes[{q}]`: must be > 0")),
                Some(t) if *t > self.port_buffer_bytes => {
                    return Err(format!(
                        "field `thresholds_bytes[{q}]`: {t} exceeds the port buffer {}",
                        self.port_buffer_bytes
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// `gradwire-ctl render fabric`: the JSON the emulated switch loads.
pub fn render(p: &Policy) -> Result<String, RenderError> {
    let q = FabricQos::from_policy(p)?;
    let mut s = serde_json::to_string_pretty(&q).map_err(|e| RenderError::OutOfRange {
        target: super::Target::Fabric,
        what: e.to_string(),
    })?;
    s.push('\n');
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::ThresholdSpec;
    use gradwire_units::Bytes;

    #[test]
    fn gradwire_policy_maps_data_and_control_dscps() {
        let p = Policy::gradwire(ThresholdSpec::Arithmetic {
            base: Bytes(15_000),
            step: 0.5,
        });
        let q = FabricQos::from_policy(&p).unwrap();
        q.validate().unwrap();
        for (queue, dscp) in gradwire_qos::DATA_DSCP.iter().enumerate() {
            assert_eq!(q.dscp_to_queue[usize::from(*dscp)], queue as u8);
        }
        assert_eq!(q.dscp_to_queue[usize::from(gradwire_qos::CONTROL_DSCP)], 7);
        // T*(1 + k d) with queue 6 = T.
        let want: Vec<Option<u64>> = (0..7u64)
            .map(|queue| Some(15_000 + (6 - queue) * 7_500))
            .chain([None])
            .collect();
        assert_eq!(q.thresholds_bytes, want);
        assert_eq!(q.port_buffer_bytes, 512 * 1024);
        let back: FabricQos = serde_json::from_str(&render(&p).unwrap()).unwrap();
        assert_eq!(back, q);
    }

    #[test]
    fn validate_names_the_bad_field() {
        let p = Policy::gradwire(ThresholdSpec::Arithmetic {
            base: Bytes(15_000),
            step: 0.5,
        });
        let good = FabricQos::from_policy(&p).unwrap();
        let mut q = good.clone();
        q.dscp_to_queue[5] = 8;
        assert!(q.validate().unwrap_err().contains("dscp_to_queue[5]"));
        let mut q = good.clone();
        q.thresholds_bytes[2] = Some(0);
        assert!(q.validate().unwrap_err().contains("thresholds_bytes[2]"));
        let mut q = good.clone();
        q.thresholds_bytes[2] = Some(q.port_buffer_bytes + 1);
        assert!(q.validate().unwrap_err().contains("exceeds"));
        let mut q = good;
        q.scheduler = "wrr".into();
        assert!(q.validate().unwrap_err().contains("scheduler"));
    }
}
