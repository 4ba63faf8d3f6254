//! Receive-side fault injection for any datapath: drop, duplicate, reorder, delay.
//!
//! This kernel has no netem, and the protocol must be shown to meet its loss bound under
//! loss, reordering and duplication. Faults are applied where the receiver sees packets, so
//! the same wrapper works over the in-memory, UDP and (later) AF_XDP datapaths. Decisions
//! come from a seeded generator, so a given arrival sequence always meets the same faults.
//!
//! Reordered packets are held back and released after a random number of later packets (or
//! when the link goes quiet), delayed ones after a fixed time: both arrive late, never lost.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{Datapath, DatapathError, DatapathStats, Deliver, Fill, RxMeta};

/// What to do to received packets. Probabilities are in [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct FaultConfig {
    /// Probability that a packet is dropped.
    pub drop: f64,
    /// Probability that a packet is delivered twice.
    pub duplicate: f64,
    /// Probability that a packet is held back behind 1..=`reorder_depth` later packets.
    pub reorder: f64,
    /// How far a reordered packet may fall behind.
    pub reorder_depth: u32,
    /// Probability that a packet is delayed by `delay`.
    pub delay_prob: f64,
    /// Extra latency of delayed packets.
    pub delay: Duration,
    /// Seed of the decision generator.
    pub seed: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            drop: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_depth: 16,
            delay_prob: 0.0,
            delay: Duration::from_millis(1),
            seed: 0x6772_6164,
        }
    }
}

/// Why a fault configuration is invalid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("fault injection: {field} = {value} is not a probability in [0, 1]")]
pub struct FaultConfigError {
    field: &'static str,
    value: f64,
}

impl FaultConfig {
    /// Only random loss with probability `p`.
    pub fn loss(p: f64) -> FaultConfig {
        FaultConfig {
            drop: p,
            ..FaultConfig::default()
        }
    }

    /// Check that every probability is in [0, 1].
    pub fn validate(&self) -> Result<(), FaultConfigError> {
        for (field, value) in [
            ("drop", self.drop),
            ("duplicate", self.duplicate),
            ("reorder", self.reorder),
            ("delay_prob", self.delay_prob),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(FaultConfigError { field, value });
            }
        }
        Ok(())
    }

    fn only_drops(&self) -> bool {
        self.duplicate == 0.0 && self.reorder == 0.0 && self.delay_prob == 0.0
    }
}

/// Counters of injected faults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FaultStats {
    /// Packets dropped.
    pub dropped: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Packets held back behind later ones.
    pub reordered: u64,
    /// Packets delayed.
    pub delayed: u64,
}

enum Release {
    AfterPackets(u32),
    At(Instant),
}

/// A datapath whose receive side suffers the configured faults.
pub struct FaultInjector<D> {
    inner: D,
    cfg: FaultConfig,
    rng: fastrand::Rng,
    held: VecDeque<(Release, RxMeta, Vec<u8>)>,
    fstats: FaultStats,
}

impl<D> std::fmt::Debug for FaultInjector<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultInjector")
            .field("cfg", &self.cfg)
            .field("stats", &self.fstats)
            .finish()
    }
}

impl<D: Datapath> FaultInjector<D> {
    /// Wrap `inner`.
    pub fn new(inner: D, cfg: FaultConfig) -> Result<FaultInjector<D>, FaultConfigError> {
        cfg.validate()?;
        let rng = fastrand::Rng::with_seed(cfg.seed);
        Ok(FaultInjector {
            inner,
            cfg,
            rng,
            held: VecDeque::new(),
            fstats: FaultStats::default(),
        })
    }

    /// Counters of injected faults.
    pub fn fault_stats(&self) -> FaultStats {
        self.fstats
    }

    /// The wrapped datapath.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.f64() < p
    }

    /// Deliver held packets that are due; `quiet` releases every reordered packet (the link
    /// went idle, so nothing would overtake them any more).
    fn release(&mut self, quiet: bool, deliver: &mut Deliver<'_>) -> usize {
        let now = Instant::now();
        let mut n = 0;
        let mut i = 0;
        while i < self.held.len() {
            let due = match self.held[i].0 {
                Release::AfterPackets(k) => quiet || k == 0,
                Release::At(t) => t <= now,
            };
            if due {
                if let Some((_, meta, buf)) = self.held.remove(i) {
                    deliver(&meta, &buf);
                    n += 1;
                }
            } else {
                i += 1;
            }
        }
        n
    }
}

