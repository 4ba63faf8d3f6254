//! Helpers of the C API tests: sessions as threads on 127.0.0.1, called through the very
//! functions C calls.
#![allow(dead_code, unsafe_code)]

pub mod forge;
pub mod programs;

use std::ffi::{CStr, CString};
use std::net::Ipv4Addr;
use std::ptr;

use gradwire_c::*;

pub const LOCAL: &CStr = c"127.0.0.1";

/// A rendezvous master's port on 127.0.0.1, reserved for as long as this lives: a socket bound
/// there with `SO_REUSEADDR` but not listening. Rank 0's listener (std sets `SO_REUSEADDR`)
/// can bind the same port, since the reservation never listens; nobody else can take it in
/// the meantime (the kernel skips it for port-0 binds, and an explicit bind without
/// `SO_REUSEADDR` conflicts). No port is ever found free, dropped and bound again later.
#[derive(Debug)]
pub struct MasterPort {
    _hold: socket2::Socket,
    pub port: u16,
}

impl MasterPort {
    pub fn reserve() -> MasterPort {
        use socket2::{Domain, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        s.bind(&std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into())
            .unwrap();
        let port = s.local_addr().unwrap().as_socket().unwrap().port();
        MasterPort { _hold: s, port }
    }

    /// "127.0.0.1:port" as C wants it.
    pub fn master(&self) -> CString {
        master(self.port)
    }
}

/// The master address of a rendezvous on 127.0.0.1.
pub fn master(port: u16) -> CString {
    CString::new(format!("127.0.0.1:{port}")).unwrap()
}

/// Rank `rank` of `world` on 127.0.0.1 with a 10 s timeout.
pub fn config(rank: u32, world: u32) -> gw_config {
    let mut c = gw_config_default(rank, world, LOCAL.as_ptr());
    c.timeout_ms = 10_000;
    c
}

/// This thread's last error message.
pub fn message() -> String {
    // SAFETY: gw_last_error_message returns this thread's live NUL-terminated string.
    unsafe { CStr::from_ptr(gw_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Panics with the code's name and the message unless `rc` is GW_OK.
#[track_caller]
pub fn ok(rc: i32) {
    assert_eq!(
        rc,
        GW_OK,
        "{}: {}",
        // SAFETY: gw_error_name returns a static string.
        unsafe { CStr::from_ptr(gw_error_name(rc)) }.to_string_lossy(),
        message()
    );
}

/// Asserts `rc` is `want` with a non-empty message, which it returns.
#[track_caller]
pub fn fails(rc: i32, want: i32) -> String {
    let m = message();
    assert_eq!(rc, want, "message: {m}");
    assert!(!m.is_empty(), "code {rc} without a message");
    m
}

/// An owned session handle, freed on drop (also when a test panics).
#[derive(Debug)]
pub struct Session(pub *mut gw_session);

// SAFETY: a gw_session may move between threads (it is used by one at a time); the tests
// that share one across threads do so on purpose, to check GW_ERR_BUSY.
unsafe impl Send for Session {}
// SAFETY: as above: concurrent calls are refused by the library with GW_ERR_BUSY.
unsafe impl Sync for Session {}

impl Session {
    /// `gw_all_reduce` of `x` (f32, sum, default options, no report): its return code.
    pub fn sum_f32(&self, x: &mut [f32]) -> std::ffi::c_int {
        // SAFETY: a live session (owned by self) and a buffer of x.len() f32.
        unsafe {
            gw_all_reduce(
                self.0,
                x.as_mut_ptr().cast(),
                x.len(),
                GW_DTYPE_F32,
                GW_OP_SUM,
                ptr::null(),
                ptr::null_mut(),
            )
        }
    }

    pub fn rendezvous(cfg: &gw_config, master: &CStr) -> Session {
        let mut s = ptr::null_mut();
        // SAFETY: valid config, C string and out-pointer.
        ok(unsafe { gw_session_rendezvous(cfg, master.as_ptr(), &mut s) });
        assert!(!s.is_null());
        Session(s)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: from a gw_session_* call, freed once here.
        unsafe { gw_session_free(self.0) };
    }
}

/// Runs `f(rank, session)` on `world` threads, each with a session set up by rendezvous.
pub fn with_sessions<T: Send>(
    world: u32,
    tweak: impl Fn(&mut gw_config) + Sync,
    f: impl Fn(u32, &Session) -> T + Sync,
) -> Vec<T> {
    let port = MasterPort::reserve();
    let m = port.master();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (m, f, tweak) = (&m, &f, &tweak);
                sc.spawn(move || {
                    let mut c = config(r, world);
                    tweak(&mut c);
                    let s = Session::rendezvous(&c, m);
                    f(r, &s)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank r's element e of the all-reduce tests: small integers, exact sums in f32.
pub fn input(rank: u32, e: usize) -> f32 {
    ((rank as usize * 7 + e * 3) % 11) as f32
}

/// One end of a two-thread barrier that never hangs: `sync` returns once the other end has
/// called it too, and panics if the other end is gone (its thread panicked) or 30 s pass.
pub struct Meet {
    tx: std::sync::mpsc::Sender<()>,
    rx: std::sync::mpsc::Receiver<()>,
}

impl Meet {
    /// The two ends.
    pub fn pair() -> (Meet, Meet) {
        let (tx0, rx1) = std::sync::mpsc::channel();
        let (tx1, rx0) = std::sync::mpsc::channel();
        (Meet { tx: tx0, rx: rx0 }, Meet { tx: tx1, rx: rx1 })
    }

    #[track_caller]
    pub fn sync(&self) {
        // A send fails only when the other end is gone, which the receive reports.
        let _ = self.tx.send(());
        self.rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the other thread failed (see its panic) or did not come within 30 s");
    }
}
