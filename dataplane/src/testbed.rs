//! A network-namespace testbed: N hosts joined by veth pairs, for tests, the demo and benches.
//!
//! Each host is a network namespace with one interface, [`HOST_IFNAME`] (`gw0`), holding
//! `198.18.0.(i+1)/24` (the benchmarking range, never routed). Two hosts are joined by a single
//! veth pair; more hosts each get a veth into a Linux bridge living in an extra "switch"
//! namespace. Every host has `lo` up, static (`permanent`) neighbour entries for every other
//! host so that a kernel-bypass sender never needs ARP, and IPv6 disabled, so the kernel sends
//! no router solicitations or MLD reports that an AF_XDP receiver would have to count as
//! foreign traffic (and no global IPv6 address can ever appear).
//!
//! # Names
//!
//! Namespaces are called `gw<pid>t<n>h<i>` (host `i`) and `gw<pid>t<n>sw` (the switch), where
//! `pid` is the creating process and `n` numbers the testbeds of that process, so parallel
//! tests and parallel test binaries never collide and leftovers can be attributed to their
//! creator. `scripts/testbed.sh` uses the prefix `gwsh`, which [`cleanup_stale`] never matches
//! (a digit must follow `gw`), and the script in turn only touches what it recorded itself.
//! Interface names are fixed (`gw0`, `h<i>`, `br0`) because they live inside private
//! namespaces, which keeps them far below the 15-byte `IFNAMSIZ` limit.
//!
//! # Teardown
//!
//! Layered, so that a failing or interrupted run leaves nothing behind:
//!
//! 1. [`Drop`] (also during a panic's unwinding) and [`Testbed::down`] delete the veths first
//!    (which synchronously detaches any XDP program and unbinds AF_XDP sockets, even if a
//!    leaked socket keeps the namespace itself alive) and then every namespace. Idempotent.
//! 2. Each testbed starts a tiny reaper process (`sh`, in its own process group so a terminal
//!    Ctrl-C does not reach it) that holds the read end of a pipe. Normal teardown tells it
//!    "done" (or, if teardown hit errors, lets it try again); if this process dies in any way,
//!    including SIGINT, SIGTERM and SIGKILL (which no process can catch, so no in-process
//!    handler could help), the pipe reaches EOF and the reaper deletes the namespaces.
//! 3. [`cleanup_stale`], called at the start of every [`Testbed::up`], deletes namespaces with
//!    our prefix whose creator pid is no longer alive, for the case where the reaper was killed
//!    too (e.g. a whole cgroup was killed). Liveness is judged by `kill(pid, 0)` in this pid
//!    namespace; a recycled pid merely postpones the cleanup.
//!
//! Threads that entered a namespace ([`Testbed::run_in`], [`Testbed::spawn_in`]) and sockets
//! created there keep the (emptied) namespace alive until they end; join and close them before
//! the testbed goes away.
//!
//! # External commands
//!
//! The testbed drives `ip` (iproute2) and, unless TX checksum offload is kept, `ethtool`
//! (`scripts/deps.sh` installs both). Every command is killed after a bound
//! ([`COMMAND_TIMEOUT`] unless told otherwise) and its stderr ends up in the error.

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::kill;
use nix::unistd::Pid;
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Common prefix of every namespace this module creates; a decimal pid always follows it.
pub const PREFIX: &str = "gw";
/// The interface of every host, inside the host's namespace.
pub const HOST_IFNAME: &str = "gw0";
/// Prefix length of the hosts' addresses: host `i` has `198.18.0.(i+1)/24`.
pub const PREFIX_LEN: u8 = 24;
/// Where `ip netns` keeps its namespace handles.
pub const NETNS_DIR: &str = "/run/netns";
/// Default bound on every external command.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// Environment variable that turns a privilege skip into a test failure (value `1`).
pub const REQUIRE_PRIV_ENV: &str = "GRADWIRE_REQUIRE_PRIV";
/// Most hosts a testbed can have: the host part of a /24 without network and broadcast.
pub const MAX_HOSTS: usize = 254;

/// Name of the bridge in the switch namespace.
const BRIDGE: &str = "br0";
/// How long teardown waits for the reaper to acknowledge "done" before killing it.
const REAPER_WAIT: Duration = Duration::from_secs(2);

/// Numbers the testbeds of this process, so that their namespace names differ.
static NEXT_TESTBED: AtomicU32 = AtomicU32::new(0);

/// Why the testbed could not be built, used or torn down.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    /// Namespaces and veths need CAP_SYS_ADMIN and CAP_NET_ADMIN; we ask for root.
    #[error(
        "the testbed needs root (effective uid {euid}); run as root, e.g. `sudo -E cargo test`"
    )]
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
        source: io::Error,
    },
    /// A file or thread operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// Why it failed.
        source: io::Error,
    },
    /// A system call failed.
    #[error("{context}: {source}")]
    Sys {
        /// What we were doing.
        context: String,
        /// Why it failed.
        source: nix::errno::Errno,
    },
    /// Teardown or stale cleanup hit one or more errors (it carries on past each one).
    #[error("cleanup left {} problem(s): {}", .0.len(), JoinErrors(.0))]
    Cleanup(Vec<TestbedError>),
}

