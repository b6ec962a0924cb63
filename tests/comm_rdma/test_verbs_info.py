"""`ditorch info`'s verbs section: the port attributes decoded from what libibverbs reports
(checked against ibv_query_port(3)'s tables by hand), the pyverbs loader's errors, and the one
line a machine without verbs gets. The same report on a real device runs in the rdma guest
(test_verbs_oracle.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dicomm import topology, verbs
from dicomm.topology import Topology, describe

from .conftest import ROOT

LINK_LOCAL = "fe80:0000:0000:0000:5054:00ff:fe12:3456"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:0a4d:0001"
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


class FakeContext:
    """What pyverbs' Context answers for one RoCE port: EDR (active_speed 32) on 4X
    (active_width 2), MTU 1024 active (code 3) of 4096 (code 5), GIDs 0 and 2 set."""

    def query_port(self, port):
        assert port == 1
        return SimpleNamespace(state=4, link_layer=2, active_mtu=3, max_mtu=5, active_speed=32,
                               active_width=2, lid=0, gid_tbl_len=3)

    def query_gid(self, port, index):
        return [LINK_LOCAL, ZERO, IPV4_MAPPED][index]

    def query_gid_type(self, port, index):
        return 1  # IBV_GID_TYPE_ROCE_V2


def test_port_attributes_decode_as_ibv_query_port_documents_them():
    port = verbs._port(FakeContext(), 1)
    assert port == verbs.VerbsPort(number=1, state="ACTIVE", link_layer="Ethernet", active_mtu=1024,
                                   max_mtu=4096, speed_gbps=100.0, lanes=4, lid=0,
                                   gids=((0, LINK_LOCAL, "RoCE v2"), (2, IPV4_MAPPED, "RoCE v2")))


def test_report_shows_live_port_attributes_beside_sysfs_placement():
    nic = topology.Nic("rxe0", (), -1, (topology.IbPort(1, "ACTIVE", "Ethernet"),))
    live = {"rxe0": verbs.VerbsDevice("rxe0", "1.0", "5054:00ff:fe12:3456", (verbs._port(FakeContext(), 1),))}
    text = describe(topo=Topology((nic,), ()), live=live)
    assert "verbs devices (sysfs + pyverbs):" in text
    assert "rxe0: virtual, numa -1, firmware 1.0, node GUID 5054:00ff:fe12:3456" in text
    assert "port 1: ACTIVE, Ethernet, MTU 1024 (max 4096), 100 Gb/s (4x), lid 0" in text
    assert f"gid[2] {IPV4_MAPPED} RoCE v2" in text
    assert "rank 0: rxe0:1 (round-robin)" in text


def test_no_verbs_is_one_line_with_the_reason():
    text = describe(topo=Topology((), ()), no_device_reason="libibverbs: Failed to get devices list")
    assert text == ("verbs devices: none (libibverbs: Failed to get devices list); "
                    "the rdma transport is not usable, dicomm uses tcp/shm")


def test_loader_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # `import pyverbs` fails as if absent
    monkeypatch.setattr(verbs, "_SYSTEM_DIRS", (tmp_path / "missing",))
    with pytest.raises(verbs.VerbsUnavailable, match="apt-get install python3-pyverbs"):
        verbs.import_pyverbs()
    other_abi = tmp_path / "pyverbs"
    other_abi.mkdir()
    (other_abi / "__init__.py").write_text("")
    (other_abi / "device.cpython-399-x86_64-linux-gnu.so").write_text("")
    monkeypatch.setattr(verbs, "_SYSTEM_DIRS", (other_abi,))
    with pytest.raises(verbs.VerbsUnavailable, match="not built for this Python"):
        verbs.import_pyverbs()


@pytest.mark.skipif(Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()),
                    reason="this machine has a verbs device")
def test_ditorch_info_without_verbs_says_so_in_one_line():
    run = subprocess.run([sys.executable, "-m", "ditorch.cli", "info"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    section = run.stdout.split("RDMA (verbs devices)\n", 1)[1].strip().splitlines()
    assert len(section) == 1 and section[0].startswith("verbs devices: none ("), run.stdout
