"""``ditorch profile``: measure one transformer layer of a model on this process's chip, at each
TP size, and write the ``layer_times_ms`` chip description ``cluster.yaml`` reads, so a plan
can come from measurements of this machine.

On the emulated vendor the chip runs at its datasheet's roofline times the time scale
(docs/device.md, "Speed"), and the times written are the chip's own: the measured time divided
by the time scale, less any time the device waited for a host that fell behind (the profile
says by how much it did): the same on every host. Without ``--time-scale`` the scale is chosen
for this host: ``host_ratio`` measures how many times longer the host takes for the layer than
the chip.

For TP size t, t processes run one real stage layer of the model (the project's LLaMA or a
Hugging Face config's own decoder layer, as ``ditorch.train`` builds it) over dicomm, so the
times include the TP all-reduces the runtime pays. Per micro-batch and layer it measures the
forward, the full backward (alternating, as in training), the recompute (the runtime's R is
the same forward, so it is the forward's time) and the update of the layer's shard (the
runtime's local step: norm, clip, AdamW and zeroing on a flat gradient buffer); the
median of ``repeats`` runs after warm-ups. It
also measures the activation memory one micro-batch leaves per layer and, with t >= 2, the
point-to-point time of one activation between two ranks (``p2p_bytes_per_s``, printed: the
host's loopback, not a chip's link). The chip's links (``intra_node_gbps``, ``nic_gbps``) and
memory bandwidth are its datasheet's (``heteropp.cluster.datasheet_defaults``): an emulated
run's links are the fleet's, emulated by dicomm at the time scale (docs/dicomm.md, "Emulated
links"), not this host's.
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import yaml

from diutil.address import free_port
from heteropp.cluster import MEASURED_TIME_KEYS, ChipSpec
from heteropp.model_spec import ModelSpec


# Layers timed back to back per sample (see _worker).
CHAIN = 4
# Written into each chip entry (``profiler_version``): what the layer times mean. Version 2 times
# a layer's update as the runtime's whole local step (see _worker); a cache of profiles (the
# demo's) measures again when an entry's version differs.
PROFILER_VERSION = 5
# Version 3 writes the chip's own time (measured / time scale), from datasheet-roofline emulation;
# version 4 leaves out the time the emulated device waited for a host that fell behind; version 5
# also its idle time at a sample's bounds (ditorch_ext.chip.timing_fence), and measures what a
# stage does once whatever its layers (stage_fwd, stage_update) apart from the layer's share.


# What `ditorch profile` prints for a TP size whose host fell more than LATE_WARN_PERCENT behind its
# chip, and how a caller reads it back (the demo measures such a chip again at a larger scale).
LATE_WARN_PERCENT = 2.0
LATE_WARNING = "the host fell behind the chip by {percent:.1f}% of its device time at time scale {scale:g}"
LATE_WARNING_LINE = re.compile(r"the host fell behind the chip by (\d+(?:\.\d+)?)% of its device time")


def _chip_seconds(fn, sync) -> float:
    """Seconds of one run of ``fn`` between two calls of ``sync`` (a timing fence), less the time
    the emulated device sat idle waiting for this host meanwhile (docs/device.md, Speed): what the
    chip takes behind a host that keeps up. Off the emulated vendor nothing is left out."""
    from ditorch_ext.chip import emulation_stats

    sync()
    late = emulation_stats().host_late_s
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start - (emulation_stats().host_late_s - late)


def _warmups() -> int:
    """Untimed runs before a device-time sample. A real chip needs several (clocks, caches,
    the allocator's first blocks). An emulated chip's device time is its kernels' datasheet
    cost, the same from the first run on; a cold host's extra time there is the lateness left
    out anyway (_chip_seconds), so one run, for the allocator, is enough."""
    return 1 if _speed_emulated() else 3


def _timed(fn, sync, repeats: int) -> float:
    """Median chip seconds (:func:`_chip_seconds`) of ``fn`` over ``repeats`` runs after two warm-ups."""
    samples = [_chip_seconds(fn, sync) for _ in range(repeats + 2)]
    return statistics.median(samples[2:])


def _device_seconds(fn, sync, repeats: int) -> float:
    """Mean device time the emulated timeline charged per run of ``fn`` over ``repeats`` runs
    after the warm-ups. Unlike :func:`_timed` it leaves out the host's own time after a
    synchronisation inside ``fn`` (the update reads the gradient norm before it steps): on the
    emulated device that is this host's time, scaled down by the time scale, so it would depend
    on the host and its load; a real chip's host spends microseconds there."""
    from ditorch_ext.chip import emulation_stats

    for _ in range(_warmups()):
        fn()
    sync()
    emulation_stats(reset=True)
    for _ in range(repeats):
        fn()
    sync()
    return emulation_stats().device_busy_s / repeats


def _update_seconds(update_step, sync, repeats: int, emulated: bool) -> float:
    """One update's seconds: on an emulated chip its kernels' device time (the host's time after
    the norm's synchronisation is this host's, not the chip's: see _device_seconds)."""
    return _device_seconds(update_step, sync, repeats) if emulated else _timed(update_step, sync, repeats)


def _replicated_update(module, flat, device):
    """The runtime's local step of a replicated stage (stage_update.py): the norm, the clip,
    AdamW on parameters that are views of one flat buffer, and the zeroing."""
    from heteropp.runtime.stage_update import clip_coefficient, make_optimizer, squared_norm, step_flat
    from heteropp.runtime.trainer import TrainOptions

    optimizer = make_optimizer(module.parameters(), lr=1e-4, weight_decay=TrainOptions.weight_decay)

    def update_step():
        sumsq = squared_norm([p.grad for p in module.parameters()], device)
        step_flat(flat, optimizer, clip_coefficient(math.sqrt(sumsq.item()), TrainOptions.clip))
    return update_step


def _zero1_update(module, flat, device, alone):
    """ZeRO-1's step (zero.py), what a stage at DP > 1 runs, over ``alone``, a group of this rank
    alone: the whole buffer is its slice, and the DP collectives are the links' time, not the chip's."""
    from heteropp.runtime.stage_update import clip_coefficient
    from heteropp.runtime.trainer import TrainOptions
    from heteropp.runtime.zero import ZeroAdamW

    zero = ZeroAdamW(flat, alone, 1, 0, lr=1e-4, weight_decay=TrainOptions.weight_decay)
    owned = [True] * len(flat.params)

    def update_step():
        zero.reduce_scatter_gradients()
        zero.step(clip_coefficient(math.sqrt(zero.owned_sumsq(owned).item()), TrainOptions.clip))
    return update_step


def _update_times(stage, flat, two_layers, device, alone, sync, repeats: int, emulated: bool) -> dict[str, float]:
    """Seconds of a layer's update and of a stage's fixed part (``update``, ``stage_update``), and
    of ZeRO-1's (``zero1_*``): one layer's update, and a two-layer stage's (made by
    ``two_layers``) less it. One optimizer lives at a time; what the chip cannot hold is left
    out (a layer's update is then charged whole, and ZeRO-1's is not measured), so the profile
    needs no more memory than one layer's replicated step."""
    import torch

    from heteropp.runtime.flat_parameters import FlatParameters

    makers = {"": _replicated_update, "zero1_": lambda *args: _zero1_update(*args, alone)}

    def seconds(make, module, buffer) -> float | None:
        try:
            return _update_seconds(make(module, buffer, device), sync, repeats, emulated)
        except torch.OutOfMemoryError:
            return None
        finally:
            gc.collect()  # the optimizer's state goes before the next is made

    one = {"": _update_seconds(_replicated_update(stage, flat, device), sync, repeats, emulated)}
    gc.collect()
    one["zero1_"] = seconds(makers["zero1_"], stage, flat)
    pair = None
    if two_layers is not None:
        try:
            module = two_layers()
            pair = (module, FlatParameters(list(module.parameters())))
        except torch.OutOfMemoryError:
            pass
    out = {}
    for name, make in makers.items():
        if one[name] is None:
            continue
        two = seconds(make, *pair) if pair is not None else None
        if two is None:
            out[f"{name}update"], out[f"{name}stage_update"] = one[name], 0.0
        else:
            out[f"{name}update"], out[f"{name}stage_update"] = max(0.0, two - one[name]), max(0.0, 2 * one[name] - two)
    return out


def _worker(rank: int, tp: int, port: int, chip: str, model: dict, precision: str, memory_scale: float,
            time_scale: float, repeats: int, sequence_parallel: bool, out: str) -> None:
    import torch
    import torch.distributed as dist

    import dicomm  # noqa: F401  (registers the backend)
    import ditorch_ext
    from ditorch_ext.chip import timing_fence
    from heteropp.runtime.flat_parameters import FlatParameters
    from heteropp.runtime.model_family import model_family
    from heteropp.runtime.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    ditorch_ext.set_chip(chip, memory_scale=memory_scale, time_scale=time_scale)
    device = torch.device("dipu", rank % torch.dipu.device_count())
    torch.dipu.set_device(device)
    dist.init_process_group("dicomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=120))
    spec = ModelSpec.from_dict(model, name=model.get("name"))
    family = model_family(spec)
    torch.manual_seed(0)
    layer = min(1, spec.n_layers - 1)  # a middle layer where there is one
    with torch.device(device):
        stage = family.stage((layer, layer + 1), False, False, TPGroup(dist.group.WORLD, tp, rank),
                             sequence_parallel=sequence_parallel)
        # the same stage without its layer: what a stage's forward does once for all its layers
        # (the position tables), measured apart so that a layer's time is the layer's alone
        bare = family.stage((layer, layer), False, False, TPGroup(dist.group.WORLD, tp, rank),
                            sequence_parallel=sequence_parallel)
    for p in stage.parameters():
        torch.nn.init.normal_(p, std=0.02)
    # the runtime's layout (flat_parameters.py): the backward below accumulates into its buffer
    flat = FlatParameters(list(stage.parameters()))

    local_seq = spec.seq // tp if stage.sp else spec.seq  # this rank's part of the sequence
    x = torch.randn(1, local_seq, spec.hidden, device=device)
    grad = torch.randn_like(x)
    autocast = torch.autocast("dipu", dtype=torch.bfloat16, enabled=precision == "bf16")
    sync = timing_fence
    holder = {}

    def forward():
        with autocast:
            holder["out"] = stage(x.detach().requires_grad_())

    # A stage runs its layers back to back, the host launching the next while the device still
    # computes; timed alone between two synchronisations, a layer would also pay the host's
    # work before its first kernel and a device gone cold. So CHAIN layers run back to back
    # per sample (each on its own input and graph) and each is charged its share.
    chain = [{} for _ in range(CHAIN)]

    def forwards():
        for h in chain:
            with autocast:
                h["out"] = stage(x.detach().requires_grad_())

    def backwards():
        for h in chain:
            torch.autograd.backward(h.pop("out"), grad)

    def bare_forwards():
        for _ in range(CHAIN):
            with autocast:
                bare(x)

    # Forward and backward alternate, as in training, after the warm-up rounds.
    from ditorch_ext.chip import emulation_stats

    fwd_samples, bwd_samples, bare_samples = [], [], []
    warmups = _warmups()
    for i in range(repeats + warmups):
        if i == warmups:
            emulation_stats(reset=True)
        for fn, samples in ((forwards, fwd_samples), (backwards, bwd_samples), (bare_forwards, bare_samples)):
            seconds = _chip_seconds(fn, sync)
            if i >= warmups:
                samples.append(seconds / CHAIN)
    lateness = emulation_stats()
    # the chip's own time: what the emulated device took, divided by the time scale it ran at
    stage_fwd = statistics.median(bare_samples) / time_scale
    fwd = max(0.0, statistics.median(fwd_samples) / time_scale - stage_fwd)
    bwd = statistics.median(bwd_samples) / time_scale
    # An update's launches and its norm's synchronisation cost a stage the same whatever its
    # layers: a layer's update is what a second layer adds, the rest is the stage's.
    def two_layers():
        first = min(layer, spec.n_layers - 2)
        with torch.device(device):
            return family.stage((first, first + 2), False, False, TPGroup(dist.group.WORLD, tp, rank),
                                sequence_parallel=sequence_parallel)

    # a group of each rank alone, made by every rank in turn before any can take its own path
    alone = [dist.new_group([r], backend="dicomm") for r in range(tp)][rank]
    updates = {k: v / time_scale for k, v in _update_times(stage, flat, two_layers if spec.n_layers >= 2 else None,
                                                            device, alone, sync, repeats, bool(lateness.kernels)).items()}
    ends = {k: v / time_scale for k, v in _end_times(spec, family, tp, rank, device, autocast, sync, repeats,
                                                      sequence_parallel, stage_fwd * time_scale).items()}
    holder.clear()
    # Garbage from the timing runs (autograd graphs in reference cycles, finished collectives'
    # work objects) is collected first and the collector kept off in the measured forward: a
    # collection inside it frees unrelated tensors and once made the activation negative.
    gc.collect()
    dist.barrier()
    sync()
    torch.dipu.reset_peak_memory_stats()
    gc.disable()
    try:
        base = torch.dipu.memory_allocated()
        forward()
        sync()
        activation = torch.dipu.memory_allocated() - base
    finally:
        gc.enable()
    holder.clear()
    bandwidth = None
    if tp >= 2:
        payload = torch.randn(1, spec.seq, spec.hidden, device=device)

        def ping():
            if rank == 0:
                dist.send(payload, 1)
            elif rank == 1:
                dist.recv(payload, 0)
            dist.barrier()

        # no kernels: a timing fence would count the whole transfer as the device's idle time
        seconds = _timed(ping, torch.dipu.synchronize, repeats)
        bandwidth = payload.numel() * payload.element_size() / seconds
    if rank == 0:
        # the runtime's R is this same forward, so the recompute time is the forward's
        Path(out).write_text(json.dumps({"fwd": fwd * 1e3, "bwd": bwd * 1e3, "recompute": fwd * 1e3,
                                         "stage_fwd": stage_fwd * 1e3, **{k: v * 1e3 for k, v in updates.items()},
                                         **{k: v * 1e3 for k, v in ends.items()},
                                         "activation_bytes": activation,
                                         "p2p_bytes_per_s": bandwidth,
                                         "host_late_percent": 100 * lateness.host_late_fraction}))
    # The profile states its lateness per TP size (host_late_percent, over the timed samples); the
    # process's report at exit would also count its set-up and the idle time at its timing fences.
    emulation_stats(reset=True)
    dist.destroy_process_group()


def _end_times(spec: ModelSpec, family, tp: int, rank: int, device, autocast, sync, repeats: int,
               sequence_parallel: bool, stage_fwd: float) -> dict[str, float]:
    """Forward and backward seconds of the pipeline's ends: the (vocab-parallel) embedding of
    the first stage, and the final norm, head and loss of the last. Each is timed as a stage
    with no layers, so ``stage_fwd`` (the forward of a stage with neither layers nor ends) is
    taken off the forwards."""
    import torch
    import torch.distributed as dist

    from heteropp.runtime.tensor_parallel import TPGroup

    group = TPGroup(dist.group.WORLD, tp, rank)
    L = spec.n_layers
    with torch.device(device):
        first = family.stage((0, 0), True, False, group, sequence_parallel=sequence_parallel)
        last = family.stage((L, L), False, True, group, sequence_parallel=sequence_parallel)
    for p in [*first.parameters(), *last.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, spec.vocab, (1, spec.seq), device=device)
    hidden = torch.randn(1, spec.seq // tp if last.sp else spec.seq, spec.hidden, device=device)
    out = {}
    for name, run in (("embed", lambda: first(tokens)), ("head", lambda: last(hidden.detach().requires_grad_(), tokens))):
        held = {}

        def forward(run=run):
            with autocast:
                held["y"] = run()

        def backward():
            y = held.pop("y")
            y.backward(torch.ones_like(y))

        fwd_samples, bwd_samples = [], []
        warmups = _warmups()
        for i in range(repeats + warmups):
            fwd, bwd = _chip_seconds(forward, sync), _chip_seconds(backward, sync)
            if i >= warmups:
                fwd_samples.append(fwd)
                bwd_samples.append(bwd)
        out[f"{name}_fwd"] = max(0.0, statistics.median(fwd_samples) - stage_fwd)
        out[f"{name}_bwd"] = statistics.median(bwd_samples)
    return out


def one_layer_on_chip(chip: str, model: dict, precision: str, memory_scale: float, sequence_parallel: bool = True):
    """In a measuring worker: this process on one thread, ``chip`` at time scale 1, and one
    layer of ``model`` (a ``ModelSpec`` dict) built on it. Returns the layer, an input for it and
    the autocast context ``precision`` asks for."""
    import torch

    import ditorch_ext
    from heteropp.roofline import _shape_only_group
    from heteropp.runtime.model_family import model_family

    torch.set_num_threads(1)
    ditorch_ext.set_chip(chip, memory_scale=memory_scale, time_scale=1.0)
    device = torch.device("dipu", 0)
    spec = ModelSpec.from_dict(model, name=model.get("name"))
    layer = min(1, spec.n_layers - 1)
    with torch.device(device):
        stage = model_family(spec).stage((layer, layer + 1), False, False, _shape_only_group(1),
                                         sequence_parallel=sequence_parallel)
    x = torch.randn(1, spec.seq, spec.hidden, device=device)
    return stage, x, torch.autocast("dipu", dtype=torch.bfloat16, enabled=precision == "bf16")


def _ratio_worker(rank: int, chip: str, model: dict, precision: str, memory_scale: float, sequence_parallel: bool,
                  out: str) -> None:
    """One rank, the chip at time scale 1: the host's CPU time for a layer's forward and
    backward against the chip's (the device time charged)."""
    import torch

    from ditorch_ext.chip import emulation_stats

    stage, x, autocast = one_layer_on_chip(chip, model, precision, memory_scale, sequence_parallel)
    ratios = []
    for i in range(4):
        torch.dipu.synchronize()
        emulation_stats(reset=True)
        start = time.process_time()  # the host's work, whatever its neighbours take of the cores
        with autocast:
            out_t = stage(x.detach().requires_grad_())
        out_t.backward(torch.ones_like(out_t))
        torch.dipu.synchronize()
        host = time.process_time() - start
        if i >= 1:  # the first run warms the allocator up
            ratios.append(host / max(emulation_stats().device_busy_s, 1e-9))
    Path(out).write_text(json.dumps({"ratio": statistics.median(ratios)}))


def host_ratio(chip: str, spec: ModelSpec, precision: str = "bf16", memory_scale: float = 1.0,
               sequence_parallel: bool = True) -> float:
    """How many times longer this host takes for one layer of ``spec`` (forward and backward,
    one thread, in CPU time: neighbours on the cores do not count) than ``chip`` does by its
    datasheet: the time scale at which one rank of that chip alone just keeps up
    (``diutil.datasheets.chips.time_scale_for`` combines the ranks' ratios, with headroom)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratio.json")
        mp.start_processes(_ratio_worker, nprocs=1, start_method="spawn",
                           args=(chip, spec.to_dict(), precision, memory_scale, sequence_parallel, out))
        return max(1.0, json.loads(Path(out).read_text())["ratio"])


def cluster_time_scale(clusters: Sequence[Mapping[str, int]], spec: ModelSpec, precision: str = "bf16",
                       memory_scale: float = 1.0) -> tuple[float, dict[str, float]]:
    """The time scale at which this host keeps up with each of ``clusters`` (chip name -> ranks
    of it on this host), run one at a time: each chip's ``host_ratio``, combined per cluster by
    ``diutil.datasheets.chips.time_scale_for`` (the largest ratio and the ratios' sum per core, with
    headroom), the largest over the clusters. Returns the scale and each chip's ratio. A chip
    named by a profile file needs ``$DITORCH_PROFILE_FILE`` in this process's environment (the
    measuring worker inherits it)."""
    from diutil.datasheets.chips import time_scale_for

    if not clusters or not all(clusters):
        raise ValueError(f"cluster_time_scale: clusters={list(clusters)!r}; expected chip counts like [{{'A': 2}}]")
    chips = dict.fromkeys(chip for cluster in clusters for chip in cluster)
    ratios = {chip: host_ratio(chip, spec, precision, memory_scale) for chip in chips}
    scale = max(time_scale_for([ratios[chip] for chip, n in cluster.items() for _ in range(n)])
                for cluster in clusters)
    return scale, ratios


def profile_tp(chip: str, spec: ModelSpec, tp: int, precision: str = "bf16", memory_scale: float = 0.001,
               repeats: int = 5, sequence_parallel: bool = True, time_scale: float = 1.0) -> dict:
    """Measure one layer of ``spec``'s model at TP size ``tp`` on ``tp`` spawned ranks; returns
    rank 0's numbers."""
    import torch.multiprocessing as mp

    from .model_family import model_family

    model_family(spec).check_tp(tp, f"ditorch profile --tp {tp}")
    if spec.seq % tp:
        raise ValueError(f"ditorch profile --tp {tp}: seq={spec.seq} does not split over {tp} ranks")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, nprocs=tp, start_method="spawn",
                           args=(tp, free_port(), chip, spec.to_dict(), precision, memory_scale, time_scale, repeats,
                                 sequence_parallel, out))
        return json.loads(Path(out).read_text())


def chip_description(chip: str, results: dict[int, dict], memory_scale: float, time_scale: float = 1.0,
                     measured_time_scale: float | None = None) -> dict:
    """The ``chips: {NAME: ...}`` entry of cluster.yaml from measured results; links and memory
    bandwidth from the chip's datasheet. ``time_scale`` is the one the plan's runs emulate at,
    ``measured_time_scale`` (default: the same) the one the results were measured at: the
    results are the chip's own times whatever the scale its host kept up at."""
    import platform

    from diutil.datasheets.chips import resolve
    from heteropp.cluster import datasheet_defaults

    profile = resolve(chip)
    sheet = datasheet_defaults(chip, f"ditorch profile --chip {chip}")
    late = max((r.get("host_late_percent") or 0.0) for r in results.values())
    measured = time_scale if measured_time_scale is None else measured_time_scale
    return {
        "count": profile.chips_per_node,
        "memory_gb": round(profile.capacity_bytes(memory_scale) / 1e9, 6),
        "chips_per_node": profile.chips_per_node,
        "tp_max": max(results),
        "intra_node_gbps": sheet["intra_node_gbps"],
        "hbm_gbps": sheet["hbm_gbps"],
        "nic_gbps": sheet["nic_gbps"],
        "layer_times_ms": {tp: {k: round(r[k], 4) for k in MEASURED_TIME_KEYS if k in r}
                           for tp, r in sorted(results.items())},
        "activation_mb": {tp: round(r["activation_bytes"] / 2**20, 4) for tp, r in sorted(results.items())},
        "emulated_time_scale": time_scale,
        "profiler_version": PROFILER_VERSION,
        "source": (f"measured: ditorch profile on {platform.node() or 'this host'} ({_cpu_name()}), "
                   f"{_vendor()} vendor at time scale {measured:g}; the host fell behind the chip by {late:.1f}%"),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def _vendor() -> str:
    return os.environ.get("DITORCH_VENDOR") or "emu"


def _speed_emulated() -> bool:
    """Whether the ranks' vendor emulates a chip's speed: emu, and the native vendor over the CPU
    (its kernels run on the calling thread); a device with streams (cuda, ...) runs at its own."""
    return _vendor() in ("emu", "cpu")


def write_cluster(path: str | Path, counts: dict[str, int], link_gbps: float = 1.0, latency_us: float = 50) -> Path:
    """A cluster.yaml over chip files ``chip-NAME.yaml`` (as ``ditorch profile --out`` names them
    beside it) with ``counts`` chips of each; every stage boundary gets the same link."""
    path = Path(path)
    link = f"{{bandwidth_gbps: {link_gbps}, latency_us: {latency_us}}}"
    path.write_text(
        "# an emulated cluster: chip types measured by `ditorch profile`, one link for all boundaries\n"
        f"name: emu\nchip_library: [{', '.join(f'chip-{c}.yaml' for c in counts)}]\n"
        f"counts: {{{', '.join(f'{c}: {n}' for c, n in counts.items())}}}\n"
        f"links:\n  inter_node: {link}\n  inter_cluster: {link}\n")
    return path


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure a model's layer times on an emulated chip per TP size")
    p.add_argument("--chip", required=True, help="chip profile (A, B, C, D or one from $DITORCH_PROFILE_FILE)")
    p.add_argument("--model", required=True,
                   help="model.yaml (LlamaConfig keys), or a Hugging Face config.json or model directory")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's max_seq_len / "
                                                         "max_position_embeddings)")
    p.add_argument("--tp", default="1", help="TP sizes, comma-separated (each spawns that many ranks)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--memory-scale", type=float, default=None, help="chip memory scale (default $DITORCH_MEMORY_SCALE or 0.001)")
    p.add_argument("--time-scale", default=None,
                   help="run the chip this many times slower than its datasheet (default $DITORCH_TIME_SCALE, else "
                        "chosen for this host: its time for the layer against this chip's, times --ranks per core "
                        "and headroom); the plan's runs use the same")
    p.add_argument("--run-time-scale", default=None,
                   help="the time scale the plan's runs emulate at (default: the measured one): a chip's profiled "
                        "times are its own at any scale its host keeps up at, so a profile, whose ranks are fewer "
                        "than a run's, may be measured at a lower scale and wait less for its emulated device")
    p.add_argument("--ranks", type=int, default=None,
                   help="emulated ranks the plan's runs will put on this host (default: the largest --tp), for the "
                        "time scale chosen when none is given")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="measure the layer as ditorch.train --no-sequence-parallel runs it")
    p.add_argument("--out", required=True, help="write the chip description (cluster.yaml's chips form) here")
    p.set_defaults(func=profile_command)


