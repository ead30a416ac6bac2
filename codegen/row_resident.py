"""Row-resident stages: a row's statistics and the element-wise output that reads them, one warp
a row, the row read from memory once and kept in registers.

A softmax is a row's max, then the sum of exp(x - max), then exp(x - max) / sum; a LayerNorm
the row's sum, then the moments about its mean, then the normalized row. As a reduction stage
followed by a reduction with a shared-memory epilogue, each row was read three times, its first
statistic went through global memory, and the output was computed by the whole block after a
``__syncthreads`` (paper BERT fp16 on an H100: a softmax 14.9 us, a LayerNorm 8.2-9 us, against
the latency model's 5.0 and 3.6). Here one warp takes a row: its lanes load the row once into
registers (``WARP`` apart, so that a warp's load is coalesced; a row of 49, a Swin window's,
two columns a lane, the second in 17 of them), reduce each statistic with
shuffles (TVM's cross-thread all-reduce, which leaves the result in every lane), and write the
row's outputs, with no shared memory and no block barrier. Where the row is whole runs of a
warp's vectors, each lane takes ``row_vector`` consecutive columns in each run (up to 16 bytes: a
LayerNorm over 768 halves, 8), and loads and stores them with one instruction.

The schedule is TVM's: ``compute_at`` of each statistic into the output's warp loop,
``cache_read`` of the row into ``local`` memory, and its lowering of the cross-thread
reductions. One step is this module's own (``_thread_private``): TVM sizes a local buffer by
the region of the row the warp's blocks touch (its lanes' reductions relax over
``threadIdx.x``), so each thread would hold the whole row, where it reads only its own columns;
the cache is indexed by the thread's own columns alone, which is exact because every read of the
cache is at the reading thread's own lane, ``column // vector % WARP`` (``_reads_along_row``
checks it on the TEs).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.ir import expr as ir_expr

from analysis.affine import BINARY_NODES, Rewriter, row_major
from analysis.dependence import IF_THEN_ELSE, TENSOR_LOAD, is_call_to, mentions, sub_expressions
from codegen.schedule import (SAME_ELEMENTS_AXIS_MAX, WARP, ScheduleError, StageSchedule, lanes_can_reduce, loop_extent,
                              outer_loop, product_of, unrolled_by_nvcc)


def schedule_row_resident(tensor: te.Tensor, placeholders: list[te.Tensor], gpu: bool, threads: int,
                          rows_per_warp: int = 1, tile_rows: int | None = None) -> tuple[tirx.PrimFunc, StageSchedule]:
    """``row_resident_stage`` for a staged output TE over ``placeholders`` (``codegen.stage.isolate_fused``),
    on a GPU with its row's value computed once (``with_row_value``) where its loads cannot be cached."""
    if gpu and rows_per_warp == 1:
        tensor = with_row_value(tensor)
    return row_resident_stage(te.create_prim_func(placeholders + [tensor]), gpu, threads, rows_per_warp, tile_rows)


ROW_VALUE = "row_value"  # the name of the TE ``with_row_value`` adds


