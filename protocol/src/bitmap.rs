//! Which segments of a tensor have arrived.
//!
//! One bit per segment. The receiver sets a bit when it places a segment; the bitmap is
//! handed back in the receive report so an aggregator can average each block over only the
//! workers that delivered it (DLCP Appendix A), and its complement, as ranges, is what a
//! retransmission request carries.

use crate::message::SegRange;

/// A fixed-size bitmap of segments.
#[derive(Clone, PartialEq, Eq)]
pub struct SegmentBitmap {
    words: Vec<u64>,
    len: u32,
    ones: u32,
}

impl std::fmt::Debug for SegmentBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SegmentBitmap({}/{})", self.ones, self.len)
    }
}

impl SegmentBitmap {
    /// An empty bitmap of `len` segments.
    pub fn new(len: u32) -> SegmentBitmap {
        SegmentBitmap {
            words: vec![0; (len as usize).div_ceil(64)],
            len,
            ones: 0,
        }
    }

    /// Number of segments tracked.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True when it tracks no segment.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of segments received.
    pub fn count_ones(&self) -> u32 {
        self.ones
    }

    /// Whether segment `i` was received (false past the end).
    #[inline]
    pub fn get(&self, i: u32) -> bool {
        self.words
            .get(i as usize / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Mark segment `i`; returns true if it was not marked before. Out of range is a no-op.
    #[inline]
    pub fn set(&mut self, i: u32) -> bool {
        if i >= self.len {
            return false;
        }
        let Some(w) = self.words.get_mut(i as usize / 64) else {
            return false;
        };
        let bit = 1u64 << (i % 64);
        let fresh = *w & bit == 0;
        *w |= bit;
        self.ones += u32::from(fresh);
        fresh
    }

    /// Fraction of segments received (1.0 for an empty tensor).
    pub fn fraction(&self) -> f64 {
        if self.len == 0 {
            1.0
        } else {
            f64::from(self.ones) / f64::from(self.len)
        }
    }

    /// The missing segments as sorted, disjoint ranges; at most `max` ranges (the rest is
    /// left for a later request, so a request always fits a control message).
    pub fn missing_ranges(&self, max: usize) -> Vec<SegRange> {
        let mut out = Vec::new();
        let mut i = 0u32;
        while i < self.len && out.len() < max {
            // Skip received segments a word at a time.
            let w = self.words[i as usize / 64] >> (i % 64);
            if w == u64::MAX >> (i % 64) && i % 64 == 0 {
                i += 64;
                continue;
            }
            if w & 1 == 1 {
                i += 1;
                continue;
            }
            let start = i;
            while i < self.len && !self.get(i) {
                i += 1;
            }
            out.push(SegRange {
                start,
                len: i - start,
            });
        }
        out
    }

    /// Iterate over the indices of received segments.
    pub fn iter_ones(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len).filter(move |&i| self.get(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_count() {
        let mut b = SegmentBitmap::new(130);
        assert!(b.set(0));
        assert!(!b.set(0), "duplicates are harmless and not double counted");
        assert!(b.set(129));
        assert!(!b.set(130), "out of range is ignored");
        assert!(b.get(0) && b.get(129) && !b.get(1) && !b.get(500));
        assert_eq!(b.count_ones(), 2);
        assert!((b.fraction() - 2.0 / 130.0).abs() < 1e-12);
        assert_eq!(b.iter_ones().collect::<Vec<_>>(), vec![0, 129]);
        assert_eq!(SegmentBitmap::new(0).fraction(), 1.0);
    }

    #[test]
    fn missing_ranges_are_compact_and_capped() {
        let mut b = SegmentBitmap::new(200);
        for i in (0..64).chain(70..72).chain(128..199) {
            b.set(i);
        }
        let r = b.missing_ranges(usize::MAX);
        assert_eq!(
            r,
            vec![
                SegRange { start: 64, len: 6 },
                SegRange { start: 72, len: 56 },
                SegRange { start: 199, len: 1 }
            ]
        );
        assert_eq!(b.missing_ranges(1), vec![SegRange { start: 64, len: 6 }]);
        let full = {
            let mut f = SegmentBitmap::new(65);
            (0..65).for_each(|i| {
                f.set(i);
            });
            f
        };
        assert!(full.missing_ranges(10).is_empty());
        assert_eq!(
            SegmentBitmap::new(3).missing_ranges(10),
            vec![SegRange { start: 0, len: 3 }]
        );
    }

    proptest::proptest! {
        #[test]
        fn missing_ranges_complement_the_set(len in 0u32..700, bits in proptest::collection::vec(0u32..700, 0..400)) {
            let mut b = SegmentBitmap::new(len);
            for i in bits { b.set(i); }
            let ranges = b.missing_ranges(usize::MAX);
            let mut missing = vec![false; len as usize];
            let mut prev_end = None;
            for r in &ranges {
                proptest::prop_assert!(r.len > 0);
                if let Some(e) = prev_end { proptest::prop_assert!(r.start > e, "sorted and not adjacent"); }
                prev_end = Some(r.start + r.len);
                for i in r.start..r.start + r.len { missing[i as usize] = true; }
            }
            for i in 0..len { proptest::prop_assert_eq!(missing[i as usize], !b.get(i)); }
        }
    }
}
