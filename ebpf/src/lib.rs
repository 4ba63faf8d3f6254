//! gradwire's XDP classifier and its loader, and DCTCP as a BPF TCP congestion control
//! ([`tcp_cc`], for the kernel-TCP baselines).
//!
//! The XDP program (`src/bpf/gradwire.bpf.c`, built by `build.rs` with clang as part of the
//! normal cargo build) looks at every frame an interface receives and:
//!
//! - passes everything that is not gradwire traffic to the kernel untouched (`XDP_PASS`): ARP,
//!   ssh, the TCP control channel, other UDP, IPv4 fragments, IPv6 with extension headers;
//! - for gradwire traffic (UDP to one of [`XdpConfig::ports`], over IPv4 or IPv6, with at most
//!   one VLAN tag): drops truncated packets, counts packets and bytes per (DSCP, ECN) pair,
//!   applies the optional allowlist of peer addresses and the optional per-DSCP fault
//!   injection, then redirects the packet to the AF_XDP socket registered for its receive
//!   queue ([`XdpProgram::register_xsk`]), or gives it to the kernel when there is none.
//!
//! The exact decision order and the counters are documented in `README.md` and on
//! [`XdpCounters`]. Map layouts come from one C header shared with this crate (see the
//! `layout` module).
//!
//! # Example
//!
//! ```no_run
//! use gradwire_ebpf::{AttachMode, XdpConfig, XdpProgram};
//!
//! # fn main() -> Result<(), gradwire_ebpf::XdpError> {
//! let mut config = XdpConfig::new(vec![7000]);
//! config.mode = AttachMode::Auto;
//! config.fault_drop[46] = 0.01; // 1% loss on EF, for a loss test
//! let prog = XdpProgram::attach("eth0", &config)?;
//! println!("attached in {:?} mode", prog.attach_mode());
//! // prog.register_xsk(queue_id, xsk_socket.as_fd())? for each AF_XDP socket
//! let counters = prog.counters()?;
//! println!("{} CE-marked gradwire packets", counters.ce_packets);
//! prog.detach()?; // or just drop it
//! # Ok(())
//! # }
//! ```
//!
//! # Lifetime of an attachment
//!
//! [`XdpProgram::attach`] attaches through a bpf_link, in native (driver) mode or generic
//! (skb) mode. A bpf_link belongs to its file descriptor: the kernel detaches the program when
//! the last descriptor is closed, which includes the process dying in any way (SIGKILL, a
//! Ctrl-C that is not handled, a panic with `panic = "abort"`). On top of that:
//!
//! - dropping the [`XdpProgram`] (normal exit, early return, panic unwinding) detaches it;
//! - [`XdpProgram::detach`] detaches explicitly and reports errors.
//!
//! The library does not install signal handlers (it cannot own the process's signals). An
//! application that wants an orderly Ctrl-C (final counters, log line) catches SIGINT itself
//! and calls [`XdpProgram::detach`] or drops the program; if it does not, the kernel still
//! detaches when the process dies. A program attached by netlink (e.g. `ip link set xdp`)
//! would outlive the process: this loader never does that.
//!
//! # Network namespaces
//!
//! Interface names and indices are resolved, and attachments made, in the network namespace
//! of the calling *thread*, so a test can attach inside a namespace it created by entering it
//! with `setns` on one thread.
//!
//! # Privileges
//!
//! Loading and attaching need root (or `CAP_BPF` + `CAP_NET_ADMIN`); without them the error is
//! [`XdpError::PermissionDenied`]. [`query_attached`] works unprivileged.
//!
//! # Errors
//!
//! An error the kernel returned keeps its code ([`XdpError::raw_os_error`]), and its message
//! ends with what to do about it: [`error::hint`], shared with gradwire's AF_XDP sockets.

mod config;
mod counters;
pub mod error;
mod layout;
mod sys;
pub mod tcp_cc;

use std::ffi::OsStr;
use std::fmt;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use libbpf_rs::{MapCore, MapFlags, MapHandle, Object, ObjectBuilder, ProgramInput};

pub use config::{AttachMode, XdpAttachedMode, XdpConfig, ALLOWLIST_CAPACITY, MAX_PORTS, NUM_DSCP};
pub use counters::{ClassCounter, Counter, XdpCounters};
pub use error::XdpError;
pub use tcp_cc::{Dctcp, TcpCcError};

use layout::*;

