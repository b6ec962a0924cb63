"""Fixtures of the micro-benchmarks: the repository on sys.path and the helper rank."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The repository first: benchmarks/ holds programs (volunteer.py, comm.py) that would shadow the
# project's packages of the same name; it is searched only for what the packages do not have.
for path in (ROOT / "tests" / "heteropp", ROOT / "tests", ROOT / "benchmarks", ROOT):
    sys.path.insert(0, str(path))

from rank_pair import RankPair  # noqa: E402


@pytest.fixture(scope="session")
def ranks() -> RankPair:
    """Rank 0 (this process) and a helper rank 1 in a process of its own, joined by a gloo
    default group, with gloo and dicomm groups side by side."""
    pair = RankPair.start()
    try:
        yield pair
    finally:
        pair.close()


def pytest_addoption(parser) -> None:
    parser.addoption("--slow-down-us", type=float, default=0.0,
                     help="sleep this long before every timed call: makes each benchmark deliberately "
                          "slower, to test that `make bench-compare` fails on a regression")


@pytest.fixture
def benchmark(benchmark, request):
    """pytest-benchmark's fixture, slowed down by --slow-down-us when it is given."""
    delay_s = request.config.getoption("--slow-down-us") / 1e6
    if delay_s > 0:
        benchmark.__class__ = _slowed(type(benchmark), delay_s)
    return benchmark


def _slowed(fixture_class: type, delay_s: float) -> type:
    """A subclass of the fixture's class whose every timed call first sleeps `delay_s`."""

    def delayed(target):
        def call(*args, **kwargs):
            time.sleep(delay_s)
            return target(*args, **kwargs)
        return call

    class Slowed(fixture_class):
        def __call__(self, target, *args, **kwargs):
            return super().__call__(delayed(target), *args, **kwargs)

        def pedantic(self, target, *args, **kwargs):
            return super().pedantic(delayed(target), *args, **kwargs)

    return Slowed
