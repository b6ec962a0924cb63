"""``ditorch ps leader|follower``: run the Di-PS leader or a follower PS; ``ditorch ps bytes``:
what an outer round moves per cluster under each codec.

Also runnable as ``python -m dips.cli ...`` (the same arguments, without the ``ps``).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-token-file", required=True,
                   help="file holding the secret the leader and followers share (not the clusters' job token)")
    p.add_argument("--advertise", default=None,
                   help="HOST:PORT peers dial (default: --bind, or for 0.0.0.0 the address that routes to the peer)")
    p.add_argument("--tls-ca", default=None, help="CA certificate the job's gRPC servers are checked against")
    p.add_argument("--tls-cert", default=None, help="this server's TLS certificate (gRPC)")
    p.add_argument("--tls-key", default=None, help="this server's TLS private key (gRPC)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _tls(args: argparse.Namespace):
    from .rpc import Tls

    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if not args.tls_ca:
        raise ValueError("TLS needs --tls-ca (the CA that signed the servers' certificates)")
    return Tls(args.tls_ca, args.tls_cert, args.tls_key)


def _add_commands(sub) -> None:
    lead = sub.add_parser("leader", help="run the leader PS (control flow, gRPC)")
    lead.add_argument("--bind", default="127.0.0.1:7000", help="HOST:PORT of the control service")
    lead.add_argument("--followers", type=int, required=True, help="number of follower PSs")
    lead.add_argument("--token-file", required=True, help="file holding the job token clusters present")
    model = lead.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="model config: a YAML of the project's LLaMA (LlamaConfig fields), or a "
                                       "Hugging Face config.json or model directory")
    model.add_argument("--init", help="any model's initial parameters: torch.save({name: tensor}) of named_parameters()")
    model.add_argument("--seed-from-cluster", action="store_true",
                       help="the first cluster to join brings the model: its parameters become the global ones")
    lead.add_argument("--mode", default="dips", choices=["dips", "sync", "async"],
                      help="dips: grace time + penalty; sync: DiLoCo; async: async DiLoCo without penalty")
    lead.add_argument("--seed", type=int, default=0, help="seed of the initial parameters")
    lead.add_argument("--outer-lr", type=float, default=0.7)
    lead.add_argument("--outer-momentum", type=float, default=0.8)
    lead.add_argument("--alpha", type=float, default=0.02, help="EMA factor of the norm statistics")
    lead.add_argument("--beta", type=float, default=3.0, help="outlier threshold scale")
    lead.add_argument("--clip-norm", type=float, default=1.0, help="clip the averaged pseudo-gradient (<=0: off)")
    lead.add_argument("--staleness-decay", type=float, default=0.0,
                      help="scale a push s versions stale by (1 + s) ** -decay (0: no staleness penalty)")
    lead.add_argument("--heartbeat", type=float, default=1.0, help="cluster heartbeat interval, seconds")
    lead.add_argument("--follower-heartbeat", type=float, default=1.0, help="follower heartbeat interval, seconds")
    lead.add_argument("--token-budget", type=int, default=None, help="stop after this many consumed tokens")
    lead.add_argument("--max-cluster-tokens-per-s", type=float, default=1e7,
                      help="refuse a push claiming more tokens than this rate since the cluster's last push")
    lead.add_argument("--metadata", default="dips-leader.json", help="metadata checkpoint file")
    lead.add_argument("--launch-followers", default="",
                      help="comma-separated HOST:PORT data addresses: run the followers here and relaunch them")
    lead.add_argument("--checkpoint-root", default="dips-followers",
                      help="checkpoint directories of launched followers (<root>/follower-<i>)")
    lead.add_argument("--no-restart-followers", action="store_true",
                      help="do not relaunch launched followers that stop heartbeating")
    _common(lead)
    lead.set_defaults(func=_checked(run_leader))

    fol = sub.add_parser("follower", help="run a follower PS (data flow, ZeroMQ)")
    fol.add_argument("--leader", default="127.0.0.1:7000", help="HOST:PORT of the leader")
    fol.add_argument("--bind", default="127.0.0.1:7100", help="HOST:PORT of the data socket")
    fol.add_argument("--checkpoint-dir", default=None, help="default: dips-follower-<port>")
    fol.add_argument("--keep-checkpoints", type=int, default=3)
    fol.add_argument("--checkpoint-every", type=int, default=1,
                     help="checkpoint every N versions, N <= 512 (sealed pushes stay on disk until one covers them)")
    fol.add_argument("--max-unsealed-pushes", type=int, default=32,
                     help="pushes staged at once (each at most this follower's slice); more are refused until sealed")
    fol.add_argument("--init", default=None, help="the leader's --init file, when it serves one")
    fol.add_argument("--index", type=int, default=None, help="slot to take (set by the leader it launched it)")
    _common(fol)
    fol.set_defaults(func=_checked(run_follower))

    dep = sub.add_parser("deploy", help="choose the cluster to host the PS: argmax_i B[i,:] . p")
    dep.add_argument("--bandwidth", required=True,
                     help="rows per candidate cluster, ';'-separated, of bandwidths to each training cluster, e.g. '10,1;5,5'")
    dep.add_argument("--throughput", required=True, help="training throughput of each training cluster, e.g. '4,1'")
    dep.set_defaults(func=_checked(run_deploy))

    cost = sub.add_parser("bytes", help="bytes a cluster moves per outer round under each push/pull codec")
    src = cost.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model config (as the leader's --model)")
    src.add_argument("--init", help="initial parameters file (as the leader's --init)")
    cost.add_argument("--push", default="bf16,int8,int4,topk,sparse", help="push codecs, comma-separated")
    cost.add_argument("--pull", default="bf16,int8,int4,topk,sparse", help="pull codecs, comma-separated")
    cost.add_argument("--clusters", type=int, default=4,
                      help="clusters pushing between a cluster's pulls: a nonzero pull after sparse pushes carries at "
                           "most the union of theirs (a leader without outer momentum)")
    cost.set_defaults(func=_checked(run_bytes))

    tok = sub.add_parser("token", help="write a fresh random job token file (mode 0600)")
    tok.add_argument("path", help="where to write the token, e.g. job.key")
    tok.set_defaults(func=_checked(run_token))


def register(subparsers) -> None:
    """Add ``ps`` with its ``leader`` and ``follower`` subcommands to the ``ditorch`` parser."""
    ps = subparsers.add_parser("ps", help="Di-PS parameter server (leader / follower)")
    _add_commands(ps.add_subparsers(dest="ps_command", metavar="ROLE", required=True))


def _checked(handler):
    """Bad input (a missing file, a wrong value) ends with one clear line, not a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (FileNotFoundError, ValueError, OSError) as exc:
            print(f"ditorch ps {args.ps_command}: error: {exc}", file=sys.stderr)
            return 2
    return run


