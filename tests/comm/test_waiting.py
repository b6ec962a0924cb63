"""Waiting that yields the core: dicomm judges a host busy (waiters then block in the kernel at
once instead of polling) when it has more runnable threads than cores, and quiet again when the
load goes. The speed this buys is measured by benchmarks/comm.py --load, not here."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


def _busy_within(seconds: float, want: bool) -> bool:
    import dicomm

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if dicomm._C.host_busy() == want:
            return True
        time.sleep(0.005)  # each call samples the run queue at most once a millisecond
    return False


@pytest.mark.timeout(60)
def test_a_busy_process_per_core_makes_the_host_busy():
    cores = len(os.sched_getaffinity(0))
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)]
    try:
        assert _busy_within(10, True), "a busy process on every core (and one more) was not seen"
    finally:
        for p in load:
            p.kill()
            p.wait()
    # Quiet again once the load has gone (unless something else keeps this machine busy).
    assert _busy_within(10, False), "the host still counted as busy 10 s after its load stopped"
