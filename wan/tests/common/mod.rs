//! Helpers shared by the wan crate's integration tests.
#![allow(dead_code)]

use std::sync::mpsc;
use std::time::Duration;

/// `f` on its own thread, failing the test if it has not returned within `limit`: a hang
/// guard set far beyond what the run takes (at least 5x its longest configured wait), so a
/// loaded machine cannot trip it; never a timing.
pub fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(t) => t,
        // The thread panicked: its message is on stderr already.
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the thread under test panicked"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the thread under test hung for {limit:?}"),
    }
}

/// `n` message-layer endpoints of job `job` on loopback, started with each other's
/// addresses: the nodes of an in-process test. A peer silent for `peer_timeout` fails the
/// links with it.
pub fn endpoints(
    n: usize,
    job: u32,
    peer_timeout: Duration,
) -> Vec<gradwire_msg::endpoint::Endpoint> {
    use gradwire_msg::endpoint::{Endpoint, EndpointConfig};
    let bound: Vec<_> = (0..n)
        .map(|r| {
            let mut cfg =
                EndpointConfig::new(job, r as u16, n as u16, "127.0.0.1:0".parse().unwrap());
            cfg.core.peer_timeout = peer_timeout;
            Endpoint::bind(cfg).expect("bind a loopback endpoint")
        })
        .collect();
    let table: Vec<_> = bound.iter().map(|b| b.local_addr()).collect();
    bound
        .into_iter()
        .map(|b| b.start(table.clone()).expect("start an endpoint"))
        .collect()
}
