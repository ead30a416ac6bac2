"""TIR shared by the two emitters of the staged program (``codegen.cuda``, ``codegen.llvm``).

A stage's scheduled PrimFunc becomes the code one block runs: its parameters become views into
the program's buffers, its tile loop the persistent ``for t in range(ceildiv(n_tiles - block,
grid))`` loop; an on-chip weight becomes a view into the block's copy, and the copy its load.
"""

from __future__ import annotations

import numpy as np
from tvm import s_tir, tirx

from codegen.schedule import lower_cross_thread_reductions, pool_offsets
from codegen.staged import OnChip, Stage, StagedProgram, stages_in
from codegen.stitch import BufferRef


def slot_views(staged: StagedProgram, items: list | None = None) -> list[tirx.Stmt]:
    """Each slot ``items`` (by default the whole program) use, declared as a view into its
    arena at its planned offset."""
    used = None if items is None else buffers_used(items)
    views = []
    for slot, offset in staged.slot_offsets.items():
        if used is None or slot in used:
            arena = staged.arena_buffers[staged.slots[slot][0]]
            views.append(tirx.DeclBuffer(slot, data=BufferRef(arena, offset, None).pointer()))
    return views


def buffers_used(items: list) -> set:
    """The buffers (slots, inputs, weights, outputs) the stages of ``items`` read or write."""
    return {ref.base for stage in stages_in(items) for ref in stage.reads + [stage.write]}


def parameters_used(staged: StagedProgram, items: list) -> list[tirx.Buffer]:
    """The program's parameters ``items`` need: the buffers they touch and their slots' arenas."""
    used = buffers_used(items)
    arenas = {staged.arena_buffers[staged.slots[slot][0]] for slot in used if slot in staged.slots}
    return [b for b in staged.parameters() if b in used or b in arenas]


def pool_shared(func: tirx.PrimFunc, pools: dict[str, tuple[tirx.Buffer, int]]) -> tuple[tirx.PrimFunc, list]:
    """``func`` without the shared buffers its inner blocks allocate (a matmul stage's operand
    slices and accumulators, ``codegen.schedule``), and their declarations as views into the
    kernel's pool where ``codegen.schedule.pool_offsets`` places them (``pools``: dtype -> the
    pool read as that dtype, the element where it starts), to put before the stage: every stage
    reuses the pool, so the kernel needs the most one stage needs, not the sum. No barrier is
    added between two stages that use it: a matmul stage's first write of its slices already follows a
    ``__syncthreads``, which TVM's ``ThreadSync`` puts there because the persistent tile loop
    rewrites the slices the previous tile read (the thread-level validator checks it, and
    tests/test_matmul_stage.py that dropping it is caught)."""
    views = []
    for buffer, offset in pool_offsets(func):
        pool, start = pools[str(buffer.dtype)]
        views.append(tirx.DeclBuffer(buffer, data=BufferRef(pool, start + offset, None).pointer()))

    def rewrite(stmt, root: bool):
        if isinstance(stmt, s_tir.SBlockRealize):
            return type(stmt)(stmt.iter_values, stmt.predicate, rewrite(stmt.block, root))
        if isinstance(stmt, s_tir.SBlock):
            kept = [b for b in stmt.alloc_buffers if root or not b.scope().startswith("shared")]
            return type(stmt)(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, rewrite(stmt.body, False),
                              stmt.init, kept, stmt.match_buffers, stmt.annotations)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([rewrite(child, root) for child in stmt.seq])
        if isinstance(stmt, tirx.For):
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, rewrite(stmt.body, root),
                            stmt.thread_binding, stmt.annotations)
        return stmt

    return func.with_body(rewrite(func.body, True)), views


