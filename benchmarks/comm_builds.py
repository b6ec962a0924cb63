"""Two builds of dicomm on the same machine, taking turns: is a change any slower?

Runs benchmarks/comm.py (same flags) alternately against a baseline build of the backend
(``--baseline``: a ``dicomm/_C*.so`` built from another commit, loaded through DICOMM_EXTENSION)
and the current one, ``--rounds`` times each, prints the median of dicomm's times for both and
their ratio (current / baseline: below 1 is faster), and saves the rounds as ``comm_builds``
(one group per row, the baseline its peer) for docs/dicomm.md's table.

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
sys.path.insert(0, str(ROOT / "benchmarks"))
from program_results import Measurement, save_run  # noqa: E402

# (table, series, size in bytes, label); the time compared is p2p's one-way time, allreduce's op time
ROWS = [
    ("p2p", "dicomm-tcp", "8", "p2p tcp 8 B one-way"),
    ("p2p", "dicomm-shm", "8", "p2p shm 8 B one-way"),
    ("p2p", "dicomm-tcp", "67108864", "p2p tcp 64 MiB one-way"),
    ("p2p", "dicomm-shm", "67108864", "p2p shm 64 MiB one-way"),
    ("allreduce", "dicomm/2", "8", "allreduce 2 ranks 8 B"),
    ("allreduce", "dicomm/2", "67108864", "allreduce 2 ranks 64 MiB"),
    ("allreduce", "dicomm/4", "8", "allreduce 4 ranks 8 B"),
    ("allreduce", "dicomm/4", "67108864", "allreduce 4 ranks 64 MiB"),
] + [("after_pause", f"dicomm-{t}", pause, f"p2p {t} 8 B one-way after {pause}")
     for t in ("tcp", "shm") for pause in ("a barrier", "1 ms compute", "10 ms compute")]
METRIC = {"p2p": "lat_us", "allreduce": "time_us", "after_pause": "lat_us"}


def run(extension: str | None, out: Path, flags: list[str]) -> dict:
    env = dict(os.environ)
    env.pop("DICOMM_EXTENSION", None)
    if extension:
        env["DICOMM_EXTENSION"] = extension
    env["DITORCH_BENCH_STORAGE"] = str(out / "storage")  # each turn's own save is not a comm.py run of this build
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "comm.py"), "--quick", "--out", str(out), *flags],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    (result,) = out.glob("comm-*.json")
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="path of the baseline build's dicomm _C module")
    ap.add_argument("--baseline-name", default="baseline", help="what the baseline is, e.g. its commit")
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
    print(f"{'us':40s} | {args.baseline_name:>10s} | {'current':>10s} | current/baseline")
    mode = f" ({' '.join(args.flags)})" if args.flags else ""
    measurements = []
    for table, series, size, label in ROWS:
        if any(size not in r.get(table, {}).get(series, {}) for rs in runs.values() for r in rs):
            continue  # not measured with these flags (e.g. --ranks 2, --sizes 8)
        samples = {name: [r[table][series][size][METRIC[table]] for r in rs] for name, rs in runs.items()}
        medians = {name: statistics.median(v) for name, v in samples.items()}
        print(f"{label:40s} | {medians['baseline']:10.1f} | {medians['current']:10.1f} | "
              f"{medians['current'] / medians['baseline']:6.3f}")
        measurements += [Measurement(f"dicomm builds{mode}: {label}", name if name == "current" else args.baseline_name,
                                     [us / 1e6 for us in samples[name]], {"peer": name == "baseline"})
                         for name in ("baseline", "current")]
    save_run("comm_builds", measurements)


if __name__ == "__main__":
    main()
