"""``souffle.compile``: a Graph -> a callable compiled model with a report.

One runner (``souffle.passes``) applies the target's pipeline, declared as one ordered list of
passes in ``codegen.pipelines``: for ``llvm`` the CPU's graph rewrites, lowering, the stitched
function and LLVM; for ``cuda`` and ``llvm-persistent`` the paper's transformations, the
persistent kernel's staged program and what synchronizes it, then its CUDA kernels or the same
program as one CPU function. ``souffle compile ... --dump-ir DIR`` writes the IR after every pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tvm

from analysis.device import DEVICES, get_device
from codegen.pipelines import PIPELINES, VALIDATE_BY_DEFAULT
from souffle import models
from souffle.compiled import CompiledModel, CpuModel, Report
from souffle.cuda_model import CudaModel, EmulatedModel
from souffle.errors import SouffleError, TargetError
from souffle.graph import Graph
from souffle.lower import TEProgram
from souffle.passes import CompileOptions, Pipeline, PipelineRun
from souffle.precision import DEFAULT_PRECISION, check_precision
from souffle.runtime.check import CHECK, EXPECTED, INPUTS, Check

TARGETS = tuple(PIPELINES)
DATABASE_TARGETS = ("cuda", "cuda-emulated")  # the targets whose stages a MetaSchedule database may schedule
MODELS = {"llvm": CpuModel, "cuda": CudaModel, "llvm-persistent": CpuModel, "cuda-emulated": EmulatedModel}  # what each target's result runs as

__all__ = ["TARGETS", "CompiledModel", "Report", "compile", "export_check", "run_passes", "stage_workloads",
           "staged_program"]


def compile(graph: Graph, target: str = "llvm", device: str | None = None, threads: int | None = None,
            opt_level: int | None = None, dump_ir: str | Path | None = None,
            print_after: tuple[str, ...] | list[str] = (), validate: bool | None = None,
            precision: str = DEFAULT_PRECISION, database: str | Path | None = None) -> CompiledModel:
    """Compile a whole model for ``target``.

    - ``"llvm"``: one CPU function, with the CPU's own schedules (the fast CPU path).
    - ``"cuda"``: ONE persistent, grid-synchronized CUDA kernel. Compiling needs nvcc, not a
      GPU: ``.source``, ``.resources`` and ``.report()`` work anywhere; running needs a GPU.
      ``device`` names the device model that sizes the grid when no GPU is present
      (``"h200"`` by default, ``"h100"`` or ``"a100"``) and the report's latency estimate.
    - ``"llvm-persistent"``: the CUDA kernel's staged program (its stages, tiles, barriers
      and scratch layout) run on the CPU, block after block — to check that program anywhere.
    - ``"cuda-emulated"``: the ``"cuda"`` kernels' very source built with the host C++ compiler
      and run on the CPU, each GPU thread a fiber, checked for races and deadlocks
      (``EmulatedModel.schedule`` picks the grid and the thread order).

    ``threads`` is the thread-block size of the persistent kernel (256 by default).

    ``opt_level`` (persistent targets; the paper's ablation, ``codegen.pipelines``): 0 one
    kernel per TE, 1 + horizontal fusion and the LSTM wavefront, 2 + vertical inlining,
    3 + global sync (one kernel per subprogram of the partition, a grid barrier between
    stages), 4 + post-optimizations (barriers only where data crosses blocks; default).

    ``dump_ir`` names a directory for the IR after every pass (``NN-pass.kind`` files, in
    pipeline order, ``00-input`` the graph); ``print_after`` names passes whose IR is printed.

    ``validate`` (cuda): check every kernel's threads before nvcc (``analysis.threads``: races,
    coverage, deadlock, launch fit), a ``ValidationError`` if one is unsafe; None takes the
    pipeline's default (``codegen.pipelines.VALIDATE_BY_DEFAULT``), False is for debugging.

    ``precision`` (``souffle.precision``): ``"fp32"`` (default), ``"fp16"`` or ``"bf16"``, the weights
    converted once at compile time, GEMMs and reductions accumulating in float32; the model's
    float inputs and outputs stay float32.

    ``database`` (cuda, cuda-emulated): a MetaSchedule JSON database (the directory MetaSchedule's
    ``tune_tir`` writes, its stage workloads tuned on a GPU); each stage it has a record for
    takes the record's schedule (``codegen.tuned``). The report says which stages did, and why
    any record was refused.
    """
    if not isinstance(graph, Graph):
        raise SouffleError(f"souffle.compile takes a souffle Graph, got {type(graph).__name__}")
    pipeline = _pipeline(target)
    if graph.weights is None:
        raise SouffleError(f"graph {graph.name!r} has no weights; build it with arrays or call .with_weights(...)")
    options = _options(pipeline, device, threads, opt_level, validate, precision, database)
    run = pipeline.run(graph, options, dump_dir=dump_ir, print_after=print_after)
    return MODELS[target](graph, run)


def run_passes(ir, target: str = "cuda", start: str | None = None, stop: str | None = None,
               device: str | None = None, threads: int | None = None, opt_level: int | None = None,
               validate: bool | None = None, precision: str = DEFAULT_PRECISION) -> PipelineRun:
    """Part of ``target``'s pipeline, from pass ``start`` to pass ``stop`` (inclusive; by default
    from the first to the last), applied to ``ir`` (what ``start`` takes) with the options
    ``compile`` would use: the passes' IRs, times and notes."""
    pipeline = _pipeline(target)
    return pipeline.run(ir, _options(pipeline, device, threads, opt_level, validate, precision), start=start, stop=stop)


