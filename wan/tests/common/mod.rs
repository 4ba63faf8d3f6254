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
