"""DiComm vs gloo on local ranks, nccl-tests style: p2p latency/bandwidth and allreduce busbw.

    .venv/bin/python benchmarks/comm.py                 # 2 and 4 ranks, 8 B .. 256 MiB
    .venv/bin/python benchmarks/comm.py --quick         # fewer sizes, up to 64 MiB
    .venv/bin/python benchmarks/comm.py --hosts 2       # ranks split over two emulated hosts
    .venv/bin/python benchmarks/comm.py --load          # a busy process on every core meanwhile
    .venv/bin/python benchmarks/comm.py --quick --ranks 2 --sizes 8 --breakdown   # where an 8 B hop's time goes

As root, every run happens on emulated hosts (tests/emulated_hosts.py: network namespaces on a
bridge), each with net.ipv4.tcp_congestion_control set to --congestion (reno by default), so gloo
and dicomm's tcp run under the same congestion control without touching the machine's settings;
elsewhere it runs on loopback and prints the algorithm each side used. CPU time per operation
(rank 0's process, all its threads) is printed beside wall time: a waiter that spins shows up
there, and under --load it takes the core from the rank it waits for.

Conventions (as nccl-tests): one-way latency = median round trip / 2 of a ping-pong between
ranks 0 and 1; p2p bandwidth = bytes / one-way time; allreduce algbw = bytes / time and
busbw = algbw * 2 (n - 1) / n. The table prints dicomm/gloo ratios and the issue's targets; a
PNG plot goes to --out. The same ping-pong over one plain blocking socket (raw-tcp, no torch
framing) shows what a single loopback TCP stream moves on this machine.

Real traffic is not back to back, so 8 B round trips are also timed after a pause: a barrier on
the same group, or 1 ms or 10 ms of compute on the calling thread of both ranks (DDP's allreduce
after a backward, a pipeline's send after a forward). The latency is half the round trip, as in
the hot loop; beside it, the first message's own one-way time, read on the one clock both ranks
share (CLOCK_MONOTONIC; emulated hosts are namespaces of one kernel): from the later of the
send's start and the receive's start to the receive's end, so it leaves out how much later
rank 1 comes back from the pause (after a barrier, the barrier's own last message). Beside
them, the CPU time a rank spends per second while it waits 0.5 s in a receive (a rank that waits
long must not burn a core).

Beside them, torch-floor: one send and one receive call on torch's no-op backend (``fake``)
after the same pauses, the part of a hop torch's own Python and c10d path costs whatever the
backend. ``--breakdown`` (DICOMM_TRACE=1 in the ranks) then cuts the 8 B hops of each dicomm
transport into the steps the backend stamps (csrc/comm/transport/Trace.h): the Python call,
the Work and host view, the post to the receiver's read of the header, the landing and the
return, and prints their medians.

Every contender runs in the same processes, on groups side by side (gloo, dicomm over tcp, over
shm, and the raw socket), and they take turns: each size is timed in ROUNDS rounds, each round
running every contender once in an order rotated from round to round. A shared VM drifts by 2x
within a minute (where the scheduler puts the ranks, steal time); taking turns makes that drift
hit every contender alike instead of whichever ran during a bad minute.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from diutil.address import free_port  # noqa: E402
from program_results import save_run  # noqa: E402  (beside this file)

MiB = 1 << 20
MEMCPY_BYTES = 64 * MiB  # the size of the memcpy target, timed beside the allreduces
ROUNDS = 5
PAUSES = {"a barrier": 0.0, "1 ms compute": 1e-3, "10 ms compute": 1e-2}  # 0: the barrier


def _iters(nbytes: int, budget_s: float, lo: int, hi: int, est_bw: float = 1e9) -> int:
    est = 60e-6 + nbytes / est_bw
    return max(lo, min(hi, int(budget_s / est)))


Sampler = Callable[[], tuple[list[float], float]]


def _take_turns(contenders: dict[str, Sampler], rounds: int) -> dict[str, tuple[list[float], float]]:
    """Call each contender's sampler once per round, the order rotated every round; return each
    contender's wall-time samples from all rounds and its median CPU seconds per op. Every rank
    must call this with the same contenders."""
    names = list(contenders)
    samples: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wall, cpu_per_op = contenders[name]()
            samples[name].extend(wall)
            cpu[name].append(cpu_per_op)
    return {n: (samples[n], statistics.median(cpu[n])) for n in names}


def _ping_pong_sampler(round_trip: Callable, nbytes: int, budget: float) -> Callable[[], list[float]]:
    """A sampler timing round trips of `nbytes`: at least 4 per call (4 x ROUNDS in all), after a
    few untimed ones, since the contender's threads slept while the others ran."""
    timed = _iters(2 * nbytes, budget / ROUNDS, lo=4, hi=400)
    warm = _iters(2 * nbytes, budget / ROUNDS / 10, lo=1, hi=20)

    def sample() -> tuple[list[float], float]:
        rtts = []
        for i in range(warm + timed):
            if i == warm:
                c0 = time.process_time()
            t0 = time.perf_counter()
            round_trip()
            if i >= warm:
                rtts.append(time.perf_counter() - t0)
        return rtts, (time.process_time() - c0) / timed / 2  # per one-way message

    return sample


PAUSE_BYTES = 8
IDLE_WAIT_S = 0.5


