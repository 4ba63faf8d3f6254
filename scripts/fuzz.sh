#!/usr/bin/env bash
# Fuzz targets in fuzz/ (cargo-fuzz, libFuzzer, AddressSanitizer) on a stable toolchain.
#
#   scripts/fuzz.sh build            build every target (installs cargo-fuzz if missing)
#   scripts/fuzz.sh run [SECONDS]    build, then run each target for SECONDS (default 30)
#   scripts/fuzz.sh run SECONDS T..  only the named targets (see `cargo fuzz list` in fuzz/)
#
# cargo-fuzz passes nightly flags (-Zsanitizer=address, ...); RUSTC_BOOTSTRAP=1 lets the
# stable compiler accept them, only for the commands below. Builds go to fuzz/target (not the
# workspace's target/); corpora grow in fuzz/corpus/<target>, crash inputs land in
# fuzz/artifacts/<target>/ (all ignored by git). Replay one with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run -O -a <target> <artifact>   (from fuzz/)
# Exit status is non-zero if any target finds a crash.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '3,5p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Same flags for build and run, so `run` reuses the build: optimised, with debug assertions
# and overflow checks (an arithmetic overflow on peer input is a bug worth a crash).
FUZZ_FLAGS=(-O -a)
CARGO_FUZZ_VERSION=0.13.2

setup() {
    if ! command -v cargo >/dev/null 2>&1; then
        for d in "$HOME/.cargo/bin" /root/.cargo/bin /usr/local/cargo/bin; do
            if [[ -x $d/cargo ]]; then export PATH="$d:$PATH"; break; fi
        done
    fi
    command -v cargo >/dev/null 2>&1 || {
        echo "fuzz: cargo not found: install Rust with rustup (https://rustup.rs)" >&2
        exit 1
    }
    # libfuzzer-sys compiles libFuzzer (C++).
    if ! command -v c++ >/dev/null 2>&1; then
        if [[ $(id -u) -ne 0 ]]; then
            echo "fuzz: no C++ compiler: install g++ (run as root to have it installed)" >&2
            exit 1
        fi
        echo "fuzz: installing g++" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends g++ >/dev/null
    fi
    if ! cargo fuzz --version >/dev/null 2>&1; then
        echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION (about a minute)" >&2
        cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
    fi
    export RUSTC_BOOTSTRAP=1
}

build() {
    (cd fuzz && cargo fuzz build "${FUZZ_FLAGS[@]}")
}

run() {
    local secs=${1:-30}
    [[ $secs =~ ^[0-9]+$ ]] || usage
    shift || true
    local targets=("$@")
    if ((${#targets[@]} == 0)); then
        mapfile -t targets < <(cd fuzz && cargo fuzz list)
    fi
    build
    local failed=() t log
    log=$(mktemp)
    for t in "${targets[@]}"; do
        printf '\n== fuzz %s for %ss\n' "$t" "$secs" >&2
        # corpus/<t> persists between runs, so repeated runs keep building on earlier ones;
        # seeds/<t> (versioned, hand-made valid inputs) start a target past its parser.
        local dirs=()
        if [[ -d fuzz/seeds/$t ]]; then
            mkdir -p "fuzz/corpus/$t"
            dirs=("corpus/$t" "seeds/$t")
        fi
        if (cd fuzz && cargo fuzz run "${FUZZ_FLAGS[@]}" "$t" "${dirs[@]}" -- \
            -max_total_time="$secs" -print_final_stats=1) >"$log" 2>&1; then
            grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 >&2 || true
            grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" >&2 || true
        else
            # The panic / sanitizer report, the input and how to reproduce it; all of it in
            # the log if neither marker is there (e.g. a build failure).
            if grep -qE '^SUMMARY:' "$log"; then
                grep -E -m 5 -A 3 'panicked at|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)' "$log" >&2 || true
                sed -n '/^SUMMARY:/,/^Minimize test case/p' "$log" >&2
            else
                tail -n 60 "$log" >&2
            fi
            failed+=("$t")
        fi
    done
    rm -f "$log"
    if ((${#failed[@]})); then
        echo "fuzz: FAILED: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
        return 1
    fi
    echo "fuzz: all targets ran ${secs}s without a crash" >&2
}

case ${1:-} in
build)
    (($# == 1)) || usage
    setup
    build
    ;;
run)
    shift
    setup
    run "$@"
    ;;
*) usage ;;
esac
