//! Chunk channels: every ordered pair of nodes carries a sequence of model chunks, each with
//! its metadata, as **messages of the node's one message-layer endpoint** (`gradwire-msg`):
//! one socket per node for every peer, no thread per link, no handshake per chunk.
//!
//! A chunk is one reliable message, sized by the sender:
//!
//! ```text
//! off  size  field
//! 0    4     data_len   bytes of values (at most MAX_CHUNK_BYTES)
//! 4    1     dtype      the values' dtype code
//! 5    8     sent_ns    the sender's send time, nanoseconds on its own clock
//! 13   2     meta_len   bytes of the caller's metadata (at most MAX_META)
//! 15   ..    meta       the caller's metadata (NetStorm's chunk header frame)
//! ..   ..    values     data_len bytes
//! ```
//!
//! The message's length must be exactly `15 + meta_len + data_len`; anything else ends the
//! channel from that peer with an error naming it.
//!
//! **Receiving.** Each node keeps [`ChannelConfig::depth`] receives posted per peer
//! ([`RecvOpts::up_to`]: the sender decides each chunk's length, at most the posted
//! `HEAD + MAX_META + max_chunk_bytes`, so a peer can never make this node allocate more per
//! posted receive; a longer message is refused by the layer, segment by segment, and never
//! placed). The receives are *patient* ([`RecvOpts::patient`]): a peer that has nothing to
//! send for a long time (it is not in this node's trees, or it computes) keeps them waiting
//! as long as it answers; a peer that stops answering fails them after the endpoint's peer
//! timeout, and a peer whose socket closed (it finished, or its process died) fails them
//! as soon as its host says so. Chunks are delivered in the order they were sent, each
//! receive's buffer reused for the next chunk.
//!
//! **Sending.** At most [`ChannelConfig::depth`] chunks per peer are messages at a time,
//! as many as the peer keeps receives posted; the others wait in the channels and go as
//! deliveries free slots ([`Channels::pump`]). A message the receiver has not posted
//! acknowledges no progress, which the layer's sender would take for a lost window.
//!
//! **Budgets.** What a peer can make this node hold is bounded per peer by
//! [`ChannelConfig::peer_budget`] (default [`DEFAULT_PEER_BUDGET`], raised to
//! [`budget_for_model`] of the model the node synchronizes): the bytes of its chunks
//! delivered on [`Channels::events`] and not yet taken by the node ([`Channels::taken`]),
//! and the bytes of relays it asked for that wait beyond the depth for a slow next hop
//! ([`Channels::relay`]). A peer past either fails: its channel ends with an
//! [`Event::Failed`] naming it and the budget, or the relay is refused naming it. A correct
//! peer is at most one round ahead (the consistency module's rounds), so it never comes
//! near a budget of a few models.
//!
//! **Passive awareness.** The layer reports when a message's first and last segments
//! arrived ([`RecvReport::first_at`], [`RecvReport::last_at`]); with the sender's send time
//! in the header that is the [`ChunkSample`] of [`gradwire_netstorm::awareness`].
//!
//! **Independence.** The streams and sends are *isolated* operations
//! ([`Op::isolated`]): the failure of one link ends that link only, so a node that finished
//! and left does not fail the links between the nodes still running. Whether a link's end
//! fails the node is the round loop's decision ([`crate::node`]).
//!
//! Both ends number a link's messages the same way (the layer reserves them in submission
//! order: the sender's sends to a peer, the receiver's receives from it), so no id travels
//! besides the layer's own.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use gradwire_msg::core::{MsgError, RecvOpts, RecvReport, SendOpts};
use gradwire_msg::endpoint::{Endpoint, EndpointStats};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};
use gradwire_netstorm::awareness::ChunkSample;
use gradwire_proto::tensor::{DType, Tensor};

/// The chunk header's fixed part: data length, dtype, send time, metadata length.
pub const HEAD: usize = 4 + 1 + 8 + 2;
/// Largest caller metadata.
pub const MAX_META: usize = 2048 - HEAD;
/// Largest chunk's values (16 M f32, 16 x NetStorm's default CHUNK_SIZE): with the header,
/// bounds what a peer's message can make this end allocate per posted receive.
pub const MAX_CHUNK_BYTES: usize = 64 << 20;
/// Receives kept posted per peer when nothing else is said: enough for a sender's chunks to
/// be placed as they arrive rather than held by the layer.
pub const DEFAULT_DEPTH: usize = 4;
/// Bytes held for one peer when nothing else is said ([`ChannelConfig::peer_budget`]).
pub const DEFAULT_PEER_BUDGET: usize = 256 << 20;

