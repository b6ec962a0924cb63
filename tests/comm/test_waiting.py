"""Waiting that yields the core: dicomm judges a host busy (waiters then block in the kernel at
once instead of polling) when it has more runnable threads than cores, and quiet again when the
load goes. The speed this buys is measured by benchmarks/comm.py --load, not here."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from busy_load import BUSY_ENV, busy_processes


def _busy_within(seconds: float, want: bool) -> bool:
    import dicomm

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if dicomm._C.host_busy() == want:
            return True
        time.sleep(0.005)  # each call samples the run queue at most once a millisecond
    return False


@pytest.mark.timeout(120)
def test_a_busy_process_per_core_makes_the_host_busy():
    cores = len(os.sched_getaffinity(0))
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)]
    try:
        assert _busy_within(10, True), "a busy process on every core (and one more) was not seen"
    finally:
        for p in load:
            p.kill()
            p.wait()
    # Quiet again once the load has gone, unless the harness keeps the machine busy on purpose.
    # Tests on the other worker (ranks of a training job) can keep it busy for a while: a bound
    # of a minute, left at the first quiet sample.
    if busy_processes():
        pytest.skip(f"{BUSY_ENV} keeps the host busy for the whole run: it cannot turn quiet here")
    assert _busy_within(60, False), "the host still counted as busy 60 s after its load stopped"
