"""``ditorch.train --compile``: each stage's decoder layers compiled by Inductor on dipu train to the
eager run's fp32 losses over a plan whose TP changes between stages; ``--profile-steps`` writes a
trace per rank with the dipu kernels of the chosen steps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from heteropp.runtime.reference import train_reference
from heteropp.runtime.trainer import TrainOptions
from plans import make_plan, torchrun

STEPS = 3


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # Inductor compiles each stage's layers in every rank (1-3 minutes here)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One small plan, TP 2 then TP 1 (3 ranks), compiled and profiled at step 2, fp32; and the
    eager losses of the same training, from the one-process reference (the eager pipeline equals
    it in fp32 within 1e-5: tests/runtime/test_exactness.py)."""
    plan = make_plan([("X", 2, 2, False), ("Y", 1, 2, False)], microbatches=2)
    tmp = tmp_path_factory.mktemp("compiled")
    plan.to_json(tmp / "plan.json")
    # One compile thread per rank: Inductor's pool of compile workers per rank would put
    # 3 x cores processes on the cores the ranks share.
    run = torchrun(tmp / "plan.json", plan.num_chips,
                   ["--steps", str(STEPS), "--precision", "fp32", "--loss-log", "run.jsonl", "--compile",
                    "--profile-steps", "2-2"], tmp, timeout=600, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    eager, _ = train_reference(plan, TrainOptions(steps=STEPS, precision="fp32", progress=False))
    return tmp, eager


# The two tests of the module's compiled run share one xdist worker (its group): on two workers
# the run, Inductor's compile in 3 ranks, would be made twice.
@pytest.mark.xdist_group("compiled training")
def test_compiled_losses_equal_eager_over_a_tp_changing_plan(compiled):
    folder, eager = compiled
    losses = _losses(folder / "run.jsonl")
    assert len(eager) == len(losses) == STEPS
    for step, (a, b) in enumerate(zip(eager, losses), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: eager {a} compiled {b}"


@pytest.mark.xdist_group("compiled training")
def test_profile_steps_writes_one_trace_per_rank_with_the_dipu_kernels(compiled):
    for rank in range(3):
        trace = json.loads((compiled[0] / "profile" / f"rank{rank}.json").read_text())
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        assert any(k["name"] == "aten::mm [dipu]" for k in kernels), f"rank {rank}: no dipu matmul in the trace"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_hugging_face_stage_compiles_its_decoder_layers_to_eager_results(family):
    """One process, TP 1: the family's own decoder layers compiled on dipu give the eager stage's
    loss and gradients."""
    import copy

    import torch
    import transformers

    import ditorch  # noqa: F401
    from heteropp.runtime.hf_stage import HFStageModule
    from heteropp.runtime.tensor_parallel import TPGroup

    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    config = cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device("dipu"):
        eager = HFStageModule(config, (0, 2), True, True, TPGroup(None, 1, 0))
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    compiled = copy.deepcopy(eager)
    compiled.compile_layers()
    from torch._dynamo.utils import counters

    counters.clear()
    tokens = torch.randint(0, 256, (2, 16), device="dipu")
    targets = torch.randint(0, 256, (2, 16), device="dipu")
    losses = []
    for module in (eager, compiled):
        loss = module(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    assert counters["stats"]["unique_graphs"] >= 1  # the layers did compile
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), losses
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad.cpu(), rtol=1e-4, atol=1e-6, msg=name)


def test_fsdp2_and_dtensor_modules_compile_on_dipu_to_their_eager_losses(tmp_path):
    """PyTorch's fully_shard and tensor-parallel DTensor modules on dipu over dicomm (2 ranks),
    compiled with Inductor, against the same modules eager in the same run."""
    from plans import torchrun_script

    script = Path(__file__).with_name("compiled_parallel_proc.py")
    run = torchrun_script(script, 2, [str(tmp_path / "out.json")], tmp_path, timeout=600,
                          env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    # Dynamo traces the FSDP2 blocks' frames without capturing a graph in this torch (2.13) (not
    # diagnosed; docs/compile.md): for them only the run under torch.compile is checked.
    assert out["dtensor/graphs"] >= 1, "the DTensor module did not compile"
    for case in ("fsdp2", "dtensor"):
        for step, (a, b) in enumerate(zip(out[case], out[case + "/compiled"]), 1):
            assert abs(a - b) <= 1e-5 * abs(a), f"{case} step {step}: eager {a} compiled {b}"
