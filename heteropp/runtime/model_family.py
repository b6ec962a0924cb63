"""What the runtime needs of a plan's model, whichever definition it comes from: its stages, its
full starting weights, its TP limits and the whole model for the single-process reference.

``LlamaFamily`` is the project's own LLaMA (``dimodel.llama``, no dependencies);
``HFFamily`` a Hugging Face decoder (``dimodel.hf``, the ``transformers`` extra).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dimodel.llama import Llama, LlamaConfig
from heteropp.model_spec import ModelSpec

from .stage_model import PipelineStage, StageModule, check_divisible
from .tensor_parallel import TPGroup, WeightGradStore


class LlamaFamily:
    """The project's LLaMA of a plan's ``ModelSpec``."""

    def __init__(self, spec: ModelSpec):
        odd = [k for k in ("head_size", "qkv_bias", "qk_norm", "tied_embeddings") if getattr(spec, k)]
        if odd:
            raise ValueError(f"model {spec.name!r} sets {odd}, which the project's LLaMA does not have; "
                             f"give a Hugging Face config.json for such a model")
        self.spec = spec
        self.config = LlamaConfig(vocab_size=spec.vocab, dim=spec.hidden, n_layers=spec.n_layers, n_heads=spec.heads,
                                  n_kv_heads=spec.kv_heads, ffn_dim=spec.ffn, max_seq_len=spec.seq)
        self.tied = False

    def check_tp(self, tp: int, where: str) -> None:
        check_divisible(self.config, tp, where)

    def stage(self, layer_range: tuple[int, int], is_first: bool, is_last: bool, tp: TPGroup,
              store: WeightGradStore | None = None, sequence_parallel: bool = False) -> PipelineStage:
        return StageModule(self.config, layer_range, is_first, is_last, tp, store, sequence_parallel)

    def initial_state(self, seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The full model's initial weights, as a single-process run makes them from ``seed``
        (``names`` is a hint: the random stream is the whole model's, so all are made)."""
        torch.manual_seed(seed)
        return Llama(self.config).state_dict()

    def whole_model(self, seed: int) -> nn.Module:
        model = Llama(self.config)
        model.load_state_dict(self.initial_state(seed))
        return model

    @staticmethod
    def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)


class HFFamily:
    """A Hugging Face decoder whose ``config.json`` mapping the plan's ``ModelSpec`` carries."""

    def __init__(self, spec: ModelSpec):
        from dimodel import hf

        self.hf, self.spec = hf, spec
        self.config = hf.load_config(json.loads(spec.hf_config))
        self.tied = hf.tied_embeddings(self.config)

    def check_tp(self, tp: int, where: str) -> None:
        self.hf.check_tp(self.config, tp, where)

    def stage(self, layer_range: tuple[int, int], is_first: bool, is_last: bool, tp: TPGroup,
              store: WeightGradStore | None = None, sequence_parallel: bool = False) -> PipelineStage:
        from .hf_stage import HFStageModule

        return HFStageModule(self.config, layer_range, is_first, is_last, tp, store, sequence_parallel)

    def initial_state(self, seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The spec's weights (only ``names`` read, when given), or ``torch.manual_seed(seed)`` +
        ``from_config`` (fp32, the whole model: its random stream is the whole model's)."""
        return self.hf.initial_state(self.config, seed, self.spec.weights or None, names)

    def whole_model(self, seed: int) -> nn.Module:
        model = self.hf.causal_lm(self.config)
        model.load_state_dict(self.initial_state(seed))
        return model

    @staticmethod
    def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens).logits

    def export(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        """A Hugging Face model directory (config.json, model.safetensors) of ``state``."""
        self.hf.export_pretrained(directory, self.config, state)


def model_family(spec: ModelSpec) -> LlamaFamily | HFFamily:
    """The definition of ``spec``'s model: Hugging Face's when it carries a config, else ours."""
    return HFFamily(spec) if spec.hf_config else LlamaFamily(spec)
