"""ATen op -> souffle ops: the conversion rules of ``from_torch``, one table.

A rule is ``rule(ctx, *args, **kwargs)`` for one ATen overload, called with the node's
arguments where each graph value is a ``Tensor`` (a graph tensor) or a ``Constant`` (known at
import time); it adds ops through ``ctx.op`` and returns the node's value (a tuple for a
node with several outputs, None where souffle does not compute one). ``ctx.fail(reason)``
refuses the node with its name and source line. Adding an ATen op is one ``@rule`` here.
"""

from __future__ import annotations

import math
import operator

from souffle.importers import recurrent
from souffle.importers.rows import constant_rows
from souffle.importers.sums import is_short_sum, sum_of_slices
from souffle.ops.logical import MASK_DTYPE
from souffle.tensor import is_float

getitem = operator.getitem

# Ops torch.export's default decomposition would split but the op registry computes whole.
KEPT = ("linear.default", "layer_norm.default", "lstm.input", "gelu.default", "silu.default",
        "hardswish.default", "hardsigmoid.default", "hardtanh.default")

RULES: dict[str, object] = {}


def rule(*overloads: str):
    """Register a conversion rule for ATen ``overloads`` (``"add.Tensor"`` is ``aten.add.Tensor``)."""

    def decorate(fn):
        for overload in overloads:
            key = f"aten.{overload}"
            if key in RULES:
                raise ValueError(f"{key} has two conversion rules")
            RULES[key] = fn
        return fn

    return decorate


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _promoted(ctx, value):
    """``value`` as a tensor of the node's result dtype (torch's type promotion; a bool result
    is a mask, true where ``value`` is nonzero)."""
    if _is_number(value):
        return value
    dtype = ctx.out_dtype()
    if ctx.dtype(value) == dtype:
        return value
    if dtype == "bool":
        return _truth(ctx, value)
    return ctx.op("cast", value, dtype=dtype)


def _is_zeros(ctx, value) -> bool:
    """Whether ``value`` is the number 0 or a constant tensor of zeros."""
    if _is_number(value):
        return value == 0
    return ctx.is_constant(value) and bool((value.value == 0).all())


def _scalar_tensor(ctx, number):
    return ctx.op("full", shape=(1,), value=number, dtype=ctx.out_dtype())


def _binary(ctx, kind: str, a, b):
    a, b = _promoted(ctx, a), _promoted(ctx, b)
    floating = is_float(ctx.out_dtype())
    if floating and kind == "mul" and _is_number(b):
        return ctx.op("scale", a, factor=float(b))
    if floating and kind == "mul" and _is_number(a):
        return ctx.op("scale", b, factor=float(a))
    if floating and kind == "div" and _is_number(b) and b != 0:
        return ctx.op("scale", a, factor=1.0 / float(b))
    a = _scalar_tensor(ctx, a) if _is_number(a) else a
    b = _scalar_tensor(ctx, b) if _is_number(b) else b
    return ctx.op(kind, a, b)


# -- elementwise ---------------------------------------------------------------------------------
@rule("add.Tensor", "add.Scalar")
def _add(ctx, a, b, alpha=1):
    """a + alpha * b; adding zeros known at import time is no op (Hugging Face's BERT adds an
    attention mask of zeros when it is given none), unless it broadcasts or promotes."""
    for zeros, other in ((b, a), (a, b)) if alpha == 1 else ((b, a),):
        if _is_zeros(ctx, zeros) and not _is_number(other) and not ctx.is_constant(other) and \
                ctx.shape(other) == ctx.out_shape() and ctx.dtype(other) == ctx.out_dtype():
            return other
    if alpha != 1:
        b = _binary(ctx, "mul", b, alpha)
    return _binary(ctx, "add", a, b)


@rule("sub.Tensor", "sub.Scalar")
def _sub(ctx, a, b, alpha=1):
    if alpha != 1:
        b = _binary(ctx, "mul", b, alpha)
    return _binary(ctx, "sub", a, b)


