"""Neural-network ops with reductions: dense/matmul, convolution, normalization, pooling.

Every rule follows PyTorch's semantics (torch.nn.functional), so a model's
graph and its torch reference compute the same numbers.
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import te, topi

from souffle.ops.common import (
    ieee_constant,
    int_pair,
    is_int,
    nan_max,
    normalize_axes,
    normalize_axis,
    prod,
    require_bool,
    require_finite,
    require_float,
    require_rank,
    require_same_dtype,
    shape_of,
)
from souffle.ops.elementwise import broadcast_shape
from souffle.ops.registry import export_rule, fail, register_op
from souffle.tensor import NARROW_FLOATS


def _reshape(tensor: te.Tensor, shape) -> te.Tensor:
    """topi.reshape, skipped when the shape already matches (no needless copy stage)."""
    shape = tuple(int(d) for d in shape)
    return tensor if shape_of(tensor) == shape else topi.reshape(tensor, shape)


def _require_eps(attrs):
    require_finite(attrs, "eps")
    if attrs["eps"] < 0:
        fail(f"eps must be a non-negative number, got {attrs['eps']!r}")


# -- dense and matmul --------------------------------------------------------------------------
def _accumulator(operand: te.Tensor) -> str:
    """GEMM-shaped ops accumulate float16 and bfloat16 operands in float32 (``souffle.precision``)."""
    return "float32" if str(operand.dtype) in NARROW_FLOATS else str(operand.dtype)


def _rounded(result: te.Tensor, operand: te.Tensor) -> te.Tensor:
    """A float32 accumulation rounded back to its narrow operands' dtype."""
    return result if str(result.dtype) == str(operand.dtype) else topi.cast(result, str(operand.dtype))


def _scaled(product: te.Tensor, alpha: float) -> te.Tensor:
    """``alpha`` times a product, as cuBLAS's alpha: in its float32 accumulator, before any rounding
    to a narrow dtype, so a product past float16's range that ``alpha`` brings back stays finite."""
    return product if alpha == 1 else topi.multiply(product, tvm.tirx.const(alpha, str(product.dtype)))


def _dense(specs, attrs):
    x, w = specs[0], specs[1]
    require_rank(w, 2, "weight (out_features, in_features)")
    if x.shape[-1:] != w.shape[1:]:
        fail(f"input features {x.shape[-1:]} do not match weight in_features {w.shape[1]}")
    if len(specs) == 3 and specs[2].shape != (w.shape[0],):
        fail(f"bias must have shape [{w.shape[0]}], got {list(specs[2].shape)}")
    require_same_dtype(specs)
    _require_split(attrs["split_k"], w.shape[1], "in_features")
    return [(x.shape[:-1] + (w.shape[0],), x.dtype)]


