"""Test ranks forked from a process that imported torch once.

Importing torch costs a test rank ~1.5-2 s of CPU, and the suite starts hundreds of ranks: most
of its CPU time went there. multiprocessing's fork server, preloading torch, forks each rank
from a process that has imported torch and done nothing else (no threads, sockets or devices).
A rank then applies the environment it was given before it imports anything of ours (dicomm,
ditorch and the vendor it reads at import), so it sees what a freshly spawned process sees;
only torch's own import-time environment is the one the test process had.

:func:`torchrun_like` runs a module or script on N such ranks with the environment ``torchrun
--standalone`` gives its workers. The tests that check torchrun itself (the CLI recipes, several
hosts, killing a launch) still launch the real one.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from diutil.address import free_port


def context() -> mp.context.BaseContext:
    """The fork server's multiprocessing context (one server per test process, started on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # imports only
    return ctx


def server_pid() -> int | None:
    """The fork server's pid, once started in this process (its reaped ranks' CPU is in its
    /proc stat: tests/cpu_time.py)."""
    return getattr(mp.forkserver._forkserver, "_forkserver_pid", None)


def _run_as_main(target: list[str], env: dict[str, str], cwd: str, out: str, err: str, host=None) -> None:
    """In the rank: the environment, the folder and the output files (and the emulated host, if
    given, before anything opens a socket), then ``python *target``."""
    os.environ.clear()
    os.environ.update(env)
    if host is not None:
        host.enter()
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, str(Path(target[0]).resolve().parent))
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    finally:
        # multiprocessing ends the rank with os._exit: run what an interpreter's exit would.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def torchrun_like(target: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float,
                  hosts: list | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc *target`` on forked ranks.

    The ranks get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    (rank 0 hosts the store, as ``env://`` does without an agent). As torchrun does, the first
    rank to fail ends the others (SIGTERM, then SIGKILL after 5 s) and the launch fails; its
    output is each rank's stdout and stderr in rank order. Raises subprocess.TimeoutExpired after
    ``timeout`` seconds, with every rank killed. With ``hosts`` (tests/emulated_hosts.py), the
    ranks are spread over them in order, as ``torchrun --nnodes`` places them (rank r on host
    r * len(hosts) // nproc), and the store is on the first.
    """
    ctx = context()
    port = str(free_port())
    files = [(cwd / f".rank{r}.out", cwd / f".rank{r}.err") for r in range(nproc)]
    procs = []
    for r in range(nproc):
        rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                    "MASTER_ADDR": hosts[0].address if hosts else "127.0.0.1", "MASTER_PORT": port}
        host = hosts[r * len(hosts) // nproc] if hosts else None
        p = ctx.Process(target=_run_as_main,
                        args=(target, rank_env, str(cwd), str(files[r][0]), str(files[r][1]), host))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                _stop(procs)
                break
            if time.monotonic() > deadline:
                _stop(procs, grace=0)
                raise subprocess.TimeoutExpired(target, timeout)
            time.sleep(0.05)
    finally:
        _stop(procs, grace=0)
    codes = [p.exitcode for p in procs]
    failed = next((c for c in codes if c != 0), 0)
    stdout = "".join(out.read_text(errors="replace") for out, _ in files)
    stderr = "".join(err.read_text(errors="replace") for _, err in files)
    for out, err in files:
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
    return subprocess.CompletedProcess(target, 1 if failed else 0, stdout, stderr)


def _stop(procs: list, grace: float = 5.0) -> None:
    """SIGTERM the ranks still running, SIGKILL what is left after ``grace`` seconds."""
    for p in procs:
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