def _compute(seconds: float) -> Callable[[], None]:
    """`seconds` of compute on the calling thread: small matmuls, as a training step's kernels
    (they also take the caches the messaging code had)."""
    import torch

    a = torch.rand(96, 96)

    def compute() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(a, a)
    return compute


def _after_pause_sampler(rank: int, timed_round_trip: Callable, pause: Callable, n: int) -> Sampler:
    """A sampler timing `n` round trips, each after `pause` on both ranks; its samples are pairs
    (half the round trip on rank 0, the first message's one-way time): for the latter, rank 1's
    receive end minus the later of rank 0's send start and rank 1's receive start, on the clock
    the ranks share. `timed_round_trip()` returns (start, end) on rank 0 and (start, end of the
    first message) on rank 1."""
    import torch.distributed as dist

    def sample() -> tuple[list[float], float]:
        marks, cpu = [], 0.0
        for _ in range(n):
            pause()
            c0 = time.process_time()
            marks.append(timed_round_trip())
            cpu += time.process_time() - c0
        both: list = [None, None]
        dist.all_gather_object(both, marks)
        sends, recvs = both
        return [((s_end - s_start) / 2, r_end - max(s_start, r_start))
                for (s_start, s_end), (r_start, r_end) in zip(sends, recvs)], cpu / n / 2
    return sample


def _idle_wait_cpu(rank: int, round_trip: Callable) -> float:
    """CPU seconds per second of rank 1's process (all its threads) while it waits IDLE_WAIT_S
    in a receive that rank 0 answers only after sleeping that long; every rank returns it."""
    import torch.distributed as dist

    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    if rank == 0:
        time.sleep(IDLE_WAIT_S)
    round_trip()
    share = [(time.process_time() - c0) / (time.perf_counter() - t0)]
    dist.broadcast_object_list(share, src=1)
    return share[0]


def _raw_socket(rank: int, address: str) -> socket.socket:
    """A plain blocking TCP connection between ranks 0 and 1 (TCP_NODELAY, as gloo); rank 0
    listens on `address`.

    Rank 0 listens on a port the kernel picks and tells rank 1 over the default group: a port
    picked earlier and bound later can be taken meanwhile (by a dicomm or gloo listener)."""
    import torch.distributed as dist

    port = [0]
    if rank == 0:
        with socket.socket() as ls:
            ls.bind((address, 0))
            ls.listen(1)
            port[0] = ls.getsockname()[1]
            dist.broadcast_object_list(port, src=0)
            ls.settimeout(60)
            s, _ = ls.accept()
            s.settimeout(None)
    else:
        dist.broadcast_object_list(port, src=0)
        s = socket.create_connection((address, port[0]), timeout=60)
        s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def dicomm_group(transport: str | None, allreduce: str | None = None):
    """A new dicomm group over every rank, forced to `transport` and `allreduce` (None: auto).
    Every rank must call it, in the same order, as ``dist.new_group``."""
    import torch.distributed as dist

    # Transport and algorithm are read when a group connects: set them for this group only.
    settings = {"DICOMM_TRANSPORT": transport, "DICOMM_ALLREDUCE": allreduce}
    saved = {k: os.environ.pop(k, None) for k in settings}
    os.environ.update({k: v for k, v in settings.items() if v})
    try:
        return dist.new_group(backend="dicomm")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


FLOOR = "torch-floor"  # torch's own send and receive calls on its no-op backend


def _floor_group():
    """A group on torch's no-op backend (``fake``: every op completes at once, nothing moves):
    what torch's Python and c10d path alone cost, after the same pauses. None when this torch
    lacks it."""
    import torch.distributed as dist

    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

        return dist.new_group(backend="fake")
    except Exception as e:  # noqa: BLE001 - the floor is an extra column, not the benchmark
        print(f"(no torch floor: {e})")
        return None


def _floor_round_trip(buf, group):
    import torch.distributed as dist

    start = time.perf_counter()
    dist.send(buf, 1 - dist.get_rank(), group=group)
    dist.recv(buf, 1 - dist.get_rank(), group=group)
    return start, time.perf_counter()


# One hop of an 8 B ping-pong (sender A, receiver B) cut at DICOMM_TRACE's points
# (csrc/comm/transport/Trace.h) and at the Python calls: (name, A's or B's start, end).
HOP_SEGMENTS = [
    ("send: python -> backend", ("A", "py.send_start"), ("A", "send.call")),
    ("send: work + view", ("A", "send.call"), ("A", "send.posted")),
    ("post -> B reads the header", ("AB", "wire_from"), ("B", "recv.frame")),
    ("recv: header -> landed", ("B", "recv.frame"), ("B", "recv.landed")),
    ("recv: landed -> wait out", ("B", "recv.landed"), ("B", "recv.wait_out")),
    ("recv: wait out -> python", ("B", "recv.wait_out"), ("B", "py.recv_end")),
    ("one way (A's send call -> B's return)", ("A", "py.send_start"), ("B", "py.recv_end")),
    ("off the hop: send post -> write returns", ("A", "send.posted"), ("A", "send.written")),
    ("off the hop: recv python -> backend", ("B", "py.recv_start"), ("B", "recv.call")),
    ("off the hop: recv post + wait entry", ("B", "recv.call"), ("B", "recv.wait_in")),
    ("B's wait began before A's post by", ("B", "recv.wait_in"), ("A", "send.posted")),
]