/// Result alias of this module.
pub type Result<T, E = TestbedError> = std::result::Result<T, E>;

/// Formats an optional namespace as its name or `-`.
struct OrDash<'a>(&'a Option<String>);

impl fmt::Display for OrDash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_deref().unwrap_or("-"))
    }
}

/// Formats a list of errors on one line.
struct JoinErrors<'a>(&'a [TestbedError]);

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

/// Shape of a testbed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestbedConfig {
    /// Number of hosts, 2 to [`MAX_HOSTS`]. Two are joined directly, more through a bridge.
    pub hosts: usize,
    /// RX and TX queue count of every veth end. AF_XDP in native mode on a veth needs at least
    /// as many RX queues as the peer has TX queues, so both ends get the same count.
    pub queues: u32,
    /// MTU of every veth end.
    pub mtu: u32,
    /// Keep TX checksum offload on the hosts' interfaces. Off by default: with it on, a kernel
    /// UDP sender's packets cross the veth with only a partial UDP checksum, which an AF_XDP
    /// receiver that verifies checksums rightly rejects.
    pub tx_checksum_offload: bool,
}

impl Default for TestbedConfig {
    fn default() -> Self {
        TestbedConfig {
            hosts: 2,
            queues: 1,
            mtu: 1500,
            tx_checksum_offload: false,
        }
    }
}

impl TestbedConfig {
    /// The default configuration with `hosts` hosts.
    pub fn with_hosts(hosts: usize) -> Self {
        TestbedConfig {
            hosts,
            ..TestbedConfig::default()
        }
    }

    fn validate(&self) -> Result<()> {
        if !(2..=MAX_HOSTS).contains(&self.hosts) {
            return Err(TestbedError::InvalidConfig(format!(
                "hosts = {}, must be 2..={MAX_HOSTS}",
                self.hosts
            )));
        }
        // veth accepts up to 4096 queues per direction (VETH_MAX_QUEUES in the kernel is
        // larger, but iproute2 and sane tests stay far below).
        if !(1..=4096).contains(&self.queues) {
            return Err(TestbedError::InvalidConfig(format!(
                "queues = {}, must be 1..=4096",
                self.queues
            )));
        }
        // 68 is the IPv4 minimum; veth's maximum is 64 KiB minus headers.
        if !(68..=65535).contains(&self.mtu) {
            return Err(TestbedError::InvalidConfig(format!(
                "mtu = {}, must be 68..=65535",
                self.mtu
            )));
        }
        Ok(())
    }
}

/// One host of a testbed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Position in the testbed.
    pub index: usize,
    /// Network namespace name (`ip netns exec <netns> ...`).
    pub netns: String,
    /// The host's interface, inside `netns`.
    pub ifname: String,
    /// Interface index of `ifname` inside `netns`.
    pub ifindex: u32,
    /// MAC address of `ifname`.
    pub mac: [u8; 6],
    /// IPv4 address of `ifname` (prefix length [`PREFIX_LEN`]).
    pub ipv4: Ipv4Addr,
}

impl Host {
    /// `mac` as `aa:bb:cc:dd:ee:ff`.
    pub fn mac_string(&self) -> String {
        mac_string(&self.mac)
    }

    /// Path of the namespace handle, for `setns`.
    pub fn netns_path(&self) -> PathBuf {
        netns_path(&self.netns)
    }
}

/// A running testbed; dropping it tears everything down.
#[derive(Debug)]
pub struct Testbed {
    id: u32,
    config: TestbedConfig,
    hosts: Vec<Host>,
    switch: Option<String>,
    /// Every namespace actually created, in creation order; teardown deletes exactly these.
    created: Vec<String>,
    reaper: Option<Reaper>,
    torn_down: bool,
}

