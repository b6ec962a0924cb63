"""CPU seconds per test, for the suite's budget: ``--cpu-durations=N`` lists the N tests that
used the most CPU (the test's process, every child it waited for: torchrun, servers, and the
ranks forked for it by multiprocessing's fork server, which that server waits for).
Wall time (``--durations``) on 2 shared cores says more about what ran beside a test than about
the test; CPU time is what a test costs the whole suite. Module- and session-scoped fixtures are
charged to the first test that uses them."""
from __future__ import annotations

import os
import resource

import pytest

import forked_ranks

KEY = "cpu_s"


def _cpu_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        use = resource.getrusage(who)
        total += use.ru_utime + use.ru_stime
    return total + _fork_server_seconds()


def _fork_server_seconds() -> float:
    """The fork server's CPU and that of the ranks it has reaped (tests/forked_ranks.py): its
    children are not this process's. 0 before it starts; once it ran, counted until it ends."""
    pid = forked_ranks.server_pid()
    if pid is None:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime, stime, cutime, cstime: fields 14-17 of proc(5), 11-14 after the name
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="list the N tests that used the most CPU time (self and waited-for children)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._cpu_start = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and hasattr(item, "_cpu_start"):
        report.user_properties.append((KEY, _cpu_seconds() - item._cpu_start))


class CpuReport:
    """Collects the teardown reports' CPU seconds (from xdist's workers too) and prints the top N."""

    def __init__(self, count: int):
        self.count, self.seconds = count, {}

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == KEY:
                self.seconds[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter):
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        tr = terminalreporter
        tr.write_sep("=", f"{min(self.count, len(ranked))} largest CPU times "
                          f"(all {len(ranked)} tests: {sum(self.seconds.values()):.0f} s)")
        for nodeid, seconds in ranked[:self.count]:
            tr.write_line(f"{seconds:8.1f}s cpu  {nodeid[:160]}")


def pytest_configure(config):
    count = config.getoption("--cpu-durations")
    if count and not hasattr(config, "workerinput"):
        config.pluginmanager.register(CpuReport(count), "cpu_time_report")
