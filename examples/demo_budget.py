"""The demo's time budget: how long each phase of ``examples/hetero_demo.py`` takes on this host,
and how much work each phase gets so that the whole demo fits a budget.

A phase's seconds are a cost model of three parts:

- process start-ups it pays one after another (``starts``), each the seconds this host takes to
  start Python and import torch and ditorch (measured at the demo's start);
- device-bound work: units (steps, repeats) x the chips' seconds per unit at time scale 1 x the
  time scale (an emulated chip runs its datasheet's time times the scale, on any host that keeps
  up: docs/device.md, "Speed");
- host-bound work (the fp32 CPU reference, the volunteer clients at time scale 1, the planner):
  units x the calibration host's CPU seconds per unit x this host's CPU time for a fixed piece
  of work against the calibration host's.

``size_phases`` gives every phase its floor (the least work its verdict still means something
on), then grows every phase's work by one common factor of its default (clamped to the phase's
floor and most) while the predicted total fits the budget. When even the floors do not fit at the
demo's batch, it tries a smaller one (``BATCHES``: less work per step in every phase that trains
the pipeline's model, the same verdicts over fewer tokens); when they fit at none, it keeps the
smallest batch's floors and says by how much they exceed the budget rather than shrinking a
verdict below its floor.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence


# A fixed piece of CPU work a fresh process times (after importing torch and the device layer, so
# the process's wall time less this is one start-up): one thread, fp32 matmuls of a llama-small
# FFN's shape. The calibration host's CPU seconds for it (the README's Xeon, 0.34-0.35 s in
# three runs; `examples/hetero_demo.py` runs it at phase 0).
HOST_PROBE = """
import json, time
import torch, ditorch_ext
torch.set_num_threads(1)
a, w = torch.randn(1024, 512), torch.randn(512, 1408)
start = time.perf_counter()
for _ in range(20):
    (a @ w) @ w.T
print(json.dumps({"work_s": time.perf_counter() - start}))
"""
HOST_PROBE_REFERENCE_S = 0.345

# The Di-PS phase's clusters take an outer step every this many inner steps: few, so that two
# rounds of each cluster (the least that shows pushes from both applied and pulled back) fit
# the budget's floor.
DIPS_INNER_STEPS = 2

# The batches the demo may train at, as shares of its default (1K tokens: 8 micro-batches of one
# 128-token sequence), largest first: half the batch is 4 micro-batches, still more than the
# default cluster's 3 pipeline stages, so the pipeline's steady state and its bubbles both show.
BATCHES = (1.0, 0.5)
# What a step at a share of the batch costs: the calibration plan's pipeline (3 stages, 8
# micro-batches) takes (micro-batches + stages - 1) micro-batch times a step.
CALIBRATION_MICROBATCHES = 8
CALIBRATION_STAGES = 3


@dataclasses.dataclass(frozen=True)
class Host:
    """What the cost model needs of the host, measured at the demo's start."""

    time_scale: float  # every emulated chip runs this many times its datasheet time
    start_s: float  # one process's start-up: Python, torch and ditorch imported
    cpu_factor: float  # this host's CPU time for a fixed piece of work against the calibration host's

    def __post_init__(self) -> None:
        for name in ("time_scale", "start_s", "cpu_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Host.{name}={value!r} is invalid; expected a positive number")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of the demo and its cost model; ``floor <= default <= most`` units of work."""

    step: str  # "3/9": how the demo labels it
    name: str
    unit: str  # what one unit of work is ("step", "repeat"); "" for a phase of fixed work
    starts: float = 0.0  # process start-ups paid one after another
    chip_s: float = 0.0  # chip seconds per unit at time scale 1
    host_s: float = 0.0  # the calibration host's CPU seconds per unit
    fixed_s: float = 0.0  # the calibration host's CPU seconds whatever the units
    fixed_chip_s: float = 0.0  # chip seconds at time scale 1 whatever the units (warm-ups)
    floor: int = 1
    default: int = 1
    most: int = 1
    multiple_of: int = 1  # units come in multiples of this (Di-PS: an outer step every DIPS_INNER_STEPS)
    same_units_as: str | None = None  # a phase whose units this one follows (the reference: training's steps)
    # how a unit's cost follows the batch (BATCHES): "" not at all, "tokens" in proportion (one
    # process), "pipeline" as the calibration plan's pipeline (fill and drain do not shrink)
    batch: str = ""
    # the share of training's time scale this phase's chips run at (the profiles run at their own)
    time_scale_share: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.time_scale_share, (int, float)) and 0 < self.time_scale_share <= 1):
            raise ValueError(f"phase {self.step}: time_scale_share={self.time_scale_share!r}; expected a number in (0, 1]")
        for name in ("starts", "chip_s", "host_s", "fixed_s", "fixed_chip_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"phase {self.step}: {name}={value!r} is invalid; expected a number >= 0")
        if not (isinstance(self.multiple_of, int) and self.multiple_of >= 1):
            raise ValueError(f"phase {self.step}: multiple_of={self.multiple_of!r}; expected an integer >= 1")
        if not (isinstance(self.floor, int) and 0 <= self.floor <= self.default <= self.most):
            raise ValueError(f"phase {self.step}: floor={self.floor!r}, default={self.default!r}, most={self.most!r}; "
                             f"expected integers with 0 <= floor <= default <= most")
        if any(n % self.multiple_of for n in (self.floor, self.default, self.most)):
            raise ValueError(f"phase {self.step}: floor, default and most must be multiples of {self.multiple_of}")
        if self.batch not in ("", "tokens", "pipeline"):
            raise ValueError(f"phase {self.step}: batch={self.batch!r}; expected '', 'tokens' or 'pipeline'")

    def batch_cost(self, share: float) -> float:
        """A unit's cost at ``share`` of the default batch, against its cost at the default."""
        if not (isinstance(share, (int, float)) and 0 < share <= 1):
            raise ValueError(f"batch share {share!r} is invalid; expected a number in (0, 1]")
        if self.batch == "tokens":
            return share
        if self.batch == "pipeline":
            fill = CALIBRATION_STAGES - 1
            return (share * CALIBRATION_MICROBATCHES + fill) / (CALIBRATION_MICROBATCHES + fill)
        return 1.0

    def seconds(self, units: int, host: Host, batch: float = 1.0) -> float:
        """Predicted wall seconds of this phase with ``units`` of work at ``batch`` (a share of
        the default batch) on ``host``."""
        time_scale = host.time_scale * self.time_scale_share
        return (self.starts * host.start_s + host.cpu_factor * self.fixed_s + time_scale * self.fixed_chip_s
                + units * self.batch_cost(batch) * (time_scale * self.chip_s + host.cpu_factor * self.host_s))

    def units_at(self, factor: float) -> int:
        """The phase's units at ``factor`` times its default, within its floor and most."""
        units = math.floor(self.default * factor / self.multiple_of + 1e-9) * self.multiple_of
        return min(self.most, max(self.floor, units))