impl Testbed {
    /// Builds a testbed. Removes stale namespaces of dead processes first (see
    /// [`cleanup_stale`]). On error, everything created so far is removed again.
    pub fn up(config: &TestbedConfig) -> Result<Testbed> {
        config.validate()?;
        if !is_root() {
            return Err(TestbedError::NotRoot {
                euid: nix::unistd::geteuid().as_raw(),
            });
        }
        require_tool("ip", "install iproute2 (scripts/deps.sh does)")?;
        if !config.tx_checksum_offload {
            require_tool("ethtool", "install ethtool (scripts/deps.sh does)")?;
        }
        // A stale namespace we cannot delete must not stop this run: our names are unique.
        if let Err(e) = cleanup_stale() {
            eprintln!("gradwire testbed: warning: stale cleanup: {e}");
        }

        let id = NEXT_TESTBED.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let host_ns: Vec<String> = (0..config.hosts)
            .map(|i| format!("{PREFIX}{pid}t{id}h{i}"))
            .collect();
        let switch = (config.hosts > 2).then(|| format!("{PREFIX}{pid}t{id}sw"));
        let all: Vec<String> = host_ns.iter().chain(switch.iter()).cloned().collect();

        let mut tb = Testbed {
            id,
            config: config.clone(),
            hosts: Vec::with_capacity(config.hosts),
            switch: switch.clone(),
            created: Vec::with_capacity(all.len()),
            reaper: None,
            torn_down: false,
        };
        // The reaper first: from here on even a SIGKILL cannot leak namespaces.
        match Reaper::spawn(&all) {
            Ok(r) => tb.reaper = Some(r),
            Err(e) => eprintln!(
                "gradwire testbed: warning: no reaper ({e}); if this process is killed, the next \
                 Testbed::up removes its namespaces"
            ),
        }
        // If anything below fails, dropping `tb` removes what exists so far.
        for ns in &all {
            tb.add_netns(ns)?;
        }
        tb.wire(&host_ns)?;
        tb.configure_hosts(&host_ns)?;
        Ok(tb)
    }

    fn add_netns(&mut self, ns: &str) -> Result<()> {
        create_netns(ns, |ns| self.created.push(ns.to_owned()))
    }

    /// Creates the veth pairs (and the bridge).
    fn wire(&self, host_ns: &[String]) -> Result<()> {
        let mac = |i: usize| mac_string(&host_mac(i));
        match &self.switch {
            None => self.veth(
                &host_ns[0],
                &mac(0),
                HOST_IFNAME,
                Some(&mac(1)),
                &host_ns[1],
            ),
            Some(sw) => {
                // STP off and no forward delay: ports forward at once. No multicast snooping:
                // the bridge must not originate IGMP/MLD queries that hosts would see.
                let bridge = format!(
                    "-n {sw} link add {BRIDGE} type bridge stp_state 0 forward_delay 0 \
                     mcast_snooping 0"
                );
                ip(Some(sw), &bridge.split_whitespace().collect::<Vec<_>>())?;
                for (i, ns) in host_ns.iter().enumerate() {
                    let port = format!("h{i}");
                    self.veth(ns, &mac(i), &port, None, sw)?;
                    ip(
                        Some(sw),
                        &["-n", sw, "link", "set", &port, "master", BRIDGE, "up"],
                    )?;
                }
                ip(Some(sw), &["-n", sw, "link", "set", BRIDGE, "up"]).map(drop)
            }
        }
    }

    /// Creates veth `gw0` (address `mac`) in `ns` with its peer `peer` directly in `peer_ns`,
    /// so that the fixed interface names never meet in the root namespace. Both ends get the
    /// configured queue counts and MTU.
    fn veth(
        &self,
        ns: &str,
        mac: &str,
        peer: &str,
        peer_mac: Option<&str>,
        peer_ns: &str,
    ) -> Result<()> {
        let (q, mtu) = (self.config.queues, self.config.mtu);
        let end = format!("numtxqueues {q} numrxqueues {q} mtu {mtu}");
        let peer_addr = peer_mac.map(|m| format!("address {m}")).unwrap_or_default();
        // Every part is a name we generated or a number: splitting on whitespace is exact.
        let line = format!(
            "-n {ns} link add {HOST_IFNAME} {end} address {mac} type veth \
             peer name {peer} {end} {peer_addr} netns {peer_ns}"
        );
        ip(Some(ns), &line.split_whitespace().collect::<Vec<_>>()).map(drop)
    }

    /// Addresses, link up, offloads, neighbours; then reads back ifindex and MAC.
    fn configure_hosts(&mut self, host_ns: &[String]) -> Result<()> {
        let n = host_ns.len();
        for (i, ns) in host_ns.iter().enumerate() {
            // One `ip -batch` per host instead of 2 + (n - 1) processes.
            let mut batch = format!(
                "addr add {}/{PREFIX_LEN} dev {HOST_IFNAME}\nlink set {HOST_IFNAME} up\n",
                host_ipv4(i)
            );
            for j in (0..n).filter(|&j| j != i) {
                batch.push_str(&format!(
                    "neigh replace {} lladdr {} dev {HOST_IFNAME} nud permanent\n",
                    host_ipv4(j),
                    mac_string(&host_mac(j))
                ));
            }
            run(&Cmd {
                program: "ip",
                args: vec!["-n".into(), ns.clone(), "-batch".into(), "-".into()],
                netns: Some(ns),
                stdin: Some(batch),
                timeout: COMMAND_TIMEOUT,
            })?;
            if !self.config.tx_checksum_offload {
                let off = ["ethtool", "-K", HOST_IFNAME, "tx", "off"];
                exec_in_netns(ns, &off, COMMAND_TIMEOUT)?;
            }
            let (ifindex, mac) = run_in_netns(ns, || link_info(HOST_IFNAME))??;
            self.hosts.push(Host {
                index: i,
                netns: ns.clone(),
                ifname: HOST_IFNAME.to_owned(),
                ifindex,
                mac,
                ipv4: host_ipv4(i),
            });
        }
        Ok(())
    }

