"""A PS seeded from the first cluster to join (no --model, no --init): the cluster's parameters
become version 1, later clusters are checked against its model, and bad layouts are refused."""
import pytest
import torch

from dips.client import OuterClient
from dips.model import build_model
from dips.rpc import RpcClient, RpcError

from pscluster import MODEL, global_params, in_process_ps, perturb, wait_for


def test_first_cluster_seeds_the_ps_and_others_join_from_it(tmp_path):
    with in_process_ps(tmp_path, model=None, seed_from_cluster=True) as (leader, followers, token):
        first = build_model(MODEL, 7)
        sent = {n: p.detach().clone() for n, p in first.named_parameters()}
        a = OuterClient(first, leader.address, inner_steps=1, token=token, name="a", join=False)
        assert a.join(timeout_s=60)
        assert leader.status()["version"] == 1 and len(followers) == 2
        held = global_params(leader, token)
        for n, value in sent.items():  # the PS holds the cluster's parameters as they crossed the BF16 wire
            assert torch.equal(held[n], value.to(torch.bfloat16).float()), n
        for n, p in first.named_parameters():  # and the cluster keeps its own FP32 values
            assert torch.equal(p.detach(), sent[n]), n

        other = build_model(MODEL, 8)
        b = OuterClient(other, leader.address, inner_steps=1, token=token, name="b")
        assert b.base == 1
        for n, p in other.named_parameters():
            assert torch.equal(p.detach(), held[n]), n

        perturb(first, 0)  # outer steps go on from the seed
        assert a.step(tokens=10)
        assert leader.status()["complete"] == 2 and [r["clusters"] for r in leader.rounds_log] == [["a"], ["a"]]

        wrong = build_model(dict(MODEL, n_layers=MODEL["n_layers"] + 1), 9)
        c = OuterClient(wrong, leader.address, inner_steps=1, token=token, name="c", join=False)
        with pytest.raises(RpcError, match="fingerprint"):
            c.join(timeout_s=5)
        for client in (a, b, c):
            client.close()


def test_a_bad_layout_is_refused_and_the_ps_waits_on(tmp_path):
    with in_process_ps(tmp_path, model=None, seed_from_cluster=True) as (leader, _, token):
        rpc = RpcClient("dips.Leader", leader.address, token)
        assert rpc.call("RegisterCluster", name="x", fingerprint="f")["status"] == "layout"
        for layout, why in (([["w", [-3]]], "shape"), ([["w", [2]], ["w", [2]]], "twice"),
                            ([["w", [1 << 30, 1 << 30, 1 << 30]]], "elements"), ([["", [2]]], "name"),
                            ("w", "list"), ([["w", [2.5]]], "shape")):
            with pytest.raises(RpcError, match=why):
                rpc.call("RegisterCluster", name="x", fingerprint="f", layout=layout)
        with pytest.raises(RpcError, match="claims"):  # a layout that is not the one its fingerprint names
            rpc.call("RegisterCluster", name="x", fingerprint="0" * 16, layout=[["w", [2]]])
        assert leader.state.layout is None and leader.status()["clusters"] == []
        rpc.close()


def test_a_follower_replays_the_seeding_round(tmp_path):
    """A follower restarted with no checkpoint past version 0 replays the seed decision from the
    sealed push it kept on disk, and the round after it, bit-identically."""
    from dips.auth import JobToken
    from dips.follower import MAX_CHECKPOINT_EVERY, Follower
    from diutil.address import free_port
    from dips.leader import Leader, LeaderConfig

    token, servers = JobToken.create(tmp_path / "job.key"), JobToken.create(tmp_path / "servers.key")
    leader = Leader(LeaderConfig(model=None, seed_from_cluster=True, n_followers=1, mode="async",
                                 bind="127.0.0.1:0", follower_heartbeat_s=0.3, restart_followers=False), token, servers)

    def follower():
        return Follower(leader.address, f"127.0.0.1:{free_port()}", servers, tmp_path / "f",
                        checkpoint_every=MAX_CHECKPOINT_EVERY)

    import threading

    box = []
    threading.Thread(target=lambda: box.append(follower()), daemon=True).start()
    client = None
    try:
        model = build_model(MODEL, 3)
        client = OuterClient(model, leader.address, inner_steps=1, token=token, name="a", join=False)
        sent = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
        assert client.join(timeout_s=60)
        perturb(model, 1)
        pushed = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
        assert client.step(tokens=5)
        wait_for(lambda: box and box[0].version == 2, 30, "version 2 on the follower")
        with box[0].state.lock:
            before = {n: t.clone() for n, t in box[0].state.theta.items()}
        for n, value in before.items():  # version 1 is the seed; version 2 a first Nesterov step (lr 0.7, m 0.8)
            g = sent[n] - pushed[n]
            torch.testing.assert_close(value, sent[n] - 0.7 * (g + 0.8 * g), rtol=1e-6, atol=1e-7)
        box.pop().stop()
        again = follower()
        box.append(again)
        wait_for(lambda: again.version == 2, 60, "the restarted follower to replay the seed and one round")
        with again.state.lock:
            assert all(torch.equal(before[n], again.state.theta[n]) for n in before)
    finally:
        if client is not None:
            client.close()
        for f in box:
            f.stop()
        leader.stop()
