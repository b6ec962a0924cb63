"""Per-layer timings of a chip type for each TP size: the numbers the cost model consumes.

``ChipProfile`` answers, for one micro-batch through one transformer layer on one chip of a
TP group: forward, backward-input, backward-weight and recompute time, and the per-layer
optimizer update time for a (TP, DP) pair. Profiles come from one of three sources, named in
``cluster.yaml``:

- ``layer_times_ms``: measured timings per TP size (the HeteroPP runtime's profiler writes these);
- ``effective_tflops``: an analytic model from the chip's sustained matmul rate and bandwidths;
- ``calibrate``: the analytic model with the sustained rate solved so that the cost model
  reproduces a measured homogeneous throughput (how the paper's chips A-D are derived
  from Tables 5-6; see docs/heteropp.md).
"""
from __future__ import annotations

import dataclasses
import math

from .cluster import END_TIME_KEYS, ChipSpec, LinkSpec
from .model_spec import BF16, FP32, ModelSpec

# Adam step per fp32 parameter: read master, grad, m, v; write master, m, v; write the bf16 copy
_ADAM_BYTES_PER_PARAM = 4 * 4 + 3 * 4 + 2


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Seconds for one micro-batch through one layer on one chip of a TP group."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute: float

    @property
    def bwd(self) -> float:
        return self.bwd_input + self.bwd_weight

    def compute(self, recompute: bool) -> float:
        """The paper's t_fwd + t_bwd + r * t_recomp."""
        return self.fwd + self.bwd + (self.recompute if recompute else 0.0)


class ChipProfile:
    """Layer timings of one chip type running one model."""

    def __init__(self, chip: ChipSpec, model: ModelSpec, dp_link: LinkSpec | None = None):
        """``dp_link``: the link a DP ring crosses between nodes (the cluster's ``inter_node``,
        diutil/datasheets/links.py), which bounds the chip's NIC; None: the NIC alone."""
        self.chip = chip
        self.model = model
        self.dp_link = dp_link
        self.effective_flops: float | None = None  # FLOP/s per chip for the analytic sources
        if chip.effective_tflops is not None:
            self.effective_flops = chip.effective_tflops * 1e12
        elif chip.calibration is not None:
            self.effective_flops = _calibrate(chip, model)
        self._cache: dict[int, LayerTimes] = {}

    def tp_allreduce_time(self, tp: int) -> float:
        """Ring all-reduce (or SP all-gather + reduce-scatter) of one layer's activation."""
        if tp == 1:
            return 0.0
        nbytes = BF16 * self.model.seq * self.model.hidden
        return 2.0 * (tp - 1) / tp * nbytes / self.chip.intra_node_bandwidth

    def layer_times(self, tp: int) -> LayerTimes:
        if tp not in self._cache:
            self._cache[tp] = self._layer_times(tp)
        return self._cache[tp]

    def _layer_times(self, tp: int) -> LayerTimes:
        measured = self.chip.measured_ms
        if measured is not None:
            if tp not in measured:
                raise KeyError(
                    f"chip {self.chip.name!r}: no measured layer timings for TP={tp}; measured TP sizes are {sorted(measured)}"
                )
            m, ms = measured[tp], self._ms
            # a measured backward is split evenly: dgrad and wgrad have equal FLOPs
            return LayerTimes(
                fwd=m["fwd"] * ms,
                bwd_input=m["bwd"] * 0.5 * ms,
                bwd_weight=m["bwd"] * 0.5 * ms,
                recompute=m.get("recompute", m["fwd"]) * ms,
            )
        if self.chip.datasheet is not None:
            return self._datasheet_layer_times(tp)
        matmul = self.model.layer_forward_flops() / (tp * self.effective_flops)
        comm = 2.0 * self.tp_allreduce_time(tp)  # attention block + MLP block
        return LayerTimes(fwd=matmul + comm, bwd_input=matmul + comm, bwd_weight=matmul, recompute=matmul + comm)

    @property
    def _ms(self) -> float:
        """Seconds per measured millisecond: a profile's chip time runs at its time scale."""
        return 1e-3 * (self.chip.emulated_time_scale or 1.0)

    def _datasheet_layer_times(self, tp: int) -> LayerTimes:
        """The layer's kernels on the datasheet (forward and backward), plus the TP all-reduces
        over the chip's scale-up links; the backward split evenly as a measured one is."""
        from diutil.datasheets.chips import resolve

        from .roofline import datasheet_kernel_times

        k = datasheet_kernel_times(self.model, tp, resolve(self.chip.datasheet).datasheet)
        comm = 2.0 * self.tp_allreduce_time(tp)  # attention block + MLP block
        return LayerTimes(fwd=k.fwd + comm, bwd_input=k.bwd / 2 + comm, bwd_weight=k.bwd / 2, recompute=k.fwd + comm)

    def stage_time(self, tp: int) -> float:
        """Seconds per micro-batch a stage's forward (and its recompute) spends outside its layers
        and the pipeline's ends: the position tables it computes once for all its layers.
        Measured profiles and datasheets; 0 in the paper's analytic model."""
        measured = self.chip.measured_ms
        if measured is not None:
            return measured.get(tp, {}).get("stage_fwd", 0.0) * self._ms
        if self.chip.datasheet is not None:
            from diutil.datasheets.chips import resolve

            from .roofline import datasheet_kernel_times

            return datasheet_kernel_times(self.model, tp, resolve(self.chip.datasheet).datasheet).stage_fwd
        return 0.0

    def stage_update_time(self, tp: int, dp: int, layers: int) -> float:
        """Seconds per step of the update of a stage of ``layers`` layers: each layer's
        (:meth:`update_time`) and what the stage's update takes whatever its layers (its
        launches, the norm's synchronisation; ZeRO-1's at DP > 1, measured profiles only)."""
        m = (self.chip.measured_ms or {}).get(tp, {})
        key = "zero1_stage_update" if dp > 1 and "zero1_stage_update" in m else "stage_update"
        return layers * self.update_time(tp, dp) + m.get(key, 0.0) * self._ms

    def end_times(self, tp: int) -> tuple[float, float, float, float]:
        """Seconds per micro-batch the pipeline's ends add: (embedding forward, embedding
        backward, head forward, head backward); measured profiles only, else zeros (the
        paper's cost model leaves them out)."""
        measured = (self.chip.measured_ms or {}).get(tp, {})
        return tuple(measured.get(k, 0.0) * self._ms for k in END_TIME_KEYS)

    def update_time(self, tp: int, dp: int) -> float:
        """Per-layer optimizer time: ZeRO-1 Adam step on 1/dp of the shard, plus the
        gradient reduce-scatter and parameter all-gather over DP (not overlapped). Measured:
        the profiled step (ZeRO-1's at DP > 1) and the runtime's fp32 collectives; analytic:
        the paper's bf16 ones."""
        params = self.model.params_per_layer / tp
        measured = self.chip.measured_ms
        if measured is not None and tp in measured and "update" in measured[tp]:
            m = measured[tp]
            # ZeRO-1 steps a 1/dp slice of the buffer
            step = m["zero1_update"] / dp if dp > 1 and "zero1_update" in m else m["update"]
            return step * self._ms + self._dp_sync_time(params, dp, FP32)
        step = params / dp * _ADAM_BYTES_PER_PARAM / self.chip.hbm_bandwidth
        return step + self._dp_sync_time(params, dp, BF16)

    def _dp_sync_time(self, params: float, dp: int, nbytes: int) -> float:
        """A ring reduce-scatter and all-gather (or all-reduce) of ``params`` gradients of
        ``nbytes`` each over DP: 2 (dp - 1) steps over the link between nodes, bounded by the
        chip's NIC; at the profile's time scale, as an emulated run's links are."""
        if dp == 1:
            return 0.0
        link = LinkSpec(self.chip.nic_bandwidth, 0.0) if self.dp_link is None else \
            self.dp_link.bounded(self.chip.nic_bandwidth)
        seconds = 2.0 * (dp - 1) * link.latency + 2.0 * (dp - 1) / dp * params * nbytes / link.bandwidth
        return seconds * (self.chip.emulated_time_scale or 1.0)


