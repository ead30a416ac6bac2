"""Comparisons, logical ops and ``where``: what attention masks are built from.

Souffle has no bool dtype, so a truth value is a *mask*: an int32 tensor holding 1 where the
condition holds and 0 elsewhere (``MASK_DTYPE``). Comparisons and logical ops make masks;
``where`` reads any integer or float condition as true where it is nonzero, as torch's
``tensor.bool()`` does. The importers represent a torch or ONNX bool tensor as such a mask.
"""

from __future__ import annotations

from tvm import te, tirx, topi

from souffle.ops.common import isnan, shape_of
from souffle.ops.elementwise import broadcast_shape
from souffle.ops.registry import export_rule, fail, register_op
from souffle.tensor import is_float

MASK_DTYPE = "int32"

# op kind -> (TIR comparison, ONNX op type, whether the ONNX result is negated)
_COMPARISONS = {
    "eq": (lambda a, b: a == b, "Equal", False),
    "ne": (lambda a, b: _unequal(a, b), "Equal", True),
    "lt": (lambda a, b: a < b, "Less", False),
    "le": (lambda a, b: a <= b, "LessOrEqual", False),
    "gt": (lambda a, b: a > b, "Greater", False),
    "ge": (lambda a, b: a >= b, "GreaterOrEqual", False),
}


def _unequal(a, b):
    """a != b that is true where either is NaN, as torch's ne: TVM rewrites not(a == b) to an
    ordered a != b, which is false for NaN."""
    if not is_float(str(a.ty.dtype)):
        return a != b
    return tirx.Or(a != b, tirx.Or(isnan(a), isnan(b)))


def _read(tensor: te.Tensor, index):
    """``tensor`` at an index of the broadcast shape (size-1 dimensions read at 0, as topi does)."""
    dims = shape_of(tensor)
    return tensor(*(0 if d == 1 else i for d, i in zip(dims, index[len(index) - len(dims):])))


def _is_true(value):
    """Nonzero, a NaN included (torch's bool(nan) is True; a NaN compares unequal to 0)."""
    return _unequal(value, tirx.const(0, value.ty.dtype))


def _mask(condition):
    return tirx.Select(condition, tirx.const(1, MASK_DTYPE), tirx.const(0, MASK_DTYPE))


def _compare_rule(specs, attrs):
    a, b = specs
    if a.dtype != b.dtype:
        fail(f"inputs must share one dtype, got {a.dtype} and {b.dtype}")
    return [(broadcast_shape(a.shape, b.shape), MASK_DTYPE)]


def _register_comparison(kind: str):
    compare, onnx_type, negated = _COMPARISONS[kind]

    def lowering(inputs):
        a, b = inputs
        shape = broadcast_shape(shape_of(a), shape_of(b))
        return te.compute(shape, lambda *i: _mask(compare(_read(a, i), _read(b, i))), name=f"T_{kind}",
                          tag=topi.tag.BROADCAST)

    lowering.__doc__ = f"torch.{kind} as a mask (1 where true); a comparison with NaN is false but for ne."
    register_op(kind, infer=_compare_rule, n_inputs=2)(lowering)

    def export(e, inputs, outputs, attrs):
        truth = e.node(onnx_type, inputs)
        if negated:
            truth = e.node("Not", [truth])
        e.node("Cast", [truth], outputs, to=6)  # int32

    export_rule(kind)(export)


for _kind in _COMPARISONS:
    _register_comparison(_kind)


def _logical_rule(specs, attrs):
    shape = specs[0].shape
    for spec in specs[1:]:
        shape = broadcast_shape(shape, spec.shape)
    return [(shape, MASK_DTYPE)]


@register_op("logical_not", infer=_logical_rule, n_inputs=1)
def logical_not(inputs):
    """1 where x is zero, as torch.logical_not (and ``~`` on a bool tensor)."""
    x = inputs[0]
    return te.compute(x.shape, lambda *i: _mask(tirx.Not(_is_true(x(*i)))), name="T_logical_not",
                      tag=topi.tag.ELEMWISE)


@export_rule("logical_not")
def _logical_not_onnx(e, inputs, outputs, attrs):
    truth = e.node("Cast", inputs, to=9)  # bool
    e.node("Cast", [e.node("Not", [truth])], outputs, to=6)


def _register_logical(kind: str, combine, onnx_type: str):
    def lowering(inputs):
        a, b = inputs
        shape = broadcast_shape(shape_of(a), shape_of(b))
        return te.compute(shape, lambda *i: _mask(combine(_is_true(_read(a, i)), _is_true(_read(b, i)))),
                          name=f"T_{kind}", tag=topi.tag.BROADCAST)

    lowering.__doc__ = f"torch.{kind}: 1 where the inputs' truth values (nonzero) combine to true."
    register_op(kind, infer=_logical_rule, n_inputs=2)(lowering)

    def export(e, inputs, outputs, attrs):
        a, b = (e.node("Cast", [x], to=9) for x in inputs)
        e.node("Cast", [e.node(onnx_type, [a, b])], outputs, to=6)

    export_rule(kind)(export)


_register_logical("logical_and", tirx.And, "And")
_register_logical("logical_or", tirx.Or, "Or")


def _where_rule(specs, attrs):
    condition, a, b = specs
    if a.dtype != b.dtype:
        fail(f"the two branches must share one dtype, got {a.dtype} and {b.dtype}")
    shape = broadcast_shape(broadcast_shape(condition.shape, a.shape), b.shape)
    return [(shape, a.dtype)]


@register_op("where", infer=_where_rule, n_inputs=3)
def where(inputs):
    """a where the condition is nonzero, else b, all three broadcast, as torch.where (and
    masked_fill with the branches swapped). Only the chosen branch's value is kept, so a NaN or
    infinity in the other one does not leak."""
    condition, a, b = inputs
    shape = broadcast_shape(broadcast_shape(shape_of(condition), shape_of(a)), shape_of(b))
    return te.compute(shape, lambda *i: tirx.Select(_is_true(_read(condition, i)), _read(a, i), _read(b, i)),
                      name="T_where", tag=topi.tag.BROADCAST)


@export_rule("where")
def _where_onnx(e, inputs, outputs, attrs):
    condition, a, b = inputs
    e.node("Where", [e.node("Cast", [condition], to=9), a, b], outputs)
