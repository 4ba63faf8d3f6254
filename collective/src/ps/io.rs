//! The node's I/O on the message layer (`gradwire-msg`): one endpoint per node, no thread
//! per link, no flows after set-up.
//!
//! - **Set-up.** [`bind`] binds the node's endpoint (its own UDP socket, so its message
//!   numbers never mix with another user's of the rank) on the address the host routes to
//!   its peers from. The node's thread then sends its address to each neighbour over the
//!   given [`Links`] and reads theirs ([`exchange`]: one small reliable flow each way per
//!   link, the links' only use; they are dropped after), and starts the endpoint.
//! - **Receiving.** One [`Inbox`] operation per link runs on the endpoint's progress thread
//!   for the node's lifetime: it always has the next header message posted (an `up_to`
//!   receive), so the layer pings a peer that falls silent and fails the receive naming it
//!   after `failure_timeout`; a header that announces data posts that message's data
//!   receives (exact lengths, the model's size at most), decodes them and hands the message
//!   to the aggregator. The peer's Bye ends it.
//! - **Sending.** The aggregator's thread submits each message as sends of the layer in
//!   order: the header message, then the values (under the hop's loss bound), then the
//!   contributor sets or block clocks (reliable). Heartbeats go out on links idle for
//!   `heartbeat` ([`Beats`]). A child link with a version still in flight gets only the
//!   newest one after it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::tensor::Tensor;
use gradwire::transport::{MissingFill, RecvOptions, SendOptions};
use gradwire_msg::core::{RecvOpts, RecvReport, SendOpts};
use gradwire_msg::endpoint::{Bound, Endpoint, EndpointConfig};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Handle, Op, OpCx, OpError, OpEvent, Step};

use super::api::PsError;
use super::core::{
    merge_blocks, publish, sets_within, Agg, AggIn, Beats, ChildSum, Out, PushMsg, VersionMsg,
};
use super::state::{raw_tensor, tensor_of, Ctx};
use super::wire::{
    decode_clocks, decode_msg, encode_msg, Header, Kind, F_EMPTY, F_SIDE, HEADER_LEN, MAX_REASON,
};
use crate::aggregate::{arrived_blocks, Contributors};
use crate::error::CollectiveError;
use crate::link::{InLink, Links, OutLink};

/// Flow id of the set-up exchange of endpoint addresses (kind 7, as the parameter server's
/// flows always had).
const T_ADDR: u32 = 7 << 27;
/// Bytes of an address in the exchange: its text, zero-padded.
const ADDR_LEN: usize = 64;
/// The data's TOS byte: best effort, ECN-capable (what the flows sent).
const DATA_TOS: u8 = 0b10;