def with_row_value(tensor: te.Tensor) -> te.Tensor:
    """``tensor``, a row-resident stage's output, recomputed so that the value its first statistic
    reduces (the row: a LayerNorm's input, a softmax's scores) is a TE of its own, ``ROW_VALUE``,
    that the statistics and the output read wherever their bodies compute the same value, where
    that value loads a tensor other than at the row's own place (split-K partials: FFN2's
    ``p0 + p1 + p2 + p3 + bias + residual``), which the stage cannot cache as it caches a row of
    one tensor (``_cached_reads``). The stage then computes the row once into registers (one
    lane's columns of it, as a cache) where each statistic and the output loaded every partial
    again (paper BERT fp16's FFN2 LayerNorm: 16 loads of 4 bytes an element, now 4). Unchanged
    where there is no such load, where the value reads through a roll (``_flatten_rows``), or
    where a statistic is not one reduction of one value."""
    statistics = statistics_of(tensor)
    reads_statistic = {s.op: any(t.op in {o.op for o in statistics} for t in s.op.input_tensors) for s in statistics}
    first = [s for s in statistics if not reads_statistic[s.op]]
    if len(first) != 1 or any(len(t.op.body) != 1 for t in [*statistics, tensor]):
        return tensor
    first = first[0]
    reduce = first.op.body[0]
    rows = len(tensor.op.axis) - 1
    if not isinstance(reduce, tirx.Reduce) or len(reduce.source) != 1 or len(reduce.axis) != 1 or \
            len(first.op.axis) < rows or [int(d) for d in first.shape[:rows]] != [int(d) for d in tensor.shape[:-1]]:
        return tensor
    value, column = reduce.source[0], reduce.axis[0]
    row_axes = first.op.axis[:rows]
    own = [column.var, *(ax.var for ax in row_axes)]
    if any(not any(v.same_as(o) for o in own) for v in tirx.analysis.undefined_vars(value)) or \
            any(is_call_to(e, IF_THEN_ELSE) for e in sub_expressions(value)) or \
            all(_at_row(e, row_axes, column) for e in sub_expressions(value) if is_call_to(e, TENSOR_LOAD)):
        return tensor

    def row_value(*axes):
        variables = dict(zip([ax.var for ax in row_axes] + [column.var], axes))
        return Rewriter(variables, f"the rows of {tensor.op.name}")(value)

    values = te.compute(tensor.shape, row_value, name=ROW_VALUE)
    rebuilt: dict = {}

    def rebuild(t: te.Tensor) -> te.Tensor:
        if t.op in rebuilt:
            return rebuilt[t.op]
        op = t.op
        own_column = op.reduce_axis[0] if op.reduce_axis else op.axis[-1]
        instance = Rewriter({ax.var: axis.var for ax, axis in zip(row_axes, op.axis)} | {column.var: own_column.var},
                            f"the rows of {tensor.op.name}")(value)
        reduce_axes = {ax.var: te.reduce_axis(ax.dom, ax.var.name) for ax in op.reduce_axis}

        def body(*axes):
            variables = dict(zip([ax.var for ax in op.axis], axes)) | {v: ax.var for v, ax in reduce_axes.items()}
            def load(read, indices):
                return (rebuild(read) if read.op in reads_statistic else read)(*indices)

            rewriter = _ValueReader(variables, f"reading the rows of {tensor.op.name}", load, reduce_axes, instance,
                                    values, [ax.var for ax in op.axis[:rows]] + [own_column.var])
            return rewriter(op.body[0])

        rebuilt[op] = te.compute(t.shape, body, name=op.name, tag=op.tag, varargs_names=[ax.var.name for ax in op.axis])
        return rebuilt[op]

    return rebuild(tensor)


def _at_row(load, row_axes: list, column: tirx.IterVar) -> bool:
    """Whether the TE load ``load`` (``te.tensor_load``) reads its tensor at the row and column
    of a statistic's ``row_axes`` and reduction ``column`` only, or reads no column (as
    ``_reads_along_row`` asks of a block's loads): what a row cache holds."""
    indices = load.args[1:]
    return not any(mentions(i, column.var) for i in indices) or _at_own_place(indices, row_axes, column)


def _same_value(a, b) -> bool:
    """Whether the TE expressions ``a`` and ``b`` are the same computation: node for node, loads of
    the same tensor at the same indices (TVM's ``structural_equal`` refuses TE's tensors)."""
    if a.same_as(b):
        return True
    if type(a) is not type(b) or isinstance(a, tirx.Var):
        return False
    if isinstance(a, (tirx.IntImm, tirx.FloatImm)):
        return a.ty == b.ty and a.value == b.value
    if isinstance(a, BINARY_NODES):
        return _same_value(a.a, b.a) and _same_value(a.b, b.b)
    if isinstance(a, tirx.Not):
        return _same_value(a.a, b.a)
    if isinstance(a, tirx.Select):
        return all(_same_value(x, y) for x, y in ((a.condition, b.condition), (a.true_value, b.true_value),
                                                   (a.false_value, b.false_value)))
    if isinstance(a, tirx.Cast):
        return a.ty == b.ty and _same_value(a.value, b.value)
    if is_call_to(a, TENSOR_LOAD):
        return is_call_to(b, TENSOR_LOAD) and a.args[0].op.same_as(b.args[0].op) and \
            a.args[0].value_index == b.args[0].value_index and len(a.args) == len(b.args) and \
            all(_same_value(x, y) for x, y in zip(a.args[1:], b.args[1:]))
    if isinstance(a, tvm.ir.expr.Call):
        return a.op.same_as(b.op) and a.ty == b.ty and len(a.args) == len(b.args) and \
            all(_same_value(x, y) for x, y in zip(a.args, b.args))
    return False


