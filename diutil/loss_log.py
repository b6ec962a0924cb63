"""A tiny training-loss logger (JSON lines ``{"step", "loss", "tokens"}``, and ``"val_loss"`` at
the steps that measured a held-out loss) and its reader."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, TextIO


class LossLogger:
    """Append one JSON line per training step to ``path``.

    Each line is flushed as written, so a run that dies keeps its losses. ``append=False``
    (default) starts a fresh file. Usable as a context manager (closes the file).
    """

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Optional[TextIO] = open(self.path, "a" if append else "w")

    def log(self, step: int, loss: float, tokens: int, val_loss: float | None = None) -> None:
        """Record ``loss`` (a float or a one-element tensor) at ``step`` after ``tokens`` tokens,
        and the held-out ``val_loss`` when the step measured one."""
        if self._file is None:
            raise ValueError(f"LossLogger({str(self.path)!r}) is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"LossLogger.log: step must be a non-negative int, got {step!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"LossLogger.log: tokens must be a non-negative int, got {tokens!r}")
        value = float(loss)  # accepts 0-d tensors and numpy scalars
        if not math.isfinite(value):
            raise ValueError(f"LossLogger.log: loss at step {step} is {value}; expected a finite number")
        record = {"step": step, "loss": value, "tokens": tokens}
        if val_loss is not None:
            record["val_loss"] = float(val_loss)
            if not math.isfinite(record["val_loss"]):
                raise ValueError(f"LossLogger.log: val_loss at step {step} is {record['val_loss']}; expected a finite number")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "LossLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_losses(path: str | os.PathLike) -> dict[int, float]:
    """Read a loss log into ``{step: loss}`` (in file order).

    Raises ``ValueError`` naming the file and line for: an empty file, a line that is not a
    JSON object with an integer ``step`` and numeric ``loss``, a NaN/inf loss, a repeated step.
    Blank lines are ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such loss log")
    losses: dict[int, float] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not a JSON line ({exc.msg}): {line.strip()[:80]!r}") from None
            if not isinstance(record, dict) or "step" not in record or "loss" not in record:
                raise ValueError(f"{where}: expected an object with 'step' and 'loss', got {line.strip()[:80]!r}")
            step, loss = record["step"], record["loss"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"{where}: step must be a non-negative integer, got {step!r}")
            if isinstance(loss, bool) or not isinstance(loss, (int, float)):
                raise ValueError(f"{where}: loss must be a number, got {loss!r}")
            if not math.isfinite(loss):
                raise ValueError(f"{where}: loss at step {step} is {loss}; the run diverged or logged a bad value")
            if step in losses:
                raise ValueError(f"{where}: step {step} appears twice")
            losses[step] = float(loss)
    if not losses:
        raise ValueError(f"{path}: empty loss log (no records)")
    return losses
