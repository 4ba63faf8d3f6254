//! The socket's error queue: ICMP errors for datagrams it sent (`IP_RECVERR` /
//! `IPV6_RECVERR`, turned on at bind), read with `MSG_ERRQUEUE`. A port-unreachable error
//! names a destination whose socket closed (the peer's process exited), which
//! [`UdpIo::take_unreachable`] hands to the endpoint so it fails that peer's messages at once
//! instead of by timeout. `send` and `recv` read the queue too when the kernel reports a
//! pending ICMP error on them.

use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;

use nix::errno::Errno;

use super::UdpIo;

impl UdpIo {
    /// Destinations the kernel reported unreachable since the last call (ICMP port
    /// unreachable: nothing listens there any more, e.g. the peer's process exited).
    pub fn take_unreachable(&mut self) -> Vec<SocketAddr> {
        if self.recverr {
            self.drain_errors();
        }
        std::mem::take(&mut self.unreachable)
    }

    /// Reads the socket's error queue (at most 64 entries per call): each entry is one ICMP
    /// error with the original destination as its address.
    pub(super) fn drain_errors(&mut self) {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrStorage};
        let mut payload = [0u8; 64];
        // Room for the extended error and its offender address, and for the TOS/TCLASS and
        // other control messages the socket asks for on every message (an IPv6 socket gets
        // several): a truncated control area would hide the error.
        // Aligned like `struct cmsghdr`, which the kernel writes and nix reads in place.
        #[repr(align(8))]
        struct Control([u8; 512]);
        let mut cmsg = Control([0u8; 512]);
        for _ in 0..64 {
            let mut iov = [std::io::IoSliceMut::new(&mut payload)];
            let msg = match recvmsg::<SockaddrStorage>(
                self.sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg.0),
                MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(m) => m,
                Err(Errno::EINTR) => continue,
                Err(_) => return, // EAGAIN: the queue is empty
            };
            let dst = msg.address.and_then(|a| {
                a.as_sockaddr_in()
                    .map(|v4| SocketAddr::V4(SocketAddrV4::from(*v4)))
                    .or_else(|| {
                        a.as_sockaddr_in6()
                            .map(|v6| SocketAddr::V6(SocketAddrV6::from(*v6)))
                    })
            });
            let refused = msg.cmsgs().into_iter().flatten().any(|c| match c {
                ControlMessageOwned::Ipv4RecvErr(e, _) | ControlMessageOwned::Ipv6RecvErr(e, _) => {
                    e.ee_errno == libc::ECONNREFUSED as u32
                }
                _ => false,
            });
            self.stats.icmp_errors += 1;
            if let (Some(dst), true) = (dst, refused) {
                if !self.unreachable.contains(&dst) {
                    self.unreachable.push(dst);
                }
            }
        }
    }
}
