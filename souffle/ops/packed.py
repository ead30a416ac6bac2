"""Dense and convolution on weights re-laid out at compile time for vector units.

``dense`` reads ``W[n, k]`` and ``conv2d`` reads ``W[o, c, r, s]``: a CPU schedule that
vectorizes over output features would walk the weight with a stride of a whole row.
The packed ops read ``Wp[n // B, k, n % B]`` (and ``Wp[o // B, c, r, s, o % B]``),
so ``B`` consecutive output features are adjacent in memory. ``pack_rows`` makes the
packed array from the original one (``codegen.cpu_transforms`` rewrites the graph);
the results are bit-for-bit those of the unpacked op with the same summation order, at every
precision: float16 and bfloat16 operands accumulate in float32 and round once, as the
unpacked ops do (``souffle.precision``).
"""

from __future__ import annotations

import numpy as np
from tvm import te, topi

from souffle.ops.common import is_int, prod, require_float, require_rank, require_same_dtype, shape_of
from souffle.ops.nn import _accumulator, _rounded, _window_attrs, window_operand
from souffle.ops.nn import _conv2d as conv2d_rule
from souffle.ops.registry import fail, register_op


def pack_rows(weight: np.ndarray, block: int) -> np.ndarray:
    """(N, ...) -> (N // block, ..., block): row n becomes [n // block, ..., n % block]."""
    rows = weight.shape[0]
    if rows % block:
        raise ValueError(f"{rows} rows do not split into blocks of {block}")
    split = weight.reshape((rows // block, block) + weight.shape[1:])
    return np.ascontiguousarray(np.moveaxis(split, 1, -1))


def _unpacked_shape(packed: tuple[int, ...]) -> tuple[int, ...]:
    return (packed[0] * packed[-1],) + packed[1:-1]


def _dense_packed(specs, attrs):
    x, w = specs[0], specs[1]
    require_rank(w, 3, "packed weight (out_features / B, in_features, B)")
    require_same_dtype(specs)
    out_features, in_features = _unpacked_shape(w.shape)
    if x.shape[-1] != in_features:
        fail(f"input features {x.shape[-1]} do not match packed weight in_features {in_features}")
    if len(specs) == 3 and specs[2].shape != (out_features,):
        fail(f"bias must have shape [{out_features}], got {list(specs[2].shape)}")
    return [(x.shape[:-1] + (out_features,), x.dtype)]


@register_op("dense_packed", infer=_dense_packed, n_inputs=(2, 3))
def dense_packed(inputs):
    """y = x @ W.T (+ b) with W given packed as Wp[n // B, k, n % B]."""
    x, wp = inputs[0], inputs[1]
    lead = shape_of(x)[:-1]
    blocks, in_features, block = shape_of(wp)
    x2 = topi.reshape(x, (prod(lead), in_features)) if len(lead) != 1 else x
    k = te.reduce_axis((0, in_features), name="k")
    acc = _accumulator(x)
    y = te.compute(
        (prod(lead), blocks * block),
        lambda i, j: te.sum(x2[i, k].astype(acc) * wp[j // block, k, j % block].astype(acc), axis=k),
        name="dense_packed",
    )
    if len(inputs) == 3:
        bias = inputs[2]
        y = te.compute(y.shape, lambda i, j: y[i, j] + bias[j].astype(acc), name="dense_packed_bias")
    y = _rounded(y, x)
    return topi.reshape(y, lead + (blocks * block,)) if len(lead) != 1 else y


def _conv2d_packed(specs, attrs):
    x, w = specs[0], specs[1]
    require_rank(w, 5, "packed weight (O / B, C / groups, R, S, B)")
    require_float(*specs)
    unpacked = type(w)(w.name, _unpacked_shape(w.shape), w.dtype)
    return conv2d_rule([x, unpacked] + list(specs[2:]), {**attrs, "split_k": 1})  # the CPU's packed conv is whole


@register_op(
    "conv2d_packed", infer=_conv2d_packed, n_inputs=(2, 3),
    attrs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1},
)
def conv2d_packed(inputs, stride, padding, dilation, groups):
    """conv2d (NCHW) with the OIHW weight given packed as Wp[o // B, c, r, s, o % B]."""
    x, wp = inputs[0], inputs[1]
    if not is_int(groups):
        fail(f"groups must be an int, got {groups!r}")
    _, stride, padding, dilation = _window_attrs({"stride": stride, "padding": padding, "dilation": dilation})
    (sh, sw), (dh, dw) = stride, dilation
    n = shape_of(x)[0]
    blocks, group_channels, _, _, block = shape_of(wp)
    out_channels = blocks * block
    group_outputs = out_channels // groups
    padded, (out_h, out_w), (rc, ry, rx) = window_operand(x, shape_of(wp), stride, padding, dilation,
                                                           "conv2d_packed_pad")

    def channel(o):
        return rc if groups == 1 else o // group_outputs * group_channels + rc

    acc = _accumulator(x)
    y = te.compute(
        (n, out_channels, out_h, out_w),
        lambda b, o, i, j: te.sum(
            padded[b, channel(o), i * sh + ry * dh, j * sw + rx * dw].astype(acc)
            * wp[o // block, rc, ry, rx, o % block].astype(acc),
            axis=[rc, ry, rx],
        ),
        name="conv2d_packed",
    )
    if len(inputs) == 3:
        bias = inputs[2]
        y = te.compute(y.shape, lambda b, o, i, j: y[b, o, i, j] + bias[o].astype(acc), name="conv2d_packed_bias")
    return _rounded(y, x)
