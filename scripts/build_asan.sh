#!/usr/bin/env bash
# Builds dicomm's backend and the device layer with DITORCH_SANITIZE=address,undefined into
# build/asan (the regular build is untouched): step 1 of `make test-asan`; a no-op once built.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
build=build/asan
if [ ! -f "$build/build.ninja" ]; then
  T=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDITORCH_SANITIZE=address,undefined \
    -DPython3_EXECUTABLE="$PWD/$PY" -DTORCH_ROOT="$T" >/dev/null
fi
echo "build-asan: building the sanitized backend and device layer" >&2
cmake --build "$build" -j 2 --target dicomm_backend ditorch_device | { grep -vE "^\[[0-9]+/[0-9]+\]" || true; }
