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
