"""torch.profiler over a range of training steps, with the dipu device's kernels in the trace.

The device side is ``csrc/device/Profiler.cpp`` (a Kineto child profiler registered as the module
loads): ``torch.profiler.profile(activities=[CPU, PrivateUse1])`` puts each dipu kernel on the
device's row of the Chrome trace, linked to its CPU op, and ``key_averages()`` counts its time in
``device_time_total``. This module only chooses which steps to trace (``--profile-steps``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity

#: What a trace of dipu work records: the host's ops and the device's kernels.
ACTIVITIES = (ProfilerActivity.CPU, ProfilerActivity.PrivateUse1)


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """``"A-B"``: steps A through B (1-based, inclusive); ``"N"``: N steps after the first (which
    warms caches and compiles, so a trace of it would show what later steps do not)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec or "")
    if not m:
        raise ValueError(f"--profile-steps {spec!r} is invalid; expected a count N or a range A-B of 1-based steps")
    if m.group(2) is None:
        n = int(m.group(1))
        if n < 1:
            raise ValueError(f"--profile-steps {spec!r} is invalid; expected a count of at least 1")
        return 2, n + 1
    first, last = int(m.group(1)), int(m.group(2))
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps {spec!r} is invalid; expected 1 <= A <= B")
    return first, last


class StepProfiler:
    """Traces steps ``first``..``last`` (1-based) of a run into one Chrome trace at ``path``.

    ``before_run()`` and ``after_step(step)`` (0-based, as the run's hook gets it) start and stop
    it; a run that ends before ``last`` writes what it traced when ``close()`` is called.
    """

    def __init__(self, first: int, last: int, path: Path | str):
        if not 1 <= first <= last:
            raise ValueError(f"profile steps {first}-{last} are invalid; expected 1 <= first <= last")
        self.first, self.last, self.path = first, last, Path(path)
        self._prof: torch.profiler.profile | None = None
        self.written = False

    def _start(self) -> None:
        self._prof = torch.profiler.profile(activities=list(ACTIVITIES))
        self._prof.start()

    def before_run(self) -> None:
        if self.first == 1:
            self._start()

    def after_step(self, step: int) -> None:
        done = step + 1
        if done == self.first - 1 and self._prof is None:
            self._start()
        elif done == self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace, if one is running."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if torch.dipu.is_available():
            torch.dipu.synchronize()
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.written = True

    def wrap(self, hook: Callable[[int], bool] | None) -> Callable[[int], bool]:
        """``hook`` (a run's after-step hook, or None) with this profiler's step before it."""
        def after_step(step: int) -> bool:
            self.after_step(step)
            return bool(hook(step)) if hook is not None else False

        return after_step
