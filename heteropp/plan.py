"""The plan: the JSON contract between HeteroAuto and the HeteroPP runtime.

A plan lists the pipeline stages in order; each stage is one chip type with its TP and DP
sizes, a contiguous range of transformer layers, the recompute switch and the global ranks
it occupies (rank = rank_range[0] + dp_index * tp + tp_index). The model, the cluster and
the batch are embedded so a plan can be simulated or run on its own. The schema is written
down in docs/heteropp.md; ``Plan.from_json`` validates every field and names what is wrong.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .cluster import ClusterSpec, GB
from .model_spec import ModelSpec

FORMAT = "ditorch.heteropp.plan/1"


class PlanError(ValueError):
    """A plan that does not describe a runnable pipeline."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage."""

    chip: str
    tp: int
    dp: int
    layers: int
    first_layer: int
    recompute: bool
    first_rank: int
    group: int = 0  # the search group (chip type or sub-group) the stage came from

    @property
    def num_ranks(self) -> int:
        return self.tp * self.dp

    @property
    def layer_range(self) -> tuple[int, int]:
        return (self.first_layer, self.first_layer + self.layers)

    @property
    def rank_range(self) -> tuple[int, int]:
        return (self.first_rank, self.first_rank + self.num_ranks)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A HeteroPP plan; see the module docstring."""

    model: ModelSpec
    cluster: ClusterSpec
    global_batch_tokens: int
    dp: int
    stages: tuple[StagePlan, ...]
    alpha: float = 1.0
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    estimate: dict = dataclasses.field(default_factory=dict)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_tokens // (self.model.seq * self.dp * self.micro_batch_size)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_chips(self) -> int:
        return sum(s.num_ranks for s in self.stages)

    def stage_tuples(self) -> list[tuple[str, int, int, int, bool]]:
        return [(s.chip, s.tp, s.dp, s.layers, s.recompute) for s in self.stages]

    def stage_memory(self, index: int, inflight: int | None = None) -> float:
        """Peak bytes on one chip of stage ``index`` under the plan's schedule: 1F1B's warm-up,
        the cross-DC schedules' activation budget (jeeves.py), or ``inflight`` micro-batches."""
        s = self.stages[index]
        if inflight is None and self.schedule in ("comm-aware", "jeeves"):
            from .jeeves import inflight_microbatches

            inflight = inflight_microbatches(self, index)
        if inflight is None:
            inflight = min(self.num_stages - index, self.num_microbatches)
        return self.model.stage_memory_bytes(
            s.layers, s.tp, s.dp, s.recompute, inflight, index == 0, index == self.num_stages - 1,
            activation_per_layer=self.cluster.chip(s.chip).activation_per_layer(s.tp),
        )

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        stages = []
        for i, s in enumerate(self.stages):
            chip = self.cluster.chip(s.chip)
            stages.append({
                "index": i, "chip": s.chip, "group": s.group, "tp": s.tp, "dp": s.dp,
                "layers": s.layers, "layer_range": list(s.layer_range), "recompute": s.recompute,
                "rank_range": list(s.rank_range),
                "memory_gb": round(self.stage_memory(i) / GB, 3),
                "memory_capacity_gb": round(chip.usable_memory / GB, 3),
            })
        return {
            "format": FORMAT,
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "global_batch_tokens": self.global_batch_tokens,
            "micro_batch_size": self.micro_batch_size,
            "dp": self.dp,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "alpha": self.alpha,
            "stages": stages,
            "estimate": self.estimate,
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | Path | dict) -> "Plan":
        """Load and validate a plan (a path, a JSON string or the parsed dict)."""
        if isinstance(source, dict):
            d, where = source, "plan"
        else:
            p = Path(source) if not str(source).lstrip().startswith("{") else None
            where = str(p) if p is not None else "plan"
            try:
                d = json.loads(p.read_text() if p is not None else str(source))
            except json.JSONDecodeError as exc:
                raise PlanError(f"{where}: not valid JSON ({exc})") from None
        return _parse(d, where)

    def validate(self) -> None:
        """Raise PlanError naming the first inconsistency (also run by the constructor paths)."""
        _validate(self, "plan")


_TOP_KEYS = {"format", "model", "cluster", "global_batch_tokens", "micro_batch_size", "dp",
             "num_microbatches", "schedule", "alpha", "stages", "estimate"}
_STAGE_KEYS = {"index", "chip", "group", "tp", "dp", "layers", "layer_range", "recompute", "rank_range",
               "memory_gb", "memory_capacity_gb"}
_STAGE_REQUIRED = {"chip", "tp", "dp", "layers", "layer_range", "recompute", "rank_range"}


