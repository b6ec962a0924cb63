"""`ditorch plan`, `simulate` and `mre` need no device: in a pure-Python tree (no compiled
extension at all, as on a laptop that only plans) they run, and the device names say why they
are missing."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools_cases import REPO

PACKAGES = ["ditorch", "ditorch_ext", "dicomm", "heteropp", "dips", "volunteer", "dimodel", "diutil"]


@pytest.fixture(scope="module")
def pure_python_tree(tmp_path_factory) -> Path:
    """The repository's packages without any compiled module."""
    root = tmp_path_factory.mktemp("pure")
    for name in PACKAGES:
        shutil.copytree(Path(REPO) / name, root / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert not list(root.rglob("*.so"))
    return root


# An editable install of the repository maps its compiled modules by name wherever the package
# is found; the tree must not reach them.
WITHOUT_EDITABLE = ("import sys\n"
                    "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n")


def python(tree: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DITORCH_")}
    env["PYTHONPATH"] = str(tree)
    return subprocess.run([sys.executable, "-c", WITHOUT_EDITABLE + code, *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def run(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``ditorch ARGS`` in the tree."""
    return python(tree, "from ditorch.cli import main\nsys.exit(main(sys.argv[1:]))", *args)


@pytest.mark.slow
def test_plan_and_simulate_run_without_the_device_layer(pure_python_tree, tmp_path):
    configs = Path(REPO) / "examples" / "configs"
    plan = tmp_path / "plan.json"
    done = run(pure_python_tree, "plan", "--cluster", str(configs / "cluster-exp-a-1.yaml"),
               "--model", str(configs / "model-100b.yaml"), "--gbs", "2M", "--out", str(plan))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(plan.read_text())["stages"]
    done = run(pure_python_tree, "simulate", str(plan))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ditorch_ext" not in done.stdout + done.stderr


def test_mre_runs_without_the_device_layer(pure_python_tree, tmp_path):
    for name, scale in (("ref", 1.0), ("run", 1.01)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"step": i, "loss": (4.0 - 0.01 * i) * scale}) + "\n" for i in range(20)))
    done = run(pure_python_tree, "mre", str(tmp_path / "ref.jsonl"), str(tmp_path / "run.jsonl"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MRE 1.0000%" in done.stdout


def test_the_device_names_say_why_they_are_missing(pure_python_tree):
    code = ("import ditorch\nassert ditorch.device_unavailable is not None\n"
            "try:\n    ditorch.set_chip('A')\nexcept ImportError as e:\n    print(e)\n")
    done = python(pure_python_tree, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ditorch.set_chip needs the device layer" in done.stdout and "ditorch_ext._C" in done.stdout
