"""Export a souffle ``Graph`` to ONNX, so that ONNX Runtime and TVM's Relax ONNX frontend serve as
baselines that compute exactly what Souffle computes, on the same weights.

Each op kind has one export rule (``@onnx_rule``), written from the op's TE lowering, which is the
ground truth of its semantics. Scans are unrolled: TVM's Relax frontend has no Loop or Scan, and an
unrolled iteration reads its own layer's weights as the model's own initializers, each stored once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from souffle.errors import SouffleError
from souffle.graph import Graph, Scan, TensorSpec
from souffle.ops import REGISTRY
from souffle.ops.common import int_list, normalize_axis, prod
from souffle.ops.nn import _mean_axes, _window_attrs, _window_count
from souffle.ops.registry import full_attrs
from souffle.ops.shape import (
    _flat_shape,
    _permutation,
    _reshape_target,
    _slice_bounds,
    _split_sizes,
)

__all__ = ["ONNX_RULES", "Emitter", "ExportError", "onnx_rule", "to_onnx"]

MIN_OPSET = 17  # LayerNormalization


class ExportError(SouffleError, ValueError):
    """A graph that cannot be written as ONNX: no weights, or an op kind with no export rule."""


class Emitter:
    """What an export rule writes into: ONNX nodes in execution order, and the static shape and
    dtype of every souffle tensor's ONNX value (rules need them for ranks, axes and constants)."""

    def __init__(self, opset: int, reserved: Iterable[str]):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        # A scan's stacked output -> its per-iteration values, so that a later scan slicing it
        # reads the value itself instead of gathering it back out of the stack.
        self.stacks: dict[str, list[str]] = {}
        self._taken = set(reserved)
        self._constants: dict[tuple, str] = {}
        self._transposed: dict[str, str] = {}

    def fresh(self, base: str) -> str:
        """A value name not used yet, ``base`` itself when it is free."""
        name, k = base, 0
        while name in self._taken:
            k += 1
            name = f"{base}_{k}"
        self._taken.add(name)
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.specs[name][0]

    def dtype(self, name: str) -> str:
        return self.specs[name][1]

    def node(self, op_type: str, inputs: Sequence[str], outputs: str | Sequence[str] | None = None, **attrs) -> str:
        """Append one node; returns its (first) output, a fresh name unless ``outputs`` names it."""
        if outputs is None:
            outputs = [self.fresh(op_type.lower())]
        elif isinstance(outputs, str):
            outputs = [outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=outputs[0], **attrs))
        return outputs[0]

    def const(self, values, dtype: str = "int64") -> str:
        """A Constant node (one per distinct value): shapes, axes, indices, scalars. Constants are
        nodes, not initializers, so the initializers are exactly the model's weights."""
        array = np.asarray(values, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.fresh("const")
            self.node("Constant", [], name, value=numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def transposed(self, matrix: str) -> str:
        """``matrix`` transposed by one node shared by every reader. Values are named once (SSA),
        so an unrolled scan's 100 steps reading one layer's weight share its transpose: a compiler
        that folds it makes one copy, not one per step."""
        if matrix not in self._transposed:
            self._transposed[matrix] = self.node("Transpose", [matrix], perm=[1, 0])
        return self._transposed[matrix]

    def scalar(self, value: float, like: str) -> str:
        """A 0-d constant of ``like``'s dtype, to broadcast against it."""
        return self.const(value, self.dtype(like))


Rule = Callable[[Emitter, list[str], list[str], dict[str, object]], None]

ONNX_RULES: dict[str, Rule] = {}


def onnx_rule(kind: str) -> Callable[[Rule], Rule]:
    """Register ``rule(emitter, inputs, outputs, attrs)``, which appends the nodes that compute op
    ``kind``: ``inputs`` and ``outputs`` are ONNX value names, ``attrs`` has the op's defaults filled in."""
    if kind not in REGISTRY:
        raise ValueError(f"op {kind!r} is not registered; nothing to export")

    def decorate(rule: Rule) -> Rule:
        if kind in ONNX_RULES:
            raise ValueError(f"op {kind!r} has two ONNX export rules")
        ONNX_RULES[kind] = rule
        return rule

    return decorate


def to_onnx(graph: Graph, opset: int = MIN_OPSET) -> onnx.ModelProto:
    """``graph`` as an ONNX model: the same inputs and outputs (names, order, shapes, dtypes), its
    weights as initializers, scans unrolled. The caller checks it with ``onnx.checker`` if wanted."""
    if graph.weights is None:
        raise ExportError(
            f"graph {graph.name!r} has no weights: ONNX stores them as initializers, so build it with "
            "weights (souffle.models.build, or Graph.with_weights)"
        )
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise ExportError(f"opset {opset} is not supported; use {MIN_OPSET} to {newest}")
    _check_rules(graph, "")

    emitter = Emitter(opset, reserved=graph.tensors)  # unrolled names must not take the graph's own
    env = {}
    for spec in (*graph.inputs, *graph.params.values()):
        env[spec.name] = spec.name
        emitter.specs[spec.name] = (spec.shape, spec.dtype)
    _emit_graph(emitter, graph, env, "")
    for name in graph.outputs:
        if env[name] != name:  # a scan's final carry, known by its last iteration's name
            emitter.node("Identity", [env[name]], name)

    nodes = _live_nodes(emitter.nodes, graph.outputs)
    inputs = [_value_info(spec) for spec in graph.inputs]
    outputs = [_value_info(graph.tensors[name]) for name in graph.outputs]
    model = helper.make_model_gen_version(
        helper.make_graph(nodes, graph.name, inputs, outputs),
        producer_name="souffle",
        opset_imports=[helper.make_opsetid("", opset)],
    )
    # Weights go in last, straight into the model: make_model copies the graph it is given.
    read = {n for node in nodes for n in node.input}
    model.graph.initializer.extend(
        numpy_helper.from_array(array, name) for name, array in graph.weights.items() if name in read
    )
    return model


# -- walking the graph -------------------------------------------------------------------------
def _check_rules(graph: Graph, where: str):
    """Refuse an op without a rule before unrolling anything, naming the op and its tensor."""
    for op in graph.ops:
        if isinstance(op, Scan):
            _check_rules(op.body, f"{where}{op.name}/")
        elif op.kind not in ONNX_RULES:
            raise ExportError(
                f"op {op.kind!r} (output {where + op.outputs[0]!r}) has no ONNX export rule; "
                f"rules exist for: {', '.join(sorted(ONNX_RULES))}"
            )


def _emit_graph(emitter: Emitter, graph: Graph, env: dict[str, str], prefix: str):
    """Append ``graph``'s ops; ``env`` maps its tensor names to ONNX value names (inputs and params
    bound by the caller), and its ops' outputs are named ``prefix + name``."""
    for op in graph.ops:
        if isinstance(op, Scan):
            _emit_scan(emitter, op, env, prefix)
            continue
        outputs = []
        for name in op.outputs:
            env[name] = emitter.fresh(prefix + name) if prefix else name
            spec = graph.tensors[name]
            emitter.specs[env[name]] = (spec.shape, spec.dtype)
            outputs.append(env[name])
        attrs = full_attrs(REGISTRY[op.kind], op.attrs, f"op {op.outputs[0]!r} ({op.kind})")
        ONNX_RULES[op.kind](emitter, [env[n] for n in op.inputs], outputs, attrs)


def _emit_scan(emitter: Emitter, scan: Scan, env: dict[str, str], prefix: str):
    """The scan unrolled: iteration i's body tensors are named ``{prefix}{scan.name}.{i}/...``."""
    body = scan.body
    carry = {body_in: env[init] for body_in, _, init, _ in scan.carry}
    stacked: dict[str, list[str]] = {body_out: [] for body_out, _ in scan.ys}
    for i in range(scan.length):
        inner = dict(carry)
        for body_in, seq in scan.xs:
            inner[body_in] = _element(emitter, env[seq], i, body.tensors[body_in])
        for body_in, outer in scan.invariants:
            inner[body_in] = env[outer]
        for body_param, names in scan.params:
            inner[body_param] = env[names[i]]
        _emit_graph(emitter, body, inner, f"{prefix}{scan.name}.{i}/")
        carry = {body_in: inner[body_out] for body_in, body_out, _, _ in scan.carry}
        for body_out, values in stacked.items():
            values.append(inner[body_out])
    for body_in, _, _, final in scan.carry:
        env[final] = carry[body_in]
    for body_out, outer in scan.ys:
        env[outer] = emitter.fresh(prefix + outer) if prefix else outer
        spec = body.tensors[body_out]
        emitter.specs[env[outer]] = ((scan.length,) + spec.shape, spec.dtype)
        axis0 = emitter.const([0])
        rows = [emitter.node("Unsqueeze", [value, axis0]) for value in stacked[body_out]]
        emitter.node("Concat", rows, env[outer], axis=0)
        emitter.stacks[env[outer]] = stacked[body_out]


def _element(emitter: Emitter, seq: str, i: int, spec: TensorSpec) -> str:
    """Slice ``i`` of ``seq`` along axis 0, read straight from the stacked values when there are any."""
    if seq in emitter.stacks:
        return emitter.stacks[seq][i]
    row = emitter.node("Slice", [seq, emitter.const([i]), emitter.const([i + 1]), emitter.const([0])],
                       emitter.fresh(f"{seq}[{i}:{i + 1}]"))
    name = emitter.node("Squeeze", [row, emitter.const([0])], emitter.fresh(f"{seq}[{i}]"))
    emitter.specs[name] = (spec.shape, spec.dtype)
    return name


def _live_nodes(nodes: list[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in order; a stack that later scans only read value by
    value, and nothing reads whole, goes."""
    live = set(outputs)
    kept = []
    for node in reversed(nodes):
        if live.intersection(node.output):
            kept.append(node)
            live.update(node.input)
    return kept[::-1]


def _value_info(spec: TensorSpec) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(spec.name, helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype)), spec.shape)


# -- rules: elementwise --------------------------------------------------------------------------
def _same_op(kind: str, op_type: str):
    @onnx_rule(kind)
    def rule(e: Emitter, inputs, outputs, attrs):
        e.node(op_type, inputs, outputs)

    rule.__doc__ = f"souffle {kind} is ONNX {op_type} (NumPy broadcasting for binary ops, as topi's)."


for _kind, _op_type in {
    "relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "copy": "Identity",
    "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div",
}.items():
    _same_op(_kind, _op_type)


@onnx_rule("gelu")
def _gelu(e: Emitter, inputs, outputs, attrs):
    """Exact GELU, 0.5 * x * (1 + erf(x / sqrt(2))), in the lowering's order of operations."""
    (x,) = inputs
    erf = e.node("Erf", [e.node("Mul", [x, e.scalar(1.0 / np.sqrt(2.0), x)])])
    half_x = e.node("Mul", [e.scalar(0.5, x), x])
    e.node("Mul", [half_x, e.node("Add", [e.scalar(1.0, x), erf])], outputs)


@onnx_rule("silu")
def _silu(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Mul", [x, e.node("Sigmoid", [x])], outputs)


@onnx_rule("scale")
def _scale(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Mul", [x, e.scalar(float(attrs["factor"]), x)], outputs)


@onnx_rule("full")
def _full(e: Emitter, inputs, outputs, attrs):
    """ConstantOfShape, not a Constant holding every element: the model stays small."""
    fill = numpy_helper.from_array(np.array([attrs["value"]], dtype=attrs["dtype"]))
    e.node("ConstantOfShape", [e.const(int_list(attrs["shape"], "shape"))], outputs, value=fill)


# -- rules: matrix products ----------------------------------------------------------------------
def _swap_last_two(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


@onnx_rule("dense")
def _dense(e: Emitter, inputs, outputs, attrs):
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


@onnx_rule("matmul")
def _matmul(e: Emitter, inputs, outputs, attrs):
    """torch.matmul is ONNX MatMul (batch dimensions broadcast alike)."""
    a, b = inputs
    if attrs["transpose_b"]:
        b = e.node("Transpose", [b], perm=_swap_last_two(len(e.shape(b))))
    e.node("MatMul", [a, b], outputs)


@onnx_rule("batch_matmul")
def _batch_matmul(e: Emitter, inputs, outputs, attrs):
    a, b = inputs
    if attrs["transpose_a"]:
        a = e.node("Transpose", [a], perm=[0, 2, 1])
    if attrs["transpose_b"]:
        b = e.node("Transpose", [b], perm=[0, 2, 1])
    e.node("MatMul", [a, b], outputs)


# -- rules: convolution, normalization, pooling --------------------------------------------------
@onnx_rule("conv2d")
def _conv2d(e: Emitter, inputs, outputs, attrs):
    _, stride, padding, dilation = _window_attrs(attrs)
    e.node(
        "Conv", inputs, outputs, kernel_shape=list(e.shape(inputs[1])[2:]), strides=list(stride),
        pads=[*padding, *padding], dilations=list(dilation), group=int(attrs["groups"]),
    )


@onnx_rule("batch_norm")
def _batch_norm(e: Emitter, inputs, outputs, attrs):
    """Inference mode: (x - mean) / sqrt(var + eps) * gamma + beta; ONNX takes the same input order."""
    e.node("BatchNormalization", inputs, outputs, epsilon=float(attrs["eps"]))


@onnx_rule("layer_norm")
def _layer_norm(e: Emitter, inputs, outputs, attrs):
    e.node("LayerNormalization", inputs, outputs, axis=-1, epsilon=float(attrs["eps"]))


@onnx_rule("softmax")
def _softmax(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Softmax", [x], outputs, axis=normalize_axis(attrs["axis"], len(e.shape(x))))


def _pool_window(e: Emitter, x: str, attrs) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
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


@onnx_rule("max_pool2d")
def _max_pool2d(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    kernel, stride, begin, end, dilation = _pool_window(e, x, attrs)
    e.node("MaxPool", [x], outputs, kernel_shape=kernel, strides=stride, pads=begin + end, dilations=dilation)


@onnx_rule("avg_pool2d")
def _avg_pool2d(e: Emitter, inputs, outputs, attrs):
    """torch's divisor counts the padding but not a ceil_mode window's overhang past it: then the
    padding is explicit zeros, and the pool counts only what is left."""
    (x,) = inputs
    kernel, stride, begin, end, _ = _pool_window(e, x, attrs)
    include = attrs["count_include_pad"]
    if include and end != begin:
        x = e.node("Pad", [x, e.const([0, 0, *begin, 0, 0, *begin])])
        begin, end, include = [0, 0], [b - a for a, b in zip(begin, end)], False
    e.node(
        "AveragePool", [x], outputs, kernel_shape=kernel, strides=stride, pads=begin + end,
        count_include_pad=int(include),
    )


@onnx_rule("global_avg_pool2d")
def _global_avg_pool2d(e: Emitter, inputs, outputs, attrs):
    e.node("GlobalAveragePool", inputs, outputs)


@onnx_rule("mean")
def _mean(e: Emitter, inputs, outputs, attrs):
    """ReduceMean takes its axes as an attribute up to opset 17 and as an input from 18."""
    (x,) = inputs
    axes = list(_mean_axes(len(e.shape(x)), attrs["axes"]))
    keepdims = int(attrs["keepdims"])
    if e.opset >= 18:
        e.node("ReduceMean", [x, e.const(axes)], outputs, keepdims=keepdims)
    else:
        e.node("ReduceMean", [x], outputs, axes=axes, keepdims=keepdims)


@onnx_rule("embedding")
def _embedding(e: Emitter, inputs, outputs, attrs):
    """Ids are clamped into [0, V) first, as the lowering's take(mode="clip") does: ONNX Gather
    would wrap a negative id and reject one past the end."""
    table, ids = inputs
    low, high = e.const(0, e.dtype(ids)), e.const(e.shape(table)[0] - 1, e.dtype(ids))
    e.node("Gather", [table, e.node("Clip", [ids, low, high])], outputs, axis=0)


# -- rules: shape --------------------------------------------------------------------------------
@onnx_rule("reshape")
def _reshape(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Reshape", [x, e.const(_reshape_target(e.shape(x), attrs["shape"]))], outputs)


@onnx_rule("flatten")
def _flatten(e: Emitter, inputs, outputs, attrs):
    """Reshape, since ONNX Flatten always makes a 2-D result."""
    (x,) = inputs
    e.node("Reshape", [x, e.const(_flat_shape(e.shape(x), attrs["start_dim"], attrs["end_dim"]))], outputs)


@onnx_rule("transpose")
def _transpose(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    e.node("Transpose", [x], outputs, perm=list(_permutation(len(e.shape(x)), attrs["axes"])))


@onnx_rule("concat")
def _concat(e: Emitter, inputs, outputs, attrs):
    e.node("Concat", inputs, outputs, axis=normalize_axis(attrs["axis"], len(e.shape(inputs[0]))))


@onnx_rule("slice")
def _slice(e: Emitter, inputs, outputs, attrs):
    """Bounds already resolved by Python's slicing rules, as the lowering resolves them."""
    (x,) = inputs
    axes, starts, stops, steps, _ = _slice_bounds(e.shape(x), **attrs)
    e.node("Slice", [x, e.const(starts), e.const(stops), e.const(list(axes)), e.const(list(steps))], outputs)


@onnx_rule("split")
def _split(e: Emitter, inputs, outputs, attrs):
    (x,) = inputs
    axis, pieces = _split_sizes(e.shape(x), **attrs)
    e.node("Split", [x, e.const(list(pieces))], outputs, axis=axis)
