"""The PS against hostile peers holding the job token, and against a full disk: each input is
refused with a reason that names it, the servers go on answering honest peers, and their state
is unchanged. A structured fuzzer (hypothesis) sends headers drawn from the data plane's schema."""
import errno
import json
import logging
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dips import leader_state
from dips.client import OuterClient
from dips.model import build_model
from dips.rpc import RpcError

from pscluster import MODEL, global_params, in_process_ps, perturb

NESTED = b"[" * 20000


def _ask(client, address, header: bytes, payload: bytes | None = None, timeout_s: float = 3.0):
    """Send one raw data message; the reply header (None if none came)."""
    sock = client.transfer.sock(address)
    sock.send_multipart([header] + ([payload] if payload is not None else []))
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return json.loads(sock.recv_multipart()[0])


def _honest_pull_works(client) -> bool:
    return client.transfer.pull(client.base, range(len(client.layout.units))) is not None


@pytest.fixture
def ps(tmp_path):
    with in_process_ps(tmp_path) as (leader, followers, token):
        c = OuterClient(build_model(MODEL, 3), leader.address, inner_steps=1, token=token, name="c")
        yield leader, followers, token, c
        c.close()


def test_hostile_data_headers_are_refused_and_the_follower_serves_on(ps):
    leader, followers, token, c = ps
    addr, f0 = c.plan["followers"][0], followers[0]
    units = list(range(*c.plan["units"][0]))
    spec = c.layout.units[units[0]]
    good_push = dict(op="push", push="x-y", cluster="c", base=0, unit=units[0],
                     names=[t.name for t in spec.tensors], shapes=[list(t.shape) for t in spec.tensors],
                     dtype="bfloat16")
    refusals = {
        NESTED: "nested deeper",
        b"\xff\xfe": "not JSON",
        b'{"op":"push","req":"a","unit":Infinity}': "Infinity",
        b'{"op":"pull","req":"b","version":Infinity,"units":[0]}': "Infinity",
        b'{"op":"pull","req":"c","version":1e400,"units":[0]}': "1e400",
        json.dumps({"op": "pull", "req": "d", "version": 0, "units": [units[0]] * 5000}).encode(): "at most",
        json.dumps({"op": "pull", "req": "e", "version": 0, "units": [10 ** 30]}).encode(): "'units'",
        json.dumps({"op": "pull", "req": "f", "version": -1, "units": units}).encode(): "'version'",
        json.dumps({**good_push, "req": "g", "dtype": []}).encode(): "dtype",
        json.dumps({**good_push, "req": "h", "unit": 10 ** 20}).encode(): "'unit'",
        json.dumps({**good_push, "req": "i", "base": "0"}).encode(): "'base'",
        json.dumps({**good_push, "req": "j", "shapes": [[[[1]]]]}).encode(): "shapes",
        json.dumps({**good_push, "req": "k", "cluster": ["c"]}).encode(): "'cluster'",
        json.dumps({"op": ["push"], "req": "l"}).encode(): "unknown op",
    }
    for header, reason in refusals.items():
        reply = _ask(c, addr, header, b"")
        assert reply is not None, f"no answer to {header[:60]!r}"
        assert not reply["ok"] and reason in reply["err"], (header[:60], reply)
    assert _honest_pull_works(c) and f0.data.alive()
    assert not f0.state.staged and not f0.state.sealed
    t0 = time.monotonic()
    f0.data.stop()
    assert time.monotonic() - t0 < 10, "stopping the data server hung"


def test_one_pull_cannot_ask_for_more_than_the_followers_slice(ps):
    """A request of 1 KB must not buy a reply of many copies of the slice."""
    leader, followers, token, c = ps
    addr = c.plan["followers"][0]
    start, stop = c.plan["units"][0]
    reply = _ask(c, addr, json.dumps({"op": "pull", "req": "r", "version": 0,
                                      "units": [start, start]}).encode())
    assert not reply["ok"] and "more than once" in reply["err"]
    reply = _ask(c, addr, json.dumps({"op": "pull", "req": "r1", "version": 0,
                                      "units": list(range(start, stop)) * 2}).encode())
    assert not reply["ok"] and "at most" in reply["err"]
    reply = _ask(c, addr, json.dumps({"op": "pull", "req": "r2", "version": 0,
                                      "units": list(range(start, stop + 1))}).encode())
    assert not reply["ok"] and "'units'" in reply["err"]


