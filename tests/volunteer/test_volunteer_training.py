"""End to end: servers and clients as threads on loopback, checked against plain training.

With delayed updates off, a job computes exactly what one process computes, whatever the number
of servers and clients and whoever leaves: every row's gradient is counted once, at the same
parameters. So the checks are exact (fp32 rounding only): the loss per step against a
single-process run, and each shard's summed gradient against the full-batch gradient.
"""
from __future__ import annotations

import random
import socket
import time

import pytest
import torch

import ditorch  # noqa: F401  (registers dipu before any backward in this process; see the dipu test)
from volunteer.client import Departed
from volunteer.job import shard_bounds
from volunteer.local import LocalJob, loopback_job
from volunteer.reference import reference_run

TINY = dict(vocab_size=256, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32)
FAST = dict(task_timeout=3.0, liveness=1.5, push_timeout=3.0)


def stage_gradient(job, stage: int, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference gradient laid out as stage ``stage``'s flat parameter vector."""
    names = [n for n, _ in job.stage_module(stage).named_parameters()]
    missing = [n for n in names if n not in grads]
    assert not missing, f"stage parameters without a counterpart in the full model: {missing}"
    return torch.cat([grads[n].reshape(-1) for n in names])


def run(job, clients, timeout=120.0):
    lj = LocalJob(job)
    for shard in (s.shard for s in lj.servers):
        shard.applied = []
    try:
        for stage, name, kwargs in clients:
            lj.add_client(stage, name, **kwargs)
        assert lj.wait(timeout), "the job did not finish"
        return lj
    finally:
        lj.close()


def check_exact(job, lj):
    losses, grads = reference_run(job)
    got = [lj.losses[s] for s in range(job.steps)]
    assert got == pytest.approx(losses, abs=1e-5), (got, losses)
    for server in lj.servers:
        shard = server.shard
        assert len(shard.applied) == job.steps
        for step, applied in enumerate(shard.applied):
            full = stage_gradient(job, server.stage, grads[step])
            lo, hi = shard_bounds(full.numel(), len(job.stages[server.stage].servers), shard.index)
            torch.testing.assert_close(applied, full[lo:hi], rtol=1e-4, atol=1e-5 * float(full.abs().max()),
                                       msg=f"{server.name} step {step}: gradient differs from the full batch's")


def test_one_client_per_stage_equals_single_process_training():
    job = loopback_job(TINY, [(0, 1), (1, 3), (3, 4)], [(1, 1)] * 3, batch=8, microbatches=2, seq=16, steps=4,
                       lr=1e-2, weight_decay=0.1, **FAST)
    check_exact(job, run(job, [(k, f"c{k}", {}) for k in range(3)]))


def test_a_port_taken_before_its_server_binds_moves_the_job_to_fresh_ports():
    """free_port() cannot hold a port: another socket may take it before the server binds it.
    LocalJob then moves every server to fresh ports, and the job trains exactly as before."""
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(1, 1), (1, 1)], batch=4, microbatches=2, seq=16, steps=2,
                       lr=1e-2, **FAST)
    host, port = job.stages[1].frontal[0].address.rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.bind((host, int(port)))
        squatter.listen(1)
        lj = run(job, [(0, "a", {}), (1, "b", {})])
    moved = {s.name: s.address for st in lj.job.stages for s in st.servers}
    assert moved[job.stages[1].frontal[0].name] != job.stages[1].frontal[0].address
    check_exact(job, lj)


def test_many_servers_and_clients_of_unequal_speed_equal_single_process_training():
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(2, 3), (1, 2)], batch=12, microbatches=2, seq=16, steps=3,
                       lr=1e-2, **FAST)
    clients = [(0, "a", {"flops": 1e12}), (0, "b", {"flops": 3e12}), (0, "c", {"flops": 2e12}),
               (1, "d", {"flops": 1e12}), (1, "e", {"flops": 5e12})]
    check_exact(job, run(job, clients))


def departing(rng: random.Random, point: str):
    """A fault hook that departs at the n-th time the client reaches ``point``."""
    n = rng.randint(1, 4)
    seen = {"count": 0}

    def hook(where: str) -> None:
        if where == point:
            seen["count"] += 1
            if seen["count"] == n:
                raise Departed(where)
    return hook


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clients_leaving_anywhere_lose_no_row_and_count_none_twice(seed):
    rng = random.Random(seed)
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(2, 1), (1, 2)], batch=8, microbatches=2, seq=16, steps=3,
                       lr=1e-2, **FAST)
    # stragglers: each task outlasts the task timeout (and their silence the liveness window), so
    # what they do is redone by others and their late results must be refused, not counted twice
    clients = [(0, "stay0", {}), (1, "stay1", {}),
               (0, "straggler0", {"emulate_flops": 4e5}), (1, "straggler1", {"emulate_flops": 4e5})]
    for i, point in enumerate(["forward", "backward", "push"] * 2):
        clients.append((i % 2, f"leave-{point}-{i}", {"fault": departing(rng, point)}))
    check_exact(job, run(job, clients))


