"""Elementwise math that imported models use: exp, log, roots, powers, clamps, the hard and
tanh-approximate activations, and dtype casts (torch semantics, NaN kept as torch keeps it)."""

from __future__ import annotations

import math

import tvm
from tvm import te, topi

from souffle.ops.common import is_real, require_float
from souffle.ops.registry import export_rule, fail, register_op
from souffle.tensor import SUPPORTED_DTYPES


def _float_same(specs, attrs):
    require_float(specs[0])
    return [(specs[0].shape, specs[0].dtype)]


def _same(specs, attrs):
    return [(specs[0].shape, specs[0].dtype)]


def _const(value: float, like) -> tvm.tirx.PrimExpr:
    return tvm.tirx.const(value, like.dtype)


def _elementwise(x: te.Tensor, fn, name: str) -> te.Tensor:
    return te.compute(x.shape, lambda *i: fn(x(*i)), name=name, tag=topi.tag.ELEMWISE)


def _unary(kind: str, lower, onnx_type: str, infer=_float_same, widen: bool = True):
    """Register a one-input op computed by ``lower(x)`` and exported as one ONNX ``onnx_type`` node."""

    def lowering(inputs):
        return lower(inputs[0])

    lowering.__doc__ = f"torch.{kind} elementwise."
    register_op(kind, infer=infer, n_inputs=1, widen=widen)(lowering)

    def export(e, inputs, outputs, attrs):
        e.node(onnx_type, inputs, outputs)

    export_rule(kind)(export)


_unary("exp", topi.exp, "Exp")
_unary("log", topi.log, "Log")
_unary("sqrt", topi.sqrt, "Sqrt")
_unary("erf", topi.erf, "Erf")
_unary("neg", topi.negative, "Neg", infer=_same, widen=False)
_unary("abs", topi.abs, "Abs", infer=_same, widen=False)


@register_op("rsqrt", infer=_float_same, n_inputs=1, widen=True)
def rsqrt(inputs):
    """1 / sqrt(x), as torch.rsqrt."""
    return topi.rsqrt(inputs[0])


@export_rule("rsqrt")
def _rsqrt_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Reciprocal", [e.node("Sqrt", [x])], outputs)


def _pow(specs, attrs):
    if not is_real(attrs["exponent"]) or not math.isfinite(attrs["exponent"]):
        fail(f"exponent must be a finite number, got {attrs['exponent']!r}")
    return _float_same(specs, attrs)


@register_op("pow", infer=_pow, n_inputs=1, attrs={"exponent": 2.0}, widen=True)
def pow_op(inputs, exponent):
    """x ** exponent for a constant exponent; a square is x * x, exactly as torch computes it."""
    x = inputs[0]
    if exponent == 2:
        return _elementwise(x, lambda v: v * v, "square")
    return _elementwise(x, lambda v: te.power(v, _const(float(exponent), x)), "pow")


@export_rule("pow")
def _pow_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Pow", [x, e.scalar(float(attrs["exponent"]), x)], outputs)


def _bound(value, name: str):
    if value is not None and (not is_real(value) or math.isnan(value)):
        fail(f"{name} must be a number or None, got {value!r}")


def _clamp(specs, attrs):
    _bound(attrs["min"], "min")
    _bound(attrs["max"], "max")
    if attrs["min"] is None and attrs["max"] is None:
        fail("give min, max or both")
    return _same(specs, attrs)


def _clamped(v, low, high):
    """min(max(v, low), high) as selects that keep a NaN ``v``, as torch.clamp does."""
    dtype = v.ty.dtype
    if low is not None:
        low = tvm.tirx.const(low, dtype)
        v = tvm.tirx.Select(v < low, low, v)
    if high is not None:
        high = tvm.tirx.const(high, dtype)
        v = tvm.tirx.Select(v > high, high, v)
    return v


@register_op("clamp", infer=_clamp, n_inputs=1, attrs={"min": None, "max": None})
def clamp(inputs, min, max):  # noqa: A002  (torch's argument names)
    """torch.clamp with constant bounds (relu6 and hardtanh included)."""
    return _elementwise(inputs[0], lambda v: _clamped(v, min, max), "clamp")


@export_rule("clamp")
def _clamp_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    low = "" if attrs["min"] is None else e.scalar(float(attrs["min"]), x)
    high = "" if attrs["max"] is None else e.scalar(float(attrs["max"]), x)
    e.node("Clip", [x, low, high], outputs)


@register_op("hardsigmoid", infer=_float_same, n_inputs=1)
def hardsigmoid(inputs):
    """clamp(x + 3, 0, 6) / 6, as torch.nn.Hardsigmoid."""
    x = inputs[0]
    return _elementwise(x, lambda v: _clamped(v + _const(3.0, x), 0.0, 6.0) / _const(6.0, x), "hardsigmoid")


@export_rule("hardsigmoid")
def _hardsigmoid_onnx(e, inputs, outputs, attrs):
    e.node("HardSigmoid", inputs, outputs, alpha=1.0 / 6.0, beta=0.5)


@register_op("hardswish", infer=_float_same, n_inputs=1)
def hardswish(inputs):
    """x * clamp(x + 3, 0, 6) / 6, as torch.nn.Hardswish (so hardswish(-inf) is NaN, as in torch)."""
    x = inputs[0]
    return _elementwise(x, lambda v: v * _clamped(v + _const(3.0, x), 0.0, 6.0) / _const(6.0, x), "hardswish")


@export_rule("hardswish")
def _hardswish_onnx(e, inputs, outputs, attrs):
    e.node("HardSwish", inputs, outputs)


@register_op("gelu_tanh", infer=_float_same, n_inputs=1, widen=True)
def gelu_tanh(inputs):
    """torch.nn.GELU(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    x = inputs[0]
    half, one, cubic, k = _const(0.5, x), _const(1.0, x), _const(0.044715, x), _const(math.sqrt(2.0 / math.pi), x)
    return _elementwise(x, lambda v: half * v * (one + te.tanh(k * (v + cubic * v * v * v))), "gelu_tanh")


@export_rule("gelu_tanh")
def _gelu_tanh_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    cube = e.node("Mul", [e.node("Mul", [x, x]), x])
    inner = e.node("Mul", [e.scalar(math.sqrt(2.0 / math.pi), x), e.node("Add", [x, e.node("Mul", [e.scalar(0.044715, x), cube])])])
    half_x = e.node("Mul", [e.scalar(0.5, x), x])
    e.node("Mul", [half_x, e.node("Add", [e.scalar(1.0, x), e.node("Tanh", [inner])])], outputs)


def _cast(specs, attrs):
    if attrs["dtype"] not in SUPPORTED_DTYPES:
        fail(f"dtype {attrs['dtype']!r} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})")
    return [(specs[0].shape, attrs["dtype"])]


@register_op("cast", infer=_cast, n_inputs=1, attrs={"dtype": "float32"})
def cast(inputs, dtype):
    """x converted to ``dtype``, as tensor.to(dtype) (a float becomes an integer by truncation)."""
    return topi.cast(inputs[0], dtype)


_ONNX_DTYPES = {"float32": 1, "int32": 6, "int64": 7, "float16": 10, "bfloat16": 16}


@export_rule("cast")
def _cast_onnx(e, inputs, outputs, attrs):
    e.node("Cast", inputs, outputs, to=_ONNX_DTYPES[attrs["dtype"]])
