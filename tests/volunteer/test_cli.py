"""The commands a user runs, as separate processes: plan, four servers and clients; the losses
equal single-process training's. On loopback through the demo (examples/volunteer_demo.py: a
client killed with SIGKILL, one leaving, one joining late), and across three emulated hosts."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from emulated_hosts import can_make_hosts, emulated_hosts
from volunteer.cli import load_job
from volunteer.reference import reference_run

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=256, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)


def ditorch(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ditorch.cli", *args], cwd=ROOT, **kwargs)


def devices_yaml(path: Path, addresses: list[str]) -> None:
    """Two sites of two reliable devices each, far apart; three unreliable devices. No device can
    hold more than two of the model's four layers, so the model needs two stages."""
    far, near = 80.0, 0.5
    site = [0, 0, 1, 1]
    delay = [[0.0 if i == j else (near if site[i] == site[j] else far) for j in range(4)] for i in range(4)]
    bw = [[10000.0 if site[i] == site[j] else 100.0 for j in range(4)] for i in range(4)]
    path.write_text(yaml.safe_dump({
        "reliable": [{"name": f"s{i}", "tflops": 10.0, "memory_gb": 0.0004, "address": addresses[i]} for i in range(4)],
        "unreliable": [{"name": f"u{i}", "tflops": 5.0, "memory_gb": 0.0004} for i in range(3)],
        "reliable_delay_ms": delay, "reliable_bandwidth_mbps": bw,
        "unreliable_delay_ms": [[1, 1, far, far], [far, far, 1, 1], [1, 1, far, far]],
        "unreliable_bandwidth_mbps": [[1000, 1000, 10, 10], [10, 10, 1000, 1000], [1000, 1000, 10, 10]],
    }))


def run_job(tmp_path: Path, addresses: list[str], on_host=lambda name: [], bind=None) -> None:
    """Plan, then start the four servers and the clients as processes (``on_host(name)`` wraps
    each command to run on an emulated host, ``bind(name)`` is a server's --bind), and check the
    losses against single-process training."""
    devices, model, alloc = tmp_path / "devices.yaml", tmp_path / "model.yaml", tmp_path / "alloc.json"
    devices_yaml(devices, addresses)
    model.write_text(yaml.safe_dump(MODEL))
    token = tmp_path / "job.key"
    assert ditorch("volunteer", "token", str(token), stdout=subprocess.DEVNULL).wait(60) == 0
    servers_token = tmp_path / "servers.key"
    assert ditorch("volunteer", "token", str(servers_token), stdout=subprocess.DEVNULL).wait(60) == 0
    plan = subprocess.run([sys.executable, "-m", "ditorch.cli", "volunteer", "plan", "--devices", str(devices),
                           "--model", str(model), "--batch", "8", "--microbatches", "2", "--steps", "4",
                           "--lr", "0.01", "--out", str(alloc)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    allocation = json.loads(alloc.read_text())
    assert len(allocation["stages"]) == 2  # the two sites
    # The job's own timeouts: no client is killed here, and on a loaded host shorter ones redo
    # work that was only slow, again and again.
    job = load_job(str(alloc))
    metrics = tmp_path / "loss.jsonl"
    logs = {}
    procs = []

    def start(name: str, *args: str) -> subprocess.Popen:
        logs[name] = open(tmp_path / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "ditorch.cli", "volunteer", *args, "--token-file", str(token)]
        p = subprocess.Popen(on_host(name) + cmd, cwd=ROOT, stdout=logs[name], stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        servers = [start(s["name"], "server", "--alloc", str(alloc), "--id", s["name"], "--metrics", str(metrics),
                         "--server-token-file", str(servers_token),
                         *(["--bind", bind(s["name"])] if bind else []))
                   for s in allocation["fleet"]["reliable"]]
        entry = job.stages[0].frontal[0].address
        clients = [start(f"c{k}", "client", "--join", entry, "--name", f"c{k}", "--stage", str(k)) for k in (0, 1)]
        clients.append(start("chooser", "client", "--join", entry, "--name", "chooser"))  # picks its stage by probing
        deadline = time.monotonic() + 150
        for p in servers + clients:
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


@pytest.mark.slow
def test_the_demo_kills_a_client_and_still_equals_single_process_training(tmp_path, capsys):
    """examples/volunteer_demo.py, every client on the exact host chip: its MRE check against
    ``ditorch volunteer reference`` at 0.001% (a row lost or counted twice moves a loss by ~1/B)."""
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump(MODEL))
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import volunteer_demo
    finally:
        sys.path.remove(str(ROOT / "examples"))
    rc = volunteer_demo.main(["--model", str(model), "--steps", "8", "--seq", "16", "--chip", "host",
                              "--emulate-tflops", "1e-5", "--threshold", "0.001", "--timeout", "150", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "SIGKILL victim" in out and "PASS: MRE < 0.001%" in out, out
    late = re.search(r"late computed (\d+) task", out)
    assert "late joins stage" in out and late and int(late.group(1)) > 0, out  # paced: it arrives in time


@pytest.mark.slow
@pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))
def test_stages_and_clients_on_three_hosts(tmp_path):
    """Each stage's servers on a host of their own, listening on all interfaces and advertised by
    host name; the clients on a third host behind a 50 Mbit/s link."""
    with emulated_hosts(3) as hosts:
        subprocess.run(["tc", "-n", hosts[2].ns, "qdisc", "add", "dev", hosts[2].dev, "root", "tbf", "rate",
                        "50mbit", "burst", "256kb", "latency", "100ms"], check=True, capture_output=True)
        place = {f"s{i}": hosts[i // 2] for i in range(4)}
        addresses = [f"{place[f's{i}'].name}:{7300 + i}" for i in range(4)]
        run_job(tmp_path, addresses, on_host=lambda name: place.get(name, hosts[2]).run([]),
                bind=lambda name: f"0.0.0.0:{7300 + int(name[1:])}")


def test_a_volunteer_job_plans_a_hugging_face_config_with_a_token_file(tmp_path):
    """`ditorch volunteer plan --model config.json --data tokens.bin` writes a job whose servers
    build the Hugging Face model's stages and read the token file."""
    pytest.importorskip("transformers")
    import numpy as np

    from ditorch.cli import main as ditorch_main

    values = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(values))
    (np.arange(640) % 64).astype(np.uint16).tofile(tmp_path / "t.bin")
    devices_yaml(tmp_path / "devices.yaml", [f"127.0.0.1:{7300 + i}" for i in range(4)])
    fleet = yaml.safe_load((tmp_path / "devices.yaml").read_text())
    for device in fleet["reliable"] + fleet["unreliable"]:
        device["memory_gb"] = 0.01  # the Qwen3 is larger than the LLaMA of the other tests
    (tmp_path / "devices.yaml").write_text(yaml.safe_dump(fleet))
    assert ditorch_main(["volunteer", "plan", "--devices", str(tmp_path / "devices.yaml"), "--model",
                         str(tmp_path / "config.json"), "--data", str(tmp_path / "t.bin"), "--seq", "16", "--batch", "8",
                         "--microbatches", "2", "--out", str(tmp_path / "alloc.json")]) == 0
    job = load_job(str(tmp_path / "alloc.json"))
    assert job.model == values and job.data == str(tmp_path / "t.bin") and job.seq == 16
    assert job.training_tokens()[:10].tolist() == list(range(10))
    names = [n for k in range(len(job.stages)) for n, _ in job.stage_module(k).named_parameters()]
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" in names
