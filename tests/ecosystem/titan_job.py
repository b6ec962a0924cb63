"""One torchtitan training job: ``torchrun`` of ``launch.py`` on ``dipu`` or on the CPU, and the
per-step losses it logged.

The job is torchtitan's ``llama3`` debug model (its own config, ``llama3_debugmodel``) made small
from the command line: 64-token sequences, 2 per rank, a fixed seed, deterministic algorithms, and
its learning-rate schedule laid over ``schedule_steps`` (``--lr_scheduler.total_steps``), so runs
that together train them, one resuming the other's checkpoint, follow the schedule of one run.
Every run starts from one seed checkpoint (torchtitan's own ``--checkpoint.create_seed_checkpoint``,
made once on one CPU rank, loaded through ``--checkpoint.initial_load_path``), as torchtitan
recommends for comparing parallelisms: the CPU's generator and dipu's (a counter-based one, as
accelerators keep) draw different initial weights, and a DTensor's are drawn per placement. Losses come from torchtitan's own
TensorBoard log (``loss_metrics/global_avg_loss``, float32), never from its console.

Ranks of one job are placed by ``nodes``: one entry per ``torchrun`` node with that node's own
environment (e.g. ``DITORCH_CHIP``), all of them on loopback, as a job over several hosts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from diutil.address import free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))
from plans import kill_tree  # noqa: E402  (a torchrun and its workers, in sessions of their own)

ROOT = HERE.parents[1]
LAUNCH = HERE / "launch.py"
LOSS_TAG = "loss_metrics/global_avg_loss"

# The debug model as the tests train it; a case adds its parallelism and precision.
BASE_ARGS = [
    "--module", "llama3", "--config", "llama3_debugmodel",
    "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--debug.seed", "42", "--debug.deterministic",
    "--validator.no-enable",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "--metrics.disable_color_printing",
]
FP32 = ["--training.mixed_precision_param", "float32"]


class JobFailed(AssertionError):
    """A job exited non-zero; the message holds the end of its log."""


def losses(dump_folder: Path) -> dict[int, float]:
    """{step: loss} from every TensorBoard event file under ``dump_folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in sorted(dump_folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if LOSS_TAG in acc.Tags().get("scalars", []):
            out.update({e.step: e.value for e in acc.Scalars(LOSS_TAG)})
    return out


def make_seed(workdir: Path) -> Path:
    """The seed checkpoint (initial weights) every run loads: torchtitan's, on one CPU rank."""
    seed = workdir / "checkpoint" / "step-0"
    if not seed.is_dir():
        _launch(workdir, "cpu", ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"], steps=1,
                schedule_steps=1, nodes=[{}], nproc=1, timeout_s=900)
    return seed


def run(workdir: Path, device: str, args: list[str], *, steps: int, seed: Path, schedule_steps: int | None = None,
        save: bool = False, nodes: list[dict[str, str]] | None = None, nproc: int = 1,
        timeout_s: float = 900) -> dict[int, float]:
    """Train up to step ``steps`` in ``workdir`` from the weights of ``seed`` on a schedule of
    ``schedule_steps`` (default ``steps``). With ``save``, every step is checkpointed in
    ``workdir`` and a run finding a checkpoint there resumes it. ``nodes``: each node's extra
    environment, ``nproc`` ranks per node (default: one node). Returns {step: loss} of the steps
    this run trained."""
    checkpoint = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed)]
    checkpoint += ["--checkpoint.interval", "1"] if save else ["--checkpoint.load_only"]
    return _launch(workdir, device, checkpoint + args, steps=steps, schedule_steps=schedule_steps or steps,
                   nodes=nodes or [{}], nproc=nproc, timeout_s=timeout_s)


def _launch(workdir: Path, device: str, args: list[str], *, steps: int, schedule_steps: int,
            nodes: list[dict[str, str]], nproc: int, timeout_s: float) -> dict[int, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    run_id = time.monotonic_ns()
    cmd_tail = [str(LAUNCH), device, *BASE_ARGS, "--training.steps", str(steps),
                "--lr_scheduler.total_steps", str(schedule_steps),
                "--hf_assets_path", str(workdir.parent / "assets" / "tokenizer"),
                "--dataloader.dataset_path", str(workdir.parent / "assets" / "c4_test"),
                "--dump_folder", str(workdir), "--metrics.save_tb_folder", f"tb/{run_id}", *args]
    procs, logs = [], []
    for rank, extra in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--node-rank", str(rank),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               *cmd_tail]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra}
        log = workdir / f"node{rank}-{run_id}.log"
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=workdir, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise JobFailed(f"{device} job ({' '.join(args)}) exited {p.returncode}; {log}:\n"
                            + log.read_text()[-6000:])
    return losses(workdir / "tb" / str(run_id))
