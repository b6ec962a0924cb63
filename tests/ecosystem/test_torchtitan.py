"""torchtitan, PyTorch's own LLM trainer, trains its ``llama3`` debug model on dipu over dicomm,
unchanged: ``import ditorch`` is the only line added (launch.py). Each case is one parallelism or
feature of torchtitan's, on dipu, held against the same job on the CPU over gloo: fp32 losses
within 1e-4 (relative) of it, bf16 within the MRE criterion of ``ditorch mre`` (1.5 %).

Run by ``make test-torchtitan`` (scripts/test_torchtitan.sh), which installs torchtitan 0.3.0
beside the torch release it is built for (2.14: on 2.13 it stops on the CPU as on dipu, at
``torch.distributed.set_timeout``, at 2.13's ``fully_shard`` and in its pipelining; docs/ecosystem.md).
Skipped where torchtitan is not installed (``make test``).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan is not installed here: make test-torchtitan")
import torch  # noqa: E402

if not hasattr(torch.distributed, "set_timeout"):
    pytest.skip(f"torchtitan {torchtitan.__version__} needs torch.distributed.set_timeout, which torch "
                f"{torch.__version__} lacks: make test-torchtitan", allow_module_level=True)

import titan_job  # noqa: E402
from assets import make_assets  # noqa: E402
from titan_job import FP32, make_seed  # noqa: E402

from ditorch.tools import mean_relative_error  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

STEPS = 3
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
       "--training.disable_cuda_graphs",  # torchtitan refuses PP with CUDA graphs, which it only uses on cuda
       "--parallelism.pipeline_parallel_microbatch_size", "1"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]


@pytest.fixture(scope="session")
def titan_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchtitan")
    make_assets(root / "assets")
    return root


SUMMARY: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def summary(titan_dir):
    """Each comparison's numbers, one line per case, in ``summary.txt`` beside the runs (the
    harness prints it after the tests; docs/ecosystem.md's results column comes from it)."""
    yield
    (titan_dir / "summary.txt").write_text("\n".join(SUMMARY) + "\n")


@pytest.fixture(scope="session")
def seed(titan_dir) -> Path:
    return make_seed(titan_dir / "seed")


def run(workdir: Path, device: str, args: list[str], **kwargs) -> dict[int, float]:
    """A job of ``STEPS`` steps (unless given) from the session's seed checkpoint."""
    kwargs.setdefault("steps", STEPS)
    return titan_job.run(workdir, device, args, seed=make_seed(workdir.parent / "seed"), **kwargs)


