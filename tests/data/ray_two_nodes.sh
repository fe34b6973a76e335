#!/usr/bin/env bash
# A two-node Ray cluster (a head and one worker node, 1 CPU each) on 127.0.0.1, then a command
# against it. tests/data/test_ray_executor.py runs this inside private network, PID and mount
# namespaces (`unshare --net --pid --mount-proc --fork --kill-child`): Ray binds every interface
# and advertises a non-loopback address when it finds one, and in a namespace that has only its
# own loopback neither leaves the test; when this script (the namespace's PID 1) exits, the kernel
# ends every process Ray started, so nothing outlives the test and no `ray stop` touches anyone
# else's cluster.
#
#   ray_two_nodes.sh TEMP_DIR RAY_BIN COMMAND...     (COMMAND gets RAY_ADDRESS=127.0.0.1:6379)
set -euo pipefail
temp_dir=$1 ray=$2
shift 2
ip link set lo up
export RAY_USAGE_STATS_ENABLED=0
common=(--block --num-cpus=1 --object-store-memory=100000000 --disable-usage-stats)

wait_for() {  # wait_for SECONDS LOG: until LOG says the node is up
  for _ in $(seq "$1"); do
    grep -q "Ray runtime started" "$2" 2>/dev/null && return 0
    sleep 1
  done
  echo "Ray node did not start in $1 s; its log:" >&2
  cat "$2" >&2
  return 1
}

"$ray" start --head --port=6379 --include-dashboard=false --temp-dir="$temp_dir/head" "${common[@]}" \
  > "$temp_dir/head.log" 2>&1 &
wait_for 150 "$temp_dir/head.log"
"$ray" start --address=127.0.0.1:6379 --temp-dir="$temp_dir/worker" "${common[@]}" \
  > "$temp_dir/worker.log" 2>&1 &
wait_for 150 "$temp_dir/worker.log"
RAY_ADDRESS=127.0.0.1:6379 "$@"
