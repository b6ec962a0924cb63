import json

import pytest

from heteropp import Plan, PlanError
from heteropp.cli import main

from heteropp_cases import CONFIGS

ARGS = ["plan", "--cluster", str(CONFIGS / "cluster-exp-a-1.yaml"), "--model", str(CONFIGS / "model-100b.yaml"),
        "--gbs", "2M"]


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(ARGS + ["--out", str(out)]) == 0
    return out


def test_plan_prints_a_table_and_writes_valid_json(plan_path, capsys):
    assert main(ARGS) == 0
    text = capsys.readouterr().out
    assert "stage chip" in text and "memory GB" in text and "estimated iteration" in text
    plan = Plan.from_json(plan_path)
    assert plan.num_chips == 768 and sum(s.layers for s in plan.stages) == 96
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "fine-grained", "comm-aware"])
def test_simulate_every_schedule_writes_a_png(plan_path, tmp_path, capsys, schedule):
    png = tmp_path / "t.png"
    assert main(["simulate", str(plan_path), "--schedule", schedule, "--timeline", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "iteration" in capsys.readouterr().out


def _tampered(plan_path, tmp_path, edit):
    d = json.loads(plan_path.read_text())
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["stages"][0].update(chip="Q"), "unknown chip type 'Q'"),
    (lambda d: d["stages"][0].update(tp=16, rank_range=[0, 16 * d["dp"]]), "tp=16 not allowed"),
    (lambda d: d.update(format="other"), "format must be"),
    (lambda d: d["stages"][0].update(layers=d["stages"][0]["layers"] + 1), "layer_range"),
    (lambda d: d.update(global_batch_tokens=4096 * 511), "not divisible by dp"),
    (lambda d: d["cluster"]["chips"]["A"].update(memory_gb=1), "usable memory"),
])
def test_bad_plans_are_rejected_with_a_clear_error(plan_path, tmp_path, capsys, edit, message):
    bad = _tampered(plan_path, tmp_path, edit)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(bad)
    assert main(["simulate", str(bad)]) == 1
    assert message.split("'")[0] in capsys.readouterr().err


def test_plan_errors_exit_nonzero(tmp_path, capsys):
    assert main(ARGS[:-1] + ["2M+1"]) == 1
    assert "token count" in capsys.readouterr().err
    small = tmp_path / "cluster.yaml"
    small.write_text((CONFIGS / "cluster-exp-a-1.yaml").read_text().replace(
        "chip_library: chips-h2.yaml", f"chip_library: {CONFIGS / 'chips-h2.yaml'}"))
    assert main(["plan", "--cluster", str(small), "--model", str(CONFIGS / "model-100b.yaml"), "--gbs", "2M"]) == 0
    bad_model = tmp_path / "m.yaml"
    bad_model.write_text("dim: 8192\nn_layers: 0\n")
    assert main(["plan", "--cluster", str(small), "--model", str(bad_model), "--gbs", "2M"]) == 1
    assert "missing key" in capsys.readouterr().err


def test_calibration_reproduces_table6():
    # each chip's Table 6 configuration, simulated, gives back the measured throughput
    from benchmark_modules import load
    from heteropp import ClusterSpec, ModelSpec

    bench = load("plan_search")

    model = ModelSpec.from_yaml(CONFIGS / "model-100b.yaml")
    lib = ClusterSpec.from_yaml(CONFIGS / "cluster-exp-b-1.yaml")
    for chip, tgs in bench.TABLE6_TGS.items():
        assert bench.homogeneous_tgs(model, lib, chip) == pytest.approx(tgs, rel=0.02)
