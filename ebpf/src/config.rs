//! What the classifier is told at load time ([`XdpConfig`]) and how it is attached.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::layout::{GW_ALLOWLIST_MAX, GW_FAULT_ALWAYS, GW_MAX_PORTS, GW_NUM_DSCP};
use crate::XdpError;

/// Number of DSCP codepoints, the length of [`XdpConfig::fault_drop`].
pub const NUM_DSCP: usize = GW_NUM_DSCP as usize;
/// Most UDP ports the classifier can match.
pub const MAX_PORTS: usize = GW_MAX_PORTS as usize;
/// Capacity of the allowlist map.
pub const ALLOWLIST_CAPACITY: usize = GW_ALLOWLIST_MAX as usize;

/// How to attach the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachMode {
    /// Native (driver) mode, else generic mode with one line on stderr.
    #[default]
    Auto,
    /// Native (driver) mode only: an error if the driver cannot.
    Native,
    /// Generic (skb) mode: works on any interface, slower (runs after skb allocation).
    Generic,
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachMode::Auto => "auto",
            AttachMode::Native => "native",
            AttachMode::Generic => "generic",
        })
    }
}

impl FromStr for AttachMode {
    type Err = XdpError;

    fn from_str(s: &str) -> Result<Self, XdpError> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(AttachMode::Auto),
            "native" | "drv" | "driver" => Ok(AttachMode::Native),
            "generic" | "skb" => Ok(AttachMode::Generic),
            _ => Err(XdpError::InvalidConfig(format!(
                "unknown XDP mode {s:?} (expected auto, native or generic)"
            ))),
        }
    }
}

/// How an XDP program found on an interface is attached (from `bpf_xdp_query`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpAttachedMode {
    /// Driver (native) mode.
    Native,
    /// Generic (skb) mode.
    Generic,
    /// Offloaded to the NIC.
    Offload,
    /// Several programs in different modes.
    Multi,
}

impl fmt::Display for XdpAttachedMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            XdpAttachedMode::Native => "native",
            XdpAttachedMode::Generic => "generic",
            XdpAttachedMode::Offload => "offload",
            XdpAttachedMode::Multi => "multiple",
        })
    }
}

/// Classifier configuration. Validated by [`XdpConfig::validate`] before anything is loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct XdpConfig {
    /// UDP destination ports of gradwire traffic: 1 to 8 distinct, non-zero ports.
    pub ports: Vec<u16>,
    /// `Some`: only these peer source addresses may send gradwire packets (an empty list
    /// drops all gradwire traffic); `None`: no source check. IPv4-mapped IPv6 addresses
    /// (`::ffff:a.b.c.d`) are stored as the IPv4 address.
    pub allowlist: Option<Vec<IpAddr>>,
    /// Drop probability per DSCP for fault injection, each in `[0, 1]`; all 0 (off) by default.
    /// Resolution 2^-32; exactly 1.0 drops every packet.
    pub fault_drop: [f64; NUM_DSCP],
    /// How to attach (ignored by [`XdpProgram::load_detached`](crate::XdpProgram::load_detached)).
    pub mode: AttachMode,
    /// Switch-port mode, for the emulated switch: every frame (any protocol) goes to the
    /// AF_XDP socket of its queue and is counted in `switched`; `ports`, the allowlist and
    /// fault injection are not consulted.
    pub switch_port: bool,
}

impl XdpConfig {
    /// Classify UDP to `ports`; no allowlist, no fault injection, [`AttachMode::Auto`].
    pub fn new(ports: impl Into<Vec<u16>>) -> Self {
        XdpConfig {
            ports: ports.into(),
            allowlist: None,
            fault_drop: [0.0; NUM_DSCP],
            mode: AttachMode::Auto,
            switch_port: false,
        }
    }