/// XDP verdict: error in the program (the kernel drops the frame).
pub const XDP_ABORTED: u32 = 0;
/// XDP verdict: drop.
pub const XDP_DROP: u32 = 1;
/// XDP verdict: to the kernel network stack.
pub const XDP_PASS: u32 = 2;
/// XDP verdict: send back out of the same interface (never used by this program).
pub const XDP_TX: u32 = 3;
/// XDP verdict: redirected (here: to an AF_XDP socket).
pub const XDP_REDIRECT: u32 = 4;

/// Most receive queues (XSKMAP slots); queue ids are `0..MAX_QUEUES`.
pub const MAX_QUEUES: u32 = GW_MAX_QUEUES;
/// Length of the gradwire header the classifier requires after the UDP header.
pub const GRADWIRE_HEADER_LEN: usize = GW_HDR_LEN as usize;

const PROG_NAME: &str = "gradwire_xdp";

/// A BPF object built by build.rs. libbpf parses it in place, so keep it 8-byte aligned
/// like an ELF file read from disk would be.
#[repr(C, align(8))]
pub(crate) struct Aligned<B: ?Sized>(pub(crate) B);
static OBJECT: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/gradwire.bpf.o")));

/// An interface, by name or by index (in the calling thread's network namespace).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Iface {
    /// Interface name, e.g. `eth0`.
    Name(String),
    /// Interface index.
    Index(u32),
}

impl From<&str> for Iface {
    fn from(s: &str) -> Self {
        Iface::Name(s.to_owned())
    }
}

impl From<String> for Iface {
    fn from(s: String) -> Self {
        Iface::Name(s)
    }
}

impl From<&String> for Iface {
    fn from(s: &String) -> Self {
        Iface::Name(s.clone())
    }
}

impl From<u32> for Iface {
    fn from(i: u32) -> Self {
        Iface::Index(i)
    }
}

impl fmt::Display for Iface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Iface::Name(n) => f.write_str(n),
            Iface::Index(i) => write!(f, "ifindex {i}"),
        }
    }
}

/// `(ifindex, ifname)` of an interface in this thread's namespace.
fn resolve(iface: &Iface) -> Result<(u32, String), XdpError> {
    let no_such = |source| XdpError::NoSuchInterface {
        iface: iface.to_string(),
        source,
    };
    match iface {
        Iface::Name(name) => {
            let index = nix::net::if_::if_nametoindex(name.as_str()).map_err(no_such)?;
            Ok((index, name.clone()))
        }
        Iface::Index(index) => {
            let name = nix::net::if_::if_indextoname(*index).map_err(no_such)?;
            // nix 0.31 reports an unknown index as Ok with an empty name.
            if name.is_empty() {
                return Err(no_such(nix::Error::ENODEV));
            }
            Ok((*index, name.to_string_lossy().into_owned()))
        }
    }
}

/// An XDP program found on an interface.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AttachedXdp {
    /// Interface name.
    pub ifname: String,
    /// Interface index.
    pub ifindex: u32,
    /// Kernel program id (for several programs, the first of driver, generic, offload).
    pub prog_id: u32,
    /// How it is attached.
    pub mode: XdpAttachedMode,
}

fn attached_from_query(q: sys::XdpQuery, ifindex: u32, ifname: &str) -> Option<AttachedXdp> {
    let mode = match q.attach_mode {
        sys::XDP_ATTACHED_NONE => return None,
        sys::XDP_ATTACHED_DRV => XdpAttachedMode::Native,
        sys::XDP_ATTACHED_SKB => XdpAttachedMode::Generic,
        sys::XDP_ATTACHED_HW => XdpAttachedMode::Offload,
        _ => XdpAttachedMode::Multi,
    };
    let prog_id = [q.prog_id, q.drv_prog_id, q.skb_prog_id, q.hw_prog_id]
        .into_iter()
        .find(|id| *id != 0)
        .unwrap_or(0);
    Some(AttachedXdp {
        ifname: ifname.to_owned(),
        ifindex,
        prog_id,
        mode,
    })
}

fn query_resolved(ifindex: u32, ifname: &str) -> Result<Option<AttachedXdp>, XdpError> {
    let q = sys::xdp_query(ifindex).map_err(|source| XdpError::Query {
        ifname: ifname.to_owned(),
        source,
    })?;
    Ok(attached_from_query(q, ifindex, ifname))
}

/// The XDP program attached to `iface`, if any (netlink query; needs no privilege).
pub fn query_attached(iface: impl Into<Iface>) -> Result<Option<AttachedXdp>, XdpError> {
    let (ifindex, ifname) = resolve(&iface.into())?;
    query_resolved(ifindex, &ifname)
}

