"""A check bundle: a kernel artifact with seeded inputs and PyTorch's outputs for them, as files.

Exported where TVM and torch are installed (``souffle.compiler.export_check``), loaded and
compared on a GPU machine with only numpy and cuda-python — by benchmarks/gpu_kernels.py and
tests/test_gpu.py alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from souffle.runtime.artifact import KernelArtifact


@dataclass
class Check:
    """A loaded bundle: the artifact, its inputs (flat, in the kernel's order) and the expected outputs."""

    artifact: KernelArtifact
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    rtol: float
    atol: float

    @classmethod
    def load(cls, directory) -> Check:
        directory = Path(directory)
        artifact = KernelArtifact.load(directory)
        given = dict(np.load(directory / "inputs.npz"))
        tolerance = json.loads((directory / "check.json").read_text())
        return cls(artifact, [np.ascontiguousarray(given[slot.name]).reshape(-1) for slot in artifact.inputs],
                   list(np.load(directory / "expected.npz").values()), tolerance["rtol"], tolerance["atol"])

    def errors(self, outputs: list[np.ndarray]) -> list[float]:
        return [float(np.max(np.abs(o - e))) for o, e in zip(outputs, self.expected)]

    def passes(self, outputs: list[np.ndarray]) -> bool:
        return all(np.allclose(o, e, rtol=self.rtol, atol=self.atol) for o, e in zip(outputs, self.expected))
