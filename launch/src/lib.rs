//! Rank processes on one machine: the one launcher behind `gradwire job run` (a job file's
//! ranks, a `gradwire job worker` each, see `gradwire-job`) and `gradwire experiment wan` (a
//! WAN topology's sites, a `gradwire wan node` each, see `gradwire-experiment`).
//!
//! - [`Ranks::start`] starts one rank's process ([`RankCommand`]: a program, its arguments
//!   and environment, in a network namespace through `ip netns exec`, or in this one) with
//!   stdin closed and stdout and stderr read as they come by a thread each, so no pipe
//!   fills up: stdout is kept whole (a rank's report); each stderr line is offered to the
//!   caller's hook first (progress lines, which it consumes) and kept otherwise.
//! - [`Ranks::supervise`] waits for the ranks: until all have exited, one has failed (if
//!   asked), the deadline has passed or the stop flag is set (Ctrl-C), running the
//!   caller's tick between polls.
//! - [`Ranks::finish`] kills and reaps whatever still runs and hands back each rank's
//!   output and how it ended. Dropping [`Ranks`] kills and reaps every rank still running,
//!   so no error path leaves one behind.
//!
//! A rank started with [`RankCommand::die_with_launcher`] finds this process's pid in
//! [`PARENT_VAR`]; calling [`die_with_launcher`] first thing, it asks the kernel for SIGKILL
//! when the launcher dies (`PR_SET_PDEATHSIG`), so a launcher killed outright (SIGKILL, no
//! cleanup of its own) leaves no rank running.
#![deny(unsafe_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The launcher sets this in the environment of a rank started with
/// [`RankCommand::die_with_launcher`] to its own pid (see [`die_with_launcher`]).
pub const PARENT_VAR: &str = "GRADWIRE_JOB_RUN_PARENT";

/// How often [`Ranks::supervise`] looks at the ranks.
pub const POLL: Duration = Duration::from_millis(20);

/// One rank's process.
#[derive(Debug, Clone, Default)]
pub struct RankCommand {
    /// The network namespace it runs in (`ip netns exec NS PROGRAM ...`: `ip` execs the
    /// program without forking, so the rank is this process's child); `None`: this one.
    pub netns: Option<String>,
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set in its environment (on top of this process's).
    pub env: Vec<(String, String)>,
    /// Set [`PARENT_VAR`] to this process's pid: a rank that calls [`die_with_launcher`]
    /// then dies with this process. The kernel's signal follows the thread that forked, so
    /// start such ranks from a thread that lives as long as the launcher (its main thread).
    pub die_with_launcher: bool,
}

impl RankCommand {
    fn command(&self) -> Command {
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.program);
                c
            }
            None => Command::new(&self.program),
        };
        cmd.args(&self.args);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        if self.die_with_launcher {
            cmd.env(PARENT_VAR, std::process::id().to_string());
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }
}

/// How a rank ended: its exit status and when (since the launcher started its ranks).
pub type Exit = (ExitStatus, Duration);

#[derive(Debug)]
struct Proc {
    child: Option<Child>,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
    ended: Option<Exit>,
}

/// The rank processes of one launch, rank `i` the `i`-th started; dropping this kills and
/// reaps whatever still runs.
#[derive(Debug)]
pub struct Ranks {
    started: Instant,
    procs: Vec<Proc>,
}

impl Default for Ranks {
    fn default() -> Self {
        Ranks::new()
    }
}

/// What [`Ranks::supervise`] waits for.
#[derive(Debug, Clone, Copy)]
pub struct Supervision<'a> {
    /// The longest the ranks may run, from [`Ranks::new`].
    pub deadline: Duration,
    /// Set (Ctrl-C) to stop waiting.
    pub stop: &'a AtomicBool,
    /// Stop waiting as soon as a rank exits unsuccessfully.
    pub end_on_failure: bool,
}

/// Why [`Ranks::supervise`] stopped waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// Every rank exited (each successfully, when ending on failure).
    AllExited,
    /// These ranks exited unsuccessfully (only when ending on failure), ascending.
    Failed(Vec<usize>),
    /// The deadline passed with these ranks still running, ascending.
    Deadline {
        /// The ranks still running.
        running: Vec<usize>,
    },
    /// The stop flag was set.
    Interrupted,
}

