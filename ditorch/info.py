"""``ditorch info``: what this machine and this build of ditorch can do."""
from __future__ import annotations

import argparse
import importlib
from typing import Callable


def _section(title: str, lines: list[str]) -> str:
    return "\n".join([title] + [f"  {line}" for line in lines])


def describe_numerics(profile) -> str:
    """A chip's arithmetic in one line, as it differs from IEEE fp32 with round-to-nearest-even."""
    parts = []
    if profile.matmul_mantissa_bits < 23:
        parts.append(f"fp32 matmul inputs keep {profile.matmul_mantissa_bits} mantissa bits")
    if profile.accumulator_bits < 23 or profile.accumulation_block:
        block = f"{profile.accumulation_block}-term blocks" if profile.accumulation_block else "the whole K"
        parts.append(f"matmul accumulator keeps {profile.accumulator_bits} bits between {block}")
    if profile.round_toward_zero:
        parts.append("bf16/fp16 results truncated")
    if profile.special_function_bits < 23:
        parts.append(f"special functions to {profile.special_function_bits} bits")
    if profile.flush_denormals:
        parts.append("denormals flushed")
    return "; ".join(parts) or "IEEE (as the host)"


def _device_lines() -> list[str]:
    import torch

    import ditorch  # noqa: F401  (registers dipu)
    import ditorch_ext

    profile, scale = ditorch_ext.current()
    props = torch.dipu.get_device_properties(0)
    lines = [
        f"vendor: {ditorch_ext.vendor_name()} (host-addressable memory: {torch.dipu.is_host_addressable()})",
        f"devices: {torch.dipu.device_count()}   current: dipu:{torch.dipu.current_device()}",
        f"chip: {profile.name} - {profile.description}",
        f"capacity per device: {props.total_memory / 2**30:.3f} GiB (memory_gb={profile.memory_gb} x scale {scale:g})",
        f"speed: {profile.relative_speed}x A100 (kernels slowed {profile.slowdown:.2f}x on this host)",
        "numerics: " + describe_numerics(profile),
        f"node: {profile.chips_per_node} chips, {profile.nics_per_node} NICs",
        "chips known: " + ", ".join(sorted(ditorch_ext.known_profiles())),
        f"autocast dtypes: {', '.join(str(d).replace('torch.', '') for d in torch.dipu.get_amp_supported_dtype())}",
    ]
    return lines


def _comm_lines() -> list[str]:
    dicomm = importlib.import_module("dicomm")
    lines = [
        "backend: dicomm (default for dipu tensors)",
        "transports built: " + ", ".join(dicomm.transports_built()),
        "transports usable here: " + ", ".join(dicomm.transports_usable()),
    ]
    return lines


def _verbs_lines() -> list[str]:
    topology = importlib.import_module("dicomm.topology")
    verbs = importlib.import_module("dicomm.verbs")
    try:
        live, why = {d.name: d for d in verbs.query_devices()}, ""
    except verbs.VerbsUnavailable as exc:
        live, why = {}, str(exc)
    return topology.describe(live=live, no_device_reason=why).splitlines()


def report() -> str:
    """The whole report as text; a layer that cannot load says why instead of hiding."""
    sections: list[tuple[str, Callable[[], list[str]]]] = [
        ("DiTorch device layer", _device_lines),
        ("DiComm", _comm_lines),
        ("RDMA (verbs devices)", _verbs_lines),
    ]
    out = []
    for title, lines in sections:
        try:
            body = lines()
        except Exception as exc:  # report, do not crash: info is what people run when things break
            body = [f"unavailable: {type(exc).__name__}: {exc}"]
        out.append(_section(title, body))
    return "\n\n".join(out)


def run(args: argparse.Namespace) -> int:
    print(report())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="print vendor, chip, capacity and what is built in")
    parser.set_defaults(func=run)
