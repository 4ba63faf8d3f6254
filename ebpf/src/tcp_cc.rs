//! DCTCP (RFC 8257) as a BPF TCP congestion control, for the kernel-TCP baselines.
//!
//! The kernel this project runs on has no `tcp_dctcp` module, but it has BPF struct_ops:
//! `src/bpf/dctcp.bpf.c` is DCTCP written from RFC 8257 as a `tcp_congestion_ops` named
//! [`DCTCP_NAME`] (`gw_dctcp`), and [`Dctcp::register`] loads and registers it.
//!
//! ```no_run
//! use std::net::TcpStream;
//! use gradwire_ebpf::tcp_cc::{self, Dctcp};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dctcp = Dctcp::register()?; // now listed in tcp_available_congestion_control
//! let sock = TcpStream::connect("198.18.0.2:5000")?;
//! tcp_cc::set_congestion_control(&sock, tcp_cc::DCTCP_NAME)?;
//! // ... transfer ...
//! if let Some(stats) = dctcp.socket_stats(&sock)? {
//!     println!("alpha {:.3}, ECN {}", stats.alpha(), stats.ecn_negotiated());
//! }
//! drop(dctcp); // unregisters; sockets still using it keep it until they close
//! # Ok(())
//! # }
//! ```
//!
//! # Scope of a registration
//!
//! A TCP congestion control is registered for the whole kernel, not per network namespace:
//! once registered, every namespace lists it in `/proc/sys/net/ipv4/tcp_available_congestion_control`
//! and any socket may select it. Only one registration per name can exist; a second
//! [`Dctcp::register`] (in this process or another) fails with
//! [`TcpCcError::AlreadyRegistered`]. A process that needs DCTCP registers it once and shares
//! the [`Dctcp`] among its users (it is `Send + Sync`, e.g. in an `Arc`).
//!
//! The registration belongs to a bpf_link owned by the [`Dctcp`]: dropping it, calling
//! [`Dctcp::unregister`] or the process dying in any way unregisters the name. Sockets that
//! already use `gw_dctcp` keep it (the kernel holds the programs until they close or switch).
//!
//! # Selecting it
//!
//! Per socket with `setsockopt(TCP_CONGESTION, "gw_dctcp")` ([`set_congestion_control`]):
//! on the connecting socket, and on the listening socket for the accepted side, which inherits
//! it. Or per namespace with `net.ipv4.tcp_congestion_control` (per namespace since Linux
//! 4.15). Selecting a congestion control that is not in `net.ipv4.tcp_allowed_congestion_control`
//! needs `CAP_NET_ADMIN` (the loader does not mark it unrestricted).
//!
//! # ECN
//!
//! The congestion control carries the kernel's "needs ECN" flag (`TCP_CONG_NEEDS_ECN`): a
//! socket using it requests ECN in its SYN whatever `net.ipv4.tcp_ecn` says, and sends ECT(0)
//! on every packet, pure ACKs and retransmissions included. The listener accepts ECN when
//! either its namespace's `net.ipv4.tcp_ecn` is non-zero (the default, 2, accepts ECN when
//! asked) or the listening socket itself uses `gw_dctcp`; only with `tcp_ecn = 0` in the
//! listener's namespace *and* another congestion control on the listener is ECN refused, and
//! the connection then runs DCTCP without marks (like Reno). DCTCP's receiver half (echoing
//! exactly which segments were CE-marked) only runs where the accepted socket uses
//! `gw_dctcp`, so both ends should select it.
//!
//! # Observing it
//!
//! [`Dctcp::counters`] sums the program's counters over all sockets; [`Dctcp::socket_stats`]
//! reads one socket's (kept in BPF socket storage, looked up by the socket's descriptor),
//! including its current DCTCP.Alpha and whether ECN was negotiated.

use std::ffi::OsStr;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd};

use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, MapType, Object, ObjectBuilder};
use nix::errno::Errno;

use crate::error::{hint_suffix, libbpf_errno};
use crate::Aligned;

#[allow(dead_code)]
mod consts {
    include!(concat!(env!("OUT_DIR"), "/dctcp_consts.rs"));
}
use consts::*;

/// Name under which [`Dctcp::register`] registers DCTCP (what `setsockopt(TCP_CONGESTION)`
/// takes).
pub const DCTCP_NAME: &str = "gw_dctcp";

