"""The ``partition`` pass (from O3): the staged program as one kernel, split only where the device
makes one kernel cost more than several.

A persistent kernel holds every stage's resources at once: ptxas allocates registers for the
whole kernel and TVM pools shared memory by liveness, so the kernel needs the most registers and
the most shared memory any of its stages needs, and its co-resident grid is the smallest that any
of its stages alone would get. One demanding stage thus slows every other stage of its kernel.
``partition`` cuts ``StagedProgram.items`` between top-level items (a scan's loop is never cut)
into the kernels with the least estimated time, so a split is made only where it pays for itself,
and each split carries the figures that justify it. As a kernel's every resource is the most one
of its stages needs, a kernel is co-resident whenever each of its stages is on its own: the only
impossible kernel is one holding a stage no kernel can hold, which no split helps, so that stage
is refused by name (``TargetError``).

The estimate (a model for choosing, not a measurement):

- ``T``, a stage's time for one execution on the whole device, is its roofline time
  (``analysis.characterize.stage_cost`` on the bytes ``codegen.traffic`` counts for it).
- On a grid of ``G`` blocks, ``min(G, n)`` of its ``n`` tiles run at once. The device reaches
  its throughput once ``S`` blocks run (``saturating_grid``: every SM at ``SATURATING_OCCUPANCY``
  of its thread slots); fewer blocks each run at their own latency-bound pace, a 1/S share of it.
  So the stage takes ``T x S / min(S, G, n)`` (``time_at_grid``): ``T`` on any grid of at least
  ``S`` blocks, ``S/G`` times that on a smaller one. Tile quantization (a last round of few
  tiles) is left out: every grid has some, and it would make the partition chase noise.
- A kernel takes the sum over its stages of executions (loop trips) x time at the kernel's grid,
  plus its grid barriers executed, each ``DeviceModel.grid_sync_seconds`` of its co-resident grid
  (a barrier waits for every block, so a wider grid's costs more: an H100 measured 1.12 us at 132
  blocks, 1.29 at 264); a kernel's first item waits for its launch, not a barrier.
- A split costs one kernel launch (``DeviceModel.launch_seconds``; top-level items run once per
  inference) plus the DRAM round trip, written then read back at ``mem_bandwidth``, of the
  tensors the kernel before it writes and later kernels read: within one kernel they are assumed
  to stay in L2.

Among partitions of equal estimated time the one with fewer kernels wins, so a program whose
items all get grids of at least ``S`` blocks (or all the same grid) is one kernel without
estimating anything.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from analysis.characterize import stage_cost
from analysis.device import DeviceModel, Occupancy, co_resident_grid
from codegen.staged import Loop, Stage, StagedProgram, copy_items, count_items
from codegen.tensor_core import WARP
from codegen.traffic import memory_traffic
from souffle.errors import GraphError, TargetError
from souffle.passes import Outcome

# Registers per thread of each schedule template, from ptxas (nvcc 13.0) on one-stage kernels
# built by this repository's pipeline, sm_90 and sm_80: elementwise (relu, gelu, add over
# 4096x1024) 28-32; thread_reduce (a 512x1024x256 dense, a 3x3 convolution) 30-31; warp_reduce
# 32-39 for softmax and layer-norm statistics but 48 (sm_90) and 62 (sm_80) for a 1024-long GEMV,
# whose unrolled reduction keeps partial sums live. Each figure is the most measured, rounded up to
# the 8 registers per thread in which they are allocated (256 per warp). Whole models' kernels
# use more than any of their stages (paper configs: MMoE 40, BERT 64, LSTM 80-94, ResNeXt 128
# and spilling), as values stay live across stages: the estimate is a floor, used only to decide
# the partition before ptxas runs; the compiled kernel's grid comes from ptxas' figure.
# matmul (dlight's rule, 16 accumulators per thread, 128-bit shared loads): 80 on sm_90 and sm_80
# for two dense stages (tests/test_matmul_stage.py's kernel) and for a 384 x 3072 x 768 dense, no spills.
# database (a MetaSchedule schedule, ``codegen.tuned``): its code is the tuner's, unknown until
# ptxas; 128, the most any of this project's own stages but the tensor-core tiles needs, rounded up.
REGISTER_ESTIMATES = {"elementwise": 32, "thread_reduce": 32, "warp_reduce": 64, "matmul": 80, "database": 128}
# tensor_core (wmma fragments): each thread of the tile's warps holds its share of the block tile's
# float32 accumulators (rows x columns / the tile's threads registers; a tile of 4 warps in a block
# of 8 leaves the others idle) on top of a base for its operand fragments and addresses,
# TENSOR_CORE_BASE_REGISTERS, fitted to ptxas on sm_90 (tests/test_tensor_core.py).
TENSOR_CORE_BASE_REGISTERS = 60

# The fraction of an SM's thread slots at which a stage is taken to reach the device's throughput.
# An assumption, not a measurement: a streaming stage needs enough warps in flight to cover DRAM
# latency, and beyond about half of the slots more warps hide no more of it; no GPU has timed
# these kernels yet.
SATURATING_OCCUPANCY = 0.5


@dataclass(frozen=True)
class Split:
    """A new kernel starts at the top-level item named ``before``, for ``reason``."""

    before: str  # Stage.name or Loop.name
    reason: str


@dataclass(frozen=True)
class Partition:
    """The staged program's top-level items grouped into kernels, in order."""

    kernels: list[list]
    splits: list[Split]  # one per kernel after the first
    occupancy: list[Occupancy]  # each kernel's co-resident grid

    def __str__(self) -> str:
        if len(self.kernels) == 1:
            occupancy = self.occupancy[0]
            return (f"1 kernel: every stage co-resident at grid {occupancy.grid} on {occupancy.device} "
                    f"({occupancy.blocks_per_sm} blocks/SM, limited by {occupancy.limiter})")
        lines = [f"{len(self.kernels)} kernels on {self.occupancy[0].device}:"]
        for k, (items, occupancy) in enumerate(zip(self.kernels, self.occupancy)):
            if k:
                lines.append(f"  {self.splits[k - 1].reason}")
            span = items[0].name if len(items) == 1 else f"{len(items)} items, {items[0].name} .. {items[-1].name}"
            lines.append(f"  kernel {k + 1}: {span}; grid {occupancy.grid} "
                         f"({occupancy.blocks_per_sm} blocks/SM, limited by {occupancy.limiter})")
        return "\n".join(lines)


