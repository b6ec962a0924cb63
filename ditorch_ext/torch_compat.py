"""The torch releases ditorch supports, and the one place where they differ in a Python API ditorch
uses (the C++ twin is csrc/device/TorchCompat.h).

ditorch is built and tested at both ends of its range, torch 2.11 and 2.15, by
``make test-torch TORCH=X.Y.Z`` (docs/device.md, "Supported torch versions"); setup.py's
``install_requires`` names the same range, and tests/device/test_torch_compat.py holds the two
together. Differences inside the range that Python code sees, and which releases take which branch:

- ``torch.cuda.memory_stats()`` names ``"num_oom_rejections"`` from 2.13 on; dipu's
  ``memory_stats()`` reports it where the release's DeviceStats has it (TorchCompat.h).
- torch.distributed's one-tensor collectives are ``all_gather_single`` and
  ``reduce_scatter_single`` from 2.13 on, where the older ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` warn that they are deprecated; 2.11 and 2.12 have only the older
  names. :data:`all_gather_single` and :data:`reduce_scatter_single` are whichever the release
  has (the same signatures).

No other Python API that ditorch calls (torch.accelerator, torch.distributed's Backend
registration, DTensor, DCP, torch.utils' PrivateUse1 helpers) differs between 2.11 and 2.15 in what
ditorch uses: both ends pass the same test subset.
"""
from __future__ import annotations

import re
import warnings

import torch
import torch.distributed as dist

# Inclusive (major, minor) bounds of the releases ditorch is proven on.
OLDEST = (2, 11)
NEWEST = (2, 15)


def release(version: str | None = None) -> tuple[int, int, int]:
    """(major, minor, patch) of a torch version string ("2.15.0+cu132" -> (2, 15, 0)); this torch's
    when `version` is None."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"torch version {text!r} is not of the form X.Y[.Z]")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def check_supported(version: str | None = None) -> None:
    """Raise for a torch older than the range (ditorch's C++ needs its APIs); warn for a newer one
    (it may work, but nothing here has built or tested it)."""
    text = torch.__version__ if version is None else version
    major_minor = release(text)[:2]
    span = f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"
    if major_minor < OLDEST:
        raise RuntimeError(f"ditorch needs torch {span}; this is torch {text}. Install a torch in that range "
                           f"(pip install 'torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}').")
    if major_minor > NEWEST:
        warnings.warn(f"ditorch is tested with torch {span}; torch {text} is newer and untested "
                      f"(`make test-torch TORCH={text.split('+')[0]}` tests it)", RuntimeWarning, stacklevel=2)


def requirement() -> str:
    """The torch requirement setup.py declares for this range."""
    return f"torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"


# torch.distributed's one-tensor all-gather and reduce-scatter under the release's own names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