/// DCTCP's estimation gain g (RFC 8257's recommended 1/16).
pub const DCTCP_G: f64 = 1.0 / (1u32 << GW_DCTCP_G_SHIFT) as f64;

/// The fixed-point 1.0 of [`DctcpSocketStats::alpha_fixed`].
pub const DCTCP_ALPHA_ONE: u32 = GW_DCTCP_ALPHA_ONE;

/// Where the kernel lists the registered congestion controls.
pub const AVAILABLE_PATH: &str = "/proc/sys/net/ipv4/tcp_available_congestion_control";

static OBJECT: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/dctcp.bpf.o")));

/// The struct_ops map (the `tcp_congestion_ops` variable in the C source).
const OPS_MAP: &str = "gw_dctcp";
const SOCKS_MAP: &str = "gw_dctcp_socks";
const TOTALS_MAP: &str = "gw_dctcp_totals";
const NUM_COUNTERS: usize = GW_DCTCP_NUM_COUNTERS as usize;
/// Size of `struct gw_dctcp_sock_stats`: the counters, then alpha and ecn_flags (u32 each).
const SOCK_STATS_LEN: usize = 8 * NUM_COUNTERS + 8;
/// `TCP_ECN_OK` in `tcp_sock.ecn_flags`: RFC 3168 ECN negotiated on the connection.
const TCP_ECN_OK: u32 = 1;
/// `TCP_ECN_SEEN` in `tcp_sock.ecn_flags`: an ECT or CE packet has been received.
const TCP_ECN_SEEN: u32 = 8;

/// What went wrong registering, unregistering or observing a congestion control.
///
/// Errors from the kernel keep its code ([`TcpCcError::raw_os_error`]); their message ends
/// with what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpCcError {
    /// The name is already registered (by another [`Dctcp`], here or in another process).
    #[error(
        "a TCP congestion control named {name} is already registered in this kernel \
         (registration is kernel-wide, not per network namespace): another gradwire process \
         or another Dctcp in this one holds it. Share that registration, or end its owner \
         (the name goes away when its bpf_link is closed)"
    )]
    AlreadyRegistered {
        /// The congestion control name.
        name: &'static str,
    },

    /// The kernel said EPERM or EACCES.
    #[error("{op}: permission denied: {source}{}", hint_suffix(source.raw_os_error()))]
    PermissionDenied {
        /// What was being done.
        op: String,
        /// The kernel's answer.
        source: io::Error,
    },

    /// libbpf could not open or load the object (the verifier log, if any, is on stderr).
    #[error(
        "loading the {DCTCP_NAME} BPF object: {source}{}; it needs a kernel with BTF \
         (/sys/kernel/btf/vmlinux), BPF struct_ops for tcp_congestion_ops (Linux 6.4+ for \
         links) and the BPF JIT",
        hint_suffix(libbpf_errno(source))
    )]
    Load {
        /// The libbpf error.
        source: libbpf_rs::Error,
    },

    /// Creating the struct_ops link (the registration) failed.
    #[error(
        "registering TCP congestion control {name}: {source}{}",
        hint_suffix(libbpf_errno(source))
    )]
    Register {
        /// The congestion control name.
        name: &'static str,
        /// The libbpf error.
        source: libbpf_rs::Error,
    },

    /// Detaching the struct_ops link failed, or the name stayed listed afterwards.
    #[error("unregistering TCP congestion control {name}: {source}")]
    Unregister {
        /// The congestion control name.
        name: &'static str,
        /// The kernel's answer (or `Other` when the name was still listed).
        source: io::Error,
    },

    /// The loaded object does not look like what this loader was built for.
    #[error("{DCTCP_NAME} object layout mismatch: {0}")]
    Layout(String),

    /// A map operation failed.
    #[error("{op} on BPF map {map}: {source}{}", hint_suffix(libbpf_errno(source)))]
    Map {
        /// Map name.
        map: &'static str,
        /// What was being done.
        op: String,
        /// The libbpf error.
        source: libbpf_rs::Error,
    },

    /// Reading the list of registered congestion controls failed.
    #[error("reading {AVAILABLE_PATH}: {source}")]
    Available {
        /// The io error.
        source: io::Error,
    },

    /// `setsockopt`/`getsockopt(TCP_CONGESTION)` failed.
    #[error("{op}: {source}{}", socket_hint(*source))]
    Socket {
        /// What was being done, with the name.
        op: String,
        /// The kernel's answer.
        source: nix::Error,
    },
}

