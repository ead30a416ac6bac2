"""Per-TE FLOP counts, bytes written and roofline costs, against counts derived by hand."""

import math

import numpy as np
import pytest
import tvm
from tvm import te, tirx, topi

from analysis.characterize import (
    StageCost,
    bytes_written,
    count_flops,
    dtype_bytes,
    stage_cost,
)
from analysis.device import H200
from codegen.cpu_transforms import pack_weights
from souffle import models
from souffle.lower import LoopRegion, lower_graph
from souffle.ops.registry import get_rule


def stages_of(output: te.Tensor) -> dict[str, te.Tensor]:
    """Every compute TE ``output`` depends on, by name."""
    found = {}

    def visit(t):
        if isinstance(t.op, te.ComputeOp) and t.op.name not in found:
            found[t.op.name] = t
            for producer in t.op.input_tensors:
                visit(producer)

    visit(output)
    return found


def reduction_stage(output: te.Tensor) -> te.Tensor:
    (stage,) = [t for t in stages_of(output).values() if t.op.reduce_axis]
    return stage


# -- hand-built TEs ----------------------------------------------------------------------------
M, N, K = 6, 10, 12


def test_relu_and_add():
    a = te.placeholder((M, N), name="a")
    b = te.placeholder((M, N), name="b")
    assert count_flops(topi.nn.relu(a)) == M * N  # one max per element
    assert count_flops(topi.add(a, b)) == M * N


def test_integer_arithmetic_is_not_counted():
    a = te.placeholder((M, N), "int32", name="a")
    b = te.placeholder((M, N), "int32", name="b")
    assert count_flops(topi.add(a, b)) == 0
    assert count_flops(te.compute((M, N), lambda i, j: a[i, j] * 3 + b[i, j], name="axpy")) == 0


def test_index_arithmetic_is_not_counted():
    a = te.placeholder((M * N,), name="a")
    gather = te.compute((M, N), lambda i, j: a[(i * N + j * 7 + 1) % (M * N)] * 2.0, name="gather")
    assert count_flops(gather) == M * N  # the multiply by 2.0 only


def test_select_cast_and_conditions():
    a = te.placeholder((M,), name="a")
    # select costs nothing, nor does its condition (a*2 > 0); the taken branch's a+1 counts 1
    clip = te.compute((M,), lambda i: tirx.Select(a[i] * 2.0 > 0.0, a[i] + 1.0, a[i]), name="clip")
    assert count_flops(clip) == M
    padded = te.compute((M + 2,), lambda i: tirx.if_then_else(i >= 1, a[i - 1] * a[i - 1], 0.0), name="pad_sq")
    assert count_flops(padded) == M + 2
    to_half = te.compute((M,), lambda i: (a[i] + a[i]).astype("float16"), name="to_half")
    assert count_flops(to_half) == M


def test_one_branch_of_an_if_then_else_is_what_a_gpu_executes():
    """The roofline rule counts both branches of an ``if_then_else``; the latency model
    (``one_branch``) the costlier, as CUDA's ``?:`` evaluates one. A ``select`` is both either way."""
    a = te.placeholder((M,), name="a")
    rolled = te.compute((M,), lambda i: tirx.if_then_else(i >= 2, a[i - 2] * 3.0 + 1.0, a[i + M - 2] * 3.0),
                        name="rolled")
    assert (count_flops(rolled), count_flops(rolled, one_branch=True)) == (3 * M, 2 * M)
    both = te.compute((M,), lambda i: tirx.Select(a[i] > 0.0, a[i] * 3.0 + 1.0, a[i] * 3.0), name="both")
    assert count_flops(both) == count_flops(both, one_branch=True) == 3 * M


def test_intrinsics_count_one():
    x = te.placeholder((M, N), name="x")
    gelu = te.compute((M, N), lambda i, j: 0.5 * x[i, j] * (1.0 + te.erf(x[i, j] * 0.7071067811865476)), name="gelu")
    assert count_flops(gelu) == 5 * M * N  # *, *, +, erf, *
    assert count_flops(topi.sigmoid(x)) == M * N
    assert count_flops(topi.tanh(x)) == M * N
    assert count_flops(topi.exp(x)) == M * N


def test_matmul_and_dense():
    a = te.placeholder((M, K), name="a")
    b = te.placeholder((K, N), name="b")
    bt = te.placeholder((N, K), name="bt")
    bias = te.placeholder((N,), name="bias")
    assert count_flops(topi.nn.matmul(a, b)) == 2 * M * N * K  # a multiply and an add per (m, n, k)
    assert count_flops(topi.nn.matmul(a, bt, transpose_b=True)) == 2 * M * N * K
    assert count_flops(topi.nn.dense(a, bt)) == 2 * M * N * K
    with_bias = topi.nn.dense(a, bt, bias)
    assert count_flops(with_bias) == M * N  # the bias add is its own TE
    assert count_flops(reduction_stage(with_bias)) == 2 * M * N * K


