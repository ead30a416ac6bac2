"""How many kernels one inference of each model launches, per compilation target.

For each model and target: the compiled model's kernel count (for ``cuda``, the
``__global__`` definitions in its source), the stages and grid barriers one inference
executes (staged targets only) and the compile time. With ``--ncu`` (needs a GPU and Nsight
Compute) one inference of the ``cuda`` build runs under ``ncu`` and the kernel launches it
records are counted, with their summed GPU time.

    python scripts/profile_kernels.py [MODEL...] [--config tiny|paper] [--targets llvm,cuda] [--ncu] [--json PATH]

The helpers below (arguments, compiling, running under ncu, the JSON record) are shared with
``scripts/profile_dram.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

import souffle
from benchmarks import common
from souffle import models
from souffle.compiler import TARGETS
from souffle.errors import SouffleError
from souffle.runtime.cuda import gpu_available
from souffle.runtime.ncu import profile_launches, require_ncu

PACKAGES = ("apache-tvm", "apache-tvm-ffi", "islpy", "numpy", "cuda-bindings")
RUN_ONCE = "--run-once"  # hidden: compile the cuda build and run exactly one inference (the process ncu profiles)


# -- shared with profile_dram.py --------------------------------------------------------------
def parser(description: str, targets: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", metavar="MODEL", help=f"models to profile (default: all of {', '.join(models.MODELS)})")
    p.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    if targets:
        p.add_argument("--targets", default="llvm,cuda", help=f"comma-separated, from {', '.join(TARGETS)} (default: llvm,cuda)")
    p.add_argument("--ncu", action="store_true", help="measure one inference of the cuda build under Nsight Compute (GPU only)")
    p.add_argument("--json", metavar="PATH", help="also write the rows, machine, versions and command as JSON")
    p.add_argument(RUN_ONCE, action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Arguments with the model and target lists checked; unknown names are usage errors."""
    args = p.parse_args(argv)
    args.models = args.models or list(models.MODELS)
    unknown = [m for m in args.models if m not in models.MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; available: {', '.join(models.MODELS)}")
    if hasattr(args, "targets"):
        args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        wrong = [t for t in args.targets if t not in TARGETS]
        if wrong:
            p.error(f"unknown target {wrong[0]!r}; available: {', '.join(TARGETS)}")
        if not args.targets:
            p.error(f"--targets is empty; available: {', '.join(TARGETS)}")
        if args.ncu and "cuda" not in args.targets:
            p.error("--ncu measures the cuda build: add cuda to --targets")
    if args.run_once and len(args.models) != 1:
        p.error(f"{RUN_ONCE} runs exactly one model")
    return args


def compile_model(name: str, config: str, target: str):
    """The compiled model and the seconds ``souffle.compile`` took (building the graph excluded)."""
    graph = models.build(name, config)
    start = time.perf_counter()
    model = souffle.compile(graph, target)
    return model, time.perf_counter() - start


def run_once(name: str, config: str) -> None:
    """One inference of the cuda build and nothing else on the GPU, so every launch ncu records is ours."""
    model, _ = compile_model(name, config, "cuda")
    model.run(models.make_inputs(name, config))


def ncu_launches(ncu: str, script: str, name: str, config: str, metrics: list[str]) -> list[dict]:
    """Each kernel launch of one inference of ``name``'s cuda build, measured by ncu; the
    process it profiles (this script with the hidden flag) runs exactly one inference."""
    return profile_launches(ncu, [sys.executable, script, RUN_ONCE, name, "--config", config], metrics,
                            f"{name} ({config})")


def format_table(columns: list[tuple[str, str]], rows: list[dict]) -> str:
    """A markdown table of ``rows`` under ``(key, header)`` columns; a missing value prints as -."""
    cells = [[h for _, h in columns]] + [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def write_json(path: str, rows: list[dict], ncu: str | None) -> None:
    """The rows with the exact command, the machine (and GPU) and the versions that produced them."""
    versions = common.versions(*PACKAGES)
    versions["nvcc"] = _tool_version(shutil.which("nvcc"))
    versions["ncu"] = _tool_version(ncu)
    machine = common.machine()
    machine["gpu"] = _gpu_name()
    payload = {"command": common.command(), "machine": machine, "versions": versions, "results": rows}
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def _tool_version(path: str | None) -> str | None:
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    lines = out.strip().splitlines()
    return next((line for line in lines if "release" in line.lower() or "version" in line.lower()), lines[-1] if lines else None)


def _gpu_name() -> str | None:
    if not gpu_available():
        return None
    from souffle.runtime.cuda import Device

    return Device().name


def main_guard(run, argv) -> int:
    """Run ``run(argv)``; a Souffle error prints its message (no traceback) and exits 1."""
    try:
        return run(argv)
    except SouffleError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        return 1


# -- this script --------------------------------------------------------------------------------
COLUMNS = [("model", "model"), ("config", "config"), ("target", "target"), ("kernels", "kernels per inference"),
           ("stages_executed", "stages executed"), ("barriers_executed", "grid barriers executed"),
           ("compile_s", "compile s")]
NCU_COLUMNS = [("ncu_launches", "launches (ncu)"), ("gpu_time_ms", "GPU time ms (ncu)")]


def profile(name: str, config: str, target: str, ncu: str | None) -> dict:
    model, seconds = compile_model(name, config, target)
    row = {"model": name, "config": config, "target": target, "kernels": model.kernel_count,
           "stages_executed": None, "barriers_executed": None, "compile_s": seconds}
    if hasattr(model, "source"):
        from codegen.cuda import kernel_count

        in_source = kernel_count(model.source)
        if in_source != model.kernel_count:
            raise SouffleError(f"{name} ({target}): the model counts {model.kernel_count} kernels, "
                               f"its CUDA source defines {in_source}")
        row["kernels"] = in_source
    if hasattr(model.plan, "stage_count"):
        row["stages_executed"] = model.plan.stage_count(executed=True)
        row["barriers_executed"] = model.plan.barrier_count(executed=True)
    if ncu is not None and target == "cuda":
        launches = ncu_launches(ncu, __file__, name, config, ["gpu__time_duration.sum"])
        row["ncu_launches"] = len(launches)
        row["gpu_time_ms"] = sum(launch["gpu__time_duration.sum"] for launch in launches) / 1e6
    return row


def run(argv=None) -> int:
    args = parse_args(parser(__doc__, targets=True), argv)
    if args.run_once:
        run_once(args.models[0], args.config)
        return 0
    ncu = require_ncu() if args.ncu else None
    rows = [profile(name, args.config, target, ncu) for name in args.models for target in args.targets]
    print(format_table(COLUMNS + (NCU_COLUMNS if ncu else []), rows))
    if args.json:
        write_json(args.json, rows, ncu)
    return 0


if __name__ == "__main__":
    sys.exit(main_guard(run, None))
