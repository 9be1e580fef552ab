#!/usr/bin/env bash
# Two hosts on one Linux machine: network namespaces A (198.18.0.1) and B (198.18.0.2) joined
# by a veth pair, one torchrun agent in each (c10d rendezvous on A), training PLAN with
# `python -m runtime` (docs/multihost.md). Traffic stays on the veth pair; the namespaces go
# away on exit.
#
# Usage (root):  scripts/two_hosts.sh NPROC_A NPROC_B PLAN [python -m runtime options]
#   e.g.          scripts/two_hosts.sh 3 3 plan.json --steps 30 --out /tmp/run
#                scripts/two_hosts.sh links OUT.yaml   (measure the A-B link:
#                `hetpipe profile --links --peer`, the inter_node class, into OUT.yaml)
# Environment:   PYTHON (default python), MAX_RESTARTS (torchrun --max-restarts, default 1),
#                RDZV_PORT (default 29500), TC_QDISC (shape the link both ways: the qdisc
#                after `tc qdisc add dev VETH root`, e.g. "tbf rate 200mbit burst 32kbit
#                latency 50ms", or "netem delay 1ms" where the kernel has sch_netem).
# Exit codes:    0 both hosts succeeded; 77 namespaces cannot be made here (not root, no ip);
#                otherwise the first failing host's code.
set -uo pipefail

links_out=
if [[ ${1:-} == links && $# -eq 2 ]]; then
    links_out=$2
    set -- 0 0 none
elif (($# < 3)); then
    echo "usage: $0 NPROC_A NPROC_B PLAN [python -m runtime options] | $0 links OUT.yaml" >&2
    exit 2
fi
nproc_a=$1 nproc_b=$2 plan=$3
shift 3
py=${PYTHON:-python}
port=${RDZV_PORT:-29500}
addr_a=198.18.0.1 addr_b=198.18.0.2
ns_a=hpa$$ ns_b=hpb$$ # namespace and veth end share a name (15 characters at most)
pids=()

cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
    ip netns del "$ns_a" 2>/dev/null
    ip netns del "$ns_b" 2>/dev/null
}

if ! command -v ip >/dev/null || ! ip netns add "$ns_a" 2>/dev/null; then
    echo "two_hosts: cannot make network namespaces here (needs root and iproute2)" >&2
    exit 77
fi
trap cleanup EXIT
set -e
ip netns add "$ns_b"
ip link add "$ns_a" type veth peer name "$ns_b"
for side in "a $ns_a $addr_a" "b $ns_b $addr_b"; do
    read -r _ ns addr <<<"$side"
    ip link set "$ns" netns "$ns"
    ip -n "$ns" addr add "$addr/24" dev "$ns"
    ip -n "$ns" link set "$ns" up
    ip -n "$ns" link set lo up
    if [[ -n ${TC_QDISC:-} ]]; then
        # shellcheck disable=SC2086  # TC_QDISC is a list of tc words
        ip netns exec "$ns" tc qdisc add dev "$ns" root $TC_QDISC
    fi
done
set +e

agent() { # NAMESPACE ADDRESS NPROC IS_HOST
    ip netns exec "$1" env GLOO_SOCKET_IFNAME="$1" NCCL_SOCKET_IFNAME="$1" \
        "$py" -m torch.distributed.run --nnodes 2 --nproc-per-node "$3" \
        --rdzv-backend c10d --rdzv-endpoint "$addr_a:$port" --rdzv-conf "is_host=$4" \
        --local-addr "$2" --max-restarts "${MAX_RESTARTS:-1}" --monitor-interval 0.5 \
        -m runtime "$plan" "${@:5}"
}

if [[ -n $links_out ]]; then
    for side in "0 $ns_a" "1 $ns_b"; do
        read -r rank ns <<<"$side"
        ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$ns" "$py" -m hetpipe profile --links \
            --peer "$addr_a:$port" --peer-rank "$rank" -o "$links_out" &
        pids+=($!)
    done
else
    agent "$ns_a" "$addr_a" "$nproc_a" 1 "$@" &
    pids+=($!)
    agent "$ns_b" "$addr_b" "$nproc_b" 0 "$@" &
    pids+=($!)
fi
wait "${pids[0]}"
code_a=$?
wait "${pids[1]}"
code_b=$?
pids=()
echo "two_hosts: host A ($addr_a) exit $code_a, host B ($addr_b) exit $code_b" >&2
if ((code_a != 0)); then exit "$code_a"; fi
exit "$code_b"
