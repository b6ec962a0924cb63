"""PyTorch's generic memory API on dipu (``torch.accelerator.*``, the dipu allocator being a
``c10::DeviceAllocator``) and ``torch.dipu``'s CUDA-shaped one, checked against what the test
allocates: counters move by the tensors' sizes rounded as docs/device.md says (our blocks: up to
1 MiB in 512-byte units, larger in 128 KiB units; a native vendor's kernel result: its nbytes),
and the statistics' names are those torch.cuda's own source uses. Runs under every vendor."""
from __future__ import annotations

import inspect
import itertools
import re

import pytest
import torch

import ditorch


def _rounded(nbytes: int) -> int:
    unit = 512 if nbytes <= 1 << 20 else 128 << 10
    return -(-nbytes // unit) * unit


def _native_results() -> bool:
    """Whether a kernel's result is the native vendor's own block (adopted at its nbytes) rather
    than one of ours (emu redirects kernel allocations into dipu blocks)."""
    return ditorch.vendor_name() != "emu"


def test_the_accelerator_is_dipu_and_its_allocator_answers():
    assert torch.accelerator.current_accelerator().type == "dipu"
    assert torch.accelerator.memory_allocated() == torch.dipu.memory_allocated()


@pytest.mark.parametrize("numel", [1000, 3 * (1 << 18) + 7])  # 4,000 B (small pool), 3 MiB + 28 B (large)
def test_allocations_move_the_counters_by_their_rounded_size(numel):
    torch.dipu.synchronize()
    before = torch.accelerator.memory_allocated()
    stats_before = torch.dipu.memory_stats()
    x = torch.empty(numel, dtype=torch.float32, device="dipu")
    expected = _rounded(x.nbytes)
    assert torch.accelerator.memory_allocated() - before == expected
    assert torch.dipu.memory_allocated() - before == expected
    pool = "small_pool" if x.nbytes <= 1 << 20 else "large_pool"
    stats = torch.dipu.memory_stats()
    assert stats[f"allocated_bytes.{pool}.current"] - stats_before[f"allocated_bytes.{pool}.current"] == expected
    assert stats[f"requested_bytes.{pool}.current"] - stats_before[f"requested_bytes.{pool}.current"] == x.nbytes
    assert stats["allocation.all.allocated"] - stats_before["allocation.all.allocated"] == 1
    del x
    assert torch.accelerator.memory_allocated() == before
    assert torch.dipu.memory_stats()["allocation.all.freed"] - stats_before["allocation.all.freed"] == 1


def test_a_kernel_result_is_counted_as_the_vendor_allocates_it():
    x = torch.ones(1000, device="dipu")
    before = torch.accelerator.memory_allocated()
    y = x + 1
    grown = torch.accelerator.memory_allocated() - before
    assert grown == (y.nbytes if _native_results() else _rounded(y.nbytes))
    del y
    assert torch.accelerator.memory_allocated() == before


def test_peak_and_its_reset_through_torch_accelerator():
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated()
    assert torch.accelerator.max_memory_allocated() == base
    big = torch.empty(4 << 20, dtype=torch.uint8, device="dipu")
    del big
    assert torch.accelerator.max_memory_allocated() == base + _rounded(4 << 20)
    assert torch.dipu.max_memory_allocated() == base + _rounded(4 << 20)
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated() == base


def test_reset_accumulated_stats_restarts_the_totals():
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.dipu.memory_stats()["allocation.all.allocated"] == 0
    x = torch.empty(10, device="dipu")
    assert torch.accelerator.memory_stats()["allocation.all.allocated"] == 1
    del x
    assert torch.dipu.memory_stats()["allocation.all.freed"] == 1


def test_empty_cache_returns_what_the_cache_holds():
    x = torch.empty(1 << 20, dtype=torch.uint8, device="dipu")
    del x
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_reserved() == torch.accelerator.memory_allocated()
    assert torch.dipu.memory_stats()["segment.all.current"] == torch.dipu.memory_stats()["allocation.all.current"]


def _cuda_stat_names() -> set[str]:
    """The flat names torch.cuda.memory_stats reports, read from torch's own source: the metrics its
    memory_summary reads, per pool and metric type, and the counters its docstring lists."""
    import torch.cuda.memory as cuda_memory

    summary = inspect.getsource(cuda_memory.memory_summary)
    # The pooled metrics (the first table; the oversize ones after it have no pools).
    pooled = summary[:summary.index("oversize_allocations")]
    metrics = re.findall(r'\("([a-z_]+)", "[^"]+", _format_(?:size|count)\)', pooled)
    assert "allocation" in metrics and "allocated_bytes" in metrics, metrics
    names = {f"{m}.{pool}.{kind}" for m, pool, kind in itertools.product(
        metrics, ("all", "large_pool", "small_pool"), ("current", "peak", "allocated", "freed"))}
    for pattern in re.findall(r'``"([a-z_]+(?:\.\{[a-z_,]+\})*)"``', cuda_memory.memory_stats.__doc__):
        head = pattern.split(".")[0]
        if head.startswith("num_") or head in ("max_split_size", "oversize_allocations", "oversize_segments"):
            parts = [p.strip("{}").split(",") for p in pattern.split(".")]
            names |= {".".join(c) for c in itertools.product(*parts)}
    return names


def test_memory_stats_use_the_names_torch_cuda_uses():
    cuda = _cuda_stat_names()
    dipu = set(torch.dipu.memory_stats())
    assert cuda <= dipu, f"names torch.cuda reports that dipu does not: {sorted(cuda - dipu)}"
    # torch.accelerator reads the same DeviceStats: every name it reports is dipu's, with its value.
    generic = torch.accelerator.memory_stats()
    assert set(generic) <= dipu
    here = torch.dipu.memory_stats()
    assert all(generic[k] == here[k] for k in generic)


def test_memory_summary_reports_the_statistics():
    x = torch.empty(3000, dtype=torch.uint8, device="dipu")
    stats = torch.dipu.memory_stats()
    text = torch.dipu.memory_summary()
    allocations = next(line for line in text.splitlines() if line.startswith(" Allocations"))
    current, peak, total, freed = (int(v) for v in allocations.split("|")[1:])
    assert (current, peak, total, freed) == (stats["allocation.all.current"], stats["allocation.all.peak"],
                                            stats["allocation.all.allocated"], stats["allocation.all.freed"])
    assert "from small pool" in text and "from small pool" not in torch.dipu.memory_summary(abbreviated=True)
    del x


def test_memory_info_is_the_chips_capacity_less_what_is_reserved():
    ditorch.set_chip("B", memory_scale=0.001)
    x = torch.empty(1 << 20, dtype=torch.uint8, device="dipu")
    free, total = torch.accelerator.get_memory_info()
    assert (free, total) == torch.dipu.mem_get_info()
    assert total == torch.dipu.get_device_properties().total_memory
    assert free <= total - torch.accelerator.memory_reserved()
    del x
