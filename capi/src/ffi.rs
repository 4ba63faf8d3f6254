//! The exported functions: the only place that reads C pointers. Each function's body runs in
//! `guard` (no panic reaches C), checks every pointer for NULL, and turns the C arguments
//! into the session's types before calling it.
#![allow(unsafe_code, non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::slice;
use std::sync::{Mutex, MutexGuard, TryLockError};

use gradwire_session::{Endpoint, PriorityFn, SegmentInfo, Session, Tag, MAX_ENDPOINT_LEN};

use crate::error::{self, guard, guard_value, CError, GW_ERR_BUSY, GW_ERR_SETUP, GW_ERR_UNUSABLE};
use crate::types::{
    self, byte_len, dtype_code, gw_allgather_fn, gw_broadcast_report, gw_config, gw_dtype, gw_op,
    gw_op_options, gw_p2p_options, gw_priority_fn, gw_recv_report, gw_reduce_report,
    gw_segment_info, gw_send_report, gw_tag,
};

/// A job's session on this rank: the links to the other ranks. Made by gw_session_rendezvous,
/// gw_session_init or gw_endpoint_connect; freed by gw_session_free.
#[derive(Debug)]
pub struct gw_session {
    rank: u32,
    world: u32,
    state: Mutex<SessionState>,
}

#[derive(Debug)]
struct SessionState {
    session: Session,
    /// The last all-reduce's per-block and per-rank delivered fractions.
    block_delivered: Vec<f64>,
    rank_delivered: Vec<f64>,
    /// The last broadcast's per-block flags: whether the block holds the root's values.
    broadcast_received: Vec<bool>,
    /// The last receive's missing byte ranges `(offset, length)`.
    recv_missing: Vec<(u64, usize)>,
}

/// This rank's bound sockets before the address exchange (two-phase set-up). Made by
/// gw_endpoint_bind; freed by gw_endpoint_free.
#[derive(Debug)]
pub struct gw_endpoint {
    endpoint: Option<Endpoint>,
    /// The configured world: the number of entries gw_endpoint_connect must be given.
    world: usize,
}

impl gw_session {
    fn new(session: Session) -> *mut gw_session {
        let (rank, world) = (session.rank(), session.world());
        Box::into_raw(Box::new(gw_session {
            rank: u32::try_from(rank).unwrap_or(u32::MAX),
            world: u32::try_from(world).unwrap_or(u32::MAX),
            state: Mutex::new(SessionState {
                session,
                block_delivered: Vec::new(),
                rank_delivered: Vec::new(),
                broadcast_received: Vec::new(),
                recv_missing: Vec::new(),
            }),
        }))
    }

    /// The session for one call, or GW_ERR_BUSY / GW_ERR_UNUSABLE. Never waits: see the
    /// header's thread-safety notes.
    fn lock(&self) -> Result<MutexGuard<'_, SessionState>, CError> {
        let g =
            match self.state.try_lock() {
                Ok(g) => g,
                Err(TryLockError::WouldBlock) => {
                    return Err(CError::new(
                        GW_ERR_BUSY,
                        "another thread is inside a call on this session: a gw_session is used by \
                     one thread at a time (use one session per thread, or serialise the calls)",
                    ))
                }
                Err(TryLockError::Poisoned(_)) => return Err(CError::new(
                    GW_ERR_UNUSABLE,
                    "an earlier call on this session failed with GW_ERR_INTERNAL: free it with \
                     gw_session_free and build a new session",
                )),
            };
        // The unit tests' way to make a call panic mid-operation (not in the library users
        // get: no panic trigger ships).
        #[cfg(test)]
        tests::panic_if_armed();
        Ok(g)
    }
}

/// `&T` from a pointer the caller promises is NULL or valid.
///
/// # Safety
/// `p` is NULL or points at a live, initialised `T` not mutated during `'a`.
unsafe fn deref<'a, T>(p: *const T, what: &str) -> Result<&'a T, CError> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| CError::null(what))
}

/// A `&str` from a C string.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string living during `'a`.
unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, CError> {
    if p.is_null() {
        return Err(CError::null(what));
    }
    // SAFETY: non-NULL and, by the caller's contract, NUL-terminated and live.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| {
        CError::new(
            error::GW_ERR_UTF8,
            format!("{what} is not valid UTF-8: {:?}", s.to_string_lossy()),
        )
    })
}

/// Writes `v` through an out-pointer.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
unsafe fn write_out<T>(p: *mut T, v: T, what: &str) -> Result<(), CError> {
    if p.is_null() {
        return Err(CError::null(what));
    }
    // SAFETY: non-NULL and, by the caller's contract, writable; `write` drops nothing there.
    unsafe { p.write(v) };
    Ok(())
}

