"""Compressed pushes and pulls end to end in one process: the PS applies exactly the decoded
pseudo-gradients (a reference run of torch.optim.SGD on them), the residual carries what the
wire dropped into the next push and survives a restart, a pull adds the decoded difference
between the new version and what the cluster holds (so what one pull drops comes with the next),
and payloads that do not fit their unit are refused with nothing applied."""
import json
import math
import struct
import time

import pytest
import torch

from dips.client import OuterClient
from dips.codec import CHUNK, Codec
from dips.follower_disk import FollowerDisk
from dips.model import build_model

from pscluster import MODEL, global_params, in_process_ps, perturb


def _flat(values: dict, unit) -> torch.Tensor:
    return torch.cat([values[t.name].reshape(-1) for t in unit.tensors])


def _unflat(flat: torch.Tensor, unit) -> dict:
    sizes = [t.numel for t in unit.tensors]
    return {t.name: part.view(t.shape) for t, part in zip(unit.tensors, flat.split(sizes))}


@pytest.mark.parametrize("push,pull", [("int8", "bf16"), ("topk:0.05", "int8"), ("int4", "int4"),
                                      ("sparse:0.05", "sparse:0.05"), ("sign", "sign"), ("sign:0.5", "sign"),
                                      ("sparseloco:0.05", "nonzero"), ("sparseloco:0.05", "sparsebf16:0.05")])
def test_compressed_rounds_match_a_reference_with_error_feedback(tmp_path, push, pull):
    """Three rounds: the cluster pushes codec(held - local + decay * residual) (decay 0.95 for
    SparseLoCo's accumulator, 1 otherwise); the reference applies the same decoded values through
    clip-to-1 and torch.optim.SGD(nesterov), keeps the dropped part as the next residual, and the
    held values move by codec(new - held) at each pull."""
    pc, qc = Codec.parse(push), Codec.parse(pull)
    theta = {n: p.detach().clone() for n, p in build_model(MODEL, 0).named_parameters()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)
    with in_process_ps(tmp_path) as (leader, _, token):
        model = build_model(MODEL, 99)
        c = OuterClient(model, leader.address, inner_steps=1, token=token, name="c", push_codec=push,
                        pull_codec=pull, state_dir=tmp_path / "state")
        units = c.layout.units
        held = {n: t.bfloat16().float() for n, t in theta.items()}  # joined: a whole pull, BF16 ...
        if qc.whole == Codec("int8"):  # ... or int8 codes of the values for a compressed pull
            for unit in units:
                held.update(_unflat(Codec.parse("int8").round_trip(_flat(held, unit))[1], unit))
        residual = {u: torch.zeros(sum(t.numel for t in unit.tensors)) for u, unit in enumerate(units)}
        for rnd in range(3):
            perturb(model, rnd)
            local = {n: p.detach().clone() for n, p in model.named_parameters()}
            # the filter's norm: the sum over followers of the pseudo-gradient's norm on their units
            sent_norm = sum(sum(float(((held[t.name] - local[t.name]).double() ** 2).sum())
                                for u in range(a, b) for t in units[u].tensors) ** 0.5 for a, b in c.plan["units"])
            decoded = {}
            for u, unit in enumerate(units):
                x = _flat(held, unit) - _flat(local, unit) + residual[u] * (0.95 if pc.kind == "sparseloco" else 1.0)
                dec = pc.round_trip(x)[1]
                residual[u] = x - dec
                decoded.update(_unflat(dec, unit))
            norm = torch.sqrt(sum((d.double() ** 2).sum() for d in decoded.values())).item()
            for n, r in ref.items():
                r.grad = decoded[n] * min(1.0, 1.0 / norm)
            sgd.step()
            new = {n: r.detach().bfloat16().float() for n, r in ref.items()}
            for unit in units:  # what the cluster holds after its pull
                change = _flat(new, unit) - _flat(held, unit)
                got = _flat(held, unit) + qc.round_trip(change)[1] if qc.lossy else _flat(new, unit)
                held.update(_unflat(got, unit))
            assert c.step(tokens=100)
            # the outlier filter scored the uncompressed pseudo-gradient's norm, as the cluster reported it
            scored = [p.norm for p in leader.state.pushes.values() if p.cluster == "c"][-1]
            assert scored == pytest.approx(sent_norm, rel=1e-9)
            for u in range(len(units)):
                torch.testing.assert_close(c.residual[u], residual[u], rtol=0, atol=1e-6)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.detach(), held[n], rtol=0, atol=1e-5)
        for n, p in global_params(leader, token).items():
            torch.testing.assert_close(p, ref[n].detach().bfloat16().float(), rtol=0, atol=1e-6)
        assert c.stats["push_bytes"] == 3 * sum(pc.payload_bytes(sum(t.numel for t in u.tensors)) for u in units)
        c.close()
        # the residual is the cluster's state: a restarted worker resumes it
        again = OuterClient(build_model(MODEL, 5), leader.address, inner_steps=1, token=token, name="c2",
                            push_codec=push, pull_codec=pull, state_dir=tmp_path / "state", join=False)
        assert set(again.residual) == set(residual)
        for u, r in residual.items():
            torch.testing.assert_close(again.residual[u], r, rtol=0, atol=1e-6)
        again.close()


