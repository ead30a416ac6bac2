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
from codegen.row_resident import schedule_row_resident
from codegen.schedule import SAME_ELEMENTS_AXIS_MAX, ScheduleError, schedule_te, tiling, warp_outputs
from codegen.stage import isolate_epilogue, isolate_fused
from codegen.staged import flat_index, tiles_of
from souffle.lower import LoopRegion, Region, TEProgram


# Whether a shared-memory epilogue pair with row statistics before it becomes one row-resident
# stage (``codegen.row_resident``); off, the statistics are stages of their own, as before (the
# ``no-row-resident`` variant of benchmarks/gpu_variants.py times that beside it).
ROW_RESIDENT = True

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
    marked in ``Region.epilogues``, and the row-resident ones' earlier statistics in
    ``Region.statistics``."""
    regions = []
    for r in program.regions:
        if isinstance(r, LoopRegion):
            regions.append(LoopRegion(r.name, r.scan, fuse_epilogues(r.body, gpu, threads)))
            continue
        epilogues = _epilogues(r, gpu, threads)
        statistics = _row_statistics(r, epilogues, gpu, threads)
        regions.append(dataclasses.replace(r, epilogues=epilogues, statistics=statistics))
    return TEProgram(program.graph, regions, program.links)


def _readers(region: Region) -> dict:
    """Operation -> the region's TEs that read it."""
    readers: dict = {}
    for tensor in region.stages():
        for producer in tensor.op.input_tensors:
            readers.setdefault(producer.op, []).append(tensor)
    return readers


def _row_statistics(region: Region, epilogues: dict, gpu: bool, threads: int) -> dict:
    """Consumer op -> the earlier reductions of its row-resident stage (``codegen.row_resident``),
    for each shared-memory epilogue pair whose output, reduction and the reductions before it
    (read by nothing else: a softmax's max, a LayerNorm's row sum) one warp a row can compute
    together. Its entry in ``epilogues`` becomes 'row' mode. A pair that does not schedule so
    stays as it was."""
    if not ROW_RESIDENT:
        return {}
    kept = {t.op for t in region.output_tensors}
    readers = _readers(region)
    order = {t.op: k for k, t in enumerate(region.stages())}
    tensor_of = {t.op: t for t in region.stages()}
    producers = {p.op for p, _ in epilogues.values()}
    statistics: dict = {}
    for consumer_op, (producer, mode) in list(epilogues.items()):
        if mode != "shared":
            continue
        members = {producer.op, consumer_op}
        chain = [producer]
        grown = True
        while grown:
            grown = False
            for tensor in [*chain, tensor_of[consumer_op]]:
                for read in tensor.op.input_tensors:
                    op = read.op
                    if (op in members or not getattr(op, "reduce_axis", None) or op in kept or op in producers
                            or op in epilogues or not all(r.op in members for r in readers.get(op, []))
                            or not _row_statistic(read, tensor_of[consumer_op])):
                        continue
                    members.add(op)
                    chain.append(tensor_of[op])
                    grown = True
        if len(chain) < 2:
            continue
        chain.sort(key=lambda t: order[t.op])
        staged, placeholders, _ = isolate_fused(chain, tensor_of[consumer_op])
        try:
            schedule_row_resident(staged, placeholders, gpu, threads)
        except (RuntimeError, ValueError, ScheduleError):  # TVM raises ValueError or InternalError
            continue
        epilogues[consumer_op] = (chain[-1], "row")
        statistics[consumer_op] = tuple(chain[:-1])
    return statistics


def _row_statistic(reduction: te.Tensor, output: te.Tensor) -> bool:
    """Whether ``reduction`` has the shape of a statistic of ``output``'s rows: one result a row,
    or a few side by side (``SAME_ELEMENTS_AXIS_MAX``: a LayerNorm's two moments). A split GEMM's
    partial products, read only by the LayerNorm that sums them, are no statistic."""
    rows = [int(d) for d in output.shape[:-1]]
    shape = [int(d) for d in reduction.shape]
    return shape[:len(rows)] == rows and (len(shape) == len(rows)
                                          or (len(shape) == len(rows) + 1 and shape[-1] <= SAME_ELEMENTS_AXIS_MAX))


def _epilogues(region: Region, gpu: bool, threads: int) -> dict:
    """Consumer op -> (its reduction, mode) for every reduction fused with its one reader; a
    consumer that already fuses a reduction is not fused into another one."""
    kept = {t.op for t in region.output_tensors}
    readers = _readers(region)
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
