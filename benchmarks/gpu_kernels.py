"""Latency and correctness of the persistent CUDA kernels on a GPU, in two steps.

A lent GPU machine has no TVM (its wheel does not fit the transfer), so the kernels are built
here and run there:

    python benchmarks/gpu_kernels.py export shared/gpu_kernels [--models ...] [--configs tiny paper]
    python benchmarks/gpu_kernels.py run shared/gpu_kernels [--repeat 100] [--warmup 10]   # on the GPU

``export`` compiles each model for target cuda and writes, per model and config, the kernel
artifact (cubins for sm_80 and sm_90, the source, the call and the weight recipes), seeded
inputs and the PyTorch outputs. ``run`` needs only numpy and cuda-python: it rebuilds the
weights from their seeds, launches each kernel cooperatively, compares every output with
PyTorch's, times ``repeat`` inferences with CUDA events after ``warmup`` and writes
benchmarks/results/gpu_kernels.{json,md} with the device, versions and command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from souffle import models
from souffle.runtime.artifact import KernelArtifact, Launcher


def export(directory: Path, names: list[str], configs: list[str]) -> None:
    import souffle

    for config in configs:
        for name in names:
            graph = models.build(name, config)
            model = souffle.compile(graph, target="cuda")
            target = directory / f"{name}_{config}"
            model.artifact(config=config, seed=0, archs=("sm_80",)).save(target)
            inputs = models.make_inputs(name, config, seed=1)
            expected = models.reference(name, config, graph.weights)(inputs)
            np.savez(target / "inputs.npz", **inputs)
            np.savez(target / "expected.npz", *expected)
            rtol, atol = models.tolerance(name, config)
            (target / "check.json").write_text(json.dumps({"rtol": rtol, "atol": atol, "report": str(model.report())}))
            print(f"{target}: {model.kernel_count} kernel, {model.plan.stage_count()} stages, "
                  f"{model.plan.barrier_count()} barriers")


def run(directory: Path, repeat: int, warmup: int) -> None:
    from souffle.runtime.cuda import Device

    device = Device()
    rows = []
    for target in sorted(p for p in directory.iterdir() if (p / "manifest.json").exists()):
        artifact = KernelArtifact.load(target)
        check = json.loads((target / "check.json").read_text())
        inputs = dict(np.load(target / "inputs.npz"))
        expected = list(np.load(target / "expected.npz").values())
        launcher = Launcher(artifact, device=device)
        arrays = [np.ascontiguousarray(inputs[slot.name]).reshape(-1) for slot in artifact.inputs]
        outputs = launcher.run(arrays)
        errors = [float(np.max(np.abs(o - e))) for o, e in zip(outputs, expected)]
        ok = all(np.allclose(o, e, rtol=check["rtol"], atol=check["atol"]) for o, e in zip(outputs, expected))
        times = [t * 1e3 for t in launcher.benchmark(arrays, repeat=repeat, warmup=warmup)]
        rows.append({"model": artifact.model, "config": artifact.config, "device": device.name, "arch": device.arch,
                     "grid": launcher.grid, "blocks_per_sm": launcher.blocks_per_sm, "threads": artifact.threads,
                     "max_abs_error": max(errors), "check": "PASS" if ok else "FAIL",
                     "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "runs": len(times)})
    header = "| model | config | grid | check (max abs error) | median | min | max | runs |\n|---|---|---|---|---|---|---|---|\n"
    table = header + "\n".join(
        f"| {r['model']} | {r['config']} | {r['grid']} ({r['blocks_per_sm']}/SM) | {r['check']} ({r['max_abs_error']:.2g}) "
        f"| {r['median_ms']:.3f} ms | {r['min_ms']:.3f} ms | {r['max_ms']:.3f} ms | {r['runs']} |" for r in rows)
    common.publish("gpu_kernels", rows, f"Device: {device.name} ({device.arch}, {device.sms} SMs)\n\n{table}",
                   ("numpy", "cuda-bindings"), f"CUDA events, {warmup} warm-up runs, median of {repeat}")
    if any(r["check"] != "PASS" for r in rows):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("export", "run"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--models", nargs="+", default=list(models.MODELS))
    parser.add_argument("--configs", nargs="+", default=["tiny", "paper"])
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if args.step == "export":
        export(args.directory, args.models, args.configs)
    else:
        run(args.directory, args.repeat, args.warmup)


if __name__ == "__main__":
    main()
