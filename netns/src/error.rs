//! The one error type of the kit.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// Why a namespace, link or testbed could not be built, used or torn down.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// Namespaces and veths need CAP_SYS_ADMIN and CAP_NET_ADMIN; we ask for root.
    #[error("network namespaces need root (effective uid {euid}); run as root, e.g. `sudo -E cargo test`")]
    NotRoot {
        /// The effective uid we run as.
        euid: u32,
    },
    /// A required external tool is not installed.
    #[error("`{tool}` not found in PATH: {hint}")]
    MissingTool {
        /// The program name.
        tool: String,
        /// How to get it.
        hint: &'static str,
    },
    /// The configuration cannot be built.
    #[error("invalid testbed config: {0}")]
    InvalidConfig(String),
    /// A host index beyond the testbed.
    #[error("no host {index}: the testbed has {hosts} hosts")]
    NoSuchHost {
        /// The index asked for.
        index: usize,
        /// How many hosts there are.
        hosts: usize,
    },
    /// A persistent namespace to be created exists already.
    #[error("network namespace {netns} exists already; remove it (or what it belongs to) first")]
    AlreadyExists {
        /// Its name.
        netns: String,
    },
    /// An external command ran and failed.
    #[error("`{command}` (netns {}) failed with {status}: {stderr}", OrDash(.netns))]
    Command {
        /// The command line.
        command: String,
        /// The namespace it was about, if any.
        netns: Option<String>,
        /// Its exit status.
        status: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// An external command did not finish in time and was killed.
    #[error("`{command}` (netns {}) timed out after {timeout:?} and was killed; stderr: {stderr}", OrDash(.netns))]
    Timeout {
        /// The command line.
        command: String,
        /// The namespace it was about, if any.
        netns: Option<String>,
        /// The bound it exceeded.
        timeout: Duration,
        /// Its standard error up to the kill, trimmed.
        stderr: String,
    },
    /// An external command could not be started.
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file or thread operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// A system call failed.
    #[error("{context}: {source}")]
    Sys {
        /// What we were doing.
        context: String,
        /// Why it failed.
        #[source]
        source: nix::errno::Errno,
    },
    /// Nothing accepted a TCP connection at `addr` before the deadline.
    #[error(
        "no TCP listener accepted at {addr} within {waited:?} ({attempts} attempts; is the \
         server up and listening there?): {source}"
    )]
    Connect {
        /// Where we tried to connect.
        addr: SocketAddr,
        /// How long we kept trying.
        waited: Duration,
        /// How many attempts were made.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        source: io::Error,
    },
    /// Teardown or stale cleanup hit one or more errors (it carries on past each one).
    #[error("cleanup left {} problem(s): {}", .0.len(), JoinErrors(.0))]
    Cleanup(Vec<NetnsError>),
}

/// Result alias of the kit.
pub type Result<T, E = NetnsError> = std::result::Result<T, E>;

/// Formats an optional namespace as its name or `-`.
struct OrDash<'a>(&'a Option<String>);

impl fmt::Display for OrDash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_deref().unwrap_or("-"))
    }
}

/// Formats a list of errors on one line.
struct JoinErrors<'a>(&'a [NetnsError]);

impl fmt::Display for JoinErrors<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl NetnsError {
    /// `Ok(())` for no errors, else [`NetnsError::Cleanup`] carrying them all.
    pub fn from_cleanup(errors: Vec<NetnsError>) -> Result<()> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(NetnsError::Cleanup(errors))
        }
    }
}
