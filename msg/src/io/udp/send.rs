//! The send path of [`UdpIo`]: [`UdpIo::send`] cuts each [`Transmit`] bundle into `msghdr`s
//! (a whole GSO bundle, or runs of its segments when it is larger than one IP packet or GSO
//! is off), each with its destination and control messages, and hands them to `sendmmsg` 64
//! at a time; a device that refuses GSO at send time turns it off for good here.
//!
//! What the kernel is given is built here in safe code; the system call itself is
//! `TxState::sendmmsg` (`mmsg.rs`).

use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd;

use nix::errno::Errno;

use super::cmsg::CmsgWriter;
use super::mmsg::{IovWalk, Piece, PieceIov};
use super::{IoError, Transmit, UdpIo, MAX_IOV, MAX_SEND_MSGS, UDP_MAX_SEGMENTS};

impl UdpIo {
    /// The destination as this socket's family wants it, and whether it is reached over IPv4
    /// (so its TOS goes in an `IP_TOS` control message).
    fn map_dst(&self, dst: SocketAddr) -> Result<(SocketAddr, bool), &'static str> {
        match (self.v6, dst) {
            (false, SocketAddr::V4(_)) => Ok((dst, true)),
            (false, SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
                Some(ip) => Ok((SocketAddr::V4(SocketAddrV4::new(ip, a.port())), true)),
                None => Err(
                    "IPv6 destination on an IPv4 socket: bind an IPv6 address (e.g. [::]) \
                     to reach IPv6 peers",
                ),
            },
            (true, SocketAddr::V4(a)) => {
                let ip = a.ip().to_ipv6_mapped();
                Ok((SocketAddr::V6(SocketAddrV6::new(ip, a.port(), 0, 0)), true))
            }
            (true, SocketAddr::V6(a)) => Ok((dst, a.ip().to_ipv4_mapped().is_some())),
        }
    }

    /// Fills `tx.pieces` (and their addresses, control messages and scratch iovecs) for one
    /// `sendmmsg`, from bundle `b` at byte `off` on. Err: bundle `b` itself is invalid.
    fn build(
        &mut self,
        batch: &[Transmit<'_>],
        mut b: usize,
        mut off: usize,
    ) -> Result<(), (SocketAddr, &'static str)> {
        self.tx.pieces.clear();
        self.tx.raw.iovs.clear();
        let max_payload = self.max_bundle_bytes();
        while let Some(t) = batch.get(b) {
            if self.tx.pieces.len() == MAX_SEND_MSGS {
                break;
            }
            let total = t.iov.iter().fold(0usize, |a, s| a.saturating_add(s.len()));
            let checked = if total > 0 && t.segment_size == 0 {
                Err("segment_size is 0 in a non-empty bundle: give the datagram size")
            } else if t.iov.len() > MAX_IOV {
                Err("more than 1024 slices in one bundle (the kernel's UIO_MAXIOV): gather fewer, larger slices")
            } else {
                self.map_dst(t.dst)
            };
            let (dst, via_v4) = match checked {
                Ok(d) => d,
                Err(reason) if self.tx.pieces.is_empty() => return Err((t.dst, reason)),
                // Send what is built; this bundle comes first next call and fails then.
                Err(_) => break,
            };
            let seg = t.segment_size.min(total);
            let per_piece = if self.gso && seg > 0 && seg <= usize::from(u16::MAX) {
                (max_payload / seg).clamp(1, UDP_MAX_SEGMENTS)
            } else {
                1
            };
            let mut walk = IovWalk::seek(t.iov, off);
            while self.tx.pieces.len() < MAX_SEND_MSGS {
                let bytes = per_piece.saturating_mul(seg).min(total - off);
                let end = off + bytes;
                let segs = if bytes == 0 { 1 } else { bytes.div_ceil(seg) };
                let iov = if off == 0 && end == total {
                    PieceIov::Whole
                } else {
                    let start = self.tx.raw.iovs.len();
                    walk.take(t.iov, bytes, &mut self.tx.raw.iovs);
                    PieceIov::Scratch {
                        start,
                        len: self.tx.raw.iovs.len() - start,
                    }
                };
                let i = self.tx.pieces.len();
                let namelen = self.tx.names[i].encode(&dst);
                let mut w = CmsgWriter::new(&mut self.tx.cmsgs[i].0);
                if segs > 1 {
                    let size = u16::try_from(seg).unwrap_or(u16::MAX);
                    w.push(libc::SOL_UDP, libc::UDP_SEGMENT, &size.to_ne_bytes());
                }
                if t.tos != 0 {
                    let tos = libc::c_int::from(t.tos).to_ne_bytes();
                    if via_v4 {
                        w.push(libc::IPPROTO_IP, libc::IP_TOS, &tos);
                    } else {
                        w.push(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &tos);
                    }
                }
                let controllen = w.len;
                self.tx.pieces.push(Piece {
                    bundle: b,
                    segs,
                    bytes,
                    end,
                    last: end == total,
                    iov,
                    namelen,
                    controllen,
                });
                off = end;
                if end == total {
                    break;
                }
            }
            if off == total {
                b += 1;
                off = 0;
            } else {
                break; // out of msghdrs mid-bundle
            }
        }
        Ok(())
    }

    /// One `sendmmsg` of the built pieces: how many the kernel took.
    fn sendmmsg(&mut self, batch: &[Transmit<'_>]) -> Result<usize, Errno> {
        #[cfg(test)]
        if self.fail_gso_once && self.tx.pieces.first().is_some_and(|p| p.segs > 1) {
            self.fail_gso_once = false;
            self.stats.send_syscalls += 1;
            return Err(Errno::EIO);
        }
        self.stats.send_syscalls += 1;
        self.tx.sendmmsg(self.sock.as_fd(), batch)
    }

    /// Sends bundles with as few system calls as possible (`sendmmsg`, up to 64 `msghdr`s per
    /// call, one per GSO bundle).
    ///
    /// Returns how many bundles (from the front of `batch`) the kernel took. Fewer than
    /// `batch.len()` when the socket would block (`EAGAIN`), or when a later bundle
    /// fails: that bundle is then first in the next call, which reports its error. `Err` means
    /// the first bundle of `batch` was refused. A bundle sent as several `msghdr`s (without
    /// GSO, or above [`UdpIo::max_bundle_bytes`]) that the socket cuts short counts as not
    /// sent: sending it again repeats its first datagrams (the message layer drops
    /// duplicates).
    pub fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, IoError> {
        let (mut bundle, mut off) = (0usize, 0usize);
        while bundle < batch.len() {
            if let Err((dst, reason)) = self.build(batch, bundle, off) {
                return if bundle > 0 {
                    Ok(bundle)
                } else {
                    Err(IoError::Transmit {
                        local: self.local,
                        dst,
                        reason,
                    })
                };
            }
            match self.sendmmsg(batch) {
                Ok(0) => {
                    self.stats.send_would_block += 1;
                    return Ok(bundle);
                }
                Ok(n) => {
                    for p in self.tx.pieces.iter().take(n) {
                        self.stats.send_datagrams += p.segs as u64;
                        self.stats.send_bytes += p.bytes as u64;
                        if p.last {
                            self.stats.send_bundles += 1;
                            (bundle, off) = (p.bundle + 1, 0);
                        } else {
                            (bundle, off) = (p.bundle, p.end);
                        }
                    }
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    self.stats.send_would_block += 1;
                    return Ok(bundle);
                }
                // With IP_RECVERR the kernel reports a datagram its device queue dropped as
                // ENOBUFS (without it the drop is silent): the first piece is gone, not
                // waiting. Go on past it, as a loss on the wire.
                Err(Errno::ENOBUFS) if self.recverr => {
                    if let Some(p) = self.tx.pieces.first() {
                        self.stats.send_local_drops += p.segs as u64;
                        if p.last {
                            (bundle, off) = (p.bundle + 1, 0);
                        } else {
                            (bundle, off) = (p.bundle, p.end);
                        }
                    } else {
                        return Ok(bundle);
                    }
                }
                Err(Errno::ENOBUFS) => {
                    self.stats.send_would_block += 1;
                    return Ok(bundle);
                }
                // A pending ICMP error for an earlier datagram is reported by the next call,
                // which then sends nothing: read the error queue and send again.
                Err(
                    Errno::ECONNREFUSED
                    | Errno::EHOSTUNREACH
                    | Errno::ENETUNREACH
                    | Errno::EHOSTDOWN,
                ) if self.recverr => {
                    self.drain_errors();
                }
                Err(Errno::EIO)
                    if self.gso && self.tx.pieces.first().is_some_and(|p| p.segs > 1) =>
                {
                    // Some devices take UDP_SEGMENT at setsockopt and refuse it here: resend
                    // this bundle (from the same offset) datagram by datagram, for good.
                    self.gso = false;
                    self.stats.gso_fallbacks += 1;
                    let dst = batch.get(bundle).map_or(self.local, |t| t.dst);
                    log::warn!(
                        "UDP {}: the kernel refused a segmentation-offload send to {dst} (EIO): \
                         GSO is off for this socket, sending datagram by datagram",
                        self.local
                    );
                }
                Err(e) => {
                    if bundle > 0 {
                        return Ok(bundle);
                    }
                    let dst = batch.get(bundle).map_or(self.local, |t| t.dst);
                    return Err(IoError::Send {
                        local: self.local,
                        dst,
                        source: e.into(),
                    });
                }
            }
        }
        Ok(bundle)
    }
}

#[cfg(test)]
mod tests {
    use super::super::UdpConfig;
    use super::*;
    use std::io::IoSlice;
    use std::net::Ipv4Addr;
    use std::time::{Duration, Instant};

    /// A GSO send the device refuses with EIO: GSO goes off, the bundle is resent datagram
    /// by datagram, byte for byte, in the same `send`.
    #[test]
    fn eio_on_gso_send_falls_back_to_datagrams() {
        let cfg = UdpConfig::default();
        let lo = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let mut tx = UdpIo::bind(lo, &cfg).unwrap();
        let mut rx = UdpIo::bind(lo, &cfg).unwrap();
        assert!(tx.gso_enabled(), "this test needs a kernel with UDP GSO");
        let seg = 1000;
        let data: Vec<u8> = (0..seg * 5 + 17).map(|i| (i * 7 % 251) as u8).collect();
        let iov = [IoSlice::new(&data[..3000]), IoSlice::new(&data[3000..])];
        tx.fail_gso_once = true;
        let t = Transmit {
            dst: rx.local_addr(),
            tos: 0,
            segment_size: seg,
            iov: &iov,
        };
        assert_eq!(tx.send(&[t]).unwrap(), 1);
        assert!(!tx.gso_enabled());
        assert_eq!(tx.max_segments(), 1);
        let s = tx.stats();
        assert_eq!(s.gso_fallbacks, 1);
        assert_eq!(
            s.send_syscalls, 2,
            "the refused call, then one sendmmsg of 6 datagrams"
        );
        assert_eq!((s.send_bundles, s.send_datagrams), (1, 6));
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < 6 && Instant::now() < deadline {
            rx.wait(Some(Duration::from_millis(100)), false).unwrap();
            rx.recv(&mut |_, d| got.push(d.to_vec())).unwrap();
        }
        let want: Vec<Vec<u8>> = data.chunks(seg).map(<[u8]>::to_vec).collect();
        assert_eq!(got, want);
    }
}
