"""Hugging Face models train exactly on the pipeline runtime: for each supported family, an fp32
run under torchrun over a plan whose stages change TP equals the family's own ``*ForCausalLM``
trained in one CPU process (``ditorch.train --reference``'s loop) within 1e-5 relative, step by
step, and so does the held-out loss it logs every other step; and the model ``--save`` exports
loads with ``from_pretrained`` and gives the reference's logits."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.runtime.reference import train_reference  # noqa: E402
from heteropp.runtime.trainer import TrainOptions  # noqa: E402
from plans import make_plan, torchrun  # noqa: E402

STEPS = 4
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
# family: (config extras, stages (chip, tp, layers, recompute), dp, extra ditorch.train arguments, token file);
# the mistral case starts from weights in the model directory (of another seed than the run's).
CASES = {
    "llama tp2-to-tp1 1f1b": ({}, [("X", 2, 2, False), ("Y", 1, 2, False)], 1, ["--schedule", "1f1b"], False),
    "qwen2 tied biases dp2 zero1 fine-grained": ({"tie_word_embeddings": True},
                                                 [("X", 1, 2, False), ("Y", 1, 2, False)], 2,
                                                 ["--schedule", "fine-grained", "--zero1"], True),
    "qwen3 tied head_dim tp1-to-tp2 gpipe replicated": ({"tie_word_embeddings": True, "head_dim": 24},
                                                        [("X", 1, 2, False), ("Y", 2, 2, False)], 1,
                                                        ["--schedule", "gpipe", "--no-sequence-parallel"], True),
    "mistral sliding window tp2-to-tp1 recompute naive": ({"sliding_window": 8},
                                                          [("X", 2, 2, False), ("Y", 1, 2, True)], 1,
                                                          ["--reshard", "naive"], False),
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_hf_model_trains_on_the_pipeline_as_in_one_process(case, tmp_path):
    from transformers import AutoModelForCausalLM

    extra_config, stages, dp, args, token_file = CASES[case]
    family = case.split()[0]
    values = {"model_type": family, **SMALL, **extra_config}
    if family == "mistral":
        from dimodel import hf

        config = hf.load_config(values)
        hf.export_pretrained(tmp_path / "model", config, hf.initial_state(config, seed=5))
        spec = ModelSpec.from_hf(tmp_path / "model")
        assert spec.weights
    else:
        (tmp_path / "config.json").write_text(json.dumps(values))
        spec = ModelSpec.from_hf(tmp_path / "config.json")
    plan = make_plan(stages, dp=dp, model=spec)
    plan.to_json(tmp_path / "plan.json")
    data = []
    if token_file:  # ids over the whole vocabulary, unlike the byte corpus's
        np.random.default_rng(1).integers(0, SMALL["vocab_size"], 5000).astype(np.uint16).tofile(tmp_path / "t.bin")
        data = ["--data", str(tmp_path / "t.bin")]
    run = torchrun(tmp_path / "plan.json", plan.num_chips,
                   ["--steps", str(STEPS), "--precision", "fp32", "--clip", "0.05", "--loss-log", "run.jsonl",
                    "--save", "ckpt", "--check-replicas", "1", "--eval-every", "2", "--eval-batches", "2", *data, *args],
                   tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    options = TrainOptions(steps=STEPS, clip=0.05, progress=False, data=tmp_path / "t.bin" if token_file else None,
                           eval_every=2, eval_batches=2, log=tmp_path / "ref.jsonl")
    _, ref_model = train_reference(plan, options)
    run_log, ref_log = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                        for name in ("run.jsonl", "ref.jsonl"))
    assert len(run_log) == STEPS
    for a, b in zip(run_log, ref_log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"step {a['step']}: pipeline {a} vs reference {b}"
        assert ("val_loss" in a) == (a["step"] % 2 == 0)
        if "val_loss" in a:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5), f"held-out: pipeline {a} vs reference {b}"

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf", dtype=torch.float32)
    assert type(exported) is type(ref_model)
    ref_state, state = ref_model.state_dict(), exported.state_dict()
    assert sorted(state) == sorted(ref_state)
    # A k bias adds the same q.b to every score of a query, which softmax ignores: its gradient is
    # zero but for rounding, and AdamW turns rounding into full-size steps. Nothing to compare.
    worst = max((_relative(state[k], v), k) for k, v in ref_state.items() if not k.endswith("k_proj.bias"))
    assert worst[0] < 1e-5, f"parameter {worst[1]} differs by {worst[0]:.2e} relative"
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _relative(exported(input_ids=tokens).logits, ref_model(input_ids=tokens).logits) < 1e-5
