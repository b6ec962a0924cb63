"""What a parameter shard admits (volunteer/shard.py), driven by hand without sockets: gradients
only for rows a frontal server handed to the pushing client (or rows the shard asked to be
redone), only near the step being summed, of a believable size; pulls kept one per client."""
from __future__ import annotations

import pytest
import torch

from volunteer.job import flat_parameters
from volunteer.local import loopback_job
from volunteer.roster import Roster
from volunteer.shard import MAX_STEPS_AHEAD, NORM_BETA, NORM_WARMUP, ParameterShard
from volunteer.wire import Message, ProtocolError

TINY = dict(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=16)
A, B = b"c:a", b"c:b"


class Shard:
    """Shard 0 of stage 0 of a job with one frontal server, and what it sent."""

    def __init__(self, steps: int = 12):
        self.job = loopback_job(TINY, [(0, 1), (1, 2)], [(1, 1), (1, 1)], batch=4, microbatches=1, seq=4,
                                steps=steps, task_timeout=60.0, liveness=60.0, push_timeout=60.0)
        self.now = 0.0
        self.roster = Roster(self.job.liveness, lambda: self.now)
        for c in (A, B):
            self.roster.hello(c, 1e12)
        initial = torch.cat([p.detach().reshape(-1) for p in flat_parameters(self.job.stage_module(0))])
        self.to_clients: list[tuple[bytes, Message]] = []
        self.shard = ParameterShard(self.job, 0, 0, initial, self.roster,
                                    lambda c, m: self.to_clients.append((c, m)), lambda s, m: None, lambda: self.now)

    def seg_done(self, step: int, accepted: dict[bytes, list[list[int]]]) -> None:
        self.shard.on_segment_done(Message("SEG_DONE", {"step": step, "frontal": 0,
                                                         "accepted": {c.decode(): r for c, r in accepted.items()}}))

    def push(self, client: bytes, step: int, rows, grad: torch.Tensor | None = None) -> dict | None:
        """The shard's answer to a push (None while it waits for its step's SEG_DONE)."""
        before = len(self.to_clients)
        grad = torch.full((self.shard.size,), 1e-3) if grad is None else grad
        self.shard.on_push(client, Message("PUSH", {"step": step, "rows": rows}, [grad]))
        answers = [m.fields for c, m in self.to_clients[before:] if m.op == "PUSHED"]
        return answers[-1] if answers else None


def test_only_rows_handed_to_the_client_are_counted():
    s = Shard()
    s.seg_done(0, {A: [[0, 2]], B: [[2, 4]]})
    refused = s.push(A, 0, [[2, 4]])  # B's rows
    assert not refused["ok"] and "not handed to this client" in refused["reason"]
    assert s.push(A, 0, [[0, 2]])["ok"] and s.push(B, 0, [[2, 4]])["ok"]
    assert s.shard.version == 1


def test_a_push_that_overtakes_its_seg_done_waits_for_it():
    s = Shard()
    assert s.push(A, 0, [[0, 2]]) is None and s.shard.version == 0  # held, not refused, not counted
    assert s.push(B, 0, [[3, 4]]) is None
    s.seg_done(0, {A: [[0, 2]], B: [[2, 3]]})
    answers = {c: m.fields for c, m in s.to_clients if m.op == "PUSHED"}
    assert answers[A]["ok"] and not answers[B]["ok"] and "not handed" in answers[B]["reason"]
    assert s.push(B, 0, [[2, 3]])["ok"] and s.shard.version == 0  # row 3 is nobody's yet


def test_rows_the_shard_asked_to_redo_may_come_from_anyone():
    s = Shard()
    s.seg_done(0, {A: [[0, 4]]})
    s.now += 1000.0  # A is overdue: the shard asks for its rows again
    s.shard.tick()
    assert s.push(B, 0, [[0, 4]])["ok"] and s.shard.version == 1


def test_a_huge_finite_gradient_is_refused_and_the_shard_stays_finite():
    s = Shard()
    s.seg_done(0, {A: [[0, 2]], B: [[2, 4]]})
    poisoned = s.push(A, 0, [[0, 2]], torch.full((s.shard.size,), 1e30))
    assert not poisoned["ok"] and "gradient norm per row" in poisoned["reason"]
    s.now += 1000.0
    s.shard.tick()  # A's rows are redone by B
    assert s.push(B, 0, [[0, 2]])["ok"] and s.push(B, 0, [[2, 4]])["ok"]
    assert s.shard.version == 1 and torch.isfinite(s.shard.param).all()
    state = s.shard.optimizer.state[s.shard.param]
    assert torch.isfinite(state["exp_avg_sq"]).all()


def test_after_warmup_a_push_far_above_the_recent_median_is_refused():
    s = Shard()
    honest = torch.full((s.shard.size,), 1e-3)
    for step in range(NORM_WARMUP // 2):
        s.seg_done(step, {A: [[0, 2]], B: [[2, 4]]})
        assert s.push(A, step, [[0, 2]], honest)["ok"] and s.push(B, step, [[2, 4]], honest * 1.5)["ok"]
    step = s.shard.version
    s.seg_done(step, {A: [[0, 2]], B: [[2, 4]]})
    big = s.push(A, step, [[0, 2]], honest * (2 * NORM_BETA))
    assert not big["ok"] and "exceeds" in big["reason"]
    assert s.push(A, step, [[0, 2]], honest * 2)["ok"]  # a believable one is still counted


def test_pushes_and_pulls_for_the_far_future_are_refused_not_kept():
    s = Shard()
    far = s.push(A, MAX_STEPS_AHEAD + 1, [[0, 4]])
    assert not far["ok"] and "ahead" in far["reason"] and not s.shard.grads
    with pytest.raises(ProtocolError, match="version"):
        s.shard.on_pull(A, Message("PULL", {"version": MAX_STEPS_AHEAD + 1}))
    for _ in range(5000):
        s.shard.on_pull(A, Message("PULL", {"version": 1}))
    assert len(s.shard.pulls) == 1  # one client waits for one version
