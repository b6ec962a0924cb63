"""The contract torchft's Manager relies on, checked on ``ProcessGroupDicommFT`` directly: a
group per ``configure`` (a new store prefix each time, in the same process), ``abort`` failing
every pending op within a second, ``errored`` naming the failure on the peers, no state shared
between a process's old and new group, and cpu and dipu tensors alike. Ranks are threads of this
process (as in torchft's own process-group tests); the sums are computed by hand."""
from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions

import ditorch  # noqa: F401  (the dipu device, then the dicomm backend)
from dicomm.torchft_group import ProcessGroupDicommFT

WORLD = 3


@pytest.fixture
def ranks():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupDicommFT(timeout=datetime.timedelta(seconds=30)) for _ in range(WORLD)]
    with ThreadPoolExecutor(WORLD) as pool:
        def configure(prefix: str, members=range(WORLD)) -> None:
            members = list(members)
            list(pool.map(lambda i: pgs[members[i]].configure(f"127.0.0.1:{store.port}/{prefix}", str(members[i]),
                                                               i, len(members)), range(len(members))))

        yield pgs, pool, configure
        for pg in pgs:
            pg.abort(errored=False)


def allreduce(pg, value: float, device: str) -> torch.Tensor:
    t = torch.full((5,), value, device=device)
    pg.allreduce([t], AllreduceOptions()).wait()
    return t.cpu()


@pytest.mark.parametrize("device", ["cpu", "dipu"])
def test_each_quorum_is_a_new_group_of_its_members(ranks, device):
    pgs, pool, configure = ranks
    configure("quorum/1")
    sums = list(pool.map(lambda r: allreduce(pgs[r], r + 1.0, device), range(WORLD)))
    assert all(torch.equal(s, torch.full((5,), 6.0)) for s in sums)
    # The next quorum drops rank 1: ranks 0 and 2 become 0 and 1 of a group of two.
    configure("quorum/2", members=[0, 2])
    assert pgs[0].size() == 2 and pgs[2].size() == 2
    sums = list(pool.map(lambda r: allreduce(pgs[r], r + 1.0, device), [0, 2]))
    assert all(torch.equal(s, torch.full((5,), 4.0)) for s in sums)
    assert pgs[0].errored() is None and pgs[2].errored() is None


def test_abort_fails_pending_ops_within_a_second_and_the_peer_learns_why(ranks):
    pgs, pool, configure = ranks
    configure("quorum/1")
    # Rank 0 waits for a receive and a broadcast that nobody will ever serve.
    recv = pgs[0].recv([torch.zeros(3)], 1, 0)
    opts = BroadcastOptions()
    opts.rootRank = 1
    bcast = pgs[0].broadcast([torch.zeros(3)], opts)
    timer = threading.Timer(0.2, pgs[0].abort)
    start = time.monotonic()
    timer.start()
    for work in (recv, bcast):
        with pytest.raises(RuntimeError, match="abort"):
            work.wait()
    assert time.monotonic() - start < 1.2
    # The peers' groups were aborted by the notice: errored() says so, naming rank 0.
    deadline = time.monotonic() + 5
    while pgs[1].errored() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "rank 0 aborted" in str(pgs[1].errored())
    assert pgs[0].errored() is None  # its own aborted group is gone: nothing left to report


def test_the_new_group_does_not_inherit_the_old_ones_failure(ranks):
    pgs, pool, configure = ranks
    configure("quorum/1")
    old = [pg.parent for pg in pgs]
    pgs[2].abort()  # as the Manager does after an error, before the next quorum
    configure("quorum/2")
    assert all(pg.errored() is None for pg in pgs)
    sums = list(pool.map(lambda r: allreduce(pgs[r], 1.0, "cpu"), range(WORLD)))
    assert all(torch.equal(s, torch.full((5,), 3.0)) for s in sums)
    # Aborting the old groups now (late, as a slow teardown would) leaves the new ones working.
    for pg in old:
        pg.abort()
    sums = list(pool.map(lambda r: allreduce(pgs[r], 2.0, "cpu"), range(WORLD)))
    assert all(torch.equal(s, torch.full((5,), 6.0)) for s in sums)


def test_a_group_that_is_not_formed_fails_naming_the_missing_rank(ranks):
    pgs, _, _ = ranks
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lonely = ProcessGroupDicommFT(timeout=datetime.timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(Exception, match="did not join"):
        lonely.configure(f"127.0.0.1:{store.port}/quorum/1", "0", 0, 2)
    assert time.monotonic() - start < 10
