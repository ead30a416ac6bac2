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
from souffle.lower import TEProgram, lower_graph

TARGETS = ("llvm", "cuda")


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
    """A compiled model: numpy in, numpy out. One kernel (one function call) per run."""

    def __init__(self, graph: Graph, target: str, program: TEProgram, stitched, executable, compile_seconds):
        import tvm

        self.graph = graph
        self.target = target
        self.program = program
        self.stitched = stitched
        self._executable = executable
        self._device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self._function = executable["main"]
        self._weights = [tvm.runtime.tensor(value.reshape(-1), self._device) for _, value in stitched.weights]
        self._arenas = [tvm.runtime.empty((max(size, 1),), dtype, self._device) for dtype, size in stitched.arena_sizes.items()]
        self._compile_seconds = compile_seconds
        self._last_run: float | None = None
        self.kernel_count = 1

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
        outputs = [tvm.runtime.empty((s.size,), s.dtype, self._device) for s in self.stitched.outputs]
        return args + self._weights + outputs + self._arenas, outputs

    def run(self, inputs: dict) -> list[np.ndarray]:
        """Run on named inputs; outputs in the graph's output order."""
        args, outputs = self._arguments(inputs)
        start = time.perf_counter()
        self._function(*args)
        self._last_run = time.perf_counter() - start
        return [o.numpy().reshape(s.shape) for o, s in zip(outputs, self.stitched.outputs)]

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
        st = self.stitched
        return Report(
            model=self.graph.name,
            target=self.target,
            ops=self.graph.op_count(),
            ops_executed=self.graph.op_count(executed=True),
            tes=self.program.te_count(),
            regions=st.region_count,
            loops=st.loop_count,
            kernels=self.kernel_count,
            weight_bytes=sum(v.nbytes for _, v in st.weights),
            arena_bytes=sum(size * np.dtype(d).itemsize for d, size in st.arena_sizes.items()),
            compile_seconds=dict(self._compile_seconds),
            run_seconds=self._last_run,
        )


def compile(graph: Graph, target: str = "llvm") -> CompiledModel:  # noqa: A001 (the public name)
    """Compile a whole model to one kernel for ``target`` ("llvm" now; "cuda" with the GPU backend)."""
    if not isinstance(graph, Graph):
        raise SouffleError(f"souffle.compile takes a souffle Graph, got {type(graph).__name__}")
    if target not in TARGETS:
        raise TargetError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    if target == "cuda":
        raise TargetError("target 'cuda' is not implemented yet; use target='llvm'")
    if graph.weights is None:
        raise SouffleError(f"graph {graph.name!r} has no weights; build it with arrays or call .with_weights(...)")
    from codegen import llvm
    from codegen.schedule_cpu import schedule_cpu
    from codegen.stitch import stitch

    seconds: dict[str, float] = {}
    prepared = _timed(seconds, "prepare", llvm.prepare_graph, graph)
    program = _timed(seconds, "lower", lower_graph, prepared)
    stitched = _timed(seconds, "schedule+stitch", stitch, program, schedule_cpu)
    executable = _timed(seconds, "build", llvm.build, stitched)
    return CompiledModel(graph, target, program, stitched, executable, seconds)


def _timed(seconds: dict[str, float], stage: str, fn, *args):
    """Run one pipeline stage, recording its wall time under ``stage``."""
    start = time.perf_counter()
    result = fn(*args)
    seconds[stage] = time.perf_counter() - start
    return result
