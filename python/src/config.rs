//! Python arguments to `SessionConfig` and the operations' options, checked with clear errors.
//!
//! Integers arrive as `i64` so that a negative rank or an oversized layer is a `ConfigError`
//! naming the argument rather than an `OverflowError` from the conversion.

use std::net::IpAddr;
use std::time::Duration;

use gradwire_session::SessionConfig;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors;

/// The keywords `Endpoint(...)` and `Session.rendezvous(...)` share.
#[derive(Debug, Clone)]
pub(crate) struct Keywords {
    pub(crate) job: i64,
    pub(crate) loss_bound: f64,
    pub(crate) timeout: f64,
    pub(crate) secret: Option<Vec<u8>>,
    pub(crate) inject_loss: f64,
    pub(crate) seed: u64,
    pub(crate) point_to_point: bool,
    pub(crate) rate_bps: Option<i64>,
    pub(crate) mtu: Option<i64>,
}

/// The session configuration of rank `rank` of `world` at `ip`.
pub(crate) fn session_config(
    py: Python<'_>,
    rank: i64,
    world: i64,
    ip: &str,
    kw: Keywords,
) -> PyResult<SessionConfig> {
    let rank = index(py, "rank", rank)?;
    let world = index(py, "world", world)?;
    let ip: IpAddr = ip.trim().parse().map_err(|_| {
        errors::config(
            py,
            format!(
                "ip {ip:?} is not an IP address: give this rank's own address, e.g. \"10.0.0.2\""
            ),
        )
    })?;
    let mut cfg = SessionConfig::new(rank, world, ip);
    cfg.job = u32::try_from(kw.job)
        .map_err(|_| errors::config(py, format!("job {} is outside 0..=4294967295", kw.job)))?;
    cfg.loss_bound = kw.loss_bound;
    cfg.timeout = seconds(py, "timeout", kw.timeout)?;
    cfg.secret = kw.secret;
    cfg.inject_loss = kw.inject_loss;
    cfg.seed = kw.seed;
    cfg.point_to_point = kw.point_to_point;
    cfg.rate_bps = match kw.rate_bps {
        None => None,
        Some(r) => Some(u64::try_from(r).ok().filter(|r| *r > 0).ok_or_else(|| {
            errors::config(
                py,
                format!("rate_bps {r} must be a positive number of bits/s or None"),
            )
        })?),
    };
    if let Some(m) = kw.mtu {
        cfg.mtu = usize::try_from(m)
            .map_err(|_| errors::config(py, format!("mtu {m} is not a number of bytes")))?;
    }
    Ok(cfg)
}

/// The job secret: bytes-like (bytes, bytearray, memoryview), not str.
pub(crate) fn secret(
    py: Python<'_>,
    secret: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<u8>>> {
    let Some(secret) = secret.filter(|s| !s.is_none()) else {
        return Ok(None);
    };
    if secret.is_instance_of::<PyString>() {
        return Err(errors::config(
            py,
            "secret must be bytes, not str: pass secret.encode()",
        ));
    }
    secret
        .extract::<Vec<u8>>()
        .map(Some)
        .map_err(|_| errors::config(py, "secret must be bytes (at least 16 of them) or None"))
}

/// The seed of `inject_loss`: any int in 0..2**64. It arrives as `i128` so that a negative one
/// is a ConfigError like the other integer options, not the conversion's OverflowError.
pub(crate) fn seed(py: Python<'_>, value: i128) -> PyResult<u64> {
    u64::try_from(value)
        .map_err(|_| errors::config(py, format!("seed {value} is outside 0..={}", u64::MAX)))
}

/// A rank, world size, peer or root: a non-negative integer.
pub(crate) fn index(py: Python<'_>, name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| errors::config(py, format!("{name} {value} must be >= 0")))
}

/// A layer number, layer count or tensor id that must fit the wire's field.
pub(crate) fn small<T: TryFrom<i64>>(
    py: Python<'_>,
    name: &str,
    value: i64,
    max: u64,
) -> PyResult<T> {
    T::try_from(value)
        .map_err(|_| errors::config(py, format!("{name} {value} is outside 0..={max}")))
}

/// A DSCP code point, 0..=63.
pub(crate) fn dscp(py: Python<'_>, value: i64) -> PyResult<u8> {
    u8::try_from(value)
        .ok()
        .filter(|d| *d <= 63)
        .ok_or_else(|| errors::config(py, format!("dscp {value} is outside 0..=63")))
}

fn seconds(py: Python<'_>, name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            errors::config(
                py,
                format!("{name} {value} must be a positive number of seconds"),
            )
        })
}
