"""The systems ``compare.py`` runs, each built from the same souffle graph and weights.

A system is one function registered with ``@system(name)``: given the model case and the run
options, it compiles (or loads) the model and returns a ``Built``: a callable from the graph's
named numpy inputs to its numpy outputs (graph output order), the compile seconds, and how many
kernels one inference invokes. TVM Relax and ONNX Runtime read the model through
``souffle.onnx_export``; PyTorch eager and torch.compile run the PyTorch reference module that
every souffle model is checked against. So every system computes the same thing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import souffle
from souffle import models
from souffle.errors import TargetError


@dataclass
class Case:
    """One model at one config: its graph (with weights), inputs and PyTorch outputs."""

    model: str
    config: str
    graph: object
    inputs: dict[str, np.ndarray]
    _onnx: object = None

    @classmethod
    def build(cls, model: str, config: str) -> Case:
        return cls(model, config, models.build(model, config=config), models.make_inputs(model, config=config))

    @property
    def onnx(self):
        """The graph as ONNX, exported once per case."""
        if self._onnx is None:
            from souffle.onnx_export import to_onnx

            self._onnx = to_onnx(self.graph)
        return self._onnx

    def torch_function(self):
        """The PyTorch reference: named numpy inputs -> outputs in graph order."""
        return models.reference(self.model, self.config, self.graph.weights)


@dataclass
class Options:
    target: str = "llvm"
    trials: int = 8
    work_dir: Path = Path("benchmarks/work")


@dataclass
class Built:
    run: Callable[[dict[str, np.ndarray]], list[np.ndarray]]
    compile_s: float
    launches: int | None
    launches_how: str
    static_bytes: int | None = None
    static_bytes_how: str = ""
    details: dict = field(default_factory=dict)


SYSTEMS: dict[str, Callable[[Case, Options], Built]] = {}
TARGETS: dict[str, tuple[str, ...]] = {}


def system(name: str, targets: tuple[str, ...] = ("llvm",)):
    """Register a system's builder for the targets it runs on."""

    def decorate(build: Callable[[Case, Options], Built]):
        SYSTEMS[name] = build
        TARGETS[name] = targets
        return build

    return decorate


def default_systems(target: str, config: str) -> list[str]:
    """Every system that runs on ``target``. The CPU run of souffle's persistent GPU program
    (blocks one after another on one core) is included only at the tiny config: at paper size it
    takes about a minute per BERT inference and says nothing about either device."""
    names = [n for n, targets in TARGETS.items() if target in targets]
    if config != "tiny":
        names = [n for n in names if not n.startswith("souffle-persistent")]
    return names


# -- souffle -------------------------------------------------------------------------------------

def _souffle_o4_bytes(graph) -> int:
    """Global-memory bytes of souffle's O4 persistent GPU program (the static traffic model)."""
    from codegen.traffic import memory_traffic
    from souffle.compiler import run_passes

    traffic = memory_traffic(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir)
    return traffic.read_bytes + traffic.write_bytes


@system("souffle", targets=("llvm",))
def souffle_llvm(case: Case, options: Options) -> Built:
    """Souffle's CPU backend: the whole model as one LLVM function."""
    start = time.perf_counter()
    compiled = souffle.compile(case.graph, target="llvm")
    return Built(compiled.run, time.perf_counter() - start, compiled.kernel_count, "functions per inference",
                 _souffle_o4_bytes(case.graph), "static model of the O4 GPU kernel's global-memory accesses")


def _souffle_persistent(level: int):
    def build(case: Case, options: Options) -> Built:
        start = time.perf_counter()
        compiled = souffle.compile(case.graph, target="llvm-persistent", opt_level=level)
        seconds = time.perf_counter() - start
        from codegen.traffic import memory_traffic

        traffic = memory_traffic(compiled.plan)
        return Built(compiled.run, seconds, compiled.plan.kernel_count(executed=True), "kernel launches per inference",
                     traffic.read_bytes + traffic.write_bytes, "static model of the kernels' global-memory accesses")

    build.__doc__ = f"Souffle's persistent GPU program at O{level}, run on the CPU (blocks one after another)."
    return build


