"""``souffle.compile(graph, target="cuda")``: the persistent kernel, built and (on a GPU) run.

Building needs TVM and nvcc, not a GPU: the kernel's source, its registers and shared memory
(from ptxas) and the co-resident grid on the device model are known at compile time, and a
kernel that cannot be co-resident is refused then. Running loads the cubin through
cuda-python and launches it cooperatively, sizing the grid with the driver's occupancy API.
"""

from __future__ import annotations

from souffle.compiler import CompiledModel, Report, _timed
from souffle.errors import TargetError


def build_cuda(graph, program, staged, device: str | None, seconds: dict[str, float]) -> CudaModel:
    from analysis.device import get_device
    from codegen.cuda import argument_order, co_resident_grid, cuda_source, persistent_kernel
    from souffle.runtime.cuda import compile_cubin

    model = get_device(device or "h200")
    if model.kind != "gpu":
        raise TargetError(f"target 'cuda' needs a GPU device model, not {model.name!r}; use 'h200' or 'a100'")
    func = _timed(seconds, "kernel", persistent_kernel, staged)
    source = _timed(seconds, "codegen", cuda_source, func, model.arch)
    cubin, resources = _timed(seconds, "nvcc", compile_cubin, source, model.arch)
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

    def _launcher(self):
        """Device, kernel, resident weights and arenas, and the grid: made once, on first use."""
        if self._gpu is None:
            from souffle.runtime import cuda as rt

            device = rt.Device()
            cubin = self.cubin if device.arch == self.device_model.arch else rt.compile_cubin(self.source, device.arch)[0]
            kernel = rt.Kernel(device, cubin)
            staged = self.plan
            grid = min(device.sms * kernel.max_active_blocks_per_sm(staged.threads), staged.max_tiles)
            if grid < 1:
                raise TargetError(f"{device.name}: the kernel cannot be resident (0 blocks per SM)")
            resident = {b.name: device.upload(value.reshape(-1))
                        for b, (_, value) in zip(staged.weight_buffers, staged.weights)}
            for dtype, buffer in staged.arena_buffers.items():
                resident[buffer.name] = device.alloc(max(staged.arena_sizes[dtype], 1) * _itemsize(dtype))
            self._gpu = (device, kernel, grid, resident)
        return self._gpu

    def _launch_arguments(self, inputs: dict):
        device, kernel, grid, resident = self._launcher()
        staged = self.plan
        by_name = dict(resident)
        for buffer, array in zip(staged.input_buffers, self._checked_inputs(inputs)):
            by_name[buffer.name] = device.upload(array)
        outputs = []
        for buffer, spec in zip(staged.output_buffers, staged.outputs):
            by_name[buffer.name] = device.alloc(spec.size * _itemsize(spec.dtype))
            outputs.append((by_name[buffer.name], spec))
        args = [grid if name == "grid_size" else by_name[name] for name in self.argument_order]
        return device, kernel, grid, args, outputs

    def run(self, inputs: dict):
        import time

        device, kernel, grid, args, outputs = self._launch_arguments(inputs)
        start = time.perf_counter()
        kernel.launch(grid, self.plan.threads, args)
        device.synchronize()
        self._last_run = time.perf_counter() - start
        return [buffer.download(spec.dtype, spec.shape) for buffer, spec in outputs]

    def benchmark(self, inputs: dict, repeat: int = 50, number: int = 1, warmup: int = 5) -> list[float]:
        """Seconds per inference from CUDA events, ``repeat`` runs after ``warmup``."""
        from souffle.runtime.cuda import time_kernel

        device, kernel, grid, args, _ = self._launch_arguments(inputs)

        def run():
            for _ in range(number):
                kernel.launch(grid, self.plan.threads, args)

        return [t / number for t in time_kernel(run, device, warmup=warmup, repeat=repeat)]

    def report(self) -> Report:
        report = super().report()
        r = self.resources
        report.extra["cuda"] = (f"{self.kernel_count} __global__ function, {r.arch}: {r.registers} registers/thread, "
                                f"{r.shared_bytes} B shared memory, {r.spill_bytes} B spilled")
        report.extra["co-residency"] = str(self.occupancy)
        return report


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize
