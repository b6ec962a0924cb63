"""JEEVES's cross-DC schedules on the runtime: a plan whose two stages sit in two DCs (chip
types X and Y, each its own cluster; each DC an emulated host where they can be made) with two
DP replicas trains exactly what one process trains (fp32, losses and parameters within 1e-5
relative, the replicas' parameters equal every step) under JEEVES (the replicas take turns on
the cross-DC link) and under the communication-aware lists alone; each rank runs the very
lists the simulator replays for the same plan (heteropp.plan_schedules), read back from the
run's trace. Both cases share one launch (exactness_proc.py), over the plan's links as dicomm
emulates them (so the turns pass after each message's serialisation time)."""
from __future__ import annotations

import dataclasses
import json
from contextlib import nullcontext

import pytest

from diutil.datasheets.links import LinkSpec
from emulated_hosts import can_make_hosts, emulated_hosts
from heteropp.plan_schedules import plan_schedules
from heteropp.runtime.reference import train_reference
from heteropp.runtime.trainer import TrainOptions
from plans import make_plan, torchrun_script
from test_exactness import PROC, _checkpoint_tensors, _relative

STEPS = 3
SCHEDULES = ("jeeves", "comm-aware")


def _plan():
    plan = make_plan([("X", 1, 2, False), ("Y", 1, 2, False)], dp=2, microbatches=4)
    # chips whose memory holds three micro-batches' activations: the lists run three forwards
    # ahead, then alternate (no generated schedule does that on two stages)
    static, per = plan.stage_memory(0, inflight=0), plan.stage_memory(0, inflight=1) - plan.stage_memory(0, inflight=0)
    chips = tuple(dataclasses.replace(c, memory=(static + 3.5 * per) / c.usable_memory_fraction)
                  for c in plan.cluster.chips)
    cross_dc = LinkSpec(bandwidth=1e8, latency=2e-3)  # 100 MB/s, 2 ms between the DCs
    return dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, chips=chips, inter_cluster=cross_dc))


_launched: list = []


def _launch(tmp_path_factory):
    """Train both cases in one launch (once per test process); the launch's folder."""
    if _launched:
        return _launched[0]
    root = tmp_path_factory.mktemp("cross-dc")
    plan = _plan()
    plan.to_json(root / "plan.json")
    cases = {str(root / name): {"steps": STEPS, "precision": "fp32", "schedule": name, "clip": 0.05,
                                "log": "run.jsonl", "save": "ckpt", "trace": "trace.json", "check_replicas": 1,
                                "progress": False} for name in SCHEDULES}
    (root / "cases.json").write_text(json.dumps(cases))
    # one host per DC: ranks 0-1 (stage 0 of both replicas) on the first, 2-3 on the second
    with emulated_hosts(2) if can_make_hosts() is None else nullcontext() as hosts:
        run = torchrun_script(PROC, plan.num_chips, [str(root / "plan.json"), str(root / "cases.json"),
                                                     "--emulate-links"], root, timeout=600, hosts=hosts)
    assert run.returncode == 0, run.stderr[-3000:]
    _launched.append(root)
    return root


def _ran_lists(trace_path, step: int) -> dict[int, list[str]]:
    """Each rank's actions of ``step``, in the order it ran them (its waits left out)."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e["args"].get("step") == step and e["args"]["kind"] not in ("WAIT", "UPDATE")]
    out: dict[int, list[str]] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        out.setdefault(e["tid"], []).append(e["name"])
    return out


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.xdist_group("cross-dc")) for s in SCHEDULES])
def test_cross_dc_schedules_train_like_one_process(schedule, tmp_path, tmp_path_factory):
    folder = _launch(tmp_path_factory) / schedule
    plan = dataclasses.replace(_plan(), schedule=schedule)
    ref_losses, ref_model = train_reference(plan, TrainOptions(steps=STEPS, clip=0.05, progress=False))
    losses = [json.loads(line)["loss"] for line in (folder / "run.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    saved = _checkpoint_tensors(folder / "ckpt", tmp_path)
    worst = max((_relative(saved[f"model/{k}"], v.detach()), k) for k, v in ref_model.state_dict().items())
    assert worst[0] < 1e-5, f"parameter {worst[1]} differs by {worst[0]:.2e} relative"

    lists = plan_schedules(plan)
    assert [str(a) for a in lists[0].actions[0] if a.kind in "FB"][:4] == ["0F0", "0F1", "0F2", "0B0"]
    assert all(s.coordinated == ((0,) if schedule == "jeeves" else ()) for s in lists)
    ran = _ran_lists(folder / "trace.json", STEPS - 1)
    for stage in range(plan.num_stages):
        for replica in range(plan.dp):
            rank = plan.stages[stage].first_rank + replica
            assert ran[rank] == [str(a) for a in lists[replica].actions[stage]], f"rank {rank}"