SLEPT = "hops whose receiver slept, %"
HOP_TOTALS = ["one way, rank 0 -> 1 (call -> return)", "one way, rank 1 -> 0 (call -> return)",
              "half rank 0's round trip"]


def _breakdown(rank: int, buf, group, pause: Callable, n: int) -> dict:
    """Medians over `n` round trips after `pause` (both ranks), each hop cut into HOP_SEGMENTS
    (us), from the stamps DICOMM_TRACE=1 leaves along the send and the receive; both hops'
    samples together. Rank 0 returns them, rank 1 an empty dict."""
    import dicomm
    import torch.distributed as dist

    peer = 1 - rank
    marks = []
    for _ in range(n):
        pause()
        dicomm._C._trace_take()
        m = {}
        if rank == 0:
            m["py.send_start"] = time.perf_counter_ns()
            dist.send(buf, peer, group=group)
            m["py.send_end"] = m["py.recv_start"] = time.perf_counter_ns()
            dist.recv(buf, peer, group=group)
            m["py.recv_end"] = time.perf_counter_ns()
        else:
            m["py.recv_start"] = time.perf_counter_ns()
            dist.recv(buf, peer, group=group)
            m["py.recv_end"] = m["py.send_start"] = time.perf_counter_ns()
            dist.send(buf, peer, group=group)
            m["py.send_end"] = time.perf_counter_ns()
        m.update(dicomm._C._trace_take())
        marks.append(m)
    both: list = [None, None]
    dist.all_gather_object(both, marks)
    if rank != 0:
        return {}
    cuts: dict = {name: [] for name, _, _ in HOP_SEGMENTS}
    cuts.update({name: [] for name in HOP_TOTALS})
    for m0, m1 in zip(*both):
        # Each hop's whole one-way time on its own: the two hops of a round trip differ (rank 1
        # may still be coming back from the pause when rank 0 sends).
        cuts[HOP_TOTALS[0]].append((m1["py.recv_end"] - m0["py.send_start"]) / 1e3)
        cuts[HOP_TOTALS[1]].append((m0["py.recv_end"] - m1["py.send_start"]) / 1e3)
        cuts[HOP_TOTALS[2]].append((m0["py.recv_end"] - m0["py.send_start"]) / 2e3)
        for a, b in ((m0, m1), (m1, m0)):
            # From the later of the send's post and the receive's wait: a receiver that came late
            # found the message waiting.
            ranks = {"A": a, "B": b, "AB": {"wire_from": max(a["send.posted"], b["recv.wait_in"])}}
            for name, (r0, p0), (r1, p1) in HOP_SEGMENTS:
                t0, t1 = ranks[r0].get(p0, 0), ranks[r1].get(p1, 0)
                if t0 and t1:
                    cuts[name].append((t1 - t0) / 1e3)
    out = {name: statistics.median(v) for name, v in cuts.items() if v}
    # How often the receiver stopped polling and slept on the connection (a busy host, or the
    # spin budget spent): its wake-up then lies in "post -> B reads the header".
    slept = [bool(b.get("wait.blocks")) for m0, m1 in zip(*both) for b in (m1, m0)]
    out[SLEPT] = 100.0 * sum(slept) / max(1, len(slept))
    return out


