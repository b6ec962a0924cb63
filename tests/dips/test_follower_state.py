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


def _apply_and_checkpoint(state: FollowerState, disk: FollowerDisk, initial: dict, version: int) -> None:
    """Round ``version`` of one push, then a checkpoint as the follower's thread writes it."""
    push = f"p{version}"
    stage_all(state, push, pushed(initial, 0.1 * version), base=version - 1)
    assert state.seal(push)["ok"]
    state.apply({"version": version, "weights": {push: 1.0}, "keep": []})
    disk.save_checkpoint(state.snapshot(), keep=3)
    for p in state.checkpointed(disk.oldest_kept_version()):
        disk.delete_push(p)


def test_a_torn_newest_checkpoint_falls_back_to_an_older_one_and_replays(follower):
    """Power lost while the newest checkpoint was written (a disk that lied about its flush): at
    every offset it was cut, the follower starts from the previous checkpoint, and replaying the
    round it lost gives the same parameters as before."""
    state, initial, directory = follower
    disk = FollowerDisk(directory)
    for version in (1, 2, 3):
        _apply_and_checkpoint(state, disk, initial, version)
    newest = disk.checkpoints()[-1]
    whole = newest.read_bytes()
    assert sorted(p.stem for p in (directory / "pushes").glob("*.pt")) == ["p2", "p3"]
    offsets = sorted({0, 1, len(whole) // 2, len(whole) - 1} | set(range(7, len(whole), len(whole) // 9)))
    for cut in offsets:
        newest.write_bytes(whole[:cut])
        again = FollowerState(FollowerDisk(directory), state.layout, range(0, 2), NesterovOuter(LR, MU), 2, "f")
        again.load(None)
        assert again.version == 2, f"cut at {cut}"
        assert list(again.sealed) == ["p3"] and again.applied_at == {"p2": 2}
        again.apply({"version": 3, "weights": {"p3": 1.0}, "keep": []})  # the leader's replay
        assert all(torch.equal(again.theta[n], state.theta[n]) for n in state.theta), f"cut at {cut}"
        assert all(torch.equal(again.momentum[n], state.momentum[n]) for n in state.momentum)


def test_a_checkpoint_the_disk_refuses_changes_nothing_and_is_retried(follower, monkeypatch):
    """The disk is full at a checkpoint: the follower's checkpoint thread reports it, keeps the
    sealed pushes and the older checkpoints, and writes the checkpoint once there is room."""
    import errno
    import threading

    from dips import follower as follower_module
    from dips import follower_disk

    state, initial, directory = follower
    disk = FollowerDisk(directory)
    _apply_and_checkpoint(state, disk, initial, 1)
    stage_all(state, "p2", pushed(initial, 0.2), base=1)
    state.seal("p2")
    state.apply({"version": 2, "weights": {"p2": 1.0}, "keep": []})
    real, refusals = follower_disk.write_atomic, []

    def full(path, write):
        if len(refusals) < 2:
            refusals.append(path)
            raise OSError(errno.ENOSPC, f"writing {path} failed: No space left on device")
        real(path, write)

    monkeypatch.setattr(follower_disk, "write_atomic", full)
    monkeypatch.setattr(follower_module, "CHECKPOINT_RETRY_S", 0.05)
    f = follower_module.Follower.__new__(follower_module.Follower)  # its checkpoint thread alone
    f.state, f.disk, f.index, f.keep_checkpoints = state, disk, 0, 3
    f._registering, f._stop, f._ckpt_wanted = threading.Lock(), threading.Event(), threading.Event()
    f._ckpt_wanted.set()
    thread = threading.Thread(target=f._checkpoint_loop, daemon=True)
    thread.start()
    deadline = 50
    while len(disk.checkpoints()) < 2 and deadline:
        threading.Event().wait(0.1)
        deadline -= 1
    f._stop.set()
    thread.join(5)
    assert len(refusals) == 2 and [FollowerDisk.version_of(p) for p in disk.checkpoints()] == [1, 2]
    assert not list(directory.glob(".*.tmp")) and not list(directory.glob("*.tmp"))
    assert (directory / "pushes" / "p2.pt").exists()  # kept: the oldest checkpoint does not cover it
