"""TVM's dlight tensor-core matmul rule (``dlight.gpu.MatmulTensorization``) in the shape of the
persistent kernel: float16 or bfloat16 operands, or float32 ones multiplied in TF32
(``precision="tf32"``), float32 accumulators in wmma fragments.

dlight's rule binds its own block, 16 warps of 4 x 2 fragments each (128 x 128 tiles), and
software-pipeline annotations; the persistent kernel has one block shape for every stage
(``codegen.schedule.THREADS``). This is the same schedule, step for step, with the warps and
fragments a ``TensorCoreTile`` says, for ``threads / 32`` warps or a divisor of them (a tile of 4
warps in a block of 8: the other 4 idle through the fragments, ``_idle_warps``):

- both operands are staged through shared memory one chunk of ``k_fragments`` x 16 terms (x 8 in
  TF32) at a time (rows padded by 8 elements, as dlight pads them, so that a fragment's rows fall on
  different banks), copied 16 bytes at a time (``COPY_BYTES``: 8 float16 or bfloat16 elements, 4
  float32) by all the block's threads;
- each of the tile's warps loads 16 x 16 fragments of both slices and accumulates ``fragments_i x fragments_j``
  16 x 16 x 16 products with ``mma_sync`` (TVM's wmma intrinsics, ``tensor_intrin.cuda``);
- the accumulators go through shared memory (a tile of float32, rows not padded: dlight's
  padding of it does not survive its ``reverse_compute_at``) to the output, where the stage's
  epilogue (the rounding to float16 or bfloat16, a bias, an activation) is computed on the way out.
- software pipelined with asynchronous copies (``TensorCoreTile.async_stages``, as MetaSchedule's
  tensor-core rule asks for them): the slices are a ring of ``ASYNC_STAGES`` copies in shared
  memory, and each thread issues its share of a chunk's copies (``cp.async``, global to shared
  memory without registers) two chunks before the warps compute on it, commits them as one group,
  and waits (``cp.async.wait_group``) for the oldest group before the block synchronizes to
  compute on it (TVM's ``InjectSoftwarePipeline`` and, under ``tirx.use_async_copy``,
  ``InjectPTXAsyncCopy``). The H100 took 1.8-1.9 us per chunk of paper BERT fp16's 128 x 128 tiles
  unpipelined, about 4x their compute, and about 1 us with the next chunk loaded one chunk ahead.
  An operand not read in whole vectors (``_copies_whole_vectors``) keeps that register pipeline
  (``pipeline_chunks``: each thread loads the next chunk into registers before the warps compute
  on this one, and stores them into the one copy of the slices after; TVM's
  ``ManifestSharedMemoryLocalStage``), as do the tiles of the ``register-pipeline`` variant. Both
  pipelines run on the stage before it is stitched (``codegen.schedule._compacted``). The
  thread-level validator matches each cp.async with the wait that retires it and the emulator
  lands each copy only at that wait (``souffle.runtime.emulated``).

TVM registers wmma intrinsics for float16 operands only; bfloat16's (m16n16k16, sm_80 and up) and
TF32's (m16n16k8, sm_80 and up) are registered here from TVM's own generators (``wmma_intrinsics``).
In TF32 a chunk is 4 x 8 terms (``TF32_TILES``), so that the float32 slices take the bytes of the
16-bit ones; the operand fragments are declared float16 for TVM's code generator, which refuses
float32 ones, and printed as CUDA's ``precision::tf32`` (``codegen.tf32``).

A GEMM whose sizes are not whole tiles is padded as dlight pads it (``pad_einsum``): the rows,
columns and terms past its edges read as zeros and are not stored (Swin's 196 tokens, ResNeXt's
14 x 14 and 7 x 7 feature maps). TVM's CUDA lowering puts each padded vector load under a branch,
which reads nothing past the operand; an operand's vectors run along its last dimension (the
terms, or the columns of a second operand kept in its own order), whose extent must be whole
vectors of them (``TensorCoreTile.copy_vector``, else ``VECTOR``, each operand its own), so that
the branch's condition holds for every element of the vector or for none. Columns that are not
whole vectors of ``VECTOR`` (a 1 x 1 convolution over a 7 x 7 map as the transposed GEMM: 49) are
stored an element a lane (``TensorCoreTile.store_vector``), and an operand whose vectors run along
them is copied an element a lane, through registers.

Left out: dlight's pipeline of the fragments' loads within a chunk (a third stage, two copies of
every fragment: registers the 128 x 128 tiles do not have).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from typing import NamedTuple

import islpy as isl
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                         get_reduction_blocks)

from analysis.affine import row_major
from analysis.dependence import IslWriter, NotAffine, constant, sub_expressions
from analysis.latency import SECTOR_BYTES
from analysis.threads import one_vector_instruction

FRAGMENT = 16  # the rows and columns of every wmma fragment this schedule uses
# wmma's reduction depth per operand dtype: m16n16k16 for float16 and bfloat16, m16n16k8 for float32
# operands multiplied in TF32 (``precision="tf32"``: the tensor cores read 10 bits of significand)
FRAGMENT_K = {"float16": 16, "bfloat16": 16, "float32": 8}
WARP = 32
VECTOR = 4  # elements per accumulator store, and per operand copy where the GEMM's sizes refuse COPY_BYTES
# bytes per operand copy from global to shared memory: a cp.async moves 4, 8 or 16 (PTX ISA), 16 a
# warp's 512 bytes in one instruction (cp.async.cg), where 8-byte copies of 16-bit operands took two
COPY_BYTES = 16
SLICE_PAD = 8  # elements added to each operand slice's rows (dlight's storage_align)
# Whether a GEMM whose first operand's rows run along its rows is scheduled as its transpose
# (``tensor_core_schedule``); off in benchmarks/gpu_variants.py's ``dlight-order``
TRANSPOSE_ROW_OPERANDS = True


class WarpCopy(NamedTuple):
    """A warp's copy of one vector a lane (``width`` elements) of an operand's slice from global
    memory, as scheduled: its global load instructions (one, or one a lane of the vector where
    TVM's code generator loads it lane by lane) and the 32-byte sectors they touch, counted per
    instruction and summed."""

    width: int
    loads: int
    sectors: int


@dataclass(frozen=True)
class TensorCoreTile:
    """A block tile: ``warps_i x warps_j`` warps, each ``fragments_i x fragments_j`` 16 x 16
    accumulators; the reduction staged ``k_fragments`` x 16 terms at a time."""

    warps_i: int
    warps_j: int
    fragments_i: int
    fragments_j: int
    k_fragments: int = 4
    pipelined: bool = True  # the next chunks loaded while the warps compute on this one
    fragment_k: int = FRAGMENT  # terms per fragment: 16, or 8 for TF32 (``FRAGMENT_K``)
    # Pipelined with asynchronous copies (``cp.async``): this many copies of the slices in shared
    # memory, a ring in which ``async_stages - 1`` chunks are in flight while the warps compute on
    # one. 0: pipelined through registers, one chunk ahead (``pipeline_chunks``).
    async_stages: int = 0
    # elements per operand copy (``COPY_BYTES`` of the operands' dtype; ``VECTOR`` where neither
    # operand's vectors fit whole in its extent along them; an operand whose vectors do not, where
    # the other's do, is copied ``VECTOR`` a lane: ``warp_copies`` has each operand's width)
    copy_vector: int = COPY_BYTES // 2
    # each operand's ``WarpCopy`` as ``tensor_core_schedule`` scheduled it (None for one copied under
    # a condition, an element a lane); empty where no schedule measured them. A fact of the GEMM the
    # tile was scheduled on, not of the tile: tiles compare without it
    warp_copies: tuple[WarpCopy | None, ...] = dataclasses.field(default=(), compare=False)
    # elements per store of the output tile: ``VECTOR``, or one where the GEMM's columns are not
    # whole vectors (a 1 x 1 convolution over a 7 x 7 map as the transposed GEMM: 49 columns)
    store_vector: int = VECTOR

    @property
    def rows(self) -> int:
        return FRAGMENT * self.warps_i * self.fragments_i

    @property
    def columns(self) -> int:
        return FRAGMENT * self.warps_j * self.fragments_j

    @property
    def depth(self) -> int:
        return self.fragment_k * self.k_fragments

    @property
    def warps(self) -> int:
        return self.warps_i * self.warps_j

    @property
    def narrow(self) -> bool:
        """One of ``NARROW_TILES``' shapes: at most ``NARROW_COLUMNS`` columns."""
        return self.columns <= NARROW_COLUMNS

    @property
    def copies_async(self) -> bool:
        """Whether the slices are copied with ``cp.async`` into a ring of ``async_stages`` copies."""
        return self.pipelined and self.async_stages >= 2

    def __str__(self):
        pipeline = (f", {self.async_stages}-stage cp.async pipeline" if self.copies_async
                    else ", pipelined" if self.pipelined else "")
        return f"{self.rows}x{self.columns}x{self.depth} ({self.warps_i}x{self.warps_j} warps of " \
               f"{self.fragments_i}x{self.fragments_j} fragments{pipeline})"


# Copies of the slices in the cp.async ring of the wide tiles: two chunks in flight while the warps
# compute on a third (a 128 x 128 tile's slices: 108 KB of shared memory, 36 KB a copy).
ASYNC_STAGES = 3
# The tiles a stage may take (the latency model picks one per stage). On the block's 8 warps:
# 128 x 128 reuses each slice most, 64 x 64 gives a small GEMM (paper BERT's 384 x 768) enough
# tiles for the SMs. 96 x 128 sits between them: paper BERT's FFN GEMMs (384 rows) are 96 tiles of
# it against 72 of 128 x 128 for the H100's 132 SMs, each warp loading 5 fragments for 6 products
# where 128 x 128 loads 6 for 8 (H100 model: 6.9-7.0 to 5.7-5.8 us each).
# On 4 warps, the block's other 4 idle through the fragments (they copy the slices): a GEMM of one
# partial round of tiles takes as long as its busiest SM's tile, and each warp's fragment loads from
# shared memory, not the tensor cores, bound that tile. Fewer warps, each with more fragments,
# load fewer for the same products: 96 x 96 is 2 x 2 warps of 3 x 3, 6 loads for 9 products, and
# paper BERT's FFN GEMMs are 128 tiles of it (H100 model: 5.7-5.8 to 4.0-4.2 us, 32% to 44-47% of
# the peak); 128 x 128 is 4 x 4 fragments a warp, 8 loads for 16.
TILES = tuple(TensorCoreTile(2, 4, i, j, async_stages=ASYNC_STAGES) for i, j in ((4, 2), (3, 2), (2, 2), (2, 1))) + \
    tuple(TensorCoreTile(2, 2, i, j, async_stages=ASYNC_STAGES) for i, j in ((4, 4), (3, 3), (2, 2)))
# A tensor-core tile of fewer warps than the block's (``TILES``' 4-warp tiles; the others idle
# through its fragments) is offered only for a GEMM of at most this many of its
# tiles: one round of one tile an SM (the H200's and H100's 132), where the stage takes as long as
# one SM's one tile and the idle warps cost nothing the grid had. Over more rounds they would,
# which the latency model, taking an SM's throughputs whatever its warps, does not see. (What their
# accumulators, 72 registers a thread for 96 x 96, cost a kernel's blocks per SM is weighed by
# ``codegen.stage.keep_occupancy``.) Checked on the GEMM's extents before it is scheduled.
IDLE_WARPS_MAX_TILES = 132
# The same tiles for float32 operands in TF32: m16n16k8 fragments, 32 terms a chunk, so that the
# float32 slices take the shared memory of the 16-bit tiles' 64 terms.
# Their ring of cp.async copies is two deep: three copies of a 128 x 128 tile's float32 slices
# would take 120 KB, more than two blocks of an H100 SM may have (the partition then split Swin at
# tf32 into 8 kernels, where 2 copies, 80 KB, keep it in 2).
TF32_ASYNC_STAGES = 2
# bfloat16 operands take the same tiles in a ring of two: in a ring of three, paper BERT at bf16
# needed 255 registers and spilled 24 B (ptxas, sm_90); in a ring of two, 174 and none. The H100
# model estimates both the same (the tiles are bound by their fragment loads).
BF16_ASYNC_STAGES = 2
TF32_TILES = tuple(dataclasses.replace(tile, fragment_k=FRAGMENT_K["float32"], async_stages=TF32_ASYNC_STAGES,
                                       copy_vector=COPY_BYTES // 4) for tile in TILES)
# Tiles one or two fragments wide, for a GEMM of at most ``NARROW_COLUMNS`` columns (a grouped
# convolution's group: paper ResNeXt's 16 or 32 output channels), which the tiles above would
# leave three quarters empty, and for a wider GEMM that no tile above fills to half (paper
# EfficientNet's projection to 80 channels at 14 x 14: 196 x 80 in 256 x 128 padded). Three
# fragments of terms a chunk: a 3 x 3 window over 16 input channels is 144 terms, three whole
# chunks. Not pipelined: a grouped convolution's input slice is gathered
# (``codegen.schedule.gathered_operands``), an index and a condition per element, and holding a
# thread's 24 elements of the next chunk took ptxas to 255 registers and a spill (paper ResNeXt
# at fp16, sm_90), where the unpipelined tile takes 80.
NARROW_COLUMNS = 32
NARROW_TILES = (TensorCoreTile(8, 1, 1, 1, k_fragments=3, pipelined=False),
                TensorCoreTile(4, 2, 1, 1, k_fragments=3, pipelined=False))
TF32_NARROW_TILES = tuple(dataclasses.replace(tile, fragment_k=FRAGMENT_K["float32"], copy_vector=COPY_BYTES // 4)
                          for tile in NARROW_TILES)


def gemm_extents(sch: s_tir.Schedule, block) -> tuple[int, int, int, int] | None:
    """(batch, rows, columns, reduction) of the normalized ``C[S, I, J] += A[S, I, K] * B[S, J, K]``
    block, or None where an extent is not constant."""
    extents = [iv.dom.extent for iv in sch.get(block).iter_vars]
    if len(extents) != 4 or not all(isinstance(e, tirx.IntImm) for e in extents):
        return None
    return tuple(int(e.value) for e in extents)


def _tvm_cuda_intrinsics():
    """TVM's module of CUDA tensor intrinsics, imported here, where a tensor-core GEMM needs it.

    The module parses every CUDA tensor intrinsic TVM has with TVMScript when it is imported, and
    TVMScript's ``prim_func`` calls ``inspect.stack()``, which looks up each frame's module. The
    import machinery's own frames (``<frozen importlib._bootstrap>``) are no file, so CPython's
    ``inspect.getmodule`` scans all of ``sys.modules`` for each of them, every time: with torch
    loaded that made the import take 57 s on this project's machine (146 s under pytest's deeper
    stack). Entering those two frozen modules in ``inspect``'s file-to-module cache, which is what
    the scan would conclude, takes it to about 8 s."""
    for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
        inspect.modulesbyfile.setdefault(f"<frozen {name}>", name)
    from tvm.s_tir.tensor_intrin import cuda

    return cuda


@functools.cache
def wmma_intrinsics(operand_dtype: str, trans_b: bool = True) -> dict[str, str]:
    """The names of TVM's wmma intrinsics this schedule tensorizes with, for operands of
    ``operand_dtype``: operands loaded from ``shared.dyn``, the second transposed (its slice
    [columns, terms]) or, without ``trans_b``, not ([terms, columns]), float32 accumulators stored
    to ``shared.dyn``. TVM registers them for float16 operands only; the others' are registered
    here, on first use, from TVM's generators, under the names TVM's scheme gives them: ``bf16``
    for ``f16``, and for float32 operands (TF32) the m16n16k8 shape, ``tf32`` operands and their
    own float32 fill and store (an accumulator fragment's shape is its type)."""
    cuda = _tvm_cuda_intrinsics()

    group = cuda.get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                       out_dtype="float32", trans_b=trans_b)
    if operand_dtype == "float16":
        return group
    assert operand_dtype in FRAGMENT_K, operand_dtype
    k = FRAGMENT_K[operand_dtype]
    generated = {
        "load_a": cuda.get_wmma_load_intrin(FRAGMENT, FRAGMENT, k, operand_dtype, "shared.dyn", False, False),
        "load_b": cuda.get_wmma_load_intrin(FRAGMENT, FRAGMENT, k, operand_dtype, "shared.dyn", True, trans_b),
        "compute": cuda.get_wmma_sync_intrin(FRAGMENT, FRAGMENT, k, operand_dtype, "float32", trans_b),
    }
    if operand_dtype == "float32":
        generated["init"] = cuda.get_wmma_fill_intrin(FRAGMENT, FRAGMENT, k, "float32")
        generated["store"] = cuda.get_wmma_store_intrin(FRAGMENT, FRAGMENT, k, "float32", "shared.dyn")
    shape = f"{FRAGMENT}x{FRAGMENT}x{k}"
    for key, (desc, impl) in generated.items():
        name = group[key].replace("16x16x16", shape)
        if key in ("load_a", "load_b", "compute"):
            name = name.replace("f16", {"bfloat16": "bf16", "float32": "tf32"}[operand_dtype])
        group[key] = name
        if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
            s_tir.TensorIntrin.register(name, desc, impl)
    return group


def pipeline_chunks_async(sch: s_tir.Schedule, chunk, copies, stages: int) -> None:
    """Software-pipeline the loop ``chunk`` over chunks of a GEMM's reduction with asynchronous
    copies, as MetaSchedule's tensor-core rule asks for them (``software_pipeline_async_stages``):
    both operands' ``copies`` into shared memory run ``stages - 1`` iterations ahead of the product,
    each slice in a ring of ``stages`` copies (TVM's ``InjectSoftwarePipeline`` sizes the ring),
    issued as ``cp.async`` (``InjectPTXAsyncCopy``, under ``tirx.use_async_copy``), committed as one
    group per chunk and waited on (``cp.async.wait_group``) before the block synchronizes to compute
    on them. No register stage: the copies go from global to shared memory directly."""
    sch.annotate(chunk, "software_pipeline_stage", [0, 0, stages - 1])
    sch.annotate(chunk, "software_pipeline_order", [0, 1, 2])
    sch.annotate(chunk, "software_pipeline_async_stages", [0])


def pipeline_chunks(sch: s_tir.Schedule, chunk, copies) -> None:
    """Software-pipeline the loop ``chunk`` over chunks of a GEMM's reduction, whose body is the
    two operands' ``copies`` into shared memory and the product: each copy gets a register stage
    (TVM's ``ManifestSharedMemoryLocalStage``: global -> registers, registers -> shared), and
    ``InjectSoftwarePipeline`` then runs, in each iteration, both loads of the next chunk into
    registers, the product of this chunk, and both stores of the next chunk into the slices:
    dlight's order (``MatmulTensorization``), less its fragments' own pipeline. The passes run in
    ``codegen.schedule._compacted``; the SIMT matmul (``codegen.schedule._pipeline_slices``) and
    the tensor-core tiles share this."""
    for copy in copies:
        sch.annotate(copy, "tirx.manifest_shared_memory_local_stage", 1)
    # the loop's body then: A to registers, A to shared, W to registers, W to shared, the product
    sch.annotate(chunk, "software_pipeline_order", [0, 3, 1, 4, 2])
    sch.annotate(chunk, "software_pipeline_stage", [0, 0, 0, 0, 1])


def _copies_whole_vectors(sch: s_tir.Schedule, copy, width: int) -> bool:
    """Whether ``copy`` (an operand's copy into its slice, its producers inlined) reads ``width``
    consecutive elements of the operand for each vector it stores, from an element a multiple of
    ``width`` into the operand, what a cp.async moves (its source aligned on its bytes, PTX ISA):
    isl finds no element of a vector (``width`` consecutive values of the copy's last iterator, from
    a multiple of ``width``) whose successor in the vector is not the next element in memory, and no
    vector whose first element is not on a whole vector of the operand (which starts on
    ``codegen.stitch.ARENA_ALIGN`` elements in the arena, a weight on its own allocation). TVM's
    ``InjectPTXAsyncCopy`` makes a cp.async of any vectorized copy into shared memory, also of a
    vector gathered from strided elements (a batched product's second operand read along its
    rows, BERT's P.V), which then copies the wrong elements: such a copy stays in the register
    pipeline. A head's slice of merged heads (``k % 64``) is read in whole vectors."""
    block = sch.get(copy)
    if not isinstance(block.body, tirx.BufferStore) or constant(sch.get(sch.get_loops(copy)[-1]).extent) != width:
        return False
    loads = [e for e in sub_expressions(block.body.value) if isinstance(e, TensorLoad)]
    if not loads:
        return False
    names = [f"b{k}" for k in range(len(block.iter_vars))]
    last = names[-1]
    domain = [f"{int(iv.dom.min)} <= {name} < {int(iv.dom.min) + int(iv.dom.extent)}"
              for iv, name in zip(block.iter_vars, names)]
    here = IslWriter([(iv.var, name) for iv, name in zip(block.iter_vars, names)])
    then = IslWriter([(iv.var, name if name != last else f"({last} + 1)") for iv, name in zip(block.iter_vars, names)])
    for load in loads:
        flat = row_major(list(load.indices), load.source.shape)
        try:
            offsets = [writer.index(flat).text for writer in (here, then)]
        except NotAffine:
            return False
        points = f"[{', '.join(names)}] : {' and '.join(domain)}"
        apart = isl.Set(f"{{ {points} and ({last} mod {width}) < {width - 1} and {offsets[1]} != {offsets[0]} + 1 }}")
        misaligned = isl.Set(f"{{ {points} and ({last} mod {width}) = 0 and ({offsets[0]}) mod {width} != 0 }}")
        if not (apart.is_empty() and misaligned.is_empty()):
            return False
    return True


def _loads_as_vectors(sch: s_tir.Schedule, copy, width: int) -> bool:
    """Whether TVM's CUDA code generator loads each vector of ``copy`` (its last loop vectorized by
    ``width``) with one instruction: each load's flat index, in the copy's loops, run through TVM's
    ``VectorizeLoop`` and ``StmtSimplify`` as the kernel's lowering runs them, is a load CodeGenC
    prints as one instruction (``analysis.threads.one_vector_instruction``, which the validator
    checks the alignment of).
    Else it loads lane by lane, and prints eight lanes as a ``make_uint4`` or ``make_longlong4`` of
    eight values, which nvcc refuses (a grouped convolution's weights, ``[O, C, 3, 3]`` read at
    ``k // 9``, ``k % 9 // 3`` and ``k % 3``: consecutive, not a ramp to the vectorizer)."""
    loads = _copy_loads(sch, copy)
    return loads is not None and all(_vector_loads(sch, copy, width, loads))


def _vector_loads(sch: s_tir.Schedule, copy, width: int, loads: list) -> list[bool]:
    """For each of ``loads`` (``copy``'s, ``_copy_loads``), whether TVM loads its vector with one
    instruction (``_loads_as_vectors``)."""
    loops = [sch.get(loop) for loop in sch.get_loops(copy)]
    analyzer = tvm.sym.Analyzer()
    for loop in loops:
        analyzer.bind(loop.loop_var, tvm.ir.Range.from_min_extent(loop.min, loop.extent))
    vectors = []
    for load, flat in loads:
        # simplified first, as the kernel's lowering simplifies before it vectorizes: a 1 x 1
        # convolution's input read at [c, hw // 14, hw % 14] is read at 196 c + hw
        flat = analyzer.simplify(flat)
        dtype = str(load.source.dtype)
        source = tirx.decl_buffer((math.prod(int(d) for d in load.source.shape),), dtype, "source")
        target = tirx.decl_buffer((width,), dtype, "target")
        body = tirx.BufferStore(target, tirx.BufferLoad(source, [flat]), [loops[-1].loop_var])
        for loop, kind in zip(reversed(loops), [tirx.ForKind.VECTORIZED] + [tirx.ForKind.SERIAL] * (len(loops) - 1)):
            body = tirx.For(loop.loop_var, loop.min, loop.extent, kind, body)
        lowered = tvm.transform.Sequential([tirx.transform.VectorizeLoop(), tirx.transform.StmtSimplify()])(
            tvm.IRModule({"main": tirx.PrimFunc([source, target], body)}))["main"]
        indices = []
        tvm_ffi.structural_walk(lowered.body, lambda node: indices.extend(node.indices)
                                if isinstance(node, TensorLoad) else None)
        vectors.append(bool(indices) and all(one_vector_instruction(i, width, write=False) for i in indices))
    return vectors


def _warp_copy(sch: s_tir.Schedule, copy, width: int, asynchronous: bool) -> WarpCopy:
    """What the first warp's first copy of ``copy`` (an operand's copy into its slice, its producers
    inlined, its last two loops the lanes and the ``width`` elements of each lane's vector) loads:
    one instruction a load of the copy where it is a cp.async (``asynchronous``: whole vectors,
    ``_copies_whole_vectors``) or TVM loads the vector as one (``_loads_as_vectors``), one where
    it reads one element for the whole vector, else one a
    lane of the vector, each touching the sectors of its lanes' elements (an index that
    reads memory, a gather, a sector of its own). Coalesced, a warp's 16-byte copies touch 16
    sectors in one instruction; A^T's 4-element copies, each vector gathered from four rows of A,
    touch 16 sectors in each of four."""
    loops = [sch.get(loop) for loop in sch.get_loops(copy)]
    lane, vector = loops[-2], loops[-1]
    outer = {loop.loop_var: loop.min for loop in loops[:-2]}  # the first warp's first copy
    analyzer = tvm.sym.Analyzer()
    copy_loads = _copy_loads(sch, copy)
    vectors = [asynchronous] * len(copy_loads) if asynchronous or width == 1 else \
        _vector_loads(sch, copy, width, copy_loads)
    loads = sectors = 0
    for (load, flat), whole in zip(copy_loads, vectors):
        itemsize = tvm.DataType(str(load.source.dtype)).bits // 8
        flat = analyzer.simplify(tvm_ffi.structural_map(flat, [(tirx.Var, lambda v: outer.get(v, v))]))

        def element_at(at_lane: int, element: int):
            point = {lane.loop_var: lane.min + at_lane, vector.loop_var: vector.min + element}
            index = analyzer.simplify(tvm_ffi.structural_map(flat, [(tirx.Var, lambda v: point.get(v, v))]))
            return index.value if isinstance(index, tirx.IntImm) else None

        def sector(at_lane: int, element: int):
            index = element_at(at_lane, element)
            return (at_lane, element) if index is None else index * itemsize // SECTOR_BYTES

        # the same element for the whole vector (a scaled operand's scale): nvcc loads it once
        broadcast = all(element_at(at_lane, 0) is not None and
                        all(element_at(at_lane, e) == element_at(at_lane, 0) for e in range(1, width))
                        for at_lane in range(WARP))

        instructions = [range(width)] if whole else [[0]] if broadcast else [[element] for element in range(width)]
        loads += len(instructions)
        sectors += sum(len({sector(at_lane, element) for at_lane in range(WARP) for element in elements})
                       for elements in instructions)
    return WarpCopy(width, loads, sectors)


def _copy_loads(sch: s_tir.Schedule, copy) -> list | None:
    """The loads of ``copy`` (its producers inlined), each (buffer, indices) once, as nvcc loads
    them, with its flat index in the operand in the copy's loop variables: (load, index) pairs;
    None where the schedule has no realize of the block."""
    realize = _realize_of(sch, copy)
    if realize is None:
        return None
    values = {iv.var: value for iv, value in zip(realize.block.iter_vars, realize.iter_values)}
    distinct = []
    for load in (e for e in sub_expressions(realize.block.body.value) if isinstance(e, TensorLoad)):
        if not any(seen.source.same_as(load.source) and tvm_ffi.structural_equal(list(seen.indices), list(load.indices))
                   for seen in distinct):
            distinct.append(load)
    return [(load, tvm_ffi.structural_map(row_major(list(load.indices), load.source.shape),
                                          [(tirx.Var, lambda v: values.get(v, v))])) for load in distinct]


def _realize_of(sch: s_tir.Schedule, block_rv):
    """The ``SBlockRealize`` of ``block_rv`` in the schedule's function (its iterators' values)."""
    block = sch.get(block_rv)
    found = []

    def visit(node):
        if isinstance(node, s_tir.SBlockRealize) and node.block.same_as(block):
            found.append(node)

    tvm_ffi.structural_walk(sch.mod["main"].body, visit)
    return found[0] if found else None


def _steps_by_one(sch: s_tir.Schedule, copy, dim: int) -> bool:
    """Whether ``copy`` (an operand's reindex copy, ``T[s, j, k] = B[...]``) reads the next element
    in memory for the next element of ``T`` along its dimension ``dim``: the operand's rows run
    along that dimension. isl finds, for each load of the copy (an operand summed from split-K
    partials reads each partial), no two points of the copy whose writes are one apart along
    ``dim`` (and equal elsewhere) whose reads are not one apart."""
    block = sch.get(copy)
    if not isinstance(block.body, tirx.BufferStore):
        return False
    loads = [e for e in sub_expressions(block.body.value) if isinstance(e, TensorLoad)]
    if not loads:
        return False
    iters = block.iter_vars
    points = {tag: [f"{tag}{k}" for k in range(len(iters))] for tag in ("p", "q")}
    writers = {tag: IslWriter([(iv.var, name) for iv, name in zip(iters, names)]) for tag, names in points.items()}
    domain = [f"{int(iv.dom.min)} <= {name} < {int(iv.dom.min) + int(iv.dom.extent)}"
              for names in points.values() for iv, name in zip(iters, names)]
    try:
        written = {tag: [w.index(i).text for i in block.body.indices] for tag, w in writers.items()}
        reads = [{tag: w.index(row_major(list(load.indices), load.source.shape)).text for tag, w in writers.items()}
                 for load in loads]
    except NotAffine:
        return False
    neighbours = [f"{q} = {p} + {int(k == dim)}" for k, (p, q) in enumerate(zip(written["p"], written["q"]))]
    names = ", ".join(points["p"] + points["q"])
    return all(isl.Set(f"{{ [{names}] : {' and '.join(domain + neighbours)} and {read['q']} != {read['p']} + 1 }}")
               .is_empty() for read in reads)


def _operand_dtypes(tile: TensorCoreTile) -> tuple[str, ...]:
    """What ``tile``'s fragments multiply: float32 in TF32 for m16n16k8, float16 or bfloat16 for m16n16k16."""
    return tuple(dtype for dtype, k in FRAGMENT_K.items() if k == tile.fragment_k)


def selects(block: s_tir.SBlock) -> bool:
    """Whether ``block`` chooses its values by a condition (``if_then_else`` or a select)."""
    text = str(block.body)
    return "if_then_else(" in text or "Select(" in text


def _operands_swapped(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """``func`` with its block ``name`` (``C += A * B``) reading ``B`` first (``C += B * A``): the
    first operand is dlight's ``A``, whose axes the GEMM's rows are, so the GEMM is taken as its
    transpose, ``C^T = B A^T``. The same products (a multiplication commutes exactly)."""

    def swap(block):
        if block.name_hint != name:
            return block
        update = block.body
        product = update.value.b  # C[...] + A * B
        value = tirx.Add(update.value.a, tirx.Mul(product.b, product.a))
        return s_tir.SBlock(block.iter_vars, list(reversed(block.reads)), block.writes, block.name_hint,
                            tirx.BufferStore(update.buffer, value, update.indices), block.init, block.alloc_buffers,
                            block.match_buffers, block.annotations)

    return tvm_ffi.structural_map(func, [(s_tir.SBlock, swap)])


def _computed_reads(sch: s_tir.Schedule, block, selecting: bool = False) -> list[bool]:
    """For each buffer ``block`` reads, whether a block of the function computes it from other
    values (``codegen.schedule.gathered_operands``: a padded convolution's input, a scaled
    operand), not only reads it elsewhere (a slice); with ``selecting``, one that ``selects`` its
    values (a padding)."""
    computed = [write.source for producer in sch.get_producers(block)
                if selects(sch.get(producer)) or (not selecting and _computes(sch.get(producer)))
                for write in sch.get(producer).writes]
    return [any(read.source.same_as(c) for c in computed) for read in sch.get(block).reads]


def _computes(block: s_tir.SBlock) -> bool:
    """Whether ``block`` stores anything but one load, perhaps cast."""
    if not isinstance(block.body, tirx.BufferStore):
        return True
    value = block.body.value
    while isinstance(value, tirx.Cast):
        value = value.value
    return not isinstance(value, TensorLoad)


# The most accumulator fragments a warp of a whole-row tile holds (``whole_row_tile``): 16, eight
# registers each, as many as a warp of a 128 x 256 tile would.
WHOLE_ROW_FRAGMENTS = 16


def whole_row_tile(rows: int, columns: int, warps: int) -> TensorCoreTile | None:
    """A tile of ``rows`` whole rows of a GEMM ``columns`` wide, its ``warps`` warps side by side
    along the columns, each holding all the rows (``codegen.align_tiles`` gives it to a GEMM whose
    row-resident reader, a softmax, takes the same rows a tile); None where the rows or columns
    are not whole fragments a warp, or a warp would hold more than ``WHOLE_ROW_FRAGMENTS``. Not
    pipelined: the GEMM it is for (attention's scores, K = 64 terms) is one chunk, and its slices
    (448 rows for 384 columns) are copied once, not into a ring."""
    if rows % FRAGMENT or columns % (FRAGMENT * warps):
        return None
    tile = TensorCoreTile(1, warps, rows // FRAGMENT, columns // (FRAGMENT * warps), pipelined=False)
    return tile if tile.fragments_i * tile.fragments_j <= WHOLE_ROW_FRAGMENTS else None


def _whole(extent: int, tile: int) -> int:
    """``extent`` rounded up to whole tiles."""
    return -(-extent // tile) * tile


def _fills(rows: int, columns: int, tile: TensorCoreTile, share: float) -> bool:
    """Whether a ``rows x columns`` GEMM fills at least ``share`` of its padded ``tile``s."""
    return rows * columns >= share * _whole(rows, tile.rows) * _whole(columns, tile.columns)


def tensor_core_schedule(func: tirx.PrimFunc, tile: TensorCoreTile, threads: int, min_use: float = 0.0,
                         wide_min_use: float = 0.0, swapped: bool = False) -> tuple[s_tir.Schedule, TensorCoreTile] | None:
    """``func`` (one GEMM-shaped reduction of float16 or bfloat16 operands into float32, with or
    without its element-wise epilogue) scheduled on tensor cores in ``tile``s for blocks of
    ``threads`` threads, padded to whole tiles, or None where it does not fit: other dtypes, not
    GEMM-shaped, terms not whole vectors, a tile of other than a divisor of ``threads / 32`` warps,
    one of fewer warps for more than ``IDLE_WARPS_MAX_TILES`` tiles,
    or one whose padded tiles the GEMM's outputs would fill less than ``min_use`` of, or a narrow
    tile for a GEMM wider than ``NARROW_COLUMNS`` that a wide tile fills to ``wide_min_use``. Its
    tiles are bound to ``blockIdx.z`` (the batch) and ``blockIdx.x``, as dlight binds them. An operand
    computed (``codegen.schedule.gathered_operands``) is copied through registers: under a
    condition, element-wise; scaled, in vectors.
    Returned with the tile as scheduled: one that asks for cp.async copies of operands that are not
    read in whole vectors (``_copies_whole_vectors``) gets the register pipeline instead."""
    if threads % (tile.warps * WARP):
        return None
    sch = s_tir.Schedule(func)
    reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if reductions is None or len(reductions) != 1:
        return None
    main = reductions[0]
    stmt = sch.get(main)
    conditional, computed = _computed_reads(sch, main, selecting=True), _computed_reads(sch, main)
    operands = [str(r.source.dtype) for r in stmt.reads]
    if operands not in [[dtype, dtype] for dtype in _operand_dtypes(tile)] or \
            [str(w.source.dtype) for w in stmt.writes] != ["float32"]:
        return None
    if operands[0] == "bfloat16" and tile.copies_async:
        tile = dataclasses.replace(tile, async_stages=BF16_ASYNC_STAGES)
    try:
        reindex_a = sch.reindex(main, ("read", 0))
        reindex_b = sch.reindex(main, ("read", 1))
        reindex_c = sch.reindex(main, ("write", 0))
        maps = get_index_map(sch.get(main))
    except s_tir.ScheduleError:
        return None
    if maps is None:
        return None
    block_map, a_map, b_map, c_map = maps
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)
    if TRANSPOSE_ROW_OPERANDS and not swapped and tile.fragment_k == FRAGMENT and not any(conditional) and \
            _steps_by_one(sch, reindex_a, 1) and not _steps_by_one(sch, reindex_a, 2):
        # the first operand's rows run along the GEMM's rows (a 1 x 1 convolution's input in NCHW,
        # X[c, hw] read as [hw, c]): each copied vector would gather elements a row apart. As the
        # transposed GEMM it is the second operand, kept in its own order like P.V's V below, and
        # the output tile's rows are the output's (an NCHW output's channels), stored along hw
        turned = tensor_core_schedule(_operands_swapped(func, stmt.name_hint), tile, threads, min_use, wide_min_use,
                                      swapped=True)
        if turned is not None:
            return turned
    # the second operand's slice in its own order where its rows run along the GEMM's columns
    # (a batched product's values, P.V's V): copied as [terms, columns], each vector consecutive
    # elements, where as [columns, terms] each vector gathered elements a row apart
    trans_b = not (tile.fragment_k == FRAGMENT and _steps_by_one(sch, reindex_b, 1) and not _steps_by_one(sch, reindex_b, 2))
    if not trans_b:
        sch.transform_layout(reindex_b, ("write", 0), lambda s, j, k: (s, k, j))
    extents = gemm_extents(sch, main)
    if extents is None:
        return None
    batches, rows, columns, depth = extents
    if tile.warps * WARP < threads and \
            batches * -(-rows // tile.rows) * -(-columns // tile.columns) > IDLE_WARPS_MAX_TILES:
        return None
    if tile.narrow and columns > NARROW_COLUMNS and any(_fills(rows, columns, wide, wide_min_use) for wide in TILES
                                                        if wide.warps * WARP == threads):
        # a narrow tile is for a GEMM that no wide tile of the block's warps fills to ``wide_min_use``
        return None
    if not _fills(rows, columns, tile, min_use):
        return None
    # a padded vector would be read or stored in part: the condition must hold for all of it
    if depth % VECTOR:
        return None
    # where the columns are not whole vectors even of ``VECTOR``, the output tile is stored an
    # element a lane, and so is the second operand copied where its vectors run along the columns
    # (kept in its own order, below): the padding's condition is an element's
    if columns % VECTOR:
        tile = dataclasses.replace(tile, store_vector=1)
    # each operand's vectors run along its own last dimension: the terms, or the columns for a
    # second operand kept in its own order; each is copied ``copy_vector`` elements a lane where
    # that extent is whole vectors of it (a 1 x 1 convolution over 14 x 14 as the transposed GEMM:
    # its weights 8 a lane, its input, 196 columns, 4), else ``VECTOR``, else one
    along = (depth, depth if trans_b else columns)
    widths = tuple(1 if gathered else tile.copy_vector if extent % tile.copy_vector == 0
                   else VECTOR if extent % VECTOR == 0 else 1 for gathered, extent in zip(conditional, along))
    if all(width < tile.copy_vector for width, gathered in zip(widths, conditional) if not gathered) \
            and not all(conditional):
        tile = dataclasses.replace(tile, copy_vector=VECTOR)
    # dlight's padding: rows, columns and terms past the GEMM's read as zeros (a branch around each
    # vector load, whose condition is the same for the vector's elements) and not stored
    sch.pad_einsum(main, [1, tile.rows, tile.columns, tile.depth])
    batch, i, j, k = sch.get_loops(main)
    i, i_inner = sch.split(i, [None, FRAGMENT])
    j, j_inner = sch.split(j, [None, FRAGMENT])
    k, k_inner = sch.split(k, [None, tile.fragment_k])
    sch.reorder(i, j, k, i_inner, j_inner, k_inner)
    fragment_product = main
    outer = sch.blockize(i_inner)
    i_tile, i_warp, i_fragment = sch.split(i, [None, tile.warps_i, tile.fragments_i])
    j_tile, j_warp, j_fragment = sch.split(j, [None, tile.warps_j, tile.fragments_j])
    k_chunk, k_fragment = sch.split(k, [None, tile.k_fragments])
    sch.reorder(i_tile, j_tile, j_warp, i_warp, k_chunk, k_fragment, i_fragment, j_fragment)
    block_tile = sch.fuse(i_tile, j_tile)
    warp = sch.fuse(j_warp, i_warp)
    sch.bind(batch, "blockIdx.z")
    sch.bind(block_tile, "blockIdx.x")
    sch.bind(warp, "threadIdx.y")

    def stage_in_shared(index: int):
        copy = sch.cache_read(outer, index, "shared.dyn")
        sch.compute_at(copy, k_chunk)
        fused = sch.fuse(*sch.get_loops(copy)[-2:])
        # an operand computed under a condition (a padding) is copied an element at a time: a
        # vector select loads every element of the vector, those the condition excludes too
        # (TVM vectorizes one whose indices are a ramp: a padded input read along its rows); a
        # scaled one is multiplied a vector at a time
        width = widths[index]
        _, copy_warp, lane, vector = sch.split(fused, [None, threads // WARP, WARP, width])
        sch.bind(lane, "threadIdx.x")
        sch.bind(copy_warp, "threadIdx.y")
        if width > 1:
            sch.vectorize(vector)
        sch.storage_align(copy, 0, axis=-2, factor=FRAGMENT, offset=SLICE_PAD)
        return copy

    a_shared, b_shared = stage_in_shared(0), stage_in_shared(1)
    auto_inline_producers(sch, a_shared)
    auto_inline_producers(sch, b_shared)
    if not all(_loads_as_vectors(sch, copy, width) for copy, width in zip((a_shared, b_shared), widths)
               if width > VECTOR):
        # TVM's CUDA code generator loads a vector it cannot load as one lane by lane, and prints
        # eight 16-bit lanes as code nvcc refuses: ``VECTOR`` elements then
        return tensor_core_schedule(func, dataclasses.replace(tile, copy_vector=VECTOR), threads, min_use, wide_min_use,
                                    swapped)
    # a cp.async moves 4, 8 or 16 bytes: an element a lane goes through registers, and so does a
    # computed operand (scaled: a cp.async copies, it does not multiply)
    if tile.copies_async and (any(computed) or not (min(widths) > 1 and all(
            _copies_whole_vectors(sch, copy, width) for copy, width in zip((a_shared, b_shared), widths)))):
        tile = dataclasses.replace(tile, async_stages=0)
    tile = dataclasses.replace(tile, warp_copies=tuple(
        None if gathered else _warp_copy(sch, copy, width, tile.copies_async)
        for copy, gathered, width in zip((a_shared, b_shared), conditional, widths)))
    if tile.copies_async:
        pipeline_chunks_async(sch, k_chunk, (a_shared, b_shared), tile.async_stages)
    elif tile.pipelined:
        pipeline_chunks(sch, k_chunk, (a_shared, b_shared))
    a_fragment = sch.cache_read(outer, 0, "wmma.matrix_a")
    b_fragment = sch.cache_read(outer, 1, "wmma.matrix_b")
    sch.compute_at(a_fragment, k_fragment)
    sch.compute_at(b_fragment, k_fragment)
    c_shared = sch.cache_write(outer, 0, "shared.dyn")
    c_fragment = sch.cache_write(outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(c_fragment, warp)
    sch.reverse_compute_at(c_shared, warp)
    fragments_init = sch.decompose_reduction(outer, k_chunk)
    init = sch.get_child_blocks(fragments_init)[0]

    intrinsics = wmma_intrinsics(operands[0], trans_b)

    def in_fragments(block, columns: int = FRAGMENT):
        """The block's last two loops split into 16 x ``columns`` fragments, the loops over
        fragments unrolled; the first inner loop."""
        i, j = sch.get_loops(block)[-2:]
        i_outer, i_inner = sch.split(i, [None, FRAGMENT])
        j_outer, j_inner = sch.split(j, [None, columns])
        sch.reorder(i_outer, j_outer, i_inner, j_inner)
        unrolled(i_outer, j_outer)
        return i_inner

    def unrolled(*loops):
        """Unrolled (dlight unrolls its fragment loads the same way), so that the CUDA source
        indexes each array of fragments by constants, which nvcc can keep in registers."""
        for loop in loops:
            sch.unroll(loop)

    names = [sch.get(block).name_hint + "_o" for block in (a_fragment, b_fragment)]
    try:
        sch.tensorize(in_fragments(a_fragment, tile.fragment_k), intrinsics["load_a"])
        sch.tensorize(in_fragments(b_fragment, tile.fragment_k), intrinsics["load_b"])
        sch.tensorize(in_fragments(c_fragment), intrinsics["store"])
        unrolled(*sch.get_loops(fragments_init)[-2:])
        sch.tensorize(sch.get_loops(init)[-2], intrinsics["init"])
        unrolled(i_fragment, j_fragment)
        sch.tensorize(sch.get_loops(fragment_product)[-3], intrinsics["compute"])
        if operands[0] == "float32":
            for name in names:
                sch.unsafe_set_dtype(sch.get_sblock(name), 0, "float16")
    except RuntimeError:  # a ScheduleError, or a check inside TVM (tvm.error.InternalError)
        return None
    auto_inline_consumer_chain(sch, c_shared)
    fused = sch.fuse(*sch.get_loops(c_shared)[-2:])
    _, lane, vector = sch.split(fused, [None, WARP, tile.store_vector])
    sch.bind(lane, "threadIdx.x")
    if tile.store_vector > 1:
        sch.vectorize(vector)
    if tile.warps * WARP < threads:
        sch = s_tir.Schedule(_idle_warps(sch.mod["main"], sch.get(warp), threads // WARP))
    return sch, tile


def _idle_warps(func: tirx.PrimFunc, warp: tirx.For, warps: int) -> tirx.PrimFunc:
    """``func`` with its loop ``warp`` over a tile's warps (``threadIdx.y``, fewer than the block's
    ``warps``) widened to the block's warps, each statement under it that only the tile's warps may
    run (a chunk's fragment loads and products, the accumulators' stores, their copy out) in one
    ``if`` on the warp: the others idle through them. The slices' copies, in their own loops over
    all the block's warps, the ``__syncthreads`` and cp.async waits between them, and the
    accumulators' zeroing (registers only) stay every warp's.

    One ``if`` around a chunk's products, not a predicate on each fragment's block: under a
    condition each, nvcc selected every fragment between its old and new value, which kept both
    live (paper BERT fp16 spilled 3.5 KB at 255 registers); with the zeroing under one too, it
    still selected the accumulators (1.6 KB); as here, 232 registers and none."""
    var, extent = warp.loop_var, warp.extent

    def realizes(stmt) -> list:
        """The outermost block realizes in ``stmt``."""
        if isinstance(stmt, s_tir.SBlockRealize):
            return [stmt]
        if isinstance(stmt, tirx.SeqStmt):
            return [r for child in stmt.seq for r in realizes(child)]
        if isinstance(stmt, tirx.For):
            return realizes(stmt.body)
        return []

    def uses_var(realize: s_tir.SBlockRealize) -> bool:
        found = []
        for value in realize.iter_values:
            tvm_ffi.structural_walk(value, lambda node: found.append(node) if node.same_as(var) else None)
        return bool(found)

    def registers_only(realize: s_tir.SBlockRealize) -> bool:
        """A block that reads nothing and writes only fragments (the accumulators' initialization):
        every warp may run it, on its own registers."""
        block = realize.block
        return not block.reads and all(w.source.scope().startswith("wmma.") for w in block.writes)

    def guarded(stmt):
        inner = realizes(stmt)
        if not any(uses_var(r) for r in inner) or all(registers_only(r) for r in inner):
            return stmt
        if all(uses_var(r) for r in inner):
            return tirx.IfThenElse(var < extent, stmt, None)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([guarded(child) for child in stmt.seq])
        if isinstance(stmt, tirx.For):
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, guarded(stmt.body), stmt.thread_binding,
                            stmt.annotations)
        raise ValueError(f"tile of {int(extent)} warps: cannot guard {type(stmt).__name__} for the idle warps")

    def widened(loop: tirx.For):
        if not loop.same_as(warp):
            return loop
        return tirx.For(var, loop.min, warps, loop.kind, guarded(loop.body), loop.thread_binding, loop.annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, widened)]))