def tiled_stage(stage: Stage, block: tirx.PrimExpr, grid: tirx.PrimExpr, on_chip=None,
                pools: dict[str, tuple[tirx.Buffer, int]] | None = None) -> tirx.Stmt:
    """The stage's code for one block: its parameters as views, and its outermost (tile) loop
    replaced by ``for t in range(ceildiv(n_tiles - block, grid)): tile = block + t * grid``.

    A weight kept on chip (``stage.on_chip``) is viewed, tile by tile, in the block's copy:
    ``on_chip(load)`` gives (buffer, where this block's copy starts in it). The shared buffers of
    its inner blocks are views into ``pools`` (``pool_shared``)."""
    func, pooled = pool_shared(lower_cross_thread_reductions(stage.func), pools or {})
    refs = stage.reads + [stage.write]
    views = [tirx.DeclBuffer(param, data=ref.pointer()) for k, (param, ref) in enumerate(zip(func.params, refs))
             if k not in stage.on_chip]
    realize = func.body
    root = realize.block
    tile_loop = root.body
    if not isinstance(tile_loop, tirx.For):
        raise TypeError(f"stage {stage.name}: the tile loop must be the root block's only statement")
    dtype = str(tile_loop.loop_var.ty.dtype)
    block, grid = (x if str(x.ty.dtype) == dtype else tirx.Cast(dtype, x) for x in (block, grid))
    t = tirx.Var("t", dtype)
    n_tiles = tirx.const(stage.schedule.n_tiles, dtype)
    tile = tile_loop.loop_var
    on_chip_views = [tirx.DeclBuffer(func.params[k], data=on_chip_pointer(load, *on_chip(load), t, tile))
                     for k, load in stage.on_chip.items()]
    persistent = tirx.For(t, 0, tirx.floordiv(n_tiles - block + grid - 1, grid), tirx.ForKind.SERIAL,
                          tirx.SeqStmt([tirx.Bind(tile, block + t * grid)] + on_chip_views + [tile_loop.body]))
    new_root = type(root)(root.iter_vars, root.reads, root.writes, root.name_hint, persistent, root.init,
                          root.alloc_buffers, root.match_buffers, root.annotations)
    return tirx.SeqStmt(views + pooled + [type(realize)(realize.iter_values, realize.predicate, new_root)])


def on_chip_pointer(load: OnChip, buffer: tirx.Buffer, base, t, tile) -> tirx.PrimExpr:
    """Where the stage's view of the weight starts so that element ``tile * per_tile + e`` of
    the weight is slot ``t``'s element e of the block's copy at ``base`` in ``buffer``.

    A bfloat16 view is the buffer's pointer plus a byte offset: TVM's bfloat16 storage
    legalization (the CPU's) retypes the buffer to uint16 but not the address of one of its
    elements, and the view read every other element (tests/test_precision.py, paper LSTM O4)."""
    dtype = str(t.ty.dtype)
    n = tirx.const(load.per_tile, dtype)
    offset = _as(base, dtype) + t * n - _as(tile, dtype) * n
    if str(buffer.dtype) == "bfloat16":
        return tirx.call_intrin("handle", "tirx.handle_add_byte_offset", buffer.data,
                                offset * tirx.const(2, dtype))
    return tirx.address_of(tirx.BufferLoad(buffer, [offset]))


def on_chip_loads(load: OnChip, buffer: tirx.Buffer, block, grid, base, elements) -> tirx.Stmt:
    """Block ``block``'s copy of its tiles' slices into ``buffer`` at ``base``: slot k holds tile
    ``block + k * grid``. ``elements(n, body)`` loops ``body(e)`` over ``e < n`` (serially on
    the CPU, over the block's threads on the GPU)."""
    k = tirx.Var("k", "int64")
    n = load.per_tile
    tile = _as(block, "int64") + k * _as(grid, "int64")
    source = load.source
    size = int(np.prod(source.spec.shape))

    def copy(e):
        e = _as(e, "int64")
        value = tirx.BufferLoad(source.base, [tile * n + e + source.offset])
        store = tirx.BufferStore(buffer, value, [_as(base, "int64") + k * n + e])
        return tirx.IfThenElse(tirx.all(tile < load.n_tiles, tile * n + e < size), store, None)

    return tirx.For(k, 0, load.slots, tirx.ForKind.SERIAL, elements(n, copy))


def _as(x, dtype: str):
    if isinstance(x, int):
        return tirx.const(x, dtype)
    return x if str(x.ty.dtype) == dtype else tirx.Cast(dtype, x)