fn already_attached(a: AttachedXdp) -> XdpError {
    // Best effort: reading another program's name needs CAP_SYS_ADMIN.
    let prog_name = libbpf_rs::ProgramHandle::from_prog_id(a.prog_id)
        .ok()
        .map(|h| h.name().to_string_lossy().into_owned())
        .filter(|n| !n.is_empty());
    XdpError::AlreadyAttached {
        ifname: a.ifname,
        ifindex: a.ifindex,
        prog_id: a.prog_id,
        prog_name,
        mode: a.mode,
    }
}

/// Owned handles (fds) of the object's maps, looked up once and checked against `gradwire.h`.
#[derive(Debug)]
struct Maps {
    config: MapHandle,
    xsks: MapHandle,
    allowlist: MapHandle,
    fault: MapHandle,
    classes: MapHandle,
    globals: MapHandle,
}

impl Maps {
    fn from_object(obj: &Object) -> Result<Maps, XdpError> {
        // (name, key size, value size, max_entries) as gradwire.h defines them.
        let get = |name: &'static str, key: usize, value: usize, entries: u32| {
            let map = obj
                .maps()
                .find(|m| m.name() == OsStr::new(name))
                .ok_or_else(|| XdpError::Layout(format!("map {name} is missing")))?;
            let handle = MapHandle::try_from(&map).map_err(|source| XdpError::Map {
                map: name,
                op: "duplicating the map fd".into(),
                source,
            })?;
            let found = (
                handle.key_size() as usize,
                handle.value_size() as usize,
                handle.max_entries(),
            );
            if found != (key, value, entries) {
                return Err(XdpError::Layout(format!(
                    "map {name}: (key size, value size, max_entries) is {found:?}, this loader \
                     expects {:?}",
                    (key, value, entries)
                )));
            }
            Ok(handle)
        };
        Ok(Maps {
            config: get("config", 4, CONFIG_SIZE, 1)?,
            xsks: get("xsks", 4, 4, GW_MAX_QUEUES)?,
            allowlist: get(
                "allowlist",
                ADDR_KEY_SIZE,
                ALLOW_VALUE_SIZE,
                GW_ALLOWLIST_MAX,
            )?,
            fault: get("fault", 4, FAULT_SIZE, GW_NUM_DSCP)?,
            classes: get("classes", 4, COUNTER_SIZE, GW_NUM_CLASSES)?,
            globals: get("globals", 4, COUNTER_SIZE, GW_CNT_MAX)?,
        })
    }
}

/// A live bpf_link: closing `link` (or BPF_LINK_DETACH) detaches the program.
#[derive(Debug)]
struct Attachment {
    link: OwnedFd,
    ifindex: u32,
    ifname: String,
    mode: AttachMode,
}

impl Attachment {
    fn detach(self) -> Result<(), XdpError> {
        // Explicit detach first: it takes effect even if a copy of the fd exists elsewhere.
        // Closing `link` afterwards (end of scope) releases the defunct link.
        sys::link_detach(self.link.as_fd()).map_err(|source| XdpError::Detach {
            ifname: self.ifname.clone(),
            source,
        })
    }
}

/// The loaded classifier, attached to one interface or (for tests) loaded detached.
///
/// Dropping it detaches the program and frees its maps. See the crate documentation for what
/// happens on Ctrl-C and process death.
#[derive(Debug)]
pub struct XdpProgram {
    // Field order is drop order: the link goes before the maps and the object.
    attachment: Option<Attachment>,
    maps: Maps,
    enabled: bool,
    allowlist_enabled: bool,
    switch_port: bool,
    ports: Vec<u16>,
    prog_id: u32,
    obj: Object,
}

impl XdpProgram {
    /// Loads the classifier with `config` and attaches it to `iface` in `config.mode`.
    ///
    /// Refuses with [`XdpError::AlreadyAttached`] when the interface already has any XDP
    /// program (it is queried before anything is loaded, and the kernel refuses a bpf_link
    /// over an existing program anyway). In [`AttachMode::Auto`], a failed native attach is
    /// reported on stderr in one line and generic mode is used; [`XdpProgram::attach_mode`]
    /// says which mode is in use.
    pub fn attach(iface: impl Into<Iface>, config: &XdpConfig) -> Result<XdpProgram, XdpError> {
        config.validate()?;
        let (ifindex, ifname) = resolve(&iface.into())?;
        if let Some(existing) = query_resolved(ifindex, &ifname)? {
            return Err(already_attached(existing));
        }
        let mut prog = Self::load_detached(config)?;
        let (link, mode) = prog.link(ifindex, &ifname, config.mode)?;
        prog.attachment = Some(Attachment {
            link,
            ifindex,
            ifname,
            mode,
        });
        Ok(prog)
    }

