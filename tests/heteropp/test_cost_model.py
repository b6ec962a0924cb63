import sys

import pytest

from heteropp import StageCost, pipeline_time
from heteropp.model_spec import ModelSpec

from heteropp_cases import CONFIGS, ROOT


def test_paper_formula_by_hand():
    # stages 2 s, 3 s, 1 s per micro-batch, updates 0.5 / 0 / 0; b = 4, alpha = 1:
    # stage 1: 4*3 + 0 + (2 + 1) = 15; stage 0: 4*2 + 0.5 + (3 + 1) = 12.5; stage 2: 4 + 5 = 9
    stages = [StageCost(2.0, 0.0, 0.5), StageCost(3.0, 0.0, 0.0), StageCost(1.0, 0.0, 0.0)]
    assert pipeline_time(stages, 4, alpha=1.0) == pytest.approx(15.0)
    assert pipeline_time(stages, 4, alpha=0.0) == pytest.approx(12.0)
    with pytest.raises(ValueError, match="num_microbatches"):
        pipeline_time(stages, 0)


def test_parameter_count_matches_the_reference_model():
    import importlib.util

    import torch  # noqa: F401  (the reference module needs it)

    spec = importlib.util.spec_from_file_location("llama_ref", ROOT / "ditorch" / "models" / "llama.py")
    llama = importlib.util.module_from_spec(spec)
    sys.modules["llama_ref"] = llama  # dataclasses look their module up
    spec.loader.exec_module(llama)
    cfg = llama.LlamaConfig.from_yaml(CONFIGS / "llama-tiny.yaml")
    model = llama.Llama(cfg)
    ours = ModelSpec.from_yaml(CONFIGS / "llama-tiny.yaml")
    assert sum(p.numel() for p in model.parameters()) == ours.total_params


def test_table4_model_is_about_100b():
    m = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    assert m.kv_heads == 8 and m.head_dim == 128
    assert 100e9 < m.total_params < 105e9


def test_a_recomputing_stage_holds_one_micro_batch_of_every_layer_at_once():
    """The runtime's R re-runs a recomputing stage's whole forward for one micro-batch (F kept
    only inputs), so its peak is that micro-batch's activations of all its layers on top of the
    kept inputs: by hand for 8 layers at TP 2, 3 micro-batches in flight, 5 MiB measured a layer."""
    m = ModelSpec(n_layers=16, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256, seq=128)
    measured = 5 * 2**20
    state = m.state_bytes(8, 2, 1, False, False)
    kept = 3 * 8 * 128 * 256 * 2 / 2  # each layer's bf16 input, per micro-batch in flight
    assert m.stage_memory_bytes(8, 2, 1, True, 3, False, False, measured) == pytest.approx(state + kept + 8 * measured)
    # without recompute: every layer's activations of each micro-batch in flight, nothing re-made
    assert m.stage_memory_bytes(8, 2, 1, False, 3, False, False, measured) == pytest.approx(state + 3 * 8 * measured)


def test_state_bytes_follow_the_runtime_layout():
    """The runtime keeps an fp32 weight and an fp32 gradient per parameter on every chip, and
    AdamW's m and v (8 B) at DP 1, or under ZeRO-1 (DP > 1) m, v and the reduced gradient
    slice (12 B) split over DP: by hand for one layer of a small model."""
    m = ModelSpec(n_layers=4, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256, seq=128)
    p = m.params_per_layer
    assert m.state_bytes(1, 1, 1, False, False) == pytest.approx(p * 16)
    assert m.state_bytes(1, 2, 2, False, False) == pytest.approx(p / 2 * (8 + 12 / 2))
    assert m.state_bytes(3, 1, 4, False, False) == pytest.approx(3 * p * (8 + 12 / 4))
    first = m.state_bytes(1, 1, 1, True, False) - m.state_bytes(1, 1, 1, False, False)
    assert first == pytest.approx(m.embedding_params * 16)


def test_weight_dtype_is_checked_and_survives_the_plan_file():
    """A plan file carries the layout its memory was estimated for, an unknown one is refused
    naming the value, and the bf16 layout is Megatron's 2 + 4 + 12/DP bytes a parameter (the
    master weight sharded at DP 1 too): by hand."""
    keys = dict(n_layers=4, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=256, seq=128)
    bf16 = ModelSpec(**keys, weight_dtype="bf16")
    assert ModelSpec.from_dict(bf16.to_dict()) == bf16
    p = bf16.params_per_layer
    assert bf16.state_bytes(1, 1, 2, False, False) == pytest.approx(p * (2 + 4 + 12 / 2))
    assert bf16.state_bytes(1, 1, 1, False, False) == pytest.approx(p * (2 + 4 + 12))
    with pytest.raises(ValueError, match="weight_dtype must be one of .* got 'fp16'"):
        ModelSpec(**keys, weight_dtype="fp16")
