"""Fault-tolerant data parallelism: a plan's DP replicas as torchft replica groups.

``ditorch.train --ft`` runs one replica of a plan: a whole pipeline over its chips (the plan's
stages with their TP, DP 1), launched by its own ``torchrun``. The replicas average their
gradients through torchft's Manager over a ``dicomm`` group per quorum
(``dicomm.torchft_group``), so they may sit on different vendors. A torchft lighthouse
(``ditorch ft lighthouse``) forms the quorums: a replica that dies is dropped while the others go
on; when it is started again it recovers the parameters and optimizer state from a healthy
replica (torchft's checkpoint transport) and rejoins. docs/ft.md has the design and the numbers.

Replica ``k`` trains on rows ``k`` of every global batch, as DP replica ``k`` of the plan does;
the gradient is summed over the replicas in the quorum with the plan's loss scale and rescaled
by ``dp / participants`` when some are missing, so with every replica present and fp32 the run is
the plan's plain DP run bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import sys
import time
import urllib.parse
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from dimodel.datasets import step_batch
from heteropp.plan import Plan, PlanError, StagePlan
from heteropp.runtime.stage_update import all_reduce_flat, clip_coefficient, squared_norm, step_flat
from heteropp.runtime.trainer import PipelineTrainer, TrainOptions, global_batch_size
from heteropp.runtime.trace import now

IDENTITY_BYTES = 512  # one replica's record in the identity exchange of each quorum


class ReplicaMismatch(RuntimeError):
    """A replica in the quorum trains another model or plan than this one."""


def replica_plan(plan: Plan) -> Plan:
    """One DP replica of ``plan``: its stages with DP 1 on ranks from 0, the same micro-batches."""
    stages, rank = [], 0
    for s in plan.stages:
        stages.append(dataclasses.replace(s, dp=1, first_rank=rank))
        rank += s.tp
    return dataclasses.replace(plan, dp=1, stages=tuple(stages),
                               global_batch_tokens=plan.global_batch_tokens // plan.dp)


def plan_digest(plan: Plan) -> str:
    """What replicas must agree on: the model, the stages and the batch (not the cluster)."""
    d = plan.to_dict()
    key = {k: d[k] for k in ("model", "global_batch_tokens", "micro_batch_size", "dp", "schedule")}
    key["stages"] = [{k: s[k] for k in ("chip", "tp", "layers", "layer_range", "recompute")} for s in d["stages"]]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def check_lighthouse_address(address: str) -> str:
    """``http://host:port`` (a bare ``host:port`` gets the scheme), or ValueError naming it."""
    text = address if "://" in address else f"http://{address}"
    parsed = urllib.parse.urlparse(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None or not 0 < port < 65536 or parsed.path not in ("", "/"):
        raise ValueError(f"lighthouse address {address!r}: expected http://HOST:PORT (the address "
                         f"`ditorch ft lighthouse` prints)")
    return f"http://{parsed.netloc}"


def _replica_group_class():
    from dicomm.torchft_group import ProcessGroupDicommFT

    class ReplicaGroup(ProcessGroupDicommFT):
        """The dicomm group of one quorum that, once made, exchanges each member's identity
        (name, plan digest, step): a replica with another plan is named, and so are the
        replicas that left or joined since the last quorum."""

        def __init__(self, identity: dict, timeout: datetime.timedelta):
            super().__init__(timeout=timeout)
            self.identity = identity
            self.step_of = lambda: 0
            self.members: list[dict] = []
            self.mismatch: str | None = None

        def configure(self, store_addr, replica_id, rank, world_size, *args, **kwargs) -> None:
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
            mine = dict(self.identity, step=self.step_of())
            raw = json.dumps(mine).encode()
            if len(raw) > IDENTITY_BYTES:
                raise ValueError(f"replica identity of {len(raw)} bytes exceeds {IDENTITY_BYTES}: use a shorter name")
            buf = torch.zeros(IDENTITY_BYTES, dtype=torch.uint8)
            buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            out = [torch.zeros_like(buf) for _ in range(world_size)]
            self.allgather([out], [buf], AllgatherOptions()).wait()
            members = []
            for o in out:  # bounded: every record is IDENTITY_BYTES long, parsed as JSON only
                text = bytes(o.numpy()).rstrip(b"\0").decode("utf-8", errors="replace")
                try:
                    members.append(json.loads(text))
                except json.JSONDecodeError:
                    members.append({"name": f"<unreadable record {text[:40]!r}>", "plan": "?", "step": -1})
            self._report_changes(members)
            self.members = members
            self.mismatch = _mismatch(mine, members)

        def _report_changes(self, members: list[dict]) -> None:
            if self.identity.get("group_rank", 0) != 0:
                return
            before = {m.get("name") for m in self.members}
            after = {m.get("name") for m in members}
            for name in sorted(after - before - {self.identity["name"]}):
                print(f"ditorch ft: replica {name!r} joined the quorum", flush=True)
            for name in sorted(before - after):
                print(f"ditorch ft: replica {name!r} left the quorum (dropped)", flush=True)

    return ReplicaGroup


def _mismatch(mine: dict, members: list[dict]) -> str | None:
    """Why this replica must leave: a member with another plan that has trained at least as far
    (or as far, with a lower name), so the replica already training keeps going."""
    for m in members:
        if m.get("plan") == mine["plan"]:
            continue
        step = m.get("step", -1)
        if step > mine["step"] or (step == mine["step"] and str(m.get("name")) < mine["name"]):
            return (f"replica {m.get('name')!r} trains plan {m.get('plan')} (model and stages) at step {m.get('step')}, "
                    f"this replica {mine['name']!r} trains plan {mine['plan']}: replicas of one job must run the same "
                    f"plan; this one leaves")
    return None


class ReplicaUpdate:
    """A stage's update in one replica: StageUpdate's order (TP-partial gradients over TP, a tied
    embedding's over the pipeline's ends, the DP sum, the global norm, the clipped AdamW step)
    with the DP sum taken by torchft's Manager over the quorum's replicas, and the step taken
    only when the Manager commits it."""

    def __init__(self, base, manager, dp: int):
        if base.zero is not None:
            raise ValueError("--ft with --zero1: ZeRO-1 shards the optimizer over DP, which --ft makes the quorum; "
                             "run without --zero1")
        self.base, self.manager, self.dp = base, manager, dp
        self.min_replicas = 1
        self.committed = True

    def apply(self, loss_sum: float) -> float:
        """Reduce, clip and step (when committed); returns the loss summed over the quorum."""
        b, m = self.base, self.manager
        partial = b.module.tp_partial_parameters()
        if partial:
            all_reduce_flat([p.grad for p in partial], b.groups.tp.group)
        if b.groups.tied is not None:
            b._sum_tied_gradients()
            b.module.tied_head().grad.div_(self.dp)  # StageUpdate divides by DP 1 here; the plan's is dp
        from torch.distributed import ReduceOp

        m.allreduce(b.flat.grad, reduce_op=ReduceOp.SUM).wait()
        n = m.num_participants()
        if n != self.dp:  # with every replica present the sum is already the plan's mean
            b.flat.grad.mul_(self.dp / n)
        owned = [b._owned(name, p) for name, p in b.module.named_parameters()]
        sumsq = squared_norm([p.grad for p, o in zip(b.module.parameters(), owned) if o], b.device)
        totals = torch.stack([sumsq, torch.tensor(loss_sum, dtype=torch.float64, device=b.device)])
        dist.all_reduce(totals)  # over this replica's pipeline
        loss = totals[1:].clone()
        m.allreduce(loss, reduce_op=ReduceOp.SUM).wait()
        coef = clip_coefficient(math.sqrt(totals[0].item()), b.clip)
        if m.current_step() > 0:  # past the job's first step (or healed to it): --min-replicas rules
            m._min_replica_size = self.min_replicas
        self.committed = m.should_commit()
        if self.committed:
            step_flat(b.flat, b.optimizer, coef)
        else:
            b.flat.zero_grad()
        return loss.item() * self.dp / max(n, 1)


class ReplicaTrainer(PipelineTrainer):
    """This rank's stage in replica ``index`` of ``plan`` (built on ``replica_plan(plan)``)."""

    def __init__(self, plan: Plan, options: TrainOptions, index: int):
        if not 0 <= index < plan.dp:
            raise PlanError(f"--replica {index}: the plan has DP {plan.dp}, so replicas 0..{plan.dp - 1}")
        super().__init__(replica_plan(plan), options)
        self.full_plan, self.index = plan, index
        # The plan's loss scale (1 / its global batch): replicas' sums then add up to plain DP's.
        self.executor.loss_scale = 1.0 / global_batch_size(plan)

    def step(self, step: int) -> float:
        """One training step on this replica's rows of global batch ``step``; returns the
        quorum's mean loss."""
        plan, rp = self.full_plan, self.plan
        rows = rp.num_microbatches * rp.micro_batch_size
        batch = step_batch(self.data, global_batch_size(plan), plan.model.seq, self.options.seed, step)
        tokens, targets = self._microbatches(batch[self.index * rows:(self.index + 1) * rows])
        losses = self.executor.run(step, tokens, targets)
        t_update = now()
        loss_sum = sum(losses) if self.module.is_last and self.place.tp_index == 0 else 0.0
        loss_total = self.update.apply(loss_sum)
        torch.dipu.synchronize()
        self.trace.record(f"{self.place.stage}UPDATE", "UPDATE", t_update, now(), step=step)
        return loss_total / (plan.num_microbatches * plan.dp)

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optim": self.update.base.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, p in self.module.state_dict().items():
                p.copy_(state["model"][name])  # in place: parameters are views of the flat buffer
        self.update.base.optimizer.load_state_dict(state["optim"])


@dataclasses.dataclass
class FTOptions:
    """How a replica joins the job (``ditorch.train --ft``)."""

    lighthouse: str
    replica: int
    name: str | None = None
    min_replicas: int = 1
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0


def run_replica(plan: Plan, options: TrainOptions, ft: FTOptions, timeout: float) -> int:
    """Train this rank's stage of replica ``ft.replica`` until step ``options.steps`` (every
    replica's rank calls this after ``init_process_group`` of its own pipeline)."""
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager

    from diutil.loss_log import LossLogger

    lighthouse = check_lighthouse_address(ft.lighthouse)
    rank = dist.get_rank()
    trainer = ReplicaTrainer(plan, options, ft.replica)
    name = ft.name or f"replica{ft.replica}"
    group = _replica_group_class()(
        {"name": name, "plan": plan_digest(plan), "group_rank": rank},
        timeout=datetime.timedelta(seconds=timeout))
    # A returning replica receives the current state over the quorum's dicomm group (torchft's
    # PGTransport), in host memory so the two ends may be of different vendors.
    transport = PGTransport(group, timeout=datetime.timedelta(seconds=timeout), device=torch.device("cpu"))
    try:
        manager = Manager(
            pg=group, checkpoint_transport=transport, load_state_dict=trainer.load_state_dict, state_dict=trainer.state_dict,
            min_replica_size=ft.min_replicas, replica_id=f"{name}_{ft.replica}", rank=rank,
            init_sync=False,  # every replica initialises from the same seed: nothing to sync at step 0
            world_size=dist.get_world_size(), store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]), lighthouse_addr=lighthouse,
            timeout=datetime.timedelta(seconds=timeout), quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout),
            connect_timeout=datetime.timedelta(seconds=ft.connect_timeout))
    except Exception as exc:
        raise ConnectionError(f"replica {name!r} could not start its torchft manager with the lighthouse at "
                              f"{lighthouse}: {exc}") from None
    group.step_of = manager.current_step
    # The first step waits for every replica of the plan (a replica alone would train on its own
    # rows and the others heal from it); --min-replicas applies from the next one. torchft has no
    # option for the first quorum: its Manager reads the attribute at each should_commit.
    manager._min_replica_size = max(ft.min_replicas, plan.dp)
    trainer.update = ReplicaUpdate(trainer.update, manager, plan.dp)
    trainer.update.min_replicas = ft.min_replicas
    started = time.monotonic()
    log = LossLogger(options.log, append=True) if options.log and rank == 0 else None
    tokens = global_batch_size(plan) * plan.model.seq
    try:
        while manager.current_step() < options.steps:
            manager.start_quorum(timeout=datetime.timedelta(seconds=ft.quorum_timeout))
            loss = trainer.step(manager.current_step())
            if group.mismatch:
                raise ReplicaMismatch(group.mismatch)
            # The step just committed, read after the commit: a replica that healed in this step
            # (the quorum runs asynchronously) is at the healthy replicas' step, not its own.
            step = manager.current_step()
            if step == 0 and time.monotonic() - started > ft.quorum_timeout:
                raise ReplicaMismatch(f"replica {name!r} waited {ft.quorum_timeout:g} s at the first step for the "
                                      f"plan's {plan.dp} replicas; the quorums held {manager.num_participants()}")
            if trainer.update.committed and log is not None:
                log.log(step, loss, step * tokens)
                if options.progress:
                    print(f"  step {step:>4}/{options.steps}  loss {loss:.4f}  replicas {manager.num_participants()}",
                          flush=True)
        if options.check_replicas:
            check_quorum_replicas(trainer, manager, name)
    finally:
        if log is not None:
            log.close()
        manager.shutdown(wait=False)
        group.shutdown()  # its threads end here, not in the interpreter's teardown
    return 0


