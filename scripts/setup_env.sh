#!/usr/bin/env bash
# One-time (and safe-to-rerun) set-up: a venv with the pinned torch, the build and test
# dependencies, and ditorch itself built in place. Both README commands call this first.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DITORCH_VENV:-.venv}
PY=${PYTHON:-python3}

# Debian packages: verbs headers let the RDMA transport compile (it is skipped without them);
# libcrypto (libssl-dev) signs dicomm's connection handshake.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libibverbs-dev libssl-dev >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev librdmacm-dev libssl-dev >/dev/null) \
    || echo "setup: libibverbs-dev or libssl-dev not installed; the rdma transport will not be built" >&2
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
# This machine's pip config names local mirrors that may be absent; their warnings are noise.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }
# torch is pinned: 2.13.0 is the CPU wheel on local disk; any other version downloads gigabytes.
stamp="$VENV/.ditorch-deps-$(sha1sum requirements.txt | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  quiet $PIP install --upgrade pip setuptools wheel
  quiet $PIP install -r requirements.txt
  touch "$stamp"
fi
# --no-build-isolation: an isolated build env would resolve (and download) another torch.
quiet $PIP install --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import ditorch" 
