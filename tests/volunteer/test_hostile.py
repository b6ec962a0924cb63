"""Bad input to a stage server: refused with a logged reason, nothing applied, service goes on."""
from __future__ import annotations

import json
import logging
import secrets
import time

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from dips.auth import JobToken
from volunteer.join import fetch_job
from volunteer.local import LocalJob, loopback_job
from volunteer.security import JobKeys, connecting_socket
from volunteer.server import max_message_bytes
from volunteer.wire import Message

TINY = dict(vocab_size=256, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32)


@pytest.fixture(scope="module")
def served():
    job = loopback_job(TINY, [(0, 1), (1, 2)], [(1, 1), (1, 1)], batch=4, microbatches=1, seq=8, steps=1,
                       task_timeout=60.0, liveness=60.0, push_timeout=60.0)
    lj = LocalJob(job)
    yield job, lj
    lj.close()


class Raw:
    """A hand-driven client socket to one server, to send what a real client never would."""

    def __init__(self, job, address: str, keys: JobKeys, max_bytes: int | None = None):
        self.context = zmq.Context()
        self.sock = connecting_socket(self.context, keys, f"tcp://{address}", f"c:raw:{secrets.token_hex(4)}".encode(),
                                      max_bytes or max_message_bytes(job))

    def send(self, msg: Message | list[bytes]) -> None:
        self.sock.send_multipart(msg.encode() if isinstance(msg, Message) else msg)

    def recv(self, timeout: float = 10.0) -> Message:
        assert self.sock.poll(timeout * 1000), "no answer"
        return Message.decode(self.sock.recv_multipart())

    def recv_op(self, *ops: str) -> Message:
        """The next message with one of ``ops`` (step notices in between are skipped)."""
        while True:
            msg = self.recv()
            if msg.op in ops:
                return msg

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def server(lj, name):
    return next(s for s in lj.servers if s.name == name)


def address(job, name):
    return next(s.address for st in job.stages for s in st.servers if s.name == name)


def test_a_client_without_the_job_token_cannot_even_connect(served, caplog):
    job, lj = served
    wrong = JobKeys(JobToken("not-the-job-token-" + "x" * 16))
    with caplog.at_level(logging.WARNING, logger="volunteer.server"):
        with pytest.raises(TimeoutError, match="token file"):
            fetch_job(address(job, "f0.0"), wrong, timeout=2.0)
    assert "CURVE handshake failed" in caplog.text
    assert fetch_job(address(job, "f0.0"), lj.keys).to_dict() == job.to_dict()  # the server is unharmed


@pytest.mark.parametrize("frames, reason", [
    ([b"\xff\xfe not json"], "not JSON"),
    ([b'{"op": "HELLO"}'], "must be an object"),
    ([b'{"op": "PING", "fields": {}, "tensors": [{"dtype": "float32", "shape": [4]}]}', b"abc"], "needs 16 bytes"),
    ([b'{"op": "PING", "fields": {}, "tensors": [{"dtype": "complex64", "shape": [1]}]}', b"12345678"], "dtype"),
    ([b'{"op": "PING", "fields": {}, "tensors": [{"dtype": [], "shape": [1]}]}', b"1234"], "dtype"),
    ([b"[" * 20000], "nested deeper"),
    ([b'{"op": "HELLO", "fields": {"flops": Infinity}, "tensors": []}'], "Infinity"),
    ([b'{"op": "PING", "fields": {}, "tensors": []}', b"extra"], "declares 0 tensor"),
    ([b'{"op": "SHUTDOWN", "fields": {}, "tensors": []}'], "no 'SHUTDOWN' is expected"),
    ([b'{"op": "REQ_TASK", "fields": {}, "tensors": []}'], "has not said hello"),
    ([b'{"op": "ACT_FWD", "fields": {}, "tensors": []}'], "no 'ACT_FWD' is expected from a client"),
])
def test_malformed_messages_are_refused_with_the_reason_logged(served, caplog, frames, reason):
    job, lj = served
    raw = Raw(job, address(job, "f1.0"), lj.keys)
    try:
        with caplog.at_level(logging.WARNING, logger="volunteer.server"):
            before = server(lj, "f1.0").refused
            raw.send(frames)
            raw.send(Message("PING", {}))  # answered: the server carries on
            assert raw.recv().op == "PONG"
        assert server(lj, "f1.0").refused == before + 1
        assert reason in caplog.text
    finally:
        raw.close()


