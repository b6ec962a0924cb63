#!/usr/bin/env bash
# Builds the stream-frame fuzzer (clang's libFuzzer) into build/fuzz and runs it for
# FUZZ_SECONDS (default 60) from the seed corpus (seeds.py). FUZZ_SANITIZER picks the checks:
# `address` (default: AddressSanitizer, LeakSanitizer, UndefinedBehaviorSanitizer) or `thread`
# (ThreadSanitizer: data races between the pair's receive, send and closing threads). Prints
# libFuzzer's final counts: inputs tried (number_of_executed_units) and distinct coverage
# reached (cov: edges, ft: features). Exit code: libFuzzer's (non-zero on a crash, a leak, a
# hang or a sanitizer report).
set -euo pipefail
cd "$(dirname "$0")/../../.."
CXX=${FUZZ_CXX:-$(command -v clang++-14 || command -v clang++ || true)}
[ -n "$CXX" ] || { echo "fuzz: clang++ not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 2; }
sanitizer=${FUZZ_SANITIZER:-address}
case "$sanitizer" in
  address) flags=(-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all) ;;
  thread) flags=(-fsanitize=fuzzer,thread) ;;
  *) echo "fuzz: FUZZ_SANITIZER='$sanitizer': expected address or thread" >&2; exit 2 ;;
esac
out=build/fuzz
mkdir -p "$out/corpus"
PY=${PYTHON:-.venv/bin/python}
T=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")
abi=$("$PY" -c "import torch; print(int(torch.compiled_with_cxx11_abi()))")
srcs=(tests/comm/fuzz/stream_frames_fuzzer.cpp
      csrc/comm/core/Mailbox.cpp csrc/comm/transport/StreamPair.cpp csrc/comm/transport/StreamConfig.cpp
      csrc/comm/transport/CrossMemory.cpp csrc/comm/transport/FailureLatch.cpp csrc/comm/transport/RendezvousBook.cpp csrc/comm/transport/Socket.cpp
      csrc/comm/transport/Handshake.cpp csrc/comm/transport/Env.cpp csrc/comm/transport/Log.cpp
      csrc/comm/transport/SmallFrameRing.cpp csrc/comm/transport/Spin.cpp csrc/comm/transport/Trace.cpp csrc/comm/transport/ListenAddress.cpp csrc/comm/transport/Transport.cpp)
bin=$out/stream_frames_fuzzer-$sanitizer
if [ ! -x "$bin" ] || [ -n "$(find "${srcs[@]}" csrc/comm \( -name '*.h' -o -name '*.cpp' \) -newer "$bin" | head -1)" ]; then
  echo "fuzz: building $bin" >&2
  "$CXX" -std=c++17 -O1 -g "${flags[@]}" -fno-omit-frame-pointer -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -I csrc -isystem "$T/include" -isystem "$T/include/torch/csrc/api/include" "${srcs[@]}" -o "$bin" \
    -L"$T/lib" -Wl,-rpath,"$T/lib" -lc10 -ltorch_cpu -lcrypto -lpthread
fi
"$PY" tests/comm/fuzz/seeds.py "$out/corpus"
# Leaks are checked (detect_leaks); a hang is an input slower than -timeout. Under TSan,
# report_signal_unsafe=0: libFuzzer's crash handler allocates to save the failing input, and
# TSan's report of that, from inside the signal, deadlocked the process (the input was lost and
# the run never ended); `timeout` bounds the run whatever else hangs.
rc=0
log=$out/last-run-$sanitizer.log
seconds=${FUZZ_SECONDS:-60}
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0:suppressions=$PWD/tests/comm/fuzz/tsan.supp" \
  timeout -k 10 $((seconds + 120)) \
  "$bin" -max_total_time="$seconds" -max_len=4096 -timeout=30 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus" >"$log" 2>&1 || rc=$?
echo "fuzz ($sanitizer):"
grep -E "^(stat::|#[0-9]+[[:space:]]+(INITED|DONE)|==[0-9]+==|SUMMARY|WARNING: ThreadSanitizer|fuzz:|[a-zA-Z/._]+:[0-9]+:[0-9]+: runtime error)" "$log" || true
[ "$rc" = 0 ] || echo "fuzz: FAILED (exit $rc); the log is $log, the input that failed is $out/crash-*, leak-*, timeout-* or oom-*" >&2
exit "$rc"
