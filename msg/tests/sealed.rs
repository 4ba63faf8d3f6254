//! Authenticated endpoints: every datagram sealed with its pair of ranks' key.
//!
//! The attack test sends a data segment with a forged source address (rank 1's, from a raw
//! socket: root) to rank 0 while it waits for rank 1's message. Against plain endpoints it
//! works: rank 0 takes the forged bytes as rank 1's (the test asserts that too, so the attack
//! is shown to be real). Against sealed endpoints the datagram is refused and counted, and
//! rank 0 gets rank 1's real message.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use gradwire_msg::core::{RecvOpts, SendOpts};
use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
use gradwire_msg::mem::Region;
use gradwire_msg::p2p::{Recv, Send};
use gradwire_msg::wire::{DataHeader, DATA_HEADER_LEN};
use gradwire_proto::auth::{JobKey, JobSecret, MemberEntry};

const JOB: u32 = 11;

fn job_key(fill: u8) -> Arc<JobKey> {
    Arc::new(JobKey::new(&JobSecret::new(vec![fill; 32]).unwrap()))
}

/// `n` ranks at 127.0.0.(r+1), sealed with `keys[r]` where given.
fn ranks(keys: &[Option<Arc<JobKey>>]) -> Vec<Result<Endpoint, String>> {
    let n = keys.len() as u16;
    let bound: Vec<_> = (0..n)
        .map(|r| {
            let ip = Ipv4Addr::new(127, 0, 0, r as u8 + 1);
            let mut c = EndpointConfig::new(JOB, r, n, SocketAddr::new(ip.into(), 0));
            c.core.peer_timeout = Duration::from_secs(2);
            c.auth = keys[usize::from(r)].clone();
            Endpoint::bind(c).unwrap()
        })
        .collect();
    let addrs: Vec<SocketAddr> = bound.iter().map(|b| b.local_addr()).collect();
    let members: Vec<Option<MemberEntry>> = bound.iter().map(|b| b.member()).collect();
    bound
        .into_iter()
        .map(|b| match b.member() {
            None => b.start(addrs.clone()).map_err(|e| e.to_string()),
            Some(_) => b
                .start_sealed(addrs.clone(), &members)
                .map_err(|e| e.to_string()),
        })
        .collect()
}

fn all_ok(eps: Vec<Result<Endpoint, String>>) -> Vec<Endpoint> {
    eps.into_iter().map(|e| e.unwrap()).collect()
}

/// Sends `payload` as segment 0 of message 0 from rank 1 to rank 0, from rank 1's address
/// (a raw socket writing its own IPv4 header).
fn forge_from(src: SocketAddr, dst: SocketAddr, payload: &[u8]) {
    let h = DataHeader {
        job: JOB,
        src: 1,
        dst: 0,
        msg: 0,
        total: payload.len() as u32,
        length: payload.len() as u16,
        ..DataHeader::default()
    };
    let mut hdr = [0u8; DATA_HEADER_LEN];
    h.emit(&mut hdr);
    let body = [&hdr[..], payload].concat();
    let (SocketAddr::V4(s), SocketAddr::V4(d)) = (src, dst) else {
        panic!("IPv4 only")
    };
    let udp_len = 8 + body.len();
    let mut pkt = vec![0u8; 20];
    pkt[0] = 0x45;
    pkt[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
    pkt[8] = 64;
    pkt[9] = 17;
    pkt[12..16].copy_from_slice(&s.ip().octets());
    pkt[16..20].copy_from_slice(&d.ip().octets());
    pkt.extend_from_slice(&s.port().to_be_bytes());
    pkt.extend_from_slice(&d.port().to_be_bytes());
    pkt.extend_from_slice(&(udp_len as u16).to_be_bytes());
    pkt.extend_from_slice(&[0, 0]); // no UDP checksum (allowed over IPv4)
    pkt.extend_from_slice(&body);
    let raw = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::UDP),
    )
    .unwrap();
    raw.set_header_included_v4(true).unwrap();
    let to = SocketAddr::V4(SocketAddrV4::new(*d.ip(), 0));
    raw.send_to(&pkt, &to.into()).unwrap();
}

