#!/usr/bin/env bash
# Dry-run test of scripts/nic-tune.sh against every profile in this directory.
#
# Never changes the machine and needs no root: nic-tune.sh only ever runs WITHOUT --apply
# here, against made-up interface names, with a fake sysfs, /proc/interrupts and
# /proc/meminfo (read-only test hooks that nic-tune.sh refuses with --apply) and
# --online-cpus / --kernel, so the output does not depend on this machine.
# Checks that each profile's commands appear, values included, and that bad input is
# rejected. Takes a few seconds. Prints "N passed, M failed"; exits 1 on any failure.
# shellcheck disable=SC2015  # "ok" always succeeds, so "A && ok || bad" is if-then-else here
# shellcheck disable=SC2016  # the evil profile line is meant to stay unexpanded
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TUNE=$HERE/../../scripts/nic-tune.sh
pass=0 fail=0

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

ok() { pass=$((pass + 1)); }
bad() {
    fail=$((fail + 1))
    echo "FAIL: $*"
}

# expect_line NAME OUTPUT LINE: OUTPUT has LINE as a whole line.
expect_line() {
    if grep -qxF -- "$3" <<<"$2"; then ok; else bad "$1: missing line: $3"; fi
}
expect_no_match() {
    if grep -qE -- "$3" <<<"$2"; then bad "$1: unexpected match for /$3/"; else ok; fi
}

# profile_value FILE KEY: KEY's value, quotes removed (the test's own reading of a profile).
profile_value() {
    sed -n "s/^$2=//p" "$1" | sed 's/^"\(.*\)"$/\1/'
}

# --- fake system --------------------------------------------------------------------------
# gwtest0: a PCI NIC (mlx5-style IRQ names: the PCI address, not the interface name).
# gwtest1: found only by name in /proc/interrupts (ice-style names). gwtest10 must not
# match gwtest1.
mkdir -p "$TMP/sys/net/gwtest1" "$TMP/sys/devices/0000:3b:00.0/msi_irqs" "$TMP/sys/net/gwtest0"
touch "$TMP/sys/devices/0000:3b:00.0/msi_irqs/140" "$TMP/sys/devices/0000:3b:00.0/msi_irqs/141" \
    "$TMP/sys/devices/0000:3b:00.0/msi_irqs/142"
ln -s ../../devices/0000:3b:00.0 "$TMP/sys/net/gwtest0/device"
cat >"$TMP/interrupts" <<'EOF'
            CPU0       CPU1       CPU2       CPU3
 140:          0          0          0          0  IR-PCI-MSIX-0000:3b:00.0    0-edge      mlx5_async0@pci:0000:3b:00.0
 141:       1203          0          0          0  IR-PCI-MSIX-0000:3b:00.0    1-edge      mlx5_comp0@pci:0000:3b:00.0
 142:          0        377          0          0  IR-PCI-MSIX-0000:3b:00.0    2-edge      mlx5_comp1@pci:0000:3b:00.0
 150:         10          0          0          0  IR-PCI-MSIX-0000:5e:00.0    1-edge      ice-gwtest1-TxRx-0
 151:          0         10          0          0  IR-PCI-MSIX-0000:5e:00.0    2-edge      ice-gwtest1-TxRx-1
 160:          0          0         10          0  IR-PCI-MSIX-0000:5f:00.0    1-edge      ice-gwtest10-TxRx-0
 170:          0          0          0         10  IR-PCI-MSIX-0000:00:03.0    1-edge      eth0-TxRx-0
NMI:          0          0          0          0   Non-maskable interrupts
EOF
cat >"$TMP/meminfo" <<'EOF'
MemTotal:       24000000 kB
HugePages_Total:       8
HugePages_Free:        8
Hugepagesize:       2048 kB
EOF

tune() {
    NIC_TUNE_TEST_SYSFS_NET=$TMP/sys/net NIC_TUNE_TEST_INTERRUPTS=$TMP/interrupts \
        NIC_TUNE_TEST_MEMINFO=$TMP/meminfo bash "$TUNE" "$@"
}

# --- every profile ------------------------------------------------------------------------
profiles=()
for f in "$HERE"/*.conf; do
    n=${f##*/}
    profiles+=("${n%.conf}")
done
for want in cx5-25g cx5-100g cx6-25g cx6-100g e810-25g e810-100g; do
    if [[ " ${profiles[*]} " == *" $want "* ]]; then ok; else bad "profile $want.conf missing"; fi