def _worker(rank, world, port, sizes, ar_sizes, budget, host, store_host, breakdown, q):
    if host is not None:
        host.enter()  # before anything opens a socket
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import dicomm  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{store_host}:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))

    def log(text: str) -> None:
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {world} ranks: {text}", flush=True)

    res: dict = {"p2p": {}, "after_pause": {}, "idle_cpu": {}, "allreduce": {}, "breakdown": {}, "memcpy_GBs": None,
                 "congestion": _congestion()}
    one_host = dicomm.local_host_id() == _gathered_host_ids(dist)
    if sizes and world == 2:
        # gloo gets a group of its own too: ops on a new group cost the same Python path for all.
        groups = {"gloo": dist.new_group(backend="gloo"), "dicomm-tcp": dicomm_group("tcp")}
        if one_host:
            groups["dicomm-shm"] = dicomm_group("shm")
        raw = _raw_socket(rank, store_host)
        peer = 1 - rank
        floor_group = _floor_group()

        def torch_round_trip(buf, group):
            return _round_trip(lambda: dist.send(buf, peer, group=group), lambda: dist.recv(buf, peer, group=group))

        def raw_round_trip(buf):
            view = memoryview(buf.numpy()).cast("B")

            def recv():
                got = 0
                while got < len(view):
                    k = raw.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
                    if k == 0:
                        raise ConnectionError("raw-tcp peer closed")
                    got += k
            return _round_trip(lambda: raw.sendall(view), recv)

        def _round_trip(send, recv):
            """A round trip that returns (its start, when the first message is in) on this
            rank: rank 0 sends first."""
            def round_trip():
                start = time.perf_counter()
                if rank == 0:
                    send()
                    recv()
                    return start, time.perf_counter()
                recv()
                first_in = time.perf_counter()
                send()
                return start, first_in
            return round_trip

        def contenders(buf, nbytes: int) -> dict:
            out = {label: _ping_pong_sampler(torch_round_trip(buf, g), nbytes, budget)
                   for label, g in groups.items()}
            out["raw-tcp"] = _ping_pong_sampler(raw_round_trip(buf), nbytes, budget)
            return out

        # Fresh processes and connections run slower for their first messages (lazy set-up,
        # page faults, the scheduler spreading the ranks over the cores): as nccl-tests' -w.
        tiny = torch.zeros(2)
        for round_trip in [torch_round_trip(tiny, g) for g in groups.values()] + [raw_round_trip(tiny)]:
            for _ in range(1000):
                round_trip()
        for nbytes in sizes:
            log(f"p2p {fmt_size(nbytes)}")
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            for label, (rtts, cpu) in _take_turns(contenders(buf, nbytes), ROUNDS).items():
                one_way = statistics.median(rtts) / 2
                res["p2p"].setdefault(label, {})[nbytes] = {"lat_us": one_way * 1e6, "cpu_us": cpu * 1e6,
                                                             "bw_GBs": nbytes / one_way / 1e9}
        buf = torch.zeros(PAUSE_BYTES, dtype=torch.uint8)
        round_trips = {label: torch_round_trip(buf, g) for label, g in groups.items()}
        round_trips["raw-tcp"] = raw_round_trip(buf)
        if floor_group is not None:
            # torch's own path on its no-op backend: this rank's send and receive calls, the
            # torch share of one hop (a sender's send and a receiver's receive).
            round_trips[FLOOR] = lambda: _floor_round_trip(buf, floor_group)
        for pause_name, seconds in PAUSES.items():
            log(f"p2p {fmt_size(PAUSE_BYTES)} after {pause_name}")
            n = max(4, min(100, int(budget / ROUNDS / (seconds or 1e-3))))
            compute = _compute(seconds)
            pauses = {label: (lambda g=g: dist.barrier(group=g)) if seconds == 0 else compute
                      for label, g in groups.items()}
            pauses["raw-tcp"] = dist.barrier if seconds == 0 else compute
            pauses[FLOOR] = dist.barrier if seconds == 0 else compute
            contenders = {label: _after_pause_sampler(rank, rt, pauses[label], n) for label, rt in round_trips.items()}
            for label, (samples, cpu) in _take_turns(contenders, ROUNDS).items():
                whole = 2 if label == FLOOR else 1  # the floor's "round trip" is one hop's calls
                res["after_pause"].setdefault(label, {})[pause_name] = {
                    "lat_us": statistics.median(s[0] for s in samples) * 1e6 * whole,
                    "first_us": statistics.median(s[1] for s in samples) * 1e6, "cpu_us": cpu * 1e6}
        if breakdown:
            for label, g in groups.items():
                if label.startswith("dicomm"):
                    for pause_name, seconds in PAUSES.items():
                        log(f"breakdown {label} after {pause_name}")
                        pause = (lambda g=g: dist.barrier(group=g)) if seconds == 0 else _compute(seconds)
                        res["breakdown"].setdefault(label, {})[pause_name] = _breakdown(
                            rank, buf, g, pause, max(20, min(100, int(budget / (seconds or 1e-3)))))
        log(f"a receive waiting {IDLE_WAIT_S:g} s")
        for label, round_trip in round_trips.items():
            if label == FLOOR:
                continue
            res["idle_cpu"][label] = statistics.median(_idle_wait_cpu(rank, round_trip) for _ in range(3))
        raw.close()

    ar_groups = {"gloo": dist.new_group(backend="gloo"), "dicomm": dicomm_group(None)}
    algorithm = ar_groups["dicomm"]._get_backend(torch.device("cpu")).allreduce_algorithm
    if algorithm != "ring":
        ar_groups["dicomm-ring"] = dicomm_group(None, "ring")  # what the segment or hierarchy buys
    if algorithm not in ("ring", "shared"):
        ar_groups["dicomm-hier"] = dicomm_group(None, "hierarchical")
    for nbytes in ar_sizes:
        log(f"allreduce {fmt_size(nbytes)}")
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        n = _iters(4 * nbytes, budget / ROUNDS, lo=2, hi=200)

        def sampler(group):
            def sample() -> tuple[list[float], float]:
                dist.all_reduce(t, group=group)  # warm-up: this group's threads slept meanwhile
                dist.barrier(group=group)
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t, group=group)
                return [(time.perf_counter() - t0) / n], (time.process_time() - c0) / n
            return sample

        contenders = {label: sampler(g) for label, g in ar_groups.items()}
        if nbytes == MEMCPY_BYTES:
            contenders["memcpy"] = _memcpy_sampler(torch, dist, rank, nbytes, n)
        times = _take_turns(contenders, ROUNDS)
        for label, (ts, cpu) in times.items():
            tt = statistics.median(ts)
            algbw = t.numel() * 4 / tt / 1e9
            res["allreduce"].setdefault(f"{label}/{world}", {})[nbytes] = {
                "time_us": tt * 1e6, "cpu_us": cpu * 1e6, "algbw_GBs": algbw,
                "busbw_GBs": algbw if label == "memcpy" else algbw * 2 * (world - 1) / world}
        if "memcpy" in times:
            res["memcpy_GBs"] = res["allreduce"][f"memcpy/{world}"][nbytes]["algbw_GBs"]
        del t
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(res)


def _memcpy_sampler(torch, dist, rank: int, nbytes: int, n: int):
    """A contender beside the allreduces of `nbytes`: rank 0 times `n` libc memcpys of `nbytes`
    on its core while the other ranks wait in a (blocking) gloo barrier: the bandwidth a
    shared-memory allreduce is held against, sampled in the same turns and with the same
    statistic (median over rounds of a mean over `n`) as the allreduces. libc's memcpy rather
    than a tensor copy_, which ran about 20% slower here: the stricter reference."""
    import ctypes

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)  # both touched: no page faults in the timed copies

    def sample() -> tuple[list[float], float]:
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        if rank == 0:
            for _ in range(n):
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        dist.barrier()
        return [wall / n], cpu / n
    return sample

