"""A DDP job for tests/comm/test_across_hosts.py, launched by torchrun on each emulated host:
a small MLP, each rank training on its shard of a seeded global batch; rank 0 saves the result."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import dicomm  # noqa: F401  (registers the backend)

STEPS, BATCH = 5, 16


def model_and_data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model and the global batch every rank (and the test's reference) starts from."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(BATCH, 8)
    y = x.sum(dim=1, keepdim=True).sin()
    return model, x, y


def main(out: str) -> None:
    dist.init_process_group("dicomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = model_and_data()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
        opt.step()
    if rank == 0:
        torch.save(model.state_dict(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
