//! NetStorm's options (Table I) and hyper-parameters (Table II), with the paper's defaults.
//!
//! Deserializes from any serde format (TOML in gradwire's files); a missing field takes its
//! default and an unknown field is an error, so a misspelt option is not silently ignored.
//! [`NetStormConfig::validate`] names the offending field.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::time::Duration;

/// NetStorm's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetStormConfig {
    /// NUM_ROOT_SERVERS: roots of the multi-root FAPT, chosen once by quality score. `None`
    /// (the default) makes every node a root, as the paper's best setting (9 of 9, §IX-C(2)).
    pub num_roots: Option<usize>,
    /// CHUNK_SIZE: most elements per chunk (1 million; §IX-E recommends 0.5-1 million).
    pub chunk_size: usize,
    /// PRIMARY_BUSY_BOUND: chunks in flight on the primary path beyond which it is busy and
    /// new chunks go to an auxiliary path (2).
    pub primary_busy_bound: usize,
    /// AUXILIARY_QUEUE_LENGTH: chunks in flight an auxiliary path accepts (1, Table II's
    /// default; the grid search of §IX-C(4) found 5 best, with PRIMARY_BUSY_BOUND = 2).
    pub auxiliary_queue_length: usize,
    /// PROBE_CHUNK_SIZE in **bytes**: only chunks larger than this time a link (2,000,000).
    /// Table II says "2 millions" and §IX-E speaks of parameters, but with CHUNK_SIZE = 1
    /// million elements no chunk could then ever exceed it; as bytes, a full f32 chunk (4 MB)
    /// qualifies and biases do not, which is the filter §V describes.
    pub probe_chunk_size: u64,
    /// PROBE_CHUNK_NUM: chunks averaged per throughput estimate (4; §IX-E recommends 4-32).
    pub probe_chunk_num: usize,
    /// UPDATE_TIME: period of the policy refresh (5 s). Written as seconds (`5`, `0.5`) or
    /// with a unit (`"500ms"`, `"5s"`, `"1min"`).
    #[serde(
        serialize_with = "serialize_secs",
        deserialize_with = "deserialize_duration"
    )]
    pub update_time: Duration,
    /// ENABLE_AWARENESS: measure links from the training traffic and feed Algorithm 2 (true).
    pub enable_awareness: bool,
    /// ENABLE_AUX_PATH: offload chunks onto auxiliary paths (true).
    pub enable_aux_path: bool,
    /// UPDATE_RATE: relative throughput change that counts as significant (0, the paper's
    /// setting: refresh every UPDATE_TIME whatever changed). See
    /// [`NetStormConfig::is_significant_change`].
    pub update_rate: f64,
}

impl Default for NetStormConfig {
    fn default() -> Self {
        NetStormConfig {
            num_roots: None,
            chunk_size: 1_000_000,
            primary_busy_bound: 2,
            auxiliary_queue_length: 1,
            probe_chunk_size: 2_000_000,
            probe_chunk_num: 4,
            update_time: Duration::from_secs(5),
            enable_awareness: true,
            enable_aux_path: true,
            update_rate: 0.0,
        }
    }
}

/// An option with a value NetStorm cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid NetStorm option {field}: {reason}")]
pub struct ConfigError {
    /// The option's field name.
    pub field: &'static str,
    /// What is wrong and what to do.
    pub reason: String,
}

impl ConfigError {
    fn new(field: &'static str, reason: impl Into<String>) -> Self {
        ConfigError {
            field,
            reason: reason.into(),
        }
    }
}

