//! Errors of the loader, each carrying the interface, map or operation it is about and the
//! kernel's error code; and [`hint`], the one place that says what to do about an OS error
//! while setting up XDP or AF_XDP (this loader's errors and gradwire's AF_XDP socket layer
//! both print it).

use std::io;

use nix::errno::Errno;

use crate::config::{AttachMode, XdpAttachedMode};

/// What to do about OS error `errno` (a positive `errno` value) when loading or attaching XDP
/// or setting up an AF_XDP socket; `None` when there is nothing specific to say.
pub fn hint(errno: i32) -> Option<&'static str> {
    Some(match Errno::from_raw(errno) {
        Errno::EPERM => {
            "run as root, or grant CAP_NET_ADMIN + CAP_NET_RAW + CAP_BPF (CAP_SYS_ADMIN before \
             Linux 5.8); if locked memory is what is refused, raise the limit (`ulimit -l`) or \
             also grant CAP_IPC_LOCK"
        }
        Errno::EACCES => {
            "run as root, or grant CAP_NET_ADMIN + CAP_NET_RAW + CAP_BPF; when loading a BPF \
             program, EACCES is also the verifier's refusal (its log is on stderr)"
        }
        Errno::EINVAL => {
            "check the queue id against the interface's channels (`ethtool -l <iface>`; a veth \
             has the numrxqueues/numtxqueues it was created with), the ring sizes (powers of \
             two), the frame size (2048 or 4096) and zero-copy support (veth has none: use \
             copy mode)"
        }
        Errno::ENOMEM => {
            "not enough memory to lock or map: raise the locked-memory limit (`ulimit -l`, \
             RLIMIT_MEMLOCK; LimitMEMLOCK= under systemd), reserve 2 MiB huge pages in \
             /proc/sys/vm/nr_hugepages or turn huge pages off, or use fewer frames and \
             smaller rings"
        }
        Errno::ENOBUFS => {
            "the UMEM is larger than the locked-memory limit: raise it (`ulimit -l`, \
             RLIMIT_MEMLOCK) or grant CAP_IPC_LOCK, or use fewer frames"
        }
        Errno::EBUSY => {
            "the queue is already bound by another AF_XDP socket (close it, share its UMEM or \
             use another queue), or the interface already has an XDP program attached \
             (`ip link show dev <iface>`; remove a stale one with `ip link set dev <iface> \
             xdp off`)"
        }
        Errno::EOPNOTSUPP => {
            "the driver does not support this (native XDP or AF_XDP zero-copy): use generic \
             XDP or copy mode"
        }
        Errno::ENODEV | Errno::ENXIO => {
            "no such interface in this thread's network namespace (`ip link`)"
        }
        _ => return None,
    })
}

/// `"; hint: ..."` for an OS error that has a [`hint`], `""` otherwise: the tail of an error
/// message.
pub fn hint_suffix(errno: Option<i32>) -> String {
    errno
        .and_then(hint)
        .map(|h| format!("; hint: {h}"))
        .unwrap_or_default()
}

/// The `errno` inside a libbpf-rs error. libbpf-rs 0.27 builds an `io::Error` from libbpf's
/// `-errno` but keeps it private, exposing only a coarse `ErrorKind` (EBUSY, ENOBUFS and many
/// more are all `Other`); std renders an OS error as `... (os error N)`, which is read back.
pub(crate) fn libbpf_errno(e: &libbpf_rs::Error) -> Option<i32> {
    const MARK: &str = "(os error ";
    let text = format!("{e:#}");
    let start = text.rfind(MARK)? + MARK.len();
    let len = text[start..].find(')')?;
    text[start..start + len].parse().ok()
}

/// [`hint_suffix`] of a libbpf-rs error.
fn libbpf_hint(e: &libbpf_rs::Error) -> String {
    hint_suffix(libbpf_errno(e))
}

/// [`hint_suffix`] of an io error.
fn io_hint(e: &io::Error) -> String {
    hint_suffix(e.raw_os_error())
}

