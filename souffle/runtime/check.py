"""A check bundle: a kernel artifact with seeded inputs and PyTorch's outputs for them, as files.

Exported where TVM and torch are installed (``souffle.compiler.export_check``), loaded and
compared on a GPU machine with only numpy and cuda-python — by benchmarks/gpu_kernels.py and
tests/test_gpu.py alike. Besides the artifact's files a bundle holds ``check.json`` (``rtol``,
``atol`` and the compile ``report``), ``inputs.npz`` (one array per input, by its name) and
``expected.npz`` (one array per output, in order: ``arr_0``, ``arr_1``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from souffle.runtime.artifact import ArtifactError, JsonFields, KernelArtifact, TensorSlot, read_json, read_npz

CHECK = "check.json"
INPUTS = "inputs.npz"
EXPECTED = "expected.npz"


@dataclass
class Check:
    """A loaded bundle: the artifact, its inputs (in the kernel's order) and the expected outputs."""

    artifact: KernelArtifact
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    rtol: float
    atol: float

    @classmethod
    def load(cls, directory) -> Check:
        """Read the bundle in ``directory``: the artifact (``KernelArtifact.load``), the tolerances,
        an input of each input slot's shape and dtype, and an expected array of each output's.
        Anything missing, malformed or mismatched is an :class:`ArtifactError` naming the file."""
        directory = Path(directory)
        artifact = KernelArtifact.load(directory)
        path = directory / CHECK
        check = JsonFields(path)
        tolerance = check.object(read_json(path, "check bundle"), "", ("rtol", "atol", "report"))
        rtol, atol = check.number(tolerance["rtol"], "rtol"), check.number(tolerance["atol"], "atol")
        if not isinstance(tolerance["report"], str):
            check.fail("report", "expected a string")
        inputs = _arrays(directory / INPUTS, {slot.name: slot for slot in artifact.inputs}, "input")
        outputs = {f"arr_{i}": slot for i, slot in enumerate(artifact.outputs)}  # np.savez's names, by position
        expected = _arrays(directory / EXPECTED, outputs, "output")
        return cls(artifact, inputs, expected, rtol, atol)

    def errors(self, outputs: list[np.ndarray]) -> list[float]:
        return [float(np.max(np.abs(o - e))) for o, e in zip(outputs, self.expected)]

    def passes(self, outputs: list[np.ndarray]) -> bool:
        return all(np.allclose(o, e, rtol=self.rtol, atol=self.atol) for o, e in zip(outputs, self.expected))

    def outside(self, outputs: list[np.ndarray]) -> tuple[int, float]:
        """How many elements miss ``passes``'s bound, |o - e| <= atol + rtol * |e|, and by how much
        the worst one does (<= 0 when none does): a FAIL at one element by rounding differs from a
        wrong kernel. A NaN counts as missing it, by infinity."""
        count, worst = 0, -np.inf
        for o, e in zip(outputs, self.expected):
            excess = np.abs(o.astype(np.float64) - e) - (self.atol + self.rtol * np.abs(e.astype(np.float64)))
            excess = np.where(np.isnan(excess), np.inf, excess)
            count += int(np.count_nonzero(excess > 0))
            worst = max(worst, float(excess.max(initial=-np.inf)))
        return count, worst


def _arrays(path: Path, slots: dict[str, TensorSlot], role: str) -> list[np.ndarray]:
    """The archive's arrays, one per slot in order (keyed as ``slots``), each of its slot's shape and dtype."""
    arrays = read_npz(path, "check bundle")
    if missing := [key for key in slots if key not in arrays]:
        raise ArtifactError(f"{path}: no array {', '.join(map(repr, missing))} (of {len(slots)} {role}s)")
    if extra := sorted(set(arrays) - set(slots)):
        raise ArtifactError(f"{path}: array {', '.join(map(repr, extra))} is no {role} of the artifact")
    for key, slot in slots.items():
        array = arrays[key]
        if array.shape != slot.shape or array.dtype != np.dtype(slot.dtype):
            raise ArtifactError(f"{path}: array {key!r} is {array.shape} {array.dtype}, but {role} {slot.name!r} "
                                f"is {slot.describe()}")
    return [arrays[key] for key in slots]
