"""Latency and correctness of the persistent CUDA kernels on a GPU, in two steps.

A lent GPU machine has no TVM (its wheel does not fit the transfer), so the kernels are built
here and run there:

    python benchmarks/gpu_kernels.py export shared/gpu_kernels [--models ...] [--configs tiny paper] [--levels 0 4]
    python benchmarks/gpu_kernels.py run shared/gpu_kernels [--repeat 100] [--warmup 10] [--ncu]   # on the GPU

``export`` compiles each model for target cuda (at each ``--levels`` opt level, by default
the compiler's, O4) and writes, per model, config and level, the kernel artifact (cubins for sm_80 and sm_90, the source, the call and the weight recipes), seeded
inputs and the PyTorch outputs. ``run`` needs only numpy and cuda-python: it rebuilds the
weights from their seeds, launches each kernel cooperatively, compares every output with
PyTorch's, times ``repeat`` inferences with CUDA events after ``warmup`` and writes
benchmarks/results/gpu_kernels.{json,md} with the device, versions and command. With ``--ncu``
one more inference of each runs under Nsight Compute, which counts its kernel launches and
measures its DRAM bytes read and written (caches flushed first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from souffle import models
from souffle.runtime.artifact import Launcher
from souffle.runtime.check import Check


def export_all(directory: Path, names: list[str], configs: list[str], levels: list[int] | None) -> None:
    from souffle.compiler import export_check  # the compiler: on the exporting machine only

    for config in configs:
        for name in names:
            for level in levels or [None]:
                target = directory / (f"{name}_{config}" + ("" if level is None else f"_O{level}"))
                model = export_check(name, config, target, opt_level=level)
                print(f"{target}: {model.kernel_count} kernels, {model.plan.stage_count()} stages, "
                      f"{model.plan.barrier_count()} barriers")


NCU_METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum"]


def once(target: Path) -> None:
    """Exactly one inference and nothing else on the GPU: the process ncu profiles."""
    check = Check.load(target)
    Launcher(check.artifact).run(check.inputs)


def run(directory: Path, repeat: int, warmup: int, ncu: bool) -> None:
    from souffle.runtime.cuda import Device
    from souffle.runtime.ncu import profile_launches, require_ncu

    ncu_path = require_ncu() if ncu else None
    device = Device()
    rows = []
    for target in sorted(p for p in directory.iterdir() if (p / "manifest.json").exists()):
        check = Check.load(target)
        artifact = check.artifact
        launcher = Launcher(artifact, device=device)
        outputs = launcher.run(check.inputs)
        errors, ok = check.errors(outputs), check.passes(outputs)
        times = [t * 1e3 for t in launcher.benchmark(check.inputs, repeat=repeat, warmup=warmup)]
        rows.append({"model": artifact.model, "config": artifact.config, "bundle": target.name,
                     "device": device.name, "arch": device.arch, "kernels": len(artifact.kernels),
                     "grid": launcher.grid, "blocks_per_sm": launcher.blocks_per_sm, "threads": artifact.threads,
                     "max_abs_error": max(errors), "check": "PASS" if ok else "FAIL",
                     "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "runs": len(times)})
        if ncu_path is not None:
            launches = profile_launches(ncu_path, [sys.executable, __file__, "once", str(target)], NCU_METRICS,
                                        target.name)
            rows[-1].update({"ncu_launches": len(launches),
                             "dram_read_mb": sum(x["dram__bytes_read.sum"] for x in launches) / 1e6,
                             "dram_write_mb": sum(x["dram__bytes_write.sum"] for x in launches) / 1e6,
                             "ncu_gpu_time_ms": sum(x["gpu__time_duration.sum"] for x in launches) / 1e6})
    header = ("| bundle | grid | check (max abs error) | median | min | max | runs | kernels (ncu) "
              "| DRAM read MB (ncu) | DRAM write MB (ncu) |\n|---|---|---|---|---|---|---|---|---|---|\n")
    table = header + "\n".join(
        f"| {r['bundle']} | {r['grid']} ({r['blocks_per_sm']}/SM) | {r['check']} ({r['max_abs_error']:.2g}) "
        f"| {r['median_ms']:.3f} ms | {r['min_ms']:.3f} ms | {r['max_ms']:.3f} ms | {r['runs']} "
        f"| {r.get('ncu_launches', '-')} | {r.get('dram_read_mb', '-')} | {r.get('dram_write_mb', '-')} |" for r in rows)
    common.publish("gpu_kernels", rows, f"Device: {device.name} ({device.arch}, {device.sms} SMs)\n\n{table}",
                   ("numpy", "cuda-bindings"), f"CUDA events, {warmup} warm-up runs, median of {repeat}")
    if any(r["check"] != "PASS" for r in rows):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("export", "run", "once"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--models", nargs="+", default=list(models.MODELS))
    parser.add_argument("--configs", nargs="+", default=["tiny", "paper"])
    parser.add_argument("--levels", nargs="+", type=int, default=None, help="opt levels to export (default: O4)")
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--ncu", action="store_true", help="also count launches and DRAM bytes with Nsight Compute")
    args = parser.parse_args()
    if args.step == "export":
        export_all(args.directory, args.models, args.configs, args.levels)
    elif args.step == "once":
        once(args.directory)
    else:
        run(args.directory, args.repeat, args.warmup, args.ncu)


if __name__ == "__main__":
    main()