    /// Host `i`. Panics if `i >= self.len()`, like slice indexing.
    pub fn host(&self, i: usize) -> &Host {
        match self.hosts.get(i) {
            Some(h) => h,
            None => panic!("no host {i}: the testbed has {} hosts", self.hosts.len()),
        }
    }

    /// All hosts, by index.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Always false: a testbed has at least two hosts.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The switch namespace (holding bridge `br0` and ports `h<i>`), for more than 2 hosts.
    pub fn switch_netns(&self) -> Option<&str> {
        self.switch.as_deref()
    }

    /// The configuration this testbed was built from.
    pub fn config(&self) -> &TestbedConfig {
        &self.config
    }

    /// Every namespace of this testbed (hosts, then the switch).
    pub fn namespaces(&self) -> &[String] {
        &self.created
    }

    /// This testbed's number within the process (the `t<n>` of its names).
    pub fn id(&self) -> u32 {
        self.id
    }

    fn checked_host(&self, i: usize) -> Result<&Host> {
        self.hosts.get(i).ok_or(TestbedError::NoSuchHost {
            index: i,
            hosts: self.hosts.len(),
        })
    }

    /// Runs `f` on a new thread inside host `i`'s namespace and returns its result. Sockets
    /// `f` creates stay in that namespace for their whole life, whichever thread uses them
    /// later. A panic in `f` is propagated to the caller.
    pub fn run_in<R, F>(&self, i: usize, f: F) -> Result<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        run_in_netns(&self.checked_host(i)?.netns, f)
    }

    /// Like [`Testbed::run_in`] without waiting: `f` runs on a thread inside host `i`'s
    /// namespace. Errors entering the namespace are reported here, before `f` starts.
    pub fn spawn_in<R, F>(&self, i: usize, f: F) -> Result<JoinHandle<R>>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        spawn_in_netns(&self.checked_host(i)?.netns, f)
    }

    /// Runs `args` inside host `i` (`ip netns exec`), killed after [`COMMAND_TIMEOUT`].
    /// Returns its stdout; a non-zero exit is an error carrying its stderr.
    pub fn exec(&self, i: usize, args: &[&str]) -> Result<String> {
        self.exec_timeout(i, args, COMMAND_TIMEOUT)
    }

    /// [`Testbed::exec`] with an explicit time bound.
    pub fn exec_timeout(&self, i: usize, args: &[&str], timeout: Duration) -> Result<String> {
        exec_in_netns(&self.checked_host(i)?.netns, args, timeout)
    }

    /// Tears the testbed down, reporting every problem (teardown continues past each).
    pub fn down(mut self) -> Result<()> {
        let errors = self.teardown();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(TestbedError::Cleanup(errors))
        }
    }

    /// Deletes the host interfaces, then the namespaces; runs at most once.
    fn teardown(&mut self) -> Vec<TestbedError> {
        if self.torn_down {
            return Vec::new();
        }
        self.torn_down = true;
        let mut errors = Vec::new();
        // Deleting a veth end deletes its peer and detaches XDP programs from both, at once,
        // even while some socket or thread keeps the namespace alive.
        for ns in self
            .created
            .iter()
            .filter(|ns| Some(*ns) != self.switch.as_ref())
        {
            if !netns_path(ns).exists() {
                continue;
            }
            if let Err(e) = ip(Some(ns), &["-n", ns, "link", "del", HOST_IFNAME]) {
                // The peer of an already deleted veth (two hosts) is already gone.
                if !is_missing_device(&e) {
                    errors.push(e);
                }
            }
        }
        for ns in self.created.iter().rev() {
            if let Err(e) = delete_netns(ns) {
                errors.push(e);
            }
        }
        if let Some(r) = self.reaper.take() {
            // After a failed deletion, let the reaper try once more instead of dismissing it.
            r.finish(errors.is_empty());
        }
        errors
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Cannot return errors from Drop, and must not panic during unwinding: report them.
        for e in self.teardown() {
            eprintln!("gradwire testbed: teardown: {e}");
        }
    }
}

/// The process that removes a testbed's namespaces if we die without tearing down.
#[derive(Debug)]
pub struct Reaper {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Reaper {
    /// Reads one line; "done" means we cleaned up ourselves, anything else (EOF because this
    /// process died) means delete the namespaces named in the arguments.
    const SCRIPT: &'static str = r#"IFS= read -r line || line=
[ "$line" = done ] && exit 0
for ns do ip -n "$ns" link del gw0 2>/dev/null; ip netns del "$ns" 2>/dev/null; done
exit 0"#;

