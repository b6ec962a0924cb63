"""The HeteroSpeedupRatio's formula against hand-computed cases, and the planner's report of it:
each chip group alone beside the whole cluster, and the fastest subset when a group alone beats
the whole."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from heteropp.cluster import GB, ChipSpec, ClusterSpec, LinkSpec
from heteropp.hsr import expected, fastest_subset, hetero_speedup_ratio, sub_cluster, throughput
from heteropp.model_spec import ModelSpec
from heteropp.search import HeteroAuto

ROOT = Path(__file__).resolve().parents[2]


def test_the_ratio_is_the_mixed_throughput_over_the_groups_summed():
    # the paper's Exp-A-2 shape: groups of 37.7k, 52.9k and 16.2k tokens/s, 115.9k together
    assert hetero_speedup_ratio(115_900.0, [37_700.0, 52_900.0, 16_200.0]) == pytest.approx(115.9 / 106.8)
    assert hetero_speedup_ratio(50.0, [100.0, 0.0]) == 0.5  # a group that cannot train alone counts 0
    with pytest.raises(ValueError, match="undefined"):
        hetero_speedup_ratio(10.0, [0.0, 0.0])
    with pytest.raises(ValueError, match=">= 0"):
        hetero_speedup_ratio(-1.0, [1.0])


MODEL = ModelSpec(n_layers=8, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=8192, seq=512)


def _cluster(slow_link: bool) -> ClusterSpec:
    chips = (ChipSpec(name="F", count=4, memory=80 * GB, chips_per_node=8, tp_max=2, intra_node_bandwidth=100 * GB,
                      hbm_bandwidth=1e12, nic_bandwidth=12.5 * GB, effective_tflops=200),
             ChipSpec(name="S", count=1, memory=80 * GB, chips_per_node=8, tp_max=1, intra_node_bandwidth=100 * GB,
                      hbm_bandwidth=1e12, nic_bandwidth=12.5 * GB, effective_tflops=2))
    link = LinkSpec(0.01 * GB if slow_link else 12.5 * GB, 5e-3 if slow_link else 5e-5)
    return ClusterSpec(chips=chips, inter_node=LinkSpec(12.5 * GB, 1e-5), inter_cluster=link)


def test_a_slow_extra_chip_is_reported_and_left_out_on_request():
    """One chip 100x slower behind a slow link: the fast group alone beats the whole cluster;
    the planner says so, and the fastest subset is the fast group, whose own plan it is."""
    cluster = _cluster(slow_link=True)
    gbs = 8 * MODEL.seq
    auto = HeteroAuto(MODEL, cluster, gbs)
    whole = auto.to_plan(auto.search())
    exp = expected(MODEL, cluster, gbs, 1.0, whole)
    fast_alone = exp.alone["F"]
    assert throughput(fast_alone) > throughput(whole) and "F" in exp.faster_groups()
    best = fastest_subset(MODEL, cluster, gbs, 1.0, exp)
    assert [c.name for c in best.cluster.chips] == ["F"]
    assert throughput(best) == pytest.approx(throughput(fast_alone))
    solo = HeteroAuto(MODEL, sub_cluster(cluster, ["F"]), gbs)
    assert best.estimate["iteration_time_s"] == pytest.approx(solo.to_plan(solo.search()).estimate["iteration_time_s"])


def test_plan_prints_the_groups_alone_and_plans_the_subset_when_asked(tmp_path):
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(_cluster(slow_link=True).to_dict()))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4,
                                                         "ffn_dim": 1408, "vocab_size": 8192, "max_seq_len": 512}))
    base = [sys.executable, "-m", "ditorch.cli", "plan", "--cluster", str(tmp_path / "cluster.yaml"),
            "--model", str(tmp_path / "model.yaml"), "--gbs", str(8 * 512)]
    plain = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert "expected HeteroSpeedupRatio" in plain.stdout
    assert "chip group(s) F" in plain.stdout and "alone would train faster" in plain.stdout
    subset = subprocess.run(base + ["--allow-subset"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert subset.returncode == 0, subset.stderr
    assert "planning the fastest subset of chip types: F" in subset.stdout


def test_the_measured_ratio_is_the_runs_tokens_over_their_seconds():
    """`ditorch hsr`'s arithmetic on hand-made runs: groups of 2048 tokens in 4 s and 8 s
    (512 + 256 tokens/s) against all chips at 2048 tokens in 3 s and 6144 in 7 s."""
    from ditorch.hsr import Measurement, RunResult

    cluster = _cluster(slow_link=False)
    gbs = 2048

    def plan(tokens: int):
        auto = HeteroAuto(MODEL, cluster, tokens)
        return auto.to_plan(auto.search())

    alone = [RunResult("F alone", plan(gbs), 4.0, 5.0, 1.0), RunResult("S alone", plan(gbs), 8.0, 8.0, 1.0)]
    together = {"constant": RunResult("all, constant batch", plan(gbs), 3.0, 2.0, 1.0),
                "sum": RunResult("all, sum batch", plan(3 * gbs), 7.0, 7.0, 1.0)}
    m = Measurement(alone, together)
    assert m.ratio("constant") == pytest.approx((2048 / 3) / 768)
    assert m.ratio("sum") == pytest.approx((6144 / 7) / 768)
    assert m.ratio("constant", simulated=True) == pytest.approx((2048 / 2) / (2048 / 5 + 2048 / 8))
    assert m.to_dict()["hsr"]["sum"]["measured"] == pytest.approx(m.ratio("sum"))


def test_hsr_refuses_a_bad_batch_and_a_cluster_of_one_chip_type(tmp_path, capsys):
    from ditorch.cli import main

    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(_cluster(slow_link=False).to_dict()))
    one = _cluster(slow_link=False).to_dict()
    one["chips"].pop("S")
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4,
                                                         "ffn_dim": 1408, "vocab_size": 8192, "max_seq_len": 512}))
    common = ["--model", str(tmp_path / "model.yaml"), "--gbs", "4K", "--out", str(tmp_path / "out")]
    assert main(["hsr", "--cluster", str(tmp_path / "cluster.yaml"), "--batch", "double", *common]) == 1
    assert "--batch 'double': expected constant, sum or both" in capsys.readouterr().err
    assert main(["hsr", "--cluster", str(tmp_path / "one.yaml"), *common]) == 1
    assert "one chip type; the HeteroSpeedupRatio compares two or more" in capsys.readouterr().err
    assert main(["hsr", "--cluster", str(tmp_path / "cluster.yaml"), "--steps", "1", *common]) == 1
    assert "--steps 1: expected at least 2" in capsys.readouterr().err


def test_a_group_that_runs_out_of_memory_alone_counts_zero_and_says_why(monkeypatch, tmp_path):
    import sys

    from ditorch import hsr as hsr_command

    def failing(output: str):  # a run that prints ``output`` and exits 1, in place of torchrun
        return lambda *a: [sys.executable, "-c", f"import sys; print({output!r}); sys.exit(1)"]

    oom = "ditorch.train: rank 0 failed: OutOfMemoryError: DIPU out of memory. Tried to allocate 68.62 MiB"
    monkeypatch.setattr(hsr_command, "train_command", failing(f"noise\n{oom}\nmore noise"))
    auto = HeteroAuto(MODEL, _cluster(slow_link=False), 2048)
    r = hsr_command.train_and_time("S alone", auto.to_plan(auto.search()), tmp_path, 4)
    assert r.failure == oom and r.throughput() == 0.0 and "did not train: " + oom in hsr_command.row(r)
    m = hsr_command.Measurement([r, hsr_command.RunResult("F alone", r.plan, 4.0, 4.0, 1.0)],
                                {"constant": hsr_command.RunResult("all", r.plan, 2.0, 2.0, 1.0)})
    assert m.ratio("constant") == pytest.approx((2048 / 2) / (2048 / 4))
    assert "S alone did not train on this runtime and counts 0" in hsr_command.ratio_table(m)
    monkeypatch.setattr(hsr_command, "train_command", failing("Segmentation fault"))
    with pytest.raises(RuntimeError, match=r"S alone: the run failed \(exit 1; .*S_alone.log\):\nSegmentation fault"):
        hsr_command.train_and_time("S alone", r.plan, tmp_path, 4)


# In place of torchrun: records when it ran, sleeps, then writes a two-step trace of the plan's
# stages (or fails at once when its plan's first chip is named in FAIL).
_FAKE_RUN = """
import json, sys, time
plan_path, trace, spans, fail = sys.argv[1:5]
plan = json.load(open(plan_path))
if plan["stages"][0]["chip"] == fail:
    sys.exit(3)
