"""`ditorch plan` of a fleet named by catalog parts and counts: no profiling, the layer times from
each part's datasheet by the roofline of the traced layer (heteropp/roofline.py)."""
from __future__ import annotations

import pytest

from heteropp import Plan
from heteropp.cli import main
from heteropp.cluster import ClusterSpec
from heteropp.model_spec import ModelSpec
from heteropp.profile import ChipProfile
from heteropp_cases import CONFIGS

SMALL = CONFIGS / "llama-small.yaml"


def test_a_fleet_of_parts_is_planned_from_datasheets(tmp_path, capsys):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("name: mixed\nparts: {H100: 2, A100: 2}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(fleet), "--model", str(SMALL), "--gbs", "2K", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "H100" in text and "A100" in text and "estimated iteration" in text
    plan = Plan.from_json(out)
    assert plan.num_chips == 4
    chips = {c.name: c for c in plan.cluster.chips}
    assert chips["H100"].datasheet == "H100" and chips["H100"].source.startswith("datasheet: NVIDIA H100")
    assert chips["H100"].memory == pytest.approx(80 * 2**30) and chips["H100"].hbm_bandwidth == pytest.approx(3350e9)


def test_an_unknown_part_is_named():
    with pytest.raises(ValueError, match=r"datasheet 'H900' is not a known chip; known: .*H100"):
        ClusterSpec.from_dict({"chips": {"X": {"datasheet": "H900", "count": 1}},
                               "links": {"inter_node": {"bandwidth_gbps": 1}, "inter_cluster": {"bandwidth_gbps": 1}}})


def test_a_fleet_count_that_is_no_positive_integer_is_refused(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("parts: {H100: 0}\n")
    with pytest.raises(ValueError, match=r"parts\['H100'\] must be a positive number of chips, got 0"):
        ClusterSpec.from_yaml(fleet)


def _layer(chip: str, tp: int = 1):
    cluster = ClusterSpec.from_dict({"chips": {chip: {"datasheet": chip, "count": 2, "tp_max": 2}},
                                     "links": {"inter_node": {"bandwidth_gbps": 1}, "inter_cluster": {"bandwidth_gbps": 1}}})
    return ChipProfile(cluster.chips[0], ModelSpec.load(SMALL)).layer_times(tp)


def test_h2_chips_keep_their_relative_speeds_in_datasheet_layer_times():
    # every rate of A-D is the A100's times its relative speed: whole layers scale exactly
    a, c, d = _layer("A"), _layer("C"), _layer("D")
    assert c.fwd / a.fwd == pytest.approx(0.75 / 0.25, rel=1e-9)
    assert a.bwd / d.bwd == pytest.approx(1.75 / 0.75, rel=1e-9)


def test_a_faster_part_has_faster_layers():
    h100, a100, l40s = _layer("H100"), _layer("A100"), _layer("L40S")
    assert h100.fwd < a100.fwd < l40s.fwd  # HBM3 over HBM2e over GDDR6 (the small layer is memory- and launch-bound)
    assert _layer("H100", 2).fwd > 0


def test_datasheet_chips_do_not_mix_with_chips_measured_at_a_time_scale():
    measured = {"count": 1, "memory_gb": 1, "chips_per_node": 1, "intra_node_gbps": 1, "hbm_gbps": 1, "nic_gbps": 1,
                "layer_times_ms": {1: {"fwd": 1.0, "bwd": 2.0}}, "emulated_time_scale": 200.0}
    links = {"inter_node": {"bandwidth_gbps": 1}, "inter_cluster": {"bandwidth_gbps": 1}}
    with pytest.raises(ValueError, match=r"chips \['A'\] were measured on emulated chips run at time scale 200, "
                                         r"chips \['H100'\] are datasheets"):
        ClusterSpec.from_dict({"chips": {"A": measured, "H100": {"datasheet": "H100", "count": 1}}, "links": links})
    measured["emulated_time_scale"] = 1.0  # measured at the chip's own speed (a real device): they compare
    assert len(ClusterSpec.from_dict({"chips": {"A": measured, "H100": {"datasheet": "H100", "count": 1}},
                                      "links": links}).chips) == 2


# A meta-path finder that makes torch and every compiled module of the project unimportable, as
# on a machine that only plans; it records what was asked for so the test sees it was in the way.
_NO_TORCH = """
import sys
class Refuse:
    asked = []
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'torch' or name in ('ditorch_ext._C', 'dicomm._C'):
            Refuse.asked.append(name)
            raise ModuleNotFoundError(f'No module named {name!r} (refused by the test)', name=name)
        return None
sys.meta_path.insert(0, Refuse())
from ditorch.cli import main
code = main(sys.argv[1:])
assert 'torch' not in sys.modules and 'ditorch_ext._C' not in sys.modules, sorted(sys.modules)
print('refused:', sorted(set(Refuse.asked)))
sys.exit(code)
"""


def test_a_fleet_of_parts_plans_without_torch_or_the_compiled_layers(tmp_path):
    import json
    import os
    import subprocess
    import sys

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("name: mixed\nparts: {H100: 16, MI300X: 8}\n")
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DITORCH_")}
    env["PYTHONPATH"] = str(CONFIGS.parents[1])
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, "plan", "--cluster", str(fleet), "--model", str(SMALL),
                           "--gbs", "2K", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: ['torch']" in done.stdout  # `import ditorch` asked for torch and went on without it
    plan = json.loads(out.read_text())
    chips = plan["cluster"]["chips"]
    assert {n: c["count"] for n, c in chips.items()} == {"H100": 16, "MI300X": 8}
    assert chips["MI300X"]["source"].startswith("datasheet: AMD Instinct MI300X")
    assert sum(s["tp"] * s["dp"] for s in plan["stages"]) <= 24 and plan["stages"]


def test_without_torch_a_layer_is_priced_within_a_factor_of_two_of_its_trace():
    from diutil.datasheets.chips import resolve
    from heteropp.roofline import analytic_kernel_times, layer_kernel_times

    spec = ModelSpec.load(CONFIGS / "model-100b.yaml")  # matmul-bound: the roofline's compute rules
    for part in ("H100", "MI300X", "L40S"):
        sheet = resolve(part).datasheet
        for tp in (1, 4):
            traced, analytic = layer_kernel_times(spec, tp, sheet), analytic_kernel_times(spec, tp, sheet)
            assert 0.5 <= analytic.fwd / traced.fwd <= 1.0 and 0.5 <= analytic.bwd / traced.bwd <= 1.0, (part, tp)
