"""The paper's time model (section 3.3): a stage's data-parallel time (Equation 1), the pipeline
time (Equation 2, and with the pipeline's fill) and the approximation clustering uses before
stages have members (Equation 3).

Units: samples of the batch, FLOP/s, bytes, seconds. A micro-batch of B/d samples is split over a
stage's participants in proportion to their compute; participant i gets w_i samples.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .devices import Fleet


@dataclasses.dataclass(frozen=True)
class Workload:
    """One batch: ``batch`` samples in ``microbatches`` micro-batches over ``layers`` layers; a
    sample costs ``flops_per_sample_layer`` per layer (forward and backward) and sends
    ``boundary_bytes_per_sample`` between stages (the paper's t)."""

    batch: int
    microbatches: int
    layers: int
    flops_per_sample_layer: float
    boundary_bytes_per_sample: float
    layer_state_bytes: float = 0.0  # parameters, gradients and optimizer state of one layer

    def __post_init__(self) -> None:
        for f in ("batch", "microbatches", "layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Workload.{f} must be a positive integer, got {v!r}")
        if self.batch % self.microbatches:
            raise ValueError(f"batch={self.batch} does not split into {self.microbatches} equal micro-batches")
        if not (self.flops_per_sample_layer > 0 and self.boundary_bytes_per_sample > 0):
            raise ValueError("flops_per_sample_layer and boundary_bytes_per_sample must be positive")

    @property
    def microbatch_samples(self) -> int:
        return self.batch // self.microbatches

    @property
    def microbatch_bytes(self) -> float:
        """The paper's t_s: activations (or gradients) of one micro-batch between two stages."""
        return self.microbatch_samples * self.boundary_bytes_per_sample

    @classmethod
    def for_model(cls, model: str, batch: int, microbatches: int, seq: int | None = None) -> "Workload":
        """The workload of a model file (a YAML of the project's LLaMA, ``examples/configs/*.yaml``,
        or a Hugging Face config.json or model directory); fp32 boundaries."""
        from heteropp.model_spec import ModelSpec

        spec = ModelSpec.load(model, seq=seq)
        # fp32 parameters and gradients, and AdamW's two moments: 16 bytes per parameter
        return cls(batch, microbatches, spec.n_layers, 3.0 * spec.layer_forward_flops(), 4.0 * spec.seq * spec.hidden,
                   16.0 * spec.params_per_layer)


@dataclasses.dataclass(frozen=True)
class StageMembers:
    """Who serves and computes in one stage (indices into the fleet), and its layers."""

    frontal: tuple[int, ...]
    backward: tuple[int, ...]
    clients: tuple[int, ...]
    layers: int

    @property
    def reliable(self) -> tuple[int, ...]:
        return self.frontal + self.backward


def link_time(delay: float, bandwidth: float, nbytes: float) -> float:
    """alpha + t / beta."""
    return delay + nbytes / bandwidth


def stage_time(fleet: Fleet, work: Workload, stage: StageMembers) -> float:
    """Equation 1, DT_k: the slowest participant's receive + compute + send for one micro-batch.

    Every device of the stage computes (servers are collocated with a client); a client takes its
    input from the frontal server it reaches fastest and sends to the fastest backward server, as
    the paper prescribes; a server's own side of that trip is local and costs nothing.
    """
    members = [("s", j) for j in stage.reliable] + [("u", i) for i in stage.clients]
    flops = np.array([(fleet.reliable if kind == "s" else fleet.unreliable)[i].flops for kind, i in members])
    share = work.microbatch_samples * flops / flops.sum()
    worst = 0.0
    for (kind, i), w, c in zip(members, share, flops):
        nbytes = w * work.boundary_bytes_per_sample
        if kind == "u":
            delay, bw = fleet.unreliable_delay[i], fleet.unreliable_bandwidth[i]
            recv = min(link_time(delay[j], bw[j], nbytes) for j in stage.frontal)
            send = min(link_time(delay[j], bw[j], nbytes) for j in stage.backward)
        else:
            delay, bw = fleet.reliable_delay, fleet.reliable_bandwidth
            recv = 0.0 if i in stage.frontal else min(link_time(delay[j, i], bw[j, i], nbytes) for j in stage.frontal)
            send = 0.0 if i in stage.backward else min(link_time(delay[i, j], bw[i, j], nbytes) for j in stage.backward)
        worst = max(worst, recv + send + w * stage.layers * work.flops_per_sample_layer / c)
    return worst


def group_link_time(fleet: Fleet, senders: Sequence[int], receivers: Sequence[int], nbytes: float) -> float:
    """alpha + t_s / beta between two groups of reliable devices, with alpha and beta the means
    over every (sender, receiver) pair."""
    delay = fleet.reliable_delay[np.ix_(senders, receivers)].mean()
    bw = fleet.reliable_bandwidth[np.ix_(senders, receivers)].mean()
    return link_time(delay, bw, nbytes)


def pipeline_time(fleet: Fleet, work: Workload, stages: Sequence[StageMembers]) -> float:
    """Equation 2: d * max_k (forward link into k + backward link into k + DT_k). Activations go
    from stage k-1's backward servers to stage k's frontal servers; gradients return from stage
    k+1's frontal servers to stage k's backward servers."""
    worst = 0.0
    for k, stage in enumerate(stages):
        fwd = group_link_time(fleet, stages[k - 1].backward, stage.frontal, work.microbatch_bytes) if k > 0 else 0.0
        bwd = (group_link_time(fleet, stages[k + 1].frontal, stage.backward, work.microbatch_bytes)
               if k + 1 < len(stages) else 0.0)
        worst = max(worst, fwd + bwd + stage_time(fleet, work, stage))
    return work.microbatches * worst


def pipeline_makespan(fleet: Fleet, work: Workload, stages: Sequence[StageMembers]) -> float:
    """Equation 2 with the pipeline's fill and drain: d + K - 1 slots of the slowest stage's term
    where Equation 2 counts d. The two agree when d is far above K (the paper's 128
    micro-batches of 4); with a few micro-batches the K - 1 slots decide between a shallow and a
    deep pipeline."""
    return pipeline_time(fleet, work, stages) * (work.microbatches + len(stages) - 1) / work.microbatches


def approximate_stage_time(fleet: Fleet, work: Workload, stages: int) -> float:
    """Equation 3: DT_k ~ B |H| / (d p sum C_s), the balanced share of the whole reliable group."""
    total = sum(d.flops for d in fleet.reliable)
    return work.microbatch_samples * work.layers * work.flops_per_sample_layer / (stages * total)


def approximate_pipeline_time(fleet: Fleet, work: Workload, ordered_clusters: Sequence[Sequence[int]]) -> float:
    """Equation 2 with Equation 3's DT_k and links between whole clusters (before the frontal and
    backward sides are chosen): what clustering compares from one level to the next."""
    p = len(ordered_clusters)
    dt = approximate_stage_time(fleet, work, p)
    worst = 0.0
    for k, cluster in enumerate(ordered_clusters):
        fwd = group_link_time(fleet, ordered_clusters[k - 1], cluster, work.microbatch_bytes) if k > 0 else 0.0
        bwd = group_link_time(fleet, ordered_clusters[k + 1], cluster, work.microbatch_bytes) if k + 1 < p else 0.0
        worst = max(worst, fwd + bwd + dt)
    return work.microbatches * worst
