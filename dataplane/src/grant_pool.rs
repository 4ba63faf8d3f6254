//! One receiver downlink's grant allocator, shared by every receiving thread of a host.
//!
//! The allocator itself ([`gradwire_proto::grant::GrantAllocator`]) is pure state; this wraps
//! it in a mutex with a clock, so the receivers of one host (one per sender, each on its own
//! thread, as in a parameter server) split one capacity between them. Hand the same pool to
//! every receiver of the host through [`crate::transport::TransferConfig::grant_pool`]; a
//! receiver without one gets a private pool, i.e. the whole capacity for its single flow.
//!
//! A receiver takes the lock when a flow is accepted or ends, once per receive batch (to
//! read its share) and once per report period (to add its packet and CE counts), never per
//! packet.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::grant::{GrantAllocator, GrantConfig, GrantKey, GrantStats};

/// A grant allocator shared between threads (cheap to clone: one `Arc`).
#[derive(Debug, Clone)]
pub struct GrantPool {
    inner: Arc<Mutex<GrantAllocator>>,
    epoch: Instant,
}

impl PartialEq for GrantPool {
    /// Two handles are equal when they share one allocator.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl GrantPool {
    /// A pool for a downlink configured by `cfg`.
    pub fn new(cfg: GrantConfig) -> GrantPool {
        GrantPool {
            inner: Arc::new(Mutex::new(GrantAllocator::new(cfg))),
            epoch: Instant::now(),
        }
    }

    /// The allocator. A thread that panicked while holding the lock left consistent state
    /// (every update is a few assignments), so a poisoned lock is used as it is.
    fn lock(&self) -> MutexGuard<'_, GrantAllocator> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// A flow of `size_bytes` was accepted; it leaves the pool when the returned membership
    /// is dropped.
    pub fn join(&self, size_bytes: u64) -> GrantMembership {
        self.join_class(size_bytes, 0)
    }

    /// A flow of priority class `class` (0 = most urgent) was accepted: while flows of a
    /// more urgent class are active, it only trickles (see `GrantAllocator::join_class`).
    pub fn join_class(&self, size_bytes: u64, class: u8) -> GrantMembership {
        GrantMembership {
            key: Some(self.lock().join_class(size_bytes, class)),
            pool: self.clone(),
        }
    }

    /// Data that arrived for any flow of this downlink in one report period.
    pub fn record(&self, packets: u64, ce_packets: u64) {
        let now = self.now_ns();
        self.lock().record(packets, ce_packets, now);
    }

    /// Like [`GrantPool::record`], for a flow of priority class `class`: ignored while a
    /// more urgent class is active, so the marks on trickling flows (which queue behind the
    /// urgent ones in the switches) do not cut the target the urgent flows share.
    pub fn record_class(&self, packets: u64, ce_packets: u64, class: u8) {
        let now = self.now_ns();
        let mut a = self.lock();
        if a.most_urgent_class().is_some_and(|best| class > best) {
            return;
        }
        a.record(packets, ce_packets, now);
    }

    /// Counters.
    pub fn stats(&self) -> GrantStats {
        self.lock().stats()
    }
}

/// A flow's place in a [`GrantPool`], given up on drop (also when the transfer fails).
#[derive(Debug)]
pub struct GrantMembership {
    key: Option<GrantKey>,
    pool: GrantPool,
}

impl GrantMembership {
    /// This flow's current share, bit/s, now that it misses `remaining_bytes`.
    pub fn grant_bps(&self, remaining_bytes: u64) -> u64 {
        let mut a = self.pool.lock();
        match self.key {
            Some(k) => {
                a.set_remaining(k, remaining_bytes);
                a.grant_bps(k)
            }
            None => a.config().min_flow_bps,
        }
    }

    /// The flow stopped wanting data (bound met): its share goes to the others now.
    pub fn leave(&mut self) {
        if let Some(k) = self.key.take() {
            self.pool.lock().leave(k);
        }
    }
}

impl Drop for GrantMembership {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_share_and_leave_on_drop() {
        let pool = GrantPool::new(GrantConfig::new(100_000_000, 1_000_000));
        let a = pool.join(0);
        assert_eq!(a.grant_bps(0), 90_000_000);
        let mut b = pool.join(0);
        assert_eq!(a.grant_bps(0), 45_000_000);
        {
            let _c = pool.join(0);
            assert_eq!(a.grant_bps(0), 30_000_000);
        }
        assert_eq!(a.grant_bps(0), 45_000_000, "a dropped member left");
        b.leave();
        b.leave();
        assert_eq!(a.grant_bps(0), 90_000_000);
        assert_eq!(pool.stats().max_active, 3);
        let other = GrantPool::new(GrantConfig::new(1, 1));
        assert_eq!(pool, pool.clone());
        assert_ne!(pool, other);
    }
}
