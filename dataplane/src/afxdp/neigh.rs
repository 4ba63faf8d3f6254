//! Ethernet addresses: our interface's, and our peers' from the kernel's neighbour table.
//!
//! A kernel-bypass sender builds Ethernet headers itself, so it needs the peer's MAC. It reads
//! the kernel's ARP table of the calling thread's network namespace
//! (`/proc/thread-self/net/arp`), and when the peer is missing it provokes resolution with
//! one kernel UDP datagram to the peer's discard port and reads again. IPv6 peers need a
//! static neighbour in the configuration.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use crate::datapath::DatapathError;

/// Peers' Ethernet addresses: the configured static entries, then whatever the kernel's
/// table resolves, cached so the per-packet path is one hash lookup.
#[derive(Debug, Default)]
pub struct Neighbors {
    cache: HashMap<IpAddr, [u8; 6]>,
}

impl Neighbors {
    /// A cache seeded with static entries.
    pub fn new(statics: &[(IpAddr, [u8; 6])]) -> Neighbors {
        Neighbors {
            cache: statics.iter().copied().collect(),
        }
    }

    /// Records the MAC of `ip` (found elsewhere, e.g. by [`resolve`] ahead of time), replacing
    /// what was known.
    pub fn insert(&mut self, ip: IpAddr, mac: [u8; 6]) {
        self.cache.insert(ip, mac);
    }

    /// The MAC of `ip`, resolving (at most one second) on first use.
    pub fn mac(&mut self, ip: IpAddr) -> Result<[u8; 6], DatapathError> {
        if let Some(m) = self.cache.get(&ip) {
            return Ok(*m);
        }
        let mac = resolve(ip, Duration::from_secs(1)).ok_or(DatapathError::NoNeighbor(ip))?;
        self.cache.insert(ip, mac);
        Ok(mac)
    }
}

/// The Ethernet address of `ifname` in the calling thread's network namespace.
pub fn interface_mac(ifname: &str) -> Option<[u8; 6]> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for a in addrs {
        if a.interface_name != ifname {
            continue;
        }
        if let Some(mac) = a
            .address
            .as_ref()
            .and_then(|s| s.as_link_addr())
            .and_then(|l| l.addr())
        {
            return Some(mac);
        }
    }
    None
}

/// Parse a MAC written `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut out {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

/// Look `ip` up in an ARP table in `/proc/net/arp` format; only complete entries count.
pub fn lookup_arp(table: &str, ip: Ipv4Addr) -> Option<[u8; 6]> {
    table.lines().skip(1).find_map(|line| {
        let mut f = line.split_whitespace();
        let addr: Ipv4Addr = f.next()?.parse().ok()?;
        let _hw_type = f.next()?;
        let flags = u32::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?;
        let mac = parse_mac(f.next()?)?;
        // ATF_COM (0x2): the entry is resolved.
        (addr == ip && flags & 0x2 != 0 && mac != [0; 6]).then_some(mac)
    })
}

fn arp_table() -> Option<String> {
    std::fs::read_to_string("/proc/thread-self/net/arp").ok()
}

/// The MAC of on-link peer `ip`, resolving it through the kernel if needed (IPv4 only).
pub fn resolve(ip: IpAddr, timeout: Duration) -> Option<[u8; 6]> {
    let IpAddr::V4(v4) = ip else { return None };
    if let Some(m) = arp_table().and_then(|t| lookup_arp(&t, v4)) {
        return Some(m);
    }
    // One datagram to the discard port makes the kernel ARP for the peer.
    if let Ok(s) = UdpSocket::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)) {
        let _ = s.send_to(b"gradwire-arp", SocketAddr::new(ip, 9));
    }
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(m) = arp_table().and_then(|t| lookup_arp(&t, v4)) {
            return Some(m);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arp_tables() {
        let t = "IP address       HW type     Flags       HW address            Mask     Device\n\
                 198.18.0.2       0x1         0x2         5a:0b:11:22:33:44     *        gw0\n\
                 198.18.0.3       0x1         0x0         00:00:00:00:00:00     *        gw0\n\
                 198.18.0.4       0x1         0x6         de:ad:be:ef:00:01     *        gw0\n";
        assert_eq!(
            lookup_arp(t, "198.18.0.2".parse().unwrap()),
            Some([0x5a, 0x0b, 0x11, 0x22, 0x33, 0x44])
        );
        assert_eq!(
            lookup_arp(t, "198.18.0.3".parse().unwrap()),
            None,
            "incomplete entry"
        );
        assert_eq!(
            lookup_arp(t, "198.18.0.4".parse().unwrap()),
            Some([0xde, 0xad, 0xbe, 0xef, 0, 1])
        );
        assert_eq!(lookup_arp(t, "198.18.0.9".parse().unwrap()), None);
        assert_eq!(lookup_arp("garbage\n1 2", "1.2.3.4".parse().unwrap()), None);
        assert_eq!(parse_mac("01:02:03:04:05:06:07"), None);
        assert_eq!(parse_mac("zz:02:03:04:05:06"), None);
    }

    #[test]
    fn loopback_has_a_link_address_entry() {
        // lo's link address is all zeros; it exists in every namespace.
        assert_eq!(interface_mac("lo"), Some([0; 6]));
        assert_eq!(interface_mac("no-such-interface0"), None);
    }
}