start = time.time()
time.sleep(float(sys.argv[5]))
with open(spans, "a") as f:
    f.write(f"{start} {time.time()}\\n")
events = [{"ph": "X", "pid": s, "tid": s, "ts": (start + k) * 1e6, "dur": 5e5, "args": {"step": k, "kind": "F"}}
          for s in range(len(plan["stages"])) for k in (0, 1)]
json.dump({"traceEvents": events}, open(trace, "w"))
"""


def _fake_runs(monkeypatch, hsr_command, spans: Path, fail: str = "", sleep: float = 1.0) -> None:
    monkeypatch.setattr(hsr_command, "train_command", lambda plan_path, trace, chips, steps: [
        sys.executable, "-c", _FAKE_RUN, str(plan_path), str(trace), str(spans), fail, str(sleep)])


def test_the_groups_alone_train_side_by_side_and_the_whole_cluster_after_them(monkeypatch, tmp_path):
    from ditorch import hsr as hsr_command

    spans = tmp_path / "spans"
    _fake_runs(monkeypatch, hsr_command, spans)
    m = hsr_command.measure(MODEL, _cluster(slow_link=False), 2048, tmp_path / "out", batches=("constant",),
                            progress=lambda line: None)
    assert [r.name for r in m.alone] == ["F alone", "S alone"] and list(m.together) == ["constant"]
    assert all(r.measured_s == pytest.approx(1.0) for r in [*m.alone, m.together["constant"]])
    (a0, a1), (b0, b1), (t0, _) = sorted(tuple(map(float, line.split())) for line in spans.read_text().splitlines())
    assert b0 < a1 and t0 >= max(a1, b1)  # the groups overlap; the whole cluster starts after both
    spans.unlink()
    hsr_command.measure(MODEL, _cluster(slow_link=False), 2048, tmp_path / "out", batches=("constant",),
                        progress=lambda line: None, groups_at_once=False)
    (a0, a1), (b0, b1), _ = sorted(tuple(map(float, line.split())) for line in spans.read_text().splitlines())
    assert b0 >= a1  # in turn


def test_a_group_that_fails_stops_the_groups_beside_it(monkeypatch, tmp_path):
    import time

    from ditorch import hsr as hsr_command

    _fake_runs(monkeypatch, hsr_command, tmp_path / "spans", fail="S", sleep=60.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"S alone: the run failed \(exit 3"):
        hsr_command.measure(MODEL, _cluster(slow_link=False), 2048, tmp_path / "out", batches=("constant",),
                            progress=lambda line: None)
    assert time.monotonic() - start < 30  # F alone's 60 s run was stopped, not waited for