/// The budget per peer for a model of `model_bytes` per round: the larger of
/// [`DEFAULT_PEER_BUDGET`] and 4 models. A correct peer is at most one round ahead, and
/// per round it sends this node at most about the model (pushes one way and results the
/// other share the model's chunks between them; relays are pushes on another path), so
/// two rounds with room to spare.
pub fn budget_for_model(model_bytes: usize) -> usize {
    DEFAULT_PEER_BUDGET.max(model_bytes.saturating_mul(4))
}

/// How the channels use the endpoint.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// DSCP of the data (the layer's control frames go at its control DSCP).
    pub dscp: u8,
    /// Largest chunk values this node accepts, bytes (at most [`MAX_CHUNK_BYTES`]): the
    /// size of each posted receive beside the header and [`MAX_META`].
    pub max_chunk_bytes: usize,
    /// Receives kept posted per peer (at least 1).
    pub depth: usize,
    /// Most bytes held for one peer, bytes: of its chunks delivered and not yet taken, and
    /// of the relays it asked for waiting beyond the depth (default
    /// [`DEFAULT_PEER_BUDGET`]; never below one chunk's message, [`ChannelConfig::recv_len`]).
    pub peer_budget: usize,
}

impl ChannelConfig {
    /// Chunks of at most `max_chunk_bytes` of values (clamped to [`MAX_CHUNK_BYTES`]) at
    /// `dscp`, [`DEFAULT_DEPTH`] receives per peer, [`DEFAULT_PEER_BUDGET`] per peer.
    pub fn new(dscp: u8, max_chunk_bytes: usize) -> ChannelConfig {
        ChannelConfig {
            dscp,
            max_chunk_bytes: max_chunk_bytes.min(MAX_CHUNK_BYTES),
            depth: DEFAULT_DEPTH,
            peer_budget: DEFAULT_PEER_BUDGET,
        }
    }

    /// Bytes of one posted receive: the largest message a peer may send.
    pub fn recv_len(&self) -> usize {
        HEAD + MAX_META + self.max_chunk_bytes.min(MAX_CHUNK_BYTES)
    }
}

/// One chunk to send.
#[derive(Debug)]
pub struct Outgoing {
    /// The caller's metadata (at most [`MAX_META`] bytes).
    pub meta: Vec<u8>,
    /// The values.
    pub data: Tensor,
}

/// One chunk received.
#[derive(Debug)]
pub struct Incoming {
    /// The sending node.
    pub from: usize,
    /// The caller's metadata.
    pub meta: Vec<u8>,
    /// The values.
    pub data: Tensor,
    /// The chunk's timing for link measurements (send time on the sender's clock, arrivals
    /// on this node's clock since the channels' epoch).
    pub sample: ChunkSample,
}

/// What the channels report.
#[derive(Debug)]
pub enum Event {
    /// A chunk arrived.
    Chunk(Box<Incoming>),
    /// A chunk was delivered to `to` (its queue shrank).
    Sent {
        /// The receiving node.
        to: usize,
    },
    /// The peer's socket closed (it finished, or its process ended): its channel ended.
    /// Whether that is a failure depends on what the node still expects from it.
    Closed {
        /// The other node.
        peer: usize,
    },
    /// The channel with `peer` failed (it went silent for the peer timeout, gave up, or
    /// broke the chunk format).
    Failed {
        /// The other node.
        peer: usize,
        /// What happened.
        error: String,
        /// The node the peer's own failure names, when the peer gave up because of a third
        /// node (it says which).
        culprit: Option<usize>,
    },
}

/// A node's chunk channels to and from every other node, over its endpoint.
#[derive(Debug)]
pub struct Channels {
    ep: Endpoint,
    cfg: ChannelConfig,
    epoch: Instant,
    events_tx: Sender<Event>,
    events: Receiver<Event>,
    /// Per peer: chunks queued here or being sent, and of those being sent.
    in_flight: Vec<Arc<AtomicUsize>>,
    sending: Vec<Arc<AtomicUsize>>,
    /// Per peer: encoded chunks waiting for a message slot, and their bytes.
    queued: Vec<VecDeque<Vec<u8>>>,
    queued_bytes: Vec<usize>,
    /// Per peer: bytes of its chunks delivered on the events and not yet taken.
    held: Vec<Arc<AtomicUsize>>,
    /// The budget per peer in force (the configured one, or raised since).
    budget: Arc<AtomicUsize>,
}