/// The hint for a failed `TCP_CONGESTION` socket option.
fn socket_hint(e: nix::Error) -> String {
    match e {
        Errno::ENOENT => "; hint: no congestion control of that name is registered: register \
                          it first (Dctcp::register) and check tcp_available_congestion_control"
            .into(),
        Errno::EPERM => "; hint: a congestion control outside \
                         net.ipv4.tcp_allowed_congestion_control needs CAP_NET_ADMIN"
            .into(),
        other => hint_suffix(Some(other as i32)),
    }
}

impl TcpCcError {
    /// The kernel's error code (`errno`) behind this error, when it came from the kernel.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            TcpCcError::AlreadyRegistered { .. } => Some(Errno::EEXIST as i32),
            TcpCcError::PermissionDenied { source, .. }
            | TcpCcError::Unregister { source, .. }
            | TcpCcError::Available { source } => source.raw_os_error(),
            TcpCcError::Load { source }
            | TcpCcError::Register { source, .. }
            | TcpCcError::Map { source, .. } => libbpf_errno(source),
            TcpCcError::Socket { source, .. } => Some(*source as i32),
            TcpCcError::Layout(_) => None,
        }
    }

    /// EPERM/EACCES from libbpf as [`TcpCcError::PermissionDenied`], else through `other`.
    fn from_libbpf(
        op: &str,
        e: libbpf_rs::Error,
        other: impl FnOnce(libbpf_rs::Error) -> TcpCcError,
    ) -> TcpCcError {
        match libbpf_errno(&e).map(Errno::from_raw) {
            Some(errno @ (Errno::EPERM | Errno::EACCES)) => TcpCcError::PermissionDenied {
                op: op.to_owned(),
                source: io::Error::from_raw_os_error(errno as i32),
            },
            _ => other(e),
        }
    }
}

/// The congestion controls registered in the kernel (the same list in every namespace).
pub fn available() -> Result<Vec<String>, TcpCcError> {
    let text = std::fs::read_to_string(AVAILABLE_PATH)
        .map_err(|source| TcpCcError::Available { source })?;
    Ok(text.split_whitespace().map(str::to_owned).collect())
}

/// Whether a congestion control called `name` is registered.
pub fn is_registered(name: &str) -> Result<bool, TcpCcError> {
    Ok(available()?.iter().any(|n| n == name))
}

/// Selects congestion control `name` on a TCP socket (`setsockopt(TCP_CONGESTION)`). On a
/// listening socket, accepted sockets inherit it.
pub fn set_congestion_control(sock: &impl AsFd, name: &str) -> Result<(), TcpCcError> {
    nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::TcpCongestion, &name.into())
        .map_err(|source| TcpCcError::Socket {
            op: format!("selecting TCP congestion control {name}"),
            source,
        })
}

/// The congestion control a TCP socket uses (`getsockopt(TCP_CONGESTION)`).
pub fn congestion_control(sock: &impl AsFd) -> Result<String, TcpCcError> {
    let name = nix::sys::socket::getsockopt(sock, nix::sys::socket::sockopt::TcpCongestion)
        .map_err(|source| TcpCcError::Socket {
            op: "reading the TCP congestion control".into(),
            source,
        })?;
    Ok(name.to_string_lossy().into_owned())
}

/// What the DCTCP program counted, over all sockets ([`Dctcp::counters`]) or for one
/// ([`DctcpSocketStats::counters`]). Sender-side counters count on the sending socket,
/// receiver-side ones on the receiving socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DctcpCounters {
    /// Sockets that started using `gw_dctcp`.
    pub sockets: u64,
    /// Bytes newly acknowledged (the sum of RFC 8257's DCTCP.BytesAcked).
    pub acked_bytes: u64,
    /// Of those, bytes acknowledged by ACKs with ECE set (DCTCP.BytesMarked).
    pub marked_bytes: u64,
    /// Observation windows closed, each one DCTCP.Alpha update.
    pub windows: u64,
    /// Windows in which some bytes were marked.
    pub marked_windows: u64,
    /// Window reductions computed (ssthresh: on ECE, or first on a loss).
    pub reductions: u64,
    /// Entries into fast recovery or RTO recovery, where the reduction became a halving.
    pub loss_episodes: u64,
    /// Receiver: changes between CE-marked and unmarked arriving segments.
    pub ce_flips: u64,
    /// Receiver: immediate ACKs sent at such a change for the segments before it.
    pub flip_acks: u64,
}

