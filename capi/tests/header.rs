//! include/gradwire.h is what cbindgen makes of the crate today: regenerated here and
//! compared, so the committed header (what C users read and scripts/capi.sh installs) can
//! never drift from the library. `GRADWIRE_BLESS=1` rewrites it instead of failing, on a
//! developer's machine only: with `CI=true` or `GRADWIRE_REQUIRE_PRIV=1` (what `.ci/run`
//! sets) it is refused, so CI always checks and never blesses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    // Parsing the sources directly (not through `cargo metadata`) keeps cargo out of the test.
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen failed on capi/src");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = dir.join("include/gradwire.h");
    if bless_requested(|k| std::env::var(k).ok()) {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is out of date with capi/src: run `GRADWIRE_BLESS=1 cargo test -p gradwire-capi \
         --test header` and commit the result",
        path.display()
    );
}

/// Whether to rewrite the header: `GRADWIRE_BLESS=1`, which must not be set in CI (panics).
fn bless_requested(var: impl Fn(&str) -> Option<String>) -> bool {
    let is = |k: &str, v: &str| var(k).is_some_and(|x| x.eq_ignore_ascii_case(v));
    if !is("GRADWIRE_BLESS", "1") {
        return false;
    }
    assert!(
        !is("CI", "true") && !is("GRADWIRE_REQUIRE_PRIV", "1"),
        "GRADWIRE_BLESS=1 rewrites include/gradwire.h instead of checking it: it is for a \
         developer's machine, never CI (CI=true or GRADWIRE_REQUIRE_PRIV=1 is set): unset it"
    );
    true
}

#[test]
fn bless_is_refused_in_ci_and_needs_exactly_1() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    };
    assert!(!bless_requested(env(&[])));
    assert!(!bless_requested(env(&[
        ("GRADWIRE_BLESS", "0"),
        ("CI", "true")
    ])));
    assert!(bless_requested(env(&[("GRADWIRE_BLESS", "1")])));
    assert!(bless_requested(env(&[
        ("GRADWIRE_BLESS", "1"),
        ("CI", "false"),
        ("GRADWIRE_REQUIRE_PRIV", "0"),
    ])));
    for ci in [
        &[("GRADWIRE_BLESS", "1"), ("CI", "true")][..],
        &[("GRADWIRE_BLESS", "1"), ("CI", "TRUE")][..],
        &[("GRADWIRE_BLESS", "1"), ("GRADWIRE_REQUIRE_PRIV", "1")][..],
    ] {
        let ci: &'static [(&'static str, &'static str)] = ci;
        let r = std::panic::catch_unwind(|| bless_requested(env(ci)));
        assert!(r.is_err(), "{ci:?} must refuse to bless");
    }
}
