"""A miniature sysfs tree: PCI functions under /devices, the /bus/pci/devices and
/class/infiniband symlinks that point into it, with the files dicomm.topology reads."""
from __future__ import annotations

import os
from pathlib import Path

NVIDIA_3D = ("0x030200", "0x10de")
ASPEED_VGA = ("0x030000", "0x1a03")  # a BMC's display: not an accelerator
AI_ACCEL = ("0x120000", "0x19e5")  # processing accelerator class (e.g. Ascend)
MLX_NIC = ("0x020700", "0x15b3")
GPU_AUDIO = ("0x040300", "0x10de")


class FakeSysfs:
    def __init__(self, root: Path) -> None:
        self.root = root
        for d in ("devices", "bus/pci/devices", "class/infiniband"):
            (root / d).mkdir(parents=True, exist_ok=True)

    def pci(self, path: str, kind: tuple[str, str], numa: int = -1) -> Path:
        """Add a PCI function at devices/<path> (``pci0000:00/0000:00:02.0/...``)."""
        d = self.root / "devices" / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "class").write_text(kind[0] + "\n")
        (d / "vendor").write_text(kind[1] + "\n")
        (d / "numa_node").write_text(f"{numa}\n")
        link = self.root / "bus/pci/devices" / d.name
        os.symlink(os.path.relpath(d, link.parent), link)
        return d

    def nic(self, name: str, path: str | None, numa: int = -1,
            ports: tuple[tuple[str, str, dict[int, tuple[str, str]]], ...] = (("4: ACTIVE", "InfiniBand", {}),)) -> None:
        """Add a verbs device; ``path`` is its PCI function (None: a virtual device like rxe).
        ports: (state, link_layer, {gid index: (gid, type)}) per port, numbered from 1."""
        if path is None:
            dev = self.root / "devices/virtual/infiniband" / name
            dev.mkdir(parents=True)
        else:
            pci = self.pci(path, MLX_NIC, numa)
            dev = pci / "infiniband" / name
            dev.mkdir(parents=True)
            os.symlink(os.path.relpath(pci, dev), dev / "device")
        for number, (state, link, gids) in enumerate(ports, start=1):
            p = dev / "ports" / str(number)
            (p / "gids").mkdir(parents=True)
            (p / "gid_attrs/types").mkdir(parents=True)
            (p / "state").write_text(state + "\n")
            (p / "link_layer").write_text(link + "\n")
            for index in range(4):  # unused table entries read as zero GIDs
                gid, gid_type = gids.get(index, ("0000:0000:0000:0000:0000:0000:0000:0000", ""))
                (p / "gids" / str(index)).write_text(gid + "\n")
                (p / "gid_attrs/types" / str(index)).write_text(gid_type + "\n")
        link = self.root / "class/infiniband" / name
        os.symlink(os.path.relpath(dev, link.parent), link)
