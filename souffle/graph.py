"""The graph IR: tensors, ops, parameters, and scans (repeated bodies).

A ``Graph`` is validated when it is built: every op kind must be registered,
every tensor an op reads must exist before it, and every op's input shapes and
dtypes must satisfy its rule (``souffle.ops``). Repeated structure (an LSTM's
time steps and layers, BERT's identical encoder layers) is a ``Scan`` whose
body is itself a ``Graph``: it is lowered once and looped, so a 1,000-cell LSTM
compiles as fast as one cell while staying one program.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from souffle.errors import GraphError, WeightError
# defined apart so that souffle.ops need not import the graph
from souffle.tensor import TensorSpec, dimension, is_float, largest_finite


def _infer_outputs(kind: str, in_specs: Sequence[TensorSpec], attrs: Mapping[str, object], name: str):
    """``souffle.ops.infer_outputs``, imported on first use: the ops' lowerings import TVM, and
    ``import souffle`` must not, so that a machine with only numpy and cuda-python loads kernels."""
    from souffle.ops import infer_outputs

    return infer_outputs(kind, in_specs, attrs, name)


@dataclass(frozen=True)
class Op:
    """One application of a registered op kind: named inputs -> named outputs."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __str__(self):
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs.items())
        return f"{', '.join(self.outputs)} = {self.kind}({', '.join(self.inputs)}{'; ' + attrs if attrs else ''})"


@dataclass(frozen=True)
class Scan:
    """A body graph applied ``length`` times, like ``jax.lax.scan``.

    carry:      (body input, body output, outer initial value, outer final value);
                iteration i reads the carry iteration i-1 wrote.
    xs:         (body input, outer tensor of shape (length, *body input shape)); slice i.
    ys:         (body output, outer tensor of shape (length, *body output shape)); slice i.
    invariants: (body input, outer tensor) read unchanged by every iteration.
    params:     (body parameter, outer weight names, one per iteration); stacked at
                compile time so iteration i reads its own layer's weights.
    """

    name: str
    body: "Graph"
    length: int
    carry: tuple[tuple[str, str, str, str], ...] = ()
    xs: tuple[tuple[str, str], ...] = ()
    ys: tuple[tuple[str, str], ...] = ()
    invariants: tuple[tuple[str, str], ...] = ()
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()

    kind = "scan"

    def __post_init__(self):
        object.__setattr__(self, "length", dimension(self.length, f"scan {self.name!r}: length"))

    @property
    def inputs(self) -> tuple[str, ...]:
        names = [c[2] for c in self.carry] + [x[1] for x in self.xs] + [v[1] for v in self.invariants]
        for _, outer in self.params:
            names.extend(outer)
        return tuple(names)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(c[3] for c in self.carry) + tuple(y[1] for y in self.ys)

    @property
    def attrs(self) -> Mapping[str, object]:
        return {"length": self.length}

    def __str__(self):
        body = "\n".join("    " + line for line in str(self.body).splitlines())
        return f"{', '.join(self.outputs)} = scan[{self.name}, length={self.length}](\n{body}\n)"


