//! Incast scheduling: receiver grants (Homa's idea, as windows).
//!
//! Many senders meeting at one receiver each have a congestion window of their own, and
//! together they offer the sum of them to the receiver's downlink. So the receiver keeps one
//! budget of first-pass segments in flight towards it, a [`Window`](super::Window) of its
//! own (slow start, DCTCP on the CE marks of its arrivals, halved when more than 10 % of a
//! window of arrivals were gaps), and splits it evenly over the peers whose first passes
//! are arriving: each hears its share in a GRANT, and a sender keeps at most `min(cwnd, grant)` first-pass
//! segments in flight towards that receiver, over all its messages. Before its first grant a
//! sender may have `unscheduled` segments in flight (the unscheduled first window).
//!
//! A grant is a window, not a credit, so a lost segment costs no credit, and a GRANT is sent
//! only when a peer's share moves by a quarter (a peer arrives or leaves, the budget grows or
//! shrinks), not per segment. GRANTs carry a sequence number: a sender takes only a newer one
//! (reordering cannot bring back an old share). A sender that is blocked and hears nothing
//! for an RTO asks with POLL, and the receiver answers it with its current grant as well.
//! With a share smaller than the ACK interval the receiver ACKs every half share, so the
//! sender's window is clocked without timeouts.

use std::time::{Duration, Instant};

use super::{Core, CtrlOp};
use crate::wire::Ctrl;

/// Smallest share a peer is granted, segments.
pub const MIN_GRANT: u32 = 4;

/// A peer counts as sending to us while its first-pass data came this recently (at least;
/// twice its RTO when that is longer).
const ACTIVE_FOR: Duration = Duration::from_millis(5);

/// Per-peer grant state, both directions.
#[derive(Debug, Clone, Default)]
pub(super) struct PeerGrants {
    /// As a sender: the receiver's grant (`None`: none yet, `unscheduled` applies) and the
    /// sequence number of the grant it came in.
    rwnd: Option<(u32, u32)>,
    /// As a receiver: when first-pass data last came from the peer, the share it last heard
    /// (0: none yet) and the sequence number of that grant.
    active_at: Option<Instant>,
    granted: u32,
    seq: u32,
}

impl Core {
    /// The grant peer `peer` gave us, if any (tests).
    #[cfg(test)]
    pub(super) fn granted_by(&self, peer: u16) -> Option<u32> {
        self.peers[usize::from(peer)].grants.rwnd.map(|(w, _)| w)
    }

    /// First-pass segments the sender may keep in flight towards peer `i`: its congestion
    /// window, within the receiver's grant.
    pub(super) fn send_window(&self, i: usize) -> u32 {
        let p = &self.peers[i];
        let cwnd = p.win.segments();
        if !self.cfg.grants {
            return cwnd;
        }
        let granted = p.grants.rwnd.map_or(self.cfg.unscheduled, |(w, _)| w);
        cwnd.min(granted.max(1))
    }

    /// Segments between ACKs of a receive from peer `i`: the configured interval, or half the
    /// share the peer was granted when that is smaller, so that a small grant is clocked by
    /// ACKs rather than by timeouts.
    pub(super) fn ack_interval(&self, i: usize) -> u32 {
        if !self.cfg.grants {
            return self.cfg.ack_every;
        }
        let g = &self.peers[i].grants;
        let share = if g.granted > 0 {
            g.granted
        } else {
            self.cfg.unscheduled
        };
        self.cfg.ack_every.min((share / 2).max(1))
    }

    /// A first-pass data segment came from peer `i` (`ce`: marked): the budget counts it,
    /// and a peer that was not sending takes its share (everyone's share changes).
    pub(super) fn note_arrival(&mut self, now: Instant, i: usize, ce: bool) {
        if !self.cfg.grants {
            return;
        }
        self.budget.on_ack(1, u32::from(ce));
        let was = self.rx_active(i, now);
        self.peers[i].grants.active_at = Some(now);
        if !was {
            self.regrant(now, None);
        }
    }

    /// Segments of a first pass found missing: the budget counts them against its window.
    pub(super) fn note_gaps(&mut self, n: u32) {
        if self.cfg.grants && n > 0 {
            self.budget.on_lost(n);
        }
    }

    fn rx_active(&self, i: usize, now: Instant) -> bool {
        let p = &self.peers[i];
        let within = ACTIVE_FOR.max(p.rtt.rto().saturating_mul(2));
        p.grants
            .active_at
            .is_some_and(|t| now.saturating_duration_since(t) <= within)
    }

    /// Splits the budget over the peers sending to us and sends a GRANT to each whose share
    /// moved by a quarter or that has none yet; `force`: that peer hears its grant again
    /// even if unchanged (it asked with POLL), and counts as sending.
    pub(super) fn regrant(&mut self, now: Instant, force: Option<usize>) {
        if !self.cfg.grants {
            return;
        }
        if let Some(q) = force {
            self.peers[q].grants.active_at = Some(now);
        }
        let active: Vec<usize> = (0..self.peers.len())
            .filter(|&q| self.rx_active(q, now))
            .collect();
        let n = active.len().max(1) as u32;
        let share = (self.budget.segments() / n).max(MIN_GRANT);
        for q in active {
            let g = &mut self.peers[q].grants;
            let old = g.granted;
            let moved = old == 0 || share.abs_diff(old).saturating_mul(4) >= old;
            if moved {
                g.granted = share;
                g.seq = g.seq.wrapping_add(1);
            } else if force != Some(q) {
                continue;
            }
            let (a, b) = (g.granted, g.seq);
            let mut c = self.ctrl_to(q, CtrlOp::Grant, 0, 0);
            c.a = a;
            c.b = b;
            self.stats.grants += 1;
            self.ctrl_frame(q, c, &[]);
        }
    }

    /// A GRANT from peer `i`: a newer one replaces the window we may keep in flight there.
    pub(super) fn on_grant(&mut self, i: usize, c: &Ctrl) {
        if !self.cfg.grants {
            return;
        }
        let p = &mut self.peers[i];
        let newer = p
            .grants
            .rwnd
            .is_none_or(|(_, seq)| (c.b.wrapping_sub(seq) as i32) > 0);
        if !newer {
            return;
        }
        let grew = p.grants.rwnd.is_none_or(|(w, _)| c.a > w);
        p.grants.rwnd = Some((c.a.max(1), c.b));
        if grew {
            // Sends that waited for room may go now: their stall timers are stale.
            for s in p.sends.values_mut() {
                s.clear_stall_timer();
            }
        }
    }
}
