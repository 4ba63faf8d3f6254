//! The node's I/O: per link a sending and a receiving thread over the link's flows, and the
//! owning thread that runs the aggregator.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Instant;

use gradwire::flow::{fixed_priority, Tag};
use gradwire::message::{LossBound, Stage};
use gradwire::tensor::{DType, Tensor};
use gradwire::transport::{MissingFill, RecvOptions, RecvReport, SendOptions};

use super::api::PsError;
use super::core::{
    merge_blocks, publish, sets_within, Agg, AggIn, ChildSum, Out, PushMsg, VersionMsg,
};
use super::state::{raw_tensor, Ctx, FailNote};
use super::wire::{decode_clocks, Header, Kind, F_EMPTY, F_SIDE, HEADER_LEN, MAX_REASON};
use crate::aggregate::{arrived_blocks, Contributors};
use crate::error::CollectiveError;
use crate::link::{InLink, Links, OutLink};

// Flow ids: a kind in bits 27..31 (the communicator uses 1..=6), the sets/clock flow of a data
// flow with bit 31.
pub(super) const T_HEADER: u32 = 7 << 27;
pub(super) const T_PUSH: u32 = 8 << 27;
pub(super) const T_WEIGHTS: u32 = 9 << 27;
pub(super) const T_FAIL: u32 = 10 << 27;
pub(super) const T_TREE: u32 = 11 << 27;
pub(super) const SIDE_BIT: u32 = 1 << 31;

// ---------------------------------------------------------------------------------------------
// Link I/O.

pub(super) fn send_flow(
    ol: &mut OutLink,
    t: &Tensor,
    tensor: u32,
    round: u32,
    stage: Stage,
    bound: LossBound,
    ctx: &Ctx,
) -> Result<u64, PsError> {
    let opts = SendOptions {
        job: ctx.job,
        tensor,
        round,
        layer: 0,
        stage,
        loss_bound: Some(bound),
    };
    let prio = fixed_priority(Tag { dscp: 0, ect: true });
    let peer = ol.peer();
    let r = ol
        .send(t, &opts, &prio, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?;
    Ok(r.stats.payload_bytes)
}

pub(super) fn recv_flow(
    il: &mut InLink,
    t: &mut Tensor,
    tensor: u32,
    round: u32,
    bound: LossBound,
    ctx: &Ctx,
) -> Result<RecvReport, PsError> {
    let opts = RecvOptions {
        job: ctx.job,
        tensor,
        round: Some(round),
        loss_bound: Some(bound),
        fill: MissingFill::Zero,
        max_bytes: None,
    };
    let peer = il.peer();
    Ok(il
        .recv(t, &opts, &ctx.transfer)
        .map_err(CollectiveError::link(peer))?)
}

/// One link's sending end: its message counter and when it last sent.
pub(super) struct Tx<'a> {
    pub(super) ol: &'a mut OutLink,
    pub(super) seq: u32,
    pub(super) stage: Stage,
    pub(super) last: Instant,
}