def _serve(stop_fn, failure=lambda: None) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until ``failure()`` names why the server cannot go
    on (exit 1, so that a supervisor relaunches it)."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    why = None
    while not done.wait(0.5) and (why := failure()) is None:
        pass
    stop_fn()
    if why is not None:
        print(f"ditorch ps: error: {why}", file=sys.stderr)
        return 1
    return 0


def run_deploy(args: argparse.Namespace) -> int:
    from .deployment import choose_deployment

    def numbers(text: str) -> list[float]:
        try:
            return [float(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"expected comma-separated numbers, got {text!r}") from None

    bandwidth = [numbers(row) for row in args.bandwidth.split(";")]
    throughput = numbers(args.throughput)
    best = choose_deployment(bandwidth, throughput)
    for i, row in enumerate(bandwidth):
        score = sum(b * p for b, p in zip(row, throughput))
        print(f"candidate {i}: B.p = {score:g}{'  <- deploy the PS here' if i == best else ''}")
    return 0


def run_bytes(args: argparse.Namespace) -> int:
    from .codec import Codec
    from .layout import ModelLayout

    if args.model:
        from .model import build_model, load_config
        layout = ModelLayout.of(build_model(load_config(args.model), 0))
    else:
        import torch
        layout = ModelLayout.of_specs([(n, tuple(t.shape)) for n, t in
                                       torch.load(args.init, weights_only=True, map_location="cpu").items()])
    sizes = [sum(t.numel for t in u.tensors) for u in layout.units]
    push = [Codec.parse_push(c) for c in args.push.split(",")]
    pull = [Codec.parse(c) for c in args.pull.split(",")]
    if args.clusters < 1:
        raise ValueError(f"--clusters {args.clusters}: expected at least 1")

    def total(codec: Codec, pushed: Codec | None = None) -> int:
        if codec.fixed_size:
            return sum(codec.payload_bytes(n) for n in sizes)
        # nonzero: the entries the last --clusters pushes changed, at most (each push's kept values)
        return sum(min(codec.payload_bytes(n, min(n, args.clusters * pushed.kept(n))), 2 * n) for n in sizes)

    bf16 = 2 * total(Codec("bf16"))
    print(f"{sum(sizes)} parameters in {len(sizes)} units; BF16 both ways: {bf16} bytes per outer round")
    print(f"{'push':>16} {'pull':>16} {'bytes/round':>12} {'vs bf16':>8}")
    for a in push:
        for b in pull:
            n = total(a) + total(b, a)
            bound = "" if b.fixed_size else f"  (at most: the union of {args.clusters} pushes, or BF16)"
            print(f"{str(a):>16} {str(b):>16} {n:>12} {bf16 / n:>7.1f}x{bound}")
    print(f"a join's whole pull (once per cluster): {total(Codec('bf16'))} bytes in BF16 (bf16, nonzero, sparsebf16), "
          f"{total(Codec('int8'))} in int8 (any other compressed pull)")
    return 0


def run_token(args: argparse.Namespace) -> int:
    from .auth import JobToken

    JobToken.create(args.path)
    print(f"wrote a new job token to {args.path}")
    return 0


def run_leader(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .auth import JobToken
    from .leader import Leader, LeaderConfig
    from .model import load_config

    launch = tuple(a for a in args.launch_followers.split(",") if a)
    cfg = LeaderConfig(model=load_config(args.model) if args.model else None, init=args.init,
                       seed_from_cluster=args.seed_from_cluster,
                       n_followers=args.followers, bind=args.bind,
                       advertise=args.advertise, mode=args.mode, launch_followers=launch,
                       checkpoint_root=args.checkpoint_root, server_token_file=args.server_token_file,
                       seed=args.seed, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                       alpha=args.alpha, beta=args.beta, clip_norm=args.clip_norm if args.clip_norm > 0 else None,
                       staleness_decay=args.staleness_decay,
                       heartbeat_s=args.heartbeat, follower_heartbeat_s=args.follower_heartbeat, token_budget=args.token_budget, metadata=args.metadata,
                       max_cluster_tokens_per_s=args.max_cluster_tokens_per_s,
                       restart_followers=not args.no_restart_followers)
    leader = Leader(cfg, JobToken.from_file(args.token_file), JobToken.from_file(args.server_token_file), _tls(args))
    logging.getLogger("dips.leader").info("leader (%s) listening on %s for %d followers", args.mode,
                                          leader.address, args.followers)
    return _serve(leader.stop)


def run_follower(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from diutil.address import split
    from .auth import JobToken
    from .follower import Follower

    ckpt = args.checkpoint_dir or f"dips-follower-{split(args.bind)[1]}"
    follower = Follower(args.leader, args.bind, JobToken.from_file(args.server_token_file), ckpt,
                        keep_checkpoints=args.keep_checkpoints, checkpoint_every=args.checkpoint_every,
                        max_unsealed_pushes=args.max_unsealed_pushes,
                        index=args.index, advertise=args.advertise,
                        tls=_tls(args), init=args.init)
    return _serve(follower.stop, follower.failure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dips.cli", description=__doc__.splitlines()[0])
    _add_commands(parser.add_subparsers(dest="ps_command", metavar="ROLE", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
