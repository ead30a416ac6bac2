"""Vectorizable float32 ``exp`` and ``erf`` for the LLVM backend.

TVM lowers ``exp`` to ``llvm.exp`` and ``erf`` to libm's ``erff``; without a vector math
library LLVM splits a vector of them into scalar libm calls (2.5 ns per ``exp``, 15 ns per
``erf`` on this CPU), which made softmax, sigmoid, tanh and GELU cost more than the
GEMMs around them. These lowerings are polynomials, so a vectorized loop stays vectorized:

- ``exp``: Cephes' ``expf`` (range reduction by ln 2 in two parts, degree-6 polynomial,
  scale by 2^n built from the exponent bits); within 2 ulp where exp(x) >= 2^-125,
  zero below about x = -87 (results near or under FLT_MIN), inf above 88.72 as ``expf``.
- ``erf``: Eigen's rational approximation x P(x^2) / Q(x^2) on [-4, 4] (erf is +-1 to
  float32 precision beyond); within 4e-7 absolute.

- ``tanh``: through one ``exp`` of -2|x| (TVM's own rule takes two and copies its argument).

sigmoid is legalized by TVM through ``exp``, so it benefits too.
Only float32 is rewritten; other dtypes keep TVM's lowering.

Both clamp their argument so that NaN passes through (TVM's min and max would make it a
bound), so exp and erf of NaN are NaN as in libm, and so are sigmoid, tanh, GELU and softmax
built on them; the infinities clamp to the bounds, whose results are exp's 0 and inf and erf's
-1 and 1.
"""

from __future__ import annotations

import tvm
from tvm import tirx

_LOG2E = 1.44269504088896341
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)
_LOWERING_LEVEL = 50  # above TVM's own llvm rules (level 10)


def _horner(x, coefficients):
    result = coefficients[0]
    for c in coefficients[1:]:
        result = result * x + c
    return result


def _clamp(x, low: float, high: float):
    """``x`` limited to [low, high], NaN kept: a comparison with NaN is false, so NaN takes neither
    bound. (TVM's min and max are select(a < b, a, b) in LLVM, which makes NaN the bound.) Each
    select is one vector min or max instruction, with its operands in the NaN-keeping order."""
    dtype = str(x.ty.dtype)  # the bounds are broadcast to a vector's lanes
    low, high = tirx.const(low, dtype), tirx.const(high, dtype)
    return tirx.Select(x < low, low, tirx.Select(x > high, high, x))


def _bound_once(rewrite):
    """``rewrite`` applied to a variable bound to its argument by a let: a TIR expression is a
    tree, so an argument used several times would be copied each time, and nested calls
    (tanh(tanh(x)), each tanh through two exps) would multiply the copies."""

    def bound(x):
        var = tirx.Var("arg", x.ty.dtype)
        return tirx.Let(var, x, rewrite(var))

    return bound


def fast_exp(x):
    """exp(x) for a float32 (or float32 vector) expression, as vectorizable arithmetic."""
    dtype = str(x.ty.dtype)
    int_dtype = dtype.replace("float32", "int32")
    x = _clamp(x, -88.0, 89.0)
    # TVM's max makes a NaN n the bound -126, so the cast below never sees NaN; r carries the NaN
    n = tirx.max(tirx.floor(x * _LOG2E + 0.5), tirx.const(-126.0, "float32"))
    r = x - n * _LN2_HI - n * _LN2_LO
    poly = _horner(r, _EXP_POLY) * (r * r) + r + 1.0
    # 2^n as 2^(n-1) * 2: n = 128 keeps a finite exponent field (the product overflows to inf
    # exactly when exp(x) does), n = -126 gives exponent field 0 (flush to zero)
    exponent = tirx.Cast(int_dtype, n) + 126
    scale = tirx.reinterpret(dtype, tirx.shift_left(exponent, tirx.const(23, "int32")))
    return poly * scale * 2.0


def fast_erf(x):
    """erf(x) for a float32 (or float32 vector) expression, as vectorizable arithmetic."""
    x = _clamp(x, -4.0, 4.0)
    x2 = x * x
    return x * _horner(x2, _ERF_P) / _horner(x2, _ERF_Q)


