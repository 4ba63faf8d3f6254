//! Socket addresses as users write them: `IP:port`, `[IPv6]:port` or `host:port`.
//!
//! A host name is resolved once, when the address is read, through the system resolver
//! (std's `ToSocketAddrs`, i.e. `getaddrinfo`: `/etc/hosts`, then DNS as `nsswitch.conf`
//! says). When a name has several addresses the first IPv4 one is taken, else the first:
//! `localhost` then means 127.0.0.1 on both ends of a transfer, and a receiver listening on
//! `0.0.0.0` is reachable (it is not over IPv6).

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// Why an address was refused; every message names what was given.
#[derive(Debug, thiserror::Error)]
pub enum AddrError {
    /// No `:port`, or an IPv6 address without brackets.
    #[error(
        "{input:?} has no port: write host:port (e.g. hostb:7070, 198.18.1.2:7070, [::1]:7070)"
    )]
    NoPort {
        /// What was given.
        input: String,
    },
    /// The port is not a number 0..=65535.
    #[error("{input:?}: port {port:?} is not a number 0..=65535")]
    BadPort {
        /// What was given.
        input: String,
        /// The text after the last `:`.
        port: String,
    },
    /// The resolver failed (unknown name, no DNS, ...).
    #[error("cannot resolve host name {host:?} (in {input:?}): {source}; check the name, /etc/hosts and DNS, or give an IP address")]
    Resolve {
        /// What was given.
        input: String,
        /// The host name.
        host: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// The resolver answered with no address.
    #[error("host name {host:?} (in {input:?}) has no address; check the name, /etc/hosts and DNS, or give an IP address")]
    NoAddress {
        /// What was given.
        input: String,
        /// The host name.
        host: String,
    },
}

/// Reads `IP:port`, `[IPv6]:port` or `host:port`, resolving a host name once (see the
/// module docs for which address is taken).
pub fn resolve(s: &str) -> Result<SocketAddr, AddrError> {
    let t = s.trim();
    if let Ok(a) = t.parse::<SocketAddr>() {
        return Ok(a);
    }
    let no_port = || AddrError::NoPort { input: s.into() };
    let (host, port) = t.rsplit_once(':').ok_or_else(no_port)?;
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(bracketed) => bracketed,
        // An unbracketed IPv6 address ("::1", "fe80::1"): its last group is not a port.
        None if host.contains(':') => return Err(no_port()),
        None => host,
    };
    if host.is_empty() {
        return Err(no_port());
    }
    let port: u16 = port.parse().map_err(|_| AddrError::BadPort {
        input: s.into(),
        port: port.into(),
    })?;
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let all: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|source| AddrError::Resolve {
            input: s.into(),
            host: host.into(),
            source,
        })?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| AddrError::NoAddress {
            input: s.into(),
            host: host.into(),
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn literal_addresses_need_no_resolver() {
        assert_eq!(
            resolve("198.18.1.2:7070").unwrap(),
            SocketAddr::new(Ipv4Addr::new(198, 18, 1, 2).into(), 7070)
        );
        assert_eq!(
            resolve(" [::1]:7070 ").unwrap(),
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), 7070)
        );
    }

    #[test]
    fn a_name_from_etc_hosts_resolves() {
        // localhost is in /etc/hosts (and glibc answers it even without the file).
        let a = resolve("localhost:7070").unwrap();
        assert_eq!(a, SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 7070));
    }

    #[test]
    fn an_unknown_name_fails_naming_it() {
        // .invalid never resolves (RFC 2606).
        let e = resolve("no-such-host.invalid:7070").unwrap_err();
        assert!(matches!(e, AddrError::Resolve { .. }), "{e:?}");
        let m = e.to_string();
        assert!(m.contains("\"no-such-host.invalid\""), "{m}");
        assert!(m.contains("cannot resolve host name"), "{m}");
    }

    #[test]
    fn a_missing_or_bad_port_is_said_clearly() {
        for bad in ["hostb", "::1", "fe80::1", ":7070", "[::1]"] {
            let e = resolve(bad).unwrap_err();
            assert!(matches!(e, AddrError::NoPort { .. }), "{bad}: {e:?}");
            assert!(e.to_string().contains("has no port"), "{e}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        let e = resolve("hostb:http").unwrap_err();
        assert!(matches!(e, AddrError::BadPort { .. }), "{e:?}");
        assert!(e.to_string().contains("\"http\""), "{e}");
        assert!(matches!(
            resolve("hostb:70000"),
            Err(AddrError::BadPort { .. })
        ));
    }
}