def _congestion() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "?"


def _gathered_host_ids(dist) -> str:
    """Rank 0's host id if every rank shares it, else "" (the ranks span hosts)."""
    import dicomm

    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, dicomm.local_host_id())
    return ids[0] if len(set(ids)) == 1 else ""


class Load:
    """A busy process on every core while it is entered (--load): what a training job does to
    the communication threads beside it."""

    def __init__(self, on: bool):
        self.on, self.procs = on, []

    def __enter__(self) -> "Load":
        if self.on:
            import subprocess

            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(os.cpu_count() or 1)]
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _spawn(target, per_rank_args) -> dict:
    """Start one spawned process per argument tuple (each gets the result queue last) and
    return what rank 0 puts on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in per_rank_args]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def run(world: int, sizes, ar_sizes, budget: float, hosts: list | None, breakdown: bool = False) -> dict:
    """gloo and dicomm on `world` spawned ranks, taking turns: p2p ping-pong of `sizes` between
    ranks 0 and 1 (world 2 only: gloo, dicomm over tcp and, on one host, shm, one raw socket)
    and allreduce of `ar_sizes`; returns rank 0's results. With `hosts`, the ranks are split over
    them in contiguous blocks (as torchrun places nodes) and the store is on the first."""
    port = free_port()
    placed = [hosts[r * len(hosts) // world] if hosts else None for r in range(world)]
    store_host = hosts[0].address if hosts else "127.0.0.1"
    return _spawn(_worker, [(r, world, port, sizes, ar_sizes, budget, placed[r], store_host, breakdown)
                            for r in range(world)])


@contextlib.contextmanager
def _hosts(count: int, congestion: str, link_mbit: float | None):
    """`count` emulated hosts with `congestion` as their TCP congestion control, or None when
    they cannot be made here (then ranks share this host's loopback)."""
    from emulated_hosts import can_make_hosts, emulated_hosts

    why = can_make_hosts()
    if why is not None:
        if count > 1:
            raise SystemExit(f"--hosts {count}: {why}")
        print(f"(no emulated host: {why}; running on loopback under the system's congestion control)")
        yield None
        return
    import subprocess

    with emulated_hosts(count, rate_mbit=link_mbit) as hosts:
        for h in hosts:
            subprocess.run(["ip", "netns", "exec", h.ns, "sysctl", "-q", "-w",
                            f"net.ipv4.tcp_congestion_control={congestion}"], check=True)
        yield hosts


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", MiB), ("KiB", 1024)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, shorter loops")
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes for allreduce (default 2,4)")
    ap.add_argument("--hosts", type=int, default=1, choices=(1, 2), help="emulated hosts to split the ranks over")
    ap.add_argument("--load", action="store_true", help="a busy process on every core during the run")
    ap.add_argument("--congestion", default="reno", help="TCP congestion control of the emulated hosts")
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="cap each emulated host's link (tc tbf), e.g. 1000 for a slower inter-host network")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes in bytes instead of the sweep, e.g. 8,65536")
    ap.add_argument("--breakdown", action="store_true",
                    help="also cut 8 B hops after each pause into the steps DICOMM_TRACE=1 stamps (send call, "
                         "wire, header read, landing, return) and print the medians")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench"), help="folder for the JSON and PNG")
    args = ap.parse_args(argv)

    top = 64 * MiB if args.quick else 256 * MiB
    sizes = [8] + [1 << k for k in range(6, 29, 3) if (1 << k) <= top]
    sizes += [64 * MiB, top]  # the 64 MiB targets, and the largest size asked for
    sizes = sorted({int(x) for x in args.sizes.split(",")} if args.sizes else set(sizes))
    budget = 0.5 if args.quick else 1.5
    worlds = [int(w) for w in args.ranks.split(",")]
    mode = f"{args.hosts}host{'s' if args.hosts > 1 else ''}-{'loaded' if args.load else 'quiet'}"
    if args.link_mbit:
        mode += f"-{args.link_mbit:g}mbit"

    results: dict = {"mode": mode, "p2p": {}, "after_pause": {}, "idle_cpu": {}, "allreduce": {}, "breakdown": {}}
    if args.breakdown:
        os.environ["DICOMM_TRACE"] = "1"  # read by the spawned ranks' dicomm
    with _hosts(args.hosts, args.congestion, args.link_mbit) as hosts, Load(args.load):
        for world in worlds:
            r = run(world, sizes if world == 2 else [], sizes, budget, hosts, args.breakdown)
            for key in ("p2p", "after_pause", "idle_cpu", "allreduce", "breakdown"):
                results[key].update(r[key])
            results["memcpy_GBs"], results["congestion"] = r["memcpy_GBs"], r["congestion"]
        if not results["p2p"]:
            r = run(2, sizes, [], budget, hosts, args.breakdown)
            for key in ("p2p", "after_pause", "idle_cpu", "breakdown"):
                results[key].update(r[key])
    print_tables(results, sizes, worlds)
    checks = targets(results, args.hosts, args.load)
    print_targets(checks)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"comm-{mode}.json").write_text(json.dumps(results, indent=1))
    save_run(f"comm_{mode}", measurements(results, checks))
    plot(results, sizes, out / f"comm-{mode}.png")
    return 0


