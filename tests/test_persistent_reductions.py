"""Reductions over the last axis and over all axes on the persistent kernel's stages (issue 14).

The CPU run of the staged program (``llvm-persistent``) runs the stages, tiles and barriers the
CUDA kernel runs, with scratch poisoned: a tile that computes more than its own elements, or a
reduction that covers less than its terms, shows up as a wrong number or a NaN. The CUDA kernel
built from the same stages cannot run here; its stages are checked for what the CPU cannot show
(lanes of a warp reducing together, thread loops of the block's shape).
"""

import re

import numpy as np
import pytest
import torch
from model_checks import run_poisoned

import souffle
from codegen.epilogues import SMALL_SHARED_BYTES
from codegen.row_resident import statistics_of
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

LEVELS = range(5)


def _param(b, rng, name, shape):
    return b.param(name, rng.standard_normal(shape).astype("float32"))


def _single(kind: str, shape):
    """One reduction op ``kind`` on an input of ``shape``, followed by an element-wise op with a
    parameter; returns the graph and its PyTorch reference."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(kind)
    x = b.input("x", shape)
    n = shape[-1]
    if kind == "softmax":
        y = b.op("mul", b.op("softmax", x), _param(b, rng, "w", (n,)))
    elif kind == "layer_norm":
        y = b.op("add", b.op("layer_norm", x, _param(b, rng, "g", (n,)), _param(b, rng, "beta", (n,))),
                 _param(b, rng, "w", (n,)))
    elif kind == "global_avg_pool2d":
        y = b.op("mul", b.op("global_avg_pool2d", x), _param(b, rng, "w", (16,)))
    else:
        y = b.op("mean", x)
    graph = b.build(y)
    w = {k: torch.from_numpy(v.copy()) for k, v in graph.weights.items()}

    def reference(t):
        if kind == "softmax":
            return torch.softmax(t, -1) * w["w"]
        if kind == "layer_norm":
            return torch.nn.functional.layer_norm(t, (n,), w["g"], w["beta"]) + w["w"]
        if kind == "global_avg_pool2d":
            return t.mean((2, 3), keepdim=True) * w["w"]
        return t.mean()

    return graph, reference


def _family(shape):
    """Softmax, layer_norm, mean over the last axis (broadcast back over it) and mean over all
    axes (a rank-0 result), each followed by an element-wise op with a parameter, as one graph."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("reductions")
    x = b.input("x", shape)
    n = shape[-1]
    outputs = [
        b.op("mul", b.op("softmax", x), _param(b, rng, "ws", (n,))),
        b.op("add", b.op("layer_norm", x, _param(b, rng, "g", (n,)), _param(b, rng, "beta", (n,))),
             _param(b, rng, "wl", (n,))),
        b.op("mul", b.op("mean", x, axes=(-1,), keepdims=True), _param(b, rng, "wk", (n,))),
        b.op("mul", b.op("mean", x), _param(b, rng, "wm", (5,))),
    ]
    if len(shape) == 4:
        outputs.append(b.op("mul", b.op("global_avg_pool2d", x), _param(b, rng, "wg", (16,))))
    graph = b.build(*outputs)
    w = {k: torch.from_numpy(v.copy()) for k, v in graph.weights.items()}

    def reference(t):
        expected = [torch.softmax(t, -1) * w["ws"],
                    torch.nn.functional.layer_norm(t, (n,), w["g"], w["beta"]) + w["wl"],
                    t.mean(-1, keepdim=True) * w["wk"],
                    t.mean() * w["wm"]]
        if len(shape) == 4:
            expected.append(t.mean((2, 3), keepdim=True) * w["wg"])
        return expected

    return graph, reference


def _check(graph, reference, shape, levels):
    x = np.random.default_rng(1).standard_normal(shape).astype("float32")
    expected = reference(torch.from_numpy(x))
    expected = [e.numpy() for e in (expected if isinstance(expected, list) else [expected])]
    for level in levels:
        model = souffle.compile(graph, target="llvm-persistent", opt_level=level)
        got = run_poisoned(model, {"x": x})
        for name, value, want in zip(graph.outputs, got, expected):
            np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5, err_msg=f"O{level} {name}")


@pytest.mark.parametrize("kind,shape", [("softmax", (3, 10, 64)), ("layer_norm", (3, 10, 64)),
                                        ("global_avg_pool2d", (2, 6, 5, 8))], ids=str)
def test_a_fused_epilogue_computes_exactly_its_tile(kind, shape):
    """Issue 14: a tile of 8 rows of (3, 10) straddles the leading dimension; its shared-memory
    epilogue computed the box around them (whole rows of the leading dimension) from results
    other tiles reduce, so O3 and O4 were off (by up to 1.5 for layer_norm)."""
    graph, reference = _single(kind, shape)
    _check(graph, reference, shape, levels=(3, 4))


def test_layer_norm_moments_take_the_row_sums_tiles(pair_epilogues):
    """A warp reduces both moments of its row (``warp_outputs``), so the moments' tiles hold the
    8 rows the row sums' tiles hold: the same block made the sums it reads, and at O4 no grid
    barrier is placed between them (with a warp a moment, a tile held 4 rows and needed one)."""
    graph, reference = _single("layer_norm", (64, 128))
    _check(graph, reference, (64, 128), levels=(4,))
    model = souffle.compile(graph, target="llvm-persistent", opt_level=4)
    schedules = [(s.name.split("/")[-1], s.schedule.template, s.schedule.per_tile, s.barrier)
                 for s in model.plan.stages()]
    assert schedules == [("layer_norm_sum", "warp_reduce", 8, None),
                         ("layer_norm_moments+add_2", "warp_reduce", 8 * 128, None)]
    assert model.plan.barrier_count() == 0


