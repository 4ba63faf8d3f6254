//! The eventfd [`Waker`]: how another thread interrupts a socket's `wait`.
//!
//! Shared by every kind of datagram socket (the AF_XDP one polls it too), so it stands alone.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;

use super::Readiness;

/// Timeouts at or above this many seconds wait forever (and cannot overflow a `timespec`).
const FOREVER_SECS: u64 = 100 * 365 * 24 * 3600;

/// Wakes a thread blocked in [`UdpIo::wait`](super::UdpIo::wait). Cheap to clone,
/// `Send + Sync`; keeps the eventfd open, so waking after the socket is gone is harmless.
#[derive(Clone, Debug)]
pub struct Waker {
    fd: Arc<OwnedFd>,
}

impl Waker {
    /// A waker over a new nonblocking eventfd, for a [`DatagramIo`](crate::io::DatagramIo) of
    /// another kind: its `wait` polls the waker's descriptor ([`AsFd`]) for `POLLIN` beside its
    /// socket and, when it fired, reads the counter back to 0 (an 8-byte `read`; `EAGAIN` when
    /// another reader drained it first).
    pub fn new() -> std::io::Result<Waker> {
        let efd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(Waker {
            fd: Arc::new(OwnedFd::from(efd)),
        })
    }

    /// Makes the next (or current) [`UdpIo::wait`](super::UdpIo::wait) return with `woken`.
    /// Never blocks, never panics; a counter already at its maximum stays woken.
    pub fn wake(&self) {
        // EAGAIN only when the counter is about to overflow: it is already signalled.
        let _ = nix::unistd::write(&*self.fd, &1u64.to_ne_bytes());
    }

    /// The `wait` of every socket kind: blocks until `sock` is readable (or writable, when
    /// `want_write`), this waker fires, or `timeout` passes (`None`: forever), and drains the
    /// waker. A signal ends the wait early with nothing set. `errors` is `POLLERR` on `sock`.
    pub(crate) fn wait_beside(
        &self,
        sock: BorrowedFd<'_>,
        timeout: Option<Duration>,
        want_write: bool,
    ) -> Result<Readiness, Errno> {
        let mut events = PollFlags::POLLIN;
        if want_write {
            events |= PollFlags::POLLOUT;
        }
        let mut fds = [
            PollFd::new(sock, events),
            PollFd::new(self.fd.as_fd(), PollFlags::POLLIN),
        ];
        let ts = timeout
            .filter(|d| d.as_secs() < FOREVER_SECS)
            .map(TimeSpec::from_duration);
        match ppoll(&mut fds, ts, None) {
            Ok(_) => {}
            Err(Errno::EINTR) => return Ok(Readiness::default()),
            Err(e) => return Err(e),
        }
        let sock = fds[0].revents().unwrap_or(PollFlags::empty());
        let woken = fds[1]
            .revents()
            .unwrap_or(PollFlags::empty())
            .contains(PollFlags::POLLIN);
        if woken {
            let mut b = [0u8; 8];
            // Nonblocking: EAGAIN if another waiter drained it first.
            let _ = nix::unistd::read(&*self.fd, &mut b);
        }
        Ok(Readiness {
            readable: sock.intersects(PollFlags::POLLIN | PollFlags::POLLERR),
            writable: want_write && sock.contains(PollFlags::POLLOUT),
            woken,
            errors: sock.contains(PollFlags::POLLERR),
        })
    }
}

impl AsFd for Waker {
    /// The eventfd: readable while woken.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
