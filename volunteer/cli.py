"""``ditorch volunteer plan|server|client|reference|token``: allocate a fleet, run a stage
server, join as a client, train the job's single-process reference, write a job token."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("volunteer", help="training on unreliable devices: plan, server, client")
    sub = p.add_subparsers(dest="volunteer_command", metavar="SUBCOMMAND", required=True)

    plan = sub.add_parser("plan", help="allocate reliable and unreliable devices to stages")
    plan.add_argument("--devices", required=True, help="devices.yaml: devices, delays and bandwidths")
    plan.add_argument("--model", required=True, help="model config: a YAML of the project's LLaMA (LlamaConfig "
                                                     "fields), or a Hugging Face config.json or model directory")
    plan.add_argument("--data", default="", help="token file the first and last stages' servers read (default: the "
                                                 "built-in byte corpus); the same path on every server")
    plan.add_argument("--data-dtype", choices=("uint16", "uint32"), default="", help="the token file's dtype")
    plan.add_argument("--batch", type=int, default=64, help="samples per batch (the paper's B)")
    plan.add_argument("--microbatches", type=int, default=8, help="micro-batches per batch (the paper's d)")
    plan.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's max_seq_len)")
    plan.add_argument("--steps", type=int, default=100, help="batches to train")
    plan.add_argument("--lr", type=float, default=1e-3)
    plan.add_argument("--weight-decay", type=float, default=0.0)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--delayed-updates", action="store_true", help="DPU: compute step s with step s-1's parameters")
    plan.add_argument("--rule", choices=["full", "paper"], default="full",
                      help="how a clustering level is scored (docs/volunteer.md)")
    plan.add_argument("--out", default="alloc.json")
    plan.set_defaults(func=run_plan)

    srv = sub.add_parser("server", help="run one reliable device's stage server")
    srv.add_argument("--alloc", required=True, help="alloc.json written by 'plan'")
    srv.add_argument("--id", required=True, help="this device's name in the allocation")
    srv.add_argument("--server-token-file", required=True,
                     help="file holding the servers' own secret (not given to clients): servers prove to "
                          "each other with it that they are servers ('ditorch volunteer token' writes one)")
    srv.add_argument("--bind", default=None,
                     help="HOST:PORT to listen on (default: loopback at the port of its address in the fleet)")
    srv.add_argument("--metrics", default=None,
                     help="append each step's loss here (a loss log, as 'ditorch mre' reads; the last stage's first server)")
    _common(srv)
    srv.set_defaults(func=run_server)

    cli = sub.add_parser("client", help="compute for a stage until the job ends or you stop it")
    cli.add_argument("--join", required=True, help="HOST:PORT of any server of the job")
    cli.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}")
    cli.add_argument("--tflops", type=float, default=1.0, help="this device's compute, to size its tasks")
    cli.add_argument("--stage", type=int, default=None, help="join this stage (default: the one it reaches best)")
    cli.add_argument("--emulate-tflops", type=float, default=None,
                     help="emulate a chip of this speed by sleeping out the rest of each task")
    cli.add_argument("--leave-after", type=float, default=None, help="leave (saying so) after this many seconds")
    cli.add_argument("--device", default="cpu", help="where to compute: cpu, dipu (after 'import ditorch'), ...")
    cli.add_argument("--join-when", default=None, metavar="PATH",
                     help="start now, join once PATH exists: a launcher starts the client ahead (importing torch "
                          "takes seconds) and lets it join at an event of its own")
    _common(cli)
    cli.set_defaults(func=run_client)

    ref = sub.add_parser("reference", help="train the job in one process: the loss curve the job must equal")
    ref.add_argument("--alloc", required=True, help="alloc.json written by 'plan'")
    ref.add_argument("--loss-log", required=True, help="write each step's loss here (JSON lines, as 'ditorch mre' reads)")
    ref.set_defaults(func=run_reference)

    tok = sub.add_parser("token", help="write a fresh random job token file (mode 0600)")
    tok.add_argument("path")
    tok.set_defaults(func=lambda a: _token(a.path))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", required=True, help="file holding the job's shared secret")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")


def _token(path: str) -> int:
    from dips.auth import JobToken

    JobToken.create(path)
    print(f"wrote a job token to {path}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    import sys

    try:
        out = _allocation(args)
    except (ValueError, KeyError, OSError) as exc:
        print(f"ditorch volunteer plan: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    tried = ", ".join("-" if t is None else f"{t:.3f}" for t in out["level_times_s"])
    print(f"{len(out['stages'])} stage(s), predicted {out['makespan_s']:.3f} s per batch (levels tried: {tried})")
    for k, s in enumerate(out["stages"]):
        layers = s["layers"]
        print(f"stage {k}: layers {layers[0]}-{layers[1] - 1}  frontal {', '.join(s['frontal'])}  "
              f"backward {', '.join(s['backward'])}  clients {', '.join(s['clients']) or '-'}")
    print(f"wrote {args.out}")
    return 0


def _allocation(args: argparse.Namespace) -> dict:
    """The allocation ``alloc.json`` holds, with its training section, checked as a job."""
    import yaml

    from heteropp.model_spec import ModelSpec

    from .allocate import allocate
    from .cost import Workload
    from .devices import Fleet
    from .job import Job

    fleet = Fleet.from_yaml(args.devices)
    spec = ModelSpec.load(args.model, seq=args.seq)
    if spec.hf_config:
        model = json.loads(spec.hf_config)
    else:
        with open(args.model) as f:
            model = yaml.safe_load(f)
    work = Workload.for_model(args.model, args.batch, args.microbatches, seq=spec.seq)
    alloc = allocate(fleet, work, rule=args.rule)
    out = alloc.to_dict()
    out["training"] = {"model": model, "seq": spec.seq, "steps": args.steps, "seed": args.seed, "lr": args.lr,
                       "weight_decay": args.weight_decay, "delayed_updates": args.delayed_updates,
                       "data": str(args.data), "data_dtype": args.data_dtype}
    training = dict(out["training"])
    # refuse now what the servers would refuse (addresses may be added to the fleet later)
    Job.from_allocation(out, training.pop("model"), require_addresses=False, **training)
    return out


def load_job(path: str):
    from .job import Job

    alloc = json.loads(Path(path).read_text())
    if "training" not in alloc:
        raise ValueError(f"{path} has no 'training' section; write it with 'ditorch volunteer plan'")
    training = dict(alloc["training"])
    return Job.from_allocation(alloc, training.pop("model"), **training)


def run_server(args: argparse.Namespace) -> int:
    from dips.auth import JobToken

    from .security import JobKeys
    from .server import StageServer

    _logging(args.log_level)
    job = load_job(args.alloc)
    keys = JobKeys(JobToken.from_file(args.token_file), JobToken.from_file(args.server_token_file))
    server = StageServer(job, args.id, keys, bind=args.bind)
    logger = None
    if args.metrics and hasattr(server.role, "on_loss"):
        from diutil.loss_log import LossLogger

        logger = LossLogger(args.metrics, append=True)
        server.role.on_loss = lambda step, loss: logger.log(step, loss, job.batch * job.seq)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.run()
    finally:
        if logger is not None:
            logger.close()
    return 0


def run_reference(args: argparse.Namespace) -> int:
    from diutil.loss_log import LossLogger

    from .reference import reference_run

    job = load_job(args.alloc)
    losses, _ = reference_run(job)
    with LossLogger(args.loss_log) as log:
        for step, loss in enumerate(losses):
            log.log(step, loss, job.batch * job.seq)
    print(f"trained {job.steps} step(s) in one process; final loss {losses[-1]:.4f}; wrote {args.loss_log}")
    return 0


def run_client(args: argparse.Namespace) -> int:
    from dips.auth import JobToken

    from .client import Client
    from .join import choose_stage, fetch_job
    from .security import JobKeys

    _logging(args.log_level)
    keys = JobKeys(JobToken.from_file(args.token_file))
    if args.device.startswith("dipu"):
        import ditorch_ext  # noqa: F401  (registers the dipu device)
    if args.join_when:
        while not os.path.exists(args.join_when):  # a launcher's event; the process is ready to compute
            time.sleep(0.1)
    job = fetch_job(args.join, keys)
    stage = args.stage if args.stage is not None else choose_stage(job, keys)
    if not 0 <= stage < len(job.stages):
        raise ValueError(f"--stage {stage}; the job has stages 0-{len(job.stages) - 1}")
    logging.getLogger("volunteer.client").info("%s joins stage %d", args.name, stage)
    client = Client(job, stage, args.name, keys, flops=args.tflops * 1e12, device=args.device,
                    emulate_flops=args.emulate_tflops and args.emulate_tflops * 1e12, leave_after=args.leave_after)
    signal.signal(signal.SIGTERM, lambda *_: client.stop())
    done = client.run()
    logging.getLogger("volunteer.client").info("%s computed %d task(s) for stage %d", args.name, done, stage)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m volunteer.cli")
    register(parser.add_subparsers())
    a = parser.parse_args(["volunteer", *sys.argv[1:]])
    sys.exit(a.func(a))
