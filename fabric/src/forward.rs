//! L3 forwarding of one emulated switch: parse, route, rewrite. No I/O, no clock.
//!
//! A frame is forwarded when it is untagged Ethernet + IPv4 with a valid header checksum and a
//! TTL above 1, to a destination in the static table. The switch then decrements the TTL
//! (checksum updated incrementally, RFC 1624), rewrites the MAC addresses to (egress port,
//! next hop), picks the egress port among the equal-cost ones (per-flow hash or per-packet
//! round robin) and classifies the packet into a queue by its DSCP through the policy's map.
//! Everything else is dropped and counted by reason; nothing here panics on any input.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use gradwire_proto::wire::{ethernet, ipv4};

use crate::sched::{Frame, PacketMeta, NUM_QUEUES};
use crate::topology::Ecmp;

/// A frame owned by the switch while it is queued: a buffer and where its IPv4 header starts.
#[derive(Debug, Default)]
pub struct Pkt {
    /// The whole Ethernet frame.
    pub data: Vec<u8>,
}

impl Frame for Pkt {
    fn mark_ce(&mut self) {
        set_ce(&mut self.data);
    }
}

/// Sets the IPv4 ECN field of an untagged Ethernet frame to CE (11) and updates the header
/// checksum incrementally. Does nothing to a frame too short to hold the header.
pub fn set_ce(frame: &mut [u8]) {
    let off = ethernet::HEADER_LEN;
    let (Some(tos), Some(c0), Some(c1)) = (
        frame.get(off + 1).copied(),
        frame.get(off + 10).copied(),
        frame.get(off + 11).copied(),
    ) else {
        return;
    };
    let new_tos = tos | 0b11;
    if new_tos == tos {
        return;
    }
    // The TOS byte is the low byte of the header's first 16-bit word (version/IHL, TOS).
    let old_word = u16::from_be_bytes([frame[off], tos]);
    let new_word = u16::from_be_bytes([frame[off], new_tos]);
    let sum = update_checksum(u16::from_be_bytes([c0, c1]), old_word, new_word);
    frame[off + 1] = new_tos;
    frame[off + 10..off + 12].copy_from_slice(&sum.to_be_bytes());
}

/// RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m').
fn update_checksum(hc: u16, old: u16, new: u16) -> u16 {
    let mut s = u32::from(!hc) + u32::from(!old) + u32::from(new);
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// Why a frame was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Not IPv4 (ARP, IPv6, VLAN-tagged, ...).
    NotIpv4,
    /// Truncated or inconsistent Ethernet/IPv4 header, or bad header checksum.
    Malformed,
    /// TTL 0 or 1.
    TtlExpired,
    /// No route to the destination.
    NoRoute,
}

/// Per-switch drop counters of the forwarding stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ForwardCounters {
    /// Frames received on any port.
    pub rx: u64,
    /// Frames handed to an egress port.
    pub forwarded: u64,
    /// Not IPv4.
    pub not_ipv4: u64,
    /// Malformed.
    pub malformed: u64,
    /// TTL expired.
    pub ttl_expired: u64,
    /// No route.
    pub no_route: u64,
}

impl ForwardCounters {
    fn count(&mut self, r: DropReason) {
        match r {
            DropReason::NotIpv4 => self.not_ipv4 += 1,
            DropReason::Malformed => self.malformed += 1,
            DropReason::TtlExpired => self.ttl_expired += 1,
            DropReason::NoRoute => self.no_route += 1,
        }
    }
}

/// One egress choice: the port's MAC and its next hop's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortMacs {
    /// The egress port's own MAC (new source).
    pub own: [u8; 6],
    /// The next hop's MAC (new destination).
    pub peer: [u8; 6],
}

/// The forwarding state of one switch.
#[derive(Debug, Clone)]
pub struct Forwarder {
    routes: BTreeMap<Ipv4Addr, Vec<usize>>,
    ports: Vec<PortMacs>,
    dscp_to_queue: [u8; 64],
    ecmp: Ecmp,
    seed: u64,
    /// Per-destination round-robin position for [`Ecmp::Packet`].
    rr: BTreeMap<Ipv4Addr, usize>,
    counters: ForwardCounters,
}

impl Forwarder {
    /// A forwarder. `dscp_to_queue` entries above 7 are treated as queue 0.
    pub fn new(
        routes: BTreeMap<Ipv4Addr, Vec<usize>>,
        ports: Vec<PortMacs>,
        dscp_to_queue: &[u8],
        ecmp: Ecmp,
        seed: u64,
    ) -> Forwarder {
        let mut map = [0u8; 64];
        for (d, q) in dscp_to_queue.iter().take(64).enumerate() {
            map[d] = if usize::from(*q) < NUM_QUEUES { *q } else { 0 };
        }
        Forwarder {
            routes,
            ports,
            dscp_to_queue: map,
            ecmp,
            seed,
            rr: BTreeMap::new(),
            counters: ForwardCounters::default(),
        }
    }

