"""Elementwise ops: unary activations, NumPy-broadcasting binary arithmetic, constants."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import te, topi

from souffle.ops.common import (ieee_constant, ieee_sub, int_list, is_real, nan_max, require_finite, require_float,
                                require_same_dtype, shape_of)
from souffle.ops.registry import export_rule, fail, register_op
from souffle.tensor import SUPPORTED_DTYPES, is_float


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting of two shapes, or a refusal naming both."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and 1 not in (da, db):
            fail(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(max(da, db))
    return tuple(reversed(out))


def _same(specs, attrs):
    return [(specs[0].shape, specs[0].dtype)]


def _float_same(specs, attrs):
    require_float(specs[0])
    return _same(specs, attrs)


def _binary(specs, attrs):
    require_same_dtype(specs)
    return [(broadcast_shape(specs[0].shape, specs[1].shape), specs[0].dtype)]


def _float_binary(specs, attrs):
    """Division is true division in torch, so integer inputs would change meaning."""
    require_float(*specs)
    return _binary(specs, attrs)


def _broadcast(a: te.Tensor, b: te.Tensor, combine, name: str) -> te.Tensor:
    """combine(a, b) elementwise over the NumPy broadcast of their shapes, indexed as topi's
    broadcast ops index (a dimension of size 1 read at 0), for ops topi's form would not keep."""
    shape = broadcast_shape(shape_of(a), shape_of(b))

    def element(tensor: te.Tensor, index):
        dims = shape_of(tensor)
        return tensor(*(0 if d == 1 else i for d, i in zip(dims, index[len(index) - len(dims):])))

    return te.compute(shape, lambda *i: combine(element(a, i), element(b, i)), name=name, tag=topi.tag.BROADCAST)


def _const(value: float, like: te.Tensor):
    return ieee_constant(value, str(like.dtype))


def _onnx_node(op_type: str):
    """The export rule of an op that is one ONNX ``op_type`` node on the same inputs (binary
    ops broadcast as NumPy does, as topi's do)."""

    def export(e, inputs, outputs, attrs):
        e.node(op_type, inputs, outputs)

    return export


@register_op("relu", infer=_same, n_inputs=1)
def relu(inputs):
    """max(x, 0) that keeps NaN, as torch.relu (topi's relu would make it 0)."""
    x = inputs[0]
    zero = tvm.tirx.const(0, x.dtype)
    return te.compute(x.shape, lambda *i: nan_max(x(*i), zero), name="compute", tag=topi.tag.ELEMWISE)


export_rule("relu")(_onnx_node("Relu"))


@register_op("sigmoid", infer=_float_same, n_inputs=1, widen=True)
def sigmoid(inputs):
    return topi.sigmoid(inputs[0])


export_rule("sigmoid")(_onnx_node("Sigmoid"))


@register_op("tanh", infer=_float_same, n_inputs=1, widen=True)
def tanh(inputs):
    return topi.tanh(inputs[0])


export_rule("tanh")(_onnx_node("Tanh"))


@register_op("gelu", infer=_float_same, n_inputs=1, widen=True)
def gelu(inputs):
    """Exact GELU, x * Phi(x) with erf, as torch.nn.GELU() (not the tanh approximation)."""
    x = inputs[0]
    half, one, inv_sqrt2 = _const(0.5, x), _const(1.0, x), _const(1.0 / math.sqrt(2.0), x)
    return te.compute(x.shape, lambda *i: half * x(*i) * (one + te.erf(x(*i) * inv_sqrt2)), name="gelu")


@export_rule("gelu")
def _gelu_onnx(e, inputs, outputs, attrs):
    """Exact GELU, 0.5 * x * (1 + erf(x / sqrt(2))), in the lowering's order of operations."""
    (x,) = inputs
    erf = e.node("Erf", [e.node("Mul", [x, e.scalar(1.0 / math.sqrt(2.0), x)])])
    half_x = e.node("Mul", [e.scalar(0.5, x), x])
    e.node("Mul", [half_x, e.node("Add", [e.scalar(1.0, x), erf])], outputs)


@register_op("silu", infer=_float_same, n_inputs=1, widen=True)
def silu(inputs):
    """x * sigmoid(x), as torch.nn.SiLU()."""
    x = inputs[0]
    return te.compute(x.shape, lambda *i: x(*i) * te.sigmoid(x(*i)), name="silu")


@export_rule("silu")
def _silu_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Mul", [x, e.node("Sigmoid", [x])], outputs)


@register_op("add", infer=_binary, n_inputs=2)
def add(inputs):
    return topi.add(inputs[0], inputs[1])


export_rule("add")(_onnx_node("Add"))


@register_op("sub", infer=_binary, n_inputs=2)
def sub(inputs):
    return _broadcast(inputs[0], inputs[1], ieee_sub, "T_subtract")


export_rule("sub")(_onnx_node("Sub"))


@register_op("mul", infer=_binary, n_inputs=2)
def mul(inputs):
    return topi.multiply(inputs[0], inputs[1])


export_rule("mul")(_onnx_node("Mul"))


@register_op("div", infer=_float_binary, n_inputs=2)
def div(inputs):
    return topi.divide(inputs[0], inputs[1])


export_rule("div")(_onnx_node("Div"))


def _scale(specs, attrs):
    require_finite(attrs, "factor")
    return _float_same(specs, attrs)


@register_op("scale", infer=_scale, n_inputs=1, attrs={"factor": 1.0})
def scale(inputs, factor):
    """x * factor with a compile-time constant (e.g. attention's 1/sqrt(d))."""
    return topi.multiply(inputs[0], _const(float(factor), inputs[0]))


@export_rule("scale")
def _scale_onnx(e, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Mul", [x, e.scalar(float(attrs["factor"]), x)], outputs)


@register_op("copy", infer=_same, n_inputs=1)
def copy(inputs):
    """A fresh tensor equal to the input (an op's output must be its own buffer)."""
    return topi.identity(inputs[0])


export_rule("copy")(_onnx_node("Identity"))


def _full(specs, attrs):
    if attrs["shape"] is None:
        fail("shape is required")
    shape = int_list(attrs["shape"], "shape", minimum=1)
    dtype, value = attrs["dtype"], attrs["value"]
    if dtype not in SUPPORTED_DTYPES:
        fail(f"dtype {dtype!r} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})")
    if not is_real(value):
        fail(f"value must be a number, got {value!r}")
    if dtype.startswith("int"):
        info = np.iinfo(dtype)
        if not float(value).is_integer() or not info.min <= int(value) <= info.max:
            fail(f"value {value!r} is not representable as {dtype} (integers in [{info.min}, {info.max}])")
    return [(shape, dtype)]


@register_op("full", infer=_full, n_inputs=0, attrs={"shape": None, "value": 0.0, "dtype": "float32"})
def full(inputs, shape, value, dtype):
    """A constant tensor, like torch.full."""
    fill = ieee_constant(value if is_float(dtype) else int(value), dtype)
    return te.compute(int_list(shape, "shape"), lambda *_: fill, name="T_full", tag=topi.tag.ELEMWISE)


@export_rule("full")
def _full_onnx(e, inputs, outputs, attrs):
    """ConstantOfShape, not a Constant holding every element: the model stays small."""
    fill = np.array([attrs["value"]], dtype=attrs["dtype"])
    e.node("ConstantOfShape", [e.const(int_list(attrs["shape"], "shape"))], outputs, value=fill)
