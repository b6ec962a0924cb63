"""The PS end to end in one process: outer step against a hand-computed reference, joins,
heartbeats, and the safety rules (token, validation, message sizes)."""
import json
import logging
import os
import time

import pytest
import torch
import zmq

from dips.auth import JobToken
from dips.client import OuterClient
from dips.curve import KeyPair, connecting_socket, tcp_endpoint
from dips.layout import pack_unit
from dips.leader import Leader, LeaderConfig
from dips.model import build_model
from dips.rpc import RpcClient, RpcError

from pscluster import MODEL, global_params, in_process_ps, perturb, wait_for


def test_outer_steps_match_reference(tmp_path):
    """Two outer rounds of one cluster reproduce: pseudo-gradient on BF16 values, clip to norm 1,
    torch.optim.SGD(nesterov) with lr 0.7, momentum 0.8, BF16 on the wire, local residue kept."""
    theta = {n: p.detach().clone() for n, p in build_model(MODEL, 0).named_parameters()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)
    with in_process_ps(tmp_path) as (leader, _, token):
        model = build_model(MODEL, 99)
        client = OuterClient(model, leader.address, inner_steps=1, token=token, name="c")
        for n, p in model.named_parameters():  # joined: holds BF16 of theta_0
            torch.testing.assert_close(p.detach(), theta[n].bfloat16().float(), rtol=0, atol=0)
        for rnd in range(2):
            base = {n: r.detach().bfloat16().float() for n, r in ref.items()}
            perturb(model, rnd)
            local = {n: p.detach().clone() for n, p in model.named_parameters()}
            delta = {n: base[n] - local[n].bfloat16().float() for n in base}
            norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item()
            scale = min(1.0, 1.0 / norm)
            for n, r in ref.items():
                r.grad = delta[n] * scale
            sgd.step()
            assert client.step(tokens=100)
            for n, p in model.named_parameters():
                expected = ref[n].detach().bfloat16().float() + (local[n] - local[n].bfloat16().float())
                torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
        assert leader.status()["version"] == 2
        client.close()


def test_stale_push_is_scaled_by_its_staleness(tmp_path):
    """Cluster a pushes twice, then b pushes from version 0: b's clipped pseudo-gradient lands on
    version 2, two versions stale, and with --staleness-decay 1 counts a third (hand computed)."""
    theta0 = {n: p.detach().clone() for n, p in build_model(MODEL, 0).named_parameters()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in theta0.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)

    def reference_step(base: dict, local: dict, staleness: int) -> None:
        delta = {n: base[n] - local[n].bfloat16().float() for n in base}
        norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item()
        for n, r in ref.items():
            r.grad = delta[n] * min(1.0, 1.0 / norm) / (1 + staleness)
        sgd.step()

    with in_process_ps(tmp_path, staleness_decay=1.0) as (leader, _, token):
        a, b = build_model(MODEL, 1), build_model(MODEL, 2)
        ca = OuterClient(a, leader.address, inner_steps=1, token=token, name="a")
        cb = OuterClient(b, leader.address, inner_steps=1, token=token, name="b")
        for rnd in range(2):
            base = {n: r.detach().bfloat16().float() for n, r in ref.items()}
            perturb(a, rnd)
            reference_step(base, {n: p.detach().clone() for n, p in a.named_parameters()}, staleness=0)
            assert ca.step(tokens=100)
        perturb(b, 7)
        reference_step({n: t.bfloat16().float() for n, t in theta0.items()},
                       {n: p.detach().clone() for n, p in b.named_parameters()}, staleness=2)
        assert cb.step(tokens=100)
        assert leader.status()["version"] == 3
        assert [r["staleness"] for r in leader.rounds_log] == [[0], [0], [2]]
        for n, p in global_params(leader, token).items():
            torch.testing.assert_close(p, ref[n].detach().bfloat16().float(), rtol=0, atol=1e-6)
        ca.close()
        cb.close()


