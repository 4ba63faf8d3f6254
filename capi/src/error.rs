//! Error codes (the session's `ErrorKind` codes, plus C misuse), the per-thread last error, and the guard every exported function runs in.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use gradwire_session::SessionError;

/// Success.
pub const GW_OK: c_int = 0;
/// A bad argument: configuration, buffer length, dtype, op, rank out of range, loss bound
/// outside [0, 1), an endpoint already connected.
pub const GW_ERR_INVALID_ARGUMENT: c_int = 1;
/// Set-up failed: sockets, addresses, the rendezvous or endpoint table, authentication, the
/// all-gather callback.
pub const GW_ERR_SETUP: c_int = 2;
/// A peer died, timed out or broke the protocol (gw_last_error_peer() names it).
pub const GW_ERR_PEER: c_int = 3;
/// An earlier operation on this session failed: free it and build a new session.
pub const GW_ERR_UNUSABLE: c_int = 4;
/// A peer sent invalid aggregation data (forged or corrupt).
pub const GW_ERR_DATA: c_int = 5;
/// A bug in gradwire (a panic was caught): please report it with the message.
pub const GW_ERR_INTERNAL: c_int = 6;
/// A required pointer argument was NULL.
pub const GW_ERR_NULL: c_int = 7;
/// A string argument was not valid UTF-8.
pub const GW_ERR_UTF8: c_int = 8;
/// Another thread is inside a call on this session (a session is used by one thread at a
/// time).
pub const GW_ERR_BUSY: c_int = 9;

/// An error on its way to C: code, message, and the peer at fault if any.
#[derive(Debug)]
pub(crate) struct CError {
    pub(crate) code: c_int,
    pub(crate) message: String,
    pub(crate) peer: Option<usize>,
}

impl CError {
    pub(crate) fn new(code: c_int, message: impl Into<String>) -> CError {
        CError {
            code,
            message: message.into(),
            peer: None,
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> CError {
        CError::new(GW_ERR_INVALID_ARGUMENT, message)
    }

    pub(crate) fn null(what: &str) -> CError {
        CError::new(GW_ERR_NULL, format!("{what} is NULL: pass a valid pointer"))
    }
}

impl From<SessionError> for CError {
    fn from(e: SessionError) -> CError {
        CError {
            code: e.kind().code(),
            message: e.to_string(),
            peer: e.peer(),
        }
    }
}

/// The name of a code, for messages and `gw_error_name`.
pub(crate) fn code_name(code: c_int) -> &'static str {
    match code {
        GW_OK => "GW_OK",
        GW_ERR_INVALID_ARGUMENT => "GW_ERR_INVALID_ARGUMENT",
        GW_ERR_SETUP => "GW_ERR_SETUP",
        GW_ERR_PEER => "GW_ERR_PEER",
        GW_ERR_UNUSABLE => "GW_ERR_UNUSABLE",
        GW_ERR_DATA => "GW_ERR_DATA",
        GW_ERR_INTERNAL => "GW_ERR_INTERNAL",
        GW_ERR_NULL => "GW_ERR_NULL",
        GW_ERR_UTF8 => "GW_ERR_UTF8",
        GW_ERR_BUSY => "GW_ERR_BUSY",
        _ => "GW_ERR_UNKNOWN",
    }
}

struct LastError {
    message: CString,
    peer: c_int,
}

thread_local! {
    static LAST: RefCell<LastError> = RefCell::new(LastError {
        message: CString::default(),
        peer: -1,
    });
}

fn set_last(message: &str, peer: Option<usize>) {
    // A C string ends at the first NUL: keep the whole message readable.
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let peer = peer.and_then(|p| c_int::try_from(p).ok()).unwrap_or(-1);
    LAST.with(|l| *l.borrow_mut() = LastError { message, peer });
}

/// The last error's message on this thread; the pointer lives until this thread's next call
/// that can set it (every int-returning function).
pub(crate) fn last_message() -> *const c_char {
    LAST.with(|l| l.borrow().message.as_ptr())
}

pub(crate) fn last_peer() -> c_int {
    LAST.with(|l| l.borrow().peer)
}

/// Runs an exported function's body: clears the last error, turns an `Err` into its code and
/// message, and a panic into `GW_ERR_INTERNAL`, so no unwinding ever reaches C.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), CError>) -> c_int {
    set_last("", None);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => GW_OK,
        Ok(Err(e)) => {
            set_last(&e.message, e.peer);
            e.code
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            set_last(
                &format!("internal error in gradwire (please report it): {what}"),
                None,
            );
            GW_ERR_INTERNAL
        }
    }
}

/// For the few exported functions that return a value instead of a code: the value, or
/// `fallback` if the body panicked.
pub(crate) fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradwire_session::ErrorKind;
    use std::ffi::CStr;

    fn message() -> String {
        // SAFETY: last_message points at this thread's live, NUL-terminated CString.
        #[allow(unsafe_code)]
        let s = unsafe { CStr::from_ptr(last_message()) };
        s.to_string_lossy().into_owned()
    }

    #[test]
    fn codes_match_the_session_error_kinds() {
        for (kind, code) in [
            (ErrorKind::InvalidArgument, GW_ERR_INVALID_ARGUMENT),
            (ErrorKind::Setup, GW_ERR_SETUP),
            (ErrorKind::Peer, GW_ERR_PEER),
            (ErrorKind::Unusable, GW_ERR_UNUSABLE),
            (ErrorKind::Data, GW_ERR_DATA),
            (ErrorKind::Internal, GW_ERR_INTERNAL),
        ] {
            assert_eq!(kind.code(), code, "{kind:?}");
        }
    }

    #[test]
    fn a_panic_becomes_internal_and_a_success_clears_the_message() {
        let code = guard(|| panic!("boom"));
        assert_eq!(code, GW_ERR_INTERNAL);
        assert!(message().contains("boom"), "{}", message());
        assert_eq!(guard(|| Ok(())), GW_OK);
        assert_eq!(message(), "");
        assert_eq!(last_peer(), -1);
    }

    #[test]
    fn an_error_keeps_code_message_and_peer_and_survives_a_nul() {
        let code = guard(|| {
            Err(CError {
                code: GW_ERR_PEER,
                message: "rank 2\0 timed out".into(),
                peer: Some(2),
            })
        });
        assert_eq!(code, GW_ERR_PEER);
        assert_eq!(message(), "rank 2  timed out");
        assert_eq!(last_peer(), 2);
    }
}
