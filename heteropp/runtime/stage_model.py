"""One pipeline stage at its own TP size: its slice of the layers, the embedding on the first
stage, the final norm, head and loss on the last. ``PipelineStage`` is what every model's stage
shares; ``StageModule`` is the project's LLaMA, ``hf_stage.HFStageModule`` a Hugging Face model.

Parameter names are the full model's (``layers.5.attn.wq.weight``,
``model.layers.5.self_attn.q_proj.weight``), so a stage's state is a subset of the full model's
``state_dict()`` with some tensors cut along one dimension; ``shard_dim`` says which. That one
rule serves cutting a full initialization, loading a checkpoint written under another plan and
gathering shards back for saving.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from dimodel.llama import LlamaConfig, RMSNorm, causal_attention, rotary_tables, swiglu

from .tensor_parallel import (
    ShardedLinear, TPGroup, VocabParallelEmbedding, WeightGradStore, enter_tp, leave_tp, vocab_parallel_cross_entropy,
)

# Column-parallel (output features split: dim 0), row-parallel (input features split: dim 1),
# vocab-parallel (rows of the embedding and the head: dim 0); the norms are replicated.
# The first three are the project's LLaMA, the rest Hugging Face's names (column-parallel biases
# are cut with their outputs).
_SHARD_DIM = [
    (re.compile(r"layers\.\d+\.(attn\.(wq|wk|wv)|ffn\.(w1|w3))\.weight$"), 0),
    (re.compile(r"layers\.\d+\.(attn\.wo|ffn\.w2)\.weight$"), 1),
    (re.compile(r"(embed|head)\.weight$"), 0),
    (re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v)_proj\.(weight|bias)|mlp\.(gate|up)_proj\.weight)$"), 0),
    (re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$"), 1),
    (re.compile(r"(model\.embed_tokens|lm_head)\.weight$"), 0),
]


def shard_dim(name: str) -> int | None:
    """The dimension a parameter of the full model is split along under TP (None: replicated)."""
    for pattern, dim in _SHARD_DIM:
        if pattern.match(name):
            return dim
    return None


def cut(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's piece of the full parameter ``name``."""
    dim = shard_dim(name)
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dimension {dim} of size {full.shape[dim]} does not split over tp={tp}")
    return full.chunk(tp, dim)[tp_rank]


def gather_full(t: torch.Tensor, dim: int | None, tp: TPGroup) -> torch.Tensor:
    """The inverse of :func:`cut`: the full tensor from every TP rank's piece (collective)."""
    if dim is None or tp.size == 1:
        return t
    if dim == 0:
        return tp.all_gather(t)
    return tp.all_gather(t.transpose(0, dim).contiguous()).transpose(0, dim)


