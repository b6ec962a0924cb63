"""Shared helpers for the rdma tests: whether a verbs device is usable here, and the
transport-level check program (built on the host by scripts/rdma_vm/run_tests.sh, because
compiling under the guest's TCG emulation takes minutes)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK_BINARY = ROOT / "build" / "comm_rdma" / "transport_check"


@functools.lru_cache(maxsize=1)
def rdma_usable() -> bool:
    """True when dicomm was built with the rdma transport and a verbs device works here.

    Cheap where there is no verbs device (no torch import). Inside the harness guest
    (DICOMM_IN_RDMA_VM=1) it is taken as true without asking: the tests then check that every
    pair really uses rdma, so a broken build fails there instead of skipping, and the guest
    saves a torch import (~45 s under TCG). Elsewhere it is asked in a subprocess: importing
    dicomm here would load torch into pytest's process."""
    ib = Path("/sys/class/infiniband")
    if not ib.is_dir() or not any(ib.iterdir()):
        return False
    if os.environ.get("DICOMM_IN_RDMA_VM") == "1":
        return True
    code = "import dicomm, sys; sys.exit(0 if 'rdma' in dicomm.transports_usable() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_binary() -> Path | None:
    return CHECK_BINARY if os.access(CHECK_BINARY, os.X_OK) else None
