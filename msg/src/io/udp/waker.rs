//! The eventfd [`Waker`]: how another thread interrupts a socket's `wait`.
//!
//! Shared by every kind of datagram socket (the AF_XDP one polls it too), so it stands alone.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nix::sys::eventfd::{EfdFlags, EventFd};

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
}

impl AsFd for Waker {
    /// The eventfd: readable while woken.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
