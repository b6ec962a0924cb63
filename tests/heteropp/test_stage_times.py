"""A profile's times add up to a whole stage's: a stage of any number of layers costs its layers'
times plus what it does once (its position tables, its update's fixed part), and the pipeline's
ends. The reference is the emulated device's own timeline running the whole stage, not the
profiler's arithmetic; the datasheet planner is checked the same way against its own pricing of
the whole stage."""
from __future__ import annotations

import math

import pytest
import torch

import ditorch
from ditorch_ext.chip import emulation_stats
from ditorch_ext.profiles import resolve
from heteropp.cluster import ChipSpec, ClusterSpec, LinkSpec
from heteropp.cost_model import stage_costs
from heteropp.model_spec import ModelSpec
from heteropp.profile import ChipProfile
from heteropp.roofline import _Pricing, _shape_only_group, layer_kernel_times
from heteropp.runtime.flat_parameters import FlatParameters
from heteropp.runtime.model_family import model_family
from heteropp.runtime.profiler import chip_description, host_ratio, profile_tp
from heteropp.runtime.stage_update import clip_coefficient, make_optimizer, squared_norm, step_flat
from heteropp_cases import CONFIGS

SPEC = ModelSpec.load(CONFIGS / "llama-tiny.yaml", seq=128)
LINK = LinkSpec(bandwidth=1e9, latency=50e-6)


@pytest.fixture(autouse=True)
def _host_again():
    yield
    ditorch.set_chip("host", time_scale=1)


def _device_seconds(fn, runs: int = 3) -> float:
    """The emulated device's time per run of ``fn``, after a warm-up run."""
    fn()
    torch.dipu.synchronize()
    emulation_stats(reset=True)
    for _ in range(runs):
        fn()
    torch.dipu.synchronize()
    return emulation_stats().device_busy_s / runs


def _whole_stage_seconds(chip: str, time_scale: float) -> tuple[float, float]:
    """Device seconds of one micro-batch's forward and backward through the whole model as one
    stage (embedding, every layer, head and loss), and of the update of a stage of every layer
    (the embedding's and the head's update are not in a profile)."""
    ditorch.set_chip(chip, memory_scale=0.01, time_scale=time_scale)
    device = torch.device("dipu", 0)
    torch.manual_seed(0)
    with torch.device(device):
        stage = model_family(SPEC).stage((0, SPEC.n_layers), True, True, _shape_only_group(1))
        layers = model_family(SPEC).stage((0, SPEC.n_layers), False, False, _shape_only_group(1))
    tokens = torch.randint(0, SPEC.vocab, (1, SPEC.seq), device=device)
    autocast = torch.autocast("dipu", dtype=torch.bfloat16)

    def micro_batch():
        with autocast:
            loss = stage(tokens, tokens)
        loss.backward()

    flat = FlatParameters(list(layers.parameters()))
    optimizer = make_optimizer(layers.parameters(), lr=1e-4, weight_decay=0.1)

    def update():
        sumsq = squared_norm([p.grad for p in layers.parameters()], device)
        step_flat(flat, optimizer, clip_coefficient(math.sqrt(sumsq.item()), 1.0))

    return _device_seconds(micro_batch), _device_seconds(update)


@pytest.mark.slow
@pytest.mark.parametrize("run_factor", [1, 2])
def test_a_measured_profile_adds_up_to_the_whole_stage_on_the_emulated_device(run_factor):
    """Measured at one time scale and run at ``run_factor`` times it (`ditorch profile
    --run-time-scale`): a profile's times are the chip's own, so the planner's stage at the run's
    scale is the whole stage measured there."""
    scale = 6 * host_ratio("A", SPEC)  # the host keeps up: the samples are the chip's
    measured = profile_tp("A", SPEC, 1, memory_scale=0.01, repeats=3, time_scale=scale)
    chip = ChipSpec.from_dict("A", chip_description("A", {1: measured}, 0.01, time_scale=run_factor * scale,
                                                    measured_time_scale=scale))
    assert f"at time scale {scale:g};" in chip.source
    cluster = ClusterSpec(chips=(chip,), inter_node=LINK, inter_cluster=LINK)
    profile = ChipProfile(chip, SPEC)
    [cost] = stage_costs(SPEC, cluster, {"A": profile}, [("A", 1, 1, SPEC.n_layers, False)])
    micro_batch, update = _whole_stage_seconds("A", run_factor * scale)
    assert cost.compute == pytest.approx(micro_batch, rel=0.03)
    assert profile.stage_update_time(1, 1, SPEC.n_layers) == pytest.approx(update, rel=0.03)


@pytest.mark.parametrize("layers", [1, 3, 4])
def test_datasheet_layer_times_add_up_to_the_priced_stage(layers):
    """The planner's datasheet times for a stage of ``layers`` layers (its layers' plus what the
    stage does once) equal the roofline pricing of that whole stage's forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sheet = resolve("A").datasheet
    k = layer_kernel_times(SPEC, 1, sheet)
    pricing = _Pricing(sheet)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.device("dipu"):
        stage = model_family(SPEC).stage((0, layers), False, False, _shape_only_group(1), sequence_parallel=True)
        x = torch.empty(1, SPEC.seq, SPEC.hidden, requires_grad=True)
        with pricing.mode, torch.autocast("dipu", dtype=torch.bfloat16):
            stage(x)
    whole, _ = pricing.take()
    assert layers * k.fwd + k.stage_fwd == pytest.approx(whole, rel=1e-6)
    assert k.stage_fwd > 0  # the position tables are the stage's, not a layer's


@pytest.mark.slow
def test_a_tp2_profile_measures_its_link_and_loads():
    """At TP 2 the profile also times one activation between the ranks (no kernels: a plain
    synchronisation bounds it) and the planner accepts what it wrote."""
    measured = profile_tp("A", SPEC, 2, memory_scale=0.01, repeats=2, time_scale=2 * host_ratio("A", SPEC))
    assert measured["p2p_bytes_per_s"] > 0
    chip = ChipSpec.from_dict("A", chip_description("A", {2: measured}, 0.01))
    assert chip.measured_ms[2]["stage_fwd"] > 0


@pytest.mark.slow
def test_a_chip_too_small_for_two_layers_update_is_profiled_with_the_update_whole():
    """The split of an update into a layer's part and the stage's needs a two-layer stage's
    optimizer state; a chip that holds one layer's but not that is still profiled, its
    one-layer update charged to the layer whole: the same one-layer stage either way."""
    scale = 2 * host_ratio("A", SPEC)
    roomy = profile_tp("A", SPEC, 1, memory_scale=3e-4, repeats=1, time_scale=scale)
    tight = profile_tp("A", SPEC, 1, memory_scale=1e-4, repeats=1, time_scale=scale)  # ZeRO-1's pair does not fit
    assert roomy["zero1_stage_update"] > 0 and tight["zero1_stage_update"] == 0
    assert tight["zero1_update"] == pytest.approx(roomy["zero1_update"] + roomy["zero1_stage_update"], rel=0.02)
    assert tight["update"] == pytest.approx(roomy["update"], rel=0.02)  # the replicated pair fits both