impl<D: Datapath> Datapath for FaultInjector<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    fn max_datagram(&self) -> usize {
        self.inner.max_datagram()
    }

    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        self.inner.send(max, fill)
    }

    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        if self.cfg.only_drops() {
            // Fast path: decide in the callback, no copies.
            let Self {
                inner,
                cfg,
                rng,
                fstats,
                ..
            } = self;
            let mut n = 0;
            inner.recv(max, timeout, &mut |meta: &RxMeta, d: &[u8]| {
                if cfg.drop > 0.0 && rng.f64() < cfg.drop {
                    fstats.dropped += 1;
                } else {
                    n += 1;
                    deliver(meta, d);
                }
            })?;
            return Ok(n);
        }
        // Wait less when something held is due soon.
        let wait = match self.held.iter().find_map(|h| match h.0 {
            Release::At(t) => Some(t.saturating_duration_since(Instant::now())),
            Release::AfterPackets(_) => None,
        }) {
            Some(d) => d.min(timeout),
            None => timeout,
        };
        let mut arrived: Vec<(RxMeta, Vec<u8>)> = Vec::new();
        let got = self.inner.recv(max, wait, &mut |meta: &RxMeta, d: &[u8]| {
            arrived.push((*meta, d.to_vec()));
        })?;
        let mut n = 0;
        for (meta, buf) in arrived {
            // Every arrival moves the reordered packets one place further back.
            for h in self.held.iter_mut() {
                if let Release::AfterPackets(k) = &mut h.0 {
                    *k = k.saturating_sub(1);
                }
            }
            if self.chance(self.cfg.drop) {
                self.fstats.dropped += 1;
                continue;
            }
            let copies = if self.chance(self.cfg.duplicate) {
                self.fstats.duplicated += 1;
                2
            } else {
                1
            };
            for _ in 0..copies {
                if self.chance(self.cfg.reorder) {
                    self.fstats.reordered += 1;
                    let k = self.rng.u32(1..=self.cfg.reorder_depth.max(1));
                    self.held
                        .push_back((Release::AfterPackets(k), meta, buf.clone()));
                } else if self.chance(self.cfg.delay_prob) {
                    self.fstats.delayed += 1;
                    self.held.push_back((
                        Release::At(Instant::now() + self.cfg.delay),
                        meta,
                        buf.clone(),
                    ));
                } else {
                    deliver(&meta, &buf);
                    n += 1;
                }
            }
            n += self.release(false, deliver);
        }
        n += self.release(got == 0, deliver);
        Ok(n)
    }

    fn backend_stats(&self) -> Option<super::BackendStats> {
        self.inner.backend_stats()
    }

    fn data_sources(&self) -> Vec<super::DataSource> {
        self.inner.data_sources()
    }

    fn admit_peers(&mut self, peers: &[super::DataSource]) -> Result<(), DatapathError> {
        self.inner.admit_peers(peers)
    }

    fn release_peers(&mut self, peers: &[super::DataSource]) -> Result<(), DatapathError> {
        self.inner.release_peers(peers)
    }

    fn stats(&self) -> DatapathStats {
        let mut s = self.inner.stats();
        s.rx_dropped += self.fstats.dropped;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::loopback::Loopback;
    use crate::datapath::TxMeta;

    fn run(cfg: FaultConfig, count: u32) -> (Vec<u32>, FaultStats) {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let (mut x, y) = Loopback::pair(a, b, 8, 1 << 16);
        let mut y = FaultInjector::new(y, cfg).unwrap();
        let mut i = 0u32;
        x.send(count as usize, &mut |buf: &mut [u8]| {
            buf[..4].copy_from_slice(&i.to_be_bytes());
            i += 1;
            Some((4, TxMeta { dst: b, tos: 0 }))
        })
        .unwrap();
        let mut got = Vec::new();
        // Until the link has been quiet for a few calls (held packets are released then).
        let mut quiet = 0;
        while quiet < 3 {
            let n = y
                .recv(64, Duration::from_millis(2), &mut |_: &RxMeta, d: &[u8]| {
                    got.push(u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
                })
                .unwrap();
            quiet = if n == 0 { quiet + 1 } else { 0 };
        }
        (got, y.fault_stats())
    }

    #[test]
    fn drop_rate_is_close_to_configured_and_deterministic() {
        let (got, st) = run(FaultConfig::loss(0.2), 20_000);
        let lost = 20_000 - got.len();
        assert_eq!(lost as u64, st.dropped);
        assert!(
            (3600..=4400).contains(&lost),
            "lost {lost} of 20000 at p=0.2"
        );
        let (again, _) = run(FaultConfig::loss(0.2), 20_000);
        assert_eq!(got, again, "same seed, same arrivals: same drops");
    }

    #[test]
    fn reorder_and_duplicate_lose_nothing() {
        let cfg = FaultConfig {
            duplicate: 0.1,
            reorder: 0.3,
            delay_prob: 0.05,
            ..FaultConfig::default()
        };
        let (got, st) = run(cfg, 5000);
        assert!(
            st.reordered > 1000 && st.duplicated > 300 && st.delayed > 100,
            "{st:?}"
        );
        assert_eq!(got.len() as u64, 5000 + st.duplicated);
        let mut uniq = got.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq, (0..5000).collect::<Vec<_>>());
        assert!(
            got.windows(2).any(|w| w[0] > w[1]),
            "some packets arrive out of order"
        );
    }

    #[test]
    fn rejects_bad_probabilities() {
        assert!(FaultConfig {
            drop: 1.5,
            ..FaultConfig::default()
        }
        .validate()
        .is_err());
        assert!(FaultConfig {
            reorder: f64::NAN,
            ..FaultConfig::default()
        }
        .validate()
        .is_err());
        assert!(FaultConfig::loss(1.0).validate().is_ok());
    }
}
