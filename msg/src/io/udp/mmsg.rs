//! The raw message headers of `sendmmsg(2)`/`recvmmsg(2)` and the two system calls.
//!
//! [`TxState`] and [`RxState`] hold, allocated once at bind, everything the kernel reads or
//! writes through a `mmsghdr`: the header and `iovec` arrays ([`RawMsgs`]), one address slot
//! and one control-message buffer per header, and (receive side) the datagram buffers.
//! [`TxState::sendmmsg`] and [`RxState::recvmmsg`] point each header at its slots and make the
//! call. This is the only file of the UDP socket with `unsafe` code outside tests: the two system
//! calls, the zeroed `mmsghdr` template and the `Send`/`Sync` promise of the header arrays,
//! each with its `SAFETY` argument. Why the socket fills `mmsghdr`s itself rather than use
//! `nix`'s wrappers is in the [module documentation](super).
#![allow(unsafe_code)]

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

use super::cmsg::{CmsgBuf, RECV_CMSG_SPACE, SEND_CMSG_SPACE};
use super::sockaddr::{RawAddr, SIN6_LEN};
use super::{Transmit, MAX_SEND_MSGS};

/// call and never dereferenced by Rust code.
pub(super) struct RawMsgs {
    pub(super) hdrs: Vec<libc::mmsghdr>,
    pub(super) iovs: Vec<libc::iovec>,
}

// SAFETY: the raw pointers inside are plain addresses between calls: they are rewritten before
// every system call that uses them and never read through by Rust code, so moving the arrays to
// another thread (Send) or sharing `&RawMsgs` (Sync, which gives access to nothing but the
// addresses' values) cannot cause a data race or a use after free.
unsafe impl Send for RawMsgs {}
// SAFETY: see `Send` above; `&RawMsgs` allows no write and no dereference.
unsafe impl Sync for RawMsgs {}

impl RawMsgs {
    /// `msgs` zeroed headers and an empty iovec list with room for `iovs` (send scratch).
    fn with_scratch(msgs: usize, iovs: usize) -> Self {
        let mut raw = RawMsgs::new(msgs, 0);
        raw.iovs.reserve(iovs);
        raw
    }

    /// `msgs` zeroed headers and `iovs` null iovecs.
    fn new(msgs: usize, iovs: usize) -> Self {
        // SAFETY: `mmsghdr` is integers and raw pointers only; all-zero (null pointers, zero
        // lengths) is a valid value of it.
        let zero: libc::mmsghdr = unsafe { std::mem::zeroed() };
        let iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        RawMsgs {
            hdrs: vec![zero; msgs],
            iovs: vec![iov; iovs],
        }
    }
}

/// Where a sent `msghdr`'s iovec list comes from.
#[derive(Debug, Clone, Copy)]
pub(super) enum PieceIov {
    /// The bundle's own `IoSlice`s (ABI-compatible with `iovec`): the whole bundle in one go.
    Whole,
    /// `tx.raw.iovs[start..start + len]`: part of a bundle, cut at segment boundaries.
    Scratch { start: usize, len: usize },
}

/// One `msghdr` of a `sendmmsg` call: a whole bundle or a run of its segments.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    pub(super) bundle: usize,
    pub(super) segs: usize,
    pub(super) bytes: usize,
    /// Offset in the bundle after this piece.
    pub(super) end: usize,
    /// The bundle's last piece.
    pub(super) last: bool,
    pub(super) iov: PieceIov,
    pub(super) namelen: libc::socklen_t,
    pub(super) controllen: usize,
}

/// Walks a bundle's slices to cut it at arbitrary byte offsets.
pub(super) struct IovWalk {
    idx: usize,
    inner: usize,
}