/// Writes `v` if `p` is not NULL (optional reports).
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
unsafe fn write_opt<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: non-NULL and, by the caller's contract, writable.
        unsafe { p.write(v) };
    }
}

/// `count` elements of `dtype` at `buf` as bytes; NULL is allowed for zero elements.
///
/// # Safety
/// `buf` is NULL or valid for reads and writes of `count` elements of `dtype`, not otherwise
/// accessed during `'a`.
unsafe fn buf_mut<'a>(
    buf: *mut c_void,
    count: usize,
    dtype: gw_dtype,
) -> Result<(gradwire_session::DType, &'a mut [u8]), CError> {
    let dt = types::dtype(dtype)?;
    let len = byte_len(count, dt)?;
    if len == 0 {
        return Ok((dt, &mut []));
    }
    if buf.is_null() {
        return Err(CError::null("buf"));
    }
    // SAFETY: non-NULL, and the caller's contract covers `len` = count * element size bytes
    // (overflow checked above), exclusively ours during the call.
    Ok((dt, unsafe {
        slice::from_raw_parts_mut(buf.cast::<u8>(), len)
    }))
}

/// Like [`buf_mut`], read-only.
///
/// # Safety
/// `buf` is NULL or valid for reads of `count` elements of `dtype` during `'a`.
unsafe fn buf_ref<'a>(
    buf: *const c_void,
    count: usize,
    dtype: gw_dtype,
) -> Result<(gradwire_session::DType, &'a [u8]), CError> {
    let dt = types::dtype(dtype)?;
    let len = byte_len(count, dt)?;
    if len == 0 {
        return Ok((dt, &[]));
    }
    if buf.is_null() {
        return Err(CError::null("buf"));
    }
    // SAFETY: non-NULL, and the caller's contract covers `len` bytes (overflow checked above).
    Ok((dt, unsafe { slice::from_raw_parts(buf.cast::<u8>(), len) }))
}

/// The session configuration a `gw_config` describes.
///
/// # Safety
/// `cfg` is NULL or valid; its `ip` and `secret` pointers are NULL or valid (see gw_config).
unsafe fn session_config(cfg: *const gw_config) -> Result<gradwire_session::SessionConfig, CError> {
    // SAFETY: the caller's contract.
    let cfg = unsafe { deref(cfg, "cfg") }?;
    // SAFETY: the caller's contract on gw_config.ip.
    let ip = unsafe { c_str(cfg.ip, "gw_config.ip") }?;
    let secret = if cfg.secret.is_null() {
        if cfg.secret_len != 0 {
            return Err(CError::null("gw_config.secret (with secret_len > 0)"));
        }
        None
    } else {
        // SAFETY: non-NULL and, by the caller's contract, `secret_len` readable bytes.
        Some(unsafe { slice::from_raw_parts(cfg.secret, cfg.secret_len) })
    };
    cfg.to_session(ip, secret)
}

/// The session's address of a rendezvous master given as text.
fn master_addr(master: &str) -> Result<std::net::SocketAddr, CError> {
    gradwire::addr::resolve(master).map_err(|e| {
        CError::invalid(format!(
            "rendezvous master: {e} (give rank 0's \"IP:port\", the same on every rank)"
        ))
    })
}

/// The version of the gradwire C library, e.g. "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn gw_version() -> *const c_char {
    static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    VERSION.as_ptr().cast()
}

/// The message of this thread's last failed call: what failed and what to do. An empty
/// string after a successful call. The pointer is valid until this thread's next gradwire
/// call returning int; copy the text to keep it.
#[no_mangle]
pub extern "C" fn gw_last_error_message() -> *const c_char {
    guard_value(
        c"internal error reading the last error".as_ptr(),
        error::last_message,
    )
}

/// The rank at fault in this thread's last failed call (GW_ERR_PEER mostly), or -1.
#[no_mangle]
pub extern "C" fn gw_last_error_peer() -> c_int {
    guard_value(-1, error::last_peer)
}

/// The name of an error code ("GW_ERR_PEER", ...), a static string; "GW_ERR_UNKNOWN" for an
/// unknown code.
#[no_mangle]
pub extern "C" fn gw_error_name(code: c_int) -> *const c_char {
    let name = match error::code_name(code) {
        "GW_OK" => c"GW_OK",
        "GW_ERR_INVALID_ARGUMENT" => c"GW_ERR_INVALID_ARGUMENT",
        "GW_ERR_SETUP" => c"GW_ERR_SETUP",
        "GW_ERR_PEER" => c"GW_ERR_PEER",
        "GW_ERR_UNUSABLE" => c"GW_ERR_UNUSABLE",
        "GW_ERR_DATA" => c"GW_ERR_DATA",
        "GW_ERR_INTERNAL" => c"GW_ERR_INTERNAL",
        "GW_ERR_NULL" => c"GW_ERR_NULL",
        "GW_ERR_UTF8" => c"GW_ERR_UTF8",
        "GW_ERR_BUSY" => c"GW_ERR_BUSY",
        _ => c"GW_ERR_UNKNOWN",
    };
    name.as_ptr()
}

