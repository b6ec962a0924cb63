"""The loaded machine the suite must pass on: ``DITORCH_TEST_BUSY=N`` (``make test TEST_BUSY=N``)
runs N busy processes beside the whole run (tests/conftest.py starts and ends them)."""
from __future__ import annotations

import os

BUSY_ENV = "DITORCH_TEST_BUSY"


def busy_processes() -> int:
    """How many busy processes the harness runs beside this suite (0: a quiet run)."""
    value = os.environ.get(BUSY_ENV, "0") or "0"
    if not value.isdigit() or int(value) > 64:
        raise ValueError(f"{BUSY_ENV}={value!r}; expected a count of busy processes from 0 to 64")
    return int(value)