def stage_registers(stage: Stage) -> int:
    """Registers per thread ``stage`` is estimated to need (``REGISTER_ESTIMATES``)."""
    template = stage.schedule.template
    if template == "tensor_core":
        tile = stage.schedule.tensor_core_tile
        return TENSOR_CORE_BASE_REGISTERS + tile.rows * tile.columns // (tile.warps * WARP)
    if template not in REGISTER_ESTIMATES:
        raise ValueError(f"stage {stage.name}: no register estimate for template {template!r} "
                         f"(known: {', '.join(REGISTER_ESTIMATES)}, tensor_core)")
    return REGISTER_ESTIMATES[template]


def saturating_grid(device: DeviceModel, threads: int) -> int:
    """Blocks of ``threads`` threads that reach the device's throughput: every SM running
    ``SATURATING_OCCUPANCY`` of its thread slots (at least one block)."""
    return device.sms * max(1, int(device.max_threads_per_sm * SATURATING_OCCUPANCY) // threads)


def time_at_grid(seconds: float, n_tiles: int, grid: int, saturating: int) -> float:
    """One execution of a stage of ``n_tiles`` tiles whose roofline time is ``seconds``, on
    ``grid`` blocks: the device's throughput scaled by the share of ``saturating`` blocks at work."""
    return seconds * saturating / min(saturating, grid, n_tiles)


def _stages(item, loops: tuple[str, ...] = ()) -> list[tuple[Stage, tuple[str, ...]]]:
    """The stages of ``item``, each with the loops around it."""
    if isinstance(item, Loop):
        return [found for inner in item.items for found in _stages(inner, loops + (item.name,))]
    return [(item, loops)]


@dataclass
class _Item:
    """A top-level item with what partitioning needs of it."""

    item: Stage | Loop
    stages: list[Stage]
    registers: list[int]  # per stage
    grid: int  # its co-resident grid alone
    writes: set  # buffers its stages write
    reads: set  # buffers its stages read


def _item(item, device: DeviceModel, threads: int, registers: Callable[[Stage], int]) -> _Item:
    """``item`` with its resources; refuses, naming the stage, one no kernel can hold."""
    stages = [stage for stage, _ in _stages(item)]
    counts = [registers(s) for s in stages]
    for (stage, loops), count in zip(_stages(item), counts):
        try:
            co_resident_grid(count, stage.schedule.shared_bytes, device, threads)
        except TargetError as error:
            where = f" (in loop {'/'.join(loops)})" if loops else ""
            raise TargetError(f"stage {stage.name}{where} needs {count} registers per thread and "
                              f"{stage.schedule.shared_bytes} B of shared memory per block with {threads} threads: "
                              f"no kernel running it can be co-resident ({error})") from None
    occupancy = co_resident_grid(max(counts), max(s.schedule.shared_bytes for s in stages), device, threads)
    return _Item(item, stages, counts, occupancy.grid, {s.write.base for s in stages},
                 {ref.base for s in stages for ref in s.reads})


def _occupancy(items: list[_Item], device: DeviceModel, threads: int) -> Occupancy:
    registers = max(r for it in items for r in it.registers)
    shared = max(s.schedule.shared_bytes for it in items for s in it.stages)
    return co_resident_grid(registers, shared, device, threads)


def _nbytes(buffer) -> int:
    return math.prod(int(d) for d in buffer.shape) * np.dtype(str(buffer.dtype)).itemsize


class _Estimate:
    """The module docstring's cost model over one program's top-level items."""

    def __init__(self, staged: StagedProgram, items: list[_Item], device: DeviceModel, saturating: int):
        self.device = device
        self.saturating = saturating
        traffic = iter(memory_traffic(staged).stages)  # program order, as the items' stages
        self.runs = [[(s.schedule.n_tiles, t.executions, stage_cost(s.tensor, t.bytes_read, device).time_s)
                      for s, t in zip(it.stages, traffic)] for it in items]
        self.last_read: dict = {}
        for k, it in enumerate(items):
            self.last_read.update(dict.fromkeys(it.reads, k))
        self.prefix: dict[int, list[float]] = {}  # grid -> seconds of items[:k]' stages at that grid
        self.own_barrier = [it.item.barrier is not None for it in items]
        self.barriers = list(itertools.accumulate(
            (count_items([it.item], lambda s: s.barrier is not None, executed=True) for it in items), initial=0))

    def seconds(self, start: int, stop: int, grid: int) -> float:
        """Items ``start`` to ``stop`` (exclusive) run in one kernel of ``grid`` blocks."""
        barriers = self.barriers[stop] - self.barriers[start] - self.own_barrier[start]
        synced = barriers * self.device.grid_sync_seconds(grid)
        grid = min(grid, self.saturating)  # every larger grid runs the stages as fast
        if grid not in self.prefix:
            per_item = (sum(runs * time_at_grid(t, n, grid, self.saturating) for n, runs, t in item)
                        for item in self.runs)
            self.prefix[grid] = list(itertools.accumulate(per_item, initial=0.0))
        return self.prefix[grid][stop] - self.prefix[grid][start] + synced

    def round_trip(self, nbytes: int) -> float:
        return 2 * nbytes / self.device.mem_bandwidth


def _cheapest_starts(items: list[_Item], estimate: _Estimate) -> list[int]:
    """Where each kernel starts in the partition of least estimated time (fewest kernels among
    equals), by dynamic programming over the item where the last kernel starts.

    A kernel's grid is the smallest of its items' grids (occupancy falls as any resource grows);
    the bytes crossing its end are those its items write and an item after it reads, kept as a
    running sum: a buffer counts from its first writer in the kernel until its last reader."""
    n = len(items)
    best = [(0.0, 0)] + [(math.inf, 0)] * n  # (seconds, kernels) of the best partition of items[:k]
    start_of_last = [0] * (n + 1)
    for start in range(n):
        grid, crossing, seen, expiring = math.inf, 0, set(), Counter()
        for stop in range(start + 1, n + 1):
            item = items[stop - 1]
            grid = min(grid, item.grid)
            crossing -= expiring.pop(stop, 0)
            for buffer in item.writes - seen:
                seen.add(buffer)
                last = estimate.last_read.get(buffer, -1)
                if last >= stop:
                    crossing += _nbytes(buffer)
                    expiring[last + 1] += _nbytes(buffer)
            split = estimate.device.launch_seconds + estimate.round_trip(crossing) if stop < n else 0.0
            candidate = (best[start][0] + estimate.seconds(start, stop, grid) + split, best[start][1] + 1)
            if candidate < best[stop]:
                best[stop], start_of_last[stop] = candidate, start
    starts, stop = [], n
    while stop:
        stop = start_of_last[stop]
        starts.append(stop)
    return starts[::-1]


def _reason(before: list[_Item], after: list[_Item], estimate: _Estimate, offsets: tuple[int, int, int],
            device: DeviceModel, threads: int) -> str:
    """Why the kernel ``after`` is not merged into ``before``: the grid one kernel would get and
    what limits it, the stages' time there and apart, and the split's cost."""
    start, middle, stop = offsets
    merged = _occupancy(before + after, device, threads)
    stages = [(s, r) for it in before + after for s, r in zip(it.stages, it.registers)]
    if merged.limiter == "registers":
        stage, count = max(stages, key=lambda sr: sr[1])
        need = f"{count} registers per thread"
    else:
        stage, _ = max(stages, key=lambda sr: sr[0].schedule.shared_bytes)
        need = f"{stage.schedule.shared_bytes / 1024:.0f} KB of shared memory per block"
    grid_before, grid_after = min(it.grid for it in before), min(it.grid for it in after)
    together = estimate.seconds(start, stop, merged.grid)
    apart = estimate.seconds(start, middle, grid_before) + estimate.seconds(middle, stop, grid_after)
    handed = sum(_nbytes(b) for b in set().union(*(it.writes for it in before))
                 if middle <= estimate.last_read.get(b, -1) < stop)
    launch = device.launch_seconds
    cost = launch + estimate.round_trip(handed)
    return (f"split before {after[0].item.name}: {stage.name} needs {need}, so one kernel for the {len(stages)} "
            f"stages of this kernel and the one before would fit {merged.blocks_per_sm} blocks/SM (grid {merged.grid}) "
            f"where apart they get grids {grid_before} and {grid_after}; at grid {merged.grid} their stages and grid "
            f"barriers would take "
            f"{together * 1e6:.1f} us instead of {apart * 1e6:.1f} us, {(together - apart) * 1e6:.1f} us more, "
            f"against a split's cost of {cost * 1e6:.1f} us (launch {launch * 1e6:.1f} us + DRAM round trip of "
            f"{handed / 1e6:.2f} MB the kernel before writes for this one)")


def partition(staged: StagedProgram, device: DeviceModel,
              registers: Callable[[Stage], int] | None = None) -> Partition:
    """``staged``'s top-level items as kernels on ``device``: one kernel unless the cost model
    (module docstring) finds a split that pays for itself. ``registers`` gives a stage's registers
    per thread (``stage_registers`` by default); a stage no kernel can hold raises ``TargetError``."""
    registers = registers or stage_registers
    items = [_item(item, device, staged.threads, registers) for item in staged.items]
    saturating = saturating_grid(device, staged.threads)
    if len({min(it.grid, saturating) for it in items}) <= 1:
        starts, estimate = [0], None
    else:
        estimate = _Estimate(staged, items, device, saturating)
        starts = _cheapest_starts(items, estimate)
    bounds = list(zip(starts, starts[1:] + [len(items)]))
    groups = [items[a:b] for a, b in bounds]
    splits = [Split(after[0].item.name, _reason(before, after, estimate, (a, b, c), device, staged.threads))
              for before, after, (a, b), (_, c) in zip(groups, groups[1:], bounds, bounds[1:])]
    return Partition([[it.item for it in group] for group in groups], splits,
                     [_occupancy(group, device, staged.threads) for group in groups])


def split_kernels(staged: StagedProgram, splits: list[Split]) -> StagedProgram:
    """``staged`` with a new kernel starting at each top-level item a split names, with its reason."""
    items = copy_items(staged.items)
    by_name = {split.before: split.reason for split in splits}
    for item in items:
        if item.name in by_name:
            item.launch, item.barrier = by_name.pop(item.name), None
    if by_name:
        raise GraphError(f"{staged.name}: the partition splits before {sorted(by_name)}, which are not top-level items")
    return staged.with_items(items)


def partition_kernels(staged: StagedProgram, device: DeviceModel) -> Outcome:
    """``staged`` split into the kernels ``partition`` chooses on ``device``, the partition
    (with each split's reason) as its note."""
    chosen = partition(staged, device)
    return Outcome(split_kernels(staged, chosen.splits), [str(chosen)])
