"""The ps command: registration under ``ditorch``, clear errors, token files."""
import argparse
import os
import stat

import pytest

from dips import cli
from dips.auth import JobToken


def test_register_adds_ps_leader_and_follower():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ps", "leader", "--followers", "2", "--model", "m.yaml", "--token-file", "k",
                              "--server-token-file", "s"])
    assert args.func is not None and args.bind == "127.0.0.1:7000" and args.mode == "dips"
    args = parser.parse_args(["ps", "follower", "--server-token-file", "s"])
    assert args.bind == "127.0.0.1:7100" and args.leader == "127.0.0.1:7000"


def test_bad_model_path_is_one_clear_error(tmp_path, capsys):
    JobToken.create(tmp_path / "k")
    rc = cli.main(["leader", "--followers", "1", "--model", str(tmp_path / "none.yaml"),
                   "--token-file", str(tmp_path / "k"), "--server-token-file", str(tmp_path / "k")])
    assert rc == 2
    assert "none.yaml" in capsys.readouterr().err


def test_token_file_is_private_and_loads(tmp_path):
    assert cli.main(["token", str(tmp_path / "job.key")]) == 0
    assert stat.S_IMODE(os.stat(tmp_path / "job.key").st_mode) == 0o600
    tok = JobToken.from_file(tmp_path / "job.key")
    assert tok.verify(tok.secret) and not tok.verify("0" * 64) and not tok.verify(None)
    with pytest.raises(FileNotFoundError, match="missing.key"):
        JobToken.from_file(tmp_path / "missing.key")


def test_deploy_prints_choice(capsys):
    assert cli.main(["deploy", "--bandwidth", "5,5;10,1", "--throughput", "4,1"]) == 0
    out = capsys.readouterr().out
    assert "candidate 1: B.p = 41  <- deploy the PS here" in out and "candidate 0: B.p = 25\n" in out
    assert cli.main(["deploy", "--bandwidth", "5,x", "--throughput", "1,1"]) == 2
    assert "'5,x'" in capsys.readouterr().err


def test_bytes_prints_each_codec_pair_per_round(tmp_path, capsys):
    """Bytes per outer round from a saved model's tensors, counted by hand: BF16 2 bytes a value;
    int8 one byte and a 4-byte scale per 64; top-k 2% of the values with an int32 index, an int8
    code and a scale per 64 kept."""
    import math

    import torch

    torch.save({"a.weight": torch.zeros(100, 30), "b.weight": torch.zeros(7)}, tmp_path / "m.pt")
    assert cli.main(["bytes", "--init", str(tmp_path / "m.pt"), "--push", "topk:0.02,int8,sign", "--pull", "bf16"]) == 0
    out = capsys.readouterr().out
    k = [math.ceil(0.02 * 3000), 1]
    topk = sum(4 * n + 4 * math.ceil(n / 64) + n for n in k)
    int8 = 3000 + 4 * math.ceil(3000 / 64) + 7 + 4
    sign = 4 * math.ceil(3000 / 256) + 3000 // 8 + 4 + 1  # a scale per 256 values, a bit a value
    bf16 = 2 * 3007
    assert f"BF16 both ways: {2 * bf16} bytes" in out
    rows = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()[2:-1]}
    assert rows == {("topk:0.02", "bf16"): topk + bf16, ("int8", "bf16"): int8 + bf16, ("sign", "bf16"): sign + bf16}
    assert out.splitlines()[-1] == f"a join's whole pull (once per cluster): {bf16} bytes in BF16 (bf16, nonzero, " \
                                   f"sparsebf16), {int8} in int8 (any other compressed pull)"
    # SparseLoCo 2%: two levels per chunk of 4096, a 16-bit index and 2 bits per kept value; a
    # nonzero pull at most the 3 clusters' kept values (a count per chunk, FP32 value, 16-bit
    # index each), or the unit in BF16 when that is smaller (the 7-value unit: 4 + 6 * 3 > 14)
    assert cli.main(["bytes", "--init", str(tmp_path / "m.pt"), "--push", "sparseloco:0.02", "--pull", "nonzero",
                     "--clusters", "3"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    push = (8 + 2 * 60 + 15) + (8 + 2 * 1 + 1)
    pull = (4 + 6 * 3 * 60) + 2 * 7
    assert row[:3] == ["sparseloco:0.02", "nonzero", str(push + pull)]
    # sparsebf16 3%: per kept value a 16-bit index and a BF16 value, whatever the clusters
    for clusters in ("3", "9"):
        assert cli.main(["bytes", "--init", str(tmp_path / "m.pt"), "--push", "sparseloco:0.02", "--pull",
                         "sparsebf16:0.03", "--clusters", clusters]) == 0
        row = capsys.readouterr().out.splitlines()[2].split()
        assert row[:3] == ["sparseloco:0.02", "sparsebf16:0.03", str(push + 4 * (90 + 1))]
    assert cli.main(["bytes", "--init", str(tmp_path / "m.pt"), "--push", "nonzero"]) == 2
    assert "a pull codec" in capsys.readouterr().err
    assert cli.main(["bytes", "--init", str(tmp_path / "m.pt"), "--push", "int9"]) == 2
    assert "codec 'int9'" in capsys.readouterr().err
