"""Elementwise ops against torch: activations, broadcasting arithmetic, constants."""

import numpy as np
import pytest
import torch

from souffle.errors import GraphError
from souffle.graph import GraphBuilder

TOL = dict(rtol=1e-5, atol=1e-5)


def t(array):
    return torch.from_numpy(array)


@pytest.mark.parametrize(
    "kind, reference",
    [
        ("relu", torch.relu),
        ("gelu", torch.nn.GELU()),
        ("sigmoid", torch.sigmoid),
        ("tanh", torch.tanh),
        ("silu", torch.nn.SiLU()),
    ],
)
def test_unary_matches_torch(run_op, rng, kind, reference):
    x = (rng.standard_normal((3, 5, 7)) * 4).astype("float32")
    np.testing.assert_allclose(run_op(kind, [x]), reference(t(x)).numpy(), **TOL)


def test_relu_on_integers(run_op):
    x = np.array([[-3, 0, 5]], "int32")
    np.testing.assert_array_equal(run_op("relu", [x]), [[0, 0, 5]])


BROADCAST_CASES = [
    ((2, 3, 4), (2, 3, 4)),
    ((2, 3, 4), (4,)),
    ((2, 1, 4), (3, 1)),
    ((1,), (2, 3)),
    ((5, 1, 1), (1, 2, 3)),
]


@pytest.mark.parametrize("kind, reference", [("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div)])
@pytest.mark.parametrize("shape_a, shape_b", BROADCAST_CASES)
def test_binary_broadcasts_like_torch(run_op, rng, kind, reference, shape_a, shape_b):
    a = rng.standard_normal(shape_a).astype("float32")
    b = rng.uniform(0.5, 2.0, shape_b).astype("float32") * rng.choice([-1, 1], shape_b).astype("float32")
    out = run_op(kind, [a, b])
    expected = reference(t(a), t(b)).numpy()
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOL)


@pytest.mark.parametrize("kind, reference", [("add", np.add), ("sub", np.subtract), ("mul", np.multiply)])
def test_integer_arithmetic(run_op, rng, kind, reference):
    a = rng.integers(-100, 100, (3, 4)).astype("int64")
    b = rng.integers(-100, 100, (4,)).astype("int64")
    np.testing.assert_array_equal(run_op(kind, [a, b]), reference(a, b))


def test_scale(run_op, rng):
    x = rng.standard_normal((4, 6)).astype("float32")
    np.testing.assert_allclose(run_op("scale", [x], factor=0.125), x * 0.125, **TOL)
    np.testing.assert_allclose(run_op("scale", [x], factor=-3), x * -3, **TOL)


def test_copy_is_equal(run_op, rng):
    x = rng.standard_normal((2, 3, 4)).astype("float32")
    np.testing.assert_array_equal(run_op("copy", [x]), x)


def test_full(run_op):
    out = run_op("full", [], shape=(2, 3), value=1.5)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.full((2, 3), 1.5, "float32"))
    out = run_op("full", [], shape=[4], value=-7, dtype="int64")
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, torch.full((4,), -7, dtype=torch.int64).numpy())
    np.testing.assert_array_equal(run_op("full", [], shape=3), np.zeros(3, "float32"))


@pytest.mark.parametrize(
    "kind, shapes, dtypes, attrs, reason",
    [
        ("add", [(2, 3), (3,)], ["float32", "float16"], {}, "inputs must share one dtype, got float16, float32"),
        ("mul", [(2, 3), (2,)], ["float32", "float32"], {}, r"shapes \[2, 3\] and \[2\] do not broadcast"),
        ("sub", [(4, 1, 3), (2, 2)], ["float32", "float32"], {}, "do not broadcast"),
        ("div", [(2,), (2,)], ["int32", "int32"], {}, "'a' must be floating-point, got int32"),
        ("gelu", [(2,)], ["int64"], {}, "must be floating-point, got int64"),
        ("sigmoid", [(2,)], ["int32"], {}, "must be floating-point"),
        ("scale", [(2,)], ["float32"], {"factor": "2"}, "factor must be a finite number"),
        ("scale", [(2,)], ["int32"], {"factor": 2.0}, "must be floating-point"),
    ],
)
def test_bad_inputs_are_refused(kind, shapes, dtypes, attrs, reason):
    b = GraphBuilder("g")
    names = [b.input(name, shape, dtype) for name, shape, dtype in zip("ab", shapes, dtypes)]
    with pytest.raises(GraphError, match=reason):
        b.op(kind, *names, **attrs)


@pytest.mark.parametrize(
    "attrs, reason",
    [
        ({}, "shape is required"),
        ({"shape": (2, 0)}, "shape must be >= 1"),
        ({"shape": (2,), "dtype": "float64"}, "dtype 'float64' is not supported"),
        ({"shape": (2,), "value": "one"}, "value must be a number"),
        ({"shape": (2,), "value": 0.5, "dtype": "int32"}, "not representable as int32"),
        ({"shape": (2,), "value": float("inf"), "dtype": "int32"}, "not representable as int32"),
        ({"shape": (2,), "value": 2**31, "dtype": "int32"},
         r"not representable as int32 \(integers in \[-2147483648, 2147483647\]\)"),
        ({"shape": (2,), "value": -2**63 - 1, "dtype": "int64"}, "not representable as int64"),
    ],
)
def test_bad_full_is_refused(attrs, reason):
    with pytest.raises(GraphError, match=reason):
        GraphBuilder("g").op("full", **attrs)
