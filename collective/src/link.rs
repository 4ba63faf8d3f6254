//! Links: one directed transport connection (a control channel and a datapath at each end)
//! from one rank to another, for every pair of ranks an algorithm makes talk.
//!
//! A link carries one flow at a time, in the order both ends agree on (the algorithms are
//! deterministic), so the flow ids only confirm what both sides expect. Links are set up
//! once per communicator:
//!
//! - in memory ([`Links::in_memory`]): loopback datapaths and in-memory control channels,
//!   with optional fault injection on every receiving datapath, for tests;
//! - over the network ([`Links::connect`]): each rank binds a control listener and a UDP
//!   datapath per incoming link on its own address, publishes the listeners' ports through
//!   the rendezvous, then connects its outgoing links. A per-link listener means the peer
//!   on the other end is known by construction; its address is also checked against the
//!   rendezvous table, so a stranger that reaches the port is refused with a clear error.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire::auth::{JobKey, JobSecret, MemberEntry, MEMBER_PROOF_LEN, PUBLIC_LEN};
use gradwire::ctrl_channel::{fresh_link_token, CtrlChannel, MemCtrl, TcpCtrl};
use gradwire::ctrl_listener::{CtrlListener, ListenerConfig};
use gradwire::datapath::fault::{FaultConfig, FaultInjector};
use gradwire::datapath::loopback::Loopback;
use gradwire::datapath::udp::{UdpConfig, UdpDatapath};
use gradwire::datapath::Datapath;
use gradwire::flow::PriorityFn;
use gradwire::tensor::{segment_payload_for, DType, Tensor};
use gradwire::transport::{
    recv_tensor, send_tensor, RecvOptions, RecvReport, SendOptions, SendReport, TransferConfig,
    TransferError,
};

use crate::error::CollectiveError;
use crate::rendezvous::{self, RendezvousConfig};
use crate::tree::Tree;

/// A datapath a link owns.
pub type BoxDatapath = Box<dyn Datapath + Send>;
/// A control channel a link owns.
pub type BoxCtrl = Box<dyn CtrlChannel + Send>;

/// The sending end of a directed link.
pub struct OutLink {
    peer: usize,
    dp: BoxDatapath,
    ctrl: BoxCtrl,
    dst: IpAddr,
    /// The rate the previous flow ended at: the next one starts there (rate memory).
    last_rate_bps: Option<u64>,
}

impl std::fmt::Debug for OutLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OutLink(to rank {} at {})", self.peer, self.dst)
    }
}

impl OutLink {
    /// The rank at the other end.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The peer's address this link sends to.
    pub fn dst(&self) -> IpAddr {
        self.dst
    }

    /// Payload bytes of each segment of a `dtype` tensor sent over this link: what the
    /// transport's sender will choose (an authenticated link makes room for the tag).
    pub fn segment_payload(&self, dtype: DType, mtu: usize) -> Option<usize> {
        let tag = if self.ctrl.session().is_some() {
            gradwire::wire::header::TAG_LEN
        } else {
            0
        };
        segment_payload_for(
            mtu.saturating_sub(tag),
            self.dst.is_ipv6(),
            dtype,
            self.dp.max_datagram().saturating_sub(tag),
        )
    }

    /// Send one tensor over the link.
    pub fn send(
        &mut self,
        tensor: &Tensor,
        opts: &SendOptions,
        prio: &PriorityFn<'_>,
        cfg: &TransferConfig,
    ) -> Result<SendReport, TransferError> {
        let mut cfg = cfg.clone();
        if cfg.rate_memory && cfg.sender.initial_rate_bps.is_none() {
            cfg.sender.initial_rate_bps = self.last_rate_bps;
        }
        let r = send_tensor(
            &mut *self.dp,
            &mut *self.ctrl,
            self.dst,
            tensor,
            opts,
            prio,
            &cfg,
        )?;
        self.last_rate_bps = Some(r.final_rate_bps);
        Ok(r)
    }
}

/// The receiving end of a directed link.
pub struct InLink {
    peer: usize,
    dp: BoxDatapath,
    ctrl: BoxCtrl,
}

impl std::fmt::Debug for InLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InLink(from rank {})", self.peer)
    }
}

impl InLink {
    /// The rank at the other end.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Receive one tensor over the link.
    pub fn recv(
        &mut self,
        tensor: &mut Tensor,
        opts: &RecvOptions,
        cfg: &TransferConfig,
    ) -> Result<RecvReport, TransferError> {
        recv_tensor(&mut *self.dp, &mut *self.ctrl, tensor, opts, cfg)
    }
}

/// Directed edges `(from, to)` of a ring over `world` ranks (both directions are not needed:
/// ring algorithms send to the next rank only).
pub fn ring_edges(world: usize) -> Vec<(usize, usize)> {
    if world < 2 {
        return Vec::new();
    }
    (0..world).map(|r| (r, (r + 1) % world)).collect()
}

/// Directed edges `(from, to)` of a tree in both directions: children push up, parents
/// multicast down.
pub fn tree_edges(tree: &Tree) -> Vec<(usize, usize)> {
    tree.edges()
        .into_iter()
        .flat_map(|(child, parent)| [(child, parent), (parent, child)])
        .collect()
}

/// A rank's links: `out[q]` sends to rank `q`, `inn[p]` receives from rank `p`.
#[derive(Debug)]
pub struct Links {
    rank: usize,
    world: usize,
    out: Vec<Option<OutLink>>,
    inn: Vec<Option<InLink>>,
    /// Each rank's message-layer socket, as its endpoint published it.
    msg_addrs: Vec<Option<SocketAddr>>,
    /// Each rank's message-layer member key (authenticated jobs), as published.
    msg_members: Vec<Option<MemberEntry>>,
    /// The job key, when the links were set up with a secret.
    key: Option<Arc<JobKey>>,
}

/// How in-memory links behave.
#[derive(Debug, Clone)]
pub struct MemLinkConfig {
    /// Largest datagram.
    pub max_datagram: usize,
    /// Datagrams queued per direction.
    pub queue: usize,
    /// Faults injected on every receiving datapath (seeded per link).
    pub fault: Option<FaultConfig>,
}

impl Default for MemLinkConfig {
    fn default() -> Self {
        MemLinkConfig {
            max_datagram: 1472,
            queue: 1 << 14,
            fault: None,
        }
    }
}

/// How network links are set up.
#[derive(Debug, Clone)]
pub struct NetLinkConfig {
    /// Longest wait for the whole set-up: the rendezvous (at most its own timeout too) and
    /// every link's connect and accept.
    pub connect_timeout: Duration,
    /// The UDP datapath of each link end.
    pub udp: UdpConfig,
    /// DSCP of the control connections.
    pub control_dscp: Option<u8>,
    /// Rendezvous limits.
    pub rendezvous: RendezvousConfig,
    /// Faults injected on every receiving datapath (tests and experiments; seeded per link).
    pub fault: Option<FaultConfig>,
    /// The port of this rank's message-layer socket, published with its endpoint.
    pub msg_port: Option<u16>,
    /// Authenticated jobs: this rank's message-layer member key, published with its
    /// endpoint ([`gradwire_msg::endpoint::Bound::member`]).
    pub msg_member: Option<MemberEntry>,
}

impl Default for NetLinkConfig {
    fn default() -> Self {
        NetLinkConfig {
            connect_timeout: Duration::from_secs(30),
            udp: UdpConfig::default(),
            control_dscp: Some(gradwire_qos::CONTROL_DSCP),
            rendezvous: RendezvousConfig::default(),
            fault: None,
            msg_port: None,
            msg_member: None,
        }
    }
}

/// What each rank publishes in the rendezvous.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Endpoint {
    /// The job: a table that mixes jobs is refused.
    job: u32,
    rank: usize,
    ip: IpAddr,
    /// `(from rank, control port)` of each incoming link.
    listeners: Vec<(usize, u16)>,
    /// The message layer's UDP port (on `ip`), if the rank runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    msg_port: Option<u16>,
    /// Authenticated jobs: the message layer's member key and its proof (checked when the
    /// endpoint starts: a forged one fails the set-up naming this rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    msg_member: Option<([u8; PUBLIC_LEN], [u8; MEMBER_PROOF_LEN])>,
    /// Plain jobs: `(from rank, token)` of each incoming link; rank `from` sends it in its
    /// `Hello`, so another process at its address cannot take the link (authenticated
    /// jobs prove the secret instead).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tokens: Vec<(usize, [u8; LINK_TOKEN_LEN])>,
}

/// Bytes of a plain link's token (a handshake nonce).
pub const LINK_TOKEN_LEN: usize = gradwire::auth::NONCE_LEN;

impl Links {
    fn empty(rank: usize, world: usize) -> Links {
        Links {
            rank,
            world,
            out: (0..world).map(|_| None).collect(),
            inn: (0..world).map(|_| None).collect(),
            msg_addrs: vec![None; world],
            msg_members: vec![None; world],
            key: None,
        }
    }

    /// The job key, when these links were set up with a job secret (authenticated): what
    /// runs over them seals its own datagrams with it too (the parameter server's endpoint).
    pub fn job_key(&self) -> Option<&Arc<JobKey>> {
        self.key.as_ref()
    }

    /// Each rank's message-layer socket (`None` where its endpoint published none).
    pub fn msg_addrs(&self) -> &[Option<SocketAddr>] {
        &self.msg_addrs
    }

