"""Any nn.Module through the PS: seeded from an --init file of its parameters, units from its
module tree balanced by bytes, clusters and followers checked against its fingerprint."""

import pytest
import torch
from torch import nn

from dips.auth import JobToken
from dips.client import OuterClient
from dips.follower import Follower
from diutil.address import free_port
from dips.leader import Leader, LeaderConfig
from dips.rpc import RpcError


def mlp(seed: int, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def save_parameters(model: nn.Module, path) -> str:
    torch.save({n: p.detach() for n, p in model.named_parameters()}, path)
    return str(path)


def test_any_module_trains_through_a_ps_seeded_from_init(tmp_path):
    init = save_parameters(mlp(0), tmp_path / "init.pt")
    token, servers = JobToken.create(tmp_path / "job.key"), JobToken.create(tmp_path / "servers.key")
    leader = Leader(LeaderConfig(model=None, init=init, n_followers=2, bind="127.0.0.1:0", restart_followers=False),
                    token, servers)
    # units "0", "2", "4" hold 288, 1056 and 132 parameters: by bytes, not by count, the big one
    # shares a follower with the small one
    assert leader.partition == [(0, 1), (1, 3)]
    followers = [Follower(leader.address, f"127.0.0.1:{free_port()}", servers, tmp_path / f"f{i}", init=init)
                 for i in range(2)]
    try:
        theta0 = {n: p.detach().clone() for n, p in mlp(0).named_parameters()}
        model = mlp(7)
        client = OuterClient(model, leader.address, inner_steps=1, token=token, name="mlp")
        for n, p in model.named_parameters():  # joined: holds BF16 of the --init parameters
            torch.testing.assert_close(p.detach(), theta0[n].bfloat16().float(), rtol=0, atol=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
        # the reference outer step: pseudo-gradient on BF16 values, clipped to norm 1, Nesterov SGD
        ref = {n: nn.Parameter(t.clone()) for n, t in theta0.items()}
        delta = {n: theta0[n].bfloat16().float() - local[n].bfloat16().float() for n in theta0}
        norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item()
        for n, r in ref.items():
            r.grad = delta[n] * min(1.0, 1.0 / norm)
        torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True).step()
        assert client.step(tokens=10)
        for n, p in model.named_parameters():
            expected = ref[n].detach().bfloat16().float() + (local[n] - local[n].bfloat16().float())
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
        client.close()

        with pytest.raises(RpcError, match="fingerprint"):  # another module is refused at registration
            OuterClient(mlp(0, width=16), leader.address, inner_steps=1, token=token, name="other")
    finally:
        for f in followers:
            f.stop()
        leader.stop()


def test_follower_needs_the_leaders_init_file(tmp_path):
    init = save_parameters(mlp(0), tmp_path / "init.pt")
    other = save_parameters(mlp(0, width=16), tmp_path / "other.pt")
    token, servers = JobToken.create(tmp_path / "job.key"), JobToken.create(tmp_path / "servers.key")
    leader = Leader(LeaderConfig(model=None, init=init, n_followers=1, bind="127.0.0.1:0", restart_followers=False),
                    token, servers)
    try:
        with pytest.raises(ValueError, match="no --init"):
            Follower(leader.address, f"127.0.0.1:{free_port()}", servers, tmp_path / "a")
        with pytest.raises(ValueError, match="the follower has [0-9a-f]{16}"):
            Follower(leader.address, f"127.0.0.1:{free_port()}", servers, tmp_path / "b", init=other)
    finally:
        leader.stop()
    with pytest.raises(ValueError, match="exactly one"):
        LeaderConfig(model=None, n_followers=1)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save({"w": torch.zeros(2, dtype=torch.int64)}, tmp_path / "ints.pt")
    with pytest.raises(ValueError, match="floating-point"):
        Leader(LeaderConfig(model=None, init=str(tmp_path / "ints.pt"), n_followers=1, bind="127.0.0.1:0"),
               token, servers)