/// A configuration with gradwire's defaults for rank `rank` of `world` ranks at address `ip`
/// (the pointer is stored, not copied: keep the string alive until the config is used).
#[no_mangle]
pub extern "C" fn gw_config_default(rank: u32, world: u32, ip: *const c_char) -> gw_config {
    let fallback = gw_config {
        job: 1,
        rank,
        world,
        ip,
        loss_bound: 0.0,
        timeout_ms: 30_000,
        point_to_point: true,
        inject_loss: 0.0,
        seed: 0,
        rate_bps: 0,
        secret: std::ptr::null(),
        secret_len: 0,
        mtu: 0,
    };
    guard_value(fallback, || gw_config::defaults(rank, world, ip))
}

/// Default options of an all-reduce or broadcast: the session's loss bound, layer 0, unknown
/// number of layers, the layer's DSCP.
#[no_mangle]
pub extern "C" fn gw_op_options_default() -> gw_op_options {
    gw_op_options::default()
}

/// Default options of a send or receive: tensor 0, layer 0, unknown number of layers (DSCP 0
/// with the default tagging), the session's loss bound.
#[no_mangle]
pub extern "C" fn gw_p2p_options_default() -> gw_p2p_options {
    gw_p2p_options::default()
}

/// Sets up a session with gradwire's own rendezvous: rank 0 serves it at `master` ("IP:port"
/// or "host:port", the same string on every rank), every rank connects to it. Blocks until
/// every rank has joined and every link is up, or cfg->timeout_ms passes.
///
/// # Safety
/// `cfg` points at a valid gw_config (its ip a C string, its secret NULL or secret_len
/// bytes); `master` is a C string; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_session_rendezvous(
    cfg: *const gw_config,
    master: *const c_char,
    out: *mut *mut gw_session,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(CError::null("out"));
        }
        // SAFETY: the caller's contract.
        let cfg = unsafe { session_config(cfg) }?;
        // SAFETY: the caller's contract.
        let master = master_addr(unsafe { c_str(master, "master") }?)?;
        let session = Session::rendezvous(cfg, master)?;
        // SAFETY: checked non-NULL above; writable by the caller's contract.
        unsafe { write_out(out, gw_session::new(session), "out") }
    })
}

/// Two-phase set-up, phase 1: binds this rank's sockets. Exchange gw_endpoint_address() with
/// every other rank yourself (MPI_Allgatherv, a key-value store, ...), then call
/// gw_endpoint_connect().
///
/// # Safety
/// `cfg` points at a valid gw_config; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_endpoint_bind(
    cfg: *const gw_config,
    out: *mut *mut gw_endpoint,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(CError::null("out"));
        }
        // SAFETY: the caller's contract.
        let cfg = unsafe { session_config(cfg) }?;
        let world = cfg.world;
        let endpoint = Endpoint::bind(cfg)?;
        let ep = Box::into_raw(Box::new(gw_endpoint {
            endpoint: Some(endpoint),
            world,
        }));
        // SAFETY: checked non-NULL above; writable by the caller's contract.
        unsafe { write_out(out, ep, "out") }
    })
}

/// This rank's address: opaque bytes (at most 64 KiB) every rank must receive. `*bytes` stays
/// valid until gw_endpoint_connect or gw_endpoint_free on `ep`.
///
/// # Safety
/// `ep` is NULL or from gw_endpoint_bind and not freed; `bytes` and `len` are writable.
#[no_mangle]
pub unsafe extern "C" fn gw_endpoint_address(
    ep: *const gw_endpoint,
    bytes: *mut *const u8,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let ep = unsafe { deref(ep, "ep") }?;
        if bytes.is_null() || len.is_null() {
            return Err(CError::null(if bytes.is_null() { "bytes" } else { "len" }));
        }
        let endpoint = ep.endpoint.as_ref().ok_or_else(connected)?;
        let a = endpoint.address();
        // SAFETY: both checked non-NULL above; writable by the caller's contract.
        unsafe {
            bytes.write(a.as_ptr());
            len.write(a.len());
        }
        Ok(())
    })
}

