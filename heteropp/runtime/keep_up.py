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
lateness (and a margin, at most doubling) and the ranks measure again, in the same processes;
once every rank keeps up, the search narrows down towards the highest scale that fell behind.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from heteropp.model_spec import ModelSpec

# A rank's loop is this much late at most; a training step adds the pipeline's own work
# (schedules, p2p, the optimizer) to the layer's, so the target sits under the 5% a run allows.
TARGET_LATE_FRACTION = 0.02
# The scale the loop kept up at, times this, is the one training runs at: a pipeline rank does more
# per step than its layer's loop (the first stage embeds, every stage steps its optimizer at the
# same moment, p2p waits end in bursts). The loop waits for the device after the forward and after
# the backward, as a stage's sends do: without them the forward's surplus of device time covers
# chip B's host-heavy backward (its 32-term accumulation blocks) and the loop keeps up at scales
# where B's training rank falls 13.4% behind (docs/device.md, "Speed").
TRAINING_MARGIN = 1.1
# Each raise goes this much past what the measured lateness asks (a rank measured 10% late at
# scale k keeps up at about 1.1 k; sampling noise makes the step land short otherwise).
RAISE_MARGIN = 1.15
# One raise at most doubles the scale; once a scale kept up, the search narrows down between the
# highest that fell behind and the lowest that kept up until they are within 10%.
MAX_RAISE = 2.0
CLOSE_ENOUGH = 1.1


@dataclasses.dataclass(frozen=True)
class KeepUp:
    """The calibration's outcome: the scale and each rank's lateness at every scale tried."""

    time_scale: float  # for training: the lowest scale that kept up times TRAINING_MARGIN (else the last tried)
    tried: list[tuple[float, list[float]]]  # (time scale, each rank's host_late_fraction)

    @property
    def kept_up(self) -> bool:
        return any(max(late) <= TARGET_LATE_FRACTION for _, late in self.tried)


def _round_up(scale: float) -> float:
    """Two significant digits, rounded up (as ``time_scale_for``)."""
    digits = 10 ** (math.floor(math.log10(scale)) - 1)
    return float(math.ceil(round(scale / digits, 9)) * digits)


def next_scale(scale: float, late: Sequence[float]) -> float:
    """The scale to try after ``scale`` left the latest rank ``max(late)`` behind (a fraction of
    its device time): the host's work per device second is about (1 + late) / scale of what the
    chip needs, so the scale rises by that and ``RAISE_MARGIN``, at most ``MAX_RAISE`` times (a
    burst of another job's work can make one sample many times late), rounded up to two digits."""
    worst = max(late)
    if worst < 0 or not math.isfinite(worst):
        raise ValueError(f"late={list(late)!r}; expected fractions >= 0")
    return _round_up(min(max(scale * (1 + worst) * RAISE_MARGIN, scale * 1.05), scale * MAX_RAISE))


def between(low: float, high: float) -> float | None:
    """The scale to try between ``low`` (a rank fell behind) and ``high`` (every rank kept up):
    their geometric mean rounded up to two digits, or None once they are within ``CLOSE_ENOUGH``."""
    if high <= low * CLOSE_ENOUGH:
        return None
    mid = _round_up(math.sqrt(low * high))
    return mid if low < mid < high else None


def _rank_worker(conn, chip: str, model: dict, precision: str, memory_scale: float, seconds: float) -> None:
    """One rank: build the layer at time scale 1, then for each scale the parent sends run the
    layer's forward and backward for ``seconds`` of wall time and send back the lateness."""
    import torch

    import ditorch_ext
    from ditorch_ext.chip import emulation_stats

    from .profiler import one_layer_on_chip

    stage, x, autocast = one_layer_on_chip(chip, model, precision, memory_scale)

    def step() -> None:
        # A pipeline stage's forward and its backward each end in a send, which waits for the
        # device (heteropp/runtime/executor.py): the forward's surplus of device time never
        # covers a host-heavy backward, so the loop may not let it either.
        with autocast:
            out = stage(x.detach().requires_grad_())
        torch.dipu.synchronize()
        out.backward(torch.ones_like(out))
        torch.dipu.synchronize()

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
    # the parent reported the lateness; at time scale 1 the process does not report it again at exit
    ditorch_ext.set_chip(chip, memory_scale=memory_scale, time_scale=1.0)


def calibrate(ranks: Sequence[str], spec: ModelSpec, start_scale: float, precision: str = "bf16",
              memory_scale: float = 1.0, seconds: float = 2.0, rounds: int = 6) -> KeepUp:
    """The time scale for training: the lowest found at which every rank of ``ranks`` (one chip
    name per rank on this host) running at once stays within ``TARGET_LATE_FRACTION`` of its
    chip's device time, times ``TRAINING_MARGIN``. From ``start_scale`` the scale rises by each
    sample's lateness (``next_scale``) until all ranks keep up, then narrows down between the
    highest scale that fell behind and that one (``between``); at most ``rounds`` scales tried
    (the last one tried if none kept up)."""
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

        def measure(scale: float) -> list[float]:
            for pipe in pipes:
                pipe.send(scale)
            return [float(_receive(pipe, "lateness")) for pipe in pipes]

        return search(measure, float(start_scale), rounds)
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


def search(measure: Callable[[float], list[float]], start_scale: float, rounds: int) -> KeepUp:
    """``calibrate``'s search over scales, ``measure(scale)`` giving each rank's lateness there."""
    scale, tried = start_scale, []
    behind, kept = 0.0, math.inf  # the highest scale a rank fell behind at, the lowest all kept up at
    for _ in range(rounds):
        late = measure(scale)
        tried.append((scale, late))
        if max(late) <= TARGET_LATE_FRACTION:
            kept = min(kept, scale)
        else:
            behind = max(behind, scale)
        if kept == math.inf:
            scale = next_scale(scale, late)
        elif (mid := between(behind, kept) if behind else None) is not None:
            scale = mid
        else:
            break
    return KeepUp(_round_up(kept * TRAINING_MARGIN) if kept < math.inf else tried[-1][0], tried)


def _receive(pipe, what: str, timeout: float = 300.0):
    if not pipe.poll(timeout):
        raise RuntimeError(f"time-scale calibration: a rank sent no {what} within {timeout:.0f} s")
    try:
        return pipe.recv()
    except EOFError:
        raise RuntimeError(f"time-scale calibration: a rank ended before sending its {what}") from None
