//! gradwire's C library (`libgradwire_c`, header `include/gradwire.h`): a thin C ABI over
//! `gradwire-session`. Sessions are set up through gradwire's rendezvous, a caller-provided
//! all-gather, or two phases with the caller's own address exchange; then all-reduce,
//! broadcast and barrier on typed buffers with a loss bound, and DLCP's send/recv of one
//! tensor with a priority function.
//!
//! Conventions (repeated in the header): every function returns `GW_OK` or a `GW_ERR_*` code
//! with a per-thread message (`gw_last_error_message`); no panic crosses the boundary
//! (`error::guard`); a session is used by one thread at a time, and a second thread's call
//! fails at once with `GW_ERR_BUSY` rather than waiting.
//!
//! Only `ffi` reads C pointers (`unsafe`); `types` and `error` are safe code.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod error;
mod ffi;
mod types;

pub use error::{
    GW_ERR_BUSY, GW_ERR_DATA, GW_ERR_INTERNAL, GW_ERR_INVALID_ARGUMENT, GW_ERR_NULL, GW_ERR_PEER,
    GW_ERR_SETUP, GW_ERR_UNUSABLE, GW_ERR_UTF8, GW_OK,
};
pub use ffi::*;
pub use types::*;