def _require_split(parts, reduction: int, what: str, attr: str = "split_k") -> None:
    """``attr`` is a positive integer dividing the reduction (``what``, of ``reduction`` terms)."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or reduction % parts:
        fail(f"{attr} must be a positive integer dividing {what} {reduction}, got {parts!r}")


@register_op("dense", infer=_dense, n_inputs=(2, 3), attrs={"split_k": 1})
def dense(inputs, split_k):
    """y = x @ W.T (+ b), W laid out (out_features, in_features) as torch.nn.Linear.

    ``split_k`` > 1 computes the product as that many partial products over equal slices of
    in_features, in float32 where the operands are narrower, then their sum (with the bias):
    more independent tiles for a GEMM whose output alone would leave SMs idle
    (``codegen.split_k``). The same value up to float32 summation order."""
    x, w = inputs[0], inputs[1]
    lead = shape_of(x)[:-1]
    rows, bias = _reshape(x, (prod(lead), x.shape[-1])), inputs[2] if len(inputs) == 3 else None
    if split_k == 1:
        y = topi.nn.dense(rows, w, bias, out_dtype=_accumulator(x))
    else:
        y = _split_k_dense(rows, w, bias, split_k, _accumulator(x))
    return _reshape(_rounded(y, x), lead + (int(w.shape[0]),))


def _split_k_dense(x: te.Tensor, w: te.Tensor, bias: te.Tensor | None, parts: int, accumulator: str) -> te.Tensor:
    """x @ W.T as ``parts`` partial GEMMs ``[parts, M, N]`` over consecutive slices of K, then
    their sum over the parts (plus the bias): two TEs, the first GEMM-shaped with a batch axis."""
    (m, k), n = shape_of(x), int(w.shape[0])
    chunk = k // parts
    r = te.reduce_axis((0, chunk), name="k")
    partial = te.compute(
        (parts, m, n),
        lambda p, i, j: te.sum(x[i, p * chunk + r].astype(accumulator) * w[j, p * chunk + r].astype(accumulator), axis=r),
        name="T_matmul_NT_part", tag="dense")
    total = _sum_of_parts(partial, "T_matmul_NT_sum")
    return total if bias is None else topi.add(total, bias.astype(accumulator))


def _sum_of_parts(partial: te.Tensor, name: str) -> te.Tensor:
    """The partial products ``[parts, ...]`` of a split GEMM added up over their first axis, as
    one expression per element (no reduction: vertical inlining folds it into its consumer)."""
    parts = int(partial.shape[0])
    return te.compute(shape_of(partial)[1:],
                      lambda *i: functools.reduce(operator.add, (partial[(p, *i)] for p in range(parts))), name=name)


@export_rule("dense")
def _dense_onnx(e, inputs, outputs, attrs):
    """x @ W.T (+ b) as MatMul on W's shared transpose (``Emitter.transposed``) and Add; other
    ranks than 2 go through 2-D. (A per-use Gemm(transB=1) becomes a per-use transpose in TVM's
    frontend, which its constant folding copies for every unrolled step.)"""
    x, weight = inputs[:2]
    lead = e.shape(x)[:-1]
    rows = x if len(lead) == 1 else e.node("Reshape", [x, e.const([prod(lead), e.shape(x)[-1]])])
    last = len(inputs) == 2 and len(lead) == 1
    y = e.node("MatMul", [rows, e.transposed(weight)], outputs if last else e.fresh(f"{outputs[0]}.matmul"))
    if len(inputs) == 3:
        y = e.node("Add", [y, inputs[2]], outputs if len(lead) == 1 else e.fresh(f"{outputs[0]}.bias"))
    if len(lead) != 1:
        e.node("Reshape", [y, e.const([*lead, e.shape(weight)[0]])], outputs)


def _matmul(specs, attrs):
    a, b = specs
    require_bool(attrs, "transpose_b")
    require_finite(attrs, "alpha")
    require_same_dtype(specs)
    if len(a.shape) < 2 or len(b.shape) < 2:
        fail(f"a and b must each be at least 2-D, got shapes {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape[-2:]
    n, kb = b.shape[-2:] if attrs["transpose_b"] else reversed(b.shape[-2:])
    if k != kb:
        fail(f"a has {k} columns but b has {kb} rows (transpose_b={attrs['transpose_b']})")
    return [(broadcast_shape(a.shape[:-2], b.shape[:-2]) + (m, n), a.dtype)]


def _as_batch3(tensor: te.Tensor, batch: tuple[int, ...]) -> te.Tensor:
    """(..., R, C) as (B, R, C) for topi's batch_matmul; a batch of one is left to broadcast."""
    shape = shape_of(tensor)
    own = shape[:-2]
    if prod(own) == 1:
        return _reshape(tensor, (1,) + shape[-2:])
    if (1,) * (len(batch) - len(own)) + own != batch:
        tensor = topi.broadcast_to(tensor, batch + shape[-2:])
    return _reshape(tensor, (prod(batch),) + shape[-2:])


@register_op("matmul", infer=_matmul, n_inputs=2, attrs={"transpose_b": False, "alpha": 1.0})
def matmul(inputs, transpose_b, alpha):
    """torch.matmul for operands of rank >= 2, batch dimensions broadcast; times ``alpha``."""
    a, b = inputs
    if len(b.shape) == 2:
        # One shared right operand: a's batch dimensions fold into rows of one GEMM.
        lead = shape_of(a)[:-1]
        y = topi.nn.matmul(_reshape(a, (prod(lead), a.shape[-1])), b, transpose_b=transpose_b,
                           out_dtype=_accumulator(a))
        return _reshape(_rounded(_scaled(y, alpha), a), lead + shape_of(y)[-1:])
    batch = broadcast_shape(shape_of(a)[:-2], shape_of(b)[:-2])
    y = topi.nn.batch_matmul(_as_batch3(a, batch), _as_batch3(b, batch), transpose_b=transpose_b,
                             out_dtype=_accumulator(a))
    return _reshape(_rounded(_scaled(y, alpha), a), batch + shape_of(y)[1:])