impl Channels {
    /// Channels over `ep` (started, with every node's address): posts the receives from
    /// every peer now.
    pub fn start(ep: Endpoint, cfg: ChannelConfig) -> Channels {
        let epoch = Instant::now();
        let (events_tx, events) = crossbeam_channel::unbounded();
        let (me, world) = (ep.rank(), ep.world());
        let held: Vec<_> = (0..world).map(|_| Arc::new(AtomicUsize::new(0))).collect();
        let budget = Arc::new(AtomicUsize::new(cfg.peer_budget));
        for peer in (0..world).filter(|&p| p != me) {
            let stream = ChunkStream {
                peer,
                depth: cfg.depth.max(1),
                len: cfg.recv_len(),
                epoch,
                events: events_tx.clone(),
                posted: VecDeque::new(),
                held: Arc::clone(&held[usize::from(peer)]),
                budget: Arc::clone(&budget),
            };
            let h = ep.submit(stream);
            let tx = events_tx.clone();
            h.on_complete(move |r| {
                if let Err(e) = r {
                    let _ = tx.send(link_ended(me, peer, &e));
                }
            });
        }
        Channels {
            in_flight: (0..world).map(|_| Arc::new(AtomicUsize::new(0))).collect(),
            sending: (0..world).map(|_| Arc::new(AtomicUsize::new(0))).collect(),
            queued: (0..world).map(|_| VecDeque::new()).collect(),
            queued_bytes: vec![0; usize::from(world)],
            held,
            budget,
            ep,
            cfg,
            epoch,
            events_tx,
            events,
        }
    }

    /// This node.
    pub fn rank(&self) -> usize {
        usize::from(self.ep.rank())
    }

    /// Nodes.
    pub fn world(&self) -> usize {
        usize::from(self.ep.world())
    }

    /// The configuration.
    pub fn config(&self) -> &ChannelConfig {
        &self.cfg
    }

