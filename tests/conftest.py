"""Shared helpers live in this folder (emulated_hosts.py, busy_load.py): make them importable
from every suite. With ``DITORCH_TEST_BUSY=N`` the session that drives the run (xdist's
controller, or the one process) runs N busy processes beside the suite, for its whole length."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from busy_load import busy_processes  # noqa: E402  (needs the path above)

pytest_plugins = ["cpu_time", "timeline"]  # --cpu-durations=N, --timeline=FILE (tests/cpu_time.py, tests/timeline.py)


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: its controller owns the load
        return
    config._busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_processes())]
    if config._busy:
        print(f"conftest: {len(config._busy)} busy processes run beside the suite", file=sys.stderr)


def pytest_unconfigure(config):
    for p in getattr(config, "_busy", []):
        p.kill()
        p.wait()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first. On several workers the suite's length is the longest worker's:
    a long test that starts last (Inductor's compile of the pipeline, the OpInfo sweep, the
    volunteer demo) leaves the other workers idle at the end, one that starts first overlaps the
    many short tests (the longest-job-first rule for scheduling on parallel machines). A test is
    marked slow where the suite's timeline (``--timeline``, tests/timeline.py) shows it over about
    15 s. The order is stable otherwise. ``make test`` passes ``--no-loadscope-reorder``: without
    it xdist's ``loadgroup`` hands out the groups with the most tests first, whatever this order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