/// Everything that can go wrong loading, attaching or driving the classifier.
///
/// Errors from the kernel keep its code ([`XdpError::raw_os_error`]) and their message ends
/// with the [`hint`] for it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum XdpError {
    /// The [`XdpConfig`](crate::XdpConfig) or an argument is out of range.
    #[error("invalid XDP configuration: {0}")]
    InvalidConfig(String),

    /// The interface name or index does not exist in the calling thread's network namespace.
    #[error("no such network interface {iface:?} (in this thread's network namespace): {source}")]
    NoSuchInterface {
        /// The name or index as given.
        iface: String,
        /// What the lookup returned.
        source: nix::Error,
    },

    /// The interface already has an XDP program; gradwire never replaces one.
    #[error(
        "interface {ifname} (ifindex {ifindex}) already has XDP program id {prog_id}{} attached in \
         {mode} mode; refusing to replace it. If it is stale, remove it first \
         (`ip link set dev {ifname} xdp off`, or end the process that owns its bpf_link)",
        prog_name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default()
    )]
    AlreadyAttached {
        /// Interface name.
        ifname: String,
        /// Interface index.
        ifindex: u32,
        /// Kernel id of the program already attached (`bpftool prog show id N`).
        prog_id: u32,
        /// Its name, when it could be read.
        prog_name: Option<String>,
        /// How it is attached.
        mode: XdpAttachedMode,
    },

    /// The kernel said EPERM or EACCES.
    #[error(
        "{op}: permission denied: {source}{}",
        hint_suffix(Some(source.raw_os_error().unwrap_or(Errno::EPERM as i32)))
    )]
    PermissionDenied {
        /// What was being done.
        op: String,
        /// The kernel's answer.
        source: io::Error,
    },

    /// libbpf could not open or load the object (the verifier log, if any, is on stderr).
    #[error("loading the gradwire XDP object: {source}{}", libbpf_hint(source))]
    Load {
        /// The libbpf error.
        source: libbpf_rs::Error,
    },

    /// The loaded object does not have the maps this loader was built for.
    #[error("gradwire XDP object layout mismatch: {0}")]
    Layout(String),

    /// Querying the interface's XDP state failed.
    #[error("querying XDP on {ifname}: {source}{}", io_hint(source))]
    Query {
        /// Interface name.
        ifname: String,
        /// The netlink error.
        source: io::Error,
    },

    /// Attaching failed (and, in `Auto` mode, so did the generic-mode fallback).
    #[error("attaching XDP to {ifname} in {mode} mode: {source}{}", attach_hint(*mode, source))]
    Attach {
        /// Interface name.
        ifname: String,
        /// The mode that was tried last.
        mode: AttachMode,
        /// The kernel's answer.
        source: io::Error,
    },

    /// Detaching the bpf_link failed.
    #[error("detaching XDP from {ifname}: {source}{}", io_hint(source))]
    Detach {
        /// Interface name.
        ifname: String,
        /// The kernel's answer.
        source: io::Error,
    },

    /// A map operation failed.
    #[error("{op} on BPF map {map}: {source}{}", libbpf_hint(source))]
    Map {
        /// Map name.
        map: &'static str,
        /// What was being done, with its key.
        op: String,
        /// The libbpf error.
        source: libbpf_rs::Error,
    },

    /// BPF_PROG_TEST_RUN failed (the kernel refuses frames shorter than an Ethernet header).
    #[error("BPF_PROG_TEST_RUN of a {len}-byte frame: {source}")]
    TestRun {
        /// Input frame length.
        len: usize,
        /// The libbpf error.
        source: libbpf_rs::Error,
    },
}

/// The hint for a failed attach: what the mode explains first, else the general one.
fn attach_hint(mode: AttachMode, e: &io::Error) -> String {
    let errno = e.raw_os_error().map(Errno::from_raw);
    match (mode, errno) {
        (AttachMode::Native, Some(Errno::EOPNOTSUPP)) => {
            "; hint: the driver has no native XDP: use mode auto or generic".into()
        }
        (AttachMode::Native, Some(Errno::ENOSPC)) => "; hint: veth: native XDP needs at least \
                                                      as many rx queues as the peer has tx \
                                                      queues"
            .into(),
        _ => io_hint(e),
    }
}

