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
schedule pays: weights, model inputs and outputs, each moved once. ``l2_traffic`` replays the
same accesses through an LRU L2: on the H200 its DRAM reads came within 15% of ncu's where the
counts are exact (paper LSTM, ResNeXt, EfficientNet and Swin at O4; MMoE's 0.1 MB within 0.05).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import NamedTuple

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


@dataclass(frozen=True)
class L2Traffic:
    """The DRAM bytes of one inference with an L2 of ``l2_bytes`` in front of DRAM, in all and
    per row of ``Traffic.stages`` (every execution of the row together)."""

    l2_bytes: int
    stage_reads: tuple[tuple[int, ...], ...]  # per row, per read: bytes not in L2 when the stage read them
    stage_writes: tuple[int, ...]  # per row: dirty bytes its accesses evicted (its writes or others')

    @property
    def read_bytes(self) -> int:
        """Operand bytes not in L2 when a stage reads them."""
        return sum(map(sum, self.stage_reads))

    @property
    def write_bytes(self) -> int:
        """Written bytes evicted from L2 before the kernels end."""
        return sum(self.stage_writes)


def l2_traffic(staged: StagedProgram, l2_bytes: int, traffic: Traffic | None = None) -> L2Traffic:
    """``traffic`` (``memory_traffic``'s per-stage bytes) replayed in execution order, loops
    unrolled, through an L2 of ``l2_bytes`` that keeps the tensors used most recently.

    A stage's read of a tensor misses only for the bytes of it L2 does not hold; its output is
    written into L2 (write-back) and reaches DRAM when evicted; a tensor larger than L2 is not
    kept. Whole tensors are the unit, at the bytes a stage touches of them, and nothing is kept
    across inferences (ncu flushes the caches before each launch). This is the upper bound's
    counterpart: what a perfect LRU L2 would leave; real L2s split into partitions and keep less.
    A write-back is charged to the stage whose access evicts it: the write happens while it runs.
    """
    traffic = traffic or memory_traffic(staged)
    rows = iter(enumerate(traffic.stages))

    def program(items: list, loop_vars: tuple) -> list:
        out = []
        for item in items:
            if isinstance(item, Loop):
                loads = [_Access(*next(rows), [_Place(load.source, loop_vars)], None) for load in item.loads]
                out.append(_Repeat(item.trips, loads, program(item.items, loop_vars + (item.var,))))
            else:
                out.append(_Access(*next(rows), [_Place(ref, loop_vars) for ref in item.reads],
                                   _Place(item.write, loop_vars)))
        return out

    cache: OrderedDict[tuple, list] = OrderedDict()  # (tensor, offset) -> [bytes held, dirty], least recent first
    held = 0
    reads = [[0] * len(row.reads) for row in traffic.stages]
    writes = [0] * len(traffic.stages)

    def touch(index: int, key: tuple, nbytes: int, dirty: bool) -> None:
        nonlocal held
        size, was_dirty = cache.pop(key, (0, False))
        held -= size
        size, dirty = max(size, nbytes), was_dirty or dirty
        if size > l2_bytes:  # streams through: written back at once, kept for nothing
            writes[index] += size if dirty else 0
            return
        cache[key] = [size, dirty]
        held += size
        while held > l2_bytes:
            _, (size, dirty) = cache.popitem(last=False)
            held -= size
            writes[index] += size if dirty else 0

    def run(steps: list, trips: tuple) -> None:
        for step in steps:
            if isinstance(step, _Repeat):
                run(step.loads, trips)
                for trip in range(step.trips):
                    run(step.body, trips + (trip,))
                continue
            for k, ((_, nbytes), place) in enumerate(zip(step.row.reads, step.reads)):
                key = place.key(trips)
                reads[step.index][k] += max(0, nbytes - (cache[key][0] if key in cache else 0))
                touch(step.index, key, nbytes, False)
            if step.write is not None:
                touch(step.index, step.write.key(trips), step.row.bytes_written, True)

    run(program(staged.items, ()), ())
    return L2Traffic(l2_bytes, tuple(map(tuple, reads)), tuple(writes))


class _Access(NamedTuple):
    """One stage (or on-chip load) of ``l2_traffic``'s replay: its counted bytes and places."""

    index: int  # of ``row`` in ``Traffic.stages``
    row: StageTraffic
    reads: list  # a _Place per read, in ``row.reads`` order
    write: _Place | None  # None for an on-chip load, which writes only shared memory


class _Repeat(NamedTuple):
    """A loop of ``l2_traffic``'s replay: its on-chip loads once, then its body ``trips`` times."""

    trips: int
    loads: list
    body: list


class _Place:
    """A tensor's place in its buffer as a key, at given iterations of the enclosing loops: a
    loop's stacked weights are one tensor whose slice moves with the loop (layer k's weights
    are not layer k-1's). The offset is taken as affine in the loop variables, read off at 0
    and at each unit vector."""

    def __init__(self, ref, loop_vars: tuple):
        self.name = ref.spec.name
        offset = ref.offset
        if isinstance(offset, int) or not loop_vars:
            self.base, self.steps = int(_evaluate(offset, {})), ()
            return
        zero = {var: 0 for var in loop_vars}
        self.base = _evaluate(offset, zero)
        self.steps = tuple(_evaluate(offset, {**zero, var: 1}) - self.base for var in loop_vars)

    def key(self, trips: tuple) -> tuple:
        return (self.name, self.base + sum(step * trip for step, trip in zip(self.steps, trips)))


def _evaluate(offset, values: dict) -> int:
    if isinstance(offset, int):
        return offset
    import tvm

    analyzer = tvm.sym.Analyzer()
    for var, value in values.items():
        analyzer.bind(var, tvm.tirx.const(value, "int32"))
    return int(analyzer.simplify(offset))


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
