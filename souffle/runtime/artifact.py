"""A compiled model's kernels as files, and their launcher — numpy and cuda-python only.

A GPU machine may have neither TVM nor room for a large model's weights, so an artifact holds
the kernels (cubins per architecture and the CUDA source), how to call them (each kernel's
parameters in order, threads, tiles, and the launch order: kernels and the host loops around
them), and *recipes* for its weights (``souffle.recipe``) instead of the arrays: the launcher
rebuilds them from the model's seeded numpy initialisation. ``souffle.compile(...,
target="cuda")`` launches through the same ``Launcher``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from souffle.errors import InputError, SouffleError, TargetError

MANIFEST = "manifest.json"


@dataclass
class TensorSlot:
    """A kernel parameter that holds a model tensor."""

    name: str  # the model's tensor (input or output) name
    buffer: str  # the kernel parameter
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class KernelArtifact:
    """Everything a launch needs, without TVM."""

    model: str
    config: str | None  # the souffle.models config the weights come from; None: weights given
    seed: int
    threads: int
    kernels: dict[str, list[str]]  # kernel -> its parameters by buffer (or loop counter) name; "grid_size" is the grid
    launches: list[dict]  # {"kernel", "cooperative", "max_tiles", "dynamic_shared", "min_grid"} or
    #                       {"loop", "trips", "body": [...]}, in order
    inputs: list[TensorSlot]
    outputs: list[TensorSlot]
    weights: list[dict]  # {"buffer", "recipe" (souffle.recipe), "shape", "dtype"}
    arenas: dict[str, tuple[str, int]]  # buffer -> (dtype, elements)
    source: str
    cubins: dict[str, bytes] = field(default_factory=dict)  # arch -> cubin

    def save(self, directory) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        manifest = {k: v for k, v in asdict(self).items() if k not in ("source", "cubins")}
        manifest["cubins"] = sorted(self.cubins)
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
        (directory / "kernel.cu").write_text(self.source)
        for arch, cubin in self.cubins.items():
            (directory / f"kernel.{arch}.cubin").write_bytes(cubin)
        return directory

    @classmethod
    def load(cls, directory) -> KernelArtifact:
        directory = Path(directory)
        if not (directory / MANIFEST).exists():
            raise SouffleError(f"{directory} is not a kernel artifact: no {MANIFEST}")
        manifest = json.loads((directory / MANIFEST).read_text())
        try:
            cubins = {arch: (directory / f"kernel.{arch}.cubin").read_bytes() for arch in manifest.pop("cubins")}
            source = (directory / "kernel.cu").read_text()
        except FileNotFoundError as err:
            raise SouffleError(f"{directory} is an incomplete kernel artifact: {err.filename} is missing") from None
        manifest["inputs"] = [TensorSlot(**{**t, "shape": tuple(t["shape"])}) for t in manifest["inputs"]]
        manifest["outputs"] = [TensorSlot(**{**t, "shape": tuple(t["shape"])}) for t in manifest["outputs"]]
        manifest["arenas"] = {k: tuple(v) for k, v in manifest["arenas"].items()}
        return cls(**manifest, source=source, cubins=cubins)

    def weight_arrays(self, model_weights: dict | None = None) -> dict[str, np.ndarray]:
        """Each weight parameter's array, from ``model_weights`` or the model's seeded initialisation."""
        if model_weights is None:
            if self.config is None:
                raise SouffleError(f"artifact {self.model!r} records no model config: pass its weights")
            from souffle import models  # numpy only: building the graph would need TVM

            model_weights = models.get(self.model).init_weights(models.config(self.model, self.config), self.seed)
        from souffle.recipe import evaluate

        arrays = {}
        for w in self.weights:
            try:
                value = evaluate(w["recipe"], model_weights)
            except (ValueError, IndexError) as err:  # numpy refusing to stack, concatenate or index mismatched shapes
                raise SouffleError(f"weight {w['buffer']!r}: cannot be rebuilt from the given weights: {err}") from None
            if tuple(value.shape) != tuple(w["shape"]) or str(value.dtype) != w["dtype"]:
                raise SouffleError(f"weight {w['buffer']!r}: expected {tuple(w['shape'])} {w['dtype']}, "
                                   f"got {value.shape} {value.dtype}")
            arrays[w["buffer"]] = np.ascontiguousarray(value).reshape(-1)
        return arrays

    def checked_inputs(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """``inputs``, one array per input slot in order, as flat C-contiguous arrays. A wrong count,
        size or dtype is refused here: on the GPU a short input would be read past its end."""
        if len(inputs) != len(self.inputs):
            names = ", ".join(slot.name for slot in self.inputs)
            raise InputError(f"{self.model} takes {len(self.inputs)} inputs ({names}), got {len(inputs)}")
        arrays = []
        for slot, array in zip(self.inputs, inputs):
            array = np.asarray(array)
            if array.size != slot.size or array.dtype != np.dtype(slot.dtype):
                raise InputError(f"{self.model}: input {slot.name!r} needs {slot.size} {slot.dtype} values "
                                 f"(shape {slot.shape}), got {array.size} {array.dtype} values")
            arrays.append(np.ascontiguousarray(array).reshape(-1))
        return arrays


class Launcher:
    """The artifact loaded on a GPU: weights and scratch resident, each kernel's grid sized by
    the driver's occupancy API (every block co-resident, no more blocks than its widest stage
    has tiles), kernels launched in the artifact's order, host loops run here."""

    def __init__(self, artifact: KernelArtifact, model_weights: dict | None = None, device=None):
        from souffle.runtime import cuda as rt

        self.artifact = artifact
        self.device = device or rt.Device()
        cubin = artifact.cubins.get(self.device.arch)
        if cubin is None:
            cubin = rt.compile_cubin(artifact.source, self.device.arch, tuple(artifact.kernels))[0]
        self.kernels = {name: rt.Kernel(self.device, cubin, name) for name in artifact.kernels}
        self.grids, self.per_sm = {}, {}
        for launch in _kernel_launches(artifact.launches):
            kernel = self.kernels[launch["kernel"]]
            kernel.allow_dynamic_shared(launch["dynamic_shared"])
            per_sm = kernel.max_active_blocks_per_sm(artifact.threads, launch["dynamic_shared"])
            if per_sm < 1:
                raise TargetError(f"{self.device.name}: kernel {launch['kernel']} cannot be resident (0 blocks of "
                                  f"{artifact.threads} threads and {launch['dynamic_shared']} B of dynamic shared "
                                  "memory per SM)")
            grid = min(self.device.sms * per_sm, launch["max_tiles"])
            if grid < launch["min_grid"]:
                raise TargetError(f"{self.device.name}: kernel {launch['kernel']} keeps weights on chip for a grid of "
                                  f"at least {launch['min_grid']} blocks, but only {grid} fit")
            self.grids[launch["kernel"]] = grid
            self.per_sm[launch["kernel"]] = per_sm
        self.resident = {name: self.device.upload(value) for name, value in artifact.weight_arrays(model_weights).items()}
        for name, (dtype, elements) in artifact.arenas.items():
            self.resident[name] = self.device.alloc(max(elements, 1) * np.dtype(dtype).itemsize)

    @property
    def grid(self) -> int:
        """The widest grid any kernel launches with."""
        return max(self.grids.values())

    @property
    def blocks_per_sm(self) -> int:
        """Co-resident blocks per SM of the kernel with the widest grid."""
        return self.per_sm[max(self.grids, key=self.grids.get)]

    def arguments(self, inputs: list[np.ndarray]):
        """The buffers by parameter name for these inputs (one array per input, in the artifact's
        order: ``KernelArtifact.checked_inputs``), and the outputs."""
        by_name = dict(self.resident)
        for slot, array in zip(self.artifact.inputs, self.artifact.checked_inputs(inputs)):
            by_name[slot.buffer] = self.device.upload(array)
        outputs = []
        for slot in self.artifact.outputs:
            by_name[slot.buffer] = self.device.alloc(slot.size * np.dtype(slot.dtype).itemsize)
            outputs.append((by_name[slot.buffer], slot))
        return by_name, outputs

    def launch(self, buffers: dict, launches: list | None = None, counters: dict | None = None) -> None:
        """One inference: the kernels in order, warps of 32 along x and the block's warps along y
        (``codegen.schedule``), a host loop's counter passed to the kernels inside it."""
        counters = counters or {}
        for launch in self.artifact.launches if launches is None else launches:
            if "loop" in launch:
                for i in range(launch["trips"]):
                    self.launch(buffers, launch["body"], {**counters, launch["loop"]: np.int64(i)})
                continue
            name = launch["kernel"]
            grid = self.grids[name]
            args = [grid if p == "grid_size" else counters[p] if p in counters else buffers[p]
                    for p in self.artifact.kernels[name]]
            self.kernels[name].launch(grid, (32, self.artifact.threads // 32, 1), args, cooperative=launch["cooperative"],
                                      shared_bytes=launch["dynamic_shared"])

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        buffers, outputs = self.arguments(inputs)
        self.launch(buffers)
        self.device.synchronize()
        return [buffer.download(slot.dtype, slot.shape) for buffer, slot in outputs]

    def benchmark(self, inputs: list[np.ndarray], repeat: int = 50, warmup: int = 5) -> list[float]:
        """Seconds per inference from CUDA events, inputs uploaded once."""
        from souffle.runtime.cuda import time_kernel

        buffers, _ = self.arguments(inputs)
        return time_kernel(lambda: self.launch(buffers), self.device, warmup=warmup, repeat=repeat)


def _kernel_launches(launches: list):
    for launch in launches:
        if "loop" in launch:
            yield from _kernel_launches(launch["body"])
        else:
            yield launch