    /// Each rank's message-layer member key (`None` where its endpoint published none: a
    /// plain job).
    pub fn msg_members(&self) -> &[Option<MemberEntry>] {
        &self.msg_members
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// World size.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Every link, for callers that drive each from a thread of its own: `out[q]` sends to
    /// rank `q`, `inn[p]` receives from rank `p`.
    #[allow(clippy::type_complexity)]
    pub fn split(self) -> (Vec<Option<OutLink>>, Vec<Option<InLink>>) {
        (self.out, self.inn)
    }

    /// The link to `peer`, if there is one.
    pub fn out(&mut self, peer: usize) -> Result<&mut OutLink, CollectiveError> {
        let rank = self.rank;
        self.out
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or(CollectiveError::NoLink {
                from: rank,
                to: peer,
            })
    }

    /// The link from `peer`, if there is one.
    pub fn inn(&mut self, peer: usize) -> Result<&mut InLink, CollectiveError> {
        let rank = self.rank;
        self.inn
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or(CollectiveError::NoLink {
                from: peer,
                to: rank,
            })
    }

    /// The outgoing link to `to` and the incoming link from `from` at once (a ring step sends
    /// and receives concurrently).
    pub fn out_and_in(
        &mut self,
        to: usize,
        from: usize,
    ) -> Result<(&mut OutLink, &mut InLink), CollectiveError> {
        let rank = self.rank;
        let out = self
            .out
            .get_mut(to)
            .and_then(Option::as_mut)
            .ok_or(CollectiveError::NoLink { from: rank, to })?;
        let inn = self
            .inn
            .get_mut(from)
            .and_then(Option::as_mut)
            .ok_or(CollectiveError::NoLink { from, to: rank })?;
        Ok((out, inn))
    }

    /// Several outgoing and incoming links at once (a tree node talks to its parent and all
    /// of its children concurrently). Each peer may appear once per list.
    pub fn many(
        &mut self,
        to: &[usize],
        from: &[usize],
    ) -> Result<(Vec<&mut OutLink>, Vec<&mut InLink>), CollectiveError> {
        let rank = self.rank;
        let mut outs: Vec<&mut OutLink> = Vec::new();
        for (q, l) in self.out.iter_mut().enumerate() {
            if to.contains(&q) {
                outs.push(
                    l.as_mut()
                        .ok_or(CollectiveError::NoLink { from: rank, to: q })?,
                );
            }
        }
        let mut ins: Vec<&mut InLink> = Vec::new();
        for (p, l) in self.inn.iter_mut().enumerate() {
            if from.contains(&p) {
                ins.push(
                    l.as_mut()
                        .ok_or(CollectiveError::NoLink { from: p, to: rank })?,
                );
            }
        }
        // In the callers' order.
        outs.sort_by_key(|l| to.iter().position(|&q| q == l.peer));
        ins.sort_by_key(|l| from.iter().position(|&p| p == l.peer));
        if outs.len() != to.len() || ins.len() != from.len() {
            return Err(CollectiveError::Config(
                "a peer is listed twice or is out of range".into(),
            ));
        }
        Ok((outs, ins))
    }

    /// In-memory links for every rank of a `world`-rank job over the directed `edges`.
    pub fn in_memory(
        world: usize,
        edges: &[(usize, usize)],
        cfg: &MemLinkConfig,
    ) -> Result<Vec<Links>, CollectiveError> {
        let mut all: Vec<Links> = (0..world).map(|r| Links::empty(r, world)).collect();
        let edges: BTreeSet<(usize, usize)> = edges.iter().copied().collect();
        for (i, &(from, to)) in edges.iter().enumerate() {
            if from >= world || to >= world || from == to {
                return Err(CollectiveError::Config(format!(
                    "edge {from} -> {to} is not between two ranks of a {world}-rank job"
                )));
            }
            // Distinct loopback addresses per rank (127.0.0.1 + rank), a port per link.
            let port = 20_000 + (i % 40_000) as u16;
            let loopback = |rank: usize| {
                IpAddr::from(std::net::Ipv4Addr::from(
                    0x7f00_0001u32 + (rank as u32 & 0x00ff_ffff),
                ))
            };
            let a = SocketAddr::new(loopback(from), port);
            let b = SocketAddr::new(loopback(to), port);
            let (dp_a, dp_b) = Loopback::pair(a, b, cfg.max_datagram, cfg.queue);
            let (ctl_a, ctl_b) = MemCtrl::pair();
            let dp_b: BoxDatapath = match &cfg.fault {
                Some(f) => {
                    let mut f = f.clone();
                    f.seed = f.seed.wrapping_add(i as u64 * 0x9e37_79b9);
                    Box::new(
                        FaultInjector::new(dp_b, f)
                            .map_err(|e| CollectiveError::Config(e.to_string()))?,
                    )
                }
                None => Box::new(dp_b),
            };
            all[from].out[to] = Some(OutLink {
                peer: to,
                dp: Box::new(dp_a),
                ctrl: Box::new(ctl_a),
                dst: b.ip(),
                last_rate_bps: None,
            });
            all[to].inn[from] = Some(InLink {
                peer: from,
                dp: dp_b,
                ctrl: Box::new(ctl_b),
            });
        }
        Ok(all)
    }

    /// Network links for `rank` of a `world`-rank job: listeners and UDP datapaths on `ip`,
    /// the rendezvous at `master` (rank 0 serves it), then every link of `edges` that starts
    /// or ends here. `secret`: the job's secret (every link authenticated) or none.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        job: u32,
        rank: usize,
        world: usize,
        ip: IpAddr,
        master: SocketAddr,
        edges: &[(usize, usize)],
        secret: Option<&JobSecret>,
        cfg: &NetLinkConfig,
    ) -> Result<Links, CollectiveError> {
        // One deadline for the whole set-up: rendezvous, connects and accepts.
        let deadline = Instant::now() + cfg.connect_timeout;
        let pending = Links::bind(job, rank, world, ip, edges, secret, cfg)?;
        let left = deadline.saturating_duration_since(Instant::now());
        // An authenticated job's rendezvous proves the secret both ways before the table.
        let rcfg = RendezvousConfig {
            timeout: cfg.rendezvous.timeout.min(left),
            key: pending.key.clone().or_else(|| cfg.rendezvous.key.clone()),
            ..cfg.rendezvous.clone()
        };
        let table = rendezvous::exchange(master, job, rank, world, pending.endpoint(), &rcfg)?;
        pending.finish_by(&table, deadline)
    }

