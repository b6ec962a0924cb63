"""torchtitan's train entry point, run unchanged on ``dipu`` or, as the reference, on the CPU.

    torchrun --nproc-per-node N tests/ecosystem/launch.py {dipu|cpu} <torchtitan arguments>

``dipu``: ``import ditorch`` and nothing else, as a user would; torchtitan finds the device with
``torch._utils._get_available_device_type()`` and its process group (dicomm) in
``Backend.default_device_backend_map``.

``cpu``: torchtitan has no CPU device of its own, so the reference run gets the smallest shim it
needs: the device type torchtitan asks for is ``cpu`` (whose backend is gloo), ``torch.cpu`` answers
the few device-module calls torchtitan's memory monitor makes, and FlexAttention, which has no CPU
backward in this torch (eager refuses it: "FlexAttention does not support backward on CPU"; the
inductor has no CPU lowering of it), runs torch's own dense implementation (the math every device
falls back to) under the ``aot_eager`` backend, where torchtitan compiles it with the inductor.
gloo has neither ``AVG`` nor ``PREMUL_SUM``, the reductions FSDP2 divides gradients with, so the
reference's FSDP2 sums and then divides (its own ``force_sum_reduction_for_comms`` path).
A compiled model's CPU reference is given ``--compile.backend aot_eager`` by the test for the same
reason.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

DEVICES = ("dipu", "cpu")


def _cpu_shim() -> None:
    import torch
    import torch._utils
    import torch.nn.attention.flex_attention as flex

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: "cpu"
    # A large capacity: torchtitan only divides its peak-memory numbers by it.
    cpu.get_device_properties = lambda device=None: SimpleNamespace(total_memory=1 << 40, name="cpu")
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    # An index, as an accelerator's: torchtitan passes it to barrier(device_ids=...).
    cpu.current_device = lambda: 0

    validate = flex._validate_device

    def validate_device(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)

    flex._validate_device = validate_device
    compile_ = torch.compile

    def compile_flex_eagerly(model=None, **kwargs):
        if model is flex.flex_attention:
            return compile_(model, backend="aot_eager", fullgraph=kwargs.get("fullgraph", False))
        return compile_(model, **kwargs) if model is not None else compile_(**kwargs)

    torch.compile = compile_flex_eagerly

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def sum_then_divide(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                        force_sum_reduction_for_comms=False):
        return divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, True)

    _fsdp_collectives._get_gradient_divide_factors = sum_then_divide


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in DEVICES:
        raise SystemExit(f"usage: launch.py {{{'|'.join(DEVICES)}}} <torchtitan arguments>; got {argv[:1]}")
    device, rest = argv[0], argv[1:]
    if device == "dipu":
        import ditorch  # noqa: F401  (the one line a user adds)
    else:
        _cpu_shim()
    from torchtitan.train import main as titan_main

    sys.argv = [sys.argv[0], *rest]
    titan_main()


if __name__ == "__main__":
    main()
