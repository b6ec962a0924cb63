"""The runtime across two emulated hosts (tests/emulated_hosts.py), launched as a user would: one
``torchrun --nnodes 2`` per host meeting at a c10d rendezvous, no DICOMM_* variable set. The stage
boundary crosses the hosts; the result equals the single-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from emulated_hosts import can_make_hosts, emulated_hosts
from plans import ROOT, chip_file, make_plan

STEPS = 4


@pytest.mark.slow
@pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))
def test_two_hosts_train_like_one_process(tmp_path):
    from heteropp.runtime.reference import train_reference
    from heteropp.runtime.trainer import TrainOptions

    plan = make_plan([("X", 1, 1, False), ("Y", 1, 1, False), ("Z", 2, 2, False)])
    plan.to_json(tmp_path / "plan.json")
    with emulated_hosts(2) as hosts:
        rendezvous = f"{hosts[0].name}:29531"
        procs = []
        for node, host in enumerate(hosts):
            # Nothing but the rendezvous address: dicomm finds the interface that routes to it.
            env = {k: v for k, v in os.environ.items() if not k.startswith("DICOMM_") and k != "GLOO_SOCKET_IFNAME"}
            env.update(PYTHONPATH=str(ROOT), DITORCH_PROFILE_FILE=str(chip_file(tmp_path)),
                       DITORCH_MEMORY_SCALE="0.001")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous, "--rdzv-id", "multihost",
                   "-m", "ditorch.train", "--plan", "plan.json", "--steps", str(STEPS),
                   "--precision", "fp32", "--quiet", "--timeout", "60", "--loss-log", f"node{node}.jsonl"]
            procs.append(subprocess.Popen(host.run(cmd), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=180) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    logs = [tmp_path / f"node{n}.jsonl" for n in range(2)]
    log = next(path for path in logs if path.exists())  # global rank 0 logs, on whichever node it landed
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    reference, _ = train_reference(plan, TrainOptions(steps=STEPS, progress=False))
    assert losses == pytest.approx(reference, rel=1e-5)
