//! `gradwire._native`: the Python binding of `gradwire-session` (PyO3, stable ABI >= 3.9).
//!
//! The public package is `python/gradwire/`: it re-exports these classes, defines the exception
//! classes (raised from here through [`errors`]) and turns CPU torch tensors into numpy views
//! (`gradwire._as_array`, called from [`buffer`] for anything that is not an ndarray).
//!
//! Every transfer works on the caller's own array memory (no copy at the API) with the GIL
//! released. A blocking call reaches it through rust-numpy's borrow-tracked views; a started
//! operation outlives the call, so [`work`] lends it the raw memory, the crate's one `unsafe`
//! block.
#![deny(unsafe_code)]

mod buffer;
mod config;
mod errors;
mod priority;
mod reports;
mod session;
mod work;

use pyo3::prelude::*;

/// The native module. Its name must match `[lib] name` and pyproject's `module-name`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<session::Endpoint>()?;
    m.add_class::<session::Session>()?;
    m.add_class::<reports::ReduceReport>()?;
    m.add_class::<reports::BroadcastReport>()?;
    m.add_class::<reports::SendReport>()?;
    m.add_class::<reports::RecvReport>()?;
    m.add_class::<work::Work>()?;
    m.add("ERROR_KINDS", errors::kind_table(m.py())?)?;
    Ok(())
}
