"""The staged program: the whole model as the stages of ONE persistent kernel.

A stage computes one TE tile by tile (``codegen.schedule``: tile t is the contiguous run
``[t * per_tile, (t + 1) * per_tile)`` of its row-major output, and runs on block
``t mod grid``); a loop runs its items once per iteration of a scan. The passes of the
persistent pipelines (``codegen.pipelines``) build it (``codegen.stage``) and then decide,
each returning a new program, what synchronizes its stages (``codegen.sync``,
``codegen.barriers``), where kernels start (``codegen.partition``), which weights stay on
chip (``codegen.on_chip``) and where each intermediate lives (``codegen.arena``).
``codegen.cuda`` and ``codegen.llvm`` emit it. It prints as a table, one line per stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import islpy as isl
import numpy as np
from tvm import te, tirx

from analysis.dependence import access_relations, element_dependences
from codegen.schedule import StageSchedule
from codegen.stitch import BufferRef
from souffle.graph import TensorSpec


@dataclass
class OnChip:
    """A weight a stage in a loop reads, loaded once per kernel into its block's shared memory.

    Tile t of the stage ``reader`` reads exactly the weight's elements ``[t * per_tile,
    (t + 1) * per_tile)``; a block runs tiles ``block + k * grid`` (k < ``slots``) and keeps each
    one's slice in slot k, so across the loop's iterations the weight is read from DRAM once.
    """

    reader: str  # the stage's name
    source: BufferRef  # the weight, where the stage reads it
    n_tiles: int  # the stage's tiles
    per_tile: int  # elements of the weight per tile
    slots: int  # tiles per block at the smallest grid the kernel is launched with
    # that grid: the fewest whole blocks per SM, up to the kernel's residency, at which the slices fit
    # (``codegen.on_chip``), or one block per tile of the kernel's widest stage where that is fewer
    min_grid: int
    offset: int = 0  # where the block's copy starts in the on-chip memory of its dtype (elements)

    @property
    def dtype(self) -> str:
        return self.source.spec.dtype

    @property
    def elements(self) -> int:
        return self.slots * self.per_tile

    @property
    def bytes(self) -> int:
        return self.elements * np.dtype(self.dtype).itemsize


@dataclass
class Stage:
    """One stage: a TE computed tile by tile into ``write``, reading ``reads``."""

    name: str
    tensor: te.Tensor  # the TE, over ``placeholders``
    placeholders: list[te.Tensor]  # one per read, in ``reads`` order
    func: tirx.PrimFunc  # scheduled; parameters: the placeholders, then the output
    schedule: StageSchedule
    reads: list[BufferRef]
    write: BufferRef
    barrier: str | None = None  # why a grid barrier precedes this stage; None: no barrier
    launch: str | None = None  # why a new kernel starts at this stage; None: same kernel
    # why a __syncthreads precedes this stage (it reads or overwrites what other threads of the
    # block touched since the last barrier); None: none needed, or a grid barrier is there
    block_barrier: str | None = None
    # 'register' or 'shared': ``tensor`` is a reduction's consumer fused into it; 'row': a row-resident
    # stage (``codegen.row_resident``), ``tensor`` the output that reads its rows' statistics
    epilogue: str | None = None
    on_chip: dict[int, OnChip] = field(default_factory=dict)  # read index -> the weight read from shared memory
    # where this stage's tile leaves some of the block's warps idle (``codegen.stage.idles_warps``):
    # its fastest candidate on all of them, which ``codegen.stage.keep_occupancy`` may take instead
    full_warp: Stage | None = None

    def read_relation(self, placeholder: te.Tensor) -> tuple[isl.Map, bool]:
        """Output element -> the elements of ``placeholder`` it reads (through the fused
        reduction for an epilogue stage), and whether that relation is exact."""
        if self.epilogue is None:
            access = access_relations(self.tensor)[placeholder.op]
            return access.spatial, access.exact
        dependence = element_dependences(self.tensor, placeholder)
        return dependence.relation, dependence.exact


@dataclass
class Loop:
    """A scan: ``items`` run ``trips`` times, ``var`` counting iterations."""

    name: str
    var: tirx.Var
    trips: int
    items: list
    barrier: str | None = None  # why a grid barrier precedes the loop; None: no barrier
    launch: str | None = None  # why a new kernel starts at the loop; None: same kernel
    loads: list[OnChip] = field(default_factory=list)  # weights each block loads on chip before the loop

    @property
    def on_host(self) -> bool:
        """Whether a kernel starts inside the loop, so that the host runs it and launches its kernels."""
        return any(item.launch is not None or (isinstance(item, Loop) and item.on_host) for item in self.items)


@dataclass
class StagedProgram:
    """The persistent kernel's program: stages and loops, and what the launcher must pass."""

    name: str
    items: list
    input_buffers: list[tirx.Buffer]
    weights: list[tuple[TensorSpec, np.ndarray]]
    weight_buffers: list[tirx.Buffer]
    output_buffers: list[tirx.Buffer]
    outputs: list[TensorSpec]
    threads: int
    weight_recipes: dict[str, list] = field(default_factory=dict)  # weight -> how it is made (souffle.recipe)
    slots: dict = field(default_factory=dict)  # slot buffer -> (dtype, elements)
    slot_offsets: dict = field(default_factory=dict)  # slot buffer -> element offset in its arena
    arena_sizes: dict[str, int] = field(default_factory=dict)  # dtype -> elements
    arena_buffers: dict[str, tirx.Buffer] = field(default_factory=dict)

    def with_items(self, items: list) -> StagedProgram:
        return dataclasses.replace(self, items=items)

    @property
    def on_chip(self) -> list[OnChip]:
        return [load for loop in loops_in(self.items) for load in loop.loads]

    @property
    def on_chip_bytes(self) -> int:
        """Dynamic shared memory per block for the on-chip weights."""
        return sum(load.bytes for load in self.on_chip)

    def on_chip_memory(self, blocks: int = 1, scope: str = "shared.dyn") -> dict[str, tirx.Buffer]:
        """One buffer per dtype holding ``blocks`` blocks' on-chip weight copies, side by side.
        One allocation, not one per weight: the copies are read through views, which TVM's
        liveness-based memory reuse does not see, so separate ones could be overlaid."""
        sizes: dict[str, int] = {}
        for load in self.on_chip:
            sizes[load.dtype] = sizes.get(load.dtype, 0) + load.elements
        return {dtype: tirx.decl_buffer((blocks * n,), dtype, name=f"on_chip_{dtype}", scope=scope)
                for dtype, n in sizes.items()}

    def parameters(self) -> list[tirx.Buffer]:
        """The buffers the program takes, in order: inputs, weights, outputs, arenas."""
        return self.input_buffers + self.weight_buffers + self.output_buffers + list(self.arena_buffers.values())

    def stages(self) -> list[Stage]:
        """Every stage, loop bodies included once, in program order."""
        return list(stages_in(self.items))

    def barrier_count(self, executed: bool = False) -> int:
        """Grid barriers in the code, or (``executed``) run per inference, loops unrolled."""
        return count_items(self.items, lambda s: s.barrier is not None, executed)

    def stage_count(self, executed: bool = False) -> int:
        return count_items(self.items, lambda s: isinstance(s, Stage), executed)

    def kernel_count(self, executed: bool = False) -> int:
        """Kernels in the code, or (``executed``) launched per inference."""
        first = next(iter(self.items), None)
        return count_items(self.items, lambda s: s.launch is not None, executed) + int(first is not None and first.launch is None)

    def summary(self) -> dict[str, str]:
        """The report's lines on the persistent kernel: launches, stages, barriers."""
        launches = self.kernel_count(executed=True)
        return {
            "launches": f"{launches} kernel launch{'es' if launches != 1 else ''} per inference",
            "stages": f"{self.stage_count()} ({self.stage_count(executed=True)} executed), {self.threads} threads "
                      f"per block, up to {self.max_tiles} tiles per stage",
            "grid barriers": f"{self.barrier_count()} ({self.barrier_count(executed=True)} executed)",
        }

    @property
    def max_tiles(self) -> int:
        return max(s.schedule.n_tiles for s in self.stages())

    @property
    def arena_bytes(self) -> int:
        return sum(n * np.dtype(d).itemsize for d, n in self.arena_sizes.items())

    def table(self) -> str:
        """One line per stage: its tiling, and why a kernel starts or a barrier precedes it."""
        kernels = self.kernel_count()
        head = (f"staged program {self.name}: {self.stage_count()} stages, {kernels} kernel{'s' * (kernels != 1)} "
                f"({self.kernel_count(executed=True)} launched), {self.barrier_count()} grid barriers "
                f"({self.barrier_count(executed=True)} executed), arena {self.arena_bytes / 1e6:.3f} MB")
        lines = [head]

        def emit(items, depth):
            for item in items:
                pad = "  " * depth
                if item.launch:
                    lines.append(f"{pad}== new kernel: {item.launch}")
                if item.barrier:
                    lines.append(f"{pad}-- grid barrier: {item.barrier}")
                elif getattr(item, "block_barrier", None):
                    lines.append(f"{pad}-- __syncthreads: {item.block_barrier}")
                if isinstance(item, Loop):
                    lines.extend(f"{pad}on chip: {load.source.spec.name} for {load.reader}, {load.slots} x "
                                 f"{load.per_tile} elements per block" for load in item.loads)
                    lines.append(f"{pad}loop {item.name} x{item.trips}:")
                    emit(item.items, depth + 1)
                    continue
                lines.append(f"{pad}{item.name}: {item.schedule}")

        emit(self.items, 1)
        return "\n".join(lines)

    __str__ = table


