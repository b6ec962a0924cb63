"""Run PyTorch's own device-generic test files on dipu and on the CPU, and compare.

Files that use ``instantiate_device_type_tests`` make a test class per device type, the
registered PrivateUse1 backend included (``TestViewOpsDIPU`` beside ``TestViewOpsCPU``), once
``import ditorch`` ran first (a pytest plugin here does it). For each file this prints how many
tests pass on the CPU, how many of those pass on dipu, and names every test that passes on the
CPU but fails on dipu; ``--json`` keeps the lot.

The test files are PyTorch's, read from a PyTorch source tree (``--tests``: its ``test/``
directory); none is copied into this repository.

    python scripts/pytorch_generic_tests.py --tests ~/pytorch/test [--files test_view_ops.py,...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILES = ("test_view_ops.py", "test_indexing.py", "test_shape_ops.py", "test_sort_and_select.py",
         "test_type_promotion.py", "test_tensor_creation_ops.py", "test_reductions.py")
PLUGIN = "import ditorch  # noqa: F401  (registers dipu before the test files instantiate their classes)\n"


def outcomes(junit: Path) -> dict[tuple[str, str], str]:
    """{(device, test with the device taken out of its class and name): passed|failed|skipped}."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        m = re.search(r"(CPU|DIPU|PRIVATEUSE1)$", cls)
        if not m:
            continue
        device = "cpu" if m.group(1) == "CPU" else "dipu"
        generic = cls[: m.start()] + "." + re.sub(r"_(cpu|dipu|privateuse1)(?=_|$)", "", name)
        kinds = {child.tag for child in case}
        out[(device, generic)] = ("failed" if kinds & {"failure", "error"} else
                                  "skipped" if "skipped" in kinds else "passed")
    return out


def run_file(tests: Path, name: str, plugin_dir: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([plugin_dir, str(REPO), os.environ.get("PYTHONPATH", "")]))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ditorch_pytest_plugin", "-p",
                               "no:cacheprovider", "--timeout", "120", "-o", "addopts=", f"--junitxml={junit}",
                               str(tests / name)], env=env, cwd=tests, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - start
        if not junit.exists():
            raise RuntimeError(f"{name}: pytest wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}")
        results = outcomes(junit)
    cpu_passed = {t for (d, t), r in results.items() if d == "cpu" and r == "passed"}
    dipu = {t: r for (d, t), r in results.items() if d == "dipu"}
    return {"file": name, "seconds": round(seconds, 1), "cpu_passed": len(cpu_passed),
            "dipu_passed": sum(1 for t in cpu_passed if dipu.get(t) == "passed"),
            "dipu_skipped": sorted(t for t in cpu_passed if dipu.get(t) == "skipped"),
            "dipu_missing": sorted(t for t in cpu_passed if t not in dipu),
            "dipu_failed": sorted(t for t in cpu_passed if dipu.get(t) == "failed")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", type=Path, required=True, help="a PyTorch source tree's test/ directory")
    p.add_argument("--files", default=",".join(FILES), help="comma-separated test files")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per file")
    p.add_argument("--json", type=Path, default=None, help="write every result here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as plugin_dir:
        Path(plugin_dir, "ditorch_pytest_plugin.py").write_text(PLUGIN)
        rows = []
        print(f"{'file':<28} {'CPU pass':>8} {'dipu pass':>9} {'skipped':>7} {'absent':>6} {'failed':>6} {'s':>6}")
        for name in args.files.split(","):
            r = run_file(args.tests, name, plugin_dir, args.timeout)
            rows.append(r)
            print(f"{name:<28} {r['cpu_passed']:>8} {r['dipu_passed']:>9} {len(r['dipu_skipped']):>7} "
                  f"{len(r['dipu_missing']):>6} {len(r['dipu_failed']):>6} {r['seconds']:>6.0f}", flush=True)
            for t in r["dipu_failed"]:
                print(f"    fails on dipu: {t}")
    total_cpu, total_dipu = sum(r["cpu_passed"] for r in rows), sum(r["dipu_passed"] for r in rows)
    print(f"{'total':<28} {total_cpu:>8} {total_dipu:>9} {sum(len(r['dipu_skipped']) for r in rows):>7} "
          f"{sum(len(r['dipu_missing']) for r in rows):>6} {sum(len(r['dipu_failed']) for r in rows):>6}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["dipu_failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
