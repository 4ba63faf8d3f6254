#!/usr/bin/env bash
# A network-namespace testbed by hand, the same shape as gradwire_netns::Testbed (netns/src/testbed.rs):
#
#   scripts/testbed.sh up [N] [--queues Q] [--mtu M]   N hosts (default 2), Q veth queues (1)
#   scripts/testbed.sh status
#   scripts/testbed.sh down
#
# Host i is namespace gwshh<i> with interface gw0 = 198.18.0.(i+1)/24, MAC 02:67:77:00:00:<i+1>,
# lo up, IPv6 disabled, TX checksum offload off (a kernel UDP sender's partial checksums would
# be rejected by a verifying AF_XDP receiver) and permanent neighbour entries for every other
# host (a kernel-bypass sender does no ARP). Two hosts share one veth pair; more hosts hang off
# bridge br0 in namespace gwshsw.
#
# The prefix gwsh keeps these apart from the Rust testbed (gw<pid>t<n>..., cleaned up by pid);
# `down` removes exactly the namespaces `up` recorded in /run/gradwire-testbed.list, by the
# namespace kit's teardown rule (netns/src/lib.rs): host veths first, then the namespaces; it
# touches nothing else.
set -euo pipefail

readonly LIST=/run/gradwire-testbed.list
readonly PREFIX=gwsh
readonly IFNAME=gw0

die() {
    echo "testbed: $*" >&2
    exit 1
}

usage() {
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces and veths): run it with sudo"
    command -v ip >/dev/null || die "\`ip\` not found: install iproute2 (scripts/deps.sh does)"
}

host_ns() { echo "${PREFIX}h$1"; }
host_ip() { echo "198.18.0.$(($1 + 1))"; }
host_mac() { printf '02:67:77:00:%02x:%02x' $((($1 + 1) >> 8)) $((($1 + 1) & 255)); }
in_range() { [[ $1 =~ ^[0-9]+$ ]] && (($1 >= $2 && $1 <= $3)); }
ns_exists() { [[ -e /run/netns/$1 ]]; }

