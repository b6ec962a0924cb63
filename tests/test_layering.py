"""The project's packages point down only (docs/architecture.md): each imports only the packages
below it, lazy imports inside functions included, so no two import each other; and what a lower
layer loads stays small (a Di-PS server never loads the device layer or DiComm)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each package and the packages it may import, bottom to top.
BELOW: dict[str, set[str]] = {
    "diutil": set(),
    "dimodel": set(),
    "ditorch_ext": {"diutil", "dimodel"},
    "dicomm": {"diutil", "dimodel"},
    "heteropp": {"ditorch_ext", "dicomm", "dimodel", "diutil"},
    "dips": {"dimodel", "diutil"},
    "volunteer": {"heteropp", "dips", "ditorch_ext", "dicomm", "dimodel", "diutil"},
    "ditorch": {"volunteer", "dips", "heteropp", "ditorch_ext", "dicomm", "dimodel", "diutil"},
}


def imports_of(package: str) -> list[tuple[str, int, str]]:
    """(file, line, imported top-level package) for every import of another project package."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in BELOW and top != package:
                    found.append((str(path.relative_to(ROOT)), node.lineno, name))
    return found


def test_the_allowed_order_has_no_cycle():
    order: list[str] = []
    seen: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"import cycle: {' -> '.join(path + (package,))}"
        if package in seen:
            return
        for lower in BELOW[package]:
            visit(lower, path + (package,))
        seen.add(package)
        order.append(package)

    for package in BELOW:
        visit(package, ())
    assert set(order) == set(BELOW) and order[-1] == "ditorch"


def test_every_package_in_the_repository_has_a_place():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "examples", "scripts"}
    assert packages == set(BELOW), f"place {sorted(packages - set(BELOW))} in BELOW; gone: {sorted(set(BELOW) - packages)}"


@pytest.mark.parametrize("package", list(BELOW))
def test_imports_point_down_only(package):
    upward = [f"{file}:{line} imports {name}" for file, line, name in imports_of(package)
              if name.split(".")[0] not in BELOW[package]]
    assert not upward, f"{package} may import only {sorted(BELOW[package])}:\n" + "\n".join(upward)


def test_a_parameter_server_loads_neither_the_device_layer_nor_dicomm():
    code = ("import sys, dips.follower, dips.leader, dips.client, dips.model;"
            "print(sorted(m for m in ('ditorch', 'ditorch_ext', 'dicomm', 'heteropp') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_datasheets_and_the_planners_cluster_load_no_torch():
    code = ("import sys, diutil.datasheets.catalog, heteropp.cluster;"
            "heteropp.cluster.ClusterSpec.from_dict({'chips': {'H100': {'datasheet': 'H100', 'count': 8}},"
            " 'links': {'inter_node': {'bandwidth_gbps': 50}, 'inter_cluster': {'bandwidth_gbps': 1}}});"
            "print(sorted(m for m in ('torch', 'ditorch_ext', 'dicomm') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