def _calibrate(chip: ChipSpec, model: ModelSpec) -> float:
    """Solve the sustained FLOP rate so that the 1F1B cost model (alpha = 1) predicts the
    measured homogeneous throughput of ``chip.calibration``."""
    c = chip.calibration
    n = c.pp * c.dp * c.tp
    if c.gbs_tokens % model.seq:
        raise ValueError(f"chip {chip.name!r} calibrate: gbs_tokens={c.gbs_tokens} is not a multiple of seq={model.seq}")
    b, rem = divmod(c.gbs_tokens // model.seq, c.dp)
    if rem:
        raise ValueError(f"chip {chip.name!r} calibrate: {c.gbs_tokens // model.seq} sequences do not split over dp={c.dp}")
    iteration = c.gbs_tokens / (n * c.tgs)
    k = math.ceil(model.n_layers / c.pp)
    probe = ChipProfile(dataclasses.replace(chip, calibration=None, effective_tflops=1.0), model)
    update = k * probe.update_time(c.tp, c.dp)
    per_layer = (iteration - update) / ((b + c.pp - 1) * k)
    comm = (4.0 + (2.0 if c.recompute else 0.0)) * probe.tp_allreduce_time(c.tp)
    matmul = per_layer - comm
    if matmul <= 0:
        raise ValueError(
            f"chip {chip.name!r} calibrate: the measured TGS {c.tgs} leaves no time for compute "
            f"(per-layer budget {per_layer * 1e3:.2f} ms <= TP communication {comm * 1e3:.2f} ms)"
        )
    passes = 4.0 if c.recompute else 3.0
    return passes * model.layer_forward_flops() / (c.tp * matmul)
