"""What a follower keeps on disk: its index, its sealed pushes (one file each, until a checkpoint
covers the round that consumed it) and its checkpoints (the newest ``keep`` of them). Every file
is written beside its final name and renamed over it, so a reader never sees half of one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class FollowerDisk:
    """A follower's directory: ``follower.json``, ``pushes/<id>.pt``, ``ckpt-<version>.pt``."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        (self.dir / "pushes").mkdir(parents=True, exist_ok=True)

    # -- the follower's index among the leader's followers
    def read_index(self) -> int | None:
        meta = self.dir / "follower.json"
        return json.loads(meta.read_text())["index"] if meta.exists() else None

    def write_index(self, index: int) -> None:
        _write(self.dir / "follower.json", lambda tmp: tmp.write_text(json.dumps({"index": index})))

    # -- sealed pushes
    def save_push(self, push: str, base: int, params: dict[str, torch.Tensor]) -> None:
        _write(self._push(push), lambda tmp: torch.save({"base": base, "params": params}, tmp))

    def load_pushes(self) -> dict[str, dict[str, Any]]:
        """push id -> {base, params} of every push on disk."""
        out = {}
        for f in sorted((self.dir / "pushes").glob("*.pt")):
            rec = torch.load(f, weights_only=True)
            out[f.stem] = {"base": int(rec["base"]), "params": rec["params"]}
        return out

    def delete_push(self, push: str) -> None:
        self._push(push).unlink(missing_ok=True)

    def _push(self, push: str) -> Path:
        return self.dir / "pushes" / f"{push}.pt"

    # -- checkpoints
    def checkpoints(self) -> list[Path]:
        return sorted(self.dir.glob("ckpt-*.pt"))

    def latest_version(self) -> int:
        """The version of the newest checkpoint (0 without one)."""
        ckpts = self.checkpoints()
        return int(ckpts[-1].stem.split("-")[1]) if ckpts else 0

    def save_checkpoint(self, snapshot: dict[str, Any], keep: int) -> None:
        """Write ``snapshot`` (its ``version`` names the file), then delete all but the newest ``keep``."""
        path = self.dir / f"ckpt-{snapshot['version']:08d}.pt"
        _write(path, lambda tmp: torch.save(snapshot, tmp))
        for old in self.checkpoints()[:-keep]:
            old.unlink(missing_ok=True)


def _write(path: Path, write) -> None:
    tmp = path.with_suffix(".tmp")
    write(tmp)
    tmp.replace(path)
