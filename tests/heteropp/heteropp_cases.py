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


def two_dc_plan(latency_us: float, bandwidth_gbps: float, dp: int = 2, layers: list[int] | None = None,
                microbatches: int = 8, dc_stages: tuple[int, int] = (2, 2), held: float = 6.5,
                one_dc: bool = False, schedule: str = "1f1b"):
    """A plan of ``llama-tiny`` (16 layers) over two DCs: ``dc_stages`` stages of chip X in DC1
    then of chip Y in DC2 (identical chips, so they differ only by where they sit), ``dp``
    replicas, the DCs joined by ``inter_cluster``; each chip's memory holds the first stage
    and ``held`` of its micro-batches' activations (and at least what any stage needs under 1F1B). ``one_dc``: every stage on X, in one DC."""
    import dataclasses

    import yaml

    from heteropp.plan import Plan, StagePlan

    spec = dict(yaml.safe_load((CONFIGS / "llama-tiny.yaml").read_text()), n_layers=sum(layers or []) or 16)
    model = ModelSpec.from_dict(spec, name="llama-tiny")
    chip = {"count": 64, "memory_gb": 1000, "chips_per_node": 8, "tp_max": 1, "intra_node_gbps": 100,
            "hbm_gbps": 1000, "nic_gbps": 100, "effective_tflops": 0.02}
    cluster = ClusterSpec.from_dict({"chips": {"X": chip, "Y": chip}, "links": {
        "inter_node": {"bandwidth_gbps": 100, "latency_us": 5},
        "inter_cluster": {"bandwidth_gbps": bandwidth_gbps, "latency_us": latency_us}}})
    S = sum(dc_stages)
    layers = layers or [model.n_layers // S + (1 if i < model.n_layers % S else 0) for i in range(S)]
    stages, first = [], 0
    for i, n in enumerate(layers):
        chip_name = "X" if one_dc or i < dc_stages[0] else "Y"
        stages.append(StagePlan(chip_name, 1, dp, n, first, False, i * dp))
        first += n
    plan = Plan(model, cluster, microbatches * dp * model.seq, dp, tuple(stages), schedule=schedule)
    static, per = plan.stage_memory(0, inflight=0), plan.stage_memory(0, inflight=1) - plan.stage_memory(0, inflight=0)
    chip["memory_gb"] = max(static + held * per, *(plan.stage_memory(i, inflight=min(S - i, microbatches)) for i in range(S))) / 0.9 / GB
    cluster = ClusterSpec.from_dict({**plan.cluster.to_dict(), "chips": {"X": chip, "Y": chip}})
    plan = dataclasses.replace(plan, cluster=cluster)
    plan.validate()
    return plan
