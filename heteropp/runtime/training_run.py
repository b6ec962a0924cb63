"""A training run of one rank: every step of its trainer, with rank 0 logging the loss (and the
held-out loss every ``eval_every`` steps), showing progress and writing the trace; checkpoints every ``save_every`` steps and at the end; replicas
checked every ``check_replicas`` steps; and a hook after each step (a Di-PS outer step) that may
end the run."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from diutil.loss_log import LossLogger

from .trace import write_chrome_trace
from .trainer import PipelineTrainer, global_batch_size


class TrainingRun:
    """The run of ``trainer``'s options (steps, log, progress, save, trace, check_replicas)."""

    def __init__(self, trainer: PipelineTrainer):
        self.trainer, self.options, self.plan = trainer, trainer.options, trainer.plan

    def run(self, after_step: Callable[[int], bool] | None = None) -> list[float]:
        """All steps; returns the losses. ``after_step(step)``, called on every rank after each
        step, ends the run early by returning True on every rank."""
        o, trainer = self.options, self.trainer
        log = LossLogger(o.log, append=trainer.start_step > 0) if o.log and dist.get_rank() == 0 else None
        tokens_per_step = global_batch_size(self.plan) * self.plan.model.seq
        losses, start = [], time.perf_counter()
        try:
            for step in range(trainer.start_step, o.steps):
                loss = trainer.step(step)
                losses.append(loss)
                evaluate = o.eval_every and ((step + 1) % o.eval_every == 0 or step + 1 == o.steps)
                val_loss = trainer.evaluate() if evaluate else None
                if log is not None:
                    log.log(step + 1, loss, (step + 1) * tokens_per_step, val_loss)
                if o.progress and dist.get_rank() == 0:
                    self._progress(step + 1, loss, tokens_per_step * len(losses) / (time.perf_counter() - start),
                                   val_loss)
                if o.save and o.save_every and (step + 1) % o.save_every == 0:
                    trainer.save(o.save, step + 1)
                stop = after_step is not None and after_step(step)
                if o.check_replicas and ((step + 1) % o.check_replicas == 0 or stop or step + 1 == o.steps):
                    trainer.check_replicas()
                if stop:
                    break
        finally:
            if log is not None:
                log.close()
        if o.save:
            trainer.save(o.save, o.steps)
        if o.trace:
            self._write_trace(o.trace)
        return losses

    def _progress(self, step: int, loss: float, rate: float, val_loss: float | None) -> None:
        n = self.options.steps
        tty = sys.stdout.isatty()
        if not tty and step != n and step % max(1, n // 10):
            return  # a log file gets every tenth of the run, a terminal every step
        bar = "#" * (30 * step // n)
        end = "\n" if step == n or not tty else "\r"
        val = f"  held-out {val_loss:.4f}" if val_loss is not None else ""
        print(f"  [{bar:<30}] step {step:>4}/{n}  loss {loss:.4f}{val}  {rate:,.0f} tok/s", end=end, flush=True)

    def _write_trace(self, path: Path) -> None:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self.trainer.trace.events(), gathered, dst=0)
        if dist.get_rank() == 0:
            names = [f"{s.chip} tp{s.tp}" + (" recompute" if s.recompute else "") for s in self.plan.stages]
            write_chrome_trace(path, [e for evs in gathered for e in evs], names)
