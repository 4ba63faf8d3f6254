//! The counters of an [`XdpIo`] ([`XdpIoStats`], and the datapath's in an [`XdpSnapshot`]) and
//! how another thread reads them: the progress thread owns the socket, so an [`XdpMonitor`]
//! asks (through the waker) and the owning thread answers from its `recv` and `wait`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gradwire::datapath::Datapath;

use super::{AfXdpStats, Waker, XdpIo};

/// Counters of one [`XdpIo`], for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpIoStats {
    /// `send` calls.
    pub send_calls: u64,
    /// `send` calls that stopped early: the next bundle did not fit the free TX frames.
    pub send_would_block: u64,
    /// Bundles sent whole.
    pub tx_bundles: u64,
    /// Datagrams put on the TX ring.
    pub tx_datagrams: u64,
    /// Their UDP payload bytes.
    pub tx_bytes: u64,
    /// Datagrams dropped because their destination has no Ethernet address (the bundle counts
    /// as sent, as if the network had lost it).
    pub tx_no_neighbor: u64,
    /// `recv` calls.
    pub recv_calls: u64,
    /// Datagrams handed to `recv`'s callback.
    pub rx_datagrams: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// Frames that reached the socket but were not valid UDP to our port: dropped.
    pub rx_dropped: u64,
    /// `wait` calls (each one `ppoll`).
    pub waits: u64,
}

/// Everything an [`XdpMonitor`] reports.
#[derive(Debug, Clone)]
pub struct XdpSnapshot {
    /// This socket's counters.
    pub io: XdpIoStats,
    /// The datapath's: the socket's and the kernel's per queue, and the classifier's
    /// (`xdp.drop_not_allowed` counts datagrams from addresses outside the allowlist).
    pub afxdp: AfXdpStats,
}

#[derive(Debug, Default)]
pub(super) struct MonitorShared {
    requested: AtomicBool,
    latest: Mutex<(u64, Option<XdpSnapshot>)>,
    cv: Condvar,
}

/// Reads an [`XdpIo`]'s counters from another thread while an endpoint's progress thread
/// owns it: a request wakes that thread, which answers on its next loop.
#[derive(Debug, Clone)]
pub struct XdpMonitor {
    shared: Arc<MonitorShared>,
    waker: Waker,
}

impl XdpMonitor {
    /// Fresh counters, or `None` when the owning thread did not answer within `timeout`
    /// (it is gone, or the socket is not being driven).
    pub fn snapshot(&self, timeout: Duration) -> Option<XdpSnapshot> {
        let end = Instant::now() + timeout;
        let mut st = self.shared.latest.lock().unwrap_or_else(|e| e.into_inner());
        let asked = st.0;
        self.shared.requested.store(true, Ordering::Release);
        self.waker.wake();
        while st.0 == asked {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.1.clone()
    }
}

impl XdpIo {
    /// The counters so far.
    pub fn stats(&self) -> XdpIoStats {
        XdpIoStats {
            rx_dropped: self.dp.stats().rx_dropped,
            waits: self.waits.get(),
            ..self.stats
        }
    }

    /// The datapath's counters: per queue (with the kernel's) and the classifier's.
    pub fn afxdp_stats(&self) -> AfXdpStats {
        self.dp.afxdp_stats()
    }

    /// A handle to read the counters from another thread once the socket is handed to an
    /// endpoint.
    pub fn monitor(&self) -> XdpMonitor {
        XdpMonitor {
            shared: Arc::clone(&self.monitor),
            waker: self.waker.clone(),
        }
    }

    /// Answers a monitor's request, if one is pending.
    pub(super) fn serve_monitor(&self) {
        if !self.monitor.requested.swap(false, Ordering::AcqRel) {
            return;
        }
        let snap = XdpSnapshot {
            io: self.stats(),
            afxdp: self.dp.afxdp_stats(),
        };
        let mut st = self
            .monitor
            .latest
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        st.0 += 1;
        st.1 = Some(snap);
        self.monitor.cv.notify_all();
    }
}
