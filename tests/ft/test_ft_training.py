"""``ditorch.train --ft``: a plan's two DP replicas as torchft replica groups, one on the cpu
vendor and one on emulated chips, each its own ``torchrun`` of a two-stage pipeline, started
from the CLI as docs/ft.md says (``ditorch ft lighthouse``, then one ``torchrun`` per replica).

* In fp32 with no failure they train what one CPU process trains (the reference run), and end
  with equal parameters (``--check-replicas``).
* A replica SIGKILLed mid-run is dropped, the other goes on alone; started again it recovers the
  parameters and optimizer state from the healthy one, rejoins, and both end equal.
* Bad input: a malformed lighthouse address and a replica index the plan does not have are
  refused in this process, before anything starts; an unreachable lighthouse and a replica with
  another plan end their launched replica with an error naming them.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from plans import ROOT, chip_file, kill_tree, make_plan  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchft")]

STAGES = [("X", 1, 2, False), ("Y", 1, 2, False)]


def _env(tmp: Path, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), DITORCH_PROFILE_FILE=str(chip_file(tmp)),
                DITORCH_MEMORY_SCALE="0.001", **extra)


class Lighthouse:
    """``ditorch ft lighthouse`` on a free loopback port."""

    def __init__(self, tmp: Path, min_replicas: int = 1, heartbeat_ms: int = 2000):
        address_file = tmp / "lighthouse.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ditorch.cli", "ft", "lighthouse", "--bind", "127.0.0.1:0",
             "--min-replicas", str(min_replicas), "--heartbeat-timeout-ms", str(heartbeat_ms),
             "--join-timeout-ms", "500", "--address-file", str(address_file)],
            env=_env(tmp), stdout=open(tmp / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (address_file.exists() and address_file.read_text().strip()):
            assert self.proc.poll() is None and time.monotonic() < deadline, (tmp / "lighthouse.log").read_text()
            time.sleep(0.1)
        self.address = address_file.read_text().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_replica(tmp: Path, k: int, vendor: str, address: str, steps: int, *args: str,
                  plan: str = "plan.json") -> subprocess.Popen:
    """One replica: its own torchrun (own store port) of the plan's two stages."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ditorch.train", "--plan", plan, "--steps", str(steps), "--precision", "fp32", "--timeout", "30",
           "--quiet", "--ft", "--lighthouse", address, "--replica", str(k), "--loss-log", f"replica{k}.jsonl", *args]
    # Output to a file: torchft logs every quorum, more than a pipe holds until the end.
    log = tmp / f"replica{k}-{time.monotonic_ns()}.log"
    p = subprocess.Popen(cmd, cwd=tmp, env=_env(tmp, DITORCH_VENDOR=vendor), stdout=open(log, "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    p.log = log
    return p


def losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outs = []
    try:
        for p in procs:
            p.wait(timeout=timeout)
            outs.append(p.log.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    return outs


@pytest.fixture
def plan_dir(tmp_path):
    make_plan(STAGES, dp=2).to_json(tmp_path / "plan.json")
    return tmp_path


def test_two_vendors_train_as_one_process_and_end_equal(plan_dir):
    from heteropp.plan import Plan
    from heteropp.runtime.reference import train_reference
    from heteropp.runtime.trainer import TrainOptions

    steps = 4
    lighthouse = Lighthouse(plan_dir, min_replicas=2)
    try:
        procs = [start_replica(plan_dir, k, vendor, lighthouse.address, steps, "--check-replicas", "1")
                 for k, vendor in enumerate(["cpu", "emu"])]
        outs = finish(procs)
    finally:
        lighthouse.close()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    reference, _ = train_reference(Plan.from_json(plan_dir / "plan.json"), TrainOptions(steps=steps, progress=False))
    for k in range(2):
        logged = losses(plan_dir / f"replica{k}.jsonl")
        assert [logged[s] for s in range(1, steps + 1)] == pytest.approx(reference, rel=1e-5)


def test_a_killed_replica_is_dropped_and_heals_from_the_other_on_its_return(plan_dir):
    from diutil.loss_log import load_losses

    steps = 400  # the survivor must still be training when the victim's new torchrun is up (15-20 s here)
    lighthouse = Lighthouse(plan_dir, min_replicas=1, heartbeat_ms=1000)
    try:
        survivor = start_replica(plan_dir, 0, "cpu", lighthouse.address, steps, "--check-replicas", "1")
        victim = start_replica(plan_dir, 1, "emu", lighthouse.address, steps)
        deadline = time.monotonic() + 120
        while len(losses(plan_dir / "replica1.jsonl")) < 3:  # both are training
            assert time.monotonic() < deadline and victim.poll() is None and survivor.poll() is None
            time.sleep(0.1)
        kill_tree(victim.pid)
        victim.wait()
        # The victim may have logged a step the survivor has committed but not yet logged.
        killed_at = max([*losses(plan_dir / "replica0.jsonl"), *losses(plan_dir / "replica1.jsonl")])
        lines_before_return = len((plan_dir / "replica1.jsonl").read_text().splitlines())
        returned = start_replica(plan_dir, 1, "emu", lighthouse.address, steps, "--check-replicas", "1")
        # The survivor goes on alone meanwhile.
        while max(losses(plan_dir / "replica0.jsonl"), default=0) < killed_at + 3:
            assert time.monotonic() < deadline and survivor.poll() is None, survivor.log.read_text()[-3000:]
            time.sleep(0.1)
        outs = finish([survivor, returned])
    finally:
        lighthouse.close()
    assert survivor.returncode == 0, outs[0][-3000:]
    assert returned.returncode == 0, outs[1][-3000:]
    assert "'replica1' left the quorum" in outs[0] and "'replica1' joined the quorum" in outs[0], outs[0][-3000:]
    # The returned replica (the lines it appended) logged steps only after it healed, past every
    # step either replica had reached at the kill, then each step up to the end; the survivor
    # logged every step.
    back = [json.loads(line)["step"] for line in (plan_dir / "replica1.jsonl").read_text().splitlines()[lines_before_return:]]
    assert back and back[0] > killed_at and back == list(range(back[0], steps + 1)), (killed_at, back)
    load_losses(plan_dir / "replica1.jsonl")  # both runs' lines: no step twice, so `ditorch mre` reads it
    assert sorted(losses(plan_dir / "replica0.jsonl")) == list(range(1, steps + 1))


@pytest.mark.parametrize("address", ["http://127.0.0.1:notaport", "ftp://127.0.0.1:29510", "http://127.0.0.1",
                                     "127.0.0.1:0", "http://[::1]:70000", "http://host:29510/path", "", ":29510"])
def test_malformed_lighthouse_addresses_are_refused_by_name(address):
    from ditorch.ft import check_lighthouse_address

    with pytest.raises(ValueError, match=f"lighthouse address {re.escape(repr(address))}: expected http://HOST:PORT"):
        check_lighthouse_address(address)


def test_lighthouse_addresses_take_the_scheme_when_bare():
    from ditorch.ft import check_lighthouse_address

    assert check_lighthouse_address("127.0.0.1:29510") == "http://127.0.0.1:29510"
    assert check_lighthouse_address("http://[::1]:29510/") == "http://[::1]:29510"
    assert check_lighthouse_address("http://lighthouse.local:1") == "http://lighthouse.local:1"


def test_a_replica_index_the_plan_lacks_is_refused_before_anything_starts(plan_dir):
    from ditorch.ft import ReplicaTrainer
    from heteropp.plan import Plan, PlanError
    from heteropp.runtime.trainer import TrainOptions

    plan = Plan.from_json(plan_dir / "plan.json")
    for index in (2, -1):
        with pytest.raises(PlanError, match=rf"--replica {index}: the plan has DP 2, so replicas 0..1"):
            ReplicaTrainer(plan, TrainOptions(steps=2, progress=False), index)


def test_of_two_plans_the_replica_further_along_keeps_training():
    """Hand-made quorums: the one that leaves is the replica behind, or at the same step the one
    with the higher name; replicas of the same plan never leave."""
    from ditorch.ft import _mismatch

    me = {"name": "replica1", "plan": "p1", "step": 5}
    assert _mismatch(me, [me, {"name": "replica0", "plan": "p1", "step": 9}]) is None
    assert _mismatch(me, [me, {"name": "replica0", "plan": "p0", "step": 4}]) is None
    assert "must run the same plan" in _mismatch(me, [me, {"name": "replica0", "plan": "p0", "step": 6}])
    assert "'replica0'" in _mismatch(me, [me, {"name": "replica0", "plan": "p0", "step": 5}])
    assert _mismatch(me, [me, {"name": "replica2", "plan": "p0", "step": 5}]) is None
    assert _mismatch(me, [me, {"name": "<unreadable record>", "plan": "?", "step": -1}]) is None


def test_an_unreachable_lighthouse_and_a_replica_of_another_plan_end_with_errors_naming_them(plan_dir):
    """Through the CLI and torchrun: the errors reach the user from every rank's process."""
    unreachable = start_replica(plan_dir, 0, "cpu", "http://127.0.0.1:9", 2)
    make_plan([("X", 1, 3, False), ("Y", 1, 1, False)], dp=2).to_json(plan_dir / "other.json")
    lighthouse = Lighthouse(plan_dir, min_replicas=2)
    try:
        first = start_replica(plan_dir, 0, "cpu", lighthouse.address, 2)
        other = start_replica(plan_dir, 1, "emu", lighthouse.address, 2, plan="other.json")
        outs = finish([unreachable, other], timeout=120)
        # replica0 keeps its place (the lower name at the same step) and waits for a quorum of 2.
        assert first.poll() is None
        kill_tree(first.pid)
        first.wait()
    finally:
        lighthouse.close()
    assert unreachable.returncode != 0 and "could not start its torchft manager" in outs[0], outs[0][-2000:]
    assert other.returncode != 0 and "must run the same plan" in outs[1] and "'replica0'" in outs[1], outs[1][-2000:]
