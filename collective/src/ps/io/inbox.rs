//! A link's receiving end: one operation on the endpoint's progress thread per link.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use gradwire_msg::core::{RecvOpts, RecvReport};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

use crate::aggregate::{arrived_blocks, Contributors};
use crate::ps::core::{sets_within, AggIn, ChildSum};
use crate::ps::state::{tensor_of, version_digest, Ctx, MAX_UNCHECKED};
use crate::ps::types::PsError;
use crate::ps::wire::{
    decode_clocks, decode_msg, Header, Kind, DIGEST_LEN, F_EMPTY, F_SIDE, HEADER_LEN, MAX_REASON,
};

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
pub(super) struct Inbox {
    peer: u16,
    ctx: Arc<Ctx>,
    agg: Sender<AggIn>,
    /// Longest header message: the header and the longest body (a reason or a dead list).
    cap: usize,
    wait: Option<Wait>,
}

impl Inbox {
    pub(super) fn new(peer: usize, ctx: Arc<Ctx>, agg: Sender<AggIn>) -> Inbox {
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

    /// A weights version of `clock` may come only from above (the server or one of this
    /// rank's aggregators), and never ahead of this worker's own clocks: the server applies
    /// clock `c` (making version `c + 1`) only with this worker's push of `c` in it.
    fn check_version(&self, clock: u64) -> Result<(), OpError> {
        let ctx = &self.ctx;
        let peer = self.rank();
        if !ctx.above(peer) {
            return Err(self.refuse(format!(
                "sent a weights version (clock {clock}), which only the server (rank {}) and \
                 this rank's aggregators {:?} may send",
                ctx.root, ctx.ancestors0
            )));
        }
        let own = ctx.shared.counters.own_clocks.load(Ordering::SeqCst);
        if clock > own {
            return Err(self.refuse(format!(
                "sent weights version {clock}, ahead of this worker's {own} clock(s): the \
                 server cannot have applied it"
            )));
        }
        Ok(())
    }

    /// [`PsConfig::verify_versions`](crate::ps::PsConfig::verify_versions): takes each
    /// staged version whose server digest is in and matches (oldest first); one that does
    /// not match fails the node naming the rank that passed it down. Versions and digests no
    /// newer than the cache are dropped, and at most [`MAX_UNCHECKED`] of each are kept.
    fn take_checked(&self) {
        let ctx = &self.ctx;
        let mut taken = 0u64;
        let mut changed = None;
        {
            let mut st = ctx.shared.lock();
            let st = &mut *st;
            if let Some(v) = st.cache.weights_clock() {
                st.staged.retain(|&c, _| c > v);
                st.digests.retain(|&c, _| c > v);
            }
            let ready: Vec<u64> = st
                .staged
                .keys()
                .filter(|c| st.digests.contains_key(c))
                .copied()
                .collect();
            for c in ready {
                let (Some((values, from)), Some(want)) =
                    (st.staged.remove(&c), st.digests.remove(&c))
                else {
                    continue;
                };
                if version_digest(c, values.as_bytes()) != want {
                    changed = Some((c, from));
                    break;
                }
                let n = st.have.len();
                st.take_version(c, values.as_bytes(), &vec![c; n], &vec![true; n], ctx.bb);
                taken += 1;
            }
            while st.staged.len() > MAX_UNCHECKED {
                st.staged.pop_first();
            }
            while st.digests.len() > MAX_UNCHECKED {
                st.digests.pop_first();
            }
        }
        if let Some((c, from)) = changed {
            ctx.fail(PsError::Protocol {
                peer: from,
                what: format!(
                    "passed down weights version {c}, which differs from the server's (rank {}) \
                     digest of it, sent here directly: it changed the weights",
                    ctx.root
                ),
            });
            return;
        }
        if taken > 0 {
            ctx.shared
                .counters
                .versions_verified
                .fetch_add(taken, Ordering::Relaxed);
            self.version_taken();
        }
    }

    /// A new version is in the cache: wake the pulls, tell the aggregator (it passes the
    /// version on).
    fn version_taken(&self) {
        self.ctx.shared.cv.notify_all();
        self.tell(AggIn::Version);
    }

    /// A tree update or failure report from a peer without standing to make it: logged and
    /// counted, nothing else (the genuine news reaches every rank from above or from the
    /// failed rank's own subtree).
    fn refuse_claim(&self, what: &str) {
        let ctx = &self.ctx;
        ctx.shared
            .counters
            .claims_refused
            .fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "parameter server rank {}: refused rank {}'s claim {what}: only the server, this \
             rank's aggregators, or a rank for its own subtree may make it",
            ctx.rank,
            self.peer
        );
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
        let busy = matches!(h.kind, Kind::Push | Kind::Weights) && h.flags & F_EMPTY == 0;
        self.tell(AggIn::Heard { peer, busy });
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
                if ctx.may_report(peer, rank) {
                    ctx.shared
                        .fail(ctx.rank, PsError::Peer { rank, reason }, Some(peer));
                } else {
                    self.refuse_claim(&format!("that rank {rank} failed ({reason:?})"));
                }
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
                if ctx.above(peer) {
                    self.tell(AggIn::Tree(dead));
                } else {
                    self.refuse_claim(&format!("that rank(s) {dead:?} are dead"));
                }
            }
            Kind::Digest => {
                if peer != ctx.root || !ctx.verify_here {
                    return Err(self.refuse(format!(
                        "sent a digest of version {}, which only the server sends, to a worker \
                         that checks versions",
                        h.clock
                    )));
                }
                let mut d = [0u8; DIGEST_LEN];
                d.copy_from_slice(body);
                ctx.shared.lock().digests.insert(h.clock, d);
                self.take_checked();
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
                if h.kind == Kind::Weights {
                    self.check_version(h.clock)?;
                }
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
            if ctx.verify_here {
                // Taken only once the server's digest says it is the server's version.
                if clocks.iter().any(|&c| c != h.clock) || arrived.iter().any(|a| !a) {
                    return Err(self.refuse(format!(
                        "version {} is not whole (block clocks or lost blocks) in a job that \
                         checks versions",
                        h.clock
                    )));
                }
                // Two different versions of one clock: someone changed one (a correct
                // aggregator sends a clock's version again only unchanged, on adoption).
                let clash = {
                    let mut st = ctx.shared.lock();
                    match st.staged.get(&h.clock) {
                        Some((v, from)) if v.as_bytes() != values.as_bytes() => Some(*from),
                        _ => {
                            st.staged.insert(h.clock, (values, peer));
                            None
                        }
                    }
                };
                if let Some(first) = clash {
                    return Err(self.refuse(format!(
                        "sent weights version {} unlike the one rank {first} sent: one of them \
                         changed it",
                        h.clock
                    )));
                }
                self.take_checked();
            } else {
                ctx.shared.lock().take_version(
                    h.clock,
                    values.as_bytes(),
                    &clocks,
                    &arrived,
                    ctx.bb,
                );
                self.version_taken();
            }
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
    fn isolated(&self) -> bool {
        true
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
                    self.tell(AggIn::Heard {
                        peer: self.rank(),
                        busy: false,
                    });
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
