#!/usr/bin/env bash
# Apply gradwire's QoS policy to a switch over ssh.
#
# DRY RUN BY DEFAULT: shows what would change and the exact commands, and contacts nothing
# (not even ssh). With --apply it fetches what it needs, shows the same, asks, and runs.
#
#   scripts/switch-apply.sh --target sonic --host admin@sw1 [--current running.json | --apply [--yes]] \
#       -- --base-threshold 64KiB --step 0.5 --asic spectrum1 --ports Ethernet0..60:4
#   scripts/switch-apply.sh --target onyx|nvue --host admin@sw1 \
#       (--config FILE | -- RENDER_FLAGS...) [--current FILE] [--apply [--yes]]
#
# SONiC: the diff and the JSON Patch are computed against the switch's config_db. A dry run
#   uses --current FILE (saved from `sonic-cfggen -d --print-data`); --apply always fetches
#   the running config over ssh and refuses --current, so the patch is never computed
#   against a stale file. The patch is applied with `sudo config apply-patch`
#   (YANG-validated), which changes the running CONFIG_DB.
# Onyx / NVUE: the commands (comments stripped) are compared line by line with --current
#   FILE if given (only for the diff shown: --apply sends every command), then sent over
#   ssh (NVUE: through bash; its last line, `nv config apply`, commits).
#
# --save (persist the change across reboots) is refused on every target: the reference
#   gradwire renders against (switch-qos-formats.md) lists no SONiC command that writes
#   the running CONFIG_DB to the startup config, no Onyx command that writes the running
#   configuration, and for NVUE only says that `nv config apply` commits, not whether that
#   survives a reboot. gradwire does not invent these commands; save by hand with your
#   platform's documented command (see docs/switch-control.md, "Persistence").
#
# Environment: GRADWIRE_CTL = path of gradwire-ctl (default: built with cargo).
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

target="" host="" current="" config="" apply=0 yes=0 save=0
render=()
while (($#)); do
    case "$1" in
        --target) target=${2:?}; shift 2 ;;
        --host) host=${2:?}; shift 2 ;;
        --current) current=${2:?}; shift 2 ;;
        --config) config=${2:?}; shift 2 ;;
        --apply) apply=1; shift ;;
        --save) save=1; shift ;;
        --yes) yes=1; shift ;;
        -h|--help) usage ;;
        --) shift; render=("$@"); break ;;
        *) echo "switch-apply: unknown argument $1" >&2; usage ;;
    esac
done
case "$target" in sonic|onyx|nvue) ;; *) echo "switch-apply: --target sonic|onyx|nvue" >&2; usage ;; esac
[[ -n $host ]] || { echo "switch-apply: --host is required" >&2; usage; }
[[ -z $current || -r $current ]] || { echo "switch-apply: cannot read --current $current" >&2; exit 1; }
[[ -z $config || -r $config ]] || { echo "switch-apply: cannot read --config $config" >&2; exit 1; }
if [[ $target == sonic && -n $config ]]; then
    echo "switch-apply: sonic builds its patch from the policy flags after --, not --config" >&2
    exit 2
fi
if [[ -z $config && ${#render[@]} -eq 0 ]]; then
    echo "switch-apply: give the policy flags after -- (or --config FILE for onyx/nvue)" >&2
    exit 2
fi
if [[ $target == sonic && -n $current ]] && ((apply)); then
    echo "switch-apply: --current is for dry runs: with --apply the running config is always fetched" >&2
    echo "  (ssh $host sonic-cfggen -d --print-data) so the patch is not computed against a stale file." >&2
    echo "  Drop --current." >&2
    exit 2
fi
if ((save)); then
    case "$target" in
        sonic) what="no SONiC command that saves the running CONFIG_DB (which config apply-patch changes) to the startup config" ;;
        onyx) what="no Onyx command that writes the running configuration to the startup configuration" ;;
        nvue) what="no NVUE save command; it says only that 'nv config apply' (the last command sent) commits, not whether that survives a reboot" ;;
    esac
    echo "switch-apply: --save: the reference gradwire renders against lists $what." >&2
    echo "  gradwire does not invent one, so nothing was done. Apply without --save, then persist" >&2
    echo "  the change by hand with your platform's documented command (docs/switch-control.md, Persistence)." >&2
    exit 2
fi

if [[ -n ${GRADWIRE_CTL:-} ]]; then
    ctl=$GRADWIRE_CTL
else
    root=$(cd "$(dirname "$0")/.." && pwd)
    cargo build -q --manifest-path "$root/Cargo.toml" -p gradwire-control --bin gradwire-ctl >&2
    ctl=$root/target/debug/gradwire-ctl
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mode="DRY RUN (nothing is sent; add --apply to apply)"
((apply)) && mode="APPLY"
echo "== switch-apply: $target on $host: $mode"

confirm() {
    ((yes)) && return 0
    local answer
    read -r -p "Apply these changes to $host? [y/N] " answer </dev/tty || return 1
    [[ $answer == y || $answer == Y ]]
}