def _swap_last_two(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


@export_rule("matmul")
def _matmul_onnx(e, inputs, outputs, attrs):
    """torch.matmul is ONNX MatMul (batch dimensions broadcast alike)."""
    a, b = inputs
    if attrs["transpose_b"]:
        b = e.node("Transpose", [b], perm=_swap_last_two(len(e.shape(b))))
    _matmul_times_alpha(e, a, b, outputs, attrs["alpha"])


def _matmul_times_alpha(e, a, b, outputs, alpha: float):
    """ONNX MatMul, then a Mul by ``alpha`` where it is not 1."""
    if alpha == 1:
        e.node("MatMul", [a, b], outputs)
    else:
        e.node("Mul", [e.node("MatMul", [a, b]), e.scalar(float(alpha), a)], outputs)


def _batch_matmul(specs, attrs):
    a, b = specs
    require_bool(attrs, "transpose_a", "transpose_b")
    require_finite(attrs, "alpha")
    require_rank(a, 3, "a")
    require_rank(b, 3, "b")
    require_same_dtype(specs)
    batch_a, m, k = (a.shape[0], a.shape[2], a.shape[1]) if attrs["transpose_a"] else a.shape
    batch_b, kb, n = (b.shape[0], b.shape[2], b.shape[1]) if attrs["transpose_b"] else b.shape
    if batch_a != batch_b:
        fail(f"batch sizes differ: {batch_a} and {batch_b}")
    if k != kb:
        fail(f"a has {k} columns but b has {kb} rows")
    return [((batch_a, m, n), a.dtype)]


@register_op("batch_matmul", infer=_batch_matmul, n_inputs=2,
             attrs={"transpose_a": False, "transpose_b": False, "alpha": 1.0})
def batch_matmul(inputs, transpose_a, transpose_b, alpha):
    """torch.bmm, with either operand optionally stored transposed; times ``alpha``."""
    a, b = inputs
    y = topi.nn.batch_matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=_accumulator(a))
    return _rounded(_scaled(y, alpha), a)


@export_rule("batch_matmul")
def _batch_matmul_onnx(e, inputs, outputs, attrs):
    a, b = inputs
    if attrs["transpose_a"]:
        a = e.node("Transpose", [a], perm=[0, 2, 1])
    if attrs["transpose_b"]:
        b = e.node("Transpose", [b], perm=[0, 2, 1])
    _matmul_times_alpha(e, a, b, outputs, attrs["alpha"])


# -- convolution -------------------------------------------------------------------------------
def _window_attrs(attrs):
    """stride, padding and dilation as (h, w) pairs; stride defaults to the kernel (pooling)."""
    kernel = int_pair(attrs["kernel"], "kernel", 1) if "kernel" in attrs else None
    stride = attrs["stride"] if attrs["stride"] is not None else kernel
    return (
        kernel,
        int_pair(stride, "stride", 1),
        int_pair(attrs["padding"], "padding", 0),
        int_pair(attrs.get("dilation", 1), "dilation", 1),
    )


def _window_count(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool = False) -> int:
    """Output length of a sliding window, torch's formula (ceil_mode drops a window
    that would start in the right padding)."""
    span = dilation * (kernel - 1) + 1
    if size + 2 * pad < span:
        fail(f"window of span {span} is larger than the padded input ({size} + 2 * {pad})")
    count = (size + 2 * pad - span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (count - 1) * stride >= size + pad:
        count -= 1
    return count


def _conv2d(specs, attrs):
    x, w = specs[0], specs[1]
    require_rank(x, 4, "input (N, C, H, W)")
    require_rank(w, 4, "weight (O, C/groups, R, S)")
    require_float(*specs)
    require_same_dtype(specs)
    _, stride, padding, dilation = _window_attrs(attrs)
    groups = attrs["groups"]
    if not is_int(groups) or groups < 1:
        fail(f"groups must be a positive int, got {groups!r}")
    n, c, h, wd = x.shape
    o, c_per_group, r, s = w.shape
    if c % groups or o % groups:
        fail(f"groups={groups} must divide both input channels {c} and output channels {o}")
    if c_per_group != c // groups:
        fail(f"weight has {c_per_group} input channels per group, expected {c // groups} ({c} channels / {groups} groups)")
    if len(specs) == 3 and specs[2].shape != (o,):
        fail(f"bias must have shape [{o}], got {list(specs[2].shape)}")
    out_h = _window_count(h, r, stride[0], padding[0], dilation[0])
    out_w = _window_count(wd, s, stride[1], padding[1], dilation[1])
    _require_split(attrs["split_k"], c, "the input channels")
    if attrs["split_k"] > 1 and not is_pointwise_gemm(w.shape, attrs):
        fail(f"split_k applies to a 1x1, stride-1, unpadded, ungrouped convolution (a GEMM over the channels); "
             f"this one has a {r}x{s} kernel, stride {list(stride)}, padding {list(padding)}, dilation "
             f"{list(dilation)} and {groups} groups")
    return [((n, o, out_h, out_w), x.dtype)]


def is_pointwise_gemm(weight_shape, attrs) -> bool:
    """Whether a convolution (its weight's shape, its attributes with their defaults) is a GEMM
    over its input channels as it stands: a 1x1 kernel at stride 1, unpadded and ungrouped (each
    output pixel one row, each output channel one column)."""
    _, stride, padding, dilation = _window_attrs(attrs)
    return (tuple(weight_shape[2:]) == (1, 1) and attrs["groups"] == 1
            and all(tuple(v) == (1, 1) for v in (stride, dilation)) and tuple(padding) == (0, 0))


@register_op("conv2d", infer=_conv2d, n_inputs=(2, 3),
             attrs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1, "split_k": 1})
