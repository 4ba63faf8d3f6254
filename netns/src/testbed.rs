//! The N-host testbed: hosts joined by veth pairs, for tests, the demo and benchmarks.
//!
//! Each host is a network namespace with one interface, [`HOST_IFNAME`] (`gw0`), holding
//! `198.18.0.(i+1)/24` (the benchmarking range, never routed). Two hosts are joined by a single
//! veth pair; more hosts each get a veth into a Linux bridge living in an extra "switch"
//! namespace. Every host has `lo` up, static (`permanent`) neighbour entries for every other
//! host so that a kernel-bypass sender never needs ARP, and IPv6 disabled, so the kernel sends
//! no router solicitations or MLD reports that an AF_XDP receiver would have to count as
//! foreign traffic (and no global IPv6 address can ever appear).
//!
//! Namespaces are called `gw<pid>t<n>h<i>` (host `i`) and `gw<pid>t<n>sw` (the switch), a
//! [`crate::new_netns_prefix`] followed by `h<i>` or `sw`. Interface names are fixed (`gw0`,
//! `h<i>`, `br0`) because they live inside private namespaces. Teardown follows the crate's
//! teardown rule through [`NamespaceSet`].

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::cmd::{exec_in_netns, require_tool, COMMAND_TIMEOUT};
use crate::error::{NetnsError, Result};
use crate::link::{self, add_bridge, mac_string, IpBatch, Veth, VethEnd};
use crate::ns::{netns_path, new_netns_prefix, run_in_netns, spawn_in_netns, NamespaceSet};
use crate::privilege::ensure_root;

/// The interface of every host, inside the host's namespace.
pub const HOST_IFNAME: &str = "gw0";
/// Prefix length of the hosts' addresses: host `i` has `198.18.0.(i+1)/24`.
pub const PREFIX_LEN: u8 = 24;
/// Most hosts a testbed can have: the host part of a /24 without network and broadcast.
pub const MAX_HOSTS: usize = 254;

/// Name of the bridge in the switch namespace.
const BRIDGE: &str = "br0";

/// Shape of a testbed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestbedConfig {
    /// Number of hosts, 2 to [`MAX_HOSTS`]. Two are joined directly, more through a bridge.
    pub hosts: usize,
    /// RX and TX queue count of every veth end. AF_XDP in native mode on a veth needs at least
    /// as many RX queues as the peer has TX queues, so both ends get the same count.
    pub queues: u32,
    /// MTU of every veth end.
    pub mtu: u32,
    /// Keep TX checksum offload on the hosts' interfaces. Off by default: with it on, a kernel
    /// UDP sender's packets cross the veth with only a partial UDP checksum, which an AF_XDP
    /// receiver that verifies checksums rightly rejects.
    pub tx_checksum_offload: bool,
}

impl Default for TestbedConfig {
    fn default() -> Self {
        TestbedConfig {
            hosts: 2,
            queues: 1,
            mtu: 1500,
            tx_checksum_offload: false,
        }
    }
}

impl TestbedConfig {
    /// The default configuration with `hosts` hosts.
    pub fn with_hosts(hosts: usize) -> Self {
        TestbedConfig {
            hosts,
            ..TestbedConfig::default()
        }
    }

    fn validate(&self) -> Result<()> {
        if !(2..=MAX_HOSTS).contains(&self.hosts) {
            return Err(NetnsError::InvalidConfig(format!(
                "hosts = {}, must be 2..={MAX_HOSTS}",
                self.hosts
            )));
        }
        // veth accepts up to 4096 queues per direction (VETH_MAX_QUEUES in the kernel is
        // larger, but iproute2 and sane tests stay far below).
        if !(1..=4096).contains(&self.queues) {
            return Err(NetnsError::InvalidConfig(format!(
                "queues = {}, must be 1..=4096",
                self.queues
            )));
        }
        // 68 is the IPv4 minimum; veth's maximum is 64 KiB minus headers.
        if !(68..=65535).contains(&self.mtu) {
            return Err(NetnsError::InvalidConfig(format!(
                "mtu = {}, must be 68..=65535",
                self.mtu
            )));
        }
        Ok(())
    }
}