    /// Starts the reaper for `namespaces`.
    pub fn spawn(namespaces: &[String]) -> io::Result<Reaper> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(Self::SCRIPT)
            .arg("gradwire-testbed-reaper")
            .args(namespaces)
            .stdin(Stdio::piped())
            // Null, not inherited: a process holding cargo's output pipes would make
            // `cargo test` wait for it.
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Own process group: a terminal's Ctrl-C kills the test process but not the
            // reaper, which then does its job.
            .process_group(0)
            .spawn()?;
        let stdin = child.stdin.take();
        Ok(Reaper { child, stdin })
    }

    /// Tells the reaper that teardown happened (`done`) or that it should delete the
    /// namespaces now (closing its pipe), then reaps it, bounded.
    pub fn finish(mut self, done: bool) {
        if let Some(mut stdin) = self.stdin.take() {
            if done {
                // If the reaper is already gone the write fails; nothing to do about it.
                let _ = stdin.write_all(b"done\n");
            }
        }
        let bound = if done { REAPER_WAIT } else { COMMAND_TIMEOUT };
        if wait_bounded(&mut self.child, bound).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Creates namespace `ns` (deleting a leftover of that name first: names carry their
/// creator's pid, so a leftover is ours), calls `created` once it exists (so the caller can
/// record it for teardown before anything else can fail), disables IPv6 and sets `lo` up.
pub fn create_netns(ns: &str, created: impl FnOnce(&str)) -> Result<()> {
    if netns_path(ns).exists() {
        // Only possible if a previous process with our pid died without cleanup and its
        // reaper was killed too (pid recycled); the name proves the namespace is ours.
        delete_netns(ns)?;
    }
    ip(None, &["netns", "add", ns])?;
    created(ns);
    // Before any interface exists, so that new interfaces inherit `default`.
    disable_ipv6(ns)?;
    ip(Some(ns), &["-n", ns, "link", "set", "lo", "up"])?;
    Ok(())
}

/// Feeds `batch` (one `ip` command per line, without the leading `ip`) to `ip -n netns -batch -`.
pub fn ip_batch(netns: &str, batch: String) -> Result<()> {
    run(&Cmd {
        program: "ip",
        args: vec!["-n".into(), netns.to_owned(), "-batch".into(), "-".into()],
        netns: Some(netns),
        stdin: Some(batch),
        timeout: COMMAND_TIMEOUT,
    })
    .map(drop)
}

/// A fresh name prefix `gw<pid>t<n>` for namespaces of a testbed built outside this module
/// (the fabric's); names `<prefix>-<node>` with `node` of a-z 0-9 are recognised by
/// [`cleanup_stale`] like this module's own.
pub fn new_netns_prefix() -> String {
    let id = NEXT_TESTBED.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}{}t{id}", std::process::id())
}

/// Runs `f` on a new thread inside network namespace `netns` (a name under [`NETNS_DIR`]) and
/// returns its result; a panic in `f` is propagated. Works for any namespace, e.g. the switch
/// or one made by `scripts/testbed.sh`.
pub fn run_in_netns<R, F>(netns: &str, f: F) -> Result<R>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    match spawn_in_netns(netns, f)?.join() {
        Ok(r) => Ok(r),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Starts `f` on a new thread inside network namespace `netns`. Returns once the thread has
/// entered the namespace (or failed to, which is returned as the error and `f` never runs).
pub fn spawn_in_netns<R, F>(netns: &str, f: F) -> Result<JoinHandle<R>>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let path = netns_path(netns);
    let file = File::open(&path).map_err(|source| TestbedError::Io {
        context: format!("open network namespace {}", path.display()),
        source,
    })?;
    let (tx, rx) = mpsc::sync_channel::<nix::Result<()>>(1);
    let handle = thread::Builder::new()
        .name(format!("netns {netns}"))
        .spawn(move || {
            // setns with CLONE_NEWNET moves only this thread; the rest of the process stays.
            let entered = setns(&file, CloneFlags::CLONE_NEWNET);
            drop(file);
            let ok = entered.is_ok();
            let _ = tx.send(entered);
            if !ok {
                // Not `panic!`: the caller reports the error, the panic hook need not print.
                std::panic::resume_unwind(Box::new("setns failed"));
            }
            f()
        })
        .map_err(|source| TestbedError::Io {
            context: format!("spawn a thread for netns {netns}"),
            source,
        })?;
    match rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(source)) => {
            let _ = handle.join();
            Err(TestbedError::Sys {
                context: format!("setns into {}", path.display()),
                source,
            })
        }
        // The thread died before reporting; cannot happen short of an allocation failure.
        Err(_) => {
            let _ = handle.join();
            Err(TestbedError::Sys {
                context: format!("setns into {}: thread ended early", path.display()),
                source: nix::errno::Errno::EIO,
            })
        }
    }
}

