"""`make bench` saves a run of the micro-benchmarks and `make bench-compare` fails on a
regression: checked end to end on the cheapest benchmark, with the Makefile's own threshold,
against a run made deliberately slower (conftest's --slow-down-us) and an unchanged one."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = "benchmarks/micro/bench_device.py::test_add_one_element"


def _make(target: str, storage: Path, *bench_args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -o setup: the test run already set the environment up; do not reinstall mid-run.
    cmd = ["make", "-s", "-o", "setup", target, f"BENCH={BENCH}", f"BENCH_STORAGE={storage}",
           f"BENCH_REPORT={storage / 'report.md'}", "BENCH_DOCS=", f"BENCH_ARGS={' '.join(bench_args)}"]
    # Not an xdist worker's environment: pytest-benchmark disables itself when it sees one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def _peer_regressed(output: str) -> bool:
    """Whether a failed compare flags the CPU peer too: the machine ran slower, not the build."""
    return any(line.lstrip().startswith("test_add_one_element[cpu] (") and "has failed" in line
               for line in output.splitlines())


@pytest.mark.slow
def test_bench_saves_a_run_and_compare_fails_only_on_a_regression(tmp_path):
    saved = _make("bench", tmp_path)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    runs = list(tmp_path.glob("*/0001_*.json"))
    assert len(runs) == 1, f"expected one saved run under {tmp_path}, found {runs}"
    saved_run = {b["name"]: b for b in json.loads(runs[0].read_text())["benchmarks"]}
    assert set(saved_run) == {"test_add_one_element[cpu]", "test_add_one_element[dipu]"}
    # the report is made from the saved run: the dipu row's ratio is its median over the CPU peer's
    medians = {name: b["stats"]["median"] for name, b in saved_run.items()}
    ratio = medians["test_add_one_element[dipu]"] / medians["test_add_one_element[cpu]"]
    report = (tmp_path / "report.md").read_text()
    assert "| test_add_one_element[cpu] |" in report and "*peer*" in report
    assert f"| {ratio:.2f}x | <= 1.3x |" in report, report

    # 200 us before a call of ~1-3 us: a regression far beyond the threshold.
    slower = _make("bench-compare", tmp_path, "--slow-down-us=200")
    assert slower.returncode != 0, slower.stdout
    assert "Performance has regressed" in slower.stdout + slower.stderr
    assert "test_add_one_element[dipu]" in slower.stdout + slower.stderr

    # An unchanged build passes. The VM has slow phases that outlast a repeat: in CI runs the
    # CPU add's median was 1.5 us in the saved run and 2.8 us in both compares after it, and in a
    # suite run 1.36 us against 2.82 us through three baselines, the other xdist worker's tests
    # loading the same two cores. So a compare in which the CPU peer "regressed" too (the machine
    # changed, not the build) takes the baseline again, in the same phase, and compares once
    # more, up to five baselines; one in which only dipu regressed fails at once.
    same = _make("bench-compare", tmp_path)
    baselines = 1
    while same.returncode != 0 and baselines < 5 and _peer_regressed(same.stdout + same.stderr):
        rebased = _make("bench", tmp_path)
        assert rebased.returncode == 0, rebased.stdout + rebased.stderr
        baselines += 1
        same = _make("bench-compare", tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "Comparing against benchmarks from" in same.stdout + same.stderr
    runs_saved = len(list(tmp_path.glob("*/*.json")))
    assert runs_saved == baselines, f"{runs_saved} saved runs for {baselines} baseline(s): a compare run must not save itself"


@pytest.mark.slow
def test_every_micro_benchmark_runs_once_and_checks_its_result():
    """Each benchmark called once (--benchmark-disable): its own checks of the result hold, and
    the helper rank mirrors the single call of a disabled benchmark."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "benchmarks/micro", "--benchmark-disable"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
