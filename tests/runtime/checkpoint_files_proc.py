"""Run by test_checkpoint_files.py in a process of its own (a one-rank gloo group): the save
directory's life through a successful save, a save the disk refuses, and a resume."""
import errno
import json
import resource
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from heteropp.runtime import checkpoint
from heteropp.runtime.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


class Stage(torch.nn.Sequential):
    """What checkpoint.py asks of a stage beyond its parameters: the names they are saved under."""

    def checkpoint_name(self, name: str) -> str:
        return name


class Trainer:
    """What checkpoint.py asks of a trainer, for one rank holding a whole small model."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.module = Stage(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        self.place = types.SimpleNamespace(rank=0, dp_index=0, tp_index=0)
        self.groups = types.SimpleNamespace(tp=types.SimpleNamespace(size=1, rank=0))
        self.optim = {}

    def optimizer_state(self):
        return self.optim

    def load_optimizer_state(self, state):
        self.optim = state


def main(root: Path, report: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}.store", rank=0, world_size=1)
    out = {}
    a = Trainer(1)
    out["first"] = save_checkpoint(root, 1, a).name
    try:  # the disk refuses the second: past RLIMIT_FSIZE every file write fails with EFBIG
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        save_checkpoint(root, 2, Trainer(2))
        out["second"] = "written"
    except CheckpointError as exc:
        out["second"] = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["listing"] = sorted(p.name for p in root.iterdir())
    out["latest"] = latest_checkpoint(root).name
    b = Trainer(3)
    out["step"] = load_checkpoint(root, b)
    out["equal"] = all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values()))
    for step in (3, 4, 5):
        save_checkpoint(root, step, a)
    out["kept"] = sorted(p.name for p in root.glob("step-*"))
    report.write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
