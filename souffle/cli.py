"""The ``souffle`` command: compile, run, check and analyse the paper's models."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from souffle.errors import SouffleError, TargetError
from souffle.precision import DEFAULT_PRECISION
from souffle.tensor import is_float


def _compile(args) -> int:
    import souffle
    from souffle import models

    if args.repeat < 1:
        raise SouffleError(f"--repeat is the number of timed runs: it must be at least 1, got {args.repeat}")
    emulated = args.target == "cuda-emulated"
    if args.emit_source:
        if args.target not in ("cuda", "cuda-emulated"):
            raise SouffleError(f"--emit-source writes CUDA source: it needs --target cuda, not {args.target!r}")
        _check_writable_file(args.emit_source, "--emit-source")
    onnx_file = args.model.endswith(".onnx")
    if onnx_file:
        graph = souffle.from_onnx(args.model, _input_shapes(args.input_shape))
    else:
        graph = models.build(args.model, config=args.config, seed=args.seed)  # refuses a seed numpy does not take
    compiled = souffle.compile(graph, target=args.target, device=args.device, threads=args.threads,
                               opt_level=args.opt_level, dump_ir=args.dump_ir, print_after=args.print_after,
                               validate=args.validate, precision=args.precision, database=args.database)
    if (args.thread_order, args.order_seed, args.grid) != ("ascending", 0, None) and not emulated:
        raise SouffleError("--thread-order, --order-seed and --grid choose how cuda-emulated runs the kernel: they need "
                           f"--target cuda-emulated, not {args.target!r}")
    if emulated:
        compiled.schedule(args.thread_order, args.grid, args.order_seed)
    if args.emit_source:
        try:
            Path(args.emit_source).write_text(compiled.source)
        except OSError as err:
            raise SouffleError(f"--emit-source {args.emit_source}: cannot write it: {err.strerror}") from None
    if args.no_run:
        print(json.dumps(compiled.report().to_dict(), indent=2, default=str) if args.json else compiled.report())
        return 0
    inputs = _random_inputs(graph, args.seed) if onnx_file else models.make_inputs(args.model, config=args.config, seed=args.seed)
    outputs = compiled.run(inputs)
    times = [compiled._last_run] if emulated else compiled.benchmark(inputs, repeat=args.repeat)
    report = compiled.report()
    report.run_seconds = statistics.median(times)
    report.extra["run spread"] = f"min {min(times) * 1e3:.3f} ms, max {max(times) * 1e3:.3f} ms over {len(times)} runs"
    if args.target == "cuda":
        try:
            replays = compiled.benchmark(inputs, repeat=args.repeat, graph=True)
            report.extra["run in a CUDA graph"] = (
                f"median {statistics.median(replays) * 1e3:.3f} ms over {len(replays)} replays (the launches in "
                "one call: the host's launch cost left out)")
        except TargetError as err:  # a driver that cannot capture the launches: the direct timing stands
            report.extra["run in a CUDA graph"] = f"not run: {err}"
    status = 0
    if args.check:
        if onnx_file:
            expected = _onnx_runtime(args.model, inputs)
            rtol, atol = (1e-4, 1e-4) if args.precision == "fp32" else models.FP16_TOLERANCE
        else:
            expected = models.reference(args.model, args.config, graph.weights, args.precision)(inputs)
            rtol, atol = models.tolerance(args.model, args.config, args.precision)
        errors = [float(np.max(np.abs(o - e))) for o, e in zip(outputs, expected)]
        ok = all(np.allclose(o, e, rtol=rtol, atol=atol) for o, e in zip(outputs, expected))
        report.extra["max abs error"] = f"{max(errors):.3g} vs {'ONNX Runtime' if onnx_file else 'PyTorch'} (per output: {', '.join(f'{e:.3g}' for e in errors)})"
        report.extra["check"] = f"{'PASS' if ok else 'FAIL'} (rtol {rtol:g}, atol {atol:g})"
        status = 0 if ok else 1
    if args.explain:
        print(compiled.program.graph)  # after the target's graph rewrites
        print(compiled.program)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report)
    return status


def _input_shapes(options: list[str]) -> dict[str, tuple[int, ...]]:
    """``NAME=1,3,224,224`` options as {name: shape}."""
    shapes = {}
    for option in options:
        name, _, dims = option.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise SouffleError(f"--input-shape {option}: expected NAME=D1,D2,... with integer sizes") from None
        if not name or any(d < 1 for d in shapes[name]):
            raise SouffleError(f"--input-shape {option}: expected NAME=D1,D2,... with positive sizes")
    return shapes


def _random_inputs(graph, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs for an imported model: normal floats, integers 0 or 1 (valid ids and masks)."""
    rng = np.random.default_rng(seed)
    return {spec.name: rng.standard_normal(spec.shape).astype(spec.dtype) if is_float(spec.dtype)
            else rng.integers(0, 2, spec.shape).astype(spec.dtype) for spec in graph.inputs}


