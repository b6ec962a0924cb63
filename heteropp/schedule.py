"""Schedules as data: per-stage lists of actions that the simulator and the HeteroPP runtime
both interpret, in ``torch.distributed.pipelining``'s action format.

An action is written ``{stage}{kind}{microbatch}``, e.g. ``0F3`` or ``2SEND_B1``. Kinds, named
as torch.distributed.pipelining names them:

- ``F``  forward;  ``I`` backward-input (input gradients);  ``W`` backward-weight;
- ``B``  the full backward (I and W fused, as plain 1F1B runs it);
- ``SEND_F``/``RECV_F`` the activation to/from the next/previous stage;
- ``SEND_B``/``RECV_B`` the gradient to/from the previous/next stage;
- ``R``  backward-recompute: re-run the forward before the backward (our addition; torch hides
  recomputation inside the backward, where neither a simulator nor a trace can see it).

Every rank of a stage (all its TP ranks) runs its stage's list; a DP replica runs one
``Schedule`` (the generated ones are the same for every replica; JEEVES's comm-aware lists
differ by replica). ``blocking_p2p`` says whether a SEND/RECV blocks the stage until the message
has arrived (Megatron's 1F1B) or only orders the messages (the compute waits for its input).
``coordinated`` names the boundaries whose link every replica shares and takes turns on (the
cross-DC link, JEEVES section 3.3): their messages cross one at a time in the global order
:func:`turn_order` gives, each sender handing the turn to the next once its message is out.
Schedules are read from and written to torch's CSV form (one row per stage, one action a cell).
"""
from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path
from typing import Sequence

COMPUTE_KINDS = ("F", "R", "I", "W", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|R|I|W|B)(\d+)$")


class ScheduleError(ValueError):
    """Action lists that no pipeline can run as written."""


@dataclasses.dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION_RE.match(text)
        if not m:
            raise ValueError(f"bad action {text!r}; expected STAGE KIND MICROBATCH like '0F3' with KIND in {KINDS}")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclasses.dataclass