def check_quorum_replicas(trainer: ReplicaTrainer, manager, name: str) -> None:
    """Raise ReplicaDivergence if the replicas of the current quorum hold different parameters on
    this rank's stage (each parameter's 64-bit digest, compared by a MAX of it and of its negation
    through the Manager: equal everywhere iff both maxima are this replica's own)."""
    from torch.distributed import ReduceOp

    from heteropp.runtime.replicas import ReplicaDivergence, parameter_digests

    named = list(trainer.module.named_parameters())
    mine = parameter_digests(named)
    # int64 digests exceed float precision: compare them as four exact 16-bit pieces each.
    pieces = torch.stack([(mine >> s) & 0xFFFF for s in (0, 16, 32, 48)]).double()
    both = torch.cat([pieces, -pieces]).reshape(-1)
    manager.start_quorum()
    manager.allreduce(both, reduce_op=ReduceOp.MAX).wait()
    n = pieces.numel()
    same = torch.equal(both[:n], pieces.reshape(-1)) and torch.equal(-both[n:], pieces.reshape(-1))
    if manager.errored():
        raise RuntimeError(f"replica {name!r}: the replica check failed: {manager.errored()}")
    if not same:
        differ = (both[:n] != pieces.reshape(-1)) | (-both[n:] != pieces.reshape(-1))
        bad = [named[i][0] for i in sorted(set(differ.reshape(4, -1).nonzero()[:, 1].tolist()))]
        raise ReplicaDivergence(f"replica {name!r}, stage {trainer.place.stage}: the {manager.num_participants()} "
                                f"replicas of the quorum differ in {len(bad)} parameters: {', '.join(bad[:5])}")


