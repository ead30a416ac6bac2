"""What the thread-level validator adds to a CUDA compile, per paper model at O4.

For each model, the cuda pipeline (``souffle.compiler.run_passes``) is timed with the validator
off and on, the validator's own caches emptied before every run so each run pays for every isl
question, as a fresh process would:

- warm: nvcc's cubin cache already holds the kernel (a recompile: the passes are all there is),
  medians of ``--repeat`` runs;
- cold: an empty nvcc cache (a first compile, nvcc included), one run;
- verdict cached: a warm recompile whose validation is read from the verdict cache
  (``codegen.validation_cache``), what a user's recompile pays.

The ratio is the validator's seconds over the rest of the compile. Writes
benchmarks/results/validate_time.{json,md}.

    python benchmarks/validate_time.py [--models lstm bert resnext mmoe] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

import analysis.threads
from codegen import validation_cache
from souffle import models
from souffle.compiler import run_passes


def _compile(graph, validate: bool, cached_verdict: bool = False) -> tuple[float, float]:
    """(seconds of the whole cuda pipeline, seconds of its validate_threads pass). The validator
    runs (its verdict cache emptied first) unless ``cached_verdict``: then the pass reads the
    verdict an earlier compile stored."""
    analysis.threads._EMPTY.clear()
    analysis.threads._ADDRESSES.clear()
    if not cached_verdict:
        shutil.rmtree(validation_cache.cache_dir(), ignore_errors=True)
    began = time.perf_counter()
    result = run_passes(graph, "cuda", opt_level=4, validate=validate)
    total = time.perf_counter() - began
    return total, result.seconds().get("validate_threads", 0.0) if validate else 0.0


def measure(name: str, repeat: int) -> dict:
    graph = models.build(name, "paper")
    _compile(graph, False)  # warm-up: TVM's first calls, and the nvcc cache
    off = [_compile(graph, False)[0] for _ in range(repeat)]
    on = [_compile(graph, True) for _ in range(repeat)]
    validator = statistics.median(v for _, v in on)
    warm_rest = statistics.median(total - v for total, v in on)
    cached = statistics.median(v for _, v in (_compile(graph, True, cached_verdict=True) for _ in range(repeat)))
    nvcc_cache = os.environ["SOUFFLE_CACHE_DIR"]
    with tempfile.TemporaryDirectory() as empty:
        os.environ["SOUFFLE_CACHE_DIR"] = empty
        try:
            cold_total, cold_validator = _compile(graph, True)
        finally:
            os.environ["SOUFFLE_CACHE_DIR"] = nvcc_cache
    return {"model": name, "config": "paper", "opt_level": 4,
            "warm_compile_off_s": statistics.median(off), "warm_compile_rest_s": warm_rest, "validator_s": validator,
            "warm_ratio": validator / warm_rest, "cached_verdict_s": cached, "cached_ratio": cached / warm_rest,
            "cold_compile_s": cold_total, "cold_validator_s": cold_validator,
            "cold_ratio": cold_validator / (cold_total - cold_validator)}


def table(rows: list[dict]) -> str:
    lines = ["| model | validator s | compile s, nvcc cached (validator off) | added | verdict cached: s | added "
             "| compile s, nvcc cold | added |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['validator_s']:.2f} | {r['warm_compile_rest_s']:.2f} "
                     f"({r['warm_compile_off_s']:.2f}) | {r['warm_ratio']:.0%} | {r['cached_verdict_s']:.3f} "
                     f"| {r['cached_ratio']:.1%} | {r['cold_compile_s']:.1f} | {r['cold_ratio']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(models.MODELS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", default="validate_time", help="file stem under benchmarks/results/")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as caches:  # nvcc's and the validator's, this run's own
        os.environ["SOUFFLE_CACHE_DIR"] = caches
        for name in args.models:
            rows.append(measure(name, args.repeat))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    common.publish(args.output, rows, table(rows), ("apache-tvm", "islpy"),
                   f"wall clock, one process; warm: medians of {args.repeat} runs; cold: one run with an empty "
                   "nvcc cache; the validator's caches (in memory and its verdict cache) emptied before every run, "
                   "except the verdict-cached runs, which read the verdict stored by the runs before")


if __name__ == "__main__":
    main()
