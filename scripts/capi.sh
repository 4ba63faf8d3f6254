#!/usr/bin/env bash
# Builds gradwire's C library (crate capi/, libgradwire_c.so and libgradwire_c.a) and installs
# it with its header and pkg-config files:
#   PREFIX/include/gradwire.h
#   PREFIX/lib/libgradwire_c.so, PREFIX/lib/libgradwire_c.a
#   PREFIX/lib/pkgconfig/gradwire.pc          (shared: pkg-config --cflags --libs gradwire)
#   PREFIX/lib/pkgconfig/gradwire-static.pc   (static: the archive and the system libraries)
# and prints, on stdout, the PKG_CONFIG_PATH line to use them.
#
# usage: scripts/capi.sh [--release | --debug] [--prefix DIR] [--from DIR]
#   --release     optimised build (default)
#   --debug       debug build
#   --prefix DIR  install there (default: target/capi; /usr/local for a system install)
#   --from DIR    do not build: install the libraries already built in DIR (e.g. target/debug)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

profile=release
prefix=target/capi
from=
while (($#)); do
    case $1 in
        --release) profile=release ;;
        --debug) profile=debug ;;
        --prefix) prefix=${2:?--prefix needs a directory}; shift ;;
        --from) from=${2:?--from needs a directory}; shift ;;
        -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "capi.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if ! command -v cargo >/dev/null 2>&1 || ! command -v rustc >/dev/null 2>&1; then
    source scripts/deps.sh
fi

# What the static library needs from the system, as rustc prints it ("note:
# native-static-libs: -lgcc_s ..."), from the lines on stdin; fails if there is none.
native_static_libs() {
    local line
    line=$(grep -o 'native-static-libs: .*' | tail -n 1) || true
    if [[ -z $line ]]; then
        echo "capi: rustc printed no native-static-libs line" >&2
        return 1
    fi
    echo "${line#native-static-libs: }"
}

if [[ -z $from ]]; then
    # `cargo rustc` rather than `cargo build`: the same library, plus rustc's own list of the
    # system libraries a static link of exactly this crate needs (cargo replays the note when
    # nothing was rebuilt).
    flags=(-p gradwire-capi --lib --locked --crate-type cdylib,staticlib)
    [[ $profile == release ]] && flags+=(--release)
    echo "capi: cargo rustc ${flags[*]} -- --print native-static-libs" >&2
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    if ! cargo rustc "${flags[@]}" -- --print native-static-libs 2>"$log"; then
        cat "$log" >&2
        exit 1
    fi
    cat "$log" >&2
    static_libs=$(native_static_libs <"$log")
    from=${CARGO_TARGET_DIR:-$root/target}/$profile
else
    # Libraries built elsewhere: what the standard library needs, from this toolchain's rustc
    # on an empty static library. gradwire's crates link no system library of their own (a
    # build above prints the same list), and capi/tests/c_example.rs links the example
    # statically with this list, so a new need fails that test rather than a user's link.
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    static_libs=$(echo "" | rustc --crate-type staticlib --crate-name gw_probe \
        --print native-static-libs -o "$scratch/libgw_probe.a" - 2>&1 | native_static_libs)
fi
for f in libgradwire_c.so libgradwire_c.a; do
    if [[ ! -f $from/$f ]]; then
        echo "capi: $from/$f is missing: build it first (cargo build -p gradwire-capi)" >&2
        exit 1
    fi
done
# Built together with the rest of the workspace (cargo test --workspace), the transport comes
# with its AF_XDP feature and the archive holds the vendored libbpf, which needs libelf and
# zlib (scripts/deps.sh installs both).
# The member list is read whole first: `ar t | grep -q` under pipefail fails whenever grep's
# early exit kills ar with SIGPIPE (CI lost the -lelf -lz this way).
members=$(ar t "$from/libgradwire_c.a")
if grep -qx 'btf.o' <<<"$members" && [[ $static_libs != *-lelf* ]]; then
    static_libs="$static_libs -lelf -lz"
fi

mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
prefix=$(cd "$prefix" && pwd)
install -m 0644 capi/include/gradwire.h "$prefix/include/gradwire.h"
install -m 0755 "$from/libgradwire_c.so" "$prefix/lib/libgradwire_c.so"
install -m 0644 "$from/libgradwire_c.a" "$prefix/lib/libgradwire_c.a"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
echo "capi: static link needs: $static_libs" >&2
common="prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include
"
cat >"$prefix/lib/pkgconfig/gradwire.pc" <<PC
${common}
Name: gradwire
Description: bounded-loss transport for distributed DNN training: all-reduce, broadcast, barrier, DLCP send/recv
Version: $version
Libs: -L\${libdir} -lgradwire_c
Libs.private: $static_libs
Cflags: -I\${includedir}
PC
cat >"$prefix/lib/pkgconfig/gradwire-static.pc" <<PC
${common}
Name: gradwire-static
Description: gradwire's C library, linked statically (libgradwire_c.a)
Version: $version
Libs: \${libdir}/libgradwire_c.a $static_libs
Cflags: -I\${includedir}
PC

echo "capi: installed gradwire $version ($(basename "$from") build) in $prefix" >&2
echo "capi: a program linked to the shared library finds it with -Wl,-rpath,$prefix/lib, LD_LIBRARY_PATH=$prefix/lib, or (system prefix) after ldconfig" >&2
echo "export PKG_CONFIG_PATH=$prefix/lib/pkgconfig\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}"
