"""Spawned ranks that end right after a backward on emulated chips (tests/device/test_exit.py)."""
from __future__ import annotations

import sys

CHIPS = ("B", "C", "B", "C")


def rank(index: int) -> None:
    """One emulated chip: a few layers' forward under autocast and backward, then return (the
    process exits at once, as a profiling worker does)."""
    import torch

    import ditorch_ext

    torch.set_num_threads(1)
    ditorch_ext.set_chip(CHIPS[index], memory_scale=0.01, time_scale=1.0)
    with torch.device("dipu:0"):
        layers = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
        x = torch.randn(32, 128)
    for _ in range(3):
        with torch.autocast("dipu", dtype=torch.bfloat16):
            y = layers(x.detach().requires_grad_())
        y.float().sum().backward()


def main() -> int:
    import torch.multiprocessing as mp

    # ProcessExitedException (a rank killed by SIGABRT) ends this process with an error
    mp.start_processes(rank, nprocs=len(CHIPS), start_method="spawn")
    print("all ranks exited with 0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
