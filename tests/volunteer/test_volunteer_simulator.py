"""The simulator against timelines computed by hand."""
from __future__ import annotations

import pytest

from volunteer.simulator import Participant, Scenario, batch_time, mean_batch_time


def two_stages() -> Scenario:
    # 3 s per row for forward + backward: forward 1 s, backward 2 s; free links, instant notice
    return Scenario((Participant("a0", 0, 3.0, 0, 0), Participant("b0", 0, 3.0, 0, 0, unreliable=True),
                     Participant("a1", 1, 3.0, 0, 0)), (0.0,), microbatches=1, microbatch_rows=2, detect=0.0)


def test_a_clean_batch():
    # stage 0: a0 and b0 forward a row each [0, 1]; stage 1: a1 forward+backward of both [1, 7];
    # stage 0: a0 and b0 backward a row each [7, 9]
    for system in ("pool", "swarm", "sync"):
        assert batch_time(two_stages(), system, {}) == pytest.approx(9.0), system


def test_a_device_leaving_in_its_backward():
    sc = two_stages()
    # pool: b0's backward becomes a recompute + backward (3 s) that a0 takes when free at 9
    assert batch_time(sc, "pool", {"b0": 8.0}) == pytest.approx(12.0)
    # swarm: b0's row starts over: a0 forward [9, 10], a1 [10, 13], a0 backward [13, 15]
    assert batch_time(sc, "swarm", {"b0": 8.0}) == pytest.approx(15.0)
    # sync: the batch restarts at 8 without b0: a0 forward of 2 rows [8, 10], a1 [10, 16], a0 backward [16, 20]
    assert batch_time(sc, "sync", {"b0": 8.0}) == pytest.approx(20.0)


def test_links_and_notice_time():
    sc = Scenario((Participant("a", 0, 1.0, 0.25, 0.5), Participant("b", 0, 1.0, 0.25, 0.5, unreliable=True)),
                  (), microbatches=1, microbatch_rows=2, detect=0.5)
    # one row each: 1 s compute + 0.25 s delay + 0.5 s moving the row
    assert batch_time(sc, "pool", {}) == pytest.approx(1.75)
    # b leaves at 1; noticed at 1.5 its row returns to the pool and a (free at 1.75) does it again
    assert batch_time(sc, "pool", {"b": 1.0}) == pytest.approx(3.5)


def test_more_departures_never_make_a_batch_faster():
    sc = two_stages()
    times = [mean_batch_time(sc, "pool", p, batches=30, seed=1) for p in (0.0, 0.5, 1.0)]
    assert times[0] == pytest.approx(9.0) and times[0] <= times[1] <= times[2]
