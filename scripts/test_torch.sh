#!/usr/bin/env bash
# `make test-torch TORCH=X.Y.Z`: ditorch against another release of torch, beside the main tree.
#
#   build/torch-X.Y.Z/venv   a venv with torch X.Y.Z from the package index (its default Linux wheel:
#                            the CUDA build, several GB) and the test dependencies;
#   build/torch-X.Y.Z/src    a copy of the working tree (tracked and untracked, not ignored files),
#                            built there, so the main tree's modules and build/cmake stay untouched;
#   build/torch-X.Y.Z/*.log  the download, build and test logs, and summary.txt (one line).
#
# Then a named subset that reaches every layer (SUBSET below). Safe to rerun: the venv is kept,
# the copy is refreshed and rebuilt incrementally. MAX_JOBS (default 1) and nice keep the build
# from crowding a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH=${TORCH:?usage: make test-torch TORCH=X.Y.Z}
[[ $TORCH =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "test-torch: TORCH=$TORCH is not a release number X.Y.Z" >&2; exit 2; }
WORK=$ROOT/build/torch-$TORCH
VENV=$WORK/venv
SRC=$WORK/src
PY=${PYTHON:-python3}
mkdir -p "$WORK"
now() { date +%s; }

# 1. The venv. PIP_CONFIG_FILE=/dev/null: a machine-wide pip constraint (some machines here cap
# torch at the releases they keep on disk) must not stop the release asked for.
t0=$(now)
if [ ! -f "$VENV/.torch-$TORCH" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # A current pip first: the venv's own (23.x here) falls back to a legacy editable install that
  # builds in isolation, without torch.
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip -q --disable-pip-version-check install --upgrade \
    pip setuptools wheel >"$WORK/download.log" 2>&1
  PIP_CONFIG_FILE=/dev/null nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check install \
    "torch==$TORCH" >>"$WORK/download.log" 2>&1
  # Everything else requirements.txt lists, except its torch pin and the Hugging Face extra.
  grep -v -E '^(torch|transformers)[=<> ]' requirements.txt >"$WORK/requirements.txt"
  PIP_CONFIG_FILE=/dev/null nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check install \
    "torch==$TORCH" -r "$WORK/requirements.txt" >>"$WORK/download.log" 2>&1
  touch "$VENV/.torch-$TORCH"
fi
t1=$(now)
torch_build=$("$VENV/bin/python" -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda)")

# 2. The copy of the tree and its build (build/cmake inside the copy).
mkdir -p "$SRC"
# (tar, not rsync: rsync is not on every machine; a tracked file deleted in the tree is skipped.)
git ls-files -co --exclude-standard -z | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$SRC"
(cd "$SRC" && MAX_JOBS=${MAX_JOBS:-1} nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check \
  install --no-build-isolation --no-deps -e . >"$WORK/build.log" 2>&1) || {
  echo "test-torch: the build against torch $TORCH failed; see $WORK/build.log" >&2; tail -30 "$WORK/build.log" >&2; exit 1; }
t2=$(now)

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
