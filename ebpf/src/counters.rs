//! Counter snapshots read from the per-CPU maps.

use serde::{Deserialize, Serialize};

/// Packets and bytes (frame length as seen by XDP: Ethernet header to end of frame, no FCS).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

impl Counter {
    pub(crate) fn add(&mut self, packets: u64, bytes: u64) {
        self.packets = self.packets.wrapping_add(packets);
        self.bytes = self.bytes.wrapping_add(bytes);
    }

    /// `self - earlier`, saturating at 0.
    pub fn since(&self, earlier: &Counter) -> Counter {
        Counter {
            packets: self.packets.saturating_sub(earlier.packets),
            bytes: self.bytes.saturating_sub(earlier.bytes),
        }
    }

    /// True when both are 0.
    pub fn is_zero(&self) -> bool {
        self.packets == 0 && self.bytes == 0
    }
}

/// Traffic of one (DSCP, ECN) pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassCounter {
    /// DSCP codepoint, 0..=63.
    pub dscp: u8,
    /// ECN codepoint: 0 Not-ECT, 1 ECT(1), 2 ECT(0), 3 CE.
    pub ecn: u8,
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// A snapshot of every classifier counter, summed over CPUs.
///
/// Invariant: `gradwire = drop_truncated + drop_not_allowed + drop_fault + redirected +
/// to_kernel`, and every frame the program saw is counted in exactly one of `gradwire`,
/// `passed` and `switched` (switch-port mode). `classes` counts every gradwire packet that passed the length checks, *before*
/// the allowlist and fault injection (it shows what arrived on the wire), so its sum is
/// `gradwire - drop_truncated`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdpCounters {
    /// UDP to a configured port, whatever happened next.
    pub gradwire: Counter,
    /// Gradwire, redirected to the AF_XDP socket of its queue.
    pub redirected: Counter,
    /// Gradwire, but no socket registered for its queue: given to the kernel (XDP_PASS).
    pub to_kernel: Counter,
    /// Not gradwire (or classifier disabled): XDP_PASS untouched.
    pub passed: Counter,
    /// Gradwire with short or inconsistent lengths: dropped.
    pub drop_truncated: Counter,
    /// Gradwire from a source not in the allowlist: dropped.
    pub drop_not_allowed: Counter,
    /// Gradwire dropped by fault injection.
    pub drop_fault: Counter,
    /// Switch-port mode: every frame, handed to the AF_XDP socket of its queue (or to the
    /// kernel when the queue has none).
    pub switched: Counter,
    /// Packets with ECN = CE (3), all DSCPs.
    pub ce_packets: u64,
    /// Bytes of those.
    pub ce_bytes: u64,
    /// Non-zero (DSCP, ECN) pairs, ordered by `dscp * 4 + ecn`.
    pub classes: Vec<ClassCounter>,
}

impl XdpCounters {
    /// Counter of one (DSCP, ECN) pair (zero when absent).
    pub fn class(&self, dscp: u8, ecn: u8) -> Counter {
        self.classes
            .iter()
            .find(|c| c.dscp == dscp && c.ecn == ecn)
            .map(|c| Counter {
                packets: c.packets,
                bytes: c.bytes,
            })
            .unwrap_or_default()
    }

    /// Total of `classes`.
    pub fn classes_total(&self) -> Counter {
        let mut t = Counter::default();
        for c in &self.classes {
            t.add(c.packets, c.bytes);
        }
        t
    }

    /// The change from `earlier` to `self` (saturating), e.g. around one test packet.
    pub fn since(&self, earlier: &XdpCounters) -> XdpCounters {
        let classes = self
            .classes
            .iter()
            .filter_map(|c| {
                let d = Counter {
                    packets: c.packets,
                    bytes: c.bytes,
                }
                .since(&earlier.class(c.dscp, c.ecn));
                (!d.is_zero()).then_some(ClassCounter {
                    dscp: c.dscp,
                    ecn: c.ecn,
                    packets: d.packets,
                    bytes: d.bytes,
                })
            })
            .collect();
        XdpCounters {
            gradwire: self.gradwire.since(&earlier.gradwire),
            redirected: self.redirected.since(&earlier.redirected),
            to_kernel: self.to_kernel.since(&earlier.to_kernel),
            passed: self.passed.since(&earlier.passed),
            drop_truncated: self.drop_truncated.since(&earlier.drop_truncated),
            drop_not_allowed: self.drop_not_allowed.since(&earlier.drop_not_allowed),
            drop_fault: self.drop_fault.since(&earlier.drop_fault),
            switched: self.switched.since(&earlier.switched),
            ce_packets: self.ce_packets.saturating_sub(earlier.ce_packets),
            ce_bytes: self.ce_bytes.saturating_sub(earlier.ce_bytes),
            classes,
        }
    }
}
