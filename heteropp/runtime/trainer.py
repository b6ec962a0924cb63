"""Training one model over a HeteroPP plan: each rank builds its stage on its chip and runs its
stage's action list every step (``PipelineTrainer``), then updates its stage
(``stage_update.StageUpdate``: gradients reduced over its DP group, clipped by the global norm
across all stages, the optimizer stepped); ``training_run.TrainingRun`` runs the steps.

Call after ``torch.distributed.init_process_group`` (``ditorch.train`` does both).
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dimodel.datasets import step_batch, training_tokens
from heteropp.plan import Plan, PlanError
from heteropp.plan_schedules import SCHEDULES, plan_schedules
from heteropp.schedule import Schedule, forward_only

from .boundary import RESHARD_MODES, StageBoundary
from .executor import StageExecutor
from .layout import PipelineLayout, RankPlace, StageGroups
from .link_turns import LinkTurns
from .model_family import HFFamily, LlamaFamily, model_family
from .stage_model import PipelineStage
from .stage_update import StageUpdate
from .trace import TraceRecorder, now

PRECISIONS = ("bf16", "fp32")


@dataclasses.dataclass
class TrainOptions:
    """What a run does beyond the plan. The reference run (reference.py) reads the same."""

    steps: int = 50
    lr: float = 1e-3
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    precision: str = "bf16"  # bf16 autocast on the chips, or fp32
    schedule: str | None = None  # a name in SCHEDULES or a torch-style CSV; default: the plan's
    reshard: str = "srag"
    sequence_parallel: bool = True  # what the plan's cost model assumes
    memory_scale: float | None = None  # default: $DITORCH_MEMORY_SCALE
    log: Path | None = None
    trace: Path | None = None
    data: Path | None = None  # a token file (dimodel.token_file); default: the built-in byte corpus
    data_dtype: str | None = None  # the token file's dtype; default: its sidecar's, else uint16
    save: Path | None = None
    save_every: int = 0
    resume: Path | None = None
    zero1: bool = False
    check_replicas: int = 0  # every N steps and at the end, check DP replicas hold equal parameters
    eval_every: int = 0  # every N steps and at the end, the held-out loss (0: never)
    eval_batches: int = 1  # global batches of held-out tokens per evaluation (the same ones each time)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: expected at least 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: expected one of {PRECISIONS}")
        if self.reshard not in RESHARD_MODES:
            raise ValueError(f"reshard={self.reshard!r}: expected one of {RESHARD_MODES}")
        if not self.lr > 0 or not self.clip > 0:
            raise ValueError(f"lr={self.lr}, clip={self.clip}: both must be > 0")
        if self.check_replicas < 0:
            raise ValueError(f"check_replicas={self.check_replicas}: expected a step count >= 0 (0: never)")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"eval_every={self.eval_every}, eval_batches={self.eval_batches}: expected a step count "
                             f">= 0 (0: never) and at least one batch")


def run_tokens(plan: Plan, options: TrainOptions):
    """(train, held-out): the tokens the run's batches and its evaluations are drawn from
    (checked against the model's vocabulary)."""
    train, held_out = training_tokens(options.data, options.data_dtype, plan.model.vocab)
    if options.eval_every and len(held_out) < plan.model.seq + 1:
        raise ValueError(f"the held-out split has {len(held_out)} tokens, fewer than one sequence of "
                         f"{plan.model.seq + 1}; give more data or no --eval-every")
    return train, held_out


def held_out_batch(held_out, plan: Plan, options: TrainOptions, index: int):
    """Evaluation batch ``index`` (0 .. eval_batches - 1): the same tokens at every evaluation."""
    return step_batch(held_out, global_batch_size(plan), plan.model.seq, options.seed, index)


def global_batch_size(plan: Plan) -> int:
    """Sequences per step: micro-batches of every DP replica."""
    return plan.num_microbatches * plan.dp * plan.micro_batch_size


def check_stage_memory(plan: Plan, stage: int, capacity_bytes: int, scale: float) -> None:
    """Refuse a stage whose planned peak does not fit this chip's memory (as emulated: the
    profile's capacity times the memory scale)."""
    need = plan.stage_memory(stage)
    if need > capacity_bytes:
        s = plan.stages[stage]
        raise PlanError(f"stage {stage} (chip {s.chip}, tp {s.tp}, {s.layers} layers, recompute {s.recompute}) needs "
                        f"{need / 2**20:.2f} MiB per chip by the plan's estimate but the chip holds "
                        f"{capacity_bytes / 2**20:.2f} MiB (memory scale {scale:g})")


def run_time_scale(plan: Plan) -> float:
    """The emulation time scale of this run: the one the plan's chips were profiled under, so the
    run is as slow as the plan's layer times say ($DITORCH_TIME_SCALE may restate it, not change it)."""
    from diutil.datasheets.chips import TIME_SCALE_ENV, time_scale_from_env

    profiled, asked = plan.cluster.emulated_time_scale, time_scale_from_env()
    if profiled is not None and asked is not None and asked != profiled:
        raise PlanError(f"{TIME_SCALE_ENV}={asked:g} but the plan's chips were profiled at time scale {profiled:g}; "
                        f"run at the profiles' scale or profile again with --time-scale {asked:g}")
    return profiled if profiled is not None else asked or 1.0


def check_plan_fits(plan: Plan, options: TrainOptions) -> None:
    """Every stage's chip can be emulated here and holds the stage, its TP size splits the model,
    and each boundary's resharding splits the sequence. Each rank checks all stages, so a bad
    plan stops every rank with the same message before any group is made."""
    from diutil.datasheets.chips import memory_scale_from_env, resolve

    from .boundary import routes

    scale = memory_scale_from_env() if options.memory_scale is None else options.memory_scale
    run_time_scale(plan)
    if plan.model.weight_dtype != "fp32":
        raise PlanError(f"the plan's model has weight_dtype {plan.model.weight_dtype!r}, whose memory this runtime "
                        f"does not have (it keeps fp32 weights under bf16 autocast); plan with weight_dtype fp32")
    family = model_family(plan.model)
    for i, s in enumerate(plan.stages):
        try:
            profile = resolve(s.chip)
            family.check_tp(s.tp, f"stage {i} ({s.chip})")
        except ValueError as exc:
            raise PlanError(f"stage {i}: {exc}" if not str(exc).startswith("stage") else str(exc)) from None
        check_stage_memory(plan, i, profile.capacity_bytes(scale), scale)
        if i + 1 < plan.num_stages:
            pieces, _ = routes(range(s.tp), range(plan.stages[i + 1].tp), options.reshard)
            if plan.model.seq % pieces:
                raise PlanError(f"stages {i}-{i + 1}: {options.reshard} resharding cuts the sequence into {pieces} "
                                f"pieces, which does not divide seq={plan.model.seq}")


class PipelineTrainer:
    """This rank's stage of a plan-driven training run: its place, chip, module, boundaries,
    action list and update; ``step`` runs one training step."""

    def __init__(self, plan: Plan, options: TrainOptions):
        import ditorch_ext

        self.plan, self.options = plan, options
        self.layout = PipelineLayout(plan)
        self.layout.check_world(dist.get_world_size())
        self.place: RankPlace = self.layout.place(dist.get_rank())
        self.stage_plan = plan.stages[self.place.stage]
        self.family: LlamaFamily | HFFamily = model_family(plan.model)
        check_plan_fits(plan, options)
        ditorch_ext.set_chip(self.stage_plan.chip, memory_scale=options.memory_scale, time_scale=run_time_scale(plan))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("dipu", local % torch.dipu.device_count())
        torch.dipu.set_device(self.device)
        self.schedule = plan_schedules(plan, options.schedule)[self.place.dp_index]
        self.groups = StageGroups.create(self.layout, self.place, tied_embeddings=self.family.tied)
        self.module = self._build_module()
        self.update = StageUpdate(self.module, self.groups, self.place, plan.dp, options.lr, options.weight_decay,
                                  options.clip, options.zero1, self.device)
        self.trace = TraceRecorder(self.place.rank, self.place.stage, enabled=options.trace is not None)
        self.boundaries = self._boundaries()
        self.executor = StageExecutor(
            self.module, self.schedule.actions[self.place.stage], *self.boundaries,
            recompute=self.stage_plan.recompute, device=self.device,
            loss_scale=1.0 / global_batch_size(plan),
            autocast_dtype=torch.bfloat16 if options.precision == "bf16" else None, trace=self.trace,
            blocking=self.schedule.blocking_p2p, turns=self._link_turns())
        self.data, self.held_out = run_tokens(plan, options)
        self.evaluator = StageExecutor(
            self.module, forward_only(plan.num_stages, plan.num_microbatches).actions[self.place.stage],
            self.executor.prev, self.executor.next, recompute=True, device=self.device, loss_scale=1.0,
            autocast_dtype=self.executor.autocast_dtype)
        self.start_step = 0

    # -- set-up ------------------------------------------------------------------------------
    def _build_module(self) -> PipelineStage:
        i, S = self.place.stage, self.plan.num_stages
        with torch.device(self.device):
            module = self.family.stage(self.stage_plan.layer_range, i == 0, i == S - 1, self.groups.tp,
                                       sequence_parallel=self.options.sequence_parallel)
        module.load_full(self.family.initial_state(self.options.seed, [n for n, _ in module.named_parameters()]))
        return module

    def _boundaries(self) -> tuple[StageBoundary | None, StageBoundary | None]:
        i, d, S = self.place.stage, self.place.dp_index, self.plan.num_stages
        shape = (self.plan.micro_batch_size, self.plan.model.seq, self.plan.model.hidden)

        def boundary(lo: int) -> StageBoundary:
            return StageBoundary(self.layout.tp_ranks(lo, d), self.layout.tp_ranks(lo + 1, d), self.place.rank,
                                 self.groups.tp, shape, torch.float32, self.device, self.options.reshard,
                                 sharded=self.options.sequence_parallel)

        return (boundary(i - 1) if i > 0 else None), (boundary(i) if i < S - 1 else None)

    def _link_turns(self) -> dict[str, LinkTurns]:
        """This rank's turns on the schedule's coordinated boundaries, per direction it sends
        over one: the chain of the ranks of its stage and TP index, one per replica."""
        i, turns = self.place.stage, {}
        if self.plan.dp < 2:
            return turns
        chain = [self.layout.rank_of(i, d, self.place.tp_index) for d in range(self.plan.dp)]
        prev, next_ = self.boundaries
        for direction, boundary, side in (("F", i, next_), ("B", i - 1, prev)):
            if boundary in self.schedule.coordinated and side is not None:
                turns[direction] = LinkTurns(chain, self.place.dp_index, self.plan.num_microbatches, direction,
                                             lambda mb, pieces, side=side, d=direction: side.post(d, mb, pieces),
                                             self._serialize_s(boundary))
        return turns

    def _serialize_s(self, boundary: int):
        """How long the emulated link of ``boundary`` takes to put out n bytes (None where
        dicomm does not emulate the links: ditorch.train sets DICOMM_LINKS when it does)."""
        from heteropp.placement import boundary_link

        if not os.environ.get("DICOMM_LINKS"):
            return None
        bandwidth = boundary_link(self.plan, boundary, run_time_scale(self.plan)).bandwidth
        return lambda nbytes: nbytes / bandwidth

    # -- one step ----------------------------------------------------------------------------
    def _microbatches(self, batch: torch.Tensor) -> tuple[list | None, list | None]:
        """This replica's micro-batches of the global ``batch``: token ids on the first stage,
        targets on the last."""
        M, mbs = self.plan.num_microbatches, self.plan.micro_batch_size
        rows = batch[self.place.dp_index * M * mbs:(self.place.dp_index + 1) * M * mbs]
        mbatches = [rows[m * mbs:(m + 1) * mbs] for m in range(M)]
        tokens = [b[:, :-1].to(self.device) for b in mbatches] if self.module.is_first else None
        targets = [b[:, 1:].to(self.device) for b in mbatches] if self.module.is_last else None
        return tokens, targets

    def _bytes_sent(self) -> int:
        return sum(b.bytes_sent for b in (self.executor.prev, self.executor.next) if b is not None)

    def optimizer_state(self) -> dict:
        """AdamW's state per parameter of this rank (gathered over DP under ZeRO-1: collective)."""
        return self.update.state()

    def load_optimizer_state(self, state: dict) -> None:
        """Install per-parameter AdamW state (after the parameters themselves were loaded)."""
        self.update.load_state(state)

    def step(self, step: int) -> float:
        """Run one training step; returns the global batch's mean loss (on every rank)."""
        cpu_start, sent_start = time.process_time(), self._bytes_sent()
        batch = step_batch(self.data, global_batch_size(self.plan), self.plan.model.seq, self.options.seed, step)
        tokens, targets = self._microbatches(batch)
        losses = self.executor.run(step, tokens, targets)
        t_update = now()
        loss_sum = sum(losses) if self.module.is_last and self.place.tp_index == 0 else 0.0
        loss_total = self.update.apply(loss_sum)
        torch.dipu.synchronize()
        # the step's CPU time and boundary bytes ride on its UPDATE event (benchmarks read them)
        self.trace.record(f"{self.place.stage}UPDATE", "UPDATE", t_update, now(), step=step,
                          cpu_s=time.process_time() - cpu_start, p2p_bytes=self._bytes_sent() - sent_start,
                          peak_bytes=torch.dipu.max_memory_allocated(self.device))
        return loss_total / (self.plan.num_microbatches * self.plan.dp)

    def evaluate(self) -> float:
        """The mean loss over the held-out batches, forward only (collective over the job)."""
        total = 0.0
        with torch.no_grad():
            for index in range(self.options.eval_batches):
                tokens, targets = self._microbatches(held_out_batch(self.held_out, self.plan, self.options, index))
                losses = self.evaluator.run(index, tokens, targets)
                if self.module.is_last and self.place.tp_index == 0:
                    total += sum(losses)
        summed = torch.tensor(total, dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return summed.item() / (self.options.eval_batches * self.plan.num_microbatches * self.plan.dp)

    # -- the run -----------------------------------------------------------------------------
    def check_replicas(self) -> None:
        """Raise ReplicaDivergence if this stage's DP replicas hold different parameters (after
        the step's update and any outer step); collective over every DP group."""
        from .replicas import check_replicas

        check_replicas(self.module, self.groups.dp, f"stage {self.place.stage} TP rank {self.place.tp_index}")

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, directory: Path, step: int) -> Path:
        """Collective: the complete checkpoint ``directory/step-<step>`` (checkpoint.py); for a
        Hugging Face model also ``directory/hf``, the model in its own format (rank 0 writes it)."""
        from .checkpoint import model_tensors, save_checkpoint

        final = save_checkpoint(directory, step, self)
        if isinstance(self.family, HFFamily):
            if dist.get_rank() == 0:
                self.family.export(Path(directory) / "hf", model_tensors(final))
            dist.barrier()
        return final

    def resume(self, directory: Path) -> int:
        """Load a checkpoint written under any plan (``directory`` itself, or the newest complete
        one in it); training continues after its step."""
        from .checkpoint import load_checkpoint

        self.start_step = load_checkpoint(directory, self)
        return self.start_step
