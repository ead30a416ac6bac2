"""The op registry: op kind -> (shape/dtype rule, TE lowering).

Adding an op touches one module: decorate its TE lowering with ``register_op``
and give the rule that checks its inputs and returns its outputs' shapes and
dtypes. The graph calls ``infer_outputs`` when it is built (so a bad graph is
refused before anything is compiled) and the lowering calls ``lower_op``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from souffle.errors import GraphError, UnknownOpError
from souffle.tensor import TensorSpec

Shape = tuple[int, ...]
InferFn = Callable[[Sequence[TensorSpec], Mapping[str, object]], list[tuple[Shape, str]]]
LowerFn = Callable[..., object]


class OpRuleError(GraphError):
    """Raised by an infer rule; ``infer_outputs`` adds which op it was."""


def fail(message: str):
    """Refuse an op's inputs or attributes with a reason."""
    raise OpRuleError(message)


@dataclass(frozen=True)
class OpRule:
    kind: str
    infer: InferFn
    lower: LowerFn
    n_inputs: tuple[int, int]
    attrs: Mapping[str, object] = field(default_factory=dict)
    doc: str = ""


REGISTRY: dict[str, OpRule] = {}


def register_op(kind: str, *, infer: InferFn, n_inputs: int | tuple[int, int], attrs: Mapping[str, object] | None = None):
    """Register ``lower(inputs: list[te.Tensor], **attrs) -> te.Tensor | list[te.Tensor]``.

    ``attrs`` lists the attributes the op accepts with their defaults; any other
    attribute is refused. ``infer(specs, attrs)`` sees attrs with defaults filled in.
    """
    bounds = (n_inputs, n_inputs) if isinstance(n_inputs, int) else tuple(n_inputs)

    def decorate(lower: LowerFn) -> LowerFn:
        if kind in REGISTRY:
            raise ValueError(f"op {kind!r} is registered twice")
        REGISTRY[kind] = OpRule(kind, infer, lower, bounds, dict(attrs or {}), (lower.__doc__ or "").strip())
        return lower

    return decorate


def get_rule(kind: str) -> OpRule:
    try:
        return REGISTRY[kind]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownOpError(f"unknown op {kind!r}; registered ops: {known}") from None


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
    out = rule.lower(list(inputs), **full_attrs(rule, attrs, f"op {kind}"))
    return list(out) if isinstance(out, (list, tuple)) else [out]
