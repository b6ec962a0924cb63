"""The real runtime against the simulator, on a scenario small enough to run here: servers and
clients as threads, client compute and links paced by sleeping. Used by benchmarks/volunteer.py
to show that the simulator it compares systems with models this system's time per batch."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from heteropp.model_spec import ModelSpec  # noqa: E402
from volunteer.local import LocalJob, loopback_job  # noqa: E402
from volunteer.simulator import Participant, Scenario, batch_time  # noqa: E402

MODEL = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
SEQ, BATCH, MICRO, STEPS = 16, 16, 4, 5
ROW_SECONDS = (0.06, 0.09, 0.12)  # paced forward+backward of one row over a stage, per client kind
LINK = (0.01, 4e6)  # per task-data message: 10 ms and 4 MB/s


def measured_against_simulated() -> dict:
    """Seconds per batch of the runtime and of the simulator for the same clients and links."""
    job = loopback_job(MODEL, [(0, 2), (2, 4)], [(1, 1), (1, 1)], batch=BATCH, microbatches=MICRO, seq=SEQ,
                       steps=STEPS, lr=1e-3, delayed_updates=True)
    per_row_flops = 2 * 3 * ModelSpec.from_dict(MODEL, seq=SEQ).layer_forward_flops()  # two layers a stage
    row_bytes = SEQ * MODEL["dim"] * 4
    finished: dict[int, float] = {}
    lj = LocalJob(job)
    last = next(s for s in lj.servers if s.name == job.stages[-1].frontal[0].name)
    last.role.on_loss = lambda step, loss: finished.setdefault(step, time.monotonic())
    people = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        for k in range(2):
            for i, row_s in enumerate(ROW_SECONDS):
                lj.add_client(k, f"c{k}{i}", flops=1 / row_s, emulate_flops=per_row_flops / row_s, link=LINK)
                people.append(Participant(f"c{k}{i}", k, row_s, 2 * LINK[0], 2 * row_bytes / LINK[1]))
        if not lj.wait(300):
            raise RuntimeError("the measured run did not finish")
    finally:
        lj.close()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    measured = (finished[STEPS - 1] - finished[0]) / (STEPS - 1)  # the first step includes start-up
    simulated = batch_time(Scenario(tuple(people), (0.0,), MICRO, BATCH // MICRO, detect=math.inf), "pool", {})
    print(f"\nmeasured runtime vs simulator, task pool without departures ({len(people)} paced clients, 2 stages): "
          f"{measured:.2f} s vs {simulated:.2f} s per batch (ratio {measured / simulated:.2f}); "
          f"run wall {wall:.0f} s, CPU {cpu:.0f} s")
    return {"measured_s_per_batch": measured, "simulated_s_per_batch": simulated, "wall_s": wall, "cpu_s": cpu}


if __name__ == "__main__":
    measured_against_simulated()
