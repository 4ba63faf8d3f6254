#!/usr/bin/env bash
# The main job: a complete bounded-loss exchange on this machine. Extra arguments go to
# `gradwire demo` (e.g. --datapath loopback --inject-loss 0.05 --loss-bound 0.01 --json).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release --locked -p gradwire >&2
exec ./target/release/gradwire demo --datapath udp --size 64MiB --count 8 \
    --inject-loss 0.02 --loss-bound 0.01 "$@"
