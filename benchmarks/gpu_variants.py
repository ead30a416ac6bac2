"""Compiler variants to time beside the default on a GPU: questions the H200's first run raised
that only a GPU can answer, each a change the compiler could make by default.

``gpu_kernels.py export DIR --variant NAME`` compiles its bundles with the variant in force and
names each ``BASE+NAME`` (``lstm_paper_O4+no-on-chip``), so that one GPU run times it beside
its base, on the same weights and inputs, checked against PyTorch the same way. The compiler
itself is untouched: a variant patches one of its names for the duration of the compile.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

SEPARATOR = "+"  # between a bundle's name and its variant's: lstm_paper_O4+no-on-chip


@dataclass(frozen=True)
class Variant:
    question: str  # what timing it beside its base answers
    patches: Callable[[], list]  # the mock patches that make it, made when it is applied


def _without_on_chip_weights() -> list:
    from codegen import pipelines
    from souffle.passes import Outcome

    def keep_nothing(staged, device):
        return Outcome(staged, ["variant no-on-chip: every weight stays in global memory"])

    return [mock.patch.object(pipelines, "keep_weights_on_chip", keep_nothing)]


def _two_blocks_per_sm() -> list:
    from codegen import pipelines

    emit = pipelines.cuda_source

    def bounded(device, arch):
        return re.sub(r"__launch_bounds__\((\d+)\)", r"__launch_bounds__(\1, 2)", emit(device, arch))

    return [mock.patch.object(pipelines, "cuda_source", bounded)]


def _without_split_k() -> list:
    from codegen import pipelines

    def split_nothing(graph, device):
        return graph, ["variant no-split-k: every GEMM keeps its whole K in one stage"]

    return [mock.patch.object(pipelines, "split_k", split_nothing)]


def _quarter_k_chunks() -> list:
    from codegen import split_k

    return [mock.patch.object(split_k, "MIN_CHUNK", 256)]


def _long_matmul_chunks() -> list:
    from codegen import latency, schedule

    return [mock.patch.object(schedule, "MATMUL_K_CHUNK", 32), mock.patch.object(latency, "MATMUL_K_CHUNK", 32)]


def _deep_tensor_core_tiles() -> list:
    import dataclasses

    from codegen import schedule

    return [mock.patch.object(schedule, "TILES", tuple(dataclasses.replace(t, k_fragments=8, async_stages=2)
                                                       for t in schedule.TILES))]


def _register_pipeline() -> list:
    import dataclasses

    from codegen import schedule

    return [mock.patch.object(schedule, name, tuple(dataclasses.replace(t, async_stages=0) for t in getattr(schedule, name)))
            for name in ("TILES", "TF32_TILES")]


def _eight_byte_copies() -> list:
    import dataclasses

    from codegen import schedule

    return [mock.patch.object(schedule, name, tuple(dataclasses.replace(t, copy_vector=4) for t in getattr(schedule, name)))
            for name in ("TILES", "NARROW_TILES")]


def _dlight_order() -> list:
    from codegen import tensor_core

    return [mock.patch.object(tensor_core, "TRANSPOSE_ROW_OPERANDS", False)]


def _unpipelined_gemms() -> list:
    import dataclasses

    from codegen import schedule

    return [mock.patch.object(schedule, "TILES", tuple(dataclasses.replace(t, pipelined=False) for t in schedule.TILES)),
            mock.patch.object(schedule, "MATMUL_PIPELINED", False)]


def _without_96_row_tiles() -> list:
    from codegen import schedule

    return [mock.patch.object(schedule, name, tuple(t for t in getattr(schedule, name) if t.rows != 96))
            for name in ("TILES", "TF32_TILES")]


def _eight_warp_tiles() -> list:
    from codegen import schedule

    return [mock.patch.object(schedule, name, tuple(t for t in getattr(schedule, name) if t.warps * 32 == schedule.THREADS))
            for name in ("TILES", "TF32_TILES")]


def _unaligned_tiles() -> list:
    from codegen import pipelines

    return [mock.patch.object(pipelines, "align_tiles", lambda staged, _device: (staged, []))]


def _two_rows_per_warp() -> list:
    from codegen import schedule

    return [mock.patch.object(schedule, "WARP_REDUCE_ROWS", 2)]


def _one_row_at_a_time() -> list:
    from codegen import schedule

    return [mock.patch.object(schedule, "GEMV_ROWS_TOGETHER", ())]


def _unstaged_vector() -> list:
    from codegen import schedule

    return [mock.patch.object(schedule, "staged_vector", lambda tensor: tensor)]


def _pair_epilogues() -> list:
    from codegen import epilogues

    return [mock.patch.object(epilogues, "ROW_RESIDENT", False)]


def _occupancy_model() -> list:
    from analysis import latency

    return [mock.patch.object(latency, "WARPS_TO_SATURATE", 32)]


VARIANTS = {
    "no-on-chip": Variant(
        "O4 without keep_weights_on_chip. Placed for a grid of 1 block/SM, paper LSTM's weights cost blocks "
        "(O4 1.51 ms at 1 block/SM against 1.00 ms in global memory at 6 on the H100) and stayed in global "
        "memory, read from L2 at each of the 109 steps; placed for the grid of the kernel's residency they "
        "are 3 slices of 16 KB a block at 4 blocks/SM (fp32; 5 at fp16): does reading them from shared "
        "memory pay for the block per SM fp32 gives up (5 -> 4)?",
        _without_on_chip_weights),
    "two-blocks": Variant(
        "__launch_bounds__(threads, 2): ptxas holds the kernel to 128 registers so that 2 blocks fit per SM "
        "(paper BERT fp16: 255 registers, 1 block/SM; capped, 172 B spilled): occupancy or spills?",
        _two_blocks_per_sm),
    "no-split-k": Variant(
        "O4 without split_k: a GEMM whose tiles leave SMs idle in one stage, not partial GEMMs over slices of "
        "K and their sum (paper BERT's FFN2, 72 tiles: 48 us a layer on the H100 where FFN1's 288 took 23); "
        "does the split pay for its barrier and partial sums?",
        _without_split_k),
    "split-k-256": Variant(
        "split_k with slices of K down to 256 (MIN_CHUNK 512 by default): paper ResNeXt's layer-3 1x1 "
        "convolutions in 4 parts, not 2, BERT's FFN2 in 8 and its attention output in 2; do shorter K loops "
        "on more of the grid pay for the larger partial sums?",
        _quarter_k_chunks),
    "k-chunk-32": Variant(
        "dlight's SIMT matmul staging 32 terms of K at a time, not 16: half as many rounds of copy, "
        "__syncthreads and compute per tile. On the H100 each chunk of paper ResNeXt's layer-3 1x1 "
        "convolutions took 1.7 us (110 us for 64 of them) where the model puts its compute at 0.33 us: "
        "is the time per chunk a fixed wait that longer chunks amortize?",
        _long_matmul_chunks),
    "tc-depth-128": Variant(
        "tensor-core tiles staging 128 terms of K at a time, not 64, in a ring of two cp.async copies, "
        "not three (the 128 x 128 tile's slices: 136 KB of shared memory, where three copies of 128 "
        "terms would not fit a block): paper BERT fp16's 128 x 128 tiles took 1.8 to 1.9 us per chunk "
        "of 64 on the H100 unpipelined; do half as many, deeper chunks pay?",
        _deep_tensor_core_tiles),
    "register-pipeline": Variant(
        "tensor-core tiles pipelined through registers, one chunk ahead, as the H100's third run timed "
        "them (paper BERT fp16 1.31 ms, its 128 x 128 tiles about 1 us a chunk of 64 where their "
        "tensor-core work is about 0.5 us), not by a ring of three cp.async copies with two chunks in "
        "flight: how much of the wait per chunk do the asynchronous copies hide?",
        _register_pipeline),
    "8-byte-copies": Variant(
        "16-bit tensor-core tiles copying their slices 4 elements (8 bytes, cp.async.ca) at a time, as the "
        "H100's third run did, not 8 (16 bytes, cp.async.cg, L1 bypassed): the same bytes in twice the "
        "instructions; what do the wider copies gain?",
        _eight_byte_copies),
    "dlight-order": Variant(
        "GEMMs taken in dlight's order even where their first operand's rows run along the GEMM's rows (1 x 1 "
        "convolutions in NCHW): the input copied through registers, each vector four channels a feature map "
        "apart, the output stored along channels, not the transposed GEMM with both operands copied by "
        "cp.async; what does the transposition gain on ResNeXt and EfficientNet?",
        _dlight_order),
    "no-pipeline": Variant(
        "GEMM stages (tensor-core tiles and dlight's SIMT matmul) without the software pipeline: each chunk's "
        "slices loaded from global memory, then computed on, one after the other, as in the H100's second run, "
        "where a chunk of paper BERT fp16's 128 x 128 tiles took 1.8-1.9 us (about 4x its compute) and one of "
        "ResNeXt's 1x1 convolutions 1.7 us (5x); how much of that wait does loading the next chunk into "
        "registers during this one's arithmetic hide?",
        _unpipelined_gemms),
    "no-96-row-tiles": Variant(
        "the wide tensor-core tiles without those of 96 rows (96 x 128, 2 x 4 warps of 3 x 2 fragments, and 96 x 96 "
        "on 4 warps): paper BERT fp16's FFN "
        "GEMMs (384 rows) in 72 tiles of 128 x 128 for the H100's 132 SMs, as the third run timed them, not 96 "
        "of 96 x 128 with 5 fragment loads for 6 products where 128 x 128 has 6 for 8 (H100 model: 5.7-5.8 us "
        "each against 6.9-7.0); do the SMs filled pay for the fragment loads?",
        _without_96_row_tiles),
    "eight-warp-tiles": Variant(
        "tensor-core tiles on all 8 warps of the block only, not also 4-warp tiles with the other 4 idle through "
        "the fragments (codegen.tensor_core.TILES): paper BERT fp16's FFN GEMMs back to 96 tiles of 96 x 128 "
        "(3 x 2 fragments a warp: 5 fragment loads for 6 products) for 132 SMs, not 128 of 96 x 96 (3 x 3: 6 "
        "for 9), its attention output and P.V on 8 warps of 2 x 1 (H100 model 413 -> 349 us with them); do the "
        "fewer fragment loads pay for the warps idle, or do 4 warps an SM not hide the loads' latency?",
        _eight_warp_tiles),
    "no-aligned-tiles": Variant(
        "each softmax a warp a row in tiles of 8 rows and its scores in the tile the model picks alone, with a grid "
        "barrier on either side of the softmax, not tiled like the product that reads it (codegen.align_tiles: "
        "paper BERT fp16's softmax in 72 tiles of 64 rows, 8 a warp, each the rows of one P.V tile, and its scores "
        "in 72 tiles of 64 whole rows, so the three run in the same block after __syncthreads and 24 of its 109 "
        "grid barriers go); are the barriers worth more than the longer tiles (H100 model: 3.52 -> 3.99 us a "
        "layer for the two stages alone, against 1.13 us a barrier)?",
        _unaligned_tiles),
    "two-rows-per-warp": Variant(
        "warp_reduce tiles of two outputs per warp, reduced one after the other (16 per tile, not 8): paper "
        "LSTM's wavefront step is 1280 tiles of 8 gates, two rounds of its 660 blocks, and took 8.3 us on the "
        "H100, 7.2 us as one round of 640 longer tiles. Do BERT's and Swin's softmax and LayerNorm rows "
        "(BERT fp16: 576 softmax tiles in 5 rounds of its 132 blocks, 3 with two rows a warp) gain too?",
        _two_rows_per_warp),
    "no-rows-together": Variant(
        "a GEMV's warps reduce one row each, not 2 or 4 together (codegen.schedule.GEMV_ROWS_TOGETHER): paper "
        "LSTM's gate product at fp16 back to 1280 tiles of 8 gates in three rounds of its 528 blocks, where 4 "
        "rows a warp make 320 tiles in one (H100 model: 2.68 -> 1.42 us a step, 505 -> 322 us); what do the "
        "rounds cost?",
        _one_row_at_a_time),
    "no-staged-vector": Variant(
        "a GEMV with rows together reads its vector from global memory in every warp, not from a copy the "
        "block makes in shared memory once a tile (codegen.schedule.staged_vector): paper LSTM's gate product "
        "at fp16, where the 8 warps of a tile each load all 512 inputs (4 sectors a load: h and c interleaved) "
        "and the copy costs a trip to memory and a __syncthreads (H100 model: 1.42 -> 1.13 us a step, 322 -> "
        "291 us). Does the L1 traffic it saves pay for them?",
        _unstaged_vector),
    "no-row-resident": Variant(
        "softmax and LayerNorm as the third run timed them: the row's first statistic (a max, a sum) a stage "
        "of its own, then the next with the output as a shared-memory epilogue, each row read three times, "
        "not one row-resident stage (a warp a row, the row in registers; codegen.row_resident). Paper BERT fp16 "
        "measured a softmax at 14.9 us and a LayerNorm at 8.2-9 us there, the model 5.0 and 3.6; what does "
        "reading each row once save?",
        _pair_epilogues),
    "occupancy": Variant(
        "the latency model with WARPS_TO_SATURATE = 32 (analysis.latency), which orders the H200's opt "
        "levels better, choosing the schedules: more, smaller tiles (with the 128 x 32 matmul tiles of the H200 "
        "run: thread_reduce for small GEMMs, 64-wide tensor-core tiles); faster or slower than the default's?",
        _occupancy_model),
}


@contextlib.contextmanager
def applied(name: str) -> Iterator[Variant]:
    """The compiler with variant ``name`` in force, for the duration of the block."""
    try:
        variant = VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None
    with contextlib.ExitStack() as stack:
        for patch in variant.patches():
            stack.enter_context(patch)
        yield variant


def split(bundle: str) -> tuple[str, str | None]:
    """``lstm_paper_O4+no-on-chip`` -> (``lstm_paper_O4``, ``no-on-chip``); no variant: None."""
    base, _, variant = bundle.partition(SEPARATOR)
    return base, variant or None
