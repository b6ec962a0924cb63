"""The single-process reference of a plan's run: the same model, initialization, batches,
optimizer and clipping, on the CPU in fp32, with PyTorch's own modules throughout
(``nn.Linear``, ``F.cross_entropy``, ``clip_grad_norm_``), so it checks the pipeline runtime
rather than repeating it."""
from __future__ import annotations

import time

import torch

from dimodel.datasets import step_batch, text_corpus
from dimodel.llama import Llama
from heteropp.plan import Plan

from .stage_update import make_optimizer
from .trainer import TrainOptions, full_initialization, global_batch_size, model_config


def train_reference(plan: Plan, options: TrainOptions) -> tuple[list[float], Llama]:
    """Train for ``options.steps``; returns the per-step losses and the trained model."""
    from diutil.loss_log import LossLogger

    config = model_config(plan)
    model = Llama(config)
    model.load_state_dict(full_initialization(config, options.seed))
    optimizer = make_optimizer(model.parameters(), options.lr, options.weight_decay)
    data, _ = text_corpus()
    n, seq = global_batch_size(plan), plan.model.seq
    losses, start = [], time.perf_counter()
    log = LossLogger(options.log) if options.log else None
    try:
        for step in range(options.steps):
            loss = model.loss(step_batch(data, n, seq, options.seed, step))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if log is not None:
                log.log(step + 1, losses[-1], (step + 1) * n * seq)
            if options.progress and ((step + 1) % max(1, options.steps // 10) == 0 or step + 1 == options.steps):
                bar = "#" * (30 * (step + 1) // options.steps)
                rate = n * seq * len(losses) / (time.perf_counter() - start)
                print(f"  [{bar:<30}] reference step {step + 1:>4}/{options.steps}  loss {losses[-1]:.4f}  "
                      f"{rate:,.0f} tok/s", flush=True)
    finally:
        if log is not None:
            log.close()
    return losses, model
