"""The system-level benchmark programs' results, in pytest-benchmark's JSON form.

The programs (cross_cluster.py, heteropp_runtime.py, volunteer.py) run for minutes, need root
for emulated hosts, and measure things pytest-benchmark cannot time itself (a pipeline
iteration across processes, a simulated batch), so they stay programs. Each saves what it
measured as pytest-benchmark does: the same file layout (``NNNN_<name>.json`` under a machine
id), the same ``machine_info``/``commit_info``, the same ``stats`` computed by
pytest-benchmark's own ``Stats``. So ``pytest-benchmark compare`` shows them beside the
micro-benchmarks, and ``compare`` below gates them with pytest-benchmark's own regression
checks, the same ``--benchmark-compare-fail`` expression ``make bench-compare`` passes to
the micro-benchmarks. Every value saved is a time: lower is better, as the checks assume.

    .venv/bin/python benchmarks/program_results.py compare --fail median:50%   # latest vs previous run
    .venv/bin/pytest-benchmark --storage .benchmarks/programs compare        # every run, as tables
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Measurement:
    """One timed quantity: a contender and its peer share a `group`, as in benchmarks/micro."""

    group: str
    name: str
    samples: list[float]  # seconds, lower is better; one per repetition
    extra_info: dict = dataclasses.field(default_factory=dict)


def storage_dir(root: Path | None = None) -> Path:
    """Where program runs are saved: ``<root>/programs/<machine id>``; `root` defaults to
    ``$DITORCH_BENCH_STORAGE``, else the repository's .benchmarks, beside the micro-benchmarks'
    runs (which pytest-benchmark keeps in ``<root>/<machine id>``)."""
    from pytest_benchmark.utils import get_machine_id

    root = root or Path(os.environ.get("DITORCH_BENCH_STORAGE", ROOT / ".benchmarks"))
    return root / "programs" / get_machine_id()


def _benchmark_json(program: str, m: Measurement) -> dict:
    from pytest_benchmark.stats import Stats

    if not m.samples or any(not (s >= 0) for s in m.samples):
        raise ValueError(f"{program}: {m.group} / {m.name}: samples must be non-negative seconds, got {m.samples}")
    stats = Stats()
    for s in m.samples:
        stats.update(s)
    return {"group": m.group, "name": m.name, "fullname": f"{program}::{m.group}::{m.name}", "params": None,
            "param": None, "extra_info": m.extra_info, "options": {"timer": f"{program} (measured by the program)"},
            "stats": {**stats.as_dict(), "iterations": 1, "data": list(m.samples)}}


def save_run(program: str, measurements: list[Measurement]) -> Path:
    """Save one run of `program` as the next numbered file; returns its path."""
    import pytest_benchmark
    from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info
    from pytest_benchmark.utils import get_commit_info

    folder = storage_dir()
    folder.mkdir(parents=True, exist_ok=True)
    numbers = [int(p.name[:4]) for p in folder.glob("[0-9][0-9][0-9][0-9]_*.json")]
    path = folder / f"{max(numbers, default=0) + 1:04d}_{program}.json"
    data = {"machine_info": pytest_benchmark_generate_machine_info(), "commit_info": get_commit_info(),
            "benchmarks": [_benchmark_json(program, m) for m in measurements],
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": pytest_benchmark.__version__}
    path.write_text(json.dumps(data, indent=1))
    print(f"saved {len(measurements)} measurements of {program} in {path}")
    return path


def _runs_by_program(folder: Path) -> dict[str, list[Path]]:
    runs: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("[0-9][0-9][0-9][0-9]_*.json")):
        runs.setdefault(path.stem[5:], []).append(path)
    return runs


def compare(fail: str, folder: Path | None = None) -> int:
    """Each program's latest run against its previous one under pytest-benchmark's check
    `fail` (e.g. ``median:50%``); prints every comparison, returns 1 when any regressed."""
    from pytest_benchmark.utils import parse_compare_fail

    check = parse_compare_fail(fail)
    folder = folder or storage_dir()
    runs = _runs_by_program(folder)
    if not runs:
        print(f"no program runs saved under {folder}: nothing to compare")
        return 0
    regressed = []
    for program, paths in runs.items():
        if len(paths) < 2:
            print(f"{program}: one saved run ({paths[0].name}), nothing to compare yet")
            continue
        current, previous = (json.loads(p.read_text())["benchmarks"] for p in (paths[-1], paths[-2]))
        before = {b["fullname"]: b["stats"] for b in previous}
        print(f"{program}: {paths[-1].name} against {paths[-2].name}")
        for bench in current:
            old = before.get(bench["fullname"])
            if old is None:
                print(f"  {bench['group']} / {bench['name']}: new")
                continue
            change = bench["stats"][check.field] / old[check.field] - 1 if old[check.field] else float("inf")
            failed = check.fails(bench["stats"], old)
            print(f"  {bench['group']} / {bench['name']}: {check.field} {old[check.field]:.4g} s -> "
                  f"{bench['stats'][check.field]:.4g} s ({change:+.1%}){'  REGRESSED' if failed else ''}")
            if failed:
                regressed.append(f"{program}: {bench['group']} / {bench['name']}: {failed}")
    if regressed:
        print("Performance has regressed:\n" + "\n".join(f"\t{r}" for r in regressed))
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="each program's latest run against its previous one")
    c.add_argument("--fail", default="median:50%", help="pytest-benchmark's --benchmark-compare-fail expression")
    c.add_argument("--storage", default=None, help="a programs/<machine id> folder (default: storage_dir())")
    args = ap.parse_args(argv)
    return compare(args.fail, Path(args.storage) if args.storage else None)


if __name__ == "__main__":
    sys.exit(main())