def conv2d(inputs, stride, padding, dilation, groups, split_k):
    """torch.nn.functional.conv2d on NCHW input and OIHW weight, grouped and depthwise included.

    ``split_k`` > 1 (a 1x1, stride-1, unpadded, ungrouped convolution only) sums the input
    channels as that many partial products over equal slices of them, as ``dense``'s does."""
    x, w = inputs[0], inputs[1]
    _, stride, padding, dilation = _window_attrs({"stride": stride, "padding": padding, "dilation": dilation})
    channels, out_channels = int(x.shape[1]), int(w.shape[0])
    accumulator = _accumulator(x)
    if split_k > 1:
        y = _split_k_pointwise(x, w, split_k, accumulator)
    elif groups == 1:
        y = topi.nn.conv2d_nchw(x, w, stride, padding, dilation, out_dtype=accumulator)
    elif groups == channels:
        # torch's (C*m, 1, R, S) depthwise weight is topi's (C, m, R, S): channel c*m+q reads input c.
        filt = _reshape(w, (channels, out_channels // channels) + shape_of(w)[2:])
        y = topi.nn.depthwise_conv2d_nchw(x, filt, stride, padding, dilation, out_dtype=accumulator)
    else:
        y = _group_conv2d(x, w, groups, stride, padding, dilation, accumulator)
    if len(inputs) == 3:
        bias = inputs[2]
        y = te.compute(y.shape, lambda n, o, i, j: y[n, o, i, j] + bias[o].astype(accumulator), name="conv2d_bias")
    return _rounded(y, x)


def window_operand(x: te.Tensor, weight_shape, stride, padding, dilation, pad_name: str):
    """What a convolution of ``x`` (NCHW) by a weight of ``weight_shape`` ((O, C / groups, R, S),
    or packed with a last axis) reads: ``x`` padded (topi's pad, a TE of its own, or ``x``), the
    output's height and width, and the reduction axes over a group's channels and the window."""
    _, group_channels, r, s = weight_shape[:4]
    height, width = shape_of(x)[2:]
    out_h = _window_count(height, r, stride[0], padding[0], dilation[0])
    out_w = _window_count(width, s, stride[1], padding[1], dilation[1])
    ph, pw = padding
    padded = topi.nn.pad(x, (0, 0, ph, pw), (0, 0, ph, pw), name=pad_name) if ph or pw else x
    axes = (te.reduce_axis((0, group_channels), name="rc"), te.reduce_axis((0, r), name="ry"),
            te.reduce_axis((0, s), name="rx"))
    return padded, (out_h, out_w), axes


def _group_conv2d(x: te.Tensor, w: te.Tensor, groups: int, stride, padding, dilation,
                  accumulator: str) -> te.Tensor:
    """A grouped convolution as a batch of GEMMs over its groups, ``[N, groups, O / groups, H, W]``
    (each group's output pixels the rows, its output channels the columns, its input channels
    times the window the terms), read back as NCHW: the group an explicit axis, so that dlight's
    GEMM rules (``codegen.tensor_core``) see a batched matmul where topi's ``group_conv2d_nchw``
    reads the input at ``o // (O / groups)``, which they take for no GEMM. The padding is topi's,
    a TE of its own that the ``vertical`` pass inlines."""
    (sh, sw), (dh, dw) = stride, dilation
    batch = shape_of(x)[0]
    out_channels, group_channels = shape_of(w)[:2]
    group_outputs = out_channels // groups
    padded, (out_h, out_w), (rc, ry, rx) = window_operand(x, shape_of(w), stride, padding, dilation,
                                                           "group_conv2d_pad")
    grouped = te.compute(
        (batch, groups, group_outputs, out_h, out_w),
        lambda b, g, j, i, k: te.sum(
            padded[b, g * group_channels + rc, i * sh + ry * dh, k * sw + rx * dw].astype(accumulator)
            * w[g * group_outputs + j, rc, ry, rx].astype(accumulator),
            axis=[rc, ry, rx],
        ),
        name="group_conv2d_nchw", tag="group_conv2d_nchw",
    )
    return te.compute((batch, out_channels, out_h, out_w),
                      lambda b, o, i, k: grouped[b, o // group_outputs, o % group_outputs, i, k],
                      name="group_conv2d_channels")


def _split_k_pointwise(x: te.Tensor, w: te.Tensor, parts: int, accumulator: str) -> te.Tensor:
    """A 1x1 convolution as ``parts`` partial products ``[parts, N, O, H, W]`` over consecutive
    slices of the input channels, then their sum: ``_split_k_dense``'s two TEs in NCHW."""
    (batch, channels, height, width), out_channels = shape_of(x), int(w.shape[0])
    chunk = channels // parts
    r = te.reduce_axis((0, chunk), name="rc")
    partial = te.compute(
        (parts, batch, out_channels, height, width),
        lambda p, n, o, i, j: te.sum(x[n, p * chunk + r, i, j].astype(accumulator)
                                     * w[o, p * chunk + r, 0, 0].astype(accumulator), axis=r),
        name="conv2d_part", tag="conv2d_nchw")
    return _sum_of_parts(partial, "conv2d_sum")


@export_rule("conv2d")
def _conv2d_onnx(e, inputs, outputs, attrs):
    _, stride, padding, dilation = _window_attrs(attrs)
    e.node(
        "Conv", inputs, outputs, kernel_shape=list(e.shape(inputs[1])[2:]), strides=list(stride),
        pads=[*padding, *padding], dilations=list(dilation), group=int(attrs["groups"]),
    )


# -- normalization -----------------------------------------------------------------------------
def _batch_norm(specs, attrs):
    x = specs[0]
    if len(x.shape) < 2:
        fail(f"input must be at least 2-D (N, C, ...), got shape {list(x.shape)}")
    require_float(*specs)
    require_same_dtype(specs)
    _require_eps(attrs)
    for spec in specs[1:]:
        if spec.shape != (x.shape[1],):
            fail(f"{spec.name!r} must have shape [{x.shape[1]}] (one value per channel), got {list(spec.shape)}")
    return [(x.shape, x.dtype)]


@register_op("batch_norm", infer=_batch_norm, n_inputs=5, attrs={"eps": 1e-5}, widen=True)
def batch_norm(inputs, eps):
    """Inference batch norm over axis 1 with running statistics (torch's eval mode)."""
    return topi.nn.batch_norm(*inputs, axis=1, epsilon=float(eps))[0]


@export_rule("batch_norm")
def _batch_norm_onnx(e, inputs, outputs, attrs):
    """Inference mode: (x - mean) / sqrt(var + eps) * gamma + beta; ONNX takes the same input order."""
    e.node("BatchNormalization", inputs, outputs, epsilon=float(attrs["eps"]))


def _layer_norm(specs, attrs):
    x = specs[0]
    if not x.shape:
        fail("input must be at least 1-D")
    require_float(*specs)
    require_same_dtype(specs)
    _require_eps(attrs)
    for spec in specs[1:]:
        if spec.shape != x.shape[-1:]:
            fail(f"{spec.name!r} must have shape {list(x.shape[-1:])} (the last dimension), got {list(spec.shape)}")
    return [(x.shape, x.dtype)]


@register_op("layer_norm", infer=_layer_norm, n_inputs=3, attrs={"eps": 1e-5}, widen=True)
def layer_norm(inputs, eps):
    """torch.nn.LayerNorm over the last dimension (biased variance), by the corrected two-pass
    algorithm (Chan, Golub and LeVeque): the mean m, then the sums of d = x - m and of d^2; the
    correction c = sum(d) / n repairs m's rounding and var = sum(d^2) / n - c^2.

    topi's layer_norm is the plain two-pass form (mean, then the sum of (x - mean)^2): the float32
    mean's rounding stays in every x - mean and 1/sqrt(var + eps) (316 at eps 1e-5) scales it
    up, so a near-constant row came out 7e-4 off a float64 reference (fuzz seed 1795450603).
    With the correction, the regression test's row is 2.3e-8 off, as torch's float32 is.

    The two sums are one reduction over a [rows, 2] output (its last axis picks d or d^2), so
    the warp_reduce template computes them side by side, two warps a row, in one pass over the
    row: on a GPU each pass is a trip through L2 (as separate reductions, paper BERT fp16's
    LayerNorm read each row four times, 8.2 us a LayerNorm on an H100). The one-pass moments
    about x[0] would save the mean's pass too, but where x[0] is the row's outlier they cancel
    up to n ulps of the variance (8.5e-4 off float64 at n = 768, where this form is 1.2e-7)."""
    x, gamma, beta = inputs
    *rows, width = shape_of(x)
    n = tvm.tirx.const(float(width), x.dtype)
    k = te.reduce_axis((0, width), "k")
    row_sum = te.compute(rows, lambda *r: te.sum(x[(*r, k)], axis=k), name="layer_norm_sum")

    def deviation(r, j):
        return x[(*r, j)] - row_sum[r] / n

    kd = te.reduce_axis((0, width), "kd")
    def moment(i):
        d = deviation(i[:-1], kd)
        return tvm.tirx.Select(i[-1] == 0, d, d * d)

    moments = te.compute((*rows, 2), lambda *i: te.sum(moment(i), axis=kd), name="layer_norm_moments")
    epsilon = tvm.tirx.const(float(eps), x.dtype)

    def normalized(i):
        r = i[:-1]
        correction = moments[(*r, 0)] / n
        variance = moments[(*r, 1)] / n - correction * correction
        return (deviation(r, i[-1]) - correction) * tvm.tirx.rsqrt(variance + epsilon)

    return te.compute(x.shape, lambda *i: normalized(i) * gamma[i[-1]] + beta[i[-1]], name="layer_norm")


@export_rule("layer_norm")
def _layer_norm_onnx(e, inputs, outputs, attrs):
    e.node("LayerNormalization", inputs, outputs, axis=-1, epsilon=float(attrs["eps"]))


def _softmax(specs, attrs):
    require_float(specs[0])
    normalize_axis(attrs["axis"], len(specs[0].shape))
    return [(specs[0].shape, specs[0].dtype)]


@register_op("softmax", infer=_softmax, n_inputs=1, attrs={"axis": -1}, widen=True)
def softmax(inputs, axis):
    """torch.softmax. A NaN or +inf in a row makes some exp(x - max) NaN (NaN - max, inf - inf),
    so the row's sum and all of its outputs are NaN, as in torch; the max itself need not
    propagate NaN, and a row of -inf is 0 / 0 = NaN too."""
    x = inputs[0]
    return topi.nn.softmax(x, axis=normalize_axis(axis, len(x.shape)))


@export_rule("softmax")
def _softmax_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Softmax", [x], outputs, axis=normalize_axis(attrs["axis"], len(e.shape(x))))


# -- pooling and reductions --------------------------------------------------------------------
def _pool2d(specs, attrs):
    x = specs[0]
    require_rank(x, 4, "input (N, C, H, W)")
    require_float(x)
    if attrs["kernel"] is None:
        fail("kernel is required")
    require_bool(attrs, *(k for k in ("ceil_mode", "count_include_pad") if k in attrs))
    kernel, stride, padding, dilation = _window_attrs(attrs)
    out = []
    for i in range(2):
        span = dilation[i] * (kernel[i] - 1) + 1
        if padding[i] > span // 2:
            fail(f"padding {padding[i]} must be at most half the kernel size {span}")
        out.append(_window_count(x.shape[2 + i], kernel[i], stride[i], padding[i], dilation[i], attrs["ceil_mode"]))
    return [(x.shape[:2] + tuple(out), x.dtype)]


def _onnx_pool_window(e, x: str, attrs) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(kernel, stride, begin pads, end pads, dilation) giving torch's output size with ceil_mode
    off: a ceil_mode window becomes explicit end padding, so the size never rests on how an ONNX
    implementation reads ceil_mode (torch drops a window that would start in the right padding)."""
    kernel, stride, padding, dilation = _window_attrs(attrs)
    end = []
    for i, size in enumerate(e.shape(x)[2:]):
        count = _window_count(size, kernel[i], stride[i], padding[i], dilation[i], attrs["ceil_mode"])
        span = dilation[i] * (kernel[i] - 1) + 1
        end.append(max(padding[i], (count - 1) * stride[i] + span - size - padding[i]))
    return list(kernel), list(stride), list(padding), end, list(dilation)


_NAN_MAX = te.comm_reducer(nan_max, lambda dtype: ieee_constant(float("-inf"), dtype), name="nan_max")
"""torch's max reduction: NaN if any element is NaN; it starts from -inf, so a window of -inf gives -inf."""


@register_op(
    "max_pool2d", infer=_pool2d, n_inputs=1,
    attrs={"kernel": None, "stride": None, "padding": 0, "dilation": 1, "ceil_mode": False},
)
def max_pool2d(inputs, **attrs):
    """torch.nn.functional.max_pool2d: a window holding a NaN gives NaN, padding is -inf.

    topi's pool takes TVM's max, which drops NaN, and pads and starts from the lowest finite
    float, which beats a window of -inf."""
    x = inputs[0]
    kernel, stride, padding, dilation = _window_attrs(attrs)
    sizes = shape_of(x)[2:]
    out, end_padding = [], []
    for i, size in enumerate(sizes):
        out.append(_window_count(size, kernel[i], stride[i], padding[i], dilation[i], attrs["ceil_mode"]))
        last_window_end = (out[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1
        end_padding.append(max(0, last_window_end - padding[i] - size))
    if any(padding) or any(end_padding):
        x = topi.nn.pad(x, (0, 0, *padding), (0, 0, *end_padding), pad_value=ieee_constant(float("-inf"), str(x.dtype)),
                        name="pad_temp")
    ry, rx = te.reduce_axis((0, kernel[0]), name="ry"), te.reduce_axis((0, kernel[1]), name="rx")
    (sh, sw), (dh, dw) = stride, dilation
    return te.compute(
        shape_of(x)[:2] + tuple(out),
        lambda n, c, i, j: _NAN_MAX(x[n, c, i * sh + ry * dh, j * sw + rx * dw], axis=[ry, rx]),
        name="pool_max",
    )


@export_rule("max_pool2d")
def _max_pool2d_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    kernel, stride, begin, end, dilation = _onnx_pool_window(e, x, attrs)
    e.node("MaxPool", [x], outputs, kernel_shape=kernel, strides=stride, pads=begin + end, dilations=dilation)


@register_op(
    "avg_pool2d", infer=_pool2d, n_inputs=1,
    attrs={"kernel": None, "stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True}, widen=True,
)
def avg_pool2d(inputs, **attrs):
    """torch.nn.functional.avg_pool2d, including its divisor for windows clipped by ceil_mode."""
    kernel, stride, padding, dilation = _window_attrs(attrs)
    return topi.nn.pool2d(
        inputs[0], kernel, stride, dilation, padding + padding, "avg",
        ceil_mode=attrs["ceil_mode"], count_include_pad=attrs["count_include_pad"],
    )


@export_rule("avg_pool2d")
def _avg_pool2d_onnx(e, inputs, outputs, attrs):
    """torch's divisor counts the padding but not a ceil_mode window's overhang past it: then the
    padding is explicit zeros, and the pool counts only what is left."""
    (x,) = inputs
    kernel, stride, begin, end, _ = _onnx_pool_window(e, x, attrs)
    include = attrs["count_include_pad"]
    if include and end != begin:
        x = e.node("Pad", [x, e.const([0, 0, *begin, 0, 0, *begin])])
        begin, end, include = [0, 0], [b - a for a, b in zip(begin, end)], False
    e.node(
        "AveragePool", [x], outputs, kernel_shape=kernel, strides=stride, pads=begin + end,
        count_include_pad=int(include),
    )


def _global_avg_pool2d(specs, attrs):
    x = specs[0]
    require_rank(x, 4, "input (N, C, H, W)")
    require_float(x)
    return [(x.shape[:2] + (1, 1), x.dtype)]


@register_op("global_avg_pool2d", infer=_global_avg_pool2d, n_inputs=1, widen=True)
def global_avg_pool2d(inputs):
    """(N, C, H, W) -> (N, C, 1, 1), as torch.nn.AdaptiveAvgPool2d(1): the mean over H and W,
    lowered as ``mean`` is, so a model that pools (a hand-built ResNeXt, ONNX's
    GlobalAveragePool) and one that takes the mean (torchvision's forward once exported) compile
    to the same TEs. (topi's global_pool divides by a window size it computes per element, which
    TVM leaves unsimplified on a 1x1 map, where a division by the constant 1 is dropped.)"""
    return mean(inputs, (2, 3), True)


@export_rule("global_avg_pool2d")
def _global_avg_pool2d_onnx(e, inputs, outputs, attrs):
    e.node("GlobalAveragePool", inputs, outputs)


def _mean_axes(rank: int, axes) -> tuple[int, ...]:
    return tuple(range(rank)) if axes is None else normalize_axes(axes, rank)


def trailing_mean_axes(rank: int, axes) -> int | None:
    """How many axes a ``mean`` over ``axes`` of a rank-``rank`` input reduces, where they are its
    last ones (what ``split`` applies to); None where they are not."""
    reduced = sorted(_mean_axes(rank, axes))
    return len(reduced) if reduced == list(range(rank - len(reduced), rank)) else None


def _mean(specs, attrs):
    x = specs[0]
    if not x.shape:
        fail("input must be at least 1-D")
    require_float(x)
    require_bool(attrs, "keepdims")
    axes = _mean_axes(len(x.shape), attrs["axes"])
    parts = attrs.get("split", 1)
    if parts != 1:
        if trailing_mean_axes(len(x.shape), attrs["axes"]) is None:
            fail(f"split applies to a reduction over the last axes, got axes {list(axes)} of a rank-{len(x.shape)} input")
        _require_split(parts, prod(x.shape[a] for a in axes), "the reduced elements", "split")
    if attrs["keepdims"]:
        return [(tuple(1 if i in axes else d for i, d in enumerate(x.shape)), x.dtype)]
    return [(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


@register_op("mean", infer=_mean, n_inputs=1, attrs={"axes": None, "keepdims": False, "split": 1}, widen=True)
def mean(inputs, axes, keepdims, split=1):
    """torch.mean over ``axes`` (all axes when None): a sum, then one division.

    ``split`` > 1 (``axes`` the last axes) sums that many equal runs of the reduced elements, in
    row-major order, each a partial sum of its own, then the partial sums: ``split`` times the
    outputs for a reduction whose outputs alone would leave SMs idle (``codegen.split_k``: paper
    EfficientNet's first squeeze, 32 means of 12544 elements, 4 tiles). The same value up to
    float32 summation order."""
    x = inputs[0]
    axes = _mean_axes(len(x.shape), axes)
    count = prod(x.shape[a] for a in axes)
    total = topi.sum(x, axis=list(axes), keepdims=keepdims) if split == 1 else _split_sum(x, len(axes), keepdims, split)
    return topi.divide(total, tvm.tirx.const(count, x.dtype))


def _split_sum(x: te.Tensor, reduced: int, keepdims: bool, parts: int) -> te.Tensor:
    """The sum over ``x``'s last ``reduced`` axes as ``parts`` partial sums of equal runs of its
    elements, then their sum."""
    shape = shape_of(x)
    lead, trailing = shape[:len(shape) - reduced], shape[len(shape) - reduced:]
    run = prod(trailing) // parts

    def element(outer, flat):
        index = []
        for extent in reversed(trailing):
            index.append(flat % extent)
            flat = flat // extent
        return x(*outer, *reversed(index))

    term = te.reduce_axis((0, run), "term")
    partial = te.compute(lead + (parts,), lambda *i: te.sum(element(i[:-1], i[-1] * run + term.var), axis=term),
                         name=f"{x.op.name}_partial_sums")
    part = te.reduce_axis((0, parts), "part")
    return te.compute(lead + (1,) * reduced * keepdims,
                      lambda *i: te.sum(partial(*i[:len(lead)], part.var), axis=part), name=f"{x.op.name}_red")


@export_rule("mean")
def _mean_onnx(e, inputs, outputs, attrs):
    """ReduceMean takes its axes as an attribute up to opset 17 and as an input from 18."""
    (x,) = inputs
    axes = list(_mean_axes(len(e.shape(x)), attrs["axes"]))
    keepdims = int(attrs["keepdims"])
    if e.opset >= 18:
        e.node("ReduceMean", [x, e.const(axes)], outputs, keepdims=keepdims)
    else:
        e.node("ReduceMean", [x], outputs, axes=axes, keepdims=keepdims)


@register_op("sum", infer=_mean, n_inputs=1, attrs={"axes": None, "keepdims": False}, widen=True)
def sum_op(inputs, axes, keepdims):
    """torch.sum over ``axes`` (all axes when None)."""
    x = inputs[0]
    return topi.sum(x, axis=list(_mean_axes(len(x.shape), axes)), keepdims=keepdims)


@export_rule("sum")
def _sum_onnx(e, inputs, outputs, attrs):
    """ReduceSum takes its axes as an input from opset 13."""
    (x,) = inputs
    axes = list(_mean_axes(len(e.shape(x)), attrs["axes"]))
    e.node("ReduceSum", [x, e.const(axes)], outputs, keepdims=int(attrs["keepdims"]))


# -- lookup ------------------------------------------------------------------------------------
def _embedding(specs, attrs):
    table, ids = specs
    require_rank(table, 2, "table (num_embeddings, embedding_dim)")
    require_float(table)
    if ids.dtype not in ("int32", "int64"):
        fail(f"ids must be int32 or int64, got {ids.dtype}")
    return [(ids.shape + table.shape[1:], table.dtype)]


@register_op("embedding", infer=_embedding, n_inputs=2)
def embedding(inputs):
    """Rows of ``table`` (V, D) picked by ``ids`` of any shape, as torch.nn.functional.embedding.

    Unlike torch, which raises IndexError, an out-of-range id is clamped into [0, V): a kernel
    cannot raise, and a clamped id cannot read outside the table."""
    table, ids = inputs
    return topi.take(table, ids, axis=0, mode="clip")


@export_rule("embedding")
def _embedding_onnx(e, inputs, outputs, attrs):
    """Ids are clamped into [0, V) first, as the lowering's take(mode="clip") does: ONNX Gather
    would wrap a negative id and reject one past the end."""
    table, ids = inputs
    low, high = e.const(0, e.dtype(ids)), e.const(e.shape(table)[0] - 1, e.dtype(ids))
    e.node("Gather", [table, e.node("Clip", [ids, low, high])], outputs, axis=0)