fn connected() -> CError {
    CError::invalid(
        "this endpoint was already passed to gw_endpoint_connect: bind a new one with \
         gw_endpoint_bind",
    )
}

/// Two-phase set-up, phase 2: `addrs[r]` (`lens[r]` bytes) is rank r's gw_endpoint_address(),
/// for every rank r < world (the world `ep` was bound with), this rank's own included. Blocks
/// until every link is up or the timeout passes. Refused before anything is set up, leaving
/// `ep` as it was: a NULL pointer (GW_ERR_NULL), a `world` other than the configured one
/// (GW_ERR_INVALID_ARGUMENT), an address longer than 64 KiB (GW_ERR_SETUP: a rank's address
/// never is, so the exchange mixed something up). Otherwise, whether it succeeds or fails,
/// `ep` is spent (it cannot be connected again) but must still be freed with
/// gw_endpoint_free.
///
/// # Safety
/// `ep` is NULL or from gw_endpoint_bind and not freed; `addrs` and `lens` are arrays of
/// `world` entries, each `addrs[r]` valid for `lens[r]` bytes; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_endpoint_connect(
    ep: *mut gw_endpoint,
    addrs: *const *const u8,
    lens: *const usize,
    world: usize,
    out: *mut *mut gw_session,
) -> c_int {
    guard(|| {
        if ep.is_null() {
            return Err(CError::null("ep"));
        }
        if out.is_null() {
            return Err(CError::null("out"));
        }
        // SAFETY: non-NULL, from gw_endpoint_bind, used by this thread only (the contract).
        let ep = unsafe { &mut *ep };
        if ep.endpoint.is_none() {
            return Err(connected());
        }
        // Before allocating anything for `world` entries: it must be the configured world.
        if world != ep.world {
            return Err(CError::invalid(format!(
                "world is {world} but the endpoint was bound for a {}-rank job: pass one address \
                 per rank (addrs and lens of gw_config.world entries)",
                ep.world
            )));
        }
        if addrs.is_null() || lens.is_null() {
            return Err(CError::null(if addrs.is_null() { "addrs" } else { "lens" }));
        }
        let mut table = Vec::with_capacity(world);
        for r in 0..world {
            // SAFETY: `addrs` and `lens` hold `world` entries (caller's contract), r < world.
            let (p, n) = unsafe { (*addrs.add(r), *lens.add(r)) };
            if p.is_null() {
                return Err(CError::null(&format!("addrs[{r}]")));
            }
            // The lengths come from other ranks through the caller's exchange: a wrong one
            // must be refused before it sizes a slice over the caller's memory.
            if n > MAX_ENDPOINT_LEN {
                return Err(CError::new(
                    GW_ERR_SETUP,
                    format!(
                        "lens[{r}] is {n} bytes, but an address is at most {MAX_ENDPOINT_LEN}: \
                         check that the exchange gives every rank's gw_endpoint_address() \
                         bytes and length, in rank order"
                    ),
                ));
            }
            // SAFETY: non-NULL and valid for `n` bytes by the caller's contract.
            table.push(unsafe { slice::from_raw_parts(p, n) }.to_vec());
        }
        let endpoint = ep.endpoint.take().ok_or_else(connected)?;
        let session = endpoint.connect(&table)?;
        // SAFETY: checked non-NULL above; writable by the caller's contract.
        unsafe { write_out(out, gw_session::new(session), "out") }
    })
}

/// Frees an endpoint (NULL is fine). Its address bytes are invalid afterwards.
///
/// # Safety
/// `ep` is NULL or from gw_endpoint_bind and not yet freed, and no other thread uses it.
#[no_mangle]
pub unsafe extern "C" fn gw_endpoint_free(ep: *mut gw_endpoint) {
    if ep.is_null() {
        return;
    }
    guard_value((), || {
        // SAFETY: from Box::into_raw in gw_endpoint_bind, freed once (the caller's contract).
        drop(unsafe { Box::from_raw(ep) });
    });
}

