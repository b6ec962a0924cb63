#!/usr/bin/env bash
# `make test-asan`: dicomm and the device layer under AddressSanitizer and UndefinedBehaviorSanitizer.
#  1. builds the backend and the device layer with DITORCH_SANITIZE=address,undefined into
#     build/asan (scripts/build_asan.sh; the regular build is untouched);
#  2. runs tests/comm against the backend (DICOMM_EXTENSION) and tests/device against the
#     device layer (the sanitized ditorch_ext._C put in front of the source package by an
#     overlay on PYTHONPATH; the OpInfo sweep's fixture included), the sanitizer runtimes
#     preloaded; any sanitizer report, in any process, fails the run;
#  3. builds and runs the stream-frame fuzzer (tests/comm/fuzz, clang's libFuzzer) for
#     FUZZ_SECONDS (default 60) under ASan + UBSan, leaks checked, then for TSAN_FUZZ_SECONDS
#     (default 30) under ThreadSanitizer (races between a pair's threads and its closing), both
#     beside the device suite of step 2.
# Installs clang-14 when run as root and missing. Extra arguments go to tests/comm's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"

if ! command -v clang++-14 >/dev/null && ! command -v clang++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test-asan: installing clang-14 (libFuzzer)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-14 libclang-rt-14-dev >/dev/null) \
    || echo "test-asan: clang-14 not installed; the fuzzer cannot be built" >&2
fi

build=build/asan
bash scripts/build_asan.sh
ext=$(ls "$build"/dicomm/_C.*.so)
device_ext=$(ls "$build"/ditorch_ext/_C.*.so)
overlay="$PWD/$build/overlay"
rm -rf "$overlay" && mkdir -p "$overlay/ditorch_ext"
ln -s "$PWD"/ditorch_ext/*.py "$overlay/ditorch_ext/" && ln -s "$PWD/$device_ext" "$overlay/ditorch_ext/"

reports="$PWD/$build/reports"
rm -rf "$reports" && mkdir -p "$reports"
# Leak checking stays off in Python processes (the interpreter keeps its objects at exit); the
# fuzzer checks leaks of the transport itself. $1: what ran; the rest: the command.
sanitized() {
  local what=$1 rc=0
  shift
  LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$reports/asan${ASAN_EXTRA:+:$ASAN_EXTRA}" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan" \
  DICOMM_EXTENSION="$PWD/$ext" GLOO_SOCKET_IFNAME=lo "$@" || rc=$?
  local found
  found=$(ls "$reports" | wc -l)
  echo "test-asan: $what exit $rc, sanitizer reports: $found"
  for f in "$reports"/*; do [ -f "$f" ] && { echo "--- $f"; head -60 "$f"; }; done
  [ "$rc" = 0 ] && [ "$found" = 0 ]
}
# handle_segv=0: the protected-memory tests expect a SIGSEGV of their own (a host read of a
# protected dipu block), which ASan would otherwise report as a crash.
# PYTHONSAFEPATH: no current directory ahead of the overlay; the source tree follows it (a
# regular package there wins over the namespace directories of the same name under tests/).
loaded=$(ASAN_EXTRA=handle_segv=0 PYTHONSAFEPATH=1 PYTHONPATH="$overlay:$PWD" sanitized "the device layer's import" \
  "$PY" -c "import ditorch_ext._C as c; print(c.__file__)")
[ "${loaded%%$'\n'*}" = "$overlay/ditorch_ext/$(basename "$device_ext")" ] \
  || { echo "test-asan: the overlay did not put the sanitized device layer first: $loaded"; exit 1; }
# tests/comm waits on its rank processes much of the time: two xdist workers (TEST_WORKERS, as
# in `make test`) take 4m46s where one takes 5m53s. tests/device computes (the OpInfo sweep's
# fixture is most of it): one worker; run beside tests/comm in one session, both took longer.
sanitized tests/comm "$PY" -m pytest -q -n "${TEST_WORKERS:-2}" tests/comm -p no:cacheprovider "$@" || exit 1
# The fuzzers (their clang builds, then one core each, one after the other: they share a corpus)
# run beside the single-process device suite, on the core it leaves.
fuzz_log="$PWD/$build/fuzz.log"
(FUZZ_SANITIZER=address bash tests/comm/fuzz/run.sh \
  && FUZZ_SANITIZER=thread FUZZ_SECONDS="${TSAN_FUZZ_SECONDS:-30}" bash tests/comm/fuzz/run.sh) >"$fuzz_log" 2>&1 &
fuzz=$!
trap 'kill "$fuzz" 2>/dev/null || true' EXIT
device_rc=0
ASAN_EXTRA=handle_segv=0 PYTHONSAFEPATH=1 PYTHONPATH="$overlay:$PWD" sanitized tests/device \
  "$PY" -m pytest -q tests/device -p no:cacheprovider \
  --deselect tests/device/test_opinfo.py::test_most_of_op_db_runs_on_cpu || device_rc=1
fuzz_rc=0
wait "$fuzz" || fuzz_rc=$?
trap - EXIT
cat "$fuzz_log"
[ "$device_rc" = 0 ] && [ "$fuzz_rc" = 0 ]
