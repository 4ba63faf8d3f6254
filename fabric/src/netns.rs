//! Building a [`Topology`] out of network namespaces and veth pairs.
//!
//! Every host and every switch is a namespace `<prefix>-<node>`. A host has one interface,
//! `eth0`, holding its /32, a route to 198.18.0.0/15 via the virtual gateway, and permanent
//! neighbour entries (gateway and every other host -> the switch port's MAC) so that neither
//! the kernel nor an AF_XDP sender ever needs ARP. Its egress is shaped to the link rate by a
//! `tbf` qdisc (the host's NIC; the switch shapes the other direction). AF_XDP transmits
//! bypass the qdisc, so an AF_XDP host is not shaped. TX checksum offload is off on host
//! interfaces: a veth would otherwise hand the switch TCP/UDP packets with partial checksums,
//! which an AF_XDP switch forwards as they are and the receiver then drops. Switch ports
//! (`p0`, `p1`, ...) have no addresses; the fabric attaches its XDP program and AF_XDP socket.
//!
//! Teardown is layered as in [`gradwire::testbed`]: [`Drop`], a reaper process for test
//! testbeds (prefix from [`gradwire::testbed::new_netns_prefix`], also found by
//! [`gradwire::testbed::cleanup_stale`]), and for the CLI's long-lived testbeds
//! `gradwire testbed down`.

use std::time::Duration;

use gradwire::testbed::{
    self, create_netns, delete_netns, exec_in_netns, ip_batch, Reaper, TestbedError,
};

use crate::topology::{mac_string, Peer, Topology, GATEWAY, HOST_IFNAME};

/// MTU of every interface.
pub const MTU: u32 = 1500;

/// Namespaces of a built topology.
#[derive(Debug)]
pub struct FabricNet {
    prefix: String,
    hosts: Vec<String>,
    switches: Vec<String>,
    created: Vec<String>,
    reaper: Option<Reaper>,
    keep: bool,
    torn_down: bool,
}

/// Namespace name of `node` under `prefix`.
pub fn ns_name(prefix: &str, node: &str) -> String {
    format!("{prefix}-{node}")
}

/// The prefix the CLI uses for topology `name` (`gwt<name>`): stable, so that
/// `gradwire testbed down` finds it again, and never matched by `cleanup_stale`.
pub fn cli_prefix(name: &str) -> String {
    format!("gwt{name}")
}

impl FabricNet {
    /// Builds `topo` under a fresh per-process prefix, with a reaper: for tests and for
    /// processes that run the fabric themselves. Removed on drop.
    pub fn up(topo: &Topology) -> Result<FabricNet, TestbedError> {
        if let Err(e) = testbed::cleanup_stale() {
            eprintln!("gradwire fabric: warning: stale cleanup: {e}");
        }
        Self::build(topo, testbed::new_netns_prefix(), true)
    }

    /// Builds `topo` under [`cli_prefix`] and leaves it in place when dropped
    /// ([`FabricNet::down_by_name`] removes it). Fails if namespaces of that name exist.
    pub fn up_persistent(topo: &Topology) -> Result<FabricNet, TestbedError> {
        let prefix = cli_prefix(&topo.name);
        let all = node_names(topo);
        if let Some(n) = all
            .iter()
            .find(|n| testbed::netns_path(&ns_name(&prefix, n)).exists())
        {
            return Err(TestbedError::Io {
                context: format!(
                    "testbed {:?} is already up (namespace {} exists); `gradwire testbed down` it first",
                    topo.name,
                    ns_name(&prefix, n)
                ),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            });
        }
        let mut net = Self::build(topo, prefix, false)?;
        net.keep = true;
        Ok(net)
    }

    /// Deletes every namespace of the CLI testbed of `topo`; returns how many existed.
    pub fn down_by_name(topo: &Topology) -> Result<usize, TestbedError> {
        let prefix = cli_prefix(&topo.name);
        let mut n = 0;
        let mut errors = Vec::new();
        for node in node_names(topo) {
            match delete_netns(&ns_name(&prefix, &node)) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            Ok(n)
        } else {
            Err(TestbedError::Cleanup(errors))
        }
    }

    fn build(topo: &Topology, prefix: String, reaper: bool) -> Result<FabricNet, TestbedError> {
        if !testbed::is_root() {
            return Err(TestbedError::NotRoot {
                euid: nix::unistd::geteuid().as_raw(),
            });
        }
        let hosts: Vec<String> = topo
            .hosts
            .iter()
            .map(|h| ns_name(&prefix, &h.name))
            .collect();
        let switches: Vec<String> = topo
            .switches
            .iter()
            .map(|s| ns_name(&prefix, &s.name))
            .collect();
        let all: Vec<String> = switches.iter().chain(&hosts).cloned().collect();
        let mut net = FabricNet {
            prefix,
            hosts,
            switches,
            created: Vec::with_capacity(all.len()),
            reaper: None,
            keep: false,
            torn_down: false,
        };
        if reaper {
            match Reaper::spawn(&all) {
                Ok(r) => net.reaper = Some(r),
                Err(e) => eprintln!(
                    "gradwire fabric: warning: no reaper ({e}); if this process is killed, \
                     the next testbed removes its namespaces"
                ),
            }
        }
        // From here on, an error drops `net`, which removes what exists.
        for ns in &all {
            let mut created = None;
            create_netns(ns, |n| created = Some(n.to_owned()))?;
            net.created.extend(created);
        }
        net.wire(topo)?;
        net.configure_hosts(topo)?;
        Ok(net)
    }

