"""The compiler's pipelines: one declared, ordered list of passes per target.

``souffle.compile`` applies the target's pipeline with one runner (``souffle.passes``), which
times every pass, collects what each did, and dumps or prints the IR after any of them.

- ``llvm``: the fast CPU path, one function for the whole model with the CPU's own schedules.
- ``cuda``: the persistent kernel. The opt levels are the paper's ablation, each adding passes
  to the one below: O0 one kernel per TE; O1 + horizontal fusion and the LSTM wavefront; O2 +
  vertical inlining; O3 + global sync (reductions fused with their epilogues, one kernel with a
  grid barrier between stages, split only where the device forces it); O4 + post-optimizations
  (barriers only where data crosses blocks, weights kept on chip across loops, GEMMs too narrow
  for the grid split over K).
- ``llvm-persistent``: the persistent kernel's very stages, tiles, barriers and scratch layout
  run on the CPU, block after block, to check that program anywhere.
- ``cuda-emulated``: the ``cuda`` pipeline, then the very CUDA source nvcc gets built with the
  host C++ compiler to run on the CPU, each GPU thread a fiber (``souffle.runtime.emulated``):
  what a thread binding, a warp shuffle or a barrier does is checked without a GPU.
"""

from __future__ import annotations

from functools import partial

from analysis.threads import device_functions, validate_kernels
from codegen import validation_cache
from codegen.align_tiles import align_tiles
from codegen.arena import plan_arena
from codegen.barriers import place_barriers
from codegen.cpu_transforms import hoist_scan_projections, pack_weights
from codegen.cuda import (CudaSource, build_emulated, check_co_residency, cuda_compile, cuda_source,
                          device_module, kernel_plan)
from codegen.epilogues import fuse_epilogues
from codegen.horizontal import horizontal
from codegen.llvm import CpuModule, build, persistent_cpu_function
from codegen.on_chip import keep_weights_on_chip
from codegen.partition import partition_kernels
from codegen.commute_rolls import commute_rolls
from codegen.scale_past_matmul import scale_past_matmul
from codegen.schedule import THREADS
from codegen.schedule_cpu import schedule_cpu
from codegen.stage import keep_occupancy, stage_program
from codegen.stitch import stitch
from codegen.sync import global_sync, kernel_per_stage
from codegen.tuned import StageDatabase
from codegen.vertical import inline_one_relies_on_one
from codegen.split_k import split_k
from codegen.wavefront import wavefront
from souffle.lower import lower_graph
from souffle.passes import IRKind, Outcome, Pass, Pipeline
from souffle.precision import with_precision

GRAPH = IRKind("graph", "graph.txt")
TE = IRKind("te", "te.txt")
STAGED = IRKind("staged", "staged.txt")
TIR = IRKind("tir", "tir.txt")
CUDA_SOURCE = IRKind("cuda", "cu")
PTXAS = IRKind("ptxas", "ptxas.txt")
KERNELS = IRKind("kernels", "kernels.txt")
LLVM_IR = IRKind("module", "ll")

DEFAULT_OPT_LEVEL = 4
# The thread-level validator runs before nvcc on every kernel; ``--no-validate`` is for debugging.
VALIDATE_BY_DEFAULT = True
OPT_LEVELS = {
    0: "one kernel per TE",
    1: "+ horizontal (and the LSTM wavefront)",
    2: "+ vertical (one-relies-on-one TEs inlined)",
    3: "+ global sync (one kernel per subprogram, a grid barrier between stages)",
    4: "+ post-optimizations (barriers only where data crosses blocks)",
}

PRECISION = Pass("precision", lambda graph, o: Outcome(*with_precision(graph, o.precision)), GRAPH, section="transform")

LLVM = Pipeline("llvm", GRAPH, (
    PRECISION,
    Pass("hoist_scan_projections", lambda graph, _: hoist_scan_projections(graph), GRAPH),
    Pass("pack_weights", lambda graph, _: pack_weights(graph), GRAPH),
    Pass("lower", lambda graph, _: lower_graph(graph), TE),
    Pass("stitch", lambda program, o: stitch(program, partial(schedule_cpu, device=o.device)), TIR),
    Pass("build", lambda stitched, _: CpuModule(stitched, build(stitched.func)), LLVM_IR),
))