@dataclasses.dataclass(frozen=True)
class Sizing:
    """Each phase's units and predicted seconds against the budget, at a share of the batch."""

    budget_s: float
    batch: float  # the share of the default batch every phase that follows it trains at
    units: dict[str, int]  # phase step -> units
    predicted_s: dict[str, float]  # phase step -> seconds

    @property
    def total_s(self) -> float:
        return sum(self.predicted_s.values())

    @property
    def over_s(self) -> float:
        """Seconds by which even the floors exceed the budget (0: it fits)."""
        return max(0.0, self.total_s - self.budget_s)


def size_phases(phases: Sequence[Phase], host: Host, budget_s: float, batches: Sequence[float] = (1.0,)) -> Sizing:
    """The most work per phase (one common factor of each phase's default) whose predicted
    seconds fit ``budget_s``, at the largest of ``batches`` (shares of the default batch) whose
    floors fit; each phase's floor at the smallest batch when none does."""
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s)):
        raise ValueError(f"budget_s={budget_s!r} is invalid; expected a number of seconds")
    if not batches or any(not (isinstance(b, (int, float)) and 0 < b <= 1) for b in batches):
        raise ValueError(f"batches={list(batches)!r} is invalid; expected shares of the batch in (0, 1]")
    by_step = {p.step: p for p in phases}
    if len(by_step) != len(phases):
        raise ValueError(f"phases {[p.step for p in phases]}: each step must appear once")
    for p in phases:
        if p.same_units_as is not None and p.same_units_as not in by_step:
            raise ValueError(f"phase {p.step} follows the units of {p.same_units_as!r}, which is not a phase")
    for batch in sorted(set(batches), reverse=True):
        sizing = _size_at_batch(phases, host, budget_s, batch)
        if not sizing.over_s:
            return sizing
    return sizing


def _size_at_batch(phases: Sequence[Phase], host: Host, budget_s: float, batch: float) -> Sizing:
    """``size_phases`` at one share of the batch."""

    def at(factor: float) -> Sizing:
        own = {p.step: p.units_at(factor) for p in phases}
        units = {p.step: own[p.same_units_as] if p.same_units_as else own[p.step] for p in phases}
        return Sizing(budget_s, batch, units, {p.step: p.seconds(units[p.step], host, batch) for p in phases})

    lo = at(0.0)  # every phase at its floor
    if lo.total_s > budget_s:
        return lo
    # The total grows with the factor (every phase's units do); past the largest most / default
    # no phase grows further.
    low, high = 0.0, max((p.most / p.default for p in phases if p.default), default=1.0)
    if at(high).total_s <= budget_s:
        return at(high)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid).total_s <= budget_s else (low, mid)
    return at(low)


