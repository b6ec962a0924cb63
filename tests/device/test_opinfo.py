"""PyTorch's OpInfo database run on dipu agrees with the same samples run on CPU.

One sweep (tests/device/opinfo_sweep.py) runs the first 3 CPU samples of every OpInfo in
``op_db`` on CPU and on dipu and compares forward results and gradients; then each op's
function, in-place and out= forms in its preferred dtype, bf16 and fp16, every sample under the
size cap. The checks: at least 90% of
the ops whose CPU samples run agree forward, at least 90% of the differentiable ones agree in
their gradients, at least 90% of the (op, variant, dtype) combinations that run on CPU agree,
the ops and combinations that do not agree are exactly those listed with a reason in
tests/device/opinfo_expectations.py, and no op needed the CPU fallback. The table is printed and
written to build/opinfo.json (docs/opinfo.md quotes it).
"""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

import opinfo_sweep
from opinfo_expectations import COMBINATION_FAILURES, FORWARD_FAILURES, GRAD_FAILURES

# One xdist worker takes the whole module (its group), so the sweep runs once.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("opinfo")]

REPORT = Path(__file__).resolve().parents[2] / "build" / "opinfo.json"
SAMPLES_PER_OP = 3
SAMPLES_PER_COMBINATION = None  # every sample under the size cap (the whole variant sweep takes ~45 s)


@pytest.fixture(scope="module")
def summary() -> dict:
    # In a thread of its own: a shallow stack. Many samples call torch.manual_seed, which queues
    # lazy seeding calls for CUDA, XPU and MTIA that each format the caller's stack; under
    # pytest's frames that took as long as the sweep itself.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        results, combos = pool.submit(opinfo_sweep.sweep, max_samples=SAMPLES_PER_OP,
                                      variant_samples=SAMPLES_PER_COMBINATION).result()
    s = opinfo_sweep.write_report(results, combos, REPORT)
    print("\n" + opinfo_sweep.format_summary(s))
    return s


def test_most_of_op_db_runs_on_cpu(summary):
    # The denominator is meaningful only if the sweep really covered op_db.
    assert summary["ops"] > 600
    assert summary["ops_cpu_ran"] >= 0.95 * summary["ops"], summary["cpu_skipped"]


def test_forward_agrees_for_at_least_90_percent_of_ops(summary):
    assert summary["forward_rate"] >= 0.90, opinfo_sweep.format_summary(summary)


def test_gradients_agree_for_at_least_90_percent_of_differentiable_ops(summary):
    assert summary["grad_checked"] > 400
    assert summary["grad_rate"] >= 0.90, opinfo_sweep.format_summary(summary)


def test_variants_and_dtypes_agree_for_at_least_90_percent_of_combinations(summary):
    by_variant, by_dtype = summary["combos_by_variant"], summary["combos_by_dtype"]
    assert by_variant["inplace"] > 100 and by_variant["out"] > 200, by_variant
    assert by_dtype.get("bfloat16", 0) > 300 and by_dtype.get("float16", 0) > 300, by_dtype
    assert summary["combos_rate"] >= 0.90, opinfo_sweep.format_summary(summary)


def test_disagreeing_combinations_are_exactly_the_listed_ones(summary):
    failures = summary["combo_failures"]
    unexpected = {k: v for k, v in failures.items() if k not in COMBINATION_FAILURES}
    assert not unexpected, f"new disagreements in a variant or dtype (shim regressions?): {unexpected}"
    stale = sorted(set(COMBINATION_FAILURES) - set(failures))
    assert not stale, f"listed as failing but agree now; remove from opinfo_expectations.py: {stale}"


def test_disagreeing_ops_are_exactly_the_listed_ones(summary):
    unexpected = {k: v for k, v in summary["forward_failures"].items() if k not in FORWARD_FAILURES}
    assert not unexpected, f"new forward disagreements (shim regressions?): {unexpected}"
    unexpected = {k: v for k, v in summary["grad_failures"].items() if k not in GRAD_FAILURES}
    assert not unexpected, f"new gradient disagreements (shim regressions?): {unexpected}"
    stale = sorted(set(FORWARD_FAILURES) - set(summary["forward_failures"]))
    stale += sorted(set(GRAD_FAILURES) - set(summary["grad_failures"]))
    assert not stale, f"listed as failing but agree now; remove from opinfo_expectations.py: {stale}"


def test_random_ops_are_reproducible_on_dipu(summary):
    # op_db's random ops (normal, bernoulli, dropout, multinomial, ...) reseed every device's
    # generator before each call; dipu's own stream must then give the CPU's shapes and dtypes,
    # and the same values twice.
    random_ops = set(summary["random_ops"])
    assert {"bernoulli", "normal", "nn.functional.dropout", "multinomial"} <= random_ops
    assert not random_ops & set(summary["forward_failures"])


def test_no_op_fell_back_to_cpu(summary):
    # The emu vendor has every CPU kernel: a fallback here would mean the shim misjudged an op.
    assert summary["cpu_fallbacks"] == {}
