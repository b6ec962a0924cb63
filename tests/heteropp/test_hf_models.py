"""Hugging Face models in one process: the planner's counts against the transformers model itself,
a stage of the whole model against the model's own forward and backward, starting weights from
local safetensors, and the refusals of configs, TP sizes and weights that do not fit."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from dimodel import hf  # noqa: E402
from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.runtime.hf_stage import HFStageModule, causal_mask  # noqa: E402
from heteropp.runtime.tensor_parallel import SINGLE  # noqa: E402


@st.composite
def hf_configs(draw) -> dict:
    """Small configs of every supported family with the variations real checkpoints have: GQA,
    head widths apart from hidden / heads, tied embeddings, sliding windows, q/k/v biases."""
    family = draw(st.sampled_from(sorted(hf.FAMILIES)))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 12, 16]))
    values = {"model_type": family, "vocab_size": draw(st.sampled_from([64, 96, 130])),
              "hidden_size": heads * head_dim, "intermediate_size": draw(st.sampled_from([24, 40])),
              "num_hidden_layers": draw(st.integers(1, 3)), "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": 64,
              "tie_word_embeddings": draw(st.booleans()), "rope_theta": draw(st.sampled_from([10000.0, 500000.0]))}
    if family in ("qwen3", "mistral") and draw(st.booleans()):
        values["head_dim"] = draw(st.sampled_from([8, 20]))  # apart from hidden / heads
    if family == "mistral":
        values["sliding_window"] = draw(st.sampled_from([None, 3, 4096]))
    if family == "qwen2" and draw(st.booleans()):
        values.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return values


@settings(max_examples=25, deadline=None)
@given(values=hf_configs())
def test_planner_counts_the_parameters_transformers_builds(values):
    spec = ModelSpec.from_hf_dict(values, seq=16)
    with torch.device("meta"):
        model = hf.causal_lm(hf.load_config(values))
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert spec.params_per_layer == sum(p.numel() for p in layer.parameters())


@settings(max_examples=12, deadline=None)
@given(values=hf_configs(), seed=st.integers(0, 2**16))
def test_a_whole_model_stage_computes_what_the_transformers_model_computes(values, seed):
    config = hf.load_config(values)
    state = hf.initial_state(config, seed)
    model = hf.causal_lm(config)
    model.load_state_dict(state)
    stage = HFStageModule(config, (0, config.num_hidden_layers), True, True, SINGLE)
    stage.load_full(state)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    logits = model(input_ids=tokens[:, :-1]).logits
    ref = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss = stage(tokens[:, :-1], tokens[:, 1:])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    ref.backward()
    loss.backward()
    grads = {n: p.grad for n, p in stage.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_the_mask_is_causal_within_the_window_by_hand():
    allowed = causal_mask(5, 2, torch.device("cpu"))[0, 0] == 0
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]).bool()
    assert torch.equal(allowed, expect)
    assert torch.equal(causal_mask(4, None, torch.device("cpu"))[0, 0] == 0, torch.ones(4, 4).tril().bool())


def _tiny(**extra) -> dict:
    return {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32, **extra}


def test_weights_in_a_model_directory_are_the_starting_point(tmp_path):
    config = hf.load_config(_tiny(tie_word_embeddings=True))
    state = hf.initial_state(config, seed=7)
    hf.export_pretrained(tmp_path, config, state)
    spec = ModelSpec.from_hf(tmp_path, seq=16)
    assert spec.weights == str(tmp_path.resolve())
    from heteropp.runtime.model_family import model_family

    loaded = model_family(spec).initial_state(seed=0)  # the seed does not matter: the weights do
    assert sorted(loaded) == sorted(state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    # a stage reads only its own tensors; the tied head is the stored embedding
    some = model_family(spec).initial_state(seed=0, names=["lm_head.weight", "model.norm.weight"])
    assert sorted(some) == ["lm_head.weight", "model.norm.weight"]
    assert torch.equal(some["lm_head.weight"], state["model.embed_tokens.weight"])


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    config = hf.load_config(_tiny())
    state = hf.initial_state(config, seed=0)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(40, 32)
    hf.export_pretrained(tmp_path / "bad-shape", config, state)
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(40, 32\), the config expects \(48, 32\)"):
        ModelSpec.from_hf(tmp_path / "bad-shape")
    del state["model.layers.0.mlp.up_proj.weight"]
    hf.export_pretrained(tmp_path / "missing", config, state)
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"):
        ModelSpec.from_hf(tmp_path / "missing")


@pytest.mark.parametrize("values, message", [
    ({"model_type": "gpt2", "n_layer": 2}, r"model_type 'gpt2' is not supported; expected one of \['llama', "),
    (_tiny(model_type="llama", attention_bias=True), r"llama config has attention_bias=true"),
    (_tiny(model_type="llama", mlp_bias=True), r"llama config has mlp_bias=true"),
])
def test_unsupported_configs_are_refused_naming_the_value(values, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf(tmp_path / "config.json")


@pytest.mark.parametrize("heads, kv, ffn, vocab, tp, what", [
    (4, 2, 48, 48, 3, "num_attention_heads=4"), (4, 2, 48, 48, 4, "num_key_value_heads=2"),
    (6, 3, 50, 48, 3, "intermediate_size=50"), (4, 4, 48, 50, 4, "vocab_size=50")])
def test_a_tp_that_does_not_split_the_model_is_refused(heads, kv, ffn, vocab, tp, what):
    config = hf.load_config(_tiny(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=heads * 8,
                                  intermediate_size=ffn, vocab_size=vocab))
    with pytest.raises(ValueError, match=rf"stage 0: tp={tp} does not divide the model's {what}"):
        hf.check_tp(config, tp, "stage 0")


def test_a_hf_model_spec_round_trips_through_the_plan_files_form():
    spec = ModelSpec.from_hf_dict(_tiny(tie_word_embeddings=True, head_dim=12), seq=16, name="tiny", weights="/w")
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())), name="tiny")
    assert again == spec
    assert again.qk_norm and again.tied_embeddings and again.head_dim == 12 and again.q_dim == 48


def test_ditorch_plan_plans_a_hf_config_and_the_plan_carries_it(tmp_path, capsys):
    """The whole planning path from a config.json: the plan file holds the config itself, and
    the layer count and vocabulary the planner split are the config's."""
    from heteropp import Plan
    from heteropp.cli import main

    from heteropp_cases import CONFIGS

    values = _tiny(num_hidden_layers=16, vocab_size=256, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(values))
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(CONFIGS / "cluster-exp-a-1.yaml"), "--model", str(tmp_path / "config.json"),
                 "--seq", "32", "--gbs", "64K", "--out", str(out)]) == 0
    plan = Plan.from_json(out)
    assert json.loads(plan.model.hf_config) == values
    assert sum(s.layers for s in plan.stages) == 16 and plan.model.vocab == 256 and plan.model.seq == 32
    assert plan.model.tied_embeddings and plan.model.qk_norm

