"""What dipu does at interpreter exit: let autograd's device threads finish first.

Autograd runs a dipu backward's kernels on a device thread per dipu device (as for CUDA) on a
vendor whose kernels run on its device, and on any vendor for a thread that turned autograd's
multithreading back on (csrc/device/AutogradThreads.h). That thread drops its last graph task
after it has woken the caller of ``backward()``, and the graph task holds the caller's
thread-local state, Python objects among them, so dropping it takes the GIL. A program that exits
right after a backward (a spawned profiling worker, a rank's last step) could have its
interpreter finalizing by then, and Python 3.11 ends a thread that asks a finalizing interpreter
for the GIL with ``pthread_exit``, whose unwinding through autograd's ``noexcept`` frames aborts
the process ("terminate called without an active exception"). At exit, before finalization,
each dipu device with allocator activity runs a one-element backward from a fresh C++ thread and
waits for it (csrc/device/AutogradThreads.h): a device thread runs its tasks in order, so it has
then dropped every earlier graph task.
"""
from __future__ import annotations

import atexit
import sys

import ditorch_ext._C as _C

_registered = False


def used_devices() -> list[int]:
    """dipu devices whose allocator saw any allocation: the ones autograd can have run work on."""
    used = []
    for d in range(_C.device_count()):
        counts = _C.memory_stats(d)["allocation"]["all"]
        if counts["allocated"] or counts["current"] or counts["peak"]:
            used.append(d)
    return used


def drain_autograd_device_threads() -> None:
    """Wait until autograd's device threads of every used dipu device hold no graph task."""
    devices = used_devices()
    if not devices:
        return
    try:
        _C.drain_autograd_device_threads(devices)
    except RuntimeError as exc:  # e.g. a device whose memory is full at exit: say so, exit as the program would
        print(f"ditorch: could not wait for autograd's dipu device threads at exit ({exc}); the process may abort "
              f"if one of them still holds a graph task", file=sys.stderr)


def register() -> None:
    """Drain the device threads at exit (once per process). Registered when ditorch_ext loads,
    so it runs after the exit handlers registered later (atexit runs them last-in first-out)."""
    global _registered
    if not _registered:
        atexit.register(drain_autograd_device_threads)
        _registered = True
