//! The AF_XDP system calls, each wrapped once: `socket`, `setsockopt`/`getsockopt` on
//! `SOL_XDP`, `bind`, the `sendto` TX kick, `poll`, and `mmap`/`munmap`.
//!
//! This module and [`super::ring`] / [`super::umem`] are the only places in gradwire that
//! talk to the kernel with raw pointers; everything above them is safe code.
#![allow(unsafe_code)]

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::{self, NonNull};

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A new AF_XDP socket.
pub fn xsk_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with constant arguments; no pointers.
    let fd = cvt(unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `setsockopt(fd, level, opt, &val)` for a plain-old-data `T`.
pub fn setsockopt<T: Copy>(
    fd: &OwnedFd,
    level: libc::c_int,
    opt: libc::c_int,
    val: &T,
) -> io::Result<()> {
    // SAFETY: `val` points to a live `T` of exactly `size_of::<T>()` bytes for the duration
    // of the call; the kernel only reads it.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (val as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// `getsockopt(fd, SOL_XDP, opt)` for a plain-old-data `T` that the kernel fills. Returns
/// the value and the length the kernel wrote (older kernels write shorter structs).
pub fn getsockopt_xdp<T: Copy>(fd: &OwnedFd, opt: libc::c_int) -> io::Result<(T, usize)> {
    // SAFETY: every `T` used here is a C struct of integers for which all-zero is valid.
    let mut val: T = unsafe { zeroed() };
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `val` is writable for `len` bytes and `len` is a valid in/out pointer.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_XDP,
            opt,
            (&mut val as *mut T).cast(),
            &mut len,
        )
    })?;
    Ok((val, len as usize))
}

/// Register a UMEM area with the socket.
pub fn umem_reg(
    fd: &OwnedFd,
    base: NonNull<u8>,
    len: usize,
    frame_size: u32,
    headroom: u32,
) -> io::Result<()> {
    // SAFETY: all-zero is valid for this C struct (it also zeroes fields newer kernels added).
    let mut reg: libc::xdp_umem_reg = unsafe { zeroed() };
    reg.addr = base.as_ptr() as u64;
    reg.len = len as u64;
    reg.chunk_size = frame_size;
    reg.headroom = headroom;
    setsockopt(fd, libc::SOL_XDP, libc::XDP_UMEM_REG, &reg)
}

/// Bind to `(ifindex, queue)` with `flags` (`XDP_COPY`, `XDP_ZEROCOPY`, `XDP_USE_NEED_WAKEUP`).
pub fn bind(fd: &OwnedFd, ifindex: u32, queue: u32, flags: u16) -> io::Result<()> {
    // SAFETY: all-zero is a valid sockaddr_xdp.
    let mut sa: libc::sockaddr_xdp = unsafe { zeroed() };
    sa.sxdp_family = libc::AF_XDP as u16;
    sa.sxdp_flags = flags;
    sa.sxdp_ifindex = ifindex;
    sa.sxdp_queue_id = queue;
    // SAFETY: `sa` is a live sockaddr_xdp and the length matches it.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_xdp).cast(),
            size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// Ask the kernel to process the TX ring (copy mode transmits only inside this call) or, in
/// busy-poll mode, to run the device's NAPI loop.
pub fn kick(fd: RawFd) -> io::Result<()> {
    // SAFETY: a zero-length sendto with null buffers is the documented AF_XDP wakeup.
    let rc = unsafe { libc::sendto(fd, ptr::null(), 0, libc::MSG_DONTWAIT, ptr::null(), 0) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        // Busy, out of buffers or no room yet: the frames stay queued and the next kick
        // picks them up. These are the codes libxdp's xsk examples retry on.
        match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS | libc::ENETDOWN | libc::EINTR) => {}
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Drive RX processing without blocking (busy-poll mode, or a FILL ring that needs wakeup).
pub fn recv_kick(fd: RawFd) -> io::Result<()> {
    // SAFETY: a zero-length recvfrom with null buffers is the documented AF_XDP wakeup.
    let rc = unsafe {
        libc::recvfrom(
            fd,
            ptr::null_mut(),
            0,
            libc::MSG_DONTWAIT,
            ptr::null_mut(),
            ptr::null_mut(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS | libc::ENETDOWN | libc::EINTR) => {}
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Wait until `fd` is readable or `timeout_ms` passes (wake-on-demand mode).
pub fn poll_in(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd.
    match cvt(unsafe { libc::poll(&mut p, 1, timeout_ms) }) {
        Ok(n) => Ok(n > 0 && p.revents & libc::POLLIN != 0),
        Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Wait until any of `fds` is readable or `timeout_ms` passes.
pub fn poll_many(fds: &[RawFd], timeout_ms: i32) -> io::Result<bool> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` is a live array of `p.len()` pollfds.
    match cvt(unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) }) {
        Ok(n) => Ok(n > 0),
        Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(false),
        Err(e) => Err(e),
    }
}

/// An owned memory mapping, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is plain memory owned by this value; moving it between threads is fine.
// Concurrent access rules are enforced by the types that hand out views of it.
unsafe impl Send for Mapping {}

// SAFETY: sharing a Mapping only shares its address; every access to the bytes goes through
// `umem::SharedUmem`, whose unsafe accessors require the caller to own the frame it touches.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Anonymous private mapping, optionally on huge pages.
    pub fn anonymous(len: usize, huge: bool) -> io::Result<Mapping> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
        if huge {
            flags |= libc::MAP_HUGETLB;
        }
        // SAFETY: anonymous mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        Self::from_raw(p, len)
    }

    /// Shared mapping of a socket's ring at page offset `pgoff`.
    pub fn ring(fd: &OwnedFd, len: usize, pgoff: i64) -> io::Result<Mapping> {
        // SAFETY: maps `len` bytes of the socket's ring area; the result is checked.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                pgoff,
            )
        };
        Self::from_raw(p, len)
    }

    fn from_raw(p: *mut libc::c_void, len: usize) -> io::Result<Mapping> {
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len })
    }

    /// Start of the mapping.
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never produced).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from a successful mmap and are unmapped exactly once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