@rule("rsub.Scalar", "rsub.Tensor")
def _rsub(ctx, a, b, alpha=1):
    if alpha != 1:
        a = _binary(ctx, "mul", a, alpha)
    return _binary(ctx, "sub", b, a)


@rule("mul.Tensor", "mul.Scalar")
def _mul(ctx, a, b):
    return _binary(ctx, "mul", a, b)


@rule("div.Tensor", "div.Scalar")
def _div(ctx, a, b):
    return _binary(ctx, "div", a, b)


def _unary(kind: str):
    def convert(ctx, x):
        return ctx.op(kind, x)

    return convert


for _overload, _kind in {
    "relu.default": "relu", "sigmoid.default": "sigmoid", "tanh.default": "tanh", "exp.default": "exp",
    "log.default": "log", "sqrt.default": "sqrt", "rsqrt.default": "rsqrt", "erf.default": "erf",
    "neg.default": "neg", "abs.default": "abs", "silu.default": "silu", "hardswish.default": "hardswish",
    "hardsigmoid.default": "hardsigmoid",
}.items():
    rule(_overload)(_unary(_kind))


@rule("gelu.default")
def _gelu(ctx, x, approximate="none"):
    return ctx.op("gelu" if approximate == "none" else "gelu_tanh", x)


@rule("hardtanh.default")
def _hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    return ctx.op("clamp", x, min=float(min_val), max=float(max_val))


@rule("clamp.default")
def _clamp(ctx, x, min=None, max=None):  # noqa: A002  (ATen's argument names)
    if not all(bound is None or _is_number(bound) for bound in (min, max)):
        ctx.fail("tensor bounds are not supported, only numbers")
    return ctx.op("clamp", x, min=min, max=max)


@rule("pow.Tensor_Scalar")
def _pow(ctx, x, exponent):
    if not _is_number(exponent):
        ctx.fail("only a constant exponent is supported")
    return ctx.op("pow", x, exponent=float(exponent))


@rule("_to_copy.default")
def _to_copy(ctx, x, dtype=None, **_layout):
    return _promoted(ctx, x)


@rule("clone.default", "alias.default", "detach.default", "lift_fresh_copy.default")
def _identity(ctx, x, **_memory_format):
    return x


@rule("_assert_tensor_metadata.default", "_assert_scalar.default")
def _assertion(ctx, *args, **kwargs):
    """torch.export's checks of what tracing assumed; the static graph holds them by construction."""
    return None


@rule("dropout.default")
def _dropout(ctx, x, p, train):
    if train:
        ctx.fail("dropout in training mode is random; call module.eval()")
    return x


# -- shapes --------------------------------------------------------------------------------------
@rule("view.default", "_unsafe_view.default", "reshape.default", "unsqueeze.default", "squeeze.dim",
      "squeeze.dims", "squeeze.default", "flatten.using_ints")
def _reshape(ctx, x, *_shape_args):
    shape = ctx.out_shape()
    return x if ctx.shape(x) == shape else ctx.op("reshape", x, shape=shape)


@rule("permute.default")
def _permute(ctx, x, dims):
    return ctx.op("transpose", x, axes=[d % len(ctx.shape(x)) for d in dims])


@rule("t.default")
def _t(ctx, x):
    return ctx.op("transpose", x) if len(ctx.shape(x)) == 2 else x


@rule("transpose.int")
def _transpose(ctx, x, dim0, dim1):
    axes = list(range(len(ctx.shape(x))))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    return ctx.op("transpose", x, axes=axes)


@rule("expand.default")
def _expand(ctx, x, sizes, implicit=False):
    shape = ctx.out_shape()
    return x if ctx.shape(x) == shape else ctx.op("expand", x, shape=shape)


@rule("cat.default")
def _cat(ctx, tensors, dim=0):
    return ctx.op("concat", *tensors, axis=dim)


@rule("slice.Tensor")
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    shape = ctx.shape(x)
    start, stop, step = slice(start, end, step).indices(shape[dim])
    if (start, stop, step) == (0, shape[dim], 1):
        return x
    return ctx.op("slice", x, begin=[start], end=[stop], axis=[dim], strides=[step])


