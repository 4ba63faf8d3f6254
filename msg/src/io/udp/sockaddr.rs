//! Socket addresses in the kernel's layout (`sockaddr_in` / `sockaddr_in6`), in safe code: the
//! `msg_name` of every `msghdr` that `sendmmsg` sends to and `recvmmsg` fills.
//!
//! Encoded and decoded byte by byte (the field offsets are checked against `libc` in the
//! tests), so the address slots need no `unsafe`; IPv4-mapped IPv6 sources come out as IPv4.

use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};

/// A socket address buffer in the kernel's layout (`sockaddr_in` or `sockaddr_in6`).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(super) struct RawAddr([u8; SIN6_LEN]);

const SIN_LEN: usize = std::mem::size_of::<libc::sockaddr_in>();
pub(super) const SIN6_LEN: usize = std::mem::size_of::<libc::sockaddr_in6>();
const AF_INET: [u8; 2] = (libc::AF_INET as libc::sa_family_t).to_ne_bytes();
const AF_INET6: [u8; 2] = (libc::AF_INET6 as libc::sa_family_t).to_ne_bytes();

impl RawAddr {
    pub(super) const ZERO: RawAddr = RawAddr([0; SIN6_LEN]);

    /// Writes `addr` (as std does: port big-endian, flow info and scope id as given); returns
    /// its `socklen_t`.
    pub(super) fn encode(&mut self, addr: &SocketAddr) -> libc::socklen_t {
        let b = &mut self.0;
        *b = [0; SIN6_LEN];
        b[2..4].copy_from_slice(&addr.port().to_be_bytes());
        match addr {
            SocketAddr::V4(a) => {
                b[..2].copy_from_slice(&AF_INET);
                b[4..8].copy_from_slice(&a.ip().octets());
                SIN_LEN as libc::socklen_t
            }
            SocketAddr::V6(a) => {
                b[..2].copy_from_slice(&AF_INET6);
                b[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
                b[8..24].copy_from_slice(&a.ip().octets());
                b[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
                SIN6_LEN as libc::socklen_t
            }
        }
    }

    /// Reads the address the kernel wrote (`len` bytes); IPv4-mapped IPv6 comes out as IPv4.
    pub(super) fn decode(&self, len: usize) -> Option<SocketAddr> {
        let b = &self.0;
        let port = u16::from_be_bytes([b[2], b[3]]);
        if b[..2] == AF_INET && len >= SIN_LEN {
            let ip = [b[4], b[5], b[6], b[7]];
            return Some(SocketAddr::V4(SocketAddrV4::new(ip.into(), port)));
        }
        if b[..2] == AF_INET6 && len >= SIN6_LEN {
            let ip: [u8; 16] = b[8..24].try_into().ok()?;
            let ip = std::net::Ipv6Addr::from(ip);
            if let Some(v4) = ip.to_ipv4_mapped() {
                return Some(SocketAddr::V4(SocketAddrV4::new(v4, port)));
            }
            let flow = u32::from_ne_bytes(b[4..8].try_into().ok()?);
            let scope = u32::from_ne_bytes(b[24..28].try_into().ok()?);
            return Some(SocketAddr::V6(SocketAddrV6::new(ip, port, flow, scope)));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn addresses_round_trip_in_kernel_layout() {
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in, sin_port), 2);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in, sin_addr), 4);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in6, sin6_flowinfo), 4);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in6, sin6_addr), 8);
        assert_eq!(std::mem::offset_of!(libc::sockaddr_in6, sin6_scope_id), 24);
        let mut raw = RawAddr::ZERO;
        let v4 = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 1), 0x1234));
        assert_eq!(raw.encode(&v4) as usize, SIN_LEN);
        assert_eq!(&raw.0[2..8], &[0x12, 0x34, 127, 0, 0, 1]);
        assert_eq!(raw.decode(SIN_LEN), Some(v4));
        assert_eq!(raw.decode(SIN_LEN - 1), None);
        let v6 = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::LOCALHOST, 4791, 5, 2));
        assert_eq!(raw.encode(&v6) as usize, SIN6_LEN);
        assert_eq!(raw.decode(SIN6_LEN), Some(v6));
        let mapped = SocketAddr::from((Ipv4Addr::new(10, 1, 2, 3).to_ipv6_mapped(), 9));
        raw.encode(&mapped);
        assert_eq!(
            raw.decode(SIN6_LEN),
            Some(SocketAddr::from((Ipv4Addr::new(10, 1, 2, 3), 9)))
        );
        assert_eq!(RawAddr::ZERO.decode(SIN6_LEN), None);
    }
}
