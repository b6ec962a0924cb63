"""Emulated links (DICOMM_LINKS, docs/dicomm.md): a message over an emulated link takes
(latency + bytes / bandwidth) x the time scale, a cross-DC link that several pairs cross at once
is shared by them, the waiting spins no core, and bad settings are refused naming the value."""
from __future__ import annotations

import resource
import time

import pytest
import torch

from diutil.datasheets.links import GB, FleetLinks, LinkSpec, Place
from launcher import run_ranks

SCALE = 10.0
NODE = LinkSpec(0.01 * GB, 2e-3)  # 10 MB/s, 2 ms
CROSS = LinkSpec(0.005 * GB, 5e-3)  # 5 MB/s, 5 ms
PLACES = [Place("dc0", "n0"), Place("dc0", "n1"), Place("dc1", "n2"), Place("dc1", "n3")]
ALONE, SHARED = 200_000, 100_000  # bytes


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def transfers(rank: int, world: int, _port: int) -> dict:
    """Phase 1: rank 0 -> 1 alone (inter_node). Phase 2: 0 -> 2 and 1 -> 3 at once, both over
    the one dc0 -> dc1 link. Times are CLOCK_MONOTONIC, which the ranks of one machine share."""
    import torch.distributed as dist

    out: dict = {"link_to": {p: dist.group.WORLD._get_backend(torch.device("cpu")).link_of(p)
                             for p in range(world) if p != rank}}
    dist.barrier()
    alone = torch.zeros(ALONE // 4)
    if rank == 0:
        out["sent"] = time.monotonic()
        dist.send(alone, 1)
    elif rank == 1:
        cpu = _cpu()
        dist.recv(alone, 0)
        out["received"], out["cpu"] = time.monotonic(), _cpu() - cpu
    dist.barrier()
    shared = torch.zeros(SHARED // 4)
    if rank in (0, 1):
        out["sent_shared"] = time.monotonic()
        dist.send(shared, rank + 2)
    else:
        dist.recv(shared, rank - 2)
        out["received_shared"] = time.monotonic()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_a_message_takes_the_fleets_link_time_and_a_cross_dc_link_is_shared(tmp_path):
    links = FleetLinks({"inter_node": NODE, "inter_cluster": CROSS}, dcs=frozenset({"dc0", "dc1"}))
    state = str(tmp_path / "links")
    out = run_ranks(transfers, 4, rank_env={r: links.env(p, SCALE, state) for r, p in enumerate(PLACES)},
                    op_timeout_s=60)
    assert out[0]["link_to"][1].startswith("inter_node dc0/n0>dc0/n1") and out[0]["link_to"][2].startswith(
        "inter_cluster dc0/n0>dc1/n2"), out[0]["link_to"]
    alone = out[1]["received"] - out[0]["sent"]
    want = (NODE.latency + ALONE / NODE.bandwidth) * SCALE  # 0.22 s
    assert alone == pytest.approx(want, rel=0.1), (alone, want)
    # the receiver slept through its 0.22 s: a spinning wait would have burnt about all of it
    assert out[1]["cpu"] < 0.25 * alone, out[1]["cpu"]
    # two messages on one link at once: each gets half of it, both end when both bytes have passed
    both = (CROSS.latency + 2 * SHARED / CROSS.bandwidth) * SCALE  # 0.45 s; alone it would be 0.25 s
    for sender, receiver in ((0, 2), (1, 3)):
        took = out[receiver]["received_shared"] - out[sender]["sent_shared"]
        assert took == pytest.approx(both, rel=0.1), (sender, receiver, took, both)


@pytest.mark.parametrize("variable, value, message", [
    ("DICOMM_LINKS", "inter_node=:50", "link 'inter_node=:50' has no bandwidth"),
    ("DICOMM_LINKS", "inter_node=0:50", "bandwidth 0 GB/s is out of range"),
    ("DICOMM_LINKS", "inter_node=1:2e7", "latency 2e7 us is out of range"),
    ("DICOMM_LINKS", "inter_rack=1:5", "unknown class 'inter_rack'"),
    ("DICOMM_LINK_PLACE", "dc0", "DICOMM_LINK_PLACE='dc0' is invalid; expected DC/NODE"),
    ("DICOMM_LINK_PLACE", "", "DICOMM_LINK_PLACE is not"),
    ("DITORCH_TIME_SCALE", "0.5", "DITORCH_TIME_SCALE='0.5' is invalid"),
    ("DICOMM_LINK_STATE", "/no-such-dir/links", "cannot open the emulated links' state file "
                                               "DICOMM_LINK_STATE='/no-such-dir/links'"),
])
def test_bad_link_settings_are_refused_naming_the_value(monkeypatch, tmp_path, variable, value, message):
    import dicomm

    settings = {"DICOMM_LINKS": "inter_node=1:5", "DICOMM_LINK_PLACE": "dc0/n0", "DITORCH_TIME_SCALE": "2",
                "DICOMM_LINK_STATE": str(tmp_path / "links"), variable: value}
    for name, setting in settings.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises((ValueError, RuntimeError), match=message.replace("(", r"\(").replace("'", ".")):
        dicomm.ProcessGroupDicomm(torch.distributed.HashStore(), 0, 1, 5.0)
