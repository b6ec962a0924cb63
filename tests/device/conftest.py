import pytest
import torch

import ditorch
import ditorch_ext


@pytest.fixture(autouse=True)
def host_chip():
    """Every test starts and ends on the un-emulated host chip with nothing forced to fall back."""
    ditorch.set_chip("host", memory_scale=1.0)
    ditorch_ext.reset_cpu_fallback_counts()
    yield
    ditorch.set_chip("host", memory_scale=1.0)
    ditorch_ext.set_unsupported_ops([])
    torch.dipu.set_device(0)
