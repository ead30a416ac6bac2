"""PyTorch on the GPU, on the weights and inputs of the exported bundles: the baselines Souffle's
kernels are compared with (issue "On a GPU").

    python benchmarks/gpu_torch.py DIR [--bundles GLOB ...] [--modes eager cuda-graph ...] [--budget S]

For each bundle in DIR that ``--bundles`` matches (default ``*_O4*``; several globs are taken in
their order, the paper models first within each; a compiler variant's bundle, ``BASE+VARIANT``,
is PyTorch's base bundle again and is left out) (``benchmarks/gpu_kernels.py export``) the model's torch module
(``souffle.models.<name>.torch_module``) is built from the same seeded weights, moved to the GPU
and run on the bundle's inputs, at the bundle's precision (fp16, bf16: ``torch.autocast("cuda")`` in
that dtype; tf32: float32 with TF32 matmuls and convolutions):

- ``eager``: the module as it is;
- ``cuda-graph``: one inference captured in a CUDA graph and replayed;
- ``reduce-overhead``: ``torch.compile(mode="reduce-overhead")``, compiled and replayed as CUDA graphs;
- ``compile``: ``torch.compile`` with its default mode;
- ``max-autotune``: ``torch.compile(mode="max-autotune")`` (which replays CUDA graphs itself).

Float32 arithmetic is IEEE float32 in every mode but tf32's (``float32_arithmetic``: cuDNN's
default is TF32 for float32 convolutions), as in Souffle's fp32 kernels. Each is checked against the bundle's
expected outputs (the CPU reference it was exported with), timed with CUDA events (``--warmup``
runs, median of ``--repeat``), and its kernels per inference counted with the torch profiler. A
mode not started because ``--budget`` seconds had passed is a row that says so. With ``--souffle
gpu_kernels.json`` the table also shows Souffle's time for the same bundle and the speedup over
each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
from gpu_report import BUNDLE
from gpu_variants import SEPARATOR

from souffle import models
from souffle.precision import DEFAULT_PRECISION, PRECISIONS
from souffle.runtime.check import Check

MODES = ("eager", "cuda-graph", "reduce-overhead", "compile", "max-autotune")  # cheapest to set up first


def float32_arithmetic(precision: str = DEFAULT_PRECISION) -> str:
    """Sets how PyTorch multiplies float32 in matmuls and convolutions to what Souffle's kernels
    at ``precision`` do: TF32 at ``tf32``, else IEEE float32 (TF32 off). cuDNN's default runs
    float32 convolutions in TF32 (10-bit mantissas on tensor cores): the H100 runs before this
    compared Souffle's IEEE float32 ResNeXt and EfficientNet with TF32 ones. Global flags, set
    before each bundle's rows; returns what was set, for the results."""
    import torch

    mode = "tf32" if precision == "tf32" else "ieee"
    conv, matmul = getattr(torch.backends.cudnn, "conv", None), getattr(torch.backends.cuda, "matmul", None)
    if hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision"):  # torch 2.9 on: mixing APIs fails
        conv.fp32_precision = matmul.fp32_precision = mode
    else:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    if mode == "tf32":
        return "tf32 (TF32 on for matmuls and cuDNN convolutions)"
    return "ieee (TF32 off for matmuls and cuDNN convolutions)"


def _module(name: str, config: str, precision: str):
    import torch

    module = models.get(name)
    cfg = models.config(name, config)
    net = module.torch_module(cfg, module.init_weights(cfg, 0)).cuda().eval()
    narrow = None if PRECISIONS[precision] == "float32" else getattr(torch, PRECISIONS[precision])

    def forward(**inputs):
        # autocast's weight cache off: a CUDA graph must not capture casts cached outside it
        with torch.no_grad(), torch.autocast("cuda", dtype=narrow, enabled=narrow is not None, cache_enabled=False):
            outputs = net(**inputs)
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

    return forward