def measurements(results: dict, checks: list[Target]) -> list:
    """The run as program_results measurements: the targets first (one group: each target's
    deciding time against its peer's), then one group per op and size, gloo the peer."""
    from program_results import Measurement

    out = [Measurement(f"{results['mode']}: targets", t.name, [t.time_s],
                       {"peer_s": t.peer_s, "peer_name": t.peer_name, "target": f"<= {t.limit:.2f}x",
                        "at": t.at, "verdict": "met" if t.met else "missed"}) for t in checks]
    for label, by_size in results["p2p"].items():
        for nbytes, r in by_size.items():
            out.append(Measurement(f"{results['mode']}: p2p one-way {fmt_size(nbytes)}", label, [r["lat_us"] / 1e6],
                                   {"peer": label == "gloo", "cpu_us": r["cpu_us"], "bw_GBs": r["bw_GBs"]}))
    for label, by_pause in results["after_pause"].items():
        for pause, r in by_pause.items():
            out.append(Measurement(f"{results['mode']}: p2p one-way {fmt_size(PAUSE_BYTES)} after {pause}", label,
                                   [r["lat_us"] / 1e6], {"peer": label == "gloo", "first_message_us": r["first_us"],
                                                         "cpu_us": r["cpu_us"]}))
    for label, share in results["idle_cpu"].items():
        out.append(Measurement(f"{results['mode']}: CPU time per second of a receive waiting {IDLE_WAIT_S:g} s",
                               label, [share], {"peer": label == "gloo", "unit": "s/s"}))
    for key, by_size in results["allreduce"].items():
        label, world = key.split("/")
        for nbytes, r in by_size.items():
            out.append(Measurement(f"{results['mode']}: allreduce {world} ranks {fmt_size(nbytes)}", label,
                                   [r["time_us"] / 1e6],
                                   {"peer": label == "gloo", "cpu_us": r["cpu_us"], "busbw_GBs": r["busbw_GBs"]}))
    return out


def print_tables(results: dict, sizes: list[int], worlds: list[int]) -> None:
    P, A = results["p2p"], results["allreduce"]
    copies = ", ".join(f"{w} ranks {A[f'memcpy/{w}'][MEMCPY_BYTES]['algbw_GBs']:.2f} GB/s" for w in worlds
                       if f"memcpy/{w}" in A)
    print(f"\n{results['mode']}: TCP congestion control {results['congestion']}; libc memcpy of "
          f"{fmt_size(MEMCPY_BYTES)} on rank 0's core, beside each world's allreduces: {copies}")
    print("\nPoint-to-point, 2 ranks: one-way latency us, CPU us per message (rank 0), bandwidth GB/s;")
    print("raw-tcp: one blocking socket without torch (what one plain stream moves here)")
    labels = [lbl for lbl in ("gloo", "dicomm-tcp", "dicomm-shm", "raw-tcp") if lbl in P]
    hdr = f"{'size':>9} | " + " | ".join(f"{lbl:>24}" for lbl in labels) + f" | {'tcp/gloo':>8}"
    hdr += f" | {'shm/gloo':>8}" if "dicomm-shm" in P else ""
    print(hdr)
    print("-" * len(hdr))
    for s in sizes:
        cells = [f"{P[lbl][s]['lat_us']:8.1f} {P[lbl][s]['cpu_us']:7.1f} {P[lbl][s]['bw_GBs']:7.3f}" for lbl in labels]
        line = f"{fmt_size(s):>9} | " + " | ".join(cells)
        line += f" | {P['dicomm-tcp'][s]['bw_GBs'] / P['gloo'][s]['bw_GBs']:8.2f}"
        if "dicomm-shm" in P:
            line += f" | {P['dicomm-shm'][s]['bw_GBs'] / P['gloo'][s]['bw_GBs']:8.2f}"
        print(line)
    if results["after_pause"]:
        W = results["after_pause"]
        print(f"\n{fmt_size(PAUSE_BYTES)} one-way after a pause on both ranks: half the round trip us, the first "
              "message's own us, CPU us per message (rank 0);")
        print(f"and the CPU a rank spends per second of a receive that waits {IDLE_WAIT_S:g} s")
        if FLOOR in W:
            print(f"{FLOOR}: one send and one receive call on torch's no-op backend (the torch share of a hop)")
        wl = labels + [FLOOR] * (FLOOR in W)
        hdr = f"{'after':>15} | " + " | ".join(f"{lbl:>24}" for lbl in wl) + f" | {'tcp/gloo':>8}"
        hdr += f" | {'shm/gloo':>8}" if "dicomm-shm" in W else ""
        print(hdr)
        print("-" * len(hdr))
        for pause in PAUSES:
            line = f"{pause:>15} | " + " | ".join(
                f"{W[lbl][pause]['lat_us']:8.1f} {W[lbl][pause]['first_us']:7.1f} {W[lbl][pause]['cpu_us']:7.1f}"
                for lbl in wl)
            for lbl in ("dicomm-tcp", "dicomm-shm"):
                if lbl in W:
                    line += f" | {W[lbl][pause]['lat_us'] / W['gloo'][pause]['lat_us']:8.2f}"
            print(line)
        print(f"{'idle CPU s/s':>15} | " + " | ".join(f"{results['idle_cpu'][lbl]:24.4f}" for lbl in labels))
    B = results.get("breakdown") or {}
    if B:
        print(f"\nWhere an {fmt_size(PAUSE_BYTES)} hop's time goes (DICOMM_TRACE=1; sender A, receiver B; medians us "
              "over both hops of each round trip):")
        cols = [(lbl, pause) for lbl in B for pause in B[lbl]]
        print(f"{'':>40} | " + " | ".join(f"{lbl.split('-')[1] + ' ' + pause:>20}" for lbl, pause in cols))
        for name in [name for name, _, _ in HOP_SEGMENTS] + HOP_TOTALS + [SLEPT]:
            print(f"{name:>40} | " + " | ".join(f"{B[lbl][pause].get(name, float('nan')):20.1f}" for lbl, pause in cols))
    print("\nAllreduce float32: time us, CPU us per op (rank 0), busbw GB/s; ratio = dicomm/gloo busbw")
    hdr = f"{'size':>9} | " + " | ".join(f"{'gloo/' + str(w):>24} {'dicomm/' + str(w):>24} {'ratio':>6}" for w in worlds)
    print(hdr)
    print("-" * len(hdr))
    cell = lambda r: f"{r['time_us']:10.1f} {r['cpu_us']:7.1f} {r['busbw_GBs']:5.2f}"
    for s in sizes:
        cells = []
        for w in worlds:
            g, d = A[f"gloo/{w}"][s], A[f"dicomm/{w}"][s]
            cells.append(f"{cell(g)} {cell(d)} {d['busbw_GBs'] / g['busbw_GBs']:6.2f}")
        print(f"{fmt_size(s):>9} | " + " | ".join(cells))
    both = [w for w in worlds if f"dicomm-ring/{w}" in A]
    if both:
        # Against the flat ring: two levels (forced) across hosts, the shared segment (auto) on one.
        two_levels = f"dicomm-hier/{both[0]}" in A
        name, label = ("two levels (DICOMM_ALLREDUCE=hierarchical)", "hier") if two_levels else \
            ("the host's shared segment (auto)", "shared")
        print(f"\nThe same ranks' allreduce through {name} and one flat ring (=ring),")
        print(f"measured in turn with the above; ratio = {label} / flat ring busbw")
        for s in sizes:
            cells = []
            for w in both:
                mine = A[f"dicomm-hier/{w}" if two_levels else f"dicomm/{w}"][s]
                ring = A[f"dicomm-ring/{w}"][s]
                cells.append(f"{label}/{w} {cell(mine)} ring/{w} {cell(ring)} {mine['busbw_GBs'] / ring['busbw_GBs']:6.2f}")
            print(f"{fmt_size(s):>9} | " + " | ".join(cells))