done

for name in "${profiles[@]}"; do
    f=$HERE/$name.conf
    driver=$(profile_value "$f" DRIVER)
    ch=$(profile_value "$f" CHANNELS)
    rx=$(profile_value "$f" RX_RING)
    tx=$(profile_value "$f" TX_RING)
    max=$(profile_value "$f" RING_MAX)
    coal=$(profile_value "$f" COALESCE)
    feat=$(profile_value "$f" FEATURES)
    mtu=$(profile_value "$f" MTU)
    frames=$(profile_value "$f" UMEM_FRAMES_PER_QUEUE)
    fsize=$(profile_value "$f" FRAME_SIZE)
    pct=$(profile_value "$f" HUGEPAGE_HEADROOM_PCT)

    # Facts the profiles must respect (ring maxima from the drivers).
    case $driver in
        mlx5_core) [[ $max == 8192 ]] && ok || bad "$name: mlx5 RING_MAX should be 8192, is $max" ;;
        ice) [[ $max == 8160 ]] && ok || bad "$name: ice RING_MAX should be 8160, is $max" ;;
        *) bad "$name: unexpected driver $driver" ;;
    esac
    ((rx <= max && tx <= max)) && ok || bad "$name: ring above max"

    # Poll cores 2..(2+ch-1) on an 8-CPU host; NIC IRQs must go to the rest.
    last=$((2 + ch - 1))
    cores="2-$last"
    house="0-1"
    ((last < 7)) && house="0-1,$((last + 1))-7"
    if [[ $name == e810* ]]; then iface=gwtest1; else iface=gwtest0; fi
    out=$(tune --profile "$name" --iface "$iface" --poll-cores "$cores" --online-cpus 0-7 \
        --kernel 6.8.0 --udp-ports 47000,47001 2>&1) && ok || bad "$name: dry run exited $?: $out"

    expect_line "$name" "$out" "# DRY RUN: commands that --apply would run; nothing is changed"
    expect_line "$name" "$out" "ethtool -L $iface combined $ch"
    expect_line "$name" "$out" "ethtool -G $iface rx $rx tx $tx"
    expect_line "$name" "$out" "ethtool -C $iface $coal"
    read -ra fw <<<"$feat"
    for ((i = 0; i < ${#fw[@]}; i += 2)); do
        expect_line "$name" "$out" "ethtool -K $iface ${fw[i]} ${fw[i + 1]}"
    done
    expect_line "$name" "$out" "ethtool -K $iface lro off"
    expect_line "$name" "$out" "ethtool -K $iface gro off"
    expect_line "$name" "$out" "ip link set dev $iface mtu $mtu"
    expect_line "$name" "$out" "echo $(profile_value "$f" NAPI_DEFER_HARD_IRQS) > /sys/class/net/$iface/napi_defer_hard_irqs"
    expect_line "$name" "$out" "echo $(profile_value "$f" GRO_FLUSH_TIMEOUT) > /sys/class/net/$iface/gro_flush_timeout"
    expect_line "$name" "$out" "sysctl -w net.core.busy_poll=$(profile_value "$f" BUSY_POLL)"
    expect_line "$name" "$out" "sysctl -w net.core.busy_read=$(profile_value "$f" BUSY_READ)"

    # IRQs: exactly the interface's own, to the housekeeping CPUs.
    if [[ $iface == gwtest0 ]]; then
        want_irqs="140 141 142"
    else
        want_irqs="150 151"
    fi
    for irq in $want_irqs; do
        expect_line "$name" "$out" "echo $house > /proc/irq/$irq/smp_affinity_list"
    done
    got=$(grep -cE '^echo .* > /proc/irq/[0-9]+/smp_affinity_list$' <<<"$out" || true)
    [[ $got == "$(wc -w <<<"$want_irqs")" ]] && ok || bad "$name: $got IRQ writes, want $(wc -w <<<"$want_irqs")"
    expect_no_match "$name" "$out" '/proc/irq/(160|170)/'

    # Hugepages: ceil(ch x frames x size / 2 MiB) + headroom, on top of the 8 free ones.
    base=$(((ch * frames * fsize + 2097151) / 2097152))
    need=$(((base * (100 + pct) + 99) / 100))
    expect_line "$name" "$out" "echo $((8 + need - 8)) > /proc/sys/vm/nr_hugepages"

    # Steering to queues 0 and 1 on a current kernel.
    expect_line "$name" "$out" "ethtool -N $iface flow-type udp4 dst-port 47000 action 0"
    expect_line "$name" "$out" "ethtool -N $iface flow-type udp4 dst-port 47001 action 1"
    expect_line "$name" "$out" "ethtool -N $iface flow-type udp6 dst-port 47000 action 0"

    # Old kernel: mlx5 zero-copy queues move up by the channel count, ice's do not.
    out_old=$(tune --profile "$name" --iface "$iface" --poll-cores "$cores" --online-cpus 0-7 \
        --kernel 5.15.0-91-generic --udp-ports 47000 2>&1) && ok || bad "$name: old-kernel dry run failed"
    if [[ $driver == mlx5_core ]]; then
        expect_line "$name" "$out_old" "ethtool -N $iface flow-type udp4 dst-port 47000 action $ch"
    else
        expect_line "$name" "$out_old" "ethtool -N $iface flow-type udp4 dst-port 47000 action 0"
    fi

    # Skipping steps drops their commands.
    out_skip=$(tune --profile "$name" --iface "$iface" --poll-cores "$cores" --online-cpus 0-7 \
        --kernel 6.8.0 --skip sysctls,hugepages 2>&1) && ok || bad "$name: --skip dry run failed"
    expect_no_match "$name --skip" "$out_skip" '^sysctl -w|nr_hugepages$'
done

# A poll-core count different from the profile's is allowed and noted.
out=$(tune --profile cx5-100g --iface gwtest9 --poll-cores 3 --online-cpus 0-3 --kernel 6.8 2>&1) && ok || bad "3-core run failed"
expect_line "one core" "$out" "ethtool -L gwtest9 combined 1"
expect_line "one core" "$out" "# note: the profile recommends 4 poll cores at 100G; using 1 (one queue per poll core)"

# --list shows every profile.
out=$(bash "$TUNE" --list 2>&1) && ok || bad "--list failed"
for name in "${profiles[@]}"; do
    grep -q "^$name " <<<"$out" && ok || bad "--list lacks $name"
done

# --- invalid input is rejected with exit 2 and a clear message -----------------------------
expect_error() { # description expected-message args...
    local what=$1 msg=$2 rc=0 o
    shift 2
    o=$(tune "$@" 2>&1) || rc=$?
    if [[ $rc == 2 ]] && grep -qF -- "$msg" <<<"$o"; then ok; else bad "$what: rc=$rc output: $o"; fi
}
expect_error "unknown profile" "unknown profile 'nosuch'" --profile nosuch --iface gwtest0 --poll-cores 2
expect_error "open range" "malformed CPU list '2-'" --profile cx5-25g --iface gwtest0 --poll-cores 2-
expect_error "letters" "malformed CPU list 'a,b'" --profile cx5-25g --iface gwtest0 --poll-cores a,b
expect_error "backwards" "range '5-2' goes backwards" --profile cx5-25g --iface gwtest0 --poll-cores 5-2
expect_error "duplicate" "CPU 3 listed twice" --profile cx5-25g --iface gwtest0 --poll-cores 2-3,3 --online-cpus 0-7
expect_error "offline" "CPU 9 is not online" --profile cx5-25g --iface gwtest0 --poll-cores 9 --online-cpus 0-7
expect_error "no housekeeping" "covers every online CPU" --profile cx5-25g --iface gwtest0 --poll-cores 0-7 --online-cpus 0-7
expect_error "bad iface" "invalid interface name" --profile cx5-25g --iface ../x --poll-cores 2
expect_error "bad skip" "unknown step 'bogus'" --profile cx5-25g --iface gwtest0 --poll-cores 2 --skip bogus
expect_error "bad port" "not a port number" --profile cx5-25g --iface gwtest0 --poll-cores 2 --udp-ports 0
expect_error "no poll cores" "--poll-cores is required" --profile cx5-25g --iface gwtest0

# A profile trying to smuggle shell code is refused before anything runs.
sed 's/^MTU=1500$/MTU=1500$(touch '"${TMP//\//\\/}"'\/pwned)/' "$HERE/cx5-25g.conf" >"$TMP/evil.conf"
expect_error "evil profile" "characters outside" --profile "$TMP/evil.conf" --iface gwtest0 --poll-cores 1
[[ ! -e $TMP/pwned ]] && ok || bad "profile value was executed"

echo "$pass passed, $fail failed"
((fail == 0))
