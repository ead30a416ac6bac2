"""Souffle side by side with the systems users compare it with, on the same inputs and weights.

    python benchmarks/compare.py MODEL... [--config tiny|paper] [--target llvm] [--trials N]

Every system (``baselines.SYSTEMS``) is built from the same souffle graph: Souffle itself; TVM
Relax untuned and tuned by MetaSchedule (Ansor's successor), both through the graph's ONNX export;
ONNX Runtime on that export; PyTorch eager and torch.compile on the PyTorch reference module.
Each is checked against PyTorch, warmed up, then timed run after run (numpy inputs in, numpy
outputs out) for the median and spread; its kernel launches per inference are counted as the
system itself reports them. Writes ``benchmarks/results/<stem>.{json,md,png}``: the machine,
versions and exact command, the latency and kernel tables, and a bar chart of Souffle's speedup
over each system.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baselines  # noqa: E402
import common  # noqa: E402

from souffle import models  # noqa: E402

PACKAGES = ("apache-tvm", "apache-tvm-ffi", "torch", "onnx", "onnxruntime", "numpy", "xgboost-cpu", "islpy")
OURS = "souffle"
MIN_RUNS = 3


def measure(run, inputs, warmup: int, repeat: int, budget_s: float) -> dict:
    """``common.time_call`` of ``run(inputs)``, stopping after ``budget_s`` seconds of runs once it
    has ``MIN_RUNS``."""
    return common.time_call(lambda: run(inputs), warmup, repeat, budget_s, MIN_RUNS)


def compare_model(model: str, args) -> list[dict]:
    case = baselines.Case.build(model, args.config)
    expected = case.torch_function()(case.inputs)
    rtol, atol = models.tolerance(model, args.config)
    options = baselines.Options(args.target, args.trials, Path(args.work_dir))
    rows = []
    for name in args.systems or baselines.default_systems(args.target, args.config):
        row = {"model": model, "config": args.config, "target": args.target, "system": name}
        try:
            built = baselines.build(name, case, options)
            outputs = [np.asarray(o) for o in built.run(case.inputs)]
        except Exception as error:  # noqa: BLE001 -- a failing system is reported as failed, as in the paper
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            print(f"{model:8s} {name:26s} failed: {row['error']}", flush=True)
            rows.append(row)
            continue
        row["max_abs_error"] = max(float(np.max(np.abs(o - e))) for o, e in zip(outputs, expected))
        row["matches_pytorch"] = len(outputs) == len(expected) and all(
            o.shape == e.shape and np.allclose(o, e, rtol=rtol, atol=atol) for o, e in zip(outputs, expected))
        row.update(compile_s=round(built.compile_s, 3), launches=built.launches, launches_how=built.launches_how,
                   static_bytes=built.static_bytes, static_bytes_how=built.static_bytes_how, details=built.details)
        row["time"] = measure(built.run, case.inputs, args.warmup, args.repeat, args.budget_s)
        print(f"{model:8s} {name:26s} {row['time']['median_ms']:11.3f} ms  launches {built.launches}  "
              f"error {row['max_abs_error']:.1e}{'' if row['matches_pytorch'] else ' (MISMATCH)'}", flush=True)
        rows.append(row)
    return rows


def _by_model(rows: list[dict]) -> dict[str, dict[str, dict]]:
    table: dict[str, dict[str, dict]] = {}
    for row in rows:
        table.setdefault(row["model"], {})[row["system"]] = row
    return table


def _systems(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(row["system"] for row in rows))


def _latency(row: dict | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "failed"
    cell = f"{row['time']['median_ms']:.3f}"
    return cell if row["matches_pytorch"] else f"{cell} (wrong)"


def speedup(ours: dict | None, other: dict | None) -> float | None:
    """Other's median time over ours; None when either failed or computed a wrong answer."""
    if not ours or not other or "error" in ours or "error" in other:
        return None
    if not (ours["matches_pytorch"] and other["matches_pytorch"]):
        return None
    return other["time"]["median_ms"] / ours["time"]["median_ms"]