@pytest.mark.parametrize("kind,shape", [("mean", (64, 64)), ("softmax", (17,))], ids=str)
def test_a_reduction_to_one_value_covers_all_its_terms(kind, shape):
    """Issue 14: a rank-0 result's tile loop was put inside its reduction loops, so the stage
    reduced one tile's worth of terms (the mean of ones(64, 64) was 0.0078; a softmax of 17
    values summed to 15.8) at every level."""
    graph, reference = _single(kind, shape)
    _check(graph, reference, shape, levels=(0, 4))


SHAPES = [(3, 10, 64), (2, 6, 5, 8), (17,), (64, 64), (7, 13), (5, 33)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reductions_at_every_level(shape):
    graph, reference = _family(shape)
    _check(graph, reference, shape, levels=LEVELS)


# -- the CUDA kernel built from the same stages (compiled, not run) ---------------------------
def _cuda(kind, shape, level):
    graph, _ = _single(kind, shape)
    return souffle.compile(graph, target="cuda", opt_level=level)


@pytest.mark.parametrize("level", [0, 4])
def test_cuda_warp_reductions_combine_their_lanes(level, pair_epilogues):
    """Each warp_reduce stage ends in a warp all-reduce (shuffles, then the result broadcast to
    the warp). Under the persistent tile loop, a stage whose rows fuse several dimensions lost
    it: its 32 lanes added into one element at once."""
    model = _cuda("softmax", (3, 10, 64), level)
    warp_stages = [s for s in model.plan.stages() if s.schedule.template == "warp_reduce"]
    assert len(warp_stages) == 2
    assert model.source.count("= __shfl_sync(") == len(warp_stages)


def test_cuda_thread_loops_have_the_block_shape(pair_epilogues):
    """Every thread loop of every stage spans the block (THREADS / 32 warps of 32 lanes). TVM does
    not guard a thread loop of another extent: a shared epilogue bound to one warp per 32 of its
    elements computed only the block's first 256 (the paper BERT's layer norm, 256 of each tile's
    6144), and one bound to the box around a tile straddling a dimension failed to build."""
    staged = run_passes(_single("softmax", (3, 10, 64))[0], "cuda", stop="plan_arena", opt_level=3).ir
    fused = [s for s in staged.stages() if s.epilogue == "shared"]
    assert fused and all(s.schedule.per_tile == 512 for s in fused)
    for stage in staged.stages():
        bindings = re.findall(r'T\.thread_binding\(([^,]+), thread="(threadIdx\.[xy])"\)', stage.func.script())
        block_shape = {(str(staged.threads // 32), "threadIdx.y"), ("32", "threadIdx.x")}
        assert bindings and set(bindings) <= block_shape, stage.name


def test_cuda_shared_epilogue_waits_for_the_whole_tile(pair_epilogues):
    """A shared epilogue's threads read results other threads wrote into shared memory: a block
    barrier separates the two, also where each warp reads only its own result (rows of 32), and
    where a warp reduces the row's two moments one after the other (a loop around the store)."""
    model = _cuda("layer_norm", (1, 8, 32), 3)
    assert [s.epilogue for s in model.plan.stages()].count("shared") == 1
    into_shared_then_barrier = r"_shared_ptr\[[^\]]*\] = red_buf0_ptr(?:_\d+)?\[0\];(?:\s*\})+\s*__syncthreads\(\);"
    assert len(re.findall(into_shared_then_barrier, model.source)) == 1


def _assert_builds_with_warp_all_reduces(graph, level):
    """Each warp reduction ends in a warp all-reduce: one a warp_reduce stage, one for each
    statistic of a row-resident stage (``codegen.row_resident``)."""
    model = souffle.compile(graph, target="cuda", opt_level=level)
    reductions = sum(len(statistics_of(s.tensor)) if s.epilogue == "row" else 1
                     for s in model.plan.stages() if s.schedule.template == "warp_reduce")
    assert model.source.count("= __shfl_sync(") == reductions, f"O{level}"
    return model


def test_cuda_builds_row_and_single_value_reductions_in_one_kernel(pair_epilogues):
    """Shared epilogues whose rows straddle a dimension (they failed to build: their thread loop
    had the extent of the box around the tile) next to a reduction to one value, whose single
    result TVM cannot pool with other shared memory: it stays out of shared memory."""
    model = _assert_builds_with_warp_all_reduces(_family((3, 10, 64))[0], 3)
    stages = model.plan.stages()
    shared = [s for s in stages if s.epilogue == "shared"]
    assert [s.name.split("/")[-1] for s in shared] == ["T_softmax_expsum+mul_2", "layer_norm_moments+add_4",
                                                       "x_red+mul_6"]
    assert all(s.schedule.shared_bytes > SMALL_SHARED_BYTES for s in shared)
    assert [s.epilogue for s in stages if s.schedule.outputs == 1] == [None]


def test_a_full_reduction_without_an_epilogue_stays_a_warp_all_reduce():
    """Found by the slow suite: at O0, the sum of a (2, 6, 5, 8) tensor to one value (one tile,
    no epilogue) was simplified like a single-tile epilogue stage, and TVM's cross-thread
    lowering no longer recognized it: all 32 lanes added into the result, and the validator
    refused the kernel."""
    _assert_builds_with_warp_all_reduces(_family((2, 6, 5, 8))[0], 0)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_builds_the_reductions_at_every_level(shape):
    graph, _ = _family(shape)
    for level in LEVELS:
        _assert_builds_with_warp_all_reduces(graph, level)