# The recorded namespaces, validated: a hand-edited list can never make `down` delete a
# namespace that is not ours.
recorded() {
    [[ -f $LIST ]] || return 0
    local name
    while IFS= read -r name; do
        [[ -z $name || $name == \#* ]] && continue
        [[ $name =~ ^${PREFIX}(h[0-9]+|sw)$ ]] || die "$LIST: unexpected entry '$name'"
        echo "$name"
    done <"$LIST"
}

recorded_shape() { [[ -f $LIST ]] && sed -n 's/^# shape: //p' "$LIST"; }

cmd_down() {
    need_root
    if [[ ! -f $LIST ]]; then
        echo "testbed: nothing to remove (no $LIST)"
        return 0
    fi
    local names=() ns
    mapfile -t names < <(recorded)
    # Host interfaces first: deleting a veth detaches XDP programs at once, even if some
    # process still holds the namespace open.
    for ns in "${names[@]}"; do
        if [[ $ns != "${PREFIX}sw" ]] && ns_exists "$ns"; then
            ip -n "$ns" link del "$IFNAME" 2>/dev/null || true
        fi
    done
    for ns in "${names[@]}"; do
        if ns_exists "$ns"; then
            ip netns del "$ns"
            echo "testbed: removed $ns"
        fi
    done
    rm -f "$LIST"
}

cmd_up() {
    local hosts=2 queues=1 mtu=1500
    while (($#)); do
        case $1 in
        --queues) queues=${2:?--queues needs a value}; shift 2 ;;
        --mtu) mtu=${2:?--mtu needs a value}; shift 2 ;;
        [0-9]*) hosts=$1; shift ;;
        *) usage ;;
        esac
    done
    in_range "$hosts" 2 254 || die "hosts must be 2..254"
    in_range "$queues" 1 4096 || die "--queues must be 1..4096"
    in_range "$mtu" 68 65535 || die "--mtu must be 68..65535"
    need_root
    command -v ethtool >/dev/null || die "\`ethtool\` not found: install it (scripts/deps.sh does)"

    local shape="hosts=$hosts queues=$queues mtu=$mtu" ns
    if [[ -f $LIST ]]; then
        local complete=1
        while IFS= read -r ns; do ns_exists "$ns" || complete=0; done < <(recorded)
        if [[ $(recorded_shape) == "$shape" ]] && ((complete)); then
            echo "testbed: already up ($shape)"
            cmd_status
            return 0
        fi
        [[ $(recorded_shape) == "$shape" ]] ||
            die "a testbed with another shape is up ($(recorded_shape)); run '$0 down' first"
        echo "testbed: the recorded testbed is incomplete; rebuilding it"
        cmd_down
    fi
    # Namespaces with our prefix that nobody recorded (e.g. a deleted list): not ours to
    # remove silently, and `ip netns add` would fail on them.
    local strays
    strays=$(ip netns list | awk '{print $1}' | grep -E "^${PREFIX}(h[0-9]+|sw)$" || true)
    [[ -z $strays ]] || die "unrecorded namespaces exist: $(echo "$strays" | tr '\n' ' ')- remove them with 'ip netns del NAME'"

    # From here on any failure or interruption removes whatever was created.
    UP_IN_PROGRESS=1
    printf '# gradwire testbed, created by %s\n# shape: %s\n' "$0" "$shape" >"$LIST"

    local names=() i
    for ((i = 0; i < hosts; i++)); do names+=("$(host_ns "$i")"); done
    if ((hosts > 2)); then names+=("${PREFIX}sw"); fi
    for ns in "${names[@]}"; do
        # Recorded before it exists, so that even an interrupted `up` is undone by `down`.
        echo "$ns" >>"$LIST"
        ip netns add "$ns"
        # shellcheck disable=SC2016 # expanded by the inner sh, on purpose
        # Before any interface exists, so that new ones inherit it: no RS/MLD noise for an
        # AF_XDP receiver, and certainly no global IPv6 address.
        ip netns exec "$ns" sh -c 'for c in default all; do
            f=/proc/sys/net/ipv6/conf/$c/disable_ipv6; [ -e "$f" ] && echo 1 >"$f"; done; true'
        ip -n "$ns" link set lo up
    done

    local q=(numtxqueues "$queues" numrxqueues "$queues" mtu "$mtu")
    if ((hosts == 2)); then
        ip -n "${names[0]}" link add "$IFNAME" "${q[@]}" address "$(host_mac 0)" type veth \
            peer name "$IFNAME" "${q[@]}" address "$(host_mac 1)" netns "${names[1]}"
    else
        local sw=${PREFIX}sw
        ip -n "$sw" link add br0 type bridge stp_state 0 forward_delay 0 mcast_snooping 0
        for ((i = 0; i < hosts; i++)); do
            ip -n "${names[i]}" link add "$IFNAME" "${q[@]}" address "$(host_mac "$i")" \
                type veth peer name "h$i" "${q[@]}" netns "$sw"
            ip -n "$sw" link set "h$i" master br0 up
        done
        ip -n "$sw" link set br0 up
    fi

    local j
    for ((i = 0; i < hosts; i++)); do
        ns=${names[i]}
        {
            echo "addr add $(host_ip "$i")/24 dev $IFNAME"
            echo "link set $IFNAME up"
            for ((j = 0; j < hosts; j++)); do
                ((j == i)) || echo "neigh replace $(host_ip "$j") lladdr $(host_mac "$j") dev $IFNAME nud permanent"
            done
        } | ip -n "$ns" -batch -
        ip netns exec "$ns" ethtool -K "$IFNAME" tx off >/dev/null
    done
    UP_IN_PROGRESS=0

    echo "testbed: up ($shape)"
    for ((i = 0; i < hosts; i++)); do
        echo "  host $i: $(host_ip "$i")/24 on $IFNAME, enter with: ip netns exec $(host_ns "$i") bash"
    done
    echo "  remove with: $0 down"
}

cmd_status() {
    need_root
    if [[ ! -f $LIST ]]; then
        echo "testbed: down (no $LIST)"
    else
        echo "testbed: $(recorded_shape) (from $LIST)"
        local ns
        while IFS= read -r ns; do
            if ! ns_exists "$ns"; then
                echo "  $ns: MISSING"
            elif [[ $ns == "${PREFIX}sw" ]]; then
                echo "  $ns: bridge ports: $(ip -n "$ns" -br link show master br0 | awk '{print $1}' | cut -d@ -f1 | tr '\n' ' ')"
            else
                local addr xdp
                addr=$(ip -n "$ns" -br -4 addr show dev "$IFNAME" 2>/dev/null | awk '{print $2, $3}')
                xdp=$(ip -n "$ns" link show dev "$IFNAME" 2>/dev/null | grep -o 'prog/xdp id [0-9]*' || true)
                echo "  $ns: $IFNAME ${addr:-?} ${xdp:-no XDP program}"
            fi
        done < <(recorded)
    fi
    local strays
    strays=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}" | grep -vxF -f <(recorded) || true)
    [[ -z $strays ]] || echo "  unrecorded $PREFIX* namespaces: $(echo "$strays" | tr '\n' ' ')"
    return 0
}

UP_IN_PROGRESS=0
on_exit() {
    local rc=$?
    if ((UP_IN_PROGRESS)); then
        UP_IN_PROGRESS=0
        echo "testbed: up failed or was interrupted; removing what it created" >&2
        cmd_down || true
    fi
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

case ${1:-} in
up) shift; cmd_up "$@" ;;
down) shift; (($# == 0)) || usage; cmd_down ;;
status) shift; (($# == 0)) || usage; cmd_status ;;
*) usage ;;
esac
