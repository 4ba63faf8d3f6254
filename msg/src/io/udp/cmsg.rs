//! Control messages in the kernel's layout, in safe code: the per-`msghdr` ancillary data
//! of `sendmmsg` (`UDP_SEGMENT`, `IP_TOS`/`IPV6_TCLASS`) and `recvmmsg` (`UDP_GRO`, `IP_TOS`,
//! `IPV6_TCLASS`, `SO_RXQ_OVFL`).
//!
//! Written and read byte by byte after `CMSG_ALIGN`/`CMSG_LEN`/`CMSG_SPACE` (checked against
//! `libc` in the tests), so neither encoding nor parsing needs `unsafe`, and no input to the
//! parser, however malformed, panics or reads out of bounds.

/// Control-message bytes per sent `msghdr`: `UDP_SEGMENT` (u16) and `IP_TOS`/`IPV6_TCLASS` (int).
pub(super) const SEND_CMSG_SPACE: usize = 64;
/// Control-message bytes per received `msghdr`: `UDP_GRO`, `IP_TOS`, `IPV6_TCLASS`,
/// `SO_RXQ_OVFL` (24 bytes each on 64-bit), with room to spare.
pub(super) const RECV_CMSG_SPACE: usize = 128;

/// `CMSG_ALIGN` unit: the kernel aligns control messages to `sizeof(long)`.
const CMSG_ALIGN_TO: usize = std::mem::size_of::<libc::c_long>();
const USIZE: usize = std::mem::size_of::<usize>();

const fn cmsg_align(n: usize) -> usize {
    (n + CMSG_ALIGN_TO - 1) & !(CMSG_ALIGN_TO - 1)
}

/// Bytes of the (aligned) `cmsghdr`: `size_t cmsg_len; int cmsg_level; int cmsg_type;`.
const CMSG_HDR: usize = cmsg_align(USIZE + 2 * std::mem::size_of::<libc::c_int>());

/// `CMSG_LEN(data)`.
const fn cmsg_len(data: usize) -> usize {
    CMSG_HDR + data
}

/// `CMSG_SPACE(data)`.
const fn cmsg_space(data: usize) -> usize {
    CMSG_HDR + cmsg_align(data)
}

/// A control-message buffer aligned like `cmsghdr`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(super) struct CmsgBuf<const N: usize>(pub(super) [u8; N]);

/// Appends control messages to a buffer.
pub(super) struct CmsgWriter<'a> {
    buf: &'a mut [u8],
    pub(super) len: usize,
}

impl<'a> CmsgWriter<'a> {
    pub(super) fn new(buf: &'a mut [u8]) -> Self {
        CmsgWriter { buf, len: 0 }
    }

    /// Appends one message; false (and nothing written) when it does not fit.
    pub(super) fn push(&mut self, level: libc::c_int, ty: libc::c_int, data: &[u8]) -> bool {
        let space = cmsg_space(data.len());
        let Some(out) = self.buf.get_mut(self.len..self.len + space) else {
            return false;
        };
        out.fill(0);
        out[..USIZE].copy_from_slice(&cmsg_len(data.len()).to_ne_bytes());
        out[USIZE..USIZE + 4].copy_from_slice(&level.to_ne_bytes());
        out[USIZE + 4..USIZE + 8].copy_from_slice(&ty.to_ne_bytes());
        out[CMSG_HDR..CMSG_HDR + data.len()].copy_from_slice(data);
        self.len += space;
        true
    }
}

/// What the receive control messages of one buffer said.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct RecvCmsgs {
    /// `UDP_GRO`: the segment size of a coalesced buffer.
    pub(super) stride: Option<usize>,
    /// `IP_TOS` or `IPV6_TCLASS`.
    pub(super) tos: Option<u8>,
    /// `SO_RXQ_OVFL`: the socket's drop counter.
    pub(super) drops: Option<u32>,
}

fn read_i32(b: &[u8]) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

