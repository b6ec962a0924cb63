"""Small random clusters for checking the search against exhaustive enumeration."""
import random

from heteropp.cluster import GB, ChipSpec, ClusterSpec, LinkSpec
from heteropp.model_spec import ModelSpec


def small_case(seed: int):
    rng = random.Random(seed)
    L = rng.choice([6, 8, 12])
    model = ModelSpec(n_layers=L, hidden=2048, heads=16, kv_heads=8, ffn=5504, vocab=32000, seq=2048)
    chips = []
    for name in "XYZ"[: rng.choice([2, 3])]:
        chips.append(ChipSpec(
            name=name, count=rng.choice([4, 8, 16]), memory=rng.choice([8, 12, 16, 24, 40, 10 ** 6]) * GB, chips_per_node=8,
            tp_max=rng.choice([2, 4, 8]), intra_node_bandwidth=rng.choice([50, 100]) * GB, hbm_bandwidth=1e12,
            nic_bandwidth=rng.choice([5, 12.5]) * GB, effective_tflops=rng.choice([30, 60, 100, 150]),
        ))
    cluster = ClusterSpec(chips=tuple(chips), inter_node=LinkSpec(12.5 * GB, 1e-5),
                          inter_cluster=LinkSpec(rng.choice([1, 12.5]) * GB, 5e-5))
    gbs = rng.choice([16, 32, 64]) * model.seq
    alpha = rng.choice([1.0, 1.0, 0.5, 0.0])
    return model, cluster, gbs, alpha


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


def broad_case(seed: int):
    """A wider generator than small_case: measured (non-analytic) layer times whose TP scaling
    and update costs vary per chip, odd chip counts, any layer count from 2 to 16, ample or
    tight memory or memory that never binds (10**6 GB), every alpha the search accepts."""
    rng = random.Random(10_000 + seed)
    L = rng.randint(2, 16)
    model = ModelSpec(n_layers=L, hidden=1024, heads=16, kv_heads=8, ffn=2816, vocab=32000, seq=1024)
    chips = []
    for name in "XYZ"[: rng.choice([1, 2, 2, 3])]:
        tp_max = rng.choice([1, 2, 4])
        base = rng.uniform(1.0, 20.0)
        times = {}
        for tp in (1, 2, 4):
            if tp > tp_max:
                break
            eff = rng.uniform(0.5, 1.0) if tp > 1 else 1.0
            fwd = base / (tp * eff)
            times[tp] = {"fwd": fwd, "bwd": fwd * rng.uniform(1.5, 2.5), "recompute": fwd * rng.uniform(0.9, 1.1),
                         "update": rng.uniform(0.0, 3.0) / tp}
        chips.append(ChipSpec(
            name=name, count=rng.choice([1, 2, 3, 4, 6, 8]), memory=rng.choice([2, 4, 8, 64, 10 ** 6]) * GB,
            chips_per_node=8, tp_max=tp_max, intra_node_bandwidth=100 * GB, hbm_bandwidth=1e12,
            nic_bandwidth=rng.choice([1, 12.5]) * GB, measured_ms=times,
        ))
    cluster = ClusterSpec(chips=tuple(chips), inter_node=LinkSpec(12.5 * GB, 1e-5),
                          inter_cluster=LinkSpec(rng.choice([0.5, 12.5]) * GB, 5e-5))
    gbs = rng.choice([4, 8, 12, 16, 24, 32]) * model.seq
    alpha = rng.choice([1.0, 0.5, 0.0])
    return model, cluster, gbs, alpha