class _ValueReader(Rewriter):
    """A ``Rewriter`` that reads ``values`` (``with_row_value``'s TE) wherever the body computes
    ``instance`` (the row's value at the block's own row and column, ``at``)."""

    def __init__(self, variables, where, on_load, reduce_axes, instance, values: te.Tensor, at: list):
        super().__init__(variables, where, on_load, reduce_axes)
        self.instance, self.values, self.at = instance, values, at

    def __call__(self, e):
        if _same_value(e, self.instance):
            return self.values(*[self.variables.get(v, v) for v in self.at])
        return super().__call__(e)


def row_resident_stage(func: tirx.PrimFunc, gpu: bool, threads: int, rows_per_warp: int = 1,
                       tile_rows: int | None = None) -> tuple[tirx.PrimFunc, StageSchedule]:
    """Schedule ``func``: reductions over the rows of its last block's output (the statistics,
    producers first) and that element-wise output, which reads them. Each warp takes
    ``rows_per_warp`` consecutive rows, one after the other (``codegen.align_tiles`` gives a
    softmax the tiles of the product that reads it), in tiles of ``tile_rows`` rows: by default
    every warp's; fewer (a window of 49 rows over 8 warps of 7), the last warps' last rows idle.
    Raises ``ScheduleError`` where the stage is not of that shape: a statistic whose reduction
    is not along a whole row, one that recomputes other rows', one TVM cannot split across a
    warp's lanes, or several rows a warp whose tile does not divide the last row axis."""
    sch = s_tir.Schedule(func)
    *statistics, output = sch.get_child_blocks(sch.get_sblock("root"))
    # the row's value, where ``with_row_value`` made it a block of its own: computed into registers
    values = [block for block in statistics if sch.get(block).name_hint == ROW_VALUE]
    statistics = [block for block in statistics if block not in values]
    if values and (rows_per_warp > 1 or not gpu):
        raise ScheduleError(f"block {ROW_VALUE}: a row's value is computed once a row on a GPU, one row a warp")
    if not statistics:
        raise ScheduleError("a row-resident stage needs at least one reduction before its output")
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in sch.get(output).iter_vars) or len(sch.get_loops(output)) < 2:
        raise ScheduleError(f"block {sch.get(output).name_hint}: a row-resident output is element-wise over rows")
    width = loop_extent(sch, sch.get_loops(output)[-1])
    for block in statistics:
        iters = sch.get(block).iter_vars
        reduced = product_of(int(iv.dom.extent) for iv in iters if iv.iter_type == tirx.IterVar.CommReduce)
        if reduced != width or any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce) for iv in iters):
            raise ScheduleError(f"block {sch.get(block).name_hint} reduces {reduced} terms, not a row of {width}")
        if gpu and not lanes_can_reduce(sch, block):
            raise ScheduleError(f"block {sch.get(block).name_hint}: TVM cannot reduce it across a warp's lanes")
    warps = threads // WARP
    tile_rows = tile_rows or warps * rows_per_warp
    if not warps * (rows_per_warp - 1) < tile_rows <= warps * rows_per_warp:
        raise ScheduleError(f"tiles of {tile_rows} rows are not {rows_per_warp} rows for each of {warps} warps")
    # a row read through a roll (``codegen.commute_rolls``): its rows as they are, nothing cached
    rolled = any(_loads_by_index(sch.get(block)) for block in [*values, *statistics, output])
    if rows_per_warp == 1 and not rolled:
        _flatten_rows(sch, [*values, *statistics], output, warps)
    for value in values:
        sch.set_scope(value, 0, "local")
    cached = _cached_reads(sch, statistics, output) if gpu and not rolled else []
    loops = sch.get_loops(output)
    n_rows = product_of(loop_extent(sch, loop) for loop in loops[:-1])
    # a warp's rows of a tensor of the stage's rows (not a vector every row reads, nor a row
    # gathered by index) loaded together, ``together`` at a time, before they are reduced
    sources = [sch.get(statistics[0]).reads[index].source for index in cached]
    of_rows = [product_of(int(d) for d in source.shape[:-1]) == n_rows for source in sources]
    together = rows_together(rows_per_warp, width, [str(s.dtype) for s, rows in zip(sources, of_rows) if rows],
                             tile_rows)
    if rows_per_warp > 1:
        # the last row axis split first, then the tile fused: split after fusing, the rows of a
        # 3-D tensor were bound as (t // 6, (t * 64 + ...) % 384), which TVM's bind of the
        # lanes no longer saw as affine
        *leading, last = loops[:-1]
        if loop_extent(sch, last) % tile_rows:
            raise ScheduleError(f"block {sch.get(output).name_hint}: tiles of {tile_rows} rows do not "
                                f"divide its last row axis ({loop_extent(sch, last)})")
        outer, rows = sch.split(last, [None, tile_rows])
        # a tile of fewer rows than its warps' is split past its end: TVM guards the rows
        # beyond it with a predicate, uniform across each warp's lanes
        warp, group, row = sch.split(rows, [warps, rows_per_warp // together, together])
        tile = sch.fuse(*leading, outer) if leading else outer
    else:
        tile, warp = sch.split(outer_loop(sch, loops[:-1], loops, output), [None, warps])
        group = row = warp
    depth = 4 if rows_per_warp > 1 else 2  # the loops a row's blocks are computed under: tile, warp (, group, row)
    vector = row_vector(width, [sch.get(block) for block in [*values, *statistics, output]]) \
        if gpu and not rolled else 1
    _, lane, *lane_vector = sch.split(sch.get_loops(output)[-1], _lanes(vector))
    for block in reversed(statistics):
        sch.compute_at(block, row)
    caches = []
    for value in values:  # as a row cache is, each lane its own columns
        sch.compute_at(value, row)
        if product_of(loop_extent(sch, loop) for loop in sch.get_loops(value)[depth:]) != width:
            raise ScheduleError(f"block {ROW_VALUE}: a warp computes more than its row of it")
        _, value_lane, *value_vector = sch.split(sch.get_loops(value)[-1], _lanes(vector))
        sch.bind(value_lane, "threadIdx.x")
        if value_vector:
            _compute_in_vectors(sch, value_vector[0], vector)
        caches.append((sch.get(value).writes[0].source, 1))
    for block in statistics:
        own = sch.get_loops(block)[depth:]
        kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
        spatial = own[:len(own) - kinds.count(tirx.IterVar.CommReduce)]
        per_row = product_of(loop_extent(sch, loop) for loop in spatial)
        results = product_of(int(d) for d in sch.get(block).writes[0].source.shape)
        if per_row * n_rows != results or per_row > SAME_ELEMENTS_AXIS_MAX:
            raise ScheduleError(f"block {sch.get(block).name_hint}: a warp would compute {per_row} of its results, "
                                f"not its row's {results // n_rows}")
        reduce_loops = own[len(spatial):]
        fused = sch.fuse(*reduce_loops) if len(reduce_loops) > 1 else reduce_loops[0]
        block_lane = sch.split(fused, _lanes(vector))[1]
        sch.set_scope(block, 0, "local")
        if gpu:
            sch.bind(block_lane, "threadIdx.x")
            # a row's several results (a LayerNorm's two moments) unrolled by nvcc (``#pragma
            # unroll``; unrolled in TIR, the lanes' reduction buffers would be allocated twice):
            # indexed by a loop, nvcc put the array in local memory (paper BERT fp16's FFN2
            # LayerNorm, from its PTX)
            unrolled_by_nvcc(sch, spatial)
    for index, of_row in zip(cached, of_rows):
        rows = together if of_row else 1
        cache = sch.cache_read(statistics[0], index, "local", consumer_blocks=[*statistics, output])
        sch.compute_at(cache, group if rows > 1 else row)
        if product_of(loop_extent(sch, loop) for loop in sch.get_loops(cache)[depth - 1 if rows > 1 else depth:]) != \
                width * rows:
            raise ScheduleError(f"block {sch.get(output).name_hint}: a warp's blocks read more than one row of "
                                f"{sch.get(cache).reads[0].source.name}")
        _, cache_lane, *cache_vector = sch.split(sch.get_loops(cache)[-1], _lanes(vector))
        sch.bind(cache_lane, "threadIdx.x")
        if cache_vector:
            sch.vectorize(cache_vector[0])
        if rows > 1:  # by nvcc, so that the rows' registers are indexed by constants (else local memory)
            unrolled_by_nvcc(sch, sch.get_loops(cache)[depth - 1:-2 if cache_vector else -1])  # up to the lanes
        caches.append((sch.get(cache).writes[0].source, rows))
    if together > 1:  # a cache of the warp's rows, indexed by the row
        unrolled_by_nvcc(sch, [row])
    if gpu:
        sch.bind(tile, "blockIdx.x")
        sch.bind(warp, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        if lane_vector:
            _compute_in_vectors(sch, lane_vector[0], vector)
    scheduled = _thread_private(sch.mod["main"], caches, vector)
    n_tiles = -(-n_rows // tile_rows)
    if gpu and n_tiles == 1:
        # a single tile's statistics are indexed without the tile (like a single tile's epilogue,
        # ``codegen.schedule.schedule_stage``): simplified, each thread keeps its own row's, not
        # an array of the tile's rows
        scheduled = s_tir.transform.StmtSimplify()(tvm.IRModule({"main": scheduled}))["main"]
    return scheduled, StageSchedule("warp_reduce", n_tiles, tile_rows * width, threads, n_rows * width, 0,
                                    rows_together=together, row_vector=vector)


# What a lane holds of the rows its warp loads together (``rows_together``): 48 registers. Paper
# BERT's fp32 softmax, 8 rows of 384 a warp loaded at once (96 floats a lane), took the kernel
# from 128 registers to 199 (ptxas, sm_90) and from 2 blocks per SM to 1 (H100 model 2.13 ->
# 2.36 ms); its fp16 one, 8 rows in 96 halves, fits.
ROW_CACHE_BYTES = 192


def rows_together(rows_per_warp: int, width: int, dtypes: list[str], tile_rows: int | None = None) -> int:
    """How many of its ``rows_per_warp`` rows a warp loads in one trip: the most, dividing them
    (and the tile's ``tile_rows``, so that each trip's rows start at a multiple of their number),
    whose columns of the row tensors (of ``dtypes``) a lane holds in ``ROW_CACHE_BYTES``; one
    where none is cached."""
    per_row = sum(np.dtype(dtype).itemsize for dtype in dtypes) * -(-width // WARP)
    if not per_row:
        return 1
    return max(n for n in range(1, rows_per_warp + 1)
               if rows_per_warp % n == 0 and (tile_rows or n) % n == 0 and (n == 1 or n * per_row <= ROW_CACHE_BYTES))


# The bytes a lane moves in one access of its row (``row_vector``): 16, the widest load a thread
# issues (``ld.global.v4.u32``; CUDA C++ Programming Guide, "Size and Alignment Requirement").
ROW_VECTOR_BYTES = 16
COMPUTED_VECTOR = 4  # float32 elements in 16 bytes: the output's arithmetic, a vector at a time


def row_vector(width: int, blocks: list) -> int:
    """How many consecutive columns of a row each lane loads and stores with one instruction:
    the most, a power of two, whose elements of the widest dtype the stage moves along its rows
    fit in ``ROW_VECTOR_BYTES``, where the row's ``width`` is whole runs of ``WARP`` such vectors
    and every load of ``blocks`` (the statistics, then the output) either indexes no column (a
    row's statistic) or is at the block's own column (its last index the block's last iterator,
    the reduction's or the output's, in a tensor whose rows are whole vectors: each vector is
    consecutive and starts on a multiple of its width). One where none is (a row of 49, Swin's
    window scores). Paper BERT's LayerNorms over 768 halves load 8 columns a lane at a time, 3
    loads a row where they took 24, and compute and store them 4 at a time (``COMPUTED_VECTOR``)."""
    output = blocks[-1].writes[0].source
    moved = [output]  # the tensors read or written along the row
    for block in blocks:
        column = block.iter_vars[-1].var
        for load in (e for e in sub_expressions(block.body) if isinstance(e, ir_expr.TensorLoad)):
            *leading, last = [mentions(index, column) for index in load.indices]
            if not (last or any(leading)):
                continue
            if any(leading) or not _is(load.indices[-1], block.iter_vars[-1]):
                return 1
            moved.append(load.source)
    vector = ROW_VECTOR_BYTES // max(tvm.DataType(str(tensor.dtype)).bits // 8 for tensor in moved)
    while vector > 1 and (width % (WARP * vector) or any(int(t.shape[-1]) % vector for t in moved)):
        vector //= 2
    return vector


def _compute_in_vectors(sch: s_tir.Schedule, loop, vector: int) -> None:
    """A lane's ``vector`` columns (``loop``) computed ``COMPUTED_VECTOR`` float32 elements at a
    time: TVM prints a float32 vector of 8 as a ``make_ulonglong4`` of eight values, which nvcc
    refuses."""
    sch.vectorize(sch.split(loop, [None, COMPUTED_VECTOR])[1] if vector > COMPUTED_VECTOR else loop)


def _lanes(vector: int) -> list:
    """The split of a row's columns into a warp's lanes, each ``vector`` consecutive columns
    (no loop of one: TVM's cross-thread reduction wants the lanes' loop innermost)."""
    return [None, WARP, vector] if vector > 1 else [None, WARP]


def statistics_of(tensor: te.Tensor) -> list[te.Tensor]:
    """The statistics a row-resident stage's output (its staged TE) reads, directly or through
    one another: the reductions of its TE graph."""
    found: dict = {}

    def visit(t: te.Tensor):
        for read in t.op.input_tensors:
            if getattr(read.op, "reduce_axis", None) and read.op not in found:
                found[read.op] = read
                visit(read)

    visit(tensor)
    return list(found.values())


def _flatten_rows(sch: s_tir.Schedule, statistics: list, output, warps: int) -> None:
    """The blocks' row axes as one, where the output has several and the last is no multiple of
    ``warps``. Fused after, then split a warp a row, TVM simplifies the bindings of rows whose
    trailing axes' product is a multiple of the warps into forms its iter maps cannot follow
    (paper Swin's softmax over [4, 16, 49, 49]: ``v_i1 = (t % 98 * 8 + w) // 49``), and its ``bind``
    of the lanes refuses the stage; over one row axis the bindings are that axis's own split.
    (A last axis of whole tiles, paper BERT's 384 rows, is split as it is.) Not called where a
    block chooses between places by index (a LayerNorm read through a roll,
    ``codegen.commute_rolls``): flattened, TVM 0.27 rewrote the window reverse of a roll's first
    branch into an index 39 rows off (paper Swin's second stage at fp32, refused by the
    thread-level validator); as they are, it binds them. Nor are such rows cached: the
    arithmetic a roll's four branches carry (split-K partials, a bias) left nvcc's loop over a
    lane's columns rolled, and a cached bias in local memory (paper Swin fp32: 112 bytes)."""
    rows = len(sch.get_loops(output)) - 1
    extents = [loop_extent(sch, loop) for loop in sch.get_loops(output)[:-1]]
    if rows < 2 or extents[-1] % warps == 0:
        return

    index_dtype = str(sch.get(output).iter_vars[0].var.ty)

    def flattened(ndim: int) -> tirx.IndexMap:
        return tirx.IndexMap.from_func(lambda *v: (row_major(v[:rows], extents), *v[rows:]), ndim=ndim,
                                       index_dtype=index_dtype)

    for block in statistics:  # their buffers first, so that a row's results are one index of them
        sch.transform_layout(block, ("write", 0), flattened(len(sch.get(block).writes[0].source.shape)))
    for block in [*statistics, output]:
        sch.transform_block_layout(block, flattened(len(sch.get(block).iter_vars)))


def _loads_by_index(block: s_tir.SBlock) -> bool:
    """Whether ``block`` chooses between loads by a condition (``if_then_else``): a roll's places."""
    return any(is_call_to(node, IF_THEN_ELSE) and any(isinstance(inner, ir_expr.TensorLoad)
                                                      for branch in node.args[1:] for inner in sub_expressions(branch))
               for node in sub_expressions(block.body))


def _cached_reads(sch: s_tir.Schedule, statistics: list, output) -> list[int]:
    """The reads of the first statistic (indices into its reads) that every block of the stage
    reads along the row only (``_reads_along_row``): those a warp loads into registers once (not
    the row's value, ``ROW_VALUE``, in registers already)."""
    blocks = [*statistics, output]
    cached = []
    for index, region in enumerate(sch.get(statistics[0]).reads):
        source = region.source
        if source.scope() != "local" and all(_reads_along_row(sch.get(block), source) for block in blocks):
            cached.append(index)
    return cached


def _reads_along_row(block: s_tir.SBlock, source) -> bool:
    """Whether ``block`` reads ``source`` (if at all) only at its own row and column: the leading
    indices its leading spatial iterators (or, for one of extent 1, its one value), the last
    index its last iterator (a statistic's reduction, the output's column). A lane then reads
    only the columns it loaded."""
    reductions = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    rows = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    if len(reductions) > 1 or not rows:
        return False
    column = reductions[0] if reductions else rows[-1]
    for load in sub_expressions(block.body):
        if not (isinstance(load, ir_expr.TensorLoad) and load.source.same_as(source)):
            continue
        if not _at_own_place(load.indices, rows, column):
            return False
    return True


def _at_own_place(indices, rows: list, column: tirx.IterVar) -> bool:
    """Whether a load at ``indices`` reads at its own row (the leading indices the leading
    ``rows`` iterators) and its own ``column`` (the last index): a place a row cache holds."""
    *leading, last = indices
    return _is(last, column) and len(leading) <= len(rows) and all(_is(i, row) for i, row in zip(leading, rows))


def _is(index, iterator: tirx.IterVar) -> bool:
    """Whether ``index`` is always ``iterator``'s value: the iterator itself, or the one value of
    an iterator of extent 1 (TVM writes 0 for the batch axis of a [1, rows, width] tensor)."""
    if isinstance(index, tirx.Var):
        return index.same_as(iterator.var)
    dom = iterator.dom
    return (isinstance(index, tirx.IntImm) and isinstance(dom.extent, tirx.IntImm) and int(dom.extent) == 1
            and isinstance(dom.min, tirx.IntImm) and int(index) == int(dom.min))


def _thread_private(func: tirx.PrimFunc, caches: list, vector: int = 1) -> tirx.PrimFunc:
    """``func`` with each row cache (``local``, laid out as the rows it caches; given with the
    rows it holds) indexed by the thread's own columns only: lane ``l`` holds the ``vector``
    consecutive columns from ``vector * l`` in each run of ``WARP * vector``, at ``column //
    (WARP * vector) * vector + column % vector`` (``column // WARP`` for one a lane),
    ``width / WARP`` elements, rounded up where a warp does not divide the row (its last lanes'
    last element unused); holding several rows, a warp's, by the row within the warp's too (the
    last row index modulo their number: a warp's rows start at a multiple of it along that axis)."""
    for cache, rows_per_warp in caches:
        columns = -(-int(cache.shape[-1]) // (WARP * vector)) * vector
        shape = (columns,) if rows_per_warp == 1 else (rows_per_warp, columns)
        private = tirx.decl_buffer(shape, cache.dtype, name=cache.name, scope="local")

        def own(indices, rows_per_warp=rows_per_warp):
            column = tirx.floordiv(indices[-1], WARP * vector) * vector + tirx.floormod(indices[-1], vector) \
                if vector > 1 else tirx.floordiv(indices[-1], WARP)
            return [column] if rows_per_warp == 1 else [tirx.floormod(indices[-2], rows_per_warp), column]

        def buffer(node, cache=cache, private=private):
            return private if node.same_as(cache) else node

        def load(node, private=private):
            return tirx.BufferLoad(private, own(node.indices)) if node.source.same_as(private) else node

        def store(node, private=private):
            return tirx.BufferStore(private, node.value, own(node.indices)) if node.buffer.same_as(private) else node

        def region(node, private=private, rows_per_warp=rows_per_warp, columns=columns):
            if not node.source.same_as(private):
                return node
            rows = [] if rows_per_warp == 1 else [tvm.ir.Range(0, rows_per_warp)]
            return ir_expr.TensorRegion(private, [*rows, tvm.ir.Range(0, columns)], node.ty)

        func = tvm_ffi.structural_map(func, [(ir_expr.Var, buffer), (ir_expr.TensorLoad, load),
                                             (tirx.BufferStore, store), (ir_expr.TensorRegion, region)])
    return func
