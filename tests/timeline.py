"""Where the suite's wall time goes: ``--timeline=FILE`` writes one JSON line per test (its
worker, start and end in seconds from the run's start, wall and CPU seconds: tests/cpu_time.py)
and prints each worker's busy time and the run's tail, the seconds at its end in which fewer
workers than started had a test to run. A test whose wall time is far above its CPU time spends
it waiting (rank start-up, sockets, timeouts); a long tail is a long test that started late."""
from __future__ import annotations

import json
import os
import time

import pytest

from cpu_time import KEY as CPU_KEY

KEY = "timeline"


def pytest_addoption(parser):
    parser.addoption("--timeline", default=None, metavar="FILE",
                     help="write each test's worker, start, end, wall and CPU seconds to FILE (JSON lines)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._timeline_start = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and hasattr(item, "_timeline_start"):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        report.user_properties.append((KEY, (worker, item._timeline_start, time.time())))


class Timeline:
    """Collects the teardown reports' start and end times (from xdist's workers too), writes them
    and prints the per-worker summary."""

    def __init__(self, path: str):
        self.path, self.tests, self.begin = path, [], time.time()

    def pytest_runtest_logreport(self, report):
        props = dict(report.user_properties)
        if KEY in props:
            worker, start, end = props[KEY]
            self.tests.append({"test": report.nodeid, "worker": worker, "start": start - self.begin,
                               "end": end - self.begin, "wall": end - start, "cpu": props.get(CPU_KEY)})

    def pytest_terminal_summary(self, terminalreporter):
        if not self.tests:
            return
        self.tests.sort(key=lambda t: t["start"])
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            for t in self.tests:
                f.write(json.dumps(t) + "\n")
        tr = terminalreporter
        workers = sorted({t["worker"] for t in self.tests})
        first = min(t["start"] for t in self.tests)
        last = max(t["end"] for t in self.tests)
        tr.write_sep("=", f"timeline of {len(self.tests)} tests on {len(workers)} workers ({self.path})")
        ends = []
        for w in workers:
            mine = [t for t in self.tests if t["worker"] == w]
            busy = sum(t["wall"] for t in mine)
            cpu = sum(t["cpu"] or 0.0 for t in mine)
            end = max(t["end"] for t in mine)
            ends.append(end)
            longest = max(mine, key=lambda t: t["wall"])
            tr.write_line(f"{w}: {len(mine)} tests, busy {busy:.0f} s, cpu {cpu:.0f} s, last ends at {end:.0f} s; "
                          f"its longest {longest['wall']:.0f} s from {longest['start']:.0f} s: {longest['test'][:100]}")
        tr.write_line(f"tests ran from {first:.0f} s to {last:.0f} s; tail with a worker idle: "
                      f"{last - min(ends):.0f} s")
        waiting = sorted(self.tests, key=lambda t: -(t["wall"] - (t["cpu"] or 0.0)))[:10]
        tr.write_line("most wall time beyond CPU time (waiting or sharing the cores):")
        for t in waiting:
            tr.write_line(f"{t['wall']:7.1f}s wall {t['cpu'] or 0:6.1f}s cpu from {t['start']:5.0f}s  {t['test'][:140]}")


def pytest_configure(config):
    path = config.getoption("--timeline")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Timeline(path), "timeline_report")