def _int(d: dict, key: str, where: str, minimum: int = 1) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise PlanError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _parse(d: Any, where: str) -> Plan:
    if not isinstance(d, dict):
        raise PlanError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise PlanError(f"{where}: format must be {FORMAT!r}, got {d.get('format')!r}")
    unknown = sorted(set(d) - _TOP_KEYS)
    missing = sorted({"model", "cluster", "global_batch_tokens", "dp", "stages"} - set(d))
    if unknown or missing:
        raise PlanError(f"{where}: unknown keys {unknown} / missing keys {missing}")
    try:
        model = ModelSpec.from_dict({k: v for k, v in d["model"].items()}, name=d["model"].get("name"))
        cluster = ClusterSpec.from_dict(d["cluster"], where=f"{where} cluster")
    except (ValueError, TypeError, AttributeError) as exc:
        raise PlanError(f"{where}: {exc}") from None
    if not isinstance(d["stages"], list) or not d["stages"]:
        raise PlanError(f"{where}: stages must be a non-empty list")
    stages = []
    for i, s in enumerate(d["stages"]):
        sw = f"{where} stage {i}"
        if not isinstance(s, dict):
            raise PlanError(f"{sw}: expected an object")
        unknown, missing = sorted(set(s) - _STAGE_KEYS), sorted(_STAGE_REQUIRED - set(s))
        if unknown or missing:
            raise PlanError(f"{sw}: unknown keys {unknown} / missing keys {missing}")
        if not isinstance(s["recompute"], bool):
            raise PlanError(f"{sw}: recompute must be true or false, got {s['recompute']!r}")
        for key in ("layer_range", "rank_range"):
            r = s[key]
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)):
                raise PlanError(f"{sw}: {key} must be [start, stop], got {r!r}")
        tp, dp, layers = _int(s, "tp", sw), _int(s, "dp", sw), _int(s, "layers", sw)
        if s["layer_range"][1] - s["layer_range"][0] != layers:
            raise PlanError(f"{sw}: layer_range {s['layer_range']} does not hold layers={layers}")
        if s["rank_range"][1] - s["rank_range"][0] != tp * dp:
            raise PlanError(f"{sw}: rank_range {s['rank_range']} does not hold tp*dp={tp * dp} ranks")
        stages.append(StagePlan(
            chip=str(s["chip"]), tp=tp, dp=dp, layers=layers, first_layer=s["layer_range"][0],
            recompute=s["recompute"], first_rank=s["rank_range"][0], group=int(s.get("group", 0)),
        ))
    alpha = d.get("alpha", 1.0)
    if not isinstance(alpha, (int, float)) or alpha < 0:
        raise PlanError(f"{where}: alpha must be a number >= 0, got {alpha!r}")
    plan = Plan(
        model=model, cluster=cluster, global_batch_tokens=_int(d, "global_batch_tokens", where),
        dp=_int(d, "dp", where), stages=tuple(stages), alpha=float(alpha),
        schedule=str(d.get("schedule", "1f1b")), micro_batch_size=_int(d, "micro_batch_size", where) if "micro_batch_size" in d else 1,
        estimate=dict(d.get("estimate") or {}),
    )
    _validate(plan, where)
    if "num_microbatches" in d and d["num_microbatches"] != plan.num_microbatches:
        raise PlanError(
            f"{where}: num_microbatches={d['num_microbatches']!r} but global_batch_tokens / (seq * dp * "
            f"micro_batch_size) = {plan.num_microbatches}"
        )
    return plan


def _validate(plan: Plan, where: str) -> None:
    m = plan.model
    seqs, rem = divmod(plan.global_batch_tokens, m.seq)
    if rem:
        raise PlanError(f"{where}: global_batch_tokens={plan.global_batch_tokens} is not a multiple of seq={m.seq}")
    if seqs % (plan.dp * plan.micro_batch_size):
        raise PlanError(
            f"{where}: {seqs} sequences per batch are not divisible by dp * micro_batch_size = "
            f"{plan.dp} * {plan.micro_batch_size}"
        )
    next_layer, next_rank = 0, 0
    used: dict[str, int] = {}
    for i, s in enumerate(plan.stages):
        sw = f"{where} stage {i}"
        try:
            chip = plan.cluster.chip(s.chip)
        except KeyError as exc:
            raise PlanError(f"{sw}: {exc.args[0]}") from None
        if s.dp != plan.dp:
            raise PlanError(f"{sw}: dp={s.dp} differs from the plan's dp={plan.dp} (one DP size per pipeline)")
        if s.tp not in chip.tp_sizes():
            raise PlanError(f"{sw}: tp={s.tp} not allowed on chip {s.chip!r}; allowed TP sizes {chip.tp_sizes()}")
        if m.kv_heads % s.tp:
            raise PlanError(f"{sw}: tp={s.tp} does not divide the model's kv_heads={m.kv_heads}")
        if s.first_layer != next_layer:
            raise PlanError(f"{sw}: layers start at {s.first_layer}, expected {next_layer} (contiguous ranges)")
        if s.first_rank != next_rank:
            raise PlanError(f"{sw}: ranks start at {s.first_rank}, expected {next_rank} (contiguous ranges)")
        next_layer += s.layers
        next_rank += s.num_ranks
        used[s.chip] = used.get(s.chip, 0) + s.num_ranks
        need, cap = plan.stage_memory(i), chip.usable_memory
        if need > cap:
            raise PlanError(
                f"{sw}: needs {need / GB:.1f} GB per chip {s.chip!r} but its usable memory is {cap / GB:.1f} GB"
            )
    if next_layer != m.n_layers:
        raise PlanError(f"{where}: stages hold {next_layer} layers, the model has {m.n_layers}")
    for name, n in used.items():
        if n > plan.cluster.chip(name).count:
            raise PlanError(f"{where}: stages use {n} chips of type {name!r}, the cluster has {plan.cluster.chip(name).count}")