def copy_items(items: list) -> list:
    """Fresh Stage and Loop objects (sharing their TVM objects and buffers), so that a pass can
    set barriers, launches and on-chip loads on its result without changing its input."""
    return [dataclasses.replace(item, items=copy_items(item.items), loads=list(item.loads))
            if isinstance(item, Loop) else dataclasses.replace(item, on_chip=dict(item.on_chip))
            for item in items]


def replaced_stages(items: list, changes: list) -> list:
    """``items`` with each stage of ``changes`` ((old stage, new stage) pairs, the old ones by
    identity) replaced, loop bodies included; the rest shared."""
    new = {id(old): stage for old, stage in changes}
    return [dataclasses.replace(item, items=replaced_stages(item.items, changes)) if isinstance(item, Loop)
            else new.get(id(item), item) for item in items]


def synchronized(item) -> bool:
    """Whether every block waits for all others before ``item``: a grid barrier or a new kernel."""
    return item.barrier is not None or item.launch is not None


def stages_in(items):
    """The stages of ``items``, loop bodies included once, in program order."""
    for item in items:
        if isinstance(item, Loop):
            yield from stages_in(item.items)
        else:
            yield item


def loops_in(items):
    """The loops of ``items``, nested ones included, outer before inner."""
    for item in items:
        if isinstance(item, Loop):
            yield item
            yield from loops_in(item.items)


