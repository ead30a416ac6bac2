"""Differential fuzzing of ``souffle.compile`` for a while (the library is ``tests/fuzzing.py``).

Fresh random graphs, one per seed, each compiled for every target at every opt level, run with
NaN in every buffer it should write, and compared with a float64 PyTorch reference:

    python scripts/fuzz.py --seconds N [--seed-start S] [--targets llvm,llvm-persistent]
                           [--levels 0,1,2,3,4] [--workers 2] [--minimize-budget 40] [--json FILE]

Seeds start at ``--seed-start`` (by default the current Unix time, so every run tries new graphs;
the first seed is printed, so a run can be repeated). Progress is printed every 10 s; at the end a
summary (graphs, compiles, runs, failures by kind) and, for every seed and kind of failure, a
minimal repro: GraphBuilder code to run from the repository root. ``--json`` also writes the
results with the command, the machine and the versions. The exit status is 1 if any graph failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ and benchmarks/ are not installed packages

from benchmarks import common  # noqa: E402
from tests import fuzzing  # noqa: E402

PACKAGES = ("apache-tvm", "torch", "numpy")
PROGRESS_SECONDS = 10.0


def _seeds(start: int, deadline: float):
    """Seeds from ``start`` until ``deadline`` (time.monotonic()); the last graph is finished."""
    seed = start
    while time.monotonic() < deadline:
        yield seed
        seed += 1


def _counts_line(counts: dict) -> str:
    failures = ", ".join(f"{kind} {n}" for kind, n in counts["failures"].items() if n) or "none"
    return (f"{counts['graphs']} graphs, {counts['compiles']} compiles ({counts['compiled']} compiled), "
            f"{counts['runs']} runs; failures: {failures}")


class Progress:
    """Prints the running counts every PROGRESS_SECONDS, so a long run is not silent."""

    def __init__(self, started: float):
        self.started = self.printed = started

    def __call__(self, result: fuzzing.FuzzResult) -> None:
        now = time.monotonic()
        if now - self.printed >= PROGRESS_SECONDS:
            self.printed = now
            print(f"[{now - self.started:5.0f} s] {_counts_line(result.counts())}", flush=True)


def _finding_record(finding: fuzzing.Finding) -> dict:
    first = finding.failures[0]
    return {"seed": first.seed, "configs": [str(c) for c in finding.configs], "kind": first.kind,
            "cause": first.cause, "output": first.output, "max_abs_error": first.max_abs_error,
            "detail": first.detail, "minimal_ops": len(finding.case.ops), "repro": finding.repro}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, required=True, help="how long to try new seeds")
    parser.add_argument("--seed-start", type=int, default=None, help="first seed (default: the Unix time)")
    parser.add_argument("--targets", default="llvm,llvm-persistent", help="comma-separated targets")
    parser.add_argument("--levels", default=None, help="comma-separated opt levels (default: all of each target)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes compiling in parallel")
    parser.add_argument("--minimize-budget", type=int, default=40,
                        help="candidate graphs checked to minimize each failure (0: print it unminimized)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    levels = None if args.levels is None else [int(v) for v in args.levels.split(",")]
    chosen = fuzzing.configs(args.targets.split(","), levels)
    start = int(time.time()) if args.seed_start is None else args.seed_start
    print(f"fuzzing for {args.seconds:g} s from seed {start} on {', '.join(map(str, chosen))} "
          f"with {args.workers} workers", flush=True)
    with fuzzing.WorkerPool(fuzzing.check_config, args.workers) as pool:
        started = time.monotonic()  # once the workers are up: they take seconds to import TVM and torch
        result = fuzzing.fuzz(_seeds(start, started + args.seconds), chosen, pool, Progress(started))
        print(f"[{time.monotonic() - started:5.0f} s] done: {_counts_line(result.counts())}", flush=True)
        findings = fuzzing.minimize_failures(result, pool, args.minimize_budget,
                                             progress=lambda message: print(message, flush=True))
    counts = result.counts()
    print(f"\nseeds {start} to {start + counts['graphs'] - 1}: {_counts_line(counts)}; "
          f"{counts['failing graphs']} graphs failed")
    for finding in findings:
        print("\n" + finding.describe())
    if args.json is not None:
        payload = {"command": common.command(), "machine": common.machine(), "versions": common.versions(*PACKAGES),
                   "seconds": args.seconds, "seed_start": start, "configs": [str(c) for c in chosen],
                   "summary": counts, "failures": [asdict(f) for f in result.failures],
                   "findings": [_finding_record(f) for f in findings]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
