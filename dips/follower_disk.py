"""What a follower keeps on disk: its index, its sealed pushes (one file each, until every kept
checkpoint covers the round that consumed it) and its checkpoints (the newest ``keep`` of them).

Every file is whole or absent after a crash or a full disk (``diutil.durable``: written aside,
fsynced, renamed). Should the newest checkpoint still be unreadable (a disk that lies about its
flushes), the follower starts from the newest one that reads, and the pushes applied since that
one are still on disk because a push is retired only once the *oldest* kept checkpoint covers it.
"""
from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from diutil.durable import write_atomic, write_text_atomic

log = logging.getLogger("dips.follower")


class FollowerDisk:
    """A follower's directory: ``follower.json``, ``pushes/<id>.pt``, ``ckpt-<version>.pt``."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        (self.dir / "pushes").mkdir(parents=True, exist_ok=True)
        self._found: tuple[Path, dict[str, Any]] | None = None  # read by latest_version(), not yet taken

    # -- the follower's index among the leader's followers
    def read_index(self) -> int | None:
        meta = self.dir / "follower.json"
        return json.loads(meta.read_text())["index"] if meta.exists() else None

    def write_index(self, index: int) -> None:
        write_text_atomic(self.dir / "follower.json", json.dumps({"index": index}))

    # -- sealed pushes
    def save_push(self, push: str, base: int, tensors: dict[str, torch.Tensor], form: str = "params",
                  sqnorm: float | None = None) -> None:
        """A sealed push: its parameters (``form`` "params") or decoded pseudo-gradient ("delta",
        with the squared norm its cluster reported)."""
        write_atomic(self._push(push), lambda tmp: torch.save({"base": base, form: tensors, "sqnorm": sqnorm}, tmp))

    def load_pushes(self) -> dict[str, dict[str, Any]]:
        """push id -> {base, params or delta} of every push on disk that reads whole (one that
        does not was never acknowledged: its Seal failed)."""
        out = {}
        for f in sorted((self.dir / "pushes").glob("*.pt")):
            try:
                rec = torch.load(f, weights_only=True)
                form = "delta" if "delta" in rec else "params"
                out[f.stem] = {"base": int(rec["base"]), form: rec[form], "sqnorm": rec.get("sqnorm")}
            except _UNREADABLE as exc:
                log.error("sealed push file %s is unreadable (%s); it is skipped", f, exc)
        return out

    def delete_push(self, push: str) -> None:
        self._push(push).unlink(missing_ok=True)

    def _push(self, push: str) -> Path:
        return self.dir / "pushes" / f"{push}.pt"

    # -- checkpoints
    def checkpoints(self) -> list[Path]:
        return sorted(self.dir.glob("ckpt-*.pt"))

    @staticmethod
    def version_of(path: Path) -> int:
        return int(path.stem.split("-")[1])

    def latest_version(self) -> int:
        """The version of the newest checkpoint that reads (0 without one)."""
        self._found = self.load_latest_checkpoint()
        return int(self._found[1]["version"]) if self._found else 0

    def load_latest_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that reads whole, and its path (None without one); an unreadable
        newer one is reported and left for inspection."""
        if self._found is not None:
            found, self._found = self._found, None
            return found
        for path in reversed(self.checkpoints()):
            try:
                return path, torch.load(path, weights_only=True)
            except _UNREADABLE as exc:
                log.error("checkpoint %s is unreadable (%s); trying an older one", path, exc)
        return None

    def oldest_kept_version(self) -> int:
        """The version of the oldest kept checkpoint (-1 without one)."""
        ckpts = self.checkpoints()
        return self.version_of(ckpts[0]) if ckpts else -1

    def save_checkpoint(self, snapshot: dict[str, Any], keep: int) -> None:
        """Write ``snapshot`` (its ``version`` names the file), then delete all but the newest
        ``keep``. Raises OSError (the disk is full, ...) with nothing changed on disk."""
        path = self.dir / f"ckpt-{snapshot['version']:08d}.pt"
        write_atomic(path, lambda tmp: torch.save(snapshot, tmp))
        for old in self.checkpoints()[:-keep]:
            old.unlink(missing_ok=True)


# What torch.load raises on a torn or foreign file.
_UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError)
