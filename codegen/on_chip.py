"""The ``keep_weights_on_chip`` pass (O4): weights a loop reads, loaded into shared memory once.

A stage inside a loop (the LSTM's gate product, run once per step) reads the same weight at
every iteration. Where each of its tiles reads its own contiguous slice of the weight, every
block loads its tiles' slices into its shared memory once, before the loop, and the stage reads
them from there: across the loop the weight is read from DRAM once instead of once per trip.

Only while it costs no residency: the weights take at most the shared memory that leaves the
kernel as many blocks per SM as its registers and threads allow. On chip at the price of blocks
was slower on both GPUs that ran it: paper LSTM fp32 took 1.51 ms on an H100 with its weights in
shared memory at 1 block/SM against 1.00 ms with them in global memory at 6 blocks/SM
(benchmarks/results/gpu_h100.md), and 1.49 against 1.20 ms on an H200 (gpu_h200.md); tiny LSTM,
whose weights fit without losing a block, was faster on chip (33 against 37 us on the H100).

A block keeps the slices of the tiles it runs, so the slices a block needs fall as the grid
grows: a weight is placed for the smallest grid of whole blocks per SM, up to that residency, at
which its slices fit (or one block per tile of the kernel's widest stage where that is fewer).
Paper LSTM's 1280 tiles of 16 KB are 10 slices a block at 132 blocks (160 KB), which never fit,
and 3 at 4 blocks/SM on an H100 (528 blocks, 48 KB), which do; a weight that fits at one block
per SM asks for no more. The launch then needs that grid (``OnChip.min_grid``):
``codegen.cuda.cuda_compile`` holds ptxas to its blocks per SM with ``__launch_bounds__`` where
ptxas would leave fewer, which the smallest grid makes as rare as it can.
"""

from __future__ import annotations

import islpy as isl
import numpy as np

from analysis.device import SHARED_RESERVED_PER_BLOCK, co_resident_grid
from codegen.partition import stage_registers
from codegen.staged import Loop, OnChip, Stage, StagedProgram, copy_items, flat_index, loops_in, stage_tiles, stages_in
from souffle.passes import Outcome


def tile_slice(stage: Stage, read: int) -> int | None:
    """Elements per tile when tile t of ``stage`` reads exactly the contiguous run
    ``[t * n, (t + 1) * n)`` of its ``read``-th input (a GEMV's weight rows); else None."""
    holder = stage.placeholders[read]
    relation, exact = stage.read_relation(holder)
    if not exact:
        return None
    tiles = stage_tiles(stage.schedule, relation.get_tuple_name(isl.dim_type.in_), stage.tensor.shape, "T")
    names = [f"o{k}" for k in range(len(holder.shape))]
    flat = isl.Map(f"{{ {relation.get_tuple_name(isl.dim_type.out)}[{', '.join(names)}] -> F[f] : "
                   f"f = {flat_index(names, holder.shape)} }}")
    footprint = tiles.reverse().apply_range(relation).apply_range(flat)
    first = footprint.intersect_domain(isl.Set("{ T[0] }")).range()
    n = int(first.count_val().to_python()) if first.is_bounded() else 0
    if n == 0:
        return None
    size = int(np.prod([int(d) for d in holder.shape]))
    expected = isl.Map(f"{{ T[t] -> F[f] : 0 <= t < {stage.schedule.n_tiles} and t * {n} <= f < (t + 1) * {n} "
                       f"and f < {size} }}")
    return n if footprint.is_equal(expected) else None


def keep_weights_on_chip(staged: StagedProgram, device) -> Outcome:
    """``staged`` with the weight slices its loops' stages read loaded into each block's shared
    memory before the loop, where every tile reads its own contiguous slice and the device's
    shared memory per block holds them at a grid of the kernel's residency or fewer blocks per SM
    (the blocks per SM its registers and threads allow; see the module docstring) without
    lowering that residency; one note per weight, kept or not. Loops that launch kernels from the
    host are left alone."""
    items = copy_items(staged.items)
    placing = _Placement(staged, device)
    for kernel in _kernels(items):
        blocks = placing.residency(stages_in(kernel), staged.threads)
        widest = max(s.schedule.n_tiles for s in stages_in(kernel))
        grids = sorted({min(b * device.sms, widest) for b in range(1, blocks + 1)})
        for loop in [item for item in loops_in(kernel) if not item.on_host]:
            placing.loop(loop, grids)
    return Outcome(staged.with_items(items), placing.notes)


def _kernels(items: list) -> list[list]:
    """The top-level items grouped by the kernel they run in."""
    kernels: list[list] = []
    for item in items:
        if item.launch is not None or not kernels:
            kernels.append([])
        kernels[-1].append(item)
    return kernels


class _Placement:
    """The shared memory per block left, where each dtype's next copy starts, and the notes."""

    def __init__(self, staged: StagedProgram, device):
        self.weights = set(staged.weight_buffers)
        self.device = device
        self.stage_shared = max(s.schedule.shared_bytes for s in staged.stages())
        self.capacity = device.smem_per_block - self.stage_shared  # for weights, per block
        self.placed = 0  # bytes of weights placed per block
        self.limit = f"shared memory left per block on {device.name}"
        self.used: dict[str, int] = {}  # dtype -> elements of on-chip memory taken
        self.notes: list[str] = []

    @property
    def budget(self) -> int:
        return self.capacity - self.placed

    def residency(self, stages: list[Stage], threads: int) -> int:
        """The blocks per SM that ``stages`` (one kernel's) get from their registers
        (``stage_registers``) and threads; the weights' shared memory capped at what keeps them."""
        registers = max(stage_registers(s) for s in stages)
        blocks = co_resident_grid(registers, self.stage_shared, self.device, threads).blocks_per_sm
        keeps = self.device.smem_per_sm // blocks - SHARED_RESERVED_PER_BLOCK - self.stage_shared
        if keeps < self.capacity:
            self.capacity = max(keeps, 0)
            self.limit = f"shared memory per block that keeps {blocks} blocks/SM on {self.device.name}"
        return blocks

    def loop(self, loop: Loop, grids: list[int]):
        """Place the weights ``loop``'s stages read, each for the first of ``grids`` (ascending)
        at which its slices fit."""
        for stage in stages_in(loop.items):
            for k, ref in enumerate(stage.reads):
                if ref.base not in self.weights or not isinstance(ref.offset, int) or k in stage.on_chip:
                    continue
                per_tile = tile_slice(stage, k)
                if per_tile is None:
                    continue
                loads = [OnChip(stage.name, ref, stage.schedule.n_tiles, per_tile, -(-stage.schedule.n_tiles // grid),
                                grid, self.used.get(ref.spec.dtype, 0)) for grid in grids]
                load = next((load for load in loads if load.bytes <= self.budget), loads[-1])
                where = f"{ref.spec.name} (read by {stage.name} in loop {loop.name})"
                if load.bytes > self.budget:
                    self.notes.append(
                        f"{where} stays in global memory: {load.slots} tiles per block x "
                        f"{per_tile * np.dtype(ref.spec.dtype).itemsize} B = {load.bytes} B > {self.budget} B, the "
                        f"{self.limit}")
                    continue
                self.placed += load.bytes
                self.used[load.dtype] = load.offset + load.elements
                stage.on_chip[k] = load
                loop.loads.append(load)
                self.notes.append(
                    f"{where} on chip: {load.slots} tiles per block x {per_tile} elements, {load.bytes} B of shared "
                    f"memory per block at {load.min_grid} blocks or more, loaded once per inference")
