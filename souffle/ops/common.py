"""Checks shared by the op rules: attribute normalization, axes, ranks and dtypes.

Each helper either returns a normalized value or refuses with ``fail``, so an
infer rule reads as a short list of requirements and a lowering can call the
same helper to get the same normalized attributes.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from tvm import tirx

from souffle.ops.registry import fail
from souffle.tensor import is_float


def shape_of(tensor) -> tuple[int, ...]:
    """A TE tensor's static shape as Python ints."""
    return tuple(int(d) for d in tensor.shape)


def prod(values) -> int:
    total = 1
    for v in values:
        total *= int(v)
    return total


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def require_finite(attrs, *names):
    """Refuse a NaN or infinite attribute where the op has no use for one (an epsilon, a factor)."""
    for name in names:
        if not is_real(attrs[name]) or not math.isfinite(attrs[name]):
            fail(f"{name} must be a finite number, got {attrs[name]!r}")


def ieee_constant(value, dtype: str):
    """A constant that TVM's simplifier cannot fold away where it meets a tensor element.

    TVM folds x * 0, 0 * x and 0 / x to 0 when the zero is a literal: true of real numbers,
    not of IEEE floats (inf * 0 and 0 / 0 are NaN, as torch computes them). A literal zero
    meets another tensor wherever a constant tensor (``full``) or factor (``scale``) is inlined
    into its consumer. A float zero is therefore written as fabs(0.0), a call that TVM keeps and
    that LLVM and nvcc fold to the constant without the unsafe rewrite (they assume IEEE).

    A bfloat16 infinity is the float32 one, written so, converted: TVM's CUDA code generator
    prints a bfloat16 infinity as ``__float2bfloat16_rn(-inff)``, which nvcc refuses, and would
    fold a converted literal back. A bfloat16 zero takes the same form (bfloat16's own fabs works
    too; a vector of either with no load beside it fails TVM's CPU legalization, which
    ``codegen.schedule_cpu._vectorizable`` avoids).
    """
    narrow_infinity = dtype == "bfloat16" and is_real(value) and math.isinf(value)
    if not is_float(dtype) or (value != 0 and not narrow_infinity):
        return tirx.const(value, dtype)
    wide = "float32" if dtype == "bfloat16" else dtype
    magnitude = tirx.call_intrin(wide, "tirx.fabs", tirx.const(abs(value), wide))
    signed = magnitude * tirx.const(-1.0, wide) if math.copysign(1.0, value) < 0 else magnitude
    return signed if wide == dtype else tirx.Cast(dtype, signed)


def ieee_sub(a, b):
    """a - b written as a + b * -1, bit for bit the same in IEEE arithmetic.

    TVM's simplifier rewrites e - e to 0 and (x + y) - x to y, which drop a NaN or infinite e
    or x (inf - inf is NaN in torch); structurally equal operands appear when both sides read
    one tensor or after inlining. It has no such rule for the sum, and LLVM turns the sum back
    into one subtraction (exact), so the form costs nothing.
    """
    if not is_float(str(a.ty.dtype)):
        return a - b
    return a + b * tirx.const(-1.0, a.ty.dtype)


def nan_max(a, b):
    """max(a, b) that is NaN when either operand is, as torch.maximum, relu and max pooling are.

    TVM's max is not: LLVM gets select(a > b, a, b), which is b when either is NaN, and CUDA
    gets fmaxf, which returns the operand that is not NaN. Here b is taken where b > a or b is
    NaN: a comparison with NaN is false, so a NaN ``a`` is kept. A constant ``b`` (relu's 0) is
    never NaN, and the select alone is one vector max instruction that keeps NaN.
    """
    if not is_float(str(a.ty.dtype)):
        return tirx.max(a, b)
    take_b = b > a
    if not isinstance(b, tirx.FloatImm):
        take_b = tirx.Or(take_b, isnan(b))
    return tirx.Select(take_b, b, a)


def isnan(x):
    """TVM's isnan, which has no bfloat16 form: a bfloat16 is NaN where its float32 value is."""
    return tirx.isnan(tirx.Cast("float32", x) if str(x.ty.dtype) == "bfloat16" else x)


def int_list(value, name: str, minimum: int | None = None) -> tuple[int, ...]:
    """An int or a list of ints as a tuple (one int becomes a 1-tuple)."""
    items = (value,) if is_int(value) else value
    if not isinstance(items, (list, tuple)) or not all(is_int(v) for v in items):
        fail(f"{name} must be an int or a list of ints, got {value!r}")
    if minimum is not None and any(v < minimum for v in items):
        fail(f"{name} must be >= {minimum}, got {value!r}")
    return tuple(int(v) for v in items)


def int_pair(value, name: str, minimum: int) -> tuple[int, int]:
    """A (height, width) attribute given as one int or a pair, as torch accepts it."""
    items = int_list(value, name, minimum)
    if len(items) == 1:
        return items * 2
    if len(items) != 2:
        fail(f"{name} must be an int or a pair of ints, got {value!r}")
    return items


def normalize_axis(axis, rank: int, name: str = "axis") -> int:
    """An axis in [0, rank) from one in [-rank, rank), as torch counts negative axes."""
    if not is_int(axis) or not -rank <= axis < rank:
        fail(f"{name} {axis!r} is out of range for a rank-{rank} tensor")
    return int(axis) % rank


def normalize_axes(axes, rank: int, name: str = "axes") -> tuple[int, ...]:
    """Distinct non-negative axes from an int or a list of ints."""
    result = tuple(normalize_axis(a, rank, name) for a in int_list(axes, name))
    if len(set(result)) != len(result):
        fail(f"{name} {axes!r} names an axis twice")
    return result


def require_rank(spec, ranks, what: str = "input"):
    """Refuse a tensor whose rank is not one of ``ranks`` (an int or a collection)."""
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if len(spec.shape) not in allowed:
        expected = " or ".join(f"{r}-D" for r in allowed)
        fail(f"{what} must be {expected}, got shape {list(spec.shape)}")


def require_float(*specs):
    for spec in specs:
        if not is_float(spec.dtype):
            fail(f"{spec.name!r} must be floating-point, got {spec.dtype}")


def require_same_dtype(specs):
    dtypes = sorted({s.dtype for s in specs})
    if len(dtypes) > 1:
        fail(f"inputs must share one dtype, got {', '.join(dtypes)}")


def require_bool(attrs, *names):
    for name in names:
        if not isinstance(attrs[name], bool):
            fail(f"{name} must be True or False, got {attrs[name]!r}")
