//! Network namespaces: names, handles under [`NETNS_DIR`], creation, deletion by the
//! teardown rule (see the crate documentation), entering one, and [`NamespaceSet`], a group
//! of namespaces that removes itself.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};

use nix::sched::{setns, CloneFlags};

use crate::cmd::{ip, is_missing_device, require_tool};
use crate::error::{NetnsError, Result};
use crate::privilege::ensure_root;
use crate::reaper::{cleanup_stale, Reaper};

/// Where `ip netns` keeps its namespace handles.
pub const NETNS_DIR: &str = "/run/netns";
/// Common prefix of every temporary namespace of the kit; a decimal pid always follows it.
pub const PREFIX: &str = "gw";

/// Numbers the namespace groups of this process, so that their names differ.
static NEXT_GROUP: AtomicU32 = AtomicU32::new(0);

/// Path of the handle of namespace `netns`.
pub fn netns_path(netns: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(netns)
}

/// A fresh name prefix `gw<pid>t<n>` for a group of temporary namespaces of this process.
/// Names `<prefix>h<i>`, `<prefix>sw` and `<prefix>-<node>` (`node` of a-z 0-9) are the ones
/// [`cleanup_stale`] and [`NamespaceSet::temporary`] accept.
pub fn new_netns_prefix() -> String {
    let id = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}{}t{id}", std::process::id())
}

/// Namespaces under [`NETNS_DIR`] named `<prefix>-<node>` (node of a-z 0-9), sorted.
pub fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| {
            n.strip_prefix(prefix)
                .and_then(|r| r.strip_prefix('-'))
                .is_some_and(is_node_name)
        })
        .collect();
    out.sort();
    out
}