/// Sets up a session with the caller's own all-gather (see gw_allgather_fn): binds, gathers
/// every rank's address through `allgather`, and connects. Blocks until every link is up or
/// the timeout passes.
///
/// # Safety
/// `cfg` points at a valid gw_config; `allgather` honours the gw_allgather_fn contract with
/// `ctx`; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_session_init(
    cfg: *const gw_config,
    allgather: gw_allgather_fn,
    ctx: *mut c_void,
    out: *mut *mut gw_session,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(CError::null("out"));
        }
        let allgather = allgather.ok_or_else(|| CError::null("allgather"))?;
        // SAFETY: the caller's contract.
        let cfg = unsafe { session_config(cfg) }?;
        let world = cfg.world;
        let endpoint = Endpoint::bind(cfg)?;
        let gather = |mine: &[u8], len: usize| -> Result<Vec<u8>, CError> {
            let total = world
                .checked_mul(len)
                .ok_or_else(|| CError::invalid("world * address length overflows"))?;
            let mut all = vec![0u8; total];
            // SAFETY: `mine` holds `len` bytes and `all` world * len writable bytes, as the
            // gw_allgather_fn contract says; the callback returns before they are dropped.
            let rc = unsafe { allgather(ctx, mine.as_ptr(), len, all.as_mut_ptr()) };
            if rc != 0 {
                return Err(CError::new(
                    GW_ERR_SETUP,
                    format!("the all-gather callback failed (returned {rc})"),
                ));
            }
            Ok(all)
        };
        let address = endpoint.address();
        let lens = gather(&(address.len() as u64).to_le_bytes(), 8)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX)
            })
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest > MAX_ENDPOINT_LEN {
            return Err(CError::new(
                GW_ERR_SETUP,
                format!(
                    "the all-gather callback returned an address length of {longest} bytes \
                     (at most {MAX_ENDPOINT_LEN}): check that it gathers `len` bytes from \
                     every rank, in rank order"
                ),
            ));
        }
        let mut mine = address.to_vec();
        mine.resize(longest, 0);
        let all = gather(&mine, longest)?;
        let table: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * longest..r * longest + n].to_vec())
            .collect();
        let session = endpoint.connect(&table)?;
        // SAFETY: checked non-NULL above; writable by the caller's contract.
        unsafe { write_out(out, gw_session::new(session), "out") }
    })
}

/// Frees a session and closes its links (NULL is fine). Every rank should free its session
/// after its last operation; a peer still inside an operation with this rank then fails with
/// GW_ERR_PEER.
///
/// # Safety
/// `s` is NULL or from a gw_session_* / gw_endpoint_connect call and not yet freed, and no
/// other thread uses it.
#[no_mangle]
pub unsafe extern "C" fn gw_session_free(s: *mut gw_session) {
    if s.is_null() {
        return;
    }
    guard_value((), || {
        // SAFETY: from Box::into_raw in gw_session::new, freed once (the caller's contract).
        drop(unsafe { Box::from_raw(s) });
    });
}

/// This session's rank.
///
/// # Safety
/// `s` is NULL or a live session; `rank` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_session_rank(s: *const gw_session, rank: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s, "s") }?;
        // SAFETY: the caller's contract.
        unsafe { write_out(rank, s.rank, "rank") }
    })
}

/// This session's number of ranks.
///
/// # Safety
/// `s` is NULL or a live session; `world` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_session_world(s: *const gw_session, world: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s, "s") }?;
        // SAFETY: the caller's contract.
        unsafe { write_out(world, s.world, "world") }
    })
}

/// All-reduce in place: `buf` holds `count` elements of `dtype` (F32, F16 or BF16) and ends
/// up with the reduction over every rank. Every rank calls it with the same count, dtype, op
/// and options. With a loss bound > 0 some blocks may miss some ranks' contributions (see
/// GW_OP_SUM); `report` (NULL: not wanted) says how much arrived, and
/// gw_last_block_delivered()/gw_last_rank_delivered() give the details.
///
/// On an argument error (GW_ERR_NULL, GW_ERR_INVALID_ARGUMENT), GW_ERR_BUSY or
/// GW_ERR_UNUSABLE, `buf` is untouched. After GW_ERR_PEER, GW_ERR_DATA or GW_ERR_INTERNAL the
/// operation stopped part-way: `buf` holds partial values (some elements reduced, some not;
/// unspecified), so restore it from your own copy if you need the input again.
///
/// # Safety
/// `s` is NULL or a live session; `buf` is NULL (count 0 only) or valid for reads and writes
/// of `count` elements; `opts` is NULL or valid; `report` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gw_all_reduce(
    s: *mut gw_session,
    buf: *mut c_void,
    count: usize,
    dtype: gw_dtype,
    op: gw_op,
    opts: *const gw_op_options,
    report: *mut gw_reduce_report,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s.cast_const(), "s") }?;
        let op = types::op(op)?;
        // SAFETY: the caller's contract; NULL means the defaults.
        let opts = unsafe { opts.as_ref() }
            .copied()
            .unwrap_or_default()
            .to_session(op)?;
        // SAFETY: the caller's contract.
        let (dt, bytes) = unsafe { buf_mut(buf, count, dtype) }?;
        let mut st = s.lock()?;
        let r = st.session.all_reduce(dt, bytes, &opts)?;
        // SAFETY: the caller's contract.
        unsafe { write_opt(report, gw_reduce_report::from(&r)) };
        st.block_delivered = r.block_delivered;
        st.rank_delivered = r.rank_delivered;
        Ok(())
    })
}

