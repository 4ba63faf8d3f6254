//! The command runner: every external program the kit starts (`ip`, `ethtool`, `tc`) runs
//! with a time bound, its output drained on helper threads, its stderr kept for the error.

use std::io::{self, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{NetnsError, Result};

/// Default bound on every external command.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// An external command to run with a time bound.
#[derive(Debug, Clone)]
pub struct Cmd<'a> {
    /// The program, looked up in `PATH`.
    pub program: &'a str,
    /// Its arguments.
    pub args: Vec<String>,
    /// The namespace it is about, for error messages only.
    pub netns: Option<&'a str>,
    /// What to write to its standard input (null if `None`).
    pub stdin: Option<String>,
    /// When to kill it.
    pub timeout: Duration,
}

impl<'a> Cmd<'a> {
    /// `program args...`, about no namespace, bounded by [`COMMAND_TIMEOUT`].
    pub fn new(program: &'a str, args: &[&str]) -> Cmd<'a> {
        Cmd {
            program,
            args: args.iter().map(|s| (*s).to_owned()).collect(),
            netns: None,
            stdin: None,
            timeout: COMMAND_TIMEOUT,
        }
    }

    fn line(&self) -> String {
        std::iter::once(self.program)
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Runs the command, draining its output on helper threads (a full pipe must not stall
    /// the child), and SIGKILLs it once `timeout` has passed. Returns its stdout; a non-zero
    /// exit is an error carrying its stderr.
    pub fn run(&self) -> Result<String> {
        let mut child = match Command::new(self.program)
            .args(&self.args)
            .stdin(if self.stdin.is_some() {
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
                return Err(NetnsError::MissingTool {
                    tool: self.program.to_owned(),
                    hint: "install it (scripts/deps.sh installs iproute2 and ethtool)",
                })
            }
            Err(source) => {
                return Err(NetnsError::Spawn {
                    command: self.line(),
                    source,
                })
            }
        };
        if let (Some(input), Some(mut pipe)) = (self.stdin.clone(), child.stdin.take()) {
            // A thread, so that a child that does not read cannot block us past the timeout.
            thread::spawn(move || {
                let _ = pipe.write_all(input.as_bytes());
            });
        }
        let stdout = Drain::start(child.stdout.take());
        let stderr = Drain::start(child.stderr.take());
        let status = wait_bounded(&mut child, self.timeout);
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
            None => Err(NetnsError::Timeout {
                command: self.line(),
                netns: self.netns.map(str::to_owned),
                timeout: self.timeout,
                stderr,
            }),
            Some(s) if !s.success() => Err(NetnsError::Command {
                command: self.line(),
                netns: self.netns.map(str::to_owned),
                status: s.to_string(),
                stderr,
            }),
            Some(_) => Ok(String::from_utf8_lossy(&stdout).into_owned()),
        }
    }
}

/// `ip args...`, about namespace `netns` (for error context), bounded by [`COMMAND_TIMEOUT`].
pub fn ip(netns: Option<&str>, args: &[&str]) -> Result<String> {
    Cmd {
        netns,
        ..Cmd::new("ip", args)
    }
    .run()
}

/// Feeds `batch` (one `ip` command per line, without the leading `ip`) to
/// `ip -n netns -batch -`.
pub fn ip_batch(netns: &str, batch: String) -> Result<()> {
    Cmd {
        netns: Some(netns),
        stdin: Some(batch),
        ..Cmd::new("ip", &["-n", netns, "-batch", "-"])
    }
    .run()
    .map(drop)
}

/// Runs `args` inside network namespace `netns` via `ip netns exec`, killed after `timeout`.
/// Returns its stdout; a non-zero exit is an error carrying its stderr.
pub fn exec_in_netns(netns: &str, args: &[&str], timeout: Duration) -> Result<String> {
    if args.is_empty() {
        return Err(NetnsError::InvalidConfig("exec: empty command".into()));
    }
    let mut full = vec!["netns", "exec", netns];
    full.extend_from_slice(args);
    Cmd {
        netns: Some(netns),
        timeout,
        ..Cmd::new("ip", &full)
    }
    .run()
}

/// Fails with [`NetnsError::MissingTool`] unless `tool` is an executable file in `PATH`.
pub fn require_tool(tool: &str, hint: &'static str) -> Result<()> {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|dir| dir.join(tool).is_file()));
    if found {
        Ok(())
    } else {
        Err(NetnsError::MissingTool {
            tool: tool.to_owned(),
            hint,
        })
    }
}

/// Whether `e` says that a device does not exist (e.g. the peer of a veth deleted already).
pub(crate) fn is_missing_device(e: &NetnsError) -> bool {
    matches!(e, NetnsError::Command { stderr, .. }
        if stderr.contains("Cannot find device") || stderr.contains("does not exist"))
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
pub(crate) fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
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
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn missing_program_is_a_clear_error() {
        let err = Cmd {
            timeout: Duration::from_secs(1),
            ..Cmd::new("gradwire-no-such-tool", &[])
        }
        .run()
        .unwrap_err();
        assert!(
            matches!(err, NetnsError::MissingTool { ref tool, .. } if tool == "gradwire-no-such-tool"),
            "{err}"
        );
        assert!(require_tool("gradwire-no-such-tool", "x").is_err());
        assert!(require_tool("sh", "x").is_ok());
    }

    #[test]
    fn commands_are_bounded_and_report_stderr() {
        let start = Instant::now();
        let err = Cmd {
            timeout: Duration::from_millis(200),
            ..Cmd::new("sh", &["-c", "echo about to hang >&2; exec sleep 30"])
        }
        .run()
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(matches!(err, NetnsError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("about to hang"), "{err}");

        let err = Cmd {
            netns: Some("gwx"),
            timeout: Duration::from_secs(5),
            ..Cmd::new("sh", &["-c", "echo broken >&2; exit 3"])
        }
        .run()
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("broken") && msg.contains("gwx") && msg.contains('3'),
            "{msg}"
        );

        let out = Cmd {
            stdin: Some("hello\n".into()),
            timeout: Duration::from_secs(5),
            ..Cmd::new("cat", &[])
        }
        .run()
        .unwrap();
        assert_eq!(out, "hello\n");
    }
}
