"""Schedules as data: causality and deadlock checks, and torch.distributed.pipelining's CSV form."""
from __future__ import annotations

import itertools
import random

import pytest

from heteropp.schedule import Action, Schedule, ScheduleError, fine_grained, gpipe, one_f_one_b
from heteropp.simulator import LinkModel, Pipeline, StageModel, simulate


def _generated(S: int, b: int, rc: list[bool]) -> list[Schedule]:
    return [gpipe(S, b, rc), one_f_one_b(S, b, rc), fine_grained(S, b, rc)]


def _moved(sched: Schedule, stage: int, src: int, dst: int) -> Schedule:
    lst = list(sched.actions[stage])
    lst.insert(dst, lst.pop(src))
    acts = [list(a) for a in sched.actions]
    acts[stage] = lst
    return Schedule(sched.name, sched.num_stages, sched.num_microbatches, acts, sched.blocking_p2p)


def _causal_by_brute_force(sched: Schedule) -> bool:
    """An independent check: execute the lists as one interleaving at a time, each stage taking its
    next action only when every message it consumes (the activation for F, the gradient for
    I/B) was sent and its own local inputs exist (F before its SEND_F, backward before SEND_B...)."""
    S = sched.num_stages
    pos = [0] * S
    done: set[tuple[int, str, int]] = set()
    while True:
        moved = False
        for s in range(S):
            if pos[s] == len(sched.actions[s]):
                continue
            a = sched.actions[s][pos[s]]
            need = {
                "F": [(s - 1, "SEND_F", a.mb), (s, "RECV_F", a.mb)] if s > 0 else [],
                "SEND_F": [(s, "F", a.mb)],
                "R": [(s, "F", a.mb)],
                "I": [(s, "F", a.mb)] + ([(s + 1, "SEND_B", a.mb), (s, "RECV_B", a.mb)] if s < S - 1 else []),
                "B": [(s, "F", a.mb)] + ([(s + 1, "SEND_B", a.mb), (s, "RECV_B", a.mb)] if s < S - 1 else []),
                "W": [(s, "I", a.mb)],
                "SEND_B": [(s, "B", a.mb), (s, "I", a.mb)],
            }.get(a.kind, [])
            if a.kind == "SEND_B":
                ok = any(n in done for n in need)
            else:
                ok = all(n in done for n in need)
            if a.kind in ("I", "B") and (s, "R", a.mb) in {(x.stage, x.kind, x.mb) for x in sched.actions[s]}:
                ok = ok and (s, "R", a.mb) in done
            if ok:
                done.add((s, a.kind, a.mb))
                pos[s] += 1
                moved = True
        if not moved:
            return all(pos[s] == len(sched.actions[s]) for s in range(S))


def test_generated_schedules_are_valid():
    for S, b in itertools.product(range(1, 5), range(1, 6)):
        for rc in itertools.product([False, True], repeat=S):
            for sched in _generated(S, b, list(rc)):
                sched.validate(list(rc))
                assert _causal_by_brute_force(sched)


def test_any_single_move_that_breaks_causality_is_refused():
    """Every way of moving one action of a small schedule: validate accepts exactly the lists the
    brute-force executor runs to the end."""
    rng = random.Random(3)
    checked = refused = 0
    for sched in _generated(3, 3, [False, True, False]):
        for stage in range(sched.num_stages):
            n = len(sched.actions[stage])
            for src, dst in itertools.product(range(n), range(n)):
                if src == dst or rng.random() > 0.35:
                    continue
                moved = _moved(sched, stage, src, dst)
                try:
                    moved.validate([False, True, False])
                    ok = True
                except ScheduleError:
                    ok = False
                assert ok == _causal_by_brute_force(moved), (stage, src, dst, moved.actions[stage])
                checked += 1
                refused += not ok
    assert checked > 200 and 0 < refused < checked


def test_errors_name_stage_and_action():
    s = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match=r"stage 0 runs 0SEND_F0 before 0F0"):
        _moved(s, 0, s.actions[0].index(Action(0, "SEND_F", 0)), 0).validate()
    with pytest.raises(ScheduleError, match=r"stage 1 runs 1F1 before 1RECV_F1"):
        lst = s.actions[1]
        _moved(s, 1, lst.index(Action(1, "RECV_F", 1)), len(lst) - 1).validate()
    # each list is locally causal, but stage 0 waits for 0B0's gradient before sending 0F1, which
    # stage 1 needs before it can produce that gradient (1F0, 1F1, then 1B0)
    dead = Schedule("dead", 2, 2, [
        [Action.parse(a) for a in "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1".split()],
        [Action.parse(a) for a in "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1".split()],
    ])
    with pytest.raises(ScheduleError, match=r"deadlocks.*stage 0 at 0B0.*stage 1 at 1F1"):
        dead.validate()


def test_simulator_cannot_be_fed_an_acausal_list():
    s = one_f_one_b(2, 2)
    bad = _moved(s, 1, s.actions[1].index(Action(1, "RECV_F", 0)), 4)
    pipe = Pipeline([StageModel(1, 1, 1, 1, False, 0, 0)] * 2, [LinkModel(1e6, 1e9, 0.0)], [2])
    with pytest.raises(ScheduleError):
        simulate(pipe, bad)


def test_csv_round_trip_and_torch_parses_our_cells(tmp_path):
    from torch.distributed.pipelining.schedules import _Action

    for sched in _generated(3, 4, [True, False, False]):
        path = sched.to_csv(tmp_path / f"{sched.name}.csv")
        back = Schedule.from_csv(path, name=sched.name)
        assert back.actions == sched.actions
        for lst in sched.actions:
            for a in lst:
                if a.kind == "R":
                    continue  # our addition; torch recomputes inside the backward
                ta = _Action.from_str(str(a))
                assert (ta.stage_index, ta.computation_type.value, ta.microbatch_index) == (a.stage, a.kind, a.mb)


def test_compute_only_csv_gets_its_transfers(tmp_path):
    """torch's compute-only CSV (with bubbles as empty cells) becomes a full list equal to ours."""
    ref = fine_grained(3, 4)
    rows = [[str(a) for a in lst if a.kind not in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")] for lst in ref.actions]
    rows[1].insert(0, "")
    (tmp_path / "zb.csv").write_text("\n".join(",".join(r) for r in rows) + "\n")
    sched = Schedule.from_csv(tmp_path / "zb.csv")
    assert sched.actions == ref.actions
    (tmp_path / "bad.csv").write_text("0F0,0UNSHARD\n")
    with pytest.raises(ScheduleError, match="UNSHARD"):
        Schedule.from_csv(tmp_path / "bad.csv")
