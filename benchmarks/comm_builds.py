"""Two builds of dicomm on the same machine, taking turns: is a change any slower?

Runs benchmarks/comm.py (same flags) alternately against a baseline build of the backend
(``--baseline``: a ``dicomm/_C*.so`` built from another commit, loaded through DICOMM_EXTENSION)
and the current one, ``--rounds`` times each, and prints the median of dicomm's numbers for both
and their ratio (current / baseline: above 1 is better for bandwidth, below 1 for time).

    git worktree add /tmp/base <commit> && (cd /tmp/base && cmake -S . -B build/cmake -G Ninja \\
        -DTORCH_ROOT=$(.venv/bin/python -c 'import os,torch;print(os.path.dirname(torch.__file__))') \\
        && cmake --build build/cmake --target dicomm_backend)
    .venv/bin/python benchmarks/comm_builds.py --baseline /tmp/base/dicomm/_C.cpython-311-x86_64-linux-gnu.so
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (table, series, size in bytes, metric, label, higher is better)
ROWS = [
    ("p2p", "dicomm-tcp", "8", "lat_us", "p2p tcp 8 B one-way us", False),
    ("p2p", "dicomm-shm", "8", "lat_us", "p2p shm 8 B one-way us", False),
    ("p2p", "dicomm-tcp", "67108864", "bw_GBs", "p2p tcp 64 MiB GB/s", True),
    ("p2p", "dicomm-shm", "67108864", "bw_GBs", "p2p shm 64 MiB GB/s", True),
    ("allreduce", "dicomm/2", "8", "time_us", "allreduce 2 ranks 8 B us", False),
    ("allreduce", "dicomm/2", "67108864", "busbw_GBs", "allreduce 2 ranks 64 MiB busbw GB/s", True),
    ("allreduce", "dicomm/4", "8", "time_us", "allreduce 4 ranks 8 B us", False),
    ("allreduce", "dicomm/4", "67108864", "busbw_GBs", "allreduce 4 ranks 64 MiB busbw GB/s", True),
]


def run(extension: str | None, out: Path, flags: list[str]) -> dict:
    env = dict(os.environ)
    env.pop("DICOMM_EXTENSION", None)
    if extension:
        env["DICOMM_EXTENSION"] = extension
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "comm.py"), "--quick", "--out", str(out), *flags],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    (result,) = out.glob("comm-*.json")
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="path of the baseline build's dicomm _C module")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("flags", nargs="*", help="more benchmarks/comm.py flags (after --), e.g. -- --load")
    args = ap.parse_args()
    if not Path(args.baseline).is_file():
        sys.exit(f"--baseline {args.baseline!r}: expected the path of a built dicomm _C module")
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name, ext in (("baseline", args.baseline), ("current", None)):
                print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(run(ext, Path(tmp) / f"{name}{i}", args.flags))
    print(f"median of {args.rounds} alternating runs of benchmarks/comm.py --quick {' '.join(args.flags)}")
    print(f"{'':40s} | {'baseline':>10s} | {'current':>10s} | current/baseline")
    for table, series, size, metric, label, higher in ROWS:
        values = {name: statistics.median(r[table][series][size][metric] for r in rs) for name, rs in runs.items()}
        ratio = values["current"] / values["baseline"]
        verdict = "better" if (ratio > 1) == higher else "worse"
        print(f"{label:40s} | {values['baseline']:10.3f} | {values['current']:10.3f} | {ratio:6.3f} ({verdict})")


if __name__ == "__main__":
    main()
