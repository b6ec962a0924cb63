"""The runtime's checkpoint files: a save the disk refuses leaves the earlier checkpoints whole
and ends in a clear error, --resume takes the newest complete one, the newest KEEP are kept,
and reading a checkpoint never runs code planted in it."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from heteropp.runtime.checkpoint import KEEP, CheckpointError, _SafeReader, latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_a_refused_save_keeps_the_last_good_checkpoint_and_resume_takes_it(tmp_path):
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("checkpoint_files_proc.py")),
                          str(tmp_path / "ckpt"), str(report)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(report.read_text())
    assert out["first"] == "step-00000001"
    assert out["second"].startswith("checkpoint of step 2 not written to") and "intact" in out["second"]
    assert "step-00000002" not in out["listing"] and out["latest"] == "step-00000001"
    assert out["step"] == 1 and out["equal"]
    assert out["kept"] == [f"step-{s:08d}" for s in (3, 4, 5)][-KEEP:]


class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp.save({"model/w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    genuine = _SafeReader(str(ckpt)).read_metadata()
    with open(ckpt / ".metadata", "rb") as f:
        assert genuine.state_dict_metadata.keys() == pickle.load(f).state_dict_metadata.keys()
    planted = _Planted()
    planted.marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(planted))
    assert latest_checkpoint(tmp_path / "ckpt") == ckpt
    with pytest.raises(CheckpointError, match="posix.system is not part of a checkpoint's metadata"):
        _SafeReader(str(ckpt)).read_metadata()
    assert not planted.marker.exists()


def test_metadata_naming_files_outside_its_directory_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp.save({"model/w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="lie in its directory"):
        _SafeReader(str(ckpt)).read_metadata()


def test_torn_metadata_at_any_offset_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp.save({"model/w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    whole = (ckpt / ".metadata").read_bytes()
    for cut in sorted({0, 1, len(whole) // 3, len(whole) // 2, len(whole) - 1} | set(range(2, len(whole), 97))):
        (ckpt / ".metadata").write_bytes(whole[:cut])
        with pytest.raises(CheckpointError, match="not checkpoint metadata"):
            _SafeReader(str(ckpt)).read_metadata()