impl Tx<'_> {
    pub(super) fn header(&mut self, h: &Header, ctx: &Ctx) -> Result<(), PsError> {
        let t = raw_tensor(&h.encode());
        send_flow(
            self.ol,
            &t,
            T_HEADER,
            self.seq,
            self.stage,
            LossBound::RELIABLE,
            ctx,
        )?;
        self.seq = self.seq.wrapping_add(1);
        self.last = Instant::now();
        Ok(())
    }

    /// A message's data: `values` with the hop's loss bound, then, when there is one, its
    /// side information (contributor sets or block clocks) as a reliable flow. Returns the
    /// payload bytes sent.
    pub(super) fn data(
        &mut self,
        values: &Tensor,
        side: Option<&[u8]>,
        kind: u32,
        clock: u64,
        stage: Stage,
        ctx: &Ctx,
    ) -> Result<u64, PsError> {
        let round = clock as u32;
        let mut bytes = send_flow(self.ol, values, kind, round, stage, ctx.hop_bound, ctx)?;
        if let Some(side) = side {
            let t = raw_tensor(side);
            let bound = LossBound::RELIABLE;
            bytes += send_flow(self.ol, &t, kind | SIDE_BIT, round, stage, bound, ctx)?;
        }
        Ok(bytes)
    }

    pub(super) fn push(&mut self, m: &PushMsg, epoch: u64, ctx: &Ctx) -> Result<(), PsError> {
        let mut flags = 0;
        if m.values.is_none() {
            flags |= F_EMPTY;
        } else if m.sets.is_some() {
            flags |= F_SIDE;
        }
        let mut h = Header::new(Kind::Push, flags, m.clock);
        h.len = u32::try_from(epoch).unwrap_or(u32::MAX);
        self.header(&h, ctx)?;
        let bytes = match &m.values {
            Some(v) => self.data(v, m.sets.as_deref(), T_PUSH, m.clock, Stage::Push, ctx)?,
            None => 0,
        };
        ctx.shared
            .counters
            .bytes_sent
            .fetch_add(bytes, Ordering::Relaxed);
        self.last = Instant::now();
        Ok(())
    }

    pub(super) fn weights(&mut self, m: &VersionMsg, ctx: &Ctx) -> Result<(), PsError> {
        let flags = if m.block_clocks.is_some() { F_SIDE } else { 0 };
        self.header(&Header::new(Kind::Weights, flags, m.clock), ctx)?;
        let side = m.block_clocks.as_deref();
        let bytes = self.data(&m.weights, side, T_WEIGHTS, m.clock, self.stage, ctx)?;
        ctx.shared
            .counters
            .bytes_sent
            .fetch_add(bytes, Ordering::Relaxed);
        ctx.shared
            .counters
            .versions_sent
            .fetch_add(1, Ordering::Relaxed);
        self.last = Instant::now();
        Ok(())
    }

    pub(super) fn tree(&mut self, dead: &[usize], ctx: &Ctx) -> Result<(), PsError> {
        let mut h = Header::new(Kind::Tree, 0, dead.len() as u64);
        h.len = u32::try_from(dead.len()).unwrap_or(u32::MAX);
        let round = self.seq;
        self.header(&h, ctx)?;
        let bytes: Vec<u8> = dead
            .iter()
            .flat_map(|&r| (r as u64).to_le_bytes())
            .collect();
        send_flow(
            self.ol,
            &raw_tensor(&bytes),
            T_TREE,
            round,
            self.stage,
            LossBound::RELIABLE,
            ctx,
        )?;
        Ok(())
    }

    pub(super) fn fail(&mut self, note: &FailNote, ctx: &Ctx) -> Result<(), PsError> {
        let mut reason = note.reason.clone();
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
        let round = self.seq;
        self.header(&h, ctx)?;
        let t = raw_tensor(reason.as_bytes());
        send_flow(
            self.ol,
            &t,
            T_FAIL,
            round,
            self.stage,
            LossBound::RELIABLE,
            ctx,
        )?;
        Ok(())
    }
}

