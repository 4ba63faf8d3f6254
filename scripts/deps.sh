#!/usr/bin/env bash
# Install what gradwire needs on a Debian machine (run as root). Idempotent and quiet when
# everything is already there. Rust itself comes from rustup (1.82 or newer).
set -euo pipefail

need_pkgs=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# clang builds the XDP program; libelf-dev and zlib1g-dev the vendored libbpf; iproute2 (ip,
# tc) and ethtool the network-namespace testbeds; util-linux (setpriv, prlimit) the AF_XDP error
# tests that drop privileges; fonts-dejavu-core the font of the
# experiment's plot (`gradwire experiment incast --plot`); openmpi-bin and libopenmpi-dev
# (mpicc, mpirun) the C library's MPI example and its test.
for p in iproute2 ethtool util-linux pkg-config make gcc libc6-dev clang libelf-dev zlib1g-dev fonts-dejavu-core openmpi-bin libopenmpi-dev; do
    have "$p" || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "deps: missing Debian packages: ${need_pkgs[*]} (run as root to install them)" >&2
        exit 1
    fi
    echo "deps: installing ${need_pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
    for d in "$HOME/.cargo/bin" /root/.cargo/bin /usr/local/cargo/bin; do
        if [[ -x $d/cargo ]]; then export PATH="$d:$PATH"; break; fi
    done
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "deps: cargo not found: install Rust 1.82 or newer with rustup (https://rustup.rs)" >&2
    exit 1
fi
