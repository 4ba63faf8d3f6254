//! The peers of an [`XdpIo`]: [`XdpIo::allow_peers`] puts exactly the job's addresses in the
//! XDP classifier's allowlist and resolves each new peer's Ethernet address once, up front,
//! so the progress thread never waits for ARP.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::{XdpIo, XdpIoError};

/// How long [`XdpIo::allow_peers`] waits for each peer's Ethernet address.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(1);

impl XdpIo {
    /// Makes the classifier's allowlist hold exactly the IP addresses of `peers` (this
    /// socket's own address, if given, is left out), so that datagrams to our port from any
    /// other address are dropped in XDP and never reach user space. Call it with every rank's
    /// address before starting the endpoint, and again whenever the job's peers change.
    ///
    /// The classifier filters by IP address: a datagram from a peer's address but another
    /// port gets through and is refused by the endpoint (counted as from an unknown source).
    ///
    /// Each new peer's Ethernet address is resolved here, once (IPv4: the kernel's ARP table
    /// of the calling thread's network namespace, waiting up to a second per peer; IPv6:
    /// [`XdpIoConfig::neighbors`](super::XdpIoConfig::neighbors)), so the thread that sends
    /// never waits for it, whatever namespace it runs in. A peer without one, or of the other
    /// address family, is an error before anything is changed.
    pub fn allow_peers(&mut self, peers: &[SocketAddr]) -> Result<(), XdpIoError> {
        let mine = self.local.ip();
        let mut want = BTreeSet::new();
        for &peer in peers {
            let ip = peer.ip().to_canonical();
            if ip == mine {
                continue;
            }
            let reason = if ip.is_ipv4() != mine.is_ipv4() {
                Some(
                    "of the other address family: an AF_XDP socket reaches peers of its own \
                     family only",
                )
            } else if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
                Some("not a host's address")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(XdpIoError::Peer {
                    local: self.local,
                    peer,
                    reason,
                });
            }
            want.insert(ip);
        }
        let mut found = Vec::new();
        for &ip in want.difference(&self.allowed) {
            if self.statics.contains(&ip) {
                continue;
            }
            match gradwire::afxdp::neigh::resolve(ip, RESOLVE_TIMEOUT) {
                Some(mac) => found.push((ip, mac)),
                None => {
                    return Err(XdpIoError::NoNeighbor {
                        ifname: self.ifname.clone(),
                        peer: ip,
                    })
                }
            }
        }
        if self.allowlist {
            let err = |source| XdpIoError::Allowlist {
                ifname: self.ifname.clone(),
                source,
            };
            let xdp = self.dp.xdp();
            for &ip in want.difference(&self.allowed) {
                xdp.allow(ip).map_err(err)?;
            }
            for &ip in self.allowed.difference(&want) {
                xdp.disallow(ip).map_err(err)?;
            }
        }
        for (ip, mac) in found {
            self.dp.add_neighbor(ip, mac);
        }
        self.allowed = want;
        self.unreachable.clear();
        Ok(())
    }

    /// The peer addresses [`XdpIo::allow_peers`] last set.
    pub fn allowed_peers(&self) -> Vec<IpAddr> {
        self.allowed.iter().copied().collect()
    }
}