@rule("select.int")
def _select(ctx, x, dim, index):
    size = ctx.shape(x)[dim]
    index = index % size
    piece = ctx.op("slice", x, begin=[index], end=[index + 1], axis=[dim])
    return ctx.op("reshape", piece, shape=ctx.out_shape())


@rule("split_with_sizes.default", "split.Tensor")
def _split(ctx, x, sizes, dim=0):
    size = ctx.shape(x)[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, size - start) for start in range(0, size, sizes)]
    if len(sizes) == 1:
        return (x,)
    pieces = ctx.op("split", x, sizes=list(sizes), axis=dim)
    return tuple(pieces)


@rule("unbind.int")
def _unbind(ctx, x, dim=0):
    shape = ctx.shape(x)
    outer = shape[:dim % len(shape)] + shape[dim % len(shape) + 1:]
    pieces = ctx.op("split", x, sections=shape[dim], axis=dim) if shape[dim] > 1 else (x,)
    return tuple(ctx.op("reshape", piece, shape=outer) for piece in pieces)


# -- linear algebra ------------------------------------------------------------------------------
@rule("linear.default")
def _linear(ctx, x, weight, bias=None):
    return ctx.op("dense", x, weight, *([bias] if bias is not None else []))


@rule("mm.default")
def _mm(ctx, a, b):
    return ctx.op("matmul", a, b)


@rule("bmm.default")
def _bmm(ctx, a, b):
    return ctx.op("batch_matmul", a, b)


@rule("addmm.default")
def _addmm(ctx, bias, a, b, beta=1, alpha=1):
    product = ctx.op("matmul", a, b)
    if alpha != 1:
        product = _binary(ctx, "mul", product, alpha)
    if beta != 1:
        bias = _binary(ctx, "mul", bias, beta)
    return ctx.op("add", product, bias)