def stage_workloads(graph: Graph, device: str | None = None, threads: int | None = None,
                    opt_level: int | None = None, precision: str = DEFAULT_PRECISION) -> dict:
    """Stage name -> its workload (an IRModule whose ``main`` is the stage's TE as one PrimFunc)
    for ``graph``'s CUDA kernel compiled with these options: what to tune with MetaSchedule
    (``tvm.s_tir.meta_schedule.tune_tir``, on the GPU, into one work_dir) to make the database
    ``compile(..., database=work_dir)`` takes stage schedules from (``codegen.tuned``)."""
    from codegen.tuned import workload

    staged = run_passes(graph, "cuda", stop="stage", device=device, threads=threads, opt_level=opt_level,
                        precision=precision).ir
    return {stage.name: tvm.IRModule({"main": workload(stage.tensor, stage.placeholders)})
            for stage in staged.stages()}


def staged_program(program: TEProgram, target: str = "cuda", threads: int | None = None,
                   opt_level: int | None = None, device: str | None = None):
    """The persistent kernel's staged program for an already lowered ``program`` (no graph
    transforms, no vertical inlining): the target's passes from its epilogue fusion to its
    arena plan, at ``opt_level``."""
    return run_passes(program, target, "fuse_epilogues", "plan_arena", device, threads, opt_level).ir


def _pipeline(target: str) -> Pipeline:
    if target not in PIPELINES:
        raise TargetError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    return PIPELINES[target]


def _options(pipeline: Pipeline, device: str | None, threads, opt_level, validate: bool | None = None,
             precision: str = DEFAULT_PRECISION, database: str | Path | None = None) -> CompileOptions:
    kind = get_device(pipeline.device).kind
    model = get_device(device or pipeline.device)
    if model.kind != kind:
        choices = ", ".join(repr(name) for name in DEVICES if get_device(name).kind == kind)
        raise TargetError(f"target {pipeline.target!r} needs a {kind.upper()} device model, not {model.name!r}; "
                          f"use {choices}")
    if validate is not None and not isinstance(validate, bool):
        raise SouffleError(f"validate must be True, False or None, got {validate!r}")
    if database is not None and pipeline.target not in DATABASE_TARGETS:
        raise TargetError(f"a MetaSchedule database schedules the stages of a CUDA kernel (targets "
                          f"{', '.join(DATABASE_TARGETS)}), not target {pipeline.target!r}")
    return CompileOptions(pipeline.target, pipeline.check_level(opt_level), pipeline.check_threads(threads), model,
                          VALIDATE_BY_DEFAULT if validate is None else validate, check_precision(precision),
                          None if database is None else str(database))


