"""Export a souffle ``Graph`` to ONNX, so that ONNX Runtime and TVM's Relax ONNX frontend serve as
baselines that compute exactly what Souffle computes, on the same weights.

Each op kind's export rule is declared beside its TE lowering, the ground truth of its semantics,
and kept in the op registry (``souffle.ops.registry.export_rule``). This module holds what the rules
write into (``Emitter``), the walk over the graph and the model's assembly. Scans are unrolled: TVM's
Relax frontend has no Loop or Scan, and an unrolled iteration reads its own layer's weights as the
model's own initializers, each stored once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from souffle.errors import ExportError
from souffle.graph import Graph, Scan, TensorSpec
from souffle.naming import UniqueNames
from souffle.ops import REGISTRY, get_export_rule
from souffle.ops.registry import full_attrs

__all__ = ["Emitter", "ExportError", "to_onnx"]

MIN_OPSET = 17  # LayerNormalization


class Emitter:
    """What an export rule (``souffle.ops.registry.export_rule``) writes into: ONNX nodes in execution
    order, and the static shape and dtype of every souffle tensor's ONNX value (rules need them for
    ranks, axes and constants)."""

    def __init__(self, opset: int, reserved: Iterable[str]):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        # A scan's stacked output -> its per-iteration values, so that a later scan slicing it
        # reads the value itself instead of gathering it back out of the stack.
        self.stacks: dict[str, list[str]] = {}
        self._names = UniqueNames(reserved, separator="_")
        self._constants: dict[tuple, str] = {}
        self._transposed: dict[str, str] = {}

    def fresh(self, base: str) -> str:
        """A value name not used yet: ``base`` itself when it is free, else ``base_2``, ``base_3``, ..."""
        return self._names(base)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.specs[name][0]

    def dtype(self, name: str) -> str:
        return self.specs[name][1]

    def node(self, op_type: str, inputs: Sequence[str], outputs: str | Sequence[str] | None = None, **attrs) -> str:
        """Append one node; returns its (first) output, a fresh name unless ``outputs`` names it.
        An ndarray attribute becomes an ONNX tensor, so that the rules need no onnx of their own."""
        if outputs is None:
            outputs = [self.fresh(op_type.lower())]
        elif isinstance(outputs, str):
            outputs = [outputs]
        attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}
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
        else:
            get_export_rule(op.kind, where + op.outputs[0])


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
        REGISTRY[op.kind].export(emitter, [env[n] for n in op.inputs], outputs, attrs)


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
