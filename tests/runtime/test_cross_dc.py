"""JEEVES's cross-DC schedules on the runtime: a plan whose two stages sit in two DCs (chip
types X and Y, each its own cluster) with two DP replicas trains exactly what one process
trains (fp32, losses within 1e-5 relative, the replicas' parameters equal every step), under
JEEVES (the replicas take turns on the cross-DC link, each DC an emulated host) and under the
communication-aware lists alone; each rank runs the very lists the simulator replays for the
same plan (heteropp.plan_schedules), read back from the run's trace."""
from __future__ import annotations

import dataclasses
import json
from contextlib import nullcontext

import pytest

from emulated_hosts import can_make_hosts, emulated_hosts
from heteropp.plan_schedules import plan_schedules
from heteropp.runtime.reference import train_reference
from heteropp.runtime.trainer import TrainOptions
from plans import make_plan, torchrun

STEPS = 3
TWO_DCS = [("X", 1, 2, False), ("Y", 1, 2, False)]


def _ran_lists(trace_path, step: int) -> dict[int, list[str]]:
    """Each rank's actions of ``step``, in the order it ran them (its waits left out)."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e["args"].get("step") == step and e["args"]["kind"] not in ("WAIT", "UPDATE")]
    out: dict[int, list[str]] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        out.setdefault(e["tid"], []).append(e["name"])
    return out


@pytest.mark.parametrize("schedule, on_hosts", [
    pytest.param("jeeves", True, marks=pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))),
    ("comm-aware", False),
])
def test_cross_dc_schedules_train_like_one_process(schedule, on_hosts, tmp_path):
    plan = make_plan(TWO_DCS, dp=2, microbatches=4, schedule=schedule)
    # chips whose memory holds three micro-batches' activations: the lists run three forwards
    # ahead, then alternate (no generated schedule does that on two stages)
    static, per = plan.stage_memory(0, inflight=0), plan.stage_memory(0, inflight=1) - plan.stage_memory(0, inflight=0)
    chips = tuple(dataclasses.replace(c, memory=(static + 3.5 * per) / c.usable_memory_fraction)
                  for c in plan.cluster.chips)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, chips=chips))
    plan.to_json(tmp_path / "plan.json")
    with emulated_hosts(2) if on_hosts else nullcontext() as hosts:  # one host per DC: ranks 0-1 and 2-3
        run = torchrun(tmp_path / "plan.json", plan.num_chips,
                       ["--steps", str(STEPS), "--precision", "fp32", "--clip", "0.05", "--loss-log", "run.jsonl",
                        "--check-replicas", "1", "--trace", "trace.json"], tmp_path, hosts=hosts)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    reference, _ = train_reference(plan, TrainOptions(steps=STEPS, clip=0.05, progress=False))
    assert losses == pytest.approx(reference, rel=1e-5)

    lists = plan_schedules(plan)
    assert [str(a) for a in lists[0].actions[0] if a.kind in "FB"][:4] == ["0F0", "0F1", "0F2", "0B0"]
    ran = _ran_lists(tmp_path / "trace.json", STEPS - 1)
    for stage in range(plan.num_stages):
        for replica in range(plan.dp):
            rank = plan.stages[stage].first_rank + replica
            assert ran[rank] == [str(a) for a in lists[replica].actions[stage]], f"rank {rank}"
