//! Kernel UDP datapath: `sendmmsg`/`recvmmsg` on one non-blocking socket.
//!
//! This is the portable path (any host, any NIC) and the baseline the AF_XDP path must beat.
//! DSCP/ECN travel per message as an `IP_TOS` (`IPV6_TCLASS`) control message; because `nix`
//! applies one control message list to a whole `sendmmsg` call, a batch is sorted by TOS and
//! sent as one call per TOS value. Reordering inside a batch is free: gradwire places every
//! packet by offset (DLCP §3.2.3). The receive side asks for `IP_RECVTOS` so CE marks are
//! visible to the rate report.
//!
//! Waiting is wake-on-demand: `ppoll` on the socket with the caller's timeout.

use std::io::{IoSlice, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::socket::{
    recvmmsg, sendmmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags,
    MultiHeaders, SockaddrStorage,
};
use nix::sys::time::TimeSpec;

use super::{Datapath, DatapathError, DatapathStats, Deliver, Fill, RxMeta, TxMeta};

/// Configuration of a UDP datapath.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// Datagrams per `sendmmsg`/`recvmmsg` call.
    pub batch: usize,
    /// Largest datagram sent or accepted (gradwire header + payload).
    pub max_datagram: usize,
    /// Requested socket receive buffer (`SO_RCVBUFFORCE` when permitted, else `SO_RCVBUF`).
    pub rcvbuf: usize,
    /// Requested socket send buffer.
    pub sndbuf: usize,
    /// How long a send waits for socket buffer room before dropping the rest of a batch.
    pub send_wait: Duration,
    /// Per-packet spraying (DLCP §3.2.3): send from this many source ports, the bound port
    /// and the next `spray_ports - 1`, rotating per packet, so that switches hashing flows
    /// for ECMP spread one transfer over their paths. 1 = one source port. The receiver needs
    /// nothing: segments are placed by offset, whatever their order or source port.
    pub spray_ports: u16,
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            batch: 64,
            max_datagram: 1500 - 28,
            rcvbuf: 32 << 20,
            sndbuf: 8 << 20,
            send_wait: Duration::from_millis(20),
            spray_ports: 1,
        }
    }
}