    /// The first half of [`Links::connect`] for callers with an all-gather of their own (a
    /// training framework's store, MPI): bind this rank's listeners and datapaths. Every
    /// rank then gives [`PendingLinks::endpoint`] to every other rank, and each calls
    /// [`PendingLinks::finish`] with the table of all of them.
    pub fn bind(
        job: u32,
        rank: usize,
        world: usize,
        ip: IpAddr,
        edges: &[(usize, usize)],
        secret: Option<&JobSecret>,
        cfg: &NetLinkConfig,
    ) -> Result<PendingLinks, CollectiveError> {
        if rank >= world {
            return Err(CollectiveError::Config(format!(
                "rank {rank} is not below the world size {world}"
            )));
        }
        let edges: BTreeSet<(usize, usize)> = edges.iter().copied().collect();
        if let Some(&(from, to)) = edges
            .iter()
            .find(|&&(from, to)| from >= world || to >= world || from == to)
        {
            return Err(CollectiveError::Config(format!(
                "edge {from} -> {to} is not between two ranks of a {world}-rank job"
            )));
        }
        let incoming: Vec<usize> = edges.iter().filter(|e| e.1 == rank).map(|e| e.0).collect();
        let outgoing: Vec<usize> = edges.iter().filter(|e| e.0 == rank).map(|e| e.1).collect();
        let mut listeners = Vec::new();
        let mut tokens = Vec::new();
        for &p in &incoming {
            let link_token = match secret {
                Some(_) => None,
                None => {
                    let t = fresh_link_token().map_err(|e| {
                        CollectiveError::Setup(format!("link token for rank {p}: {e}"))
                    })?;
                    tokens.push((p, t));
                    Some(t)
                }
            };
            let lcfg = ListenerConfig {
                key: secret.map(JobKey::new),
                dscp: cfg.control_dscp,
                link_token,
                ..ListenerConfig::default()
            };
            let l = CtrlListener::bind(SocketAddr::new(ip, 0), lcfg).map_err(|e| {
                CollectiveError::Setup(format!(
                    "control listener for rank {p} on {ip}: {e} (is {ip} an address of this host?)"
                ))
            })?;
            let dp = bind_udp(ip, cfg, "receiving datapath")?;
            let dp: BoxDatapath = match &cfg.fault {
                Some(f) => {
                    let mut f = f.clone();
                    // Distinct, reproducible decisions per link.
                    f.seed = f.seed.wrapping_add((rank * world + p) as u64 * 0x9e37_79b9);
                    Box::new(
                        FaultInjector::new(dp, f)
                            .map_err(|e| CollectiveError::Config(e.to_string()))?,
                    )
                }
                None => Box::new(dp),
            };
            listeners.push((p, l, dp));
        }
        let me = Endpoint {
            job,
            rank,
            ip,
            listeners: listeners
                .iter()
                .map(|(p, l, _)| (*p, l.local_addr().port()))
                .collect(),
            msg_port: cfg.msg_port,
            msg_member: cfg.msg_member.map(|m| (m.public, m.proof)),
            tokens,
        };
        let endpoint = serde_json::to_vec(&me)
            .map_err(|e| CollectiveError::Setup(format!("endpoint encoding: {e}")))?;
        Ok(PendingLinks {
            job,
            rank,
            world,
            ip,
            outgoing,
            listeners,
            key: secret.map(|s| Arc::new(JobKey::new(s))),
            cfg: cfg.clone(),
            endpoint,
        })
    }
}