fn is_node_name(node: &str) -> bool {
    !node.is_empty()
        && node
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The creator pid of a temporary namespace name (`gw<pid>t<n>h<i>`, `gw<pid>t<n>sw` or
/// `gw<pid>t<n>-<node>`), or `None` for any other name. Strict, so that nothing else is ever
/// mistaken for ours.
pub(crate) fn creator_pid(name: &str) -> Option<u32> {
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
        || rest.strip_prefix('-').is_some_and(is_node_name);
    if !valid_tail {
        return None;
    }
    // Pids are positive i32; anything else (or 0/1, never ours) is not a name we made.
    let pid: u32 = pid.parse().ok()?;
    (pid > 1 && i32::try_from(pid).is_ok()).then_some(pid)
}

/// Creates namespace `ns` (deleting a leftover of that name first: temporary names carry
/// their creator's pid, so a leftover is ours), disables IPv6 and sets `lo` up.
/// `created` is called once the namespace exists, so that the caller can record it for
/// teardown before anything else can fail.
pub fn create_netns(ns: &str, created: impl FnOnce(&str)) -> Result<()> {
    if netns_path(ns).exists() {
        // Only possible if a previous process with our pid died without cleanup and its
        // reaper was killed too (pid recycled).
        delete_netns(ns)?;
    }
    ip(None, &["netns", "add", ns])?;
    created(ns);
    // Before any interface exists, so that new interfaces inherit `default`: no router
    // solicitations or MLD reports that an AF_XDP receiver would count as foreign traffic.
    disable_ipv6(ns)?;
    ip(Some(ns), &["-n", ns, "link", "set", "lo", "up"])?;
    Ok(())
}

/// Deletes namespace `ns` by the teardown rule: its devices first, then its handle.
/// `Ok(false)` if it did not exist.
pub fn delete_netns(ns: &str) -> Result<bool> {
    if !netns_path(ns).exists() {
        return Ok(false);
    }
    delete_links(ns)?;
    match ip(Some(ns), &["netns", "del", ns]) {
        Ok(_) => Ok(true),
        Err(NetnsError::Command { ref stderr, .. }) if stderr.contains("No such file") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes every device of namespace `ns` but `lo`. Deleting a veth end deletes its peer and
/// detaches XDP programs and AF_XDP sockets from both, at once, whatever still holds the
/// namespace (see the teardown rule in the crate documentation).
pub fn delete_links(ns: &str) -> Result<()> {
    let listing = match ip(Some(ns), &["-n", ns, "-o", "link", "show"]) {
        Ok(out) => out,
        // Deleted by someone else (a concurrent stale cleanup) in the meantime.
        Err(_) if !netns_path(ns).exists() => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut errors = Vec::new();
    for dev in link_names(&listing).into_iter().filter(|d| d != "lo") {
        match ip(Some(ns), &["-n", ns, "link", "del", &dev]) {
            // The peer of a veth deleted a moment ago is gone with it; a namespace gone in
            // the meantime was removed by a concurrent cleanup.
            Err(e) if !is_missing_device(&e) && netns_path(ns).exists() => errors.push(e),
            _ => {}
        }
    }
    NetnsError::from_cleanup(errors)
}

/// Device names from `ip -o link show` (`2: gw0@if3: <...> ...`).
fn link_names(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|n| n.trim_end_matches(':').split('@').next())
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Disables IPv6 in namespace `ns` (all present and future interfaces), from a thread inside
/// it: /proc/sys/net shows the sysctls of the reading thread's namespace. A kernel without
/// IPv6 has nothing to disable.
fn disable_ipv6(ns: &str) -> Result<()> {
    run_in_netns(ns, || -> io::Result<()> {
        for conf in ["default", "all"] {
            match write_ipv6_conf(conf, "disable_ipv6", b"1") {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                r => r?,
            }
        }
        Ok(())
    })?
    .map_err(|source| NetnsError::Io {
        context: format!("disable IPv6 in netns {ns}"),
        source,
    })
}

/// Writes `/proc/sys/net/ipv6/conf/<conf>/<key>` of the calling thread's namespace.
pub(crate) fn write_ipv6_conf(conf: &str, key: &str, value: &[u8]) -> io::Result<()> {
    std::fs::write(format!("/proc/sys/net/ipv6/conf/{conf}/{key}"), value)
}

/// Moves the calling thread into network namespace `netns` (a name under [`NETNS_DIR`]) for
/// good. `setns` with `CLONE_NEWNET` moves only this thread; the rest of the process stays.
/// Sockets the thread creates afterwards belong to `netns` for their whole life.
pub fn enter(netns: &str) -> Result<()> {
    let path = netns_path(netns);
    let file = File::open(&path).map_err(|source| NetnsError::Io {
        context: format!("open network namespace {}", path.display()),
        source,
    })?;
    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Sys {
        context: format!("setns into {}", path.display()),
        source,
    })
}

/// Runs `f` with the calling thread inside `netns`, then returns the thread to the namespace
/// it was in. For code that must stay on its thread (e.g. a pinned one); otherwise
/// [`run_in_netns`] is simpler.
pub fn with_netns<R>(netns: &str, f: impl FnOnce() -> R) -> Result<R> {
    let home_path = "/proc/thread-self/ns/net";
    let home = File::open(home_path).map_err(|source| NetnsError::Io {
        context: format!("open {home_path}"),
        source,
    })?;
    enter(netns)?;
    let r = f();
    // Failing to return would leave this thread in `netns` for good.
    setns(&home, CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Sys {
        context: format!("setns back from {netns}"),
        source,
    })?;
    Ok(r)
}

/// Runs `f` on a new thread inside network namespace `netns` and returns its result; a panic
/// in `f` is propagated. Works for any namespace under [`NETNS_DIR`].
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
    let (tx, rx) = mpsc::sync_channel::<Result<()>>(1);
    let target = netns.to_owned();
    let handle = thread::Builder::new()
        .name(format!("netns {netns}"))
        .spawn(move || {
            let entered = enter(&target);
            let ok = entered.is_ok();
            let _ = tx.send(entered);
            if !ok {
                // Not `panic!`: the caller reports the error, the panic hook need not print.
                std::panic::resume_unwind(Box::new("setns failed"));
            }
            f()
        })
        .map_err(|source| NetnsError::Io {
            context: format!("spawn a thread for netns {netns}"),
            source,
        })?;
    match rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        // The thread died before reporting; cannot happen short of an allocation failure.
        Err(_) => {
            let _ = handle.join();
            Err(NetnsError::Sys {
                context: format!("enter {netns}: thread ended early"),
                source: nix::errno::Errno::EIO,
            })
        }
    }
}

/// A group of namespaces that are removed together, by the teardown rule: on
/// [`NamespaceSet::down`], on drop (also while unwinding) unless persistent, and, for
/// temporary ones, by a reaper process if this process dies first.
#[derive(Debug)]
pub struct NamespaceSet {
    label: String,
    /// Every namespace actually created, in creation order; teardown deletes exactly these.
    created: Vec<String>,
    reaper: Option<Reaper>,
    persistent: bool,
    torn_down: bool,
}

impl NamespaceSet {
    /// Creates `names`, temporary namespaces of this process: each must be a name
    /// [`new_netns_prefix`] describes, with this process's pid, so that the reaper and
    /// [`cleanup_stale`] know it. Removes stale namespaces of dead processes first and starts
    /// a reaper. `label` starts warnings printed to stderr (e.g. `gradwire testbed`). On
    /// error, everything created so far is removed again.
    pub fn temporary(label: &str, names: &[String]) -> Result<NamespaceSet> {
        let me = std::process::id();
        if let Some(bad) = names.iter().find(|n| creator_pid(n) != Some(me)) {
            return Err(NetnsError::InvalidConfig(format!(
                "{bad:?} is not a temporary namespace name of this process (use new_netns_prefix)"
            )));
        }
        ensure_root()?;
        require_tool("ip", "install iproute2 (scripts/deps.sh does)")?;
        // A stale namespace we cannot delete must not stop this run: our names are unique.
        if let Err(e) = cleanup_stale() {
            eprintln!("{label}: warning: stale cleanup: {e}");
        }
        let mut set = NamespaceSet::empty(label, names.len());
        // The reaper first: from here on even a SIGKILL cannot leak namespaces.
        match Reaper::spawn(names) {
            Ok(r) => set.reaper = Some(r),
            Err(e) => eprintln!(
                "{label}: warning: no reaper ({e}); if this process is killed, the next \
                 temporary namespaces remove its namespaces"
            ),
        }
        set.create_all(names)?;
        Ok(set)
    }

    /// Creates `names` to outlive this process: no reaper, left in place on drop (only
    /// [`NamespaceSet::down`] or [`delete_netns`] removes them). Fails with
    /// [`NetnsError::AlreadyExists`] if any of them exists. On error, everything created so
    /// far is removed again.
    pub fn persistent(label: &str, names: &[String]) -> Result<NamespaceSet> {
        ensure_root()?;
        require_tool("ip", "install iproute2 (scripts/deps.sh does)")?;
        if let Some(n) = names.iter().find(|n| netns_path(n).exists()) {
            return Err(NetnsError::AlreadyExists { netns: n.clone() });
        }
        let mut set = NamespaceSet::empty(label, names.len());
        set.create_all(names)?;
        set.persistent = true;
        Ok(set)
    }

    fn empty(label: &str, n: usize) -> NamespaceSet {
        NamespaceSet {
            label: label.to_owned(),
            created: Vec::with_capacity(n),
            reaper: None,
            persistent: false,
            torn_down: false,
        }
    }

    fn create_all(&mut self, names: &[String]) -> Result<()> {
        for ns in names {
            create_netns(ns, |ns| self.created.push(ns.to_owned()))?;
        }
        Ok(())
    }

    /// Every namespace of the set, in creation order.
    pub fn namespaces(&self) -> &[String] {
        &self.created
    }

    /// Whether drop leaves the namespaces in place.
    pub fn is_persistent(&self) -> bool {
        self.persistent
    }

    /// Removes every namespace (persistent or not), reporting every problem; teardown
    /// continues past each.
    pub fn down(mut self) -> Result<()> {
        self.persistent = false;
        NetnsError::from_cleanup(self.teardown())
    }

    /// Deletes the namespaces by the teardown rule, last created first; runs at most once.
    fn teardown(&mut self) -> Vec<NetnsError> {
        if self.torn_down || self.persistent {
            return Vec::new();
        }
        self.torn_down = true;
        let errors: Vec<NetnsError> = self
            .created
            .iter()
            .rev()
            .filter_map(|ns| delete_netns(ns).err())
            .collect();
        if let Some(r) = self.reaper.take() {
            // After a failed deletion, let the reaper try once more instead of dismissing it.
            r.finish(errors.is_empty());
        }
        errors
    }
}

impl Drop for NamespaceSet {
    fn drop(&mut self) {
        // Cannot return errors from Drop, and must not panic during unwinding: report them.
        for e in self.teardown() {
            eprintln!("{}: teardown: {e}", self.label);
        }
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
    fn fresh_prefixes_make_names_the_cleanup_knows() {
        let p = new_netns_prefix();
        assert_ne!(p, new_netns_prefix());
        let me = Some(std::process::id());
        for tail in ["h0", "sw", "-a", "-leaf0"] {
            assert_eq!(creator_pid(&format!("{p}{tail}")), me, "{p}{tail}");
        }
    }

    #[test]
    fn link_names_of_ip_o_link_show() {
        let out = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00\n\
                   2: gw0@if2: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue\\    link/ether 02:67:77:00:00:01\n\
                   3: br0: <BROADCAST,MULTICAST> mtu 1500\n";
        assert_eq!(link_names(out), ["lo", "gw0", "br0"]);
    }

    #[test]
    fn temporary_sets_refuse_names_the_reaper_does_not_know() {
        for bad in ["gwk-1-a", "gwxdp1t0a", "other"] {
            let err = NamespaceSet::temporary("test", &[bad.to_owned()]).unwrap_err();
            assert!(matches!(err, NetnsError::InvalidConfig(_)), "{err}");
        }
    }
}
