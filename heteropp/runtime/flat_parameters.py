"""A stage's parameters and their gradients as views of two flat buffers.

As Megatron-core's DDP keeps them (its parameter and gradient buffers): the gradients are summed
over DP in place, as one collective with no flattened copy, and ZeRO-1 (``zero.py``) steps a
slice of the parameter buffer itself and all-gathers the other ranks' slices straight into it.
Both buffers are padded with zeros to a multiple of ``pad_to`` (the DP size) so that the slices
are equal. The gradients stay allocated between steps and are zeroed after each update (as in
Megatron): a parameter's ``.grad`` must keep being its view, so nothing may set it to None.
"""
from __future__ import annotations

import torch
from torch import nn


class FlatParameters:
    """``params`` (one dtype, one device) re-pointed into the flat ``data`` buffer, their ``.grad``
    into the flat ``grad`` buffer; ``ranges[i]`` is parameter i's [start, end) in both."""

    def __init__(self, params: list[nn.Parameter], pad_to: int = 1):
        if not params:
            raise ValueError("FlatParameters: expected at least one parameter, got none")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatParameters: expected parameters of one dtype on one device, got {sorted(map(str, kinds))}")
        if pad_to < 1:
            raise ValueError(f"FlatParameters: pad_to={pad_to}; expected a positive multiple")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        padded = -(-self.numel // pad_to) * pad_to
        self.data = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        self.ranges: list[tuple[int, int]] = []
        at = 0
        # The buffers need no grad, so their views are plain ones, made with grad mode on: a
        # view made under no_grad may not be modified in place outside it (a deferred weight
        # gradient is accumulated there).
        for p in params:  # each parameter's own storage goes as it moves in
            end = at + p.numel()
            self.data[at:end].copy_(p.detach().reshape(-1))
            p.data = self.data[at:end].view_as(p)
            self.ranges.append((at, end))
            at = end
        # Made once the parameters moved: the set-up never holds more than weights and gradients.
        self.grad = torch.zeros_like(self.data)
        for (a, b), p in zip(self.ranges, params):
            p.grad = self.grad[a:b].view_as(p)

    def zero_grad(self) -> None:
        """Zero every gradient (in place: each ``.grad`` stays a view of ``grad``)."""
        self.grad.zero_()

    def pack(self, per_param: list[torch.Tensor]) -> torch.Tensor:
        """One tensor per parameter (its shape) laid out as the buffers are, padding included."""
        flat = self.data.new_zeros(self.data.numel())
        for (a, b), t in zip(self.ranges, per_param):
            flat[a:b].copy_(t.reshape(-1))
        return flat

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (laid out as the buffers) shaped as each parameter."""
        return [flat[a:b].view_as(p) for (a, b), p in zip(self.ranges, self.params)]
