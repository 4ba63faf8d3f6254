#!/usr/bin/env bash
# Tune a NIC for gradwire's AF_XDP data plane from a profile in hw-configs/nic-tuning/.
#
# DRY RUN BY DEFAULT: prints every command it would run and changes nothing (no root needed,
# the interface need not exist). With --apply it runs them, as root, on an existing interface.
#
#   scripts/nic-tune.sh --profile NAME --iface IF --poll-cores LIST [--apply]
#           [--udp-ports P[,P...]] [--skip STEP[,STEP...]] [--force]
#           [--online-cpus LIST] [--kernel VERSION]        (dry-run previews for another host)
#   scripts/nic-tune.sh --show --iface IF      current settings (read-only)
#   scripts/nic-tune.sh --list                 available profiles
#
# NAME is a profile (cx5-25g, cx5-100g, cx6-25g, cx6-100g, e810-25g, e810-100g) or a path to
# a .conf file. LIST is a CPU list such as 2-5 or 2,3,8-9: the gradwire poll cores. One
# combined channel (one AF_XDP queue) per poll core; every IRQ of the NIC goes to the other
# online CPUs. --udp-ports adds ntuple rules steering those UDP destination ports to the
# AF_XDP queues. --force allows a driver other than the profile's (e.g. veth, for testing).
#
# Steps, in order (names for --skip): channels rings coalesce features mtu napi sysctls irqs
# hugepages steering.
#
# --apply: stops before changing anything if not root, if the interface does not exist, if
# its driver differs from the profile's (without --force) or if a ring/channel count exceeds
# what the NIC reports. After that, a failing command is reported and the remaining steps
# still run (they are independent); the exit status is 1 if any command failed.
#
# Exit status: 0 success, 1 a command failed (--apply) or --show found no interface,
# 2 invalid arguments or profile.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROFILE_DIR=$ROOT/hw-configs/nic-tuning

# Read-only test hooks (used by hw-configs/nic-tuning/test-dry-run.sh; refused with --apply).
SYSNET=${NIC_TUNE_TEST_SYSFS_NET:-/sys/class/net}
INTERRUPTS=${NIC_TUNE_TEST_INTERRUPTS:-/proc/interrupts}
MEMINFO=${NIC_TUNE_TEST_MEMINFO:-/proc/meminfo}

STEPS=(channels rings coalesce features mtu napi sysctls irqs hugepages steering)
PROFILE_KEYS=(NIC DRIVER SPEED_GBPS CHANNELS RX_RING TX_RING RING_MAX RING_MULTIPLE COALESCE
    FEATURES MTU FRAME_SIZE UMEM_FRAMES_PER_QUEUE HUGEPAGE_HEADROOM_PCT BUSY_POLL BUSY_READ
    NAPI_DEFER_HARD_IRQS GRO_FLUSH_TIMEOUT XSK_ZEROCOPY XSK_QID_OFFSET_BELOW_KERNEL
    STEER_FLOW_TYPES)

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}
die() {
    echo "nic-tune: error: $*" >&2
    exit 2
}
note() { echo "# $*"; }
warn() { echo "# WARNING: $*"; }

# ---------------------------------------------------------------------------------------
# CPU lists

