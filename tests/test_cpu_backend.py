"""The CPU backend around the scheduler: packed ops, the weight-packing graph rewrite, the
vectorizable exp/erf lowering, and the target and thread pool it compiles for."""

import math
import os
import re

import numpy as np
import pytest
import tvm
from tvm import s_tir, te

import souffle
from codegen.cpu_math import register_llvm_math
from codegen.cpu_transforms import hoist_scan_projections, pack_weights, packed_name
from codegen.llvm import host_target, use_every_core
from souffle import models
from souffle.graph import Graph, GraphBuilder, Scan
from souffle.ops.packed import pack_rows


def _kinds(graph: Graph) -> list[str]:
    kinds = []
    for op in graph.ops:
        kinds += _kinds(op.body) if isinstance(op, Scan) else [op.kind]
    return kinds


def test_pack_rows_puts_consecutive_rows_last():
    w = np.arange(32 * 3, dtype="float32").reshape(32, 3)
    packed = pack_rows(w, 16)
    assert packed.shape == (2, 3, 16)
    assert all(packed[n // 16, k, n % 16] == w[n, k] for n in range(32) for k in range(3))


def test_packed_ops_match_the_unpacked_ones(run_op, rng):
    x = rng.standard_normal((2, 5, 24), dtype="float32")
    w = rng.standard_normal((32, 24), dtype="float32")
    b = rng.standard_normal(32, dtype="float32")
    got, want = run_op("dense_packed", [x, pack_rows(w, 16), b]), run_op("dense", [x, w, b])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    img = rng.standard_normal((1, 8, 9, 9), dtype="float32")
    k = rng.standard_normal((16, 2, 3, 3), dtype="float32")
    attrs = {"stride": 2, "padding": 1, "groups": 4}
    got, want = run_op("conv2d_packed", [img, pack_rows(k, 8)], **attrs), run_op("conv2d", [img, k], **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_top_level_weights_are_packed_once_and_the_originals_dropped():
    rng = np.random.default_rng(0)
    b = GraphBuilder("mlp")
    x = b.input("x", (4, 8))
    h = b.op("dense", x, b.param("fc.weight", rng.standard_normal((24, 8), dtype="float32")))
    shared = b.param("shared", rng.standard_normal((16, 24), dtype="float32"))
    y = b.op("dense", h, shared)
    computed = b.op("copy", b.param("t", rng.standard_normal((16, 16), dtype="float32")))
    graph = b.build(b.op("dense", y, computed), b.op("relu", shared))  # a computed weight stays unpacked
    packed = pack_weights(graph)
    assert _kinds(packed) == ["dense_packed", "dense_packed", "copy", "dense", "relu"]
    assert set(packed.params) == {packed_name("fc.weight", 8), packed_name("shared", 16), "shared", "t"}
    assert packed.weights[packed_name("fc.weight", 8)].shape == (3, 8, 8)
    inputs = {"x": rng.standard_normal((4, 8), dtype="float32")}
    for got, want in zip(souffle.compile(packed).run(inputs), souffle.compile(graph).run(inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, dense_weight", [
    ("lstm", lambda n: n.startswith("weight_")),
    ("bert", lambda n: n.endswith(".weight") and ("dense" in n or ".self." in n)),
])
def test_weights_in_scan_bodies_are_packed_through_params_and_invariants(name, dense_weight):
    graph = models.build(name)
    packed = pack_weights(graph)
    assert "dense" not in _kinds(packed) and "dense_packed" in _kinds(packed)
    originals = [n for n in graph.params if dense_weight(n)]
    assert originals and not any(n in packed.params for n in originals)
    assert all(any(p.startswith(n + ".packed") for p in packed.params) for n in originals)
    outer_scan = next(op for op in packed.ops if isinstance(op, Scan) and op.params)
    stacked = [outers for inner, outers in outer_scan.params if ".packed" in inner]
    assert stacked and all(all(".packed" in o for o in outers) for outers in stacked)


def test_lstm_input_projection_is_hoisted_out_of_each_time_scan():
    graph = hoist_scan_projections(models.build("lstm"))
    assert [op.kind for op in graph.ops if not isinstance(op, Scan)].count("dense") == 1  # layer 0, over all steps
    layers = next(op for op in graph.ops if isinstance(op, Scan) and op.name == "layers")
    assert [op.kind for op in layers.body.ops if not isinstance(op, Scan)].count("dense") == 1  # layers 1.., per layer
    time_scans = [next(op for op in ops if isinstance(op, Scan)) for ops in (graph.ops, layers.body.ops)]
    for scan in time_scans:
        assert _kinds(scan.body).count("dense") == 1  # only the recurrent h @ W_hh is left per step
        assert [inner for inner, _ in scan.xs] == ["dense_1"] and "w_ih" not in dict(scan.invariants)
    inputs = models.make_inputs("lstm")
    expected = models.reference("lstm", "tiny", graph.weights)(inputs)
    for got, want in zip(souffle.compile(graph).run(inputs), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_projections_that_depend_on_the_step_stay_in_the_scan():
    rng = np.random.default_rng(1)
    body = GraphBuilder("step")
    h, x = body.input("h", (1, 4)), body.input("x", (1, 4))
    w, w_step = body.input("w", (4, 4)), body.param("w_step", (4, 4))
    projected = body.op("dense", x, w, name="projected")  # a body output: stays
    # a weight that differs per step, and a projection of the carry: both stay
    h_next = body.op("add", body.op("dense", x, w_step), body.op("dense", h, w), name="h_next")
    b = GraphBuilder("net")
    xs, h0 = b.input("xs", (3, 1, 4)), b.input("h0", (1, 4))
    w_outer = b.param("w", rng.standard_normal((4, 4), dtype="float32"))
    steps = [b.param(f"w{i}", rng.standard_normal((4, 4), dtype="float32")) for i in range(3)]
    (final,), (ys,) = b.scan(body.build(h_next, projected), 3, name="s", carry=[("h", "h_next", h0)], xs=[("x", xs)],
                             ys=["projected"], invariants=[("w", w_outer)], params={"w_step": steps})
    graph = b.build(final, ys)
    assert hoist_scan_projections(graph) is graph


def test_models_without_packable_weights_are_returned_unchanged():
    b = GraphBuilder("act")
    graph = b.build(b.op("relu", b.input("x", (3,))))
    graph = Graph(graph.name, graph.inputs, [], graph.ops, graph.outputs, {})
    assert pack_weights(graph) is graph


def _run_elementwise(fn, x):
    register_llvm_math()
    X = te.placeholder(x.shape, name="x")
    sch = s_tir.Schedule(te.create_prim_func([X, te.compute(x.shape, lambda i: fn(X[i]), name="y")]))
    block = sch.get_sblock("y")
    _, lanes = sch.split(sch.get_loops(block)[0], [None, 8])
    sch.vectorize(lanes)
    lib = tvm.compile(sch.mod, target=host_target())
    dev = tvm.cpu()
    out = tvm.runtime.empty(x.shape, "float32", dev)
    lib(tvm.runtime.tensor(x, dev), out)
    return out.numpy(), lib.mod.inspect_source("asm")


def _ulps(got, want):
    want32 = want.astype("float32")
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want32)).astype(np.float64)


def test_exp_is_vectorized_arithmetic_within_two_ulps():
    x = np.concatenate([np.linspace(-87, 88.7, 40000), [-1e30, -100.0, 0.0, 89.0, 1e30]]).astype("float32")
    got, asm = _run_elementwise(te.exp, x)
    assert not re.search(r"call\w*\s+expf", asm)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64))
    normal = (want > 2.0 ** -125) & (want < np.finfo(np.float32).max)
    assert _ulps(got[normal], want[normal]).max() <= 2
    assert got[-5] == 0 and got[-4] == 0 and got[-3] == 1 and np.isinf(got[-2]) and np.isinf(got[-1])


