"""ONNX op type -> souffle ops: the conversion rules of ``from_onnx``, one table.

A rule is ``rule(ctx, inputs, attrs)``: ``inputs`` are the node's values in order (a graph
``Tensor``, a ``Constant`` numpy array known at import time, or None for an omitted optional
input), ``attrs`` its attributes as Python values. It adds ops through ``ctx.op`` and returns
the node's value (a tuple for several outputs). Adding an ONNX op type is one ``@rule`` here.
"""

from __future__ import annotations

import math

import numpy as np

from souffle.importers import recurrent
from souffle.importers.rows import constant_rows
from souffle.importers.sums import is_short_sum, sum_of_slices
from souffle.tensor import is_float

RULES: dict[str, object] = {}

# Op types computed by their rule even on constant inputs (their rules make the right op): a
# gather of a weight table's rows by constant indices stays a slice of the weight, not a copy;
# GatherElements is computed by numpy, which onnx's reference evaluator cannot always do.
NOT_FOLDED: frozenset[str] = frozenset({"Gather", "GatherElements"})


def rule(*op_types: str):
    def decorate(fn):
        for op_type in op_types:
            if op_type in RULES:
                raise ValueError(f"ONNX {op_type} has two conversion rules")
            RULES[op_type] = fn
        return fn

    return decorate


def _constant(ctx, value, what: str) -> np.ndarray:
    if not ctx.is_constant(value):
        ctx.fail(f"{what} must be known at import time")
    return np.asarray(value.value)


def _ints(ctx, value, what: str) -> list[int]:
    return [int(v) for v in _constant(ctx, value, what).reshape(-1)]


def _scalar(ctx, value):
    """The number a constant one-element tensor holds, or None."""
    if ctx.is_constant(value) and value.value.size == 1:
        return value.value.reshape(-1)[0].item()
    return None


# -- elementwise ---------------------------------------------------------------------------------
for _op_type, _kind in {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf", "Exp": "exp",
                        "Log": "log", "Sqrt": "sqrt", "Neg": "neg", "Abs": "abs", "HardSwish": "hardswish"}.items():
    def _unary(ctx, inputs, attrs, kind=_kind):
        return ctx.op(kind, inputs[0])

    rule(_op_type)(_unary)


@rule("Identity", "Dropout")
def _identity(ctx, inputs, attrs):
    return inputs[0]


@rule("Add", "Sub", "Mul", "Div")
def _binary(ctx, inputs, attrs):
    kind = ctx.node.op_type.lower()
    a, b = inputs
    factor = _scalar(ctx, b)
    if kind in ("mul", "div") and factor is not None and is_float(ctx.dtype(a)) and \
            len(ctx.shape(b)) <= len(ctx.shape(a)) and factor != 0:
        return ctx.op("scale", a, factor=float(factor if kind == "mul" else 1.0 / factor))
    if kind == "add":
        for product, bias in ((a, b), (b, a)):
            if not ctx.is_constant(product) and product.name in ctx.unbiased_products and ctx.is_constant(bias) \
                    and ctx.shape(bias) == ctx.shape(product)[-1:]:
                return ctx.op("dense", *ctx.unbiased_products[product.name], bias)
    return ctx.op(kind, a, b)


@rule("Reciprocal")
def _reciprocal(ctx, inputs, attrs):
    (x,) = inputs
    one = ctx.op("full", shape=(1,), value=1.0, dtype=ctx.dtype(x))
    return ctx.op("div", one, x)


@rule("Pow")
def _pow(ctx, inputs, attrs):
    exponent = _scalar(ctx, inputs[1])
    if exponent is None:
        ctx.fail("only a constant scalar exponent is supported")
    return ctx.op("pow", inputs[0], exponent=float(exponent))


@rule("Gelu")
def _gelu(ctx, inputs, attrs):
    return ctx.op("gelu_tanh" if attrs.get("approximate", b"none") in (b"tanh", "tanh") else "gelu", inputs[0])


@rule("HardSigmoid")
def _hardsigmoid(ctx, inputs, attrs):
    if not (math.isclose(attrs.get("alpha", 0.2), 1 / 6, rel_tol=1e-6) and math.isclose(attrs.get("beta", 0.5), 0.5)):
        ctx.fail("only torch's hardsigmoid (alpha 1/6, beta 0.5) is supported")
    return ctx.op("hardsigmoid", inputs[0])


