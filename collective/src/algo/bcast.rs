//! Binomial-tree broadcast: relative to the root, rank v receives from v minus its highest
//! set bit and forwards to v + 2^k for every 2^k above v (ceil(log2 world) rounds). Reliable.

use gradwire_msg::core::{RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

/// Broadcast of one region from `root`.
#[derive(Debug)]
pub struct Broadcast {
    root: usize,
    tos: u8,
    region: Option<Region>,
    buf: Option<BufId>,
    children: Vec<(u16, u32)>,
    sends_left: usize,
    recv_left: usize,
}

impl Broadcast {
    /// A broadcast of `region` (the root's is sent; the others' are overwritten).
    pub fn new(region: Region, root: usize, tos: u8) -> Broadcast {
        Broadcast {
            root,
            tos,
            region: Some(region),
            buf: None,
            children: Vec::new(),
            sends_left: 0,
            recv_left: 0,
        }
    }

    fn forward(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let buf = self
            .buf
            .ok_or_else(|| OpError::Invalid("no buffer".into()))?;
        let len = cx.buf(buf).len();
        for (peer, msg) in std::mem::take(&mut self.children) {
            let opts = SendOpts {
                tos: self.tos,
                ..SendOpts::default()
            };
            cx.send(peer, msg, buf, 0..len, opts)?;
            self.sends_left += 1;
        }
        Ok(())
    }

    fn done(&mut self, cx: &mut OpCx<'_>) -> Step<Option<Region>> {
        if self.sends_left > 0 || self.recv_left > 0 {
            return Ok(None);
        }
        Ok(Some(self.buf.take().and_then(|b| cx.unregister(b))))
    }
}

impl Op for Broadcast {
    type Output = Option<Region>;

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<Option<Region>> {
        let w = usize::from(cx.world());
        let r = usize::from(cx.rank());
        if self.root >= w {
            return Err(OpError::Invalid(format!(
                "root {} is not a rank of a world of {w}",
                self.root
            )));
        }
        let region = self
            .region
            .take()
            .ok_or_else(|| OpError::Invalid("started twice".into()))?;
        let len = region.len();
        let buf = cx.register(region);
        self.buf = Some(buf);
        let v = (r + w - self.root) % w;
        let abs = |x: usize| ((x + self.root) % w) as u16;
        // Children: v + 2^k for 2^k > v.
        let mut k = if v == 0 {
            1
        } else {
            (v + 1).next_power_of_two()
        };
        if v != 0 && k == v {
            k *= 2;
        }
        let mut bit = k;
        while v + bit < w {
            let child = abs(v + bit);
            let msg = cx.reserve_sends(child, 1)?;
            self.children.push((child, msg));
            bit *= 2;
        }
        if v == 0 {
            self.forward(cx)?;
        } else {
            let parent = abs(v - (1 << (usize::BITS - 1 - v.leading_zeros())));
            let msg = cx.reserve_recvs(parent, 1)?;
            cx.recv(parent, msg, buf, 0..len, RecvOpts::default())?;
            self.recv_left = 1;
        }
        self.done(cx)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<Option<Region>> {
        match ev {
            OpEvent::Sent { .. } => self.sends_left = self.sends_left.saturating_sub(1),
            OpEvent::Received { .. } => {
                self.recv_left = 0;
                self.forward(cx)?;
            }
        }
        self.done(cx)
    }
}