impl NetStormConfig {
    /// Checks every option; the error names the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_roots == Some(0) {
            return Err(ConfigError::new(
                "num_roots",
                "0 roots: give at least 1, or leave it unset for one root per node",
            ));
        }
        if self.chunk_size == 0 {
            return Err(ConfigError::new(
                "chunk_size",
                "0 elements: a chunk needs at least 1 (the paper uses 1000000)",
            ));
        }
        if self.auxiliary_queue_length == 0 {
            return Err(ConfigError::new(
                "auxiliary_queue_length",
                "0 would accept no chunk on any auxiliary path: give at least 1, or set \
                 enable_aux_path = false to turn auxiliary paths off",
            ));
        }
        if self.probe_chunk_num == 0 {
            return Err(ConfigError::new(
                "probe_chunk_num",
                "0 chunks cannot estimate a throughput: give at least 1 (the paper uses 4)",
            ));
        }
        if self.update_time.is_zero() {
            return Err(ConfigError::new(
                "update_time",
                "0 s would refresh the policy continuously: give a period (the paper uses 5s)",
            ));
        }
        if !self.update_rate.is_finite() || self.update_rate < 0.0 {
            return Err(ConfigError::new(
                "update_rate",
                format!(
                    "{} is not a relative change: give a finite number >= 0 (0 refreshes every \
                     update_time)",
                    self.update_rate
                ),
            ));
        }
        Ok(())
    }

    /// The number of roots for an overlay of `num_nodes` nodes: `num_roots`, or all nodes.
    pub fn roots_for(&self, num_nodes: usize) -> Result<usize, ConfigError> {
        match self.num_roots {
            None => Ok(num_nodes),
            Some(0) => Err(ConfigError::new("num_roots", "0 roots: give at least 1")),
            Some(k) if k > num_nodes => Err(ConfigError::new(
                "num_roots",
                format!(
                    "{k} roots but the overlay has {num_nodes} nodes: give at most {num_nodes}"
                ),
            )),
            Some(k) => Ok(k),
        }
    }

    /// Whether a measured change (e.g. [`crate::graph::Overlay::max_relative_change`]) is
    /// significant enough to reformulate the policy: `change >= update_rate`, so the default 0
    /// refreshes every UPDATE_TIME as the paper does.
    pub fn is_significant_change(&self, change: f64) -> bool {
        change >= self.update_rate
    }
}

fn serialize_secs<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// A duration from seconds (a number) or a string with a unit (`ns`, `us`, `ms`, `s`, `min`,
/// `h`).
fn deserialize_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    struct Visitor;
    impl serde::de::Visitor<'_> for Visitor {
        type Value = Duration;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a duration: seconds as a number, or a string such as \"500ms\" or \"5s\"")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_secs(v))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v)
                .map(Duration::from_secs)
                .map_err(|_| E::custom(format!("{v} s is negative: give a duration >= 0")))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Duration, E> {
            Duration::try_from_secs_f64(v)
                .map_err(|_| E::custom(format!("{v} s is not a duration: give seconds >= 0")))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Duration, E> {
            parse_duration(v).map_err(E::custom)
        }
    }
    d.deserialize_any(Visitor)
}

