#!/usr/bin/env bash
# A Ray cluster of emulated hosts on this machine (issue 54, first piece):
# one head and N worker nodes, each in a network namespace of its own
# (refit-ray-0 is the head, refit-ray-1.. the workers), joined by a bridge
# on 10.78.0.0/24, started with Ray's own commands. Root only.
#
#   scripts/ray-cluster.sh up [N] [RAY]   # N worker nodes (default 3); RAY: the ray command
#   scripts/ray-cluster.sh down           # everything it made, whatever state it is in
#   scripts/ray-cluster.sh exec K CMD...  # CMD inside host K's namespace
#
# The head listens on 10.78.0.1:6379. Token authentication is off
# (RAY_AUTH_MODE=disabled): a token file left in ~/.ray by another cluster
# would otherwise make every worker's join fail with InvalidAuthToken.
# `up` tears down whatever it had made if any step fails; `down` kills
# every process in the namespaces, removes them, the bridge and Ray's
# session files under /tmp/ray-refit-*.
set -euo pipefail

PREFIX=refit-ray
BRIDGE=refitraybr0
NET=10.78.0

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    # Until every one has exited (a killed process goes some time later).
    for _ in $(seq 100); do
      alive=0
      for p in $pids; do [ -e "/proc/$p" ] && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 0.1
    done
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf /tmp/ray-refit-*
}

host() {
  local k=$1 ns="$PREFIX-$1"
  ip netns add "$ns"
  ip link add "rr$k" type veth peer name "rrp$k"
  ip link set "rrp$k" netns "$ns"
  ip link set "rr$k" master "$BRIDGE" up
  ip -n "$ns" addr add "$NET.$((k + 1))/24" dev "rrp$k"
  ip -n "$ns" link set "rrp$k" up
  ip -n "$ns" link set lo up
}

up() {
  local n=${1:-3} ray=${2:-ray}
  down
  trap 'down; exit 1' ERR
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for k in $(seq 0 "$n"); do host "$k"; done
  export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
  ip netns exec "$PREFIX-0" "$ray" start --head --node-ip-address="$NET.1" --port=6379 \
    --temp-dir=/tmp/ray-refit-0 --include-dashboard=false --disable-usage-stats >/dev/null
  for k in $(seq 1 "$n"); do
    ip netns exec "$PREFIX-$k" "$ray" start --address="$NET.1:6379" --node-ip-address="$NET.$((k + 1))" \
      --resources="{\"host$k\": 1}" >/dev/null
  done
  # Until every node is alive in the head's view (a worker's `ray start`
  # returns before the head lists it).
  for _ in $(seq 120); do
    alive=$(ip netns exec "$PREFIX-0" "$ray" status --address="$NET.1:6379" 2>/dev/null | grep -c "^ 1 node_" || true)
    [ "$alive" -ge $((n + 1)) ] && break
    sleep 0.5
  done
  [ "$alive" -ge $((n + 1)) ] || { echo "only $alive of $((n + 1)) Ray nodes came up" >&2; false; }
  trap - ERR
  echo "$NET.1:6379"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  exec) shift; k=$1; shift; exec ip netns exec "$PREFIX-$k" "$@" ;;
  *) echo "usage: $0 up [N] [RAY] | down | exec K CMD..." >&2; exit 2 ;;
esac
