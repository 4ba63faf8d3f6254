//! Cutting the planned bundles of an [`XdpIo::send`](super::XdpIo::send) into datagrams:
//! [`Filler`] hands the datapath one datagram per frame, copied from the bundle's iovec at its
//! segment size, across slice boundaries, and keeps count of what it handed out so that a
//! refused datagram can be taken back.

use std::io::IoSlice;
use std::net::SocketAddr;

use gradwire::datapath::TxMeta;

use crate::io::Transmit;

/// One bundle of a `send`, checked.
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    /// Index in the batch.
    pub(super) bundle: usize,
    /// Destination in this socket's family.
    pub(super) dst: SocketAddr,
    pub(super) tos: u8,
    /// Datagram size (the last may be shorter).
    pub(super) seg: usize,
    /// Bundle bytes.
    pub(super) total: usize,
    /// Datagrams (1 for an empty bundle).
    pub(super) datagrams: usize,
    /// Dropped rather than sent: the destination has no Ethernet address.
    pub(super) drop: bool,
}

/// Hands the planned bundles' datagrams to the datapath one frame at a time.
pub(super) struct Filler<'p, 'b, 'i> {
    pub(super) batch: &'b [Transmit<'i>],
    pub(super) plan: &'p mut [Planned],
    /// Current plan entry; bundles before it were handed out whole.
    pub(super) at: usize,
    /// Datagrams of `plan[at]` handed out.
    pub(super) emitted: usize,
    /// Bytes of `plan[at]` handed out.
    pub(super) off: usize,
    /// Position in `plan[at]`'s iovec: slice, byte in it.
    pub(super) slice: usize,
    pub(super) inner: usize,
    /// Plan entry of the datagram handed out last, and its length.
    pub(super) last: usize,
    pub(super) last_len: usize,
    /// Datagrams and payload bytes handed out.
    pub(super) handed: usize,
    pub(super) bytes: usize,
}

impl Filler<'_, '_, '_> {
    pub(super) fn skip_to(&mut self, at: usize) {
        self.at = at;
        self.emitted = 0;
        self.off = 0;
        self.slice = 0;
        self.inner = 0;
    }

    /// Datagrams still to hand out.
    pub(super) fn left(&self) -> usize {
        let mut n: usize = self
            .plan
            .iter()
            .skip(self.at)
            .filter(|p| !p.drop)
            .map(|p| p.datagrams)
            .sum();
        if self.plan.get(self.at).is_some_and(|p| !p.drop) {
            n = n.saturating_sub(self.emitted);
        }
        n
    }

    /// Writes the next datagram into `buf`; `None` when every planned bundle is out.
    pub(super) fn next(&mut self, buf: &mut [u8]) -> Option<(usize, TxMeta)> {
        loop {
            let p = *self.plan.get(self.at)?;
            if p.drop || self.emitted >= p.datagrams {
                self.skip_to(self.at + 1);
                continue;
            }
            let t = self.batch.get(p.bundle)?;
            let len = p.seg.min(p.total.saturating_sub(self.off));
            let out = buf.get_mut(..len)?;
            copy_from_iov(t.iov, &mut self.slice, &mut self.inner, out);
            self.off += len;
            self.emitted += 1;
            self.last = self.at;
            self.last_len = len;
            self.handed += 1;
            self.bytes += len;
            if self.emitted == p.datagrams {
                self.skip_to(self.at + 1);
            }
            return Some((
                len,
                TxMeta {
                    dst: p.dst,
                    tos: p.tos,
                },
            ));
        }
    }
}

