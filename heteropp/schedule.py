"""Schedules as data: per-stage lists of actions that the simulator (and later the HeteroPP
runtime) interpret, in the spirit of ``torch.distributed.pipelining``'s action format.

An action is written ``{stage}{kind}{microbatch}``, e.g. ``0F3`` or ``2SEND_B1``. Kinds:

- ``F``  forward;  ``R`` backward-recompute (re-run the forward before the backward);
- ``B``  backward-input (input gradients);  ``W`` backward-weight (weight gradients);
- ``BW`` the full backward (B and W fused, as plain 1F1B runs it);
- ``SEND_F``/``RECV_F`` the activation to/from the next/previous stage;
- ``SEND_B``/``RECV_B`` the gradient to/from the previous/next stage.

Every rank of a stage (all its TP and DP ranks) runs its stage's list; all DP replicas run
the same lists. ``blocking_p2p`` says whether a SEND/RECV blocks the stage until the message
has arrived (Megatron's 1F1B) or only orders the messages (the compute waits for its input).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

COMPUTE_KINDS = ("F", "R", "B", "W", "BW")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|R|B|W)(\d+)$")


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

    def to_dict(self) -> dict:
        return {
            "name": self.name, "num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
            "blocking_p2p": self.blocking_p2p, "actions": [[str(a) for a in lst] for lst in self.actions],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        s = cls(name=str(d["name"]), num_stages=int(d["num_stages"]), num_microbatches=int(d["num_microbatches"]),
                actions=[[Action.parse(a) for a in lst] for lst in d["actions"]],
                blocking_p2p=bool(d.get("blocking_p2p", False)))
        s.validate()
        return s

    def validate(self, recompute: Sequence[bool] | None = None) -> None:
        """Each stage runs each micro-batch's forward once and its backward once, in a legal order."""
        if len(self.actions) != self.num_stages:
            raise ValueError(f"schedule {self.name!r}: {len(self.actions)} action lists for {self.num_stages} stages")
        S, b = self.num_stages, self.num_microbatches
        for s, lst in enumerate(self.actions):
            seen: dict[tuple[str, int], int] = {}
            for pos, a in enumerate(lst):
                if a.stage != s:
                    raise ValueError(f"schedule {self.name!r}: action {a} in the list of stage {s}")
                if not 0 <= a.mb < b:
                    raise ValueError(f"schedule {self.name!r}: action {a} names micro-batch {a.mb}, expected 0..{b - 1}")
                if (a.kind, a.mb) in seen:
                    raise ValueError(f"schedule {self.name!r}: action {a} appears twice in stage {s}")
                seen[(a.kind, a.mb)] = pos
            for m in range(b):
                if ("F", m) not in seen:
                    raise ValueError(f"schedule {self.name!r}: stage {s} never runs {s}F{m}")
                fused = ("BW", m) in seen
                split = ("B", m) in seen and ("W", m) in seen
                if fused == split:
                    raise ValueError(f"schedule {self.name!r}: stage {s} needs either {s}BW{m} or both {s}B{m} and {s}W{m}")
                back = seen[("BW", m)] if fused else seen[("B", m)]
                if back < seen[("F", m)] or (split and seen[("W", m)] < back):
                    raise ValueError(f"schedule {self.name!r}: stage {s} runs the backward of micro-batch {m} out of order")
                if recompute is not None and recompute[s] != (("R", m) in seen):
                    raise ValueError(f"schedule {self.name!r}: stage {s} recompute={recompute[s]} but {s}R{m} is "
                                     f"{'missing' if recompute[s] else 'present'}")
                for kind, needed in (("RECV_F", s > 0), ("SEND_F", s < S - 1), ("RECV_B", s < S - 1), ("SEND_B", s > 0)):
                    if needed != ((kind, m) in seen):
                        raise ValueError(f"schedule {self.name!r}: stage {s} {'lacks' if needed else 'has a stray'} {s}{kind}{m}")


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
        out.append(Action(s, "B", m))
        if s > 0:
            out.append(Action(s, "SEND_B", m))
        out.append(Action(s, "W", m))
    else:
        out.append(Action(s, "BW", m))
        if s > 0:
            out.append(Action(s, "SEND_B", m))
    return out


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

    ``split_backward`` gives the paper's fine-grained variant: B, SEND_B, then W."""
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
