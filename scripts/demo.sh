#!/usr/bin/env bash
# The main job: a complete bounded-loss exchange on this machine. As root it runs over AF_XDP
# between two network namespaces it creates (and removes); otherwise over kernel UDP on
# 127.0.0.1. Extra arguments go to `gradwire demo` and win over these defaults
# (e.g. --datapath udp --inject-loss 0.05 --loss-bound 0.01 --json).
# As root and without extra arguments it then runs a collective job: 8 ranks in two racks
# (collective/jobs/racks8.toml), one process per rank in its own namespace, all-reducing a
# scaled ResNet-50's layers over MLNET's RACK tree, every result checked.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release --locked -p gradwire-cli >&2
datapath=udp
if [[ $(id -u) -eq 0 ]]; then
    datapath=afxdp
fi
./target/release/gradwire demo --datapath "$datapath" --size 64MiB --count 8 \
    --inject-loss 0.02 --loss-bound 0.01 "$@"
if [[ $(id -u) -eq 0 && $# -eq 0 ]]; then
    echo
    exec ./target/release/gradwire job run collective/jobs/racks8.toml --algorithm rack \
        --iterations 3
fi