/// Copies the next `out.len()` bytes of `iov` from (`slice`, `inner`) on, advancing them.
fn copy_from_iov(iov: &[IoSlice<'_>], slice: &mut usize, inner: &mut usize, mut out: &mut [u8]) {
    while !out.is_empty() {
        let Some(s) = iov.get(*slice) else { break };
        let rest = s.get(*inner..).unwrap_or_default();
        let n = rest.len().min(out.len());
        let (head, tail) = std::mem::take(&mut out).split_at_mut(n);
        head.copy_from_slice(&rest[..n]);
        out = tail;
        *inner += n;
        if *inner >= s.len() {
            *slice += 1;
            *inner = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(bundle: usize, tos: u8, seg: usize, total: usize) -> Planned {
        Planned {
            bundle,
            dst: "198.18.0.2:7000".parse().unwrap(),
            tos,
            seg,
            total,
            datagrams: if total == 0 { 1 } else { total.div_ceil(seg) },
            drop: false,
        }
    }

    /// The filler cuts bundles at their segment size across slice boundaries, emits an
    /// empty bundle as one empty datagram, skips dropped bundles, and stops at the end.
    #[test]
    fn filler_cuts_bundles_across_slices() {
        let data: Vec<u8> = (0..=255u8).cycle().take(2500).collect();
        let parts = [&data[..7], &data[7..7], &data[7..1500], &data[1500..]];
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let other = [IoSlice::new(&data[..100])];
        let dst: SocketAddr = "198.18.0.2:7000".parse().unwrap();
        let batch = [
            Transmit {
                dst,
                tos: 0x28,
                segment_size: 1000,
                iov: &iov,
            },
            Transmit {
                dst,
                tos: 1,
                segment_size: 0,
                iov: &[],
            },
            Transmit {
                dst,
                tos: 2,
                segment_size: 64,
                iov: &other,
            },
            Transmit {
                dst,
                tos: 3,
                segment_size: 1000,
                iov: &other,
            },
        ];
        let mut plan = vec![
            planned(0, 0x28, 1000, 2500),
            planned(1, 1, 0, 0),
            Planned {
                drop: true,
                ..planned(2, 2, 64, 100)
            },
            planned(3, 3, 100, 100),
        ];
        let mut fill = Filler {
            batch: &batch,
            plan: &mut plan,
            at: 0,
            emitted: 0,
            off: 0,
            slice: 0,
            inner: 0,
            last: 0,
            last_len: 0,
            handed: 0,
            bytes: 0,
        };
        assert_eq!(fill.left(), 5);
        let mut out = Vec::new();
        let mut buf = vec![0u8; 3000];
        while let Some((len, meta)) = fill.next(&mut buf) {
            out.push((buf[..len].to_vec(), meta.tos));
            assert_eq!(fill.left(), 5 - out.len());
        }
        assert_eq!(out.len(), 5);
        assert_eq!(out[0], (data[..1000].to_vec(), 0x28));
        assert_eq!(out[1], (data[1000..2000].to_vec(), 0x28));
        assert_eq!(out[2], (data[2000..].to_vec(), 0x28));
        assert_eq!(out[3], (Vec::new(), 1));
        assert_eq!(out[4], (data[..100].to_vec(), 3));
        assert_eq!((fill.handed, fill.bytes, fill.last), (5, 2600, 3));
        assert!(fill.next(&mut buf).is_none());
    }

    /// A buffer too small for the next datagram stops the filler without losing its place.
    #[test]
    fn filler_stops_on_a_short_buffer() {
        let data = [7u8; 300];
        let iov = [IoSlice::new(&data)];
        let batch = [Transmit {
            dst: "198.18.0.2:7000".parse().unwrap(),
            tos: 0,
            segment_size: 200,
            iov: &iov,
        }];
        let mut plan = vec![planned(0, 0, 200, 300)];
        let mut fill = Filler {
            batch: &batch,
            plan: &mut plan,
            at: 0,
            emitted: 0,
            off: 0,
            slice: 0,
            inner: 0,
            last: 0,
            last_len: 0,
            handed: 0,
            bytes: 0,
        };
        assert!(fill.next(&mut [0u8; 100]).is_none());
        assert_eq!(fill.left(), 2);
        let mut buf = [0u8; 200];
        assert_eq!(fill.next(&mut buf).map(|x| x.0), Some(200));
        assert_eq!(fill.next(&mut buf).map(|x| x.0), Some(100));
        assert_eq!(fill.left(), 0);
    }
}
