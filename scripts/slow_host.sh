#!/usr/bin/env bash
# slow_host.sh CMD...: run CMD as the slowest host of this project's kind would run it: an
# emulation of the 2-core AMD EPYC of issue 72 (AVX2, no AVX-512, no bf16 units) on this host,
# not a measurement of one.
#
# - torch's AVX2 kernels only (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, and MKL's GEMMs by
#   MKL_ENABLE_INSTRUCTIONS=AVX2);
# - no bf16 units: dipu's bf16 matmuls as fp32 kernels rounded to bf16 (DITORCH_BF16_VIA_FP32=1),
#   as on a host without them;
# - a CPU quota (cgroup v1, /sys/fs/cgroup/cpu: cpu.cfs_quota_us over a short cpu.cfs_period_us)
#   for CMD and everything it starts, so that this host's CPU, all cores busy, does what the
#   EPYC's did: a `llama-small` layer cost the EPYC 101x chip A's datasheet time, 127x B's and
#   49x C's (issue 72); this host's ratios under the two settings above (measured first, as
#   `make demo`'s phase 0 measures them) over those give the share of the cores it may use
#   (their geometric mean, times the cores). A lone process may use up to one core of that
#   share, so with one process running this host is faster than the EPYC was; with a process
#   per core or more, as in the demo's multi-rank phases, it is as fast.
#
# SLOW_HOST_SHARE=F skips the measurement and uses F (0 < F <= 1) as the share of each core.
# Needs root (it makes a cgroup) and cgroup v1's cpu controller.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: scripts/slow_host.sh CMD..." >&2; exit 2; }
CGROUP_ROOT=/sys/fs/cgroup/cpu
if [ "$(id -u)" != 0 ]; then
  echo "slow_host.sh: needs root (it makes a cgroup under $CGROUP_ROOT to cap the CPU)" >&2; exit 1
fi
if [ ! -w "$CGROUP_ROOT/cpu.cfs_quota_us" ]; then
  echo "slow_host.sh: no cgroup v1 cpu controller at $CGROUP_ROOT (cpu.cfs_quota_us); cannot cap the CPU" >&2; exit 1
fi
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 DITORCH_BF16_VIA_FP32=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CORES=$(nproc)
PERIOD_US=10000  # short, so the cap acts within a kernel's time, not in 100 ms bursts

share=${SLOW_HOST_SHARE:-}
if [ -z "$share" ]; then
  share=$("$PY" -c "$(cat <<'PYEOF'
import math
from heteropp.model_spec import ModelSpec
from heteropp.runtime.profiler import host_ratio

EPYC = {"A": 101.0, "B": 127.0, "C": 49.0}  # issue 72: the EPYC's time for a layer over each chip's
if __name__ == "__main__":
    spec = ModelSpec.load("examples/configs/llama-small.yaml")
    here = {chip: host_ratio(chip, spec) for chip in EPYC}
    share = math.exp(sum(math.log(here[c] / EPYC[c]) for c in EPYC) / len(EPYC))
    import sys
    print("slow_host.sh: this host's layer against each chip's, AVX2 only and bf16 via fp32: "
          + ", ".join(f"{c} {here[c]:.1f}x (the EPYC {EPYC[c]:g}x)" for c in EPYC)
          + f"; share of each core {share:.3f}", file=sys.stderr)
    print(f"{min(share, 1.0):.4f}")
PYEOF
)")
fi
if ! awk -v s="$share" 'BEGIN { exit !(s > 0 && s <= 1) }'; then
  echo "slow_host.sh: share $share is invalid; expected a number in (0, 1]" >&2; exit 2
fi
quota=$(awk -v s="$share" -v c="$CORES" -v p="$PERIOD_US" 'BEGIN { printf "%d", s * c * p }')
group="$CGROUP_ROOT/ditorch-slow-host.$$"
mkdir "$group"
cleanup() {
  # the group's processes (none but stragglers) go back to the root group; then it can go
  while read -r pid; do echo "$pid" > "$CGROUP_ROOT/cgroup.procs" 2>/dev/null || true; done < "$group/cgroup.procs"
  rmdir "$group" 2>/dev/null || true
}
trap cleanup EXIT
echo "$PERIOD_US" > "$group/cpu.cfs_period_us"
echo "$quota" > "$group/cpu.cfs_quota_us"
echo "slow_host.sh: emulating the slowest host (not a measurement of it): AVX2 kernels, bf16 via fp32, ${quota} us of CPU per ${PERIOD_US} us over ${CORES} cores ($(awk -v s="$share" 'BEGIN { printf "%.0f", 100 * s }')% of each)" >&2
set +e
(echo "$BASHPID" > "$group/cgroup.procs" && exec "$@")
rc=$?
exit $rc