def test_new_cluster_starts_from_latest_global(tmp_path):
    with in_process_ps(tmp_path) as (leader, _, token):
        a = build_model(MODEL, 1)
        ca = OuterClient(a, leader.address, inner_steps=1, token=token, name="a")
        for i in range(3):
            perturb(a, i)
            ca.step(tokens=10)
        b = build_model(MODEL, 2)
        cb = OuterClient(b, leader.address, inner_steps=1, token=token, name="b")
        assert cb.base == 3
        latest = global_params(leader, token)
        for n, p in b.named_parameters():
            assert torch.equal(p.detach(), latest[n])
        ca.close()
        cb.close()


def test_silent_cluster_removed_after_three_intervals(tmp_path):
    with in_process_ps(tmp_path, heartbeat_s=0.3) as (leader, _, token):
        c = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="quiet")
        time.sleep(1.2)  # heartbeats keep it registered well past 3 intervals
        assert "quiet" in leader.status()["clusters"]
        c.close(leave=False)  # stops heartbeating without saying goodbye
        t0 = time.monotonic()
        wait_for(lambda: "quiet" not in leader.status()["clusters"], 5, "removal")
        gone = time.monotonic() - t0
        assert 0.6 <= gone <= 0.9 + 1.0, gone  # > 3 intervals since the last beat (<= 1 interval before close)


def test_sync_round_waits_for_all_then_for_removal(tmp_path):
    """Sync DiLoCo closes a round only when every live cluster pushed; a dead one is dropped."""
    with in_process_ps(tmp_path, mode="sync", heartbeat_s=0.3) as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="a",
                        round_timeout_s=0.5)
        b = OuterClient(build_model(MODEL, 2), leader.address, inner_steps=1, token=token, name="b")
        assert not a.step(tokens=1)       # b has not pushed: the round stays open
        assert leader.status()["version"] == 0 and a.speaker.pending is not None
        b.close(leave=False)               # b dies; after 3 intervals it is removed and the round closes
        wait_for(lambda: leader.status()["complete"] == 1, 5, "round to close")
        perturb(a.model, 0)
        assert a.step(tokens=1)            # resolves the pending push (pulls version 1) ...
        assert a.base == 1
        a.close()


def test_round_log_counts_staleness(tmp_path):
    """Two clusters join at version 0; a's push makes version 1, so b's push (base 0) is applied
    one version late, and b's next push, from the version it pulled, is not stale."""
    with in_process_ps(tmp_path, mode="async") as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="a")
        b = OuterClient(build_model(MODEL, 2), leader.address, inner_steps=1, token=token, name="b")
        for client, seed in ((a, 0), (b, 1), (b, 2)):
            perturb(client.model, seed)
            assert client.step(tokens=1)
        seen = [(r["clusters"], r["staleness"]) for r in leader.rounds_log]
        assert seen == [(["a"], [0]), (["b"], [1]), (["b"], [0])]
        a.close()
        b.close()


def test_a_cluster_that_exits_right_after_its_last_outer_step_leaves_every_push_committed(tmp_path):
    """Async mode, a round timeout of 0 (the outer step never waits for its push's round): the
    push of the last outer step is still uncommitted when training ends. close() (or leaving the
    ``with`` block) finishes it, so the leader's committed version counts every push the cluster
    sealed the moment the cluster is gone; 20 clusters in a row, one after the other."""
    with in_process_ps(tmp_path, mode="async") as (leader, _, token):
        for i in range(20):
            before = leader.status()["version"]
            client = OuterClient(build_model(MODEL, i), leader.address, inner_steps=1, token=token, name=f"c{i}",
                                 round_timeout_s=0.0)
            with client:
                for step in range(3):
                    perturb(client.model, 100 * i + step)
                    client.step(tokens=1)
            left = client.close()  # a second close reports what the first one did
            status = leader.status()
            assert left["pending"] is None and left["pushed"] >= 1, left
            assert status["version"] - before == left["pushed"] == left["applied"], (i, left, status)
            assert status["complete"] == status["version"] and left["version"] == status["version"]
            assert f"c{i}" not in status["clusters"]


