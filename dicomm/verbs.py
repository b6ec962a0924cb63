"""Live verbs devices, as rdma-core's own Python bindings (pyverbs) report them.

``dicomm.topology`` reads sysfs, which says where a NIC sits (PCI path, NUMA node) and is
readable without opening the device. What only the device can say (the MTU a port runs at,
its speed and width, the GID table as the provider fills it) comes from opening it, here
through pyverbs rather than a second hand-written binding: it is the bindings rdma-core
tests itself with, so ``ditorch info`` reports what libibverbs sees.

pyverbs is not on PyPI in a form that builds against a distribution's rdma-core, so the
distribution's package is used (Debian: ``python3-pyverbs``). Its modules are compiled for
the distribution's Python; when the running interpreter has the same ABI (a venv on another
build of the same Python version) the package is imported from the distribution's
directory by itself, without putting the rest of that directory on ``sys.path``.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["VerbsPort", "VerbsDevice", "VerbsUnavailable", "import_pyverbs", "query_devices"]

# Where distributions install pyverbs for their own Python 3.
_SYSTEM_DIRS = (Path("/usr/lib/python3/dist-packages/pyverbs"), Path("/usr/lib64/python3/site-packages/pyverbs"))
# IB port states and MTU codes (verbs.h: enum ibv_port_state, enum ibv_mtu).
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
# active_speed codes -> data rate per lane in Gb/s (SDR .. NDR, XDR), as ibv_devinfo prints them;
# active_width codes -> lanes.
_LANE_GBPS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0, 256: 200.0}
_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
# ibv_gid_type as pyverbs' query_gid_type returns it.
_GID_TYPES = {0: "IB/RoCE v1", 1: "RoCE v2"}


class VerbsUnavailable(RuntimeError):
    """pyverbs is missing or finds no verbs device; the message says which, in one line."""


@dataclasses.dataclass(frozen=True)
class VerbsPort:
    """One port as the device reports it."""

    number: int
    state: str
    link_layer: str
    active_mtu: int  # bytes
    max_mtu: int  # bytes
    speed_gbps: float  # lanes x per-lane rate; 0 when the provider does not say
    lanes: int
    lid: int
    gids: tuple[tuple[int, str, str], ...]  # (index, gid, type), non-zero entries only


@dataclasses.dataclass(frozen=True)
class VerbsDevice:
    name: str
    firmware: str
    node_guid: str
    ports: tuple[VerbsPort, ...]


def import_pyverbs() -> ModuleType:
    """The ``pyverbs`` package: from this interpreter's path, else the distribution's
    (when built for this interpreter's ABI). Raises VerbsUnavailable saying what to install."""
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
    for directory in _SYSTEM_DIRS:
        if not (directory / "__init__.py").is_file():
            continue
        if not (directory / f"device{suffix}").is_file():
            raise VerbsUnavailable(f"pyverbs in {directory} is not built for this Python ({suffix})")
        spec = importlib.util.spec_from_file_location("pyverbs", directory / "__init__.py",
                                                      submodule_search_locations=[str(directory)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules["pyverbs"]
            raise
        return module
    raise VerbsUnavailable("pyverbs is not installed (Debian: apt-get install python3-pyverbs)")


def _gids(context, port: int, table_len: int, limit: int = 16) -> tuple[tuple[int, str, str], ...]:
    """The non-zero GIDs among the first `limit` entries (RoCE tables hold one per address)."""
    out = []
    for index in range(min(table_len, limit)):
        try:
            gid = str(context.query_gid(port, index))
        except Exception:  # noqa: BLE001 - an empty or unreadable slot ends nothing
            continue
        if not gid or set(gid.replace(":", "")) <= {"0"}:
            continue
        try:
            kind = _GID_TYPES.get(int(context.query_gid_type(port, index)), "?")
        except Exception:  # noqa: BLE001 - InfiniBand ports have no GID types
            kind = ""
        out.append((index, gid, kind))
    return tuple(out)


def _port(context, number: int) -> VerbsPort:
    attr = context.query_port(number)
    lanes = _LANES.get(int(attr.active_width), 0)
    return VerbsPort(
        number=number,
        state=_PORT_STATES.get(int(attr.state), str(attr.state)),
        link_layer=_LINK_LAYERS.get(int(attr.link_layer), str(attr.link_layer)),
        active_mtu=_MTU_BYTES.get(int(attr.active_mtu), 0),
        max_mtu=_MTU_BYTES.get(int(attr.max_mtu), 0),
        speed_gbps=lanes * _LANE_GBPS.get(int(attr.active_speed), 0.0),
        lanes=lanes,
        lid=int(attr.lid),
        gids=_gids(context, number, int(attr.gid_tbl_len)),
    )


def _text(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def _guid(raw) -> str:
    return str(raw) if not isinstance(raw, int) else ":".join(f"{raw:016x}"[i:i + 4] for i in range(0, 16, 4))


def query_devices() -> list[VerbsDevice]:
    """Every verbs device with its ports. Raises VerbsUnavailable (one line: why) when
    pyverbs is missing or libibverbs finds no device."""
    import_pyverbs()
    device_mod = importlib.import_module("pyverbs.device")
    try:
        found = device_mod.get_device_list()
    except Exception as exc:  # noqa: BLE001 - pyverbs raises when there is no device at all
        raise VerbsUnavailable(f"libibverbs: {exc}") from exc
    if not found:
        raise VerbsUnavailable("libibverbs lists no device")
    devices = []
    for dev in found:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        with device_mod.Context(name=name) as context:
            attr = context.query_device()
            ports = tuple(_port(context, p) for p in range(1, int(attr.phys_port_cnt) + 1))
            devices.append(VerbsDevice(name, _text(attr.fw_version), _guid(attr.node_guid), ports))
    return devices