def test_an_oversize_message_drops_the_connection_before_it_is_read(served):
    job, lj = served
    limit = max_message_bytes(job)
    raw = Raw(job, address(job, "f1.0"), lj.keys, max_bytes=4 * limit)
    events = raw.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        raw.send(Message("PING", {}))
        assert raw.recv().op == "PONG"
        before = server(lj, "f1.0").refused
        raw.send([Message("PING", {}).encode()[0], b"\0" * (limit + 1)])
        assert events.poll(5000), "the server should drop the connection that sent an oversize frame"
        assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        assert server(lj, "f1.0").refused == before  # it was never decoded
    finally:
        raw.sock.disable_monitor()
        events.close(0)
        raw.close()
    again = Raw(job, address(job, "f1.0"), lj.keys)
    try:
        again.send(Message("PING", {}))
        assert again.recv().op == "PONG"
    finally:
        again.close()


def test_wrong_shape_nan_and_duplicate_results_are_refused_and_nothing_is_applied(served, caplog):
    job, lj = served
    fs, bs, shard = server(lj, "f1.0"), server(lj, "b0.0"), server(lj, "f1.0").shard
    # the last stage's only FS gets its input from stage 0's BS; feed that BS a micro-batch by hand
    producer = Raw(job, address(job, "b0.0"), lj.keys)
    worker = Raw(job, address(job, "f1.0"), lj.keys)
    pusher = Raw(job, address(job, "f1.0"), lj.keys)
    try:
        for r in (producer, worker):  # the worker alone on its stage: its tasks span the whole micro-batch
            r.send(Message("HELLO", {"flops": 1e12}))
        rows = (0, job.batch)
        good = torch.zeros(job.boundary_shape(job.batch))
        act = {"task": [0, 0, 0], "step": 0, "mb": 0, "start": 0, "end": job.batch}
        with caplog.at_level(logging.WARNING, logger="volunteer.server"):
            producer.send(Message("ACT", act, [torch.zeros(job.batch, job.seq, 7)]))
            producer.send(Message("ACT", act, [torch.full_like(good, float("nan"))]))
            producer.send(Message("PING", {}))
            assert producer.recv().op == "PONG"
        assert "expected float32[4, 8, 32]" in caplog.text and "NaN" in caplog.text
        assert not bs.role.segments or not bs.role.segments[(0, 0)].produced  # nothing stored
        producer.send(Message("ACT", act, [good]))  # now a good one: it flows on to stage 1's FS

        worker.send(Message("REQ_TASK", {}))
        task = worker.recv()
        assert task.op == "TASK" and (task.fields["start"], task.fields["end"]) == rows
        done = {"task": task.fields["task"], "attempt": task.fields["attempt"], "loss": 1.0}
        with caplog.at_level(logging.WARNING, logger="volunteer.server"):
            worker.send(Message("BWD_DONE", done, [torch.full_like(good, float("nan"))]))
            worker.send(Message("BWD_DONE", {**done, "loss": float("nan")}, [good]))
            worker.send(Message("PING", {}))
            assert worker.recv_op("PONG").op == "PONG"
        assert fs.role.tasks[tuple(task.fields["task"])].state == "running"  # neither was applied
        worker.send(Message("BWD_DONE", done, [good]))
        assert worker.recv_op("ACCEPT", "REFUSE").op == "ACCEPT"
        worker.send(Message("BWD_DONE", {**done, "loss": 5.0}, [good]))
        assert worker.recv_op("ACCEPT", "REFUSE").op == "REFUSE"  # the first completion stands; the loss is counted once
        assert fs.role.losses[0] == pytest.approx(1.0 / (job.batch * job.seq))

        pusher.send(Message("HELLO", {"flops": 1e12}))
        with caplog.at_level(logging.WARNING, logger="volunteer.server"):
            pusher.send(Message("PUSH", {"step": 0, "rows": [[0, job.batch]]}, [torch.full((shard.size,), float("nan"))]))
            pusher.send(Message("PUSH", {"step": 0, "rows": [[2, 1]]}, [torch.zeros(shard.size)]))
            pusher.send(Message("PUSH", {"step": 0, "rows": [[0, 2]]}, [torch.zeros(shard.size + 1)]))
            pusher.send(Message("PING", {}))
            assert pusher.recv_op("PONG").op == "PONG"
        assert shard.version == 0 and not shard.grads  # nothing summed
        assert "not sorted, disjoint and inside" in caplog.text
    finally:
        for r in (producer, worker, pusher):
            r.close()