impl DctcpCounters {
    fn from_slice(v: &[u64; NUM_COUNTERS]) -> DctcpCounters {
        let g = |i: u32| v[i as usize];
        DctcpCounters {
            sockets: g(GW_DCTCP_SOCKETS),
            acked_bytes: g(GW_DCTCP_ACKED_BYTES),
            marked_bytes: g(GW_DCTCP_MARKED_BYTES),
            windows: g(GW_DCTCP_WINDOWS),
            marked_windows: g(GW_DCTCP_MARKED_WINDOWS),
            reductions: g(GW_DCTCP_REDUCTIONS),
            loss_episodes: g(GW_DCTCP_LOSS_EPISODES),
            ce_flips: g(GW_DCTCP_CE_FLIPS),
            flip_acks: g(GW_DCTCP_FLIP_ACKS),
        }
    }

    /// Fraction of acknowledged bytes that were marked (0 when nothing was acknowledged).
    pub fn marked_fraction(&self) -> f64 {
        if self.acked_bytes == 0 {
            0.0
        } else {
            self.marked_bytes as f64 / self.acked_bytes as f64
        }
    }
}

/// One socket's DCTCP state and counters ([`Dctcp::socket_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DctcpSocketStats {
    /// This socket's counters.
    pub counters: DctcpCounters,
    /// DCTCP.Alpha as the program keeps it: a fraction of [`DCTCP_ALPHA_ONE`].
    pub alpha_fixed: u32,
    /// The socket's `ecn_flags` as of its last ACK.
    pub ecn_flags: u32,
}

impl DctcpSocketStats {
    fn decode(bytes: &[u8]) -> Option<DctcpSocketStats> {
        if bytes.len() != SOCK_STATS_LEN {
            return None;
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[8 * i..8 * i + 8]);
            u64::from_ne_bytes(b)
        };
        let u32_at = |off: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&bytes[off..off + 4]);
            u32::from_ne_bytes(b)
        };
        let counts: [u64; NUM_COUNTERS] = std::array::from_fn(u64_at);
        Some(DctcpSocketStats {
            counters: DctcpCounters::from_slice(&counts),
            alpha_fixed: u32_at(8 * NUM_COUNTERS),
            ecn_flags: u32_at(8 * NUM_COUNTERS + 4),
        })
    }

    /// DCTCP.Alpha, 0.0 to 1.0.
    pub fn alpha(&self) -> f64 {
        f64::from(self.alpha_fixed) / f64::from(DCTCP_ALPHA_ONE)
    }

    /// Whether the connection negotiated ECN (RFC 3168 mode).
    pub fn ecn_negotiated(&self) -> bool {
        self.ecn_flags & TCP_ECN_OK != 0
    }

    /// Whether the socket has received ECN-capable (ECT or CE) packets, as of its last ACK.
    pub fn ect_received(&self) -> bool {
        self.ecn_flags & TCP_ECN_SEEN != 0
    }
}

/// DCTCP's Alpha after `windows` observation windows without a marked byte, starting from 1.0,
/// in the program's fixed-point arithmetic: `alpha -= alpha >> 4` per window (RFC 8257 with
/// g = 1/16 and M = 0). For checking the program against the RFC's recurrence.
pub fn alpha_after_unmarked_windows(windows: u64) -> u32 {
    let mut alpha = DCTCP_ALPHA_ONE;
    for _ in 0..windows {
        let next = alpha - (alpha >> GW_DCTCP_G_SHIFT);
        if next == alpha {
            break; // below 16/65536 the shift rounds to zero and alpha stays
        }
        alpha = next;
    }
    alpha
}

/// DCTCP registered as TCP congestion control [`DCTCP_NAME`]; dropping it unregisters.
pub struct Dctcp {
    // Field order is drop order: the link (the registration) goes first.
    link: Option<Link>,
    socks: MapHandle,
    totals: MapHandle,
    _obj: Object,
}

impl fmt::Debug for Dctcp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dctcp")
            .field("name", &DCTCP_NAME)
            .field("registered", &self.link.is_some())
            .finish_non_exhaustive()
    }
}

