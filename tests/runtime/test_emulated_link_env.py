"""`ditorch.train` gives emulated chips the plan's links (heteropp/placement.py): each rank's
dicomm is told its place and the cluster's links at the run's time scale; a vendor whose chips
run at their own speed, or DITORCH_EMULATED_LINKS=0, keeps the host's links."""
from __future__ import annotations

import pytest

from ditorch import train
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
    _emulate_links(plan, 60)
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
    _emulate_links(make_plan([("X", 1, 2, False), ("Y", 1, 2, False)]), 60)
    assert not any(name in os.environ for name in LINK_VARIABLES)


def test_state_files_of_jobs_that_died_before_mapping_them_are_reaped(rank_env, tmp_path):
    # a live job's file has a name only until its ranks have all mapped it (ditorch.train
    # removes it then), which the start timeout bounds: older files are a dead start's
    import os
    import time

    rank_env.setattr(train, "LINK_STATE_DIR", tmp_path)
    rank_env.setenv("RANK", "0")
    uid = os.getuid()
    stale, fresh = tmp_path / f"ditorch-links-{uid}-10.0.0.1-1", tmp_path / f"ditorch-links-{uid}-10.0.0.1-2"
    other = tmp_path / "ditorch-links-other-user-10.0.0.1-1"  # not this user's: left alone
    for path in (stale, fresh, other):
        path.write_bytes(b"\0" * 64)
    old = time.time() - 120
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    state = _emulate_links(make_plan([("X", 1, 2, False), ("Y", 1, 2, False)]), 60)
    assert state == tmp_path / f"ditorch-links-{uid}-127.0.0.1-29999"
    assert not stale.exists() and fresh.exists() and other.exists()


def test_the_state_files_name_goes_once_every_rank_has_it(tmp_path):
    # one rank's group: after the group's barrier the name is removed, and a mapping made
    # before (as dicomm's) still reads and writes the same memory
    import mmap

    import torch.distributed as dist

    state = tmp_path / "ditorch-links-state"
    state.write_bytes(b"\0" * 4096)
    with open(state, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4096)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        train._release_link_state(state)
    finally:
        dist.destroy_process_group()
    assert not state.exists()
    mapped[:4] = b"link"
    assert mapped[:4] == b"link"
    mapped.close()
    train._release_link_state(None)  # no emulated links: nothing to release