def test_batch_matmul():
    batch = 3
    a = te.placeholder((batch, M, K), name="a")
    b = te.placeholder((batch, N, K), name="b")
    assert count_flops(topi.nn.batch_matmul(a, b)) == 2 * batch * M * N * K
    b_plain = te.placeholder((batch, K, N), name="b_plain")
    assert count_flops(topi.nn.batch_matmul(a, b_plain, transpose_b=False)) == 2 * batch * M * N * K


@pytest.mark.parametrize("stride, padding, out_size", [(1, 1, 10), (2, 1, 5), (1, 0, 8)])
def test_conv2d(stride, padding, out_size):
    n, c, size, k, r = 2, 8, 10, 16, 3
    x = te.placeholder((n, c, size, size), name="x")
    w = te.placeholder((k, c, r, r), name="w")
    y = topi.nn.conv2d_nchw(x, w, stride, padding, 1)
    p = q = (size + 2 * padding - r) // stride + 1
    assert p == out_size
    assert count_flops(y) == 2 * n * k * c * r * r * p * q
    assert sum(count_flops(t) for t in stages_of(y).values()) == 2 * n * k * c * r * r * p * q  # padding is free


def test_grouped_and_depthwise_conv2d():
    n, c, size, k, r, groups = 2, 8, 9, 16, 3, 4
    x = te.placeholder((n, c, size, size), name="x")
    w = te.placeholder((k, c // groups, r, r), name="w")
    y = topi.nn.group_conv2d_nchw(x, w, 1, 1, 1, groups)
    assert count_flops(reduction_stage(y)) == 2 * n * k * (c // groups) * r * r * size * size
    multiplier = 2
    dw = te.placeholder((c, multiplier, r, r), name="dw")
    y = topi.nn.depthwise_conv2d_nchw(x, dw, 1, 1, 1)
    assert count_flops(reduction_stage(y)) == 2 * n * (c * multiplier) * 1 * r * r * size * size


def test_softmax():
    x = te.placeholder((M, N), name="x")
    stages = stages_of(topi.nn.softmax(x))
    counts = {name: count_flops(t) for name, t in stages.items()}
    assert counts == {
        "T_softmax_maxelem": M * N,  # max-reduce: the combiner's max per point
        "T_softmax_exp": 2 * M * N,  # exp(x - max)
        "T_softmax_expsum": M * N,  # sum-reduce
        "T_softmax_norm": M * N,  # divide
    }


def test_layer_norm():
    x = te.placeholder((M, N), name="x")
    gamma = te.placeholder((N,), name="gamma")
    beta = te.placeholder((N,), name="beta")
    y = topi.nn.layer_norm(x, gamma, beta, axis=[1], epsilon=1e-5)
    counts = sorted(count_flops(t) for t in stages_of(y).values())
    # mean: sum (1 per point), / N per row; variance: sum of (x-mean)*(x-mean) (3 + 1 per point);
    # output: (x - mean) * rsqrt(var / N + eps) * gamma + beta (7 per element)
    assert counts == sorted([M * N, M, 4 * M * N, 7 * M * N])
    assert sum(counts) == 12 * M * N + M


def test_adaptive_pool_counts_unequal_windows_exactly():
    x = te.placeholder((1, 2, 5, 5), name="x")
    y = topi.nn.adaptive_pool(x, (3, 3), "avg")
    # 5 -> 3 windows: [0, 2), [1, 4), [3, 5), of 2, 3 and 2 rows (and columns)
    assert count_flops(reduction_stage(y)) == 2 * (2 + 3 + 2) ** 2  # one add per window element


def tuple_sum(x):
    """Sum and sum of squares in one tuple reduction: two outputs sharing one Reduce."""
    k = te.reduce_axis((0, N), name="k")
    reducer = te.comm_reducer(lambda p, q: (p[0] + q[0], p[1] + q[1]),
                              lambda t0, t1: (tirx.const(0, t0), tirx.const(0, t1)), name="sum_sq")
    return te.compute((M,), lambda i: reducer((x[i, k], x[i, k] * x[i, k]), axis=k), name="moments")


def test_tuple_reduction_is_counted_once():
    x = te.placeholder((M, N), name="x")
    total, squares = tuple_sum(x)
    assert total.op.num_outputs == 2 and total.op.same_as(squares.op)
    # per point: x*x (1) in the sources, two adds in the combiner; once for the TE, not per output
    assert count_flops(total) == count_flops(squares) == 3 * M * N


def test_bytes_written():
    assert [dtype_bytes(d) for d in ("float16", "float32", "int64", "bool")] == [2, 4, 8, 1]
    x = te.placeholder((M, N), name="x")
    assert bytes_written(topi.nn.relu(x)) == M * N * 4
    assert bytes_written(topi.nn.relu(te.placeholder((M, N), "float16", name="h"))) == M * N * 2
    assert bytes_written(tuple_sum(x)[0]) == 2 * M * 4  # both outputs


# -- roofline ----------------------------------------------------------------------------------
def test_big_matmul_is_compute_bound_on_h200():
    size = 4096
    a = te.placeholder((size, size), "float16", name="a")
    b = te.placeholder((size, size), "float16", name="b")
    c = topi.nn.matmul(a, b)
    read = 2 * size * size * 2
    cost = stage_cost(c, read, H200)
    flops = 2 * size**3
    moved = read + size * size * 2
    assert cost == StageCost(flops, read, size * size * 2, flops / moved, "compute", flops / 989.5e12)
    assert cost.intensity == pytest.approx(1365.33, rel=1e-5)  # 2*4096 / 6 >> ridge 206
    assert cost.intensity > H200.ridge_point("float16")


def test_relu_is_memory_bound_on_h200():
    size = 4096
    x = te.placeholder((size, size), name="x")
    moved = 2 * size * size * 4
    cost = stage_cost(topi.nn.relu(x), size * size * 4, H200)
    assert cost.flops == size * size
    assert cost.intensity == 0.125  # one FLOP per 4-byte read and 4-byte write
    assert cost.bound == "memory"
    assert cost.time_s == pytest.approx(moved / 4.8e12)


def test_integer_copy_is_memory_bound_without_an_integer_peak():
    ids = te.placeholder((M, N), "int64", name="ids")
    copy = te.compute((M, N), lambda i, j: ids[i, j], name="copy")
    cost = stage_cost(copy, M * N * 8, H200)
    assert (cost.flops, cost.intensity, cost.bound) == (0, 0.0, "memory")
    assert cost.time_s == pytest.approx(2 * M * N * 8 / 4.8e12)


# -- every contraction of every model ----------------------------------------------------------
CONTRACTIONS = {"dense", "dense_packed", "matmul", "batch_matmul", "conv2d", "conv2d_packed"}


def closed_form_flops(op, graph) -> int:
    """2 x multiply-accumulates of a contraction op, from its input specs and attributes."""
    attrs = {**get_rule(op.kind).attrs, **op.attrs}
    shapes = [graph.tensors[name].shape for name in op.inputs]
    if op.kind in ("dense", "dense_packed"):
        x, w = shapes[:2]
        out_features = w[0] * w[2] if op.kind == "dense_packed" else w[0]  # packed: (N / B, K, B)
        return 2 * math.prod(x[:-1]) * out_features * x[-1]
    if op.kind == "matmul":
        a, b = shapes
        (m, k), n = a[-2:], b[-2] if attrs["transpose_b"] else b[-1]
        return 2 * math.prod(np.broadcast_shapes(a[:-2], b[:-2])) * m * n * k
    if op.kind == "batch_matmul":
        a, b = shapes
        batch, m, k = (a[0], a[2], a[1]) if attrs["transpose_a"] else a
        n = b[1] if attrs["transpose_b"] else b[2]
        return 2 * batch * m * n * k
    (n, c, _, _), w = shapes[:2]
    out_channels = w[0] * w[4] if op.kind == "conv2d_packed" else w[0]  # packed: (O / B, C / g, R, S, B)
    r, s = w[2], w[3]
    p, q = graph.tensors[op.outputs[0]].shape[2:]
    return 2 * n * out_channels * (c // attrs["groups"]) * r * s * p * q


def contraction_stages(program):
    """(stage, graph op, graph holding the op's tensors) for each contraction TE, loop bodies included."""
    for region in program.regions:
        if isinstance(region, LoopRegion):
            yield from contraction_stages(region.body)
            continue
        for stage in region.stages():
            op = region.op_of[stage.op]
            if op.kind in CONTRACTIONS and stage.op.reduce_axis:
                yield stage, op, program.graph


def model_graph(name, config, packed):
    """Paper graphs are built without weights (the structure is all that is counted), so instantly."""
    if packed:
        return pack_weights(models.build(name, config))
    return models.structure(name, config)


MODEL_CASES = [(name, config, False) for name in models.MODELS for config in ("tiny", "paper")]
MODEL_CASES += [(name, "tiny", True) for name in models.MODELS]  # packing needs weights: tiny ones are cheap


@pytest.mark.parametrize("name, config, packed", MODEL_CASES,
                         ids=[f"{n}-{c}" + ("-packed" if p else "") for n, c, p in MODEL_CASES])
def test_model_contractions_match_closed_form(name, config, packed):
    program = lower_graph(model_graph(name, config, packed))
    checked = []
    for stage, op, graph in contraction_stages(program):
        assert count_flops(stage) == closed_form_flops(op, graph), f"{op} ({stage.op.name})"
        checked.append(op.kind)
    assert checked, f"{name} {config}: no contraction stage found"
    if packed:
        assert any(kind.endswith("_packed") for kind in checked)


def test_tvm_dtype_objects_are_accepted():
    x = te.placeholder((M,), "float16", name="x")
    assert dtype_bytes(x.dtype) == 2
    assert dtype_bytes(tvm.DataType("float32")) == 4
