import glob
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dipu_available() -> bool:
    if not glob.glob(os.path.join(REPO, "ditorch_ext", "_C*.so")):
        return False
    try:
        import ditorch  # noqa: F401

        torch.empty(1, device="dipu")
        return True
    except Exception:
        return False


needs_dipu = pytest.mark.skipif(not dipu_available(), reason="dipu device layer not built")


@pytest.fixture
def test_library():
    """A scratch op namespace that exists only for one test."""
    lib = torch.library.Library("ditorch_tools_test", "FRAGMENT")
    yield lib
    lib._destroy()


@pytest.fixture(autouse=True)
def no_mode_left_behind():
    """Every test must leave the dispatch-mode stack as it found it (empty)."""
    assert torch._C._len_torch_dispatch_stack() == 0
    yield
    assert torch._C._len_torch_dispatch_stack() == 0, "a tool left a dispatch mode on the stack"
