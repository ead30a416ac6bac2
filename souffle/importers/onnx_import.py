"""``from_onnx``: an ONNX model (opsets 13 to 21) as a souffle Graph.

Initializers become weights under their own names (where an op reads them; one only
transposed or reshaped at import time becomes its result's weight), graph inputs the graph's
inputs. A node
whose inputs are all known at import time (Constant, Shape of a static tensor, arithmetic on
shapes, a Transpose of an initializer) is computed by onnx's reference evaluator and becomes
a constant; any other node goes to its conversion rule (``souffle.importers.onnx_rules``).
A bool tensor (a mask) is an int32 mask of 0s and 1s (``souffle.ops.logical``); ``ctx.dtype``
says "bool" for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from souffle.errors import GraphError, ModelImportError, UnsupportedOpError
from souffle.graph import Graph, GraphBuilder
from souffle.importers import onnx_rules
from souffle.importers.prune import without_dead_ops
from souffle.importers.repeats import fold_repeated_blocks
from souffle.naming import UniqueNames
from souffle.ops.logical import MASK_DTYPE
from souffle.tensor import IMPORTED_DTYPES

__all__ = ["OPSETS", "from_onnx"]

OPSETS = range(13, 22)


@dataclass(frozen=True)
class Tensor:
    """A tensor of the graph being built, by name."""

    name: str


@dataclass(frozen=True)
class Constant:
    """An array known at import time; a weight (or a ``full`` op) only where an op reads it."""

    value: np.ndarray
    name: str


def from_onnx(path_or_model, input_shapes: dict[str, tuple[int, ...]] | None = None) -> Graph:
    """The ONNX model at ``path_or_model`` (a path or an onnx.ModelProto) as a Graph.

    ``input_shapes`` fixes the shape of inputs whose ONNX shape is symbolic (``batch``); souffle
    compiles static shapes."""
    import onnx

    if isinstance(path_or_model, (str, Path)):
        try:
            model = onnx.load(str(path_or_model))
        except Exception as err:  # onnx raises several types for a missing or malformed file
            raise ModelImportError(f"cannot read ONNX model {str(path_or_model)!r}: {err}") from None
    elif isinstance(path_or_model, onnx.ModelProto):
        model = path_or_model
    else:
        raise ModelImportError(f"from_onnx takes a path or an onnx.ModelProto, got {type(path_or_model).__name__}")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset not in OPSETS:
        raise ModelImportError(f"ONNX opset {opset} is not supported; souffle imports opsets {OPSETS.start} to {OPSETS.stop - 1}")
    name = model.graph.name or "onnx_model"
    return _Importer(model, opset, name, dict(input_shapes or {})).run()


def _dtype(array_dtype, what: str) -> str:
    dtype = str(np.dtype(array_dtype))
    if dtype not in IMPORTED_DTYPES:
        raise ModelImportError(f"{what} is {dtype}; souffle imports {', '.join(IMPORTED_DTYPES)}")
    return dtype


class _Importer:
    """One walk over an ONNX graph; the context every conversion rule gets."""

    def __init__(self, model, opset: int, name: str, input_shapes: dict):
        self.model = model
        self.opset = opset
        self.builder = GraphBuilder(name)
        self.values: dict[str, object] = {}
        self.node = None
        self.input_shapes = input_shapes
        self._names = UniqueNames(separator=".")
        self._materialized: dict[str, str] = {}
        self._sources: set[str] = set()
        self._reshaped_from: dict[str, Tensor] = {}
        self._bools: set[str] = set()  # int32 masks that stand for ONNX bool tensors
        # dense ops a MatMul made without a bias, by output: (input, weight), for a bias added next
        self.unbiased_products: dict[str, tuple] = {}

    def run(self) -> Graph:
        from onnx import helper, numpy_helper

        graph = self.model.graph
        initializers = {init.name: init for init in graph.initializer}
        for name in [*initializers, *(i.name for i in graph.input)]:
            self._names.reserve(name)
        for value in graph.input:
            if value.name not in initializers:
                self.values[value.name] = self._input(value)
        unknown = sorted(set(self.input_shapes) - {i.name for i in graph.input})
        if unknown:
            raise ModelImportError(f"input_shapes names {unknown}, which are not inputs of the model")
        for name, init in initializers.items():
            self.values[name] = Constant(numpy_helper.to_array(init), name)
        for node in graph.node:
            self.node = node
            inputs = [self.values[n] if n else None for n in node.input]
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            results = self._convert(node, inputs, attrs)
            results = results if isinstance(results, (list, tuple)) else [results]
            for name, result in zip(node.output, results):
                if name:
                    self.values[name] = result
        self.node = None
        outputs = []
        for value in graph.output:
            name = self.tensor(self.values[value.name])
            if name in outputs or name in self._sources or name in self._materialized.values():
                name = self.builder.op("copy", name, name=self._names(f"{value.name}.out"))
            outputs.append(name)
        try:
            return fold_repeated_blocks(without_dead_ops(self.builder.build(*outputs)))
        except GraphError as err:
            raise ModelImportError(f"the imported graph is not valid: {err}") from None

    def _input(self, value) -> Tensor:
        from onnx import helper

        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]
        if value.name in self.input_shapes:
            given = tuple(int(d) for d in self.input_shapes[value.name])
            if len(given) != len(dims) or any(isinstance(d, int) and d != g for d, g in zip(dims, given)):
                raise ModelImportError(f"input {value.name!r} has shape {dims}; the given shape {list(given)} does not fit it")
            dims = list(given)
        symbolic = [(axis, d) for axis, d in enumerate(dims) if not isinstance(d, int)]
        if symbolic:
            axis, dim = symbolic[0]
            raise ModelImportError(
                f"input {value.name!r} has a symbolic dimension {axis} ({dim!r}): souffle compiles static shapes; "
                f"give its shape (from_onnx(..., input_shapes={{{value.name!r}: (...)}}), or --input-shape "
                f"{value.name}=... on the command line)")
        dtype = _dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type), f"input {value.name!r}")
        self._sources.add(value.name)
        return Tensor(self.builder.input(value.name, tuple(dims), dtype))

    def _convert(self, node, inputs, attrs):
        if node.domain not in ("", "ai.onnx"):
            self._unsupported(f"domain {node.domain!r}")
        constant = all(v is None or isinstance(v, Constant) for v in inputs)
        if node.op_type == "Shape" and isinstance(inputs[0], Tensor):
            start, end = attrs.get("start", 0), attrs.get("end")
            return Constant(np.array(self.shape(inputs[0])[start:end], dtype=np.int64), self._names(node.output[0]))
        if constant and node.op_type not in onnx_rules.NOT_FOLDED:
            return self._fold(node, inputs)
        rule = onnx_rules.RULES.get(node.op_type)
        if rule is None:
            self._unsupported("no conversion rule")
        try:
            return rule(self, inputs, attrs)
        except GraphError as err:
            self.fail(str(err))

    def _fold(self, node, inputs):
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        names = [f"in{i}" if v is not None else "" for i, v in enumerate(inputs)]
        folded = helper.make_node(node.op_type, names, list(node.output), domain=node.domain, **{
            a.name: helper.get_attribute_value(a) for a in node.attribute})
        feeds = {n: v.value for n, v in zip(names, inputs) if v is not None}
        graph = helper.make_graph([folded], "fold", [helper.make_tensor_value_info(n, 0, None) for n in feeds],
                                  [helper.make_tensor_value_info(o, 0, None) for o in node.output if o])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        results = ReferenceEvaluator(model).run(None, feeds)
        return [Constant(np.asarray(r), self._names(o)) for r, o in zip(results, [o for o in node.output if o])]

    def _unsupported(self, reason: str):
        node = self.node
        raise UnsupportedOpError(
            f"unsupported ONNX op {node.op_type!r} (node {node.name!r}, output {node.output[0]!r}): {reason}; "
            f"souffle converts the op types in souffle.importers.onnx_rules")

    # -- what the rules call ----------------------------------------------------------------
    def fail(self, reason: str):
        node = self.node
        raise UnsupportedOpError(f"cannot convert ONNX {node.op_type} (node {node.name!r}, output {node.output[0]!r}): {reason}")

    def op(self, kind: str, *inputs, **attrs):
        names = [self.tensor(v) for v in inputs]
        result = self.builder.op(kind, *names, name=self._names(self.node.output[0]), **attrs)
        return tuple(map(Tensor, result)) if isinstance(result, tuple) else Tensor(result)

    def tensor(self, value) -> str:
        """The graph tensor of ``value``; a constant becomes a ``full`` op when its elements are
        all equal, else a weight under its own name (an initializer's, or the folded node's output)."""
        if isinstance(value, Tensor):
            return value.name
        if not isinstance(value, Constant):
            self.fail(f"expected a tensor, got {value!r}")
        if value.name in self._materialized:
            return self._materialized[value.name]
        array = np.asarray(value.value)
        boolean = array.dtype == np.bool_
        if boolean:
            array = array.astype(MASK_DTYPE)
        dtype = _dtype(array.dtype, f"constant {value.name!r}")
        shape = array.shape or (1,)
        flat = array.reshape(-1)
        if flat.size and (flat == flat[0]).all():
            name = self.builder.op("full", name=self._names(f"{value.name}.full"), shape=shape,
                                   value=flat[0].item(), dtype=dtype)
        else:
            name = self.builder.param(value.name, np.ascontiguousarray(array.reshape(shape)), dtype)
            self._sources.add(name)
        if boolean:
            self._bools.add(name)
        self._materialized[value.name] = name
        return name

    def shape(self, value) -> tuple[int, ...]:
        if isinstance(value, Constant):
            return tuple(value.value.shape)
        return self.builder.spec(value.name).shape

    def dtype(self, value) -> str:
        """The value's dtype as numpy names it: "bool" for a mask that stands for a bool tensor."""
        if isinstance(value, Constant):
            return str(value.value.dtype)
        return "bool" if value.name in self._bools else self.builder.spec(value.name).dtype

    def mark_bool(self, value: Tensor) -> Tensor:
        """Record that ``value`` (an int32 mask a rule made) stands for a bool tensor."""
        self._bools.add(value.name)
        return value

    def is_constant(self, value) -> bool:
        return isinstance(value, Constant)

    def reshape(self, value, shape) -> Tensor:
        """``value`` reshaped; a reshape of a reshape reads the first one's input, and one back to
        that input's shape is the input itself (an LSTM's Y squeezed back into the next layer's
        sequence stays the scan's own output, as the wavefront pass needs)."""
        shape = tuple(int(d) for d in shape)
        source = self._reshaped_from.get(value.name, value) if isinstance(value, Tensor) else value
        if self.shape(source) == shape:
            return source
        result = self.op("reshape", source, shape=shape)
        if isinstance(source, Tensor):
            self._reshaped_from[result.name] = source
        return result

    def constant(self, array, name: str) -> Constant:
        return Constant(np.asarray(array), self._names(name))

    def value(self, name: str) -> Tensor:
        return Tensor(name)

    def fresh(self, base: str) -> str:
        return self._names(base)
