"""An in-process Di-PS (leader + followers as threads) for protocol tests."""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from dips.auth import JobToken
from dips.follower import Follower
from diutil.address import free_port
from dips.leader import Leader, LeaderConfig
from dips.model import build_model, load_config


ROOT = Path(__file__).resolve().parents[2]
MODEL = load_config(ROOT / "examples/configs/llama-tiny.yaml")


@contextlib.contextmanager
def in_process_ps(tmp_path, n_followers: int = 2, tls=None, **leader_kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    token = JobToken.create(tmp_path / "job.key")
    server_token = JobToken.create(tmp_path / "servers.key")
    cfg = LeaderConfig(**{"model": MODEL, **leader_kw}, n_followers=n_followers, bind="127.0.0.1:0",
                       metadata=str(tmp_path / "leader.json"), restart_followers=False)
    leader = Leader(cfg, token, server_token, tls)
    followers = _start_followers(leader, server_token, tmp_path, n_followers, tls,
                                 wait=not cfg.seed_from_cluster)
    try:
        yield leader, followers, token
    finally:
        for f in followers:
            f.stop()
        leader.stop()


def _start_followers(leader, server_token, tmp_path, n: int, tls, wait: bool) -> list:
    """``n`` followers; without ``wait`` they register in the background (a seeded PS holds
    them back until a cluster brings the model) and the list fills as they do."""
    def start(i: int) -> None:
        followers.append(Follower(leader.address, f"127.0.0.1:{free_port()}", server_token, tmp_path / f"f{i}",
                                  tls=tls))

    followers: list = []
    for i in range(n):
        if wait:
            start(i)
        else:
            threading.Thread(target=start, args=(i,), daemon=True).start()
    return followers


def global_params(leader, token) -> dict[str, torch.Tensor]:
    from dips.client import OuterClient

    model = build_model(MODEL, 0)
    reader = OuterClient(model, leader.address, 1, token=token, join=False)
    reader.fetch_global()
    reader.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def perturb(model, seed: int, scale: float = 0.01) -> None:
    """Stand-in for inner training: a seeded random change of every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
