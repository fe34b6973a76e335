#!/usr/bin/env bash
# `kvik train` on two "nodes": two torchrun agents (one process each) that find each other through
# torchrun's c10d rendezvous at 127.0.0.1:29400, as two machines would at a head node's address.
# tests/train/test_multinode.py runs this in private network, PID and mount namespaces, so the
# rendezvous store and gloo listen on that namespace's loopback only, and nothing outlives it.
#
#   torchrun_two_nodes.sh LOG_DIR PYTHON TRAIN_ARGS...      (logs: LOG_DIR/node-{0,1}.log)
set -uo pipefail
log_dir=$1 python=$2
shift 2
ip link set lo up
export GLOO_SOCKET_IFNAME=lo  # on real nodes: the interface the nodes reach each other on

node() {  # node IS_HOST: one agent; the one with is_host=1 serves the rendezvous store
  "$python" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
    --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --rdzv-id kvik-two-nodes \
    --rdzv-conf "is_host=$1" --local-addr 127.0.0.1 \
    -m kvik.cli.main train "${@:2}"
}

node 1 "$@" > "$log_dir/node-0.log" 2>&1 &
first=$!
node 0 "$@" > "$log_dir/node-1.log" 2>&1 &
second=$!
status=0
wait "$first" || status=$?
wait "$second" || status=$?
exit "$status"
