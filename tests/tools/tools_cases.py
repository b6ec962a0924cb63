"""Shared by the tools tests (imported by module name: a unique name, unlike ``conftest``)."""
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
