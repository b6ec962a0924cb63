"""Checkpoints resume under another plan on the same loss curve; bad plans fail before training
with errors naming the stage and the value (one through the launcher, the rest as each rank checks
them); a killed rank ends the run with an error, never a hang."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from plans import ROOT, chip_file, make_plan, torchrun

STEPS = 6


def _losses(path) -> dict[int, float]:
    return {(d := json.loads(line))["step"]: d["loss"] for line in path.read_text().splitlines()}


@pytest.mark.slow
def test_resume_under_another_plan_continues_the_curve(tmp_path):
    """3 steps under TP 2 -> TP 1, then 3 more under TP 1 -> TP 2 with DP 2, ZeRO-1 and recompute
    on other chips, equal the 6 steps of one uninterrupted run (the one-process reference, which
    the pipeline equals: tests/runtime/test_exactness.py)."""
    from heteropp.runtime.reference import train_reference
    from heteropp.runtime.trainer import TrainOptions

    first = make_plan([("X", 2, 2, False), ("Y", 1, 2, False)], microbatches=4)
    second = make_plan([("Z", 1, 1, False), ("Y", 2, 3, True)], dp=2, microbatches=2)
    first.to_json(tmp_path / "first.json")
    second.to_json(tmp_path / "second.json")
    common = ["--precision", "fp32", "--clip", "0.05"]
    whole, _ = train_reference(first, TrainOptions(steps=STEPS, precision="fp32", clip=0.05, progress=False))
    part1 = torchrun(tmp_path / "first.json", 3, ["--steps", "3", "--save", "ckpt", *common], tmp_path)
    assert part1.returncode == 0, part1.stderr[-3000:]
    part2 = torchrun(tmp_path / "second.json", 6, ["--steps", str(STEPS), "--resume", "ckpt", "--loss-log",
                                                   "resumed.jsonl", "--zero1", *common], tmp_path)
    assert part2.returncode == 0, part2.stderr[-3000:]
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(whole[step - 1], rel=1e-5), step


def test_a_bad_plan_fails_every_rank_before_training(tmp_path):
    """Through the launcher: a plan for 3 ranks started on 2 ends both with the reason, no step run."""
    two = make_plan([("X", 2, 2, False), ("Y", 1, 2, False)])
    two.to_json(tmp_path / "plan.json")
    run = torchrun(tmp_path / "plan.json", 2, ["--steps", "2", "--loss-log", "run.jsonl"], tmp_path, timeout=120)
    assert run.returncode != 0
    assert re.search(r"the plan needs exactly 3 ranks .* world size 2", run.stderr), run.stderr[-3000:]
    assert not (tmp_path / "run.jsonl").exists() or not (tmp_path / "run.jsonl").read_text().strip()


def _check(plan, memory_scale: float | None = None) -> None:
    """What every rank's trainer checks before it makes a group (check_plan_fits), in this process."""
    from heteropp.runtime.trainer import TrainOptions, check_plan_fits

    check_plan_fits(plan, TrainOptions(steps=2, memory_scale=memory_scale, progress=False))


def test_bad_plans_are_refused_naming_the_stage_and_the_value(tmp_path, monkeypatch):
    from heteropp.plan import PlanError

    monkeypatch.setenv("DITORCH_PROFILE_FILE", str(chip_file(tmp_path)))
    # memory: at this scale X holds 3.9 MiB and Z 1.3 MiB; the plan puts more than that on Z
    small = make_plan([("X", 1, 2, False), ("Z", 1, 2, False)])
    assert 1.31 * 2**20 < small.stage_memory(1) < small.stage_memory(0) < 3.9 * 2**20
    need = f"{small.stage_memory(1) / 2**20:.2f}"
    with pytest.raises(PlanError, match=rf"stage 1 \(chip Z.*needs {need} MiB .* holds 1.31 MiB"):
        _check(small, memory_scale=4e-5)
    _check(small, memory_scale=1e-3)  # where the chips hold it, the same plan passes
    # a chip the process cannot emulate
    with pytest.raises(PlanError, match=r"stage 1: unknown chip 'Q'"):
        _check(make_plan([("X", 1, 2, False), ("Q", 1, 2, False)]))
    # a model the stage cannot split: ffn 120 over tp 4 is fine, 4 KV heads over 4 too, 250 vocab is not
    odd = make_plan([("X", 4, 2, False), ("Y", 1, 2, False)],
                    model={"vocab_size": 250, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4,
                           "ffn_dim": 128, "max_seq_len": 32})
    with pytest.raises(PlanError, match=r"tp=4 does not divide the model's vocab_size=250"):
        _check(odd)


def test_a_killed_rank_fails_every_other_rank_naming_it(tmp_path):
    """Ranks started by hand (no torchrun to tear the job down): kill rank 1 mid-run; ranks 0
    and 2 exit with an error naming rank 1 well before the run's timeout."""
    plan = make_plan([("X", 1, 2, False), ("Y", 1, 1, False), ("Z", 1, 1, False)], microbatches=8)
    plan.to_json(tmp_path / "plan.json")
    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    master_port = port.getsockname()[1]
    port.close()
    procs = []
    for rank in range(3):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(master_port), PYTHONPATH=str(ROOT), DITORCH_PROFILE_FILE=str(chip_file(tmp_path)),
                   DITORCH_MEMORY_SCALE="0.001")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ditorch.train", "--plan", "plan.json", "--steps", "1000", "--precision", "fp32",
             "--timeout", "120", "--loss-log", f"r{rank}.jsonl"], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 90
        log = tmp_path / "r0.jsonl"
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            time.sleep(0.2)
        assert log.exists(), "the run never reached step 2"
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for rank in (0, 2):
            _, err = procs[rank].communicate(timeout=60)
            assert procs[rank].returncode != 0
            assert f"rank {rank} failed" in err and "rank 1" in err.split(f"rank {rank} failed", 1)[1], err[-2000:]
        assert time.monotonic() - killed_at < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
