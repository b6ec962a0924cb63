#!/bin/sh
# Runs inside the rdma guest (scripts/rdma_vm/run.sh -- sh scripts/rdma_vm/selftest.sh):
# proves the verbs stack end to end with rdma-core's own tools before any project code runs.
# The server starts first and the client after a short wait; both have time limits.
set -e
ibv_devinfo -d rxe0 | grep -E 'hca_id|state|link_layer'
ibv_devices
# -g 1: the IPv4-mapped GID (index 0 is the IPv6 link-local one).
timeout 60 ibv_rc_pingpong -d rxe0 -g 1 -n 200 -s 4096 > /tmp/pp_server.log 2>&1 &
server=$!
sleep 1
timeout 60 ibv_rc_pingpong -d rxe0 -g 1 -n 200 -s 4096 127.0.0.1
wait $server
cat /tmp/pp_server.log
echo "selftest: ibv_rc_pingpong over rxe0 passed"
