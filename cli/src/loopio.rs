//! `--datapath loopback` on the message layer: two in-memory datagram sockets joined to each
//! other inside one process, behind the layer's [`DatagramIo`], so the demo runs the same
//! endpoints, wire format and timers as over UDP without any kernel socket.
//!
//! Each end has an inbox (a bounded queue of datagrams) and an eventfd [`Waker`] that both the
//! endpoint (new commands) and the other end (new datagrams) fire. A bundle is cut into
//! datagrams at its segment size, as UDP's segmentation offload would; a datagram to an
//! address that is not the other end's, or to a full inbox, is dropped and counted, as a
//! network would.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gradwire_msg::io::{BoxError, DatagramIo, Readiness, RecvMeta, Transmit, Waker};
use nix::errno::Errno;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::time::TimeSpec;

/// Most segments of one bundle (UDP's GSO limit, so bundles look the same as over UDP).
const MAX_SEGMENTS: usize = 64;
/// Most datagrams one `recv` hands over.
const RECV_BUDGET: usize = 1024;

type Datagram = (SocketAddr, u8, Vec<u8>);

#[derive(Debug)]
struct Inbox {
    queue: Mutex<VecDeque<Datagram>>,
    waker: Waker,
    /// Datagrams dropped because the inbox was full.
    overflow: AtomicU64,
}

/// One end of an in-memory pair.
#[derive(Debug)]
pub struct MemIo {
    local: SocketAddr,
    mine: Arc<Inbox>,
    peer: SocketAddr,
    theirs: Arc<Inbox>,
    capacity: usize,
    /// Datagrams to an address that is not the other end's.
    no_route: u64,
    batch: Vec<Datagram>,
}

impl MemIo {
    /// Two ends at `a` and `b`, each inbox holding at most `capacity` datagrams.
    pub fn pair(a: SocketAddr, b: SocketAddr, capacity: usize) -> std::io::Result<(MemIo, MemIo)> {
        let inbox = || -> std::io::Result<Arc<Inbox>> {
            Ok(Arc::new(Inbox {
                queue: Mutex::new(VecDeque::new()),
                waker: Waker::new()?,
                overflow: AtomicU64::new(0),
            }))
        };
        let (ia, ib) = (inbox()?, inbox()?);
        let end = |local, mine: &Arc<Inbox>, peer, theirs: &Arc<Inbox>| MemIo {
            local,
            mine: mine.clone(),
            peer,
            theirs: theirs.clone(),
            capacity: capacity.max(1),
            no_route: 0,
            batch: Vec::with_capacity(RECV_BUDGET),
        };
        Ok((end(a, &ia, b, &ib), end(b, &ib, a, &ia)))
    }

    /// Datagrams this end sent that were dropped: (no route, the other inbox was full).
    #[cfg(test)]
    pub fn dropped(&self) -> (u64, u64) {
        (self.no_route, self.theirs.overflow.load(Ordering::Relaxed))
    }
}

impl DatagramIo for MemIo {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn max_segments(&self) -> usize {
        MAX_SEGMENTS
    }

    fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, BoxError> {
        let mut out = Vec::new();
        for t in batch {
            if t.dst != self.peer {
                self.no_route += 1;
                continue;
            }
            let bytes: Vec<u8> = t.iov.iter().flat_map(|s| s.iter().copied()).collect();
            let seg = if t.segment_size == 0 {
                bytes.len().max(1)
            } else {
                t.segment_size
            };
            if bytes.is_empty() {
                out.push((self.local, t.tos, Vec::new()));
            }
            out.extend(bytes.chunks(seg).map(|c| (self.local, t.tos, c.to_vec())));
        }
        if !out.is_empty() {
            let mut q = self.theirs.queue.lock().unwrap_or_else(|e| e.into_inner());
            for d in out {
                if q.len() >= self.capacity {
                    self.theirs.overflow.fetch_add(1, Ordering::Relaxed);
                } else {
                    q.push_back(d);
                }
            }
            drop(q);
            self.theirs.waker.wake();
        }
        Ok(batch.len())
    }

    fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, BoxError> {
        {
            let mut q = self.mine.queue.lock().unwrap_or_else(|e| e.into_inner());
            let n = q.len().min(RECV_BUDGET);
            self.batch.extend(q.drain(..n));
        }
        let n = self.batch.len();
        for (src, tos, d) in self.batch.drain(..) {
            f(RecvMeta { src, tos }, &d);
        }
        Ok(n)
    }

    fn wait(&self, timeout: Option<Duration>, _want_write: bool) -> Result<Readiness, BoxError> {
        let queued = || {
            !self
                .mine
                .queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
        };
        if queued() {
            return Ok(Readiness {
                readable: true,
                writable: true,
                ..Readiness::default()
            });
        }
        let mut fds = [PollFd::new(self.mine.waker.as_fd(), PollFlags::POLLIN)];
        let ts = timeout.map(TimeSpec::from_duration);
        match ppoll(&mut fds, ts, None) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(Box::new(std::io::Error::from(e))),
        }
        let woken = fds[0]
            .revents()
            .unwrap_or(PollFlags::empty())
            .contains(PollFlags::POLLIN);
        if woken {
            let mut b = [0u8; 8];
            // Nonblocking: EAGAIN when it was drained already.
            let _ = nix::unistd::read(&self.mine.waker, &mut b);
        }
        Ok(Readiness {
            readable: queued(),
            // An inbox never refuses: sending never waits.
            writable: true,
            woken,
            errors: false,
        })
    }

    fn waker(&self) -> Waker {
        self.mine.waker.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSlice;

    #[test]
    fn bundles_are_cut_at_the_segment_size_and_strangers_get_nothing() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap_or_else(|_| unreachable!());
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap_or_else(|_| unreachable!());
        let c: SocketAddr = "127.0.0.1:3".parse().unwrap_or_else(|_| unreachable!());
        let (mut x, mut y) = MemIo::pair(a, b, 4).expect("eventfds");
        let bytes = [7u8; 10];
        let iov = [IoSlice::new(&bytes[..3]), IoSlice::new(&bytes[3..])];
        let t = Transmit {
            dst: b,
            tos: 42,
            segment_size: 4,
            iov: &iov,
        };
        let stray = Transmit { dst: c, ..t };
        assert_eq!(x.send(&[t, stray]).expect("send"), 2);
        let r = y.wait(Some(Duration::from_secs(1)), false).expect("wait");
        assert!(r.readable);
        let mut got = Vec::new();
        y.recv(&mut |m, d| got.push((m.src, m.tos, d.len())))
            .expect("recv");
        assert_eq!(got, vec![(a, 42, 4), (a, 42, 4), (a, 42, 2)]);
        assert_eq!(x.dropped(), (1, 0));
        // A full inbox drops, as a network would.
        let five = [IoSlice::new(&bytes[..5])];
        let t = Transmit {
            dst: b,
            tos: 0,
            segment_size: 1,
            iov: &five,
        };
        x.send(&[t]).expect("send");
        assert_eq!(x.dropped(), (1, 1));
    }
}