def test_a_cluster_that_leaves_is_not_waited_for(tmp_path):
    """A departing cluster says so: a sync round closes at once, not when its heartbeats lapse
    (30 s here, far beyond the test's wait)."""
    with in_process_ps(tmp_path, mode="sync", heartbeat_s=30.0) as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="a",
                        round_timeout_s=0.5)
        b = OuterClient(build_model(MODEL, 2), leader.address, inner_steps=1, token=token, name="b")
        assert not a.step(tokens=1)
        b.close()
        assert leader.status()["clusters"] == ["a"]
        wait_for(lambda: leader.status()["complete"] == 1, 5, "round to close")
        a.close()
        assert leader.status()["clusters"] == []


def test_wrong_token_refused_and_logged(tmp_path, caplog):
    with in_process_ps(tmp_path) as (leader, followers, token):
        with caplog.at_level(logging.WARNING, logger="dips.rpc"):
            bad = RpcClient("dips.Leader", leader.address, JobToken("x" * 32))
            with pytest.raises(RpcError, match="PERMISSION_DENIED"):
                bad.call("Status")
            with pytest.raises(RpcError, match="PERMISSION_DENIED"):
                RpcClient("dips.Follower", followers[0].ctrl, JobToken("y" * 32)).call("Status")
        assert sum("refused" in r.message for r in caplog.records) >= 2
        with pytest.raises(ValueError, match="at least 16"):
            JobToken("short")


def test_cluster_credentials_cannot_act_as_a_server(tmp_path, caplog):
    """Roles: the job token clusters hold cannot register a follower, heartbeat as one, or drive a
    follower's outer step; the leader refuses a server token equal to the job token."""
    with in_process_ps(tmp_path) as (leader, followers, token):
        wait_for(lambda: len(leader.status()["followers"]) == 2, 30, "followers")
        as_cluster = RpcClient("dips.Leader", leader.address, token)
        with caplog.at_level(logging.WARNING, logger="dips.rpc"):
            for method, fields in [("RegisterFollower", {"index": 0, "data": "127.0.0.1:1", "ctrl": "127.0.0.1:2"}),
                                   ("FollowerHeartbeat", {"id": 0, "version": 99})]:
                with pytest.raises(RpcError, match="PERMISSION_DENIED"):
                    as_cluster.call(method, **fields)
            for method in ("Status", "Apply", "Seal"):
                with pytest.raises(RpcError, match="PERMISSION_DENIED"):
                    RpcClient("dips.Follower", followers[0].ctrl, token).call(method, version=1, weights={})
        assert sum("refused" in r.message for r in caplog.records) == 5
        assert leader.state.data_plan()["followers"] == [f.advertise for f in sorted(followers, key=lambda f: f.index)]
        assert leader.status()["followers"] == {"0": 0, "1": 0}
        assert as_cluster.call("Status")["version"] == 0     # the role it has still works
        as_cluster.close()
    with pytest.raises(ValueError, match="server token equals the job token"):
        Leader(LeaderConfig(model=MODEL, n_followers=1, bind="127.0.0.1:0"), token, JobToken(token.secret))


