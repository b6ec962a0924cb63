"""One rank of test_compiled_training's FSDP2 and DTensor cases: PyTorch's own parallel modules
on dipu over dicomm, compiled by Inductor, against the same modules eager, in one run. Writes
``{case: [eager losses], case + "/compiled": [...], case + "/graphs": graphs Dynamo compiled}`` to
argv[1] from rank 0."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import ditorch  # noqa: F401  (dipu and dicomm)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to("dipu")


def train(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device="dipu"), torch.randn(8, 16, device="dipu")
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fsdp2(compiled: bool) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(mlp(), mlp())  # two blocks, each its own FSDP unit, as a model's layers
    if compiled:  # regional, before sharding, as torchtitan does: FSDP's hooks stay eager around each block
        for block in model:
            block.compile()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return train(model)


def dtensor_tp(compiled: bool) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("dipu", (dist.get_world_size(),))
    model = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return train(torch.compile(model) if compiled else model)


def main() -> None:
    dist.init_process_group("dicomm")
    torch.dipu.set_device(0)
    from torch._dynamo.utils import counters

    out = {}
    for name, case in (("fsdp2", fsdp2), ("dtensor", dtensor_tp)):
        out[name] = case(False)
        counters.clear()
        out[name + "/compiled"] = case(True)
        out[name + "/graphs"] = counters["stats"]["unique_graphs"]
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
