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
  no shared memory and no block-wide synchronization. A GEMV-shaped one also has candidates
  whose warps reduce 2 or 4 rows together, one sum per row in each lane (``rfactor``, as
  dlight's GEMV rule does), the vector loaded once for all of them.
- ``thread_reduce``: enough outputs to give every thread of the grid its own (GEMMs,
  convolutions): one output per thread, ``THREADS`` per tile, the reduction serial in a
  register, stored once (``schedule_te``).
- ``matmul`` (GPU only): a GEMM-shaped stage of at least one tile is scheduled by TVM's dlight
  matmul rule instead (``matmul_stage``): both operands staged through shared memory, a
  register tile per thread. Its tiles are boxes of the output, not runs; the schedule carries
  them as an isl relation (``StageSchedule.tile_relation``).
- ``tensor_core`` (GPU only): a GEMM-shaped stage of float16 or bfloat16 operands (float32 ones
  in TF32 at ``precision="tf32"``) accumulating in float32, padded to whole tiles, is scheduled
  by dlight's tensor-core rule in the kernel's block shape
  (``tensor_core_stages``, ``codegen.tensor_core``): wmma fragments fed from shared-memory
  slices, one candidate per tile size; folded and carried like ``matmul``.

Where a stage has several candidates, ``codegen.stage`` takes the one the latency model
estimates fastest.

A stage may carry an *epilogue*: the one element-wise consumer of its reduction, computed in
the same tile so the reduction's result never goes to global memory (``epilogue_mode``):

- ``register``: the consumer reads each result at its own index; it runs in the thread that
  holds the result, straight from registers (a GEMM's bias and activation);
- ``shared``: the consumer reads several results of the same tile (the LSTM cell reads the
  four gates of its unit); the tile's results go to shared memory and, after a
  ``__syncthreads``, all the block's threads compute the consumer's tile: the contiguous run of
  its row-major output that reads exactly those results.

A softmax's or LayerNorm's statistics and output, where a shared epilogue pair has statistics
before it that nothing else reads, are one row-resident stage instead (``codegen.row_resident``:
a warp a row, the row loaded once into registers).

The same split is made for the CPU (``gpu=False``) without binding threads, so the CPU runs
exactly the tiles the GPU runs.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from functools import reduce as _fold

import islpy as isl
import tvm
from tvm import s_tir, te, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import get_root_block

from analysis.affine import Rewriter, recompute, row_major
from analysis.characterize import same_elements_axis, shares_loads_along_rows
from analysis.dependence import TENSOR_LOAD, IslWriter, NotAffine, is_call_to, tensor_loads
from codegen.stitch import align
from codegen.tensor_core import (NARROW_TILES, TF32_NARROW_TILES, TF32_TILES, TILES, TensorCoreTile,
                                 pipeline_chunks, selects, tensor_core_schedule, whole_row_tile)
from souffle.errors import SouffleError

THREADS = 256  # one thread-block shape for every stage of a kernel
WARP = 32
WARP_REDUCE_MIN_EXTENT = 32  # shorter reductions leave lanes of the warp idle
GRID_WAVE = 132 * 2  # tiles that keep a full GPU busy (H200: 132 SMs, two blocks each)
# Outputs each warp of a warp_reduce tile reduces, one after the other: a tile has warps x this
# many. More than one makes fewer, longer tiles (paper LSTM's wavefront step: 1280 tiles of 8 gates
# in two rounds of its 660 blocks; the ``two-rows-per-warp`` variant times 640 of 16).
WARP_REDUCE_ROWS = 1
# Rows a warp of a GEMV-shaped warp_reduce stage may reduce together (``rows_together``
# candidates, the latency model picks): the warp's lanes keep one sum per row and load the
# vector's element once for all of them. Paper LSTM's wavefront step is 1280 tiles of 8 gates,
# three rounds of its 528 blocks each paying the chain of loads and shuffles; 4 rows together
# make 320 tiles of 32, one round. Offered where the stage takes more than a round of the grid
# (``GRID_WAVE`` tiles), its epilogue computed by the block from shared memory (the LSTM cell's
# update; the one checked on emulated threads) and its matrices are 16-bit: a tile of 4 rows of
# float32 weights (64 KB for paper LSTM) no longer fits a block's shared memory, where
# ``codegen.on_chip`` keeps them, which the choice, made on the stage alone, cannot weigh.
GEMV_ROWS_TOGETHER = (2, 4)
# A reduction's last output axis up to this long whose outputs read the same elements (no load is
# indexed by it: a row's moments, the sums of d and of d^2) goes to one warp whole (``warp_outputs``).
SAME_ELEMENTS_AXIS_MAX = 4
# A GEMM-shaped stage with at least this many outputs (one tile of dlight's matmul at 256
# threads, 64 x 64) is scheduled by ``matmul_stage``; smaller ones by ``thread_reduce``.
MATMUL_MIN_OUTPUTS = 64 * 64
MATMUL_MIN_USE = 0.5  # and its tiles must be at least half full
# A narrow tensor-core tile (``codegen.tensor_core.NARROW_TILES``) a quarter full: a grouped
# convolution of 8 output channels per group fills half of a fragment's 16 columns, where the
# thread_reduce template does all of its 9 x channels terms in one thread per output
NARROW_MIN_USE = 0.25
MATMUL_PIPELINED = True  # the next chunk's slices loaded into registers during this one's FMAs
# dlight's CUDA matmul configuration: each thread accumulates MATMUL_VTHREADS x MATMUL_MICRO
# outputs (rows along threadIdx.x, interleaved by virtual threads: lane i holds rows i and i + 32;
# columns along threadIdx.y), a tile of 64 x 64, the reduction staged through shared memory
# MATMUL_K_CHUNK terms at a time, MATMUL_VECTOR elements per global load. Not dlight's CUDA
# defaults (4 x 4 micro tiles of 8 x 16 threads, vectors of 2): with 32 lanes their rows 4 apart,
# padded to 18 floats, put 8 lanes on each shared-memory bank. Rows one apart, padded to 20 floats
# (16 terms and the vector), start on 16 bytes, so nvcc loads 4 terms of a row with one
# conflict-free 128-bit load; cuobjdump of a 384 x 3072 x 768 dense (sm_90): 40 LDS.128 per 256
# FFMA and 80 registers, where 128 x 32 tiles padded to 17 took 43 narrower loads per 128 FFMA.
MATMUL_VTHREADS = 2
MATMUL_MICRO = (1, 8)
MATMUL_K_CHUNK = 16
MATMUL_VECTOR = 4


@dataclass(frozen=True)
class StageSchedule:
    """How one stage is tiled: the facts the kernel builder and the barrier analysis need."""

    template: str
    n_tiles: int
    per_tile: int  # output elements per tile, contiguous in the row-major output
    threads: int
    outputs: int  # output elements
    shared_bytes: int  # shared memory the stage allocates per block
    # ``matmul`` only: its tiles are boxes, not runs; isl text of tile -> the output elements it
    # writes (``{ [t] -> [a0, ..., an] : ... }``), read off the scheduled function
    tile_relation: str = ""
    box: tuple[int, ...] = ()  # ``matmul`` only: the largest extent of a tile along each output dimension
    tensor_core_tile: TensorCoreTile | None = None  # ``tensor_core`` only: its warps and fragments
    measured_seconds: float | None = None  # ``database`` only: its record's run time (``codegen.tuned``)
    # the rows a warp loads in one trip: row-resident (``codegen.row_resident``), or a warp_reduce
    # warp reducing its rows together (``_reduce_rows_together``)
    rows_together: int = 1
    # row-resident only: the consecutive columns of a row each lane loads and stores at once
    # (``codegen.row_resident.row_vector``)
    row_vector: int = 1
    # a GEMV with rows together only: its vector is copied into shared memory once a tile, by
    # the whole block, for every warp to read (``staged_vector``)
    staged_vector: bool = False

    def __str__(self):
        shared = f", {self.shared_bytes} B shared" if self.shared_bytes else ""
        shape = "x".join(map(str, self.box)) if self.box else str(self.per_tile)
        return f"{self.template} {self.n_tiles} tiles x {shape} elements, {self.threads} threads{shared}"


class ScheduleError(SouffleError):
    """A stage no template can schedule (the message says which and why)."""


def loop_extent(sch: s_tir.Schedule, loop) -> int:
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm):
        raise ScheduleError(f"loop {sch.get(loop).loop_var} has a symbolic extent {extent}")
    return int(extent.value)


def _only_block(sch: s_tir.Schedule):
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        raise ScheduleError(f"a stage must be one TE block, got {len(blocks)}")
    return blocks[0]


def product_of(values) -> int:
    return _fold(lambda a, b: a * b, values, 1)


def choose_template(spatial: int, reduction: int, threads: int = THREADS) -> str:
    """The template for a block with ``spatial`` outputs and ``reduction`` terms per output."""
    if reduction == 1:
        return "elementwise"
    if reduction >= WARP_REDUCE_MIN_EXTENT and spatial < GRID_WAVE * threads:
        return "warp_reduce"
    return "thread_reduce"


def tiling(outputs: int, reduction: int, threads: int = THREADS, per_warp: int | None = None) -> tuple[str, int]:
    """(template, output elements per tile) for a stage of that shape; a warp_reduce warp takes
    ``per_warp`` outputs (``warp_outputs``; ``WARP_REDUCE_ROWS`` if not given)."""
    template = choose_template(outputs, reduction, threads)
    if template == "elementwise":
        return template, (4 if outputs >= 4 * threads * GRID_WAVE else 1) * threads
    return template, threads // WARP * (per_warp or WARP_REDUCE_ROWS) if template == "warp_reduce" else threads


def warp_outputs(reduction: te.Tensor) -> int:
    """Outputs each warp of ``reduction``'s warp_reduce tiles reduces, one after the other:
    ``WARP_REDUCE_ROWS``, times the extent of the last output axis where that axis is short
    (``SAME_ELEMENTS_AXIS_MAX``) and indexes none of the loads, so that its outputs read the same
    elements. The warp's second pass then reads them from L1, and a tile holds whole rows, as the
    tiles of the stage that made the rows' statistics do: with a warp for each of a LayerNorm's
    two moments, a tile of 8 warps held 4 rows where the row sums' held 8, and the moments of
    rows 4-7 were a grid barrier away from their sums (paper BERT: 25 more barriers)."""
    return WARP_REDUCE_ROWS * (same_elements_axis(reduction, SAME_ELEMENTS_AXIS_MAX) or 1)


def schedule_stage(func: tirx.PrimFunc, gpu: bool, threads: int = THREADS,
                   epilogue_mode: str | None = None, per_warp: int | None = None,
                   together: bool = False) -> tuple[tirx.PrimFunc, StageSchedule]:
    """Tile the block of ``func`` (a single TE from ``te.create_prim_func``, or a reduction and
    its epilogue, see ``epilogue_mode``) for blocks of ``threads`` threads; ``gpu`` binds the
    tile and thread loops, the CPU runs them serially. A warp_reduce warp takes ``per_warp``
    outputs (``warp_outputs``), one after the other, or with ``together`` all at once
    (``_reduce_rows_together``)."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    vector = None
    if together and epilogue_mode == "shared" and len(blocks) == 3:  # the GEMV's vector, a TE of its own
        vector, blocks = blocks[0], blocks[1:]
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
    outputs = product_of(loop_extent(sch, loop) for loop in spatial_loops)
    reduction = product_of(loop_extent(sch, loop) for loop in reduce_loops)
    template, per_tile = tiling(outputs, reduction, threads, per_warp)
    if template == "warp_reduce" and not lanes_can_reduce(sch, block):
        template, per_tile = "thread_reduce", threads
    fused = outer_loop(sch, spatial_loops, loops, block)
    if epilogue_mode == "register" and outputs == 1:
        # A single result's epilogue is bound to constant indexes, which nothing guards: placed
        # in the unit loop before the split, it gets the split's guard like the reduction, or
        # every warp would store it, seven of eight from lanes that reduced nothing.
        sch.reverse_compute_at(blocks[1], fused)
    warps = threads // WARP
    sums = None
    if template == "elementwise":
        tile, _, warp, lane = sch.split(fused, [None, per_tile // threads, warps, WARP])
        holder = lane
    elif template == "warp_reduce":  # each warp's outputs (WARP_REDUCE_ROWS) one after the other
        tile, warp, *_ = sch.split(fused, [None, warps] + ([per_tile // warps] if per_tile > warps else []))
        r = sch.fuse(*reduce_loops) if len(reduce_loops) > 1 else reduce_loops[0]
        _, lane = sch.split(r, [None, WARP])
        if together and per_tile > warps:
            tile, warp, lane, sums = _reduce_rows_together(sch, block, lane, gpu)
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
    if vector is not None:
        _stage_vector(sch, vector, tile, warps, gpu)
    if sums is not None:
        _accumulate_in_registers(sch, *sums)
    n_tiles = -(-outputs // per_tile)
    func = sch.mod["main"]
    if gpu and n_tiles == 1 and epilogue_mode is not None:
        # ``reverse_compute_at`` binds an epilogue in a single tile without the tile's index,
        # while the reduction keeps it: the two index the results differently, and TVM keeps a
        # whole local array of results per thread (98 floats for a 7 x 7 x 2 pooling) where the
        # simplified bindings agree and leave one register. (Simplified with many tiles, paper
        # EfficientNet's convolutions wrote the last tile's elements from two threads each. A
        # stage without an epilogue has no second binding to reconcile, and simplified, a
        # warp_reduce one is no longer the pattern TVM's cross-thread lowering recognizes: every
        # lane added into the one result of a full reduction of a 4-D tensor.)
        # Its lanes' reduction is lowered first: simplified, its fused reduce loops' bindings are
        # no longer the pattern TVM's cross-thread lowering recognizes, and it would leave them
        # alone (a sum of all of a (2, 32, 3) tensor: each lane kept its own, every lane stored it;
        # fuzz seed 1795869453, refused by the validator).
        func = lower_cross_thread_reductions(func)
        func = s_tir.transform.StmtSimplify()(tvm.IRModule({"main": func}))["main"]
    if gpu and epilogue_mode == "shared":
        func = _synchronize_epilogue(func)
    return func, StageSchedule(template, n_tiles, per_tile, threads, outputs, _shared_bytes(sch),
                               rows_together=1 if sums is None else per_tile // warps,
                               staged_vector=vector is not None)


def _reduce_rows_together(sch: s_tir.Schedule, block, lane, gpu: bool):
    """``block``'s warp_reduce loops (tile, warp, rows, steps, lane) as a warp reducing its rows
    together, as dlight's GEMV rule does it: ``rfactor`` over the lanes gives each lane a sum per
    row in registers, accumulated in one pass over the steps (the rows' loop innermost, unrolled,
    so a load the rows share, the vector's element, is one load: nvcc keeps one of the
    identical loads, no store between them), then the warp's shuffles reduce each row's sums
    (TVM's cross-thread lowering of ``block``, in the same warp's loop). Returns the tile, warp
    and (accumulating) lane loops, and what ``_accumulate_in_registers`` takes once they are
    bound."""
    partial = sch.rfactor(lane, 0)
    tile, warp, rows, steps, lane = sch.get_loops(partial)[-5:]
    sch.reorder(lane, steps, rows)
    # the shuffles' nest (tile, warp, rows, lanes) merged into the sums' loop by loop, which keeps
    # its blocks' bindings in the split's terms (``reverse_compute_at`` rewrote a fused output's
    # index into a form TVM no longer proves affine, and refused to bind its lanes)
    shuffle_tile, shuffle_warp, shuffle_rows, shuffle_lane = sch.get_loops(block)[-4:]
    if gpu:
        sch.bind(shuffle_lane, "threadIdx.x")
    tile = sch.merge(tile, shuffle_tile)
    warp = sch.merge(warp, shuffle_warp)
    sch.set_scope(partial, 0, "local")
    return tile, warp, lane, (partial, steps, rows, shuffle_rows)


def _stage_vector(sch: s_tir.Schedule, vector, tile, warps: int, gpu: bool):
    """The GEMV's vector (``staged_vector``) computed into shared memory at the start of each
    tile by all the block's threads, consecutive lanes on consecutive elements, for the tile's
    warps to read: every warp reads all of it, from global memory each warp on its own before."""
    sch.compute_at(vector, tile)
    flat = sch.fuse(*sch.get_loops(vector)[1:])
    _, warp, lane = sch.split(flat, [None, warps, WARP])
    if gpu:
        sch.bind(warp, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        sch.set_scope(vector, 0, "shared")


def _accumulate_in_registers(sch: s_tir.Schedule, partial, steps, rows, shuffle_rows):
    """The sums of ``_reduce_rows_together`` set to zero before their steps, and both loops over
    their rows unrolled (the shuffles' by nvcc), so that each row's sum is a register: a loop
    indexing them by its variable would put them in local memory. After the loops are bound:
    ``bind`` checks a block it finds without its initialization (``decompose_reduction``) as
    neither complete nor a reduction, and refuses."""
    sch.decompose_reduction(partial, steps)
    sch.unroll(rows)
    unrolled_by_nvcc(sch, [shuffle_rows])


def unrolled_by_nvcc(sch: s_tir.Schedule, loops: list) -> None:
    """``loops`` marked ``#pragma unroll`` for nvcc (unrolled in TIR, a row's reduction buffers
    would be allocated once per copy, and a cross-thread reduction's left undefined)."""
    for loop in loops:
        sch.unroll(loop)
        sch.annotate(loop, "pragma_unroll_explicit", False)


def lower_cross_thread_reductions(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its reductions over thread-bound loops (warp_reduce's lanes) lowered to TVM's
    cross-thread all-reduce while its tile loop is still a loop. Under the persistent loop the
    tile is a value bound in the body, so a block whose output index divides it (a fused row of
    a multi-dimensional output) no longer has an affine binding, and TVM's lowering silently
    leaves it alone: the lanes would then all accumulate into one element at once. A function
    without thread bindings (the CPU's) is returned unchanged.

    The lowering writes each warp's result back (block ``<reduction>_write_back``) with none of
    the reduction's guard: a warp past the last result (a tile of 8 warps for 4 rows) would
    store its lane's nothing past the end of the results buffer. The write-back gets the guard's
    terms that hold there (those of loops around it, not of the reduction loops)."""
    lowered = s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({"main": func}))["main"]
    guards = {name: predicate for name, predicate in _block_guards(func.body)}
    return lowered.with_body(_guarded(lowered.body, guards, []))


_WRITE_BACK = "_write_back"


def _block_guards(stmt):
    """(name, predicate) of every block of ``stmt`` (TVM 0.27 has no Python statement visitor)."""
    if isinstance(stmt, s_tir.SBlockRealize):
        yield stmt.block.name_hint, stmt.predicate
        yield from _block_guards(stmt.block.body)
    elif isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            yield from _block_guards(child)
    elif isinstance(stmt, (tirx.For, s_tir.SBlock)):
        yield from _block_guards(stmt.body)


def _terms(predicate):
    if isinstance(predicate, tirx.And):
        return _terms(predicate.a) + _terms(predicate.b)
    return [predicate]


def _guarded(stmt, guards: dict, loops: list):
    """``stmt`` with each write-back block guarded by the terms of its reduction's guard over
    ``loops`` (the loop variables around it)."""
    if isinstance(stmt, s_tir.SBlockRealize):
        block, predicate = stmt.block, stmt.predicate
        if block.name_hint.endswith(_WRITE_BACK) and block.name_hint.removesuffix(_WRITE_BACK) in guards:
            for term in _terms(guards[block.name_hint.removesuffix(_WRITE_BACK)]):
                if all(any(var.same_as(loop) for loop in loops) for var in tirx.analysis.undefined_vars(term)):
                    always = isinstance(predicate, tirx.IntImm) and predicate.value
                    predicate = term if always else tirx.And(predicate, term)
        block = type(block)(block.iter_vars, block.reads, block.writes, block.name_hint,
                            _guarded(block.body, guards, loops), block.init, block.alloc_buffers, block.match_buffers,
                            block.annotations)
        return type(stmt)(stmt.iter_values, predicate, block)
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_guarded(child, guards, loops) for child in stmt.seq])
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, _guarded(stmt.body, guards, loops + [stmt.loop_var]),
                        stmt.thread_binding, stmt.annotations)
    return stmt


def lanes_can_reduce(sch: s_tir.Schedule, block) -> bool:
    """Whether TVM can split ``block``'s reduction across a warp's lanes, race-free:

    - its cross-thread lowering, like ``rfactor``, needs a combiner it recognizes (a sum, a
      max), and a NaN-keeping max (``souffle.ops.common.nan_max``, a select) is none: tried on
      a copy with ``rfactor`` (a wide max pooling failed in TVM's lowering);
    - it shuffles only the types it counts as float, and reduces a bfloat16 in shared memory
      through volatile pointers with no barrier between the lanes' steps, a race the emulator
      finds (tests/test_bf16_cuda.py)."""
    if any(str(write.source.dtype) == "bfloat16" for write in sch.get(block).writes):
        return False
    trial = sch.copy()
    reduce_loops = [loop for loop, iv in zip(trial.get_loops(block), trial.get(block).iter_vars)
                    if iv.iter_type == tirx.IterVar.CommReduce]
    fused = trial.fuse(*reduce_loops) if len(reduce_loops) > 1 else reduce_loops[0]
    _, lane = trial.split(fused, [None, WARP])
    try:
        trial.rfactor(lane, 0)
    except (ValueError, s_tir.ScheduleError):
        return False
    return True


def schedule_te(tensor: te.Tensor, placeholders: list[te.Tensor], gpu: bool, threads: int = THREADS,
                epilogue_mode: str | None = None) -> tuple[tirx.PrimFunc, StageSchedule]:
    """``schedule_stage`` for one TE over ``placeholders`` (a stage isolated from its program);
    an epilogue stage's tiles are counted in the epilogue's output, which the stage writes.
    The first of ``schedule_candidates``."""
    return schedule_candidates(tensor, placeholders, gpu, threads, epilogue_mode)[0]


def schedule_candidates(tensor: te.Tensor, placeholders: list[te.Tensor], gpu: bool, threads: int = THREADS,
                        epilogue_mode: str | None = None,
                        tf32: bool = False) -> list[tuple[tirx.PrimFunc, StageSchedule]]:
    """The schedules a stage may take, in order of preference on a tie: where it is a GEMM-shaped
    GPU stage, tensor cores (float16 or bfloat16 operands, or float32 ones in TF32 where ``tf32``;
    one candidate per tile) and dlight's SIMT matmul; then this module's own template, which every
    stage has, and on the GPU, where it is a GEMV-shaped warp_reduce, the same with each warp's
    rows reduced together (``GEMV_ROWS_TOGETHER``; ``codegen.stage`` picks one by the latency
    model)."""
    gemms = []
    if gpu and epilogue_mode != "shared":
        func = te.create_prim_func(placeholders + [gathered_operands(tensor)])
        matmul = matmul_stage(te.create_prim_func(placeholders + [widened_operands(scaled_operands(tensor))]), threads)
        gemms = tensor_core_stages(func, threads, tf32) + ([matmul] if matmul else [])
    own = _own_schedule(tensor, placeholders, gpu, threads, epilogue_mode)
    together = []
    reduction = stage_reduction(tensor)
    if gpu and epilogue_mode == "shared" and own[1].template == "warp_reduce" and own[1].n_tiles > GRID_WAVE \
            and reduction is not None \
            and warp_outputs(reduction) == 1 and shares_loads_along_rows(reduction) \
            and all(str(p.dtype) in ("float16", "bfloat16") for p in placeholders if len(p.shape) > 1):
        # a tile within one row of the last axis, so that TVM indexes each lane's sums by the
        # row within the warp alone: tiles straddling paper EfficientNet's 14-wide maps at fp32
        # indexed them through the tile's divisions by 196 and 14, which put them in local memory
        # (112 B, ptxas)
        last = int(reduction.op.axis[-1].dom.extent)
        staged = staged_vector(tensor)
        sources = [tensor] + ([staged] if staged is not tensor else [])
        for rows, source in itertools.product(GEMV_ROWS_TOGETHER, sources):
            if last % (threads // WARP * rows):
                continue
            try:
                together.append(_own_schedule(source, placeholders, gpu, threads, epilogue_mode, rows))
            except ScheduleError:
                continue  # tiles of that many rows its epilogue cannot take: not a candidate
    return gemms + [own] + together


def gathered_operands(tensor: te.Tensor) -> te.Tensor:
    """``tensor`` (a reduction, or the epilogue of one) with each factor of its product that reads
    under a condition (a convolution's padding, inlined by the ``vertical`` pass) or that is a
    product of two loads (a scaled operand, ``codegen.vertical``) computed by a TE of its own over
    the axes it varies with, which the product reads at those axes: an implicit im2col,
    ``X[n, g, i, k, rc, ry, rx]`` for a grouped convolution's input. dlight's GEMM rules
    (``get_index_map``) then see a batched matmul, and the tensor-core schedule computes the
    factor, condition and all, as it copies it into shared memory (``codegen.tensor_core``):
    never stored. ``tensor`` itself where no factor is either."""
    return _operands_gathered(tensor, scaled_only=False)


def scaled_operands(tensor: te.Tensor) -> te.Tensor:
    """``gathered_operands`` of the scaled factors alone: dlight's SIMT matmul computes them as it
    copies them into its slices, and refuses an operand read under a condition
    (``_gemm_rules_apply``)."""
    return _operands_gathered(tensor, scaled_only=True)


def staged_vector(tensor: te.Tensor) -> te.Tensor:
    """``tensor`` (a GEMV's epilogue) with the factor of its reduction's product that its rows
    share (the vector: not indexed by the last output axis) computed by a TE of its own over the
    axes it varies with, which ``schedule_stage`` computes into shared memory once a tile
    (``_stage_vector``); ``tensor`` itself where the product has no such factor."""
    return _operands_gathered(tensor, scaled_only=False, vector=True)


def _operands_gathered(tensor: te.Tensor, scaled_only: bool, vector: bool = False) -> te.Tensor:
    reduction = stage_reduction(tensor)
    if reduction is None:
        factors = (False, False)
    elif vector:
        factors = _vector_factors(reduction)
    else:
        factors = gathered_factors(reduction, scaled_only)
    if not any(factors):
        return tensor
    body = reduction.op.body[0]
    product = _uncast(body.source[0])
    axes = [ax.var for ax in reduction.op.axis] + [ax.var for ax in reduction.op.reduce_axis]
    extents = [ax.dom.extent for ax in reduction.op.axis] + [ax.dom.extent for ax in reduction.op.reduce_axis]
    gathered = {}
    for k, (factor, conditional) in enumerate(zip((product.a, product.b), factors)):
        if not conditional:
            continue
        inner = _uncast(factor)
        used = tirx.analysis.undefined_vars(inner)
        kept = [i for i, var in enumerate(axes) if any(var.same_as(v) for v in used)]
        if not _conditional(inner):
            # a scaled operand in its tensor's order (a 1 x 1 convolution's input: [rc, yy, xx]),
            # so that the tensor-core copy, along its last axis, reads consecutive elements
            kept.sort(key=lambda i: _first_use(_whole_load(inner), axes[i]))
        gathered[k] = (_gathered(inner, [axes[i] for i in kept], [extents[i] for i in kept],
                                 f"{reduction.op.name}_gathered{k}"), kept)

    def rebuilt(factor, k, variables):
        if k not in gathered:
            return Rewriter(variables, "gathering an operand")(factor)
        if isinstance(factor, tirx.Cast):
            return tirx.Cast(factor.ty, rebuilt(factor.value, k, variables))
        operand, kept = gathered[k]
        return operand(*[variables[axes[i]] for i in kept])

    def compute(*spatial):
        reduce_axes = [te.reduce_axis(ax.dom, ax.var.name) for ax in reduction.op.reduce_axis]
        variables = dict(zip(axes, list(spatial) + [r.var for r in reduce_axes]))
        term = tirx.Mul(rebuilt(product.a, 0, variables), rebuilt(product.b, 1, variables))
        return te.sum(_recast(body.source[0], term), axis=reduce_axes)

    new = te.compute(reduction.shape, compute, name=reduction.op.name, tag=reduction.op.tag)
    if reduction is tensor:
        return new
    return recompute(tensor, lambda t, idx, _: (new if t.op.same_as(reduction.op) else t)(*idx),
                     f"gathering {tensor.op.name}")


def _product(reduction: te.Tensor) -> tirx.Mul | None:
    """The product ``reduction`` sums, where its body is one plain sum of a product; else None."""
    body = reduction.op.body[0] if len(reduction.op.body) == 1 else None
    if body is None or len(body.source) != 1 or not _is_true(body.condition) or body.init:
        return None
    product = _uncast(body.source[0])
    return product if isinstance(product, tirx.Mul) else None


def _vector_factors(reduction: te.Tensor) -> tuple[bool, bool]:
    """Which factor of ``reduction``'s product is a GEMV's vector: the one whose loads do not use
    the last output axis, where the other's do."""
    if (product := _product(reduction)) is None:
        return False, False
    last = reduction.op.axis[-1].var
    rows = [any(v.same_as(last) for v in tirx.analysis.undefined_vars(f)) for f in (product.a, product.b)]
    return (not rows[0] and rows[1], rows[0] and not rows[1])


def gathered_factors(reduction: te.Tensor, scaled_only: bool = False) -> tuple[bool, bool]:
    """Which factors of ``reduction``'s product ``gathered_operands`` computes as TEs of their own
    (those that read under a condition, unless ``scaled_only``, and those that are a product of
    two loads): none where the body is not one plain sum of a product."""
    if (product := _product(reduction)) is None:
        return False, False
    return tuple((not scaled_only and _conditional(_uncast(f))) or scaled_factors(f) is not None
                 for f in (product.a, product.b))


def _whole_load(expr):
    """The load of the larger tensor of a scaled operand (``scaled_factors``)."""
    return max(scaled_factors(expr), key=lambda load: product_of(int(d) for d in load.tensor.shape))


def _first_use(load, var) -> int:
    """The first index of ``load`` that ``var`` occurs in (past the last where none does)."""
    for position, index in enumerate(load.indices):
        if any(var.same_as(v) for v in tirx.analysis.undefined_vars(index)):
            return position
    return len(load.indices)


def scaled_factors(expr) -> tuple | None:
    """The two loads of ``expr`` where it is their product, each perhaps cast (a tensor scaled by
    another, ``codegen.vertical``'s scaled operand), else None."""
    product = _uncast(expr)
    if not isinstance(product, tirx.Mul):
        return None
    factors = [_uncast(product.a), _uncast(product.b)]
    if not all(is_call_to(f, TENSOR_LOAD) for f in factors):
        return None
    return tuple(tensor_loads(f)[0] for f in factors)


def _gathered(expr, axes: list, extents: list, name: str) -> te.Tensor:
    """``expr`` as a TE over ``axes`` (its variables), of ``extents``."""
    return te.compute(extents, lambda *new: Rewriter(dict(zip(axes, new)), f"gathering {name}")(expr), name=name)


def _uncast(expr):
    while isinstance(expr, tirx.Cast):
        expr = expr.value
    return expr


def _recast(template, value):
    """``value`` under the casts ``template`` has above its first non-cast expression."""
    if isinstance(template, tirx.Cast):
        return tirx.Cast(template.ty, _recast(template.value, value))
    return value


def _is_true(condition) -> bool:
    return isinstance(condition, tirx.IntImm) and bool(condition.value)


def _conditional(expr) -> bool:
    """Whether ``expr`` reads a tensor under a condition on the axes (a padding's bounds)."""
    return any(load.conditions for load in tensor_loads(expr))


def widened_operands(tensor: te.Tensor) -> te.Tensor:
    """``tensor`` (a reduction, or the epilogue of one) with the reduction's operands of a
    narrower dtype than float32 read from a float32 copy of each, a TE of its own: dlight's SIMT
    matmul then casts as it copies them into float32 slices, whose rows nvcc reads four terms per
    128-bit load, where it reads float16 slices one half at a time (``ld.shared.u16`` in its
    PTX). ``tensor`` itself where there is nothing to widen."""
    reduction = stage_reduction(tensor)
    if reduction is None or str(reduction.dtype) != "float32":
        return tensor
    uncast = _read_uncast(reduction.op.body[0])
    narrow = {t.op: t for t in reduction.op.input_tensors
              if str(t.dtype) in ("float16", "bfloat16") and not any(t.op.same_as(op) for op in uncast)}
    if not narrow:
        return tensor
    wide = {op: _as_float32(t) for op, t in narrow.items()}
    widened = recompute(reduction, lambda t, idx, _: wide.get(t.op, t)(*idx), f"widening {reduction.op.name}")
    if reduction is tensor:
        return widened
    return recompute(tensor, lambda t, idx, _: (widened if t.op.same_as(reduction.op) else t)(*idx),
                     f"widening {tensor.op.name}")


def stage_reduction(tensor: te.Tensor) -> te.Tensor | None:
    """The reduction a stage's TE computes: the TE itself, or the one its epilogue reads; None
    for an element-wise stage."""
    return tensor if tensor.op.reduce_axis else epilogue_reduction(tensor)


def epilogue_reduction(epilogue: te.Tensor) -> te.Tensor | None:
    """The reduction an epilogue reads (its first input that is one), or None."""
    return next((t for t in epilogue.op.input_tensors if getattr(t.op, "reduce_axis", None)), None)


def _read_uncast(expr) -> list[te.Operation]:
    """The operations of the tensors ``expr`` reads other than as the operand of a cast to float32
    (a LayerNorm's row recomputed from float16 operands added in float16): a float32 copy cannot
    stand in for those reads."""
    found = []

    def walk(e, cast: bool):
        if is_call_to(e, TENSOR_LOAD):
            if not cast:
                found.append(e.args[0].op)
            for index in e.args[1:]:
                walk(index, False)
        elif isinstance(e, tirx.Reduce):
            for source in e.source:
                walk(source, False)
            walk(e.condition, False)
        elif isinstance(e, tirx.Cast):
            walk(e.value, str(e.ty.dtype) == "float32")
        elif isinstance(e, tvm.ir.expr.Call):
            for arg in e.args:
                walk(arg, False)
        elif isinstance(e, tirx.Select):
            for child in (e.condition, e.true_value, e.false_value):
                walk(child, False)
        else:
            for name in ("a", "b", "value"):
                child = getattr(e, name, None)
                if child is not None and not isinstance(child, (int, float)):
                    walk(child, False)

    walk(expr, False)
    return found


def _as_float32(tensor: te.Tensor) -> te.Tensor:
    return te.compute(tensor.shape, lambda *i: tensor(*i).astype("float32"), name=f"{tensor.op.name}_f32")


def _own_schedule(tensor: te.Tensor, placeholders: list[te.Tensor], gpu: bool, threads: int,
                  epilogue_mode: str | None, rows_together: int = 1) -> tuple[tirx.PrimFunc, StageSchedule]:
    """``schedule_stage``'s template. A reduction that each thread computes alone
    (``thread_reduce``) gets a copy as its register epilogue: the thread sums in a register and
    stores once. Written in place, the output would be loaded and stored at every reduction
    step, since nvcc must assume that the arena views (one ``__restrict__`` pointer) alias the
    operands. (A ``cache_write`` does the same in principle, but TVM's ``reverse_compute_at`` of
    its write-back into a tile of 32 outputs of 30 widened it to a 6 x 6 box with no guard, which
    stored past the output, and ``compute_at`` of the reduction into a tiled write-back broke its
    affine bindings.)"""
    if epilogue_mode is None and _accumulates_alone(tensor, threads):
        tensor, epilogue_mode = te.compute(tensor.shape, lambda *i: tensor(*i), name=tensor.op.name), "register"
    reduction = stage_reduction(tensor)
    per_warp = None if reduction is None else warp_outputs(reduction)
    if rows_together > 1:
        per_warp = rows_together
    func, schedule = schedule_stage(te.create_prim_func(placeholders + [tensor]), gpu, threads, epilogue_mode, per_warp,
                                    together=rows_together > 1)
    if epilogue_mode is None:
        return func, schedule
    outputs = product_of(int(d) for d in tensor.shape)
    return func, dataclasses.replace(schedule, per_tile=schedule.per_tile * outputs // schedule.outputs, outputs=outputs)


def _accumulates_alone(tensor: te.Tensor, threads: int) -> bool:
    """Whether ``tensor`` is a reduction that ``thread_reduce`` schedules."""
    axes = getattr(tensor.op, "reduce_axis", [])
    analyzer = tvm.sym.Analyzer()
    extents = [analyzer.simplify(a.dom.extent) for a in axes]
    if not extents or not all(isinstance(e, tirx.IntImm) for e in extents):
        return False  # no reduction, or one ``schedule_stage`` refuses with its reason
    outputs = product_of(int(d) for d in tensor.shape)
    return choose_template(outputs, product_of(int(e) for e in extents), threads) == "thread_reduce"


def outer_loop(sch: s_tir.Schedule, spatial_loops: list, loops: list, block):
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
    size = loop_extent(sch, flat)
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
        sch.transform_layout(producer, ("write", 0), lambda *index: [row_major(index, shape)])
    _flatten_spatial(sch, epilogue, len(sch.get(epilogue).iter_vars))


def _synchronize_epilogue(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (a shared epilogue's stage) with a block barrier between the tile's reduction and
    its epilogue, and one after the epilogue (and, where the tile first copies a GEMV's vector,
    ``_stage_vector``, one after the copy). Threads read results other threads wrote, and the
    next tile overwrites them; TVM's barrier insertion takes a shared-memory access at the same
    index as the same thread's and would leave out the first barrier where a warp reads only the
    results written by its own first lane (rows of ``WARP`` elements)."""
    realize = func.body
    root = realize.block
    tile = root.body
    *vector, reduction, epilogue = tile.body.seq

    def sync():  # one statement each, so that a mutant (scripts/validate_mutants.py) can drop one
        return tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))

    body = ([*vector, sync()] if vector else []) + [reduction, sync(), epilogue, sync()]
    tile = tirx.For(tile.loop_var, tile.min, tile.extent, tile.kind, tirx.SeqStmt(body), tile.thread_binding,
                    tile.annotations)
    root = type(root)(root.iter_vars, root.reads, root.writes, root.name_hint, tile, root.init, root.alloc_buffers,
                      root.match_buffers, root.annotations)
    return func.with_body(type(realize)(realize.iter_values, realize.predicate, root))


def _flatten_spatial(sch: s_tir.Schedule, block, n_spatial: int):
    """Make the block's first ``n_spatial`` (spatial) iterators one, their row-major flat index,
    iterated by one loop (the reduction iterators are kept)."""
    iters = sch.get(block).iter_vars
    if n_spatial < 2:
        return
    extents = [int(iv.dom.extent) for iv in iters[:n_spatial]]
    flat = tirx.IndexMap.from_func(lambda *index: [row_major(index[:n_spatial], extents), *index[n_spatial:]],
                                   ndim=len(iters), index_dtype=str(iters[0].var.ty.dtype))
    sch.transform_block_layout(block, flat)


def _shared_bytes(sch: s_tir.Schedule) -> int:
    """Bytes of the shared-memory buffers the schedule allocates, each compacted to what one
    tile touches, as TVM lowers it (and pools them across stages)."""
    passes = [s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(),
              s_tir.transform.CompactBufferAllocation()]
    mod = tvm.transform.Sequential(passes)(sch.mod)
    return sum(product_of(int(d) for d in b.shape) * tvm.runtime.DataType(b.dtype).bits // 8
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


class _KernelShapedMatmul(dlight.gpu.Matmul):
    """TVM's dlight CUDA matmul rule (shared-memory tiles of both operands, a register tile of
    accumulators per thread) with the kernel's one block shape, ``WARP`` lanes along
    ``threadIdx.x`` and ``threads / WARP`` warps along ``threadIdx.y``, and the configuration
    above (``MATMUL_VTHREADS``, ``MATMUL_MICRO``, ...)."""

    def __init__(self, threads: int):
        self.threads = threads

    def get_configs(self, target):
        config = super().get_configs(target)
        return dataclasses.replace(config, block_size_x=WARP, block_size_y=self.threads // WARP,
                                   vthread_x=MATMUL_VTHREADS, micro_size_x=MATMUL_MICRO[0], micro_size_y=MATMUL_MICRO[1],
                                   micro_size_k=MATMUL_K_CHUNK, vector_size=MATMUL_VECTOR, unroll=0)


_CUDA = {"kind": "cuda", "arch": "sm_80"}  # the rule does not depend on the arch


def matmul_stage(func: tirx.PrimFunc, threads: int = THREADS) -> tuple[tirx.PrimFunc, StageSchedule] | None:
    """``func`` (a GEMM-shaped reduction, with or without its register epilogue) scheduled by
    dlight's matmul rule for blocks of ``threads`` threads, or None where the rule does not
    apply (not GEMM-shaped: a reduction of no product, over a computed index) or is not worth it
    (``_gemm_rules_apply``).

    dlight binds its tiles to ``blockIdx.y`` and ``blockIdx.x``; they are folded into one
    ``blockIdx.x`` loop, the tile loop the persistent kernel replaces. Its tiles are boxes of the
    output, so the schedule carries each tile's elements as an isl relation read off the
    scheduled function, which the barrier analysis uses instead of runs. With
    ``MATMUL_PIPELINED`` the chunks of K are software pipelined (``_pipeline_slices``)."""
    if not _gemm_rules_apply(func):
        return None
    # The rule's SIMT form: its tensor-core form (float16 operands) binds its own block shape, 16
    # warps, where the persistent kernel has one for every stage; ``tensor_core_stages`` is that
    # form in the kernel's shape.
    func = func.with_attr("dlight.do_not_tensorize", True)
    scheduled = _KernelShapedMatmul(threads).apply(func, tvm.target.Target(_CUDA), False)
    if scheduled is None:
        return None
    return stitchable(scheduled, "matmul", threads, MATMUL_PIPELINED and _pipeline_slices(scheduled))


def _pipeline_slices(sch: s_tir.Schedule) -> bool:
    """dlight's SIMT matmul software pipelined as the tensor-core form is
    (``codegen.tensor_core.pipeline_chunks``): each thread loads its share of the next chunk's
    slices into registers before the FMAs on this one, and stores them into the slices after.
    False (and ``sch`` unchanged) where the rule's loop over chunks is not the one expected:
    two slices' copies and the product under it, more than one chunk."""
    copies = [b for b in sch.get_child_blocks(get_root_block(sch)) if sch.get(b).name_hint.endswith("_shared")]
    if len(copies) != 2:
        return False
    chunk = sch.get_loops(copies[0])[-5]  # above the copy's own four (warps, lanes, rounds, vector)
    below = sch.get(chunk).body
    if not (sch.get(sch.get_loops(copies[1])[-5]).same_as(sch.get(chunk)) and isinstance(below, tirx.SeqStmt)
            and len(below.seq) == 3 and _constant(sch.get(chunk).extent) > 1):
        return False
    pipeline_chunks(sch, chunk, copies)
    return True


def tensor_core_stages(func: tirx.PrimFunc, threads: int = THREADS,
                       tf32: bool = False) -> list[tuple[tirx.PrimFunc, StageSchedule]]:
    """``func`` (a GEMM-shaped reduction of float16 or bfloat16 operands into float32, or of
    float32 operands where ``tf32`` lets the tensor cores round them to TF32, with or without its
    register epilogue) on tensor cores, one schedule per tile of ``codegen.tensor_core.TILES``
    (``TF32_TILES``, whose fragments take float32 operands) that fits it (``codegen.tensor_core``),
    folded and carried like ``matmul_stage``'s."""
    if product_of(int(d) for d in func.params[-1].shape) < MATMUL_MIN_OUTPUTS:
        return []  # (an operand read under a condition is no bar: its copy is element-wise)
    found = []
    for tile in TILES + NARROW_TILES + (TF32_TILES + TF32_NARROW_TILES if tf32 else ()):
        stage = tensor_core_stage(func, tile, threads, NARROW_MIN_USE if tile.narrow else MATMUL_MIN_USE)
        if stage is not None:
            found.append(stage)
    return found


def tensor_core_stage(func: tirx.PrimFunc, tile: TensorCoreTile, threads: int = THREADS,
                      min_use: float = MATMUL_MIN_USE) -> tuple[tirx.PrimFunc, StageSchedule] | None:
    """``func`` on tensor cores in ``tile`` (``tensor_core_stages``' candidate of that tile), or
    None where the tile does not fit it."""
    scheduled = tensor_core_schedule(func, tile, threads, min_use, MATMUL_MIN_USE)
    if scheduled is None:
        return None
    scheduled, applied = scheduled
    stage = stitchable(scheduled, "tensor_core", threads, applied.pipelined)
    return None if stage is None else (stage[0], dataclasses.replace(stage[1], tensor_core_tile=applied))


def whole_row_stage(tensor: te.Tensor, placeholders: list[te.Tensor], threads: int,
                    rows: int) -> tuple[tirx.PrimFunc, StageSchedule] | None:
    """A GEMM-shaped stage's TE (with its register epilogue) on tensor cores in tiles of ``rows``
    whole rows of its output (``codegen.tensor_core.whole_row_tile``), tile ``t`` the ``t``-th
    ``rows`` rows, batch by batch; None where no such tile fits it."""
    tile = whole_row_tile(rows, int(tensor.shape[-1]), threads // WARP)
    if tile is None:
        return None
    return tensor_core_stage(te.create_prim_func(placeholders + [gathered_operands(tensor)]), tile, threads)


def _gemm_rules_apply(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is worth dlight's SIMT matmul rule (``matmul_stage``): at least one tile of
    outputs, and no operand read under a condition (a padded convolution: the rule copies its
    slices with vector loads, and a vector select loads both sides, out of bounds where the
    padding is; the validator found it). The tensor-core tiles copy such an operand element-wise
    (``tensor_core_stages``)."""
    return product_of(int(d) for d in func.params[-1].shape) >= MATMUL_MIN_OUTPUTS and not _reads_conditionally(func)


def stitchable(scheduled: s_tir.Schedule, template: str, threads: int,
                pipelined: bool = False) -> tuple[tirx.PrimFunc, StageSchedule] | None:
    """A dlight schedule made a stage of the persistent kernel: compacted, its block indices
    folded into one tile loop, its tiles read off as an isl relation; None where they cannot be
    (an index isl cannot represent) or would be mostly idle."""
    func = scheduled.mod["main"]
    outputs = product_of(int(d) for d in func.params[-1].shape)
    nest = _block_index_nest(func)
    relation = _tile_relation(func, nest)
    if relation is None:
        return None
    box = _tile_box(relation)
    n_tiles = product_of(_constant(loop.extent) for loop in nest)
    if outputs < MATMUL_MIN_USE * n_tiles * product_of(box):
        return None  # mostly idle threads (a GEMV's one row in tiles of 128)
    compacted = _compacted(func, pipelined)
    folded = _fold_block_indices(compacted, _block_index_nest(compacted))
    shared = pooled_shared(folded)
    schedule = StageSchedule(template, n_tiles, product_of(box), threads, outputs, shared,
                             tile_relation=relation.to_str(), box=box)
    return folded, schedule


def _compacted(func: tirx.PrimFunc, pipelined: bool = False) -> tirx.PrimFunc:
    """``func`` with each buffer allocated where it is used, at the size one use touches: the
    operand slices in shared memory are one chunk of one tile, not the whole operand. These
    are TVM's own passes, run on the stage before it is stitched: after stitching, TVM hoists
    every shared buffer to the top of the kernel, where its liveness spans every loop around the
    stage, and would give every stage of a scan body its own shared memory; the persistent
    kernel pools them instead (``codegen.tiled.pool_shared``). Compacted before the block
    indices are folded into the tile, each thread's accumulators are indexed by its own loops
    alone (folded first, their offsets kept a ``max`` of the tile's digits, and nvcc put the
    array in local memory).

    A ``pipelined`` stage also gets its software pipeline here (its registers staging the next
    chunk, then the loop's prologue and epilogue), from TVM's passes in the order its own lowering
    runs them: run on the kernel, they would not find the slices, which are the kernel pool's by
    then. The kernel's lowering compacts the stage again, which works once the slices are views
    into the pool; on a pipelined stage alone, TVM's compaction divides by zero."""
    transform = s_tir.transform
    passes = [transform.PlanAndUpdateBufferAllocationLocation(), transform.ConvertBlocksToOpaque()]
    if pipelined:
        passes += [transform.LiftThreadBinding(), transform.ManifestSharedMemoryLocalStage()]
    passes.append(transform.CompactBufferAllocation())
    if pipelined:
        passes += [transform.LowerMatchBuffer(), transform.InjectSoftwarePipeline(), _settle_fragments]
    return tvm.transform.Sequential(passes)(tvm.IRModule({"main": func}))["main"]


@tirx.transform.prim_func_pass(opt_level=0, name="SettleFragments")
def _settle_fragments(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """A pipelined tensor-core stage with its wmma fragments allocated once, by statements
    (``AllocBuffer``) at the top of the stage's outermost block, not by the blocks of the
    pipeline's prologue, body and epilogue, which each allocate them. The kernel's lowering
    compacts its buffers again (TVM's ``CompactBufferAllocation``, which TVM itself runs once,
    before the pipeline): by blocks, it would find three definitions of each fragment, and would
    recompute layouts that ``LowerMatchBuffer`` has already written into the wmma calls'
    fragment indices."""
    fragments: list[tirx.Buffer] = []

    def settle(stmt, depth: int):
        if isinstance(stmt, s_tir.SBlockRealize):
            return type(stmt)(stmt.iter_values, stmt.predicate, settle(stmt.block, depth))
        if isinstance(stmt, s_tir.SBlock):
            start = len(fragments)
            for buffer in stmt.alloc_buffers:
                if buffer.scope().startswith("wmma.") and not any(buffer.same_as(b) for b in fragments):
                    fragments.append(buffer)
            body = settle(stmt.body, depth + 1)
            if depth == 1 and len(fragments) > start:
                body = tirx.SeqStmt([tirx.AllocBuffer(b) for b in fragments[start:]] + [body])
            return type(stmt)(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, stmt.init,
                              [b for b in stmt.alloc_buffers if not b.scope().startswith("wmma.")],
                              stmt.match_buffers, stmt.annotations)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([settle(child, depth) for child in stmt.seq])
        if isinstance(stmt, tirx.For):
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, settle(stmt.body, depth),
                            stmt.thread_binding, stmt.annotations)
        if isinstance(stmt, tirx.IfThenElse):
            return tirx.IfThenElse(stmt.condition, settle(stmt.then_case, depth),
                                   None if stmt.else_case is None else settle(stmt.else_case, depth))
        if isinstance(stmt, tirx.AttrStmt):
            return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, settle(stmt.body, depth))
        return stmt

    return func.with_body(settle(func.body, 0))


def buffer_elements(buffer: tirx.Buffer) -> int:
    """Elements a (possibly strided, padded) buffer spans."""
    shape = [int(d) for d in buffer.shape]
    if not buffer.strides:
        return product_of(shape)
    return max(1, 1 + sum((d - 1) * int(s) for d, s in zip(shape, buffer.strides)))


def _reads_conditionally(func: tirx.PrimFunc) -> bool:
    """Whether the reduction of ``func``, or a block before it, computes its terms under a
    condition (``if_then_else`` or a select: a padded input); an epilogue's select (a ReLU) is
    no operand of the product."""
    for realize in _realizes(func.body):
        block = realize.block
        if block.name_hint == "root":
            continue
        if selects(block):
            return True
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars):
            return False
    return False


def _realizes(stmt):
    """Every block realize in ``stmt``."""
    if isinstance(stmt, s_tir.SBlockRealize):
        yield stmt
        yield from _realizes(stmt.block.body)
    elif isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            yield from _realizes(child)
    elif isinstance(stmt, tirx.For):
        yield from _realizes(stmt.body)


def _block_index_nest(func: tirx.PrimFunc) -> list[tirx.For]:
    """The nest of ``blockIdx`` loops (outermost first) at the top of ``func``."""
    nest, body = [], func.body.block.body
    while isinstance(body, tirx.For) and body.thread_binding is not None and \
            body.thread_binding.thread_tag.startswith("blockIdx"):
        nest.append(body)
        body = body.body
    if not nest:
        raise ScheduleError(f"dlight's matmul schedule binds no blockIdx loop:\n{func}")
    return nest


def _tile_strides(nest: list[tirx.For]) -> list[int]:
    """Each block index's weight in the folded tile index, the outermost the most significant."""
    extents = [_constant(loop.extent) for loop in nest]
    return [product_of(extents[k + 1:]) for k in range(len(extents))]


def _fold_block_indices(func: tirx.PrimFunc, nest: list[tirx.For]) -> tirx.PrimFunc:
    """``func`` with its ``nest`` of ``blockIdx`` loops made one ``blockIdx.x`` loop over their
    product, each index bound to its digit of the tile."""
    realize = func.body
    root = realize.block
    dtype = str(nest[0].loop_var.ty.dtype)
    n_tiles = product_of(_constant(loop.extent) for loop in nest)
    tile = tirx.Var("tile", dtype)
    digits = [tirx.Bind(loop.loop_var, tirx.floormod(tirx.floordiv(tile, tirx.const(stride, dtype)), loop.extent))
              for loop, stride in zip(nest, _tile_strides(nest))]
    binding = tirx.IterVar(tvm.ir.Range(0, tirx.const(n_tiles, dtype)), tile, tirx.IterVar.ThreadIndex, "blockIdx.x")
    loop = tirx.For(tile, tirx.const(0, dtype), tirx.const(n_tiles, dtype), tirx.ForKind.THREAD_BINDING,
                    tirx.SeqStmt(digits + [nest[-1].body]), binding)
    root = type(root)(root.iter_vars, root.reads, root.writes, root.name_hint, loop, root.init, root.alloc_buffers,
                      root.match_buffers, root.annotations)
    return func.with_body(type(realize)(realize.iter_values, realize.predicate, root))


def _constant(e) -> int:
    if not isinstance(e, tirx.IntImm):
        raise ScheduleError(f"loop extent {e} is not a constant")
    return int(e.value)


class _BlockIslWriter(IslWriter):
    """``IslWriter`` over loops that also reads a block's iterators, as the values they are bound to."""

    def __init__(self, axes: list, bound: dict):
        super().__init__(axes)
        self.bound = bound

    def name_of(self, var) -> str:
        for iterator, value in self.bound.items():
            if iterator.same_as(var):
                return f"({self.aff(value).text})"
        return super().name_of(var)


def _tile_relation(func: tirx.PrimFunc, nest: list[tirx.For]) -> isl.Map | None:
    """tile -> the output elements the tile writes: every block instance writing the output,
    over the loops around it (their bounds, the block's guard and the ``if``s around it: a tile of
    fewer warps than the block's, ``codegen.tensor_core._idle_warps``), the tile being the ``nest``
    of block indices folded (``_fold_block_indices``), as an isl relation. None where an index is
    not quasi-affine in the loops."""
    output = func.params[-1]
    found = list(_writes_to(func.body, output, [], []))
    if len(found) != 1:
        return None
    loops, conditions, realize = found[0]
    names = [(loop.loop_var, f"l{k}") for k, loop in enumerate(loops)]
    block = realize.block
    writer = _BlockIslWriter(names, {iv.var: value for iv, value in zip(block.iter_vars, realize.iter_values)})
    (region,) = [r for r in block.writes if r.source.same_as(output)]
    if any(_constant(r.extent) != 1 for r in region.region):
        return None
    try:
        indices = [writer.aff(r.min).text for r in region.region]
        guards = [writer.condition(c) for c in [*conditions, realize.predicate]]
    except NotAffine:
        return None
    bounds = [f"{_constant(loop.min)} <= {name} < {_constant(loop.min) + _constant(loop.extent)}"
              for loop, (_, name) in zip(loops, names)]
    folded = " + ".join(f"{stride} * {name}" for (_, name), stride in zip(names, _tile_strides(nest)))
    outs = [f"o{d}" for d in range(len(indices))]
    condition = " and ".join(bounds + guards + [f"t = {folded}"] + [f"{o} = {i}" for o, i in zip(outs, indices)])
    return isl.Map(f"{{ [t] -> [{', '.join(outs)}] : exists ({', '.join(name for _, name in names)} : {condition}) }}")


def _writes_to(stmt, buffer: tirx.Buffer, loops: list, conditions: list):
    """(loops around it, outermost first; the conditions of the ``if``s around it; the realize) of
    each block of ``stmt`` writing ``buffer``."""
    if isinstance(stmt, s_tir.SBlockRealize):
        if any(r.source.same_as(buffer) for r in stmt.block.writes) and stmt.block.name_hint != "root":
            yield loops, conditions, stmt
            return
        yield from _writes_to(stmt.block.body, buffer, loops, conditions)
    elif isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            yield from _writes_to(child, buffer, loops, conditions)
    elif isinstance(stmt, tirx.For):
        yield from _writes_to(stmt.body, buffer, loops + [stmt], conditions)
    elif isinstance(stmt, tirx.IfThenElse):
        yield from _writes_to(stmt.then_case, buffer, loops, conditions + [stmt.condition])
        if stmt.else_case is not None:
            yield from _writes_to(stmt.else_case, buffer, loops, conditions + [tirx.Not(stmt.condition)])
    elif isinstance(stmt, s_tir.SBlock) or hasattr(stmt, "body"):
        yield from _writes_to(stmt.body, buffer, loops, conditions)


def _tile_box(relation: isl.Map) -> tuple[int, ...]:
    """The extent of tile 0 along each output dimension (every tile but the last ones along a
    dimension has the same)."""
    first = relation.intersect_domain(isl.Set("{ [0] }")).range()
    box = []
    for d in range(first.dim(isl.dim_type.set)):
        low, high = first.dim_min_val(d).to_python(), first.dim_max_val(d).to_python()
        box.append(int(high) - int(low) + 1)
    return tuple(box)


POOL_ALIGN_BYTES = 32  # a pooled buffer starts on 32 bytes: wmma's load and store need 256-bit aligned pointers


def pool_offsets(func: tirx.PrimFunc) -> list[tuple[tirx.Buffer, int]]:
    """Each shared buffer that ``func``'s inner blocks allocate, and the element where it starts
    in the kernel's pool (``codegen.tiled.pool_shared``), counted in its own dtype: the pool is
    one run of bytes for every dtype (``codegen.cuda``'s views of it, one per dtype, all from its
    first byte), each buffer on ``POOL_ALIGN_BYTES`` (``_pool_bytes``)."""
    return [(buffer, offset * 8 // tvm.runtime.DataType(buffer.dtype).bits) for buffer, offset in _pool_bytes(func)]


def pooled_shared(func: tirx.PrimFunc) -> int:
    """Bytes ``func``'s shared buffers take in the kernel's pool."""
    return max((offset + _buffer_bytes(buffer) for buffer, offset in _pool_bytes(func)), default=0)


def _buffer_bytes(buffer: tirx.Buffer) -> int:
    return buffer_elements(buffer) * tvm.runtime.DataType(buffer.dtype).bits // 8


def _pool_bytes(func: tirx.PrimFunc) -> list[tuple[tirx.Buffer, int]]:
    """Each inner shared buffer of ``func`` and its first byte in the pool, in the order they are
    allocated, each at the lowest offset on ``POOL_ALIGN_BYTES`` where it meets no buffer used in
    the same span of the stage (``_spans``): a tensor-core tile's float32 accumulators, stored
    once the last chunk's fragments are loaded, share bytes with the operand slices (a 128 x 128
    tile: 64 KB of accumulators in the 108 KB of its three copies of the slices, where apart they
    took 172 KB, more than two blocks of an SM can have). The block's barriers between the
    slices' last reads and the accumulators' first stores are TVM's, as it pools the two itself;
    the thread-level validator checks them."""
    buffers = list(_inner_shared(func.body))
    spans = _spans(func, buffers)
    placed: list[tuple[tirx.Buffer, int]] = []
    for buffer in buffers:
        size = _buffer_bytes(buffer)
        live = [(offset, offset + _buffer_bytes(other)) for other, offset in placed
                if not (spans[id(buffer)][1] < spans[id(other)][0] or spans[id(other)][1] < spans[id(buffer)][0])]
        for start in sorted({0} | {align(end, POOL_ALIGN_BYTES) for _, end in live}):
            if all(start + size <= low or high <= start for low, high in live):
                placed.append((buffer, start))
                break
    return placed


def _spans(func: tirx.PrimFunc, buffers: list[tirx.Buffer]) -> dict:
    """Each buffer's span in ``func``, by ``id``: the first and last block (in program order) that reads or
    writes it, widened to the whole of every loop it is used in (its iterations interleave the
    uses), except the tile loop and the loops over threads, which every use shares."""
    uses: dict = {id(b): [] for b in buffers}
    loops: list[tuple[int, int]] = []
    counter = itertools.count()

    def visit(stmt, top: bool):
        if isinstance(stmt, s_tir.SBlockRealize):
            visit(stmt.block, top)
        elif isinstance(stmt, s_tir.SBlock):
            position = next(counter)
            touched = [r.source for r in [*stmt.reads, *stmt.writes]]
            for buffer in buffers:
                if any(t.same_as(buffer) for t in touched):
                    uses[id(buffer)].append(position)
            visit(stmt.body, False)
        elif isinstance(stmt, tirx.SeqStmt):
            for child in stmt.seq:
                visit(child, top)
        elif isinstance(stmt, tirx.For):
            first = next(counter)
            visit(stmt.body, False)
            if not top and stmt.kind != tirx.ForKind.THREAD_BINDING:
                loops.append((first, next(counter)))
        elif isinstance(stmt, tirx.IfThenElse):
            visit(stmt.then_case, top)
            if stmt.else_case is not None:
                visit(stmt.else_case, top)
        elif hasattr(stmt, "body"):
            visit(stmt.body, top)

    realize = func.body
    visit(realize.block.body if isinstance(realize, s_tir.SBlockRealize) else realize, True)
    spans = {}
    for buffer in buffers:
        positions = uses[id(buffer)] or [0]
        low, high = min(positions), max(positions)
        widened = True
        while widened:
            widened = False
            for first, last in loops:
                if low <= last and first <= high and (first < low or high < last):
                    low, high, widened = min(low, first), max(high, last), True
        spans[id(buffer)] = (low, high)
    return spans


def _inner_shared(stmt, root: bool = True):
    """The shared buffers the blocks below ``stmt``'s root block allocate."""
    if isinstance(stmt, s_tir.SBlockRealize):
        yield from _inner_shared(stmt.block, root)
    elif isinstance(stmt, s_tir.SBlock):
        if not root:
            yield from (b for b in stmt.alloc_buffers if b.scope().startswith("shared"))
        yield from _inner_shared(stmt.body, False)
    elif isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            yield from _inner_shared(child, root)
    elif isinstance(stmt, tirx.For):
        yield from _inner_shared(stmt.body, root)
