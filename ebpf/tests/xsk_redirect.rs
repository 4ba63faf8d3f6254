//! The redirect path, with a real AF_XDP socket registered in the XSKMAP.
//!
//! BPF_PROG_TEST_RUN does not perform the redirect, but the verdict shows the helper found
//! the socket: observed on kernel 6.18, a good gradwire frame on queue 0 returns
//! `XDP_REDIRECT` (counted as `redirected`) while a socket is registered for queue 0, and the
//! `XDP_PASS` fallback (`to_kernel`) when it is not. Needs root (skips otherwise, or fails
//! with `GRADWIRE_REQUIRE_PRIV=1`).

mod common;

use std::net::IpAddr;
use std::os::fd::AsFd;

use common::*;
use gradwire_ebpf::{XdpConfig, XDP_DROP, XDP_PASS, XDP_REDIRECT};

/// The smallest AF_XDP socket the XSKMAP accepts: UMEM, fill, completion and RX rings set,
/// not bound and no ring mapped (the test run never delivers to it). Test-only `unsafe`:
/// the library itself has none outside its `sys` module.
#[allow(unsafe_code)]
mod xsk {
    use std::io;
    use std::mem::size_of;
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

    const FRAMES: usize = 16;
    const FRAME_SIZE: usize = 4096;

    #[derive(Debug)]
    pub struct MinimalXsk {
        fd: Option<OwnedFd>,
        umem: *mut libc::c_void,
        len: usize,
    }

    fn setsockopt<T>(fd: &OwnedFd, opt: libc::c_int, val: &T) -> io::Result<()> {
        // SAFETY: `val` points to a live, initialised T of exactly the length passed, and
        // `fd` is an open socket; the kernel copies the value.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_XDP,
                opt,
                (val as *const T).cast(),
                size_of::<T>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    impl MinimalXsk {
        pub fn new() -> io::Result<MinimalXsk> {
            let len = FRAMES * FRAME_SIZE;
            // SAFETY: anonymous private mapping with no address hint; checked below.
            let umem = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if umem == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let mut x = MinimalXsk {
                fd: None,
                umem,
                len,
            };
            // SAFETY: plain socket(2) call; the result is checked before use.
            let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `raw` is a fresh descriptor owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let reg = libc::xdp_umem_reg {
                addr: umem as u64,
                len: len as u64,
                chunk_size: FRAME_SIZE as u32,
                headroom: 0,
                flags: 0,
                tx_metadata_len: 0,
            };
            setsockopt(&fd, libc::XDP_UMEM_REG, &reg)?;
            let ring = FRAMES as u32;
            setsockopt(&fd, libc::XDP_UMEM_FILL_RING, &ring)?;
            setsockopt(&fd, libc::XDP_UMEM_COMPLETION_RING, &ring)?;
            setsockopt(&fd, libc::XDP_RX_RING, &ring)?;
            x.fd = Some(fd);
            Ok(x)
        }
    }

    impl AsFd for MinimalXsk {
        fn as_fd(&self) -> BorrowedFd<'_> {
            self.fd.as_ref().expect("socket is set up in new()").as_fd()
        }
    }

    impl Drop for MinimalXsk {
        fn drop(&mut self) {
            // Socket first (it releases the UMEM), then the memory.
            drop(self.fd.take());
            // SAFETY: `umem`/`len` are exactly the mapping created in new(), unmapped once.
            unsafe {
                libc::munmap(self.umem, self.len);
            }
        }
    }
}

#[test]
fn registered_socket_gets_redirect_verdict() {
    if !require_root("registered_socket_gets_redirect_verdict") {
        return;
    }
    let mut c = XdpConfig::new(vec![PORT]);
    c.allowlist = Some(vec![IpAddr::V4(SRC4), IpAddr::V6(SRC6)]);
    let p = load(&c);
    let sock = xsk::MinimalXsk::new().expect("AF_XDP socket");
    let tos = 34 << 2 | 3;
    let good4 = Frame::v4().dscp_ecn(34, 3).build();
    let good6 = Frame::v6().vlan(ETH_P_8021Q).dscp_ecn(34, 3).build();

    // No socket yet: the fallback.
    assert_eq!(
        run(&p, &good4),
        (XDP_PASS, expect_to_kernel(tos, good4.len()))
    );

    // A socket on another queue does not catch queue 0's traffic.
    p.register_xsk(1, sock.as_fd()).expect("register queue 1");
    assert_eq!(
        run(&p, &good4),
        (XDP_PASS, expect_to_kernel(tos, good4.len()))
    );
    p.unregister_xsk(1).unwrap();

    p.register_xsk(0, sock.as_fd()).expect("register queue 0");
    assert_eq!(
        run(&p, &good4),
        (XDP_REDIRECT, expect_redirected(tos, good4.len()))
    );
    assert_eq!(
        run(&p, &good6),
        (XDP_REDIRECT, expect_redirected(tos, good6.len()))
    );
    // Everything else keeps its verdict with a socket registered.
    let other = Frame::v4().port(OTHER_PORT).build();
    assert_eq!(run(&p, &other), (XDP_PASS, expect_passed(other.len())));
    let short = Frame::v4().body(10).build();
    assert_eq!(run(&p, &short), (XDP_DROP, expect_truncated(short.len())));
    let foreign = Frame::v4().src4(FOREIGN4).build();
    assert_eq!(
        run(&p, &foreign),
        (XDP_DROP, expect_not_allowed(0, foreign.len()))
    );
    p.set_fault_drop(34, 1.0).unwrap();
    assert_eq!(run(&p, &good4), (XDP_DROP, expect_fault(tos, good4.len())));
    p.set_fault_drop(34, 0.0).unwrap();

    p.unregister_xsk(0).unwrap();
    assert_eq!(
        run(&p, &good4),
        (XDP_PASS, expect_to_kernel(tos, good4.len()))
    );
}
