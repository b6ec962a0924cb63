"""The action lists a plan runs under a named schedule, and the pipeline the simulator runs them
on: one function for ``ditorch simulate``, ``ditorch plan`` and the runtime (``ditorch.train``),
so all three run the same lists.

- ``1f1b``, ``gpipe``, ``fine-grained``: generated (schedule.py), the same lists for every DP
  replica; 1F1B and GPipe block on their sends (DAPPLE / Megatron), fine-grained does not.
- ``comm-aware``: JEEVES's communication-aware lists (jeeves.py), per replica: what the greedy
  scheduler runs on the plan's pipeline with every replica and the shared cross-DC link;
  sends and receives are actions, handed off without blocking the stage.
- ``jeeves``: the same with the replicas taking turns on the cross-DC link (the lists carry
  the coordinated boundary); ``ditorch plan --schedule jeeves`` also divides the layers.
- a torch-style CSV file of actions, the same lists for every replica.
"""
from __future__ import annotations

from pathlib import Path

from .plan import Plan, PlanError
from .schedule import Schedule, fine_grained, gpipe, one_f_one_b
from .simulator import Pipeline, pipeline_from_plan

GENERATED = {"1f1b": one_f_one_b, "gpipe": gpipe, "fine-grained": fine_grained}
CROSS_DC = ("comm-aware", "jeeves")
SCHEDULES = (*GENERATED, *CROSS_DC)


def plan_schedules(plan: Plan, name: str | None = None) -> list[Schedule]:
    """The lists each DP replica of ``plan`` runs under ``name`` (default: the plan's),
    validated against the plan's stages."""
    from . import jeeves

    name = name or plan.schedule
    S, b = plan.num_stages, plan.num_microbatches
    rc = [s.recompute for s in plan.stages]
    if name in GENERATED:
        scheds = [GENERATED[name](S, b, rc)] * plan.dp
    elif name in CROSS_DC:
        scheds = jeeves.comm_aware_schedules(plan, coordinated=name == "jeeves")
    elif name.endswith(".csv") and Path(name).is_file():
        scheds = [Schedule.from_csv(name)] * plan.dp
    else:
        raise ValueError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)} or a CSV file of actions")
    for r, sched in enumerate(scheds):
        if (sched.num_stages, sched.num_microbatches) != (S, b):
            raise PlanError(f"schedule {name!r} has {sched.num_stages} stages x {sched.num_microbatches} "
                            f"micro-batches, the plan {S} x {b}")
        sched.validate(rc)
    return scheds


def schedule_pipeline(plan: Plan, name: str | None = None) -> Pipeline:
    """The simulator's pipeline for ``plan`` under ``name``: for the cross-DC schedules every DP
    replica with the shared cross-DC link (jeeves.plan_pipeline), else one replica
    (simulator.pipeline_from_plan)."""
    from . import jeeves

    name = name or plan.schedule
    if name in CROSS_DC:
        return jeeves.plan_pipeline(plan, coordinated=name == "jeeves")
    return pipeline_from_plan(plan)


def with_schedule(plan: Plan, name: str) -> Plan:
    """``plan`` set to run ``name``: ``jeeves`` also divides its layers (memory-aware, jeeves.py);
    ``auto`` picks, for a plan across two DCs, whichever of DAPPLE's 1F1B and JEEVES the
    simulator finishes first (with every replica on the shared cross-DC link), else 1F1B. A
    cross-DC schedule's estimate is the simulator's iteration."""
    import dataclasses

    from . import jeeves
    from .simulator import simulate

    if name == "auto":
        if not jeeves.cross_dc_boundaries(plan):
            return dataclasses.replace(plan, schedule="1f1b")
        candidate = with_schedule(plan, "jeeves")
        dapple = simulate(jeeves.plan_pipeline(plan, ack_wait=True), plan_schedules(plan, "1f1b")).iteration_time
        if candidate.estimate["iteration_time_s"] < dapple:
            return candidate
        return dataclasses.replace(plan, schedule="1f1b")
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)} or auto")
    out = dataclasses.replace(plan, schedule=name)
    if name not in CROSS_DC:
        out.validate()
        return out
    out = jeeves.divide_plan(out) if name == "jeeves" else out
    out.validate()
    t = simulate(schedule_pipeline(out), plan_schedules(out)).iteration_time
    keep = {k: v for k, v in plan.estimate.items() if k in ("search_seconds", "search_leaves")}
    return dataclasses.replace(out, estimate={**keep, "iteration_time_s": t, "estimated_by": f"simulator ({name})",
                                              "tokens_per_chip_per_s": plan.global_batch_tokens / (t * plan.num_chips)})
