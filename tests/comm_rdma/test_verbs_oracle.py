"""DiComm's rdma transport checked from outside by verbs_oracle.py, a second verbs
implementation on pyverbs (Debian's python3-pyverbs), and `ditorch info` on a real device.
Runs inside the rdma guest (scripts/rdma_vm/run_tests.sh)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from diutil.address import free_port  # noqa: E402

from .conftest import ROOT, check_binary, rdma_usable  # noqa: E402

ORACLE = Path(__file__).resolve().with_name("verbs_oracle.py")


@functools.lru_cache(maxsize=None)  # one probe per session: each is a Python start in the slow guest
def _pyverbs_missing() -> str | None:
    run = subprocess.run([sys.executable, str(ORACLE), "--probe"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    return None if run.returncode == 0 else (run.stdout + run.stderr).strip()


pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not rdma_usable(), reason="needs a usable verbs device (run scripts/rdma_vm/run_tests.sh)"),
]


def _oracle_run(rkey_xor: int = 0, timeout: float = 240) -> tuple[subprocess.CompletedProcess, str]:
    """transport_check as rank 0 in oracle mode against verbs_oracle.py as rank 1; returns the
    oracle's result and transport_check's output."""
    if check_binary() is None:
        pytest.skip("build it first: tests/comm_rdma/build_transport_check.sh")
    why = _pyverbs_missing()
    if why:
        pytest.fail(f"pyverbs is needed in the rdma guest (scripts/rdma_vm/host_packages.sh installs it): {why}")
    port = free_port()
    env = dict(os.environ, DICOMM_TEST_RKEY_XOR=str(rkey_xor))
    dicomm_rank = subprocess.Popen([str(check_binary()), "rdma", "0", "2", str(port), "oracle"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        oracle = subprocess.run([sys.executable, str(ORACLE), "--store-port", str(port), "--timeout", "180"],
                                cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        try:
            out = dicomm_rank.communicate(timeout=5 if oracle.returncode else 90)[0]
        except subprocess.TimeoutExpired:
            dicomm_rank.kill()
            out = dicomm_rank.communicate()[0]
    finally:
        if dicomm_rank.poll() is None:
            dicomm_rank.kill()
    return oracle, out


@pytest.mark.timeout(400)
def test_independent_verbs_peer_exchanges_with_dicomm_both_ways() -> None:
    oracle, out = _oracle_run()
    print(oracle.stdout, out, sep="\n")
    assert oracle.returncode == 0, f"oracle:\n{oracle.stdout}{oracle.stderr}\ntransport_check:\n{out}"
    assert "oracle: ok" in oracle.stdout
    assert "RDMA READ through DiComm's key refused" in oracle.stdout
    assert "rank 0 rdma oracle: ok" in out, out


@pytest.mark.timeout(400)
def test_oracle_catches_a_wrong_published_key() -> None:
    """transport_check built with DICOMM_TEST_HOOKS publishes rkey ^ 1 on request."""
    oracle, out = _oracle_run(rkey_xor=1)
    assert oracle.returncode == 1, f"oracle:\n{oracle.stdout}{oracle.stderr}\ntransport_check:\n{out}"
    assert "the published key is wrong" in oracle.stdout, oracle.stdout


@pytest.mark.timeout(300)
def test_ditorch_info_lists_the_soft_roce_device() -> None:
    why = _pyverbs_missing()
    if why:
        pytest.fail(f"pyverbs is needed in the rdma guest: {why}")
    run = subprocess.run([sys.executable, "-m", "ditorch.cli", "info"], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "verbs devices (sysfs + pyverbs)" in text, text
    assert "rxe0: virtual" in text and "port 1: ACTIVE, Ethernet, MTU " in text, text
    # init.sh gives dummy0 10.77.0.1: rxe maps it into the GID table as ::ffff:10.77.0.1
    assert "0000:0000:0000:0000:0000:ffff:0a4d:0001 RoCE v2" in text, text
    assert "rank 0: rxe0:1 (round-robin)" in text, text
