"""A client's copy of its stage and the arithmetic of a task on it: forward, backward, the flat
parameter gradient, and (to emulate a slower chip) pacing that sleeps, never spins."""
from __future__ import annotations

import contextlib
import time

import torch


from .job import Job, flat_parameters


class StageCompute:
    """Stage ``stage`` of ``job`` on ``device``; ``emulate_flops``: the FLOP/s a task is paced to."""

    def __init__(self, job: Job, stage: int, device: str, emulate_flops: float | None):
        self.job, self.emulate_flops = job, emulate_flops
        self.spec = job.stages[stage]
        self.first, self.last = stage == 0, stage == len(job.stages) - 1
        self.device = torch.device(device)  # "dipu" computes on the emulated (or a real) accelerator
        self.module = job.stage_module(stage).to(self.device)
        self.params = flat_parameters(self.module)
        self.numel = sum(p.numel() for p in self.params)
        layers = self.spec.layers[1] - self.spec.layers[0]
        self.flops_per_sample = layers * 3 * job.spec.layer_forward_flops()

    def install(self, flat: torch.Tensor) -> None:
        """New parameters, as one flat vector."""
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat.to(self.device), self.params)

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        """A task's input on the device (a leaf whose gradient is wanted, past the first stage)."""
        x = x.to(self.device)
        return x if self.first else x.clone().requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def loss_sum(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage: the summed loss of the task's rows."""
        return self.module(x, targets.to(self.device)) * targets.numel()

    def backward(self, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor | None):
        """(input gradient or None, flat parameter gradient) of one task. Gradients go through
        ``.grad`` because the stage's linear layers accumulate their weight gradients there."""
        for p in self.params:
            p.grad = None
        torch.autograd.backward(y, None if grad is None else grad.to(self.device))
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params]).cpu()
        for p in self.params:
            p.grad = None
        return (None if self.first else x.grad.cpu()), flat

    @contextlib.contextmanager
    def paced(self, rows: tuple[int, int], fraction: float):
        """Emulates a slower chip: the block takes at least ``fraction`` of the task's training
        FLOPs at ``emulate_flops``, sleeping (never spinning) for the rest."""
        t0 = time.monotonic()
        yield
        if self.emulate_flops:
            rest = (rows[1] - rows[0]) * self.flops_per_sample * fraction / self.emulate_flops - (time.monotonic() - t0)
            if rest > 0:
                time.sleep(rest)
