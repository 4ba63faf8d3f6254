//! Dissemination barrier: in round k every rank sends an empty message to rank + 2^k and
//! waits for one from rank - 2^k; after ceil(log2 world) rounds everyone has (transitively)
//! heard from everyone.

use gradwire_msg::core::{RecvOpts, SendOpts};
use gradwire_msg::mem::{BufId, Region};
use gradwire_msg::op::{Op, OpCx, OpError, OpEvent, Step};

/// A barrier.
#[derive(Debug, Default)]
pub struct Barrier {
    buf: Option<BufId>,
    /// Per round: (to, send number, from, receive number).
    rounds: Vec<(u16, u32, u16, u32)>,
    got: Vec<bool>,
    round: usize,
    sends_left: usize,
    recvs_left: usize,
}

impl Barrier {
    /// A barrier.
    pub fn new() -> Barrier {
        Barrier::default()
    }

    fn send_round(&mut self, cx: &mut OpCx<'_>) -> Result<(), OpError> {
        let buf = self
            .buf
            .ok_or_else(|| OpError::Invalid("no buffer".into()))?;
        if let Some(&(to, msg, _, _)) = self.rounds.get(self.round) {
            cx.send(to, msg, buf, 0..0, SendOpts::default())?;
            self.sends_left += 1;
        }
        Ok(())
    }
}

impl Op for Barrier {
    type Output = ();

    fn start(&mut self, cx: &mut OpCx<'_>) -> Step<()> {
        let w = usize::from(cx.world());
        let r = usize::from(cx.rank());
        let buf = cx.register(Region::owned(Vec::new()));
        self.buf = Some(buf);
        let mut d = 1;
        while d < w {
            let to = ((r + d) % w) as u16;
            let from = ((r + w - d % w) % w) as u16;
            let s = cx.reserve_sends(to, 1)?;
            let m = cx.reserve_recvs(from, 1)?;
            cx.recv(from, m, buf, 0..0, RecvOpts::default())?;
            self.rounds.push((to, s, from, m));
            self.got.push(false);
            self.recvs_left += 1;
            d *= 2;
        }
        if self.rounds.is_empty() {
            return Ok(Some(()));
        }
        self.send_round(cx)?;
        Ok(None)
    }

    fn on_event(&mut self, ev: OpEvent, cx: &mut OpCx<'_>) -> Step<()> {
        match ev {
            OpEvent::Sent { .. } => self.sends_left = self.sends_left.saturating_sub(1),
            OpEvent::Received { peer, msg, .. } => {
                // Round k + 1 is sent only once round k's message is in (messages of later
                // rounds may arrive first).
                self.recvs_left = self.recvs_left.saturating_sub(1);
                if let Some(k) = self.rounds.iter().position(|r| (r.2, r.3) == (peer, msg)) {
                    self.got[k] = true;
                }
                while self.round + 1 < self.rounds.len() && self.got[self.round] {
                    self.round += 1;
                    self.send_round(cx)?;
                }
            }
        }
        Ok((self.sends_left == 0 && self.recvs_left == 0).then_some(()))
    }
}
