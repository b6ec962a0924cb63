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
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp

from .stage_model import cut, gather_full, shard_dim

if TYPE_CHECKING:
    from .trainer import PipelineTrainer

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _stage_tensors(trainer: "PipelineTrainer") -> dict[str, tuple[torch.Tensor, int | None]]:
    """Every tensor this rank holds, under its checkpoint key, with the dimension TP splits."""
    state = trainer.optimizer_state()
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for name, p in trainer.module.named_parameters():
        dim = shard_dim(name)
        out[f"model/{name}"] = (p.detach(), dim)
        for key in _OPTIM_KEYS:
            if key in state.get(p, {}):
                value = state[p][key]
                out[f"optim/{name}/{key}"] = (value, dim if value.dim() > 0 else None)
    return out


def save_checkpoint(directory: str | Path, step: int, trainer: "PipelineTrainer") -> None:
    """Collective over all ranks: write the full model and optimizer state at ``step``."""
    place, tp = trainer.place, trainer.groups.tp
    writer = place.dp_index == 0 and place.tp_index == 0
    state: dict[str, object] = {}
    for key, (t, dim) in _stage_tensors(trainer).items():
        full = gather_full(t, dim, tp)  # every TP rank of replica 0 joins the gather
        if writer:
            state[key] = full.detach().to("cpu", copy=True)
    if place.rank == 0:
        state["train/step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=str(directory))


def load_checkpoint(directory: str | Path, trainer: "PipelineTrainer") -> int:
    """Collective over all ranks: load this rank's cut of the checkpoint; returns its step."""
    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(f"{directory}: not a checkpoint (no .metadata); expected a directory written by --save")
    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    tp = trainer.groups.tp
    wanted: dict[str, torch.Tensor] = {"train/step": torch.tensor(0)}
    for name, _ in trainer.module.named_parameters():
        keys = [f"model/{name}"] + [f"optim/{name}/{k}" for k in _OPTIM_KEYS]
        if keys[0] not in metadata:
            raise KeyError(f"{directory}: the checkpoint has no {keys[0]!r}; it was written for another model")
        for key in keys:
            if key in metadata:  # no optimizer state before the first step
                wanted[key] = torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
    dcp.load(wanted, checkpoint_id=str(directory))
    optim: dict = {}
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
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
