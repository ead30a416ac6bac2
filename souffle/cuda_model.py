"""``souffle.compile(graph, target="cuda")``: the persistent kernel, built and (on a GPU) run.

Building needs TVM and nvcc, not a GPU: the kernel's source, its registers and shared memory
(from ptxas) and the co-resident grid on the device model are known at compile time, and a
kernel that cannot be co-resident is refused then. Running loads the cubin through
cuda-python and launches it cooperatively, sizing the grid with the driver's occupancy API.
"""

from __future__ import annotations

from souffle.compiler import CompiledModel, Report, timed
from souffle.errors import TargetError
from souffle.runtime.artifact import KernelArtifact, Launcher, TensorSlot


def build_cuda(graph, program, staged, device: str | None, seconds: dict[str, float]) -> CudaModel:
    from analysis.device import get_device
    from codegen.cuda import (
        argument_order,
        co_resident_grid,
        cuda_source,
        persistent_kernel,
    )
    from souffle.runtime.cuda import compile_cubin

    model = get_device(device or "h200")
    if model.kind != "gpu":
        raise TargetError(f"target 'cuda' needs a GPU device model, not {model.name!r}; use 'h200' or 'a100'")
    func = timed(seconds, "kernel", persistent_kernel, staged)
    source = timed(seconds, "codegen", cuda_source, func, model.arch)
    cubin, resources = timed(seconds, "nvcc", compile_cubin, source, model.arch)
    occupancy = co_resident_grid(resources.registers, resources.shared_bytes, model, staged.threads)
    return CudaModel(graph, program, staged, source, model, cubin, resources, occupancy,
                     argument_order(source, staged), seconds)


class CudaModel(CompiledModel):
    """One persistent CUDA kernel: ``.source`` and ``.report()`` anywhere, ``m(x)`` on a GPU."""

    def __init__(self, graph, program, staged, source, device_model, cubin, resources, occupancy, order, seconds):
        from codegen.cuda import kernel_count

        super().__init__(graph, "cuda", program, staged, None, seconds)
        self.source = source
        self.device_model = device_model
        self.cubin = cubin
        self.resources = resources
        self.occupancy = occupancy
        self.argument_order = order
        self.grid = min(occupancy.grid, staged.max_tiles)
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
            model=self.graph.name, config=config, seed=seed, threads=staged.threads, max_tiles=staged.max_tiles,
            argument_order=list(self.argument_order),
            inputs=[TensorSlot(s.name, b.name, tuple(s.shape), s.dtype) for s, b in zip(self.graph.inputs, staged.input_buffers)],
            outputs=[TensorSlot(s.name, b.name, tuple(s.shape), s.dtype) for s, b in zip(staged.outputs, staged.output_buffers)],
            weights=[{"buffer": b.name, "sources": staged.weight_sources[spec.name], "shape": list(spec.shape),
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
        report.extra["cuda"] = (f"{self.kernel_count} __global__ function, {r.arch}: {r.registers} registers/thread, "
                                f"{r.shared_bytes} B shared memory, {r.spill_bytes} B spilled")
        report.extra["co-residency"] = str(self.occupancy)
        return report