def describe(sizing: Sizing, phases: Sequence[Phase]) -> list[str]:
    """One line per phase: its work and predicted seconds."""
    return [f"{p.step} {p.name}: " + (f"{sizing.units[p.step]} {p.unit}{'s' if sizing.units[p.step] != 1 else ''}, "
                                       if p.unit else "") + f"{sizing.predicted_s[p.step]:.0f} s"
            for p in phases]


def predicted_against_actual(predicted: Mapping[str, float], actual: Mapping[str, float]) -> list[str]:
    """Rows of a table: each phase's predicted and measured seconds and their ratio."""
    rows = [f"{'phase':>6} {'predicted s':>11} {'actual s':>9} {'actual/predicted':>16}"]
    for step in sorted(set(predicted) | set(actual)):
        p, a = predicted.get(step), actual.get(step)
        ratio = f"{a / p:.2f}" if p and a is not None else "-"
        rows.append(f"{step:>6} {'-' if p is None else f'{p:.0f}':>11} {'-' if a is None else f'{a:.0f}':>9} "
                    f"{ratio:>16}")
    rows.append(f"{'total':>6} {sum(predicted.values()):>11.0f} {sum(actual.values()):>9.0f}")
    return rows


def demo_phases(chips_to_profile: int, hsr: bool, ps: bool, volunteer: bool,
                profile_time_scale_share: float = 1.0) -> list[Phase]:
    """``examples/hetero_demo.py``'s phases after phase 0, for its default cluster (one A, one B,
    two C) and model (``llama-small``, 1K tokens per step), calibrated on the README's `make demo`
    from a fresh clone on the 2-core Xeon host, quiet, at time scale 160 (1.2 s start-ups; phases
    401 s: profiles 68 at 3 repeats and half the scale, plan 1, train 109 at 15 steps, reference 11,
    MRE 2, timeline 2, HSR 60 at 2 steps, Di-PS 76 at 8 steps, volunteers 71 at 10 steps): chip
    seconds per unit are the host-independent part (a phase's device-bound seconds over the time
    scale), start-ups the processes a phase waits for one after another. Another cluster or model
    is predicted as this one; the demo prints predicted against actual seconds per phase."""
    phases = []
    if chips_to_profile:
        # per chip: the CLI, then TP 1's rank and TP 2's two; each TP's fixed work (building the
        # layer, the stage's ends and updates, one warm-up round) costs more than its repeats; the
        # chips run at the profiles' own time scale, profile_time_scale_share of training's, where
        # the host's own work sets much of a profile's time and a chip whose host fell behind is
        # measured again at training's (chip B on the calibration run)
        phases.append(Phase("1/9", "profiles", "repeat", starts=3.5 * chips_to_profile,
                            chip_s=0.01 * chips_to_profile, fixed_chip_s=0.2 * chips_to_profile,
                            floor=2, default=3, most=5, time_scale_share=profile_time_scale_share))
    phases += [
        Phase("2/9", "plan", "", fixed_s=1.0),
        # torchrun, then four ranks starting on two cores, then a step per unit on the pipeline's
        # critical path (its bubbles included)
        Phase("3/9", "train", "step", starts=3.0, chip_s=0.0458, floor=8, default=16, most=48, batch="pipeline"),
        Phase("4/9", "fp32 reference", "step", starts=1.0, host_s=0.66, same_units_as="3/9", batch="tokens"),
        Phase("5/9", "MRE", "", fixed_s=2.0),
        Phase("6/9", "timeline", "", fixed_s=2.0),
    ]
    if hsr:
        # the CLI, the chip types' runs alone side by side (their torchruns and ranks starting at
        # once), then the whole cluster's; a step is the slowest group's (C alone) plus the whole
        # cluster's; the first step of each run is not timed, so 2 steps time one
        phases.append(Phase("7/9", "HSR", "step", starts=13.0, chip_s=0.134, floor=2, default=2, most=4,
                            batch="pipeline"))
    if ps:
        # a plan, `ps bytes`, the leader and its followers, two clusters' torchruns side by side (a
        # step is the pipeline's: the one-chip cluster's half batch keeps pace with it); two outer
        # steps of each cluster at least
        phases.append(Phase("8/9", "Di-PS", "step", starts=6.0, fixed_s=1.0, chip_s=0.055, floor=2 * DIPS_INNER_STEPS,
                            default=4 * DIPS_INNER_STEPS, most=8 * DIPS_INNER_STEPS, multiple_of=DIPS_INNER_STEPS,
                            batch="pipeline"))
    if volunteer:
        # tokens, plan, four servers and five clients starting together, the reference, MRE; the
        # clients' chips run at time scale 1, so a step is the host's work (its batch follows the
        # pipeline's share); a client leaves after 8 s
        phases.append(Phase("9/9", "volunteers", "step", starts=7.0, fixed_s=10.0, host_s=5.4, floor=6, default=10,
                            most=16, batch="tokens"))
    return phases
