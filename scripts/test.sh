#!/usr/bin/env bash
# The whole test suite: formatting, lints, fuzz-target and bench builds, then every test.
# Tests that need root (network namespaces) skip with a visible message when not root, and
# fail instead when GRADWIRE_REQUIRE_PRIV=1 (as CI runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

step() { printf '\n== %s\n' "$*" >&2; }

# A fresh clone (CI) gains nothing from incremental compilation, which doubles target/'s size.
if [[ -n ${CI:-} ]]; then export CARGO_INCREMENTAL=0; fi
# The suite needs about 12 GiB (target/ and the venv with torch): say so before failing late.
free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
if ((free_kib < 12 * 1024 * 1024)); then
    echo "test: only $((free_kib / 1024 / 1024)) GiB free on $(df -P . | awk 'NR == 2 { print $6 }'); the suite needs about 12 GiB (cargo's target/ and .venv/ with torch): free some disk (cargo clean in other checkouts) and run again" >&2
    exit 1
fi

step "rustfmt"
cargo fmt --all -- --check

step "clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "benches build"
cargo bench --workspace --no-run --locked

if [[ -f fuzz/Cargo.toml ]]; then
    step "fuzz targets build"
    bash scripts/fuzz.sh build
fi

step "NIC tuning profiles (dry run)"
bash hw-configs/nic-tuning/test-dry-run.sh

step "tests"
cargo test --workspace --locked --no-fail-fast

# The Python package, the PyTorch DDP hook and the convergence experiment's short run: a venv
# in .venv/ (numpy, torch, scikit-learn, pytest, maturin, matplotlib; installed once, then
# only when python/requirements-dev.txt changes), the package built from source every time.
step "Python package and PyTorch hook (pytest)"
source scripts/python-env.sh
"$VENV_PY" -m pytest python/tests -q -p no:cacheprovider
