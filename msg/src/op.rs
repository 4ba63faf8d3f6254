//! Operations: state machines that run on an endpoint's progress thread, post messages and
//! react to their completion (Gloo's algorithm classes, without a thread per step).
//!
//! An [`Op`] gets an [`OpCx`] to register buffers and post messages; every message it posts
//! is routed back to it as an [`OpEvent`]. When it returns a result (or fails), the endpoint
//! cancels whatever it left posted and unregisters its buffers, so memory handed to an
//! operation is never touched after its [`Handle`] completes.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::core::{Core, MsgError, PostError, RecvOpts, RecvReport, SendOpts};
use crate::mem::{BufId, Region};

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    /// A peer died, hung or aborted.
    #[error("{0}")]
    Peer(#[from] MsgError),
    /// The operation posted something invalid (a bug in the operation or its arguments).
    #[error("invalid message: {0}")]
    Post(#[from] PostError),
    /// The operation's arguments are invalid.
    #[error("{0}")]
    Invalid(String),
    /// A peer sent data the operation refuses (forged or corrupt), named.
    #[error("rank {peer} sent invalid data: {reason}")]
    Data {
        /// The peer.
        peer: u16,
        /// What was wrong.
        reason: String,
    },
    /// The operation was cancelled (its caller gave up waiting, or the endpoint shut down).
    #[error("the operation was cancelled: {0}")]
    Cancelled(String),
    /// The endpoint's progress thread is gone.
    #[error("the endpoint is shut down or its progress thread failed: {0}")]
    Down(String),
}

impl OpError {
    /// The rank to blame, if a peer failed (for a peer that gave up because of a third rank,
    /// that rank).
    pub fn peer(&self) -> Option<u16> {
        match self {
            OpError::Peer(MsgError::Aborted {
                culprit: Some(c), ..
            }) => Some(*c),
            OpError::Peer(
                MsgError::PeerSilent { peer, .. }
                | MsgError::Aborted { peer, .. }
                | MsgError::Unreachable { peer, .. },
            )
            | OpError::Data { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

/// A message of an operation finished.
#[derive(Debug, Clone)]
pub enum OpEvent {
    /// A send finished.
    Sent {
        /// Receiver.
        peer: u16,
        /// Message.
        msg: u32,
        /// Segments the receiver did without (under its loss bound or deadline).
        missing: u32,
        /// Data segments sent for the message, retransmissions and probes included.
        segments: u32,
    },
    /// A receive finished.
    Received {
        /// Sender.
        peer: u16,
        /// Message.
        msg: u32,
        /// What arrived.
        report: RecvReport,
    },
}

/// What an operation says after a step.
pub type Step<T> = Result<Option<T>, OpError>;

/// A state machine run on the progress thread.
pub trait Op: Send + 'static {
    /// The result handed to the waiter.
    type Output: Send + 'static;
    /// Starts: reserve message numbers, register buffers, post the first messages.
    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<Self::Output>;
    /// One of its messages finished.
    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<Self::Output>;
    /// Whether its failure concerns its own messages only. By default an operation that
    /// fails makes every peer give up everything with this rank (a group's operations run
    /// in lock-step, so after one fails the ranks no longer agree where they are). An
    /// isolated operation (a stream of chunks on one link of a runtime whose links are
    /// independent, as NetStorm's) aborts only its own messages: a peer that left fails
    /// the links with it, not the links with every other peer.
    fn isolated(&self) -> bool {
        false
    }
}

/// Key of a routed message: (peer, message, is a send).
pub(crate) type Route = (u16, u32, bool);

/// What an operation may do on the progress thread.
#[derive(Debug)]
pub struct OpCx<'a> {
    pub(crate) core: &'a mut Core,
    pub(crate) now: Instant,
    pub(crate) routes: &'a mut HashMap<Route, u64>,
    pub(crate) id: u64,
    pub(crate) bufs: &'a mut Vec<BufId>,
}

impl OpCx<'_> {
    /// This rank.
    pub fn rank(&self) -> u16 {
        self.core.config().rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> u16 {
        self.core.config().world
    }

    /// Now.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Payload bytes per segment: blocks of a bounded-loss reduction line up with it.
    pub fn seg_payload(&self) -> usize {
        self.core.config().seg_payload
    }

    /// Registers memory for this operation (unregistered when it ends).
    pub fn register(&mut self, region: Region) -> BufId {
        let id = self.core.register(region);
        self.bufs.push(id);
        id
    }

    /// Unregisters a buffer now and returns its region (cancelling messages still on it).
    pub fn unregister(&mut self, id: BufId) -> Option<Region> {
        self.bufs.retain(|b| *b != id);
        self.core.unregister(id)
    }

    /// A buffer's bytes.
    pub fn buf(&self, id: BufId) -> &[u8] {
        self.core.buffer(id).unwrap_or(&[])
    }

    /// A buffer's bytes, mutably.
    pub fn buf_mut(&mut self, id: BufId) -> &mut [u8] {
        self.core.buffer_mut(id).unwrap_or(&mut [])
    }

    /// Reserves `n` message numbers to `peer`.
    pub fn reserve_sends(&mut self, peer: u16, n: u32) -> Result<u32, OpError> {
        Ok(self.core.reserve_sends(peer, n)?)
    }

    /// Reserves `n` message numbers from `peer`.
    pub fn reserve_recvs(&mut self, peer: u16, n: u32) -> Result<u32, OpError> {
        Ok(self.core.reserve_recvs(peer, n)?)
    }

    /// Marks a reserved receive number as unused (both sides agreed there is no message).
    pub fn skip_recv(&mut self, peer: u16, msg: u32) -> Result<(), OpError> {
        Ok(self.core.skip_recv(peer, msg)?)
    }

    /// Sets the deadline of a posted receive of this operation.
    pub fn set_deadline(&mut self, peer: u16, msg: u32, at: Instant) {
        self.core.set_deadline(peer, msg, at);
    }

    /// Posts a send.
    pub fn send(
        &mut self,
        peer: u16,
        msg: u32,
        buf: BufId,
        range: Range<usize>,
        opts: SendOpts,
    ) -> Result<(), OpError> {
        self.core.post_send(self.now, peer, msg, buf, range, opts)?;
        self.routes.insert((peer, msg, true), self.id);
        Ok(())
    }

    /// Posts a receive.
    pub fn recv(
        &mut self,
        peer: u16,
        msg: u32,
        buf: BufId,
        range: Range<usize>,
        opts: RecvOpts,
    ) -> Result<(), OpError> {
        self.routes.insert((peer, msg, false), self.id);
        if let Err(e) = self.core.post_recv(self.now, peer, msg, buf, range, opts) {
            self.routes.remove(&(peer, msg, false));
            return Err(e.into());
        }
        Ok(())
    }
}

/// Where a result waits for its handle.
#[derive(Debug)]
pub(crate) struct Slot<T> {
    state: Mutex<SlotState<T>>,
    cv: Condvar,
}

type Callback = Box<dyn FnOnce(Result<(), OpError>) + Send>;

enum SlotState<T> {
    Pending(Option<Callback>),
    Ready(Result<T, OpError>),
    Taken,
}

impl<T> std::fmt::Debug for SlotState<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SlotState::Pending(_) => "Pending",
            SlotState::Ready(_) => "Ready",
            SlotState::Taken => "Taken",
        })
    }
}