for _level in (4, 0):
    system(f"souffle-persistent-O{_level}", targets=("llvm",))(_souffle_persistent(_level))


# -- TVM Relax: untuned, and tuned by MetaSchedule ("Ansor") -----------------------------------

def host_target():
    import tvm

    from codegen.llvm import host_target as souffle_host_target

    target = souffle_host_target()
    return tvm.target.Target({**dict(target.export()), "num-cores": os.cpu_count() or 1})


def relax_module(case: Case):
    """The case's model as a Relax IRModule, weights bound as constants (as souffle's are)."""
    from tvm.relax.frontend.onnx import from_onnx

    return from_onnx(case.onnx, keep_params_in_input=False)


def _fast_builder_init():
    """Register a MetaSchedule build function in each builder worker. TVM's default one imports
    ``tvm.s_tir.tensor_intrin`` in every fresh worker, which takes about 50 s on this 2-core machine
    and made every trial of a first attempt time out; LLVM candidates do not need those intrinsics."""
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    def build(mod, target, _params):
        return tvm.compile(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target).mod

    tvm.register_global_func("souffle.bench.llvm_build", build, override=True)


# The evolutionary search's population. TVM's default, 512, took 11 minutes on this 2-core machine to
# sample for one kernel of the unrolled paper LSTM (the concatenation of its 100 steps' outputs);
# at a budget of 8 trials per kernel, 64 candidates per generation are plenty to pick from.
POPULATION = 64


def _stop_when_exhausted():
    """MetaSchedule's evolutionary search, finished once it has no new candidate to offer.

    In TVM 0.27 the evolutionary search answers a kernel whose design space holds fewer distinct
    schedules than the trial budget with an empty batch instead of "finished", and the task
    scheduler asks again forever (the tiny LSTM's slice kernels hung the first tiny run).
    """
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.search_strategy import PySearchStrategy

    @derived_object
    class StopWhenExhausted(PySearchStrategy):
        def __init__(self, inner=None):
            self.inner = inner or ms.search_strategy.EvolutionarySearch(population_size=POPULATION)

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
            self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)

        def post_tuning(self):
            self.inner.post_tuning()

        def generate_measure_candidates(self):
            candidates = self.inner.generate_measure_candidates()
            return candidates if candidates is not None and len(candidates) else None

        def notify_runner_results(self, measure_candidates, results):
            self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return StopWhenExhausted(self.inner.clone())

    return StopWhenExhausted()


def _fused(mod, target):
    """Relax's default operator fusion (FuseOps + FuseTIR): the kernels MetaSchedule tunes."""
    import tvm
    from tvm import relax

    with target:
        return tvm.transform.Sequential([
            relax.transform.DecomposeOpsForInference(),
            relax.transform.CanonicalizeBindings(),
            relax.get_pipeline("zero"),
        ])(mod)


