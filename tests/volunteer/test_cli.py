"""The commands a user runs, as separate processes: plan, four servers, clients, one of which is
killed with SIGKILL in the middle of training; the losses still equal single-process training."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from volunteer.cli import load_job
from volunteer.local import free_port

from volunteer_reference import reference_run

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=256, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)


def ditorch(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ditorch.cli", *args], cwd=ROOT, **kwargs)


def devices_yaml(path: Path) -> None:
    """Two sites of two reliable devices each, far apart; three unreliable devices. No device can
    hold more than two of the model's four layers, so the model needs two stages."""
    far, near = 80.0, 0.5
    site = [0, 0, 1, 1]
    delay = [[0.0 if i == j else (near if site[i] == site[j] else far) for j in range(4)] for i in range(4)]
    bw = [[10000.0 if site[i] == site[j] else 100.0 for j in range(4)] for i in range(4)]
    path.write_text(yaml.safe_dump({
        "reliable": [{"name": f"s{i}", "tflops": 10.0, "memory_gb": 0.0004, "address": f"127.0.0.1:{free_port()}"} for i in range(4)],
        "unreliable": [{"name": f"u{i}", "tflops": 5.0, "memory_gb": 0.0004} for i in range(3)],
        "reliable_delay_ms": delay, "reliable_bandwidth_mbps": bw,
        "unreliable_delay_ms": [[1, 1, far, far], [far, far, 1, 1], [1, 1, far, far]],
        "unreliable_bandwidth_mbps": [[1000, 1000, 10, 10], [10, 10, 1000, 1000], [1000, 1000, 10, 10]],
    }))


def test_plan_servers_and_clients_as_processes_with_a_client_killed(tmp_path):
    devices, model, alloc = tmp_path / "devices.yaml", tmp_path / "model.yaml", tmp_path / "alloc.json"
    devices_yaml(devices)
    model.write_text(yaml.safe_dump(MODEL))
    token = tmp_path / "job.key"
    assert ditorch("volunteer", "token", str(token), stdout=subprocess.DEVNULL).wait(60) == 0
    plan = subprocess.run([sys.executable, "-m", "ditorch.cli", "volunteer", "plan", "--devices", str(devices),
                           "--model", str(model), "--batch", "8", "--microbatches", "2", "--steps", "4",
                           "--lr", "0.01", "--out", str(alloc)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    allocation = json.loads(alloc.read_text())
    assert len(allocation["stages"]) == 2  # the two sites
    # short timeouts so that the killed client's work is redone quickly
    allocation["training"].update(task_timeout=3.0, liveness=2.0, push_timeout=3.0)
    alloc.write_text(json.dumps(allocation))
    job = load_job(str(alloc))
    metrics = tmp_path / "loss.jsonl"
    logs = {}
    procs = []

    def start(name: str, *args: str) -> subprocess.Popen:
        logs[name] = open(tmp_path / f"{name}.log", "w")
        p = ditorch("volunteer", *args, "--token-file", str(token), stdout=logs[name], stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        servers = [start(s["name"], "server", "--alloc", str(alloc), "--id", s["name"], "--metrics", str(metrics))
                   for s in allocation["fleet"]["reliable"]]
        entry = job.stages[0].frontal[0].address
        clients = [start(f"c{k}", "client", "--join", entry, "--name", f"c{k}", "--stage", str(k)) for k in (0, 1)]
        chooser = start("chooser", "client", "--join", entry, "--name", "chooser")  # picks its stage by probing
        victim = start("victim", "client", "--join", entry, "--name", "victim", "--stage", "0")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)
        assert metrics.exists(), "no step finished"
        os.kill(victim.pid, signal.SIGKILL)
        for p in servers + clients + [chooser]:
            assert p.wait(max(1, deadline - time.monotonic())) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    losses = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}
    reference, _ = reference_run(job)
    assert [losses[s] for s in range(job.steps)] == pytest.approx(reference, abs=1e-5)
    assert "joins stage" in (tmp_path / "chooser.log").read_text()
