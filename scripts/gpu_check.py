#!/usr/bin/env python3
"""``make gpu-check``: the dipu device on a real GPU, in at most 8 minutes, as one command.

On a machine with an NVIDIA GPU and a CUDA build of torch (no network needed: nothing is
installed, the build uses the torch that is there). Where the GPU (or a CUDA build of torch) is
missing, it still builds everything first, then stops with one line naming what is missing (exit 2):
nothing that can be checked without the GPU is left for the first run that has one.

1. build the device layer and dicomm against the installed torch (CMake + ninja);
2. the vendor-generic device tests with ``DITORCH_VENDOR=cuda`` (needs pytest);
3. the project's LLaMA trained on dipu against the same model on native cuda: fp32 with
   deterministic algorithms (losses equal within 1e-4 relative) and bf16 autocast (MRE < 0.5%);
4. two ranks sharing the GPU: dicomm p2p, allreduce and a DDP step on dipu tensors, against the
   same computed on the CPU;
5. the mixed-vendor pipeline: a TP-2 first stage on the GPU (one torchrun) and two stages of
   emulated chips B and C (another torchrun), bf16, MRE < 1.5% against the CPU fp32 reference;
6. micro-benchmarks, dipu over native cuda: a 4096x4096 bf16 matmul (goal <= 1.03x), a 1,000-element
   add (goal: at most 1 us over native, the host overhead a user pays on every small kernel) and
   a bf16 training step (goal <= 1.05x, the median of per-round ratios, the two taking turns).

Every step runs in a process of its own, so one failure does not hide the others; the report is
a table printed at the end and written into docs/device.md (between the gpu-check markers) with
the date and the GPU's name. ``--device-type cpu`` runs the same steps against the native vendor
over the cpu (what `make test` also covers), to try the script on a machine without a GPU;
``--no-docs`` leaves docs/device.md alone.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 8 * 60
DOC = ROOT / "docs" / "device.md"
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
VENDOR_GENERIC = ["tests/device/test_device.py", "tests/device/test_device_refusals.py",
                  "tests/device/test_unboxed_shim.py", "tests/device/test_llama.py",
                  "tests/device/test_chip_numerics.py"]


# -- the workers: each runs in its own process, prints one JSON line last -------------------------------------------


def _llama():
    from dimodel.llama import LlamaConfig

    return LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=128)


class _LlamaTraining:
    """The project's LLaMA and AdamW on `device` (seed 0), stepped on the batches it draws (seed 1)."""

    def __init__(self, device: str, precision: str):
        import torch

        from dimodel.llama import Llama

        self.cfg = _llama()
        torch.manual_seed(0)
        self.device, self.bf16 = device, precision == "bf16"
        self.model = Llama(self.cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batches = torch.Generator().manual_seed(1)
        self.sync = getattr(torch, torch.device(device).type).synchronize

    def step(self) -> tuple[float, float]:
        """One step on the next batch, the device synchronized at its end: (loss, seconds)."""
        import torch

        cfg = self.cfg
        tokens = torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len + 1), generator=self.batches).to(self.device)
        start = time.perf_counter()
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return loss.item(), time.perf_counter() - start


def _train(device: str, precision: str, steps: int) -> list[float]:
    """The losses of `steps` steps of _LlamaTraining on `device`."""
    run = _LlamaTraining(device, precision)
    return [run.step()[0] for _ in range(steps)]