def _onnx_runtime(path: str, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The ONNX file's outputs by ONNX Runtime: the reference an ONNX model is checked against."""
    try:
        import onnxruntime
    except ImportError:
        raise SouffleError("--check on an ONNX file needs onnxruntime; install it with `pip install onnxruntime`") from None
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def _check_writable_file(path: str, option: str):
    """Refuse, before compiling, a file path that cannot be written: a directory, or in a missing one."""
    file = Path(path)
    if file.is_dir():
        raise SouffleError(f"{option} {path}: is a directory, not a file")
    if not file.parent.is_dir():
        raise SouffleError(f"{option} {path}: directory {str(file.parent)!r} does not exist")


CONFIG_HELP = ("tiny (tests), paper (the paper's sizes), or a JSON object of overrides of tiny, "
               "e.g. '{\"batch\": 2, \"attention_mask\": \"int64\"}'")


def _model_config(text: str):
    """--config: a config name, or a JSON object of overrides of "tiny" (``souffle.models``)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON object of config overrides: {err}") from None


def _analyze(args) -> int:
    from analysis import analyze
    from analysis.device import get_device
    from souffle import models

    device = get_device(args.device)  # an unknown device is refused before the model is built
    result = analyze(models.structure(args.model, config=args.config), device)
    print(json.dumps(result.to_json(), indent=2) if args.json else result)
    return 0


def _passes(args) -> int:
    from codegen.pipelines import PIPELINES

    if args.target is not None and args.target not in PIPELINES:
        raise SouffleError(f"unknown target {args.target!r}; available: {', '.join(PIPELINES)}")
    chosen = [PIPELINES[args.target]] if args.target else list(PIPELINES.values())
    print("\n\n".join(pipeline.describe() for pipeline in chosen))
    return 0


def _parser() -> argparse.ArgumentParser:
    from souffle.models import MODELS

    parser = argparse.ArgumentParser(prog="souffle", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    compile_cmd = commands.add_parser("compile", help="compile a model, run it on seeded inputs, print the report")
    compile_cmd.add_argument("model", help=f"one of: {', '.join(MODELS)}; or an ONNX file (model.onnx)")
    compile_cmd.add_argument("--input-shape", metavar="NAME=D1,D2,...", action="append", default=[],
                             help="static shape of an ONNX input whose shape is symbolic (repeatable)")
    compile_cmd.add_argument("--config", default="tiny", type=_model_config, help=CONFIG_HELP)
    compile_cmd.add_argument("--target", default="llvm",
                             help="llvm (CPU), cuda (one persistent kernel; running needs a GPU), "
                                  "llvm-persistent (the CUDA kernel's stages run on the CPU), or cuda-emulated (the "
                                  "CUDA kernel's source run on the CPU, each GPU thread a fiber)")
    compile_cmd.add_argument("--device", default=None,
                             help="GPU device model sizing the cuda grid and the latency estimate: h200 (default), h100 "
                                  "or a100")
    compile_cmd.add_argument("--threads", type=int, default=None, help="threads per block of the persistent kernel (256)")
    compile_cmd.add_argument("--opt-level", type=int, default=None, metavar="{0,1,2,3,4}",
                             help="the persistent kernel's optimizations (cuda, llvm-persistent): 0 one kernel per TE, "
                                  "1 +horizontal and LSTM wavefront, 2 +vertical, 3 +global sync, "
                                  "4 +post-optimizations (default)")
    compile_cmd.add_argument("--precision", default=DEFAULT_PRECISION,
                             help="what the model computes in: fp32 (default), fp16 or bf16 (weights converted at "
                                  "compile time, GEMMs and reductions accumulate in fp32; inputs and outputs stay fp32), "
                                  "or tf32 (fp32, GEMMs on CUDA tensor cores in TF32)")
    compile_cmd.add_argument("--database", metavar="DIR",
                             help="a MetaSchedule JSON database (targets cuda, cuda-emulated): each stage whose "
                                  "workload it has a record for takes the record's schedule (the report lists them)")
    compile_cmd.add_argument("--emit-source", metavar="FILE",
                             help="write the generated CUDA source to FILE (targets cuda, cuda-emulated)")
    compile_cmd.add_argument("--thread-order", default="ascending", choices=("ascending", "descending", "random"),
                             help="cuda-emulated: the order threads run in between barriers (default ascending)")
    compile_cmd.add_argument("--order-seed", type=int, default=0, help="cuda-emulated: the seed of the random order")
    compile_cmd.add_argument("--grid", type=int, default=None,
                             help="cuda-emulated: blocks in the grid (default: the fewest the kernels allow, at least 2)")
    compile_cmd.add_argument("--no-run", action="store_true", help="compile and print the report without running")
    compile_cmd.add_argument("--check", action="store_true", help="compare the outputs with the PyTorch reference")
    compile_cmd.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    compile_cmd.add_argument("--repeat", type=int, default=5, help="timed runs (the median is reported)")
    compile_cmd.add_argument("--explain", action="store_true", help="print the graph and the global TE program")
    compile_cmd.add_argument("--dump-ir", metavar="DIR",
                             help="write the IR after every pass to DIR, one numbered file per pass in pipeline order")
    compile_cmd.add_argument("--print-after", metavar="PASS", action="append", default=[],
                             help="print the IR after pass PASS (repeatable; `souffle passes` lists them)")
    compile_cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    compile_cmd.add_argument("--validate", action=argparse.BooleanOptionalAction, default=None,
                             help="check every CUDA kernel's threads before nvcc: races, coverage, deadlock, launch "
                                  "fit (--no-validate skips it, for debugging only)")
    compile_cmd.set_defaults(run=_compile)
    analyze_cmd = commands.add_parser(
        "analyze", help="classify every TE's dependences, reuse, FLOPs and bytes (the global analysis)")
    analyze_cmd.add_argument("model", help=f"one of: {', '.join(MODELS)}")
    analyze_cmd.add_argument("--config", default="tiny", type=_model_config, help=CONFIG_HELP)
    analyze_cmd.add_argument("--device", default="h200", help="device model for the roofline: h200, h100, a100 or cpu")
    analyze_cmd.add_argument("--json", action="store_true", help="print every TE and the summary as JSON")
    analyze_cmd.set_defaults(run=_analyze)
    passes_cmd = commands.add_parser("passes", help="print each target's pipeline: its passes in order")
    passes_cmd.add_argument("--target", default=None, help="llvm, cuda, llvm-persistent or cuda-emulated (default: all)")
    passes_cmd.set_defaults(run=_passes)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except SouffleError as err:
        print(f"souffle: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