/// What a link thread's error means: with route-around, a link failure marks the peer as
/// suspect (the aggregator decides); otherwise, and for protocol errors, the node fails.
pub(super) fn link_error(ctx: &Ctx, peer: usize, e: PsError, agg: &Sender<AggIn>) {
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

/// A link's sending thread: messages from `rx` in order (newest weights only), heartbeats
/// when idle, failure news once, Bye at the end.
pub(super) fn sender_loop(ol: &mut OutLink, rx: Receiver<Out>, ctx: &Ctx, agg: Sender<AggIn>) {
    let peer = ol.peer();
    let mut tx = Tx {
        ol,
        seq: 0,
        stage: Stage::Pull,
        last: Instant::now(),
    };
    let mut told_fail = false;
    let mut stash: Option<Out> = None;
    let r = (|| -> Result<(), PsError> {
        loop {
            if !told_fail {
                if let Some(note) = ctx.shared.note_for(peer) {
                    told_fail = true;
                    tx.fail(&note, ctx)?;
                }
            }
            if ctx.shared.forced() {
                return Ok(());
            }
            let msg = match stash.take() {
                Some(m) => m,
                None => match rx.recv_timeout(ctx.poll) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => {
                        if tx.last.elapsed() >= ctx.heartbeat {
                            tx.header(&Header::new(Kind::Heartbeat, 0, 0), ctx)?;
                            ctx.shared
                                .counters
                                .heartbeats_sent
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        // A forced stop leaves without a word (the peer must see a failure).
                        if !ctx.shared.forced() {
                            tx.header(&Header::new(Kind::Bye, 0, 0), ctx)?;
                        }
                        return Ok(());
                    }
                },
            };
            // Only the newest of consecutive versions matters.
            let msg = match msg {
                Out::Weights(mut v) => {
                    while let Ok(m) = rx.try_recv() {
                        match m {
                            Out::Weights(newer) => v = newer,
                            other => {
                                stash = Some(other);
                                break;
                            }
                        }
                    }
                    Out::Weights(v)
                }
                other => other,
            };
            match msg {
                Out::Push(p, epoch) => {
                    tx.push(&p, epoch, ctx)?;
                    ctx.shared
                        .counters
                        .sums_sent
                        .fetch_add(1, Ordering::Relaxed);
                }
                Out::Weights(v) => tx.weights(&v, ctx)?,
                Out::Tree(dead) => tx.tree(&dead, ctx)?,
                Out::Adopt { version, from } => {
                    let mut h = Header::new(Kind::Adopt, 0, from);
                    h.len = u32::try_from(version).unwrap_or(u32::MAX);
                    tx.header(&h, ctx)?;
                }
                Out::Finish => {
                    tx.header(&Header::new(Kind::Bye, 0, 0), ctx)?;
                    return Ok(());
                }
            }
        }
    })();
    if let Err(e) = r {
        link_error(ctx, peer, e, &agg);
    }
}

/// One link's receiving end: its message counter.
pub(super) struct Rx<'a> {
    pub(super) il: &'a mut InLink,
    pub(super) seq: u32,
}