class References:
    """CPU runs over gloo, each made once and shared by the cases that compare against it."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def __call__(self, name: str, args: list[str], nproc: int) -> dict[int, float]:
        if name not in self.done:
            self.done[name] = run(self.root / f"cpu-{name}", "cpu", args, nproc=nproc)
        return self.done[name]


@pytest.fixture(scope="session")
def cpu(titan_dir, seed) -> References:
    return References(titan_dir)


def _record(reference: dict[int, float], got: dict[int, float], what: str) -> None:
    case = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    steps = sorted(set(reference) & set(got))
    SUMMARY.append(f"{case}: {what}; dipu {[round(got[s], 5) for s in steps]}, "
                   f"CPU {[round(reference[s], 5) for s in steps]}")


def assert_fp32_close(reference: dict[int, float], got: dict[int, float]) -> None:
    assert sorted(got) == sorted(reference), f"steps differ: reference {sorted(reference)}, dipu {sorted(got)}"
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    _record(reference, got,
            f"largest relative difference {worst:.1e}")
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-4), (
            f"step {step}: dipu {got[step]!r}, CPU {reference[step]!r}; all: dipu {got}, CPU {reference}")


def assert_within_mre(reference: dict[int, float], got: dict[int, float]) -> None:
    report = mean_relative_error(reference, got)
    _record(reference, got,
            f"MRE {report.mre_percent:.4f} %")
    assert report.passed(), report.format()


def test_fsdp2_fp32(titan_dir, cpu):
    assert_fp32_close(cpu("fsdp2", FP32 + FSDP2, 2), run(titan_dir / "dipu-fsdp2", "dipu", FP32 + FSDP2,
                                                           nproc=2))


def test_tp2_fp32(titan_dir, cpu):
    assert_fp32_close(cpu("tp2", FP32 + TP2, 2), run(titan_dir / "dipu-tp2", "dipu", FP32 + TP2, nproc=2))


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pp2_fp32(titan_dir, cpu, schedule):
    args = FP32 + PP2 + ["--parallelism.pipeline_parallel_schedule", schedule]
    assert_fp32_close(cpu(f"pp2-{schedule}", args, 2), run(titan_dir / f"dipu-pp2-{schedule}", "dipu", args,
                                                           nproc=2))


def test_hsdp_fp32(titan_dir, cpu):
    assert_fp32_close(cpu("hsdp", FP32 + HSDP, 4), run(titan_dir / "dipu-hsdp", "dipu", FP32 + HSDP, nproc=4))


def test_full_activation_checkpointing_equals_selective(titan_dir, cpu):
    """Every case runs the debug config's selective activation checkpointing; full recomputation
    changes no loss."""
    got = run(titan_dir / "dipu-full-ac", "dipu", FP32 + FSDP2 + ["activation-checkpoint:full"], nproc=2)
    assert_fp32_close(cpu("fsdp2", FP32 + FSDP2, 2), got)


def test_torch_compile(titan_dir, cpu):
    """torchtitan's compile of each transformer block and of the loss, with the inductor, against
    the eager CPU run."""
    got = run(titan_dir / "dipu-compile", "dipu", FP32 + FSDP2 + ["--compile.enable"], nproc=2)
    assert_fp32_close(cpu("fsdp2", FP32 + FSDP2, 2), got)


def test_distributed_checkpoint_saved_on_dipu_resumes_on_cpu_and_back(titan_dir, cpu):
    """Step 1 on dipu, saved; step 2 on the CPU from that checkpoint, saved; step 3 on dipu from
    the CPU's. Every save and load is torchtitan's (DCP, sharded by FSDP2 over 2 ranks)."""
    work = titan_dir / "dcp"
    shutil.rmtree(work, ignore_errors=True)
    args = FP32 + FSDP2
    got = {}
    for steps, device in enumerate(["dipu", "cpu", "dipu"], start=1):
        trained = run(work, device, args, steps=steps, schedule_steps=STEPS, save=True, nproc=2)
        assert sorted(trained) == [steps], f"{device} run to step {steps} trained steps {sorted(trained)}"
        assert (work / "checkpoint" / f"step-{steps}").is_dir()
        got.update(trained)
    assert_fp32_close(cpu("fsdp2", FP32 + FSDP2, 2), got)


def test_bf16_within_mre(titan_dir, cpu):
    """torchtitan's default mixed precision (bf16 parameters, fp32 reduction) under FSDP2."""
    got = run(titan_dir / "dipu-bf16", "dipu", FSDP2, nproc=2)
    assert_within_mre(cpu("bf16", FSDP2, 2), got)


def test_ranks_on_two_chip_types_train_within_mre(titan_dir, cpu):
    """The FSDP2 job with rank 0 on chip A and rank 1 on chip C (``DITORCH_CHIP`` per rank: each
    rank a torchrun node of its own). Their fp32 matmuls and special functions are each chip's own
    (docs/device.md, "Numerics"), so the losses are held to the MRE criterion, not to 1e-4."""
    nodes = [{"DITORCH_CHIP": "A"}, {"DITORCH_CHIP": "C"}]
    got = run(titan_dir / "dipu-chips-A-C", "dipu", FP32 + FSDP2, nodes=nodes)
    assert_within_mre(cpu("fsdp2", FP32 + FSDP2, 2), got)


def test_ranks_on_two_vendors_train_as_the_cpu(titan_dir, cpu):
    """The FSDP2 job with rank 0's dipu on the emu vendor and rank 1's on the cpu vendor
    (``DITORCH_VENDOR`` per rank): exact fp32 on both, so within 1e-4."""
    nodes = [{"DITORCH_VENDOR": "emu"}, {"DITORCH_VENDOR": "cpu"}]
    got = run(titan_dir / "dipu-vendors-emu-cpu", "dipu", FP32 + FSDP2, nodes=nodes)
    assert_fp32_close(cpu("fsdp2", FP32 + FSDP2, 2), got)


def test_a_job_that_fails_is_reported_with_its_log(titan_dir, seed):
    """The runner's own check: a bad torchtitan argument fails the job, and the error holds the
    log's end (what each case shows when dipu or dicomm refuses something)."""
    with pytest.raises(titan_job.JobFailed, match="no-such-option"):
        run(titan_dir / "bad", "cpu", ["--no-such-option"], steps=1)
