"""benchmarks/program_results.py: a program's runs saved in pytest-benchmark's form (read back
by pytest-benchmark's own `compare`), and gated against the previous run with the same check
expression `make bench-compare` uses."""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from benchmark_modules import load

program_results = load("program_results")
Measurement = program_results.Measurement


@pytest.fixture
def storage(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DITORCH_BENCH_STORAGE", str(tmp_path))
    return tmp_path


def _run(scale: float, seed: int = 0) -> list[Measurement]:
    rng = random.Random(seed)
    base = [rng.uniform(0.5, 2.0) for _ in range(7)]
    return [Measurement("toy: seconds per step", "contender", [scale * x for x in base], {"note": "c"}),
            Measurement("toy: seconds per step", "peer", [2 * x for x in base])]


def test_saved_stats_are_the_samples_statistics(storage):
    path = program_results.save_run("toy", _run(1.0))
    assert path.name == "0001_toy.json" and path.parent.parent.name == "programs"
    data = json.loads(path.read_text())
    samples = _run(1.0)[0].samples
    stats = data["benchmarks"][0]["stats"]
    assert stats["min"] == min(samples) and stats["max"] == max(samples)
    assert stats["median"] == pytest.approx(statistics.median(samples))
    assert stats["mean"] == pytest.approx(statistics.fmean(samples))
    assert stats["stddev"] == pytest.approx(statistics.stdev(samples))
    assert stats["rounds"] == len(samples)
    assert data["benchmarks"][0]["extra_info"] == {"note": "c"}
    assert program_results.save_run("toy", _run(1.0)).name == "0002_toy.json"


def test_compare_fails_only_on_a_regression_beyond_the_threshold(storage, capsys):
    program_results.save_run("toy", _run(1.0))
    assert program_results.compare("min:25%") == 0  # one run: nothing to compare
    program_results.save_run("toy", _run(1.2))  # 20% slower: within 25%
    assert program_results.compare("min:25%") == 0
    program_results.save_run("toy", _run(1.2 * 1.3))  # 30% slower than the previous run
    capsys.readouterr()
    assert program_results.compare("min:25%") == 1
    out = capsys.readouterr().out
    assert "Performance has regressed" in out and "contender" in out.split("Performance has regressed")[1]
    assert "peer" not in out.split("Performance has regressed")[1]


def test_negative_or_missing_samples_are_refused(storage):
    with pytest.raises(ValueError, match="non-negative seconds"):
        program_results.save_run("toy", [Measurement("g", "n", [])])
    with pytest.raises(ValueError, match="non-negative seconds"):
        program_results.save_run("toy", [Measurement("g", "n", [1.0, float("nan")])])


def test_pytest_benchmark_reads_the_saved_runs(storage):
    program_results.save_run("toy", _run(1.0))
    program_results.save_run("toy", _run(1.5))
    cli = Path(sys.executable).with_name("pytest-benchmark")
    if not cli.exists():
        pytest.skip(f"pytest-benchmark's command is not beside {sys.executable}")
    run = subprocess.run([str(cli), "--storage", str(storage / "programs"), "compare", "--group-by", "group"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "benchmark 'toy: seconds per step': 4 tests" in run.stdout, run.stdout