def tune(mod, target, work_dir: Path, trials_per_task: int) -> dict:
    """Tune every fused kernel of ``mod`` with MetaSchedule, ``trials_per_task`` trials each.

    The database lives in ``work_dir``; a finished tuning leaves ``tuned.json`` there, and a rerun
    with the same budget and population reuses the database instead of tuning again.
    """
    import cloudpickle
    import tvm.s_tir.meta_schedule as ms

    marker = work_dir / "tuned.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if (done.get("trials_per_task"), done.get("population")) == (trials_per_task, POPULATION):
            return {**done, "reused": True}
    work_dir.mkdir(parents=True, exist_ok=True)
    tasks = ms.relax_integration.extract_tasks(mod, target)
    cloudpickle.register_pickle_by_value(__import__(__name__))
    start = time.perf_counter()
    ms.relax_integration.tune_relax(
        mod, {}, target, str(work_dir), max_trials_global=trials_per_task * len(tasks),
        max_trials_per_task=trials_per_task, num_trials_per_iter=min(trials_per_task, 16),
        builder=ms.builder.LocalBuilder(f_build="souffle.bench.llvm_build", initializer=_fast_builder_init,
                                        timeout_sec=120),
        runner=ms.runner.LocalRunner(timeout_sec=120), strategy=_stop_when_exhausted(), seed=0,
    )
    records = work_dir / "database_tuning_record.json"
    measured = sum(1 for line in records.read_text().splitlines() if line.strip()) if records.exists() else 0
    done = {"trials_per_task": trials_per_task, "population": POPULATION, "tasks": len(tasks),
            "budget": trials_per_task * len(tasks),
            "trials": measured,
            "tuning_s": round(time.perf_counter() - start, 1), "task_names": [t.task_name for t in tasks]}
    marker.write_text(json.dumps(done, indent=1) + "\n")
    return {**done, "reused": False}


def _relax_runner(executable, case: Case) -> Built:
    import tvm
    from tvm import relax

    device = tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    names = [spec.name for spec in case.graph.inputs]

    def run(inputs):
        result = vm["main"](*[tvm.runtime.tensor(inputs[n], device) for n in names])
        outputs = list(result) if isinstance(result, (tuple, list, tvm.ir.Array)) else [result]
        return [o.numpy() for o in outputs]

    launches, touched = _relax_kernel_calls(executable, case)
    return Built(run, 0.0, launches, "kernel functions invoked per inference (VM instrument)", touched,
                 "sum of every kernel call's argument bytes")


def _relax_kernel_calls(executable, case: Case) -> tuple[int, int]:
    """Kernel functions one inference invokes, and the bytes of their arguments, counted by the
    VM's call instrument (VM builtins such as allocation are not kernels)."""
    import tvm
    from tvm import relax

    device = tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    calls = {"count": 0, "bytes": 0}

    def instrument(func, symbol, before_run, ret_value, *args):
        if before_run and not str(symbol).startswith("vm."):
            calls["count"] += 1
            calls["bytes"] += sum(a.numpy().nbytes for a in args if isinstance(a, tvm.runtime.Tensor))
        return 0

    vm.set_instrument(instrument)
    vm["main"](*[tvm.runtime.tensor(case.inputs[s.name], device) for s in case.graph.inputs])
    return calls["count"], calls["bytes"]


@system("tvm-relax", targets=("llvm",))
def relax_untuned(case: Case, options: Options) -> Built:
    """TVM Relax's default pipeline, no tuning: the same fused kernels MetaSchedule tunes, with
    their default (unscheduled) loop nests."""
    import tvm

    target = host_target()
    start = time.perf_counter()
    executable = tvm.compile(_fused(relax_module(case), target), target=target)
    built = _relax_runner(executable, case)
    built.compile_s = time.perf_counter() - start
    return built


@system("metaschedule", targets=("llvm",))
def relax_metaschedule(case: Case, options: Options) -> Built:
    """Ansor's successor: Relax's fused kernels, each tuned by MetaSchedule for ``trials`` trials."""
    import tvm
    from tvm import relax

    target = host_target()
    start = time.perf_counter()
    fused = _fused(relax_module(case), target)
    work_dir = Path(options.work_dir) / f"metaschedule-{case.model}-{case.config}-{options.target}"
    tuning = tune(fused, target, work_dir, options.trials)
    with target:
        tuned = relax.transform.MetaScheduleApplyDatabase(str(work_dir))(fused)
    executable = tvm.compile(tuned, target=target)
    built = _relax_runner(executable, case)
    built.compile_s = time.perf_counter() - start
    built.details = {"tuning": tuning, "work_dir": str(work_dir)}
    return built


# -- PyTorch ---------------------------------------------------------------------------------------

