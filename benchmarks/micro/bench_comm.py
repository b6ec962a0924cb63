"""DiComm against gloo on two local ranks (rank 1 is a helper process; rank 0 times): a
ping-pong round trip per size, and an allreduce, a reduce-scatter and an allgather per size. Each group holds gloo and dicomm
over tcp and over shm for one size, so the table's ratios are dicomm against gloo measured in
the same run. `extra_info` carries rank 0's CPU time per op beside the wall time, and the
bandwidth. The full sweep (more sizes, 4 ranks, two emulated hosts, a loaded machine) is
benchmarks/comm.py."""
from __future__ import annotations

import pytest

from rank_pair import GROUPS

pytestmark = pytest.mark.two_ranks
MiB = 1 << 20
SIZES = [8, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB]


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _estimate_s(nbytes: int) -> float:
    """A rough time per call (60 us + 1 GB/s) that sizes the rounds."""
    return 60e-6 + nbytes / 1e9


@pytest.mark.parametrize("nbytes", SIZES, ids=_label)
@pytest.mark.parametrize("group", GROUPS)
def test_round_trip(benchmark, ranks, group, nbytes):
    benchmark.group = f"p2p round trip {_label(nbytes)}"
    benchmark.extra_info["peer"] = group == "gloo"
    cpu_s = ranks.timed(benchmark, "round_trip", group, nbytes, 2 * _estimate_s(nbytes))
    benchmark.extra_info["cpu_us_per_round_trip"] = cpu_s * 1e6
    if not benchmark.disabled:
        benchmark.extra_info["bandwidth_GBs"] = 2 * nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("nbytes", [8, 1 * MiB, 64 * MiB], ids=_label)
@pytest.mark.parametrize("group", GROUPS)
def test_all_reduce(benchmark, ranks, group, nbytes):
    benchmark.group = f"allreduce float32, 2 ranks, {_label(nbytes)}"
    benchmark.extra_info["peer"] = group == "gloo"
    cpu_s = ranks.timed(benchmark, "all_reduce", group, nbytes, 2 * _estimate_s(nbytes))
    benchmark.extra_info["cpu_us_per_op"] = cpu_s * 1e6
    if not benchmark.disabled:
        # nccl-tests' bus bandwidth: algbw * 2 (n - 1) / n, which is algbw for 2 ranks
        benchmark.extra_info["busbw_GBs"] = max(4, nbytes) / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("nbytes", [1 * MiB, 64 * MiB], ids=_label)
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("group", GROUPS)
def test_reduce_scatter_and_all_gather(benchmark, ranks, group, op, nbytes):
    """`nbytes` is the larger side: a reduce-scatter's input, an allgather's output."""
    name = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}[op]
    benchmark.group = f"{name} float32, 2 ranks, {_label(nbytes)}"
    benchmark.extra_info["peer"] = group == "gloo"
    cpu_s = ranks.timed(benchmark, op, group, nbytes, _estimate_s(nbytes))
    benchmark.extra_info["cpu_us_per_op"] = cpu_s * 1e6
    if not benchmark.disabled:
        # nccl-tests' bus bandwidth: the larger side * (n - 1) / n per op
        benchmark.extra_info["busbw_GBs"] = nbytes / 2 / benchmark.stats.stats.median / 1e9
