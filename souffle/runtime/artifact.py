"""A compiled persistent kernel as files, and its launcher — numpy and cuda-python only.

A GPU machine may have neither TVM nor room for a large model's weights, so an artifact holds
the kernel (cubins per architecture and the CUDA source), how to call it (parameters in order,
threads, tiles), and *recipes* for its weights (which model weights, stacked or not) instead
of the arrays: the launcher rebuilds them from the model's seeded numpy initialisation.
``souffle.compile(..., target="cuda")`` launches through the same ``Launcher``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from souffle.errors import SouffleError, TargetError

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
    max_tiles: int
    argument_order: list[str]  # kernel parameters by buffer name; "grid_size" is the grid
    inputs: list[TensorSlot]
    outputs: list[TensorSlot]
    weights: list[dict]  # {"buffer", "sources": [model weight names], "shape", "dtype"}; several sources: stacked
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
        cubins = {arch: (directory / f"kernel.{arch}.cubin").read_bytes() for arch in manifest.pop("cubins")}
        manifest["inputs"] = [TensorSlot(**{**t, "shape": tuple(t["shape"])}) for t in manifest["inputs"]]
        manifest["outputs"] = [TensorSlot(**{**t, "shape": tuple(t["shape"])}) for t in manifest["outputs"]]
        manifest["arenas"] = {k: tuple(v) for k, v in manifest["arenas"].items()}
        return cls(**manifest, source=(directory / "kernel.cu").read_text(), cubins=cubins)

    def weight_arrays(self, model_weights: dict | None = None) -> dict[str, np.ndarray]:
        """Each weight parameter's array, from ``model_weights`` or the model's seeded initialisation."""
        if model_weights is None:
            if self.config is None:
                raise SouffleError(f"artifact {self.model!r} records no model config: pass its weights")
            from souffle import models  # numpy only: building the graph would need TVM

            model_weights = models.get(self.model).init_weights(models.config(self.model, self.config), self.seed)
        arrays = {}
        for w in self.weights:
            parts = [np.asarray(model_weights[name]) for name in w["sources"]]
            value = np.stack(parts) if len(parts) > 1 else parts[0]
            if tuple(value.shape) != tuple(w["shape"]) or str(value.dtype) != w["dtype"]:
                raise SouffleError(f"weight {w['buffer']!r}: expected {tuple(w['shape'])} {w['dtype']}, "
                                   f"got {value.shape} {value.dtype}")
            arrays[w["buffer"]] = np.ascontiguousarray(value).reshape(-1)
        return arrays


class Launcher:
    """The artifact loaded on a GPU: weights and scratch resident, the grid sized by the driver's
    occupancy API (every block co-resident, no more blocks than the widest stage has tiles)."""

    def __init__(self, artifact: KernelArtifact, model_weights: dict | None = None, device=None):
        from souffle.runtime import cuda as rt

        self.artifact = artifact
        self.device = device or rt.Device()
        cubin = artifact.cubins.get(self.device.arch)
        if cubin is None:
            cubin = rt.compile_cubin(artifact.source, self.device.arch)[0]
        self.kernel = rt.Kernel(self.device, cubin)
        per_sm = self.kernel.max_active_blocks_per_sm(artifact.threads)
        if per_sm < 1:
            raise TargetError(f"{self.device.name}: the kernel cannot be resident (0 blocks of {artifact.threads} "
                              "threads per SM)")
        self.blocks_per_sm = per_sm
        self.grid = min(self.device.sms * per_sm, artifact.max_tiles)
        self.resident = {name: self.device.upload(value) for name, value in artifact.weight_arrays(model_weights).items()}
        for name, (dtype, elements) in artifact.arenas.items():
            self.resident[name] = self.device.alloc(max(elements, 1) * np.dtype(dtype).itemsize)

    def arguments(self, inputs: list[np.ndarray]):
        """Kernel arguments for these inputs (flat arrays in the artifact's input order), and the outputs."""
        by_name = dict(self.resident)
        for slot, array in zip(self.artifact.inputs, inputs):
            by_name[slot.buffer] = self.device.upload(array)
        outputs = []
        for slot in self.artifact.outputs:
            by_name[slot.buffer] = self.device.alloc(slot.size * np.dtype(slot.dtype).itemsize)
            outputs.append((by_name[slot.buffer], slot))
        return [self.grid if name == "grid_size" else by_name[name] for name in self.artifact.argument_order], outputs

    def launch(self, args) -> None:
        """One inference: warps of 32 along x, the block's warps along y (``codegen.schedule``)."""
        self.kernel.launch(self.grid, (32, self.artifact.threads // 32, 1), args)

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        args, outputs = self.arguments(inputs)
        self.launch(args)
        self.device.synchronize()
        return [buffer.download(slot.dtype, slot.shape) for buffer, slot in outputs]

    def benchmark(self, inputs: list[np.ndarray], repeat: int = 50, warmup: int = 5) -> list[float]:
        """Seconds per inference from CUDA events, inputs uploaded once."""
        from souffle.runtime.cuda import time_kernel

        args, _ = self.arguments(inputs)
        return time_kernel(lambda: self.launch(args), self.device, warmup=warmup, repeat=repeat)