class Graph:
    """A validated dataflow graph with parameters.

    ``weights`` holds the parameter arrays of a top-level graph (a scan body has
    parameter specs only: its values come from the scan's stacked weights). ``recipes`` says,
    for a weight a transformation derived at compile time, how it is made from the model's
    own weights (``souffle.recipe``); a weight without one is the model's own. ``weight_notes``
    says how the given weights were taken (dtype conversions, keys a loader dropped); the
    compile report prints them.
    """

    def __init__(
        self,
        name: str,
        inputs: Sequence[TensorSpec],
        params: Sequence[TensorSpec],
        ops: Sequence[Op | Scan],
        outputs: Sequence[str],
        weights: Mapping[str, np.ndarray] | None = None,
        recipes: Mapping[str, list] | None = None,
    ):
        self.name = name
        self.inputs = tuple(inputs)
        self.params = {p.name: p for p in params}
        self.ops = tuple(ops)
        self.outputs = tuple(outputs)
        self.tensors: dict[str, TensorSpec] = {}
        self.producer: dict[str, Op | Scan] = {}
        self._validate()
        self.weight_notes: tuple[str, ...] = ()
        self.weights = None if weights is None else self._checked_weights(weights)
        self.recipes = dict(recipes or {})

    def recipe(self, name: str) -> list:
        """How weight ``name`` is made from the model's weights (``souffle.recipe``)."""
        return self.recipes.get(name, ["model", name])

    def with_ops(self, ops: Sequence[Op | Scan]) -> Graph:
        """This graph with ``ops`` in place of its own: the same inputs, parameters, outputs,
        weights, recipes and weight notes (what a graph pass's rewrite keeps)."""
        rewritten = Graph(self.name, self.inputs, list(self.params.values()), ops, self.outputs, self.weights,
                          self.recipes)
        rewritten.weight_notes = self.weight_notes
        return rewritten

    def rewritten(self, rewrite: Callable[[int, Op], Sequence[Op | Scan]],
                  scan: Callable[[Graph], Graph]) -> Graph:
        """A graph pass's rewrite: each op (at its index) replaced by the ops ``rewrite`` returns
        for it (none to drop it), each scan's body by ``scan`` of it, in order; this graph itself
        where nothing changed."""
        ops, changed = [], False
        for index, op in enumerate(self.ops):
            if isinstance(op, Scan):
                body = scan(op.body)
                new = [op if body is op.body else replace(op, body=body)]
            else:
                new = list(rewrite(index, op))
            changed |= len(new) != 1 or new[0] is not op
            ops += new
        return self.with_ops(ops) if changed else self

    def readers(self) -> dict[str, list[int]]:
        """Tensor name -> the indices of the ops that read it, in order."""
        found: dict[str, list[int]] = {}
        for index, op in enumerate(self.ops):
            for name in op.inputs:
                found.setdefault(name, []).append(index)
        return found

    # -- validation -------------------------------------------------------------------------
    def _define(self, spec: TensorSpec, what: str):
        if spec.name in self.tensors:
            raise GraphError(f"graph {self.name!r}: tensor {spec.name!r} ({what}) is defined twice")
        self.tensors[spec.name] = spec

    def _lookup(self, name: str, user: str) -> TensorSpec:
        try:
            return self.tensors[name]
        except KeyError:
            raise GraphError(
                f"graph {self.name!r}: {user} reads tensor {name!r}, which is not an input, "
                f"a parameter or the output of an earlier op"
            ) from None

    def _validate(self):
        for spec in self.inputs:
            self._define(spec, "input")
        for spec in self.params.values():
            self._define(spec, "parameter")
        for op in self.ops:
            in_specs = [self._lookup(n, f"op {op.outputs[0]!r} ({op.kind})") for n in op.inputs]
            if isinstance(op, Scan):
                out_specs = _infer_scan(op, in_specs)
            else:
                out_specs = _infer_outputs(op.kind, in_specs, op.attrs, op.outputs[0])
                if len(out_specs) != len(op.outputs):
                    raise GraphError(
                        f"op {op.outputs[0]!r} ({op.kind}) produces {len(out_specs)} outputs, "
                        f"but {len(op.outputs)} names were given"
                    )
            for name, (shape, dtype) in zip(op.outputs, out_specs):
                self._define(TensorSpec(name, shape, dtype), f"output of {op.kind}")
                self.producer[name] = op
        if not self.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        for name in self.outputs:
            self._lookup(name, "the graph's output list")

    def _checked_weights(self, weights: Mapping[str, object]) -> dict[str, np.ndarray]:
        if not isinstance(weights, Mapping):
            raise WeightError(
                f"weights for {self.name!r} must be a mapping from parameter name to array "
                f"(a dict or a PyTorch state_dict), not a {type(weights).__name__}"
            )
        missing = sorted(set(self.params) - set(weights))
        extra = sorted(set(weights) - set(self.params))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)}: {_short_list(missing)}")
            if extra:
                parts.append(f"unexpected {len(extra)}: {_short_list(extra)}")
            raise WeightError(f"weights for {self.name!r} do not match its parameters ({'; '.join(parts)})")
        checked = {}
        conversions: dict[tuple[str, str], int] = {}
        for name, spec in self.params.items():
            where = f"weight {name!r} of {self.name!r}"
            array, source = _weight_array(weights[name], where)
            if tuple(array.shape) != spec.shape:
                raise WeightError(f"{where} has shape {tuple(array.shape)}, expected {spec.shape}")
            checked[name] = _owned_weight(array, source, np.dtype(spec.dtype), where)
            if source != spec.dtype:
                conversions[source, spec.dtype] = conversions.get((source, spec.dtype), 0) + 1
        self.weight_notes = tuple(_conversion_note(source, dtype, count)
                                  for (source, dtype), count in sorted(conversions.items()))
        return checked

    # -- convenience ------------------------------------------------------------------------
    def with_weights(self, weights: Mapping[str, np.ndarray]) -> "Graph":
        """The same graph with other weights (e.g. a PyTorch state_dict): numpy arrays or torch
        tensors, copied into read-only arrays of the parameters' dtypes. Integers and half-precision
        floats (bfloat16, float16) must convert exactly; float32 and float64 may round to a narrower
        float's nearest value, but not overflow it."""
        return Graph(self.name, self.inputs, self.params.values(), self.ops, self.outputs, weights, self.recipes)

    def output_specs(self) -> list[TensorSpec]:
        return [self.tensors[n] for n in self.outputs]

    def op_count(self, executed: bool = False) -> int:
        """Ops in the graph; with ``executed``, scan bodies count once per iteration."""
        total = 0
        for op in self.ops:
            if isinstance(op, Scan):
                total += op.body.op_count(executed) * (op.length if executed else 1)
            else:
                total += 1
        return total

    def __str__(self):
        lines = [f"graph {self.name}("]
        lines += [f"  input {s}" for s in self.inputs]
        lines += [f"  param {s}" for s in self.params.values()]
        lines.append(")")
        lines += [f"  {op}" for op in self.ops]
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)


