//! Helpers shared by the transport's integration tests.

#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gradwire::datapath::{
    DataSource, Datapath, DatapathError, DatapathStats, Deliver, Fill, TxMeta,
};

/// A sent datagram and its metadata.
pub type Sent = (Vec<u8>, TxMeta);

/// A sender's datapath, wrapped: keeps a copy of every datagram it sends while `recording`
/// (a capture, as an on-path observer would make one), and plays `replay` back ahead of its
/// next batch (late packets of an earlier flow). Everything else is the wrapped datapath's,
/// its announced data sources included.
pub struct Recorder<D> {
    pub inner: D,
    pub recorded: Arc<Mutex<Vec<Sent>>>,
    pub recording: Arc<AtomicBool>,
    pub replay: Vec<Sent>,
}

impl<D: Datapath> Recorder<D> {
    /// Records everything `inner` sends, replays nothing yet.
    pub fn new(inner: D) -> Recorder<D> {
        Recorder {
            inner,
            recorded: Arc::default(),
            recording: Arc::new(AtomicBool::new(true)),
            replay: Vec::new(),
        }
    }

    /// Takes what was recorded so far.
    pub fn take_recorded(&self) -> Vec<Sent> {
        std::mem::take(&mut *self.recorded.lock().unwrap())
    }

    /// Sends `late` now, through the wrapped datapath.
    pub fn send_raw(&mut self, late: Vec<Sent>) {
        let n = late.len();
        let mut it = late.into_iter();
        let sent = self
            .inner
            .send(n, &mut |buf: &mut [u8]| {
                let (d, m) = it.next()?;
                buf[..d.len()].copy_from_slice(&d);
                Some((d.len(), m))
            })
            .unwrap();
        assert_eq!(sent, n);
    }
}

impl<D: Datapath> Datapath for Recorder<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }
    fn max_datagram(&self) -> usize {
        self.inner.max_datagram()
    }
    fn send(&mut self, max: usize, fill: &mut Fill<'_>) -> Result<usize, DatapathError> {
        let late = std::mem::take(&mut self.replay);
        if !late.is_empty() {
            self.send_raw(late);
        }
        let recording = self.recording.load(Ordering::Acquire);
        let rec = &self.recorded;
        self.inner.send(max, &mut |buf: &mut [u8]| {
            let (len, meta) = fill(buf)?;
            if recording {
                rec.lock().unwrap().push((buf[..len].to_vec(), meta));
            }
            Some((len, meta))
        })
    }
    fn recv(
        &mut self,
        max: usize,
        timeout: Duration,
        deliver: &mut Deliver<'_>,
    ) -> Result<usize, DatapathError> {
        self.inner.recv(max, timeout, deliver)
    }
    fn stats(&self) -> DatapathStats {
        self.inner.stats()
    }
    fn data_sources(&self) -> Vec<DataSource> {
        self.inner.data_sources()
    }
}
