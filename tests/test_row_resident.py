"""Row-resident stages (codegen.row_resident): a softmax's or LayerNorm's statistics and output in
one stage, a warp a row, the row loaded once into registers.

Checked three ways: the staged program has one such stage where there were two (and the
``no-row-resident`` variant keeps the two); the CUDA kernel runs on the emulator (every GPU thread
a fiber, scratch poisoned) and matches PyTorch, rows straddling tiles, widths a multiple of a warp
and not (the last lanes' last column idle); and the check that decides what may be cached is
tested by the reads it must refuse.
"""

import re

import numpy as np
import pytest
import torch
from tvm import s_tir, te

import souffle
from codegen.epilogues import _row_statistic
from codegen.row_resident import _reads_along_row
from codegen.schedule import THREADS, WARP
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

WARPS = THREADS // WARP


def _graph(kind: str, shape):
    """``kind`` (softmax or layer_norm) over the last axis of an input of ``shape``; the graph and
    its PyTorch reference."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(kind)
    x = b.input("x", shape)
    n = shape[-1]
    if kind == "softmax":
        y = b.op("softmax", x)
    else:
        y = b.op("layer_norm", x, b.param("g", rng.standard_normal(n).astype("float32")),
                 b.param("beta", rng.standard_normal(n).astype("float32")))
    graph = b.build(y)
    weights = {k: torch.from_numpy(v.copy()) for k, v in graph.weights.items()}

    def reference(t):
        if kind == "softmax":
            return torch.softmax(t, -1)
        return torch.nn.functional.layer_norm(t, (n,), weights["g"], weights["beta"])

    return graph, reference


FUSED = {"softmax": "T_softmax_maxelem+T_softmax_expsum+softmax_1",
         "layer_norm": "layer_norm_sum+layer_norm_moments+layer_norm_1"}


@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
@pytest.mark.parametrize("shape", [(3, 10, 64), (5, 33), (64, 128), (2, 8, 7, 49)], ids=str)
def test_a_row_s_statistics_and_output_are_one_stage(kind, shape):
    """One stage, a warp a row: tiles of 8 rows (the last one partial where the rows are not a
    multiple of 8), no shared memory; at O4 no barrier inside the stage's program at all."""
    staged = run_passes(_graph(kind, shape)[0], "cuda", stop="plan_arena", opt_level=4).ir
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    assert [(s.name.split("/")[-1], s.epilogue, s.schedule.template, s.schedule.n_tiles, s.schedule.per_tile,
             s.schedule.shared_bytes) for s in staged.stages()] == \
        [(FUSED[kind], "row", "warp_reduce", -(-rows // WARPS), WARPS * width, 0)]
    assert staged.barrier_count() == 0


def test_without_the_variant_the_statistics_are_stages_of_their_own(pair_epilogues):
    staged = run_passes(_graph("layer_norm", (64, 128))[0], "cuda", stop="plan_arena", opt_level=4).ir
    assert [(s.name.split("/")[-1], s.epilogue) for s in staged.stages()] == \
        [("layer_norm_sum", None), ("layer_norm_moments+layer_norm_1", "shared")]


@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
@pytest.mark.parametrize("width", [128, 49])
def test_each_thread_loads_its_columns_of_the_row_once(kind, width):
    """The row cache is the thread's own width / 32 columns, rounded up (TVM alone would size it
    by the warp's whole row: 128 floats a thread for 4 used; a Swin window's 49 take two, the
    second in 17 lanes); x is read by the cache's load alone; the stage has no __syncthreads."""
    model = souffle.compile(_graph(kind, (64, width))[0], target="cuda", opt_level=4)
    kernel = model.source[model.source.rindex("main_kernel("):]  # the definition, after its declaration
    assert re.findall(r"float (x_in_local_ptr)\[(\d+)\];", kernel) == [("x_in_local_ptr", str(-(-width // WARP)))]
    assert len(re.findall(r"\bx_in\[", kernel)) == 1
    assert "__syncthreads" not in kernel


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
@pytest.mark.parametrize("shape", [(3, 10, 64), (5, 33), (2, 7, 96), (8, 96), (3, 40), (2, 8, 7, 49), (2, 8, 7, 64)],
                         ids=str)
def test_the_emulated_kernel_matches_torch(kind, shape, order):
    """Rows straddling a tile and a leading dimension, a partial last tile, a width of 33 (two
    columns a lane, the second in lane 0 alone) and one of 96 (three columns a lane), single tiles,
    whose stage is simplified once its lanes' reductions are lowered, and rows of several axes
    whose last is no multiple of the warps (Swin's windows x heads x 49 rows), flattened first."""
    graph, reference = _graph(kind, shape)
    x = np.random.default_rng(1).standard_normal(shape).astype("float32") * 3
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert [s.epilogue for s in model.plan.stages()] == ["row"]
    (got,) = model.schedule(order).run({"x": x})
    np.testing.assert_allclose(got, reference(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
def test_the_cpu_runs_the_same_stage(kind):
    """The CPU run of the staged program (``llvm-persistent``, scratch poisoned) runs the
    row-resident stage's tiles, without threads or the row cache."""
    from model_checks import run_poisoned

    graph, reference = _graph(kind, (3, 10, 64))
    x = np.random.default_rng(2).standard_normal((3, 10, 64)).astype("float32")
    model = souffle.compile(graph, target="llvm-persistent", opt_level=4)
    assert [s.epilogue for s in model.plan.stages()] == ["row"]
    (got,) = run_poisoned(model, {"x": x})
    np.testing.assert_allclose(got, reference(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)


def _block(read):
    """The block of ``out[r, c] = x[<read(r, c)>]`` over x of (4, 64)."""
    x = te.placeholder((4, 64), name="x")
    out = te.compute((4, 64), lambda r, c: x[read(r, c)] * 2, name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    return sch.get(sch.get_sblock("out")), x


@pytest.mark.parametrize("read,along", [
    (lambda r, c: (r, c), True),
    (lambda r, c: (r, 63 - c), False),  # another lane's column
    (lambda r, c: (r, (c + 1) % 64), False),
    (lambda r, c: ((r + 1) % 4, c), False),  # another warp's row
    (lambda r, c: (0, c), False),  # row 0 for every row: a row of extent 4, not 1
])
def test_only_reads_at_the_thread_s_own_row_and_column_are_cached(read, along):
    """The cache drops its row and lane dimensions, which is exact only where each thread reads
    what it loaded: every read of the cached tensor at the block's own row and column."""
    block, _ = _block(read)
    source = block.reads[0].source
    assert _reads_along_row(block, source) is along


def test_a_batch_axis_of_one_is_read_at_its_one_index():
    x = te.placeholder((1, 4, 64), name="x")
    out = te.compute((1, 4, 64), lambda b, r, c: x[0, r, c] * 2, name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    block = sch.get(sch.get_sblock("out"))
    assert _reads_along_row(block, block.reads[0].source)


def test_a_statistic_is_a_few_results_a_row():
    """A LayerNorm's row sum and moments are statistics of its rows; a split GEMM's partial
    products that only the LayerNorm reads (paper BERT's FFN2, ``codegen.split_k``) are not,
    though they too are reductions of row length that nothing else reads."""
    output = te.placeholder((1, 384, 768), name="out")
    assert _row_statistic(te.placeholder((1, 384), name="sum"), output)
    assert _row_statistic(te.placeholder((1, 384, 2), name="moments"), output)
    assert not _row_statistic(te.placeholder((4, 384, 768), name="parts"), output)
    assert not _row_statistic(te.placeholder((1, 384, 768), name="whole"), output)


@pytest.mark.parametrize("shape", [(64, 128), (5, 33)], ids=str)
def test_a_layer_norm_s_two_moments_stay_in_registers(shape):
    """The moments (two results a row) are computed in a loop nvcc unrolls (``#pragma unroll``):
    indexed by a loop, nvcc put their array in local memory (a stack frame in ptxas' report)."""
    model = souffle.compile(_graph("layer_norm", shape)[0], target="cuda", opt_level=4)
    assert re.search(r"#pragma unroll\s+for \(int ax0 = 0; ax0 < 2; \+\+ax0\)", model.source), model.source
    assert model.resources.stack_bytes == 0 and model.resources.spill_bytes == 0