@dataclasses.dataclass
class Target:
    """One of issue 17's targets as a time ratio: dicomm's time for the work that decides it over
    its peer's time for the same work (gloo's, or a copy at memcpy speed), met at or below `limit`."""

    name: str
    time_s: float
    peer_s: float
    peer_name: str
    limit: float
    at: str  # the size (and, for "every size" targets, that it was the worst one)

    @property
    def ratio(self) -> float:
        return self.time_s / self.peer_s

    @property
    def met(self) -> bool:
        return self.ratio <= self.limit


def targets(results: dict, hosts: int, loaded: bool) -> list[Target]:
    """The targets of the issue that apply to this mode, decided from the run's `results`."""
    P, A = results["p2p"], results["allreduce"]
    worlds = sorted(int(k.split("/")[1]) for k in A if k.startswith("gloo/"))
    big = 64 * MiB
    out = []

    def versus_gloo(name: str, mine: dict, gloo: dict, key: str, limit: float, sizes=None) -> None:
        sizes = sizes or list(gloo)
        worst = max(sizes, key=lambda s: mine[s][key] / gloo[s][key])
        at = fmt_size(worst) + (" (worst size)" if len(sizes) > 1 else "")
        out.append(Target(name, mine[worst][key] / 1e6, gloo[worst][key] / 1e6, "gloo", limit, at))

    if loaded:
        versus_gloo("p2p tcp >= gloo at every size", P["dicomm-tcp"], P["gloo"], "lat_us", 1.0)
        for w in worlds:
            versus_gloo(f"allreduce {w} ranks >= gloo at every size", A[f"dicomm/{w}"], A[f"gloo/{w}"], "time_us", 1.0)
        versus_gloo("8 B one-way tcp <= 0.5x gloo", P["dicomm-tcp"], P["gloo"], "lat_us", 0.5, [8])
    W = results.get("after_pause", {})
    for transport in (t for t in ("dicomm-tcp", "dicomm-shm") if t in W):
        pauses = [p for p in W["gloo"]]
        worst = max(pauses, key=lambda p: W[transport][p]["lat_us"] / W["gloo"][p]["lat_us"])
        mine, gloo = W[transport][worst]["lat_us"] / 1e6, W["gloo"][worst]["lat_us"] / 1e6
        kind = transport.split("-")[1]
        name = f"8 B one-way {kind} after a pause"
        barrier = W[transport]["a barrier"]["lat_us"] / 1e6, W["gloo"]["a barrier"]["lat_us"] / 1e6
        if loaded:
            out.append(Target(f"{name} >= gloo", mine, gloo, "gloo", 1.0, f"{worst} (worst)"))
            out.append(Target(f"8 B one-way {kind} after a barrier >= 1.5x gloo", *barrier, "gloo", 1 / 1.5,
                              "a barrier"))
        else:
            # Issue 59: after a barrier <= 12 us and >= 5x gloo; after 1 ms of compute within 5 us of
            # torch's own send and receive calls (its no-op backend) timed in the same run.
            out.append(Target(f"8 B one-way {kind} after a barrier <= 12 us", barrier[0], 12e-6, "12 us", 1.0,
                              "a barrier"))
            out.append(Target(f"8 B one-way {kind} after a barrier >= 5x gloo", *barrier, "gloo", 0.2, "a barrier"))
            if FLOOR in W:
                floor = W[FLOOR]["1 ms compute"]["lat_us"] / 1e6
                out.append(Target(f"8 B one-way {kind} after 1 ms compute <= torch floor + 5 us",
                                  W[transport]["1 ms compute"]["lat_us"] / 1e6, floor + 5e-6,
                                  f"floor {floor * 1e6:.1f} us + 5 us", 1.0, "1 ms compute"))
    for label in (t for t in ("dicomm-tcp", "dicomm-shm") if t in results.get("idle_cpu", {})):
        out.append(Target(f"a receive waiting {IDLE_WAIT_S:g} s ({label.split('-')[1]}) uses <= 1% of a core",
                          results["idle_cpu"][label], 1.0, "a core", 0.01, "CPU s per s"))
    if hosts == 2 and not loaded and 2 in worlds and big in A["gloo/2"]:
        versus_gloo("2 hosts x 1 rank: 8 B allreduce <= 0.3x gloo", A["dicomm/2"], A["gloo/2"], "time_us", 0.3, [8])
        versus_gloo("2 hosts x 1 rank: 64 MiB allreduce >= 1.5x gloo", A["dicomm/2"], A["gloo/2"], "time_us",
                    1 / 1.5, [big])
    if hosts == 2 and 4 in worlds and big in A["gloo/4"]:
        versus_gloo("2 hosts x 2 ranks: 64 MiB allreduce >= 2x gloo", A["dicomm/4"], A["gloo/4"], "time_us", 0.5,
                    [big])
    if hosts == 1 and not loaded:
        for w in (w for w in worlds if big in A[f"dicomm/{w}"]):
            # busbw >= half of memcpy: at most twice the time the bus bytes take at memcpy speed
            # (memcpy sampled beside this world's allreduces; a single figure in older runs).
            memcpy = A[f"memcpy/{w}"][big]["algbw_GBs"] if f"memcpy/{w}" in A else results["memcpy_GBs"]
            at_memcpy = big * 2 * (w - 1) / w / (memcpy * 1e9)
            out.append(Target(f"{w} ranks: 64 MiB allreduce busbw >= 50% of memcpy",
                              A[f"dicomm/{w}"][big]["time_us"] / 1e6, at_memcpy, "memcpy", 2.0, fmt_size(big)))
    return out