impl Dctcp {
    /// Loads `gw_dctcp` and registers it for the whole kernel. Fails with
    /// [`TcpCcError::AlreadyRegistered`] when the name is taken, and with
    /// [`TcpCcError::PermissionDenied`] without root (or `CAP_BPF` + `CAP_NET_ADMIN`).
    pub fn register() -> Result<Dctcp, TcpCcError> {
        // The kernel refuses a duplicate too (EEXIST, below); asking first avoids loading the
        // object and libbpf's warning on stderr in the common case.
        if is_registered(DCTCP_NAME)? {
            return Err(TcpCcError::AlreadyRegistered { name: DCTCP_NAME });
        }
        let open = ObjectBuilder::default()
            .open_memory(&OBJECT.0)
            .map_err(|source| TcpCcError::Load { source })?;
        let mut obj = open.load().map_err(|e| {
            TcpCcError::from_libbpf("loading the DCTCP programs", e, |source| TcpCcError::Load {
                source,
            })
        })?;
        let socks = map_handle(&obj, SOCKS_MAP, MapType::SkStorage, SOCK_STATS_LEN)?;
        let totals = map_handle(&obj, TOTALS_MAP, MapType::PercpuArray, 8)?;
        let link = {
            let mut ops = obj
                .maps_mut()
                .find(|m| m.name() == OsStr::new(OPS_MAP))
                .ok_or_else(|| TcpCcError::Layout(format!("map {OPS_MAP} is missing")))?;
            ops.attach_struct_ops().map_err(|e| {
                if libbpf_errno(&e) == Some(Errno::EEXIST as i32) {
                    return TcpCcError::AlreadyRegistered { name: DCTCP_NAME };
                }
                TcpCcError::from_libbpf("registering the congestion control", e, |source| {
                    TcpCcError::Register {
                        name: DCTCP_NAME,
                        source,
                    }
                })
            })?
        };
        Ok(Dctcp {
            link: Some(link),
            socks,
            totals,
            _obj: obj,
        })
    }

    /// The registered name, [`DCTCP_NAME`].
    pub fn name(&self) -> &'static str {
        DCTCP_NAME
    }

    /// Unregisters now, reporting errors (dropping unregisters too, reporting on stderr).
    /// Afterwards the name is gone from [`available`].
    pub fn unregister(mut self) -> Result<(), TcpCcError> {
        self.unlink()
    }

    fn unlink(&mut self) -> Result<(), TcpCcError> {
        let Some(link) = self.link.take() else {
            return Ok(());
        };
        // bpf_link_detach unregisters at once, even if a copy of the link fd lives on in a
        // child process; closing (the drop) then frees the link.
        let detached = link.detach();
        drop(link);
        if let Err(e) = detached {
            let source = libbpf_errno(&e)
                .map(io::Error::from_raw_os_error)
                .unwrap_or_else(|| io::Error::other(e.to_string()));
            return Err(TcpCcError::Unregister {
                name: DCTCP_NAME,
                source,
            });
        }
        if is_registered(DCTCP_NAME)? {
            return Err(TcpCcError::Unregister {
                name: DCTCP_NAME,
                source: io::Error::other(format!("still listed in {AVAILABLE_PATH}")),
            });
        }
        Ok(())
    }

    /// The counters summed over all sockets that used this registration, and over CPUs. Not
    /// atomic across counters.
    pub fn counters(&self) -> Result<DctcpCounters, TcpCcError> {
        let mut v = [0u64; NUM_COUNTERS];
        for (idx, slot) in (0u32..).zip(v.iter_mut()) {
            let per_cpu = self
                .totals
                .lookup_percpu(&idx.to_ne_bytes(), MapFlags::ANY)
                .map_err(|source| TcpCcError::Map {
                    map: TOTALS_MAP,
                    op: format!("per-CPU lookup of index {idx}"),
                    source,
                })?;
            for cpu in per_cpu.iter().flatten() {
                let mut b = [0u8; 8];
                if cpu.len() == 8 {
                    b.copy_from_slice(cpu);
                }
                *slot += u64::from_ne_bytes(b);
            }
        }
        Ok(DctcpCounters::from_slice(&v))
    }

    /// The DCTCP state of one TCP socket of this process; `None` when it never used
    /// `gw_dctcp` under this registration (or its storage could not be allocated).
    pub fn socket_stats(&self, sock: &impl AsFd) -> Result<Option<DctcpSocketStats>, TcpCcError> {
        let fd = sock.as_fd().as_raw_fd();
        let value = self
            .socks
            .lookup(&fd.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| TcpCcError::Map {
                map: SOCKS_MAP,
                op: format!("lookup of socket fd {fd}"),
                source,
            })?;
        match value {
            None => Ok(None),
            Some(bytes) => DctcpSocketStats::decode(&bytes).map(Some).ok_or_else(|| {
                TcpCcError::Layout(format!(
                    "{SOCKS_MAP} value is {} bytes, expected {SOCK_STATS_LEN}",
                    bytes.len()
                ))
            }),
        }
    }
}