def test_the_message_bound_is_the_largest_stage_or_micro_batch(served):
    job, _ = served
    for k in range(len(job.stages)):  # the count the bound is computed from, against the modules themselves
        assert job.stage_parameters(k) == sum(p.numel() for p in job.stage_module(k).parameters())
    largest = max(job.stage_parameters(k) for k in range(len(job.stages)))
    assert max_message_bytes(job) >= 4 * largest


@pytest.mark.parametrize("op", ["COMMITTED", "SEG_DONE", "GRAD"])
def test_a_client_cannot_pass_for_a_server(served, caplog, op):
    """A holder of the job token names itself s:<server>: its server-only messages are refused,
    because it did not authenticate with the servers' key."""
    job, lj = served
    context = zmq.Context()
    fake = connecting_socket(context, lj.keys, f"tcp://{address(job, 'b0.0')}", b"s:f0.0", max_message_bytes(job))
    try:
        with caplog.at_level(logging.WARNING, logger="volunteer.server"):
            before = server(lj, "b0.0").refused
            fake.send_multipart(Message(op, {"step": 0, "shard": 0, "frontal": 0, "accepted": {}}).encode())
            # the fake's message and the honest PING travel on two connections: no order between them
            deadline = time.monotonic() + 10
            while server(lj, "b0.0").refused == before and time.monotonic() < deadline:
                time.sleep(0.01)
            honest = Raw(job, address(job, "b0.0"), lj.keys)
            honest.send(Message("PING", {}))
            assert honest.recv().op == "PONG"
            honest.close()
        assert server(lj, "b0.0").refused == before + 1
        assert "without the servers' key" in caplog.text
        with pytest.raises(ValueError, match="server token"):
            connecting_socket(context, JobKeys(JobToken("x" * 32)), "tcp://127.0.0.1:1", b"s:x", 1024, as_server=True)
    finally:
        fake.close(0)
        context.term()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
OPS = ["JOIN", "PING", "HELLO", "LEAVE", "PUSH", "PULL", "REQ_TASK", "FWD_DONE", "BWD_DONE", "ACT", "GET_GRAD",
       "SEG_DONE", "COMMITTED", "HEARTBEAT", "?"]
headers = st.fixed_dictionaries({
    "op": st.sampled_from(OPS) | json_values,
    "fields": st.dictionaries(st.sampled_from(["step", "rows", "version", "task", "attempt", "loss", "flops", "mb",
                                               "start", "end", "accepted", "frontal"]), json_values, max_size=5)
              | json_values,
    "tensors": st.lists(st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "int64"]) | json_values,
                                               "shape": st.lists(st.integers(-1, 5), max_size=3) | json_values}),
                        max_size=2) | json_values})


@pytest.mark.parametrize("name", ["f1.0", "b0.0"])
def test_fuzzed_headers_never_stop_a_server(served, name):
    """Headers drawn from the protocol's schema with any JSON in any field, from a client that said
    hello: the server refuses or answers each, and still answers a PING after all of them."""
    job, lj = served
    raw = Raw(job, address(job, name), lj.keys)
    raw.send(Message("HELLO", {"flops": 1e12}))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(headers, st.lists(st.binary(max_size=64), max_size=2))
    def one(header, frames):
        raw.send([json.dumps(header).encode(), *frames])

    try:
        one()
        raw.send(Message("PING", {}))
        assert raw.recv_op("PONG").op == "PONG"
        assert all(t.is_alive() for t in lj.threads)
    finally:
        raw.close()
