"""CPU schedules for one region's PrimFunc (LLVM target, AVX2-class x86), sized by the CPU's
device model (``analysis.device.local_cpu``: its vector lanes and its per-core L2).

Every rule is keyed on a block's structure (iterator kinds, extents, and the
strides of its accesses in the flattened buffers), never on an op's name:

1. Inline a producer into its consumers when that saves a pass over memory
   without repeating work: never arithmetic into a reduction that reads each
   element many times (a GELU inlined into the next GEMM would recompute erf
   once per output column), never padding (a conditional) into a reduction,
   never a transcendental into several readers.
2. A reduction with a *vector axis* (a spatial axis that every read either
   ignores or walks with unit stride) is register-tiled: a tile of
   ``rows x width`` outputs is accumulated in registers while the whole
   reduction runs, ``width`` vectorized, ``rows`` unrolled along an axis that
   reuses the vector loads; the tile loops are fused and run in parallel.
   An intermediate buffer that is walked with the wrong stride is re-laid out
   (``transform_layout``) by its producer, which costs one strided copy instead
   of a strided read per multiply-add. Element-wise consumers of the result
   are inlined into the tile's write-back (bias, activation, transpose).
3. A reduction along a contiguous axis with no vector axis (softmax and norm
   statistics, a GEMV on an unpacked weight) is vectorized along the reduction
   with ``rfactor``.
4. Everything else runs its outer loops in parallel and vectorizes the
   innermost loop when its extent allows.

Parallel loops are only made where the work pays for waking the thread pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce as _fold

import tvm
from tvm import s_tir, sym, tirx
from tvm.ir import Range
from tvm.ir.expr import TensorLoad  # what a BufferLoad is in TVM 0.27
from tvm_ffi import structural_equal

from analysis.dependence import mentions, sub_expressions
from analysis.device import DeviceModel
from codegen.cpu_math import MAX_NESTED_EXPANDED_CALLS, MAX_NESTED_SELECTS, nested_expanded_calls, nested_selects

DEFAULT_L2_BYTES = 512 << 10  # where the device model could not read the L2's size
MAX_ACCUMULATORS = 12  # vector registers for a register tile (of 16; the rest hold loads)
PARALLEL_MIN_WORK = 1 << 14  # multiply-adds or elements below which threads cost more than they save
RFACTOR_MIN_EXTENT = 32  # shorter reductions are not worth a vector partial sum
RELAYOUT_MIN_REUSE = 16  # reads per element that repay re-laying out a buffer


# -- block structure ---------------------------------------------------------------------------
@dataclass
class _Iter:
    var: tirx.Var
    extent: int
    reduce: bool


@dataclass
class _Access:
    """One buffer access of a block: ``indices`` is None when the block touches a region
    larger than a point (several reads of the same buffer), which no rule analyses."""

    buffer: tirx.Buffer
    indices: list | None


@dataclass
class _BlockInfo:
    iters: list[_Iter]
    reads: list[_Access]
    write: _Access

    @property
    def spatial(self) -> list[int]:
        return [k for k, it in enumerate(self.iters) if not it.reduce]

    @property
    def reduces(self) -> list[int]:
        return [k for k, it in enumerate(self.iters) if it.reduce]

    @property
    def work(self) -> int:
        return _product(it.extent for it in self.iters)


def _product(values) -> int:
    return _fold(lambda a, b: a * b, values, 1)


def _access(region) -> _Access:
    ranges = list(region.region)
    point = all(isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1 for r in ranges)
    return _Access(region.source, [r.min for r in ranges] if point else None)


def _block_info(sch: s_tir.Schedule, block) -> _BlockInfo | None:
    """The block's iterators and accesses, or None unless it sits in its own loop nest, one
    loop per iterator in iterator order (as ``te.create_prim_func`` makes it), which every
    rule here assumes."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    iters = []
    for iv in stmt.iter_vars:
        kinds = (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
        if not isinstance(iv.dom.extent, tirx.IntImm) or iv.iter_type not in kinds:
            return None
        iters.append(_Iter(iv.var, int(iv.dom.extent), iv.iter_type == tirx.IterVar.CommReduce))
    if len(loops) != len(iters) or len(stmt.writes) != 1:
        return None
    for loop, it in zip(loops, iters):
        if _const_extent(sch, loop) != it.extent:
            return None
    return _BlockInfo(iters, [_access(r) for r in stmt.reads], _access(stmt.writes[0]))


def _const_extent(sch: s_tir.Schedule, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _flat_offset(access: _Access):
    offset = 0
    for index, dim in zip(access.indices, access.buffer.shape):
        offset = offset * int(dim) + index
    return offset


def _stride(info: _BlockInfo, access: _Access, axis: int, width: int) -> int | None:
    """Elements between neighbouring points of ``axis``'s innermost ``width`` split in the
    flattened ``access``: 0 (invariant), 1 (contiguous), other, or None (not affine)."""
    if access.indices is None:
        return None
    analyzer = sym.Analyzer()
    dtype = str(info.iters[axis].var.ty.dtype)
    outer = tirx.Var("outer", dtype)
    inner = tirx.Var("inner", dtype)
    analyzer.bind(outer, Range(0, info.iters[axis].extent // width))
    analyzer.bind(inner, Range(0, width))
    for k, it in enumerate(info.iters):
        if k != axis:
            analyzer.bind(it.var, Range(0, it.extent))
    analyzer.bind(info.iters[axis].var, outer * width + inner)
    offset = analyzer.simplify(_flat_offset(access))
    coefficients = sym.detect_linear_equation(offset, [inner])
    if not coefficients or not isinstance(coefficients[0], tirx.IntImm):
        return None
    return int(coefficients[0])


# -- rule 1: inlining --------------------------------------------------------------------------
def _stored_value(sch: s_tir.Schedule, block):
    body = sch.get(block).body
    return body.value if isinstance(body, tirx.BufferStore) else None


def _calls(value) -> list[str]:
    return [node.op.name for node in sub_expressions(value)
            if isinstance(node, tvm.ir.Call) and isinstance(node.op, tvm.ir.Op)]


def _reuse(info: _BlockInfo, buffer: tirx.Buffer) -> int:
    """How many times ``info``'s block reads each element of ``buffer``: the product of the
    extents of its iterators that no index of the read depends on."""
    used = set()
    for access in info.reads:
        if not access.buffer.same_as(buffer):
            continue
        if access.indices is None:
            return 1 << 30
        for index in access.indices:
            used.update(k for k, it in enumerate(info.iters) if mentions(index, it.var))
    return _product(it.extent for k, it in enumerate(info.iters) if k not in used)


def _read_count(sch: s_tir.Schedule, block, buffer: tirx.Buffer) -> int:
    value = _stored_value(sch, block)
    if value is None:
        return 1 << 30
    return sum(1 for node in sub_expressions(value) if isinstance(node, TensorLoad) and node.source.same_as(buffer))


def _worth_inlining(sch: s_tir.Schedule, block, consumers) -> bool:
    value = _stored_value(sch, block)
    if value is None:
        return False
    buffer = sch.get(block).writes[0].source
    calls = _calls(value)
    conditional = "prim.if_then_else" in calls or any(isinstance(n, tirx.Select) for n in sub_expressions(value))
    moves_data = isinstance(value, TensorLoad) or (isinstance(value, tirx.Cast) and isinstance(value.value, TensorLoad))
    transcendental = any(name != "prim.if_then_else" for name in calls)
    reads = 0
    for consumer in consumers:
        consumer_value = _stored_value(sch, consumer)
        if consumer_value is not None and _nests_too_deep_values(value, consumer_value):
            return False  # the code generator's time grows by tens per nesting level
        reads += _read_count(sch, consumer, buffer)
        if not _is_reduction(sch, consumer):
            continue
        if conditional:
            return False
        info = _block_info(sch, consumer)
        if not moves_data and (info is None or _reuse(info, buffer) > 1):
            return False
    return not transcendental or reads <= 1


def _inline_producers(sch: s_tir.Schedule):
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if _is_reduction(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if not consumers or not _worth_inlining(sch, block, consumers):
                continue
            try:
                sch.compute_inline(block)
                changed = True
            except s_tir.ScheduleError:
                continue


# -- rule 2: register tiling -------------------------------------------------------------------
@dataclass
class _TilePlan:
    vector: int  # iterator walked by the vector lanes
    width: int  # outputs per row of the tile (a multiple of the lanes)
    rows: int | None  # iterator unrolled as the tile's rows; None: more of ``vector``
    row_tile: int
    vector_tiles_outermost: bool = False  # see _tile_order
    fixes: list[tuple[int, int, bool]] = field(default_factory=list)  # (read index, dim to move last, copy first)
    score: tuple = ()


def _intermediates(sch: s_tir.Schedule) -> list[tirx.Buffer]:
    return list(sch.get(sch.get_sblock("root")).alloc_buffers)


def _layout_fix(info: _BlockInfo, access: _Access, axis: int, intermediates) -> tuple[int, bool] | None:
    """How to make ``axis`` walk ``access`` contiguously: (dim of its buffer to move last,
    whether the buffer is a parameter that must first be copied). Only worth it when the
    block reads each element many times, as a matrix product does."""
    if access.indices is None:
        return None
    var = info.iters[axis].var
    dims = [d for d, index in enumerate(access.indices) if mentions(index, var)]
    if len(dims) != 1 or dims[0] == len(access.indices) - 1:
        return None
    coefficients = sym.detect_linear_equation(access.indices[dims[0]], [var])
    if not coefficients or not isinstance(coefficients[0], tirx.IntImm) or int(coefficients[0]) != 1:
        return None
    if _reuse(info, access.buffer) < RELAYOUT_MIN_REUSE:
        return None  # read once per element (a row reduction): the new layout only moves the strided walk
    return dims[0], not any(access.buffer.same_as(b) for b in intermediates)


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclass(frozen=True)
class _Cpu:
    """What the rules read of the CPU: fp32 lanes of its vectors, and its per-core L2 in bytes."""

    lanes: int
    l2_bytes: int


def _tile_plan(sch: s_tir.Schedule, info: _BlockInfo, cpu: _Cpu) -> _TilePlan | None:
    """The best register tile for a reduction block, or None if no axis vectorizes."""
    if not info.reduces or info.write.indices is None:
        return None
    intermediates = _intermediates(sch)
    best = None
    for axis in info.spatial:
        extent = info.iters[axis].extent
        for width in (2 * cpu.lanes, cpu.lanes):
            if extent % width:
                continue
            strides, fixes = [], []
            for read_index, access in enumerate(info.reads):
                stride = _stride(info, access, axis, width)
                if stride not in (0, 1):
                    fix = _layout_fix(info, access, axis, intermediates)
                    if fix is None:
                        break
                    fixes.append((read_index, *fix))
                    stride = 1
                strides.append(stride)
            else:
                plan = _rows_for(info, axis, width, strides, cpu)
                plan.fixes = fixes
                out_contiguous = _stride(info, info.write, axis, width) == 1
                fix_cost = sum(2 if copy else 1 for _, _, copy in fixes)
                plan.score = (plan.row_tile * width // cpu.lanes, -fix_cost, width, out_contiguous, axis)
                if best is None or plan.score > best.score:
                    best = plan
    return best


def _rows_for(info: _BlockInfo, axis: int, width: int, strides: list[int], cpu: _Cpu) -> _TilePlan:
    """Pick the rows of the tile: another spatial axis, preferably one along which the vector
    loads are invariant (each load then feeds several accumulators). Only when no other axis
    has more than one point (a GEMV) do the rows come from the vector axis itself: otherwise
    every tile would stream its own slice of the vector operand once per point of the
    other axes (a 1x1 convolution on 7x7 pixels would read its weights 49 times)."""
    limit = MAX_ACCUMULATORS // (width // cpu.lanes)
    vector_loads = [a for a, s in zip(info.reads, strides) if s == 1]
    best = None
    for rows in info.spatial:
        extent = info.iters[rows].extent
        if rows == axis or extent == 1:
            continue
        tile = _largest_divisor(extent, limit)
        reuses = all(_stride(info, a, rows, tile) == 0 for a in vector_loads)
        key = (reuses, tile, rows)
        if best is None or key > best[0]:
            best = (key, rows, tile)
    if best is not None:
        _, rows, tile = best
        return _TilePlan(axis, width, rows, tile, _vector_tiles_outermost(info, rows, tile, strides, cpu.l2_bytes))
    tile = _largest_divisor(info.iters[axis].extent // width, limit)
    return _TilePlan(axis, width, None, tile)


def _vector_tiles_outermost(info: _BlockInfo, rows: int, tile: int, strides: list[int], l2: int) -> bool:
    """Order of the tiles. By default consecutive tiles walk the vector axis, so the rows'
    operand (read a scalar at a time, the strided one) stays in cache while the vector
    operand (packed weights, prefetchable) streams past, once per row of tiles. When that
    vector operand is larger than L2 and the rows' operand fits, the vector tiles go
    outermost instead: each slice of the big operand is read once, and the small one is
    re-read from L2 (a 1x1 convolution on 7x7 pixels: 16 MB of weights, 400 KB of pixels)."""
    vector_operand = [a for a, s in zip(info.reads, strides) if s == 1 and _stride(info, a, rows, tile) == 0]
    rows_operand = [a for a, s in zip(info.reads, strides) if s == 0 and _stride(info, a, rows, tile) != 0]
    if not vector_operand or not rows_operand:
        return False
    return max(map(_bytes, vector_operand)) > l2 >= max(map(_bytes, rows_operand))


def _bytes(access: _Access) -> int:
    return _product(int(d) for d in access.buffer.shape) * tvm.runtime.DataType(str(access.buffer.dtype)).bits // 8


def _apply_fixes(sch: s_tir.Schedule, block, plan: _TilePlan):
    """Re-lay out the buffers of ``plan.fixes``: an intermediate in place (its producer
    writes the new layout), a parameter through a re-laid-out copy."""
    for read_index, dim, copy in plan.fixes:
        shape = sch.get(block).reads[read_index].source.shape
        index = [tirx.Var(f"i{d}", str(extent.ty.dtype)) for d, extent in enumerate(shape)]
        moved = tirx.IndexMap(index, index[:dim] + index[dim + 1:] + [index[dim]], None)
        if copy:
            sch.transform_layout(sch.cache_read(block, read_index, "global"), ("write", 0), moved)
        else:
            sch.transform_layout(block, ("read", read_index), moved)


def _schedule_tiled(sch: s_tir.Schedule, block, info: _BlockInfo, plan: _TilePlan):
    write_back = sch.cache_write(block, 0, "local")
    # The accumulator tile is named *_local but kept in "global" scope: TVM 0.27 puts a
    # small global buffer on the stack, which LLVM promotes to registers, but allocates a
    # "local" one with TVMBackendAllocWorkspace, whose pointer LLVM must assume aliases
    # the operands (every multiply-add then stores and reloads its accumulator).
    sch.set_scope(block, 0, "global")
    _vector_dim_last(sch, block, info, plan.vector)
    loops = sch.get_loops(block)
    outer, reduce_loops = [], []
    row_inner = vector_inner = None
    for k, (loop, it) in enumerate(zip(loops, info.iters)):
        if it.reduce:
            reduce_loops.append(loop)
        elif k == plan.vector and plan.rows is None:
            vo, row_inner, vector_inner = sch.split(loop, [None, plan.row_tile, plan.width])
            outer.append(vo)
        elif k == plan.vector:
            vector_outer, vector_inner = sch.split(loop, [None, plan.width])
        elif k == plan.rows:
            ro, row_inner = sch.split(loop, [None, plan.row_tile])
            outer.append(ro)
        else:
            outer.append(loop)
    if plan.rows is not None and plan.vector_tiles_outermost:
        outer.insert(0, vector_outer)
    elif plan.rows is not None:
        outer.append(vector_outer)
    sch.reorder(*outer, *reduce_loops, row_inner, vector_inner)
    tile_loop = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if info.work >= PARALLEL_MIN_WORK and (_const_extent(sch, tile_loop) or 0) >= 2:
        sch.parallel(tile_loop)
    sch.unroll(row_inner)
    sch.vectorize(vector_inner)
    _inline_epilogues(sch, write_back)
    sch.reverse_compute_at(write_back, tile_loop)
    _check_stores_inside(sch, write_back)
    _vectorize_innermost(sch, write_back)
    init = sch.decompose_reduction(block, reduce_loops[0])
    _vectorize_innermost(sch, init)


def _vector_dim_last(sch: s_tir.Schedule, block, info: _BlockInfo, axis: int):
    """Lay out the tile's accumulator with the vector axis innermost, so each row of the tile
    is one vector register (a strided accumulator would be gathered and scattered)."""
    indices = sch.get(block).writes[0].region
    var = info.iters[axis].var
    dims = [d for d, r in enumerate(indices) if mentions(r.min, var)]
    if len(dims) != 1 or dims[0] == len(indices) - 1:
        return
    dim = dims[0]
    index = [tirx.Var(f"i{d}", str(r.min.ty.dtype)) for d, r in enumerate(indices)]
    sch.transform_layout(block, ("write", 0), tirx.IndexMap(index, index[:dim] + index[dim + 1:] + [index[dim]], None))


def _inline_epilogues(sch: s_tir.Schedule, write_back):
    """Fold element-wise consumers (bias, activation, a transposing copy) into the tile's
    write-back, so the result is stored once, already in its final form. Only a sole
    consumer: inlining redirects the store to its output, so any other consumer (e.g. the
    slices of a horizontally fused GEMM) would read a buffer nothing writes. And only one
    that reads each element of the tile exactly once (see ``_reads_each_element_once``)."""
    while True:
        consumers = sch.get_consumers(write_back)
        if len(consumers) != 1 or _is_reduction(sch, consumers[0]):
            return
        buffer = sch.get(write_back).writes[0].source
        if not _reads_each_element_once(sch, consumers[0], buffer) or _nests_too_deep(sch, write_back, consumers[0]):
            return
        try:
            sch.reverse_compute_inline(consumers[0])
        except s_tir.ScheduleError:
            return


def _nests_too_deep(sch: s_tir.Schedule, write_back, consumer) -> bool:
    """Whether folding ``consumer`` would nest more expanded calls (exp, tanh, erf, ...) in the
    write-back than the code generator builds in reasonable time (see ``cpu_math``): a GEMM
    followed by silu, silu, gelu_tanh and sigmoid, folded into one store, took LLVM minutes."""
    value, consumer_value = _stored_value(sch, write_back), _stored_value(sch, consumer)
    if value is None or consumer_value is None:
        return True
    return _nests_too_deep_values(value, consumer_value)


def _nests_too_deep_values(value, consumer_value) -> bool:
    """Whether ``value`` folded into ``consumer_value`` nests more expanded calls or selects than
    TVM simplifies and LLVM builds in reasonable time (see ``cpu_math``)."""
    return (nested_expanded_calls(value) + nested_expanded_calls(consumer_value) > MAX_NESTED_EXPANDED_CALLS
            or nested_selects(value) + nested_selects(consumer_value) > MAX_NESTED_SELECTS)


def _reads_each_element_once(sch: s_tir.Schedule, consumer, buffer: tirx.Buffer) -> bool:
    """Whether ``consumer``'s iteration points and ``buffer``'s elements correspond one to one
    (each point reads one element, every element is read): an element-wise op, a transpose
    or a reshape. Folding any other consumer into the write-back is wrong or impossible:
    one that reads part of the tile (a slice, a split) leaves TVM a ``T.where`` on the
    folded store, which ``reverse_compute_at`` then drops, so the whole tile is stored into
    the smaller output (past its end); a strided read makes TVM's inverse of the index map
    fail with an internal error instead of a ScheduleError."""
    info = _block_info(sch, consumer)
    value = _stored_value(sch, consumer)
    if info is None or info.reduces or value is None:
        return False
    loads = [node for node in sub_expressions(value) if isinstance(node, TensorLoad) and node.source.same_as(buffer)]
    if not loads or any(not structural_equal(list(load.indices), list(loads[0].indices)) for load in loads):
        return False
    # The map from the consumer's iterators to the indices it reads, unit iterators kept as
    # TVM's reverse_compute_inline keeps them. Bijective: no two points read the same element.
    domain = {it.var: Range(0, it.extent) for it in info.iters}
    iter_map = sym.detect_iter_map(list(loads[0].indices), domain, check_level="bijective",
                                   simplify_trivial_iterators=False)
    if not iter_map.indices:
        return False
    return [_dense_extent(index) for index in iter_map.indices] == [int(dim) for dim in buffer.shape]


def _dense_extent(index: sym.IterSumExpr) -> int | None:
    """How many values an index of an iterator map counts through, 0, 1, 2, ... in order
    (its splits' scales are 1 and each the product of the extents below it); None if it
    skips values, which TVM cannot invert: a stride, even on an iterator of one point (the
    slice ``0:1:2``), fails an internal check there."""
    if not (isinstance(index.base, tirx.IntImm) and int(index.base) == 0):
        return None
    extent = 1
    for split in sorted(index.args, key=lambda s: (int(s.scale), int(s.extent))):
        if int(split.scale) != extent:
            return None
        extent *= int(split.extent)
    return extent


def _check_stores_inside(sch: s_tir.Schedule, block):
    """Refuse a write-back that stores outside its buffer, over the iterators
    ``reverse_compute_at`` gave it (which cover the whole tile, whatever ``T.where`` the block
    had): an epilogue folded into it that covers less than the tile would otherwise write
    past the end of its output, into the arena or the heap."""
    stmt = sch.get(block)
    analyzer = sym.Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    store = stmt.body
    for index, dim in zip(store.indices, store.buffer.shape):
        bound = analyzer.const_int_bound(index)
        if bound.min_value < 0 or bound.max_value >= int(dim):
            raise AssertionError(f"CPU schedule: the write-back {stmt.name_hint!r} stores {store.buffer.name}"
                                 f"{list(store.indices)} at {index} in [{bound.min_value}, {bound.max_value}],"
                                 f" outside its shape {list(store.buffer.shape)}")


def _vectorize_innermost(sch: s_tir.Schedule, block):
    """Vectorize a tile-local block's innermost loop (its last iterator, as
    ``reverse_compute_at`` and ``decompose_reduction`` lay them out) when it stores
    contiguously along it; a strided store would be split into scalar stores anyway."""
    loops = sch.get_loops(block)
    extent = _const_extent(sch, loops[-1])
    if extent and extent % 4 == 0 and _stores_contiguously(sch.get(block)) and _vectorizable(sch, block):
        sch.vectorize(loops[-1])


def _vectorizable(sch: s_tir.Schedule, block) -> bool:
    """Whether TVM can lower ``block`` vectorized: its bfloat16 legalization leaves a vector of a
    bfloat16 constant (a fill, a reduction's initial value) unconverted and fails on its store."""
    stmt = sch.get(block)
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "bfloat16":
        return True
    return any(isinstance(node, TensorLoad) for node in sub_expressions(store.value))


def _stores_contiguously(stmt) -> bool:
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or not stmt.iter_vars:
        return False
    var = stmt.iter_vars[-1].var
    *lead, last = store.indices
    if any(mentions(index, var) for index in lead):
        return False
    coefficients = sym.detect_linear_equation(last, [var])
    return bool(coefficients) and isinstance(coefficients[0], tirx.IntImm) and int(coefficients[0]) == 1


# -- rule 3: reductions along a contiguous axis ------------------------------------------------
def _contiguous_reduction(info: _BlockInfo, lanes: int) -> bool:
    """Whether the innermost reduction iterator walks every read that uses it with unit stride."""
    axis = info.reduces[-1]
    extent = info.iters[axis].extent
    if extent < RFACTOR_MIN_EXTENT or extent % lanes:
        return False
    strides = [_stride(info, access, axis, lanes) for access in info.reads]
    return all(s in (0, 1) for s in strides) and 1 in strides


def _schedule_rfactor(sch: s_tir.Schedule, block, info: _BlockInfo, lanes: int):
    """Partial sums in vector lanes (``rf[..., lane]``), then a short sum over the lanes.
    Both run inside the same parallel loop over the outputs."""
    loops = sch.get_loops(block)
    _, lane = sch.split(loops[info.reduces[-1]], [None, lanes])
    partial = sch.rfactor(lane, factor_axis=len(info.spatial))
    sch.vectorize(sch.get_loops(partial)[-1])
    if not info.spatial:  # a reduction to one value: both run once, serial
        sch.decompose_reduction(partial, sch.get_loops(partial)[0])
        return
    spatial = sch.get_loops(partial)[: len(info.spatial)]
    outer = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    if info.work >= PARALLEL_MIN_WORK and (_const_extent(sch, outer) or 0) >= 2:
        sch.parallel(outer)
    sch.reverse_compute_at(block, outer)
    sch.decompose_reduction(partial, sch.get_loops(partial)[1])


# -- rule 4: everything else -------------------------------------------------------------------
def _schedule_plain(sch: s_tir.Schedule, block, info: _BlockInfo | None, lanes: int):
    """Outer spatial loops fused and parallel; the innermost loop vectorized when its extent
    is a multiple of the lanes, else left whole (fusing it in would put a division and a
    modulo into every element's address). Reductions keep their loops serial."""
    loops = sch.get_loops(block)
    if info is None or not loops or info.spatial != list(range(len(info.spatial))) or not info.spatial:
        return
    spatial = loops[: len(info.spatial)]
    inner = None
    if not info.reduces:
        if info.iters[len(spatial) - 1].extent % lanes == 0:
            spatial[-1], inner = sch.split(spatial[-1], [None, lanes])
        elif len(spatial) > 1:
            spatial, inner = spatial[:-1], spatial[-1]
    outer = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    if info.work >= PARALLEL_MIN_WORK and (_const_extent(sch, outer) or 0) >= 2:
        sch.parallel(outer)
    if inner is not None and _const_extent(sch, inner) == lanes and _vectorizable(sch, block):
        sch.vectorize(inner)


def _split_padding(sch: s_tir.Schedule, block) -> list:
    """A padding block (``if_then_else(inside, load, constant)``) as a fill and an interior
    copy, neither with a conditional, so both vectorize; other blocks are returned as is."""
    value = _stored_value(sch, block)
    if not (isinstance(value, tvm.ir.Call) and value.op.name == "prim.if_then_else"):
        return [block]
    try:
        fill = sch.decompose_padding(block, sch.get_loops(block)[0])
    except s_tir.ScheduleError:
        return [block]
    return [fill, block]


# -- entry point -------------------------------------------------------------------------------
def _blocks(sch: s_tir.Schedule) -> list:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def _loop_every_block(sch: s_tir.Schedule):
    """Give a block with no loop (``te.create_prim_func`` makes one for a rank-0 tensor) a
    loop of one iteration, as the rules assume; without it TVM's ``rfactor`` of a reduction
    in the same scope fails an internal check on the loop-less block."""
    for block in _blocks(sch):
        if not sch.get_loops(block):
            sch.add_unit_loop(block)


def schedule_cpu(func: tirx.PrimFunc, device: DeviceModel) -> tirx.PrimFunc:
    """A CPU schedule for one region's PrimFunc, for the CPU ``device`` describes."""
    cpu = _Cpu(device.vector_lanes, device.smem_per_block or DEFAULT_L2_BYTES)
    sch = s_tir.Schedule(func)
    _loop_every_block(sch)
    _inline_producers(sch)
    for block in _blocks(sch):  # layouts first, so producers are scheduled for their new layout
        info = _block_info(sch, block)
        if info is not None and info.reduces:
            plan = _tile_plan(sch, info, cpu)
            if plan is not None and plan.fixes:
                _apply_fixes(sch, block, plan)
    for name in [sch.get(block).name_hint for block in _blocks(sch)]:
        try:
            block = sch.get_sblock(name)
        except s_tir.ScheduleError:
            continue  # folded into an earlier tile's write-back
        _schedule_block(sch, block, _block_info(sch, block), cpu)
    return sch.mod["main"]


def _schedule_block(sch: s_tir.Schedule, block, info: _BlockInfo | None, cpu: _Cpu):
    if info is not None and info.reduces:
        plan = _tile_plan(sch, info, cpu)
        if plan is not None:
            _schedule_tiled(sch, block, info, plan)
        elif _contiguous_reduction(info, cpu.lanes):
            _schedule_rfactor(sch, block, info, cpu.lanes)
        else:
            _schedule_plain(sch, block, info, cpu.lanes)
    elif info is not None:
        for part in _split_padding(sch, block):
            _schedule_plain(sch, part, _block_info(sch, part), cpu.lanes)
