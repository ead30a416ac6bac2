"""How long the global analysis takes per model, and what it finds.

For each model: lowering to the global TE program and ``analysis.analyze`` (dependences with
isl, reuse, per-TE cost), each timed as the median of several runs after a warm-up, next to
the analysis' own figures (TEs, edges by mapping type, FLOPs, unfused DRAM bytes). Writes
benchmarks/results/analysis_time.{json,md}.

    python benchmarks/analysis_time.py [--models lstm bert resnext mmoe] [--config paper] [--device h200]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from analysis import analyze
from analysis.device import get_device
from souffle import models
from souffle.lower import lower_graph


def measure(name: str, config: str, device: str, repeat: int, warmup: int) -> dict:
    graph = models.structure(name, config)
    program = lower_graph(graph)
    model = get_device(device)
    result = analyze(program, model)
    return {
        "model": name, "config": config, "device": device,
        "lower": common.time_call(lambda: lower_graph(graph), warmup=warmup, repeat=repeat),
        "analyze": common.time_call(lambda: analyze(program, model), warmup=warmup, repeat=repeat),
        "summary": result.summary(),
    }


def table(rows: list[dict]) -> str:
    lines = [("| model | config | TEs (executed) | 1:1 / 1:many TEs | edges 1-1 / shuf / reorg / 1-n / n-n | inexact "
             "| GFLOP | unfused GB | lower ms | analyze ms |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        edges = " / ".join(str(n) for n in s["edges_by_mapping"].values())
        lines.append(f"| {r['model']} | {r['config']} | {s['tes']} ({s['tes_executed']}) "
                     f"| {s['one_relies_on_one']} / {s['one_relies_on_many']} | {edges} | {s['inexact_edges']} "
                     f"| {s['flops'] / 1e9:.3g} | {s['bytes_unfused'] / 1e9:.3g} "
                     f"| {r['lower']['median_ms']:.1f} | {r['analyze']['median_ms']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(models.MODELS))
    parser.add_argument("--config", default="paper")
    parser.add_argument("--device", default="h200")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default="analysis_time", help="file stem under benchmarks/results/")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(measure(name, args.config, args.device, args.repeat, args.warmup))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    common.publish(args.output, rows, table(rows), ("apache-tvm", "apache-tvm-ffi", "islpy", "sympy", "numpy"),
                   f"medians of {args.repeat} runs after {args.warmup} warm-up, wall clock, one process")


if __name__ == "__main__":
    main()
