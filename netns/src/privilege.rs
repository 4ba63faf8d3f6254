//! Privilege gates: who may build namespaces, and how tests skip (visibly) or fail.

use std::io::{self, Write};

use crate::error::{NetnsError, Result};

/// Environment variable that turns a skip into a test failure (value `1`), so that CI can
/// never pass a test that did not run.
pub const REQUIRE_PRIV_ENV: &str = "GRADWIRE_REQUIRE_PRIV";

/// True when running with effective uid 0.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `Ok(())` when root, else [`NetnsError::NotRoot`].
pub fn ensure_root() -> Result<()> {
    if is_root() {
        Ok(())
    } else {
        Err(NetnsError::NotRoot {
            euid: nix::unistd::geteuid().as_raw(),
        })
    }
}

/// Whether `GRADWIRE_REQUIRE_PRIV=1` forbids skipping.
pub fn skips_forbidden() -> bool {
    std::env::var_os(REQUIRE_PRIV_ENV).is_some_and(|v| v == "1")
}

/// Privilege gate for tests: true when root. Otherwise prints
/// `SKIPPED: <test_name> needs root (...)` to stderr and returns false, or panics when
/// `GRADWIRE_REQUIRE_PRIV=1` (CI), so that a skip can never pass silently there.
pub fn require_root(test_name: &str) -> bool {
    if is_root() {
        return true;
    }
    if skips_forbidden() {
        panic!(
            "{test_name} needs root and {REQUIRE_PRIV_ENV}=1 forbids skipping it; run the tests \
             as root (e.g. `sudo -E cargo test`)"
        );
    }
    visible(&format!(
        "SKIPPED: {test_name} needs root (set {REQUIRE_PRIV_ENV}=1 to fail instead)"
    ));
    false
}

/// A partial skip: part `part` of test `test_name` cannot run because of `reason`. Prints
/// `SKIPPED: <test_name>: <part>: <reason>` to stderr, or panics when
/// `GRADWIRE_REQUIRE_PRIV=1`, like [`require_root`].
pub fn skip_part(test_name: &str, part: &str, reason: &str) {
    if skips_forbidden() {
        panic!("{test_name}: {part} cannot run ({reason}) and {REQUIRE_PRIV_ENV}=1 forbids skipping it");
    }
    visible(&format!(
        "SKIPPED: {test_name}: {part}: {reason} (set {REQUIRE_PRIV_ENV}=1 to fail instead)"
    ));
}

/// Written to the stderr handle rather than with `eprintln!`, which the test harness captures
/// and hides for passing tests: a skip must be visible.
fn visible(msg: &str) {
    let _ = writeln!(io::stderr(), "{msg}");
}
