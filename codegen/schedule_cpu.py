"""CPU schedules for one region's PrimFunc (LLVM target).

Rules, in order: inline injective stages into their consumers (no materialized
reshape/transpose/bias/activation tensors where TVM can avoid them), then for
each remaining stage parallelize the outer spatial loops over the cores and
vectorize the innermost spatial loop; reductions (dense, matmul, conv) are
tiled so the output tile stays in registers while the reduction runs.
"""

from __future__ import annotations

from tvm import s_tir, tirx

VECTOR_LANES = 8  # AVX2 float32
PARALLEL_MIN_EXTENT = 2


def _iter_types(sch: s_tir.Schedule, block) -> list[str]:
    return [iv.iter_type for iv in sch.get(block).iter_vars]


def _is_reduction(sch, block) -> bool:
    return any(t == tirx.IterVar.CommReduce for t in _iter_types(sch, block))


def _const_extent(sch, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _inline_injective(sch: s_tir.Schedule):
    """Inline every injective stage that TVM can fold into its consumers."""
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if _is_reduction(sch, block) or not sch.get_consumers(block):
                continue
            try:
                sch.compute_inline(block)
                changed = True
            except s_tir.ScheduleError:
                try:
                    sch.reverse_compute_inline(block)
                    changed = True
                except s_tir.ScheduleError:
                    continue


def _schedule_spatial(sch: s_tir.Schedule, block):
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loops[-1]
    extent = _const_extent(sch, inner)
    if extent is not None and extent >= VECTOR_LANES and extent % VECTOR_LANES == 0:
        _, lanes = sch.split(inner, [None, VECTOR_LANES])
        sch.vectorize(lanes)
        loops = sch.get_loops(block)
    outer = loops[: max(1, len(loops) - 1)]
    if len(outer) > 1:
        outer = [sch.fuse(*outer)]
    if (_const_extent(sch, outer[0]) or 0) >= PARALLEL_MIN_EXTENT:
        sch.parallel(outer[0])


def _schedule_reduction(sch: s_tir.Schedule, block):
    """Tile spatial x reduction: outer spatial loops parallel, reduction in the middle,
    a small spatial tile innermost so partial sums stay in registers."""
    types = _iter_types(sch, block)
    loops = sch.get_loops(block)
    if len(loops) != len(types):
        _schedule_spatial(sch, block)
        return
    spatial = [lp for lp, t in zip(loops, types) if t == tirx.IterVar.DataPar]
    reduce = [lp for lp, t in zip(loops, types) if t == tirx.IterVar.CommReduce]
    if not spatial:
        return
    last = spatial[-1]
    extent = _const_extent(sch, last)
    tile = VECTOR_LANES if extent and extent % VECTOR_LANES == 0 and extent > VECTOR_LANES else None
    if tile:
        last_outer, last_inner = sch.split(last, [None, tile])
        sch.reorder(*spatial[:-1], last_outer, *reduce, last_inner)
        outer = spatial[:-1] + [last_outer]
    else:
        outer = spatial
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if (_const_extent(sch, fused) or 0) >= PARALLEL_MIN_EXTENT:
        sch.parallel(fused)
    if tile:
        sch.vectorize(sch.get_loops(block)[-1])
    if reduce:
        sch.decompose_reduction(block, sch.get_loops(block)[1])


def schedule_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A CPU schedule for one region's PrimFunc."""
    sch = s_tir.Schedule(func)
    _inline_injective(sch)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if _is_reduction(sch, block):
            _schedule_reduction(sch, block)
        else:
            _schedule_spatial(sch, block)
    return sch.mod["main"]
