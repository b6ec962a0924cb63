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
