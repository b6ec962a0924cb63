"""The transport's bookkeeping objects (csrc/comm/transport/FailureLatch.h, RendezvousBook.h,
GreetingBound.h) and the mailbox (csrc/comm/core/Mailbox.h),
checked without sockets by a small C++ program built here against the same sources."""
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["tests/comm/unit/transport_units.cpp", "csrc/comm/transport/FailureLatch.cpp",
           "csrc/comm/transport/RendezvousBook.cpp", "csrc/comm/transport/GreetingBound.cpp",
           "csrc/comm/core/Mailbox.cpp", "csrc/comm/transport/Env.cpp"]


def test_failure_latch_and_rendezvous_book(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler on PATH (set CXX)")
    torch_dir = Path(torch.__file__).parent
    binary = tmp_path / "transport_units"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Werror",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
         "-I", str(ROOT / "csrc"), "-isystem", str(torch_dir / "include"),
         "-isystem", str(torch_dir / "include/torch/csrc/api/include"),
         "-isystem", sysconfig.get_paths()["include"],
         *[str(ROOT / s) for s in SOURCES], "-o", str(binary)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all checks passed" in run.stdout