/// What one rank left behind.
#[derive(Debug)]
pub struct RankOutput {
    /// The rank.
    pub rank: usize,
    /// How it ended, if it had ended before it was killed ([`Ranks::poll`] saw it).
    pub ended: Option<Exit>,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// The lines it wrote to stderr that its hook did not consume, each ending in `\n`.
    pub stderr: String,
}

impl Ranks {
    /// No ranks yet; the clock of deadlines and exit times starts now.
    pub fn new() -> Ranks {
        Ranks {
            started: Instant::now(),
            procs: Vec::new(),
        }
    }

    /// Start the next rank (its number is returned). `on_stderr_line` sees each line it
    /// writes to stderr, on the rank's reader thread: a line it returns `true` for is
    /// consumed (a progress line), any other is kept for [`RankOutput::stderr`].
    pub fn start(
        &mut self,
        cmd: &RankCommand,
        mut on_stderr_line: impl FnMut(&str) -> bool + Send + 'static,
    ) -> std::io::Result<usize> {
        let mut child = cmd.command().spawn()?;
        let out = child.stdout.take();
        let err = child.stderr.take();
        let stdout = std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut o) = out {
                let _ = o.read_to_string(&mut s);
            }
            s
        });
        let stderr = std::thread::spawn(move || {
            let mut kept = String::new();
            let Some(e) = err else { return kept };
            for line in BufReader::new(e).lines() {
                let Ok(line) = line else { break };
                if !on_stderr_line(&line) {
                    kept.push_str(&line);
                    kept.push('\n');
                }
            }
            kept
        });
        self.procs.push(Proc {
            child: Some(child),
            stdout: Some(stdout),
            stderr: Some(stderr),
            ended: None,
        });
        Ok(self.procs.len() - 1)
    }

    /// Ranks started.
    pub fn len(&self) -> usize {
        self.procs.len()
    }

    /// No rank started.
    pub fn is_empty(&self) -> bool {
        self.procs.is_empty()
    }

    /// Time since [`Ranks::new`].
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Look at every rank not known to have ended; the ranks seen to have ended now,
    /// ascending (their [`Ranks::ended`] is set from here on).
    pub fn poll(&mut self) -> Vec<usize> {
        let now = self.started.elapsed();
        let mut newly = Vec::new();
        for (r, p) in self.procs.iter_mut().enumerate() {
            if p.ended.is_some() {
                continue;
            }
            if let Some(Ok(Some(s))) = p.child.as_mut().map(Child::try_wait) {
                p.ended = Some((s, now));
                newly.push(r);
            }
        }
        newly
    }

    /// How rank `rank` ended, if a [`Ranks::poll`] saw it end.
    pub fn ended(&self, rank: usize) -> Option<Exit> {
        self.procs.get(rank).and_then(|p| p.ended)
    }

    /// The ranks not seen to have ended, ascending.
    pub fn running(&self) -> Vec<usize> {
        (0..self.procs.len())
            .filter(|&r| self.procs[r].ended.is_none())
            .collect()
    }

    /// Send rank `rank` SIGKILL (a later [`Ranks::poll`] sees it end).
    pub fn kill(&mut self, rank: usize) {
        if let Some(c) = self.procs.get_mut(rank).and_then(|p| p.child.as_mut()) {
            let _ = c.kill();
        }
    }

    /// Kill and reap every rank; the ones that were still running, ascending.
    pub fn kill_running(&mut self) -> Vec<usize> {
        let mut stopped = Vec::new();
        for (r, p) in self.procs.iter_mut().enumerate() {
            if let Some(mut child) = p.child.take() {
                if matches!(child.try_wait(), Ok(None)) {
                    stopped.push(r);
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        stopped
    }

    /// Wait as `how` says, polling every [`POLL`] and calling `tick` before each poll
    /// (sampling counters, injecting faults with [`Ranks::kill`]).
    pub fn supervise(&mut self, how: &Supervision<'_>, mut tick: impl FnMut(&mut Ranks)) -> Ended {
        loop {
            if how.stop.load(Ordering::Relaxed) {
                return Ended::Interrupted;
            }
            tick(self);
            let newly = self.poll();
            if how.end_on_failure {
                let failed: Vec<usize> = newly
                    .into_iter()
                    .filter(|&r| self.ended(r).is_some_and(|(s, _)| !s.success()))
                    .collect();
                if !failed.is_empty() {
                    return Ended::Failed(failed);
                }
            }
            if self.procs.iter().all(|p| p.ended.is_some()) {
                return Ended::AllExited;
            }
            if self.started.elapsed() > how.deadline {
                return Ended::Deadline {
                    running: self.running(),
                };
            }
            std::thread::sleep(POLL);
        }
    }

    /// Kill and reap whatever still runs, and each rank's output, in rank order. The output
    /// is complete when the rank's pipes close: a rank must not leave processes of its own
    /// holding them (`ip netns exec` execs the program, so the rank is the program itself).
    pub fn finish(mut self) -> Vec<RankOutput> {
        self.kill_running();
        std::mem::take(&mut self.procs)
            .into_iter()
            .enumerate()
            .map(|(rank, mut p)| RankOutput {
                rank,
                ended: p.ended,
                stdout: p
                    .stdout
                    .take()
                    .and_then(|h| h.join().ok())
                    .unwrap_or_default(),
                stderr: p
                    .stderr
                    .take()
                    .and_then(|h| h.join().ok())
                    .unwrap_or_default(),
            })
            .collect()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_running();
    }
}

/// Why a rank cannot die with its launcher.
#[derive(Debug, thiserror::Error)]
pub enum DeathError {
    /// `prctl(PR_SET_PDEATHSIG)` failed.
    #[error("cannot ask to die with the launcher that started this rank: {0}")]
    Signal(nix::Error),
    /// The launcher died before the request took effect.
    #[error("the launcher that started this rank (pid {pid}) is gone: not starting without it")]
    LauncherGone {
        /// The launcher's pid, from [`PARENT_VAR`].
        pid: u32,
    },
}

/// The rank side of [`RankCommand::die_with_launcher`]: when [`PARENT_VAR`] names the
/// launcher, ask the kernel for SIGKILL when it dies, so a launcher killed outright leaves
/// no rank running (nothing to do without the variable). `ip netns exec` execs the rank
/// without forking, so the launcher is this process's parent; if it died before the
/// request took effect, the parent is already someone else: stop here
/// ([`DeathError::LauncherGone`]).
pub fn die_with_launcher() -> Result<(), DeathError> {
    let Some(pid) = std::env::var(PARENT_VAR)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    else {
        return Ok(());
    };
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .map_err(DeathError::Signal)?;
    if i64::from(nix::unistd::getppid().as_raw()) != i64::from(pid) {
        return Err(DeathError::LauncherGone { pid });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::sync::mpsc;

    fn sh(script: &str) -> RankCommand {
        RankCommand {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            ..RankCommand::default()
        }
    }

    fn never() -> AtomicBool {
        AtomicBool::new(false)
    }

    #[test]
    fn output_is_collected_and_progress_lines_go_to_the_hook() {
        let mut ranks = Ranks::new();
        let (tx, rx) = mpsc::channel();
        for r in 0..2 {
            let tx = tx.clone();
            let script = format!(
                "echo \"rank {r}: step 1\" >&2; echo warn >&2; echo \"rank {r}: step 2\" >&2; \
                 echo \"{{\\\"rank\\\": {r}}}\""
            );
            let mark = format!("rank {r}: step ");
            let got = ranks
                .start(&sh(&script), move |line| {
                    let Some(k) = line.strip_prefix(&mark) else {
                        return false;
                    };
                    tx.send((r, k.to_owned())).unwrap();
                    true
                })
                .unwrap();
            assert_eq!(got, r);
        }
        drop(tx);
        let stop = never();
        let how = Supervision {
            deadline: Duration::from_secs(60),
            stop: &stop,
            end_on_failure: true,
        };
        let mut ticks = 0;
        assert_eq!(ranks.supervise(&how, |_| ticks += 1), Ended::AllExited);
        assert!(ticks >= 1);
        let out = ranks.finish();
        let mut steps: Vec<(usize, String)> = rx.iter().collect();
        steps.sort();
        assert_eq!(steps.len(), 4, "{steps:?}");
        for (r, o) in out.iter().enumerate() {
            assert_eq!(o.rank, r);
            assert!(o.ended.unwrap().0.success());
            assert_eq!(o.stdout.trim(), format!("{{\"rank\": {r}}}"));
            assert_eq!(o.stderr, "warn\n");
        }
    }

    #[test]
    fn a_failure_ends_the_wait_and_the_others_are_stopped() {
        let mut ranks = Ranks::new();
        ranks.start(&sh("exec sleep 60"), |_| false).unwrap();
        ranks.start(&sh("echo bad >&2; exit 3"), |_| false).unwrap();
        let stop = never();
        let how = Supervision {
            deadline: Duration::from_secs(60),
            stop: &stop,
            end_on_failure: true,
        };
        assert_eq!(ranks.supervise(&how, |_| {}), Ended::Failed(vec![1]));
        assert_eq!(ranks.running(), vec![0]);
        assert_eq!(ranks.kill_running(), vec![0]);
        let out = ranks.finish();
        assert!(out[0].ended.is_none());
        assert_eq!(out[1].ended.unwrap().0.code(), Some(3));
        assert_eq!(out[1].stderr, "bad\n");
    }

    #[test]
    fn without_ending_on_failure_every_rank_is_waited_for_and_a_killed_rank_is_seen() {
        let mut ranks = Ranks::new();
        ranks.start(&sh("exit 1"), |_| false).unwrap();
        ranks.start(&sh("exec sleep 60"), |_| false).unwrap();
        let stop = never();
        let how = Supervision {
            deadline: Duration::from_secs(60),
            stop: &stop,
            end_on_failure: false,
        };
        // The tick kills rank 1 once rank 0 is seen to have ended.
        let ended = ranks.supervise(&how, |ranks| {
            if ranks.ended(0).is_some() {
                ranks.kill(1);
            }
        });
        assert_eq!(ended, Ended::AllExited);
        let (s, _) = ranks.ended(1).unwrap();
        assert!(!s.success() && s.code().is_none(), "{s}");
    }

    #[test]
    fn the_deadline_and_the_stop_flag_end_the_wait() {
        let mut ranks = Ranks::new();
        ranks.start(&sh("exit 0"), |_| false).unwrap();
        ranks.start(&sh("exec sleep 60"), |_| false).unwrap();
        let stop = never();
        let how = Supervision {
            deadline: Duration::from_millis(300),
            stop: &stop,
            end_on_failure: true,
        };
        assert_eq!(
            ranks.supervise(&how, |_| {}),
            Ended::Deadline { running: vec![1] }
        );
        stop.store(true, Ordering::Relaxed);
        assert_eq!(ranks.supervise(&how, |_| {}), Ended::Interrupted);
        // Dropping kills the sleeper: finish returns at once.
        let out = ranks.finish();
        assert!(out[1].ended.is_none());
    }

    #[test]
    fn a_rank_that_should_die_with_the_launcher_gets_its_pid() {
        let mut ranks = Ranks::new();
        let mut cmd = sh(&format!("echo ${PARENT_VAR}; echo $GW_X"));
        cmd.env.push(("GW_X".into(), "x".into()));
        cmd.die_with_launcher = true;
        ranks.start(&cmd, |_| false).unwrap();
        ranks
            .start(&sh(&format!("echo \"${PARENT_VAR}\"")), |_| false)
            .unwrap();
        let stop = never();
        let how = Supervision {
            deadline: Duration::from_secs(60),
            stop: &stop,
            end_on_failure: true,
        };
        assert_eq!(ranks.supervise(&how, |_| {}), Ended::AllExited);
        let out = ranks.finish();
        assert_eq!(out[0].stdout, format!("{}\nx\n", std::process::id()));
        assert_eq!(out[1].stdout, "\n");
    }

    #[test]
    fn a_missing_program_is_an_error_at_start() {
        let mut ranks = Ranks::new();
        let cmd = RankCommand {
            program: "/nonexistent/gradwire".into(),
            ..RankCommand::default()
        };
        assert!(ranks.start(&cmd, |_| false).is_err());
        assert!(ranks.is_empty());
    }
}