    /// What the channels report, in order per peer.
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Chunks sent to `to` (queued or being sent) and not yet delivered (0 for no such
    /// peer).
    pub fn in_flight(&self, to: usize) -> usize {
        self.in_flight
            .get(to)
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// The endpoint's counters (datagrams, refusals, resends).
    pub fn stats(&self) -> EndpointStats {
        self.ep.stats()
    }

    /// The node took a chunk of `from` off the events: `bytes`, its `sample.bytes`, no
    /// longer count against `from`'s budget. The node calls it for every
    /// [`Event::Chunk`] it receives.
    pub fn taken(&self, from: usize, bytes: u64) {
        if let Some(h) = self.held.get(from) {
            let n = usize::try_from(bytes).unwrap_or(usize::MAX);
            // Never below zero, whatever the caller says.
            let _ = h.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(n))
            });
        }
    }

    /// Bytes of `from`'s chunks delivered on the events and not yet [taken](Channels::taken).
    pub fn held(&self, from: usize) -> usize {
        self.held.get(from).map_or(0, |h| h.load(Ordering::Acquire))
    }

    /// Bytes of chunks for `to` waiting beyond the depth.
    pub fn queued_bytes(&self, to: usize) -> usize {
        self.queued_bytes.get(to).copied().unwrap_or(0)
    }

    /// The budget per peer in force ([`ChannelConfig::peer_budget`], or raised since).
    pub fn budget(&self) -> usize {
        self.budget.load(Ordering::Acquire)
    }

    /// Raises the budget per peer to `bytes` if it is below (it never goes down: chunks
    /// held under a higher one stay valid). The node raises it to [`budget_for_model`] of
    /// the model it synchronizes.
    pub fn raise_budget(&self, bytes: usize) {
        self.budget.fetch_max(bytes, Ordering::AcqRel);
    }

    /// Sends a chunk to `to`; its delivery or failure comes as an [`Event`]. Refuses
    /// (without sending) metadata above [`MAX_META`], values above
    /// [`ChannelConfig::max_chunk_bytes`] and a peer that is not another node.
    ///
    /// At most [`ChannelConfig::depth`] chunks per peer are messages at a time, as many as
    /// the peer keeps receives posted; the others wait here, and [`Channels::pump`] (on
    /// every [`Event::Sent`]) sends them. A message the receiver has not posted yet makes
    /// no progress it acknowledges, so the layer would count the sender's window as lost
    /// every RTO and halve it (measured on wan9: rounds of 80-100 s instead of 6-11 s).
    pub fn send(&mut self, to: usize, chunk: &Outgoing) -> Result<(), String> {
        let bytes = self.encode(to, chunk)?;
        self.enqueue(to, bytes);
        Ok(())
    }

    /// Sends a chunk to `to` that node `asked_by` asked this node to relay (an auxiliary
    /// path's next hop), as [`Channels::send`] does, unless the chunks waiting for `to`
    /// beyond the depth would then pass the budget per peer: then the relay is refused
    /// with an error naming `asked_by` (a correct node never asks for that much: the next
    /// hop is too slow, or `asked_by` floods it through this node), and nothing is sent.
    pub fn relay(&mut self, to: usize, chunk: &Outgoing, asked_by: usize) -> Result<(), String> {
        let bytes = self.encode(to, chunk)?;
        let (queued, budget) = (self.queued_bytes(to), self.budget());
        if self.sending_now(to) >= self.cfg.depth.max(1)
            && queued.saturating_add(bytes.len()) > budget
        {
            return Err(format!(
                "node {asked_by} asked for a relay to node {to}, which has {queued} bytes \
                 waiting here already: another {} would pass the {budget}-byte budget per \
                 peer (the next hop is too slow, or node {asked_by} floods it; if correct runs \
                 hit this, raise the budget: NodeConfig::peer_budget)",
                bytes.len()
            ));
        }
        self.enqueue(to, bytes);
        Ok(())
    }

    /// Chunks to `to` that are messages now.
    fn sending_now(&self, to: usize) -> usize {
        self.sending
            .get(to)
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// `chunk` for `to` as its message, or why it cannot be sent.
    fn encode(&self, to: usize, chunk: &Outgoing) -> Result<Vec<u8>, String> {
        u16::try_from(to)
            .ok()
            .filter(|&p| p != self.ep.rank() && p < self.ep.world())
            .ok_or_else(|| format!("node {to} is not another node of the job"))?;
        if chunk.data.len_bytes() > self.cfg.max_chunk_bytes {
            return Err(format!(
                "a chunk of {} bytes is above this job's {} (chunk_size x 4)",
                chunk.data.len_bytes(),
                self.cfg.max_chunk_bytes
            ));
        }
        encode_chunk(&chunk.meta, &chunk.data, self.epoch.elapsed())
    }

    /// Queues `bytes` for `to` (a peer checked by [`Channels::encode`]) and sends what may go.
    fn enqueue(&mut self, to: usize, bytes: Vec<u8>) {
        self.in_flight[to].fetch_add(1, Ordering::AcqRel);
        self.queued_bytes[to] += bytes.len();
        self.queued[to].push_back(bytes);
        self.pump(to);
    }

    /// Sends what waits for `to` while fewer than [`ChannelConfig::depth`] of its chunks
    /// are messages. The node calls it on every [`Event::Sent`].
    pub fn pump(&mut self, to: usize) {
        let Ok(peer) = u16::try_from(to) else {
            return;
        };
        let depth = self.cfg.depth.max(1);
        while self
            .sending
            .get(to)
            .is_some_and(|c| c.load(Ordering::Acquire) < depth)
        {
            let Some(bytes) = self.queued[to].pop_front() else {
                return;
            };
            self.queued_bytes[to] = self.queued_bytes[to].saturating_sub(bytes.len());
            self.submit(peer, bytes);
        }
    }

    fn submit(&self, peer: u16, bytes: Vec<u8>) {
        let to = usize::from(peer);
        let (counter, sending) = (
            Arc::clone(&self.in_flight[to]),
            Arc::clone(&self.sending[to]),
        );
        sending.fetch_add(1, Ordering::AcqRel);
        let tos = (self.cfg.dscp << 2) | 0b10; // ECN-capable (ECT(0)), as the flows were
                                               // One chunk: a reliable, isolated message at the chunk's TOS.
        let opts = SendOpts {
            tos,
            ..SendOpts::default()
        };
        let h = self
            .ep
            .submit(gradwire_msg::p2p::Send::new(Region::owned(bytes), peer, opts).isolated());
        let tx = self.events_tx.clone();
        let me = self.ep.rank();
        h.on_complete(move |r| {
            sending.fetch_sub(1, Ordering::AcqRel);
            counter.fetch_sub(1, Ordering::AcqRel);
            let ev = match r {
                Ok(_) => Event::Sent { to },
                Err(e) => match link_ended(me, peer, &e) {
                    // A peer that left while this node still sends to it broke the link.
                    Event::Closed { .. } => Event::Failed {
                        peer: to,
                        error: e.to_string(),
                        culprit: None,
                    },
                    ev => ev,
                },
            };
            let _ = tx.send(ev);
        });
    }

    /// This node fails because of node `culprit`: every peer gives up its links with this
    /// node naming `culprit` (an ABORT of everything, sent even if the node exits at once),
    /// so a node that hears of it first through this node's leaving still names `culprit`.
    pub fn give_up(&self, culprit: usize) {
        if let Ok(c) = u16::try_from(culprit) {
            self.ep.abort_all(c);
        }
    }

    /// Waits up to `timeout` until every chunk sent has been delivered (or failed), sending
    /// what still waits; whether they all were. Chunks that arrive meanwhile are dropped:
    /// for a node that has its results.
    pub fn flush(&mut self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            if self
                .in_flight
                .iter()
                .all(|c| c.load(Ordering::Acquire) == 0)
            {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            // A failed send ends its count too; nothing else waits here.
            match self.events.recv_timeout(Duration::from_millis(5)) {
                Ok(Event::Sent { to }) => self.pump(to),
                Ok(Event::Chunk(c)) => self.taken(c.from, c.sample.bytes),
                _ => {}
            }
        }
    }
}

