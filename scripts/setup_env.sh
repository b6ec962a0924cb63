#!/usr/bin/env bash
# One-time (and safe-to-rerun) set-up: a venv with the pinned torch, the build and test
# dependencies, and ditorch itself built in place. Both README commands call this first.
#
# The phases overlap where they can: Debian's packages install while pip installs torch and the
# build tools; then the C++ build (which needs torch, cmake, ninja and the Debian headers, and
# nothing else) runs while pip installs the remaining Python packages (mostly downloads). Each
# phase's wall time is printed, so a slow set-up says where its time went.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DITORCH_VENV:-.venv}
PY=${PYTHON:-python3}
START=$SECONDS
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

took() { local s=$(( SECONDS - $1 )); printf '%dm%02ds' $(( s / 60 )) $(( s % 60 )); }
say() { echo "setup: $*" >&2; }
# This machine's pip config names local mirrors that may be absent; their warnings are noise.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }
# run_logged NAME CMD...: runs CMD with its output in $LOGS/NAME, shown only if it fails.
run_logged() {
  local name=$1; shift
  if ! "$@" >"$LOGS/$name" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$LOGS/$name" >&2 || true
    say "$name failed"
    return 1
  fi
}

# Debian packages, only when one is missing: verbs headers let the RDMA transport compile (it is
# skipped without them); libcrypto (libssl-dev) signs dicomm's connection handshake.
debian() {
  local t=$SECONDS
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev librdmacm-dev libssl-dev) >"$LOGS/debian" 2>&1; then
    say "debian packages $(took "$t")"
  else
    say "libibverbs-dev or libssl-dev not installed; the rdma transport (and without libssl-dev, dicomm) will not be built"
  fi
}
debian_pid=
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libibverbs-dev librdmacm-dev libssl-dev >/dev/null 2>&1; then
  debian & debian_pid=$!
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
# torch is pinned: 2.13.0 is the CPU wheel on local disk; any other version downloads gigabytes.
# The build needs only the lines of requirements.txt that name torch and the build tools.
BUILD_REQS=$(grep -E '^(torch|cmake|ninja)\b' requirements.txt)
stamp="$VENV/.ditorch-deps-$(sha1sum requirements.txt | cut -c1-12)"
python_packages_pid=
if [ ! -f "$stamp" ]; then
  t=$SECONDS
  # One pip run (each resolves and starts afresh): the C++ build waits on it.
  # shellcheck disable=SC2086  # one requirement per word
  quiet $PIP install --upgrade pip setuptools wheel $BUILD_REQS
  say "torch and build tools $(took "$t")"
  python_packages() {
    local t=$SECONDS
    run_logged python-packages $PIP install -r requirements.txt && touch "$stamp" && say "python packages $(took "$t")"
  }
  python_packages & python_packages_pid=$!
fi
[ -z "$debian_pid" ] || wait "$debian_pid"

# The C++ build, beside the Python packages' install: setup.py's build_ext drives CMake + ninja
# into build/cmake. The editable install below finds it up to date.
t=$SECONDS
run_logged build "$VENV/bin/python" setup.py -q build_ext --inplace
say "C++ build $(took "$t")"
[ -z "$python_packages_pid" ] || wait "$python_packages_pid"
# --no-build-isolation: an isolated build env would resolve (and download) another torch.
t=$SECONDS
quiet $PIP install --no-build-isolation --no-deps -e .
say "editable install $(took "$t")"
"$VENV/bin/python" -c "import ditorch"
say "ready in $(took "$START")"
# make demo's budget (--budget) includes the set-up that preceded it (examples/hetero_demo.py).
mkdir -p build
echo "{\"seconds\": $(( SECONDS - START ))}" > build/setup-seconds.json