impl Rx<'_> {
    pub(super) fn header(&mut self, ctx: &Ctx) -> Result<Header, PsError> {
        let mut t = Tensor::zeros(DType::Raw, HEADER_LEN);
        recv_flow(
            self.il,
            &mut t,
            T_HEADER,
            self.seq,
            LossBound::RELIABLE,
            ctx,
        )?;
        let round = self.seq;
        self.seq = self.seq.wrapping_add(1);
        Header::decode(t.as_bytes()).map_err(|what| PsError::Protocol {
            peer: self.il.peer(),
            what: format!("message {round}: {what}"),
        })
    }

    pub(super) fn reason(&mut self, h: &Header, ctx: &Ctx) -> Result<String, PsError> {
        let len = h.len as usize;
        if len == 0 || len > MAX_REASON {
            return Err(self.protocol(format!("a failure reason of {len} bytes")));
        }
        let mut t = Tensor::zeros(DType::Raw, len);
        recv_flow(
            self.il,
            &mut t,
            T_FAIL,
            self.seq.wrapping_sub(1),
            LossBound::RELIABLE,
            ctx,
        )?;
        Ok(String::from_utf8_lossy(t.as_bytes()).into_owned())
    }

    /// A tree update: the dead ranks.
    pub(super) fn tree(&mut self, h: &Header, ctx: &Ctx) -> Result<Vec<usize>, PsError> {
        let n = h.len as usize;
        if n == 0 || n > ctx.world || h.clock != n as u64 {
            return Err(self.protocol(format!(
                "a tree update of version {} naming {n} dead rank(s)",
                h.clock
            )));
        }
        let mut t = Tensor::zeros(DType::Raw, n * 8);
        recv_flow(
            self.il,
            &mut t,
            T_TREE,
            self.seq.wrapping_sub(1),
            LossBound::RELIABLE,
            ctx,
        )?;
        let mut dead = Vec::with_capacity(n);
        for w in t.as_bytes().chunks_exact(8) {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            match usize::try_from(u64::from_le_bytes(a)) {
                Ok(r) if r < ctx.world => dead.push(r),
                _ => return Err(self.protocol("a tree update names a rank out of range".into())),
            }
        }
        Ok(dead)
    }

    pub(super) fn protocol(&self, what: String) -> PsError {
        PsError::Protocol {
            peer: self.il.peer(),
            what,
        }
    }

    /// A sum of clock `h.clock`; `subtree`: the workers it may name.
    pub(super) fn push(
        &mut self,
        h: &Header,
        subtree: &Contributors,
        ctx: &Ctx,
    ) -> Result<Option<ChildSum>, PsError> {
        if h.flags & F_EMPTY != 0 {
            return Ok(None);
        }
        let blocks = ctx.blocks();
        let round = h.clock as u32;
        let mut values = Tensor::zeros(ctx.dtype, ctx.layout.elems());
        let report = recv_flow(self.il, &mut values, T_PUSH, round, ctx.hop_bound, ctx)?;
        let arrived = arrived_blocks(&report.missing_byte_ranges(), ctx.bb, blocks);
        let sets = if h.flags & F_SIDE != 0 {
            let len = blocks * Contributors::none(1, ctx.world).encoded_block_len();
            let mut t = Tensor::zeros(DType::Raw, len);
            recv_flow(
                self.il,
                &mut t,
                T_PUSH | SIDE_BIT,
                round,
                LossBound::RELIABLE,
                ctx,
            )?;
            let sets =
                Contributors::decode(t.as_bytes(), blocks, ctx.world, true).map_err(|e| {
                    self.protocol(format!("contributor sets of clock {}: {e}", h.clock))
                })?;
            if !sets_within(&sets, subtree) {
                return Err(self.protocol(format!(
                    "the sum of clock {} names workers outside its subtree",
                    h.clock
                )));
            }
            sets
        } else if ctx.reliable {
            let mut s = Contributors::none(blocks, ctx.world);
            for b in 0..blocks {
                s.unite(b, subtree, 0);
            }
            s
        } else {
            return Err(self.protocol(format!(
                "the sum of clock {} came without contributor sets under a loss bound",
                h.clock
            )));
        };
        Ok(Some(ChildSum {
            values,
            sets,
            arrived,
        }))
    }

    /// A version: its values, per-block clocks and which blocks arrived.
    pub(super) fn weights(
        &mut self,
        h: &Header,
        ctx: &Ctx,
    ) -> Result<(Tensor, Vec<u64>, Vec<bool>), PsError> {
        let blocks = ctx.blocks();
        let round = h.clock as u32;
        let mut values = Tensor::zeros(ctx.dtype, ctx.layout.elems());
        let report = recv_flow(self.il, &mut values, T_WEIGHTS, round, ctx.hop_bound, ctx)?;
        let arrived = arrived_blocks(&report.missing_byte_ranges(), ctx.bb, blocks);
        let clocks = if h.flags & F_SIDE != 0 {
            let mut t = Tensor::zeros(DType::Raw, blocks * 8);
            recv_flow(
                self.il,
                &mut t,
                T_WEIGHTS | SIDE_BIT,
                round,
                LossBound::RELIABLE,
                ctx,
            )?;
            decode_clocks(t.as_bytes(), blocks, h.clock)
                .map_err(|e| self.protocol(format!("version {}: {e}", h.clock)))?
        } else {
            vec![h.clock; blocks]
        };
        Ok((values, clocks, arrived))
    }
}

