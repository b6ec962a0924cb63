"""Decoder-only models from Hugging Face definitions (Llama, Mistral, Qwen2, Qwen3), built with the
``transformers`` package's own modules, with nothing downloaded: a ``config.json`` (or a local
model directory holding one, and optionally ``*.safetensors`` weights) is all it reads.

``transformers`` is an optional extra (``pip install ditorch[hf]``); it is imported on first use.
A random initialization is exactly ``torch.manual_seed(seed)`` then
``AutoModelForCausalLM.from_config(config)`` in fp32, so anyone can rebuild a run's starting point.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["FAMILIES", "attention_window", "causal_lm", "check_tp", "decoder_parts", "export_pretrained",
           "head_dim", "initial_state", "load_config", "load_weights", "read_config_dict", "tied_embeddings"]

# the supported model_types, each also the name of its transformers.models module
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Config switches that give o_proj / down_proj a bias, which each TP rank would add once. (Qwen2's
# q/k/v biases are built in; column-parallel, they are cut with their outputs.)
_ROW_PARALLEL_BIASES = ("attention_bias", "mlp_bias")


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the extra is installed by make setup
        raise ImportError("Hugging Face models need the transformers package: pip install 'ditorch[hf]'") from exc
    return transformers


def read_config_dict(path: str | Path) -> dict:
    """The mapping of a ``config.json`` (``path`` is the file or a directory holding it)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        values = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no Hugging Face config here (expected config.json or a directory holding it)") \
            from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not a JSON config ({exc})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file}: expected a JSON object of config fields, got {type(values).__name__}")
    return values


def load_config(values: dict | str | Path):
    """A ``transformers`` config of a supported family from a config mapping or file, set to eager
    attention (the reference and the pipeline stages then run the same attention code)."""
    if not isinstance(values, dict):
        values = read_config_dict(values)
    model_type = values.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {sorted(FAMILIES)} "
                         f"(decoder-only Llama, Mistral, Qwen2, Qwen3)")
    fields = {k: v for k, v in values.items() if k not in ("model_type", "transformers_version", "architectures")}
    config = _transformers().AutoConfig.for_model(model_type, **fields)
    for key in _ROW_PARALLEL_BIASES:
        if getattr(config, key, False):
            raise ValueError(f"{model_type} config has {key}=true: biases on the row-parallel projections "
                             f"(o_proj, down_proj) are not supported; expected {key}=false")
    config._attn_implementation = "eager"
    return config


def head_dim(config) -> int:
    """Width of one attention head (Qwen3 and Mistral may set it apart from hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def tied_embeddings(config) -> bool:
    """Whether the LM head shares the input embedding's weight."""
    return bool(getattr(config, "tie_word_embeddings", False))


def attention_window(config, layer: int) -> int | None:
    """The sliding window of layer ``layer``'s attention (None: full causal), as the family's own
    model builds its masks (Qwen: per-layer ``layer_types``; Mistral: ``sliding_window`` on all)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def check_tp(config, tp: int, where: str) -> None:
    """Every split a TP stage makes of this model must be exact; name the first that is not."""
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        n = getattr(config, what)
        if n % tp:
            raise ValueError(f"{where}: tp={tp} does not divide the model's {what}={n}")


def decoder_parts(config) -> tuple[type, type, type]:
    """The family's (decoder layer, RMSNorm, rotary embedding) classes."""
    import importlib

    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    prefix = type(config).__name__[: -len("Config")]
    return (getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm"),
            getattr(module, f"{prefix}RotaryEmbedding"))


def causal_lm(config) -> torch.nn.Module:
    """The family's ``*ForCausalLM`` in fp32 with transformers' own random initialization."""
    return _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def initial_state(config, seed: int, weights: str | Path | None = None,
                  names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's starting weights: the tensors ``names`` (default: all) of ``weights`` (a
    directory of safetensors, read tensor by tensor) when given, else the whole of
    ``torch.manual_seed(seed)`` then ``AutoModelForCausalLM.from_config`` (fp32)."""
    if weights is not None:
        return load_weights(weights, config, names)
    torch.manual_seed(seed)
    return causal_lm(config).state_dict()


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = causal_lm(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else [directory]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{directory}: no *.safetensors weights found")
    return files


def load_weights(directory: str | Path, config, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The fp32 tensors ``names`` (default: all) of ``directory``'s ``*.safetensors``, after
    checking every tensor's name and shape against the model ``config`` defines (from the files'
    headers: only the tensors asked for are read). A tied head may be absent: it is the embedding."""
    from safetensors import safe_open

    directory = Path(directory)
    where: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in _weight_files(directory):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                where[key] = (f, tuple(handle.get_slice(key).get_shape()))
    expected = _expected_shapes(config)
    alias = {}
    if tied_embeddings(config) and "lm_head.weight" not in where and "model.embed_tokens.weight" in where:
        alias["lm_head.weight"] = "model.embed_tokens.weight"
    unexpected = sorted(set(where) - set(expected))
    missing = sorted(set(expected) - set(where) - set(alias))
    if unexpected or missing:
        raise ValueError(f"{directory}: the weights do not match the config: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                         f"{' ...' if len(unexpected) > 4 else ''}")
    for name, shape in expected.items():
        got = where[alias.get(name, name)][1]
        if got != shape:
            raise ValueError(f"{directory}: {name} has shape {got}, the config expects {shape}")
    wanted = list(expected) if names is None else names
    out = {}
    for f in {where[alias.get(n, n)][0] for n in wanted}:  # each file opened once
        with safe_open(str(f), framework="pt") as handle:
            for name in wanted:
                stored = alias.get(name, name)
                if where[stored][0] == f:
                    out[name] = handle.get_tensor(stored).float()
    return out


def export_pretrained(directory: str | Path, config, state: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``from_pretrained`` loads (a tied head
    is stored once, as transformers stores it)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    if tied_embeddings(config):
        tensors.pop("lm_head.weight", None)
    config.save_pretrained(directory)
    tmp = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / "model.safetensors")
    return directory
