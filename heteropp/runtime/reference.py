"""The single-process reference of a plan's run: the same model, initialization, batches,
optimizer and clipping, on the CPU in fp32, with PyTorch's own modules throughout
(``nn.Linear``, ``F.cross_entropy``, ``clip_grad_norm_``; for a Hugging Face model, its own
``*ForCausalLM``), so it checks the pipeline runtime rather than repeating it."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dimodel.datasets import step_batch
from heteropp.plan import Plan

from .model_family import model_family
from .stage_update import make_optimizer
from .trainer import TrainOptions, global_batch_size, held_out_batch, run_tokens


def train_reference(plan: Plan, options: TrainOptions) -> tuple[list[float], torch.nn.Module]:
    """Train for ``options.steps``; returns the per-step losses and the trained model (the
    project's ``Llama``, or the Hugging Face ``*ForCausalLM`` of the plan's config)."""
    from diutil.loss_log import LossLogger

    family = model_family(plan.model)
    model = family.whole_model(options.seed)
    optimizer = make_optimizer(model.parameters(), options.lr, options.weight_decay)
    data, held_out = run_tokens(plan, options)

    def batch_loss(tokens: torch.Tensor) -> torch.Tensor:
        logits = family.logits(model, tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def held_out_loss() -> float:
        with torch.no_grad():
            return sum(batch_loss(held_out_batch(held_out, plan, options, i)).item()
                       for i in range(options.eval_batches)) / options.eval_batches

    n, seq = global_batch_size(plan), plan.model.seq
    losses, start = [], time.perf_counter()
    log = LossLogger(options.log) if options.log else None
    try:
        for step in range(options.steps):
            loss = batch_loss(step_batch(data, n, seq, options.seed, step))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            evaluate = options.eval_every and ((step + 1) % options.eval_every == 0 or step + 1 == options.steps)
            if log is not None:
                log.log(step + 1, losses[-1], (step + 1) * n * seq, held_out_loss() if evaluate else None)
            if options.progress and ((step + 1) % max(1, options.steps // 10) == 0 or step + 1 == options.steps):
                bar = "#" * (30 * (step + 1) // options.steps)
                rate = n * seq * len(losses) / (time.perf_counter() - start)
                print(f"  [{bar:<30}] reference step {step + 1:>4}/{options.steps}  loss {losses[-1]:.4f}  "
                      f"{rate:,.0f} tok/s", flush=True)
    finally:
        if log is not None:
            log.close()
    return losses, model
