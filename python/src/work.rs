//! Started operations (`Session.start_*`): a [`Work`] per operation, waited for from any
//! thread, with the GIL released while it waits.
//!
//! The operation works on the array's own memory ([`Lent`]) on the message layer's progress
//! thread. The `Work` owns, in this order, the running operation and the lent array, so when
//! it is dropped the operation is cancelled and waited for before the array is let go: the
//! memory stays alive and claimed for exactly as long as anything may touch it.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gradwire_session::{self as gs, Outcome, Region};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;

use crate::buffer::Lent;
use crate::errors;
use crate::reports::{BroadcastReport, RecvReport, ReduceReport, SendReport};

/// Set when the operation completes (by the progress thread); waiters sleep on it.
#[derive(Default)]
struct Signal {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    fn set(&self) {
        *self.done.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }

    fn is_set(&self) -> bool {
        *self.done.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until set or `timeout` (None: for ever); whether it is set.
    fn wait(&self, timeout: Option<Duration>) -> bool {
        let end = timeout.map(|t| Instant::now() + t);
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        while !*done {
            match end {
                None => done = self.cv.wait(done).unwrap_or_else(PoisonError::into_inner),
                Some(end) => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    done = self
                        .cv
                        .wait_timeout(done, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
        true
    }
}

/// What `wait` returned the first time (kept for later calls).
enum Result_ {
    Pending(gs::Work),
    Ok(Py<PyAny>),
    Err(PyErr),
}

/// A started operation: `wait()` for its report (or None for an all-gather or barrier),
/// `is_completed()` to test it. Dropping it before it completed cancels the operation.
#[pyclass(module = "gradwire._native", frozen)]
pub(crate) struct Work {
    /// Declared first so it is dropped first: a pending operation is cancelled and waited
    /// for before the lent memory below is released.
    state: Mutex<Option<Result_>>,
    signal: Arc<Signal>,
    what: &'static str,
    /// Released as soon as the operation has ended (a completed Work may live on in a
    /// framework's hands; its memory is free for the next operation).
    lent: Mutex<Option<Lent>>,
}

impl Work {
    pub(crate) fn new(what: &'static str, work: gs::Work, lent: Option<Lent>) -> Work {
        let signal = Arc::new(Signal::default());
        let s = Arc::clone(&signal);
        work.on_complete(move |_| s.set());
        Work {
            state: Mutex::new(Some(Result_::Pending(work))),
            signal,
            what,
            lent: Mutex::new(lent),
        }
    }
}

fn to_python(py: Python<'_>, outcome: Outcome) -> PyResult<Py<PyAny>> {
    Ok(match outcome {
        Outcome::Reduced(r) => Py::new(py, ReduceReport::from(r))?.into_any(),
        Outcome::Broadcast(r) => Py::new(py, BroadcastReport::from(r))?.into_any(),
        Outcome::Sent(r) => Py::new(py, SendReport::from(r))?.into_any(),
        Outcome::Received(r) => Py::new(py, RecvReport::from(r))?.into_any(),
        Outcome::Done => py.None(),
    })
}

#[pymethods]
impl Work {
    /// Waits for the operation (GIL released) and returns its report, or raises its error;
    /// later calls return the same. `timeout` in seconds: TimeoutError if it is still
    /// running then (it keeps running; wait again, or drop the Work to cancel it).
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let limit = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t.min(1e9))),
            Some(t) => {
                return Err(errors::config(
                    py,
                    format!("timeout {t} is not a number of seconds >= 0"),
                ))
            }
        };
        let signal = Arc::clone(&self.signal);
        if !py.detach(|| signal.wait(limit)) {
            return Err(PyTimeoutError::new_err(format!(
                "{}: still running after {:.3} s; wait again, or drop the work to cancel it",
                self.what,
                timeout.unwrap_or(0.0)
            )));
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let result = match state.take() {
            Some(Result_::Pending(work)) => {
                // Complete: this wait only collects the outcome.
                match py.detach(|| work.wait()) {
                    Ok(outcome) => to_python(py, outcome).map_or_else(Result_::Err, Result_::Ok),
                    Err(e) => Result_::Err(errors::session(py, &e)),
                }
            }
            Some(done) => done,
            None => Result_::Err(errors::internal(py, "the work's state was lost")),
        };
        let out = match &result {
            Result_::Ok(v) => Ok(v.clone_ref(py)),
            Result_::Err(e) => Err(e.clone_ref(py)),
            Result_::Pending(_) => Err(errors::internal(py, "the work is still pending")),
        };
        *state = Some(result);
        drop(state);
        // The operation has ended (its outcome was collected): nothing touches the memory.
        drop(
            self.lent
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        out
    }

    /// Whether the operation has completed (`wait()` then returns at once).
    fn is_completed(&self) -> bool {
        self.signal.is_set()
    }

    fn __repr__(&self) -> String {
        format!(
            "Work({}, {})",
            self.what,
            if self.signal.is_set() {
                "completed"
            } else {
                "running"
            }
        )
    }
}

/// The memory of `lent` as a region for the operation.
#[allow(unsafe_code)]
pub(crate) fn region(lent: &Lent) -> Region {
    // SAFETY: `lent` holds a strong reference to the array (so its memory stays allocated)
    // and claims the range in the module's registry (so no other gradwire operation touches
    // it). The region is given to one operation whose `Work` owns `lent`, and the `Work`
    // drops (cancels and waits for) the operation before `lent`: nothing uses the region
    // after the memory is released. Python code writing the array meanwhile is the caller's
    // documented error, as for the blocking calls.
    unsafe {
        Region::borrowed(std::slice::from_raw_parts_mut(
            lent.ptr as *mut u8,
            lent.len,
        ))
    }
}