    /// Counters so far.
    pub fn counters(&self) -> ForwardCounters {
        self.counters
    }

    /// Routes `frame` in place: on success returns the egress port and the queueing metadata,
    /// with TTL, checksum and MACs already rewritten; on failure the frame is unchanged and
    /// the reason counted.
    pub fn forward(&mut self, frame: &mut [u8]) -> Result<(usize, PacketMeta), DropReason> {
        self.counters.rx += 1;
        match self.route(frame) {
            Ok(r) => {
                self.counters.forwarded += 1;
                Ok(r)
            }
            Err(e) => {
                self.counters.count(e);
                Err(e)
            }
        }
    }

    fn route(&mut self, frame: &mut [u8]) -> Result<(usize, PacketMeta), DropReason> {
        let eth = ethernet::Packet::new_checked(&*frame).map_err(|_| DropReason::Malformed)?;
        if eth.ethertype() != ethernet::ethertype::IPV4 {
            return Err(DropReason::NotIpv4);
        }
        let l3 = frame
            .get(ethernet::HEADER_LEN..)
            .ok_or(DropReason::Malformed)?;
        let ip = ipv4::Packet::new_checked(l3).map_err(|_| DropReason::Malformed)?;
        if !ip.verify_checksum() {
            return Err(DropReason::Malformed);
        }
        if ip.hop_limit() <= 1 {
            return Err(DropReason::TtlExpired);
        }
        let dst = ip.dst_addr();
        let ports = self.routes.get(&dst).ok_or(DropReason::NoRoute)?;
        let n = ports.len();
        let pick = match (self.ecmp, n) {
            (_, 0) => return Err(DropReason::NoRoute),
            (_, 1) => 0,
            (Ecmp::Packet, _) => {
                let k = self.rr.entry(dst).or_insert(0);
                let i = *k % n;
                *k = k.wrapping_add(1);
                i
            }
            (Ecmp::Flow, _) => (flow_hash(l3, ip.header_len(), self.seed) % n as u64) as usize,
        };
        let port = *ports.get(pick).ok_or(DropReason::NoRoute)?;
        let macs = *self.ports.get(port).ok_or(DropReason::NoRoute)?;
        let dscp = ip.dscp();
        let ecn = ip.ecn().bits();
        let ttl = ip.hop_limit();
        let cksum = ip.checksum();
        let proto = ip.protocol();
        // Rewrite: TTL and checksum (TTL is the high byte of the TTL/protocol word).
        let old = u16::from_be_bytes([ttl, proto]);
        let new = u16::from_be_bytes([ttl - 1, proto]);
        let sum = update_checksum(cksum, old, new);
        let off = ethernet::HEADER_LEN;
        frame[off + 8] = ttl - 1;
        frame[off + 10..off + 12].copy_from_slice(&sum.to_be_bytes());
        frame[0..6].copy_from_slice(&macs.peer);
        frame[6..12].copy_from_slice(&macs.own);
        let meta = PacketMeta {
            len: frame.len() as u32,
            queue: self.dscp_to_queue[usize::from(dscp & 63)],
            ect: ecn != 0,
        };
        Ok((port, meta))
    }
}