def profile_command(args) -> int:
    import sys

    try:
        tps = sorted({int(t) for t in args.tp.split(",")})
        if any(t < 1 or t & (t - 1) for t in tps):
            raise ValueError(f"--tp {args.tp}: expected powers of two like 1,2,4")
        spec = ModelSpec.load(args.model, seq=args.seq)
        scale = args.memory_scale or float(os.environ.get("DITORCH_MEMORY_SCALE", "0.001"))
        from diutil.datasheets.chips import resolve, time_scale_from_env, time_scale_or_default

        resolve(args.chip)
        if not _speed_emulated():
            # a real device runs at its own speed: its times are its own, no scale to divide by
            stretch = 1.0
        elif args.time_scale is None and time_scale_from_env() is None:
            from diutil.datasheets.chips import time_scale_for

            ratio = host_ratio(args.chip, spec, args.precision, scale, args.sequence_parallel)
            stretch = time_scale_for([ratio] * (getattr(args, "ranks", None) or max(tps)))
            print(f"this host takes {ratio:.1f}x chip {args.chip}'s time for the layer: time scale {stretch:g}")
        else:
            stretch = time_scale_or_default(args.time_scale, "--time-scale")
        run_stretch = stretch
        if _speed_emulated() and getattr(args, "run_time_scale", None) is not None:
            run_stretch = time_scale_or_default(args.run_time_scale, "--run-time-scale")
    except (ValueError, OSError) as exc:
        print(f"ditorch profile: {exc}", file=sys.stderr)
        return 2
    results = {}
    print(f"profiling one layer of {Path(args.model).name} on chip {args.chip} ({args.precision}) at time scale "
          f"{stretch:g}; chip milliseconds (measured / time scale):")
    print(f"{'TP':>3} {'fwd ms':>8} {'bwd ms':>8} {'recomp ms':>9} {'update ms':>9} {'act MiB':>8} {'p2p GB/s':>8} "
          f"{'stage f/u ms':>13} {'embed f/b ms':>13} {'head f/b ms':>13}")
    for tp in tps:
        r = results[tp] = profile_tp(args.chip, spec, tp, args.precision, scale, args.repeats, args.sequence_parallel,
                                     stretch)
        p2p = f"{r['p2p_bytes_per_s'] / 1e9:.2f}" if r["p2p_bytes_per_s"] else "-"
        print(f"{tp:>3} {r['fwd']:>8.2f} {r['bwd']:>8.2f} {r['recompute']:>9.2f} {r['update']:>9.2f} "
              f"{r['activation_bytes'] / 2**20:>8.2f} {p2p:>8} {r['stage_fwd']:>6.2f}/{r['stage_update']:<6.2f} "
              f"{r['embed_fwd']:>6.2f}/{r['embed_bwd']:<6.2f} "
              f"{r['head_fwd']:>6.2f}/{r['head_bwd']:<6.2f}", flush=True)
        if (r.get("host_late_percent") or 0) > LATE_WARN_PERCENT:
            print("    " + LATE_WARNING.format(percent=r["host_late_percent"], scale=stretch)
                  + ": that wait is left out of these times; a run at this scale is as late "
                  "(a larger --time-scale lets the host keep up)", flush=True)
    desc = {"chips": {args.chip: chip_description(args.chip, results, scale, time_scale=run_stretch,
                                                  measured_time_scale=stretch)}}
    try:  # what the planner will read: a measurement it would refuse is not written
        ChipSpec.from_dict(args.chip, desc["chips"][args.chip])
    except ValueError as exc:
        print(f"ditorch profile: the measurement is not a valid profile, not writing {args.out}: {exc}", file=sys.stderr)
        return 1
    seq = f" --seq {args.seq}" if args.seq else ""
    header = (f"# ditorch profile --chip {args.chip} --model {args.model}{seq} --tp {args.tp} --precision {args.precision}\n"
              f"# measured one layer per micro-batch of {spec.seq} tokens; memory is the emulated "
              f"capacity at memory scale {scale:g}; times are the chip's own (measured at time scale {stretch:g} "
              f"and divided by it); the plan's runs emulate at time scale {run_stretch:g}\n")
    Path(args.out).write_text(header + yaml.safe_dump(desc, sort_keys=False))
    print(f"wrote {args.out}")
    return 0
