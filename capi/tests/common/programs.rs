//! Building and running programs outside Rust (the C and MPI examples): where the repository
//! and the libraries cargo built are, and a command that must succeed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The directory holding the libgradwire_c.so/.a that cargo built with this test (the same
/// compilation as the rlib the test links: never stale).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        if dir.join("libgradwire_c.so").is_file() && dir.join("libgradwire_c.a").is_file() {
            return dir.to_path_buf();
        }
    }
    panic!("libgradwire_c.so/.a not found next to {}", exe.display());
}

/// Runs `cmd` and returns its standard output; panics with both outputs unless it exits 0.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("{what}: cannot run: {e} (scripts/deps.sh installs gcc, pkg-config, Open MPI)")
    });
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
