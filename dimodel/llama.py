"""A small LLaMA-style decoder: RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP.

Plain PyTorch with no device assumptions, so the same module runs on ``cpu``, ``dipu`` or
``cuda`` and a run on one can serve as the reference for a run on another.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Block", "FeedForward", "Llama", "LlamaConfig", "RMSNorm", "apply_rotary", "causal_attention",
           "rotary_tables", "swiglu"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Transformer shape. ``n_kv_heads < n_heads`` gives grouped-query attention."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 344
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LlamaConfig.{field.name} must be a positive number, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_dict(cls, values: dict) -> "LlamaConfig":
        """Build from a mapping; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"LlamaConfig: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LlamaConfig":
        """Load a config written as YAML (or JSON, a subset of YAML)."""
        import yaml

        with open(path) as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of LlamaConfig fields, got {type(values).__name__}")
        return cls.from_dict(values.get("model", values))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 mean-of-squares loses too much precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_tables(config: LlamaConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim/2) for rotary position embedding."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x: (batch, heads, seq, head_dim)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.config
        q = self.wq(x).view(b, s, c.n_heads, c.head_dim)
        k = self.wk(x).view(b, s, c.n_kv_heads, c.head_dim)
        v = self.wv(x).view(b, s, c.n_kv_heads, c.head_dim)
        return self.wo(causal_attention(q, k, v, cos, sin))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """Rotary + grouped-query causal attention of projected heads.

    q: (b, s, heads, head_dim); k, v: (b, s, kv_heads, head_dim) with kv_heads dividing heads
    (query head h reads kv head h // (heads / kv_heads)). Returns (b, s, heads * head_dim).
    A tensor-parallel rank calls it with its own contiguous slice of the heads.
    """
    b, s, heads, head_dim = q.shape
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    groups = heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    # Explicit attention (not SDPA) so every op is an ordinary ATen op on any backend.
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = F.softmax(scores.float(), dim=-1).type_as(q)
    return (probs @ v).transpose(1, 2).reshape(b, s, heads * head_dim)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation of the MLP: silu(x W1) * (x W3)."""
    return F.silu(gate) * up


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only LM: ``forward(tokens[b, s]) -> logits[b, s, vocab]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed(tokens)
        cos, sin = rotary_tables(self.config, s, tokens.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``tokens`` (b, s+1): inputs tokens[:, :-1]."""
        logits = self.forward(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
