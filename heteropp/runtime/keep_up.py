"""Whether this host keeps up with a cluster's emulated chips at a time scale, measured with the
cluster's ranks all running at once, and the time scale at which it does.

``heteropp.runtime.profiler.host_ratio`` measures one rank alone in CPU time, and
``diutil.datasheets.chips.time_scale_for`` adds headroom for what that leaves out: ranks
sharing cores, busy neighbours, caches and memory bandwidth shared between cores, a CPU quota.
The headroom is a guess; this measures instead. One process per rank of the cluster (its chip,
one layer of the model, forward and backward in a loop, as ``host_ratio``'s worker) runs at the
candidate time scale beside all the others, on the cores training will have with whatever else
runs there, and reports how far its host fell behind its chip (``host_late_fraction``, the
figure a training run prints). While a rank is later than the target, the scale rises by that
lateness (and a margin) and the ranks measure again, in the same processes.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from heteropp.model_spec import ModelSpec

# A rank's loop is this much late at most; a training step adds the pipeline's own work
# (schedules, p2p, the optimizer) to the layer's, so the target sits under the 5% a run allows.
TARGET_LATE_FRACTION = 0.02
# The scale the loop kept up at, times this, is the one training runs at: a pipeline rank does more
# per step than its layer's loop (the first stage embeds, every stage steps its optimizer at the
# same moment, p2p waits end in bursts). Measured: ranks whose loops were 0-1.6% late at 270 and
# 410 ran training 1.0-6.1% late (the first stage, chip A, the latest), so 15% more leaves
# training within 5%.
TRAINING_MARGIN = 1.15
# Each raise goes this much past what the measured lateness asks (a rank measured 10% late at
# scale k keeps up at about 1.1 k; sampling noise makes the step land short otherwise).
RAISE_MARGIN = 1.15


@dataclasses.dataclass(frozen=True)
class KeepUp:
    """The calibration's outcome: the scale and each rank's lateness at every scale tried."""

    time_scale: float  # for training: the last scale tried, times TRAINING_MARGIN where it kept up
    tried: list[tuple[float, list[float]]]  # (time scale, each rank's host_late_fraction)

    @property
    def kept_up(self) -> bool:
        return max(self.tried[-1][1]) <= TARGET_LATE_FRACTION


def _round_up(scale: float) -> float:
    """Two significant digits, rounded up (as ``time_scale_for``)."""
    digits = 10 ** (math.floor(math.log10(scale)) - 1)
    return float(math.ceil(round(scale / digits, 9)) * digits)


def next_scale(scale: float, late: Sequence[float]) -> float:
    """The scale to try after ``scale`` left the latest rank ``max(late)`` behind (a fraction of
    its device time): the host's work per device second is about (1 + late) / scale of what the
    chip needs, so the scale rises by that and ``RAISE_MARGIN``, rounded up to two digits."""
    worst = max(late)
    if worst < 0 or not math.isfinite(worst):
        raise ValueError(f"late={list(late)!r}; expected fractions >= 0")
    return _round_up(max(scale * (1 + worst) * RAISE_MARGIN, scale * 1.05))


def _rank_worker(conn, chip: str, model: dict, precision: str, memory_scale: float, seconds: float) -> None:
    """One rank: build the layer at time scale 1, then for each scale the parent sends run the
    layer's forward and backward for ``seconds`` of wall time and send back the lateness."""
    import torch

    import ditorch_ext
    from ditorch_ext.chip import emulation_stats
    from heteropp.roofline import _shape_only_group
    from heteropp.runtime.model_family import model_family

    torch.set_num_threads(1)
    ditorch_ext.set_chip(chip, memory_scale=memory_scale, time_scale=1.0)
    device = torch.device("dipu", 0)
    spec = ModelSpec.from_dict(model, name=model.get("name"))
    layer = min(1, spec.n_layers - 1)
    with torch.device(device):
        stage = model_family(spec).stage((layer, layer + 1), False, False, _shape_only_group(1), sequence_parallel=True)
    x = torch.randn(1, spec.seq, spec.hidden, device=device)
    autocast = torch.autocast("dipu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            out = stage(x.detach().requires_grad_())
        out.backward(torch.ones_like(out))

    step()  # the allocator warms up
    torch.dipu.synchronize()
    conn.send("ready")
    while (scale := conn.recv()) is not None:
        ditorch_ext.set_chip(chip, memory_scale=memory_scale, time_scale=scale)
        step()
        torch.dipu.synchronize()
        emulation_stats(reset=True)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            step()
        torch.dipu.synchronize()
        conn.send(emulation_stats().host_late_fraction)


def calibrate(ranks: Sequence[str], spec: ModelSpec, start_scale: float, precision: str = "bf16",
              memory_scale: float = 1.0, seconds: float = 2.0, rounds: int = 4) -> KeepUp:
    """The time scale for training: from ``start_scale`` up, the first at which every rank of
    ``ranks`` (one chip name per rank on this host) running at once stays within
    ``TARGET_LATE_FRACTION`` of its chip's device time, times ``TRAINING_MARGIN``; at most
    ``rounds`` scales tried (the last one tried if none kept up)."""
    import torch.multiprocessing as mp

    if not ranks:
        raise ValueError("ranks=[] is invalid; expected one chip name per rank on this host")
    if not (math.isfinite(start_scale) and start_scale >= 1):
        raise ValueError(f"start_scale={start_scale!r} is invalid; expected a time scale >= 1")
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    try:
        for chip in ranks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_worker, args=(child, chip, spec.to_dict(), precision, memory_scale,
                                                          seconds), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        for pipe in pipes:
            _receive(pipe, "ready")
        scale, tried = float(start_scale), []
        for _ in range(rounds):
            for pipe in pipes:
                pipe.send(scale)
            late = [float(_receive(pipe, "lateness")) for pipe in pipes]
            tried.append((scale, late))
            if max(late) <= TARGET_LATE_FRACTION:
                break
            scale = next_scale(scale, late)
        last = tried[-1][0]
        return KeepUp(_round_up(last * TRAINING_MARGIN) if max(tried[-1][1]) <= TARGET_LATE_FRACTION else last, tried)
    finally:
        for pipe in pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _receive(pipe, what: str, timeout: float = 300.0):
    if not pipe.poll(timeout):
        raise RuntimeError(f"time-scale calibration: a rank sent no {what} within {timeout:.0f} s")
    try:
        return pipe.recv()
    except EOFError:
        raise RuntimeError(f"time-scale calibration: a rank ended before sending its {what}") from None
