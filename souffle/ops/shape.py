"""Shape ops: reshape, transpose, concat, slice, split, flatten, pad, roll, take (torch semantics).

Each op's attribute normalization is one function used by its infer rule, its
lowering and its ONNX export rule, so they cannot disagree about the output shape.
"""

from __future__ import annotations

import math

from tvm import te, tirx, topi

from souffle.ops.common import (ieee_constant, int_list, is_int, is_real, normalize_axes, normalize_axis, prod,
                                require_same_dtype, shape_of)
from souffle.ops.registry import export_rule, fail, register_op
from souffle.tensor import is_float


def _reshape_target(shape: tuple[int, ...], target) -> tuple[int, ...]:
    """The requested shape with its one -1 resolved, as torch.reshape does."""
    if target is None:
        fail("shape is required")
    dims = int_list(target, "shape", minimum=-1)
    if 0 in dims or dims.count(-1) > 1:
        fail(f"shape {list(dims)} may hold positive sizes and at most one -1")
    known = prod(d for d in dims if d != -1)
    size = prod(shape)
    if -1 in dims:
        if size % known:
            fail(f"cannot reshape {list(shape)} ({size} elements) to {list(dims)}")
        dims = tuple(size // known if d == -1 else d for d in dims)
    if prod(dims) != size:
        fail(f"cannot reshape {list(shape)} ({size} elements) to {list(dims)} ({prod(dims)} elements)")
    return dims


def _reshape(specs, attrs):
    return [(_reshape_target(specs[0].shape, attrs["shape"]), specs[0].dtype)]


@register_op("reshape", infer=_reshape, n_inputs=1, attrs={"shape": None})
def reshape(inputs, shape):
    x = inputs[0]
    return topi.reshape(x, _reshape_target(shape_of(x), shape))


@export_rule("reshape")
def _reshape_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Reshape", [x, e.const(_reshape_target(e.shape(x), attrs["shape"]))], outputs)


def _permutation(rank: int, axes) -> tuple[int, ...]:
    """A full permutation of the axes; None reverses them (torch's .T, numpy's default)."""
    if axes is None:
        return tuple(reversed(range(rank)))
    perm = normalize_axes(axes, rank)
    if len(perm) != rank:
        fail(f"axes {list(axes)} must name each of the {rank} axes once")
    return perm


def _transpose(specs, attrs):
    x = specs[0]
    return [(tuple(x.shape[a] for a in _permutation(len(x.shape), attrs["axes"])), x.dtype)]


@register_op("transpose", infer=_transpose, n_inputs=1, attrs={"axes": None})
def transpose(inputs, axes):
    x = inputs[0]
    return topi.transpose(x, list(_permutation(len(x.shape), axes)))


@export_rule("transpose")
def _transpose_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Transpose", [x], outputs, perm=list(_permutation(len(e.shape(x)), attrs["axes"])))


def _concat(specs, attrs):
    require_same_dtype(specs)
    first = specs[0]
    axis = normalize_axis(attrs["axis"], len(first.shape))
    for spec in specs[1:]:
        if len(spec.shape) != len(first.shape) or any(
            a != b for i, (a, b) in enumerate(zip(spec.shape, first.shape)) if i != axis
        ):
            fail(f"{spec.name!r} {list(spec.shape)} does not match {list(first.shape)} outside axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(s.shape[axis] for s in specs)
    return [(tuple(shape), first.dtype)]


@register_op("concat", infer=_concat, n_inputs=(1, math.inf), attrs={"axis": 0})
def concat(inputs, axis):
    """torch.cat along ``axis``."""
    return topi.concatenate(inputs, normalize_axis(axis, len(inputs[0].shape)))


@export_rule("concat")
def _concat_onnx(e, inputs, outputs, attrs):
    e.node("Concat", inputs, outputs, axis=normalize_axis(attrs["axis"], len(e.shape(inputs[0]))))


def _slice_bounds(shape: tuple[int, ...], begin, end, axis, strides):
    """(axes, starts, stops, strides) in range, with Python's slicing rules for negative and
    out-of-range bounds, plus the output shape."""
    if begin is None or end is None:
        fail("begin and end are required")
    begins, ends = int_list(begin, "begin"), int_list(end, "end")
    axes = tuple(range(len(begins))) if axis is None else normalize_axes(axis, len(shape), "axis")
    steps = (1,) * len(axes) if strides is None else int_list(strides, "strides", minimum=1)
    if not len(begins) == len(ends) == len(axes) == len(steps):
        fail(f"begin {list(begins)}, end {list(ends)}, axis {list(axes)} and strides {list(steps)} differ in length")
    if len(axes) > len(shape):
        fail(f"{len(axes)} slice bounds for a rank-{len(shape)} tensor")
    out = list(shape)
    starts, stops = [], []
    for a, b, e, s in zip(axes, begins, ends, steps):
        start, stop, _ = slice(b, e, s).indices(shape[a])
        out[a] = len(range(start, stop, s))
        if out[a] == 0:
            fail(f"slice {b}:{e}:{s} of axis {a} (size {shape[a]}) is empty")
        starts.append(start)
        stops.append(stop)
    return axes, starts, stops, steps, tuple(out)


def _slice(specs, attrs):
    x = specs[0]
    return [(_slice_bounds(x.shape, **attrs)[-1], x.dtype)]


@register_op("slice", infer=_slice, n_inputs=1, attrs={"begin": None, "end": None, "axis": None, "strides": None})
def slice_op(inputs, **attrs):
    """x[begin:end:stride] on each listed axis (all leading axes when ``axis`` is None)."""
    x = inputs[0]
    axes, starts, stops, steps, _ = _slice_bounds(shape_of(x), **attrs)
    return topi.strided_slice(x, starts, stops, list(steps), axes=list(axes))


@export_rule("slice")
def _slice_onnx(e, inputs, outputs, attrs):
    """Bounds already resolved by Python's slicing rules, as the lowering resolves them."""
    (x,) = inputs
    axes, starts, stops, steps, _ = _slice_bounds(e.shape(x), **attrs)
    e.node("Slice", [x, e.const(starts), e.const(stops), e.const(list(axes)), e.const(list(steps))], outputs)


def _split_sizes(shape: tuple[int, ...], sections, sizes, axis) -> tuple[int, tuple[int, ...]]:
    """(axis, piece sizes) from an even count of ``sections`` or explicit ``sizes``."""
    axis = normalize_axis(axis, len(shape))
    dim = shape[axis]
    if (sections is None) == (sizes is None):
        fail("give exactly one of sections (a count) or sizes (a list)")
    if sizes is None:
        if not is_int(sections) or sections < 1 or dim % sections:
            fail(f"sections={sections!r} must be a positive int dividing axis {axis} of size {dim}")
        return axis, (dim // sections,) * sections
    pieces = int_list(sizes, "sizes", minimum=1)
    if sum(pieces) != dim:
        fail(f"sizes {list(pieces)} sum to {sum(pieces)}, not the size {dim} of axis {axis}")
    return axis, pieces


def _split(specs, attrs):
    x = specs[0]
    axis, pieces = _split_sizes(x.shape, **attrs)
    return [(x.shape[:axis] + (p,) + x.shape[axis + 1 :], x.dtype) for p in pieces]


@register_op("split", infer=_split, n_inputs=1, attrs={"sections": None, "sizes": None, "axis": 0})
def split(inputs, **attrs):
    """Pieces of x along ``axis``, in order; one output per piece."""
    x = inputs[0]
    axis, pieces = _split_sizes(shape_of(x), **attrs)
    if len(pieces) == 1:
        return [topi.identity(x)]
    boundaries = [sum(pieces[:i]) for i in range(1, len(pieces))]
    return list(topi.split(x, boundaries, axis))


@export_rule("split")
def _split_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    axis, pieces = _split_sizes(e.shape(x), **attrs)
    e.node("Split", [x, e.const(list(pieces))], outputs, axis=axis)


def _flat_shape(shape: tuple[int, ...], start_dim, end_dim) -> tuple[int, ...]:
    """torch.flatten's shape: dims start_dim..end_dim merged into one."""
    rank = max(len(shape), 1)
    start = normalize_axis(start_dim, rank, "start_dim")
    end = normalize_axis(end_dim, rank, "end_dim")
    if start > end:
        fail(f"start_dim {start_dim} comes after end_dim {end_dim}")
    return shape[:start] + (prod(shape[start : end + 1]),) + shape[end + 1 :]


def _flatten(specs, attrs):
    return [(_flat_shape(specs[0].shape, **attrs), specs[0].dtype)]


@register_op("flatten", infer=_flatten, n_inputs=1, attrs={"start_dim": 1, "end_dim": -1})
def flatten(inputs, start_dim, end_dim):
    """torch.flatten(x, start_dim, end_dim); the default start_dim=1 keeps the batch axis
    (nn.Flatten)."""
    x = inputs[0]
    return topi.reshape(x, _flat_shape(shape_of(x), start_dim, end_dim))


@export_rule("flatten")
def _flatten_onnx(e, inputs, outputs, attrs):
    """Reshape, since ONNX Flatten always makes a 2-D result."""
    (x,) = inputs
    e.node("Reshape", [x, e.const(_flat_shape(e.shape(x), attrs["start_dim"], attrs["end_dim"]))], outputs)


def _expand_target(shape: tuple[int, ...], target) -> tuple[int, ...]:
    """torch.Tensor.expand's shape: new leading axes, size-1 axes stretched, -1 keeps a size."""
    if target is None:
        fail("shape is required")
    dims = int_list(target, "shape", minimum=-1)
    if len(dims) < len(shape):
        fail(f"cannot expand {list(shape)} to fewer dimensions {list(dims)}")
    lead = len(dims) - len(shape)
    out = list(dims[:lead])
    if -1 in out:
        fail(f"-1 is not allowed for the new leading dimensions of {list(dims)}")
    for size, want in zip(shape, dims[lead:]):
        if want == -1:
            want = size
        if size != want and size != 1:
            fail(f"cannot expand {list(shape)} to {list(dims)}: only size-1 dimensions stretch")
        out.append(want)
    if 0 in out:
        fail(f"shape {list(dims)} has a zero dimension")
    return tuple(out)


def _expand(specs, attrs):
    return [(_expand_target(specs[0].shape, attrs["shape"]), specs[0].dtype)]


@register_op("expand", infer=_expand, n_inputs=1, attrs={"shape": None})
def expand(inputs, shape):
    """x broadcast to ``shape``, as torch.Tensor.expand (a copy: every output is its own buffer)."""
    x = inputs[0]
    return topi.broadcast_to(x, _expand_target(shape_of(x), shape))


@export_rule("expand")
def _expand_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Expand", [x, e.const(_expand_target(e.shape(x), attrs["shape"]))], outputs)


# -- pad, roll, take (Swin Transformer's windows and relative position bias) ----------------------
def _pad_widths(shape: tuple[int, ...], before, after) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(before, after, output shape): a non-negative amount on each side of every axis."""
    if before is None or after is None:
        fail("before and after are required (one amount per axis)")
    low, high = int_list(before, "before", minimum=0), int_list(after, "after", minimum=0)
    if not len(low) == len(high) == len(shape):
        fail(f"before {list(low)} and after {list(high)} must give one amount per axis of {list(shape)}")
    return low, high, tuple(d + lo + hi for d, lo, hi in zip(shape, low, high))


def _pad(specs, attrs):
    x = specs[0]
    if not is_real(attrs["value"]):
        fail(f"value must be a number, got {attrs['value']!r}")
    return [(_pad_widths(x.shape, attrs["before"], attrs["after"])[2], x.dtype)]


@register_op("pad", infer=_pad, n_inputs=1, attrs={"before": None, "after": None, "value": 0.0})
def pad(inputs, before, after, value):
    """x with ``before[a]`` and ``after[a]`` elements of ``value`` around axis a (torch's
    constant F.pad, its amounts listed per axis from the first)."""
    x = inputs[0]
    low, high, _ = _pad_widths(shape_of(x), before, after)
    fill = ieee_constant(value if is_float(str(x.dtype)) else int(value), str(x.dtype))
    return topi.nn.pad(x, list(low), list(high), pad_value=fill)


@export_rule("pad")
def _pad_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    low, high, _ = _pad_widths(e.shape(x), attrs["before"], attrs["after"])
    e.node("Pad", [x, e.const(list(low) + list(high)), e.const(attrs["value"], e.dtype(x))], outputs, mode="constant")


def _roll_amounts(shape: tuple[int, ...], shifts, axes) -> dict[int, int]:
    """axis -> shift in [0, size) for each rolled axis (an axis named twice adds its shifts)."""
    if shifts is None or axes is None:
        fail("shifts and axes are required")
    amounts = int_list(shifts, "shifts")
    dims = tuple(normalize_axis(a, len(shape)) for a in int_list(axes, "axes"))
    if len(amounts) != len(dims):
        fail(f"shifts {list(amounts)} and axes {list(dims)} differ in length")
    total: dict[int, int] = {}
    for axis, amount in zip(dims, amounts):
        total[axis] = (total.get(axis, 0) + amount) % shape[axis]
    return {axis: amount for axis, amount in total.items() if amount}


def _roll(specs, attrs):
    x = specs[0]
    _roll_amounts(x.shape, attrs["shifts"], attrs["axes"])
    return [(x.shape, x.dtype)]


@register_op("roll", infer=_roll, n_inputs=1, attrs={"shifts": None, "axes": None})
def roll(inputs, shifts, axes):
    """torch.roll: element i of a rolled axis is element (i - shift) mod size of the input.

    Each rolled axis is a choice between two affine reads, i - shift or i + size - shift, so the
    analysis and the thread-level validator see exact accesses. A floormod index would be
    quasi-affine too, but TVM 0.27's buffer flattening rewrites ((f // 4 + 1) % 4) * 4 +
    (f % 4 + 1) % 4, a two-axis roll read in a fused loop f, to (f + 4) % 16, which drops the
    second axis's shift."""
    x = inputs[0]
    shape = shape_of(x)
    amounts = _roll_amounts(shape, shifts, axes)

    def read(rolled: list[int], index: list):
        if not rolled:
            return x(*index)
        axis, rest = rolled[0], rolled[1:]
        i, amount = index[axis], amounts[axis]
        inside = index[:axis] + [i - amount] + index[axis + 1:]
        wrapped = index[:axis] + [i + (shape[axis] - amount)] + index[axis + 1:]
        return tirx.if_then_else(i >= amount, read(rest, inside), read(rest, wrapped))

    def element(*index):
        return read(sorted(amounts), list(index))

    return te.compute(shape, element, name="T_roll", tag=topi.tag.INJECTIVE)


@export_rule("roll")
def _roll_onnx(e, inputs, outputs, attrs):
    """Each rolled axis as its last ``shift`` elements concatenated before the others."""
    (x,) = inputs
    shape = e.shape(x)
    amounts = _roll_amounts(shape, attrs["shifts"], attrs["axes"])
    value = x
    for number, (axis, amount) in enumerate(amounts.items()):
        cut = shape[axis] - amount
        tail = e.node("Slice", [value, e.const([cut]), e.const([shape[axis]]), e.const([axis])])
        head = e.node("Slice", [value, e.const([0]), e.const([cut]), e.const([axis])])
        last = number == len(amounts) - 1
        value = e.node("Concat", [tail, head], outputs if last else None, axis=axis)
    if not amounts:
        e.node("Identity", [x], outputs)


def _take(specs, attrs):
    data, indices = specs
    axis = normalize_axis(attrs["axis"], len(data.shape))
    if indices.dtype not in ("int32", "int64"):
        fail(f"indices must be int32 or int64, got {indices.dtype}")
    return [(data.shape[:axis] + indices.shape + data.shape[axis + 1:], data.dtype)]


@register_op("take", infer=_take, n_inputs=2, attrs={"axis": 0})
def take(inputs, axis):
    """Elements of ``data`` along ``axis`` picked by ``indices`` of any shape, as
    torch.index_select and tensor[index] (and ONNX Gather): a negative index counts from the
    end. An index out of range is clamped into the axis, where torch raises: a kernel cannot
    raise, and a clamped index cannot read outside the tensor."""
    data, indices = inputs
    axis = normalize_axis(axis, len(data.shape))
    size, rank = shape_of(data)[axis], len(indices.shape)
    dtype = str(indices.dtype)
    zero, last, count = (tirx.const(v, dtype) for v in (0, size - 1, size))

    def element(*i):
        index = indices(*i[axis:axis + rank])
        index = tirx.Select(index < zero, index + count, index)
        # an int32 position, as every other axis's: an int64 one substituted into an inlined
        # producer would meet its int32 arithmetic
        position = tirx.Cast("int32", tirx.min(tirx.max(index, zero), last))
        return data(*i[:axis], position, *i[axis + rank:])

    shape = shape_of(data)[:axis] + shape_of(indices) + shape_of(data)[axis + 1:]
    return te.compute(shape, element, name="T_take", tag=topi.tag.INJECTIVE)


@export_rule("take")
def _take_onnx(e, inputs, outputs, attrs):
    """Indices wrapped once and clamped into [0, size) first, as the lowering does: ONNX Gather
    rejects an index out of range."""
    data, indices = inputs
    axis = normalize_axis(attrs["axis"], len(e.shape(data)))
    size = e.shape(data)[axis]
    dtype = e.dtype(indices)
    negative = e.node("Less", [indices, e.const(0, dtype)])
    wrapped = e.node("Where", [negative, e.node("Add", [indices, e.const(size, dtype)]), indices])
    clamped = e.node("Clip", [wrapped, e.const(0, dtype), e.const(size - 1, dtype)])
    e.node("Gather", [data, clamped], outputs, axis=axis)