def test_erf_tanh_sigmoid_are_accurate():
    x = np.linspace(-12, 12, 24001).astype("float32")
    erf, asm = _run_elementwise(te.erf, x)
    assert not re.search(r"call\w*\s+erff", asm)
    np.testing.assert_allclose(erf, [math.erf(v) for v in x.astype(np.float64)], rtol=0, atol=5e-7)
    tanh, _ = _run_elementwise(te.tanh, x)
    np.testing.assert_allclose(tanh, np.tanh(x.astype(np.float64)), rtol=0, atol=2e-7)
    special, _ = _run_elementwise(te.tanh, np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 8], "float32"))
    np.testing.assert_array_equal(special[:5], [np.nan, 1, -1, 0, 0])
    np.testing.assert_allclose(special[5:], np.tanh([1e-30, -1e-30, 8]), rtol=0, atol=2e-7)
    sigmoid, _ = _run_elementwise(te.sigmoid, x)
    np.testing.assert_allclose(sigmoid, 1 / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["exp", "erf", "tanh"])
def test_exp_erf_and_tanh_hold_their_argument_once(name):
    """The lowering binds its argument to a variable: copied into each of its uses (about 25 in
    exp), the argument would multiply the code of nested calls by that at every level (three
    chained tanh, each through two exps, took minutes to compile)."""
    register_llvm_math()
    lower = tvm.ir.Op.get(f"tirx.{name}").get_attr("llvm.FLowerIntrinsic")
    argument = tvm.tirx.Var("argument_marker", "float32")
    assert str(lower(getattr(te, name)(argument))).count("argument_marker") == 1


