"""The shm pair's small-frame ring (csrc/comm/transport/SmallFrameRing.h): its sleep/wake
handshake never loses a wake-up, checked by a small C++ program built here against the same
source (tests/comm/unit/ring_handshake.cpp): thousands of rounds taking the reader away before,
inside and after a publication, then two processes exchanging thousands of messages."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["tests/comm/unit/ring_handshake.cpp", "csrc/comm/transport/SmallFrameRing.cpp"]


@pytest.fixture(scope="module")
def ring_handshake(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler on PATH (set CXX)")
    binary = tmp_path_factory.mktemp("ring") / "ring_handshake"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(ROOT / "csrc"),
                            *[str(ROOT / s) for s in SOURCES], "-o", str(binary)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-4000:]
    return binary


def test_reader_going_away_at_any_point_is_never_left_asleep(ring_handshake):
    run = subprocess.run([str(ring_handshake), "windows", "6000"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no lost wake-up" in run.stdout


def test_two_processes_exchange_thousands_of_messages(ring_handshake):
    run = subprocess.run([str(ring_handshake), "stress", "5000"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "delivered" in run.stdout