/// Runs `args` inside network namespace `netns` via `ip netns exec`, killed after `timeout`.
/// Returns its stdout; a non-zero exit is an error carrying its stderr.
pub fn exec_in_netns(netns: &str, args: &[&str], timeout: Duration) -> Result<String> {
    if args.is_empty() {
        return Err(TestbedError::InvalidConfig("exec: empty command".into()));
    }
    let mut full = vec!["netns".to_owned(), "exec".into(), netns.to_owned()];
    full.extend(args.iter().map(|s| (*s).to_owned()));
    let out = run(&Cmd {
        program: "ip",
        args: full,
        netns: Some(netns),
        stdin: None,
        timeout,
    })?;
    Ok(out.stdout)
}

/// Removes namespaces named by this module (`gw<pid>t<n>...`) whose creator pid is not alive,
/// left behind by runs that were killed along with their reaper. Never touches namespaces of
/// live processes (this one included) or names of any other shape. Returns how many it
/// removed.
pub fn cleanup_stale() -> Result<usize> {
    let entries = match std::fs::read_dir(NETNS_DIR) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(source) => {
            return Err(TestbedError::Io {
                context: format!("list {NETNS_DIR}"),
                source,
            })
        }
    };
    let me = std::process::id();
    let mut removed = 0;
    let mut errors = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Some(pid) = creator_pid(&name) else {
            continue;
        };
        if pid == me || pid_alive(pid) {
            continue;
        }
        // Its devices first, for the same reason as in teardown; the switch has none by that
        // name, and a host's peer may be gone already.
        if let Err(e) = ip(Some(&name), &["-n", &name, "link", "del", HOST_IFNAME]) {
            if !is_missing_device(&e) && netns_path(&name).exists() {
                errors.push(e);
                continue;
            }
        }
        match delete_netns(&name) {
            Ok(true) => removed += 1,
            // A concurrent cleanup (another test thread) got there first.
            Ok(false) => {}
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(removed)
    } else {
        Err(TestbedError::Cleanup(errors))
    }
}

/// True when running with effective uid 0.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Privilege gate for tests: true when root. Otherwise prints
/// `SKIPPED: <test_name> needs root (...)` to stderr and returns false, or panics when
/// `GRADWIRE_REQUIRE_PRIV=1` (CI), so that a skip can never pass silently there.
pub fn require_root(test_name: &str) -> bool {
    if is_root() {
        return true;
    }
    if std::env::var_os(REQUIRE_PRIV_ENV).is_some_and(|v| v == "1") {
        panic!(
            "{test_name} needs root and {REQUIRE_PRIV_ENV}=1 forbids skipping it; run the tests \
             as root (e.g. `sudo -E cargo test`)"
        );
    }
    // Written to the stderr handle rather than with `eprintln!`, which the test harness
    // captures and hides for passing tests: a skip must be visible.
    let _ = writeln!(
        io::stderr(),
        "SKIPPED: {test_name} needs root (set {REQUIRE_PRIV_ENV}=1 to fail instead)"
    );
    false
}

/// `198.18.0.(i+1)`, the address of host `i`.
pub fn host_ipv4(i: usize) -> Ipv4Addr {
    let last = u8::try_from(i + 1).unwrap_or(u8::MAX);
    Ipv4Addr::new(198, 18, 0, last)
}

/// Path of the handle of namespace `netns`.
pub fn netns_path(netns: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(netns)
}

/// The MAC we give host `i`: locally administered, unicast, `02:67:77:00:hi:lo` of `i + 1`
/// ("gw" in the middle bytes), so captures are easy to read.
fn host_mac(i: usize) -> [u8; 6] {
    let n = u16::try_from(i + 1).unwrap_or(u16::MAX).to_be_bytes();
    [0x02, 0x67, 0x77, 0x00, n[0], n[1]]
}

fn mac_string(mac: &[u8; 6]) -> String {
    let parts: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    parts.join(":")
}

/// The creator pid of a namespace name of ours (`gw<pid>t<n>h<i>` or `gw<pid>t<n>sw`), or
/// `None` for any other name. Strict, so that nothing else is ever mistaken for ours.
fn creator_pid(name: &str) -> Option<u32> {
    fn digits(s: &str) -> (&str, &str) {
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        s.split_at(end)
    }
    let rest = name.strip_prefix(PREFIX)?;
    let (pid, rest) = digits(rest);
    let rest = rest.strip_prefix('t')?;
    let (n, rest) = digits(rest);
    if pid.is_empty() || n.is_empty() {
        return None;
    }
    let valid_tail = rest == "sw"
        || rest
            .strip_prefix('h')
            .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        || rest.strip_prefix('-').is_some_and(|node| {
            !node.is_empty()
                && node
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        });
    if !valid_tail {
        return None;
    }
    // Pids are positive i32; anything else (or 0/1, never ours) is not a name we made.
    let pid: u32 = pid.parse().ok()?;
    (pid > 1 && i32::try_from(pid).is_ok()).then_some(pid)
}