/// One host of a testbed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Position in the testbed.
    pub index: usize,
    /// Network namespace name (`ip netns exec <netns> ...`).
    pub netns: String,
    /// The host's interface, inside `netns`.
    pub ifname: String,
    /// Interface index of `ifname` inside `netns`.
    pub ifindex: u32,
    /// MAC address of `ifname`.
    pub mac: [u8; 6],
    /// IPv4 address of `ifname` (prefix length [`PREFIX_LEN`]).
    pub ipv4: Ipv4Addr,
}

impl Host {
    /// `mac` as `aa:bb:cc:dd:ee:ff`.
    pub fn mac_string(&self) -> String {
        mac_string(&self.mac)
    }

    /// Path of the namespace handle, for `setns`.
    pub fn netns_path(&self) -> PathBuf {
        netns_path(&self.netns)
    }
}

/// A running testbed; dropping it tears everything down.
#[derive(Debug)]
pub struct Testbed {
    id: String,
    config: TestbedConfig,
    hosts: Vec<Host>,
    switch: Option<String>,
    namespaces: NamespaceSet,
}

impl Testbed {
    /// Builds a testbed. Removes stale namespaces of dead processes first (see
    /// [`crate::cleanup_stale`]). On error, everything created so far is removed again.
    pub fn up(config: &TestbedConfig) -> Result<Testbed> {
        config.validate()?;
        ensure_root()?;
        if !config.tx_checksum_offload {
            require_tool("ethtool", "install ethtool (scripts/deps.sh does)")?;
        }
        let prefix = new_netns_prefix();
        let host_ns: Vec<String> = (0..config.hosts).map(|i| format!("{prefix}h{i}")).collect();
        let switch = (config.hosts > 2).then(|| format!("{prefix}sw"));
        let all: Vec<String> = host_ns.iter().chain(switch.iter()).cloned().collect();
        // If anything below fails, dropping the set removes what exists so far.
        let namespaces = NamespaceSet::temporary("gradwire testbed", &all)?;
        let mut tb = Testbed {
            id: prefix,
            config: config.clone(),
            hosts: Vec::with_capacity(config.hosts),
            switch,
            namespaces,
        };
        tb.wire(&host_ns)?;
        tb.configure_hosts(&host_ns)?;
        Ok(tb)
    }

    /// Creates the veth pairs (and the bridge).
    fn wire(&self, host_ns: &[String]) -> Result<()> {
        let (queues, mtu) = (Some(self.config.queues), Some(self.config.mtu));
        let host_end = |i: usize| VethEnd {
            netns: &host_ns[i],
            ifname: HOST_IFNAME,
            mac: Some(host_mac(i)),
        };
        match &self.switch {
            None => Veth {
                a: host_end(0),
                b: VethEnd {
                    ifname: HOST_IFNAME,
                    ..host_end(1)
                },
                mtu,
                queues,
            }
            .create(),
            Some(sw) => {
                add_bridge(sw, BRIDGE)?;
                let mut ports = IpBatch::new();
                for i in 0..host_ns.len() {
                    let port = format!("h{i}");
                    Veth {
                        a: host_end(i),
                        b: VethEnd {
                            netns: sw,
                            ifname: &port,
                            mac: None,
                        },
                        mtu,
                        queues,
                    }
                    .create()?;
                    ports.master(&port, BRIDGE).up(&port);
                }
                ports.up(BRIDGE).apply(sw)
            }
        }
    }

    /// Addresses, link up, offloads, neighbours; then reads back ifindex and MAC.
    fn configure_hosts(&mut self, host_ns: &[String]) -> Result<()> {
        let n = host_ns.len();
        for (i, ns) in host_ns.iter().enumerate() {
            let mut batch = IpBatch::new();
            batch
                .addr(HOST_IFNAME, host_ipv4(i).into(), PREFIX_LEN)
                .up(HOST_IFNAME);
            for j in (0..n).filter(|&j| j != i) {
                batch.neighbour(HOST_IFNAME, host_ipv4(j).into(), &host_mac(j));
            }
            batch.apply(ns)?;
            if !self.config.tx_checksum_offload {
                link::disable_tx_checksum_offload(ns, HOST_IFNAME)?;
            }
            let (ifindex, mac) = link::link_info(ns, HOST_IFNAME)?;
            self.hosts.push(Host {
                index: i,
                netns: ns.clone(),
                ifname: HOST_IFNAME.to_owned(),
                ifindex,
                mac,
                ipv4: host_ipv4(i),
            });
        }
        Ok(())
    }

