"""Checkpoints that load under any plan: other stage splits, TP sizes, DP sizes, chips.

A checkpoint holds the *full* model's tensors under their single-process names
(``model/layers.3.attn.wq.weight``), AdamW's state the same way
(``optim/layers.3.attn.wq.weight/exp_avg``) and the step, written and read with
``torch.distributed.checkpoint`` (DCP). Saving, each stage's TP ranks gather their shards and
the stage's first rank writes the whole tensors; DCP spreads the writing over the stages and
keeps one metadata file. Loading, every rank reads the whole tensors of its own stage and cuts
its shard with the rule that cuts a fresh initialization (stage_model.cut), so a checkpoint
written under one plan resumes under another. Re-planning when the fleet changes needs exactly
this; DCP's own resharding covers DTensor placements, not a change of stage boundaries.

A save directory (``--save DIR``) holds complete checkpoints ``DIR/step-<N>``, the newest
``KEEP`` of them. Each is written to ``DIR/.step-<N>.partial`` (DCP fsyncs every file) and
renamed into place by rank 0 once every rank's part and the metadata are on disk, the rename
itself made durable: a save cut short by a full disk, a kill or a power loss leaves the earlier
checkpoints as they were, and ``--resume DIR`` takes the newest complete one.

Reading, nothing in a checkpoint runs code. DCP stores tensors with ``torch.save`` and reads
them with ``weights_only=True``, but reads its metadata file with a plain ``pickle.load``: a
downloaded checkpoint could run anything it likes. So the metadata is read here by an unpickler
that builds only DCP's own metadata records (``_SafeReader``), and every file it names must lie
in the checkpoint's directory.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from diutil.durable import fsync_dir

from .stage_model import cut, gather_full, shard_dim

if TYPE_CHECKING:
    from .trainer import PipelineTrainer

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")
KEEP = 2  # complete checkpoints kept in a save directory
_STEP_DIR = re.compile(r"step-(\d{8,})")


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or read; the message says which and why."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else (no call of anything a file names)."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "TensorProperties",
            "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


class _SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader, with the metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: not checkpoint metadata this program reads ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
        for info in (metadata.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if not name or "/" in name or name in (".", "..") or "\0" in name:
                raise CheckpointError(f"{path}: names the file {name[:80]!r}; a checkpoint's files lie in its directory")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def latest_checkpoint(directory: str | Path) -> Path:
    """The checkpoint ``--resume`` takes: ``directory`` itself when it is one, else the newest
    complete ``step-<N>`` in it."""
    directory = Path(directory)
    if (directory / ".metadata").is_file():
        return directory
    steps = sorted((d for d in directory.glob("step-*") if _STEP_DIR.fullmatch(d.name)
                    and (d / ".metadata").is_file()), key=lambda d: int(d.name[5:]))
    if not steps:
        raise FileNotFoundError(f"{directory}: no complete checkpoint (no .metadata, no step-<N> directory with "
                                "one); expected a directory written by --save")
    return steps[-1]

def _stage_tensors(trainer: "PipelineTrainer") -> dict[str, tuple[torch.Tensor, int | None]]:
    """Every tensor this rank holds, under its checkpoint key, with the dimension TP splits."""
    state = trainer.optimizer_state()
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for name, p in trainer.module.named_parameters():
        dim, name = shard_dim(name), trainer.module.checkpoint_name(name)
        out[f"model/{name}"] = (p.detach(), dim)
        for key in _OPTIM_KEYS:
            if key in state.get(p, {}):
                value = state[p][key]
                out[f"optim/{name}/{key}"] = (value, dim if value.dim() > 0 else None)
    return out


def save_checkpoint(directory: str | Path, step: int, trainer: "PipelineTrainer") -> Path:
    """Collective over all ranks: write the full model and optimizer state at ``step`` as the
    complete checkpoint ``directory/step-<step>``; returns it. Raises CheckpointError on every
    rank when any rank's write failed, with the earlier checkpoints left as they were."""
    root = Path(directory)
    final, partial = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
    place, tp = trainer.place, trainer.groups.tp
    writer = place.dp_index == 0 and place.tp_index == 0
    state: dict[str, object] = {}
    for key, (t, dim) in _stage_tensors(trainer).items():
        full = gather_full(t, dim, tp)  # every TP rank of replica 0 joins the gather
        if writer:
            state[key] = full.detach().to("cpu", copy=True)
    if place.rank == 0:
        state["train/step"] = torch.tensor(step)
    _agree(lambda: _clear(root, partial), f"preparing {partial}")
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True))
    except CheckpointException as exc:  # a BaseException: never let it pass as an interrupt
        raise CheckpointError(f"checkpoint of step {step} not written to {root}: {_failures(exc)}; "
                              "the earlier checkpoints there are intact") from None
    _agree(lambda: _publish(root, partial, final), f"publishing {final}")
    return final


