# shellcheck shell=bash
# Source this (scripts/test.sh and the experiments do): the repository's Python venv, .venv/
# at the root, with gradwire built from source and installed. Exports VENV_PY.
#
#   source scripts/python-env.sh && "$VENV_PY" -m pytest python/tests
#
# 1. Creates .venv/ with python3 (or $GRADWIRE_PYTHON, >= 3.9) unless it works already.
# 2. Installs python/requirements-dev.txt when its hash differs from the one recorded in the
#    venv after the last successful install (pip's cache makes a reinstall quick).
# 3. Builds and installs the package every time: `pip install --no-build-isolation ./python`
#    with maturin from the venv and cargo's target dir at the repository's target/, so the
#    workspace's compiled dependencies are reused and an unchanged tree takes seconds.
# Returns non-zero (with the reason on stderr) when a step fails; leaves the caller's shell
# options alone.

_gradwire_python_env() {
    local root venv py req stamp want
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    venv="$root/.venv"
    py="${GRADWIRE_PYTHON:-python3}"
    req="$root/python/requirements-dev.txt"
    stamp="$venv/.gradwire-requirements.sha256"

    if ! "$venv/bin/python" -c 'import sys; assert sys.version_info >= (3, 9)' 2>/dev/null; then
        if ! "$py" -c 'import sys; assert sys.version_info >= (3, 9)' 2>/dev/null; then
            echo "python-env: $py is missing or older than 3.9: install Python >= 3.9 (and its venv module) or set GRADWIRE_PYTHON" >&2
            return 1
        fi
        echo "python-env: creating $venv with $("$py" --version 2>&1)" >&2
        rm -rf "$venv"
        "$py" -m venv "$venv" || {
            echo "python-env: '$py -m venv' failed: on Debian install python3-venv" >&2
            return 1
        }
    fi

    want="$(sha256sum "$req" | cut -d' ' -f1)" || return 1
    if [[ ! -f $stamp || "$(cat "$stamp")" != "$want" ]]; then
        echo "python-env: installing python/requirements-dev.txt (torch is large: minutes the first time)" >&2
        rm -f "$stamp"
        "$venv/bin/python" -m pip install -q -r "$req" || {
            echo "python-env: installing python/requirements-dev.txt failed (see pip's message above)" >&2
            return 1
        }
        echo "$want" >"$stamp"
    fi

    # maturin is run from PATH by its PEP 517 hook; --locked: the committed Cargo.lock, as the
    # cargo steps of scripts/test.sh use it.
    local started=$SECONDS
    if ! PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" \
        MATURIN_PEP517_ARGS="--locked" \
        "$venv/bin/python" -m pip install -q --no-build-isolation "$root/python"; then
        echo "python-env: building the gradwire package failed (cargo's or maturin's message above)" >&2
        return 1
    fi
    echo "python-env: gradwire built and installed in $((SECONDS - started)) s" >&2
    VENV_PY="$venv/bin/python"
    export VENV_PY
}

if ! _gradwire_python_env; then
    unset -f _gradwire_python_env
    # `return` when sourced; `exit` when run as a script.
    return 1 2>/dev/null || exit 1
fi
unset -f _gradwire_python_env