/// Copies up to `cap` values into `out` and sets `*len` to how many there are in total.
///
/// # Safety
/// `out` is NULL (cap 0) or writable for `cap` values; `len` is writable.
unsafe fn copy_values<T: Copy>(
    v: &[T],
    out: *mut T,
    cap: usize,
    len: *mut usize,
) -> Result<(), CError> {
    if len.is_null() {
        return Err(CError::null("len"));
    }
    if out.is_null() && cap > 0 {
        return Err(CError::null("out (with cap > 0)"));
    }
    let n = v.len().min(cap);
    if n > 0 {
        // SAFETY: `out` is non-NULL and writable for cap >= n values (the caller's contract);
        // `v` is ours, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, n) };
    }
    // SAFETY: checked non-NULL above.
    unsafe { len.write(v.len()) };
    Ok(())
}

/// The last successful gw_all_reduce's per-block delivered fractions (ranks summed / world;
/// block b = elements [b * block_elems, ...)): copies min(cap, blocks) values into `out` and
/// sets `*len` to the number of blocks. Call with out = NULL, cap = 0 to get the length.
/// Before any all-reduce, `*len` is 0.
///
/// # Safety
/// `s` is NULL or a live session; `out` is NULL (cap 0) or writable for `cap` doubles; `len`
/// is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_last_block_delivered(
    s: *const gw_session,
    out: *mut f64,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s, "s") }?;
        let st = s.lock()?;
        // SAFETY: the caller's contract.
        unsafe { copy_values(&st.block_delivered, out, cap, len) }
    })
}

/// The last successful gw_all_reduce's per-rank delivered fractions (the fraction of blocks
/// rank r's contribution reached), like gw_last_block_delivered: `*len` is the world size
/// (0 before any all-reduce).
///
/// # Safety
/// As gw_last_block_delivered.
#[no_mangle]
pub unsafe extern "C" fn gw_last_rank_delivered(
    s: *const gw_session,
    out: *mut f64,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s, "s") }?;
        let st = s.lock()?;
        // SAFETY: the caller's contract.
        unsafe { copy_values(&st.rank_delivered, out, cap, len) }
    })
}

/// Broadcast in place from rank `root` (below the world size): every rank's `buf` (`count`
/// elements of `dtype`, the same on every rank) ends up with root's. `opts` as for
/// gw_all_reduce (NULL: defaults). With a loss bound > 0 some blocks may keep their previous
/// contents: `report` counts them and gw_last_broadcast_received() says which. On an error,
/// `buf` is as after a failed gw_all_reduce: untouched after an argument error, partly the
/// root's values (unspecified) after GW_ERR_PEER, GW_ERR_DATA or GW_ERR_INTERNAL.
///
/// # Safety
/// As gw_all_reduce.
#[no_mangle]
pub unsafe extern "C" fn gw_broadcast(
    s: *mut gw_session,
    root: u32,
    buf: *mut c_void,
    count: usize,
    dtype: gw_dtype,
    opts: *const gw_op_options,
    report: *mut gw_broadcast_report,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s.cast_const(), "s") }?;
        // SAFETY: the caller's contract; NULL means the defaults.
        let opts = unsafe { opts.as_ref() }
            .copied()
            .unwrap_or_default()
            .to_session(Default::default())?;
        // SAFETY: the caller's contract.
        let (dt, bytes) = unsafe { buf_mut(buf, count, dtype) }?;
        let mut st = s.lock()?;
        let r = st.session.broadcast(root as usize, dt, bytes, &opts)?;
        // SAFETY: the caller's contract.
        unsafe { write_opt(report, gw_broadcast_report::from(&r)) };
        st.broadcast_received = r.block_received;
        Ok(())
    })
}

/// The last successful gw_broadcast's per-block flags: whether block b (elements
/// [b * block_elems, ...), see gw_broadcast_report) holds the root's values (true) or kept
/// this rank's previous contents (false, only with a loss bound > 0). Copies min(cap, blocks)
/// flags into `out` and sets `*len` to the number of blocks, like gw_last_block_delivered.
/// Before any broadcast, `*len` is 0.
///
/// # Safety
/// `s` is NULL or a live session; `out` is NULL (cap 0) or writable for `cap` bools; `len`
/// is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_last_broadcast_received(
    s: *const gw_session,
    out: *mut bool,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s, "s") }?;
        let st = s.lock()?;
        // SAFETY: the caller's contract.
        unsafe { copy_values(&st.broadcast_received, out, cap, len) }
    })
}

