"""The model the PS serves: the shared LLaMA, built deterministically from config and seed."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch


def _llama_module():
    try:
        from ditorch.models import llama
    except ImportError:  # the umbrella package may need a C++ extension not built yet
        path = Path(__file__).resolve().parent.parent / "ditorch" / "models" / "llama.py"
        spec = importlib.util.spec_from_file_location("_dips_llama", path)
        llama = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = llama  # dataclasses look their module up while the class is built
        spec.loader.exec_module(llama)
    return llama


def load_config(path: str | Path) -> dict:
    """A Llama config file as a plain dict (validated by LlamaConfig)."""
    llama = _llama_module()
    return {k: v for k, v in vars(llama.LlamaConfig.from_yaml(path)).items()}


def build_model(config: dict, seed: int) -> torch.nn.Module:
    """``Llama(config)`` with weights drawn from ``seed``: every process gets the same theta_0."""
    llama = _llama_module()
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return llama.Llama(llama.LlamaConfig.from_dict(dict(config)))
    finally:
        torch.random.set_rng_state(gen_state)