def check_divisible(config: LlamaConfig, tp: int, where: str) -> None:
    """Every split the stage makes must be exact; name the first that is not."""
    for what, n in (("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads), ("ffn_dim", config.ffn_dim),
                    ("vocab_size", config.vocab_size)):
        if n % tp:
            raise ValueError(f"{where}: tp={tp} does not divide the model's {what}={n}")


class TPAttention(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup, store: WeightGradStore, sp: bool):
        super().__init__()
        self.tp, self.sp = tp, sp
        hd = config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.n_heads // tp.size, config.n_kv_heads // tp.size, hd
        self.wq = ShardedLinear(config.dim, self.heads * hd, store)
        self.wk = ShardedLinear(config.dim, self.kv_heads * hd, store)
        self.wv = ShardedLinear(config.dim, self.kv_heads * hd, store)
        self.wo = ShardedLinear(self.heads * hd, config.dim, store)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = enter_tp(x, self.tp, self.sp)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        return leave_tp(self.wo(causal_attention(q, k, v, cos, sin)), self.tp, self.sp)


class TPFeedForward(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup, store: WeightGradStore, sp: bool):
        super().__init__()
        self.tp, self.sp = tp, sp
        f = config.ffn_dim // tp.size
        self.w1 = ShardedLinear(config.dim, f, store)
        self.w3 = ShardedLinear(config.dim, f, store)
        self.w2 = ShardedLinear(f, config.dim, store)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp(x, self.tp, self.sp)
        return leave_tp(self.w2(swiglu(self.w1(x), self.w3(x))), self.tp, self.sp)


class TPBlock(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup, store: WeightGradStore, sp: bool):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = TPAttention(config, tp, store, sp)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = TPFeedForward(config, tp, store, sp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class PipelineStage(nn.Module):
    """What every model's stage shares: ``forward(x)`` takes token ids (b, s) on the first stage
    and the hidden state elsewhere: (b, s, hidden), or this rank's sequence shard (b, s / tp,
    hidden) with ``sequence_parallel``; it returns the hidden state in the same form, or on the
    last stage the loss against ``targets`` (b, s) as a mean over the micro-batch's tokens.

    A subclass builds its layers and sets ``embedding`` (first stage), ``final_norm`` and
    ``lm_head`` (last stage), and runs its layers in ``run_layers``.
    """

    embedding: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module

    def __init__(self, layer_range: tuple[int, int], is_first: bool, is_last: bool, tp: TPGroup,
                 store: WeightGradStore | None, sequence_parallel: bool):
        super().__init__()
        self.tp, self.is_first, self.is_last = tp, is_first, is_last
        self.sp = sequence_parallel and tp.size > 1
        self.layer_range = layer_range
        self.store = store or WeightGradStore()

    def run_layers(self, x: torch.Tensor, seq: int) -> torch.Tensor:
        """This stage's layers over ``x`` (sequences of ``seq`` tokens, whole or sharded)."""
        raise NotImplementedError

    def decoder_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order."""
        raise NotImplementedError

    def compile_layers(self, **compile_options) -> None:
        """Regional compilation, as torchtitan does it: each decoder layer compiled on its own
        (``nn.Module.compile``, in place: parameter names, state dicts and hooks stay the
        module's), so one layer's graph serves every layer of the same shape and a TP collective
        inside a layer breaks only that layer's graph. ``compile_options`` go to torch.compile."""
        for layer in self.decoder_layers():
            layer.compile(**compile_options)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            x = self.embedding(x)
        x = self.run_layers(x, x.shape[1] * (self.tp.size if self.sp else 1))
        if not self.is_last:
            return x
        logits = self.lm_head(enter_tp(self.final_norm(x), self.tp, self.sp))
        if targets is None:
            raise ValueError("the last stage needs the micro-batch's targets to compute its loss")
        losses = vocab_parallel_cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), self.tp)
        return losses.mean()

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every TP rank holds whole (the norms)."""
        return [p for name, p in self.named_parameters() if shard_dim(name) is None]

    def tp_partial_parameters(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradient each TP rank holds only a part of, to be summed
        over the TP group: under sequence parallelism each rank sees only its tokens."""
        return self.replicated_parameters() if self.sp else []

    def tied_head(self) -> nn.Parameter | None:
        """The embedding or LM head this stage holds that is tied to one on another stage."""
        return None

    def checkpoint_name(self, name: str) -> str:
        """The name parameter ``name`` is saved under (one name for tensors that are one)."""
        return name

    @torch.no_grad()
    def load_full(self, full_state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy this rank's cut of each full-model tensor ``full_state`` holds."""
        missing = []
        for name, p in self.named_parameters():
            if name not in full_state:
                missing.append(name)
                continue
            piece = cut(name, full_state[name], self.tp.size, self.tp.rank)
            if piece.shape != p.shape:
                raise ValueError(f"{name}: the checkpoint's tensor {tuple(full_state[name].shape)} cuts to "
                                 f"{tuple(piece.shape)} at tp={self.tp.size}, the stage expects {tuple(p.shape)}")
            p.copy_(piece)
        if strict and missing:
            raise KeyError(f"the full state lacks {len(missing)} tensor(s) of this stage, e.g. {missing[:3]}")


class StageModule(PipelineStage):
    """Layers ``[first, last)`` of the project's LLaMA on one TP rank."""

    def __init__(self, config: LlamaConfig, layer_range: tuple[int, int], is_first: bool, is_last: bool,
                 tp: TPGroup, store: WeightGradStore | None = None, sequence_parallel: bool = False):
        check_divisible(config, tp.size, f"stage with layers {list(layer_range)}")
        super().__init__(layer_range, is_first, is_last, tp, store, sequence_parallel)
        self.config = config
        if is_first:
            self.embed = VocabParallelEmbedding(config.vocab_size, config.dim, tp, self.sp)
        self.layers = nn.ModuleDict({str(i): TPBlock(config, tp, self.store, self.sp) for i in range(*layer_range)})
        if is_last:
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.head = ShardedLinear(config.dim, config.vocab_size // tp.size, self.store)

    @property
    def embedding(self) -> nn.Module:
        return self.embed

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    @property
    def lm_head(self) -> nn.Module:
        return self.head

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.layers.values())

    def run_layers(self, x: torch.Tensor, seq: int) -> torch.Tensor:
        cos, sin = rotary_tables(self.config, seq, x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return x