def fast_tanh(x):
    """tanh(x) as copysign(2 / (1 + e) - 1, x) with e = exp(-2|x|): one exp that cannot overflow
    (TVM's rule takes two), and x used twice (TVM's rule copies it into three places, two of them
    exps). NaN stays NaN (e is NaN); +-inf give e = 0 and +-1; within 2e-7 absolute."""
    dtype = str(x.ty.dtype)
    int_dtype = dtype.replace("float32", "int32")
    one, two = tirx.const(1.0, dtype), tirx.const(2.0, dtype)
    e = _bound_once(fast_exp)(tirx.abs(x) * tirx.const(-2.0, dtype))
    magnitude = tirx.reinterpret(int_dtype, two / (one + e) - one)
    sign = tirx.bitwise_and(tirx.reinterpret(int_dtype, x), tirx.const(-(2**31), "int32"))
    return tirx.reinterpret(dtype, tirx.bitwise_or(magnitude, sign))  # copysign (TVM's LLVM has none)


EXPANDED_CALLS = frozenset({"tirx.exp", "tirx.erf", "tirx.tanh", "tirx.sigmoid"})
MAX_NESTED_EXPANDED_CALLS = 2


def nested_expanded_calls(expr) -> int:
    """How many exp/erf/tanh/sigmoid calls nest along the deepest path of ``expr``.

    Each lowers to arithmetic that uses its argument tens of times, bound once by a let; but
    TVM's LLVM code generator simplifies every let's value with the lets inside it inlined (its
    analyzer inlines side-effect-free lets), so the work grows by that factor per nesting level:
    three nested tanh took minutes to compile and four did not finish in ten. Fusion (``vertical``
    and the CPU schedule's inlining) stops before a fused expression nests more than
    ``MAX_NESTED_EXPANDED_CALLS`` of them; the intermediate is stored instead.
    """
    return _nesting(expr, lambda node: isinstance(node, tvm.ir.Call) and isinstance(node.op, tvm.ir.Op)
                    and node.op.name in EXPANDED_CALLS)


MAX_NESTED_SELECTS = 2


def nested_selects(expr) -> int:
    """How many data-dependent selects (``where``, clamps) nest along the deepest path of ``expr``.

    TVM's simplifier simplifies each branch of a select under its condition, and the condition
    itself first: a select whose condition or branches hold further selects is simplified again
    for each, so the work grows by a factor per level. Three levels of ``where`` over comparisons
    of ``where`` took TVM's lowering and LLVM build past five minutes; fusion stops at
    ``MAX_NESTED_SELECTS`` like it does for expanded calls.
    """
    return _nesting(expr, lambda node: isinstance(node, tvm.tirx.Select))


def _nesting(expr, counted) -> int:
    """The most nodes for which ``counted`` holds along one path from ``expr`` down."""
    depth: dict = {}

    def visit(node) -> int:
        key = node.__hash__()
        if key in depth:
            return depth[key]
        children = [getattr(node, name, None) for name in ("a", "b", "value", "body", "condition", "true_value",
                                                          "false_value", "base", "stride")]
        for name in ("args", "indices", "source"):
            listed = getattr(node, name, None)
            if isinstance(listed, (list, tuple, tvm.ir.Array)):
                children.extend(listed)
        below = max((visit(c) for c in children if isinstance(c, tvm.ir.Expr)), default=0)
        depth[key] = below + bool(counted(node))
        return depth[key]

    return visit(expr)


def _float32_only(rewrite):
    def lower(call):
        if str(call.ty.dtype).split("x")[0] != "float32":
            return call
        return rewrite(call.args[0])

    return lower


_registered = False


def register_llvm_math():
    """Make the LLVM target lower float32 ``exp``/``erf``/``tanh`` with the polynomials above
    (once per process: TVM's op attribute registry is global)."""
    global _registered
    if _registered:
        return
    _registered = True
    tirx.register_intrin_lowering("tirx.exp", target="llvm", f=_float32_only(_bound_once(fast_exp)), level=_LOWERING_LEVEL)
    tirx.register_intrin_lowering("tirx.erf", target="llvm", f=_float32_only(_bound_once(fast_erf)), level=_LOWERING_LEVEL)
    tirx.register_intrin_lowering("tirx.tanh", target="llvm", f=_float32_only(_bound_once(fast_tanh)), level=_LOWERING_LEVEL)
