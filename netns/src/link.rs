//! Links inside namespaces: veth pairs, bridges, addresses, routes, permanent neighbours,
//! offloads, egress shaping, and reading an interface's index and MAC back.
//!
//! Devices are deleted by the teardown rule (crate documentation), through
//! [`crate::delete_netns`] or [`crate::delete_links`].

use std::fmt::Write as _;
use std::io;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use crate::cmd::{exec_in_netns, ip, ip_batch, COMMAND_TIMEOUT};
use crate::error::{NetnsError, Result};
use crate::ns::{run_in_netns, write_ipv6_conf};

/// `mac` as `aa:bb:cc:dd:ee:ff`.
pub fn mac_string(mac: &[u8; 6]) -> String {
    let parts: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    parts.join(":")
}

/// One end of a veth pair.
#[derive(Debug, Clone, Copy)]
pub struct VethEnd<'a> {
    /// The namespace it lives in.
    pub netns: &'a str,
    /// Its name there.
    pub ifname: &'a str,
    /// Its MAC address; the kernel picks a random one if `None`.
    pub mac: Option<[u8; 6]>,
}

/// A veth pair between two namespaces. Created inside `a.netns` with the peer placed directly
/// into `b.netns`, so that interface names never meet in the root namespace (they can be
/// fixed, far below the 15-byte `IFNAMSIZ`).
#[derive(Debug, Clone, Copy)]
pub struct Veth<'a> {
    /// The end the pair is created from.
    pub a: VethEnd<'a>,
    /// The peer.
    pub b: VethEnd<'a>,
    /// MTU of both ends (kernel default if `None`).
    pub mtu: Option<u32>,
    /// RX and TX queue count of both ends (kernel default if `None`). AF_XDP in native mode on a veth needs
    /// at least as many RX queues as the peer has TX queues, so both ends get the same count.
    pub queues: Option<u32>,
}

impl Veth<'_> {
    /// Creates the pair; the links stay down.
    pub fn create(&self) -> Result<()> {
        let end = |e: &VethEnd<'_>, args: &mut Vec<String>| {
            if let Some(q) = self.queues {
                let q = q.to_string();
                args.extend(["numtxqueues".into(), q.clone(), "numrxqueues".into(), q]);
            }
            if let Some(mtu) = self.mtu {
                args.extend(["mtu".into(), mtu.to_string()]);
            }
            if let Some(mac) = e.mac {
                args.extend(["address".into(), mac_string(&mac)]);
            }
        };
        let mut args: Vec<String> = ["-n", self.a.netns, "link", "add", self.a.ifname]
            .map(str::to_owned)
            .into();
        end(&self.a, &mut args);
        args.extend(["type", "veth", "peer", "name", self.b.ifname].map(str::to_owned));
        end(&self.b, &mut args);
        args.extend(["netns".to_owned(), self.b.netns.to_owned()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ip(Some(self.a.netns), &args).map(drop)
    }
}

/// Creates bridge `name` in `netns`, down, for ports that forward at once: STP off, no
/// forward delay, and no multicast snooping (the bridge must not originate IGMP/MLD queries
/// that hosts would see).
pub fn add_bridge(netns: &str, name: &str) -> Result<()> {
    ip(
        Some(netns),
        &[
            "-n",
            netns,
            "link",
            "add",
            name,
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
            "mcast_snooping",
            "0",
        ],
    )
    .map(drop)
}

/// Link configuration of one namespace, applied with a single `ip -batch` process.
#[derive(Debug, Clone, Default)]
pub struct IpBatch {
    lines: String,
}

impl IpBatch {
    /// An empty batch.
    pub fn new() -> IpBatch {
        IpBatch::default()
    }

    fn line(&mut self, args: std::fmt::Arguments<'_>) -> &mut IpBatch {
        // Writing to a String cannot fail.
        let _ = self.lines.write_fmt(args);
        self.lines.push('\n');
        self
    }

    /// Adds address `addr/prefix_len` to `dev`.
    pub fn addr(&mut self, dev: &str, addr: IpAddr, prefix_len: u8) -> &mut IpBatch {
        self.line(format_args!("addr add {addr}/{prefix_len} dev {dev}"))
    }

    /// Adds IPv6 address `addr/prefix_len` to `dev` without duplicate address detection, so
    /// that it is usable at once instead of tentative for a second.
    pub fn addr6_nodad(&mut self, dev: &str, addr: Ipv6Addr, prefix_len: u8) -> &mut IpBatch {
        // The family follows from the address (a batch line takes no `-6`).
        self.line(format_args!("addr add {addr}/{prefix_len} dev {dev} nodad"))
    }

    /// Sets `dev` up.
    pub fn up(&mut self, dev: &str) -> &mut IpBatch {
        self.line(format_args!("link set {dev} up"))
    }

