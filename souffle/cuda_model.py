"""``souffle.compile(graph, target="cuda")``: the persistent kernel (or, below O3 or where the
partition splits, its kernels), built and (on a GPU) run.

Building needs TVM and nvcc, not a GPU: the kernel's source, its registers and shared memory
(from ptxas) and the co-resident grid on the device model are known at compile time, and a
kernel that cannot be co-resident is refused then. Running loads the cubin through
cuda-python and launches it cooperatively, sizing the grid with the driver's occupancy API.
"""

from __future__ import annotations

import functools

from souffle import recipe
from souffle.compiled import CompiledModel, Report, check_count
from souffle.passes import PipelineRun
from souffle.runtime.artifact import KernelArtifact, Launcher, TensorSlot


class CudaModel(CompiledModel):
    """The model's CUDA kernels: ``.source`` and ``.report()`` anywhere, ``m(x)`` on a GPU.

    ``resources``, ``occupancy`` and ``argument_order`` are those of the kernel with the most
    registers (the only one at O3 and O4 when the partition does not split); ``kernel_resources``,
    ``kernel_occupancy`` and ``argument_orders`` have every kernel's.
    """

    def __init__(self, graph, passes: PipelineRun):
        from codegen.cuda import kernel_count

        kernels = passes.ir
        staged = kernels.plan.staged
        resources = kernels.binary.resources
        widest = max(resources, key=lambda name: resources[name].registers)
        super().__init__(graph, passes, staged, min(kernels.occupancy[widest].grid, staged.max_tiles))
        self.source = kernels.binary.source.text
        self.device_model = passes.options.device
        self.cubin = kernels.binary.cubin
        self.kernel_plan = kernels.plan
        self.kernel_resources = resources
        self.kernel_occupancy = kernels.occupancy
        self.argument_orders = kernels.argument_orders
        self.resources = resources[widest]
        self.occupancy = kernels.occupancy[widest]
        self.argument_order = kernels.argument_orders[widest]
        self.kernel_count = kernel_count(self.source)
        self._gpu = None

    @functools.cached_property
    def latency(self):
        """The static latency model's estimate (``analysis.latency``) of the kernels on the device
        model they were compiled for, each kernel's grid from its ptxas figures."""
        from codegen.latency import latency_estimate

        occupancies = [self.kernel_occupancy[name] for name in self.kernel_plan.kernel_names]
        return latency_estimate(self.plan, self.device_model, occupancies, self.traffic, self.behind_l2)

    @functools.cached_property
    def traffic(self):
        """``codegen.traffic.memory_traffic`` of the kernels' program: counted once, for the
        estimate and for whoever else asks (isl counts take seconds on paper Swin)."""
        from codegen.traffic import memory_traffic

        return memory_traffic(self.plan)

    @functools.cached_property
    def behind_l2(self):
        """``codegen.traffic.l2_traffic`` of ``traffic`` behind the device model's L2: the DRAM
        bytes the estimate charges each stage."""
        from codegen.traffic import l2_traffic

        return l2_traffic(self.plan, self.device_model.l2_bytes, self.traffic)

    def artifact(self, config: str | None = None, seed: int = 0, archs: tuple[str, ...] = ()) -> KernelArtifact:
        """The kernel as a TVM-free artifact (``souffle.runtime.artifact``), with cubins for
        ``archs`` besides the device model's; ``config`` and ``seed`` name the model's own
        weights (when the graph came from ``souffle.models``) so the artifact need not carry them.
        A weight the model's initialisation does not make (a constant an importer folded: Swin's
        shifted-window masks) is carried in its recipe, since a GPU machine cannot import again."""
        from souffle.runtime.cuda import compile_cubin

        staged = self.plan
        cubins = {self.device_model.arch: self.cubin}
        kernels = tuple(self.argument_orders)
        cubins.update({arch: compile_cubin(self.source, arch, kernels)[0] for arch in archs if arch not in cubins})
        constants = self._folded_constants(config, seed)
        return KernelArtifact(
            model=self.graph.name, config=config, seed=seed, threads=staged.threads,
            kernels={name: list(order) for name, order in self.argument_orders.items()},
            launches=_launches_json(self.kernel_plan.launches),
            inputs=[TensorSlot(s.name, b.name, tuple(s.shape), s.dtype) for s, b in zip(self.graph.inputs, staged.input_buffers)],
            outputs=[TensorSlot(s.name, b.name, tuple(s.shape), s.dtype) for s, b in zip(staged.outputs, staged.output_buffers)],
            weights=[{"buffer": b.name, "recipe": recipe.with_constants(staged.weight_recipes[spec.name], constants),
                      "shape": list(spec.shape), "dtype": spec.dtype}
                     for b, (spec, _) in zip(staged.weight_buffers, staged.weights)],
            arenas={buffer.name: (dtype, staged.arena_sizes[dtype]) for dtype, buffer in staged.arena_buffers.items()},
            source=self.source, cubins=cubins)

    def _folded_constants(self, config: str | None, seed: int) -> dict:
        """The graph's weights that ``config``'s seeded initialisation does not make."""
        if config is None:
            return {}
        from souffle import models

        made = models.get(self.graph.name).init_weights(models.config(self.graph.name, config), seed)
        return {name: value for name, value in self.graph.weights.items() if name not in made}

    def _device(self):
        """The device the kernels run on: None for the first GPU."""
        return None

    def _launcher(self) -> Launcher:
        if self._gpu is None:
            self._gpu = Launcher(self.artifact(), model_weights=self.graph.weights, device=self._device())
            self.grid = self._gpu.grid
        return self._gpu

    def run(self, inputs: dict):
        import time

        arrays = self._shaped_inputs(inputs)  # before the launcher: bad inputs are refused without a GPU
        launcher = self._launcher()
        start = time.perf_counter()
        outputs = launcher.run(arrays)
        self._last_run = time.perf_counter() - start
        return outputs

    def benchmark(self, inputs: dict, repeat: int = 50, number: int = 1, warmup: int = 5,
                  graph: bool = False) -> list[float]:
        """Seconds per inference from CUDA events, ``repeat`` runs after ``warmup``; with
        ``graph``, each a replay of the inference captured once in a CUDA graph, which takes
        the host's cost of launching out of a small model's time."""
        arrays = self._shaped_inputs(inputs)
        check_count(repeat, "repeat", 1)
        check_count(warmup, "warmup", 0)
        return self._launcher().benchmark(arrays, repeat=repeat, warmup=warmup, graph=graph)

    def _shaped_inputs(self, inputs: dict) -> list:
        """The inputs in the graph's order and shapes, as the launcher takes them."""
        return [array.reshape(spec.shape) for array, spec in zip(self._checked_inputs(inputs), self.graph.inputs)]

    def report(self) -> Report:
        report = super().report()
        r = self.resources
        functions = "1 __global__ function" if self.kernel_count == 1 else \
            f"{self.kernel_count} __global__ functions, the largest"
        dynamic = max(launch.dynamic_shared for launch in self.kernel_plan.kernel_launches())
        # ptxas' stack frame (local memory: an array nvcc could not keep in registers, and the
        # spills) only where it holds more than the spills, a cost to look into like a spill
        stack = max(k.stack_bytes - k.spill_bytes for k in self.kernel_resources.values())
        report.extra["cuda"] = (f"{functions}, {r.arch}: {r.registers} registers/thread, "
                                f"{r.shared_bytes} B static + {dynamic} B dynamic shared memory, "
                                f"{r.spill_bytes} B spilled" + (f", {stack} B more of local memory" if stack > 0 else ""))
        report.extra.update({f"ptxas {k + 1}": note for k, note in enumerate(self.passes.notes("ptxas"))})
        report.extra.update({f"database {k + 1}": note for k, note in enumerate(self.passes.notes("database"))})
        report.extra["co-residency"] = str(self.occupancy)
        report.extra.update(self.latency.summary())
        return report