def _runner(forward, mode: str, inputs: dict):
    """A call that runs one inference in ``mode`` and returns its outputs (GPU tensors)."""
    import torch

    if mode == "eager":
        return lambda: forward(**inputs)
    if mode == "cuda-graph":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm up off the default stream, as torch.cuda.graphs asks
                forward(**inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = forward(**inputs)

        def replay():
            graph.replay()
            return captured

        return replay
    # Dynamo caches compiled code per code object: every bundle's ``forward`` shares one, and
    # past its recompile limit (8) it silently runs eagerly; reset, so each bundle compiles anew.
    torch._dynamo.reset()
    compiled = torch.compile(forward, mode=None if mode == "compile" else mode)
    return lambda: compiled(**inputs)


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (``torch._dynamo.reset`` does not zero it)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _time(run, warmup: int, repeat: int) -> list[float]:
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def _kernels_per_inference(run) -> int:
    """GPU kernels one inference launches, as the torch profiler records them."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower())


class Bundle:
    """One bundle's model on the GPU, at the bundle's precision, with its inputs and expected outputs."""

    def __init__(self, path: Path):
        import torch

        self.name = path.name
        self.check = Check.load(path)
        artifact = self.check.artifact
        self.model, self.config = artifact.model, artifact.config
        self.precision = BUNDLE.match(path.name)["precision"] or "fp32"
        self.forward = _module(self.model, self.config, self.precision)
        self.inputs = {slot.name: torch.from_numpy(array.reshape(slot.shape)).cuda()
                       for slot, array in zip(artifact.inputs, self.check.inputs)}

    def measure(self, mode: str, warmup: int, repeat: int) -> dict:
        import torch

        row = {"bundle": self.name, "model": self.model, "config": self.config, "precision": self.precision,
               "mode": mode, "device": torch.cuda.get_device_name()}
        started = time.monotonic()
        try:
            graphs = _compiled_graphs()
            run = _runner(self.forward, mode, self.inputs)
            expected = self.check.expected
            outputs = [o.float().cpu().numpy().reshape(e.shape) for o, e in zip(run(), expected)]
            if mode in ("compile", "max-autotune") and _compiled_graphs() == graphs:
                raise RuntimeError("torch.compile compiled no graph: it ran eagerly")
            times = _time(run, warmup, repeat)
            row.update({"status": "ok", "max_abs_error_vs_cpu_reference": max(
                            float(np.max(np.abs(o - e))) for o, e in zip(outputs, expected)),
                        "matches_cpu_reference": bool(self.check.passes(outputs)),
                        "median_ms": statistics.median(times), "min_ms": min(times), "runs": len(times),
                        "kernels": _kernels_per_inference(run),
                        "setup_s": time.monotonic() - started - sum(times) / 1e3})
        except Exception as e:  # a mode that fails is this row's finding; the other modes still run
            first_line = str(e).splitlines()[0][:300] if str(e) else ""
            row.update({"status": f"failed: {type(e).__name__}: {first_line}"})
        return row


def table(rows: list[dict], souffle: dict[str, dict]) -> str:
    out = ["| bundle | mode | status | PyTorch median | kernels | Souffle median | Souffle launches | speedup |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mine = souffle.get(r["bundle"], {})
        theirs, ours = r.get("median_ms"), mine.get("median_ms")
        speedup = f"{theirs / ours:.2f}x" if theirs and ours else "-"
        out.append(f"| {r['bundle']} | {r['mode']} | {r['status']} | {f'{theirs:.3f} ms' if theirs else '-'} "
                   f"| {r.get('kernels', '-')} | {f'{ours:.3f} ms' if ours else '-'} "
                   f"| {mine.get('launches', '-')} | {speedup} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--bundles", nargs="+", default=["*_O4*"],
                        help="globs of the bundles to compare, taken in this order (default '*_O4*')")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds after which no mode starts")
    parser.add_argument("--souffle", type=Path, help="gpu_kernels.json of the same bundles, for the speedups")
    parser.add_argument("--results", type=Path, default=None)
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    paths = []
    for pattern in args.bundles:
        paths += [p for p in sorted(args.directory.glob(pattern), key=lambda p: ("_paper_" not in p.name, p.name))
                  if (p / "manifest.json").exists() and p not in paths and SEPARATOR not in p.name]
    souffle = {}
    if args.souffle and args.souffle.exists():
        souffle = {r["bundle"]: r for r in json.loads(args.souffle.read_text())["results"]}
    bundles, rows = {}, []
    for mode in args.modes:  # every bundle in one mode before the next, slower to set up, mode
        for path in paths:
            if time.monotonic() > deadline:
                rows.append({"bundle": path.name, "mode": mode, "status": "not run (time budget)"})
                continue
            try:
                bundle = bundles.get(path) or bundles.setdefault(path, Bundle(path))
                float32 = float32_arithmetic(bundle.precision)
                row = bundle.measure(mode, args.warmup, args.repeat)
            except Exception as e:  # a model that cannot be built is its row's finding
                float32 = None
                row = {"bundle": path.name, "mode": mode, "status": f"failed: {type(e).__name__}: {e}"[:300]}
            rows.append({**row, "float32": float32})
            print(json.dumps(rows[-1]), flush=True)
            # written after every row: a run stopped at its time limit keeps what it measured
            common.write("gpu_torch", {"command": common.command(), "results": rows}, table(rows, souffle),
                         args.results)
    common.publish("gpu_torch", rows, table(rows, souffle), ("torch", "numpy"),
                   f"CUDA events, {args.warmup} warm-up runs, median of {args.repeat}", args.results)


if __name__ == "__main__":
    main()
