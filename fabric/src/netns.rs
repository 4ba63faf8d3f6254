//! Building a [`Topology`] out of network namespaces and veth pairs, with the namespace kit
//! ([`gradwire_netns`]): this module maps the topology onto namespaces, the kit provides every
//! namespace, veth, neighbour, shaping and teardown primitive.
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
//! [`FabricNet::up`] builds temporary namespaces (a fresh kit prefix, a reaper, removed on
//! drop); [`FabricNet::up_persistent`] builds them under a prefix its caller chooses and leaves
//! them in place. Teardown follows the kit's teardown rule.

use std::net::IpAddr;
use std::time::Duration;

use gradwire_netns::link::{disable_tx_checksum_offload, shape_egress};
use gradwire_netns::{
    delete_netns, new_netns_prefix, IpBatch, NamespaceSet, NetnsError, Veth, VethEnd,
};

use crate::topology::{Peer, Topology, GATEWAY, HOST_IFNAME};

/// MTU of every interface.
pub const MTU: u32 = 1500;

/// Namespaces of a built topology.
#[derive(Debug)]
pub struct FabricNet {
    prefix: String,
    hosts: Vec<String>,
    switches: Vec<String>,
    namespaces: NamespaceSet,
}

/// Namespace name of `node` under `prefix`.
pub fn ns_name(prefix: &str, node: &str) -> String {
    format!("{prefix}-{node}")
}

impl FabricNet {
    /// Builds `topo` in temporary namespaces (a fresh per-process prefix, with a reaper): for
    /// tests and for processes that run the fabric themselves. Removed on drop.
    pub fn up(topo: &Topology) -> Result<FabricNet, NetnsError> {
        let prefix = new_netns_prefix();
        let names = all_names(topo, &prefix);
        let set = NamespaceSet::temporary("gradwire fabric", &names)?;
        Self::build(topo, prefix, set)
    }

    /// Builds `topo` under `prefix` and leaves it in place when dropped
    /// ([`FabricNet::down_by_name`] or [`FabricNet::down`] removes it). Fails with
    /// [`NetnsError::AlreadyExists`] if a namespace of that name exists. `label` starts the
    /// warnings printed to stderr.
    pub fn up_persistent(
        topo: &Topology,
        prefix: &str,
        label: &str,
    ) -> Result<FabricNet, NetnsError> {
        let names = all_names(topo, prefix);
        let set = NamespaceSet::persistent(label, &names)?;
        Self::build(topo, prefix.to_owned(), set)
    }

    /// Deletes every namespace of `topo` under `prefix`; returns how many existed.
    pub fn down_by_name(topo: &Topology, prefix: &str) -> Result<usize, NetnsError> {
        let mut n = 0;
        let mut errors = Vec::new();
        for ns in all_names(topo, prefix) {
            match delete_netns(&ns) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => errors.push(e),
            }
        }
        NetnsError::from_cleanup(errors).map(|()| n)
    }

    fn build(topo: &Topology, prefix: String, set: NamespaceSet) -> Result<FabricNet, NetnsError> {
        let net = FabricNet {
            hosts: topo
                .hosts
                .iter()
                .map(|h| ns_name(&prefix, &h.name))
                .collect(),
            switches: topo
                .switches
                .iter()
                .map(|s| ns_name(&prefix, &s.name))
                .collect(),
            prefix,
            namespaces: set,
        };
        // From here on, an error drops `net`, which removes what exists (also when persistent:
        // the set only becomes persistent once it is complete).
        net.wire(topo)?;
        net.configure_hosts(topo)?;
        Ok(net)
    }

    fn wire(&self, topo: &Topology) -> Result<(), NetnsError> {
        let mut batches: Vec<IpBatch> = vec![IpBatch::new(); self.switches.len()];
        for (si, s) in topo.switches.iter().enumerate() {
            for (pi, p) in s.ports.iter().enumerate() {
                let port = VethEnd {
                    netns: &self.switches[si],
                    ifname: &p.ifname,
                    mac: Some(p.mac),
                };
                match p.peer {
                    // Created inside the host namespace with its peer placed directly into the
                    // switch's: the fixed names never meet in the root namespace.
                    Peer::Host(h) => pair(
                        VethEnd {
                            netns: &self.hosts[h],
                            ifname: HOST_IFNAME,
                            mac: Some(topo.hosts[h].mac),
                        },
                        port,
                    )
                    .create()?,
                    // Each switch-switch link once, from its lower end.
                    Peer::Switch(t, tp) if (si, pi) < (t, tp) => {
                        let peer = &topo.switches[t].ports[tp];
                        let far = VethEnd {
                            netns: &self.switches[t],
                            ifname: &peer.ifname,
                            mac: Some(peer.mac),
                        };
                        pair(port, far).create()?;
                    }
                    Peer::Switch(..) => {}
                }
                batches[si].up(&p.ifname);
            }
        }
        for (si, b) in batches.iter().enumerate() {
            if !b.is_empty() {
                b.apply(&self.switches[si])?;
            }
        }
        Ok(())
    }

    fn configure_hosts(&self, topo: &Topology) -> Result<(), NetnsError> {
        for (i, h) in topo.hosts.iter().enumerate() {
            let ns = &self.hosts[i];
            let gw_mac = topo.switches[h.switch].ports[h.port].mac;
            let mut b = IpBatch::new();
            b.addr(HOST_IFNAME, IpAddr::V4(h.ip), 32)
                .up(HOST_IFNAME)
                .neighbour(HOST_IFNAME, IpAddr::V4(GATEWAY), &gw_mac)
                .route_onlink(HOST_IFNAME, "198.18.0.0/15", IpAddr::V4(GATEWAY));
            // Entries for the other hosts are what an AF_XDP sender (which resolves the
            // destination itself) finds in the neighbour table; the kernel routes via the
            // gateway and never uses them.
            for o in topo.hosts.iter().filter(|o| o.ip != h.ip) {
                b.neighbour(HOST_IFNAME, IpAddr::V4(o.ip), &gw_mac);
            }
            b.apply(ns)?;
            disable_tx_checksum_offload(ns, HOST_IFNAME)?;
            // The host's NIC: its egress runs at the link rate too. The switch shapes the
            // other direction; without this a host could offer more than its link carries.
            let link = &topo.switches[h.switch].ports[h.port].link;
            // A quarter millisecond of line rate, at least two full frames.
            let burst = (link.rate_bps / 8 / 4000).max(2 * 1514);
            shape_egress(
                ns,
                HOST_IFNAME,
                link.rate_bps,
                burst,
                Duration::from_millis(50),
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

    /// Removes everything (persistent or not), reporting every problem.
    pub fn down(self) -> Result<(), NetnsError> {
        self.namespaces.down()
    }
}

/// Switches first, then hosts: the order the namespaces are created in.
fn all_names(topo: &Topology, prefix: &str) -> Vec<String> {
    topo.switches
        .iter()
        .map(|s| &s.name)
        .chain(topo.hosts.iter().map(|h| &h.name))
        .map(|node| ns_name(prefix, node))
        .collect()
}

/// A veth pair of [`MTU`] from `a` to `b`, with the kernel's default queue count.
fn pair<'a>(a: VethEnd<'a>, b: VethEnd<'a>) -> Veth<'a> {
    Veth {
        a,
        b,
        mtu: Some(MTU),
        queues: None,
    }
}
