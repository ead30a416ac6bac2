"""``souffle.compile``: a Graph -> a callable compiled model with a report.

The pipeline, each step a named function whose result can be printed:

    graph --prepare_graph--> Graph (target rewrites) --lower_graph--> TEProgram
          --stitch(schedule)--> one PrimFunc --build--> module
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from souffle.errors import InputError, SouffleError, TargetError
from souffle.graph import Graph
from souffle.lower import LoopRegion, TEProgram, lower_graph

TARGETS = ("llvm", "cuda", "llvm-persistent")
PERSISTENT_CPU_GRID = 1056  # blocks the CPU run of the staged program uses at most (H200: 132 SMs x 8)


@dataclass
class Report:
    """What the compiler did and what a run cost."""

    model: str
    target: str
    ops: int
    ops_executed: int
    tes: int
    regions: int
    loops: int
    kernels: int
    weight_bytes: int
    arena_bytes: int
    compile_seconds: dict[str, float]
    run_seconds: float | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    def __str__(self):
        c = self.compile_seconds
        lines = [
            f"model          {self.model} (target {self.target})",
            f"ops            {self.ops} in the graph, {self.ops_executed} executed (scan bodies x trip count)",
            f"TEs            {self.tes} (loop bodies counted once)",
            f"regions/loops  {self.regions} regions, {self.loops} loops",
            f"kernels        {self.kernels}",
            f"weights        {self.weight_bytes / 1e6:.2f} MB (stacked per-layer weights included)",
            f"scratch arena  {self.arena_bytes / 1e6:.3f} MB",
            "compile        " + ", ".join(f"{k} {v:.2f} s" for k, v in c.items()) + f" (total {sum(c.values()):.2f} s)",
        ]
        if self.run_seconds is not None:
            lines.append(f"run            {self.run_seconds * 1e3:.3f} ms")
        lines += [f"{k:<14} {v}" for k, v in self.extra.items()]
        return "\n".join(lines)


class CompiledModel:
    """A compiled model: numpy in, numpy out. One kernel (one function call) per run.

    ``plan`` is what was compiled: the stitched CPU function (``codegen.stitch``) or the
    persistent kernel's staged program (``codegen.staging``); both take their buffers in the
    order inputs, weights, outputs, scratch arenas.
    """

    def __init__(self, graph: Graph, target: str, program: TEProgram, plan, executable, compile_seconds):
        self.graph = graph
        self.target = target
        self.program = program
        self.plan = plan
        self._compile_seconds = compile_seconds
        self._last_run: float | None = None
        self.kernel_count = 1
        self.grid: int | None = None
        if executable is not None:
            import tvm

            self._executable = executable
            self._device = tvm.cpu()
            self._function = executable["main"]
            self._weights = [tvm.runtime.tensor(value.reshape(-1), self._device) for _, value in plan.weights]
            self._arenas = [tvm.runtime.empty((max(size, 1),), dtype, self._device) for dtype, size in plan.arena_sizes.items()]

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.graph.inputs]

    def _checked_inputs(self, inputs: dict) -> list[np.ndarray]:
        expected = {s.name: s for s in self.graph.inputs}
        missing = [n for n in expected if n not in inputs]
        extra = [n for n in inputs if n not in expected]
        if missing or extra:
            raise InputError(
                f"{self.graph.name}: inputs must be {sorted(expected)}"
                + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else "")
            )
        arrays = []
        for name, spec in expected.items():
            array = np.asarray(inputs[name])
            if tuple(array.shape) != spec.shape:
                raise InputError(f"{self.graph.name}: input {name!r} has shape {tuple(array.shape)}, expected {spec.shape}")
            if array.dtype != np.dtype(spec.dtype):
                raise InputError(f"{self.graph.name}: input {name!r} has dtype {array.dtype}, expected {spec.dtype}")
            arrays.append(np.ascontiguousarray(array).reshape(-1))
        return arrays

    def _arguments(self, inputs: dict):
        import tvm

        args = [tvm.runtime.tensor(a, self._device) for a in self._checked_inputs(inputs)]
        outputs = [tvm.runtime.empty((s.size,), s.dtype, self._device) for s in self.plan.outputs]
        return args + self._weights + outputs + self._arenas, outputs

    def run(self, inputs: dict) -> list[np.ndarray]:
        """Run on named inputs; outputs in the graph's output order."""
        args, outputs = self._arguments(inputs)
        start = time.perf_counter()
        self._function(*args)
        self._last_run = time.perf_counter() - start
        return [o.numpy().reshape(s.shape) for o, s in zip(outputs, self.plan.outputs)]

    def __call__(self, *args, **kwargs):
        """``m(x)`` or ``m(x=...)``; one output is returned as an array, several as a tuple."""
        if args and kwargs:
            raise InputError("pass inputs either by position or by name, not both")
        if args:
            if len(args) != len(self.graph.inputs):
                raise InputError(f"{self.graph.name} takes {len(self.graph.inputs)} inputs ({self.input_names}), got {len(args)}")
            kwargs = dict(zip(self.input_names, args))
        outputs = self.run(kwargs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def benchmark(self, inputs: dict, repeat: int = 10, number: int = 1) -> list[float]:
        """Seconds per run, ``repeat`` samples after one warm-up, timed by TVM's evaluator."""
        args, _ = self._arguments(inputs)
        evaluator = self._executable.mod.time_evaluator("main", self._device, number=number, repeat=repeat, min_repeat_ms=0)
        self._function(*args)
        return list(evaluator(*args).results)

    def report(self) -> Report:
        plan = self.plan
        staged = hasattr(plan, "stages")
        report = Report(
            model=self.graph.name,
            target=self.target,
            ops=self.graph.op_count(),
            ops_executed=self.graph.op_count(executed=True),
            tes=self.program.te_count(),
            regions=sum(not isinstance(r, LoopRegion) for r in self.program.regions) if staged else plan.region_count,
            loops=sum(isinstance(r, LoopRegion) for r in self.program.regions) if staged else plan.loop_count,
            kernels=self.kernel_count,
            weight_bytes=sum(v.nbytes for _, v in plan.weights),
            arena_bytes=sum(size * np.dtype(d).itemsize for d, size in plan.arena_sizes.items()),
            compile_seconds=dict(self._compile_seconds),
            run_seconds=self._last_run,
        )
        if staged:
            from codegen.transform import LEVEL_NAMES

            report.extra["opt level"] = f"O{plan.level}: {LEVEL_NAMES[plan.level]}"
            launches = plan.kernel_count(executed=True)
            report.extra["launches"] = f"{launches} kernel launch{'es' if launches != 1 else ''} per inference"
            report.extra.update({f"transform {k + 1}": line for k, line in enumerate(plan.transforms)})
            report.extra.update({f"on chip {k + 1}": note for k, note in enumerate(plan.on_chip_notes)})
            if plan.partition is not None:
                report.extra["partition"] = str(plan.partition).replace("\n", "\n" + " " * 15)
            report.extra["stages"] = f"{plan.stage_count()} ({plan.stage_count(executed=True)} executed), " \
                                     f"{plan.threads} threads per block, up to {plan.max_tiles} tiles per stage"
            report.extra["grid barriers"] = f"{plan.barrier_count()} ({plan.barrier_count(executed=True)} executed)"
            if self.grid is not None:
                report.extra["grid"] = f"{self.grid} blocks"
        return report


def compile(graph: Graph, target: str = "llvm", device: str | None = None,
            threads: int | None = None, opt_level: int | None = None) -> CompiledModel:
    """Compile a whole model for ``target``.

    - ``"llvm"``: one CPU function, with the CPU's own schedules (the fast CPU path).
    - ``"cuda"``: ONE persistent, grid-synchronized CUDA kernel. Compiling needs nvcc, not a
      GPU: ``.source``, ``.resources`` and ``.report()`` work anywhere; running needs a GPU.
      ``device`` names the device model that sizes the grid when no GPU is present
      (``"h200"`` by default, or ``"a100"``).
    - ``"llvm-persistent"``: the CUDA kernel's staged program (its stages, tiles, barriers
      and scratch layout) run on the CPU, block after block — to check that program anywhere.

    ``threads`` is the thread-block size of the persistent kernel (256 by default).

    ``opt_level`` (persistent targets; the paper's ablation, ``codegen.transform``): 0 one
    kernel per TE, 1 + horizontal fusion and the LSTM wavefront, 2 + vertical inlining,
    3 + global sync (one kernel per subprogram of ``analysis.partition``, a grid barrier
    between stages), 4 + post-optimizations (barriers only where data crosses blocks; default).
    """
    if not isinstance(graph, Graph):
        raise SouffleError(f"souffle.compile takes a souffle Graph, got {type(graph).__name__}")
    if target not in TARGETS:
        raise TargetError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    if graph.weights is None:
        raise SouffleError(f"graph {graph.name!r} has no weights; build it with arrays or call .with_weights(...)")
    if target == "llvm":
        if opt_level is not None:
            raise TargetError("opt levels are the persistent kernel's (targets cuda and llvm-persistent); "
                              "target 'llvm' has its own CPU pipeline")
        return _compile_llvm(graph)
    from codegen.schedule import THREADS
    from codegen.transform import DEFAULT_OPT_LEVEL, check_level

    threads = THREADS if threads is None else threads
    if not (isinstance(threads, int) and 32 <= threads <= 1024 and threads % 32 == 0):
        raise TargetError(f"threads must be a multiple of 32 from 32 to 1024, got {threads!r}")
    level = check_level(DEFAULT_OPT_LEVEL if opt_level is None else opt_level)
    return _compile_persistent(graph, target, device, threads, level)


def _compile_llvm(graph: Graph) -> CompiledModel:
    from codegen import llvm
    from codegen.schedule_cpu import schedule_cpu
    from codegen.stitch import stitch

    seconds: dict[str, float] = {}
    prepared = timed(seconds, "prepare", llvm.prepare_graph, graph)
    program = timed(seconds, "lower", lower_graph, prepared)
    stitched = timed(seconds, "schedule+stitch", stitch, program, schedule_cpu)
    executable = timed(seconds, "build", llvm.build, stitched.func)
    return CompiledModel(graph, "llvm", program, stitched, executable, seconds)


def staged_program(program: TEProgram, gpu: bool, threads: int, level: int = 4, device: str | None = None):
    """The persistent kernel's program: stages tiled, then what synchronizes them (per opt
    level: a kernel per stage, a barrier per stage, or barriers only where data crosses
    blocks), then the kernels the device forces (``analysis.partition``), then the arena."""
    from analysis.partition import partition
    from codegen.staging import (
        barrier_per_stage,
        keep_weights_on_chip,
        kernel_per_stage,
        place_barriers,
        plan_arena,
        split_kernels,
        stage_program,
    )

    staged = stage_program(program, gpu, threads, epilogues=level >= 3)
    staged.level = level
    if level <= 2:
        return plan_arena(kernel_per_stage(staged, f"O{level}: one kernel per TE"))
    if level == 3:
        staged = barrier_per_stage(staged, "O3: every stage boundary synchronizes the grid")
    else:
        staged = place_barriers(staged)
    model = gpu_device_model(device or "h200")
    staged.partition = partition(staged, model)
    staged = split_kernels(staged, staged.partition.splits)
    if level >= 4:
        staged = keep_weights_on_chip(staged, model)
    return plan_arena(staged)


def gpu_device_model(name: str):
    """The GPU device model ``name``; the persistent kernel's grid and partition are sized by one."""
    from analysis.device import get_device

    model = get_device(name)
    if model.kind != "gpu":
        raise TargetError(f"the persistent kernel needs a GPU device model, not {model.name!r}; use 'h200' or 'a100'")
    return model


def _compile_persistent(graph: Graph, target: str, device: str | None, threads: int, level: int) -> CompiledModel:
    from codegen import llvm
    from codegen.transform import optimize

    seconds: dict[str, float] = {}
    optimized = timed(seconds, "lower+transform", optimize, graph, level)
    program = optimized.program
    staged = timed(seconds, "stage", staged_program, program, target == "cuda", threads, level, device)
    staged.transforms = optimized.log
    if target == "cuda":
        from souffle.cuda_model import build_cuda

        return build_cuda(graph, program, staged, device, seconds)
    grid = min(staged.max_tiles, PERSISTENT_CPU_GRID)
    executable = timed(seconds, "build", llvm.build, llvm.staged_function(staged, grid))
    model = CompiledModel(graph, target, program, staged, executable, seconds)
    model.grid = grid
    model.kernel_count = staged.kernel_count()
    return model


def timed(seconds: dict[str, float], stage: str, fn, *args):
    """Run one pipeline stage, recording its wall time under ``stage``."""
    start = time.perf_counter()
    result = fn(*args)
    seconds[stage] = time.perf_counter() - start
    return result