/// The event for a link whose operation with `peer` failed with `e`, on node `me`.
fn link_ended(me: u16, peer: u16, e: &OpError) -> Event {
    let p = usize::from(peer);
    match e {
        OpError::Peer(MsgError::Unreachable { .. }) => Event::Closed { peer: p },
        OpError::Peer(MsgError::Aborted {
            culprit: Some(c), ..
        }) if *c != peer && *c != me => Event::Failed {
            peer: p,
            error: e.to_string(),
            culprit: Some(usize::from(*c)),
        },
        _ => Event::Failed {
            peer: p,
            error: e.to_string(),
            culprit: None,
        },
    }
}

/// A posted receive of the stream: its message number, buffer and, once finished, report.
#[derive(Debug)]
struct Posted {
    msg: u32,
    buf: BufId,
    done: Option<RecvReport>,
}

/// The receiving end of one peer's channel: `depth` receives kept posted, chunks decoded
/// and reported in message order, each buffer reposted for the next chunk. It runs until
/// the link fails (its error is the handle's) or the node stops listening.
#[derive(Debug)]
struct ChunkStream {
    peer: u16,
    depth: usize,
    len: usize,
    epoch: Instant,
    events: Sender<Event>,
    posted: VecDeque<Posted>,
    /// Bytes of this peer's chunks delivered and not yet taken by the node.
    held: Arc<AtomicUsize>,
    /// The budget per peer in force.
    budget: Arc<AtomicUsize>,
}

impl ChunkStream {
    fn post(&mut self, cx: &mut OpCx<'_>, buf: BufId) -> Result<(), OpError> {
        let msg = cx.reserve_recvs(self.peer, 1)?;
        let opts = RecvOpts {
            up_to: true,
            patient: true,
            ..RecvOpts::default()
        };
        cx.recv(self.peer, msg, buf, 0..self.len, opts)?;
        self.posted.push_back(Posted {
            msg,
            buf,
            done: None,
        });
        Ok(())
    }

    fn refuse(&self, reason: String) -> OpError {
        OpError::Data {
            peer: self.peer,
            reason,
        }
    }
}

