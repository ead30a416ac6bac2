"""A static estimate of the global-memory traffic of a staged program, as it runs.

Between stages the persistent kernel keeps no tensor on chip: every stage loads what it reads
from global memory and stores its whole output there. Inside a stage, a fused reduction's
result stays in registers or shared memory (an epilogue stage reads only the reduction's
inputs), and a weight kept on chip across a loop (``codegen.staged.OnChip``) is read from
global memory once, by the load before the loop. So per execution a stage
moves, for each tensor it reads, the distinct elements its access relation touches (an
element loaded by several threads or reduction steps counts once), plus its output. A stage
inside loops runs once per iteration of each, so its bytes are multiplied by the product of
their trip counts.

This is an upper bound on DRAM traffic, not a prediction: L2 (and L1) may serve part of
those loads, writes may be absorbed by L2 and overwritten before eviction, and a gather
(an index read from memory) is counted over the whole extent its access relation had to be
widened to (``exact`` is False for such stages). ``compulsory_bytes`` is the floor every
schedule pays: weights, model inputs and outputs, each moved once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from analysis.dependence import count_points_at_most
from codegen.staged import Loop, OnChip, Stage, StagedProgram


@dataclass(frozen=True)
class StageTraffic:
    """One stage's bytes per execution, and how many times it executes per inference."""

    name: str
    loops: tuple[str, ...]  # enclosing loops, outermost first
    executions: int
    reads: tuple[tuple[str, int], ...]  # (tensor read, bytes per execution), in ``Stage.reads`` order
    bytes_written: int
    exact: bool  # False when an access relation was over-approximated (a gather)

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.reads)

    @property
    def total_read(self) -> int:
        return self.bytes_read * self.executions

    @property
    def total_written(self) -> int:
        return self.bytes_written * self.executions


@dataclass(frozen=True)
class Traffic:
    """Every stage's traffic, in program order, with the totals of one inference."""

    name: str
    stages: tuple[StageTraffic, ...]
    compulsory_bytes: int

    @property
    def read_bytes(self) -> int:
        return sum(s.total_read for s in self.stages)

    @property
    def write_bytes(self) -> int:
        return sum(s.total_written for s in self.stages)

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def stages_executed(self) -> int:
        return sum(s.executions for s in self.stages)

    def to_json(self) -> dict:
        return {"name": self.name, "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
                "compulsory_bytes": self.compulsory_bytes, "stages_executed": self.stages_executed,
                "stages": [{**asdict(s), "reads": [list(r) for r in s.reads], "bytes_read": s.bytes_read}
                           for s in self.stages]}

    def table(self) -> str:
        """A summary line, then one row per stage (bytes per execution and per inference)."""
        summary = (f"memory traffic {self.name} (upper bound): read {self.read_bytes:,} B, written {self.write_bytes:,} B, "
                   f"compulsory {self.compulsory_bytes:,} B; {len(self.stages)} stages ({self.stages_executed} executed)")
        header = (f"  {'stage (loops: name; ~ over-approximated read)':<56} {'runs':>6} {'read B/run':>12} "
                  f"{'written B/run':>13} {'read B':>14} {'written B':>14}")
        lines = [summary, header]
        for s in self.stages:
            name = (f"{'/'.join(s.loops)}: " if s.loops else "") + s.name + ("" if s.exact else " ~")
            lines.append(f"  {name:<56} {s.executions:>6} {s.bytes_read:>12,} {s.bytes_written:>13,} "
                         f"{s.total_read:>14,} {s.total_written:>14,}")
        return "\n".join(lines)

    __str__ = table


def memory_traffic(staged: StagedProgram) -> Traffic:
    """The global-memory bytes ``staged`` moves per inference, stage by stage (an upper bound).

    Each stage's access relations are built and counted once, however many times loops run
    it: the per-inference figures are those counts times the stage's executions.
    """
    rows: list[StageTraffic] = []

    def visit(items: list, loops: tuple[str, ...], executions: int):
        for item in items:
            if isinstance(item, Loop):
                rows.extend(_load_traffic(load, loops, executions) for load in item.loads)
                visit(item.items, loops + (item.name,), executions * item.trips)
            else:
                rows.append(stage_traffic(item, loops, executions))

    visit(staged.items, (), 1)
    return Traffic(staged.name, tuple(rows), compulsory_bytes(staged))


def compulsory_bytes(staged: StagedProgram) -> int:
    """Weights (per-loop stacks included), model inputs and outputs, each moved once."""
    weights = sum(spec.size * _itemsize(spec.dtype) for spec, _ in staged.weights)
    inputs = sum(math.prod(int(d) for d in b.shape) * _itemsize(b.dtype) for b in staged.input_buffers)
    outputs = sum(spec.size * _itemsize(spec.dtype) for spec in staged.outputs)
    return weights + inputs + outputs


def stage_traffic(stage: Stage, loops: tuple[str, ...] = (), executions: int = 1) -> StageTraffic:
    """``stage``'s bytes: each operand's elements its tiles read, and its output."""
    reads, exact = [], True
    for k, (ref, holder) in enumerate(zip(stage.reads, stage.placeholders)):
        if k in stage.on_chip:
            reads.append((ref.spec.name, 0))  # from shared memory; its load is counted once
            continue
        relation, exact_read = stage.read_relation(holder)
        elements, counted = count_points_at_most(relation.range())
        reads.append((ref.spec.name, elements * _itemsize(holder.dtype)))
        exact = exact and exact_read and counted
    written = math.prod(int(d) for d in stage.tensor.shape) * _itemsize(stage.tensor.dtype)
    return StageTraffic(stage.name, loops, executions, tuple(reads), written, exact)


def _load_traffic(load: OnChip, loops: tuple[str, ...], executions: int) -> StageTraffic:
    """Every block's copy of its tiles' slices of an on-chip weight: the weight, read once."""
    source = load.source
    elements = min(load.n_tiles * load.per_tile, source.spec.size)
    return StageTraffic(f"on-chip load of {source.spec.name} for {load.reader}", loops, executions,
                        ((source.spec.name, elements * _itemsize(source.spec.dtype)),), 0, True)


def _itemsize(dtype) -> int:
    return np.dtype(str(dtype)).itemsize