/// `<number><unit>` with an optional space, e.g. `500ms`, `1.5 s`, `2min`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} does not start with a number: write e.g. \"5s\""))?;
    let scale = match unit.trim() {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" | "sec" => 1.0,
        "min" | "m" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "{text:?} has unit {other:?}: use ns, us, ms, s, min or h"
            ))
        }
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::value::{Error, MapDeserializer, StrDeserializer, U64Deserializer};
    use serde::de::IntoDeserializer;

    fn from_pairs<V>(pairs: Vec<(&'static str, V)>) -> Result<NetStormConfig, Error>
    where
        V: IntoDeserializer<'static, Error>,
    {
        // serde's value deserializers stand in for a format crate (TOML, JSON).
        let de: MapDeserializer<'_, _, Error> = MapDeserializer::new(pairs.into_iter());
        NetStormConfig::deserialize(de)
    }

    #[test]
    fn defaults_are_the_papers() {
        let c = NetStormConfig::default();
        assert_eq!(c.num_roots, None);
        assert_eq!(c.roots_for(9), Ok(9));
        assert_eq!(c.chunk_size, 1_000_000);
        assert_eq!(c.primary_busy_bound, 2);
        assert_eq!(c.auxiliary_queue_length, 1);
        assert_eq!(c.probe_chunk_size, 2_000_000);
        assert_eq!(c.probe_chunk_num, 4);
        assert_eq!(c.update_time, Duration::from_secs(5));
        assert!(c.enable_awareness && c.enable_aux_path);
        assert_eq!(c.update_rate, 0.0);
        c.validate().unwrap();
    }

    #[test]
    fn missing_fields_default_and_unknown_fields_are_refused() {
        let c = from_pairs(vec![("chunk_size", 500_000u64), ("probe_chunk_num", 8)]).unwrap();
        assert_eq!(c.chunk_size, 500_000);
        assert_eq!(c.probe_chunk_num, 8);
        assert_eq!(c.primary_busy_bound, 2);
        let c = from_pairs(vec![("enable_aux_path", false)]).unwrap();
        assert!(!c.enable_aux_path && c.enable_awareness);
        let err = from_pairs(vec![("chunk_sise", 5u64)]).unwrap_err();
        assert!(err.to_string().contains("chunk_sise"), "{err}");
    }

    #[test]
    fn update_time_takes_seconds_or_a_unit() {
        let c = from_pairs(vec![("update_time", "500ms")]).unwrap();
        assert_eq!(c.update_time, Duration::from_millis(500));
        let c = from_pairs(vec![("update_time", 7u64)]).unwrap();
        assert_eq!(c.update_time, Duration::from_secs(7));
        let d = deserialize_duration(U64Deserializer::<Error>::new(3)).unwrap();
        assert_eq!(d, Duration::from_secs(3));
        let f = deserialize_duration(serde::de::value::F64Deserializer::<Error>::new(1.5));
        assert_eq!(f.unwrap(), Duration::from_millis(1500));
        for (text, want) in [
            ("2min", Duration::from_secs(120)),
            (" 1.5 s", Duration::from_millis(1500)),
            ("20us", Duration::from_micros(20)),
        ] {
            let d = deserialize_duration(StrDeserializer::<Error>::new(text)).unwrap();
            assert_eq!(d, want, "{text}");
        }
        for bad in ["5 parsecs", "fast", ""] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(deserialize_duration(serde::de::value::I64Deserializer::<Error>::new(-1)).is_err());
    }

    #[test]
    fn validation_names_the_field() {
        let bad = [
            (
                NetStormConfig {
                    num_roots: Some(0),
                    ..Default::default()
                },
                "num_roots",
            ),
            (
                NetStormConfig {
                    chunk_size: 0,
                    ..Default::default()
                },
                "chunk_size",
            ),
            (
                NetStormConfig {
                    auxiliary_queue_length: 0,
                    ..Default::default()
                },
                "auxiliary_queue_length",
            ),
            (
                NetStormConfig {
                    probe_chunk_num: 0,
                    ..Default::default()
                },
                "probe_chunk_num",
            ),
            (
                NetStormConfig {
                    update_time: Duration::ZERO,
                    ..Default::default()
                },
                "update_time",
            ),
            (
                NetStormConfig {
                    update_rate: f64::NAN,
                    ..Default::default()
                },
                "update_rate",
            ),
        ];
        for (config, field) in bad {
            let err = config.validate().unwrap_err();
            assert_eq!(err.field, field);
            assert!(err.to_string().contains(field), "{err}");
        }
        let c = NetStormConfig {
            num_roots: Some(10),
            ..Default::default()
        };
        assert_eq!(c.roots_for(9).unwrap_err().field, "num_roots");
        assert_eq!(
            NetStormConfig {
                num_roots: Some(3),
                ..Default::default()
            }
            .roots_for(9),
            Ok(3)
        );
    }

    #[test]
    fn significant_change_threshold() {
        let c = NetStormConfig::default();
        assert!(c.is_significant_change(0.0));
        let c = NetStormConfig {
            update_rate: 0.2,
            ..Default::default()
        };
        assert!(!c.is_significant_change(0.1));
        assert!(c.is_significant_change(0.2));
    }
}
