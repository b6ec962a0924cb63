"""Streamed outer steps in one process: a push's units leave spread over the inner steps after
its snapshot, the round applies exactly that snapshot's pseudo-gradient (a reference run), the
pull keeps the inner progress made while it streamed, and no round waits for a stream in flight."""
import pytest
import torch

from dips.client import OuterClient
from dips.codec import Codec
from dips.model import build_model

from pscluster import MODEL, global_params, in_process_ps, perturb


def _sends(client) -> list[int]:
    """Record the inner step at which each unit is sent."""
    at: list[int] = []
    send = client.transfer.send_payload

    def recorded(*args, **kwargs):
        at.append(client.inner_count)
        return send(*args, **kwargs)
    client.transfer.send_payload = recorded
    return at


def test_a_streamed_push_applies_its_snapshot_and_keeps_the_progress_made_while_it_streamed(tmp_path):
    H = 4
    theta = {n: p.detach().clone() for n, p in build_model(MODEL, 0).named_parameters()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)
    codec = Codec.parse("int8")
    with in_process_ps(tmp_path) as (leader, _, token):
        model = build_model(MODEL, 9)
        c = OuterClient(model, leader.address, inner_steps=H, token=token, name="s", push_codec="int8",
                        fragments=H)
        at = _sends(c)
        held = {n: t.bfloat16().float() for n, t in theta.items()}
        for i in range(H):
            perturb(model, i)
            assert not c.step(tokens=10)
        snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert c._stream is not None and leader.status()["version"] == 0
        for i in range(H, 2 * H - 1):
            perturb(model, i)
            assert not c.step(tokens=10)
        assert leader.status()["version"] == 0  # not sealed before its last part went
        perturb(model, 2 * H - 1)
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert c.step(tokens=10)
        # the parts left at inner steps H .. 2H-1, in the schedule's order
        n_units = len(c.layout.units)
        assert sorted(set(at[:n_units])) == list(range(H, 2 * H)) and at[:n_units] == sorted(at[:n_units])
        # the reference: the snapshot's pseudo-gradient, int8 on the wire, clipped, Nesterov
        decoded = {}
        for unit in c.layout.units:
            x = torch.cat([(held[t.name] - snapshot[t.name]).reshape(-1) for t in unit.tensors])
            dec = codec.round_trip(x)[1]
            decoded.update({t.name: d.view(t.shape) for t, d in zip(unit.tensors, dec.split([t.numel for t in unit.tensors]))})
        norm = torch.sqrt(sum((d.double() ** 2).sum() for d in decoded.values())).item()
        for n, r in ref.items():
            r.grad = decoded[n] * min(1.0, 1.0 / norm)
        sgd.step()
        assert leader.status()["version"] == 1
        for n, p in global_params(leader, token).items():
            torch.testing.assert_close(p, ref[n].detach().bfloat16().float(), rtol=0, atol=1e-6)
        for n, p in model.named_parameters():  # the new global values plus what was trained while streaming
            want = ref[n].detach().bfloat16().float() + (local[n] - snapshot[n])
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-5)
        assert c._stream is not None  # the next stream started at once
        assert leader.status()["tokens"] == H * 10  # the first push counted the first H steps' tokens only
        assert c.tokens_pending == H * 10  # those of the steps taken while it streamed go into the next
        c.close()


def test_rounds_do_not_wait_for_a_stream_in_flight(tmp_path):
    with in_process_ps(tmp_path, push_timeout_s=300.0) as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=8, token=token, name="a",
                        push_codec="topk:0.05", fragments=8)
        b = OuterClient(build_model(MODEL, 2), leader.address, inner_steps=1, token=token, name="b",
                        round_timeout_s=5.0)
        for i in range(8):
            perturb(a.model, i)
            a.step(tokens=10)
        assert a._stream is not None
        perturb(b.model, 0)
        assert b.step(tokens=10), "b's round waited for a's streamed push"
        assert a._stream is not None and leader.status()["version"] == 1
        for i in range(8):
            a.step(tokens=10)
        assert leader.status()["version"] >= 2 and a.stats["pushed"] == 1
        a.close()
        b.close()


def test_fragments_are_bounded_by_the_inner_steps(tmp_path):
    with pytest.raises(ValueError, match="fragments=5"):
        OuterClient(build_model(MODEL, 1), "127.0.0.1:1", inner_steps=4, token=None, token_file="x", fragments=5)
