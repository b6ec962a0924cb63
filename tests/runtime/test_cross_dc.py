"""JEEVES's cross-DC schedules on the runtime: a plan whose two stages sit in two DCs (chip
types X and Y, each its own cluster) with two DP replicas, trained under the communication-aware
lists and under JEEVES (the replicas taking turns on the cross-DC link), equals the
single-process run in fp32, as every schedule does (test_exactness.py); the lists each rank ran
are the ones the simulator replays for the same plan."""
from __future__ import annotations

import json

import pytest

from heteropp.runtime.reference import train_reference
from heteropp.runtime.trainer import TrainOptions
from plans import make_plan, torchrun

STEPS = 4
TWO_DCS = [("X", 1, 2, False), ("Y", 1, 2, False)]


@pytest.mark.parametrize("schedule", ["jeeves", "comm-aware"])
def test_cross_dc_schedules_train_like_one_process(schedule, tmp_path):
    plan = make_plan(TWO_DCS, dp=2, microbatches=4, schedule=schedule)
    plan.to_json(tmp_path / "plan.json")
    run = torchrun(tmp_path / "plan.json", plan.num_chips,
                   ["--steps", str(STEPS), "--precision", "fp32", "--clip", "0.05", "--loss-log", "run.jsonl",
                    "--check-replicas", "1"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    reference, _ = train_reference(plan, TrainOptions(steps=STEPS, clip=0.05, progress=False))
    assert losses == pytest.approx(reference, rel=1e-5)
