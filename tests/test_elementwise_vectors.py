"""Elementwise GPU stages in vectors: where its tiles are whole and it reads nothing under a
condition, each thread computes ``ELEMENTWISE_VECTOR`` consecutive outputs as one vector (its
loads together, then one store), in tiles of that many outputs a thread; elsewhere a thread's
outputs stay a block apart (``codegen.schedule._vectorizes``)."""

import re

import numpy as np
import pytest
import torch
from tvm import s_tir, te, tirx

import souffle
from analysis.device import get_device
from codegen.latency import stage_works
from codegen.schedule import ELEMENTWISE_VECTOR, THREADS, WARP, schedule_stage
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

PER_TILE = THREADS * ELEMENTWISE_VECTOR


def _loops(func) -> list[tuple[str, int]]:
    """(binding or loop kind, extent) of the one block's loops, outermost first."""
    sch = s_tir.Schedule(func)
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    found = []
    for loop in sch.get_loops(block):
        node = sch.get(loop)
        kind = "vectorized" if node.kind == tirx.ForKind.VECTORIZED else "serial"
        found.append((node.thread_binding.thread_tag if node.thread_binding is not None else kind, int(node.extent)))
    return found


def _sum_relu(shape, dtype="float32", padded=False):
    """relu(a + b), or relu of ``a`` padded by one on its last axis."""
    a = te.placeholder(shape, dtype, name="a")
    if padded:
        *lead, last = shape
        out = te.compute((*lead, last + 2), lambda *i: te.max(tirx.if_then_else(
            tirx.all(i[-1] >= 1, i[-1] <= last), a(*i[:-1], i[-1] - 1), tirx.const(0, dtype)), tirx.const(0, dtype)),
            name="padded")
        return te.create_prim_func([a, out])
    b = te.placeholder(shape, dtype, name="b")
    out = te.compute(shape, lambda *i: te.max(a(*i) + b(*i), tirx.const(0, dtype)), name="sum_relu")
    return te.create_prim_func([a, b, out])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_whole_tiles_are_computed_a_vector_a_thread(dtype):
    func, schedule = schedule_stage(_sum_relu((64, 1024), dtype), gpu=True)
    assert (schedule.template, schedule.n_tiles, schedule.per_tile, schedule.vector) == \
        ("elementwise", 64 * 1024 // PER_TILE, PER_TILE, ELEMENTWISE_VECTOR)
    assert _loops(func) == [("blockIdx.x", 64), ("threadIdx.y", THREADS // WARP), ("threadIdx.x", WARP),
                            ("vectorized", ELEMENTWISE_VECTOR)]


@pytest.mark.parametrize("case", ["partial last tile", "padded", "bfloat16", "cpu"])
def test_other_stages_keep_a_thread_s_outputs_a_block_apart(case):
    """A partial last tile (its guard) and a padding (a load under a condition) would make TVM run
    the vector's elements one by one, lanes 4 elements apart; bfloat16 has no vector TVM prints as
    one access; the CPU runs its tiles without threads, as before."""
    shape = (64, 1000) if case == "partial last tile" else (64, 1024)
    func, schedule = schedule_stage(_sum_relu(shape, "bfloat16" if case == "bfloat16" else "float32",
                                              padded=case == "padded"), gpu=case != "cpu")
    assert (schedule.vector, schedule.per_tile) == (1, THREADS)
    if case != "cpu":
        assert _loops(func)[1:] == [("serial", 1), ("threadIdx.y", THREADS // WARP), ("threadIdx.x", WARP)]


def _graph(shape):
    """relu(x * x + bias), one elementwise stage, and PyTorch's answer."""
    b = GraphBuilder("square_bias_relu")
    x = b.input("x", shape)
    bias = b.param("bias", np.random.default_rng(0).standard_normal(shape[-1]).astype("float32"))
    graph = b.build(b.op("relu", b.op("add", b.op("mul", x, x), bias)))
    return graph, lambda t: torch.relu(t * t + torch.from_numpy(graph.weights[bias].copy()))


@pytest.mark.parametrize("precision,vector", [("fp32", "float4"), ("fp16", "half4")])
def test_the_kernel_loads_and_stores_a_vector_a_thread(precision, vector):
    """The bias (float16 at fp16) is loaded 4 elements a lane, and the output (float32 at the
    model's edge) stored 4 at a time, one instruction each."""
    model = souffle.compile(_graph((16, 1024))[0], target="cuda", opt_level=4, precision=precision)
    (stage,) = [s for s in model.plan.stages() if s.schedule.template == "elementwise"]
    assert (stage.schedule.n_tiles, stage.schedule.vector) == (16 * 1024 // PER_TILE, ELEMENTWISE_VECTOR)
    kernel = model.source[model.source.rindex("main_kernel("):]
    assert re.search(rf"= \*\({vector}\*\)\(bias_in \+ ", kernel), kernel
    assert re.search(r"\*\(float4\*\)\(\w+ \+ .*\) = ", kernel), kernel
    assert model.resources.spill_bytes == 0


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-6), ("fp16", 2e-2)])
def test_vectors_match_torch_on_emulated_threads(precision, tolerance):
    graph, answer = _graph((8, 1024))
    x = np.random.default_rng(1).standard_normal((8, 1024)).astype("float32")
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    assert [s.schedule.vector for s in model.plan.stages() if s.schedule.template == "elementwise"] == \
        [ELEMENTWISE_VECTOR]
    expected = answer(torch.from_numpy(x)).numpy()
    for order in ("ascending", "descending"):
        (got,) = model.schedule(order).run({"x": x})
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=order)


def test_the_model_counts_one_access_a_vector():
    """A warp's access moves 32 vectors: 4 outputs a lane, 16 bytes of float32, 16 sectors, and a
    tile of 1024 outputs takes 8 of them per tensor where one output a lane took 32 of 4 sectors."""
    staged = run_passes(_graph((16, 1024))[0], "cuda", stop="kernel_plan", device="h100").ir.staged
    (work,) = [w for w in stage_works(staged, get_device("h100")) if w.template == "elementwise"]
    assert {(a.kind, a.per_tile, a.sectors) for a in work.accesses if a.space == "global"} == \
        {("load", PER_TILE // (WARP * ELEMENTWISE_VECTOR), WARP * ELEMENTWISE_VECTOR * 4 // 32),
         ("store", PER_TILE // (WARP * ELEMENTWISE_VECTOR), WARP * ELEMENTWISE_VECTOR * 4 // 32)}