    /// Loads the classifier and fills its maps without attaching it anywhere: for
    /// [`XdpProgram::test_run`] fixtures. `config.mode` is ignored.
    pub fn load_detached(config: &XdpConfig) -> Result<XdpProgram, XdpError> {
        config.validate()?;
        let open = ObjectBuilder::default()
            .open_memory(&OBJECT.0)
            .map_err(|source| XdpError::Load { source })?;
        let obj = open.load().map_err(|e| {
            XdpError::from_libbpf("loading the XDP program", e, |source| XdpError::Load {
                source,
            })
        })?;
        let maps = Maps::from_object(&obj)?;
        let prog_id = {
            let prog = obj
                .progs()
                .find(|p| p.name() == OsStr::new(PROG_NAME))
                .ok_or_else(|| XdpError::Layout(format!("program {PROG_NAME} is missing")))?;
            libbpf_rs::Program::id_from_fd(prog.as_fd())
                .map_err(|source| XdpError::Load { source })?
        };
        let p = XdpProgram {
            attachment: None,
            maps,
            enabled: true,
            allowlist_enabled: config.allowlist.is_some(),
            switch_port: config.switch_port,
            ports: config.ports.clone(),
            prog_id,
            obj,
        };
        for addr in config.allowlist.iter().flatten() {
            p.allow(*addr)?;
        }
        for (dscp, prob) in config.fault_drop.iter().enumerate() {
            if *prob != 0.0 {
                p.write_fault(dscp, *prob)?;
            }
        }
        // Last, so the program never runs with a half-written allowlist.
        p.write_config()?;
        Ok(p)
    }

