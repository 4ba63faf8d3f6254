//! The receive path of [`UdpIo`]: [`UdpIo::recv`] makes one `recvmmsg` (`RxState::recvmmsg`,
//! `mmsg.rs`) and hands every datagram to the caller, each GRO buffer split at its stride,
//! with the source and TOS byte its control messages gave; it counts truncated buffers and
//! the kernel's drops, and reads the error queue when the call reports an ICMP error.

use std::os::fd::AsFd;

use nix::errno::Errno;

use super::cmsg::{parse_cmsgs, RECV_CMSG_SPACE};
use super::{IoError, RecvMeta, UdpIo};

impl UdpIo {
    /// Receives what is queued, without blocking: one `recvmmsg` (`MSG_DONTWAIT`) into the
    /// internal buffers, then `f` once per received *datagram* (a GRO buffer is split at its
    /// stride here, so `f` always sees single datagrams, in arrival order) with its metadata.
    /// Returns the number of datagrams: 0 when nothing is queued. Call again while it returns
    /// datagrams; one call moves at most `recv_batch` buffers.
    pub fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, IoError> {
        let received = loop {
            self.stats.recv_syscalls += 1;
            match self.rx.recvmmsg(self.sock.as_fd()) {
                Ok(n) => break n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => {
                    self.stats.recv_empty += 1;
                    return Ok(0);
                }
                // An ICMP error for one of our datagrams, reported once (before any queued
                // data) on the next call: read the error queue (which destination) and carry
                // on receiving. Returning here would leave a closing peer's last datagrams
                // queued while the endpoint fails it for the error.
                Err(
                    Errno::ECONNREFUSED
                    | Errno::EHOSTUNREACH
                    | Errno::ENETUNREACH
                    | Errno::EHOSTDOWN,
                ) if self.recverr => {
                    self.drain_errors();
                    continue;
                }
                Err(e) => {
                    return Err(IoError::Recv {
                        local: self.local,
                        source: e.into(),
                    })
                }
            }
        };

        let rx = &mut self.rx;
        let buf_len = rx.buf_len;

        let stats = &mut self.stats;
        stats.recv_buffers += received as u64;
        let mut datagrams = 0usize;
        for i in 0..received {
            let h = &rx.raw.hdrs[i];
            let len = (h.msg_len as usize).min(buf_len);
            let truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            // `size_t` with glibc, `socklen_t` with musl.
            #[allow(clippy::unnecessary_cast)]
            let controllen = (h.msg_hdr.msg_controllen as usize).min(RECV_CMSG_SPACE);
            let c = parse_cmsgs(&rx.cmsgs[i].0[..controllen]);
            if let Some(d) = c.drops {
                let delta = d.wrapping_sub(rx.drops_seen);
                if delta < 1 << 31 {
                    stats.recv_kernel_drops += u64::from(delta);
                    rx.drops_seen = d;
                }
            }
            let Some(src) = rx.names[i].decode(h.msg_hdr.msg_namelen as usize) else {
                stats.recv_malformed += 1;
                continue;
            };
            let meta = RecvMeta {
                src,
                tos: c.tos.unwrap_or(0),
            };
            let data = &rx.buf[i * buf_len..i * buf_len + len];
            if truncated {
                stats.recv_truncated += 1;
            }
            let stride = match c.stride {
                Some(s) if s > 0 => s,
                // One datagram; a truncated one is dropped.
                _ if truncated => continue,
                _ => len,
            };
            if len == 0 {
                f(meta, data);
                datagrams += 1;
                continue;
            }
            // A truncated GRO buffer: only its whole segments are datagrams.
            let whole = if truncated { len - len % stride } else { len };
            for d in data[..whole].chunks(stride) {
                f(meta, d);
                datagrams += 1;
                stats.recv_bytes += d.len() as u64;
            }
        }
        stats.recv_datagrams += datagrams as u64;
        Ok(datagrams)
    }
}