impl Op for ChunkStream {
    type Output = ();

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<()> {
        for _ in 0..self.depth {
            let buf = cx.register(Region::owned(vec![0; self.len]));
            self.post(cx, buf)?;
        }
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<()> {
        let OpEvent::Received { msg, report, .. } = ev else {
            return Ok(None);
        };
        if let Some(p) = self.posted.iter_mut().find(|p| p.msg == msg) {
            p.done = Some(report);
        }
        // In message order: a later chunk that finished first waits for the earlier one.
        while self.posted.front().is_some_and(|p| p.done.is_some()) {
            let Some(Posted {
                buf,
                done: Some(report),
                ..
            }) = self.posted.pop_front()
            else {
                break;
            };
            // The budget first: a peer past it gets nothing more delivered (nor decoded).
            let n = report.len as usize;
            let budget = self.budget.load(Ordering::Acquire).max(self.len);
            let held = self.held.load(Ordering::Acquire);
            if held.saturating_add(n) > budget {
                return Err(self.refuse(format!(
                    "{held} bytes of its chunks wait here for the node to take them, and \
                     another {n} would pass the {budget}-byte budget per peer: a correct peer \
                     is at most one round ahead (if correct runs hit this, raise the budget: \
                     NodeConfig::peer_budget, ChannelConfig::peer_budget)"
                )));
            }
            if report.missing != 0 {
                return Err(self.refuse(format!(
                    "a chunk ended with {} of {} segments missing on a reliable channel",
                    report.missing, report.segments
                )));
            }
            let bytes = cx
                .buf(buf)
                .get(..report.len as usize)
                .ok_or_else(|| self.refuse("a chunk longer than its buffer".into()))?;
            let (data, sent_ns, meta) =
                decode_chunk(bytes).map_err(|e| self.refuse(format!("invalid chunk: {e}")))?;
            let since = |t: Option<Instant>| {
                t.map_or(Duration::ZERO, |t| t.saturating_duration_since(self.epoch))
            };
            let sample = ChunkSample {
                bytes: u64::from(report.len),
                sent_at: Duration::from_nanos(sent_ns),
                first_arrival: since(report.first_at),
                last_arrival: since(report.last_at.or(report.first_at)),
                packets: report.segments.saturating_sub(report.missing),
            };
            let chunk = Incoming {
                from: usize::from(self.peer),
                meta,
                data,
                sample,
            };
            // Counted before it is on the events, so the node's `taken` never comes first.
            self.held.fetch_add(n, Ordering::AcqRel);
            if self.events.send(Event::Chunk(Box::new(chunk))).is_err() {
                // Nobody listens any more: the node has stopped.
                return Ok(Some(()));
            }
            self.post(cx, buf)?;
        }
        Ok(None)
    }

    fn isolated(&self) -> bool {
        true
    }
}

/// A chunk's message: the header, the caller's metadata, the values.
pub fn encode_chunk(meta: &[u8], data: &Tensor, sent: Duration) -> Result<Vec<u8>, String> {
    if meta.len() > MAX_META {
        return Err(format!(
            "chunk metadata of {} bytes is above {MAX_META}",
            meta.len()
        ));
    }
    let values = data.as_bytes();
    let len = u32::try_from(values.len())
        .ok()
        .filter(|&b| b as usize <= MAX_CHUNK_BYTES)
        .ok_or_else(|| {
            format!(
                "a chunk of {} bytes is above {MAX_CHUNK_BYTES}",
                values.len()
            )
        })?;
    let mut b = Vec::with_capacity(HEAD + meta.len() + values.len());
    b.extend_from_slice(&len.to_be_bytes());
    b.push(data.dtype().code());
    b.extend_from_slice(&(sent.as_nanos() as u64).to_be_bytes());
    b.extend_from_slice(&(meta.len() as u16).to_be_bytes());
    b.extend_from_slice(meta);
    b.extend_from_slice(values);
    Ok(b)
}

/// Parse a chunk's message: (values, send time ns, caller metadata). The message must be
/// exactly as long as its header says.
pub fn decode_chunk(b: &[u8]) -> Result<(Tensor, u64, Vec<u8>), String> {
    let head = b
        .get(..HEAD)
        .ok_or("a chunk message shorter than its header")?;
    let bytes = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if bytes > MAX_CHUNK_BYTES {
        return Err(format!(
            "a chunk of {bytes} bytes announced, above {MAX_CHUNK_BYTES}"
        ));
    }
    let dtype =
        DType::from_code(head[4]).ok_or_else(|| format!("unknown dtype code {}", head[4]))?;
    let mut ns = [0u8; 8];
    ns.copy_from_slice(&head[5..13]);
    let meta_len = usize::from(u16::from_be_bytes([head[13], head[14]]));
    if meta_len > MAX_META {
        return Err(format!(
            "chunk metadata of {meta_len} bytes, above {MAX_META}"
        ));
    }
    if b.len() != HEAD + meta_len + bytes {
        return Err(format!(
            "a chunk message of {} bytes for a header saying {} (metadata {meta_len}, values \
             {bytes})",
            b.len(),
            HEAD + meta_len + bytes
        ));
    }
    let mut data = Tensor::zeros_bytes(dtype, bytes)
        .ok_or_else(|| format!("{bytes} bytes of {dtype} are not whole elements"))?;
    data.as_bytes_mut().copy_from_slice(&b[HEAD + meta_len..]);
    Ok((
        data,
        u64::from_be_bytes(ns),
        b[HEAD..HEAD + meta_len].to_vec(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any chunk the encoder writes decodes to what was encoded, and decoding is
        /// canonical: a message that decodes re-encodes to exactly its own bytes.
        #[test]
        fn chunks_round_trip_and_decoding_is_canonical(
            code in 0u8..4,
            elems in 0usize..300,
            meta in proptest::collection::vec(any::<u8>(), 0..64),
            ns in any::<u64>(),
            seed in any::<u64>(),
        ) {
            let dtype = DType::from_code(code).unwrap();
            let mut data = Tensor::zeros(dtype, elems);
            data.fill_pattern(seed);
            let t = encode_chunk(&meta, &data, Duration::from_nanos(ns)).unwrap();
            let (back, got_ns, got_meta) = decode_chunk(&t).unwrap();
            prop_assert_eq!(back.dtype(), dtype);
            prop_assert_eq!(got_ns, ns);
            prop_assert_eq!(&got_meta, &meta);
            prop_assert!(back.as_bytes() == data.as_bytes());
            let again = encode_chunk(&got_meta, &back, Duration::from_nanos(got_ns)).unwrap();
            prop_assert!(again == t);
        }

        /// Arbitrary bytes never panic the decoder, and what it accepts is exactly as long
        /// as its header says and re-encodes to the same bytes.
        #[test]
        fn arbitrary_bytes_never_panic_and_accepted_messages_are_canonical(
            b in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            if let Ok((data, ns, meta)) = decode_chunk(&b) {
                prop_assert_eq!(b.len(), HEAD + meta.len() + data.len_bytes());
                let again = encode_chunk(&meta, &data, Duration::from_nanos(ns)).unwrap();
                prop_assert!(again == b);
            }
        }
    }

    #[test]
    fn chunks_round_trip_and_bad_headers_are_refused() {
        let mut data = Tensor::zeros(DType::F32, 1024);
        data.fill_pattern(3);
        let t = encode_chunk(b"hello", &data, Duration::from_nanos(77)).unwrap();
        let (back, ns, meta) = decode_chunk(&t).unwrap();
        assert_eq!(
            (back.dtype(), ns, meta.as_slice()),
            (DType::F32, 77, &b"hello"[..])
        );
        assert!(back.as_bytes() == data.as_bytes());
        assert!(encode_chunk(&[0; MAX_META + 1], &data, Duration::ZERO).is_err());
        // Unknown dtype, metadata past the end, a huge length, a short or long message.
        let mut b = t.clone();
        b[4] = 99;
        assert!(decode_chunk(&b).is_err());
        let mut b = t.clone();
        b[13..15].copy_from_slice(&u16::MAX.to_be_bytes());
        assert!(decode_chunk(&b).is_err());
        let mut b = t.clone();
        b[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_chunk(&b).is_err());
        assert!(decode_chunk(&t[..3]).is_err());
        assert!(decode_chunk(&t[..t.len() - 1]).is_err());
        let mut b = t.clone();
        b.push(0);
        assert!(decode_chunk(&b).is_err());
        // Values that are not whole elements of their dtype.
        let mut b = t.clone();
        b[0..4].copy_from_slice(&4095u32.to_be_bytes());
        b.pop();
        assert!(decode_chunk(&b).is_err());
    }

    #[test]
    fn a_posted_receive_holds_the_largest_chunk_and_no_more() {
        let c = ChannelConfig::new(10, 4 * 700);
        assert_eq!(c.recv_len(), HEAD + MAX_META + 2800);
        // The configured bound never exceeds the format's.
        let c = ChannelConfig::new(10, usize::MAX);
        assert_eq!(c.max_chunk_bytes, MAX_CHUNK_BYTES);
        assert_eq!(c.recv_len(), HEAD + MAX_META + MAX_CHUNK_BYTES);
    }
}