def test_a_residual_of_another_model_is_not_resumed(tmp_path):
    with in_process_ps(tmp_path) as (leader, _, token):
        c = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="c",
                        push_codec="int8", state_dir=tmp_path / "state", join=False)
        torch.save({"fingerprint": "0" * 16, "units": {0: torch.ones(3)}}, tmp_path / "state-other.pt")
        (tmp_path / "state").mkdir()
        (tmp_path / "state-other.pt").rename(tmp_path / "state" / "residual-w0.pt")
        c.close()
        again = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="c",
                            push_codec="int8", state_dir=tmp_path / "state", join=False)
        assert again.residual == {}
        again.close()


def test_a_pull_since_a_version_no_longer_held_falls_back_to_whole_values(tmp_path):
    with in_process_ps(tmp_path) as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="a",
                        push_codec="int8", pull_codec="int8")
        units = range(len(a.layout.units))
        assert a.transfer.pull(0, units, Codec.parse("int8"), since=7) is None and a.transfer.refused
        for rnd in range(2):
            perturb(a.model, rnd)
            assert a.step(tokens=10)
        a.base = 0  # as if it had missed versions the followers no longer keep
        a._held = {n: torch.zeros_like(t) for n, t in a._held.items()}
        perturb(a.model, 5)
        assert a.step(tokens=10)
        latest = global_params(leader, token)
        whole = {}  # a whole int8 pull: the global values' int8 codes, decoded
        for unit in a.layout.units:
            whole.update(_unflat(Codec.parse("int8").round_trip(_flat(latest, unit))[1], unit))
        for n, p in a.model.named_parameters():
            assert torch.equal(p.detach(), whole[n])
        a.close()


def test_a_seeded_ps_takes_the_seed_as_parameters_from_a_compressing_cluster(tmp_path):
    with in_process_ps(tmp_path, model=None, seed_from_cluster=True) as (leader, followers, token):
        model = build_model(MODEL, 4)
        want = {n: p.detach().bfloat16().float() for n, p in model.named_parameters()}
        c = OuterClient(model, leader.address, inner_steps=1, token=token, name="s", push_codec="topk:0.05",
                        pull_codec="int8", join=False)
        assert c.join(30)
        for n, p in global_params(leader, token).items():
            assert torch.equal(p, want[n])
        perturb(model, 1)
        assert c.step(tokens=10) and c.stats["push_bytes"] > 0
        c.close()


