//! The receive path of an [`XdpIo`]: [`XdpIo::recv`] takes frames off the RX ring (the
//! datapath parses them in place and refills the FILL ring) and hands each UDP payload to the
//! caller with its source and TOS byte.

use std::time::Duration;

use gradwire::datapath::Datapath;

use super::{RecvMeta, XdpIo, XdpIoError};

impl XdpIo {
    /// Hands every datagram on the RX ring to `f` (up to
    /// [`XdpIoConfig::recv_budget`](super::XdpIoConfig::recv_budget)), without blocking, each
    /// with its source address and TOS byte, and gives the frames back to the kernel. Returns
    /// how many: 0 when nothing is queued.
    pub fn recv(&mut self, f: &mut dyn FnMut(RecvMeta, &[u8])) -> Result<usize, XdpIoError> {
        self.serve_monitor();
        self.stats.recv_calls += 1;
        let mut total = 0usize;
        let mut bytes = 0usize;
        while total < self.recv_budget {
            let dropped = self.dp.stats().rx_dropped;
            let max = self.batch.min(self.recv_budget - total);
            let n = self
                .dp
                .recv(max, Duration::ZERO, &mut |m, d| {
                    bytes += d.len();
                    f(
                        RecvMeta {
                            src: m.src,
                            tos: m.tos,
                        },
                        d,
                    );
                })
                .map_err(|source| XdpIoError::Datapath {
                    op: "receive",
                    local: self.local,
                    source,
                })?;
            total += n;
            // A batch of frames dropped as malformed delivers nothing but may hide more.
            if n == 0 && self.dp.stats().rx_dropped == dropped {
                break;
            }
        }
        self.stats.rx_datagrams += total as u64;
        self.stats.rx_bytes += bytes as u64;
        Ok(total)
    }
}