NOT_KERNELS = frozenset({"aten::lift_fresh", "aten::detach", "aten::to", "aten::resolve_conj", "aten::resolve_neg",
                         "aten::alias", "aten::empty", "aten::empty_strided"})


def _torch_kernel_calls(run: Callable, inputs) -> tuple[int, int]:
    """Kernels one call runs, from torch.profiler: each outermost ATen op run eagerly, and each
    call a compiled graph makes (Inductor's generated C++ kernels, profiled by name with
    ``cpp.enable_kernel_profile``, and the ATen ops it calls out to: GEMMs, convolutions). Numpy
    conversion and allocation are not kernels. Also returns how many compiled graphs ran."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run(inputs)

    def compiled_call(event) -> bool:
        return event.cpu_parent is not None and event.cpu_parent.name.startswith("## Call CompiledFxGraph")

    def outermost_op(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::", "## Call CompiledFxGraph")):
                return False
            parent = parent.cpu_parent
        return event.name.startswith("aten::")

    events = profile.events()
    kernels = sum(1 for e in events if e.name not in NOT_KERNELS and (compiled_call(e) or outermost_op(e)))
    return kernels, sum(1 for e in events if e.name.startswith("## Call CompiledFxGraph"))


@system("pytorch", targets=("llvm",))
def torch_eager(case: Case, options: Options) -> Built:
    """PyTorch eager on the reference module."""
    start = time.perf_counter()
    run = case.torch_function()
    seconds = time.perf_counter() - start
    return Built(run, seconds, _torch_kernel_calls(run, case.inputs)[0], "ATen ops run per inference (profiler)")


@system("torch.compile", targets=("llvm",))
def torch_compiled(case: Case, options: Options) -> Built:
    """torch.compile (Inductor, default mode on the CPU) on the reference function."""
    import torch
    import torch._inductor.config

    torch._inductor.config.cpp.enable_kernel_profile = True
    compiled = torch.compile(case.torch_function())
    start = time.perf_counter()
    compiled(case.inputs)
    seconds = time.perf_counter() - start
    kernels, graphs = _torch_kernel_calls(compiled, case.inputs)
    # Dynamo leaves what it cannot trace (torch.nn.LSTM) to eager PyTorch: say so.
    return Built(compiled, seconds, kernels, "Inductor kernels and ATen ops run per inference (profiler)",
                 details={"compiled_graphs_per_inference": graphs})


# -- ONNX Runtime ----------------------------------------------------------------------------------

@system("onnxruntime", targets=("llvm",))
def onnxruntime_cpu(case: Case, options: Options) -> Built:
    """ONNX Runtime, CPU execution provider, all graph optimizations."""
    import onnxruntime as ort

    start = time.perf_counter()
    session = ort.InferenceSession(case.onnx.SerializeToString(), providers=["CPUExecutionProvider"])
    seconds = time.perf_counter() - start
    names = [o.name for o in session.get_outputs()]

    def run(inputs):
        return session.run(names, inputs)

    return Built(run, seconds, _onnxruntime_nodes(case), "graph nodes executed per inference (ORT profiler)")


def _onnxruntime_nodes(case: Case) -> int:
    import onnxruntime as ort

    settings = ort.SessionOptions()
    settings.enable_profiling = True
    session = ort.InferenceSession(case.onnx.SerializeToString(), settings, providers=["CPUExecutionProvider"])
    session.run(None, case.inputs)
    path = session.end_profiling()
    try:
        events = json.loads(Path(path).read_text())
    finally:
        os.remove(path)
    return sum(1 for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))


def build(name: str, case: Case, options: Options) -> Built:
    """Build system ``name`` for ``case``; a system that does not run on the target is refused."""
    if name not in SYSTEMS:
        raise KeyError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    if options.target not in TARGETS[name]:
        raise TargetError(f"system {name!r} does not run on target {options.target!r} "
                          f"(it runs on {', '.join(TARGETS[name])})")
    return SYSTEMS[name](case, options)
