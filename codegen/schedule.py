"""Per-stage schedules for the persistent kernel: one template per stage shape.

Every stage of the persistent kernel runs on the same thread block (``THREADS`` threads: warps
of 32 along ``threadIdx.x``, ``THREADS / 32`` warps along ``threadIdx.y``) and covers its
output in ``n_tiles`` tiles; a tile is a contiguous run of
``per_tile`` elements of the row-major output, so which tile wrote an element is
``floor(flat_index / per_tile)`` — the map ``codegen.barriers`` uses to decide where a grid
barrier is needed. The tile loop is the outermost loop of the stage (bound to ``blockIdx.x`` on
the GPU); ``codegen.cuda`` and ``codegen.llvm`` replace it with the persistent
``for tile in range(block, n_tiles, grid)`` loop.

Templates, chosen from the block's iterators (never from an op's name):

- ``elementwise``: no reduction. The output is walked in tiles of ``unroll x THREADS``
  elements, consecutive threads on consecutive elements (coalesced).
- ``warp_reduce``: few outputs, long reductions (softmax and norm statistics, a GEMV):
  one output per warp, its reduction split across the warp's 32 lanes (coalesced reads) and
  combined by TVM's cross-thread all-reduce, which for one warp is register shuffles only —
  no shared memory and no block-wide synchronization.
- ``thread_reduce``: enough outputs to give every thread of the grid its own (GEMMs,
  convolutions): one output per thread, ``THREADS`` per tile, the reduction serial in a
  register, stored once (``schedule_te``).

A stage may carry an *epilogue*: the one element-wise consumer of its reduction, computed in
the same tile so the reduction's result never goes to global memory (``epilogue_mode``):

- ``register``: the consumer reads each result at its own index; it runs in the thread that
  holds the result, straight from registers (a GEMM's bias and activation);
- ``shared``: the consumer reads several results of the same tile (the LSTM cell reads the
  four gates of its unit); the tile's results go to shared memory and, after a
  ``__syncthreads``, all the block's threads compute the consumer's tile: the contiguous run of
  its row-major output that reads exactly those results.

The same split is made for the CPU (``gpu=False``) without binding threads, so the CPU runs
exactly the tiles the GPU runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import reduce as _fold

import tvm
from tvm import s_tir, te, tirx

from souffle.errors import SouffleError

THREADS = 256  # one thread-block shape for every stage of a kernel
WARP = 32
WARP_REDUCE_MIN_EXTENT = 32  # shorter reductions leave lanes of the warp idle
GRID_WAVE = 132 * 2  # tiles that keep a full GPU busy (H200: 132 SMs, two blocks each)


@dataclass(frozen=True)
class StageSchedule:
    """How one stage is tiled: the facts the kernel builder and the barrier analysis need."""

    template: str
    n_tiles: int
    per_tile: int  # output elements per tile, contiguous in the row-major output
    threads: int
    outputs: int  # output elements
    shared_bytes: int  # shared memory the stage allocates per block

    def __str__(self):
        shared = f", {self.shared_bytes} B shared" if self.shared_bytes else ""
        return f"{self.template} {self.n_tiles} tiles x {self.per_tile} elements, {self.threads} threads{shared}"


class ScheduleError(SouffleError):
    """A stage no template can schedule (the message says which and why)."""


def _extent(sch: s_tir.Schedule, loop) -> int:
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm):
        raise ScheduleError(f"loop {sch.get(loop).loop_var} has a symbolic extent {extent}")
    return int(extent.value)


def _only_block(sch: s_tir.Schedule):
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        raise ScheduleError(f"a stage must be one TE block, got {len(blocks)}")
    return blocks[0]


def _product(values) -> int:
    return _fold(lambda a, b: a * b, values, 1)


def choose_template(spatial: int, reduction: int, threads: int = THREADS) -> str:
    """The template for a block with ``spatial`` outputs and ``reduction`` terms per output."""
    if reduction == 1:
        return "elementwise"
    if reduction >= WARP_REDUCE_MIN_EXTENT and spatial < GRID_WAVE * threads:
        return "warp_reduce"
    return "thread_reduce"


def tiling(outputs: int, reduction: int, threads: int = THREADS) -> tuple[str, int]:
    """(template, output elements per tile) for a stage of that shape."""
    template = choose_template(outputs, reduction, threads)
    if template == "elementwise":
        return template, (4 if outputs >= 4 * threads * GRID_WAVE else 1) * threads
    return template, threads // WARP if template == "warp_reduce" else threads


def schedule_stage(func: tirx.PrimFunc, gpu: bool, threads: int = THREADS,
                   epilogue_mode: str | None = None) -> tuple[tirx.PrimFunc, StageSchedule]:
    """Tile the block of ``func`` (a single TE from ``te.create_prim_func``, or a reduction and
    its epilogue, see ``epilogue_mode``) for blocks of ``threads`` threads; ``gpu`` binds the
    tile and thread loops, the CPU runs them serially."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if epilogue_mode is None:
        block = _only_block(sch)
    elif len(blocks) != 2 or epilogue_mode not in ("register", "shared"):
        raise ScheduleError(f"an epilogue stage is a reduction and its consumer, 'register' or 'shared'; "
                            f"got {len(blocks)} blocks and {epilogue_mode!r}")
    else:
        block = blocks[0]
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    n_spatial = sum(1 for k in kinds if k == tirx.IterVar.DataPar)
    if any(k not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce) for k in kinds) or \
            any(k == tirx.IterVar.DataPar for k in kinds[n_spatial:]):
        raise ScheduleError(f"block {sch.get(block).name_hint}: iterators must be spatial, then reductions")
    if epilogue_mode == "shared":
        _flatten_shared_epilogue(sch, block, blocks[1], n_spatial)
        n_spatial = min(n_spatial, 1)
        loops = sch.get_loops(block)
    spatial_loops, reduce_loops = loops[:n_spatial], loops[n_spatial:]
    outputs = _product(_extent(sch, loop) for loop in spatial_loops)
    reduction = _product(_extent(sch, loop) for loop in reduce_loops)
    template, per_tile = tiling(outputs, reduction, threads)
    fused = _outer_loop(sch, spatial_loops, loops, block)
    if epilogue_mode == "register" and outputs == 1:
        # A single result's epilogue is bound to constant indexes, which nothing guards: placed
        # in the unit loop before the split, it gets the split's guard like the reduction, or
        # every warp would store it, seven of eight from lanes that reduced nothing.
        sch.reverse_compute_at(blocks[1], fused)
    warps = threads // WARP
    if template == "elementwise":
        tile, _, warp, lane = sch.split(fused, [None, per_tile // threads, warps, WARP])
        holder = lane
    elif template == "warp_reduce":
        tile, warp = sch.split(fused, [None, warps])
        r = sch.fuse(*reduce_loops) if len(reduce_loops) > 1 else reduce_loops[0]
        _, lane = sch.split(r, [None, WARP])
        holder = warp
    else:
        tile, warp, lane = sch.split(fused, [None, warps, WARP])
        holder = lane
    if epilogue_mode is not None:
        tile = _place_epilogue(sch, block, blocks[1], epilogue_mode, tile, holder, template, per_tile, outputs,
                               warps, gpu)
    if gpu:
        sch.bind(tile, "blockIdx.x")
        sch.bind(warp, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
    n_tiles = -(-outputs // per_tile)
    func = sch.mod["main"]
    if gpu and n_tiles == 1:
        # ``reverse_compute_at`` binds an epilogue in a single tile without the tile's index,
        # while the reduction keeps it: the two index the results differently, and TVM keeps a
        # whole local array of results per thread (98 floats for a 7 x 7 x 2 pooling) where the
        # simplified bindings agree and leave one register. (Simplified with many tiles, paper
        # EfficientNet's convolutions wrote the last tile's elements from two threads each.)
        func = s_tir.transform.StmtSimplify()(tvm.IRModule({"main": func}))["main"]
    if gpu and epilogue_mode == "shared":
        func = _synchronize_epilogue(func)
    return func, StageSchedule(template, n_tiles, per_tile, threads, outputs, _shared_bytes(sch))


def schedule_te(tensor: te.Tensor, placeholders: list[te.Tensor], gpu: bool, threads: int = THREADS,
                epilogue_mode: str | None = None) -> tuple[tirx.PrimFunc, StageSchedule]:
    """``schedule_stage`` for one TE over ``placeholders`` (a stage isolated from its program);
    an epilogue stage's tiles are counted in the epilogue's output, which the stage writes.

    A reduction that each thread computes alone (``thread_reduce``) gets a copy as its register
    epilogue: the thread sums in a register and stores once. Written in place, the output would
    be loaded and stored at every reduction step, since nvcc must assume that the arena views
    (one ``__restrict__`` pointer) alias the operands. (A ``cache_write`` does the same in
    principle, but TVM's ``reverse_compute_at`` of its write-back into a tile of 32 outputs of
    30 widened it to a 6 x 6 box with no guard, which stored past the output, and
    ``compute_at`` of the reduction into a tiled write-back broke its affine bindings.)"""
    if epilogue_mode is None and _accumulates_alone(tensor, threads):
        tensor, epilogue_mode = te.compute(tensor.shape, lambda *i: tensor(*i), name=tensor.op.name), "register"
    func, schedule = schedule_stage(te.create_prim_func(placeholders + [tensor]), gpu, threads, epilogue_mode)
    if epilogue_mode is None:
        return func, schedule
    outputs = _product(int(d) for d in tensor.shape)
    return func, dataclasses.replace(schedule, per_tile=schedule.per_tile * outputs // schedule.outputs, outputs=outputs)


def _accumulates_alone(tensor: te.Tensor, threads: int) -> bool:
    """Whether ``tensor`` is a reduction that ``thread_reduce`` schedules."""
    axes = getattr(tensor.op, "reduce_axis", [])
    analyzer = tvm.sym.Analyzer()
    extents = [analyzer.simplify(a.dom.extent) for a in axes]
    if not extents or not all(isinstance(e, tirx.IntImm) for e in extents):
        return False  # no reduction, or one ``schedule_stage`` refuses with its reason
    outputs = _product(int(d) for d in tensor.shape)
    return choose_template(outputs, _product(int(e) for e in extents), threads) == "thread_reduce"


def _outer_loop(sch: s_tir.Schedule, spatial_loops: list, loops: list, block):
    """The block's spatial loops fused into one, outermost: the loop its tiles split. A block with
    none (a rank-0 output) gets a unit loop above all its loops, so that its tile loop is the
    outermost loop and the reduction stays inside the tile."""
    if len(spatial_loops) > 1:
        return sch.fuse(*spatial_loops)
    if spatial_loops:
        return spatial_loops[0]
    return sch.add_unit_loop(loops[0] if loops else block)


def _place_epilogue(sch: s_tir.Schedule, producer, epilogue, mode: str, tile, holder, template: str,
                    per_tile: int, outputs: int, warps: int, gpu: bool):
    """Compute the epilogue inside the producer's tile: in the thread holding each result
    (``register``), or by the whole block from shared memory (``shared``). Returns the tile loop.

    A shared epilogue computes exactly its tile, the contiguous run of ``per_tile * size /
    outputs`` elements of its (flattened) output that reads the producer's tile
    (``epilogue_mode`` proved it reads nothing else): its loop is split into tiles and its tile
    loop merged with the producer's. ``reverse_compute_at`` would compute the box around what
    the tile's results feed instead, which is more than the tile where the tile's rows straddle
    a leading dimension: it computed other tiles' elements from results this tile never reduced.
    The tile's elements are walked by all the block's threads, ``WARP`` lanes by ``warps`` warps,
    like an elementwise stage: TVM does not guard a thread loop of another extent than the
    block's, so one would skip elements or write past the tile."""
    if mode == "register":
        if not sch.get(sch.get_loops(epilogue)[-1]).same_as(sch.get(holder)):
            sch.reverse_compute_at(epilogue, holder)
        sch.set_scope(producer, 0, "local")
        return tile
    if template != "warp_reduce":
        raise ScheduleError(f"a shared-memory epilogue needs a warp_reduce producer, not {template}: "
                            "a thread_reduce one would synchronize the block at every reduction step")
    (flat,) = sch.get_loops(epilogue)
    size = _extent(sch, flat)
    if (per_tile * size) % outputs:
        raise ScheduleError(f"a shared-memory epilogue of {size} elements cannot be tiled like its {outputs} results "
                            f"({per_tile} per tile)")
    own_tile, elements = sch.split(flat, [None, per_tile * size // outputs])
    tile = sch.merge(tile, own_tile)
    _, warp, lane = sch.split(elements, [None, warps, WARP])
    if gpu:
        sch.bind(warp, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        sch.set_scope(producer, 0, "shared")
    return tile


def _flatten_shared_epilogue(sch: s_tir.Schedule, producer, epilogue, n_spatial: int):
    """Index a shared epilogue's stage by flat (row-major) positions: the producer's outputs and
    its results buffer, and the epilogue's output, each one loop. A tile is then a range of one
    index, which ``_place_epilogue`` splits exactly, and TVM bounds the tile's results relative
    to the tile, keeping only them in shared memory (in their own dimensions a run of rows need
    not be a box, and the whole buffer would stay in shared memory)."""
    _flatten_spatial(sch, producer, n_spatial)
    shape = [int(d) for d in sch.get(producer).writes[0].source.shape]
    if len(shape) > 1:
        sch.transform_layout(producer, ("write", 0), lambda *index: [_row_major(index, shape)])
    _flatten_spatial(sch, epilogue, len(sch.get(epilogue).iter_vars))


def _synchronize_epilogue(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (a shared epilogue's stage) with a block barrier between the tile's reduction and
    its epilogue, and one after the epilogue. Threads read results other threads wrote, and the
    next tile overwrites them; TVM's barrier insertion takes a shared-memory access at the same
    index as the same thread's and would leave out the first barrier where a warp reads only the
    results written by its own first lane (rows of ``WARP`` elements)."""
    realize = func.body
    root = realize.block
    tile = root.body
    reduction, epilogue = tile.body.seq
    sync = tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))
    tile = tirx.For(tile.loop_var, tile.min, tile.extent, tile.kind, tirx.SeqStmt([reduction, sync, epilogue, sync]),
                    tile.thread_binding, tile.annotations)
    root = type(root)(root.iter_vars, root.reads, root.writes, root.name_hint, tile, root.init, root.alloc_buffers,
                      root.match_buffers, root.annotations)
    return func.with_body(type(realize)(realize.iter_values, realize.predicate, root))


def _row_major(index, shape):
    """The row-major flat index of ``index`` (at least one coordinate) in a tensor of ``shape``."""
    return _fold(lambda flat, pair: flat * pair[1] + pair[0], zip(index[1:], shape[1:]), index[0])


def _flatten_spatial(sch: s_tir.Schedule, block, n_spatial: int):
    """Make the block's first ``n_spatial`` (spatial) iterators one, their row-major flat index,
    iterated by one loop (the reduction iterators are kept)."""
    iters = sch.get(block).iter_vars
    if n_spatial < 2:
        return
    extents = [int(iv.dom.extent) for iv in iters[:n_spatial]]
    flat = tirx.IndexMap.from_func(lambda *index: [_row_major(index[:n_spatial], extents), *index[n_spatial:]],
                                   ndim=len(iters), index_dtype=str(iters[0].var.ty.dtype))
    sch.transform_block_layout(block, flat)


def _shared_bytes(sch: s_tir.Schedule) -> int:
    """Bytes of the shared-memory buffers the schedule allocates, each compacted to what one
    tile touches, as TVM lowers it (and pools them across stages)."""
    passes = [s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(),
              s_tir.transform.CompactBufferAllocation()]
    mod = tvm.transform.Sequential(passes)(sch.mod)
    return sum(_product(int(d) for d in b.shape) * tvm.runtime.DataType(b.dtype).bits // 8
               for b in _allocations(mod["main"].body) if b.scope().startswith("shared"))


def _allocations(stmt):
    """The buffers the blocks of ``stmt`` allocate (TVM 0.27 has no Python statement visitor)."""
    if isinstance(stmt, s_tir.SBlockRealize):
        yield from _allocations(stmt.block)
    elif isinstance(stmt, s_tir.SBlock):
        yield from stmt.alloc_buffers
        yield from _allocations(stmt.body)
    elif isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            yield from _allocations(child)
    elif isinstance(stmt, tirx.IfThenElse):
        yield from _allocations(stmt.then_case)
        if stmt.else_case is not None:
            yield from _allocations(stmt.else_case)
    elif hasattr(stmt, "body"):
        yield from _allocations(stmt.body)
