"""The op registry: op kind -> (shape/dtype rule, TE lowering, ONNX export rule).

Adding an op touches one module: decorate its TE lowering with ``register_op``
and give the rule that checks its inputs and returns its outputs' shapes and
dtypes; right after the lowering, decorate the function that writes the op as
ONNX nodes with ``export_rule``. The graph calls ``infer_outputs`` when it is
built (so a bad graph is refused before anything is compiled), the lowering
calls ``lower_op`` and ``souffle.onnx_export`` calls ``get_export_rule``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from tvm import topi

from souffle.errors import ExportError, GraphError, UnknownOpError
from souffle.tensor import NARROW_FLOATS, TensorSpec

Shape = tuple[int, ...]
InferFn = Callable[[Sequence[TensorSpec], Mapping[str, object]], list[tuple[Shape, str]]]
LowerFn = Callable[..., object]
ExportFn = Callable[..., None]


class OpRuleError(GraphError):
    """Raised by an infer rule; ``infer_outputs`` adds which op it was."""


def fail(message: str):
    """Refuse an op's inputs or attributes with a reason."""
    raise OpRuleError(message)


@dataclass(frozen=True)
class OpRule:
    """What the registry knows of one op kind; ``export`` is None for an op with no ONNX form."""

    kind: str
    infer: InferFn
    lower: LowerFn
    n_inputs: tuple[int, int]
    attrs: Mapping[str, object] = field(default_factory=dict)
    doc: str = ""
    export: ExportFn | None = None
    widen: bool = False  # given float16 or bfloat16, computes in float32 and rounds its outputs (``lower_op``)


REGISTRY: dict[str, OpRule] = {}


def register_op(kind: str, *, infer: InferFn, n_inputs: int | tuple[int, int], attrs: Mapping[str, object] | None = None,
                widen: bool = False):
    """Register ``lower(inputs: list[te.Tensor], **attrs) -> te.Tensor | list[te.Tensor]``.

    ``attrs`` lists the attributes the op accepts with their defaults; any other
    attribute is refused. ``infer(specs, attrs)`` sees attrs with defaults filled in.
    ``widen``: an op whose float16 or bfloat16 arithmetic would lose the answer (a sum of many
    terms, exp, a normalization) is lowered in float32 from such inputs and its outputs rounded
    back to their dtype.
    """
    bounds = (n_inputs, n_inputs) if isinstance(n_inputs, int) else tuple(n_inputs)

    def decorate(lower: LowerFn) -> LowerFn:
        if kind in REGISTRY:
            raise ValueError(f"op {kind!r} is registered twice")
        REGISTRY[kind] = OpRule(kind, infer, lower, bounds, dict(attrs or {}), (lower.__doc__ or "").strip(),
                                widen=widen)
        return lower

    return decorate


def export_rule(kind: str):
    """Register ``export(e, inputs, outputs, attrs)``, which appends to ``e`` (a
    ``souffle.onnx_export.Emitter``) the ONNX nodes that compute op ``kind``: ``inputs`` and
    ``outputs`` are ONNX value names, ``attrs`` has the op's defaults filled in.

    It is written from the op's TE lowering, the ground truth of the op's semantics, and sits
    right after it. It only calls the emitter's methods, so ``souffle.ops`` needs no onnx.
    """
    if kind not in REGISTRY:
        raise ValueError(f"op {kind!r} is not registered; nothing to export")

    def decorate(export: ExportFn) -> ExportFn:
        if REGISTRY[kind].export is not None:
            raise ValueError(f"op {kind!r} has two ONNX export rules")
        REGISTRY[kind] = replace(REGISTRY[kind], export=export)
        return export

    return decorate


def get_rule(kind: str) -> OpRule:
    try:
        return REGISTRY[kind]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownOpError(f"unknown op {kind!r}; registered ops: {known}") from None


def get_export_rule(kind: str, output: str) -> ExportFn:
    """Op ``kind``'s export rule; without one, an ExportError naming the op by ``output`` (the
    tensor it computes) and listing the kinds that can be exported."""
    export = get_rule(kind).export
    if export is None:
        exportable = sorted(k for k, rule in REGISTRY.items() if rule.export is not None)
        raise ExportError(
            f"op {kind!r} (output {output!r}) has no ONNX export rule; rules exist for: {', '.join(exportable)}"
        )
    return export


def full_attrs(rule: OpRule, attrs: Mapping[str, object], where: str) -> dict[str, object]:
    unknown = sorted(set(attrs) - set(rule.attrs))
    if unknown:
        accepted = ", ".join(sorted(rule.attrs)) or "none"
        raise GraphError(f"{where}: unknown attribute(s) {unknown} for {rule.kind} (accepted: {accepted})")
    return {**rule.attrs, **attrs}


def infer_outputs(kind: str, in_specs: Sequence[TensorSpec], attrs: Mapping[str, object], name: str) -> list[tuple[Shape, str]]:
    """Check an op's inputs and attributes; return each output's (shape, dtype)."""
    rule = get_rule(kind)
    where = f"op {name!r} ({kind})"
    lo, hi = rule.n_inputs
    if not lo <= len(in_specs) <= hi:
        expected = str(lo) if lo == hi else f"{lo} to {hi}"
        raise GraphError(f"{where} takes {expected} inputs, got {len(in_specs)}")
    full = full_attrs(rule, attrs, where)
    try:
        outputs = rule.infer(in_specs, full)
    except OpRuleError as err:
        inputs = ", ".join(str(s) for s in in_specs)
        raise GraphError(f"{where}: {err} (inputs: {inputs})") from None
    return [(tuple(int(d) for d in shape), dtype) for shape, dtype in outputs]


def lower_op(kind: str, inputs: Sequence[object], attrs: Mapping[str, object]) -> list[object]:
    """The op's TE tensors for the given TE inputs, always as a list."""
    rule = get_rule(kind)
    inputs = list(inputs)
    narrow = next((_dtype(t) for t in inputs if _dtype(t) in NARROW_FLOATS), None) if rule.widen else None
    if narrow:
        inputs = [topi.cast(t, "float32") if _dtype(t) in NARROW_FLOATS else t for t in inputs]
    out = rule.lower(inputs, **full_attrs(rule, attrs, f"op {kind}"))
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    return [topi.cast(t, narrow) if narrow and _dtype(t) == "float32" else t for t in out]


def _dtype(tensor) -> str | None:
    return str(tensor.dtype) if hasattr(tensor, "dtype") else None
