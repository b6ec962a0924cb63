"""A follower's push state machine (dips/follower_state.py) without sockets or threads: a push
goes staged -> sealed (on disk, its pseudo-gradient norm) -> applied by a round -> retired by a
checkpoint, and every refusal names what was wrong. Values are checked against hand-computed
ones (the Nesterov rule of torch.optim.SGD written out)."""
from __future__ import annotations

import math

import pytest
import torch

from dips.follower_disk import FollowerDisk
from dips.follower_state import STALE_UNSEALED_S, FollowerState
from dips.layout import ModelLayout
from dips.outer_optimizer import NesterovOuter

LR, MU = 0.5, 0.9


@pytest.fixture
def follower(tmp_path):
    layout = ModelLayout.of_specs([("layers.0.w", (2, 3)), ("layers.1.w", (4,))])
    gen = torch.Generator().manual_seed(0)
    initial = {t.name: torch.randn(t.shape, generator=gen) for u in layout.units for t in u.tensors}
    state = FollowerState(FollowerDisk(tmp_path), layout, range(0, 2), NesterovOuter(LR, MU), max_unsealed_pushes=2,
                          name="follower 0")
    state.load(initial)
    return state, initial, tmp_path


def pushed(initial: dict, shift: float) -> dict:
    """A cluster's parameters: the base moved by `shift`, in BF16 as pushed."""
    return {n: (t.to(torch.bfloat16).float() - shift).to(torch.bfloat16) for n, t in initial.items()}


def stage_all(state: FollowerState, push: str, params: dict, base: int = 0, units=(0, 1)) -> None:
    for u in units:
        names = [t.name for t in state.layout.units[u].tensors]
        state.stage(u, push, base, "c", {n: params[n] for n in names})


def test_a_push_is_staged_sealed_applied_and_retired(follower):
    state, initial, directory = follower
    p = pushed(initial, 0.25)
    stage_all(state, "p1", p, units=(0,))
    assert "push p1 is partial: follower 0 lacks units [1]" in state.seal("p1")["err"]
    stage_all(state, "p1", p, units=(1,))
    sealed = state.seal("p1")
    # the pseudo-gradient: the BF16 base minus what was pushed
    base = {n: t.to(torch.bfloat16).float() for n, t in initial.items()}
    delta = {n: base[n] - p[n].float() for n in base}
    assert sealed["ok"] and sealed["norm"] == pytest.approx(math.sqrt(sum(float((d.double() ** 2).sum()) for d in delta.values())))
    assert (directory / "pushes" / "p1.pt").exists() and not state.staged
    assert state.seal("p1")["norm"] == sealed["norm"]  # sealing again answers the same

    with pytest.raises(ValueError, match="follower 0 is at version 0; cannot apply 2"):
        state.apply({"version": 2, "weights": {"p1": 1.0}})
    reply, applied = state.apply({"version": 1, "weights": {"p1": 0.5}, "keep": []})
    assert applied and reply == {"version": 1} and not state.sealed
    # SGD(nesterov): buf = g (first step); p -= lr * (g + mu * buf)
    for n, theta in state.theta.items():
        g = 0.5 * delta[n]
        torch.testing.assert_close(theta, initial[n] - LR * (g + MU * g), rtol=1e-6, atol=1e-6)
    assert sorted(state.bases) == [1]  # nothing needs base 0 any more
    assert state.apply({"version": 1, "weights": {}}) == ({"version": 1}, False)  # a replayed round: no change

    assert state.checkpointed(1) == ["p1"] and state.checkpointed(1) == []


def test_refusals_name_what_is_wrong(follower):
    state, initial, _ = follower
    p = pushed(initial, 1.0)
    with pytest.raises(ValueError, match=r"push p1: base version 7 is not held \(held: \[0\]\)"):
        stage_all(state, "p1", p, base=7)
    stage_all(state, "p1", p)
    state.seal("p1")
    with pytest.raises(ValueError, match="push p1 is already sealed"):
        stage_all(state, "p1", p)
    stage_all(state, "p2", p, units=(0,))
    stage_all(state, "p3", p, units=(0,))
    with pytest.raises(ValueError, match="2 pushes are staged and not sealed.*--max-unsealed-pushes"):
        stage_all(state, "p4", p, units=(0,))
    assert state.seal("nope") == {"ok": False, "err": "follower 0 holds no unit of push nope"}
    with pytest.raises(ValueError, match="push nope is not sealed on follower 0"):
        state.prepare({"nope": 1.0})
    with pytest.raises(ValueError, match=r"version 3 is not held \(held: \[0\]\)"):
        state.pull(3, [0])
    with pytest.raises(ValueError, match="unit 5 is not owned by follower 0"):
        state.pull(0, [5])


def test_stale_and_discarded_pushes_are_forgotten(follower):
    state, initial, _ = follower
    p = pushed(initial, 1.0)
    stage_all(state, "old", p, units=(0,))
    stage_all(state, "sealed", p)
    state.seal("sealed")
    state.drop_stale(state.staged["old"]["t"] + STALE_UNSEALED_S / 2)
    assert list(state.staged) == ["old"]
    state.drop_stale(state.staged["old"]["t"] + STALE_UNSEALED_S + 1)
    assert not state.staged
    state.discard(["sealed"])
    assert not state.sealed and state.checkpointed(0) == ["sealed"]


def test_a_restart_finds_the_sealed_pushes_and_the_checkpoint(follower, tmp_path):
    state, initial, directory = follower
    stage_all(state, "p1", pushed(initial, 1.0))
    state.seal("p1")
    state.apply({"version": 1, "weights": {"p1": 1.0}})
    disk = FollowerDisk(directory)
    disk.save_checkpoint(state.snapshot(), keep=3)  # as the follower's checkpoint thread does
    for push in state.checkpointed(1):
        disk.delete_push(push)
    stage_all(state, "p2", pushed(initial, 2.0), base=1)
    state.seal("p2")
    again = FollowerState(disk, state.layout, range(0, 2), NesterovOuter(LR, MU), 2, "follower 0")
    again.load(None)
    assert again.version == 1 and list(again.sealed) == ["p2"] and sorted(again.bases) == sorted(state.bases)
    assert all(torch.equal(again.theta[n], state.theta[n]) for n in state.theta)