header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
push_or_pull = st.fixed_dictionaries(
    {"op": st.sampled_from(["push", "pull", "other"]), "req": st.text(min_size=1, max_size=10)},
    optional={**{k: header_values for k in ("push", "cluster", "base", "unit", "names", "shapes", "dtype",
                                            "version", "units", "since", "sqnorm")},
              # the compressed forms: a real codec now and then, so their checks are reached too
              "codec": st.sampled_from(["int8", "int4", "topk:0.02", "sparse:0.03", "sign", "sign:0.5", "bf16",
                                             "sparseloco:0.02", "sparsebf16:0.04", "nonzero"]) | header_values})


def test_fuzzed_data_headers_never_stop_the_follower(ps):
    """Headers drawn from the data plane's schema, each field any JSON value: every one gets an
    answer (or, without an id, nothing), none stages anything, and honest pulls go on."""
    leader, followers, token, c = ps
    addr, f0 = c.plan["followers"][0], followers[0]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(push_or_pull)
    def one(header):
        reply = _ask(c, addr, json.dumps(header).encode(), b"\0" * 8)
        assert reply is not None and not reply["ok"]
        # answered under its id, or without one when the header is not JSON this protocol reads
        assert reply["req"] == header["req"] or (reply["req"] is None and "Infinity" in reply["err"])

    one()
    assert _honest_pull_works(c) and f0.data.alive() and not f0.state.staged


def test_hostile_control_requests_are_refused_without_filling_the_log(ps, caplog):
    leader, followers, token, c = ps
    rpc = c.speaker.leader
    with caplog.at_level(logging.WARNING):
        fn = rpc._channel.unary_unary("/dips.Leader/Status")
        for _ in range(30):  # anyone who reaches the port: refused, never logged with a traceback
            with pytest.raises(grpc.RpcError) as info:
                fn(NESTED, timeout=30)  # generous: the machine may be loaded
            assert info.value.code().name == "INVALID_ARGUMENT" and "nested" in info.value.details()
        t0 = time.monotonic()
        for wait in (b"NaN", b"Infinity", b"-1", b'"5"'):
            with pytest.raises(grpc.RpcError) as info:
                rpc._channel.unary_unary("/dips.Leader/WaitPush")(
                    json.dumps({"tok": token.secret, "push": "p"}).encode()[:-1] + b',"wait":' + wait + b"}", timeout=30)
            assert info.value.code().name == "INVALID_ARGUMENT"
            assert wait.decode().strip('"') in info.value.details() or "'wait'" in info.value.details()
        assert time.monotonic() - t0 < 4  # refused at once: none of them waited
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
    for fields, reason in [({"pull_s": float("nan")}, "NaN"), ({"pull_s": -1.0}, "pull_s"), ({"base": 1e300}, "base"),
                           ({"workers": {"x": [0]}}, "worker")]:
        request = dict(**c.speaker._me(), tokens=1, base=c.base,
                       workers={"0": list(range(len(c.layout.units)))}) | fields
        body = json.dumps({"tok": token.secret, **request}).encode()
        with pytest.raises(grpc.RpcError) as info:
            rpc._channel.unary_unary("/dips.Leader/PushRequest")(body, timeout=5)
        assert info.value.code().name == "INVALID_ARGUMENT" and reason in info.value.details()
    assert leader.state.pushes == {}
    assert c.step(tokens=10) and leader.status()["version"] >= 1


@pytest.mark.parametrize("tok", ["\ud800", "x\udfff" * 20, ["\ud800"], {"\ud800": 1}, 7, None, ""],
                         ids=["lone-high", "lone-low-repeated", "in-a-list", "as-a-key", "integer", "null", "empty"])
def test_a_malformed_token_is_refused_as_a_wrong_one(ps, caplog, tok):
    """JSON escapes can carry a lone surrogate, which is no Unicode text: as a token it is refused
    like any wrong token, never with a traceback."""
    leader, followers, token, c = ps
    with caplog.at_level(logging.WARNING):
        with pytest.raises(grpc.RpcError) as info:
            c.speaker.leader._channel.unary_unary("/dips.Leader/Status")(json.dumps({"tok": tok}).encode(), timeout=30)
        assert info.value.code().name == "PERMISSION_DENIED"
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"


