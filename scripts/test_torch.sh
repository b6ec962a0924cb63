#!/usr/bin/env bash
# `make test-torch TORCH=X.Y.Z`: ditorch against another release of torch, beside the main tree.
#
# scripts/torch_release.sh makes build/torch-X.Y.Z/venv (torch X.Y.Z from the package index) and
# build/torch-X.Y.Z/src (the tree built against it); then a named subset that reaches every layer
# (SUBSET below) writes build/torch-X.Y.Z/test.log and summary.txt (one line).
set -euo pipefail
TORCH=${TORCH:?usage: make test-torch TORCH=X.Y.Z}
WHO=test-torch
# shellcheck source=scripts/torch_release.sh
source "$(dirname "$0")/torch_release.sh"

# 3. The subset: every layer once. Device tests under both the emu and the cpu vendor; dicomm's
# list collectives against gloo and a two-rank DDP/FSDP2/pipeline step; one HeteroPP plan over
# two vendors and two chip types; one Di-PS round; one volunteer step.
DEVICE_TESTS="tests/device/test_device.py tests/device/test_unboxed_shim.py tests/device/test_memory_api.py tests/device/test_torch_compat.py tests/device/test_random.py tests/device/test_flex_attention.py"
SUBSET=(
  "emu|$DEVICE_TESTS tests/device/test_native_vendor.py"
  "cpu|$DEVICE_TESTS"
  "emu|tests/comm/test_contracts.py tests/comm/test_training.py::test_ddp_fsdp2_pipeline_match_single_process"
  "emu|tests/runtime/test_vendors.py"
  "emu|tests/dips/test_seed.py::test_first_cluster_seeds_the_ps_and_others_join_from_it"
  "emu|tests/volunteer/test_volunteer_training.py::test_one_client_per_stage_equals_single_process_training"
)
: >"$WORK/test.log"
status=0
for entry in "${SUBSET[@]}"; do
  vendor=${entry%%|*}
  tests=${entry#*|}
  echo "== DITORCH_VENDOR=$vendor $tests" >>"$WORK/test.log"
  # shellcheck disable=SC2086
  (cd "$SRC" && DITORCH_VENDOR=$vendor GLOO_SOCKET_IFNAME=lo nice -n 19 "$VENV/bin/python" -m pytest -q -p no:xdist \
     -p no:cacheprovider -rs --timeout 600 $tests) >>"$WORK/test.log" 2>&1 || status=1
done
t3=$(now)

# pytest's closing lines ("3 passed, 1 skipped in 9.1s" under -q, framed by "=" without it) summed over the runs.
counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped).* in [0-9.]+s' "$WORK/test.log" | "$VENV/bin/python" -c '
import re, sys
total = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
for line in sys.stdin:
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
        total[what.rstrip("s") if what.startswith("error") else what] += int(n)
print(" ".join(f"{v} {k}" for k, v in total.items()))')
summary="torch $torch_build: download+install $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s: $counts"
echo "$summary" | tee "$WORK/summary.txt"
exit $status