def test_data_flow_admits_only_the_cluster_key(tmp_path, caplog):
    """CURVE + ZAP on a follower's data socket: a plain socket and a CURVE client with another
    key get no reply (ZAP logs the refusal); the cluster key gets its pull."""
    with in_process_ps(tmp_path) as (leader, followers, token):
        f = min(followers, key=lambda f: f.index)
        wait_for(lambda: f.version == 0, 30, "the follower's registration")
        ctx = zmq.Context()
        pull = [json.dumps({"op": "pull", "version": 0, "units": [0], "req": "r"}).encode()]

        def ask(sock) -> list | None:
            """The reply, or None when the message cannot even be sent (no admitted connection)."""
            if not sock.poll(1500, zmq.POLLOUT):
                return None
            try:  # a refused handshake can tear the connection down between the poll and the send
                sock.send_multipart(pull, flags=zmq.NOBLOCK)
            except zmq.Again:
                return None
            return sock.recv_multipart() if sock.poll(1500) else None

        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(tcp_endpoint(f.advertise))
        follower_key = KeyPair.derive(JobToken((tmp_path / "servers.key").read_text()), "dips-follower").public
        intruder = connecting_socket(ctx, follower_key, KeyPair.derive(JobToken("w" * 32), "dips-cluster"),
                                     tcp_endpoint(f.advertise), 1 << 20)
        member = connecting_socket(ctx, follower_key, KeyPair.derive(token, "dips-cluster"),
                                   tcp_endpoint(f.advertise), 1 << 20)
        with caplog.at_level(logging.WARNING, logger="dips.curve"):
            assert ask(plain) is None
            assert ask(intruder) is None
            reply = ask(member)
        assert reply is not None and json.loads(reply[0])["ok"] is True
        assert any("refused a connection" in r.message for r in caplog.records)
        for s in (plain, intruder, member):
            s.close(0)
        ctx.term()


def test_oversize_data_frame_drops_the_connection(tmp_path):
    """MAXMSGSIZE is the model's largest unit: a bigger frame never reaches the follower's queues."""
    with in_process_ps(tmp_path) as (leader, followers, token):
        model = build_model(MODEL, 3)
        c = OuterClient(model, leader.address, inner_steps=1, token=token, name="c")
        addr = c.plan["followers"][0]
        sock = c.transfer.sock(addr)
        big = b"\0" * (c.layout.max_message_bytes + 1)
        sock.send_multipart([c.transfer.header(op="push", push="p", req="big"), big])
        assert not sock.poll(1500), "an oversize frame was answered"
        assert all(not f.state.staged for f in followers)
        c.close()


def _raw_push(client, leader_version_check, units_to_send, mutate=None):
    """Request a push and send ``units_to_send`` by hand (possibly mutated); return PushDone's reply."""
    reply = client.speaker.leader.call("PushRequest", **client.speaker._me(), tokens=1, base=client.base,
                               workers={"0": list(range(len(client.layout.units)))})
    push = reply["push"]
    acks = []
    for unit in units_to_send:
        spec = client.layout.units[unit]
        names = [t.name for t in spec.tensors]
        shapes = [list(t.shape) for t in spec.tensors]
        tensors = [client.params[n].detach() for n in names]
        header = dict(op="push", push=push, cluster=client.speaker.cluster_id, base=client.base, unit=unit, names=names,
                      shapes=shapes, dtype="bfloat16", req=f"{push}:{unit}")
        payload = pack_unit(tensors)
        if mutate:
            header, payload = mutate(header, payload)
        addr = client.plan["followers"][0 if unit < client.plan["units"][0][1] else 1]
        client.transfer.sock(addr).send_multipart([client.transfer.header(**header), payload])
        acks += [h for h, _ in client.transfer.replies(addr, {header["req"]})]
    return acks, client.speaker.leader.call("PushDone", **client.speaker._me(), push=push)


@pytest.mark.parametrize("case", ["partial", "shape", "names", "nan", "size"])
def test_malformed_push_rejected_state_unchanged(tmp_path, case):
    with in_process_ps(tmp_path) as (leader, followers, token):
        model = build_model(MODEL, 3)
        c = OuterClient(model, leader.address, inner_steps=1, token=token, name="c")
        before = global_params(leader, token)
        units = list(range(len(c.layout.units)))
        mutate = None
        if case == "partial":
            units = units[:-1]
        elif case == "shape":
            mutate = lambda h, p: ({**h, "shapes": [[s[0] + 1, *s[1:]] for s in h["shapes"]]}, p)  # noqa: E731
        elif case == "names":
            mutate = lambda h, p: ({**h, "names": list(reversed(h["names"]))}, p)  # noqa: E731
        elif case == "size":
            mutate = lambda h, p: (h, p[:-2])  # noqa: E731
        elif case == "nan":
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        acks, done = _raw_push(c, None, units, mutate)
        assert done["status"] == "failed", done
        if case != "partial":
            assert any(not a["ok"] for a in acks)
        else:
            assert "partial" in done["err"]
        time.sleep(0.1)
        assert leader.status()["version"] == 0
        after = global_params(leader, token)
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert all(not f.state.sealed for f in followers)
        c.close()