def print_targets(checks: list[Target]) -> None:
    print("\nTargets for this mode, as ratios (dicomm / peer):")
    for t in checks:
        print(f"  [{'PASS' if t.met else 'MISS'}] {t.name}: {t.ratio:.2f}x {t.peer_name} at {t.at} (<= {t.limit:.2f}x)")


def plot(results: dict, sizes: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    P, A, W = results["p2p"], results["allreduce"], results.get("after_pause", {})
    fig, ax = plt.subplots(1, 4 if W else 3, figsize=(21 if W else 16, 4.5))
    for label in P:
        ax[0].loglog(sizes, [P[label][s]["lat_us"] for s in sizes], "o-", label=label)
        ax[1].semilogx(sizes, [P[label][s]["bw_GBs"] for s in sizes], "o-", label=label)
    for key in A:
        if key.startswith("memcpy/"):  # one size: a line at half of it, the memcpy target
            half = A[key][MEMCPY_BYTES]["algbw_GBs"] / 2
            ax[2].axhline(half, linestyle="--" if key.endswith("/2") else ":", color="gray", linewidth=1, label=f"half of memcpy ({key.split('/')[1]} ranks)")
            continue
        ax[2].semilogx(sizes, [A[key][s]["busbw_GBs"] for s in sizes], "o-", label=key)
    ax[0].set(title=f"p2p one-way latency ({results['mode']})", xlabel="bytes", ylabel="us")
    ax[1].set(title="p2p bandwidth (2 ranks)", xlabel="bytes", ylabel="GB/s")
    ax[2].set(title="allreduce busbw", xlabel="bytes", ylabel="GB/s")
    if W:  # grouped bars: one group per pause (and the hot loop), one bar per contender
        labels = list(W)
        groups = ["hot loop", *PAUSES]
        width = 0.8 / len(labels)
        for k, label in enumerate(labels):
            values = [P[label][PAUSE_BYTES]["lat_us"] if PAUSE_BYTES in P.get(label, {}) else 0,
                      *(W[label][g]["lat_us"] for g in PAUSES)]
            ax[3].bar([i + k * width for i in range(len(groups))], values, width, label=label)
        ax[3].set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)
        ax[3].set(title=f"{fmt_size(PAUSE_BYTES)} one-way (half the round trip) after a pause", ylabel="us",
                  yscale="log")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path} and {path.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