def _launches_json(launches) -> list[dict]:
    from codegen.cuda import HostLoop

    out = []
    for launch in launches:
        if isinstance(launch, HostLoop):
            out.append({"loop": launch.counter, "trips": launch.trips, "body": _launches_json(launch.body)})
        else:
            out.append({"kernel": f"{launch.kernel}_kernel", "cooperative": launch.cooperative,
                        "max_tiles": launch.max_tiles, "dynamic_shared": launch.dynamic_shared,
                        "min_grid": launch.min_grid})
    return out


class EmulatedModel(CudaModel):
    """``target="cuda-emulated"``: the same CUDA kernels, built with the host C++ compiler and run
    on the CPU with every GPU thread a fiber (``souffle.runtime.emulated``). ``schedule`` picks the
    grid (by default the smallest the kernels allow, at least two blocks) and the order the
    threads run in between barriers; a data race, a deadlock or an access outside every buffer is
    an ``EmulationError``."""

    def __init__(self, graph, passes: PipelineRun):
        super().__init__(graph, passes)
        self.schedule()

    def schedule(self, thread_order: str = "ascending", grid: int | None = None, seed: int = 0) -> EmulatedModel:
        """Run the threads in ``thread_order`` (ascending, descending or random, seeded by
        ``seed``) on ``grid`` blocks (at most each launch's tiles); returns the model."""
        from souffle.runtime.emulated import DEFAULT_GRID, EmulatedDevice

        if grid is None:
            grid = max(DEFAULT_GRID, *(launch.min_grid for launch in self.kernel_plan.kernel_launches()))
        self.emulator = EmulatedDevice(grid, thread_order, seed)
        self._gpu = None
        return self

    def _device(self):
        return self.emulator

    def benchmark(self, inputs: dict, repeat: int = 1, number: int = 1, warmup: int = 0) -> list[float]:
        """Seconds of emulated runs on the CPU (nothing like the GPU's time)."""
        import time

        arrays = self._shaped_inputs(inputs)
        check_count(repeat, "repeat", 1)
        launcher = self._launcher()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            launcher.run(arrays)
            times.append(time.perf_counter() - start)
        return times

    def report(self) -> Report:
        report = super().report()
        report.extra["emulation"] = f"{self.emulator.name}, grid {self._launcher().grid}" if self._gpu else \
            self.emulator.name
        return report