fn bind_udp(ip: IpAddr, cfg: &NetLinkConfig, what: &str) -> Result<UdpDatapath, CollectiveError> {
    UdpDatapath::bind(SocketAddr::new(ip, 0), cfg.udp.clone()).map_err(|e| {
        CollectiveError::Setup(format!("{what}: {e} (is {ip} an address of this host?)"))
    })
}

/// A rank's links between [`Links::bind`] and [`PendingLinks::finish`]: sockets bound, the
/// endpoint to publish ready.
pub struct PendingLinks {
    job: u32,
    rank: usize,
    world: usize,
    ip: IpAddr,
    outgoing: Vec<usize>,
    listeners: Vec<(usize, CtrlListener, BoxDatapath)>,
    key: Option<Arc<JobKey>>,
    cfg: NetLinkConfig,
    endpoint: Vec<u8>,
}

impl std::fmt::Debug for PendingLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PendingLinks(rank {} of {} at {}, {} in, {} out)",
            self.rank,
            self.world,
            self.ip,
            self.listeners.len(),
            self.outgoing.len()
        )
    }
}

/// The most bytes an endpoint may take: a bound on what a peer's table entry may make us parse.
pub const MAX_ENDPOINT_LEN: usize = 64 * 1024;

/// Check a table of endpoints from the caller's all-gather (untrusted bytes: from every
/// rank, through whatever exchanged them): `world` entries of at most [`MAX_ENDPOINT_LEN`]
/// bytes, entry `r` from rank `r` of job `job`. Returns each rank's address and listener
/// ports `(from rank, port)`.
pub fn parse_endpoint_table(
    table: &[Vec<u8>],
    job: u32,
    world: usize,
) -> Result<Vec<EndpointInfo>, CollectiveError> {
    if table.len() != world {
        return Err(CollectiveError::Setup(format!(
            "the endpoint table has {} entries for a {world}-rank job: every rank's endpoint is needed",
            table.len()
        )));
    }
    let mut endpoints = Vec::with_capacity(world);
    for (r, bytes) in table.iter().enumerate() {
        if bytes.len() > MAX_ENDPOINT_LEN {
            return Err(CollectiveError::Setup(format!(
                "rank {r}'s endpoint is {} bytes, above the {MAX_ENDPOINT_LEN}-byte limit",
                bytes.len()
            )));
        }
        let e: Endpoint = serde_json::from_slice(bytes).map_err(|e| {
            CollectiveError::Setup(format!("rank {r}'s endpoint is not valid: {e}"))
        })?;
        if e.rank != r {
            return Err(CollectiveError::Setup(format!(
                "the endpoint at position {r} of the table is rank {}'s: order the table by rank",
                e.rank
            )));
        }
        if e.job != job {
            return Err(CollectiveError::Setup(format!(
                "rank {r}'s endpoint is for job {}, not job {job}: do all ranks use the same job id?",
                e.job
            )));
        }
        if e.ip.is_unspecified() || e.ip.is_multicast() {
            return Err(CollectiveError::Setup(format!(
                "rank {r}'s endpoint address {} is not one a peer can connect to",
                e.ip
            )));
        }
        if e.listeners.len() > world {
            return Err(CollectiveError::Setup(format!(
                "rank {r}'s endpoint lists {} listeners in a {world}-rank job",
                e.listeners.len()
            )));
        }
        if e.msg_port == Some(0) {
            return Err(CollectiveError::Setup(format!(
                "rank {r}'s endpoint names message-layer port 0"
            )));
        }
        if e.tokens.len() > e.listeners.len() {
            return Err(CollectiveError::Setup(format!(
                "rank {r}'s endpoint lists {} link tokens for {} listeners",
                e.tokens.len(),
                e.listeners.len()
            )));
        }
        endpoints.push(EndpointInfo {
            ip: e.ip,
            listeners: e.listeners,
            msg: e.msg_port.map(|p| SocketAddr::new(e.ip, p)),
            msg_member: e
                .msg_member
                .map(|(public, proof)| MemberEntry { public, proof }),
            tokens: e.tokens,
        });
    }
    Ok(endpoints)
}

