//! An in-memory datapath pair: what one end sends, the other receives, in order, losslessly
//! unless its bounded queue is full. Wrap it in [`super::fault::FaultInjector`] for loss,
//! reordering, duplication and delay.

use std::net::SocketAddr;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};

use super::{Datapath, DatapathError, DatapathStats, Deliver, Fill, RxMeta};

/// Default queue depth per direction, in datagrams (like a NIC ring plus socket buffer).
pub const DEFAULT_QUEUE: usize = 65_536;

type Datagram = (RxMeta, Vec<u8>);

/// One end of an in-memory link.
#[derive(Debug)]
pub struct Loopback {
    addr: SocketAddr,
    max_datagram: usize,
    tx: Sender<Datagram>,
    rx: Receiver<Datagram>,
    /// Spent buffers come back here so steady state allocates nothing.
    pool: Vec<Vec<u8>>,
    stats: DatapathStats,
}

impl Loopback {
    /// Two connected ends with addresses `a` and `b`, carrying datagrams up to
    /// `max_datagram` bytes, with `queue` slots per direction.
    pub fn pair(
        a: SocketAddr,
        b: SocketAddr,
        max_datagram: usize,
        queue: usize,
    ) -> (Loopback, Loopback) {
        let (tx_ab, rx_ab) = bounded(queue);
        let (tx_ba, rx_ba) = bounded(queue);
        let end = |addr, tx, rx| Loopback {
            addr,
            max_datagram,
            tx,
            rx,
            pool: Vec::new(),
            stats: DatapathStats::default(),
        };
        (end(a, tx_ab, rx_ba), end(b, tx_ba, rx_ab))
    }
}

impl Datapath for Loopback {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn max_datagram(&self) -> usize {
        self.max_datagram
    }

    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        let mut filled = 0;
        while filled < max {
            let mut buf = self.pool.pop().unwrap_or_default();
            buf.resize(self.max_datagram, 0);
            let Some((len, meta)) = fill(&mut buf) else {
                self.pool.push(buf);
                break;
            };
            filled += 1;
            buf.truncate(len.min(self.max_datagram));
            let bytes = buf.len() as u64;
            match self.tx.try_send((
                RxMeta {
                    src: self.addr,
                    tos: meta.tos,
                },
                buf,
            )) {
                Ok(()) => {
                    self.stats.tx_packets += 1;
                    self.stats.tx_bytes += bytes;
                }
                Err(TrySendError::Full(_)) => self.stats.tx_dropped += 1,
                Err(TrySendError::Disconnected(_)) => return Err(DatapathError::Closed),
            }
        }
        Ok(filled)
    }

    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        let mut n = 0;
        while n < max {
            let got = if n == 0 {
                match self.rx.recv_timeout(timeout) {
                    Ok(d) => d,
                    Err(RecvTimeoutError::Timeout) => break,
                    // The peer went away: like a silent network, nothing more arrives; the
                    // control channel, not the data path, reports a vanished peer.
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match self.rx.try_recv() {
                    Ok(d) => d,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            };
            let (meta, buf) = got;
            deliver(&meta, &buf);
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += buf.len() as u64;
            if self.pool.len() < 1024 {
                self.pool.push(buf);
            }
            n += 1;
        }
        Ok(n)
    }

    fn stats(&self) -> DatapathStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::TxMeta;

    fn addrs() -> (SocketAddr, SocketAddr) {
        (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        )
    }

    #[test]
    fn delivers_in_order_and_counts() {
        let (a, b) = addrs();
        let (mut x, mut y) = Loopback::pair(a, b, 64, 8);
        let mut k = 0u8;
        let sent = x
            .send(5, &mut |buf: &mut [u8]| {
                buf[0] = k;
                k += 1;
                Some((1 + k as usize, TxMeta { dst: b, tos: 0b11 }))
            })
            .unwrap();
        assert_eq!(sent, 5);
        let mut got = Vec::new();
        let n = y
            .recv(
                10,
                Duration::from_millis(10),
                &mut |m: &RxMeta, d: &[u8]| {
                    assert_eq!(m.src, a);
                    assert!(m.is_ce());
                    got.push((d[0], d.len()));
                },
            )
            .unwrap();
        assert_eq!(n, 5);
        assert_eq!(got, vec![(0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]);
        assert_eq!(x.stats().tx_packets, 5);
        assert_eq!(y.stats().rx_bytes, 2 + 3 + 4 + 5 + 6);
        // Empty queue: timeout, nothing delivered.
        assert_eq!(
            y.recv(10, Duration::from_millis(1), &mut |_: &RxMeta, _: &[u8]| {})
                .unwrap(),
            0
        );
    }

    #[test]
    fn full_queue_drops_and_closed_peer_errors() {
        let (a, b) = addrs();
        let (mut x, y) = Loopback::pair(a, b, 16, 2);
        let n = x
            .send(4, &mut |_: &mut [u8]| Some((4, TxMeta { dst: b, tos: 0 })))
            .unwrap();
        assert_eq!(n, 4);
        assert_eq!(x.stats().tx_dropped, 2);
        drop(y);
        assert!(matches!(
            x.send(1, &mut |_: &mut [u8]| Some((4, TxMeta { dst: b, tos: 0 }))),
            Err(DatapathError::Closed)
        ));
    }
}
