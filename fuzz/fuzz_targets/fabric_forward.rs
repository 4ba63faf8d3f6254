//! Fuzzes the emulated switch's per-frame path on raw frames, as its AF_XDP ports see them:
//! `Forwarder::forward` (Ethernet/IPv4 parse, checksum, TTL, route, ECMP, rewrite) and, for a
//! forwarded frame, CE marking and admission into an egress port.
//!
//! Properties checked:
//! - nothing panics on any input;
//! - a forwarded frame is still valid IPv4 (its header checksum verifies) with TTL one lower,
//!   before and after CE marking, and its length is unchanged;
//! - a dropped frame is left exactly as it was.
#![no_main]

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use gradwire_proto::wire::ipv4;
use gradwire_fabric::forward::{set_ce, Forwarder, Pkt, PortMacs};
use gradwire_fabric::sched::{EgressPort, PortConfig};
use gradwire_fabric::topology::Ecmp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, frame)) = data.split_first() else {
        return;
    };
    // Routes for the whole 198.18.1.0/29 over two or three ports, so random frames reach the
    // rewrite path often.
    let routes: BTreeMap<Ipv4Addr, Vec<usize>> = (0..8u8)
        .map(|i| (Ipv4Addr::new(198, 18, 1, i), vec![usize::from(i % 3), 2]))
        .collect();
    let ports = (0..3u8)
        .map(|p| PortMacs {
            own: [2, 0x73, 0, 0, 0, p],
            peer: [2, 0x68, 0, 0, 0, p],
        })
        .collect();
    let map: Vec<u8> = (0..64u8).map(|d| d % 9).collect();
    let ecmp = if mode & 1 == 0 { Ecmp::Flow } else { Ecmp::Packet };
    let mut f = Forwarder::new(routes, ports, &map, ecmp, u64::from(mode));
    let mut buf = frame.to_vec();
    match f.forward(&mut buf) {
        Err(_) => assert_eq!(buf, frame, "a dropped frame must be unchanged"),
        Ok((port, meta)) => {
            assert!(port < 3);
            assert_eq!(meta.len as usize, frame.len());
            let ip = ipv4::Packet::new_checked(&buf[14..]).expect("forwarded frame is IPv4");
            assert!(ip.verify_checksum(), "checksum after TTL rewrite");
            assert_eq!(ip.hop_limit() + 1, frame[14 + 8]);
            let mut marked = buf.clone();
            set_ce(&mut marked);
            let ip = ipv4::Packet::new_checked(&marked[14..]).expect("still IPv4");
            assert!(ip.verify_checksum(), "checksum after CE");
            let mut cfg = PortConfig::default();
            cfg.thresholds = [Some(1); 8];
            let mut eg: EgressPort<Pkt> = EgressPort::new(cfg).expect("valid port");
            for t in 0..3u64 {
                let _ = eg.enqueue(t, meta, Pkt { data: buf.clone() });
            }
            while eg.poll(u64::MAX).is_some() {}
        }
    }
});
