import pytest
import torch

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
