"""Paper-config run time of each model: Souffle (LLVM, one kernel) next to PyTorch eager.

Same machine, same weights, same inputs, one process; warm-up, then the median of
several runs for each system. Writes benchmarks/results/cpu_vs_torch.{json,md}.

    python benchmarks/cpu_vs_torch.py [--models lstm bert resnext mmoe] [--config paper] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import souffle  # noqa: E402
from souffle import models  # noqa: E402


def measure(name: str, config: str, repeat: int, warmup: int) -> dict:
    import torch

    graph = models.build(name, config=config)
    start = time.perf_counter()
    compiled = souffle.compile(graph, target="llvm")
    compile_s = time.perf_counter() - start
    inputs = models.make_inputs(name, config=config)
    reference = models.reference(name, config, graph.weights)
    ours = compiled.run(inputs)
    expected = reference(inputs)
    error = max(float(np.max(np.abs(o - e))) for o, e in zip(ours, expected))
    souffle_ms = common.summarize([s * 1e3 for s in compiled.benchmark(inputs, repeat=repeat)])
    souffle_e2e_ms = common.time_call(lambda: compiled.run(inputs), warmup=warmup, repeat=repeat)
    torch_ms = common.time_call(lambda: reference(inputs), warmup=warmup, repeat=repeat)
    return {
        "model": name, "config": config, "compile_s": compile_s, "kernels": compiled.kernel_count,
        "max_abs_error": error, "souffle": souffle_ms, "souffle_end_to_end": souffle_e2e_ms, "torch_eager": torch_ms,
        "ratio_souffle_over_torch": souffle_e2e_ms["median_ms"] / torch_ms["median_ms"],
        "torch_threads": torch.get_num_threads(),
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | config | souffle ms (kernel) | souffle ms (numpy in/out) | torch eager ms | souffle / torch | kernels | compile s | max abs error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['config']} | {r['souffle']['median_ms']:.3f} | {r['souffle_end_to_end']['median_ms']:.3f} "
                     f"| {r['torch_eager']['median_ms']:.3f} "
                     f"| {r['ratio_souffle_over_torch']:.2f}x | {r['kernels']} | {r['compile_s']:.1f} | {r['max_abs_error']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(models.MODELS))
    parser.add_argument("--config", default="paper")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default="cpu_vs_torch", help="file stem under benchmarks/results/")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(measure(name, args.config, args.repeat, args.warmup))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    common.publish(args.output, rows, table(rows), ("apache-tvm", "apache-tvm-ffi", "torch", "numpy"),
                   f"medians of {args.repeat} runs after warm-up; souffle 'kernel' by TVM's time_evaluator "
                   "(the one compiled function), souffle 'numpy in/out' and torch by wall clock around the whole "
                   "call from numpy inputs to numpy outputs; the ratio uses the numpy in/out time")


if __name__ == "__main__":
    main()
