import pytest
import torch

import ditorch


@pytest.fixture(autouse=True)
def host_chip():
    """Every test starts and ends on the un-emulated host chip with nothing forced to fall back."""
    ditorch.set_chip("host", memory_scale=1.0)
    yield
    ditorch.set_chip("host", memory_scale=1.0)
    import ditorch_ext

    ditorch_ext.set_unsupported_ops([])
    torch.dipu.set_device(0)
