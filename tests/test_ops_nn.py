"""Neural-network ops against torch.nn.functional, and their refusals of bad inputs."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from souffle.errors import GraphError
from souffle.graph import GraphBuilder

TOL = dict(rtol=1e-5, atol=1e-5)
REDUCTION_TOL = dict(rtol=1e-4, atol=1e-4)


def t(array):
    return torch.from_numpy(array)


def randn(rng, *shape, dtype="float32"):
    return rng.standard_normal(shape).astype(dtype)


def refuses(kind, specs, reason, **attrs):
    """Assert that adding ``kind`` on inputs given as (shape, dtype) pairs fails with ``reason``."""
    b = GraphBuilder("g")
    names = [b.input(f"in{i}", shape, dtype) for i, (shape, dtype) in enumerate(specs)]
    with pytest.raises(GraphError, match=reason):
        b.op(kind, *names, **attrs)


F32 = "float32"


# -- dense and matmul --------------------------------------------------------------------------
@pytest.mark.parametrize("x_shape", [(4, 6), (2, 3, 6), (6,)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense(run_op, rng, x_shape, with_bias):
    x, w, b = randn(rng, *x_shape), randn(rng, 5, 6), randn(rng, 5)
    arrays = [x, w, b] if with_bias else [x, w]
    expected = F.linear(t(x), t(w), t(b) if with_bias else None).numpy()
    np.testing.assert_allclose(run_op("dense", arrays), expected, **TOL)


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((3, 4), (4, 5)),
        ((2, 3, 4), (4, 5)),
        ((3, 4), (2, 4, 5)),
        ((2, 3, 4), (2, 4, 5)),
        ((2, 1, 3, 4), (3, 4, 5)),
        ((1, 3, 4), (2, 2, 4, 5)),
    ],
)
@pytest.mark.parametrize("transpose_b", [False, True])
def test_matmul_broadcasts_batches(run_op, rng, a_shape, b_shape, transpose_b):
    a, b = randn(rng, *a_shape), randn(rng, *b_shape)
    stored_b = np.ascontiguousarray(np.swapaxes(b, -1, -2)) if transpose_b else b
    out = run_op("matmul", [a, stored_b], transpose_b=transpose_b)
    expected = torch.matmul(t(a), t(b)).numpy()
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOL)


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_batch_matmul(run_op, rng, transpose_a, transpose_b):
    a, b = randn(rng, 3, 4, 6), randn(rng, 3, 6, 5)
    stored_a = np.ascontiguousarray(a.transpose(0, 2, 1)) if transpose_a else a
    stored_b = np.ascontiguousarray(b.transpose(0, 2, 1)) if transpose_b else b
    out = run_op("batch_matmul", [stored_a, stored_b], transpose_a=transpose_a, transpose_b=transpose_b)
    np.testing.assert_allclose(out, torch.bmm(t(a), t(b)).numpy(), **TOL)


# -- convolution -------------------------------------------------------------------------------
CONV_CASES = {
    "plain": dict(c=3, o=4, k=(3, 3), bias=False, attrs={}),
    "padded": dict(c=3, o=4, k=(3, 3), bias=True, attrs={"padding": 1}),
    "strided": dict(c=3, o=4, k=(3, 3), bias=False, attrs={"stride": 2, "padding": 1}),
    "dilated": dict(c=2, o=3, k=(3, 3), bias=True, attrs={"dilation": 2, "padding": 2}),
    "asymmetric": dict(c=2, o=3, k=(3, 1), bias=True, attrs={"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2)}),
    "pointwise": dict(c=4, o=6, k=(1, 1), bias=False, attrs={}),
    "grouped": dict(c=4, o=6, k=(3, 3), bias=True, attrs={"groups": 2, "padding": 1}),
    "grouped_strided_dilated": dict(
        c=6, o=9, k=(3, 3), bias=False, attrs={"groups": 3, "stride": 2, "dilation": 2, "padding": (2, 1)}
    ),
    "depthwise": dict(c=4, o=4, k=(3, 3), bias=True, attrs={"groups": 4, "padding": 1}),
    "depthwise_strided": dict(c=4, o=4, k=(3, 3), bias=False, attrs={"groups": 4, "stride": 2, "padding": 1}),
    "depthwise_multiplier": dict(c=3, o=6, k=(3, 3), bias=True, attrs={"groups": 3, "padding": (0, 1), "dilation": (2, 1)}),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv2d_matches_torch(run_op, rng, case):
    spec = CONV_CASES[case]
    attrs, with_bias = spec["attrs"], spec["bias"]
    groups = attrs.get("groups", 1)
    x = randn(rng, 2, spec["c"], 9, 8)
    w = randn(rng, spec["o"], spec["c"] // groups, *spec["k"])
    b = randn(rng, spec["o"])
    arrays = [x, w, b] if with_bias else [x, w]
    expected = F.conv2d(t(x), t(w), t(b) if with_bias else None, **attrs).numpy()
    out = run_op("conv2d", arrays, **attrs)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOL)


@pytest.mark.parametrize(
    "x_shape, w_shape, attrs, reason",
    [
        ((1, 3, 8, 8), (4, 2, 3, 3), {}, r"weight has 2 input channels per group, expected 3 \(3 channels / 1 groups\)"),
        ((1, 4, 8, 8), (6, 2, 3, 3), {"groups": 3}, "groups=3 must divide both input channels 4 and output channels 6"),
        ((1, 4, 8, 8), (5, 2, 3, 3), {"groups": 2}, "output channels 5"),
        ((1, 4, 8, 8), (4, 1, 3, 3), {"groups": 0}, "groups must be a positive int"),
        ((3, 8, 8), (4, 3, 3, 3), {}, r"input \(N, C, H, W\) must be 4-D, got shape \[3, 8, 8\]"),
        ((1, 3, 8, 8), (4, 3, 3), {}, "weight .* must be 4-D"),
        ((1, 3, 4, 4), (4, 3, 5, 5), {}, "larger than the padded input"),
        ((1, 3, 4, 4), (4, 3, 3, 3), {"dilation": 2}, "window of span 5"),
        ((1, 3, 8, 8), (4, 3, 3, 3), {"stride": 0}, "stride must be >= 1"),
        ((1, 3, 8, 8), (4, 3, 3, 3), {"padding": (1, 1, 1)}, "padding must be an int or a pair"),
        ((1, 3, 8, 8), (4, 3, 3, 3), {"padding": "same"}, "padding must be an int or a list of ints"),
    ],
)
def test_conv2d_refuses(x_shape, w_shape, attrs, reason):
    refuses("conv2d", [(x_shape, F32), (w_shape, F32)], reason, **attrs)


def test_conv2d_refuses_bad_bias():
    refuses("conv2d", [((1, 3, 8, 8), F32), ((4, 3, 3, 3), F32), ((3,), F32)], r"bias must have shape \[4\], got \[3\]")


# -- normalization -----------------------------------------------------------------------------
@pytest.mark.parametrize("x_shape", [(2, 4, 3, 5), (6, 4)])
def test_batch_norm_inference(run_op, rng, x_shape):
    x, gamma, beta, mean = randn(rng, *x_shape), randn(rng, 4), randn(rng, 4), randn(rng, 4)
    var = rng.uniform(0.5, 2.0, 4).astype(F32)
    out = run_op("batch_norm", [x, gamma, beta, mean, var], eps=1e-3)
    expected = F.batch_norm(t(x), t(mean), t(var), t(gamma), t(beta), training=False, eps=1e-3).numpy()
    np.testing.assert_allclose(out, expected, **TOL)


@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_layer_norm(run_op, rng, eps):
    x, gamma, beta = randn(rng, 2, 3, 16) * 3 + 1, randn(rng, 16), randn(rng, 16)
    out = run_op("layer_norm", [x, gamma, beta], eps=eps)
    expected = F.layer_norm(t(x), (16,), t(gamma), t(beta), eps=eps).numpy()
    np.testing.assert_allclose(out, expected, **TOL)


@pytest.mark.parametrize("axis", [-1, 0, 1, -3])
def test_softmax(run_op, rng, axis):
    x = randn(rng, 3, 4, 5) * 5
    np.testing.assert_allclose(run_op("softmax", [x], axis=axis), F.softmax(t(x), dim=axis).numpy(), **TOL)


@pytest.mark.parametrize(
    "kind, specs, attrs, reason",
    [
        ("batch_norm", [(2, 4, 3, 3), (4,), (4,), (3,), (4,)], {}, r"'in3' must have shape \[4\] \(one value per channel\)"),
        ("batch_norm", [(4,), (4,), (4,), (4,), (4,)], {}, "at least 2-D"),
        ("batch_norm", [(2, 4), (4,), (4,), (4,), (4,)], {"eps": -1.0}, "eps must be a non-negative number"),
        ("layer_norm", [(2, 8), (8,), (4,)], {}, r"'in2' must have shape \[8\] \(the last dimension\)"),
        ("softmax", [(2, 8)], {"axis": 2}, "axis 2 is out of range for a rank-2 tensor"),
        ("softmax", [(2, 8)], {"axis": -3}, "axis -3 is out of range"),
    ],
)
def test_normalization_refuses(kind, specs, attrs, reason):
    refuses(kind, [(shape, F32) for shape in specs], reason, **attrs)


def test_softmax_refuses_integers():
    refuses("softmax", [((2, 3), "int32")], "must be floating-point, got int32")


# -- pooling and reductions --------------------------------------------------------------------
POOL_CASES = [
    dict(kernel=2),
    dict(kernel=3, stride=2),
    dict(kernel=3, stride=2, padding=1),
    dict(kernel=(3, 2), stride=(2, 1), padding=(1, 0)),
    dict(kernel=3, stride=2, ceil_mode=True),
    dict(kernel=2, stride=2, padding=1, ceil_mode=True),
    dict(kernel=3, stride=3, padding=1, ceil_mode=True),
]


def _torch_pool_args(attrs):
    args = dict(attrs)
    args["kernel_size"] = args.pop("kernel")
    return args


@pytest.mark.parametrize("attrs", POOL_CASES + [dict(kernel=3, stride=1, padding=1, dilation=2)])
def test_max_pool2d(run_op, rng, attrs):
    x = randn(rng, 2, 3, 7, 8)
    expected = F.max_pool2d(t(x), **_torch_pool_args(attrs)).numpy()
    out = run_op("max_pool2d", [x], **attrs)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOL)


def test_max_pool2d_ignores_padding_for_negative_inputs(run_op, rng):
    x = -np.abs(randn(rng, 1, 2, 5, 5)) - 1
    expected = F.max_pool2d(t(x), 3, 2, 1).numpy()
    np.testing.assert_allclose(run_op("max_pool2d", [x], kernel=3, stride=2, padding=1), expected, **TOL)


@pytest.mark.parametrize(
    "attrs, count_include_pad",
    [(attrs, True) for attrs in POOL_CASES] + [(attrs, False) for attrs in POOL_CASES if attrs.get("padding")],
)
def test_avg_pool2d(run_op, rng, attrs, count_include_pad):
    x = randn(rng, 2, 3, 7, 8)
    expected = F.avg_pool2d(t(x), count_include_pad=count_include_pad, **_torch_pool_args(attrs)).numpy()
    out = run_op("avg_pool2d", [x], count_include_pad=count_include_pad, **attrs)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOL)


def test_global_avg_pool2d(run_op, rng):
    x = randn(rng, 2, 5, 7, 6)
    expected = torch.nn.AdaptiveAvgPool2d(1)(t(x)).numpy()
    np.testing.assert_allclose(run_op("global_avg_pool2d", [x]), expected, **TOL)


@pytest.mark.parametrize(
    "attrs, reason",
    [
        ({}, "kernel is required"),
        ({"kernel": 2, "padding": 2}, "padding 2 must be at most half the kernel size 2"),
        ({"kernel": 9}, "larger than the padded input"),
        ({"kernel": 2, "stride": 0}, "stride must be >= 1"),
        ({"kernel": 2, "ceil_mode": 1}, "ceil_mode must be True or False"),
        ({"kernel": 2, "count_include_pad": False}, r"unknown attribute\(s\) \['count_include_pad'\] for max_pool2d"),
    ],
)
def test_max_pool2d_refuses(attrs, reason):
    refuses("max_pool2d", [((1, 2, 8, 8), F32)], reason, **attrs)


def test_pool_refuses_wrong_rank():
    refuses("avg_pool2d", [((2, 8, 8), F32)], r"must be 4-D, got shape \[2, 8, 8\]", kernel=2)
    refuses("global_avg_pool2d", [((2, 8), F32)], "must be 4-D")


@pytest.mark.parametrize(
    "attrs, shape",
    [
        ({}, (3, 4, 5)),
        ({"axes": -1}, (3, 4, 5)),
        ({"axes": (0, 2), "keepdims": True}, (3, 4, 5)),
        ({"axes": [-2, 0]}, (3, 4, 5)),
        ({"axes": 1}, (2, 4096)),
        ({"axes": (2, 3), "keepdims": True, "split": 4}, (2, 3, 8, 6)),  # runs of 12 across rows
        ({"axes": [-1, -2], "split": 16}, (2, 3, 8, 6)),
        ({"axes": None, "split": 2}, (3, 4, 5)),
    ],
)
def test_mean(run_op, rng, attrs, shape):
    x = randn(rng, *shape) + 1
    dims = attrs.get("axes")
    expected = (torch.mean(t(x)) if dims is None else torch.mean(t(x), dim=dims, keepdim=attrs.get("keepdims", False))).numpy()
    out = run_op("mean", [x], **attrs)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **REDUCTION_TOL)


@pytest.mark.parametrize(
    "attrs, reason",
    [
        ({"axes": (1, -2)}, r"axes \(1, -2\) names an axis twice"),
        ({"axes": 3}, "axes 3 is out of range for a rank-3 tensor"),
        ({"axes": 1.0}, "axes must be an int or a list of ints"),
        ({"keepdims": "yes"}, "keepdims must be True or False"),
        ({"axes": (0, 1), "split": 2}, r"split applies to a reduction over the last axes, got axes \[0, 1\]"),
        ({"axes": 2, "split": 3}, "split must be a positive integer dividing the reduced elements 4, got 3"),
        ({"axes": 2, "split": 0}, "split must be a positive integer"),
    ],
)
def test_mean_refuses(attrs, reason):
    refuses("mean", [((2, 3, 4), F32)], reason, **attrs)


# -- lookup ------------------------------------------------------------------------------------
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
@pytest.mark.parametrize("id_shape", [(5,), (2, 3)])
def test_embedding(run_op, rng, id_dtype, id_shape):
    table = randn(rng, 10, 4)
    ids = rng.integers(0, 10, id_shape).astype(id_dtype)
    expected = F.embedding(t(ids.astype("int64")), t(table)).numpy()
    out = run_op("embedding", [table, ids])
    assert out.shape == id_shape + (4,)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "specs, reason",
    [
        ([((10, 4), F32), ((3,), F32)], "ids must be int32 or int64, got float32"),
        ([((10,), F32), ((3,), "int64")], r"table .* must be 2-D, got shape \[10\]"),
        ([((10, 4), "int32"), ((3,), "int64")], "must be floating-point"),
    ],
)
def test_embedding_refuses(specs, reason):
    refuses("embedding", specs, reason)


# -- matmul refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, a_shape, b_shape, attrs, reason",
    [
        ("dense", (2, 6), (5, 4), {}, r"input features \(6,\) do not match weight in_features 4"),
        ("dense", (2, 6), (6,), {}, "must be 2-D"),
        ("matmul", (2, 3, 4), (5, 6), {}, r"a has 4 columns but b has 5 rows \(transpose_b=False\)"),
        ("matmul", (3, 4), (4, 5), {"transpose_b": True}, "a has 4 columns but b has 5 rows"),
        ("matmul", (2, 3, 4), (3, 4, 5), {}, r"shapes \[2\] and \[3\] do not broadcast"),
        ("matmul", (4,), (4, 5), {}, "at least 2-D"),
        ("batch_matmul", (2, 3, 4), (3, 4, 5), {}, "batch sizes differ: 2 and 3"),
        ("batch_matmul", (2, 3, 4), (2, 5, 4), {}, "a has 4 columns but b has 5 rows"),
        ("batch_matmul", (3, 4), (4, 5), {}, "a must be 3-D"),
        ("batch_matmul", (2, 3, 4), (2, 4, 5), {"transpose_a": 1}, "transpose_a must be True or False"),
    ],
)
def test_matmul_refuses(kind, a_shape, b_shape, attrs, reason):
    refuses(kind, [(a_shape, F32), (b_shape, F32)], reason, **attrs)


def test_matmul_refuses_mixed_dtypes():
    refuses("matmul", [((2, 3), F32), ((3, 2), "float16")], "inputs must share one dtype")