impl IovWalk {
    pub(super) fn seek(iov: &[IoSlice<'_>], mut off: usize) -> Self {
        let mut idx = 0;
        while let Some(s) = iov.get(idx) {
            if off < s.len() {
                break;
            }
            off -= s.len();
            idx += 1;
        }
        IovWalk { idx, inner: off }
    }

    /// Appends iovecs for the next `len` bytes.
    pub(super) fn take(&mut self, iov: &[IoSlice<'_>], mut len: usize, out: &mut Vec<libc::iovec>) {
        while len > 0 {
            let Some(s) = iov.get(self.idx) else { break };
            let rest = s.get(self.inner..).unwrap_or_default();
            let n = rest.len().min(len);
            if n > 0 {
                out.push(libc::iovec {
                    iov_base: rest.as_ptr().cast_mut().cast(),
                    iov_len: n,
                });
            }
            len -= n;
            self.inner += n;
            if self.inner >= s.len() {
                self.idx += 1;
                self.inner = 0;
            }
        }
    }
}

/// What one `sendmmsg` call needs besides the caller's bundles: `msghdr`s with their scratch
/// iovecs, destination addresses and control messages, and the pieces they were built from.
pub(super) struct TxState {
    pub(super) raw: RawMsgs,
    pub(super) names: Vec<RawAddr>,
    pub(super) cmsgs: Vec<CmsgBuf<SEND_CMSG_SPACE>>,
    pub(super) pieces: Vec<Piece>,
}

/// What one `recvmmsg` call fills: `msghdr`s, one iovec, source address slot and
/// control-message buffer each, and `recv_batch` datagram buffers of `buf_len` bytes.
pub(super) struct RxState {
    pub(super) raw: RawMsgs,
    pub(super) names: Vec<RawAddr>,
    pub(super) cmsgs: Vec<CmsgBuf<RECV_CMSG_SPACE>>,
    pub(super) buf: Vec<u8>,
    pub(super) buf_len: usize,
    /// Last `SO_RXQ_OVFL` value seen.
    pub(super) drops_seen: u32,
}

impl TxState {
    /// Room for [`MAX_SEND_MSGS`] `msghdr`s, allocated once at bind.
    pub(super) fn new() -> Self {
        TxState {
            raw: RawMsgs::with_scratch(MAX_SEND_MSGS, 4 * MAX_SEND_MSGS),
            names: vec![RawAddr::ZERO; MAX_SEND_MSGS],
            cmsgs: vec![CmsgBuf([0; SEND_CMSG_SPACE]); MAX_SEND_MSGS],
            pieces: Vec::with_capacity(MAX_SEND_MSGS),
        }
    }

    /// One `sendmmsg` on `sock` of the built pieces: how many the kernel took. The pieces
    /// (with their addresses, control messages and scratch iovecs) were built from this same
    /// `batch` by `UdpIo::build`, just before.
    pub(super) fn sendmmsg(
        &mut self,
        sock: BorrowedFd<'_>,
        batch: &[Transmit<'_>],
    ) -> Result<usize, Errno> {
        let names = self.names.as_mut_ptr();
        let cmsgs = self.cmsgs.as_mut_ptr();
        let iovs = self.raw.iovs.as_mut_ptr();
        let pieces = &self.pieces;
        for (i, (p, h)) in pieces.iter().zip(self.raw.hdrs.iter_mut()).enumerate() {
            let m = &mut h.msg_hdr;
            m.msg_name = names.wrapping_add(i).cast();
            m.msg_namelen = p.namelen;
            match p.iov {
                PieceIov::Whole => {
                    let iov = batch.get(p.bundle).map_or(&[][..], |t| t.iov);
                    m.msg_iov = iov.as_ptr().cast_mut().cast();
                    m.msg_iovlen = iov.len() as _;
                }
                PieceIov::Scratch { start, len } => {
                    m.msg_iov = iovs.wrapping_add(start);
                    m.msg_iovlen = len as _;
                }
            }
            if p.controllen > 0 {
                m.msg_control = cmsgs.wrapping_add(i).cast();
            } else {
                m.msg_control = std::ptr::null_mut();
            }
            m.msg_controllen = p.controllen as _;
            m.msg_flags = 0;
            h.msg_len = 0;
        }
        let count = pieces.len().min(self.raw.hdrs.len()) as libc::c_uint;
        // SAFETY: `hdrs[..count]` were all filled above. Each `msg_name` points to a `RawAddr`
        // of `self.names` (28 bytes >= `msg_namelen`), each `msg_control` to
        // `msg_controllen` initialised bytes of `self.cmsgs` (or is null with length 0),
        // each `msg_iov` to `msg_iovlen` iovecs: either the caller's `IoSlice`s (guaranteed
        // ABI-compatible with `iovec`, borrowed through `batch` for this whole call) or entries
        // of `self.raw.iovs` built from those slices in `build`, each within its slice. The
        // vectors are not touched between taking their pointers and the call, so the pointers
        // are valid; the kernel only reads all of it and writes nothing but `msg_len` in
        // `hdrs`, which we own mutably.
        let rc = unsafe {
            libc::sendmmsg(
                sock.as_raw_fd(),
                self.raw.hdrs.as_mut_ptr(),
                count,
                libc::MSG_DONTWAIT,
            )
        };
        if rc < 0 {
            Err(Errno::last())
        } else {
            Ok(usize::try_from(rc).unwrap_or(0))
        }
    }
}

impl RxState {
    /// `batch` receive buffers of `buf_len` bytes with their headers, allocated once at bind.
    pub(super) fn new(batch: usize, buf_len: usize) -> Self {
        RxState {
            raw: RawMsgs::new(batch, batch),
            names: vec![RawAddr::ZERO; batch],
            cmsgs: vec![CmsgBuf([0; RECV_CMSG_SPACE]); batch],
            buf: vec![0; batch * buf_len],
            buf_len,
            drops_seen: 0,
        }
    }

    /// One `recvmmsg` (`MSG_DONTWAIT`) on `sock` into every buffer: how many `msghdr`s the
    /// kernel filled (`msg_len`, `msg_flags`, the source in `names[i]`, the control messages
    /// in `cmsgs[i]`, the data in chunk `i` of `buf`).
    pub(super) fn recvmmsg(&mut self, sock: BorrowedFd<'_>) -> Result<usize, Errno> {
        let buf_len = self.buf_len;
        let count = self.raw.hdrs.len().min(self.raw.iovs.len());
        let base = self.buf.as_mut_ptr();
        for (i, iov) in self.raw.iovs.iter_mut().enumerate() {
            iov.iov_base = base.wrapping_add(i * buf_len).cast();
            iov.iov_len = buf_len;
        }
        let names = self.names.as_mut_ptr();
        let cmsgs = self.cmsgs.as_mut_ptr();
        let iovs = self.raw.iovs.as_mut_ptr();
        for (i, h) in self.raw.hdrs.iter_mut().enumerate() {
            let m = &mut h.msg_hdr;
            m.msg_name = names.wrapping_add(i).cast();
            m.msg_namelen = SIN6_LEN as libc::socklen_t;
            m.msg_iov = iovs.wrapping_add(i);
            m.msg_iovlen = 1;
            m.msg_control = cmsgs.wrapping_add(i).cast();
            m.msg_controllen = RECV_CMSG_SPACE as _;
            m.msg_flags = 0;
            h.msg_len = 0;
        }
        // SAFETY: `hdrs[..count]` were all filled just above: msg_name points to a
        // `RawAddr` of `self.names` (28 writable bytes = msg_namelen), msg_control to a
        // `RECV_CMSG_SPACE`-byte buffer of `self.cmsgs` (= msg_controllen), msg_iov to one
        // iovec of `self.raw.iovs` covering `buf_len` bytes of `self.buf` (chunk i of
        // `count * buf_len` bytes, in bounds since `buf` was allocated with
        // `recv_batch * buf_len` bytes and `count <= recv_batch`). All these vectors are
        // owned by `self`, mutably borrowed here, not resized or referenced between taking
        // their pointers and the call, and outlive it; the kernel writes only within those
        // lengths and into `hdrs`. A null timeout is allowed.
        let rc = unsafe {
            libc::recvmmsg(
                sock.as_raw_fd(),
                self.raw.hdrs.as_mut_ptr(),
                count as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if rc >= 0 {
            Ok(usize::try_from(rc).unwrap_or(0).min(count))
        } else {
            Err(Errno::last())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iov_walk_cuts_across_slices() {
        let data: Vec<u8> = (0..=255).collect();
        let parts = [&data[..10], &data[10..10], &data[10..100], &data[100..]];
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut out = Vec::new();
        for (off, len) in [(0, 256), (5, 7), (10, 90), (95, 161), (250, 100), (256, 1)] {
            out.clear();
            IovWalk::seek(&iov, off).take(&iov, len, &mut out);
            let got: usize = out.iter().map(|v| v.iov_len).sum();
            assert_eq!(got, len.min(256 - off.min(256)), "off {off} len {len}");
            if let Some(first) = out.first() {
                assert_eq!(first.iov_base.cast_const(), data[off..].as_ptr().cast());
            }
        }
    }
}