@rule("convolution.default")
def _convolution(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        ctx.fail("transposed convolution is not supported")
    if len(ctx.shape(x)) != 4:
        ctx.fail(f"only 2-D convolution (a 4-D input) is supported, got a {len(ctx.shape(x))}-D input")
    inputs = [x, weight] + ([bias] if bias is not None else [])
    return ctx.op("conv2d", *inputs, stride=list(stride), padding=list(padding), dilation=list(dilation),
                  groups=groups)


# -- normalization, softmax, pooling, reductions -------------------------------------------------
def _ones(ctx, size: int):
    return ctx.op("full", shape=(size,), value=1.0, dtype=ctx.out_dtype())


def _zeros(ctx, size: int):
    return ctx.op("full", shape=(size,), value=0.0, dtype=ctx.out_dtype())


@rule("_native_batch_norm_legit_no_training.default")
def _batch_norm(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    channels = ctx.shape(x)[1]
    weight = _ones(ctx, channels) if weight is None else weight
    bias = _zeros(ctx, channels) if bias is None else bias
    return ctx.op("batch_norm", x, weight, bias, running_mean, running_var, eps=float(eps)), None, None


@rule("layer_norm.default")
def _layer_norm(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=False):
    if len(normalized_shape) != 1:
        ctx.fail(f"layer_norm over {len(normalized_shape)} trailing dimensions; souffle normalizes the last one")
    size = normalized_shape[0]
    weight = _ones(ctx, size) if weight is None else weight
    bias = _zeros(ctx, size) if bias is None else bias
    return ctx.op("layer_norm", x, weight, bias, eps=float(eps))


@rule("_softmax.default")
def _softmax(ctx, x, dim, half_to_float=False):
    return ctx.op("softmax", x, axis=dim)


@rule("mean.dim")
def _mean(ctx, x, dims, keepdim=False, dtype=None):
    return ctx.op("mean", x, axes=list(dims) if dims else None, keepdims=bool(keepdim))


@rule("sum.dim_IntList")
def _sum(ctx, x, dims, keepdim=False, dtype=None):
    """A reduction; over one short axis the adds of its slices (``sums.sum_of_slices``)."""
    x, axes = _promoted(ctx, x), list(dims) if dims else None
    if is_short_sum(ctx, x, axes):
        return sum_of_slices(ctx, x, axes[0], bool(keepdim))
    return ctx.op("sum", x, axes=axes, keepdims=bool(keepdim))


@rule("max_pool2d_with_indices.default")
def _max_pool2d(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    pooled = ctx.op("max_pool2d", x, kernel=list(kernel_size), stride=list(stride) or None, padding=padding,
                    dilation=dilation, ceil_mode=bool(ceil_mode))
    return pooled, None


@rule("avg_pool2d.default")
def _avg_pool2d(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if divisor_override is not None:
        ctx.fail("divisor_override is not supported")
    return ctx.op("avg_pool2d", x, kernel=list(kernel_size), stride=list(stride) or None, padding=padding,
                  ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad))


@rule("_adaptive_avg_pool2d.default")
def _adaptive_avg_pool2d(ctx, x, output_size):
    height, width = ctx.shape(x)[2:]
    out_h, out_w = output_size
    if (out_h, out_w) == (1, 1):
        return ctx.op("global_avg_pool2d", x)
    if height % out_h or width % out_w:
        ctx.fail(f"adaptive pooling of {height}x{width} to {out_h}x{out_w} has uneven windows")
    kernel = [height // out_h, width // out_w]
    return ctx.op("avg_pool2d", x, kernel=kernel, stride=kernel)


@rule("embedding.default")
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """A lookup; by indices known at import time (Hugging Face's position ids) a slice, or one
    row broadcast, where they allow it (``rows.constant_rows``)."""
    if ctx.is_constant(indices):
        rows = constant_rows(ctx, weight, indices.value.numpy(), ctx.out_shape())
        if rows is not None:
            return rows
    return ctx.op("embedding", weight, indices)


# -- recurrence ----------------------------------------------------------------------------------
@rule("lstm.input")
def _lstm(ctx, x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """torch.nn.LSTM as one time scan per layer (``recurrent.lstm_layer``)."""
    if bidirectional:
        ctx.fail("a bidirectional LSTM is not supported")
    per_layer = 4 if has_biases else 2
    if len(params) != per_layer * num_layers:
        ctx.fail("an LSTM with proj_size is not supported")
    if batch_first:
        x = ctx.op("transpose", x, axes=[1, 0, 2])
    h0, c0 = hx
    sequence, h_finals, c_finals = x, [], []
    for layer in range(num_layers):
        weights = list(params[per_layer * layer: per_layer * (layer + 1)]) + [None] * (4 - per_layer)
        h_init, c_init = (recurrent.layer_state(ctx, state, layer) for state in (h0, c0))
        sequence, h_n, c_n = recurrent.lstm_layer(ctx, sequence, weights, h_init, c_init, f"{ctx.node.name}.l{layer}")
        h_finals.append(h_n)
        c_finals.append(c_n)
    if batch_first:
        sequence = ctx.op("transpose", sequence, axes=[1, 0, 2])
    return sequence, recurrent.stacked(ctx, h_finals), recurrent.stacked(ctx, c_finals)


# -- masks: comparisons, bool logic, where, indexing by constants ---------------------------------
# A torch bool tensor is an int32 mask of 0s and 1s (souffle.ops.logical); ctx.dtype says "bool".
def _truth(ctx, value):
    """A mask of where ``value`` is nonzero (``tensor.bool()``)."""
    if ctx.dtype(value) == "bool":
        return value
    zero = ctx.op("full", shape=(1,), value=0, dtype=ctx.dtype(value))
    return ctx.mark_bool(ctx.op("ne", value, zero))


def _operand_dtype(ctx, *values) -> str:
    """The dtype two operands of a comparison meet in: torch's promotion for the cases masks use
    (a float wins, then the widest integer; a bool mask counts as int32; a number takes the tensor's)."""
    dtypes = [MASK_DTYPE if ctx.dtype(v) == "bool" else ctx.dtype(v) for v in values if not _is_number(v)]
    floats = [d for d in dtypes if is_float(d)]
    if floats:
        return floats[0]
    if any(_is_number(v) and isinstance(v, float) for v in values):
        return "float32"
    return "int64" if "int64" in dtypes else dtypes[0]


def _as_operand(ctx, value, dtype: str):
    if _is_number(value):
        return ctx.op("full", shape=(1,), value=value, dtype=dtype)
    return value if ctx.spec(value).dtype == dtype else ctx.op("cast", value, dtype=dtype)


def _comparison(kind: str):
    def convert(ctx, a, b):
        dtype = _operand_dtype(ctx, a, b)
        return ctx.mark_bool(ctx.op(kind, _as_operand(ctx, a, dtype), _as_operand(ctx, b, dtype)))

    return convert


for _kind in ("eq", "ne", "lt", "le", "gt", "ge"):
    rule(f"{_kind}.Scalar", f"{_kind}.Tensor")(_comparison(_kind))


def _logical(kind: str, bitwise: bool):
    """A logical op; a bitwise one on bools is the same op (on integers it is refused)."""

    def convert(ctx, *operands):
        if any(_is_number(v) for v in operands):
            ctx.fail("a logical op with a number operand is not supported")
        if bitwise and not all(ctx.dtype(v) == "bool" for v in operands):
            ctx.fail("bitwise ops are supported on bool tensors only")
        return ctx.mark_bool(ctx.op(kind, *operands))

    return convert


for _overloads, _kind, _bitwise in (
        (("logical_and.default",), "logical_and", False), (("logical_or.default",), "logical_or", False),
        (("logical_not.default",), "logical_not", False), (("bitwise_and.Tensor",), "logical_and", True),
        (("bitwise_or.Tensor",), "logical_or", True), (("bitwise_not.default",), "logical_not", True)):
    rule(*_overloads)(_logical(_kind, _bitwise))


@rule("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def _where(ctx, condition, a, b):
    return _select(ctx, condition, a, b)


@rule("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(ctx, x, mask, value):
    return _select(ctx, mask, value, x)


def _select(ctx, condition, a, b):
    """where(condition, a, b) in the node's dtype (bool branches as masks)."""
    boolean = ctx.out_dtype() == "bool"
    dtype = MASK_DTYPE if boolean else ctx.out_dtype()
    result = ctx.op("where", _truth(ctx, condition), _as_operand(ctx, a, dtype), _as_operand(ctx, b, dtype))
    return ctx.mark_bool(result) if boolean else result


@rule("index.Tensor")
def _index(ctx, x, indices):
    """x[indices] for indices known at import time. Indices that only lay x out again (Hugging
    Face's padding mask indexes with aranges) become a reshape and a broadcast; others a gather
    of a float tensor's elements by a constant table of positions. One index tensor that is not
    (a buffer, as Swin's relative_position_index, or an input) is a take along its axis."""
    import torch

    if not all(i is None or ctx.is_constant(i) for i in indices):
        return _take_by_tensor(ctx, x, indices)
    shape = ctx.shape(x)
    positions = torch.arange(math.prod(shape)).reshape(shape)[
        tuple(slice(None) if i is None else i.value for i in indices)]
    out_shape = tuple(positions.shape)
    kept = positions
    for axis in range(positions.dim()):
        first = kept.narrow(axis, 0, 1)
        if bool((kept == first).all()):
            kept = first
    if kept.numel() == math.prod(shape) and bool((kept.reshape(-1) == torch.arange(kept.numel())).all()):
        laid_out = x if tuple(kept.shape) == shape else ctx.op("reshape", x, shape=tuple(kept.shape))
        return laid_out if tuple(kept.shape) == out_shape else ctx.op("expand", laid_out, shape=out_shape)
    if not is_float(ctx.spec(x).dtype):
        ctx.fail("gathering elements by constant indices is supported for float tensors only")
    table = ctx.op("reshape", x, shape=(math.prod(shape), 1))
    gathered = ctx.op("embedding", table, ctx.constant(positions, f"{ctx.node.name}.positions"))
    return ctx.op("reshape", gathered, shape=out_shape)


# -- padding, rolling and indexing (Swin Transformer) --------------------------------------------
KEPT += ("roll.default",)  # decomposed, a roll is index_select by arange/fmod tables; kept, one op


@rule("constant_pad_nd.default")
def _constant_pad_nd(ctx, x, pad, value=0):
    """F.pad's amounts come in (before, after) pairs from the last axis backwards."""
    rank = len(ctx.shape(x))
    if len(pad) % 2 or len(pad) > 2 * rank:
        ctx.fail(f"pad {list(pad)} must hold (before, after) pairs for at most {rank} axes")
    before, after = [0] * rank, [0] * rank
    for pair in range(len(pad) // 2):
        before[rank - 1 - pair], after[rank - 1 - pair] = pad[2 * pair], pad[2 * pair + 1]
    if any(amount < 0 for amount in before + after):
        ctx.fail(f"negative padding (cropping) {list(pad)} is not supported")
    if not any(before + after):
        return x
    return ctx.op("pad", x, before=before, after=after, value=value)


@rule("roll.default")
def _roll(ctx, x, shifts, dims=()):
    if dims:
        return ctx.op("roll", x, shifts=list(shifts), axes=list(dims))
    shape = ctx.shape(x)  # no dims: torch rolls the flattened tensor
    flat = ctx.op("reshape", x, shape=(-1,))
    return ctx.op("reshape", ctx.op("roll", flat, shifts=list(shifts), axes=[0]), shape=shape)


def _integer_index(ctx, index):
    dtype = ctx.dtype(index)
    if dtype not in ("int32", "int64"):
        ctx.fail(f"indexing by a {dtype} tensor is not supported, only by int32 or int64 indices")
    return index


def _take_by_tensor(ctx, x, indices):
    """tensor[..., index, ...] with one index tensor computed at run time: a take along its axis."""
    picked = [(axis, index) for axis, index in enumerate(indices) if index is not None]
    if len(picked) != 1:
        ctx.fail(f"indexing by {len(picked)} index tensors at once is not supported, only by one "
                 f"(or by indices known at import time)")
    axis, index = picked[0]
    return ctx.op("take", x, _integer_index(ctx, index), axis=axis)


@rule("index_select.default")
def _index_select(ctx, x, dim, index):
    return ctx.op("take", x, _integer_index(ctx, index), axis=dim)


@rule("as_strided.default")
def _as_strided(ctx, x, size, stride, storage_offset=None):
    """A view of x's memory (torch's decompositions emit one to restride a pooled result): the
    input's own strides, as torch traced them, say which element sits at each memory position,
    so the view is a reshape of x, or a take of its elements by a table computed here."""
    import torch

    traced = ctx.node.args[0].meta.get("val")
    if traced is None or len(traced.stride()) != len(ctx.shape(x)):
        ctx.fail("the input's memory layout is unknown")
    shape, strides = tuple(ctx.shape(x)), tuple(traced.stride())
    count = math.prod(shape)
    span = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    if span != count:
        ctx.fail(f"the input (shape {list(shape)}, strides {list(strides)}) does not fill its memory densely")
    # the element (row-major number) of x at each memory position, then at each position of the view
    numbers = torch.empty_strided(shape, strides, dtype=torch.int64)
    numbers.copy_(torch.arange(count, dtype=torch.int64).reshape(shape))
    offset = 0 if storage_offset is None else storage_offset - traced.storage_offset()
    try:
        table = torch.as_strided(numbers, list(size), list(stride), offset).reshape(-1)
    except RuntimeError:
        ctx.fail(f"the view (size {list(size)}, stride {list(stride)}, offset {offset}) reaches outside the input")
    if table.numel() == count and bool((table == torch.arange(count)).all()):
        return x if tuple(size) == shape else ctx.op("reshape", x, shape=tuple(size))
    picked = ctx.op("take", ctx.op("reshape", x, shape=(count,)), ctx.constant(table, f"{ctx.node.name}.index"))
    return ctx.op("reshape", picked, shape=tuple(size))