/// One rank's entry of a checked endpoint table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// The rank's address.
    pub ip: IpAddr,
    /// `(from rank, control port)` of each of its incoming links.
    pub listeners: Vec<(usize, u16)>,
    /// Its message-layer socket, if it published one.
    pub msg: Option<SocketAddr>,
    /// Its message-layer member key (authenticated jobs), if it published one.
    pub msg_member: Option<MemberEntry>,
    /// Plain jobs: `(from rank, token)` its listeners want in the `Hello` of each incoming
    /// link.
    pub tokens: Vec<(usize, [u8; LINK_TOKEN_LEN])>,
}

impl PendingLinks {
    /// This rank's endpoint: opaque bytes every other rank needs (at most
    /// [`MAX_ENDPOINT_LEN`]).
    pub fn endpoint(&self) -> &[u8] {
        &self.endpoint
    }

    /// Connect every link, given every rank's endpoint (`table[r]` from rank `r`, this
    /// rank's own included), within the configured connect timeout.
    pub fn finish(self, table: &[Vec<u8>]) -> Result<Links, CollectiveError> {
        let deadline = Instant::now() + self.cfg.connect_timeout;
        self.finish_by(table, deadline)
    }

    fn finish_by(self, table: &[Vec<u8>], deadline: Instant) -> Result<Links, CollectiveError> {
        let left = || deadline.saturating_duration_since(Instant::now());
        let (rank, world) = (self.rank, self.world);
        let endpoints = parse_endpoint_table(table, self.job, world)?;
        if table[rank] != self.endpoint {
            return Err(CollectiveError::Setup(format!(
                "the table's entry for this rank ({rank}) is not this rank's endpoint"
            )));
        }
        let mut links = Links::empty(rank, world);
        links.key.clone_from(&self.key);
        links.msg_addrs = endpoints.iter().map(|e| e.msg).collect();
        links.msg_members = endpoints.iter().map(|e| e.msg_member).collect();
        // Outgoing first: the peers' listeners run handshakes in the background, so connects
        // complete without the peers calling accept, and nobody waits on anybody in a cycle.
        for &q in &self.outgoing {
            let port = endpoints[q]
                .listeners
                .iter()
                .find(|(from, _)| *from == rank)
                .map(|(_, port)| *port)
                .ok_or_else(|| CollectiveError::PeerSetup {
                    peer: q,
                    reason: format!(
                        "it published no listener for rank {rank}: do all ranks run the same \
                         algorithm and job file, and the same authentication (a job secret \
                         everywhere or nowhere: a rank without one runs the message layer)?"
                    ),
                })?;
            let addr = SocketAddr::new(endpoints[q].ip, port);
            let token = endpoints[q]
                .tokens
                .iter()
                .find(|(from, _)| *from == rank)
                .map(|(_, t)| *t);
            let ctrl = TcpCtrl::connect_link(
                Some(self.ip),
                addr,
                left(),
                self.cfg.control_dscp,
                self.key.as_deref(),
                token,
            )
            .map_err(|e| CollectiveError::Link {
                peer: q,
                source: TransferError::Channel(e),
            })?;
            links.out[q] = Some(OutLink {
                peer: q,
                dp: Box::new(bind_udp(self.ip, &self.cfg, "sending datapath")?),
                ctrl: Box::new(ctrl),
                dst: endpoints[q].ip,
                last_rate_bps: None,
            });
        }
        for (p, listener, dp) in self.listeners {
            let ctrl = loop {
                let c = listener.accept(left()).map_err(|e| CollectiveError::Link {
                    peer: p,
                    source: TransferError::Channel(e),
                })?;
                if c.peer_addr().ip() == endpoints[p].ip {
                    break c;
                }
                log::warn!(
                    "rank {rank}: refused a connection from {} on rank {p}'s link (rank {p} is {})",
                    c.peer_addr(),
                    endpoints[p].ip
                );
            };
            links.inn[p] = Some(InLink {
                peer: p,
                dp,
                ctrl: Box::new(ctrl),
            });
        }
        Ok(links)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_edges_close_the_ring() {
        assert_eq!(ring_edges(3), vec![(0, 1), (1, 2), (2, 0)]);
        assert!(ring_edges(1).is_empty());
    }

    #[test]
    fn in_memory_links_exist_where_the_edges_say() {
        let mut links = Links::in_memory(3, &ring_edges(3), &MemLinkConfig::default()).unwrap();
        assert!(links[0].out(1).is_ok());
        assert!(links[0].inn(2).is_ok());
        assert!(matches!(
            links[0].out(2),
            Err(CollectiveError::NoLink { from: 0, to: 2 })
        ));
        assert!(Links::in_memory(2, &[(0, 5)], &MemLinkConfig::default()).is_err());
        let (outs, ins) = links[1].many(&[2], &[0]).unwrap();
        assert_eq!((outs[0].peer(), ins[0].peer()), (2, 0));
    }

    fn entry(job: u32, rank: usize, listeners: &[(usize, u16)]) -> Vec<u8> {
        serde_json::to_vec(&Endpoint {
            job,
            rank,
            ip: "198.18.0.1".parse().unwrap(),
            listeners: listeners.to_vec(),
            msg_port: None,
            msg_member: None,
            tokens: listeners
                .iter()
                .map(|&(from, _)| (from, [from as u8; 32]))
                .collect(),
        })
        .unwrap()
    }

    #[test]
    fn endpoint_tables_are_checked_entry_by_entry() {
        let good = vec![entry(4, 0, &[(1, 9000)]), entry(4, 1, &[(0, 9001)])];
        let t = parse_endpoint_table(&good, 4, 2).unwrap();
        assert_eq!(t[1].listeners, vec![(0, 9001)]);
        assert_eq!(t[1].tokens, vec![(0, [0; 32])]);
        let setup = |table: &[Vec<u8>], job, world| {
            let e = parse_endpoint_table(table, job, world).unwrap_err();
            assert!(matches!(e, CollectiveError::Setup(_)), "{e}");
            e.to_string()
        };
        assert!(setup(&good, 4, 3).contains("every rank's endpoint"));
        assert!(setup(&good, 5, 2).contains("same job id"));
        let swapped = vec![good[1].clone(), good[0].clone()];
        assert!(setup(&swapped, 4, 2).contains("order the table by rank"));
        assert!(setup(&[b"{".to_vec(), good[1].clone()], 4, 2).contains("not valid"));
        let big = vec![vec![b' '; MAX_ENDPOINT_LEN + 1], good[1].clone()];
        assert!(setup(&big, 4, 2).contains("limit"));
        let many = vec![entry(4, 0, &[(1, 1), (1, 2), (1, 3)]), good[1].clone()];
        assert!(setup(&many, 4, 2).contains("listeners"));
        // More tokens than listeners: not an endpoint gradwire wrote.
        let mut e: serde_json::Value = serde_json::from_slice(&good[0]).unwrap();
        e["tokens"] = serde_json::json!([[1, vec![1u8; 32]], [1, vec![2u8; 32]]]);
        let tokens = vec![serde_json::to_vec(&e).unwrap(), good[1].clone()];
        assert!(setup(&tokens, 4, 2).contains("link tokens"));
    }

    proptest::proptest! {
        #[test]
        fn endpoint_tables_of_any_bytes_never_panic(
            table in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..64), 0..5),
            world in 0usize..6,
        ) {
            if let Ok(t) = parse_endpoint_table(&table, 0, world) {
                proptest::prop_assert_eq!(t.len(), world);
            }
        }
    }
}