def test_control_messages_small_and_metadata_under_100kb(tmp_path):
    with in_process_ps(tmp_path) as (leader, followers, token):
        model = build_model(MODEL, 4)
        c = OuterClient(model, leader.address, inner_steps=1, token=token, name="c")
        for i in range(4):
            perturb(model, i)
            assert c.step(tokens=1000)
        assert leader.rpc.stats.count > 10
        assert leader.rpc.stats.max_bytes < 1024
        assert max(f.rpc.stats.max_bytes for f in followers) < 1024
        assert os.path.getsize(tmp_path / "leader.json") < 100_000
        c.close()


def test_servers_bind_loopback_by_default():
    import inspect

    from dips.cli import main  # noqa: F401
    from dips.leader import LeaderConfig

    assert LeaderConfig(model=MODEL, n_followers=1).bind.startswith("127.0.0.1:")
    from dips import cli

    src = inspect.getsource(cli)
    assert 'default="127.0.0.1:7000"' in src and 'default="127.0.0.1:7100"' in src


def test_grace_time_gathers_close_pushes_into_one_round(tmp_path):
    """Two clusters pushing within the grace time share one outer step, weighted by tokens."""
    import threading

    with in_process_ps(tmp_path, initial_grace=1.0) as (leader, _, token):
        models = [build_model(MODEL, 20 + i) for i in range(2)]
        clients = [OuterClient(m, leader.address, inner_steps=1, token=token, name=f"g{i}") for i, m in enumerate(models)]
        for i, m in enumerate(models):
            perturb(m, 40 + i)
        results = [None, None]

        def push(i):
            results[i] = clients[i].step(tokens=300 if i == 0 else 100)
        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.2)  # well inside the 1 s grace time
        for t in threads:
            t.join(30)
        assert results == [True, True]
        assert leader.status()["version"] == 1          # one round, not two
        r = leader.rounds_log[-1]
        assert r["accepted"] == 2 and sorted(r["clusters"]) == ["g0", "g1"] and r["staleness"] == [0, 0]
        weights = sorted(leader.state.decisions[1]["weights"].values())
        assert weights == [0.25, 0.75]
        for c in clients:
            c.close()


@pytest.mark.parametrize("tokens", [-5, 1.5, True, "12", 10**12])
def test_bad_token_counts_refused_state_unchanged(tmp_path, caplog, tokens):
    """A push's token count is its averaging weight: a negative, fractional, non-numeric or
    impossibly large one (more than --max-cluster-tokens-per-s allows since the cluster's tokens
    were last counted) is refused with the reason logged, and the PS keeps no trace of it."""
    with in_process_ps(tmp_path, max_cluster_tokens_per_s=1000.0) as (leader, _, token):
        c = OuterClient(build_model(MODEL, 3), leader.address, inner_steps=1, token=token, name="c")
        before, meta = leader.status(), (tmp_path / "leader.json").read_bytes()
        with caplog.at_level(logging.WARNING, logger="dips.rpc"):
            with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*tokens"):
                c.speaker.leader.call("PushRequest", **c.speaker._me(), tokens=tokens, base=c.base,
                              workers={"0": list(range(len(c.layout.units)))})
        assert any("PushRequest refused" in r.message and "tokens" in r.message for r in caplog.records)
        assert leader.state.pushes == {} and leader.status() == before
        assert (tmp_path / "leader.json").read_bytes() == meta
        assert c.step(tokens=500)          # a count the rate allows goes through
        assert leader.status()["tokens"] == 500
        c.close()