/// Waits until every rank has entered the barrier.
///
/// # Safety
/// `s` is NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn gw_barrier(s: *mut gw_session) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s.cast_const(), "s") }?;
        s.lock()?.session.barrier()?;
        Ok(())
    })
}

/// The C priority function and its context, callable from gradwire's sending threads.
struct CPriority {
    f: unsafe extern "C" fn(*mut c_void, *const gw_segment_info) -> gw_tag,
    ctx: *mut c_void,
}

// SAFETY: gw_priority_fn's documented contract: the function and `ctx` may be used from any
// thread, several at once, during the gw_send that was given them.
unsafe impl Sync for CPriority {}

impl CPriority {
    fn tag(&self, seg: &SegmentInfo<'_>) -> Tag {
        let info = gw_segment_info {
            index: seg.index,
            offset: seg.offset,
            layer: seg.layer,
            dtype: dtype_code(seg.dtype),
            payload: seg.payload.as_ptr(),
            len: seg.payload.len(),
        };
        // SAFETY: `info` and the payload it points at live during the call; the function and
        // ctx honour gw_priority_fn's contract (the caller of gw_send promised so).
        let t = unsafe { (self.f)(self.ctx, &info) };
        Tag {
            dscp: t.dscp & 0x3f,
            ect: t.ect,
        }
    }
}

/// DLCP's send of one tensor to rank `peer`: `count` elements of `dtype` (any dtype) at
/// `buf`, copied once. Each segment is tagged by `priority` (called with `ctx`; see
/// gw_priority_fn), or, if it is NULL, by DLCP's default tagging: the DSCP of
/// opts->layer of opts->num_layers (front layers more urgent; num_layers 0: DSCP 0), and
/// ECN-capable by gradient magnitude. Returns when the receiver has what its loss bound asks
/// for.
///
/// # Safety
/// `s` is NULL or a live session; `buf` is NULL (count 0 only) or valid for reads of `count`
/// elements; `opts` is NULL or valid; `priority` and `ctx` honour gw_priority_fn's contract;
/// `report` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gw_send(
    s: *mut gw_session,
    peer: u32,
    buf: *const c_void,
    count: usize,
    dtype: gw_dtype,
    opts: *const gw_p2p_options,
    priority: gw_priority_fn,
    ctx: *mut c_void,
    report: *mut gw_send_report,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s.cast_const(), "s") }?;
        // SAFETY: the caller's contract; NULL means the defaults.
        let opts = unsafe { opts.as_ref() }
            .copied()
            .unwrap_or_default()
            .to_session();
        // SAFETY: the caller's contract.
        let (dt, bytes) = unsafe { buf_ref(buf, count, dtype) }?;
        let cprio = priority.map(|f| CPriority { f, ctx });
        let closure = cprio
            .as_ref()
            .map(|p| move |seg: &SegmentInfo<'_>| p.tag(seg));
        let prio: Option<&PriorityFn<'_>> = closure.as_ref().map(|c| c as &PriorityFn<'_>);
        let mut st = s.lock()?;
        let r = st.session.send(peer as usize, dt, bytes, &opts, prio)?;
        // SAFETY: the caller's contract.
        unsafe { write_opt(report, gw_send_report::from(&r)) };
        Ok(())
    })
}

/// DLCP's receive of one tensor from rank `peer` into `buf` (`count` elements of `dtype`, the
/// sender's count and dtype). Returns once at least 1 - loss bound of the segments arrived;
/// the missing ones are zero-filled. `report` (NULL: not wanted) says how much arrived and
/// gw_last_recv_missing() which byte ranges are missing. `buf` is written only on success.
///
/// # Safety
/// `s` is NULL or a live session; `buf` is NULL (count 0 only) or valid for writes of
/// `count` elements; `opts` is NULL or valid; `report` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gw_recv(
    s: *mut gw_session,
    peer: u32,
    buf: *mut c_void,
    count: usize,
    dtype: gw_dtype,
    opts: *const gw_p2p_options,
    report: *mut gw_recv_report,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s.cast_const(), "s") }?;
        // SAFETY: the caller's contract; NULL means the defaults.
        let opts = unsafe { opts.as_ref() }
            .copied()
            .unwrap_or_default()
            .to_session();
        // SAFETY: the caller's contract.
        let (dt, bytes) = unsafe { buf_mut(buf, count, dtype) }?;
        let mut st = s.lock()?;
        let r = st.session.recv(peer as usize, dt, bytes, &opts)?;
        // SAFETY: the caller's contract.
        unsafe { write_opt(report, gw_recv_report::from(&r)) };
        st.recv_missing = r.missing;
        Ok(())
    })
}

