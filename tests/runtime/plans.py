"""Small plans and a launcher for runtime tests: each run is ``ditorch.train`` (or a script) on ranks
set up as ``torchrun --standalone`` sets up its workers."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import yaml

from forked_ranks import torchrun_like
from heteropp.cluster import ClusterSpec
from heteropp.model_spec import ModelSpec
from heteropp.plan import Plan, StagePlan

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
         "max_seq_len": 32}
# Chips with exact fp32 numerics and host speed (the runtime, not the chip model, is under test),
# and the paper's A and C for the mixed-precision runs.
EXACT_CHIPS = {
    "X": {"memory_gb": 96, "relative_speed": 2.0, "chips_per_node": 8, "nics_per_node": 8},
    "Y": {"memory_gb": 64, "relative_speed": 2.0, "chips_per_node": 8, "nics_per_node": 8},
    "Z": {"memory_gb": 32, "relative_speed": 2.0, "chips_per_node": 8, "nics_per_node": 8},
}


def _cluster(names) -> ClusterSpec:
    memory = {"X": 96, "Y": 64, "Z": 32, "Q": 16, "A": 96, "B": 64, "C": 32, "D": 32}
    chip = lambda n: {"count": 8, "memory_gb": memory[n], "chips_per_node": 8, "tp_max": 4, "intra_node_gbps": 10,
                      "hbm_gbps": 100, "nic_gbps": 1, "effective_tflops": 1}
    return ClusterSpec.from_dict({"chips": {n: chip(n) for n in names},
                                  "links": {"inter_node": {"bandwidth_gbps": 1}, "inter_cluster": {"bandwidth_gbps": 1}}})


def make_plan(stages: list[tuple[str, int, int, bool]], dp: int = 1, microbatches: int = 4,
              model: dict | ModelSpec | None = None, schedule: str = "1f1b") -> Plan:
    """stages: (chip, tp, layers, recompute) in pipeline order; ``model``: the project's LLaMA's
    keys, or a ModelSpec (e.g. of a Hugging Face config)."""
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_dict(model or MODEL, name="test-llama")
    out, layer, rank = [], 0, 0
    for chip, tp, layers, rc in stages:
        out.append(StagePlan(chip=chip, tp=tp, dp=dp, layers=layers, first_layer=layer, recompute=rc, first_rank=rank))
        layer += layers
        rank += tp * dp
    plan = Plan(model=spec, cluster=_cluster(sorted({s[0] for s in stages})),
                global_batch_tokens=microbatches * dp * spec.seq, dp=dp, stages=tuple(out), schedule=schedule)
    plan.validate()
    return plan


def chip_file(tmp: Path) -> Path:
    """``tmp/chips.yaml`` with EXACT_CHIPS. Written whole under another name and renamed into
    place: a test calls this for every process it starts, and a process started before reads
    the file while a later call would otherwise be rewriting it."""
    path = tmp / "chips.yaml"
    text = yaml.safe_dump({"emulated_chips": EXACT_CHIPS})
    if not path.exists() or path.read_text() != text:
        part = path.with_name(f".chips.yaml.{os.getpid()}")
        part.write_text(text)
        os.replace(part, path)
    return path


def torchrun(plan_path: Path, nproc: int, args: list[str], tmp: Path, timeout: float = 240,
             env: dict | None = None, hosts: list | None = None) -> subprocess.CompletedProcess:
    """``ditorch.train --plan plan_path *args`` on ``nproc`` ranks, as ``torchrun --standalone`` would run it
    (spread over emulated ``hosts`` in rank order, as ``torchrun --nnodes`` would, if given)."""
    return _launch(["-m", "ditorch.train", "--plan", str(plan_path), "--quiet", *args], nproc, tmp, timeout, env,
                   hosts)


def torchrun_script(script: Path, nproc: int, args: list[str], tmp: Path, timeout: float = 240,
                    env: dict | None = None, hosts: list | None = None) -> subprocess.CompletedProcess:
    """``script *args`` on ``nproc`` ranks, with the same chips (and ``hosts``) as :func:`torchrun`."""
    return _launch([str(script), *args], nproc, tmp, timeout, env, hosts)


def _launch(target: list[str], nproc: int, tmp: Path, timeout: float, env: dict | None,
            hosts: list | None = None) -> subprocess.CompletedProcess:
    """On ranks forked with torch imported (tests/forked_ranks.py): what a test checks here is the
    training, not the launcher; tests/ft, test_multihost.py, test_vendors.py and
    tests/comm/test_across_hosts.py launch the real torchrun."""
    full_env = dict(os.environ, DITORCH_PROFILE_FILE=str(chip_file(tmp)), DITORCH_MEMORY_SCALE="0.001",
                    PYTHONPATH=str(ROOT))
    full_env.update(env or {})
    return torchrun_like(target, nproc, full_env, tmp, timeout, hosts)


def kill_tree(pid: int) -> None:
    """SIGKILL a torchrun and every process under it (its workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
