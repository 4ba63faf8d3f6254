//! Set-up: the node's endpoint bound, and the endpoint addresses exchanged over the links
//! (their only use).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use gradwire::auth::{JobKey, MemberEntry, MEMBER_ENTRY_LEN};
use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::tensor::Tensor;
use gradwire::transport::{MissingFill, RecvOptions, SendOptions};
use gradwire_msg::endpoint::{Bound, Endpoint, EndpointConfig};

use crate::error::CollectiveError;
use crate::link::{InLink, Links, OutLink};
use crate::ps::state::{raw_tensor, Ctx};
use crate::ps::types::PsError;

/// Flow id of the set-up exchange of endpoint addresses (kind 7, as the parameter server's
/// flows always had).
const T_ADDR: u32 = 7 << 27;
/// Bytes of an address in the exchange: its text, zero-padded.
const ADDR_LEN: usize = 64;
/// Bytes of the exchange: the address, then the node's member entry (its X25519 public key
/// and proof; zeros in a plain job).
const EXCHANGE_LEN: usize = ADDR_LEN + MEMBER_ENTRY_LEN;
/// Binds the node's endpoint for `rank` of `world` in `job`, on the address this host sends
/// to `toward` (a neighbour) from; the layer fails a message whose peer says nothing about
/// it for `peer_timeout`, naming the peer. With the job key of authenticated links, every
/// datagram of the endpoint is sealed with its pair of ranks' key.
#[allow(clippy::too_many_arguments)]
pub(in crate::ps) fn bind(
    toward: IpAddr,
    job: u32,
    rank: usize,
    world: usize,
    mtu: usize,
    peer_timeout: Duration,
    inject_loss: f64,
    key: Option<Arc<JobKey>>,
) -> Result<Bound, PsError> {
    let (Ok(r), Ok(w)) = (u16::try_from(rank), u16::try_from(world)) else {
        return Err(PsError::Config(format!(
            "a {world}-rank job is too large for the message layer (at most {} ranks)",
            u16::MAX
        )));
    };
    let ip = local_ip_towards(toward).map_err(|e| {
        PsError::Config(format!(
            "no local address routes to {toward} (a neighbour's link address): {e}"
        ))
    })?;
    let mut cfg = EndpointConfig::new(job, r, w, SocketAddr::new(ip, 0));
    cfg.core.peer_timeout = peer_timeout;
    cfg.mtu = mtu;
    cfg.inject_loss = inject_loss;
    cfg.seed = u64::from(job);
    cfg.auth = key;
    Endpoint::bind(cfg).map_err(|e| {
        PsError::Config(format!(
            "the node's message-layer socket on {ip}: {e} (is {ip} an address of this host?)"
        ))
    })
}

/// The source address this host uses toward `dst` (connecting a UDP socket sends nothing).
fn local_ip_towards(dst: IpAddr) -> std::io::Result<IpAddr> {
    let any: IpAddr = if dst.is_ipv6() {
        Ipv6Addr::UNSPECIFIED.into()
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    };
    let s = UdpSocket::bind((any, 0))?;
    s.connect((dst, 9))?;
    Ok(s.local_addr()?.ip())
}

/// Sends this node's endpoint address to every neighbour and reads theirs, over the links
/// (every link at once: a flow waits for its receiver, and a neighbour that never comes
/// must not hold up the others), with this node's member entry in an authenticated job.
/// Per peer: its address and entry, or why there is none.
pub(super) fn exchange(
    links: &mut Links,
    me: SocketAddr,
    member: Option<MemberEntry>,
    ctx: &Ctx,
) -> BTreeMap<usize, Result<(SocketAddr, Option<MemberEntry>), PsError>> {
    let mut got = BTreeMap::new();
    let (outs, ins) = match links.many(&ctx.peers, &ctx.peers) {
        Ok(x) => x,
        Err(e) => {
            for &p in &ctx.peers {
                got.insert(p, Err(PsError::Config(format!("links: {e}"))));
            }
            return got;
        }
    };
    let mut text = me.to_string().into_bytes();
    text.resize(ADDR_LEN, 0);
    if let Some(m) = member {
        text.extend_from_slice(&m.to_bytes());
    }
    text.resize(EXCHANGE_LEN, 0);
    let t = raw_tensor(&text);
    std::thread::scope(|s| {
        let sends: Vec<_> = outs
            .into_iter()
            .map(|ol| {
                let t = &t;
                s.spawn(move || (ol.peer(), send_addr(ol, t, ctx)))
            })
            .collect();
        let recvs: Vec<_> = ins
            .into_iter()
            .map(|il| s.spawn(move || (il.peer(), recv_addr(il, ctx))))
            .collect();
        for h in recvs {
            if let Ok((p, r)) = h.join() {
                got.insert(p, r);
            }
        }
        for h in sends {
            // A peer that did not take our address cannot reach us either.
            if let Ok((p, Err(e))) = h.join() {
                got.insert(p, Err(e));
            }
        }
    });
    for &p in &ctx.peers {
        got.entry(p)
            .or_insert(Err(CollectiveError::ThreadPanicked.into()));
    }
    got
}

fn send_addr(ol: &mut OutLink, t: &Tensor, ctx: &Ctx) -> Result<(), PsError> {
    let opts = SendOptions {
        job: ctx.job,
        tensor: T_ADDR,
        round: 0,
        layer: 0,
        stage: Stage::Pull,
        loss_bound: Some(LossBound::RELIABLE),
    };
    let prio = fixed_priority(Tag { dscp: 0, ect: true });
    let peer = ol.peer();
    ol.send(t, &opts, &prio, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?;
    Ok(())
}

fn recv_addr(il: &mut InLink, ctx: &Ctx) -> Result<(SocketAddr, Option<MemberEntry>), PsError> {
    let opts = RecvOptions {
        job: ctx.job,
        tensor: T_ADDR,
        round: Some(0),
        loss_bound: Some(LossBound::RELIABLE),
        fill: MissingFill::Zero,
        max_bytes: None,
    };
    let peer = il.peer();
    let mut t = raw_tensor(&[0u8; EXCHANGE_LEN]);
    il.recv(&mut t, &opts, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?;
    let (b, entry) = t.as_bytes().split_at(ADDR_LEN);
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let addr = std::str::from_utf8(&b[..end])
        .ok()
        .and_then(|s| s.parse::<SocketAddr>().ok())
        .filter(|a| !a.ip().is_unspecified() && a.port() != 0)
        .ok_or_else(|| PsError::Protocol {
            peer,
            what: "its endpoint address at set-up is not an address".into(),
        })?;
    // All zeros: a plain job's node.
    let member = entry
        .iter()
        .any(|&b| b != 0)
        .then(|| MemberEntry::from_bytes(entry))
        .flatten();
    Ok((addr, member))
}