def _conversion_note(source: str, dtype: str, count: int) -> str:
    """How ``count`` weights given as ``source`` became the parameters' ``dtype``; a float narrowed
    to a smaller float is rounded to nearest (``_lost_values`` refuses only a value that overflows)."""
    rounded = is_float(dtype) and np.dtype(dtype).itemsize < _itemsize(source)
    return f"{count} tensor{'s' if count > 1 else ''} converted {source} -> {dtype}" + \
        (" (rounded to nearest)" if rounded else "")


def _itemsize(dtype: str) -> int:
    """Bytes per element of a numpy or torch dtype name (torch's bfloat16 and float8 have no numpy dtype)."""
    sizes = {"bfloat16": 2}
    return sizes[dtype] if dtype in sizes else 1 if dtype.startswith("float8") else np.dtype(dtype).itemsize


def _is_torch_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value) -> bool:
    return isinstance(value, np.ndarray) or _is_torch_tensor(value)


def _weight_array(value, where: str) -> tuple[np.ndarray, str]:
    """A weight given as a numpy array or a torch tensor, as a numpy array, and the dtype it was
    given in. Torch's bfloat16 (and float8) has no numpy dtype: it becomes float32, which holds
    every such value exactly; the dtype it came in still decides how it may convert."""
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        return array, str(array.dtype)
    if _is_torch_tensor(value):
        tensor = value.detach().cpu()
        source = str(tensor.dtype).removeprefix("torch.")
        if tensor.is_floating_point() and tensor.element_size() < 4 and source != "float16":
            tensor = tensor.float()
        try:
            return tensor.numpy(), source
        except TypeError:
            raise WeightError(f"{where} has torch dtype {source}, which has no numpy equivalent") from None
    raise WeightError(f"{where} is a {type(value).__name__}: a weight must be a numpy array or a torch tensor")


