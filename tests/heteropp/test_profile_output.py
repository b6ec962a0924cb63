"""`ditorch profile` writes only what the planner accepts, and the demo measures again when the
profile it cached is not usable. The measurement itself is replaced by fixed numbers here (the
real one spawns ranks and runs for seconds: the demo runs it)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import yaml

from heteropp.cluster import ChipSpec
from heteropp.runtime import profiler

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "configs" / "llama-small.yaml"


def _measured(activation_bytes: float) -> dict:
    ms = {"fwd": 10.0, "bwd": 20.0, "recompute": 10.0, "update": 5.0, "activation_bytes": activation_bytes,
          "p2p_bytes_per_s": None}
    return {**{key: 1.0 for key in profiler.MEASURED_TIME_KEYS}, **ms}


def _profile(monkeypatch, tmp_path, activation_bytes: float, time_scale: str = "1",
             run_time_scale: str | None = None) -> tuple[int, Path]:
    monkeypatch.setattr(profiler, "profile_tp", lambda *a, **k: _measured(activation_bytes))
    out = tmp_path / "chip-B.yaml"
    args = argparse.Namespace(chip="B", model=str(MODEL), seq=None, tp="1", precision="bf16", memory_scale=0.001,
                              time_scale=time_scale, run_time_scale=run_time_scale, ranks=None, repeats=1,
                              sequence_parallel=True, out=str(out))
    return profiler.profile_command(args), out


def test_a_valid_measurement_is_written_and_loads(monkeypatch, tmp_path):
    rc, out = _profile(monkeypatch, tmp_path, 5 * 2**20)
    assert rc == 0
    spec = ChipSpec.from_dict("B", yaml.safe_load(out.read_text())["chips"]["B"])
    assert spec is not None


def test_a_profile_measured_at_one_time_scale_is_written_for_runs_at_another(monkeypatch, tmp_path, capsys):
    rc, out = _profile(monkeypatch, tmp_path, 5 * 2**20, time_scale="40", run_time_scale="80")
    assert rc == 0
    spec = ChipSpec.from_dict("B", yaml.safe_load(out.read_text())["chips"]["B"])
    assert spec.emulated_time_scale == 80.0 and "at time scale 40;" in spec.source
    rc, bad = _profile(monkeypatch, tmp_path / "bad", 5 * 2**20, time_scale="40", run_time_scale="0.5")
    assert rc == 2 and not bad.exists()
    assert "--run-time-scale='0.5' is invalid" in capsys.readouterr().err


def test_a_measurement_the_planner_refuses_is_not_written(monkeypatch, tmp_path, capsys):
    rc, out = _profile(monkeypatch, tmp_path, -1.6 * 2**20)
    assert rc == 1 and not out.exists()
    assert "activation_mb[1] must be a number >= 0" in capsys.readouterr().err


def test_the_demo_measures_again_when_its_cached_profile_is_unusable(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hetero_demo
    finally:
        sys.path.remove(str(ROOT / "examples"))
    _, good = _profile(monkeypatch, tmp_path, 5 * 2**20)  # at time scale 1 ($DITORCH_TIME_SCALE unset)
    assert hetero_demo.usable_profile(good, "B", 1.0)
    assert not hetero_demo.usable_profile(good, "B", 2.0)  # taken at another time scale
    bad = tmp_path / "bad.yaml"
    desc = yaml.safe_load(good.read_text())
    desc["chips"]["B"]["activation_mb"] = {1: -1.6}
    bad.write_text(yaml.safe_dump(desc))
    assert not hetero_demo.usable_profile(bad, "B", 1.0)
    assert not hetero_demo.usable_profile(tmp_path / "missing.yaml", "B", 1.0)
    for version in (None, 1):  # measured by an older profiler: its times mean something else
        old = tmp_path / f"old-{version}.yaml"
        desc = yaml.safe_load(good.read_text())
        if version is None:
            del desc["chips"]["B"]["profiler_version"]
        else:
            desc["chips"]["B"]["profiler_version"] = version
        old.write_text(yaml.safe_dump(desc))
        assert not hetero_demo.usable_profile(old, "B", 1.0), version


def test_a_profiler_version_that_is_no_positive_integer_is_refused():
    desc = {"count": 1, "memory_gb": 1, "chips_per_node": 1, "intra_node_gbps": 1, "hbm_gbps": 1, "nic_gbps": 1,
            "effective_tflops": 100}
    assert ChipSpec.from_dict("B", {**desc, "profiler_version": 3}).profiler_version == 3
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match=f"profiler_version must be a positive integer, got {bad!r}"):
            ChipSpec.from_dict("B", {**desc, "profiler_version": bad})


def test_a_profile_states_the_chips_datasheet_links_not_the_hosts_loopback(monkeypatch, tmp_path):
    measured = {**_measured(5 * 2**20), "p2p_bytes_per_s": 7.5e9}  # what a loopback ping measured
    monkeypatch.setattr(profiler, "profile_tp", lambda *a, **k: measured)
    out = tmp_path / "chip-H100.yaml"
    args = argparse.Namespace(chip="H100", model=str(MODEL), seq=None, tp="1", precision="bf16", memory_scale=0.001,
                              time_scale="1", ranks=None, repeats=1, sequence_parallel=True, out=str(out))
    assert profiler.profile_command(args) == 0
    chip = yaml.safe_load(out.read_text())["chips"]["H100"]
    # NVIDIA's H100 SXM5: NVLink 900 GB/s both ways, 8x 400 Gb/s NICs for 8 GPUs; HBM3 3.35 TB/s
    assert (chip["intra_node_gbps"], chip["nic_gbps"], chip["hbm_gbps"]) == (450, 50, 3350)
