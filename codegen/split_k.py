"""The ``split_k`` pass (O4): a GEMM too narrow to fill the GPU becomes partial GEMMs, then a sum.

A persistent kernel runs each stage's tiles on its whole grid. A ``dense`` whose output has few
tiles leaves most blocks idle through its whole K loop: paper BERT's second FFN GEMM (384 x 768
from K = 3072) has 72 tiles of 64 x 64 for 132 SMs, and on an H100 it took 48 us a layer where
the first (the same FLOPs as 288 tiles) took 23 (``benchmarks/results/gpu_h100.md``, the fp16
timeline). Split into ``parts`` slices of K, it is ``parts`` times the tiles, each with a
``parts`` times shorter K loop, in one GEMM-shaped stage with a batch axis, and the next stage
adds the partial products (float32 where the operands are narrower) and the bias, with whatever
element-wise consumers vertical inlining folds into it: ``souffle.ops.nn.dense``'s ``split_k``.
A 1x1 convolution (stride 1, unpadded, ungrouped) is the same GEMM in NCHW, one row per output
pixel, and is split the same way (``conv2d``'s ``split_k``): on the H100, paper ResNeXt's layer-3
1x1 convolutions (196 x 1024 over K = 1024, 64 tiles) took 110 us each, 4.96 of its 7.55 ms
(``benchmarks/results/gpu_h100_2.md``).
The price is one grid barrier and the partial products' round trip through L2 (``parts x M x N``
float32 values).

A ``mean`` over its last axes of few outputs is split the same way (``mean``'s ``split``): its
tiles are ``MEANS_PER_TILE`` outputs, one a warp, each warp summing all of its output's elements.
Paper EfficientNet's first squeeze takes the mean of 12544 elements for each of 32 channels, 4
tiles for 132 SMs (the H100 model: 5.0 us, latency-bound); in 16 runs of 784 it is 64 tiles, then
a sum of 16 partial sums per channel, a stage of one tile that the excitation, in the same block,
reads after a ``__syncthreads``: no grid barrier more than before.

``parts``, a power of two whose slices keep at least ``MIN_CHUNK`` of K, minimizes the rounds
of tiles the grid runs, each ``parts`` times shorter: ``ceil(tiles x parts / slots) / parts``,
averaged over one and two blocks per SM (the kernel's residency is known only after ptxas; paper
BERT fp16 runs 1, fp32 2). A GEMM is split only where that saves ``MIN_GAIN`` of its rounds, which
pays for the barrier and the sum. A rule, not a search: the latency model is still 1.8x off the
H100's stage times (``latency_vs_h100.md``), and the ``no-split-k`` variant
(``benchmarks/gpu_variants.py``) lets the next GPU run time both.
"""

from __future__ import annotations

import math

from codegen.schedule import WARP_REDUCE_MIN_EXTENT
from souffle.graph import Graph, Op
from souffle.ops.nn import is_pointwise_gemm, trailing_mean_axes
from souffle.ops.registry import full_attrs, get_rule

TILE = 64  # the output tile side of the matmul and smallest tensor-core schedules
BLOCKS_PER_SM = (1, 2)  # the residencies a split is chosen for (codegen.schedule.GRID_WAVE: 2)
# Each partial product keeps at least this much of K, so that its K loop still amortizes the
# tile's prologue and its partial sums (written and read once) stay small against its operands.
MIN_CHUNK = 512
MIN_GAIN = 0.2  # the share of a GEMM's rounds of tiles a split must save
MEANS_PER_TILE = 8  # a warp_reduce tile's outputs: one a warp, 8 warps a block (codegen.schedule)
# Each partial sum of a split mean keeps at least this many elements, 16 a lane: a mean of 784 in
# two runs of 392 (paper EfficientNet's at 28 x 28) saved 0.15 us on the H100 model, less than
# the grid barrier its sum put before an excitation of two tiles.
MIN_RUN = 512
# Fewer parts than a warp's lanes (``codegen.schedule.WARP_REDUCE_MIN_EXTENT``): their sum is then
# a thread_reduce of 256 outputs a tile, one tile for up to 256 means, which the block that runs
# the excitation after it (a GEMV of one tile) runs too, a ``__syncthreads`` apart; as a
# warp_reduce of 8 outputs a tile it was a grid barrier away from it.
MAX_MEAN_PARTS = WARP_REDUCE_MIN_EXTENT // 2


def split_k(graph: Graph, device) -> tuple[Graph, list[str]]:
    """``graph`` with each GEMM (``gemm_of``) whose tiles would leave the grid idle split over K, and
    each such mean (``mean_of``) over runs of its elements (scan bodies included), and one note per
    split; ``graph`` itself is not changed."""
    notes: list[str] = []
    return _rewritten(graph, device.sms, notes), notes


def rounds(tiles: int, parts: int, sms: int) -> float:
    """The tile rounds of a GEMM of ``tiles`` tiles split ``parts`` ways, in units of the
    unsplit tile's K loop, averaged over ``BLOCKS_PER_SM``."""
    return sum(math.ceil(tiles * parts / (sms * blocks)) / parts for blocks in BLOCKS_PER_SM) / len(BLOCKS_PER_SM)


