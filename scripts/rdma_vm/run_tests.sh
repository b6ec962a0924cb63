#!/usr/bin/env bash
# The project's real-RDMA test run (what .ci/run calls): builds on the host what the guest
# needs (the dicomm extension with the rdma transport, the transport check program), then boots
# the soft-RoCE guest and runs, inside it, rdma-core's own ping-pong and the `rdma`-marked
# tests. Exit code: the guest's. Needs root (for qemu's 9p export of /); installs the packages
# it needs first (scripts/rdma_vm/host_packages.sh).
#   scripts/rdma_vm/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
start=$(date +%s)
bash scripts/rdma_vm/host_packages.sh
if [ -d build/cmake ]; then
  timeout 1200 cmake --build build/cmake --target dicomm_backend >/dev/null
else
  timeout 1800 bash scripts/setup_env.sh
fi
timeout 1200 tests/comm_rdma/build_transport_check.sh >/dev/null
echo "rdma_vm: host build done in $(( $(date +%s) - start )) s"
# One guest for everything: boot costs ~15 s, and the guest's page cache keeps torch warm.
rc=0
timeout 3000 scripts/rdma_vm/run.sh --timeout 2700 --env GLOO_SOCKET_IFNAME=lo -- \
  sh -c "sh scripts/rdma_vm/selftest.sh && $PY -m pytest -q -s -m rdma tests/comm_rdma -p no:cacheprovider --durations=0 $*" || rc=$?
echo "rdma_vm: finished in $(( $(date +%s) - start )) s with exit code $rc"
exit $rc
