"""`ditorch.train` gives emulated chips the plan's links (heteropp/placement.py): each rank's
dicomm is told its place and the cluster's links at the run's time scale; a vendor whose chips
run at their own speed, or DITORCH_EMULATED_LINKS=0, keeps the host's links."""
from __future__ import annotations

import pytest

from ditorch.train import _emulate_links
from plans import make_plan

LINK_VARIABLES = ("DICOMM_LINKS", "DICOMM_LINK_PLACE", "DICOMM_LINK_STATE", "DITORCH_TIME_SCALE")


@pytest.fixture
def rank_env(monkeypatch):
    for name in (*LINK_VARIABLES, "DITORCH_VENDOR", "DITORCH_EMULATED_LINKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    return monkeypatch


def test_each_rank_of_an_emulated_run_is_placed_on_the_plans_links(rank_env):
    import os

    plan = make_plan([("X", 2, 2, False), ("Y", 1, 2, False)], dp=2)  # ranks: X tp2 x dp2, then Y dp2
    rank_env.setenv("RANK", "5")  # Y's second replica
    _emulate_links(plan)
    # tests/runtime/plans.py: every chip's NIC 1 GB/s, both links 1 GB/s with no latency, time scale 1
    assert os.environ["DICOMM_LINK_PLACE"] == "Y/s1r1/1.0"
    assert os.environ["DICOMM_LINKS"] == "inter_cluster=1.0:0.0,inter_node=1.0:0.0"
    assert os.environ["DITORCH_TIME_SCALE"] == "1.0"
    assert os.environ["DICOMM_LINK_STATE"].endswith("-127.0.0.1-29999")


@pytest.mark.parametrize("setting", [{"DITORCH_VENDOR": "cuda"}, {"DITORCH_EMULATED_LINKS": "0"}])
def test_real_chips_and_an_opt_out_keep_the_hosts_links(rank_env, setting):
    import os

    rank_env.setenv("RANK", "0")
    for name, value in setting.items():
        rank_env.setenv(name, value)
    _emulate_links(make_plan([("X", 1, 2, False), ("Y", 1, 2, False)]))
    assert not any(name in os.environ for name in LINK_VARIABLES)