def _step_ratio(devices: tuple[str, str], rounds: int = 16, turns: int = 4) -> tuple[dict, float]:
    """Median seconds per bf16 step on each device and the median over rounds of their ratio
    (second / first). Each round builds both models afresh (where a model's memory lies moves a
    step by several percent from one instance to the next) and warms each up a step; then they
    take turns, one step each, the order alternating, the garbage collector held off while a step
    is timed, so that the host's drifting speed and load hit both alike."""
    seconds = {d: [] for d in devices}
    ratios = []
    for _ in range(rounds):
        runs = {d: _LlamaTraining(d, "bf16") for d in devices}
        for run in runs.values():
            run.step()
        mine = {d: [] for d in devices}
        for turn in range(turns):
            for d in (devices if turn % 2 == 0 else devices[::-1]):
                with _gc_held_off():
                    mine[d].append(runs[d].step()[1])
        for d in devices:
            seconds[d] += mine[d]
        ratios.append(statistics.median(mine[devices[1]]) / statistics.median(mine[devices[0]]))
    return {d: statistics.median(t) for d, t in seconds.items()}, statistics.median(ratios)


def worker_train(device_type: str) -> dict:
    import torch

    import ditorch  # noqa: F401

    torch.use_deterministic_algorithms(True)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from ditorch.tools import mean_relative_error

    out = {}
    for precision, steps in (("fp32", 20), ("bf16", 20)):
        native = _train(device_type, precision, steps)
        dipu = _train("dipu", precision, steps)
        worst = max(abs(a - b) / abs(b) for a, b in zip(dipu, native))
        report = mean_relative_error(dict(enumerate(native, 1)), dict(enumerate(dipu, 1)))
        out[precision] = {"max_rel": worst, "mre_percent": report.mre_percent, "last": [dipu[-1], native[-1]]}
    out["ok"] = out["fp32"]["max_rel"] <= 1e-4 and out["bf16"]["mre_percent"] < 0.5
    return out


def _rank_main(rank: int, world: int, port: int, result_dir: str) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ditorch  # noqa: F401

    dist.init_process_group("dicomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=60))
    out = {"addressable": torch.dipu.is_host_addressable(), "asynchronous": torch.dipu.is_asynchronous()}
    x = (torch.arange(1 << 20, dtype=torch.float32) + rank).to("dipu") * 1.0  # produced by a kernel on the stream
    if rank == 0:
        dist.send(x, dst=1)
    else:
        y = torch.empty_like(x)
        dist.recv(y, src=0)
        out["p2p_ok"] = bool(torch.equal(y.cpu(), torch.arange(1 << 20, dtype=torch.float32)))
    s = (torch.arange(4096, dtype=torch.float32) * (rank + 1)).to("dipu")
    dist.all_reduce(s)
    out["allreduce_ok"] = bool(torch.equal(s.cpu(), torch.arange(4096, dtype=torch.float32) * 3))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    ddp = DistributedDataParallel(model.to("dipu"))
    batch = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    ddp(batch.to("dipu")).pow(2).mean().backward()
    out["grads"] = [p.grad.cpu().tolist() for p in ddp.module.parameters()]
    dist.destroy_process_group()
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out))


def worker_ranks(device_type: str) -> dict:
    import torch
    import torch.multiprocessing as mp

    from diutil.address import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(2, free_port(), tmp), nprocs=2, start_method="spawn", join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    for r in range(2):
        model(torch.randn(16, 64, generator=torch.Generator().manual_seed(r))).pow(2).mean().backward()
    want = [p.grad / 2 for p in model.parameters()]
    ddp_ok = all(torch.allclose(torch.tensor(g), w, rtol=1e-4, atol=1e-6)
                 for rank in ranks for g, w in zip(rank["grads"], want))
    staged = not ranks[0]["addressable"]
    return {"ok": bool(ranks[1]["p2p_ok"] and ranks[0]["allreduce_ok"] and ranks[1]["allreduce_ok"] and ddp_ok and staged),
            "p2p": ranks[1]["p2p_ok"], "allreduce": ranks[0]["allreduce_ok"] and ranks[1]["allreduce_ok"], "ddp": ddp_ok,
            "staged": staged}


