"""The ``fuse_epilogues`` pass (from O3): a reduction and its one element-wise reader in one stage.

A reduction whose only reader is element-wise can run that reader in its own tiles, so its
result never goes to global memory (``codegen.schedule``'s epilogues): in the thread holding
each result ('register', a GEMM's bias and activation) or from the tile's results in shared
memory ('shared', the LSTM cell reading the four gates of its unit). The pass marks each such
pair in its region (``Region.epilogues``); the ``stage`` pass then builds the pair as one stage.
A pair TVM cannot schedule that way (``reverse_compute_at`` refuses some access patterns) is
left as two stages.
"""

from __future__ import annotations

import dataclasses

import islpy as isl
import numpy as np
import tvm
from tvm import te

from analysis.dependence import access_relations, iteration_domain
from codegen.schedule import ScheduleError, schedule_te, tiling, warp_outputs
from codegen.stage import isolate_epilogue
from codegen.staged import flat_index, tiles_of
from souffle.lower import LoopRegion, Region, TEProgram


# TVM 0.27's pooling of a kernel's static shared memory (``tirx.merge_static_smem``, see
# ``codegen.cuda``) gives no place to a buffer of 4 bytes or less (it leaves such a buffer to
# registers), so a kernel with one among other shared buffers fails to build. A shared epilogue
# keeps a tile's results in shared memory (``per_tile`` of them, or all of them if fewer), so they
# must take more: a reduction to a single float32 value, or a block of one warp, has none.
SMALL_SHARED_BYTES = 4


def epilogue_mode(producer: te.Tensor, consumer: te.Tensor, threads: int) -> str | None:
    """How ``consumer`` (element-wise, the only reader of the reduction ``producer``) can run in
    the producer's tiles: 'register' when it reads each result at its own index, 'shared'
    when each of its tiles reads only the same-numbered producer tile (and a tile's results take
    more than ``SMALL_SHARED_BYTES``); None otherwise."""
    if consumer.op.reduce_axis or len(consumer.op.body) != 1 or len(producer.op.body) != 1:
        return None
    access = access_relations(consumer)[producer.op]
    if not access.exact:
        return None
    relation = access.spatial
    if not iteration_domain(consumer).is_subset(relation.domain()):
        return None  # elements that read no result (padding) would belong to no tile
    shape = [int(d) for d in producer.shape]
    if _reads_own_index(relation, [int(d) for d in consumer.shape], shape):
        return "register"
    outputs = int(np.prod(shape))
    analyzer = tvm.sym.Analyzer()
    reduction = int(np.prod([int(analyzer.simplify(ax.dom.extent)) for ax in producer.op.reduce_axis]))
    template, per_tile = tiling(outputs, reduction, threads, warp_outputs(producer))
    consumer_size = int(np.prod([int(d) for d in consumer.shape]))
    if template != "warp_reduce" or (per_tile * consumer_size) % outputs:
        return None
    if min(per_tile, outputs) * np.dtype(str(producer.dtype)).itemsize <= SMALL_SHARED_BYTES:
        return None
    reads = tiles_of(relation.get_tuple_name(isl.dim_type.in_), consumer.shape, per_tile * consumer_size // outputs, "R")
    writes = tiles_of(relation.get_tuple_name(isl.dim_type.out), producer.shape, per_tile, "W")
    cross = reads.reverse().apply_range(relation).apply_range(writes)
    return "shared" if cross.is_subset(isl.Map("{ R[t] -> W[t] }")) else None


def _reads_own_index(relation: isl.Map, consumer_shape: list[int], producer_shape: list[int]) -> bool:
    """Whether the consumer reads each result at its own index: the same row-major position of a
    shape of as many elements. That is the same index where the shapes are equal, the same once
    their axes of extent 1 are dropped (a batched matrix product of shape (heads, S, S) read as
    (1, heads, S, S), as an exported model reshapes it), or a reshape (a grouped convolution's
    [N, groups, O / groups, H, W] read as NCHW, ``souffle.ops.nn``): the relation's indices are
    within the shapes, where a row-major position is one element."""
    if int(np.prod(consumer_shape)) != int(np.prod(producer_shape)):
        return False
    source, target = relation.get_tuple_name(isl.dim_type.in_), relation.get_tuple_name(isl.dim_type.out)
    names = [f"a{k}" for k in range(len(consumer_shape))]
    produced = [f"b{k}" for k in range(len(producer_shape))]
    same_position = isl.Map(f"{{ {source}[{', '.join(names)}] -> {target}[{', '.join(produced)}] : "
                            f"{flat_index(names, consumer_shape)} = {flat_index(produced, producer_shape)} }}")
    return relation.is_subset(same_position)


def fuse_epilogues(program: TEProgram, gpu: bool, threads: int) -> TEProgram:
    """``program`` with every region's (loop bodies' included) fusable reduction-reader pairs
    marked in ``Region.epilogues``."""
    regions = [LoopRegion(r.name, r.scan, fuse_epilogues(r.body, gpu, threads)) if isinstance(r, LoopRegion)
               else dataclasses.replace(r, epilogues=_epilogues(r, gpu, threads)) for r in program.regions]
    return TEProgram(program.graph, regions, program.links)


def _epilogues(region: Region, gpu: bool, threads: int) -> dict:
    """Consumer op -> (its reduction, mode) for every reduction fused with its one reader; a
    consumer that already fuses a reduction is not fused into another one."""
    kept = {t.op for t in region.output_tensors}
    readers: dict = {}
    for tensor in region.stages():
        for producer in tensor.op.input_tensors:
            readers.setdefault(producer.op, []).append(tensor)
    fused: dict = {}
    for tensor in region.stages():
        users = readers.get(tensor.op, [])
        if not tensor.op.reduce_axis or tensor.op in kept or len(users) != 1 or tensor.op in fused:
            continue
        mode = epilogue_mode(tensor, users[0], threads)
        if mode is None:
            continue
        staged, placeholders, _ = isolate_epilogue(tensor, users[0])
        try:
            schedule_te(staged, placeholders, gpu, threads, mode)
        except (RuntimeError, ValueError, ScheduleError):  # TVM raises ValueError or InternalError
            continue
        fused[users[0].op] = (tensor, mode)
    return fused