/// Why a UDP datapath could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum UdpSetupError {
    /// bind failed.
    #[error("cannot bind UDP socket to {addr}: {source}")]
    Bind {
        /// Address asked for.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// A socket option could not be set.
    #[error("cannot set {option} on UDP socket {addr}: {source}")]
    Option {
        /// Option name.
        option: &'static str,
        /// Local address.
        addr: SocketAddr,
        /// OS error.
        source: Errno,
    },
    /// Bad configuration.
    #[error("invalid UDP datapath configuration: {0}")]
    Config(&'static str),
}

/// A kernel UDP socket datapath.
#[derive(Debug)]
pub struct UdpDatapath {
    sock: UdpSocket,
    /// Send-only sockets on the next `spray_ports - 1` ports.
    spray: Vec<UdpSocket>,
    /// Rotation position over `sock` + `spray`.
    spray_next: usize,
    local: SocketAddr,
    cfg: UdpConfig,
    tx_bufs: Vec<Vec<u8>>,
    tx_meta: Vec<(usize, TxMeta)>,
    order: Vec<usize>,
    rx_bufs: Vec<Vec<u8>>,
    rx_info: Vec<(usize, SocketAddr, u8)>,
    stats: DatapathStats,
    /// Datagrams received truncated or from an unparsable address, skipped.
    pub rx_malformed: u64,
}

fn io(op: &'static str, e: Errno) -> DatapathError {
    DatapathError::Io {
        op,
        source: std::io::Error::from(e),
    }
}

fn to_std(s: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    s.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}

impl UdpDatapath {
    /// Bind a UDP socket at `addr` (port 0 picks one).
    pub fn bind(addr: SocketAddr, cfg: UdpConfig) -> Result<UdpDatapath, UdpSetupError> {
        if cfg.batch == 0 {
            return Err(UdpSetupError::Config("batch must be at least 1"));
        }
        if !(40..=65_507).contains(&cfg.max_datagram) {
            return Err(UdpSetupError::Config(
                "max_datagram must be within 40..=65507",
            ));
        }
        let sock = UdpSocket::bind(addr).map_err(|source| UdpSetupError::Bind { addr, source })?;
        let local = sock
            .local_addr()
            .map_err(|source| UdpSetupError::Bind { addr, source })?;
        sock.set_nonblocking(true)
            .map_err(|source| UdpSetupError::Bind { addr, source })?;
        let opt = |option, r: nix::Result<()>| {
            r.map_err(|source| UdpSetupError::Option {
                option,
                addr: local,
                source,
            })
        };
        // Forcing the size needs CAP_NET_ADMIN; without it the kernel caps at rmem_max.
        if setsockopt(&sock, sockopt::RcvBufForce, &cfg.rcvbuf).is_err() {
            opt("SO_RCVBUF", setsockopt(&sock, sockopt::RcvBuf, &cfg.rcvbuf))?;
        }
        if setsockopt(&sock, sockopt::SndBufForce, &cfg.sndbuf).is_err() {
            opt("SO_SNDBUF", setsockopt(&sock, sockopt::SndBuf, &cfg.sndbuf))?;
        }
        if local.is_ipv4() {
            opt("IP_RECVTOS", setsockopt(&sock, sockopt::IpRecvTos, &true))?;
        } else {
            opt(
                "IPV6_RECVTCLASS",
                setsockopt(&sock, sockopt::Ipv6RecvTClass, &true),
            )?;
        }
        if cfg.spray_ports == 0 {
            return Err(UdpSetupError::Config("spray_ports must be at least 1"));
        }
        let mut spray = Vec::new();
        if cfg.spray_ports > 1 {
            if addr.port() == 0 || u32::from(local.port()) + u32::from(cfg.spray_ports) > 65_536 {
                return Err(UdpSetupError::Config(
                    "spraying needs an explicit port with spray_ports - 1 free ports after it",
                ));
            }
            for k in 1..cfg.spray_ports {
                let a = SocketAddr::new(local.ip(), local.port() + k);
                let s =
                    UdpSocket::bind(a).map_err(|source| UdpSetupError::Bind { addr: a, source })?;
                s.set_nonblocking(true)
                    .map_err(|source| UdpSetupError::Bind { addr: a, source })?;
                if setsockopt(&s, sockopt::SndBufForce, &cfg.sndbuf).is_err() {
                    opt("SO_SNDBUF", setsockopt(&s, sockopt::SndBuf, &cfg.sndbuf))?;
                }
                spray.push(s);
            }
        }
        let buf = vec![0u8; cfg.max_datagram];
        Ok(UdpDatapath {
            sock,
            spray,
            spray_next: 0,
            local,
            tx_bufs: vec![buf.clone(); cfg.batch],
            rx_bufs: vec![buf; cfg.batch],
            tx_meta: Vec::with_capacity(cfg.batch),
            order: Vec::with_capacity(cfg.batch),
            rx_info: Vec::with_capacity(cfg.batch),
            cfg,
            stats: DatapathStats::default(),
            rx_malformed: 0,
        })
    }

    /// Wait until the socket is ready for `flags` or `timeout` passes.
    fn wait(&self, flags: PollFlags, timeout: Duration) -> Result<bool, DatapathError> {
        let mut fds = [PollFd::new(self.sock.as_fd(), flags)];
        match ppoll(&mut fds, Some(TimeSpec::from_duration(timeout)), None) {
            Ok(n) => Ok(n > 0),
            Err(Errno::EINTR) => Ok(false),
            Err(e) => Err(io("ppoll", e)),
        }
    }

    /// Send the filled slots `idx`, all with the same TOS.
    fn send_run(&mut self, idx: &[usize], tos: u8, sock: usize) -> Result<(), DatapathError> {
        let fd = match sock.checked_sub(1).and_then(|k| self.spray.get(k)) {
            Some(s) => s.as_raw_fd(),
            None => self.sock.as_raw_fd(),
        };
        let tclass = i32::from(tos);
        let cmsg = if self.local.is_ipv4() {
            [ControlMessage::Ipv4Tos(&tos)]
        } else {
            [ControlMessage::Ipv6TClass(&tclass)]
        };
        let mut done = 0;
        while done < idx.len() {
            let rest = &idx[done..];
            let addrs: Vec<Option<SockaddrStorage>> = rest
                .iter()
                .map(|&i| Some(SockaddrStorage::from(self.tx_meta[i].1.dst)))
                .collect();
            let iovs: Vec<[IoSlice<'_>; 1]> = rest
                .iter()
                .map(|&i| [IoSlice::new(&self.tx_bufs[i][..self.tx_meta[i].0])])
                .collect();
            let mut hdrs = MultiHeaders::<SockaddrStorage>::preallocate(
                rest.len(),
                Some(nix::cmsg_space!(libc::c_int)),
            );
            match sendmmsg(fd, &mut hdrs, &iovs, &addrs, cmsg, MsgFlags::MSG_DONTWAIT) {
                Ok(res) => {
                    let sent = res.count();
                    for &i in &rest[..sent] {
                        self.stats.tx_packets += 1;
                        self.stats.tx_bytes += self.tx_meta[i].0 as u64;
                    }
                    done += sent;
                }
                Err(Errno::EAGAIN) => {
                    if !self.wait(PollFlags::POLLOUT, self.cfg.send_wait)? {
                        // The socket stayed full: the data channel is unreliable by design,
                        // the loss is counted and the protocol recovers it if the bound needs it.
                        self.stats.tx_dropped += rest.len() as u64;
                        return Ok(());
                    }
                }
                // A refused or unroutable datagram is lost like any other; keep going.
                Err(
                    Errno::ENOBUFS | Errno::ECONNREFUSED | Errno::EHOSTUNREACH | Errno::ENETUNREACH,
                ) => {
                    self.stats.tx_dropped += 1;
                    done += 1;
                }
                Err(e) => return Err(io("sendmmsg", e)),
            }
        }
        Ok(())
    }
}

impl Datapath for UdpDatapath {
    fn name(&self) -> &'static str {
        "udp"
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The bound address and port, and the spray ports after it.
    fn data_sources(&self) -> Vec<super::DataSource> {
        vec![super::DataSource {
            addr: self.local.ip(),
            port: self.local.port(),
            // At most 65535 sockets: spray_ports is a u16 and the bound one is among them.
            ports: u16::try_from(1 + self.spray.len()).unwrap_or(u16::MAX),
        }]
    }

    fn max_datagram(&self) -> usize {
        self.cfg.max_datagram
    }

    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        let limit = max.min(self.cfg.batch);
        self.tx_meta.clear();
        while self.tx_meta.len() < limit {
            let buf = &mut self.tx_bufs[self.tx_meta.len()];
            match fill(buf) {
                Some((len, meta)) => self.tx_meta.push((len.min(buf.len()), meta)),
                None => break,
            }
        }
        let n = self.tx_meta.len();
        // Packet i goes out of socket (spray_next + i) mod K; one sendmmsg per (TOS, socket).
        let k = 1 + self.spray.len();
        let first = self.spray_next;
        let sock_of = |i: usize| (first + i) % k;
        self.spray_next = (first + n) % k;
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(0..n);
        order.sort_by_key(|&i| (self.tx_meta[i].1.tos, sock_of(i)));
        let mut start = 0;
        let mut result = Ok(());
        while start < n && result.is_ok() {
            let key = (self.tx_meta[order[start]].1.tos, sock_of(order[start]));
            let end = order[start..]
                .iter()
                .position(|&i| (self.tx_meta[i].1.tos, sock_of(i)) != key)
                .map_or(n, |p| start + p);
            result = self.send_run(&order[start..end], key.0, key.1);
            start = end;
        }
        self.order = order;
        result.map(|()| n)
    }

    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        let limit = max.min(self.cfg.batch);
        if limit == 0 {
            return Ok(0);
        }
        let fd = self.sock.as_raw_fd();
        let mut info = std::mem::take(&mut self.rx_info);
        info.clear();
        for attempt in 0..2 {
            let mut hdrs = MultiHeaders::<SockaddrStorage>::preallocate(
                limit,
                Some(nix::cmsg_space!(libc::c_int)),
            );
            let mut iovs: Vec<[IoSliceMut<'_>; 1]> = self.rx_bufs[..limit]
                .iter_mut()
                .map(|b| [IoSliceMut::new(b)])
                .collect();
            match recvmmsg(fd, &mut hdrs, iovs.iter_mut(), MsgFlags::MSG_DONTWAIT, None) {
                Ok(res) => {
                    for m in res {
                        let tos = m.cmsgs().ok().and_then(|mut c| {
                            c.find_map(|c| match c {
                                ControlMessageOwned::Ipv4Tos(t) => Some(t),
                                ControlMessageOwned::Ipv6TClass(t) => u8::try_from(t).ok(),
                                _ => None,
                            })
                        });
                        let src = m.address.as_ref().and_then(to_std);
                        match src {
                            Some(src) if !m.flags.contains(MsgFlags::MSG_TRUNC) => {
                                info.push((m.bytes, src, tos.unwrap_or(0)));
                            }
                            // Oversized or addressless datagrams are not gradwire's: skip them,
                            // keeping the slot numbering of the ones after.
                            _ => info.push((usize::MAX, self.local, 0)),
                        }
                    }
                    break;
                }
                Err(Errno::EAGAIN) if attempt == 0 => {
                    if !self.wait(PollFlags::POLLIN, timeout)? {
                        break;
                    }
                }
                Err(Errno::EAGAIN | Errno::EINTR) => break,
                Err(e) => {
                    self.rx_info = info;
                    return Err(io("recvmmsg", e));
                }
            }
        }
        let mut n = 0;
        for (i, &(len, src, tos)) in info.iter().enumerate() {
            if len == usize::MAX {
                self.rx_malformed += 1;
                continue;
            }
            let data = &self.rx_bufs[i][..len.min(self.cfg.max_datagram)];
            deliver(&RxMeta { src, tos }, data);
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += len as u64;
            n += 1;
        }
        self.rx_info = info;
        Ok(n)
    }

    fn stats(&self) -> DatapathStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_with_mixed_tos_arrives_with_its_tos() {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut a = UdpDatapath::bind(lo, UdpConfig::default()).unwrap();
        let mut b = UdpDatapath::bind(lo, UdpConfig::default()).unwrap();
        let dst = b.local_addr();
        let mut k = 0u8;
        let n = a
            .send(10, &mut |buf: &mut [u8]| {
                buf[0] = k;
                // Alternate DSCP 10 / 46 and ECN ECT(0) / not-ECT.
                let tos = if k % 2 == 0 {
                    super::super::tos(10, 2)
                } else {
                    super::super::tos(46, 0)
                };
                k += 1;
                Some((100, TxMeta { dst, tos }))
            })
            .unwrap();
        assert_eq!(n, 10);
        let mut got = Vec::new();
        while got.len() < 10 {
            let r = b
                .recv(64, Duration::from_secs(2), &mut |m: &RxMeta, d: &[u8]| {
                    got.push((d[0], d.len(), m.tos, m.src));
                })
                .unwrap();
            assert!(r > 0, "timed out with {} of 10", got.len());
        }
        got.sort_unstable();
        for (i, (k, len, tos, src)) in got.into_iter().enumerate() {
            assert_eq!(k as usize, i);
            assert_eq!(len, 100);
            assert_eq!(tos, if i % 2 == 0 { (10 << 2) | 2 } else { 46 << 2 });
            assert_eq!(src, a.local_addr());
        }
        assert_eq!(a.stats().tx_packets, 10);
        assert_eq!(b.stats().rx_bytes, 1000);
    }

    #[test]
    fn recv_times_out_empty_and_config_is_checked() {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut b = UdpDatapath::bind(lo, UdpConfig::default()).unwrap();
        let n = b
            .recv(8, Duration::from_millis(5), &mut |_: &RxMeta, _: &[u8]| {})
            .unwrap();
        assert_eq!(n, 0);
        let bad = UdpConfig {
            batch: 0,
            ..UdpConfig::default()
        };
        assert!(matches!(
            UdpDatapath::bind(lo, bad),
            Err(UdpSetupError::Config(_))
        ));
        let taken = b.local_addr();
        assert!(matches!(
            UdpDatapath::bind(taken, UdpConfig::default()),
            Err(UdpSetupError::Bind { .. })
        ));
    }
}
