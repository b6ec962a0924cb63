"""The device tests run against the process's vendor: `emu` in `make test`, and again with
DITORCH_VENDOR=cpu (tests/device/test_native_vendor.py), the native vendor's code path that a GPU
takes. Tests of what only one of them has say so with a mark and are skipped, with the reason,
on the other:

- ``@pytest.mark.two_devices``: needs dipu:0 and dipu:1 (the cpu vendor shows one device);
- ``@pytest.mark.synchronous_vendor``: kernels run on the calling thread (emu, cpu), so a chip's
  speed is emulated (a vendor with streams, cuda, runs at the device's own speed).
"""
import pytest
import torch

import ditorch
import ditorch_ext


def pytest_configure(config):
    config.addinivalue_line("markers", "two_devices: needs two dipu devices")
    config.addinivalue_line("markers", "synchronous_vendor: needs a vendor whose kernels run on the calling thread")


def pytest_runtest_setup(item):
    if item.get_closest_marker("two_devices") and torch.dipu.device_count() < 2:
        pytest.skip(f"needs two dipu devices; the '{ditorch.vendor_name()}' vendor shows {torch.dipu.device_count()}")
    if item.get_closest_marker("synchronous_vendor") and torch.dipu.is_asynchronous():
        pytest.skip(f"the '{ditorch.vendor_name()}' vendor runs kernels on streams at the device's own speed")


@pytest.fixture(autouse=True)
def host_chip():
    """Every test starts and ends on the un-emulated host chip with nothing forced to fall back."""
    ditorch.set_chip("host", memory_scale=1.0)
    ditorch_ext.reset_cpu_fallback_counts()
    yield
    ditorch.set_chip("host", memory_scale=1.0)
    ditorch_ext.set_unsupported_ops([])
    torch.dipu.set_device(0)