/// Whether `pid` exists in our pid namespace. EPERM means it exists but is not ours to signal.
fn pid_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    !matches!(
        kill(Pid::from_raw(raw), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Deletes namespace `ns`; `Ok(false)` if it did not exist.
pub fn delete_netns(ns: &str) -> Result<bool> {
    if !netns_path(ns).exists() {
        return Ok(false);
    }
    match ip(Some(ns), &["netns", "del", ns]) {
        Ok(_) => Ok(true),
        Err(TestbedError::Command { ref stderr, .. }) if stderr.contains("No such file") => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

fn is_missing_device(e: &TestbedError) -> bool {
    matches!(e, TestbedError::Command { stderr, .. }
        if stderr.contains("Cannot find device") || stderr.contains("does not exist"))
}

/// Disables IPv6 in namespace `ns` (all present and future interfaces), from a thread inside
/// it: /proc/sys/net shows the sysctls of the reading thread's namespace. A kernel without
/// IPv6 has nothing to disable.
fn disable_ipv6(ns: &str) -> Result<()> {
    run_in_netns(ns, || -> io::Result<()> {
        for conf in ["default", "all"] {
            let path = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
            match std::fs::write(&path, b"1") {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                r => r?,
            }
        }
        Ok(())
    })?
    .map_err(|source| TestbedError::Io {
        context: format!("disable IPv6 in netns {ns}"),
        source,
    })
}

/// Ifindex and MAC of `ifname` in the calling thread's namespace.
fn link_info(ifname: &str) -> Result<(u32, [u8; 6])> {
    let sys = |source| TestbedError::Sys {
        context: format!("look up interface {ifname}"),
        source,
    };
    let ifindex = nix::net::if_::if_nametoindex(ifname).map_err(sys)?;
    // getifaddrs reports one AF_PACKET entry per interface, carrying its hardware address.
    let mac = nix::ifaddrs::getifaddrs()
        .map_err(sys)?
        .filter(|ifa| ifa.interface_name == ifname)
        .find_map(|ifa| {
            ifa.address
                .and_then(|a| a.as_link_addr().and_then(|l| l.addr()))
        })
        .ok_or(TestbedError::Sys {
            context: format!("no link-layer address for {ifname}"),
            source: nix::errno::Errno::ENODEV,
        })?;
    Ok((ifindex, mac))
}

fn require_tool(tool: &str, hint: &'static str) -> Result<()> {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|dir| dir.join(tool).is_file()));
    if found {
        Ok(())
    } else {
        Err(TestbedError::MissingTool {
            tool: tool.to_owned(),
            hint,
        })
    }
}

/// `ip args...`, about namespace `netns` (for error context), bounded by [`COMMAND_TIMEOUT`].
fn ip(netns: Option<&str>, args: &[&str]) -> Result<CmdOutput> {
    run(&Cmd {
        program: "ip",
        args: args.iter().map(|s| (*s).to_owned()).collect(),
        netns,
        stdin: None,
        timeout: COMMAND_TIMEOUT,
    })
}

/// An external command to run with a time bound.
struct Cmd<'a> {
    program: &'a str,
    args: Vec<String>,
    netns: Option<&'a str>,
    stdin: Option<String>,
    timeout: Duration,
}

impl Cmd<'_> {
    fn line(&self) -> String {
        std::iter::once(self.program)
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[derive(Debug)]
struct CmdOutput {
    stdout: String,
}

/// Runs `cmd`, draining its output on helper threads (a full pipe must not stall the child),
/// and SIGKILLs it once `cmd.timeout` has passed.
fn run(cmd: &Cmd<'_>) -> Result<CmdOutput> {
    let mut child = match Command::new(cmd.program)
        .args(&cmd.args)
        .stdin(if cmd.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(TestbedError::MissingTool {
                tool: cmd.program.to_owned(),
                hint: "install it (scripts/deps.sh installs iproute2 and ethtool)",
            })
        }
        Err(source) => {
            return Err(TestbedError::Spawn {
                command: cmd.line(),
                source,
            })
        }
    };
    if let (Some(input), Some(mut pipe)) = (cmd.stdin.clone(), child.stdin.take()) {
        // A thread, so that a child that does not read cannot block us past the timeout.
        thread::spawn(move || {
            let _ = pipe.write_all(input.as_bytes());
        });
    }
    let stdout = Drain::start(child.stdout.take());
    let stderr = Drain::start(child.stderr.take());
    let status = wait_bounded(&mut child, cmd.timeout);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    // The child is gone; its pipes close unless it left a grandchild holding them, so wait
    // only briefly for the ends and otherwise take what was read so far.
    let grace = Instant::now() + Duration::from_secs(1);
    let stdout = stdout.finish(grace);
    let stderr = String::from_utf8_lossy(&stderr.finish(grace))
        .trim()
        .to_owned();
    match status {
        None => Err(TestbedError::Timeout {
            command: cmd.line(),
            netns: cmd.netns.map(str::to_owned),
            timeout: cmd.timeout,
            stderr,
        }),
        Some(s) if !s.success() => Err(TestbedError::Command {
            command: cmd.line(),
            netns: cmd.netns.map(str::to_owned),
            status: s.to_string(),
            stderr,
        }),
        Some(_) => Ok(CmdOutput {
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
        }),
    }
}

/// Reads a pipe to its end on a thread, keeping what it read available at any time.
struct Drain {
    buf: Arc<Mutex<Vec<u8>>>,
    done: mpsc::Receiver<()>,
}

impl Drain {
    fn start<P: Read + Send + 'static>(pipe: Option<P>) -> Drain {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let (tx, done) = mpsc::sync_channel(1);
        if let Some(mut pipe) = pipe {
            let buf = Arc::clone(&buf);
            thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                    lock(&buf).extend_from_slice(&chunk[..n]);
                }
                let _ = tx.send(());
            });
        }
        Drain { buf, done }
    }

    /// Waits for end of file until `deadline`, then returns everything read.
    fn finish(self, deadline: Instant) -> Vec<u8> {
        let _ = self
            .done
            .recv_timeout(deadline.saturating_duration_since(Instant::now()));
        std::mem::take(&mut *lock(&self.buf))
    }
}

