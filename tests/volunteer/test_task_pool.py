"""A frontal server's task pool driven message by message, without sockets or clients: what
it hands out, to whom, and when."""
from __future__ import annotations

import torch

from volunteer.frontal import FrontalServer
from volunteer.local import loopback_job
from volunteer.roster import Roster
from volunteer.wire import Message

TINY = dict(vocab_size=64, dim=8, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=4)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def middle_stage_server():
    """The only frontal server of the middle of three stages, holding step 0's input rows."""
    job = loopback_job(TINY, [(0, 1), (1, 2), (2, 3)], [(1, 1)] * 3, batch=8, microbatches=2, seq=4, steps=2,
                       task_timeout=30.0, liveness=3.0)
    clock, sent = Clock(), []
    fs = FrontalServer(job, 1, 0, Roster(job.liveness, clock), lambda c, m: sent.append((c, m)),
                       lambda s, m: None, clock)
    for mb in range(job.microbatches):
        lo, hi = job.microbatch_rows(mb)
        fs.on_activations(Message("ACT_FWD", {"step": 0, "mb": mb, "start": lo, "end": hi},
                                  [torch.zeros(job.boundary_shape(hi - lo))]))
    return fs, clock, sent


def tasks_given(sent, kind: str) -> list[tuple[bytes, tuple[int, int]]]:
    return [(c, (m.fields["start"], m.fields["end"])) for c, m in sent if m.op == "TASK" and m.fields["kind"] == kind]


def test_rows_asked_again_by_every_shard_are_redone_once_until_their_task_is_lost():
    """Each of a stage's shards asks every frontal server for the rows it lacks. A second ask
    arriving after the first redo task went out must not make a second task of the same rows
    (two clients would compute them and one push would be refused); once the task's client is
    gone, the next ask hands the rows out again."""
    fs, clock, sent = middle_stage_server()
    for c in (b"a", b"b"):
        fs.roster.hello(c, 1.0)
    redo = Message("REDO", {"step": 0, "rows": [[2, 4]]})
    fs.on_redo(redo)  # from shard 0
    fs.on_request(b"a", Message("REQ_TASK", {}))
    fs.on_redo(redo)  # from shard 1, after the task went to a
    for _ in range(8):  # b asks and takes forward work until the pool has only what a holds
        fs.on_request(b"b", Message("REQ_TASK", {}))
    assert tasks_given(sent, "redo") == [(b"a", (2, 4))]

    clock.now += fs.job.liveness + 1  # a vanished; b still speaks
    fs.roster.heard(b"b")
    fs.tick()
    fs.on_redo(redo)  # the shards ask again
    fs.on_request(b"b", Message("REQ_TASK", {}))
    assert tasks_given(sent, "redo") == [(b"a", (2, 4)), (b"b", (2, 4))]