# The persistent kernel's passes up to its TE program, then after its stages are built.
TRANSFORMS = (
    Pass("wavefront", lambda graph, _: Outcome(*wavefront(graph)), GRAPH, from_level=1, section="transform"),
    PRECISION,
    Pass("horizontal", lambda graph, _: Outcome(*horizontal(graph)), GRAPH, from_level=1, section="transform"),
    Pass("scale_past_matmul", lambda graph, _: Outcome(*scale_past_matmul(graph)), GRAPH, from_level=2,
         section="transform"),
    Pass("commute_rolls", lambda graph, _: Outcome(*commute_rolls(graph)), GRAPH, from_level=2,
         section="transform"),
    Pass("split_k", lambda graph, o: Outcome(*split_k(graph, o.device)), GRAPH, from_level=4, section="transform"),
    Pass("lower", lambda graph, _: lower_graph(graph), TE),
    Pass("vertical", lambda program, _: inline_one_relies_on_one(program), TE, from_level=2, section="transform"),
)
SYNCHRONIZATION = (
    Pass("kernel_per_stage", lambda staged, _: kernel_per_stage(staged), STAGED),
    Pass("global_sync", lambda staged, _: global_sync(staged), STAGED, from_level=3),
    Pass("place_barriers", lambda staged, _: place_barriers(staged), STAGED, from_level=4),
    Pass("partition", lambda staged, o: partition_kernels(staged, o.device), STAGED, from_level=3,
         section="partition"),
    Pass("keep_weights_on_chip", lambda staged, o: keep_weights_on_chip(staged, o.device), STAGED, from_level=4,
         section="on chip"),
    Pass("plan_arena", lambda staged, _: plan_arena(staged), STAGED),
)


def _gpu_stages(program, options) -> Outcome:
    """The stage pass for a GPU: where a MetaSchedule database is given, the stages it has
    records for take their schedules from it (``codegen.tuned``), one note per such stage."""
    database = StageDatabase(options.database) if options.database else None
    staged = stage_program(program, True, options.threads, options.device, options.precision == "tf32", database)
    return Outcome(staged, [] if database is None else
                   database.notes or [f"no stage's workload has a record in {database.path}"])


def _source(plan, arch: str) -> CudaSource:
    device = device_module(plan.funcs, arch)
    return CudaSource(plan, cuda_source(device, arch), device)


def validate_threads(source: CudaSource, options) -> Outcome:
    """Every kernel of ``source``, as TVM lowers it for the CUDA code generator, checked by
    ``analysis.threads`` (races, coverage, deadlock, launch fit): a ``ValidationError`` if one
    is unsafe; the notes say where the check over-approximated."""
    if not options.validate:
        return Outcome(source, ["skipped (validation off)"])
    plan = source.plan
    threads, counters, min_grids = plan.staged.threads, plan.host_loop_trips(), plan.min_grids()
    digest = validation_cache.key(source.text, threads, counters, min_grids)
    if (accepted := validation_cache.load(digest)) is not None:
        return Outcome(source, [f"{kernel}: {note}" for kernel, notes in accepted.items() for note in notes]
                       + [f"{len(accepted)} kernels validated (verdict cached under {digest[:16]})"])
    device = source.device if source.device is not None else device_module(plan.funcs, options.device.arch)
    results = validate_kernels(device_functions(device), threads, counters, min_grids)
    validation_cache.store(digest, {r.kernel: list(r.notes) for r in results})
    return Outcome(source, [f"{r.kernel}: {note}" for r in results for note in r.notes]
                   + [f"{len(results)} kernels validated"])


CUDA = Pipeline("cuda", GRAPH, (
    *TRANSFORMS,
    Pass("fuse_epilogues", lambda program, o: fuse_epilogues(program, True, o.threads), TE, from_level=3),
    Pass("stage", lambda program, o: _gpu_stages(program, o), STAGED, section="database"),
    Pass("align_tiles", lambda staged, o: Outcome(*align_tiles(staged, o.device)), STAGED, from_level=4,
         section="transform"),
    Pass("keep_occupancy", lambda staged, o: Outcome(*keep_occupancy(staged, o.device)), STAGED, section="transform"),
    *SYNCHRONIZATION,
    Pass("kernel_plan", lambda staged, _: kernel_plan(staged), TIR),
    Pass("cuda_source", lambda plan, o: _source(plan, o.device.arch), CUDA_SOURCE),
    Pass("validate_threads", validate_threads, CUDA_SOURCE),
    Pass("nvcc", lambda source, o: cuda_compile(source, o.device), PTXAS, section="ptxas"),
    Pass("co_residency", lambda binary, o: check_co_residency(binary, o.device), KERNELS),
), "h200", OPT_LEVELS, DEFAULT_OPT_LEVEL, THREADS)

LLVM_PERSISTENT = Pipeline("llvm-persistent", GRAPH, (
    *TRANSFORMS,
    Pass("fuse_epilogues", lambda program, o: fuse_epilogues(program, False, o.threads), TE, from_level=3),
    Pass("stage", lambda program, o: stage_program(program, False, o.threads), STAGED),
    *SYNCHRONIZATION,
    Pass("staged_function", lambda staged, _: persistent_cpu_function(staged), TIR),
    Pass("build", lambda function, _: CpuModule(function.staged, build(function.func), function.grid), LLVM_IR),
), "h200", OPT_LEVELS, DEFAULT_OPT_LEVEL, THREADS)

CUDA_EMULATED = Pipeline("cuda-emulated", GRAPH, (
    *CUDA.passes,
    Pass("emulated_build", lambda kernels, _: build_emulated(kernels), KERNELS),
), "h200", OPT_LEVELS, DEFAULT_OPT_LEVEL, THREADS)

PIPELINES = {pipeline.target: pipeline for pipeline in (LLVM, CUDA, LLVM_PERSISTENT, CUDA_EMULATED)}