    /// Host `i`. Panics if `i >= self.len()`, like slice indexing.
    pub fn host(&self, i: usize) -> &Host {
        match self.hosts.get(i) {
            Some(h) => h,
            None => panic!("no host {i}: the testbed has {} hosts", self.hosts.len()),
        }
    }

    /// All hosts, by index.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Always false: a testbed has at least two hosts.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The switch namespace (holding bridge `br0` and ports `h<i>`), for more than 2 hosts.
    pub fn switch_netns(&self) -> Option<&str> {
        self.switch.as_deref()
    }

    /// The configuration this testbed was built from.
    pub fn config(&self) -> &TestbedConfig {
        &self.config
    }

    /// Every namespace of this testbed (hosts, then the switch).
    pub fn namespaces(&self) -> &[String] {
        self.namespaces.namespaces()
    }

    /// The name prefix of this testbed's namespaces (`gw<pid>t<n>`).
    pub fn id(&self) -> &str {
        &self.id
    }

    fn checked_host(&self, i: usize) -> Result<&Host> {
        self.hosts.get(i).ok_or(NetnsError::NoSuchHost {
            index: i,
            hosts: self.hosts.len(),
        })
    }

    /// Runs `f` on a new thread inside host `i`'s namespace and returns its result. Sockets
    /// `f` creates stay in that namespace for their whole life, whichever thread uses them
    /// later. A panic in `f` is propagated to the caller.
    pub fn run_in<R, F>(&self, i: usize, f: F) -> Result<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        run_in_netns(&self.checked_host(i)?.netns, f)
    }

    /// Like [`Testbed::run_in`] without waiting: `f` runs on a thread inside host `i`'s
    /// namespace. Errors entering the namespace are reported here, before `f` starts.
    pub fn spawn_in<R, F>(&self, i: usize, f: F) -> Result<JoinHandle<R>>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        spawn_in_netns(&self.checked_host(i)?.netns, f)
    }

    /// Runs `args` inside host `i` (`ip netns exec`), killed after [`COMMAND_TIMEOUT`].
    /// Returns its stdout; a non-zero exit is an error carrying its stderr.
    pub fn exec(&self, i: usize, args: &[&str]) -> Result<String> {
        self.exec_timeout(i, args, COMMAND_TIMEOUT)
    }

    /// [`Testbed::exec`] with an explicit time bound.
    pub fn exec_timeout(&self, i: usize, args: &[&str], timeout: Duration) -> Result<String> {
        exec_in_netns(&self.checked_host(i)?.netns, args, timeout)
    }

    /// Tears the testbed down, reporting every problem (teardown continues past each).
    pub fn down(self) -> Result<()> {
        self.namespaces.down()
    }
}

/// `198.18.0.(i+1)`, the address of host `i`.
pub fn host_ipv4(i: usize) -> Ipv4Addr {
    let last = u8::try_from(i + 1).unwrap_or(u8::MAX);
    Ipv4Addr::new(198, 18, 0, last)
}

/// The MAC we give host `i`: locally administered, unicast, `02:67:77:00:hi:lo` of `i + 1`
/// ("gw" in the middle bytes), so captures are easy to read.
pub fn host_mac(i: usize) -> [u8; 6] {
    let n = u16::try_from(i + 1).unwrap_or(u16::MAX).to_be_bytes();
    [0x02, 0x67, 0x77, 0x00, n[0], n[1]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_macs() {
        assert_eq!(host_ipv4(0), Ipv4Addr::new(198, 18, 0, 1));
        assert_eq!(host_ipv4(253), Ipv4Addr::new(198, 18, 0, 254));
        assert_eq!(mac_string(&host_mac(0)), "02:67:77:00:00:01");
        assert_eq!(mac_string(&host_mac(255)), "02:67:77:00:01:00");
    }

    #[test]
    fn config_validation() {
        assert!(TestbedConfig::default().validate().is_ok());
        assert!(TestbedConfig::with_hosts(1).validate().is_err());
        assert!(TestbedConfig::with_hosts(MAX_HOSTS + 1).validate().is_err());
        let q0 = TestbedConfig {
            queues: 0,
            ..TestbedConfig::default()
        };
        assert!(q0.validate().is_err());
    }
}
