//! The crate's only `unsafe` code: three libbpf calls that libbpf-rs 0.27 does not wrap in
//! the form the loader needs.
//!
//! - `bpf_xdp_query` without a program: libbpf-rs only offers it on an `Xdp` built from a
//!   program fd, and the loader must query *before* loading anything.
//! - `bpf_link_create(BPF_XDP)` with `XDP_FLAGS_DRV_MODE` / `XDP_FLAGS_SKB_MODE`:
//!   `Program::attach_xdp` passes no mode flag, so the kernel silently picks generic mode on a
//!   driver without native XDP, and generic mode cannot be requested at all. A bpf_link
//!   (rather than a netlink attachment) is what makes process death safe: the kernel detaches
//!   the program when the last fd of the link is closed.
//! - `bpf_link_detach`: detaches explicitly, even if another fd of the link exists (for
//!   example inherited by a child process), so `detach()` is definitive.
//!
//! All three take plain integers and a pointer to an options struct that lives on our stack
//! for the duration of the call; libbpf keeps no reference to it.

#![allow(unsafe_code)]

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use libbpf_sys as sys;

/// What `bpf_xdp_query` reports for an interface (ids are 0 when absent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct XdpQuery {
    /// `XDP_ATTACHED_*`: 0 none, 1 driver, 2 generic (skb), 3 hardware, 4 several.
    pub attach_mode: u8,
    pub prog_id: u32,
    pub drv_prog_id: u32,
    pub skb_prog_id: u32,
    pub hw_prog_id: u32,
}

pub(crate) const XDP_ATTACHED_NONE: u8 = sys::XDP_ATTACHED_NONE as u8;
pub(crate) const XDP_ATTACHED_DRV: u8 = sys::XDP_ATTACHED_DRV as u8;
pub(crate) const XDP_ATTACHED_SKB: u8 = sys::XDP_ATTACHED_SKB as u8;
pub(crate) const XDP_ATTACHED_HW: u8 = sys::XDP_ATTACHED_HW as u8;
pub(crate) const XDP_FLAGS_SKB_MODE: u32 = sys::XDP_FLAGS_SKB_MODE;
pub(crate) const XDP_FLAGS_DRV_MODE: u32 = sys::XDP_FLAGS_DRV_MODE;

fn ifindex_arg(ifindex: u32) -> io::Result<i32> {
    i32::try_from(ifindex).map_err(|_| io::Error::from(nix::errno::Errno::ENODEV))
}

/// libbpf 1.x returns `-errno` on failure.
fn check(rc: i32) -> io::Result<i32> {
    if rc < 0 {
        Err(io::Error::from_raw_os_error(-rc))
    } else {
        Ok(rc)
    }
}

/// Which XDP program(s) the interface has, over netlink (needs no privilege). Runs in the
/// calling thread's network namespace.
pub(crate) fn xdp_query(ifindex: u32) -> io::Result<XdpQuery> {
    let ifindex = ifindex_arg(ifindex)?;
    let mut opts = sys::bpf_xdp_query_opts {
        sz: size_of::<sys::bpf_xdp_query_opts>() as sys::size_t,
        ..Default::default()
    };
    // SAFETY: `opts` is a valid, initialised bpf_xdp_query_opts whose `sz` is its own size,
    // exclusively borrowed for the duration of the call; libbpf only writes its fields.
    let rc = unsafe { sys::bpf_xdp_query(ifindex, 0, &mut opts) };
    check(rc)?;
    Ok(XdpQuery {
        attach_mode: opts.attach_mode,
        prog_id: opts.prog_id,
        drv_prog_id: opts.drv_prog_id,
        skb_prog_id: opts.skb_prog_id,
        hw_prog_id: opts.hw_prog_id,
    })
}

/// Attaches `prog` to `ifindex` as an XDP bpf_link with `flags` (`XDP_FLAGS_DRV_MODE` or
/// `XDP_FLAGS_SKB_MODE`). The kernel refuses (EBUSY) when any XDP program is attached in any
/// mode; a link is never a silent replacement. Closing the returned fd detaches.
pub(crate) fn xdp_link_create(
    prog: BorrowedFd<'_>,
    ifindex: u32,
    flags: u32,
) -> io::Result<OwnedFd> {
    let ifindex = ifindex_arg(ifindex)?;
    let opts = sys::bpf_link_create_opts {
        sz: size_of::<sys::bpf_link_create_opts>() as sys::size_t,
        flags,
        ..Default::default()
    };
    // SAFETY: `prog` is a live program fd borrowed for the call, `opts` is a valid,
    // zero-initialised bpf_link_create_opts with a correct `sz` that outlives the call.
    let fd =
        check(unsafe { sys::bpf_link_create(prog.as_raw_fd(), ifindex, sys::BPF_XDP, &opts) })?;
    // SAFETY: on success bpf_link_create returns a new file descriptor that nothing else owns;
    // OwnedFd takes sole ownership and closes it exactly once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Detaches the program of an XDP link (BPF_LINK_DETACH); the fd stays open but defunct.
pub(crate) fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: `link` is a live bpf_link fd borrowed for the call; no pointers are passed.
    check(unsafe { sys::bpf_link_detach(link.as_raw_fd()) }).map(|_| ())
}