def test_delayed_updates_equal_single_process_training_with_delayed_updates():
    """DPU: step s computes with the parameters of step s - 1 while step s - 1's update is being
    aggregated; the reference applies the same rule in one process."""
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(1, 2), (2, 1)], batch=8, microbatches=2, seq=16, steps=4,
                       lr=1e-2, delayed_updates=True, **FAST)
    clients = [(0, "a", {}), (0, "b", {"flops": 2e12}), (1, "c", {}), (1, "d", {})]
    check_exact(job, run(job, clients))


def test_delayed_updates_under_churn_stay_within_2_percent_of_the_run_without():
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(1, 1), (1, 1)], batch=8, microbatches=2, seq=16, steps=5,
                       lr=1e-2, delayed_updates=True, **FAST)
    calm = run(job, [(0, "a", {}), (1, "b", {})]).losses
    rng = random.Random(7)
    clients = [(0, "a", {}), (1, "b", {})] + [(i % 2, f"leave{i}", {"fault": departing(rng, p)})
                                              for i, p in enumerate(["forward", "backward", "push", "forward"])]
    churn = run(job, clients).losses
    assert [churn[s] for s in range(job.steps)] == pytest.approx([calm[s] for s in range(job.steps)], rel=0.02)


def test_a_client_that_says_it_leaves_has_its_work_redone_at_once():
    """Timeouts of a minute: only the LEAVE a departing client sends lets the job end sooner."""
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(1, 1), (1, 1)], batch=8, microbatches=2, seq=16, steps=4,
                       lr=1e-2, task_timeout=60.0, liveness=60.0, push_timeout=60.0)
    slow = {"emulate_flops": 2e7}  # about 0.1 s a row: the job outlasts the leaver's second
    clients = [(0, "a", slow), (1, "b", slow), (0, "leaver0", {**slow, "leave_after": 1.0}),
               (1, "leaver1", {**slow, "leave_after": 1.5})]
    t0 = time.monotonic()
    lj = run(job, clients, timeout=45.0)
    assert time.monotonic() - t0 < 45.0
    check_exact(job, lj)


def test_clients_on_dipu_and_on_the_cpu_train_the_same_model():
    """The seam with DiTorch: one stage's clients compute on the dipu device, the other's on the
    CPU, and the job still equals single-process training. (ditorch is imported with this module,
    at collection: the autograd engine sizes its device queues at the process's first backward.)"""
    job = loopback_job(TINY, [(0, 2), (2, 4)], [(1, 1), (1, 1)], batch=8, microbatches=2, seq=16, steps=3,
                       lr=1e-2, **FAST)
    clients = [(0, "dipu0", {"device": "dipu"}), (0, "cpu0", {}), (1, "dipu1", {"device": "dipu"})]
    lj = run(job, clients)
    check_exact(job, lj)
    devices = {c.name: next(c.compute.module.parameters()).device.type for c, _ in lj.clients}
    assert devices == {"dipu0": "dipu", "cpu0": "cpu", "dipu1": "dipu"}
    assert all(c.tasks_done for c, _ in lj.clients if c.name != "cpu0")  # the dipu clients did compute


def test_a_hugging_face_model_with_a_token_file_equals_single_process_training(tmp_path):
    """A Qwen3 (per-head q/k norms, its own head width) over three volunteer stages, fed from a
    token file: the family's own model in one process is the reference."""
    pytest.importorskip("transformers")
    import numpy as np

    np.random.default_rng(3).integers(0, 96, 4000).astype(np.uint16).tofile(tmp_path / "t.bin")
    qwen3 = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24,
             "max_position_embeddings": 32, "tie_word_embeddings": False}
    job = loopback_job(qwen3, [(0, 1), (1, 3), (3, 4)], [(1, 1)] * 3, batch=8, microbatches=2, seq=16, steps=3,
                       lr=1e-2, weight_decay=0.1, data=str(tmp_path / "t.bin"), **FAST)
    check_exact(job, run(job, [(k, f"c{k}", {}) for k in range(3)]))


def test_a_volunteer_job_refuses_tied_embeddings_split_over_stages():
    pytest.importorskip("transformers")
    tied = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 32, "tie_word_embeddings": True}
    with pytest.raises(ValueError, match="ties its embedding and LM head"):
        loopback_job(tied, [(0, 1), (1, 2)], [(1, 1)] * 2, batch=8, microbatches=2, seq=16, steps=1)