    fn wire(&self, topo: &Topology) -> Result<(), TestbedError> {
        let mut batches: Vec<String> = vec![String::new(); self.switches.len()];
        for (si, s) in topo.switches.iter().enumerate() {
            for (pi, p) in s.ports.iter().enumerate() {
                let sw_ns = &self.switches[si];
                match p.peer {
                    Peer::Host(h) => {
                        // Created inside the host namespace with its peer placed directly into
                        // the switch's: the fixed names never meet in the root namespace.
                        let line = format!(
                            "link add {HOST_IFNAME} mtu {MTU} address {} type veth peer name {} \
                             mtu {MTU} address {} netns {sw_ns}",
                            mac_string(&topo.hosts[h].mac),
                            p.ifname,
                            mac_string(&p.mac)
                        );
                        ip_batch(&self.hosts[h], format!("{line}\n"))?;
                    }
                    // Each switch-switch link once, from its lower end.
                    Peer::Switch(t, tp) if (si, pi) < (t, tp) => {
                        let peer = &topo.switches[t].ports[tp];
                        let line = format!(
                            "link add {} mtu {MTU} address {} type veth peer name {} mtu {MTU} \
                             address {} netns {}",
                            p.ifname,
                            mac_string(&p.mac),
                            peer.ifname,
                            mac_string(&peer.mac),
                            self.switches[t]
                        );
                        ip_batch(sw_ns, format!("{line}\n"))?;
                    }
                    Peer::Switch(..) => {}
                }
                batches[si].push_str(&format!("link set {} up\n", p.ifname));
            }
        }
        for (si, b) in batches.into_iter().enumerate() {
            if !b.is_empty() {
                ip_batch(&self.switches[si], b)?;
            }
        }
        Ok(())
    }

    fn configure_hosts(&self, topo: &Topology) -> Result<(), TestbedError> {
        for (i, h) in topo.hosts.iter().enumerate() {
            let ns = &self.hosts[i];
            let gw_mac = mac_string(&topo.switches[h.switch].ports[h.port].mac);
            let mut b = format!(
                "addr add {}/32 dev {HOST_IFNAME}\nlink set {HOST_IFNAME} up\n\
                 neigh replace {GATEWAY} lladdr {gw_mac} dev {HOST_IFNAME} nud permanent\n\
                 route add 198.18.0.0/15 via {GATEWAY} dev {HOST_IFNAME} onlink\n",
                h.ip
            );
            // Entries for the other hosts are what an AF_XDP sender (which resolves the
            // destination itself) finds in the neighbour table; the kernel routes via the
            // gateway and never uses them.
            for o in topo.hosts.iter().filter(|o| o.ip != h.ip) {
                b.push_str(&format!(
                    "neigh replace {} lladdr {gw_mac} dev {HOST_IFNAME} nud permanent\n",
                    o.ip
                ));
            }
            ip_batch(ns, b)?;
            exec_in_netns(
                ns,
                &["ethtool", "-K", HOST_IFNAME, "tx", "off"],
                Duration::from_secs(10),
            )?;
            // The host's NIC: its egress runs at the link rate too. The switch shapes the
            // other direction; without this a host could offer more than its link carries.
            let link = &topo.switches[h.switch].ports[h.port].link;
            let rate = format!("{}bit", link.rate_bps);
            // A quarter millisecond of line rate, at least two full frames.
            let burst = (link.rate_bps / 8 / 4000).max(2 * 1514).to_string();
            exec_in_netns(
                ns,
                &[
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    HOST_IFNAME,
                    "root",
                    "tbf",
                    "rate",
                    &rate,
                    "burst",
                    &burst,
                    "latency",
                    "50ms",
                ],
                Duration::from_secs(10),
            )?;
        }
        Ok(())
    }

    /// The prefix of every namespace name.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Namespace of host `i` (in topology order).
    pub fn host_ns(&self, i: usize) -> Option<&str> {
        self.hosts.get(i).map(String::as_str)
    }

    /// Namespaces of the hosts, in topology order.
    pub fn host_namespaces(&self) -> &[String] {
        &self.hosts
    }

    /// Namespaces of the switches, in topology order.
    pub fn switch_namespaces(&self) -> &[String] {
        &self.switches
    }

    /// Removes everything, reporting every problem.
    pub fn down(mut self) -> Result<(), TestbedError> {
        self.keep = false;
        let errors = self.teardown();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(TestbedError::Cleanup(errors))
        }
    }

    fn teardown(&mut self) -> Vec<TestbedError> {
        if self.torn_down || self.keep {
            return Vec::new();
        }
        self.torn_down = true;
        // Deleting a namespace destroys its veths (and detaches their XDP programs) even if a
        // socket keeps the namespace object alive a little longer.
        let errors: Vec<TestbedError> = self
            .created
            .iter()
            .rev()
            .filter_map(|ns| delete_netns(ns).err())
            .collect();
        if let Some(r) = self.reaper.take() {
            r.finish(errors.is_empty());
        }
        errors
    }
}

impl Drop for FabricNet {
    fn drop(&mut self) {
        for e in self.teardown() {
            eprintln!("gradwire fabric: teardown: {e}");
        }
    }
}

fn node_names(topo: &Topology) -> Vec<String> {
    topo.switches
        .iter()
        .map(|s| s.name.clone())
        .chain(topo.hosts.iter().map(|h| h.name.clone()))
        .collect()
}