    fn program(&self) -> Result<libbpf_rs::ProgramMut<'_>, XdpError> {
        self.obj
            .progs_mut()
            .find(|p| p.name() == OsStr::new(PROG_NAME))
            .ok_or_else(|| XdpError::Layout(format!("program {PROG_NAME} is missing")))
    }

    /// Creates the bpf_link in the requested mode (with the Auto fallback).
    fn link(
        &self,
        ifindex: u32,
        ifname: &str,
        mode: AttachMode,
    ) -> Result<(OwnedFd, AttachMode), XdpError> {
        let program = self.program()?;
        let prog = program.as_fd();
        let try_mode = |m: AttachMode| -> Result<OwnedFd, XdpError> {
            let flags = match m {
                AttachMode::Generic => sys::XDP_FLAGS_SKB_MODE,
                _ => sys::XDP_FLAGS_DRV_MODE,
            };
            sys::xdp_link_create(prog, ifindex, flags).map_err(|e| {
                let op = format!("attaching XDP to {ifname} in {m} mode");
                XdpError::from_io(op, e, |source| {
                    // EBUSY/EEXIST: someone attached a program since the query.
                    if matches!(
                        source.raw_os_error().map(nix::errno::Errno::from_raw),
                        Some(nix::errno::Errno::EBUSY | nix::errno::Errno::EEXIST)
                    ) {
                        if let Ok(Some(existing)) = query_resolved(ifindex, ifname) {
                            return already_attached(existing);
                        }
                    }
                    XdpError::Attach {
                        ifname: ifname.to_owned(),
                        mode: m,
                        source,
                    }
                })
            })
        };
        match mode {
            AttachMode::Native | AttachMode::Generic => Ok((try_mode(mode)?, mode)),
            AttachMode::Auto => match try_mode(AttachMode::Native) {
                Ok(fd) => Ok((fd, AttachMode::Native)),
                Err(e @ (XdpError::PermissionDenied { .. } | XdpError::AlreadyAttached { .. })) => {
                    Err(e)
                }
                Err(e) => {
                    eprintln!("gradwire-ebpf: {e}; falling back to generic (skb) mode on {ifname}");
                    Ok((try_mode(AttachMode::Generic)?, AttachMode::Generic))
                }
            },
        }
    }

    /// The mode in use ([`AttachMode::Native`] or [`AttachMode::Generic`]); `None` when loaded
    /// detached or after [`XdpProgram::detach`].
    pub fn attach_mode(&self) -> Option<AttachMode> {
        self.attachment.as_ref().map(|a| a.mode)
    }

    /// Name of the interface the program is attached to.
    pub fn ifname(&self) -> Option<&str> {
        self.attachment.as_ref().map(|a| a.ifname.as_str())
    }

    /// Index of the interface the program is attached to.
    pub fn ifindex(&self) -> Option<u32> {
        self.attachment.as_ref().map(|a| a.ifindex)
    }

    /// Kernel id of the loaded program (what `bpf_xdp_query` / `bpftool` show).
    pub fn prog_id(&self) -> u32 {
        self.prog_id
    }

    /// Detaches from the interface now, reporting errors (dropping detaches too, silently
    /// except for a line on stderr). The maps go away with `self`.
    pub fn detach(mut self) -> Result<(), XdpError> {
        match self.attachment.take() {
            Some(a) => a.detach(),
            None => Ok(()),
        }
    }

    fn write_config(&self) -> Result<(), XdpError> {
        let value = encode_config(
            self.enabled,
            self.allowlist_enabled,
            self.switch_port,
            &self.ports,
        );
        self.maps
            .config
            .update(&0u32.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "config",
                op: "update of key 0".into(),
                source,
            })
    }

    /// Turns classification on or off; off passes every frame to the kernel (counted as
    /// `passed`).
    pub fn set_enabled(&mut self, enabled: bool) -> Result<(), XdpError> {
        self.enabled = enabled;
        self.write_config()
    }

    /// Turns the source allowlist on or off (its entries are kept).
    pub fn set_allowlist_enabled(&mut self, enabled: bool) -> Result<(), XdpError> {
        self.allowlist_enabled = enabled;
        self.write_config()
    }

    /// Registers the AF_XDP socket `fd` for receive queue `queue_id`: gradwire packets arriving
    /// on that queue are redirected to it. The socket must have its UMEM, fill ring and RX ring
    /// set up (the kernel refuses others with EOPNOTSUPP). The map keeps its own reference:
    /// call [`XdpProgram::unregister_xsk`] before closing the socket to stop redirection.
    pub fn register_xsk(&self, queue_id: u32, fd: BorrowedFd<'_>) -> Result<(), XdpError> {
        check_queue(queue_id)?;
        let raw = u32::try_from(fd.as_raw_fd())
            .map_err(|_| XdpError::InvalidConfig(format!("invalid fd {}", fd.as_raw_fd())))?;
        self.maps
            .xsks
            .update(&queue_id.to_ne_bytes(), &raw.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "xsks",
                op: format!(
                    "registering fd {raw} for queue {queue_id} (must be an AF_XDP socket with \
                     UMEM, fill ring and RX ring)"
                ),
                source,
            })
    }

    /// Removes the socket of `queue_id`; its gradwire packets go to the kernel again.
    /// Removing an empty slot is not an error.
    pub fn unregister_xsk(&self, queue_id: u32) -> Result<(), XdpError> {
        check_queue(queue_id)?;
        match self.maps.xsks.delete(&queue_id.to_ne_bytes()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(XdpError::Map {
                map: "xsks",
                op: format!("unregistering queue {queue_id}"),
                source,
            }),
        }
    }

    fn write_fault(&self, dscp: usize, p: f64) -> Result<(), XdpError> {
        config::check_probability(dscp, p)?;
        let value = encode_fault(config::probability_to_u32(p));
        let key = u32::try_from(dscp).unwrap_or(u32::MAX);
        self.maps
            .fault
            .update(&key.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "fault",
                op: format!("update of DSCP {dscp}"),
                source,
            })
    }

    /// Fault injection: drop gradwire packets with this DSCP with probability `p` (0 = off,
    /// 1 = all). Applied after the allowlist; dropped packets count in `drop_fault`.
    pub fn set_fault_drop(&self, dscp: u8, p: f64) -> Result<(), XdpError> {
        self.write_fault(usize::from(dscp), p)
    }

    /// Adds a peer source address to the allowlist (effective while the allowlist is
    /// enabled). IPv4-mapped IPv6 addresses are stored as IPv4. Adding twice is harmless.
    pub fn allow(&self, addr: IpAddr) -> Result<(), XdpError> {
        let addr = config::canonical(addr);
        self.maps
            .allowlist
            .update(&encode_addr_key(addr), &encode_allow_value(), MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "allowlist",
                op: format!("adding {addr} (capacity {ALLOWLIST_CAPACITY})"),
                source,
            })
    }

    /// Removes a peer source address from the allowlist; removing an absent one is not an
    /// error.
    pub fn disallow(&self, addr: IpAddr) -> Result<(), XdpError> {
        let addr = config::canonical(addr);
        match self.maps.allowlist.delete(&encode_addr_key(addr)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(XdpError::Map {
                map: "allowlist",
                op: format!("removing {addr}"),
                source,
            }),
        }
    }

    /// Whether `addr` is in the allowlist (whether or not the allowlist is enabled).
    pub fn is_allowed(&self, addr: IpAddr) -> Result<bool, XdpError> {
        let addr = config::canonical(addr);
        self.maps
            .allowlist
            .lookup(&encode_addr_key(addr), MapFlags::ANY)
            .map(|v| v.is_some())
            .map_err(|source| XdpError::Map {
                map: "allowlist",
                op: format!("looking up {addr}"),
                source,
            })
    }

    fn read_counter(map: &MapHandle, name: &'static str, idx: u32) -> Result<Counter, XdpError> {
        let per_cpu = map
            .lookup_percpu(&idx.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: name,
                op: format!("per-CPU lookup of index {idx}"),
                source,
            })?;
        let mut total = Counter::default();
        for v in per_cpu.iter().flatten() {
            let (packets, bytes) = decode_counter(v);
            total.add(packets, bytes);
        }
        Ok(total)
    }

    /// Reads every counter, summed over CPUs. Not atomic across counters: packets arriving
    /// meanwhile may show up in some and not yet in others.
    pub fn counters(&self) -> Result<XdpCounters, XdpError> {
        let g = |idx| Self::read_counter(&self.maps.globals, "globals", idx);
        let mut c = XdpCounters {
            gradwire: g(GW_CNT_GRADWIRE)?,
            redirected: g(GW_CNT_REDIRECTED)?,
            to_kernel: g(GW_CNT_TO_KERNEL)?,
            passed: g(GW_CNT_PASSED)?,
            drop_truncated: g(GW_CNT_DROP_TRUNCATED)?,
            drop_not_allowed: g(GW_CNT_DROP_NOT_ALLOWED)?,
            drop_fault: g(GW_CNT_DROP_FAULT)?,
            switched: g(GW_CNT_SWITCHED)?,
            ..XdpCounters::default()
        };
        for idx in 0..GW_NUM_CLASSES {
            let v = Self::read_counter(&self.maps.classes, "classes", idx)?;
            if v.is_zero() {
                continue;
            }
            let ecn = (idx & 3) as u8;
            if ecn == 3 {
                c.ce_packets += v.packets;
                c.ce_bytes += v.bytes;
            }
            c.classes.push(ClassCounter {
                dscp: (idx >> 2) as u8,
                ecn,
                packets: v.packets,
                bytes: v.bytes,
            });
        }
        Ok(c)
    }

    /// Runs the program once on `frame` with BPF_PROG_TEST_RUN (receive queue 0) and returns
    /// the verdict (`XDP_*`) and the frame as the program left it. Counters change exactly as
    /// for a received frame. The kernel does not perform redirects in a test run: with a
    /// socket registered for queue 0 the verdict is [`XDP_REDIRECT`], without one the
    /// fallback [`XDP_PASS`]. Frames shorter than an Ethernet header (14 bytes) are refused by
    /// the kernel (EINVAL) before the program runs.
    pub fn test_run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>), XdpError> {
        let prog = self.program()?;
        // Room for the program to grow the frame (it does not today).
        let mut out = vec![0u8; frame.len() + 256];
        let input = ProgramInput {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: 1,
            ..ProgramInput::default()
        };
        let output = prog.test_run(input).map_err(|source| XdpError::TestRun {
            len: frame.len(),
            source,
        })?;
        let data = output.data.map(|d| d.to_vec()).unwrap_or_default();
        Ok((output.return_value, data))
    }
}

fn check_queue(queue_id: u32) -> Result<(), XdpError> {
    if queue_id >= MAX_QUEUES {
        return Err(XdpError::InvalidConfig(format!(
            "queue {queue_id} out of range 0..{MAX_QUEUES}"
        )));
    }
    Ok(())
}

impl Drop for XdpProgram {
    fn drop(&mut self) {
        if let Some(a) = self.attachment.take() {
            let ifname = a.ifname.clone();
            if let Err(e) = a.detach() {
                // Closing the link fd (which follows) still detaches unless another process
                // holds a copy of it.
                eprintln!("gradwire-ebpf: detaching XDP from {ifname} on drop: {e}");
            }
        }
    }
}