impl XdpError {
    /// The kernel's error code (`errno`) behind this error, when it came from the kernel.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            XdpError::NoSuchInterface { source, .. } => Some(*source as i32),
            XdpError::PermissionDenied { source, .. }
            | XdpError::Query { source, .. }
            | XdpError::Attach { source, .. }
            | XdpError::Detach { source, .. } => source.raw_os_error(),
            XdpError::Load { source }
            | XdpError::Map { source, .. }
            | XdpError::TestRun { source, .. } => libbpf_errno(source),
            XdpError::InvalidConfig(_) | XdpError::AlreadyAttached { .. } | XdpError::Layout(_) => {
                None
            }
        }
    }

    /// Maps a libbpf error to [`XdpError::PermissionDenied`] when it is EPERM/EACCES, else
    /// through `other`.
    pub(crate) fn from_libbpf(
        op: impl Into<String>,
        e: libbpf_rs::Error,
        other: impl FnOnce(libbpf_rs::Error) -> XdpError,
    ) -> XdpError {
        if e.kind() == libbpf_rs::ErrorKind::PermissionDenied {
            let source = match libbpf_errno(&e) {
                Some(errno) => io::Error::from_raw_os_error(errno),
                None => io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()),
            };
            XdpError::PermissionDenied {
                op: op.into(),
                source,
            }
        } else {
            other(e)
        }
    }

    /// Maps an io error to [`XdpError::PermissionDenied`] when it is EPERM/EACCES, else
    /// through `other`.
    pub(crate) fn from_io(
        op: impl Into<String>,
        e: io::Error,
        other: impl FnOnce(io::Error) -> XdpError,
    ) -> XdpError {
        if e.kind() == io::ErrorKind::PermissionDenied {
            XdpError::PermissionDenied {
                op: op.into(),
                source: e,
            }
        } else {
            other(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libbpf_rs::ErrorExt as _;

    #[test]
    fn the_errno_survives_libbpf_rs() {
        let e = libbpf_rs::Error::from_raw_os_error(Errno::EBUSY as i32);
        assert_eq!(libbpf_errno(&e), Some(Errno::EBUSY as i32));
        let with_context: Result<(), _> = Err(e);
        let e = with_context.context("while doing it").unwrap_err();
        assert_eq!(libbpf_errno(&e), Some(Errno::EBUSY as i32));
        let err = XdpError::Map {
            map: "xsks",
            op: "update".into(),
            source: e,
        };
        assert_eq!(err.raw_os_error(), Some(Errno::EBUSY as i32));
        assert!(err.to_string().contains("already bound"), "{err}");
    }

    #[test]
    fn every_advertised_errno_has_a_hint_and_others_none() {
        for (errno, needle) in [
            (Errno::EPERM, "CAP_NET_RAW"),
            (Errno::EINVAL, "ethtool -l"),
            (Errno::ENOMEM, "/proc/sys/vm/nr_hugepages"),
            (Errno::ENOMEM, "ulimit -l"),
            (Errno::EBUSY, "another AF_XDP socket"),
        ] {
            let h = hint(errno as i32).unwrap_or_default();
            assert!(h.contains(needle), "{errno}: {h}");
        }
        assert_eq!(hint(Errno::EINTR as i32), None);
        assert_eq!(hint_suffix(None), "");
        let err = XdpError::Attach {
            ifname: "gw0".into(),
            mode: AttachMode::Generic,
            source: io::Error::from_raw_os_error(Errno::EINVAL as i32),
        };
        let msg = err.to_string();
        assert!(
            msg.starts_with("attaching XDP to gw0 in generic mode: "),
            "{msg}"
        );
        assert!(
            msg.contains("os error 22") && msg.contains("; hint: "),
            "{msg}"
        );
        assert_eq!(err.raw_os_error(), Some(Errno::EINVAL as i32));
    }
}