    /// Makes `dev` a port of `bridge`.
    pub fn master(&mut self, dev: &str, bridge: &str) -> &mut IpBatch {
        self.line(format_args!("link set {dev} master {bridge}"))
    }

    /// A permanent neighbour entry `ip -> mac` on `dev`: a kernel-bypass sender, which
    /// resolves destinations itself, then never needs ARP.
    pub fn neighbour(&mut self, dev: &str, ip: IpAddr, mac: &[u8; 6]) -> &mut IpBatch {
        let mac = mac_string(mac);
        self.line(format_args!(
            "neigh replace {ip} lladdr {mac} dev {dev} nud permanent"
        ))
    }

    /// A route to `dest` (`addr/len`) via `gateway` on `dev`, `onlink` (the gateway needs no
    /// address of its own subnet on `dev`).
    pub fn route_onlink(&mut self, dev: &str, dest: &str, gateway: IpAddr) -> &mut IpBatch {
        self.line(format_args!(
            "route add {dest} via {gateway} dev {dev} onlink"
        ))
    }

    /// Whether there is nothing to apply.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Applies the batch in `netns`; the first failing line is the error.
    pub fn apply(&self, netns: &str) -> Result<()> {
        ip_batch(netns, self.lines.clone())
    }
}

/// Turns TX checksum offload off on `dev` in `netns` (`ethtool -K dev tx off`). With it on, a
/// kernel sender's packets cross a veth with only a partial checksum, which an AF_XDP receiver
/// (or an AF_XDP switch forwarding them as they are) hands on to a receiver that rightly
/// rejects them.
pub fn disable_tx_checksum_offload(netns: &str, dev: &str) -> Result<()> {
    exec_in_netns(netns, &["ethtool", "-K", dev, "tx", "off"], COMMAND_TIMEOUT).map(drop)
}

/// Shapes the egress of `dev` in `netns` to `rate_bps` with a `tbf` qdisc of `burst_bytes`
/// and `latency` (how long a packet may wait before it is dropped).
pub fn shape_egress(
    netns: &str,
    dev: &str,
    rate_bps: u64,
    burst_bytes: u64,
    latency: Duration,
) -> Result<()> {
    let rate = format!("{rate_bps}bit");
    let burst = burst_bytes.to_string();
    let latency = format!("{}us", latency.as_micros());
    exec_in_netns(
        netns,
        &[
            "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst,
            "latency", &latency,
        ],
        COMMAND_TIMEOUT,
    )
    .map(drop)
}

/// Sets the minimum TCP retransmission timeout of every IPv4 route in the main table of
/// `netns` to `rto_min` (whole milliseconds, at least 1): each route is replaced by itself
/// plus `rto_min <ms>ms`, as `ip route replace <route> rto_min 10ms` would. TCP reads the
/// metric from the route when a connection starts, so call this before connecting (on both
/// ends: each side's retransmissions use its own route). Linux's default is 200 ms; the DCTCP
/// and incast papers' baselines use 10 ms. Returns the routes as they read after the change.
pub fn set_route_rto_min(netns: &str, rto_min: Duration) -> Result<Vec<String>> {
    let ms = rto_min.as_millis();
    if ms == 0 || Duration::from_millis(ms as u64) != rto_min || ms > u128::from(u32::MAX) {
        return Err(NetnsError::InvalidConfig(format!(
            "rto_min {rto_min:?}: must be a whole number of milliseconds, at least 1"
        )));
    }
    let show = ["-n", netns, "-o", "-4", "route", "show", "table", "main"];
    let mut batch = String::new();
    for route in ip(Some(netns), &show)?.lines() {
        // `ip -o route show` prints a route as `ip route replace` takes it, except for flags
        // that only describe its state, a metric already set, and `\` for line breaks.
        let mut words = route.split_whitespace().filter(|w| *w != "\\").peekable();
        let mut spec = Vec::new();
        while let Some(w) = words.next() {
            match w {
                "linkdown" | "dead" | "offload" | "trap" | "rt_offload" | "rt_trap"
                | "rt_offload_failed" | "pervasive" | "notify" | "unresolved" => {}
                "rto_min" => {
                    if words.peek() == Some(&"lock") {
                        words.next();
                    }
                    words.next();
                }
                _ => spec.push(w),
            }
        }
        if !spec.is_empty() {
            let _ = writeln!(batch, "route replace {} rto_min {ms}ms", spec.join(" "));
        }
    }
    if !batch.is_empty() {
        ip_batch(netns, batch)?;
    }
    Ok(ip(Some(netns), &show)?.lines().map(str::to_owned).collect())
}

