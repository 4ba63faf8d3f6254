//! Helpers shared by the CLI's integration tests: running the binary, a child process that
//! cannot outlive a failing test, a temporary directory.

#![allow(clippy::unwrap_used)]
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Output};

/// Runs `gradwire args` to completion.
pub fn gradwire(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gradwire"))
        .args(args)
        .output()
        .unwrap()
}

/// A child process that is killed and reaped when the guard goes out of scope, so a test
/// that fails half-way leaves nothing running.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    pub fn spawn(cmd: &mut Command) -> ChildGuard {
        ChildGuard(Some(cmd.spawn().unwrap()))
    }

    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().unwrap()
    }

    /// Waits for the child to exit and collects its output (the guard no longer owns it).
    pub fn wait_with_output(mut self) -> Output {
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            // Already exited: kill fails harmlessly; wait reaps either way.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A directory of test files, removed on drop; named after the test binary's `prefix`, the
/// process and `tag`, so parallel tests never share one.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str, tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("{prefix}-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    /// Writes `name` in the directory; returns its path.
    pub fn write(&self, name: &str, text: &str) -> String {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