/// Hash of (source, destination, protocol, and for unfragmented TCP/UDP the two ports):
/// FNV-1a over those bytes, seeded per switch so that two tiers do not polarise.
fn flow_hash(l3: &[u8], ihl: usize, seed: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(l3.get(12..20).unwrap_or(&[]));
    let proto = l3.get(9).copied().unwrap_or(0);
    eat(&[proto]);
    let frag = l3
        .get(6..8)
        .map(|b| u16::from_be_bytes([b[0], b[1]]) & 0x3fff != 0)
        .unwrap_or(true);
    if !frag && (proto == 6 || proto == 17) {
        eat(l3.get(ihl..ihl + 4).unwrap_or(&[]));
    }
    // Final avalanche so that the low bits used by `% n` depend on every input byte.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_proto::wire::frame::{emit_headers, header_len, FrameMeta};
    use gradwire_proto::wire::Ecn;
    use std::net::SocketAddr;

    fn udp_frame(dst: Ipv4Addr, sport: u16, dscp: u8, ecn: Ecn, ttl: u8) -> Vec<u8> {
        let payload = 100;
        let mut buf = vec![0u8; header_len(false) + payload];
        let fm = FrameMeta {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src: SocketAddr::from((Ipv4Addr::new(198, 18, 1, 0), sport)),
            dst: SocketAddr::from((dst, 7000)),
            dscp,
            ecn,
            hop_limit: ttl,
            ident: 1,
        };
        let n = emit_headers(&mut buf, &fm, payload).unwrap();
        buf.truncate(n);
        buf
    }

    fn fwd(ecmp: Ecmp) -> Forwarder {
        let dst = Ipv4Addr::new(198, 18, 1, 9);
        let routes = BTreeMap::from([(dst, vec![1, 2])]);
        let ports = (0..3)
            .map(|p| PortMacs {
                own: [2, 0x73, 0, 0, 0, p],
                peer: [2, 0x68, 0, 0, 0, p],
            })
            .collect();
        let q = crate::topology::default_policy();
        let map = gradwire_control::render::fabric::FabricQos::from_policy(&q)
            .unwrap()
            .dscp_to_queue;
        Forwarder::new(routes, ports, &map, ecmp, 7)
    }

    fn ip_checksum_ok(f: &[u8]) -> bool {
        ipv4::Packet::new_checked(&f[14..])
            .unwrap()
            .verify_checksum()
    }

    #[test]
    fn rewrites_ttl_macs_and_keeps_checksum_valid() {
        let mut f = fwd(Ecmp::Flow);
        let mut fr = udp_frame(Ipv4Addr::new(198, 18, 1, 9), 5000, 46, Ecn::Ect0, 64);
        let (port, meta) = f.forward(&mut fr).unwrap();
        assert!(port == 1 || port == 2);
        assert_eq!(&fr[0..6], &[2, 0x68, 0, 0, 0, port as u8]);
        assert_eq!(&fr[6..12], &[2, 0x73, 0, 0, 0, port as u8]);
        assert_eq!(fr[14 + 8], 63);
        assert!(ip_checksum_ok(&fr));
        assert_eq!(meta.queue, 6, "DSCP 46 is the front-layer queue");
        assert!(meta.ect);
        assert_eq!(meta.len as usize, fr.len());
        // CE marking keeps the checksum valid too.
        set_ce(&mut fr);
        assert_eq!(fr[15] & 3, 3);
        assert_eq!(fr[15] >> 2, 46);
        assert!(ip_checksum_ok(&fr));
    }

    #[test]
    fn per_packet_alternates_and_per_flow_sticks() {
        let dst = Ipv4Addr::new(198, 18, 1, 9);
        let mut f = fwd(Ecmp::Packet);
        let ports: Vec<usize> = (0..6)
            .map(|_| {
                f.forward(&mut udp_frame(dst, 5000, 0, Ecn::NotEct, 64))
                    .unwrap()
                    .0
            })
            .collect();
        assert_eq!(ports, vec![1, 2, 1, 2, 1, 2]);
        let mut f = fwd(Ecmp::Flow);
        let first = f
            .forward(&mut udp_frame(dst, 5000, 0, Ecn::NotEct, 64))
            .unwrap()
            .0;
        for _ in 0..10 {
            assert_eq!(
                f.forward(&mut udp_frame(dst, 5000, 0, Ecn::NotEct, 64))
                    .unwrap()
                    .0,
                first
            );
        }
        // Many flows use both ports.
        let used: std::collections::BTreeSet<usize> = (0..64)
            .map(|sp| {
                f.forward(&mut udp_frame(dst, 6000 + sp, 0, Ecn::NotEct, 64))
                    .unwrap()
                    .0
            })
            .collect();
        assert_eq!(used.len(), 2);
    }

    #[test]
    fn drops_are_counted_by_reason_and_leave_the_frame_alone() {
        let mut f = fwd(Ecmp::Flow);
        let mut ttl1 = udp_frame(Ipv4Addr::new(198, 18, 1, 9), 1, 0, Ecn::NotEct, 1);
        let before = ttl1.clone();
        assert_eq!(f.forward(&mut ttl1), Err(DropReason::TtlExpired));
        assert_eq!(ttl1, before);
        let mut unknown = udp_frame(Ipv4Addr::new(198, 18, 7, 7), 1, 0, Ecn::NotEct, 9);
        assert_eq!(f.forward(&mut unknown), Err(DropReason::NoRoute));
        let mut bad = udp_frame(Ipv4Addr::new(198, 18, 1, 9), 1, 0, Ecn::NotEct, 9);
        bad[14 + 10] ^= 0xff;
        assert_eq!(f.forward(&mut bad), Err(DropReason::Malformed));
        let mut arp = vec![0u8; 42];
        arp[12] = 0x08;
        arp[13] = 0x06;
        assert_eq!(f.forward(&mut arp), Err(DropReason::NotIpv4));
        assert_eq!(f.forward(&mut [0u8; 5][..]), Err(DropReason::Malformed));
        let c = f.counters();
        assert_eq!(
            (
                c.rx,
                c.forwarded,
                c.ttl_expired,
                c.no_route,
                c.malformed,
                c.not_ipv4
            ),
            (5, 0, 1, 1, 2, 1)
        );
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(mut bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let mut f = fwd(Ecmp::Flow);
            let _ = f.forward(&mut bytes);
            set_ce(&mut bytes);
        }
    }
}