/// Re-enables IPv6 on `dev` in `netns` (the kit disables it in every namespace it creates).
/// [`NetnsError::Io`] with `NotFound` if the kernel has no IPv6.
pub fn enable_ipv6(netns: &str, dev: &str) -> Result<()> {
    let dev_owned = dev.to_owned();
    run_in_netns(netns, move || {
        write_ipv6_conf(&dev_owned, "disable_ipv6", b"0")
    })?
    .map_err(|source| NetnsError::Io {
        context: format!("enable IPv6 on {dev} in netns {netns}"),
        source,
    })
}

/// Whether `e` means that the kernel has no IPv6 (from [`enable_ipv6`]).
pub fn is_ipv6_missing(e: &NetnsError) -> bool {
    matches!(e, NetnsError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

/// Ifindex and MAC of `dev` in `netns`.
pub fn link_info(netns: &str, dev: &str) -> Result<(u32, [u8; 6])> {
    let dev = dev.to_owned();
    run_in_netns(netns, move || link_info_here(&dev))?
}

/// Ifindex and MAC of `dev` in the calling thread's namespace.
fn link_info_here(dev: &str) -> Result<(u32, [u8; 6])> {
    let sys = |source| NetnsError::Sys {
        context: format!("look up interface {dev}"),
        source,
    };
    let ifindex = nix::net::if_::if_nametoindex(dev).map_err(sys)?;
    // getifaddrs reports one AF_PACKET entry per interface, carrying its hardware address.
    let mac = nix::ifaddrs::getifaddrs()
        .map_err(sys)?
        .filter(|ifa| ifa.interface_name == dev)
        .find_map(|ifa| {
            ifa.address
                .and_then(|a| a.as_link_addr().and_then(|l| l.addr()))
        })
        .ok_or(NetnsError::Sys {
            context: format!("no link-layer address for {dev}"),
            source: nix::errno::Errno::ENODEV,
        })?;
    Ok((ifindex, mac))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn batches_are_ip_commands() {
        let mut b = IpBatch::new();
        assert!(b.is_empty());
        b.addr("gw0", Ipv4Addr::new(198, 18, 0, 1).into(), 24)
            .up("gw0")
            .neighbour(
                "gw0",
                Ipv4Addr::new(198, 18, 0, 2).into(),
                &[2, 0x67, 0x77, 0, 0, 2],
            )
            .route_onlink(
                "eth0",
                "198.18.0.0/15",
                Ipv4Addr::new(198, 18, 0, 254).into(),
            )
            .addr6_nodad("gw0", "fe80::a".parse().unwrap(), 64)
            .master("h0", "br0");
        assert_eq!(
            b.lines,
            "addr add 198.18.0.1/24 dev gw0\nlink set gw0 up\n\
             neigh replace 198.18.0.2 lladdr 02:67:77:00:00:02 dev gw0 nud permanent\n\
             route add 198.18.0.0/15 via 198.18.0.254 dev eth0 onlink\n\
             addr add fe80::a/64 dev gw0 nodad\nlink set h0 master br0\n"
        );
    }

    #[test]
    fn route_rto_min_is_set_on_every_route() {
        if !crate::require_root("route_rto_min_is_set_on_every_route") {
            return;
        }
        assert!(set_route_rto_min("unused", Duration::from_micros(1500)).is_err());
        assert!(set_route_rto_min("unused", Duration::ZERO).is_err());
        let tb = crate::Testbed::up(&crate::TestbedConfig::default()).unwrap();
        let ns = tb.host(0).netns.clone();
        let mut extra = IpBatch::new();
        extra.route_onlink("gw0", "198.19.0.0/16", Ipv4Addr::new(198, 18, 0, 2).into());
        extra.apply(&ns).unwrap();
        let routes = set_route_rto_min(&ns, Duration::from_millis(10)).unwrap();
        // Twice: a route that has the metric already is replaced, not duplicated.
        let again = set_route_rto_min(&ns, Duration::from_millis(10)).unwrap();
        assert_eq!(routes, again);
        let shown = ip(Some(&ns), &["-n", &ns, "-4", "route", "show"]).unwrap();
        let lines: Vec<&str> = shown.lines().collect();
        assert_eq!(lines.len(), 2, "{shown}");
        for line in &lines {
            assert!(line.contains("rto_min") && line.contains("10ms"), "{shown}");
        }
        assert!(
            lines.iter().any(|l| l.starts_with("198.18.0.0/24 dev gw0")),
            "{shown}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("198.19.0.0/16 via 198.18.0.2")),
            "{shown}"
        );
        tb.down().unwrap();
    }

    #[test]
    fn macs_print_as_colon_hex() {
        assert_eq!(
            mac_string(&[2, 0x67, 0x77, 0, 1, 0xff]),
            "02:67:77:00:01:ff"
        );
    }
}