def latency_table(rows: list[dict]) -> str:
    """Table 3 of the paper: median latency (ms) of each system per model, and Souffle's speedup."""
    systems = _systems(rows)
    lines = ["| model | " + " | ".join(f"{s} ms" for s in systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for model, by in _by_model(rows).items():
        lines.append(f"| {model} | " + " | ".join(_latency(by.get(s)) for s in systems) + " |")
    others = [s for s in systems if s != OURS]
    if OURS in systems and others:
        lines += ["", "Speedup of souffle (other's median / souffle's median; >1 means souffle is faster):", "",
                  "| model | " + " | ".join(others) + " |", "|---" * (len(others) + 1) + "|"]
        ratios: dict[str, list[float]] = {s: [] for s in others}
        for model, by in _by_model(rows).items():
            cells = []
            for s in others:
                r = speedup(by.get(OURS), by.get(s))
                cells.append("-" if r is None else f"{r:.2f}x")
                if r is not None:
                    ratios[s].append(r)
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
        lines.append("| geometric mean | " + " | ".join(
            f"{math.exp(sum(map(math.log, v)) / len(v)):.2f}x" if v else "-" for v in ratios.values()) + " |")
    return "\n".join(lines)


def kernel_table(rows: list[dict]) -> str:
    """Table 5 of the paper: kernel launches per inference / static bytes moved (MB) per system."""
    systems = _systems(rows)
    lines = ["| model | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for model, by in _by_model(rows).items():
        cells = []
        for s in systems:
            row = by.get(s)
            if row is None or "error" in row:
                cells.append("-" if row is None else "failed")
                continue
            moved = "-" if row.get("static_bytes") is None else f"{row['static_bytes'] / 1e6:.3f} MB"
            cells.append(f"{row['launches']} / {moved}")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    how = {row["system"]: (row.get("launches_how"), row.get("static_bytes_how")) for row in rows if "error" not in row}
    lines += ["", "Counted as: " + "; ".join(f"{s}: {k}" + (f", bytes: {b}" if b else "") for s, (k, b) in how.items())]
    return "\n".join(lines)


def tuning_table(rows: list[dict]) -> str:
    """MetaSchedule's budget per model: fused kernels tuned, trials measured (a kernel with fewer
    distinct schedules than its budget stops early), seconds; and every system's compile seconds."""
    lines = ["| model | system | compile s | tuned kernels | trials measured of budget | tuning s |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            continue
        tuning = row.get("details", {}).get("tuning")
        extra = "| - | - | - |" if tuning is None else (
            f"| {tuning['tasks']} | {tuning['trials']} of {tuning['budget']} | "
            f"{tuning['tuning_s']}{' (database reused)' if tuning['reused'] else ''} |")
        lines.append(f"| {row['model']} | {row['system']} | {row['compile_s']:.1f} {extra}")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> bool:
    """Bar chart of Souffle's speedup over each system, per model (log scale); False if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_model = _by_model(rows)
    others = [s for s in _systems(rows) if s != OURS]
    if not others or not any(OURS in by for by in by_model.values()):
        return False
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(by_model), 3.6))
    width = 0.8 / len(others)
    for k, system in enumerate(others):
        values = [speedup(by.get(OURS), by.get(system)) for by in by_model.values()]
        xs = [i + (k - (len(others) - 1) / 2) * width for i in range(len(by_model))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(by_model)), list(by_model))
    ax.set_ylabel("speedup of souffle (x)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", choices=list(models.MODELS), metavar="MODEL",
                        help=f"one or more of {', '.join(models.MODELS)}")
    parser.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    parser.add_argument("--target", default="llvm", choices=("llvm", "cuda"),
                        help="llvm: every system on this CPU (cuda: not built yet, see the error)")
    parser.add_argument("--trials", type=int, default=8, help="MetaSchedule trials per tuned kernel (default 8)")
    parser.add_argument("--systems", nargs="+", choices=list(baselines.SYSTEMS), metavar="SYSTEM",
                        help=f"systems to run (default: all for the target): {', '.join(baselines.SYSTEMS)}")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per system (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--budget-s", type=float, default=30.0,
                        help="stop timing a system after this many seconds of runs, once it has 3 (default 30)")
    parser.add_argument("--work-dir", default="benchmarks/work", help="MetaSchedule databases (reused by reruns)")
    parser.add_argument("--output", help="file stem under --results-dir (default compare_<config>_<target>)")
    parser.add_argument("--results-dir", default=str(common.RESULTS))
    args = parser.parse_args(argv)
    if args.target == "cuda":
        parser.error("--target cuda: the GPU comparison is not built yet; no session has had a GPU to check it on "
                     "(`benchmarks/gpu_kernels.py` runs souffle's own kernels on a GPU)")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.repeat < MIN_RUNS:
        parser.error(f"--repeat must be at least {MIN_RUNS}")

    rows = []
    for model in args.models:
        rows.extend(compare_model(model, args))
    tables = f"## Latency (Table 3 style)\n\n{latency_table(rows)}\n\n## Kernels per inference / bytes (Table 5 style)\n\n" \
             f"{kernel_table(rows)}\n\n## Compile and tuning time\n\n{tuning_table(rows)}"
    stem = args.output or f"compare_{args.config}_{args.target}"
    results = Path(args.results_dir)
    import torch

    timing = (f"wall clock of run(inputs) from numpy inputs to numpy outputs: {args.warmup} warm-up runs, then "
              f"{args.repeat} runs or fewer (at least {MIN_RUNS}) after {args.budget_s:g} s; median, min, max. "
              f"Threads: torch {torch.get_num_threads()}, TVM and ONNX Runtime their defaults, on "
              f"{os.cpu_count()} cores. MetaSchedule: {args.trials} trials per fused kernel.")
    common.publish(stem, rows, tables, PACKAGES, timing, results)
    if chart(rows, results / f"{stem}.png"):
        print(f"wrote {results / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