def worker_pipeline(device_type: str) -> dict:
    from ditorch.tools import load_losses, mean_relative_error
    from diutil.address import free_port
    from heteropp.cluster import ClusterSpec
    from heteropp.model_spec import ModelSpec
    from heteropp.plan import Plan, StagePlan

    spec = ModelSpec.from_dict({"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                                "ffn_dim": 128, "max_seq_len": 32}, name="gpu-check-llama")
    chip = lambda memory: {"count": 8, "memory_gb": memory, "chips_per_node": 8, "tp_max": 4, "intra_node_gbps": 10,
                           "hbm_gbps": 100, "nic_gbps": 1, "effective_tflops": 1}
    cluster = ClusterSpec.from_dict({"chips": {"host": chip(80), "B": chip(64), "C": chip(32)},
                                     "links": {"inter_node": {"bandwidth_gbps": 1}, "inter_cluster": {"bandwidth_gbps": 1}}})
    stages = (StagePlan(chip="host", tp=2, dp=1, layers=2, first_layer=0, recompute=False, first_rank=0),
              StagePlan(chip="B", tp=1, dp=1, layers=1, first_layer=2, recompute=False, first_rank=2),
              StagePlan(chip="C", tp=1, dp=1, layers=1, first_layer=3, recompute=True, first_rank=3))
    plan = Plan(model=spec, cluster=cluster, global_batch_tokens=4 * spec.seq, dp=1, stages=stages, schedule="1f1b")
    plan.validate()
    steps = 20
    with tempfile.TemporaryDirectory() as tmp:
        plan.to_json(Path(tmp, "plan.json"))
        port = free_port()
        procs = []
        for node, vendor in enumerate([device_type, "emu"]):
            env = dict(os.environ, PYTHONPATH=str(ROOT), DITORCH_VENDOR=vendor, DITORCH_MEMORY_SCALE="0.001")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "ditorch.train", "--plan", "plan.json", "--steps", str(steps), "--precision", "bf16",
                   "--quiet", "--timeout", "60", "--loss-log", f"node{node}.jsonl"]
            procs.append(subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = [p.communicate(timeout=180) for p in procs]
        for p, (_, err) in zip(procs, outs):
            if p.returncode != 0:
                return {"ok": False, "error": err[-1500:]}
        ref = subprocess.run([sys.executable, "-m", "ditorch.train", "--plan", "plan.json", "--reference", "--steps",
                              str(steps), "--loss-log", "ref.jsonl"], cwd=tmp, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
        if ref.returncode != 0:
            return {"ok": False, "error": ref.stderr[-1500:]}
        report = mean_relative_error(load_losses(Path(tmp, "ref.jsonl")), load_losses(Path(tmp, "node0.jsonl")))
        stages_line = [line for line in outs[0][0].splitlines() if "stage 0:" in line]
    return {"ok": report.n == steps and report.mre_percent < 1.5, "mre_percent": report.mre_percent,
            "stage0": stages_line[0].strip() if stages_line else ""}


@contextlib.contextmanager
def _gc_held_off():
    """Python's garbage collector off while a contender is timed, after a collection (as timeit
    does): otherwise a collection lands in whichever contender crosses its threshold."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _per_call(fns: dict, syncs: dict, repeats: int, rounds: int = 7) -> dict:
    """Median over rounds of the seconds per call of each of `fns` (`repeats` calls, then its sync),
    the contenders taking turns within each round so that a busy moment hits both alike."""
    samples = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
        syncs[name]()
    for _ in range(rounds):
        for name, fn in fns.items():
            with _gc_held_off():
                start = time.perf_counter()
                for _ in range(repeats):
                    fn()
                syncs[name]()
                samples[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def worker_bench(device_type: str) -> dict:
    import torch

    import ditorch  # noqa: F401

    module = getattr(torch, device_type)
    devices = (device_type, "dipu")
    syncs = {device_type: module.synchronize, "dipu": torch.dipu.synchronize}
    size = 4096 if device_type == "cuda" else 512
    host = [torch.randn(size, size, dtype=torch.bfloat16) for _ in range(2)]
    mats = {d: [m.to(d) for m in host] for d in devices}
    vectors = {d: torch.ones(1000, device=d) for d in devices}
    matmul = _per_call({d: (lambda d=d: mats[d][0] @ mats[d][1]) for d in devices}, syncs, 20)
    add = _per_call({d: (lambda d=d: vectors[d] + vectors[d]) for d in devices}, syncs, 2000)
    step, step_ratio = _step_ratio(devices)
    out = {d: {"matmul_s": matmul[d], "add_s": add[d], "step_s": step[d]} for d in devices}
    native, dipu = out[device_type], out["dipu"]
    ratios = {key: dipu[key] / native[key] for key in native}
    ratios["step_s"] = step_ratio  # within rounds first, as the step's docstring says
    return {"ok": True, "native": native, "dipu": dipu, "ratios": ratios,
            "goals_met": ratios["matmul_s"] <= 1.03 and dipu["add_s"] - native["add_s"] <= 1e-6
            and ratios["step_s"] <= 1.05}


WORKERS = {"train": worker_train, "ranks": worker_ranks, "pipeline": worker_pipeline, "bench": worker_bench}


# -- the driver ------------------------------------------------------------------------------------------------------


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, float]] = []  # step, verdict, detail, seconds

    def add(self, step: str, ok: bool | None, detail: str, seconds: float) -> None:
        verdict = "skipped" if ok is None else ("PASS" if ok else "FAIL")
        self.rows.append((step, verdict, detail, seconds))
        print(f"gpu-check: {step}: {verdict} ({seconds:.0f} s) {detail}", flush=True)

    @property
    def passed(self) -> bool:
        return all(v == "PASS" for _, v, _, _ in self.rows)

    def markdown(self, header: str) -> str:
        lines = [header, "", "| step | result | measured | time |", "|---|---|---|---|"]
        lines += [f"| {s} | {v} | {d.replace('|', '/')} | {t:.0f} s |" for s, v, d, t in self.rows]
        return "\n".join(lines)


def _run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(cmd, -1, out, f"timed out after {timeout:.0f} s")


def _build(report: Report, deadline: float) -> bool:
    import torch

    start = time.monotonic()
    build = ROOT / "build" / f"gpu-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split('+')[0]}"
    torch_root = Path(torch.__file__).parent
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-DTORCH_ROOT={torch_root}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    env = dict(os.environ)
    steps = [configure, ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "ditorch_device"]]
    for cmd in steps:
        run = _run(cmd, env, deadline - time.monotonic())
        if run.returncode != 0:
            report.add("build", False, (run.stdout + run.stderr)[-300:].replace("\n", " "), time.monotonic() - start)
            return False
    comm = _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "dicomm_backend"], env,
                deadline - time.monotonic())
    detail = f"torch {torch.__version__}, python {sys.version.split()[0]}"
    detail += "" if comm.returncode == 0 else "; dicomm NOT built: " + (comm.stdout + comm.stderr)[-200:].replace("\n", " ")
    report.add("build", comm.returncode == 0, detail, time.monotonic() - start)
    return comm.returncode == 0


def _worker_step(report: Report, name: str, label: str, device_type: str, deadline: float, limit: float,
                 describe) -> None:
    start = time.monotonic()
    left = min(limit, deadline - start)
    if left <= 5:
        report.add(label, None, "out of the 8-minute budget", 0)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), DITORCH_VENDOR=device_type, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    run = _run([sys.executable, __file__, "--worker", name, "--device-type", device_type], env, left)
    seconds = time.monotonic() - start
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report.add(label, False, (run.stderr or run.stdout)[-400:].replace("\n", " "), seconds)
        return
    report.add(label, bool(result.get("ok")), describe(result) if result.get("ok") is not None else "", seconds)
    if "error" in result:
        print(result["error"], file=sys.stderr)


def _missing_for(device_type: str) -> str:
    """What this machine lacks to run the device steps on `device_type`, in one line; "" when nothing."""
    import torch

    if device_type != "cuda":
        return ""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU build (no CUDA runtime); install a CUDA build of torch, "
                "or run `--device-type cpu` to try the steps on the cpu vendor")
    if not torch.cuda.is_available():
        return (f"no CUDA GPU is visible (torch {torch.__version__} for CUDA {torch.version.cuda}: "
                f"torch.cuda.device_count() == {torch.cuda.device_count()})")
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-type", default="cuda", help="the native device to check dipu on (default cuda)")
    p.add_argument("--no-docs", action="store_true", help="print the table only; leave docs/device.md alone")
    p.add_argument("--no-build", action="store_true", help="use the modules already built")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.device_type)))
        return 0

    import torch

    deadline = time.monotonic() + BUDGET_S
    missing = _missing_for(args.device_type)
    gpu = (torch.cuda.get_device_name(0) if args.device_type == "cuda" and not missing
           else f"{args.device_type} (no GPU)")
    report = Report()
    # Everything that can be checked without the device is, first: the build against this torch.
    if not args.no_build and not _build(report, deadline):
        print(report.markdown(f"gpu-check on {gpu}"))
        if missing:
            print(f"gpu-check: the build failed, and then: {missing}", file=sys.stderr)
        return 1
    if missing:
        print(f"gpu-check: {'built everything; ' if not args.no_build else ''}stopping: {missing}", file=sys.stderr)
        return 2
    start = time.monotonic()
    if subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True).returncode == 0:
        env = dict(os.environ, PYTHONPATH=str(ROOT), DITORCH_VENDOR=args.device_type)
        run = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *VENDOR_GENERIC], env,
                   min(180, deadline - time.monotonic()))
        summary = (run.stdout.strip().splitlines() or ["no output"])[-1]
        report.add("device tests", run.returncode == 0, summary, time.monotonic() - start)
        if run.returncode != 0:
            print(run.stdout[-4000:], run.stderr[-2000:], file=sys.stderr)
    else:
        report.add("device tests", None, "pytest is not installed here", 0)
    _worker_step(report, "train", "LLaMA on dipu vs native", args.device_type, deadline, 120,
                 lambda r: f"fp32 max rel {r['fp32']['max_rel']:.1e} (<= 1e-4); bf16 MRE {r['bf16']['mre_percent']:.3f}% (< 0.5%)")
    _worker_step(report, "ranks", "2 ranks: p2p, allreduce, DDP", args.device_type, deadline, 120,
                 lambda r: f"p2p {r['p2p']}, allreduce {r['allreduce']}, DDP {r['ddp']}, staged {r['staged']}")
    _worker_step(report, "pipeline", "mixed-vendor pipeline", args.device_type, deadline, 200,
                 lambda r: f"MRE {r.get('mre_percent', float('nan')):.3f}% (< 1.5%); {r.get('stage0', '')}")
    _worker_step(report, "bench", "dipu / native", args.device_type, deadline, 120,
                 lambda r: (f"bf16 matmul {r['ratios']['matmul_s']:.3f}x (goal <= 1.03); 1,000-element add "
                            f"{r['dipu']['add_s'] * 1e6:.2f} us vs {r['native']['add_s'] * 1e6:.2f} us = "
                            f"{(r['dipu']['add_s'] - r['native']['add_s']) * 1e6:.2f} us over native (goal <= 1 us); "
                            f"training step {r['ratios']['step_s']:.3f}x "
                            f"(goal <= 1.05){'' if r['goals_met'] else '; a goal is missed'}"))
    header = (f"`make gpu-check` on {gpu}, {datetime.date.today().isoformat()}, torch {torch.__version__}: "
              f"{'PASS' if report.passed else 'FAIL'} in {BUDGET_S - (deadline - time.monotonic()):.0f} s")
    table = report.markdown(header)
    print(table)
    if not args.no_docs:
        text = DOC.read_text()
        if BEGIN in text and END in text:
            before, rest = text.split(BEGIN, 1)
            DOC.write_text(before + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
            print(f"gpu-check: the table is in {DOC.relative_to(ROOT)}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
