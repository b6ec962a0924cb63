"""benchmarks/cross_cluster.py's saved results (docs/dips.md's tables): a momentum sweep is one
run with one group per momentum, each mode compared with sync DiLoCo at the same momentum."""
from __future__ import annotations

import pytest

from benchmark_modules import load

cross_cluster = load("cross_cluster")


def _result(mode: str, momentum: float, throughput: float, loss: float) -> dict:
    return {"mode": mode, "label": cross_cluster.MODES[mode][-1], "momentum": momentum, "tokens": 1000,
            "throughput": throughput, "final_loss": loss, "rounds": 3, "rejected": 0, "mean_scale": 0.5,
            "min_scale": 0.25, "mean_stale_scale": 0.7, "staleness": 1.5, "max_staleness": 3,
            "bytes_per_round": 3.2e6 if mode in ("dips", "sync") else 1e5, "peak_bytes_s": 1e6,
            "join_bytes": 1.6e6 if mode in ("dips", "sync") else 8e5, "slow_cluster_throughput": throughput / 8}


def test_a_sweep_compares_each_mode_with_sync_at_its_own_momentum():
    args = cross_cluster.parse(["--clusters", "9", "--churn", "--outer-momentum", "0.5,0.8", "--modes", "dips,sync"])
    assert args.outer_momentum == [0.5, 0.8]
    tag = cross_cluster.run_tag(args)
    assert tag == "9c-churn-momentum-0.5-0.8"
    results = [_result("dips", 0.5, 300.0, 2.2), _result("sync", 0.5, 200.0, 2.0),
               _result("dips", 0.8, 300.0, 3.0), _result("sync", 0.8, 100.0, 4.0)]
    cross_cluster.compare_with_sync(results)
    saved = cross_cluster.measurements(results, tag)
    groups = {m.group for m in saved}
    assert groups == {f"cross-cluster {tag}, outer momentum {m}: wall seconds per 1000 tokens" for m in ("0.5", "0.8")}
    by = {(m.group.split("momentum ")[1][:3], m.name): m for m in saved}
    dips5, sync5, dips8 = by[("0.5", "Di-PS")], by[("0.5", "sync DiLoCo")], by[("0.8", "Di-PS")]
    assert sync5.extra_info["peer"] and not dips5.extra_info["peer"]
    assert dips5.samples == [pytest.approx(1000 / 300)] and sync5.samples == [pytest.approx(5.0)]
    assert dips5.extra_info["loss_vs_sync"] == "+10.0%"  # 2.2 against 2.0 at the same momentum
    assert dips8.extra_info["loss_vs_sync"] == "-25.0%"  # 3.0 against 4.0, not against 0.5's sync
    assert sync5.extra_info["loss_vs_sync"] == ""
    assert dips5.extra_info["clip_mean/min"] == "0.50 / 0.25" and dips5.extra_info["stale_mean/max"] == "1.5 / 3"
    assert "target" in dips5.extra_info and "target" not in sync5.extra_info


def test_a_run_without_sync_states_no_target():
    alone = [_result("dips", 0.0, 300.0, 2.2), _result("dips-nofilter", 0.0, 310.0, 2.3)]
    cross_cluster.compare_with_sync(alone)
    saved = cross_cluster.measurements(alone, "9c-churn-faulty")
    assert all("target" not in m.extra_info and m.extra_info["loss_vs_sync"] == "" for m in saved)


def test_the_default_momentum_keeps_the_plain_tag():
    assert cross_cluster.run_tag(cross_cluster.parse([])) == "4c"
    assert cross_cluster.run_tag(cross_cluster.parse(["--modes", "dips,dips-int8", "--links", "10,10,0.1,10"])) == \
        "4c-compressed-links-10-10-0.1-10"
    assert cross_cluster.run_tag(cross_cluster.parse(["--faulty", "1", "--clusters", "9", "--churn",
                                                      "--outer-momentum", "0,0.8"])) == "9c-churn-faulty-momentum-0-0.8"


@pytest.mark.parametrize("value", ["x", "0.5,", "1", "-0.1"])
def test_a_bad_momentum_is_refused_naming_it(value, capsys):
    with pytest.raises(SystemExit):
        cross_cluster.parse(["--outer-momentum", value])
    assert "--outer-momentum" in capsys.readouterr().err


def test_compressed_modes_are_compared_with_uncompressed_dips():
    results = [_result("dips", 0.0, 100.0, 2.0), _result("sync", 0.0, 50.0, 2.1), _result("dips-topk", 0.0, 150.0, 2.02)]
    cross_cluster.compare_with_sync(results)
    topk = results[2]["vs_dips"]
    assert topk["bytes"] == 32.0 and topk["throughput"] == 1.5 and abs(topk["loss"] - 0.01) < 1e-12
    assert "vs_dips" not in results[0] and "vs_dips" not in results[1]
    saved = cross_cluster.measurements(results, "4c")
    assert saved[2].extra_info["vs_Di-PS"] == "32.0x fewer bytes, 1.50x tokens/s, loss +1.0%"
    assert saved[2].extra_info["KB_per_round"] == 100


def test_peak_bytes_counts_the_largest_one_second_burst_after_the_join():
    logs = {"c0": [{"t": 0.0, "bytes": 5000}, {"t": 0.5, "bytes": 5000}, {"t": 1.0, "bytes": 5300},
                   {"t": 1.4, "bytes": 5600}, {"t": 3.0, "bytes": 5700}],
            "c1": [{"event": "start"}, {"t": 0.0, "bytes": 100}, {"t": 2.0, "bytes": 550}]}
    assert cross_cluster.peak_bytes(logs) == 600.0  # c0's 300 + 300 within one second; not its 5000 at join


def test_round_bytes_leaves_the_join_apart():
    """c0 joined with one 800-byte pull, then pushed 3 times (300 bytes) and pulled 3 more times
    (90 bytes): 100 + 30 bytes a round; c1 never pushed and is not counted."""
    logs = {"c0": [{"event": "ready", "join_bytes": 800, "join_pulls": 1}, {"t": 1.0, "bytes": 900},
                   {"event": "end", "stats": {"pushed": 3, "push_bytes": 300, "pulls": 4, "pull_bytes": 890}}],
            "c1": [{"event": "ready", "join_bytes": 800, "join_pulls": 1},
                   {"event": "end", "stats": {"pushed": 0, "push_bytes": 0, "pulls": 1, "pull_bytes": 800}}]}
    assert cross_cluster.round_bytes(logs) == (130.0, 800.0)


@pytest.mark.parametrize("preset,gbps", [("paper", [10, 10, 1, 10]), ("slowest", [10, 10, 0.1, 10]),
                                         ("slow", [1, 1, 0.1, 1]), ("10,5,1,0.5", [10, 5, 1, 0.5])])
def test_link_presets_give_each_cluster_its_gbps(preset, gbps):
    args = cross_cluster.parse(["--links", preset])
    rates = cross_cluster.link_rates(args, cross_cluster.load_config(args.model), 0.3)
    assert [r / rates[0] for r in rates] == pytest.approx([g / gbps[0] for g in gbps], rel=1e-3)


def test_a_bad_links_value_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        cross_cluster.parse(["--links", "fast"])
    assert "--links 'fast'" in capsys.readouterr().err


def test_the_slow_cluster_ratio_is_against_uncompressed_dips():
    results = [_result("dips", 0.0, 100.0, 2.0), _result("dips-sign", 0.0, 150.0, 2.1)]
    cross_cluster.compare_with_sync(results)
    assert results[1]["vs_dips"]["slow_cluster"] == pytest.approx(1.5)