@rule("Clip")
def _clip(ctx, inputs, attrs):
    x, low, high = (list(inputs) + [None, None])[:3]
    bounds = [None if v is None else _scalar(ctx, v) for v in (low, high)]
    if any(v is not None and b is None for v, b in zip((low, high), bounds)):
        ctx.fail("only constant bounds are supported")
    return ctx.op("clamp", x, min=bounds[0], max=bounds[1])


_DTYPES = {1: "float32", 6: "int32", 7: "int64", 10: "float16", 16: "bfloat16"}


@rule("Cast")
def _cast(ctx, inputs, attrs):
    if attrs["to"] == _BOOL:
        return _truth(ctx, inputs[0])
    dtype = _DTYPES.get(attrs["to"])
    if dtype is None:
        ctx.fail(f"cast to ONNX type {attrs['to']} is not supported")
    return inputs[0] if ctx.dtype(inputs[0]) == dtype else ctx.op("cast", inputs[0], dtype=dtype)


# -- shapes --------------------------------------------------------------------------------------
def _reshaped(ctx, x, shape):
    return ctx.reshape(x, shape)


@rule("Reshape")
def _reshape(ctx, inputs, attrs):
    x, shape = inputs
    dims = _ints(ctx, shape, "the shape")
    if not attrs.get("allowzero", 0):
        dims = [ctx.shape(x)[i] if d == 0 else d for i, d in enumerate(dims)]
    known = math.prod(d for d in dims if d != -1)
    dims = [math.prod(ctx.shape(x)) // known if d == -1 else d for d in dims]
    return _reshaped(ctx, x, dims)


@rule("Flatten")
def _flatten(ctx, inputs, attrs):
    shape = ctx.shape(inputs[0])
    axis = attrs.get("axis", 1) % (len(shape) + 1) if shape else 0
    return _reshaped(ctx, inputs[0], (math.prod(shape[:axis]), math.prod(shape[axis:])))


def _axes(ctx, inputs, attrs) -> list[int] | None:
    """Axes given as an input (opset 13 on for Squeeze/Unsqueeze/ReduceSum, 18 on for the others) or an attribute."""
    if len(inputs) > 1 and inputs[1] is not None:
        return _ints(ctx, inputs[1], "the axes")
    return list(attrs["axes"]) if "axes" in attrs else None


@rule("Unsqueeze")
def _unsqueeze(ctx, inputs, attrs):
    shape = list(ctx.shape(inputs[0]))
    rank = len(shape) + len(_axes(ctx, inputs, attrs))
    for axis in sorted(a % rank for a in _axes(ctx, inputs, attrs)):
        shape.insert(axis, 1)
    return _reshaped(ctx, inputs[0], shape)


@rule("Squeeze")
def _squeeze(ctx, inputs, attrs):
    shape = ctx.shape(inputs[0])
    axes = _axes(ctx, inputs, attrs)
    axes = {a % len(shape) for a in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
    return _reshaped(ctx, inputs[0], [d for i, d in enumerate(shape) if i not in axes])


@rule("Transpose")
def _transpose(ctx, inputs, attrs):
    return ctx.op("transpose", inputs[0], axes=list(attrs["perm"]) if "perm" in attrs else None)


@rule("Expand")
def _expand(ctx, inputs, attrs):
    x, shape = inputs
    dims = _ints(ctx, shape, "the shape")
    own = ctx.shape(x)
    rank = max(len(own), len(dims))
    own, dims = (1,) * (rank - len(own)) + own, [1] * (rank - len(dims)) + dims
    target = [max(a, b) for a, b in zip(own, dims)]
    x = _reshaped(ctx, x, own)
    return x if list(own) == target else ctx.op("expand", x, shape=target)


@rule("Concat")
def _concat(ctx, inputs, attrs):
    return ctx.op("concat", *inputs, axis=attrs["axis"])


@rule("Slice")
def _slice(ctx, inputs, attrs):
    x = inputs[0]
    starts, ends = _ints(ctx, inputs[1], "starts"), _ints(ctx, inputs[2], "ends")
    rank = len(ctx.shape(x))
    axes = _ints(ctx, inputs[3], "axes") if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
    steps = _ints(ctx, inputs[4], "steps") if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    if any(s < 1 for s in steps):
        ctx.fail("negative slice steps are not supported")
    axes = [a % rank for a in axes]
    ends = [min(e, ctx.shape(x)[a]) for e, a in zip(ends, axes)]
    return ctx.op("slice", x, begin=starts, end=ends, axis=axes, strides=steps)


@rule("Split")
def _split(ctx, inputs, attrs):
    x = inputs[0]
    axis = attrs.get("axis", 0)
    if len(inputs) > 1 and inputs[1] is not None:
        sizes = _ints(ctx, inputs[1], "the split sizes")
    elif "split" in attrs:
        sizes = list(attrs["split"])
    else:
        parts = attrs.get("num_outputs", len(ctx.node.output))
        size = -(-ctx.shape(x)[axis] // parts)
        sizes = [min(size, ctx.shape(x)[axis] - k * size) for k in range(parts)]
    if len(sizes) == 1:
        return (x,)
    return ctx.op("split", x, sizes=sizes, axis=axis)


@rule("Gather")
def _gather(ctx, inputs, attrs):
    """A gather; by constant indices a slice, or one row broadcast, where they allow it (a weight
    table's rows: Hugging Face BERT's positions and token types), else computed at import when
    the data is constant too."""
    data, indices = inputs
    axis = attrs.get("axis", 0) % len(ctx.shape(data))
    if ctx.is_constant(indices):
        if axis == 0 and len(ctx.shape(data)) >= 2 and is_float(ctx.dtype(data)):
            out_shape = tuple(indices.value.shape) + ctx.shape(data)[1:]
            rows = constant_rows(ctx, data, indices.value, out_shape)
            if rows is not None:
                return rows
        if ctx.is_constant(data):
            return ctx.constant(np.take(data.value, indices.value, axis=axis), ctx.node.output[0])
        picks = _constant(ctx, indices, "indices").reshape(-1) % ctx.shape(data)[axis]
        start = int(picks[0])
        if np.array_equal(picks, np.arange(start, start + picks.size)):
            piece = ctx.op("slice", data, begin=[start], end=[start + picks.size], axis=[axis])
            shape = ctx.shape(data)[:axis] + tuple(indices.value.shape) + ctx.shape(data)[axis + 1:]
            return _reshaped(ctx, piece, shape)
    elif axis == 0 and len(ctx.shape(data)) == 2 and is_float(ctx.dtype(data)):
        return ctx.op("embedding", data, indices)
    return ctx.op("take", data, indices, axis=axis)


@rule("GatherElements")
def _gather_elements(ctx, inputs, attrs):
    """Of constants only (Hugging Face BERT gathers its token type buffer by its position ids),
    computed at import time with numpy: onnx's reference evaluator picks along the axis with
    np.choose, which takes at most 64 choices (the buffer has 512 positions at the paper's size)."""
    data, indices = (_constant(ctx, value, what) for value, what in zip(inputs, ("the data", "the indices")))
    axis = attrs.get("axis", 0) % data.ndim
    picks = np.where(indices < 0, indices + data.shape[axis], indices)
    return ctx.constant(np.take_along_axis(data, picks, axis=axis), ctx.node.output[0])


# -- linear algebra and convolution --------------------------------------------------------------
@rule("MatMul")
def _matmul(ctx, inputs, attrs):
    a, b = inputs
    if len(ctx.shape(a)) < 2 or len(ctx.shape(b)) < 2:
        ctx.fail("1-D MatMul operands are not supported")
    if ctx.is_constant(b) and len(ctx.shape(b)) == 2 and is_float(ctx.dtype(b)):
        # torch.nn.Linear on more than two dimensions, as exported: a dense on the weight (its
        # transpose, (out_features, in_features) again), which horizontal fusion merges with the
        # dense ops reading the same input; a bias added next joins it (``_binary``)
        operands = (a, ctx.constant(np.ascontiguousarray(b.value.T), f"{b.name}.T"))
        product = ctx.op("dense", *operands)
        ctx.unbiased_products[product.name] = operands
        return product
    return ctx.op("matmul", a, b)


@rule("Gemm")
def _gemm(ctx, inputs, attrs):
    a, b = inputs[:2]
    c = inputs[2] if len(inputs) > 2 else None
    if attrs.get("alpha", 1.0) != 1.0 or (c is not None and attrs.get("beta", 1.0) != 1.0):
        ctx.fail("alpha and beta other than 1 are not supported")
    if attrs.get("transA", 0):
        a = ctx.op("transpose", a)
    if c is not None and ctx.shape(c) != (ctx.shape(b)[0 if attrs.get("transB", 0) else 1],):
        ctx.fail(f"a bias of shape {list(ctx.shape(c))} is not supported (only one per output feature)")
    if attrs.get("transB", 0):
        return ctx.op("dense", a, b, *([c] if c is not None else []))
    product = ctx.op("matmul", a, b)
    return product if c is None else ctx.op("add", product, c)


def _pads(ctx, attrs, rank: int) -> list[int]:
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        ctx.fail("auto_pad is not supported; give explicit pads")
    pads = list(attrs.get("pads", [0] * (2 * rank)))
    if pads[:rank] != pads[rank:]:
        ctx.fail(f"asymmetric pads {pads} are not supported")
    return pads[:rank]


@rule("Conv")
def _conv(ctx, inputs, attrs):
    x = inputs[0]
    if len(ctx.shape(x)) != 4:
        ctx.fail("only 2-D convolution is supported")
    return ctx.op("conv2d", *[v for v in inputs if v is not None], stride=list(attrs.get("strides", [1, 1])),
                  padding=_pads(ctx, attrs, 2), dilation=list(attrs.get("dilations", [1, 1])),
                  groups=attrs.get("group", 1))


# -- normalization, softmax, pooling, reductions -------------------------------------------------
@rule("BatchNormalization")
def _batch_norm(ctx, inputs, attrs):
    if attrs.get("training_mode", 0):
        ctx.fail("training-mode batch normalization is not supported")
    return ctx.op("batch_norm", *inputs[:5], eps=float(attrs.get("epsilon", 1e-5)))


@rule("LayerNormalization")
def _layer_norm(ctx, inputs, attrs):
    x, scale = inputs[:2]
    if attrs.get("axis", -1) % len(ctx.shape(x)) != len(ctx.shape(x)) - 1:
        ctx.fail("layer normalization over more than the last axis is not supported")
    bias = inputs[2] if len(inputs) > 2 and inputs[2] is not None else \
        ctx.op("full", shape=(ctx.shape(x)[-1],), value=0.0, dtype=ctx.dtype(x))
    return ctx.op("layer_norm", x, scale, bias, eps=float(attrs.get("epsilon", 1e-5)))


@rule("Softmax")
def _softmax(ctx, inputs, attrs):
    return ctx.op("softmax", inputs[0], axis=attrs.get("axis", -1))


def _pool_window(ctx, attrs):
    kernel = list(attrs["kernel_shape"])
    return kernel, list(attrs.get("strides", [1] * len(kernel))), _pads(ctx, attrs, len(kernel))


@rule("MaxPool")
def _max_pool(ctx, inputs, attrs):
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        ctx.fail("the indices output is not supported")
    kernel, stride, pads = _pool_window(ctx, attrs)
    return ctx.op("max_pool2d", inputs[0], kernel=kernel, stride=stride, padding=pads,
                  dilation=list(attrs.get("dilations", [1, 1])), ceil_mode=bool(attrs.get("ceil_mode", 0)))


@rule("AveragePool")
def _average_pool(ctx, inputs, attrs):
    kernel, stride, pads = _pool_window(ctx, attrs)
    return ctx.op("avg_pool2d", inputs[0], kernel=kernel, stride=stride, padding=pads,
                  ceil_mode=bool(attrs.get("ceil_mode", 0)), count_include_pad=bool(attrs.get("count_include_pad", 0)))


@rule("GlobalAveragePool")
def _global_average_pool(ctx, inputs, attrs):
    return ctx.op("global_avg_pool2d", inputs[0])


@rule("ReduceMean", "ReduceSum")
def _reduce(ctx, inputs, attrs):
    axes = _axes(ctx, inputs, attrs)
    if not axes and attrs.get("noop_with_empty_axes", 0):
        return inputs[0]
    kind = "mean" if ctx.node.op_type == "ReduceMean" else "sum"
    keepdims = bool(attrs.get("keepdims", 1))
    if kind == "sum" and is_short_sum(ctx, inputs[0], axes or None):
        return sum_of_slices(ctx, inputs[0], axes[0], keepdims)  # element-wise, as ``sums`` says why
    return ctx.op(kind, inputs[0], axes=axes or None, keepdims=keepdims)


# -- recurrence ----------------------------------------------------------------------------------
_TORCH_GATES = [0, 2, 3, 1]  # ONNX stacks the gates i, o, f, c; torch i, f, g (ONNX's c), o


@rule("LSTM")
def _lstm(ctx, inputs, attrs):
    """A forward ONNX LSTM (one layer) as a time scan with its weights in torch's gate order."""
    x, w, r, bias, lengths, h0, c0, peepholes = (list(inputs) + [None] * 8)[:8]
    if attrs.get("direction", b"forward") not in (b"forward", "forward") or attrs.get("layout", 0):
        ctx.fail("only a forward LSTM with layout 0 is supported")
    if lengths is not None or peepholes is not None or "activations" in attrs or "clip" in attrs:
        ctx.fail("sequence_lens, peepholes, custom activations and clip are not supported")
    hidden = attrs["hidden_size"]
    name = ctx.node.output[0] or ctx.node.name

    def torch_order(array: np.ndarray, what: str):
        rows = array.reshape((4, hidden) + array.shape[1:])[_TORCH_GATES]
        return ctx.constant(rows.reshape(array.shape), f"{name}.{what}")

    w_ih, w_hh = (_constant(ctx, v, what)[0] for v, what in ((w, "W"), (r, "R")))
    weights = [torch_order(w_ih, "w_ih"), torch_order(w_hh, "w_hh"), None, None]
    if bias is not None:
        b_ih, b_hh = _constant(ctx, bias, "B").reshape(2, 4 * hidden)
        weights[2:] = [torch_order(b_ih, "b_ih"), torch_order(b_hh, "b_hh")]
    _, batch, _ = ctx.shape(x)
    zeros = ctx.constant(np.zeros((1, batch, hidden), dtype=np.float32), f"{name}.zeros")
    h_init, c_init = (recurrent.layer_state(ctx, zeros if s is None else s, 0) for s in (h0, c0))
    outputs, h_n, c_n = recurrent.lstm_layer(ctx, x, weights, h_init, c_init, name)
    steps = ctx.shape(x)[0]
    return _reshaped(ctx, outputs, (steps, 1, batch, hidden)), h_n, c_n


# -- masks: comparisons, bool logic, Where ---------------------------------------------------------
# An ONNX bool tensor is an int32 mask of 0s and 1s (souffle.ops.logical); ctx.dtype says "bool".
_BOOL = 9


def _truth(ctx, value):
    """A mask of where ``value`` is nonzero (Cast to bool)."""
    if ctx.dtype(value) == "bool":
        return value
    zero = ctx.op("full", shape=(1,), value=0, dtype=ctx.dtype(value))
    return ctx.mark_bool(ctx.op("ne", value, zero))


for _op_type, _kind in {"Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt",
                        "GreaterOrEqual": "ge"}.items():
    def _compare(ctx, inputs, attrs, kind=_kind):
        return ctx.mark_bool(ctx.op(kind, *inputs))

    rule(_op_type)(_compare)


for _op_type, _kind in {"And": "logical_and", "Or": "logical_or", "Not": "logical_not"}.items():
    def _logical(ctx, inputs, attrs, kind=_kind):
        return ctx.mark_bool(ctx.op(kind, *inputs))

    rule(_op_type)(_logical)


@rule("Where")
def _where(ctx, inputs, attrs):
    condition, a, b = inputs
    return ctx.op("where", _truth(ctx, condition), a, b)


# -- padding (Swin Transformer) ------------------------------------------------------------------
@rule("Pad")
def _pad(ctx, inputs, attrs):
    """Constant padding; ONNX lists the amounts as all the begins, then all the ends."""
    x, pads, value, axes = (list(inputs) + [None] * 4)[:4]
    if attrs.get("mode", b"constant") not in (b"constant", "constant"):
        ctx.fail(f"only constant padding is supported, not {attrs['mode']!r}")
    rank = len(ctx.shape(x))
    amounts = _ints(ctx, pads, "the pads")
    axes = [a % rank for a in _ints(ctx, axes, "the axes")] if axes is not None else list(range(rank))
    if len(amounts) != 2 * len(axes):
        ctx.fail(f"pads {amounts} must hold a begin and an end for each of the axes {axes}")
    if any(amount < 0 for amount in amounts):
        ctx.fail(f"negative pads (cropping) {amounts} are not supported")
    before, after = [0] * rank, [0] * rank
    for k, axis in enumerate(axes):
        before[axis], after[axis] = amounts[k], amounts[len(axes) + k]
    fill = 0 if value is None else _scalar(ctx, value)
    if fill is None:
        ctx.fail("the padding value must be known at import time")
    if not any(before + after):
        return x
    return ctx.op("pad", x, before=before, after=after, value=fill)
