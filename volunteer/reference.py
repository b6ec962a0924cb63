"""What a volunteer job must equal: the same model trained in one process, one optimizer step
per batch, on the same batches (``ditorch volunteer reference``; the tests' exactness oracle).
It shares nothing with the servers and clients but the job's description."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dimodel.datasets import step_batch

from .job import Job


def reference_run(job: Job) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """(loss per step, full-batch gradient per step by parameter name) of plain training.

    With delayed updates, step s's gradient is taken at the parameters of step s - 1 and applied
    to those of step s, as the servers' shards do."""
    family = job.family
    model = family.whole_model(job.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    data = job.training_tokens()
    losses, grads = [], []
    stale = None  # with delayed updates: the parameters the step before computed with
    for step in range(job.steps):
        tokens = step_batch(data, job.batch, job.seq, job.seed, step)
        opt.zero_grad()
        if job.delayed_updates and stale is not None:
            current = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(stale[n])
        logits = family.logits(model, tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        if job.delayed_updates:
            stale = {n: p.detach().clone() for n, p in model.named_parameters()} if stale is None else current
            if step > 0:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(current[n])
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads
