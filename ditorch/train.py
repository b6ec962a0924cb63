"""Train one model over a HeteroPP plan: ``torchrun --nproc-per-node N -m ditorch.train --plan plan.json``.

Every rank takes its stage, chip, TP and DP place from the plan; all groups run on ``dicomm``.
``--reference`` runs the same model on the same batches in one CPU process in fp32 instead,
for ``ditorch mre``. Multi-host runs use torchrun's rendezvous (``--nnodes``, ``--rdzv-endpoint``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from heteropp.runtime.boundary import RESHARD_MODES
    from heteropp.runtime.trainer import PRECISIONS, SCHEDULES

    p = argparse.ArgumentParser(prog="python -m ditorch.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="plan.json written by `ditorch plan`")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (over all stages)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="bf16 autocast on the chips, or fp32")
    p.add_argument("--schedule", default=None, help=f"one of {', '.join(SCHEDULES)} or a CSV of actions "
                                                    "(torch.distributed.pipelining's form); default: the plan's")
    p.add_argument("--reshard", choices=RESHARD_MODES, default="srag",
                   help="stage boundaries: send-receive + all-gather (srag) or whole tensors from one rank")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="replicate activations over TP ranks instead of cutting them along the sequence")
    p.add_argument("--zero1", action="store_true", help="ZeRO-1: shard AdamW's state over each stage's DP group, as a plan's memory and update "
                        "estimates assume at DP > 1 (no effect at DP 1)")
    p.add_argument("--check-replicas", type=int, default=0, metavar="N",
                   help="every N steps and at the end, check each stage's DP replicas hold equal parameters")
    p.add_argument("--memory-scale", type=float, default=None, help="chip memory scale (default $DITORCH_MEMORY_SCALE)")
    # Not "--log": torchrun's parser reads it as an abbreviation of its own --log-dir and stops.
    p.add_argument("--loss-log", type=Path, default=None, help="per-step loss log (JSON lines) for `ditorch mre`")
    p.add_argument("--trace", type=Path, default=None, help="Chrome trace JSON of every rank's actions")
    p.add_argument("--profile-steps", default=None, metavar="A-B|N",
                   help="torch.profiler trace of steps A-B (or N steps after the first) with the dipu kernels: "
                        "one Chrome trace per rank, PROFILE_DIR/rank<R>.json (docs/compile.md)")
    p.add_argument("--profile-dir", type=Path, default=Path("profile"), help="where --profile-steps writes")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each stage's decoder layers (regional compilation, Inductor; docs/compile.md)")
    p.add_argument("--data", type=Path, default=None,
                   help="token file (flat uint16/uint32 token ids, e.g. from `ditorch data prepare`); "
                        "default: the built-in byte corpus")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                   help="the token file's dtype (default: its .json sidecar's, else uint16)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps and at the end, log the loss on held-out tokens (the last 10%% of the data)")
    p.add_argument("--eval-batches", type=int, default=1, help="global batches of held-out tokens per evaluation")
    p.add_argument("--save", type=Path, default=None,
                   help="checkpoint directory (written at the end; a Hugging Face model also as hf-<step>/)")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--resume", type=Path, default=None, help="continue from a checkpoint written under any plan")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails the run")
    p.add_argument("--ps", default=None, metavar="HOST:PORT",
                   help="train as one cluster of a Di-PS job: every --inner-steps steps push to / pull from this leader")
    p.add_argument("--inner-steps", type=int, default=64, help="steps between outer steps (with --ps)")
    p.add_argument("--ps-token-file", type=Path, default=None, help="the job token (with --ps)")
    p.add_argument("--ps-name", default=None, help="this cluster's stable id at the PS (with --ps)")
    p.add_argument("--ps-tls-ca", default=None, help="CA of the leader's TLS certificate (with --ps)")
    p.add_argument("--ps-push", default="bf16", metavar="CODEC",
                   help="how pushes travel: bf16 (parameters), int8, int4, sign[:FRACTION], topk[:DENSITY], "
                        "sparse[:DENSITY] or sparseloco[:DENSITY] (a compressed pseudo-gradient with error feedback, "
                        "decaying for sparseloco; docs/dips.md) (with --ps)")
    p.add_argument("--ps-pull", default="bf16", metavar="CODEC",
                   help="how pulls travel: bf16 (parameters), int8, int4, sign[:FRACTION], topk[:DENSITY], "
                        "sparse[:DENSITY] (the change since the version held; a join's whole pull in int8), nonzero "
                        "(the changed values exactly; a join in BF16) or sparsebf16[:DENSITY] (each chunk's largest "
                        "changes in BF16, a bounded size; a join in BF16) (with --ps)")
    p.add_argument("--ps-fragments", type=int, default=1,
                   help="stream each push: send its units in this many parts over the inner steps (with --ps; "
                        "1: all at the outer step)")
    p.add_argument("--ps-state-dir", type=Path, default=None,
                   help="where each worker keeps its compression residual across restarts (with --ps; "
                        "default: <--save>/ps when --save is given)")
    p.add_argument("--ft", action="store_true",
                   help="run one DP replica of the plan as a torchft replica group (docs/ft.md): with --lighthouse, --replica")
    p.add_argument("--lighthouse", default=None, metavar="http://HOST:PORT", help="the torchft lighthouse (with --ft)")
    p.add_argument("--replica", type=int, default=None, metavar="K", help="which DP replica of the plan this is (with --ft)")
    p.add_argument("--replica-name", default=None, help="the replica's name in messages (with --ft; default replicaK)")
    p.add_argument("--min-replicas", type=int, default=1, help="replicas a step needs to commit (with --ft)")
    p.add_argument("--reference", action="store_true", help="run the single-process CPU fp32 reference instead")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from heteropp.plan import Plan, PlanError
    from heteropp.runtime.trainer import TrainOptions

    try:
        profile = None  # --profile-steps: (first, last) and the trace folder
        if args.profile_steps is not None:
            from ditorch_ext.profiler import parse_profile_steps
            profile = (parse_profile_steps(args.profile_steps), Path(args.profile_dir))
        plan = Plan.from_json(args.plan)
        options = TrainOptions(
            steps=args.steps, lr=args.lr, clip=args.clip, seed=args.seed, precision=args.precision, schedule=args.schedule,
            reshard=args.reshard, sequence_parallel=args.sequence_parallel, memory_scale=args.memory_scale,
            log=args.loss_log, trace=args.trace, data=args.data, data_dtype=args.data_dtype, save=args.save,
            save_every=args.save_every, resume=args.resume, zero1=args.zero1, check_replicas=args.check_replicas,
            eval_every=args.eval_every, eval_batches=args.eval_batches,
            progress=not args.quiet)
    except (PlanError, ValueError, OSError) as exc:
        print(f"ditorch.train: {exc}", file=sys.stderr)
        return 2
    if args.ps and not args.ps_token_file:
        print("ditorch.train: --ps needs --ps-token-file (the job token clusters hold)", file=sys.stderr)
        return 2
    if args.ps:
        from dips.codec import Codec
        try:
            Codec.parse_push(args.ps_push)
            Codec.parse(args.ps_pull)
        except ValueError as exc:
            print(f"ditorch.train: --ps-push/--ps-pull: {exc}", file=sys.stderr)
            return 2
        if not 1 <= args.ps_fragments <= args.inner_steps:
            print(f"ditorch.train: --ps-fragments {args.ps_fragments}: expected 1..--inner-steps ({args.inner_steps})",
                  file=sys.stderr)
            return 2
    if args.ft and (args.lighthouse is None or args.replica is None):
        print("ditorch.train: --ft needs --lighthouse http://HOST:PORT and --replica K", file=sys.stderr)
        return 2
    if args.reference:
        return _reference(plan, options)
    return _distributed(plan, options, args.timeout, args if args.ps else None, args if args.ft else None,
                        compile_layers=args.compile, profile=profile)


LINK_STATE_DIR, LINK_STATE_PREFIX = Path("/dev/shm"), "ditorch-links-"


def _emulate_links(plan, timeout: float) -> Path | None:
    """Emulated chips talk over the fleet's links, as they compute at their datasheets' speed:
    this rank's dicomm paces its pairs to the plan's links at the run's time scale
    (heteropp/placement.py; docs/dicomm.md, "Emulated links"). A vendor whose chips run at their
    own speed keeps its own links, and DITORCH_EMULATED_LINKS=0 keeps the host's. Returns the
    links' state file, whose name :func:`_release_link_state` removes once every rank mapped it."""
    import atexit

    from heteropp.placement import link_env
    from heteropp.plan import PlanError
    from heteropp.runtime.trainer import run_time_scale

    if os.environ.get("DITORCH_VENDOR", "emu") not in ("emu", "cpu") or \
            os.environ.get("DITORCH_EMULATED_LINKS", "1") == "0" or "RANK" not in os.environ:
        return None
    try:
        scale = run_time_scale(plan)
    except PlanError:
        return None  # the trainer refuses the run, naming why
    _reap_link_states(timeout)
    job = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}".replace("/", "_")
    state = LINK_STATE_DIR / f"{LINK_STATE_PREFIX}{os.getuid()}-{job}"
    os.environ.update(link_env(plan, int(os.environ["RANK"]), scale, str(state)))
    # A rank that leaves before the others mapped the file (a failed start) takes the name with it.
    atexit.register(lambda: state.unlink(missing_ok=True))
    return state


