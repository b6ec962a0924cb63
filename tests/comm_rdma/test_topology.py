"""NIC affinity on fake sysfs trees. Expected mappings are worked out by hand from the trees
drawn in each test's docstring; the random-tree test checks against a brute-force distance."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dicomm.topology import (
    TopologyError,
    assign_nics,
    choose_nic,
    describe,
    discover,
    parse_ib_device,
)

from .fake_sysfs import AI_ACCEL, ASPEED_VGA, GPU_AUDIO, NVIDIA_3D, FakeSysfs


def two_socket_server(root: Path) -> FakeSysfs:
    """Socket 0 (host bridge pci0000:00, NUMA 0) and socket 1 (pci0000:80, NUMA 1), each with
    two PCIe switches; every switch holds two GPUs and one NIC:

        sw A (00:02.0): gpu0 gpu1 mlx5_0      sw C (80:02.0): gpu4 gpu5 mlx5_2
        sw B (00:03.0): gpu2 gpu3 mlx5_1      sw D (80:03.0): gpu6 gpu7 mlx5_3
    """
    fs = FakeSysfs(root)
    fs.pci("pci0000:00/0000:00:01.0", ASPEED_VGA, 0)
    n = 0
    for host, numa, base in (("00", 0, 0x10), ("80", 1, 0x90)):
        for sw in range(2):
            bus = base + 0x10 * sw
            up = f"pci0000:{host}/0000:{host}:0{2 + sw}.0/0000:{bus:02x}:00.0"
            for slot in range(2):
                fs.pci(f"{up}/0000:{bus + 1:02x}:{slot:02x}.0/0000:{bus + 2 + slot:02x}:00.0", NVIDIA_3D, numa)
                fs.pci(f"{up}/0000:{bus + 1:02x}:{slot:02x}.0/0000:{bus + 2 + slot:02x}:00.1", GPU_AUDIO, numa)
            fs.nic(f"mlx5_{n}", f"{up}/0000:{bus + 1:02x}:08.0/0000:{bus + 8:02x}:00.0", numa)
            n += 1
    return fs


def test_switch_local_nic_for_every_gpu(tmp_path: Path) -> None:
    two_socket_server(tmp_path)
    topo = discover(tmp_path, topology_file="")
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert len(topo.accelerators) == 8  # the BMC VGA and the GPUs' audio functions are not
    assert [a.numa_node for a in topo.accelerators] == [0, 0, 0, 0, 1, 1, 1, 1]
    got = {i: (c.device, c.level) for i, c in assign_nics(topo).items()}
    want = {i: (f"mlx5_{i // 2}", "pcie-switch") for i in range(8)}
    assert got == want
    # local rank r drives gpu r; rank 9 wraps to gpu 1
    assert choose_nic(5, topo, env={}).device == "mlx5_2"
    assert choose_nic(9, topo, env={}).device == "mlx5_0"


def test_device_with_no_near_nic_spreads_over_the_rest(tmp_path: Path) -> None:
    """NUMA 0: switch A (gpu0, mlx5_0), switch B (gpu1, mlx5_1). NUMA 1: gpu2, gpu3, gpu4 on
    their own root ports and no NIC. gpu0/gpu1 take their switch NICs; gpu2..4 have only
    'remote' NICs and go to the least-loaded one in turn: mlx5_0, mlx5_1, mlx5_0."""
    fs = FakeSysfs(tmp_path)
    fs.pci("pci0000:00/0000:00:02.0/0000:10:00.0/0000:11:00.0/0000:12:00.0", NVIDIA_3D, 0)
    fs.nic("mlx5_0", "pci0000:00/0000:00:02.0/0000:10:00.0/0000:11:08.0/0000:18:00.0", 0)
    fs.pci("pci0000:00/0000:00:03.0/0000:20:00.0/0000:21:00.0/0000:22:00.0", NVIDIA_3D, 0)
    fs.nic("mlx5_1", "pci0000:00/0000:00:03.0/0000:20:00.0/0000:21:08.0/0000:28:00.0", 0)
    for i in range(3):
        fs.pci(f"pci0000:80/0000:80:0{2 + i}.0/0000:{0x90 + i:02x}:00.0", NVIDIA_3D, 1)
    got = {i: (c.device, c.level) for i, c in assign_nics(discover(tmp_path, topology_file="")).items()}
    assert got == {
        0: ("mlx5_0", "pcie-switch"),
        1: ("mlx5_1", "pcie-switch"),
        2: ("mlx5_0", "remote"),
        3: ("mlx5_1", "remote"),
        4: ("mlx5_0", "remote"),
    }


def test_host_bridge_beats_numa_and_ranks_spread_within_a_level(tmp_path: Path) -> None:
    """One NUMA node, two host bridges. pci0000:00 has gpu0, gpu1 (own root ports) and mlx5_0,
    mlx5_1 (own root ports); pci0000:40 has mlx5_2 and an AI accelerator (class 0x12).
    gpu0 -> mlx5_0, gpu1 -> mlx5_1 (host-bridge, spread), accel2 -> mlx5_2 (host-bridge)."""
    fs = FakeSysfs(tmp_path)
    fs.pci("pci0000:00/0000:00:02.0/0000:01:00.0", NVIDIA_3D, 0)
    fs.pci("pci0000:00/0000:00:03.0/0000:02:00.0", NVIDIA_3D, 0)
    fs.nic("mlx5_0", "pci0000:00/0000:00:04.0/0000:03:00.0", 0)
    fs.nic("mlx5_1", "pci0000:00/0000:00:05.0/0000:04:00.0", 0)
    fs.nic("mlx5_2", "pci0000:40/0000:40:02.0/0000:41:00.0", 0)
    fs.pci("pci0000:40/0000:40:03.0/0000:42:00.0", AI_ACCEL, 0)
    got = {i: (c.device, c.level) for i, c in assign_nics(discover(tmp_path, topology_file="")).items()}
    assert got == {0: ("mlx5_0", "host-bridge"), 1: ("mlx5_1", "host-bridge"), 2: ("mlx5_2", "host-bridge")}


def test_numa_level_and_inactive_ports(tmp_path: Path) -> None:
    """gpu0 on NUMA 1; mlx5_0 (NUMA 1, port DOWN), mlx5_1 (NUMA 1, active), mlx5_2 (NUMA 0).
    The down NIC is never chosen: gpu0 -> mlx5_1 at the numa level."""
    fs = FakeSysfs(tmp_path)
    fs.pci("pci0000:80/0000:80:02.0/0000:81:00.0", NVIDIA_3D, 1)
    fs.nic("mlx5_0", "pci0000:a0/0000:a0:02.0/0000:a1:00.0", 1, ports=(("1: DOWN", "InfiniBand", {}),))
    fs.nic("mlx5_1", "pci0000:c0/0000:c0:02.0/0000:c1:00.0", 1)
    fs.nic("mlx5_2", "pci0000:00/0000:00:02.0/0000:01:00.0", 0)
    c = choose_nic(0, discover(tmp_path, topology_file=""), env={})
    assert (c.device, c.port, c.level) == ("mlx5_1", 1, "numa")


def test_no_accelerator_round_robin_and_soft_device(tmp_path: Path) -> None:
    """Emulated dipu: no accelerator in sysfs. rxe0 (virtual) and mlx5_0: ranks alternate."""
    fs = FakeSysfs(tmp_path)
    rxe_gid = {0: ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2"),
               1: ("0000:0000:0000:0000:0000:ffff:0a4d:0001", "RoCE v2")}
    fs.nic("mlx5_0", "pci0000:00/0000:00:02.0/0000:01:00.0", 0)
    fs.nic("rxe0", None, ports=(("4: ACTIVE", "Ethernet", rxe_gid),))
    topo = discover(tmp_path, topology_file="")
    rxe = next(n for n in topo.nics if n.name == "rxe0")
    assert rxe.pci_path == () and rxe.ports[0].link_layer == "Ethernet"
    assert [g[0] for g in rxe.ports[0].gids] == [0, 1]  # zero GIDs 2, 3 are skipped
    assert [choose_nic(r, topo, env={}).device for r in range(4)] == ["mlx5_0", "rxe0", "mlx5_0", "rxe0"]
    text = describe(topo=topo)
    assert "gid[1] 0000:0000:0000:0000:0000:ffff:0a4d:0001 RoCE v2" in text
    assert "rank 1: rxe0:1 (round-robin)" in text


def test_no_nics(tmp_path: Path) -> None:
    fs = FakeSysfs(tmp_path)
    fs.pci("pci0000:00/0000:00:02.0/0000:01:00.0", NVIDIA_3D, 0)
    topo = discover(tmp_path, topology_file="")
    assert choose_nic(0, topo, env={}) is None
    assert assign_nics(topo) == {}
    assert "none" in describe(topo=topo)


def test_env_override(tmp_path: Path) -> None:
    two_socket_server(tmp_path)
    topo = discover(tmp_path, topology_file="")
    c = choose_nic(0, topo, env={"DICOMM_IB_DEVICE": "mlx5_3:2"})
    assert (c.device, c.port, c.level, c.env_value) == ("mlx5_3", 2, "override", "mlx5_3:2")
    env = {"DICOMM_IB_DEVICE": "mlx5_1,mlx5_2"}
    assert [choose_nic(r, topo, env=env).device for r in range(3)] == ["mlx5_1", "mlx5_2", "mlx5_1"]
    with pytest.raises(TopologyError, match=r"'mlx9_0'.*does not have.*mlx5_0, mlx5_1"):
        choose_nic(0, topo, env={"DICOMM_IB_DEVICE": "mlx9_0"})
    with pytest.raises(TopologyError, match="port >= 1"):
        parse_ib_device("mlx5_0:0", 0)
    with pytest.raises(TopologyError, match="expected 'dev"):
        parse_ib_device(" , ", 0)
    with pytest.raises(TopologyError, match="local_rank must be >= 0"):
        choose_nic(-1, topo, env={})


def test_topology_file_replaces_sysfs(tmp_path: Path) -> None:
    """A VM whose sysfs shows every device on one flat bus: the file restores the real tree.
    Real tree: gpu0 shares a switch with ib1, gpu1 with ib0; rank 2 is pinned to ib0:2."""
    fs = FakeSysfs(tmp_path / "sys")
    fs.pci("pci0000:00/0000:00:05.0", NVIDIA_3D)
    fs.pci("pci0000:00/0000:00:06.0", NVIDIA_3D)
    fs.nic("ib0", "pci0000:00/0000:00:07.0")
    fs.nic("ib1", "pci0000:00/0000:00:08.0")
    flat = discover(tmp_path / "sys", topology_file="")
    assert [c.level for c in assign_nics(flat).values()] == ["host-bridge", "host-bridge"]
    f = tmp_path / "topo.yaml"
    f.write_text(
        "nics:\n"
        "  - {name: ib0, pci_path: pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:01.0/0000:07:00.0, numa_node: 0}\n"
        "  - {name: ib1, pci_path: pci0000:00/0000:00:03.0/0000:15:00.0/0000:16:01.0/0000:17:00.0, numa_node: 0}\n"
        "accelerators:\n"
        "  - {pci_path: pci0000:00/0000:00:03.0/0000:15:00.0/0000:16:02.0/0000:18:00.0, numa_node: 0}\n"
        "  - {pci_path: pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:02.0/0000:08:00.0, numa_node: 0}\n"
        "ranks:\n"
        "  2: ib0:2\n"
    )
    topo = discover(tmp_path / "sys", topology_file=f)
    assert {i: (c.device, c.level) for i, c in assign_nics(topo).items()} == {
        0: ("ib1", "pcie-switch"), 1: ("ib0", "pcie-switch")}
    c = choose_nic(2, topo, env={})
    assert (c.device, c.port, c.level) == ("ib0", 2, "pinned")
    assert choose_nic(3, topo, env={}).device == "ib0"  # unpinned rank 3 drives gpu1


@pytest.mark.parametrize("content,message", [
    ("[1, 2]", "expected a mapping"),
    ('{"nic": []}', "unknown keys \\['nic'\\]"),
    ('{"nics": [{"pci_path": "x"}]}', "nics\\[0\\]: expected a mapping with a 'name'"),
    ('{"nics": [{"name": "a", "port": 0}]}', "port must be >= 1"),
    ('{"ranks": {"x": "mlx5_0"}}', "ranks entry 'x'"),
    ("{not json", "not valid JSON"),
])
def test_bad_topology_file(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "topo.json"
    f.write_text(content)
    with pytest.raises(TopologyError, match=message):
        discover(tmp_path, topology_file=f)
    with pytest.raises(TopologyError, match="cannot read"):
        discover(tmp_path, topology_file=tmp_path / "missing.json")


def _brute_force_level(gpu: str, nic: str, gpu_numa: int, nic_numa: int) -> int:
    """Distance from the two sysfs paths as strings: the deepest shared directory."""
    g, n = gpu.split("/"), nic.split("/")
    shared = 0
    while shared < min(len(g), len(n)) - 1 and g[shared] == n[shared]:
        shared += 1
    if shared >= 2:
        return 0
    if shared == 1:
        return 1
    return 2 if gpu_numa == nic_numa else 3


@pytest.mark.parametrize("seed", range(20))
def test_random_trees_every_device_gets_its_closest_level(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    fs = FakeSysfs(tmp_path)
    gpus, nics = [], []
    bus = 1
    for host in range(rng.randint(1, 3)):
        numa = rng.randint(0, 1)
        for port in range(rng.randint(1, 3)):
            base = f"pci0000:{host:02x}/0000:{host:02x}:{port + 2:02x}.0"
            for _ in range(rng.randint(0, 3)):
                path = f"{base}/0000:{bus:02x}:00.0"
                bus += 1
                if rng.random() < 0.6:
                    fs.pci(path, NVIDIA_3D, numa)
                    gpus.append((path, numa))
                else:
                    fs.nic(f"mlx5_{len(nics)}", path, numa)
                    nics.append((f"mlx5_{len(nics)}", path, numa))
    topo = discover(tmp_path, topology_file="")
    assignment = assign_nics(topo)
    if not nics:
        assert assignment == {}
        return
    order = sorted(gpus)  # accelerators are indexed in PCI (path) order
    names = ("pcie-switch", "host-bridge", "numa", "remote")
    loads: dict[str, int] = {}
    for index, (path, numa) in enumerate(order):
        best = min(_brute_force_level(path, p, numa, nn) for _, p, nn in nics)
        choice = assignment[index]
        nic_path, nic_numa = next((p, nn) for n, p, nn in nics if n == choice.device)
        assert _brute_force_level(path, nic_path, numa, nic_numa) == best
        assert choice.level == names[best]
        loads[choice.device] = loads.get(choice.device, 0) + 1
    assert sum(loads.values()) == len(gpus)


def test_discover_on_this_host_does_not_fail() -> None:
    # Whatever the machine has (often nothing), discovery and the report must work.
    topo = discover()
    assert isinstance(describe(topo=topo), str)
    assert json.dumps([n.name for n in topo.nics])
