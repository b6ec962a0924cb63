"""One pipeline over two vendors, launched as a user launches one job over a GPU host and a host
of other chips: one ``torchrun`` per "host" (here both on loopback), each with the vendor of its
own chips. Stage 0 (TP 2) runs on the native vendor over the cpu, the path a GPU takes
(``DITORCH_VENDOR=cuda`` there): device memory the host may not address, every boundary tensor
and collective staged through pinned host copies. The later stages run on emulated chips. In
fp32 the job trains what one CPU process trains."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diutil.address import free_port
from plans import ROOT, chip_file, make_plan

STEPS = 4


@pytest.mark.slow
def test_a_pipeline_over_the_cpu_vendor_and_emulated_chips_equals_one_process(tmp_path):
    from heteropp.runtime.reference import train_reference
    from heteropp.runtime.trainer import TrainOptions

    plan = make_plan([("X", 2, 2, False), ("Y", 1, 1, False), ("Z", 1, 1, False)])
    plan.to_json(tmp_path / "plan.json")
    port = free_port()
    procs = []
    for node, vendor in enumerate(["cpu", "emu"]):
        env = dict(os.environ, PYTHONPATH=str(ROOT), DITORCH_PROFILE_FILE=str(chip_file(tmp_path)),
                   DITORCH_MEMORY_SCALE="0.001", DITORCH_VENDOR=vendor)
        # Static rendezvous: node 0's ranks are 0 and 1, so stage 0 is the cpu vendor's.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "ditorch.train", "--plan", "plan.json", "--steps", str(STEPS), "--precision", "fp32",
               "--quiet", "--timeout", "60", "--loss-log", f"node{node}.jsonl"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    described = outs[0][0]
    assert "stage 0: chip X on cpu ranks [0, 1]" in described and "stage 1: chip Y on emu ranks [2]" in described, described
    log = tmp_path / "node0.jsonl"
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    reference, _ = train_reference(plan, TrainOptions(steps=STEPS, progress=False))
    assert losses == pytest.approx(reference, rel=1e-5)
