"""Data reuse in the global program, from the access relations.

Temporal reuse: one tensor read by several TEs, or by every iteration of a loop
(a loop-invariant weight) — data a fused kernel can keep on chip instead of
reading DRAM again. Spatial reuse: within one TE, how many output elements read
the same input element (a broadcast bias is read by every row; a GEMM operand by
every column) — data a tile can stage in shared memory or registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from analysis.characterize import tensor_bytes
from analysis.dependence import (
    AccessRelation,
    Dependences,
    count_points,
    representative_point,
)


@dataclass(frozen=True)
class TemporalReuse:
    """A tensor that is read more than once per inference."""

    tensor: str
    bytes: int  # size of the tensor
    readers: tuple[str, ...]  # the TEs that read it
    iterations: int  # loop iterations that each re-read it (1 unless it is loop-invariant)

    @property
    def reads(self) -> int:
        """How many times the tensor is read in full per inference, unfused."""
        return len(self.readers) * self.iterations


@dataclass(frozen=True)
class Reuse:
    """Every temporally reused tensor, and the spatial reuse of every (TE, input) edge."""

    temporal: list[TemporalReuse]
    spatial: dict[tuple[str, str], int]  # (TE name, input name) -> output elements reading one input element

    def fan_out(self, stage: str, tensor: str) -> int:
        return self.spatial[(stage, tensor)]

    def __str__(self):
        lines = ["temporal reuse:"]
        for t in self.temporal:
            loop = f", every one of {t.iterations} iterations" if t.iterations > 1 else ""
            lines.append(f"  {t.tensor} ({t.bytes} B) read by {len(t.readers)} TE(s){loop}: {', '.join(t.readers)}")
        lines.append("spatial reuse (output elements per input element, > 1 only):")
        lines += [f"  {s} <- {x}: {n}" for (s, x), n in self.spatial.items() if n > 1]
        return "\n".join(lines)


def spatial_fan_out(access: AccessRelation) -> int:
    """Output elements of the TE that read one representative element of the input."""
    spatial = access.spatial
    if spatial.is_empty():
        return 0
    point = representative_point(spatial.range())
    return count_points(spatial.intersect_range(point).domain())


def find_reuse(deps: Dependences) -> Reuse:
    """Temporal reuse per tensor and spatial reuse per (TE, input) edge."""
    readers: dict[object, list[str]] = {}
    info: dict[object, tuple[str, int, int]] = {}
    spatial: dict[tuple[str, str], int] = {}
    produced_by = {s.stage.op: s.name for s in deps.stages}
    for stage in deps.stages:
        for edge in stage.edges:
            spatial[(stage.name, edge.name)] = spatial_fan_out(edge.access)
            key = edge.producer.op if edge.producer is not None else edge.name
            readers.setdefault(key, []).append(stage.name)
            iterations = stage.loops[-1][1] if edge.role == "invariant" else 1
            info.setdefault(key, (produced_by.get(key, edge.name), tensor_bytes(edge.tensor), iterations))
    temporal = []
    for key, names in readers.items():
        name, size, iterations = info[key]
        if len(names) > 1 or iterations > 1:
            temporal.append(TemporalReuse(name, size, tuple(names), iterations))
    return Reuse(temporal, spatial)

