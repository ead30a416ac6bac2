"""Comparisons, logical ops and where against torch: int32 masks (1 where true), NaN as torch treats it."""

import numpy as np
import pytest
import torch

from souffle.errors import GraphError
from souffle.graph import GraphBuilder

NAN = np.nan


@pytest.mark.parametrize("kind", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons_broadcast_and_treat_nan_as_torch(run_op, kind):
    a = np.array([[1, 2, NAN, np.inf], [0, -0.0, 3, -np.inf]], np.float32)
    b = np.array([1, NAN, NAN, np.inf], np.float32)
    got = run_op(kind, [a, b])
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, getattr(torch, kind)(torch.from_numpy(a), torch.from_numpy(b)).int().numpy())


def test_comparisons_of_integers(run_op):
    a = np.array([[3, -2, 7]], np.int64)
    b = np.array([[3], [7]], np.int64)
    np.testing.assert_array_equal(run_op("le", [a, b]), [[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize("kind", ["logical_and", "logical_or"])
def test_logical_ops_read_nonzero_nan_included_as_true(run_op, kind):
    a = np.array([[0, 1, -2, NAN]], np.float32)
    b = np.array([[0], [5]], np.float32)
    want = getattr(torch, kind)(torch.from_numpy(a), torch.from_numpy(b)).int().numpy()
    np.testing.assert_array_equal(run_op(kind, [a, b]), want)


def test_logical_not(run_op):
    np.testing.assert_array_equal(run_op("logical_not", [np.array([0, 2, -1, 0], np.int64)]), [1, 0, 0, 1])


def test_where_keeps_only_the_chosen_branch(run_op):
    """A NaN or inf in the branch not chosen does not leak, as in torch.where."""
    condition = np.array([[1], [0], [7]], np.int32)
    a = np.array([[NAN, 1, 2]], np.float32)
    b = np.array([[3, np.inf, 5], [6, 7, 8], [9, 10, 11]], np.float32)
    want = torch.where(torch.from_numpy(condition) != 0, torch.from_numpy(a), torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(run_op("where", [condition, a, b]), want)


def test_where_on_a_float_condition_reads_nan_as_true(run_op):
    condition = np.array([0.0, NAN, -0.0, 0.5], np.float32)
    np.testing.assert_array_equal(run_op("where", [condition, np.ones(4, np.float32), np.zeros(4, np.float32)]),
                                  [0, 1, 0, 1])


def test_mismatched_dtypes_are_refused():
    b = GraphBuilder("t")
    x, ids = b.input("x", (3,)), b.input("ids", (3,), "int64")
    with pytest.raises(GraphError, match="inputs must share one dtype, got float32 and int64"):
        b.op("lt", x, ids)
    with pytest.raises(GraphError, match="branches must share one dtype"):
        b.op("where", ids, x, ids)