run_or_print() {
    # $1: description; rest: the command. In a dry run only print it.
    local what=$1
    shift
    if ((apply)); then
        echo "-- $what"
        "$@"
    else
        printf '  '
        printf ' %q' "$@"
        echo
    fi
}

if [[ $target == sonic ]]; then
    if [[ -z $current ]]; then
        if ((apply)); then
            echo "-- fetching the running config: ssh $host sonic-cfggen -d --print-data"
            ssh "$host" sonic-cfggen -d --print-data >"$tmp/current.json"
            current=$tmp/current.json
        else
            echo "-- no --current given: diff against an empty config (every field shows as added)."
            echo "   Save the switch's config with 'ssh $host sonic-cfggen -d --print-data > running.json'"
            echo "   and pass --current running.json for the real diff."
            echo '{}' >"$tmp/empty.json"
        fi
    fi
    diff_against=${current:-$tmp/empty.json}
    echo "== what would change (config_db fields)"
    "$ctl" diff --target sonic --current "$diff_against" "${render[@]}"
    # render repeats the diff's warnings on stderr: show them only if rendering fails.
    if [[ -n $current ]]; then
        "$ctl" render --target sonic-patch --current "$current" "${render[@]}" >"$tmp/patch.json" 2>"$tmp/render.err" \
            || { cat "$tmp/render.err" >&2; exit 1; }
    else
        # Without the running config: the patch that assumes the QoS tables exist.
        "$ctl" render --target sonic-patch "${render[@]}" >"$tmp/patch.json" 2>"$tmp/render.err" \
            || { cat "$tmp/render.err" >&2; exit 1; }
        echo "-- without --current the patch cannot see QUEUE range entries (Ethernet0|3-4) or an"
        echo "   existing pfc_enable; --apply fetches the running config and builds the exact patch."
    fi
    if [[ $(tr -d ' \n' <"$tmp/patch.json") == "[]" ]]; then
        echo "== nothing to change"
        exit 0
    fi
    echo "== JSON Patch for config apply-patch"
    cat "$tmp/patch.json"
    echo "== commands"
    if ((apply)) && ! confirm; then
        echo "switch-apply: not applied" >&2
        exit 1
    fi
    run_or_print "copying the patch" ssh "$host" "cat > /tmp/gradwire-qos-patch.json" <"$tmp/patch.json"
    run_or_print "applying (YANG-validated)" ssh "$host" sudo config apply-patch /tmp/gradwire-qos-patch.json
    ((apply)) || echo "   (the first command reads the patch above on stdin)"
    echo "-- note: config apply-patch changes the running CONFIG_DB only; it is not saved for the next"
    echo "   boot (the reference lists no save command: see docs/switch-control.md, Persistence)."
    exit 0
fi

# Onyx and NVUE: plain command lists.
if [[ -n $config ]]; then
    cp "$config" "$tmp/config"
else
    "$ctl" render --target "$target" "${render[@]}" >"$tmp/config"
fi
grep -v '^[[:space:]]*#' "$tmp/config" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//' | grep -v '^$' >"$tmp/commands" || true
total=$(wc -l <"$tmp/commands")
echo "== what would change"
if [[ -n $current ]]; then
    sed 's/^[[:space:]]*//; s/[[:space:]]*$//' "$current" | grep -v '^$' >"$tmp/have" || true
    grep -vxF -f "$tmp/have" "$tmp/commands" >"$tmp/new" || true
    echo "# $(wc -l <"$tmp/new") of $total commands are not in $current (compared verbatim; removals are not detected)"
    ((apply)) && echo "# (--current only shapes this diff; --apply sends all $total commands)"
    sed 's/^/+ /' "$tmp/new"
else
    echo "# no --current given: all $total commands shown as new"
    sed 's/^/+ /' "$tmp/commands"
fi
echo "== commands"
if ((apply)) && ! confirm; then
    echo "switch-apply: not applied" >&2
    exit 1
fi
if [[ $target == nvue ]]; then
    # The command list ends with `nv config apply`; if NVUE asks for confirmation, run
    # the file interactively on the switch instead.
    run_or_print "running the NVUE commands" ssh "$host" bash -s <"$tmp/commands"
else
    # Onyx reads CLI commands on stdin; enter configuration mode first.
    { printf 'enable\nconfigure terminal\n'; cat "$tmp/commands"; printf 'exit\n'; } >"$tmp/session"
    run_or_print "sending the Onyx commands" ssh -T "$host" <"$tmp/session"
fi
((apply)) || echo "   (stdin: the commands listed above$([[ $target == onyx ]] && echo ", after 'enable' and 'configure terminal'"))"
if [[ $target == onyx ]]; then
    echo "-- note: the running configuration is not written for the next boot (the reference lists"
    echo "   no Onyx save command: see docs/switch-control.md, Persistence)."
else
    echo "-- note: 'nv config apply' commits; the reference does not say whether that survives a"
    echo "   reboot and lists no save command (see docs/switch-control.md, Persistence)."
fi
