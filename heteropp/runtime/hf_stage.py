"""One pipeline stage of a Hugging Face decoder (Llama, Mistral, Qwen2, Qwen3) at its own TP size.

The layers are the family's own ``transformers`` decoder layers (norms, rotary embedding, eager
attention, MLP), with their projections swapped for this rank's ``ShardedLinear`` shards:
q/k/v (with their biases) and gate/up column-parallel, o/down row-parallel, the embedding and
LM head vocab-parallel. Forward hooks around each layer's ``self_attn`` and ``mlp`` add the TP
communication (``enter_tp`` on the way in, ``leave_tp`` on the way out), so the modules and
their parameter names stay the family's: a stage's state is a cut of
``AutoModelForCausalLM.state_dict()``, and a gathered checkpoint is a Hugging Face model.

Why hooks rather than ``torch.distributed.tensor.parallel``: see tensor_parallel.py (the
deferred weight gradients of the fine-grained schedules).
"""
from __future__ import annotations

import torch
from torch import nn

from dimodel import hf

from .stage_model import PipelineStage
from .tensor_parallel import ShardedLinear, TPGroup, VocabParallelEmbedding, WeightGradStore, enter_tp, leave_tp

_ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")  # column-parallel, with their biases


def _enter_hook(tp: TPGroup, sp: bool):
    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = enter_tp(kwargs["hidden_states"], tp, sp)
        else:
            args = (enter_tp(args[0], tp, sp), *args[1:])
        return args, kwargs
    return hook


def _leave_hook(tp: TPGroup, sp: bool):
    def hook(module, args, kwargs, output):
        if isinstance(output, tuple):  # attention: (output, weights)
            return (leave_tp(output[0], tp, sp), *output[1:])
        return leave_tp(output, tp, sp)
    return hook


def _shard_layer(layer: nn.Module, tp: TPGroup, store: WeightGradStore, sp: bool) -> nn.Module:
    """Swap ``layer``'s projections for this rank's shards and hook in the TP communication."""
    attn, mlp = layer.self_attn, layer.mlp
    for name in _ATTENTION_COLUMNS:
        full = getattr(attn, name)
        setattr(attn, name, ShardedLinear(full.in_features, full.out_features // tp.size, store, full.bias is not None))
    attn.o_proj = ShardedLinear(attn.o_proj.in_features // tp.size, attn.o_proj.out_features, store)
    for name in ("gate_proj", "up_proj"):
        full = getattr(mlp, name)
        setattr(mlp, name, ShardedLinear(full.in_features, full.out_features // tp.size, store))
    mlp.down_proj = ShardedLinear(mlp.down_proj.in_features // tp.size, mlp.down_proj.out_features, store)
    if tp.size > 1:
        for module in (attn, mlp):
            module.register_forward_pre_hook(_enter_hook(tp, sp), with_kwargs=True)
            module.register_forward_hook(_leave_hook(tp, sp), with_kwargs=True)
    return layer


def causal_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """The additive (1, 1, seq, seq) mask of causal attention, within ``window`` tokens if set
    (query i sees key j when j <= i and i - j < window, as transformers' masks have it)."""
    i = torch.arange(seq, device=device).unsqueeze(1)
    j = torch.arange(seq, device=device).unsqueeze(0)
    visible = j <= i
    if window is not None:
        visible &= (i - j) < window
    mask = torch.zeros(seq, seq, device=device).masked_fill(~visible, torch.finfo(torch.float32).min)
    return mask[None, None]


class HFStageModule(PipelineStage):
    """Layers ``[first, last)`` of a Hugging Face decoder ``config`` on one TP rank (see
    ``PipelineStage`` for ``forward``). Parameters are uninitialized: ``load_full`` fills them."""

    def __init__(self, config, layer_range: tuple[int, int], is_first: bool, is_last: bool, tp: TPGroup,
                 store: WeightGradStore | None = None, sequence_parallel: bool = False):
        hf.check_tp(config, tp.size, f"stage with layers {list(layer_range)}")
        super().__init__(layer_range, is_first, is_last, tp, store, sequence_parallel)
        self.config = config
        layer_cls, norm_cls, rotary_cls = hf.decoder_parts(config)
        device = torch.empty(0).device  # the caller's default device
        self.model = nn.Module()
        with torch.device("meta"):  # the full-size projections are swapped out before any memory is taken
            if is_first:
                self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, self.sp,
                                                                 padding_idx=config.pad_token_id)
            self.model.layers = nn.ModuleDict(
                {str(i): _shard_layer(layer_cls(config, i), tp, self.store, self.sp) for i in range(*layer_range)})
            if is_last:
                self.model.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
                self.lm_head = ShardedLinear(config.hidden_size, config.vocab_size // tp.size, self.store)
        self.to_empty(device=device)
        if is_first and is_last and hf.tied_embeddings(config):
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device(device):
            self.rotary = rotary_cls(config=config)
        self.windows = {i: hf.attention_window(config, i) for i in range(*layer_range)}

    @property
    def embedding(self) -> nn.Module:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def run_layers(self, x: torch.Tensor, seq: int) -> torch.Tensor:
        positions = torch.arange(seq, device=x.device).unsqueeze(0)
        rotary = self.rotary(x, positions)
        masks = {w: causal_mask(seq, w, x.device) for w in set(self.windows.values())}
        for i, layer in self.model.layers.items():
            x = layer(x, attention_mask=masks[self.windows[int(i)]], position_embeddings=rotary)
        return x

    def tp_partial_parameters(self) -> list[nn.Parameter]:
        """The sequence-parallel norms (see ``PipelineStage``), and at TP > 1 the per-head q/k
        norms: each rank normalises only its heads."""
        partial = super().tp_partial_parameters()
        if self.tp.size > 1:
            seen = {id(p) for p in partial}
            partial += [p for name, p in self.named_parameters()
                        if name.endswith(("q_norm.weight", "k_norm.weight")) and id(p) not in seen]
        return partial

    def tied_head(self) -> nn.Parameter | None:
        """The tied embedding / LM head this stage holds (None: untied, or both on this stage)."""
        if not hf.tied_embeddings(self.config) or (self.is_first and self.is_last):
            return None
        return self.model.embed_tokens.weight if self.is_first else self.lm_head.weight if self.is_last else None

    def checkpoint_name(self, name: str) -> str:
        """A tied LM head is saved as the embedding, the one tensor it is."""
        return "model.embed_tokens.weight" if name == "lm_head.weight" and hf.tied_embeddings(self.config) else name
