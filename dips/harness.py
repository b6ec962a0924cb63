"""Emulated training clusters on one machine: the shared harness of Di-PS tests and benchmarks.

Each cluster is a process training the tiny LLaMA on a real text corpus (the English text of
Python's own documentation topics, shipped with the standard library as ``pydoc_data``; bytes are
tokens, vocabulary 256). Heterogeneity is emulated by pacing: an inner step of cluster ``i``
takes ``step_s * (1 + delay_i)`` seconds (computation, then a sleep for the rest), so cluster
speeds do not depend on how the machine's few cores happen to be shared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diutil.address import free_port
from dimodel.datasets import sample_batch, text_corpus

REPO = Path(__file__).resolve().parent.parent


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, batches: int = 16, batch: int = 16, seq: int = 32) -> float:
    """Mean next-byte loss on fixed held-out windows (same windows for every caller)."""
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    losses = [model.loss(sample_batch(data, batch, seq, gen)).item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


@dataclasses.dataclass
class ClusterSpec:
    name: str
    leader: str
    token_file: str
    model: dict
    log: str
    inner_steps: int = 16
    batch: int = 8
    seq: int = 32
    inner_lr: float = 3e-3
    step_s: float = 0.0          # paced duration of an inner step at delay 0 (0: unpaced)
    delay: float = 0.0           # extra fraction of step_s (eta = 100 spreads these over 0..1)
    max_steps: int = 10_000
    seed: int = 0
    poison_scale: float = 1.0    # != 1: push parameters scaled by this (a faulty cluster) ...
    poison_from_step: int = 0    # ... from this inner step on
    heartbeat_s: float = 1.0
    go_file: str | None = None   # wait for this file to exist before training (a common start)
    dp: int = 1                  # data-parallel ranks inside the cluster (processes)
    backend: str = "gloo"        # torch.distributed backend inside the cluster ("dicomm" once built)
    dist_port: int = 0
    push_codec: str = "bf16"     # how pushes and pulls travel (dips.codec)
    pull_codec: str = "bf16"
    fragments: int = 1           # > 1: streamed pushes
    transfer_timeout_s: float = 30.0  # a slow link needs longer to move a whole model


def run_cluster(spec: ClusterSpec, rank: int = 0) -> None:
    """Train until the leader's token budget is spent (or ``max_steps``); rank 0 logs JSON lines.

    With ``spec.dp > 1`` this is one data-parallel rank: gradients are all-reduced with
    ``spec.backend`` and the OuterClient's rank 0 speaks for the cluster. SIGTERM makes the
    cluster leave after its current inner step, as a preempted job would; SIGKILL is a crash.
    """
    torch.set_num_threads(1)
    leaving = []
    signal.signal(signal.SIGTERM, lambda *_: leaving.append(True))
    import torch.distributed as dist

    from .auth import JobToken
    from .client import OuterClient
    from .model import build_model

    if spec.dp > 1:
        dist.init_process_group(spec.backend, init_method=f"tcp://127.0.0.1:{spec.dist_port}", rank=rank,
                                world_size=spec.dp)
    train, _ = text_corpus()
    model = build_model(spec.model, seed=1000 + spec.seed)  # replaced by the global parameters on join
    client = OuterClient(model, spec.leader, spec.inner_steps, token=JobToken.from_file(spec.token_file),
                         name=spec.name, heartbeat_s=spec.heartbeat_s, join=False, push_codec=spec.push_codec,
                         pull_codec=spec.pull_codec, fragments=spec.fragments,
                         transfer_timeout_s=spec.transfer_timeout_s)
    if not client.join(timeout_s=120.0):
        raise RuntimeError(f"cluster {spec.name} could not join the PS at {spec.leader}")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.inner_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    with open(spec.log if rank == 0 else f"{spec.log}.rank{rank}", "w", buffering=1) as log:
        log.write(json.dumps({"event": "ready", "t": time.time(), "base": client.base,  # the join's pull
                              "join_bytes": client.stats["pull_bytes"], "join_pulls": client.stats["pulls"]}) + "\n")
        while spec.go_file and not os.path.exists(spec.go_file):
            time.sleep(0.05)
        log.write(json.dumps({"event": "start", "t": time.time(), "base": client.base}) + "\n")
        for step in range(spec.max_steps):
            t0 = time.monotonic()
            x = sample_batch(train, spec.batch, spec.seq, gen)
            loss = model.loss(x)
            loss.backward()
            if spec.dp > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(spec.dp)
            opt.step()
            opt.zero_grad(set_to_none=True)
            compute_s = time.monotonic() - t0
            if spec.step_s > 0:
                time.sleep(max(0.0, spec.step_s * (1 + spec.delay) - compute_s))
            if spec.poison_scale != 1.0 and step >= spec.poison_from_step and (step + 1) % spec.inner_steps == 0:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(spec.poison_scale)
            updated = client.step(tokens=x[:, 1:].numel())
            log.write(json.dumps({"t": time.time(), "step": step, "loss": round(loss.item(), 4),
                                  "late": spec.step_s > 0 and compute_s > spec.step_s * (1 + spec.delay),
                                  "tokens": client.tokens_total, "updated": updated,
                                  "bytes": client.stats["push_bytes"] + client.stats["pull_bytes"],
                                  "base": client.base}) + "\n")
            if client.done or _any_rank(bool(leaving), spec.dp):
                break
        log.write(json.dumps({"event": "end", "t": time.time(), "left": bool(leaving), "stats": client.stats,
                              "checksum": [float(p.detach().double().sum()) for p in model.parameters()]}) + "\n")
    client.close()
    if spec.dp > 1:
        dist.destroy_process_group()


def _any_rank(flag: bool, world: int) -> bool:
    """True on every rank when ``flag`` is on any (ranks must leave at the same step)."""
    if world == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class ClusterProcesses:
    """The processes of one emulated cluster (one per data-parallel rank)."""

    def __init__(self, spec: ClusterSpec, wrap: Callable[[list[str]], list[str]] | None = None):
        if spec.dp > 1 and not spec.dist_port:
            spec = dataclasses.replace(spec, dist_port=free_port())
        self.spec = spec
        text = json.dumps(dataclasses.asdict(spec))
        # own sessions: a crash is emulated by killing a rank's whole process group
        self.ranks = [subprocess.Popen((wrap or list)([sys.executable, "-m", "dips.harness", text, str(r)]),
                                       env=python_env(), start_new_session=True) for r in range(spec.dp)]

    def alive(self) -> bool:
        return any(r.poll() is None for r in self.ranks)

    def join(self, timeout_s: float) -> list[int | None]:
        """Wait up to ``timeout_s`` in all; the ranks' exit codes (None: still running)."""
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.wait(max(0.0, deadline - time.monotonic()))
        return [r.poll() for r in self.ranks]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every rank's process group (SIGKILL: the cluster crashes)."""
        for r in self.ranks:
            if r.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the ranks that still run, then kill what ignores it."""
        self.signal(signal.SIGTERM)
        if None in self.join(timeout_s):
            self.signal(signal.SIGKILL)
            self.join(timeout_s)


def start_cluster(spec: ClusterSpec, wrap: Callable[[list[str]], list[str]] | None = None) -> ClusterProcesses:
    """Run :func:`run_cluster` in fresh processes, one per data-parallel rank; ``wrap`` turns
    each command into one that runs elsewhere (on an emulated host)."""
    return ClusterProcesses(spec, wrap)


def read_log(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def python_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def start_follower(leader: str, bind: str, server_token_file: str, ckpt_dir: str,
                   log_path: str | None = None) -> subprocess.Popen:
    """A follower PS as its own process, started with the CLI."""
    out = open(log_path, "a") if log_path else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "dips.cli", "follower", "--leader", leader, "--bind", bind,
                             "--server-token-file", server_token_file, "--checkpoint-dir", ckpt_dir,
                             "--log-level", "WARNING"],
                            env=python_env(), stdout=out, stderr=subprocess.STDOUT)


if __name__ == "__main__":  # one rank of an emulated cluster: python -m dips.harness SPEC_JSON RANK
    run_cluster(ClusterSpec(**json.loads(sys.argv[1])), int(sys.argv[2]))
