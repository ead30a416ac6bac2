"""The paper's ablation: every model at opt levels O0-O4 (``codegen.pipelines``).

Per model and level, all levels compiled from the same graph and run on the same inputs:

- kernels: in the code, and launched per inference (O0-O2 launch one per TE, loops from the host),
  and grid barriers executed per inference, of the ``llvm-persistent`` program (below), whose
  stages have no tensor cores: where the cuda pipeline's tensor-core stages make its partition
  split, the kernels it launches are the ``launches (cuda)`` column, and where it tiles stages to
  run in one block (``codegen.align_tiles``), the grid barriers it executes are the ``grid
  barriers (cuda)`` column, beside its estimate;
- static global-memory bytes read and written (``codegen.traffic``, an upper bound on DRAM);
- the CPU latency of the persistent kernel's staged program (target ``llvm-persistent``: the
  same stages, tiles and barriers run block after block on this CPU), median of ``--repeat``
  runs after one warm-up, and its largest error against PyTorch;
- the static latency model's estimate of the cuda pipeline's program on ``--device`` (h100 by
  default; ``analysis.latency``: per stage the schedule as emitted, plus grid barriers and kernel
  launches) next to the roofline bound (all FLOPs at peak, or weights, inputs and outputs moved
  once): a model, not a measurement. Without ``--cuda`` the grid comes from the partition's
  register estimates, with it from ptxas;
- with ``--cuda``: the CUDA build for sm_80 and sm_90 (kernels in the source, registers of the
  largest); with ``--gpu`` (a GPU machine with TVM and nvcc): its latency from CUDA events, in the
  GPU ms column beside the estimate (empty until measured), so the model can be corrected
  (``--device`` should then name the GPU that runs it).

``--precision fp16`` compiles every level in float16 (float32 accumulation, ``souffle.precision``)
and checks against PyTorch under autocast.

    python scripts/ablation.py [MODEL...] [--config tiny|paper] [--levels 0,1,2,3,4] [--repeat N]
                               [--no-run] [--cuda] [--gpu] [--device h100|h200|a100]
                               [--precision fp32|tf32|fp16|bf16] [--name NAME]

CPU latencies rank the levels by the work they do, not by what a GPU would take: on the CPU a
kernel launch and a grid barrier cost nothing. The results go to
``benchmarks/results/<NAME>.{json,md}`` (``ablation_<config>`` by default, with ``_<precision>``
for another precision than fp32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package

import souffle
from analysis.device import DEVICES, get_device
from benchmarks import common
from codegen.latency import latency_estimate
from codegen.traffic import memory_traffic
from codegen.pipelines import OPT_LEVELS
from souffle import models
from souffle.compiler import run_passes
from souffle.precision import PRECISIONS

PACKAGES = ("apache-tvm", "apache-tvm-ffi", "islpy", "numpy", "torch", "cuda-bindings")
ARCHS = ("sm_80", "sm_90")
COLUMNS = [("model", "model"), ("precision", "precision"), ("level", "level"), ("kernels", "kernels"),
           ("launches", "launches"),
           ("barriers_executed", "grid barriers"), ("read_mb", "read MB"), ("write_mb", "written MB"),
           ("cpu_ms", "CPU ms"), ("max_abs_error", "max abs error"), ("cuda", "CUDA"),
           ("estimate_launches", "launches (cuda)"), ("estimate_grid_barriers", "grid barriers (cuda)"),
           ("roofline_ms", "roofline ms"),
           ("estimate_ms", "estimate ms"), ("gpu_ms", "GPU ms")]
GPUS = [name for name in DEVICES if get_device(name).kind == "gpu"]


def measure(name: str, config: str, level: int, graph, inputs, expected, args) -> dict:
    start = time.perf_counter()
    model = souffle.compile(graph, target="llvm-persistent", opt_level=level, precision=args.precision)
    compile_s = time.perf_counter() - start
    staged = model.plan
    traffic = memory_traffic(staged)
    row = {"model": name, "config": config, "precision": args.precision, "level": f"O{level}",
           "kernels": staged.kernel_count(),
           "launches": staged.kernel_count(executed=True), "barriers_executed": staged.barrier_count(executed=True),
           "stages_executed": staged.stage_count(executed=True), "read_bytes": traffic.read_bytes,
           "write_bytes": traffic.write_bytes, "compulsory_bytes": traffic.compulsory_bytes,
           "weight_bytes": sum(spec.size * np.dtype(spec.dtype).itemsize for spec, _ in staged.weights),
           "compile_s": round(compile_s, 3), "transforms": model.transforms, "on_chip": model.on_chip_notes}
    if not args.no_run:
        outputs = model.run(inputs)
        row["max_abs_error"] = max(float(np.max(np.abs(o - e))) for o, e in zip(outputs, expected))
        rtol, atol = models.tolerance(name, config, args.precision)
        row["matches_pytorch"] = all(np.allclose(o, e, rtol=rtol, atol=atol) for o, e in zip(outputs, expected))
        samples = model.benchmark(inputs, repeat=args.repeat)
        row["cpu_ms"] = statistics.median(samples) * 1e3
    if args.cuda or args.gpu:
        model = souffle.compile(graph, target="cuda", opt_level=level, device=args.device, precision=args.precision)
        row.update(cuda_build(model, inputs, args.gpu, args.repeat))
        estimate = model.latency
    else:
        estimate = latency_estimate(run_passes(graph, "cuda", stop="plan_arena", device=args.device,
                                               opt_level=level, precision=args.precision).ir, get_device(args.device))
    row.update(latency_columns(estimate))
    return row


def latency_columns(estimate) -> dict:
    """The latency model's estimate and the roofline bound, with what the estimate is made of."""
    gemms = estimate.gemm_stages()
    return {"estimate_device": estimate.device.name, "estimate_ms": estimate.seconds * 1e3,
            "roofline_ms": estimate.roofline_seconds * 1e3, "estimate_stages_ms": estimate.stage_seconds * 1e3,
            "estimate_barriers_ms": estimate.barrier_seconds * 1e3,
            "estimate_launches_ms": estimate.launch_seconds * 1e3,
            "estimate_launches": estimate.launches, "estimate_grid_barriers": estimate.grid_barriers,
            "gemm_stages": len(gemms),
            "gemm_best_fraction_of_peak": max((s.fraction_of_peak for s in gemms), default=None),
            "estimate": estimate.summary()}


