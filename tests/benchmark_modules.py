"""Modules of benchmarks/ loaded by path for the tests: putting benchmarks/ on sys.path would
let its program files (volunteer.py, comm.py) shadow the project's packages of the same name."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The helper module the programs import by name (they run with benchmarks/ as the script folder).
SHARED = "program_results"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as module `name` (registered, as dataclasses need)."""
    if name != SHARED:
        load(SHARED)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(BENCHMARKS / f"{name}.py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