def test_sealed_delta_pushes_read_back_from_disk(tmp_path):
    disk = FollowerDisk(tmp_path)
    delta = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    disk.save_push("p1", 3, delta, "delta", 2.5)
    disk.save_push("p2", 4, {"a": torch.randn(2).bfloat16()})
    got = disk.load_pushes()
    assert set(got["p1"]) == {"base", "delta", "sqnorm"} and got["p1"]["base"] == 3 and got["p1"]["sqnorm"] == 2.5
    assert all(torch.equal(got["p1"]["delta"][n], delta[n]) for n in delta)
    assert set(got["p2"]) == {"base", "params", "sqnorm"} and got["p2"]["sqnorm"] is None


# ------------------------------------------------------------------ hostile payloads
def _mutations(codec: Codec, n: int):
    """Each way a compressed payload can fail to fit a unit of ``n`` values, and the words the
    refusal must hold."""
    def scale(p: bytes, value: float) -> bytes:
        at = (4 * codec.kept(n) if codec.kind == "topk"
              else len(p) // 10 if codec.kind == "sign" and codec.density else 0)  # sign:F: 40 bytes a block
        return p[:at] + struct.pack("<f", value) + p[at + 4:]

    def index(p: bytes, value: int) -> bytes:
        return p[:4] + struct.pack("<i", value) + p[8:]

    cases = {"short": (lambda p: p[:-1], "bytes of"), "long": (lambda p: p + b"\0", "bytes of")}
    m = math.ceil(n / CHUNK)
    if codec.kind == "sparsebf16":  # no scales: its first value (BF16, after the k indices)
        v = 2 * codec.kept(n)
        cases["nan value"] = (lambda p: p[:v] + struct.pack("<H", 0x7FC0) + p[v + 2:], "value nan")
        cases["inf value"] = (lambda p: p[:v] + struct.pack("<H", 0xFF80) + p[v + 2:], "value -inf")
    else:
        cases["nan scale"] = (lambda p: scale(p, float("nan")), "scale nan")
        cases["inf scale"] = (lambda p: scale(p, float("inf")), "scale inf")
    if codec.kind == "topk":
        cases["index out of range"] = (lambda p: index(p, n), f"index {n} out of range")
        cases["index repeated"] = (lambda p: p[:4] + p[:4] + p[8:], "strictly increasing")
    if codec.kind in ("sparse", "sparseloco", "sparsebf16"):  # the first chunk's second index (chunks of 4096)
        at = {"sparse": 4, "sparseloco": 8, "sparsebf16": 0}[codec.kind] * m + 2
        cases["index out of range"] = (lambda p: p[:at] + struct.pack("<H", min(n, CHUNK)) + p[at + 2:],
                                       "out of range")
        cases["index repeated"] = (lambda p: p[:at] + p[at - 2:at] + p[at + 2:], "strictly increasing")
    if codec.kind == "sign" and codec.density:  # the sent blocks' indices come first
        cases["block out of range"] = (lambda p: index(p, math.ceil(n / 256)), "out of range")
        cases["block repeated"] = (lambda p: p[:4] + p[:4] + p[8:], "strictly increasing")
    elif codec.kind == "sign" and n % 8:
        cases["padding bit"] = (lambda p: p[:-1] + bytes([p[-1] | 0x80]), "padding bits")
    return cases


@pytest.mark.parametrize("spec", ["int8", "int4", "topk:0.05", "sparse:0.05", "sign", "sign:0.5", "sparseloco:0.05",
                                  "sparsebf16:0.05"])
def test_compressed_payloads_that_do_not_fit_are_refused_with_nothing_applied(tmp_path, spec):
    codec = Codec.parse(spec)
    with in_process_ps(tmp_path) as (leader, followers, token):
        c = OuterClient(build_model(MODEL, 3), leader.address, inner_steps=1, token=token, name="c")
        before = global_params(leader, token)
        unit = 0
        spec_u = c.layout.units[unit]
        n = sum(t.numel for t in spec_u.tensors)
        good = codec.encode(torch.randn(n) * 1e-3)
        addr = c.plan["followers"][0]
        for what, (mutate, words) in _mutations(codec, n).items():
            reply = c.speaker.leader.call("PushRequest", **c.speaker._me(), tokens=1, base=c.base,
                                          workers={"0": list(range(len(c.layout.units)))})
            task = {"push": reply["push"], "cluster": c.speaker.cluster_id, "base": c.base}
            req = c.transfer.send_payload(task, unit, addr, mutate(good), spec, sqnorm=1.0)
            acks = [h for h, _ in c.transfer.replies(addr, {req})]
            assert acks and not acks[0]["ok"] and words in acks[0]["err"], (what, acks)
            assert not any(f.state.staged for f in followers), what
        # a codec the follower does not know, and a compressed push to a PS awaiting its seed
        reply = c.speaker.leader.call("PushRequest", **c.speaker._me(), tokens=1, base=c.base,
                                      workers={"0": list(range(len(c.layout.units)))})
        task = {"push": reply["push"], "cluster": c.speaker.cluster_id, "base": c.base}
        req = c.transfer.send_payload(task, unit, addr, good, "int3", sqnorm=1.0)
        acks = [h for h, _ in c.transfer.replies(addr, {req})]
        assert not acks[0]["ok"] and "codec 'int3'" in acks[0]["err"]
        # a pull's form, whose size follows from its counts, does not carry a push
        req = c.transfer.send_payload(task, unit, addr, Codec.parse("nonzero").encode(torch.randn(n)), "nonzero",
                                      sqnorm=1.0)
        acks = [h for h, _ in c.transfer.replies(addr, {req})]
        assert not acks[0]["ok"] and "codec nonzero carries pulls" in acks[0]["err"]
        for sqnorm in (None, -1.0, 1e301, "1"):  # the reported norm: present, a finite number >= 0
            req = c.transfer.send_payload(task, unit, addr, good, spec, sqnorm=sqnorm)
            acks = [h for h, _ in c.transfer.replies(addr, {req})]
            assert not acks[0]["ok"] and "sqnorm" in acks[0]["err"], (sqnorm, acks)
        assert c.speaker.leader.call("PushDone", **c.speaker._me(), push=reply["push"])["status"] == "failed"
        time.sleep(0.1)
        assert leader.status()["version"] == 0
        after = global_params(leader, token)
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert all(not f.state.sealed and not f.state.staged for f in followers)
        c.close()


def test_hostile_compressed_pull_headers_are_refused(tmp_path):
    with in_process_ps(tmp_path) as (leader, followers, token):
        c = OuterClient(build_model(MODEL, 3), leader.address, inner_steps=1, token=token, name="c",
                        pull_codec="int8")
        addr, units = c.plan["followers"][0], list(range(*c.plan["units"][0]))
        sock = c.transfer.sock(addr)
        for extra, words in [({"codec": "int8", "cluster": "c"}, "since"),
                             ({"codec": "int8", "since": 0}, "names its cluster"),
                             ({"codec": "int8", "since": 5, "cluster": "c"}, "what cluster 'c' holds"),
                             ({"codec": "int8", "since": 0, "cluster": "x" * 200}, "cluster"),
                             ({"codec": "int8", "since": -2, "cluster": "c"}, "since"),
                             ({"codec": "topk:2"}, "top-k density"), ({"codec": ["int8"]}, "codec")]:
            sock.send_multipart([json.dumps({"op": "pull", "req": "r", "version": 0, "units": units,
                                             **extra}).encode()])
            assert sock.poll(3000)
            header = json.loads(sock.recv_multipart()[0])
            assert not header["ok"] and words in header["err"], (extra, header)
        assert c.transfer.pull(0, range(len(c.layout.units)), Codec.parse("int8"), since=0, cluster="c") is not None
        c.close()


def test_what_a_pull_drops_comes_with_the_next(tmp_path):
    """Pulls of one version in top-k 5%: each sends the largest part of what the cluster still
    lacks, so the values it holds close in on the global ones (without the followers' record of
    what it holds, a second pull of the same version would carry nothing)."""
    codec = Codec.parse("topk:0.05")
    with in_process_ps(tmp_path) as (leader, _, token):
        a = OuterClient(build_model(MODEL, 1), leader.address, inner_steps=1, token=token, name="a",
                        push_codec="int8", pull_codec=str(codec))
        perturb(a.model, 0, scale=0.05)
        assert a.step(tokens=10)
        target = global_params(leader, token)
        held = dict(a._held)
        units = range(len(a.layout.units))

        def gap() -> float:
            return sum(float((held[n] - target[n]).norm() ** 2) for n in target) ** 0.5

        gaps = [gap()]
        assert gaps[0] > 0  # one top-k pull did not bring it all
        for _ in range(30):
            change = a.transfer.pull(1, units, codec, since=1, cluster="a")
            held = {n: held[n] + change[n] for n in held}
            gaps.append(gap())
        assert all(b <= g for g, b in zip(gaps, gaps[1:])) and gaps[-1] < 0.05 * gaps[0], gaps
        a.close()


@pytest.mark.parametrize("pull", ["sign", "sign:0.5", "sparse:0.05", "nonzero", "sparsebf16:0.05"])
def test_followers_record_exactly_what_the_cluster_holds(tmp_path, pull):
    """After a compressed join and two rounds of compressed pulls, each follower's record of what
    the cluster holds (its view) equals the cluster's held values bit for bit: both add the same
    decoded FP32 values, so the next difference is taken from exactly what the cluster has."""
    with in_process_ps(tmp_path) as (leader, followers, token):
        c = OuterClient(build_model(MODEL, 2), leader.address, inner_steps=1, token=token, name="c",
                        push_codec="sign", pull_codec=pull)
        for rnd in range(3):
            if rnd:
                perturb(c.model, rnd)
                assert c.step(tokens=10)
            for f, (start, stop) in zip(followers, c.plan["units"]):
                view = f.state.views[c.speaker.cluster_id][c.base]
                for u in range(start, stop):
                    assert torch.equal(view[u], _flat(c._held, c.layout.units[u])), (rnd, u)
        c.close()


def test_sparse_pushes_make_sparse_exact_pulls(tmp_path):
    """SparseLoCo's pushes with plain outer SGD (momentum 0): a round changes at most the entries
    the push kept, and a ``nonzero`` pull carries exactly the entries of the global BF16
    parameters that changed since the cluster's version (counted here from the parameters
    themselves), after which the cluster holds them bit for bit."""
    push = Codec.parse("sparseloco:0.05")
    with in_process_ps(tmp_path, outer_momentum=0.0) as (leader, _, token):
        c = OuterClient(build_model(MODEL, 4), leader.address, inner_steps=1, token=token, name="c",
                        push_codec=str(push), pull_codec="nonzero")
        sizes = [sum(t.numel for t in u.tensors) for u in c.layout.units]
        for rnd in range(3):
            before, pulled = global_params(leader, token), c.stats["pull_bytes"]
            perturb(c.model, rnd)
            assert c.step(tokens=10)
            after = global_params(leader, token)
            changed = sum(int((after[n] != before[n]).sum()) for n in after)
            assert 0 < changed <= sum(push.kept(n) for n in sizes), rnd
            assert c.stats["pull_bytes"] - pulled == sum(4 * math.ceil(n / CHUNK) for n in sizes) + 6 * changed
            for n, t in after.items():
                assert torch.equal(c._held[n], t), (rnd, n)
        c.close()


def test_sign_error_feedback_by_hand():
    """Two pushes of one block in signs with error feedback, worked by hand: x = [3, -1, 0.5, -0.5]
    sends its mean magnitude 1.25 with the signs and keeps [1.75, 0.25, -0.75, 0.75]; the next
    push of [0, 0, 0, 0] sends that residual: mean 0.875, signs +, +, -, +."""
    codec = Codec.parse("sign")
    x = torch.tensor([3.0, -1.0, 0.5, -0.5])
    dec = codec.round_trip(x)[1]
    assert dec.tolist() == [1.25, -1.25, 1.25, -1.25]
    residual = x - dec
    assert residual.tolist() == [1.75, 0.25, -0.75, 0.75]
    dec2 = codec.round_trip(torch.zeros(4) + residual)[1]
    assert dec2.tolist() == [0.875, 0.875, -0.875, 0.875]


def test_bounded_sparse_pulls_keep_the_view_exact_and_deliver_what_they_leave(tmp_path):
    """Three clusters push SparseLoCo 5% with plain outer SGD; cluster a pulls ``sparsebf16:0.02``,
    less than the union of the pushes that land between its pulls. Each pull is the codec's fixed
    size whatever that union holds; after it every follower's record of what a holds equals a's
    held values bit for bit; what a pull leaves stays in the difference, so further pulls of the
    same version bring a's values to the global BF16 ones exactly. A follower that restarted knows
    no view: a's next pull is whole (BF16) and the views agree again from there; so do they when
    the cluster restarts and joins again."""
    pull = Codec.parse("sparsebf16:0.02")
    with in_process_ps(tmp_path, outer_momentum=0.0) as (leader, followers, token):
        clients = [OuterClient(build_model(MODEL, 10 + i), leader.address, inner_steps=1, token=token, name=name,
                               push_codec="sparseloco:0.05", pull_codec=str(pull)) for i, name in enumerate("abc")]
        a = clients[0]
        sizes = [sum(t.numel for t in u.tensors) for u in a.layout.units]
        units = range(len(sizes))
        who = a.speaker.cluster_id

        def views_agree(c: OuterClient) -> None:
            for f, (start, stop) in zip(followers, c.plan["units"]):
                view = f.state.views[c.speaker.cluster_id][c.base]
                for u in range(start, stop):
                    assert torch.equal(view[u], _flat(c._held, c.layout.units[u])), u

        for rnd in range(3):
            for i, c in enumerate(reversed(clients)):  # a pushes last, after the others' rounds
                perturb(c.model, 10 * rnd + i)
                pulled = a.stats["pull_bytes"]
                assert c.step(tokens=10)
            assert a.stats["pull_bytes"] - pulled == sum(pull.payload_bytes(n) for n in sizes)
            views_agree(a)
        target = global_params(leader, token)
        assert any(not torch.equal(a._held[n], target[n]) for n in target)  # the pulls left some of it
        held, gaps = dict(a._held), []
        for _ in range(60):
            change = a.transfer.pull(a.base, units, pull, since=a.base, cluster=who)
            held = {n: held[n] + change[n] for n in held}
            gaps.append(sum(int((held[n] != target[n]).sum()) for n in target))
            if not gaps[-1]:
                break
        assert len(gaps) > 2 and gaps[-1] == 0 and all(b <= g for g, b in zip(gaps, gaps[1:])), gaps
        # a restarted follower knows no view: the pull is refused, a pulls whole and the views start again
        for f in followers:
            f.state.views.clear()
        perturb(a.model, 99)
        joins = a.stats["pulls"]
        assert a.step(tokens=10)
        assert a.stats["pulls"] - joins == 1
        views_agree(a)
        latest = global_params(leader, token)
        assert all(torch.equal(a._held[n], latest[n]) for n in latest)  # the whole pull: the BF16 values
        # a restarted cluster joins whole (BF16), its view starts there and its next pull is bounded again
        a.close()
        again = OuterClient(build_model(MODEL, 50), leader.address, inner_steps=1, token=token, name="a",
                            push_codec="sparseloco:0.05", pull_codec=str(pull))
        views_agree(again)
        perturb(again.model, 77)
        pulled = again.stats["pull_bytes"]
        assert again.step(tokens=10)
        assert again.stats["pull_bytes"] - pulled == sum(pull.payload_bytes(n) for n in sizes)
        views_agree(again)
        for c in [again] + clients[1:]:
            c.close()
