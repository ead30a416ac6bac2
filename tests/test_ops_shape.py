"""Shape ops against torch/numpy: reshape, transpose, concat, slice, split, flatten."""

import numpy as np
import pytest
import torch

from souffle.errors import GraphError
from souffle.graph import GraphBuilder


def arange(*shape, dtype="float32"):
    """Distinct values, so any misplaced element shows."""
    return np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)


def refuses(kind, shapes, reason, dtypes=None, **attrs):
    b = GraphBuilder("g")
    dtypes = dtypes or ["float32"] * len(shapes)
    names = [b.input(f"in{i}", shape, dtype) for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    with pytest.raises(GraphError, match=reason):
        b.op(kind, *names, **attrs)


@pytest.mark.parametrize("shape", [(4, 6), (-1, 3), (2, -1, 2), (24,), [1, 24, 1]])
def test_reshape(run_op, shape):
    x = arange(2, 3, 4)
    np.testing.assert_array_equal(run_op("reshape", [x], shape=shape), torch.from_numpy(x).reshape(shape).numpy())


@pytest.mark.parametrize("axes", [None, (1, 0, 2), (2, 0, 1), [-1, -3, -2]])
def test_transpose(run_op, axes):
    x = arange(2, 3, 4)
    expected = np.transpose(x) if axes is None else torch.from_numpy(x).permute(*axes).numpy()
    np.testing.assert_array_equal(run_op("transpose", [x], axes=axes), expected)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(run_op, axis):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, shape in enumerate(shapes):
        shape[axis] += i
    arrays = [arange(*s) + 100 * i for i, s in enumerate(shapes)]
    expected = torch.cat([torch.from_numpy(a) for a in arrays], dim=axis).numpy()
    np.testing.assert_array_equal(run_op("concat", arrays, axis=axis), expected)


def test_concat_of_one_and_of_integers(run_op):
    x = arange(2, 3, dtype="int64")
    np.testing.assert_array_equal(run_op("concat", [x]), x)
    np.testing.assert_array_equal(run_op("concat", [x, x], axis=1), np.concatenate([x, x], 1))


@pytest.mark.parametrize(
    "attrs, index",
    [
        (dict(begin=1, end=3), np.s_[1:3]),
        (dict(begin=1, end=5, axis=2), np.s_[:, :, 1:5]),
        (dict(begin=-3, end=100, axis=-1), np.s_[..., -3:]),
        (dict(begin=0, end=6, axis=2, strides=2), np.s_[:, :, 0:6:2]),
        (dict(begin=[1, -5], end=[3, -1], axis=[1, 2], strides=[1, 3]), np.s_[:, 1:3, -5:-1:3]),
        (dict(begin=[0, 2], end=[1, 100]), np.s_[0:1, 2:]),
        (dict(begin=-100, end=2, axis=1), np.s_[:, :2]),
    ],
)
def test_slice(run_op, attrs, index):
    x = arange(3, 4, 6)
    expected = torch.from_numpy(x)[index].numpy()
    np.testing.assert_array_equal(run_op("slice", [x], **attrs), expected)


@pytest.mark.parametrize(
    "attrs, torch_sizes, axis",
    [
        (dict(sections=2), 2, 0),
        (dict(sections=3, axis=-1), 2, -1),
        (dict(sizes=[1, 2, 3], axis=2), [1, 2, 3], 2),
        (dict(sizes=(3, 1), axis=1), [3, 1], 1),
    ],
)
def test_split(run_op, attrs, torch_sizes, axis):
    x = arange(4, 4, 6)
    outs = run_op("split", [x], **attrs)
    expected = torch.split(torch.from_numpy(x), torch_sizes, dim=axis)
    assert len(outs) == len(expected)
    for out, ref in zip(outs, expected):
        np.testing.assert_array_equal(out, ref.numpy())


def test_split_into_one_piece(run_op):
    x = arange(2, 3)
    np.testing.assert_array_equal(run_op("split", [x], sections=1), x)


@pytest.mark.parametrize("attrs", [{}, {"start_dim": 0}, {"start_dim": 1, "end_dim": 2}, {"start_dim": -2}, {"start_dim": 3}])
def test_flatten(run_op, attrs):
    x = arange(2, 3, 4, 5)
    expected = torch.flatten(torch.from_numpy(x), attrs.get("start_dim", 1), attrs.get("end_dim", -1)).numpy()
    np.testing.assert_array_equal(run_op("flatten", [x], **attrs), expected)


@pytest.mark.parametrize(
    "kind, shapes, attrs, reason",
    [
        ("reshape", [(2, 3)], {}, "shape is required"),
        ("reshape", [(2, 3)], {"shape": (4, 2)}, r"cannot reshape \[2, 3\] \(6 elements\) to \[4, 2\] \(8 elements\)"),
        ("reshape", [(2, 3)], {"shape": (4, -1)}, r"cannot reshape \[2, 3\] \(6 elements\) to \[4, -1\]"),
        ("reshape", [(2, 3)], {"shape": (-1, -1)}, "at most one -1"),
        ("reshape", [(2, 3)], {"shape": (0, 6)}, "at most one -1"),
        ("transpose", [(2, 3, 4)], {"axes": (0, 1)}, "must name each of the 3 axes once"),
        ("transpose", [(2, 3, 4)], {"axes": (0, 1, 1)}, "names an axis twice"),
        ("transpose", [(2, 3, 4)], {"axes": (0, 1, 3)}, "axes 3 is out of range"),
        ("concat", [(2, 3), (3, 3)], {"axis": 1}, r"'in1' \[3, 3\] does not match \[2, 3\] outside axis 1"),
        ("concat", [(2, 3), (2, 3, 1)], {}, "does not match"),
        ("concat", [(2, 3), (2, 3)], {"axis": 2}, "axis 2 is out of range for a rank-2 tensor"),
        ("slice", [(4, 5)], {"begin": 1}, "begin and end are required"),
        ("slice", [(4, 5)], {"begin": 3, "end": 2}, "slice 3:2:1 of axis 0 .size 4. is empty"),
        ("slice", [(4, 5)], {"begin": [0, 1], "end": [2], "axis": [0, 1]}, "differ in length"),
        ("slice", [(4, 5)], {"begin": 0, "end": 2, "strides": 0}, "strides must be >= 1"),
        ("slice", [(4, 5)], {"begin": 0, "end": 2, "axis": 2}, "axis 2 is out of range"),
        ("slice", [(4,)], {"begin": [0, 0], "end": [1, 1]}, "2 slice bounds for a rank-1 tensor"),
        ("split", [(4, 6)], {"sections": 4, "axis": 1}, "sections=4 must be a positive int dividing axis 1 of size 6"),
        ("split", [(4, 6)], {"sizes": [2, 3]}, r"sizes \[2, 3\] sum to 5, not the size 4 of axis 0"),
        ("split", [(4, 6)], {}, "give exactly one of sections"),
        ("split", [(4, 6)], {"sections": 2, "sizes": [2, 2]}, "give exactly one of sections"),
        ("split", [(4, 6)], {"sections": 2, "axis": -3}, "axis -3 is out of range"),
        ("flatten", [(2, 3, 4)], {"start_dim": 2, "end_dim": 1}, "start_dim 2 comes after end_dim 1"),
        ("flatten", [(2, 3, 4)], {"start_dim": 3}, "start_dim 3 is out of range"),
    ],
)
def test_bad_shape_ops_are_refused(kind, shapes, attrs, reason):
    refuses(kind, shapes, reason, **attrs)


def test_concat_refuses_mixed_dtypes():
    refuses("concat", [(2, 3), (2, 3)], "inputs must share one dtype", dtypes=["float32", "int32"])


# -- pad, roll, take ------------------------------------------------------------------------------
@pytest.mark.parametrize("before, after, value", [([0, 1, 0], [0, 2, 3], 0.0), ([1, 0, 2], [0, 0, 1], -1.5)])
def test_pad(run_op, before, after, value):
    x = arange(2, 3, 4)
    torch_pad = [amount for axis in reversed(range(3)) for amount in (before[axis], after[axis])]
    expected = torch.nn.functional.pad(torch.from_numpy(x), torch_pad, value=value).numpy()
    np.testing.assert_array_equal(run_op("pad", [x], before=before, after=after, value=value), expected)


@pytest.mark.parametrize("shifts, axes", [([-1], [1]), ([-2, -2], [1, 2]), ([3, 1], [-2, 1]), ([5, -7], [2, 2]),
                                          ([4], [0])])
def test_roll(run_op, shifts, axes):
    """Two rolled axes at once included: TVM's flattening once dropped the second one's shift."""
    x = arange(2, 4, 5, 3)
    expected = torch.roll(torch.from_numpy(x), shifts, axes).numpy()
    np.testing.assert_array_equal(run_op("roll", [x], shifts=shifts, axes=axes), expected)


def test_two_axis_roll_through_the_compiler():
    """The roll of Swin's shifted windows, compiled as a whole graph (fused loops, flattened buffers)."""
    import souffle

    x = arange(1, 8, 8, 3)
    b = GraphBuilder("roll")
    y = b.op("roll", b.input("x", x.shape), shifts=[-2, -2], axes=[1, 2])
    for target in ("llvm", "llvm-persistent"):
        (got,) = souffle.compile(b.build(y), target=target).run({"x": x})
        np.testing.assert_array_equal(got, torch.roll(torch.from_numpy(x), (-2, -2), (1, 2)).numpy(), err_msg=target)


@pytest.mark.parametrize("axis, indices", [(0, [[4, 0], [-1, 2]]), (1, [2, 2, 0]), (-1, [[3], [-4]])])
def test_take(run_op, axis, indices):
    """torch.index_select / tensor[index]: negative indices count from the end."""
    x = arange(5, 3, 4)
    index = np.array(indices, dtype=np.int64)
    expected = np.take(x, index, axis=axis)
    np.testing.assert_array_equal(run_op("take", [x, index], axis=axis), expected)


def test_take_clamps_an_index_out_of_range(run_op):
    x = arange(4, 2)
    got = run_op("take", [x, np.array([9, -9], dtype=np.int32)], axis=0)
    np.testing.assert_array_equal(got, x[[3, 0]])


@pytest.mark.parametrize(
    "kind, shapes, dtypes, attrs, reason",
    [
        ("pad", [(2, 3)], None, {"before": [1], "after": [1]}, "one amount per axis"),
        ("pad", [(2, 3)], None, {"before": [0, -1], "after": [0, 0]}, "before must be >= 0"),
        ("pad", [(2, 3)], None, {"before": [0, 1], "after": [0, 0], "value": "x"}, "value must be a number"),
        ("roll", [(2, 3)], None, {"shifts": [1, 2], "axes": [0]}, "differ in length"),
        ("roll", [(2, 3)], None, {"shifts": [1], "axes": [2]}, "axis 2 is out of range"),
        ("take", [(2, 3), (4,)], ["float32", "float32"], {}, "indices must be int32 or int64"),
        ("take", [(2, 3), (4,)], ["float32", "int64"], {"axis": 2}, "axis 2 is out of range"),
    ],
)
def test_bad_pad_roll_take_are_refused(kind, shapes, dtypes, attrs, reason):
    refuses(kind, shapes, reason, dtypes=dtypes, **attrs)
