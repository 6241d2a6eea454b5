#!/usr/bin/env bash
# A Ray cluster of emulated hosts on this machine: one head and N worker
# nodes, each in a network namespace of its own (refit-ray-0 is the head,
# refit-ray-1.. the workers) with a veth pair to a bridge on 10.78.0.0/24
# (`eth0` inside, host K at 10.78.0.K+1), started with Ray's own commands.
# Root only.
#
#   scripts/ray-cluster.sh up [N] [RAY]   # N worker nodes (default 3); RAY: the ray command
#   scripts/ray-cluster.sh add K [RAY]    # one more worker node, host K (a replacement)
#   scripts/ray-cluster.sh kill K         # host K lost: every process in it killed (kept until down)
#   scripts/ray-cluster.sh down           # everything it made, whatever state it is in
#   scripts/ray-cluster.sh exec K CMD...  # CMD inside host K's namespace
#
# Worker node K offers Ray the resources {"hostK": 1} and, with a role,
# {"ROLE": 16} (placement groups ask for a role, not a host). Shaped links:
# a worker node's link is capped by a `tbf` on both ends of its veth (its
# egress inside, its ingress on the bridge's side), as `refit launch
# --netns --emulate-nic-mbps` shapes each node's: at the node's rate in
# each direction, a bucket of 10 ms of traffic (at least 64 KiB), packets
# waiting at most 100 ms. `up` takes them from the environment, one word
# per worker node; `add` from RATE and ROLE:
#
#   RATES="10 10 20" ROLES="train train rollout" scripts/ray-cluster.sh up 3
#   RATE=10 ROLE=train scripts/ray-cluster.sh add 4
#
# (rates in whole MB/s, 10^6 bytes; "-" or nothing: unshaped.) The head's link
# is not shaped (it carries the control plane).
#
# The head listens on 10.78.0.1:6379. Token authentication is off
# (RAY_AUTH_MODE=disabled): a token file left in ~/.ray by another cluster
# would otherwise make every worker's join fail with InvalidAuthToken.
# `up` and `add` tear down whatever they made if a step fails (`up`:
# everything); `down` kills every process in the namespaces, removes them,
# the bridge and Ray's session files under /tmp/ray-refit-*.
set -euo pipefail

PREFIX=refit-ray
BRIDGE=refitraybr0
NET=10.78.0

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
    kill_host "$ns"
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf /tmp/ray-refit-*
}

# The tbf arguments for a rate in MB/s (as refit launch --netns writes them).
tbf() {
  local bytes=$(($1 * 1000000))
  local burst=$((bytes / 100 > 65536 ? bytes / 100 : 65536))
  echo "tbf rate $((bytes * 8))bit burst $burst latency 100ms"
}

# Host K's namespace and link, shaped at RATE MB/s if given.
host() {
  local k=$1 rate=${2:--} ns="$PREFIX-$1"
  ip netns add "$ns"
  ip link add "rr$k" type veth peer name eth0 netns "$ns"
  ip link set "rr$k" master "$BRIDGE" up
  ip -n "$ns" addr add "$NET.$((k + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  if [ "$rate" != - ]; then
    # shellcheck disable=SC2046 # the words of the tbf arguments
    tc -n "$ns" qdisc add dev eth0 root handle 1: $(tbf "$rate")
    # shellcheck disable=SC2046
    tc qdisc add dev "rr$k" root handle 1: $(tbf "$rate")
  fi
}

# Worker node K joins the head (host K made first), with role ROLE if given.
node() {
  local k=$1 ray=$2 role=${3:--} resources
  resources="{\"host$k\": 1}"
  [ "$role" != - ] && resources="{\"host$k\": 1, \"$role\": 16}"
  RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 ip netns exec "$PREFIX-$k" "$ray" start --address="$NET.1:6379" \
    --node-ip-address="$NET.$((k + 1))" --resources="$resources" >/dev/null
}

# Until N Ray nodes are alive in the head's view (a worker's `ray start`
# returns before the head lists it).
alive_nodes() {
  local want=$1 ray=$2 alive=0
  for _ in $(seq 120); do
    alive=$(RAY_AUTH_MODE=disabled ip netns exec "$PREFIX-0" "$ray" status --address="$NET.1:6379" 2>/dev/null | grep -c "^ 1 node_" || true)
    [ "$alive" -ge "$want" ] && return 0
    sleep 0.5
  done
  echo "only $alive of $want Ray nodes came up" >&2
  return 1
}

up() {
  local n=${1:-3} ray=${2:-ray}
  local -a rates roles
  read -r -a rates <<<"${RATES:-}"
  read -r -a roles <<<"${ROLES:-}"
  down
  trap 'down; exit 1' ERR
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  host 0
  for k in $(seq 1 "$n"); do host "$k" "${rates[$((k - 1))]:--}"; done
  export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
  ip netns exec "$PREFIX-0" "$ray" start --head --node-ip-address="$NET.1" --port=6379 \
    --temp-dir=/tmp/ray-refit-0 --include-dashboard=false --disable-usage-stats >/dev/null
  for k in $(seq 1 "$n"); do node "$k" "$ray" "${roles[$((k - 1))]:--}"; done
  alive_nodes $((n + 1)) "$ray"
  trap - ERR
  echo "$NET.1:6379"
}

# One more worker node, host K (the cluster up): its namespace and link
# removed again if it cannot join. Joined once the head counts its
# resource hostK among the alive nodes' (not a count of nodes: a node
# just lost may be found dead meanwhile).
add() {
  local k=$1 ray=${2:-ray}
  [ -n "$k" ] && ip link show "$BRIDGE" >/dev/null 2>&1 || { echo "add K: no cluster is up" >&2; return 1; }
  trap 'remove "$k"; exit 1' ERR
  host "$k" "${RATE:--}"
  node "$k" "$ray" "${ROLE:--}"
  for _ in $(seq 120); do
    RAY_AUTH_MODE=disabled ip netns exec "$PREFIX-0" "$ray" status --address="$NET.1:6379" 2>/dev/null | grep "/1.0 host$k\$" >/dev/null && break
    sleep 0.5
  done
  RAY_AUTH_MODE=disabled ip netns exec "$PREFIX-0" "$ray" status --address="$NET.1:6379" 2>/dev/null | grep "/1.0 host$k\$" >/dev/null ||
    { echo "node $k did not join" >&2; false; }
  trap - ERR
}

# Every process in host K's namespace, killed; none left when it returns.
kill_host() {
  local ns=$1 pids alive
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  # Until every one has exited (a killed process goes some time later).
  for _ in $(seq 100); do
    alive=0
    for p in $pids; do [ -e "/proc/$p" ] && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
}

# Host K's processes, namespace and link.
remove() {
  kill_host "$PREFIX-$1"
  ip netns del "$PREFIX-$1" 2>/dev/null || true
  ip link del "rr$1" 2>/dev/null || true
}

case "${1:-}" in
  up) shift; up "$@" ;;
  add) shift; add "$@" ;;
  kill) kill_host "$PREFIX-${2:?kill K}" ;;
  down) down ;;
  exec) shift; k=$1; shift; exec ip netns exec "$PREFIX-$k" "$@" ;;
  *) echo "usage: $0 up [N] [RAY] | add K [RAY] | kill K | down | exec K CMD..." >&2; exit 2 ;;
esac