def _agree(action, what: str) -> None:
    """Rank 0 runs ``action``; every rank learns whether it failed and raises the same error."""
    error = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as exc:
            error[0] = f"{what} failed: {exc}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(f"{error[0]}; the earlier checkpoints are intact")


def _clear(root: Path, partial: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if partial.exists():  # a save cut short earlier
        shutil.rmtree(partial)


def _publish(root: Path, partial: Path, final: Path) -> None:
    """Make ``partial`` the complete checkpoint ``final``, durably, and keep the newest KEEP."""
    fsync_dir(partial)  # the files' names (DCP fsynced their contents)
    if final.exists():  # the same step saved again (a resumed run): replace it whole
        old = root / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    fsync_dir(root)
    complete = sorted((d for d in root.glob("step-*") if _STEP_DIR.fullmatch(d.name)), key=lambda d: int(d.name[5:]))
    for old in complete[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def _failures(exc: CheckpointException) -> str:
    failures = getattr(exc, "failures", {}) or {}
    parts = []
    for rank, failure in sorted(failures.items())[:4]:
        error = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {type(error).__name__}: {error}")
    return "; ".join(parts) or str(exc)


def model_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The full model's tensors in a complete checkpoint, read in this process alone."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(checkpoint), f"{tmp}/full.pt")
        full = torch.load(f"{tmp}/full.pt", weights_only=True)
    return {k[len("model/"):]: v for k, v in full.items() if k.startswith("model/")}


def load_checkpoint(directory: str | Path, trainer: "PipelineTrainer") -> int:
    """Collective over all ranks: load this rank's cut of the newest complete checkpoint in
    ``directory`` (or of ``directory`` itself); returns its step."""
    directory = latest_checkpoint(directory)
    reader = _SafeReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    tp = trainer.groups.tp
    wanted: dict[str, torch.Tensor] = {"train/step": torch.tensor(0)}
    for name, _ in trainer.module.named_parameters():
        name = trainer.module.checkpoint_name(name)
        keys = [f"model/{name}"] + [f"optim/{name}/{k}" for k in _OPTIM_KEYS]
        if keys[0] not in metadata:
            raise KeyError(f"{directory}: the checkpoint has no {keys[0]!r}; it was written for another model")
        for key in keys:
            if key in metadata:  # no optimizer state before the first step
                wanted[key] = torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
    try:
        dcp.load(wanted, storage_reader=reader)
    except CheckpointException as exc:
        raise CheckpointError(f"checkpoint {directory} could not be read: {_failures(exc)}") from None
    optim: dict = {}
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
            name = trainer.module.checkpoint_name(name)
            full = wanted[f"model/{name}"]
            piece = cut(name, full, tp.size, tp.rank)
            if piece.shape != p.shape:
                raise ValueError(f"{directory}: {name} is {tuple(full.shape)} in the checkpoint, which cuts to "
                                 f"{tuple(piece.shape)} at tp={tp.size}; this stage expects {tuple(p.shape)}")
            p.copy_(piece)
            if f"optim/{name}/exp_avg" in wanted:
                optim[p] = {key: cut(name, wanted[f"optim/{name}/{key}"], tp.size, tp.rank).to(p.device, p.dtype).clone()
                            for key in ("exp_avg", "exp_avg_sq")}
                optim[p]["step"] = wanted[f"optim/{name}/step"].clone()
    trainer.load_optimizer_state(optim)
    return int(wanted["train/step"])
