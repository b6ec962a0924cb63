#!/usr/bin/env bash
# Builds build/comm_rdma/transport_check (the transport-level check, see transport_check.cpp)
# from the transport sources; skips work when the binary is newer than every source.
# Built with DICOMM_TEST_HOOKS (test-only behaviour, never in the extension: see
# RdmaTransport.cpp). Needs libibverbs-dev; prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=build/comm_rdma
bin=$out/transport_check
# Every transport source but shared memory (the check runs over tcp and rdma): globbed, so a new
# transport file needs no edit here.
srcs=(tests/comm_rdma/transport_check.cpp csrc/comm/transport/*.cpp csrc/comm/transport/tcp/*.cpp
      csrc/comm/transport/rdma/*.cpp)
[ -f /usr/include/infiniband/verbs.h ] || { echo "build_transport_check: libibverbs-dev is not installed" >&2; exit 2; }
mkdir -p "$out"
PY=${PYTHON:-.venv/bin/python}
T=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")
flags=(-std=c++17 -O2 -g0 -fPIC -DDICOMM_TEST_HOOKS -D_GLIBCXX_USE_CXX11_ABI=$("$PY" -c "import torch; print(int(torch.compiled_with_cxx11_abi()))")
       -I csrc -isystem "$T/include" -isystem "$T/include/torch/csrc/api/include")
objs=()
for s in "${srcs[@]}"; do
  o="$out/$(echo "$s" | tr / _).o"
  objs+=("$o")
  # headers change too: rebuild an object when any header of its folder is newer
  if [ ! -f "$o" ] || [ -n "$(find "$s" "$(dirname "$s")" csrc/comm/transport -maxdepth 1 -name '*.h' -newer "$o" -o -name "$(basename "$s")" -newer "$o" 2>/dev/null | head -1)" ]; then
    echo "g++ -c $s" >&2
    g++ "${flags[@]}" -c "$s" -o "$o" &
    # two compilers at a time: the machines have 2 cores
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
  fi
done
wait
g++ -o "$bin" "${objs[@]}" -L"$T/lib" -Wl,-rpath,"$T/lib" -ltorch_cpu -lc10 -libverbs -lcrypto -lpthread
echo "$bin"
