"""``souffle.compile(graph, target="cuda")``: the persistent kernel (or, below O3 or where the
partition splits, its kernels), built and (on a GPU) run.

Building needs TVM and nvcc, not a GPU: the kernel's source, its registers and shared memory
(from ptxas) and the co-resident grid on the device model are known at compile time, and a
kernel that cannot be co-resident is refused then. Running loads the cubin through
cuda-python and launches it cooperatively, sizing the grid with the driver's occupancy API.
"""

from __future__ import annotations

from souffle.compiler import CompiledModel, Report, gpu_device_model, timed
from souffle.errors import TargetError
from souffle.runtime.artifact import KernelArtifact, Launcher, TensorSlot


def build_cuda(graph, program, staged, device: str | None, seconds: dict[str, float]) -> CudaModel:
    from codegen.cuda import argument_order, co_resident_grid, cuda_source, kernel_plan
    from souffle.runtime.cuda import compile_cubin

    model = gpu_device_model(device or "h200")
    plan = timed(seconds, "kernel", kernel_plan, staged)
    source = timed(seconds, "codegen", cuda_source, plan.funcs, model.arch)
    cubin, resources = timed(seconds, "nvcc", compile_cubin, source, model.arch, tuple(plan.kernel_names))
    launches = {f"{launch.kernel}_kernel": launch for launch in plan.kernel_launches()}
    occupancy = {}
    for name, used in resources.items():
        launch = launches[name]
        try:
            occupancy[name] = co_resident_grid(used.registers, used.shared_bytes + launch.dynamic_shared, model,
                                               staged.threads)
        except TargetError as err:
            raise TargetError(f"kernel {name}: {err}") from None
        if occupancy[name].grid < launch.min_grid:
            raise TargetError(f"kernel {name}: its on-chip weights assume at least {launch.min_grid} blocks, but only "
                              f"{occupancy[name].grid} can be co-resident on {model.name}")
    orders = {name: argument_order(source, staged, name) for name in plan.kernel_names}
    return CudaModel(graph, program, staged, source, model, cubin, resources, occupancy, orders, plan, seconds)


class CudaModel(CompiledModel):
    """The model's CUDA kernels: ``.source`` and ``.report()`` anywhere, ``m(x)`` on a GPU.

    ``resources``, ``occupancy`` and ``argument_order`` are those of the kernel with the most
    registers (the only one at O3 and O4 when the partition does not split); ``kernel_resources``,
    ``kernel_occupancy`` and ``argument_orders`` have every kernel's.
    """

    def __init__(self, graph, program, staged, source, device_model, cubin, resources, occupancy, orders, plan,
                 seconds):
        from codegen.cuda import kernel_count

        super().__init__(graph, "cuda", program, staged, None, seconds)
        self.source = source
        self.device_model = device_model
        self.cubin = cubin
        self.kernel_plan = plan
        self.kernel_resources = resources
        self.kernel_occupancy = occupancy
        self.argument_orders = orders
        widest = max(resources, key=lambda name: resources[name].registers)
        self.resources = resources[widest]
        self.occupancy = occupancy[widest]
        self.argument_order = orders[widest]
        self.grid = min(occupancy[widest].grid, staged.max_tiles)
        self.kernel_count = kernel_count(source)
        self._gpu = None

    def artifact(self, config: str | None = None, seed: int = 0, archs: tuple[str, ...] = ()) -> KernelArtifact:
        """The kernel as a TVM-free artifact (``souffle.runtime.artifact``), with cubins for
        ``archs`` besides the device model's; ``config`` and ``seed`` name the model's own
        weights (when the graph came from ``souffle.models``) so the artifact need not carry them."""
        from souffle.runtime.cuda import compile_cubin

        staged = self.plan
        cubins = {self.device_model.arch: self.cubin}
        cubins.update({arch: compile_cubin(self.source, arch)[0] for arch in archs if arch not in cubins})
        return KernelArtifact(
            model=self.graph.name, config=config, seed=seed, threads=staged.threads,
            kernels={name: list(order) for name, order in self.argument_orders.items()},
            launches=_launches_json(self.kernel_plan.launches),
            inputs=[TensorSlot(s.name, b.name, tuple(s.shape), s.dtype) for s, b in zip(self.graph.inputs, staged.input_buffers)],
            outputs=[TensorSlot(s.name, b.name, tuple(s.shape), s.dtype) for s, b in zip(staged.outputs, staged.output_buffers)],
            weights=[{"buffer": b.name, "recipe": staged.weight_recipes[spec.name], "shape": list(spec.shape),
                      "dtype": spec.dtype} for b, (spec, _) in zip(staged.weight_buffers, staged.weights)],
            arenas={buffer.name: (dtype, staged.arena_sizes[dtype]) for dtype, buffer in staged.arena_buffers.items()},
            source=self.source, cubins=cubins)

    def _launcher(self) -> Launcher:
        if self._gpu is None:
            self._gpu = Launcher(self.artifact(), model_weights=self.graph.weights)
            self.grid = self._gpu.grid
        return self._gpu

    def run(self, inputs: dict):
        import time

        launcher = self._launcher()
        arrays = self._checked_inputs(inputs)
        start = time.perf_counter()
        outputs = launcher.run(arrays)
        self._last_run = time.perf_counter() - start
        return outputs

    def benchmark(self, inputs: dict, repeat: int = 50, number: int = 1, warmup: int = 5) -> list[float]:
        """Seconds per inference from CUDA events, ``repeat`` runs after ``warmup``."""
        return self._launcher().benchmark(self._checked_inputs(inputs), repeat=repeat, warmup=warmup)

    def report(self) -> Report:
        report = super().report()
        r = self.resources
        functions = "1 __global__ function" if self.kernel_count == 1 else \
            f"{self.kernel_count} __global__ functions, the largest"
        report.extra["cuda"] = (f"{functions}, {r.arch}: {r.registers} registers/thread, "
                                f"{r.shared_bytes} B static + {self.plan.on_chip_bytes} B dynamic shared memory, "
                                f"{r.spill_bytes} B spilled")
        report.extra["co-residency"] = str(self.occupancy)
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

