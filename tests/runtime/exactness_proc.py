"""A rank of tests/runtime/test_exactness.py: one launch trains several cases of one plan, one
after another in the same process group, each as ``ditorch.train`` trains one run (its options,
its trainer and groups, its loss log and checkpoint). Launching is not what those cases test
(every other runtime test launches through ``torchrun -m ditorch.train``); sharing the launch
spares each case the ranks' start-up.

Usage (under torchrun): ``exactness_proc.py PLAN.json CASES.json [--emulate-links]`` where CASES
maps a case's directory to its TrainOptions fields."""
from __future__ import annotations

import datetime
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ditorch  # noqa: F401  (the dipu device and the dicomm backend)
from heteropp.plan import Plan
from heteropp.runtime.trainer import PipelineTrainer, TrainOptions
from heteropp.runtime.training_run import TrainingRun


def main(plan_path: str, cases_path: str, links: str = "") -> int:
    plan = Plan.from_json(plan_path)
    cases = json.loads(Path(cases_path).read_text())
    torch.set_num_threads(1)
    state = None
    if links == "--emulate-links":  # dicomm paces the plan's links, as ditorch.train has it do
        from ditorch.train import _emulate_links

        state = _emulate_links(plan, 180)
    dist.init_process_group("dicomm", timeout=datetime.timedelta(seconds=180))
    if state is not None:
        from ditorch.train import _release_link_state

        _release_link_state(state)
    for directory, fields in cases.items():
        Path(directory).mkdir(parents=True, exist_ok=True)
        paths = {k: Path(directory) / v for k, v in fields.items() if k in ("log", "save", "trace")}
        options = TrainOptions(**{**fields, **paths})
        trainer = PipelineTrainer(plan, options)
        TrainingRun(trainer).run()
        del trainer
        gc.collect()  # the chip's memory is the next case's
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
