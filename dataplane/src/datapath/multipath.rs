//! Host-side multipath: round robin over several datapaths, one per interface or next hop
//! (DLCP §3.2.3's source-routed choice). Each datapath is bound to its own interface or
//! address, so the choice of datapath is the choice of path; no switch hashing is involved.
//! The receiver needs no reordering: segments are placed by offset.
//!
//! Sending rotates per `chunk` datagrams (1: every datagram takes the next path). Receiving
//! polls every path in turn without blocking, then waits on them in short slices until the
//! timeout, so no path starves another.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{Datapath, DatapathError, DatapathStats, Deliver, Fill};

/// Longest single wait on one path while the others may have data.
const WAIT_SLICE: Duration = Duration::from_micros(200);

/// Round robin over several datapaths.
pub struct MultiPath {
    paths: Vec<Box<dyn Datapath + Send>>,
    chunk: usize,
    tx_next: usize,
    rx_next: usize,
    /// Datagrams sent on each path, for reports and tests.
    sent_per_path: Vec<u64>,
}

impl std::fmt::Debug for MultiPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiPath")
            .field("paths", &self.paths.len())
            .field("chunk", &self.chunk)
            .field("sent_per_path", &self.sent_per_path)
            .finish_non_exhaustive()
    }
}

impl MultiPath {
    /// Round robin over `paths` (at least one), `chunk` (>= 1) datagrams per turn. The first
    /// path's address is the one peers are told to send to; every path receives.
    pub fn new(paths: Vec<Box<dyn Datapath + Send>>, chunk: usize) -> Option<MultiPath> {
        if paths.is_empty() || chunk == 0 {
            return None;
        }
        let n = paths.len();
        Some(MultiPath {
            paths,
            chunk,
            tx_next: 0,
            rx_next: 0,
            sent_per_path: vec![0; n],
        })
    }

    /// Datagrams sent on each path so far.
    pub fn sent_per_path(&self) -> &[u64] {
        &self.sent_per_path
    }
}

impl Datapath for MultiPath {
    fn name(&self) -> &'static str {
        "multipath"
    }

    fn local_addr(&self) -> SocketAddr {
        self.paths[0].local_addr()
    }

    /// Every path's sources: a receiver must accept the flow's data from all of them.
    fn data_sources(&self) -> Vec<super::DataSource> {
        let mut all: Vec<super::DataSource> = Vec::new();
        for s in self.paths.iter().flat_map(|p| p.data_sources()) {
            if !all.contains(&s) {
                all.push(s);
            }
        }
        all
    }

    /// All paths or none: a path that refuses undoes the admissions of those before it.
    fn admit_peers(&mut self, peers: &[super::DataSource]) -> Result<(), DatapathError> {
        for i in 0..self.paths.len() {
            if let Err(e) = self.paths[i].admit_peers(peers) {
                for done in &mut self.paths[..i] {
                    // Best effort: the admission error is the one to report.
                    let _ = done.release_peers(peers);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Every path, even after one fails; the first error is reported.
    fn release_peers(&mut self, peers: &[super::DataSource]) -> Result<(), DatapathError> {
        let mut first = Ok(());
        for p in &mut self.paths {
            if let Err(e) = p.release_peers(peers) {
                first = first.and(Err(e));
            }
        }
        first
    }

    fn max_datagram(&self) -> usize {
        self.paths
            .iter()
            .map(|p| p.max_datagram())
            .min()
            .unwrap_or(0)
    }

    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        let n = self.paths.len();
        let mut done = 0;
        while done < max {
            let i = self.tx_next % n;
            let want = self.chunk.min(max - done);
            let sent = self.paths[i].send(want, fill)?;
            self.sent_per_path[i] += sent as u64;
            done += sent;
            if sent < want {
                // `fill` ran out (or the path is full): this batch is over; the next one
                // continues on the same path so that rotation stays even.
                break;
            }
            self.tx_next = (i + 1) % n;
        }
        Ok(done)
    }

    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        let n = self.paths.len();
        let deadline = Instant::now() + timeout;
        loop {
            let mut got = 0;
            for k in 0..n {
                if got >= max {
                    break;
                }
                let i = (self.rx_next + k) % n;
                got += self.paths[i].recv(max - got, Duration::ZERO, deliver)?;
            }
            self.rx_next = (self.rx_next + 1) % n;
            let now = Instant::now();
            if got > 0 || now >= deadline {
                return Ok(got);
            }
            // Nothing anywhere: wait on one path for a short slice, then look at all again.
            let slice = (deadline - now).min(WAIT_SLICE);
            let i = self.rx_next;
            let got = self.paths[i].recv(max, slice, deliver)?;
            if got > 0 {
                return Ok(got);
            }
        }
    }

    fn stats(&self) -> DatapathStats {
        self.paths
            .iter()
            .fold(DatapathStats::default(), |mut a, p| {
                let s = p.stats();
                a.tx_packets += s.tx_packets;
                a.tx_bytes += s.tx_bytes;
                a.tx_dropped += s.tx_dropped;
                a.rx_packets += s.rx_packets;
                a.rx_bytes += s.rx_bytes;
                a.rx_dropped += s.rx_dropped;
                a
            })
    }

    fn backend_stats(&self) -> Option<super::BackendStats> {
        self.paths.iter().find_map(|p| p.backend_stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::loopback::Loopback;
    use crate::datapath::TxMeta;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn every_datagram_takes_the_next_path_and_all_arrive() {
        let (a1, b1) = Loopback::pair(addr("198.18.1.1:7000"), addr("198.18.1.2:7000"), 1472, 1024);
        let (a2, b2) = Loopback::pair(addr("198.18.2.1:7000"), addr("198.18.2.2:7000"), 1472, 1024);
        let mut tx = MultiPath::new(vec![Box::new(a1), Box::new(a2)], 1).unwrap();
        let mut rx = MultiPath::new(vec![Box::new(b1), Box::new(b2)], 1).unwrap();
        assert!(MultiPath::new(Vec::new(), 1).is_none());
        let dst = addr("198.18.1.2:7000");
        let mut k = 0u8;
        let mut fill = |buf: &mut [u8]| {
            if k == 101 {
                return None;
            }
            buf[0] = k;
            k += 1;
            Some((1, TxMeta { dst, tos: 0 }))
        };
        let mut sent = 0;
        while sent < 101 {
            let n = tx.send(32, &mut fill).unwrap();
            if n == 0 {
                break;
            }
            sent += n;
        }
        assert_eq!(sent, 101);
        assert_eq!(tx.sent_per_path(), &[51, 50]);
        let mut seen = Vec::new();
        while seen.len() < 101 {
            let n = rx
                .recv(64, Duration::from_millis(100), &mut |_, d: &[u8]| {
                    seen.push(d[0])
                })
                .unwrap();
            assert!(n > 0, "datagrams missing: {}", seen.len());
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..101).collect::<Vec<u8>>());
        assert_eq!(rx.stats().rx_packets, 101);
        assert_eq!(tx.stats().tx_packets, 101);
    }
}
