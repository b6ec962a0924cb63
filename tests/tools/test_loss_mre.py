"""LossLogger / load_losses and the MRE against hand-computed cases."""
import json

import pytest
import torch

from ditorch.cli import main as ditorch_main
from ditorch.tools import LossLogger, load_losses, mean_relative_error, plot_mre


def test_mre_hand_computed():
    # relative errors 0.1, 0.25, 0 -> mean 0.35/3 = 11.666...%
    report = mean_relative_error({0: 2.0, 1: 4.0, 2: 5.0}, {0: 2.2, 1: 3.0, 2: 5.0})
    assert report.n == 3
    assert report.mre_percent == pytest.approx(35 / 3)
    assert report.worst[0] == (1, 4.0, 3.0, pytest.approx(0.25))
    assert report.worst[1] == (0, 2.0, 2.2, pytest.approx(0.1))
    assert not report.passed(1.5) and report.passed(12.0)


def test_mre_is_relative_to_the_reference_not_the_run():
    # |(y - yhat)/y|: y=1, yhat=2 -> 100%; swapped y=2, yhat=1 -> 50%
    assert mean_relative_error({5: 1.0}, {5: 2.0}).mre_percent == pytest.approx(100.0)
    assert mean_relative_error({5: 2.0}, {5: 1.0}).mre_percent == pytest.approx(50.0)


def test_identical_runs_have_zero_mre():
    losses = {i: 5.0 / (i + 1) for i in range(300)}
    report = mean_relative_error(losses, dict(losses))
    assert report.mre_percent == 0.0 and report.n == 300


def test_step_range_policy():
    ref = {i: 1.0 for i in range(10)}
    short = {i: 1.0 for i in range(7)}
    with pytest.raises(ValueError, match=r"run lacks reference steps 7-9"):
        mean_relative_error(ref, short)
    with pytest.raises(ValueError, match=r"reference lacks run steps 12"):
        mean_relative_error(ref, {**ref, 12: 1.0})
    report = mean_relative_error(ref, short, common_steps_only=True)
    assert report.n == 7 and report.ignored_steps == 3
    with pytest.raises(ValueError, match="no common steps"):
        mean_relative_error({0: 1.0}, {1: 1.0}, common_steps_only=True)
    with pytest.raises(ValueError, match="reference loss at step 0 is 0"):
        mean_relative_error({0: 0.0}, {0: 1.0})
    with pytest.raises(ValueError, match="no steps"):
        mean_relative_error({}, {0: 1.0})


def test_logger_round_trip_and_context_manager(tmp_path):
    path = tmp_path / "sub" / "loss.jsonl"
    with LossLogger(path) as log:
        log.log(0, torch.tensor(3.5), tokens=512)
        log.log(1, 3.25, tokens=1024)
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    assert lines == [{"step": 0, "loss": 3.5, "tokens": 512}, {"step": 1, "loss": 3.25, "tokens": 1024}]
    assert load_losses(path) == {0: 3.5, 1: 3.25}
    with pytest.raises(ValueError, match="closed"):
        log.log(2, 1.0, 1)
    with LossLogger(path, append=True) as log:
        log.log(2, 3.0, 1536)
    assert load_losses(path) == {0: 3.5, 1: 3.25, 2: 3.0}


def test_logger_rejects_bad_values(tmp_path):
    with LossLogger(tmp_path / "l.jsonl") as log:
        with pytest.raises(ValueError, match="finite"):
            log.log(0, float("nan"), 1)
        with pytest.raises(ValueError, match="step"):
            log.log(-1, 1.0, 1)
        with pytest.raises(ValueError, match="tokens"):
            log.log(0, 1.0, 1.5)


@pytest.mark.parametrize("content, message", [
    ("", "empty loss log"),
    ("\n\n", "empty loss log"),
    ('{"step": 0, "loss": 1.0}\nnot json\n', r":2: not a JSON line"),
    ('{"step": 0, "loss": NaN, "tokens": 1}\n', r":1: loss at step 0 is nan"),
    ('{"step": 0, "loss": Infinity}\n', "loss at step 0 is inf"),
    ('{"step": 0}\n', "expected an object with 'step' and 'loss'"),
    ('{"step": "a", "loss": 1}\n', "step must be a non-negative integer"),
    ('{"step": 0, "loss": "1"}\n', "loss must be a number"),
    ('{"step": 0, "loss": 1}\n{"step": 0, "loss": 2}\n', ":2: step 0 appears twice"),
])
def test_load_losses_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_losses(path)


def _write(path, losses):
    with LossLogger(path) as log:
        for step, loss in losses.items():
            log.log(step, loss, tokens=step * 100)
    return str(path)


def test_cli_pass_fail_plot_and_errors(tmp_path, capsys):
    ref = _write(tmp_path / "ref.jsonl", {i: 4.0 - i * 0.01 for i in range(50)})
    close = _write(tmp_path / "close.jsonl", {i: (4.0 - i * 0.01) * 1.004 for i in range(50)})
    far = _write(tmp_path / "far.jsonl", {i: (4.0 - i * 0.01) * 1.03 for i in range(50)})
    png = tmp_path / "mre.png"
    assert ditorch_main(["mre", ref, close, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "MRE 0.4000%" in out and "PASS" in out and "n=50" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ditorch_main(["mre", ref, far, "--threshold", "1.5"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert ditorch_main(["mre", ref, far, "--threshold", "5"]) == 0
    short = _write(tmp_path / "short.jsonl", {i: 4.0 for i in range(20)})
    assert ditorch_main(["mre", ref, short]) == 2
    assert "run lacks reference steps 20-49" in capsys.readouterr().err
    assert ditorch_main(["mre", ref, short, "--common-steps"]) in (0, 1)
    assert ditorch_main(["mre", ref, str(tmp_path / "missing.jsonl")]) == 2
    assert "no such loss log" in capsys.readouterr().err


def test_plot_several_runs(tmp_path):
    ref = {i: 3.0 - 0.001 * i for i in range(100)}
    reports = {f"chip {c}": mean_relative_error(ref, {i: v * (1 + k * 0.002) for i, v in ref.items()})
               for k, c in enumerate("ABCD", 1)}
    out = plot_mre(reports, tmp_path / "all.png")
    assert open(out, "rb").read(4) == b"\x89PNG"
