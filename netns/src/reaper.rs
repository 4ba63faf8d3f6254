//! Cleanup when this process dies without tearing down: the reaper process of each group of
//! temporary namespaces, and [`cleanup_stale`] for groups whose reaper died too.

use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::kill;
use nix::unistd::Pid;

use crate::cmd::{wait_bounded, COMMAND_TIMEOUT};
use crate::error::{NetnsError, Result};
use crate::ns::{creator_pid, delete_netns, NETNS_DIR};

/// How long teardown waits for the reaper to acknowledge "done" before killing it.
const REAPER_WAIT: Duration = Duration::from_secs(2);

/// The process that removes a group's namespaces if we die without tearing down: a tiny `sh`
/// in its own process group (so a terminal's Ctrl-C does not reach it) holding the read end
/// of a pipe. If this process dies in any way, SIGKILL included (which no in-process handler
/// could catch), the pipe reaches EOF and the reaper deletes the namespaces by the teardown
/// rule.
#[derive(Debug)]
pub struct Reaper {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Reaper {
    /// Reads one line; "done" means we cleaned up ourselves, anything else (EOF because this
    /// process died) means delete the namespaces named in the arguments: every device but
    /// `lo` first (the names in `ip -o link show` are `gw0@if3:` or `br0:`), then the handle.
    const SCRIPT: &'static str = r#"IFS= read -r line || line=
[ "$line" = done ] && exit 0
for ns do
  ip -n "$ns" -o link show 2>/dev/null | while read -r _ dev _; do
    dev=${dev%:}; dev=${dev%%@*}
    [ "$dev" = lo ] || ip -n "$ns" link del "$dev" 2>/dev/null
  done
  ip netns del "$ns" 2>/dev/null
done
exit 0"#;

    /// Starts the reaper for `namespaces`.
    pub fn spawn(namespaces: &[String]) -> io::Result<Reaper> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(Self::SCRIPT)
            .arg("gradwire-netns-reaper")
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

/// Removes temporary namespaces (`gw<pid>t<n>...`, see [`crate::new_netns_prefix`]) whose
/// creator pid is not alive, left behind by runs that were killed along with their reaper
/// (e.g. a whole cgroup was killed). Never touches namespaces of live processes (this one
/// included) or names of any other shape. Liveness is judged by `kill(pid, 0)` in this pid
/// namespace; a recycled pid merely postpones the cleanup. Returns how many it removed.
pub fn cleanup_stale() -> Result<usize> {
    let entries = match std::fs::read_dir(NETNS_DIR) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(source) => {
            return Err(NetnsError::Io {
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
        match delete_netns(&name) {
            Ok(true) => removed += 1,
            // A concurrent cleanup (another test thread) got there first.
            Ok(false) => {}
            Err(e) => errors.push(e),
        }
    }
    NetnsError::from_cleanup(errors).map(|()| removed)
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
