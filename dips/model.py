"""The model the PS serves: the shared LLaMA, built deterministically from config and seed."""
from __future__ import annotations

from pathlib import Path

import torch

from ditorch.models import llama


def load_config(path: str | Path) -> dict:
    """A Llama config file as a plain dict (validated by LlamaConfig)."""
    return {k: v for k, v in vars(llama.LlamaConfig.from_yaml(path)).items()}


def build_model(config: dict, seed: int) -> torch.nn.Module:
    """``Llama(config)`` with weights drawn from ``seed``: every process gets the same theta_0."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return llama.Llama(llama.LlamaConfig.from_dict(dict(config)))
    finally:
        torch.random.set_rng_state(gen_state)
