//! The send path of an [`XdpIo`]: [`XdpIo::send`] checks each bundle, plans the ones that fit
//! the free TX frames whole, has them framed onto the TX ring (`fill.rs` cuts them into
//! datagrams), kicks and flushes the ring, and drops what goes to a destination without an
//! Ethernet address (not tried again for a while).

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use gradwire::datapath::{Datapath, DatapathError};

use super::fill::{Filler, Planned};
use super::{Transmit, XdpIo, XdpIoError};

/// How long a destination without an Ethernet address is not tried again (resolving it takes
/// the sending thread up to a second).
const UNREACHABLE_BACKOFF: Duration = Duration::from_secs(10);

impl XdpIo {
    /// The destination in this socket's family.
    fn map_dst(&self, dst: SocketAddr) -> Result<SocketAddr, &'static str> {
        match (self.local, dst) {
            (SocketAddr::V4(_), SocketAddr::V4(_)) | (SocketAddr::V6(_), SocketAddr::V6(_)) => {
                match dst {
                    SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
                        Some(_) => Err("IPv4-mapped destination on an IPv6 AF_XDP socket: \
                                        give the peer's IPv6 address"),
                        None => Ok(SocketAddr::new(IpAddr::V6(*a.ip()), a.port())),
                    },
                    v4 => Ok(v4),
                }
            }
            (SocketAddr::V4(_), SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
                Some(ip) => Ok(SocketAddr::V4(SocketAddrV4::new(ip, a.port()))),
                None => Err(
                    "IPv6 destination on an IPv4 AF_XDP socket: open one on an IPv6 \
                             address to reach IPv6 peers",
                ),
            },
            (SocketAddr::V6(_), SocketAddr::V4(_)) => Err(
                "IPv4 destination on an IPv6 AF_XDP socket: open one on an IPv4 address to \
                 reach IPv4 peers",
            ),
        }
    }

    /// Checks bundle `i` of `batch`.
    fn check(
        &self,
        batch: &[Transmit<'_>],
        i: usize,
        now: Instant,
    ) -> Result<Planned, &'static str> {
        let Some(t) = batch.get(i) else {
            return Err("no such bundle");
        };
        let total = t.iov.iter().fold(0usize, |a, s| a.saturating_add(s.len()));
        if total > 0 && t.segment_size == 0 {
            return Err("segment_size is 0 in a non-empty bundle: give the datagram size");
        }
        let seg = t.segment_size.min(total);
        if seg > self.max_datagram {
            return Err(
                "a datagram larger than an AF_XDP frame holds (XdpIo::max_datagram): \
                        lower the MTU, or use 4096-byte frames",
            );
        }
        let dst = self.map_dst(t.dst)?;
        let datagrams = if total == 0 { 1 } else { total.div_ceil(seg) };
        if datagrams > self.tx_capacity {
            return Err(
                "more datagrams in one bundle than the socket has TX frames: send \
                        smaller bundles (XdpIo::max_segments)",
            );
        }
        let drop = self
            .unreachable
            .get(&dst.ip())
            .is_some_and(|&at| now.saturating_duration_since(at) < UNREACHABLE_BACKOFF);
        Ok(Planned {
            bundle: i,
            dst,
            tos: t.tos,
            seg,
            total,
            datagrams,
            drop,
        })
    }

    /// Sends bundles: every datagram framed and put on the TX ring, in batches of
    /// [`XdpIoConfig::batch`](super::XdpIoConfig::batch) with one kick each, then the ring
    /// flushed.
    ///
    /// Returns how many bundles (from the front of `batch`) were sent. Fewer than
    /// `batch.len()` when the next bundle does not fit the free TX frames (it was not sent at
    /// all; [`XdpIo::wait`] with `want_write` then waits for the ring), or when a later bundle
    /// is invalid: that bundle is then first in the next call, which reports its error. `Err`
    /// means the first bundle of `batch` was refused (nothing was sent). A bundle to an
    /// address without an Ethernet address counts as sent and is dropped
    /// ([`XdpIoStats::tx_no_neighbor`](super::XdpIoStats::tx_no_neighbor)); that address is not
    /// tried again for 10 s.
    pub fn send(&mut self, batch: &[Transmit<'_>]) -> Result<usize, XdpIoError> {
        self.stats.send_calls += 1;
        let now = Instant::now();
        let mut done = 0usize;
        let mut room = self.dp.tx_room();
        let mut flushed = false;
        while done < batch.len() {
            // The bundles from `done` on that fit the room whole.
            let mut plan = std::mem::take(&mut self.plan);
            plan.clear();
            let mut need = 0usize;
            let mut refused = None;
            for i in done..batch.len() {
                match self.check(batch, i, now) {
                    Ok(p) => {
                        let n = if p.drop { 0 } else { p.datagrams };
                        if need + n > room {
                            break;
                        }
                        need += n;
                        plan.push(p);
                    }
                    Err(reason) => {
                        refused = Some((batch[i].dst, reason));
                        break;
                    }
                }
            }
            if plan.is_empty() {
                self.plan = plan;
                if let Some((dst, reason)) = refused {
                    if done == 0 {
                        return Err(XdpIoError::Transmit {
                            local: self.local,
                            dst,
                            reason,
                        });
                    }
                    break;
                }
                if flushed {
                    self.stats.send_would_block += 1;
                    break;
                }
                // Push out what the ring holds, reap what the kernel finished, look again.
                self.flush()?;
                room = self.dp.tx_room();
                flushed = true;
                continue;
            }
            let sent = self.transmit(batch, &mut plan);
            self.plan = plan;
            match sent {
                Ok(n) if n > 0 => {
                    done += n;
                    flushed = false;
                    room = self.dp.tx_room();
                }
                Ok(_) => {
                    // The datapath took nothing although the room was there: try once more
                    // after a flush, then report the socket full.
                    if flushed {
                        self.stats.send_would_block += 1;
                        break;
                    }
                    self.flush()?;
                    room = self.dp.tx_room();
                    flushed = true;
                }
                Err(e) if done == 0 => return Err(e),
                Err(_) => break,
            }
        }
        self.flush()?;
        Ok(done)
    }

    /// Kicks the TX ring until the kernel took everything (copy mode) and reaps completions.
    fn flush(&mut self) -> Result<(), XdpIoError> {
        self.dp.flush_tx().map_err(|source| XdpIoError::Datapath {
            op: "send",
            local: self.local,
            source,
        })
    }

    /// Hands the datagrams of `plan` (bundles `plan[0].bundle..`, consecutive) to the
    /// datapath; returns how many of its bundles were sent whole (or dropped).
    fn transmit(
        &mut self,
        batch: &[Transmit<'_>],
        plan: &mut [Planned],
    ) -> Result<usize, XdpIoError> {
        let mut fill = Filler {
            batch,
            plan,
            at: 0,
            emitted: 0,
            off: 0,
            slice: 0,
            inner: 0,
            last: 0,
            last_len: 0,
            handed: 0,
            bytes: 0,
        };
        let mut result = Ok(());
        loop {
            let left = fill.left();
            if left == 0 {
                break;
            }
            let before = fill.handed;
            match self.dp.send(left, &mut |b| fill.next(b)) {
                Ok(_) if fill.handed == before => break,
                Ok(_) => {}
                Err(DatapathError::NoNeighbor(ip)) => {
                    // The datagram handed out last was refused, and it was the first of its
                    // bundle (a bundle has one destination, whose address the datapath caches
                    // once found); everything handed out before it was sent. That bundle and
                    // the later ones to the same address are dropped, as the network would.
                    fill.handed = fill.handed.saturating_sub(1);
                    fill.bytes = fill.bytes.saturating_sub(fill.last_len);
                    let last = fill.last;
                    for p in fill.plan[last..].iter_mut() {
                        if p.dst.ip() == ip && !p.drop {
                            p.drop = true;
                            self.stats.tx_no_neighbor += p.datagrams as u64;
                        }
                    }
                    fill.skip_to(last + 1);
                    if self.unreachable.insert(ip, Instant::now()).is_none() {
                        log::warn!(
                            "AF_XDP {}: no Ethernet address for {ip}; dropping what is sent \
                             to it, trying again in {UNREACHABLE_BACKOFF:?}",
                            self.local
                        );
                    }
                }
                Err(source) => {
                    result = Err(XdpIoError::Datapath {
                        op: "send",
                        local: self.local,
                        source,
                    });
                    break;
                }
            }
        }
        let whole = if fill.left() == 0 {
            fill.plan.len()
        } else {
            fill.at
        };
        self.stats.tx_datagrams += fill.handed as u64;
        self.stats.tx_bytes += fill.bytes as u64;
        self.stats.tx_bundles += fill.plan[..whole].iter().filter(|p| !p.drop).count() as u64;
        match result {
            Err(e) if whole == 0 => Err(e),
            _ => Ok(whole),
        }
    }
}