    /// Checks every field; the error says which one is wrong.
    pub fn validate(&self) -> Result<(), XdpError> {
        let bad = |m: String| Err(XdpError::InvalidConfig(m));
        if self.ports.is_empty() || self.ports.len() > MAX_PORTS {
            return bad(format!(
                "{} ports given, need 1 to {MAX_PORTS}",
                self.ports.len()
            ));
        }
        for (i, p) in self.ports.iter().enumerate() {
            if *p == 0 {
                return bad("port 0 is not a valid gradwire port".into());
            }
            if self.ports[..i].contains(p) {
                return bad(format!("port {p} is listed twice"));
            }
        }
        if let Some(list) = &self.allowlist {
            if list.len() > ALLOWLIST_CAPACITY {
                return bad(format!(
                    "{} allowlist entries, the map holds {ALLOWLIST_CAPACITY}",
                    list.len()
                ));
            }
        }
        for (dscp, p) in self.fault_drop.iter().enumerate() {
            check_probability(dscp, *p)?;
        }
        Ok(())
    }
}

pub(crate) fn check_probability(dscp: usize, p: f64) -> Result<(), XdpError> {
    if dscp >= NUM_DSCP {
        return Err(XdpError::InvalidConfig(format!(
            "DSCP {dscp} out of range 0..=63"
        )));
    }
    if !(0.0..=1.0).contains(&p) {
        return Err(XdpError::InvalidConfig(format!(
            "fault drop probability {p} for DSCP {dscp} is not in [0, 1]"
        )));
    }
    Ok(())
}

/// Scales a probability in `[0, 1]` to the map's u32: 0 never, `u32::MAX` always (only for
/// exactly 1.0), else `round(p * 2^32)` capped just below "always".
pub(crate) fn probability_to_u32(p: f64) -> u32 {
    if p <= 0.0 {
        0
    } else if p >= 1.0 {
        GW_FAULT_ALWAYS
    } else {
        let scaled = (p * 4_294_967_296.0).round();
        // The cast saturates; `min` keeps "almost 1" from meaning "always".
        (scaled as u64).min(u64::from(GW_FAULT_ALWAYS - 1)) as u32
    }
}

/// IPv4-mapped IPv6 addresses never appear as IPv6 sources on the wire; a dual-stack socket
/// reports IPv4 peers that way, so store them as IPv4.
pub(crate) fn canonical(addr: IpAddr) -> IpAddr {
    addr.to_canonical()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probability_scaling() {
        assert_eq!(probability_to_u32(0.0), 0);
        assert_eq!(probability_to_u32(1.0), u32::MAX);
        assert_eq!(probability_to_u32(0.5), 1 << 31);
        assert_eq!(probability_to_u32(0.999_999_999_999), u32::MAX - 1);
        assert_eq!(probability_to_u32(1e-12), 0);
    }

    #[test]
    fn validation() {
        assert!(XdpConfig::new(vec![7000]).validate().is_ok());
        assert!(XdpConfig::new(vec![]).validate().is_err());
        assert!(XdpConfig::new(vec![1, 2, 3, 4, 5, 6, 7, 8])
            .validate()
            .is_ok());
        assert!(XdpConfig::new(vec![1, 2, 3, 4, 5, 6, 7, 8, 9])
            .validate()
            .is_err());
        assert!(XdpConfig::new(vec![0]).validate().is_err());
        assert!(XdpConfig::new(vec![5, 5]).validate().is_err());
        let mut c = XdpConfig::new(vec![7000]);
        c.fault_drop[63] = 1.0;
        assert!(c.validate().is_ok());
        c.fault_drop[10] = 1.5;
        assert!(c.validate().is_err());
        c.fault_drop[10] = f64::NAN;
        assert!(c.validate().is_err());
        c.fault_drop[10] = -0.1;
        assert!(c.validate().is_err());
        let mut c = XdpConfig::new(vec![7000]);
        c.allowlist = Some(vec![IpAddr::from([198, 18, 0, 1]); ALLOWLIST_CAPACITY + 1]);
        assert!(c.validate().is_err());
    }

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse::<AttachMode>().ok(), Some(AttachMode::Auto));
        assert_eq!("SKB".parse::<AttachMode>().ok(), Some(AttachMode::Generic));
        assert_eq!(
            "native".parse::<AttachMode>().ok(),
            Some(AttachMode::Native)
        );
        assert!("bogus".parse::<AttachMode>().is_err());
    }

    #[test]
    fn mapped_addresses_become_ipv4() {
        let mapped: IpAddr = "::ffff:198.18.0.1"
            .parse()
            .unwrap_or(IpAddr::from([0u8; 16]));
        assert_eq!(canonical(mapped), IpAddr::from([198, 18, 0, 1]));
    }
}
