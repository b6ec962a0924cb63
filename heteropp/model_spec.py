"""Transformer shape and the parameter, FLOP, activation and memory formulas the planner uses.

The model is a LLaMA-style decoder (RMSNorm, GQA attention, SwiGLU MLP): the project's own
``dimodel.llama``, whose YAML uses the same keys as ``LlamaConfig``, or a Hugging Face Llama,
Mistral, Qwen2 or Qwen3 ``config.json`` (``ModelSpec.from_hf``: explicit head width, q/k/v
biases, per-head q/k norms and tied embeddings counted from the config).
Activations are bf16. Weights are fp32 under bf16 autocast as ``ditorch.train`` keeps them
(``weight_dtype: fp32``, the default), or bf16 with an fp32 master copy as Megatron's mixed
precision keeps them (``weight_dtype: bf16``, H2's); Adam's state is sharded over data
parallelism (ZeRO-1).
Tensor parallelism is Megatron-style with sequence parallelism, so every stored activation
of a layer is split over the TP ranks.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

BF16 = 2
FP32 = 4
# Bytes per parameter of weights, gradients and optimizer state, by the weights' dtype:
# (not sharded, sharded over DP by ZeRO-1 at DP > 1, the optimizer's at DP 1).
# fp32 is ditorch.train's layout (heteropp/runtime/flat_parameters.py, zero.py): bf16 autocast
# over fp32 weights; the fp32 weight and gradient on every chip; Adam's m and v and the
# reduce-scattered gradient slice sharded (AdamW steps the weight buffer's own slice, no master
# copy); plain AdamW's m and v at DP 1.
# bf16 is Megatron's mixed precision (H2's): bf16 weight, fp32 gradient; the fp32 master weight
# and Adam's m and v sharded.
_STATE_BYTES_PER_PARAM = {"fp32": (FP32 + FP32, 3 * FP32, 2 * FP32), "bf16": (BF16 + FP32, 3 * FP32, 3 * FP32)}

_YAML_KEYS = {
    "n_layers": "n_layers",
    "dim": "hidden",
    "n_heads": "heads",
    "n_kv_heads": "kv_heads",
    "ffn_dim": "ffn",
    "vocab_size": "vocab",
    "max_seq_len": "seq",
}
_OPTIONAL_YAML_KEYS = {"weight_dtype": "weight_dtype", "head_dim": "head_size", "qkv_bias": "qkv_bias",
                       "qk_norm": "qk_norm", "tie_word_embeddings": "tied_embeddings", "hf_config": "hf_config",
                       "weights": "weights"}
_IGNORED_YAML_KEYS = {"rope_theta", "norm_eps", "name"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer trained with sequences of ``seq`` tokens."""

    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    name: str = "model"
    weight_dtype: str = "fp32"  # the layout of the memory estimate: _STATE_BYTES_PER_PARAM
    head_size: int = 0  # width of one attention head; 0: hidden / heads
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3)
    tied_embeddings: bool = False
    hf_config: str = ""  # a Hugging Face config.json's mapping as canonical JSON ("": the project's LLaMA)
    weights: str = ""  # a directory of *.safetensors to start from ("": a random initialization)

    def __post_init__(self) -> None:
        if self.weight_dtype not in _STATE_BYTES_PER_PARAM:
            raise ValueError(f"ModelSpec.weight_dtype must be one of {sorted(_STATE_BYTES_PER_PARAM)}, "
                             f"got {self.weight_dtype!r}")
        for field in ("n_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelSpec.{field} must be a positive integer, got {value!r}")
        if not isinstance(self.head_size, int) or self.head_size < 0:
            raise ValueError(f"ModelSpec.head_size must be an integer >= 0 (0: hidden / heads), got {self.head_size!r}")
        if self.hidden % self.heads and not self.head_size:
            raise ValueError(f"ModelSpec: hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict, seq: int | None = None, name: str | None = None) -> "ModelSpec":
        """Build from LlamaConfig-style keys (``dim``, ``n_heads``, ...); ``seq`` overrides."""
        unknown = sorted(set(values) - set(_YAML_KEYS) - set(_OPTIONAL_YAML_KEYS) - _IGNORED_YAML_KEYS)
        if unknown:
            raise ValueError(f"model spec: unknown key(s) {unknown}; expected some of "
                             f"{sorted(_YAML_KEYS | _OPTIONAL_YAML_KEYS)}")
        missing = sorted(k for k in _YAML_KEYS if k not in values and not (k == "max_seq_len" and seq))
        if missing:
            raise ValueError(f"model spec: missing key(s) {missing}")
        keys = _YAML_KEYS | _OPTIONAL_YAML_KEYS
        kwargs = {ours: values[theirs] for theirs, ours in keys.items() if theirs in values}
        if seq is not None:
            kwargs["seq"] = seq
        if isinstance(kwargs.get("hf_config"), dict):
            kwargs["hf_config"] = json.dumps(kwargs["hf_config"], sort_keys=True)
        return cls(**kwargs, name=name or str(values.get("name", "model")))

    @classmethod
    def from_hf(cls, path: str | Path, seq: int | None = None) -> "ModelSpec":
        """The shape of a Hugging Face model: ``path`` is its ``config.json`` or a local model
        directory, whose ``*.safetensors``, if any, become the starting weights (checked against
        the config here, before anything is planned on them)."""
        from dimodel import hf

        path = Path(path)
        values = hf.read_config_dict(path)
        weights = str(path.resolve()) if path.is_dir() and any(path.glob("*.safetensors")) else ""
        if weights:
            hf.load_weights(weights, hf.load_config(values))
        name = path.name if path.is_dir() else path.parent.name
        return cls.from_hf_dict(values, seq=seq, name=name, weights=weights)

    @classmethod
    def from_hf_dict(cls, values: dict, seq: int | None = None, name: str = "model", weights: str = "") -> "ModelSpec":
        """The shape of the Hugging Face model whose ``config.json`` mapping is ``values``; ``seq``
        defaults to its ``max_position_embeddings``."""
        from dimodel import hf

        config = hf.load_config(values)
        hd = hf.head_dim(config)
        return cls(n_layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, ffn=config.intermediate_size, vocab=config.vocab_size,
                   seq=seq or config.max_position_embeddings, name=name,
                   head_size=hd if hd * config.num_attention_heads != config.hidden_size else 0,
                   qkv_bias=config.model_type == "qwen2", qk_norm=config.model_type == "qwen3",
                   tied_embeddings=hf.tied_embeddings(config), hf_config=json.dumps(values, sort_keys=True),
                   weights=weights)

    @classmethod
    def from_config(cls, values: dict, seq: int | None = None, name: str = "model") -> "ModelSpec":
        """From a config mapping of either kind: a Hugging Face ``config.json``'s (it has a
        ``model_type``) or the project's LLaMA's keys."""
        if "model_type" in values:
            return cls.from_hf_dict(values, seq=seq, name=name)
        return cls.from_dict(values, seq=seq, name=name)

    @classmethod
    def load(cls, path: str | Path, seq: int | None = None) -> "ModelSpec":
        """A model file as the CLIs take it: a Hugging Face ``config.json`` or model directory, or
        a YAML of the project's LLaMA."""
        path = Path(path)
        if path.is_dir() or path.suffix == ".json":
            return cls.from_hf(path, seq)
        return cls.from_yaml(path, seq)

    @classmethod
    def from_yaml(cls, path: str | Path, seq: int | None = None) -> "ModelSpec":
        import yaml

        path = Path(path)
        with open(path) as f:
            values = yaml.safe_load(f)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of model fields, got {type(values).__name__}")
        return cls.from_dict(values, seq=seq, name=values.get("name", path.stem))

    # -- sizes -----------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def matmul_params_per_layer(self) -> int:
        """Weights of the matmuls of one layer: q and o (h x q), k and v (h x kv), 3 SwiGLU."""
        h = self.hidden
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.ffn

    @property
    def params_per_layer(self) -> int:
        extra = (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return self.matmul_params_per_layer + 2 * self.hidden + extra  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden + self.hidden  # output projection + final norm

    @property
    def total_params(self) -> int:
        """Distinct parameters: a tied head is the embedding (its stage still holds a copy)."""
        head = self.hidden if self.tied_embeddings else self.head_params
        return self.n_layers * self.params_per_layer + self.embedding_params + head

    # -- compute ---------------------------------------------------------------------------
    def layer_forward_flops(self) -> float:
        """FLOPs of one layer's forward pass over one sequence (micro-batch size 1).

        2 FLOPs per weight per token for the matmuls plus QK^T and AV (4 s^2 q_dim, counted
        without the causal saving, as Megatron's accounting does).
        """
        s = self.seq
        return 2.0 * self.matmul_params_per_layer * s + 4.0 * s * s * self.q_dim

    def layer_backward_flops(self) -> float:
        """Backward = input gradients + weight gradients, each as costly as the forward."""
        return 2.0 * self.layer_forward_flops()

    def training_flops_per_token(self, recompute: bool = False) -> float:
        """Layer FLOPs per token of one training step (the embedding/head are not counted)."""
        per_seq = self.layer_forward_flops() * (4.0 if recompute else 3.0)
        return self.n_layers * per_seq / self.seq

    # -- memory ----------------------------------------------------------------------------
    def activation_bytes_per_token(self) -> int:
        """bf16 tensors one layer keeps for its backward, per token, before TP sharding.

        Inputs of both norms, both norm outputs (matmul inputs), q/k/v, the attention output
        (flash attention keeps no s x s scores), SwiGLU gate and up outputs, silu(gate) and
        the product that feeds the down projection.
        """
        h, f = self.hidden, self.ffn
        return BF16 * (2 * h + 2 * h + (self.q_dim + 2 * self.kv_dim) + self.q_dim + 4 * f)

    def activation_bytes(self, layers: int, tp: int, recompute: bool, measured_per_layer: float | None = None) -> float:
        """Activations one micro-batch leaves on one chip of a stage with ``layers`` layers.

        With recompute only each layer's input survives the forward pass. ``measured_per_layer``
        (bytes, from ``ditorch profile``) replaces the formula when the stage does not recompute.
        """
        if measured_per_layer is not None and not recompute:
            return layers * measured_per_layer
        per_token = BF16 * self.hidden if recompute else self.activation_bytes_per_token()
        return layers * self.seq * per_token / tp

    def working_bytes(self, tp: int, last_stage: bool) -> float:
        """Transient memory on top of the stored activations: the last stage's fp32 logits."""
        return self.seq * self.vocab * FP32 / tp if last_stage else 0.0

    def recompute_bytes(self, layers: int, tp: int, measured_per_layer: float | None = None) -> float:
        """What a recomputing stage re-materialises at once: the runtime's R re-runs the stage's
        whole forward for one micro-batch, so that micro-batch's activations of every layer."""
        return self.activation_bytes(layers, tp, False, measured_per_layer)

    def state_bytes(self, layers: int, tp: int, dp: int, first_stage: bool, last_stage: bool) -> float:
        """Weights, gradients and ZeRO-1 optimizer states of one chip of a stage, laid out as the
        runtime lays them out (see the constants above)."""
        params = layers * self.params_per_layer
        if first_stage:
            params += self.embedding_params
        if last_stage:
            params += self.head_params
        unsharded, sharded, alone = _STATE_BYTES_PER_PARAM[self.weight_dtype]
        return params / tp * (unsharded + (sharded / dp if dp > 1 else alone))

    def stage_memory_bytes(
        self,
        layers: int,
        tp: int,
        dp: int,
        recompute: bool,
        inflight_microbatches: int,
        first_stage: bool,
        last_stage: bool,
        activation_per_layer: float | None = None,
    ) -> float:
        """Peak memory of one chip of a pipeline stage.

        ``inflight_microbatches`` is how many micro-batches' activations the stage holds at
        once: under 1F1B stage k of p holds min(p - k, b) (the warm-up micro-batches).
        ``activation_per_layer``: a measured value (see ``activation_bytes``).
        """
        return (
            self.state_bytes(layers, tp, dp, first_stage, last_stage)
            + inflight_microbatches * self.activation_bytes(layers, tp, recompute, activation_per_layer)
            + (self.recompute_bytes(layers, tp, activation_per_layer) if recompute else 0.0)
            + self.working_bytes(tp, last_stage)
        )

    def p2p_bytes(self, tp: int) -> float:
        """Bytes one TP rank sends across a stage boundary per micro-batch (its shard): the
        residual stream, in the weights' dtype (fp32 weights under bf16 autocast keep an fp32
        stream, as ditorch.train sends it; Megatron's bf16 weights a bf16 one)."""
        return (FP32 if self.weight_dtype == "fp32" else BF16) * self.seq * self.hidden / tp

    def to_dict(self) -> dict:
        """The plan file's form: the LLaMA keys, and the optional ones only where they differ from
        their defaults (so the project's LLaMA writes what it always wrote)."""
        out = {theirs: getattr(self, ours) for theirs, ours in _YAML_KEYS.items()}
        for theirs, ours in _OPTIONAL_YAML_KEYS.items():
            value = getattr(self, ours)
            if ours == "weight_dtype" or value != next(f.default for f in dataclasses.fields(self) if f.name == ours):
                out[theirs] = json.loads(value) if ours == "hf_config" else value
        return out | {"name": self.name}