@pytest.mark.parametrize("method,fields", [("WaitPush", {"push": "\ud800"}), ("Heartbeat", {"id": "c\udc80"}),
                                           ("RegisterCluster", {"name": "\ud800", "fingerprint": "f"}),
                                           ("Status", {"\ud800": 1}), ("Status", {"x": ["a", {"y": "\udfff"}]})])
def test_a_lone_surrogate_in_any_field_is_refused_before_it_reaches_a_handler(ps, caplog, method, fields):
    leader, followers, token, c = ps
    with caplog.at_level(logging.WARNING):
        with pytest.raises(grpc.RpcError) as info:
            c.speaker.leader._channel.unary_unary(f"/dips.Leader/{method}")(
                json.dumps({"tok": token.secret, **fields}).encode(), timeout=30)
        assert info.value.code().name == "INVALID_ARGUMENT" and "surrogate" in info.value.details()
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
    assert c.step(tokens=10)  # the leader serves on


def test_a_cluster_cannot_speak_for_another(ps):
    """Clusters share the job token; each id is bound to the secret its registration returned."""
    leader, followers, token, c = ps
    d = OuterClient(build_model(MODEL, 4), leader.address, inner_steps=1, token=token, name="d")
    as_c = {"id": "c", "secret": d.speaker.secret}
    for method, extra in [("Leave", {}), ("Heartbeat", {}),
                          ("PushRequest", {"tokens": 1, "base": 0, "workers": {"0": [0]}}),
                          ("PushDone", {"push": "p"})]:
        with pytest.raises(RpcError, match="PERMISSION_DENIED"):
            d.speaker.leader.call(method, **as_c, **extra)
        with pytest.raises(RpcError, match="PERMISSION_DENIED"):
            d.speaker.leader.call(method, id="c", **extra)  # no secret at all
    with pytest.raises(RpcError, match="PERMISSION_DENIED: cluster name 'c' is held"):
        d.speaker.leader.call("RegisterCluster", name="c", fingerprint=c.layout.fingerprint)
    assert "c" in leader.state.clusters
    assert c.step(tokens=10) and leader.status()["version"] >= 1
    d.close()


def test_a_commit_that_cannot_be_written_is_not_made(ps, monkeypatch):
    """The metadata write at a round's commit point fails (disk full): the version stays, nothing
    is applied, and the round closes once the disk has room again, as version 1."""
    leader, followers, token, c = ps
    real = leader_state.write_text_atomic
    failed = []

    def full_disk(path, data):
        if len(failed) < 3 and json.loads(data)["version"] > 0:
            failed.append([f.version for f in followers])
            raise OSError(errno.ENOSPC, f"writing {path} failed: No space left on device")
        real(path, data)

    monkeypatch.setattr(leader_state, "write_text_atomic", full_disk)
    before = global_params(leader, token)
    perturb(c.model, seed=1)
    assert c.step(tokens=10), "the push was not applied once the disk had room"
    assert failed == [[0, 0]] * 3
    assert leader.status()["version"] == leader.status()["complete"] == 1
    saved = json.loads(open(leader.state.cfg.metadata).read())
    assert saved["version"] == 1 and list(saved["decisions"]) == ["1"]
    assert [f.version for f in followers] == [1, 1]
    after = global_params(leader, token)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_torn_leader_metadata_is_a_clear_error_at_start(tmp_path):
    """The leader's metadata cut at any offset (a disk that lied about a flush): the leader does
    not start on half a state, and says which file and what to do."""
    from dips.auth import JobToken
    from dips.leader import Leader, LeaderConfig

    with in_process_ps(tmp_path / "ps") as (leader, followers, token):
        c = OuterClient(build_model(MODEL, 3), leader.address, inner_steps=1, token=token, name="c")
        perturb(c.model, seed=2)
        assert c.step(tokens=10)
        c.close()
    meta = tmp_path / "ps" / "leader.json"
    whole = meta.read_bytes()
    tokens = JobToken("j" * 32), JobToken("s" * 32)
    for cut in sorted({0, 1, len(whole) // 2, len(whole) - 1} | set(range(5, len(whole), max(1, len(whole) // 8)))):
        meta.write_bytes(whole[:cut])
        cfg = LeaderConfig(model=MODEL, n_followers=2, bind="127.0.0.1:0", metadata=str(meta), restart_followers=False)
        with pytest.raises(ValueError, match="leader metadata .* is unreadable"):
            Leader(cfg, *tokens)
