"""FlexAttention on dipu (ditorch_ext/flex_attention.py), eager and compiled, forward and backward.

The forward is checked against the same flex_attention call on CPU (PyTorch's CPU path), and
forward and gradients against attention written out here in float64 (scores, the score_mod and
mask applied by broadcasting, softmax, product with V; autograd for the gradients): CPU's
flex_attention has no backward to compare with.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, S, D = 2, 4, 128, 16
WINDOW = 24
DOCS = [0] * 40 + [1] * 56 + [2] * 32  # three packed sequences


def masks(device: str) -> dict:
    docs = torch.tensor(DOCS, device=device)
    return {
        "causal": lambda b, h, q, k: q >= k,
        "document": lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k),
        "sliding window": lambda b, h, q, k: (q >= k) & (q - k < WINDOW),
    }


def score_mods(device: str) -> dict:
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)], device=device)
    return {
        "none": None,
        "relative bias": lambda s, b, h, q, k: s + (q - k) * 0.05,
        "alibi": lambda s, b, h, q, k: s - slopes[h] * (q - k),
        "soft cap": lambda s, b, h, q, k: 5.0 * torch.tanh(s / 5.0),
    }


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(3)]


def written_out(q, k, v, score_mod, mask_mod):
    """Attention in float64 from its definition; indices broadcast as (b, h, q, k)."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / D ** 0.5
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(S).view(1, 1, S, 1)
    ki = torch.arange(S).view(1, 1, 1, S)
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    scores = scores.masked_fill(~mask_mod(b, h, qi, ki).expand_as(scores), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def run(fn, device, score_mod_name, mask_name):
    q, k, v = (t.to(device).requires_grad_() for t in inputs())
    block_mask = create_block_mask(masks(device)[mask_name], B, H, S, S, device=device)
    out = fn(q, k, v, score_mod=score_mods(device)[score_mod_name], block_mask=block_mask)
    grad_out = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1)).to(device)
    out.backward(grad_out)
    return out.detach().cpu(), [t.grad.cpu() for t in (q, k, v)]


def reference(score_mod_name, mask_name):
    q, k, v = (t.double().requires_grad_() for t in inputs())
    out = written_out(q, k, v, score_mods("cpu")[score_mod_name], masks("cpu")[mask_name])
    out.backward(torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1)).double())
    return out.detach(), [t.grad for t in (q, k, v)]


def cpu_flex_forward(score_mod_name, mask_name):
    q, k, v = inputs()
    block_mask = create_block_mask(masks("cpu")[mask_name], B, H, S, S, device="cpu")
    with torch.no_grad():
        return flex_attention(q, k, v, score_mod=score_mods("cpu")[score_mod_name], block_mask=block_mask)


def agree(got, want, what):
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("score_mod_name,mask_name", [("none", "causal"), ("relative bias", "document"),
                                                      ("alibi", "sliding window"), ("soft cap", "causal")])
def test_eager_forward_and_backward_equal_cpu_and_the_definition(score_mod_name, mask_name):
    out, grads = run(flex_attention, "dipu", score_mod_name, mask_name)
    agree(out, cpu_flex_forward(score_mod_name, mask_name), "forward vs CPU flex_attention")
    want_out, want_grads = reference(score_mod_name, mask_name)
    agree(out, want_out, "forward vs the definition")
    for name, got, want in zip("qkv", grads, want_grads):
        agree(got, want, f"d{name}")


def test_on_an_emulated_chip_the_call_charged_whole_gives_the_same_results():
    """With the chip's speed emulated, an eager call runs charged as one attention kernel each way
    (test_kernel_costs.py), its backward recomputing the scores: the same values."""
    import ditorch
    from ditorch_ext.profiles import ChipProfile

    ditorch.set_chip(ChipProfile("fast", 8, None, 8, 8, fp32_tflops=1000.0, bf16_tflops=1000.0, memory_gbps=10000.0,
                                 launch_us=0.1))
    out, grads = run(flex_attention, "dipu", "alibi", "document")
    want_out, want_grads = reference("alibi", "document")
    agree(out, want_out, "forward vs the definition")
    for name, got, want in zip("qkv", grads, want_grads):
        agree(got, want, f"d{name}")


def test_compiled_forward_and_backward_equal_eager():
    compiled = torch.compile(flex_attention)
    out, grads = run(compiled, "dipu", "relative bias", "document")
    agree(out, cpu_flex_forward("relative bias", "document"), "compiled forward vs CPU flex_attention")
    want_out, want_grads = reference("relative bias", "document")
    agree(out, want_out, "compiled forward vs the definition")
    for name, got, want in zip("qkv", grads, want_grads):
        agree(got, want, f"compiled d{name}")


def test_other_devices_keep_torchs_check():
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)
