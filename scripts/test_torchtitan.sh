#!/usr/bin/env bash
# `make test-torchtitan`: torchtitan 0.3.0 trains its llama3 debug model on dipu over dicomm
# (tests/ecosystem). torchtitan 0.3.0 is built for torch 2.14 (on 2.13 it stops at
# torch.distributed.set_timeout, fully_shard and pipelining: docs/ecosystem.md), so it runs in
# `make test-torch`'s venv for TORCH (default 2.14.1) and its build of the tree (scripts/torch_release.sh), with
# torchtitan and what it imports in build/torch-X.Y.Z/titan-site (--no-deps, so pip never resolves
# or replaces torch; scripts/torchtitan_requirements.txt). Writes build/torch-X.Y.Z/titan.log.
set -euo pipefail
TORCH=${TORCH:-2.14.1}
WHO=test-torchtitan
# shellcheck source=scripts/torch_release.sh
source "$(dirname "$0")/torch_release.sh"

SITE=$WORK/titan-site
stamp="$SITE/.requirements-$(sha1sum scripts/torchtitan_requirements.txt | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  rm -rf "$SITE"
  PIP_CONFIG_FILE=/dev/null nice -n 19 "$VENV/bin/python" -m pip -q --disable-pip-version-check install \
    --no-deps --target "$SITE" -r scripts/torchtitan_requirements.txt >>"$WORK/download.log" 2>&1
  touch "$stamp"
fi

# Test ranks are torchrun workers of their own (OMP_NUM_THREADS=1 each): one pytest process. Its
# runs stay in build/torch-X.Y.Z/titan-runs (logs, checkpoints, TensorBoard losses), and the
# cases' numbers (summary.txt) end the log.
RUNS=$WORK/titan-runs
(cd "$SRC" && PYTHONPATH=$SITE GLOO_SOCKET_IFNAME=lo nice -n 10 "$VENV/bin/python" -m pytest -q -p no:xdist \
   -p no:cacheprovider -rs --basetemp "$RUNS" tests/ecosystem ${TEST_ARGS:-}) 2>&1 | tee "$WORK/titan.log"
status=${PIPESTATUS[0]}
[ ! -f "$RUNS/torchtitan0/summary.txt" ] || tee -a "$WORK/titan.log" <"$RUNS/torchtitan0/summary.txt"
exit "$status"
