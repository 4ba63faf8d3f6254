//! include/gradwire.h is what cbindgen makes of the crate today: regenerated here and
//! compared, so the committed header (what C users read and scripts/capi.sh installs) can
//! never drift from the library. `GRADWIRE_BLESS=1` rewrites it instead of failing.

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
    if std::env::var_os("GRADWIRE_BLESS").is_some_and(|v| v == "1") {
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