/// Rank 0 waits for 8 bytes from rank 1; the forger sends `FORGED!!` as rank 1 first, then
/// the real rank 1 sends `genuine!`. Returns what rank 0 got and its endpoint's counters.
fn race(eps: &[Endpoint]) -> (Vec<u8>, gradwire_msg::endpoint::EndpointStats) {
    let wait = Duration::from_secs(10);
    let recv = eps[0].submit(Recv::new(Region::owned(vec![0; 8]), 1, RecvOpts::default()));
    std::thread::sleep(Duration::from_millis(50));
    forge_from(eps[1].local_addr(), eps[0].local_addr(), b"FORGED!!");
    std::thread::sleep(Duration::from_millis(50));
    let send = eps[1].submit(Send::new(
        Region::owned(b"genuine!".to_vec()),
        0,
        SendOpts::default(),
    ));
    let (region, _) = recv.wait_timeout(wait).unwrap().unwrap();
    send.wait_timeout(wait).unwrap().unwrap();
    (region.unwrap().as_slice().to_vec(), eps[0].stats())
}

#[test]
fn a_forged_source_address_reaches_a_plain_endpoint_but_not_a_sealed_one() {
    if !gradwire_netns::require_root("a_forged_source_address_reaches_a_plain_endpoint") {
        return;
    }
    // Plain: the attack works (what the message layer did before sealing).
    let (got, _) = race(&all_ok(ranks(&[None, None])));
    assert_eq!(
        got, b"FORGED!!",
        "the plain endpoint should take the forgery"
    );
    // Sealed: refused and counted, the real message arrives.
    let k = job_key(1);
    let (got, stats) = race(&all_ok(ranks(&[Some(k.clone()), Some(k)])));
    assert_eq!(got, b"genuine!");
    assert_eq!(stats.unauthenticated, 1, "{stats:?}");
    assert_eq!(stats.core.refused, 0, "nothing unopened reached the core");
}

#[test]
fn a_sealed_job_moves_data_exactly_under_loss() {
    let k = job_key(2);
    let eps = all_ok(ranks(&[Some(k.clone()), Some(k.clone()), Some(k)]));
    let wait = Duration::from_secs(20);
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
    // Rank 2 sends to rank 0 and rank 0 to rank 1, at once.
    let s1 = eps[2].submit(Send::new(
        Region::owned(data.clone()),
        0,
        SendOpts::default(),
    ));
    let s2 = eps[0].submit(Send::new(
        Region::owned(data.clone()),
        1,
        SendOpts::default(),
    ));
    for (ep, from) in [(&eps[0], 2), (&eps[1], 0)] {
        let (r, report) = ep
            .run(
                Recv::new(
                    Region::owned(vec![0; data.len()]),
                    from,
                    RecvOpts::default(),
                ),
                wait,
            )
            .unwrap();
        assert_eq!(report.missing, 0);
        assert!(r.unwrap().as_slice() == &data[..], "bytes differ");
    }
    s1.wait_timeout(wait).unwrap().unwrap();
    s2.wait_timeout(wait).unwrap().unwrap();
    for ep in &eps {
        let st = ep.stats();
        assert_eq!(
            (st.unauthenticated, st.replayed, st.core.refused),
            (0, 0, 0)
        );
    }
}

#[test]
fn ranks_with_different_secrets_or_none_do_not_start_or_talk() {
    // Another secret: the member key's proof fails at start, naming the rank.
    let eps = ranks(&[Some(job_key(1)), Some(job_key(2))]);
    for (r, e) in eps.iter().enumerate() {
        let err = e.as_ref().unwrap_err();
        assert!(err.contains(&format!("rank {}", 1 - r)), "{err}");
        assert!(err.contains("same secret"), "{err}");
    }
    // A plain endpoint cannot start sealed, nor a sealed one plain.
    let mut c = EndpointConfig::new(
        JOB,
        0,
        1,
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
    );
    let plain = Endpoint::bind(c.clone()).unwrap();
    assert!(plain.member().is_none());
    assert!(plain.start_sealed(vec![], &[]).is_err());
    c.auth = Some(job_key(1));
    let sealed = Endpoint::bind(c).unwrap();
    let addr = sealed.local_addr();
    let err = sealed.start(vec![addr]).unwrap_err().to_string();
    assert!(err.contains("start_sealed"), "{err}");
}