def cuda_build(model, inputs, on_gpu: bool, repeat: int) -> dict:
    from souffle.runtime.cuda import compile_cubin

    for arch in ARCHS:
        compile_cubin(model.source, arch, tuple(model.kernel_plan.kernel_names))
    kernels = f"{model.kernel_count} kernel{'s' * (model.kernel_count != 1)}"
    row = {"cuda": f"{kernels}, {model.resources.registers} registers ({'/'.join(ARCHS)} built)",
           "cuda_kernels": model.kernel_count, "cuda_registers": model.resources.registers}
    if on_gpu:
        row["gpu_ms"] = statistics.median(model.benchmark(inputs, repeat=repeat)) * 1e3
    return row


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(level not in OPT_LEVELS for level in levels):
        raise argparse.ArgumentTypeError(f"levels are comma-separated, from {', '.join(map(str, OPT_LEVELS))}")
    return levels


def _printable(row: dict) -> dict:
    out = dict(row)
    out["read_mb"] = f"{row['read_bytes'] / 1e6:.6f}"
    out["write_mb"] = f"{row['write_bytes'] / 1e6:.6f}"
    if "cpu_ms" in row:
        out["cpu_ms"] = f"{row['cpu_ms']:.3f}"
    for key in ("gpu_ms", "estimate_ms", "roofline_ms"):
        if key in row:
            out[key] = f"{row[key]:.3g}"
    if "max_abs_error" in row:
        out["max_abs_error"] = f"{row['max_abs_error']:.2g}"
    return out


def table(rows: list[dict]) -> str:
    """The rows as markdown; the GPU ms column stands beside the estimates even while empty."""
    estimated = [r for r in rows if "estimate_ms" in r]
    columns = [(key, title) for key, title in COLUMNS if any(key in r or key[:-3] + "_bytes" in r for r in rows)
               or (key == "gpu_ms" and estimated)]
    if estimated:
        device = estimated[0]["estimate_device"]
        columns = [(key, f"{title} ({device})" if key in ("estimate_ms", "roofline_ms") else title)
                   for key, title in columns]
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in map(_printable, rows):
        lines.append("| " + " | ".join(str(row.get(key, "")) for key, _ in columns) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", metavar="MODEL", help=f"default: all of {', '.join(models.MODELS)}")
    p.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    p.add_argument("--levels", type=_levels, default=list(OPT_LEVELS), help="comma-separated opt levels (0-4)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per level (the median is reported)")
    p.add_argument("--no-run", action="store_true",
                   help="compile and count only: no CPU run, check or CPU latency (the estimate is made)")
    p.add_argument("--cuda", action="store_true", help="also build the CUDA kernels for sm_80 and sm_90 (needs nvcc)")
    p.add_argument("--gpu", action="store_true", help="also time the cuda build on this machine's GPU")
    p.add_argument("--device", default="h100", choices=GPUS,
                   help="GPU device model of the latency estimate and the cuda build (default h100)")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="compute precision (fp16, bf16: float16 or bfloat16 with float32 accumulation, checked "
                        "against autocast)")
    p.add_argument("--name", help="results file name in benchmarks/results (default ablation_<config>, "
                                  "ablation_<config>_<precision> for another precision than fp32)")
    args = p.parse_args(argv)
    names = args.models or list(models.MODELS)
    unknown = [n for n in names if n not in models.MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; available: {', '.join(models.MODELS)}")
    rows = []
    for name in names:
        graph = models.build(name, args.config)
        inputs = models.make_inputs(name, args.config)
        expected = None if args.no_run else models.reference(name, args.config, graph.weights, args.precision)(inputs)
        for level in args.levels:
            rows.append(measure(name, args.config, level, graph, inputs, expected, args))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    timing = ("CPU: the llvm-persistent staged program, median of --repeat runs after one warm-up (TVM's time "
              "evaluator); GPU: CUDA events" if not args.no_run else "not run (--no-run)")
    timing += (f"; estimate: the static latency model (analysis.latency) of the cuda program on the {args.device} "
               "model, not a measurement")
    default_name = f"ablation_{args.config}" + ("" if args.precision == "fp32" else f"_{args.precision}")
    common.publish(args.name or default_name, rows, table(rows), PACKAGES, timing)
    failed = [f"{r['model']} {r['level']}" for r in rows if r.get("matches_pytorch") is False]
    if failed:
        print(f"does not match PyTorch: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
