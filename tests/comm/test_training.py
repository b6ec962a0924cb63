"""Training stacks on top of dicomm match a single-process run: DDP, FSDP2 and 1F1B pipelining."""
from __future__ import annotations

import pytest
import torch

from launcher import run_ranks

STEPS = 3
LR = 0.05


def tiny_llama():
    from dimodel.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16))


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, 64, (2, 9), generator=g)


def single_process_llama(world: int) -> dict[str, torch.Tensor]:
    """The reference: one process sees every rank's batch; loss = mean of the ranks' losses."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(model.loss(batch(r, step)) for r in range(world)) / world
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def train_all(rank: int, world: int, _port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    # DDP
    model = DDP(tiny_llama())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        tokens = batch(rank, step)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    out["ddp"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    # FSDP2: parameters sharded across the ranks; gather them back to compare
    mesh = init_device_mesh("cpu", (world,))
    fmodel = tiny_llama()
    for layer in fmodel.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fmodel, mesh=mesh)
    fopt = torch.optim.SGD(fmodel.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        fopt.zero_grad()
        tokens = batch(rank, step)
        logits = fmodel(tokens[:, :-1])  # through forward(): FSDP2's hooks unshard the root's params
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        fopt.step()
        losses.append(loss.item())
    out["fsdp"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in fmodel.state_dict().items()}

    # 1F1B pipeline over 2 stages (ranks 0 and 1), 4 microbatches
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    full = mlp()
    stage_mod = full[:4] if rank == 0 else full[4:]
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    if rank < 2:
        pg = dist.new_group([0, 1], backend="dicomm")
        stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"), group=pg)
        sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        pipe_losses = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=pipe_losses)
        out["pipe_grads"] = {n: p.grad.clone() for n, p in stage_mod.named_parameters()}
        out["pipe_losses"] = [l.item() for l in pipe_losses]
    else:
        dist.new_group([0, 1], backend="dicomm")
    return out


@pytest.mark.timeout(240)
def test_ddp_fsdp2_pipeline_match_single_process():
    world = 2
    results = run_ranks(train_all, world)
    ref = single_process_llama(world)
    for r in range(world):
        for k, v in ref.items():
            torch.testing.assert_close(results[r]["ddp"][k], v, rtol=1e-4, atol=1e-5, msg=f"DDP rank {r} {k}")
            torch.testing.assert_close(results[r]["fsdp"][k], v, rtol=1e-4, atol=1e-5, msg=f"FSDP2 rank {r} {k}")
    # pipeline reference: the whole model in one process, microbatch gradients averaged
    full = mlp()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(6))
    ref_losses = []
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        loss = torch.nn.functional.mse_loss(full(xm), ym)
        (loss / 4).backward()  # the schedule scales gradients by 1 / n_microbatches
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(results[1]["pipe_losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    ref_grads = {n: p.grad for n, p in full.named_parameters()}
    for n, g in results[0]["pipe_grads"].items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"stage 0 grad {n}")
    for n, g in results[1]["pipe_grads"].items():
        # nn.Sequential slices keep the parent's child names ("4.weight", ...)
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"stage 1 grad {n}")