/// Locks `m`, ignoring poisoning: the data is plain bytes, valid whatever panicked.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits for `child` up to `timeout`; `None` if it is still running. Polls with a growing
/// interval: std has no wait-with-timeout, and most commands here end within milliseconds.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(200);
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s),
            Ok(None) => {}
            // ECHILD and the like: nothing left to wait for.
            Err(_) => return None,
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creator_pid_accepts_only_our_names() {
        assert_eq!(creator_pid("gw1234t0h0"), Some(1234));
        assert_eq!(creator_pid("gw1234t17h253"), Some(1234));
        assert_eq!(creator_pid("gw99t3sw"), Some(99));
        // The fabric's testbeds: `<prefix>-<node>`.
        assert_eq!(creator_pid("gw1234t2-leaf0"), Some(1234));
        for other in [
            "gw1234t2-",
            "gw1234t2-Leaf",
            "gw1234t2-a-b",
            "gwtls-leaf0",
            "gwshh0",
            "gwshsw",
            "gwk-1234-a",
            "gw1234",
            "gw1234t",
            "gw1234t0",
            "gw1234t0h",
            "gw1234t0hx",
            "gw1234t0h1x",
            "gw1234t0swx",
            "gwt0h0",
            "gw1t0h0",
            "gw0t0h0",
            "gw99999999999t0h0",
            "xgw1234t0h0",
        ] {
            assert_eq!(creator_pid(other), None, "{other}");
        }
    }

    #[test]
    fn addresses_and_macs() {
        assert_eq!(host_ipv4(0), Ipv4Addr::new(198, 18, 0, 1));
        assert_eq!(host_ipv4(253), Ipv4Addr::new(198, 18, 0, 254));
        assert_eq!(mac_string(&host_mac(0)), "02:67:77:00:00:01");
        assert_eq!(mac_string(&host_mac(255)), "02:67:77:00:01:00");
    }

    #[test]
    fn config_validation() {
        assert!(TestbedConfig::default().validate().is_ok());
        assert!(TestbedConfig::with_hosts(1).validate().is_err());
        assert!(TestbedConfig::with_hosts(MAX_HOSTS + 1).validate().is_err());
        let q0 = TestbedConfig {
            queues: 0,
            ..TestbedConfig::default()
        };
        assert!(q0.validate().is_err());
    }

    #[test]
    fn missing_program_is_a_clear_error() {
        let err = run(&Cmd {
            program: "gradwire-no-such-tool",
            args: vec![],
            netns: None,
            stdin: None,
            timeout: Duration::from_secs(1),
        })
        .unwrap_err();
        assert!(
            matches!(err, TestbedError::MissingTool { ref tool, .. } if tool == "gradwire-no-such-tool"),
            "{err}"
        );
        assert!(require_tool("gradwire-no-such-tool", "x").is_err());
        assert!(require_tool("sh", "x").is_ok());
    }

    #[test]
    fn commands_are_bounded_and_report_stderr() {
        let start = Instant::now();
        let err = run(&Cmd {
            program: "sh",
            args: vec!["-c".into(), "echo about to hang >&2; exec sleep 30".into()],
            netns: None,
            stdin: None,
            timeout: Duration::from_millis(200),
        })
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(matches!(err, TestbedError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("about to hang"), "{err}");

        let err = run(&Cmd {
            program: "sh",
            args: vec!["-c".into(), "echo broken >&2; exit 3".into()],
            netns: Some("gwx"),
            stdin: None,
            timeout: Duration::from_secs(5),
        })
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("broken") && msg.contains("gwx") && msg.contains('3'),
            "{msg}"
        );

        let out = run(&Cmd {
            program: "cat",
            args: vec![],
            netns: None,
            stdin: Some("hello\n".into()),
            timeout: Duration::from_secs(5),
        })
        .unwrap();
        assert_eq!(out.stdout, "hello\n");
    }
}
