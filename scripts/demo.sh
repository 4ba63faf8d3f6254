#!/usr/bin/env bash
# The main job: a complete bounded-loss exchange on this machine. As root it runs over AF_XDP
# between two network namespaces it creates (and removes); otherwise over kernel UDP on
# 127.0.0.1. Extra arguments go to `gradwire demo` and win over these defaults
# (e.g. --datapath udp --inject-loss 0.05 --loss-bound 0.01 --json).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release --locked -p gradwire-cli >&2
datapath=udp
if [[ $(id -u) -eq 0 ]]; then
    datapath=afxdp
fi
exec ./target/release/gradwire demo --datapath "$datapath" --size 64MiB --count 8 \
    --inject-loss 0.02 --loss-bound 0.01 "$@"