def _owned_weight(array: np.ndarray, source: str, dtype: np.dtype, where: str) -> np.ndarray:
    """``array`` as the graph's own read-only, C-contiguous ``dtype`` copy, so that neither the
    caller editing its array later nor an in-place edit of ``graph.weights`` changes the model."""
    if array.dtype == dtype and array.flags.owndata and not array.flags.writeable and array.flags.c_contiguous:
        return array  # already read-only memory of its own (another graph's weight): nothing can change it
    if array.dtype.kind not in "fiu" and not is_float(array.dtype):
        raise WeightError(f"{where} has non-numeric dtype {array.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        owned = array.astype(dtype, order="C")
        if array.dtype != dtype:
            lost, reason = _lost_values(array, source, owned)
            if lost.any():
                first = array.reshape(-1)[np.flatnonzero(lost)[0]].item()
                raise WeightError(f"{where}: {np.count_nonzero(lost)} {source} values {reason} (the first: {first!r})")
    owned.setflags(write=False)
    return owned


def _lost_values(array: np.ndarray, source: str, converted: np.ndarray) -> tuple[np.ndarray, str]:
    """Which values of ``array`` (given in dtype ``source``) its conversion did not keep, and why.

    Integers and half-precision floats must convert exactly; float32 and float64 may round to a
    narrower float's nearest value (as every float64 state_dict does), but may not overflow it."""
    dtype = converted.dtype
    inexact = f"cannot be held exactly by {dtype}"
    if is_float(dtype) and is_float(array.dtype):
        if source in ("float32", "float64"):
            return np.isfinite(array) & ~np.isfinite(converted), \
                f"overflow {dtype}, whose largest is {largest_finite(dtype):g}"
        back = converted.astype(array.dtype)
        return (back != array) & ~(np.isnan(array) & np.isnan(back)), inexact
    if is_float(dtype):  # from integers: kept if the float is in the integers' range and converts back to them
        wide = converted.astype(np.float64)  # every float16 and float32 value, and the range's bounds, exactly
        low, high = _integer_range(array.dtype)
        kept = np.isfinite(wide) & (wide >= low) & (wide < high)
        kept &= np.where(kept, wide, 0).astype(array.dtype) == array
        return ~kept, inexact
    if is_float(array.dtype):  # to integers: whole numbers in their range
        wide = array.astype(np.float64)
        low, high = _integer_range(dtype)
        return ~(np.isfinite(wide) & (np.trunc(wide) == wide) & (wide >= low) & (wide < high)), inexact
    info = np.iinfo(dtype)
    return (array < info.min) | (array > info.max), inexact  # numpy compares with Python ints exactly


def _integer_range(dtype: np.dtype) -> tuple[float, float]:
    """An integer dtype's range as [low, high) in float64, whose bounds are powers of two that
    float64 holds exactly (it cannot hold int64's largest value, 2**63 - 1, but holds 2**63)."""
    info = np.iinfo(dtype)
    return float(info.min), 2.0 ** (info.bits - 1 if info.min < 0 else info.bits)


def _short_list(names: list[str], limit: int = 5) -> str:
    head = ", ".join(repr(n) for n in names[:limit])
    return head + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _infer_scan(scan: Scan, in_specs: list[TensorSpec]) -> list[tuple[tuple[int, ...], str]]:
    """Check a scan's bindings against its body and return its outputs' (shape, dtype)."""
    body = scan.body
    where = f"scan {scan.name!r}"
    if scan.length < 1:
        raise GraphError(f"{where}: length must be >= 1, got {scan.length}")
    outer = {s.name: s for s in in_specs}
    body_inputs = {s.name: s for s in body.inputs}
    bound = [c[0] for c in scan.carry] + [x[0] for x in scan.xs] + [v[0] for v in scan.invariants]
    if sorted(bound) != sorted(body_inputs):
        raise GraphError(
            f"{where}: body inputs {sorted(body_inputs)} must each be bound once as carry, xs or "
            f"invariant; bound: {sorted(bound)}"
        )
    bound_params = [p[0] for p in scan.params]
    if sorted(bound_params) != sorted(body.params):
        raise GraphError(f"{where}: body parameters {sorted(body.params)} must each be bound; bound: {sorted(bound_params)}")

    def expect(name: str, shape, dtype, what: str):
        spec = outer[name]
        if spec.shape != tuple(shape) or spec.dtype != dtype:
            raise GraphError(f"{where}: {what} {name!r} is {spec.dtype}{list(spec.shape)}, expected {dtype}{list(shape)}")

    for body_in, body_out, init, _ in scan.carry:
        spec = body_inputs[body_in]
        out_spec = body.tensors.get(body_out)
        if body_out not in body.outputs or out_spec is None:
            raise GraphError(f"{where}: carry output {body_out!r} is not an output of the body")
        if (out_spec.shape, out_spec.dtype) != (spec.shape, spec.dtype):
            raise GraphError(f"{where}: carry {body_in!r} is {spec.dtype}{list(spec.shape)} but the body returns {out_spec}")
        expect(init, spec.shape, spec.dtype, "initial carry")
    for body_in, seq in scan.xs:
        spec = body_inputs[body_in]
        expect(seq, (scan.length,) + spec.shape, spec.dtype, "scanned input")
    for body_in, name in scan.invariants:
        spec = body_inputs[body_in]
        expect(name, spec.shape, spec.dtype, "invariant input")
    for body_param, names in scan.params:
        spec = body.params[body_param]
        if len(names) != scan.length:
            raise GraphError(f"{where}: parameter {body_param!r} is bound to {len(names)} weights, expected {scan.length}")
        for name in names:
            expect(name, spec.shape, spec.dtype, f"weight for {body_param!r}")
        if len(set(names)) > 1:  # stacked into one (length, *shape) weight at compile time: it must be indexable
            TensorSpec(f"{scan.name}/{body_param}", (scan.length,) + spec.shape, spec.dtype)
    outputs = [(body_inputs[c[0]].shape, body_inputs[c[0]].dtype) for c in scan.carry]
    for body_out, _ in scan.ys:
        if body_out not in body.outputs:
            raise GraphError(f"{where}: scanned output {body_out!r} is not an output of the body")
        spec = body.tensors[body_out]
        outputs.append(((scan.length,) + spec.shape, spec.dtype))
    return outputs


class GraphBuilder:
    """Builds a ``Graph`` op by op, checking each op as it is added.

    >>> b = GraphBuilder("mlp")
    >>> x = b.input("x", (1, 4))
    >>> w = b.param("fc.weight", np.ones((3, 4), "float32"))
    >>> y = b.op("dense", x, w)
    >>> g = b.build(y)
    """

    def __init__(self, name: str):
        self.name = name
        self._inputs: list[TensorSpec] = []
        self._params: list[TensorSpec] = []
        self._weights: dict[str, np.ndarray] = {}
        self._ops: list[Op | Scan] = []
        self._specs: dict[str, TensorSpec] = {}
        self._counter = 0

    def _fresh(self, base: str) -> str:
        while True:
            self._counter += 1
            name = f"{base}_{self._counter}"
            if name not in self._specs:
                return name

    def _add_spec(self, spec: TensorSpec):
        if spec.name in self._specs:
            raise GraphError(f"graph {self.name!r}: tensor {spec.name!r} is defined twice")
        self._specs[spec.name] = spec

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise GraphError(f"graph {self.name!r}: no tensor named {name!r}") from None

    def input(self, name: str, shape: Iterable[int], dtype: str = "float32") -> str:
        spec = TensorSpec(name, shape, dtype)
        self._add_spec(spec)
        self._inputs.append(spec)
        return name

    def param(self, name: str, value, dtype: str | None = None) -> str:
        """A parameter from an array, numpy or torch (top-level graphs), or a shape (scan bodies).
        The array is copied when the graph is built (``Graph`` owns its weights)."""
        if _is_array(value):
            array, _ = _weight_array(value, f"weight {name!r} of {self.name!r}")
            spec = TensorSpec(name, array.shape, dtype or str(array.dtype))
            self._weights[name] = value
        else:
            spec = TensorSpec(name, value, dtype or "float32")
        self._add_spec(spec)
        self._params.append(spec)
        return name

    def op(self, kind: str, *inputs: str, name: str | None = None, n_outputs: int | None = None, **attrs):
        """Add an op; returns its output name (or a tuple of names for several outputs)."""
        in_specs = [self.spec(n) for n in inputs]
        base = name or kind
        out_specs = _infer_outputs(kind, in_specs, attrs, base)
        if n_outputs is not None and n_outputs != len(out_specs):
            raise GraphError(f"op {base!r} ({kind}) produces {len(out_specs)} outputs, not {n_outputs}")
        if len(out_specs) == 1:
            names = [name or self._fresh(kind)]
        else:
            stem = name or self._fresh(kind)
            names = [f"{stem}.{i}" for i in range(len(out_specs))]
        for n, (shape, dtype) in zip(names, out_specs):
            self._add_spec(TensorSpec(n, shape, dtype))
        self._ops.append(Op(kind, tuple(inputs), tuple(names), dict(attrs)))
        return names[0] if len(names) == 1 else tuple(names)

    def scan(
        self,
        body: Graph,
        length: int,
        *,
        name: str | None = None,
        carry: Sequence[tuple[str, str, str]] = (),
        xs: Sequence[tuple[str, str]] = (),
        ys: Sequence[str] = (),
        invariants: Sequence[tuple[str, str]] = (),
        params: Mapping[str, Sequence[str]] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Add a scan. ``carry`` is (body input, body output, outer init); ``ys`` are body
        outputs to stack. Returns (final carry names, stacked output names)."""
        stem = name or self._fresh("scan")
        carry4 = tuple((bi, bo, init, f"{stem}.{bi}") for bi, bo, init in carry)
        ys2 = tuple((bo, f"{stem}.{bo}") for bo in ys)
        scan = Scan(
            stem, body, length, carry4, tuple(xs), ys2, tuple(invariants),
            tuple((p, tuple(names)) for p, names in (params or {}).items()),
        )
        in_specs = [self.spec(n) for n in scan.inputs]
        for n, (shape, dtype) in zip(scan.outputs, _infer_scan(scan, in_specs)):
            self._add_spec(TensorSpec(n, shape, dtype))
        self._ops.append(scan)
        return [c[3] for c in carry4], [y[1] for y in ys2]

    def build(self, *outputs: str) -> Graph:
        if len(self._weights) == len(self._params):
            weights = self._weights
        elif not self._weights:
            weights = None
        else:
            raise GraphError(f"graph {self.name!r}: give every parameter an array, or none (a scan body)")
        return Graph(self.name, self._inputs, self._params, self._ops, outputs, weights)
