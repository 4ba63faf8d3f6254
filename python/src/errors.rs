//! Rust errors as the Python exceptions of `gradwire/__init__.py`.
//!
//! The classes are Python classes (`ConfigError` is both a `GradwireError` and a `ValueError`,
//! which a class made here could not be); each is raised with the Rust error's message and
//! carries `.kind` and `.code` (the `ErrorKind`'s, given to Python by `ERROR_KINDS`) and `.peer`.

use std::error::Error as _;

use gradwire_session::{ErrorKind, SessionError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The exception class of each kind, by its name in the `gradwire` package.
const CLASSES: [(ErrorKind, &str); 6] = [
    (ErrorKind::InvalidArgument, "ConfigError"),
    (ErrorKind::Setup, "SetupError"),
    (ErrorKind::Peer, "PeerError"),
    (ErrorKind::Unusable, "UnusableError"),
    (ErrorKind::Data, "DataError"),
    (ErrorKind::Internal, "InternalError"),
];

fn class_name(kind: ErrorKind) -> &'static str {
    CLASSES
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or("GradwireError", |(_, name)| name)
}

/// `{class name: (kind name, code)}`: the package sets its classes' `kind` and `code` from it.
pub(crate) fn kind_table(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let table = PyDict::new(py);
    for (kind, class) in CLASSES {
        table.set_item(class, (kind.name(), kind.code()))?;
    }
    Ok(table)
}

/// The exception of `kind` with `message`.
pub(crate) fn raise(
    py: Python<'_>,
    kind: ErrorKind,
    message: String,
    peer: Option<usize>,
) -> PyErr {
    match build(py, kind, &message, peer) {
        Ok(err) => err,
        // Only if the package's classes are missing (a broken install): keep the message.
        Err(lookup) => PyRuntimeError::new_err(format!(
            "{message} (and gradwire's exception class {} could not be loaded: {lookup})",
            class_name(kind)
        )),
    }
}

fn build(py: Python<'_>, kind: ErrorKind, message: &str, peer: Option<usize>) -> PyResult<PyErr> {
    let class = py.import("gradwire")?.getattr(class_name(kind))?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("peer", peer)?;
    let exc = class.call((message,), Some(&kwargs))?;
    Ok(PyErr::from_value(exc))
}

/// A session error, its message followed by the causes its text does not already include.
pub(crate) fn session(py: Python<'_>, err: &SessionError) -> PyErr {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    raise(py, err.kind(), message, err.peer())
}

/// A wrong argument or wrong use (`ConfigError`).
pub(crate) fn config(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, ErrorKind::InvalidArgument, message.into(), None)
}

/// A closed or consumed object (`UnusableError`).
pub(crate) fn unusable(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, ErrorKind::Unusable, message.into(), None)
}

/// A panic caught at the binding's edge (`InternalError`): a bug, never a Python crash.
pub(crate) fn internal(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, ErrorKind::Internal, message.into(), None)
}