/// The byte ranges the last successful gw_recv did not get (they are zero in its buffer):
/// range i is `lens[i]` bytes from byte `offsets[i]`, in increasing order. Copies min(cap,
/// ranges) of them into `offsets` and `lens` and sets `*len` to the number of ranges (0 when
/// everything arrived, or before any gw_recv); call with NULL arrays and cap 0 to get it.
///
/// # Safety
/// `s` is NULL or a live session; `offsets` and `lens` are NULL (cap 0) or writable for `cap`
/// values each; `len` is writable.
#[no_mangle]
pub unsafe extern "C" fn gw_last_recv_missing(
    s: *const gw_session,
    offsets: *mut u64,
    lens: *mut usize,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { deref(s, "s") }?;
        if len.is_null() {
            return Err(CError::null("len"));
        }
        if cap > 0 && (offsets.is_null() || lens.is_null()) {
            return Err(CError::null(if offsets.is_null() {
                "offsets (with cap > 0)"
            } else {
                "lens (with cap > 0)"
            }));
        }
        let st = s.lock()?;
        let missing = &st.recv_missing;
        for (i, &(off, n)) in missing.iter().take(cap).enumerate() {
            // SAFETY: non-NULL (cap > 0 here) and writable for cap > i values (the contract).
            unsafe {
                offsets.add(i).write(off);
                lens.add(i).write(n);
            }
        }
        // SAFETY: checked non-NULL above.
        unsafe { len.write(missing.len()) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::ptr;

    thread_local! {
        static PANIC_IN_NEXT_CALL: Cell<bool> = const { Cell::new(false) };
    }

    /// Panics once, inside the session's lock, after `arm()` on this thread.
    pub(super) fn panic_if_armed() {
        if PANIC_IN_NEXT_CALL.with(|p| p.replace(false)) {
            panic!("test hook: a bug inside a session call");
        }
    }

    fn arm() {
        PANIC_IN_NEXT_CALL.with(|p| p.set(true));
    }

    fn message() -> String {
        // SAFETY: this thread's live NUL-terminated message.
        unsafe { CStr::from_ptr(gw_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_inside_an_exported_call_is_gw_err_internal_then_the_session_is_unusable() {
        // A 1-rank job set up in two phases: a real session with no peer to wait for.
        let cfg = gw_config_default(0, 1, c"127.0.0.1".as_ptr());
        let (mut ep, mut s) = (ptr::null_mut(), ptr::null_mut());
        let (mut p, mut n) = (ptr::null(), 0);
        // SAFETY: valid config, out-pointers, a live endpoint, a table of its 1 address.
        unsafe {
            assert_eq!(
                gw_endpoint_bind(&cfg, &mut ep),
                error::GW_OK,
                "{}",
                message()
            );
            assert_eq!(gw_endpoint_address(ep, &mut p, &mut n), error::GW_OK);
            assert_eq!(
                gw_endpoint_connect(ep, &p, &n, 1, &mut s),
                error::GW_OK,
                "{}",
                message()
            );
            gw_endpoint_free(ep);
        }
        // SAFETY: a live session.
        assert_eq!(unsafe { gw_barrier(s) }, error::GW_OK, "{}", message());

        arm();
        // SAFETY: a live session; the call panics inside (the hook), which must not unwind
        // out of the extern "C" function.
        let rc = unsafe { gw_barrier(s) };
        assert_eq!(rc, error::GW_ERR_INTERNAL, "{}", message());
        let m = message();
        assert!(
            m.contains("internal error in gradwire") && m.contains("test hook: a bug"),
            "{m}"
        );
        assert_eq!(gw_last_error_peer(), -1);
        // The panic left the session half-way: every later operation says so.
        let mut x = [1.0f32; 4];
        // SAFETY: a live session and a buffer of 4 f32.
        let rc = unsafe {
            gw_all_reduce(
                s,
                x.as_mut_ptr().cast(),
                4,
                types::GW_DTYPE_F32,
                types::GW_OP_SUM,
                ptr::null(),
                ptr::null_mut(),
            )
        };
        assert_eq!(rc, GW_ERR_UNUSABLE, "{}", message());
        assert!(message().contains("GW_ERR_INTERNAL"), "{}", message());
        // SAFETY: a live session.
        assert_eq!(unsafe { gw_barrier(s) }, GW_ERR_UNUSABLE);
        // What needs no lock still works, and the session frees normally.
        let mut rank = 7;
        // SAFETY: a live session and a writable u32.
        assert_eq!(unsafe { gw_session_rank(s, &mut rank) }, error::GW_OK);
        assert_eq!(rank, 0);
        // SAFETY: freed once.
        unsafe { gw_session_free(s) };
    }
}
