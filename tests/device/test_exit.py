"""A process whose emulated chips ran a backward exits cleanly (ditorch_ext/shutdown.py).

Without the drain at exit, autograd's dipu device thread could still be dropping its last graph
task (which takes the GIL) while the interpreter finalized, and the rank aborted with
"terminate called without an active exception" (seen in 2 of 4 ranks per run of this test)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ranks_on_chips_b_and_c_exit_with_zero_and_no_terminate():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("exit_worker.py"))], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all ranks exited with 0" in proc.stdout


def test_drain_refuses_a_device_index_out_of_range():
    import pytest
    import torch  # noqa: F401

    import ditorch_ext

    with pytest.raises(RuntimeError, match="device index 99 is out of range"):
        ditorch_ext._C.drain_autograd_device_threads([99])