def _release_link_state(state: Path | None) -> None:
    """Remove the links' state file's name once every rank has mapped it (dicomm maps it as it
    makes the default group, and later groups reuse that mapping): the mappings hold the links'
    occupancy for the job, and nothing is left in /dev/shm however the job ends."""
    import torch.distributed as dist

    if state is None:
        return
    dist.barrier()
    state.unlink(missing_ok=True)


def _reap_link_states(timeout: float) -> None:
    """Remove this user's state files of jobs that died before their ranks all mapped them: a
    live job's file has a name only until its group is made, which its start timeout bounds."""
    import time

    stale = time.time() - timeout
    for path in LINK_STATE_DIR.glob(f"{LINK_STATE_PREFIX}{os.getuid()}-*"):
        try:
            if path.stat().st_mtime < stale:
                path.unlink(missing_ok=True)
        except OSError:
            continue  # another job reaped it first


def _reference(plan, options) -> int:
    import torch

    from heteropp.runtime.reference import train_reference

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"reference: {plan.model.name}, {plan.model.n_layers} layers, one CPU process, fp32, {options.steps} steps")
    train_reference(plan, options)
    return 0


def _distributed(plan, options, timeout: float, ps_args=None, ft_args=None, compile_layers: bool = False,
                 profile: tuple[tuple[int, int], Path] | None = None) -> int:
    import torch
    import torch.distributed as dist

    import ditorch  # noqa: F401  (the dipu device and the dicomm backend)
    from heteropp.plan import PlanError
    from heteropp.runtime.checkpoint import CheckpointError
    from heteropp.runtime.trainer import PipelineTrainer
    from heteropp.runtime.training_run import TrainingRun

    # Ranks outnumber cores here; one intra-op thread each keeps them from fighting over cores
    # and lets the chip emulation charge each kernel its own CPU time.
    torch.set_num_threads(int(os.environ.get("DITORCH_THREADS_PER_RANK", "1")))
    link_state = _emulate_links(plan, timeout)
    dist.init_process_group("dicomm", timeout=datetime.timedelta(seconds=timeout))
    _release_link_state(link_state)
    rank = dist.get_rank()
    if ft_args is not None:
        code = _fault_tolerant(plan, options, timeout, ft_args, rank)
        dist.destroy_process_group()
        return code
    try:
        trainer = PipelineTrainer(plan, options)
        if compile_layers:
            trainer.module.compile_layers()
        if options.resume:
            trainer.resume(options.resume)
        vendors = [None] * dist.get_world_size()  # a job may span vendors: one per host
        dist.all_gather_object(vendors, ditorch.vendor_name())
        if rank == 0:
            _describe(trainer, vendors)
        outer = _outer_client(trainer, ps_args) if ps_args else None
        after_step = _outer_steps(outer, trainer) if outer else None
        profiler = _step_profiler(profile, rank)
        if profiler is not None:
            after_step = profiler.wrap(after_step)
            profiler.before_run()
        TrainingRun(trainer).run(after_step=after_step)
        if profiler is not None:
            profiler.close()
        if outer is not None:  # the last outer step's push is committed (or said not to be) before leaving
            left = outer.close()
            if rank == 0:
                print(f"ditorch.train: Di-PS: {left['pushed']} pushes sealed, {left['applied']} applied, "
                      f"{left['rejected']} rejected, {left['failed']} failed, {left['skipped']} outer steps skipped; "
                      f"global version {left['version']}"
                      + (f"; push {left['pending']} still uncommitted" if left["pending"] else ""), flush=True)
    except (PlanError, ValueError, KeyError, FileNotFoundError) as exc:
        print(f"ditorch.train: rank {rank}: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:  # every rank learns it: the group is whole, leave it cleanly
        print(f"ditorch.train: rank {rank}: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 1
    except Exception as exc:  # a peer or transport failure: name this rank, then leave
        print(f"ditorch.train: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # the group is broken; a clean shutdown would wait on the dead peer
    dist.destroy_process_group()
    return 0


def _step_profiler(profile: tuple[tuple[int, int], Path] | None, rank: int):
    """The torch.profiler of --profile-steps for this rank, or None."""
    if profile is None:
        return None
    from ditorch_ext.profiler import StepProfiler

    (first, last), folder = profile
    return StepProfiler(first, last, folder / f"rank{rank}.json")


def _outer_client(trainer, args):
    """Join the Di-PS job as one pipeline cluster."""
    from dips.client import OuterClient
    from ditorch.ps_pipeline import PipelineStages
    from dips.rpc import Tls

    state_dir = args.ps_state_dir or (args.save / "ps" if args.save else None)
    outer = OuterClient(PipelineStages(trainer), args.ps, args.inner_steps, token_file=args.ps_token_file,
                        name=args.ps_name, join=False, tls=Tls(args.ps_tls_ca) if args.ps_tls_ca else None,
                        push_codec=args.ps_push, pull_codec=args.ps_pull, state_dir=state_dir,
                        fragments=args.ps_fragments)
    if not outer.join(timeout_s=120.0):
        raise ValueError(f"could not join the Di-PS leader at {args.ps} within 120 s")
    return outer


def _outer_steps(outer, trainer):
    """The hook that runs the cluster's outer steps after each training step."""
    from heteropp.runtime.trainer import global_batch_size

    tokens = global_batch_size(trainer.plan) * trainer.plan.model.seq

    def after_step(step: int) -> bool:
        outer.step(tokens=tokens)
        return outer.done

    return after_step


def _fault_tolerant(plan, options, timeout: float, args, rank: int) -> int:
    """One replica of the plan under torchft (ditorch/ft.py); a failure exits as _distributed's do."""
    from ditorch.ft import FTOptions, ReplicaMismatch, run_replica
    from heteropp.plan import PlanError

    try:
        return run_replica(plan, options, FTOptions(args.lighthouse, args.replica, args.replica_name, args.min_replicas),
                           timeout)
    except (PlanError, ValueError, ReplicaMismatch, ConnectionError) as exc:
        print(f"ditorch.train: rank {rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # the replica's peers learn it from its group's end; nothing to wait for
    except Exception as exc:
        print(f"ditorch.train: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)


def _describe(trainer, vendors: list[str]) -> None:
    plan, o = trainer.plan, trainer.options
    print(f"ditorch.train: {plan.model.name} ({plan.model.n_layers} layers) over {plan.num_stages} stages, "
          f"{plan.num_chips} ranks, DP {plan.dp}, {plan.num_microbatches} micro-batches of {plan.model.seq} tokens, "
          f"schedule {trainer.schedule.name}, {o.precision}, reshard {o.reshard}, "
          f"sequence parallelism {'on' if o.sequence_parallel else 'off'}")
    for i, s in enumerate(plan.stages):
        on = "/".join(sorted({vendors[r] for r in range(*s.rank_range)}))
        print(f"  stage {i}: chip {s.chip} on {on} ranks {list(range(*s.rank_range))} tp {s.tp} dp {s.dp} "
              f"layers {list(s.layer_range)}{' recompute' if s.recompute else ''}")


if __name__ == "__main__":
    sys.exit(main())
