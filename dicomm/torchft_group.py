"""dicomm as a torchft process group: ``ProcessGroupDicommFT``.

torchft (PyTorch's fault-tolerance library) keeps synchronous data-parallel training going while
replicas die and return. Its Manager reconfigures one process group per quorum: ``configure``
with a new store prefix, rank and world size, in the same process; ``abort`` when something
failed; ``errored`` to learn, before committing a step, whether the group broke meanwhile. It
ships such groups for gloo, NCCL and XCCL, one vendor's devices each. This one is a dicomm group,
so one quorum can hold replicas on different vendors (CPU, emulated chips, CUDA): every tensor a
dicomm group takes (cpu, dipu, cuda) goes through it.

It follows torchft's ``ProcessGroupWrapper`` contract as torchft's own ``ProcessGroupGloo`` does:
each ``configure`` aborts the previous group and builds a fresh dicomm backend on
``PrefixStore(prefix, TCPStore(host, port))``. Each dicomm backend owns its communicator,
listener, pairs and threads, and its store keys live under the quorum's prefix, so the old and
the new group of a process share nothing. ``abort`` closes the communicator: every pending op
fails at once naming the cause, and the peers learn it from an abort notice.

Importing this module needs ``torchft`` (``requirements.txt`` installs it); ``dicomm`` itself
does not.
"""
from __future__ import annotations

import datetime
import types
from typing import Optional

import torch
from torch.distributed import Store
from torchft.process_group import ProcessGroupWrapper

import dicomm

__all__ = ["ProcessGroupDicommFT"]

_BaseProcessGroup = torch._C._distributed_c10d.ProcessGroup


def dicomm_devices() -> list[str]:
    """The device types a dicomm group serves in this process: cpu, dipu once the device layer
    is loaded, and cuda where it is available."""
    devices = ["cpu"]
    if torch._C._get_privateuse1_backend_name() == "dipu":
        devices.append("dipu")
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


class ProcessGroupDicommFT(ProcessGroupWrapper):
    """A reconfigurable dicomm process group for torchft's Manager (``Manager(pg=...)``).

    ``timeout`` bounds making each group (all its ranks connecting) and is every op's default
    deadline (torchft's ``set_timeout`` changes it for the next ``configure``).
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._backend: Optional[dicomm.ProcessGroupDicomm] = None
        self._quorum = 0  # groups made so far: names each one

    def getBackendName(self) -> str:
        return "torchft-dicomm"

    def _create_pg(self, store: Store, rank: int, world_size: int) -> _BaseProcessGroup:
        self._quorum += 1
        name = f"torchft_quorum_{self._quorum_id if self._quorum_id is not None else self._quorum}"
        opts = types.SimpleNamespace(store=store, group_rank=rank, group_size=world_size,
                                     timeout=self._timeout, group_id=name)
        backend = dicomm._create_backend(opts, None)
        pg = _BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(_BaseProcessGroup.BackendType.CUSTOM)
        for device in dicomm_devices():
            pg._register_backend(torch.device(device), _BaseProcessGroup.BackendType.CUSTOM, backend)
        self._backend = backend
        return pg

    def abort(self, errored: bool = True) -> None:
        """Fail every pending op of the current group at once and drop it (idempotent)."""
        # ProcessGroup.abort() aborts the dicomm backend: its pending ops fail naming the call
        # and the peers' groups learn it from the abort notice.
        self._backend = None
        super().abort(errored=errored)

    def shutdown(self) -> None:
        """Leave the current group: its peers' pending and later ops fail at once naming this
        rank (dicomm's goodbye) instead of at their deadline, as they would if the group lived
        on unreferenced until a garbage collection. Ops of this rank still queued finish first."""
        pg, self._backend = self._pg, None
        super().shutdown()
        if pg is not None:
            pg.shutdown()

    def errored(self) -> Optional[Exception]:
        """The failure that aborted the current group (a peer that died or aborted, an op past
        its deadline), or None while it is healthy."""
        backend = self._backend
        if backend is not None and backend.aborted:
            return RuntimeError(f"dicomm process group aborted: {backend.abort_cause}")
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg})"
