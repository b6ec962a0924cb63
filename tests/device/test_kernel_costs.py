"""The machine's kernel cost table (``DITORCH_KERNEL_COSTS``, csrc/device/KernelCosts.h): a
kernel's cost is the least host time of its first 32 runs on the machine, then fixed; every
process sharing the file charges it, the table is merged back at exit, and a malformed file is
reported and replaced, never trusted.

The file format is read and written here by the test itself (header ``DTKCOST2``, a uint64
count, then (uint64 signature, int64 ns, uint64 samples) entries), as an independent reference
of the format."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

# host time is charged only where kernels run on the calling thread (tests/device/conftest.py)
pytestmark = pytest.mark.synchronous_vendor

MAGIC = b"DTKCOST2"
FIXED = 32  # samples after which a cost is fixed
REPO = Path(__file__).resolve().parents[2]

# 40 matmuls on a chip 20x slower than the host; prints their wall time.
MATMULS = """
import time, torch, ditorch
from ditorch_ext.profiles import ChipProfile
torch.set_num_threads(1)
ditorch.set_chip(ChipProfile("slow", memory_gb=8, relative_speed=0.1, chips_per_node=8, nics_per_node=8))
a = torch.randn(320, 320, device="dipu")
torch.dipu.synchronize()
start = time.perf_counter()
for _ in range(40):
    a @ a
torch.dipu.synchronize()
print(time.perf_counter() - start)
"""


def read_table(path: Path) -> dict[int, tuple[int, int]]:
    """signature -> (ns, samples)"""
    data = path.read_bytes()
    assert data[:8] == MAGIC
    (count,) = struct.unpack_from("<Q", data, 8)
    assert len(data) == 16 + 24 * count
    return {sig: (ns, n) for sig, ns, n in struct.iter_unpack("<QqQ", data[16:])}


def write_table(path: Path, table: dict[int, tuple[int, int]]) -> None:
    path.write_bytes(MAGIC + struct.pack("<Q", len(table))
                     + b"".join(struct.pack("<QqQ", s, ns, n) for s, (ns, n) in table.items()))


def run(table: Path | None) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DITORCH_KERNEL_COSTS", None)
    if table is not None:
        env["DITORCH_KERNEL_COSTS"] = str(table)
    proc = subprocess.run([sys.executable, "-c", MATMULS], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split()[-1]), proc.stderr


def test_a_fixed_cost_is_charged_by_every_process_that_shares_the_table(tmp_path):
    table = tmp_path / "costs"
    first_s, _ = run(table)
    learned = read_table(table)
    assert learned and all(ns > 0 and 1 <= n <= FIXED for ns, n in learned.values())
    assert max(n for _, n in learned.values()) == FIXED  # 40 matmuls fix the matmul's cost
    alone_s, _ = run(None)
    assert 0.6 * alone_s < first_s < 1.6 * alone_s, (first_s, alone_s)  # its own costs, charged
    # Fixed at 1 ns: the 40 matmuls take their host time only, not twenty times it.
    write_table(table, {sig: (1, FIXED) for sig in learned})
    cheap_s, _ = run(table)
    assert cheap_s < 0.35 * alone_s, (cheap_s, alone_s)
    assert all(read_table(table)[sig] == (1, FIXED) for sig in learned), "a fixed cost changed"
    # Fixed at 4x what was learned: charged as such, though every run is faster. The reference
    # is the same costs fixed at 1x, run just before, so load on the machine cancels out.
    write_table(table, {sig: (ns, FIXED) for sig, (ns, n) in learned.items()})
    same_s, _ = run(table)
    write_table(table, {sig: (4 * ns, FIXED) for sig, (ns, n) in learned.items()})
    dear_s, _ = run(table)
    assert 3.0 * same_s < dear_s < 5.0 * same_s, (dear_s, same_s)
    # Not fixed yet (one sample at 4x): this process's own runs lower it, and add their samples.
    write_table(table, {sig: (4 * ns, 1) for sig, (ns, n) in learned.items()})
    pooled_s, _ = run(table)
    assert pooled_s < 1.6 * alone_s, (pooled_s, alone_s)
    pooled = read_table(table)
    assert all(pooled[sig][1] > 1 and pooled[sig][0] < 4 * ns for sig, (ns, n) in learned.items() if n == FIXED)


@pytest.mark.parametrize("damage,says", [
    (lambda data: data[:20], "does not match its"),  # a torn write
    (lambda data: b"NOTCOSTS" + data[8:], "not a kernel cost table"),
    (lambda data: data[:8] + struct.pack("<Q", 1 << 40) + data[16:], "is beyond"),
    (lambda data: data[:24] + struct.pack("<q", -5) + data[32:], "expected > 0"),
    (lambda data: data[:32] + struct.pack("<Q", 0) + data[40:], "samples (expected 1 to 32)"),
])
def test_a_malformed_table_is_reported_and_replaced(tmp_path, damage, says):
    table = tmp_path / "costs"
    run(table)
    table.write_bytes(damage(table.read_bytes()))
    _, stderr = run(table)
    assert "DITORCH_KERNEL_COSTS" in stderr and says in stderr, stderr
    assert read_table(table), "the table was not rewritten at exit"


def test_a_table_that_cannot_be_written_is_reported(tmp_path):
    _, stderr = run(tmp_path / "missing-folder" / "costs")
    assert "kernel cost table was not saved" in stderr and "missing-folder" in stderr, stderr