def test_clusters_waiting_for_a_round_do_not_starve_heartbeats(tmp_path):
    """40 WaitPush calls parked for 4 s each (more than the RPC server's 16 threads) while a
    sync round waits for a second cluster: heartbeats still get through (every 0.5 s, removal
    after 1.5 s of silence), so no cluster is removed and every wait ends as 'pending'."""
    import threading

    with in_process_ps(tmp_path, mode="sync", heartbeat_s=0.5) as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="a",
                        round_timeout_s=0.0)
        b = OuterClient(build_model(MODEL, 2), leader.address, inner_steps=1, token=token, name="b")
        perturb(a.model, 0)
        assert not a.step(tokens=1) and a.speaker.pending is not None   # sealed; the sync round waits for b
        fates = []

        def wait():
            rpc = RpcClient("dips.Leader", leader.address, token)
            fates.append(rpc.call("WaitPush", timeout=10.0, push=a.speaker.pending, wait=4.0)["state"])
            rpc.close()

        waiters = [threading.Thread(target=wait) for _ in range(40)]
        for t in waiters:
            t.start()
        time.sleep(3.0)
        assert leader.status()["clusters"] == ["a", "b"]
        for t in waiters:
            t.join(15)
        assert fates == ["pending"] * 40
        assert leader.status()["clusters"] == ["a", "b"]
        b.close()  # b leaves, so the sync round closes with a's push and a's close finds it applied
        assert a.close()["applied"] == 1


def test_followers_stage_only_pushes_the_leader_issued(tmp_path):
    """A cluster cannot make follower memory grow at will: a push id it made up, or one issued to
    another cluster, is refused; a new push request supersedes the cluster's unfinished one (one
    push in flight per cluster); and a follower stages at most --max-unsealed-pushes pushes."""
    with in_process_ps(tmp_path) as (leader, followers, token):
        c = OuterClient(build_model(MODEL, 3), leader.address, inner_steps=1, token=token, name="c")
        f0 = min(followers, key=lambda f: f.index)
        addr = c.plan["followers"][f0.index]
        spec = c.layout.units[0]

        def send(push: str, cluster: str = "c") -> dict:
            header = dict(op="push", push=push, cluster=cluster, base=0, unit=0, names=[t.name for t in spec.tensors],
                          shapes=[list(t.shape) for t in spec.tensors], dtype="bfloat16", req=f"{push}:{cluster}")
            c.transfer.sock(addr).send_multipart([c.transfer.header(**header), pack_unit([c.params[t.name] for t in spec.tensors])])
            return next(h for h, _ in c.transfer.replies(addr, {header["req"]}))

        assert "not an id the leader issued" in send("made-up")["err"]
        request = dict(**c.speaker._me(), tokens=1, base=0, workers={"0": list(range(len(c.layout.units)))})
        first = c.speaker.leader.call("PushRequest", **request)["push"]
        assert "not an id the leader issued" in send(first, cluster="other")["err"]
        assert send(first)["ok"] and list(f0.state.staged) == [first]
        second = c.speaker.leader.call("PushRequest", **request)["push"]
        assert leader.state.pushes[first].state == "failed" and leader.state.pushes[second].state == "requested"
        wait_for(lambda: not f0.state.staged, 5, "the superseded push to be discarded")
        f0.state.max_unsealed_pushes = 1  # c's push is staged; another cluster's finds no room
        assert send(second)["ok"]
        d = OuterClient(build_model(MODEL, 4), leader.address, inner_steps=1, token=token, name="d")
        other = d.speaker.leader.call("PushRequest", **{**request, **d.speaker._me()})["push"]
        assert "--max-unsealed-pushes" in send(other, cluster="d")["err"] and list(f0.state.staged) == [second]
        d.close()
        c.close()