class Schedule:
    """Per-stage action lists for one pipeline replica."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: list[list[Action]]
    blocking_p2p: bool = False
    coordinated: tuple[int, ...] = ()  # boundaries (stage i to i + 1) whose shared link replicas take turns on

    def to_dict(self) -> dict:
        return {
            "name": self.name, "num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
            "blocking_p2p": self.blocking_p2p, "coordinated": list(self.coordinated),
            "actions": [[str(a) for a in lst] for lst in self.actions],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        s = cls(name=str(d["name"]), num_stages=int(d["num_stages"]), num_microbatches=int(d["num_microbatches"]),
                actions=[[Action.parse(a) for a in lst] for lst in d["actions"]],
                blocking_p2p=bool(d.get("blocking_p2p", False)),
                coordinated=tuple(int(b) for b in d.get("coordinated", ())))
        s.validate()
        return s

    def validate(self, recompute: Sequence[bool] | None = None) -> None:
        """Each stage runs each micro-batch's forward once and its backward once, every action
        after what it depends on, and the lists together run to the end without deadlock.
        Raises ScheduleError naming the stage and the action."""
        if len(self.actions) != self.num_stages:
            raise ScheduleError(f"schedule {self.name!r}: {len(self.actions)} action lists for {self.num_stages} stages")
        bad = [b for b in self.coordinated if not 0 <= b < self.num_stages - 1]
        if bad:
            raise ScheduleError(f"schedule {self.name!r}: coordinated boundaries {bad} are not between two of its "
                                f"{self.num_stages} stages (expected 0..{self.num_stages - 2})")
        for s, lst in enumerate(self.actions):
            self._validate_stage(s, lst, recompute)
        self._validate_progress()

    def _validate_stage(self, s: int, lst: list["Action"], recompute: Sequence[bool] | None) -> None:
        S, b, name = self.num_stages, self.num_microbatches, self.name
        seen: dict[tuple[str, int], int] = {}
        for pos, a in enumerate(lst):
            if a.stage != s:
                raise ScheduleError(f"schedule {name!r}: action {a} in the list of stage {s}")
            if not 0 <= a.mb < b:
                raise ScheduleError(f"schedule {name!r}: action {a} names micro-batch {a.mb}, expected 0..{b - 1}")
            if (a.kind, a.mb) in seen:
                raise ScheduleError(f"schedule {name!r}: action {a} appears twice in stage {s}")
            seen[(a.kind, a.mb)] = pos

        def before(first: str, then: str, m: int) -> None:
            if seen[(first, m)] > seen[(then, m)]:
                raise ScheduleError(f"schedule {name!r}: stage {s} runs {s}{then}{m} before {s}{first}{m}, which it needs")

        for m in range(b):
            if ("F", m) not in seen:
                raise ScheduleError(f"schedule {name!r}: stage {s} never runs {s}F{m}")
            fused = ("B", m) in seen
            split = ("I", m) in seen and ("W", m) in seen
            if fused == split:
                raise ScheduleError(f"schedule {name!r}: stage {s} needs either {s}B{m} or both {s}I{m} and {s}W{m}")
            back = "B" if fused else "I"
            if recompute is not None and recompute[s] != (("R", m) in seen):
                raise ScheduleError(f"schedule {name!r}: stage {s} recompute={recompute[s]} but {s}R{m} is "
                                    f"{'missing' if recompute[s] else 'present'}")
            for kind, needed in (("RECV_F", s > 0), ("SEND_F", s < S - 1), ("RECV_B", s < S - 1), ("SEND_B", s > 0)):
                if needed != ((kind, m) in seen):
                    raise ScheduleError(f"schedule {name!r}: stage {s} {'lacks' if needed else 'has a stray'} {s}{kind}{m}")
            before("F", back, m)
            if split:
                before("I", "W", m)
            if ("R", m) in seen:
                before("F", "R", m)
                before("R", back, m)
            if s > 0:
                before("RECV_F", "F", m)
                before(back, "SEND_B", m)
            if s < S - 1:
                before("F", "SEND_F", m)
                before("RECV_B", back, m)

    def _validate_progress(self) -> None:
        """Run the lists abstractly: a compute action waits for the message it consumes, which
        exists once its sender has passed the SEND. Sends never block (the runtime posts them
        asynchronously), so a stage can only stall at a compute action; if all stall, deadlock."""
        S = self.num_stages
        pos = [0] * S
        sent: set[tuple[int, str, int]] = set()  # (receiving stage, direction, mb)
        progress = True
        while progress:
            progress = False
            for s in range(S):
                lst = self.actions[s]
                while pos[s] < len(lst):
                    a = lst[pos[s]]
                    if a.kind == "F" and s > 0 and (s, "F", a.mb) not in sent:
                        break
                    if a.kind in ("B", "I") and s < S - 1 and (s, "B", a.mb) not in sent:
                        break
                    if a.kind == "SEND_F":
                        sent.add((s + 1, "F", a.mb))
                    elif a.kind == "SEND_B":
                        sent.add((s - 1, "B", a.mb))
                    pos[s] += 1
                    progress = True
        stuck = [f"stage {s} at {self.actions[s][pos[s]]}" for s in range(S) if pos[s] < len(self.actions[s])]
        if stuck:
            raise ScheduleError(f"schedule {self.name!r} deadlocks: every stage waits for a message no stage will "
                                f"send ({'; '.join(stuck)})")

    # -- torch.distributed.pipelining's CSV form ---------------------------------------------------
    def to_csv(self, path: str | Path) -> Path:
        """One row per stage, one action per cell (what torch's ``_dump_csv`` writes)."""
        path = Path(path)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([[str(a) for a in lst] for lst in self.actions])
        return path

    @classmethod
    def from_csv(cls, path: str | Path, name: str | None = None, blocking_p2p: bool = False) -> "Schedule":
        """Read torch's CSV form. A compute-only file (no SEND/RECV, as torch's
        ``_load_csv`` takes) gets its transfers placed next to the compute that makes or
        needs them; empty cells (bubbles) are skipped. The result is validated."""
        path = Path(path)
        with open(path, newline="") as f:
            rows = [[c.strip() for c in row if c.strip()] for row in csv.reader(f)]
        if not rows:
            raise ScheduleError(f"{path}: no rows; expected one row of actions per stage")
        actions = []
        for s, row in enumerate(rows):
            parsed = []
            for cell in row:
                try:
                    parsed.append(Action.parse(cell))
                except ValueError as exc:
                    raise ScheduleError(f"{path} row {s}: {exc}") from None
            actions.append(parsed)
        mbs = [a.mb for lst in actions for a in lst]
        if not mbs:
            raise ScheduleError(f"{path}: no actions")
        sched = cls(name or path.stem, len(actions), max(mbs) + 1, actions, blocking_p2p)
        if not any(a.kind in COMM_KINDS for lst in actions for a in lst):
            sched.actions = [_with_transfers(s, len(actions), lst) for s, lst in enumerate(actions)]
        sched.validate()
        return sched


def turn_order(microbatches: Sequence[int]) -> list[tuple[int, int]]:
    """The global order in which the replicas' messages of one direction cross a coordinated
    link: (replica, micro-batch), a micro-batch of every replica in turn (JEEVES section 3.3).
    ``microbatches`` holds each replica's count."""
    return [(r, m) for m in range(max(microbatches)) for r in range(len(microbatches)) if m < microbatches[r]]


def _with_transfers(s: int, S: int, compute: list[Action]) -> list[Action]:
    """Place each transfer next to its compute: RECV_F before F, SEND_F after it, RECV_B before
    the backward (before R when recomputing), SEND_B after the backward that makes the gradient."""
    out: list[Action] = []
    recomputes = {a.mb for a in compute if a.kind == "R"}
    for a in compute:
        if a.kind == "F" and s > 0:
            out.append(Action(s, "RECV_F", a.mb))
        if s < S - 1 and (a.kind == "R" or (a.kind in ("B", "I") and a.mb not in recomputes)):
            out.append(Action(s, "RECV_B", a.mb))
        out.append(a)
        if a.kind == "F" and s < S - 1:
            out.append(Action(s, "SEND_F", a.mb))
        if a.kind in ("B", "I") and s > 0:
            out.append(Action(s, "SEND_B", a.mb))
    return out


def _forward(s: int, S: int, m: int) -> list[Action]:
    out = [Action(s, "RECV_F", m)] if s > 0 else []
    out.append(Action(s, "F", m))
    if s < S - 1:
        out.append(Action(s, "SEND_F", m))
    return out


def _backward(s: int, S: int, m: int, recompute: bool, split: bool) -> list[Action]:
    out = [Action(s, "RECV_B", m)] if s < S - 1 else []
    if recompute:
        out.append(Action(s, "R", m))
    if split:  # send the input gradient as soon as it exists; the weight gradient overlaps the send
        out.append(Action(s, "I", m))
        if s > 0:
            out.append(Action(s, "SEND_B", m))
        out.append(Action(s, "W", m))
    else:
        out.append(Action(s, "B", m))
        if s > 0:
            out.append(Action(s, "SEND_B", m))
    return out


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Every micro-batch's forward and nothing else: the evaluation of a held-out loss (not a
    training schedule, so not ``validate``-d as one)."""
    acts = [[a for m in range(num_microbatches) for a in _forward(s, num_stages, m)] for s in range(num_stages)]
    return Schedule("forward-only", num_stages, num_microbatches, acts, blocking_p2p=True)


def gpipe(num_stages: int, num_microbatches: int, recompute: Sequence[bool] | None = None) -> Schedule:
    """All forwards, then all backwards."""
    rc = list(recompute or [False] * num_stages)
    acts = []
    for s in range(num_stages):
        lst = [a for m in range(num_microbatches) for a in _forward(s, num_stages, m)]
        lst += [a for m in range(num_microbatches) for a in _backward(s, num_stages, m, rc[s], False)]
        acts.append(lst)
    return Schedule("gpipe", num_stages, num_microbatches, acts, blocking_p2p=True)


def one_f_one_b(num_stages: int, num_microbatches: int, recompute: Sequence[bool] | None = None,
                split_backward: bool = False, blocking_p2p: bool = True, warmup: Sequence[int] | None = None) -> Schedule:
    """1F1B (PipeDream-flush / DAPPLE): stage s runs ``warmup[s]`` forwards (default S - s - 1),
    then alternates one forward and one backward, then drains the backwards.

    ``split_backward`` gives the paper's fine-grained variant: I, SEND_B, then W."""
    S, b = num_stages, num_microbatches
    rc = list(recompute or [False] * S)
    acts = []
    for s in range(S):
        w = min(S - s - 1 if warmup is None else warmup[s], b)
        lst: list[Action] = []
        for m in range(w):
            lst += _forward(s, S, m)
        for j in range(b - w):
            lst += _forward(s, S, w + j)
            lst += _backward(s, S, j, rc[s], split_backward)
        for m in range(b - w, b):
            lst += _backward(s, S, m, rc[s], split_backward)
        acts.append(lst)
    name = "fine-grained" if split_backward else "1f1b"
    return Schedule(name, S, b, acts, blocking_p2p=blocking_p2p)


def fine_grained(num_stages: int, num_microbatches: int, recompute: Sequence[bool] | None = None) -> Schedule:
    """1F1B with the backward split into B and W and P2P overlapped with compute (H2 section 5)."""
    return one_f_one_b(num_stages, num_microbatches, recompute, split_backward=True, blocking_p2p=False)
