//! `send`'s `priority` argument: None (DLCP's default tagging), an int DSCP, or a Python
//! callable `(index, offset, layer, payload: bytes) -> (dscp, ect)` called for every segment.
//!
//! The callable runs while the transfer has released the GIL, so each call takes the GIL back
//! (`Python::attach`). It cannot stop the transfer: if it raises or returns a bad tag, the
//! remaining segments get [`FALLBACK`] and `send` raises after the transfer, naming the segment.
//!
//! While it runs, its session is inside `send` (holding the session's lock): a call back into
//! that session from the callable would wait for itself forever. Each call marks its thread
//! with the session's id ([`inside_priority_of`]) so that the session refuses such a call.

use std::cell::Cell;
use std::sync::{Mutex, PoisonError};

use gradwire_session::{SegmentInfo, Tag};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt};

use crate::{config, errors};

/// The tag of the segments after the callable failed: best effort, not ECN-capable.
const FALLBACK: Tag = Tag {
    dscp: 0,
    ect: false,
};

/// A checked `priority` argument.
#[derive(Debug)]
pub(crate) enum Priority {
    /// DLCP's default tagging (the layer's DSCP, ECN by gradient magnitude).
    Default,
    /// Every segment gets this DSCP and is ECN-capable (ECT(0): marked, not dropped, by a
    /// switch over its ECN threshold).
    Fixed(Tag),
    /// A Python callable deciding each segment's tag.
    Callable(Callback),
}

thread_local! {
    /// The id of the session whose priority callable this thread is running, if any.
    static RUNNING_FOR: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Whether this thread is inside a priority callable of session `session`.
pub(crate) fn inside_priority_of(session: u64) -> bool {
    RUNNING_FOR.with(|r| r.get() == Some(session))
}

/// Marks this thread as running session `session`'s callable until dropped (also on a panic).
struct Running(Option<u64>);

impl Running {
    fn enter(session: u64) -> Running {
        Running(RUNNING_FOR.with(|r| r.replace(Some(session))))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING_FOR.with(|r| r.set(self.0));
    }
}

impl Priority {
    /// `priority` of a send on session `session` (its id, see [`inside_priority_of`]).
    pub(crate) fn new(
        py: Python<'_>,
        priority: Option<&Bound<'_, PyAny>>,
        session: u64,
    ) -> PyResult<Priority> {
        let Some(p) = priority.filter(|p| !p.is_none()) else {
            return Ok(Priority::Default);
        };
        // bool is an int in Python; True/False as a DSCP is a mistake, not a choice.
        if p.is_instance_of::<PyInt>() && !p.is_instance_of::<PyBool>() {
            let dscp = config::dscp(py, p.extract::<i64>().unwrap_or(-1))?;
            return Ok(Priority::Fixed(Tag { dscp, ect: true }));
        }
        if p.is_callable() {
            return Ok(Priority::Callable(Callback {
                func: p.clone().unbind(),
                session,
                failure: Mutex::new(None),
            }));
        }
        Err(errors::config(
            py,
            format!(
                "priority must be None, an int DSCP (0..=63) or a callable \
                 (index, offset, layer, payload) -> (dscp, ect), not {}",
                p.get_type()
                    .name()
                    .map_or_else(|_| "?".to_owned(), |n| n.to_string())
            ),
        ))
    }
}

/// A Python priority callable and the first failure it had.
#[derive(Debug)]
pub(crate) struct Callback {
    func: Py<PyAny>,
    /// The id of the session sending.
    session: u64,
    failure: Mutex<Option<(u32, PyErr)>>,
}

impl Callback {
    /// The tag of one segment (called by the sender with the GIL released).
    pub(crate) fn tag(&self, seg: &SegmentInfo<'_>) -> Tag {
        if self.failed() {
            return FALLBACK;
        }
        // The lock is not held across the call: the GIL is never awaited under it.
        let _running = Running::enter(self.session);
        Python::attach(|py| match self.call(py, seg) {
            Ok(tag) => tag,
            Err(err) => {
                let mut failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
                failure.get_or_insert((seg.index, err));
                FALLBACK
            }
        })
    }

    fn failed(&self) -> bool {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn call(&self, py: Python<'_>, seg: &SegmentInfo<'_>) -> PyResult<Tag> {
        let payload = PyBytes::new(py, seg.payload);
        let out = self
            .func
            .call1(py, (seg.index, seg.offset, seg.layer, payload))?;
        let (dscp, ect): (i64, Bound<'_, PyAny>) = out.extract(py).map_err(|_| {
            PyTypeError::new_err("the priority callable must return a (dscp, ect) tuple")
        })?;
        let dscp = u8::try_from(dscp)
            .ok()
            .filter(|d| *d <= 63)
            .ok_or_else(|| PyValueError::new_err(format!("dscp {dscp} is outside 0..=63")))?;
        Ok(Tag {
            dscp,
            ect: ect.is_truthy()?,
        })
    }

    /// After the transfer: the callable's first failure as a ConfigError caused by it.
    pub(crate) fn failure(&self, py: Python<'_>) -> Option<PyErr> {
        let (index, cause) = self
            .failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        let err = errors::config(
            py,
            format!(
                "the priority callable failed on segment {index} ({cause}); that segment and \
                 the rest were sent with DSCP 0, not ECN-capable"
            ),
        );
        err.set_cause(py, Some(cause));
        Some(err)
    }
}