def export_check(name: str, config: str, directory, archs: tuple[str, ...] = ("sm_80",), opt_level: int | None = None,
                 precision: str = "fp32"):
    """Compile model ``name`` for cuda (at ``opt_level``, by default the compiler's, and
    ``precision``) and write its check bundle (``souffle.runtime.check``) to ``directory``, with
    PyTorch's outputs at the same precision; returns the compiled model.

    The bundle is loaded back as the GPU machine will load it, so that one it would refuse (a
    reference output of another shape or dtype than the kernel's) fails here, where it is made."""
    graph = models.build(name, config)
    model = compile(graph, target="cuda", opt_level=opt_level, precision=precision)
    target = model.artifact(config=config, seed=0, archs=archs).save(directory)
    inputs = models.make_inputs(name, config, seed=1)
    np.savez(target / INPUTS, **inputs)
    np.savez(target / EXPECTED, *models.reference(name, config, graph.weights, precision)(inputs))
    rtol, atol = models.tolerance(name, config, precision)
    (target / CHECK).write_text(json.dumps({"rtol": rtol, "atol": atol, "report": str(model.report())}))
    figures = static_figures(model)
    figures["timeline"] = export_timeline(model, target, archs)
    (target / STATIC).write_text(json.dumps(figures, indent=1))
    Check.load(target)
    return model


def export_timeline(model: CudaModel, directory: Path, archs: tuple[str, ...]) -> str:
    """Write the kernel's timeline build (``codegen.timeline``) beside its bundle, read by
    ``souffle.runtime.timeline``; returns what was written, or why nothing was (a model of
    several kernels, or one without grid barriers)."""
    from codegen.timeline import TimelineError, instrument, segments
    from souffle.runtime import timeline as files
    from souffle.runtime.cuda import compile_cubin, sha256_hex

    try:
        parts = segments(model.plan, model.latency)
        (kernel,) = model.argument_orders
        source = instrument(model.source, kernel, len(parts))
    except TimelineError as e:
        return f"none: {e}"
    built = {arch: compile_cubin(source, arch, (kernel,)) for arch in dict.fromkeys((model.device_model.arch, *archs))}
    cubins = {arch: cubin for arch, (cubin, _) in built.items()}
    stamped = built[model.device_model.arch][1][kernel]
    (directory / files.SOURCE).write_text(source)
    for arch, cubin in cubins.items():
        (directory / files.cubin_file(arch)).write_bytes(cubin)
    (directory / files.TIMELINE).write_text(json.dumps({
        "kernel": kernel, "source_sha256": sha256_hex(source.encode()),
        "cubins": {arch: sha256_hex(cubin) for arch, cubin in cubins.items()},
        # ptxas on the device model's arch, the kernel and its timeline build: the stamp is a call,
        # which can move a few registers (paper LSTM: 4 B spilled in the timeline build only)
        "resources": {"kernel": _resources(model.resources), "timeline": _resources(stamped)},
        "segments": [{"stages": list(part.stages), "estimate_us": part.estimate_seconds * 1e6} for part in parts]}))
    return f"{files.TIMELINE}: {len(parts)} segments"


def _resources(resources) -> dict:
    return {"registers": resources.registers, "spill_bytes": resources.spill_bytes, "stack_bytes": resources.stack_bytes}


STATIC = "static.json"  # beside a check bundle: what the compiler predicts for it, read back by the GPU report


def static_figures(model: CudaModel) -> dict:
    """The static model's figures for ``model``'s kernels, to set beside a GPU's measurements:
    the latency estimate and roofline bound on the device model it was compiled for, and the
    global-memory bytes one inference reads and writes (an upper bound on DRAM traffic)."""
    estimate, traffic, behind_l2 = model.latency, model.traffic, model.behind_l2
    return {"device": estimate.device.name, "estimate_ms": estimate.seconds * 1e3,
            "roofline_ms": estimate.roofline_seconds * 1e3, "launches": estimate.launches,
            "grid_barriers": estimate.grid_barriers, "read_bytes": traffic.read_bytes,
            "write_bytes": traffic.write_bytes, "compulsory_bytes": traffic.compulsory_bytes,
            "traffic_exact": all(stage.exact for stage in traffic.stages),
            "l2_model_read_bytes": behind_l2.read_bytes, "l2_model_write_bytes": behind_l2.write_bytes}