impl Drop for Dctcp {
    fn drop(&mut self) {
        if let Err(e) = self.unlink() {
            eprintln!("gradwire-ebpf: {e}");
        }
    }
}

/// A map of the loaded object by name, checked for its type and value size.
fn map_handle(
    obj: &Object,
    name: &'static str,
    kind: MapType,
    value_size: usize,
) -> Result<MapHandle, TcpCcError> {
    let map = obj
        .maps()
        .find(|m| m.name() == OsStr::new(name))
        .ok_or_else(|| TcpCcError::Layout(format!("map {name} is missing")))?;
    let handle = MapHandle::try_from(&map).map_err(|source| TcpCcError::Map {
        map: name,
        op: "duplicating the map fd".into(),
        source,
    })?;
    if handle.map_type() != kind || handle.value_size() as usize != value_size {
        return Err(TcpCcError::Layout(format!(
            "map {name} is a {:?} with {}-byte values, this loader expects a {kind:?} with \
             {value_size}-byte values",
            handle.map_type(),
            handle.value_size()
        )));
    }
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alpha_decays_by_one_sixteenth_per_unmarked_window() {
        assert_eq!(alpha_after_unmarked_windows(0), DCTCP_ALPHA_ONE);
        assert_eq!(alpha_after_unmarked_windows(1), 65536 - 4096);
        assert_eq!(alpha_after_unmarked_windows(2), 61440 - 3840);
        // (15/16)^n, within the rounding of the shift.
        let exact = f64::from(DCTCP_ALPHA_ONE) * (15.0f64 / 16.0).powi(20);
        let got = f64::from(alpha_after_unmarked_windows(20));
        assert!((got - exact).abs() < 20.0, "{got} vs {exact}");
        // It settles where the shift rounds to zero instead of reaching 0.
        assert_eq!(alpha_after_unmarked_windows(10_000), 15);
        assert!((DCTCP_G - 1.0 / 16.0).abs() < f64::EPSILON);
    }

    #[test]
    fn socket_stats_decode_the_c_layout() {
        let mut bytes = Vec::new();
        for i in 0..NUM_COUNTERS as u64 {
            bytes.extend_from_slice(&(i + 1).to_ne_bytes());
        }
        bytes.extend_from_slice(&(DCTCP_ALPHA_ONE / 4).to_ne_bytes());
        bytes.extend_from_slice(&5u32.to_ne_bytes());
        let s = DctcpSocketStats::decode(&bytes).unwrap_or_else(|| panic!("decodes"));
        assert_eq!(s.counters.sockets, 1);
        assert_eq!(s.counters.acked_bytes, 2);
        assert_eq!(s.counters.marked_bytes, 3);
        assert_eq!(s.counters.flip_acks, 9);
        assert!((s.alpha() - 0.25).abs() < 1e-9);
        assert!(s.ecn_negotiated());
        assert!(DctcpSocketStats::decode(&bytes[1..]).is_none());
    }

    #[test]
    fn a_registration_can_be_shared_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Dctcp>();
    }

    #[test]
    fn errors_say_what_to_do() {
        let e = TcpCcError::AlreadyRegistered { name: DCTCP_NAME };
        assert_eq!(e.raw_os_error(), Some(Errno::EEXIST as i32));
        assert!(e.to_string().contains("not per network namespace"), "{e}");
        let e = TcpCcError::Socket {
            op: "selecting TCP congestion control gw_dctcp".into(),
            source: Errno::ENOENT,
        };
        assert!(e.to_string().contains("Dctcp::register"), "{e}");
        assert_eq!(e.raw_os_error(), Some(Errno::ENOENT as i32));
    }
}