def tiles_of(rows: int, columns: int) -> int:
    """The ``TILE`` x ``TILE`` output tiles of a ``rows x columns`` GEMM."""
    return math.ceil(rows / TILE) * math.ceil(columns / TILE)


def parts_for(rows: int, columns: int, reduction: int, sms: int) -> int:
    """The number of K slices for a ``rows x columns`` GEMM over ``reduction`` (1: no split;
    also for a GEMV, fewer than half a tile of rows or columns)."""
    if min(rows, columns) < TILE // 2:
        return 1  # a GEMV: one warp per output, no 64 x 64 tiles to count
    return _parts(tiles_of(rows, columns), reduction, MIN_CHUNK, reduction, sms)


def mean_parts_for(outputs: int, reduction: int, sms: int) -> int:
    """The number of runs a mean of ``outputs`` outputs over ``reduction`` elements each is summed
    in (1: no split): as ``parts_for``, each run at least ``MIN_RUN`` elements."""
    return _parts(math.ceil(outputs / MEANS_PER_TILE), reduction, MIN_RUN, MAX_MEAN_PARTS, sms)


def _parts(tiles: int, reduction: int, least: int, most: int, sms: int) -> int:
    """The power of two, at most ``most``, dividing ``reduction`` into slices of at least
    ``least`` that minimizes the rounds of ``tiles`` tiles, where it saves ``MIN_GAIN`` of them;
    else 1."""
    candidates = [2 ** e for e in range(reduction.bit_length())
                  if reduction % 2 ** e == 0 and reduction // 2 ** e >= least and 2 ** e <= most]
    best = min(candidates or [1], key=lambda parts: (rounds(tiles, parts, sms), parts))
    return best if rounds(tiles, best, sms) <= (1 - MIN_GAIN) * rounds(tiles, 1, sms) else 1


def mean_of(graph: Graph, op: Op) -> tuple[int, int] | None:
    """(outputs, elements each) of a ``mean`` over its last axes, the means ``split_k`` can
    split; None for any other op."""
    if op.kind != "mean":
        return None
    shape = graph.tensors[op.inputs[0]].shape
    reduced = trailing_mean_axes(len(shape), full_attrs(get_rule("mean"), op.attrs, "op mean")["axes"])
    if reduced is None:
        return None
    return math.prod(shape[:len(shape) - reduced]), math.prod(shape[len(shape) - reduced:])


def gemm_of(graph: Graph, op: Op) -> tuple[int, int, int] | None:
    """(rows, columns, reduction) of an op ``split_k`` can split: a ``dense``, or a ``conv2d``
    that is a GEMM over its input channels as it stands (1x1, stride 1, unpadded, ungrouped:
    ResNeXt's bottleneck convolutions); None for any other op."""
    if op.kind not in ("dense", "conv2d"):
        return None
    x, w = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    if op.kind == "dense":
        return math.prod(x.shape[:-1]), w.shape[0], w.shape[1]
    if is_pointwise_gemm(w.shape, full_attrs(get_rule("conv2d"), op.attrs, "op conv2d")):
        batch, channels, height, width = x.shape
        return batch * height * width, w.shape[0], channels
    return None


def _rewritten(graph: Graph, sms: int, notes: list[str]) -> Graph:
    def rewrite(_, op: Op) -> list[Op]:
        if op.attrs.get("split", 1) == 1 and (mean := mean_of(graph, op)) is not None:
            return _split_mean(op, *mean)
        if op.attrs.get("split_k", 1) != 1 or (gemm := gemm_of(graph, op)) is None:
            return [op]
        rows, columns, reduction = gemm
        parts = parts_for(rows, columns, reduction, sms)
        if parts == 1:
            return [op]
        tiles = tiles_of(rows, columns)
        notes.append(f"{graph.name}/{op.outputs[0]}: {rows} x {columns} over K = {reduction} has {tiles} "
                     f"tiles of {TILE} x {TILE} for {sms} SMs -> {parts} partial GEMMs over "
                     f"K = {reduction // parts} ({tiles * parts} tiles, {rounds(tiles, parts, sms):.2f} "
                     f"of the rounds of tiles), then their sum")
        return [Op(op.kind, op.inputs, op.outputs, {**op.attrs, "split_k": parts})]

    def _split_mean(op: Op, outputs: int, reduction: int) -> list[Op]:
        parts = mean_parts_for(outputs, reduction, sms)
        if parts == 1:
            return [op]
        tiles = math.ceil(outputs / MEANS_PER_TILE)
        notes.append(f"{graph.name}/{op.outputs[0]}: {outputs} means of {reduction} elements have {tiles} "
                     f"tiles of {MEANS_PER_TILE} for {sms} SMs -> {parts} partial sums of {reduction // parts} "
                     f"each ({tiles * parts} tiles, {rounds(tiles, parts, sms):.2f} of the rounds of tiles), "
                     f"then their sum")
        return [Op(op.kind, op.inputs, op.outputs, {**op.attrs, "split": parts})]

    return graph.rewritten(rewrite, lambda body: _rewritten(body, sms, notes))
