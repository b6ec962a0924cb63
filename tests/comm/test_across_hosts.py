"""DiComm across emulated hosts (network + UTS + mount namespaces on a bridge), configured as a
new user would: nothing but the store's address. Each rank must listen on the address of the
interface that routes to the store; a peer that cannot be reached, or that vanishes, must fail
every rank within seconds, naming it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from emulated_hosts import can_make_hosts, emulated_hosts
from launcher import error_of, run_ranks

pytestmark = pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _env_without_dicomm() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DICOMM_") and k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.timeout(240)
def test_torchrun_two_hosts_ddp_with_no_configuration(tmp_path):
    """`torchrun --nnodes 2` on two hosts, no DICOMM_* variable: DDP matches one process."""
    sys.path.insert(0, str(HERE))
    from ddp_across_hosts import BATCH, STEPS, model_and_data

    with emulated_hosts(2) as hosts:
        endpoint = f"{hosts[0].name}:29541"
        procs = []
        for node, host in enumerate(hosts):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "ddp",
                   str(HERE / "ddp_across_hosts.py"), str(tmp_path / "model.pt")]
            procs.append(subprocess.Popen(host.run(cmd), env=_env_without_dicomm(), cwd=tmp_path,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        try:
            outs = [p.communicate(timeout=180)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    trained = torch.load(tmp_path / "model.pt")

    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert BATCH % 4 == 0  # equal shards: DDP's mean of shard means is the full-batch mean
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _listen_where(rank, world, port):
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    t = torch.ones(4)
    dist.all_reduce(t)
    return {"transport": pg.transport_of(1 - rank), "sum": t[0].item()}


@pytest.mark.timeout(120)
def test_ipv6_store_and_link_local_interfaces():
    """A store reached over IPv6 makes every rank listen on IPv6; an interface with only a
    link-local address works too, the dialer swapping in its own interface as the scope."""
    with emulated_hosts(2) as hosts:
        # the route to an IPv6 store
        out = run_ranks(_listen_where, 2, hosts=hosts, store_address=f"[{hosts[0].address6}]")
        assert all(o == {"transport": "tcp", "sum": 2.0} for o in out.values()), out
        # link-local only: interfaces differ in name between the hosts, as on real machines
        for h in hosts:
            subprocess.run(["ip", "-n", h.ns, "addr", "del", f"{h.address6}/64", "dev", h.dev], check=True)
        env = {"DICOMM_SOCKET_IFNAME": ",".join(h.dev for h in hosts), "DICOMM_SOCKET_FAMILY": "AF_INET6"}
        out = run_ranks(_listen_where, 2, hosts=hosts, env=env)
        assert all(o == {"transport": "tcp", "sum": 2.0} for o in out.values()), out


def _init_and_report(rank, world, port):
    import datetime

    import torch.distributed as dist

    t0 = time.monotonic()
    err = error_of(dist.init_process_group, "dicomm", init_method=f"tcp://{os.environ['TEST_STORE']}:{port}",
                   rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    return {"error": err, "seconds": time.monotonic() - t0}


@pytest.mark.timeout(120)
def test_unreachable_listen_address_fails_both_ranks_in_seconds():
    """Rank 1 listens on an interface rank 0 has no route to: both ranks fail within the connect
    timeout (10 s), not the group's (120 s), naming the rank, the address and what to set."""
    with emulated_hosts(2) as hosts:
        island = "dumx"
        # a second interface of host 1 that leads nowhere (a veth pair with both ends on host 1)
        ip = ["ip", "-n", hosts[1].ns]
        subprocess.run([*ip, "link", "add", island, "type", "veth", "peer", "name", f"{island}p"], check=True)
        subprocess.run([*ip, "addr", "add", "10.250.0.2/24", "dev", island], check=True)
        for dev in (island, f"{island}p"):
            subprocess.run([*ip, "link", "set", dev, "up"], check=True)
        env = {"DICOMM_SOCKET_IFNAME": f"{island},{hosts[0].dev}", "TEST_STORE": hosts[0].address}
        out = run_ranks(_init_and_report, 2, hosts=hosts, env=env, init=False)
    dialer, acceptor = out[0], out[1]
    assert dialer["error"] and acceptor["error"], out
    assert "rank 0 cannot connect to rank 1 at tcp:10.250.0.2:" in dialer["error"], dialer
    assert "DICOMM_SOCKET_IFNAME" in dialer["error"] and "DICOMM_CONNECT_TIMEOUT" in dialer["error"], dialer
    # Rank 0 hosts the store, so rank 1 hears either the reason through it or, if rank 0 has
    # already gone with its store, that rank 0 did not connect.
    assert ("could not reach rank 1 (this rank)" in acceptor["error"] and "10.250.0.2" in acceptor["error"]
            or "rank 0 did not connect, and the store stopped answering" in acceptor["error"]), acceptor
    # The connect timeout (10 s) ended it, not the group's (120 s): half the group's bound leaves a
    # sanitized build on a loaded host its slowness without blurring the two.
    for o in out.values():
        assert 9 < o["seconds"] < 60, out


def _allreduce_until_the_link_goes(rank, world, port):
    import threading

    import torch.distributed as dist

    big = torch.ones(8 << 20)
    for _ in range(3):
        dist.all_reduce(big)  # the pairs work
    cut_at = None
    if rank == world - 1:
        # The last host takes its own link down while the collectives run.
        dev = os.environ["TEST_DEV"]

        def cut():
            nonlocal cut_at
            time.sleep(0.05)
            cut_at = time.time()
            subprocess.run(["ip", "link", "set", dev, "down"], check=True)

        threading.Thread(target=cut).start()
    failed_at, err = None, None
    for _ in range(10_000):
        err = error_of(dist.all_reduce, big)
        if err:
            failed_at = time.time()
            break
    return {"error": err, "failed_at": failed_at, "cut_at": cut_at}


@pytest.mark.timeout(180)
def test_vanished_host_fails_every_rank_within_the_keepalive_bound():
    """Host 1 (ranks 2, 3) loses its link mid-collective: ranks 0 and 1 fail within
    DICOMM_PEER_TIMEOUT (10 s) plus slack, not at the op timeout (90 s), naming a rank of host 1."""
    with emulated_hosts(2) as hosts:
        out = run_ranks(_allreduce_until_the_link_goes, 4, hosts=hosts, env={"TEST_DEV": hosts[1].dev},
                        op_timeout_s=90, wall_timeout_s=170)
    cut_at = out[3]["cut_at"]
    assert cut_at is not None, out
    for rank in (0, 1):
        o = out[rank]
        assert o["error"] and re.search(r"rank [23]\b", o["error"]), (rank, o)
        assert "timed out after" not in o["error"], (rank, o)  # the keepalive, not the op timeout
        assert o["failed_at"] - cut_at < 18, (rank, o["failed_at"] - cut_at, o)
