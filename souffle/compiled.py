"""What ``souffle.compile`` returns: a compiled model (numpy in, numpy out) and its report.

Everything a model knows about its compilation comes from the pipeline run (``passes``): the
TE program and the plan (the stitched CPU function or the persistent kernel's staged program)
are the passes' IRs, the compile times are the passes' times, and the report's transforms,
on-chip weights and partition are what the passes said they did.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from souffle.errors import InputError
from souffle.graph import Graph
from souffle.passes import PipelineRun


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
            "compile        " + _wrapped([f"{k} {v:.2f} s" for k, v in c.items()]) + f" (total {sum(c.values()):.2f} s)",
        ]
        if self.run_seconds is not None:
            lines.append(f"run            {self.run_seconds * 1e3:.3f} ms")
        lines += [f"{k:<14} {v}" for k, v in self.extra.items()]
        return "\n".join(lines)


def check_count(value, name: str, minimum: int):
    """Refuse a benchmark's count of runs below ``minimum``: zero timed runs leave no time to report."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _wrapped(parts: list[str], width: int = 80) -> str:
    """``parts`` joined by ", ", continued on lines indented under the report's values."""
    lines = [parts[0]] if parts else [""]
    for part in parts[1:]:
        if len(lines[-1]) + len(part) + 2 > width:
            lines[-1] += ","
            lines.append(part)
        else:
            lines[-1] += ", " + part
    return ("\n" + " " * 15).join(lines)


class CompiledModel:
    """A compiled model: numpy in, numpy out.

    ``passes`` is the pipeline run that made it; ``program`` the global TE program as compiled
    (after the target's transforms); ``plan`` what was compiled, taking its buffers in the order
    inputs, weights, outputs, scratch arenas.
    """

    def __init__(self, graph: Graph, passes: PipelineRun, plan, grid: int | None = None):
        self.graph = graph
        self.passes = passes
        self.target = passes.options.target
        self.program = passes.irs["te"]
        self.plan = plan
        self.kernel_count = plan.kernel_count()
        self.grid = grid
        self._last_run: float | None = None

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.graph.inputs]

    @property
    def transforms(self) -> list[str]:
        """What the transformations did, one line each ("pass: what")."""
        return self.passes.notes("transform", prefixed=True)

    @property
    def on_chip_notes(self) -> list[str]:
        """The weights kept on chip across a loop, and why the others are not."""
        return self.passes.notes("on chip")

    def _checked_inputs(self, inputs: dict) -> list[np.ndarray]:
        expected = {s.name: s for s in self.graph.inputs}
        if not isinstance(inputs, Mapping):
            raise InputError(
                f"{self.graph.name}: run takes a dict of the named inputs {list(expected)}, not a "
                f"{type(inputs).__name__}; m(x) takes the inputs as positional arrays"
            )
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

    def run(self, inputs: dict) -> list[np.ndarray]:
        """Run on named inputs; outputs in the graph's output order."""
        raise NotImplementedError

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

    def report(self) -> Report:
        plan, passes = self.plan, self.passes
        report = Report(
            model=self.graph.name,
            target=self.target,
            ops=self.graph.op_count(),
            ops_executed=self.graph.op_count(executed=True),
            tes=self.program.te_count(),
            regions=self.program.region_count(),
            loops=self.program.loop_count(),
            kernels=self.kernel_count,
            weight_bytes=sum(v.nbytes for _, v in plan.weights),
            arena_bytes=sum(size * np.dtype(d).itemsize for d, size in plan.arena_sizes.items()),
            compile_seconds=passes.seconds(),
            run_seconds=self._last_run,
        )
        level = passes.options.opt_level
        if level is not None:
            report.extra["opt level"] = f"O{level}: {passes.pipeline.levels[level]}"
        report.extra.update({f"weights note {k + 1}": note for k, note in enumerate(self.graph.weight_notes)})
        report.extra.update({f"transform {k + 1}": line for k, line in enumerate(self.transforms)})
        report.extra.update({f"on chip {k + 1}": note for k, note in enumerate(self.on_chip_notes)})
        report.extra.update({"partition": note.replace("\n", "\n" + " " * 15) for note in passes.notes("partition")})
        report.extra.update(plan.summary())
        if self.grid is not None:
            report.extra["grid"] = f"{self.grid} blocks"
        return report


class CpuModel(CompiledModel):
    """A model compiled to one CPU function (target llvm, or the staged program on the CPU):
    one function call per run."""

    def __init__(self, graph: Graph, passes: PipelineRun):
        import tvm

        module = passes.ir
        super().__init__(graph, passes, module.plan, module.grid)
        self._executable = module.executable
        self._device = tvm.cpu()
        self._function = module.executable["main"]
        self._weights = [tvm.runtime.tensor(value.reshape(-1), self._device) for _, value in self.plan.weights]
        self._arenas = [tvm.runtime.empty((max(size, 1),), dtype, self._device)
                        for dtype, size in self.plan.arena_sizes.items()]

    def _arguments(self, inputs: dict):
        import tvm

        args = [tvm.runtime.tensor(a, self._device) for a in self._checked_inputs(inputs)]
        outputs = [tvm.runtime.empty((s.size,), s.dtype, self._device) for s in self.plan.outputs]
        return args + self._weights + outputs + self._arenas, outputs

    def run(self, inputs: dict) -> list[np.ndarray]:
        args, outputs = self._arguments(inputs)
        start = time.perf_counter()
        self._function(*args)
        self._last_run = time.perf_counter() - start
        return [o.numpy().reshape(s.shape) for o, s in zip(outputs, self.plan.outputs)]

    def benchmark(self, inputs: dict, repeat: int = 10, number: int = 1) -> list[float]:
        """Seconds per run, ``repeat`` samples after one warm-up, timed by TVM's evaluator."""
        check_count(repeat, "repeat", 1)
        check_count(number, "number", 1)
        args, _ = self._arguments(inputs)
        evaluator = self._executable.mod.time_evaluator("main", self._device, number=number, repeat=repeat,
                                                        min_repeat_ms=0)
        self._function(*args)
        return list(evaluator(*args).results)
