//! One message to or from one peer, reliable or under a loss bound; a receive may accept a
//! shorter message (`RecvOpts::up_to`, the report's `len`).

use crate::core::{RecvOpts, RecvReport, SendOpts};
use crate::mem::{BufId, Region};
use crate::op::{Op, OpCx, OpError, OpEvent, Step};

/// A send of one region to `peer`.
#[derive(Debug)]
pub struct Send {
    peer: u16,
    opts: SendOpts,
    region: Option<Region>,
    buf: Option<BufId>,
    isolated: bool,
}

impl Send {
    /// Sends `region` to `peer`.
    pub fn new(region: Region, peer: u16, opts: SendOpts) -> Send {
        Send {
            peer,
            opts,
            region: Some(region),
            buf: None,
            isolated: false,
        }
    }

    /// A send whose failure ends its own message only ([`Op::isolated`]): one message of a
    /// link's own stream (a parameter server's link, a NetStorm chunk channel).
    pub fn isolated(mut self) -> Send {
        self.isolated = true;
        self
    }
}

/// What a [`Send`] ends with.
#[derive(Debug)]
pub struct SendDone {
    /// The region given back (an owned one; `None` for a borrowed one).
    pub region: Option<Region>,
    /// Segments the receiver did without (under its loss bound or deadline; 0 when
    /// reliable).
    pub missing: u32,
    /// Data segments sent for the message: its segments once, plus retransmissions and
    /// tail probes.
    pub segments: u32,
}

impl Op for Send {
    type Output = SendDone;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<SendDone> {
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        let len = region.len();
        let buf = cx.register(region);
        self.buf = Some(buf);
        let msg = cx.reserve_sends(self.peer, 1)?;
        cx.send(self.peer, msg, buf, 0..len, std::mem::take(&mut self.opts))?;
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<SendDone> {
        let (missing, segments) = match ev {
            OpEvent::Sent {
                missing, segments, ..
            } => (missing, segments),
            OpEvent::Received { .. } => return Ok(None),
        };
        Ok(Some(SendDone {
            region: self.buf.take().and_then(|b| cx.unregister(b)),
            missing,
            segments,
        }))
    }

    fn isolated(&self) -> bool {
        self.isolated
    }
}

/// A receive of one region from `peer` (the sender's tensor must have its length).
#[derive(Debug)]
pub struct Recv {
    peer: u16,
    opts: RecvOpts,
    region: Option<Region>,
    buf: Option<BufId>,
}

impl Recv {
    /// Receives into `region` from `peer`.
    pub fn new(region: Region, peer: u16, opts: RecvOpts) -> Recv {
        Recv {
            peer,
            opts,
            region: Some(region),
            buf: None,
        }
    }
}

impl Op for Recv {
    type Output = (Option<Region>, RecvReport);

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<Self::Output> {
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        let len = region.len();
        let buf = cx.register(region);
        self.buf = Some(buf);
        let msg = cx.reserve_recvs(self.peer, 1)?;
        cx.recv(self.peer, msg, buf, 0..len, self.opts.clone())?;
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<Self::Output> {
        match ev {
            OpEvent::Received { report, .. } => Ok(Some((
                self.buf.take().and_then(|b| cx.unregister(b)),
                report,
            ))),
            OpEvent::Sent { .. } => Ok(None),
        }
    }
}
