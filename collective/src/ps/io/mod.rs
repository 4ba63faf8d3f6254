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

mod inbox;
mod setup;

use inbox::Inbox;
pub(in crate::ps) use setup::bind;
use setup::exchange;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradwire::auth::MemberEntry;
use gradwire_msg::core::SendOpts;
use gradwire_msg::endpoint::{Bound, Endpoint};
use gradwire_msg::mem::Region;
use gradwire_msg::op::{Handle, OpError};

use crate::error::CollectiveError;
use crate::link::Links;
use crate::ps::core::{publish, Agg, AggIn, Beats, Liveness, Out, PushMsg, VersionMsg};
use crate::ps::state::Ctx;
use crate::ps::types::PsError;
use crate::ps::wire::{encode_msg, Header, Kind, F_EMPTY, F_SIDE, MAX_REASON};

/// The data's TOS byte: best effort, ECN-capable (what the flows sent).
const DATA_TOS: u8 = 0b10;

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
pub(super) fn layer_error(ctx: &Ctx, peer: usize, e: OpError, agg: &Sender<AggIn>) {
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

/// The sending side of the node: the endpoint, and per link what is in flight.
struct Net {
    ep: Endpoint,
    ctx: Arc<Ctx>,
    agg: Sender<AggIn>,
    beats: Beats,
    liveness: Liveness,
    /// Links that still carry messages (not failed, Bye not sent).
    open: BTreeSet<usize>,
    /// Links that ended: the peer's Bye arrived, or the link failed.
    ended: BTreeSet<usize>,
    told_fail: BTreeSet<usize>,
    /// Child links with a version in flight (its messages not yet acknowledged), and the
    /// newest one waiting behind it.
    busy: BTreeMap<usize, u32>,
    newest: BTreeMap<usize, Arc<VersionMsg>>,
    sends: Vec<Handle<gradwire_msg::p2p::SendDone>>,
}

impl Net {
    fn send(&mut self, peer: usize, bytes: Vec<u8>, notify: bool) {
        // One message of the link: isolated (a dead peer ends this link only; the node
        // routes around it).
        let opts = SendOpts {
            tos: DATA_TOS,
            ..SendOpts::default()
        };
        let h = self.ep.submit(
            gradwire_msg::p2p::Send::new(Region::owned(bytes), peer as u16, opts).isolated(),
        );
        let (ctx, agg) = (self.ctx.clone(), self.agg.clone());
        h.on_complete(move |r| match r {
            Ok(_) if notify => {
                let _ = agg.send(AggIn::Sent(peer));
            }
            Ok(_) => {}
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
            Out::Weights(v) if self.busy.contains_key(&peer) => {
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
            Out::Digest { clock, digest } => {
                let mut h = Header::new(Kind::Digest, 0, clock);
                h.len = digest.len() as u32;
                self.header(peer, &h, &digest);
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
        self.send(peer, m.weights.as_bytes().to_vec(), true);
        let mut in_flight = 1;
        if let Some(c) = &m.block_clocks {
            self.bytes_sent(c.len());
            self.send(peer, c.clone(), true);
            in_flight += 1;
        }
        self.busy.insert(peer, in_flight);
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
        // Only where the peer takes it from this rank (it is below, or the failed rank is).
        let me = self.ctx.rank;
        if !(self.ctx.below(me, peer) || self.ctx.below(me, note.origin)) {
            return;
        }
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

    /// Links silent for `failure_timeout` have failed.
    fn watch(&mut self) {
        let ctx = self.ctx.clone();
        for p in self.liveness.silent(Instant::now()) {
            let e = CollectiveError::Peer {
                peer: p,
                reason: format!(
                    "rank {p} sent nothing (no message, no heartbeat) for {:?}: it is dead, hung or cut off",
                    ctx.failure_timeout
                ),
            };
            link_error(&ctx, p, e.into(), &self.agg);
        }
    }

    /// Failure news, heartbeats on idle links, silent links, and forgetting finished sends.
    fn tick(&mut self) {
        self.watch();
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
                let left = self.busy.get(&peer).map_or(0, |n| n.saturating_sub(1));
                if left > 0 {
                    self.busy.insert(peer, left);
                    return None;
                }
                self.busy.remove(&peer);
                if let Some(v) = self.newest.remove(&peer) {
                    if self.open.contains(&peer) {
                        self.weights(peer, &v);
                    }
                }
                None
            }
            AggIn::Heard { peer, busy } => {
                self.liveness.heard(peer, Instant::now(), busy);
                None
            }
            AggIn::Bye(peer) => {
                self.ended.insert(peer);
                self.liveness.stop(peer);
                Some(AggIn::Bye(peer))
            }
            AggIn::Down { peer, reason } => {
                self.ended.insert(peer);
                self.liveness.stop(peer);
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
            if !ctx.shared.has_failed() {
                for p in self.open.clone() {
                    self.bye(p);
                }
            }
        }
        let mut all_ended: Option<Instant> = None;
        while !ctx.shared.forced() {
            self.watch();
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
        agg.send_digests();
    }
    net.flush(&mut agg);
    loop {
        if ctx.shared.forced() || agg.broken {
            break;
        }
        if agg.may_leave() && !ctx.shared.has_failed() {
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
pub(in crate::ps) fn node_main(
    mut links: Links,
    bound: Bound,
    ctx: &Arc<Ctx>,
    agg_tx: Sender<AggIn>,
    agg_rx: Receiver<AggIn>,
) {
    let me = bound.local_addr();
    let mine = bound.member();
    let addrs = exchange(&mut links, me, mine, ctx);
    drop(links);
    // Ranks without a link get an address nobody has (they are never sent to).
    let mut table: Vec<SocketAddr> = (0..ctx.world)
        .map(|r| SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), (r % 65_535 + 1) as u16))
        .collect();
    table[ctx.rank] = me;
    let mut members: Vec<Option<MemberEntry>> = vec![None; ctx.world];
    let mut live = Vec::new();
    let mut lost = Vec::new();
    for (p, r) in addrs {
        match r {
            // Both authenticated or both plain: the links' handshake already refused a
            // secret on one side only, so a mismatch here is a peer that lies.
            Ok((_, m)) if m.is_some() != mine.is_some() => lost.push((
                p,
                PsError::Protocol {
                    peer: p,
                    what: "its message-layer member key at set-up does not match the job's \
                           authentication"
                        .into(),
                },
            )),
            Ok((a, m)) => {
                table[p] = a;
                members[p] = m;
                live.push(p);
            }
            Err(e) => lost.push((p, e)),
        }
    }
    let started = match mine {
        None => bound.start(table),
        Some(_) => bound.start_sealed(table, &members),
    };
    let ep = match started {
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
        liveness: Liveness::new(ctx.failure_timeout),
        open: live.iter().copied().collect(),
        ended: BTreeSet::new(),
        told_fail: BTreeSet::new(),
        busy: BTreeMap::new(),
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