/// A link's receiving thread: every message to the aggregator (versions merged into the
/// cache here), until the peer's Bye or the link fails.
pub(super) fn peer_recv(il: &mut InLink, ctx: &Ctx, agg: Sender<AggIn>) {
    let peer = il.peer();
    let mut rx = Rx { il, seq: 0 };
    let r = (|| -> Result<(), PsError> {
        loop {
            let h = rx.header(ctx)?;
            let msg = match h.kind {
                Kind::Heartbeat => None,
                Kind::Bye => {
                    let _ = agg.send(AggIn::Bye(peer));
                    return Ok(());
                }
                Kind::Fail => {
                    let reason = rx.reason(&h, ctx)?;
                    let rank = usize::try_from(h.clock).unwrap_or(usize::MAX);
                    ctx.shared
                        .fail(ctx.rank, PsError::Peer { rank, reason }, Some(peer));
                    None
                }
                Kind::Push => {
                    let sum = rx.push(&h, &ctx.subtree0[peer], ctx)?;
                    Some(AggIn::Child {
                        peer,
                        epoch: u64::from(h.len),
                        clock: h.clock,
                        sum,
                    })
                }
                Kind::Weights => {
                    let (values, clocks, arrived) = rx.weights(&h, ctx)?;
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
                    Some(AggIn::Version)
                }
                Kind::Tree => Some(AggIn::Tree(rx.tree(&h, ctx)?)),
                Kind::Adopt => Some(AggIn::Adopt {
                    peer,
                    version: u64::from(h.len),
                    from: h.clock,
                }),
            };
            if let Some(m) = msg {
                // The aggregator may have left already: then only the Bye matters.
                let _ = agg.send(m);
            }
            if ctx.shared.forced() {
                return Ok(());
            }
        }
    })();
    if let Err(e) = r {
        link_error(ctx, peer, e, &agg);
    }
}

/// The aggregator, on the node's owning thread: sums each clock's pushes in clock order and
/// sends the sum up (a worker) or applies it (the server); repairs the tree on failures.
pub(super) fn aggregate(ctx: &Ctx, rx: Receiver<AggIn>, outs: BTreeMap<usize, Sender<Out>>) {
    let mut agg = Agg::new(ctx, outs);
    if !agg.worker() {
        publish(ctx, None);
        for c in agg.children() {
            agg.send_version(c);
        }
    }
    loop {
        if ctx.shared.forced() || agg.broken {
            break;
        }
        if agg.may_leave() {
            agg.leave();
            break;
        }
        match rx.recv_timeout(ctx.poll) {
            Ok(m) => agg.handle(m),
            Err(RecvTimeoutError::Timeout) => continue,
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

/// The node's owning thread: every link gets a sending and a receiving sub-thread; the
/// aggregator runs here.
pub(super) fn node_main(
    mut links: Links,
    ctx: &Ctx,
    agg_tx: Sender<AggIn>,
    agg_rx: Receiver<AggIn>,
) {
    let (outs, ins) = match links.many(&ctx.peers, &ctx.peers) {
        Ok(x) => x,
        Err(e) => {
            ctx.fail(e.into());
            return;
        }
    };
    std::thread::scope(|sc| {
        let mut handles = Vec::new();
        let spawn_err = |e: std::io::Error| {
            ctx.fail(PsError::Config(format!(
                "cannot start a link thread: {e} (too many threads?)"
            )));
        };
        let name = |what: &str| format!("gw-ps{}-{what}", ctx.rank);
        let mut txs = BTreeMap::new();
        for ol in outs {
            let (tx, rx) = mpsc::channel::<Out>();
            txs.insert(ol.peer(), tx);
            let agg = agg_tx.clone();
            let b = std::thread::Builder::new().name(name(&format!("to{}", ol.peer())));
            match b.spawn_scoped(sc, move || sender_loop(ol, rx, ctx, agg)) {
                Ok(h) => handles.push(h),
                Err(e) => spawn_err(e),
            }
        }
        for il in ins {
            let agg = agg_tx.clone();
            let b = std::thread::Builder::new().name(name(&format!("from{}", il.peer())));
            match b.spawn_scoped(sc, move || peer_recv(il, ctx, agg)) {
                Ok(h) => handles.push(h),
                Err(e) => spawn_err(e),
            }
        }
        drop(agg_tx);
        aggregate(ctx, agg_rx, txs);
        for h in handles {
            if h.join().is_err() {
                ctx.fail(CollectiveError::ThreadPanicked.into());
            }
        }
    });
}
