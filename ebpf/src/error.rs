//! Errors of the loader, each carrying the interface, map or operation it is about.

use std::io;

use crate::config::{AttachMode, XdpAttachedMode};

/// Everything that can go wrong loading, attaching or driving the classifier.
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

    /// The kernel said EPERM.
    #[error(
        "{op}: permission denied: loading and attaching XDP programs needs root \
         (or CAP_BPF + CAP_NET_ADMIN)"
    )]
    PermissionDenied {
        /// What was being done.
        op: String,
        /// The underlying error.
        source: io::Error,
    },

    /// libbpf could not open or load the object (the verifier log, if any, is on stderr).
    #[error("loading the gradwire XDP object: {source}")]
    Load {
        /// The libbpf error.
        source: libbpf_rs::Error,
    },

    /// The loaded object does not have the maps this loader was built for.
    #[error("gradwire XDP object layout mismatch: {0}")]
    Layout(String),

    /// Querying the interface's XDP state failed.
    #[error("querying XDP on {ifname}: {source}")]
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
    #[error("detaching XDP from {ifname}: {source}")]
    Detach {
        /// Interface name.
        ifname: String,
        /// The kernel's answer.
        source: io::Error,
    },

    /// A map operation failed.
    #[error("{op} on BPF map {map}: {source}")]
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

fn attach_hint(mode: AttachMode, e: &io::Error) -> &'static str {
    use nix::errno::Errno;
    let errno = e.raw_os_error().map(Errno::from_raw);
    match (mode, errno) {
        (AttachMode::Native, Some(Errno::EOPNOTSUPP)) => {
            " (the driver has no native XDP: use mode auto or generic)"
        }
        (AttachMode::Native, Some(Errno::ENOSPC)) => {
            " (veth: native XDP needs at least as many rx queues as the peer has tx queues)"
        }
        _ => "",
    }
}

impl XdpError {
    /// Maps a libbpf error to [`XdpError::PermissionDenied`] when it is EPERM/EACCES, else
    /// through `other`.
    pub(crate) fn from_libbpf(
        op: impl Into<String>,
        e: libbpf_rs::Error,
        other: impl FnOnce(libbpf_rs::Error) -> XdpError,
    ) -> XdpError {
        if e.kind() == libbpf_rs::ErrorKind::PermissionDenied {
            XdpError::PermissionDenied {
                op: op.into(),
                source: io::Error::other(e.to_string()),
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
