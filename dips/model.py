"""The model the PS serves: the project's LLaMA or a Hugging Face decoder (Llama, Mistral, Qwen2,
Qwen3) built from a config and a seed, or any model's parameters read from a checkpoint
(``--init``)."""
from __future__ import annotations

from pathlib import Path

import torch

from dimodel import llama


def load_config(path: str | Path) -> dict:
    """A model config file as a plain dict: a Hugging Face ``config.json`` (or model directory)
    as it is, validated by ``dimodel.hf``; else a YAML of the project's LLaMA (validated by
    LlamaConfig)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".json":
        from dimodel import hf

        values = hf.read_config_dict(path)
        hf.load_config(values)
        return values
    return {k: v for k, v in vars(llama.LlamaConfig.from_yaml(path)).items()}


def load_initial(path: str | Path) -> dict[str, torch.Tensor]:
    """A model's parameters from ``path``: a ``{name: tensor}`` dict saved with ``torch.save``,
    e.g. ``{n: p.detach() for n, p in model.named_parameters()}`` (only tensors, read with
    ``weights_only``; clients compare their ``named_parameters()`` with it)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"initial parameters {str(p)!r}: no such file")
    state = torch.load(p, weights_only=True, map_location="cpu")
    if not isinstance(state, dict) or not state:
        raise ValueError(f"{p}: expected a non-empty dict of name -> tensor (a model's named_parameters)")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v) or not v.is_floating_point()]
    if bad:
        raise ValueError(f"{p}: entries {bad[:3]} are not named floating-point tensors")
    return {k: v.detach().float() for k, v in state.items()}


def initial_parameters(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """``build_model(config, seed)``'s parameters by name."""
    return {n: p.detach() for n, p in build_model(config, seed).named_parameters()}


def build_model(config: dict, seed: int) -> torch.nn.Module:
    """The model of ``config`` with weights drawn from ``seed``, every process the same theta_0:
    ``Llama(config)``, or for a Hugging Face config (one with a ``model_type``)
    ``AutoModelForCausalLM.from_config`` in fp32, as ``ditorch.train`` initializes it."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if "model_type" in config:
            from dimodel import hf

            return hf.causal_lm(hf.load_config(dict(config)))
        return llama.Llama(llama.LlamaConfig.from_dict(dict(config)))
    finally:
        torch.random.set_rng_state(gen_state)