/// Binds the node's endpoint for `rank` of `world` in `job`, on the address this host sends
/// to `toward` (a neighbour) from.
pub(super) fn bind(
    toward: IpAddr,
    job: u32,
    rank: usize,
    world: usize,
    mtu: usize,
    failure_timeout: Duration,
    inject_loss: f64,
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
    // The layer fails a receive whose peer is silent this long, naming it: exactly the
    // parameter server's "a link silent for failure_timeout has failed".
    cfg.core.peer_timeout = failure_timeout;
    cfg.mtu = mtu;
    cfg.inject_loss = inject_loss;
    cfg.seed = u64::from(job);
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
/// must not hold up the others). Per peer: its address, or why there is none.
fn exchange(
    links: &mut Links,
    me: SocketAddr,
    ctx: &Ctx,
) -> BTreeMap<usize, Result<SocketAddr, PsError>> {
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

fn recv_addr(il: &mut InLink, ctx: &Ctx) -> Result<SocketAddr, PsError> {
    let opts = RecvOptions {
        job: ctx.job,
        tensor: T_ADDR,
        round: Some(0),
        loss_bound: Some(LossBound::RELIABLE),
        fill: MissingFill::Zero,
        max_bytes: None,
    };
    let peer = il.peer();
    let mut t = raw_tensor(&[0u8; ADDR_LEN]);
    il.recv(&mut t, &opts, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?;
    let b = t.as_bytes();
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let addr = std::str::from_utf8(&b[..end])
        .ok()
        .and_then(|s| s.parse::<SocketAddr>().ok())
        .filter(|a| !a.ip().is_unspecified() && a.port() != 0);
    addr.ok_or_else(|| PsError::Protocol {
        peer,
        what: "its endpoint address at set-up is not an address".into(),
    })
}

/// What a link's failure means: with route-around, a failure of the link marks the peer as
/// suspect (the aggregator decides); otherwise, and for protocol errors, the node fails.
fn link_error(ctx: &Ctx, peer: usize, e: PsError, agg: &Sender<AggIn>) {
    if ctx.shared.forced() {
        return;
    }
    match e {
        PsError::Collective(c) if ctx.reroute => {
            let _ = agg.send(AggIn::Down {
                peer,
                reason: c.to_string(),
            });
        }
        e => ctx.fail(e),
    }
}

/// A message of the layer with `peer` failed.
fn layer_error(ctx: &Ctx, peer: usize, e: OpError, agg: &Sender<AggIn>) {
    // After the peer's Bye nothing more is owed on the link (a peer that has left may not
    // acknowledge our last message); after our own close, every message fails.
    if ctx.shared.closing.load(Ordering::SeqCst) || ctx.shared.said_bye(peer) {
        return;
    }
    let err = match e {
        OpError::Data { peer: p, reason } => PsError::Protocol {
            peer: usize::from(p),
            what: reason,
        },
        OpError::Peer(m) => CollectiveError::Peer {
            peer,
            reason: m.to_string(),
        }
        .into(),
        other => PsError::Endpoint(other.to_string()),
    };
    link_error(ctx, peer, err, agg);
}

/// Where a link's receiving operation is.
#[derive(Debug)]
enum Wait {
    /// The next header message: `(message, buffer)`.
    Header(u32, BufId),
    /// The data of a push or a version.
    Data(Box<Data>),
}

#[derive(Debug)]
struct Data {
    h: Header,
    values: (u32, BufId),
    side: Option<(u32, BufId)>,
    report: Option<RecvReport>,
    side_done: bool,
}

/// A link's receiving end, on the endpoint's progress thread: every message from `peer` to
/// the aggregator (versions merged into the cache here), until the peer's Bye.
struct Inbox {
    peer: u16,
    ctx: Arc<Ctx>,
    agg: Sender<AggIn>,
    /// Longest header message: the header and the longest body (a reason or a dead list).
    cap: usize,
    wait: Option<Wait>,
}

impl Inbox {
    fn new(peer: usize, ctx: Arc<Ctx>, agg: Sender<AggIn>) -> Inbox {
        let cap = HEADER_LEN + MAX_REASON.max(ctx.world * 8);
        Inbox {
            peer: peer as u16,
            ctx,
            agg,
            cap,
            wait: None,
        }
    }

    fn rank(&self) -> usize {
        usize::from(self.peer)
    }

    fn refuse(&self, what: String) -> OpError {
        OpError::Data {
            peer: self.peer,
            reason: format!("broke the parameter-server protocol: {what}"),
        }
    }

    fn tell(&self, m: AggIn) {
        // The aggregator may have left already: then only the Bye matters, and the node's
        // thread reads it.
        let _ = self.agg.send(m);
    }

    fn post_header(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let buf = cx.register(Region::owned(vec![0u8; self.cap]));
        let msg = cx.reserve_recvs(self.peer, 1)?;
        let opts = RecvOpts {
            up_to: true,
            ..RecvOpts::default()
        };
        cx.recv(self.peer, msg, buf, 0..self.cap, opts)?;
        self.wait = Some(Wait::Header(msg, buf));
        Ok(())
    }

    /// Posts a receive of `len` bytes under `loss_bound`.
    fn post(
        &self,
        cx: &mut OpCx<'_>,
        len: usize,
        loss_bound: f64,
    ) -> Result<(u32, BufId), OpError> {
        let buf = cx.register(Region::owned(vec![0u8; len]));
        let msg = cx.reserve_recvs(self.peer, 1)?;
        let opts = RecvOpts {
            loss_bound,
            ..RecvOpts::default()
        };
        cx.recv(self.peer, msg, buf, 0..len, opts)?;
        Ok((msg, buf))
    }

    /// A header message arrived; `Ok(true)`: the link ended (Bye).
    fn on_header(&mut self, bytes: &[u8], msg: u32, cx: &mut OpCx<'_>) -> Result<bool, OpError> {
        let ctx = self.ctx.clone();
        let (h, body) =
            decode_msg(bytes).map_err(|what| self.refuse(format!("message {msg}: {what}")))?;
        let peer = self.rank();
        match h.kind {
            Kind::Heartbeat => {}
            Kind::Bye => {
                ctx.shared.set_bye(peer);
                self.tell(AggIn::Bye(peer));
                return Ok(true);
            }
            Kind::Fail => {
                if body.is_empty() || body.len() > MAX_REASON {
                    return Err(self.refuse(format!("a failure reason of {} bytes", body.len())));
                }
                let reason = String::from_utf8_lossy(body).into_owned();
                let rank = usize::try_from(h.clock).unwrap_or(usize::MAX);
                ctx.shared
                    .fail(ctx.rank, PsError::Peer { rank, reason }, Some(peer));
            }
            Kind::Tree => {
                let n = h.len as usize;
                if n == 0 || n > ctx.world || h.clock != n as u64 {
                    return Err(self.refuse(format!(
                        "a tree update of version {} naming {n} dead rank(s)",
                        h.clock
                    )));
                }
                let mut dead = Vec::with_capacity(n);
                for w in body.chunks_exact(8) {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(w);
                    match usize::try_from(u64::from_le_bytes(a)) {
                        Ok(r) if r < ctx.world => dead.push(r),
                        _ => {
                            return Err(
                                self.refuse("a tree update names a rank out of range".into())
                            )
                        }
                    }
                }
                self.tell(AggIn::Tree(dead));
            }
            Kind::Adopt => self.tell(AggIn::Adopt {
                peer,
                version: u64::from(h.len),
                from: h.clock,
            }),
            Kind::Push if h.flags & F_EMPTY != 0 => self.tell(AggIn::Child {
                peer,
                epoch: u64::from(h.len),
                clock: h.clock,
                sum: None,
            }),
            Kind::Push | Kind::Weights => {
                let side = h.flags & F_SIDE != 0;
                if h.kind == Kind::Push && !side && !ctx.reliable {
                    return Err(self.refuse(format!(
                        "the sum of clock {} came without contributor sets under a loss bound",
                        h.clock
                    )));
                }
                let blocks = ctx.blocks();
                let bytes = ctx.layout.elems() * ctx.dtype.elem_size();
                let values = self.post(cx, bytes, ctx.hop_bound.ppm() as f64 / 1e6)?;
                let side = if !side {
                    None
                } else if h.kind == Kind::Push {
                    let len = blocks * Contributors::none(1, ctx.world).encoded_block_len();
                    Some(self.post(cx, len, 0.0)?)
                } else {
                    Some(self.post(cx, blocks * 8, 0.0)?)
                };
                self.wait = Some(Wait::Data(Box::new(Data {
                    h,
                    values,
                    side,
                    report: None,
                    side_done: false,
                })));
                return Ok(false);
            }
        }
        self.post_header(cx)?;
        Ok(false)
    }

    /// A push's or a version's data is in: decode it, hand it on.
    fn on_data(&mut self, d: &Data, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let ctx = self.ctx.clone();
        let peer = self.rank();
        let h = d.h;
        let blocks = ctx.blocks();
        let report = d.report.as_ref();
        let values = tensor_of(ctx.dtype, cx.buf(d.values.1));
        let seg = cx.seg_payload().max(1);
        let len = values.as_bytes().len();
        let missing: Vec<(u64, usize)> = match report {
            Some(r) if r.arrived.is_some() => (0..r.segments as usize)
                .filter(|&s| !r.has(s))
                .map(|s| ((s * seg) as u64, seg.min(len.saturating_sub(s * seg))))
                .collect(),
            _ => Vec::new(),
        };
        let arrived = arrived_blocks(&missing, ctx.bb, blocks);
        let side = d.side.map(|(_, b)| cx.buf(b).to_vec());
        if h.kind == Kind::Push {
            let subtree = &ctx.subtree0[peer];
            let sets = match side {
                Some(bytes) => {
                    let sets =
                        Contributors::decode(&bytes, blocks, ctx.world, true).map_err(|e| {
                            self.refuse(format!("contributor sets of clock {}: {e}", h.clock))
                        })?;
                    if !sets_within(&sets, subtree) {
                        return Err(self.refuse(format!(
                            "the sum of clock {} names workers outside its subtree",
                            h.clock
                        )));
                    }
                    sets
                }
                None => {
                    let mut s = Contributors::none(blocks, ctx.world);
                    for b in 0..blocks {
                        s.unite(b, subtree, 0);
                    }
                    s
                }
            };
            self.tell(AggIn::Child {
                peer,
                epoch: u64::from(h.len),
                clock: h.clock,
                sum: Some(ChildSum {
                    values,
                    sets,
                    arrived,
                }),
            });
        } else {
            let clocks = match side {
                Some(bytes) => decode_clocks(&bytes, blocks, h.clock)
                    .map_err(|e| self.refuse(format!("version {}: {e}", h.clock)))?,
                None => vec![h.clock; blocks],
            };
            ctx.shared
                .counters
                .versions_received
                .fetch_add(1, Ordering::Relaxed);
            {
                let mut st = ctx.shared.lock();
                let st = &mut *st;
                merge_blocks(
                    st.weights.as_bytes_mut(),
                    &mut st.have,
                    values.as_bytes(),
                    &clocks,
                    &arrived,
                    ctx.bb,
                );
                st.cache.on_weights(h.clock);
            }
            ctx.shared.cv.notify_all();
            self.tell(AggIn::Version);
        }
        cx.unregister(d.values.1);
        if let Some((_, b)) = d.side {
            cx.unregister(b);
        }
        Ok(())
    }
}

impl Op for Inbox {
    type Output = ();

    // A dead peer ends this link only: the node routes around it and goes on with the others.
    fn failure_breaks_group(&self) -> bool {
        false
    }

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<()> {
        self.post_header(cx)?;
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<()> {
        let OpEvent::Received { msg, report, .. } = ev else {
            return Ok(None);
        };
        if self.ctx.shared.forced() {
            return Ok(Some(()));
        }
        match self.wait.take() {
            Some(Wait::Header(m, buf)) if m == msg => {
                let n = (report.len as usize).min(self.cap);
                let bytes = cx.buf(buf)[..n].to_vec();
                cx.unregister(buf);
                if self.on_header(&bytes, msg, cx)? {
                    return Ok(Some(()));
                }
            }
            Some(Wait::Data(mut d)) => {
                if d.values.0 == msg {
                    d.report = Some(report);
                } else if d.side.is_some_and(|(m, _)| m == msg) {
                    d.side_done = true;
                }
                if d.report.is_some() && (d.side.is_none() || d.side_done) {
                    self.on_data(&d, cx)?;
                    self.post_header(cx)?;
                } else {
                    self.wait = Some(Wait::Data(d));
                }
            }
            other => {
                // Every receive this operation posts is awaited: a stray event is a bug.
                self.wait = other;
                return Err(OpError::Invalid(format!(
                    "the parameter server's inbox from rank {} got message {msg} it did not wait for",
                    self.peer
                )));
            }
        }
        Ok(None)
    }
}

/// One message of a link (the layer's plain send fails the rank's whole group with it).
struct LinkSend {
    peer: u16,
    region: Option<Region>,
}

impl Op for LinkSend {
    type Output = ();

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<()> {
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        let len = region.len();
        let buf = cx.register(region);
        let msg = cx.reserve_sends(self.peer, 1)?;
        let opts = SendOpts {
            tos: DATA_TOS,
            ..SendOpts::default()
        };
        cx.send(self.peer, msg, buf, 0..len, opts)?;
        Ok(None)
    }

    fn on_event(&mut self, _ev: OpEvent, _cx: &mut OpCx<'_>) -> Step<()> {
        Ok(Some(()))
    }

    fn failure_breaks_group(&self) -> bool {
        false
    }
}

/// The sending side of the node: the endpoint, and per link what is in flight.
struct Net {
    ep: Endpoint,
    ctx: Arc<Ctx>,
    agg: Sender<AggIn>,
    beats: Beats,
    /// Links that still carry messages (not failed, Bye not sent).
    open: BTreeSet<usize>,
    /// Links that ended: the peer's Bye arrived, or the link failed.
    ended: BTreeSet<usize>,
    told_fail: BTreeSet<usize>,
    /// Child links with a version in flight, and the newest one waiting behind it.
    busy: BTreeSet<usize>,
    newest: BTreeMap<usize, Arc<VersionMsg>>,
    sends: Vec<Handle<()>>,
}

impl Net {
    fn send(&mut self, peer: usize, bytes: Vec<u8>, notify: bool) {
        let h = self.ep.submit(LinkSend {
            peer: peer as u16,
            region: Some(Region::owned(bytes)),
        });
        let (ctx, agg) = (self.ctx.clone(), self.agg.clone());
        h.on_complete(move |r| match r {
            Ok(()) if notify => {
                let _ = agg.send(AggIn::Sent(peer));
            }
            Ok(()) => {}
            Err(e) => layer_error(&ctx, peer, e, &agg),
        });
        self.sends.push(h);
        self.beats.sent(peer, Instant::now());
    }

    fn header(&mut self, peer: usize, h: &Header, body: &[u8]) {
        self.send(peer, encode_msg(h, body), false);
    }

    fn bytes_sent(&self, n: usize) {
        self.ctx
            .shared
            .counters
            .bytes_sent
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Sends one of the aggregator's messages.
    fn dispatch(&mut self, peer: usize, m: Out) {
        if !self.open.contains(&peer) {
            return;
        }
        self.tell_fail(peer);
        match m {
            Out::Push(p, epoch) => self.push(peer, &p, epoch),
            Out::Weights(v) if self.busy.contains(&peer) => {
                // Only the newest of the versions queued behind one in flight matters.
                self.newest.insert(peer, v);
            }
            Out::Weights(v) => self.weights(peer, &v),
            Out::Tree(dead) => {
                let mut h = Header::new(Kind::Tree, 0, dead.len() as u64);
                h.len = u32::try_from(dead.len()).unwrap_or(u32::MAX);
                let body: Vec<u8> = dead
                    .iter()
                    .flat_map(|&r| (r as u64).to_le_bytes())
                    .collect();
                self.header(peer, &h, &body);
            }
            Out::Adopt { version, from } => {
                let mut h = Header::new(Kind::Adopt, 0, from);
                h.len = u32::try_from(version).unwrap_or(u32::MAX);
                self.header(peer, &h, &[]);
            }
            Out::Finish => self.bye(peer),
        }
    }

    fn push(&mut self, peer: usize, m: &PushMsg, epoch: u64) {
        let mut flags = 0;
        if m.values.is_none() {
            flags |= F_EMPTY;
        } else if m.sets.is_some() {
            flags |= F_SIDE;
        }
        let mut h = Header::new(Kind::Push, flags, m.clock);
        h.len = u32::try_from(epoch).unwrap_or(u32::MAX);
        self.header(peer, &h, &[]);
        if let Some(v) = &m.values {
            self.bytes_sent(v.as_bytes().len());
            self.send(peer, v.as_bytes().to_vec(), false);
            if let Some(sets) = &m.sets {
                self.bytes_sent(sets.len());
                self.send(peer, sets.clone(), false);
            }
        }
        self.ctx
            .shared
            .counters
            .sums_sent
            .fetch_add(1, Ordering::Relaxed);
    }

    fn weights(&mut self, peer: usize, m: &VersionMsg) {
        let flags = if m.block_clocks.is_some() { F_SIDE } else { 0 };
        self.header(peer, &Header::new(Kind::Weights, flags, m.clock), &[]);
        self.bytes_sent(m.weights.as_bytes().len());
        let last_is_values = m.block_clocks.is_none();
        self.send(peer, m.weights.as_bytes().to_vec(), last_is_values);
        if let Some(c) = &m.block_clocks {
            self.bytes_sent(c.len());
            self.send(peer, c.clone(), true);
        }
        self.busy.insert(peer);
        self.ctx
            .shared
            .counters
            .versions_sent
            .fetch_add(1, Ordering::Relaxed);
    }

    fn bye(&mut self, peer: usize) {
        if self.open.contains(&peer) {
            self.header(peer, &Header::new(Kind::Bye, 0, 0), &[]);
        }
        self.close(peer);
    }

    fn close(&mut self, peer: usize) {
        self.open.remove(&peer);
        self.beats.stop(peer);
        self.busy.remove(&peer);
        self.newest.remove(&peer);
    }

    /// Tells `peer` once which rank failed, when this node knows of a failure it did not
    /// hear from `peer`.
    fn tell_fail(&mut self, peer: usize) {
        if self.told_fail.contains(&peer) || !self.open.contains(&peer) {
            return;
        }
        let Some(note) = self.ctx.shared.note_for(peer) else {
            return;
        };
        self.told_fail.insert(peer);
        let mut reason = note.reason;
        if reason.is_empty() {
            reason.push('?');
        }
        if reason.len() > MAX_REASON {
            let mut cut = MAX_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        let mut h = Header::new(Kind::Fail, 0, note.origin as u64);
        h.len = reason.len() as u32;
        self.header(peer, &h, reason.as_bytes());
    }

    /// Failure news, heartbeats on idle links, and forgetting finished sends.
    fn tick(&mut self) {
        for p in self.open.clone() {
            self.tell_fail(p);
        }
        for p in self.beats.due(Instant::now()) {
            self.header(p, &Header::new(Kind::Heartbeat, 0, 0), &[]);
            self.ctx
                .shared
                .counters
                .heartbeats_sent
                .fetch_add(1, Ordering::Relaxed);
        }
        self.sends.retain(|h| !h.test());
    }

    /// What the I/O learns from an event before the aggregator gets it (`None`: the I/O's
    /// alone).
    fn observe(&mut self, m: AggIn) -> Option<AggIn> {
        match m {
            AggIn::Sent(peer) => {
                self.busy.remove(&peer);
                if let Some(v) = self.newest.remove(&peer) {
                    if self.open.contains(&peer) {
                        self.weights(peer, &v);
                    }
                }
                None
            }
            AggIn::Bye(peer) => {
                self.ended.insert(peer);
                Some(AggIn::Bye(peer))
            }
            AggIn::Down { peer, reason } => {
                self.ended.insert(peer);
                self.close(peer);
                Some(AggIn::Down { peer, reason })
            }
            m => Some(m),
        }
    }

    fn flush(&mut self, agg: &mut Agg<'_>) {
        for (peer, m) in std::mem::take(&mut agg.outbox) {
            self.dispatch(peer, m);
        }
    }

    /// The node is done (it left, or it failed): say Bye where it has not yet, wait for
    /// every peer's Bye (or the link's failure) and for the last sends, then close.
    fn finish(mut self, rx: &Receiver<AggIn>) {
        let ctx = self.ctx.clone();
        if !ctx.shared.forced() {
            self.tick();
            for p in self.open.clone() {
                self.bye(p);
            }
        }
        let mut all_ended: Option<Instant> = None;
        while !ctx.shared.forced() {
            self.sends.retain(|h| !h.test());
            if ctx.peers.iter().all(|p| self.ended.contains(p)) {
                let since = *all_ended.get_or_insert_with(Instant::now);
                // The last sends are acknowledged, or the peers left before they could.
                if self.sends.is_empty() || since.elapsed() >= ctx.failure_timeout {
                    break;
                }
            }
            match rx.recv_timeout(ctx.poll) {
                Ok(m) => {
                    let _ = self.observe(m);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        ctx.shared.closing.store(true, Ordering::SeqCst);
        // The handles hold the endpoint's command channel, which its progress thread waits
        // to see closed: drop them first.
        let Net { ep, sends, .. } = self;
        drop(sends);
        drop(ep);
    }
}

/// The aggregator on the node's thread: sums each clock's pushes in clock order and sends
/// the sum up (a worker) or applies it (the server); repairs the tree on failures.
fn aggregate(ctx: &Ctx, rx: &Receiver<AggIn>, net: &mut Net) {
    let mut agg = Agg::new(ctx, ctx.peers.clone());
    if !agg.worker() {
        publish(ctx, None);
        for c in agg.children() {
            agg.send_version(c);
        }
    }
    net.flush(&mut agg);
    loop {
        if ctx.shared.forced() || agg.broken {
            break;
        }
        if agg.may_leave() {
            agg.leave();
            net.flush(&mut agg);
            break;
        }
        net.tick();
        // Wake for the next heartbeat, or to look at the stop flags.
        let wait = net.beats.next().map_or(ctx.poll, |t| {
            t.saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(1), ctx.poll)
        });
        match rx.recv_timeout(wait) {
            Ok(m) => {
                if let Some(m) = net.observe(m) {
                    agg.handle(m);
                }
                net.flush(&mut agg);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    if !agg.pending.is_empty() {
        log::warn!(
            "parameter server rank {}: stopped with {} clock(s) incomplete (from clock {}): some push never came",
            ctx.rank,
            agg.pending.len(),
            agg.next
        );
        ctx.shared
            .counters
            .dropped_clocks
            .fetch_add(agg.pending.len() as u64, Ordering::Relaxed);
    }
}

/// The node's thread: the address exchange, the endpoint, an inbox per link, the aggregator.
pub(super) fn node_main(
    mut links: Links,
    bound: Bound,
    ctx: &Arc<Ctx>,
    agg_tx: Sender<AggIn>,
    agg_rx: Receiver<AggIn>,
) {
    let me = bound.local_addr();
    let addrs = exchange(&mut links, me, ctx);
    drop(links);
    // Ranks without a link get an address nobody has (they are never sent to).
    let mut table: Vec<SocketAddr> = (0..ctx.world)
        .map(|r| SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), (r % 65_535 + 1) as u16))
        .collect();
    table[ctx.rank] = me;
    let mut live = Vec::new();
    let mut lost = Vec::new();
    for (p, r) in addrs {
        match r {
            Ok(a) => {
                table[p] = a;
                live.push(p);
            }
            Err(e) => lost.push((p, e)),
        }
    }
    let ep = match bound.start(table) {
        Ok(ep) => ep,
        Err(e) => {
            ctx.fail(PsError::Endpoint(format!("starting it: {e}")));
            return;
        }
    };
    let mut net = Net {
        ep,
        ctx: ctx.clone(),
        agg: agg_tx.clone(),
        beats: Beats::new(ctx.heartbeat, &live, Instant::now()),
        open: live.iter().copied().collect(),
        ended: BTreeSet::new(),
        told_fail: BTreeSet::new(),
        busy: BTreeSet::new(),
        newest: BTreeMap::new(),
        sends: Vec::new(),
    };
    for &p in &live {
        let h = net.ep.submit(Inbox::new(p, ctx.clone(), agg_tx.clone()));
        let (c, agg) = (ctx.clone(), agg_tx.clone());
        h.on_complete(move |r| {
            if let Err(e) = r {
                layer_error(&c, p, e, &agg);
            }
        });
    }
    for (p, e) in lost {
        net.ended.insert(p);
        link_error(ctx, p, e, &agg_tx);
    }
    drop(agg_tx);
    aggregate(ctx, &agg_rx, &mut net);
    net.finish(&agg_rx);
}