pub(super) fn parse_cmsgs(buf: &[u8]) -> RecvCmsgs {
    let mut out = RecvCmsgs::default();
    let mut off = 0;
    while let Some(hdr) = buf.get(off..off + CMSG_HDR) {
        let Some(len) = hdr
            .get(..USIZE)
            .and_then(|b| b.try_into().ok())
            .map(usize::from_ne_bytes)
        else {
            break;
        };
        let (Some(level), Some(ty)) = (read_i32(&hdr[USIZE..]), read_i32(&hdr[USIZE + 4..])) else {
            break;
        };
        if len < CMSG_HDR {
            break;
        }
        let Some(data) = buf.get(off + CMSG_HDR..off + len) else {
            break;
        };
        match (level, ty) {
            (libc::SOL_UDP, libc::UDP_GRO) => {
                out.stride = read_i32(data).and_then(|s| usize::try_from(s).ok());
            }
            (libc::IPPROTO_IP, libc::IP_TOS) => out.tos = data.first().copied(),
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                out.tos = read_i32(data).map(|t| (t & 0xff) as u8);
            }
            (libc::SOL_SOCKET, libc::SO_RXQ_OVFL) => {
                out.drops = read_i32(data).map(|d| d as u32);
            }
            _ => {}
        }
        off += cmsg_align(len);
    }
    out
}

#[cfg(test)]
// `libc::CMSG_LEN`/`CMSG_SPACE`, the reference the layout is checked against, are `unsafe fn`s.
#[allow(unsafe_code)]
mod tests {
    use super::*;

    #[test]
    fn cmsg_layout_matches_libc() {
        for n in [1usize, 2, 4, 8, 13] {
            let len = u32::try_from(n).unwrap();
            // SAFETY: CMSG_LEN and CMSG_SPACE are arithmetic on their argument only.
            let (l, s) = unsafe { (libc::CMSG_LEN(len), libc::CMSG_SPACE(len)) };
            assert_eq!(cmsg_len(n), l as usize, "CMSG_LEN({n})");
            assert_eq!(cmsg_space(n), s as usize, "CMSG_SPACE({n})");
        }
        assert_eq!(CMSG_HDR, cmsg_align(std::mem::size_of::<libc::cmsghdr>()));
        assert_eq!(std::mem::offset_of!(libc::cmsghdr, cmsg_level), USIZE);
        assert_eq!(std::mem::offset_of!(libc::cmsghdr, cmsg_type), USIZE + 4);
        assert!(std::mem::align_of::<CmsgBuf<8>>() >= std::mem::align_of::<libc::cmsghdr>());
        // The send buffer holds both messages we may write.
        assert!(cmsg_space(2) + cmsg_space(4) <= SEND_CMSG_SPACE);
        assert!(4 * cmsg_space(4) <= RECV_CMSG_SPACE);
    }

    #[test]
    fn cmsgs_round_trip_and_bad_input_stops_parsing() {
        let mut buf = CmsgBuf([0u8; RECV_CMSG_SPACE]);
        let mut w = CmsgWriter::new(&mut buf.0);
        assert!(w.push(libc::SOL_UDP, libc::UDP_GRO, &1472i32.to_ne_bytes()));
        assert!(w.push(libc::IPPROTO_IP, libc::IP_TOS, &[0xb9]));
        assert!(w.push(libc::SOL_SOCKET, libc::SO_RXQ_OVFL, &7u32.to_ne_bytes()));
        let n = w.len;
        let c = parse_cmsgs(&buf.0[..n]);
        assert_eq!(
            c,
            RecvCmsgs {
                stride: Some(1472),
                tos: Some(0xb9),
                drops: Some(7)
            }
        );
        // Too small to hold another message: refused, nothing written.
        let mut small = [0u8; 20];
        let mut w = CmsgWriter::new(&mut small);
        assert!(!w.push(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &1i32.to_ne_bytes()));
        assert_eq!(w.len, 0);
        // A length running past the buffer, a zero length, or garbage: no panic, stops.
        let mut bad = buf.0;
        bad[..USIZE].copy_from_slice(&usize::MAX.to_ne_bytes());
        assert_eq!(parse_cmsgs(&bad[..n]), RecvCmsgs::default());
        bad[..USIZE].copy_from_slice(&0usize.to_ne_bytes());
        assert_eq!(parse_cmsgs(&bad[..n]), RecvCmsgs::default());
        for len in 0..n {
            let _ = parse_cmsgs(&buf.0[..len]);
        }
    }
}