impl<T> Slot<T> {
    pub(crate) fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            state: Mutex::new(SlotState::Pending(None)),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn complete(&self, r: Result<T, OpError>) {
        let status = r.as_ref().map(|_| ()).map_err(Clone::clone);
        let cb = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let cb = match &mut *st {
                SlotState::Pending(cb) => cb.take(),
                _ => return,
            };
            *st = SlotState::Ready(r);
            self.cv.notify_all();
            cb
        };
        // The callback runs without the lock, so it may use the handle.
        if let Some(cb) = cb {
            cb(status);
        }
    }
}

/// The handle of a submitted operation: wait for it, test it, or have a callback run when
/// it completes.
pub struct Handle<T> {
    pub(crate) slot: Arc<Slot<T>>,
    pub(crate) cancel: Option<Box<dyn Fn() + Send + Sync>>,
}

impl<T> std::fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("done", &self.test())
            .finish()
    }
}

impl<T> Handle<T> {
    /// Whether the operation has completed.
    pub fn test(&self) -> bool {
        let st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        !matches!(*st, SlotState::Pending(_))
    }

    /// Waits for the result.
    pub fn wait(self) -> Result<T, OpError> {
        let mut st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match std::mem::replace(&mut *st, SlotState::Taken) {
                SlotState::Ready(r) => return r,
                SlotState::Taken => {
                    return Err(OpError::Down("the result was already taken".into()))
                }
                pending @ SlotState::Pending(_) => {
                    *st = pending;
                    st = self.slot.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// Waits at most `timeout`; `Err(self)` if it is still running.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Result<T, OpError>, Handle<T>> {
        let end = Instant::now() + timeout;
        {
            let mut st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
            while matches!(*st, SlotState::Pending(_)) {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    drop(st);
                    return Err(self);
                }
                st = self
                    .slot
                    .cv
                    .wait_timeout(st, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Ok(self.wait())
    }

    /// Runs `f` with the outcome (the result stays for [`Handle::wait`]) when the operation
    /// completes, on the progress thread, or now if it already has.
    pub fn on_complete(&self, f: impl FnOnce(Result<(), OpError>) + Send + 'static) {
        let status = {
            let mut st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
            match &mut *st {
                SlotState::Pending(cb) => {
                    *cb = Some(Box::new(f));
                    return;
                }
                SlotState::Ready(r) => r.as_ref().map(|_| ()).map_err(Clone::clone),
                SlotState::Taken => return,
            }
        };
        f(status);
    }

    /// Asks the progress thread to cancel the operation (it completes with `Cancelled`).
    pub fn cancel(&self) {
        if let Some(c) = &self.cancel {
            c();
        }
    }
}

/// An operation with its result slot, type-erased for the progress thread. `start` and
/// `on_event` return whether it is done; the driver cleans up (cancels its messages,
/// unregisters its buffers) and only then calls `deliver`, so a waiter never returns while
/// the operation could still touch its memory.
pub(crate) trait Erased: Send {
    fn start(&mut self, cx: &mut OpCx<'_>) -> Result<bool, OpError>;
    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Result<bool, OpError>;
    fn deliver(&mut self);
    fn fail(&mut self, e: OpError);
    fn isolated(&self) -> bool;
}

pub(crate) struct Typed<O: Op> {
    pub(crate) op: O,
    pub(crate) out: Option<O::Output>,
    pub(crate) slot: Arc<Slot<O::Output>>,
}

impl<O: Op> Erased for Typed<O> {
    fn start(&mut self, cx: &mut OpCx<'_>) -> Result<bool, OpError> {
        self.out = self.op.start(cx)?;
        Ok(self.out.is_some())
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Result<bool, OpError> {
        self.out = self.op.on_event(ev, cx)?;
        Ok(self.out.is_some())
    }

    fn deliver(&mut self) {
        match self.out.take() {
            Some(out) => self.slot.complete(Ok(out)),
            None => self.slot.complete(Err(OpError::Down("no result".into()))),
        }
    }

    fn fail(&mut self, e: OpError) {
        self.slot.complete(Err(e));
    }

    fn isolated(&self) -> bool {
        self.op.isolated()
    }
}