def test_float64_exp_keeps_the_libm_lowering():
    register_llvm_math()
    X = te.placeholder((4,), "float64", name="x")
    lib = tvm.compile(te.create_prim_func([X, te.compute((4,), lambda i: te.exp(X[i]))]), target=host_target())
    dev = tvm.cpu()
    out = tvm.runtime.empty((4,), "float64", dev)
    lib(tvm.runtime.tensor(np.arange(4.0), dev), out)
    np.testing.assert_array_equal(out.numpy(), np.exp(np.arange(4.0)))


def test_target_is_the_host_cpu_and_the_pool_uses_every_core(monkeypatch):
    assert host_target().attrs["mcpu"] == tvm.target.codegen.llvm_get_system_cpu()
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    use_every_core()
    assert os.environ["TVM_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    use_every_core()
    assert os.environ["TVM_NUM_THREADS"] == "1"  # an explicit setting is kept


@pytest.mark.parametrize("channels, out_channels, size, kernel, stride, groups", [
    (5, 10, 9, 3, 2, 1),  # 10 outputs: no packing block divides, stays conv2d
    (6, 24, 11, 3, 1, 3),  # packed by 8 with 8 outputs per group
    (16, 16, 6, 3, 1, 16),  # depthwise
    (8, 16, 5, 1, 1, 1),
])
def test_odd_convolutions_match_torch(channels, out_channels, size, kernel, stride, groups):
    import torch

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, channels, size, size), dtype="float32")
    w = rng.standard_normal((out_channels, channels // groups, kernel, kernel), dtype="float32")
    b = GraphBuilder("conv")
    conv = b.op("conv2d", b.input("x", x.shape), b.param("w", w), stride=stride, padding=kernel // 2, groups=groups)
    y = b.op("relu", conv)
    got = souffle.compile(b.build(y)).run({"x": x})[0]
    want = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=stride,
                                                 padding=kernel // 2, groups=groups)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, features, outputs", [(3, 7, 10), (5, 33, 24), (1, 100, 1000)])
def test_odd_dense_shapes_match_numpy(rows, features, outputs):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, features), dtype="float32")
    w = rng.standard_normal((outputs, features), dtype="float32")
    bias = rng.standard_normal(outputs, dtype="float32")
    b = GraphBuilder("fc")
    y = b.op("dense", b.input("x", x.shape), b.param("w", w), b.param("b", bias))
    got = souffle.compile(b.build(y)).run({"x": x})[0]
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T + bias, rtol=1e-5, atol=1e-4)
