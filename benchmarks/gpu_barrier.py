"""The cost of a grid barrier on a GPU, by grid size: cooperative_groups' ``grid.sync()``, the
barrier between the stages of every persistent kernel here (``codegen.cuda``).

The latency model charges ``DeviceModel.grid_sync_seconds`` per barrier: the line through this
script's figures from an H100 (``analysis.device``; it was a flat 2 us, an assumption, before
any GPU ran this). The H100's timelines put more on each segment between two barriers than its stages'
estimates explain (``latency_vs_gpu.py --segments``: a fixed cost per segment); this measures the
barrier alone, and with an element-wise phase of a given size before each (BERT's transposes are
384 x 768), at 1 to 8 blocks of 256 threads per SM, so that the two can be told apart.

    python benchmarks/gpu_barrier.py export DIR            # here: nvcc builds sm_80 and sm_90 cubins
    python benchmarks/gpu_barrier.py run DIR [--results OUT]  # on the GPU machine: cuda-python, no TVM

``run`` times one cooperative launch of N phases against one of none (CUDA events, median of
``--repeat``), so the launch itself cancels out: (t(N) - t(0)) / N per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import command, machine, versions, write  # noqa: E402

ARCHS = ("sm_80", "sm_90")
THREADS = 256
KERNELS = ("barriers", "phases")
SOURCE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// n grid barriers and nothing else; each block's first thread keeps a value so that nothing is
// optimized away
extern "C" __global__ void __launch_bounds__(256) barriers(float* out, int n) {
  cg::grid_group grid = cg::this_grid();
  float kept = 0.0f;
  for (int i = 0; i < n; ++i) {
    grid.sync();
    kept += 1.0f;
  }
  if (threadIdx.x == 0) out[blockIdx.x] = kept;
}

// n phases, each an element-wise pass over elements floats (a grid-stride loop: every thread
// reads one and writes the next buffer) and a grid barrier: a persistent kernel's element-wise
// stage and the barrier after it
extern "C" __global__ void __launch_bounds__(256) phases(float* a, float* b, int n, int elements) {
  cg::grid_group grid = cg::this_grid();
  int stride = gridDim.x * blockDim.x;
  for (int i = 0; i < n; ++i) {
    float* from = (i & 1) ? b : a;
    float* to = (i & 1) ? a : b;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < elements; e += stride) to[e] = from[e] + 1.0f;
    grid.sync();
  }
}
"""


def export(directory: Path) -> Path:
    """The kernels' source and their cubins for ``ARCHS`` in ``directory``."""
    from souffle.runtime.cuda import compile_cubin

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "barrier.cu").write_text(SOURCE)
    for arch in ARCHS:
        cubin, _ = compile_cubin(SOURCE, arch, KERNELS)
        (directory / f"barrier.{arch}.cubin").write_bytes(cubin)
    return directory


def per_phase_us(kernel, device, grid: int, args_for, phases: int, repeat: int) -> float:
    """(t(phases) - t(0)) / phases in microseconds, each t the median of ``repeat`` launches of
    ``kernel`` with the arguments ``args_for(count)``."""
    from souffle.runtime.cuda import time_kernel

    def median(count: int) -> float:
        launch = kernel.prepare(grid, THREADS, args_for(count))
        return statistics.median(time_kernel(launch, device, warmup=3, repeat=repeat))

    return (median(phases) - median(0)) / phases * 1e6


def run(directory: Path, phases: int, repeat: int, elements: list[int]) -> dict:
    from souffle.runtime.cuda import Device

    device = Device()
    cubins = {arch: (directory / f"barrier.{arch}.cubin").read_bytes() for arch in ARCHS
              if (directory / f"barrier.{arch}.cubin").exists()}
    kernels = device.load_kernels((directory / "barrier.cu").read_text(), cubins, KERNELS)
    largest = max(elements)
    out, a, b = device.alloc(4 * device.sms * 8), device.alloc(4 * largest), device.alloc(4 * largest)
    a.fill(0)
    rows = []
    for per_sm in (1, 2, 4, 5, 8):
        if per_sm > kernels["barriers"].max_active_blocks_per_sm(THREADS):
            continue
        grid = device.sms * per_sm
        row = {"blocks_per_sm": per_sm, "grid": grid,
               "barrier_us": per_phase_us(kernels["barriers"], device, grid, lambda count: [out, count], phases,
                                          repeat)}
        if per_sm <= kernels["phases"].max_active_blocks_per_sm(THREADS):
            row["phase_us"] = {str(n): per_phase_us(kernels["phases"], device, grid,
                                                    lambda count, n=n: [a, b, count, n], phases, repeat)
                               for n in elements}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"device": device.name, "sms": device.sms, "threads": THREADS, "phases": phases, "repeat": repeat,
            "rows": rows}


def table(result: dict) -> str:
    sizes = sorted({n for r in result["rows"] for n in r.get("phase_us", {})}, key=int)
    lines = [f"{result['device']} ({result['sms']} SMs), blocks of {result['threads']} threads; microseconds per "
             f"phase, (t({result['phases']} phases) - t(0)) / {result['phases']}, medians of {result['repeat']} "
             f"launches (CUDA events):", "",
             "| blocks/SM | grid | grid.sync() alone | " + " | ".join(f"{n} floats + grid.sync()" for n in sizes) + " |",
             "|---|---|---|" + "---|" * len(sizes)]
    for r in result["rows"]:
        phase = r.get("phase_us", {})
        lines.append(f"| {r['blocks_per_sm']} | {r['grid']} | {r['barrier_us']:.2f} | "
                     + " | ".join(f"{phase[n]:.2f}" if n in phase else "-" for n in sizes) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("export", "run"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--phases", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--elements", type=int, nargs="+", default=[0, 384 * 768, 12 * 384 * 384],
                        help="floats each phase passes over (default: none, BERT's transposes, its attention scores)")
    parser.add_argument("--results", type=Path, default=None, help="where the JSON and markdown go "
                        "(default benchmarks/results/, as gpu_barrier.json and .md)")
    args = parser.parse_args()
    if args.step == "export":
        print(f"wrote {export(args.directory)}")
        return
    result = run(args.directory, args.phases, args.repeat, args.elements)
    md = table(result)
    payload = {"command": command(), "machine": machine(), "versions": versions("numpy", "cuda-bindings"), **result}
    print(md)
    json_path, md_path = write("gpu_barrier", payload, f"# Grid barrier cost\n\nCommand: `{command()}`\n\n{md}\n",
                               args.results)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