def count_items(items, predicate, executed: bool) -> int:
    """Items (stages, or loops for their own barrier) satisfying ``predicate``, loop bodies
    counted once or, ``executed``, once per trip."""
    total = 0
    for item in items:
        if isinstance(item, Loop):
            total += count_items(item.items, predicate, executed) * (item.trips if executed else 1)
        total += int(predicate(item))
    return total


# -- tiles as isl maps ------------------------------------------------------------------------
def flat_index(names: list[str], shape) -> str:
    """The row-major flat index of element ``names`` of a tensor of ``shape``, as isl text."""
    terms, stride = [], 1
    for name, extent in reversed(list(zip(names, shape))):
        terms.append(f"{stride}*{name}")
        stride *= int(extent)
    return " + ".join(terms) or "0"


def stage_tiles(schedule: StageSchedule, tuple_name: str, shape, tile_tuple: str) -> isl.Map:
    """Element of the output (of ``shape``) of a stage scheduled by ``schedule`` -> the tile
    (``tile_tuple[t]``) writing it: runs of ``per_tile`` elements, or a matmul stage's boxes."""
    if not schedule.tile_relation:
        return tiles_of(tuple_name, shape, schedule.per_tile, tile_tuple)
    relation = isl.Map(schedule.tile_relation).reverse()
    return relation.set_tuple_name(isl.dim_type.in_, tuple_name).set_tuple_name(isl.dim_type.out, tile_tuple)


def same_tiles(a: StageSchedule, b: StageSchedule) -> bool:
    """Whether two stages writing the same tensor write each element in the same tile."""
    return (a.per_tile, a.tile_relation) == (b.per_tile, b.tile_relation)


def tiles_of(tuple_name: str, shape, per_tile: int, tile_tuple: str) -> isl.Map:
    """Element of a tensor of ``shape`` -> the tile (``tile_tuple[t]``) of ``per_tile`` elements holding it."""
    names = [f"a{k}" for k in range(len(shape))]
    bounds = " and ".join(f"0 <= {n} < {int(e)}" for n, e in zip(names, shape)) or "true"
    return isl.Map(f"{{ {tuple_name}[{', '.join(names)}] -> {tile_tuple}[t] : "
                   f"t = floor(({flat_index(names, shape)})/{per_tile}) and {bounds} }}")
