"""What the precision tools cost on a training step of the small LLaMA, on CPU: the step with
the tools imported and off (the peer), and inside ``time_ops()`` and ``overflow_check()``.
A process that never imported ``ditorch.tools`` cannot share this one, so the target
(tools off within 5% of never imported) is measured by benchmarks/tools_overhead.py, which
runs each side in a process of its own."""
from __future__ import annotations

import contextlib

import pytest
import torch

from ditorch import tools
from dimodel import Llama, LlamaConfig

SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=64)
TOOLS = {"off": contextlib.nullcontext, "time_ops": tools.time_ops, "overflow_check": tools.overflow_check}


@pytest.mark.parametrize("tool", TOOLS)
def test_train_step_with_tool(benchmark, tool):
    benchmark.group = "precision tools on a llama train step (2 layers, dim 64, 8x64 tokens)"
    benchmark.extra_info["peer"] = tool == "off"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**SMALL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with TOOLS[tool]():
            loss = model.loss(tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    step()
    benchmark.pedantic(step, rounds=15, warmup_rounds=1)
    assert torch._C._len_torch_dispatch_stack() == 0  # every tool left the dispatch stack
