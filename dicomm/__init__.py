"""DiComm: the ``dicomm`` torch.distributed backend.

Importing this package registers the backend with ``torch.distributed`` for the ``cpu``,
``dipu`` and ``cuda`` devices (it becomes the default for ``dipu``; cpu stays gloo and cuda stays
nccl unless you ask for dicomm)::

    import dicomm, torch.distributed as dist
    dist.init_process_group("dicomm")            # or "cpu:gloo,dipu:dicomm"

Environment:
    DICOMM_TRANSPORT     auto (default) | tcp | shm | rdma: force one transport for every peer
    DICOMM_SOCKET_IFNAME interfaces (comma-separated names) the tcp listener uses; default: the one
                         that routes to the store (MASTER_ADDR), as gloo and NCCL choose
    DICOMM_SOCKET_FAMILY AF_INET or AF_INET6: restrict that choice to one address family
    DICOMM_LISTEN_HOST   an explicit address for the tcp listener (overrides both)
    DICOMM_DEBUG         INFO: log the listen address, transports and algorithms chosen
    DICOMM_CHUNK_BYTES   pipeline chunk of the ring/tree collectives (default 4 MiB)
    DICOMM_FORCE_STAGING 1: stage device tensors through host copies even when the device's
                         memory is host-addressable (tests the path real vendors take)
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def _load_extension_from(path: str) -> None:
    """Use the backend built at `path` (a sanitizer build: `make test-asan`) as dicomm._C."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("dicomm._C", path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"DICOMM_EXTENSION={path!r}: expected the path of a built dicomm _C module")
    module = importlib.util.module_from_spec(spec)
    sys.modules["dicomm._C"] = module
    spec.loader.exec_module(module)
    globals()["_C"] = module  # as an import of the submodule would bind it


if os.environ.get("DICOMM_EXTENSION"):
    _load_extension_from(os.environ["DICOMM_EXTENSION"])

from dicomm._C import ProcessGroupDicomm, local_host_id  # noqa: E402
from dicomm._C import transports_built as _transports_built  # noqa: E402
from dicomm._C import transports_usable as _transports_usable  # noqa: E402

__all__ = [
    "ProcessGroupDicomm",
    "transports_built",
    "transports_usable",
    "local_host_id",
    "register",
    "BACKEND_NAME",
]

BACKEND_NAME = "dicomm"
_TRANSPORTS = ("auto", "tcp", "shm", "rdma")


def transports_built() -> list[str]:
    """Transports compiled into this build, most preferred first (e.g. ``['shm', 'tcp']``)."""
    return list(_transports_built())


def transports_usable() -> list[str]:
    """Transports that can run on this machine, most preferred first."""
    return list(_transports_usable())


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer number of bytes") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of bytes")
    return value


def _dipu_says(question: str) -> bool:
    """``torch.dipu.<question>()`` when the device layer is loaded, else False."""
    probe = getattr(getattr(torch, "dipu", None), question, None)
    return bool(probe()) if callable(probe) else False


def _seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _create_backend(dist_backend_opts, backend_options) -> ProcessGroupDicomm:
    """torch.distributed's creator hook (extended API) for ``dicomm``."""
    transport = os.environ.get("DICOMM_TRANSPORT", "auto").strip().lower() or "auto"
    if transport not in _TRANSPORTS:
        raise ValueError(f"DICOMM_TRANSPORT={transport!r}: expected one of {', '.join(_TRANSPORTS)}")
    if transport in ("auto", "rdma") and "rdma" in transports_built() and not os.environ.get("DICOMM_IB_DEVICE"):
        # Each local rank takes the NIC nearest its accelerator (the rdma transport reads the choice
        # from DICOMM_IB_DEVICE); without it every rank would share the first active device.
        from dicomm import topology

        topology.apply_affinity()
    return ProcessGroupDicomm(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        _seconds(dist_backend_opts.timeout),
        transport=transport,
        listen_host=os.environ.get("DICOMM_LISTEN_HOST", ""),
        chunk_bytes=_env_int("DICOMM_CHUNK_BYTES", 4 << 20),
        dipu_host_addressable=_dipu_says("is_host_addressable"),
        force_staging=os.environ.get("DICOMM_FORCE_STAGING", "0") == "1",
        group_name=str(dist_backend_opts.group_id or ""),
        dipu_asynchronous=_dipu_says("is_asynchronous"),
    )


class DicommOptions(torch._C._distributed_c10d.Backend.Options):
    """Backend options of a dicomm group (what ``split_group`` copies from its parent)."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
        super().__init__(BACKEND_NAME, timeout)

    def __deepcopy__(self, memo) -> "DicommOptions":
        return DicommOptions(self._timeout)


# torch.distributed.split_group deep-copies `parent_backend.options`.
ProcessGroupDicomm.options = property(
    lambda self: DicommOptions(datetime.timedelta(seconds=self.timeout_seconds)),
    doc="This group's backend options (timeout).",
)


def _perform_nocolor_split(self, device: torch.device) -> None:
    """What torch.distributed's new_group calls on a rank left out of the new group when the default
    group is bound to a device (NCCL's ncclCommSplit must be entered by every rank). A dicomm group
    is made from the store by its members alone: nothing to take part in."""


ProcessGroupDicomm.perform_nocolor_split = _perform_nocolor_split


def _dicomm_backends_of(group) -> list:
    """The distinct dicomm backends serving `group`'s devices."""
    found = []
    for device in group._device_types:
        backend = group._get_backend(device)
        if isinstance(backend, ProcessGroupDicomm) and not any(b is backend for b in found):
            found.append(backend)
    return found


_torch_set_pg_timeout = dist.distributed_c10d._set_pg_timeout


def _set_pg_timeout(timeout: datetime.timedelta, group=None) -> None:
    """torch.distributed's ``_set_pg_timeout`` (what torchtitan calls after its first step), for
    dicomm groups too: torch's own sets only gloo's and NCCL's and warns for any other backend.
    A group with another backend beside dicomm (``cpu:gloo,dipu:dicomm``) has that one set by
    torch's."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.distributed_c10d._rank_not_in_group(pg):
        raise ValueError("Invalid process group specified")
    ours = _dicomm_backends_of(pg)
    for backend in ours:
        backend.set_timeout(timeout)
    others = [d for d in pg._device_types if not isinstance(pg._get_backend(d), ProcessGroupDicomm)]
    if others or not ours:
        _torch_set_pg_timeout(timeout, group)


dist.distributed_c10d._set_pg_timeout = _set_pg_timeout


def register() -> list[str]:
    """Register ``dicomm`` with torch.distributed; returns the device types it serves.

    ``dipu`` is included once the device layer has renamed PrivateUse1 to ``dipu`` (``import
    ditorch`` does that before importing dicomm); call again after a late ``import ditorch``.
    Registering twice is harmless.
    """
    devices = ["cpu", "cuda"]
    if torch._C._get_privateuse1_backend_name() == "dipu":
        devices.insert(1, "dipu")
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=devices)
    return devices


register()
