"""tests/timeline.py on two xdist workers: one line per test with its worker, start, end, wall and
CPU time, a waiting test's wall time above its CPU time and a computing test's CPU time near its
wall time, and each worker's summary."""
from __future__ import annotations

import json
import os
from pathlib import Path

pytest_plugins = ["pytester"]

INNER = '''
import time

def test_waits():
    time.sleep(0.5)

def test_computes():
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass

def test_quick():
    pass
'''


def test_each_test_has_its_worker_times_and_cpu(pytester, monkeypatch):
    here = str(Path(__file__).resolve().parent)  # the plugins' folder (tests/conftest.py puts it on sys.path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_inner=INNER)
    out = pytester.path / "timeline.jsonl"
    result = pytester.runpytest_subprocess("-p", "cpu_time", "-p", "timeline", "-n", "2", "-p", "no:cacheprovider",
                                           f"--timeline={out}")
    result.assert_outcomes(passed=3)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tests = {t["test"].split("::")[1]: t for t in lines}
    assert sorted(tests) == ["test_computes", "test_quick", "test_waits"] and len(lines) == 3
    for t in lines:
        assert t["worker"] in ("gw0", "gw1") and 0 <= t["start"] <= t["end"]
        assert t["wall"] == t["end"] - t["start"]
    assert tests["test_waits"]["wall"] >= 0.5 and tests["test_waits"]["cpu"] < 0.25
    assert tests["test_computes"]["cpu"] >= 0.3 and tests["test_computes"]["wall"] >= 0.3
    assert [t["start"] for t in lines] == sorted(t["start"] for t in lines)
    result.stdout.fnmatch_lines(["*timeline of 3 tests on 2 workers*", "gw0: * tests, busy * s, cpu * s, last ends at *",
                                 "*tail with a worker idle: * s"])
