"""Host topology for DiComm: RDMA NICs, accelerators, and which NIC each local rank uses.

The H2 paper (section 4.3, Table 3) gives every chip a dedicated *affinity NIC*: the NIC
closest to it on the PCIe tree, with the chips of a host spread over the NICs. Using a far NIC
cost 45-47 % of throughput there. This module reads the truth from sysfs:

* NICs: ``/sys/class/infiniband/<dev>`` (PCI path, NUMA node, ports with state, link layer and
  GIDs);
* accelerators: ``/sys/bus/pci/devices/*`` whose PCI class is a 3D/VGA controller of a GPU
  vendor or a processing accelerator (class 0x12), in PCI bus order (the order CUDA uses with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and most vendors use by default);

and maps each accelerator to a NIC by closeness, best first:

====  ==============  ==========================================================
rank  level           meaning
====  ==============  ==========================================================
0     ``pcie-switch``  NIC and device share a PCIe switch or root port
1     ``host-bridge``  same PCI host bridge (root complex), different root ports
2     ``numa``         same NUMA node only
3     ``remote``       nothing in common (another socket, or unknown)
====  ==============  ==========================================================

Devices are assigned level by level (all devices with a switch-local NIC first), each to the
least-loaded NIC of its best level, so ranks spread over NICs and a device with no near NIC
takes whatever NIC is least used.

Overrides, strongest first: ``DICOMM_IB_DEVICE`` (``dev[:port]``, or a comma list indexed by
local rank), then a topology file (``DICOMM_TOPOLOGY_FILE``, JSON or YAML) whose ``ranks:``
pins local ranks, and whose ``nics:``/``accelerators:`` replace what sysfs says for hosts
where sysfs does not tell the truth (VMs, containers, NICs behind unusual bridges).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "AFFINITY_LEVELS",
    "Accelerator",
    "IbPort",
    "Nic",
    "NicChoice",
    "Topology",
    "TopologyError",
    "apply_affinity",
    "assign_nics",
    "choose_nic",
    "describe",
    "discover",
    "parse_ib_device",
]

AFFINITY_LEVELS = ("pcie-switch", "host-bridge", "numa", "remote")

# PCI vendor ids whose display controllers are compute accelerators (not e.g. a BMC's VGA).
_GPU_VENDORS = {"0x10de": "nvidia", "0x1002": "amd", "0x8086": "intel"}
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA, 3D controller
_ACCEL_CLASS = "0x12"  # processing accelerators (Ascend, Gaudi, many AI chips)
_PORT_ACTIVE = "ACTIVE"


class TopologyError(ValueError):
    """A topology file, override or sysfs tree that cannot be used; the message says why."""


@dataclasses.dataclass(frozen=True)
class IbPort:
    """One port of a verbs device."""

    number: int
    state: str  # "ACTIVE", "DOWN", ... (sysfs "4: ACTIVE" without the number)
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    gids: tuple[tuple[int, str, str], ...] = ()  # (index, gid, type e.g. "RoCE v2"), non-zero only

    @property
    def active(self) -> bool:
        return self.state == _PORT_ACTIVE


@dataclasses.dataclass(frozen=True)
class Nic:
    """A verbs device (HCA, RoCE NIC, or a soft device such as rxe)."""

    name: str
    pci_path: tuple[str, ...] = ()  # sysfs device path below /sys/devices, root first; () if virtual
    numa_node: int = -1  # -1: unknown
    ports: tuple[IbPort, ...] = ()

    @property
    def active_port(self) -> IbPort | None:
        return next((p for p in self.ports if p.active), None)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """An accelerator as the PCI tree shows it; ``index`` is its position in PCI bus order."""

    index: int
    pci_path: tuple[str, ...] = ()
    numa_node: int = -1
    vendor: str = ""


@dataclasses.dataclass(frozen=True)
class Topology:
    nics: tuple[Nic, ...]
    accelerators: tuple[Accelerator, ...]
    rank_pins: Mapping[int, str] = dataclasses.field(default_factory=dict)  # from a topology file
    source: str = "sysfs"


@dataclasses.dataclass(frozen=True)
class NicChoice:
    """The NIC a local rank uses, and why."""

    device: str
    port: int
    level: str  # one of AFFINITY_LEVELS, or "override" / "pinned" / "round-robin"
    reason: str

    @property
    def env_value(self) -> str:
        """The ``DICOMM_IB_DEVICE`` value that selects exactly this NIC and port."""
        return f"{self.device}:{self.port}"


# ---- sysfs ------------------------------------------------------------------------------


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _int(text: str, default: int = -1) -> int:
    try:
        return int(text, 0)
    except ValueError:
        return default


def _pci_path(device_dir: Path, sysfs: Path) -> tuple[str, ...]:
    """The chain of sysfs device directories from the host bridge down, e.g.
    ("pci0000:00", "0000:00:02.0", "0000:03:00.0"); () when not on a PCI bus."""
    real = Path(os.path.realpath(device_dir))
    try:
        rel = real.relative_to(Path(os.path.realpath(sysfs / "devices")))
    except ValueError:
        return ()
    parts = rel.parts
    if not parts or not parts[0].startswith("pci"):
        return ()
    return tuple(parts)


def _read_ports(dev_dir: Path) -> tuple[IbPort, ...]:
    ports = []
    for port_dir in sorted((dev_dir / "ports").glob("*"), key=lambda p: _int(p.name, 1 << 30)):
        number = _int(port_dir.name)
        if number < 0:
            continue
        state = _read(port_dir / "state", "UNKNOWN").split(":")[-1].strip()
        gids = []
        for gid_file in sorted((port_dir / "gids").glob("*"), key=lambda p: _int(p.name, 1 << 30)):
            gid = _read(gid_file)
            if not gid or set(gid.replace(":", "")) <= {"0"}:
                continue
            index = _int(gid_file.name)
            gid_type = _read(port_dir / "gid_attrs" / "types" / gid_file.name)
            gids.append((index, gid, gid_type))
        ports.append(IbPort(number, state, _read(port_dir / "link_layer", "unknown"), tuple(gids)))
    return tuple(ports)


def _discover_nics(sysfs: Path) -> list[Nic]:
    nics = []
    for dev_dir in sorted((sysfs / "class" / "infiniband").glob("*")):
        device = dev_dir / "device"
        if device.exists():
            pci_path = _pci_path(device, sysfs)
            numa = _int(_read(device / "numa_node", "-1"))
        else:  # a soft device (rxe, siw): no PCI function of its own
            pci_path, numa = (), -1
        nics.append(Nic(dev_dir.name, pci_path, numa, _read_ports(dev_dir)))
    return nics


def _discover_accelerators(sysfs: Path) -> list[Accelerator]:
    found = []
    for dev in sorted((sysfs / "bus" / "pci" / "devices").glob("*")):
        cls = _read(dev / "class")
        vendor = _read(dev / "vendor")
        is_gpu = cls[:6] in _GPU_CLASSES and vendor in _GPU_VENDORS
        if not (is_gpu or cls[:4] == _ACCEL_CLASS):
            continue
        found.append((dev.name, _pci_path(dev, sysfs), _int(_read(dev / "numa_node", "-1")),
                      _GPU_VENDORS.get(vendor, vendor)))
    return [Accelerator(i, path, numa, vendor) for i, (_, path, numa, vendor) in enumerate(found)]


# ---- topology file ----------------------------------------------------------------------


def _split_path(value: Any, what: str) -> tuple[str, ...]:
    if value in (None, ""):
        return ()
    if isinstance(value, str):
        return tuple(p for p in value.split("/") if p)
    if isinstance(value, (list, tuple)):
        return tuple(str(p) for p in value)
    raise TopologyError(f"{what}: pci_path must be a string like 'pci0000:00/0000:00:02.0', got {value!r}")


def _load_topology_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError(f"topology file {path}: cannot read it ({exc.strerror})") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is the file's fault
        raise TopologyError(f"topology file {path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}") from exc
    if not isinstance(data, dict):
        raise TopologyError(f"topology file {path}: expected a mapping with nics/accelerators/ranks, got {type(data).__name__}")
    unknown = set(data) - {"nics", "accelerators", "ranks"}
    if unknown:
        raise TopologyError(f"topology file {path}: unknown keys {sorted(unknown)}; expected nics, accelerators, ranks")
    return data


def _nics_from_file(entries: Any, path: Path) -> list[Nic]:
    if not isinstance(entries, list):
        raise TopologyError(f"topology file {path}: 'nics' must be a list, got {type(entries).__name__}")
    nics = []
    for i, e in enumerate(entries):
        what = f"topology file {path}: nics[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise TopologyError(f"{what}: expected a mapping with a 'name' string, got {e!r}")
        port = _int(str(e.get("port", 1)))
        if port < 1:
            raise TopologyError(f"{what}: port must be >= 1, got {e.get('port')!r}")
        nics.append(Nic(e["name"], _split_path(e.get("pci_path"), what), _int(str(e.get("numa_node", -1))),
                        (IbPort(port, _PORT_ACTIVE, str(e.get("link_layer", "unknown"))),)))
    return nics


def _accelerators_from_file(entries: Any, path: Path) -> list[Accelerator]:
    if not isinstance(entries, list):
        raise TopologyError(f"topology file {path}: 'accelerators' must be a list, got {type(entries).__name__}")
    out = []
    for i, e in enumerate(entries):
        what = f"topology file {path}: accelerators[{i}]"
        if not isinstance(e, dict):
            raise TopologyError(f"{what}: expected a mapping with pci_path and/or numa_node, got {e!r}")
        out.append(Accelerator(i, _split_path(e.get("pci_path"), what), _int(str(e.get("numa_node", -1))),
                               str(e.get("vendor", ""))))
    return out


def discover(sysfs: str | os.PathLike[str] = "/sys", topology_file: str | os.PathLike[str] | None = None) -> Topology:
    """Read NICs and accelerators from ``sysfs``; ``topology_file`` (default: the
    ``DICOMM_TOPOLOGY_FILE`` variable) replaces the parts it names."""
    root = Path(sysfs)
    nics = _discover_nics(root)
    accels = _discover_accelerators(root)
    pins: dict[int, str] = {}
    source = "sysfs"
    topology_file = topology_file if topology_file is not None else os.environ.get("DICOMM_TOPOLOGY_FILE") or None
    if topology_file:
        path = Path(topology_file)
        data = _load_topology_file(path)
        source = f"sysfs + {path}"
        if "nics" in data:
            nics = _nics_from_file(data["nics"], path)
        if "accelerators" in data:
            accels = _accelerators_from_file(data["accelerators"], path)
        ranks = data.get("ranks") or {}
        if not isinstance(ranks, dict):
            raise TopologyError(f"topology file {path}: 'ranks' must map local rank -> 'dev[:port]', got {ranks!r}")
        for k, v in ranks.items():
            r = _int(str(k))
            if r < 0 or not isinstance(v, str) or not v:
                raise TopologyError(f"topology file {path}: ranks entry {k!r}: {v!r} is not 'local_rank: dev[:port]'")
            pins[r] = v
    return Topology(tuple(nics), tuple(accels), pins, source)


# ---- affinity ---------------------------------------------------------------------------


def _level(accel: Accelerator, nic: Nic) -> int:
    if accel.pci_path and nic.pci_path:
        common = 0
        for a, b in zip(accel.pci_path[:-1], nic.pci_path[:-1]):
            if a != b:
                break
            common += 1
        if common >= 2:  # share the host bridge and at least one PCI bridge below it
            return 0
        if common == 1:
            return 1
    if accel.numa_node >= 0 and accel.numa_node == nic.numa_node:
        return 2
    return 3


def _candidates(topo: Topology) -> list[Nic]:
    active = [n for n in topo.nics if n.active_port is not None]
    return active or list(topo.nics)


def assign_nics(topo: Topology) -> dict[int, NicChoice]:
    """Accelerator index -> its NIC, for every accelerator in ``topo`` (empty without NICs)."""
    nics = _candidates(topo)
    if not nics:
        return {}
    load = {n.name: 0 for n in nics}
    levels = {a.index: [_level(a, n) for n in nics] for a in topo.accelerators}
    best = {i: min(ls) for i, ls in levels.items()}
    out: dict[int, NicChoice] = {}
    for level in range(len(AFFINITY_LEVELS)):
        for accel in topo.accelerators:
            if best[accel.index] != level:
                continue
            # least-loaded NIC among the closest ones; ties go to the earlier NIC
            pick = min((i for i, lv in enumerate(levels[accel.index]) if lv == level),
                       key=lambda i: (load[nics[i].name], i))
            nic = nics[pick]
            load[nic.name] += 1
            port = nic.active_port or (nic.ports[0] if nic.ports else IbPort(1, "UNKNOWN", "unknown"))
            out[accel.index] = NicChoice(nic.name, port.number, AFFINITY_LEVELS[level],
                                         f"device {accel.index} -> {nic.name}: {AFFINITY_LEVELS[level]}, "
                                         f"{load[nic.name]} device(s) on it")
    return out


def parse_ib_device(value: str, local_rank: int) -> tuple[str, int]:
    """``DICOMM_IB_DEVICE`` grammar: ``dev[:port]`` or a comma list of them indexed by local
    rank (modulo its length). Returns (device, port); port defaults to 1."""
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if not entries:
        raise TopologyError(f"DICOMM_IB_DEVICE={value!r}: expected 'dev[:port]' or a comma list of them")
    entry = entries[local_rank % len(entries)]
    name, _, port_text = entry.partition(":")
    port = _int(port_text) if port_text else 1
    if not name or port < 1:
        raise TopologyError(f"DICOMM_IB_DEVICE={value!r}: entry {entry!r} is not 'dev[:port]' with port >= 1")
    return name, port


def choose_nic(local_rank: int, topo: Topology | None = None, env: Mapping[str, str] | None = None) -> NicChoice | None:
    """The NIC ``local_rank`` uses (``None`` when the host has no verbs device).

    Local rank r drives accelerator r (modulo their number). Precedence: ``DICOMM_IB_DEVICE``,
    the topology file's ``ranks:``, affinity, and round-robin over NICs when no accelerator
    is visible in sysfs (e.g. the emulated ``dipu`` vendor)."""
    if local_rank < 0:
        raise TopologyError(f"local_rank must be >= 0, got {local_rank}")
    env = os.environ if env is None else env
    topo = discover() if topo is None else topo
    known = {n.name for n in topo.nics}
    for origin, value in (("DICOMM_IB_DEVICE", env.get("DICOMM_IB_DEVICE", "")),
                          ("topology file", topo.rank_pins.get(local_rank, ""))):
        if not value:
            continue
        name, port = parse_ib_device(value, local_rank)
        if known and name not in known:
            raise TopologyError(f"{origin} names verbs device {name!r}, which this host does not have; "
                                f"devices: {', '.join(sorted(known))}")
        return NicChoice(name, port, "override" if origin == "DICOMM_IB_DEVICE" else "pinned",
                         f"local rank {local_rank} -> {name}:{port} from {origin}")
    nics = _candidates(topo)
    if not nics:
        return None
    if topo.accelerators:
        accel = topo.accelerators[local_rank % len(topo.accelerators)]
        return assign_nics(topo)[accel.index]
    nic = nics[local_rank % len(nics)]
    port = nic.active_port or (nic.ports[0] if nic.ports else IbPort(1, "UNKNOWN", "unknown"))
    return NicChoice(nic.name, port.number, "round-robin",
                     f"local rank {local_rank} -> {nic.name}: no accelerator in sysfs, ranks spread over NICs")


def apply_affinity(local_rank: int | None = None) -> NicChoice | None:
    """Resolve this process's NIC and export it as ``DICOMM_IB_DEVICE=dev:port`` for the rdma
    transport (which reads only that variable). ``local_rank`` defaults to ``LOCAL_RANK``."""
    if local_rank is None:
        local_rank = _int(os.environ.get("LOCAL_RANK", "0"), 0)
    choice = choose_nic(local_rank)
    if choice is not None:
        os.environ["DICOMM_IB_DEVICE"] = choice.env_value
    return choice


def describe(local_ranks: Sequence[int] | None = None, topo: Topology | None = None,
             live: Mapping[str, Any] | None = None, no_device_reason: str = "") -> str:
    """Human-readable report for ``ditorch info``: verbs devices, ports, link state, GIDs,
    accelerators, and the NIC each local rank would use. ``live`` maps a device name to what
    the device itself reports (``dicomm.verbs.VerbsDevice``: MTU, speed, GIDs), which then
    replaces sysfs's port lines; with no device at all the report is one line, ending with
    ``no_device_reason`` when given."""
    topo = discover() if topo is None else topo
    live = live or {}
    if not topo.nics and not live:
        why = f" ({no_device_reason})" if no_device_reason else ""
        return f"verbs devices: none{why}; the rdma transport is not usable, dicomm uses tcp/shm"
    lines = [f"verbs devices ({topo.source}{' + pyverbs' if live else ''}):"]
    for nic in topo.nics:
        where = "/".join(nic.pci_path[1:]) if nic.pci_path else "virtual"
        lines.append(f"  {nic.name}: {where}, numa {nic.numa_node}")
        device = live.get(nic.name)
        if device is not None:
            lines[-1] += f", firmware {device.firmware or '?'}, node GUID {device.node_guid}"
            lines += _live_port_lines(device.ports)
            continue
        if no_device_reason:
            lines.append(f"    (ports as sysfs shows them; the device itself was not asked: {no_device_reason})")
        for p in nic.ports:
            lines.append(f"    port {p.number}: {p.state}, {p.link_layer}")
            for index, gid, gid_type in p.gids:
                lines.append(f"      gid[{index}] {gid} {gid_type}".rstrip())
    lines.append(f"accelerators in PCI order: {len(topo.accelerators)}")
    for a in topo.accelerators:
        lines.append(f"  {a.index}: {a.vendor or 'unknown'} {'/'.join(a.pci_path[1:]) or '?'}, numa {a.numa_node}")
    if topo.nics:
        ranks = local_ranks if local_ranks is not None else range(len(topo.accelerators) or len(topo.nics))
        lines.append("NIC per local rank:")
        for r in ranks:
            try:
                c = choose_nic(r, topo)
            except TopologyError as exc:
                lines.append(f"  rank {r}: error: {exc}")
                continue
            if c is not None:
                lines.append(f"  rank {r}: {c.device}:{c.port} ({c.level})")
    return "\n".join(lines)


def _live_port_lines(ports: Sequence[Any]) -> list[str]:
    lines = []
    for p in ports:
        speed = f"{p.speed_gbps:g} Gb/s ({p.lanes}x)" if p.speed_gbps else "speed unknown"
        lines.append(f"    port {p.number}: {p.state}, {p.link_layer}, MTU {p.active_mtu} (max {p.max_mtu}), "
                     f"{speed}, lid {p.lid}")
        for index, gid, gid_type in p.gids:
            lines.append(f"      gid[{index}] {gid} {gid_type}".rstrip())
    return lines
