"""The seam between the pipeline runtime and Di-PS: a HeteroPP cluster (two stages of different
chips and TP sizes) trains through the PS, each stage's owning rank pushing and pulling its own
units; and it trains one model together with a data-parallel cluster."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from dips.auth import JobToken
from dips.client import OuterClient
from dips.follower import Follower
from diutil.address import free_port
from dips.harness import ClusterSpec, read_log, start_cluster
from dips.leader import Leader, LeaderConfig
from dips.model import build_model
from heteropp.model_spec import ModelSpec
from heteropp.runtime.reference import train_reference
from heteropp.runtime.trainer import TrainOptions
from plans import MODEL, make_plan, torchrun

STEPS = 6
TWO_STAGES = [("X", 2, 2, False), ("Y", 1, 2, False)]   # TP 2 then TP 1: shards are gathered per stage
# A Hugging Face Qwen3 (per-head q/k norms, a head width apart from hidden / heads).
QWEN3 = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 32,
         "tie_word_embeddings": False}


@contextlib.contextmanager
def parameter_server(tmp_path, model: dict = MODEL, **config):
    token = JobToken.create(tmp_path / "job.key")
    servers = JobToken.create(tmp_path / "servers.key")
    leader = Leader(LeaderConfig(model=dict(model), n_followers=2, bind="127.0.0.1:0", restart_followers=False,
                                 metadata=str(tmp_path / "leader.json"), heartbeat_s=2.0, **config), token, servers)
    followers = [Follower(leader.address, f"127.0.0.1:{free_port()}", servers, tmp_path / f"f{i}")
                 for i in range(2)]
    try:
        yield leader, token
    finally:
        for f in followers:
            f.stop()
        leader.stop()


def global_parameters(leader, token, config: dict = MODEL) -> dict[str, torch.Tensor]:
    model = build_model(dict(config), 0)
    reader = OuterClient(model, leader.address, 1, token=token, join=False)
    reader.fetch_global()
    reader.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("stages,dp,model", [(TWO_STAGES, 1, MODEL), ([("X", 1, 2, False), ("Y", 1, 2, False)], 2, MODEL),
                                            (TWO_STAGES, 1, QWEN3)], ids=["tp2-tp1", "dp2", "hf-qwen3-tp2-tp1"])
def test_pipeline_cluster_through_the_ps_equals_plain_training(tmp_path, stages, dp, model):
    """One pipeline cluster, H = 1, outer lr 1, momentum 0, no clipping, no penalty: every outer
    step hands the cluster its own parameters back (up to the BF16 of the wire), so training
    equals plain training (one CPU process: the pipeline equals it in fp32, tests/runtime/
    test_exactness.py), and the PS ends holding the cluster's model. With DP 2 the second replica
    gets the pulled values from the first, and the run checks after every outer step that both
    replicas hold the same bytes (a checkpoint keeps only one of them)."""
    if "model_type" in model:
        (tmp_path / "config.json").write_text(json.dumps(model))
        plan = make_plan(stages, dp=dp, model=ModelSpec.from_hf(tmp_path / "config.json"))
    else:
        plan = make_plan(stages, dp=dp)
    plan.to_json(tmp_path / "plan.json")
    common = ["--steps", str(STEPS), "--precision", "fp32"]
    plain, _ = train_reference(plan, TrainOptions(steps=STEPS, progress=False))
    with parameter_server(tmp_path, model, mode="async", outer_lr=1.0, outer_momentum=0.0,
                          clip_norm=None) as (leader, token):
        run = torchrun(tmp_path / "plan.json", plan.num_chips,
                       common + ["--loss-log", "ps.jsonl", "--save", "ckpt", "--ps", leader.address,
                                 "--inner-steps", "1", "--ps-token-file", str(tmp_path / "job.key"),
                                 "--ps-name", "pipeline", "--check-replicas", "1"], tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        status = leader.status()
        # every round took the cluster's one push (its membership lapses a few heartbeats after it
        # exits, which a loaded machine can reach before this line)
        assert status["version"] == STEPS
        assert [(r["accepted"], r["clusters"]) for r in leader.rounds_log] == [(1, ["pipeline"])] * STEPS
        final = global_parameters(leader, token, model)
    assert len(losses(tmp_path / "ps.jsonl")) == STEPS
    for step, (a, b) in enumerate(zip(losses(tmp_path / "ps.jsonl"), plain), 1):
        assert a == pytest.approx(b, rel=5e-4), f"step {step}: through the PS {a}, plain {b}"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from heteropp.runtime.checkpoint import latest_checkpoint

    dcp_to_torch_save(str(latest_checkpoint(tmp_path / "ckpt")), str(tmp_path / "full.pt"))
    saved = {k[len("model/"):]: v for k, v in torch.load(tmp_path / "full.pt").items() if k.startswith("model/")}
    assert sorted(saved) == sorted(final)
    for name, value in saved.items():  # the PS holds what the cluster trained, to BF16 precision
        torch.testing.assert_close(final[name], value.float(), rtol=1e-2, atol=1e-2 * value.abs().max().item())


@pytest.mark.slow
def test_pipeline_and_data_parallel_clusters_train_one_model(tmp_path):
    plan = make_plan(TWO_STAGES)
    plan.to_json(tmp_path / "plan.json")
    with parameter_server(tmp_path) as (leader, _):
        dp = start_cluster(ClusterSpec(name="dp", leader=leader.address, token_file=str(tmp_path / "job.key"),
                                       model=dict(MODEL), log=str(tmp_path / "dp.jsonl"), inner_steps=2,
                                       max_steps=12, seq=MODEL["max_seq_len"]))
        run = torchrun(tmp_path / "plan.json", plan.num_chips,
                       ["--steps", "12", "--ps", leader.address, "--inner-steps", "2", "--ps-token-file",
                        str(tmp_path / "job.key"), "--ps-name", "pipeline"], tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert dp.join(120) == [0]
        pushed = [c for r in leader.rounds_log for c in r["clusters"]]
        assert pushed.count("pipeline") == 6 and pushed.count("dp") == 6
        assert read_log(tmp_path / "dp.jsonl")[-1]["stats"]["failed"] == 0
        assert leader.status()["version"] >= 6


@pytest.mark.slow
def test_a_pipeline_cluster_pushes_and_pulls_compressed_and_streamed(tmp_path):
    """``--ps-push int8 --ps-pull int8 --ps-fragments 2`` with H = 2: as in the exactness test
    above (outer lr 1, no momentum, clipping or penalty) each round hands the cluster back the
    parameters it pushed, now to int8's precision with the dropped part fed into the next push,
    and the merge keeps the step taken while the push streamed, so training stays plain
    training's; each stage's worker keeps its residual, for its own units only, under
    ``--save``/ps. Pushes stream from steps 2, 4 and 6; the last is still streaming at the end."""
    plan = make_plan(TWO_STAGES)
    plan.to_json(tmp_path / "plan.json")
    plain, _ = train_reference(plan, TrainOptions(steps=STEPS, progress=False))
    with parameter_server(tmp_path, mode="async", outer_lr=1.0, outer_momentum=0.0, clip_norm=None) as (leader, token):
        run = torchrun(tmp_path / "plan.json", plan.num_chips,
                       ["--steps", str(STEPS), "--precision", "fp32", "--loss-log", "ps.jsonl", "--save", "ckpt",
                        "--ps", leader.address, "--inner-steps", "2", "--ps-token-file", str(tmp_path / "job.key"),
                        "--ps-name", "pipeline", "--ps-push", "int8", "--ps-pull", "int8", "--ps-fragments", "2"],
                       tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert leader.status()["version"] == STEPS // 2 - 1
    for step, (a, b) in enumerate(zip(losses(tmp_path / "ps.jsonl"), plain), 1):
        assert a == pytest.approx(b, rel=1e-2), f"step {step}: through the PS {a}, plain {b}"
    from dips.layout import ModelLayout

    layout = ModelLayout.of(build_model(dict(MODEL), 0))
    stage_units = []
    for w in range(len(TWO_STAGES)):
        residual = torch.load(tmp_path / "ckpt" / "ps" / f"residual-w{w}.pt", weights_only=True)
        assert residual["fingerprint"] == layout.fingerprint
        stage_units.append(sorted(residual["units"]))
        assert all(bool(r.abs().sum() > 0) for r in residual["units"].values())
    assert sorted(u for units in stage_units for u in units) == list(range(len(layout.units)))


def test_a_bad_codec_flag_is_one_clear_error(tmp_path):
    plan = make_plan(TWO_STAGES)
    plan.to_json(tmp_path / "plan.json")
    run = torchrun(tmp_path / "plan.json", 1, ["--steps", "1", "--ps", "127.0.0.1:1", "--ps-token-file", "k",
                                                "--ps-push", "int3"], tmp_path)
    assert run.returncode != 0 and "codec 'int3'" in run.stderr
    run = torchrun(tmp_path / "plan.json", 1, ["--steps", "1", "--ps", "127.0.0.1:1", "--ps-token-file", "k",
                                                "--ps-push", "nonzero"], tmp_path)
    assert run.returncode != 0 and "codec 'nonzero' carries pulls, not pushes" in run.stderr
    run = torchrun(tmp_path / "plan.json", 1, ["--steps", "1", "--ps", "127.0.0.1:1", "--ps-token-file", "k",
                                                "--inner-steps", "4", "--ps-fragments", "5"], tmp_path)
    assert run.returncode != 0 and "--ps-fragments 5" in run.stderr