# -- the command line --------------------------------------------------------------------------
def lighthouse_main(args: argparse.Namespace) -> int:
    """``ditorch ft lighthouse``: torchft's lighthouse, serving until interrupted."""
    from torchft._torchft import LighthouseServer

    try:
        server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                                  quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as exc:
        print(f"ditorch ft lighthouse: cannot serve on {args.bind!r}: {exc}", file=sys.stderr)
        return 2
    print(f"ditorch ft lighthouse: {server.address()} (min {args.min_replicas} replicas); "
          f"replicas join with: torchrun ... -m ditorch.train --plan PLAN --ft --lighthouse {server.address()} "
          f"--replica K", flush=True)
    if args.address_file:
        Path(args.address_file).write_text(server.address() + "\n")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """``ditorch ft lighthouse``."""
    ft = sub.add_parser("ft", help="fault-tolerant data parallelism (torchft): the lighthouse")
    ftsub = ft.add_subparsers(dest="ft_command", metavar="SUBCOMMAND", required=True)
    lh = ftsub.add_parser("lighthouse", help="serve the torchft lighthouse that forms the replicas' quorums")
    lh.add_argument("--bind", default="[::]:29510", help="address to listen on (default [::]:29510; port 0: any)")
    lh.add_argument("--min-replicas", type=int, default=1, help="replicas a quorum needs (default 1)")
    lh.add_argument("--join-timeout-ms", type=int, default=1000,
                    help="how long a quorum waits for more replicas once it has the minimum (default 1000)")
    lh.add_argument("--quorum-tick-ms", type=int, default=100)
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                    help="a replica silent this long is dropped from the quorum (default 5000)")
    lh.add_argument("--address-file", type=Path, default=None, help="also write the address here")
    lh.set_defaults(func=lighthouse_main)