# parse_cpu_list LIST WHAT: sets CPU_OUT to the sorted CPUs of LIST, or dies.
parse_cpu_list() {
    local list=$1 what=$2 part a b c
    [[ $list =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] ||
        die "$what: malformed CPU list '$list' (expected e.g. 2-5 or 2,3,8-9)"
    local -A seen=()
    CPU_OUT=()
    local -a parts
    IFS=, read -ra parts <<<"$list"
    for part in "${parts[@]}"; do
        if [[ $part == *-* ]]; then a=${part%-*} b=${part#*-}; else a=$part b=$part; fi
        ((${#a} <= 5 && ${#b} <= 5)) || die "$what: CPU number too large in '$part'"
        a=$((10#$a)) b=$((10#$b))
        ((a <= b)) || die "$what: range '$part' goes backwards"
        ((b < 8192)) || die "$what: CPU $b out of range"
        for ((c = a; c <= b; c++)); do
            [[ -z ${seen[$c]:-} ]] || die "$what: CPU $c listed twice"
            seen[$c]=1
            CPU_OUT+=("$c")
        done
    done
    mapfile -t CPU_OUT < <(printf '%s\n' "${CPU_OUT[@]}" | sort -n)
}

# cpu_ranges CPU...: compact list ("0-1,6-7") of sorted CPUs.
cpu_ranges() {
    local out="" start="" prev="" c
    for c in "$@"; do
        if [[ -n $prev ]] && ((c == prev + 1)); then
            prev=$c
            continue
        fi
        [[ -z $start ]] || out+="${out:+,}$([[ $start == "$prev" ]] && echo "$start" || echo "$start-$prev")"
        start=$c prev=$c
    done
    [[ -z $start ]] || out+="${out:+,}$([[ $start == "$prev" ]] && echo "$start" || echo "$start-$prev")"
    echo "$out"
}

# ---------------------------------------------------------------------------------------
# Profiles: KEY=VALUE, parsed here (never sourced).

declare -A P=()

profile_path() {
    local name=$1
    if [[ $name == */* ]]; then
        [[ -f $name ]] || die "profile file '$name' not found"
        echo "$name"
        return
    fi
    [[ $name =~ ^[a-z0-9][a-z0-9-]*$ ]] || die "invalid profile name '$name'"
    [[ -f $PROFILE_DIR/$name.conf ]] ||
        die "unknown profile '$name' (known: $(list_names | paste -sd, -))"
    echo "$PROFILE_DIR/$name.conf"
}

list_names() {
    local f
    for f in "$PROFILE_DIR"/*.conf; do
        [[ -e $f ]] || continue
        f=${f##*/}
        echo "${f%.conf}"
    done
}

is_uint() { [[ $1 =~ ^[0-9]{1,9}$ ]]; }

# load_profile FILE: fills P, validating every key and value.
load_profile() {
    local file=$1 line key val n=0 k
    P=()
    local -A allowed=()
    for k in "${PROFILE_KEYS[@]}"; do allowed[$k]=1; done
    while IFS= read -r line || [[ -n $line ]]; do
        n=$((n + 1))
        line=${line%$'\r'}
        line="${line#"${line%%[![:space:]]*}"}"
        line="${line%"${line##*[![:space:]]}"}"
        [[ -z $line || $line == \#* ]] && continue
        [[ $line =~ ^([A-Z][A-Z0-9_]*)=(.*)$ ]] || die "$file:$n: not a KEY=VALUE line: $line"
        key=${BASH_REMATCH[1]} val=${BASH_REMATCH[2]}
        if [[ $val =~ ^\"(.*)\"$ ]]; then val=${BASH_REMATCH[1]}; fi
        [[ -n ${allowed[$key]:-} ]] || die "$file:$n: unknown key $key"
        [[ -z ${P[$key]+x} ]] || die "$file:$n: $key set twice"
        [[ $val =~ ^[A-Za-z0-9\ ._,:/+-]*$ ]] ||
            die "$file:$n: $key: value has characters outside [A-Za-z0-9 ._,:/+-]"
        P[$key]=$val
    done <"$file"
    for k in "${PROFILE_KEYS[@]}"; do
        [[ -n ${P[$k]+x} ]] || die "$file: missing key $k"
    done
    for k in SPEED_GBPS CHANNELS RX_RING TX_RING RING_MAX RING_MULTIPLE MTU FRAME_SIZE \
        UMEM_FRAMES_PER_QUEUE HUGEPAGE_HEADROOM_PCT BUSY_POLL BUSY_READ NAPI_DEFER_HARD_IRQS \
        GRO_FLUSH_TIMEOUT; do
        is_uint "${P[$k]}" || die "$file: $k must be a non-negative integer, got '${P[$k]}'"
    done
    [[ ${P[DRIVER]} =~ ^[a-z0-9_]+$ ]] || die "$file: DRIVER '${P[DRIVER]}' is not a driver name"
    ((P[CHANNELS] >= 1 && P[RING_MULTIPLE] >= 1)) || die "$file: CHANNELS and RING_MULTIPLE must be >= 1"
    local r
    for k in RX_RING TX_RING; do
        r=${P[$k]}
        ((r >= 64 && r <= P[RING_MAX])) || die "$file: $k=$r outside 64..${P[RING_MAX]}"
        ((r % P[RING_MULTIPLE] == 0)) || die "$file: $k=$r is not a multiple of ${P[RING_MULTIPLE]}"
        ((r & (r - 1))) && die "$file: $k=$r is not a power of two (mlx5 rounds up, some ice kernels refuse zero-copy)"
    done
    [[ ${P[FRAME_SIZE]} == 2048 || ${P[FRAME_SIZE]} == 4096 ]] || die "$file: FRAME_SIZE must be 2048 or 4096"
    ((P[MTU] >= 576 && P[MTU] <= 9216)) || die "$file: MTU ${P[MTU]} out of range"
    ((P[HUGEPAGE_HEADROOM_PCT] <= 200)) || die "$file: HUGEPAGE_HEADROOM_PCT above 200"
    ((P[UMEM_FRAMES_PER_QUEUE] >= 1)) || die "$file: UMEM_FRAMES_PER_QUEUE must be >= 1"
    check_pairs "$file" COALESCE '^(on|off|[0-9]{1,9})$'
    check_pairs "$file" FEATURES '^(on|off)$'
    [[ ${P[XSK_ZEROCOPY]} == yes || ${P[XSK_ZEROCOPY]} == no ]] || die "$file: XSK_ZEROCOPY must be yes or no"
    [[ ${P[XSK_QID_OFFSET_BELOW_KERNEL]} =~ ^(none|[0-9]+\.[0-9]+)$ ]] ||
        die "$file: XSK_QID_OFFSET_BELOW_KERNEL must be none or MAJOR.MINOR"
    local t
    for t in ${P[STEER_FLOW_TYPES]}; do
        [[ $t == udp4 || $t == udp6 ]] || die "$file: STEER_FLOW_TYPES: '$t' is not udp4 or udp6"
    done
}

# check_pairs FILE KEY VALUE_REGEX: KEY holds "name value name value ...".
check_pairs() {
    local file=$1 key=$2 re=$3 i
    local -a w
    read -ra w <<<"${P[$key]}"
    ((${#w[@]} > 0 && ${#w[@]} % 2 == 0)) || die "$file: $key must be 'name value' pairs"
    for ((i = 0; i < ${#w[@]}; i += 2)); do
        [[ ${w[i]} =~ ^[a-z][a-z0-9-]*$ ]] || die "$file: $key: bad parameter name '${w[i]}'"
        [[ ${w[i + 1]} =~ $re ]] || die "$file: $key: bad value '${w[i + 1]}' for ${w[i]}"
    done
}

# ---------------------------------------------------------------------------------------
# Reading the system (all read-only)

online_cpus() {
    if [[ -r /sys/devices/system/cpu/online ]]; then
        cat /sys/devices/system/cpu/online
    else
        echo "0-$(($(nproc) - 1))"
    fi
}

# ver_lt A B: is kernel version A older than MAJOR.MINOR B?
ver_lt() {
    local a=$1 b=$2 am an bm bn
    [[ $a =~ ^([0-9]+)\.([0-9]+) ]] || return 1
    am=${BASH_REMATCH[1]} an=${BASH_REMATCH[2]}
    [[ $b =~ ^([0-9]+)\.([0-9]+) ]] || return 1
    bm=${BASH_REMATCH[1]} bn=${BASH_REMATCH[2]}
    ((am < bm || (am == bm && an < bn)))
}

iface_driver() {
    local iface=$1 d
    if [[ -L $SYSNET/$iface/device/driver ]]; then
        d=$(readlink "$SYSNET/$iface/device/driver")
        echo "${d##*/}"
    elif command -v ethtool >/dev/null && [[ $SYSNET == /sys/class/net ]]; then
        ethtool -i "$iface" 2>/dev/null | awk '/^driver:/ {print $2}' || true
    fi
}

iface_pci() {
    local d
    [[ -L $SYSNET/$1/device ]] || return 0
    d=$(readlink "$SYSNET/$1/device")
    d=${d##*/}
    [[ $d =~ ^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$ ]] && echo "$d"
    return 0
}

# find_irqs IFACE PCI: IRQ numbers of the interface: its PCI function's MSI vectors plus
# every /proc/interrupts line naming the interface (ice: ice-IF-TxRx-N) or its PCI address
# (mlx5: mlx5_comp0@pci:0000:3b:00.0, which never contains the interface name).
find_irqs() {
    local iface=$1 pci=$2
    {
        if [[ -d $SYSNET/$iface/device/msi_irqs ]]; then
            ls "$SYSNET/$iface/device/msi_irqs"
        fi
        if [[ -r $INTERRUPTS ]]; then
            awk -v ifn="$iface" -v pci="$pci" '
                NR == 1 { next }
                {
                    irq = $1; sub(/:$/, "", irq)
                    if (irq !~ /^[0-9]+$/) next
                    n = split($0, tok, /[ \t,]+/)
                    for (i = 2; i <= n; i++) {
                        t = tok[i]
                        if (t == ifn || index(t, ifn "-") == 1 || index(t, "-" ifn "-") > 0 ||
                            (length(t) > length(ifn) && substr(t, length(t) - length(ifn)) == "-" ifn) ||
                            (pci != "" && index(t, pci) > 0)) { print irq; break }
                    }
                }' "$INTERRUPTS"
        fi
    } | grep -E '^[0-9]+$' | sort -n | uniq
}

irq_name() {
    [[ -r $INTERRUPTS ]] || return 0
    awk -v irq="$1:" '$1 == irq { print $NF; exit }' "$INTERRUPTS"
}

meminfo() { awk -v k="$1:" '$1 == k { print $2; exit }' "$MEMINFO" 2>/dev/null || true; }

irqbalance_running() {
    local c
    for c in /proc/[0-9]*/comm; do
        [[ -r $c ]] || continue
        [[ $(<"$c") == irqbalance ]] 2>/dev/null && return 0
    done 2>/dev/null
    return 1
}

# ethtool_field OUTPUT SECTION KEY: value of "KEY:" under the "SECTION" heading of
# ethtool -l / -g output ("Pre-set maximums" or "Current hardware settings").
ethtool_field() {
    awk -v sec="$2:" -v key="$3:" '
        $0 == sec { on = 1; next }
        /^(Pre-set maximums|Current hardware settings):$/ { on = 0; next }
        on && $1 == key { print $2; exit }' <<<"$1"
}

# ---------------------------------------------------------------------------------------
# Running (or printing) commands

APPLY=0
NCMD=0
FAILURES=()

record_fail() {
    FAILURES+=("$1: $2")
    echo "  FAILED: $2"
}

# run CMD...: print it; with --apply run it and report.
run() {
    local shown out rc
    shown=$(printf '%s ' "$@")
    shown=${shown% }
    NCMD=$((NCMD + 1))
    echo "$shown"
    ((APPLY)) || return 0
    if out=$("$@" 2>&1); then
        echo "  ok${out:+ ($(tr '\n' ' ' <<<"$out" | sed 's/ *$//'))}"
    else
        rc=$?
        record_fail "$shown" "exit $rc: $(tr '\n' ' ' <<<"$out" | sed 's/ *$//')"
    fi
}

# write_val PATH VALUE: echo VALUE > PATH.
write_val() {
    local path=$1 val=$2 out
    NCMD=$((NCMD + 1))
    echo "echo $val > $path"
    ((APPLY)) || return 0
    if [[ ! -e $path ]]; then
        record_fail "echo $val > $path" "$path does not exist"
    elif out=$({ printf '%s\n' "$val" >"$path"; } 2>&1); then
        echo "  ok"
    else
        record_fail "echo $val > $path" "$(tr '\n' ' ' <<<"$out" | sed 's/ *$//')"
    fi
}

skipped() { [[ " $SKIP " == *" $1 "* ]]; }

step() {
    echo
    if skipped "$1"; then
        note "== $1: skipped (--skip)"
        return 1
    fi
    note "== $1: $2"
}

# ---------------------------------------------------------------------------------------
# --show

show() {
    local iface=$1 f irq
    [[ -e $SYSNET/$iface ]] || { echo "nic-tune: interface '$iface' does not exist" >&2; return 1; }
    sub() {
        echo
        echo "== $*"
    }
    try() { "$@" 2>&1 || echo "(not available: exit $?)"; }
    sub "driver (ethtool -i)"
    try ethtool -i "$iface"
    sub "channels (ethtool -l)"
    try ethtool -l "$iface"
    sub "rings (ethtool -g)"
    try ethtool -g "$iface"
    sub "coalescing (ethtool -c)"
    try ethtool -c "$iface"
    sub "offloads (ethtool -k, XDP-relevant)"
    try ethtool -k "$iface" | grep -E '^(large-receive-offload|generic-receive-offload|rx-gro-hw|ntuple-filters):' || true
    sub "ntuple rules (ethtool -n)"
    try ethtool -n "$iface"
    sub "link (MTU, attached XDP program)"
    try ip -d link show dev "$iface"
    sub "per-device NAPI (/sys/class/net/$iface)"
    for f in napi_defer_hard_irqs gro_flush_timeout; do
        echo "$f = $(cat "$SYSNET/$iface/$f" 2>/dev/null || echo '(not present)')"
    done
    sub "busy-poll sysctls"
    for f in busy_poll busy_read; do
        echo "net.core.$f = $(cat "/proc/sys/net/core/$f" 2>/dev/null || echo '(not present in this network namespace)')"
    done
    sub "hugepages"
    grep -E '^(HugePages_Total|HugePages_Free|Hugepagesize):' "$MEMINFO" || true
    sub "IRQs of $iface (number, name, smp_affinity_list)"
    local found=0
    while read -r irq; do
        found=1
        echo "$irq $(irq_name "$irq") $(cat "/proc/irq/$irq/smp_affinity_list" 2>/dev/null || echo '?')"
    done < <(find_irqs "$iface" "$(iface_pci "$iface")")
    ((found)) || echo "(none found: virtual device or IRQ names without the interface name)"
    if irqbalance_running; then
        echo
        echo "irqbalance is running (it rewrites IRQ affinity)"
    fi
    return 0
}

# ---------------------------------------------------------------------------------------
# --list

list_profiles() {
    local name
    printf '%-12s %-20s %-10s %-6s %s\n' PROFILE NIC DRIVER SPEED POLL-CORES
    while read -r name; do
        load_profile "$PROFILE_DIR/$name.conf"
        printf '%-12s %-20s %-10s %-6s %s\n' "$name" "${P[NIC]}" "${P[DRIVER]}" "${P[SPEED_GBPS]}G" "${P[CHANNELS]}"
    done < <(list_names)
}

# ---------------------------------------------------------------------------------------
# Arguments

mode=tune profile="" iface="" poll="" ports="" SKIP="" force=0 online_override="" kernel=""
while (($#)); do
    case "$1" in
        --profile) profile=${2:?--profile needs a value}; shift 2 ;;
        --iface) iface=${2:?--iface needs a value}; shift 2 ;;
        --poll-cores) poll=${2:?--poll-cores needs a value}; shift 2 ;;
        --udp-ports) ports=${2:?--udp-ports needs a value}; shift 2 ;;
        --skip) SKIP=${2:?--skip needs a value}; shift 2 ;;
        --online-cpus) online_override=${2:?--online-cpus needs a value}; shift 2 ;;
        --kernel) kernel=${2:?--kernel needs a value}; shift 2 ;;
        --apply) APPLY=1; shift ;;
        --force) force=1; shift ;;
        --show) mode=show; shift ;;
        --list) mode=list; shift ;;
        -h | --help) usage ;;
        *) echo "nic-tune: unknown argument '$1'" >&2; usage ;;
    esac
done

if [[ -n $iface ]]; then
    [[ $iface =~ ^[A-Za-z0-9_.-]{1,15}$ && $iface != . && $iface != .. ]] ||
        die "invalid interface name '$iface' (1-15 characters from [A-Za-z0-9_.-])"
fi

case $mode in
    list)
        list_profiles
        exit 0
        ;;
    show)
        [[ -n $iface ]] || die "--show needs --iface"
        show "$iface" || exit 1
        exit 0
        ;;
esac

[[ -n $profile ]] || die "--profile is required (see --list)"
[[ -n $iface ]] || die "--iface is required"
[[ -n $poll ]] || die "--poll-cores is required (e.g. --poll-cores 2-5)"

skip_list=$SKIP
SKIP=""
if [[ -n $skip_list ]]; then
    [[ $skip_list =~ ^[a-z]+(,[a-z]+)*$ ]] || die "--skip: malformed list '$skip_list'"
    IFS=, read -ra _skips <<<"$skip_list"
    for s in "${_skips[@]}"; do
        [[ " ${STEPS[*]} " == *" $s "* ]] || die "--skip: unknown step '$s' (steps: ${STEPS[*]})"
        SKIP+=" $s"
    done
fi

port_list=()
if [[ -n $ports ]]; then
    [[ $ports =~ ^[0-9]{1,5}(,[0-9]{1,5})*$ ]] || die "--udp-ports: malformed list '$ports' (e.g. 47000,47001)"
    IFS=, read -ra port_list <<<"$ports"
    for p in "${port_list[@]}"; do
        ((10#$p >= 1 && 10#$p <= 65535)) || die "--udp-ports: $p is not a port number"
    done
    ((${#port_list[@]} <= 64)) || die "--udp-ports: at most 64 ports"
fi

if ((APPLY)); then
    [[ -z ${NIC_TUNE_TEST_SYSFS_NET:-}${NIC_TUNE_TEST_INTERRUPTS:-}${NIC_TUNE_TEST_MEMINFO:-} ]] ||
        die "--apply refuses to run with NIC_TUNE_TEST_* variables set"
    [[ -z $online_override && -z $kernel ]] || die "--online-cpus and --kernel are for dry-run previews only"
fi

pfile=$(profile_path "$profile")
load_profile "$pfile"

parse_cpu_list "$poll" --poll-cores
POLL=("${CPU_OUT[@]}")
parse_cpu_list "${online_override:-$(online_cpus)}" "online CPUs"
ONLINE=("${CPU_OUT[@]}")
declare -A is_poll=() is_online=()
for c in "${POLL[@]}"; do is_poll[$c]=1; done
for c in "${ONLINE[@]}"; do is_online[$c]=1; done
for c in "${POLL[@]}"; do
    [[ -n ${is_online[$c]:-} ]] ||
        die "--poll-cores: CPU $c is not online here (online: $(cpu_ranges "${ONLINE[@]}"))${online_override:+ per --online-cpus}"
done
HOUSE=()
for c in "${ONLINE[@]}"; do [[ -n ${is_poll[$c]:-} ]] || HOUSE+=("$c"); done
((${#HOUSE[@]} > 0)) || die "--poll-cores covers every online CPU: at least one must stay for IRQs and the kernel"
HOUSE_LIST=$(cpu_ranges "${HOUSE[@]}")
POLL_LIST=$(cpu_ranges "${POLL[@]}")
NQ=${#POLL[@]}

kernel=${kernel:-$(uname -r)}
XSK_BASE=0
if [[ ${P[XSK_QID_OFFSET_BELOW_KERNEL]} != none ]] && ver_lt "$kernel" "${P[XSK_QID_OFFSET_BELOW_KERNEL]}"; then
    XSK_BASE=$NQ
fi

present=0
[[ -e $SYSNET/$iface ]] && present=1
driver=""
((present)) && driver=$(iface_driver "$iface")

if ((APPLY)); then
    ((EUID == 0)) || die "--apply must run as root (dry run needs no privileges: drop --apply)"
    ((present)) || die "interface '$iface' does not exist"
    for tool in ethtool ip sysctl; do
        command -v "$tool" >/dev/null || die "$tool not found"
    done
    if [[ $driver != "${P[DRIVER]}" ]] && ((!force)); then
        die "$iface uses driver '${driver:-unknown}', profile $profile is for ${P[DRIVER]} (--force to apply anyway)"
    fi
fi

echo "# nic-tune: profile $profile (${P[NIC]}, ${P[DRIVER]}, ${P[SPEED_GBPS]}G) on $iface"
if ((APPLY)); then
    echo "# APPLYING (failures are reported and the remaining steps still run)"
else
    echo "# DRY RUN: commands that --apply would run; nothing is changed"
fi
note "poll cores: $POLL_LIST ($NQ, one AF_XDP queue each); NIC IRQs -> $HOUSE_LIST"
if ((NQ != P[CHANNELS])); then
    note "note: the profile recommends ${P[CHANNELS]} poll cores at ${P[SPEED_GBPS]}G; using $NQ (one queue per poll core)"
fi
if ((!present)); then
    note "note: interface $iface does not exist here; driver, limits and IRQs are not checked"
elif [[ -n $driver && $driver != "${P[DRIVER]}" ]]; then
    warn "$iface uses driver '$driver', this profile is for ${P[DRIVER]}"
fi
if ((present)) && [[ -r $SYSNET/$iface/device/numa_node ]]; then
    node=$(<"$SYSNET/$iface/device/numa_node")
    if [[ $node =~ ^[0-9]+$ && -r /sys/devices/system/node/node$node/cpulist ]]; then
        parse_cpu_list "$(</sys/devices/system/node/node"$node"/cpulist)" "NUMA node $node CPUs"
        declare -A on_node=()
        for c in "${CPU_OUT[@]}"; do on_node[$c]=1; done
        for c in "${POLL[@]}"; do
            [[ -n ${on_node[$c]:-} ]] || warn "poll core $c is not on NUMA node $node of $iface (cross-socket DMA and copies)"
        done
    fi
fi

# ethtool -l / -g limits, when the interface is here.
check_limit() { # what requested max current
    local what=$1 req=$2 max=$3 cur=$4
    if [[ $max =~ ^[0-9]+$ ]] && ((req > max)); then
        if ((APPLY)); then die "$iface: $what $req exceeds the NIC's maximum $max"; fi
        warn "$iface: $what $req exceeds the NIC's maximum $max; --apply would stop here"
    fi
    [[ -z $cur || $cur == n/a ]] || note "current $what: $cur (max ${max:-?})"
}
# (Only on the real /sys: with a test sysfs the interface is not a real one.)
if ((present)) && [[ $SYSNET == /sys/class/net ]] && command -v ethtool >/dev/null; then
    lout=$(ethtool -l "$iface" 2>/dev/null || true)
    gout=$(ethtool -g "$iface" 2>/dev/null || true)
    if ! skipped channels && [[ -n $lout ]]; then
        check_limit "combined channels" "$NQ" "$(ethtool_field "$lout" "Pre-set maximums" Combined)" \
            "$(ethtool_field "$lout" "Current hardware settings" Combined)"
    fi
    if ! skipped rings && [[ -n $gout ]]; then
        check_limit "RX ring" "${P[RX_RING]}" "$(ethtool_field "$gout" "Pre-set maximums" RX)" \
            "$(ethtool_field "$gout" "Current hardware settings" RX)"
        check_limit "TX ring" "${P[TX_RING]}" "$(ethtool_field "$gout" "Pre-set maximums" TX)" \
            "$(ethtool_field "$gout" "Current hardware settings" TX)"
    fi
fi

# ---------------------------------------------------------------------------------------
# The steps

if step channels "one combined channel per poll core (changing channels resets queues: tune before gradwire starts)"; then
    run ethtool -L "$iface" combined "$NQ"
fi

if step rings "RX/TX descriptors (profile max ${P[RING_MAX]})"; then
    run ethtool -G "$iface" rx "${P[RX_RING]}" tx "${P[TX_RING]}"
fi

if step coalesce "fixed, low interrupt moderation (busy polling masks the IRQ anyway)"; then
    read -ra _coal <<<"${P[COALESCE]}"
    run ethtool -C "$iface" "${_coal[@]}"
fi

if step features "LRO/GRO off for XDP, ntuple for steering (one feature per command)"; then
    read -ra _feat <<<"${P[FEATURES]}"
    for ((i = 0; i < ${#_feat[@]}; i += 2)); do
        run ethtool -K "$iface" "${_feat[i]}" "${_feat[i + 1]}"
    done
fi

if step mtu "single-buffer XDP frames"; then
    run ip link set dev "$iface" mtu "${P[MTU]}"
fi

if step napi "defer hard IRQs while gradwire busy-polls (SO_PREFER_BUSY_POLL)"; then
    write_val "/sys/class/net/$iface/napi_defer_hard_irqs" "${P[NAPI_DEFER_HARD_IRQS]}"
    write_val "/sys/class/net/$iface/gro_flush_timeout" "${P[GRO_FLUSH_TIMEOUT]}"
fi

if step sysctls "system-wide busy-poll defaults (microseconds; not persistent)"; then
    run sysctl -w "net.core.busy_poll=${P[BUSY_POLL]}"
    run sysctl -w "net.core.busy_read=${P[BUSY_READ]}"
fi

if step irqs "every IRQ of $iface to $HOUSE_LIST, away from the poll cores $POLL_LIST"; then
    irqs=()
    if ((present)) || [[ -n ${NIC_TUNE_TEST_SYSFS_NET:-}${NIC_TUNE_TEST_INTERRUPTS:-} ]]; then
        # Read now, after the channel change above (the driver may re-create its IRQs).
        mapfile -t irqs < <(find_irqs "$iface" "$(iface_pci "$iface")")
    fi
    if ((${#irqs[@]} == 0)); then
        if ((present)) || [[ -n ${NIC_TUNE_TEST_SYSFS_NET:-}${NIC_TUNE_TEST_INTERRUPTS:-} ]]; then
            note "no IRQs found for $iface (in its PCI function's msi_irqs or in $INTERRUPTS): a virtual device has none"
        else
            note "$iface is not here, so its IRQs were not looked up"
        fi
        note "on a real NIC each IRQ N gets: echo $HOUSE_LIST > /proc/irq/N/smp_affinity_list"
    fi
    for irq in "${irqs[@]}"; do
        name=$(irq_name "$irq")
        [[ -z $name ]] || note "IRQ $irq: $name"
        write_val "/proc/irq/$irq/smp_affinity_list" "$HOUSE_LIST"
    done
    if irqbalance_running; then
        warn "irqbalance is running and will move these IRQs back: stop it, or set IRQBALANCE_BANNED_CPULIST=$POLL_LIST"
    fi
fi

if step hugepages "2 MiB pages for the UMEMs"; then
    umem_bytes=$((NQ * P[UMEM_FRAMES_PER_QUEUE] * P[FRAME_SIZE]))
    base_pages=$(((umem_bytes + 2097151) / 2097152))
    need=$(((base_pages * (100 + P[HUGEPAGE_HEADROOM_PCT]) + 99) / 100))
    note "$NQ queues x ${P[UMEM_FRAMES_PER_QUEUE]} frames x ${P[FRAME_SIZE]} B = $((umem_bytes / 1048576)) MiB = $base_pages pages, +${P[HUGEPAGE_HEADROOM_PCT]}% = $need pages"
    total=$(meminfo HugePages_Total) free=$(meminfo HugePages_Free) hsize=$(meminfo Hugepagesize)
    total=${total:-0} free=${free:-0}
    hp_file=/proc/sys/vm/nr_hugepages
    if [[ -n $hsize && $hsize != 2048 ]]; then
        note "default hugepage size is ${hsize} kB, so the 2 MiB pool is set through sysfs"
        hp_file=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
        total=$(cat "$hp_file" 2>/dev/null || echo 0)
        free=$(cat /sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages 2>/dev/null || echo 0)
    fi
    if ((free >= need)); then
        note "$free free 2 MiB pages already (>= $need): nothing to do"
    else
        target=$((total + need - free))
        note "pool: $total pages, $free free; raising the pool to $target (never lowered here)"
        write_val "$hp_file" "$target"
        if ((APPLY)); then
            got=$(cat "$hp_file" 2>/dev/null || echo 0)
            if ((got < target)); then
                record_fail "hugepages" "only $got of $target pages allocated (fragmented memory: reserve them at boot with hugepages=$target)"
            fi
        fi
        note "NUMA: this spreads pages over nodes; to place them on the NIC's node use"
        note "/sys/devices/system/node/nodeN/hugepages/hugepages-2048kB/nr_hugepages or the boot line"
    fi
fi

if ((${#port_list[@]} > 0)); then
    if step steering "ntuple rules: gradwire UDP ports -> AF_XDP queues"; then
        existing=""
        if ((present)) && [[ $SYSNET == /sys/class/net ]] && command -v ethtool >/dev/null; then
            existing=$(ethtool -n "$iface" 2>/dev/null | awk '/Dest port:/ {print $3}' | tr '\n' ' ' || true)
        fi
        k=0
        for p in "${port_list[@]}"; do
            p=$((10#$p))
            q=$((XSK_BASE + k % NQ))
            if [[ " $existing " == *" $p "* ]]; then
                note "port $p already has a rule (ethtool -n $iface); delete it with ethtool -N $iface delete LOC to change it"
            else
                for t in ${P[STEER_FLOW_TYPES]}; do
                    run ethtool -N "$iface" flow-type "$t" dst-port "$p" action "$q"
                done
            fi
            k=$((k + 1))
        done
    fi
else
    echo
    note "== steering: no --udp-ports given; RSS spreads gradwire flows over the $NQ queues."
    note "With fixed receiver ports, --udp-ports P1,P2,... adds: ethtool -N $iface flow-type udp4 dst-port P action Q"
fi

echo
note "== gradwire: AF_XDP queue ids (bind one socket per queue, worker pinned to the core):"
for ((i = 0; i < NQ; i++)); do
    note "  queue $((XSK_BASE + i)) -> poll core ${POLL[i]}"
done
if ((XSK_BASE)); then
    note "  (mlx5 on kernel $kernel < ${P[XSK_QID_OFFSET_BELOW_KERNEL]}: zero-copy XSK queues are channel + $NQ)"
fi
if [[ ${P[XSK_ZEROCOPY]} == yes ]]; then
    note "  ${P[DRIVER]} supports zero-copy: check gradwire's stats report zero-copy, not copy mode"
fi

echo
if ((APPLY)); then
    if ((${#FAILURES[@]})); then
        note "applied $NCMD commands, ${#FAILURES[@]} failed:"
        for f in "${FAILURES[@]}"; do note "  $f"; done
        exit 1
    fi
    note "applied $NCMD commands, all succeeded (not persistent: re-run after reboot or driver reload)"
else
    note "dry run: $NCMD commands printed, nothing changed; add --apply (as root) to run them"
fi
