"""The runtime across two emulated hosts (network namespaces joined by a veth pair), launched
as a user would: one ``torchrun --nnodes 2`` per host meeting at a c10d rendezvous. The stage
boundary crosses the hosts; the result equals the single-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hosts import can_make_hosts, in_host, two_hosts
from plans import ROOT, chip_file, make_plan

STEPS = 4


@pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))
def test_two_hosts_train_like_one_process(tmp_path):
    from heteropp.runtime.reference import train_reference
    from heteropp.runtime.trainer import TrainOptions

    plan = make_plan([("X", 1, 1, False), ("Y", 1, 1, False), ("Z", 2, 2, False)])
    plan.to_json(tmp_path / "plan.json")
    with two_hosts() as hosts:
        rendezvous = f"{hosts[0][1]}:29531"
        procs = []
        for node, (ns, address) in enumerate(hosts):
            env = dict(os.environ, PYTHONPATH=str(ROOT), DITORCH_PROFILE_FILE=str(chip_file(tmp_path)),
                       DITORCH_MEMORY_SCALE="0.001", DICOMM_LISTEN_HOST=address)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous, "--rdzv-id", "multihost",
                   # the hosts share a hostname here, so say which one serves the rendezvous
                   "--rdzv-conf", f"is_host={int(node == 0)}",
                   "--local-addr", address, "-m", "ditorch.train", "--plan", "plan.json", "--steps", str(STEPS),
                   "--precision", "fp32", "--quiet", "--timeout", "60", "--loss-log", f"node{node}.jsonl"]
            procs.append(subprocess.Popen(in_host(ns, cmd), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
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
