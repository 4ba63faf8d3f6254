#!/usr/bin/env bash
# Regenerate hw-configs/ from control/src/hwconfigs.rs (the test
# control/tests/hw_configs.rs fails when a checked-in file differs). Pass --check to only
# compare.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run -q -p gradwire-control --bin gradwire-ctl -- gen-hw-configs --out hw-configs "$@"
