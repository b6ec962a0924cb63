"""The native vendor (`DITORCH_VENDOR=<device type>`, vendor/NativeVendor.cpp) over the cpu: the
code path a GPU takes (PyTorch's allocator, guard and generators of the kernel device; results
adopted from the kernel device's allocator; device memory the host may not address), run on
every machine. The vendor is read once, at import, so each check runs in a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The device tests that hold for every vendor; emu-only ones skip themselves (conftest.py).
# (test_llama.py's training is covered on this vendor by tests/runtime/test_vendors.py.)
VENDOR_GENERIC = ["tests/device/test_device.py", "tests/device/test_device_refusals.py",
                  "tests/device/test_unboxed_shim.py", "tests/device/test_chip_numerics.py"]

NATIVE_FACTS = """
import json, torch, ditorch
out = {"vendor": ditorch.vendor_name(), "addressable": torch.dipu.is_host_addressable(),
       "asynchronous": torch.dipu.is_asynchronous(), "count": torch.dipu.device_count()}
a = torch.ones(1000, device="dipu")
before = torch.dipu.memory_stats()
c = a + a
after = torch.dipu.memory_stats()
out["allocations_per_add"] = after["allocation.all.allocated"] - before["allocation.all.allocated"]
out["bytes_per_add"] = after["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
del c
out["freed"] = torch.dipu.memory_allocated() == before["allocated_bytes.all.current"]
props = torch.dipu.get_device_properties()
out["name"], out["total"] = props.name, props.total_memory
free, total = torch.dipu.mem_get_info()
out["free_le_total"] = 0 < free <= total
ditorch.set_chip("C", memory_scale=1e-4)  # 3.3 MB: capped by the chip, not by the host's memory
out["capped_total"] = torch.dipu.get_device_properties().total_memory
small = torch.ones(1000, device="dipu")
try:
    small.view(1000, 1) @ small.view(1, 1000)  # a 4 MB result the kernel device's allocator made: refused
    out["oom"] = None
except torch.OutOfMemoryError as e:
    out["oom"] = str(e)
print(json.dumps(out))
"""


def _python(code: str, vendor: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "DITORCH_VENDOR": vendor})


def test_the_cpu_vendor_is_the_kernel_devices_memory_adopted_and_counted():
    run = _python(NATIVE_FACTS, "cpu")
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    facts = json.loads(run.stdout.splitlines()[-1])
    assert (facts["vendor"], facts["addressable"], facts["asynchronous"], facts["count"]) == ("cpu", False, False, 1)
    # One allocation per result (adopted from the cpu allocator, not copied into a second block).
    assert facts["allocations_per_add"] == 1 and facts["bytes_per_add"] == 4000 and facts["freed"]
    assert facts["name"] == "cpu as chip host"
    assert facts["total"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and facts["free_le_total"]
    assert facts["capped_total"] == int(32 * 2**30 * 1e-4)
    assert facts["oom"] and "kernel's result of 3.81 MiB on dipu:0 does not fit chip 'C'" in facts["oom"]


@pytest.mark.slow
def test_device_tests_pass_on_the_cpu_vendor():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:randomly", *VENDOR_GENERIC], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "DITORCH_VENDOR": "cpu"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    # Only what one cpu device cannot show is skipped.
    assert all("needs two dipu devices" in line for line in skipped), skipped


@pytest.mark.parametrize("vendor, message", [
    ("cuda", "DITORCH_VENDOR=cuda: this build of PyTorch has no cuda runtime"),
    ("privateuseone", "DITORCH_VENDOR=privateuseone is not a vendor; expected 'emu' or a device type"),
])
def test_a_vendor_that_cannot_run_here_is_named(vendor, message):
    import torch

    if vendor == "cuda" and torch.cuda.is_available():
        pytest.skip("cuda runs here, so DITORCH_VENDOR=cuda is a vendor, not a refusal")
    if vendor == "cuda" and torch.version.cuda is not None:
        # A CUDA build of torch on a machine without a GPU (make test-torch's wheels): the runtime
        # is there, the device is not.
        message = "DITORCH_VENDOR=cuda: no cuda device is visible"
    run = _python("import ditorch", vendor)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
